"""The fused NF4 linear: kernels, one family per file, each with its own launches (gemv.py, gemv_table.py,
gemv_mma.py, gemm_word.py, gemv_pair.py, gemm_gluon.py (a Gluon kernel that launches itself, from gluon_launch.py);
common.py's shared
@triton.jit helpers), config (`config.py`), tuned data
(`tuned.py`, `tuned.json`), autotuning on first use (`autotune.py`: the table's pick raced against a few configs per
shape and M on a GPU), launch (`launch.py`: the kernels by name, the fallbacks, the shared arguments; `call.py`:
what it hands a kernel file and the helpers they share), torch.library ops (`ops.py`), API with autograd
(`api.py`). A kernel is one file plus one entry in launch.KERNELS (docs/ARCHITECTURE.md, "Adding a kernel"; the
example is gemv_pair, in no tuned row). The backward is nf4.dequantize + cuBLAS."""

from .api import linear
from .config import LinearConfig

__all__ = ["LinearConfig", "linear"]
