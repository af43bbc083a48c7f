"""The two codebooks of NF4 with double quantization, rebuilt from first principles.

`NF4_CODE` (in `reference.format`) is the authority: bitsandbytes dequantizes with those 16
float32 constants. This module rebuilds them the way the QLoRA paper describes (normal quantiles,
asymmetric, exact zero), and rebuilds bitsandbytes' signed 8-bit dynamic map for the absmax, so
that a reader can see where each constant comes from and how far a rebuild lands from it.
"""

from __future__ import annotations

import numpy as np

from .cpu_numerics import torch_linspace_f32
from .format import QLORA_OFFSET

F32 = np.float32


def nf4_code_from_normal(offset: float = QLORA_OFFSET, *, float32_grid: bool = True) -> np.ndarray:
    """Rebuild the 16 NF4 levels from normal quantiles (QLoRA, Dettmers et al. 2023, §3).

    Eight positive levels are the quantiles of N(0, 1) at probabilities evenly spaced from
    `offset` down to 0.5 (9 points, the last, 0.5 -> 0, dropped); seven negative levels mirror
    8 points likewise; an exact zero joins them; all are divided by the largest, so the range is
    [-1, 1] with 8 levels above zero and 7 below.

    float32_grid: bitsandbytes spaces the probabilities with a float32 linspace and divides in
    float32; with False the grid and the quantiles stay in float64 and only the end is rounded.
    Returns 16 float32 values in ascending order. See tests/test_codebook.py for how many ulp
    each variant lands from `NF4_CODE`.
    """
    if float32_grid:
        pos_p = torch_linspace_f32(offset, 0.5, 9)[:-1].astype(np.float64)
        neg_p = torch_linspace_f32(offset, 0.5, 8)[:-1].astype(np.float64)
    else:
        pos_p = np.linspace(offset, 0.5, 9)[:-1]
        neg_p = np.linspace(offset, 0.5, 8)[:-1]
    from scipy.stats import norm  # imported here: `import reference` loads no scipy

    levels = np.concatenate([norm.ppf(pos_p), [0.0], -norm.ppf(neg_p)])
    levels.sort()
    if float32_grid:
        levels32 = levels.astype(F32)
        return (levels32 / levels32.max()).astype(F32)
    return (levels / levels.max()).astype(F32)


def dynamic_map(*, contract: bool, lanes: int = 16, signed: bool = True, max_exponent_bits: int = 7,
                total_bits: int = 8) -> np.ndarray:
    """Rebuild bitsandbytes' dynamic 8-bit map (`functional.create_dynamic_map`), 256 float32.

    For each exponent i the fraction points are `linspace(0.1, 1, 2**(i + 7 - 7) + 1)` in
    float32; their midpoints times 10**(i - 6) are the levels, mirrored when signed; 0 and 1.0
    complete the map, which is sorted. The linspace values depend on the CPU torch build that made
    them: whether `start + step * k` was contracted into one FMA (`contract`) and the SIMD width
    (`lanes`). bitsandbytes dequantizes with the map stored in the state (`code2`): a rebuild is
    for study, never for dequantization.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        if signed:
            items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        else:
            items = 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = torch_linspace_f32(0.1, 1.0, items, lanes=lanes, contract=contract)
        means = ((bounds[:-1] + bounds[1:]) / F32(2.0)).astype(F32)
        scale = F32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).astype(F32).tolist()
        if signed:
            data += (-scale * means).astype(F32).tolist()
    if additional > 0:
        bounds = torch_linspace_f32(0.1, 1.0, additional + 1, lanes=lanes, contract=contract)
        means = ((bounds[:-1] + bounds[1:]) / F32(2.0)).astype(F32)
        scale = F32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data += (scale * means).astype(F32).tolist()
        if signed:
            data += (-scale * means).astype(F32).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return np.array(sorted(data), dtype=F32)
