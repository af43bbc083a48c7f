"""The fused linear's backward for the experiments: dY @ W (the input gradient, W frozen as in QLoRA).

Everything is `experiments.ops.linear` with backward=True: a case `NxKxM[:fp16|bf16[:BLOCKSIZE]]`
is W of N x K and dY of M x N; a variant is called as `run(dy, packed, quant_state, out, *, ftz)`
and writes dY @ W ([M, K], dY's dtype) into `out`. The checked dY is made of signed
power-of-two-scaled identity rows, so row i of the output must be `scales[i] * W[rows[i], :] + 0.0`
bit for bit (the operand of the transposed product is the dequantized weight too).
"""

from __future__ import annotations

from .linear import SM75_BACKWARD_WEIGHT as SM75_WEIGHT
from .linear import _op
from .linear import meta_inputs as _meta_inputs

__all__ = ["OP", "SM75_WEIGHT", "meta_inputs"]

OP = _op(backward=True)


def meta_inputs(out_dtype) -> tuple:
    """(dy, packed, quant_state, out) on the meta device for the offline sm_75 compile."""
    return _meta_inputs(out_dtype, backward=True)
