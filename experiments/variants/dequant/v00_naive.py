"""v00: the naive kernel: one output element per lane, every parameter gathered per element.

Teaches the baseline cost of the format: each weight reads its packed byte, absmax_u8, code2,
absmax2 and the offset on its own (the caches absorb most of it, but the instruction count and
the byte-wide loads remain). Checked bit-exact like every other variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded
from experiments.registry import register
from nf4.device import mul

BLOCK = 1024  # output elements per program
NUM_WARPS = 4


@triton.jit
def _naive_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr,
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + offs // 2, mask=mask, other=0)
    nib = tl.where(offs % 2 == 0, byte >> 4, byte & 0xF).to(tl.int32)  # element 2k: high nibble of byte k
    blk = offs // BLOCKSIZE
    q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
    level2 = tl.load(code2_ptr + q, mask=mask, other=0.0)
    scale2 = tl.load(absmax2_ptr + blk // 256, mask=mask, other=0.0)
    offset = tl.load(offset_ptr + offs * 0)  # gathered per element too, on purpose
    absmax = mul(level2, scale2, FTZ, ASM) + offset
    y = mul(tl.load(code_ptr + nib), absmax, FTZ, ASM)
    store_rounded(out_ptr, offs, y, mask, BF16_BITS, "", "")


@register("v00_naive", parent=None, change="one output element per lane; every parameter gathered per element",
          kernel=_naive_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    common.launch(_naive_kernel, (triton.cdiv(s.n, BLOCK),), packed, s.absmax_u8, s.absmax2, s.code2, s.offset,
                  s.code, out, s.n, s.blocksize, BLOCK, ftz, asm, bf16_bits, num_warps=NUM_WARPS)
    return out
