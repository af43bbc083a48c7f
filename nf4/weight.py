"""One frozen value for an NF4 weight, built and checked once, and the check that keeps a cache honest.

    w = NF4Weight.of(linear4bit)                 # a bnb.nn.Linear4bit, a Params4bit ...
    w = NF4Weight.of(packed, quant_state)        # ... or the packed tensor and its QuantState

`NF4Weight` holds what every kernel reads: the packed bytes (a plain tensor over the caller's
storage, never a copy), the first- and second-level state, and the shape, blocksize, dtype and
whether it is double-quantized. It is validated when built, so the ops take it as it is.

`StateCheck` records everything of a QuantState and its packed tensor that a launch depends on
(each tensor's identity, data pointer, version, dtype, size and device; shape, blocksize, dtype,
quant type, nesting; the packed tensor's dtype, size, device, contiguity and alignment), so that
an op's repeat-call cache (`RepeatCache`, one per op) serves a call only when nothing changed.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from reference.format import ABSMAX_BLOCKSIZE, BLOCKSIZES

from . import runtime

PACKED_DTYPES = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int16, torch.int32)
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_is = operator.is_


@dataclass(frozen=True, eq=False)
class NF4Weight:
    """A validated NF4 weight: the packed bytes and their QuantState's tensors and facts."""

    packed: torch.Tensor  # contiguous, (n + 1) // 2 bytes in any quant_storage dtype
    absmax: torch.Tensor  # uint8 codes (nested) or float32, one per block
    absmax2: torch.Tensor | None  # float32, one per 256 blocks (nested only)
    code2: torch.Tensor | None  # float32 [256], the dynamic map (nested only)
    offset: torch.Tensor | None  # float32 [1] (nested only)
    shape: tuple[int, ...]  # the dequantized weight's shape
    blocksize: int
    dtype: torch.dtype  # the dequantized weight's dtype (QuantState.dtype)
    nested: bool

    @property
    def n(self) -> int:
        """Elements of the weight."""
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def transposed(self) -> bool:
        """Whether bitsandbytes returns this weight transposed (a packed tensor of shape[0] == 1)."""
        return self.packed.dim() >= 1 and self.packed.shape[0] == 1

    def with_packed(self, packed: torch.Tensor) -> NF4Weight:
        """The same state over other packed bytes (already checked to fit: see StateCheck.fits)."""
        return replace(self, packed=packed)

    @classmethod
    def of(cls, weight, quant_state=None) -> NF4Weight:
        """Build and validate from a Linear4bit, a Params4bit, or (packed tensor, QuantState)."""
        packed, qs = unpack(weight, quant_state)
        return cls.from_state(packed, qs)

    @classmethod
    def from_state(cls, packed: torch.Tensor, qs) -> NF4Weight:
        """Validate (packed, qs); TypeError or ValueError naming the field otherwise."""
        return cls(plain(packed), *check_state(packed, qs))


def plain(packed: torch.Tensor) -> torch.Tensor:
    """A plain torch.Tensor over the same storage as `packed` (itself when it is one): a Params4bit's methods
    dispatch through Python __torch_function__, about 2 us each."""
    if type(packed) is torch.Tensor or torch.compiler.is_compiling():
        return packed
    with _NO_TORCH_FUNCTION():
        return packed.as_subclass(torch.Tensor)


def module_weight(module):
    """A module's `weight`: read from its parameter dict where nn.Module keeps it (a plain `module.weight`
    fails the instance and class lookups before nn.Module.__getattr__ finds it there, about 0.6 us of host
    time per call); any other module's attribute otherwise."""
    params = getattr(module, "_parameters", None)
    inner = params.get("weight") if isinstance(params, dict) else None
    return inner if inner is not None else getattr(module, "weight", None)


def module_parts(module) -> tuple:
    """(weight, bias) of a module for the repeat calls: the weight as `module_weight` reads it, the bias from the
    parameter dict where it is registered there (a Linear4bit registers None without one: `module.bias` would
    reach it through nn.Module.__getattr__), the attribute otherwise."""
    params = getattr(module, "_parameters", None)
    if not isinstance(params, dict):
        return getattr(module, "weight", None), getattr(module, "bias", None)
    weight = params.get("weight")
    if weight is None:
        weight = getattr(module, "weight", None)
    return weight, params["bias"] if "bias" in params else getattr(module, "bias", None)


def unpack(weight, quant_state):
    """(packed tensor, QuantState) from a Linear4bit module, a Params4bit, or (packed tensor, QuantState)."""
    if quant_state is None:
        inner = module_weight(weight)
        if inner is not None and hasattr(inner, "quant_state"):  # bnb.nn.Linear4bit
            weight = inner
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            raise TypeError("quant_state is required unless weight is a bitsandbytes Linear4bit or Params4bit "
                            f"carrying one; got {type(weight).__name__} without quant_state")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a packed torch.Tensor, Params4bit or Linear4bit, got {type(weight).__name__}")
    if isinstance(quant_state, (torch.Tensor, dict, list, tuple)) or not all(
            hasattr(quant_state, f) for f in ("absmax", "shape", "blocksize", "dtype", "quant_type")):
        raise TypeError("quant_state must be a bitsandbytes QuantState (absmax, shape, blocksize, dtype, quant_type), "
                        f"got {type(quant_state).__name__}")
    if weight.device.type == "meta" and not runtime.is_recording():  # recording: an offline compile's stand-ins
        raise ValueError("weight is on the meta device, which holds no bytes to read; expected a CUDA tensor "
                         "(or a CPU tensor with TRITON_INTERPRET=1)")
    if weight.device.type == "cpu" and not runtime.interpreter_on():
        raise ValueError("weight is a CPU tensor, which nf4 runs in Triton's interpreter, but the interpreter is off: "
                         "set TRITON_INTERPRET=1 in the environment before triton is first imported (torch.compile "
                         "and bitsandbytes import it too), or move the weight to CUDA")
    return weight, quant_state


def as_int(value, field: str) -> int:
    """An integral value (int, NumPy integer, integral float, 0-d tensor) as int; TypeError/ValueError otherwise."""
    v = value
    if isinstance(v, torch.Tensor):
        if v.dim() != 0 or v.dtype.is_complex or v.dtype == torch.bool:
            raise TypeError(f"{field} must be an integer, got a {v.dtype} tensor of shape {tuple(v.shape)}")
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{field} must be an integer, got {type(value).__name__} {value!r}")
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise ValueError(f"{field} must be an integral value, got {value!r}")
    return int(v)


def _check_tensor(name: str, t, dtype, numel: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"quant_state.{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"quant_state.{name} must be {dtype}, got {t.dtype}")
    if t.numel() != numel:
        raise ValueError(f"quant_state.{name} has {t.numel()} elements, expected {numel}")
    if t.device != device:
        raise ValueError(f"quant_state.{name} is on {t.device}, expected {device} like the packed weight")
    if not t.is_contiguous():
        raise ValueError(f"quant_state.{name} must be contiguous")


def check_state(packed: torch.Tensor, qs) -> tuple:
    """Validate a QuantState against its packed tensor: (absmax, absmax2, code2, offset, shape, blocksize,
    dtype, nested), the fields of NF4Weight after `packed`."""
    quant_type = getattr(qs, "quant_type", None)
    if quant_type != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {quant_type!r}")
    blocksize = qs.blocksize if type(qs.blocksize) is int else as_int(qs.blocksize, "quant_state.blocksize")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"quant_state.blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")
    if qs.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"quant_state.dtype must be torch.float16, torch.bfloat16 or torch.float32, got {qs.dtype}")
    if packed.dtype not in PACKED_DTYPES:
        raise TypeError(f"packed weight has dtype {packed.dtype}, expected a quant_storage dtype: {PACKED_DTYPES}")
    if not packed.is_contiguous():
        raise ValueError("packed weight must be contiguous")
    if not isinstance(qs.shape, (tuple, list, torch.Size)):
        raise TypeError(f"quant_state.shape must be a torch.Size or a tuple of integers, got {type(qs.shape).__name__}")
    shape = tuple(qs.shape)
    if not all(type(d) is int for d in shape):  # (a torch.Size holds ints; anything else is checked one by one)
        shape = tuple(as_int(d, f"quant_state.shape[{i}]") for i, d in enumerate(qs.shape))
    if any(d < 0 for d in shape):
        raise ValueError(f"quant_state.shape must hold non-negative integers, got {tuple(qs.shape)}")
    n = math.prod(shape)
    have = packed.numel() * packed.element_size()
    if have != (n + 1) // 2:
        raise ValueError(f"packed weight holds {have} bytes, expected {(n + 1) // 2} for quant_state.shape {shape}")
    device = packed.device
    n_blocks = -(-n // blocksize)
    absmax = qs.absmax
    nested = getattr(qs, "nested", False)
    if not isinstance(nested, (bool, np.bool_)):
        raise TypeError(f"quant_state.nested must be a bool, got {type(nested).__name__} {nested!r}")
    if nested:
        _check_tensor("absmax", absmax, torch.uint8, n_blocks, device)
        s2 = getattr(qs, "state2", None)
        if s2 is None:
            raise ValueError("quant_state.state2 is required with double quantization (quant_state.nested is True)")
        for name in ("absmax", "code", "blocksize"):
            if not hasattr(s2, name):
                raise TypeError(f"quant_state.state2.{name} is missing: quant_state.state2 must be a bitsandbytes "
                                f"QuantState with absmax, code and blocksize, got {type(s2).__name__}")
        if as_int(s2.blocksize, "quant_state.state2.blocksize") != ABSMAX_BLOCKSIZE:
            raise ValueError(f"quant_state.state2.blocksize must be {ABSMAX_BLOCKSIZE}, got {s2.blocksize!r}")
        absmax2, code2, offset = s2.absmax, s2.code, getattr(qs, "offset", None)
        _check_tensor("state2.absmax", absmax2, torch.float32, -(-n_blocks // ABSMAX_BLOCKSIZE), device)
        _check_tensor("state2.code", code2, torch.float32, 256, device)
        _check_tensor("offset", offset, torch.float32, 1, device)
    else:
        _check_tensor("absmax", absmax, torch.float32, n_blocks, device)
        absmax2 = code2 = offset = None
    return absmax, absmax2, code2, offset, shape, blocksize, qs.dtype, bool(nested)


class StateCheck:
    """What a launch read of a QuantState and its packed tensor, compared on every repeat call.

    Holds the state's tensors (alive as long as the state is) but never the packed tensor or the state.
    `matches(qs, packed)` is True only when the state holds the same objects with the same data pointers,
    versions and sizes, the same shape, blocksize, dtype, quant type and nesting, and the packed tensor has
    the checked dtype, element count, device, contiguity and 16-byte alignment; `check(qs, packed)`, the repeat
    calls' form of it, gives the packed tensor's data pointer then (else -1). Subclasses (the ops' cache
    entries) add their launches.
    """

    __slots__ = ("__weakref__", "_refs", "_sigs", "_values", "blocksize", "device", "index",
                 "nested", "packed_dtype", "packed_numel", "ptr_mod", "quant_type", "s2_blocksize", "shape", "state2",
                 "w")

    def __init__(self, qs, w: NF4Weight):
        s2 = getattr(qs, "state2", None)
        self.w = w.with_packed(None)  # the validated state without the caller's packed bytes
        self.shape, self.blocksize, self.quant_type = qs.shape, qs.blocksize, qs.quant_type
        self.nested, self.state2 = getattr(qs, "nested", False), s2
        self.s2_blocksize = getattr(s2, "blocksize", None)
        refs = (qs.absmax, getattr(qs, "offset", None), getattr(s2, "absmax", None), getattr(s2, "code", None))
        self._refs = refs
        packed = w.packed
        self.packed_dtype, self.packed_numel = packed.dtype, packed.numel()
        # what t.get_device() says of a tensor on the weight's device: the CUDA index, -1 for the CPU
        self.index = packed.get_device()
        self.device = packed.device
        # every attribute of the state (and of state2) as it was checked, compared by identity: one C-level pass
        # (None where an object keeps no __dict__: its fields are then compared one by one)
        self._values = None if torch.compiler.is_compiling() else _values(qs)  # (Dynamo cannot read a __dict__)
        if torch.compiler.is_compiling():  # traced tensors have no data pointers: a check that never matches
            self._sigs, self.ptr_mod = None, -1
        else:
            self._sigs = _sigs(*refs)
            self.ptr_mod = packed.data_ptr() % 16

    def matches(self, qs, packed) -> bool:
        """Whether the state and the packed tensor (plain tensor or Params4bit) are as checked (`check`)."""
        if type(packed) is not torch.Tensor:
            if not isinstance(packed, torch.Tensor):
                return False
            with _NO_TORCH_FUNCTION():
                return self.check(qs, packed) >= 0
        return self.check(qs, packed) >= 0

    def check(self, qs, packed) -> int:
        """The data pointer of `packed` where `qs` holds what was checked (`state_ok`) and `packed` is bytes this
        state's launches can read (`packed_ptr`: a tensor whose methods need no Python dispatch), else -1. The
        repeat calls' one check, both inline."""
        values = self._values
        if values is None:  # a state without __dict__ (or checked while tracing: None never matches then)
            return self.packed_ptr(packed) if self.state_ok(qs) else -1
        # every attribute of the state by identity (shape, dtype, blocksize, quant_type, nested, state2, absmax,
        # offset, ...), then state2's three the launch reads, then the tensors' pointers, versions and sizes
        d = getattr(qs, "__dict__", None)
        if d is None or len(d) != len(values) or not all(map(_is, d.values(), values)):
            return -1
        a, o, a2, c2 = self._refs
        s2 = self.state2
        if s2 is not None and (s2.absmax is not a2 or s2.code is not c2 or s2.blocksize != self.s2_blocksize):
            return -1
        if a2 is None:  # (_sigs, inline)
            if self._sigs != (a.data_ptr(), a._version, a.numel(), a.dtype):
                return -1
        elif self._sigs != (a.data_ptr(), a._version, a.numel(), a.dtype, o.data_ptr(), o._version, o.numel(), o.dtype,
                            a2.data_ptr(), a2._version, a2.numel(), a2.dtype, c2.data_ptr(), c2._version, c2.numel(),
                            c2.dtype):
            return -1
        index = self.index  # (packed_ptr, inline)
        if (packed.dtype is self.packed_dtype and packed.numel() == self.packed_numel
                and packed.get_device() == index and packed.is_contiguous() and (index >= 0 or not packed.is_meta)):
            ptr = packed.data_ptr()
            if ptr % 16 == self.ptr_mod:
                return ptr
        return -1

    def state_ok(self, qs) -> bool:
        """Whether `qs` holds what was checked, field by field (`check` compares a state's __dict__ in one pass)."""
        s2 = self.state2
        if not (qs.shape is self.shape and qs.dtype is self.w.dtype and qs.blocksize == self.blocksize
                and qs.quant_type == self.quant_type and getattr(qs, "nested", False) is self.nested
                and getattr(qs, "state2", None) is s2 and (s2 is None or s2.blocksize == self.s2_blocksize)):
            return False
        a, o, a2, c2 = self._refs
        if not (qs.absmax is a and getattr(qs, "offset", None) is o
                and (s2 is None or (s2.absmax is a2 and s2.code is c2))):
            return False
        return self._sigs == _sigs(a, o, a2, c2)

    def fits(self, packed) -> bool:
        """Whether `packed` (plain tensor or Params4bit) is bytes this state's launches can read."""
        if type(packed) is not torch.Tensor:
            if not isinstance(packed, torch.Tensor):
                return False
            with _NO_TORCH_FUNCTION():
                return self.packed_ptr(packed) >= 0
        return self.packed_ptr(packed) >= 0

    def packed_ptr(self, packed) -> int:
        """The data pointer of `packed` (a tensor whose methods need no Python dispatch: a plain one, or any with
        __torch_function__ disabled) where it is bytes this state's launches can read: the checked dtype, element
        count and device, contiguous, the same 16-byte alignment, not a meta tensor; else -1."""
        if (packed.dtype is self.packed_dtype and packed.numel() == self.packed_numel
                and packed.get_device() == self.index and packed.is_contiguous()
                and (self.index >= 0 or not packed.is_meta)):
            ptr = packed.data_ptr()
            if ptr % 16 == self.ptr_mod:
                return ptr
        return -1


def _values(obj) -> tuple | None:
    """The values of an object's attributes (its __dict__), or None where it keeps none."""
    d = getattr(obj, "__dict__", None)
    return tuple(d.values()) if d is not None else None


def _sigs(absmax, offset, absmax2, code2) -> tuple:
    """The state tensors' data pointers, versions, sizes and dtypes: any change of where, how much or what they hold
    (a `.data` swap moves the pointer or, with a view of another dtype, keeps it and changes the dtype; resize_, set_
    and as_strided_ bump the version)."""
    if absmax2 is None:  # not nested: absmax alone
        return absmax.data_ptr(), absmax._version, absmax.numel(), absmax.dtype
    return (absmax.data_ptr(), absmax._version, absmax.numel(), absmax.dtype, offset.data_ptr(), offset._version,
            offset.numel(), offset.dtype, absmax2.data_ptr(), absmax2._version, absmax2.numel(), absmax2.dtype,
            code2.data_ptr(), code2._version, code2.numel(), code2.dtype)


class RepeatCache:
    """One op's repeat-call cache: id(quant_state) -> entry, dropped with the QuantState.

    An entry is any object with `matches(quant_state, packed) -> bool`, which must compare everything
    a launch depends on (nf4.weight.StateCheck does); `get` returns an entry only when it matches, so
    no change to a QuantState or its tensors can reuse a stale launch. The cache holds no QuantState
    and no packed weight, only what its entries hold.
    """

    __slots__ = ("entries", "limit")

    def __init__(self, limit: int = 4096):
        self.entries: dict[int, Any] = {}  # id(quant_state) -> entry; the ops' repeat calls read it directly
        self.limit = limit

    def get(self, quant_state, packed):
        """The entry of `quant_state` when it still matches (state and packed tensor), else None."""
        entry = self.entries.get(id(quant_state))
        if entry is not None and entry.matches(quant_state, packed):
            return entry
        return None

    def peek(self, quant_state):
        """The entry of `quant_state`, matching or not (tests and benchmarks)."""
        return self.entries.get(id(quant_state))

    def put(self, quant_state, entry) -> None:
        """Keep `entry` for `quant_state` until the state is garbage-collected (or the cache is full)."""
        key = id(quant_state)
        if key not in self.entries:
            if len(self.entries) >= self.limit:
                self.entries.clear()
            try:
                weakref.finalize(quant_state, self.entries.pop, key, None)
            except TypeError:  # a state that takes no weak references is not cached: its id may be reused
                return
        self.entries[key] = entry

    def forget(self, quant_state) -> None:
        """Drop the entry of `quant_state`."""
        self.entries.pop(id(quant_state), None)

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)
