"""The fused linear's meta-parameters as a frozen value, and the tuned table that picks them per M.

`nf4.linear` takes a `LinearConfig` or reads the table: rows (largest M, config) per GPU (a
substring of `torch.cuda.get_device_name`) and direction ("forward": x @ W^T, "backward": dY @ W).
A config names its path:
- "gemv": nf4_gemv_kernel (FMAs, no tensor cores), for a few rows of x;
- "gemm": nf4_gemm_kernel (`tl.dot`), decoding each W tile once per BLOCK_M rows of x;
- "dequant": `nf4.dequantize` into a scratch weight, then `torch.nn.functional.linear` (forward only:
  where a dense cuBLAS matmul on the dequantized weight measured faster than any fused tile).
The rows come from measurements (results/linear/tuning_*.json); GPUs without rows use the H100's;
Triton's interpreter takes the fused kernels at every M (INTERPRETER), so CPU runs exercise them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PATHS = ("gemv", "gemm", "dequant")
INTERPRET_PROGRAMS = 3  # programs of a persistent gemm in Triton's interpreter (several tiles each on small cases)


def _pow2(v) -> bool:
    return type(v) is int and v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class LinearConfig:
    """Meta-parameters of nf4.linear.kernel's kernels and which one runs."""

    path: str = "gemv"
    # gemv: rows of W per program (forward) or per step (backward), and bytes of a row per step
    # (forward) or per program (backward), capped at half the blocksize (one absmax per row and step)
    block_r: int = 32
    step_bytes: int = 32
    # gemv forward: programs along K (split-K; partial sums in float32, summed in order by a second
    # kernel); 0 picks enough for programs_per_sm programs per multiprocessor (1 in the interpreter)
    split_k: int = 0
    programs_per_sm: int = 8
    # gemm: output tile, K step (weights; capped at the blocksize), programs along M that share a W
    # tile, pipeline stages
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group: int = 8
    swap: bool = False  # forward: out^T = W @ x^T, the decoded tile as tl.dot's first operand (small M)
    # gemm: programs per multiprocessor that loop over the output tiles (persistent); 0: one program per tile.
    # Triton's interpreter runs INTERPRET_PROGRAMS programs instead.
    persistent: int = 0
    num_stages: int = 3
    num_warps: int = 4
    # 0: 16-entry table gather, 1: select tree, 2: 256-entry table of level pairs, 3 (GEMV forward): each
    # absmax block's 16 products in registers, looked up with prmt (nf4_gemv_table_kernel; where it cannot
    # run, and in the other kernels, codebook 3 means 0)
    codebook: int = 2
    # codebook 3's GEMV with its products on tensor cores (nf4_gemv_mma_kernel: PTX mma.sync, M <= 32); a warp
    # (a group of warps_k warps, below) owns 16 rows of W, so block_r must be 16 * num_warps / warps_k;
    # step_bytes (16 or 32) is what one lane decodes of each of its two rows per step. Where it cannot run it
    # falls back like codebook 3 (launch_config).
    mma: bool = False
    # the tensor-core GEMV: warps of a program that share each 16-row group and split the program's K range
    # (their sums added in the program), so that fewer programs along K (split_k) are needed, down to a single
    # launch; block_r must then be 16 * num_warps / warps_k
    warps_k: int = 1
    evict: str = "evict_first"  # eviction policy of the packed bytes (read once per x tile)
    bf16_bits: bool = False  # round to bfloat16 with integer ops on the GPU too (the interpreter always does)
    plan: bool = True  # remember validated calls (the cheap repeat call)
    # registers per thread the compiler may use (PTX .maxnreg), None: its own choice. Fewer registers let more
    # programs share a multiprocessor (64 for programs of 256 threads: 4 per multiprocessor, not 3 at 80)
    maxnreg: int | None = None

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"LinearConfig.path must be one of {PATHS}, got {self.path!r}")
        for name in ("block_r", "step_bytes", "block_m", "block_n", "block_k", "group"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"LinearConfig.{name} must be a power of two, got {getattr(self, name)}")
        for name in ("split_k", "programs_per_sm", "persistent", "num_stages", "num_warps", "codebook", "warps_k"):
            if type(getattr(self, name)) is not int:
                raise TypeError(f"LinearConfig.{name} must be an int, got {getattr(self, name)!r}")
        for name in ("swap", "bf16_bits", "plan", "mma"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LinearConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.persistent < 0:
            raise ValueError(f"LinearConfig.persistent must be >= 0 (programs per multiprocessor), got "
                             f"{self.persistent}")
        if self.split_k < 0 or self.programs_per_sm < 1:
            raise ValueError(f"LinearConfig: split_k must be >= 0 and programs_per_sm >= 1, got {self.split_k}, "
                             f"{self.programs_per_sm}")
        if self.step_bytes < 16:
            raise ValueError(f"LinearConfig.step_bytes must be at least 16, got {self.step_bytes}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32:
            raise ValueError("LinearConfig: tl.dot needs block_m >= 16, block_n >= 16 and block_k >= 32, got "
                             f"{self.block_m}, {self.block_n}, {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearConfig.num_warps must be a power of two up to 16, got {self.num_warps}")
        if self.maxnreg is not None and type(self.maxnreg) is not int:
            raise TypeError(f"LinearConfig.maxnreg must be None or an int, got {self.maxnreg!r}")
        if self.maxnreg is not None and not 16 <= self.maxnreg <= 255:
            raise ValueError(f"LinearConfig.maxnreg must be in 16..255 (registers per thread), got {self.maxnreg}")
        if self.codebook not in (0, 1, 2, 3):
            raise ValueError(f"LinearConfig.codebook must be 0, 1, 2 or 3, got {self.codebook}")
        if self.mma and (self.path != "gemv" or self.codebook != 3):
            raise ValueError(f"LinearConfig.mma needs path='gemv' and codebook=3, got {self.path!r}, {self.codebook}")
        if not _pow2(self.warps_k) or self.num_warps % self.warps_k:
            raise ValueError(f"LinearConfig.warps_k must be a power of two dividing num_warps = {self.num_warps}, "
                             f"got {self.warps_k}")
        if self.warps_k > 1 and not self.mma:
            raise ValueError(f"LinearConfig.warps_k > 1 needs mma=True (the tensor-core GEMV), got {self.warps_k}")
        if self.mma and self.block_r != 16 * self.num_warps // self.warps_k:
            raise ValueError(f"LinearConfig.block_r must be 16 * num_warps / warps_k = "
                             f"{16 * self.num_warps // self.warps_k} with mma=True (a group of warps_k warps owns "
                             f"16 rows), got {self.block_r}")

    def with_(self, **changes) -> LinearConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)


# Measured on an H100 (results/linear/bench_h100.json, and the tuning sweeps in results/linear/tuning/;
# bf16, 14336x4096, 4096x14336, 4096x4096): the split-K word GEMV (GEMV_TABLE) up to 4 rows of x,
# nf4.dequantize + cuBLAS above. The swapped tl.dot tile (GEMM_SMALL) beat nf4.dequantize + cuBLAS
# only on the tall 14336x4096 weight at M = 8-16 and lost by 2.8-3x on the other two, so the table
# (keyed by M alone) does not take it (results/linear/tuning/bench_8d9bb27_h100.json). The backward's
# fused tiles took 2-4x the time of a dequantize plus cuBLAS at M = 64-1024 (tuning/sweep5_h100.json:
# backward rows against the dense matmul rows, plus nf4.dequantize's own time), so the table takes the
# latter; the fused
# backward stays available as LinearConfig(path="gemm") and is tested operand-exact.
GEMV = LinearConfig(path="gemv", block_r=32, num_warps=2, codebook=0, programs_per_sm=16)
# The word GEMV with a product table per absmax block (codebook 3; M <= 4, W dtype == x dtype): H100 sweeps at
# fa8a542, 2c50c38 and 3968eae (results/linear/tuning/sweep_table*_h100.json, sweep_small_h100.json): 14336x4096
# bf16 M=1 32.0-33.8 us against 43.9-44.2 for GEMV above; block_r 64 is within 5 % of the best shape on the
# large weights and the best on 4096x4096 (16.6 us against 20.3 for block_r 128).
GEMV_TABLE = LinearConfig(path="gemv", block_r=64, num_warps=2, codebook=3, programs_per_sm=16)
# The word GEMV on tensor cores (mma.sync m16n8k16): H100 sweep (results/linear/tuning/sweep_mma_h100.json, bf16,
# 14336x4096 and 4096x14336): 23.5-24.4 us at M = 1-4 with 4 warps, 32-byte lanes and 12 programs per SM, against
# 31.2-31.3 at M = 1 and 45.9-50.7 at M = 4 for GEMV_TABLE in the same run; at M = 8 16-byte lanes with 7 programs
# per SM measured 25.7-26.1 us against 28.2-28.4.
GEMV_MMA = LinearConfig(path="gemv", codebook=3, mma=True, block_r=64, num_warps=4, step_bytes=32, programs_per_sm=12)
GEMV_MMA8 = LinearConfig(path="gemv", codebook=3, mma=True, block_r=64, num_warps=4, step_bytes=16, programs_per_sm=7)
# Two and four 8-row tiles of x (results/linear/tuning/sweep_mma32_h100.json, geometric mean over the three weights):
# at M = 9-16, 8 warps, 16-byte lanes and 2 programs per SM (M = 16: 34.0 / 30.1 / 11.9 us on 14336x4096 /
# 4096x14336 / 4096x4096, against 43.4 / 44.8 / 16.4 for dense cuBLAS in bench_h100.json); at M = 17-32, 4 warps,
# 16-byte lanes, 3 programs per SM (M = 32: 54.5 / 43.3 / 17.2 us: slower than dense cuBLAS on the first, about
# half of nf4.dequantize + cuBLAS, which the table took there before). Where they cannot run: nf4.dequantize + cuBLAS.
GEMV_MMA16 = LinearConfig(path="gemv", codebook=3, mma=True, block_r=128, num_warps=8, step_bytes=16,
                          programs_per_sm=2)
GEMV_MMA32 = LinearConfig(path="gemv", codebook=3, mma=True, block_r=64, num_warps=4, step_bytes=16,
                          programs_per_sm=3)
# The tensor-core GEMV whose 8 warps share each 16-row group and split K among themselves (warps_k = 8), in a single
# launch (split_k = 1: no partial sums, no second kernel): tuning sweeps at 7dbc63e on both GPUs
# (results/linear/tuning/sweep_wk_{h100,h200}.json, bf16, 14336x4096, 4096x14336, 4096x4096; CUDA-graph device time,
# every row operand-exact). With 32-byte lanes, geometric mean over the three weights against GEMV_MMA: 0.962 (H100)
# and 0.958 (H200) at M = 1, 0.951 at M = 2 (H200); per weight at M = 1, 9.4 / 22.5 / 24.9 us on the H100 against
# 10.5 / 23.5 / 24.1 (the tall 14336x4096 weight 3 % slower). With 16-byte lanes at M = 3-8: 0.955 (H200, M = 4)
# and 0.923 / 0.933 (H100 / H200, M = 8) against GEMV_MMA16, which the table took at M = 5-16 before; at M = 16 it
# measured 1.07-1.08x GEMV_MMA16, so that row stays. The single launch also drops the host's second launch.
# The bench at dea3212 (results/linear/bench_{h100,h200}.json, against the earlier rows' bench_*.json in git history,
# same GPU kinds, other runs): M = 1 host time 1.02-1.19x (H100) and 0.97-1.15x (H200) an empty JIT launch, from
# 1.52-1.71x. Device time: better or within 0.3 us on the three swept weights; on 2048x8192 better at M = 1-4 and
# 0.5-0.9 us slower at M = 8; 0.6-1.1 us slower on 1024x4096 at M <= 8 (64 programs of 16 rows for 132
# multiprocessors, where the split-K rows filled the GPU) and 0.9-1.4 us slower on 8192x2048 at M = 1-2 (K = 2048:
# one 128-byte step per warp). The sweeps at 125705e over those weights (`for_shape`) gave 8192x2048 at M <= 4 a
# program of 4 warps instead (GEMV_MMA_WK4); on 1024x4096 no single launch beat these rows, and split-K cost host time.
GEMV_MMA_WK = LinearConfig(path="gemv", codebook=3, mma=True, block_r=16, num_warps=8, warps_k=8, step_bytes=32,
                           split_k=1)
GEMV_MMA_WK16 = GEMV_MMA_WK.with_(step_bytes=16)
# 4 warps splitting K 4 ways (l34's kernel): on rows too short for GEMV_MMA_WK (`for_shape`).
GEMV_MMA_WK4 = GEMV_MMA_WK.with_(num_warps=4, warps_k=4)
# 16 warps in 8 pairs, each pair splitting its 16 rows' K 2 ways: 128 rows per program, so that 14336 rows make 112
# programs, one per multiprocessor, in a single launch (`for_shape`). Sweeps at a0a6bb3 (results/linear/tuning/
# sweep_wkreg_{h100,h200}.json: the single-launch grid of warps x warps_k x step bytes, and the same at 64 registers
# per thread; bf16, six weights, M = 1, 4, 8, every row operand-exact): on 14336x4096 the fastest at M = 1 and 4 on both
# GPUs, 23.6 / 24.3 us on the H100 and 22.9 / 23.7 on the H200, against the table's GEMV_MMA_WK at M = 1 (24.3 / 24.3)
# and GEMV_MMA_WK16 at M = 4 (25.4 / 24.8); 1.4-3.9x slower than the table's rows on the five other weights (fewer
# programs than multiprocessors), and slower than GEMV_MMA_WK16 at M = 8. The 64-register grid was never the fastest
# at M = 1 (1-8 % behind the best unrestricted config on every weight, both GPUs): occupancy is not what limits it.
GEMV_MMA_WK2 = GEMV_MMA_WK.with_(num_warps=16, warps_k=2, block_r=128)
DEQUANT = LinearConfig(path="dequant")
# The word tl.dot kernel (nf4_gemm_word_kernel: the word GEMV's prmt decode, one row's 64-weight step per thread,
# into tl.dot's first operand; wgmma on Hopper), split-K nearest 2 programs per multiprocessor: sweeps at 6215746
# (H100) and 5cde365 (H200) over 14336x4096, 4096x14336, 4096x4096, 8192x2048, 2048x8192 and 1024x4096 at
# M = 32-256 (results/linear/tuning/sweep_word_{h100,h200}.json, bf16, every row operand-exact). Against the rows
# it replaces (results/linear/bench_{h100,h200}.json at c820221), on the H100: 14336x4096 43.9 / 53.3 / 66.5 us at
# M = 32 / 64 / 128 against 54.7 / 99.6 / 101.1 (GEMV_MMA32, then nf4.dequantize + cuBLAS); 4096x14336 39.1 /
# 44.4 / 57.1 against 43.9 / 102.6 / 108.1. At M = 256 nf4.dequantize + cuBLAS stays (the word kernel decodes W
# again per 128 rows of x: 105-134 us against 106-114 on the H100, 100-104 against 85-90 on the H200). Where
# it cannot run: nf4.dequantize + cuBLAS.
WORD_GEMM32 = LinearConfig(path="gemm", codebook=3, block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3,
                           swap=True, split_k=0, programs_per_sm=2)
WORD_GEMM64 = WORD_GEMM32.with_(block_m=64)
WORD_GEMM128 = WORD_GEMM32.with_(block_m=128)
# 256 rows of x per W tile, so that M = 129-256 decodes W once, with 8 warps (two threads per row of the 128-row tile,
# the accumulator over two warpgroups) and one program per multiprocessor: sweeps at d016d52 (H100) and 67bd43e
# (H200) over 14336x4096, 4096x14336, 4096x4096 and 8192x2048 at M = 128-512 (results/linear/tuning/
# sweep_word256_{h100,h200}.json, bf16, every row operand-exact, nf4.dequantize + cuBLAS timed in the same run). At
# M = 256 on 4096x14336: 73.9 / 75.2 us against 113.4 / 89.6 for nf4.dequantize + cuBLAS (H100 / H200); on the
# rows of 4096 or fewer weights it lost or tied on both GPUs (14336x4096: 97.2 / 99.1 against 106.5 / 85.2; 4096x4096
# 32.0 / 32.0 against 31.8 / 26.9; 8192x2048 36.7 / 36.7 against 29.1 / 25.9), so `for_shape` keeps nf4.dequantize +
# cuBLAS on rows shorter than 8192. At M = 512 (two W decodes) nf4.dequantize + cuBLAS won on every swept weight.
# Those sweeps ran the kernel with every wgmma of its loop serialized by ptxas (experiments gemm-limit); with the
# loop said nonempty (1042431) the sweeps over 14336x4096, 4096x14336, 4096x4096, 8192x2048, 2048x8192 and 1024x4096
# at M = 256, 384, 512 and 1024 (results/linear/tuning/sweep_wordfix_{h100,h200}.json, bf16, every row
# operand-exact, nf4.dequantize + cuBLAS in the same run), alike on both GPUs: at M = 256 WORD_GEMM256 won on
# 14336x4096 (74.1 / 74.9 us against 106.6 / 84.7 on the H100 / H200), 4096x14336 (76.8 / 76.7 against
# 112.8 / 89.7) and 2048x8192 (30.1 / 30.3 against 35.6 / 34.0) and lost on the three weights of 2^24 weights or
# fewer with rows of 4096 or fewer; at M = 384-1024 nf4.dequantize + cuBLAS won on every weight but one (8192x2048
# at M = 512 on the H100, by 2 %), so the table keeps it past 256 rows.
WORD_GEMM256 = WORD_GEMM32.with_(block_m=256, num_warps=8, programs_per_sm=1)
# WORD_GEMM128's tile with 8 warps in one launch (no split-K, so no partial sums and no second kernel): the sweeps at
# 0f747f3 over the six weights at M = 32, 64 and 128 (results/linear/tuning/sweep_wordfix_small_{h100,h200}.json,
# bf16, every row operand-exact; the first sweeps of the word GEMM's rows since its loop was said nonempty, which
# made the 16-bit store of a single launch cheap): on 14336x4096 at M = 128 it took 59.7 / 59.8 us on the H100 /
# H200 against 67.6 / 66.1 for WORD_GEMM128 (split 2 there, then the sum kernel); on the other weights that
# WORD_GEMM128 takes at M = 128 it was not among the fastest three, and WORD_GEMM128 was within 4 % of the best on
# both GPUs, so `for_shape` takes it where WORD_GEMM256 takes the rows above (large weights with rows under 8192).
WORD_GEMM128_W8 = WORD_GEMM128.with_(num_warps=8, split_k=1)
# WORD_GEMM32 split 8 ways along K: in the same sweeps, on 14336x4096 at M = 32, 39.7 / 39.0 us (H100 / H200) against
# 44.3 / 44.3 for WORD_GEMM32 (its split nearest 2 programs per multiprocessor: 2 on that weight's 112 tiles); on
# 4096x14336 37.8 / 38.2 against 38.6 / 38.3; on the weights of 2^24 weights it was up to 10 % slower or a tie. At
# M = 64 a fixed split gained nothing on both GPUs. `for_shape` takes it where the two rows above are taken.
WORD_GEMM32_S8 = WORD_GEMM32.with_(split_k=8)
# What a tuned row runs where its kernel cannot (nf4.linear.api.launch_config, through `fallback`): the tensor-core
# GEMV (x or the packed bytes not 16-byte aligned, K / 2 not whole steps, W dtype != x dtype, no sm_80+ GPU) becomes
# the word GEMV up to M = 4 and nf4.dequantize + cuBLAS above (the table's choice there before it); the word GEMV
# (W dtype != x dtype, misaligned packed bytes, no sm_80+ GPU) the codebook-0 GEMV with its own shape. An entry is a
# config, or rows (largest M, config) where the row's M range spans both. Any other tensor-core config keeps its
# shape without mma, any other codebook-3 config its shape with codebook 0.
Rows = tuple[tuple[int | None, LinearConfig], ...]
FALLBACK: dict[LinearConfig, LinearConfig | Rows] = {
    GEMV_MMA: GEMV_TABLE, GEMV_TABLE: GEMV, GEMV_MMA8: GEMV, GEMV_MMA16: ((4, GEMV_TABLE), (None, DEQUANT)),
    GEMV_MMA32: DEQUANT, GEMV_MMA_WK: GEMV_TABLE, GEMV_MMA_WK16: ((4, GEMV_TABLE), (None, DEQUANT)),
    GEMV_MMA_WK4: GEMV_TABLE, GEMV_MMA_WK2: GEMV_TABLE, WORD_GEMM32: DEQUANT, WORD_GEMM64: DEQUANT,
    WORD_GEMM128: DEQUANT, WORD_GEMM128_W8: DEQUANT, WORD_GEMM32_S8: DEQUANT, WORD_GEMM256: DEQUANT}


def fallback(config: LinearConfig, m: int) -> LinearConfig | None:
    """The tuned fallback of `config` at M rows of x (FALLBACK), or None where it has none."""
    entry = FALLBACK.get(config)
    return pick(entry, m) if isinstance(entry, tuple) else entry


def pick(rows: Rows, m: int) -> LinearConfig:
    """The config of the first row whose largest M (None: any) takes m rows of x; the last row's past them all."""
    for limit, config in rows:
        if limit is None or m <= limit:
            return config
    return rows[-1][1]


GEMM_SMALL = LinearConfig(path="gemm", block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1, swap=True,
                          codebook=0)
GEMM = LinearConfig(path="gemm", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=1, codebook=0)

TUNED: dict[str, dict[str, Rows]] = {
    "H100": {
        "forward": ((2, GEMV_MMA_WK), (8, GEMV_MMA_WK16), (16, GEMV_MMA16), (32, WORD_GEMM32), (64, WORD_GEMM64),
                    (128, WORD_GEMM128), (256, WORD_GEMM256), (None, DEQUANT)),
        "backward": ((None, DEQUANT),),
    },
}
DEFAULT_GPU = "H100"  # whose rows apply to a GPU with none of its own
# Interpreter (CPU): the fused kernels at every M, so that CPU runs exercise them.
INTERPRETER: dict[str, Rows] = {"forward": ((4, GEMV), (None, GEMM)), "backward": ((None, GEMM),)}

# Rows of x from which nf4 (this table's path) measured faster than bitsandbytes 0.50.2's own choice
# for `gemm_4bit` (its fused kernel or its dequantize + F.linear fallback), per GPU; below, a patched
# bitsandbytes keeps its own kernel (nf4.integrations.bitsandbytes).
ROUTE_GEMM_4BIT_MIN_M: dict[str, int] = {"H100": 128}


# Rows of x up to which nf4.linear (this table's rows) measured faster than bitsandbytes 0.50.2's `matmul_4bit` (its
# own choice of fused kernel or fallback) on every bench weight, per GPU: at 852e210, results/linear/bench_{h100,
# h200}_852e210.json (bf16: 14336x4096, 4096x14336, 4096x4096, 8192x2048, 2048x8192, 1024x4096, M = 1-4096) and
# bench2_*_852e210.json (fp16, M = 1-1024): the smallest ratio per M was 1.07 / 1.14 (H100 / H200) at M = 1, 1.5-2.5
# at M = 2-128, 1.17 / 1.31 at M = 256-512 and 1.05 / 1.04 at M = 4096, the largest M measured; the runs at e4b0b72
# (bench_{h100,h200}.json, bench2_*) agree, down to a tie at M = 4096 on the H100 (4096x14336: 724.8 us against
# 726.8, the same dequantize + cuBLAS, whose matmul is nearly all of it). Past 128 rows both run a dequantize and
# cuBLAS (nf4.linear's DEQUANT row; bitsandbytes' fallback, the only path it takes past 1536 rows), where nf4 pays
# less host time per call (bench host_us at M = 512). Used only by the opt-in fused route of a patched bitsandbytes
# (`nf4.patch_bitsandbytes(fused_linear=True)`), whose outputs are nf4.linear's: float32 sums in another order than
# bitsandbytes' fused kernel where nf4.linear runs a fused kernel (the table's fused rows), not bitsandbytes' bits.
ROUTE_MATMUL_4BIT_MAX_M: dict[str, int] = {"H100": 4096, "H200": 4096}

_ROUTE_TABLES = {"matmul_4bit": ROUTE_MATMUL_4BIT_MAX_M, "gemm_4bit": ROUTE_GEMM_4BIT_MIN_M}
_limits: dict[tuple[str, str], int] = {}


def _gpu_limit(route: str, device_name: str) -> int:
    """The entry of a route's per-GPU table (_ROUTE_TABLES) whose key is in the GPU's name (the default GPU's
    otherwise), cached: the routes ask on every bitsandbytes call. Keyed by the route's name, not the table's
    id(), which torch.compile cannot trace (the route runs inside a compiled Linear4bit)."""
    key = (route, device_name)
    limit = _limits.get(key)
    if limit is None:
        table = _ROUTE_TABLES[route]
        limit = _limits[key] = next((v for gpu, v in table.items() if gpu in device_name), table[DEFAULT_GPU])
    return limit


def matmul_4bit_route_max_m(device_name: str) -> int:
    """The most rows of a matmul_4bit call that the fused route of a patched bitsandbytes sends to nf4.linear on
    this GPU ("" for Triton's interpreter: the default GPU's limit)."""
    return _gpu_limit("matmul_4bit", device_name)


def routes_matmul_4bit(device_name: str, m: int) -> bool:
    """Whether the fused route of a patched bitsandbytes sends a matmul_4bit of m rows to nf4.linear on this GPU
    ("" for Triton's interpreter: the default GPU's limit)."""
    return 1 <= m <= _gpu_limit("matmul_4bit", device_name)  # asked on every bitsandbytes call: no wrapper


def routes_gemm_4bit(device_name: str, m: int) -> bool:
    """Whether a patched bitsandbytes should send a gemm_4bit of m rows to nf4 on this GPU."""
    return m >= _gpu_limit("gemm_4bit", device_name)


SMALL_WEIGHT = 1024 * 4096
LARGE_WEIGHT = 8192 * 4096  # weights from which the word GEMM rows take rows of 4096-8191 weights (for_shape)


def for_shape(config: LinearConfig, m: int, n: int, k: int) -> LinearConfig:
    """The config a tuned single-launch GEMV row gives way to on a weight of n x k that it fits badly; any other
    config unchanged. From sweeps of the tensor-core GEMV grid at M = 1, 2, 4, 8
    on 1024x4096, 8192x2048, 2048x8192 and 4096x4096 (bf16, results/linear/tuning/sweep_shapes_{h100,h200}.json,
    at 125705e), alike on both GPUs: at M <= 4, rows shorter than two steps of a GEMV_MMA_WK warp (k / 2 bytes
    < 2 x 8 warps x 128 bytes) take GEMV_MMA_WK4, whose 4 warps take two 128-byte steps each there (8192x2048:
    9.3 us against 10.1-12.0 on the H100, 9.1-9.4 against 10.0-11.8 on the H200); at M = 8 it measured as
    GEMV_MMA_WK16 (10.2 / 10.0 against 10.2 / 10.4), which stays.
    Where cdiv(n, 16) < multiprocessors (one launch leaves some idle: 1024x4096, 2048x8192) split-K over programs
    (GEMV_MMA16) measured 0.3-0.9 us less device time than the rows, but its second launch and partial-sum buffer
    took 35 us of host time per call against 20-22 (H100, bench-linear at 0bf48e8, results/linear/
    bench_h100_0bf48e8.json), so the rows stay: those weights are small, and their calls host-bound in eager use.
    The word tl.dot rows (sweeps at 6215746 / 5cde365): at M = 17-32 a weight of at most SMALL_WEIGHT weights keeps
    GEMV_MMA32 (1024x4096, M = 32: 7.5 / 7.4 us against 8.2 / 10.5 on the H100 / H200); at M = 65-128 rows shorter
    than 4096 take nf4.dequantize + cuBLAS (8192x2048, M = 128: 25.0 / 20.9 us against 26.3 / 25.4); at M = 129-256
    rows shorter than 8192 do too, but for rows of 4096 or more in a weight of LARGE_WEIGHT weights or more
    (WORD_GEMM256's sweeps at 1042431: it won on 14336x4096, 4096x14336 and 2048x8192 and lost on 4096x4096,
    8192x2048 and 1024x4096; the bound lies between 2^24 weights and 14336x4096's 58.7M, where no weight was swept).
    Those large weights with rows of 4096-8191 take WORD_GEMM128_W8 at M = 65-128 and WORD_GEMM32_S8 at M = 17-32
    (their sweeps at 0f747f3).
    At M <= 4 a weight of 14336-16384 rows of 4096 weights takes GEMV_MMA_WK2 (112-128 programs of 128 rows, about
    one per multiprocessor; measured on 14336x4096 only, at a0a6bb3: 3-6 % faster than the rows it replaces at M = 1
    and 4 on both GPUs)."""
    large_short = 4096 <= k < 8192 and n * k >= LARGE_WEIGHT  # a large weight with rows of 4096-8191
    if config is WORD_GEMM32 and n * k <= SMALL_WEIGHT:
        return GEMV_MMA32
    if config is WORD_GEMM32 and large_short:
        return WORD_GEMM32_S8
    if (config is WORD_GEMM128 and k < 4096) or (config is WORD_GEMM256 and k < 8192 and not large_short):
        return DEQUANT
    if config is WORD_GEMM128 and large_short:
        return WORD_GEMM128_W8
    if m > 4 or (config is not GEMV_MMA_WK and config is not GEMV_MMA_WK16):
        return config
    if k // 2 < 2 * GEMV_MMA_WK.warps_k * 4 * GEMV_MMA_WK.step_bytes:
        return GEMV_MMA_WK4
    if k == 4096 and 14336 <= n <= 16384:
        return GEMV_MMA_WK2
    return config


def tuned(device_name: str, m: int, backward: bool = False, *, n: int | None = None,
          k: int | None = None) -> LinearConfig:
    """The tuned config for M rows of x on the named GPU ("" for the interpreter: the default rows); given the
    weight's n x k, as `for_shape` adjusts it for that weight."""
    if not device_name:
        return pick(INTERPRETER["backward" if backward else "forward"], m)
    table = next((t for gpu, t in TUNED.items() if gpu in device_name), TUNED[DEFAULT_GPU])
    config = pick(table["backward" if backward else "forward"], m)
    if not backward and n is not None and k is not None:
        config = for_shape(config, m, n, k)
    return config
