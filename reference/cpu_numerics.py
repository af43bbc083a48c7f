"""Float32 arithmetic exactly as PyTorch's CPU kernels round it, in NumPy.

bitsandbytes' double quantization stores `offset = absmax.mean()`, computed by torch's CPU
reduction, and its dynamic map comes from `torch.linspace`. Neither is a correctly rounded
operation: the result depends on the summation order (SIMD lane count, an unrolled 4-way
accumulator, a cascade of partial sums, the thread split) and, for linspace, on whether the
compiler contracted `start + step * k` into an FMA. To be bit-exact without importing torch,
this module replays those orders in float32. Each step below is one float32 rounding, as in
ATen's `SumKernel.cpp` (`cascade_sum`, `multi_row_sum`, `row_sum`, `vectorized_inner_sum`),
`TensorIteratorBase::parallel_reduce` and `RangeFactoriesKernel.cpp` (`linspace_kernel`).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

F32 = np.float32
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: below it a reduction runs on one thread
_NUM_LEVELS = 4  # cascade depth of multi_row_sum
_ILP = 4  # accumulators per row in row_sum


def _ceil_log2(x: int) -> int:
    return 0 if x <= 1 else int(x - 1).bit_length()


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """Cascade-sum `rows` (shape [size, k]) down axis 0, as ATen's multi_row_sum does."""
    size, k = rows.shape
    level_power = max(4, _ceil_log2(size) // _NUM_LEVELS)
    level_step = 1 << level_power
    level_mask = level_step - 1
    acc = np.zeros((_NUM_LEVELS, k), dtype=F32)
    i = 0
    while i + level_step <= size:
        for j in range(level_step):  # noqa: B007 - sequential float32 adds, order matters
            acc[0] = acc[0] + rows[i]
            i += 1
        for j in range(1, _NUM_LEVELS):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = 0
            if i & (level_mask << (j * level_power)):
                break
    while i < size:
        acc[0] = acc[0] + rows[i]
        i += 1
    for j in range(1, _NUM_LEVELS):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _row_sum(items: np.ndarray) -> np.ndarray:
    """ATen's row_sum over `items` (shape [size, lanes]): 4 interleaved accumulators, then fold."""
    size = items.shape[0]
    size_ilp = size // _ILP
    lanes = items.shape[1]
    if size_ilp:
        grouped = items[: size_ilp * _ILP].reshape(size_ilp, _ILP * lanes)
        partial = _multi_row_sum(grouped).reshape(_ILP, lanes)
    else:
        partial = np.zeros((_ILP, lanes), dtype=F32)
    for i in range(size_ilp * _ILP, size):
        partial[0] = partial[0] + items[i]
    for k in range(1, _ILP):
        partial[0] = partial[0] + partial[k]
    return partial[0]


def _serial_sum(x: np.ndarray, lanes: int) -> np.float32:
    """One thread's contiguous float32 sum (ATen cascade_sum, inner reduction)."""
    n = x.shape[0]
    if n >= lanes:
        vec_size = n // lanes
        vec_acc = _row_sum(x[: vec_size * lanes].reshape(vec_size, lanes))
        final = F32(0)
        for v in x[vec_size * lanes :]:
            final = F32(final + v)
        for v in vec_acc:
            final = F32(final + v)
        return final
    return F32(_row_sum(x.reshape(n, 1))[0])


def torch_sum_f32(x: np.ndarray, *, lanes: int = 8, num_threads: int = 1) -> np.float32:
    """`torch.sum` of a contiguous float32 vector on the CPU, bit for bit.

    lanes: the SIMD width of the kernel torch dispatched to, in floats (8 was measured for torch
    2.13 on an x86-64 AVX512 machine: its reduction ran the 8-lane kernel).
    num_threads: `torch.get_num_threads()`; it matters only from GRAIN_SIZE elements on,
    where torch splits the vector into one chunk per thread and sums the partial sums.
    """
    x = np.ascontiguousarray(x, dtype=F32).reshape(-1)
    n = x.shape[0]
    if n < GRAIN_SIZE or num_threads <= 1:
        return F32(F32(0) + _serial_sum(x, lanes))
    # at::parallel_for: min(divup(n, GRAIN_SIZE), num_threads) tasks of divup(n, tasks) elements
    tasks = max(1, min(-(-n // GRAIN_SIZE), num_threads))
    chunk = -(-n // tasks)
    partials = np.zeros(num_threads, dtype=F32)  # one buffer slot per thread, identity 0
    for t in range(tasks):
        part = x[t * chunk : min(n, (t + 1) * chunk)]
        if part.size:
            partials[t] = F32(partials[t] + _serial_sum(part, lanes))
    return F32(F32(0) + _serial_sum(partials, lanes))


def torch_mean_f32(x: np.ndarray, *, lanes: int = 8, num_threads: int = 1) -> np.float32:
    """`torch.mean` of a float32 vector on the CPU: the sum above, then one float32 division."""
    x = np.asarray(x, dtype=F32).reshape(-1)
    return F32(torch_sum_f32(x, lanes=lanes, num_threads=num_threads) / F32(x.shape[0]))


def _fma_f32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """float32 fused multiply-add `a * b + c` with a single rounding (exact rational arithmetic)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    return round_to_f32(exact)


def round_to_f32(value: Fraction) -> np.float32:
    """Round an exact rational to the nearest float32, ties to even, with no double rounding."""
    f64 = float(value)  # correctly rounded to float64
    r = F32(f64)
    lo, hi = sorted((r, np.nextafter(r, F32(np.inf) if f64 > float(r) else F32(-np.inf))))
    if lo != hi and Fraction(float(lo)) + Fraction(float(hi)) == 2 * Fraction(f64) and Fraction(f64) != value:
        # f64 sits exactly on a float32 midpoint only because it was rounded: go where value is.
        return hi if value > Fraction(f64) else lo
    return r


def torch_linspace_f32(
    start: float, end: float, steps: int, *, lanes: int = 16, contract: bool = True, contract_lanes: bool | None = None
) -> np.ndarray:
    """`torch.linspace(start, end, steps, dtype=torch.float32)` on the CPU, bit for bit.

    The first half counts up from `start`, the second down from `end`. Full vector pairs
    (2 * lanes elements) take the SIMD path, `Vectorized::arange(base, step)`, whose lanes are
    `base + i * step` with `base = start + step * idx`; the rest take the scalar path.
    contract: whether the compiler fused each `a + b * c` into one FMA (one rounding).
    """
    start32, end32 = F32(start), F32(end)
    step = F32(F32(end32 - start32) / F32(steps - 1))
    halfway = steps // 2

    def mul_add(a, b, c):  # a + b * c
        b, c = F32(b), F32(c)
        return _fma_f32(b, c, a) if contract else F32(a + F32(b * c))

    def lane_add(a, b, c):
        b, c = F32(b), F32(c)
        fuse = contract if contract_lanes is None else contract_lanes
        return _fma_f32(b, c, a) if fuse else F32(a + F32(b * c))

    def mul_sub(a, b, c):  # a - b * c
        return mul_add(a, -F32(b), c)

    out = np.empty(steps, dtype=F32)
    idx = 0
    while idx + 2 * lanes <= steps:
        for _ in range(2):
            if idx < halfway:
                base = mul_add(start32, step, idx)
            else:
                base = mul_sub(end32, step, steps - idx - 1)
            for i in range(lanes):
                out[idx + i] = lane_add(base, i, step)
            idx += lanes
    for k in range(idx, steps):
        out[k] = mul_add(start32, step, k) if k < halfway else mul_sub(end32, step, steps - k - 1)
    return out
