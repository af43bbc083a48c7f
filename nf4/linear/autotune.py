"""Autotuning on first use: nf4.linear's config for one GPU, weight shape and M, raced once and kept on disk.

The tuned table (`tuned.py`) states rules fit on part of the shape catalog. Between the configs its rows use, the
fastest for a given shape still differs from the table's pick by up to 1.7x, and picks that change with M make a
larger M run faster than a smaller one (results/labs/config_race_catalog_<gpu>.json; the catalog issue's
inversions). So on a CUDA GPU the first forward call of a key

    (GPU name, N, K, blocksize, nested, weight dtype, x dtype, M rounded up to a power of two), M <= MAX_M

races the table's pick and the candidates of that M's row of AUTOTUNE (tuned.json) at that M, on random weights of
the same shape (never the caller's tensors), each call rotating over enough copies to leave L2, in CUDA graphs
(`triton.testing.do_bench_cudagraph`), two rounds, and takes the fastest (the table's pick unless another is more
than TIE faster). The choice is kept in memory for the process and in `linear.json` under NF4_CACHE_DIR (default
~/.cache/nf4) for the next, keyed also by a fingerprint of the kernels' sources, the candidates and Triton's version,
so that a changed kernel is raced again. Every candidate is an exact-operand kernel: the choice changes the speed and
the order of the float32 sum, never the operand.

No race (the table's pick) with NF4_AUTOTUNE=0, in Triton's interpreter, for the backward, during a CUDA-graph
capture (a choice already made is still used), where fewer than two candidates can run the call, or when the race
fails (a warning). The race runs on the first call of a key, never in a repeat call: the repeat-call cache
(nf4.linear.api) keeps the bound launches of the chosen config. Under torch.compile it runs while the op is
traced, outside the fake-tensor modes, so the compiled graph holds the raced kernel.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from .. import runtime
from ..dequant.api import dequantize_weight
from ..weight import NF4Weight
from .config import LinearConfig
from .launch import dense_product, direct, kernel_args, launch_config, run_direct, split_k
from .tuned import CONFIGS, DATA, NAMES, tuned

ENV = "NF4_AUTOTUNE"  # "0": no race, the tuned table alone
CACHE_ENV = "NF4_CACHE_DIR"  # where linear.json lives (default ~/.cache/nf4)
FILE = "linear.json"
TIE = 0.01  # another candidate must be this much faster than the table's pick to replace it
ROUNDS = 2  # races of every candidate, interleaved; a candidate's time is its fastest
REP_MS = 0.25  # CUDA-graph time per candidate per round (do_bench_cudagraph's rep; it replays 10 such graphs)
# calls a timed function makes: do_bench_cudagraph sizes its graph from a host-timed estimate, and a slow estimate
# left one short call per graph, its replay overhead counted as the call's (race times 1.2-1.8x the call's on 13 of
# 1,186 small H200 keys in a first run); CALLS per function keep at least that many calls in each graph
CALLS = 16
L2_MULTIPLE = 2  # rotating copies of the weight: enough to span this many L2 caches, at most MAX_COPIES
MAX_COPIES = 8
# (largest M, candidate config names), from tuned.json: the configs of the table's rows for those M
AUTOTUNE: tuple[tuple[int, tuple[str, ...]], ...] = tuple((m, tuple(names)) for m, names in DATA["autotune"])
MAX_M = AUTOTUNE[-1][0]


class Key(NamedTuple):
    """What a choice is kept under (besides the tuner's fingerprint)."""

    gpu: str
    n: int
    k: int
    blocksize: int
    nested: bool
    w_dtype: torch.dtype
    x_dtype: torch.dtype
    m: int

    def text(self, fingerprint: str) -> str:
        """The key in the file: the GPU, the fingerprint and the other fields, joined by "|"."""
        return "|".join((self.gpu, fingerprint, str(self.n), str(self.k), str(self.blocksize), str(int(self.nested)),
                         str(self.w_dtype).removeprefix("torch."), str(self.x_dtype).removeprefix("torch."),
                         str(self.m)))


def bucket(m: int) -> int:
    """The M a race is keyed by and run at: m rounded up to a power of two. Every M of a bucket takes its choice, so a
    shape races at most once per bucket (prefills of many lengths do not race each), and the buckets' bounds are the
    tuned table's row bounds (its rows and rules split M at powers of two)."""
    return 1 << max(0, m - 1).bit_length()


def enabled() -> bool:
    """Whether races may run: NF4_AUTOTUNE unset, empty or "1"; "0" turns them off; any other value is refused."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (no autotuning) or 1 (autotuning on first use, the default), got {value!r}")
    return value != "0"


def cache_path() -> Path:
    """The file of kept choices: NF4_CACHE_DIR/linear.json (default ~/.cache/nf4/linear.json)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "nf4")
    return Path(root) / FILE


def candidates(m: int, table: LinearConfig) -> tuple[LinearConfig, ...]:
    """The configs raced at M rows of x: the table's pick first, then the first AUTOTUNE row that takes m (none
    past MAX_M)."""
    names = next((row for limit, row in AUTOTUNE if m <= limit), ())
    out = [table]
    for name in names:
        if CONFIGS[name] not in out:
            out.append(CONFIGS[name])
    return tuple(out) if names else ()


def source_fingerprint() -> str:
    """A digest of what a kept choice depends on besides its key: the linear kernels' and device helpers' sources,
    tuned.json (the candidates and their fields) and Triton's version."""
    import triton

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(triton.__version__.encode())
    for path in [*sorted(here.glob("*.py")), here / "tuned.json", here.parent / "device.py"]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _read() -> dict:
    """The kept choices ({} when the file is absent or unreadable)."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


class Tuner:
    """One process's choices (in memory) over the kept ones (the file). The defaults are the real race, device name,
    capture check and fingerprint; a test hands stand-ins."""

    def __init__(self, race=None, device_name=None, capturing=None, fingerprint: str | None = None):
        self.race = race if race is not None else race_configs
        self.device_name = device_name if device_name is not None else runtime.device_name
        self.capturing = capturing if capturing is not None else torch.cuda.is_current_stream_capturing
        self._fingerprint = fingerprint
        self.memory: dict[Key, str] = {}  # key -> chosen config name
        self.lock = threading.RLock()
        self.warned: set[str] = set()

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = source_fingerprint()
        return self._fingerprint

    def pick(self, device: torch.device, m: int, trans: bool, n: int, k: int, blocksize: int, nested: bool,
             w_dtype: torch.dtype, x_dtype: torch.dtype) -> LinearConfig:
        """The config nf4.linear runs for M rows of x on `device`: the tuned table's (`tuned`), or where autotuning
        applies (module docstring) the raced choice."""
        gpu = self.device_name(device)
        if trans or not gpu or m > MAX_M or not enabled():
            return tuned(gpu, m, trans, n=n, k=k)
        top = bucket(m)
        key = Key(gpu, n, k, blocksize, bool(nested), w_dtype, x_dtype, top)
        name = self.memory.get(key)
        if name is not None:
            return CONFIGS[name]
        with self.lock:
            name = self.memory.get(key)
            if name is None:
                name = self._choose(device, key, tuned(gpu, top, n=n, k=k))
            if name is None:
                return tuned(gpu, m, n=n, k=k)
            self.memory[key] = name
        return CONFIGS[name]

    def forget(self) -> None:
        """Drop the choices in memory (the file stays): the next call of each key reads the file or races again."""
        with self.lock:
            self.memory.clear()

    def _choose(self, device: torch.device, key: Key, table: LinearConfig) -> str | None:
        """The kept or raced choice of `key`: the table's pick where there is nothing to race or the race failed,
        None during a capture (the table's pick, not remembered: the next call outside a capture races)."""
        configs = candidates(key.m, table)
        table_name = NAMES.get(table)
        names = tuple(NAMES[c] for c in configs if c in NAMES)
        if table_name is None:
            return None
        if len(names) < 2:
            return table_name
        entry = _read().get(key.text(self.fingerprint))
        kept = entry.get("config") if isinstance(entry, dict) else None
        if kept in names:
            return kept
        if self.capturing():
            return None
        try:
            times = self.race(device, key, configs)
        except Exception as exc:  # a failed race must not fail the call: the table's pick runs
            self._warn_once(f"nf4.linear: autotuning {key.n}x{key.k} at M = {key.m} failed ({type(exc).__name__}: "
                            f"{exc}); the tuned table's config runs")
            return table_name
        if table_name not in times or len(times) < 2:
            return table_name
        best = min(times, key=times.get)
        name = best if times[best] < times[table_name] * (1 - TIE) else table_name
        self._keep(key, name, times)
        return name

    def _keep(self, key: Key, name: str, times: dict[str, float]) -> None:
        """Add a choice to the file (read again first, so that other processes' choices stay), written whole and
        renamed into place; a file that cannot be written leaves the choice in memory only (one warning)."""
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = _read()
            entries[key.text(self.fingerprint)] = {"config": name, "us": {n: round(t, 3) for n, t in times.items()}}
            body = json.dumps({"about": "nf4.linear's raced configs (nf4/linear/autotune.py); safe to delete",
                               "entries": entries}, indent=1, sort_keys=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".linear-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, path)
        except OSError as exc:
            self._warn_once(f"nf4.linear: could not keep autotuned configs in {path} ({exc}); they last this "
                            f"process only")

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def synthetic_weight(n: int, k: int, blocksize: int, nested: bool, w_dtype: torch.dtype, device,
                     seed: int = 0) -> NF4Weight:
    """A random NF4 weight of n x k (packed bytes and state of bitsandbytes' layout, values meaningless): what a
    race times."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = n * k // blocksize
    packed = torch.randint(0, 256, (n * k // 2, 1), dtype=torch.uint8, device=device, generator=gen)
    if nested:
        absmax = torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=device, generator=gen)
        absmax2 = torch.rand(-(-blocks // 256), device=device, generator=gen) + 0.5
        code2 = torch.linspace(-1.0, 1.0, 256, device=device)
        offset = torch.full((1,), 0.01, device=device)
        return NF4Weight(packed, absmax, absmax2, code2, offset, (n, k), blocksize, w_dtype, True)
    absmax = torch.rand(blocks, device=device, generator=gen) + 0.5
    return NF4Weight(packed, absmax, None, None, None, (n, k), blocksize, w_dtype, False)


def race_configs(device: torch.device, key: Key, configs: tuple[LinearConfig, ...]) -> dict[str, float]:
    """Microseconds per call of each config that can run the call (`launch_config` keeps it), CUDA-graph time over
    rotating copies of a random weight, the fastest of ROUNDS interleaved rounds."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.testing import do_bench_cudagraph

    n, k, blocksize, nested, m = key.n, key.k, key.blocksize, key.nested, key.m
    with unset_fake_temporarily(), _disable_current_modes(), torch.cuda.device(device), torch.no_grad():
        weight_bytes = n * k // 2 + n * k // blocksize * (1 if nested else 4)
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        copies = max(1, min(MAX_COPIES, -(-L2_MULTIPLE * l2 // max(1, weight_bytes))))
        weights = [synthetic_weight(n, k, blocksize, nested, key.w_dtype, device, seed=i) for i in range(copies)]
        gen = torch.Generator(device=device).manual_seed(m)
        x = torch.randn((m, k), device=device, generator=gen).to(key.x_dtype)
        runners = {}
        torch.cuda.synchronize(device)  # the race's stream reads what the current stream made
        for config in configs:
            if launch_config(config, weights[0], x, m, False) != config:
                continue
            runners[NAMES[config]] = _runner(config, weights, x, m)
        times: dict[str, float] = {}
        for _ in range(ROUNDS):
            for name, fn in runners.items():
                ms = do_bench_cudagraph(fn, rep=REP_MS, return_mode="min")
                times[name] = min(times.get(name, float("inf")), ms * 1e3 / CALLS)
        return times


def _runner(config: LinearConfig, weights: list[NF4Weight], x: torch.Tensor, m: int):
    """A function that runs CALLS calls of `config` per invocation, each on the next of the rotating weights."""
    n = weights[0].shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, _ = split_k(config, weights[0], m, x.device)
    part = torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else None
    if config.kernel == "dequant":
        calls = [lambda w=w: dense_product(x, dequantize_weight(w, ftz=True), None, False) for w in weights]
    elif direct(config):
        calls = [lambda w=w: run_direct(x, w, None, out, m, config, True, part) for w in weights]
    else:
        def launches(w):
            plan = kernel_args(x, w, None, out, m, config, True, False, part)

            def run():
                for fn, grid, args, options in plan:
                    runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
            return run
        calls = [launches(w) for w in weights]
    cycle = itertools.cycle(calls)

    def run_calls():
        for _ in range(CALLS):
            next(cycle)()
    return run_calls


TUNER = Tuner()  # the process's


def pick(device: torch.device, m: int, trans: bool, n: int, k: int, blocksize: int, nested: bool,
         w_dtype: torch.dtype, x_dtype: torch.dtype) -> LinearConfig:
    """`Tuner.pick` of the process's tuner: what nf4.linear runs (its eager call and its torch.library ops)."""
    return TUNER.pick(device, m, trans, n, k, blocksize, nested, w_dtype, x_dtype)


def pick_for(x: torch.Tensor, w: NF4Weight) -> LinearConfig:
    """`pick` for the forward call nf4.linear(x, weight) (x: [..., K] rows): the config it runs by default before
    its runnable check (`launch.launch_config`); a first call's race runs here."""
    return pick(x.device, x.numel() // x.shape[-1], False, *w.shape, w.blocksize, w.nested, w.dtype, x.dtype)
