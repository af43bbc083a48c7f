"""paper.sections.linear_host: the per-linear host-time table and macros from a result file's rows, never typed."""

from __future__ import annotations

import json
import re

from paper import generate
from paper.sections import linear_host


def _row(n, k, m, phase, form, host, jit):
    return {"N": n, "K": k, "M": m, "phase": phase, "form": form, "host_us": host, "jit_host_us": jit}


def _payload(commit="abc1234", scale=1.0):
    rows = []
    for n, k in ((14336, 4096), (1024, 4096)):
        for phase, base in (("forward", 10.0), ("step", 100.0)):
            for form, f in (("F.linear", 1.0), ("bnb", 6.0), ("nf4", 5.0), ("nf4_fused", 3.0), ("dense", 1.5),
                            ("no_matmul", 0.5)):
                rows.append(_row(n, k, 512, phase, form, base * f * scale, 10.0 * scale))
    rows.append(_row(14336, 4096, 1, "step", "nf4_fused", 999.0, 1.0))  # another M: not in the table
    rows.append({"N": 14336, "K": 4096, "M": 512, "phase": "step", "form": "unsloth", "error": "ValueError: x"})
    return {"env": {"commit": commit}, "rows": rows}


def _generate(tmp_path, payloads):
    (tmp_path / "linear").mkdir()
    for tag, payload in payloads.items():
        (tmp_path / "linear" / f"host_{tag}.json").write_text(json.dumps(payload))
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    return dict(re.findall(r"\\newcommand\{\\(NFlinHost[A-Za-z]+)\}\{(.*)\}", files["macros.tex"])), files, missing


def test_ratios_are_taken_against_the_paired_jit_launch(tmp_path):
    # the H200's host is twice as slow and so is its JIT launch: the same multiples
    macros, files, _ = _generate(tmp_path, {"h100": _payload(), "h200": _payload("def5678", scale=2.0)})
    assert macros["NFlinHostM"] == "512" and macros["NFlinHostWeight"] == r"14336$\times$4096"
    assert macros["NFlinHostStepFusedOverDenseHOneHundred"] == "2.00"
    assert macros["NFlinHostStepFusedOverBnbHOneHundred"] == "0.50"
    assert macros["NFlinHostStepFusedOverBnbHTwoHundred"] == "0.50"
    assert macros["NFlinHostCommitHOneHundred"] == "abc1234" and macros["NFlinHostCommitHTwoHundred"] == "def5678"
    table = files["linear_host_table.tex"]
    assert table.index("14336$\\times$4096") < table.index("1024$\\times$4096")  # the largest weight first
    assert "300 (30.0)" in table and "600 (30.0)" in table  # H100 and H200 step of the fused route
    assert "999" not in table and "unsloth" not in table


def test_missing_file_gives_placeholders(tmp_path):
    macros, files, missing = _generate(tmp_path, {"h100": _payload()})
    assert macros["NFlinHostStepFusedOverDenseHTwoHundred"] == generate.NM
    assert any("host_h200.json" in m for m in missing)
    assert "H200" not in files["linear_host_table.tex"]


def test_jit_units_skip_failed_rows():
    units = linear_host.jit_units({"rows": [_row(1, 2, 512, "step", "bnb", 30.0, 10.0),
                                            {"N": 1, "K": 2, "M": 512, "phase": "step", "form": "nf4", "error": "x"},
                                            _row(1, 2, 512, "step", "dense", 5.0, 0.0)]})
    assert units == {(1, 2, 512, "step", "bnb"): 3.0}
