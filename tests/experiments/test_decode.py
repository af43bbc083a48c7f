"""experiments.decode without a GPU: arguments, rows and their file, the agreement and linear-share helpers against
values computed here, a tiny model of the same construction (bitsandbytes Linear4bit, nf4 patched, one greedy step
in Triton's interpreter), and the CLI's refusal without CUDA.

transformers need not be installed: experiments.decode imports it inside functions; the tests that build a model
skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import decode

ROOT = Path(__file__).resolve().parents[2]
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _row(**changes):
    fields = {"model": "llama3-8b", "layers": 32, "batch": 8, "mode": "nf4", "compiled": True, "phase": "decode",
              "fullgraph": True, "linear_share": 0.5, "token_agreement": 1.0,
              **decode.timing_fields("decode", 8, 64, 0.5)}
    fields.update(changes)
    return decode.make_row(**fields)


# --- arguments -------------------------------------------------------------------------------------


def test_defaults():
    a = decode.parse_args([])
    assert a.model_list == ["llama3-8b", "qwen2.5-7b"] and a.layers == 32 and a.vocab == 32000
    assert a.batch_list == [1, 8, 32] and a.prefill_list == [512, 2048] and a.tokens == 64
    assert a.mode_list == ["dense", "bnb", "nf4", "nf4-fused"] and a.compiled_list == (False, True)
    assert a.budget_s is None and a.out is None


def test_arguments():
    a = decode.parse_args(["--models", "qwen2.5-7b", "--layers", "4", "--batches", "32,1", "--modes",
                           "nf4-fused,bnb", "--compiled", "on", "--prefill", "128", "--tokens", "8", "--budget-s",
                           "60", "--out", "x.json"])
    assert a.model_list == ["qwen2.5-7b"] and a.layers == 4 and a.batch_list == [32, 1]
    assert a.mode_list == ["nf4-fused", "bnb"]  # the order given (--budget-s stops the last ones first)
    assert decode.parse_args(["--modes", "nf4,dense,bnb"]).mode_list == ["dense", "nf4", "bnb"]  # dense first
    assert a.compiled_list == (True,) and a.prefill_list == [128] and a.tokens == 8 and a.budget_s == 60
    assert decode.parse_args(["--compiled", "off"]).compiled_list == (False,)


@pytest.mark.parametrize("argv", [["--models", "llama2"], ["--batches", "0"], ["--batches", "1,1"],
                                  ["--batches", "a"], ["--modes", "fp4"], ["--compiled", "maybe"],
                                  ["--prefill", ""], ["--tokens", "0"], ["--budget-s", "0"], ["--layers", "0"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        decode.parse_args(argv)
    assert exc.value.code == 2


def test_parse_ints_and_names():
    assert decode.parse_ints(" 1, 8,32 ", "x") == [1, 8, 32]
    with pytest.raises(ValueError):
        decode.parse_ints("1,-2", "x")
    assert decode.parse_names("nf4,dense", decode.MODES, "m") == ["nf4", "dense"]
    with pytest.raises(ValueError):
        decode.parse_names("nf4,nf4", decode.MODES, "m")


# --- rows and the file ------------------------------------------------------------------------------


def test_row_schema():
    row = _row(prompt_tokens=512)
    assert list(row)[: len(decode.ROW_KEYS)] == list(decode.ROW_KEYS) and row["prompt_tokens"] == 512
    bare = decode.make_row(model="m", layers=1, batch=1, mode="bnb", compiled=False, phase="prefill")
    assert all(bare[k] is None for k in ("tokens_per_s", "ms_per_token", "fullgraph", "linear_share",
                                         "token_agreement"))
    for bad in ({"phase": "train"}, {"mode": "fp4"}, {"model": None}):
        with pytest.raises(ValueError):
            _row(**bad)
    for bad in ({"compiled": 1}, {"fullgraph": "yes"}):
        with pytest.raises(TypeError):
            _row(**bad)
    for bad in ({"linear_share": 1.5}, {"token_agreement": -0.1}):
        with pytest.raises(ValueError):
            _row(**bad)


def test_timing_fields():
    d = decode.timing_fields("decode", 8, 64, 0.5)  # 64 steps of 8 tokens in 0.5 s
    assert d["tokens_per_s"] == pytest.approx(8 * 64 / 0.5) and d["ms_per_token"] == pytest.approx(500 / 64)
    p = decode.timing_fields("prefill", 2, 512, 0.25)  # 2 x 512 prompt positions in 0.25 s
    assert p["tokens_per_s"] == pytest.approx(4096) and p["ms_per_token"] == pytest.approx(250 / 1024)
    assert p["ms"] == pytest.approx(250)
    with pytest.raises(ValueError):
        decode.timing_fields("decode", 1, 1, 0.0)


def test_writer(tmp_path):
    rows = [_row(), _row(phase="prefill", prompt_tokens=2048, fullgraph=None, token_agreement=None),
            _row(mode="dense", compiled=False, fullgraph=None, linear_share=None)]
    payload = {"device": "NVIDIA H100", "environment": {"torch": torch.__version__}, "rows": rows}
    path = decode.save(tmp_path / "d" / "decode.json", payload)
    back = json.loads(path.read_text())
    assert back["device"] == "NVIDIA H100" and back["rows"] == rows
    assert all(set(decode.ROW_KEYS) <= set(r) for r in back["rows"])
    with pytest.raises(ValueError):
        decode.save(tmp_path / "bad.json", {"rows": [{"model": "x"}]})
    assert not (tmp_path / "bad.json").exists()
    assert decode.default_out("NVIDIA H100 80GB HBM3") == "build/decode/decode_nvidia_h100_80gb_hbm3.json"
    line = decode.format_row(rows[0])
    assert "llama3-8b" in line and "nf4" in line and "compiled" in line and "tok/s" in line


# --- the helpers against values computed here ---------------------------------------------------------


def test_token_agreement():
    a = [[5, 6, 7, 8], [1, 2, 3, 4]]
    b = [[5, 6, 0, 8], [1, 9, 9, 4]]
    equal = sum(1 for i in range(2) for j in range(4) if a[i][j] == b[i][j])  # 5 of 8
    assert decode.token_agreement(a, b) == equal / 8 == 0.625
    assert decode.token_agreement(torch.tensor(a), torch.tensor(a)) == 1.0
    assert decode.token_agreement(a, None) is None
    with pytest.raises(ValueError):
        decode.token_agreement([[1, 2]], [[1, 2, 3]])


def test_top_kernels():
    kernels = [("a", 1.0), ("nf4_gemv_mma_kernel" + "x" * 200, 7.04), ("b", 3.0), ("c", 3.0)]
    top = decode.top_kernels(kernels, 3)
    assert top == [["nf4_gemv_mma_kernel" + "x" * 101, 7.0], ["b", 3.0], ["c", 3.0]]
    assert len(decode.top_kernels([(str(i), i) for i in range(30)])) == decode.TOP_KERNELS
    assert decode.top_kernels([]) == []


def test_linear_share():
    kernels = [("nf4_gemm_word_kernel", 30.0), ("void kgemm_4bit_inference_naive<...>", 10.0),
               ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>", 5.0),
               ("ampere_bf16_s16816gemm_bf16_128x64", 40.0), ("flash_fwd_kernel", 15.0)]
    expected = (30.0 + 10.0 + 5.0) / (30.0 + 10.0 + 5.0 + 40.0 + 15.0)
    assert decode.linear_share(kernels) == pytest.approx(expected)
    assert decode.linear_share([("sm90_xmma_gemm", 1.0)]) == 0.0
    assert decode.linear_share([]) is None and decode.linear_share([("x", 0)]) is None
    assert decode.is_linear_kernel("nf4_split_sum_kernel") and not decode.is_linear_kernel("triton_poi_fused_mul")


def test_record_agreement():
    ref, pending = {}, {}
    dense = _row(mode="dense", compiled=False, token_agreement=None)
    decode.record_agreement(dense, [[1, 2, 3, 4]], ref, pending)
    assert dense["token_agreement"] is None  # bitsandbytes alone has not run yet
    bnb = _row(mode="bnb", compiled=False, token_agreement=None)
    decode.record_agreement(bnb, [[1, 2, 0, 4]], ref, pending)
    assert bnb["token_agreement"] == 1.0 and dense["token_agreement"] == 0.75 and not pending
    nf4 = _row(mode="nf4", compiled=False, token_agreement=None)
    decode.record_agreement(nf4, [[1, 0, 0, 0]], ref, pending)
    assert nf4["token_agreement"] == 0.5
    other = _row(mode="nf4", compiled=True, token_agreement=None)  # another unit: no bnb tokens for it
    decode.record_agreement(other, [[1, 2, 0, 4]], ref, pending)
    assert other["token_agreement"] is None


def test_catalog_dims():
    assert decode.model_dims("llama3-8b") == {"hidden_size": 4096, "intermediate_size": 14336, "heads": 32,
                                              "kv_heads": 8, "head_dim": 128}
    q = decode.model_dims("qwen2.5-7b")
    assert (q["hidden_size"], q["intermediate_size"], q["heads"], q["kv_heads"]) == (3584, 18944, 28, 4)


# --- a tiny model of the same construction on the CPU ------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("key", ["llama3-8b", "qwen2.5-7b"])
def test_tiny_model(key):
    import bitsandbytes as bnb

    import nf4

    model = decode.build_model(key, layers=2, vocab=128, max_positions=64, seed=0, device="cpu", tiny=True)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.num_key_value_heads) == (64, 2, 128, 2)
    assert type(cfg).__name__ == decode.MODELS[key][2]
    assert next(model.parameters()).dtype == torch.bfloat16
    assert decode.quantize_linears(model, "cpu") == 14
    linears = [(n, m) for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 14
    for name, m in linears:
        assert isinstance(m, bnb.nn.Linear4bit), name
        w = m.weight
        assert isinstance(w, bnb.nn.Params4bit) and w.bnb_quantized and w.quant_type == "nf4", name
        assert w.quant_state.nested and w.quant_state.blocksize == 64 and m.compute_dtype == torch.bfloat16, name
    if key == "qwen2.5-7b":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert type(model.lm_head) is torch.nn.Linear  # lm_head stays bf16, as transformers leaves it

    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    out, routed = {}, {}
    for mode in ("bnb", "nf4", "nf4-fused"):
        before = decode.routed_snapshot()
        with torch.no_grad(), decode.mode_context(mode):
            run = decode.Runner(model, decode.make_cache(model, 1, 16, "cpu"))
            run.reset()
            tok = run.prefill(run.forward, ids)
            step = run.step(run.forward, tok)  # one eager greedy step through the static cache
            assert bool(nf4.integrations.bitsandbytes.STATE.patches) == (mode != "bnb")  # patched while it ran
        routed[mode] = decode.counts_delta(before, decode.routed_snapshot())
        assert tok.shape == step.shape == (1, 1) and 0 <= int(step) < 128
        out[mode] = [int(tok), int(step)]
    assert decode.token_agreement([out["nf4"]], [out["bnb"]]) == 1.0  # bit-identical dequantization
    assert 0.0 <= decode.token_agreement([out["nf4-fused"]], [out["bnb"]]) <= 1.0
    # the fused route sent every 4-bit matmul (7 per layer, prompt and step) to nf4.linear, in the interpreter
    assert routed["nf4-fused"] == {"matmul_4bit/nf4": 2 * 14} and routed["bnb"] == {}
    assert not nf4.integrations.bitsandbytes.STATE.patches


@needs_transformers
def test_budget_stops_cleanly(tmp_path):
    out = tmp_path / "decode.json"
    code = decode.main(["--allow-cpu", "--tiny", "--layers", "1", "--vocab", "64", "--budget-s", "1e-9",
                        "--out", str(out)])
    payload = json.loads(out.read_text())
    assert code == 0 and payload["rows"] == [] and "--budget-s" in payload["stopped"]
    assert payload["environment"]["torch"] == torch.__version__ and payload["device"] == "cpu"
    assert "32000" not in payload["config"]["vocab_note"] and "64" in payload["config"]["vocab_note"]


@needs_transformers
@pytest.mark.slow  # one torch.compile of a tiny model on the CPU (about 20 s)
def test_compiled_unit_runs(tmp_path):
    """A compiled unit (the decode step under reduce-overhead, the prefill compiled) gives rows, not an error: a run
    on the H200 was the first to reach this path, after a CPU run found it failing on its own row fields."""
    out = tmp_path / "decode.json"
    code = decode.main(["--allow-cpu", "--tiny", "--models", "llama3-8b", "--layers", "1", "--vocab", "64", "--modes",
                        "dense", "--batches", "1", "--compiled", "on", "--prefill", "4", "--tokens", "2", "--reps", "1",
                        "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and [r["phase"] for r in rows] == ["prefill", "decode"], rows
    assert all(r["compiled"] is True and r["fullgraph"] is True and not r.get("error") for r in rows), rows
    assert rows[1]["deterministic"] is True and rows[1]["ms_per_token"] > 0


# --- the CLI without CUDA --------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_exits_2_without_cuda(tmp_path):
    out = tmp_path / "decode.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments", "decode", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "experiments decode needs a CUDA GPU" in proc.stderr and "missing: a CUDA GPU" in proc.stderr
    assert "no file written" in proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_importable_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import experiments.decode as d; "
            "print(d.parse_args(['--tokens', '4']).tokens)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "4", proc.stderr


def test_merge(tmp_path):
    """Runs of one device join: a later run's row replaces the same (model, layers, batch, mode, compiled, phase,
    prompt length); rows keep their run's commit; `runs` lists each; other devices or keyless rows refuse."""
    old = {"device": "NVIDIA H200", "environment": {"commit": "aaa"}, "config": {"batches": [1]}, "stopped": None,
           "rows": [_row(batch=1), _row(batch=1, phase="prefill", prompt_tokens=512),
                    _row(batch=1, phase="prefill", prompt_tokens=2048), _row(batch=8, ms_per_token=9.0)]}
    new = {"device": "NVIDIA H200", "environment": {"commit": "bbb"}, "config": {"batches": [8, 32]},
           "stopped": "--budget-s 480 spent", "rows": [_row(batch=8, ms_per_token=7.0), _row(batch=32)]}
    merged = decode.merge([old, new], ["old.json", "new.json"])
    assert len(merged["rows"]) == 5 and merged["config"] == {"batches": [8, 32]}
    by = {(r["batch"], r["phase"], r.get("prompt_tokens")): r for r in merged["rows"]}
    assert by[(8, "decode", None)]["ms_per_token"] == 7.0 and by[(8, "decode", None)]["commit"] == "bbb"
    assert by[(1, "prefill", 2048)]["commit"] == "aaa" and (1, "prefill", 512) in by
    assert [r["file"] for r in merged["runs"]] == ["old.json", "new.json"]
    assert merged["runs"][1]["stopped"] == "--budget-s 480 spent" and merged["runs"][0]["rows"] == 4
    again = decode.merge([merged, {**new, "environment": {"commit": "ccc"}}], ["merged", "third"])
    assert [r["commit"] for r in again["runs"]] == ["aaa", "bbb", "ccc"]  # a merged file's runs carry over
    with pytest.raises(ValueError, match="devices"):
        decode.merge([old, {**new, "device": "NVIDIA H100 80GB HBM3"}])
    with pytest.raises(ValueError, match="lacks"):
        decode.merge([{"device": "x", "rows": [{"model": "m"}]}])
    paths = []
    for name, p in (("old.json", old), ("new.json", new)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(p))
    assert decode.main(["merge", str(tmp_path / "out.json"), *map(str, paths)]) == 0
    assert len(json.loads((tmp_path / "out.json").read_text())["rows"]) == 5
    assert decode.main(["merge", str(tmp_path / "x.json"), str(tmp_path / "missing.json")]) == 2
