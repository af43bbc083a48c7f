"""`nf4.linear` and `LinearConfig` reject bad input with a ValueError/TypeError that names the field and
what was expected, before anything is launched, and leave every input as it was."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4 import DequantConfig
from nf4.linear import LinearConfig
from nf4.linear.gemv import nf4_gemv_kernel
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_gemv_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

META = torch.device("meta")  # stands in for "another device" on a machine with only a CPU
N, K = 45, 128


@pytest.fixture
def case(nf4h):
    return nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("linear-errors"))


def _x(dtype=torch.bfloat16, shape=(3, K)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


# (id, builder(nf4h, packed, qs) -> (x, packed, qs, kwargs), exception, regex naming the field and the expectation)
def _kw(**kwargs):
    return lambda h, p, s: (_x(), p, s, kwargs)


def _x_is(x):
    return lambda h, p, s: (x() if callable(x) else x, p, s, {})


BAD = [
    ("x-list", _x_is([[0.0] * K]), TypeError, r"x must be a torch\.Tensor, got list"),
    ("x-ndarray", _x_is(lambda: _x().float().numpy()), TypeError, r"x must be a torch\.Tensor, got ndarray"),
    ("x-last-dim", _x_is(lambda: _x(shape=(3, K + 2))), ValueError,
     rf"x has shape \(3, {K + 2}\), expected \(\.\.\., {K}\).*in_features"),
    ("x-transposed", _x_is(lambda: _x(shape=(K, 3))), ValueError,
     rf"x has shape \({K}, 3\), expected \(\.\.\., {K}\)"),
    ("x-0d", _x_is(lambda: torch.tensor(1.0, dtype=torch.bfloat16)), ValueError,
     rf"x has shape \(\), expected \(\.\.\., {K}\)"),
    ("x-meta", _x_is(lambda: torch.empty(3, K, dtype=torch.bfloat16, device=META)), ValueError,
     r"x is on meta, expected cpu"),
    ("bias-shape", _kw(bias=torch.zeros(N + 1, dtype=torch.bfloat16)), ValueError,
     rf"bias has shape \({N + 1},\), expected \({N},\)"),
    ("bias-2d", _kw(bias=torch.zeros(1, N, dtype=torch.bfloat16)), ValueError, rf"bias has shape \(1, {N}\), expected"),
    ("bias-dtype", _kw(bias=torch.zeros(N, dtype=torch.float32)), TypeError,
     r"bias has dtype torch\.float32, expected torch\.bfloat16 like x"),
    ("bias-list", _kw(bias=[0.0] * N), TypeError, r"bias must be a torch\.Tensor or None, got list"),
    ("bias-meta", _kw(bias=torch.zeros(N, dtype=torch.bfloat16, device=META)), ValueError,
     r"bias is on meta, expected cpu"),
    ("config-str", _kw(config="gemv"), TypeError, r"config must be a nf4\.LinearConfig or None, got str 'gemv'"),
    ("config-dict", _kw(config={"kernel": "gemv"}), TypeError, r"config must be a nf4\.LinearConfig or None, got dict"),
    ("config-dequant", _kw(config=DequantConfig()), TypeError,
     r"config must be a nf4\.LinearConfig or None, got DequantConfig"),
    ("ftz-int", _kw(ftz=1), TypeError, r"ftz must be True, False or None.*int 1"),
    ("ftz-str", _kw(ftz="yes"), TypeError, r"ftz must be True, False or None.*str 'yes'"),
    ("qs-tensor", lambda h, p, s: (_x(), p, s.absmax, {}), TypeError,
     r"quant_state must be a bitsandbytes QuantState.*Tensor"),
    ("qs-dict", lambda h, p, s: (_x(), p, s.as_dict(), {}), TypeError,
     r"quant_state must be a bitsandbytes QuantState.*dict"),
    ("qs-list", lambda h, p, s: (_x(), p, [s], {}), TypeError, r"quant_state must be a bitsandbytes QuantState.*list"),
    ("qs-missing", lambda h, p, s: (_x(), p, None, {}), TypeError, r"quant_state is required"),
    ("qs-shape-1d", lambda h, p, s: (_x(), p, h.clone_state(s, shape=torch.Size([N * K])), {}), ValueError,
     rf"quant_state\.shape must be 2-D \(out_features, in_features\).*\({N * K},\)"),
    ("qs-shape-3d", lambda h, p, s: (_x(), p, h.clone_state(s, shape=torch.Size([N, 2, K // 2])), {}), ValueError,
     rf"quant_state\.shape must be 2-D.*\({N}, 2, {K // 2}\)"),
    ("qs-shape-bytes", lambda h, p, s: (_x(), p, h.clone_state(s, shape=torch.Size([N + 1, K])), {}), ValueError,
     r"packed.*bytes.*expected"),
    ("qs-fp4", lambda h, p, s: (_x(), p, h.clone_state(s, quant_type="fp4"), {}), ValueError,
     r"quant_type.*'nf4'.*'fp4'"),
    ("weight-list", lambda h, p, s: (_x(), [1, 2], s, {}), TypeError, r"weight must be a packed torch\.Tensor.*list"),
]


@pytest.mark.parametrize(("build", "exc", "pattern"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(nf4h, case, build, exc, pattern):
    packed, qs = case
    before = nf4h.snapshot(packed, qs)
    x, bad_packed, bad_qs, kwargs = build(nf4h, packed, qs)
    x_before = x.clone() if isinstance(x, torch.Tensor) and not x.is_meta else None
    with pytest.raises(exc, match=pattern):
        nf4.linear(x, bad_packed, bad_qs, **kwargs)
    nf4h.assert_unchanged(before, packed, qs)
    if x_before is not None:
        assert_bitexact(x, x_before, name="x after the failed call")


def test_bad_input_with_grad(nf4h, case):
    """The checks run before autograd records anything: the same errors with x.requires_grad."""
    packed, qs = case
    x = _x(shape=(3, K + 2)).requires_grad_()
    with pytest.raises(ValueError, match=rf"expected \(\.\.\., {K}\)"):
        nf4.linear(x, packed, qs)
    with pytest.raises(TypeError, match=r"bias has dtype"):
        nf4.linear(_x().requires_grad_(), packed, qs, bias=torch.zeros(N, dtype=torch.float16, requires_grad=True))


BAD_CONFIG = [
    ("kernel", {"kernel": "cublas"},
     r"LinearConfig\.kernel must be one of \('gemv', 'gemv_table', 'gemv_mma', 'gemm_word', 'gemv_pair', "
     r"'gemm_gluon', 'dequant'\), "
     r"got 'cublas'"),
    ("kernel-old-path", {"kernel": "word"}, r"LinearConfig\.kernel must be one of .*got 'word'"),
    # nf4_gemm_kernel left the product for experiments/variants/linear/_gemm_kernel.py
    ("kernel-gemm", {"kernel": "gemm"}, r"LinearConfig\.kernel must be one of .*got 'gemm'"),
    ("block_r", {"block_r": 24}, r"LinearConfig\.block_r must be a power of two, got 24"),
    ("block_r-0", {"block_r": 0}, r"LinearConfig\.block_r must be a power of two, got 0"),
    ("step_bytes", {"step_bytes": 48}, r"LinearConfig\.step_bytes must be a power of two, got 48"),
    ("step_bytes-small", {"step_bytes": 8},
     r"LinearConfig: step_bytes must be in 16\.\.1024 and block_r at most 1024, got 8, 32"),
    ("step_bytes-large", {"step_bytes": 2048}, r"step_bytes must be in 16\.\.1024 .*got 2048, 32"),
    ("block_r-large", {"block_r": 2048}, r"block_r at most 1024, got 32, 2048"),
    ("block_m", {"block_m": 96}, r"LinearConfig\.block_m must be a power of two, got 96"),
    ("block_n", {"block_n": 100}, r"LinearConfig\.block_n must be a power of two, got 100"),
    ("block_k", {"block_k": 3}, r"LinearConfig\.block_k must be a power of two, got 3"),
    ("group", {"group": 6}, r"LinearConfig\.group must be a power of two, got 6"),
    ("block_m-small", {"block_m": 8},
     r"LinearConfig: tl\.dot needs block_m and block_n in 16\.\.512 and block_k >= 32, got 8, 128, 128"),
    ("block_n-large", {"block_n": 1024}, r"block_m and block_n in 16\.\.512 .*got 64, 1024, 128"),
    ("block_k-small", {"block_k": 16}, r"block_k >= 32, got 64, 128, 16"),
    ("codebook", {"codebook": 4}, r"LinearConfig\.codebook must be 0, 1 or 2, got 4"),
    # the old codebook 3 (the product-table GEMVs) is a kernel now: kernel="gemv_table" / "gemv_mma" / "gemm_word"
    ("codebook-3", {"codebook": 3}, r"LinearConfig\.codebook must be 0, 1 or 2, got 3"),
    ("split_k", {"split_k": -1}, r"split_k must be >= 0.*got -1"),
    ("programs_per_sm", {"programs_per_sm": 0}, r"programs_per_sm >= 1.*0"),
    ("num_stages-0", {"num_stages": 0}, r"LinearConfig\.num_stages must be in 1\.\.8, got 0"),
    ("num_stages-9", {"num_stages": 9}, r"LinearConfig\.num_stages must be in 1\.\.8, got 9"),
    ("num_warps", {"num_warps": 3}, r"LinearConfig\.num_warps must be a power of two up to 16, got 3"),
    ("evict", {"evict": "evict_sometimes"},
     r"LinearConfig\.evict must be one of \('', 'evict_first', 'evict_last', 'evict_normal'\), got 'evict_sometimes'"),
    ("warps_k-3", {"kernel": "gemv_mma", "num_warps": 4, "block_r": 16, "warps_k": 3},
     r"LinearConfig\.warps_k must be a power of two, got 3"),
    ("warps_k-past-num_warps", {"kernel": "gemv_mma", "num_warps": 4, "block_r": 8, "warps_k": 8},
     r"LinearConfig\.warps_k must divide num_warps = 4, got 8"),
    ("warps_k-without-mma", {"warps_k": 2}, r"LinearConfig\.warps_k > 1 needs kernel='gemv_mma', got 'gemv'"),
    ("warps_k-word-gemv", {"kernel": "gemv_table", "warps_k": 2},
     r"LinearConfig\.warps_k > 1 needs kernel='gemv_mma', got 'gemv_table'"),
    ("warps_k-block_r", {"kernel": "gemv_mma", "num_warps": 4, "block_r": 64, "warps_k": 2},
     r"LinearConfig\.block_r must be 16 \* num_warps / warps_k = 32 with kernel='gemv_mma' .*got 64"),
    ("mma-block_r", {"kernel": "gemv_mma"},
     r"LinearConfig\.block_r must be 16 \* num_warps / warps_k = 64 with kernel='gemv_mma' .*got 32"),
    ("maxnreg-small", {"maxnreg": 8}, r"LinearConfig\.maxnreg must be in 16\.\.255 \(registers per thread\), got 8"),
    ("maxnreg-large", {"maxnreg": 256}, r"LinearConfig\.maxnreg must be in 16\.\.255 .*got 256"),
]

BAD_CONFIG_TYPES = [
    ("kernel-int", {"kernel": 1}, r"LinearConfig\.kernel must be str, got int 1"),
    ("split_k-float", {"split_k": 2.0}, r"LinearConfig\.split_k must be int, got float 2\.0"),
    ("num_warps-bool", {"num_warps": True}, r"LinearConfig\.num_warps must be int, got bool True"),
    ("swap-int", {"swap": 1}, r"LinearConfig\.swap must be bool, got int 1"),
    ("warps_k-float", {"warps_k": 2.0}, r"LinearConfig\.warps_k must be int, got float 2\.0"),
    ("block_r-bool", {"block_r": True}, r"LinearConfig\.block_r must be int, got bool True"),
    ("block_m-float", {"block_m": 64.0}, r"LinearConfig\.block_m must be int, got float 64\.0"),
    ("codebook-bool", {"codebook": False}, r"LinearConfig\.codebook must be int, got bool False"),
    ("evict-none", {"evict": None}, r"LinearConfig\.evict must be str, got NoneType None"),
    ("maxnreg-float", {"maxnreg": 64.0}, r"LinearConfig\.maxnreg must be int \| None, got float 64\.0"),
    ("maxnreg-bool", {"maxnreg": True}, r"LinearConfig\.maxnreg must be int \| None, got bool True"),
]


@pytest.mark.parametrize(("changes", "pattern"), [c[1:] for c in BAD_CONFIG_TYPES],
                         ids=[c[0] for c in BAD_CONFIG_TYPES])
def test_bad_linear_config_types(changes, pattern):
    with pytest.raises(TypeError, match=pattern):
        LinearConfig(**changes)


@pytest.mark.parametrize(("changes", "pattern"), [c[1:] for c in BAD_CONFIG], ids=[c[0] for c in BAD_CONFIG])
def test_bad_linear_config(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        LinearConfig(**changes)
    with pytest.raises(ValueError, match=pattern):
        LinearConfig().with_(**changes)


def test_linear_config_is_a_frozen_value():
    config = LinearConfig(kernel="gemm_word", swap=True)
    assert config == LinearConfig(kernel="gemm_word", swap=True)
    assert hash(config) == hash(LinearConfig(kernel="gemm_word", swap=True))
    assert config.with_(swap=False) == LinearConfig(kernel="gemm_word")
    assert config != LinearConfig(kernel="gemv", swap=True)
    with pytest.raises(AttributeError):
        config.kernel = "gemv"


@pytest.mark.parametrize("old", [{"path": "gemv"}, {"mma": True}, {"persistent": 1}], ids=["path", "mma", "persistent"])
def test_linear_config_has_no_path_or_mma(old):
    """The kernel's name replaced `path`, `mma` and codebook 3, and `persistent` left with the tl.dot kernel that
    read it (nf4_gemm_kernel, now experiments/variants/linear/_gemm_kernel.py's GemmConfig): the old fields are no
    keywords of the config."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
        LinearConfig(**old)
