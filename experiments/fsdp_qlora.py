"""FSDP-QLoRA end to end: a Llama-shaped NF4 model sharded with FSDP, trained a few steps with and without nf4.

    python -m experiments fsdp-qlora                                   # every GPU of the machine (2 or more)
    python -m experiments fsdp-qlora --nproc 2 --steps 5 --out results/linear/fsdp_qlora_h200x2.json
    python -m experiments fsdp-qlora --cpu --nproc 2                   # gloo on the CPU, a tiny model (debugging)
    python -m experiments fsdp-qlora --nproc 2 --steps 60 --warmup 10 --interleave --layers 4 --hidden 4096 \
        --intermediate 14336 --heads 32 --kv-heads 8                   # Llama-3-8B's layers, runs interleaved

Runs: bitsandbytes alone, nf4 patched, bitsandbytes again (drift). By default one after another; --interleave builds
the three models first and interleaves their steps (step i of each in turn, the order rotated by one each step), so
that drift of the host, clocks or memory reaches each run alike; each run still trains its own model.

Needs transformers, peft and bitsandbytes (exit code 2 without them), and two or more CUDA GPUs unless --cpu.
Nothing comes from the hub. The command spawns one worker process per GPU (torch.multiprocessing, MASTER_ADDR
127.0.0.1 and a free port; no torchrun), backend nccl on CUDA and gloo with --cpu. Before any process starts it sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off; nothing
here uses symmetric memory). With --cpu it sets TRITON_INTERPRET=1, so nf4's kernel runs in Triton's interpreter.

Model: `experiments.qlora.build_model` on every rank from the same seed (random bf16 LlamaForCausalLM, every decoder
nn.Linear a bitsandbytes NF4 `Linear4bit`, double quantization, blocksize 64, compute bf16, PEFT LoRA r=16 on the 7
linears), then each packed weight is re-typed to `quant_storage=torch.bfloat16`: bitsandbytes' `quantize_4bit` with
a storage dtype other than uint8 returns the same bytes viewed as that dtype (`packed.view(quant_storage)`, shape
(n/4, 1)); `storage_check` in the result re-verifies that on the device. bf16 storage is what FSDP1 needs: it
flattens each unit into one FlatParameter of one floating dtype (uint8 storage: "Cannot flatten integer dtype
tensors"; float32 LoRA beside bf16: "Must flatten tensors with uniform dtype", both seen on the CPU). FSDP2 shards
each parameter on its own and also trained with uint8 storage and float32 LoRA on the CPU (not tried on a GPU); bf16
is kept for both, as FSDP-QLoRA does. The LoRA weights are cast to --lora-dtype (bfloat16 by default: every
parameter bf16, no mixed-precision policy). Every rank checks that it built bit-identical parameters
(`weights_identical_across_ranks`) and computes its batch's loss on the unsharded model (`unsharded_loss_bits`).

Sharding (--fsdp): `fully_shard` (FSDP2, `torch.distributed.fsdp.fully_shard`, torch >= 2.6; the older
`torch.distributed._composable.fsdp` path is taken where that is all there is) on each decoder layer, then on the
root; or `fsdp1`: `FullyShardedDataParallel(use_orig_params=True)` with the decoder layer as the auto-wrap unit (needs
one dtype, so --lora-dtype bfloat16). Both trained on the CPU with the same losses bit for bit. Under FSDP1 the
frozen parameters of a unit that holds LoRA weights are views of a FlatParameter that requires grad (the layer norms'
weights too), so the first layer's q/k/v inputs require grad and its backward also dequantizes them: 7
dequantizations per layer and step against FSDP2's 4 in the first layer, and gradients computed only to be dropped.

How a sharded `Params4bit` keeps working under FSDP2: `fully_shard` chunks the parameter with torch.chunk (which
`Params4bit.__torch_function__` answers with Params4bit chunks) and keeps a plain DTensor shard; before a layer's
forward it all-gathers the packed bytes into a plain unsharded `nn.Parameter` without a QuantState, and
`Linear4bit.forward` repairs that (`fix_4bit_weight_quant_state_from_module` wraps the tensor in a Params4bit and
attaches `module.quant_state`, which `Params4bit._quantize` stored on the module). The QuantState's tensors (absmax,
state2) are neither parameters nor buffers: FSDP leaves them whole on every rank. accelerate's FSDP plugin is not
run: it configures these same two APIs.

Training: one batch of seeded random token ids per rank (--batch x --seq, a different batch on each rank, the same
at every step, so the loss falls as LoRA fits it), labels = ids, forward + backward + `torch.optim.AdamW(lr=--lr)` on
the LoRA parameters, --steps steps. Three runs, each from a freshly built model and optimizer: `bnb` (bitsandbytes
alone), `nf4` (the same steps inside `nf4.patched_bitsandbytes()`), `bnb_repeat` (bitsandbytes alone again: is
bitsandbytes under FSDP deterministic?).
Per step and rank: the loss (float and float32 bits as int32) and the step time (forward, backward, optimizer step,
FSDP's collectives; CUDA events on a GPU, perf_counter on the CPU; ranks meet at a barrier before each step). After the
last step, a sha256 over every rank's local shard of the LoRA weights (`lora_digest`). `routed`: the calls that
`nf4.integrations.bitsandbytes.routed_counts()` saw during a run, per rank (nf4 took the backward's
`dequantize_4bit`; on a GPU also gemm_4bit's dequantize + F.linear fallback; on the CPU bitsandbytes' forward is
not routable, see nf4.integrations.bitsandbytes).

Verdicts: `losses_identical` (every loss of every rank and step bit-identical between nf4 and bnb),
`lora_identical` (the trained LoRA shards too), `bnb_deterministic` (bnb and bnb_repeat identical, losses and LoRA),
`unsharded_matches_fsdp` (each rank's first FSDP loss equals its unsharded model's). Exit 1 when a run failed or nf4
differs from a deterministic bitsandbytes (`unsharded_matches_fsdp` is only reported: on the GPU the sharded
model's first loss differed from the unsharded one's in its last bits, with bitsandbytes alone too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import warnings

from . import qlora

# NVLink multicast can take a shared host's GPUs out of service: keep it off in NCCL, PyTorch and NVSHMEM, always.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPU_DEFAULTS = {"layers": 4, "hidden": 2048, "intermediate": 5632, "heads": 16, "kv_heads": 4, "vocab": 8192,
                "batch": 2, "seq": 1024}
CPU_DEFAULTS = {"layers": 1, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
                "batch": 1, "seq": 16}
RUNS = ("bnb", "nf4", "bnb_repeat")  # nf4 between the two bitsandbytes runs, so that drift reaches both
FSDP_APIS = ("fully_shard", "fsdp1")


# --- pure helpers (tested on the CPU) -------------------------------------------------------------


def run_outcome(run: dict) -> tuple:
    """What a run computed, comparable across runs: every rank's loss bits per step, then its LoRA digest."""
    return tuple((tuple(r["loss_bits"]), r["lora_digest"]) for r in sorted(run["ranks"], key=lambda r: r["rank"]))


def verdicts(runs: dict) -> dict:
    """losses_identical / lora_identical (nf4 against bnb), bnb_deterministic, unsharded_matches_fsdp, and more.

    runs: {"bnb": run, "nf4": run, "bnb_repeat": run}, a run being {"ranks": [{"rank", "loss_bits",
    "lora_digest", "unsharded_loss_bits", "weights_digest", "routed"}, ...]}. A missing run gives None for what
    needs it.
    """
    def losses(name):
        return [o[0] for o in run_outcome(runs[name])] if name in runs else None

    def loras(name):
        return [o[1] for o in run_outcome(runs[name])] if name in runs else None

    def same(a, b):
        return None if a is None or b is None else a == b

    out = {
        "losses_identical": same(losses("nf4"), losses("bnb")),
        "lora_identical": same(loras("nf4"), loras("bnb")),
        "bnb_deterministic": same(losses("bnb_repeat"), losses("bnb")) and same(loras("bnb_repeat"), loras("bnb")),
        "nf4_losses_match_a_bnb_run": None,
        "unsharded_matches_fsdp": None,
        "weights_identical_across_ranks": None,
        "routed_to_nf4": None,
    }
    if "nf4" in runs:
        out["nf4_losses_match_a_bnb_run"] = any(same(losses("nf4"), losses(n)) for n in ("bnb", "bnb_repeat")
                                                if n in runs)
    ranks = [r for run in runs.values() for r in run["ranks"]]
    if ranks:
        out["unsharded_matches_fsdp"] = all(r["unsharded_loss_bits"] == r["loss_bits"][0] for r in ranks)
        out["weights_identical_across_ranks"] = all(len({r["weights_digest"] for r in run["ranks"]}) == 1
                                                    for run in runs.values())
    if "nf4" in runs:
        out["routed_to_nf4"] = sum(n for r in runs["nf4"]["ranks"] for k, n in r["routed"].items()
                                   if k.endswith("/nf4"))
    return out


def failed(payload: dict) -> list[str]:
    """Why this result is a failure (empty: it is not)."""
    v = payload.get("verdicts", {})
    why = [f"{name}: {run['error']}" for name, run in payload.get("runs", {}).items() if "error" in run]
    if "error" in payload:
        why.append(payload["error"])
    # unsharded_matches_fsdp is reported, not required: on two H200s (results/fsdp/) the unsharded model's
    # first loss differed from the sharded one's in the last bits with bitsandbytes alone too (another
    # summation order), which says nothing about nf4
    if v.get("bnb_deterministic") and v.get("losses_identical") is False:
        why.append("nf4's losses differ from a deterministic bitsandbytes")
    if v.get("routed_to_nf4") == 0:
        why.append("nothing was routed to nf4 during the patched run: the comparison shows nothing")
    return why


def default_out(device_name: str, world: int) -> str:
    """build/fsdp_qlora_<device>_x<world>.json (the device in lower case, other runs of characters as '_')."""
    from verify.timing import device_slug

    return f"build/fsdp_qlora_{device_slug(device_name)}_x{world}.json"


def table(payload: dict) -> str:
    """Markdown: rank 0's loss and step time per step for each run, then the verdicts."""
    runs = {name: run for name, run in payload.get("runs", {}).items() if "error" not in run}
    names = [n for n in RUNS if n in runs]
    if not names:
        return "no run finished: " + "; ".join(payload.get("failures") or [payload.get("error", "?")])
    head = " | ".join(f"{n} loss | {n} ms" for n in names)
    lines = [f"| step | {head} | nf4 = bnb (bits, all ranks) |", "|---" * (2 + 2 * len(names)) + "|"]
    steps = max((len(run["step_ms"]) for run in runs.values()), default=0)
    for i in range(steps):
        cells = []
        for n in names:
            r0 = runs[n]["ranks"][0]
            cells.append(f"{r0['loss'][i]:.6f} | {runs[n]['step_ms'][i]:.2f}")
        same = ""
        if "bnb" in runs and "nf4" in runs:
            same = qlora._yes(all(a["loss_bits"][i] == b["loss_bits"][i]
                                  for a, b in zip(runs["bnb"]["ranks"], runs["nf4"]["ranks"], strict=True)))
        lines.append(f"| {i} | {' | '.join(cells)} | {same} |")
    medians = " | ".join(f" | {runs[n]['time']['median_ms']:.2f}" if runs[n].get("time") else " | -" for n in names)
    lines.append(f"| median (after {payload.get('config', {}).get('warmup', '?')}) | {medians} | |")
    v = payload.get("verdicts", {})
    lines += ["", "| verdict | value |", "|---|---|"]
    lines += [f"| {k} | {qlora._yes(val) if isinstance(val, bool) or val is None else val} |" for k, val in v.items()]
    for name, run in payload.get("runs", {}).items():
        if "error" in run:
            lines.append(f"| {name} | error: {run['error'][:100]} |")
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the model and one run (in the workers) -------------------------------------------------------


def to_bf16_storage(model) -> int:
    """Re-type every bnb Linear4bit's packed NF4 weight as quant_storage=bfloat16 (the same bytes); count them."""
    import bitsandbytes as bnb
    import torch

    count = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        w = module.weight
        if w.dtype != torch.uint8 or w.quant_state is None:
            raise RuntimeError(f"expected a quantized uint8 Params4bit, got {w.dtype}, quant_state {w.quant_state}")
        packed = w.data.reshape(-1).view(torch.bfloat16).reshape(-1, 1)
        module.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=w.quant_state,
                                          blocksize=w.blocksize, compress_statistics=w.compress_statistics,
                                          quant_type=w.quant_type, quant_storage=torch.bfloat16, module=module,
                                          bnb_quantized=True)
        module.quant_storage = torch.bfloat16
        module.quant_state = w.quant_state  # what Linear4bit.forward re-attaches after FSDP's all-gather
        count += 1
    return count


def storage_check(device: str) -> bool:
    """bitsandbytes' own quantize_4bit(quant_storage=bfloat16) gives the uint8 result's bytes (what to_bf16_storage
    assumes), on this device, for a small seeded weight."""
    import bitsandbytes.functional as F
    import torch

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    as_u8, _ = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
    as_bf16, _ = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                 quant_storage=torch.bfloat16)
    return as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.reshape(-1).view(torch.uint8),
                                                           as_u8.reshape(-1).view(torch.uint8))


def _fully_shard():
    """(fully_shard, where it was imported from): the public path from torch 2.6, else the composable one."""
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard, "torch.distributed.fsdp.fully_shard"
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

        return fully_shard, "torch.distributed._composable.fsdp.fully_shard"


def shard(model, api: str, device):
    """FSDP over the whole world: per decoder layer, then the root. Returns (model, description)."""
    import torch

    layers = model.base_model.model.model.layers
    if api == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard, where = _fully_shard()
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, f"{where} per decoder layer, then the root (reshard_after_forward default)"
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():  # LoRA (trainable) beside its frozen base in one unit: that is the point here
        warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad=True and False.*")
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}),
                                           use_orig_params=True, device_id=device, sync_module_states=False)
    return wrapped, "torch.distributed.fsdp.FullyShardedDataParallel(use_orig_params=True), decoder layers wrapped"


def _local(t):
    """A DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_run(mode: str, args, rank: int, device) -> dict:
    """Build, shard and ready one model of `mode` on this rank: its state for `run_step` and `finish_run`."""
    import torch

    import nf4

    dims = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "max_position_embeddings": max(4096, args.seq)}
    model, _config, info = qlora.build_model(dims, layers=args.layers, vocab=args.vocab, seed=args.seed,
                                             attn=args.attn, device=str(device))
    info["bf16_storage_weights"] = to_bf16_storage(model)
    lora_dtype = getattr(torch, args.lora_dtype)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(lora_dtype)
    weights_digest = qlora.grad_digest(model.named_parameters())
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(args.seed * 1_000_003 + rank * 10_007)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    patch = nf4.patched_bitsandbytes if mode == "nf4" else contextlib.nullcontext
    with patch():
        unsharded_loss_bits = qlora.loss_bits(model(input_ids=ids, labels=ids).loss)
    model, sharding = shard(model, args.fsdp, device)
    params = [p for p in model.parameters() if p.requires_grad]
    return {"model": model, "optimizer": torch.optim.AdamW(params, lr=args.lr), "ids": ids, "patch": patch,
            "timer": qlora._Timer(str(device)), "rank": rank, "params": len(params), "info": info,
            "weights_digest": weights_digest, "unsharded_loss_bits": unsharded_loss_bits, "sharding": sharding,
            "loss_bits": [], "step_ms": [], "routed": {}}


def run_step(state: dict, device) -> None:
    """One timed training step of a built run (after a barrier of all ranks), its loss, time and nf4 routes noted."""
    import torch.distributed as dist

    from nf4.integrations import bitsandbytes as nf4_bnb

    model, optimizer, ids = state["model"], state["optimizer"], state["ids"]

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss

    before = nf4_bnb.routed_counts()
    with state["patch"]():
        dist.barrier(**({"device_ids": [device.index]} if device.type == "cuda" else {}))
        ms, loss = state["timer"](step)
    state["loss_bits"].append(qlora.loss_bits(loss))
    state["step_ms"].append(ms)
    for key, n in qlora.counts_delta(before, nf4_bnb.routed_counts()).items():
        state["routed"][key] = state["routed"].get(key, 0) + n


def finish_run(state: dict, device) -> dict:
    """This rank's record of a run (the steps, routes, digests); the model and optimizer are dropped."""
    import torch

    model = state.pop("model")
    state.pop("optimizer")
    record = {"rank": state["rank"], "loss_bits": state["loss_bits"], "step_ms": state["step_ms"],
              "loss": [float(torch.tensor(b, dtype=torch.int32).view(torch.float32)) for b in state["loss_bits"]],
              "routed": state["routed"],
              "lora_digest": qlora.grad_digest((n, _local(p.detach())) for n, p in model.named_parameters()
                                               if p.requires_grad),
              "weights_digest": state["weights_digest"], "unsharded_loss_bits": state["unsharded_loss_bits"],
              "sharding": state["sharding"], "trainable_params": state["params"], **state["info"]}
    if device.type == "cuda":
        record["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        record["device_name"] = torch.cuda.get_device_name(device)
    return record


def one_run(mode: str, args, rank: int, device) -> dict:
    """Build, shard and train one model on this rank; returns this rank's record (the steps, routes, digests)."""
    import torch

    state = build_run(mode, args, rank, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        run_step(state, device)
    return finish_run(state, device)


def interleaved_runs(args, rank: int, device) -> dict:
    """Every run's model built first, then their steps interleaved: step i of each run in turn, the order rotated by
    one each step (no run always first after a barrier), so that drift of the host, clocks or memory reaches every
    run alike. Each run still trains its own model, so its losses are its own. Returns {mode: this rank's record}."""
    states, records = {}, {}
    for mode in RUNS:
        try:
            states[mode] = build_run(mode, args, rank, device)
        except Exception as exc:  # one failed run must not lose the others
            records[mode] = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"[:800]}
    order = [mode for mode in RUNS if mode in states]
    for i in range(args.steps):
        for mode in order[i % len(order):] + order[:i % len(order)] if order else []:
            if mode in records:
                continue
            try:
                run_step(states[mode], device)
            except Exception as exc:
                records[mode] = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"[:800]}
    for mode in order:
        if mode not in records:
            records[mode] = finish_run(states[mode], device)
    return records


def _worker(rank: int, world: int, args, port: int, result_path: str) -> None:
    """One process of the world: init, the three runs, rank 0 pickles what every rank recorded."""
    os.environ.update(MULTICAST_OFF)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        backend = "gloo"
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.collective_timeout))
    try:
        results = {"backend": backend, "storage_check": storage_check(str(device)), "runs": {}}
        interleaved = interleaved_runs(args, rank, device) if args.interleave else {}
        for mode in RUNS:
            if args.interleave:
                record = interleaved.get(mode, {"rank": rank, "error": "not run"})
            else:
                try:
                    record = one_run(mode, args, rank, device)
                except Exception as exc:  # one failed run must not lose the others; every rank reports its own
                    record = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"[:800]}
                gc.collect()  # the run's model, before the next one is built
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            gathered = [None] * world
            dist.all_gather_object(gathered, record)
            results["runs"][mode] = gathered
            if rank == 0:
                print(f"  {mode}: " + _fmt_run(gathered), flush=True)
        if rank == 0:
            with open(result_path, "wb") as f:
                pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def _fmt_run(records: list) -> str:
    errors = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if errors:
        return "ERROR " + "; ".join(errors)
    r0 = records[0]
    return (f"losses {[round(x, 6) for x in r0['loss']]}, ms {[round(x, 2) for x in r0['step_ms']]}, "
            f"routed {r0['routed']}")


def assemble(results: dict, warmup: int) -> dict:
    """The workers' records as runs (rank 0's step times summarized after `warmup` steps) and their verdicts."""
    runs = {}
    for mode, records in results["runs"].items():
        errors = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
        if errors:
            runs[mode] = {"error": "; ".join(errors), "ranks": records}
            continue
        ranks = sorted(records, key=lambda r: r["rank"])
        timed = ranks[0]["step_ms"][warmup:]
        runs[mode] = {"ranks": ranks, "step_ms": ranks[0]["step_ms"], "loss": ranks[0]["loss"],
                      "loss_bits": ranks[0]["loss_bits"], "time": qlora.summarize_ms(timed) if timed else None}
    good = {mode: run for mode, run in runs.items() if "error" not in run}
    v = verdicts(good)
    if good.get("bnb", {}).get("time") and good.get("nf4", {}).get("time"):
        v["speedup_nf4_vs_bnb"] = good["bnb"]["time"]["median_ms"] / good["nf4"]["time"]["median_ms"]
    return {"runs": runs, "verdicts": v}


# --- the command ----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments fsdp-qlora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default: build/fsdp_qlora_<device>_x<nproc>.json)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, nf4 in Triton's interpreter, tiny defaults")
    ap.add_argument("--nproc", type=int, default=None, help="worker processes (default: every GPU; 2 with --cpu)")
    ap.add_argument("--fsdp", default="fully_shard", choices=FSDP_APIS, help="FSDP2 fully_shard (default) or FSDP1")
    ap.add_argument("--layers", type=int, help="decoder layers (GPU 4, CPU 1)")
    ap.add_argument("--hidden", type=int, help="hidden size (GPU 2048, CPU 64)")
    ap.add_argument("--intermediate", type=int, help="MLP size (GPU 5632, CPU 128)")
    ap.add_argument("--heads", type=int, help="attention heads (GPU 16, CPU 4)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads (GPU 4, CPU 2)")
    ap.add_argument("--vocab", type=int, help="vocabulary (GPU 8192, CPU 256)")
    ap.add_argument("--batch", type=int, help="sequences per rank and step (GPU 2, CPU 1)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (GPU 1024, CPU 16)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the time summary (default 1)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--lora-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="LoRA weights' dtype (default bfloat16; fsdp1 needs bfloat16)")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", action="store_true",
                    help="build every run's model first, then interleave their steps (rotating order); else one run "
                         "after another")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG")
    ap.add_argument("--port", type=int, default=0, help="MASTER_PORT (default: a free one)")
    ap.add_argument("--collective-timeout", type=int, default=300, help="seconds before a stuck collective fails")
    args = ap.parse_args(argv)
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sizes = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq", "steps")
    if any(getattr(args, k) < 1 for k in sizes) or (args.nproc is not None and args.nproc < 1):
        ap.error(f"--{', --'.join(k.replace('_', '-') for k in sizes)} and --nproc must be 1 or more")
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must leave at least one step to time (0 <= warmup < steps)")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.fsdp == "fsdp1" and args.lora_dtype != "bfloat16":
        ap.error("--fsdp fsdp1 flattens one dtype per unit: use --lora-dtype bfloat16")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF)  # before any process (and any NCCL) starts; inherited by the workers
    if args.cpu:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("--cpu needs TRITON_INTERPRET=1 before triton is imported, and triton is imported already",
                  file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    nproc = args.nproc or (2 if args.cpu else gpus)
    missing = qlora.missing_requirements(True)
    if not args.cpu and (not torch.cuda.is_available() or gpus < 2):
        missing.insert(0, f"two or more CUDA GPUs (found {gpus}; --cpu runs on gloo)")
    elif not args.cpu and not 2 <= nproc <= gpus:
        missing.insert(0, f"--nproc between 2 and the {gpus} GPUs (got {nproc})")
    if missing:
        print("experiments fsdp-qlora needs transformers, peft, bitsandbytes and two or more GPUs (or --cpu); "
              "missing: " + ", ".join(missing) + ". Nothing measured.", file=sys.stderr)
        return 2
    import peft
    import torch.multiprocessing as mp
    import transformers

    from verify import timing

    env = timing.environment()
    env.update(transformers=transformers.__version__, peft=peft.__version__, accelerate=qlora._version("accelerate"),
               nf4_commit_env=os.environ.get("NF4_COMMIT"), world_size=nproc,
               **{k: os.environ.get(k) for k in MULTICAST_OFF})
    if args.cpu:
        env.update(device="cpu", mode="cpu (gloo, Triton interpreter)")
    out = args.out or default_out(env["device"], nproc)
    port = args.port or free_port()
    print(f"{env['device']} x{nproc}  torch {env['torch']}  transformers {env['transformers']}  peft {env['peft']}  "
          f"bnb {env['bitsandbytes']}  commit {env['commit'][:12]}  fsdp {args.fsdp}", flush=True)
    config = {k: getattr(args, k) for k in ("fsdp", "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab",
                                            "batch", "seq", "steps", "warmup", "lr", "lora_dtype", "attn", "seed",
                                            "deterministic", "cpu", "interleave")}
    config.update(nproc=nproc, runs=list(RUNS), quant_storage="bfloat16", quantization=(
        "bitsandbytes Linear4bit nf4, double quant (compress_statistics), blocksize 64, compute bf16, packed weight "
        "as quant_storage bfloat16; embeddings, norms and lm_head bf16 (frozen)"),
        lora={"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": list(qlora.TARGET_MODULES)},
        optimizer="torch.optim.AdamW on the LoRA weights", gradient_checkpointing=False)
    payload = {"env": env, "config": config}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.pkl")
        try:
            mp.spawn(_worker, args=(nproc, args, port, result_path), nprocs=nproc, join=True)
            with open(result_path, "rb") as f:
                results = pickle.load(f)
        except Exception as exc:  # a worker died: keep what is known
            payload["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            results = None
    payload["wall_s"] = round(time.perf_counter() - t0, 1)
    if results is not None:
        payload.update(backend=results["backend"], storage_check=results["storage_check"],
                       **assemble(results, args.warmup))
        first = next((r["ranks"][0] for r in payload["runs"].values() if "error" not in r), {})
        config.update({k: first[k] for k in ("sharding", "linears_replaced", "bf16_storage_weights",
                                             "lora_layer_classes", "trainable_params") if k in first})
    payload["failures"] = failed(payload)
    path = timing.write_json(out, payload)
    print(f"\nwrote {path}\n")
    print(table(payload))
    if payload["failures"]:
        print("\nFAILED: " + "; ".join(payload["failures"]), file=sys.stderr)
    return 1 if payload["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
