"""The dequantize kernel as `torch.library` ops, so that torch.compile(fullgraph=True) traces through it.

Only used while torch.compile traces (`nf4.dequantize` checks `torch.compiler.is_compiling()`); eager
calls launch the kernel directly and pay no dispatcher cost.

- `nf4::dequantize` (a new tensor) and `nf4::dequantize_into` (into `out`): `triton_op`s whose body
  launches the kernel with `wrap_triton`, so that Inductor sees the Triton kernel itself and schedules
  it in its graph. The launch is `nf4.dequant.launch.kernel_launch` with the tuned table's config and
  two differences that tracing asks for: the word path is chosen from the packed tensor's storage
  offset (a traced tensor has no data pointer), as Inductor chooses its own alignment assumption, and
  the IEEE product is PTX too (Inductor compiles the kernel with FMA contraction on).
- `nf4::dequantize_opaque`: an opaque custom op launching through nf4.runtime. The triton_ops take it in
  Triton's interpreter, where `wrap_triton` cannot trace (the kernels are InterpretedFunctions, which
  would run on torch.compile's FakeTensors).
The weight's tensors are the ops' inputs (an op takes tensors, not an NF4Weight); `_weight` rebuilds
the value inside.
"""

from __future__ import annotations

import torch

from .. import runtime
from ..traced import traced_tables
from ..weight import NF4Weight
from .launch import kernel_launch, launch, tuned_config


def _weight(packed, absmax, absmax2, code2, offset, shape, blocksize, dtype) -> NF4Weight:
    """An op's inputs as the (already checked) weight they are."""
    return NF4Weight(packed, absmax, absmax2, code2, offset, tuple(shape), blocksize, dtype, absmax2 is not None)


@torch.library.custom_op("nf4::dequantize_opaque", mutates_args=("out",))
def _dequantize_opaque(packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
                       code2: torch.Tensor | None, offset: torch.Tensor | None, out: torch.Tensor, blocksize: int,
                       ftz: bool) -> None:
    launch(_weight(packed, absmax, absmax2, code2, offset, out.shape, blocksize, out.dtype), out, ftz)


@_dequantize_opaque.register_fake
def _(packed, absmax, absmax2, code2, offset, out, blocksize, ftz) -> None:
    return None


def word_aligned(packed: torch.Tensor) -> bool:
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


def _traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz):
    """The kernel into `out` as a triton_op's body launches it: through `wrap_triton`, or in Triton's
    interpreter through the opaque op."""
    n = out.numel()
    if n == 0:
        return
    if runtime.interpreter_on():
        torch.ops.nf4.dequantize_opaque(packed, absmax, absmax2, code2, offset, out, blocksize, ftz)
        return
    from torch.library import wrap_triton

    w = _weight(packed, absmax, absmax2, code2, offset, out.shape, blocksize, out.dtype)
    config = tuned_config(packed.device, n * out.element_size())
    fn, grid, args, options = kernel_launch(w, out, ftz, config, vec=word_aligned(packed), fusion_proof=True,
                                            code=code_pairs if config.codebook == 2 else code, dummy=dummy)
    wrap_triton(fn)[grid](**args, **options)


@torch.library.triton_op("nf4::dequantize", mutates_args=())
def _dequantize(packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
                code2: torch.Tensor | None, offset: torch.Tensor | None, code: torch.Tensor,
                code_pairs: torch.Tensor, dummy: torch.Tensor, shape: list[int], out_dtype: torch.dtype,
                blocksize: int, ftz: bool) -> torch.Tensor:
    """The weight of `shape` in out_dtype (absmax2, code2, offset: None without double quantization)."""
    out = torch.empty(shape, dtype=out_dtype, device=packed.device)
    _traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz)
    return out


@torch.library.triton_op("nf4::dequantize_into", mutates_args=("out",))
def _dequantize_into(packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
                     code2: torch.Tensor | None, offset: torch.Tensor | None, code: torch.Tensor,
                     code_pairs: torch.Tensor, dummy: torch.Tensor, out: torch.Tensor, blocksize: int,
                     ftz: bool) -> None:
    """The weight into `out` (contiguous, the weight's shape and output dtype)."""
    _traceable(packed, absmax, absmax2, code2, offset, code, code_pairs, dummy, out, blocksize, ftz)


def dequantize_op(w: NF4Weight, out, out_dtype, ftz: bool):
    """nf4.dequantize through the triton_ops (what torch.compile traces): into `out`, or a new tensor of the
    weight's shape and out_dtype when `out` is None; returns it."""
    tables = traced_tables(w.device)
    if out is None:
        return torch.ops.nf4.dequantize(w.packed, w.absmax, w.absmax2, w.code2, w.offset, *tables, list(w.shape),
                                        out_dtype, w.blocksize, ftz)
    torch.ops.nf4.dequantize_into(w.packed, w.absmax, w.absmax2, w.code2, w.offset, *tables, out, w.blocksize, ftz)
    return out


