"""No repeat-call cache serves a state it did not check: after a first call, each field and tensor of a
QuantState (and the packed tensor) is changed, and the next call must give the bits a call with a QuantState
never seen before gives, or the same error.

Runs on the CPU in Triton's interpreter and, where CUDA is present, on the GPU too (where the caches bind
launches). Both ops: nf4.dequantize and nf4.linear (whose fused path caches per (M, dtype, ...) key).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nf4

bnb_f = pytest.importorskip("bitsandbytes.functional")

N, K, BLOCKSIZE = 32, 128, 64
# the interpreter on a machine without CUDA (nf4 refuses CPU tensors where the interpreter is off), the GPU on one
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _weight(device, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 4
    packed, qs = bnb_f.quantize_4bit(w.to(device), blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    qs.dtype = dtype
    return packed, qs


def _fresh_state(qs):
    """A QuantState object no cache has seen, holding the (possibly changed) fields and tensors of `qs`."""
    fresh = copy.copy(qs)  # a new object; the same tensors
    if getattr(qs, "state2", None) is not None:
        fresh.state2 = copy.copy(qs.state2)
    return fresh


def _x(device):
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, K, generator=g).to(device=device, dtype=torch.bfloat16)


def _call(op, device, packed, qs):
    if op == "dequantize":
        return nf4.dequantize(packed, qs)
    return nf4.linear(_x(device), packed, qs)


def _outcome(fn):
    try:
        y = fn()
    except (ValueError, TypeError) as exc:
        return ("error", type(exc), str(exc))
    return ("bits", y.dtype, tuple(y.shape), y.contiguous().view(torch.int16 if y.element_size() == 2 else
                                                                 torch.int32).cpu())


def _noncontiguous_copy(packed):
    flat = packed.reshape(-1)
    room = torch.zeros(2 * flat.numel(), dtype=flat.dtype, device=flat.device)
    room[::2] = flat
    return room[::2].unsqueeze(1)  # the same values, stride 2


def _misaligned_copy(packed):
    flat = packed.reshape(-1)
    room = torch.zeros(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
    room[1:] = flat
    return room[1:].view(packed.shape)  # the same values, one byte off


# name -> mutation(packed, qs, device) returning the packed tensor to call with (qs changed in place)
MUTATIONS = {
    "packed non-contiguous, same values": lambda p, qs, d: _noncontiguous_copy(p),
    "packed misaligned, same values": lambda p, qs, d: _misaligned_copy(p),
    "packed of another weight": lambda p, qs, d: _weight(d, 99)[0],
    "packed bytes changed in place": lambda p, qs, d: p.copy_(p.flip(0)),
    "packed viewed as bfloat16": lambda p, qs, d: p.view(-1).view(torch.bfloat16).unsqueeze(1),
    "packed too short": lambda p, qs, d: p[:-2],
    "quant_type fp4": lambda p, qs, d: (setattr(qs, "quant_type", "fp4"), p)[1],
    "blocksize 128": lambda p, qs, d: (setattr(qs, "blocksize", 128), p)[1],
    "nested cleared": lambda p, qs, d: (setattr(qs, "nested", False), p)[1],
    "dtype float16": lambda p, qs, d: (setattr(qs, "dtype", torch.float16), p)[1],
    "shape transposed": lambda p, qs, d: (setattr(qs, "shape", torch.Size((K, N))), p)[1],
    "absmax replaced": lambda p, qs, d: (setattr(qs, "absmax", qs.absmax.flip(0).contiguous()), p)[1],
    "absmax changed in place": lambda p, qs, d: (qs.absmax.copy_(qs.absmax.flip(0)), p)[1],
    "absmax .data swapped": lambda p, qs, d: (setattr(qs.absmax, "data", qs.absmax.flip(0).contiguous()), p)[1],
    "absmax resized in place": lambda p, qs, d: (qs.absmax.resize_(qs.absmax.numel() - 1), p)[1],
    "absmax .data viewed as int8": lambda p, qs, d: (setattr(qs.absmax, "data", qs.absmax.view(torch.int8)), p)[1],
    "offset .data viewed as int32": lambda p, qs, d: (setattr(qs.offset, "data", qs.offset.view(torch.int32)), p)[1],
    "absmax float32": lambda p, qs, d: (setattr(qs, "absmax", qs.absmax.float()), p)[1],
    "state2.absmax replaced": lambda p, qs, d: (setattr(qs.state2, "absmax", qs.state2.absmax * 2), p)[1],
    "state2.absmax changed in place": lambda p, qs, d: (qs.state2.absmax.mul_(0.5), p)[1],
    "state2.code replaced": lambda p, qs, d: (setattr(qs.state2, "code", qs.state2.code.flip(0).contiguous()), p)[1],
    "state2.blocksize 128": lambda p, qs, d: (setattr(qs.state2, "blocksize", 128), p)[1],
    "state2 removed": lambda p, qs, d: (setattr(qs, "state2", None), p)[1],
    "offset replaced": lambda p, qs, d: (setattr(qs, "offset", qs.offset + 1), p)[1],
    "offset changed in place": lambda p, qs, d: (qs.offset.add_(0.25), p)[1],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["dequantize", "linear"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_changed_state_gives_fresh_call_bits_or_the_same_error(device, op, mutation):
    packed, qs = _weight(device, 1)
    first = _outcome(lambda: _call(op, device, packed, qs))
    assert first[0] == "bits"
    _call(op, device, packed, qs)  # the second call: the caches bind their launches here
    called_with = MUTATIONS[mutation](packed, qs, device)
    again = _outcome(lambda: _call(op, device, called_with, qs))
    fresh = _outcome(lambda: _call(op, device, called_with, _fresh_state(qs)))
    if fresh[0] == "error":
        assert again[:2] == fresh[:2], f"{mutation}: cached call gave {again[:2]}, fresh call {fresh}"
    else:
        assert again[0] == "bits", f"{mutation}: cached call raised {again}, fresh call gave bits"
        assert again[1:3] == fresh[1:3]
        diff = (again[3] != fresh[3]).nonzero()
        assert diff.numel() == 0, f"{mutation}: {diff.shape[0]} outputs differ from a fresh call, first {diff[:4]}"


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_state_changes_the_result(device):
    """The mutations above are not no-ops: a replaced absmax gives other bits than the first call (so the
    comparison with a fresh call can tell a stale launch from a fresh one)."""
    packed, qs = _weight(device, 1)
    before = nf4.dequantize(packed, qs).clone()
    nf4.dequantize(packed, qs)
    qs.absmax = qs.absmax.flip(0).contiguous()
    after = nf4.dequantize(packed, qs)
    assert (before.view(torch.int16) != after.view(torch.int16)).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["0-d x", "meta x", "meta bias", "meta weight", "integer x"])
def test_bad_inputs_after_a_first_call_get_nf4s_own_errors(device, case):
    packed, qs = _weight(device, 2)
    x = _x(device)
    nf4.linear(x, packed, qs)
    nf4.linear(x, packed, qs)
    bias = None
    if case == "0-d x":
        x, field = torch.tensor(1.0, dtype=torch.bfloat16, device=device), "x"
    elif case == "meta x":
        x, field = x.to("meta"), "x"
    elif case == "meta bias":
        bias, field = torch.zeros(N, dtype=torch.bfloat16, device="meta"), "bias"
    elif case == "meta weight":
        packed, field = packed.to("meta"), "weight"
    else:
        x, field = torch.ones(3, K, dtype=torch.int32, device=device), "x"
    with pytest.raises((ValueError, TypeError), match=field):
        nf4.linear(x, packed, qs, bias=bias)
