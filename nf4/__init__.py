"""nf4: bitsandbytes NF4 kernels in Triton, bit-exact with bitsandbytes.

    import nf4
    w = nf4.dequantize(linear4bit_module)            # or nf4.dequantize(packed, quant_state)
    y = nf4.linear(x, linear4bit_module)             # x @ W^T + bias, W decoded inside the matmul
    nf4.dequantize(packed, quant_state, out=buf)     # into a preallocated buffer

Bit-exact with bitsandbytes' `dequantize_4bit` (CUDA) and with `reference.dequantize_nf4`
(Triton's interpreter on a CPU: set TRITON_INTERPRET=1 before importing triton).

Layout: one folder per op (`dequant/`: kernel, config, API), the device helpers every kernel
shares (`device.py`), one launch mechanism (`runtime/`), torch.compile registrations (`ops.py`),
other libraries' call forms (`integrations/`). Importing nf4 loads torch and triton, nothing else.
"""

from .dequant import DequantConfig, dequantize, launch
from .integrations.bitsandbytes import patch_bitsandbytes, patched_bitsandbytes, unpatch_bitsandbytes
from .integrations.unsloth import fast_dequantize
from .linear import LinearConfig, linear

__all__ = [
    "DequantConfig",
    "LinearConfig",
    "dequantize",
    "fast_dequantize",
    "launch",
    "linear",
    "patch_bitsandbytes",
    "patched_bitsandbytes",
    "unpatch_bitsandbytes",
]
