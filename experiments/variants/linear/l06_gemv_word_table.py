"""l06-l08: the word GEMV (kernel "gemv_table": nf4_gemv_table_kernel): each block's 16 products in registers, prmt.

Teaches what the tuned table's small-M kernel (nf4.linear.tuned.GEMV_TABLE, H100 rows to M = 4) gains
over the codebook-0 GEMV it falls back to (l01), and two of its meta-parameters. Against l01 (a
16-entry table gather per nibble, then a float32 multiply by the absmax and a rounding per weight,
into a [BLOCK_M, rows, bytes] accumulator), the word GEMV reads W as 32-bit words and builds, once per
row and step, the block's 16 products NF4[c] * absmax already rounded to x's dtype (16 multiplies, 8
cvt.rn.{bf16,f16}x2.f32, 8 prmt: nf4.device.product_table); each packed byte then becomes its two
16-bit weights by prmt lookups in those registers (nf4.device.table_pairs), and a [rows, 4] float32
accumulator per row of x takes the products (at most 4 rows of x: no BLOCK_M dimension, no spills).
Of the codebook strategies asked for the linear, this is the prmt one (l01: L1 table gather; l02:
select tree; l03: 256-entry pair table, one 8-byte gather per byte).
- l06: the table's GEMV_TABLE (64 rows per program, 2 warps, one step = 32 bytes = two 16-byte tiles,
  split-K for 16 programs per multiprocessor), on slices of at most 4 rows of x like l01;
- l07: one 16-byte tile per step: the product table is built per 16 bytes, twice per 64-weight block;
- l08: 128 rows per program (the tuning sweeps' other shape; half the programs, so twice the split-K).

Every member must launch nf4_gemv_table_kernel: `_common.launch(expect=...)` refuses (RuntimeError) a
product where nf4.linear would take the codebook-0 GEMV instead (M > 4, W dtype != x dtype,
misaligned packed bytes, a GPU before sm_80). The PTX needs sm_80 (cvt.rn.{bf16,f16}x2.f32), so the
offline sm_75 compile records these ids as not built (`min_arch`), never the fallback under their name.
Triton's interpreter has no PTX: it checks the kernel with its pure-Triton decode (`_word_pairs`), the
GPU run checks the prmt decode.
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear import tuned as linear_tuned
from nf4.linear.gemv_table import nf4_gemv_table_kernel

from ._common import launcher
from .l01_gemv import GEMV_ROWS

TABLE = linear_tuned.GEMV_TABLE
MIN_ARCH = 80
ARCH_REASON = ("nf4_gemv_table_kernel's product table packs with cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, which ptxas "
               "refuses for sm_75 ('requires .target sm_80 or higher'); a T4 runs l01's codebook-0 GEMV instead")
NOTE = ("interpreter: the word GEMV's pure-Triton decode (_word_pairs) is checked, not the PTX product table and "
        "prmt lookups (GPU run); no sm_75 build (needs sm_80)")
# id, parent, the LinearConfig fields changed versus GEMV_TABLE, the one-line change.
FAMILY = [
    ("l06_gemv_word_table", "l01_gemv", {},
     f"codebook 3: the table's word GEMV (nf4_gemv_table_kernel: W as 32-bit words, each absmax block's 16 products "
     f"in registers, prmt lookups; 64 rows x 2 warps), on slices of {GEMV_ROWS} rows of x"),
    ("l07_gemv_word_table_tile16", "l06_gemv_word_table", {"step_bytes": 16},
     "one 16-byte tile per step: the block's product table built per 16 bytes (twice per 64-weight block)"),
    ("l08_gemv_word_table_rows128", "l06_gemv_word_table", {"block_r": 128},
     "128 rows of W per program (half the programs, twice the split-K)"),
]

for _id, _parent, _changed, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=nf4_gemv_table_kernel, min_arch=MIN_ARCH,
             arch_reason=ARCH_REASON, note=NOTE, module=__name__)(
        launcher(TABLE.with_(**_changed), max_rows=GEMV_ROWS, expect=nf4_gemv_table_kernel))
