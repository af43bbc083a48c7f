"""The GEMV lab's fourth skeleton: each warp streams its 16 rows through shared memory with Hopper bulk copies
(`cp.async.bulk`, the TMA engine) and mbarriers, STAGES stages deep, and split-K is summed inside the kernel.

Why: the first skeleton's no-decode control stayed at 1.24-1.76x the same-bytes cuBLAS GEMV (H100 and H200,
results/labs/gemv_skeletons_<gpu>.json); ncu showed its warps waiting on long scoreboards with one step of
register loads in flight, and cuBLAS's GEMV keeping ~164 KiB of each SM's shared memory in flight through TMA.
Register-held prefetch (`deep.py`) and per-thread cp.async stages (`staged.py`) did not close the gap. Here the
bytes in flight do not live in registers or per-thread copy groups: lanes 0-15 of a warp each issue one bulk
copy of their row's next SB = 128 * SPS bytes (whole 128-byte lines) into the warp's stage, lane 0 arms the
stage's mbarrier with the 16 * SB bytes to expect, and the warp waits on the barrier's phase before reading the
stage with `ld.shared.v4`. A warp owns its stages and barriers: no block-wide barrier in the loop.

Shared memory, per warp: STAGES stages of 16 rows, SB + 16 bytes a row (the 16 bytes of padding put rows g and
g + 1 in different banks: lane 4g + t's two 16-byte reads at row g, bytes 32t and 32t + 16, are conflict-free in
each quarter warp). Static `.shared` (declared in inline PTX, like staged.py) stays under 48 KiB a program.

Lanes, fragments and decodes are the first skeleton's (kernels.py: lane 4g + t takes bytes 32t .. 32t + 31 of
each 128-byte step of rows g and g + 8, one absmax block of each; MODE 0 prmt table, 1 pair table, 4 the
no-decode control). The absmax bytes and their state2 scales of the next stage are loaded (registers) while this
stage is decoded; code2[byte] is gathered where the stage is decoded.
Grid: (row blocks) x (K segments), one tile a program; PARTIAL (split > 1) as staged.py (the last program of a
row block adds the partials in split order). GPU only (inline PTX, sm_90: bulk copies and mbarrier tx counts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import kernels as K
from .stream import PLANS, _amax, _out, last_program_sums, occupancy, plan_of, scratch  # noqa: F401 (plan_of)
from .stream import plan as stream_plan

STEP = tl.constexpr(128)
PAD = 16  # bytes after each row of a stage (bank spread), per-row copies only
# (STAGES, warps, steps per stage, tensor copies) built here; index = the kernel's SHAPE argument
SHAPES = ((4, 2, 2, False), (3, 2, 2, False), (4, 4, 1, False), (6, 2, 1, False), (8, 2, 1, False),
          (3, 4, 1, False), (8, 2, 1, True), (10, 2, 1, True), (5, 4, 1, True), (4, 2, 2, True), (16, 1, 1, True),
          (6, 2, 1, True))


def stage_bytes(sps: int, tensor: bool) -> int:
    """A warp's stage: 16 rows of 128 * sps bytes, padded rows (per-row copies) or sps dense 16 x 128 boxes."""
    return 16 * 128 * sps if tensor else 16 * (128 * sps + PAD)


def shared_bytes(stages: int, warps: int, sps: int, tensor: bool) -> int:
    return warps * stages * stage_bytes(sps, tensor) + warps * stages * 8


def declare_asm(stages: int, warps: int, sps: int, tensor: bool) -> str:
    """$0: the stages' base, $1: the barriers' base (shared addresses); STAGES barriers a warp. 1024-byte alignment:
    the 128-byte swizzle of the tensor copies XORs address bits 4-6 with bits 7-9."""
    return (f".shared .align 1024 .b8 nf4bulk_buf[{warps * stages * stage_bytes(sps, tensor)}]; "
            f".shared .align 8 .b64 nf4bulk_bar[{warps * stages}]; "
            "mov.u32 $0, nf4bulk_buf; mov.u32 $1, nf4bulk_bar;")


def init_asm(stages: int) -> str:
    """Lane 0 ($1 == 0) initialises the warp's STAGES barriers at $2, $2 + 8, ... (one arrival a phase)."""
    lines = ["{", ".reg .pred p;", ".reg .b32 a;", "setp.eq.u32 p, $1, 0;", "mov.u32 a, $2;"]
    for s in range(stages):
        lines.append("@p mbarrier.init.shared::cta.b64 [a], 1;")
        if s + 1 < stages:
            lines.append("add.u32 a, a, 8;")
    lines += ["fence.mbarrier_init.release.cluster;", "mov.u32 $0, 0;", "}"]
    return " ".join(lines)


def issue_asm(sps: int) -> str:
    """If $2 != 0: lane 0 ($1) arms barrier $3 with 16 rows x SB bytes, and lanes 0-15 copy SB bytes of their row
    from global $5 to shared $4, completing on barrier $3."""
    sb = 128 * sps
    return " ".join([
        "{", ".reg .pred p, q;",
        "setp.ne.u32 q, $2, 0;",
        "setp.eq.and.u32 p, $1, 0, q;",
        "setp.lt.and.u32 q, $1, 16, q;",
        "fence.proxy.async.shared::cta;",
        f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$3], {16 * sb};",
        f"@q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$4], [$5], {sb}, [$3];",
        "mov.u32 $0, 0;", "}"])


def tensor_issue_asm(sps: int) -> str:
    """If $2 != 0: lane 0 ($1) arms barrier $3 with sps boxes of 16 rows x 128 bytes and copies them with the tensor
    map at global $5 (rows $7.., bytes $6.. of each row) to shared $4, $4 + 2048, ..."""
    lines = ["{", ".reg .pred p;", ".reg .b32 d, k;", "setp.ne.u32 p, $2, 0;", "setp.eq.and.u32 p, $1, 0, p;",
             "fence.proxy.async.shared::cta;",
             f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$3], {2048 * sps};", "mov.u32 d, $4;", "mov.u32 k, $6;"]
    for q in range(sps):
        lines.append("@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[d], [$5, {k, $7}], [$3];")
        if q + 1 < sps:
            lines += ["add.u32 d, d, 2048;", "add.u32 k, k, 128;"]
    return " ".join([*lines, "mov.u32 $0, 0;", "}"])


WAIT = tl.constexpr(" ".join([
    "{", ".reg .pred p;", "NF4_WAIT:", "mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;", "@!p bra NF4_WAIT;",
    "mov.u32 $0, 0;", "}"]))
READ = tl.constexpr(" ".join([
    "ld.shared.v4.u32 {$0, $1, $2, $3}, [$16];", "ld.shared.v4.u32 {$4, $5, $6, $7}, [$16+16];",
    "ld.shared.v4.u32 {$8, $9, $10, $11}, [$17];", "ld.shared.v4.u32 {$12, $13, $14, $15}, [$17+16];"]))
# the tensor copies' 128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8); $16: row a's chunk 2t ^ g
READ_SW = tl.constexpr(" ".join([
    "{", ".reg .b32 a1, b0, b1;", "xor.b32 a1, $16, 16;", "add.u32 b0, $16, 1024;", "xor.b32 b1, b0, 16;",
    "ld.shared.v4.u32 {$0, $1, $2, $3}, [$16];", "ld.shared.v4.u32 {$4, $5, $6, $7}, [a1];",
    "ld.shared.v4.u32 {$8, $9, $10, $11}, [b0];", "ld.shared.v4.u32 {$12, $13, $14, $15}, [b1];", "}"]))
TISSUE_1 = tl.constexpr(tensor_issue_asm(1))
TISSUE_2 = tl.constexpr(tensor_issue_asm(2))
ISSUE_1 = tl.constexpr(issue_asm(1))
ISSUE_2 = tl.constexpr(issue_asm(2))
INIT_3 = tl.constexpr(init_asm(3))
INIT_4 = tl.constexpr(init_asm(4))
INIT_6 = tl.constexpr(init_asm(6))
INIT_8 = tl.constexpr(init_asm(8))
INIT_5 = tl.constexpr(init_asm(5))
INIT_10 = tl.constexpr(init_asm(10))
INIT_16 = tl.constexpr(init_asm(16))
DECL_0 = tl.constexpr(declare_asm(*SHAPES[0]))
DECL_1 = tl.constexpr(declare_asm(*SHAPES[1]))
DECL_2 = tl.constexpr(declare_asm(*SHAPES[2]))
DECL_3 = tl.constexpr(declare_asm(*SHAPES[3]))
DECL_4 = tl.constexpr(declare_asm(*SHAPES[4]))
DECL_5 = tl.constexpr(declare_asm(*SHAPES[5]))
DECL_6 = tl.constexpr(declare_asm(*SHAPES[6]))
DECL_7 = tl.constexpr(declare_asm(*SHAPES[7]))
DECL_8 = tl.constexpr(declare_asm(*SHAPES[8]))
DECL_9 = tl.constexpr(declare_asm(*SHAPES[9]))
DECL_10 = tl.constexpr(declare_asm(*SHAPES[10]))
DECL_11 = tl.constexpr(declare_asm(*SHAPES[11]))


@triton.jit
def _declare(i, SHAPE: tl.constexpr):
    if SHAPE == 0:
        r = tl.inline_asm_elementwise(DECL_0, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 1:
        r = tl.inline_asm_elementwise(DECL_1, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 2:
        r = tl.inline_asm_elementwise(DECL_2, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 3:
        r = tl.inline_asm_elementwise(DECL_3, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 4:
        r = tl.inline_asm_elementwise(DECL_4, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 5:
        r = tl.inline_asm_elementwise(DECL_5, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 6:
        r = tl.inline_asm_elementwise(DECL_6, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 7:
        r = tl.inline_asm_elementwise(DECL_7, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 8:
        r = tl.inline_asm_elementwise(DECL_8, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 9:
        r = tl.inline_asm_elementwise(DECL_9, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    elif SHAPE == 10:
        r = tl.inline_asm_elementwise(DECL_10, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(DECL_11, "=r,=r,r", [i], dtype=(tl.uint32, tl.uint32), is_pure=False, pack=1)
    return r


@triton.jit
def _init(lane, bar, STAGES: tl.constexpr):
    if STAGES == 3:
        r = tl.inline_asm_elementwise(INIT_3, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    elif STAGES == 4:
        r = tl.inline_asm_elementwise(INIT_4, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    elif STAGES == 6:
        r = tl.inline_asm_elementwise(INIT_6, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    elif STAGES == 8:
        r = tl.inline_asm_elementwise(INIT_8, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    elif STAGES == 5:
        r = tl.inline_asm_elementwise(INIT_5, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    elif STAGES == 10:
        r = tl.inline_asm_elementwise(INIT_10, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(INIT_16, "=r,r,r", [lane, bar], dtype=tl.uint32, is_pure=False, pack=1)
    return r


@triton.jit
def _issue(lane, go, bar, dst, src, SPS: tl.constexpr):
    if SPS == 1:
        r = tl.inline_asm_elementwise(ISSUE_1, "=r,r,r,r,r,l", [lane, go, bar, dst, src], dtype=tl.uint32,
                                      is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(ISSUE_2, "=r,r,r,r,r,l", [lane, go, bar, dst, src], dtype=tl.uint32,
                                      is_pure=False, pack=1)
    return r


@triton.jit
def _tissue(lane, go, bar, dst, tmap, kb, row, SPS: tl.constexpr):
    if SPS == 1:
        r = tl.inline_asm_elementwise(TISSUE_1, "=r,r,r,r,r,l,r,r", [lane, go, bar, dst, tmap, kb, row],
                                      dtype=tl.uint32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(TISSUE_2, "=r,r,r,r,r,l,r,r", [lane, go, bar, dst, tmap, kb, row],
                                      dtype=tl.uint32, is_pure=False, pack=1)
    return r


@triton.jit
def _wait(bar, parity):
    return tl.inline_asm_elementwise(WAIT, "=r,r,r", [bar, parity], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _read(addr_a, addr_b, TENSOR: tl.constexpr):
    if TENSOR:
        r = tl.inline_asm_elementwise(READ_SW, "=r," * 16 + "r,r", [addr_a, addr_b], dtype=(tl.uint32,) * 16,
                                      is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(READ, "=r," * 16 + "r,r", [addr_a, addr_b], dtype=(tl.uint32,) * 16,
                                      is_pure=False, pack=1)
    return r


@triton.jit
def _step(wa8, wb8, j, amax_a, amax_b, base, xr0, xr1, one, m0, m1, m2, m3, m4, m5,
          c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
          MODE: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr, FTZ: tl.constexpr, TENSOR: tl.constexpr,
          xok0, xok1, XPRED: tl.constexpr):
    """One 128-byte step: the lane's 8 words of rows a and b (wa8 / wb8: 16 words, read at shared addresses) against
    x's pairs at byte j of the row."""
    (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7) = _read(wa8, wb8, TENSOR)
    if MODE == 5 or MODE == 6:  # the stream controls: the words read and folded (6: with the absmax chain)
        f = a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ b0 ^ b1 ^ b2 ^ b3 ^ b4 ^ b5 ^ b6 ^ b7
        c00 = c00 + f.to(tl.float32)
        if MODE == 6:
            c01 = c01 + amax_a + amax_b
    else:
        ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = one, one, one, one, one, one, one, one
        tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = one, one, one, one, one, one, one, one
        if MODE == 0:
            ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = K.product_table(amax_a, FTZ, X_DT)
            tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = K.product_table(amax_b, FTZ, X_DT)
        m6, m7 = one, one
        xp0, xp1 = xr0 + j, xr1 + j
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a0, b0, 0, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a1, b1, 1, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a2, b2, 2, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a3, b3, 3, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a4, b4, 4, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a5, b5, 5, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a6, b6, 6, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = K._wordx(
            a7, b7, 7, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
            tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
            c11, c12, c13, c14, c15, c16, c17, MODE, 0, X_DT, NTILE, xok0, xok1, XPRED)
    return c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17


@triton.jit
def _raw(absmax_ptr, absmax2_ptr, ba, bb, blk, MODE: tl.constexpr):
    """The absmax bytes (as int32) of the lane's blocks at block offset blk of rows a and b, and their scales (MODE
    5: none loaded)."""
    if MODE == 5:
        return blk * 0, blk * 0, (blk * 0).to(tl.float32), (blk * 0).to(tl.float32)
    qa = tl.load(absmax_ptr + ba + blk).to(tl.int32)
    qb = tl.load(absmax_ptr + bb + blk).to(tl.int32)
    sa = tl.load(absmax2_ptr + (ba + blk) // 256, eviction_policy="evict_last")
    sb = tl.load(absmax2_ptr + (bb + blk) // 256, eviction_policy="evict_last")
    return qa, qb, sa, sb


@triton.jit
def _amax5(q, s, code2_ptr, offset, FTZ: tl.constexpr, MODE: tl.constexpr):
    if MODE == 5:
        r = s
    else:
        r = _amax(q, s, code2_ptr, offset, FTZ)
    return r


@triton.jit(do_not_specialize=["M", "N", "KB", "SPLIT", "SEG", "ONE"])
def lab_bulk_kernel(
    x_ptr, packed_ptr, tmap_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, KB, SPLIT, SEG, ONE,
    MODE: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr,
    THREADS: tl.constexpr, SHAPE: tl.constexpr, STAGES: tl.constexpr, SPS: tl.constexpr, TENSOR: tl.constexpr,
    FTZ: tl.constexpr, PARTIAL: tl.constexpr, NOX: tl.constexpr, XPRED: tl.constexpr,
):
    """x @ W^T for M <= 16; program p: row block p // SPLIT (THREADS // 2 rows), K segment p % SPLIT (SEG bytes of
    a row, a multiple of 128 * SPS). Blocksize 64, nested absmax, KB = K / 2 a multiple of 128 * SPS.
    TENSOR: lane 0 copies the warp's 16 rows with the tensor map at tmap_ptr (boxes of 16 rows x 128 bytes, 128-byte
    swizzle); else lanes 0-15 copy a row each (cp.async.bulk). NOX (a control): x's words of the first step stand in
    for every step's (loop-invariant loads). MODE 5 / 6: the stream controls (bytes only / bytes and absmax)."""
    SB: tl.constexpr = 128 * SPS
    RS: tl.constexpr = 128 * SPS + 16
    STAGE_BYTES: tl.constexpr = 2048 * SPS if TENSOR else 16 * (128 * SPS + 16)
    QSTEP: tl.constexpr = 2048 if TENSOR else 128  # shared bytes between a stage's steps
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    i = tl.arange(0, THREADS)
    lane = i % 32
    warp = i // 32
    g = lane // 4
    t = lane % 4
    one = (i * 0 + ONE).to(tl.uint32)
    base, m0, m1, m2, m3, m4, m5 = K.pair_setup(code_ptr, lane, one, MODE, COPIES, SHIFT, THREADS)
    buf, bars = _declare(i, SHAPE)
    wbuf = buf + (warp * (STAGES * STAGE_BYTES)).to(tl.uint32)  # the warp's stage 0
    wbar = bars + (warp * (STAGES * 8)).to(tl.uint32)  # the warp's barrier 0
    keep = _init(lane.to(tl.uint32), wbar, STAGES)
    tl.debug_barrier()
    pid = tl.program_id(0)
    rblk = pid // SPLIT
    pid_k = pid % SPLIT
    row_a = rblk * (THREADS // 2) + warp * 16 + g
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)
    rb = tl.minimum(row_b, N - 1)
    row_c = tl.minimum(rblk * (THREADS // 2) + warp * 16 + lane % 16, N - 1)  # the row this lane copies (lanes < 16)
    src = packed_ptr + row_c.to(tl.int64) * KB
    dst = wbuf + ((lane % 16) * RS).to(tl.uint32)
    if TENSOR:
        dst = wbuf
        rd_a = wbuf + (g * 128 + ((2 * t) ^ g) * 16).to(tl.uint32)  # row a's chunk 2t (swizzled) in stage 0
        rd_b = rd_a  # (READ_SW finds row b and the second chunks)
    else:
        rd_a = wbuf + (g * RS + t * 32).to(tl.uint32)  # this lane's bytes of row a in stage 0
        rd_b = rd_a + 8 * RS
    tmap = tmap_ptr + i * 0
    row0 = (rblk * (THREADS // 2) + warp * 16).to(tl.uint32)
    ba = ra * (KB // 32)  # the rows' first absmax blocks
    bb = rb * (KB // 32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    nst = (end - first) // SB
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    xok0 = (g < M).to(tl.uint32)
    xok1 = (8 + g < M).to(tl.uint32)
    offset = tl.load(offset_ptr)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    lane32 = lane.to(tl.uint32)
    for s in tl.static_range(STAGES - 1):
        go = (one * 0 + (s < nst).to(tl.uint32))
        if TENSOR:
            keep |= _tissue(lane32 + keep, go, wbar + s * 8, dst + s * STAGE_BYTES, tmap,
                            (one * 0 + first + s * SB).to(tl.uint32), row0, SPS)
        else:
            keep |= _issue(lane32 + keep, go, wbar + s * 8, dst + s * STAGE_BYTES, src + first + s * SB, SPS)
    # the absmax bytes of stage 0 (blocks of step q: c // 32 + 4q + t)
    blk0 = first // 32 + t
    qa0, qb0, sa0, sb0 = _raw(absmax_ptr, absmax2_ptr, ba, bb, blk0, MODE)
    qa1, qb1, sa1, sb1 = qa0, qb0, sa0, sb0
    if SPS == 2:
        qa1, qb1, sa1, sb1 = _raw(absmax_ptr, absmax2_ptr, ba, bb, blk0 + 4, MODE)
    for it in range(0, nst):
        nxt = it + STAGES - 1
        slot_n = nxt % STAGES
        go = (one * 0 + (nxt < nst).to(tl.uint32))
        if TENSOR:
            keep |= _tissue(lane32 + keep, go, wbar + slot_n * 8, dst + slot_n * STAGE_BYTES, tmap,
                            (one * 0 + first + tl.minimum(nxt, nst - 1) * SB).to(tl.uint32), row0, SPS)
        else:
            keep |= _issue(lane32 + keep, go, wbar + slot_n * 8, dst + slot_n * STAGE_BYTES,
                           src + first + tl.minimum(nxt, nst - 1) * SB, SPS)
        c = first + it * SB
        # the next stage's absmax bytes, loaded while this one is decoded
        blk_n = (first + tl.minimum(it + 1, nst - 1) * SB) // 32 + t
        pa0, pb0, psa0, psb0 = _raw(absmax_ptr, absmax2_ptr, ba, bb, blk_n, MODE)
        pa1, pb1, psa1, psb1 = pa0, pb0, psa0, psb0
        if SPS == 2:
            pa1, pb1, psa1, psb1 = _raw(absmax_ptr, absmax2_ptr, ba, bb, blk_n + 4, MODE)
        slot = it % STAGES
        keep |= _wait(wbar + slot * 8 + keep, ((it // STAGES) % 2).to(tl.uint32) + one * 0)
        sbase = (slot * STAGE_BYTES).to(tl.uint32) + keep
        amax_a = _amax5(qa0, sa0, code2_ptr, offset, FTZ, MODE)
        amax_b = _amax5(qb0, sb0, code2_ptr, offset, FTZ, MODE)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _step(
            rd_a + sbase, rd_b + sbase, c * (1 - NOX) + t * 32, amax_a, amax_b, base, xr0, xr1, one,
            m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
            MODE, X_DT, NTILE, FTZ, TENSOR, xok0, xok1, XPRED)
        if SPS == 2:
            amax_a = _amax5(qa1, sa1, code2_ptr, offset, FTZ, MODE)
            amax_b = _amax5(qb1, sb1, code2_ptr, offset, FTZ, MODE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _step(
                rd_a + sbase + QSTEP, rd_b + sbase + QSTEP, (c + 128) * (1 - NOX) + t * 32, amax_a, amax_b, base,
                xr0, xr1, one, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13,
                c14, c15, c16, c17, MODE, X_DT, NTILE, FTZ, TENSOR, xok0, xok1, XPRED)
        qa0, qb0, sa0, sb0 = pa0, pb0, psa0, psb0
        qa1, qb1, sa1, sb1 = pa1, pb1, psa1, psb1
    _out(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL, X_DT)
    if NTILE == 2:
        _out(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, part_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL,
             X_DT)
    if PARTIAL:
        last_program_sums(i, lock_ptr, rblk, SPLIT, out_ptr, part_ptr, row_a, row_b, t, M, N, X_DT, NTILE)


# --- host side ------------------------------------------------------------------------------------------------

def plan(n: int, k: int, warps: int, slots: int, sps: int, stages: int) -> dict:
    """stream.plan counted in stages (SB = 128 * sps bytes) with a pipeline fill of STAGES - 1 stages."""
    p = stream_plan(n, k // sps, warps, slots, stages - 1)
    p["seg"] *= sps
    return p


# name -> (decode mode, table copies, SHAPES index)
CANDIDATES = {
    "b_none": ("none", 1, 0),
    "b_none_s3": ("none", 1, 1),
    "b_none_w4": ("none", 1, 2),
    "b_none_s6": ("none", 1, 3),
    "b_none_s8": ("none", 1, 4),
    "b_prmt": ("prmt", 1, 0),
    "b_prmt_w4": ("prmt", 1, 2),
    "b_prmt_s8": ("prmt", 1, 4),
    "b_pair8": ("pair", 8, 1),
    "b_pair8_w4": ("pair", 8, 5),
    # tensor copies (one cp.async.bulk.tensor a box of 16 rows x 128 bytes)
    "t_none8": ("none", 1, 6),
    "t_none10": ("none", 1, 7),
    "t_none5w4": ("none", 1, 8),
    "t_none4x2": ("none", 1, 9),
    "t_none16w1": ("none", 1, 10),
    "t_prmt8": ("prmt", 1, 6),
    "t_prmt10": ("prmt", 1, 7),
    "t_prmt5w4": ("prmt", 1, 8),
    # the stream control (MODE 5): the bytes copied and read back from shared memory, no absmax, x or products
    "t_stream8": ("stream", 1, 6),
    "t_stream4x2": ("stream", 1, 9),
    "t_stream5w4": ("stream", 1, 8),
    "b_stream_s6": ("stream", 1, 3),
    "t_absmax4x2": ("absmax", 1, 9),  # MODE 6: the stream control with the absmax chain
    "t_none4x2_nox": ("none", 1, 9),  # NOX: x loads loop-invariant
    "t_prmt4x2": ("prmt", 1, 9),
    "t_prmt4x2_nox": ("prmt", 1, 9),
    # _xp: x's loads only in lanes whose x row exists (kernels.mma_pairs_x)
    "t_none4x2_xp": ("none", 1, 9),
    "t_prmt4x2_xp": ("prmt", 1, 9),
    "t_prmt8_xp": ("prmt", 1, 6),
    "t_pair8_xp": ("pair", 8, 11),
}
STREAM_MODES = {"stream": 5, "absmax": 6}
_TMAPS: dict = {}


def tensor_map(packed, n: int, kb: int):
    """A CUtensorMap (128 bytes, on packed's device) of the packed bytes as a [n, kb] uint8 matrix, boxes of 16 rows
    x 128 bytes, 128-byte swizzle, made by the driver's cuTensorMapEncodeTiled (ctypes). Kept per (address, n, kb):
    a lab cache, keyed by what the map encodes."""
    import ctypes

    import torch

    key = (packed.data_ptr(), n, kb, packed.device)
    if key in _TMAPS:
        return _TMAPS[key]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("bulk.tensor_map: call prepare() before capturing a CUDA graph")
    lib = ctypes.CDLL("libcuda.so.1")
    raw = (ctypes.c_uint8 * 192)()
    addr = (ctypes.addressof(raw) + 63) // 64 * 64  # CUtensorMap is 64-byte aligned
    dims = (ctypes.c_uint64 * 2)(kb, n)
    strides = (ctypes.c_uint64 * 1)(kb)
    box = (ctypes.c_uint32 * 2)(128, 16)
    ones = (ctypes.c_uint32 * 2)(1, 1)
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    # (map, UINT8 = 0, rank 2, address, dims, strides, box, element strides, INTERLEAVE_NONE, SWIZZLE_128B = 3,
    #  L2_PROMOTION_L2_128B = 2, FLOAT_OOB_FILL_NONE)
    err = fn(ctypes.c_void_p(addr), ctypes.c_int(0), ctypes.c_uint32(2), ctypes.c_void_p(packed.data_ptr()), dims,
             strides, box, ones, ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(2), ctypes.c_int(0))
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUresult {err}")
    host = torch.tensor(list(bytes((ctypes.c_uint8 * 128).from_address(addr))), dtype=torch.uint8)
    _TMAPS[key] = host.to(packed.device)
    return _TMAPS[key]


def prepare(packed, qs) -> None:
    """Make the tensor map of a weight before a CUDA graph captures calls on it."""
    tensor_map(packed, qs.shape[0], qs.shape[1] // 2)


def linear(x, packed, qs, candidate: str):
    """x @ W^T by a candidate of this skeleton (the contract of experiments.labs.gemv_lut.lab_linear)."""
    import torch

    mode, copies, shape = CANDIDATES[candidate]
    stages, warps, sps, tensor = SHAPES[shape]
    m, k = x.shape
    n = qs.shape[0]
    if m > 16 or k % (256 * sps) or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError(f"lab kernels: M <= 16, K % {256 * sps} == 0, blocksize 64, nested absmax")
    if x.data_ptr() % 16 or packed.data_ptr() % 16 or not x.is_contiguous():
        raise ValueError("lab kernels: x and the packed bytes contiguous and 16-byte aligned")
    key = (candidate, n, k, m, x.dtype, x.device)
    x_dt = 2 if x.dtype == torch.bfloat16 else 1
    tmap = tensor_map(packed, n, k // 2) if tensor else packed

    def launch(split, seg, partial):
        grid = triton.cdiv(n, 16 * warps) * split
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        part, lock = scratch(split, m, n, x.device)
        compiled = lab_bulk_kernel[(grid,)](
            x, packed, tmap, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, K.levels(x.device), out, part,
            lock, m, n, k // 2, split, seg, 1,
            MODE=STREAM_MODES.get(mode, K.MODES.get(mode)), COPIES=copies, SHIFT=K.pair_shift(copies), X_DT=x_dt,
            NTILE=1 if m <= 8 else 2,
            THREADS=32 * warps, SHAPE=shape, STAGES=stages, SPS=sps, TENSOR=tensor, FTZ=True, PARTIAL=partial,
            NOX=int(candidate.endswith("_nox")), XPRED=int("_xp" in candidate),
            num_warps=warps)
        return out, compiled

    p = PLANS.get(key)
    if p is None:
        _, compiled = launch(1, k // 2, True)  # compiles the split build (one segment: its own last program)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        shared = shared_bytes(stages, warps, sps, tensor) + (256 * 8 * copies if mode == "pair" else 0)
        per_sm = occupancy(compiled.n_regs, shared + 1024, warps)  # + the driver's 1 KiB a block
        p = plan(n, k, warps, sms * per_sm, sps, stages)
        p.update(registers=compiled.n_regs, per_sm=per_sm, shared=shared)
        PLANS[key] = p
    return launch(p["split"], p["seg"], p["split"] > 1)[0]
