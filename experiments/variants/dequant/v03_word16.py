"""v03: one 16-byte row per thread (the third production kernel): 32 weights from one vector load.

Teaches the widest load: a thread loads 16 packed bytes at once, splits the four words apart in
registers (tl.split) and writes its 32 outputs with four 16-byte stores in the same register
layout (no shared-memory relayout). The catch, measured on an H200 by the production work: a
warp's stores now stride 64 bytes apart per instruction instead of covering 512 contiguous
bytes (v02). The last partial row takes a byte path in one extra program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_word8, tail_bytes
from experiments.registry import register
from nf4.device import absmax_of_block

TILE_BYTES = 2048  # packed bytes per program
NUM_WARPS = 4


@triton.jit
def _word16_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes, n_rows,  # n_rows: whole rows of 16 packed bytes (0 when not VEC)
    # meta-parameters
    BLOCKSIZE: tl.constexpr, TILE_BYTES: tl.constexpr, VEC: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    R: tl.constexpr = TILE_BYTES // 16  # rows per program
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    if VEC:
        if pid * R < n_rows:
            rows = pid * R + tl.arange(0, R)
            ok = rows < n_rows
            words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
            words = tl.load(words_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0,
                            eviction_policy="evict_first")
            absmax = absmax_of_block(rows // (BLOCKSIZE // 32), ok, absmax_ptr, absmax2_ptr, code2_ptr,
                                      offset_ptr, True, FTZ, ASM)
            even, odd = tl.split(tl.reshape(words, (R, 2, 2)))  # even = words 0, 2; odd = words 1, 3
            word0, word2 = tl.split(even)
            word1, word3 = tl.split(odd)
            base = rows[:, None] * 32
            m = ok[:, None]
            store_word8(out_ptr, base, word0, absmax, code_ptr, m, FTZ, ASM, BF16_BITS, "evict_last", "", "")
            store_word8(out_ptr, base + 8, word1, absmax, code_ptr, m, FTZ, ASM, BF16_BITS, "evict_last", "", "")
            store_word8(out_ptr, base + 16, word2, absmax, code_ptr, m, FTZ, ASM, BF16_BITS, "evict_last", "", "")
            store_word8(out_ptr, base + 24, word3, absmax, code_ptr, m, FTZ, ASM, BF16_BITS, "evict_last", "", "")
        else:  # the program past the whole rows: the last partial row
            tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                       n_rows * 16 + tl.arange(0, 16), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)
    else:
        tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                   pid * TILE_BYTES + tl.arange(0, TILE_BYTES), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)


@register("v03_word16", parent="v02_word4",
          change="one 16-byte row per thread: tl.split into 4 words, four 16-byte stores", kernel=_word16_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    vec, n_rows, grid = common.unit_plan(packed, s.n, TILE_BYTES, 16)
    common.launch(_word16_kernel, grid, packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, out, s.n,
                  (s.n + 1) // 2, n_rows, s.blocksize, TILE_BYTES, vec, ftz, asm, bf16_bits, num_warps=NUM_WARPS)
    return out
