"""l30-l36: the word GEMV with its products on tensor cores (nf4_gemv_mma_kernel: PTX mma.sync m16n8k16), GPU only.

Teaches what moving the word GEMV's multiply-adds from float32 FMAs (l06: a [rows, 4] float32
accumulator per row of x, at most 4 rows) onto tensor cores is worth, and three of its
meta-parameters. The decode is l06's (W as 32-bit words, each absmax block's 16 products
NF4[c] * absmax rounded to x's dtype built once per row and step with cvt.rn.{bf16,f16}x2.f32 and
prmt, each byte's two weights by prmt lookups in those registers); the decoded pairs are then the A
operand of `mma.sync.aligned.m16n8k16` (16 rows of W per warp: lane 4g + t decodes rows g and g + 8),
x's matching pairs the B operand (its 8 columns are 8 rows of x), with float32 accumulation. So one
launch serves up to 8 rows of x at the cost of 1 (the unused columns of B are wasted work, not more
instructions), and a lane keeps 8 float32 accumulators whatever M is. One step covers 4 lanes x
step_bytes bytes of each row (`nf4.linear.launch.gemv_step`): split-K is in whole steps.
- l30: GEMV_MMA, once the table's row (64 rows = 4 warps x 16, 32-byte lanes: one 64-weight absmax block per
  lane and step, split-K for 12 programs per multiprocessor; H100 rows to M = 4; defined here since nf4 dropped
  the presets no table row uses), on slices of at most 8 rows of x;
- l31: 16-byte lanes (half a block per lane and step: the product table built twice per block, a
  step of 64 bytes per row, half the loads in flight per lane);
- l32: 2 warps, 32 rows per program (twice the programs along N, so half the auto split-K);
- l33: GEMV_MMA8 (the table's M = 5-8 row until the tiles of 9-32 rows were swept): l31 with split-K for
  7 programs per multiprocessor;
- l34: one launch: the 4 warps of a program share 16 rows and split the row's steps among them
  (`LinearConfig.warps_k`), their sums added in the program through shared memory, with no split-K and
  so no second kernel adding partial sums (4x the programs along N of l30; what a single launch costs
  or saves in device time, beside the host time of the second launch and its float32 buffer);
- l35: l34 with 8 warps per program and 8-way K splits in it (twice the warps per row): the kernel of the
  table's GEMV_MMA_WK (rows of x up to 2; its programs_per_sm, which a single launch does not
  use, aside);
- l36: l35 with 16-byte lanes: the table's GEMV_MMA_WK16 (3-8 rows of x).

GPU only: Triton's interpreter has no PTX (nf4.linear's `launch_config` falls back to the word GEMV
there), so the interpreter run lists these ids as skipped. Where nf4.linear would not launch
nf4_gemv_mma_kernel (`nf4.linear.launch.runnable`: a GPU before sm_80, M > 32, W dtype != x dtype, x not
contiguous, x or the packed bytes not 16-byte aligned, K / 2 not a multiple of 4 * min(step_bytes,
blocksize / 2, 32)), `_common.launch(expect=...)` raises instead of checking or timing the fallback
under their name. The offline sm_75 compile records them as not built (`min_arch` 80).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear import tuned as linear_tuned
from nf4.linear.config import LinearConfig
from nf4.linear.gemv_mma import nf4_gemv_mma_kernel

from ._common import launcher

# nf4.linear.config.GEMV_MMA and GEMV_MMA8 before nf4 dropped the presets no table row used
MMA = LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, step_bytes=32, programs_per_sm=12)
MMA8 = LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, step_bytes=16, programs_per_sm=7)
MMA_ROWS = 8  # the rows of x one mma.sync's B operand holds (one tile; nf4.linear takes up to 4 tiles, M <= 32)
MIN_ARCH = 80
ARCH_REASON = ("nf4_gemv_mma_kernel issues mma.sync.aligned.m16n8k16 with f16/bf16 operands and packs its product "
               "table with cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32; ptxas refuses both for sm_75 ('requires .target "
               "sm_80 or higher'); a T4 runs l01's codebook-0 GEMV instead")
NOTE = ("GPU only: the interpreter has no PTX (mma.sync, prmt, cvt.rn.*x2), so it is not run there; no sm_75 build "
        "(needs sm_80)")
# id, parent, the config, the one-line change.
FAMILY = [
    ("l30_gemv_mma", "l06_gemv_word_table", MMA,
     f"products on tensor cores via mma.sync m16n8k16 instead of float32 FMAs (nf4_gemv_mma_kernel, GEMV_MMA: 4 "
     f"warps x 16 rows, 32-byte lanes, split-K for 12 programs per SM), on slices of {MMA_ROWS} rows of x"),
    ("l31_gemv_mma_tile16", "l30_gemv_mma", MMA.with_(step_bytes=16),
     "16-byte lanes: half an absmax block per lane and step (the product table built twice per block)"),
    ("l32_gemv_mma_warps2", "l30_gemv_mma", MMA.with_(num_warps=2, block_r=32),
     "2 warps, 32 rows of W per program (twice the programs, half the split-K)"),
    ("l33_gemv_mma8", "l31_gemv_mma_tile16", MMA8,
     "split-K for 7 programs per SM instead of 12 (GEMV_MMA8)"),
    ("l34_gemv_mma_warps_k4", "l30_gemv_mma", MMA.with_(warps_k=4, block_r=16, split_k=1),
     "one launch: the 4 warps share 16 rows and split K in the program (warps_k 4), no split-K sum kernel"),
    ("l35_gemv_mma_warps_k8", "l34_gemv_mma_warps_k4", MMA.with_(num_warps=8, warps_k=8, block_r=16, split_k=1),
     "8 warps per program, each row's K split 8 ways in it (the kernel of GEMV_MMA_WK)"),
    ("l36_gemv_mma_warps_k8_tile16", "l35_gemv_mma_warps_k8", linear_tuned.GEMV_MMA_WK16,
     "16-byte lanes (GEMV_MMA_WK16)"),
]

for _id, _parent, _config, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=nf4_gemv_mma_kernel, gpu_only=True, min_arch=MIN_ARCH,
             arch_reason=ARCH_REASON, note=NOTE, module=__name__)(
        launcher(_config, max_rows=MMA_ROWS, expect=nf4_gemv_mma_kernel))
