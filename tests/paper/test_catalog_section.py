"""paper.sections.catalog: the catalog table, figure and macros from a result file's rows, never typed."""

from __future__ import annotations

import json
import re

from paper import generate
from paper.sections import catalog


def _row(n, k, nf4, floor, bnb, unsloth, exact=True):
    return {"N": n, "K": k, "dtype": "bfloat16", "nf4_us": nf4, "floor_us": floor, "exact": exact,
            "peers_us": {"bnb_dequantize_4bit": bnb, "unsloth_dequantize": unsloth}}


def _payload():
    return {"device": "GPU", "rows": [
        _row(8192, 4096, 10.0, 9.5, 20.0, 9.0),  # 32 Mi weights at 95 % of the floor; slower than Unsloth
        _row(8192, 8192, 20.0, 16.0, 30.0, 22.0),  # 64 Mi weights at 80 %: under the bar
        _row(1024, 1024, 4.0, 1.0, 12.0, 5.0),  # small: not counted for the bar
        _row(4096, 4096, 1.0, 1.0, 100.0, 100.0, exact=False),  # not exact: not counted at all
    ]}


def test_summary_counts_from_rows():
    s = catalog.summary(_payload())
    assert s["rows"] == 3 and s["big"] == (1, 2)
    lo, med, hi, slower, n = s["peers"]["unsloth_dequantize"]
    assert (round(lo, 3), round(med, 3), round(hi, 3), slower, n) == (0.9, 1.1, 1.25, 1, 3)
    assert s["floor"][2] == 4.0


def test_generated_macros_and_table(tmp_path):
    (tmp_path / "catalog").mkdir()
    (tmp_path / "catalog" / "dequant_h100.json").write_text(json.dumps(_payload()))
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    macros = dict(re.findall(r"\\newcommand\{\\(NFcat[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    assert macros["NFcatUnslothSlowerHOneHundred"] == "1" and macros["NFcatBigUnderHOneHundred"] == "1"
    assert macros["NFcatUnslothMedianHTwoHundred"] == generate.NM  # no H200 file
    assert any("dequant_h200.json" in m for m in missing)
    assert "1 of 3" in files["catalog_dequant_table.tex"] and "H200" not in files["catalog_dequant_table.tex"]
    assert files["catalog_dequant_h100.dat"].splitlines()[0] == "weights over"


def test_linear_bars_table_reads_the_files_summary(tmp_path):
    """The linear catalog's bars come from the file's summary (written by the GPU run or `merge`), per GPU."""
    (tmp_path / "catalog").mkdir()
    bars = {"m1_same_bytes": {"rows": 4, "held": 1, "worst": {"value": 2.31}},
            "m17_128_dense": {"rows": 6, "held": 6, "worst": {"value": 1.2}}}
    payload = {"device": "GPU", "rows": [], "summary": {"bars": bars, "inversions": {"count": 7}}}
    (tmp_path / "catalog" / "linear_h200.json").write_text(json.dumps(payload))
    files, _ = generate.generate(tmp_path, generate.CLAIMS)
    table = files["catalog_linear_bars_table.tex"]
    assert "H200: held & worst" in table and "H100" not in table
    assert "1 of 4 & 2.31" in table and "6 of 6 & 1.20" in table and "7 found" in table
    macros = dict(re.findall(r"\\newcommand\{\\(NFcatLinear[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    assert macros["NFcatLinearInversionsHTwoHundred"] == "7"
    assert macros["NFcatLinearInversionsHOneHundred"] == generate.NM
