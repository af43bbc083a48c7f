"""The contract of `nf4.dequantize` around the kernel (CPU tensors, Triton's interpreter).

Bad input raises ValueError/TypeError naming the field and what was expected; inputs are never
written; `out` is filled completely and nothing outside it is touched; the returned tensor is `out`
itself; and torch.compile(fullgraph=True) traces the call without a graph break, bit-exact. Also the
repeat-call cache: what it serves and keeps, and when a state's launch is bound.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.dequant.kernel import nf4_dequantize_kernel
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_dequantize_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

META = torch.device("meta")  # stands in for "another device" on a machine with only a CPU


@pytest.fixture
def dq_case(nf4h):
    """A fresh double-quantized (packed, state) of odd size: nothing is shared between tests."""
    return nf4h.quantize((5, 67), torch.float16, 64, True, seed=nf4h.case_seed("api-dq"))


@pytest.fixture
def plain_case(nf4h):
    """A fresh (packed, state) without double quantization."""
    return nf4h.quantize((5, 67), torch.float16, 64, False, seed=nf4h.case_seed("api-plain"))


# Each bad case: (id, builder(nf4h, packed, state) -> (packed, state, kwargs), exception, regex). The
# regex names the field and what was expected.
def _cs(**changes):
    return lambda h, p, s: (p, h.clone_state(s, **changes), {})


def _cs2(**changes):
    return lambda h, p, s: (p, h.clone_state(s, state2=h.clone_state(s.state2, **changes)), {})


def _packed(fn):
    return lambda h, p, s: (fn(p), s, {})


def _kw(**kwargs):
    return lambda h, p, s: (p, s, {k: (v(s) if callable(v) else v) for k, v in kwargs.items()})


def _noncontiguous_packed(p):
    wide = torch.cat([p, p], dim=1)  # (k, 2): column 0 is p, a strided view
    view = wide[:, :1]
    assert not view.is_contiguous() and torch.equal(view, p)
    return view


def _out_over_packed(h, p, s):
    """An `out` whose first bytes hold the packed weight (a copy of it): the kernel would overwrite its input."""
    out = torch.zeros(5, 67, dtype=torch.float16)
    packed = out.view(-1).view(torch.uint8)[: p.numel()].view(-1, 1)
    packed.copy_(p)
    return packed, s, {"out": out}


def _out_over_absmax(h, p, s):
    """An `out` whose bytes hold the state's absmax (a copy of it)."""
    out = torch.zeros(5, 67, dtype=torch.float16)
    absmax = out.view(-1).view(torch.uint8)[100 : 100 + s.absmax.numel()]
    absmax.copy_(s.absmax)
    return p, h.clone_state(s, absmax=absmax), {"out": out}


BAD_DQ = [
    ("packed-int64", _packed(lambda p: p.reshape(-1).view(torch.int64).reshape(-1, 1)),
     TypeError, r"(?s)packed.*int64.*uint8"),
    ("packed-noncontiguous", _packed(_noncontiguous_packed), ValueError, r"packed.*contiguous"),
    ("packed-too-short", _packed(lambda p: p[:-1]), ValueError, r"packed.*bytes.*expected"),
    ("packed-meta", _packed(lambda p: torch.empty_like(p, device=META)), ValueError, r"weight.*meta.*expected"),
    ("quant_type-fp4", _cs(quant_type="fp4"), ValueError, r"quant_type.*'nf4'.*'fp4'"),
    ("blocksize-48", _cs(blocksize=48), ValueError, r"blocksize.*64.*48"),
    ("shape-mismatch", _cs(shape=torch.Size([5, 69])), ValueError, r"packed.*expected"),
    ("dtype-int32", _cs(dtype=torch.int32), TypeError, r"dtype.*float16.*int32"),
    ("absmax-short", lambda h, p, s: (p, h.clone_state(s, absmax=s.absmax[:-1].clone()), {}),
     ValueError, r"absmax.*elements.*expected"),
    ("absmax-float32", lambda h, p, s: (p, h.clone_state(s, absmax=s.absmax.float()), {}),
     TypeError, r"absmax.*uint8.*float32"),
    ("absmax-meta", lambda h, p, s: (p, h.clone_state(s, absmax=torch.empty_like(s.absmax, device=META)), {}),
     ValueError, r"absmax.*meta.*expected cpu"),
    ("state2-missing", _cs(state2=None), ValueError, r"state2.*required"),
    ("state2-blocksize", _cs2(blocksize=128), ValueError, r"state2\.blocksize.*256.*128"),
    ("state2.code-255", _cs2(code=torch.zeros(255)), ValueError, r"state2\.code.*255.*256"),
    ("state2.code-float64", _cs2(code=torch.zeros(256, dtype=torch.float64)), TypeError,
     r"state2\.code.*float32.*float64"),
    ("state2.absmax-long", lambda h, p, s: (p, h.clone_state(s, state2=h.clone_state(
        s.state2, absmax=torch.cat([s.state2.absmax, s.state2.absmax]))), {}), ValueError,
     r"state2\.absmax.*elements.*expected"),
    ("state2.absmax-meta", lambda h, p, s: (p, h.clone_state(s, state2=h.clone_state(
        s.state2, absmax=torch.empty_like(s.state2.absmax, device=META))), {}), ValueError,
     r"state2\.absmax.*meta.*expected cpu"),
    ("state2.code-meta", _cs2(code=torch.empty(256, device=META)), ValueError, r"state2\.code.*meta.*expected cpu"),
    ("offset-float64", lambda h, p, s: (p, h.clone_state(s, offset=s.offset.double()), {}), TypeError,
     r"offset.*float32.*float64"),
    ("offset-meta", lambda h, p, s: (p, h.clone_state(s, offset=torch.empty_like(s.offset, device=META)), {}),
     ValueError, r"offset.*meta.*expected cpu"),
    ("offset-float", _cs(offset=0.5), TypeError, r"offset.*tensor.*float"),
    ("out-shape", _kw(out=lambda s: torch.empty(67, 5, dtype=torch.float16)), ValueError,
     r"out.*shape.*\(67, 5\).*expected \(5, 67\)"),
    ("out-dtype", _kw(out=lambda s: torch.empty(5, 67, dtype=torch.bfloat16)), TypeError,
     r"out.*bfloat16.*expected torch.float16"),
    ("out-dtype-vs-dtype", _kw(out=lambda s: torch.empty(5, 67, dtype=torch.float16), dtype=torch.float32),
     TypeError, r"out.*float16.*expected torch.float32"),
    ("out-noncontiguous", _kw(out=lambda s: torch.empty(67, 5, dtype=torch.float16).t()), ValueError,
     r"out.*contiguous"),
    ("out-meta", _kw(out=lambda s: torch.empty(5, 67, dtype=torch.float16, device=META)), ValueError,
     r"out.*meta.*expected cpu"),
    ("out-not-tensor", _kw(out=lambda s: [0.0] * 335), TypeError, r"out.*Tensor.*list"),
    ("dtype-kwarg-int8", _kw(dtype=torch.int8), TypeError, r"dtype.*float16.*int8"),
    ("out-over-packed", _out_over_packed, ValueError, r"out shares memory with the packed weight"),
    ("out-over-absmax", _out_over_absmax, ValueError, r"out shares memory with quant_state\.absmax"),
]

BAD_PLAIN = [
    ("absmax-float16", lambda h, p, s: (p, h.clone_state(s, absmax=s.absmax.half()), {}), TypeError,
     r"absmax.*float32.*float16"),
    ("absmax-uint8", lambda h, p, s: (p, h.clone_state(s, absmax=s.absmax.to(torch.uint8)), {}), TypeError,
     r"absmax.*float32.*uint8"),
    ("absmax-long", lambda h, p, s: (p, h.clone_state(s, absmax=torch.cat([s.absmax, s.absmax])), {}), ValueError,
     r"absmax.*elements.*expected"),
    ("absmax-noncontiguous", lambda h, p, s: (p, h.clone_state(s, absmax=torch.stack([s.absmax, s.absmax], 1)[:, 0]),
                                               {}), ValueError, r"absmax.*contiguous"),
]


def _run_bad(nf4h, case, build, exc, pattern):
    packed, state = case
    before = nf4h.snapshot(packed, state)
    bad_packed, bad_state, kwargs = build(nf4h, packed, state)
    bad_before = nf4h.snapshot(bad_packed, bad_state)
    with pytest.raises(exc, match=pattern):
        nf4.dequantize(bad_packed, bad_state, **kwargs)
    nf4h.assert_unchanged(before, packed, state)
    nf4h.assert_unchanged(bad_before, bad_packed, bad_state)


@pytest.mark.parametrize(("build", "exc", "pattern"), [c[1:] for c in BAD_DQ], ids=[c[0] for c in BAD_DQ])
def test_bad_input_double_quant(nf4h, dq_case, build, exc, pattern):
    _run_bad(nf4h, dq_case, build, exc, pattern)


@pytest.mark.parametrize(("build", "exc", "pattern"), [c[1:] for c in BAD_PLAIN], ids=[c[0] for c in BAD_PLAIN])
def test_bad_input_plain(nf4h, plain_case, build, exc, pattern):
    _run_bad(nf4h, plain_case, build, exc, pattern)


def test_quant_state_missing(dq_case):
    packed, _ = dq_case
    with pytest.raises(TypeError, match=r"quant_state is required"):
        nf4.dequantize(packed)
    with pytest.raises(TypeError, match=r"quant_state is required"):
        nf4.dequantize(packed, None)


def test_weight_not_a_tensor(dq_case):
    _, state = dq_case
    with pytest.raises(TypeError, match=r"weight must be a packed torch.Tensor.*list"):
        nf4.dequantize([1, 2, 3], state)


@pytest.mark.parametrize("layout", ["alloc", "out", "row"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16], ids=str)
def test_inputs_unchanged(nf4h, quant_storage, double_quant, layout):
    packed, state = nf4h.quantize((6, 70), torch.bfloat16, 32, double_quant, quant_storage=quant_storage,
                                  seed=nf4h.case_seed("unchanged", quant_storage, double_quant, layout))
    if layout == "row":
        packed = packed.reshape(1, -1)
    before = nf4h.snapshot(packed, state)
    out = torch.empty(6, 70, dtype=torch.float32) if layout == "out" else None
    got = nf4.dequantize(packed, state, out=out, dtype=torch.float32)
    assert_bitexact(got, nf4h.reference_dequant(packed, state, torch.float32))
    nf4h.assert_unchanged(before, packed, state)


@pytest.mark.parametrize("lead", [0, 3])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("shape", "blocksize"), [((7,), 64), ((3, 5, 67), 64), ((1, 333), 32), ((2, 4096), 4096),
                                                  ((129, 65), 128)], ids=str)
def test_poisoned_out(nf4h, shape, blocksize, out_dtype, lead):
    """`out` inside a NaN buffer: every element of out is written, the guards keep their NaN bits."""
    packed, state = nf4h.quantize(shape, torch.float16, blocksize, True,
                                  seed=nf4h.case_seed("poison", shape, blocksize, out_dtype, lead))
    buf, out = nf4h.poisoned_out(shape, out_dtype, "cpu", lead=lead)
    got = nf4.dequantize(packed, state, out=out, dtype=out_dtype)
    assert got is out
    expect = nf4h.reference_dequant(packed, state, out_dtype)
    assert not torch.isnan(expect.float()).any()
    assert_bitexact(out, expect)
    nf4h.assert_poison_intact(buf, lead, lead + out.numel())


def test_returns_out_itself(nf4h):
    packed, state = nf4h.quantize((40, 96), torch.float16, 64, True, seed=nf4h.case_seed("ret"))
    out = torch.empty(40, 96, dtype=torch.float16)
    got = nf4.dequantize(packed, state, out=out)
    assert got is out and got.data_ptr() == out.data_ptr()
    row = packed.t()
    got = nf4.dequantize(row, state, out=out)  # (1, k) packed: the transpose of out, as bitsandbytes returns
    assert got.data_ptr() == out.data_ptr() and tuple(got.shape) == (96, 40)
    assert got.stride() == out.t().stride()
    assert_bitexact(got, nf4h.reference_dequant(row, state))


def _no_graph_breaks(fn, *args):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_torch_compile_fullgraph(nf4h, double_quant, with_out):
    from torch._dynamo.utils import counters

    packed, state = nf4h.quantize((33, 100), torch.bfloat16, 64, double_quant,
                                  seed=nf4h.case_seed("compile", double_quant, with_out))
    expect = nf4h.reference_dequant(packed, state)

    if with_out:
        def fn(p, buf):
            return nf4.dequantize(p, state, out=buf)
        args = (packed, torch.empty(33, 100, dtype=torch.bfloat16))
    else:
        def fn(p):
            return nf4.dequantize(p, state)
        args = (packed,)

    _no_graph_breaks(fn, *args)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_bitexact(got, expect)
    if with_out:
        assert_bitexact(args[1], expect, name="out after the compiled call")
    torch._dynamo.reset()


class _Entry:
    """A repeat-call cache entry whose `matches` answers `ok`."""

    def __init__(self):
        self.ok = True

    def matches(self, quant_state, packed):
        return self.ok


def test_repeat_cache_serves_only_matching_entries_and_keeps_no_state_alive():
    """The repeat-call cache each op keeps (nf4.dequant.api.CACHE's class): `get` serves an entry only while it
    matches (`peek` shows it regardless); the entry leaves with its QuantState, which the cache never keeps alive;
    new objects, some at a freed one's address, start without an entry; a state that takes no weak references is
    not cached (its id could be reused); a full cache is emptied before the next state."""
    import gc
    import weakref

    from nf4.dequant import api

    RepeatCache = type(api.CACHE)

    class State:
        pass

    cache = RepeatCache()
    first = State()
    assert cache.get(first, None) is None and cache.peek(first) is None
    entry = _Entry()
    cache.put(first, entry)
    assert cache.get(first, None) is entry and cache.peek(first) is entry and len(cache) == 1
    entry.ok = False
    assert cache.get(first, None) is None and cache.peek(first) is entry  # stale: never served
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None, "the cache keeps the state alive"
    assert len(cache) == 0
    others = [State() for _ in range(50)]
    assert [cache.peek(s) for s in others] == [None] * 50
    for s in others:
        cache.put(s, _Entry())
    assert len(cache) == 50 and all(cache.get(s, None) is not None for s in others)
    cache.forget(others[0])
    assert cache.peek(others[0]) is None and len(cache) == 49
    no_weakref = (1, 2)
    cache.put(no_weakref, _Entry())
    assert cache.peek(no_weakref) is None and len(cache) == 49
    cache.clear()
    assert len(cache) == 0
    small = RepeatCache(limit=3)
    for s in others[:4]:
        small.put(s, _Entry())
    assert len(small) == 1 and small.peek(others[3]) is not None  # full: emptied before the fourth


def test_the_launch_is_bound_on_the_second_call_of_a_state(nf4h):
    """What a full-path call leaves in nf4.dequantize's repeat-call cache (`_remember`, nf4.dequant.api.CACHE): the
    first call of a QuantState notes it (checked, no launch bound), the second binds the launch, later ones keep
    that entry and its bound launch; a call with another config starts again; the entry leaves with the state,
    which it never keeps alive. nf4.dequantize notes CUDA calls only: here `_remember` is driven directly, with a
    stand-in for the compiled kernel (a Python launcher: no C `launch`)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from nf4 import DequantConfig, NF4Weight
    from nf4.dequant import api
    from nf4.dequant.launch import kernel_launch, tuned_config

    packed, state = nf4h.quantize((5, 67), torch.float16, 64, True, seed=nf4h.case_seed("api-remember"))
    w = NF4Weight.of(packed, state)
    out = torch.empty(w.shape, dtype=w.dtype)
    fn, grid, args, _ = kernel_launch(w, out, True, tuned_config(w.device, w.n * out.element_size()),
                                      vec=packed.data_ptr() % 4 == 0)
    compiled = SimpleNamespace(run=lambda *a: None, function=0, packed_metadata=None)
    try:
        api._remember(state, w, out, compiled, fn, grid, args, None)
        entry = api.CACHE.peek(state)
        assert entry is not None and entry.bound is None and entry.matches(state, packed)
        api._remember(state, w, out, compiled, fn, grid, args, None)
        assert api.CACHE.peek(state) is entry and entry.bound is not None
        assert entry.bound.rebind == ("packed_ptr", "out_ptr")
        bound = entry.bound
        api._remember(state, w, out, compiled, fn, grid, args, None)
        assert api.CACHE.peek(state) is entry and entry.bound is bound  # bound once, not on every call
        other = DequantConfig()
        api._remember(state, w, out, compiled, fn, grid, args, other)  # another config: noted anew
        renewed = api.CACHE.peek(state)
        assert renewed is not entry and renewed.bound is None and renewed.config is other
    except BaseException:
        api.CACHE.forget(state)  # a CPU entry with a bound launch must not serve a later call
        raise
    count = len(api.CACHE)
    ref = weakref.ref(state)
    del state, entry, renewed
    gc.collect()
    assert ref() is None, "the cache keeps the QuantState alive"
    assert len(api.CACHE) == count - 1
