"""v01: one packed byte per lane, both of its nibbles, interleaved back with tl.join + reshape.

Teaches that a byte is the natural unit of the format (two weights, same block): half the index
math and gathers of v00, and the join/reshape puts element 2k (high nibble) before 2k+1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded
from experiments.registry import register
from nf4.device import absmax_of_block, mul

BLOCK = 1024  # packed bytes per program (2 * BLOCK outputs)
NUM_WARPS = 4


@triton.jit
def _byte_pairs_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr,
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    byte_idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = byte_idx < n_bytes
    byte = tl.load(packed_ptr + byte_idx, mask=ok, other=0)
    absmax = absmax_of_block(byte_idx // (BLOCKSIZE // 2), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                              True, FTZ, ASM)
    hi = mul(tl.load(code_ptr + (byte >> 4).to(tl.int32)), absmax, FTZ, ASM)
    lo = mul(tl.load(code_ptr + (byte & 0xF).to(tl.int32)), absmax, FTZ, ASM)
    y = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))  # [hi0, lo0, hi1, lo1, ...]
    idx = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    store_rounded(out_ptr, idx, y, idx < n, BF16_BITS, "", "")


@register("v01_byte_pairs", parent="v00_naive", change="one packed byte per lane, both nibbles (join + reshape)",
          kernel=_byte_pairs_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    n_bytes = (s.n + 1) // 2
    common.launch(_byte_pairs_kernel, (triton.cdiv(n_bytes, BLOCK),), packed, s.absmax_u8, s.absmax2, s.code2,
                  s.offset, s.code, out, s.n, n_bytes, s.blocksize, BLOCK, ftz, asm, bf16_bits, num_warps=NUM_WARPS)
    return out
