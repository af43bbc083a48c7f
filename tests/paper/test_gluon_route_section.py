"""paper.sections.gluon_route: the routed Gluon GEMM's table and macros from a judged file, never typed."""

from __future__ import annotations

import json
import re

from paper import generate
from paper.sections import gluon_route


def _sub(subset, routed, med, worst, slower, dense, not_exact=0, m=128, dtype="bfloat16"):
    return {"dtype": dtype, "M": m, "subset": subset, "routed": routed, "not_exact": not_exact,
            "median_over_table": med, "worst_over_table": worst, "slower_than_table_3pct": slower,
            "median_over_dense": dense, "faster_than_dense": 0}


def _payload():
    return {"device": "GPU", "slower_threshold": 1.03, "judged": [
        {"source": "race", "shapes": 10, "rows": [
            _sub("fit", 6, 0.7, 1.1, 1, 1.2), _sub("held-out", 3, 0.8, 1.0, 0, 1.3),
            _sub("fit", 2, 0.9, 0.95, 0, 1.4, m=256)]},
        {"source": "product", "shapes": 5, "rows": [_sub("held-out", 2, None, None, 0, None, not_exact=2)]}]}


def test_cells_keep_subsets_apart():
    cs = gluon_route.cells(_payload())
    assert [(c["source"], c["M"]) for c in cs] == [("race", 128), ("race", 256), ("product", 128)]
    a = cs[0]
    assert (a["routed"], a["fit"], a["held_out"], a["worst"], a["slower"], a["dense"]) == (9, 0.7, 0.8, 1.1, 1, 1.2)
    assert cs[1]["held_out"] is None and cs[2]["not_exact"] == 2 and cs[2]["worst"] is None


def test_generated_macros_and_table(tmp_path):
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "gluon_rule_judged_h200.json").write_text(json.dumps(_payload()))
    files, _ = generate.generate(tmp_path, generate.CLAIMS)
    macros = dict(re.findall(r"\\newcommand\{\\(NFgluonRoute[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    assert macros["NFgluonRouteMedMinHTwoHundred"] == "0.70" and macros["NFgluonRouteMedMaxHTwoHundred"] == "0.90"
    assert macros["NFgluonRouteRowsHTwoHundred"] == "13" and macros["NFgluonRouteNotExactHTwoHundred"] == "2"
    assert macros["NFgluonRouteHeldMinHTwoHundred"] == "0.80" and macros["NFgluonRouteSlowerPct"] == "3"
    assert macros["NFgluonRouteRowsHOneHundred"] == generate.NM
    table = files["gluon_route_table.tex"]
    assert "H200 & race (10) & bfloat16 & 128 & 9 & 0.70 & 0.80 & 1.10 & 1 & 1.20" in table and "H100" not in table
