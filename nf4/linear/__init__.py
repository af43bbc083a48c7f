"""The fused NF4 linear: kernels (gemv.py, gemv_table.py, gemv_mma.py, gemm.py, gemm_word.py, common.py), config
(`config.py`), tuned data (`tuned.py`, `tuned.json`), launch (`launch.py`), torch.library ops (`ops.py`), API with
autograd (`api.py`)."""

from .api import linear
from .config import LinearConfig

__all__ = ["LinearConfig", "linear"]
