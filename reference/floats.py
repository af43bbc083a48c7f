"""Float formats NumPy lacks or rounds differently: bfloat16 as uint16 bits, flush-to-zero.

The reference represents a bfloat16 array as a NumPy uint16 array of the bf16 bit patterns
(the upper half of a float32). `bf16_to_float32` widens it exactly; `float32_to_bf16` rounds to
nearest, ties to even, and keeps the sign of zero, as `torch.Tensor.to(bfloat16)` and CUDA's
`__float2bfloat16_rn` do for every non-NaN value. A NaN becomes a quiet NaN that keeps its sign
and top payload bits; torch itself is not consistent there (0x7FC0 from its scalar path, 0xFFFF
from its vectorised path), so NaN payloads are not part of the exactness contract.
"""

from __future__ import annotations

import numpy as np

from .format import FLT_MIN

_SIGN = np.uint32(0x8000_0000)
_ABS = np.uint32(0x7FFF_FFFF)
_EXP_ALL_ONES = np.uint32(0x7F80_0000)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (RNE); returns the bf16 bit patterns as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
    is_nan = (bits & _ABS) > _EXP_ALL_ONES
    quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040))
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be a uint16 array, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def flush_subnormal(x: np.ndarray) -> np.ndarray:
    """Replace float32 subnormals by a zero of the same sign, as CUDA's `.ftz` arithmetic does."""
    x = np.asarray(x, dtype=np.float32)
    tiny = np.abs(x) < FLT_MIN
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def cast_float32(x: np.ndarray, out_dtype: str) -> np.ndarray:
    """Round float32 to `out_dtype` ('float16', 'bfloat16' as uint16 bits, or 'float32' as is)."""
    x = np.asarray(x, dtype=np.float32)
    if out_dtype == "float32":
        return x.copy()
    if out_dtype == "float16":
        with np.errstate(over="ignore"):  # rounding up to inf (|x| >= 65520) is the right answer
            return x.astype(np.float16)  # NumPy rounds to nearest even, subnormals included
    if out_dtype == "bfloat16":
        return float32_to_bf16(x)
    raise ValueError(f"out_dtype must be 'float16', 'bfloat16' or 'float32', got {out_dtype!r}")


def as_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """View an array stored as `dtype` ('float16', 'bfloat16' bits, 'float32') as float32."""
    if dtype == "bfloat16":
        return bf16_to_float32(x)
    return np.asarray(x).astype(np.float32)
