"""bitsandbytes' native CPU 8-bit blockwise quantization (`quantize_blockwise` on a CPU), in NumPy.

Which algorithm
---------------
bitsandbytes' GitHub history has two CPU implementations of `cquantize_blockwise_cpu_fp32`:

* older releases: per element `normed = A[i] / absmax`, then the `BinSearch` library's
  `BinAlgo<Scalar, float, Direct2>` (a bucket grid over the code, then two compares and a
  "left or right neighbour is closer" correction), after writing `code[0] = -1.0` into the map;
* the build shipped in bitsandbytes 0.50.2 (the one this module matches): no BinSearch at all.
  Its `libbitsandbytes_cpu.so` exports `quantize_cpu`, an OpenMP `quantize_cpu_impl<float>`,
  `get_global_lut`, `build_quantize_lut` and a `g_lut_cache`; there are no BinSearch symbols
  and the map is not written to (`create_dynamic_map()[0]` stays -0.99296874). The steps
  below were read off its disassembly and confirmed against it value by value.

The 0.50.2 algorithm
--------------------
1. A 65536-entry table, built once per map. (bitsandbytes keeps 4 tables, keyed by the map's
   address and its entries 0, 1, 127 and 255; a different map in the same buffer that agrees on
   those 4 entries would reuse a stale table. This module keys its cache on all 256 entries.)

       mid[k] = (code[k] + code[k+1]) * 0.5            k = 0..254, float32
       g[j]   = (float(j) + float(j)) / 65535 - 1       j = 0..65535, float32 (a uniform grid on [-1, 1])
       lut[j] = first k in 0..254 with not (g[j] > mid[k]), else 255

   (a pointer that only moves forward, so for an unsorted map it is the first midpoint that
   stops the walk, not a count of the midpoints below g[j]).
2. Per block: `absmax = max(0, max |A[i]|)` with NaNs skipped (`std::max` keeps the running
   value on an unordered compare), stored as is. A block whose absmax is 0 (all zeros, all
   NaN) is written as index 0 throughout.
3. Otherwise, per element, all float32: `inv = 1 / absmax` once per block, `t = A[i] * inv`
   (a multiply by the reciprocal, not a division), `t = clamp(t, -1, 1)` (NaN passes through),
   `u = (1 + t) * 0.5`, `r = fma(u, 65535, 0.5)` (one rounding), `j = int32(trunc(r)) & 0xFFFF`,
   `out = lut[j]`. A NaN becomes the int32 0x80000000, so j = 0 and the index is lut[0].

Why the exact nearest code does not match
-----------------------------------------
The normed value is first snapped to the grid g, whose step is 2/65535 (about 3.05e-5), and only
the grid point is compared with the midpoints. So a value up to half a step past a midpoint can
still get the lower index (e.g. just above (code[79] + code[80]) / 2 with absmax 1), or the upper
one just below it. The codes near zero lie far closer together than one step (code[128] = 5.5e-7,
code[129] = 3.3e-6, ...). The grid has no point at 0 (65535 steps): t = 0 rounds to j = 32768,
g = +1.53e-5, which with the dynamic map lies past the midpoints up to (code[130] + code[131]) / 2.
So an exact 0 gets index 131 (not 127, the exact zero), any |t| below about 1.5e-5 gets 123 or
131, and indices 124..130 are never produced at all. On top
of that, `A * (1 / absmax)` differs from `A / absmax` by an ulp now and then, a block of zeros
gives index 0 (where 0/0 = NaN would make a nearest search return anything), and a NaN input
gives lut[0] (0 for the dynamic map) without disturbing its block's absmax.

Exactness of the NumPy replay
-----------------------------
`1 + t` is a float32 in [0, 2] and a multiple of 2**-24 (the sum of 1 and a float32 of
magnitude at most 1), so `u` is a multiple of 2**-25 and `u * 65535 + 0.5` is a multiple of
2**-25 below 2**16: 41 significant bits, exact in float64. Rounding that float64 to float32 once
is therefore exactly the FMA's single rounding.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
LUT_BITS = 16
LUT_SIZE = 1 << LUT_BITS  # 65536 grid points on [-1, 1]
_GRID_MAX = F32(LUT_SIZE - 1)  # 65535.0f: the grid is j * 2 / 65535 - 1

__all__ = ["LUT_SIZE", "build_quantize_lut", "lut_index", "quantize_blockwise_cpu"]

_LUT_CACHE: dict[bytes, np.ndarray] = {}


def build_quantize_lut(code: np.ndarray) -> np.ndarray:
    """The 65536-entry uint8 table of bitsandbytes' CPU quantizer for a 256-entry float32 map.

    Entry j is the index given to the grid point g[j] = 2j / 65535 - 1: the first midpoint
    (code[k] + code[k+1]) / 2 that g[j] does not exceed, or 255. Cached by the map's bytes
    (read-only result).
    """
    code = np.ascontiguousarray(code, dtype=F32).reshape(-1)
    if code.size != 256:
        raise ValueError(f"code must have 256 entries, got {code.size}")
    key = code.tobytes()
    lut = _LUT_CACHE.get(key)
    if lut is not None:
        return lut
    mid = ((code[:-1] + code[1:]) * F32(0.5)).astype(F32)  # 255 midpoints, two float32 roundings
    j = np.arange(LUT_SIZE, dtype=np.int64)
    grid = ((j.astype(F32) + j.astype(F32)) / _GRID_MAX - F32(1)).astype(F32)  # nondecreasing
    # The walk stops at the first k with not (g > mid[k]); since g never decreases, every k
    # before the stop was passed for good. "First k with mid[k] >= g or mid[k] NaN" is the first
    # k whose running maximum (NaN counted as +inf) reaches g.
    barrier = np.maximum.accumulate(np.where(np.isnan(mid), F32(np.inf), mid))
    lut = np.searchsorted(barrier, grid, side="left").astype(np.uint8)  # 255 when no stop
    lut.setflags(write=False)
    _LUT_CACHE[key] = lut
    return lut


def lut_index(normed: np.ndarray) -> np.ndarray:
    """The table index of float32 values already multiplied by 1/absmax: int64 in [0, 65535].

    clamp to [-1, 1], (1 + t) * 0.5, fma(., 65535, 0.5), truncate; NaN gives 0 (the low 16 bits
    of cvttss2si's 0x80000000).
    """
    t = np.asarray(normed, dtype=F32)
    t = np.where(t < F32(-1), F32(-1), np.where(t > F32(1), F32(1), t))
    u = ((F32(1) + t) * F32(0.5)).astype(F32)
    nan = np.isnan(u)
    r = (u.astype(np.float64) * 65535.0 + 0.5).astype(F32)  # exact in float64, then one rounding
    r = np.where(nan, F32(0), r)
    return np.trunc(r).astype(np.int64) & (LUT_SIZE - 1)


def quantize_blockwise_cpu(values: np.ndarray, code: np.ndarray, blocksize: int = 256):
    """8-bit blockwise quantization as bitsandbytes 0.50.2's `cquantize_blockwise_cpu_fp32`.

    values: any shape, taken as flat float32; code: the 256-entry float32 map (not modified).
    Returns (uint8 indices of len(values), float32 absmax per block of `blocksize` values; the
    last block may be short).
    """
    blocksize = int(blocksize)
    if blocksize <= 0:
        raise ValueError(f"blocksize must be positive, got {blocksize}")
    values = np.ascontiguousarray(values, dtype=F32).reshape(-1)
    lut = build_quantize_lut(code)
    n = values.size
    nb = -(-n // blocksize)
    if n == 0:
        return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=F32)

    # absmax: running max of |x| from -inf with NaNs skipped, then max(0, .).
    mag = np.abs(values)
    padded = np.zeros(nb * blocksize, dtype=F32)
    padded[:n] = np.where(np.isnan(mag), F32(0), mag)
    absmax = padded.reshape(nb, blocksize).max(axis=1).astype(F32)

    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = (F32(1) / absmax).astype(F32)  # inf for absmax 0 (those blocks are zeroed below)
        scaled = np.empty(nb * blocksize, dtype=F32)
        scaled[:n] = values
        scaled[n:] = 0
        normed = (scaled.reshape(nb, blocksize) * inv[:, None]).astype(F32).reshape(-1)[:n]
        out = lut[lut_index(normed)]
    zero_block = np.repeat(absmax == 0, blocksize)[:n]
    out[zero_block] = 0
    return out.astype(np.uint8, copy=False), absmax
