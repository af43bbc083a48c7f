"""The two codebooks: NF4's 16 levels and the 8-bit dynamic map of the absmax, against bitsandbytes.

`reference.NF4_CODE` is the authority for dequantization and must equal bitsandbytes' table bit for
bit. The rebuilds in `reference.codebook` show where the constants come from and how far a rebuild
lands; their ulp counts are pinned so that a change in either shows.

The dynamic map depends on the CPU build that made it: `create_dynamic_map()` calls
`torch.linspace`, whose vectorised CPU kernel may contract `start + step * k` into one FMA and
processes `Vectorized<float>::size()` lanes at a time. `reference.DYNAMIC_MAP` was recorded on an
AVX512 machine (torch 2.13.0+cpu); other builds differ by 1-2 ulp in some entries. Dequantization
always uses the map stored in the state (`state2.code`), never a rebuilt one.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from verify.exact import assert_bitexact, compare


def _ulp_diff(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Signed int32-view difference, actual minus expected (one ulp per step for same-sign values)."""
    return actual.view(np.int32).astype(np.int64) - expected.view(np.int32).astype(np.int64)


def _bnb_functional():
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes.functional as F

    return F


# --- NF4 ------------------------------------------------------------------------------------------


def test_nf4_code_equals_bnb():
    """`reference.NF4_CODE` is bitsandbytes' `get_4bit_type('nf4')`, bit for bit."""
    F = _bnb_functional()
    assert_bitexact(reference.NF4_CODE, F.get_4bit_type("nf4", device="cpu"), name="NF4 code")


def test_nf4_code_shape():
    """16 float32 levels, strictly ascending, -1.0 first, exact 0.0 at index 7, 1.0 last, read-only."""
    code = reference.NF4_CODE
    assert code.dtype == np.float32 and code.shape == (16,)
    assert np.all(np.diff(code) > 0)
    assert code.view(np.uint32)[[0, 7, 15]].tolist() == [0xBF800000, 0x00000000, 0x3F800000]
    assert not code.flags.writeable


def test_nf4_rebuild_float32_grid_lands_on_every_bit():
    """Normal quantiles at probabilities spaced by a float32 linspace, divided in float32 (what
    bitsandbytes' `create_normal_map` does) reproduce all 16 constants exactly."""
    assert_bitexact(reference.nf4_code_from_normal(float32_grid=True), reference.NF4_CODE, name="rebuild")


# Measured: rebuild minus constant, int32 views, per entry.
FLOAT64_GRID_ULPS = [0, 2, 0, 0, -1, 0, -6, 0, 4, -2, -1, -2, -1, -1, -2, 0]


def test_nf4_rebuild_float64_grid_misses_by_up_to_6_ulp():
    """With the probabilities and the division in float64 the rebuild misses by up to 6 ulp.

    Why: bitsandbytes builds the probabilities with `torch.linspace(0.9677083, 0.5, 9)` in float32,
    so each grid point is off its exact value by up to about a float32 ulp (6e-8 near 0.97), and
    the inverse normal CDF amplifies that by 1/pdf(x), about 14 at the outermost point and 2-3
    near the middle; the float32 levels are then divided by their maximum in float32 (one more
    rounding). The float64 path has neither error, so it lands on other float32 values: the
    constants are the output of that float32 computation, not the correctly rounded quantiles.
    """
    rebuilt = reference.nf4_code_from_normal(float32_grid=False)
    assert _ulp_diff(rebuilt, reference.NF4_CODE).tolist() == FLOAT64_GRID_ULPS
    assert np.abs(FLOAT64_GRID_ULPS).max() == 6


def test_nf4_create_normal_map_matches():
    """bitsandbytes' own `create_normal_map()` holds exactly the 16 constants (plus zero padding)."""
    F = _bnb_functional()
    values = F.create_normal_map().numpy()
    assert values.shape == (256,)
    assert_bitexact(np.unique(values), reference.NF4_CODE, name="create_normal_map levels")


# --- the dynamic map (state2.code) ----------------------------------------------------------------


def _cpu_capability() -> str:
    torch = pytest.importorskip("torch")
    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture(scope="module")
def bnb_dynamic_map() -> np.ndarray:
    F = _bnb_functional()
    return F.create_dynamic_map().numpy()


def test_dynamic_map_recorded_constant(bnb_dynamic_map):
    """`reference.DYNAMIC_MAP` equals `create_dynamic_map()` exactly on an AVX512 build (where it was
    recorded), within 2 ulp elsewhere."""
    if _cpu_capability() == "AVX512":
        assert_bitexact(reference.DYNAMIC_MAP, bnb_dynamic_map, name="DYNAMIC_MAP")
    else:
        assert np.abs(_ulp_diff(reference.DYNAMIC_MAP, bnb_dynamic_map)).max() <= 2


# (contract, lanes) -> (entries that differ, max |ulp|), measured against create_dynamic_map() on
# this AVX512 machine with torch 2.13.0+cpu.
DYNAMIC_MAP_MEASURED = {
    (False, 8): (46, 2),
    (False, 16): (44, 2),
    (True, 8): (30, 2),
    (True, 16): (16, 1),
}


@pytest.mark.parametrize("contract, lanes", list(DYNAMIC_MAP_MEASURED), ids=lambda v: str(v))
def test_dynamic_map_rebuild(bnb_dynamic_map, contract, lanes):
    """`reference.dynamic_map(contract, lanes)` stays within 2 ulp of bitsandbytes' map.

    The map's level i (i = 0..6, magnitudes in (10**(i-7), 10**(i-6))) comes from
    `linspace(0.1, 1, 2**i + 1)`. Linspaces of at most 17 steps are built by the scalar path for
    these lane counts (or, for 17 steps at 8 lanes, by one vector pair whose lanes the model gets
    right): with contract=True every entry below 0.01 in magnitude (steps <= 17) must match exactly.
    On the AVX512 build the differing counts are pinned as measured.
    """
    rebuilt = reference.dynamic_map(contract=contract, lanes=lanes)
    assert rebuilt.shape == (256,) and rebuilt.dtype == np.float32
    diff = _ulp_diff(rebuilt, bnb_dynamic_map)
    assert np.abs(diff).max() <= 2, compare(rebuilt, bnb_dynamic_map, name="dynamic map").detail
    if contract:
        small = np.abs(bnb_dynamic_map) < np.float32(0.01)
        assert_bitexact(rebuilt[small], bnb_dynamic_map[small], name="entries from linspace with <= 17 steps")
    if _cpu_capability() == "AVX512":
        count, worst = DYNAMIC_MAP_MEASURED[(contract, lanes)]
        assert (int(np.count_nonzero(diff)), int(np.abs(diff).max())) == (count, worst)


def test_dynamic_map_structure():
    """256 sorted float32 entries: -0.99296875 ... 1.0, one exact zero, symmetric except the 1.0."""
    dm = reference.DYNAMIC_MAP
    assert dm.shape == (256,) and np.all(np.diff(dm) > 0)
    assert dm.view(np.uint32)[[0, 127, 255]].tolist() == [0xBF7E3333, 0x00000000, 0x3F800000]
    assert_bitexact(-dm[:127][::-1], dm[128:255], name="negative half mirrored")
