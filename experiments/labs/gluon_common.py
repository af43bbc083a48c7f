"""What the Gluon labs (gluon_gemm.py, gluon_ws.py) share: the exact product-table asm, the double-quantized absmax,
the TMA load under both Triton versions' names, the split-K choice."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from nf4.device import table_asm

TABLE_BF16_FTZ = gl.constexpr(table_asm(True, "bf16"))
# Triton 3.6 (the GPU machines) names the TMA load async_copy_global_to_shared; 3.9 (CI's offline builds) async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
ABSMAX_BLOCK = gl.constexpr(256)  # blocks of absmax per absmax2 scale (bitsandbytes' double quantization)


@gluon.jit
def _absmax(q, blk, ok, absmax2_ptr, code2_ptr, offset):
    """Double quantization: code2[q] * absmax2[blk // 256] (mul.rn.ftz) + offset for absmax bytes q of blocks blk,
    as bitsandbytes (two roundings)."""
    level = gl.load(code2_ptr + q.to(gl.int32), mask=ok, other=0.0)
    scale2 = gl.load(absmax2_ptr + blk // ABSMAX_BLOCK, mask=ok, other=0.0)
    prod = gl.inline_asm_elementwise("mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [level, scale2], dtype=gl.float32,
                                     is_pure=True, pack=1)
    return prod + offset


def splits(tiles: int, steps: int, split: int, sms: int = 132) -> int:
    if split:
        return split
    best = 1
    for s in range(1, 17):
        if steps // s < 8:
            break
        if abs(tiles * s - 2 * sms) < abs(tiles * best - 2 * sms):
            best = s
    return best


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
