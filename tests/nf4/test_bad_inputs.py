"""Bad and unusual inputs to every public function of nf4, one table of cases (Triton's interpreter, CPU tensors).

Each case builds fresh, seeded inputs and expects one of two things:

- an error of the stated class (TypeError or ValueError) whose message names the argument or field
  (`out`, `quant_state.absmax`, `DequantConfig.tile_bytes`, `x`, ...), never an error from inside torch or
  Triton and never a wrong result;
- the right result: for `nf4.dequantize` (and `fast_dequantize`, the bitsandbytes patch) the bits of
  `reference.dequantize_nf4(reference.from_bnb(packed, state))`; for `nf4.linear` a result within the float32
  accumulation bound (`reference.linear.worst_ratio` <= 1, as tests/nf4/linear/test_sum.py) of the float64
  product with the reference operand in x's dtype; for the configs the value built.

Either way no input is modified: every tensor reachable from the arguments (a QuantState's, its state2's, a
module's, a Params4bit's) keeps its bytes, dtype, shape and strides, and a QuantState keeps its attributes. A
caller's `out` is judged by the result when the call succeeds, and must be untouched when it is refused.

Shapes are small and odd: 33x100 with blocksize 64 for dequantize (a tail block), 48x128 for linear.
A case marked xfail(strict=True) is a defect of nf4 still open: its reason says what happens and what should.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import threading
import types
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
import reference
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.integrations import bitsandbytes as nf4_bnb
from reference.linear import worst_ratio
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_dequantize_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

META = torch.device("meta")  # stands in for "another device" on a machine with only a CPU
DQ = (33, 100)  # dequantize: 3300 weights, 52 blocks of 64 (the last one a tail of 36)
N, K = 48, 128  # linear: blocks of 64 divide the rows
DT_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# --- data ----------------------------------------------------------------------------------------------


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def weights(shape, dtype, seed: int) -> torch.Tensor:
    """Random weights over a few octaves, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-4, 5, shape, generator=g).float())
    x.view(-1)[::13] = 0.0
    return x.to(dtype)


def randn(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-2, 3, shape, generator=g).float())).to(dtype)


def quant(shape=DQ, dtype=torch.bfloat16, blocksize=64, nested=True, *, seed: int, storage=torch.uint8):
    """(packed, QuantState) from bitsandbytes' quantize_4bit on the CPU, nf4."""
    return F.quantize_4bit(weights(shape, dtype, seed), blocksize=blocksize, compress_statistics=nested,
                           quant_type="nf4", quant_storage=storage)


def ref_dequant(packed, qs, out_dtype=None, *, ftz: bool = False) -> torch.Tensor:
    """The reference's weight as a CPU tensor, transposed as bitsandbytes does for a (1, n) packed tensor."""
    out_dtype = qs.dtype if out_dtype is None else out_dtype
    arr = reference.dequantize_nf4(reference.from_bnb(packed, qs), DT_NAME[out_dtype], ftz=ftz)
    t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if out_dtype == torch.bfloat16 else \
        torch.from_numpy(arr)
    return t.t() if packed.dim() == 2 and packed.shape[0] == 1 else t


def lazy(v) -> bool:
    """Whether a builder's value is a function of the fresh inputs (a lambda or def), not a value itself (a type,
    a module and a NumPy scalar type are callable values)."""
    return isinstance(v, types.FunctionType)


def with_(qs, **changes):
    """A shallow copy of a QuantState with some attributes replaced (its tensors shared: they are fresh)."""
    new = copy.copy(qs)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def with2(qs, **changes):
    """A copy of a nested QuantState whose state2 (a copy too) has some attributes replaced."""
    return with_(qs, state2=with_(qs.state2, **changes))


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous 1-D view with t's values (every other element of a buffer twice as long)."""
    flat = t.reshape(-1)
    buf = torch.zeros(2 * flat.numel(), dtype=t.dtype)
    view = buf[::2]
    view.copy_(flat)
    assert not view.is_contiguous() or flat.numel() <= 1
    return view


def in_buffer(t: torch.Tensor, buf: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """t's values copied into the uint8 buffer `buf` at `byte_offset`: a view of buf's storage in t's dtype/shape."""
    nbytes = t.numel() * t.element_size()
    view = buf[byte_offset:byte_offset + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def out_in(buf: torch.Tensor, byte_offset: int, shape, dtype) -> torch.Tensor:
    """An output buffer of `shape`/`dtype`: a contiguous view of the uint8 `buf` from `byte_offset`."""
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    assert byte_offset + n <= buf.numel()
    return buf[byte_offset:byte_offset + n].view(dtype).view(shape)


class SlotsState2:
    """A QuantState's state2 as a __slots__ class without __weakref__."""

    __slots__ = ("absmax", "blocksize", "code", "dtype", "quant_type")


class SlotsState:
    """A QuantState as a __slots__ class without __weakref__: it takes no weak references."""

    __slots__ = ("absmax", "blocksize", "code", "dtype", "nested", "offset", "quant_type", "shape", "state2")


def slots_state(qs) -> SlotsState:
    new = SlotsState()
    for name in SlotsState.__slots__:
        setattr(new, name, getattr(qs, name, None))
    if qs.nested:
        s2 = SlotsState2()
        for name in SlotsState2.__slots__:
            setattr(s2, name, getattr(qs.state2, name, None))
        new.state2 = s2
    with pytest.raises(TypeError):
        weakref.ref(new)
    return new


def linear4bit(seed: int, *, nested=True, bias=True, in_features=K, out_features=N):
    """A bitsandbytes Linear4bit quantized on the CPU (float32 weights and bias, blocksize 64)."""
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.float32,
                              compress_statistics=nested, quant_type="nf4", quant_storage=torch.uint8)
    layer.weight = bnb.nn.Params4bit(weights((out_features, in_features), torch.float32, seed), requires_grad=False,
                                     quant_type="nf4", compress_statistics=nested, quant_storage=torch.uint8,
                                     blocksize=64)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(weights((out_features,), torch.float32, seed + 1))
    layer = layer.to("cpu")
    assert layer.weight.bnb_quantized
    return layer


# --- checks ------------------------------------------------------------------------------------------------


def exact(expected: torch.Tensor, *, out: torch.Tensor | None = None) -> Callable:
    """The result equals `expected` bit for bit (shape and dtype too); with `out`, it is out's memory."""

    def check(y):
        assert isinstance(y, torch.Tensor), type(y)
        assert (tuple(y.shape), y.dtype) == (tuple(expected.shape), expected.dtype), (y.shape, y.dtype)
        assert_bitexact(y, expected)
        if out is not None:
            assert y.data_ptr() == out.data_ptr(), "the result is not the caller's out"

    return check


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def within_bound(x: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None = None) -> Callable:
    """y = x @ w.T + bias in x's dtype within the float32 accumulation bound, w = wd.to(x.dtype) the operand."""

    def check(y):
        assert isinstance(y, torch.Tensor), type(y)
        assert y.dtype == x.dtype and tuple(y.shape) == (*x.shape[:-1], wd.shape[0]), (y.shape, y.dtype)
        w = wd.to(x.dtype)
        ratio = worst_ratio(np64(y), np64(x), np64(w), DT_NAME[x.dtype], None if bias is None else np64(bias))
        assert ratio <= 1.0, f"worst ratio {ratio} to the float32 accumulation bound"

    return check


# --- the unchanged-input check --------------------------------------------------------------------------------


def _field_names(obj) -> list[str]:
    if hasattr(obj, "__dict__"):
        return list(vars(obj))
    return [n for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]


def _walk(obj, path: str, tensors: dict, states: dict, seen: set) -> None:
    """Every tensor reachable from obj (lists, dicts, modules, Params4bit.quant_state, QuantState fields)."""
    if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, torch.dtype, torch.Size)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        qs = getattr(obj, "quant_state", None) if type(obj) is not torch.Tensor else None
        if qs is not None:
            _walk(qs, f"{path}.quant_state", tensors, states, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", tensors, states, seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", tensors, states, seen)
    elif isinstance(obj, torch.nn.Module):
        for name, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            _walk(t, f"{path}.{name}", tensors, states, seen)
    elif hasattr(obj, "absmax") or hasattr(obj, "code"):  # a QuantState or its state2
        names = _field_names(obj)
        states[path] = (obj, {n: id(getattr(obj, n)) for n in names})
        for n in names:
            _walk(getattr(obj, n), f"{path}.{n}", tensors, states, seen)


def _raw(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor).detach().clone().reshape(-1).view(torch.uint8)


def snapshot(roots: dict) -> tuple:
    tensors, states = {}, {}
    seen: set = set()
    for name, obj in roots.items():
        _walk(obj, name, tensors, states, seen)
    saved = {p: (t, t.dtype, tuple(t.shape), t.stride(), None if t.is_meta else _raw(t)) for p, t in tensors.items()}
    return saved, states


def assert_unchanged(snap) -> None:
    saved, states = snap
    for path, (t, dtype, shape, stride, raw) in saved.items():
        assert (t.dtype, tuple(t.shape), t.stride()) == (dtype, shape, stride), f"{path} was reshaped or retyped"
        if raw is not None:
            assert torch.equal(_raw(t), raw), f"{path} was modified"
    for path, (obj, ids) in states.items():
        assert {n: id(getattr(obj, n)) for n in ids} == ids, f"{path}: attributes were replaced"


# --- the table ------------------------------------------------------------------------------------------


@dataclass
class Call:
    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    check: Callable | None = None  # for a case expected to succeed

    def run(self):
        return self.fn(*self.args, **self.kwargs)


@dataclass
class Case:
    id: str
    build: Callable[[int], Call]
    raises: tuple | None = None  # (exception class, regex naming the field), or None: the right result
    xfail: str | None = None


CASES: list[Case] = []


def ok(case_id: str, build, *, xfail: str | None = None) -> None:
    CASES.append(Case(case_id, build, None, xfail))


def bad(case_id: str, build, exc, pattern: str, *, xfail: str | None = None) -> None:
    CASES.append(Case(case_id, build, (exc, pattern), xfail))


# --- builders: dequantize ---------------------------------------------------------------------------------------


OMIT = object()


def deq(change=None, *, fn=None, shape=DQ, dtype=torch.bfloat16, blocksize=64, nested=True, storage=torch.uint8,
        out_dtype=None, ftz=False, **kwargs):
    """A dequantize call on fresh weights: change(packed, qs) -> (weight, quant_state[, extra kwargs]) alters them
    (quant_state OMIT: left out); kwargs values that are lambdas get (packed, qs). The expected result is the
    reference's on the unaltered weight, in out_dtype (default: the state's) with ftz."""
    fn = nf4.dequantize if fn is None else fn

    def build(seed):
        packed, qs = quant(shape, dtype, blocksize, nested, seed=seed, storage=storage)
        expected = ref_dequant(packed, qs, out_dtype, ftz=ftz)
        kw = {k: (v(packed, qs) if lazy(v) else v) for k, v in kwargs.items()}
        weight, state, extra = packed, qs, {}
        if change is not None:
            got = change(packed, qs)
            weight, state = got[:2]
            extra = got[2] if len(got) > 2 else {}
        kw.update(extra)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == 1 != packed.shape[0]:
            expected = expected.t()  # bitsandbytes transposes the result of a row-shaped packed tensor
        args = (weight,) if state is OMIT else (weight, state)
        return Call(fn, args, kw, exact(expected, out=kw.get("out")))

    return build


def st(**changes):
    """change: the state with attributes replaced (lambdas get (packed, qs))."""
    return lambda p, s: (p, with_(s, **{k: (v(p, s) if lazy(v) else v) for k, v in changes.items()}))


def st2(**changes):
    """change: the state whose state2 has attributes replaced."""
    return lambda p, s: (p, with2(s, **{k: (v(p, s) if lazy(v) else v) for k, v in changes.items()}))


def pk(fn):
    """change: another packed tensor fn(packed)."""
    return lambda p, s: (fn(p), s)


# --- nf4.dequantize: the packed tensor --------------------------------------------------------------------------

for dt in (torch.float64, torch.int64, torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn):
    name = str(dt).removeprefix("torch.")

    def _retype(p, s, dt=dt):
        raw = p.reshape(-1)
        size = torch.empty(0, dtype=dt).element_size()
        pad = torch.zeros((-raw.numel()) % size, dtype=torch.uint8)
        return torch.cat([raw, pad]).view(dt), s

    bad(f"dq-packed-dtype-{name}", deq(_retype), TypeError, r"packed weight has dtype .*expected a quant_storage")
bad("dq-packed-one-byte-short", deq(pk(lambda p: p[:-1].clone())), ValueError, r"packed weight holds 1649 bytes")
bad("dq-packed-one-byte-long", deq(pk(lambda p: torch.cat([p, p[:1]]))), ValueError, r"packed weight holds 1651 bytes")
bad("dq-packed-empty", deq(pk(lambda p: p[:0].clone())), ValueError, r"packed weight holds 0 bytes")
bad("dq-packed-strided", deq(pk(strided)), ValueError, r"packed weight must be contiguous")
bad("dq-packed-transposed-2d", deq(pk(lambda p: p.view(33, 50).t())), ValueError, r"packed weight must be contiguous")
bad("dq-packed-meta", deq(pk(lambda p: p.to(META))), ValueError, r"weight is on the meta device")
ok("dq-packed-flat", deq(pk(lambda p: p.reshape(-1))))
ok("dq-packed-2d-other-shape", deq(pk(lambda p: p.view(50, 33))))
ok("dq-packed-row-transposes", deq(pk(lambda p: p.view(1, -1))))  # bitsandbytes' transposed result
ok("dq-packed-int8-view", deq(pk(lambda p: p.view(torch.int8))))
ok("dq-storage-bf16", deq(storage=torch.bfloat16))
ok("dq-storage-int16", deq(storage=torch.int16))
ok("dq-storage-fp32", deq(shape=(32, 100), storage=torch.float32))
ok("dq-storage-int32", deq(shape=(32, 100), storage=torch.int32))
ok("dq-packed-offset-view", deq(pk(lambda p: torch.cat([p[:1], p]).reshape(-1)[1:])))  # unaligned start

# --- nf4.dequantize: absmax, state2, offset ----------------------------------------------------------------------

bad("dq-absmax-float32-nested", deq(st(absmax=lambda p, s: s.absmax.float())), TypeError,
    r"quant_state\.absmax must be torch\.uint8, got torch\.float32")
bad("dq-absmax-float16-plain", deq(st(absmax=lambda p, s: s.absmax.half()), nested=False), TypeError,
    r"quant_state\.absmax must be torch\.float32, got torch\.float16")
bad("dq-absmax-int8", deq(st(absmax=lambda p, s: s.absmax.view(torch.int8))), TypeError,
    r"quant_state\.absmax must be torch\.uint8")
bad("dq-absmax-short", deq(st(absmax=lambda p, s: s.absmax[:-1].clone())), ValueError,
    r"quant_state\.absmax has 51 elements, expected 52")
bad("dq-absmax-long", deq(st(absmax=lambda p, s: torch.cat([s.absmax, s.absmax[:1]]))), ValueError,
    r"quant_state\.absmax has 53 elements, expected 52")
bad("dq-absmax-short-plain", deq(st(absmax=lambda p, s: s.absmax[:-1].clone()), nested=False), ValueError,
    r"quant_state\.absmax has 51 elements")
bad("dq-absmax-strided", deq(st(absmax=lambda p, s: strided(s.absmax))), ValueError,
    r"quant_state\.absmax must be contiguous")
bad("dq-absmax-strided-plain", deq(st(absmax=lambda p, s: strided(s.absmax)), nested=False), ValueError,
    r"quant_state\.absmax must be contiguous")
bad("dq-absmax-meta", deq(st(absmax=lambda p, s: s.absmax.to(META))), ValueError,
    r"quant_state\.absmax is on meta, expected cpu")
bad("dq-absmax-list", deq(st(absmax=lambda p, s: s.absmax.tolist())), TypeError,
    r"quant_state\.absmax must be a tensor, got list")
bad("dq-absmax-ndarray", deq(st(absmax=lambda p, s: s.absmax.numpy().copy()), nested=False), TypeError,
    r"quant_state\.absmax must be a tensor, got ndarray")
bad("dq-absmax-none", deq(st(absmax=None)), TypeError, r"quant_state\.absmax must be a tensor, got NoneType")
ok("dq-absmax-2d-contiguous", deq(st(absmax=lambda p, s: s.absmax.view(4, 13))))
bad("dq-state2-none", deq(st(state2=None)), ValueError, r"quant_state\.state2 is required")
bad("dq-state2-blocksize-128", deq(st2(blocksize=128)), ValueError, r"quant_state\.state2\.blocksize must be 256")
bad("dq-state2-absmax-float16", deq(st2(absmax=lambda p, s: s.state2.absmax.half())), TypeError,
    r"quant_state\.state2\.absmax must be torch\.float32")
bad("dq-state2-absmax-long", deq(st2(absmax=lambda p, s: s.state2.absmax.repeat(2))), ValueError,
    r"quant_state\.state2\.absmax has 2 elements, expected 1")
bad("dq-state2-absmax-empty", deq(st2(absmax=lambda p, s: s.state2.absmax[:0].clone())), ValueError,
    r"quant_state\.state2\.absmax has 0 elements")
bad("dq-state2-absmax-meta", deq(st2(absmax=lambda p, s: s.state2.absmax.to(META))), ValueError,
    r"quant_state\.state2\.absmax is on meta")
bad("dq-state2-absmax-none", deq(st2(absmax=None)), TypeError, r"quant_state\.state2\.absmax must be a tensor")
bad("dq-state2-code-float64", deq(st2(code=lambda p, s: s.state2.code.double())), TypeError,
    r"quant_state\.state2\.code must be torch\.float32")
bad("dq-state2-code-255", deq(st2(code=lambda p, s: s.state2.code[:255].clone())), ValueError,
    r"quant_state\.state2\.code has 255 elements, expected 256")
bad("dq-state2-code-strided", deq(st2(code=lambda p, s: strided(s.state2.code))), ValueError,
    r"quant_state\.state2\.code must be contiguous")
bad("dq-state2-code-list", deq(st2(code=lambda p, s: s.state2.code.tolist())), TypeError,
    r"quant_state\.state2\.code must be a tensor")
bad("dq-state2-object", deq(st(state2=object())), TypeError, r"quant_state\.state2")
bad("dq-state2-without-code", deq(lambda p, s: (p, with_(s, state2=types.SimpleNamespace(
    absmax=s.state2.absmax, blocksize=256)))), TypeError, r"quant_state\.state2")
bad("dq-state2-blocksize-str", deq(st2(blocksize="256")), (TypeError, ValueError),
    r"quant_state\.state2\.blocksize .*(str|'256')")
bad("dq-state2-blocksize-none", deq(st2(blocksize=None)), TypeError,
    r"quant_state\.state2\.blocksize must be an integer, got NoneType")
ok("dq-state2-blocksize-float", deq(st2(blocksize=256.0)))
ok("dq-state2-blocksize-numpy", deq(st2(blocksize=np.int64(256))))
bad("dq-offset-float64", deq(st(offset=lambda p, s: s.offset.double())), TypeError,
    r"quant_state\.offset must be torch\.float32")
bad("dq-offset-two", deq(st(offset=lambda p, s: s.offset.reshape(1).repeat(2))), ValueError,
    r"quant_state\.offset has 2 elements, expected 1")
bad("dq-offset-none", deq(st(offset=None)), TypeError, r"quant_state\.offset must be a tensor, got NoneType")
bad("dq-offset-float", deq(st(offset=lambda p, s: float(s.offset))), TypeError,
    r"quant_state\.offset must be a tensor, got float")
bad("dq-offset-meta", deq(st(offset=lambda p, s: s.offset.to(META))), ValueError, r"quant_state\.offset is on meta")
ok("dq-offset-1d", deq(st(offset=lambda p, s: s.offset.reshape(1))))
bad("dq-nested-str", deq(st(nested="yes")), TypeError, r"quant_state\.nested must be a bool")
bad("dq-nested-int", deq(st(nested=1)), TypeError, r"quant_state\.nested must be a bool")
ok("dq-nested-numpy-bool", deq(st(nested=np.bool_(True))))
bad("dq-nested-false-with-uint8-absmax", deq(st(nested=False)), TypeError,
    r"quant_state\.absmax must be torch\.float32, got torch\.uint8")
bad("dq-nested-true-without-state2", deq(st(nested=True), nested=False), TypeError,
    r"quant_state\.absmax must be torch\.uint8")

# --- nf4.dequantize: quant_type, blocksize, shape, dtype ---------------------------------------------------------

bad("dq-quant-type-fp4", deq(st(quant_type="fp4")), ValueError, r"quant_state\.quant_type must be 'nf4', got 'fp4'")
bad("dq-quant-type-upper", deq(st(quant_type="NF4")), ValueError, r"quant_state\.quant_type must be 'nf4'")
bad("dq-quant-type-none", deq(st(quant_type=None)), ValueError, r"quant_state\.quant_type must be 'nf4'")
ok("dq-blocksize-float-64.0", deq(st(blocksize=64.0)))
ok("dq-blocksize-numpy-int64", deq(st(blocksize=np.int64(64))))
ok("dq-blocksize-numpy-int32", deq(st(blocksize=np.int32(64))))
ok("dq-blocksize-numpy-float32", deq(st(blocksize=np.float32(64.0))))
ok("dq-blocksize-0d-tensor", deq(st(blocksize=torch.tensor(64))))
bad("dq-blocksize-96", deq(st(blocksize=96)), ValueError, r"quant_state\.blocksize must be one of .*got 96")
bad("dq-blocksize-0", deq(st(blocksize=0)), ValueError, r"quant_state\.blocksize must be one of .*got 0")
bad("dq-blocksize-negative", deq(st(blocksize=-64)), ValueError, r"quant_state\.blocksize must be one of")
bad("dq-blocksize-8192", deq(st(blocksize=8192)), ValueError, r"quant_state\.blocksize must be one of")
bad("dq-blocksize-64.5", deq(st(blocksize=64.5)), ValueError, r"quant_state\.blocksize must be an integral value")
bad("dq-blocksize-str", deq(st(blocksize="64")), TypeError, r"quant_state\.blocksize must be an integer, got str")
bad("dq-blocksize-none", deq(st(blocksize=None)), TypeError, r"quant_state\.blocksize must be an integer")
bad("dq-blocksize-bool", deq(st(blocksize=True)), TypeError, r"quant_state\.blocksize must be an integer, got bool")
bad("dq-blocksize-1d-tensor", deq(st(blocksize=torch.tensor([64]))), TypeError, r"quant_state\.blocksize must be")
bad("dq-blocksize-nan", deq(st(blocksize=float("nan"))), ValueError, r"quant_state\.blocksize must be an integral")
bad("dq-blocksize-128-for-64", deq(st(blocksize=128)), ValueError,
    r"quant_state\.absmax has 52 elements, expected 26")
ok("dq-blocksize-32", deq(blocksize=32))
ok("dq-blocksize-4096", deq(blocksize=4096))
bad("dq-shape-negative", deq(st(shape=torch.Size([-33, 100]))), ValueError,
    r"quant_state\.shape must hold non-negative integers")
bad("dq-shape-both-negative", deq(st(shape=(-33, -100))), ValueError, r"quant_state\.shape must hold non-negative")
bad("dq-shape-float", deq(st(shape=(33.5, 100))), ValueError, r"quant_state\.shape\[0\] must be an integral value")
bad("dq-shape-str", deq(st(shape=(33, "100"))), TypeError, r"quant_state\.shape\[1\] must be an integer")
bad("dq-shape-none-entry", deq(st(shape=(33, None))), TypeError, r"quant_state\.shape\[1\] must be an integer")
bad("dq-shape-int", deq(st(shape=3300)), TypeError, r"quant_state\.shape must be a torch\.Size or a tuple")
bad("dq-shape-none", deq(st(shape=None)), TypeError, r"quant_state\.shape must be a torch\.Size or a tuple")
bad("dq-shape-too-many", deq(st(shape=torch.Size([34, 100]))), ValueError,
    r"packed weight holds 1650 bytes, expected 1700 for quant_state\.shape")
bad("dq-shape-too-few", deq(st(shape=torch.Size([33, 98]))), ValueError, r"packed weight holds 1650 bytes")
bad("dq-shape-ndarray", deq(st(shape=np.array([33, 100]))), TypeError,
    r"quant_state\.shape must be a torch\.Size or a tuple of integers, got ndarray")
bad("dq-shape-bool-entry", deq(st(shape=(True, 3300))), TypeError, r"quant_state\.shape\[0\] must be an integer")
bad("dq-shape-huge", deq(st(shape=(2**62, 2**62))), ValueError, r"packed weight holds 1650 bytes, expected")
bad("dq-shape-huge-times-zero", deq(st(shape=(2**40, 0))), ValueError, r"packed weight holds 1650 bytes, expected 0")
bad("dq-blocksize-inf", deq(st(blocksize=float("inf"))), ValueError, r"quant_state\.blocksize must be an integral")
bad("dq-blocksize-numpy-bool", deq(st(blocksize=np.bool_(True))), TypeError,
    r"quant_state\.blocksize must be an integer")
bad("dq-shape-3d-row-packed", deq(lambda p, s: (p.view(1, -1), with_(s, shape=torch.Size([3, 11, 100])))), ValueError,
    r"packed weight|quant_state\.shape")


def scalar_weight(seed):
    """A QuantState of shape () over one packed byte: a 0-d weight of one element."""
    packed, qs = quant((1,), seed=seed)
    state = with_(qs, shape=torch.Size([]))
    return Call(nf4.dequantize, (packed, state), {}, exact(ref_dequant(packed, qs).reshape(())))


ok("dq-shape-0d", scalar_weight)
ok("dq-shape-numpy-entries", deq(st(shape=(np.int64(33), 100.0))))
ok("dq-shape-list", deq(st(shape=[33, 100])))


def _shape_view(new_shape):
    """deq case whose state has another shape of the same weights: the expected result is the reference's
    reshaped."""

    def build(seed):
        packed, qs = quant(seed=seed)
        expected = ref_dequant(packed, qs).reshape(new_shape)
        state = with_(qs, shape=torch.Size(new_shape))
        return Call(nf4.dequantize, (packed, state), {}, exact(expected))

    return build


ok("dq-shape-1d", _shape_view((3300,)))
ok("dq-shape-3d", _shape_view((3, 11, 100)))
ok("dq-shape-4d", _shape_view((3, 11, 5, 20)))
ok("dq-shape-1d-odd", deq(shape=(67,)))
ok("dq-shape-1x1", deq(shape=(1, 1)))
ok("dq-shape-3x67", deq(shape=(3, 67)))
ok("dq-shape-7", deq(shape=(7,), nested=False))
ok("dq-shape-5x13-blocksize-4096", deq(shape=(5, 13), blocksize=4096))
ok("dq-empty-rows", deq(shape=(0, 100)))
ok("dq-empty-rows-plain", deq(shape=(0, 100), nested=False))
ok("dq-empty-cols", deq(shape=(64, 0)))
ok("dq-empty-1d", deq(shape=(0,)))
bad("dq-state-dtype-float64", deq(st(dtype=torch.float64)), TypeError,
    r"quant_state\.dtype must be torch\.float16, torch\.bfloat16 or torch\.float32, got torch\.float64")
bad("dq-state-dtype-int32", deq(st(dtype=torch.int32)), TypeError, r"quant_state\.dtype must be")
bad("dq-state-dtype-str", deq(st(dtype="float16")), TypeError, r"quant_state\.dtype must be")
bad("dq-state-dtype-none", deq(st(dtype=None)), TypeError, r"quant_state\.dtype must be")
ok("dq-state-fp16", deq(dtype=torch.float16))
ok("dq-state-fp32", deq(dtype=torch.float32, nested=False))

# --- nf4.dequantize: the keyword arguments ------------------------------------------------------------------------

def _deqkw(kwargs, out_dtype=None, ftz=False):
    def build(seed):
        packed, qs = quant(seed=seed)
        kw = {k: (v(packed, qs) if lazy(v) else v) for k, v in kwargs.items()}
        dtype = kw.get("dtype") if kw.get("dtype") in DT_NAME else None
        expected = ref_dequant(packed, qs, out_dtype or dtype, ftz=ftz)
        return Call(nf4.dequantize, (packed, qs), kw, exact(expected, out=kw.get("out")))

    return build


for dt in (torch.float64, torch.int32, torch.int8, torch.bool, torch.uint8, torch.complex64):
    bad(f"dq-dtype-{str(dt).removeprefix('torch.')}", _deqkw({"dtype": dt}), TypeError,
        r"dtype must be torch\.float16, torch\.bfloat16 or torch\.float32")
bad("dq-dtype-str", _deqkw({"dtype": "float16"}), TypeError, r"dtype must be torch\.float16")
bad("dq-dtype-numpy", _deqkw({"dtype": np.float16}), TypeError, r"dtype must be torch\.float16")
ok("dq-dtype-float16", _deqkw({"dtype": torch.float16}))
ok("dq-dtype-float32", _deqkw({"dtype": torch.float32}))
ok("dq-dtype-bfloat16-same", _deqkw({"dtype": torch.bfloat16}))
bad("dq-ftz-int-1", _deqkw({"ftz": 1}), TypeError, r"ftz must be True, False or None")
bad("dq-ftz-int-0", _deqkw({"ftz": 0}), TypeError, r"ftz must be True, False or None")
bad("dq-ftz-str", _deqkw({"ftz": "yes"}), TypeError, r"ftz must be True, False or None")
bad("dq-ftz-tensor", _deqkw({"ftz": torch.tensor(True)}), TypeError, r"ftz must be True, False or None")
ok("dq-ftz-none", _deqkw({"ftz": None}))
ok("dq-ftz-false", _deqkw({"ftz": False}))
ok("dq-ftz-numpy-false", _deqkw({"ftz": np.bool_(False)}))
ok("dq-ftz-true", _deqkw({"ftz": True}, ftz=True))
bad("dq-config-str-fast", _deqkw({"config": "fast"}), TypeError, r"config must be a nf4\.DequantConfig or None")
bad("dq-config-linear", _deqkw({"config": nf4.LinearConfig()}), TypeError,
    r"config must be a nf4\.DequantConfig or None, got LinearConfig")
bad("dq-config-dict", _deqkw({"config": {"tile_bytes": 512}}), TypeError, r"config must be a nf4\.DequantConfig")
ok("dq-config-default", _deqkw({"config": nf4.DequantConfig()}))
ok("dq-config-tile-64-warps-1", _deqkw({"config": nf4.DequantConfig(tile_bytes=64, num_warps=1)}))
ok("dq-config-codebook-1", _deqkw({"config": nf4.DequantConfig(codebook=1, tile_bytes=256)}))
ok("dq-config-codebook-2", _deqkw({"config": nf4.DequantConfig(codebook=2, tile_bytes=1024)}))
ok("dq-config-interpret-programs-1", _deqkw({"config": nf4.DequantConfig(interpret_programs=1)}))
ok("dq-config-interpret-programs-999", _deqkw({"config": nf4.DequantConfig(interpret_programs=999)}))
ok("dq-config-no-plan", _deqkw({"config": nf4.DequantConfig(plan=False, evict_stream="", store_cm="")}))
ok("dq-config-tile-max", _deqkw({"config": nf4.DequantConfig(tile_bytes=1 << 16)}))
ok("dq-config-tile-4-small", deq(shape=(3, 67), config=nf4.DequantConfig(tile_bytes=4, num_warps=1)))
ok("dq-config-programs-per-sm", _deqkw({"config": nf4.DequantConfig(programs_per_sm=4, tile_bytes=128)}))
ok("dq-config-bf16-bits", _deqkw({"config": nf4.DequantConfig(bf16_bits=True, direct_launch=False)}))
bad("dq-unknown-kwarg", _deqkw({"blocksize": 64}), TypeError, r"blocksize")

# --- nf4.dequantize: out= ------------------------------------------------------------------------------------------

bad("dq-out-list", _deqkw({"out": []}), TypeError, r"out must be a torch\.Tensor, got list")
bad("dq-out-ndarray", _deqkw({"out": lambda p, s: np.zeros(DQ, np.float32)}), TypeError,
    r"out must be a torch\.Tensor, got ndarray")
bad("dq-out-transposed-shape", _deqkw({"out": torch.empty(100, 33, dtype=torch.bfloat16)}), ValueError,
    r"out has shape \(100, 33\), expected \(33, 100\)")
bad("dq-out-flat", _deqkw({"out": torch.empty(3300, dtype=torch.bfloat16)}), ValueError, r"out has shape \(3300,\)")
bad("dq-out-dtype", _deqkw({"out": torch.empty(DQ, dtype=torch.float16)}), TypeError,
    r"out has dtype torch\.float16, expected torch\.bfloat16")
bad("dq-out-dtype-vs-dtype-arg", _deqkw({"out": torch.empty(DQ, dtype=torch.bfloat16), "dtype": torch.float32}),
    TypeError, r"out has dtype torch\.bfloat16, expected torch\.float32")
bad("dq-out-int16", _deqkw({"out": torch.empty(DQ, dtype=torch.int16)}), TypeError, r"out has dtype torch\.int16")
bad("dq-out-noncontiguous", _deqkw({"out": torch.empty(100, 33, dtype=torch.bfloat16).t()}), ValueError,
    r"out must be contiguous")
bad("dq-out-strided-rows", _deqkw({"out": torch.empty(66, 100, dtype=torch.bfloat16)[::2]}), ValueError,
    r"out must be contiguous")
bad("dq-out-meta", _deqkw({"out": torch.empty(DQ, dtype=torch.bfloat16, device=META)}), ValueError,
    r"out is on meta, expected cpu")
ok("dq-out", _deqkw({"out": torch.full(DQ, float("nan"), dtype=torch.bfloat16)}))
ok("dq-out-float32-with-dtype", _deqkw({"out": torch.empty(DQ, dtype=torch.float32), "dtype": torch.float32}))
ok("dq-out-unaligned-view", _deqkw({"out": torch.zeros(3301, dtype=torch.bfloat16)[1:].view(DQ)}))


def out_overlap(place, out_offset, *, nested=True, dtype=torch.bfloat16, size=16384):
    """A dequantize call whose `out` is a view of one uint8 buffer that also holds an input: place(buf, packed, qs)
    -> (packed, qs) moves the input into buf; out starts at out_offset bytes."""

    def build(seed):
        packed, qs = quant(dtype=dtype, nested=nested, seed=seed)
        expected = ref_dequant(packed, qs)
        buf = torch.zeros(size, dtype=torch.uint8)
        packed, qs = place(buf, packed, qs)
        out = out_in(buf, out_offset, DQ, dtype)
        return Call(nf4.dequantize, (packed, qs), {"out": out}, exact(expected, out=out))

    return build


def put_packed(at):
    return lambda buf, p, s: (in_buffer(p, buf, at), s)


def put_state(name, at):
    return lambda buf, p, s: (p, with_(s, **{name: in_buffer(getattr(s, name), buf, at)}))


def put_state2(name, at):
    return lambda buf, p, s: (p, with2(s, **{name: in_buffer(getattr(s.state2, name), buf, at)}))


# the bf16 output is 6600 bytes; the packed weight 1650
bad("dq-out-is-packed-storage-start", out_overlap(put_packed(0), 0), ValueError,
    r"out shares memory with the packed weight")
bad("dq-out-contains-packed", out_overlap(put_packed(2000), 0), ValueError, r"out shares memory with the packed weight")
bad("dq-out-overlaps-packed-tail", out_overlap(put_packed(6000), 0), ValueError,
    r"out shares memory with the packed weight")
bad("dq-out-overlaps-packed-head", out_overlap(put_packed(0), 1648), ValueError,
    r"out shares memory with the packed weight")
bad("dq-out-overlaps-packed-last-byte", out_overlap(put_packed(6599), 0), ValueError,
    r"out shares memory with the packed weight")
ok("dq-out-adjacent-to-packed", out_overlap(put_packed(0), 1650))
ok("dq-out-before-packed", out_overlap(put_packed(6600), 0))
bad("dq-out-overlaps-absmax", out_overlap(put_state("absmax", 100), 0), ValueError,
    r"out shares memory with quant_state\.absmax")
bad("dq-out-overlaps-absmax-partially", out_overlap(put_state("absmax", 6590), 0), ValueError,
    r"out shares memory with quant_state\.absmax")
bad("dq-out-overlaps-absmax-plain", out_overlap(put_state("absmax", 400), 0, nested=False), ValueError,
    r"out shares memory with quant_state\.absmax")
bad("dq-out-overlaps-state2-absmax", out_overlap(put_state2("absmax", 3000), 0), ValueError,
    r"out shares memory with quant_state\.state2\.absmax")
bad("dq-out-overlaps-code", out_overlap(put_state2("code", 1024), 0), ValueError,
    r"out shares memory with quant_state\.state2\.code")
bad("dq-out-overlaps-code-partially", out_overlap(put_state2("code", 6000), 0), ValueError,
    r"out shares memory with quant_state\.state2\.code")
bad("dq-out-overlaps-offset", out_overlap(put_state("offset", 64), 0), ValueError,
    r"out shares memory with quant_state\.offset")
bad("dq-out-overlaps-packed-fp32", out_overlap(put_packed(12000), 0, dtype=torch.float32), ValueError,
    r"out shares memory with the packed weight")
ok("dq-out-beside-all-state", out_overlap(
    lambda buf, p, s: (in_buffer(p, buf, 8000), with2(with_(s, absmax=in_buffer(s.absmax, buf, 9664),
                                                               offset=in_buffer(s.offset, buf, 9728)),
                                                         absmax=in_buffer(s.state2.absmax, buf, 9732),
                                                         code=in_buffer(s.state2.code, buf, 9736))), 0))


def out_is_view_of_packed(seed):
    """A weight whose packed bytes sit inside a larger tensor's storage (bf16), and out a view of that tensor."""
    packed, qs = quant(seed=seed)
    store = torch.zeros(4000, dtype=torch.bfloat16)
    view = store.view(torch.uint8)[:1650].view(1650, 1)
    view.copy_(packed)
    out = store[500:3800].view(33, 100)  # bytes 1000..7600: the packed view's tail
    return Call(nf4.dequantize, (view, qs), {"out": out}, exact(ref_dequant(packed, qs), out=out))


bad("dq-out-view-into-packed-storage", out_is_view_of_packed, ValueError, r"out shares memory with the packed weight")

# --- weight and quant_state of the wrong kind ---------------------------------------------------------------------

bad("dq-weight-none", deq(lambda p, s: (None, s)), TypeError, r"weight must be a packed torch\.Tensor")
bad("dq-weight-list", deq(lambda p, s: (p.tolist(), s)), TypeError, r"weight must be a packed torch\.Tensor.*list")
bad("dq-weight-ndarray", deq(lambda p, s: (p.numpy(), s)), TypeError, r"weight must be a packed torch\.Tensor")
bad("dq-weight-none-alone", deq(lambda p, s: (None, OMIT)), TypeError, r"quant_state is required")
bad("dq-weight-module-without-weight", deq(lambda p, s: (torch.nn.ReLU(), OMIT)), TypeError,
    r"quant_state is required.*ReLU")
bad("dq-weight-nn-linear", deq(lambda p, s: (torch.nn.Linear(4, 4), OMIT)), TypeError,
    r"quant_state is required.*Linear")
bad("dq-weight-module-with-state", deq(lambda p, s: (torch.nn.ReLU(), s)), TypeError,
    r"weight must be a packed torch\.Tensor, Params4bit or Linear4bit, got ReLU")
bad("dq-packed-without-state", deq(lambda p, s: (p, OMIT)), TypeError, r"quant_state is required")
bad("dq-state-tensor", deq(lambda p, s: (p, s.absmax)), TypeError, r"quant_state must be a bitsandbytes QuantState")
bad("dq-state-dict", deq(lambda p, s: (p, s.as_dict())), TypeError, r"quant_state must be a bitsandbytes QuantState")
bad("dq-state-tuple", deq(lambda p, s: (p, (s,))), TypeError, r"quant_state must be a bitsandbytes QuantState")
bad("dq-state-object", deq(lambda p, s: (p, object())), TypeError, r"quant_state must be a bitsandbytes QuantState")
bad("dq-state-int", deq(lambda p, s: (p, 64)), TypeError, r"quant_state must be a bitsandbytes QuantState")


def _namespace_without(missing):
    def change(p, s):
        ns = types.SimpleNamespace(**{k: v for k, v in vars(s).items() if k != missing})
        return p, ns

    return change


bad("dq-state-without-absmax", deq(_namespace_without("absmax")), TypeError,
    r"quant_state must be a bitsandbytes QuantState \(absmax")
bad("dq-state-without-quant-type", deq(_namespace_without("quant_type")), TypeError,
    r"quant_state must be a bitsandbytes QuantState")
ok("dq-state-namespace", deq(lambda p, s: (p, types.SimpleNamespace(**vars(s)))))


def slots_calls(fn_name):
    """dequantize (or linear) twice with a QuantState (and state2) that takes no weak references."""

    def build(seed):
        if fn_name == "dequantize":
            packed, qs = quant(seed=seed)
            expected = ref_dequant(packed, qs)
            state = slots_state(qs)
            check_one = exact(expected)
            run = lambda p, s: [nf4.dequantize(p, s) for _ in range(3)]  # noqa: E731
        else:
            packed, qs = quant((N, K), seed=seed)
            x = randn((3, K), torch.bfloat16, seed + 1)
            expected = ref_dequant(packed, qs)
            state = slots_state(qs)
            check_one = within_bound(x, expected)
            run = lambda p, s: [nf4.linear(x, p, s) for _ in range(3)]  # noqa: E731

        def check(results):
            for y in results:
                check_one(y)
            for y in results[1:]:
                assert_bitexact(y, results[0], name="a repeat call")

        return Call(run, (packed, state), {}, check)

    return build


ok("dq-state-slots-no-weakref", slots_calls("dequantize"))
ok("lin-state-slots-no-weakref", slots_calls("linear"))


def slots_plain(seed):
    packed, qs = quant(nested=False, seed=seed)
    state = slots_state(qs)
    return Call(lambda p, s: nf4.dequantize(p, s), (packed, state), {}, exact(ref_dequant(packed, qs)))


ok("dq-state-slots-no-weakref-plain", slots_plain)

# --- bitsandbytes' modules ----------------------------------------------------------------------------------------


def module_form(kind, fn_name="dequantize", *, nested=True, x_dtype=torch.bfloat16, use_bias=True):
    """nf4.dequantize / nf4.linear / fast_dequantize / NF4Weight.of on a Linear4bit or its Params4bit."""

    def build(seed):
        layer = linear4bit(seed, nested=nested, bias=use_bias)
        w = layer.weight
        qs = w.quant_state
        wd = ref_dequant(w, qs)
        if kind == "module":
            args = (layer,)
        elif kind == "params":
            args = (w,)
        else:  # params with its state
            args = (w, qs)
        if fn_name == "dequantize":
            return Call(nf4.dequantize, args, {}, exact(wd))
        if fn_name == "fast_dequantize":
            return Call(nf4.fast_dequantize, (w, qs), {}, exact(wd))
        if fn_name == "of":
            def check(nw):
                assert isinstance(nw, nf4.NF4Weight)
                assert (nw.shape, nw.blocksize, nw.dtype, nw.nested) == ((N, K), 64, torch.float32, nested)
                assert nw.packed.data_ptr() == w.data_ptr() and type(nw.packed) is torch.Tensor
            return Call(nf4.NF4Weight.of, args, {}, check)
        x = randn((5, K), x_dtype, seed + 7)
        bias = layer.bias.detach().to(x_dtype) if (kind == "module" and use_bias) else None
        return Call(nf4.linear, (x, *args), {}, within_bound(x, wd, bias))

    return build


ok("dq-linear4bit", module_form("module"))
ok("dq-linear4bit-plain", module_form("module", nested=False))
ok("dq-params4bit", module_form("params"))
ok("dq-params4bit-with-state", module_form("params+state"))
ok("fast-dq-params4bit", module_form("params", "fast_dequantize"))
ok("of-linear4bit", module_form("module", "of"))
ok("of-params4bit", module_form("params", "of", nested=False))
ok("lin-linear4bit-bf16", module_form("module", "linear"))
ok("lin-linear4bit-fp16-plain", module_form("module", "linear", nested=False, x_dtype=torch.float16))
ok("lin-linear4bit-fp32", module_form("module", "linear", x_dtype=torch.float32))
ok("lin-linear4bit-no-bias", module_form("module", "linear", use_bias=False))
ok("lin-params4bit", module_form("params", "linear"))
ok("lin-params4bit-with-state", module_form("params+state", "linear", x_dtype=torch.float16))


def linear4bit_explicit_bias(seed):
    """An explicit bias replaces the module's own."""
    layer = linear4bit(seed)
    x = randn((4, K), torch.float16, seed + 3)
    b = randn((N,), torch.float16, seed + 4)
    wd = ref_dequant(layer.weight, layer.weight.quant_state)
    return Call(nf4.linear, (x, layer), {"bias": b}, within_bound(x, wd, b))


ok("lin-linear4bit-explicit-bias", linear4bit_explicit_bias)



def unquantized(fn_name, part):
    """A Linear4bit never moved to a device: its Params4bit holds float weights and no quant_state."""

    def build(seed):
        layer = bnb.nn.Linear4bit(K, N, quant_type="nf4")
        weight = layer if part == "module" else layer.weight
        if fn_name == "dequantize":
            return Call(nf4.dequantize, (weight,))
        return Call(nf4.linear, (randn((2, K), torch.float16, seed), weight))

    return build


def module_misuse(fn_name, how):
    """A quantized Linear4bit passed with something that does not fit it."""

    def build(seed):
        if how == "fp4":
            layer = bnb.nn.Linear4bit(K, N, quant_type="fp4").to("cpu")
            args = (layer,)
        else:
            layer = linear4bit(seed)
            args = (layer, layer.weight.quant_state)
        if fn_name == "dequantize":
            return Call(nf4.dequantize, args)
        x = randn((2, K), torch.bfloat16, seed)
        if how == "float32-bias":
            return Call(nf4.linear, (x, layer), {"bias": layer.bias.detach().clone()})
        return Call(nf4.linear, (x, *args))

    return build


bad("dq-linear4bit-unquantized", unquantized("dequantize", "module"), TypeError, r"quant_state is required")
bad("dq-params4bit-unquantized", unquantized("dequantize", "params"), TypeError, r"quant_state is required")
bad("lin-linear4bit-unquantized", unquantized("linear", "module"), TypeError, r"quant_state is required")
bad("dq-linear4bit-fp4", module_misuse("dequantize", "fp4"), ValueError, r"quant_state\.quant_type must be 'nf4'")
bad("lin-linear4bit-fp4", module_misuse("linear", "fp4"), ValueError, r"quant_state\.quant_type must be 'nf4'")
bad("dq-linear4bit-with-state", module_misuse("dequantize", "with-state"), TypeError,
    r"weight must be a packed torch\.Tensor, Params4bit or Linear4bit, got Linear4bit")
bad("lin-linear4bit-with-state", module_misuse("linear", "with-state"), TypeError,
    r"weight must be a packed torch\.Tensor.*got Linear4bit")
bad("lin-linear4bit-explicit-float32-bias", module_misuse("linear", "float32-bias"), TypeError,
    r"bias has dtype torch\.float32, expected torch\.bfloat16")

# --- nf4.fast_dequantize -------------------------------------------------------------------------------------------


def fast_none(seed):
    w = randn((7, 5), torch.float16, seed)

    def check(y):
        assert y is w

    return Call(nf4.fast_dequantize, (w, None), {}, check)


ok("fast-dq-no-state-returns-w", fast_none)
ok("fast-dq", deq(fn=nf4.fast_dequantize))
ok("fast-dq-global-buffer", deq(fn=nf4.fast_dequantize, use_global_buffer=True))
ok("fast-dq-out", deq(fn=nf4.fast_dequantize, out=lambda p, s: torch.empty(DQ, dtype=torch.bfloat16)))
bad("fast-dq-out-dtype", deq(fn=nf4.fast_dequantize, out=lambda p, s: torch.empty(DQ, dtype=torch.float32)),
    TypeError, r"out has dtype torch\.float32")
bad("fast-dq-out-overlaps-packed",
    deq(lambda p, s: (lambda buf: (in_buffer(p, buf, 0), s, {"out": out_in(buf, 1000, DQ, torch.bfloat16)}))(
        torch.zeros(8000, dtype=torch.uint8)), fn=nf4.fast_dequantize),
    ValueError, r"out shares memory with the packed weight")
bad("fast-dq-fp4", deq(st(quant_type="fp4"), fn=nf4.fast_dequantize), ValueError, r"quant_state\.quant_type")
bad("fast-dq-weight-list", deq(lambda p, s: (p.tolist(), s), fn=nf4.fast_dequantize), TypeError,
    r"weight must be a packed torch\.Tensor")

# --- nf4.NF4Weight.of -----------------------------------------------------------------------------------------------


def of_check(seed):
    packed, qs = quant(seed=seed)

    def check(w):
        assert (w.shape, w.blocksize, w.dtype, w.nested, w.n) == (DQ, 64, torch.bfloat16, True, 3300)
        assert w.packed is packed and w.absmax is qs.absmax and w.offset is qs.offset
        assert w.absmax2 is qs.state2.absmax and w.code2 is qs.state2.code

    return Call(nf4.NF4Weight.of, (packed, qs), {}, check)


ok("of-packed-state", of_check)
bad("of-none", deq(lambda p, s: (None, OMIT), fn=nf4.NF4Weight.of), TypeError, r"quant_state is required")
bad("of-packed-alone", deq(lambda p, s: (p, OMIT), fn=nf4.NF4Weight.of), TypeError, r"quant_state is required")
bad("of-fp4", deq(st(quant_type="fp4"), fn=nf4.NF4Weight.of), ValueError, r"quant_state\.quant_type")
bad("of-absmax-float16", deq(st(absmax=lambda p, s: s.absmax.half()), fn=nf4.NF4Weight.of), TypeError,
    r"quant_state\.absmax must be torch\.uint8")
bad("of-state2-none", deq(st(state2=None), fn=nf4.NF4Weight.of), ValueError, r"quant_state\.state2 is required")
bad("of-packed-strided", deq(pk(strided), fn=nf4.NF4Weight.of), ValueError, r"packed weight must be contiguous")
bad("of-shape-negative", deq(st(shape=(-1, 3300)), fn=nf4.NF4Weight.of), ValueError, r"quant_state\.shape")

# --- nf4.DequantConfig ---------------------------------------------------------------------------------------------


def config(cls, **kwargs):
    def build(seed):
        def check(c):
            assert isinstance(c, cls)
            for k, v in kwargs.items():
                assert getattr(c, k) == v and type(getattr(c, k)) is type(v), k

        return Call(cls, (), kwargs, check)

    return build


def config_with(cls, **kwargs):
    """cls().with_(**kwargs): a changed copy is checked as the constructor checks."""
    return lambda seed: Call(cls().with_, (), kwargs)


DC = nf4.DequantConfig
for fld, value, exc, pattern in [
    ("tile_bytes", "512", TypeError, r"DequantConfig\.tile_bytes must be int, got str"),
    ("tile_bytes", 512.0, TypeError, r"DequantConfig\.tile_bytes must be int, got float"),
    ("tile_bytes", None, TypeError, r"DequantConfig\.tile_bytes must be int, got NoneType"),
    ("tile_bytes", True, TypeError, r"DequantConfig\.tile_bytes must be int, got bool"),
    ("tile_bytes", np.int64(512), TypeError, r"DequantConfig\.tile_bytes must be int"),
    ("tile_bytes", 3, ValueError, r"DequantConfig\.tile_bytes must be a power of two in 4\.\.65536, got 3"),
    ("tile_bytes", 1 << 20, ValueError, r"DequantConfig\.tile_bytes must be a power of two in 4\.\.65536"),
    ("tile_bytes", 2, ValueError, r"DequantConfig\.tile_bytes must be a power of two"),
    ("tile_bytes", 0, ValueError, r"DequantConfig\.tile_bytes must be a power of two"),
    ("tile_bytes", -512, ValueError, r"DequantConfig\.tile_bytes must be a power of two"),
    ("tile_bytes", 768, ValueError, r"DequantConfig\.tile_bytes must be a power of two"),
    ("num_warps", "4", TypeError, r"DequantConfig\.num_warps must be int, got str"),
    ("num_warps", 4.0, TypeError, r"DequantConfig\.num_warps must be int, got float"),
    ("num_warps", 3, ValueError, r"DequantConfig\.num_warps must be a power of two up to 32, got 3"),
    ("num_warps", 64, ValueError, r"DequantConfig\.num_warps must be a power of two up to 32, got 64"),
    ("num_warps", 0, ValueError, r"DequantConfig\.num_warps must be"),
    ("evict_stream", "bogus", ValueError, r"DequantConfig\.evict_stream must be one of .*got 'bogus'"),
    ("evict_stream", "EVICT_FIRST", ValueError, r"DequantConfig\.evict_stream must be one of"),
    ("evict_stream", None, TypeError, r"DequantConfig\.evict_stream must be str"),
    ("store_cm", "x", ValueError, r"DequantConfig\.store_cm must be one of .*got 'x'"),
    ("store_cm", "cs", ValueError, r"DequantConfig\.store_cm must be one of"),
    ("store_cm", 1, TypeError, r"DequantConfig\.store_cm must be str"),
    ("codebook", 3, ValueError, r"DequantConfig\.codebook must be 0, 1 or 2, got 3"),
    ("codebook", -1, ValueError, r"DequantConfig\.codebook must be 0, 1 or 2"),
    ("codebook", False, TypeError, r"DequantConfig\.codebook must be int, got bool"),
    ("kernel", "dequant", ValueError, r"DequantConfig\.kernel must be one of \('dequantize',\)"),
    ("kernel", None, TypeError, r"DequantConfig\.kernel must be str"),
    ("bf16_bits", 1, TypeError, r"DequantConfig\.bf16_bits must be bool, got int"),
    ("programs_per_sm", -1, ValueError, r"programs_per_sm must be >= 0"),
    ("programs_per_sm", 1.5, TypeError, r"DequantConfig\.programs_per_sm must be int"),
    ("interpret_programs", 0, ValueError, r"interpret_programs >= 1"),
    ("interpret_programs", "3", TypeError, r"DequantConfig\.interpret_programs must be int"),
    ("fp_fusion", 1, TypeError, r"DequantConfig\.fp_fusion must be bool"),
    ("plan", None, TypeError, r"DequantConfig\.plan must be bool"),
    ("direct_launch", "yes", TypeError, r"DequantConfig\.direct_launch must be bool"),
]:
    bad(f"dconfig-{fld}-{value!r}", config(DC, **{fld: value}), exc, pattern)
bad("dconfig-unknown-field", config(DC, tile=512), TypeError, r"unexpected keyword argument 'tile'")
bad("dconfig-with-tile-bytes-3", config_with(DC, tile_bytes=3), ValueError, r"DequantConfig\.tile_bytes")
bad("dconfig-with-num-warps-str", config_with(DC, num_warps="4"), TypeError, r"DequantConfig\.num_warps")
ok("dconfig-tile-4", config(DC, tile_bytes=4))
ok("dconfig-tile-65536-warps-32", config(DC, tile_bytes=1 << 16, num_warps=32))
ok("dconfig-no-eviction", config(DC, evict_stream="", store_cm=""))
ok("dconfig-evict-last-wb", config(DC, evict_stream="evict_last", store_cm=".wb"))

# --- nf4.LinearConfig: every field ---------------------------------------------------------------------------------

LC = nf4.LinearConfig
LC_FIELDS = {f.name: f.type for f in dataclasses.fields(LC)}
# a value of a wrong type for each annotation; every field of LinearConfig gets two
WRONG_TYPES = {"int": ("8", 8.0, True, None), "bool": (1, "no", None), "str": (1, None, b"gemv"),
               "int | None": ("64", 64.0, True)}
for fld, kind in LC_FIELDS.items():
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    assert kind in WRONG_TYPES, f"LinearConfig.{fld}: no wrong values for its type {kind}"
    seen_types = set()
    for value in WRONG_TYPES[kind]:
        if len(seen_types) == 2:
            break
        seen_types.add(type(value))
        bad(f"lconfig-type-{fld}-{type(value).__name__}", config(LC, **{fld: value}), TypeError,
            rf"LinearConfig\.{fld} must be {re.escape(kind)}, got {type(value).__name__}")
# out-of-range values of every numeric and named field (those this version has)
LC_RANGES = [("kernel", "cublas"), ("kernel", "GEMV"), ("kernel", ""), ("block_r", 24), ("block_r", 0),
             ("block_r", 2048), ("step_bytes", 8), ("step_bytes", 48), ("step_bytes", 2048), ("split_k", -1),
             ("programs_per_sm", 0), ("programs_per_sm", -8), ("block_m", 8), ("block_m", 96), ("block_m", 1024),
             ("block_n", 100), ("block_n", 1024), ("block_n", 8), ("block_k", 16), ("block_k", 96), ("group", 0),
             ("group", 6), ("persistent", -1), ("num_stages", 0), ("num_stages", 9), ("num_warps", 3),
             ("num_warps", 32), ("num_warps", 0), ("codebook", 3), ("codebook", -1), ("warps_k", 3), ("warps_k", 0),
             ("evict", "bogus"), ("evict", "evict-first"), ("maxnreg", 15), ("maxnreg", 256), ("maxnreg", -1)]
for fld, value in LC_RANGES:
    if fld in LC_FIELDS:
        bad(f"lconfig-range-{fld}-{value!r}", config(LC, **{fld: value}), ValueError, rf"\b{fld}\b")
bad("lconfig-warps-k-without-mma", config(LC, warps_k=2), ValueError, r"LinearConfig\.warps_k > 1 needs")
bad("lconfig-mma-block-r", config(LC, kernel="gemv_mma"), ValueError, r"LinearConfig\.block_r must be 16")
bad("lconfig-unknown-field", config(LC, mma=True), TypeError, r"unexpected keyword argument 'mma'")
bad("lconfig-with-block-m-8", config_with(LC, block_m=8), ValueError, r"block_m")
bad("lconfig-with-swap-int", config_with(LC, swap=1), TypeError, r"LinearConfig\.swap")
ok("lconfig-maxnreg-none", config(LC, maxnreg=None))
ok("lconfig-maxnreg-255", config(LC, maxnreg=255))
ok("lconfig-mma", config(LC, kernel="gemv_mma", block_r=32, num_warps=4, warps_k=2))

# --- nf4.linear ----------------------------------------------------------------------------------------------------


def lin(change=None, *, x_shape=(3, K), x_dtype=torch.float16, bias=False, shape=(N, K), wdtype=torch.bfloat16,
        nested=True, blocksize=64, storage=torch.uint8, **kwargs):
    """A linear call on fresh weights and x: change(args dict) alters x / weight / quant_state / bias / kwargs in
    place (quant_state OMIT: left out). The expected result: x @ W^T (+ bias) within the float32 bound, with the
    reference's W in the state's dtype cast to x's, on the unaltered weight, the x and bias passed."""

    def build(seed):
        packed, qs = quant(shape, wdtype, blocksize, nested, seed=seed, storage=storage)
        wd = ref_dequant(packed, qs)
        x = randn(x_shape, x_dtype, seed + 1)
        b = randn((shape[0],), x_dtype, seed + 2) if bias else None
        a = {"x": x, "weight": packed, "quant_state": qs, "bias": b,
             "kw": {k: (v(packed, qs) if lazy(v) else v) for k, v in kwargs.items()}}
        if change is not None:
            change(a)
        args = (a["x"], a["weight"]) if a["quant_state"] is OMIT else (a["x"], a["weight"], a["quant_state"])
        kw = dict(a["kw"])
        if a["bias"] is not None:
            kw["bias"] = a["bias"]
        x_ok = isinstance(a["x"], torch.Tensor) and a["x"].dtype in DT_NAME and not a["x"].is_meta
        check = within_bound(a["x"], wd, a["bias"]) if x_ok else None
        return Call(nf4.linear, args, kw, check)

    return build


def setx(fn):
    def change(a):
        a["x"] = fn(a["x"])

    return change


def setw(**changes):
    def change(a):
        for k, v in changes.items():
            a[k] = v(a) if lazy(v) else v

    return change


def setqs(**changes):
    return lambda a: a.update(quant_state=with_(a["quant_state"], **{
        k: (v(a["quant_state"]) if lazy(v) else v) for k, v in changes.items()}))


for dt in (torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool, torch.float64,
           torch.complex64, torch.float8_e5m2):
    bad(f"lin-x-{str(dt).removeprefix('torch.')}", lin(setx(lambda x, dt=dt: x.to(dt))), TypeError,
        r"x must be float16, bfloat16 or float32")
bad("lin-x-list", lin(setx(lambda x: x.tolist())), TypeError, r"x must be a torch\.Tensor, got list")
bad("lin-x-ndarray", lin(setx(lambda x: x.float().numpy())), TypeError, r"x must be a torch\.Tensor, got ndarray")
bad("lin-x-none", lin(setx(lambda x: None)), TypeError, r"x must be a torch\.Tensor")
bad("lin-x-float", lin(setx(lambda x: 1.0)), TypeError, r"x must be a torch\.Tensor")
bad("lin-x-last-dim", lin(x_shape=(3, K + 1)), ValueError, r"x has shape \(3, 129\), expected \(\.\.\., 128\)")
bad("lin-x-transposed", lin(x_shape=(K, 3)), ValueError, r"x has shape \(128, 3\)")
bad("lin-x-out-features", lin(x_shape=(3, N)), ValueError, r"x has shape \(3, 48\)")
bad("lin-x-0d", lin(setx(lambda x: x[0, 0].clone())), ValueError, r"x has shape \(\)")
bad("lin-x-meta", lin(setx(lambda x: x.to(META))), ValueError, r"x is on meta, expected cpu")
bad("lin-x-meta-bf16", lin(setx(lambda x: x.to(META)), x_dtype=torch.bfloat16), ValueError, r"x is on meta")
bad("lin-x-int-with-grad-path", lin(setx(lambda x: x.to(torch.int32)), bias=True), TypeError, r"x must be float16")
ok("lin-x-fp16", lin())
ok("lin-x-bf16", lin(x_dtype=torch.bfloat16))
ok("lin-x-fp32", lin(x_dtype=torch.float32))
ok("lin-x-fp16-bias", lin(bias=True))
ok("lin-x-bf16-bias", lin(x_dtype=torch.bfloat16, bias=True))
ok("lin-x-fp32-bias", lin(x_dtype=torch.float32, bias=True))
ok("lin-x-1d", lin(x_shape=(K,)))
ok("lin-x-3d", lin(x_shape=(2, 3, K), x_dtype=torch.bfloat16))
ok("lin-x-4d-fp32", lin(x_shape=(2, 1, 2, K), x_dtype=torch.float32))
ok("lin-x-no-rows", lin(x_shape=(0, K)))
ok("lin-x-no-rows-3d", lin(x_shape=(2, 0, K), x_dtype=torch.bfloat16))
ok("lin-x-20-rows", lin(x_shape=(20, K)))
ok("lin-x-noncontiguous", lin(setx(lambda x: torch.cat([x, x], 1)[:, ::2])))
ok("lin-x-transposed-view", lin(setx(lambda x: x.t().contiguous().t())))
ok("lin-x-unaligned", lin(setx(lambda x: torch.cat([x.reshape(-1)[:1], x.reshape(-1)])[1:].view(x.shape))))
ok("lin-x-expanded", lin(setx(lambda x: x[:1].expand(4, K))))
ok("lin-x-requires-grad", lin(setx(lambda x: x.clone().requires_grad_())))
ok("lin-weight-fp16", lin(wdtype=torch.float16, x_dtype=torch.bfloat16))
ok("lin-weight-fp32", lin(wdtype=torch.float32))
ok("lin-weight-plain", lin(nested=False))
ok("lin-weight-blocksize-32", lin(blocksize=32))
ok("lin-weight-blocksize-128-bf16-storage", lin(blocksize=128, storage=torch.bfloat16))
ok("lin-weight-blocksize-4096", lin(blocksize=4096, shape=(5, 100), x_shape=(2, 100)))
ok("lin-weight-blocks-straddle-rows", lin(shape=(33, 100), x_shape=(3, 100)))
ok("lin-weight-odd-count", lin(shape=(3, 67), x_shape=(2, 67), x_dtype=torch.bfloat16))
ok("lin-weight-empty-rows", lin(shape=(0, K)))
ok("lin-weight-one-row", lin(shape=(1, K)))
ok("lin-weight-storage-fp32", lin(storage=torch.float32))
ok("lin-packed-flat", lin(setw(weight=lambda a: a["weight"].reshape(-1))))
ok("lin-packed-row-fp16", lin(setw(weight=lambda a: a["weight"].view(1, -1))))
ok("lin-packed-row-fp32", lin(setw(weight=lambda a: a["weight"].view(1, -1)), x_dtype=torch.float32))
ok("lin-x-parameter", lin(setx(lambda x: torch.nn.Parameter(x.clone(), requires_grad=False))))
ok("lin-weight-empty-cols", lin(shape=(N, 0), x_shape=(3, 0)))
ok("lin-weight-empty-rows-bias", lin(shape=(0, K), bias=True))
ok("lin-state-shape-numpy", lin(setqs(shape=(np.int64(N), np.int32(K)))))
ok("lin-state-shape-list", lin(setqs(shape=[N, K])))


def lin_backward(x_dtype):
    """Forward and backward of x (requires grad) and bias: y and x.grad (= dY @ W, dY of ones) within the bound."""

    def build(seed):
        packed, qs = quant((N, K), seed=seed)
        wd = ref_dequant(packed, qs)
        x = randn((5, K), x_dtype, seed + 1)
        b = randn((N,), x_dtype, seed + 2)

        def run(x, packed, qs, b):
            xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
            y = nf4.linear(xg, packed, qs, bias=bg)
            y.sum().backward()
            return y.detach(), xg.grad, bg.grad

        def check(got):
            y, gx, gb = got
            within_bound(x, wd, b)(y)
            within_bound(torch.ones(5, N, dtype=x_dtype), wd.t().contiguous())(gx)
            assert torch.equal(gb, torch.full((N,), 5.0, dtype=x_dtype))

        return Call(run, (x, packed, qs, b), {}, check)

    return build


ok("lin-backward-fp16", lin_backward(torch.float16))
ok("lin-backward-bf16", lin_backward(torch.bfloat16))
ok("lin-backward-fp32", lin_backward(torch.float32))
bad("lin-bias-shape", lin(setw(bias=lambda a: torch.zeros(N + 1, dtype=torch.float16))), ValueError,
    r"bias has shape \(49,\), expected \(48,\)")
bad("lin-bias-2d", lin(setw(bias=lambda a: torch.zeros(1, N, dtype=torch.float16))), ValueError,
    r"bias has shape \(1, 48\)")
bad("lin-bias-0d", lin(setw(bias=lambda a: torch.tensor(0.0, dtype=torch.float16))), ValueError, r"bias has shape")
bad("lin-bias-in-features", lin(setw(bias=lambda a: torch.zeros(K, dtype=torch.float16))), ValueError,
    r"bias has shape \(128,\)")
bad("lin-bias-dtype-fp32", lin(setw(bias=lambda a: torch.zeros(N, dtype=torch.float32))), TypeError,
    r"bias has dtype torch\.float32, expected torch\.float16")
bad("lin-bias-dtype-bf16", lin(setw(bias=lambda a: torch.zeros(N, dtype=torch.bfloat16))), TypeError,
    r"bias has dtype torch\.bfloat16")
bad("lin-bias-dtype-int", lin(setw(bias=lambda a: torch.zeros(N, dtype=torch.int32))), TypeError, r"bias has dtype")
bad("lin-bias-dtype-fp32-x", lin(setw(bias=lambda a: torch.zeros(N, dtype=torch.float16)), x_dtype=torch.float32),
    TypeError, r"bias has dtype torch\.float16, expected torch\.float32")
bad("lin-bias-meta", lin(setw(bias=lambda a: torch.zeros(N, dtype=torch.float16, device=META))), ValueError,
    r"bias is on meta")
bad("lin-bias-list", lin(setw(bias=lambda a: [0.0] * N)), TypeError, r"bias must be a torch\.Tensor or None")
bad("lin-bias-float", lin(setw(bias=lambda a: 0.5)), TypeError, r"bias must be a torch\.Tensor or None")
bad("lin-bias-ndarray", lin(setw(bias=lambda a: np.zeros(N, np.float16))), TypeError, r"bias must be a torch\.Tensor")
ok("lin-bias-noncontiguous", lin(setw(bias=lambda a: randn((2 * N,), torch.float16, 5)[::2])))
ok("lin-bias-requires-grad", lin(setw(bias=lambda a: randn((N,), torch.bfloat16, 6).requires_grad_()),
                                 x_dtype=torch.bfloat16))
bad("lin-config-str", lin(config="gemv"), TypeError, r"config must be a nf4\.LinearConfig or None")
bad("lin-config-dequant", lin(config=nf4.DequantConfig()), TypeError,
    r"config must be a nf4\.LinearConfig or None, got DequantConfig")
bad("lin-config-dict", lin(config={"kernel": "gemv"}), TypeError, r"config must be a nf4\.LinearConfig")
ok("lin-config-gemv", lin(config=lambda p, s: LC(kernel="gemv")))
ok("lin-config-gemv-small-steps", lin(config=lambda p, s: LC(kernel="gemv", block_r=8, step_bytes=16, codebook=0)))
ok("lin-config-gemv-table", lin(config=lambda p, s: LC(kernel="gemv_table", block_r=16, step_bytes=16),
                                x_dtype=torch.bfloat16))
ok("lin-config-gemm-word", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=16, block_n=32, block_k=64),
                               x_dtype=torch.bfloat16))
ok("lin-config-gemm-word-fp16-on-bf16", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=16, block_n=16,
                                                                  block_k=64, swap=True), x_shape=(20, K)))
ok("lin-config-kernel-dequant", lin(config=lambda p, s: LC(kernel="dequant")))
ok("lin-config-split-k-beyond-steps", lin(config=lambda p, s: LC(kernel="gemv", split_k=64)))
ok("lin-config-huge-tiles", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=512, block_n=512, block_k=2048)))
ok("lin-config-group-1024", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=16, block_n=16, block_k=64,
                                                       group=1024), x_shape=(40, K)))
ok("lin-config-gemv-mma", lin(config=lambda p, s: LC(kernel="gemv_mma", block_r=64, num_warps=4)))
ok("lin-config-gemv-widest", lin(config=lambda p, s: LC(kernel="gemv", block_r=1024, step_bytes=1024)))
ok("lin-config-gemm-word-blocksize-32", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=16, block_n=16,
                                                                   block_k=32), blocksize=32))
ok("lin-config-stages-warps", lin(config=lambda p, s: LC(kernel="gemm_word", block_m=16, block_n=16, block_k=64,
                                                         num_stages=8, num_warps=16, maxnreg=255)))
bad("lin-ftz-int", lin(ftz=1), TypeError, r"ftz must be True, False or None")
bad("lin-ftz-str", lin(ftz="no"), TypeError, r"ftz must be True, False or None")
ok("lin-ftz-false", lin(ftz=False))
ok("lin-ftz-none", lin(ftz=None))
bad("lin-out-kwarg", lin(out=torch.empty(3, N, dtype=torch.float16)), TypeError, r"\bout\b")
bad("lin-weight-none", lin(setw(weight=None)), TypeError, r"weight must be a packed torch\.Tensor")
bad("lin-weight-list", lin(setw(weight=lambda a: a["weight"].tolist())), TypeError, r"weight must be a packed")
bad("lin-weight-none-alone", lin(setw(weight=None, quant_state=OMIT)), TypeError, r"quant_state is required")
bad("lin-weight-module-without-weight", lin(setw(weight=torch.nn.ReLU(), quant_state=OMIT)), TypeError,
    r"quant_state is required.*ReLU")
bad("lin-weight-nn-linear", lin(setw(weight=torch.nn.Linear(K, N), quant_state=OMIT)), TypeError,
    r"quant_state is required")
bad("lin-packed-without-state", lin(setw(quant_state=OMIT)), TypeError, r"quant_state is required")
bad("lin-packed-meta", lin(setw(weight=lambda a: a["weight"].to(META))), ValueError, r"weight is on the meta device")
bad("lin-packed-strided", lin(setw(weight=lambda a: strided(a["weight"]))), ValueError,
    r"packed weight must be contiguous")
bad("lin-packed-short", lin(setw(weight=lambda a: a["weight"][:-1].clone())), ValueError, r"packed weight holds")
bad("lin-packed-float64", lin(setw(weight=lambda a: a["weight"].reshape(-1).view(torch.float64))), TypeError,
    r"packed weight has dtype torch\.float64")
bad("lin-state-dict", lin(setw(quant_state=lambda a: a["quant_state"].as_dict())), TypeError,
    r"quant_state must be a bitsandbytes QuantState")
bad("lin-state-fp4", lin(setqs(quant_type="fp4")), ValueError, r"quant_state\.quant_type must be 'nf4'")
bad("lin-state-blocksize-96", lin(setqs(blocksize=96)), ValueError, r"quant_state\.blocksize must be one of")
ok("lin-state-blocksize-64.0", lin(setqs(blocksize=64.0)))
ok("lin-state-blocksize-numpy", lin(setqs(blocksize=np.int64(64))))
bad("lin-state-absmax-float16", lin(setqs(absmax=lambda s: s.absmax.half())), TypeError,
    r"quant_state\.absmax must be torch\.uint8")
bad("lin-state-absmax-short", lin(setqs(absmax=lambda s: s.absmax[:-1].clone()), nested=False), ValueError,
    r"quant_state\.absmax has 95 elements, expected 96")
bad("lin-state-absmax-strided", lin(setqs(absmax=lambda s: strided(s.absmax))), ValueError,
    r"quant_state\.absmax must be contiguous")
bad("lin-state-state2-none", lin(setqs(state2=None)), ValueError, r"quant_state\.state2 is required")
bad("lin-state-code-short", lin(lambda a: a.update(quant_state=with2(a["quant_state"],
                                                                     code=a["quant_state"].state2.code[:16].clone()))),
    ValueError, r"quant_state\.state2\.code has 16 elements")
bad("lin-state2-object", lin(setqs(state2=object())), TypeError, r"quant_state\.state2")
bad("lin-state-offset-none", lin(setqs(offset=None)), TypeError, r"quant_state\.offset must be a tensor")
bad("lin-state-dtype-float64", lin(setqs(dtype=torch.float64)), TypeError, r"quant_state\.dtype must be")
bad("lin-state-shape-negative", lin(setqs(shape=(-48, 128))), ValueError, r"quant_state\.shape must hold non-negative")
bad("lin-state-shape-1d", lin(setqs(shape=torch.Size([N * K]))), ValueError,
    r"quant_state\.shape must be 2-D \(out_features, in_features\)")
bad("lin-state-shape-3d", lin(setqs(shape=torch.Size([N, 2, K // 2]))), ValueError, r"quant_state\.shape must be 2-D")
bad("lin-state-shape-1d-odd", lin(shape=(67,), x_shape=(3, 67)), ValueError, r"quant_state\.shape must be 2-D")
def lin_state_swapped(seed):
    """A state that says (K, N) for the same bytes: a valid weight of that shape (the reference's reshaped)."""
    packed, qs = quant((N, K), seed=seed)
    state = with_(qs, shape=torch.Size([K, N]))
    x = randn((3, N), torch.float16, seed + 1)
    return Call(nf4.linear, (x, packed, state), {}, within_bound(x, ref_dequant(packed, qs).reshape(K, N)))


ok("lin-state-shape-swapped", lin_state_swapped)

# --- threads ---------------------------------------------------------------------------------------------------------


def threads(seed):
    """8 threads x 3 rounds of dequantize (4 weights, shared) and linear (one weight, shared; each thread its x), at
    once: every result is the sequential one, bit for bit."""
    dq = [quant(DQ, (torch.bfloat16, torch.float16)[i % 2], 64, i < 2, seed=seed + i) for i in range(4)]
    lw = quant((N, K), torch.bfloat16, 64, True, seed=seed + 9)
    xs = [randn((1 + i % 5, K), (torch.float16, torch.bfloat16)[i % 2], seed + 20 + i) for i in range(8)]
    want_dq = [ref_dequant(p, s) for p, s in dq]
    want_lin = [nf4.linear(x, *lw) for x in xs]  # sequential
    n_threads, rounds = 8, 3

    def run(dq, lw, xs):
        barrier = threading.Barrier(n_threads)
        results: list = [None] * n_threads
        errors: list = []

        def work(i):
            try:
                barrier.wait()
                got = []
                for r in range(rounds):
                    j = (i + r) % 4
                    got.append((j, nf4.dequantize(*dq[j])))
                    got.append((None, nf4.linear(xs[i], *lw)))
                results[i] = got
            except BaseException as exc:  # reported below
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        return results

    def check(results):
        wd = ref_dequant(*lw)
        for i, got in enumerate(results):
            assert got is not None and len(got) == 2 * rounds
            for j, y in got:
                if j is None:
                    assert_bitexact(y, want_lin[i], name=f"thread {i}: linear")
                    within_bound(xs[i], wd)(y)
                else:
                    exact(want_dq[j])(y)

    return Call(run, (dq, lw, xs), {}, check)


ok("threads-dequantize-and-linear", threads)

# --- the bitsandbytes patch ------------------------------------------------------------------------------------------

for value in ("yes", 1, 0, None, 1.0, "True"):
    bad(f"patch-fused-linear-{value!r}", lambda seed, v=value: Call(nf4.patch_bitsandbytes, (), {"fused_linear": v}),
        TypeError, r"fused_linear must be True or False")


def patched_context(value):
    def enter():
        with nf4.patched_bitsandbytes(fused_linear=value):
            pass

    return lambda seed: Call(enter)


bad("patched-fused-linear-'yes'", patched_context("yes"), TypeError, r"fused_linear must be True or False")
bad("patched-fused-linear-2", patched_context(2), TypeError, r"fused_linear must be True or False")
bad("patch-positional", lambda seed: Call(nf4.patch_bitsandbytes, (True,)), TypeError, r"positional")


def through_patch(fused_linear, *, nested=True):
    """bitsandbytes' dequantize_4bit inside patched_bitsandbytes(fused_linear=...): nf4's bits, the patch undone."""

    def build(seed):
        packed, qs = quant(nested=nested, seed=seed)

        def run(p, s):
            key = ("dequantize_4bit", "nf4")
            before = nf4_bnb.routed_counts().get(key, 0)
            with nf4.patched_bitsandbytes(fused_linear=fused_linear):
                y = F.dequantize_4bit(p, s)
            return y, nf4_bnb.routed_counts().get(key, 0) - before

        def check(got):
            y, routed = got
            assert routed == 1, f"{routed} calls of dequantize_4bit went to nf4"
            exact(ref_dequant(packed, qs))(y)

        return Call(run, (packed, qs), {}, check)

    return build


ok("patched-dequantize-4bit", through_patch(False))
ok("patched-dequantize-4bit-plain", through_patch(False, nested=False))
ok("patched-fused-linear-numpy-bool", through_patch(np.bool_(True)))


def unpatch_twice(seed):
    def run():
        nf4.unpatch_bitsandbytes()
        nf4.unpatch_bitsandbytes()
        return nf4_bnb.patched_names()

    def check(names):
        assert names == []

    return Call(run, (), {}, check)


def patch_unpatch(seed):
    def run():
        nf4.patch_bitsandbytes()
        nf4.patch_bitsandbytes()  # idempotent
        try:
            return nf4_bnb.patched_names()
        finally:
            nf4.unpatch_bitsandbytes()

    def check(names):
        assert names, "nothing was patched"

    return Call(run, (), {}, check)


ok("unpatch-twice", unpatch_twice)
ok("patch-twice-then-unpatch", patch_unpatch)


# --- the test ------------------------------------------------------------------------------------------


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


IDS = [c.id for c in CASES]
assert len(IDS) == len(set(IDS)), sorted({i for i in IDS if IDS.count(i) > 1})


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_or_unusual_input(case: Case):
    call = case.build(seed_of("bad-inputs", case.id))
    roots = {"args": call.args, "kwargs": dict(call.kwargs)}
    if case.raises is None:
        roots["kwargs"].pop("out", None)  # a successful call writes out: its result is checked instead
    before = snapshot(roots)
    patches = nf4_bnb.patched_names()
    if case.raises is None:
        assert call.check is not None, "a case expected to succeed needs a check"
        call.check(call.run())
    else:
        exc, pattern = case.raises
        with pytest.raises(exc, match=pattern) as info:
            call.run()
        assert type(info.value) in (TypeError, ValueError), f"{type(info.value).__name__}: {info.value}"
    assert_unchanged(before)
    assert nf4_bnb.patched_names() == patches, "the bitsandbytes patch state changed"


def test_at_least_150_cases():
    assert len(CASES) >= 150, len(CASES)
    assert not re.search(r"\s", "".join(IDS))
