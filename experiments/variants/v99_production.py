"""v99: nf4.dequantize itself, the public entry point: checks, then the cached launch.

Teaches nothing new; it is the row every other variant is compared with, and the one whose
host time (checks included) the challenge harness pays.
"""

from __future__ import annotations

import nf4
from experiments.registry import register
from nf4.kernel import nf4_dequantize_kernel


@register("v99_production", parent="v51_cached_launch", change="nf4.dequantize: input checks + cached launch",
          kernel=nf4_dequantize_kernel, host_timing=True)
def run(packed, quant_state, out, *, ftz):
    got = nf4.dequantize(packed, quant_state, out=out, ftz=ftz)
    return got.t() if packed.shape[0] == 1 else got  # undo the (1, k) transpose: compare in quant_state.shape
