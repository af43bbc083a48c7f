"""The `@triton.jit` helpers every NF4 kernel shares: nibbles, level lookup, ftz multiply, absmax, stores.

One home for the device-side arithmetic, so that the product kernels (`nf4.dequant`) and every
experiment variant and lab decode NF4 the same way. The format's facts (levels, nibble order, the
absmax block of double quantization) come from `reference.format` and enter the compiled code as
constexprs built from it; nothing here repeats a level or a block size as a literal
(tests/nf4/test_device.py pins the constexprs to the format module).

Exactness rules these helpers carry (docs/FORMAT.md §3-5):
- `mul` rounds a float32 product once; with FTZ it flushes subnormal operands and results to a
  zero of the same sign, like bitsandbytes' fast-math CUDA build. On a GPU (ASM) it is one PTX
  `mul.rn.ftz.f32`, which the compiler cannot contract with a following add.
- `absmax_of_block` recovers a double-quantized absmax with two float32 roundings (a product,
  then a separate add); kernels are compiled with `enable_fp_fusion=False` so the IEEE path keeps
  them apart too.
- `store_rounded` rounds to the output dtype to nearest even; in Triton's interpreter (which
  truncates float32 -> bfloat16) it rounds bfloat16 with integer ops (`to_bf16_rne`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from reference.format import ABSMAX_BLOCKSIZE, FLT_MIN, HIGH_NIBBLE_SHIFT, LOW_NIBBLE_MASK, NF4_CODE, NF4_CODE_BITS

# constexprs built from the format module (float32 -> Python float is exact)
FLT_MIN_F32 = tl.constexpr(float(FLT_MIN))  # smallest normal float32
ABSMAX_BLOCK = tl.constexpr(ABSMAX_BLOCKSIZE)  # first-level absmax values per second-level scale
HIGH_SHIFT = tl.constexpr(HIGH_NIBBLE_SHIFT)  # element 2k of a byte is its high nibble
LOW_MASK = tl.constexpr(LOW_NIBBLE_MASK)
NF4_0 = tl.constexpr(float(NF4_CODE[0]))
NF4_1 = tl.constexpr(float(NF4_CODE[1]))
NF4_2 = tl.constexpr(float(NF4_CODE[2]))
NF4_3 = tl.constexpr(float(NF4_CODE[3]))
NF4_4 = tl.constexpr(float(NF4_CODE[4]))
NF4_5 = tl.constexpr(float(NF4_CODE[5]))
NF4_6 = tl.constexpr(float(NF4_CODE[6]))
NF4_7 = tl.constexpr(float(NF4_CODE[7]))
NF4_8 = tl.constexpr(float(NF4_CODE[8]))
NF4_9 = tl.constexpr(float(NF4_CODE[9]))
NF4_10 = tl.constexpr(float(NF4_CODE[10]))
NF4_11 = tl.constexpr(float(NF4_CODE[11]))
NF4_12 = tl.constexpr(float(NF4_CODE[12]))
NF4_13 = tl.constexpr(float(NF4_CODE[13]))
NF4_14 = tl.constexpr(float(NF4_CODE[14]))
NF4_15 = tl.constexpr(float(NF4_CODE[15]))
SELECT_TREE_LEVELS = (NF4_0, NF4_1, NF4_2, NF4_3, NF4_4, NF4_5, NF4_6, NF4_7, NF4_8, NF4_9, NF4_10, NF4_11, NF4_12,
                      NF4_13, NF4_14, NF4_15)  # for the test that pins them to the format module


@triton.jit
def flush(x, FTZ: tl.constexpr):
    """Flush float32 subnormals to a zero of the same sign when FTZ, else return x unchanged."""
    if FTZ:
        x = tl.where(tl.abs(x) < FLT_MIN_F32, x * 0.0, x)
    return x


@triton.jit
def to_bf16_rne(y):
    """float32 -> bfloat16, round to nearest even, with integer ops (quiets NaNs, keeps -0.0).

    Triton's interpreter truncates float32 -> bfloat16 (and its "rtne" mode rounds ties up), so
    the interpreter takes this path to stay bit-exact; the GPU uses the native conversion unless
    a config asks for the integer path.
    """
    bits = y.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def high_nibble(byte):
    """The code of element 2k of packed byte k (int32)."""
    return ((byte >> HIGH_SHIFT) & LOW_MASK).to(tl.int32)


@triton.jit
def low_nibble(byte):
    """The code of element 2k + 1 of packed byte k (int32)."""
    return (byte & LOW_MASK).to(tl.int32)


@triton.jit
def word_nibble_shift(k):
    """Right shift of element k (0..7) of a little-endian 32-bit word of 4 packed bytes.

    Byte j of the word is bits 8j..8j+7, and element 2j is its high nibble.
    """
    return ((k // 2) * 8 + HIGH_SHIFT - (k % 2) * HIGH_SHIFT).to(tl.uint32)


@triton.jit
def nf4_level(nib, code_ptr, CODEBOOK: tl.constexpr):
    """Float32 NF4 level of each 4-bit code: a gather from the 16-entry table (CODEBOOK 0), or a
    select tree over the code's bits (any other value) whose leaves are the format's constexprs."""
    if CODEBOOK == 0:
        v = tl.load(code_ptr + nib, eviction_policy="evict_last")
    else:
        b0 = (nib & 1) != 0
        b1 = (nib & 2) != 0
        b2 = (nib & 4) != 0
        b3 = (nib & 8) != 0
        v01 = tl.where(b0, NF4_1, NF4_0)
        v23 = tl.where(b0, NF4_3, NF4_2)
        v45 = tl.where(b0, NF4_5, NF4_4)
        v67 = tl.where(b0, NF4_7, NF4_6)
        v89 = tl.where(b0, NF4_9, NF4_8)
        vab = tl.where(b0, NF4_11, NF4_10)
        vcd = tl.where(b0, NF4_13, NF4_12)
        vef = tl.where(b0, NF4_15, NF4_14)
        v03 = tl.where(b1, v23, v01)
        v47 = tl.where(b1, v67, v45)
        v8b = tl.where(b1, vab, v89)
        vcf = tl.where(b1, vef, vcd)
        v07 = tl.where(b2, v47, v03)
        v8f = tl.where(b2, vcf, v8b)
        v = tl.where(b3, v8f, v07).to(tl.float32)
    return v


@triton.jit
def mul(a, b, FTZ: tl.constexpr, ASM: tl.constexpr):
    """float32 a * b, rounded once; with FTZ, subnormal operands and results become signed zeros.

    ASM: use PTX `mul.rn.ftz.f32`, which flushes in the multiplier itself (one instruction), or
    without FTZ `mul.rn.f32`, which the compiler cannot contract with a following add even when
    a kernel is compiled with FMA contraction on; otherwise (Triton's interpreter has no PTX)
    flush with compares and selects.
    """
    if FTZ and ASM:
        return tl.inline_asm_elementwise("mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    elif ASM:
        # IEEE product that no compile option can contract into an FMA (explicit rounding mode)
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    elif FTZ:
        return flush(flush(a, True) * flush(b, True), True)
    else:
        return a * b


@triton.jit
def absmax_of_block(blk, ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                    DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr):
    """The float32 absmax of blocks `blk`: stored, or code2[u8] * absmax2[blk // ABSMAX_BLOCK] + offset."""
    if DOUBLE_QUANT:
        q = tl.load(absmax_ptr + blk, mask=ok, other=0)
        level = tl.load(code2_ptr + q.to(tl.int32), mask=ok, other=0.0, eviction_policy="evict_last")
        scale2 = tl.load(absmax2_ptr + blk // ABSMAX_BLOCK, mask=ok, other=0.0, eviction_policy="evict_last")
        # Two roundings: a product, then a separate IEEE add (bitsandbytes adds the offset with a
        # torch op, outside its fast-math kernel). enable_fp_fusion=False keeps them apart.
        absmax = mul(level, scale2, FTZ, ASM) + tl.load(offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + blk, mask=ok, other=0.0)
    return absmax


@triton.jit
def store_rounded(out_ptr, idx, y, mask, BF16_BITS: tl.constexpr, STORE_CM: tl.constexpr,
                  STORE_EVICT: tl.constexpr):
    # No default values on constexpr parameters: Triton 3.6 cannot compile a call that relies on one.
    """Round float32 `y` to the output dtype (RNE; integer ops for bf16 when BF16_BITS) and store it.

    STORE_CM: PTX cache modifier ("" or ".cs", ".cg", ...); STORE_EVICT: eviction policy ("" or
    "evict_first", ...).
    """
    if BF16_BITS and out_ptr.dtype.element_ty == tl.bfloat16:
        y_out = to_bf16_rne(y)
    else:
        y_out = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, y_out, mask=mask, cache_modifier=STORE_CM, eviction_policy=STORE_EVICT)


@triton.jit
def round_to(y, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """float32 `y` rounded (RNE) to dtype code DT (0 float32, 1 float16, 2 bfloat16), in that dtype."""
    if DT == 2:
        if BF16_BITS:
            r = to_bf16_rne(y)
        else:
            r = y.to(tl.bfloat16)
    elif DT == 1:
        r = y.to(tl.float16)
    else:
        r = y
    return r


@triton.jit
def operand(y, W_DT: tl.constexpr, X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """A float32 dequantized weight as a matmul operand of dtype code X_DT: rounded first to the
    weight's dtype W_DT (what `dequantize` returns), then converted to X_DT where that differs
    (bitsandbytes' `dequantize_4bit(W).to(x.dtype)`). Codes: 0 float32, 1 float16, 2 bfloat16."""
    w = round_to(y, W_DT, BF16_BITS)
    if W_DT != X_DT:
        w = round_to(w.to(tl.float32), X_DT, BF16_BITS)
    return w


@triton.jit
def widen(v, BF16_BITS: tl.constexpr):
    """A float16/bfloat16/float32 tensor as float32, exactly. With BF16_BITS a bfloat16 is widened with
    integer ops (Triton 3.9's interpreter converts bfloat16 subnormals to float32 wrongly)."""
    if BF16_BITS and v.dtype == tl.bfloat16:
        r = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        r = v.to(tl.float32)
    return r


# --- A block's 16 products in registers, looked up with PTX `prmt` (the fused linear's GEMV) --------
#
# For one absmax block, the 16 possible weights round(NF4[c] * absmax) (16-bit) are computed once and
# kept as byte planes: t0..t3 hold the low bytes of entries 0-3, 4-7, 8-11, 12-15 and t4..t7 their high
# bytes. `prmt` picks 4 bytes out of 8 by 3-bit selectors, so a 4-bit code selects in both halves of a
# plane (entries 0-7 and 8-15) and a third `prmt` keeps the half its top bit names. A 32-bit word of
# 4 packed bytes (8 weights) costs 2 x 11 instructions; the table 16 multiplies, 8 conversions, 8 prmt.


def table_asm(ftz: bool, dtype: str) -> str:
    mul_op = "mul.rn.ftz.f32" if ftz else "mul.rn.f32"
    lines = ["{", ".reg .b32 p<16>;", ".reg .b32 q<8>;"]
    lines += [f"{mul_op} p{i}, $8, 0f{int(NF4_CODE_BITS[i]):08X};" for i in range(16)]
    # cvt.rn.{bf16,f16}x2.f32 d, a, b puts a in the high half: entry 2i + 1 high, 2i low
    lines += [f"cvt.rn.{dtype}x2.f32 q{i}, p{2 * i + 1}, p{2 * i};" for i in range(8)]
    lines += [f"prmt.b32 ${i}, q{2 * i}, q{2 * i + 1}, 0x6420;" for i in range(4)]  # low bytes
    lines += [f"prmt.b32 ${4 + i}, q{2 * i}, q{2 * i + 1}, 0x7531;" for i in range(4)]  # high bytes
    return " ".join([*lines, "}"])


def _lookup_half(src: str, out0: int) -> list[str]:
    """Two output pairs from the low 16 bits of register `src` (bytes 0-1 of it: 4 codes)."""
    return [
        f"and.b32 i, {src}, 0x7777;",  # the low 3 bits of each code: a prmt selector
        "prmt.b32 l0, $5, $6, i;", "prmt.b32 l1, $7, $8, i;",  # low bytes of entries c & 7 and 8 + (c & 7)
        "prmt.b32 h0, $9, $10, i;", "prmt.b32 h1, $11, $12, i;",
        f"shr.b32 u, {src}, 1;", "and.b32 u, u, 0x4444;", "or.b32 u, u, 0x3210;",  # byte k: k, or 4 + k if c >= 8
        "prmt.b32 l, l0, l1, u;", "prmt.b32 h, h0, h1, u;",
        # byte j of the word holds element 2j in its high nibble (selector nibble 1, 3) and 2j + 1 in
        # its low one (0, 2); a pair has element 2j in its low half
        f"prmt.b32 ${out0}, l, h, 0x4051;", f"prmt.b32 ${out0 + 1}, l, h, 0x6273;",
    ]


_LOOKUP_ASM = " ".join(["{", ".reg .b32 i, u, s, l0, l1, h0, h1, l, h;", *_lookup_half("$4", 0),
                        "shr.b32 s, $4, 16;", *_lookup_half("s", 2), "}"])
_TABLE_ASM_BF16_FTZ = tl.constexpr(table_asm(True, "bf16"))
_TABLE_ASM_BF16 = tl.constexpr(table_asm(False, "bf16"))
_TABLE_ASM_F16_FTZ = tl.constexpr(table_asm(True, "f16"))
_TABLE_ASM_F16 = tl.constexpr(table_asm(False, "f16"))
LOOKUP_ASM = tl.constexpr(_LOOKUP_ASM)


@triton.jit
def product_table(absmax, FTZ: tl.constexpr, DT: tl.constexpr):
    """The byte planes (t0..t7, uint32) of round_DT(mul(NF4[c], absmax, FTZ)) for c = 0..15, per
    element of `absmax` (float32). DT: 1 float16, 2 bfloat16 (round to nearest even). GPU only (PTX)."""
    if DT == 2:
        if FTZ:
            return _table(absmax, _TABLE_ASM_BF16_FTZ)
        else:
            return _table(absmax, _TABLE_ASM_BF16)
    else:
        if FTZ:
            return _table(absmax, _TABLE_ASM_F16_FTZ)
        else:
            return _table(absmax, _TABLE_ASM_F16)


@triton.jit
def _table(absmax, ASM_TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(ASM_TEXT, "=r,=r,=r,=r,=r,=r,=r,=r,r", [absmax],
                                     dtype=(tl.uint32,) * 8, is_pure=True, pack=1)


@triton.jit
def table_pairs(word, t0, t1, t2, t3, t4, t5, t6, t7):
    """A 32-bit word of 4 packed bytes -> 4 uint32 pairs of 16-bit weights from its block's table
    (`product_table`): pair j holds element 2j (the high nibble of byte j) in its low half and
    element 2j + 1 in its high half, the order of x's 16-bit pairs. GPU only (PTX)."""
    return tl.inline_asm_elementwise(LOOKUP_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                     [word, t0, t1, t2, t3, t4, t5, t6, t7],
                                     dtype=(tl.uint32,) * 4, is_pure=True, pack=1)


# --- Tensor-core products for the GEMV (mma.sync m16n8k16, float32 accumulation) ----------------
#
# These helpers work on 1-D tensors of one element per thread (tl.arange(0, 32 * num_warps)): element i
# lives in lane i % 32 of warp i // 32, so an `mma.sync` issued by the whole warp sees element i's
# registers as lane i's fragment. GPU only (PTX); sm_80 or later.

MMA_BF16 = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
                        "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
MMA_F16 = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
                       "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
LD_V4_STREAM = tl.constexpr("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];")
LD_V4 = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def mma_16x8x16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, DT: tl.constexpr):
    """D = A @ B + C for the warp's 16x16 A (row-major fragments a0..a3: pairs of 16-bit values), 16x8 B
    (b0, b1) and 16x8 float32 C / D (c0..c3), as PTX's m16n8k16 fragments: lane 4g + t holds A rows g and
    g + 8 at columns 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3), B rows 2t, 2t + 1 (b0) and 2t + 8,
    2t + 9 (b1) of column g, and D rows g (d0, d1) and g + 8 (d2, d3) at columns 2t and 2t + 1.
    DT: 1 float16, 2 bfloat16 operands."""
    if DT == 2:
        return tl.inline_asm_elementwise(MMA_BF16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                         [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(MMA_F16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                         [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)


@triton.jit
def load_v4(ptr, STREAM: tl.constexpr):
    """4 uint32 words from a 16-byte aligned pointer per element (one vector load; no mask: keep it in bounds).
    STREAM: do not keep the line in L1 (data read once)."""
    if STREAM:
        return tl.inline_asm_elementwise(LD_V4_STREAM, "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32,) * 4,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(LD_V4, "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32,) * 4, is_pure=True,
                                         pack=1)
