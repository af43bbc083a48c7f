"""The word GEMV's inline PTX (nf4.device.product_table and table_pairs) executed by a small emulator.

Triton's interpreter cannot run PTX, so on a CPU the word GEMV decodes per nibble instead; this test
runs the PTX text itself, instruction by instruction, on random absmax values (normal, subnormal,
huge, signed zero) and random words, and compares every 16-bit weight with the reference's
`round(NF4[c] * absmax)` (reference.nf4.dequantize_nf4's arithmetic: FTZ or IEEE, then RNE to the
dtype). It also holds the asm text to one line: Inductor writes a kernel's constexpr globals into
its generated Python source, where a newline inside the string broke the import (torch.compile of
nf4.linear at M = 1, results/linear/gpu_tests_h100_*.txt).
"""

from __future__ import annotations

import numpy as np
import pytest

from nf4 import device
from reference.floats import cast_float32, flush_subnormal
from reference.format import NF4_CODE_BITS

NF4 = np.asarray(NF4_CODE_BITS, dtype=np.uint32).view(np.float32)
ASM = {(ftz, dt): getattr(device, f"_TABLE_ASM_{'BF16' if dt == 'bfloat16' else 'F16'}{'_FTZ' if ftz else ''}")
       for ftz in (True, False) for dt in ("bfloat16", "float16")}


def _text(c) -> str:
    return getattr(c, "value", c)


def _bits16(v: np.float32, dtype: str) -> int:
    r = cast_float32(np.asarray([v], dtype=np.float32), dtype)
    return int(r.view(np.uint16)[0])


def _absmax_values(rng) -> list[float]:
    vals = list(rng.standard_normal(40).astype(np.float32) * np.float32(0.05))
    vals += [1.0, -0.0, 0.0, 3e-39, -7e-40, 1e-38, 1.2e-38, 70000.0, -65504.0, 3.4e38, 2.0**-24, 2.0**-14]
    return [np.float32(v) for v in vals]


@pytest.mark.parametrize("ftz", [True, False], ids=["ftz", "ieee"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_product_table_and_lookup(nf4h, ftz, dtype):
    rng = np.random.default_rng(20261123 + 2 * ftz + (dtype == "float16"))
    table_asm, lookup_asm = _text(ASM[ftz, dtype]), _text(device.LOOKUP_ASM)
    words = [int(w) for w in rng.integers(0, 2**32, size=24, dtype=np.uint64)]
    words += [0x01234567, 0x89ABCDEF, 0xFEDCBA98, 0x76543210]
    for absmax in _absmax_values(rng):
        a_bits = int(np.asarray([absmax], dtype=np.float32).view(np.uint32)[0])
        regs = nf4h.emulate_ptx(table_asm, {"$8": a_bits})
        planes = [regs[f"${i}"] for i in range(8)]
        if ftz:
            products = flush_subnormal(NF4 * flush_subnormal(np.float32(absmax)))
        else:
            products = (NF4 * absmax).astype(np.float32)
        want = [_bits16(p, dtype) for p in products]
        # the planes hold entry c's low byte in byte c % 4 of t[c // 4] and its high byte likewise in t[4 + c // 4]
        got = [((planes[4 + c // 4] >> (8 * (c % 4))) & 0xFF) << 8 | ((planes[c // 4] >> (8 * (c % 4))) & 0xFF)
               for c in range(16)]
        assert got == want, f"table for absmax {absmax!r} ({dtype}, ftz={ftz})"
        for word in words:
            out = nf4h.emulate_ptx(lookup_asm, {"$4": word, **{f"${5 + i}": planes[i] for i in range(8)}})
            for j in range(4):  # pair j: element 2j (high nibble of byte j) low, 2j + 1 high
                byte = (word >> (8 * j)) & 0xFF
                expect = want[byte >> 4] | (want[byte & 0xF] << 16)
                assert out[f"${j}"] == expect, f"word {word:#010x} pair {j}, absmax {absmax!r} ({dtype}, ftz={ftz})"


def test_asm_text_is_one_line():
    for text in [*map(_text, ASM.values()), _text(device.LOOKUP_ASM)]:
        assert "\n" not in text and "\r" not in text
