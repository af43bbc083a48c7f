"""GPU timing and provenance shared by nf4.bench, verify and experiments.

Device time: CUDA events around each call, inputs rotated so that the L2 cache (50-60 MB on
H100/H200) never holds the next call's data, median of many calls after a warm-up; before each
call the GPU spins for a while so the host has queued the call before the GPU reaches it. Host time:
wall clock per call without synchronisation (what the CPU spends issuing the work). Wall time:
the challenge harness's clock, a `torch.cuda.synchronize()` after every call.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

L2_FLUSH_BYTES = 256 * 2**20  # rotate through at least this many bytes of inputs
SPIN_CYCLES = 400_000  # GPU clock cycles of busy-wait before each timed call (~0.2 ms)


def git_commit() -> str:
    """The repository's HEAD commit, with '-dirty' when the work tree has uncommitted changes.

    NF4_COMMIT, when set, wins: a copy of the work tree (a lent GPU machine) may carry a stale .git.
    """
    if os.environ.get("NF4_COMMIT"):
        return os.environ["NF4_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        commit = head.stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True)
        return commit + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("NF4_COMMIT", "unknown")


def environment() -> dict:
    """Device name, library versions, commit and date: stamped into every result file."""
    import numpy
    import torch
    import triton

    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except Exception:
        bnb_version = None
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": os.environ.get("NF4_COMMIT") or git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "bitsandbytes": bnb_version,
        "cuda": torch.version.cuda,
        "device": "cpu",
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "nf4_autotune": os.environ.get("NF4_AUTOTUNE", "1"),  # "0": nf4.linear runs the tuned table, no race
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), sm=f"{props.major}{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return env


def device_slug(device_name: str) -> str:
    """A GPU's name for a file name: lower case, every other run of characters one underscore ("device" if empty)."""
    import re

    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") or "device"


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write a result file (pretty JSON, sorted keys) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
    return path


def rotation_count(bytes_per_call: int, minimum: int = 2) -> int:
    """How many input sets to rotate through so that their total exceeds L2_FLUSH_BYTES."""
    return max(minimum, -(-L2_FLUSH_BYTES // max(1, bytes_per_call)))


def device_time_us(fn, inputs: list, *, warmup: int = 10, reps: int = 100) -> dict:
    """Median (and quartiles) of per-call device time in microseconds, CUDA events, rotating inputs."""
    import torch

    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        # Keep the GPU busy while the host issues the call, so the events time the device work and
        # not the host's launch latency (small weights are host-bound otherwise).
        torch.cuda._sleep(SPIN_CYCLES)
        starts[i].record()
        fn(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))
    q = statistics.quantiles(times, n=4)
    return {"median_us": statistics.median(times), "q1_us": q[0], "q3_us": q[2], "min_us": times[0], "reps": reps}


def graph_time_us(fn, inputs: list, *, calls: int | None = None, reps: int = 20) -> dict | None:
    """Per-call device time from CUDA-graph replays of `calls` rotated calls (launch gaps removed).

    Returns None when the callable cannot be captured in a graph.
    """
    import torch

    calls = calls or max(len(inputs), 20)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):
                fn(inputs[i % len(inputs)])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(inputs[i % len(inputs)])
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return {"median_us": statistics.median(times), "min_us": min(times), "calls_per_replay": calls, "reps": reps}


def _batch_us(fn, inputs: list, calls: int) -> float:
    """Host microseconds per call over `calls` calls issued back to back, then one synchronize."""
    import torch

    t0 = time.perf_counter()
    for i in range(calls):
        fn(inputs[i % len(inputs)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def host_time_us(fn, inputs: list, *, calls: int = 200, warmup: int = 20, batches: int = 9) -> dict:
    """Host wall time per call without synchronisation (issue cost), median of `batches` batches."""
    import torch

    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    per_batch = [_batch_us(fn, inputs, calls) for _ in range(batches)]
    return {"median_us": statistics.median(per_batch), "min_us": min(per_batch), "calls": calls,
            "batches": batches}


def host_time_pair_us(fn, inputs: list, ref, ref_inputs: list, *, calls: int = 100, warmup: int = 20,
                      batches: int = 15) -> dict:
    """host_time_us of `fn` and of a reference callable measured in alternating batches.

    The host's speed drifts during a run (the same step measured twice can differ by half), so a
    comparison of two host times is only fair when their batches are interleaved; the medians
    then see the same drift.
    """
    import torch

    for i in range(warmup):
        fn(inputs[i % len(inputs)])
        ref(ref_inputs[i % len(ref_inputs)])
    torch.cuda.synchronize()
    times: dict[str, list] = {"fn": [], "ref": []}
    for b in range(batches):
        for which in (("fn", "ref") if b % 2 == 0 else ("ref", "fn")):
            f, xs = (fn, inputs) if which == "fn" else (ref, ref_inputs)
            times[which].append(_batch_us(f, xs, calls))
    return {"median_us": statistics.median(times["fn"]), "ref_median_us": statistics.median(times["ref"]),
            "calls": calls, "batches": batches}


def wall_time_us(fn, inputs: list, *, iters: int = 1000, warmup: int = 20, sync=None) -> dict:
    """The challenge's clock: total wall time of `iters` calls, each followed by a synchronize.

    sync: what "synchronize" means (default `torch.cuda.synchronize`; a no-op for CPU smoke tests).
    """
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
        sync()
    t0 = time.perf_counter()
    for i in range(iters):
        fn(inputs[i % len(inputs)])
        sync()
    total = time.perf_counter() - t0
    return {"total_s": total, "per_call_us": total * 1e6 / iters, "iters": iters}


def copy_bandwidth_gbs(nbytes: int = 2**30, reps: int = 30) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    pair = (torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255),
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
    t = device_time_us(lambda p: p[1].copy_(p[0]), [pair], warmup=5, reps=reps)
    pair = None
    torch.cuda.empty_cache()
    return {"gbs": 2 * nbytes / (t["median_us"] * 1e-6) / 1e9, "bytes": nbytes, "median_us": t["median_us"]}


def nf4_bytes(n: int, blocksize: int, out_bytes: int, double_quant: bool = True) -> int:
    """Fewest bytes a dequantization must move: packed weights, absmax, state2 scales, the output."""
    n_blocks = -(-n // blocksize)
    absmax = n_blocks * (1 if double_quant else 4)
    state2 = (-(-n_blocks // 256) * 4 + 256 * 4 + 4) if double_quant else 0
    return (n + 1) // 2 + absmax + state2 + n * out_bytes


_empty_kernel_fn: list = []


def empty_jit_launch():
    """A callable(_) that launches an empty Triton kernel through the JIT: the host-time yardstick."""
    import torch
    import triton

    if not _empty_kernel_fn:

        @triton.jit
        def _empty_kernel(x_ptr, n):
            pass

        _empty_kernel_fn.append(_empty_kernel)
    kernel = _empty_kernel_fn[0]
    x = torch.empty(16, device="cuda")
    return lambda _: kernel[(1,)](x, 16)

