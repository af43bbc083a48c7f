"""Tuning nf4.dequantize that generalizes: a sweep of DequantConfigs on the catalog, and rules fit on its fit subset.

    python -m experiments tune-dequant sweep --out build/tune/dequant_sweep_h100.json [--shapes fit|held-out|all]
        [--dtypes bf16,fp16] [--budget-s 420]
    python -m experiments tune-dequant fit build/tune/dequant_sweep_h100.json [...] --out-table nf4/dequant/tuned.json
        [--report build/tune/dequant_fit.json]

`sweep` (GPU only: exit 2 and no file without a CUDA GPU). Per shape (experiments.catalog's, a subset, or NxK,...)
one random bfloat16 normal weight is quantized on the GPU by bitsandbytes (blocksize 64, double quantization, the
seed catalog-bench uses) and cloned for rotation (verify.timing.rotation_count: a replay walks through more than the
L2 cache). Per dtype and candidate config, `nf4.dequantize(packed, quant_state, config=...)` is first checked bit for
bit (int16 views) against bitsandbytes' `dequantize_4bit` on the first weight (an inexact config gets no time and is
never chosen), then timed by CUDA-graph device time over the rotating weights (`catalog_bench.time_us`:
verify.timing.graph_time_us, CALLS calls a replay, fewer for long calls, never fewer than the weights rotated, the
median of REPS replays). Timed beside the grid: today's tuned config (`config=None`, what a user gets; key "today").
The file holds the copy bandwidth (verify.timing.copy_bandwidth_gbs) and per row its byte floor (verify.timing.
nf4_bytes at that bandwidth).

The grid (`grid()`, GRID_SIZE = 28 configs) and why it is this size. Candidates are tile_bytes in 256..4096 (powers of
two), num_warps in 1, 2, 4, 8 and programs_per_sm 0 (one program per tile) or 2, 4, 8 (a persistent grid striding
over the tiles); every other DequantConfig field keeps its default. Pruned (`prune_reason`): a thread with fewer than
1 or more than 16 of the 32-bit words (tile_bytes / 4 / (32 * num_warps)): fewer leaves threads idle, more spills
registers for nothing a memory-bound kernel needs; a persistent grid with fewer than 16 or more than 64 resident warps
per multiprocessor (programs_per_sm * num_warps): fewer cannot keep enough loads in flight, more do not fit on an SM
(64 warps on sm_80/sm_90) and only queue, as one program per tile does; and a persistent program with more than 2
words a thread: it loops over tiles already, so a larger tile only adds registers. That leaves 16 one-program-per-tile
configs and 12 persistent ones. The budget sets the count: one timing of a shape holds at least the rotated weights'
count of captured calls (thousands for the smallest shapes), and one pass of one config over the fit subset (104
shapes x 2 dtypes) costs about 6 s by `estimate_s` (3.7 s of it host time capturing about 58,000 calls). With 29
timings a row (28 and today's), the setup of each shape and dtype and ~25 s of compiles (58 kernels in 8 worker
processes), the estimate is ~270 s for the fit subset on an H100 (copy ~3000 GB/s) or an H200 (~4250 GB/s), ~95 s
more for the held-out subset (--shapes all: ~365 s): one ~7-minute device call either way. The 64 configs that the
words rule alone leaves would take ~510 s for the fit subset, over the budget.

The run is cost-aware: fit shapes first, then held-out ones; within each, round robin over size bands (powers of two
of the output bytes), the cheapest shape of a band first, so a run cut short has shapes of every size. `--budget-s`
(default 420 s, counted from the start of measuring) skips a shape whose estimate (scaled by the measured rate of the
shapes before) would pass it and stops a shape cut off mid-way without keeping it; the file is written after every
shape (`complete`: false and `skipped` while shapes are missing). The run prints its estimate first.

`fit` (anywhere). From the rows of the fit subset only (experiments.catalog.subset of N x K; the held-out rows never
enter a choice), per GPU (the sweep's device named by `gpu_key`: "H100", "H200"), a table of rows by output bytes:
thresholds at powers of two (between two neighbouring fit sizes, the power of two nearest their geometric middle), at
most MAX_ROWS rows, each band holding at least MIN_BAND_SHAPES fit shapes. Each band takes the config with the best
geometric-mean time over its fit shapes and dtypes; configs within TIE of the best are ties, and the simplest of them
wins (`simplicity`: one program per tile before persistent, then fewer programs per SM, smaller tiles, fewer warps).
Of the partitions, the one with the fewest rows whose geometric-mean ratio (rule / per-shape best, fit rows) is within
ROW_GAIN of the best partition's. A config inexact on any fit row is never chosen. It writes `--out-table` in
nf4/dequant/tuned.json's format (the swept GPUs' entries replaced, other GPUs' kept), naming the sweep files in
"source" and stating the rule in "why", and the report (`--report`): per GPU and shape, the rule's config time over
the best time the sweep found for that shape (min / median / max / geometric mean per subset; the bar: the held-out
median within 3% of the fit median) and over today's config, and the fraction of the copy bandwidth the rule's config
reaches (floor_us / time; the bar: >= 90% on every shape of 16M weights or more).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

from nf4.dequant.config import DequantConfig
from verify import timing

from . import catalog as cat
from . import catalog_bench as cb

ROOT = Path(__file__).resolve().parent.parent
OP = "tune-dequant-sweep"
TILE_BYTES = (256, 512, 1024, 2048, 4096)
NUM_WARPS = (1, 2, 4, 8)
PERSISTENT = (2, 4, 8)  # programs_per_sm of the persistent candidates (0: one program per tile)
WORDS_MIN, WORDS_MAX = 1, 16  # 32-bit words a thread
PERSIST_WORDS_MAX = 2
RESIDENT_WARPS_MIN, RESIDENT_WARPS_MAX = 16, 64  # warps a multiprocessor holds of a persistent grid
GRID_FIELDS = ("tile_bytes", "num_warps", "programs_per_sm")
THREADS_PER_WARP = 32
TODAY = "today"
CALLS, REPS = 10, 5
BUDGET_S = 420.0
# estimate: per shape and dtype (rotated states, bitsandbytes' reference), per exact check, per compile, per worker
SETUP_S, CHECK_S, COMPILE_S, WORKER_START_S = 0.3, 0.004, 1.5, 12.0
WARM_SHAPE = (256, 4096)  # the weight the compiles run on
# fit
MAX_ROWS, MIN_BAND_SHAPES, TIE, ROW_GAIN = 4, 6, 0.003, 0.005
BIG_WEIGHTS = 16_000_000  # "16M weights or more", as the catalog writes weights (1e6)
COPY_BAR, HELD_OUT_TOLERANCE = 0.90, 0.03
ABOUT = ("Tuned DequantConfig fields per GPU (a substring of torch.cuda.get_device_name) and output size: rows of "
         "(largest output bytes or null, fields). A GPU with no rows takes the default GPU's. Each GPU names the "
         "result files its rows came from.")


class OutOfTime(Exception):
    """The budget ran out in the middle of a shape."""


# --- the grid ------------------------------------------------------------------------------------


def words_per_thread(tile_bytes: int, num_warps: int) -> float:
    """32-bit words of packed bytes each thread of a program takes per tile."""
    return tile_bytes / 4 / (THREADS_PER_WARP * num_warps)


def prune_reason(tile_bytes: int, num_warps: int, programs_per_sm: int) -> str | None:
    """Why a candidate is left out of the grid (None: it stays)."""
    words = words_per_thread(tile_bytes, num_warps)
    if words < WORDS_MIN:
        return f"{words:g} words a thread (threads idle)"
    if words > WORDS_MAX:
        return f"{words:g} words a thread (more than {WORDS_MAX})"
    if programs_per_sm:
        resident = programs_per_sm * num_warps
        if not RESIDENT_WARPS_MIN <= resident <= RESIDENT_WARPS_MAX:
            return f"{resident} resident warps per SM (persistent grids: {RESIDENT_WARPS_MIN}-{RESIDENT_WARPS_MAX})"
        if words > PERSIST_WORDS_MAX:
            return f"{words:g} words a thread in a persistent program (at most {PERSIST_WORDS_MAX})"
    return None


def grid() -> list[dict]:
    """The candidate configs' fields (GRID_FIELDS), one program per tile first, then persistent."""
    out = []
    for pps in (0, *PERSISTENT):
        for tile, warps in itertools.product(TILE_BYTES, NUM_WARPS):
            if prune_reason(tile, warps, pps) is None:
                out.append({"tile_bytes": tile, "num_warps": warps, "programs_per_sm": pps})
    return out


def config_key(fields: dict) -> str:
    """'t1024_w4_p0': tile bytes, warps, programs per SM (0: one program per tile)."""
    return f"t{fields['tile_bytes']}_w{fields['num_warps']}_p{fields.get('programs_per_sm', 0)}"


def grid_fields(config: DequantConfig) -> dict:
    return {name: getattr(config, name) for name in GRID_FIELDS}


def simplicity(fields: dict) -> tuple:
    """Smaller is simpler: one program per tile before a persistent grid, then fewer programs per SM, smaller
    tiles, fewer warps."""
    pps = fields.get("programs_per_sm", 0)
    return (pps > 0, pps, fields["tile_bytes"], fields["num_warps"])


def describe(fields: dict) -> str:
    words = words_per_thread(fields["tile_bytes"], fields["num_warps"])
    pps = fields.get("programs_per_sm", 0)
    grid_text = f"{pps} persistent programs per SM" if pps else "one program per tile"
    return (f"{fields['tile_bytes']}-byte tiles, {fields['num_warps']} warp{'s' if fields['num_warps'] > 1 else ''}, "
            f"{grid_text} ({words:g} word{'s' if words != 1 else ''} a thread)")


GRID_SIZE = len(grid())


def gpu_key(device_name: str) -> str:
    """The table's key for a GPU: its model token ('NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA A100-SXM4-80GB' ->
    'A100'), else the whole name."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name)
    return m.group(1) if m else device_name


def human_bytes(v: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if v >= 1 << shift and v % (1 << shift) == 0:
            return f"{v >> shift} {unit}"
    return f"{v} bytes"


# --- cost and order ------------------------------------------------------------------------------


def _elem(dt: str) -> int:
    return torch.empty((), dtype=cb.DTYPES[dt]).element_size()


def timing_cost_s(est_us: float, count: int, calls: int = CALLS, reps: int = REPS) -> float:
    """One catalog_bench.time_us: host work (a capture of C calls) and device work (6 + C * (reps + 1) calls)."""
    est_us = max(est_us, cb.MIN_CALL_US)
    c = max(count, min(calls, math.ceil(cb.REPLAY_US / est_us)))
    return cb.TIMING_S + c * cb.HOST_CALL_S + est_us * 1e-6 * (6 + c * (reps + 1))


def shape_cost_s(n: int, k: int, dtypes, timings: int, *, copy_gbs: float = 3000.0, calls: int = CALLS,
                 reps: int = REPS) -> float:
    """A shape's estimated seconds: per dtype the setup and `timings` exact checks and timings, each call at the
    byte floor."""
    count = timing.rotation_count(cb.weight_bytes(n, k))
    total = 0.0
    for dt in dtypes:
        est = cb.dequant_bytes(n, k, _elem(dt)) / (copy_gbs * 1e3)
        total += SETUP_S + timings * (CHECK_S + timing_cost_s(est, count, calls, reps))
    return total


def compile_cost_s(configs: int, dtypes: int, jobs: int) -> float:
    """The compiles' estimated seconds: in `jobs` worker processes (0: in this one)."""
    kernels = configs * dtypes
    if jobs <= 0:
        return kernels * COMPILE_S
    return WORKER_START_S + math.ceil(kernels / jobs) * COMPILE_S


def estimate_s(shapes, dtypes, timings: int = GRID_SIZE + 1, **kw) -> float:
    """The shapes' estimated seconds, compiles not counted."""
    return sum(shape_cost_s(n, k, dtypes, timings, **kw) for n, k in shapes)


def shape_order(shapes, cost) -> list:
    """Fit shapes first, then held-out ones (a shape's subset by experiments.catalog.subset); within each, round robin
    over size bands (the power of two of 2 * N * K, a 16-bit output's bytes), the cheapest (cost(n, k)) first."""
    out = []
    for subset in (cat.FIT, cat.HELD_OUT):
        bands: dict[int, list] = defaultdict(list)
        for n, k in dict.fromkeys(tuple(s) for s in shapes):
            if cat.subset(n, k) == subset:
                bands[(2 * n * k).bit_length()].append((n, k))
        queues = [sorted(v, key=lambda s: (cost(*s), s)) for _, v in sorted(bands.items())]
        while any(queues):
            for q in queues:
                if q:
                    out.append(q.pop(0))
    return out


# --- the sweep loop (no GPU in it: measure is handed in) --------------------------------------------


def sweep(shapes, payload: dict, out, *, measure, cost, budget_s: float, started: float | None = None,
          clock=time.monotonic, log=print) -> dict:
    """Measure `shapes` in order (measure(n, k, deadline) -> rows; raises OutOfTime past the deadline) into
    payload["rows"], writing `out` after every shape. A shape whose cost(n, k), scaled by the rate measured so far,
    would pass the budget is skipped (the next, cheaper one may still fit); a shape cut off mid-way is not kept and
    ends the run."""
    t0 = clock() if started is None else started
    deadline = t0 + budget_s
    payload.setdefault("rows", [])
    payload.setdefault("skipped", [])
    payload.setdefault("errors", {})
    spent = est_done = 0.0
    left = list(shapes)
    while left:
        n, k = left.pop(0)
        name = f"{n}x{k}"
        est = cost(n, k)
        rate = spent / est_done if est_done else 1.0
        now = clock()
        if now + est * rate > deadline:
            payload["skipped"].append(name)
            log(f"-- {name}: skipped, about {est * rate:.0f} s would pass the budget ({deadline - now:.0f} s left)",
                flush=True)
            continue
        try:
            rows = measure(n, k, deadline)
        except OutOfTime:
            payload["skipped"] += [name] + [f"{a}x{b}" for a, b in left]
            payload["stopped"] = f"the budget of {budget_s:.0f} s ran out during {name} (not kept)"
            log(f"-- {payload['stopped']}", flush=True)
            break
        except Exception as exc:  # a shape that cannot run (memory) is reported, not fatal
            payload["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            rows = []
        spent += clock() - now
        est_done += est
        payload["rows"] += rows
        payload["elapsed_s"] = round(clock() - t0, 1)
        payload["complete"] = not left and not payload["skipped"]
        timing.write_json(out, payload)
        rest = sum(cost(a, b) for a, b in left) * (spent / est_done)
        log(f"-- {name} done: {len(payload['rows'])} rows, {clock() - t0:.0f} s, about {rest:.0f} s left "
            f"(budget {budget_s:.0f} s)", flush=True)
    payload["complete"] = not payload["skipped"] and not payload["errors"]
    payload["elapsed_s"] = round(clock() - t0, 1)
    timing.write_json(out, payload)
    return payload


# --- the GPU part --------------------------------------------------------------------------------


def _quantized(n: int, k: int, count: int | None = None):
    """catalog_bench's weight for N x K (same seed) and clones of its packed tensor: (packed tensors, QuantState)."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device="cuda").manual_seed(n * 7919 + k)
    w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    packed, qs = F.quantize_4bit(w, blocksize=cb.BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    del w
    count = timing.rotation_count(cb.weight_bytes(n, k)) if count is None else count
    return [packed] + [packed.clone() for _ in range(count - 1)], qs


def _candidates(grid_rows: list[dict]) -> list[tuple[str, DequantConfig | None]]:
    return [(config_key(f), DequantConfig(**f)) for f in grid_rows] + [(TODAY, None)]


def measure_shape(n: int, k: int, deadline: float, *, dtypes, grid_rows, copy_gbs: float, calls: int = CALLS,
                  reps: int = REPS, log=print) -> list[dict]:
    """The rows of one shape, one per dtype: every candidate checked exact, then timed (see the module docstring)."""
    import nf4
    from nf4.dequant import launch as dequant_launch
    from verify import peers
    from verify.cases import clone_state
    from verify.exact import mismatch_count

    packs, qs = _quantized(n, k)
    count = len(packs)
    rows = []
    try:
        for dt in dtypes:
            dtype = cb.DTYPES[dt]
            e = dtype.itemsize
            sets = list(zip(packs, [clone_state(qs, dtype=dtype) for _ in range(count)], strict=True))
            ref = peers.bnb_dequantize(*sets[0])
            today = dequant_launch.tuned_config(packs[0].device, n * k * e)
            today_fields = grid_fields(today)
            row = {"N": n, "K": k, "dtype": cb.DTYPE_NAMES[dtype], "subset": cat.subset(n, k), "weights": n * k,
                   "out_bytes": n * k * e, "bytes": cb.dequant_bytes(n, k, e),
                   "floor_us": cb.dequant_bytes(n, k, e) / (copy_gbs * 1e3), "rotation": count, "configs": {},
                   "today_fields": asdict(today),
                   "today_key": config_key(today_fields) if today == DequantConfig(**today_fields) else None}
            for key, config in _candidates(grid_rows):
                if time.monotonic() > deadline:
                    raise OutOfTime
                entry = {"us": None, "exact": False, "mismatches": None}
                try:
                    got = nf4.dequantize(*sets[0], config=config)
                    entry["mismatches"] = mismatch_count(got, ref)
                    del got
                    entry["exact"] = entry["mismatches"] == 0
                    if entry["exact"]:
                        entry["us"] = cb.time_us(lambda i, c=config, s=sets: nf4.dequantize(*s[i], config=c),
                                                 count, calls, reps)
                except Exception as exc:  # a config that cannot run here is recorded, never chosen
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["configs"][key] = entry
            timed = {key: v["us"] for key, v in row["configs"].items() if key != TODAY and v["us"] is not None}
            row["best"] = min(timed, key=timed.get) if timed else None
            row["best_us"] = timed.get(row["best"])
            rows.append(row)
            t = row["configs"][TODAY]["us"]
            log(f"{n}x{k} {row['dtype']}: best {row['best']} {row['best_us'] or float('nan'):.1f} us, today "
                f"{t or float('nan'):.1f} us, floor {row['floor_us']:.1f} us, "
                f"{sum(not v['exact'] for v in row['configs'].values())} inexact", flush=True)
            del sets, ref
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        packs.clear()
        del qs
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def compile_all(grid_rows: list[dict], dtypes) -> dict:
    """Run every candidate once per dtype on a small weight (Triton compiles each); returns key -> error."""
    import nf4
    from verify.cases import clone_state

    errors = {}
    packs, qs = _quantized(*WARM_SHAPE, count=1)
    for dt in dtypes:
        state = clone_state(qs, dtype=cb.DTYPES[dt])
        for key, config in _candidates(grid_rows):
            try:
                nf4.dequantize(packs[0], state, config=config)
            except Exception as exc:
                errors[f"{key}:{dt}"] = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.synchronize()
    return errors


def compile_parallel(grid_rows: list[dict], dtypes, jobs: int, log=print) -> dict:
    """compile_all split over `jobs` worker processes (they fill Triton's on-disk cache, which this process then
    reads), then in this process (cache hits; anything a worker missed compiles here). Returns key -> error."""
    if jobs > 0:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        keys = [config_key(f) for f in grid_rows]
        with tempfile.TemporaryDirectory() as tmp:
            logs = [Path(tmp) / f"worker{i}.log" for i in range(min(jobs, len(keys)))]
            procs = []
            for i, path in enumerate(logs):
                with path.open("w") as err:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "experiments", "tune-dequant", "compile-worker", "--keys",
                         ",".join(keys[i::len(logs)]), "--dtypes", ",".join(dtypes)],
                        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
            for p, path in zip(procs, logs, strict=True):
                if p.wait():
                    log(f"a compile worker failed (rc {p.returncode}); this process compiles its configs instead: "
                        f"{path.read_text()[-300:]}", flush=True)
    return compile_all(grid_rows, dtypes)


def run_sweep(args) -> dict:
    """The GPU sweep of `args`: copy bandwidth, compiles, then `sweep` over the ordered shapes."""
    from nf4.dequant import tuned as dequant_tuned

    started = time.monotonic()
    grid_rows = grid()
    device = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    copy = timing.copy_bandwidth_gbs()
    gbs = copy["gbs"]
    timings = len(grid_rows) + 1

    def cost(n, k):
        return shape_cost_s(n, k, args.dtypes, timings, copy_gbs=gbs, calls=args.calls, reps=args.reps)

    shapes = shape_order(args.shapes, cost)
    est = sum(cost(n, k) for n, k in shapes)
    compile_est = compile_cost_s(timings, len(args.dtypes), args.compile_jobs)
    print(f"{device} ({props.multi_processor_count} SMs): copy {gbs:.0f} GB/s; {len(shapes)} shapes x "
          f"{len(args.dtypes)} dtypes x {timings} configs ({len(grid_rows)} of the grid and today's); estimate "
          f"~{est + compile_est:.0f} s (~{compile_est:.0f} s of it compiles); budget {args.budget_s:.0f} s"
          + ("" if est + compile_est <= args.budget_s else "; the budget will skip some shapes"), flush=True)
    t_compile = time.monotonic()
    compile_errors = compile_parallel(grid_rows, args.dtypes, args.compile_jobs)
    compile_s = time.monotonic() - t_compile
    print(f"compiles: {compile_s:.0f} s" + (f", {len(compile_errors)} failed" if compile_errors else ""), flush=True)
    payload = {
        "op": OP, "device": device, "gpu": gpu_key(device), "sm_count": props.multi_processor_count,
        "environment": timing.environment(), "copy_gbs": gbs, "copy": copy, "selection": args.shapes_text,
        "order": [f"{n}x{k}" for n, k in shapes], "dtypes": [cb.DTYPE_NAMES[cb.DTYPES[d]] for d in args.dtypes],
        "blocksize": cb.BLOCKSIZE, "double_quant": True, "weights": "bfloat16 normal, quantize_4bit on the GPU",
        "grid": {config_key(f): f for f in grid_rows}, "defaults": asdict(DequantConfig()),
        "tuned_table": dequant_tuned.DATA,
        "timing": {"calls": args.calls, "reps": args.reps, "replay_us": cb.REPLAY_US,
                   "what": "verify.timing.graph_time_us median, rotating weights (experiments.catalog_bench.time_us)"},
        "budget_s": args.budget_s, "estimate_s": round(est + compile_est, 1), "compile_s": round(compile_s, 1),
        "compile_errors": compile_errors, "rows": [], "skipped": [], "errors": {}, "complete": False,
    }
    timing.write_json(args.out, payload)

    def measure(n, k, deadline):
        return measure_shape(n, k, deadline, dtypes=args.dtypes, grid_rows=grid_rows, copy_gbs=gbs,
                             calls=args.calls, reps=args.reps)

    return sweep(shapes, payload, args.out, measure=measure, cost=cost, budget_s=args.budget_s, started=started)


# --- the fit -------------------------------------------------------------------------------------


def _time(row: dict, key: str) -> float | None:
    """A config's time on a row: None where it was not measured, failed or was inexact."""
    e = row.get("configs", {}).get(key)
    if not e or e.get("exact") is not True or e.get("us") is None:
        return None
    return float(e["us"])


def _best(row: dict, keys) -> tuple[str | None, float | None]:
    timed = {key: t for key in keys if (t := _time(row, key)) is not None}
    if not timed:
        return None, None
    key = min(timed, key=lambda c: (timed[c], c))
    return key, timed[key]


def load_sweeps(paths) -> dict:
    """Sweep files grouped per GPU (gpu_key): {gpu: {"devices", "sources", "rows", "grid", "copy_gbs", "sm_count"}}.
    ValueError for a file that is not a sweep, a grid key whose fields differ between files, or a row measured
    twice for one GPU."""
    out: dict[str, dict] = {}
    for path in paths:
        payload = json.loads(Path(path).read_text())
        if payload.get("op") != OP or "grid" not in payload:
            raise ValueError(f"{path} is not a tune-dequant sweep (op {payload.get('op')!r})")
        gpu = payload.get("gpu") or gpu_key(payload["device"])
        g = out.setdefault(gpu, {"devices": [], "sources": [], "rows": [], "grid": {}, "copy_gbs": [],
                                 "sm_count": payload.get("sm_count"), "seen": {}})
        g["devices"] = list(dict.fromkeys([*g["devices"], payload["device"]]))
        g["sources"].append(_source_name(path))
        g["copy_gbs"].append(payload.get("copy_gbs"))
        for key, fields in payload["grid"].items():
            if g["grid"].setdefault(key, fields) != fields:
                raise ValueError(f"{path}: grid key {key} is {fields}, another file has {g['grid'][key]}")
        for r in payload.get("rows", []):
            rk = (r["N"], r["K"], r["dtype"])
            if rk in g["seen"]:
                raise ValueError(f"{gpu}: row {rk} is in {g['seen'][rk]} and in {path}")
            g["seen"][rk] = path
            g["rows"].append(r)
    for g in out.values():
        del g["seen"]
    return out


def _source_name(path) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def _threshold(lo: int, hi: int) -> int | None:
    """The power of two between two neighbouring fit sizes (lo <= 2**p < hi) nearest their geometric middle (the
    smaller on a tie), or None."""
    first, last = (lo - 1).bit_length(), (hi - 1).bit_length() - 1  # 2**first >= lo, 2**last < hi
    if first > last:
        return None
    middle = (math.log2(lo) + math.log2(hi)) / 2
    return 1 << min(range(first, last + 1), key=lambda p: (abs(p - middle), p))


def choose(rows: list[dict], keys, fields: dict, tie: float = TIE) -> tuple[str | None, float]:
    """The config with the best geometric-mean time over `rows` (each must have a time for it); configs within `tie`
    of the best are ties, the simplest wins. Returns (key, its mean log time) or (None, inf)."""
    scores = {}
    for key in keys:
        ts = [_time(r, key) for r in rows]
        if rows and all(t is not None for t in ts):
            scores[key] = sum(math.log(t) for t in ts) / len(ts)
    if not scores:
        return None, math.inf
    best = min(scores.values())
    tied = [key for key, s in scores.items() if s <= best + math.log1p(tie)]
    key = min(tied, key=lambda c: (simplicity(fields[c]), c))
    return key, scores[key]


def fit_rule(rows: list[dict], fields: dict, *, max_rows: int = MAX_ROWS, min_shapes: int = MIN_BAND_SHAPES,
             tie: float = TIE, row_gain: float = ROW_GAIN) -> dict:
    """The rule for one GPU from its fit-subset rows (the others are dropped here): see the module docstring.
    fields: grid key -> DequantConfig fields. Returns rows ([[limit or None, fields], ...]), bands, the partitions
    considered per row count, the configs left out as inexact, and the fit rows' count."""
    fit_rows = sorted((r for r in rows if cat.subset(r["N"], r["K"]) == cat.FIT),
                      key=lambda r: (r["out_bytes"], r["N"], r["K"], r["dtype"]))
    if not fit_rows:
        raise ValueError("no fit-subset rows to fit on")
    inexact = sorted({key for r in fit_rows for key, e in r.get("configs", {}).items()
                      if key in fields and e.get("exact") is False})
    keys = sorted(key for key in fields if key not in inexact)
    fit_rows = [r for r in fit_rows if _best(r, keys)[0] is not None]  # a row with no exact time says nothing
    if not fit_rows:
        raise ValueError("no fit-subset row has an exact time")
    best_log = [math.log(_best(r, keys)[1]) for r in fit_rows]
    sizes = [r["out_bytes"] for r in fit_rows]
    # cut positions: index i such that rows[:i] lie at or under the threshold
    cuts = []
    for i in range(1, len(fit_rows)):
        if sizes[i - 1] < sizes[i] and (limit := _threshold(sizes[i - 1], sizes[i])) is not None:
            cuts.append((i, limit))

    memo: dict[tuple[int, int], tuple] = {}

    def band(lo: int, hi: int):
        if (lo, hi) not in memo:
            part = fit_rows[lo:hi]
            shapes = {(r["N"], r["K"]) for r in part}
            whole = lo == 0 and hi == len(fit_rows)  # one row for every size needs no minimum
            key, score = choose(part, keys, fields, tie) if whole or len(shapes) >= min_shapes else (None, math.inf)
            loss = (sum(math.log(_time(r, key)) - b for r, b in zip(part, best_log[lo:hi], strict=True))
                    if key is not None else math.inf)
            memo[(lo, hi)] = (key, loss, len(shapes), score)
        return memo[(lo, hi)]

    best_by_rows = {}
    for count in range(1, max_rows + 1):
        for chosen in itertools.combinations(cuts, count - 1):
            edges = [0, *(i for i, _ in chosen), len(fit_rows)]
            parts = [band(a, b) for a, b in itertools.pairwise(edges)]
            loss = sum(p[1] for p in parts)
            if math.isfinite(loss) and (count not in best_by_rows or loss < best_by_rows[count][0] - 1e-12):
                best_by_rows[count] = (loss, chosen, parts, edges)
    if not best_by_rows:
        raise ValueError("no config has an exact time on every fit row of any partition")
    n = len(fit_rows)
    ratio = {c: math.exp(v[0] / n) for c, v in best_by_rows.items()}
    best_ratio = min(ratio.values())
    count = min(c for c in ratio if ratio[c] <= best_ratio * (1 + row_gain))
    _, chosen, parts, edges = best_by_rows[count]
    bands = []
    for (lo, hi), (_, limit), part in zip(itertools.pairwise(edges), [*chosen, (None, None)], parts, strict=True):
        key, loss, n_shapes, score = part
        if bands and bands[-1]["key"] == key:  # neighbours with one config are one row
            merged = bands.pop()
            lo = merged["lo"]
            part_rows = fit_rows[lo:hi]
            loss = sum(math.log(_time(r, key)) - b for r, b in zip(part_rows, best_log[lo:hi], strict=True))
            n_shapes = len({(r["N"], r["K"]) for r in part_rows})
            score = sum(math.log(_time(r, key)) for r in part_rows) / len(part_rows)
        bands.append({"lo": lo, "hi": hi, "limit": limit, "key": key, "fields": dict(fields[key]),
                      "fit_shapes": n_shapes, "fit_rows": hi - lo, "geomean_us": math.exp(score),
                      "geomean_ratio": math.exp(loss / (hi - lo)),
                      "out_bytes": [fit_rows[lo]["out_bytes"], fit_rows[hi - 1]["out_bytes"]]})
    for b in bands:
        DequantConfig(**b["fields"])  # what nf4.dequant.tuned's loader does with each row
    return {"rows": [[b["limit"], b["fields"]] for b in bands],
            "bands": [{k: v for k, v in b.items() if k not in ("lo", "hi")} for b in bands],
            "by_row_count": {str(c): {"geomean_ratio": ratio[c],
                                      "limits": [lim for _, lim in best_by_rows[c][1]]} for c in sorted(ratio)},
            "fit_geomean_ratio": ratio[count], "inexact_on_fit": inexact, "fit_rows": n,
            "fit_shapes": len({(r["N"], r["K"]) for r in fit_rows}), "candidates": keys}


def rule_config(rule_rows, out_bytes: int) -> dict:
    """nf4.dequant.tuned's lookup on rule rows: the first row whose limit is None or holds out_bytes."""
    for limit, fields in rule_rows:
        if limit is None or out_bytes <= limit:
            return fields
    return rule_rows[-1][1]


def why_text(gpu: str, g: dict, rule: dict, settings: dict) -> str:
    """The rule stated for a reader (fit numbers only: the held-out rows never change the table)."""
    parts, lower = [], None
    for b in rule["bands"]:
        if b["limit"] is None:
            where = "every output size" if lower is None else "larger outputs"
        else:
            where = (f"outputs up to {human_bytes(b['limit'])}" if lower is None
                     else f"over {human_bytes(lower)} up to {human_bytes(b['limit'])}")
        parts.append(f"{where}: {describe(b['fields'])}")
        lower = b["limit"]
    copy = [c for c in g["copy_gbs"] if c]
    return (f"Fit by experiments.tune_dequant on {rule['fit_shapes']} fit-subset shapes ({rule['fit_rows']} rows, "
            f"experiments.catalog's fixed split; held-out shapes never used) of the sweep in source "
            f"({', '.join(g['devices'])}, {g.get('sm_count')} SMs, copy {statistics.median(copy):.0f} GB/s), "
            f"{len(g['grid'])} configs. Rule: " + "; ".join(parts) + ". Each band's config has the best "
            f"geometric-mean time over its fit shapes and dtypes (within {settings['tie']:.1%}: the simplest); "
            f"thresholds are powers of two, at most {settings['max_rows']} rows of at least "
            f"{settings['min_shapes']} fit shapes, a row only where it gains {settings['row_gain']:.1%}; "
            f"fit rows run at {rule['fit_geomean_ratio']:.3f}x their best config's time (geometric mean).")


def _stats(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None, "geomean": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values),
            "geomean": math.exp(sum(math.log(v) for v in values) / len(values))}


def report_gpu(gpu: str, g: dict, rule: dict, dtypes_seen) -> dict:
    """Per shape the rule's config against the best the sweep found and against today's config, and the copy
    bandwidth fraction; per subset their statistics; the bars."""
    keys = [k for k in g["grid"] if k not in rule["inexact_on_fit"]]
    shapes = []
    for r in sorted(g["rows"], key=lambda r: (r["out_bytes"], r["N"], r["K"], r["dtype"])):
        fields = rule_config(rule["rows"], r["out_bytes"])
        key = config_key(fields)
        rule_us = _time(r, key)
        best_key, best_us = _best(r, keys)
        today_us = _time(r, TODAY)
        floor = r.get("floor_us")
        shapes.append({
            "N": r["N"], "K": r["K"], "dtype": r["dtype"], "subset": cat.subset(r["N"], r["K"]),
            "weights": r["N"] * r["K"], "out_bytes": r["out_bytes"], "rule": key, "rule_us": rule_us,
            "rule_exact": (r.get("configs", {}).get(key) or {}).get("exact"), "best": best_key, "best_us": best_us,
            "ratio": rule_us / best_us if rule_us and best_us else None, "today": r.get("today_key"),
            "today_us": today_us, "today_ratio": today_us / best_us if today_us and best_us else None,
            "rule_over_today": rule_us / today_us if rule_us and today_us else None, "floor_us": floor,
            "copy_fraction": floor / rule_us if floor and rule_us else None,
            "today_copy_fraction": floor / today_us if floor and today_us else None})
    subsets = {}
    for subset in (cat.FIT, cat.HELD_OUT):
        part = [s for s in shapes if s["subset"] == subset]
        big = [s for s in part if s["weights"] >= BIG_WEIGHTS]
        catalog_shapes = {(s.n, s.k) for s in cat.catalog() if s.subset == subset}
        swept = {(s["N"], s["K"]) for s in part}
        subsets[subset] = {
            "rows": len(part), "shapes": len(swept), "catalog_shapes": len(catalog_shapes),
            "catalog_shapes_missing": len(catalog_shapes - swept),
            "ratio": _stats(s["ratio"] for s in part), "today_ratio": _stats(s["today_ratio"] for s in part),
            "rule_over_today": _stats(s["rule_over_today"] for s in part),
            "copy_fraction": _stats(s["copy_fraction"] for s in part),
            "copy_fraction_16m": _stats(s["copy_fraction"] for s in big),
            "today_copy_fraction_16m": _stats(s["today_copy_fraction"] for s in big),
            "no_rule_time": [f"{s['N']}x{s['K']} {s['dtype']}" for s in part if s["rule_us"] is None]}
    fit_med, held_med = subsets[cat.FIT]["ratio"]["median"], subsets[cat.HELD_OUT]["ratio"]["median"]
    big_rows = [s for s in shapes if s["weights"] >= BIG_WEIGHTS]
    below = [f"{s['N']}x{s['K']} {s['dtype']} " + ("no time" if s["copy_fraction"] is None
                                                   else f"{s['copy_fraction']:.3f}")
             for s in big_rows if s["copy_fraction"] is None or s["copy_fraction"] < COPY_BAR]
    bars = {
        "held_out_median_within": HELD_OUT_TOLERANCE,
        "held_out_median_ok": (held_med <= fit_med * (1 + HELD_OUT_TOLERANCE)
                               if fit_med is not None and held_med is not None else None),
        "copy_bar": COPY_BAR, "copy_bar_weights": BIG_WEIGHTS, "copy_rows_16m": len(big_rows),
        "copy_below_bar": below, "copy_ok": not below if big_rows else None}
    sms, gbs = g.get("sm_count"), statistics.median([c for c in g["copy_gbs"] if c] or [math.nan])
    for b in rule["bands"]:  # the thresholds in the GPU's terms, for 16-bit outputs (4 output bytes a packed byte)
        lim = b["limit"]
        b["tiles_per_sm_at_limit"] = lim / (4 * b["fields"]["tile_bytes"]) / sms if lim and sms else None
        b["floor_us_at_limit"] = timing.nf4_bytes(lim // 2, cb.BLOCKSIZE, 2) / (gbs * 1e3) if lim else None
    return {"gpu": gpu, "devices": g["devices"], "sources": g["sources"], "sm_count": g.get("sm_count"),
            "copy_gbs": g["copy_gbs"], "dtypes": sorted(dtypes_seen), "rule": rule, "subsets": subsets,
            "bars": bars, "shapes": shapes}


def table_text(data: dict) -> str:
    """tuned.json's layout: one line per row."""
    lines = ["{", f'  "about": {json.dumps(data["about"])},', f'  "default_gpu": {json.dumps(data["default_gpu"])},',
             '  "gpus": {']
    gpus = list(data["gpus"].items())
    for i, (gpu, entry) in enumerate(gpus):
        rows = entry["rows"]
        row_lines = ",\n               ".join(json.dumps(r) for r in rows)
        extra = [f'      {json.dumps(k)}: {json.dumps(v)},' for k, v in entry.items()
                 if k not in ("source", "why", "rows")]
        lines += [f"    {json.dumps(gpu)}: {{", f'      "source": {json.dumps(entry["source"])},',
                  f'      "why": {json.dumps(entry["why"])},', *extra, f'      "rows": [{row_lines}]',
                  "    }" + ("," if i < len(gpus) - 1 else "")]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def fit(paths, out_table, report_path, *, max_rows: int = MAX_ROWS, min_shapes: int = MIN_BAND_SHAPES,
        tie: float = TIE, row_gain: float = ROW_GAIN, log=print) -> dict:
    """Fit every GPU of the sweep files, write the table (other GPUs' entries of an existing table kept) and the
    report. Returns the report."""
    settings = {"max_rows": max_rows, "min_shapes": min_shapes, "tie": tie, "row_gain": row_gain}
    groups = load_sweeps(paths)
    out_table = Path(out_table)
    table = (json.loads(out_table.read_text()) if out_table.exists()
             else {"about": ABOUT, "default_gpu": None, "gpus": {}})
    report = {"settings": settings, "sweeps": [_source_name(p) for p in paths], "table": str(out_table),
              "environment": timing.environment() if torch.cuda.is_available() else None, "gpus": {}}
    for gpu in sorted(groups):
        g = groups[gpu]
        rule = fit_rule(g["rows"], g["grid"], **settings)
        table["gpus"][gpu] = {"source": g["sources"], "why": why_text(gpu, g, rule, settings), "rows": rule["rows"]}
        report["gpus"][gpu] = report_gpu(gpu, g, rule, {r["dtype"] for r in g["rows"]})
    if table.get("default_gpu") not in table["gpus"]:
        table["default_gpu"] = sorted(table["gpus"])[0]
    text = table_text(table)
    json.loads(text)
    out_table.parent.mkdir(parents=True, exist_ok=True)
    out_table.write_text(text)
    report["table_written"] = table
    timing.write_json(report_path, report)
    for rep in report["gpus"].values():
        log(summary_text(rep))
    return report


def summary_text(rep: dict) -> str:
    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    lines = [f"{rep['gpu']} ({', '.join(rep['devices'])}): {len(rep['rule']['rows'])} rows, fit geometric-mean "
             f"ratio {f(rep['rule']['fit_geomean_ratio'])}"]
    lower = None
    for b in rep["rule"]["bands"]:
        where = ("every output" if b["limit"] is None and lower is None else f"over {human_bytes(lower)}"
                 if b["limit"] is None else f"up to {human_bytes(b['limit'])}")
        lines.append(f"  {where}: {b['key']} ({describe(b['fields'])}; {b['fit_shapes']} fit shapes)")
        lower = b["limit"]
    for subset, s in rep["subsets"].items():
        r, t, c = s["ratio"], s["today_ratio"], s["copy_fraction_16m"]
        lines.append(f"  {subset:>8}: {s['rows']} rows ({s['shapes']} of {s['catalog_shapes']} catalog shapes); "
                     f"rule / best min {f(r['min'])} median {f(r['median'])} max {f(r['max'])}; today / best median "
                     f"{f(t['median'])} max {f(t['max'])}; copy fraction (16M+) min {f(c['min'])} median "
                     f"{f(c['median'])}")
    b = rep["bars"]
    lines.append(f"  bars: held-out median within {b['held_out_median_within']:.0%} of fit: "
                 f"{b['held_out_median_ok']}; >= {b['copy_bar']:.0%} of copy on 16M+ weights: {b['copy_ok']} "
                 f"({len(b['copy_below_bar'])} of {b['copy_rows_16m']} rows below)")
    return "\n".join(lines)


# --- the command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments tune-dequant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sw = sub.add_parser("sweep", help="GPU: time the config grid on the catalog's shapes")
    sw.add_argument("--out", required=True, help="sweep file (JSON), e.g. build/tune/dequant_sweep_h100.json")
    sw.add_argument("--shapes", default=cat.FIT, help="fit (default), held-out, all, or NxK,NxK,...")
    sw.add_argument("--dtypes", type=cb.parse_dtypes, default=list(cb.DTYPES), help="comma list of bf16, fp16")
    sw.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds of measuring before it stops")
    sw.add_argument("--calls", type=int, default=CALLS, help="calls a graph replay holds (fewer for long calls)")
    sw.add_argument("--reps", type=int, default=REPS, help="graph replays timed")
    sw.add_argument("--compile-jobs", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                    help="worker processes compiling the candidates first (0: compile in this process)")
    ft = sub.add_parser("fit", help="the table's rules from the fit rows of sweep files, and the held-out report")
    ft.add_argument("sweeps", nargs="+", help="sweep files (one or more GPUs)")
    ft.add_argument("--out-table", required=True, help="tuned.json to write, e.g. nf4/dequant/tuned.json")
    ft.add_argument("--report", default="build/tune/dequant_fit.json", help="the report (JSON)")
    ft.add_argument("--max-rows", type=int, default=MAX_ROWS)
    ft.add_argument("--min-shapes", type=int, default=MIN_BAND_SHAPES, help="fit shapes a row's band holds at least")
    ft.add_argument("--tie", type=float, default=TIE, help="relative geometric-mean difference counted as a tie")
    ft.add_argument("--row-gain", type=float, default=ROW_GAIN, help="what a further row must gain")
    cw = sub.add_parser("compile-worker", help=argparse.SUPPRESS)
    cw.add_argument("--keys", required=True)
    cw.add_argument("--dtypes", type=cb.parse_dtypes, required=True)
    return ap


def _no_gpu() -> bool:
    return not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "fit":
        try:
            fit(args.sweeps, args.out_table, args.report, max_rows=args.max_rows, min_shapes=args.min_shapes,
                tie=args.tie, row_gain=args.row_gain)
        except (OSError, ValueError, KeyError) as exc:
            print(f"tune-dequant fit: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.out_table} and {args.report}")
        return 0
    if _no_gpu():
        print(f"tune-dequant {args.command} needs a CUDA GPU (it times GPU kernels); nothing measured, nothing written",
              file=sys.stderr)
        return 2
    if args.command == "compile-worker":
        wanted = set(args.keys.split(","))
        errors = compile_all([f for f in grid() if config_key(f) in wanted], args.dtypes)
        return 1 if errors else 0
    try:
        args.shapes_text, args.shapes = args.shapes, cb.parse_shapes(args.shapes)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    payload = run_sweep(args)
    print(f"wrote {args.out} ({len(payload['rows'])} rows, {len(payload['skipped'])} shapes skipped, "
          f"{payload['elapsed_s']:.0f} s)")
    return 0 if payload["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
