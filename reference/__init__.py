"""A NumPy reference of bitsandbytes' NF4 with double quantization, bit-exact with bitsandbytes.

Public names: `NF4_CODE`, `quantize_nf4`, `dequantize_nf4`, `from_bnb`, `NF4Quantized`, and the
bfloat16 helpers `bf16_to_float32` / `float32_to_bf16` (bfloat16 arrays are uint16 bit
patterns). Importing this package does not import torch; `from_bnb` imports it when called.
"""

from .bnb import from_bnb, tensor_to_numpy
from .codebook import dynamic_map, nf4_code_from_normal
from .floats import bf16_to_float32, float32_to_bf16, flush_subnormal
from .format import ABSMAX_BLOCKSIZE, BLOCKSIZES, DYNAMIC_MAP, NF4_CODE
from .nf4 import NF4Quantized, dequantize_nf4, quantize_nf4, recover_absmax, unpack_nibbles

__all__ = [
    "ABSMAX_BLOCKSIZE",
    "BLOCKSIZES",
    "DYNAMIC_MAP",
    "NF4_CODE",
    "NF4Quantized",
    "bf16_to_float32",
    "dequantize_nf4",
    "dynamic_map",
    "float32_to_bf16",
    "flush_subnormal",
    "from_bnb",
    "nf4_code_from_normal",
    "quantize_nf4",
    "recover_absmax",
    "tensor_to_numpy",
    "unpack_nibbles",
]
