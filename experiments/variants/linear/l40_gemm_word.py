"""l40-l42: the word tl.dot kernel (nf4_gemm_word_kernel): the word GEMV's decode feeding `tl.dot`.

Teaches what the codebook strategy is worth inside the tl.dot kernel. l11 decodes its W tile by
gathering each weight's level from a 16-entry table (codebook 0) and multiplying by the absmax per
weight; here each thread owns one row of the tile and decodes that row's 64-weight step (one absmax
block) as 8 words of packed bytes: the block's 16 products NF4[c] * absmax rounded to x's dtype are
built once (cvt.rn.{bf16,f16}x2.f32, prmt: `nf4.device.product_table`) and each byte's two weights
are prmt lookups in those registers (`table_pairs`), laid out in column order in the thread's
registers (`word_tile`) and handed to tl.dot as its first operand (swapped: out^T = W @ x^T).
- l40: the table's WORD_GEMM128 tile (128 rows of W by 128 rows of x, 4 warps, 3 stages) in one
  launch (no split-K);
- l41: split-K nearest 2 programs per multiprocessor, the partial sums added in order by a second
  kernel (the table's WORD_GEMM128 as it runs for M = 65-128);
- l42: l40 unswapped (x as the first operand): Triton 3.9's offline sm_90 build stages the decoded
  tile for wgmma's second operand with 2-byte shared-memory stores (64 STS per thread and step against
  8 swapped), so the tuning grid swept the swapped form only. The GPU machines ran Triton 3.6, where an
  earlier layout of this kernel (two threads per row, at 3075ef1: results/linear/tuning/
  sweep_word_h100_3075ef1.json) measured 4-11 % faster unswapped than swapped at M = 128-1024 on
  4096x4096 (128x128 tile, 2 stages); at this layout unswapped took 0.96-1.07x the swapped tile's
  time at M = 64-512 on 14336x4096, 4096x14336 and 4096x4096 (H100 at cd93f7f, results/linear/tuning/
  sweep_word_plain_h100.json), so the table stays swapped.

Where nf4.linear would not launch nf4_gemm_word_kernel (`nf4.linear.launch.runnable`: W dtype !=
x dtype, packed bytes not 4-byte aligned, blocksize under 32, a GPU before sm_80 or the meta device),
`_common.launch(expect=...)` raises instead of checking or timing the fallback under their name. The
interpreter runs them (the decode by `_word_pairs`, the same values); no sm_75 build (needs sm_80:
cvt.rn.*x2).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear import tuned as linear_tuned
from nf4.linear.gemm_word import nf4_gemm_word_kernel

from ._common import launcher

WORD = linear_tuned.WORD_GEMM128
MIN_ARCH = 80
ARCH_REASON = ("nf4_gemm_word_kernel packs its product table with cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, which "
               "ptxas refuses for sm_75 ('requires .target sm_80 or higher'); a T4 runs nf4.dequantize + cuBLAS "
               "instead")
NOTE = "no sm_75 build (needs sm_80: cvt.rn.*x2)"
# id, parent, the config, the one-line change.
FAMILY = [
    ("l40_gemm_word", "l11_gemm_swap", WORD.with_(split_k=1),
     "codebook 3 in the tl.dot kernel: a thread per row decodes its 64-weight step through the block's product "
     "table and prmt (nf4_gemm_word_kernel; WORD_GEMM128's tile: 128x128, 4 warps, 3 stages), one launch"),
    ("l41_gemm_word_split", "l40_gemm_word", WORD,
     "split-K nearest 2 programs per SM (the partial sums added in order by a second kernel): WORD_GEMM128"),
    ("l42_gemm_word_plain", "l40_gemm_word", WORD.with_(split_k=1, swap=False),
     "not swapped: x as tl.dot's first operand, the decoded tile staged for wgmma's second"),
]

for _id, _parent, _config, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=nf4_gemm_word_kernel, min_arch=MIN_ARCH,
             arch_reason=ARCH_REASON, note=NOTE, module=__name__)(launcher(_config, expect=nf4_gemm_word_kernel))
