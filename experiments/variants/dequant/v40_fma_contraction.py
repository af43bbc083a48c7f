"""v40-v41: the production kernel compiled with fp fusion on: `code2 * absmax2 + offset` may become one FMA.

Teaches why the launcher passes enable_fp_fusion=False: an FMA rounds once where bitsandbytes
rounds twice (a product, then a separate add), so some absmax values, and every weight of their
block, move by an ulp. Not exact by design: the runner reports the mismatch count and never
times these. With ftz=True on a GPU the first product is inline PTX (mul.rn.ftz.f32), which the
compiler cannot fuse with the add; v41 therefore also runs the IEEE path (ftz=False, no
subnormals occur in these weights), where contraction is possible. `--sm75` counts the FMAs.
The interpreter never contracts: there both are exact.
"""

from __future__ import annotations

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel


@register("v40_fma_contraction", parent="v51_cached_launch", change="compiled with enable_fp_fusion=True",
          exact_expected=False, kernel=nf4_dequantize_kernel)
def run(packed, quant_state, out, *, ftz):
    return common.launch_production(packed, quant_state, out, ftz, fp_fusion=True)


@register("v41_fma_contraction_ieee", parent="v40_fma_contraction",
          change="fp fusion on and ftz=False: a plain mul.f32 the compiler can contract", exact_expected=False,
          kernel=nf4_dequantize_kernel)
def run_ieee(packed, quant_state, out, *, ftz):
    return common.launch_production(packed, quant_state, out, False, fp_fusion=True)
