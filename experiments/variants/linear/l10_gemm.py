"""l10-l18: the tl.dot kernel (tensor cores) at every M, and one of its meta-parameters at a time.

Teaches where the tile's time goes. The kernel (nf4_gemm_kernel, `_gemm_kernel.py`) was nf4.linear's kernel
"gemm" until no path of the product reached it outside Triton's interpreter; l10 is the interpreter's tile for
M > 4 of that time (GEMM: 128x128 output, K step 64 = one absmax block, 8 warps, no software pipelining, 16-entry
table gather), with x as tl.dot's first operand and the decoded W tile (transposed) as the second. Each
member changes one thing:
- l11 swaps the operands (out^T = W @ x^T: the decoded tile is the first operand, x^T the second);
- l12 pipelines the K loop in 3 stages (on sm_80+ the pipeliner turns the codebook and x loads into
  cp.async copies through shared memory; sm_75 has no cp.async);
- l13 a 64x64 output tile; l14 the select-tree codebook; l15 the 256-entry pair table;
- l16 the table's former small-M tile (GEMM_SMALL below: swapped, 16x64, 4 warps) at every M;
- l17 GROUP = 1: programs walk the output tiles along N for one M tile at a time, instead of 8 M
  tiles in a row sharing each decoded W tile (L2 reuse of the packed bytes);
- l18 persistent: one program per multiprocessor loops over the output tiles (in l10's order).

The ablations asked for the linear, and what covers them:
- decode in registers vs through shared memory: the operand order (l11 against l10) is the closest
  config. The decoded tile is produced in the decode's register layout; whichever operand it
  becomes, the compiler converts it to the MMA operand layout, and which conversion goes through
  shared memory depends on the operand (on Hopper, wgmma reads its second operand from shared
  memory and may take its first from registers). The sm_75 compile facts (shared loads/stores,
  bar.sync, shared bytes) show what each order does on a T4; the kernels have no switch that
  forces the decoded tile to stay in registers or to be staged in shared memory explicitly.
- K-major vs N-major traversal: inside a program the K loop is always innermost (each program owns
  an output tile and walks K); the order of the programs over the output tiles is l17 (N-major,
  GROUP = 1) against l10 (grouped along M). Splitting K across programs is the GEMV's split-K
  (l04 against l01/l05); the tl.dot kernel has no split-K.
- persistent vs not: l18 (one program per multiprocessor, each taking output tiles pid, pid +
  programs, ... in l10's order; `GemmConfig.persistent`) against l10 (one program per tile).

On sm_75 (offline compile, Triton 3.9) `tl.dot` becomes float32 FMAs in fp16 and bf16 alike (no
mma.sync): the 128x128 tile then spills 10-11 KB per thread (those members declare spills_expected),
the 64x64 and 16x64 tiles do not; l12's stages change nothing there (no cp.async before sm_80).
"""

from __future__ import annotations

from experiments.registry import register

from ._gemm_kernel import GEMM, GemmConfig, launcher, nf4_gemm_kernel

# the table's former small-M tile (nf4.linear.config.GEMM_SMALL before nf4 dropped the presets no table row used)
GEMM_SMALL = GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1, swap=True, codebook=0)
# id, parent, the config (a change of GEMM, or another table row), the one-line change.
FAMILY = [
    ("l10_gemm", "l00_production", GEMM,
     "tl.dot at every M: 128x128 tile, K step 64, 8 warps, 1 stage, x as the first operand (not swapped)"),
    ("l11_gemm_swap", "l10_gemm", GEMM.with_(swap=True),
     "operands swapped: out^T = W @ x^T, the decoded W tile as tl.dot's first operand"),
    ("l12_gemm_stages3", "l10_gemm", GEMM.with_(num_stages=3),
     "K loop pipelined in 3 stages (cp.async copies of the gathers and x loads on sm_80+)"),
    ("l13_gemm_tile64", "l10_gemm", GEMM.with_(block_m=64, block_n=64), "64x64 output tile"),
    ("l14_gemm_select_tree", "l10_gemm", GEMM.with_(codebook=1), "NF4 levels by a select tree (codebook 1)"),
    ("l15_gemm_pair_table", "l10_gemm", GEMM.with_(codebook=2),
     "both levels of a byte by one 8-byte gather from a 256-entry pair table (codebook 2)"),
    ("l16_gemm_small", "l00_production", GEMM_SMALL,
     "the table's small-M tile at every M: swapped, 16x64, K step 64, 4 warps, 1 stage"),
    ("l17_gemm_group1", "l10_gemm", GEMM.with_(group=1),
     "program order N-major (GROUP 1) instead of 8 M tiles in a row per decoded W tile"),
    ("l18_gemm_persistent", "l10_gemm", GEMM.with_(persistent=1),
     "persistent: one program per multiprocessor looping over the output tiles in the same order"),
]

# Measured (sm_75 offline): the 128x128 float32 tile of FMAs spills there.
SPILLS_ON_SM75 = {"l10_gemm", "l11_gemm_swap", "l12_gemm_stages3", "l14_gemm_select_tree", "l15_gemm_pair_table",
                  "l17_gemm_group1", "l18_gemm_persistent"}

for _id, _parent, _config, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=nf4_gemm_kernel, spills_expected=_id in SPILLS_ON_SM75,
             module=__name__)(launcher(_config))
