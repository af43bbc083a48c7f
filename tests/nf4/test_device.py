"""nf4.device's constexprs come from the format module, and no kernel repeats a format fact as a literal."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from nf4 import device
from reference.format import ABSMAX_BLOCKSIZE, HIGH_NIBBLE_SHIFT, LOW_NIBBLE_MASK, NF4_CODE, NF4_CODE_BITS

NF4_DIR = Path(device.__file__).resolve().parent


def _value(c):
    return getattr(c, "value", c)


def test_select_tree_levels_are_the_format_levels_bit_for_bit():
    levels = np.array([_value(c) for c in device.SELECT_TREE_LEVELS], dtype=np.float32)
    assert len(levels) == 16
    assert (levels.view(np.uint32) == NF4_CODE_BITS).all(), [hex(int(b)) for b in levels.view(np.uint32)]
    # the named constexprs, in code order
    named = [_value(getattr(device, f"NF4_{i}")) for i in range(16)]
    assert np.array_equal(np.array(named, dtype=np.float32).view(np.uint32), NF4_CODE_BITS)


def test_block_and_nibble_constexprs_are_the_format_module_values():
    assert _value(device.ABSMAX_BLOCK) == ABSMAX_BLOCKSIZE
    assert _value(device.HIGH_SHIFT) == HIGH_NIBBLE_SHIFT and _value(device.LOW_MASK) == LOW_NIBBLE_MASK
    assert np.float32(_value(device.FLT_MIN_F32)) == np.finfo(np.float32).tiny


def _kernel_sources() -> list[Path]:
    """Every module of nf4 that defines a @triton.jit function (the dequant kernel, the linear kernels' files,
    device.py's helpers)."""
    return sorted(p for p in NF4_DIR.rglob("*.py") if re.search(r"^@triton\.jit", p.read_text(), re.MULTILINE))


def test_no_kernel_types_a_level_or_the_absmax_block():
    """No NF4 level appears as a decimal literal and no `256` as a divisor in the kernels' sources."""
    sources = _kernel_sources()
    assert NF4_DIR / "device.py" in sources and any(p.parent.name == "dequant" for p in sources)
    # common, gemv, gemv_table, gemv_mma, gemm_word, gemv_pair
    assert sum(p.parent.name == "linear" for p in sources) >= 6, sources
    bad = []
    for path in sources:
        text = path.read_text()
        for v in NF4_CODE:
            if v not in (0.0, 1.0, -1.0) and repr(float(v))[:8] in text:
                bad.append(f"{path.name}: level {float(v)!r}")
        if re.search(r"//\s*256\b", text):
            bad.append(f"{path.name}: '// 256'")
    assert not bad, bad
