"""experiments.labs.config_race on a CPU: the summary (the table's pick over the best raced config) by hand, the
shapes' expansion from the catalog's names, --part, --report, and the refusals before any GPU work."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import catalog as cat
from experiments.labs import config_race as cr


def _row(n, k, m, config, us, mismatches=0, dtype="bfloat16"):
    return {"N": n, "K": k, "M": m, "dtype": dtype, "config": config, "graph_us": us, "operand_mismatches": mismatches}


def test_summary_by_hand():
    rows = [_row(64, 128, 1, "tuned", 10.0), _row(64, 128, 1, "A", 8.0), _row(64, 128, 1, "B", 12.0),  # 1.25
            _row(64, 128, 2, "tuned", 10.0), _row(64, 128, 2, "A", 9.5),  # 1.0526: within 10 %
            _row(64, 128, 4, "tuned", 10.0), _row(64, 128, 4, "A", 11.0),  # the pick is the best: 1.0
            _row(64, 128, 8, "tuned", 10.0), _row(64, 128, 8, "A", 1.0, mismatches=3),  # inexact: not a best
            _row(32, 128, 1, "tuned", 10.0), _row(32, 128, 1, "A", 5.0)]  # another subset: 2.0
    got = cr.summary(rows, fit={(64, 128)})
    fit, held = got["fit"], got["held-out"]
    assert (fit["rows"], fit["within_10pct"]) == (3, 2)
    assert fit["min"] == 1.0 and fit["max"] == pytest.approx(1.25) and fit["median"] == pytest.approx(10 / 9.5)
    assert fit["worst"] == {"N": 64, "K": 128, "M": 1, "dtype": "bfloat16", "ratio": pytest.approx(1.25),
                            "best": "A"}
    assert (held["rows"], held["within_10pct"], held["max"]) == (1, 0, 2.0)
    assert cr.summary(rows)["all"]["rows"] == 4


def test_expand_shapes_takes_catalog_names_and_keeps_each_shape_once():
    shapes = cr.expand_shapes(["fit", "held-out", "64x128", str(cat.catalog()[0].n) + "x" + str(cat.catalog()[0].k)])
    assert len(shapes) == len(cat.catalog()) + 1 and shapes[-1] == (64, 128)
    assert cr.expand_shapes(["all"]) == [(s.n, s.k) for s in cat.catalog()]


def test_report_prints_the_summary(tmp_path, capsys):
    path = tmp_path / "race.json"
    path.write_text(json.dumps({"rows": [_row(64, 128, 1, "tuned", 10.0), _row(64, 128, 1, "A", 8.0)]}))
    assert cr.main(["--report", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["held-out"]["rows"] == 1 and printed["held-out"]["within_10pct"] == 0


@pytest.mark.parametrize("argv", [["--ms", "1"], ["--configs", "NOPE"], ["--configs", "GEMV_MMA_WK", "--part", "2/2"],
                                  ["--configs", "GEMV_MMA_WK", "--shapes", "12x"]])
def test_bad_arguments_are_refused_before_any_gpu_work(argv):
    with pytest.raises(SystemExit) as exc:
        cr.main(argv)
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_no_gpu_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "race.json"
    assert cr.main(["--configs", "GEMV_MMA_WK", "--shapes", "fit", "--part", "1/4", "--out", str(out)]) == 2
    assert not out.exists()


def test_summary_with_a_pick_and_one_launch_best_by_hand():
    rows = [_row(64, 128, 1, "tuned", 10.0), _row(64, 128, 1, "A", 8.0), _row(64, 128, 1, "GEMV_MMA16", 4.0),
            _row(64, 128, 16, "tuned", 10.0), _row(64, 128, 16, "A", 12.0), _row(64, 128, 16, "GEMV_MMA16", 5.0)]
    # the timed table against every raced config, and against the one-launch ones at M <= 8 (GEMV_MMA16 splits K)
    assert cr.summary(rows)["all"]["max"] == pytest.approx(2.5)
    got = cr.summary(rows, single=True)["all"]
    assert got["rows"] == 2 and got["worst"]["M"] == 16 and got["min"] == pytest.approx(1.25)
    # another commit's pick, judged from the raced configs' own times; a pick that was not raced is left out
    got = cr.summary(rows, pick=lambda n, k, m: "A" if m == 1 else "GEMV_MMA16", single=True)["all"]
    assert (got["rows"], got["within_10pct"], got["max"]) == (2, 2, 1.0)
    assert cr.summary(rows, pick=lambda n, k, m: "B") == {}


def test_inversions_by_hand():
    rows = [_row(64, 128, 1, "tuned", 10.0), _row(64, 128, 4, "tuned", 9.8),  # 2 % faster: not an inversion
            _row(64, 128, 8, "tuned", 9.0),  # faster than M = 1 and M = 4 by more than 3 %: two
            _row(64, 128, 16, "tuned", 20.0), _row(64, 128, 32, "tuned", 1.0),  # M = 32 is past the bar's range
            _row(64, 128, 1, "A", 1.0), _row(64, 128, 8, "A", 2.0)]
    assert cr.inversions(rows) == {"pairs": 6, "inversions": 2}
    assert cr.inversions(rows, pick=lambda n, k, m: "A") == {"pairs": 1, "inversions": 0}


def test_report_current_judges_this_commits_table(tmp_path, capsys):
    from nf4.linear import tuned

    h100 = "NVIDIA H100 80GB HBM3"
    pick = tuned.NAMES[tuned.tuned(h100, 1, n=64, k=896)]
    path = tmp_path / "race.json"
    path.write_text(json.dumps({"device": h100, "rows": [_row(64, 896, 1, "tuned", 10.0), _row(64, 896, 1, pick, 5.0),
                                                          _row(64, 896, 1, "OTHER", 6.0)]}))
    assert cr.main(["--report", str(path), "--current"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["timed_table"]["vs_one_launch"]["fit"]["max"] == pytest.approx(2.0)  # 64 x 896: a fit shape
    assert printed["current_table"]["vs_one_launch"]["fit"]["max"] == 1.0
