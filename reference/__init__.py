"""A NumPy reference of bitsandbytes' NF4 with double quantization, bit-exact with bitsandbytes.

Public names: `NF4_CODE`, `quantize_nf4`, `dequantize_nf4`, `from_bnb`, `NF4Quantized`, the
bfloat16 helpers `bf16_to_float32` / `float32_to_bf16` (bfloat16 arrays are uint16 bit
patterns), and the fused linear's oracles `linear_float64`, `accumulation_bound`, `worst_ratio`
and `gemv_model` (`reference.linear`). The format's facts live in `reference.format` (NumPy
only), which the Triton kernels read too. Importing this package loads neither torch nor scipy:
the names below are resolved on first use (PEP 562), `from_bnb` imports torch when called, and
`nf4_code_from_normal` scipy.
"""

from __future__ import annotations

import importlib

# name -> submodule that defines it
_EXPORTS = {
    "from_bnb": "bnb", "tensor_to_numpy": "bnb",
    "dynamic_map": "codebook", "nf4_code_from_normal": "codebook",
    "accumulation_bound": "linear", "gemv_model": "linear", "linear_float64": "linear", "worst_ratio": "linear",
    "bf16_to_float32": "floats", "float32_to_bf16": "floats", "flush_subnormal": "floats",
    "ABSMAX_BLOCKSIZE": "format", "BLOCKSIZES": "format", "DYNAMIC_MAP": "format", "NF4_CODE": "format",
    "NF4Quantized": "nf4", "dequantize_nf4": "nf4", "quantize_nf4": "nf4", "recover_absmax": "nf4",
    "unpack_nibbles": "nf4",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reference' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
