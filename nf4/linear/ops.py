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
from ..traced import traced_tables
from ..weight import NF4Weight
from .launch import dense_product, kernel_args, launch_config, level_pairs, split_k
from .tuned import tuned


def _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype) -> NF4Weight:
    return NF4Weight(packed, absmax, absmax2, code2, offset, (n, k), blocksize, w_dtype, absmax2 is not None)


@torch.library.custom_op("nf4::dequantize_matmul_opaque", mutates_args=())
def _dequantize_matmul_opaque(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                              absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: torch.Tensor | None,
                              bias: torch.Tensor | None, n: int, k: int, blocksize: int, w_dtype: torch.dtype,
                              ftz: bool, trans: bool) -> torch.Tensor:
    """The weight dequantized into a scratch tensor, then the cuBLAS product eager runs."""
    wt = torch.empty((n, k), dtype=w_dtype, device=x.device)
    dequant_launch(_weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype), wt, ftz)
    return dense_product(x, wt, bias, trans)


@_dequantize_matmul_opaque.register_fake
def _(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype, ftz, trans):
    return x.new_empty((x.shape[0], k if trans else n))


@torch.library.custom_op("nf4::linear_opaque", mutates_args=())
def _linear_opaque(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
                   code2: torch.Tensor | None, offset: torch.Tensor | None, bias: torch.Tensor | None, n: int, k: int,
                   blocksize: int, w_dtype: torch.dtype, ftz: bool) -> torch.Tensor:
    """The forward's fused launches as eager runs them (nf4.runtime), as one opaque op: what the triton_op takes in
    Triton's interpreter, where `wrap_triton` cannot trace (the kernels are InterpretedFunctions, which would run on
    torch.compile's FakeTensors)."""
    w = _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype)
    m = x.shape[0]
    config = launch_config(tuned(runtime.device_name(x.device), m, False, n=n, k=k), w, x, m, False)
    if config.kernel == "dequant":
        return _dequantize_matmul_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype,
                                         ftz, False)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, _ = split_k(config, w, m, x.device)
    part = torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else None
    for fn, grid, args, options in kernel_args(x, w, bias, out, m, config, ftz, runtime.interpreting(x.device), part):
        runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
    return out


@_linear_opaque.register_fake
def _(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype, ftz):
    return x.new_empty((x.shape[0], n))


@torch.library.triton_op("nf4::linear", mutates_args=())
def _linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
            code2: torch.Tensor | None, offset: torch.Tensor | None, code: torch.Tensor, code_pairs: torch.Tensor,
            dummy: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, blocksize: int, w_dtype: torch.dtype,
            ftz: bool, trans: bool) -> torch.Tensor:
    """x @ W^T + bias (trans: x @ W) for x of shape (M, K) (trans: (M, N)); the tuned table's config."""
    from torch.library import wrap_triton

    w = _weight(packed, absmax, absmax2, code2, offset, n, k, blocksize, w_dtype)
    m = x.shape[0]
    n_out = k if trans else n
    config = tuned(runtime.device_name(x.device), m, trans, n=n, k=k)
    if config.kernel != "dequant":
        config = launch_config(config, w, x, m, trans)
    if config.kernel == "dequant":  # the table's, or a kernel's fallback
        # one opaque op for the dequantize and the product: with the triton_op Inductor laid the scratch weight
        # out its own way and, with the product in the graph, padded it; either changed the last bit of a few
        # gradients against eager
        return torch.ops.nf4.dequantize_matmul_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k,
                                                      blocksize, w_dtype, ftz, trans)
    if runtime.interpreter_on():  # (a fused kernel is forward only: the backward takes the dequant path above)
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
    code, code_pairs, dummy = traced_tables(x.device)
    y = torch.ops.nf4.linear(x2, w.packed, w.absmax, w.absmax2, w.code2, w.offset, code, code_pairs, dummy, bias,
                             n, k, w.blocksize, w.dtype, ftz, False)
    return y.reshape(*lead, n)
