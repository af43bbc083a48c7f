"""What the Gluon labs (gluon_gemm.py, gluon_ws.py) share: the exact product-table asm, and from the product's Gluon
GEMM (nf4.linear.gemm_gluon) the double-quantized absmax, the TMA load under both Triton versions' names and the
swap-AB epilogue; the split-K choice and second pass."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from nf4.device import table_asm
from nf4.linear.gemm_gluon import SINGLE_MUL, store_tile
from nf4.linear.gemm_gluon import block_absmax as product_absmax
from nf4.linear.gemm_gluon import tma_load as _tma_load  # noqa: F401 (the labs' name)

TABLE_BF16_FTZ = gl.constexpr(table_asm(True, "bf16"))
MUL_FTZ = gl.constexpr(SINGLE_MUL[True])


@gluon.jit
def _absmax(q, blk, ok, absmax2_ptr, code2_ptr, offset):
    """Double quantization: code2[q] * absmax2[blk // 256] (mul.rn.ftz) + offset for absmax bytes q of blocks blk,
    as bitsandbytes (two roundings): the product GEMM's (nf4.linear.gemm_gluon)."""
    return product_absmax(q, blk, ok, absmax2_ptr, code2_ptr, offset, True, MUL_FTZ)


@gluon.jit
def _store_out(acc, off_n, off_m, M, N, bias_ptr, out_ptr, part_ptr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The swap-AB epilogue (the product GEMM's): out[m, n] rounded to bf16 (+ bias), or with SPLIT > 1 the float32
    partial sums, which nf4_split_sum_kernel adds in split order with the bias and rounds."""
    if SPLIT > 1:
        store_tile(acc, off_n, off_m, M, N, bias_ptr, part_ptr, True, False, gl.bfloat16)
    else:
        store_tile(acc, off_n, off_m, M, N, bias_ptr, out_ptr, False, HAS_BIAS, gl.bfloat16)


def splits(tiles: int, steps: int, split: int, sms: int = 132) -> int:
    """split-K: `split` if set, else the count (at most 16, at least 8 steps each) that brings tiles x splits nearest
    two programs a multiprocessor."""
    if split:
        return split
    best = 1
    for s in range(1, 17):
        if steps // s < 8:
            break
        if abs(tiles * s - 2 * sms) < abs(tiles * best - 2 * sms):
            best = s
    return best


_PARTS: dict = {}


def partial_sums(split: int, m: int, n: int, out):
    """The float32 [split, m, n] buffer of split-K's partial sums (kept per shape and device), or `out` itself when
    there is one split (the kernels then round and store there)."""
    import torch

    if split <= 1:
        return out
    key = (split, m, n, out.device)
    part = _PARTS.get(key)
    if part is None:
        part = _PARTS[key] = torch.empty(split, m, n, device=out.device, dtype=torch.float32)
    return part


def sum_splits(part, bias, out, split: int):
    """split-K's second pass: out = round(((part[0] + part[1]) + ...) + bias), nf4.linear's split-sum kernel (bf16
    rounded with integer ops in Triton's interpreter, whose float32 -> bf16 conversion does not round to nearest even,
    as nf4.linear does)."""
    from nf4.linear.common import nf4_split_sum_kernel
    from nf4.runtime import interpreter_on

    if split <= 1:
        return
    mn = out.numel()
    nf4_split_sum_kernel[(triton_cdiv(mn, 1024),)](part, bias if bias is not None else out, out, mn, out.shape[-1],
                                                   SPLIT=split, HAS_BIAS=bias is not None, X_DT=2,
                                                   BF16_BITS=interpreter_on(), BLOCK=1024)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
