"""The mistakes a new user made, each answered by a ValueError/TypeError that names the field and what
was expected, never by a wrong result or an error from deep inside Triton; and the inputs that look
odd but are valid (an integral blocksize of another type, an empty weight) give bitsandbytes' result."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.dequant.kernel import nf4_dequantize_kernel
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_dequantize_kernel, InterpretedFunction),
    reason="CPU tensors need Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA)")

F = pytest.importorskip("bitsandbytes.functional")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def weight(nf4h):
    """(packed, state, the weight nf4 gives for them): fresh seeded data with a tail block."""
    packed, state = nf4h.quantize((7, 67), torch.bfloat16, 64, True, seed=nf4h.case_seed("errors"))
    return packed, state, nf4.dequantize(packed, state)


def _with(state, **changes):
    new = copy.copy(state)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


@pytest.mark.parametrize("blocksize", [64.0, np.int64(64), np.int32(64), torch.tensor(64), np.float32(64.0)],
                         ids=["float", "np.int64", "np.int32", "0-d tensor", "np.float32"])
def test_integral_blocksize_of_another_type_is_accepted(weight, blocksize):
    packed, state, expected = weight
    assert_bitexact(nf4.dequantize(packed, _with(state, blocksize=blocksize)), expected, name=repr(blocksize))


@pytest.mark.parametrize(("blocksize", "exc", "pattern"), [
    (64.5, ValueError, r"quant_state\.blocksize must be an integral value, got 64\.5"),
    ("64", TypeError, r"quant_state\.blocksize must be an integer, got str '64'"),
    (torch.tensor([64]), TypeError, r"quant_state\.blocksize must be an integer, got a torch\.int64 tensor of shape"),
    (True, TypeError, r"quant_state\.blocksize must be an integer, got bool"),
    (None, TypeError, r"quant_state\.blocksize must be an integer, got NoneType"),
    (96, ValueError, r"quant_state\.blocksize must be one of \(32, 64.*got 96"),
], ids=["64.5", "str", "1-d tensor", "bool", "None", "96"])
def test_bad_blocksize(weight, blocksize, exc, pattern):
    packed, state, _ = weight
    with pytest.raises(exc, match=pattern):
        nf4.dequantize(packed, _with(state, blocksize=blocksize))


@pytest.mark.parametrize("ftz", [1, 0, "yes", np.float32(1.0)], ids=["1", "0", "str", "np.float32"])
def test_ftz_must_be_a_bool(weight, ftz):
    packed, state, _ = weight
    with pytest.raises(TypeError, match=r"ftz must be True, False or None .*got"):
        nf4.dequantize(packed, state, ftz=ftz)


def test_ftz_numpy_bool_is_a_bool(weight):
    packed, state, _ = weight
    assert_bitexact(nf4.dequantize(packed, state, ftz=np.bool_(False)), nf4.dequantize(packed, state, ftz=False))


@pytest.mark.parametrize("state", ["tensor", "dict", "list", "tuple", "object"])
def test_quant_state_must_be_a_quant_state(weight, state):
    packed, real, _ = weight
    bad = {"tensor": real.absmax, "dict": real.as_dict(), "list": [real.absmax], "tuple": (real.absmax,),
           "object": object()}[state]
    with pytest.raises(TypeError, match=r"quant_state must be a bitsandbytes QuantState .*got " + type(bad).__name__):
        nf4.dequantize(packed, bad)


@pytest.mark.parametrize(("shape", "exc", "pattern"), [
    (torch.Size([-7, 67]), ValueError, r"quant_state\.shape must hold non-negative integers, got \(-7, 67\)"),
    ((7.5, 67), ValueError, r"quant_state\.shape\[0\] must be an integral value, got 7\.5"),
    ((7, "67"), TypeError, r"quant_state\.shape\[1\] must be an integer, got str"),
    (469, TypeError, r"quant_state\.shape must be a torch\.Size or a tuple of integers, got int"),
], ids=["negative", "float", "str", "int"])
def test_bad_shape(weight, shape, exc, pattern):
    packed, state, _ = weight
    with pytest.raises(exc, match=pattern):
        nf4.dequantize(packed, _with(state, shape=shape))


def test_integral_shape_entries_of_another_type_are_accepted(weight):
    packed, state, expected = weight
    got = nf4.dequantize(packed, _with(state, shape=(np.int64(7), 67.0)))
    assert_bitexact(got, expected)


def test_meta_weight(weight):
    packed, state, _ = weight
    with pytest.raises(ValueError, match=r"weight is on the meta device.*expected a CUDA tensor"):
        nf4.dequantize(packed.to("meta"), state)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0,)], ids=str)
def test_empty_weight_gives_an_empty_result_like_bitsandbytes(double_quant, shape):
    packed, state = F.quantize_4bit(torch.empty(shape), blocksize=64, compress_statistics=double_quant,
                                    quant_type="nf4")
    got = nf4.dequantize(packed, state)
    assert got.shape == tuple(state.shape) and got.dtype == state.dtype and got.numel() == 0
    if len(shape) == 2:  # bitsandbytes' CPU route returns (1, n) for a 1-D shape (a known defect of it)
        expected = F.dequantize_4bit(packed, state)
        assert got.shape == expected.shape and got.dtype == expected.dtype


def test_cpu_tensor_without_the_interpreter_says_what_to_set(tmp_path):
    """Without TRITON_INTERPRET, a CPU weight gets an error saying what to set and when, not a Triton error."""
    code = ("import torch, bitsandbytes.functional as F, nf4\n"
            "p, s = F.quantize_4bit(torch.randn(4, 64), blocksize=64, quant_type='nf4')\n"
            "try:\n    nf4.dequantize(p, s)\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ValueError: weight is a CPU tensor" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout
    assert "before triton is first imported" in out.stdout
