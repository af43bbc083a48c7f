"""The GEMV lab's second skeleton: balanced tiles, the absmax chain off the critical path, x prefetched, and
split-K summed inside the kernel (one launch).

The first skeleton (experiments.labs.kernels) was measured on an H100 (probe of 2026-11-27, ncu source counters):
its control with no decode at all (MODE 4) took 1.76x the byte floor at 14336x4096, M = 1, where cuBLAS's GEMV
on as many bf16 bytes took 1.24x. The samples named three causes, each fixed here:
- the next step's absmax was computed in the iteration that requested its byte: code2[byte] waited a whole DRAM
  latency every step (the top long-scoreboard stall, on the FMUL of the absmax). Here the byte and the state2
  scale travel to the next iteration and the absmax is made where it is used;
- x's words were loaded next to the tensor-core products that read them (their latency exposed: the HMMA
  stalls). XPRE: the next step's x words of tile 0 are requested with the next step's weight bytes;
- persistent programs sized by an assumed occupancy: pair16 took 96 registers, 5 programs fit per SM, not 6,
  so 1.2 waves ran. Here a program is one tile (a 16 * warps row block and a K segment), and the host chooses
  the split from the occupancy of the compiled kernel (`plan`), so that the tiles make whole waves.
PARTIAL (split > 1): each program writes its float32 partial sums, then a counter per row block (acq_rel atomic
after a fence and a barrier) elects the last program of the row block, which adds the partials in split order
and stores the rounded output, then resets the counter: the result does not depend on which program finishes
last, and there is no second launch.

Lanes, fragments and decodes are the first skeleton's (experiments.labs.kernels: MODE 0 prmt table, 1 pair
table, 4 the no-decode control). GPU only (inline PTX, sm_80+).

Measured (`python -m experiments.labs.gemv_lut`, results/labs/gemv_skeletons_<gpu>.json): no faster than the first
skeleton where their plans agree, and much slower where the plan cut segments of one or two steps (each tile then
pays a whole pipeline fill and the partial pass); the absmax and x changes did not move the no-decode control.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nf4.device import load_v4, mma_16x8x16, mul

from . import kernels as K

STEP = tl.constexpr(128)
FENCE = tl.constexpr("fence.acq_rel.gpu; mov.u32 $0, 0;")


@triton.jit
def _word2(wa, wb, q: tl.constexpr, x0, x1, x2, x3, xp1, base, amax_a, amax_b,
           ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
           m0, m1, m2, m3, m4, m5, m6, m7, m8,
           c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
           MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr,
           XPRE: tl.constexpr):
    """Word q of the lane's 8 per row; x's pairs of tile 0 given (x0..x3), of tile 1 loaded here."""
    pa0, pa1, pa2, pa3 = K._pairs(wa, q, base, amax_a, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7,
                                  m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    pb0, pb1, pb2, pb3 = K._pairs(wb, q, base, amax_b, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
                                  m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    c00, c01, c02, c03 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, c00, c01, c02, c03, X_DT)
    c04, c05, c06, c07 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, c04, c05, c06, c07, X_DT)
    if NTILE == 2:
        y0, y1, y2, y3 = load_v4(xp1 + 4 * q, False)
        c10, c11, c12, c13 = mma_16x8x16(pa0, pb0, pa1, pb1, y0, y1, c10, c11, c12, c13, X_DT)
        c14, c15, c16, c17 = mma_16x8x16(pa2, pb2, pa3, pb3, y2, y3, c14, c15, c16, c17, X_DT)
    return c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17


@triton.jit
def _xwords(xp, XPRE: tl.constexpr, one):
    """The lane's 8 x words (4 uint32 each) of tile 0 at xp (XPRE), else placeholders (loaded per word)."""
    if XPRE:
        x0, x1, x2, x3 = load_v4(xp, False)
        x4, x5, x6, x7 = load_v4(xp + 4, False)
        x8, x9, x10, x11 = load_v4(xp + 8, False)
        x12, x13, x14, x15 = load_v4(xp + 12, False)
        x16, x17, x18, x19 = load_v4(xp + 16, False)
        x20, x21, x22, x23 = load_v4(xp + 20, False)
        x24, x25, x26, x27 = load_v4(xp + 24, False)
        x28, x29, x30, x31 = load_v4(xp + 28, False)
    else:
        (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19, x20, x21, x22,
            x23, x24, x25, x26, x27, x28, x29, x30, x31) = (one, one, one, one, one, one, one, one, one, one, one,
            one, one, one, one, one, one, one, one, one, one, one, one, one, one, one, one, one, one, one, one,
            one)
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19, x20, x21,
        x22, x23, x24, x25, x26, x27, x28, x29, x30, x31)


@triton.jit
def _xword(q: tl.constexpr, xp, x0, x1, x2, x3, XPRE: tl.constexpr):
    if not XPRE:
        x0, x1, x2, x3 = load_v4(xp + 4 * q, False)
    return x0, x1, x2, x3


@triton.jit
def _fetch2(wa, wb, ba, bb, j, absmax_ptr, absmax2_ptr):
    """The lane's 8 words of each row at byte j, the absmax bytes of their blocks (ba + j // 32, bb + ...) and the
    state2 scales of those blocks (their absmax is made later, in `_amax`)."""
    a0, a1, a2, a3 = load_v4(wa + j // 4, True)
    a4, a5, a6, a7 = load_v4(wa + j // 4 + 4, True)
    b0, b1, b2, b3 = load_v4(wb + j // 4, True)
    b4, b5, b6, b7 = load_v4(wb + j // 4 + 4, True)
    qa = tl.load(absmax_ptr + ba + j // 32)
    qb = tl.load(absmax_ptr + bb + j // 32)
    sa = tl.load(absmax2_ptr + (ba + j // 32) // 256, eviction_policy="evict_last")
    sb = tl.load(absmax2_ptr + (bb + j // 32) // 256, eviction_policy="evict_last")
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, qa, qb, sa, sb


@triton.jit
def _amax(q, s, code2_ptr, offset, FTZ: tl.constexpr):
    level = tl.load(code2_ptr + q.to(tl.int32), eviction_policy="evict_last")
    return mul(level, s, FTZ, True) + offset


@triton.jit
def _out1(y, out_ptr, part_ptr, r, m, M, N, pid_k, PARTIAL: tl.constexpr, X_DT: tl.constexpr):
    ok = (r < N) & (m < M)
    if PARTIAL:
        tl.store(part_ptr + (pid_k * M + m) * N + r, y, mask=ok)
    elif X_DT == 2:
        tl.store(out_ptr + m * N + r, y.to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + m * N + r, y.to(tl.float16), mask=ok)


@triton.jit
def _out(c0, c1, c2, c3, c4, c5, c6, c7, m0, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k,
         PARTIAL: tl.constexpr, X_DT: tl.constexpr):
    m = m0 + 2 * t
    _out1(c0 + c4, out_ptr, part_ptr, row_a, m, M, N, pid_k, PARTIAL, X_DT)
    _out1(c1 + c5, out_ptr, part_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, X_DT)
    _out1(c2 + c6, out_ptr, part_ptr, row_b, m, M, N, pid_k, PARTIAL, X_DT)
    _out1(c3 + c7, out_ptr, part_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, X_DT)


@triton.jit
def _sum1(out_ptr, part_ptr, r, m, M, N, SPLIT, X_DT: tl.constexpr):
    """The last program of a row block: partials of (m, r) added in split order, rounded, stored."""
    ok = (r < N) & (m < M)
    y = tl.load(part_ptr + m * N + r, mask=ok, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT):
        y += tl.load(part_ptr + (s * M + m) * N + r, mask=ok, other=0.0, cache_modifier=".cg")
    if X_DT == 2:
        tl.store(out_ptr + m * N + r, y.to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + m * N + r, y.to(tl.float16), mask=ok)


@triton.jit
def _sum(m0, out_ptr, part_ptr, row_a, row_b, t, M, N, SPLIT, X_DT: tl.constexpr):
    m = m0 + 2 * t
    _sum1(out_ptr, part_ptr, row_a, m, M, N, SPLIT, X_DT)
    _sum1(out_ptr, part_ptr, row_a, m + 1, M, N, SPLIT, X_DT)
    _sum1(out_ptr, part_ptr, row_b, m, M, N, SPLIT, X_DT)
    _sum1(out_ptr, part_ptr, row_b, m + 1, M, N, SPLIT, X_DT)


@triton.jit
def last_program_sums(i, lock_ptr, rblk, SPLIT, out_ptr, part_ptr, row_a, row_b, t, M, N, X_DT: tl.constexpr,
                      NTILE: tl.constexpr):
    """After this program's partial sums are stored: a fence and a barrier, one acq_rel atomic on the row block's
    counter, and the program that arrives last adds the SPLIT partials in split order, stores the rounded output
    and resets the counter."""
    tl.inline_asm_elementwise(FENCE, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    tl.debug_barrier()
    done = tl.atomic_add(lock_ptr + rblk, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        tl.inline_asm_elementwise(FENCE, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        _sum(0, out_ptr, part_ptr, row_a, row_b, t, M, N, SPLIT, X_DT)
        if NTILE == 2:
            _sum(8, out_ptr, part_ptr, row_a, row_b, t, M, N, SPLIT, X_DT)
        tl.atomic_xchg(lock_ptr + rblk, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "N", "KB", "SPLIT", "SEG", "ONE"])
def lab_gemv2_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, KB, SPLIT, SEG, ONE,
    MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr,
    X_DT: tl.constexpr, NTILE: tl.constexpr, THREADS: tl.constexpr, FTZ: tl.constexpr, XPRE: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """x @ W^T for M <= 16; program p: row block p // SPLIT (THREADS // 2 rows), K segment p % SPLIT (SEG bytes
    of a row). Blocksize 64, nested absmax, KB = K / 2 a multiple of 128."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    one = (i * 0 + ONE).to(tl.uint32)
    base, m0, m1, m2, m3, m4, m5 = K.pair_setup(code_ptr, lane, one, MODE, COPIES, SHIFT, THREADS)
    m6, m7 = one, one
    pid = tl.program_id(0)
    rblk = pid // SPLIT
    pid_k = pid % SPLIT
    row_a = rblk * (THREADS // 2) + (i // 32) * 16 + g
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)
    rb = tl.minimum(row_b, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    ba = ra * (KB // 32)  # the row's first absmax block
    bb = rb * (KB // 32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    offset = tl.load(offset_ptr)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (zero, zero, zero, zero,
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, nqa, nqb, nsa, nsb) = _fetch2(
        wa, wb, ba, bb, first + t * 32, absmax_ptr, absmax2_ptr)
    (nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, nx8, nx9, nx10, nx11, nx12, nx13, nx14, nx15, nx16, nx17, nx18, nx19,
        nx20, nx21, nx22, nx23, nx24, nx25, nx26, nx27, nx28, nx29, nx30, nx31) = _xwords(xr0 + first + t * 32,
        XPRE, one)
    for c0 in range(first, end, STEP):
        a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
        b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
        qa, qb, sa, sb = nqa, nqb, nsa, nsb
        (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19, x20, x21, x22,
            x23, x24, x25, x26, x27, x28, x29, x30, x31) = (nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, nx8, nx9, nx10,
            nx11, nx12, nx13, nx14, nx15, nx16, nx17, nx18, nx19, nx20, nx21, nx22, nx23, nx24, nx25, nx26, nx27,
            nx28, nx29, nx30, nx31)
        j = c0 + t * 32
        nj = tl.minimum(c0 + STEP, end - STEP) + t * 32  # the last step re-reads itself (unused)
        (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, nqa, nqb, nsa, nsb) = _fetch2(
            wa, wb, ba, bb, nj, absmax_ptr, absmax2_ptr)
        (nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, nx8, nx9, nx10, nx11, nx12, nx13, nx14, nx15, nx16, nx17, nx18,
            nx19, nx20, nx21, nx22, nx23, nx24, nx25, nx26, nx27, nx28, nx29, nx30, nx31) = _xwords(xr0 + nj, XPRE,
            one)
        amax_a = _amax(qa, sa, code2_ptr, offset, FTZ)
        amax_b = _amax(qb, sb, code2_ptr, offset, FTZ)
        ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = one, one, one, one, one, one, one, one
        tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = one, one, one, one, one, one, one, one
        if MODE == 0 or PRMT_WORDS > 0:
            ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = K.product_table(amax_a, FTZ, X_DT)
            tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = K.product_table(amax_b, FTZ, X_DT)
        xp0 = xr0 + j
        xp1 = xr1 + j
        x0, x1, x2, x3 = _xword(0, xp0, x0, x1, x2, x3, XPRE)
        x4, x5, x6, x7 = _xword(1, xp0, x4, x5, x6, x7, XPRE)
        x8, x9, x10, x11 = _xword(2, xp0, x8, x9, x10, x11, XPRE)
        x12, x13, x14, x15 = _xword(3, xp0, x12, x13, x14, x15, XPRE)
        x16, x17, x18, x19 = _xword(4, xp0, x16, x17, x18, x19, XPRE)
        x20, x21, x22, x23 = _xword(5, xp0, x20, x21, x22, x23, XPRE)
        x24, x25, x26, x27 = _xword(6, xp0, x24, x25, x26, x27, XPRE)
        x28, x29, x30, x31 = _xword(7, xp0, x28, x29, x30, x31, XPRE)
        m8 = one
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a0, b0, 0, x0,
            x1, x2, x3, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4,
            tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11,
            c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a1, b1, 1, x4,
            x5, x6, x7, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4,
            tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11,
            c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a2, b2, 2, x8,
            x9, x10, x11, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a3, b3, 3, x12,
            x13, x14, x15, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a4, b4, 4, x16,
            x17, x18, x19, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a5, b5, 5, x20,
            x21, x22, x23, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a6, b6, 6, x24,
            x25, x26, x27, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word2(a7, b7, 7, x28,
            x29, x30, x31, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, m8, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, XPRE)
    _out(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL, X_DT)
    if NTILE == 2:
        _out(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL,
             X_DT)
    if PARTIAL:
        last_program_sums(i, lock_ptr, rblk, SPLIT, out_ptr, part_ptr, row_a, row_b, t, M, N, X_DT, NTILE)


# --- host side ------------------------------------------------------------------------------------------------

def occupancy(n_regs: int, shared: int, warps: int) -> int:
    """Programs of `warps` warps that fit on one Hopper SM: 64 warps, 32 programs, 64 Ki registers (allocated per
    warp in units of 256), 227 KiB of shared memory."""
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = (65536 // per_warp) // warps
    by_shared = (227 * 1024) // shared if shared else 32
    return max(1, min(32, 64 // warps, by_regs, by_shared))


def plan(n: int, k: int, warps: int, slots: int, fill_steps: int = 0, max_split: int = 32) -> dict:
    """The split (K segments per row block of 16 * warps rows) whose tiles make the fewest, fullest waves of `slots`
    programs: the least rounds x (segment steps + fill_steps, a tile's pipeline fill), plus 1 for the partial pass;
    grid = min(tiles, slots) (the persistent skeletons loop over the rest)."""
    kb = k // 2
    steps = kb // 128
    row_blocks = triton.cdiv(n, 16 * warps)
    best = None
    for s in range(1, min(steps, max_split) + 1):
        seg = triton.cdiv(steps, s)
        split = triton.cdiv(steps, seg)
        tiles = row_blocks * split
        cost = triton.cdiv(tiles, slots) * (seg + fill_steps) + (1 if split > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, split, seg, tiles)
    _, split, seg, tiles = best
    return {"split": split, "seg": seg * 128, "tiles": tiles, "row_blocks": row_blocks, "slots": slots,
            "grid": min(tiles, slots), "rounds": triton.cdiv(tiles, slots), "waves": tiles / slots}


# name -> (decode mode, table copies, prmt words, warps per program, x prefetched)
CANDIDATES = {
    "s_none": ("none", 1, 0, 4, True),
    "s_none_nx": ("none", 1, 0, 4, False),
    "s_prmt": ("prmt", 1, 0, 4, True),
    "s_prmt_nx": ("prmt", 1, 0, 4, False),
    "s_pair16": ("pair", 16, 0, 4, True),
    "s_pair16_nx": ("pair", 16, 0, 4, False),
    "s_prmt_w2": ("prmt", 1, 0, 2, True),
}
PLANS: dict = {}
_BUFFERS: dict = {}


def buffer(key, make):
    """A scratch tensor kept per key (partial sums, the counters: zeros that the kernels reset)."""
    if key not in _BUFFERS:
        _BUFFERS[key] = make()
    return _BUFFERS[key]


def scratch(split: int, m: int, n: int, device):
    """The split-K skeletons' scratch: float32 partials [split, m, n] and the row blocks' counters (zeros that the
    last program of each row block resets), kept per shape and device."""
    import torch

    part = buffer(("part", split, m, n, device), lambda: torch.empty((split, m, n), dtype=torch.float32,
                                                                     device=device))
    lock = buffer(("lock", device), lambda: torch.zeros(1 << 16, dtype=torch.int32, device=device))
    return part, lock


def linear(x, packed, qs, candidate: str, p: dict | None = None):
    """x @ W^T by a candidate of this skeleton (same contract as experiments.labs.gemv_lut.lab_linear); the plan
    comes from the occupancy of the kernel compiled for it (the first call compiles with split 1)."""
    import torch

    mode, copies, prmt_words, warps, xpre = CANDIDATES[candidate]
    m, k = x.shape
    n = qs.shape[0]
    if m > 16 or k % 256 or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError("lab kernels: M <= 16, K % 256 == 0, blocksize 64, nested absmax")
    key = (candidate, n, k, m, x.dtype, x.device)
    ntile = 1 if m <= 8 else 2
    x_dt = 2 if x.dtype == torch.bfloat16 else 1

    def launch(split, seg, partial):
        grid = triton.cdiv(n, 16 * warps) * split
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        part, lock = scratch(split, m, n, x.device)
        compiled = lab_gemv2_kernel[(grid,)](
            x, packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, K.levels(x.device), out, part, lock,
            m, n, k // 2, split, seg, 1,
            MODE=K.MODES[mode], PRMT_WORDS=prmt_words, COPIES=copies, SHIFT=K.pair_shift(copies), X_DT=x_dt,
            NTILE=ntile, THREADS=32 * warps, FTZ=True, XPRE=xpre and ntile == 1, PARTIAL=partial, num_warps=warps)
        return out, compiled

    if p is None:
        p = PLANS.get(key)
    if p is None:
        _, compiled = launch(1, k // 2, True)  # compiles the split build (one segment: its own last program)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        per_sm = occupancy(compiled.n_regs, compiled.metadata.shared, warps)
        p = plan(n, k, warps, sms * per_sm)
        p.update(registers=compiled.n_regs, per_sm=per_sm, shared=compiled.metadata.shared)
        PLANS[key] = p
    return launch(p["split"], p["seg"], p["split"] > 1)[0]


def plan_of(candidate: str, x, qs) -> dict | None:
    """The plan a skeleton's `linear` used for this candidate, x and weight (after its first call)."""
    return PLANS.get((candidate, qs.shape[0], x.shape[1], x.shape[0], x.dtype, x.device))
