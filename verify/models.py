"""NumPy models of how other implementations compute NF4 dequantization, for recognising known defects.

The reference (`reference.dequantize_nf4`) is what the format says. A known defect is accepted only
when the implementation's output equals, bit for bit, a model of *what it does instead*: a
mechanism, not a tolerance. Every model is the format with one step swapped:

    absmax:  "ieee"  (code2 * absmax2) + offset, two float32 roundings (the format)
             "ftz"   the product flushed to signed zero below 2**-126 (bitsandbytes' CUDA build)
             "fma"   fma(code2, absmax2, offset), one rounding (a compiler contracted the multiply-add)
    product: "ieee"  NF4[nibble] * absmax, one float32 rounding (the format)
             "ftz"   operands and product flushed (bitsandbytes' CUDA build)
    index:   "format" absmax[i // blocksize]
             "avx512" absmax[row * (n // blocksize) + (col // 16 * 16) // blocksize] over the [rows, n] view
                      (bitsandbytes' native CPU kernel, AVX512 branch)
    convert: "rne"         round to nearest even (the format)
             "bf16-daz"    bf16 output: subnormal float32 treated as zero first (AVX512_BF16 vcvtneps2bf16)
             "interpreter" bf16 output: Triton's interpreter conversion, which truncates

Arrays: float32/float16 as NumPy, bfloat16 as uint16 bit patterns (as in `reference`).
"""

from __future__ import annotations

from math import prod

import numpy as np

import reference
from reference.floats import cast_float32, flush_subnormal

F32 = np.float32
ABSMAX_MODES = ("ieee", "ftz", "fma")
PRODUCT_MODES = ("ieee", "ftz")
INDEX_MODES = ("format", "avx512")
CONVERT_MODES = ("rne", "bf16-daz", "interpreter")


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, correctly rounded once: round_f32(a * b + c).

    a * b of two float32 values is exact in float64 (48 significant bits). The float64 sum is
    made round-to-odd with its TwoSum error term, and a round-to-odd result with at least
    two more bits than float32 rounds to float32 exactly as the infinitely precise sum would.
    """
    a = np.asarray(a, dtype=F32).astype(np.float64)
    b = np.asarray(b, dtype=F32).astype(np.float64)
    c = np.asarray(c, dtype=F32).astype(np.float64)
    p = a * b
    with np.errstate(over="ignore", invalid="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        odd = (s.view(np.uint64) & np.uint64(1)).astype(bool)
        inexact = (err != 0) & np.isfinite(s)
        nudge = inexact & ~odd
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(F32)


def recover_absmax(q: reference.NF4Quantized, mode: str = "ieee") -> np.ndarray:
    """The float32 absmax per block under `mode` (see the module docstring)."""
    if mode not in ABSMAX_MODES:
        raise ValueError(f"absmax mode must be one of {ABSMAX_MODES}, got {mode!r}")
    if not q.double_quant or mode in ("ieee", "ftz"):
        return reference.recover_absmax(q, ftz=(mode == "ftz"))
    scale = np.repeat(np.asarray(q.absmax2, dtype=F32), reference.ABSMAX_BLOCKSIZE)[: q.absmax_u8.size]
    level = np.asarray(q.code2, dtype=F32)[q.absmax_u8]
    return fma_f32(level, scale, np.full_like(level, F32(q.offset)))


def block_index(q: reference.NF4Quantized, mode: str = "format") -> np.ndarray:
    """For every element (flat order), the index of the absmax it is scaled by."""
    n = q.numel
    if mode == "format":
        return np.arange(n, dtype=np.int64) // q.blocksize
    if mode != "avx512":
        raise ValueError(f"index mode must be one of {INDEX_MODES}, got {mode!r}")
    shape = q.shape if len(q.shape) > 1 else (1, q.shape[0])
    rows, cols = prod(shape[:-1]), shape[-1]
    index = np.arange(rows)[:, None] * (cols // q.blocksize) + (np.arange(cols)[None, :] // 16 * 16) // q.blocksize
    return index.reshape(-1)


def convert(y: np.ndarray, out_dtype: str, mode: str = "rne") -> np.ndarray:
    """Round float32 `y` to `out_dtype` under `mode` (see the module docstring)."""
    if mode not in CONVERT_MODES:
        raise ValueError(f"convert mode must be one of {CONVERT_MODES}, got {mode!r}")
    if out_dtype != "bfloat16" or mode == "rne":
        return cast_float32(y, out_dtype)
    if mode == "bf16-daz":
        return cast_float32(flush_subnormal(y), out_dtype)
    return interpreter_to_bf16(y)


def interpreter_to_bf16(y: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as Triton's interpreter converts them (its `_convert_float`, no rounding mode).

    For normal numbers that is truncation toward zero (`bits >> 16`); `truncate_to_bf16` states it
    independently, and tests check that the two agree. Subnormal inputs follow the interpreter's own
    renormalisation, so the routine itself is called here.
    """
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float

    y = np.ascontiguousarray(y, dtype=F32)
    flat = _convert_float(y.reshape(-1), tl.float32, tl.bfloat16, None)
    return np.asarray(flat).view(np.uint16).reshape(y.shape)


def truncate_to_bf16(y: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits by truncation (drop the low 16 bits): what the interpreter does to normals."""
    return (np.ascontiguousarray(y, dtype=F32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def model_dequant(q: reference.NF4Quantized, out_dtype: str, *, absmax: str = "ieee", product: str = "ieee",
                  index: str = "format", convert_mode: str = "rne") -> np.ndarray:
    """Dequantize `q` with the steps named by the keyword arguments; shaped `q.shape`."""
    if product not in PRODUCT_MODES:
        raise ValueError(f"product mode must be one of {PRODUCT_MODES}, got {product!r}")
    n = q.numel
    scale = recover_absmax(q, absmax)[block_index(q, index)]
    levels = np.asarray(q.code, dtype=F32)[reference.unpack_nibbles(q.packed, n)]
    if product == "ftz":
        y = flush_subnormal(flush_subnormal(levels) * flush_subnormal(scale))
    else:
        y = (levels * scale).astype(F32)
    return convert(y, out_dtype, convert_mode).reshape(q.shape)


def describe(deviation: dict) -> str:
    """A short name for a deviation, e.g. 'absmax=fma' ('values as the format' when it changes no step)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(deviation.items())) or "values as the format"
