"""The GEMV lab's fourth skeleton: the first skeleton with two steps of weight bytes in flight per thread, the
absmax chain a step ahead of its use, whole-sector loads, split-K summed in the kernel, and persistent programs
sized by the compiled kernel's occupancy.

Why (H100 and H200 probes of 2026-11-27, results/labs/gemv_skeletons_<gpu>.json): the first skeleton's control with
no decode (kernels.py MODE 4) stays well above cuBLAS's GEMV on as many bf16 bytes, and its warps stall on long
scoreboards. Each thread of it holds one step (64 bytes) in flight; ncu counted the absmax's code2 gather, issued in
the iteration that requested the absmax byte, as the single largest stall (the gather waits for the byte's DRAM
latency in the same iteration). Here, per thread and iteration: the words, absmax bytes and state2 scales of step
i + 2 are requested; the code2 gathers of step i + 1 (whose bytes were requested an iteration ago) are issued; step
i is decoded with the absmax made an iteration ago. No load waits on a load of the same iteration.

Lanes and fragments as in kernels.py, with kernels.py's FULLSEC byte layout (lane t of a row reads bytes 16t.. and
64 + 16t.. of each 128-byte step: the 4 lanes of a row read 64 contiguous bytes per load, whole sectors; words 0-3
of a lane are in block t // 2 of the step, words 4-7 in block 2 + t // 2). Decodes: MODE 1 (pair table; the absmax
is an operand of each word's multiply, so two blocks per lane cost two absmax, nothing else) and 4 (no decode, the
control). PARTIAL: the last program of a row block (stream.py's counter) sums the partials in split order.
GPU only (inline PTX, sm_80+).

Measured (results/labs/gemv_skeletons_<gpu>.json): no faster than the first skeleton with whole-sector loads, the
control included. With ~106-128 registers only 16-18 warps fit an SM, so twice the bytes per warp is about the same
bytes per SM in flight as the first skeleton's 28 warps; ncu still puts the top stalls on long scoreboards (the
absmax bytes and the words). What cuBLAS's GEMV does differently (nvjet, same run): 132 programs, a TMA pipeline
of ~160 KiB of shared memory per SM, kilobytes of each row in flight; no register file can hold that.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nf4.device import load_v4, mul

from . import kernels as K
from .stream import PLANS, _out, last_program_sums, occupancy, plan_of, scratch  # noqa: F401 (plan_of)
from .stream import plan as stream_plan

STEP = tl.constexpr(128)


@triton.jit
def _words(wa, wb, c, t):
    """Step c's 16 words of this lane (rows a, b): bytes c + 16t.. and c + 64 + 16t.. of each row."""
    j0 = c + 16 * t
    a0, a1, a2, a3 = load_v4(wa + j0 // 4, True)
    a4, a5, a6, a7 = load_v4(wa + j0 // 4 + 16, True)
    b0, b1, b2, b3 = load_v4(wb + j0 // 4, True)
    b4, b5, b6, b7 = load_v4(wb + j0 // 4 + 16, True)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def _bytes(ba, bb, c, t, absmax_ptr, absmax2_ptr):
    """Step c's absmax bytes of this lane's two blocks per row, and their state2 scales."""
    k0 = (c + 16 * t) // 32
    k1 = k0 + 2
    qa0 = tl.load(absmax_ptr + ba + k0)
    qa1 = tl.load(absmax_ptr + ba + k1)
    qb0 = tl.load(absmax_ptr + bb + k0)
    qb1 = tl.load(absmax_ptr + bb + k1)
    sa0 = tl.load(absmax2_ptr + (ba + k0) // 256, eviction_policy="evict_last")
    sa1 = tl.load(absmax2_ptr + (ba + k1) // 256, eviction_policy="evict_last")
    sb0 = tl.load(absmax2_ptr + (bb + k0) // 256, eviction_policy="evict_last")
    sb1 = tl.load(absmax2_ptr + (bb + k1) // 256, eviction_policy="evict_last")
    return qa0, qa1, qb0, qb1, sa0, sa1, sb0, sb1


@triton.jit
def _amax4(qa0, qa1, qb0, qb1, sa0, sa1, sb0, sb1, code2_ptr, offset, FTZ: tl.constexpr):
    return (_scale(_level(qa0, code2_ptr), sa0, offset, FTZ), _scale(_level(qa1, code2_ptr), sa1, offset, FTZ),
            _scale(_level(qb0, code2_ptr), sb0, offset, FTZ), _scale(_level(qb1, code2_ptr), sb1, offset, FTZ))


@triton.jit
def _decode(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a0, amax_a1, amax_b0, amax_b1,
            c0, t, xr0, xr1, base, m0, m1, m2, m3, m4, m5, one,
            c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
            MODE: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr):
    """One step's 8 words per row into the accumulators (x's pairs at the words' bytes)."""
    xp0 = xr0 + c0 + 16 * t
    xp1 = xr1 + c0 + 16 * t
    xh0 = xp0 + 48
    xh1 = xp1 + 48
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a0, b0, 0, xp0, xp1, base, amax_a0, amax_b0, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a1, b1, 1, xp0, xp1, base, amax_a0, amax_b0, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a2, b2, 2, xp0, xp1, base, amax_a0, amax_b0, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a3, b3, 3, xp0, xp1, base, amax_a0, amax_b0, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a4, b4, 4, xh0, xh1, base, amax_a1, amax_b1, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a5, b5, 5, xh0, xh1, base, amax_a1, amax_b1, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a6, b6, 6, xh0, xh1, base, amax_a1, amax_b1, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
        a7, b7, 7, xh0, xh1, base, amax_a1, amax_b1, one, one, one, one, one, one, one, one, one, one, one, one, one,
        one, one, one, m0, m1, m2, m3, m4, m5, one, one, one, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12,
        c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    return c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17


@triton.jit
def _level(q, code2_ptr):
    return tl.load(code2_ptr + q.to(tl.int32), eviction_policy="evict_last")


@triton.jit
def _scale(level, s, offset, FTZ: tl.constexpr):
    """bitsandbytes' nested absmax: the product rounded once, then the offset added (two roundings)."""
    return mul(level, s, FTZ, True) + offset


@triton.jit(do_not_specialize=["M", "N", "KB", "SPLIT", "SEG", "TILES", "ONE"])
def lab_deep_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, KB, SPLIT, SEG, TILES, ONE,
    MODE: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr,
    THREADS: tl.constexpr, FTZ: tl.constexpr, PARTIAL: tl.constexpr,
):
    """x @ W^T for M <= 16; tiles t = pid, pid + P, ...: row block t // SPLIT (THREADS // 2 rows), K segment
    t % SPLIT (SEG bytes of a row, a multiple of 128; no segment empty). Blocksize 64, nested
    absmax, KB = K / 2 a multiple of 128."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    one = (i * 0 + ONE).to(tl.uint32)
    base, m0, m1, m2, m3, m4, m5 = K.pair_setup(code_ptr, lane, one, MODE, COPIES, SHIFT, THREADS)
    offset = tl.load(offset_ptr)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    for tile in range(tl.program_id(0), TILES, tl.num_programs(0)):
        rblk = tile // SPLIT
        pid_k = tile % SPLIT
        row_a = rblk * (THREADS // 2) + (i // 32) * 16 + g
        row_b = row_a + 8
        ra = tl.minimum(row_a, N - 1)
        rb = tl.minimum(row_b, N - 1)
        wa = words_ptr + ra * KW
        wb = words_ptr + rb * KW
        ba = ra * (KB // 32)
        bb = rb * (KB // 32)
        first = pid_k * SEG
        end = tl.minimum(first + SEG, KB)
        last = end - STEP
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (
            zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
        # Even steps in set A (words wA*, absmax mA*), odd steps in set B; the loop is unrolled by two so that no
        # in-flight register is ever copied (a copy would wait for its load). Iteration k, half A: the absmax of
        # step 2k + 1 from bytes requested an iteration ago, the bytes of step 2k + 3 requested, step 2k decoded,
        # the words of step 2k + 2 requested into the registers step 2k just freed; half B the same, shifted.
        nsteps = (end - first) // STEP
        (wa0, wa1, wa2, wa3, wa4, wa5, wa6, wa7, wb0, wb1, wb2, wb3, wb4, wb5, wb6, wb7) = _words(wa, wb, first, t)
        qa0, qa1, qb0, qb1, sa0, sa1, sb0, sb1 = _bytes(ba, bb, first, t, absmax_ptr, absmax2_ptr)
        mA0, mA1, mA2, mA3 = _amax4(qa0, qa1, qb0, qb1, sa0, sa1, sb0, sb1, code2_ptr, offset, FTZ)
        (va0, va1, va2, va3, va4, va5, va6, va7, vb0, vb1, vb2, vb3, vb4, vb5, vb6, vb7) = _words(
            wa, wb, tl.minimum(first + STEP, last), t)
        (qB0, qB1, qB2, qB3, sB0, sB1, sB2, sB3) = _bytes(ba, bb, tl.minimum(first + STEP, last), t, absmax_ptr,
                                                          absmax2_ptr)
        (qA0, qA1, qA2, qA3, sA0, sA1, sA2, sA3) = _bytes(ba, bb, tl.minimum(first + 2 * STEP, last), t,
                                                          absmax_ptr, absmax2_ptr)
        for k in range(0, (nsteps + 1) // 2):
            c0 = first + 2 * k * STEP
            # half A
            mB0, mB1, mB2, mB3 = _amax4(qB0, qB1, qB2, qB3, sB0, sB1, sB2, sB3, code2_ptr, offset, FTZ)
            (qB0, qB1, qB2, qB3, sB0, sB1, sB2, sB3) = _bytes(ba, bb, tl.minimum(c0 + 3 * STEP, last), t,
                                                              absmax_ptr, absmax2_ptr)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _decode(
                wa0, wa1, wa2, wa3, wa4, wa5, wa6, wa7, wb0, wb1, wb2, wb3, wb4, wb5, wb6, wb7, mA0, mA1, mA2, mA3,
                c0, t, xr0, xr1, base, m0, m1, m2, m3, m4, m5, one,
                c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, MODE, X_DT, NTILE)
            (wa0, wa1, wa2, wa3, wa4, wa5, wa6, wa7, wb0, wb1, wb2, wb3, wb4, wb5, wb6, wb7) = _words(
                wa, wb, tl.minimum(c0 + 2 * STEP, last), t)
            # half B (absent past an odd segment's last step)
            if 2 * k + 1 < nsteps:
                mA0, mA1, mA2, mA3 = _amax4(qA0, qA1, qA2, qA3, sA0, sA1, sA2, sA3, code2_ptr, offset, FTZ)
                (qA0, qA1, qA2, qA3, sA0, sA1, sA2, sA3) = _bytes(ba, bb, tl.minimum(c0 + 4 * STEP, last), t,
                                                                  absmax_ptr, absmax2_ptr)
                (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _decode(
                    va0, va1, va2, va3, va4, va5, va6, va7, vb0, vb1, vb2, vb3, vb4, vb5, vb6, vb7, mB0, mB1, mB2,
                    mB3, c0 + STEP, t, xr0, xr1, base, m0, m1, m2, m3, m4, m5, one,
                    c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, MODE, X_DT,
                    NTILE)
                (va0, va1, va2, va3, va4, va5, va6, va7, vb0, vb1, vb2, vb3, vb4, vb5, vb6, vb7) = _words(
                    wa, wb, tl.minimum(c0 + 3 * STEP, last), t)
        _out(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL,
             X_DT)
        if NTILE == 2:
            _out(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k,
                 PARTIAL, X_DT)
        if PARTIAL:
            last_program_sums(i, lock_ptr, rblk, SPLIT, out_ptr, part_ptr, row_a, row_b, t, M, N, X_DT, NTILE)
            tl.debug_barrier()  # the next tile's partial stores wait for this tile's readers


# --- host side ------------------------------------------------------------------------------------------------

def plan(n: int, k: int, warps: int, slots: int, fill_steps: int = 3, max_split: int = 32) -> dict:
    """stream.plan with this skeleton's pipeline fill (3 steps a tile)."""
    return stream_plan(n, k, warps, slots, fill_steps, max_split)


# name -> (decode mode, table copies, warps per program)
CANDIDATES = {
    "d_none": ("none", 1, 4),
    "d_none_w2": ("none", 1, 2),
    "d_pair16": ("pair", 16, 4),
    "d_pair16_w8": ("pair", 16, 8),
}


def linear(x, packed, qs, candidate: str):
    """x @ W^T by a candidate of this skeleton (the contract of experiments.labs.gemv_lut.lab_linear)."""
    import torch

    mode, copies, warps = CANDIDATES[candidate]
    m, k = x.shape
    n = qs.shape[0]
    if m > 16 or k % 256 or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError("lab kernels: M <= 16, K % 256 == 0, blocksize 64, nested absmax")
    key = (candidate, n, k, m, x.dtype, x.device)
    x_dt = 2 if x.dtype == torch.bfloat16 else 1

    def launch(p):
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        split = p["split"]
        part, lock = scratch(split, m, n, x.device)
        compiled = lab_deep_kernel[(p["grid"],)](
            x, packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, K.levels(x.device), out, part, lock,
            m, n, k // 2, split, p["seg"], p["tiles"], 1,
            MODE=K.MODES[mode], COPIES=copies, SHIFT=K.pair_shift(copies), X_DT=x_dt, NTILE=1 if m <= 8 else 2,
            THREADS=32 * warps, FTZ=True, PARTIAL=split > 1, num_warps=warps)
        return out, compiled

    p = PLANS.get(key)
    if p is None:
        rows, kb = triton.cdiv(n, 16 * warps), k // 2
        seg = max(128, (kb // 2) // 128 * 128)  # two segments where the row has two steps: the split build
        first = {"split": triton.cdiv(kb, seg), "seg": seg, "tiles": rows * triton.cdiv(kb, seg)}
        _, compiled = launch({**first, "grid": first["tiles"]})
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        shared = 256 * 8 * copies if mode == "pair" else 0  # the table, declared in asm
        per_sm = occupancy(compiled.n_regs, shared + 1024, warps)
        p = plan(n, k, warps, sms * per_sm)
        p.update(registers=compiled.n_regs, per_sm=per_sm, shared=shared)
        PLANS[key] = p
    return launch(p)[0]
