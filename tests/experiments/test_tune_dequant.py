"""experiments tune-dequant on a CPU: the grid's pruning, the fit on seeded synthetic sweeps (a planted config per size
band recovered, ties to the simpler config, held-out rows never changing the table), the written table read by
nf4.dequant.tuned's own loader, the report's ratios against values computed here, the budgeted sweep loop with a fake
clock, the estimate, and the GPU-only exit that writes nothing."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import catalog as cat
from experiments import tune_dequant as td
from nf4.dequant.config import DequantConfig

ROOT = Path(__file__).resolve().parents[2]
KEYS = [td.config_key(f) for f in td.grid()]
FIELDS = {td.config_key(f): f for f in td.grid()}
SHAPES = [(s.n, s.k) for s in cat.catalog()]
DTYPES = ("bfloat16", "float16")
H100 = "NVIDIA H100 80GB HBM3"
# planted: bands of output bytes (limit or None) and the config that is best in each
PLANTED = ((1 << 24, "t1024_w4_p0"), (1 << 27, "t512_w2_p8"), (None, "t2048_w8_p0"))


def _planted_key(out_bytes: int, planted=PLANTED) -> str:
    return next(key for limit, key in planted if limit is None or out_bytes <= limit)


def _rows(seed: int, planted=PLANTED, shapes=SHAPES, noise: float = 0.002, copies=None) -> list[dict]:
    """Sweep rows: the planted config at the byte floor x 1.1 (plus noise), every other config 3-60% slower;
    copies: key -> key whose times a config repeats exactly."""
    rng = random.Random(seed)
    rows = []
    for n, k in shapes:
        for dtype in DTYPES:
            out = n * k * 2
            floor = td.timing.nf4_bytes(n * k, 64, 2) / 3000e3
            best = _planted_key(out, planted)
            configs = {}
            for key in KEYS:
                factor = 1.0 if key == best else rng.uniform(1.03, 1.6)
                configs[key] = {"us": floor * 1.1 * factor * (1 + rng.uniform(0, noise)), "exact": True,
                                "mismatches": 0}
            for key, source in (copies or {}).items():
                configs[key] = dict(configs[source])
            configs[td.TODAY] = {"us": floor * 1.1 * rng.uniform(1.0, 1.3), "exact": True, "mismatches": 0}
            rows.append({"N": n, "K": k, "dtype": dtype, "subset": cat.subset(n, k), "weights": n * k,
                         "out_bytes": out, "bytes": td.timing.nf4_bytes(n * k, 64, 2), "floor_us": floor,
                         "configs": configs, "today_key": "t1024_w4_p0"})
    return rows


def _sweep_file(path: Path, rows: list[dict], device: str = H100, grid=None) -> Path:
    payload = {"op": td.OP, "device": device, "gpu": td.gpu_key(device), "sm_count": 132, "copy_gbs": 3000.0,
               "grid": grid or FIELDS, "rows": rows, "complete": True}
    path.write_text(json.dumps(payload))
    return path


def _fit(tmp_path, rows, name="sweep.json", table="tuned.json", **kw):
    sweep = _sweep_file(tmp_path / name, rows)
    report = td.fit([sweep], tmp_path / table, tmp_path / "report.json", log=lambda *a, **k: None, **kw)
    return report, (tmp_path / table).read_text()


# --- the grid ------------------------------------------------------------------------------------


def test_grid_prunes_to_the_stated_rule():
    raw = list(itertools.product(td.TILE_BYTES, td.NUM_WARPS, (0, *td.PERSISTENT)))
    kept = {(f["tile_bytes"], f["num_warps"], f["programs_per_sm"]) for f in td.grid()}
    assert len(raw) == 80 and len(kept) == td.GRID_SIZE == 28
    for tile, warps, pps in raw:
        words = tile / 4 / (32 * warps)
        ok = 1 <= words <= 16 and (pps == 0 or (16 <= pps * warps <= 64 and words <= 2))
        assert ((tile, warps, pps) in kept) == ok, (tile, warps, pps)
        assert (td.prune_reason(tile, warps, pps) is None) == ok
    assert sum(pps == 0 for _, _, pps in kept) == 16
    assert "32 words" in td.prune_reason(4096, 1, 0) and "0.5 words" in td.prune_reason(256, 4, 0)
    assert "resident warps" in td.prune_reason(512, 2, 2)
    for f in td.grid():
        assert DequantConfig(**f).tile_bytes == f["tile_bytes"]  # every candidate is a valid config
    # today's table rows are grid configs, so the sweep's "today" time has a grid twin
    today = json.loads((ROOT / "nf4/dequant/tuned.json").read_text())
    for entry in today["gpus"].values():
        for _, fields in entry["rows"]:
            assert td.config_key({"programs_per_sm": 0, **fields}) in KEYS
    assert len(set(KEYS)) == len(KEYS)


def test_gpu_key_and_thresholds():
    assert td.gpu_key(H100) == "H100" and td.gpu_key("NVIDIA H200") == "H200"
    assert td.gpu_key("NVIDIA A100-SXM4-80GB") == "A100" and td.gpu_key("Some GPU") == "Some GPU"
    assert td._threshold(1 << 24, (1 << 24) + 1) == 1 << 24
    assert td._threshold(3 << 20, 3 << 22) == 1 << 23  # 2**22 and 2**23 lie between; 2**23 is nearer the middle
    assert td._threshold(5, 6) is None
    assert td.human_bytes(1 << 25) == "32 MiB" and td.human_bytes(1 << 30) == "1 GiB"


def test_the_fit_subsets_estimate_fits_the_budget():
    fit = [(s.n, s.k) for s in cat.fit_shapes()]
    for gbs in (2500.0, 3000.0, 4300.0):
        total = td.estimate_s(fit, ["bf16", "fp16"], copy_gbs=gbs) + td.compile_cost_s(td.GRID_SIZE + 1, 2, 8)
        assert 120 < total < 0.8 * td.BUDGET_S, (gbs, total)


def test_shape_order_is_fit_first_and_round_robin_over_bands():
    cost = {s: random.Random(str(s)).random() for s in SHAPES}
    order = td.shape_order(SHAPES + SHAPES[:5], lambda n, k: cost[(n, k)])
    assert sorted(order) == sorted(SHAPES)
    subsets = [cat.subset(n, k) for n, k in order]
    assert subsets == sorted(subsets, key=lambda s: s != cat.FIT)
    fit = [s for s in order if cat.subset(*s) == cat.FIT]
    bands = sorted({(2 * n * k).bit_length() for n, k in fit})
    assert [(2 * n * k).bit_length() for n, k in fit[:len(bands)]] == bands  # one of each band first
    first = {}
    for s in fit:
        first.setdefault((2 * s[0] * s[1]).bit_length(), s)
    for band, s in first.items():  # the cheapest of its band
        assert cost[s] == min(cost[t] for t in fit if (2 * t[0] * t[1]).bit_length() == band)


# --- the fit -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2026])
def test_fit_recovers_the_planted_config_of_each_band(tmp_path, seed):
    report, _ = _fit(tmp_path, _rows(seed))
    rule = report["gpus"]["H100"]["rule"]
    assert [td.config_key(f) for _, f in rule["rows"]] == [key for _, key in PLANTED]
    assert rule["rows"][-1][0] is None
    for r in _rows(seed):
        if r["subset"] == cat.FIT:
            assert td.config_key(td.rule_config(rule["rows"], r["out_bytes"])) == _planted_key(r["out_bytes"])
    for limit, _ in rule["rows"][:-1]:
        assert limit & (limit - 1) == 0  # powers of two
    assert rule["fit_geomean_ratio"] == pytest.approx(1.0, abs=0.003)


def test_one_config_best_everywhere_gives_one_row(tmp_path):
    report, _ = _fit(tmp_path, _rows(5, planted=((None, "t512_w2_p0"),)))
    assert report["gpus"]["H100"]["rule"]["rows"] == [[None, FIELDS["t512_w2_p0"]]]


def test_ties_go_to_the_simpler_config(tmp_path):
    # equal times: the persistent twin of a one-program-per-tile config, and the reverse planting
    planted = ((1 << 24, "t1024_w4_p0"), (1 << 27, "t512_w2_p8"), (None, "t2048_w8_p0"))
    copies = {"t1024_w4_p8": "t1024_w4_p0", "t1024_w4_p4": "t1024_w4_p0", "t256_w2_p8": "t512_w2_p8",
              "t2048_w8_p2": "t2048_w8_p0", "t4096_w8_p0": "t2048_w8_p0"}
    report, _ = _fit(tmp_path, _rows(3, planted=planted, copies=copies))
    keys = [td.config_key(f) for _, f in report["gpus"]["H100"]["rule"]["rows"]]
    assert keys == ["t1024_w4_p0", "t256_w2_p8", "t2048_w8_p0"]  # the persistent with the smaller tile wins band 2
    # within the tie tolerance (0.1% faster) the simpler still wins; 2% faster wins outright
    rows = [{"configs": {"t512_w2_p0": {"us": 10.0, "exact": True}, "t512_w2_p8": {"us": 10.0 / 1.001, "exact": True},
                         "t1024_w4_p4": {"us": 9.8, "exact": True}}} for _ in range(3)]
    assert td.choose(rows, ["t512_w2_p0", "t512_w2_p8"], FIELDS)[0] == "t512_w2_p0"
    assert td.choose(rows, ["t512_w2_p0", "t512_w2_p8", "t1024_w4_p4"], FIELDS)[0] == "t1024_w4_p4"
    assert td.choose(rows, ["t512_w2_p0", "t512_w2_p8"], FIELDS, tie=0.0)[0] == "t512_w2_p8"


def test_inexact_or_missing_configs_are_never_chosen(tmp_path):
    rows = _rows(11)
    fit_rows = [r for r in rows if r["subset"] == cat.FIT]
    fit_rows[0]["configs"]["t2048_w8_p0"].update(exact=False, us=None, mismatches=3)  # inexact on one fit row
    first_band = next(r for r in fit_rows if r["out_bytes"] <= 1 << 24)
    del first_band["configs"]["t1024_w4_p0"]  # missing on one row of the first band
    report, _ = _fit(tmp_path, rows)
    rule = report["gpus"]["H100"]["rule"]
    chosen = {td.config_key(f) for _, f in rule["rows"]}
    assert "t2048_w8_p0" not in chosen and "t2048_w8_p0" in rule["inexact_on_fit"]
    assert td.config_key(td.rule_config(rule["rows"], first_band["out_bytes"])) != "t1024_w4_p0"


def test_held_out_rows_never_change_the_table(tmp_path):
    rows = _rows(7)
    report, table = _fit(tmp_path, rows)
    rng = random.Random(0)
    changed = json.loads(json.dumps(rows))
    for r in changed:
        if r["subset"] == cat.HELD_OUT:
            for e in r["configs"].values():
                e["us"] *= rng.uniform(0.2, 5.0)
            r["configs"]["t4096_w8_p0"]["us"] = 1e-3  # a config far faster on every held-out row
            r["configs"][_planted_key(r["out_bytes"])].update(exact=False, us=None)
    changed = [r for i, r in enumerate(changed) if r["subset"] == cat.FIT or i % 3]  # and some held-out rows gone
    report2, table2 = _fit(tmp_path, changed)  # the same file name: the same "source"
    assert table2 == table
    assert report2["gpus"]["H100"]["subsets"][cat.HELD_OUT] != report["gpus"]["H100"]["subsets"][cat.HELD_OUT]
    # a fit row's change does change it
    for r in changed:
        if r["subset"] == cat.FIT:
            r["configs"]["t4096_w8_p0"]["us"] = 1e-3
    assert _fit(tmp_path, changed)[1] != table


def test_report_ratios_and_copy_fractions_match_values_computed_here(tmp_path):
    # the rule cannot be exact for every shape: noise of 8% and a planted best that is not a band's everywhere
    rows = _rows(13, noise=0.08)
    rng = random.Random(4)
    for r in rows:
        if rng.random() < 0.3:
            r["configs"]["t512_w4_p4"]["us"] = min(e["us"] for e in r["configs"].values()) * 0.95
    report, _ = _fit(tmp_path, rows)
    rep = report["gpus"]["H100"]
    rule_rows = rep["rule"]["rows"]
    keys = [k for k in KEYS if k not in rep["rule"]["inexact_on_fit"]]
    for subset in (cat.FIT, cat.HELD_OUT):
        ratios, today, copy16 = [], [], []
        for r in rows:
            if r["subset"] != subset:
                continue
            t = r["configs"][td.config_key(td.rule_config(rule_rows, r["out_bytes"]))]["us"]
            best = min(r["configs"][k]["us"] for k in keys)
            ratios.append(t / best)
            today.append(r["configs"][td.TODAY]["us"] / best)
            if r["weights"] >= 16_000_000:
                copy16.append(r["floor_us"] / t)
        s = rep["subsets"][subset]
        assert s["rows"] == len(ratios)
        assert (s["ratio"]["min"], s["ratio"]["median"], s["ratio"]["max"]) == pytest.approx(
            (min(ratios), statistics.median(ratios), max(ratios)), rel=1e-12)
        assert s["ratio"]["geomean"] == pytest.approx(math.exp(statistics.fmean(map(math.log, ratios))), rel=1e-12)
        assert s["today_ratio"]["median"] == pytest.approx(statistics.median(today), rel=1e-12)
        assert s["copy_fraction_16m"]["min"] == pytest.approx(min(copy16), rel=1e-12)
        assert s["catalog_shapes_missing"] == 0
    fit_med, held_med = rep["subsets"][cat.FIT]["ratio"]["median"], rep["subsets"][cat.HELD_OUT]["ratio"]["median"]
    assert rep["bars"]["held_out_median_ok"] == (held_med <= fit_med * 1.03)
    below = [s for s in rep["shapes"] if s["weights"] >= 16_000_000 and s["copy_fraction"] < 0.9]
    assert len(rep["bars"]["copy_below_bar"]) == len(below) and rep["bars"]["copy_ok"] == (not below)
    assert len(rep["shapes"]) == len(rows)


def test_two_gpus_and_duplicate_rows(tmp_path):
    a = _sweep_file(tmp_path / "h100.json", _rows(1))
    b = _sweep_file(tmp_path / "h200.json", _rows(2, planted=((None, "t512_w2_p0"),)), device="NVIDIA H200")
    report = td.fit([a, b], tmp_path / "t.json", tmp_path / "r.json", log=lambda *x, **k: None)
    assert set(report["gpus"]) == {"H100", "H200"}
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["gpus"]["H200"]["rows"] == [[None, FIELDS["t512_w2_p0"]]]
    assert table["gpus"]["H100"]["source"] == [str(a)]  # outside the repository: the path as given
    dup = _sweep_file(tmp_path / "again.json", _rows(1)[:3])
    with pytest.raises(ValueError, match="is in"):
        td.load_sweeps([a, dup])
    assert td.main(["fit", str(a), str(dup), "--out-table", str(tmp_path / "x.json"),
                    "--report", str(tmp_path / "xr.json")]) == 1
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "other.json").write_text(json.dumps({"op": "dequant", "rows": []}))
    with pytest.raises(ValueError, match="not a tune-dequant sweep"):
        td.load_sweeps([tmp_path / "other.json"])


def _load_with_the_product_loader(tmp_path, table: Path, name: str):
    """nf4/dequant/tuned.py itself, run on `table`: copied into a package whose config is nf4's."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from nf4.dequant.config import DequantConfig\n")
    shutil.copy(ROOT / "nf4/dequant/tuned.py", pkg / "tuned.py")
    shutil.copy(table, pkg / "tuned.json")
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(f"{name}.tuned")
    finally:
        sys.path.remove(str(tmp_path))


def test_the_written_table_loads_with_nf4s_loader_and_keeps_other_gpus(tmp_path):
    table = tmp_path / "tuned.json"
    shutil.copy(ROOT / "nf4/dequant/tuned.json", table)  # a copy: the repository's table is never written
    before = json.loads(table.read_text())
    sweep = _sweep_file(tmp_path / "sweep.json", _rows(21))
    assert td.main(["fit", str(sweep), "--out-table", str(table), "--report", str(tmp_path / "rep.json")]) == 0
    data = json.loads(table.read_text())
    assert data["default_gpu"] == before["default_gpu"] and data["gpus"]["H200"] == before["gpus"]["H200"]
    entry = data["gpus"]["H100"]
    assert entry["source"] == [str(sweep)] and "fit-subset" in entry["why"] and "held-out" in entry["why"]
    loaded = _load_with_the_product_loader(tmp_path, table, "tuned_check_a")
    for gpu, rows in loaded.TUNED.items():
        assert all(isinstance(c, DequantConfig) for _, c in rows) and rows[-1][0] is None, gpu
    for r in _rows(21):
        if r["subset"] == cat.FIT:
            got = loaded.tuned(H100, r["out_bytes"])
            assert td.config_key(td.grid_fields(got)) == _planted_key(r["out_bytes"])
    assert loaded.tuned("NVIDIA H200", 1 << 20) == DequantConfig(tile_bytes=1024, num_warps=4)
    assert json.loads((tmp_path / "rep.json").read_text())["table_written"] == data
    # a fresh table: only the swept GPU, and it is the default
    fresh = tmp_path / "fresh" / "tuned.json"
    td.fit([sweep], fresh, tmp_path / "rep2.json", log=lambda *a, **k: None)
    assert json.loads(fresh.read_text())["default_gpu"] == "H100"
    assert _load_with_the_product_loader(tmp_path, fresh, "tuned_check_b").DEFAULT_GPU == "H100"


# --- the sweep loop ------------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_sweep_loop_saves_every_shape_and_keeps_to_the_budget(tmp_path):
    clock = _Clock()
    shapes = [(64 * i, 128) for i in range(1, 9)]
    cost = {s: 10.0 for s in shapes}
    cost[shapes[3]] = 200.0  # does not fit once 40 s are spent: skipped, the later ones still run
    out = tmp_path / "s.json"
    seen = []

    def measure(n, k, deadline):
        clock.t += cost[(n, k)] * 1.5  # everything takes 1.5x its estimate
        seen.append((n, k, json.loads(out.read_text())["rows"] if out.exists() else None))
        return [{"N": n, "K": k, "dtype": "bfloat16"}]

    payload = td.sweep(shapes, {"rows": []}, out, measure=measure, cost=lambda n, k: cost[(n, k)], budget_s=100.0,
                       clock=clock, log=lambda *a, **k: None)
    done = [(r["N"], r["K"]) for r in payload["rows"]]
    assert shapes[3] not in done and f"{shapes[3][0]}x128" in payload["skipped"]
    assert clock.t - 1000.0 <= 100.0 and not payload["complete"]
    assert len(done) == 6 and payload["skipped"] == [f"{n}x{k}" for n, k in shapes if (n, k) not in done]
    assert [len(s[2] or []) for s in seen] == list(range(len(seen)))  # the file held every shape before
    assert json.loads(out.read_text())["rows"] == payload["rows"]

    def cut(n, k, deadline):
        if n == 192:
            raise td.OutOfTime
        return [{"N": n, "K": k, "dtype": "bfloat16"}]

    payload = td.sweep(shapes, {"rows": []}, out, measure=cut, cost=lambda n, k: 1.0, budget_s=100.0, clock=clock,
                       log=lambda *a, **k: None)
    assert [r["N"] for r in payload["rows"]] == [64, 128] and "192x128" in payload["stopped"]
    assert payload["skipped"] == [f"{n}x{k}" for n, k in shapes[2:]]
    assert json.loads(out.read_text())["complete"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the exit without a GPU")
def test_cli_without_cuda_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "tune" / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "experiments", "tune-dequant", "sweep", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    assert not out.exists() and not out.parent.exists()
