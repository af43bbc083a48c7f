"""v06: v04's tile of whole absmax blocks, with the two nibble planes interleaved instead of joined.

Teaches what the output relayout costs. Unsloth 2026.10.9's one-launch kernel, measured as a peer
(its layout read from running it, not copied), also keeps one absmax block per tile row and loads
bytes, but writes the planes with an interleave, about 2 KiB of packed bytes per program on large
weights, and ran close to nf4 where v04 did not. `tl.interleave(hi, lo)` puts element 2k (the high
nibble of byte k) and 2k + 1 side by side in the register layout the stores want; v04's
join + reshape does not. A grid over packed bytes per program and warps.
"""

from __future__ import annotations

import itertools

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_rounded
from experiments.registry import register
from nf4.device import absmax_of_block, high_nibble, low_nibble, mul, nf4_level

TILE_BYTES = (1024, 2048, 4096)
NUM_WARPS = (4, 8)


@triton.jit
def _rows_interleave_kernel(
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
    byte = tl.load(packed_ptr + byte_idx, mask=2 * byte_idx < n, other=0)
    hi = mul(nf4_level(high_nibble(byte), code_ptr, 0), absmax, FTZ, ASM)
    lo = mul(nf4_level(low_nibble(byte), code_ptr, 0), absmax, FTZ, ASM)
    y = tl.interleave(hi, lo)  # [ROWS, BLOCKSIZE]: element 2k = high nibble of byte k
    out_idx = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    store_rounded(out_ptr, out_idx, y, out_idx < n, BF16_BITS, "", "")


def _launcher(tile_bytes, num_warps):
    def run(packed, quant_state, out, *, ftz):
        s = common.state_of(packed, quant_state)
        asm, bf16_bits = common.flags(packed, ftz)
        rows = max(1, tile_bytes // (s.blocksize // 2))
        common.launch(_rows_interleave_kernel, (triton.cdiv(s.n_blocks, rows),), packed, s.absmax_u8, s.absmax2,
                      s.code2, s.offset, s.code, out, s.n, s.n_blocks, s.blocksize, rows, ftz, asm, bf16_bits,
                      num_warps=num_warps)
        return out

    return run


for _tile, _warps in itertools.product(TILE_BYTES, NUM_WARPS):
    register(f"v06_t{_tile:04d}_w{_warps}", parent="v04_rows2d",
             change=f"interleaved nibble planes (no join+reshape), {_tile} packed bytes per program, {_warps} warps",
             kernel=_rows_interleave_kernel, module=__name__)(_launcher(_tile, _warps))
