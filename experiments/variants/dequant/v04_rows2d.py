"""v04: a 2-D tile of whole absmax blocks, [ROWS, BLOCKSIZE / 2] bytes, one absmax per row.

Teaches the per-block broadcast: the absmax is recovered once per block (ROWS per program, not
once per byte) and broadcast along the row. The price is the output relayout: join + reshape of
the [ROWS, HALF] nibble planes into [ROWS, BLOCKSIZE] does not keep the load's register layout,
so the compiler moves the tile through shared memory (see `--sm75`: shared bytes, bar.sync).
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded
from experiments.registry import register
from nf4.device import absmax_of_block, mul

TILE_BYTES = 2048  # packed bytes per program
NUM_WARPS = 4


@triton.jit
def _rows2d_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_blocks,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, ROWS: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr,
):
    HALF: tl.constexpr = BLOCKSIZE // 2  # packed bytes per absmax block
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    absmax = absmax_of_block(blk, blk < n_blocks, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                              ASM)[:, None]
    byte_idx = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
    elem_hi = 2 * byte_idx
    byte = tl.load(packed_ptr + byte_idx, mask=elem_hi < n, other=0)
    hi = mul(tl.load(code_ptr + (byte >> 4).to(tl.int32)), absmax, FTZ, ASM)
    lo = mul(tl.load(code_ptr + (byte & 0xF).to(tl.int32)), absmax, FTZ, ASM)
    y = tl.reshape(tl.join(hi, lo), (ROWS, BLOCKSIZE))
    out_idx = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    store_rounded(out_ptr, out_idx, y, out_idx < n, BF16_BITS, "", "")


@register("v04_rows2d", parent="v01_byte_pairs",
          change="2-D [ROWS, BLOCKSIZE/2] byte tile: one absmax per row, broadcast; join+reshape output",
          kernel=_rows2d_kernel)
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    asm, bf16_bits = common.flags(packed, ftz)
    rows = max(1, TILE_BYTES // (s.blocksize // 2))
    common.launch(_rows2d_kernel, (triton.cdiv(s.n_blocks, rows),), packed, s.absmax_u8, s.absmax2, s.code2,
                  s.offset, s.code, out, s.n, s.n_blocks, s.blocksize, rows, ftz, asm, bf16_bits,
                  num_warps=NUM_WARPS)
    return out
