"""The model check (docs/FORMAT.md §9): nf4.linear's GEMV forward in Triton's interpreter equals
`reference.linear.gemv_model` bit for bit, and the model is what it says.

The kernel's accumulation order shows in the output only where float32 rounding survives the final
rounding to 16 bits, so besides random x each case runs a cancelling x: one column of every row holds
a large power of two L and the bias is -L times that column of W (exact in x's dtype), so the output
is the small rest of a float32 sum whose rounding was set by the large term. There a different order
(another step size, no split) changes many outputs, which the test checks too: it can fail.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.linear import LinearConfig
from nf4.linear import api as linear_api
from nf4.linear import launch as linear_launch
from nf4.linear.gemv import nf4_gemv_kernel
from nf4.linear.gemv_table import nf4_gemv_table_kernel
from nf4.linear.tuned import tuned
from nf4.weight import NF4Weight
from reference.linear import fma_float32, gemv_model
from verify.exact import assert_bitexact

INTERPRETING = isinstance(nf4_gemv_kernel, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING,
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)
F32 = np.float32


# --- fma_float32: one rounding ------------------------------------------------------------------


def _round_fraction_f32(v: Fraction) -> np.float32:
    """The float32 nearest to the rational v (ties to even), by exact comparison with neighbours."""
    guess = F32(float(v))  # within one float32 of the answer (float() rounds once, the cast once more)
    cands = {guess, np.nextafter(guess, F32(np.inf)), np.nextafter(guess, F32(-np.inf))}
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.uint32)) & 1))
    if best == 0:
        return F32(0.0)  # an exact zero from nonzero terms of opposite signs is +0 (round to nearest)
    return best


def _fma_cases(rng, n):
    """Products that put a + b * c exactly on, just off, and far from float32 midpoints, and zeros."""
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(F32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(F32)
    p = a.astype(np.float64) * b
    # c near -p (cancellation), near p * 2**-24 (midpoints of the sum's last bit), or random
    kind = rng.integers(0, 3, n)
    c = np.where(kind == 0, -p * (1 + rng.integers(-4, 5, n) * 2.0**-24),
                 np.where(kind == 1, p * 2.0**-24 * rng.integers(-3, 4, n) / 2, rng.standard_normal(n)))
    return a, b, c.astype(F32)


def test_fma_float32_rounds_once():
    rng = np.random.default_rng(1)
    a, b, c = _fma_cases(rng, 3000)
    # signed zeros, subnormal results, and products that are float32 midpoints (1 + 2**-12)**2 =
    # 1 + 2**-11 + 2**-24 nudged by +-2**-60: the float64 sum rounds onto the midpoint, one rounding must not
    mid = 1 + 2.0**-12
    a = np.concatenate([a, F32([0.0, -0.0, 1.0, -1.0, 2.0**-149, 1.5, 2.0**-75, mid, mid, -mid * 4, mid / 8])])
    b = np.concatenate([b, F32([5.0, 5.0, -0.0, 0.0, 0.5, 1 + 2.0**-23, 2.0**-75, mid, mid, mid, -mid])])
    c = np.concatenate([c, F32([-0.0, -0.0, 0.0, -0.0, 0.0, -1.5, 0.0, 2.0**-60, -(2.0**-60), 2.0**-58, 2.0**-63])])
    got = fma_float32(a, b, c)
    want = np.array([_round_fraction_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     if not (x * y == 0 and z == 0) else F32(x) * F32(y) + F32(z)  # signed zeros: IEEE rules
                     for x, y, z in zip(a, b, c, strict=True)], dtype=F32)
    assert_bitexact(got, want, name="fma_float32 vs exact rational rounding")
    # the midpoint cases exist: rounding a float64 sum to float32 (two roundings) differs somewhere
    twice = (a.astype(np.float64) * b + c).astype(F32)
    assert (twice.view(np.uint32) != want.view(np.uint32)).any()


@needs_interpreter
def test_fma_float32_equals_the_interpreters_fma():
    from triton._C.libtriton import interpreter as triton_interpreter

    rng = np.random.default_rng(2)
    a, b, c = _fma_cases(rng, 200_000)
    assert_bitexact(fma_float32(a, b, c), triton_interpreter.fma_fp32(a, b, c), name="fma_float32 vs interpreter")


def test_model_rows_are_independent_of_the_program_shape():
    """np.sum over the contiguous last axis sums each output's own lanes: the model with all N rows in
    one array equals the model with the kernel's [BLOCK_M, BLOCK_R, HALF] arrays (several BLOCK_R)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 192)) * np.exp2(rng.integers(-8, 8, (3, 192)))).astype(np.float16).astype(F32)
    w = (rng.standard_normal((37, 192)) * np.exp2(rng.integers(-8, 8, (37, 192)))).astype(np.float16).astype(F32)
    b = rng.standard_normal(37).astype(np.float16).astype(F32)
    for half, seg in ((16, 96), (32, 32), (32, 64)):
        whole = gemv_model(x, w, half, seg, b, "float16")
        for block_r in (1, 8, 32, 64):
            assert_bitexact(gemv_model(x, w, half, seg, b, "float16", block_r=block_r), whole,
                            name=f"half={half} seg={seg} block_r={block_r}")


# --- the interpreter's GEMV against the model -----------------------------------------------------


def _model(lin, x, wd, bias, half, seg, dtype):
    return gemv_model(lin.np32(x), lin.np32(wd), half, seg, None if bias is None else lin.np32(bias),
                      lin.DT_NAME[dtype])


def _model_bits(y: np.ndarray) -> np.ndarray:
    return y.view(np.uint16)


# (blocksize, K): whole blocks per row
SHAPES = {32: 128, 64: 256, 128: 256, 256: 512}
STEPS = (16, 32, 64)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("blocksize", sorted(SHAPES))
def test_gemv_matches_model(nf4h, lin, blocksize, dtype):
    """M = 1..4 (split_k 1, 2, 3 and auto), step_bytes 16 / 32 / 64, with and without bias, random and
    cancelling x; N = 45 rows (two programs of 32, or six of 8). The model with another step size or
    without the split differs from the kernel somewhere (the check can fail)."""
    k = SHAPES[blocksize]
    w_dtype = (torch.float16, torch.bfloat16, torch.float32)[sorted(SHAPES).index(blocksize) % 3]
    seed = nf4h.case_seed("model", blocksize, dtype)
    packed, qs = nf4h.quantize((45, k), w_dtype, blocksize, blocksize != 128, seed=seed)
    w = NF4Weight.from_state(packed, qs)
    entry = linear_api.entry_of(packed, qs)
    wd = lin.operand(packed, qs, dtype)
    differs = 0
    for m, split_k in ((1, 1), (2, 2), (3, 3), (4, 0)):
        step = STEPS[(m + sorted(SHAPES).index(blocksize)) % len(STEPS)]
        config = LinearConfig(kernel="gemv", split_k=split_k, step_bytes=step, block_r=8 if m == 2 else 32)
        split, seg = linear_launch.split_k(config, w, m, torch.device("cpu"))
        half = min(blocksize // 2, step)
        assert seg % half == 0 and split == -(-(k // 2) // seg)
        random_x = lin.randn((m, k), dtype, seed + m)
        random_bias = lin.randn((45,), dtype, seed + 10 + m) if m % 2 else None
        cases = {"random": (random_x, random_bias), "cancelling": lin.cancelling(wd, m, dtype, seed + m)}
        for label, (x, bias) in cases.items():
            got = linear_api.run(x, packed, qs, entry, bias, config=config)
            want = _model(lin, x, wd, bias, half, seg, dtype)
            name = f"M={m} split={split} seg={seg} half={half} bias={bias is not None} {label}"
            assert_bitexact(lin.bits16(got), _model_bits(want), name=name)
            if label == "cancelling":
                for other_half, other_seg in ((half, k // 2), (half // 2, seg)):
                    if (other_half, other_seg) != (half, seg):
                        other = _model(lin, x, wd, bias, other_half, other_seg, dtype)
                        differs += int((_model_bits(other) != lin.bits16(got)).sum())
    assert differs > 0, "no output depends on the accumulation order: the model check would not see a wrong order"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_public_call_matches_model(nf4h, lin, dtype):
    """nf4.linear with the tuned table (the word GEMV up to 4 rows in the interpreter, as on a GPU where the
    tensor-core GEMV cannot run; split 1) and leading dimensions, with bias: the word model's bits; the GEMV's
    byte-order model differs from them somewhere (the check can fail)."""
    packed, qs = nf4h.quantize((45, 256), dtype, 64, True, seed=nf4h.case_seed("model-public", dtype))
    w = NF4Weight.from_state(packed, qs)
    wd = lin.operand(packed, qs, dtype)
    config = tuned("", 4)  # the row nf4.linear takes for M <= 4 in the interpreter
    assert config.kernel == "gemv_table"
    _, seg = linear_launch.split_k(config, w, 4, torch.device("cpu"))
    half = min(64 // 2, config.step_bytes)
    x, bias = lin.cancelling(wd, 4, dtype, 9)
    got = nf4.linear(x.reshape(2, 2, 256), packed, qs, bias=bias)
    assert tuple(got.shape) == (2, 2, 45)
    word = gemv_model(lin.np32(x), lin.np32(wd), half, seg, lin.np32(bias), lin.DT_NAME[dtype], word=4, lanes=4)
    assert_bitexact(lin.bits16(got.reshape(4, 45)), _model_bits(word))
    assert (_model_bits(_model(lin, x, wd, bias, half, seg, dtype)) != lin.bits16(got.reshape(4, 45))).any()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("blocksize", [32, 64, 128])
def test_table_gemv_matches_word_model(nf4h, lin, blocksize, dtype):
    """The word GEMV (kernel "gemv_table": nf4_gemv_table_kernel, interpreter fallback decode) against
    gemv_model(word=4) at M = 1..4, split 1 / 2 / 3, with and without bias, random and cancelling x; the per-byte model
    (word=1) differs from it somewhere, so the check can fail."""
    k = 4 * blocksize
    seed = nf4h.case_seed("model-table", blocksize, dtype)
    packed, qs = nf4h.quantize((45, k), dtype, blocksize, blocksize != 128, seed=seed)
    w = NF4Weight.from_state(packed, qs)
    entry = linear_api.entry_of(packed, qs)
    wd = lin.operand(packed, qs, dtype)
    differs = 0
    for m, split_k in ((1, 1), (2, 2), (3, 3), (4, 2)):
        config = LinearConfig(kernel="gemv_table", split_k=split_k, step_bytes=32, block_r=16)
        split, seg = linear_launch.split_k(config, w, m, torch.device("cpu"))
        half = min(blocksize // 2, 32)
        x0 = lin.randn((m, k), dtype, 0)
        assert linear_launch.launch_config(config, w, x0, m, False) is config  # the word GEMV runs, no fallback
        assert linear_launch.kernel_args(x0, w, None, None, m, config, False, True)[0][0] is nf4_gemv_table_kernel
        bias = lin.randn((45,), dtype, seed + 10 + m) if m % 2 else None
        cases = {"random": (lin.randn((m, k), dtype, seed + m), bias),
                 "cancelling": lin.cancelling(wd, m, dtype, seed + m)}
        for label, (x, b) in cases.items():
            got = linear_api.run(x, packed, qs, entry, b, config=config)
            want = gemv_model(lin.np32(x), lin.np32(wd), half, seg, None if b is None else lin.np32(b),
                              lin.DT_NAME[dtype], word=4, lanes=4)
            assert_bitexact(lin.bits16(got), _model_bits(want), name=f"M={m} split={split} {label}")
            if label == "cancelling":
                other = gemv_model(lin.np32(x), lin.np32(wd), half, seg, None if b is None else lin.np32(b),
                                   lin.DT_NAME[dtype], word=1)
                differs += int((_model_bits(other) != lin.bits16(got)).sum())
    assert differs > 0, "the word order and the byte order agree everywhere: the check would not see the order"
