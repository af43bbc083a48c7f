"""experiments.labs.gemm_tma (the GEMM lab) on a CPU: which candidates run at which M, the report and the paper's
summary by hand (an inexact candidate is never the best exact one), and an offline sm_90 build of the swap-AB
candidate: no local memory, wgmma with a register operand, one wgmma group left in flight. No GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.labs import gemm_tma as gt
from paper.sections import gemm_lab


def test_fits_by_m():
    assert gt.fits("gemv_n128_m16", 1) and gt.fits("gemv_n128_m16", 16) and not gt.fits("gemv_n128_m16", 17)
    assert gt.fits("swap_n128_m32", 17) and gt.fits("swap_n128_m64", 64) and not gt.fits("swap_n128_m64", 65)
    assert gt.fits("dense_m128_n256", 65) and not gt.fits("dense_m128_n256", 64)


def _payload():
    def r(provider, us, **kw):
        return {"N": 256, "K": 512, "M": 512, "provider": provider, "graph_us": us, **kw}

    return {"device": "test GPU", "environment": {"commit": "abc"},
            "candidates": {"swap_n128_m256": [0, 256, 128, 8, 3, True, True, 1],
                           "tma_m128_n128": [0, 128, 128, 8, 4, False, True, 1],
                           "dense_m128_n128": [1, 128, 128, 8, 4, False, True, 1],
                           "nolookup_swap_n128_m128": [2, 128, 128, 8, 4, True, True, 1]},
            "rows": [r("cublas_dense", 10.0), r("nf4.linear", 15.0),
                     r("tma_m128_n128", 11.0, operand_mismatches=2, random_within_bound=True),  # inexact: not best
                     r("swap_n128_m256", 13.0, operand_mismatches=0, random_within_bound=True),
                     r("dense_m128_n128", 10.5, operand_mismatches=0, random_within_bound=True),
                     r("nolookup_swap_n128_m128", 17.0, operand_mismatches=99, random_within_bound=False)]}


def test_paper_summary_by_hand():
    s = gemm_lab.summary(_payload())[(256, 512, 512)]
    assert s["cublas"] == 10.0 and s["nf4"] == pytest.approx(1.5)
    assert s["exact"] == (pytest.approx(1.3), "swap_n128_m256")
    assert s["dense"][0] == pytest.approx(1.05) and s["nolookup"][0] == pytest.approx(1.7)


def test_report_by_hand(tmp_path):
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(_payload()))
    text = gt.report([str(path)])
    assert "| 256 x 512 | 512 | 10.0 | 1.50 | 1.30 (swap_n128_m256) | 1.05 | 1.70 |" in text


@pytest.mark.slow  # two offline sm_90 builds in a child process without the interpreter (make test-long)
def test_builds_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "experiments.labs.gemm_tma", "--build", "swap_n128_m128",
                          "tma_m128_n128"], capture_output=True, text=True, env=env, timeout=900, check=True).stdout
    swap, plain = json.loads(out.strip().splitlines()[-1])
    assert swap["local"] == 0 and plain["local"] == 0
    assert swap["wgmma_register_a"] and swap["wgmma_in_flight"] >= 1  # decode overlaps the previous wgmma
    assert not plain["wgmma_register_a"] and plain["wgmma_in_flight"] == 0  # one shared buffer: each wgmma waited on
