"""The fused linear's meta-parameters as a frozen value, checked when it is built.

A config names the kernel it runs (`kernel`, one of KERNELS; nf4.linear.launch.KERNELS maps each name
but "dequant" to its kernel file, and a test checks that the two agree):
- "gemv": nf4_gemv_kernel (float32 FMAs, no tensor cores; `codebook` picks its level lookup);
- "gemv_table": nf4_gemv_table_kernel (each absmax block's 16 products looked up with prmt; M <= 4);
- "gemv_mma": nf4_gemv_mma_kernel (the same decode, products on tensor cores; M <= 32);
- "gemm_word": nf4_gemm_word_kernel (the prmt decode feeding tl.dot; M = 17-256);
- "gemv_pair": nf4_gemv_pair_kernel (the tensor-core GEMV decoding through a shared table of level pairs; M <= 16;
  in no tuned row);
- "gemm_gluon": nf4_gemm_gluon_kernel (Gluon: the decode writes wgmma's register operand, x permuted to match;
  sm_90, blocksize 64; M = 65-512 on large weights);
- "dequant": `nf4.dequantize` into a scratch weight, then cuBLAS (every backward takes it).
The tuned choice per GPU and M is data (`tuned.json`, read by nf4.linear.tuned).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..runtime import check_fields

KERNELS = ("gemv", "gemv_table", "gemv_mma", "gemm_word", "gemv_pair", "gemm_gluon", "dequant")
EVICTIONS = ("", "evict_first", "evict_last", "evict_normal")  # Triton's eviction policies


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class LinearConfig:
    """Meta-parameters of nf4.linear's kernels and the kernel that runs."""

    kernel: str = "gemv"
    # gemv kernels: rows of W per program, and bytes of a row per step, capped at half the blocksize (one
    # absmax per row and step)
    block_r: int = 32
    step_bytes: int = 32
    # gemv kernels and gemm_word: programs along K (split-K; partial sums in float32, summed in order by a
    # second kernel); 0 picks enough for programs_per_sm programs per multiprocessor (1 in the interpreter)
    split_k: int = 0
    programs_per_sm: int = 8
    # gemm_word: output tile, K step (weights; 32 or 64, capped at the blocksize), programs along M that share a
    # W tile, pipeline stages
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group: int = 8
    swap: bool = False  # out^T = W @ x^T, the decoded tile as tl.dot's first operand (small M)
    num_stages: int = 3
    num_warps: int = 4
    codebook: int = 2  # gemv: 0 16-entry table gather, 1 select tree, 2 256-entry table of level pairs
    # gemv_mma: warps of a program that share each 16-row group and split the program's K range (their sums
    # added in the program); block_r must then be 16 * num_warps / warps_k
    warps_k: int = 1
    evict: str = "evict_first"  # eviction policy of the packed bytes (read once per x tile)
    bf16_bits: bool = False  # round to bfloat16 with integer ops on the GPU too (the interpreter always does)
    plan: bool = True  # keep checked calls in the repeat-call cache (the cheap repeat call)
    # registers per thread the compiler may use (PTX .maxnreg), None: its own choice
    maxnreg: int | None = None

    def __post_init__(self):
        check_fields(self)
        if self.kernel not in KERNELS:
            raise ValueError(f"LinearConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        for name in ("block_r", "step_bytes", "block_m", "block_n", "block_k", "group", "warps_k"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"LinearConfig.{name} must be a power of two, got {getattr(self, name)}")
        if self.split_k < 0 or self.programs_per_sm < 1:
            raise ValueError(f"LinearConfig: split_k must be >= 0 and programs_per_sm >= 1, got {self.split_k}, "
                             f"{self.programs_per_sm}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"LinearConfig.num_stages must be in 1..8, got {self.num_stages}")
        if self.step_bytes < 16 or self.block_r > 1024 or self.step_bytes > 1024:
            raise ValueError(f"LinearConfig: step_bytes must be in 16..1024 and block_r at most 1024, got "
                             f"{self.step_bytes}, {self.block_r}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32 or max(self.block_m, self.block_n) > 512:
            raise ValueError("LinearConfig: tl.dot needs block_m and block_n in 16..512 and block_k >= 32, got "
                             f"{self.block_m}, {self.block_n}, {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearConfig.num_warps must be a power of two up to 16, got {self.num_warps}")
        if self.maxnreg is not None and not 16 <= self.maxnreg <= 255:
            raise ValueError(f"LinearConfig.maxnreg must be in 16..255 (registers per thread), got {self.maxnreg}")
        if self.codebook not in (0, 1, 2):
            raise ValueError(f"LinearConfig.codebook must be 0, 1 or 2, got {self.codebook}")
        if self.evict not in EVICTIONS:
            raise ValueError(f"LinearConfig.evict must be one of {EVICTIONS}, got {self.evict!r}")
        if self.num_warps % self.warps_k:
            raise ValueError(f"LinearConfig.warps_k must divide num_warps = {self.num_warps}, got {self.warps_k}")
        if self.warps_k > 1 and self.kernel != "gemv_mma":
            raise ValueError(f"LinearConfig.warps_k > 1 needs kernel='gemv_mma', got {self.kernel!r}")
        if self.kernel == "gemv_mma" and self.block_r != 16 * self.num_warps // self.warps_k:
            raise ValueError(f"LinearConfig.block_r must be 16 * num_warps / warps_k = "
                             f"{16 * self.num_warps // self.warps_k} with kernel='gemv_mma' (a group of warps_k "
                             f"warps owns 16 rows), got {self.block_r}")

    def with_(self, **changes) -> LinearConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)
