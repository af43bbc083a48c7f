"""nf4.runtime with a stand-in kernel, on any machine: specialisation key, cache, recording, named binding.

The stand-in mimics what the runtime reads of a `@triton.jit` function (`params`, `arg_names`,
`do_not_specialize`, `kernel[grid](*args, **options)`) and of a compiled kernel (`run`, `function`,
`packed_metadata`, `kernel[grid](*args)`), so these tests see every call the runtime makes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from nf4 import runtime


class _Param:
    def __init__(self, name, constexpr=False):
        self.name, self.is_constexpr = name, constexpr


class _Compiled:
    def __init__(self, log):
        self.log = log
        self.function, self.packed_metadata = 0xF00, ("meta",)
        self.run = self._wrapper  # a Python wrapper with no C `launch` attribute: the fallback path

    def _wrapper(self, *args):
        self.log.append(("run", args))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("compiled", grid, args))


class _Kernel:
    """Stands in for a @triton.jit function: x_ptr, out_ptr, n, BLOCK (constexpr); n not specialised."""

    __name__ = "stand_in_kernel"

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("out_ptr"), _Param("n"), _Param("BLOCK", True)]
        self.arg_names = [p.name for p in self.params]
        self.do_not_specialize = ["n"]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log)

        return launch


class _Ptr:
    def __init__(self, address, dtype=torch.float16):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address


CUDA0 = SimpleNamespace(type="cuda", index=0)


@pytest.fixture
def no_interpret(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_spec_key_follows_what_triton_specialises_on():
    k = _Kernel()
    base = runtime.spec_key(k, (_Ptr(256), _Ptr(512), 100, 64))
    assert runtime.spec_key(k, (_Ptr(1024), _Ptr(2048), 100, 64)) == base  # other 16-aligned pointers
    assert runtime.spec_key(k, (_Ptr(258), _Ptr(512), 100, 64)) != base  # alignment
    assert runtime.spec_key(k, (_Ptr(256, torch.bfloat16), _Ptr(512), 100, 64)) != base  # dtype
    assert runtime.spec_key(k, (_Ptr(256), _Ptr(512), 100, 128)) != base  # constexpr value
    assert runtime.spec_key(k, (_Ptr(256), _Ptr(512), 112, 64)) == base  # n is not specialised...
    assert runtime.spec_key(k, (_Ptr(256), _Ptr(512), 2**33, 64)) != base  # ...but its width counts
    k.do_not_specialize = []
    assert runtime.spec_key(k, (_Ptr(256), _Ptr(512), 112, 64)) != runtime.spec_key(k, (_Ptr(256), _Ptr(512), 100, 64))
    assert runtime.spec_key(k, (_Ptr(256), _Ptr(512), 1, 64)) != runtime.spec_key(k, (_Ptr(256), _Ptr(512), 3, 64))


def test_launch_compiles_once_then_calls_the_compiled_kernel(no_interpret):
    k = _Kernel()
    args = {"x_ptr": _Ptr(256), "out_ptr": _Ptr(512), "n": 100, "BLOCK": 64}
    first = runtime.launch(k, (7,), args, device=CUDA0, num_warps=2)
    second = runtime.launch(k, (9,), {**args, "n": 101}, device=CUDA0, num_warps=2)
    assert first is second and first is not None
    assert k.log[0][0] == "jit" and k.log[0][1] == (7, 1, 1)
    assert k.log[0][3] == {"num_warps": 2, "enable_fp_fusion": False}  # contraction off unless asked
    assert k.log[1] == ("compiled", (9, 1, 1), (args["x_ptr"], args["out_ptr"], 101, 64))
    runtime.launch(k, (1,), args, device=CUDA0, num_warps=4)  # other options: another binary
    assert k.log[2][0] == "jit"


def test_launch_names_a_missing_argument(no_interpret):
    with pytest.raises(KeyError, match="BLOCK"):
        runtime.launch(_Kernel(), (1,), {"x_ptr": _Ptr(256), "out_ptr": _Ptr(512), "n": 1}, device=CUDA0)


def test_recording_runs_nothing_and_nests(no_interpret):
    k = _Kernel()
    args = {"x_ptr": _Ptr(256), "out_ptr": _Ptr(512), "n": 100, "BLOCK": 64}
    with runtime.recording() as outer:
        with runtime.recording() as inner:
            assert runtime.launch(k, (3,), args, device=CUDA0) is None
        assert runtime.is_recording()
        runtime.launch(k, (4,), args, device=CUDA0, num_warps=8)
    assert not runtime.is_recording() and k.log == []
    assert [r.grid for r in inner] == [(3, 1, 1)] and [r.grid for r in outer] == [(4, 1, 1)]
    assert outer[0].fn is k and outer[0].args[2] == 100 and outer[0].options["num_warps"] == 8


def test_interpreting_follows_the_device_and_the_environment(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert runtime.interpreting(torch.device("cpu"))
    assert not runtime.interpreting(CUDA0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.interpreting(CUDA0)


def test_bind_rebinds_named_slots_through_the_fallback_launcher(no_interpret):
    k = _Kernel()
    args = {"x_ptr": _Ptr(256), "out_ptr": _Ptr(512), "n": 100, "BLOCK": 64}
    compiled = runtime.launch(k, (5,), args, device=CUDA0)
    bound = runtime.bind(compiled, k, (5,), args, ("out_ptr",))
    assert bound.rebind == ("out_ptr",) and bound.grid_x == 5
    bound(77, 4096)  # stream, then the new out_ptr
    assert compiled.log[-1] == ("run", (5, 1, 1, 77, 0xF00, ("meta",), None, None, None, 256, 4096, 100, 64))
    both = runtime.bind(compiled, k, (5,), args, ("out_ptr", "x_ptr"))
    both(78, 8192, 1024)
    assert compiled.log[-1][1][-4:] == (1024, 8192, 100, 64)
    with pytest.raises(KeyError, match="y_ptr"):
        runtime.bind(compiled, k, (5,), args, ("y_ptr",))
    with pytest.raises(ValueError, match="1-D"):
        runtime.bind(compiled, k, (5, 2), args, ("out_ptr",))



@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_a_bound_call_splices_the_rebound_values_into_their_slots(count):
    """The bound call's splicing (runtime._segments and the _call_* functions runtime.splice picks) puts each
    rebound value in its slot, in any slot order, and keeps every other bound value: checked against a plain list
    copy on seeded random layouts."""
    rng = random.Random(count)
    calls = []
    for _ in range(40):
        size = rng.randint(count, 24)
        positions = rng.sample(range(size), count)
        if rng.random() < 0.5:  # the caller's order is the parameter order (the calls without indexing)
            positions.sort()
        values = [f"v{i}" for i in range(size)]
        segments = runtime._segments(values, positions)
        order = tuple(sorted(range(count), key=positions.__getitem__))
        fn, ctx = runtime.splice(lambda *a: calls.append(a), 7, ("head",), segments, order)
        new = [f"new{i}" for i in range(count)]
        calls.clear()
        fn(ctx, 99, *new)
        expected = list(values)
        for value, p in zip(new, positions, strict=True):
            expected[p] = value
        assert calls == [(7, 1, 1, 99, "head", *expected)], (positions, calls)
