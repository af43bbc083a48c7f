"""experiments linear-host on a machine without CUDA: it refuses with exit code 2 (it times a GPU's host path only),
through `python -m experiments` too; its argument helpers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import linear_host

ROOT = Path(__file__).resolve().parents[2]


def test_parse_shape():
    assert linear_host.parse_shape("14336x4096") == (14336, 4096)
    assert linear_host.parse_shape("4096X1024") == (4096, 1024)


def test_unknown_form_is_refused():
    with pytest.raises(ValueError, match="form must be one of"):
        linear_host.form_call("nope", layer=None, dense_weight=None, contexts={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "host.json"
    assert linear_host.main(["--out", str(out)]) == 2
    proc = subprocess.run([sys.executable, "-m", "experiments", "linear-host", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not out.exists()
