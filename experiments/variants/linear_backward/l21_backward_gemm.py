"""l21-l22: the input gradient dY @ W (W frozen, as in QLoRA): the fused tl.dot kernel, and the tuned table.

Teaches what the backward's operand costs: the same packed bytes read transposed (a program owns
K / 2 bytes of every row and walks down the rows), the decoded tile as tl.dot's second operand
untransposed. l21 is l10's tile (GEMM of experiments/variants/linear/_gemm_kernel.py) with TRANS (128
rows of dY x one absmax block of W per program): the fused backward nf4.linear no longer has, kept
here with its kernel (nf4_gemm_kernel). l22 is the tuned table's backward row: nf4.dequantize + cuBLAS
on every GPU and in the interpreter (it measured 2-5x faster than every fused tile on an H100).
Checked on the operand like the forward: dY made of identity rows picking rows of W. On sm_75
(offline) l21's tl.dot is float32 FMAs and spills (about 2.6 KB per thread), like the forward's
128x128 tile.
"""

from __future__ import annotations

from experiments.registry import register
from experiments.variants.linear._common import launcher
from experiments.variants.linear._gemm_kernel import GEMM, nf4_gemm_kernel
from experiments.variants.linear._gemm_kernel import launcher as gemm_launcher
from nf4.dequant.kernel import nf4_dequantize_kernel

register("l21_backward_gemm", parent="l10_gemm", change="dY @ W through the same tl.dot kernel (TRANS: W read "
         "transposed, the decoded tile untransposed as the second operand)", kernel=nf4_gemm_kernel,
         spills_expected=True, module=__name__)(gemm_launcher(GEMM, trans=True))
register("l22_backward_production", parent="l00_production", change="dY @ W by the tuned table's backward row "
         "(nf4.dequantize + cuBLAS)", kernel=nf4_dequantize_kernel, module=__name__)(launcher(None, trans=True))
