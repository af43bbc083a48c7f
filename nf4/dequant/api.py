"""`nf4.dequantize`: the public entry point, a drop-in for bitsandbytes' and Unsloth's dequantize.

The call path is kept short: the weight is checked (nf4.weight.NF4Weight), the output allocated,
and a compiled kernel launched directly (nf4.runtime: Triton's JIT dispatch costs more host time
than the whole kernel on small weights). A repeat call with the same QuantState skips the checks:
the op's one repeat-call cache (`CACHE`) keeps, per QuantState, what was checked (nf4.weight.StateCheck)
and, from the second call on, the launch bound by nf4.runtime; an entry serves a call only when the
state and the packed tensor still match. No device-to-host synchronisation happens per call: the
offset is read by the kernel from device memory.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import runtime
from ..weight import NF4Weight, RepeatCache, StateCheck, module_weight, unpack
from .config import DequantConfig
from .launch import launch

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE = RepeatCache()
_ENTRIES = CACHE.entries  # read directly by the repeat call (RepeatCache.get without the call)
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_is_compiling = torch.compiler.is_compiling
_raw_stream = runtime.raw_stream


class _Entry(StateCheck):
    """A checked QuantState with, from its second call on, its bound launch (`bound`) and what a repeat call needs:
    an empty tensor of the output's dtype and device (`template`), the output's strides and bytes, whether the
    kernel was specialised on an aligned output, and the bytes of the packed tensor and the state's tensors (whose
    addresses `check` compares on every call), where a caller's out= must not reach."""

    __slots__ = ("bound", "config", "out_aligned", "out_bytes", "packed_bytes", "ranges", "strides", "template")

    def repeat(self, qs, packed, out):
        """The repeat call's result: the bound launch on `packed` into `out` (allocated when None), transposed as
        bitsandbytes returns a row-shaped packed tensor; None where the state, the packed tensor or `out` is not
        what this entry checked (the full path then decides)."""
        if type(packed) is torch.Tensor:
            ptr, shape = self.check(qs, packed), packed.shape
        elif isinstance(packed, torch.Tensor):  # a Params4bit: its metadata without __torch_function__
            with _NO_TORCH_FUNCTION():
                ptr, shape = self.check(qs, packed), packed.shape
        else:
            return None
        if ptr < 0:
            return None
        transpose = len(shape) != 0 and shape[0] == 1
        if transpose and len(self.w.shape) > 2:
            return None  # (the full path's error)
        if out is None:  # (cheaper to call than torch.empty(shape, dtype=, device=) and new_empty: strides given)
            out = self.template.new_empty_strided(self.w.shape, self.strides)
            out_ptr = out.data_ptr()
        else:
            out_ptr = self.out_ptr(out, ptr)
            if out_ptr < 0:
                return None
        bound = self.bound
        bound.fn(bound.ctx, _raw_stream(self.index), ptr, out_ptr)
        return out.t() if transpose else out

    def out_ptr(self, out, packed_ptr: int) -> int:
        """The data pointer of a caller's `out` the bound kernel can write: the entry's shape, dtype and device,
        contiguous, 16-byte aligned where the compiled kernel assumes it, sharing no memory with the packed bytes
        at `packed_ptr` or the state's tensors (what `_shared` checks); else -1."""
        if not (type(out) is torch.Tensor and out.dtype is self.w.dtype and out.shape == self.w.shape
                and out.get_device() == self.index and out.is_contiguous()):
            return -1
        start = out.data_ptr()
        if self.out_aligned and start % 16:
            return -1
        end = start + self.out_bytes
        if start < packed_ptr + self.packed_bytes and packed_ptr < end:
            return -1
        for a, b in self.ranges:
            if start < b and a < end:
                return -1
        return start


def contiguous_strides(shape) -> tuple:
    """The strides torch gives a contiguous tensor of `shape` (for Tensor.new_empty_strided)."""
    strides, step = [], 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _remember(qs, w: NF4Weight, out, compiled, fn, grid, args, asked) -> None:
    """Note a checked call in the cache: a first call keeps the check only, the second binds the launch."""
    entry = CACHE.peek(qs)
    if entry is None or not entry.matches(qs, w.packed) or entry.config is not asked:
        entry = _Entry(qs, w)
        entry.bound, entry.config = None, asked
        CACHE.put(qs, entry)
        return
    if entry.bound is not None or runtime.hooks_active():
        return  # (profiling hooks want the full path)
    entry.out_aligned = out.data_ptr() % 16 == 0  # the kernel was specialised on it
    entry.template = torch.empty(0, dtype=out.dtype, device=out.device)
    entry.strides = contiguous_strides(w.shape)
    entry.out_bytes = w.n * out.element_size()
    entry.packed_bytes = w.packed.numel() * w.packed.element_size()
    # (the state's tensors are the entry's own: `check` holds their addresses and sizes to these on every call)
    entry.ranges = tuple((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                         for t in (w.absmax, w.absmax2, w.code2, w.offset) if t is not None and t.numel())
    direct = asked is None or asked.direct_launch
    entry.bound = runtime.bind(compiled, fn, grid, args, ("packed_ptr", "out_ptr"), direct=direct)


def check_out(out, w: NF4Weight, out_dtype) -> None:
    """A caller's `out`: a contiguous tensor of the weight's shape, the output dtype and device, sharing no memory
    with the packed weight or its state."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != w.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {w.shape}")
    if out.dtype != out_dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {out_dtype}")
    if out.device != w.device:
        raise ValueError(f"out is on {out.device}, expected {w.device} like the packed weight")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if torch.compiler.is_compiling() or out.is_meta:  # (traced and meta tensors have no addresses to compare)
        return
    name = _shared(out, w.packed, w)
    if name is not None:
        raise ValueError(f"out shares memory with {name}: expected a separate buffer (the kernel would overwrite "
                         "its own input)")


def _shared(out, packed, w: NF4Weight) -> str | None:
    """The input `out` shares memory with (the packed weight or a state tensor), else None."""
    for name, t in (("the packed weight", packed), ("quant_state.absmax", w.absmax),
                    ("quant_state.state2.absmax", w.absmax2), ("quant_state.state2.code", w.code2),
                    ("quant_state.offset", w.offset)):
        if t is not None and _overlap(out, t):
            return name
    return None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two contiguous tensors intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def dequantize(weight, quant_state=None, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               ftz: bool | None = None, config: DequantConfig | None = None) -> torch.Tensor:
    """Dequantize an NF4 weight (double-quantized or not) with one fused Triton kernel.

    weight: a `bnb.nn.Linear4bit`, a `Params4bit`, or the packed tensor (any quant_storage).
    quant_state: the `bitsandbytes.functional.QuantState` (taken from `weight` when omitted).
    out: optional preallocated output of `quant_state.shape`, contiguous, on the same device, sharing
    no memory with the inputs.
    dtype: output dtype (float16, bfloat16, float32); defaults to `quant_state.dtype`.
    ftz: flush subnormal float32 operands and products to zero. Default: on for CUDA tensors,
    matching bitsandbytes' CUDA build; off on CPU (interpreter), matching its CPU routes and
    the reference's default.
    config: meta-parameters (`nf4.DequantConfig`); default: the tuned table's choice.
    Returns the weight in `quant_state.shape`, or its transpose when the packed tensor's
    `shape[0] == 1` (as bitsandbytes and Unsloth do). Inputs are never modified.
    """
    # The repeat call: a bound launch exists only for CUDA tensors with ftz on (the CUDA default).
    if dtype is None and (ftz is None or ftz is True) and not _is_compiling():
        packed, qs = weight, quant_state
        if qs is None:
            if not isinstance(weight, torch.Tensor):
                packed = module_weight(weight)
            qs = getattr(packed, "quant_state", None)
        entry = _ENTRIES.get(id(qs))  # (None is never a key)
        if entry is not None and entry.bound is not None and entry.config is config:
            y = entry.repeat(qs, packed, out)
            if y is not None:
                return y
    if ftz is not None and not isinstance(ftz, (bool, np.bool_)):
        raise TypeError(f"ftz must be True, False or None (the device's default), got {type(ftz).__name__} {ftz!r}")
    if config is not None and not isinstance(config, DequantConfig):
        raise TypeError(f"config must be a nf4.DequantConfig or None, got {type(config).__name__} {config!r}")
    if dtype is not None and dtype not in OUT_DTYPES:
        raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
    packed, qs = unpack(weight, quant_state)
    w = NF4Weight.from_state(packed, qs)
    if w.transposed and len(w.shape) > 2:
        raise ValueError(f"packed weight has shape {tuple(packed.shape)} (a row), whose result bitsandbytes returns "
                         f"transposed, but quant_state.shape {w.shape} has more than 2 dimensions: expected a packed "
                         "tensor of shape (n, 1) for it")
    return dequantize_weight(w, qs, out=out, dtype=dtype, ftz=ftz, config=config)


def dequantize_weight(w: NF4Weight, qs=None, *, out=None, dtype=None, ftz=None, config=None) -> torch.Tensor:
    """nf4.dequantize on a checked weight (what nf4.linear's dequant path calls). qs: the QuantState to note in
    the repeat-call cache (None: none)."""
    compiling = torch.compiler.is_compiling()
    device = w.device
    out_dtype = w.dtype if dtype is None else dtype
    ftz = device.type == "cuda" if ftz is None else bool(ftz)
    if out is None:
        if w.n == 0 or not compiling:  # under torch.compile the op allocates its result
            out = torch.empty(w.shape, dtype=out_dtype, device=device)
    else:
        check_out(out, w, out_dtype)
    if w.n == 0:  # an empty weight: an empty result, as bitsandbytes returns
        return out.t() if w.packed.dim() == 2 and w.transposed else out
    if compiling:  # the triton_ops of nf4.dequant.ops, with the tuned table's config
        from .ops import dequantize_op

        out = dequantize_op(w, out, out_dtype, ftz)
    else:
        out, compiled, fn, grid, args = launch(w, out, ftz, config)
        cacheable = config is None or (config.plan and not config.fp_fusion)
        if (qs is not None and compiled is not None and cacheable and dtype is None and ftz
                and device.type == "cuda" and not runtime.is_recording()):
            _remember(qs, w, out, compiled, fn, grid, args, config)
    return out.t() if w.transposed else out
