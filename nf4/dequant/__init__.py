"""The dequantize op: kernel (`kernel.py`), config (`config.py`), tuned data (`tuned.py`, `tuned.json`),
launch (`launch.py`), torch.library ops (`ops.py`), API (`api.py`)."""

from .api import dequantize
from .config import DequantConfig

__all__ = ["DequantConfig", "dequantize"]
