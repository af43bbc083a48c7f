"""v50: the production kernel launched through Triton's JIT (`kernel[grid](...)`) on every call.

Teaches host overhead: the JIT binds the arguments, computes the specialisation key and looks up
its cache on each call, which on small weights costs more host time than the kernel takes on the
GPU. The arguments are the ones nf4.dequant.launch prepares (recorded, not launched, on each call, so
this file does not depend on the kernel's signature); compare host_us with v51_cached_launch.
"""

from __future__ import annotations

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel


@register("v50_jit_launch", parent=None,
          change="the production kernel (nf4/dequant/kernel.py), launched through the Triton JIT on every call",
          kernel=nf4_dequantize_kernel, host_timing=True)
def run(packed, quant_state, out, *, ftz):
    with common.recording() as calls:
        common.launch_production(packed, quant_state, out, ftz)
    ((kernel, grid, args, options),) = calls
    common.launch(kernel, grid, *args, jit=True, **options)
    return out
