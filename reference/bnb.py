"""Conversion from bitsandbytes objects to the reference's arrays. Imports torch lazily."""

from __future__ import annotations

import numpy as np

from .floats import float32_to_bf16
from .format import ABSMAX_BLOCKSIZE, check_blocksize
from .nf4 import NF4Quantized

_DTYPE_NAMES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def _to_numpy(t) -> np.ndarray:
    return t.detach().to("cpu").contiguous().numpy()


def tensor_to_numpy(t) -> np.ndarray:
    """A torch tensor as the reference stores it: float16/float32 as is, bfloat16 as uint16 bits."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_bnb(packed, quant_state) -> NF4Quantized:
    """Convert a bitsandbytes packed NF4 tensor and its `QuantState` to an `NF4Quantized`.

    packed: the packed tensor (any `quant_storage`, on any device: its bytes are read as uint8).
    quant_state: a `bitsandbytes.functional.QuantState` with quant_type 'nf4', nested or not.
    The state's own `state2.code` is kept (never a rebuilt map). Raises ValueError for anything
    that is not NF4 or whose sizes do not agree.
    """
    qs = quant_state
    if getattr(qs, "quant_type", None) != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {getattr(qs, 'quant_type', None)!r}")
    blocksize = check_blocksize(int(qs.blocksize))
    dtype = _DTYPE_NAMES.get(str(qs.dtype))
    if dtype is None:
        raise ValueError(f"quant_state.dtype must be float16, bfloat16 or float32, got {qs.dtype}")
    shape = tuple(int(s) for s in qs.shape)
    raw = _to_numpy(packed.detach().reshape(-1).view(_uint8_dtype()))
    numel = int(np.prod(shape, dtype=np.int64))
    if raw.size < (numel + 1) // 2:
        raise ValueError(f"packed holds {raw.size} bytes, expected {(numel + 1) // 2} for shape {shape}")
    common = dict(packed=raw[: (numel + 1) // 2].copy(), shape=shape, dtype=dtype, blocksize=blocksize)
    if getattr(qs, "nested", False):
        s2 = qs.state2
        if int(s2.blocksize) != ABSMAX_BLOCKSIZE:
            raise ValueError(f"quant_state.state2.blocksize must be {ABSMAX_BLOCKSIZE}, got {s2.blocksize}")
        return NF4Quantized(
            absmax_u8=_to_numpy(qs.absmax).astype(np.uint8, copy=True),
            absmax2=_to_numpy(s2.absmax).astype(np.float32, copy=True),
            code2=_to_numpy(s2.code).astype(np.float32, copy=True),
            offset=np.float32(_to_numpy(qs.offset.reshape(-1))[0]),
            **common,
        )
    return NF4Quantized(absmax=_to_numpy(qs.absmax.float()).astype(np.float32, copy=True), **common)


def _uint8_dtype():
    import torch

    return torch.uint8


def bnb_transposes(packed) -> bool:
    """bitsandbytes returns `out.t()` when the packed tensor's shape[0] is 1 (a legacy shim)."""
    return int(packed.shape[0]) == 1


__all__ = ["bnb_transposes", "float32_to_bf16", "from_bnb", "tensor_to_numpy"]
