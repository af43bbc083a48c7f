"""The dequantize op: kernel (`kernel.py`), meta-parameters and tuned table (`config.py`), API (`api.py`)."""

from .api import dequantize, launch
from .config import DequantConfig

__all__ = ["DequantConfig", "dequantize", "launch"]
