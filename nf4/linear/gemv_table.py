"""`nf4_gemv_table_kernel`: the word GEMV (x of at most 4 rows), and its launches (kernel "gemv_table").

W read as 32-bit words; each absmax block's 16 products NF4[c] * absmax, rounded to x's dtype, are built once
per row and step (nf4.device.product_table) and each byte's two weights looked up with prmt
(nf4.device.table_pairs); float32 FMAs per row of x.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import absmax_of_block, product_table, round_to, table_pairs, widen
from ..weight import NF4Weight
from .call import Call, aligned, gemv_options, gemv_split, packs_16bit, with_split_sum
from .common import split_pairs, word_pairs
from .config import LinearConfig

TABLE_MAX_M = 4  # rows of x the kernel takes
SIMPLER = "gemv"  # what runs a config of this shape where this kernel cannot (launch.launch_config)


@triton.jit
def _fma_word(p0, p1, p2, p3, xrow_ptr, xw, acc, X_DT: tl.constexpr):
    """acc [R, W] + the 8 products of each word with x's row (pairs at xrow_ptr + xw + 0..3), in element
    order: per byte j, w[2j] x[2j] then w[2j + 1] x[2j + 1] (exact products: FMAs)."""
    acc = _fma_pair(p0, tl.load(xrow_ptr + xw), acc, X_DT)
    acc = _fma_pair(p1, tl.load(xrow_ptr + xw + 1), acc, X_DT)
    acc = _fma_pair(p2, tl.load(xrow_ptr + xw + 2), acc, X_DT)
    return _fma_pair(p3, tl.load(xrow_ptr + xw + 3), acc, X_DT)


@triton.jit
def _fma_pair(w_pair, x_pair, acc, X_DT: tl.constexpr):
    w_even, w_odd = split_pairs(w_pair, X_DT)
    x_even, x_odd = split_pairs(x_pair, X_DT)
    acc = tl.fma(w_even, x_even[None, :], acc)
    return tl.fma(w_odd, x_odd[None, :], acc)


@triton.jit
def _fma_rows(p0, p1, p2, p3, xw, x0, x1, x2, x3, acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr,
              X_DT: tl.constexpr):
    """`_fma_word` for each of the BLOCK_M (1, 2 or 4) rows of x (row pointers x0..x3) into its accumulator."""
    acc0 = _fma_word(p0, p1, p2, p3, x0, xw, acc0, X_DT)
    if BLOCK_M > 1:
        acc1 = _fma_word(p0, p1, p2, p3, x1, xw, acc1, X_DT)
    if BLOCK_M > 2:
        acc2 = _fma_word(p0, p1, p2, p3, x2, xw, acc2, X_DT)
        acc3 = _fma_word(p0, p1, p2, p3, x3, xw, acc3, X_DT)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(acc, ptr, bias_ptr, rows, row_ok, m, M, N, pid_k, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """Row m of the result from its lanes [BLOCK_R, 4]: float32 partials [SPLIT, M, N] at ptr (PARTIAL), else
    (+ bias) rounded once into out [M, N] at ptr."""
    y = tl.sum(acc, axis=1)  # [BLOCK_R]
    ok = row_ok & ((rows * 0 + m) < M)
    if PARTIAL:
        tl.store(ptr + (pid_k * M + m) * N + rows, y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)
        tl.store(ptr + m * N + rows, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_table_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x: 1, 2 or 4 (next power of two of M)
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,  # bytes of a row per step: 16 or 32, at most BLOCKSIZE / 2
    SPLIT, SEG, PARTIAL: tl.constexpr, BF16_BITS: tl.constexpr, EVICT: tl.constexpr,
):
    """The GEMV forward of `nf4_gemv_kernel` (x @ W^T, split-K with float32 partials) reading W as 32-bit
    words and decoding each absmax block through its 16-entry product table (codebook 3), built once
    per row and step. A step is one or two 16-byte tiles of a row (4 words each); for each row m of
    x, lane t of a row takes word t of each tile in turn and adds its 8 products in element order;
    the 4 lanes of a row are summed once at the end. Needs M <= 4, W's dtype == x's dtype and 4-byte
    aligned packed bytes (the API checks them)."""
    NSUB: tl.constexpr = HALF // 16  # 16-byte tiles per step (1 or 2): a lane takes word t of each
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] in one load
    KW = KB // 4  # words per row of W
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    rows = (pid // SPLIT) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    # a lane per (row, word of a 16-byte tile) for each row of x; rows of x past M read row M - 1 and
    # are not stored
    acc0 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    x1 = xw_ptr + tl.minimum(1, M - 1) * KB
    x2 = xw_ptr + tl.minimum(2, M - 1) * KB
    x3 = xw_ptr + tl.minimum(3, M - 1) * KB
    wi = tl.arange(0, 4)
    wrow = packed_ptr + rows[:, None] * KW
    nxt0 = tl.load(wrow + (first // 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
    nxt1 = nxt0
    if NSUB == 2:
        nxt1 = tl.load(wrow + (first // 4 + 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
    for c0 in range(first, end, HALF):
        word0 = nxt0
        word1 = nxt1
        c1 = tl.minimum(c0 + HALF, end - HALF)  # the last step re-reads itself (in bounds, unused)
        nxt0 = tl.load(wrow + (c1 // 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        if NSUB == 2:
            nxt1 = tl.load(wrow + (c1 // 4 + 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        blk = (rows * KB + c0) // (BLOCKSIZE // 2)
        absmax = absmax_of_block(blk, row_ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, DOUBLE_QUANT, FTZ,
                                 ASM)
        absmax = tl.where(row_ok, absmax, 0.0)[:, None]
        if ASM:  # the block's table once for both tiles
            t0, t1, t2, t3, t4, t5, t6, t7 = product_table(absmax, FTZ, X_DT)
            p0, p1, p2, p3 = table_pairs(word0, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            p0, p1, p2, p3 = word_pairs(word0, absmax, code_ptr, FTZ, X_DT, BF16_BITS)
        xw = c0 + 4 * wi  # x's pair for byte 0 of each word
        acc0, acc1, acc2, acc3 = _fma_rows(p0, p1, p2, p3, xw, xw_ptr, x1, x2, x3, acc0, acc1, acc2, acc3, BLOCK_M,
                                           X_DT)
        if NSUB == 2:
            if ASM:
                p0, p1, p2, p3 = table_pairs(word1, t0, t1, t2, t3, t4, t5, t6, t7)
            else:
                p0, p1, p2, p3 = word_pairs(word1, absmax, code_ptr, FTZ, X_DT, BF16_BITS)
            acc0, acc1, acc2, acc3 = _fma_rows(p0, p1, p2, p3, xw + 16, xw_ptr, x1, x2, x3, acc0, acc1, acc2, acc3,
                                               BLOCK_M, X_DT)
    _store_row(acc0, out_ptr, bias_ptr, rows, row_ok, 0, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    if BLOCK_M > 1:
        _store_row(acc1, out_ptr, bias_ptr, rows, row_ok, 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    if BLOCK_M > 2:
        _store_row(acc2, out_ptr, bias_ptr, rows, row_ok, 2, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
        _store_row(acc3, out_ptr, bias_ptr, rows, row_ok, 3, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


def runnable(config: LinearConfig, w: NF4Weight, x, m: int) -> bool:
    """W's dtype is x's, 4-byte aligned packed bytes, a step of whole 16-byte tiles, M <= 4, sm_80+ or the
    interpreter."""
    half = min(w.blocksize // 2, config.step_bytes)
    return (m <= TABLE_MAX_M and w.dtype == x.dtype and packs_16bit(w.packed.device) and aligned(w.packed, 4)
            and half % 16 == 0)


def step(config: LinearConfig, w: NF4Weight) -> int:
    """Bytes of a row per step: one absmax block at most (a split's length is a whole number of steps)."""
    return min(w.blocksize // 2, config.step_bytes)


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    return gemv_split(config, w, sms, step(config, w))


def launches(call: Call) -> list[tuple]:
    config, w = call.config, call.w
    parts, seg = split(config, w, call.m, call.sms)
    args = {**call.args, "BLOCK_M": triton.next_power_of_2(call.m), "BLOCK_R": config.block_r,
            "HALF": min(step(config, w), 32), "SPLIT": parts, "SEG": seg, "PARTIAL": parts > 1}
    del args["CODEBOOK"], args["W_DT"]
    grid = (triton.cdiv(w.shape[0], config.block_r) * parts,)
    return with_split_sum((nf4_gemv_table_kernel, grid, args, gemv_options(config)), parts, call)
