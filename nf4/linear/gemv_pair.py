"""`nf4_gemv_pair_kernel`: the tensor-core GEMV whose decode reads a shared-memory table of level pairs, and its
launches (kernel "gemv_pair"; M <= 16).

The lab's "pair" candidate (experiments/labs/kernels.py, mode 1 with 16 copies) as a product kernel: its decode
moves the level lookup off the integer (ALU) pipe. The skeleton is nf4_gemv_mma_kernel's: each warp owns 16 rows
of W; lane 4g + t decodes bytes t * 32 .. t * 32 + 31 of each 128-byte step of rows g and g + 8 (one 64-weight
absmax block of each row), as 8 words of 4 bytes; a word of each row gives 4 pairs of 16-bit weights, the A
fragments of two `mma.sync.m16n8k16` whose B fragments are x's pairs at the same bytes (x's row 8u + g for tile
u). Programs are persistent: program p takes tiles p, p + P, ... of (64-row block, K segment), so that the
shared table is filled once per program.

The decode of a word (4 packed bytes, 8 weights: byte j holds element 2j in its high nibble): a 256-entry table of
float32 level pairs (NF4[b >> 4], NF4[b & 15]) in shared memory, 16 copies interleaved so that lane l reads copy
l % 16: entry b of copy c is at base + b * 128 + 8 * c. With 16 copies (32 KiB) every half-warp reads 16 distinct
bank pairs: no bank conflicts, whatever the bytes. The byte's table offset is made by multiplies (FMA pipe), not
by shifts (`pair_asm`); the multipliers are run-time values (built from the argument ONE = 1), so ptxas cannot
turn them into shifts (ALU). Then one `ld.shared.v2.f32` per byte, two `mul.rn.ftz.f32` (`mul.rn.f32` without
ftz) by the block's absmax and one `cvt.rn.{bf16,f16}x2.f32` give the byte's pair, element 2j in the low half:
x's own pair order, so x needs no permutation. Per 8 weights: 6 ALU (2 LOP3 + 4 F2FP), 6 IMAD, 8 FMUL, 4 LDS.64.
The operand is `round_{x dtype}(mul(NF4[nibble], absmax))`, `nf4.dequantize(W).to(x.dtype)` where W's dtype is
x's; experiments.labs.models runs this file's asm text against the reference (tests/experiments/test_labs_gemv.py).

Not in the tuned table: in an exploratory H200 run (not committed) it was slower than the table's row at
14336x4096, M = 1 (`python -m experiments.labs.gemv_lut` measures both, the lab's pair16 and nf4.linear).
`LinearConfig(kernel="gemv_pair", ...)` runs it; the fields it reads: num_warps (16 rows of W per warp),
programs_per_sm (persistent programs per multiprocessor; the lab's pair16 took 6 of 4 warps), split_k (0: enough
K segments for the programs), maxnreg, bf16_bits. Needs a CUDA GPU of sm_80 or later (inline PTX), M <= 16,
W's dtype == x's, blocksize 64, K a multiple of 256, x contiguous, x and the packed bytes 16-byte aligned
(`runnable`); elsewhere the word GEMV of its shape takes over (SIMPLER).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ..device import absmax_of_block, load_v4, mma_16x8x16, round_to, widen
from ..weight import NF4Weight
from .call import Call, aligned, gemv_options, packs_16bit, split_by, with_split_sum
from .config import LinearConfig

MAX_M = 16  # rows of x: two 8-row tiles of B's columns
PAIR_BLOCKSIZE = 64  # a lane's 32 bytes of a step are one absmax block
STEP_BYTES = 128  # bytes of a row per step: 4 lanes x 32 bytes
COPIES = 16  # interleaved copies of the pair table (32 KiB): conflict-free lookups
PAIR_TABLE = "nf4_pair_levels"  # the table's .shared symbol
SIMPLER = "gemv_table"  # what runs a config of this shape where this kernel cannot (launch.launch_config)


# --- PTX text (one line each: Inductor-safe, like nf4.device) ---------------------------------------------------

def pair_shift(copies: int = COPIES) -> int:
    """log2 of the byte stride of the pair table's entries: 8 bytes per copy."""
    s = int(math.log2(8 * copies))
    if 8 * copies != 2**s or s > 8:
        raise ValueError(f"copies must be a power of two up to 32, got {copies}")
    return s


def pair_constants(copies: int, lanebase: int) -> tuple[int, ...]:
    """The decode's run-time operands after the absmax: X = lanebase << (16 - s), then 2^16, 2^8, 1, 2^(16+s),
    2^(8+s); lanebase = the table's base + 8 * the lane's copy (`pair_asm`)."""
    s = pair_shift(copies)
    return lanebase << (16 - s), 1 << 16, 1 << 8, 1, 1 << (16 + s), 1 << (8 + s)


def pair_asm(dtype: str, ftz: bool = True) -> str:
    """$0-$3: pairs of bytes 0-3 of word $4; $5 the lane's base (table base + 8 * copy), $6 the absmax, $7..$12
    `pair_constants`.

    Byte b of the word is looked up at lanebase + b * 2^s: v0 = w & 0x00FF00FF = b2 << 16 | b0 and
    v1 = w & 0xFF00FF00 = b3 << 24 | b1 << 8; u0 = lo32(v0 * 2^16) + X = b0 << 16 + X, u1 = lo32(v1 * 2^8) + X,
    u2 = v0 + X with X = lanebase << (16 - s); then hi32(u * 2^(16+s)) = u >> (16 - s) = b << s + lanebase
    (b0 < 2^(16-s) shifts out of u2 for s <= 8; no overflow while lanebase < 2^23, i.e. the shared window of a
    CTA launched without clusters). Byte 3: hi32(v1 * 2^(8+s)) = b3 << s, plus lanebase by an IMAD with the
    run-time 1. All ten are IMAD / IMAD.HI (FMA pipe): a plain add of the base after a mul.hi is what ptxas
    folds into an IMAD.HI with a 64-bit addend, whose register pair costs MOVs (ALU) every time. ftz: the
    products flush float32 subnormals like bitsandbytes' CUDA build (mul.rn.ftz.f32), else IEEE (mul.rn.f32)."""
    mul = "mul.rn.ftz.f32" if ftz else "mul.rn.f32"
    lines = ["{", ".reg .b32 v0, v1, u0, u1, u2, t3, a0, a1, a2, a3;", ".reg .f32 h0, h1, h2, h3, l0, l1, l2, l3;",
             "and.b32 v0, $4, 0x00FF00FF;", "and.b32 v1, $4, 0xFF00FF00;",
             "mad.lo.u32 u0, v0, $8, $7;", "mad.lo.u32 u1, v1, $9, $7;", "mad.lo.u32 u2, v0, $10, $7;",
             "mul.hi.u32 a0, u0, $11;", "mul.hi.u32 a1, u1, $11;", "mul.hi.u32 a2, u2, $11;",
             "mul.hi.u32 t3, v1, $12;", "mad.lo.u32 a3, t3, $10, $5;"]
    lines += [f"ld.shared.v2.f32 {{h{k}, l{k}}}, [a{k}];" for k in range(4)]  # (level of element 2j, of 2j + 1)
    lines += [f"{mul} h{k}, h{k}, $6; {mul} l{k}, l{k}, $6;" for k in range(4)]
    lines += [f"cvt.rn.{dtype}x2.f32 ${k}, l{k}, h{k};" for k in range(4)]  # element 2j + 1 in the high half
    return " ".join([*lines, "}"])


PAIR_BF16 = tl.constexpr(pair_asm("bf16"))
PAIR_F16 = tl.constexpr(pair_asm("f16"))
PAIR_BF16_IEEE = tl.constexpr(pair_asm("bf16", ftz=False))
PAIR_F16_IEEE = tl.constexpr(pair_asm("f16", ftz=False))
# declares the table in .shared (function scope) and returns its shared-window address in $0
DECLARE_PAIRS = tl.constexpr(f".shared .align 16 .b8 {PAIR_TABLE}[{256 * 8 * COPIES}]; mov.u32 $0, {PAIR_TABLE};")
ST_V2 = tl.constexpr("st.shared.v2.f32 [$1], {$2, $3}; mov.u32 $0, 0;")
_COPIES = tl.constexpr(COPIES)
_SHIFT = tl.constexpr(pair_shift())
_STEP = tl.constexpr(STEP_BYTES)


# --- device helpers -------------------------------------------------------------------------------------------

@triton.jit
def _fill_table(code_ptr, THREADS: tl.constexpr):
    """Declare and fill the pair table (copy c of entry e at base + e * 8 * COPIES + 8 * c: NF4[e >> 4], then
    NF4[e & 15]), then a barrier; returns its base (uint32, one per thread)."""
    i = tl.arange(0, THREADS)
    base = tl.inline_asm_elementwise(DECLARE_PAIRS, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    done = tl.zeros((THREADS,), dtype=tl.uint32)
    for r in tl.static_range((256 * _COPIES) // THREADS):
        idx = r * THREADS + i
        e = idx // _COPIES
        addr = base + (e * (8 * _COPIES) + (idx % _COPIES) * 8).to(tl.uint32)
        hi = tl.load(code_ptr + (e >> 4))
        lo = tl.load(code_ptr + (e & 15))
        done |= tl.inline_asm_elementwise(ST_V2, "=r,r,r,r", [addr, hi, lo], dtype=tl.uint32, is_pure=False,
                                          pack=1)
    tl.debug_barrier()
    return base + done  # done is 0: keeps the stores alive


@triton.jit
def _pairs(w, base, amax, m0, m1, m2, m3, m4, m5, X_DT: tl.constexpr, FTZ: tl.constexpr):
    """The 4 pairs of 16-bit weights of word w (`pair_asm`); pair j: element 2j low, 2j + 1 high."""
    if X_DT == 2:
        if FTZ:
            r = tl.inline_asm_elementwise(PAIR_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(PAIR_BF16_IEEE, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
    else:
        if FTZ:
            r = tl.inline_asm_elementwise(PAIR_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(PAIR_F16_IEEE, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
    return r


@triton.jit
def _word(wa, wb, q, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5,
          c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
          X_DT: tl.constexpr, FTZ: tl.constexpr, NTILE: tl.constexpr):
    """Word q of the lane's 8 (rows g: wa, g + 8: wb) against x's pairs at the same bytes (tile u at xp_u)."""
    pa0, pa1, pa2, pa3 = _pairs(wa, base, amax_a, m0, m1, m2, m3, m4, m5, X_DT, FTZ)
    pb0, pb1, pb2, pb3 = _pairs(wb, base, amax_b, m0, m1, m2, m3, m4, m5, X_DT, FTZ)
    return mma_pairs(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, q, xp0, xp1, c00, c01, c02, c03, c04, c05, c06, c07,
                     c10, c11, c12, c13, c14, c15, c16, c17, X_DT, NTILE)


@triton.jit
def mma_pairs(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, q, xp0, xp1,
              c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
              X_DT: tl.constexpr, NTILE: tl.constexpr):
    """A word's decoded pairs (rows g: pa*, g + 8: pb*) times x's pairs at the same bytes (tile u at xp_u), into the
    accumulators of one or two 8-row tiles of x (the GEMV lab's decodes share this)."""
    x0, x1, x2, x3 = load_v4(xp0 + 4 * q, False)
    c00, c01, c02, c03 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, c00, c01, c02, c03, X_DT)
    c04, c05, c06, c07 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, c04, c05, c06, c07, X_DT)
    if NTILE == 2:
        y0, y1, y2, y3 = load_v4(xp1 + 4 * q, False)
        c10, c11, c12, c13 = mma_16x8x16(pa0, pb0, pa1, pb1, y0, y1, c10, c11, c12, c13, X_DT)
        c14, c15, c16, c17 = mma_16x8x16(pa2, pb2, pa3, pb3, y2, y3, c14, c15, c16, c17, X_DT)
    return c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17


@triton.jit
def _store1(y, out_ptr, bias_ptr, r, m, M, N, pid_k, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
            X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    ok = (r < N) & (m < M)
    if PARTIAL:  # float32 partials [SPLIT, M, N], summed in order by nf4_split_sum_kernel
        tl.store(out_ptr + (pid_k * M + m) * N + r, y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + r, mask=r < N, other=0.0), BF16_BITS)
        tl.store(out_ptr + m * N + r, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit
def _store(c0, c1, c2, c3, c4, c5, c6, c7, m0, out_ptr, bias_ptr, row_a, row_b, t, M, N, pid_k,
           PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """The lane's 4 outputs of one 8-row tile of x (D rows g / g + 8 at x rows m0 + 2t, m0 + 2t + 1)."""
    m = m0 + 2 * t
    _store1(c0 + c4, out_ptr, bias_ptr, row_a, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _store1(c1 + c5, out_ptr, bias_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _store1(c2 + c6, out_ptr, bias_ptr, row_b, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _store1(c3 + c7, out_ptr, bias_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


@triton.jit
def _fetch(wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE: tl.constexpr,
           DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr):
    """The lane's 8 words of each row (at byte j) and the two rows' absmax there (one 64-weight block)."""
    a0, a1, a2, a3 = load_v4(wa + j // 4, True)
    a4, a5, a6, a7 = load_v4(wa + j // 4 + 4, True)
    b0, b1, b2, b3 = load_v4(wb + j // 4, True)
    b4, b5, b6, b7 = load_v4(wb + j // 4 + 4, True)
    amax_a = absmax_of_block((ra * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    amax_b = absmax_of_block((rb * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a, amax_b


@triton.jit(do_not_specialize=["M", "ONE", "SPLIT", "SEG", "TILES"])
def nf4_gemv_pair_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
    code_ptr,  # float32 [16] NF4 levels (the table is built from them)
    bias_ptr, out_ptr,
    M, N, K, KB,
    SPLIT, SEG,  # programs along K per 64-row block and bytes of a row each (a multiple of 128)
    TILES,  # (row block, K segment) tiles: SPLIT * cdiv(N, THREADS // 2)
    ONE,  # the integer 1, at run time: the multipliers of the IMAD addressing are built from it
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    NTILE: tl.constexpr,  # 8-row tiles of x: 1 (M <= 8) or 2
    THREADS: tl.constexpr, PARTIAL: tl.constexpr, BF16_BITS: tl.constexpr,
):
    """x @ W^T (+ bias) for M <= 16 on tensor cores; tiles of (row block of THREADS // 2 rows, K segment of SEG
    bytes) t = pid, pid + P, ...: tile t covers row block t // SPLIT and K segment t % SPLIT. PARTIAL: float32
    partial sums into out_ptr[SPLIT, M, N] (nf4_split_sum_kernel adds them and the bias), else the rounded
    output [M, N]."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] as one word
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    always = i >= 0
    one = (i * 0 + ONE).to(tl.uint32)
    # the shared table and the multipliers of its IMAD addressing, as run-time values (`pair_constants`)
    base = _fill_table(code_ptr, THREADS) + ((lane % _COPIES) * 8).to(tl.uint32)  # the lane's copy
    m0 = base << (16 - _SHIFT)
    m1, m2, m3, m4, m5 = one << 16, one << 8, one, one << (16 + _SHIFT), one << (8 + _SHIFT)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    # B's column g of tile u: x's row 8u + g (past M: row M - 1, not stored)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    for tile in range(tl.program_id(0), TILES, tl.num_programs(0)):
        pid_k = tile % SPLIT
        row_a = (tile // SPLIT) * (THREADS // 2) + (i // 32) * 16 + g
        row_b = row_a + 8
        ra = tl.minimum(row_a, N - 1)  # rows past the weight decode its last row (their outputs are not stored)
        rb = tl.minimum(row_b, N - 1)
        wa = words_ptr + ra * KW
        wb = words_ptr + rb * KW
        first = pid_k * SEG
        end = tl.minimum(first + SEG, KB)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (
            zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
        # the first step's words and absmax; each step then requests the next step's before decoding its own (the
        # last step re-reads itself: in bounds, unused)
        (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = _fetch(
            wa, wb, ra, rb, first + t * 32, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE,
            DOUBLE_QUANT, FTZ)
        for c0 in range(first, end, _STEP):
            a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
            b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
            amax_a, amax_b = next_a, next_b
            j = c0 + t * 32
            (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = _fetch(
                wa, wb, ra, rb, tl.minimum(c0 + _STEP, end - _STEP) + t * 32, KB, always, absmax_ptr, absmax2_ptr,
                code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT, FTZ)
            xp0, xp1 = xr0 + j, xr1 + j
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a0, b0, 0, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a1, b1, 1, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a2, b2, 2, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a3, b3, 3, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a4, b4, 4, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a5, b5, 5, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a6, b6, 6, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _word(
                a7, b7, 7, xp0, xp1, base, amax_a, amax_b, m0, m1, m2, m3, m4, m5, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, FTZ, NTILE)
        _store(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, bias_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL,
               HAS_BIAS, X_DT, BF16_BITS)
        if NTILE == 2:
            _store(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, bias_ptr, row_a, row_b, t, M, N, pid_k,
                   PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


# --- launches ---------------------------------------------------------------------------------------------------

def runnable(config: LinearConfig, w: NF4Weight, x, m: int) -> bool:
    """A CUDA GPU of sm_80 or later, M <= 16, W's dtype is x's, blocksize 64, K a multiple of 256 (whole 128-byte
    steps), x contiguous, x and the packed bytes 16-byte aligned."""
    packed = w.packed
    return (m <= MAX_M and w.dtype == x.dtype and packed.device.type == "cuda" and packs_16bit(packed.device)
            and w.blocksize == PAIR_BLOCKSIZE and (w.shape[1] // 2) % STEP_BYTES == 0 and x.is_contiguous()
            and aligned(x, 16) and aligned(packed, 16))


def rows_per_program(config: LinearConfig) -> int:
    return 16 * config.num_warps


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    """Auto (split_k 0): enough K segments that the row blocks make programs_per_sm programs per multiprocessor
    (1 off the GPU: sms None); segments of whole 128-byte steps."""

    def auto(steps: int) -> int:
        if sms is None:
            return 1
        return triton.cdiv(config.programs_per_sm * sms, triton.cdiv(w.shape[0], rows_per_program(config)))

    return split_by(config, w, STEP_BYTES, auto)


def launches(call: Call) -> list[tuple]:
    config, w, m = call.config, call.w, call.m
    parts, seg = split(config, w, m, call.sms)
    tiles = triton.cdiv(w.shape[0], rows_per_program(config)) * parts
    programs = config.programs_per_sm * call.sms if call.sms is not None else tiles  # persistent programs
    args = {**call.args, "SPLIT": parts, "SEG": seg, "TILES": tiles, "ONE": 1, "NTILE": 1 if m <= 8 else 2,
            "THREADS": 32 * config.num_warps, "PARTIAL": parts > 1}
    for name in ("ASM", "CODEBOOK", "W_DT", "EVICT"):
        del args[name]
    return with_split_sum((nf4_gemv_pair_kernel, (min(tiles, programs),), args, gemv_options(config)), parts, call)
