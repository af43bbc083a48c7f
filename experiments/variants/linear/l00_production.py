"""l00: the fused linear's tuned table: the config nf4.linear picks for this GPU and M (config=None).

Teaches nothing new; it is the row every other linear variant is compared with. On an H100 (and a
GPU without rows of its own) the table takes the tensor-core GEMVs up to M = 16, the word tl.dot kernel
up to 256 (or nf4.dequantize + cuBLAS, by the weight's shape), and nf4.dequantize + cuBLAS above; in
Triton's interpreter the word GEMV up to 4 and the word tl.dot kernel above (nf4/linear/tuned.json).
Launched by the product's own launches into the runner's buffer (variants/linear/_common.py); the
offline sm_75 compile records what a T4 would launch at M = 1 (the codebook-0 GEMV, the fallback of
the kernels that need sm_80).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear.gemv import nf4_gemv_kernel

from ._common import launcher

register("l00_production", parent=None, change="nf4.linear's tuned table (config=None): GEMVs, the word tl.dot "
         "kernel or nf4.dequantize + cuBLAS by M", kernel=nf4_gemv_kernel, module=__name__)(launcher(None))
