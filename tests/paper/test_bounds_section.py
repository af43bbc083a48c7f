"""paper.sections.bounds: the table and the macros from result files (seeded random bar lines), and the placeholders
without them."""

from __future__ import annotations

import json
import random
import re

from paper.latex import NM, Document
from paper.sections import bounds

READ, TRITON = "cuBLAS GEMV, the packed bytes' count", "Triton dense GEMM (inductor max-autotune)"
WEIGHTS = ((14336, 4096), (4096, 14336), (4096, 4096))


def _payload(seed: int) -> dict:
    rng = random.Random(seed)
    bars = []
    for n, k in WEIGHTS:
        for m in (1, 128, 256, 512, 1024, 4096):
            bar = "a" if m == 1 else "b" if m <= 128 else "c" if m <= 512 else "d"
            control = READ if bar == "a" else None if bar == "b" else TRITON
            target, nf4_us = rng.uniform(5, 500), rng.uniform(5, 500)
            control_us = rng.uniform(5, 500) if control else None
            int4_us = rng.uniform(5, 500) if m <= 512 else None
            bars.append({"bar": bar, "N": n, "K": k, "M": m, "dtype": "bfloat16", "target_us": target,
                         "nf4_us": nf4_us, "nf4_meets": nf4_us <= target, "control": control,
                         "control_us": control_us,
                         "control_meets": None if control is None else control_us <= target,
                         "int4_us": int4_us, "int4_meets": None if int4_us is None else int4_us <= target})
    bars.append("not a line")
    return {"env": {"commit": "abcdef123", "torch": "2.11.0+cu130"}, "bars": bars, "rows": []}


def _build(tmp_path, payloads: dict):
    (tmp_path / "linear" / "bounds").mkdir(parents=True)
    for tag, payload in payloads.items():
        (tmp_path / "linear" / "bounds" / f"bounds_{tag}.json").write_text(json.dumps(payload))
    doc = Document(tmp_path)
    bounds.build(doc, bounds.load(doc))
    macros = dict(re.findall(r"\\newcommand\{\\(NF[A-Za-z]+)\}\{(.*)\}", doc.macros_tex()))
    return doc, macros


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.rstrip("\\ ").split("&")] for line in table.splitlines() if "&" in line]


def test_table_and_macros_come_from_the_bar_lines(tmp_path):
    payloads = {"h100": _payload(1), "h200": _payload(2)}
    doc, macros = _build(tmp_path, payloads)
    for tag, g in (("h100", "HOneHundred"), ("h200", "HTwoHundred")):
        ls = [b for b in payloads[tag]["bars"] if isinstance(b, dict)]
        i4 = [b for b in ls if b["int4_us"] is not None]
        assert macros[f"NFbndIntLines{g}"] == str(len(i4))
        assert macros[f"NFbndIntMeets{g}"] == str(sum(b["int4_meets"] for b in i4))
        up = next(b for b in ls if (b["N"], b["K"], b["M"]) == (14336, 4096, 1))
        assert [macros[f"NFbnd{n}Up{g}"] for n in ("Target", "Nf", "Int", "Read")] == [
            f"{up[key]:.1f}" for key in ("target_us", "nf4_us", "int4_us", "control_us")]
        assert macros[f"NFbndLines{g}"] == str(len(ls))
        assert macros[f"NFbndNfMeets{g}"] == str(sum(b["nf4_meets"] for b in ls))
        ctrl = [b for b in ls if b["control"]]
        assert macros[f"NFbndControlLines{g}"] == str(len(ctrl))
        assert macros[f"NFbndControlMeets{g}"] == str(sum(b["control_meets"] for b in ctrl))
        assert macros[f"NFbndGapOurs{g}"] == str(sum(b["control_meets"] and not b["nf4_meets"] for b in ctrl))
        a = next(b for b in ls if (b["N"], b["K"], b["M"]) == (4096, 4096, 1))
        assert macros[f"NFbndReadSquare{g}"] == f"{a['control_us']:.1f}"
        assert macros[f"NFbndTargetSquare{g}"] == f"{a['target_us']:.1f}"
        assert macros[f"NFbndCommit{g}"] == "abcdef1"
    body = _cells(doc.files["linear_bounds_table.tex"])[1:]
    assert len(body) == 18
    for cells in body:
        bar, m = cells[0].strip("()"), int(cells[2])
        n, k = (int(v) for v in cells[1].split(r"$\times$"))
        for i, tag in enumerate(("h100", "h200")):
            b = next(x for x in payloads[tag]["bars"] if isinstance(x, dict)
                     and (x["bar"], x["N"], x["K"], x["M"]) == (bar, n, k, m))
            target, nf4_us, control_us, int4_us, meets = cells[4 + 5 * i: 9 + 5 * i]
            assert int4_us == (f"{b['int4_us']:.1f}" if b["int4_us"] is not None else "--")
            assert target == f"{b['target_us']:.1f}" and nf4_us == f"{b['nf4_us']:.1f}"
            yes = {True: "yes", False: "no"}
            if b["control"]:
                assert control_us == f"{b['control_us']:.1f}"
                assert meets == f"{yes[b['nf4_meets']]} / {yes[b['control_meets']]}"
            else:
                assert control_us == "--" and meets == yes[b["nf4_meets"]]


def test_placeholders_without_the_files(tmp_path):
    doc = Document(tmp_path)
    bounds.build(doc, bounds.load(doc))
    assert r"\NFmissingbox" in doc.files["linear_bounds_table.tex"]
    assert any("bounds_h100.json" in m for m in doc.missing)
    macros = dict(re.findall(r"\\newcommand\{\\(NF[A-Za-z]+)\}\{(.*)\}", doc.macros_tex()))
    assert macros["NFbndLinesHOneHundred"] == NM and macros["NFbndReadSquareHTwoHundred"] == NM
    assert macros["NFbndIntUpHTwoHundred"] == NM


def test_one_gpu_leaves_the_other_not_measured(tmp_path):
    _, macros = _build(tmp_path, {"h100": _payload(4)})
    assert macros["NFbndLinesHTwoHundred"] == NM
