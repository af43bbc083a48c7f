"""v21: the NF4 codebook in PTX: a 16-entry table lookup with byte permutes (prmt.b32), 8 levels per call.

Teaches custom asm that stays bit-exact. The production kernel's word layout (own copy, at
the production DequantConfig's tile, warps and hints) with only the codebook changed. One `tl.inline_asm_elementwise`
call takes a packed 32-bit word and returns the float32 bits of its 8 levels. The table lives in 16 immediates: for each
byte j of a float32, four registers hold byte j of the 16 levels (levels 0-3, 4-7, 8-11, 12-15).
For 4 codes at once, `prmt` picks byte j by the low 3 bits of each code from the low and the high
half of the table, a third `prmt` chooses per lane by bit 3, and 8 more `prmt` transpose the 4x4
bytes into 4 floats: 20 permutes and 4 logic ops per 4 levels, no memory access, no selects.

Triton's interpreter cannot run PTX: there the same function computes the 8 levels with the
table gather (the join order is shared, so the interpreter checks it); the PTX itself is checked
bit-exact on the GPU run, and by the PTX-subset emulator in tests/test_experiments.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded, tail_bytes
from experiments.registry import register
from nf4.device import absmax_of_block, mul, nf4_level
from reference.format import NF4_CODE_BITS


def _plane(j: int, first: int) -> int:
    """Byte j of levels first..first+3, packed little-endian into one 32-bit immediate."""
    return sum(((int(NF4_CODE_BITS[first + k]) >> (8 * j)) & 0xFF) << (8 * k) for k in range(4))


def _group(src: str, outs: list[str]) -> list[str]:
    """PTX for 4 levels whose codes are the 4 low nibbles of register `src` (code k in bits 4k..4k+3)."""
    lines = [f"and.b32 c, {src}, 0x7777;",  # low 3 bits of each code: prmt byte selectors
             f"shr.b32 h, {src}, 1;", "and.b32 h, h, 0x4444;",
             "or.b32 h, h, 0x3210;"]  # lane k picks lane k of the low (0-3) or high half (4-7) by bit 3
    for j in range(4):
        lines += [f"prmt.b32 lo, {_plane(j, 0):#010x}, {_plane(j, 4):#010x}, c;",
                  f"prmt.b32 hi, {_plane(j, 8):#010x}, {_plane(j, 12):#010x}, c;",
                  f"prmt.b32 r{j}, lo, hi, h;"]  # r_j lane k = byte j of level(code k)
    lines += ["prmt.b32 t0, r0, r1, 0x5140;", "prmt.b32 t1, r0, r1, 0x7362;",  # 4x4 byte transpose
              "prmt.b32 t2, r2, r3, 0x5140;", "prmt.b32 t3, r2, r3, 0x7362;",
              f"prmt.b32 {outs[0]}, t0, t2, 0x5410;", f"prmt.b32 {outs[1]}, t0, t2, 0x7632;",
              f"prmt.b32 {outs[2]}, t1, t3, 0x5410;", f"prmt.b32 {outs[3]}, t1, t3, 0x7632;"]
    return lines


# $8: the packed word; $0..$7: float32 bits of elements 0..7 (element 2j = high nibble of byte j).
PRMT_PTX = tl.constexpr("\n".join([
    "{",
    ".reg .b32 s, u, c, h, lo, hi, r0, r1, r2, r3, t0, t1, t2, t3;",
    "shr.b32 u, $8, 4;", "and.b32 u, u, 0x0F0F0F0F;",  # swap the nibbles of each byte:
    "shl.b32 s, $8, 4;", "and.b32 s, s, 0xF0F0F0F0;",  # code of element k -> bits 4k..4k+3
    "or.b32 s, s, u;",
    *_group("s", ["$0", "$1", "$2", "$3"]),
    "shr.b32 s, s, 16;",
    *_group("s", ["$4", "$5", "$6", "$7"]),
    "}",
]))


@triton.jit
def _levels8(word, code_ptr, ASM: tl.constexpr):
    """[R] packed words -> [R, 8] float32 NF4 levels, elements 0..7 of each word."""
    if ASM:
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            PRMT_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [word],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    else:  # the interpreter: the same 8 levels by table gather
        e0 = nf4_level(((word >> 4) & 0xF).to(tl.int32), code_ptr, 0)
        e1 = nf4_level((word & 0xF).to(tl.int32), code_ptr, 0)
        e2 = nf4_level(((word >> 12) & 0xF).to(tl.int32), code_ptr, 0)
        e3 = nf4_level(((word >> 8) & 0xF).to(tl.int32), code_ptr, 0)
        e4 = nf4_level(((word >> 20) & 0xF).to(tl.int32), code_ptr, 0)
        e5 = nf4_level(((word >> 16) & 0xF).to(tl.int32), code_ptr, 0)
        e6 = nf4_level(((word >> 28) & 0xF).to(tl.int32), code_ptr, 0)
        e7 = nf4_level(((word >> 24) & 0xF).to(tl.int32), code_ptr, 0)
    # join adds a trailing axis, so the innermost join picks the lowest index bit: [R, 2, 2, 2] -> [R, 8]
    y = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(y, (word.shape[0], 8))


@triton.jit(do_not_specialize=["n_words"])
def _prmt_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes, n_words,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, TILE_BYTES: tl.constexpr, VEC: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    BF16_BITS: tl.constexpr, PACKED_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    W: tl.constexpr = TILE_BYTES // 4  # words per program
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    if VEC:
        if pid * W < n_words:
            w = pid * W + tl.arange(0, W)
            ok = w < n_words
            word = tl.load(packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + w, mask=ok, other=0,
                           eviction_policy=PACKED_EVICT)
            absmax = absmax_of_block(w // (BLOCKSIZE // 8), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                      True, FTZ, ASM)
            y = mul(_levels8(word, code_ptr, ASM), absmax[:, None], FTZ, ASM)
            store_rounded(out_ptr, w[:, None] * 8 + tl.arange(0, 8)[None, :], y, ok[:, None], BF16_BITS,
                          STORE_CACHE, "")
        else:  # the program past the whole words: the last 1-3 bytes (table gather)
            tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                       n_words * 4 + tl.arange(0, 4), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)
    else:
        tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                   pid * TILE_BYTES + tl.arange(0, TILE_BYTES), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)


@register("v21_prmt_lut", parent="v51_cached_launch",
          change="codebook: inline PTX prmt.b32 byte-table lookup, 8 levels per asm call from the packed word",
          kernel=_prmt_kernel, note="interpreter runs the gather fallback; the PTX is checked on the GPU run")
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    _, bf16_bits = common.flags(packed, ftz)
    asm = not common.interpreting(packed)  # the lookup is PTX whatever ftz says
    vec, n_words, grid = common.unit_plan(packed, s.n, common.PRODUCTION.tile_bytes, 4)
    common.launch(_prmt_kernel, grid, packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, out, s.n,
                  (s.n + 1) // 2, n_words, s.blocksize, common.PRODUCTION.tile_bytes, vec, ftz, asm, bf16_bits,
                  common.PRODUCTION.evict_stream, common.PRODUCTION.store_cm, num_warps=common.PRODUCTION.num_warps)
    return out
