"""The repeat calls' own path (a bound launch serving the call), on any machine: the bound launch is stood in by a
recorder of the pointers it is handed, so that which calls it serves, and what it passes, is seen without a GPU.

Both ops: every call form (Linear4bit, Params4bit, packed + QuantState, a fresh view, out= for nf4.dequantize) is
served with the caller's pointers; after each change of test_stale_state.py's list the stood-in launch serves only
where nothing it was bound for changed (other packed bytes of the same layout), and the call goes on to the full
path otherwise; an out= that shares memory with the packed bytes or a state tensor is refused with the full path's
error.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import nf4
from nf4.dequant import api as dequant_api
from nf4.dequant.launch import kernel_launch, tuned_config
from nf4.linear import api as linear_api


def _sibling(name: str):
    """A test module beside this one (the tests are no package: pytest imports them by path)."""
    spec = importlib.util.spec_from_file_location(f"_nf4_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_stale = _sibling("test_stale_state")  # its mutations and helpers: the same changes, here against the stand-in
MUTATIONS, N, _fresh_state, _weight, _x = (_stale.MUTATIONS, _stale.N, _stale._fresh_state, _stale._weight,
                                           _stale._x)
bnb = pytest.importorskip("bitsandbytes")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # a GPU run: test_stale_state.py runs the real launches
    pytest.skip("the stood-in launches run on CPU tensors, in Triton's interpreter", allow_module_level=True)
# mutations after which the bound launch may serve: the state is unchanged and the packed bytes are of its layout
SERVED = {"packed of another weight", "packed bytes changed in place"}


class _Recorder:
    """Stands in for a bound launch: `fn(ctx, stream, *ptrs)` records the pointers."""

    def __init__(self):
        self.ctx = object()
        self.calls = []

    def fn(self, ctx, stream, *ptrs):
        assert ctx is self.ctx
        self.calls.append(ptrs)


def _bind_dequant(packed, qs) -> _Recorder:
    """nf4.dequantize's entry of (packed, qs) as its second call leaves it, its bound launch a recorder."""
    w = nf4.NF4Weight.of(packed, qs)
    out = torch.empty(w.shape, dtype=w.dtype)
    fn, grid, args, _ = kernel_launch(w, out, True, tuned_config(w.device, w.n * out.element_size()),
                                      vec=packed.data_ptr() % 4 == 0)
    compiled = SimpleNamespace(run=lambda *a: None, function=0, packed_metadata=None)
    for _ in range(2):  # the first call notes the state, the second binds
        dequant_api._remember(qs, w, out, compiled, fn, grid, args, None)
    entry = dequant_api.CACHE.peek(qs)
    entry.bound = rec = _Recorder()
    return rec


def _bind_linear(packed, qs, x) -> _Recorder:
    """nf4.linear's entry of (packed, qs) with a bound single launch for x's shape, noted for the fast call."""
    entry = linear_api.entry_of(packed, qs)
    ftz = entry.index >= 0  # the device's default that the repeat call uses
    rec = _Recorder()
    entry.launches[(x.numel() // x.shape[-1], x.dtype, False, False, None, ftz)] = (rec, None, 0)
    linear_api._remember_fast(x, entry, ftz)
    assert entry.fast
    return rec


def _layer(packed, qs):
    params = bnb.nn.Params4bit(data=packed, requires_grad=False, quant_state=qs, quant_type="nf4",
                               blocksize=qs.blocksize, compress_statistics=True, module=None, bnb_quantized=True)
    layer = bnb.nn.Linear4bit(qs.shape[1], qs.shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = params
    assert layer.weight.quant_state is qs and layer.weight.data_ptr() == packed.data_ptr()
    return layer, params


@pytest.fixture
def state():
    packed, qs = _weight("cpu", 5)
    yield packed, qs
    dequant_api.CACHE.forget(qs)
    linear_api.CACHE.forget(qs)


def test_every_call_form_is_served_by_the_bound_launch(state):
    packed, qs = state
    x = _x("cpu")
    layer, params = _layer(packed, qs)
    dq, lin = _bind_dequant(packed, qs), _bind_linear(packed, qs, x)
    ptr = packed.data_ptr()
    out = torch.empty(tuple(qs.shape), dtype=qs.dtype)
    for form, weight in (("module", (layer,)), ("Params4bit", (params,)), ("packed + state", (packed, qs)),
                         ("fresh view", (packed.view(-1, 1), qs))):
        y = nf4.dequantize(*weight)
        assert dq.calls[-1] == (ptr, y.data_ptr()) and y.shape == qs.shape and y.dtype == qs.dtype, form
        assert nf4.dequantize(*weight, out=out) is out and dq.calls[-1] == (ptr, out.data_ptr()), form
        y = nf4.linear(x, *weight)
        assert lin.calls[-1] == (x.data_ptr(), ptr, y.data_ptr()) and y.shape == (x.shape[0], N), form
    assert len(dq.calls) == 8 and len(lin.calls) == 4
    row = packed.view(1, -1)  # a row-shaped packed tensor: the result transposed, as bitsandbytes returns it
    y = nf4.dequantize(row, qs)
    assert dq.calls[-1] == (ptr, y.data_ptr()) and y.shape == qs.shape[::-1]


@pytest.mark.parametrize("op", ["dequantize", "linear"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_changed_state_is_served_only_where_nothing_bound_changed(op, mutation):
    packed, qs = _weight("cpu", 6)
    x = _x("cpu")
    rec = _bind_dequant(packed, qs) if op == "dequantize" else _bind_linear(packed, qs, x)
    try:
        called_with = MUTATIONS[mutation](packed, qs, "cpu")
        try:
            y = nf4.dequantize(called_with, qs) if op == "dequantize" else nf4.linear(x, called_with, qs)
        except (ValueError, TypeError):
            y = None
        if mutation in SERVED:
            ptrs = (called_with.data_ptr(), y.data_ptr())
            assert rec.calls == [ptrs if op == "dequantize" else (x.data_ptr(), *ptrs)]
        else:
            assert rec.calls == [], f"{mutation}: the bound launch served a changed state"
            fresh = _fresh_state(qs)
            try:  # the full path's outcome: the same as for a state never seen
                want = nf4.dequantize(called_with, fresh) if op == "dequantize" else nf4.linear(x, called_with, fresh)
            except (ValueError, TypeError):
                want = None
            assert (y is None) == (want is None), mutation
            if y is not None:
                assert torch.equal(y.view(torch.int16), want.view(torch.int16)), mutation
    finally:
        dequant_api.CACHE.forget(qs)
        linear_api.CACHE.forget(qs)


@pytest.mark.parametrize("within", ["packed", "absmax", "state2.absmax", "state2.code", "offset"])
def test_an_out_sharing_memory_with_an_input_is_refused(within):
    """out= over the bytes of the packed weight or of a state tensor: not served (the bound launch would overwrite
    its own input), and the full path's error names the input."""
    packed, qs = _weight("cpu", 7)
    n_out = qs.shape[0] * qs.shape[1] * 2
    room = torch.zeros(n_out + 4096, dtype=torch.uint8)  # out at its start; the input placed inside it
    if within == "packed":
        packed = room[64:64 + packed.numel()].view(packed.shape).copy_(packed)
    else:
        holder = qs.state2 if within.startswith("state2.") else qs
        name = within.split(".")[-1]
        t = getattr(holder, name)
        nbytes = t.numel() * t.element_size()
        setattr(holder, name, room[96:96 + nbytes].view(t.dtype).view(t.shape).copy_(t))
    out = room[:n_out].view(torch.bfloat16).view(tuple(qs.shape))
    rec = _bind_dequant(packed, qs)
    try:
        separate = torch.empty(tuple(qs.shape), dtype=qs.dtype)
        assert nf4.dequantize(packed, qs, out=separate) is separate and len(rec.calls) == 1
        with pytest.raises(ValueError, match="shares memory with"):
            nf4.dequantize(packed, qs, out=out)
        assert len(rec.calls) == 1
    finally:
        dequant_api.CACHE.forget(qs)
