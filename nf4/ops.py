"""The kernels as `torch.library` ops, so that torch.compile(fullgraph=True) traces through them.

Only used while torch.compile traces (`nf4.dequantize` and `nf4.linear` check
`torch.compiler.is_compiling()`); eager calls launch the kernels directly and pay no dispatcher cost.

- `nf4::dequantize` (a new tensor) and `nf4::dequantize_into` (into `out`): `triton_op`s whose body
  launches the dequantize kernel with `wrap_triton`, so that Inductor sees the Triton kernel itself
  and schedules it in its graph. The launch is the one `nf4.launch` runs eagerly
  (`nf4.dequant.api.kernel_launch`, the tuned table's config) with two differences that tracing
  asks for: the word path is chosen from the packed tensor's storage offset (a traced tensor has
  no data pointer), as Inductor chooses its own alignment assumption, and the IEEE product is PTX
  too (Inductor compiles the kernel with FMA contraction on).
- `nf4::dequantize_opaque`: an opaque custom op launching through nf4.runtime. Those two ops take it
  in Triton's interpreter, where `wrap_triton` cannot trace (the kernels are InterpretedFunctions,
  which would run on torch.compile's FakeTensors), so that torch.compile works on a CPU as before;
  experiments.compile_dequant also times it against them.
- `nf4::linear`: a `triton_op` whose body launches the linear kernels with `wrap_triton`, so
  Inductor sees the Triton kernels themselves (its dequant path is one opaque op,
  `nf4::dequantize_matmul_opaque`: the dequantize and the cuBLAS product eager runs, so that the
  compiled result keeps eager's bits);
  its autograd formula is the same op with `trans` flipped (dY @ W), and the bias gradient a sum
  over rows.
"""

from __future__ import annotations

import torch

from .dequant.api import _dummy, _interpreter_on, code_table, kernel_launch, launch, traced_tables, tuned_config

# --- nf4.dequantize -------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def fill_tables(device: torch.device) -> None:
    """Fill nf4.dequant.api's level tables and stand-in for `device` (nf4.dequant.api.traced_tables).

    torch.compile calls this instead of tracing it, so the caches are filled before the trace reads them.
    Traced, a cold cache would be filled by the graph: a side effect that Dynamo refuses inside an
    autograd.Function (bitsandbytes' MatMul4Bit.backward dequantizes there), and the pair table would be
    built through torch._numpy, which has no uint64 shifts. It lives here, not in nf4.dequant.api, because
    the decorator imports torch._dynamo, which `import nf4` must not load.
    """
    code_table(device, 0)
    code_table(device, 2)
    _dummy(device)



@torch.library.custom_op("nf4::dequantize_opaque", mutates_args=("out",))
def _dequantize_opaque(
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


@_dequantize_opaque.register_fake
def _(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz) -> None:
    return None


@torch.library.custom_op("nf4::dequantize_matmul_opaque", mutates_args=())
def _dequantize_matmul_opaque(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    k: int,
    blocksize: int,
    w_dtype: torch.dtype,
    ftz: bool,
    trans: bool,
) -> torch.Tensor:
    """nf4.linear's dequant path as one opaque op: the weight dequantized into a scratch tensor, then the
    cuBLAS product eager runs (x @ W, or F.linear(x, W, bias)). Opaque, so that Inductor cannot rewrite the
    product: its mm padding (K = 333 padded to 336) picked another cuBLAS kernel and changed the last bit
    of 4 of 32768 gradients at M = 64 against eager (H200, tests/nf4/linear/test_gpu.py)."""
    from .linear.api import dense_product

    wt = torch.empty((n, k), dtype=w_dtype, device=x.device)
    launch(packed, absmax, absmax2, code2, offset, wt, n * k, blocksize, absmax2 is not None, ftz)
    return dense_product(x, wt, bias, trans)


@_dequantize_matmul_opaque.register_fake
def _(x, packed, absmax, absmax2, code2, offset, bias, n, k, blocksize, w_dtype, ftz, trans):
    return x.new_empty((x.shape[0], k if trans else n))


def _word_aligned(packed: torch.Tensor) -> bool:
    """Whether the packed bytes start 4-byte aligned (the kernel's word path).

    A tensor with data answers by its pointer. A traced one (FakeTensor) has none: its storage offset
    answers instead, where it keeps the bytes 16-byte aligned, which is the alignment Inductor assumes
    of such a graph input and restores (by a copy) when one arrives misaligned
    (`torch._inductor.utils.tensor_is_aligned`).
    """
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not is_fake(packed):
        return packed.data_ptr() % 4 == 0
    return statically_known_true(packed.storage_offset() * packed.element_size() % 16 == 0)


def _dequantize_traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz):
    """The dequantize kernel into `out` as a triton_op's body launches it: through `wrap_triton`, or in
    Triton's interpreter through the opaque op."""
    n = out.numel()
    if n == 0:
        return
    nested = absmax2 is not None
    if _interpreter_on():
        torch.ops.nf4.dequantize_opaque(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz)
        return
    from torch.library import wrap_triton

    config = tuned_config(packed.device, n * out.element_size())
    fn, grid, args, options = kernel_launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz,
                                            config, vec=_word_aligned(packed), fusion_proof=True,
                                            code=code_pairs if config.codebook == 2 else code, dummy=dummy)
    wrap_triton(fn)[grid](**args, **options)


@torch.library.triton_op("nf4::dequantize", mutates_args=())
def _dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: torch.Tensor | None,
    code: torch.Tensor,
    code_pairs: torch.Tensor,
    dummy: torch.Tensor,
    shape: list[int],
    out_dtype: torch.dtype,
    blocksize: int,
    ftz: bool,
) -> torch.Tensor:
    """The weight of `shape` in out_dtype (absmax2, code2, offset: None without double quantization)."""
    out = torch.empty(shape, dtype=out_dtype, device=packed.device)
    _dequantize_traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz)
    return out


@torch.library.triton_op("nf4::dequantize_into", mutates_args=("out",))
def _dequantize_into(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: torch.Tensor | None,
    code: torch.Tensor,
    code_pairs: torch.Tensor,
    dummy: torch.Tensor,
    out: torch.Tensor,
    blocksize: int,
    ftz: bool,
) -> None:
    """The weight into `out` (contiguous, the weight's shape and output dtype)."""
    _dequantize_traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz)


def dequantize_op(packed, absmax, absmax2, code2, offset, out, shape, out_dtype, blocksize, ftz):
    """nf4.dequantize through the triton_ops (what torch.compile traces): into `out`, or a new tensor
    of `shape` and out_dtype when `out` is None; returns it."""
    tables = traced_tables(packed.device)
    if out is None:
        return torch.ops.nf4.dequantize(packed, absmax, absmax2, code2, offset, *tables, list(shape), out_dtype,
                                        blocksize, ftz)
    torch.ops.nf4.dequantize_into(packed, absmax, absmax2, code2, offset, *tables, out, blocksize, ftz)
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
    config = config_mod.tuned(api._device_name(x.device), m, trans, n=n, k=k)
    if config.path != "dequant":
        config = api.launch_config(config, w, x, packed, m, trans)
    if config.path == "dequant":  # the table's, or a tensor-core GEMV's fallback
        # one opaque op for the dequantize and the product: with the triton_op Inductor laid the scratch weight
        # out its own way (H100, results/linear/gpu_tests_h100_3968eae.txt) and, with the product in the graph,
        # padded it (see _dequantize_matmul_opaque); either changed the last bit of a few gradients against eager
        return torch.ops.nf4.dequantize_matmul_opaque(x, packed, absmax, absmax2, code2, offset, bias, n, k,
                                                      blocksize, w_dtype, ftz, trans)
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
    absmax, absmax2, code2, offset, n, k, blocksize, w_dtype = qs_parts
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    code, code_pairs, dummy = traced_tables(x.device)
    y = torch.ops.nf4.linear(x2, packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, bias, n, k,
                             blocksize, w_dtype, ftz, False)
    return y.reshape(*lead, n)
