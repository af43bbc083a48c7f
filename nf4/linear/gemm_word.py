"""`nf4_gemm_word_kernel`: the word GEMV's prmt decode feeding tl.dot (wgmma on Hopper), M = 17-256, and its
launches (kernel "gemm_word").

A thread decodes one row's 64-weight step into tl.dot's first operand (SWAP: out^T = W @ x^T); split-K over
programs with float32 partials summed in order by nf4_split_sum_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import absmax_of_block, product_table, round_to, table_pairs, widen
from ..weight import NF4Weight
from .call import Call, aligned, packs_16bit, split_by, with_split_sum
from .common import dot, grouped, word_pairs
from .config import LinearConfig


@triton.jit
def word_tile(p0, p1, p2, p3, X_DT: tl.constexpr):
    """Four [H, R, W] uint32 tensors of weight pairs (`table_pairs`' order: pair j of word w holds elements
    8w + 2j (low half) and 8w + 2j + 1 (high half)) -> the [R, 8WH] tile of 16-bit weights in x's dtype (word
    w of part h at columns 8(hW + w) ..). Each join adds its new axis as the fastest register of a thread, so
    a thread's 8WH weights of a row stay in column order in its registers (vector stores to shared memory)."""
    H: tl.constexpr = p0.shape[0]
    R: tl.constexpr = p0.shape[1]
    W: tl.constexpr = p0.shape[2]
    q = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [H, R, W, 2, 2]: entry [.., i, o] is pair 2i + o
    q = tl.reshape(q, (H, R, 4 * W))
    if X_DT == 2:
        dt = tl.bfloat16
    else:
        dt = tl.float16
    lo = (q & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    hi = (q >> 16).to(tl.uint16).to(dt, bitcast=True)
    t = tl.reshape(tl.join(lo, hi), (H, R, 8 * W))
    if H == 1:
        return tl.reshape(t, (R, 8 * W))
    else:
        return tl.reshape(tl.permute(t, (1, 0, 2)), (R, 8 * W * H))


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemm_word_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # weights of a row per step: 32 or 64, at most BLOCKSIZE (one absmax per row and step)
    GROUP: tl.constexpr, SWAP: tl.constexpr,
    SPLIT,  # programs along K per output tile (split-K)
    SEG,  # bytes of a row per split (a multiple of BLOCK_K / 2)
    PARTIAL: tl.constexpr,  # write float32 partial sums [SPLIT, M, N] (SPLIT > 1), summed by nf4_split_sum_kernel
    BF16_BITS: tl.constexpr, EVICT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """x @ W^T (+ bias) by `tl.dot` (wgmma on Hopper) on W tiles decoded like the word GEMV's: a row's step is
    BLOCK_K / 8 words of packed bytes looked up with `prmt` in the row's 16-entry product table
    (`product_table`, built once per row and step), each 4 words laid out in element order as a
    [BLOCK_N, 32] tile (`word_tile`) and multiplied with x's 32 matching columns. Grid:
    SPLIT * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs, GROUP tiles along M next to each other per W tile.
    SWAP: out^T = W @ x^T (the decoded tile as tl.dot's first operand). Needs W's dtype == x's, 4-byte aligned
    packed bytes and K a multiple of BLOCK_K (the API checks them); Triton's interpreter decodes with
    `word_pairs` instead of PTX."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    pid_m, pid_n = grouped(pid // SPLIT, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r = tl.minimum(rows, N - 1)  # rows past the weight decode its last row (not stored)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    H: tl.constexpr = BLOCK_K // 32  # 4-word parts of a row's step: [H, BLOCK_N, 4] words, a thread per row
    wp = words_ptr + r[None, :, None] * KW + (4 * tl.arange(0, H)[:, None, None] + tl.arange(0, 4)[None, None, :])
    xp = x_ptr + m[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    blk = r * (KB // (BLOCKSIZE // 2))  # the row's first absmax block
    always = r >= 0
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    # Every split has a step (split_k: SPLIT = cdiv(KB, SEG), K > 0). Said to the compiler, the loop has no
    # zero-trip path: without it LLVM set the accumulator to zero again on that path, after the loop, where ptxas
    # (CUDA 12.8-12.9) counts it as a non-wgmma definition of wgmma accumulators and serializes every wgmma of the
    # loop (C7515) whenever the epilogue rounds to 16 bits (experiments gemm-limit).
    tl.assume(end > first)
    for c0 in range(first, end, BLOCK_K // 2):
        amax = absmax_of_block(blk + c0 // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                               DOUBLE_QUANT, FTZ, ASM)[None, :, None]
        word = tl.load(wp + c0 // 4, eviction_policy=EVICT)
        if ASM:  # the row's table once for the step
            t0, t1, t2, t3, t4, t5, t6, t7 = product_table(amax, FTZ, X_DT)
            p0, p1, p2, p3 = table_pairs(word, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            p0, p1, p2, p3 = word_pairs(word, amax, code_ptr, FTZ, X_DT, BF16_BITS)
        w = word_tile(p0, p1, p2, p3, X_DT)
        xk = tl.load(xp + 2 * c0, mask=m_ok[:, None], other=0.0)
        if SWAP:
            acc = dot(w, tl.trans(xk), acc, DOT_F32)
        else:
            acc = dot(xk, tl.trans(w), acc, DOT_F32)
    if SWAP:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & row_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc = acc + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)[None, :]
        tl.store(out_ptr + m[:, None] * N + rows[None, :], round_to(acc, X_DT, BF16_BITS), mask=ok)


def runnable(config: LinearConfig, w: NF4Weight, x, m: int) -> bool:
    """W's dtype is x's, steps of 32 or 64 weights, 4-byte aligned packed bytes, sm_80+ or the interpreter."""
    return w.dtype == x.dtype and w.blocksize >= 32 and packs_16bit(w.packed.device) and aligned(w.packed, 4)


def block_k(config: LinearConfig, w: NF4Weight) -> int:
    """Weights of a row per step: 64 or 32, at most the blocksize."""
    return min(64, config.block_k, w.blocksize)


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    """Auto (split_k 0): the split nearest programs_per_sm programs per multiprocessor, at least 4 steps each
    (1 off the GPU: sms None)."""

    def auto(steps: int) -> int:
        if sms is None:
            return 1
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(w.shape[0], config.block_n)
        want = config.programs_per_sm * sms
        return max(1, min((want + tiles // 2) // tiles, steps // 4))

    return split_by(config, w, block_k(config, w) // 2, auto)


def launches(call: Call) -> list[tuple]:
    config, w, m = call.config, call.w, call.m
    parts, seg = split(config, w, m, call.sms)
    args = {**call.args, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": block_k(config, w),
            "GROUP": config.group, "SWAP": config.swap, "SPLIT": parts, "SEG": seg, "PARTIAL": parts > 1,
            "DOT_F32": call.interpreting}
    del args["CODEBOOK"], args["W_DT"]
    grid = (parts * triton.cdiv(m, config.block_m) * triton.cdiv(w.shape[0], config.block_n),)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return with_split_sum((nf4_gemm_word_kernel, grid, args, options), parts, call)
