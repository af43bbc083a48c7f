"""v30: work per program x num_warps sweep of the production layout, generated from one grid.

Teaches occupancy versus work per thread: packed bytes per thread = tile_bytes / (32 * num_warps).
Too few and the tile is smaller than the thread count (threads hold replicated work and Triton
may relayout through shared memory); too many and registers run out. The production kernel
(whatever nf4/dequant/kernel.py is) through nf4.dequant.launch; `spills_expected` marks the points measured
to spill in the offline sm_75 compile.
"""

from __future__ import annotations

import itertools

from experiments import common
from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel

TILE_BYTES = (512, 1024, 2048, 4096, 8192)
NUM_WARPS = (1, 2, 4, 8)
SPILLS_AT_BYTES_PER_THREAD = 128  # sm_75 offline compile, nf4/dequant/kernel.py as of writing: 128 B/thread spills


def _launcher(tile_bytes, num_warps):
    def run(packed, quant_state, out, *, ftz):
        return common.launch_production(packed, quant_state, out, ftz, tile_bytes=tile_bytes, num_warps=num_warps)

    return run


for _tile, _warps in itertools.product(TILE_BYTES, NUM_WARPS):
    _per_thread = _tile // (32 * _warps)
    register(f"v30_t{_tile:04d}_w{_warps}", parent="v51_cached_launch",
             change=f"tile_bytes={_tile}, num_warps={_warps} ({_per_thread} packed bytes per thread)",
             kernel=nf4_dequantize_kernel, spills_expected=_per_thread >= SPILLS_AT_BYTES_PER_THREAD,
             module=__name__)(_launcher(_tile, _warps))
