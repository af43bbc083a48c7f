"""The fused NF4 linear: kernels (GEMV and tl.dot), config and tuned table, API with autograd."""

from .api import linear
from .config import LinearConfig

__all__ = ["LinearConfig", "linear"]
