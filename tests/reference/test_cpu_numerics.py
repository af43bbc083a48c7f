"""`reference.cpu_numerics` against torch's CPU kernels, bit for bit.

The double-quantization offset is `absmax.mean()`, computed by torch's float32 reduction, whose
result depends on the summation order (SIMD lanes, 4 accumulators, a cascade, and from 32768
elements on the split over threads). The model replays that order with lanes=8, measured for torch
2.13.0+cpu on x86-64 (AVX512 capability). The data span eight decades so that the order matters:
`test_order_matters` checks that a plain sequential float32 sum would fail these tests.

`torch_linspace_f32` is exact for 2..31 steps with lanes=16, contract=True (the scalar path and
the first vector pairs). From 32 steps on torch's vectorised path is not modelled exactly (1-2
ulp off in some entries); `test_linspace_vector_path_is_bounded` records how far.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference.cpu_numerics import GRAIN_SIZE, torch_linspace_f32, torch_mean_f32, torch_sum_f32  # noqa: E402
from verify.exact import assert_bitexact  # noqa: E402

LANES = 8
SHORT = list(range(1, 201))
LONG = [GRAIN_SIZE - 1, GRAIN_SIZE, GRAIN_SIZE + 1, 40_000, 65_537, 100_003]


def _vector(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4.0, 4.0, n)).astype(np.float32)


@pytest.fixture
def threads(request):
    """Run with torch.set_num_threads(request.param), restoring the previous count afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def _check(n: int, num_threads: int) -> None:
    x = _vector(n)
    t = torch.from_numpy(x)
    assert_bitexact(
        np.atleast_1d(torch_sum_f32(x, lanes=LANES, num_threads=num_threads)),
        torch.sum(t).reshape(1),
        name=f"sum of {n}",
    )
    assert_bitexact(
        np.atleast_1d(torch_mean_f32(x, lanes=LANES, num_threads=num_threads)),
        torch.mean(t).reshape(1),
        name=f"mean of {n}",
    )


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_sum_mean_short(threads):
    """Lengths 1..200 (below GRAIN_SIZE the thread count does not matter)."""
    for n in SHORT:
        _check(n, threads)


@pytest.mark.parametrize("n", LONG)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_sum_mean_long(threads, n):
    """From 32768 elements on torch splits the sum over threads; the model follows the split."""
    _check(n, threads)


def test_order_matters():
    """A naive sequential float32 sum disagrees with torch on this data: the tests above have teeth."""
    wrong = 0
    for n in SHORT:
        x = _vector(n)
        acc = np.float32(0)
        for v in x:
            acc = np.float32(acc + v)
        wrong += int(acc.view(np.uint32) != torch.sum(torch.from_numpy(x)).numpy().view(np.uint32))
    assert wrong > 20


@pytest.mark.parametrize("steps", range(2, 32))
def test_linspace_exact_below_32_steps(steps):
    """`torch_linspace_f32(0.1, 1, steps, lanes=16, contract=True)` is torch.linspace, bit for bit."""
    assert_bitexact(
        torch_linspace_f32(0.1, 1.0, steps, lanes=16, contract=True),
        torch.linspace(0.1, 1.0, steps, dtype=torch.float32),
        name=f"linspace {steps}",
    )


def test_linspace_vector_path_is_bounded():
    """Not exact from 32 steps on (the vector path is not modelled exactly): within 2 ulp, and off
    somewhere, so that this test notices if the model becomes exact and the docstring is stale."""
    off = 0
    for steps in range(32, 129):
        mine = torch_linspace_f32(0.1, 1.0, steps, lanes=16, contract=True)
        theirs = torch.linspace(0.1, 1.0, steps, dtype=torch.float32).numpy()
        diff = mine.view(np.int32).astype(np.int64) - theirs.view(np.int32)
        assert np.abs(diff).max() <= 2, steps
        off += int(np.any(diff))
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # where it was measured: 93 of 97 step counts are off
        assert off > 0
