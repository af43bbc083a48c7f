"""l20: nf4.dequantize into a scratch weight, then cuBLAS: the tuned table's path above M = 32 on an H100.

Teaches the price of not fusing: the weight is written in full (2 bytes a weight) and read back by
a dense matmul, against the fused kernels' half a byte a weight. It wins where the matmul is bound
by flops and cuBLAS's tiles beat the fused tl.dot tile. In the interpreter both halves run on the
CPU (nf4.dequantize in Triton's interpreter, the matmul in PyTorch); the operand is checked the same
way. Its offline sm_75 build is nf4.dequantize's kernel (cuBLAS is not a Triton kernel).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.linear import tuned as linear_tuned

from ._common import launcher

register("l20_dequant_cublas", parent="l00_production", change="nf4.dequantize into a scratch weight, then cuBLAS "
         "(kernel \"dequant\") at every M", kernel=nf4_dequantize_kernel, module=__name__)(
    launcher(linear_tuned.DEQUANT))
