"""reference.binsearch / quantize_blockwise_8bit against bitsandbytes' native CPU 8-bit quantizer."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from reference.binsearch import LUT_SIZE, build_quantize_lut, lut_index, quantize_blockwise_cpu
from reference.format import DYNAMIC_MAP
from reference.nf4 import quantize_blockwise_8bit

torch = pytest.importorskip("torch")
F = pytest.importorskip("bitsandbytes.functional")

F32 = np.float32


def _rng(*key) -> np.random.Generator:
    """A generator seeded from the test's parameters: fresh, reproducible data for each test."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _bnb(values: np.ndarray, code: np.ndarray, blocksize: int = 256):
    out, state = F.quantize_blockwise(
        torch.from_numpy(np.ascontiguousarray(values, dtype=F32)),
        code=torch.from_numpy(np.array(code, dtype=F32)),
        blocksize=blocksize,
    )
    return out.numpy(), state.absmax.numpy()


def _assert_same(values: np.ndarray, code: np.ndarray = DYNAMIC_MAP, blocksize: int = 256):
    ref_idx, ref_absmax = _bnb(values, code, blocksize)
    idx, absmax = quantize_blockwise_8bit(values, code, blocksize)
    assert idx.dtype == np.uint8 and absmax.dtype == np.float32
    bad = np.flatnonzero(idx != ref_idx)
    assert np.array_equal(idx, ref_idx), f"{bad.size} index mismatches, e.g. {values[bad[:5]]}"
    assert np.array_equal(absmax.view(np.uint32), ref_absmax.view(np.uint32))


def _with_absmax_one(normed: np.ndarray) -> np.ndarray:
    """Blocks of 256 that start with 1.0, so absmax = 1 and each value is its own normed value."""
    normed = np.asarray(normed, dtype=F32)
    rows = np.zeros((-(-normed.size // 255), 255), dtype=F32)
    rows.reshape(-1)[: normed.size] = normed
    return np.concatenate([np.ones((rows.shape[0], 1), F32), rows], axis=1).reshape(-1)


def test_dynamic_map_matches_bitsandbytes():
    assert np.array_equal(F.create_dynamic_map().numpy().view(np.uint32), DYNAMIC_MAP.view(np.uint32))


@pytest.mark.parametrize("n", [1, 2, 7, 255, 256, 257, 1000, 4096, 65537, 300_000])
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e3])
def test_random_normal(n, scale):
    x = _rng("normal", n, scale).standard_normal(n).astype(F32) * F32(scale)
    _assert_same(x)


@pytest.mark.parametrize("blocksize", [64, 128, 512, 4096])
def test_other_blocksizes(blocksize):
    rng = _rng("blocksize", blocksize)
    x = (rng.standard_normal(50_001) * 10.0 ** rng.uniform(-6, 3, 50_001)).astype(F32)
    _assert_same(x, blocksize=blocksize)


def test_between_adjacent_codes():
    rng = _rng("pairs")
    c = DYNAMIC_MAP
    parts = [rng.uniform(c[k], c[k + 1], 400).astype(F32) for k in range(255)]
    mids = ((c[:-1] + c[1:]) * F32(0.5)).astype(F32)
    near_mid = (mids.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)).reshape(-1).view(F32)
    _assert_same(_with_absmax_one(np.concatenate([*parts, near_mid, c, -c, mids])))


def test_grid_boundaries_of_the_table():
    # The points where the rounding of fma(u, 65535, 0.5) switches table entry, a few ulp either side.
    half = ((np.arange(LUT_SIZE - 1) + 0.5) * 2 / (LUT_SIZE - 1) - 1).astype(F32)
    x = (half.view(np.int32)[:, None] + np.arange(-2, 3, dtype=np.int32)).reshape(-1).view(F32)
    _assert_same(_with_absmax_one(x[np.abs(x) <= 1]))


def test_tiny_and_signed_zero():
    tiny = (F32(10) ** np.linspace(-45, -4, 3000).astype(F32)).astype(F32)
    _assert_same(_with_absmax_one(np.concatenate([tiny, -tiny, [0.0, -0.0, 1.0, -1.0]])))


def test_zero_blocks_and_single_nonzero():
    rng = _rng("zeros")
    x = np.zeros(256 * 6 + 17, dtype=F32)
    x[256 * 2 : 256 * 3] = -0.0
    x[256 * 3 + rng.integers(256)] = F32(-2.5)  # one nonzero in a block of zeros
    x[256 * 4 + 255] = F32(1e-30)
    x[-1] = F32(7.0)  # short last block
    _assert_same(x)
    _assert_same(np.zeros(3, F32))


def test_nan_inf_and_subnormal():
    rng = _rng("special")
    x = rng.standard_normal(256 * 8).astype(F32)
    x[::13] = np.nan
    x[256 * 2 : 256 * 3] = np.nan  # all-NaN block
    x[256 * 4 + 3] = np.inf
    x[256 * 5 : 256 * 6] *= F32(1e-41)  # subnormal absmax: 1/absmax overflows
    x[256 * 6 : 256 * 6 + 100] = 0
    x[256 * 6 + 100 :] = rng.standard_normal(x.size - 256 * 6 - 100).astype(F32) * F32(1e-39)
    _assert_same(x)


def test_not_nearest_code():
    # The documented departures from the nearest code: zero and tiny values, NaN.
    idx, _ = quantize_blockwise_cpu(np.array([1.0, 0.0, 1e-6, -1e-6, np.nan], F32), DYNAMIC_MAP)
    assert idx.tolist() == [255, 131, 131, 123, 0]
    assert set(range(124, 131)).isdisjoint(build_quantize_lut(DYNAMIC_MAP).tolist())
    assert lut_index(np.array([-1.0, 1.0, np.nan, 2.0], F32)).tolist() == [0, LUT_SIZE - 1, 0, LUT_SIZE - 1]


@pytest.mark.parametrize("kind", ["linear", "normal", "random", "unsorted"])
def test_other_maps(kind):
    rng = _rng("map", kind)
    code = {
        "linear": lambda: F.create_linear_map(signed=True).numpy(),
        "normal": lambda: F.create_normal_map().numpy(),
        "random": lambda: np.sort(rng.uniform(-1, 1, 256)),
        "unsorted": lambda: rng.uniform(-1, 1, 256),
    }[kind]()
    code = np.ascontiguousarray(code, dtype=F32)
    x = rng.standard_normal(20_000).astype(F32)
    _assert_same(x, code)
    _assert_same(_with_absmax_one(np.linspace(-1, 1, 50_000, dtype=F32)), code)
