"""The GEMV lab's third skeleton: the weight bytes and absmax bytes stream through shared memory in STAGES-deep
cp.async pipelines, one per thread, and split-K is summed inside the kernel.

Why (H100 probes of 2026-11-27, ncu): the first skeleton's control with no decode (experiments.labs.kernels MODE
4) read its bytes at 1.7-1.8x the floor where cuBLAS's GEMV on as many bf16 bytes took 1.27x; its warps stalled
on long scoreboards with one step (2 KiB a warp) in flight, and L1 ran at 72-81 % of its throughput (register
loads of half sectors, x, absmax bytes and code2 gathers through one cache). Here each thread copies its own
bytes of step i + STAGES - 1 (`cp.async.cg`, 16 bytes, L1 bypassed; its rows' 4 absmax bytes of the step with
`cp.async.ca`, 4 bytes) while it decodes step i, waits on its own copy groups (`cp.async.wait_group`), and reads
them back with `ld.shared` (chunk-major slots: conflict-free): no barrier, as no thread reads another's bytes.
A warp holds STAGES - 1 steps in flight, and no registers.

Lanes, fragments and decodes are the first skeleton's (kernels.py: lane 4g + t, bytes t * 32 .. t * 32 + 31 of
each 128-byte step of rows g and g + 8; MODE 0 prmt table, 1 pair table, 4 the no-decode control).
Measured (results/labs/gemv_skeletons_<gpu>.json): slower than the first skeleton, control and decodes alike.
ncu (H100) put the top stall on the absmax's FMUL: code2[byte] and the state2 scale are loaded where the byte is
read back, so their cache latency is exposed every step; the plans also left a third of the SMs idle (a wave of
448 tiles over 660 slots). Per-thread 16-byte copies still fetch half sectors (L2 sectors 2x the ideal).
PARTIAL (split > 1): float32 partial sums, then the last program of a row block (a counter per row block, after a
fence, a barrier and an acq_rel atomic) adds them in split order, stores the rounded output and resets the counter.
GPU only (inline PTX, sm_80+).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import kernels as K
from .stream import PLANS, _amax, _out, last_program_sums, occupancy, plan_of, scratch  # noqa: F401 (plan_of)
from .stream import plan as stream_plan

STEP = tl.constexpr(128)
CHUNKS = 5  # per thread and stage: 4 x 16 bytes of words (a0-3, a4-7, b0-3, b4-7), then 8 bytes of absmax
_CHUNKS = tl.constexpr(CHUNKS)
SHAPES = ((2, 128), (3, 128), (4, 128), (3, 64), (4, 64), (6, 64))  # (STAGES, THREADS) built here


def declare_asm(stages: int, threads: int) -> str:
    return (f".shared .align 16 .b8 nf4lab_stages[{stages * CHUNKS * threads * 16}]; "
            f"mov.u32 $0, nf4lab_stages;")


ISSUE = tl.constexpr(" ".join([
    "{", ".reg .b32 d;",
    "cp.async.cg.shared.global [$1], [$2], 16;",
    "add.u32 d, $1, $8;", "cp.async.cg.shared.global [d], [$3], 16;",
    "add.u32 d, d, $8;", "cp.async.cg.shared.global [d], [$4], 16;",
    "add.u32 d, d, $8;", "cp.async.cg.shared.global [d], [$5], 16;",
    "add.u32 d, d, $8;", "cp.async.ca.shared.global [d], [$6], 4;",
    "add.u32 d, d, 4;", "cp.async.ca.shared.global [d], [$7], 4;",
    "cp.async.commit_group;", "mov.u32 $0, 0;", "}"]))


def read_asm(pending: int) -> str:
    """$0-$15 the words, $16 $17 the absmax words of the slot at $18 (chunk stride $19), once this thread's copy
    groups but the newest `pending` are complete."""
    return " ".join([
        "{", ".reg .b32 d;", f"cp.async.wait_group {pending};",
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [$18];",
        "add.u32 d, $18, $19;", "ld.shared.v4.u32 {$4, $5, $6, $7}, [d];",
        "add.u32 d, d, $19;", "ld.shared.v4.u32 {$8, $9, $10, $11}, [d];",
        "add.u32 d, d, $19;", "ld.shared.v4.u32 {$12, $13, $14, $15}, [d];",
        "add.u32 d, d, $19;", "ld.shared.v2.u32 {$16, $17}, [d];", "}"])


DECL_2_128 = tl.constexpr(declare_asm(2, 128))
DECL_3_128 = tl.constexpr(declare_asm(3, 128))
DECL_4_128 = tl.constexpr(declare_asm(4, 128))
DECL_3_64 = tl.constexpr(declare_asm(3, 64))
DECL_4_64 = tl.constexpr(declare_asm(4, 64))
DECL_6_64 = tl.constexpr(declare_asm(6, 64))
READ_1 = tl.constexpr(read_asm(1))
READ_2 = tl.constexpr(read_asm(2))
READ_3 = tl.constexpr(read_asm(3))
READ_5 = tl.constexpr(read_asm(5))


@triton.jit
def _declare(i, STAGES: tl.constexpr, THREADS: tl.constexpr):
    if THREADS == 128:
        if STAGES == 2:
            r = tl.inline_asm_elementwise(DECL_2_128, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        elif STAGES == 3:
            r = tl.inline_asm_elementwise(DECL_3_128, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise(DECL_4_128, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    else:
        if STAGES == 3:
            r = tl.inline_asm_elementwise(DECL_3_64, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        elif STAGES == 4:
            r = tl.inline_asm_elementwise(DECL_4_64, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise(DECL_6_64, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    return r


@triton.jit
def _issue(slot, stride, wa, wb, aa, ab, j):
    """Copy this thread's bytes of the step whose lane offset is byte j (words at wa/wb + j // 4, the absmax word
    holding its block at aa/ab + (j // 32) // 4, in words) into `slot`."""
    w0 = wa + j // 4
    w1 = wb + j // 4
    s0 = aa + (j // 32) // 4
    s1 = ab + (j // 32) // 4
    return tl.inline_asm_elementwise(ISSUE, "=r,r,l,l,l,l,l,l,r", [slot, w0, w0 + 4, w1, w1 + 4, s0, s1, stride],
                                     dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _read(slot, stride, STAGES: tl.constexpr):
    if STAGES == 2:
        r = tl.inline_asm_elementwise(READ_1, "=r," * 18 + "r,r", [slot, stride], dtype=(tl.uint32,) * 18,
                                      is_pure=False, pack=1)
    elif STAGES == 3:
        r = tl.inline_asm_elementwise(READ_2, "=r," * 18 + "r,r", [slot, stride], dtype=(tl.uint32,) * 18,
                                      is_pure=False, pack=1)
    elif STAGES == 4:
        r = tl.inline_asm_elementwise(READ_3, "=r," * 18 + "r,r", [slot, stride], dtype=(tl.uint32,) * 18,
                                      is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(READ_5, "=r," * 18 + "r,r", [slot, stride], dtype=(tl.uint32,) * 18,
                                      is_pure=False, pack=1)
    return r


@triton.jit(do_not_specialize=["M", "N", "KB", "SPLIT", "SEG", "ONE"])
def lab_staged_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, KB, SPLIT, SEG, ONE,
    MODE: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr,
    THREADS: tl.constexpr, STAGES: tl.constexpr, FTZ: tl.constexpr, PARTIAL: tl.constexpr,
):
    """x @ W^T for M <= 16; program p: row block p // SPLIT (THREADS // 2 rows), K segment p % SPLIT (SEG bytes
    of a row, a multiple of 128). Blocksize 64, nested absmax, KB = K / 2 a multiple of 128."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    am_ptr = absmax_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    one = (i * 0 + ONE).to(tl.uint32)
    base, m0, m1, m2, m3, m4, m5 = K.pair_setup(code_ptr, lane, one, MODE, COPIES, SHIFT, THREADS)
    m6, m7 = one, one
    stages = _declare(i, STAGES, THREADS)
    stride = (one * 0 + THREADS * 16).to(tl.uint32)  # bytes between a thread's chunks
    mine = stages + (i * 16).to(tl.uint32)  # this thread's chunk 0 of stage 0
    slot_bytes = _CHUNKS * THREADS * 16
    pid = tl.program_id(0)
    rblk = pid // SPLIT
    pid_k = pid % SPLIT
    row_a = rblk * (THREADS // 2) + (i // 32) * 16 + g
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)
    rb = tl.minimum(row_b, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    aa = am_ptr + ra * (KB // 128)  # the row's absmax bytes as words (KB // 32 bytes a row, a multiple of 4)
    ab = am_ptr + rb * (KB // 128)
    ba = ra * (KB // 32)  # the row's first absmax block
    bb = rb * (KB // 32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    offset = tl.load(offset_ptr)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    keep = one * 0
    for s in tl.static_range(STAGES - 1):
        keep |= _issue(mine + s * slot_bytes, stride, wa, wb, aa, ab, tl.minimum(first + s * STEP, end - STEP) + t * 32)
    it = 0
    for c0 in range(first, end, STEP):
        nxt = tl.minimum(c0 + (STAGES - 1) * STEP, end - STEP) + t * 32  # past the segment: re-reads its last step
        keep |= _issue(mine + ((it + STAGES - 1) % STAGES) * slot_bytes, stride, wa, wb, aa, ab, nxt)
        (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, qa, qb) = _read(
            mine + (it % STAGES) * slot_bytes + keep, stride, STAGES)
        it += 1
        j = c0 + t * 32
        blk = (c0 // 32) + t
        amax_a = _amax((qa >> (8 * t).to(tl.uint32)) & 255, tl.load(absmax2_ptr + (ba + blk) // 256), code2_ptr,
                       offset, FTZ)
        amax_b = _amax((qb >> (8 * t).to(tl.uint32)) & 255, tl.load(absmax2_ptr + (bb + blk) // 256), code2_ptr,
                       offset, FTZ)
        ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = one, one, one, one, one, one, one, one
        tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = one, one, one, one, one, one, one, one
        if MODE == 0:
            ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = K.product_table(amax_a, FTZ, X_DT)
            tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = K.product_table(amax_b, FTZ, X_DT)
        xp0, xp1 = xr0 + j, xr1 + j
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a0, b0, 0, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a1, b1, 1, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a2, b2, 2, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a3, b3, 3, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a4, b4, 4, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a5, b5, 5, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a6, b6, 6, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._word(
            a7, b7, 7, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE)
    _out(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL, X_DT)
    if NTILE == 2:
        _out(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL,
             X_DT)
    if PARTIAL:
        last_program_sums(i, lock_ptr, rblk, SPLIT, out_ptr, part_ptr, row_a, row_b, t, M, N, X_DT, NTILE)


# --- host side ------------------------------------------------------------------------------------------------

def plan(n: int, k: int, warps: int, slots: int, fill_steps: int = 4, max_split: int = 32) -> dict:
    """stream.plan with this skeleton's pipeline fill (4 steps a tile)."""
    return stream_plan(n, k, warps, slots, fill_steps, max_split)


# name -> (decode mode, table copies, warps per program, stages)
CANDIDATES = {
    "c_none3": ("none", 1, 4, 3),
    "c_none4": ("none", 1, 4, 4),
    "c_none6w2": ("none", 1, 2, 6),
    "c_prmt3": ("prmt", 1, 4, 3),
    "c_prmt4": ("prmt", 1, 4, 4),
    "c_prmt4w2": ("prmt", 1, 2, 4),
    "c_pair3w2": ("pair", 16, 2, 3),  # static shared memory stays under 48 KiB: 15 KiB of stages + 32 KiB of table
    "c_pair8_3w2": ("pair", 8, 2, 3),
    "c_pair8_4": ("pair", 8, 4, 3),
}


def linear(x, packed, qs, candidate: str):
    """x @ W^T by a candidate of this skeleton (the contract of experiments.labs.gemv_lut.lab_linear)."""
    import torch

    mode, copies, warps, stages = CANDIDATES[candidate]
    m, k = x.shape
    n = qs.shape[0]
    if m > 16 or k % 256 or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError("lab kernels: M <= 16, K % 256 == 0, blocksize 64, nested absmax")
    key = (candidate, n, k, m, x.dtype, x.device)
    x_dt = 2 if x.dtype == torch.bfloat16 else 1

    def launch(split, seg, partial):
        grid = triton.cdiv(n, 16 * warps) * split
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        part, lock = scratch(split, m, n, x.device)
        compiled = lab_staged_kernel[(grid,)](
            x, packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, K.levels(x.device), out, part, lock,
            m, n, k // 2, split, seg, 1,
            MODE=K.MODES[mode], COPIES=copies, SHIFT=K.pair_shift(copies), X_DT=x_dt, NTILE=1 if m <= 8 else 2,
            THREADS=32 * warps, STAGES=stages, FTZ=True, PARTIAL=partial, num_warps=warps)
        return out, compiled

    p = PLANS.get(key)
    if p is None:
        _, compiled = launch(1, k // 2, True)  # compiles the split build (one segment: its own last program)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        shared = stages * CHUNKS * 32 * warps * 16 + (256 * 8 * copies if mode == "pair" else 0)  # .shared in asm
        per_sm = occupancy(compiled.n_regs, shared + 1024, warps)  # + the driver's 1 KiB a block
        p = plan(n, k, warps, sms * per_sm)
        p.update(registers=compiled.n_regs, per_sm=per_sm, shared=shared)
        PLANS[key] = p
    return launch(p["split"], p["seg"], p["split"] > 1)[0]
