"""paper.sections.decode and the catalog section's bulk-lab table: speedups and macros from a result file's rows."""

from __future__ import annotations

import json
import re

from paper import generate
from paper.sections import catalog, decode


def _row(mode, compiled, ms, share=None, phase="decode", **extra):
    return {"model": "llama3-8b", "layers": 32, "batch": 1, "mode": mode, "compiled": compiled, "phase": phase,
            "ms_per_token": ms, "tokens_per_s": 1000 / ms, "linear_share": share,
            "fullgraph": True if compiled else None, **extra}


def _payload():
    return {"device": "NVIDIA H200", "rows": [
        _row("dense", False, 20.0), _row("dense", True, 6.0), _row("bnb", False, 30.0, 0.5),
        _row("bnb", True, 5.0, 0.6), _row("nf4-fused", False, 29.0, 0.4), _row("nf4-fused", True, 4.0, 0.55),
        _row("nf4-fused", True, 0.01, phase="prefill"),  # not a decode row
        _row("nf4", True, 3.0, error="OutOfMemoryError")]}  # a failed unit has no row


def _macros(files):
    return dict(re.findall(r"\\newcommand\{\\(NF(?:decode|bulk)[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))


def test_summary_speedups_over_dense_and_bnb():
    s = {r["mode"]: r for r in decode.summary(_payload())}
    assert set(s) == {"dense", "bnb", "nf4-fused"}  # the failed nf4 unit is not summarised
    assert s["nf4-fused"]["vs_dense"] == 6.0 / 4.0 and s["nf4-fused"]["vs_bnb"] == 5.0 / 4.0
    assert s["nf4-fused"]["eager_ms"] == 29.0 and s["dense"]["vs_dense"] == 1.0


def test_macros_and_table(tmp_path):
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "decode_h200.json").write_text(json.dumps(_payload()))
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    macros = _macros(files)
    assert macros["NFdecodeFusedVsDenseHTwoHundred"] == "1.50" and macros["NFdecodeFusedVsBnbHTwoHundred"] == "1.25"
    assert macros["NFdecodeFusedMsHTwoHundred"] == "4.00" and macros["NFdecodeFusedLinearShareHTwoHundred"] == "55.0"
    assert macros["NFdecodeFusedVsDenseHOneHundred"] == generate.NM
    assert any("decode_h100.json" in m for m in missing)
    want = "H200 & Llama-3-8B & 1 & nf4, \\code{fused\\_linear} & 29.00 & 4.00 & 1.50 & 1.25 & 55.0 & yes"
    assert want in files["decode_table.tex"]


def test_bulk_ratios_use_each_rows_own_run(tmp_path):
    rows = [{"N": 4096, "K": 4096, "M": 1, "provider": p, "graph_us": us, "same_bytes_us": base}
            for p, us, base in (("t_stream4x2", 5.0, 5.0), ("t_none4x2", 12.0, 6.0),
                                ("dense F.linear [N, K/4]", 5.0, 5.0))]
    rows.append({"N": 4096, "K": 4096, "M": 4, "provider": "t_none4x2", "graph_us": 99.0, "same_bytes_us": 1.0})
    r = catalog.bulk_ratios({"rows": rows})
    assert r == {(4096, 4096): {"t_stream4x2": 1.0, "t_none4x2": 2.0, "dense F.linear [N, K/4]": 1.0}}
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "gemv_bulk_h200.json").write_text(json.dumps({"rows": rows}))
    files, _ = generate.generate(tmp_path, generate.CLAIMS)
    macros = _macros(files)
    assert macros["NFbulkNoneMaxHTwoHundred"] == "2.00" and macros["NFbulkStreamMinHTwoHundred"] == "1.00"
    assert macros["NFbulkPrmtMinHTwoHundred"] == generate.NM


def test_sass_table_and_macros(tmp_path):
    per = {"alu": 0.5, "imad": 1.0, "fp32": 0.25, "shared_wavefronts": 0.75, "lsu": 0.125, "total": 2.5}
    payload = {"environment": {"triton": "3.9.0"},
               "builds": [{"build": "scaled", "registers": 96, "per_weight": per},
                          {"build": "prmt", "error": "did not build"}]}
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "sass_sm90.json").write_text(json.dumps(payload))
    files, _ = generate.generate(tmp_path, generate.CLAIMS)
    macros = dict(re.findall(r"\\newcommand\{\\(NFsass[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    assert macros["NFsassScaledAlu"] == "0.50" and macros["NFsassScaledWavefronts"] == "0.75"
    assert macros["NFsassPrmtAlu"] == generate.NM and macros["NFsassBudget"] == "1.25"
    assert macros["NFsassTriton"] == "3.9.0"
    assert "scaled contract: level pairs & 96 & 0.50 & 1.00 & 0.25 & 0.75 & 0.12 & 2.50" in files["sass_table.tex"]
    assert "prmt table" not in files["sass_table.tex"]  # a build that failed has no row


def test_prefill_macros_are_bitsandbytes_time_over_nf4s():
    from paper.sections import decode

    rows = [{"model": "llama3-8b", "batch": 1, "mode": m, "compiled": c, "phase": "prefill", "ms_per_token": ms}
            for m, c, ms in (("bnb", False, 0.1), ("nf4", False, 0.2), ("bnb", True, 0.06), ("nf4", True, 0.05),
                             ("bnb", True, 9.0))]  # a second prompt length: the first row of a key counts
    pre = decode.prefill({"rows": rows})
    assert pre[("llama3-8b", 1, "nf4", False)] == 0.2 and pre[("llama3-8b", 1, "bnb", True)] == 0.06


def test_prefill_device_ms_reads_the_profiles_sum():
    from paper.sections import decode

    rows = [{"model": "llama3-8b", "batch": 1, "mode": "bnb", "compiled": True, "phase": "prefill", "ms": 36.5,
             "top_kernels": [["(all kernels)", 22113.9], ["kDequantizeBlockwise", 7787.1]]},
            {"model": "llama3-8b", "batch": 1, "mode": "nf4", "compiled": True, "phase": "prefill", "ms": 50.0,
             "top_kernels": None}]
    got = decode.prefill_device_ms({"rows": rows})
    assert got == {("llama3-8b", 1, "bnb", True): (36.5, 22.1139)}


def test_the_shorter_run_gives_its_own_prefill_macros_and_stays_out_of_the_table(tmp_path):
    import json
    import re

    from paper import generate

    (tmp_path / "decode").mkdir()
    rows = [{"model": "llama3-8b", "layers": 8, "batch": 1, "mode": m, "compiled": True, "phase": p,
             "ms_per_token": ms, "ms": 1.0} for m, p, ms in (("bnb", "prefill", 0.06), ("nf4-fused", "prefill", 0.04),
                                                             ("nf4-fused", "decode", 1.0))]
    payload = {"config": {"layers": 8}, "environment": {"commit": "abcdef0123"}, "rows": rows}
    (tmp_path / "decode" / "decode_8layers_h200.json").write_text(json.dumps(payload))
    files, _ = generate.generate(tmp_path, generate.CLAIMS)
    macros = dict(re.findall(r"\\newcommand\{\\(NFshort[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    assert macros["NFshortLayersHTwoHundred"] == "8" and macros["NFshortCommitHTwoHundred"] == "abcdef0"
    assert macros["NFshortPrefillFusedVsBnbHTwoHundred"] == "1.50"
    assert macros["NFshortPrefillPlainVsBnbHTwoHundred"] == generate.NM
    assert "H200" not in files["decode_table.tex"]  # no full-depth file: the shorter run makes no table rows
