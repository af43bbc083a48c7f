"""One launch mechanism for every nf4 kernel, the device facts it needs, and the repeat-call cache.

    compiled = runtime.launch(kernel, grid, args, device=dev, num_warps=4)   # args: {name: value}
    bound = runtime.bind(compiled, kernel, grid, args, rebind=("out_ptr",))
    bound.fn(bound.ctx, stream, out_ptr)                                    # the repeat call

`launch` compiles a `@triton.jit` function once per specialisation (`spec_key`: what Triton
specialises on, read from the kernel's own parameter list) and afterwards calls the compiled
kernel directly: Triton's JIT dispatch costs more host time than a small kernel runs. `bind`
fixes every argument but the named `rebind` slots, so that a repeat call passes only those and
the stream, through Triton's C launch function (on the Triton releases in DIRECT_LAUNCH_VERSIONS)
or else `CompiledKernel.run`. Nothing here names a particular kernel. While `recording()` is
active nothing runs: launches are recorded (for the offline sm_75 compiles).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import triton

from reference.format import NF4_CODE

# Triton versions whose C launch function is called directly, skipping the Python wrapper
# `CompiledKernel.run` (its argument convention changes between releases, so a version is listed
# only after the GPU tests passed with it). Others use the wrapper.
DIRECT_LAUNCH_VERSIONS = ("3.6",)

_compiled: dict[tuple, Any] = {}
_recording: list | None = None
_sm_counts: dict[int, int] = {}
_names: dict[int, str] = {}
_capabilities: dict[int, tuple[int, int]] = {}
_tables: dict[tuple, torch.Tensor] = {}
# Triton's interpreter keeps global state per launch: launches from several threads are serialized.
interpreter_lock = threading.RLock()


# --- device facts -----------------------------------------------------------------------------------


def interpreting(device: torch.device) -> bool:
    """True when a launch on `device` runs in Triton's interpreter (a CPU tensor, or TRITON_INTERPRET set)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_on() -> bool:
    """Whether @triton.jit makes interpreted functions (TRITON_INTERPRET was set when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe_kernel, InterpretedFunction)


@triton.jit
def _probe_kernel(x_ptr):
    pass


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached)."""
    count = _sm_counts.get(device.index)
    if count is None:
        count = _sm_counts[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def device_name(device: torch.device) -> str:
    """The CUDA device's name (cached); "" for Triton's interpreter, whose tuned rows are their own."""
    if interpreting(device):
        return ""
    name = _names.get(device.index)
    if name is None:
        name = _names[device.index] = torch.cuda.get_device_name(device)
    return name


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (cached)."""
    cap = _capabilities.get(device.index)
    if cap is None:
        cap = _capabilities[device.index] = torch.cuda.get_device_capability(device)
    return cap


# --- per-device resources ---------------------------------------------------------------------------


def level_table(device: torch.device, pairs: bool = False) -> torch.Tensor:
    """The NF4 levels on `device`: 16 float32, or (pairs) 256 level pairs packed as 64-bit words.

    Pair b holds the float32 bits of NF4[b >> 4] (low half) and NF4[b & 15] (high half).
    """
    key = (device, pairs)
    t = _tables.get(key)
    if t is None:
        if pairs:
            bits = NF4_CODE.view(np.uint32).astype(np.uint64)
            b = np.arange(256)
            words = bits[b >> 4] | (bits[b & 15] << np.uint64(32))
            t = torch.from_numpy(words.view(np.int64).copy()).to(device)
        else:
            t = torch.from_numpy(NF4_CODE.copy()).to(device)
        _tables[key] = t
    return t


def stand_in(device: torch.device) -> torch.Tensor:
    """A stand-in for absent tensors (never read where it stands in), also 256 bytes of zeros that a kernel may
    read (the tensor-core GEMV with warps_k > 1)."""
    key = (device, "zeros")
    t = _tables.get(key)
    if t is None:
        t = _tables[key] = torch.zeros(64, dtype=torch.float32, device=device)
    return t


# --- launching ----------------------------------------------------------------------------------------


def _unspecialised(fn) -> set[int]:
    names = list(fn.arg_names)
    return {names.index(p) if isinstance(p, str) else int(p) for p in (getattr(fn, "do_not_specialize", None) or ())}


def spec_key(fn, values: Sequence) -> tuple:
    """What Triton specialises a launch of `fn` on: constexpr values, pointer dtypes and 16-byte
    alignment, integers' divisibility by 16, equality with 1 and 32-bit range, booleans. Integer
    parameters the kernel lists in `do_not_specialize` count by their width only."""
    skip = _unspecialised(fn)
    key = []
    for i, (param, arg) in enumerate(zip(fn.params, values, strict=True)):
        if param.is_constexpr:
            key.append(arg)
        elif isinstance(arg, torch.Tensor) or hasattr(arg, "data_ptr"):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, bool):
            key.append(("b", arg))
        elif isinstance(arg, int):
            wide = -(2**31) <= arg < 2**31
            key.append(wide if i in skip else (arg % 16 == 0, arg == 1, wide))
        else:
            key.append(type(arg).__name__)
    return tuple(key)


@dataclass(frozen=True)
class Recorded:
    """A launch that `recording()` kept instead of running: the kernel, grid, positional values, options."""

    fn: Any
    grid: tuple
    args: tuple
    options: dict


@contextlib.contextmanager
def recording():
    """Record launches instead of running them; yields the list of `Recorded`. Nests."""
    global _recording
    saved = _recording
    _recording = []
    try:
        yield _recording
    finally:
        _recording = saved


def is_recording() -> bool:
    """Whether launches are being recorded (see `recording`)."""
    return _recording is not None


def positional(fn, args: Mapping[str, Any]) -> tuple:
    """The kernel's arguments in parameter order (KeyError naming a missing one)."""
    try:
        return tuple(args[name] for name in fn.arg_names)
    except KeyError as exc:
        raise KeyError(f"{fn.__name__}: no value for parameter {exc.args[0]!r}") from None


def launch(fn, grid: Sequence[int], args: Mapping[str, Any], *, device: torch.device, jit: bool = False,
           **options):
    """Launch `fn[grid](**args)` through the compiled-kernel cache; returns the compiled kernel (None
    when interpreting, recording, or with jit=True).

    options: num_warps (default 4), enable_fp_fusion (default False: contraction would round
    multiply-adds once), any other Triton launch option. jit=True goes through Triton's JIT
    dispatch on every call (what a plain `kernel[grid](...)` costs; for the experiments).
    """
    options = {"num_warps": 4, "enable_fp_fusion": False, **options}
    grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled kernel reads grid[0], grid[1], grid[2]
    values = positional(fn, args)
    if _recording is not None:
        _recording.append(Recorded(fn, grid, values, options))
        return None
    if interpreting(device):
        with interpreter_lock:
            fn[grid](*values, **options)
        return None
    if jit:
        fn[grid](*values, **options)
        return None
    key = (fn, device.index, tuple(sorted(options.items())), spec_key(fn, values))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = fn[grid](*values, **options)
    else:
        compiled[grid](*values)
    return compiled


def hooks_active() -> bool:
    """Whether a launch hook (a profiler) is installed; Triton 3.6+ keeps them in (possibly empty) chains."""
    from triton import knobs

    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _triton_version() -> str:
    return ".".join(triton.__version__.split(".")[:2])


def launch_head(compiled, direct: bool = True) -> tuple:
    """(callable, the launch arguments between the stream and the kernel's own arguments)."""
    run = compiled.run
    fn = getattr(run, "launch", None)
    if (direct and fn is not None and _triton_version() in DIRECT_LAUNCH_VERSIONS
            and not getattr(run, "global_scratch_size", 1) and not getattr(run, "profile_scratch_size", 1)):
        # Triton 3.6: launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch,
        #                    profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)
        return fn, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                    compiled.packed_metadata, None, None, None)
    # CompiledKernel.run(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata,
    #                    enter_hook, exit_hook, *args)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class Bound:
    """A compiled launch with its arguments bound: `fn(ctx, stream, *rebind_values)` launches it."""

    __slots__ = ("ctx", "fn", "grid_x", "rebind")

    def __call__(self, stream: int, *values) -> None:
        self.fn(self.ctx, stream, *values)


def _segments(values: list, positions: list) -> tuple:
    """The bound values between the rebound slots, in slot order: (before the first, between, ..., after the last)."""
    order = sorted(positions)
    cuts = [0, *[p + 1 for p in order]]
    ends = [*order, len(values)]
    return tuple(tuple(values[a:b]) for a, b in zip(cuts, ends, strict=True))


def _call_1(ctx, stream, v0):
    fn, gx, s0, s1 = ctx
    fn(gx, 1, 1, stream, *s0, v0, *s1)


def _call_2(ctx, stream, v0, v1):
    fn, gx, s0, s1, s2 = ctx
    fn(gx, 1, 1, stream, *s0, v0, *s1, v1, *s2)


def _call_3(ctx, stream, v0, v1, v2):
    fn, gx, s0, s1, s2, s3 = ctx
    fn(gx, 1, 1, stream, *s0, v0, *s1, v1, *s2, v2, *s3)


def _call_4(ctx, stream, v0, v1, v2, v3):
    fn, gx, s0, s1, s2, s3, s4 = ctx
    fn(gx, 1, 1, stream, *s0, v0, *s1, v1, *s2, v2, *s3, v3, *s4)


def _call_2p(ctx, stream, v0, v1):  # the two slots in the other order
    fn, gx, s0, s1, s2 = ctx
    fn(gx, 1, 1, stream, *s0, v1, *s1, v0, *s2)


def _call_3p(ctx, stream, *v):
    fn, gx, s0, s1, s2, s3, a, b, c = ctx
    fn(gx, 1, 1, stream, *s0, v[a], *s1, v[b], *s2, v[c], *s3)


def _call_4p(ctx, stream, *v):
    fn, gx, s0, s1, s2, s3, s4, a, b, c, d = ctx
    fn(gx, 1, 1, stream, *s0, v[a], *s1, v[b], *s2, v[c], *s3, v[d], *s4)


def _call_n(ctx, stream, *values):
    fn, gx, segments, order = ctx
    args = [*segments[0]]
    for i, seg in zip(order, segments[1:], strict=True):
        args.append(values[i])
        args += seg
    fn(gx, 1, 1, stream, *args)


_IN_ORDER = {1: _call_1, 2: _call_2, 3: _call_3, 4: _call_4}
_PERMUTED = {2: _call_2p, 3: _call_3p, 4: _call_4p}


def splice(launch_fn, grid_x: int, head: tuple, segments: tuple, order: tuple) -> tuple:
    """(fn, ctx) of a bound call: `fn(ctx, stream, *values)` calls `launch_fn(grid_x, 1, 1, stream, *head, ...)`
    with the caller's values (`order[j]`: the one for the j-th rebound slot in parameter order) spliced between
    the bound `segments` (`_segments`). The head is joined to the first segment once; up to four rebound slots
    take a call of their own (without indexing where the caller's order is the parameter order)."""
    segments = ((*head, *segments[0]), *segments[1:])
    if order == tuple(range(len(order))) and len(order) in _IN_ORDER:
        return _IN_ORDER[len(order)], (launch_fn, grid_x, *segments)
    if len(order) == 2:
        return _call_2p, (launch_fn, grid_x, *segments)
    if len(order) in _PERMUTED:
        return _PERMUTED[len(order)], (launch_fn, grid_x, *segments, *order)
    return _call_n, (launch_fn, grid_x, segments, order)


def bind(compiled, fn, grid: Sequence[int], args: Mapping[str, Any], rebind: Sequence[str], *,
         direct: bool = True) -> Bound:
    """Bind `compiled` (a kernel `launch` returned for `fn`) with `args` for repeat calls that change only
    the `rebind` slots (pointer parameters, by name). direct=False skips Triton's C launch function for its
    Python wrapper `CompiledKernel.run`."""
    if tuple(grid[1:]) not in ((), (1,), (1, 1)):
        raise ValueError(f"bind: only 1-D grids, got {tuple(grid)}")
    names = list(fn.arg_names)
    for name in rebind:
        if name not in names:
            raise KeyError(f"{fn.__name__}: no parameter {name!r} to rebind")
    bound = Bound()
    bound.grid_x, bound.rebind = int(grid[0]), tuple(rebind)
    launch_fn, head = launch_head(compiled, direct)
    # Triton's launch functions take every argument in parameter order (constexprs too; they skip them). The
    # bound values are cut into the runs between the rebound slots once, so a repeat call only splices.
    values = [v.data_ptr() if hasattr(v, "data_ptr") else v for v in positional(fn, args)]
    positions = [names.index(name) for name in rebind]
    segments = _segments(values, positions)
    # order[j]: which rebound value (in the caller's order) fills the j-th rebound slot in parameter order
    order = tuple(sorted(range(len(positions)), key=positions.__getitem__))
    bound.fn, bound.ctx = splice(launch_fn, bound.grid_x, head, segments, order)
    return bound


def _no_stream(device_index: int) -> int:
    """A CPU-only build's stand-in: no CUDA stream (nothing launches on one there)."""
    return 0


# The current CUDA stream of a device as an int.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _no_stream


# --- configs ------------------------------------------------------------------------------------------


def check_fields(config) -> None:
    """TypeError naming the field whose value is not of its annotated type (int, bool, str, or `int | None`).

    bool is not accepted for an int field, nor an int for a bool field."""
    name = type(config).__name__
    for f in fields(config):
        v = getattr(config, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "int | None" and v is None:
            continue
        want = {"int": int, "int | None": int, "bool": bool, "str": str}.get(kind)
        if want is None:
            continue
        if type(v) is not want:
            raise TypeError(f"{name}.{f.name} must be {kind}, got {type(v).__name__} {v!r}")
