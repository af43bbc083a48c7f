"""The kernels as `torch.library` ops, so that torch.compile(fullgraph=True) traces through them.

Only used while torch.compile traces (`nf4.dequantize` and `nf4.linear` check
`torch.compiler.is_compiling()`); eager calls launch the kernels directly and pay no dispatcher cost.

- `nf4::dequantize_into`: an opaque custom op (Inductor calls it; it launches through nf4.runtime).
- `nf4::linear`: a `triton_op` whose body launches the linear kernels with `wrap_triton`, so
  Inductor sees the Triton kernels themselves; its autograd formula is the same op with `trans`
  flipped (dY @ W), and the bias gradient a sum over rows.
"""

from __future__ import annotations

import torch

from .dequant.api import launch


@torch.library.custom_op("nf4::dequantize_into", mutates_args=("out",))
def _dequantize_into(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: torch.Tensor | None,
    out: torch.Tensor,
    n: int,
    blocksize: int,
    nested: bool,
    ftz: bool,
) -> None:
    launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz)


@_dequantize_into.register_fake
def _(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz) -> None:
    return None


def dequantize_op(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz):
    """Run the kernel through the custom op (traceable); returns `out`."""
    torch.ops.nf4.dequantize_into(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz)
    return out


# --- nf4.linear: a triton_op, so that Inductor sees (and schedules) the Triton kernels --------------


@torch.library.triton_op("nf4::linear", mutates_args=())
def _linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: torch.Tensor | None,
    code: torch.Tensor,
    code_pairs: torch.Tensor,
    dummy: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    k: int,
    blocksize: int,
    w_dtype: torch.dtype,
    ftz: bool,
    trans: bool,
) -> torch.Tensor:
    """x @ W^T + bias (trans: x @ W) for x of shape (M, K) (trans: (M, N)); the tuned table's config."""
    from torch.library import wrap_triton

    from . import runtime
    from .linear import api
    from .linear import config as config_mod

    w = api.new_weight(n, k, blocksize, absmax2 is not None, w_dtype, absmax, absmax2, code2, offset, x.device)
    m = x.shape[0]
    n_out = k if trans else n
    config = config_mod.tuned(api._device_name(x.device), m, trans)
    if config.path == "dequant":
        wt = torch.empty((n, k), dtype=w_dtype, device=x.device)
        dequantize_op(packed, absmax, absmax2, code2, offset, wt, n * k, blocksize, w.nested, ftz)
        wt = wt.to(x.dtype)
        return x @ wt if trans else torch.nn.functional.linear(x, wt, bias)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    split, _ = api.split_k(config, w, m, trans, x.device)
    part = torch.empty(split * m * n_out, dtype=torch.float32, device=x.device) if split > 1 else None
    table = code_pairs if config.codebook == 2 else code
    launches = api.kernel_args(x, packed, w, bias, out, m, trans, config, ftz, runtime.interpreting(x.device), part,
                               code=table, dummy=dummy)
    for fn, grid, args, options in launches:
        wrap_triton(fn)[grid](**args, **options)
    return out


def _linear_setup(ctx, inputs, output):
    _, packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, bias = inputs[:10]
    n, k, blocksize, w_dtype, ftz, trans = inputs[10:]
    ctx.weight = (packed, absmax, absmax2, code2, offset, code, code_pairs, dummy)
    ctx.meta = (n, k, blocksize, w_dtype, ftz, trans)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    packed, absmax, absmax2, code2, offset, code, code_pairs, dummy = ctx.weight
    n, k, blocksize, w_dtype, ftz, trans = ctx.meta
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.nf4.linear(grad.contiguous(), packed, absmax, absmax2, code2, offset, code, code_pairs,
                                      dummy, None, n, k, blocksize, w_dtype, ftz, not trans)
    grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[9] else None
    return (grad_x, None, None, None, None, None, None, None, None, grad_bias, None, None, None, None, None, None)


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_op(x, packed, qs_parts, bias, ftz: bool):
    """nf4.linear through the triton_op (what torch.compile traces): x (..., K) -> (..., N)."""
    from .dequant.api import _dummy, code_table
    absmax, absmax2, code2, offset, n, k, blocksize, w_dtype = qs_parts
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch.ops.nf4.linear(x2, packed, absmax, absmax2, code2, offset, code_table(x.device, 0),
                             code_table(x.device, 2), _dummy(x.device), bias, n, k, blocksize, w_dtype, ftz, False)
    return y.reshape(*lead, n)
