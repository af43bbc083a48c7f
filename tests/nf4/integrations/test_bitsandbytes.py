"""`nf4.patch_bitsandbytes` / `unpatch_bitsandbytes` / `patched_bitsandbytes` with bitsandbytes 0.50.2.

Patched calls are compared bit for bit (integer views, `verify.exact.assert_bitexact`) with the same
call unpatched, and `nf4.integrations.bitsandbytes.routed_counts()` shows which side computed them.
On a machine without CUDA the tensors are CPU tensors and nf4 runs in Triton's interpreter
(conftest sets TRITON_INTERPRET=1); the reference is then bitsandbytes' own CPU route, which is
wrong for some shapes (verify/known.py, tests/reference/test_bnb.py): its AVX512 branch misreads
absmax when rows do not hold whole blocks, and it returns a 1-D shape as (1, n). The shapes here
are 2-D and 3-D, and each is one where that route is right: a last dim that is a multiple of the
blocksize (AVX512 branch: rows hold whole blocks), a last dim that is even but not a multiple of 16
(its scalar C++ branch), or an odd last dim (its pure-torch default backend); every case is checked
against `verify.known.native_absmax_index_bug`. With CUDA, the same checks also run on CUDA tensors
against bitsandbytes' CUDA kernels, and a Linear4bit with 2048 rows exercises gemm_4bit's dequantize
+ linear fallback.

What bitsandbytes' CPU Linear4bit does (checked below): the forward runs the op
`bitsandbytes::gemm_4bit`, whose default kernel calls the op `bitsandbytes::dequantize_4bit`, never
the Python `functional.dequantize_4bit`, so the CPU forward is not routed; the backward calls
`functional.dequantize_4bit` and is routed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.integrations.bitsandbytes import (
    patched_names,
    reset_routed_counts,
    route_dequant_linear_fallback,
    route_gemm_4bit_choice,
    routed_counts,
)
from verify.exact import assert_bitexact
from verify.known import native_absmax_index_bug

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

ROOT = Path(__file__).resolve().parents[3]
INTERPRETING = isinstance(nf4_dequantize_kernel, InterpretedFunction)
# Where nf4 runs: CPU tensors only in Triton's interpreter.
DEVICES = (["cpu"] if INTERPRETING else []) + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# bitsandbytes' CPU route for each (module docstring): AVX512 branch with whole blocks per row (at
# blocksizes 64 and 128), scalar C++ branch, scalar C++ branch in 3-D, pure-torch default backend
SHAPES = [(7, 128), (5, 70), (3, 5, 42), (3, 67)]
DQ = "dequantize_4bit"
FB = "_dequant_linear_fallback"

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="CPU tensors reach nf4 only in Triton's interpreter")


@pytest.fixture(autouse=True)
def _unpatched():
    """Every test starts and ends with nothing patched and the counts at zero."""
    nf4.unpatch_bitsandbytes()
    reset_routed_counts()
    yield
    nf4.unpatch_bitsandbytes()
    reset_routed_counts()


def _counts(function=DQ) -> tuple[int, int]:
    """(calls sent to nf4, calls sent to bitsandbytes) by the replacement of `function`."""
    c = routed_counts()
    return c.get((function, "nf4"), 0), c.get((function, "bitsandbytes"), 0)


def _bnb_bindings() -> dict[tuple[str, str], object]:
    """Every global of every loaded bitsandbytes module, by (module, name)."""
    return {(name, attr): value for name, module in list(sys.modules.items())
            if module is not None and (name == "bitsandbytes" or name.startswith("bitsandbytes."))
            for attr, value in list(vars(module).items())}


def _holding(*functions) -> list[tuple[str, str]]:
    """The bindings in loaded bitsandbytes modules that hold one of `functions` (by identity)."""
    return sorted(key for key, value in _bnb_bindings().items() if any(value is f for f in functions))


def _assert_same_bindings(before: dict, after: dict) -> None:
    assert after.keys() == before.keys()
    changed = [key for key in before if after[key] is not before[key]]
    assert not changed, f"bindings not restored to the same objects: {changed}"


def _outcome(fn):
    """("ok", result) or ("raises", exception type): what a call does, to compare patched with unpatched."""
    try:
        return "ok", fn()
    except Exception as e:
        return "raises", type(e)


def _assert_same_outcome(got, expect, name="output"):
    assert got[0] == expect[0], (got, expect)
    if got[0] == "raises":
        assert got[1] is expect[1], (got, expect)
    else:
        assert (tuple(got[1].shape), got[1].dtype) == (tuple(expect[1].shape), expect[1].dtype), name
        assert_bitexact(got[1], expect[1], name=name)


# --- 1. patching: bindings, identity, idempotence, the context manager ----------------------------


def test_patch_and_unpatch_restore_the_same_objects():
    """Where CUDA's gemm_4bit fallback is loaded, the plain patch also holds it, its kernel-or-fallback heuristic
    (every name binding it: bitsandbytes' CUDA ops module keeps it under two) and matmul_4bit (to hand the call's
    QuantState to the fallback's replacement)."""
    original = F.dequantize_4bit
    before = _bnb_bindings()
    cuda_ops = sys.modules.get("bitsandbytes.backends.cuda.ops")
    expect = _holding(original, *([cuda_ops._dequant_linear_fallback, cuda_ops._gemm_4bit_use_custom_fn,
                                   bnb.matmul_4bit] if cuda_ops is not None else []))
    assert ("bitsandbytes.functional", "dequantize_4bit") in expect

    nf4.patch_bitsandbytes()
    assert patched_names() == expect
    replacement = F.dequantize_4bit
    assert replacement is not original and replacement.__name__ == "dequantize_4bit"
    assert replacement._nf4_original is original
    assert not _holding(original), "a binding of the original was left unpatched"

    nf4.patch_bitsandbytes()  # twice is one patch: the same replacement, not a replacement of it
    assert patched_names() == expect and F.dequantize_4bit is replacement

    nf4.unpatch_bitsandbytes()
    assert patched_names() == [] and F.dequantize_4bit is original
    _assert_same_bindings(before, _bnb_bindings())
    nf4.unpatch_bitsandbytes()  # no-op
    _assert_same_bindings(before, _bnb_bindings())

    nf4.patch_bitsandbytes()  # again after an unpatch: the same replacement object
    assert F.dequantize_4bit is replacement


def test_unpatch_without_patch_is_a_no_op():
    before = _bnb_bindings()
    nf4.unpatch_bitsandbytes()
    assert patched_names() == []
    _assert_same_bindings(before, _bnb_bindings())


def test_context_manager_normal_exit_exception_and_nesting():
    original = F.dequantize_4bit
    before = _bnb_bindings()
    with nf4.patched_bitsandbytes():
        assert F.dequantize_4bit is not original and patched_names()
        with nf4.patched_bitsandbytes():  # nested: nothing new to patch, so nothing undone on its exit
            inner = F.dequantize_4bit
        assert F.dequantize_4bit is inner and patched_names()
    assert F.dequantize_4bit is original and patched_names() == []
    _assert_same_bindings(before, _bnb_bindings())

    with pytest.raises(RuntimeError, match="inside"), nf4.patched_bitsandbytes():
        assert F.dequantize_4bit is not original
        raise RuntimeError("inside")
    assert F.dequantize_4bit is original and patched_names() == []
    _assert_same_bindings(before, _bnb_bindings())


def test_context_manager_keeps_an_earlier_patch():
    original = F.dequantize_4bit
    nf4.patch_bitsandbytes()
    replacement, names = F.dequantize_4bit, patched_names()
    with nf4.patched_bitsandbytes():
        assert F.dequantize_4bit is replacement
    assert F.dequantize_4bit is replacement and patched_names() == names
    with nf4.patched_bitsandbytes():
        nf4.unpatch_bitsandbytes()  # undone inside the block: the state before it comes back on exit
        assert F.dequantize_4bit is original
    assert F.dequantize_4bit is replacement and patched_names() == names
    nf4.unpatch_bitsandbytes()
    assert F.dequantize_4bit is original


def test_by_value_bindings_are_patched_and_restored(monkeypatch):
    """A bitsandbytes module holding the function by value (`from bitsandbytes.functional import
    dequantize_4bit`) is patched and restored too, and so is CUDA's gemm_4bit fallback; stand-in
    modules play both where they are not loaded (no CUDA: bitsandbytes does not load its CUDA ops)."""
    original = F.dequantize_4bit
    by_value = types.ModuleType("bitsandbytes._nf4_test_by_value")
    by_value.dequantize_4bit = original
    by_value.unrelated = len
    monkeypatch.setitem(sys.modules, by_value.__name__, by_value)
    cuda_name = "bitsandbytes.backends.cuda.ops"
    if cuda_name in sys.modules:
        cuda_ops = sys.modules[cuda_name]
    else:
        cuda_ops = types.ModuleType(cuda_name)

        def _dequant_linear_fallback(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                                     absmax_code=None, absmax_offset=None):
            raise AssertionError("the stand-in is never called here")

        cuda_ops._dequant_linear_fallback = _dequant_linear_fallback
        monkeypatch.setitem(sys.modules, cuda_name, cuda_ops)
    fallback = cuda_ops._dequant_linear_fallback
    before = _bnb_bindings()
    try:
        nf4.patch_bitsandbytes()
        names = patched_names()
        assert (by_value.__name__, "dequantize_4bit") in names and (cuda_name, FB) in names
        assert by_value.dequantize_4bit is F.dequantize_4bit is not original
        assert cuda_ops._dequant_linear_fallback is not fallback
        assert cuda_ops._dequant_linear_fallback._nf4_original is fallback
        assert by_value.unrelated is len
        with nf4.patched_bitsandbytes():
            pass
        assert patched_names() == names
    finally:
        nf4.unpatch_bitsandbytes()
    assert by_value.dequantize_4bit is original and cuda_ops._dequant_linear_fallback is fallback
    _assert_same_bindings(before, _bnb_bindings())


def test_import_by_value_while_patched_is_restored(monkeypatch):
    """A module that imports the name while patched holds the replacement; a later patch records it, and
    unpatching gives it the original."""
    original = F.dequantize_4bit
    late = types.ModuleType("bitsandbytes._nf4_test_late")
    monkeypatch.setitem(sys.modules, late.__name__, late)
    nf4.patch_bitsandbytes()
    late.dequantize_4bit = F.dequantize_4bit  # what `from bitsandbytes.functional import ...` does now
    nf4.patch_bitsandbytes()
    assert (late.__name__, "dequantize_4bit") in patched_names()
    nf4.unpatch_bitsandbytes()
    assert late.dequantize_4bit is original


@needs_interpreter
def test_a_kept_replacement_calls_bitsandbytes_after_unpatch(nf4h):
    packed, state = nf4h.quantize((7, 128), torch.float32, 64, True, seed=nf4h.case_seed("kept"))
    expect = F.dequantize_4bit(packed, state)
    nf4.patch_bitsandbytes()
    kept = F.dequantize_4bit
    nf4.unpatch_bitsandbytes()
    assert_bitexact(kept(packed, state), expect)
    assert _counts() == (0, 1)


# --- 2. NF4 states: bit for bit, and through nf4 -------------------------------------------------


def _check_routed(device, packed, state, *, quant_storage=torch.uint8):
    expect = F.dequantize_4bit(packed, state)
    with nf4.patched_bitsandbytes():
        got = F.dequantize_4bit(packed, state)
        assert _counts() == (1, 0)
        via_nf4_name = F.dequantize_nf4(packed, state)  # functional's own global lookup
        assert _counts() == (2, 0)
        with_own_absmax = bnb.functional.dequantize_4bit(packed, quant_state=state, absmax=state.absmax,
                                                         blocksize=state.blocksize)
        assert _counts() == (3, 0)
    for name, t in (("dequantize_4bit", got), ("dequantize_nf4", via_nf4_name), ("own absmax", with_own_absmax)):
        assert (tuple(t.shape), t.dtype, t.device.type) == (tuple(expect.shape), expect.dtype, device), name
        assert_bitexact(t, expect, name=name)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_nf4_states_bitexact_through_nf4(nf4h, device, shape, blocksize, dtype, double_quant):
    assert not native_absmax_index_bug(shape, blocksize)
    packed, state = nf4h.quantize(shape, dtype, blocksize, double_quant, device=device,
                                  seed=nf4h.case_seed("bnb-patch", shape, blocksize, dtype, double_quant))
    _check_routed(device, packed, state)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("shape", [(7, 128), (5, 72)], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_quant_storage(nf4h, device, shape, double_quant):
    assert not native_absmax_index_bug(shape, 128)
    packed, state = nf4h.quantize(shape, torch.bfloat16, 128, double_quant, quant_storage=torch.bfloat16,
                                  device=device, seed=nf4h.case_seed("bnb-patch-bf16", shape, double_quant))
    assert packed.dtype == torch.bfloat16
    _check_routed(device, packed, state)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("device", DEVICES)
def test_row_packed_is_transposed_like_bitsandbytes(nf4h, device, double_quant):
    packed, state = nf4h.quantize((9, 64), torch.float16, 64, double_quant, device=device,
                                  seed=nf4h.case_seed("bnb-patch-row", double_quant))
    row = packed.t()  # (1, k): bitsandbytes returns the result transposed
    expect = F.dequantize_4bit(row, state)
    assert tuple(expect.shape) == (64, 9)
    with nf4.patched_bitsandbytes():
        got = F.dequantize_4bit(row, state)
    assert _counts() == (1, 0)
    assert tuple(got.shape) == (64, 9) and got.stride() == expect.stride()
    assert_bitexact(got, expect)


@pytest.mark.parametrize("device", DEVICES)
def test_out_argument(nf4h, device):
    """`out=` of the state's shape and dtype goes to nf4, which fills it and returns it (transposed for
    a (1, k) packed tensor), as bitsandbytes' CUDA route does; bitsandbytes' CPU build has no .out
    kernel and raises. Any other `out` goes to bitsandbytes, with the same outcome as unpatched."""
    packed, state = nf4h.quantize((6, 128), torch.bfloat16, 64, True, device=device,
                                  seed=nf4h.case_seed("bnb-patch-out"))
    expect = F.dequantize_4bit(packed, state)
    unpatched_out = _outcome(lambda: F.dequantize_4bit(packed, state, out=torch.empty_like(expect)))
    if device == "cpu":
        assert unpatched_out[0] == "raises"  # bitsandbytes 0.50.2: no CPU kernel for dequantize_4bit.out
    with nf4.patched_bitsandbytes():
        out = torch.empty_like(expect)
        got = F.dequantize_4bit(packed, state, out=out)
        assert got is out or got.data_ptr() == out.data_ptr()
        assert_bitexact(out, expect)
        out_t = torch.empty_like(expect)
        got_t = F.dequantize_4bit(packed.t(), state, out=out_t)
        assert got_t.data_ptr() == out_t.data_ptr() and tuple(got_t.shape) == (128, 6)
        assert_bitexact(got_t, expect.t())
        assert _counts() == (2, 0)
    others = {
        "dtype": lambda: torch.empty(6, 128, dtype=torch.float32, device=device),
        "shape": lambda: torch.empty(128, 6, dtype=torch.bfloat16, device=device),
        "not contiguous": lambda: torch.empty(128, 6, dtype=torch.bfloat16, device=device).t(),
    }
    for name, make in others.items():
        expect_outcome = _outcome(lambda make=make: F.dequantize_4bit(packed, state, out=make()))
        reset_routed_counts()
        with nf4.patched_bitsandbytes():
            got_outcome = _outcome(lambda make=make: F.dequantize_4bit(packed, state, out=make()))
        assert _counts() == (0, 1), name
        _assert_same_outcome(got_outcome, expect_outcome, name=f"out of another {name}")


# --- 3. what stays with bitsandbytes -------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp4_goes_to_bitsandbytes(nf4h, device, double_quant):
    x = nf4h.make_weight((7, 128), torch.float16, nf4h.case_seed("bnb-patch-fp4", double_quant), device)
    packed, state = F.quantize_4bit(x, blocksize=64, compress_statistics=double_quant, quant_type="fp4")
    expect = F.dequantize_4bit(packed, state)
    expect_fp4 = F.dequantize_fp4(packed, state)
    with nf4.patched_bitsandbytes():
        got = F.dequantize_4bit(packed, state)
        got_fp4 = F.dequantize_fp4(packed, state)
    assert _counts() == (0, 2)
    assert_bitexact(got, expect)
    assert_bitexact(got_fp4, expect_fp4)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_absmax_and_conflicts_go_to_bitsandbytes(nf4h, device):
    packed, state = nf4h.quantize((7, 128), torch.float32, 64, False, device=device,
                                  seed=nf4h.case_seed("bnb-patch-absmax"))
    calls = {
        # no QuantState: bitsandbytes builds one from absmax and out
        "absmax + out": lambda: F.dequantize_4bit(packed, absmax=state.absmax, blocksize=64, quant_type="nf4",
                                                  out=torch.empty(7, 128, device=device)),
        # a QuantState with arguments that disagree with it (bitsandbytes ignores them)
        "other absmax": lambda: F.dequantize_4bit(packed, state, absmax=state.absmax.clone()),
        "other blocksize": lambda: F.dequantize_4bit(packed, state, blocksize=128),
        # a state nf4 rejects (TypeError: float64 output); bitsandbytes decides (it raises ValueError)
        "float64 state": lambda: F.dequantize_4bit(packed, nf4h.clone_state(state, dtype=torch.float64)),
    }
    for name, call in calls.items():
        expect = _outcome(call)
        reset_routed_counts()
        with nf4.patched_bitsandbytes():
            got = _outcome(call)
        assert _counts() == (0, 1), name
        _assert_same_outcome(got, expect, name=name)


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
def test_cpu_tensors_go_to_bitsandbytes_without_the_interpreter():
    """With TRITON_INTERPRET unset nf4 cannot run CPU tensors: every CPU call goes to bitsandbytes."""
    code = (
        "import torch, nf4, bitsandbytes.functional as F\n"
        "from nf4.integrations.bitsandbytes import routed_counts\n"
        "x = torch.randn(7, 128, generator=torch.Generator().manual_seed(5))\n"
        "packed, state = F.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type='nf4')\n"
        "expect = F.dequantize_4bit(packed, state)\n"
        "with nf4.patched_bitsandbytes():\n"
        "    got = F.dequantize_4bit(packed, state)\n"
        "assert torch.equal(got.view(torch.int32), expect.view(torch.int32))\n"
        "assert routed_counts() == {('dequantize_4bit', 'bitsandbytes'): 1}, routed_counts()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# --- 4. Linear4bit, forward and backward ----------------------------------------------------------


def _linear4bit(nf4h, in_features, out_features, seed, *, compress_statistics, compute_dtype, device,
                weight_dtype=torch.float32):
    """A Linear4bit with a bias; its QuantState's dtype is weight_dtype (bf16 when quantized from bf16 weights,
    as a model loaded in bf16 is)."""
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=True, compute_dtype=compute_dtype,
                              compress_statistics=compress_statistics, quant_type="nf4", quant_storage=torch.uint8)
    weight = nf4h.make_weight((out_features, in_features), weight_dtype, seed)
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                     compress_statistics=compress_statistics, quant_storage=torch.uint8, blocksize=64)
    with torch.no_grad():
        layer.bias.copy_(nf4h.make_weight((out_features,), torch.float32, seed + 1))
    layer = layer.to(device)  # quantizes the weight on `device`
    assert layer.weight.bnb_quantized and layer.weight.quant_state.quant_type == "nf4"
    return layer.train()


def _forward_backward(layer, x):
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    counts_after_forward = dict(routed_counts())
    y.sum().backward()
    return y.detach(), x.grad, counts_after_forward


@needs_interpreter
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=DT.get)
@pytest.mark.parametrize("compress_statistics", [True, False], ids=["dq", "nodq"])
def test_linear4bit_cpu_forward_and_backward(nf4h, compress_statistics, compute_dtype):
    """CPU: the forward is bitsandbytes' (gemm_4bit's default kernel calls the op, not the function),
    the backward's dequantization is nf4's; output and input gradient are bit-identical to unpatched."""
    seed = nf4h.case_seed("bnb-patch-linear", compress_statistics, compute_dtype)
    layer = _linear4bit(nf4h, 128, 37, seed, compress_statistics=compress_statistics,
                        compute_dtype=compute_dtype, device="cpu")
    assert not native_absmax_index_bug((37, 128), 64)
    x = nf4h.make_weight((3, 5, 128), torch.float32, seed + 2)
    y0, g0, _ = _forward_backward(layer, x)
    with nf4.patched_bitsandbytes():
        y1, g1, after_forward = _forward_backward(layer, x)
    assert after_forward == {}, "the CPU forward called a patched function"
    assert _counts() == (1, 0)  # the backward's F.dequantize_4bit(B, ctx.state)
    assert_bitexact(y1, y0, name="output")
    assert_bitexact(g1, g0, name="input gradient")


@needs_interpreter
def test_linear4bit_cpu_ops_called(nf4h):
    """What the CPU Linear4bit runs, from the profiler: the forward runs the ops bitsandbytes::gemm_4bit
    and (inside it) bitsandbytes::dequantize_4bit in both states; the backward runs
    bitsandbytes::dequantize_4bit unpatched and no bitsandbytes op patched (nf4 dequantizes)."""
    from torch.profiler import ProfilerActivity, profile

    layer = _linear4bit(nf4h, 128, 19, nf4h.case_seed("bnb-patch-ops"), compress_statistics=True,
                        compute_dtype=torch.float32, device="cpu")
    x = nf4h.make_weight((4, 128), torch.float32, nf4h.case_seed("bnb-patch-ops-x"))

    def ops(patched):
        xin = x.clone().requires_grad_(True)
        with nf4.patched_bitsandbytes() if patched else contextlib.nullcontext():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                y = layer(xin)
            forward = {e.name for e in prof.events() if e.name.startswith("bitsandbytes::")}
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                y.sum().backward()
            backward = {e.name for e in prof.events() if e.name.startswith("bitsandbytes::")}
        return forward, backward

    forward, backward = ops(False)
    assert {"bitsandbytes::gemm_4bit", "bitsandbytes::dequantize_4bit"} <= forward
    assert "bitsandbytes::dequantize_4bit" in backward
    forward, backward = ops(True)
    assert {"bitsandbytes::gemm_4bit", "bitsandbytes::dequantize_4bit"} <= forward
    assert "bitsandbytes::dequantize_4bit" not in backward and _counts() == (1, 0)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("device", DEVICES)
def test_matmul_4bit_kn_weight_forward(nf4h, device, double_quant):
    """A weight quantized in [K, N] orientation: matmul_4bit's forward calls F.dequantize_4bit itself."""
    packed, state = nf4h.quantize((70, 128), torch.float32, 64, double_quant, device=device,
                                  seed=nf4h.case_seed("bnb-patch-kn", double_quant))
    assert not native_absmax_index_bug((70, 128), 64)
    a = nf4h.make_weight((3, 70), torch.float32, nf4h.case_seed("bnb-patch-kn-a", double_quant), device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # bitsandbytes asks to re-quantize as [N, K]
        expect = bnb.matmul_4bit(a, packed, state)
        with nf4.patched_bitsandbytes():
            got = bnb.matmul_4bit(a, packed, state)
    assert _counts() == (1, 0)
    assert tuple(got.shape) == (3, 128)
    assert_bitexact(got, expect)


# --- gemm_4bit's CUDA fallback (dequantize + linear) ---------------------------------------------


def _fallback_args(state, a, packed, bias):
    """The arguments MatMul4Bit.forward hands torch.ops.bitsandbytes.gemm_4bit (and its CUDA kernel to
    `_dequant_linear_fallback`)."""
    b = packed.view(-1, 1)
    if not state.nested:
        return (a, b, state.shape, state.absmax, state.blocksize, state.quant_type, bias), {}
    return ((a, b, state.shape, state.state2.absmax, state.blocksize, state.quant_type, bias),
            {"absmax_8bit": state.absmax, "absmax_code": state.state2.code, "absmax_offset": state.offset})


@needs_interpreter
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=DT.get)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_dequant_linear_fallback_route(nf4h, double_quant, compute_dtype, quant_type):
    """The replacement of CUDA's `_dequant_linear_fallback`, on CPU tensors (CUDA's ops module cannot be
    imported by a CPU-only torch): NF4 is dequantized by nf4 into A's dtype (a state of dtype
    compute_dtype, as the fallback's own dequantize uses), then F.linear, bit for bit with
    bitsandbytes' CPU dequantize + F.linear; FP4 goes to the original with the caller's arguments."""
    seed = nf4h.case_seed("bnb-patch-fallback", double_quant, compute_dtype, quant_type)
    w = nf4h.make_weight((37, 128), torch.float32, seed)
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
    a = nf4h.make_weight((3, 5, 128), compute_dtype, seed + 1)
    bias = nf4h.make_weight((37,), compute_dtype, seed + 2)
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "original"

    route = route_dequant_linear_fallback(original)
    args, kwargs = _fallback_args(state, a, packed, bias)
    with nf4.patched_bitsandbytes():  # the replacements route only while patched
        got = route(*args, **kwargs)
    if quant_type == "fp4":
        assert got == "original" and _counts(FB) == (0, 1)
        (got_args, got_kwargs), = calls
        assert all(x is y for x, y in zip(got_args, args, strict=True))
        assert all(got_kwargs[k] is v for k, v in kwargs.items())
        return
    assert not calls and _counts(FB) == (1, 0)
    weight = F.dequantize_4bit(packed, nf4h.clone_state(state, dtype=compute_dtype))
    expect = torch.nn.functional.linear(a, weight, bias)
    assert_bitexact(got, expect)
    assert route(*args, **kwargs) == "original"  # not patched: the original, unchanged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compress_statistics", [True, False], ids=["dq", "nodq"])
def test_linear4bit_cuda_fallback_forward_and_backward(nf4h, compress_statistics):
    """CUDA: 2048 rows (> 1536) send gemm_4bit to `_dequant_linear_fallback`, routed to nf4; the backward
    to F.dequantize_4bit, routed too. Output and input gradient bit-identical to unpatched."""
    assert "bitsandbytes.backends.cuda.ops" in sys.modules
    seed = nf4h.case_seed("bnb-patch-linear-cuda", compress_statistics)
    layer = _linear4bit(nf4h, 256, 96, seed, compress_statistics=compress_statistics,
                        compute_dtype=torch.bfloat16, device="cuda")
    x = nf4h.make_weight((2048, 256), torch.float32, seed + 2, "cuda")
    y0, g0, _ = _forward_backward(layer, x)
    with nf4.patched_bitsandbytes():
        assert ("bitsandbytes.backends.cuda.ops", FB) in patched_names()
        y1, g1, after_forward = _forward_backward(layer, x)
    assert after_forward == {(FB, "nf4"): 1}
    assert _counts(FB) == (1, 0) and _counts(DQ) == (1, 0)
    assert_bitexact(y1, y0, name="output")
    assert_bitexact(g1, g0, name="input gradient")
    from nf4.dequant.api import CACHE

    # the forward's dequantize used the layer's own QuantState (handed over by matmul_4bit's replacement):
    # its launch is bound (the plan) after the second call with it (the backward's was the first), and a third
    # forward, served by it, gives the same bits
    with nf4.patched_bitsandbytes():
        y2, g2, _ = _forward_backward(layer, x)
        plan = CACHE.peek(layer.weight.quant_state)
        assert plan is not None and plan.bound is not None
        y3, _, _ = _forward_backward(layer, x)
    assert_bitexact(y2, y0, name="output, again")
    assert_bitexact(g2, g0, name="input gradient, again")
    assert_bitexact(y3, y0, name="output, with the plan")


UC = "_gemm_4bit_use_custom_fn"


@pytest.mark.parametrize("m", [1, 127, 128, 1000])
@pytest.mark.parametrize("device_name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "Some Other GPU"])
def test_gemm_4bit_choice_route(device_name, m):
    """The replacement of `_gemm_4bit_use_custom_fn` answers "fallback" (False: routed to nf4) from the
    measured row threshold of the GPU on (nf4.integrations.routes.routes_gemm_4bit), and asks the original
    heuristic below it with the caller's arguments; unpatched it always asks the original."""
    from nf4.integrations.routes import routes_gemm_4bit

    calls = []

    def original(*args):
        calls.append(args)
        return "original"

    route = route_gemm_4bit_choice(original, device_name=lambda index: device_name)
    args = (0, torch.bfloat16, m, 4096, 1024)
    with nf4.patched_bitsandbytes():
        got = route(*args)
    if routes_gemm_4bit(device_name, m):
        assert got is False and not calls and _counts(UC) == (1, 0)
    else:
        assert got == "original" and calls == [args] and _counts(UC) == (0, 1)
    assert route(*args) == "original"  # not patched: the original
    assert route(0, torch.float32, 4096, 64, 64) == "original"
    assert route_gemm_4bit_choice(original) is route  # one replacement per original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear4bit_cuda_gemm_route(nf4h):
    """CUDA: a Linear4bit forward of M rows at or above the GPU's routing threshold goes to nf4 (the
    heuristic's replacement says fallback, the fallback dequantizes with nf4), bit-identical to
    bitsandbytes' own dequantize + F.linear; below the threshold bitsandbytes' choice is asked."""
    from nf4.integrations.routes import ROUTE_GEMM_4BIT_MIN_M, routes_gemm_4bit

    name = torch.cuda.get_device_name(0)
    m_route = next((v for gpu, v in ROUTE_GEMM_4BIT_MIN_M.items() if gpu in name), min(ROUTE_GEMM_4BIT_MIN_M.values()))
    seed = nf4h.case_seed("bnb-gemm-route")
    layer = _linear4bit(nf4h, 256, 96, seed, compress_statistics=True, compute_dtype=torch.bfloat16, device="cuda")
    x = nf4h.make_weight((m_route, 256), torch.bfloat16, seed + 2, "cuda")
    assert routes_gemm_4bit(name, m_route)
    with torch.no_grad():
        # the layer has a bias (float32, cast to x's dtype by Linear4bit.forward)
        expect = torch.nn.functional.linear(x, F.dequantize_4bit(layer.weight, layer.weight.quant_state).to(x.dtype),
                                            layer.bias.to(x.dtype))
        reset_routed_counts()
        with nf4.patched_bitsandbytes():
            got = layer(x)
            small = layer(x[:1])
    assert _counts(UC)[0] == 1 and _counts(FB)[0] == 1
    assert _counts(UC)[1] <= 1  # the one-row call asked bitsandbytes' heuristic (if it consulted it)
    assert_bitexact(got, expect, name="routed forward")
    assert small.shape == (1, 96)


# --- 5. the opt-in fused route: matmul_4bit of few rows to nf4.linear ------------------------------

MM = "matmul_4bit"


def _within_bound(got, x, layer, name):
    """got (x @ W^T + bias, summed in float32 in any order) within reference.linear.accumulation_bound of the
    float64 product of bitsandbytes' own dequantized weight (W in x's dtype, as bitsandbytes multiplies)."""
    from reference.linear import accumulation_bound

    w = F.dequantize_4bit(layer.weight, layer.weight.quant_state).to(x.dtype).float().cpu().numpy()
    xs = x.float().cpu().numpy().reshape(-1, w.shape[1])
    b = layer.bias.detach().to(x.dtype).float().cpu().numpy()
    exact = xs.astype("float64") @ w.astype("float64").T + b
    bound = accumulation_bound(xs, w, {torch.bfloat16: "bfloat16", torch.float16: "float16"}[x.dtype], bias=b)
    err = abs(got.float().cpu().numpy().reshape(exact.shape) - exact)
    assert (err <= bound).all(), f"{name}: worst error / bound {(err / bound).max():.3f}"


def test_fused_mode_bindings_and_restore():
    """fused_linear=True also patches every binding of bitsandbytes.matmul_4bit; a later patch without it
    puts back the original objects there (the mode is the last call's); unpatch and the context manager
    restore every binding and the mode; a non-bool mode is a TypeError naming the argument."""
    from nf4.integrations.bitsandbytes import fused_linear_on

    original = bnb.matmul_4bit
    before = _bnb_bindings()
    holding = _holding(original)
    assert ("bitsandbytes", MM) in holding
    nf4.patch_bitsandbytes(fused_linear=True)
    assert fused_linear_on()
    assert set(holding) <= set(patched_names())
    assert bnb.matmul_4bit is not original and bnb.matmul_4bit._nf4_original is original
    assert not _holding(original)
    nf4.patch_bitsandbytes()  # the plain mode: matmul_4bit back (kept where CUDA's fallback is), dequantize routed
    cuda = "bitsandbytes.backends.cuda.ops" in sys.modules
    assert not fused_linear_on() and (bnb.matmul_4bit is original) is not cuda
    assert bool(set(holding) & set(patched_names())) is cuda and ("bitsandbytes.functional", DQ) in patched_names()
    nf4.unpatch_bitsandbytes()
    _assert_same_bindings(before, _bnb_bindings())
    with nf4.patched_bitsandbytes():
        with nf4.patched_bitsandbytes(fused_linear=True):
            assert fused_linear_on() and bnb.matmul_4bit is not original
        assert not fused_linear_on() and (bnb.matmul_4bit is original) is not cuda
        assert ("bitsandbytes.functional", DQ) in patched_names()
    _assert_same_bindings(before, _bnb_bindings())
    nf4.patch_bitsandbytes(fused_linear=True)
    with nf4.patched_bitsandbytes():  # a plain block inside the fused mode: fused again after it
        assert (bnb.matmul_4bit is original) is not cuda and not fused_linear_on()
    assert fused_linear_on() and bnb.matmul_4bit is not original
    nf4.unpatch_bitsandbytes()
    assert not fused_linear_on()
    _assert_same_bindings(before, _bnb_bindings())
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="fused_linear must be True or False"):
            nf4.patch_bitsandbytes(fused_linear=bad)
    _assert_same_bindings(before, _bnb_bindings())


def test_matmul_4bit_hands_its_state_to_the_fallback(nf4h):
    """While the matmul_4bit replacement runs its original, the fallback's replacement gets the call's own
    QuantState for gemm_4bit's arguments that are that state's tensors and shape (by value: torch.ops hands the
    kernel a new list), so that nf4.dequantize's plan for the state serves it; None for any other arguments, and
    None outside the call; the plain mode does it too."""
    from nf4.integrations.bitsandbytes import route_matmul_4bit
    from nf4.integrations.routes import _state_of_call

    seen = []
    for double_quant in (True, False):
        packed, state = nf4h.quantize((37, 128), torch.bfloat16, 64, double_quant,
                                      seed=nf4h.case_seed("bnb-handover", double_quant))
        _, other = nf4h.quantize((37, 128), torch.bfloat16, 64, double_quant,
                                            seed=nf4h.case_seed("bnb-handover-other", double_quant))

        def original(A, B, quant_state, out=None, bias=None, state=state, other=other):
            args, _ = _fallback_args(quant_state, A, B, None)
            _, _, shape, absmax, blocksize, _, _ = args
            nested = (quant_state.absmax, quant_state.state2.code, quant_state.offset) if quant_state.nested else (
                None, None, None)
            seen.append(_state_of_call(shape, absmax, blocksize, A.dtype, nested[0], nested[1], nested[2]))
            # the other weight's tensors, a float16 x, a copied shape: not the call's state
            o_absmax = other.state2.absmax if other.nested else other.absmax
            o_nested = (other.absmax, other.state2.code, other.offset) if other.nested else (None, None, None)
            seen.append(_state_of_call(shape, o_absmax, blocksize, A.dtype, *o_nested))
            seen.append(_state_of_call(shape, absmax, blocksize, torch.float16, *nested))
            seen.append(_state_of_call((shape[0] - 1, shape[1]), absmax, blocksize, A.dtype, *nested))  # other shape
            # the shape as torch.ops hands it to gemm_4bit's kernel: a new list of the same ints is the call's state
            seen.append(_state_of_call(list(shape), absmax, blocksize, A.dtype, *nested))
            seen.append(_state_of_call(torch.Size(tuple(shape)), absmax, blocksize, A.dtype, *nested))
            return "original"

        route = route_matmul_4bit(original, device_name=lambda index: "NVIDIA H100 80GB HBM3")
        a = nf4h.make_weight((4097, 128), torch.bfloat16, 5)  # past the fused route's rows, to the original
        for fused in (False, True):
            seen.clear()
            with nf4.patched_bitsandbytes(fused_linear=fused):
                assert route(a, packed, state) == "original"
            assert seen[0] is state and seen[1:4] == [None, None, None], (double_quant, fused)
            assert seen[4] is state and seen[5] is state, (double_quant, fused)
        args, _ = _fallback_args(state, a, packed, None)
        assert _state_of_call(args[2], args[3], 64, torch.bfloat16, state.absmax if state.nested else None,
                              state.state2.code if state.nested else None,
                              state.offset if state.nested else None) is None  # outside the call


@pytest.mark.parametrize("m", [0, 1, 32, 33, 128, 129, 1000, 4096, 4097])
@pytest.mark.parametrize("device_name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "Some Other GPU", ""])
def test_routes_matmul_4bit_limits(device_name, m):
    """The fused route's row limit per GPU: 1 to the GPU's ROUTE_MATMUL_4BIT_MAX_M (the default GPU's for
    another GPU and for the interpreter's "")."""
    from nf4.integrations.routes import DEFAULT_GPU, ROUTE_MATMUL_4BIT_MAX_M, routes_matmul_4bit

    limit = next((v for gpu, v in ROUTE_MATMUL_4BIT_MAX_M.items() if device_name and gpu in device_name),
                 ROUTE_MATMUL_4BIT_MAX_M[DEFAULT_GPU])
    assert routes_matmul_4bit(device_name, m) is (1 <= m <= limit)


def test_route_limits_trace_under_compile():
    """The per-GPU limit lookups run inside a compiled Linear4bit's forward: dynamo traces them without a graph
    break (fullgraph), a cold cache and a warm one (a lookup keyed by a table's id() did not trace)."""
    from nf4.integrations import routes
    from nf4.integrations.routes import routes_gemm_4bit, routes_matmul_4bit

    def f(x):
        return x + int(routes_matmul_4bit("NVIDIA H100 80GB HBM3", 5)) + int(routes_gemm_4bit("NVIDIA H200", 200))

    for cold in (True, False):
        if cold:
            routes._limits.clear()
        torch._dynamo.reset()
        assert torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2)).tolist() == [2.0, 2.0]


@needs_interpreter
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_fused_route_conditions(nf4h, double_quant):
    """The matmul_4bit replacement on CPU tensors (interpreter): what it gives nf4.linear (bit for bit
    nf4.linear's own result, `out` filled and returned) and what it leaves to the original with the
    caller's arguments: FP4, a [K, N] weight, fp32 x, rows past the limit, a bias nf4.linear refuses
    (float32 for bf16 x), the plain mode, and after unpatching."""
    from nf4.integrations.bitsandbytes import route_matmul_4bit

    seed = nf4h.case_seed("bnb-fused-conditions", double_quant)
    packed, state = nf4h.quantize((37, 128), torch.bfloat16, 64, double_quant, seed=seed)
    calls = []

    def original(A, B, quant_state, out=None, bias=None):
        calls.append((A, B, quant_state, out, bias))
        return "original"

    route = route_matmul_4bit(original, device_name=lambda index: "NVIDIA H100 80GB HBM3")
    assert route_matmul_4bit(original) is route  # one replacement per original
    a = nf4h.make_weight((3, 5, 128), torch.bfloat16, seed + 1)
    bias = nf4h.make_weight((37,), torch.bfloat16, seed + 2)
    expect = nf4.linear(a, packed, state, bias)
    with nf4.patched_bitsandbytes(fused_linear=True):
        got = route(a, packed, state, bias=bias)
        assert _counts(MM) == (1, 0) and not calls
        assert_bitexact(got, expect, name="routed")
        out = nf4h.poison(torch.empty((3, 5, 37), dtype=torch.bfloat16))
        assert route(a, packed, state, out=out, bias=bias) is out
        assert_bitexact(out, expect, name="routed into out")
        reset_routed_counts()
        w_fp4 = nf4h.make_weight((37, 128), torch.float32, seed + 3)
        packed_fp4, state_fp4 = F.quantize_4bit(w_fp4, blocksize=64, compress_statistics=double_quant,
                                                quant_type="fp4")
        _, state_kn = nf4h.quantize((128, 37), torch.bfloat16, 64, double_quant, seed=seed + 4)
        cpu_packed = copy.copy(state)
        cpu_packed.packing_format_for_cpu = True  # what bitsandbytes' _convert_weight_packed_for_cpu sets
        declined = [
            (a, packed_fp4, state_fp4, None, None),  # FP4
            (nf4h.make_weight((4, 128), torch.bfloat16, seed + 5), packed, state_kn, None, None),  # [K, N]
            (a.float(), packed, state, None, bias.float()),  # fp32 x
            (nf4h.make_weight((4097, 128), torch.bfloat16, seed + 6), packed, state, None, bias),  # past the rows
            (a, packed, state, None, bias.float()),  # a float32 bias for bf16 x: nf4.linear raises, bnb decides
            (a, packed, cpu_packed, None, bias),  # bitsandbytes' CPU repacking (another layout)
        ]
        for args in declined:
            assert route(*args) == "original"
            assert all(x is y for x, y in zip(calls[-1], args, strict=True))
        assert _counts(MM) == (0, len(declined))
    with nf4.patched_bitsandbytes():  # the plain mode: the replacement routes nothing
        assert route(a, packed, state, bias=bias) == "original"
    assert route(a, packed, state, bias=bias) == "original"  # not patched


def test_flag_reads_without_quantstates_getattr(monkeypatch):
    """`_flag` (the fused route's read of `packing_format_for_cpu`) gives getattr(obj, name, False): on a QuantState
    without calling its Python __getattr__ (which raises for a missing name on every call), for an instance or a
    class attribute; on any other object as getattr does, consulting its own __getattr__, which may answer."""
    from nf4.integrations.routes import _flag

    calls = []

    def counting_getattr(self, name):
        calls.append(name)
        raise AttributeError(name)

    monkeypatch.setattr(F.QuantState, "__getattr__", counting_getattr)
    state = F.QuantState(absmax=torch.ones(1), shape=(1, 64), blocksize=64, quant_type="nf4")
    assert _flag(state, "packing_format_for_cpu") is False and calls == []
    monkeypatch.setattr(F.QuantState, "packing_format_for_cpu", "class value", raising=False)
    assert _flag(state, "packing_format_for_cpu") == "class value" and calls == []
    monkeypatch.delattr(F.QuantState, "packing_format_for_cpu")
    state.packing_format_for_cpu = True
    assert _flag(state, "packing_format_for_cpu") is True and calls == []
    assert getattr(state, "missing", False) is False and calls == ["missing"]  # the patched __getattr__ is live

    class Proxy:  # another class's __getattr__ may answer the name: it is asked
        def __getattr__(self, name):
            return name == "packing_format_for_cpu"

    assert _flag(Proxy(), "packing_format_for_cpu") is True
    assert _flag((1, 2), "packing_format_for_cpu") is False  # no __dict__
    assert _flag(types.SimpleNamespace(packing_format_for_cpu=1), "packing_format_for_cpu") == 1


@needs_interpreter
@pytest.mark.parametrize("compress_statistics", [True, False], ids=["dq", "nodq"])
def test_linear4bit_cpu_fused_route(nf4h, compress_statistics):
    """A Linear4bit in the fused mode (interpreter): 1 and 15 rows go to nf4.linear (its output and input
    gradient bit for bit, within the float32 accumulation bound of the exact product), 4097 rows (past the
    route) to bitsandbytes (bit-identical to unpatched); a float32 compute dtype stays with bitsandbytes."""
    seed = nf4h.case_seed("bnb-fused-linear4bit", compress_statistics)
    layer = _linear4bit(nf4h, 128, 37, seed, compress_statistics=compress_statistics,
                        compute_dtype=torch.bfloat16, device="cpu")
    qs = layer.weight.quant_state
    for i, lead in enumerate([(1,), (3, 5), (4097,)]):
        x = nf4h.make_weight((*lead, 128), torch.bfloat16, seed + 10 + i)
        y0, g0, _ = _forward_backward(layer, x)
        reset_routed_counts()
        with nf4.patched_bitsandbytes(fused_linear=True):
            y1, g1, after_forward = _forward_backward(layer, x)
        if lead == (4097,):
            assert after_forward.get((MM, "bitsandbytes")) == 1 and (MM, "nf4") not in after_forward
            assert_bitexact(y1, y0, name="4097 rows: bitsandbytes")
            assert_bitexact(g1, g0, name="4097 rows: input gradient")
            continue
        assert after_forward == {(MM, "nf4"): 1}, after_forward
        xe = x.detach().clone().requires_grad_(True)
        ye = nf4.linear(xe, layer.weight, qs, layer.bias.to(torch.bfloat16))
        ye.sum().backward()
        assert_bitexact(y1, ye.detach(), name=f"{lead}: nf4.linear")
        assert_bitexact(g1, xe.grad, name=f"{lead}: nf4.linear input gradient")
        _within_bound(y1, x, layer, f"{lead}: routed forward")
    layer32 = _linear4bit(nf4h, 128, 19, seed + 1, compress_statistics=compress_statistics,
                          compute_dtype=torch.float32, device="cpu")
    x = nf4h.make_weight((2, 128), torch.float32, seed + 20)
    y0, _, _ = _forward_backward(layer32, x)
    reset_routed_counts()
    with nf4.patched_bitsandbytes(fused_linear=True):
        y1, _, after_forward = _forward_backward(layer32, x)
    assert after_forward == {(MM, "bitsandbytes"): 1}
    assert_bitexact(y1, y0, name="float32 compute dtype")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compress_statistics", [True, False], ids=["dq", "nodq"])
def test_linear4bit_cuda_fused_route(nf4h, compress_statistics):
    """CUDA, the fused mode, a layer quantized from bf16 weights (its QuantState bf16, as x: nf4.linear's
    tensor-core GEMV runs): a Linear4bit forward of 1, 5, 16 and 32 rows (no grad, as in decode; and 5 rows
    with grad) is nf4.linear's (bit for bit; within the float32 accumulation bound of the exact product), 33
    rows bitsandbytes' path as in the plain mode, or where the routes send them to nf4.linear its bits;
    torch.compile(fullgraph=True) of the patched layer at one row gives the eager bits; 300 rows with grad give the
    plain patch's bits (both nf4.dequantize + cuBLAS there). (Where nf4.linear's table takes nf4.dequantize + cuBLAS
    instead, as at M = 33-64 on these rows of 512 weights on the H100 and the H200, or for a float32 QuantState,
    cuBLAS's bf16 reductions are not held to that bound: tests/nf4/linear/test_sum.py.)"""
    from nf4.integrations.routes import routes_matmul_4bit
    from nf4.linear.tuned import tuned

    name = torch.cuda.get_device_name(0)
    seed = nf4h.case_seed("bnb-fused-cuda", compress_statistics)
    layer = _linear4bit(nf4h, 512, 333, seed, compress_statistics=compress_statistics,
                        compute_dtype=torch.bfloat16, device="cuda", weight_dtype=torch.bfloat16)
    assert layer.weight.quant_state.dtype == torch.bfloat16
    qs, bias = layer.weight.quant_state, layer.bias.to(torch.bfloat16)
    for m in (1, 5, 16, 32, 33):
        x = nf4h.make_weight((m, 512), torch.bfloat16, seed + m, "cuda")
        with torch.no_grad():
            plain = layer(x)
            reset_routed_counts()
            with nf4.patched_bitsandbytes(fused_linear=True):
                got = layer(x)
                again = layer(x)  # the repeat call (a Params4bit weight, bound launch)
            expect = nf4.linear(x, layer.weight.data, qs, bias)
        if not routes_matmul_4bit(name, m):
            assert _counts(MM) == (0, 2)
            assert_bitexact(got, plain, name=f"M={m}: bitsandbytes")
            continue
        assert _counts(MM) == (2, 0)
        assert_bitexact(got, expect, name=f"M={m}")
        assert_bitexact(again, expect, name=f"M={m}, repeat call")
        if tuned(name, m, n=333, k=512).kernel != "dequant":  # the fused kernels' float32 sums (see the docstring)
            _within_bound(got, x, layer, f"M={m}")
    x = nf4h.make_weight((5, 512), torch.bfloat16, seed + 99, "cuda")
    reset_routed_counts()
    with nf4.patched_bitsandbytes(fused_linear=True):
        y1, g1, after_forward = _forward_backward(layer, x)
    assert after_forward == {(MM, "nf4"): 1}
    xe = x.detach().clone().requires_grad_(True)
    ye = nf4.linear(xe, layer.weight, qs, bias)
    ye.sum().backward()
    assert_bitexact(y1, ye.detach(), name="with grad")
    assert_bitexact(g1, xe.grad, name="input gradient")
    # Past nf4.linear's fused rows it runs nf4.dequantize + cuBLAS, as the plain patch's bitsandbytes fallback does
    # (the plain patch sends gemm_4bit to that fallback from ROUTE_GEMM_4BIT_MIN_M rows): the same bits, forward and
    # input gradient, with a fresh gradient path through nf4.linear's autograd function.
    x = nf4h.make_weight((300, 512), torch.bfloat16, seed + 98, "cuda")
    with nf4.patched_bitsandbytes():
        y0, g0, _ = _forward_backward(layer, x)
    reset_routed_counts()
    with nf4.patched_bitsandbytes(fused_linear=True):
        y1, g1, after_forward = _forward_backward(layer, x)
    assert routes_matmul_4bit(name, 300) and after_forward == {(MM, "nf4"): 1}
    assert_bitexact(y1, y0, name="300 rows: the plain patch's forward")
    assert_bitexact(g1, g0, name="300 rows: the plain patch's input gradient")
    x1 = nf4h.make_weight((1, 512), torch.bfloat16, seed + 100, "cuda")
    with torch.no_grad(), nf4.patched_bitsandbytes(fused_linear=True):
        eager = layer(x1)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)
        assert_bitexact(compiled(x1), eager, name="compiled, one row")


# --- 6. import nf4 alone ---------------------------------------------------------------------------


def test_import_nf4_does_not_import_bitsandbytes():
    code = ("import sys, nf4, nf4.integrations.bitsandbytes\n"
            "assert callable(nf4.patch_bitsandbytes) and callable(nf4.unpatch_bitsandbytes)\n"
            "loaded = [m for m in sys.modules if m == 'bitsandbytes' or m.startswith('bitsandbytes.')]\n"
            "print('loaded:', loaded)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded: []" in result.stdout, result.stdout


def test_torch_ops_hands_a_new_shape_list_and_the_same_tensors():
    """What the handover relies on, through a torch.library op of gemm_4bit's argument kinds (int[] and Tensor): the
    kernel receives the caller's tensor objects and a new list for the shape, so the shape must be compared by value
    (a run on GPUs routed every prefill dequantization through a rebuilt QuantState while it was compared by
    identity)."""
    lib = torch.library.Library("nf4_test_handover", "DEF")
    lib.define("probe(Tensor A, int[] shapeB, Tensor absmax) -> Tensor")
    seen = {}

    def kernel(A, shapeB, absmax):
        seen.update(A=A, shapeB=shapeB, absmax=absmax)
        return A.clone()

    lib.impl("probe", kernel, "CPU")
    a, absmax, shape = torch.randn(3), torch.randn(4), torch.Size([5, 6])
    torch.ops.nf4_test_handover.probe.default(a, shape, absmax)
    assert seen["A"] is a and seen["absmax"] is absmax
    assert seen["shapeB"] is not shape and list(seen["shapeB"]) == [5, 6]


@needs_interpreter
def test_routed_calls_leave_the_state_tensors_as_they_were(nf4h):
    """After routed fallback calls (the shape as torch.ops hands it), the QuantState's tensors carry no attributes
    of nf4's and a checkpoint of them saves and loads with weights_only=True (torch.save pickles a tensor's
    __dict__: a cache kept there would ride into every checkpoint)."""
    import io

    packed, state = F.quantize_4bit(nf4h.make_weight((37, 128), torch.float32, 5), blocksize=64,
                                    compress_statistics=True, quant_type="nf4")
    state = nf4h.clone_state(state, dtype=torch.bfloat16)
    a = nf4h.make_weight((3, 128), torch.bfloat16, 6)
    route = route_dequant_linear_fallback(lambda *args, **kwargs: "original")
    args, kwargs = _fallback_args(state, a, packed, None)
    with nf4.patched_bitsandbytes():
        for _ in range(2):
            route(*args[:2], list(args[2]), *args[3:], **kwargs)
    tensors = {"absmax": state.absmax, "absmax2": state.state2.absmax, "code": state.state2.code,
               "offset": state.offset, "packed": packed}
    assert all(not vars(t) for t in tensors.values()), {k: vars(t) for k, t in tensors.items()}
    buf = io.BytesIO()
    torch.save(tensors, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert all(torch.equal(back[k], t) for k, t in tensors.items())


def _parts_case(nf4h, name: str, double_quant: bool):
    """A seeded 37 x 128 NF4 weight with a bf16 state, x of 3 rows, and the fallback route around a stub: the
    kept-state tests' set-up."""
    seed = nf4h.case_seed(name, double_quant)
    packed, state = F.quantize_4bit(nf4h.make_weight((37, 128), torch.float32, seed), blocksize=64,
                                    compress_statistics=double_quant, quant_type="nf4")
    state = nf4h.clone_state(state, dtype=torch.bfloat16)
    a = nf4h.make_weight((3, 128), torch.bfloat16, seed + 1)
    route = route_dequant_linear_fallback(lambda *args, **kwargs: "original")
    return packed, state, a, route


@needs_interpreter
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_fallback_without_handover_makes_one_state_per_parts(nf4h, double_quant):
    """A compiled forward reaches the fallback without matmul_4bit's handover, with the shape as the new list that
    torch.ops makes and the packed weight as an alias made anew each call (no `_base`: tests/nf4/integrations'
    compiled test shows inductor's): the state rebuilt from the parts is made once and kept by the state's absmax
    tensor (one state per shape, dtype and blocksize: a second call adds none and keeps the same object, a packed
    tensor that is no view too); other tensors (a clone of one) replace it, another dtype gets another; the results
    stay bit-exact; and nothing outlives the weight (the kept state and its tensors go with the absmax tensor)."""
    import gc
    import weakref

    from nf4.integrations import routes

    packed, state, a, route = _parts_case(nf4h, "bnb-parts-cache", double_quant)
    args, kwargs = _fallback_args(state, a, packed, None)  # B is packed.view(-1, 1): a view, as gemm_4bit gets
    args = (*args[:2], list(args[2]), *args[3:])  # the shape as torch.ops hands it
    root = state.absmax  # the state's own absmax (the 8-bit one where nested): what the state is kept by
    expect = torch.nn.functional.linear(a, F.dequantize_4bit(packed, state))

    def kept(owner):
        return [st for _, st in routes._FROM_PARTS[id(owner)].values()]

    with nf4.patched_bitsandbytes():
        first = route(*args, **kwargs)
        (made,) = kept(root)
        again = route(*args, **kwargs)
        plain = route(args[0], packed.reshape(-1, 1).clone(), *args[2:], **kwargs)  # no view (as inductor's alias)
        assert kept(root) == [made]  # the same state, none added
        assert tuple(made.shape) == (37, 128) and made.dtype is torch.bfloat16
        assert made.absmax is not root and made.absmax.data_ptr() == root.data_ptr()  # an alias, not the tensor
        if double_quant:  # another code2: made again, in the same slot
            other = route(*args, **{**kwargs, "absmax_code": kwargs["absmax_code"].clone()})
            assert len(kept(root)) == 1 and kept(root)[0] is not made
        else:  # another absmax tensor: kept by that tensor
            clone = args[3].clone()
            other = route(args[0], args[1], args[2], clone, *args[4:], **kwargs)
            assert kept(root) == [made] and len(kept(clone)) == 1 and kept(clone)[0] is not made
            del clone
        half = route(a.half(), *args[1:], **kwargs)
        assert len(kept(root)) == 2
    for got in (first, again, other, plain):
        assert_bitexact(got, expect)
    assert half.dtype is torch.float16
    kept_tensor, key = weakref.ref(args[3]), id(root)
    del args, kwargs, state, packed, root, made, first, again, other, half, plain, expect
    gc.collect()
    assert key not in routes._FROM_PARTS and kept_tensor() is None


@needs_interpreter
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_kept_state_after_an_in_place_change_gives_fresh_bits(nf4h, double_quant):
    """The state kept per packed weight is the same object after its tensors change in place (same identities):
    nf4.dequantize's own check sees the new versions, so the next routed call gives the bits of the changed
    state, as bitsandbytes' dequantize + F.linear of it does."""
    from nf4.integrations import routes

    packed, state, a, route = _parts_case(nf4h, "bnb-parts-inplace", double_quant)
    args, kwargs = _fallback_args(state, a, packed, None)
    args = (*args[:2], list(args[2]), *args[3:])
    root = state.absmax
    with nf4.patched_bitsandbytes():
        route(*args, **kwargs)
        route(*args, **kwargs)  # (on a GPU the second call binds nf4.dequantize's repeat launch)
        ((_, made),) = routes._FROM_PARTS[id(root)].values()
        if double_quant:
            state.offset.mul_(0.5)  # in place: the same tensor objects
        else:
            state.absmax.mul_(2.0)
        got = route(*args, **kwargs)
        assert [st for _, st in routes._FROM_PARTS[id(root)].values()] == [made]
    assert_bitexact(got, torch.nn.functional.linear(a, F.dequantize_4bit(packed, state)))


@needs_interpreter
def test_compiled_fallback_keeps_one_state_per_weight(nf4h):
    """Compiled as a forward is (the packed weight a Parameter, reached through an opaque op as bitsandbytes'
    gemm_4bit is), the fallback gets the packed weight as an alias that inductor makes anew for every call (torch
    2.13: no `_base`, so nothing could be kept by the packed tensor) and the state's tensors as the same objects:
    three compiled calls make one state, kept by the state's absmax tensor, with the bits of bitsandbytes'
    dequantize + F.linear."""
    from nf4.integrations import routes

    seed = nf4h.case_seed("bnb-compiled-parts")
    raw, state = F.quantize_4bit(nf4h.make_weight((37, 128), torch.float32, seed), blocksize=64,
                                    compress_statistics=True, quant_type="nf4")
    state = nf4h.clone_state(state, dtype=torch.bfloat16)
    packed = torch.nn.Parameter(raw, requires_grad=False)
    a = nf4h.make_weight((3, 128), torch.bfloat16, seed + 1)
    route = route_dequant_linear_fallback(lambda *args, **kwargs: "original")
    bases = []

    @torch.library.custom_op("nf4_tests::fallback_probe", mutates_args=())
    def probe(a: torch.Tensor, b: torch.Tensor, absmax: torch.Tensor, absmax_8bit: torch.Tensor,
              code: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        bases.append(b._base)
        return route(a, b, [37, 128], absmax, 64, "nf4", None, absmax_8bit=absmax_8bit, absmax_code=code,
                     absmax_offset=offset)

    @probe.register_fake
    def _(a, b, absmax, absmax_8bit, code, offset):
        return a.new_empty((a.shape[0], 37))

    def forward(x):
        return probe(x, packed.view(-1, 1), state.state2.absmax, state.absmax, state.state2.code, state.offset)

    compiled = torch.compile(forward, fullgraph=True)
    expect = torch.nn.functional.linear(a, F.dequantize_4bit(raw, state))
    routes._FROM_PARTS.pop(id(state.absmax), None)
    with nf4.patched_bitsandbytes():
        outs = [compiled(a) for _ in range(3)]
    assert len(bases) == 3
    assert len(routes._FROM_PARTS[id(state.absmax)]) == 1
    for got in outs:
        assert_bitexact(got, expect)
