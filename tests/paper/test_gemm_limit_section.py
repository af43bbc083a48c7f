"""paper.sections.gemm_limit: the table and the macros from result files (seeded random times), and the placeholders
without them."""

from __future__ import annotations

import json
import random
import re

import pytest

from paper.latex import NM, Document
from paper.sections import gemm_limit
from paper.sections.linear import MID_FACTOR

PARTS = [p for p, _ in gemm_limit.PARTS]


def _payload(seed: int, ms=(128, 256, 512), waits=None) -> dict:
    rng = random.Random(seed)
    n, k = gemm_limit.SHAPE
    rows = [{"N": n, "K": k, "M": m, "part": part, "graph_us": round(rng.uniform(10, 400), 3)}
            for m in ms for part in PARTS]
    rows.append({"N": 4096, "K": 4096, "M": 512, "part": "production", "graph_us": 1.0})  # another weight: ignored
    sass = [{"M": 256, "production": {"loop_instructions": 298, "wgmma_waits": waits or {"0": 1, "3": 4}},
             "probe: lookup": {"loop_instructions": 297, "wgmma_waits": {"0": 1, "3": 4}},
             gemm_limit.OLD_STORE: {"loop_instructions": 297, "wgmma_waits": {"0": 4},
                                    "wgmma_serialized": "non wgmma instructions defining accumulator registers"},
             "probe: no lookup": {"loop_instructions": 210}, "probe: dense operand": {"loop_instructions": 103}}]
    return {"env": {"commit": "abcdef123", "device": "GPU"}, "rows": rows, "sass": sass}


def _build(tmp_path, payloads: dict):
    (tmp_path / "linear").mkdir()
    for tag, payload in payloads.items():
        (tmp_path / "linear" / f"gemm_limit_{tag}.json").write_text(json.dumps(payload))
    doc = Document(tmp_path)
    gemm_limit.build(doc, gemm_limit.load(doc))
    macros = dict(re.findall(r"\\newcommand\{\\(NF[A-Za-z]+)\}\{(.*)\}", doc.macros_tex()))
    return doc, macros


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.rstrip("\\ ").split("&")] for line in table.splitlines() if "&" in line]


@pytest.mark.parametrize("seed", [11, 12])
def test_table_and_macros_come_from_the_rows(tmp_path, seed):
    payloads = {"h100": _payload(seed), "h200": _payload(seed + 100, ms=(256, 512))}
    doc, macros = _build(tmp_path, payloads)
    table = doc.files["gemm_limit_table.tex"]
    head, *body = _cells(table)
    assert head[1:] == [f"H100 $M{{=}}{m}$" for m in (128, 256, 512)] + [f"H200 $M{{=}}{m}$" for m in (128, 256, 512)]
    times = {tag: {(r["M"], r["part"]): r["graph_us"] for r in p["rows"] if r["N"] == gemm_limit.SHAPE[0]}
             for tag, p in payloads.items()}
    for line, part in zip(body, PARTS, strict=True):
        want = [f"{times['h100'][(m, part)]:.1f}" for m in (128, 256, 512)]
        want += [f"{times['h200'][(m, part)]:.1f}" if (m, part) in times["h200"] else NM
                 for m in (128, 256, 512)]
        assert line[1:] == want, part
    t = times["h100"]
    m = gemm_limit.SHOWN_M
    assert macros["NFglimProductionHOneHundred"] == f"{t[(m, 'production')]:.1f}"
    assert macros["NFglimStoreCostHOneHundred"] == (
        f"{t[(m, 'probe: lookup, production' + chr(39) + 's store')] / t[(m, 'probe: lookup')]:.2f}")
    old, fixed = t[(m, gemm_limit.OLD_STORE)], t[(m, gemm_limit.FIXED_STORE)]
    assert macros["NFglimSerialCostHOneHundred"] == f"{old / fixed:.2f}"
    assert macros["NFglimDenseOverCublasHOneHundred"] == f"{t[(m, gemm_limit.DENSE_FIXED)] / t[(m, 'cuBLAS')]:.2f}"
    g = gemm_limit.GAIN_M
    assert macros["NFglimGainHOneHundred"] == f"{t[(g, 'nf4.dequantize + cuBLAS')] / t[(g, 'production')]:.2f}"
    assert macros["NFglimGainProductionHTwoHundred"] == f"{times['h200'][(g, 'production')]:.1f}"
    assert macros["NFglimNoLookupOverDequantHOneHundred"] == (
        f"{t[(m, 'probe: no lookup')] / t[(m, 'nf4.dequantize + cuBLAS')]:.2f}")
    assert macros["NFglimBarTimeHOneHundred"] == f"{t[(m, 'nf4.dequantize + cuBLAS')] / MID_FACTOR:.1f}"
    assert macros["NFglimPendingProductionHOneHundred"] == "3" and macros["NFglimPendingLookupHOneHundred"] == "3"
    assert macros["NFglimPendingOldStoreHOneHundred"] == "0" and macros["NFglimPendingDenseFixedHOneHundred"] == NM
    assert macros["NFglimSerialReasonHOneHundred"] == "non wgmma instructions defining accumulator registers"
    assert macros["NFglimLoopNoLookupHTwoHundred"] == "210" and macros["NFglimCommitHTwoHundred"] == "abcdef1"


def test_pending_is_the_deepest_wait_and_missing_files_give_placeholders(tmp_path):
    assert gemm_limit.most_pending({"0": 1, "3": 4}) == 3
    assert gemm_limit.most_pending({"0": 8}) == 0
    assert gemm_limit.most_pending({}) is None and gemm_limit.most_pending(None) is None
    doc = Document(tmp_path)
    gemm_limit.build(doc, gemm_limit.load(doc))
    assert r"\NFmissingbox" in doc.files["gemm_limit_table.tex"]
    assert any("gemm_limit_h100.json" in m for m in doc.missing)
