"""v31: a fixed grid of programs striding over the tiles (a "persistent" kernel), same layout.

Teaches whether fewer, longer-lived programs pay. Each program walks its tiles in a loop, and the
loop's load -> gather -> store chain is not overlapped with the next tile's load, so the memory
system sees less in flight than with one short program per tile, where the GPU's block scheduler
keeps every multiprocessor full (on the H200 of results/probe_h200.json the fixed grid lost on the
two larger challenge weights and won slightly on the smallest). The production kernel's PERSIST path through
nf4.dequant.launch (`programs_per_sm` programs per multiprocessor; three programs in the interpreter).
"""

from __future__ import annotations

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel

PROGRAMS_PER_SM = (8, 16, 32)


def _launcher(per_sm):
    def run(packed, quant_state, out, *, ftz):
        return common.launch_production(packed, quant_state, out, ftz, programs_per_sm=per_sm)

    return run


for _per_sm in PROGRAMS_PER_SM:
    register(f"v31_persist{_per_sm:02d}", parent="v51_cached_launch",
             change=f"fixed grid of {_per_sm} programs per SM striding over the 512-byte tiles",
             kernel=nf4_dequantize_kernel, module=__name__)(_launcher(_per_sm))
