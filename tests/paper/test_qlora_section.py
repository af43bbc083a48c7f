"""paper.sections.qlora: the end-to-end bars and table from a result file's rows, never typed."""

from __future__ import annotations

import json
import re

from paper import generate
from paper.sections import qlora


def _payload(step=1.2, fused=1.3, bound=1.5, decode=1.1, commit="abc1234"):
    def mode(speedup, exact=True, is_bound=False, key="bitexact_vs_bnb"):
        return {"speedup": speedup, key: None if is_bound else exact, **({"bound": True} if is_bound else {})}

    return {"env": {"commit": commit, "device": "NVIDIA H100 80GB HBM3"},
            "rows": [{"shape": "1x512", "speedup": step, "bitexact_vs_bnb": True, "bnb_ms": 20.0, "bnb_kernel_ms": 5.0,
                      "bnb": {"n": 100},
                      "modes": {"nf4_fused": mode(fused), "no_matmul": mode(bound, is_bound=True),
                                "dense": mode(bound + 0.1, is_bound=True)}},
                     {"shape": "8x2048", "error": "OutOfMemoryError"}],
            "decode": [{"bnb_tok_s": 10.0, "speedup": decode, "tokens_identical": True,
                        "modes": {"nf4_fused": mode(decode + 0.5, exact=False, key="tokens_identical"),
                                  "no_matmul": mode(2.5, is_bound=True, key="tokens_identical")}}]}


def _generate(tmp_path, payloads):
    for tag, payload in payloads.items():
        (tmp_path / f"qlora_{tag}.json").write_text(json.dumps(payload))
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    return dict(re.findall(r"\\newcommand\{\\(NFqlora[A-Za-z]+)\}\{(.*)\}", files["macros.tex"])), files, missing


def test_bars_take_the_best_of_nf4s_modes_not_the_bounds(tmp_path):
    macros, files, _ = _generate(tmp_path, {"h100": _payload(), "h200": _payload(step=1.2, fused=1.1)})
    assert macros["NFqloraBarStepHOneHundred"] == "met" and macros["NFqloraBarStepValueHOneHundred"] == "1.30"
    assert macros["NFqloraBarStepModeHOneHundred"] == r"nf4\_fused"
    assert macros["NFqloraBarStepHTwoHundred"] == "met" and macros["NFqloraBarStepValueHTwoHundred"] == "1.20"
    assert macros["NFqloraStepNoMatmulHOneHundred"] == "1.50" and macros["NFqloraStepDenseHOneHundred"] == "1.60"
    # decode: 1.6 is under the bar of 2 although the no_matmul bound is 2.5
    assert macros["NFqloraBarDecodeHOneHundred"] == "missed" and macros["NFqloraBarDecodeValueHOneHundred"] == "1.60"
    assert macros["NFqloraDecodeNoMatmulHOneHundred"] == "2.50" and macros["NFqloraCommitHOneHundred"] == "abc1234"
    assert macros["NFqloraStepBnbKernelPctHOneHundred"] == "25.0" and macros["NFqloraStepBnbMsHOneHundred"] == "20.0"
    assert macros["NFqloraStepsHOneHundred"] == "100" and macros["NFqloraStepPlainHOneHundred"] == "1.20"
    table = files["qlora_table.tex"]
    assert r"1.30$\times$ (exact)" in table and r"1.50$\times$ (bound)" in table
    assert r"1.60$\times$ (not exact)" in table and "8$\\times$2048" not in table  # the failed shape has no rows


def test_missing_file_gives_placeholders(tmp_path):
    macros, files, missing = _generate(tmp_path, {"h100": _payload(step=1.0, fused=1.0)})
    assert macros["NFqloraBarStepHOneHundred"] == "missed"
    assert macros["NFqloraBarStepHTwoHundred"] == generate.NM and macros["NFqloraCommitHTwoHundred"] == generate.NM
    assert macros["NFqloraStepsHTwoHundred"] == generate.NM and macros["NFqloraStepPlainHTwoHundred"] == generate.NM
    assert any("qlora_h200.json" in m for m in missing)
    assert "H200" not in files["qlora_table.tex"]


def test_shape_label():
    assert qlora._shape("1x512") == r"1$\times$512"
