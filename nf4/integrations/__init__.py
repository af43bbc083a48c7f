"""nf4 in other libraries' call forms: Unsloth's `fast_dequantize` signature (`unsloth.py`)."""
