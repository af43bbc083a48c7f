"""v22: the 16-byte row load written in PTX: `ld.global.nc.L1::no_allocate.v4.b32` through inline asm.

Teaches loading through inline asm: the asm takes one pointer per row and returns its four
32-bit words, read through the non-coherent (read-only) path without allocating in L1, the
packed stream being read exactly once. Asm loads cannot be masked, so rows past the end are
clamped to the last full row (their stores stay masked). Everything after the load is v03.
The interpreter cannot run PTX: there the words come from tl.load (the rest is checked); the
PTX load is checked bit-exact on the GPU run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_word8, tail_bytes
from experiments.registry import register
from nf4.device import absmax_of_block

TILE_BYTES = 2048
NUM_WARPS = 4
LD_NC_V4 = tl.constexpr("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _ld_nc_kernel(
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
            if ASM:
                row_ptr = words_ptr + tl.minimum(rows, n_rows - 1) * 4  # in bounds: asm loads have no mask
                word0, word1, word2, word3 = tl.inline_asm_elementwise(
                    LD_NC_V4, "=r,=r,=r,=r,l", [row_ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                    is_pure=True, pack=1)
            else:  # the interpreter
                words = tl.load(words_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0)
                even, odd = tl.split(tl.reshape(words, (R, 2, 2)))
                word0, word2 = tl.split(even)
                word1, word3 = tl.split(odd)
            absmax = absmax_of_block(rows // (BLOCKSIZE // 32), ok, absmax_ptr, absmax2_ptr, code2_ptr,
                                      offset_ptr, True, FTZ, ASM)
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


@register("v22_ld_nc_asm", parent="v03_word16",
          change="row load in inline PTX: ld.global.nc.L1::no_allocate.v4.b32 from a row pointer",
          kernel=_ld_nc_kernel, note="interpreter loads with tl.load; the PTX load is checked on the GPU run")
def run(packed, quant_state, out, *, ftz):
    s = common.state_of(packed, quant_state)
    _, bf16_bits = common.flags(packed, ftz)
    asm = not common.interpreting(packed)
    vec, n_rows, grid = common.unit_plan(packed, s.n, TILE_BYTES, 16)
    common.launch(_ld_nc_kernel, grid, packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, out, s.n,
                  (s.n + 1) // 2, n_rows, s.blocksize, TILE_BYTES, vec, ftz, asm, bf16_bits, num_warps=NUM_WARPS)
    return out
