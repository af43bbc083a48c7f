"""Oracles of a float32-accumulated linear `y = x @ w.T (+ bias)` (docs/FORMAT.md §9), in NumPy.

- `linear_float64`: the float64 product of exact weights, the oracle of the sum check.
- `accumulation_bound` / `worst_ratio`: how far a float32 accumulation of K products, rounded once
  to the output dtype, may lie from that oracle, and the worst observed fraction of it.
- `gemv_model`: the bit-exact model of `nf4.linear`'s GEMV forward (nf4_gemv_kernel, then
  nf4_split_sum_kernel; nf4_gemv_table_kernel with word=4) as Triton's interpreter runs it; the model check.

Weights enter as the operand's values (`nf4.dequantize(W).to(x.dtype)` widened to float32 or
float64), so this module knows nothing of NF4 itself. Dtype names are those of `reference.format`
('float16', 'bfloat16', 'float32'; a `torch.float16` is accepted by name); bfloat16 arrays are
uint16 bit patterns, as everywhere in `reference`.
"""

from __future__ import annotations

import numpy as np

from .floats import bf16_to_float32, cast_float32
from .format import check_out_dtype

F32 = np.float32
F64 = np.float64

# unit roundoff (half an ulp of 1) of each output dtype: 8, 11 and 24 significand bits
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
# half the smallest subnormal: the absolute error of rounding a tiny value to the dtype
HALF_TINY = {"bfloat16": 2.0**-134, "float16": 2.0**-25, "float32": 2.0**-150}
FLOAT32_EPS_HALF = 2.0**-24  # unit roundoff of the float32 accumulator


def _as_float64(a, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array (bfloat16 bits: widen with bf16_to_float32), got {a.dtype}")
    return a.astype(F64)


def linear_float64(x, w) -> np.ndarray:
    """x @ w.T in float64: x [..., K], w [N, K] (any float arrays, widened exactly) -> [..., N] float64.

    The oracle of the sum check. Its own error (at most about K * 2**-53 * sum |x_k w_k|) is 2**-29
    of the float32 accumulation bound, so it stands for the exact product.
    """
    x, w = _as_float64(x, "x"), _as_float64(w, "w")
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., K] and w [N, K] expected, got x {x.shape} and w {w.shape}")
    return x @ w.T


def accumulation_bound(x, w, out_dtype, bias=None) -> np.ndarray:
    """Elementwise bound on |y - x @ w.T| for y summed in float32 and rounded once to `out_dtype`.

    bound = (1 + u) * c * (|x| @ |w|.T + |bias|) + u * |x @ w.T + bias| + HALF_TINY[out_dtype]

    with T the number of terms (K, or K + 1 with a bias: the bias is one more float32 addition), u
    the unit roundoff of `out_dtype` (2**-8 bfloat16, 2**-11 float16, 2**-24 float32) and
    c = max(T * 2**-24, g) with g = (T - 1) u32 / (1 - (T - 1) u32) (c = T * 2**-24 up to T = 4096).
    Any order of T - 1 float32 additions errs by at most A = g * sum|terms| (products of 16-bit
    values are exact in float32), and rounding the float32 sum s to the output dtype errs by at most
    u |s| <= u (|exact| + A), or by HALF_TINY (half the dtype's smallest subnormal) among the
    subnormals; that last term also keeps the bound positive. docs/FORMAT.md §9 states the first
    two terms; (1 + u), g and HALF_TINY make the bound hold without exception. For random data the
    final rounding dominates (ratios near 1 from it alone are normal for 16-bit outputs); the
    accumulation term matters where the sum cancels.
    """
    out_dtype = check_out_dtype(out_dtype)
    x, w = _as_float64(x, "x"), _as_float64(w, "w")
    exact = linear_float64(x, w)
    magnitude = np.abs(x) @ np.abs(w).T
    terms = x.shape[-1]
    if bias is not None:
        b = _as_float64(bias, "bias")
        exact = exact + b
        magnitude = magnitude + np.abs(b)
        terms += 1
    u = UNIT_ROUNDOFF[out_dtype]
    g = (terms - 1) * FLOAT32_EPS_HALF / (1 - (terms - 1) * FLOAT32_EPS_HALF)
    c = max(terms * FLOAT32_EPS_HALF, g)
    return (1 + u) * c * magnitude + u * np.abs(exact) + HALF_TINY[out_dtype]


def worst_ratio(y, x, w, out_dtype, bias=None) -> float:
    """max |y - (x @ w.T + bias)| / accumulation_bound: <= 1 for any float32 summation order.

    y: the computed output [..., N] as floats (or bfloat16 bits, uint16, when out_dtype is
    bfloat16); 0.0 when y is empty. A NaN or infinity in y gives inf.
    """
    out_dtype = check_out_dtype(out_dtype)
    y = np.asarray(y)
    if y.dtype == np.uint16 and out_dtype == "bfloat16":
        y = bf16_to_float32(y)
    y = _as_float64(y, "y")
    exact = linear_float64(x, w)
    if bias is not None:
        exact = exact + _as_float64(bias, "bias")
    if y.shape != exact.shape:
        raise ValueError(f"y has shape {y.shape}, expected {exact.shape}")
    if y.size == 0:
        return 0.0
    if not np.isfinite(y).all():
        return float("inf")
    return float(np.max(np.abs(y - exact) / accumulation_bound(x, w, out_dtype, bias)))


def fma_float32(a, b, c) -> np.ndarray:
    """fma(a, b, c) on float32 arrays (broadcast): a * b + c rounded once to float32 (nearest even).

    a * b of two float32 values is exact in float64 (48 significand bits, exponents far inside
    float64's range); the float64 sum s = a * b + c is then rounded to float32, which rounds twice.
    Two roundings differ from one only when s falls exactly on a midpoint between two float32
    values while the exact sum does not: the sum's error term e (TwoSum, exact) says on which side
    the exact sum lies, and the result moves to that neighbour. Signed zeros follow IEEE (an exact
    zero sum of opposite signs is +0). Overflow to infinity is not modelled beyond NumPy's cast.
    """
    a, b, c = (np.asarray(v, dtype=F32) for v in (a, b, c))
    p = a.astype(F64) * b.astype(F64)
    c64 = c.astype(F64)
    s = p + c64
    # TwoSum: s + e == p + c exactly
    bv = s - p
    e = (p - (s - bv)) + (c64 - bv)
    with np.errstate(over="ignore"):
        r = s.astype(F32)
    r64 = r.astype(F64)
    inexact = (r64 != s) & (e != 0) & np.isfinite(s)
    if inexact.any():
        # the other float32 neighbour of s, and whether s sits exactly halfway between the two
        other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf)).astype(F32))
        on_midpoint = inexact & ((r64 + other.astype(F64)) * 0.5 == s)
        # the exact sum lies beyond s toward `other` when e points that way
        toward_other = on_midpoint & ((other.astype(F64) - r64) * e > 0)
        r = np.where(toward_other, other, r)
    return np.asarray(r, dtype=F32)


def _next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def gemv_model(x, w_operand, half: int, seg: int, bias=None, out_dtype="bfloat16", *, block_r: int | None = None,
               word: int = 1, lanes: int | None = None) -> np.ndarray:
    """nf4.linear's GEMV forward, bit for bit as Triton's interpreter runs it: x [M, K] @ w_operand.T.

    x: float32 [M, K] holding the 16-bit values of x (bfloat16 bits: widen them first);
    w_operand: float32 [N, K] holding the operand (`nf4.dequantize(W).to(x.dtype)`); K even.
    half: bytes of a row per step (`min(blocksize // 2, config.step_bytes)`); seg: bytes of a row
    per split (`nf4.linear.launch.split_k(...)[1]`, a multiple of half; seg >= K / 2: no split).
    bias: [N] float32 holding x's dtype's values, or None. block_r: rows of W per program (None:
    all N rows in one array; see below). Returns [M, N] in `out_dtype`: float16 values, or for
    bfloat16 the uint16 bit patterns (`reference.floats`), or float32.

    The order (nf4_gemv_kernel): for each split s (bytes [s * seg, min((s + 1) * seg,
    K / 2)) of every row), a float32 accumulator acc[BLOCK_M, rows, half] starts at +0; each step
    of `half` bytes from c0 does, per lane t (byte j = c0 + t, elements 2j and 2j + 1),
        acc = fma(w[n, 2j], x[m, 2j], acc);  acc = fma(w[n, 2j + 1], x[m, 2j + 1], acc)
    then the split's partial is np.sum(acc, axis=2) (the interpreter's tl.sum is that call on the
    float32 array). The partials are added in split order in float32, then the bias (float32), and
    the result is rounded once to out_dtype (nearest even).
    word=4, lanes=4 models nf4_gemv_table_kernel (codebook 3): the accumulator is [BLOCK_M, rows, 4]
    and a step is half / 16 tiles of 16 bytes; lane t adds the products of bytes 4t .. 4t + 3 of each
    tile in turn (each byte's two elements as above). word and lanes default to one byte per lane
    and half lanes, the order above.

    The array handed to np.sum is C-contiguous float32 with the reduced axis last and contiguous,
    as in the interpreter (rows of x padded to BLOCK_M = next_pow2(M) with zeros). NumPy reduces
    such an array one output element at a time over its contiguous run of `half` values (its
    pairwise summation of that run, as the same NumPy does inside the interpreter), so an output's
    sum depends only on its own lanes, not on how many rows share the array: block_r=None (all N
    rows at once) gives the same bits as the kernel's per-program [BLOCK_M, BLOCK_R, half] arrays
    (block_r=config.block_r builds exactly those; tests/nf4/linear/test_model.py checks that both
    agree).
    """
    out_dtype = check_out_dtype(out_dtype)
    x = np.asarray(x)
    w = np.asarray(w_operand)
    if x.dtype != F32 or w.dtype != F32:
        raise TypeError(f"x and w_operand must be float32 arrays, got {x.dtype} and {w.dtype}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.shape[1] % 2:
        raise ValueError(f"x [M, K] and w_operand [N, K] with K even expected, got {x.shape} and {w.shape}")
    m, k = x.shape
    n = w.shape[0]
    kb = k // 2
    n_lanes = half // word if lanes is None else lanes
    if word not in (1, 4) or half % (word * n_lanes):
        raise ValueError(f"word (1 or 4) times lanes must divide half ({half}), got word={word}, lanes={lanes}")
    if half < 1 or seg < half or seg % half or kb % half:
        raise ValueError(f"half must divide K / 2 = {kb} and seg ({seg}) must be a multiple of half ({half})")
    block_m = _next_pow2(m)
    xp = np.zeros((block_m, k), dtype=F32)
    xp[:m] = x
    x_even, x_odd = xp[:, 0::2], xp[:, 1::2]  # [BLOCK_M, KB]
    w_even, w_odd = w[:, 0::2], w[:, 1::2]  # [N, KB]
    rows = max(n, 1) if block_r is None else block_r
    y = np.zeros((m, n), dtype=F32)
    n_split = -(-kb // seg)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        # rows past the weight decode as zeros in the kernel (never stored): zero padding here
        we = np.zeros((rows, kb), dtype=F32)
        wo = np.zeros((rows, kb), dtype=F32)
        we[: r1 - r0], wo[: r1 - r0] = w_even[r0:r1], w_odd[r0:r1]
        partial = None
        for s in range(n_split):
            first, end = s * seg, min((s + 1) * seg, kb)
            acc = np.zeros((block_m, rows, n_lanes), dtype=F32)
            for c0 in range(first, end, half):
                for tile in range(half // (word * n_lanes)):  # lane t: chunk t of each tile in turn
                    t0 = c0 + tile * word * n_lanes
                    for b in range(word):  # the chunk's bytes in turn: lane t's byte t0 + t * word + b
                        j = slice(t0 + b, t0 + word * n_lanes, word)
                        acc = fma_float32(we[None, :, j], x_even[:, None, j], acc)
                        acc = fma_float32(wo[None, :, j], x_odd[:, None, j], acc)
            part = np.sum(np.ascontiguousarray(acc), axis=2)[:m, : r1 - r0]
            partial = part if partial is None else (partial + part).astype(F32)
        y[:, r0:r1] = partial
    if bias is not None:
        b = np.asarray(bias)
        if b.dtype != F32 or b.shape != (n,):
            raise ValueError(f"bias must be a float32 array of shape ({n},), got {b.dtype} {b.shape}")
        y = (y + b[None, :]).astype(F32)
    return cast_float32(y, out_dtype)
