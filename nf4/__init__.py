"""nf4: one fused Triton kernel that dequantizes bitsandbytes NF4 weights (both levels, one launch).

    import nf4
    w = nf4.dequantize(linear4bit_module)            # or nf4.dequantize(packed, quant_state)
    nf4.dequantize(packed, quant_state, out=buf)     # into a preallocated buffer

Bit-exact with bitsandbytes' `dequantize_4bit` (CUDA) and with `reference.dequantize_nf4`
(Triton's interpreter on a CPU: set TRITON_INTERPRET=1 before importing triton).
"""

from .api import dequantize, launch
from .unsloth import fast_dequantize

__all__ = ["dequantize", "fast_dequantize", "launch"]
