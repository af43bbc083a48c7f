"""Helpers of the `nf4.linear` tests, reached through the `lin` fixture (beside the root's `nf4h`).

The operand check (docs/FORMAT.md §9): x made of rows of the identity, signed and scaled by powers
of two, picks single weights, so each output is `scale * w + 0.0` exactly; the expected value is
computed in float32 like the kernels' sum (the product of a 16-bit weight and a power of two is
rounded once there, only among float32 subnormals) and rounded once to x's dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import ClassVar

import numpy as np
import pytest
import torch

import nf4
from nf4.linear import LinearConfig

# Configs the interpreter tests run: small tiles so that N and K are several tiles and not multiples
# of them; every kernel the interpreter can run and every level lookup of the FMA GEMV (codebook 0 gather, 1
# select tree, 2 pair table) appears: the word GEMV ("gemv_table": where W's dtype is x's and M <= 4, else the
# codebook-0 GEMV of its shape) and the word tl.dot kernel ("gemm_word": where W's dtype is x's, else
# nf4.dequantize + cuBLAS, as on a GPU).
FORWARD = {
    "gemv": LinearConfig(kernel="gemv"),
    "gemv-s1": LinearConfig(kernel="gemv", split_k=1, block_r=16, step_bytes=16, codebook=0),
    "gemv-s2": LinearConfig(kernel="gemv", split_k=2, block_r=8, step_bytes=32, codebook=1),
    "gemv-s3": LinearConfig(kernel="gemv", split_k=3, step_bytes=16),
    "gemv-table": LinearConfig(kernel="gemv_table", split_k=2, block_r=16, step_bytes=32),
    # the word tl.dot kernel: split-K 2 through the ordered sum, unswapped, and steps of 32 weights split 3 ways
    "gemm-word": LinearConfig(kernel="gemm_word", block_m=16, block_n=32, block_k=64, swap=True, split_k=2),
    "gemm-word-plain": LinearConfig(kernel="gemm_word", block_m=16, block_n=16, block_k=64, split_k=1),
    "gemm-word-k32": LinearConfig(kernel="gemm_word", block_m=32, block_n=16, block_k=32, swap=True, split_k=3,
                                  group=1),
    "tuned": None,  # the interpreter's rows: the word GEMV for M <= 4, the word tl.dot kernel above
}
# The backward (dY @ W) is nf4.dequantize + cuBLAS whatever the config (nf4.linear.launch.launch_config): the
# table's row, and fused configs given to it.
BACKWARD = {
    "tuned": None,
    "gemv": LinearConfig(kernel="gemv"),
    "gemm-word": LinearConfig(kernel="gemm_word", block_m=16, block_n=32, block_k=64, swap=True),
}

class LinearTestHelpers:
    """Helpers of the nf4.linear tests (a class, so its names cannot clash with other helpers)."""

    DT_NAME: ClassVar[dict] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    DT_SHORT: ClassVar[dict] = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    FORWARD = FORWARD
    BACKWARD = BACKWARD

    @staticmethod
    def operand(packed, qs, dtype: torch.dtype, *, ftz: bool | None = None) -> torch.Tensor:
        """The operand the fused linear must multiply by: `nf4.dequantize(W).to(dtype)`."""
        return nf4.dequantize(packed, qs, ftz=ftz).to(dtype)

    @staticmethod
    def identity_rows(cols, dtype: torch.dtype, width: int, seed: int, *, signed: bool = True, device="cpu"):
        """(x, scales): x[i] = scales[i] * e_{cols[i]} of `width` columns in `dtype`; scales are
        +-2**e (e in -2..2) when `signed`, else 1, with row 0 always plain 1.0."""
        cols = torch.as_tensor(cols, dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        m = cols.numel()
        scales = torch.ones(m, dtype=torch.float32)
        if signed:
            sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
            scales = sign * torch.exp2(torch.randint(-2, 3, (m,), generator=g).float())
            if m:
                scales[0] = 1.0
        x = torch.zeros(m, width, dtype=dtype)
        x[torch.arange(m), cols] = scales.to(dtype)
        return x.to(device), scales.to(device)

    @staticmethod
    def picked(wmat: torch.Tensor, cols, scales, dtype: torch.dtype) -> torch.Tensor:
        """The exact result of identity rows against `wmat` ([rows picked, ...]): scale * wmat[col] + 0.0,
        in float32 like the kernels, rounded once to `dtype` (the + 0.0: +0 + -0 is +0)."""
        cols = torch.as_tensor(cols, dtype=torch.int64, device=wmat.device)
        return (scales[:, None].float() * wmat.float()[cols] + 0.0).to(dtype)

    @staticmethod
    @contextlib.contextmanager
    def ieee_dense():
        """The dequant path's dense product (the backward's, and the forward's fallback) as IEEE arithmetic on the
        CPU: oneDNN's bfloat16 matmul there flushes subnormal results to zero (cuBLAS on a GPU does not), so the
        operand checks that reach bfloat16 subnormals run it with oneDNN off (torch's own CPU gemm)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            with torch.backends.mkldnn.flags(enabled=False):
                yield

    STATE_CHANGES = ("absmax", "state2.absmax", "dtype", "offset", "state2.code")

    @staticmethod
    def replace_in_state(qs, change: str) -> None:
        """Replace one of a QuantState's attributes (STATE_CHANGES) by another tensor or dtype, as a caller that
        edits its state between calls does: every one changes the decoded weight."""
        if change == "absmax":
            qs.absmax = torch.roll(qs.absmax, 1).contiguous()
        elif change == "state2.absmax":
            qs.state2.absmax = qs.state2.absmax * 2
        elif change == "dtype":
            qs.dtype = torch.float16
        elif change == "offset":
            qs.offset = qs.offset + 0.5
        elif change == "state2.code":
            qs.state2.code = qs.state2.code.flip(0).contiguous()
        else:
            raise ValueError(f"change must be one of {LinearTestHelpers.STATE_CHANGES}, got {change!r}")

    @staticmethod
    def columns(n: int, count: int, seed: int) -> torch.Tensor:
        """`count` random columns of n (with repeats), from a seeded generator."""
        return torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def permutation(n: int, seed: int) -> torch.Tensor:
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def randn(shape, dtype: torch.dtype, seed: int, *, scale: float = 1.0, device="cpu") -> torch.Tensor:
        """Normal values spread over a few octaves, rounded to dtype."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float()) * scale
        return x.to(dtype).to(device)

    @classmethod
    def cancelling(cls, wd: torch.Tensor, m: int, dtype: torch.dtype, seed: int):
        """(x, bias) whose outputs are small rests of large float32 sums: x is small except column a,
        L (a power of two) in every row, and bias = -L * W[:, a] exactly in x's dtype, so the exact
        output is the small terms' sum while the float32 accumulator held L * W[n, a] (its rounding
        is what shows: the order of the sum, and the accumulation term of the bound, matter there)."""
        g = torch.Generator().manual_seed(seed)
        k = wd.shape[1]
        a = int(torch.randint(0, k, (1,), generator=g))
        top = wd[:, a].float().abs().max().item() or 1.0
        if dtype == torch.bfloat16:
            big, small = 2.0**20, 1.0
        else:  # float16: L * W must stay finite
            big, small = min(2.0**8, 2.0 ** np.floor(np.log2(30000.0 / top))), 2.0**-8
        x = cls.randn((m, k), torch.float32, seed, scale=small).to(dtype)
        x[:, a] = big
        bias = (-big * wd[:, a].float()).to(dtype)
        assert torch.equal(bias.float(), -big * wd[:, a].float()), "bias must cancel L * W[:, a] exactly"
        return x, bias

    @classmethod
    def np64(cls, t: torch.Tensor) -> np.ndarray:
        """A tensor's values as a float64 NumPy array (exact for every float dtype)."""
        return t.detach().to("cpu", torch.float64).numpy()

    @classmethod
    def np32(cls, t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).numpy()

    @staticmethod
    def bits16(t: torch.Tensor) -> np.ndarray:
        """A 16-bit tensor's bit patterns as uint16."""
        return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.fixture
def lin():
    """The nf4.linear tests' helpers (LinearTestHelpers)."""
    return LinearTestHelpers


# The interpreter's longest cases (tens of seconds each on a 2-core machine): `make test-long` runs them (CI runs
# both targets). Every kernel path stays in `make test` through the same tests' other cases (the table GEMV's
# operand at blocksize 64 and its model at 32, flush-to-zero through test_api.py's ftz case and the dequantize
# tests, and the sum bound).
SLOW = {
    "test_operand.py::test_forward_operand[gemv-table-32]",
    "test_operand.py::test_forward_operand[gemv-table-128]",
    "test_operand.py::test_forward_operand[gemv-table-256]",
    "test_operand.py::test_ftz_flushes_subnormal_weights",
    "test_operand.py::test_subnormal_weights_ieee[gemv-table-False]",
    "test_model.py::test_table_gemv_matches_word_model[64-bf16]",
    "test_model.py::test_table_gemv_matches_word_model[64-fp16]",
    "test_model.py::test_table_gemv_matches_word_model[128-bf16]",
    "test_model.py::test_table_gemv_matches_word_model[128-fp16]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
