"""The README's snippet runs as written on a CPU, in Triton's interpreter (its `dev` set to "cpu", as it says)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_its_api_snippet():
    assert len(_snippets()) == 1 and "nf4.linear" in _snippets()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the snippet (a CUDA machine runs it as is)")
def test_the_readme_snippet_runs_on_a_cpu(tmp_path):
    code = _snippets()[0]
    assert 'dev = "cuda"' in code
    code = code.replace('dev = "cuda"', 'dev = "cpu"', 1)
    # the snippet's last value must be a real product: checked against the dequantized weight in float64
    code += ("\nw64 = nf4.dequantize(packed, state).double()\n"
             "ref = x.double() @ w64.t()\n"
             "assert y.shape == ref.shape and torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2), "
             "(y - ref).abs().max()\n"
             "print('snippet ok')\n")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "snippet ok" in proc.stdout


def test_the_readme_catalog_claims_hold_in_the_committed_results():
    """The README's speed sentences are checked against results/catalog/dequant_<gpu>.json (no number typed)."""
    import json

    from paper.sections import catalog

    text = (ROOT / "README.md").read_text()
    assert "faster than bitsandbytes' on every shape on the H100 and the H200" in text
    assert "faster at the median on both" in text
    for gpu in ("h100", "h200"):
        s = catalog.summary(json.loads((ROOT / "results" / "catalog" / f"dequant_{gpu}.json").read_text()))
        bnb, unsloth = s["peers"]["bnb_dequantize_4bit"], s["peers"]["unsloth_dequantize"]
        assert bnb[3] == 0 and bnb[4] == s["rows"] > 0, (gpu, bnb)  # slower on no row
        assert unsloth[1] > 1.0, (gpu, unsloth)  # the median speedup


def test_the_readme_decode_and_fsdp_claims_hold_in_the_committed_results():
    """The README's decode and FSDP sentences against results/decode/decode_h200.json and results/fsdp/."""
    import json

    from paper.sections import decode

    text = (ROOT / "README.md").read_text()
    assert "is faster than dense bf16 and than bitsandbytes alone, but short of the 2x its bytes allow" in text
    assert "its median step is at least as fast as bitsandbytes alone's" in text
    rows = decode.summary(json.loads((ROOT / "results" / "decode" / "decode_h200.json").read_text()))
    fused = next(r for r in rows if r["mode"] == "nf4-fused" and r["batch"] == 1 and r["layers"] == 32)
    assert 1.0 < fused["vs_dense"] < decode.BAR and 1.0 < fused["vs_bnb"] < decode.BAR, fused
    assert "At batch 8 and 32 it is within a tenth of dense bf16" in text
    assert "and faster than bitsandbytes alone." in text
    for batch in (8, 32):
        at = next(r for r in rows if r["mode"] == "nf4-fused" and r["batch"] == batch and r["layers"] == 32)
        assert 0.9 <= at["vs_dense"] <= 1.1 and at["vs_bnb"] > 1.0, at
    fsdp = json.loads((ROOT / "results" / "fsdp" / "fsdp_qlora_h200x2.json").read_text())
    assert fsdp["config"].get("interleave") and fsdp["verdicts"]["speedup_nf4_vs_bnb"] >= 1.0
    medians = {k: r["time"]["median_ms"] for k, r in fsdp["runs"].items()}
    assert medians["nf4"] <= min(medians["bnb"], medians["bnb_repeat"]) and fsdp["runs"]["nf4"]["time"]["n"] >= 50
