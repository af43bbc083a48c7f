"""v05: a 3-D [NBLK, RPB, 4]-byte tile: each thread owns rows of 4 bytes (the second production kernel).

Teaches keeping load and store in one register layout: a thread's 4-byte row becomes its 8
outputs (16 bytes in fp16) without a shuffle, while the absmax still broadcasts per block along
dims 1 and 2. A thread repeats this over several rows, each a separate 4-byte load; v03 then
widens the row to 16 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded
from experiments.registry import register
from nf4.device import absmax_of_block, mul

TILE_BYTES = 2048  # packed bytes per program
BPR = 4  # packed bytes per thread row
NUM_WARPS = 4


@triton.jit
def _rows3d_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes, n_blocks,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, NBLK: tl.constexpr, BPR: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    RPB: tl.constexpr = BLOCKSIZE // (2 * BPR)  # rows per absmax block
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
    absmax = absmax_of_block(blk, blk < n_blocks, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                              ASM)[:, None, None]
    row = blk[:, None, None] * RPB + tl.arange(0, RPB)[None, :, None]
    byte_idx = row * BPR + tl.arange(0, BPR)[None, None, :]
    byte = tl.load(packed_ptr + byte_idx, mask=byte_idx < n_bytes, other=0, eviction_policy="evict_first")
    hi = mul(tl.load(code_ptr + (byte >> 4).to(tl.int32), eviction_policy="evict_last"), absmax, FTZ, ASM)
    lo = mul(tl.load(code_ptr + (byte & 0xF).to(tl.int32), eviction_policy="evict_last"), absmax, FTZ, ASM)
    y = tl.reshape(tl.join(hi, lo), (NBLK, RPB, 2 * BPR))  # element 2k = high nibble of byte k
    out_idx = row * (2 * BPR) + tl.arange(0, 2 * BPR)[None, None, :]
    store_rounded(out_ptr, out_idx, y, out_idx < n, BF16_BITS, "", "")


@register("v05_rows3d", parent="v04_rows2d",
          change="3-D [NBLK, RPB, 4]-byte tile: 4-byte rows per thread, load and store in one layout",
          kernel=_rows3d_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    nblk = max(1, TILE_BYTES // (s.blocksize // 2))
    common.launch(_rows3d_kernel, (triton.cdiv(s.n_blocks, nblk),), packed, s.absmax_u8, s.absmax2, s.code2,
                  s.offset, s.code, out, s.n, (s.n + 1) // 2, s.n_blocks, s.blocksize, nblk, BPR, ftz, asm,
                  bf16_bits, num_warps=NUM_WARPS)
    return out
