"""What the Gluon labs (gluon_gemm.py, gluon_ws.py) share: the exact product-table asm, the double-quantized absmax,
the TMA load under both Triton versions' names, the swap-AB epilogue, the split-K choice."""

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


@gluon.jit
def _store_out(acc, off_n, off_m, M, N, bias_ptr, out_ptr, part_ptr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The swap-AB epilogue: acc [BN rows of W, BM rows of x] (float32) -> out[m, n] rounded to bf16 (+ bias), or with
    SPLIT > 1 the float32 partial sums, which nf4_split_sum_kernel adds in split order with the bias and rounds."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    ACC: gl.constexpr = acc.type.layout
    n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
    mask = gl.expand_dims(n < N, 1) & gl.expand_dims(m < M, 0)
    idx = gl.expand_dims(m, 0) * N + gl.expand_dims(n, 1)
    if SPLIT > 1:
        gl.store(part_ptr + gl.program_id(2) * M * N + idx, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32), 1)
        gl.store(out_ptr + idx, acc.to(gl.bfloat16), mask=mask)


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
