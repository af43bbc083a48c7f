"""l00: the fused linear's tuned table: the config nf4.linear picks for this GPU and M (config=None).

Teaches nothing new; it is the row every other linear variant is compared with. On an H100 (and a
GPU without rows of its own) the table takes the split-K GEMV up to M = 4, the swapped 16x64 tl.dot
tile up to 32, and nf4.dequantize + cuBLAS above; in Triton's interpreter the GEMV up to 4 and the
128x128 tl.dot tile above (nf4/linear/tuned.json). Launched by the product's own launches into the
runner's buffer (variants/linear/_common.py); the offline sm_75 compile records what a T4 would
launch at M = 1 (the GEMV).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear.gemv import nf4_gemv_kernel

from ._common import launcher

register("l00_production", parent=None, change="nf4.linear's tuned table (config=None): GEMV, swapped tl.dot or "
         "nf4.dequantize + cuBLAS by M", kernel=nf4_gemv_kernel, module=__name__)(launcher(None))
