"""experiments.labs.gluon_gemm / gluon_ws: the Gluon kernels' column bookkeeping, replayed in NumPy with the same
reshapes and permutations the kernels apply to their registers, against fragment.py's model; x's permutation; the
split and report helpers. The kernels themselves run on a GPU only (gluon_gemm's operand checks); the slow test builds
them offline for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from experiments.labs import fragment as fr
from experiments.labs import gluon_gemm as gg


def _packed_element_grid(bn: int) -> np.ndarray:
    """[bn, 4 (q), 2 (v), 2 (j0), 2 (j1), 2 (e)]: the packed element of the step each decoded half holds, in the
    order gluon_gemm._decode builds it (words 2q + v, pair j = 2 j1 + j0 of table_pairs, half e)."""
    g = np.zeros((bn, 4, 2, 2, 2, 2), dtype=np.int64)
    for q in range(4):
        for v in range(2):
            for j0 in range(2):
                for j1 in range(2):
                    for e in range(2):
                        g[:, q, v, j0, j1, e] = fr.packed_element(q, v, 2 * j1 + j0, e)
    return g


def test_register_operand_relabelling_is_the_fragment_model():
    # gluon_gemm._decode: permute [0, 2, 4, 3, 1, 5], then reshape to [BN, 64]: column f must hold perm()[f]
    tile = np.transpose(_packed_element_grid(16), [0, 2, 4, 3, 1, 5]).reshape(16, 64)
    assert (tile == fr.perm()[None, :]).all()
    # and a different permutation would not be
    wrong = np.transpose(_packed_element_grid(16), [0, 2, 3, 4, 1, 5]).reshape(16, 64)
    assert not (wrong == fr.perm()[None, :]).all()


def test_in_kernel_x_relabelling_is_perm():
    # gluon_gemm._step with X_REG: x's natural [BM, 64] tile, reshaped to 7 dims, permuted [0, 3, 4, 5, 1, 2, 6] and
    # reshaped back, must hold x's column perm()[f] at column f: the same permutation as permute_x
    cols = np.broadcast_to(np.arange(64), (4, 64))
    got = np.transpose(cols.reshape(4, 2, 2, 2, 2, 2, 2), [0, 3, 4, 5, 1, 2, 6]).reshape(4, 64)
    assert (got == fr.perm()[None, :]).all()


def test_shared_tile_pairs_are_in_k_order():
    # gluon_ws._decoder: join(join(p0, p2), join(p1, p3)) -> [BN, 8 (w), 2 (j1), 2 (j0)] -> [BN, 32]: 32-bit column
    # 4 w + j must hold pair j of word w (columns 8 w + 2 j, + 1 of the bf16 tile); gl.join stacks on a new last axis
    p = [np.full(8, j) for j in range(4)]  # pair j of each of the row's 8 words
    q = np.stack([np.stack([p[0], p[2]], -1), np.stack([p[1], p[3]], -1)], -1).reshape(32)
    assert (q == np.tile(np.arange(4), 8)).all()
    swapped = np.stack([np.stack([p[0], p[1]], -1), np.stack([p[2], p[3]], -1)], -1).reshape(32)
    assert not (swapped == np.tile(np.arange(4), 8)).all()


def test_permute_x_is_fragment_order():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3 * 64, generator=gen).to(torch.bfloat16)
    got = gg.permute_x(x)
    want = fr.fragment_order(x.float().numpy())
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert np.array_equal(got.float().numpy(), want)
    assert torch.equal(x, gg.permute_x(x.clone()).reshape(5, 3, 64)[:, :, np.argsort(fr.perm())].reshape(5, 192))
    # every element written (a poisoned out), the input unchanged, and more columns than one program takes
    x2 = torch.randn(3, 11 * 64, generator=gen).to(torch.bfloat16)
    keep = x2.clone()
    out = torch.full_like(x2, float("nan"))
    assert gg.permute_x(x2, out) is out
    assert np.array_equal(out.float().numpy(), fr.fragment_order(x2.float().numpy())) and torch.equal(x2, keep)


def test_splits_by_hand():
    assert gg.splits(64, 224, 0) == 4  # 64 tiles: 4 splits make 256, nearest 2 x 132
    assert gg.splits(512, 224, 0) == 1
    assert gg.splits(8, 16, 0) == 2  # at least 8 steps a split
    assert gg.splits(8, 64, 3) == 3  # a fixed split wins


def test_report_by_hand(tmp_path):
    rows = [{"N": 256, "K": 512, "M": 128, "provider": "cublas_dense", "graph_us": 10.0},
            {"N": 256, "K": 512, "M": 128, "provider": "nf4.linear", "graph_us": 15.0},
            {"N": 256, "K": 512, "M": 128, "provider": "g_m128_w4_a1_sh", "graph_us": 12.0, "kernel_us": 11.0,
             "operand_mismatches": 0, "random_within_bound": True},
            {"N": 256, "K": 512, "M": 128, "provider": "ws_m128_n128", "graph_us": 11.5,
             "operand_mismatches": 1, "random_within_bound": True}]  # not exact: never the best
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"device": "GPU", "environment": {"commit": "abc"}, "rows": rows}))
    assert "| 256 x 512 | 128 | 10.0 | 1.50 | 1.20 (g_m128_w4_a1_sh) | 1.10 |" in gg.report([str(path)])


@pytest.mark.slow  # offline sm_90 builds in a child process without the interpreter (make test-long)
def test_builds_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "experiments.labs.gluon_gemm", "--build", "g_m128_w4_a1_sh",
                          "ws_m128_n128"], capture_output=True, text=True, env=env, timeout=900, check=True).stdout
    rs, ws = json.loads(out.strip().splitlines()[-1])
    assert rs["local"] == 0 and ws["local"] == 0
    assert rs["wgmma_register_a"] and rs["wgmma_in_flight"] == 1  # the decoded tile is the register operand
    assert rs["loop_shared"]["STS"] == 0 and rs["loop_shared"]["STSM"] == 0  # and never goes through shared memory


def test_split_k_second_pass_in_the_interpreter():
    from experiments.labs import gluon_common as gc

    gen = torch.Generator().manual_seed(11)
    m, n, split = 3, 70, 3
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert gc.partial_sums(1, m, n, out) is out  # one split: the kernels store in out
    part = gc.partial_sums(split, m, n, out)
    assert part.shape == (split, m, n) and part.dtype == torch.float32 and gc.partial_sums(split, m, n, out) is part
    part.copy_(torch.randn(split, m, n, generator=gen))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    gc.sum_splits(part, bias, out, split)
    want = ((part[0] + part[1]) + part[2]) + bias.float()  # float32, split order, then the bias, one rounding
    assert torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    gc._PARTS.clear()


def test_shape_list_parts_cover_the_catalog():
    from experiments import catalog

    whole = gg.shape_list(["catalog"])
    assert whole == [(s.n, s.k) for s in catalog.catalog()]
    parts = [gg.shape_list(["catalog"], f"{i}/3") for i in range(3)]
    assert sorted(s for part in parts for s in part) == sorted(whole) and all(parts)
    assert gg.shape_list(["4096x14336", "catalog"], "1/154")[0] == (4096, 14336)
    with pytest.raises(ValueError, match="--part"):
        gg.shape_list(["catalog"], "3/3")


def _row(n, k, m, provider, us, dtype="bfloat16", **extra):
    return {"N": n, "K": k, "M": m, "dtype": dtype, "provider": provider, "graph_us": us, **extra}


def test_judge_rule_on_race_and_product_files():
    """judge_rule counts only what this commit's rule routes, compares the rule's kernel with the table's time, and
    counts a routed row that was not exact instead of timing it."""
    exact = {"operand_mismatches": 0, "random_within_bound": True}
    h100 = "NVIDIA H100 80GB HBM3"
    race = {"device": h100, "rows": [
        # 14336 x 4096 at M = 128: routed (GLUON_GEMM128 -> g_m128_w4_a1_sh): 30 / 40
        _row(14336, 4096, 128, "cublas_dense", 25.0), _row(14336, 4096, 128, "nf4.linear", 40.0),
        _row(14336, 4096, 128, "g_m128_w4_a1_sh", 30.0, **exact),
        _row(14336, 4096, 128, "g_m256_w4_a1_sh", 1.0, **exact),
        # 1024 x 1024 at M = 128: not routed (too small), whatever its times
        _row(1024, 1024, 128, "cublas_dense", 5.0), _row(1024, 1024, 128, "nf4.linear", 9.0),
        _row(1024, 1024, 128, "g_m128_w4_a1_sh", 1.0, **exact),
        # 4096 x 14336 at M = 256: not routed (N < K); at M = 128 routed but not exact
        _row(4096, 14336, 256, "cublas_dense", 5.0), _row(4096, 14336, 256, "nf4.linear", 9.0),
        _row(4096, 14336, 128, "cublas_dense", 5.0), _row(4096, 14336, 128, "nf4.linear", 9.0),
        _row(4096, 14336, 128, "g_m128_w4_a1_sh", 1.0, operand_mismatches=3, random_within_bound=True)]}
    j = gg.judge_rule(race)
    assert j["source"] == "race" and j["shapes"] == 3
    cells = {(r["M"], r["subset"]): r for r in j["rows"]}
    from experiments import catalog

    sub = {(s.n, s.k): s.subset for s in catalog.catalog()}
    a, b = cells[(128, sub[(14336, 4096)])], cells[(128, sub[(4096, 14336)])]
    if sub[(14336, 4096)] == sub[(4096, 14336)]:
        assert a["routed"] == 2 and a["not_exact"] == 1 and a["median_over_table"] == pytest.approx(0.75)
    else:
        assert (a["routed"], a["not_exact"], b["routed"], b["not_exact"]) == (1, 0, 1, 1)
        assert a["median_over_table"] == pytest.approx(0.75) and b["median_over_table"] is None
    assert a["median_over_dense"] == pytest.approx(1.2) and a["faster_than_dense"] == 0
    assert all(r["M"] == 128 for r in j["rows"])
    product = {"device": "NVIDIA H200", "rows": [
        _row(14336, 4096, 128, "cublas_dense", 25.0, "float16"),
        _row(14336, 4096, 128, "nf4.linear", 20.0, "float16", config="GLUON_GEMM128", **exact),
        _row(14336, 4096, 128, "nf4.linear_table", 40.0, "float16", config="WORD_GEMM128_W8"),
        # routed by this rule but measured when the table did not route it: skipped
        _row(8192, 8192, 300, "cublas_dense", 25.0),
        _row(8192, 8192, 300, "nf4.linear", 30.0, config="DEQUANT", **exact),
        _row(8192, 8192, 300, "nf4.linear_table", 30.0, config="DEQUANT")]}
    j = gg.judge_rule(product)
    assert j["source"] == "product" and len(j["rows"]) == 1
    r = j["rows"][0]
    assert (r["dtype"], r["M"], r["routed"], r["faster_than_dense"]) == ("float16", 128, 1, 1)
    assert r["median_over_table"] == pytest.approx(0.5) and r["slower_than_table_3pct"] == 0
    assert "| float16 | 128 |" in gg.rule_table([j])


def test_the_tuned_rules_are_what_the_committed_files_fit():
    """tuned.GLUON_RULES is what `--fit-rule` fits on the committed files: the H100's on its catalog race, the H200's
    on its product race within the H100's rule (the rule of the commit that timed it)."""
    from pathlib import Path

    from nf4.linear.tuned import GLUON_RULES

    labs = Path(__file__).resolve().parents[2] / "results" / "labs"
    race = json.loads((labs / "gluon_race_h100.json").read_text())
    assert gg.fit_rule(race) == GLUON_RULES["H100"]
    product = json.loads((labs / "gluon_product_h200.json").read_text())
    assert gg.fit_rule(product, within=GLUON_RULES["H100"]) == GLUON_RULES["H200"]


def test_fit_rule_on_a_planted_race():
    """A planted race on fit-subset shapes: the kernel gains on every weight of 32Mi or more with N >= K and loses
    on the rest; the fit finds that row, and None where nothing gains."""
    from experiments import catalog

    exact = {"operand_mismatches": 0, "random_within_bound": True}
    fit = [(s.n, s.k) for s in catalog.fit_shapes() if s.k % 128 == 0]
    rows = []
    for n, k in fit:
        gains = n * k >= 32 << 20 and n >= k
        rows += [_row(n, k, 128, "cublas_dense", 10.0), _row(n, k, 128, "nf4.linear", 10.0),
                 _row(n, k, 128, "g_m128_w4_a1_sh", 8.0 if gains else 12.0, **exact),
                 _row(n, k, 256, "cublas_dense", 10.0), _row(n, k, 256, "nf4.linear", 10.0),
                 _row(n, k, 256, "g_m256_w4_a1_sh", 12.0, **exact)]
    got = gg.fit_rule({"device": "GPU", "rows": rows})
    # the smallest grid ratio that routes no loser among the fit shapes of 32Mi or more (ties go to the smaller pair)
    ratio = min(r for r in gg.FIT_RATIO if not any(n * k >= 32 << 20 and r * k <= n < k for n, k in fit))
    assert got[0] == (128, 32 << 20, ratio, "GLUON_GEMM128") and got[1] is None and got[2] is None
    assert ratio <= 1.0
