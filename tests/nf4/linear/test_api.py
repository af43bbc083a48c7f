"""The contract of `nf4.linear` around its kernels (CPU tensors, Triton's interpreter).

Autograd in x and bias (x.grad checked operand-exact through identity rows of dY, bias.grad the exact
sum of dY over the leading dimensions), leading dimensions, every call form (Linear4bit, Params4bit,
packed + QuantState), the fallbacks (float32 x, a K that is not a multiple of the blocksize) equal to
`F.linear(x, nf4.dequantize(W).to(x.dtype), bias)` bit for bit, strided and misaligned x, inputs
never modified, empty x, a QuantState changed between calls, and `nf4.linear` staying the function
after its package's modules are imported.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.linear import LinearConfig
from nf4.linear.gemv import nf4_gemv_kernel
from nf4.weight import NF4Weight
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_gemv_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

ROOT = Path(__file__).resolve().parents[3]
N, K = 45, 128
CONFIGS = {"tuned": None, "gemv": LinearConfig(kernel="gemv", split_k=2, step_bytes=16),
           "gemm-word": LinearConfig(kernel="gemm_word", block_m=16, block_n=32, block_k=64, swap=True)}
# presets that nf4.linear.tuned no longer names (no table row used them), with the fields they had
GEMV_MMA = LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, step_bytes=32, programs_per_sm=12)
GEMV_MMA8 = LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, step_bytes=16, programs_per_sm=7)


@pytest.fixture
def case(nf4h):
    """A fresh double-quantized bfloat16 weight (N, K), blocksize 64: nothing is shared between tests."""
    return nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("linear-api"))


# --- autograd ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_autograd_x_and_bias(lin, case, config_name):
    packed, qs = case
    wd = lin.operand(packed, qs, torch.bfloat16)
    x = lin.randn((2, 3, K), torch.bfloat16, 1).requires_grad_()
    bias = lin.randn((N,), torch.bfloat16, 2).requires_grad_()
    y = nf4.linear(x, packed, qs, bias=bias, config=CONFIGS[config_name])
    assert y.requires_grad and tuple(y.shape) == (2, 3, N) and y.dtype == torch.bfloat16
    # identity rows of dY (signed, scaled) pick rows of W: x.grad is operand-exact
    rows = lin.columns(N, 6, 3)
    dy, scales = lin.identity_rows(rows, torch.bfloat16, N, 4)
    y.backward(dy.reshape(2, 3, N))
    assert x.grad is not None and bias.grad is not None
    assert x.grad.dtype == torch.bfloat16 and tuple(x.grad.shape) == (2, 3, K)
    assert_bitexact(x.grad.reshape(6, K), lin.picked(wd, rows, scales, torch.bfloat16), name="x.grad")
    assert_bitexact(bias.grad, dy.sum(0), name="bias.grad")
    # random dY: bias.grad is dY summed over every leading dimension, in dY's dtype, exactly
    x.grad = bias.grad = None
    y = nf4.linear(x, packed, qs, bias=bias, config=CONFIGS[config_name])
    dy = lin.randn((2, 3, N), torch.bfloat16, 5)
    y.backward(dy)
    assert_bitexact(bias.grad, dy.reshape(-1, N).sum(0), name="bias.grad, random dY")
    assert bias.grad.dtype == torch.bfloat16


def test_autograd_one_input_at_a_time(lin, case):
    packed, qs = case
    x = lin.randn((3, K), torch.float16, 1)
    bias = lin.randn((N,), torch.float16, 2).requires_grad_()
    nf4.linear(x, packed, qs, bias=bias).sum().backward()  # sum(): an expanded, stride-0 dY
    assert x.grad is None
    assert_bitexact(bias.grad, torch.full((N,), 3.0, dtype=torch.float16), name="bias.grad of a sum")
    x.requires_grad_()
    y = nf4.linear(x, packed, qs, bias=bias.detach())
    y.sum().backward()
    want = torch.ones(3, N, dtype=torch.float16) @ lin.operand(packed, qs, torch.float16)
    assert x.grad is not None and tuple(x.grad.shape) == (3, K)
    # every output is a float32 sum of N products; compare to the same grad made explicit
    x2 = x.detach().clone().requires_grad_()
    nf4.linear(x2, packed, qs).backward(torch.ones(3, N, dtype=torch.float16))
    assert_bitexact(x.grad, x2.grad, name="x.grad of a sum vs explicit ones")
    assert torch.allclose(x.grad.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_no_graph_without_grad(lin, case):
    packed, qs = case
    x = lin.randn((3, K), torch.bfloat16, 1).requires_grad_()
    with torch.no_grad():
        y = nf4.linear(x, packed, qs)
    assert not y.requires_grad and y.grad_fn is None


# --- shapes and layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_leading_dimensions(lin, case, config_name):
    packed, qs = case
    config = CONFIGS[config_name]
    wd = lin.operand(packed, qs, torch.bfloat16)
    cols = lin.columns(K, 6, 11)
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 12)
    y = nf4.linear(x.reshape(2, 3, K), packed, qs, config=config)
    assert tuple(y.shape) == (2, 3, N)
    assert_bitexact(y.reshape(6, N), lin.picked(wd.t(), cols, scales, torch.bfloat16), name="(2, 3, K)")
    xr = lin.randn((2, 3, K), torch.bfloat16, 13)
    flat = nf4.linear(xr.reshape(6, K), packed, qs, config=config)
    assert_bitexact(nf4.linear(xr, packed, qs, config=config), flat.reshape(2, 3, N), name="(2, 3, K) vs (6, K)")
    assert_bitexact(nf4.linear(xr.reshape(1, 2, 1, 3, K), packed, qs, config=config), flat.reshape(1, 2, 1, 3, N))
    assert_bitexact(nf4.linear(xr[0, 0], packed, qs, config=config), flat[0], name="1-D x")


def test_strided_and_misaligned_x(lin, case):
    """A transposed view, a column slice, and x one element into its storage (not 4-byte aligned)."""
    packed, qs = case
    xr = lin.randn((5, K), torch.float16, 21)
    want = nf4.linear(xr, packed, qs)
    assert_bitexact(nf4.linear(xr.t().contiguous().t(), packed, qs), want, name="transposed view")
    wide = torch.cat([xr, xr], dim=1)
    assert_bitexact(nf4.linear(wide[:, K:], packed, qs), want, name="column slice")
    buf = torch.empty(5 * K + 1, dtype=torch.float16)
    shifted = buf[1:].view(5, K)
    shifted.copy_(xr)
    assert shifted.data_ptr() % 4
    assert_bitexact(nf4.linear(shifted, packed, qs), want, name="misaligned x")
    bias = lin.randn((2 * N,), torch.float16, 22)[::2]
    assert not bias.is_contiguous()
    assert_bitexact(nf4.linear(xr, packed, qs, bias=bias), nf4.linear(xr, packed, qs, bias=bias.contiguous()),
                    name="strided bias")


@pytest.mark.parametrize("shape", [(0, K), (2, 0, K)], ids=["0xK", "2x0xK"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_empty_x(case, shape, dtype):
    packed, qs = case
    x = torch.empty(shape, dtype=dtype, requires_grad=True)
    bias = torch.zeros(N, dtype=dtype, requires_grad=True)
    y = nf4.linear(x, packed, qs, bias=bias)
    assert tuple(y.shape) == (*shape[:-1], N) and y.dtype == dtype
    y.sum().backward()
    assert tuple(x.grad.shape) == shape
    assert_bitexact(bias.grad, torch.zeros(N, dtype=dtype))
    with torch.no_grad():
        assert tuple(nf4.linear(x, packed, qs).shape) == (*shape[:-1], N)


# --- call forms -----------------------------------------------------------------------------------


def _linear4bit(nf4h, in_features, out_features, seed, *, bias_dtype, quant_storage=torch.uint8, blocksize=64):
    """A bitsandbytes Linear4bit quantized on the CPU (as tests/nf4/dequant do), bias in bias_dtype."""
    bnb = pytest.importorskip("bitsandbytes")
    try:
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=True, compress_statistics=True, quant_type="nf4",
                                  quant_storage=quant_storage)
        data = nf4h.make_weight((out_features, in_features), torch.float32, seed)
        layer.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                         quant_storage=quant_storage, blocksize=blocksize)._quantize("cpu")
    except (RuntimeError, NotImplementedError, AttributeError) as exc:  # a build without CPU quantization
        pytest.skip(f"bitsandbytes cannot build a Linear4bit on the CPU here: {exc}")
    layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=torch.Generator().manual_seed(seed))
                                    .to(bias_dtype))
    assert layer.weight.bnb_quantized and layer.weight.dtype == quant_storage
    return layer


@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16], ids=str)
def test_linear4bit_and_params4bit(nf4h, lin, quant_storage):
    layer = _linear4bit(nf4h, K, N, nf4h.case_seed("l4b", quant_storage), bias_dtype=torch.bfloat16,
                        quant_storage=quant_storage)
    w, qs = layer.weight, layer.weight.quant_state
    wd = lin.operand(w.data, qs, torch.bfloat16)
    cols = lin.columns(K, 3, 31)
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 32)
    # the module brings its bias: scale * w + bias, one float32 addition, rounded once
    want = (lin.picked(wd.t(), cols, scales, torch.float32) + layer.bias.detach().float()).to(torch.bfloat16)
    assert_bitexact(nf4.linear(x, layer), want, name="Linear4bit (its bias)")
    assert_bitexact(nf4.linear(x, w, bias=layer.bias), want, name="Params4bit + bias")
    assert_bitexact(nf4.linear(x, w.data, qs, bias=layer.bias), want, name="packed + QuantState + bias")
    assert_bitexact(nf4.linear(x, w), lin.picked(wd.t(), cols, scales, torch.bfloat16), name="Params4bit, no bias")
    assert_bitexact(nf4.linear(x, layer, bias=layer.bias * 0), lin.picked(wd.t(), cols, scales, torch.bfloat16),
                    name="Linear4bit with an explicit bias")
    # autograd through the module form: x.grad and the module's bias.grad
    xr = lin.randn((4, K), torch.bfloat16, 33).requires_grad_()
    nf4.linear(xr, layer).backward(lin.randn((4, N), torch.bfloat16, 34))
    assert xr.grad is not None and layer.bias.grad is not None


def test_linear4bit_float32_bias(nf4h, lin):
    """A Linear4bit whose bias stayed float32 (its default) with bfloat16 x: the bias is cast to x's dtype
    first, as Linear4bit.forward does, and the result equals the bfloat16-bias one bit for bit."""
    layer = _linear4bit(nf4h, K, N, nf4h.case_seed("l4b-f32-bias"), bias_dtype=torch.float32)
    x = lin.randn((3, K), torch.bfloat16, 35)
    want = nf4.linear(x, layer.weight, bias=layer.bias.detach().to(torch.bfloat16))
    assert_bitexact(nf4.linear(x, layer), want, name="float32 bias cast to bfloat16")
    assert layer.bias.dtype == torch.float32  # the module's bias is not modified


def test_ftz_numpy_bool(nf4h, lin):
    """ftz accepts NumPy booleans like nf4.dequantize does."""
    layer = _linear4bit(nf4h, K, N, nf4h.case_seed("l4b-np-ftz"), bias_dtype=torch.bfloat16)
    x = lin.randn((2, K), torch.bfloat16, 36)
    assert_bitexact(nf4.linear(x, layer.weight, ftz=np.False_), nf4.linear(x, layer.weight, ftz=False))
    assert_bitexact(nf4.linear(x, layer.weight, ftz=np.True_), nf4.linear(x, layer.weight, ftz=True))


# --- fallbacks ------------------------------------------------------------------------------------


def _fallback_cases(nf4h):
    """(name, packed, qs, x dtype): float32 x on a fused weight, and weights whose K is not a multiple of
    the blocksize (blocks straddle rows; an odd K; a K smaller than one block)."""
    fused = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("fb-fused"))
    return [
        ("fp32-x", *fused, torch.float32),
        ("K=100-bs64", *nf4h.quantize((7, 100), torch.float16, 64, True, seed=nf4h.case_seed("fb-100")), torch.float16),
        ("K=99-bs32", *nf4h.quantize((5, 99), torch.bfloat16, 32, False, seed=nf4h.case_seed("fb-99")), torch.bfloat16),
        ("K=40-bs64", *nf4h.quantize((3, 40), torch.float32, 64, True, seed=nf4h.case_seed("fb-40")), torch.bfloat16),
    ]


def test_fallbacks_equal_f_linear(nf4h, lin):
    for name, packed, qs, dtype in _fallback_cases(nf4h):
        k = qs.shape[1]
        wd = nf4.dequantize(packed, qs).to(dtype)
        x = lin.randn((2, 3, k), dtype, 41)
        bias = lin.randn((qs.shape[0],), dtype, 42)
        assert_bitexact(nf4.linear(x, packed, qs, bias=bias), F.linear(x, wd, bias), name=f"{name} with bias")
        assert_bitexact(nf4.linear(x, packed, qs), F.linear(x, wd), name=f"{name} without bias")


def test_fallback_backward_16_bit(nf4h, lin):
    """A weight the kernels cannot take (K % blocksize != 0): x.grad = dY @ nf4.dequantize(W).to(x.dtype)."""
    for name, packed, qs, dtype in _fallback_cases(nf4h)[1:]:
        n, k = qs.shape
        x = lin.randn((3, k), dtype, 43).requires_grad_()
        dy = lin.randn((3, n), dtype, 44)
        nf4.linear(x, packed, qs).backward(dy)
        assert_bitexact(x.grad, dy @ nf4.dequantize(packed, qs).to(dtype), name=name)


def test_fallback_backward_float32(nf4h, lin):
    """float32 x (forward: F.linear in float32): x.grad = dY @ nf4.dequantize(W).float(), float32 throughout."""
    _, packed, qs, _ = _fallback_cases(nf4h)[0]
    x = lin.randn((3, K), torch.float32, 45).requires_grad_()
    dy = lin.randn((3, N), torch.float32, 46)
    nf4.linear(x, packed, qs).backward(dy)
    assert x.grad.dtype == torch.float32
    assert_bitexact(x.grad, dy @ nf4.dequantize(packed, qs).float(), name="float32 x.grad")


# --- inputs never modified ------------------------------------------------------------------------


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_inputs_unchanged(nf4h, lin, double_quant, config_name):
    packed, qs = nf4h.quantize((N, K), torch.float16, 64, double_quant, quant_storage=torch.bfloat16,
                               seed=nf4h.case_seed("unchanged", double_quant, config_name))
    before = nf4h.snapshot(packed, qs)
    x = lin.randn((3, K), torch.float16, 51).requires_grad_()
    bias = lin.randn((N,), torch.float16, 52).requires_grad_()
    dy = lin.randn((3, N), torch.float16, 53)
    x0, bias0, dy0 = x.detach().clone(), bias.detach().clone(), dy.clone()
    nf4.linear(x, packed, qs, bias=bias, config=CONFIGS[config_name]).backward(dy)
    with torch.no_grad():
        nf4.linear(x.float(), packed, qs, bias=bias.float())  # the float32 fallback too
    nf4h.assert_unchanged(before, packed, qs)
    assert_bitexact(x.detach(), x0, name="x after the call")
    assert_bitexact(bias.detach(), bias0, name="bias after the call")
    assert_bitexact(dy, dy0, name="dY after the backward")


# --- a QuantState changed between calls -----------------------------------------------------------



@pytest.mark.parametrize("change", ["absmax", "state2.absmax", "dtype", "offset", "state2.code"])  # lin.STATE_CHANGES
def test_quant_state_replaced_between_calls(nf4h, lin, change):
    """After a call, one of the QuantState's attributes is replaced by another tensor (or dtype): the
    next call decodes what the state holds now, like nf4.dequantize."""
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("stale", change))
    cols = lin.permutation(K, 61)
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 62)
    nf4.linear(x, packed, qs)
    nf4.linear(x, packed, qs)  # a second call: whatever is remembered for this state is in place
    lin.replace_in_state(qs, change)
    wd = lin.operand(packed, qs, torch.bfloat16)
    assert_bitexact(nf4.linear(x, packed, qs), lin.picked(wd.t(), cols, scales, torch.bfloat16),
                    name=f"after replacing {change}")


def test_bytes_changed_in_place_are_read(nf4h, lin, case):
    packed, qs = case
    cols = lin.permutation(K, 63)
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 64)
    nf4.linear(x, packed, qs)
    packed.copy_(torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(6)))
    qs.absmax.copy_(torch.roll(qs.absmax, 3))
    wd = lin.operand(packed, qs, torch.bfloat16)
    assert_bitexact(nf4.linear(x, packed, qs), lin.picked(wd.t(), cols, scales, torch.bfloat16))


# --- the name ---------------------------------------------------------------------------------------


def test_linear_is_the_function_after_importing_its_modules():
    """`nf4.linear` (the function) shadows the package on the nf4 namespace; importing the package's
    modules, in either order and before or after `import nf4`, must not rebind it."""
    for prelude in ("import nf4; import nf4.linear.api; import nf4.linear.config; import nf4.linear.gemv; "
                    "import nf4.linear.launch; import nf4.linear.ops",
                    "import nf4.linear.tuned; import nf4.linear.config; import nf4.linear.api; import nf4",
                    "from nf4.linear import api, config, launch; import nf4; from nf4.linear.api import run",
                    "import importlib, nf4; importlib.import_module('nf4.linear.api')"):
        code = (f"{prelude}\nimport nf4 as m\nassert callable(m.linear), m.linear\n"
                "assert m.linear.__module__ == 'nf4.linear.api', m.linear.__module__\n"
                "assert m.linear is __import__('sys').modules['nf4.linear.api'].linear\nprint('ok')")
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (prelude, result.stderr[-2000:])
    assert callable(nf4.linear) and nf4.linear.__module__ == "nf4.linear.api"


# --- torch.compile in the interpreter ----------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 33], ids=["gemv", "gemm-word"])
def test_torch_compile_fullgraph_cpu(lin, case, m):
    """torch.compile(fullgraph=True, backend="aot_eager") of a function calling nf4.linear: the eager bits (in the
    interpreter the triton_op takes the opaque nf4::linear_opaque, which launches as eager does)."""
    packed, qs = case
    bias = lin.randn((N,), torch.bfloat16, 71)

    def fn(x):
        return nf4.linear(x, packed, qs, bias=bias)

    torch._dynamo.reset()
    try:
        x = lin.randn((m, K), torch.bfloat16, 72)
        assert_bitexact(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x), name="compiled vs eager")
    finally:
        torch._dynamo.reset()


def test_tensor_core_rows_fall_back_to_dequantize_and_cublas(nf4h, lin):
    """A tuned tensor-core row for M > 4 that cannot run (here: no GPU) runs nf4.dequantize + F.linear, as the
    table did before at those M: the same bits as that product, bias included."""
    from nf4.linear.tuned import GEMV_MMA16, GEMV_MMA32, GEMV_MMA_WK16

    packed, qs = nf4h.quantize((40, 128), torch.bfloat16, 64, True, seed=nf4h.case_seed("mma-dequant-fallback"))
    bias = lin.randn((40,), torch.bfloat16, 3)
    wt = nf4.dequantize(packed, qs).to(torch.bfloat16)
    for m, config in ((5, GEMV_MMA_WK16), (8, GEMV_MMA_WK16), (13, GEMV_MMA16), (32, GEMV_MMA32)):
        x = lin.randn((m, 128), torch.bfloat16, m)
        y = nf4.linear(x, packed, qs, bias=bias, config=config)
        assert_bitexact(y, torch.nn.functional.linear(x, wt, bias), name=f"M = {m}")


def test_launch_config_falls_back_where_the_word_gemv_cannot_run(nf4h):
    """The word GEMV (kernel "gemv_table") runs for M <= 4 when W's dtype is x's and the packed bytes are 4-byte
    aligned; elsewhere the tuned row falls back to the codebook-0 GEMV with its own shape and any other word GEMV
    config keeps its shape as the codebook-0 GEMV; the meta device (the offline sm_75 builds) never takes it. The
    tensor-core GEMV ("gemv_mma") needs a CUDA GPU: here it falls back to the word GEMV, then as above. The word
    tl.dot kernel falls back to nf4.dequantize + cuBLAS, and the backward always takes that path."""
    from nf4.linear import launch
    from nf4.linear.tuned import (
        DEQUANT,
        GEMV,
        GEMV_MMA16,
        GEMV_MMA32,
        GEMV_MMA_WK,
        GEMV_MMA_WK4,
        GEMV_MMA_WK16,
        GEMV_TABLE,
        WORD_GEMM32,
        WORD_GEMM128,
    )

    packed, qs = nf4h.quantize((40, 128), torch.bfloat16, 64, True, seed=nf4h.case_seed("launch-config"))
    w = NF4Weight.from_state(packed, qs)

    def x(m, dtype=torch.bfloat16):
        return torch.empty((m, 128), dtype=dtype)

    mine = LinearConfig(kernel="gemv_table", block_r=16, num_warps=1)
    assert launch.launch_config(GEMV_TABLE, w, x(4), 4, False) is GEMV_TABLE
    assert launch.launch_config(GEMV_TABLE, w, x(5), 5, False) is GEMV
    assert launch.launch_config(GEMV_TABLE, w, x(1, torch.float16), 1, False) is GEMV
    # backward: nf4.dequantize + cuBLAS, whatever the config
    for config in (GEMV_TABLE, GEMV, mine, WORD_GEMM32, LinearConfig(kernel="gemv", codebook=2)):
        assert launch.launch_config(config, w, x(1), 1, True) is DEQUANT, config
    assert launch.launch_config(mine, w, x(1, torch.float16), 1, False) == mine.with_(kernel="gemv", codebook=0)
    flat = packed.reshape(-1)
    shifted = torch.empty(flat.numel() + 1, dtype=torch.uint8)[1:]
    shifted.copy_(flat)  # the same bytes one byte off alignment
    shifted_w = w.with_packed(shifted.reshape(packed.shape))
    assert launch.launch_config(GEMV_TABLE, shifted_w, x(1), 1, False) is GEMV
    meta = torch.empty(packed.shape, dtype=packed.dtype, device="meta")
    assert launch.launch_config(GEMV_TABLE, w.with_packed(meta), x(1), 1, False) is GEMV
    tc = LinearConfig(kernel="gemv_mma", block_r=32, num_warps=2)
    assert not launch.runnable(tc, w, x(1), 1)  # a CPU tensor: no mma.sync
    assert launch.launch_config(tc, w, x(1), 1, False) == tc.with_(kernel="gemv_table", codebook=0)
    assert launch.launch_config(tc, w, x(5), 5, False) == tc.with_(kernel="gemv", codebook=0)
    # GEMV_MMA and GEMV_MMA8 left the tuned table, and their tuned fallbacks with it: like any config of the
    # caller's own they keep their shape (the word GEMV up to M = 4 where it runs, the codebook-0 GEMV else)
    assert launch.launch_config(GEMV_MMA, w, x(1), 1, False) == GEMV_MMA.with_(kernel="gemv_table", codebook=0)
    assert launch.launch_config(GEMV_MMA, w, x(1, torch.float16), 1, False) == GEMV_MMA.with_(kernel="gemv",
                                                                                                codebook=0)
    assert launch.launch_config(GEMV_MMA8, w, x(8), 8, False) == GEMV_MMA8.with_(kernel="gemv", codebook=0)
    # the tuned rows' fallbacks
    assert launch.launch_config(GEMV_MMA16, w, x(16), 16, False) is DEQUANT
    assert launch.launch_config(GEMV_MMA32, w, x(32), 32, False) is DEQUANT
    # the single-launch rows (warps splitting K): the word GEMV up to M = 4, nf4.dequantize + cuBLAS above
    assert launch.launch_config(GEMV_MMA_WK, w, x(1), 1, False) is GEMV_TABLE
    assert launch.launch_config(GEMV_MMA_WK, w, x(2, torch.float16), 2, False) is GEMV
    for m, want in ((3, GEMV_TABLE), (4, GEMV_TABLE), (5, DEQUANT), (8, DEQUANT)):
        assert launch.launch_config(GEMV_MMA_WK16, w, x(m), m, False) is want, m
    assert launch.launch_config(GEMV_MMA_WK16, w, x(4, torch.float16), 4, False) is GEMV
    # the rows a weight's shape picks instead (tuned.for_shape): GEMV_MMA16 also at M <= 8, GEMV_MMA_WK4 at M <= 4
    for m, want in ((1, GEMV_TABLE), (4, GEMV_TABLE), (5, DEQUANT), (8, DEQUANT)):
        assert launch.launch_config(GEMV_MMA16, w, x(m), m, False) is want, m
    assert launch.launch_config(GEMV_MMA_WK4, w, x(1), 1, False) is GEMV_TABLE
    # the word tl.dot rows run where W's dtype is x's and the packed bytes are 4-byte aligned (the interpreter
    # too), else nf4.dequantize + cuBLAS; so does a word tl.dot config of the caller's own (no simpler fused kernel)
    assert launch.launch_config(WORD_GEMM32, w, x(32), 32, False) is WORD_GEMM32
    assert launch.launch_config(WORD_GEMM128, w, x(100), 100, False) is WORD_GEMM128
    assert launch.launch_config(WORD_GEMM32, w, x(32, torch.float16), 32, False) is DEQUANT
    assert launch.launch_config(WORD_GEMM128, shifted_w, x(64), 64, False) is DEQUANT
    assert launch.launch_config(WORD_GEMM32, w.with_packed(meta), x(32), 32, False) is DEQUANT
    word = LinearConfig(kernel="gemm_word", block_m=16, block_n=32)
    assert launch.launch_config(word, w, x(20), 20, False) is word
    assert launch.launch_config(word, w, x(20, torch.float16), 20, False) is DEQUANT


def test_warps_k_config_falls_back_where_the_tensor_core_gemv_cannot_run(nf4h):
    """In Triton's interpreter (no PTX) a tensor-core GEMV whose warps split K (warps_k) falls back like any
    tensor-core config: the word GEMV of the same rows per program, warps_k 1; its product is that config's."""
    from nf4.linear import launch

    config = GEMV_MMA.with_(warps_k=4, block_r=16, split_k=1)
    packed, qs = nf4h.quantize((45, 256), torch.bfloat16, 64, True, seed=nf4h.case_seed("warps_k-fallback"))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    launched = launch.launch_config(config, NF4Weight.from_state(packed, qs), x, 3, False)
    assert launched == config.with_(kernel="gemv_table", codebook=0, warps_k=1)
    assert_bitexact(nf4.linear(x, packed, qs, config=config), nf4.linear(x, packed, qs, config=launched))


def test_tuned_rows_for_a_weights_shape():
    """tuned.tuned with the weight's shape (tuned.for_shape): the word tl.dot rows give way to GEMV_MMA32 on
    small weights (M = 17-32), to nf4.dequantize + cuBLAS on rows under 2048 (M = 33-64, H200 and H100), on rows
    under 4096 (M = 65-128) and on rows under 8192
    of weights under LARGE_WEIGHT (M = 129-256), to WORD_GEMM128_W8 (M = 65-128) and WORD_GEMM32_S8 (M = 17-32)
    on rows of 4096-8191 of larger weights; at M <= 4 the single-launch rows become GEMV_MMA_WK2 on 14336-16384 rows
    of 4096 weights; on the H100 and the H200 (the catalog's config race) rows of packed bytes not a multiple of 256
    take GEMV_MMA_WK16 at M <= 8, weights of 2304 rows or more with rows of at most 11008 weights GEMV_MMA_WK4 at
    M <= 4, and weights of 16384 rows or more GEMV_MMA_WK16 at M = 9-16; on other GPUs the single-launch rows
    become GEMV_MMA_WK4 at M <= 4 where K / 2 is under two 128-byte steps of each of GEMV_MMA_WK's 8 warps (2048
    bytes); every other row and M, the backward, a call without the shape and the interpreter's rows are as
    before. (The Gluon GEMM's rule, which comes before these on the H100 and the H200: test_gluon_rule.)"""
    from nf4.linear.tuned import (
        DEQUANT,
        GEMV_MMA16,
        GEMV_MMA32,
        GEMV_MMA_WK,
        GEMV_MMA_WK2,
        GEMV_MMA_WK4,
        GEMV_MMA_WK16,
        INTERPRETER,
        WORD_GEMM32,
        WORD_GEMM32_S8,
        WORD_GEMM64,
        WORD_GEMM128,
        WORD_GEMM128_W8,
        WORD_GEMM256,
        for_shape,
        pick,
        tuned,
    )

    h100 = "NVIDIA H100 80GB HBM3"

    def at(m, n, k, name=h100, backward=False):  # the rules below, without the Gluon GEMM's (its own test)
        return tuned(name, m, backward, n=n, k=k, gluon=False)

    h200 = "NVIDIA H200"
    for m in (1, 2, 3, 4, 5, 8):
        row = tuned(h100, m)  # GEMV_MMA_WK to M = 2, GEMV_MMA_WK16 to 8
        tall = GEMV_MMA_WK2 if m <= 4 else row  # 14336-16384 rows of 4096 weights: 112-128 programs
        assert at(m, 14336, 4096) is tall and at(m, 16384, 4096) is tall, m
        assert at(m, 14336, 4096, name=h200) is tall, m
        # the H100 (GEMV_RULE_GPUS): rows whose packed bytes are not a multiple of 256 take GEMV_MMA_WK16
        for n, k in ((8192, 29568), (2048, 5504), (64, 896), (14336, 4096 - 128)):
            assert at(m, n, k) is GEMV_MMA_WK16, (m, n, k)
        # ... else at M <= 4, 2304 rows or more of at most 11008 weights take GEMV_MMA_WK4
        many = GEMV_MMA_WK4 if m <= 4 else row
        for n, k in ((2304, 4096), (12288, 4096), (16512, 4096), (8192, 2048), (4096, 10240)):
            assert at(m, n, k) is many, (m, n, k)
        for n, k in ((2303, 4096), (1024, 2048), (4096, 14336), (14336, 14336), (4096, 11264)):
            assert at(m, n, k) is row, (m, n, k)
        # the H200 takes the same rules (GEMV_RULE_GPUS); other GPUs keep the earlier one: rows under two steps of a
        # GEMV_MMA_WK warp take GEMV_MMA_WK4 at M <= 4
        assert at(m, 8192, 29568, name=h200) is GEMV_MMA_WK16 and at(m, 12288, 4096, name=h200) is many, m
        a100 = "NVIDIA A100-SXM4-80GB"
        short = GEMV_MMA_WK4 if m <= 4 else row
        assert at(m, 14336, 4096 - 128, name=a100) is short and at(m, 1024, 2048, name=a100) is short, m
        assert at(m, 12288, 4096, name=a100) is row and at(m, 8192, 29568, name=a100) is row, m
    assert tuned(h100, 1) is GEMV_MMA_WK and tuned(h100, 8) is GEMV_MMA_WK16
    # M = 9-16 on the H100: weights of 16384 rows or more take GEMV_MMA_WK16 (one launch) over GEMV_MMA16 (split-K)
    for m in (9, 16):
        assert at(m, 16384, 4096) is GEMV_MMA_WK16 and at(m, 59136, 8192) is GEMV_MMA_WK16, m
        assert at(m, 59136, 8192, name=h200) is GEMV_MMA_WK16, m
        assert at(m, 16383, 4096) is GEMV_MMA16 and at(m, 59136, 8192, name="NVIDIA A100-SXM4-80GB") is GEMV_MMA16, m
    for m in (64, 1024):  # past the single-launch rows: unchanged
        assert at(m, 1024, 2048) is tuned(h100, m), m
    # the word tl.dot rows: a small weight keeps GEMV_MMA32 at M = 17-32, rows under 4096 take nf4.dequantize +
    # cuBLAS at M = 65-128
    assert tuned(h100, 32) is WORD_GEMM32 and tuned(h100, 64) is WORD_GEMM64 and tuned(h100, 128) is WORD_GEMM128
    for m in (17, 32):
        assert at(m, 1024, 4096) is GEMV_MMA32 and at(m, 1024, 2048) is GEMV_MMA32, m
        assert at(m, 1025, 4096) is WORD_GEMM32 and at(m, 4096, 14336) is WORD_GEMM32, m
        # split 8 ways on large weights with rows of 4096-8191
        assert at(m, 14336, 4096) is WORD_GEMM32_S8 and at(m, 8192, 4096) is WORD_GEMM32_S8, m
        assert at(m, 8191, 4096) is WORD_GEMM32 and at(m, 16384, 2048) is WORD_GEMM32, m
    assert WORD_GEMM32_S8 == WORD_GEMM32.with_(split_k=8)
    for m in (65, 128):
        assert at(m, 8192, 2048) is DEQUANT and at(m, 14336, 4096 - 64) is DEQUANT, m
        assert at(m, 1024, 4096) is WORD_GEMM128 and at(m, 4096, 14336) is WORD_GEMM128, m
        # one launch of 8 warps on large weights with rows under 8192 (those WORD_GEMM256 takes above)
        assert at(m, 14336, 4096) is WORD_GEMM128_W8 and at(m, 8192, 4096) is WORD_GEMM128_W8, m
        assert at(m, 8191, 4096) is WORD_GEMM128 and at(m, 4096, 8192) is WORD_GEMM128, m
    assert WORD_GEMM128_W8.split_k == 1 and WORD_GEMM128_W8.num_warps == 8
    assert WORD_GEMM128_W8.with_(num_warps=4, split_k=0) == WORD_GEMM128
    assert at(64, 8192, 2048) is WORD_GEMM64 and at(129, 4096, 4096) is DEQUANT
    # M = 33-64 on the H200 and the H100: rows under 2048 weights take nf4.dequantize + cuBLAS (other GPUs keep the
    # word GEMM)
    for m in (33, 64):
        assert at(m, 8192, 2048 - 64, name=h200) is DEQUANT and at(m, 896, 896, name=h200) is DEQUANT, m
        assert at(m, 8192, 2048, name=h200) is WORD_GEMM64 and at(m, 896, 896) is DEQUANT, m
        assert at(m, 896, 896, name="NVIDIA A100-SXM4-80GB") is WORD_GEMM64, m
    assert at(32, 896, 896, name=h200) is GEMV_MMA32 and at(65, 896, 896, name=h200) is DEQUANT
    # M = 129-256: 256 rows of x per W tile on rows of 8192 weights or more and on weights of LARGE_WEIGHT weights
    # or more, nf4.dequantize + cuBLAS on the others
    for m in (129, 256):
        assert at(m, 4096, 14336) is WORD_GEMM256 and at(m, 2048, 8192) is WORD_GEMM256, m
        assert at(m, 14336, 4096) is WORD_GEMM256 and at(m, 8192, 4096) is WORD_GEMM256, m
        assert at(m, 8191, 4096) is DEQUANT and at(m, 4096, 8192 - 64) is DEQUANT, m
        assert at(m, 4096, 4096) is DEQUANT and at(m, 8192, 2048) is DEQUANT and at(m, 1024, 4096) is DEQUANT, m
        assert at(m, 16384, 2048) is DEQUANT, m  # a large weight of short rows: not swept, the dequant path kept
    assert at(257, 4096, 14336) is DEQUANT and tuned(h100, 256) is WORD_GEMM256
    assert at(1, 1024, 2048, backward=True) is tuned(h100, 1, True)  # the backward rows are not adjusted
    assert at(1, 1024, 2048, name="") is pick(INTERPRETER["forward"], 1)  # nor the interpreter's
    assert tuned("NVIDIA H200", 1) is tuned(h100, 1)  # the H100's table rows apply to the H200
    mine = GEMV_MMA_WK16.with_(programs_per_sm=4)  # a config of the caller's own is never adjusted
    assert for_shape(mine, 1, 8192, 2048, h100) is mine


@pytest.mark.parametrize("trans", [False, True], ids=["forward", "backward"])
def test_dequantize_matmul_opaque_op(nf4h, lin, trans):
    """The op nf4::linear's dequant path runs under torch.compile (nf4/linear/ops.py): torch.library.opcheck (schema,
    fake tensor, dispatch), and its output is eager's nf4.dequantize + cuBLAS product bit for bit."""
    import nf4.linear.ops  # registers the ops

    n, k = 37, 128
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, True, seed=nf4h.case_seed("dequant-matmul-op", trans))
    x = lin.randn((5, n if trans else k), torch.bfloat16, 11)
    bias = None if trans else lin.randn((n,), torch.bfloat16, 12)
    s2 = qs.state2
    args = (x, packed, qs.absmax, s2.absmax, s2.code, qs.offset, bias, n, k, 64, torch.bfloat16, False, trans)
    torch.library.opcheck(torch.ops.nf4.dequantize_matmul_opaque.default, args)
    wt = nf4.dequantize(packed, qs, ftz=False)
    want = x @ wt if trans else torch.nn.functional.linear(x, wt, bias)
    assert_bitexact(torch.ops.nf4.dequantize_matmul_opaque(*args), want, name="opaque op")


@pytest.mark.parametrize("op", ["linear_opaque", "dequantize_matmul_opaque"])
def test_opaque_ops_have_no_gradient_and_say_so(nf4h, lin, op):
    """The opaque ops are torch.library.Library registrations (nf4.traced.opaque_op: one Python crossing a call, no
    autograd kernel): with grad mode on, an x or a bias that requires grad is refused with an error naming the op, and
    nothing is returned without a gradient; with grad mode off the same call runs and gives eager's bits. No
    autograd kernel is registered (the dispatcher's fallback passes through, the op's kernel decides)."""
    import nf4.linear.ops  # registers the ops

    n, k = 37, 128
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, True, seed=nf4h.case_seed("opaque-grad", op))
    s2 = qs.state2
    x = lin.randn((5, k), torch.bfloat16, 13)
    bias = lin.randn((n,), torch.bfloat16, 14)
    tail = (n, k, 64, torch.bfloat16, False) + ((False,) if op == "dequantize_matmul_opaque" else ())
    fn = getattr(torch.ops.nf4, op).default
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(fn.name(), "Autograd")
    with torch.no_grad():
        want = fn(x, packed, qs.absmax, s2.absmax, s2.code, qs.offset, bias, *tail)
    for xg, bg in ((x.clone().requires_grad_(True), bias), (x, bias.clone().requires_grad_(True))):
        with pytest.raises(RuntimeError, match=f"nf4::{op} has no gradient"):
            fn(xg, packed, qs.absmax, s2.absmax, s2.code, qs.offset, bg, *tail)
        with torch.no_grad():
            got = fn(xg, packed, qs.absmax, s2.absmax, s2.code, qs.offset, bg, *tail)
        assert_bitexact(got, want, name=op)
    if op == "linear_opaque":  # the fused launches as eager makes them
        assert_bitexact(want, nf4.linear(x, packed, qs, bias, ftz=False), name=op)
    else:  # nf4.dequantize, then the product
        assert_bitexact(want, torch.nn.functional.linear(x, nf4.dequantize(packed, qs, ftz=False), bias), name=op)


def test_maxnreg_reaches_the_compile_options_and_changes_no_result(nf4h):
    """LinearConfig.maxnreg is a compile option of the GEMV launches (PTX .maxnreg on a GPU; the offline sm_90a
    builds of experiments bench-linear's mma-wk-reg grid), absent where it is None; in Triton's interpreter a
    GEMV config with it gives its product without it, bit for bit."""
    from nf4.linear import launch
    from nf4.linear.tuned import GEMV_MMA_WK

    packed, qs = nf4h.quantize((45, 256), torch.bfloat16, 64, True, seed=nf4h.case_seed("maxnreg"))
    w = NF4Weight.from_state(packed, qs)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    out = torch.empty((3, 45), dtype=torch.bfloat16)
    capped = GEMV_MMA_WK.with_(maxnreg=64)
    for config, want in ((capped, {"num_warps": 8, "maxnreg": 64}), (GEMV_MMA_WK, {"num_warps": 8})):
        # kernel_args trusts the config's kernel (an offline build passes the config it wants)
        ((fn, _, _, options),) = launch.kernel_args(x, w, None, out, 3, config, True, False)
        assert fn.__name__ == "nf4_gemv_mma_kernel" and options == want
    plain = LinearConfig(kernel="gemv", split_k=1, block_r=16, step_bytes=16, codebook=0)
    assert_bitexact(nf4.linear(x, packed, qs, config=plain.with_(maxnreg=40)), nf4.linear(x, packed, qs, config=plain))


@pytest.mark.parametrize("nested", [True, False], ids=["dq", "nodq"])
def test_opaque_dequantize_binds_per_launch_facts_and_rebinds_every_pointer(nf4h, monkeypatch, nested):
    """The opaque op's dequantize (what a compiled dequant-path linear runs on every call) binds its launch once per
    set of launch facts and, on later calls, rebinds every tensor pointer (the packed alias a compiled graph makes
    anew each call, the state's tensors, the output): new tensor objects at the same alignment take the bound launch
    with their own pointers; another alignment, size, dtype or flag takes the full launch again. Launches stubbed
    (the interpreter binds none)."""
    ops = importlib.import_module("nf4.linear.ops")

    full, bound_calls = [], []

    class Bound:
        def __init__(self, rebind):
            self.rebind = rebind

        def __call__(self, stream, *values):
            bound_calls.append(values)

    def launch(w, out, ftz):
        full.append((w.packed.data_ptr(), out.shape, ftz))
        return out, object(), None, (1,), {}

    monkeypatch.setattr(ops, "_bindable", lambda device: True)
    monkeypatch.setattr(ops, "dequant_launch", launch)
    monkeypatch.setattr(ops.runtime, "bind", lambda compiled, fn, grid, args, rebind: Bound(rebind))
    monkeypatch.setattr(ops.runtime, "raw_stream", lambda index: 7)
    monkeypatch.setattr(ops, "_PLANS", {})
    packed, qs = nf4h.quantize((37, 128), torch.bfloat16, 64, nested, seed=nf4h.case_seed("opaque-plans", nested))
    s2 = qs.state2

    def parts(p):
        return (p, qs.absmax, s2.absmax, s2.code, qs.offset) if nested else (p, qs.absmax, None, None, None)

    def call(p, ftz=False, k=128, dtype=torch.bfloat16):
        return ops._dequantize_scratch(*parts(p), 37, k, 64, dtype, ftz, p.device)

    call(packed)
    assert len(full) == 1 and not bound_calls
    (bound,) = ops._PLANS.values()
    assert bound.rebind == (ops._NESTED_SLOTS if nested else ops._PLAIN_SLOTS)
    twin = packed.clone()  # another tensor object (and pointer), the same facts
    wt = call(twin)
    assert len(full) == 1 and len(bound_calls) == 1
    want = [t.data_ptr() for t in parts(twin) if t is not None]
    assert list(bound_calls[0][:-1]) == want and bound_calls[0][-1] != 0 and wt.shape == (37, 128)
    bytes_ = torch.zeros(packed.numel() * packed.element_size() + 4, dtype=torch.uint8)
    shifted = bytes_[4:].view(packed.dtype).view(packed.shape)  # 4 bytes off its 16-byte alignment
    shifted.copy_(packed)
    call(shifted)
    call(packed, ftz=True)
    call(packed, dtype=torch.float16)
    assert len(full) == 4 and len(bound_calls) == 1 and len(ops._PLANS) == 4


@pytest.mark.parametrize("nested", [True, False], ids=["dq", "nodq"])
def test_opaque_linear_binds_a_direct_kernel_per_launch_facts(nf4h, monkeypatch, nested):
    """The opaque linear (torch.compile's path for a kernel that launches itself, the Gluon GEMM) binds the kernel
    on its first call per set of launch facts (`ops._direct_key`) and later calls take the bound launches with their
    own x, packed bytes, bias, out and state's tensors; another M, alignment, contiguity or bias takes the full path
    again, as does a call while a profiler hook is on. The table's choice and the kernel stood in for (on the CPU
    the Gluon GEMM cannot run)."""
    ops = importlib.import_module("nf4.linear.ops")
    binds, bound_calls = [], []
    gluon = LinearConfig(kernel="gemm_gluon", block_m=128)

    def bound(x, packed, bias, out, *state):
        bound_calls.append((x.data_ptr(), packed.data_ptr(), bias, out.shape, state))
        return out

    def bind_direct(x, w, bias, out, m, config, ftz, part):
        binds.append((m, config, ftz))
        return bound

    monkeypatch.setattr(ops, "_bindable", lambda device: True)
    monkeypatch.setattr(ops, "launch_config", lambda config, w, x, m, trans: gluon)
    monkeypatch.setattr(ops, "split_k", lambda config, w, m, device: (1, w.shape[1] // 2))
    fulls = []
    monkeypatch.setattr(ops, "bind_direct", bind_direct)
    monkeypatch.setattr(ops, "run_direct", lambda x, w, bias, out, *a: fulls.append(x.shape) or out)
    monkeypatch.setattr(ops, "_PLANS", {})
    n, k = 37, 128
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, nested, seed=nf4h.case_seed("opaque-direct", nested))
    s2 = qs.state2
    state = (qs.absmax, s2.absmax, s2.code, qs.offset) if nested else (qs.absmax, None, None, None)

    def call(x, p=packed, st=state, bias=None):
        return ops._linear_opaque(x, p, *st, bias, n, k, 64, torch.bfloat16, True)

    x = torch.randn(96, k).to(torch.bfloat16)
    call(x)
    assert len(binds) == 1 and binds[0][:2] == (96, gluon) and not bound_calls
    twin_state = tuple(None if t is None else t.clone() for t in state)  # another weight, the same facts
    x2, packed2 = torch.randn(96, k).to(torch.bfloat16), packed.clone()
    out = call(x2, packed2, twin_state)
    assert len(binds) == 1 and len(bound_calls) == 1 and out.shape == (96, n)
    assert bound_calls[0][:2] == (x2.data_ptr(), packed2.data_ptr()) and bound_calls[0][4] == twin_state
    call(torch.randn(97, k).to(torch.bfloat16))  # another M
    call(torch.randn(96, k + 2).to(torch.bfloat16)[:, :k])  # not contiguous
    call(x, bias=torch.randn(n).to(torch.bfloat16))  # a bias
    assert len(binds) == 3 and len(bound_calls) == 1 and len(fulls) == 1  # the strided x: the full path, unbound
    monkeypatch.setattr(ops.runtime, "hooks_active", lambda: True)  # a profiler: the full path, nothing bound
    call(x2, packed2, twin_state)
    assert len(binds) == 3 and len(bound_calls) == 1 and len(fulls) == 2


def test_gluon_rule():
    """tuned.gluon_rule: on the H100, M = 65-128 on weights of 8Mi weights or more take GLUON_GEMM128, M = 129-256 on
    weights of 16Mi or more with N >= K and M = 257-512 on weights of 24Mi or more with N >= 0.75 K GLUON_GEMM256; on
    the H200 the same rows from 16Mi (and N >= K / 4), 24Mi and 48Mi weights; nothing at M <= 64 or above 512, on
    other GPUs, or in the backward; with gluon=False, and where the kernel cannot run (tuned.fallback's "table"), the
    table's choice for the shape without the rule."""
    from nf4.linear.tuned import CONFIGS, fallback, for_shape, gluon_rule, pick, tuned

    g128, g256 = CONFIGS["GLUON_GEMM128"], CONFIGS["GLUON_GEMM256"]
    assert g128.kernel == g256.kernel == "gemm_gluon" and (g128.block_m, g256.block_m) == (128, 256)
    for gpu, scale in (("NVIDIA H100 80GB HBM3", (1, 1, 1)), ("NVIDIA H200", (2, 1.5, 2))):
        n128, n256, n512 = (int(4096 * s) for s in scale)  # rows that reach each threshold
        for m in (65, 100, 128):
            assert gluon_rule(m, n128 // 2, 4096, gpu) is g128 and gluon_rule(m, n128 // 2 - 1, 4096, gpu) is None, m
            assert gluon_rule(m, n128 // 4, 8192, gpu) is g128, m  # N < K: at least K / 4 on the H200 only
            assert (gluon_rule(m, 4096, 32768, gpu) is g128) == (gpu != "NVIDIA H200"), m
        for m in (129, 256):
            assert gluon_rule(m, n256, 4096, gpu) is g256 and gluon_rule(m, n256 - 1, 4096, gpu) is None, m
            assert gluon_rule(m, 4096, 14336, gpu) is None and gluon_rule(m, 14336, 4096, gpu) is g256, m
        for m in (257, 512):
            assert gluon_rule(m, int(1.5 * n512), 4096, gpu) is g256, m
            assert gluon_rule(m, int(1.5 * n512) - 1, 4096, gpu) is None, m
            assert gluon_rule(m, 12288, 16384, gpu) is g256 and gluon_rule(m, 12287, 16384, gpu) is None, m  # 0.75 K
        for m in (1, 16, 64, 513, 4096):
            assert gluon_rule(m, 59136, 8192, gpu) is None, m
        assert tuned(gpu, 128, n=14336, k=4096) is g128 and tuned(gpu, 128, True, n=14336, k=4096).kernel == "dequant"
        assert tuned(gpu, 128) is not g128  # no shape: the row
        for m, n, k in ((100, 14336, 4096), (200, 14336, 4096), (400, 14336, 4096)):
            assert tuned(gpu, m, n=n, k=k).kernel == "gemm_gluon", (gpu, m)
            without = tuned(gpu, m, n=n, k=k, gluon=False)
            assert without.kernel != "gemm_gluon" and fallback(tuned(gpu, m, n=n, k=k), m, n, k, gpu) is without
            assert without is for_shape(pick(tuned.__globals__["TUNED"]["H100"]["forward"], m), m, n, k, gpu)
    assert gluon_rule(128, 14336, 4096, "NVIDIA A100-SXM4-80GB") is None and gluon_rule(128, 14336, 4096, "") is None
