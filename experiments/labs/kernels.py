"""Tensor-core NF4 GEMV candidates whose decode leaves the integer (ALU) pipe: lookups in shared memory.

Every kernel here is one `lab_gemv_kernel` specialisation (constexpr MODE). The skeleton is the product's
`nf4_gemv_mma_kernel` (nf4/linear/kernel.py), rewritten for the common case only: blocksize 64, nested
(double-quantized) absmax, FTZ like bitsandbytes' CUDA build, K / 2 a multiple of 128 bytes, x of M <= 16
rows (bf16 or fp16), x and the packed bytes 16-byte aligned. Each warp owns 16 rows of W; lane 4g + t decodes
bytes t * 32 .. t * 32 + 31 of each 128-byte step of rows g and g + 8 (one absmax block of each row), as 8
words of 4 bytes; a word of each row gives 4 pairs of 16-bit weights, the A fragments of two
`mma.sync.m16n8k16` whose B fragments are x's pairs at the same bytes (x's row 8u + g for tile u), exactly
as in the product kernel. Programs are persistent: program p takes tiles p, p + P, ... of (64-row block,
K segment), so that the shared table is filled once per program.

The decode of a word (4 packed bytes, 8 weights: byte j holds element 2j in its high nibble) by MODE:
- 0 `prmt` (the product's decode, for reference): a per-block table of the 16 rounded products in 8 byte
  planes (`nf4.device.product_table`, 16 FMUL + 8 F2FP + 8 PRMT per row and block) and a `prmt` tree per word
  (`nf4.device.table_pairs`, ~23 ALU instructions per 8 weights).
- 1 `pair` (candidate c): a 256-entry table of float32 level pairs (NF4[b >> 4], NF4[b & 15]) in shared
  memory, COPIES copies interleaved so that lane l reads copy l % COPIES: entry b of copy c is at
  base + b * 8 * COPIES + 8 * c. With 16 copies (32 KiB) every half-warp reads 16 distinct bank pairs: no
  bank conflicts, whatever the bytes. The byte's table offset is made by multiplies (FMA pipe), not by
  shifts: v0 = w & 0x00FF00FF and v1 = w & 0xFF00FF00 (2 LOP3 per word), then for byte 2
  hi32(v0 * 2^(16+s)) = v0 >> (16 - s) = b2 << s (b0 >> (16 - s) = 0 for s <= 8), for byte 3
  hi32(v1 * 2^(8+s)) = b3 << s, and for bytes 0 and 1 the same after lo32(v0 * 2^16) = b0 << 16 and
  lo32(v1 * 2^8) = b1 << 16 (s = log2(8 * COPIES)); `mad.hi.u32` adds the lane's copy base for free. The
  multipliers are runtime values (built from the argument ONE = 1), so ptxas cannot turn them into shifts
  (ALU). Then one `ld.shared.v2.f32` per byte, two `mul.rn.ftz.f32` by the block's absmax and one
  `cvt.rn.{bf16,f16}x2.f32` (F2FP) give the byte's pair, element 2j in the low half: x's own pair order, so x
  needs no permutation. Per 8 weights: 6 ALU (2 LOP3 + 4 F2FP), 6 IMAD, 8 FMUL, 4 LDS.64.
- 2 `level_prmt` (candidate a as briefed): a 16-entry float32 level table (64 bytes, 256-byte aligned, entry e
  in bank e: conflict-free). (w << 2) & 0x3C3C3C3C and (w >> 2) & 0x3C3C3C3C hold every nibble times 4 in a
  byte lane; one `prmt` per weight takes the byte and the table base's upper three bytes (the address), then
  `ld.shared.f32`, `mul.rn.ftz.f32` and one F2FP per two weights.
- 3 `level_imad`: the same table, the address by multiplies like MODE 1: v0 = w & 0x0F0F0F0F, v1 =
  w & 0xF0F0F0F0, lo32 moves the nibble to bits 28-31, hi32(. * 2^6) = nibble * 4 (+ base).
- 4 `none` (a control, not exact): no lookup at all; the word and its absmax's bits stand in for the pairs
  (one ALU instruction per pair), so that the skeleton's loads, absmax chain and tensor-core products run alone.
PRMT_WORDS (MODE 1-3): the first PRMT_WORDS of a lane's 8 words per row and step take MODE 0's decode instead
(candidate d: part of the lookups on the ALU pipe, the rest on shared memory, to balance the two pipes).

The operand is `round_{x dtype}(mul.rn.ftz.f32(NF4[nibble], absmax))` in every mode, the bits
bitsandbytes' `dequantize_4bit(W).to(x.dtype)` holds (W's dtype must be x's); `experiments.labs.models`
runs each mode's asm text in a PTX emulator against the reference. GPU only (inline PTX, sm_80+).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nf4.device import absmax_of_block, load_v4, mma_16x8x16, product_table, table_pairs
from nf4.linear.gemv_pair import mma_pairs, pair_asm, pair_constants, pair_shift  # noqa: F401 (the product's)
from reference.format import NF4_CODE

MODES = {"prmt": 0, "pair": 1, "level_prmt": 2, "level_imad": 3, "none": 4}
STEP_BYTES = 128  # bytes of a row per step: 4 lanes x 32 bytes (one absmax block each)
STEP = tl.constexpr(STEP_BYTES)
LEVEL_TABLE = "nf4lab_levels"
PAIR_TABLE = "nf4lab_pairs"


# --- PTX text (one line each: Inductor-safe, like nf4.device) ---------------------------------------------------


# level_imad: lo32 multipliers (log2) moving the low nibble of byte k = 0, 1, 2 to bits 28-31, the same for the
# high nibble, then the hi32 multipliers: * 2^6 (nibble at bits 28-31 -> nibble * 4) and * 2^10 (low nibble of
# byte 3, at bits 24-27)
LEVEL_MULTIPLIERS = (28, 20, 12, 24, 16, 8, 6, 10)


def _cvt(dtype: str, hi: str, lo: str, dst: str) -> str:
    return f"cvt.rn.{dtype}x2.f32 {dst}, {hi}, {lo};"


def level_prmt_asm(dtype: str) -> str:
    """$0-$3: pairs of bytes 0-3 of word $4; $5 the table base (256-byte aligned), $6 the absmax."""
    lines = ["{", ".reg .b32 t, lo, hi, al0, al1, al2, al3, ah0, ah1, ah2, ah3;",
             ".reg .f32 l0, l1, l2, l3, h0, h1, h2, h3;",
             "shl.b32 t, $4, 2;", "and.b32 lo, t, 0x3C3C3C3C;", "shr.b32 t, $4, 2;", "and.b32 hi, t, 0x3C3C3C3C;"]
    lines += [f"prmt.b32 al{k}, lo, $5, 0x{0x7650 | k:04X}; prmt.b32 ah{k}, hi, $5, 0x{0x7650 | k:04X};"
              for k in range(4)]
    lines += [f"ld.shared.f32 l{k}, [al{k}]; ld.shared.f32 h{k}, [ah{k}];" for k in range(4)]
    lines += [f"mul.rn.ftz.f32 h{k}, h{k}, $6; mul.rn.ftz.f32 l{k}, l{k}, $6;" for k in range(4)]
    lines += [_cvt(dtype, f"l{k}", f"h{k}", f"${k}") for k in range(4)]
    return " ".join([*lines, "}"])


def level_imad_asm(dtype: str) -> str:
    """$0-$3: pairs of bytes 0-3 of word $4; $5 the table base, $6 the absmax, $7..$14 the multipliers
    2^LEVEL_MULTIPLIERS[i], $15 the run-time 1 (the base is added by IMAD, see pair_asm): v0 = w & 0x0F0F0F0F,
    v1 = w & 0xF0F0F0F0; lo32 moves a nibble to bits 28-31 (the
    nibbles below it shift out... or stay below bit 24), hi32(. * 2^6) = nibble * 4; byte 3's low nibble
    directly: hi32(v0 * 2^10) = v0 >> 22, its high nibble hi32(v1 * 2^6)."""
    m = [f"${7 + i}" for i in range(8)]
    lines = ["{", ".reg .b32 v0, v1, s, al0, al1, al2, al3, ah0, ah1, ah2, ah3;",
             ".reg .f32 l0, l1, l2, l3, h0, h1, h2, h3;",
             "and.b32 v0, $4, 0x0F0F0F0F;", "and.b32 v1, $4, 0xF0F0F0F0;"]
    for k in range(3):
        lines += [f"mul.lo.u32 s, v0, {m[k]};", f"mul.hi.u32 al{k}, s, {m[6]};",
                  f"mul.lo.u32 s, v1, {m[3 + k]};", f"mul.hi.u32 ah{k}, s, {m[6]};"]
    lines += [f"mul.hi.u32 al3, v0, {m[7]};", f"mul.hi.u32 ah3, v1, {m[6]};"]
    lines += [f"mad.lo.u32 al{k}, al{k}, $15, $5; mad.lo.u32 ah{k}, ah{k}, $15, $5;" for k in range(4)]  # + base
    lines += [f"ld.shared.f32 l{k}, [al{k}]; ld.shared.f32 h{k}, [ah{k}];" for k in range(4)]
    lines += [f"mul.rn.ftz.f32 h{k}, h{k}, $6; mul.rn.ftz.f32 l{k}, l{k}, $6;" for k in range(4)]
    lines += [_cvt(dtype, f"l{k}", f"h{k}", f"${k}") for k in range(4)]
    return " ".join([*lines, "}"])


def declare_asm(mode: int, copies: int) -> str:
    """Declares the mode's table in .shared (function scope) and returns its shared-window address in $0."""
    if mode == 1:
        return f".shared .align 16 .b8 {PAIR_TABLE}[{256 * 8 * copies}]; mov.u32 $0, {PAIR_TABLE};"
    return f".shared .align 256 .b8 {LEVEL_TABLE}[64]; mov.u32 $0, {LEVEL_TABLE};"


PAIR_BF16 = tl.constexpr(pair_asm("bf16"))
PAIR_F16 = tl.constexpr(pair_asm("f16"))
LEVEL_PRMT_BF16 = tl.constexpr(level_prmt_asm("bf16"))
LEVEL_PRMT_F16 = tl.constexpr(level_prmt_asm("f16"))
LEVEL_IMAD_BF16 = tl.constexpr(level_imad_asm("bf16"))
LEVEL_IMAD_F16 = tl.constexpr(level_imad_asm("f16"))
DECLARE_LEVELS = tl.constexpr(declare_asm(2, 1))
DECLARE_PAIRS_16 = tl.constexpr(declare_asm(1, 16))
DECLARE_PAIRS_8 = tl.constexpr(declare_asm(1, 8))
DECLARE_PAIRS_4 = tl.constexpr(declare_asm(1, 4))
DECLARE_PAIRS_1 = tl.constexpr(declare_asm(1, 1))
ST_V2 = tl.constexpr("st.shared.v2.f32 [$1], {$2, $3}; mov.u32 $0, 0;")
ST_F32 = tl.constexpr("st.shared.f32 [$1], $2; mov.u32 $0, 0;")


# --- device helpers -------------------------------------------------------------------------------------------

@triton.jit
def _declare(i, MODE: tl.constexpr, COPIES: tl.constexpr):
    if MODE == 1:
        if COPIES == 16:
            r = tl.inline_asm_elementwise(DECLARE_PAIRS_16, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        elif COPIES == 8:
            r = tl.inline_asm_elementwise(DECLARE_PAIRS_8, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        elif COPIES == 4:
            r = tl.inline_asm_elementwise(DECLARE_PAIRS_4, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise(DECLARE_PAIRS_1, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(DECLARE_LEVELS, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    return r


@triton.jit
def fill_table(code_ptr, MODE: tl.constexpr, COPIES: tl.constexpr, THREADS: tl.constexpr):
    """Declare and fill the mode's shared table (then a barrier); returns its base (uint32, one per thread)."""
    i = tl.arange(0, THREADS)
    base = _declare(i, MODE, COPIES)
    done = tl.zeros((THREADS,), dtype=tl.uint32)
    if MODE == 1:
        for r in tl.static_range((256 * COPIES) // THREADS):
            idx = r * THREADS + i
            e = idx // COPIES
            addr = base + (e * (8 * COPIES) + (idx % COPIES) * 8).to(tl.uint32)
            hi = tl.load(code_ptr + (e >> 4))
            lo = tl.load(code_ptr + (e & 15))
            done |= tl.inline_asm_elementwise(ST_V2, "=r,r,r,r", [addr, hi, lo], dtype=tl.uint32, is_pure=False,
                                              pack=1)
    else:
        e = i % 16
        done |= tl.inline_asm_elementwise(ST_F32, "=r,r,r", [base + (e * 4).to(tl.uint32), tl.load(code_ptr + e)],
                                          dtype=tl.uint32, is_pure=False, pack=1)
    tl.debug_barrier()
    return base + done  # done is 0: keeps the stores alive


@triton.jit
def pair_setup(code_ptr, lane, one, MODE: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr,
               THREADS: tl.constexpr):
    """MODE 1: the pair table filled and the lane's base in it (its copy), with the run-time multipliers of its IMAD
    addressing (`pair_constants`); other modes: placeholders. Returns (base, m0..m5)."""
    base = one * 0
    m0, m1, m2, m3, m4, m5 = one, one, one, one, one, one
    if MODE == 1:
        base = fill_table(code_ptr, MODE, COPIES, THREADS) + ((lane % COPIES) * 8).to(tl.uint32)
        m0 = base << (16 - SHIFT)
        m1, m2, m3, m4, m5 = one << 16, one << 8, one, one << (16 + SHIFT), one << (8 + SHIFT)
    return base, m0, m1, m2, m3, m4, m5


@triton.jit
def word_pairs(w, base, amax, m0, m1, m2, m3, m4, m5, m6, m7, one, MODE: tl.constexpr, X_DT: tl.constexpr):
    """The 4 pairs of 16-bit weights of word w (shared-memory modes 1-3); pair j: element 2j low, 2j + 1 high."""
    if MODE == 1:
        if X_DT == 2:
            r = tl.inline_asm_elementwise(PAIR_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(PAIR_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5], dtype=(tl.uint32,) * 4,
                                          is_pure=True, pack=1)
    elif MODE == 2:
        if X_DT == 2:
            r = tl.inline_asm_elementwise(LEVEL_PRMT_BF16, "=r,=r,=r,=r,r,r,r", [w, base, amax],
                                          dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(LEVEL_PRMT_F16, "=r,=r,=r,=r,r,r,r", [w, base, amax],
                                          dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    elif MODE == 4:  # the control: no lookup, the word and its absmax bits reused as operands (not exact)
        ab = amax.to(tl.uint32, bitcast=True)
        r = (w, w ^ ab, w + ab, w | ab)
    else:
        if X_DT == 2:
            r = tl.inline_asm_elementwise(LEVEL_IMAD_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5, m6, m7, one],
                                          dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(LEVEL_IMAD_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                          [w, base, amax, m0, m1, m2, m3, m4, m5, m6, m7, one],
                                          dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    return r


@triton.jit
def _pairs(w, q: tl.constexpr, base, amax, t0, t1, t2, t3, t4, t5, t6, t7, m0, m1, m2, m3, m4, m5, m6, m7, m8,
           MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, X_DT: tl.constexpr):
    if MODE == 0 or q < PRMT_WORDS:
        return table_pairs(w, t0, t1, t2, t3, t4, t5, t6, t7)
    else:
        return word_pairs(w, base, amax, m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, X_DT)


@triton.jit
def _word(wa, wb, q: tl.constexpr, xp0, xp1, base, amax_a, amax_b,
          ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
          m0, m1, m2, m3, m4, m5, m6, m7, m8,
          c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
          MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr):
    """Word q of the lane's 8 (rows g: wa, g + 8: wb) against x's pairs at the same bytes (tile u at xp_u)."""
    pa0, pa1, pa2, pa3 = _pairs(wa, q, base, amax_a, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7,
                                m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    pb0, pb1, pb2, pb3 = _pairs(wb, q, base, amax_b, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
                                m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    return mma_pairs(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, q, xp0, xp1, c00, c01, c02, c03, c04, c05, c06, c07,
                     c10, c11, c12, c13, c14, c15, c16, c17, X_DT, NTILE)


# x's 16 bytes at a word, only in lanes whose x row exists ($5 != 0): the other lanes' B columns (x rows >= M) give
# output columns that are never stored, so their registers are left as they are (one L1 wavefront per 8-lane group
# of real rows instead of every lane reading row min(g, M - 1))
LD_V4_IF = tl.constexpr("{ .reg .pred p; setp.ne.u32 p, $5, 0; @p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4]; }")


@triton.jit
def load_v4_if(ptr, ok):
    return tl.inline_asm_elementwise(LD_V4_IF, "=r,=r,=r,=r,l,r", [ptr, ok], dtype=(tl.uint32,) * 4, is_pure=True,
                                     pack=1)


@triton.jit
def mma_pairs_x(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, q, xp0, xp1, ok0, ok1,
                c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
                X_DT: tl.constexpr, NTILE: tl.constexpr, XPRED: tl.constexpr):
    """nf4.linear.gemv_pair.mma_pairs with XPRED: x's words loaded only where the lane's x row exists (ok0 / ok1)."""
    if XPRED:
        x0, x1, x2, x3 = load_v4_if(xp0 + 4 * q, ok0)
    else:
        x0, x1, x2, x3 = load_v4(xp0 + 4 * q, False)
    c00, c01, c02, c03 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, c00, c01, c02, c03, X_DT)
    c04, c05, c06, c07 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, c04, c05, c06, c07, X_DT)
    if NTILE == 2:
        if XPRED:
            y0, y1, y2, y3 = load_v4_if(xp1 + 4 * q, ok1)
        else:
            y0, y1, y2, y3 = load_v4(xp1 + 4 * q, False)
        c10, c11, c12, c13 = mma_16x8x16(pa0, pb0, pa1, pb1, y0, y1, c10, c11, c12, c13, X_DT)
        c14, c15, c16, c17 = mma_16x8x16(pa2, pb2, pa3, pb3, y2, y3, c14, c15, c16, c17, X_DT)
    return c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17


@triton.jit
def _wordx(wa, wb, q: tl.constexpr, xp0, xp1, base, amax_a, amax_b,
           ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
           m0, m1, m2, m3, m4, m5, m6, m7, m8,
           c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17,
           MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, X_DT: tl.constexpr, NTILE: tl.constexpr,
           ok0, ok1, XPRED: tl.constexpr):
    """_word with x's loads predicated on the lane's x row (XPRED)."""
    pa0, pa1, pa2, pa3 = _pairs(wa, q, base, amax_a, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7,
                                m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    pb0, pb1, pb2, pb3 = _pairs(wb, q, base, amax_b, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
                                m0, m1, m2, m3, m4, m5, m6, m7, m8, MODE, PRMT_WORDS, X_DT)
    return mma_pairs_x(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, q, xp0, xp1, ok0, ok1,
                       c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, X_DT, NTILE,
                       XPRED)


@triton.jit
def _store1(y, out_ptr, r, m, M, N, pid_k, PARTIAL: tl.constexpr, X_DT: tl.constexpr):
    ok = (r < N) & (m < M)
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + m) * N + r, y, mask=ok)
    elif X_DT == 2:
        tl.store(out_ptr + m * N + r, y.to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + m * N + r, y.to(tl.float16), mask=ok)


@triton.jit
def _store(c0, c1, c2, c3, c4, c5, c6, c7, m0, out_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL: tl.constexpr,
           X_DT: tl.constexpr):
    """The lane's 4 outputs of one 8-row tile of x (D rows g / g + 8 at x rows m0 + 2t, m0 + 2t + 1)."""
    m = m0 + 2 * t
    _store1(c0 + c4, out_ptr, row_a, m, M, N, pid_k, PARTIAL, X_DT)
    _store1(c1 + c5, out_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, X_DT)
    _store1(c2 + c6, out_ptr, row_b, m, M, N, pid_k, PARTIAL, X_DT)
    _store1(c3 + c7, out_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, X_DT)


@triton.jit
def _fetch(wa, wb, ra, rb, c, t, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, FTZ: tl.constexpr,
           FULLSEC: tl.constexpr):
    """The lane's 8 words of each row in the step at byte c and the two rows' absmax there: bytes t * 32 ..
    t * 32 + 31 (one 64-weight block), or with FULLSEC bytes 16t.. and 64 + 16t.. (the 4 lanes of a row read 64
    contiguous bytes per load: whole sectors; two blocks per lane, the second absmax for words 4-7)."""
    if FULLSEC:
        j0 = c + 16 * t
        j1 = c + 64 + 16 * t
        a0, a1, a2, a3 = load_v4(wa + j0 // 4, True)
        a4, a5, a6, a7 = load_v4(wa + j1 // 4, True)
        b0, b1, b2, b3 = load_v4(wb + j0 // 4, True)
        b4, b5, b6, b7 = load_v4(wb + j1 // 4, True)
    else:
        j0 = c + t * 32
        j1 = j0
        a0, a1, a2, a3 = load_v4(wa + j0 // 4, True)
        a4, a5, a6, a7 = load_v4(wa + j0 // 4 + 4, True)
        b0, b1, b2, b3 = load_v4(wb + j0 // 4, True)
        b4, b5, b6, b7 = load_v4(wb + j0 // 4 + 4, True)
    amax_a = absmax_of_block((ra * KB + j0) // 32, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                             True)
    amax_b = absmax_of_block((rb * KB + j0) // 32, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                             True)
    if FULLSEC:
        amax_a2 = absmax_of_block((ra * KB + j1) // 32, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True,
                                  FTZ, True)
        amax_b2 = absmax_of_block((rb * KB + j1) // 32, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True,
                                  FTZ, True)
    else:
        amax_a2 = amax_a
        amax_b2 = amax_b
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a, amax_b, amax_a2, amax_b2


@triton.jit(do_not_specialize=["M", "ONE", "SPLIT", "SEG", "TILES"])
def lab_gemv_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    M, N, KB, SPLIT, SEG, TILES,
    ONE,  # the integer 1, at run time: the multipliers of the IMAD addressing are built from it
    MODE: tl.constexpr, PRMT_WORDS: tl.constexpr, COPIES: tl.constexpr, SHIFT: tl.constexpr,  # log2(8 * COPIES)
    X_DT: tl.constexpr,
    NTILE: tl.constexpr, THREADS: tl.constexpr, PARTIAL: tl.constexpr, FTZ: tl.constexpr,
    FULLSEC: tl.constexpr,  # 0 or 1 (see _fetch)
    XPRED: tl.constexpr,  # 0 or 1: x's loads only in lanes whose x row exists (mma_pairs_x)
):
    """x @ W^T for M <= 16 (NTILE 8-row tiles of x) on tensor cores; tiles of (64-row block, K segment of SEG
    bytes) t = pid, pid + P, ...: tile t covers rows (t // SPLIT) * 16 * warps.. and K segment t % SPLIT.
    PARTIAL: float32 partial sums into out_ptr[SPLIT, M, N] (experiments.labs.kernels.split_sum_kernel adds
    them), else the rounded output [M, N]."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    always = i >= 0
    one = (i * 0 + ONE).to(tl.uint32)
    # the shared table (modes 1-3) and the multipliers of its IMAD addressing, as run-time values
    base = one * 0
    m0, m1, m2, m3, m4, m5, m6, m7 = one, one, one, one, one, one, one, one
    if MODE == 1:
        base = fill_table(code_ptr, MODE, COPIES, THREADS) + ((lane % COPIES) * 8).to(tl.uint32)  # lanebase
        m0 = base << (16 - SHIFT)  # see pair_constants
        m1, m2, m3, m4, m5 = one << 16, one << 8, one, one << (16 + SHIFT), one << (8 + SHIFT)
    elif MODE == 2 or MODE == 3:
        base = fill_table(code_ptr, MODE, COPIES, THREADS)
        m0, m1, m2, m3 = one << 28, one << 20, one << 12, one << 24  # LEVEL_MULTIPLIERS
        m4, m5, m6, m7 = one << 16, one << 8, one << 6, one << 10
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    xok0 = (g < M).to(tl.uint32)
    xok1 = (8 + g < M).to(tl.uint32)
    for tile in range(tl.program_id(0), TILES, tl.num_programs(0)):
        pid_k = tile % SPLIT
        row_a = (tile // SPLIT) * (THREADS // 2) + (i // 32) * 16 + g
        row_b = row_a + 8
        ra = tl.minimum(row_a, N - 1)
        rb = tl.minimum(row_b, N - 1)
        wa = words_ptr + ra * KW
        wb = words_ptr + rb * KW
        first = pid_k * SEG
        end = tl.minimum(first + SEG, KB)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = (
            zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
        (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b, next_a2,
         next_b2) = _fetch(wa, wb, ra, rb, first, t, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, FTZ,
                           FULLSEC)
        for c0 in range(first, end, STEP):
            a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
            b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
            amax_a, amax_b, amax_a2, amax_b2 = next_a, next_b, next_a2, next_b2
            j = c0 + t * (32 - 16 * FULLSEC)
            (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b, next_a2,
             next_b2) = _fetch(wa, wb, ra, rb, tl.minimum(c0 + STEP, end - STEP), t, KB, always, absmax_ptr,
                               absmax2_ptr, code2_ptr, offset_ptr, FTZ, FULLSEC)
            ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = one, one, one, one, one, one, one, one
            tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = one, one, one, one, one, one, one, one
            if MODE == 0 or PRMT_WORDS > 0:
                ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = product_table(amax_a, FTZ, X_DT)
                tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = product_table(amax_b, FTZ, X_DT)
            xp0, xp1 = xr0 + j, xr1 + j
            xh0, xh1 = xp0 + 48 * FULLSEC, xp1 + 48 * FULLSEC  # words 4-7 (FULLSEC: 64 bytes on)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a0, b0, 0, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a1, b1, 1, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a2, b2, 2, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a3, b3, 3, xp0, xp1, base, amax_a, amax_b, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            if FULLSEC and (MODE == 0 or PRMT_WORDS > 4):  # words 4-7 are the second block's (see _fetch)
                ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = product_table(amax_a2, FTZ, X_DT)
                tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = product_table(amax_b2, FTZ, X_DT)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a4, b4, 4, xh0, xh1, base, amax_a2, amax_b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a5, b5, 5, xh0, xh1, base, amax_a2, amax_b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a6, b6, 6, xh0, xh1, base, amax_a2, amax_b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17) = _wordx(
                a7, b7, 7, xh0, xh1, base, amax_a2, amax_b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3,
                tb4, tb5, tb6, tb7, m0, m1, m2, m3, m4, m5, m6, m7, one, c00, c01, c02, c03, c04, c05, c06, c07, c10,
                c11, c12, c13, c14, c15, c16, c17, MODE, PRMT_WORDS, X_DT, NTILE, xok0, xok1, XPRED)
        _store(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL, X_DT)
        if NTILE == 2:
            _store(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, row_a, row_b, t, M, N, pid_k, PARTIAL, X_DT)


@triton.jit
def split_sum_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, X_DT: tl.constexpr, BLOCK: tl.constexpr):
    """out = round(part[0] + part[1] + ...) over MN = M * N outputs (split-K's second pass), in split order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    y = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    if X_DT == 2:
        tl.store(out_ptr + i, y.to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + i, y.to(tl.float16), mask=ok)


NF4_LEVELS = [float(v) for v in NF4_CODE]  # what the host passes as code_ptr (float32, 16 entries)
_LEVELS: dict = {}


def levels(device):
    """NF4_LEVELS as a float32 tensor on `device` (made once per device): the labs' code_ptr."""
    if device not in _LEVELS:
        import torch

        _LEVELS[device] = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return _LEVELS[device]
