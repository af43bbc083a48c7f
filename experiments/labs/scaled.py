"""The GEMV lab's second numerical contract (opt-in; not bitsandbytes' bits): the block's scale applied to float32
partial sums, never to a rounded weight.

    y[m, n] = sum over the absmax blocks b of row n of  absmax[n, b] * (sum over k in b of x[m, k] * L[c[n, k]])

L holds the 16 NF4 levels rounded once to x's dtype, the same for every block. So the decode is one shared-memory
lookup per byte of a pair of levels, and nothing else: no per-block table, no FMUL, no conversion.

Why: with x's loads made cheap (`_xp`), the TMA stream at the same-bytes GEMV's speed, and the no-decode
controls at 1.3-1.7x it, the exact decodes stayed at 1.9-2.7x (results/labs/gemv_bulk_h200.json). The exact operand
round(NF4[c] * absmax) needs, per weight, a product by the block's absmax and a rounding, or a per-block table,
on top of the lookup. Issue 34 allows this contract only as an opt-in beside the exact one, with its own model and
error bound.

Lanes: the first skeleton's (kernels.py: each warp owns 16 rows, lane 4g + t, rows g and g + 8), but each 128-byte
step of a row is four 32-byte absmax blocks, and lane t takes bytes 8t .. 8t + 7 of each (two words). So the 16 k
of every mma.sync.m16n8k16 belong to one block. Per block, the lane's two words of rows g and g + 8 feed 4 chained
mma.sync from zero, and the block's D fragment is scaled by the rows' absmax into float32 totals (4 FFMA). x's
loads are `_xp`'s: 16 bytes a word, only in lanes whose x row exists. M <= 8.

The table (`LEVEL_COPIES` = 32 interleaved copies, 32 KiB): entry e holds L[e >> 4] in its low half (element 2j is
the byte's high nibble) and L[e & 15] in its high half; copy c of entry e is at base + e * 128 + 4c, so that lane l
reads copy l % 32. Conflict-free whatever the bytes. The byte's offset is made by multiplies, as in
nf4.linear.gemv_pair.pair_asm (FMA pipe). Per 8 weights: 2 LOP3, 6 IMAD, 4 LDS.32. Lane t makes the absmax of the
step's block t of its two rows, and the row's 4 lanes pass them round with SHFL (8 a step).

`model(x, w_q, x_dtype)` is the contract in float64 (NumPy). `bound(...)` is the float32 accumulation bound of the
kernel against it: each block's partial is a sum of 64 exact products (bf16 x bf16 and fp16 x fp16 are exact in
float32) in a tensor-core order, then one FFMA per block into the row's total, in block order. Both are used by
`check` (gemv_lut's check for this module; on a GPU). GPU only (inline PTX, sm_80+).
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from nf4.device import absmax_of_block, mma_16x8x16

from . import kernels as K

LEVEL_COPIES = 32
TABLE = "nf4lab_level_pairs"
STEP = tl.constexpr(128)
_COPIES = tl.constexpr(LEVEL_COPIES)


def table_shift(copies: int = LEVEL_COPIES) -> int:
    """log2 of the byte stride of the table's entries: 4 bytes per copy."""
    s = int(math.log2(4 * copies))
    if 4 * copies != 2**s or s > 8:
        raise ValueError(f"copies must be a power of two up to 64, got {copies}")
    return s


def lookup_asm() -> str:
    """$0-$3: the level pairs of bytes 0-3 of word $4; $5 X = lanebase << (16 - s), $6 2^16, $7 2^8, $8 1,
    $9 2^(16 + s), $10 2^(8 + s), $11 lanebase (table base + 4 * the lane's copy). The address arithmetic is
    nf4.linear.gemv_pair.pair_asm's with 4-byte entries."""
    lines = ["{", ".reg .b32 v0, v1, u0, u1, u2, t3, a0, a1, a2, a3;",
             "and.b32 v0, $4, 0x00FF00FF;", "and.b32 v1, $4, 0xFF00FF00;",
             "mad.lo.u32 u0, v0, $6, $5;", "mad.lo.u32 u1, v1, $7, $5;", "mad.lo.u32 u2, v0, $8, $5;",
             "mul.hi.u32 a0, u0, $9;", "mul.hi.u32 a1, u1, $9;", "mul.hi.u32 a2, u2, $9;",
             "mul.hi.u32 t3, v1, $10;", "mad.lo.u32 a3, t3, $8, $11;"]
    lines += [f"ld.shared.b32 ${k}, [a{k}];" for k in range(4)]
    return " ".join([*lines, "}"])


LOOKUP = tl.constexpr(lookup_asm())
DECLARE = tl.constexpr(f".shared .align 16 .b8 {TABLE}[{256 * 4 * LEVEL_COPIES}]; mov.u32 $0, {TABLE};")
ST_B32 = tl.constexpr("st.shared.b32 [$1], $2; mov.u32 $0, 0;")
LD_V2 = tl.constexpr("ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [$2];")
SHFL = tl.constexpr("shfl.sync.idx.b32 $0, $1, $2, 31, -1;")  # $1 of lane $2, across the warp


@triton.jit
def _fill(lev_ptr, THREADS: tl.constexpr):
    """Declare and fill the table from lev_ptr (16 int32: the rounded levels' 16-bit patterns), then a barrier;
    returns its base (uint32, one per thread)."""
    i = tl.arange(0, THREADS)
    base = tl.inline_asm_elementwise(DECLARE, "=r,r", [i], dtype=tl.uint32, is_pure=False, pack=1)
    done = tl.zeros((THREADS,), dtype=tl.uint32)
    for r in tl.static_range((256 * _COPIES) // THREADS):
        idx = r * THREADS + i
        e = idx // _COPIES
        addr = base + (e * (4 * _COPIES) + (idx % _COPIES) * 4).to(tl.uint32)
        pair = (tl.load(lev_ptr + (e >> 4)) | (tl.load(lev_ptr + (e & 15)) << 16)).to(tl.uint32, bitcast=True)
        done |= tl.inline_asm_elementwise(ST_B32, "=r,r,r", [addr, pair], dtype=tl.uint32, is_pure=False, pack=1)
    tl.debug_barrier()
    return base + done


@triton.jit
def _lookup(w, X, m16, m8, one, mh, m3, lanebase):
    return tl.inline_asm_elementwise(LOOKUP, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w, X, m16, m8, one, mh, m3, lanebase],
                                     dtype=(tl.uint32,) * 4, is_pure=True, pack=1)


@triton.jit
def _load2(ptr):
    return tl.inline_asm_elementwise(LD_V2, "=r,=r,l", [ptr], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _from_lane(v, src):
    """v (float32) of lane src (uint32), for every lane: one SHFL."""
    r = tl.inline_asm_elementwise(SHFL, "=r,r,r", [v.to(tl.uint32, bitcast=True), src], dtype=tl.uint32,
                                  is_pure=True, pack=1)
    return r.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M", "N", "KB", "SPLIT", "SEG", "ONE"])
def lab_scaled_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, lev_ptr, out_ptr,
    M, N, KB, SPLIT, SEG, ONE,
    X_DT: tl.constexpr, THREADS: tl.constexpr, SHIFT: tl.constexpr, PARTIAL: tl.constexpr, FTZ: tl.constexpr,
):
    """x @ W^T under the scaled contract, M <= 8; program p: row block p // SPLIT (THREADS // 2 rows), K segment
    p % SPLIT (SEG bytes of a row, a multiple of 128). PARTIAL: float32 partials [SPLIT, M, N] for
    kernels.split_sum_kernel, else the rounded output [M, N]."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    always = i >= 0
    one = (i * 0 + ONE).to(tl.uint32)
    lanebase = _fill(lev_ptr, THREADS) + ((lane % _COPIES) * 4).to(tl.uint32)
    X = lanebase << (16 - SHIFT)
    m16, m8, mh, m3 = one << 16, one << 8, one << (16 + SHIFT), one << (8 + SHIFT)
    pid = tl.program_id(0)
    rblk = pid // SPLIT
    pid_k = pid % SPLIT
    row_a = rblk * (THREADS // 2) + (i // 32) * 16 + g
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)
    rb = tl.minimum(row_b, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    xr = xw_ptr + tl.minimum(g, M - 1) * KB
    xok = (g < M).to(tl.uint32)
    group = (lane - t).to(tl.uint32)  # lane 4g: the first of the row's 4 lanes
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    t0, t1, t2, t3 = zero, zero, zero, zero
    KB32 = KB // 32  # absmax blocks a row
    for c in range(first, end, STEP):
        jw = c // 4 + 2 * t  # the lane's first word of the step (block 0); block b is 8 words on
        pa = wa + jw
        pb = wb + jw
        px = xr + 4 * jw  # x's word i holds elements 2i, 2i + 1: the packed byte i's pair
        # lane t makes the absmax of the step's block t of rows a and b; the 4 lanes of a row pass them round
        mine_a = absmax_of_block(ra * KB32 + c // 32 + t, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                 True, FTZ, True)
        mine_b = absmax_of_block(rb * KB32 + c // 32 + t, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                 True, FTZ, True)
        for b in tl.static_range(4):
            a0, a1 = _load2(pa + 8 * b)
            b0, b1 = _load2(pb + 8 * b)
            amax_a = _from_lane(mine_a, group + b)
            amax_b = _from_lane(mine_b, group + b)
            pa0, pa1, pa2, pa3 = _lookup(a0, X, m16, m8, one, mh, m3, lanebase)
            pb0, pb1, pb2, pb3 = _lookup(b0, X, m16, m8, one, mh, m3, lanebase)
            x0, x1, x2, x3 = K.load_v4_if(px + 32 * b, xok)
            d0, d1, d2, d3 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, zero, zero, zero, zero, X_DT)
            d0, d1, d2, d3 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, d0, d1, d2, d3, X_DT)
            qa0, qa1, qa2, qa3 = _lookup(a1, X, m16, m8, one, mh, m3, lanebase)
            qb0, qb1, qb2, qb3 = _lookup(b1, X, m16, m8, one, mh, m3, lanebase)
            y0, y1, y2, y3 = K.load_v4_if(px + 32 * b + 4, xok)
            d0, d1, d2, d3 = mma_16x8x16(qa0, qb0, qa1, qb1, y0, y1, d0, d1, d2, d3, X_DT)
            d0, d1, d2, d3 = mma_16x8x16(qa2, qb2, qa3, qb3, y2, y3, d0, d1, d2, d3, X_DT)
            t0 = t0 + amax_a * d0
            t1 = t1 + amax_a * d1
            t2 = t2 + amax_b * d2
            t3 = t3 + amax_b * d3
    m = 2 * t
    K._store1(t0, out_ptr, row_a, m, M, N, pid_k, PARTIAL, X_DT)
    K._store1(t1, out_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, X_DT)
    K._store1(t2, out_ptr, row_b, m, M, N, pid_k, PARTIAL, X_DT)
    K._store1(t3, out_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, X_DT)


# --- the contract in NumPy ----------------------------------------------------------------------------------------

def rounded_levels(x_dtype: str) -> np.ndarray:
    """The 16 NF4 levels rounded to x's dtype ("bf16" or "fp16"), as float64, and their 16-bit patterns."""
    from reference.floats import bf16_to_float32, float32_to_bf16
    from reference.format import NF4_CODE

    code = np.asarray(NF4_CODE, dtype=np.float32)
    if x_dtype == "bf16":
        bits = float32_to_bf16(code)
        values = bf16_to_float32(bits).astype(np.float64)
    else:
        half = code.astype(np.float16)
        bits, values = half.view(np.uint16), half.astype(np.float64)
    return values, bits


def model(x: np.ndarray, codes: np.ndarray, absmax: np.ndarray, x_dtype: str = "bf16") -> np.ndarray:
    """y[m, n] of the contract in float64: x [M, K] (the values x holds), codes [N, K] (0-15), absmax [N, K / 64]
    (float32, as the kernel recovers it)."""
    levels, _ = rounded_levels(x_dtype)
    w = levels[codes]  # [N, K]
    n, k = codes.shape
    part = np.einsum("mbk,nbk->mnb", x.reshape(x.shape[0], k // 64, 64).astype(np.float64),
                     w.reshape(n, k // 64, 64))
    return np.einsum("mnb,nb->mn", part, absmax.astype(np.float64))


def bound(x: np.ndarray, codes: np.ndarray, absmax: np.ndarray, x_dtype: str = "bf16") -> np.ndarray:
    """A bound on |kernel's float32 totals - model| per output: each block's partial, a float32 sum of 64 exact
    products in some order, is within gamma(63) of its sum of magnitudes; the scaled add of a block is one rounding
    of the product and one of the sum (separate mul and add, or an FFMA: at most the same); the totals run over
    the row's blocks in order (one per block), and split-K partials add in split order (at most as many more)."""
    levels, _ = rounded_levels(x_dtype)
    n, k = codes.shape
    blocks = k // 64
    mag = np.einsum("mbk,nbk->mnb", np.abs(x).reshape(x.shape[0], blocks, 64).astype(np.float64),
                    np.abs(levels[codes]).reshape(n, blocks, 64)) * np.abs(absmax.astype(np.float64))[None]
    u = 2.0**-24
    per = 63 + 2 + 2 * blocks  # block sum, the scaled add, the running total (and split-K's adds)
    return (per * u / (1 - per * u)) * mag.sum(axis=2)


# --- host side ------------------------------------------------------------------------------------------------

_LEVELS: dict = {}


def _level_bits(device, x_dtype: str):
    import torch

    key = (device, x_dtype)
    if key not in _LEVELS:
        _, bits = rounded_levels(x_dtype)
        _LEVELS[key] = torch.tensor(bits.astype(np.int32), dtype=torch.int32, device=device)
    return _LEVELS[key]


CANDIDATES = {"sc_w4": 4, "sc_w2": 2}  # name -> warps a program


def plan_of(candidate: str, x, qs) -> dict | None:
    return None


def linear(x, packed, qs, candidate: str):
    """x @ W^T under the scaled contract (M <= 8, blocksize 64, nested absmax, K % 256 == 0)."""
    import torch

    warps = CANDIDATES[candidate]
    m, k = x.shape
    n = qs.shape[0]
    if m > 8 or k % 256 or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError("scaled lab kernel: M <= 8, K % 256 == 0, blocksize 64, nested absmax")
    x_dt = 2 if x.dtype == torch.bfloat16 else 1
    kb = k // 2
    steps = kb // 128
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = triton.cdiv(n, 16 * warps)
    split = max(1, min(steps, triton.cdiv(sms * 8, rows)))
    seg = triton.cdiv(steps, split) * 128
    split = triton.cdiv(kb, seg)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    lab_scaled_kernel[(rows * split,)](
        x, packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset,
        _level_bits(x.device, "bf16" if x_dt == 2 else "fp16"), part, m, n, kb, split, seg, 1,
        X_DT=x_dt, THREADS=32 * warps, SHIFT=table_shift(), PARTIAL=split > 1, FTZ=True, num_warps=warps)
    if split > 1:
        K.split_sum_kernel[(triton.cdiv(m * n, 256),)](part, out, m * n, SPLIT=split, X_DT=x_dt, BLOCK=256)
    return out


def check(y, x, packed, qs) -> dict:
    """The kernel's output against the contract's model: the largest |y - model| over its bound, and the outputs
    beyond it (y is rounded to x's dtype: one ulp of the output is allowed on top)."""
    import torch

    from reference.nf4 import NF4Quantized, recover_absmax

    n, k = qs.shape
    q = packed.reshape(-1).cpu().numpy()
    codes = np.stack([q >> 4, q & 15], axis=1).reshape(n, k)
    quant = NF4Quantized(packed=q, shape=(n, k), dtype="bfloat16", blocksize=64,
                         absmax_u8=qs.absmax.cpu().numpy(), absmax2=qs.state2.absmax.cpu().numpy(),
                         code2=qs.state2.code.cpu().numpy(), offset=float(qs.offset.item()))
    absmax = recover_absmax(quant, ftz=True).reshape(n, k // 64)  # as the kernel's absmax_of_block (FTZ)
    xd = x.float().cpu().numpy()
    x_dtype = "bf16" if x.dtype == torch.bfloat16 else "fp16"
    want = model(xd, codes, absmax, x_dtype)
    tol = bound(xd, codes, absmax, x_dtype) + np.abs(want) * (2.0**-8 if x_dtype == "bf16" else 2.0**-11)
    err = np.abs(y.float().cpu().numpy().astype(np.float64) - want)
    return {"max_err_over_bound": float((err / (tol + 1e-300)).max()), "beyond": int((err > tol).sum())}
