"""`nf4_gemv_kernel`: the FMA GEMV for a few rows of x, and its launches (kernel "gemv").

Plain FMAs into a [BLOCK_M, rows, CHUNKS, CH] float32 accumulator, one lane per (m, row, byte); the byte's two
weights meet x[2j] and x[2j + 1]. A program owns BLOCK_R rows of W and walks along K (split-K over programs:
float32 partials summed in order by nf4_split_sum_kernel); the lanes are summed once at the end. The order of
the float32 additions is the kernel's own (modelled bit for bit by reference.linear.gemv_model for Triton's
interpreter). Runs anywhere: the fallback of the word GEMVs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import round_to, widen
from ..weight import NF4Weight
from .call import Call, gemv_options, gemv_split, with_split_sum
from .common import decode, load_row_bytes, split_pairs
from .config import LinearConfig


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_kernel(
    x_ptr,  # [M, K] contiguous rows, float16 / bfloat16
    packed_ptr,  # W's packed bytes (any storage dtype, read as uint8)
    absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,  # first / second-level state (see nf4.dequant.kernel)
    code_ptr,  # float32 [16] NF4 levels (CODEBOOK 2: the 256 level pairs)
    bias_ptr,  # [N] in x's dtype (unused without HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype
    M, N, K,
    KB,  # bytes per row of W (K / 2); an argument so that Triton sees its divisibility by 16
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    CODEBOOK: tl.constexpr,  # 0: 16-entry table gather, 1: select tree, 2: 256-entry table of level pairs
    W_DT: tl.constexpr, X_DT: tl.constexpr,  # dtype codes (0 float32, 1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= M, a power of two
    BLOCK_R: tl.constexpr,  # rows of W per program
    HALF: tl.constexpr,  # bytes of a row per step; at most BLOCKSIZE / 2
    SPLIT,  # programs along K per block of rows (split-K)
    SEG,  # bytes of a row per split (a multiple of HALF)
    PARTIAL: tl.constexpr,  # write float32 partial sums [SPLIT, M, N] (SPLIT > 1)
    BF16_BITS: tl.constexpr, EVICT: tl.constexpr,
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    # x as uint32 pairs: x[m, 2j] and x[m, 2j + 1] in one load
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    pid_k = pid % SPLIT
    rows = (pid // SPLIT) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    acc = tl.zeros((BLOCK_M, BLOCK_R, HALF), dtype=tl.float32)  # a lane per (m, row, byte)
    # Every step is whole (HALF divides SEG and KB), so the loads are masked by row only and
    # vectorise; the prefetch after the last step re-reads that step (in bounds, unused).
    nxt = load_row_bytes(packed_ptr, rows, row_ok, first, KB, HALF, EVICT)
    for c0 in range(first, end, HALF):
        # the next step's bytes are requested before this step's are decoded
        byte = nxt
        nxt = load_row_bytes(packed_ptr, rows, row_ok, tl.minimum(c0 + HALF, end - HALF), KB, HALF, EVICT)
        w_even, w_odd = decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
        j = c0 + tl.arange(0, HALF)
        pair = tl.load(xw_ptr + m[:, None] * KB + j[None, :], mask=m_ok[:, None], other=0)
        x_even, x_odd = split_pairs(pair, X_DT)
        # products of 16-bit floats are exact in float32: fma(w, x, acc) == acc + w * x
        acc = tl.fma(widen(w_even, BF16_BITS)[None], x_even[:, None, :], acc)
        acc = tl.fma(widen(w_odd, BF16_BITS)[None], x_odd[:, None, :], acc)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_R]
    ok = m_ok[:, None] & row_ok[None, :]
    if PARTIAL:  # float32 partials [SPLIT, M, N], summed in order by nf4_split_sum_kernel
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)[None, :]
        tl.store(out_ptr + m[:, None] * N + rows[None, :], round_to(y, X_DT, BF16_BITS), mask=ok)


def step(config: LinearConfig, w: NF4Weight) -> int:
    """Bytes of a row per step: one absmax block at most (a split's length is a whole number of steps)."""
    return min(w.blocksize // 2, config.step_bytes)


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    return gemv_split(config, w, sms, step(config, w))


def level_pairs(config: LinearConfig) -> bool:
    """Whether the kernel reads the 256-entry table of level pairs (codebook 2), else the 16 levels."""
    return config.codebook == 2


def launches(call: Call) -> list[tuple]:
    config, w = call.config, call.w
    half = step(config, w)
    parts, seg = split(config, w, call.m, call.sms)
    args = {**call.args, "BLOCK_M": triton.next_power_of_2(call.m), "BLOCK_R": config.block_r, "HALF": half,
            "SPLIT": parts, "SEG": seg, "PARTIAL": parts > 1}
    grid = (triton.cdiv(w.shape[0], config.block_r) * parts,)
    return with_split_sum((nf4_gemv_kernel, grid, args, gemv_options(config)), parts, call)
