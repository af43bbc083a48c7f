"""experiments.fsdp_qlora: its CPU mode end to end (2 gloo processes, FSDP2, a tiny model), and its pure helpers.

The end-to-end test needs transformers and peft (skipped without them); the helpers need neither.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import fsdp_qlora

ROOT = Path(__file__).resolve().parents[2]
NEEDS = [name for name in ("transformers", "peft", "bitsandbytes") if importlib.util.find_spec(name) is None]


@pytest.mark.slow  # two processes of a tiny model on the CPU (about 25 s: make test-long)
@pytest.mark.skipif(bool(NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_cpu_two_processes_nf4_matches_bitsandbytes(tmp_path):
    out = tmp_path / "fsdp_qlora.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "experiments", "fsdp-qlora", "--cpu", "--nproc", "2", "--steps", "2", "--layers", "1",
           "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
           "--batch", "1", "--seq", "16", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:])
    payload = json.loads(out.read_text())
    v = payload["verdicts"]
    assert v["losses_identical"] is True and v["lora_identical"] is True, v
    assert v["bnb_deterministic"] is True and v["unsharded_matches_fsdp"] is True, v
    assert v["weights_identical_across_ranks"] is True and v["routed_to_nf4"] > 0, v
    assert payload["failures"] == [] and payload["storage_check"] is True and payload["backend"] == "gloo"
    assert payload["env"]["world_size"] == 2 and payload["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert payload["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and payload["env"]["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "fully_shard" in payload["config"]["sharding"] and payload["config"]["bf16_storage_weights"] == 7
    runs = payload["runs"]
    assert set(runs) == {"bnb", "nf4", "bnb_repeat"}
    for name, run in runs.items():
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        for r in run["ranks"]:
            assert len(r["loss_bits"]) == len(r["step_ms"]) == 2 and all(ms > 0 for ms in r["step_ms"])
            assert r["loss_bits"][0] != r["loss_bits"][1]  # an optimizer step happened: the loss moved
            routed_nf4 = sum(n for k, n in r["routed"].items() if k.endswith("/nf4"))
            assert (routed_nf4 > 0) == (name == "nf4"), (name, r["routed"])
    assert runs["bnb"]["ranks"][0]["loss_bits"] != runs["bnb"]["ranks"][1]["loss_bits"]  # a batch per rank
    assert "nf4 = bnb" in proc.stdout and "losses_identical | yes" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(bool(NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_cpu_interleaved_runs_train_their_own_models(tmp_path):
    """--interleave: every run's model built first and their steps interleaved; each run still trains its own model,
    so the verdicts hold as in the sequential schedule, and every run's step count and routes are its own."""
    out = tmp_path / "fsdp_qlora.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "experiments", "fsdp-qlora", "--cpu", "--nproc", "2", "--steps", "3", "--layers", "1",
           "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
           "--batch", "1", "--seq", "16", "--interleave", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:])
    payload = json.loads(out.read_text())
    v = payload["verdicts"]
    assert payload["config"]["interleave"] is True and payload["failures"] == []
    assert v["losses_identical"] is True and v["lora_identical"] is True and v["bnb_deterministic"] is True, v
    for name, run in payload["runs"].items():
        for r in run["ranks"]:
            assert len(r["loss_bits"]) == len(r["step_ms"]) == 3 and len(set(r["loss_bits"])) == 3
            routed_nf4 = sum(n for k, n in r["routed"].items() if k.endswith("/nf4"))
            assert (routed_nf4 > 0) == (name == "nf4"), (name, r["routed"])


def _run(losses, lora="d", unsharded=None, routed=None):
    ranks = [{"rank": i, "loss_bits": list(bits), "lora_digest": f"{lora}{i}", "weights_digest": "w",
              "unsharded_loss_bits": bits[0] if unsharded is None else unsharded,
              "routed": routed or {}} for i, bits in enumerate(losses)]
    return {"ranks": ranks}


def test_verdicts():
    runs = {"bnb": _run([(1, 2), (3, 4)]), "nf4": _run([(1, 2), (3, 4)], routed={"dequantize_4bit/nf4": 4}),
            "bnb_repeat": _run([(1, 2), (3, 4)])}
    v = fsdp_qlora.verdicts(runs)
    assert v["losses_identical"] and v["lora_identical"] and v["bnb_deterministic"] and v["unsharded_matches_fsdp"]
    assert v["weights_identical_across_ranks"] and v["routed_to_nf4"] == 8 and v["nf4_losses_match_a_bnb_run"]
    runs["nf4"] = _run([(1, 2), (3, 5)], routed={"dequantize_4bit/nf4": 1})  # rank 1's second loss differs
    v = fsdp_qlora.verdicts(runs)
    assert v["losses_identical"] is False and v["lora_identical"] is True
    assert fsdp_qlora.failed({"verdicts": v, "runs": runs}) == ["nf4's losses differ from a deterministic "
                                                                "bitsandbytes"]
    runs["bnb_repeat"] = _run([(1, 2), (3, 5)], lora="e")  # bitsandbytes alone varies: nothing claimed, no failure
    v = fsdp_qlora.verdicts(runs)
    assert v["bnb_deterministic"] is False and v["nf4_losses_match_a_bnb_run"] is True
    assert fsdp_qlora.failed({"verdicts": v, "runs": runs}) == []
    runs["bnb"] = _run([(1, 2), (3, 4)], unsharded=9)
    assert fsdp_qlora.verdicts(runs)["unsharded_matches_fsdp"] is False
    v = fsdp_qlora.verdicts({"bnb": _run([(1, 2)])})
    assert v["losses_identical"] is None and v["bnb_deterministic"] is None and v["routed_to_nf4"] is None


def test_failed_and_default_out():
    assert fsdp_qlora.failed({"runs": {"nf4": {"error": "boom"}}, "verdicts": {}}) == ["nf4: boom"]
    assert "nothing was routed" in fsdp_qlora.failed({"verdicts": {"routed_to_nf4": 0}})[0]
    assert fsdp_qlora.default_out("NVIDIA H200", 2) == "build/fsdp_qlora_nvidia_h200_x2.json"
    assert fsdp_qlora.default_out("cpu", 2) == "build/fsdp_qlora_cpu_x2.json"


def test_parse_args():
    gpu = fsdp_qlora.parse_args([])
    assert (gpu.hidden, gpu.intermediate, gpu.heads, gpu.kv_heads, gpu.layers, gpu.vocab) == (2048, 5632, 16, 4, 4,
                                                                                              8192)
    assert (gpu.batch, gpu.seq, gpu.steps, gpu.nproc, gpu.fsdp, gpu.lora_dtype) == (2, 1024, 5, None, "fully_shard",
                                                                                   "bfloat16")
    cpu = fsdp_qlora.parse_args(["--cpu", "--layers", "2"])
    assert (cpu.hidden, cpu.layers, cpu.batch, cpu.seq) == (64, 2, 1, 16)
    for bad in (["--steps", "1", "--warmup", "1"], ["--hidden", "100"], ["--fsdp", "fsdp1", "--lora-dtype", "float32"],
                ["--nproc", "0"]):
        with pytest.raises(SystemExit):
            fsdp_qlora.parse_args(bad)


def test_table_without_runs():
    assert fsdp_qlora.table({"runs": {"bnb": {"error": "x"}}, "failures": ["bnb: x"]}) == "no run finished: bnb: x"
