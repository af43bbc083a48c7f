"""`nf4.linear`'s shortest repeat call (`_fast_call`), checked on any machine with a stand-in for the bound launch.

On a GPU the fast call launches a kernel bound by nf4.runtime; here that bound launch is stood in by a recorder of
the pointers it is handed, so that what the fast call passes, and when it refuses
(leaving the call to the checked path), is seen without a GPU. On a CUDA machine the last test checks that the
checked repeat call notes the entry and the next call takes it; the kernels' results through it are checked there
by test_repeat.py and test_gpu.py (where the fast call is the repeat call's default).
"""

from __future__ import annotations

import pytest
import torch

import nf4
from nf4.dequant.api import contiguous_strides
from nf4.linear import api as linear_api

N, K = 40, 128


class _Recorder:
    """A stand-in for nf4.runtime's bound launch: `fn(ctx, stream, x_ptr, packed_ptr, out_ptr)` records the call."""

    def __init__(self):
        self.ctx = object()
        self.calls = []

    def fn(self, ctx, stream, *ptrs):
        assert ctx is self.ctx
        self.calls.append(ptrs)


def _served(x, packed, qs):
    """What nf4.linear's repeat call does first (for a plain packed tensor and no bias): the cache entry of the
    QuantState, its check of the state and the packed tensor (the packed pointer, or -1), then that entry's fast
    call; None: refused (the call goes on to the checked path)."""
    entry = linear_api.CACHE.peek(qs)
    ptr = -1 if entry is None else entry.check(qs, packed)
    return None if ptr < 0 else linear_api._fast_call(x, ptr, entry)


def _fast(x, packed, entry):
    """The entry's fast call on x and the packed tensor's bytes."""
    return linear_api._fast_call(x, packed.data_ptr(), entry)


@pytest.fixture
def fast(nf4h, monkeypatch):
    """(packed, QuantState, the weight's cache entry, x (3, K) bfloat16, the recorder) with a bound launch stood
    in for M = 3 and its fast entry noted, as the checked repeat call notes it (on a CPU-only build
    nf4.runtime.raw_stream gives stream 0)."""
    seed = nf4h.case_seed("fast-call")
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=seed)
    w = linear_api.entry_of(packed, qs)
    assert linear_api.CACHE.get(qs, packed) is w
    rec = _Recorder()
    ftz = w.index >= 0  # the device's default that the repeat call uses
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((3, K), generator=g).to(torch.bfloat16)
    linear_api._remember_fast(x, w, ftz)
    assert not w.fast  # no bound launch for M = 3 yet: nothing noted
    w.launches[(3, torch.bfloat16, False, False, None, ftz)] = (rec, None, 0)
    linear_api._remember_fast(x, w, ftz)
    yield packed, qs, w, x, rec
    linear_api.CACHE.forget(qs)


def test_nothing_noted_for_a_split_sum_or_the_dequant_path(nf4h):
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("fast-none"))
    w = linear_api.entry_of(packed, qs)
    ftz = w.index >= 0
    x = torch.zeros((5, K), dtype=torch.bfloat16)
    for plan in ((_Recorder(), _Recorder(), 5 * N * 2), linear_api._DEQUANT, 0):
        w.launches[(5, torch.bfloat16, False, False, None, ftz)] = plan
        linear_api._remember_fast(x, w, ftz)
        assert not w.fast, plan
    linear_api.CACHE.forget(qs)


def test_fast_entry_made_and_used(fast):
    packed, qs, w, x, rec = fast
    assert set(w.fast) == {x.shape}
    before = x.clone()
    y1 = _fast(x, packed, w)
    y2 = nf4.linear(x, packed, qs)  # the public call takes the fast entry
    assert y1 is not None and len(rec.calls) == 2
    for y, ptrs in ((y1, rec.calls[0]), (y2, rec.calls[1])):
        assert y.shape == (3, N) and y.dtype == torch.bfloat16 and y.is_contiguous()
        assert y.stride() == torch.empty((3, N)).stride()
        assert ptrs == (x.data_ptr(), packed.data_ptr(), y.data_ptr())
    assert y1.data_ptr() != y2.data_ptr()  # a fresh output every call
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))


def test_fast_entry_with_leading_dimensions(fast):
    packed, qs, w, x, rec = fast
    x3 = x.view(1, 3, K)
    assert _fast(x3, packed, w) is None  # another shape of x: not noted yet
    linear_api._remember_fast(x3, w, w.index >= 0)
    y = _fast(x3, packed, w)
    assert y is not None and y.shape == (1, 3, N) and y.stride() == torch.empty((1, 3, N)).stride()
    assert rec.calls[-1] == (x3.data_ptr(), packed.data_ptr(), y.data_ptr())
    y = nf4.linear(x3, packed, qs)  # the public call takes it too
    assert y.shape == (1, 3, N) and rec.calls[-1] == (x3.data_ptr(), packed.data_ptr(), y.data_ptr())


def _refusals(packed, qs, x):
    """(what changed, x, packed, QuantState, whether the fast call itself refuses) for each call the fast entry must
    not serve; the packed tensors of another byte count or dtype are refused by the cache entry's check
    (`check`), before the fast call."""
    unaligned_x = torch.empty(3 * K + 8, dtype=torch.bfloat16)[1:3 * K + 1].view(3, K).copy_(x)
    store = torch.empty(packed.numel() + 16, dtype=packed.dtype)
    unaligned_packed = store[1:packed.numel() + 1].view(packed.shape).copy_(packed)
    strided_x = torch.empty((3, 2 * K), dtype=torch.bfloat16)[:, ::2].copy_(x)
    return [
        ("float16 x", x.to(torch.float16), packed, qs, True),
        ("another M", torch.cat([x, x]), packed, qs, True),
        ("non-contiguous x", strided_x, packed, qs, True),
        ("x not 16-byte aligned", unaligned_x, packed, qs, True),
        ("packed not 16-byte aligned", x, unaligned_packed, qs, True),
        ("packed of another byte count", x, packed[:-1], qs, False),
        ("packed of another dtype", x, packed.view(torch.int8), qs, False),
    ]


def test_fast_call_refuses_what_it_was_not_made_for(fast):
    packed, qs, w, x, rec = fast
    for what, x2, packed2, qs2, by_fast_call in _refusals(packed, qs, x):
        assert _served(x2, packed2, qs2) is None, what
        if by_fast_call:
            assert _fast(x2, packed2, w) is None, what
    assert not rec.calls
    assert _served(x, packed, qs) is not None and len(rec.calls) == 1  # the call it was made for


def test_fast_call_refuses_a_changed_quant_state(fast):
    packed, qs, w, x, rec = fast
    old = qs.absmax
    qs.absmax = old.clone()
    try:
        assert linear_api.CACHE.get(qs, packed) is None
        assert _served(x, packed, qs) is None
    finally:
        qs.absmax = old
    assert not rec.calls
    assert linear_api.CACHE.get(qs, packed) is w
    assert _served(x, packed, qs) is not None and len(rec.calls) == 1


def test_fast_call_leaves_autograd_to_the_checked_path(fast):
    packed, _, w, x, _ = fast
    xg = x.clone().requires_grad_(True)
    assert _fast(xg, packed, w) is None
    with torch.no_grad():
        y = _fast(xg, packed, w)
    assert y is not None and not y.requires_grad


@pytest.mark.parametrize("shape", [(1, 1024), (0, 5), (3, 0, 2), (7,), (2, 1, 3), (), (5, 1)])
def test_contiguous_strides_are_torchs(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()
    assert contiguous_strides(torch.Size(shape)) == torch.empty(shape).stride()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bound launches need a CUDA GPU")
def test_the_repeat_call_notes_and_takes_the_fast_entry_on_a_gpu(nf4h):
    import sys

    n = k = 4096  # a weight whose M = 1 row is a single launch (GEMV_MMA_WK) on the H100 and H200
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, True, seed=nf4h.case_seed("fast-gpu"), device="cuda")
    x = torch.randn((1, k), device="cuda").to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), nf4.dequantize(packed, qs).float()).to(torch.bfloat16)
    got = [nf4.linear(x, packed, qs) for _ in range(3)]  # full path, bound on the second, noted on the third
    w = linear_api.CACHE.get(qs, packed)
    assert w is not None and x.shape in w.fast
    calls = []
    code = linear_api._fast_call.__code__

    def hook(frame, event, arg):
        if event == "return" and frame.f_code is code:
            calls.append(arg is not None)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        y = nf4.linear(x, packed, qs)
    finally:
        sys.setprofile(previous)
    assert calls == [True]
    for r in (*got, y):  # the single-launch GEMV at M = 1: one product per output, against float32 on the operand
        assert torch.equal(r.view(torch.int16), got[0].view(torch.int16))
    assert (y.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-6
    linear_api.CACHE.forget(qs)
