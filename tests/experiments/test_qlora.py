"""experiments.qlora without a GPU: the CLI refuses cleanly (exit 2), and its pure helpers are right.

transformers and peft need not be installed: experiments.qlora imports them inside functions only.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import qlora

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_exits_2_without_cuda(tmp_path):
    out = tmp_path / "qlora.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments", "qlora", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "experiments qlora needs a CUDA GPU, transformers, peft and bitsandbytes" in proc.stderr
    assert "missing: a CUDA GPU" in proc.stderr and "Nothing measured." in proc.stderr
    assert not out.exists()


def test_missing_requirements(monkeypatch):
    assert qlora.missing_requirements(False)[0].startswith("a CUDA GPU")
    found = {"transformers": object(), "peft": None, "bitsandbytes": object()}
    monkeypatch.setattr(qlora.importlib.util, "find_spec", lambda name: found[name])
    assert qlora.missing_requirements(True) == ["peft"]
    found["peft"] = object()
    assert qlora.missing_requirements(True) == []


def test_parse_shape():
    assert qlora.parse_shape("1x512") == (1, 512)
    assert qlora.parse_shape(" 8X2048 ") == (8, 2048)
    for bad in ("2048", "0x16", "2x0", "2x-1", "ax2", "2x3x4", ""):
        with pytest.raises(ValueError, match="BATCHxSEQ"):
            qlora.parse_shape(bad)


def test_parse_args_defaults_and_quick():
    args = qlora.parse_args([])
    assert args.shape_list == [(1, 512), (2, 2048), (8, 2048)]
    assert (args.layers, args.steps, args.decode_tokens, args.vocab) == (2, 10, 200, 8192)
    assert args.dims["hidden_size"] == 4096 and args.dims["intermediate_size"] == 14336
    assert (args.dims["num_attention_heads"], args.dims["num_key_value_heads"]) == (32, 8)
    assert args.out is None
    quick = qlora.parse_args(["--quick", "--shapes", "4x4096", "--steps", "50"])  # --quick wins
    assert quick.shape_list == [(1, 32)]
    assert (quick.layers, quick.steps, quick.decode_tokens, quick.vocab) == (1, 2, 8, 1024)
    assert quick.dims == {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 4096}
    with pytest.raises(SystemExit) as exc:
        qlora.parse_args(["--shapes", "2x"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        qlora.parse_args(["--steps", "1"])  # no spread, no determinism check from one run


def test_summarize_ms():
    s = qlora.summarize_ms([4.0, 1.0, 3.0, 2.0])
    assert s["median_ms"] == 2.5 and s["min_ms"] == 1.0 and s["max_ms"] == 4.0 and s["n"] == 4
    q = statistics.quantiles([1.0, 2.0, 3.0, 4.0], n=4)
    assert (s["q1_ms"], s["q3_ms"]) == (q[0], q[2]) and s["q1_ms"] <= s["median_ms"] <= s["q3_ms"]
    one = qlora.summarize_ms([7.0])
    assert one["median_ms"] == one["q1_ms"] == one["q3_ms"] == one["min_ms"] == one["max_ms"] == 7.0
    with pytest.raises(ValueError):
        qlora.summarize_ms([])


def test_grad_digest_bits_names_and_order():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    b = torch.randn(8, 16, generator=gen)
    d = qlora.grad_digest([("x.lora_A", a), ("x.lora_B", b)])
    assert len(d) == 64 and int(d, 16) >= 0
    assert qlora.grad_digest([("x.lora_B", b.clone()), ("x.lora_A", a.clone())]) == d  # sorted by name
    flipped = a.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # one bit of one bf16 element
    assert qlora.grad_digest([("x.lora_A", flipped), ("x.lora_B", b)]) != d
    assert qlora.grad_digest([("x.lora_A", a), ("y.lora_B", b)]) != d  # names count
    assert qlora.grad_digest([("x.lora_A", a), ("x.lora_B", None)]) != d
    assert qlora.grad_digest([("x.lora_A", a.float()), ("x.lora_B", b)]) != d  # dtype counts
    assert qlora.grad_digest([("x.lora_A", a.reshape(8, 16)), ("x.lora_B", b)]) != d  # shape counts
    assert qlora.grad_digest([("z", a.t())]) == qlora.grad_digest([("z", a.t().contiguous())])
    zero, neg_zero = torch.zeros(4), torch.zeros(4)
    neg_zero[1] = -0.0
    assert torch.equal(zero, neg_zero) and qlora.grad_digest([("z", zero)]) != qlora.grad_digest([("z", neg_zero)])


def test_loss_bits():
    assert qlora.loss_bits(torch.tensor(1.0)) == 0x3F80_0000
    assert qlora.loss_bits(torch.tensor(-2.0)) == -0x4000_0000  # sign bit set: a negative int32
    assert qlora.loss_bits(torch.tensor(1.5, dtype=torch.bfloat16)) == 0x3FC0_0000
    x = torch.tensor(6.9702215)
    assert qlora.loss_bits(x) == qlora.loss_bits(x.clone()) != qlora.loss_bits(torch.nextafter(x, x + 1))


def test_interleave_order_and_warmup():
    calls = []

    def make(name):
        def run():
            calls.append(name)
            return float(len(calls)), (name, len(calls))
        return run

    res = qlora.interleave({"bnb": make("bnb"), "nf4": make("nf4")}, warmup=2, steps=3)
    assert calls == ["bnb", "nf4", "nf4", "bnb"] * 2 + ["bnb", "nf4"]  # the order rotates every round
    assert res["bnb"]["times"] == [5.0, 8.0, 9.0] and res["nf4"]["times"] == [6.0, 7.0, 10.0]
    assert [r[1] for r in res["bnb"]["records"]] == [1, 4, 5, 8, 9]  # warm-up records kept
    assert len(res["nf4"]["records"]) == 5
    calls.clear()
    qlora.interleave({name: make(name) for name in "abc"}, warmup=0, steps=4)
    assert calls == list("abc" "bca" "cab" "abc")


def test_compare():
    same = [(7, "d")] * 4
    ok = qlora.compare(same, [(7, "d")] * 3)
    assert ok["bnb_deterministic"] and ok["nf4_deterministic"] and ok["bitexact_vs_bnb"] and ok["loss_bitexact"]
    grads_differ = qlora.compare(same, [(7, "d")] * 2 + [(7, "e")])
    assert grads_differ["bitexact_vs_bnb"] is False and grads_differ["loss_bitexact"] is True
    assert grads_differ["nf4_deterministic"] is False and not grads_differ["nf4_within_bnb_outcomes"]
    loss_differs = qlora.compare(same, [(8, "d")] * 4)
    assert loss_differs["bitexact_vs_bnb"] is False and loss_differs["loss_bitexact"] is False
    # bitsandbytes alone not deterministic: nothing is claimed
    noisy = qlora.compare([(7, "d"), (7, "e"), (7, "d")], [(7, "d")] * 3)
    assert noisy["bnb_deterministic"] is False and noisy["bitexact_vs_bnb"] is None
    assert noisy["loss_bitexact"] is True and noisy["nf4_within_bnb_outcomes"] and noisy["bnb_distinct_outcomes"] == 2
    noisy_loss = qlora.compare([(7, "d"), (8, "d")], [(7, "d")] * 2)
    assert noisy_loss["bitexact_vs_bnb"] is None and noisy_loss["loss_bitexact"] is None
    assert qlora.compare([(7, "d")], [(7, "d")])["bnb_deterministic"] is False  # one run proves nothing


def test_counts_delta():
    before = {("dequantize_4bit", "nf4"): 3, ("dequantize_4bit", "bitsandbytes"): 1}
    after = {("dequantize_4bit", "nf4"): 10, ("dequantize_4bit", "bitsandbytes"): 1,
             ("_dequant_linear_fallback", "nf4"): 2}
    assert qlora.counts_delta(before, after) == {"_dequant_linear_fallback/nf4": 2, "dequantize_4bit/nf4": 7}
    assert qlora.counts_delta(after, after) == {}


def test_default_out():
    assert qlora.default_out("NVIDIA H100 80GB HBM3") == "build/qlora_nvidia_h100_80gb_hbm3.json"
    assert qlora.default_out("NVIDIA H200") == "build/qlora_nvidia_h200.json"
    assert qlora.default_out("??") == "build/qlora_device.json"
    assert not qlora.default_out("x").startswith("results")


def test_table():
    t = {"median_ms": 10.0}
    payload = {
        "rows": [{"shape": "2x2048", "bnb": {"median_ms": 12.0}, "nf4": t, "speedup": 1.2, "bitexact_vs_bnb": True,
                  "bnb_deterministic": True,
                  "routed": {"dequantize_4bit/nf4": 7, "_dequant_linear_fallback/nf4": 7,
                             "dequantize_4bit/bitsandbytes": 1}},
                 {"shape": "1x512", "bnb": t, "nf4": t, "speedup": 1.0, "bitexact_vs_bnb": None,
                  "bnb_deterministic": False, "routed": {}},
                 {"shape": "8x2048", "error": "OutOfMemoryError: CUDA out of memory"}],
        "decode": [{"prompt_tokens": 16, "decode_tokens": 200, "bnb_tok_s": 50.0, "nf4_tok_s": 51.0, "speedup": 1.02,
                    "tokens_identical": True}],
    }
    lines = qlora.table(payload).splitlines()
    assert lines[0].startswith("| train step")
    assert "| 2x2048 | 12.00 | 10.00 | 1.200x | yes | yes | 14 / 1 |" in lines
    assert "| 1x512 | 10.00 | 10.00 | 1.000x | n/a | NO | 0 / 0 |" in lines
    assert any(line.startswith("| 8x2048 | error: OutOfMemoryError") for line in lines)
    assert "| 16 + 200 | 50.0 | 51.0 | 1.020x | yes |" in lines


def test_table_other_modes():
    """Modes beyond nf4 get their own train and decode tables; the nf4 lines stay as they were."""
    st = {"median_ms": 8.0, "speedup": 1.5, "bitexact_vs_bnb": True, "routed": {"unsloth.fast_dequantize/unsloth": 14}}
    payload = {
        "rows": [{"shape": "1x512", "bnb": {"median_ms": 12.0}, "nf4": {"median_ms": 10.0}, "speedup": 1.2,
                  "bitexact_vs_bnb": True, "bnb_deterministic": True, "routed": {},
                  "modes": {"nf4": {**st, "median_ms": 10.0}, "unsloth": st}}],
        "decode": [{"prompt_tokens": 16, "decode_tokens": 200, "bnb_tok_s": 50.0, "nf4_tok_s": 51.0, "speedup": 1.02,
                    "tokens_identical": True,
                    "modes": {"nf4": {"tok_s": 51.0, "speedup": 1.02, "tokens_identical": True},
                              "nf4_fused": {"tok_s": 60.0, "speedup": 1.2, "tokens_identical": False}}}],
    }
    lines = qlora.table(payload).splitlines()
    assert "| 1x512 | 12.00 | 10.00 | 1.200x | yes | yes | 0 / 0 |" in lines
    assert "| 1x512 | unsloth | 8.00 | 1.500x | yes | 14 |" in lines
    assert not any("| nf4 |" in line for line in lines)  # nf4 is the main table's
    assert "| nf4_fused | 60.0 | 1.200x | NO |" in lines


def test_mode_stats():
    res = {"bnb": {"times": [10.0, 12.0], "records": [(7, "d")] * 4, "median": 11.0},
           "unsloth": {"times": [5.0, 6.0], "records": [(7, "d")] * 4}}
    st = qlora._mode_stats("unsloth", res, {"unsloth": {"x/unsloth": 3}})
    assert st["median_ms"] == 5.5 and st["speedup"] == 2.0 and st["routed"] == {"x/unsloth": 3}
    assert st["bitexact_vs_bnb"] is True and st["bnb_deterministic"] is True
    res["unsloth"]["records"] = [(8, "d")] * 4
    assert qlora._mode_stats("unsloth", res, {})["bitexact_vs_bnb"] is False


def test_mode_contexts_without_the_release():
    """Without Unsloth's extracted release the unsloth mode is skipped with the loader's reason; bnb and nf4
    always run, nf4_fused when asked, and each context patches what it says."""
    import nf4
    from nf4.integrations.bitsandbytes import fused_linear_on, patched_names
    def missing(root=None):
        raise FileNotFoundError("Unsloth 2026.10.9 release files not found")

    contexts, skipped = qlora.mode_contexts(["bnb", "nf4", "nf4_fused", "unsloth"], unsloth_load=missing)
    assert list(contexts) == ["bnb", "nf4", "nf4_fused"]
    assert "FileNotFoundError" in skipped["unsloth"] and "not run" in skipped["unsloth"]
    nf4.unpatch_bitsandbytes()
    try:
        with contexts["bnb"]():
            assert not patched_names()
        with contexts["nf4"]():
            assert patched_names() and not fused_linear_on()
        with contexts["nf4_fused"]():
            assert fused_linear_on()
        assert not patched_names()
    finally:
        nf4.unpatch_bitsandbytes()
    assert list(qlora.mode_contexts(["nf4"])[0]) == ["bnb", "nf4"]


def test_unsloth_context_counts_and_restores():
    """The unsloth mode installs the override forced, counts the release's kernel calls made inside it (the
    override calls them through the release object), and restores the release's methods and uninstalls on
    exit, an exception too."""
    class FakeRelease:
        shim = False

        def fast_dequantize(self, W, quant_state=None, out=None, use_global_buffer=False):
            return "dq"

        def fast_gemv(self, X, W, quant_state, out=None):
            return "gemv"

    class FakeOverride:
        def __init__(self):
            self.events = []

        def install(self, force=False):
            self.events.append(("install", force))
            return True

        def uninstall(self):
            self.events.append(("uninstall",))

    release, override = FakeRelease(), FakeOverride()
    release.bnb_override = lambda: override
    counts = {("unsloth.fast_gemv", "unsloth"): 5}
    context, why = qlora.unsloth_context(lambda: release, counts)
    assert why is None
    before = dict(counts)
    with context():
        assert release.fast_dequantize("W", "qs") == "dq" and release.fast_dequantize("W", "qs") == "dq"
        assert release.fast_gemv("X", "W", "qs") == "gemv"
    assert qlora.counts_delta(before, counts) == {"unsloth.fast_dequantize/unsloth": 2, "unsloth.fast_gemv/unsloth": 1}
    assert qlora.unsloth_context(lambda: release)[1] is None  # the default counts: those routed_snapshot reads
    assert "fast_dequantize" not in vars(release) and "fast_gemv" not in vars(release)
    assert override.events == [("install", True), ("uninstall",)]
    with pytest.raises(KeyError):
        with context():
            raise KeyError("inside")
    assert override.events[-1] == ("uninstall",) and "fast_gemv" not in vars(release)


def test_no_matmul_context_patches_counts_and_restores():
    """The no_matmul bound replaces bitsandbytes.matmul_4bit (both names Linear4bit and bitsandbytes' autograd
    module bind) while active, counts its calls, returns the product's shape and dtype with a gradient of x's
    shape, and puts the original objects back, after an exception too."""
    bitsandbytes = pytest.importorskip("bitsandbytes")
    import bitsandbytes.autograd._functions as functions

    original = bitsandbytes.matmul_4bit
    counts = {}

    class State:
        shape = (7, 5)

    x = torch.randn(3, 2, 5, dtype=torch.bfloat16, requires_grad=True)
    with qlora.no_matmul_context(counts):
        assert bitsandbytes.matmul_4bit is not original and functions.matmul_4bit is bitsandbytes.matmul_4bit
        y = bitsandbytes.matmul_4bit(x, None, State())
        bias = torch.ones(7, dtype=torch.bfloat16)
        yb = bitsandbytes.matmul_4bit(x.detach(), None, State(), bias=bias)
    assert bitsandbytes.matmul_4bit is original and functions.matmul_4bit is original
    assert counts == {("matmul_4bit", "no_matmul"): 2}
    assert y.shape == (3, 2, 7) and y.dtype == torch.bfloat16 and yb.shape == (3, 2, 7)
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    with pytest.raises(RuntimeError, match="boom"), qlora.no_matmul_context({}):
        raise RuntimeError("boom")
    assert bitsandbytes.matmul_4bit is original and functions.matmul_4bit is original


def test_no_matmul_mode_is_a_bound():
    """The bound's stats carry no exactness claim (its outputs are uninitialized memory) and the tables say so."""
    res = {"bnb": {"times": [10.0, 12.0], "records": [(7, "d")] * 4, "median": 11.0},
           "no_matmul": {"times": [9.0, 10.0], "records": [(1, "x"), (2, "y")]}}
    st = qlora._mode_stats("no_matmul", res, {})
    assert st["bound"] is True and st["bitexact_vs_bnb"] is None and st["median_ms"] == 9.5
    payload = {"rows": [{"shape": "1x512", "bnb": {"median_ms": 11.0}, "nf4": {"median_ms": 11.0}, "speedup": 1.0,
                         "bitexact_vs_bnb": True, "bnb_deterministic": True, "routed": {},
                         "modes": {"no_matmul": {**st, "routed": {"matmul_4bit/no_matmul": 14}}}}],
               "decode": [{"prompt_tokens": 16, "decode_tokens": 200, "bnb_tok_s": 50.0, "nf4_tok_s": 51.0,
                           "speedup": 1.02, "tokens_identical": True,
                           "modes": {"no_matmul": {"tok_s": 70.0, "speedup": 1.4, "tokens_identical": None,
                                                   "bound": True}}}]}
    lines = qlora.table(payload).splitlines()
    assert "| 1x512 | no_matmul | 9.50 | 1.158x | bound | 14 |" in lines
    assert "| no_matmul | 70.0 | 1.400x | bound |" in lines
    contexts, _ = qlora.mode_contexts(["no_matmul"])
    assert list(contexts) == ["bnb", "nf4", "no_matmul"]


def test_mode_text_names_the_route_limit():
    from nf4.integrations.routes import matmul_4bit_route_max_m

    limit = matmul_4bit_route_max_m("NVIDIA H100 80GB HBM3")
    assert f"1-{limit} rows" in qlora.mode_text("nf4_fused", "NVIDIA H100 80GB HBM3")
    assert qlora.mode_text("bnb", "") == qlora.MODE_TEXT["bnb"]


def test_dense_context_dequantizes_once_and_restores():
    """The dense bound: F.linear on the weight dequantized once per QuantState (the dequantized weight in
    quant_state.shape, a transposed result turned back), differentiable in x, the original back on exit."""
    bitsandbytes = pytest.importorskip("bitsandbytes")

    original = bitsandbytes.matmul_4bit
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(7, 5, generator=gen).to(torch.bfloat16)
    calls, counts = [], {}

    class State:
        shape = (7, 5)

    def dequantize(B, qs):
        calls.append(qs)
        return w.t()  # what bitsandbytes returns for a transposed packed view

    state = State()
    x = torch.randn(3, 5, generator=gen).to(torch.bfloat16).requires_grad_(True)
    qlora._DENSE.clear()
    try:
        with qlora.dense_context(counts, dequantize=dequantize):
            y = bitsandbytes.matmul_4bit(x, None, state)
        with qlora.dense_context(counts, dequantize=dequantize):
            y2 = bitsandbytes.matmul_4bit(x, None, state, bias=torch.ones(7))
    finally:
        qlora._DENSE.clear()
    assert bitsandbytes.matmul_4bit is original and calls == [state] and counts == {("matmul_4bit", "dense"): 2}
    assert torch.equal(y, torch.nn.functional.linear(x, w))
    assert torch.equal(y2, torch.nn.functional.linear(x, w, torch.ones(7, dtype=torch.bfloat16)))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 7, dtype=torch.bfloat16) @ w)


def test_refuted_by_withdraws_claims_when_a_witness_is_not_deterministic():
    """bitsandbytes alone with one outcome is a sample when a mode that runs none of nf4's code (dense, unsloth)
    gives several for the same inputs: every bit-identity claim of the row becomes None, with the note; a row
    whose witnesses were deterministic keeps its claims, and so does one whose bnb runs already differed."""
    def row(dense_det, bnb_det=True):
        return {"bnb_deterministic": bnb_det, "bitexact_vs_bnb": False,
                "modes": {"nf4": {"bitexact_vs_bnb": False}, "dense": {"nf4_deterministic": dense_det,
                                                                       "bitexact_vs_bnb": True},
                          "no_matmul": {"bitexact_vs_bnb": None, "bound": True}}}

    r = row(False)
    assert qlora.refuted_by(r) == ["dense"]
    assert r["bitexact_vs_bnb"] is None and r["bnb_deterministic_by_chance"] == ["dense"]
    assert all(s["bitexact_vs_bnb"] is None for s in r["modes"].values()) and "dense" in r["note"]
    kept = row(True)
    assert qlora.refuted_by(kept) == [] and kept["bitexact_vs_bnb"] is False and "note" not in kept
    other = row(False, bnb_det=False)
    qlora.refuted_by(other)
    assert other["bitexact_vs_bnb"] is False and "bnb_deterministic_by_chance" not in other
