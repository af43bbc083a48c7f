"""v20: the NF4 codebook as a tl.where select tree instead of a gather from a 16-entry table.

Teaches the trade between a memory gather (one L1-resident load per weight) and arithmetic
(15 selects per weight on the 4 bits of the code, constants in the instruction stream). The
production kernel through nf4.dequant.launch with its default meta-parameters and codebook=1.
"""

from __future__ import annotations

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel


@register("v20_select_tree", parent="v51_cached_launch", change="codebook: tl.where select tree on the 4 code bits",
          kernel=nf4_dequantize_kernel)
def run(packed, quant_state, out, *, ftz):
    return common.launch_production(packed, quant_state, out, ftz, codebook=1)
