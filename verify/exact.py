"""Bit-exact comparison by integer views, with a report a person can act on.

Two float arrays are equal here only when their bit patterns are: -0.0 differs from 0.0 and
NaNs compare by payload. Accepts NumPy arrays and torch tensors (converted lazily);
bfloat16 tensors are compared as their 16-bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The bit patterns of `x` (NumPy array or torch tensor) as an unsigned integer array."""
    if not isinstance(x, np.ndarray):
        import torch

        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            if t.dtype.is_floating_point or t.dtype in (torch.int16, torch.int32, torch.int64, torch.uint8):
                int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                arr = t.view(int_view).numpy()
                return arr.view(_UINT_OF_SIZE[t.element_size()])
            x = t.numpy()
        else:
            x = np.asarray(x)
    x = np.ascontiguousarray(x)
    return x.view(_UINT_OF_SIZE[x.dtype.itemsize])


def _values(x) -> np.ndarray:
    """Float values for display: bf16 bit patterns (uint16 from a bf16 tensor) are widened."""
    if not isinstance(x, np.ndarray):
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu").float().numpy()
    return np.asarray(x)


@dataclass(frozen=True)
class Mismatch:
    """Outcome of a bit-exact comparison."""

    count: int
    total: int
    first: tuple[tuple[int, ...], ...]
    detail: str

    @property
    def ok(self) -> bool:
        """True when every element matched bit for bit (and the shapes agreed)."""
        return self.count == 0

    def __str__(self) -> str:
        return self.detail


def compare(actual, expected, *, name: str = "output", limit: int = 5) -> Mismatch:
    """Compare bit patterns; the report names the count and the first `limit` indices with values."""
    a_shape = tuple(actual.shape)
    e_shape = tuple(expected.shape)
    a_bits, e_bits = bits(actual), bits(expected)
    if a_shape != e_shape or a_bits.dtype.itemsize != e_bits.dtype.itemsize:
        detail = (f"{name}: shape/width differ: actual {a_shape} x {a_bits.dtype.itemsize} bytes, "
                  f"expected {e_shape} x {e_bits.dtype.itemsize} bytes")
        return Mismatch(max(int(np.prod(e_shape)), 1), int(np.prod(e_shape)), (), detail)
    diff = a_bits != e_bits
    count = int(diff.sum())
    total = int(diff.size)
    if not count:
        return Mismatch(0, total, (), f"{name}: all {total} elements bit-exact")
    where = np.argwhere(diff)[:limit]
    av, ev = _values(actual), _values(expected)
    lines = [f"{name}: {count} of {total} elements differ; first {len(where)}:"]
    first = []
    for idx in where:
        idx = tuple(int(i) for i in idx)
        first.append(idx)
        lines.append(f"  {idx}: actual {av[idx]!r} (0x{int(a_bits[idx]):0{2 * a_bits.itemsize}x}) "
                     f"expected {ev[idx]!r} (0x{int(e_bits[idx]):0{2 * e_bits.itemsize}x})")
    return Mismatch(count, total, tuple(first), "\n".join(lines))


def assert_bitexact(actual, expected, *, name: str = "output") -> None:
    """Raise AssertionError with the mismatch report unless every bit pattern is equal."""
    result = compare(actual, expected, name=name)
    if not result.ok:
        raise AssertionError(result.detail)


def mismatch_count(a, b) -> int:
    """Number of elements of two torch tensors whose bit patterns differ (a shape or dtype mismatch
    counts every element); compared on the tensors' device."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(iv) != b.contiguous().view(iv)).sum().item())

