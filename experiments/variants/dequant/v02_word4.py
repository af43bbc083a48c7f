"""v02: one 4-byte word per thread: 8 weights from one 32-bit load, written with one 16-byte store.

Teaches the word as a unit (8 weights, never straddling an absmax block) and the shift table of
a little-endian word (byte j is bits 8j..8j+7, its high nibble is element 2j). Consecutive
threads take consecutive words, so a warp's stores cover 512 contiguous bytes. The load is masked
with an unspecialised n_words so that Triton cannot merge 4 words into one 16-byte load per
thread (v03 does that on purpose). The last 1-3 bytes take a byte path in one extra program.
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


@triton.jit(do_not_specialize=["n_words"])
def _word4_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes, n_words,  # n_words: whole 4-byte words (0 when not VEC)
    # meta-parameters
    BLOCKSIZE: tl.constexpr, TILE_BYTES: tl.constexpr, VEC: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    W: tl.constexpr = TILE_BYTES // 4  # words per program
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    if VEC:
        if pid * W < n_words:
            w = pid * W + tl.arange(0, W)
            ok = w < n_words
            word = tl.load(packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + w, mask=ok, other=0)
            absmax = absmax_of_block(w // (BLOCKSIZE // 8), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                      True, FTZ, ASM)
            store_word8(out_ptr, w[:, None] * 8, word, absmax, code_ptr, ok[:, None], FTZ, ASM, BF16_BITS,
                        "evict_last", "", "")
        else:  # the program past the whole words: the last 1-3 bytes
            tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                       n_words * 4 + tl.arange(0, 4), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)
    else:
        tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                   pid * TILE_BYTES + tl.arange(0, TILE_BYTES), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)


@register("v02_word4", parent="v01_byte_pairs", change="one 4-byte word per thread: 8 weights, one 16-byte store",
          kernel=_word4_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    vec, n_words, grid = common.unit_plan(packed, s.n, TILE_BYTES, 4)
    common.launch(_word4_kernel, grid, packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, out, s.n,
                  (s.n + 1) // 2, n_words, s.blocksize, TILE_BYTES, vec, ftz, asm, bf16_bits, num_warps=NUM_WARPS)
    return out
