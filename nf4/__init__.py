"""nf4: bitsandbytes NF4 kernels in Triton, bit-exact with bitsandbytes.

    import nf4
    w = nf4.dequantize(linear4bit_module)            # or nf4.dequantize(packed, quant_state)
    y = nf4.linear(x, linear4bit_module)             # x @ W^T + bias, W decoded inside the matmul
    nf4.dequantize(packed, quant_state, out=buf)     # into a preallocated buffer

Bit-exact with bitsandbytes' `dequantize_4bit` (CUDA) and with `reference.dequantize_nf4`
(Triton's interpreter on a CPU: set TRITON_INTERPRET=1 before importing triton).

Layout (docs/ARCHITECTURE.md): `weight.py` (NF4Weight, one checked value per weight, and the state
check every repeat-call cache uses), `device.py` (the @triton.jit helpers every kernel shares),
`runtime.py` (one launch mechanism, device facts, the repeat-call cache), one folder per op
(`dequant/`, `linear/`: kernels, config, tuned data, launch, torch.library ops, API), other
libraries' call forms (`integrations/`). Importing nf4 loads torch and triton, nothing else.
"""

from .dequant import DequantConfig, dequantize
from .integrations.bitsandbytes import patch_bitsandbytes, patched_bitsandbytes, unpatch_bitsandbytes
from .integrations.unsloth import fast_dequantize
from .linear import LinearConfig, linear
from .weight import NF4Weight

__all__ = [
    "DequantConfig",
    "LinearConfig",
    "NF4Weight",
    "dequantize",
    "fast_dequantize",
    "linear",
    "patch_bitsandbytes",
    "patched_bitsandbytes",
    "unpatch_bitsandbytes",
]
