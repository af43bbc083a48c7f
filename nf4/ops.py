"""The kernel as a `torch.library` custom op, so that torch.compile(fullgraph=True) traces through it.

Only used while torch.compile traces (`nf4.dequantize` checks `torch.compiler.is_compiling()`);
eager calls launch the kernel directly and pay no dispatcher cost.
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
