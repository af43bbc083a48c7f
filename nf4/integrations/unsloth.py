"""Unsloth-compatible entry point: `fast_dequantize(W, quant_state=None, out=None, use_global_buffer=False)`."""

from __future__ import annotations

import torch

from ..dequant import dequantize


def fast_dequantize(W: torch.Tensor, quant_state=None, out: torch.Tensor | None = None,
                    use_global_buffer: bool = False) -> torch.Tensor:
    """Drop-in for `unsloth.kernels.utils.fast_dequantize` with NF4 states.

    Returns W unchanged when quant_state is None (Unsloth's behaviour for unquantized weights).
    `use_global_buffer` is accepted for signature compatibility; the fused kernel allocates only
    the output, so there is no intermediate buffer to reuse.
    """
    if quant_state is None:
        return W
    return dequantize(W, quant_state, out=out)
