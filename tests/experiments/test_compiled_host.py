"""experiments.compiled_host without a GPU: the refusal, and its forms on a small weight in Triton's interpreter (the
opaque ops called directly give the eager call's bits; the route is the tuned table's kernel)."""

from __future__ import annotations

import importlib

import pytest
import torch

import nf4
from experiments import compiled_host


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    assert compiled_host.main(["--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors in Triton's interpreter")
def test_forms_on_a_small_weight(nf4h):
    importlib.import_module("nf4.linear.ops")  # registers the ops

    n, k = 40, 128
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, True, seed=nf4h.case_seed("compiled-host"))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    route, forms = compiled_host._forms(packed, qs, x, n, k)
    names = [name for name, _ in forms]
    assert names == ["compiled", "eager", "nf4::linear_opaque", "nf4::dequantize_matmul_opaque"]
    assert isinstance(route, str) and route
    eager = dict(forms)["eager"](x)
    assert torch.equal(eager.view(torch.int16), nf4.linear(x, packed, qs).view(torch.int16))
    opaque = dict(forms)["nf4::linear_opaque"](x)
    assert opaque.shape == (3, n) and torch.equal(opaque.view(torch.int16), eager.view(torch.int16))
    product = dict(forms)["nf4::dequantize_matmul_opaque"](x)  # the dequant path: nf4.dequantize, then the product
    want = torch.nn.functional.linear(x, nf4.dequantize(packed, qs))
    assert torch.equal(product.view(torch.int16), want.view(torch.int16))
