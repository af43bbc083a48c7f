"""experiments linear-bounds on a CPU: the per-bar lines from rows of seeded random times, the inductor options
filtered to what this torch has, and the GPU-only exit that writes nothing."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from experiments import linear_bounds as lb

SHAPES = ((14336, 4096), (4096, 4096), (1000, 4160))
MS = (1, 2, 128, 256, 384, 512, 1024, 4096)


def _rows(seed: int, drop=()):
    """Rows as measure() writes them, random times (a part in `drop` left out; (N, K, M, part) keys given None)."""
    rng = random.Random(seed)
    rows = []
    for n, k in SHAPES:
        for m in MS:
            floor = rng.uniform(1, 20)
            parts = [lb.NF4, lb.BNB, lb.DEQ, lb.CUBLAS] + ([lb.READ] if m == 1 else []) + \
                    ([lb.TRITON] if m >= lb.TRITON_MIN_M else []) + ([lb.INT4] if m <= lb.INT4_MAX_M else [])
            for part in parts:
                if part in drop:
                    continue
                t = None if (n, k, m, part) in drop else rng.uniform(1, 300)
                rows.append({"N": n, "K": k, "M": m, "dtype": "bfloat16", "byte_floor_us": floor, "part": part,
                             "graph_us": t})
    return rows


def _time(rows, n, k, m, part):
    found = [r["graph_us"] for r in rows if (r["N"], r["K"], r["M"], r["part"]) == (n, k, m, part)]
    return found[0] if found else None


@pytest.mark.parametrize("seed", [3, 11, 2027])
def test_bars_lines_follow_the_issue(seed):
    rows = _rows(seed)
    lines = lb.bars(rows)
    assert len(lines) == len(SHAPES) * len(MS)
    for line in lines:
        n, k, m = line["N"], line["K"], line["M"]

        def t(part, n=n, k=k, m=m):
            return _time(rows, n, k, m, part)

        floor = next(r["byte_floor_us"] for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m))
        if m == 1:
            want = ("a", min(1.5 * floor, t(lb.BNB) / 2), lb.READ)
        elif m <= 128:
            want = ("b", t(lb.CUBLAS), None)
        elif m <= 512:
            want = ("c", min(t(lb.DEQ), t(lb.BNB)) / 1.5, lb.TRITON)
        else:
            want = ("d", 1.1 * t(lb.CUBLAS), lb.TRITON)
        bar, target, control = want
        assert (line["bar"], line["control"]) == (bar, control)
        assert line["target_us"] == pytest.approx(target, rel=1e-12)
        assert line["nf4_us"] == t(lb.NF4)
        assert line["nf4_meets"] is (t(lb.NF4) <= target)
        if control is None:
            assert line["control_us"] is None and line["control_meets"] is None
        else:
            assert line["control_us"] == t(control)
            assert line["control_meets"] is (t(control) <= target)
        assert line["cublas_us"] == t(lb.CUBLAS) and line["byte_floor_us"] == floor
        assert line["triton_dense_us"] == t(lb.TRITON)
        assert line["int4_us"] == t(lb.INT4)
        assert line["int4_meets"] is (None if t(lb.INT4) is None else t(lb.INT4) <= target)


def test_bars_missing_times_give_none_not_a_verdict():
    """A part that failed (None) or is absent leaves the verdicts that need it undecided; bar (a) without
    bitsandbytes keeps its byte-floor half."""
    rows = _rows(5, drop={(4096, 4096, 1024, lb.CUBLAS), (4096, 4096, 512, lb.TRITON), (4096, 4096, 128, lb.NF4),
                          (1000, 4160, 1, lb.BNB), (4096, 4096, 256, lb.INT4)})
    lines = {(b["N"], b["K"], b["M"]): b for b in lb.bars(rows)}
    d = lines[(4096, 4096, 1024)]
    assert d["target_us"] is None and d["nf4_meets"] is None and d["control_meets"] is None
    c = lines[(4096, 4096, 512)]
    assert c["target_us"] is not None and c["control_us"] is None and c["control_meets"] is None
    assert isinstance(c["nf4_meets"], bool) and isinstance(c["int4_meets"], bool)
    assert lines[(4096, 4096, 256)]["int4_us"] is None and lines[(4096, 4096, 256)]["int4_meets"] is None
    b = lines[(4096, 4096, 128)]
    assert b["nf4_us"] is None and b["nf4_meets"] is None
    a = lines[(1000, 4160, 1)]
    floor = next(r["byte_floor_us"] for r in rows if (r["N"], r["K"], r["M"]) == (1000, 4160, 1))
    assert a["target_us"] == pytest.approx(1.5 * floor)
    rows = _rows(5, drop={lb.DEQ})  # bar (c) with bitsandbytes alone
    for line in lb.bars(rows):
        if line["bar"] == "c":
            assert line["target_us"] == pytest.approx(_time(rows, line["N"], line["K"], line["M"], lb.BNB) / 1.5)


def test_inductor_options_keep_only_what_this_torch_has(monkeypatch):
    import torch._inductor.config as config

    got = lb.inductor_options()
    assert got["max_autotune_gemm_backends"] == "TRITON" and got["max_autotune"] is True
    assert set(got) <= set(lb.INDUCTOR_OPTIONS)
    for name in got:
        obj = config
        for part in name.split("."):
            obj = getattr(obj, part)
    monkeypatch.setitem(lb.INDUCTOR_OPTIONS, "triton.no_such_option_anywhere", 1)
    monkeypatch.setitem(lb.INDUCTOR_OPTIONS, "no_such_option_anywhere", 1)
    assert lb.inductor_options() == got


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "bounds.json"
    proc = subprocess.run([sys.executable, "-m", "experiments", "linear-bounds", "--out", str(out), "--ms", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stderr
    assert not out.exists()
