"""`nf4.linear`: x @ W^T (+ bias) for a bitsandbytes NF4 weight, decoded inside the matmul.

    y = nf4.linear(x, linear4bit.weight)                      # Params4bit (or the module itself)
    y = nf4.linear(x, packed, quant_state, bias=b)             # packed tensor + QuantState

The operand is the dequantized weight bit for bit (`nf4.dequantize(W).to(x.dtype)`, what
bitsandbytes' `matmul_4bit` fallback multiplies by); the sum is float32 (docs/FORMAT.md §10).
Differentiable in x and bias (W frozen, as in QLoRA): the backward computes dY @ W by nf4.dequantize
+ cuBLAS (the tuned table's backward row on every GPU measured; `launch_config` gives it to every backward).

The repeat call is kept short: the op's one repeat-call cache (`CACHE`) keeps, per QuantState, what
was checked (nf4.weight.StateCheck) and, for each (M, dtype, bias, direction, config, ftz) seen twice,
the launches bound by nf4.runtime (or a mark that sends the key to the dequant path); an entry serves
a call only while the state and the packed tensor still match.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import runtime
from ..dequant import dequantize
from ..weight import NF4Weight, RepeatCache, StateCheck, module_parts, plain, unpack
from .autotune import pick
from .config import LinearConfig
from .launch import bind_direct, dense_product, direct, fused, kernel_args, launch_config, run_direct, split_k

X_DTYPES = (torch.float16, torch.bfloat16)
_INT32_LIMIT = 2**31 - 1
_FAST_LIMIT = 64  # shapes of x per weight with a fast entry
_DEQUANT = ("dequant",)  # the launches' mark of a key that the table sends to the dequant path
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose methods need no Python dispatch
CACHE = RepeatCache()
_ENTRIES = CACHE.entries  # read directly by the repeat call (RepeatCache.get without the call)
_is_compiling = torch.compiler.is_compiling
_raw_stream = runtime.raw_stream


class _Entry(StateCheck):
    """A checked weight with its bound launches per call key (`launches`) and per shape of x (`fast`)."""

    __slots__ = ("K", "N", "fast", "fused", "launches")


def entry_of(packed, qs) -> _Entry:
    """The cache entry of (packed, qs): the cached one while it matches, else checked in full and kept."""
    compiling = torch.compiler.is_compiling()  # (a traced tensor has no data pointer to check: no cache)
    entry = None if compiling else CACHE.get(qs, packed)
    if entry is not None:
        return entry
    w = NF4Weight.from_state(packed, qs)
    if len(w.shape) != 2:
        raise ValueError(f"quant_state.shape must be 2-D (out_features, in_features) for a linear, got {w.shape}")
    entry = _Entry(qs, w)
    entry.N, entry.K = w.shape
    entry.fused, entry.launches, entry.fast = fused(w), {}, {}
    if not compiling:
        CACHE.put(qs, entry)
    return entry


def _check_x(x, entry: _Entry) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != entry.K:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (..., {entry.K}): the last dimension must be "
                         f"in_features of the weight {(entry.N, entry.K)}")
    if x.device != entry.device:
        raise ValueError(f"x is on {x.device}, expected {entry.device} like the weight")


def _check_bias(bias, x, entry: _Entry) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (entry.N,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({entry.N},)")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias has dtype {bias.dtype}, expected {x.dtype} like x")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device}, expected {x.device} like the weight")


def _fused_ok(x, entry: _Entry, m: int) -> bool:
    return entry.fused and x.dtype in X_DTYPES and m * max(entry.N, entry.K) <= _INT32_LIMIT


def _dequantized(packed, qs, ftz: bool) -> torch.Tensor:
    """nf4.dequantize (with its own repeat-call cache) as W [N, K], also for a row-shaped packed tensor (whose
    result nf4.dequantize returns transposed, as bitsandbytes does)."""
    wt = dequantize(packed, qs, ftz=ftz)
    return wt.t() if packed.shape[0] == 1 else wt


def _dequant_run(x, packed, qs, bias, trans: bool, ftz: bool) -> torch.Tensor:
    """The dequantized weight in a scratch tensor, then cuBLAS."""
    return dense_product(x, _dequantized(packed, qs, ftz), bias, trans)


def run(x, packed, qs, entry: _Entry, bias, *, trans: bool = False, config: LinearConfig | None = None,
        ftz: bool = True) -> torch.Tensor:
    """One fused product on checked inputs: x [..., K] -> [..., N] (trans: x [..., N] -> [..., K])."""
    numel = x.numel()
    n_out = entry.K if trans else entry.N
    if numel and x.is_contiguous():  # the repeat call: from the key to the bound launches, nothing else
        m = numel // x.shape[-1]
        plan = entry.launches.get((m, x.dtype, bias is not None, trans, config, ftz))
        if plan is _DEQUANT and x.data_ptr() % 4 == 0:  # the table's dequant path, chosen for this key
            return _dequant_run(x, packed, qs, bias, trans, ftz)
        if plan and _aligned_ptrs(x, packed, bias):
            return _run_plan(plan, x, packed, bias, m, entry.index, x.new_empty((*x.shape[:-1], n_out)))
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 4:
        x2 = x2.contiguous() if x2.data_ptr() % 4 == 0 else x2.clone(memory_format=torch.contiguous_format)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if m == 0 or n_out == 0:
        return torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    key = (m, x.dtype, bias is not None, trans, config, ftz)
    if config is None:
        state = entry.w  # the table's or the autotuner's choice (a race on a first call: nf4.linear.autotune)
        config = pick(x.device, m, trans, entry.N, entry.K, state.blocksize, state.nested, state.dtype, x.dtype)
    if config.kernel == "dequant":
        entry.launches[key] = _DEQUANT  # the same key always takes this path (the choice depends on nothing else)
        return _dequant_run(x2, packed, qs, bias, trans, ftz).reshape(*lead, n_out)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    plan = entry.launches.get(key)
    if plan and _aligned_ptrs(x2, packed, bias):
        return _run_plan(plan, x2, packed, bias, m, entry.index, out).reshape(*lead, n_out)
    w = entry.w.with_packed(plain(packed))
    config = launch_config(config, w, x2, m, trans)
    if config.kernel == "dequant":  # a tuned kernel's fallback
        return _dequant_run(x2, packed, qs, bias, trans, ftz).reshape(*lead, n_out)
    split, _ = split_k(config, w, m, x.device)
    part = torch.empty(split * m * n_out, dtype=torch.float32, device=x.device) if split > 1 else None
    if direct(config):  # a kernel that launches itself: it binds its own launches (`bind_direct`)
        if plan is None or not (config.plan and not runtime.hooks_active() and _aligned_ptrs(x2, packed, bias)):
            if plan is None and config.plan:
                entry.launches[key] = 0  # seen once: bound on the second call
            return run_direct(x2, w, bias, out, m, config, ftz, part).reshape(*lead, n_out)
        bound = bind_direct(x2, w, bias, out, m, config, ftz, part)
        if bound is not None:
            entry.launches[key] = bound
        return out.reshape(*lead, n_out)
    launches = kernel_args(x2, w, bias, out, m, config, ftz, runtime.interpreting(x.device), part)
    compiled = [runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
                for fn, grid, args, options in launches]
    if compiled[0] is not None and config.plan and not runtime.hooks_active() and all(
            t.data_ptr() % 16 == 0 for t in (x2, w.packed, out) + ((bias,) if bias is not None else ())):
        if plan is None:
            entry.launches[key] = 0  # seen once: bound on the second call, so a one-off M costs no bind
        else:
            with_bias = ("bias_ptr",) if bias is not None else ()
            fn, grid, args, _ = launches[0]
            main = runtime.bind(compiled[0], fn, grid, args,
                                ("x_ptr", "packed_ptr", "out_ptr") + (with_bias if part is None else ()))
            finish = None
            if part is not None:
                fn, grid, args, _ = launches[1]
                finish = runtime.bind(compiled[1], fn, grid, args, ("part_ptr", "out_ptr", *with_bias))
            entry.launches[key] = (main, finish, split * m * n_out)
    return out.reshape(*lead, n_out)


def _aligned_ptrs(x, packed, bias) -> bool:
    """x (contiguous), the packed bytes and the bias as a bound launch was made for: 16-byte aligned, the bias
    contiguous."""
    return (x.data_ptr() % 16 == 0 and packed.data_ptr() % 16 == 0
            and (bias is None or (bias.is_contiguous() and bias.data_ptr() % 16 == 0)))


def _run_plan(plan, x2, packed, bias, m: int, device_index: int, out) -> torch.Tensor:
    """The bound launches of a key (`entry.launches`) on x2 (contiguous, m rows) into `out`: a kernel's own bound
    call (`bind_direct`), or (main, finish, split partials' numel)."""
    if plan.__class__ is not tuple:
        return plan(x2, packed, bias, out)
    main, finish, part_numel = plan
    stream = runtime.raw_stream(device_index)
    if finish is None:
        if bias is None:
            main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), out.data_ptr())
        else:
            main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), out.data_ptr(), bias.data_ptr())
    else:
        part = x2.new_empty(part_numel, dtype=torch.float32)
        main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), part.data_ptr())
        if bias is None:
            finish.fn(finish.ctx, stream, part.data_ptr(), out.data_ptr())
        else:
            finish.fn(finish.ctx, stream, part.data_ptr(), out.data_ptr(), bias.data_ptr())
    return out


class _LinearFn(torch.autograd.Function):
    """x -> x @ W^T + bias with W frozen; backward dY @ W by nf4.dequantize + cuBLAS (`run(trans=True)`)."""

    @staticmethod
    def forward(ctx, x, bias, packed, qs, entry, config, ftz):
        ctx.packed, ctx.qs, ctx.entry, ctx.ftz = packed, qs, entry, ftz
        ctx.has_bias = bias is not None
        return _forward(x, packed, qs, entry, bias, config, ftz)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            if ctx.entry.fused and grad.dtype in X_DTYPES:
                grad_x = run(grad, ctx.packed, ctx.qs, ctx.entry, None, trans=True, ftz=ctx.ftz)
            else:
                grad_x = _dequant_run(grad, ctx.packed, ctx.qs, None, True, ctx.ftz)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None, None, None, None


def _forward(x, packed, qs, entry, bias, config, ftz):
    if _fused_ok(x, entry, math.prod(x.shape[:-1])):
        return run(x, packed, qs, entry, bias, config=config, ftz=ftz)
    # not fused: blocks that straddle rows, float32 x, or more than 2**31 elements of x or out
    return torch.nn.functional.linear(x, _dequantized(packed, qs, ftz).to(x.dtype), bias)


def _repeat(x, packed, qs, entry: _Entry, bias):
    """The repeat call on a cache entry: None unless the state and the packed tensor are as the entry checked (its
    `check`), x (a plain tensor) and the bias as the launches need (else the full path decides). `_fast_call` where
    it applies, else `run` or, where autograd records, `_LinearFn`. The caller disables __torch_function__ for a
    Params4bit `packed`."""
    ptr = entry.check(qs, packed)
    if ptr < 0:
        return None
    if bias is None:
        y = _fast_call(x, ptr, entry)
        if y is not None:
            return y
    index = entry.index
    if (x.dtype in X_DTYPES and entry.fused and x.get_device() == index and x.dim() and x.shape[-1] == entry.K
            and (index >= 0 or not x.is_meta)
            and (bias is None or (type(bias) in _PLAIN and bias.dtype is x.dtype and bias.dim() == 1
                                  and bias.shape[0] == entry.N and bias.get_device() == index
                                  and (index >= 0 or not bias.is_meta)))):
        ftz = index >= 0  # the device's default, as the full path sets it: on for CUDA, off on the CPU
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            # training: the backward runs later on autograd's thread, with __torch_function__ on again, so it gets
            # a plain alias of the packed bytes (no copy)
            return _LinearFn.apply(x, bias, plain(packed), qs, entry, None, ftz)
        y = run(x, packed, qs, entry, bias, ftz=ftz)
        if bias is None and x.is_contiguous():
            _remember_fast(x, entry, ftz)
        return y
    return None


def _remember_fast(x, entry: _Entry, ftz: bool) -> None:
    """Note the bound single launch of (x's shape and dtype, no bias, the default config) in `entry.fast`, for
    `_fast_call`; nothing where that key has no bound launch yet, or has two (a split-K sum) or the dequant path."""
    shape = x.shape
    plan = entry.launches.get((x.numel() // shape[-1], x.dtype, False, False, None, ftz))
    if type(plan) is tuple and plan is not _DEQUANT and plan[1] is None:
        if len(entry.fast) >= _FAST_LIMIT:
            entry.fast.clear()
        out_shape = (*shape[:-1], entry.N)
        strides = tuple(math.prod(out_shape[i + 1:]) for i in range(len(out_shape)))
        entry.fast[shape] = (x.dtype, plan[0], out_shape, strides)


def _fast_call(x, packed_ptr: int, entry: _Entry):
    """The shortest repeat call, on packed bytes at `packed_ptr` that the entry's `check` passed: x of a shape and
    dtype that `_remember_fast` noted, no bias, no autograd recording, x contiguous and both pointers 16-byte aligned
    (as the bound launch was made for). The output, or None (then `_repeat` decides)."""
    item = entry.fast.get(x.shape)
    if (item is None or item[0] is not x.dtype or x.get_device() != entry.index or not x.is_contiguous()
            or (x.requires_grad and torch.is_grad_enabled())):
        return None
    x_ptr = x.data_ptr()
    if (x_ptr | packed_ptr) & 15:
        return None
    out = x.new_empty_strided(item[2], item[3])  # (cheaper to call than new_empty: the strides are given)
    bound = item[1]
    bound.fn(bound.ctx, _raw_stream(entry.index), x_ptr, packed_ptr, out.data_ptr())
    return out


def linear(x: torch.Tensor, weight, quant_state=None, bias: torch.Tensor | None = None, *,
           config: LinearConfig | None = None, ftz: bool | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for an NF4 weight W of shape (out_features, in_features).

    x: float16 or bfloat16 (float32 is accepted and goes through `nf4.dequantize` + F.linear),
    any leading dimensions, last dimension in_features. weight: a `bnb.nn.Linear4bit`, a
    `Params4bit`, or the packed tensor with its `quant_state` (double-quantized or not, any
    quant_storage, bitsandbytes' packed layout). bias: (out_features,) in x's dtype, or None.
    Returns (..., out_features) in x's dtype, accumulated in float32. Differentiable in x and
    bias. config: a `nf4.LinearConfig` (default: the tuned table's choice for this GPU and M).
    ftz: as in `nf4.dequantize` (default on for CUDA, off on CPU). Inputs are never modified.
    """
    # The repeat call: a checked weight, x of a fused dtype on its device, not compiling (with or without grad).
    if config is None and ftz is None and type(x) is torch.Tensor and not _is_compiling():
        packed, qs, b = weight, quant_state, bias
        if qs is None:
            if bias is None and not isinstance(weight, torch.Tensor):
                packed, b = module_parts(weight)  # a Linear4bit: its weight and bias
            qs = getattr(packed, "quant_state", None)  # a Params4bit's own
        entry = _ENTRIES.get(id(qs))  # (None is never a key)
        if entry is not None:
            if type(packed) is torch.Tensor:
                y = _repeat(x, packed, qs, entry, b)
            elif isinstance(packed, torch.Tensor):
                # A Params4bit (bitsandbytes' Linear4bit passes its weight so) turns every method call into a
                # Python __torch_function__ dispatch; none is needed to read its metadata and pointer.
                with _NO_TORCH_FUNCTION():
                    y = _repeat(x, packed, qs, entry, b)
            else:
                y = None
            if y is not None:
                return y
    compiling = _is_compiling()
    if quant_state is None and not isinstance(weight, torch.Tensor) and bias is None:
        bias = getattr(weight, "bias", None)  # a Linear4bit brings its bias
        if isinstance(bias, torch.Tensor) and isinstance(x, torch.Tensor) and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)  # as Linear4bit.forward does (its bias stays float32 while x is 16-bit)
    packed, qs = unpack(weight, quant_state)
    entry = entry_of(packed, qs)
    _check_x(x, entry)
    _check_bias(bias, x, entry)
    if ftz is not None and not isinstance(ftz, (bool, np.bool_)):
        raise TypeError(f"ftz must be True, False or None (the device's default), got {type(ftz).__name__} {ftz!r}")
    if config is not None and not isinstance(config, LinearConfig):
        raise TypeError(f"config must be a nf4.LinearConfig or None, got {type(config).__name__} {config!r}")
    ftz = x.device.type == "cuda" if ftz is None else bool(ftz)
    packed = plain(packed)
    if compiling:
        from .ops import linear_op

        if not _fused_ok(x, entry, math.prod(x.shape[:-1])):
            return torch.nn.functional.linear(x, _dequantized(packed, qs, ftz).to(x.dtype), bias)
        return linear_op(x, entry.w.with_packed(packed), bias, ftz)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearFn.apply(x, bias, packed, qs, entry, config, ftz)
    return _forward(x, packed, qs, entry, bias, config, ftz)
