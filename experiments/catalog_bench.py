"""The catalog bench: nf4 against its released peers on every shape users have (experiments.catalog).

    python -m experiments catalog-bench dequant --out results/catalog/dequant_h100.json
    python -m experiments catalog-bench linear --out results/catalog/linear_h100.json --part 0/2
    python -m experiments catalog-bench linear --out /tmp/l.json --shapes 4096x4096,14336x4096 --ms 1,16 --dtypes bf16
    python -m experiments catalog-bench merge results/catalog/linear_h100.json /tmp/part0.json /tmp/part1.json

GPU only (exit 2 and no file without a CUDA GPU); `merge` runs anywhere. Per shape (N x K = out x in features; the
catalog's, its fit or held-out subset, or a list) one random bfloat16 normal weight is quantized on the GPU by
bitsandbytes (`quantize_4bit`, blocksize 64, double quantization, NF4) and cloned for rotation
(`verify.timing.rotation_count`: the weights a replay walks through exceed the L2 cache); each dtype's rows use
QuantStates of that weight whose `dtype` is the row's. Times are CUDA-graph device times per call
(`verify.timing.graph_time_us`, CALLS calls a replay, REPS replays; fewer calls where one call is long, never fewer
than the weights rotated), median of the replays; x is one random tensor per M (not rotated).

dequant, per shape and dtype: `nf4.dequantize` first checked bit for bit (int16 views) against bitsandbytes'
`dequantize_4bit` on the first weight (`exact`, `mismatches`; an inexact nf4 is not timed), then timed beside
`bnb_dequantize_4bit` (bitsandbytes.functional.dequantize_4bit) and `unsloth_dequantize` (Unsloth 2026.10.9's
released Triton fast_dequantize, run from the wheel's files through verify.unsloth_release; null, with the reason
in `errors`, where the release is not here). `floor_us`: verify.timing.nf4_bytes of the weight (packed, absmax,
state2, output) at the copy bandwidth measured in the same run.

linear, per shape, dtype and M (rows of x; default MS): `nf4.linear` first checked on its operand: row i of x is
row i mod min(M, 8) of the identity, negated for odd i, so row i of the output must be that column of the
dequantized weight (bitsandbytes'), negated for odd i, +0.0 for zeros, bit for bit (`exact`, `mismatches`; an
inexact nf4 is not timed). Then, on random normal x, nf4.linear beside `bnb_matmul_4bit` (bitsandbytes.matmul_4bit(x,
packed.t(), quant_state), as Linear4bit.forward calls it), `unsloth_gemv` (M = 1 only: Unsloth 2026.10.9's released
fast_gemv on x of shape (1, 1, K)), `dequant_then_cublas` (nf4.dequantize, then F.linear), `dense_cublas` (F.linear
on the dequantized 16-bit weight) and, at M = 1, `same_bytes_cublas` (F.linear of x's first K / 4 columns on an
[N, K / 4] matrix of x's dtype: as many bytes as the packed weight, nothing to decode). `floor_us`: the packed weight,
absmax, state2, x and y bytes at the copy bandwidth (a byte floor at every M; at large M the tensor cores bound it).

Rows: N, K, dtype (M), subset, nf4_us, peers_us (peer -> us, null where it does not apply or failed), errors
(peer -> why it failed; "nf4" too), floor_us, exact, mismatches, nf4_config. The file: device, environment, copy_gbs,
peers (what each peer is, with versions), rows, summary (`summary(rows)`), and the run's settings. It is written after
every shape (the linear: after each dtype of it), so a run cut off keeps what it measured. `--part i/n` (0 <= i < n)
runs shapes i, i + n, i + 2n, ... of the selection, so one GPU's catalog can be split over device calls; `merge`
joins the parts of one device and op. On an H200, half the catalog took 49 s (dequant, both dtypes) and 380 s
(linear, both dtypes, 13 M; 122 s of it the first shape, Triton's compiles); the run prints its estimate first.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from verify import timing

from . import catalog as cat

OPS = ("dequant", "linear")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZE = 64
CALLS, REPS = 20, 5  # calls a graph replay holds, replays timed
REPLAY_US = 4000.0  # a replay of long calls holds about this much work (never fewer calls than weights rotated)
CHECK_ROWS = 8  # distinct identity rows in the linear's operand check
INVERSION_MAX_M, INVERSION_TOLERANCE = 16, 0.03  # the bar: no larger M > 3% faster, up to M = 16
DEQUANT_PEERS = ("bnb_dequantize_4bit", "unsloth_dequantize")
LINEAR_PEERS = ("bnb_matmul_4bit", "unsloth_gemv", "dequant_then_cublas", "dense_cublas", "same_bytes_cublas")
PEER_CALLS = {
    "bnb_dequantize_4bit": "bitsandbytes.functional.dequantize_4bit(packed, quant_state)",
    "unsloth_dequantize": "Unsloth's fast_dequantize(packed, quant_state), Triton path (verify.unsloth_release)",
    "bnb_matmul_4bit": "bitsandbytes.matmul_4bit(x, packed.t(), quant_state=quant_state)",
    "unsloth_gemv": "Unsloth's fast_gemv(x.view(1, 1, K), packed, quant_state), M = 1 only (verify.unsloth_release)",
    "dequant_then_cublas": "F.linear(x, nf4.dequantize(packed, quant_state))",
    "dense_cublas": "F.linear(x, w) on the dequantized 16-bit weight [N, K]",
    "same_bytes_cublas": "F.linear(x[:, :K // 4], w4) on a [N, K // 4] matrix of x's dtype, M = 1 only",
}
# the estimate's host costs (seconds): per timing (capture, instantiation, sync), per captured call, per shape and
# dtype (quantization, clones, checks); and the shortest device time of a call in a graph (microseconds). Fit to an
# H200 run of half the catalog (linear: 258 s measured after the first shape, 285 s estimated; dequant: 42 s, 53 s)
TIMING_S, HOST_CALL_S, SHAPE_S, MIN_CALL_US = 0.012, 20e-6, 0.3, 3.0
COMPILE_S = {"dequant": 8.0, "linear": 120.0}  # the first shape's extra seconds (Triton's compiles), same run
EST_TFLOPS = 500.0  # a rough sustained dense 16-bit rate for the estimate
# nf4.linear's race on the first call of a shape and M (nf4/linear/autotune.py, up to its MAX_M): about 0.3 s a key by
# the pace of session 29's H200 catalog runs (1,248 rows of 48 shapes in 525 s, against about 0.22 s a row before)
RACE_S, RACE_MAX_M = 0.3, 512


# --- arguments -----------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'all', 'fit', 'held-out' (the catalog and its subsets, in catalog order) or 'NxK,NxK,...'."""
    named = {"all": cat.catalog, cat.FIT: cat.fit_shapes, cat.HELD_OUT: cat.held_out_shapes}
    if text in named:
        return [(s.n, s.k) for s in named[text]()]
    out = []
    for item in text.split(","):
        try:
            n, k = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a shape is NxK (or all, fit, held-out), got {item!r}") from None
        if n <= 0 or k <= 0:
            raise argparse.ArgumentTypeError(f"a shape's sides are positive, got {item!r}")
        out.append((n, k))
    return out


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"dtypes are a comma list of {', '.join(DTYPES)}, got {text!r}")
    return names


def parse_ms(text: str) -> list[int]:
    try:
        ms = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"M is a comma list of positive integers, got {text!r}") from None
    if not ms or min(ms) <= 0:
        raise argparse.ArgumentTypeError(f"M is a comma list of positive integers, got {text!r}")
    return sorted(set(ms))


def parse_part(text: str) -> tuple[int, int]:
    """'i/n' with 0 <= i < n."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a part is i/n, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"a part i/n needs 0 <= i < n, got {text!r}")
    return i, n


def select_part(shapes: list, part: tuple[int, int]) -> list:
    """Shapes i, i + n, i + 2n, ... (the catalog is sorted by size, so the parts' work is about even)."""
    i, n = part
    return list(shapes[i::n])


# --- bytes, floors and the estimate --------------------------------------------------------------


def weight_bytes(n: int, k: int) -> int:
    """The packed weight, its uint8 absmax and state2 (absmax2, code2, offset): what a 4-bit kernel must read."""
    return timing.nf4_bytes(n * k, BLOCKSIZE, 0)


def dequant_bytes(n: int, k: int, out_bytes: int) -> int:
    return timing.nf4_bytes(n * k, BLOCKSIZE, out_bytes)


def linear_bytes(n: int, k: int, m: int, x_bytes: int) -> int:
    """The weight's bytes (weight_bytes), x (M x K) and y (M x N)."""
    return weight_bytes(n, k) + m * k * x_bytes + m * n * x_bytes


def _calls(est_us: float, count: int, calls: int = CALLS) -> int:
    """Calls a replay holds: `calls`, fewer for long calls (about REPLAY_US a replay), never fewer than `count`."""
    return max(count, min(calls, math.ceil(REPLAY_US / max(est_us, 1e-3))))


def _timing_s(est_us: float, count: int, calls: int, reps: int) -> float:
    """Host overhead plus device time of one timing: a warm-up and a probe call, graph_time_us' three warm-up calls,
    its capture, and reps + 1 replays."""
    est_us = max(est_us, MIN_CALL_US)
    c = _calls(est_us, count, calls)
    return TIMING_S + c * HOST_CALL_S + est_us * 1e-6 * (5 + c * (reps + 1))


def estimate_s(op: str, shapes, dtypes, ms=MS, *, copy_gbs: float = 3000.0, calls: int = CALLS, reps: int = REPS,
               unsloth: bool = True, races: bool | None = None) -> float:
    """A rough estimate of a run's seconds (Triton's first compiles not counted): per timing TIMING_S of host work
    plus its calls at the byte floor (and, for the linear, at EST_TFLOPS where that is slower, the peers 1.5x); for
    the linear with autotuning on (races: None reads NF4_AUTOTUNE), RACE_S per first call of an M it races."""
    if races is None:
        from nf4.linear import autotune

        races = autotune.enabled()
    total = 0.0
    for n, k in shapes:
        for dt in dtypes:
            e = torch.empty((), dtype=DTYPES[dt] if isinstance(dt, str) else dt).element_size()
            total += SHAPE_S
            if op == "dequant":
                nbytes = dequant_bytes(n, k, e)
                est = nbytes / (copy_gbs * 1e3)
                count = timing.rotation_count(nbytes)
                total += _timing_s(est, count, calls, reps) * (2 + unsloth)
                continue
            count = timing.rotation_count(weight_bytes(n, k))
            for m in ms:
                if races and m <= RACE_MAX_M:
                    total += RACE_S
                est = max(linear_bytes(n, k, m, e) / (copy_gbs * 1e3), 2.0 * m * n * k / (EST_TFLOPS * 1e6))
                timings = 4 + (2 if m == 1 else 0) - (0 if unsloth or m != 1 else 1)
                total += _timing_s(est, count, calls, reps) + _timing_s(1.5 * est, count, calls, reps) * (timings - 1)
    return total


# --- the summary ---------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def _ratios(rows: list[dict]) -> dict:
    """Per peer, the speedup of nf4 over it (peer_us / nf4_us: min, median, max) and the rows where nf4 is slower;
    nf4_us / floor_us. Rows without both times are left out of each."""
    names = list(dict.fromkeys(p for r in rows for p in r.get("peers_us", {})))
    peers_out = {}
    for name in names:
        pairs = [(r["peers_us"][name], r["nf4_us"]) for r in rows
                 if r.get("nf4_us") is not None and r.get("peers_us", {}).get(name) is not None]
        ratios = [p / t for p, t in pairs]
        s = _stats(ratios)
        peers_out[name] = {"n": s["n"], "speedup_min": s["min"], "speedup_median": s["median"],
                           "speedup_max": s["max"], "nf4_slower": sum(1 for p, t in pairs if t > p)}
    floor = [r["nf4_us"] / r["floor_us"] for r in rows if r.get("nf4_us") is not None and r.get("floor_us")]
    return {"peers": peers_out, "nf4_over_floor": _stats(floor)}


def inversions(rows: list[dict], max_m: int = INVERSION_MAX_M, tolerance: float = INVERSION_TOLERANCE) -> dict:
    """The issue's bar "no inversions": for M <= max_m, a larger M never runs more than `tolerance` faster than a
    smaller M on the same shape and dtype, i.e. nf4_us(smaller) / nf4_us(larger) <= 1 + tolerance for every pair
    (not only neighbours). Rows without an nf4 time are left out. Returns the count and every violating pair."""
    times: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r.get("M") is not None and r["M"] <= max_m and r.get("nf4_us") is not None:
            times.setdefault((r["N"], r["K"], r["dtype"]), {})[r["M"]] = r["nf4_us"]
    violations, pairs = [], 0
    for (n, k, dtype), by_m in sorted(times.items()):
        ms = sorted(by_m)
        for a, small in enumerate(ms):
            for large in ms[a + 1:]:
                pairs += 1
                ratio = by_m[small] / by_m[large]
                if ratio > 1 + tolerance:
                    violations.append({"N": n, "K": k, "dtype": dtype, "m_small": small, "m_large": large,
                                       "us_small": by_m[small], "us_large": by_m[large], "speedup": ratio})
    return {"rule": f"for M <= {max_m}, nf4_us(smaller M) / nf4_us(larger M) <= {1 + tolerance:g} on each shape and "
                    "dtype", "pairs": pairs, "count": len(violations), "violations": violations}


# issue 34's bars over the catalog: (name, M range, the ratio, its direction and limit, rows it applies to)
# ratio "speedup": peer_us / nf4_us (at least the limit); "time": nf4_us / peer_us (at most the limit)
BIG_WEIGHT = 16 * 2**20
BARS = (
    ("m1_same_bytes", 1, 1, "same_bytes_cublas", "time", 1.3, BIG_WEIGHT),
    ("m1_best_4bit_peer", 1, 1, ("bnb_matmul_4bit", "unsloth_gemv"), "speedup", 2.0, 0),
    ("m1_dense", 1, 1, "dense_cublas", "speedup", 2.5, 0),
    ("m2_16_dense", 2, 16, "dense_cublas", "speedup", 2.0, 0),
    ("m17_128_dense", 17, 128, "dense_cublas", "speedup", 1.0, 0),
    ("m129_512_dense", 129, 512, "dense_cublas", "time", 1.1, 0),
    ("m1024_dense", 1024, None, "dense_cublas", "time", 1.05, 0),
)


def bars(rows: list[dict]) -> dict:
    """Issue 34's forward bars over the catalog rows (`BARS`): per bar the rows it applies to (M in range, a weight
    of at least the size given, nf4's and the peer's times; the best 4-bit peer is the faster of those named), the
    rows that hold, and the worst ratio with its row. "faster than" holds strictly (speedup above 1.0)."""
    out = {}
    for name, lo, hi, peer, kind, limit, min_weight in BARS:
        vals = []
        for r in rows:
            m = r.get("M")
            if m is None or m < lo or (hi is not None and m > hi) or r["N"] * r["K"] < min_weight:
                continue
            peers = r.get("peers_us") or {}
            times = [peers[p] for p in ((peer,) if isinstance(peer, str) else peer) if peers.get(p)]
            if r.get("nf4_us") is None or not times:
                continue
            t = min(times)
            vals.append((t / r["nf4_us"] if kind == "speedup" else r["nf4_us"] / t, r))
        if kind == "speedup":
            held = [v for v, _ in vals if (v > limit if limit == 1.0 else v >= limit)]
            worst = min(vals, key=lambda vr: vr[0]) if vals else None
        else:
            held = [v for v, _ in vals if v <= limit]
            worst = max(vals, key=lambda vr: vr[0]) if vals else None
        out[name] = {"peer": peer if isinstance(peer, str) else list(peer), "ratio": kind, "limit": limit,
                     "m": [lo, hi], "min_weights": min_weight, "rows": len(vals), "held": len(held),
                     "worst": None if worst is None else {"value": worst[0], "N": worst[1]["N"], "K": worst[1]["K"],
                                                         "M": worst[1]["M"], "dtype": worst[1]["dtype"]}}
    return out


def summary(rows: list[dict]) -> dict:
    """Overall and per subset (fit / held-out): per peer nf4's speedup over it (peer_us / nf4_us: min, median, max)
    and how many rows nf4 is slower on; nf4_us / floor_us (min, median, max); the exactness counts. For the linear
    (rows with M) also per M, the inversion bar (`inversions`) and issue 34's forward bars (`bars`)."""
    out = {"rows": len(rows), "exact": sum(1 for r in rows if r.get("exact") is True),
           "inexact": sum(1 for r in rows if r.get("exact") is False), **_ratios(rows)}
    subsets = list(dict.fromkeys(r["subset"] for r in rows if r.get("subset")))
    out["by_subset"] = {s: _ratios([r for r in rows if r.get("subset") == s]) for s in subsets}
    if any("M" in r for r in rows):
        ms = sorted({r["M"] for r in rows if "M" in r})
        out["by_m"] = {str(m): _ratios([r for r in rows if r.get("M") == m]) for m in ms}
        out["inversions"] = inversions(rows)
        out["bars"] = bars(rows)
    return out


# --- merge ---------------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    return r["N"], r["K"], r["dtype"], r.get("M", 0)


def _part_commits(payload: dict) -> dict:
    """{(N, K): commit} of a file's rows by the part that measured them, or {None: commit} where the file has one
    commit: a merged file's parts are `i/n` parts of its selection (`select_part`)."""
    parts = payload.get("parts") or [payload]
    commits = {(q.get("environment") or {}).get("commit") for q in parts}
    if len(commits) == 1:
        return {None: commits.pop()}
    try:
        shapes = parse_shapes(payload.get("selection") or "all")
        out = {}
        for q in parts:
            for shape in select_part(shapes, parse_part(q["part"])):
                out[shape] = (q.get("environment") or {}).get("commit")
        return out
    except (KeyError, TypeError, ValueError, argparse.ArgumentTypeError):
        return {}


def merge(payloads: list[dict], names: list[str] | None = None, replace: bool = False) -> dict:
    """One file from the parts of one op's run on one device: rows joined (a row measured twice is refused), the
    summary recomputed, each part's environment and copy bandwidth kept under `parts` (the top level keeps the
    first's). replace: a later part's row replaces an earlier one's (a re-run of some rows, e.g. --ms 1,2,4,8,16, over
    a merged file); a merged input's own parts are listed, then a line with how many of its rows are left.
    ValueError for parts of different devices or ops."""
    if not payloads:
        raise ValueError("merge needs at least one part")
    names = names or [f"part {i}" for i in range(len(payloads))]
    devices = {p.get("device") for p in payloads}
    if len(devices) != 1:
        raise ValueError("parts of different devices cannot be merged: "
                         + ", ".join(f"{nm}: {p.get('device')!r}" for nm, p in zip(names, payloads, strict=True)))
    ops = {p.get("op") for p in payloads}
    if len(ops) != 1:
        raise ValueError(f"parts of different ops cannot be merged: {sorted(map(str, ops))}")
    by_key, seen = {}, {}
    for name, p in zip(names, payloads, strict=True):
        commit_of = _part_commits(p)
        for r in p.get("rows", []):
            commit = commit_of.get((r["N"], r["K"]), commit_of.get(None))
            if replace and commit and "commit" not in r:  # a file of rows from several runs: each row says its own
                r = {**r, "commit": commit}
            if _key(r) in seen and not replace:
                raise ValueError(f"row {_key(r)} is in {seen[_key(r)]} and in {name}")
            seen[_key(r)] = name
            by_key[_key(r)] = r
    rows = sorted(by_key.values(), key=_key)
    out = {key: value for key, value in payloads[0].items() if key not in ("rows", "summary", "part", "elapsed_s")}
    parts = []
    for name, p in zip(names, payloads, strict=True):
        left = sum(seen[_key(r)] == name for r in p.get("rows", []))
        if p.get("parts"):  # a merged file: its own parts, then how many of its rows are left
            parts += p["parts"]
            parts.append({"file": name, "merged": True, "rows": len(p.get("rows", [])), "rows_left": left})
            continue
        parts.append({"file": name, "part": p.get("part"), "environment": p.get("environment"),
                      "copy_gbs": p.get("copy_gbs"), "rows": len(p.get("rows", [])), "complete": p.get("complete"),
                      "elapsed_s": p.get("elapsed_s"), **({"rows_left": left} if replace else {})})
    out["parts"] = parts
    out["complete"] = all(p.get("complete") for p in payloads)
    out["rows"] = rows
    out["summary"] = summary(rows)
    out["row_commits"] = row_commits(out)
    return out


# --- the autotuner's races ------------------------------------------------------------------------


def row_commits(payload: dict) -> dict[str, int]:
    """Rows per commit of a catalog file: a row's own `commit` (a file merged with --replace), else its part's."""
    commit_of = _part_commits(payload)
    out: dict[str, int] = {}
    for r in payload.get("rows", []):
        c = str(r.get("commit") or commit_of.get((r["N"], r["K"]), commit_of.get(None)) or "unknown")[:7]
        out[c] = out.get(c, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def races(race_files: list[dict], catalog: dict, before: dict | None = None, names=None) -> dict:
    """The autotuner's kept races of one GPU (nf4/linear/autotune.py's linear.json, copied out of the run) judged
    against the catalog run that made them: per M, the raced time of the tuned table's pick (this commit's rules)
    over that of the choice (`table_over_choice`), and the catalog's time of the chosen config over the fastest raced
    time of its key (a race times a random weight of the shape in CUDA graphs, the catalog the quantized one: two
    harnesses); which configs were chosen; the inversions of the catalog and, given `before` (the catalog file of
    an earlier commit), of that one."""
    from nf4.linear.tuned import NAMES, tuned

    entries: dict = {}
    for f in race_files:
        entries.update(f.get("entries") or {})
    gains: dict[int, list[float]] = {}
    rows = {_key(r): r for r in catalog.get("rows", []) if r.get("nf4_us")}
    by_m: dict[int, list[float]] = {}
    by_subset: dict[str, list[float]] = {}
    chosen: dict[str, int] = {}
    gpus = set()
    for text, e in entries.items():
        gpu, _fp, n, k, _bs, _nested, w_dt, x_dt, m = text.split("|")
        gpus.add(gpu)
        chosen[e["config"]] = chosen.get(e["config"], 0) + 1
        table = NAMES.get(tuned(gpu, int(m), n=int(n), k=int(k)))  # this commit's table, as the race's first entry
        if table in (e.get("us") or {}) and e["config"] in e["us"]:
            gains.setdefault(int(m), []).append(e["us"][table] / e["us"][e["config"]])
        r = rows.get((int(n), int(k), x_dt, int(m)))
        if r is not None and w_dt == x_dt and e.get("us"):
            value = r["nf4_us"] / min(e["us"].values())
            by_m.setdefault(int(m), []).append(value)
            by_subset.setdefault(cat.subset(int(n), int(k)), []).append(value)

    def judge(v: list[float]) -> dict:
        return {"keys": len(v), "median": statistics.median(v), "max": max(v), "over_10pct": sum(x > 1.1 for x in v)}

    judged = {str(m): judge(v) for m, v in sorted(by_m.items())}
    gain = {str(m): {"keys": len(v), "changed": sum(x > 1 for x in v), "median": statistics.median(v),
                     "p90": sorted(v)[int(0.9 * len(v))], "max": max(v)} for m, v in sorted(gains.items())}
    newest = (catalog.get("parts") or [catalog])[-1]
    out = {"device": catalog.get("device"), "environment": newest.get("environment"), "gpus_in_keys": sorted(gpus),
           "sources": names,
           "about": "nf4.linear's autotuner: each key's raced times (us) and choice, and the catalog run's time of the "
                    "choice over the fastest raced time, per M (experiments/catalog_bench.py races)",
           "table_over_choice": gain, "judged": judged,
           "judged_by_subset": {name: judge(v) for name, v in sorted(by_subset.items())},
           "chosen": dict(sorted(chosen.items(), key=lambda kv: -kv[1])),
           "catalog": {"inversions": inversions(catalog.get("rows", [])), "row_commits": row_commits(catalog)},
           "entries": entries}
    if before is not None:
        out["before"] = {"inversions": inversions(before.get("rows", [])), "row_commits": row_commits(before)}
    return out


# --- the GPU run ---------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _probe_us(fn, count: int) -> float:
    """One call's device time, roughly (two calls between CUDA events), to size the replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    fn(1 % count)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 2


def time_us(fn, count: int, calls: int = CALLS, reps: int = REPS) -> float:
    """Per-call CUDA-graph device time of fn(i) for i over `count` rotated inputs; raises on failure."""
    fn(0)
    est = _probe_us(fn, count)
    g = timing.graph_time_us(fn, list(range(count)), calls=_calls(est, count, calls), reps=reps)
    if not g or "median_us" not in g:
        raise RuntimeError((g or {}).get("error", "the call could not be captured in a CUDA graph"))
    return g["median_us"]


def _quantized_sets(n: int, k: int, seed: int):
    """One random bfloat16 normal weight quantized by bitsandbytes on the GPU, and clones of its packed tensor:
    (packed tensors, the QuantState)."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    packed, qs = F.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    del w
    copies = timing.rotation_count(weight_bytes(n, k))
    return [packed] + [packed.clone() for _ in range(copies - 1)], qs


def _states(qs, dtype, count: int) -> list:
    """`count` QuantStates of the weight whose dtype is `dtype` (each with its own tensors, for rotation)."""
    from verify.cases import clone_state

    return [clone_state(qs, dtype=dtype) for _ in range(count)]


def _peer_times(row: dict, names, timed: dict, count_of: dict, calls: int, reps: int, skip: dict) -> None:
    """Time each peer of `names` (timed: name -> fn(i)) into row["peers_us"], failures into row["errors"]; a peer
    in `skip` gets null, and its reason (if not None) in row["errors"]."""
    for name in names:
        row["peers_us"][name] = None
        if name in skip or name not in timed:
            if skip.get(name):
                row["errors"][name] = skip[name]
            continue
        try:
            row["peers_us"][name] = time_us(timed[name], count_of[name], calls, reps)
        except Exception as exc:  # a peer that cannot take this case is reported, not fatal
            row["errors"][name] = _error(exc)


def _line(row: dict) -> str:
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    m = f" M={row['M']:<4}" if "M" in row else ""
    peers_text = "  ".join(f"{name} {us(v)}" for name, v in row["peers_us"].items() if v is not None)
    return (f"{row['N']}x{row['K']} {row['dtype']}{m}  nf4 {us(row['nf4_us'])} us  floor {us(row['floor_us'])}  "
            f"{'exact' if row['exact'] else 'INEXACT'}  {peers_text}"
            + (f"  errors: {', '.join(row['errors'])}" if row["errors"] else ""))


def _config_text(config) -> str:
    import dataclasses

    from nf4.linear import tuned as linear_tuned

    name = linear_tuned.NAMES.get(config) if hasattr(config, "kernel") else None
    if name:
        return name
    try:
        return json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    except TypeError:
        return repr(config)


def _rotating(f, items: list):
    """fn(i): f on item i of `items`, rotated."""
    return lambda i: f(items[i % len(items)])


def dequant_shape(n: int, k: int, dtypes, copy_gbs: float, unsloth, unsloth_missing, *, calls=CALLS, reps=REPS,
                  log=print) -> list[dict]:
    """The dequant rows of one shape, one per dtype (see the module docstring)."""
    packed, qs = _quantized_sets(n, k, seed=n * 7919 + k)
    rows = []
    try:
        for dt in dtypes:
            rows.append(_dequant_row(n, k, DTYPES[dt], packed, qs, copy_gbs, unsloth, unsloth_missing, calls, reps))
            log(_line(rows[-1]), flush=True)
            _free()
    finally:
        packed.clear()
        del qs
        _free()
    return rows


def _free() -> None:
    """Give the device memory of the tensors just dropped back (one shape's weights at a time on the GPU)."""
    gc.collect()
    torch.cuda.empty_cache()


def _dequant_row(n, k, dtype, packed, qs, copy_gbs, unsloth, unsloth_missing, calls, reps) -> dict:
    import nf4
    from nf4.dequant import launch as dequant_launch
    from verify import peers
    from verify.exact import mismatch_count

    sets = list(zip(packed, _states(qs, dtype, len(packed)), strict=True))
    e = dtype.itemsize
    row = {"N": n, "K": k, "dtype": DTYPE_NAMES[dtype], "subset": cat.subset(n, k), "nf4_us": None,
           "peers_us": {}, "errors": {}, "floor_us": dequant_bytes(n, k, e) / (copy_gbs * 1e3),
           "bytes": dequant_bytes(n, k, e), "exact": False, "mismatches": None}
    try:
        row["nf4_config"] = _config_text(dequant_launch.tuned_config(packed[0].device, n * k * e))
    except Exception as exc:
        row["nf4_config"] = _error(exc)
    try:
        row["mismatches"] = mismatch_count(nf4.dequantize(*sets[0]), peers.bnb_dequantize(*sets[0]))
        row["exact"] = row["mismatches"] == 0
        if row["exact"]:
            row["nf4_us"] = time_us(_rotating(lambda s: nf4.dequantize(*s), sets), len(sets), calls, reps)
        else:
            row["errors"]["nf4"] = f"not bit-exact with bitsandbytes: {row['mismatches']} elements differ"
    except Exception as exc:
        row["errors"]["nf4"] = _error(exc)
    timed = {"bnb_dequantize_4bit": _rotating(lambda s: peers.bnb_dequantize(*s), sets)}
    skip = {}
    if unsloth is None:
        skip["unsloth_dequantize"] = f"Unsloth release not available: {unsloth_missing}"
    else:
        timed["unsloth_dequantize"] = _rotating(lambda s: unsloth.fast_dequantize(*s), sets)
    _peer_times(row, DEQUANT_PEERS, timed, dict.fromkeys(timed, len(sets)), calls, reps, skip)
    return row


def operand_x(m: int, k: int, dtype, device="cuda"):
    """x of the linear's operand check: row i is row i mod min(M, CHECK_ROWS) of the identity, negated for odd i.
    Returns (x, columns, signs)."""
    cols = torch.arange(m, device=device) % min(m, CHECK_ROWS, k)
    signs = torch.where(torch.arange(m, device=device) % 2 == 1, -1.0, 1.0)
    x = torch.zeros((m, k), dtype=dtype, device=device)
    x[torch.arange(m, device=device), cols] = signs.to(dtype)
    return x, cols, signs


def operand_expected(w, cols, signs):
    """Row i: signs[i] * w[:, cols[i]] (exact in w's dtype), every zero +0.0 (the sum of an exact product and zeros)."""
    y = w[:, cols].t() * signs.to(w.dtype)[:, None]
    return torch.where(y == 0, torch.zeros_like(y), y).contiguous()


def linear_shape(n: int, k: int, dtypes, ms, copy_gbs: float, unsloth, unsloth_missing, *, calls=CALLS, reps=REPS,
                 log=print, save=None) -> list[dict]:
    """The linear rows of one shape, one per dtype and M (see the module docstring); save(rows) after each dtype."""
    from nf4 import runtime

    packed, qs = _quantized_sets(n, k, seed=n * 7919 + k)
    device_name = runtime.device_name(packed[0].device)
    rows = []
    try:
        for dt in dtypes:
            rows += _linear_rows(n, k, DTYPES[dt], ms, packed, qs, device_name, copy_gbs, unsloth, unsloth_missing,
                                 calls, reps, log)
            _free()
            if save is not None:
                save(rows)
    finally:
        packed.clear()
        del qs
        _free()
    return rows


def _linear_rows(n, k, dtype, ms, packed, qs, device_name, copy_gbs, unsloth, unsloth_missing, calls, reps,
                 log) -> list[dict]:
    """The rows of one shape and dtype at every M."""
    from verify import peers

    e = dtype.itemsize
    sets = list(zip(packed, _states(qs, dtype, len(packed)), strict=True))
    w = peers.bnb_dequantize(*sets[0])
    dense = [w] + [w.clone() for _ in range(timing.rotation_count(n * k * e) - 1)]
    small = []
    if 1 in ms:
        gen = torch.Generator(device="cuda").manual_seed(n + 3 * k)
        small = [torch.randn((n, k // 4), device="cuda", generator=gen).to(dtype)
                 for _ in range(timing.rotation_count(n * (k // 4) * e))]
    rows = []
    for m in ms:
        rows.append(_linear_row(n, k, m, dtype, sets, w, dense, small, device_name, copy_gbs, unsloth,
                                unsloth_missing, calls, reps))
        log(_line(rows[-1]), flush=True)
    return rows


def _linear_row(n, k, m, dtype, sets, w, dense, small, device_name, copy_gbs, unsloth, unsloth_missing, calls,
                reps) -> dict:
    import bitsandbytes as bnb

    import nf4
    from nf4.linear import autotune
    from nf4.weight import NF4Weight
    from verify.exact import mismatch_count

    linear = torch.nn.functional.linear
    e = dtype.itemsize
    gen = torch.Generator(device="cuda").manual_seed(m * 131 + n + k)
    x = torch.randn((m, k), device="cuda", generator=gen).to(dtype)
    row = {"N": n, "K": k, "M": m, "dtype": DTYPE_NAMES[dtype], "subset": cat.subset(n, k), "nf4_us": None,
           "peers_us": {}, "errors": {}, "floor_us": linear_bytes(n, k, m, e) / (copy_gbs * 1e3),
           "bytes": linear_bytes(n, k, m, e), "exact": False, "mismatches": None}
    try:
        row["nf4_config"] = _config_text(autotune.pick_for(x, NF4Weight.from_state(*sets[0])))
    except Exception as exc:
        row["nf4_config"] = _error(exc)
    try:
        xid, cols, signs = operand_x(m, k, dtype)
        row["mismatches"] = mismatch_count(nf4.linear(xid, *sets[0]), operand_expected(w, cols, signs))
        row["exact"] = row["mismatches"] == 0
        del xid, cols, signs
        if row["exact"]:
            row["nf4_us"] = time_us(_rotating(lambda s: nf4.linear(x, *s), sets), len(sets), calls, reps)
        else:
            row["errors"]["nf4"] = f"operand check failed: {row['mismatches']} elements differ"
    except Exception as exc:
        row["errors"]["nf4"] = _error(exc)
    timed = {"bnb_matmul_4bit": _rotating(lambda s: bnb.matmul_4bit(x, s[0].t(), quant_state=s[1]), sets)}
    count_of = dict.fromkeys(LINEAR_PEERS, len(sets))
    skip = {}
    if m != 1:
        skip["unsloth_gemv"] = None
    elif unsloth is None:
        skip["unsloth_gemv"] = f"Unsloth release not available: {unsloth_missing}"
    else:
        timed["unsloth_gemv"] = _rotating(lambda s: unsloth.fast_gemv(x.view(1, 1, k), *s), sets)
    timed["dequant_then_cublas"] = _rotating(lambda s: linear(x, nf4.dequantize(*s)), sets)
    timed["dense_cublas"] = _rotating(lambda d: linear(x, d), dense)
    count_of["dense_cublas"] = len(dense)
    if m == 1 and small:
        x4 = x[:, : k // 4].contiguous()
        timed["same_bytes_cublas"] = _rotating(lambda d: linear(x4, d), small)
        count_of["same_bytes_cublas"] = len(small)
    else:
        skip["same_bytes_cublas"] = None
    _peer_times(row, LINEAR_PEERS, timed, count_of, calls, reps, skip)
    return row


def _peers_info(op: str, unsloth, unsloth_missing) -> dict:
    import bitsandbytes

    names = DEQUANT_PEERS if op == "dequant" else LINEAR_PEERS
    out = {"nf4": {"library": "nf4-triton", "version": timing.git_commit(),
                   "call": "nf4.dequantize(packed, quant_state)" if op == "dequant"
                   else "nf4.linear(x, packed, quant_state)"}}
    for name in names:
        info = {"call": PEER_CALLS[name]}
        if name.startswith("bnb"):
            info.update(library="bitsandbytes", version=bitsandbytes.__version__)
        elif name.startswith("unsloth"):
            from verify import unsloth_release

            info.update(library="unsloth", version=unsloth_release.VERSION, available=unsloth is not None)
            if unsloth is None:
                info["missing"] = unsloth_missing
            else:
                info["wheel_sha256"] = unsloth.provenance()["wheel_sha256"]
        else:
            info.update(library="torch", version=torch.__version__)
        out[name] = info
    return out


def run(args) -> dict:
    """The GPU run of `args` (op, shapes, dtypes, ms, part, out, calls, reps): measures, writes, returns the file."""
    from verify import peers

    shapes = select_part(args.shapes, args.part)
    ms = args.ms if args.op == "linear" else None
    unsloth = peers.unsloth_release()
    missing = peers.release_missing()
    copy = timing.copy_bandwidth_gbs()
    gbs = copy["gbs"]
    payload = {"op": args.op, "device": torch.cuda.get_device_name(), "environment": timing.environment(),
               "copy_gbs": gbs, "copy": copy, "peers": _peers_info(args.op, unsloth, missing),
               "selection": args.shapes_text, "part": f"{args.part[0]}/{args.part[1]}",
               "shapes": [f"{n}x{k}" for n, k in shapes], "dtypes": [DTYPE_NAMES[DTYPES[d]] for d in args.dtypes],
               "blocksize": BLOCKSIZE, "double_quant": True, "weights": "bfloat16 normal, quantize_4bit on the GPU",
               "timing": {"calls": args.calls, "reps": args.reps, "replay_us": REPLAY_US,
                          "what": "verify.timing.graph_time_us median, rotating weights"},
               "rows": [], "complete": False}
    if ms is not None:
        payload["ms"] = list(ms)
    est = estimate_s(args.op, shapes, args.dtypes, ms or MS, copy_gbs=gbs, calls=args.calls, reps=args.reps,
                     unsloth=unsloth is not None)
    print(f"{payload['device']}: {args.op}, {len(shapes)} shapes x {len(args.dtypes)} dtypes"
          + (f" x {len(ms)} M" if ms else "") + f"; copy {gbs:.0f} GB/s; Unsloth "
          + ("loaded" if unsloth is not None else f"missing ({missing})")
          + f"; estimate ~{est + COMPILE_S[args.op]:.0f} s (~{COMPILE_S[args.op]:.0f} s of it Triton's first "
          "compiles)", flush=True)
    t0 = time.time()
    done_est = first_s = first_est = 0.0
    for index, (n, k) in enumerate(shapes):
        before = list(payload["rows"])

        def save(rows, before=before):
            payload["rows"] = before + rows
            payload["summary"] = summary(payload["rows"])
            payload["elapsed_s"] = round(time.time() - t0, 1)
            timing.write_json(args.out, payload)

        if args.op == "dequant":
            save(dequant_shape(n, k, args.dtypes, gbs, unsloth, missing, calls=args.calls, reps=args.reps))
        else:
            save(linear_shape(n, k, args.dtypes, ms, gbs, unsloth, missing, calls=args.calls, reps=args.reps,
                              save=save))
        done_est += estimate_s(args.op, [(n, k)], args.dtypes, ms or MS, copy_gbs=gbs, calls=args.calls,
                               reps=args.reps, unsloth=unsloth is not None)
        elapsed = time.time() - t0
        if index == 0:  # the first shape's time holds the compiles: the rate is taken from the later ones
            first_s, first_est = elapsed, done_est
        rate = (elapsed - first_s) / (done_est - first_est) if index else 1.0
        left = (est - done_est) * rate
        print(f"-- shape {index + 1}/{len(shapes)} done, {elapsed:.0f} s, about {left:.0f} s left", flush=True)
    payload["complete"] = True
    payload["summary"] = summary(payload["rows"])
    payload["elapsed_s"] = round(time.time() - t0, 1)
    timing.write_json(args.out, payload)
    return payload


def _print_summary(s: dict) -> None:
    def f(v):
        return "-" if v is None else f"{v:.2f}"

    print(f"{s['rows']} rows, {s['exact']} exact, {s['inexact']} inexact; nf4_us / floor_us "
          f"{f(s['nf4_over_floor']['min'])} / {f(s['nf4_over_floor']['median'])} / {f(s['nf4_over_floor']['max'])}")
    for name, p in s["peers"].items():
        print(f"  {name:<22} speedup min {f(p['speedup_min'])}  median {f(p['speedup_median'])}  "
              f"max {f(p['speedup_max'])}  nf4 slower on {p['nf4_slower']} of {p['n']}")
    if "inversions" in s:
        inv = s["inversions"]
        print(f"  inversions (M <= {INVERSION_MAX_M}): {inv['count']} of {inv['pairs']} pairs")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments catalog-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="op", required=True)
    for op in OPS:
        p = sub.add_parser(op, help=f"GPU: time the {op} on the catalog's shapes")
        p.add_argument("--out", required=True, help="result file (JSON), e.g. results/catalog/" + op + "_h100.json")
        p.add_argument("--shapes", default="all", help="all, fit, held-out, or NxK,NxK,... (default all)")
        p.add_argument("--dtypes", type=parse_dtypes, default=list(DTYPES), help="comma list of bf16, fp16")
        if op == "linear":
            p.add_argument("--ms", type=parse_ms, default=list(MS), help="comma list of M (rows of x)")
        p.add_argument("--part", type=parse_part, default=(0, 1), help="i/n: shapes i, i + n, ... (0 <= i < n)")
        p.add_argument("--calls", type=int, default=CALLS, help="calls a graph replay holds (fewer for long calls)")
        p.add_argument("--reps", type=int, default=REPS, help="graph replays timed")
    mg = sub.add_parser("merge", help="join the parts of one op's run on one device")
    mg.add_argument("out")
    mg.add_argument("inputs", nargs="+")
    mg.add_argument("--replace", action="store_true",
                    help="a later input's row replaces an earlier one's (a re-run of some rows over a merged file)")
    rc = sub.add_parser("races", help="judge the autotuner's races of one GPU against the catalog run that made them")
    rc.add_argument("out")
    rc.add_argument("inputs", nargs="+", help="the runs' linear.json files (NF4_CACHE_DIR), copied out")
    rc.add_argument("--catalog", required=True, help="the catalog file of the same runs")
    rc.add_argument("--before", help="the catalog file of an earlier commit (its inversions beside)")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.op == "races":
        try:
            files = [json.loads(Path(p).read_text()) for p in args.inputs]
            before = json.loads(Path(args.before).read_text()) if args.before else None
            out = races(files, json.loads(Path(args.catalog).read_text()), before, list(args.inputs))
        except (OSError, ValueError) as exc:
            print(f"catalog-bench races: {exc}", file=sys.stderr)
            return 1
        timing.write_json(args.out, out)
        print(f"wrote {args.out} ({len(out['entries'])} keys); chosen {out['chosen']}")
        for m, j in out["judged"].items():
            print(f"  M={m:>4}: {j['keys']} keys, catalog / fastest raced median {j['median']:.3f} max {j['max']:.3f}, "
                  f"over 10 % on {j['over_10pct']}")
        print(f"  inversions {out['catalog']['inversions']['count']}"
              + (f" (before: {out['before']['inversions']['count']})" if before is not None else ""))
        return 0
    if args.op == "merge":
        try:
            payloads = [json.loads(Path(p).read_text()) for p in args.inputs]
            merged = merge(payloads, list(args.inputs), replace=args.replace)
        except (OSError, ValueError) as exc:
            print(f"catalog-bench merge: {exc}", file=sys.stderr)
            return 1
        timing.write_json(args.out, merged)
        print(f"wrote {args.out} ({len(merged['rows'])} rows from {len(payloads)} parts)")
        _print_summary(merged["summary"])
        return 0
    try:
        args.shapes_text, args.shapes = args.shapes, parse_shapes(args.shapes)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(f"catalog-bench {args.op} needs a CUDA GPU (it times GPU kernels); nothing measured, nothing written",
              file=sys.stderr)
        return 2
    payload = run(args)
    print(f"wrote {args.out} ({len(payload['rows'])} rows, {payload['elapsed_s']:.0f} s)")
    _print_summary(payload["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
