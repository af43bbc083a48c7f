"""nf4 in other libraries' call forms: Unsloth's `fast_dequantize` signature (`unsloth.py`), and
bitsandbytes' own NF4 dequantization routed through nf4 in place (`bitsandbytes.py`:
`patch_bitsandbytes`, `unpatch_bitsandbytes`, `patched_bitsandbytes`)."""
