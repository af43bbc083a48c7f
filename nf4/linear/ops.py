"""nf4.linear as `torch.library` ops, so that torch.compile(fullgraph=True) traces through it.

Only used while torch.compile traces (`nf4.linear` checks `torch.compiler.is_compiling()`).
- `nf4::linear`: a `triton_op` whose body launches the linear kernels with `wrap_triton`, so Inductor
  sees the Triton kernels themselves; its autograd formula is the same op with `trans` flipped (dY @ W),
  and the bias gradient a sum over rows.
- `nf4::dequantize_matmul_opaque`: the dequant path as one opaque op (the dequantize and the cuBLAS product
  eager runs), so that the compiled result keeps eager's bits: with the product in the graph, Inductor
  padded it (K = 333 to 336), picked another cuBLAS kernel and changed the last bit of 4 of 32768 gradients
  at M = 64 against eager (H200, tests/nf4/linear/test_gpu.py).
The weight's tensors are the ops' inputs (an op takes tensors, not an NF4Weight).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..dequant.launch import launch as dequant_launch
from ..traced import opaque_op, traced_tables
from ..weight import NF4Weight
from .autotune import pick
from .launch import bind_direct, dense_product, direct, kernel_args, launch_config, level_pairs, run_direct, split_k


def _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype) -> NF4Weight:
    return NF4Weight(packed, absmax, absmax2, code2, offset, (n, k), blocksize, w_dtype, absmax2 is not None)


# The opaque op's dequantize launches, bound once per set of launch facts (`_plan_key`) with every tensor pointer
# rebound on each call: a compiled graph hands the op its packed weight as an alias made anew for every call (and
# the state's tensors as they are), so no launch is kept by tensor identity; what the compiled kernel depends on
# (sizes, dtypes, blocksize, flags, each pointer's 16-byte alignment, which Triton specialises on) is the key. The
# opaque linear keeps a self-launching kernel's bound launches (gluon_launch.Bound) here the same way (`_direct_key`).
_PLANS: dict[tuple, object] = {}
_PLANS_LIMIT = 4096
_NESTED_SLOTS = ("packed_ptr", "absmax_ptr", "absmax2_ptr", "code2_ptr", "offset_ptr", "out_ptr")
_PLAIN_SLOTS = ("packed_ptr", "absmax_ptr", "out_ptr")


def _plan_key(parts: tuple, wt: torch.Tensor, n: int, k: int, blocksize: int, ftz: bool) -> tuple:
    """Everything a bound dequantize launch depends on besides its pointers (parts: packed, absmax and, nested,
    absmax2, code2, offset; wt the output)."""
    return (wt.device.index, n, k, blocksize, wt.dtype, ftz,
            *((t.dtype, t.numel(), t.data_ptr() % 16) for t in parts), wt.data_ptr() % 16)


def _direct_key(x, packed, state: tuple, bias, n: int, k: int, blocksize: int, w_dtype, ftz: bool) -> tuple:
    """What the table's choice and a self-launching kernel's bound launches (`launch.bind_direct`) depend on in the
    opaque op besides the pointers they rebind: the GPU, the shapes and dtypes, ftz, the bias, whether x and the
    packed bytes are contiguous, and the 16-byte alignment of x, the packed bytes, the bias and the state's tensors
    (absmax, absmax2, code2, offset; None where not nested), which Triton specialises on."""
    return ("direct", x.device.index, x.shape, x.dtype, x.is_contiguous(), x.data_ptr() % 16, packed.dtype,
            packed.numel(), packed.is_contiguous(), packed.data_ptr() % 16, n, k, blocksize, w_dtype, ftz,
            None if bias is None else (bias.dtype, bias.data_ptr() % 16),
            *(None if t is None else (t.dtype, t.data_ptr() % 16) for t in state))


def _bindable(device: torch.device) -> bool:
    """Whether launches on `device` can be bound (a CUDA GPU: Triton's interpreter and meta tensors launch none)."""
    return device.type == "cuda"


def _dequantize_scratch(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype, ftz, device):
    """The weight dequantized into a new [n, k] tensor of w_dtype: a bound launch where one was made for the same
    launch facts (on a CUDA GPU, no profiler hooks), else the full launch, which binds one for the next call."""
    wt = torch.empty((n, k), dtype=w_dtype, device=device)
    nested = absmax2 is not None
    parts = (packed, absmax, absmax2, code2, offset) if nested else (packed, absmax)
    key = _plan_key(parts, wt, n, k, blocksize, ftz) if _bindable(device) else None
    bound = _PLANS.get(key) if key is not None else None
    if bound is not None and not runtime.hooks_active():
        bound(runtime.raw_stream(device.index), *(t.data_ptr() for t in parts), wt.data_ptr())
        return wt
    _, compiled, fn, grid, args = dequant_launch(_weight(packed, absmax, absmax2, code2, offset, n, k, blocksize,
                                                         w_dtype), wt, ftz)
    if key is not None and compiled is not None and not runtime.hooks_active():
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        _PLANS[key] = runtime.bind(compiled, fn, grid, args, _NESTED_SLOTS if nested else _PLAIN_SLOTS)
    return wt


_STATE_ARGS = "Tensor x, Tensor packed, Tensor absmax, Tensor? absmax2, Tensor? code2, Tensor? offset, Tensor? bias"


def _dequantize_matmul_fake(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype, ftz, trans):
    return x.new_empty((x.shape[0], k if trans else n))


@opaque_op("dequantize_matmul_opaque",
           f"({_STATE_ARGS}, SymInt n, SymInt k, SymInt blocksize, ScalarType w_dtype, bool ftz, bool trans) -> Tensor",
           _dequantize_matmul_fake)
def _dequantize_matmul_opaque(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                              absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: torch.Tensor | None,
                              bias: torch.Tensor | None, n: int, k: int, blocksize: int, w_dtype: torch.dtype,
                              ftz: bool, trans: bool) -> torch.Tensor:
    """The weight dequantized into a scratch tensor, then the cuBLAS product eager runs."""
    wt = _dequantize_scratch(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype, ftz, x.device)
    return dense_product(x, wt, bias, trans)


def _linear_fake(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype, ftz):
    return x.new_empty((x.shape[0], n))


@opaque_op("linear_opaque", f"({_STATE_ARGS}, SymInt n, SymInt k, SymInt blocksize, ScalarType w_dtype, bool ftz)"
           " -> Tensor", _linear_fake)
def _linear_opaque(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
                   code2: torch.Tensor | None, offset: torch.Tensor | None, bias: torch.Tensor | None, n: int, k: int,
                   blocksize: int, w_dtype: torch.dtype, ftz: bool) -> torch.Tensor:
    """The forward's fused launches as eager runs them (nf4.runtime), as one opaque op: what the triton_op takes in
    Triton's interpreter, where `wrap_triton` cannot trace (the kernels are InterpretedFunctions, which would run on
    torch.compile's FakeTensors), and for a kernel that launches itself (`direct`: the Gluon GEMM)."""
    m = x.shape[0]
    state = (absmax, absmax2, code2, offset)
    key = _direct_key(x, packed, state, bias, n, k, blocksize, w_dtype, ftz) if _bindable(x.device) else None
    bound = _PLANS.get(key) if key is not None else None
    if bound is not None and not runtime.hooks_active():  # a kernel's own bound launches, the state rebound
        return bound(x, packed, bias, torch.empty((m, n), dtype=x.dtype, device=x.device), *state)
    w = _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype)
    config = launch_config(pick(x.device, m, False, n, k, blocksize, w.nested, w_dtype, x.dtype), w, x, m, False)
    if config.kernel == "dequant":
        return _dequantize_matmul_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype,
                                         ftz, False)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, _ = split_k(config, w, m, x.device)
    part = torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else None
    if direct(config):
        if key is None or runtime.hooks_active() or not x.is_contiguous():
            return run_direct(x, w, bias, out, m, config, ftz, part)
        bound = bind_direct(x, w, bias, out, m, config, ftz, part)
        if bound is not None:
            if len(_PLANS) >= _PLANS_LIMIT:
                _PLANS.clear()
            _PLANS[key] = bound
        return out
    for fn, grid, args, options in kernel_args(x, w, bias, out, m, config, ftz, runtime.interpreting(x.device), part):
        runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
    return out


@torch.library.triton_op("nf4::linear", mutates_args=())
def _linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
            code2: torch.Tensor | None, offset: torch.Tensor | None, code: torch.Tensor, code_pairs: torch.Tensor,
            dummy: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, blocksize: int, w_dtype: torch.dtype,
            ftz: bool, trans: bool) -> torch.Tensor:
    """x @ W^T + bias (trans: x @ W) for x of shape (M, K) (trans: (M, N)); the table's or the autotuned config."""
    from torch.library import wrap_triton

    w = _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype)
    m = x.shape[0]
    n_out = k if trans else n
    config = pick(x.device, m, trans, n, k, blocksize, w.nested, w_dtype, x.dtype)
    if config.kernel != "dequant":
        config = launch_config(config, w, x, m, trans)
    if config.kernel == "dequant":  # the table's, or a kernel's fallback
        # one opaque op for the dequantize and the product: with the triton_op Inductor laid the scratch weight
        # out its own way and, with the product in the graph, padded it; either changed the last bit of a few
        # gradients against eager
        return torch.ops.nf4.dequantize_matmul_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k,
                                                      blocksize, w_dtype, ftz, trans)
    # (a fused kernel is forward only: the backward takes the dequant path above); a kernel that launches itself
    # (TMA descriptors, which wrap_triton does not take) runs in the opaque op too
    if runtime.interpreter_on() or direct(config):
        return torch.ops.nf4.linear_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype,
                                           ftz)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    split, _ = split_k(config, w, m, x.device)
    part = torch.empty(split * m * n_out, dtype=torch.float32, device=x.device) if split > 1 else None
    table = code_pairs if level_pairs(config) else code
    for fn, grid, args, options in kernel_args(x, w, bias, out, m, config, ftz, runtime.interpreting(x.device),
                                               part, code=table, dummy=dummy):
        wrap_triton(fn)[grid](**args, **options)
    return out


def _linear_setup(ctx, inputs, output):
    _, packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, bias = inputs[:10]
    ctx.weight = (packed, absmax, absmax2, code2, offset, code, code_pairs, dummy)
    ctx.meta = inputs[10:]  # n, k, blocksize, w_dtype, ftz, trans
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    n, k, blocksize, w_dtype, ftz, trans = ctx.meta
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.nf4.linear(grad.contiguous(), *ctx.weight, None, n, k, blocksize, w_dtype, ftz, not trans)
    grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[9] else None
    return (grad_x, None, None, None, None, None, None, None, None, grad_bias, None, None, None, None, None, None)


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_op(x, w: NF4Weight, bias, ftz: bool):
    """nf4.linear through the triton_op (what torch.compile traces): x (..., K) -> (..., N)."""
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernels read it as N contiguous values, as the eager call makes it
    code, code_pairs, dummy = traced_tables(x.device)
    y = torch.ops.nf4.linear(x2, w.packed, w.absmax, w.absmax2, w.code2, w.offset, code, code_pairs, dummy, bias,
                             n, k, w.blocksize, w.dtype, ftz, False)
    return y.reshape(*lead, n)
