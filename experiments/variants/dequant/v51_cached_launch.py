"""v51: the production kernel through nf4.dequant.launch: a compiled kernel cached per configuration.

Teaches what skipping the JIT's dispatch buys on the host (compare host_us with v50): the
launch is one dictionary lookup and a direct call of the compiled kernel. No input checks
(v99 adds nf4.dequantize's checks and allocation).
"""

from __future__ import annotations

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel


@register("v51_cached_launch", parent="v50_jit_launch", change="cached compiled launch (nf4.dequant.launch defaults)",
          kernel=nf4_dequantize_kernel, host_timing=True)
def run(packed, quant_state, out, *, ftz):
    return common.launch_production(packed, quant_state, out, ftz)
