"""experiments catalog-bench on a CPU: summary() and the inversion bar against values computed here from seeded random
rows, --part splitting, merge (refusing parts of different devices), the byte floors, the argument parsers, and the
GPU-only exit that writes nothing."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import catalog as cat
from experiments import catalog_bench as cb

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ((14336, 4096), (4096, 4096), (1000, 4160), (2048, 5472))
MS = (1, 2, 4, 8, 16, 32, 256)
DTYPES = ("bfloat16", "float16")


def _linear_rows(seed: int) -> list[dict]:
    """Rows as the linear writes them: random times, some peers null (not applicable or failed), some nf4 null."""
    rng = random.Random(seed)
    rows = []
    for n, k in SHAPES:
        for dtype in DTYPES:
            for m in MS:
                nf4_us = None if rng.random() < 0.1 else rng.uniform(5, 50)
                peers = {}
                for name in cb.LINEAR_PEERS:
                    applies = m == 1 or name not in ("unsloth_gemv", "same_bytes_cublas")
                    peers[name] = rng.uniform(3, 120) if applies and rng.random() > 0.15 else None
                rows.append({"N": n, "K": k, "M": m, "dtype": dtype, "subset": cat.subset(n, k), "nf4_us": nf4_us,
                             "peers_us": peers, "errors": {}, "floor_us": rng.uniform(1, 10),
                             "exact": nf4_us is not None})
    return rows


def _dequant_rows(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"N": n, "K": k, "dtype": dtype, "subset": cat.subset(n, k),
             "nf4_us": rng.uniform(5, 50), "floor_us": rng.uniform(1, 10), "exact": True, "errors": {},
             "peers_us": {name: (rng.uniform(3, 120) if rng.random() > 0.2 else None) for name in cb.DEQUANT_PEERS}}
            for n, k in SHAPES for dtype in DTYPES]


def _expected_ratios(rows):
    """summary's per-peer and floor statistics, computed with numpy from the rows."""
    out = {}
    for name in {p for r in rows for p in r["peers_us"]}:
        pairs = [(r["peers_us"][name], r["nf4_us"]) for r in rows
                 if r["nf4_us"] is not None and r["peers_us"][name] is not None]
        speed = np.array([p / t for p, t in pairs])
        stats = (speed.min(), np.median(speed), speed.max()) if pairs else (None, None, None)
        out[name] = (len(pairs), *stats, int(sum(t > p for p, t in pairs)))
    floor = np.array([r["nf4_us"] / r["floor_us"] for r in rows if r["nf4_us"] is not None])
    return out, (len(floor), floor.min(), np.median(floor), floor.max())


def _check_ratios(got, rows):
    peers, floor = _expected_ratios(rows)
    assert set(got["peers"]) == set(peers)
    for name, (n, lo, med, hi, slower) in peers.items():
        p = got["peers"][name]
        assert p["n"] == n and p["nf4_slower"] == slower
        if n:
            assert (p["speedup_min"], p["speedup_median"], p["speedup_max"]) == pytest.approx((lo, med, hi), rel=1e-12)
        else:
            assert (p["speedup_min"], p["speedup_median"], p["speedup_max"]) == (None, None, None)
    f = got["nf4_over_floor"]
    assert f["n"] == floor[0]
    assert (f["min"], f["median"], f["max"]) == pytest.approx(floor[1:], rel=1e-12)


@pytest.mark.parametrize("seed", [1, 7, 2026])
def test_summary_of_linear_rows_matches_numpy(seed):
    rows = _linear_rows(seed)
    s = cb.summary(rows)
    assert s["rows"] == len(rows)
    assert s["exact"] == sum(r["nf4_us"] is not None for r in rows)
    assert s["inexact"] == len(rows) - s["exact"]
    _check_ratios(s, rows)
    assert set(s["by_m"]) == {str(m) for m in MS}
    for m in (1, 16, 256):
        _check_ratios(s["by_m"][str(m)], [r for r in rows if r["M"] == m])
    # M > 1: the M = 1 peers never apply, and say so with no rows rather than a number
    assert s["by_m"]["2"]["peers"]["unsloth_gemv"] == {"n": 0, "speedup_min": None, "speedup_median": None,
                                                      "speedup_max": None, "nf4_slower": 0}
    for subset in {r["subset"] for r in rows}:
        _check_ratios(s["by_subset"][subset], [r for r in rows if r["subset"] == subset])
    assert s["inversions"]["count"] == len(s["inversions"]["violations"])


@pytest.mark.parametrize("seed", [3, 99])
def test_summary_of_dequant_rows_matches_numpy_and_has_no_linear_parts(seed):
    rows = _dequant_rows(seed)
    s = cb.summary(rows)
    _check_ratios(s, rows)
    assert "by_m" not in s and "inversions" not in s
    assert set(s["peers"]) == set(cb.DEQUANT_PEERS)


def test_summary_of_no_rows():
    s = cb.summary([])
    assert s["rows"] == 0 and s["peers"] == {} and s["nf4_over_floor"]["median"] is None


def _inversion_rows(seed: int) -> list[dict]:
    """Times close to each other across M (so that some pairs invert by more than 3% and some do not)."""
    rng = random.Random(seed)
    rows = []
    for n, k in SHAPES:
        for dtype in DTYPES:
            base = rng.uniform(10, 40)
            for m in MS:
                t = None if rng.random() < 0.1 else base * rng.uniform(0.92, 1.1)
                rows.append({"N": n, "K": k, "M": m, "dtype": dtype, "nf4_us": t, "peers_us": {}, "floor_us": 1.0})
    return rows


@pytest.mark.parametrize("seed", [0, 5, 123, 4567])
def test_inversions_match_every_pair_checked_here(seed):
    rows = _inversion_rows(seed)
    want = set()
    pairs = 0
    for a in rows:
        for b in rows:
            same = (a["N"], a["K"], a["dtype"]) == (b["N"], b["K"], b["dtype"])
            if same and a["M"] < b["M"] <= 16 and a["nf4_us"] is not None and b["nf4_us"] is not None:
                pairs += 1
                if a["nf4_us"] > 1.03 * b["nf4_us"]:
                    want.add((a["N"], a["K"], a["dtype"], a["M"], b["M"]))
    got = cb.inversions(rows)
    assert want, "the seeded rows should hold some inversions"
    assert got["pairs"] == pairs
    assert got["count"] == len(want)
    assert {(v["N"], v["K"], v["dtype"], v["m_small"], v["m_large"]) for v in got["violations"]} == want
    for v in got["violations"]:
        assert v["speedup"] == pytest.approx(v["us_small"] / v["us_large"], rel=1e-12) and v["speedup"] > 1.03
    assert cb.summary(rows)["inversions"]["count"] == len(want)


def test_inversions_by_hand():
    times = {1: 10.0, 2: 10.2, 4: 9.8, 8: 9.6, 16: 12.0, 32: 1.0}
    rows = [{"N": 64, "K": 128, "M": m, "dtype": "bfloat16", "nf4_us": t} for m, t in times.items()]
    # 10 / 9.6 = 1.042, 10.2 / 9.8 = 1.041, 10.2 / 9.6 = 1.063 are over 3%; 10 / 9.8 = 1.020, 9.8 / 9.6 = 1.021 are
    # not; M = 32 is past the bar
    got = cb.inversions(rows)
    assert got["pairs"] == 10
    assert [(v["m_small"], v["m_large"]) for v in got["violations"]] == [(1, 8), (2, 4), (2, 8)]
    assert cb.inversions([{**r, "dtype": "float16"} for r in rows] + rows)["count"] == 6  # per dtype


def test_bars_by_hand():
    big, small = (8192, 4096), (1024, 1024)  # 32 Mi weights (the M = 1 same-bytes bar's size) and 1 Mi

    def row(shape, m, nf4, **peers):
        return {"N": shape[0], "K": shape[1], "M": m, "dtype": "bfloat16", "nf4_us": nf4, "peers_us": peers}

    rows = [row(big, 1, 13.0, same_bytes_cublas=10.0, bnb_matmul_4bit=30.0, unsloth_gemv=26.0, dense_cublas=33.0),
            row(small, 1, 5.0, same_bytes_cublas=2.0, bnb_matmul_4bit=11.0, unsloth_gemv=None, dense_cublas=12.0),
            row(big, 8, 10.0, dense_cublas=20.0), row(big, 16, 10.0, dense_cublas=19.9),
            row(big, 64, 10.0, dense_cublas=10.0), row(big, 128, 9.0, dense_cublas=10.0),
            row(big, 256, 11.0, dense_cublas=10.0), row(big, 512, 11.1, dense_cublas=10.0),
            row(big, 1024, 10.5, dense_cublas=10.0), row(big, 2048, None, dense_cublas=10.0)]
    got = cb.bars(rows)
    # same bytes: only the big weight counts, 13 / 10 = 1.3 holds (at most 1.3)
    assert got["m1_same_bytes"]["rows"] == 1 and got["m1_same_bytes"]["held"] == 1
    assert got["m1_same_bytes"]["worst"]["value"] == pytest.approx(1.3)
    # the best 4-bit peer is the faster one: 26 / 13 = 2.0 holds, 11 / 5 = 2.2 holds
    assert got["m1_best_4bit_peer"]["held"] == 2 and got["m1_best_4bit_peer"]["worst"]["value"] == pytest.approx(2.0)
    # dense at M = 1: 33 / 13 = 2.54 holds, 12 / 5 = 2.4 does not
    assert (got["m1_dense"]["held"], got["m1_dense"]["worst"]["N"]) == (1, 1024)
    # M = 2-16: 20 / 10 = 2.0 holds, 19.9 / 10 does not
    assert (got["m2_16_dense"]["rows"], got["m2_16_dense"]["held"]) == (2, 1)
    # M = 17-128: faster, strictly: 10 / 10 does not hold, 10 / 9 does
    assert (got["m17_128_dense"]["rows"], got["m17_128_dense"]["held"]) == (2, 1)
    # M = 129-512: at most 1.1x dense: 1.1 holds, 1.11 does not; M >= 1024: 1.05 holds; no nf4 time, no row
    assert (got["m129_512_dense"]["held"], got["m129_512_dense"]["worst"]["M"]) == (1, 512)
    assert (got["m1024_dense"]["rows"], got["m1024_dense"]["held"]) == (1, 1)
    assert "bars" in cb.summary(rows) and "bars" not in cb.summary([{k: v for k, v in r.items() if k != "M"}
                                                                   for r in rows])


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_parts_cover_every_shape_once(parts):
    shapes = cb.parse_shapes("all")
    assert len(shapes) == len(cat.catalog())
    split = [cb.select_part(shapes, cb.parse_part(f"{i}/{parts}")) for i in range(parts)]
    joined = [s for part in split for s in part]
    assert sorted(joined) == sorted(shapes) and len(set(joined)) == len(shapes)
    assert max(map(len, split)) - min(map(len, split)) <= 1
    assert split[0][0] == shapes[0]


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0"])
def test_bad_parts_are_refused(text):
    with pytest.raises(Exception, match="part"):
        cb.parse_part(text)


def test_shape_selections():
    assert cb.parse_shapes("fit") == [(s.n, s.k) for s in cat.fit_shapes()]
    assert cb.parse_shapes("held-out") == [(s.n, s.k) for s in cat.held_out_shapes()]
    assert cb.parse_shapes("4096x4096, 14336X4096") == [(4096, 4096), (14336, 4096)]
    for bad in ("4096", "0x64", "axb"):
        with pytest.raises(Exception, match="shape"):
            cb.parse_shapes(bad)
    assert cb.parse_dtypes("fp16") == ["fp16"] and cb.parse_ms("4,1,4") == [1, 4]
    with pytest.raises(Exception, match="dtypes"):
        cb.parse_dtypes("fp32")


def test_floors_count_the_bytes():
    n, k = 4096, 14336
    blocks = n * k // 64
    weight = n * k // 2 + blocks + (-(-blocks // 256)) * 4 + 256 * 4 + 4  # packed, absmax, absmax2, code2, offset
    assert cb.weight_bytes(n, k) == weight
    assert cb.linear_bytes(n, k, 1, 2) == weight + 2 * k + 2 * n
    assert cb.dequant_bytes(n, k, 2) == weight + 2 * n * k
    est = cb.estimate_s("linear", [(n, k)], ["bf16"])
    assert 0 < est < cb.estimate_s("linear", [(n, k)], ["bf16", "fp16"])
    from nf4.linear import autotune

    assert cb.RACE_MAX_M == autotune.MAX_M
    raced = sum(m <= autotune.MAX_M for m in cb.MS)
    assert cb.estimate_s("linear", [(n, k)], ["bf16"], races=True) == pytest.approx(
        cb.estimate_s("linear", [(n, k)], ["bf16"], races=False) + raced * cb.RACE_S)


def _part(device, rows, op="linear", part="0/2"):
    return {"op": op, "device": device, "environment": {"device": device}, "copy_gbs": 3000.0, "part": part,
            "rows": rows, "complete": True, "peers": {}}


def test_merge_joins_parts_and_recomputes_the_summary():
    rows = _linear_rows(11)
    a = [r for r in rows if (r["N"], r["K"]) in SHAPES[0::2]]
    b = [r for r in rows if (r["N"], r["K"]) in SHAPES[1::2]]
    merged = cb.merge([_part("NVIDIA H100 80GB HBM3", a), _part("NVIDIA H100 80GB HBM3", b, part="1/2")],
                      ["p0.json", "p1.json"])
    assert len(merged["rows"]) == len(rows)
    assert sorted(map(cb._key, merged["rows"])) == sorted(map(cb._key, rows))
    assert merged["summary"] == cb.summary(merged["rows"])
    assert merged["device"] == "NVIDIA H100 80GB HBM3" and merged["complete"] is True
    assert [p["file"] for p in merged["parts"]] == ["p0.json", "p1.json"]
    with pytest.raises(ValueError, match=r"in p0\.json and in p1\.json"):
        cb.merge([_part("H100", a), _part("H100", a[:1])], ["p0.json", "p1.json"])
    with pytest.raises(ValueError, match="different ops"):
        cb.merge([_part("H100", a), _part("H100", _dequant_rows(1), op="dequant")])


def test_merge_replace_puts_a_rerun_over_a_merged_file(tmp_path):
    rows = _linear_rows(11)
    dev = "NVIDIA H100 80GB HBM3"
    a = [r for r in rows if (r["N"], r["K"]) in SHAPES[0::2]]
    b = [r for r in rows if (r["N"], r["K"]) in SHAPES[1::2]]
    first = {**_part(dev, a), "environment": {"device": dev, "commit": "old"}}
    second = {**_part(dev, b, part="1/2"), "environment": {"device": dev, "commit": "old"}}
    merged = cb.merge([first, second], ["p0.json", "p1.json"])
    rerun_rows = [{**r, "nf4_us": -1.0} for r in rows if r["M"] <= 16]
    rerun = {**_part(dev, rerun_rows, part="0/1"), "environment": {"device": dev, "commit": "new"}}
    with pytest.raises(ValueError, match=r"is in merged\.json and in rerun\.json"):
        cb.merge([merged, rerun], ["merged.json", "rerun.json"])
    out = cb.merge([merged, rerun], ["merged.json", "rerun.json"], replace=True)
    assert sorted(map(cb._key, out["rows"])) == sorted(map(cb._key, rows))
    got = {cb._key(r): r for r in out["rows"]}
    for r in rows:
        want_us, want_commit = (-1.0, "new") if r["M"] <= 16 else (r["nf4_us"], "old")
        assert got[cb._key(r)]["nf4_us"] == want_us and got[cb._key(r)]["commit"] == want_commit
    assert [p["file"] for p in out["parts"]] == ["p0.json", "p1.json", "merged.json", "rerun.json"]
    assert out["parts"][2]["rows_left"] == sum(r["M"] > 16 for r in rows)
    assert out["parts"][3]["rows_left"] == len(rerun_rows)
    assert out["summary"] == cb.summary(out["rows"])
    src, new, dst = tmp_path / "m.json", tmp_path / "r.json", tmp_path / "o.json"
    src.write_text(json.dumps(merged))
    new.write_text(json.dumps(rerun))
    assert cb.main(["merge", str(dst), str(src), str(new)]) == 1 and not dst.exists()
    assert cb.main(["merge", "--replace", str(dst), str(src), str(new)]) == 0
    assert len(json.loads(dst.read_text())["rows"]) == len(rows)


def test_merge_refuses_different_devices(tmp_path):
    rows = _linear_rows(2)
    with pytest.raises(ValueError, match="different devices"):
        cb.merge([_part("NVIDIA H100 80GB HBM3", rows[:10]), _part("NVIDIA H200", rows[10:])])
    p0, p1, out = tmp_path / "p0.json", tmp_path / "p1.json", tmp_path / "merged.json"
    p0.write_text(json.dumps(_part("NVIDIA H100 80GB HBM3", rows[:10])))
    p1.write_text(json.dumps(_part("NVIDIA H200", rows[10:])))
    assert cb.main(["merge", str(out), str(p0), str(p1)]) == 1
    assert not out.exists()
    p1.write_text(json.dumps(_part("NVIDIA H100 80GB HBM3", rows[10:])))
    assert cb.main(["merge", str(out), str(p0), str(p1)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == len(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the exit without a GPU")
@pytest.mark.parametrize("op", ["dequant", "linear"])
def test_cli_without_cuda_exits_2_and_writes_nothing(tmp_path, op):
    out = tmp_path / "catalog" / f"{op}.json"
    proc = subprocess.run([sys.executable, "-m", "experiments", "catalog-bench", op, "--out", str(out),
                           "--shapes", "64x896"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    assert not out.exists() and not out.parent.exists()


def test_races_judge_the_autotuner_against_its_catalog_run():
    dev = "NVIDIA H200"
    rows = _linear_rows(5)
    catalog = {**_part(dev, rows, part="0/1"), "environment": {"device": dev, "commit": "abcdef123"}}
    timed = [r for r in rows if r["nf4_us"] and r["M"] <= 16]
    entries = {}
    for r in timed:
        text = f"{dev}|fp|{r['N']}|{r['K']}|64|1|{r['dtype']}|{r['dtype']}|{r['M']}"
        entries[text] = {"config": "GEMV_MMA_WK4", "us": {"GEMV_MMA_WK4": r["nf4_us"] / 1.2, "GEMV_MMA16": 1e9}}
    first = dict(list(entries.items())[: len(entries) // 2])
    second = dict(list(entries.items())[len(entries) // 2:])
    before = {**catalog, "rows": [{**r, "nf4_us": r["nf4_us"] and r["nf4_us"] * (2 if r["M"] == 1 else 1)}
                                  for r in rows]}
    out = cb.races([{"entries": first}, {"entries": second}], catalog, before, ["a.json", "b.json"])
    assert out["entries"] == entries and out["gpus_in_keys"] == [dev] and out["chosen"] == {"GEMV_MMA_WK4": len(timed)}
    assert sum(j["keys"] for j in out["judged"].values()) == len(timed)
    assert sum(j["keys"] for j in out["judged_by_subset"].values()) == len(timed)
    assert set(out["judged_by_subset"]) <= {cat.FIT, cat.HELD_OUT}
    assert all(g["median"] >= 1 and g["max"] >= 1 for g in out["table_over_choice"].values())  # the choice is fastest
    for j in out["judged"].values():
        assert j["median"] == pytest.approx(1.2) and j["max"] == pytest.approx(1.2) and j["over_10pct"] == j["keys"]
    assert out["catalog"]["inversions"] == cb.inversions(rows)
    assert out["before"]["inversions"]["count"] > out["catalog"]["inversions"]["count"]
    assert out["catalog"]["row_commits"] == {"abcdef1": len(rows)}


def test_row_commits_count_each_rows_own_commit_first():
    rows = _linear_rows(3)
    payload = {**_part("H100", rows), "environment": {"commit": "1111111aaa"}}
    assert cb.row_commits(payload) == {"1111111": len(rows)}
    stamped = {**payload, "rows": [{**r, "commit": "2222222bbb"} if r["M"] == 1 else r for r in rows]}
    ones = sum(r["M"] == 1 for r in rows)
    assert cb.row_commits(stamped) == {"1111111": len(rows) - ones, "2222222": ones}


def test_merge_replace_gives_each_old_row_its_parts_commit():
    dev = "NVIDIA H100 80GB HBM3"
    rows = _linear_rows(13)
    selection = ",".join(f"{n}x{k}" for n, k in SHAPES)
    a = [r for r in rows if (r["N"], r["K"]) in SHAPES[0::2]]
    b = [r for r in rows if (r["N"], r["K"]) in SHAPES[1::2]]
    first = {**_part(dev, a), "environment": {"commit": "aaaaaaa1"}, "selection": selection}
    second = {**_part(dev, b, part="1/2"), "environment": {"commit": "bbbbbbb2"}, "selection": selection}
    merged = cb.merge([first, second], ["p0.json", "p1.json"])
    rerun = {**_part(dev, [r for r in rows if r["M"] == 1], part="0/1"), "environment": {"commit": "ccccccc3"}}
    out = cb.merge([merged, rerun], ["merged.json", "rerun.json"], replace=True)
    for r in out["rows"]:
        want = "ccccccc3" if r["M"] == 1 else "aaaaaaa1" if (r["N"], r["K"]) in SHAPES[0::2] else "bbbbbbb2"
        assert r["commit"] == want
    assert out["row_commits"] == cb.row_commits(out) and sum(out["row_commits"].values()) == len(rows)
