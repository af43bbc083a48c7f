"""The sum check of `nf4.linear` in Triton's interpreter (docs/FORMAT.md §9).

Against the float64 product of the exact operand (`reference.linear.linear_float64`), every output
of a float32 accumulation rounded once to x's dtype lies within `reference.linear.accumulation_bound`:
the worst ratio of error to bound must be <= 1 for the GEMV (split or not), the word GEMV, the word tl.dot
kernel (swapped and not), the tuned rows, the bias, and the backward (autograd's x.grad against dY @ W in
float64: nf4.dequantize + the dense product). The same statistic for torch's dense matmul on the dequantized
weight (CPU here) is
computed on the same inputs and reported beside it (record_property, and printed with -s), not
asserted: the bound is a property of float32 accumulation, which the CPU's half-precision matmul
need not use. Inputs: random x over a few octaves, and a cancelling x whose outputs are small rests
of large terms (where the accumulation term of the bound, not the final rounding, dominates).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.linear import LinearConfig
from nf4.linear.gemv import nf4_gemv_kernel
from reference.linear import accumulation_bound, linear_float64, worst_ratio
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_gemv_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

CONFIGS = {
    "gemv": (3, LinearConfig(kernel="gemv")),
    "gemv-split3": (4, LinearConfig(kernel="gemv", split_k=3, step_bytes=16)),
    "gemv-table": (4, LinearConfig(kernel="gemv_table", block_r=16, split_k=2)),
    "gemm-word-plain": (40, LinearConfig(kernel="gemm_word", block_m=16, block_n=32, block_k=64)),
    "gemm-word": (37, LinearConfig(kernel="gemm_word", block_m=16, block_n=32, block_k=64, swap=True, split_k=3)),
    "tuned-small": (2, None),
    "tuned": (33, None),
}
N, K = 77, 256


def _report(record_property, name, ours, dense):
    record_property(f"{name}_nf4_ratio", ours)
    record_property(f"{name}_dense_ratio", dense)
    print(f"\n{name}: worst ratio to the float32 bound: nf4.linear {ours:.3g}, torch dense {dense:.3g}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_forward_within_bound(nf4h, lin, record_property, config_name, dtype):
    m, config = CONFIGS[config_name]
    seed = nf4h.case_seed("sum", config_name, dtype)
    w_dtype = (torch.float16, torch.bfloat16, torch.float32)[list(CONFIGS).index(config_name) % 3]
    if config_name != "gemv" and config_name != "gemv-split3":
        w_dtype = dtype  # the word kernels (and the tuned rows) take W of x's dtype
    packed, qs = nf4h.quantize((N, K), w_dtype, 64, True, seed=seed)
    wd = lin.operand(packed, qs, dtype)
    x = lin.randn((m, K), dtype, seed)
    cases = {"random": (x, None), "random-bias": (x, lin.randn((N,), dtype, seed + 1)),
             "cancelling": lin.cancelling(wd, m, dtype, seed + 2)}
    for label, (x, b) in cases.items():
        y = nf4.linear(x, packed, qs, bias=b, config=config)
        bias64 = None if b is None else lin.np64(b)
        ours = worst_ratio(lin.np64(y), lin.np64(x), lin.np64(wd), dtype, bias64)
        dense = worst_ratio(lin.np64(torch.nn.functional.linear(x, wd, b)), lin.np64(x), lin.np64(wd), dtype, bias64)
        name = f"{config_name}-{lin.DT_SHORT[dtype]}-{label}"
        _report(record_property, name, ours, dense)
        assert ours <= 1.0, f"{name}: worst ratio {ours} exceeds the float32 accumulation bound"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [3, 24])
def test_backward_within_bound(nf4h, lin, record_property, m, dtype):
    """autograd's x.grad (the backward: nf4.dequantize + the dense product, oneDNN off on the CPU as in
    lin.ieee_dense) against float64 dY @ W; bias.grad is dY summed exactly."""
    seed = nf4h.case_seed("sum-backward", m, dtype)
    packed, qs = nf4h.quantize((N, K), dtype, 128, False, seed=seed)
    wd = lin.operand(packed, qs, dtype)
    x = lin.randn((m, K), dtype, seed).requires_grad_()
    bias = lin.randn((N,), dtype, seed + 1).requires_grad_()
    dy = lin.randn((m, N), dtype, seed + 2)
    with lin.ieee_dense():
        nf4.linear(x, packed, qs, bias=bias).backward(dy)
        dense = worst_ratio(lin.np64(dy @ wd), lin.np64(dy), lin.np64(wd.t()), dtype)
    wt = lin.np64(wd.t())  # dY @ W = dY @ (W^T)^T
    ours = worst_ratio(lin.np64(x.grad), lin.np64(dy), wt, dtype)
    _report(record_property, f"backward-autograd-M{m}-{lin.DT_SHORT[dtype]}", ours, dense)
    assert ours <= 1.0
    assert_bitexact(bias.grad, dy.sum(0), name="bias.grad")


def test_bound_and_ratio_are_what_they_say():
    """The bound's terms on a hand-checked case, and worst_ratio's answers for exact, rounded, off-bound,
    empty and non-finite outputs."""
    x = np.array([[1.0, 2.0]])
    w = np.array([[3.0, -1.0], [0.5, 0.25]])
    assert linear_float64(x, w).tolist() == [[1.0, 1.0]]
    bound = accumulation_bound(x, w, "bfloat16")
    # K = 2 terms: 2 * 2**-24 * sum|x w| * (1 + 2**-8) + 2**-8 * |exact| + 2**-134
    want = (1 + 2.0**-8) * 2 * 2.0**-24 * np.array([5.0, 1.0]) + 2.0**-8 * 1.0 + 2.0**-134
    assert np.allclose(bound, want[None, :], rtol=1e-15, atol=0)
    assert worst_ratio(np.array([[1.0, 1.0]]), x, w, "float16") == 0.0
    assert worst_ratio(np.array([[1.0 + 2.0**-8, 1.0]]), x, w, "bfloat16") <= 1.0  # one bf16 rounding
    assert worst_ratio(np.array([[1.0 + 2.0**-6, 1.0]]), x, w, "bfloat16") > 1.0
    assert worst_ratio(np.array([[np.nan, 1.0]]), x, w, "bfloat16") == float("inf")
    assert worst_ratio(np.zeros((0, 2)), np.zeros((0, 2)), w, "float32") == 0.0
    # a bfloat16 output given as its bits
    assert worst_ratio(np.array([[0x3F80, 0x3F80]], dtype=np.uint16), x, w, torch.bfloat16) == 0.0
