"""`nf4.linear`'s repeat call (CPU tensors in Triton's interpreter, or a CUDA GPU's compiled kernels and bound
launches, whichever this process has): with and without autograd, in every call form
that keeps a QuantState (packed + QuantState, a Params4bit), it skips the checks and computes what the full path
computes, bit for bit, and never serves a stale weight: a QuantState whose tensors were replaced, bytes changed in
place, a Params4bit whose `.data` was swapped, each read anew. The table's dequant path, remembered per key, is
nf4.dequantize + F.linear as on the first call.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.linear import LinearConfig
from nf4.linear import api as linear_api
from nf4.linear.gemv import nf4_gemv_kernel
from verify.exact import assert_bitexact

INTERPRETED = isinstance(nf4_gemv_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"  # the interpreter runs CPU tensors; compiled kernels a GPU's
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; conftest sets it without CUDA) "
           "or a CUDA GPU",
)

N, K = 37, 128


@pytest.fixture
def full_calls():
    """The full path's entries (calls of its first check, `nf4.weight.unpack`, from `nf4.linear` itself: nf4.dequantize
    calls it too, where the table takes nf4.dequantize + cuBLAS), seen by a profile hook (on this thread, where the
    forward runs)."""
    calls = []
    code, caller = linear_api.unpack.__code__, linear_api.linear.__code__

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code and frame.f_back is not None and frame.f_back.f_code is caller:
            calls.append(1)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def _params4bit(nf4h, seed):
    bnb = pytest.importorskip("bitsandbytes")
    data = nf4h.make_weight((N, K), torch.float32, seed)
    try:
        return bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                 blocksize=64)._quantize(DEVICE)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:  # a build without CPU quantization
        pytest.skip(f"bitsandbytes cannot quantize on the CPU here: {exc}")


def _forms(nf4h, seed):
    """(name, weight argument, quant_state argument, packed, QuantState) for each form with a remembered state."""
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=seed, device=DEVICE)
    p = _params4bit(nf4h, seed + 1)
    return [("packed+qs", packed, qs, packed, qs), ("Params4bit", p, None, p.data, p.quant_state),
            ("Params4bit+qs", p, p.quant_state, p.data, p.quant_state)]


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("m", [3, 9])  # the interpreter's table: the GEMV at M <= 4, tl.dot above
def test_repeat_call_skips_checks_and_equals_the_full_path(nf4h, lin, full_calls, grad, m):
    for name, weight, qs_arg, packed, qs in _forms(nf4h, nf4h.case_seed("repeat", grad, m)):
        wd = lin.operand(packed, qs, torch.bfloat16)
        cols = lin.columns(K, m, 3)
        x, scales = lin.identity_rows(cols, torch.bfloat16, K, 4, device=DEVICE)
        rows = lin.columns(N, m, 5)
        dy, dscales = lin.identity_rows(rows, torch.bfloat16, N, 6, device=DEVICE)
        outs, grads = [], []
        full_calls.clear()
        for _ in range(3):
            xi = x.clone().requires_grad_(grad)
            y = nf4.linear(xi, weight, qs_arg)
            assert y.requires_grad == grad, name
            outs.append(y.detach())
            if grad:
                y.backward(dy)
                grads.append(xi.grad)
        first = 0 if name == "Params4bit+qs" else 1  # (the Params4bit's state was validated by the form before)
        assert len(full_calls) == first, f"{name}: the repeat calls took the full path ({len(full_calls)} entries)"
        want = lin.picked(wd.t(), cols, scales, torch.bfloat16)
        for i, y in enumerate(outs):
            assert_bitexact(y, want, name=f"{name}, call {i}")
        for i, g in enumerate(grads):
            assert_bitexact(g, lin.picked(wd, rows, dscales, torch.bfloat16), name=f"{name}, x.grad of call {i}")


@pytest.mark.parametrize("lead", [(2, 3), (1, 9), (4, 1, 5)], ids=str)
def test_repeat_call_with_leading_dimensions(nf4h, lin, full_calls, lead):
    """x with leading dimensions takes the repeat call as its (M, K) matrix (a contiguous x is passed by pointer, no
    reshape): the output has x's leading dimensions and the operand's bits."""
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("repeat-lead", lead),
                               device=DEVICE)
    wd = lin.operand(packed, qs, torch.bfloat16)
    m = 1
    for d in lead:
        m *= d
    cols = lin.columns(K, m, 11)
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 12, device=DEVICE)
    want = lin.picked(wd.t(), cols, scales, torch.bfloat16).reshape(*lead, N)
    for i in range(3):
        y = nf4.linear(x.reshape(*lead, K), packed, qs)
        assert tuple(y.shape) == (*lead, N)
        assert_bitexact(y, want, name=f"call {i}")
    assert len(full_calls) == 1


def test_repeat_call_with_bias_grad(nf4h, lin, full_calls):
    packed, qs = nf4h.quantize((N, K), torch.float16, 64, False, seed=nf4h.case_seed("repeat-bias"), device=DEVICE)
    x = lin.randn((2, 5, K), torch.float16, 7, device=DEVICE)
    bias = lin.randn((N,), torch.float16, 8, device=DEVICE).requires_grad_()
    dy = lin.randn((2, 5, N), torch.float16, 9, device=DEVICE)
    results = []
    for _ in range(2):
        bias.grad = None
        y = nf4.linear(x, packed, qs, bias=bias)  # x needs no grad, the bias does
        y.backward(dy)
        results.append((y.detach(), bias.grad))
    assert len(full_calls) == 1
    assert_bitexact(results[1][0], results[0][0], name="y")
    assert_bitexact(results[1][1], dy.reshape(-1, N).sum(0), name="bias.grad")


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("change", ["absmax", "state2.absmax", "dtype", "offset", "state2.code", "bytes", "data"])
def test_repeat_call_reads_what_is_there_now(nf4h, lin, grad, change):
    """After two calls (the second a repeat call), the weight changes: the next call, and its backward, use the
    new weight."""
    p = _params4bit(nf4h, nf4h.case_seed("stale-repeat", change, grad))
    qs = p.quant_state
    cols, rows = lin.permutation(K, 61), lin.columns(N, K, 62)  # dY: one identity row per row of x
    x, scales = lin.identity_rows(cols, torch.bfloat16, K, 63, device=DEVICE)
    dy, dscales = lin.identity_rows(rows, torch.bfloat16, N, 64, device=DEVICE)
    nf4.linear(x, p)
    nf4.linear(x, p)
    if change in lin.STATE_CHANGES:
        lin.replace_in_state(qs, change)
    elif change == "bytes":
        p.data.copy_(torch.randint(0, 256, p.data.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
                     .to(DEVICE))
    else:  # a new packed tensor of the same size swapped in, as a loader or FSDP does
        p.data = torch.randint(0, 256, p.data.shape, dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(7)).to(DEVICE)
    wd = lin.operand(p.data, qs, torch.bfloat16)
    xi = x.clone().requires_grad_(grad)
    y = nf4.linear(xi, p)
    assert_bitexact(y.detach(), lin.picked(wd.t(), cols, scales, torch.bfloat16), name=f"after {change}")
    if grad:
        y.backward(dy)
        assert_bitexact(xi.grad, lin.picked(wd, rows, dscales, torch.bfloat16), name=f"x.grad after {change}")


def test_a_freed_weight_is_not_kept_alive(nf4h, lin):
    """The repeat call's memory (the validated state) holds no packed weight: a Params4bit used with grad and
    dropped is freed (on a GPU its bytes go back to the allocator), and its state's entry goes with its QuantState."""
    import gc
    import weakref

    x = lin.randn((3, K), torch.bfloat16, 65, device=DEVICE).requires_grad_()
    # a first weight makes what a process keeps per device once (level tables, the stand-in zeros): not a weight's
    warm = _params4bit(nf4h, nf4h.case_seed("freed-warm-up"))
    torch.autograd.grad(nf4.linear(x, warm).sum(), x)
    del warm
    gc.collect()
    before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    p = _params4bit(nf4h, nf4h.case_seed("freed"))
    for _ in range(3):
        torch.autograd.grad(nf4.linear(x, p).sum(), x)  # (no x.grad kept: memory is compared below)
    entry = linear_api.CACHE.peek(p.quant_state)
    assert entry is not None and linear_api.CACHE.get(p.quant_state, p) is entry
    param, state, kept = weakref.ref(p), weakref.ref(p.quant_state), weakref.ref(entry)
    del p, entry
    gc.collect()
    assert param() is None and state() is None
    assert kept() is None, "the cache entry outlived its QuantState"
    if DEVICE == "cuda":
        assert torch.cuda.memory_allocated() == before, "the packed weight's bytes are still allocated"


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_dequant_path_one_dimensional_x(nf4h, lin, grad, with_bias):
    """A 1-D x on the dequant path: the repeat calls pass it to cuBLAS as it is (no 2-D view), and F.linear and
    matmul take a 1-D x as the one-row product the first call's 2-D view gave: every call equals F.linear on
    nf4.dequantize's weight for that row, bit for bit, and the backward's dY @ W picks W's row exactly."""
    dequant = LinearConfig(kernel="dequant")
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("dequant-1d", grad, with_bias),
                               device=DEVICE)
    wd = nf4.dequantize(packed, qs)
    x = lin.randn((K,), torch.bfloat16, 76, device=DEVICE)
    bias = lin.randn((N,), torch.bfloat16, 78, device=DEVICE) if with_bias else None
    want = F.linear(x.unsqueeze(0), wd, bias)[0]
    row = 5
    dy = torch.zeros(N, dtype=torch.bfloat16, device=DEVICE)
    dy[row] = 1.0
    for i in range(3):
        xi = x.clone().requires_grad_(grad)
        y = nf4.linear(xi, packed, qs, bias=bias, config=dequant)
        assert y.shape == (N,)
        assert_bitexact(y.detach(), want, name=f"call {i}")
        if grad:
            y.backward(dy)
            assert_bitexact(xi.grad, wd[row], name=f"x.grad of call {i}")
    ftz = DEVICE == "cuda"
    w = linear_api.CACHE.get(qs, packed)
    assert w is not None and w.launches.get((1, torch.bfloat16, with_bias, False, dequant, ftz)) is linear_api._DEQUANT


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_dequant_path_remembered_per_key(nf4h, lin, grad):
    """Where the config (the table's, or here the caller's) takes nf4.dequantize + cuBLAS, the key is marked once and
    later calls go there without choosing again: the same bits as F.linear on nf4.dequantize's weight, and the
    backward's dY @ W likewise."""
    dequant = LinearConfig(kernel="dequant")
    packed, qs = nf4h.quantize((N, K), torch.bfloat16, 64, True, seed=nf4h.case_seed("dequant-key", grad),
                               device=DEVICE)
    wd = nf4.dequantize(packed, qs)
    x = lin.randn((2, 6, K), torch.bfloat16, 66, device=DEVICE)
    bias = lin.randn((N,), torch.bfloat16, 68, device=DEVICE)
    rows = lin.columns(N, 12, 67)
    dy, dscales = lin.identity_rows(rows, torch.bfloat16, N, 69, device=DEVICE)  # x.grad: rows of W, operand-exact
    for i in range(3):
        xi = x.clone().requires_grad_(grad)
        y = nf4.linear(xi, packed, qs, bias=bias, config=dequant)
        assert_bitexact(y.detach(), F.linear(x, wd, bias), name=f"call {i}")
        if grad:
            y.backward(dy.reshape(2, 6, N))
            assert_bitexact(xi.grad.reshape(12, K), lin.picked(wd, rows, dscales, torch.bfloat16),
                            name=f"x.grad of call {i}")
        if i == 0:
            w = linear_api.CACHE.get(qs, packed)
            ftz = DEVICE == "cuda"  # the device's default
            assert w is not None
            assert w.launches.get((12, torch.bfloat16, True, False, dequant, ftz)) is linear_api._DEQUANT
