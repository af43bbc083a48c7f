"""`nf4_gemv_mma_kernel`: the word GEMV with its products on tensor cores (PTX mma.sync m16n8k16), M <= 32, and
its launches (kernel "gemv_mma").

The decode is the word GEMV's (product table per absmax block, prmt lookups); the decoded pairs are the A
operand (16 rows of W per warp: lane 4g + t decodes rows g and g + 8), x's matching pairs the B operand (its
8 columns are 8 rows of x), float32 accumulation. WARPS_K warps of a program may share each 16-row group and
split its K range, their sums added in the program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import absmax_of_block, load_v4, mma_16x8x16, product_table, round_to, table_pairs, widen
from ..weight import NF4Weight
from .call import Call, aligned, gemv_options, gemv_split, packs_16bit, with_split_sum
from .config import LinearConfig

MMA_MAX_M = 32  # rows of x the kernel takes: up to 4 tiles of B's 8 columns
SIMPLER = "gemv_table"  # what runs a config of this shape where this kernel cannot (launch.launch_config)


@triton.jit
def _mma_pairs(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp, c0, c1, c2, c3, c4, c5, c6, c7, X_DT: tl.constexpr):
    """One word's looked-up pairs of rows g (pa) and g + 8 (pb) against x's 4 matching pairs at xp (B's column g
    of one 8-row tile of x): pairs 0 and 1 as the lane's A columns 2t.. and 2t + 8.. of one mma.sync, pairs 2
    and 3 of a second, into the two accumulator sets (c0..c3, c4..c7)."""
    x0, x1, x2, x3 = load_v4(xp, False)
    c0, c1, c2, c3 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, c0, c1, c2, c3, X_DT)
    c4, c5, c6, c7 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, c4, c5, c6, c7, X_DT)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _mma_word(wa, wb, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
              xp0, xp1, xp2, xp3,
              c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23,
              c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37,
              X_DT: tl.constexpr, NTILE: tl.constexpr):
    """One word of each of the lane's two rows (wa: row g, wb: row g + 8), looked up once, against each of the
    NTILE 8-row tiles of x (pairs at xp0..xp3; accumulators c<tile><0..7>)."""
    pa0, pa1, pa2, pa3 = table_pairs(wa, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7)
    pb0, pb1, pb2, pb3 = table_pairs(wb, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7)
    c00, c01, c02, c03, c04, c05, c06, c07 = _mma_pairs(
        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp0, c00, c01, c02, c03, c04, c05, c06, c07, X_DT)
    if NTILE > 1:
        c10, c11, c12, c13, c14, c15, c16, c17 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp1, c10, c11, c12, c13, c14, c15, c16, c17, X_DT)
    if NTILE > 2:
        c20, c21, c22, c23, c24, c25, c26, c27 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp2, c20, c21, c22, c23, c24, c25, c26, c27, X_DT)
        c30, c31, c32, c33, c34, c35, c36, c37 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp3, c30, c31, c32, c33, c34, c35, c36, c37, X_DT)
    return (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
            c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37)


@triton.jit
def mma_tile(a0, a1, a2, a3, b0, b1, b2, b3, xp0, xp1, xp2, xp3,
              ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
              c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23,
              c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37,
              X_DT: tl.constexpr, NTILE: tl.constexpr):
    """A lane's 16-byte tile of each of its rows (words a0..a3 of row g, b0..b3 of row g + 8) against x's 16
    matching pairs in each 8-row tile of x (at xp0..xp3): 8 mma.sync steps per tile of x."""
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a0, b0, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0, xp1, xp2, xp3,
        c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
        c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a1, b1, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 4, xp1 + 4,
        xp2 + 4, xp3 + 4, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a2, b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 8, xp1 + 8,
        xp2 + 8, xp3 + 8, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a3, b3, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 12, xp1 + 12,
        xp2 + 12, xp3 + 12, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    return (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
            c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37)


@triton.jit
def _mma_store(y, ptr, bias_ptr, rows, m, M, N, pid_k, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """One output per thread (W row `rows`, x row `m`): a float32 partial, or (+ bias) rounded once."""
    ok = (rows < N) & (m < M)
    if PARTIAL:
        tl.store(ptr + (pid_k * M + m) * N + rows, y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + rows, mask=ok, other=0.0), BF16_BITS)
        tl.store(ptr + m * N + rows, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit
def mma_words(wa, wb, j, NSUB: tl.constexpr, STREAM: tl.constexpr):
    """A lane's words of its two rows of W (at wa, wb) for the step at byte j, NSUB 16-byte tiles each (with one,
    the second four words repeat the first). STREAM: not kept in L1 (as mma_fetch reads them)."""
    a0, a1, a2, a3 = load_v4(wa + j // 4, STREAM)
    b0, b1, b2, b3 = load_v4(wb + j // 4, STREAM)
    a4, a5, a6, a7 = a0, a1, a2, a3
    b4, b5, b6, b7 = b0, b1, b2, b3
    if NSUB == 2:
        a4, a5, a6, a7 = load_v4(wa + j // 4 + 4, STREAM)
        b4, b5, b6, b7 = load_v4(wb + j // 4 + 4, STREAM)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def mma_absmax(ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE: tl.constexpr,
               DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr):
    """The absmax of rows ra and rb at byte j of their rows (the lane's block of the step)."""
    amax_a = absmax_of_block((ra * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    amax_b = absmax_of_block((rb * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    return amax_a, amax_b


@triton.jit
def mma_fetch(wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
              BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, NSUB: tl.constexpr):
    """A lane's words of its two rows of W (at wa, wb: rows ra, rb) for the step at byte j (`mma_words`) and the
    two rows' absmax there (`mma_absmax`)."""
    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = mma_words(wa, wb, j, NSUB, True)
    amax_a, amax_b = mma_absmax(ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE,
                                DOUBLE_QUANT, FTZ)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a, amax_b


@triton.jit
def _warps_sum(y, GROUPS: tl.constexpr, WARPS_K: tl.constexpr):
    """[THREADS] (thread i: group i // (32 * WARPS_K), warp (i // 32) % WARPS_K, lane i % 32) -> [GROUPS, 32]:
    each group's WARPS_K warps added lane by lane."""
    return tl.sum(tl.reshape(y, (GROUPS, WARPS_K, 32)), axis=1)


@triton.jit
def _mma_store_tile(c0, c1, c2, c3, c4, c5, c6, c7, m0, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N, pid_k,
                    PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, X_DT: tl.constexpr, BF16_BITS: tl.constexpr,
                    GROUPS: tl.constexpr, WARPS_K: tl.constexpr):
    """The lane's 4 outputs of one 8-row tile of x (from row m0): the two accumulator sets added. With WARPS_K > 1
    the group's warps are added too (`_warps_sum`), and the [GROUPS, 32] sums go to the rows of lane 4g + t of
    each group (from the program's first row, row0)."""
    y0, y1, y2, y3 = c0 + c4, c1 + c5, c2 + c6, c3 + c7
    if WARPS_K > 1:
        y0, y1 = _warps_sum(y0, GROUPS, WARPS_K), _warps_sum(y1, GROUPS, WARPS_K)
        y2, y3 = _warps_sum(y2, GROUPS, WARPS_K), _warps_sum(y3, GROUPS, WARPS_K)
        lane = tl.arange(0, 32)[None, :]
        row_a = row0 + tl.arange(0, GROUPS)[:, None] * 16 + lane // 4
        row_b = row_a + 8
        t = lane % 4
    m = m0 + 2 * t
    _mma_store(y0, out_ptr, bias_ptr, row_a, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y1, out_ptr, bias_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y2, out_ptr, bias_ptr, row_b, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y3, out_ptr, bias_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_mma_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    zero_ptr,  # WARPS_K > 1: 128 bytes of zeros, the x a warp reads for a step past its program's range
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    THREADS: tl.constexpr,  # 32 * num_warps: every 1-D tensor here holds one element per thread
    HALF: tl.constexpr,  # bytes of each of its two rows a thread decodes per step: 16 or 32 (<= BLOCKSIZE / 2)
    NTILE: tl.constexpr,  # 8-row tiles of x (B's 8 columns each): 1, 2 or 4 (M <= 8 * NTILE)
    SPLIT, SEG, PARTIAL: tl.constexpr, BF16_BITS: tl.constexpr,
    WARPS_K: tl.constexpr,  # warps of a program that share its 16-row groups and split its K range
):
    """The word GEMV (codebook 3's product table and prmt lookup) with its products on tensor cores:
    x @ W^T for M <= 32 by PTX `mma.sync.m16n8k16` (float32 accumulation), split-K like nf4_gemv_kernel.
    Each warp owns 16 rows of W; lane 4g + t decodes rows g and g + 8, bytes t * HALF .. (t + 1) * HALF of
    each 4 * HALF-byte step. An mma's 16 columns of K are any 16 of the step, provided A's and B's agree:
    the lane's own word pairs are its A columns 2t.. / 2t + 8.., and its B registers are x's pairs at
    the same bytes, from row 8u + g of x (B's column g of the u-th 8-row tile of x); a word is looked up once
    for all NTILE tiles. D's lane 4g + t holds outputs (row g / g + 8, x row 8u + 2t / 8u + 2t + 1). Needs an
    sm_80+ GPU, 16-byte aligned x and packed bytes, K / 2 a multiple of 4 * HALF and W's dtype == x's (the
    API checks them); GPU only (no PTX in Triton's interpreter).

    WARPS_K > 1: the program's warps form groups of WARPS_K that own the same 16 rows, warp k of a group taking
    steps k, k + WARPS_K, ... of the program's range (a step past the range reads its last step's weights
    against zeros at zero_ptr); the group's sums are added in the program (`_warps_sum`, through shared memory)
    before the store, so that a single launch (SPLIT 1) can spread a row's K over several warps."""
    NSUB: tl.constexpr = HALF // 16
    STEP: tl.constexpr = 4 * HALF
    GROUPS: tl.constexpr = THREADS // (32 * WARPS_K)  # 16-row groups per program
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] as one word
    KW = KB // 4
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    row0 = (pid // SPLIT) * (16 * GROUPS)  # the program's first row
    row_a = row0 + (i // (32 * WARPS_K)) * 16 + g  # the warp's 16-row group
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)  # rows past the weight decode its last row (their outputs are not stored)
    rb = tl.minimum(row_b, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    # B's column g of tile u: x's row 8u + g (past M: row M - 1, not stored)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    xr2 = xw_ptr + tl.minimum(16 + g, M - 1) * KB
    xr3 = xw_ptr + tl.minimum(24 + g, M - 1) * KB
    always = i >= 0
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    kw = (i // 32) % WARPS_K  # the warp's place in its group (0 without WARPS_K)
    zw = zero_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero,
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    # the first step's words and absmax; each step then requests the next step's before decoding its own
    # (the last step re-reads itself: in bounds, unused)
    if WARPS_K == 1:
        j = first + t * HALF  # this lane's bytes of the step (one absmax block)
    else:
        j = tl.minimum(first + kw * STEP, end - STEP) + t * HALF
    (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = mma_fetch(
        wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT, FTZ,
        NSUB)
    for c0 in range(first, end, STEP * WARPS_K):
        a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
        b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
        amax_a, amax_b = next_a, next_b
        if WARPS_K == 1:
            j = c0 + t * HALF
            jn = tl.minimum(c0 + STEP, end - STEP) + t * HALF
            x0, x1, x2, x3 = xr0 + j, xr1 + j, xr2 + j, xr3 + j
        else:
            s = c0 + kw * STEP  # this warp's step; past `end` it re-reads the last step, against zeros
            j = tl.minimum(s, end - STEP) + t * HALF
            jn = tl.minimum(s + STEP * WARPS_K, end - STEP) + t * HALF
            live = s < end
            x0, x1, x2, x3 = (tl.where(live, xr0 + j, zw), tl.where(live, xr1 + j, zw), tl.where(live, xr2 + j, zw),
                              tl.where(live, xr3 + j, zw))
        (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = mma_fetch(
            wa, wb, ra, rb, jn, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT,
            FTZ, NSUB)
        ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = product_table(amax_a, FTZ, X_DT)
        tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = product_table(amax_b, FTZ, X_DT)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
         c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = mma_tile(
            a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, ta0, ta1, ta2, ta3, ta4, ta5, ta6,
            ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13,
            c14, c15, c16, c17, c20, c21, c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT,
            NTILE)
        if NSUB == 2:
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
             c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = mma_tile(
                a4, a5, a6, a7, b4, b5, b6, b7, x0 + 16, x1 + 16, x2 + 16, x3 + 16, ta0, ta1,
                ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25, c26, c27, c30, c31,
                c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    _mma_store_tile(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                    pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
    if NTILE > 1:
        _mma_store_tile(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
    if NTILE > 2:
        _mma_store_tile(c20, c21, c22, c23, c24, c25, c26, c27, 16, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
        _mma_store_tile(c30, c31, c32, c33, c34, c35, c36, c37, 24, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)


def runnable(config: LinearConfig, w: NF4Weight, x, m: int) -> bool:
    """CUDA sm_80+, M <= 32, W's dtype is x's, x contiguous, x and the packed bytes 16-byte aligned, rows of whole
    steps."""
    packed = w.packed
    half = min(w.blocksize // 2, config.step_bytes, 32)
    return (m <= MMA_MAX_M and w.dtype == x.dtype and packed.device.type == "cuda"
            and packs_16bit(packed.device) and half % 16 == 0 and (w.shape[1] // 2) % (4 * half) == 0
            and x.is_contiguous() and aligned(x, 16) and aligned(packed, 16))


def step(config: LinearConfig, w: NF4Weight) -> int:
    """Bytes of a row per step: 4 lanes' worth (4 * min(one absmax block, step_bytes, 32))."""
    return 4 * min(w.blocksize // 2, config.step_bytes, 32)


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    return gemv_split(config, w, sms, step(config, w))


def launches(call: Call) -> list[tuple]:
    config, w, m = call.config, call.w, call.m
    parts, seg = split(config, w, m, call.sms)
    args = {**call.args, "SPLIT": parts, "SEG": seg, "PARTIAL": parts > 1, "THREADS": 32 * config.num_warps,
            "HALF": step(config, w) // 4, "NTILE": triton.next_power_of_2(triton.cdiv(m, 8)),  # 8-row tiles of x
            "WARPS_K": config.warps_k, "zero_ptr": call.dummy}  # dummy: zeros, enough for a step of x
    for name in ("CODEBOOK", "W_DT", "ASM", "EVICT"):
        del args[name]
    grid = (triton.cdiv(w.shape[0], config.block_r) * parts,)
    return with_split_sum((nf4_gemv_mma_kernel, grid, args, gemv_options(config)), parts, call)
