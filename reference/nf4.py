"""NF4 quantize and dequantize in NumPy, bit-exact with bitsandbytes (double quantization on or off).

Quantization follows bitsandbytes' CPU route: the first level is its pure-torch default backend
(`quantize_4bit`), the second level its native CPU `quantize_blockwise`; the offset is torch's
CPU `mean`, replayed by `reference.cpu_numerics`. Dequantization is docs/FORMAT.md §3-§4:

    absmax[b] = (code2[absmax_u8[b]] * absmax2[b // 256]) + offset     two float32 roundings
    y[i]      = NF4[nibble(i)] * absmax[i // blocksize]                one float32 rounding
    out[i]    = round_to_nearest_even(y[i], out_dtype)

bfloat16 arrays are uint16 bit patterns (see `reference.floats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .binsearch import quantize_blockwise_cpu
from .cpu_numerics import torch_mean_f32
from .floats import as_float32, cast_float32, flush_subnormal
from .format import (
    ABSMAX_BLOCKSIZE,
    DYNAMIC_MAP,
    HIGH_NIBBLE_SHIFT,
    LOW_NIBBLE_MASK,
    NF4_CODE,
    check_blocksize,
    check_out_dtype,
    num_blocks,
    packed_size,
)

F32 = np.float32
_CLAMP_MIN = F32(1e-38)  # bitsandbytes clamps the divisor, not the stored absmax


@dataclass(frozen=True)
class NF4Quantized:
    """An NF4 tensor as bitsandbytes stores it, in NumPy arrays.

    packed: uint8 [(numel + 1) // 2], element 2k in the high nibble of byte k.
    shape, dtype: the original shape and dtype name ('float16', 'bfloat16', 'float32').
    absmax: float32 [num_blocks] without double quantization, else None.
    absmax_u8, absmax2, code2, offset: the double-quantized absmax (uint8 [num_blocks]), one
    float32 scale per 256 absmax values, the 256-entry float32 map, and the float32 offset.
    """

    packed: np.ndarray
    shape: tuple[int, ...]
    dtype: str
    blocksize: int
    absmax: np.ndarray | None = None
    absmax_u8: np.ndarray | None = None
    absmax2: np.ndarray | None = None
    code2: np.ndarray | None = None
    offset: np.float32 | None = None
    code: np.ndarray = field(default_factory=lambda: NF4_CODE.copy())

    @property
    def double_quant(self) -> bool:
        """Whether the absmax is itself quantized (bitsandbytes' compress_statistics)."""
        return self.absmax_u8 is not None

    @property
    def numel(self) -> int:
        """Number of weights."""
        return int(np.prod(self.shape, dtype=np.int64))


def quantize_blockwise_8bit(values: np.ndarray, code: np.ndarray, blocksize: int = ABSMAX_BLOCKSIZE):
    """bitsandbytes' native CPU 8-bit blockwise quantization: (uint8 indices, float32 absmax).

    Not the nearest code: bitsandbytes 0.50.2 snaps `value * (1 / absmax)` to a 65536-point grid
    and reads the index from a table, zeroes blocks whose absmax is 0 and skips NaNs in the
    absmax. See `reference.binsearch`.
    """
    return quantize_blockwise_cpu(values, code, blocksize)


def quantize_nf4(
    x: np.ndarray,
    blocksize: int = 64,
    *,
    double_quant: bool = True,
    dtype: str | None = None,
    code2: np.ndarray | None = None,
    mean_lanes: int = 8,
    mean_threads: int = 1,
) -> NF4Quantized:
    """Quantize an array to NF4 exactly as `bitsandbytes.functional.quantize_4bit` does on a CPU.

    x: float32 or float16 array of any shape, or bfloat16 as uint16 bits with dtype='bfloat16'.
    blocksize: 32, 64, ..., 4096. double_quant: bitsandbytes' compress_statistics.
    code2: the 256-entry map for the absmax (default: bitsandbytes' dynamic map, DYNAMIC_MAP).
    mean_lanes, mean_threads: the SIMD width and thread count of the torch build whose
    `absmax.mean()` gives the offset (8 lanes were measured for torch 2.13 on x86-64; threads
    matter from 32768 absmax values on). See `reference.cpu_numerics`.
    """
    blocksize = check_blocksize(blocksize)
    x = np.asarray(x)
    if dtype is None:
        if x.dtype == np.uint16:
            raise TypeError("x is uint16: pass dtype='bfloat16' to quantize bfloat16 bits")
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(x.dtype)
        if dtype is None:
            raise TypeError(f"x must be float32, float16 or bfloat16 bits (uint16), got {x.dtype}")
    dtype = check_out_dtype(dtype)
    if dtype == "bfloat16" and x.dtype != np.uint16:
        raise TypeError(f"dtype='bfloat16' expects uint16 bit patterns, got {x.dtype}")
    if x.size == 0:
        raise ValueError("x must have at least one element")
    flat = as_float32(x, dtype).reshape(-1)
    n = flat.size
    nb = num_blocks(n, blocksize)
    full = (n // blocksize) * blocksize

    # First level: absmax per block, then x scaled into [-1, 1]. Full blocks multiply by a
    # float32 reciprocal; the tail block divides (two roundings versus one, as bitsandbytes).
    mag = np.abs(flat)
    absmax = np.empty(nb, dtype=F32)
    scaled = np.empty(n + (n & 1), dtype=F32)
    scaled[n:] = 0  # the pad nibble of an odd numel quantizes a zero
    if full:
        absmax[: full // blocksize] = mag[:full].reshape(-1, blocksize).max(axis=1)
        recip = (F32(1) / np.maximum(absmax[: full // blocksize], _CLAMP_MIN)).astype(F32)
        scaled[:full] = (flat[:full].reshape(-1, blocksize) * recip[:, None]).reshape(-1)
    if full < n:
        # The tail block's absmax is stored clamped (bitsandbytes clamps it before concatenating),
        # unlike the full blocks': an all-zero tail stores 1e-38, not 0.
        absmax[-1] = np.maximum(mag[full:].max(), _CLAMP_MIN)
        scaled[full:n] = flat[full:] / absmax[-1]
    np.clip(scaled, F32(-1), F32(1), out=scaled)
    bounds = ((NF4_CODE[:-1] + NF4_CODE[1:]) / F32(2)).astype(F32)
    nibbles = np.searchsorted(bounds, scaled, side="left").astype(np.uint8)
    packed = ((nibbles[0::2] << HIGH_NIBBLE_SHIFT) | nibbles[1::2]).astype(np.uint8)
    assert packed.size == packed_size(n)

    common = {"packed": packed, "shape": tuple(int(s) for s in x.shape), "dtype": dtype, "blocksize": blocksize}
    if not double_quant:
        return NF4Quantized(absmax=absmax, **common)

    # Second level: center on the mean, then 8-bit blockwise over the absmax vector.
    code2 = DYNAMIC_MAP.copy() if code2 is None else np.array(code2, dtype=F32)
    if code2.shape != (256,):
        raise ValueError(f"code2 must have 256 entries, got shape {code2.shape}")
    offset = torch_mean_f32(absmax, lanes=mean_lanes, num_threads=mean_threads)
    absmax_u8, absmax2 = quantize_blockwise_8bit((absmax - offset).astype(F32), code2)
    return NF4Quantized(absmax_u8=absmax_u8, absmax2=absmax2, code2=code2, offset=F32(offset), **common)


def recover_absmax(q: NF4Quantized, *, ftz: bool = False) -> np.ndarray:
    """The float32 absmax per block: stored as is, or `(code2[u8] * absmax2[b // 256]) + offset`.

    ftz: flush subnormal inputs and products of the multiply to signed zero, as bitsandbytes'
    fast-math CUDA kernel does (its `+ offset` is a separate torch op and stays IEEE).
    """
    if not q.double_quant:
        return np.asarray(q.absmax, dtype=F32).copy()
    scale = np.repeat(np.asarray(q.absmax2, dtype=F32), ABSMAX_BLOCKSIZE)[: q.absmax_u8.size]
    level = np.asarray(q.code2, dtype=F32)[q.absmax_u8]
    if ftz:
        product = flush_subnormal(flush_subnormal(level) * flush_subnormal(scale))
    else:
        product = (level * scale).astype(F32)
    return (product + F32(q.offset)).astype(F32)


def unpack_nibbles(packed: np.ndarray, numel: int) -> np.ndarray:
    """The 4-bit codes, element 2k from the high nibble of byte k, element 2k+1 from the low."""
    packed = np.asarray(packed).reshape(-1).view(np.uint8)
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2] = packed >> HIGH_NIBBLE_SHIFT
    nibbles[1::2] = packed & LOW_NIBBLE_MASK
    return nibbles[:numel]


def dequantize_nf4(q: NF4Quantized, out_dtype: str | None = None, *, ftz: bool = False) -> np.ndarray:
    """Dequantize to `out_dtype` (default: the quantized tensor's dtype), in `q.shape`.

    Returns float16 or float32 arrays, or bfloat16 as uint16 bits (view with
    `reference.bf16_to_float32`). ftz=True reproduces bitsandbytes' CUDA build, which flushes
    subnormal float32 operands and products to signed zero; ftz=False its CPU routes (IEEE).
    The transpose that bitsandbytes applies to a packed tensor of shape (1, n) is the caller's
    business (see `reference.from_bnb`).
    """
    out_dtype = check_out_dtype(out_dtype or q.dtype)
    n = q.numel
    if q.packed.size * 2 < n:
        raise ValueError(f"packed has {q.packed.size} bytes, expected {packed_size(n)} for shape {q.shape}")
    absmax = recover_absmax(q, ftz=ftz)
    if absmax.size != num_blocks(n, q.blocksize):
        raise ValueError(f"absmax has {absmax.size} blocks, expected {num_blocks(n, q.blocksize)}")
    levels = np.asarray(q.code, dtype=F32)[unpack_nibbles(q.packed, n)]
    scale = np.repeat(absmax, q.blocksize)[:n]
    if ftz:
        y = flush_subnormal(levels * flush_subnormal(scale))
    else:
        y = (levels * scale).astype(F32)
    return cast_float32(y, out_dtype).reshape(q.shape)
