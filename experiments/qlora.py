"""End-to-end QLoRA with the real libraries: a train step and greedy decode, bitsandbytes alone against nf4 patched in.

    python -m experiments qlora                                   # 2 layers, shapes 1x512 2x2048 8x2048
    python -m experiments qlora --layers 4 --shapes 4x1024 --steps 20 --out build/q.json
    python -m experiments qlora --quick --out /tmp/qlora.json     # a tiny model, a smoke run

Needs a CUDA GPU, transformers, peft and bitsandbytes (exit code 2 without them). Nothing comes from the hub.

Model: `transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
num_key_value_heads=8, num_hidden_layers=--layers, vocab_size=--vocab (8192 by default, not Llama's 32000, to keep
the bf16 lm_head and its backward matmul small), max_position_embeddings=4096)` and `LlamaForCausalLM(config)` built
in bf16 straight on the GPU with random weights (`torch.manual_seed(--seed)`). Quantization: every nn.Linear of the
decoder layers (q/k/v/o/gate/up/down) is replaced by a `bitsandbytes.nn.Linear4bit` (NF4, double quantization
`compress_statistics=True`, blocksize 64, compute dtype bf16) holding a `Params4bit` of the same weight; moving the
module to the device runs bitsandbytes' own `Params4bit._quantize`, the same call transformers' bnb quantizer ends
in. The embeddings and lm_head stay bf16 (transformers skips lm_head too). This was chosen over
`from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))` because it needs no save/load round trip
through a temp dir and does not depend on transformers' loading code, which changed a lot in 5.x. The model gets
`is_loaded_in_4bit = True`, which is what peft reads to wrap a `Linear4bit` with its bitsandbytes LoRA class
(`peft.tuners.lora.bnb.Linear4bit`; the class peft actually used is recorded in the result). Then
`peft.get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[q,k,v,o,gate,up,down]_proj,
lora_dropout=0.0, task_type="CAUSAL_LM"))`. Gradient checkpointing off; attention `--attn` (sdpa by default).

Modes (--modes; each is a context the same model runs in, interleaved with the order rotating every round,
  A B C, B C A, C A B, ..., so drift reaches all and no mode always follows the same one):
  bnb        bitsandbytes alone;
  nf4        inside `nf4.patched_bitsandbytes()`: bitsandbytes' NF4 dequantization through nf4 (bit-identical);
  nf4_fused  inside `nf4.patched_bitsandbytes(fused_linear=True)`: also `matmul_4bit` up to the GPU's route limit
             (nf4.integrations.routes.ROUTE_MATMUL_4BIT_MAX_M) to nf4.linear, in training too (not bit-identical to
             bitsandbytes where nf4.linear runs a fused kernel: M <= 128);
  no_matmul  a bound, not an implementation: `matmul_4bit` replaced by an op that allocates its output (and its
             input's gradient) and launches no kernel, so its time is what the step would take with a 4-bit linear
             of zero device time; its outputs are garbage and never compared;
  dense      a bound, not an implementation: `matmul_4bit` replaced by F.linear on the weight dequantized once
             beforehand (bf16), its backward by autograd: the step with a free dequantize and cuBLAS's matmuls;
  unsloth    Unsloth 2026.10.9's own Linear4bit override, the released `unsloth/kernels/bnb_override.py` run from
             the wheel's files (verify.unsloth_release: its kernels are the release's, the few lines of utils.py
             plumbing it calls are our re-statement), forced on as UNSLOTH_BNB_NF4_LINEAR=1 does: the release
             installs it by default only on sm100/sm120 with bitsandbytes >= 0.50 (`default_on` in the result says
             what it decides on this GPU). Skipped, with the reason in the result, without the extracted release.

Train step, per (batch, seq) in --shapes: seeded random token ids, labels = ids, forward (loss) + backward, no
optimizer step (every repetition computes the same thing). Step time: CUDA events around forward + backward, median
of --steps after 3 warm-ups, per mode, interleaved. Each run records the loss bits (float32 as int32) and a
sha256 over every LoRA parameter's .grad (sorted by name, raw bytes). After the timed steps, torch.profiler records
each mode's GPU kernel time per step (`kernel_ms`; `bnb_kernel_ms`, `nf4_kernel_ms`): against the step time it
says how much of the step the GPU spends running kernels. `bnb_deterministic`: every bitsandbytes-alone
run (warm-ups too) gave the same loss bits and digest; `bitexact_vs_bnb`: every nf4 run gave exactly that (None, not
claimed, when bitsandbytes alone is not deterministic; see `note`). `routed` counts the calls of one step that
went to nf4 and to bitsandbytes (`nf4.integrations.bitsandbytes.routed_counts()`), and for the unsloth mode the
calls of the release's fast_dequantize / fast_gemv. `modes` holds every mode other than bnb with the same
statistics (the top-level nf4 keys are the nf4 mode's).

Decode: the same model (LoRA attached, eval, no grad), a 16-token seeded prompt, then --decode-tokens single-token
forward passes with the KV cache (a greedy loop with past_key_values, what generate(do_sample=False) does, without
its stopping rules), timed with torch.cuda.synchronize + time.perf_counter; tokens/s for both, interleaved over
--decode-reps, and whether the generated ids are identical. Single-token 4-bit matmuls without grad go to
bitsandbytes' fused kernel, which the nf4 mode does not replace (only the prompt's forward dequantizes, see
`routed`); the nf4_fused mode sends them to nf4.linear, and the unsloth mode to the release's fast_gemv.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FULL_DIMS = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 4096}
QUICK_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096}
QUICK = {"layers": 1, "vocab": 1024, "shapes": ["1x32"], "steps": 2, "decode_tokens": 8}
WARMUP = 3
PROMPT_TOKENS = 16
MODES = ("bnb", "nf4", "nf4_fused", "unsloth", "no_matmul", "dense")
MODE_TEXT = {
    "bnb": "bitsandbytes alone",
    "nf4": "nf4.patched_bitsandbytes(): bitsandbytes' NF4 dequantization through nf4 (bit-identical)",
    "nf4_fused": "nf4.patched_bitsandbytes(fused_linear=True): also matmul_4bit of 1-{max_m} rows to nf4.linear",
    "unsloth": "Unsloth 2026.10.9's Linear4bit override (unsloth/kernels/bnb_override.py), forced on",
    "no_matmul": "a bound, not an implementation: bitsandbytes' matmul_4bit replaced by an op that allocates its "
                 "output (and in the backward its input's gradient) and launches no kernel; its step time is what any "
                 "4-bit linear kernel, at zero device time, would leave (outputs are not compared)",
    "dense": "a bound, not an implementation: bitsandbytes' matmul_4bit replaced by F.linear on the weight "
             "dequantized once by bitsandbytes (bf16, kept per QuantState), its backward by autograd: the step with a "
             "free dequantize and cuBLAS's matmuls",
}
BOUNDS = ("no_matmul", "dense")  # modes that time a bound, not an implementation
# Modes that run none of nf4's code and compute the rest of the model as bitsandbytes alone does: if one of them gives
# different gradients for identical inputs, the model's own ops are not deterministic, whatever bitsandbytes alone
# happened to give in its runs.
WITNESSES = ("dense", "unsloth")
CHANCE_NOTE = (
    "bitsandbytes alone gave one outcome in its runs, but {modes}, which run none of nf4's code, gave several for the "
    "same inputs: the model's own ops are not deterministic (see the note on non-deterministic ops), so one outcome "
    "of bitsandbytes alone is a sample, and bit-identity with it is not claimed (nor denied)."
)
UNCOMPARED = ("no_matmul",)  # bounds whose outputs are uninitialized memory: never compared with bitsandbytes'
NONDETERMINISM_NOTE = (
    "bitsandbytes alone gave different losses or LoRA gradients for identical inputs, so bit-identity of nf4 with it "
    "is not claimed. Likely non-deterministic ops: atomics in the attention backward (SDPA's flash / "
    "memory-efficient kernels accumulate dQ/dK/dV with atomicAdd), split-K cuBLAS GEMMs whose reduction order "
    "depends on the workspace/stream, and index/scatter ops (embedding backward, cross-entropy gather) that "
    "accumulate with atomics. Rerun with --deterministic (torch.use_deterministic_algorithms + "
    "CUBLAS_WORKSPACE_CONFIG) or --attn eager to narrow it down."
)


# --- pure helpers (tested on the CPU) -------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int]:
    """'2x2048' -> (2, 2048): batch x sequence length, both positive."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"shape {text!r} is not BATCHxSEQ with positive integers, e.g. 2x2048")
    return int(m.group(1)), int(m.group(2))


def summarize_ms(times: list[float]) -> dict:
    """Median, quartiles, min and max of a list of step times in ms (quartiles need two or more)."""
    if not times:
        raise ValueError("no times to summarize")
    s = sorted(times)
    q1, q3 = (statistics.quantiles(s, n=4)[0::2] if len(s) >= 2 else (s[0], s[0]))
    return {"median_ms": statistics.median(s), "q1_ms": q1, "q3_ms": q3, "min_ms": s[0], "max_ms": s[-1],
            "n": len(s)}


def grad_digest(named_grads: Iterable[tuple[str, object]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every gradient, sorted by name; a None grad hashes as such.

    Raw bytes (a uint8 view), so that bf16 works and -0.0 / NaN payloads count: equal digests mean bit-equal grads.
    """
    import torch

    h = hashlib.sha256()
    for name, g in sorted(named_grads, key=lambda item: item[0]):
        h.update(name.encode() + b"\0")
        if g is None:
            h.update(b"<none>\0")
            continue
        t = g.detach().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def loss_bits(loss) -> int:
    """The loss as a float32, its bits as a signed int32 (equal ints = bit-identical losses)."""
    import torch

    return int(loss.detach().float().reshape(1).view(torch.int32).item())


def interleave(runs: dict[str, Callable[[], tuple[float, object]]], *, warmup: int, steps: int) -> dict:
    """Call every run once per round: `warmup` rounds untimed, then `steps` rounds timed. The order rotates by
    one each round (A B C, B C A, C A B, ...), so that no run always follows the same one (a step after another
    mode's step can find its caches and clocks in the state that mode left).

    Each run returns (ms, record). Returns {name: {"times": timed ms, "records": every record, warm-ups too}}.
    """
    out = {name: {"times": [], "records": []} for name in runs}
    names = list(runs)
    for i in range(warmup + steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            run = runs[name]
            ms, record = run()
            out[name]["records"].append(record)
            if i >= warmup:
                out[name]["times"].append(ms)
    return out


def compare(bnb_records: list, nf4_records: list) -> dict:
    """Bit-exactness of nf4's runs against bitsandbytes alone; records are (loss_bits, grad_digest) pairs.

    bnb_deterministic needs two or more bitsandbytes runs, all equal. bitexact_vs_bnb is None when bitsandbytes is
    not deterministic (nothing to be exact to); loss_bitexact compares the losses alone (the forward).
    """
    bnb, ours = set(map(tuple, bnb_records)), set(map(tuple, nf4_records))
    deterministic = len(bnb_records) >= 2 and len(bnb) == 1
    bnb_losses, our_losses = {r[0] for r in bnb}, {r[0] for r in ours}
    return {
        "bnb_deterministic": deterministic,
        "nf4_deterministic": len(nf4_records) >= 2 and len(ours) == 1,
        "bitexact_vs_bnb": (ours == bnb) if deterministic else None,
        "loss_bitexact": (our_losses == bnb_losses) if len(bnb_losses) == 1 else None,
        "nf4_within_bnb_outcomes": ours <= bnb,
        "bnb_distinct_outcomes": len(bnb),
        "nf4_distinct_outcomes": len(ours),
    }


def counts_delta(before: dict, after: dict) -> dict[str, int]:
    """routed_counts() after minus before, as {"function/route": n} (JSON keys), zeros dropped."""
    keys = sorted(set(before) | set(after))
    delta = {f"{k[0]}/{k[1]}": after.get(k, 0) - before.get(k, 0) for k in keys}
    return {k: v for k, v in delta.items() if v}


def default_out(device_name: str) -> str:
    """build/qlora_<gpu>.json, the device's name in lower case with every other run of characters an underscore."""
    from verify.timing import device_slug

    return f"build/qlora_{device_slug(device_name)}.json"


def missing_requirements(cuda_available: bool) -> list[str]:
    """What this benchmark needs and cannot find: a CUDA GPU, transformers, peft, bitsandbytes."""
    missing = [] if cuda_available else ["a CUDA GPU (torch.cuda.is_available() is False)"]
    missing += [name for name in ("transformers", "peft", "bitsandbytes") if importlib.util.find_spec(name) is None]
    return missing


def table(payload: dict) -> str:
    """Markdown: train step per shape, then decode."""
    lines = ["| train step (batch x seq) | bnb ms | nf4 ms | speedup | bit-exact | bnb deterministic | "
             "dequant calls/step nf4 / bnb |", "|---|---|---|---|---|---|---|"]
    for r in payload.get("rows", []):
        if "error" in r:
            lines.append(f"| {r['shape']} | error: {r['error'][:60]} | | | | | |")
            continue
        routed = r.get("routed", {})
        n_nf4 = sum(v for k, v in routed.items() if k.endswith("/nf4"))
        n_bnb = sum(v for k, v in routed.items() if k.endswith("/bitsandbytes"))
        lines.append(f"| {r['shape']} | {r['bnb']['median_ms']:.2f} | {r['nf4']['median_ms']:.2f} | "
                     f"{r['speedup']:.3f}x | {_yes(r['bitexact_vs_bnb'])} | {_yes(r['bnb_deterministic'])} | "
                     f"{n_nf4} / {n_bnb} |")
    others = [(r["shape"], mode, st) for r in payload.get("rows", []) if "error" not in r
              for mode, st in r.get("modes", {}).items() if mode != "nf4"]
    if others:
        lines += ["", "| train step, other modes | mode | ms | speedup over bnb | bit-exact | calls/step |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {shape} | {mode} | {st['median_ms']:.2f} | {st['speedup']:.3f}x | "
                  f"{'bound' if st.get('bound') else _yes(st['bitexact_vs_bnb'])} | {sum(st['routed'].values())} |"
                  for shape, mode, st in others]
    for d in payload.get("decode", []):
        if "error" in d:
            lines.append(f"\n| decode | error: {d['error'][:60]} |\n|---|---|")
            continue
        lines += ["", "| decode (prompt + tokens) | bnb tok/s | nf4 tok/s | speedup | same tokens |",
                  "|---|---|---|---|---|",
                  f"| {d['prompt_tokens']} + {d['decode_tokens']} | {d['bnb_tok_s']:.1f} | {d['nf4_tok_s']:.1f} | "
                  f"{d['speedup']:.3f}x | {_yes(d['tokens_identical'])} |"]
        extra = {mode: st for mode, st in d.get("modes", {}).items() if mode != "nf4"}
        if extra:
            lines += ["", "| decode, other modes | tok/s | speedup over bnb | same tokens as bnb |",
                      "|---|---|---|---|"]
            lines += [f"| {mode} | {st['tok_s']:.1f} | {st['speedup']:.3f}x | "
                      f"{'bound' if st.get('bound') else _yes(st['tokens_identical'])} |" for mode, st in extra.items()]
    return "\n".join(lines)


def _yes(value) -> str:
    return {True: "yes", False: "NO", None: "n/a"}.get(value, str(value))


# --- the model (GPU; transformers, peft and bitsandbytes imported here) ---------------------------


def build_model(dims: dict, *, layers: int, vocab: int, seed: int, attn: str, device: str):
    """LlamaForCausalLM with random bf16 weights, decoder linears as bnb NF4 Linear4bit, LoRA attached (peft)."""
    import bitsandbytes as bnb
    import torch
    import transformers

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise RuntimeError(f"peft {_version('peft')} lacks LoraConfig/get_peft_model: {exc}") from exc
    try:
        config = transformers.LlamaConfig(num_hidden_layers=layers, vocab_size=vocab, **dims)
    except (AttributeError, TypeError) as exc:
        raise RuntimeError(f"transformers {transformers.__version__}: LlamaConfig failed: {exc}") from exc
    config.use_cache = True
    try:
        config._attn_implementation = attn
    except (AttributeError, ValueError) as exc:
        raise RuntimeError(f"transformers {transformers.__version__} refuses attn_implementation={attn!r}: {exc}") \
            from exc
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    replaced = 0
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if name in TARGET_MODULES and type(child) is torch.nn.Linear:
                    setattr(parent, name, _linear4bit(bnb, child, device))
                    replaced += 1
    if replaced != 7 * layers:
        raise RuntimeError(f"replaced {replaced} linears, expected {7 * layers}: transformers' Llama layout changed?")
    try:
        model.is_loaded_in_4bit = True  # what peft reads to pick its bitsandbytes LoRA layer
    except AttributeError:
        pass  # a read-only property in this transformers: peft falls back to its generic LoRA Linear
    model.config.use_cache = True
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGET_MODULES), lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for p in model.parameters():  # peft puts LoRA weights beside their base layer; make sure (not the 4-bit ones)
        if p.requires_grad and p.device != torch.device(device):
            p.data = p.data.to(device)
    info = {"linears_replaced": replaced, "lora_layer_classes": sorted({
        f"{type(m).__module__}.{type(m).__qualname__}" for n, m in model.named_modules()
        if n.endswith(TARGET_MODULES)})}
    return model, config, info


def _linear4bit(bnb, linear, device):
    """A bnb NF4 Linear4bit (double quant, blocksize 64, compute bf16) of `linear`'s weight, quantized on `device`."""
    import torch

    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                            device="meta")
    new.weight = bnb.nn.Params4bit(linear.weight.data.to(torch.bfloat16), requires_grad=False, blocksize=64,
                                   compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8, module=new)
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
    new.to(device)  # Params4bit.to quantizes (bitsandbytes' own _quantize)
    if not new.weight.bnb_quantized or new.weight.quant_state is None:
        raise RuntimeError("bitsandbytes did not quantize the Linear4bit weight on .to(device)")
    return new


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except Exception:
        return "?"


class _Timer:
    """ms of a callable: CUDA events on a GPU (synchronized before and after), perf_counter on the CPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")

    def __call__(self, fn):
        torch = self.torch
        if not self.cuda:
            t0 = time.perf_counter()
            result = fn()
            return (time.perf_counter() - t0) * 1e3, result
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result


def _mode_stats(mode: str, res: dict, routed: dict) -> dict:
    """A mode's times, speedup over bitsandbytes alone and exactness against it, from interleave()'s result."""
    t = summarize_ms(res[mode]["times"])
    stats = {"ms": t, "median_ms": t["median_ms"], "speedup": res["bnb"]["median"] / t["median_ms"],
             "routed": routed.get(mode, {})}
    if mode in UNCOMPARED:
        stats.update(bitexact_vs_bnb=None)
    else:
        stats.update(compare(res["bnb"]["records"], res[mode]["records"]))
    if mode in BOUNDS:
        stats["bound"] = True
    return stats


def train_shape(model, params, batch: int, seq: int, *, modes: dict, vocab: int, seed: int, steps: int, timer,
                device: str):
    """Interleaved train steps on one shape, one run per mode per round (modes: name -> context factory, with
    "bnb" and "nf4"): a result row."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + batch * 100_003 + seq)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    model.train()
    routed = {mode: {} for mode in modes}

    def step():
        for p in params.values():
            p.grad = None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def run(mode):
        before = routed_snapshot()
        with modes[mode]():
            ms, loss = timer(step)
        routed[mode] = counts_delta(before, routed_snapshot())
        return ms, (loss_bits(loss), grad_digest((n, p.grad) for n, p in params.items()))

    res = interleave({mode: (lambda mode=mode: run(mode)) for mode in modes}, warmup=WARMUP, steps=steps)
    kernel_ms = {}
    if device.startswith("cuda"):  # after the timed steps: the profiler's own cost is not in their times
        for mode in modes:
            with modes[mode]():
                kernel_ms[mode] = gpu_kernel_ms(step)
    bnb_t, nf4_t = summarize_ms(res["bnb"]["times"]), summarize_ms(res["nf4"]["times"])
    res["bnb"]["median"] = bnb_t["median_ms"]
    row = {"shape": f"{batch}x{seq}", "batch": batch, "seq": seq, "tokens": batch * seq, "bnb": bnb_t, "nf4": nf4_t,
           "bnb_ms": bnb_t["median_ms"], "nf4_ms": nf4_t["median_ms"],
           "speedup": bnb_t["median_ms"] / nf4_t["median_ms"],
           "routed": routed["nf4"], "routed_during_bnb_alone": routed["bnb"],
           "loss_bits": sorted({r[0] for r in res["bnb"]["records"]}),
           "loss": float(torch.tensor(res["bnb"]["records"][0][0], dtype=torch.int32).view(torch.float32)),
           "bnb_digests": sorted({r[1] for r in res["bnb"]["records"]}),
           "nf4_digests": sorted({r[1] for r in res["nf4"]["records"]}),
           "modes": {mode: _mode_stats(mode, res, routed) for mode in modes if mode != "bnb"}}
    if kernel_ms:
        row["bnb_kernel_ms"], row["nf4_kernel_ms"] = kernel_ms["bnb"], kernel_ms["nf4"]
        for mode, stats in row["modes"].items():
            stats["kernel_ms"] = kernel_ms[mode]
    row.update(compare(res["bnb"]["records"], res["nf4"]["records"]))
    if not row["bnb_deterministic"]:
        row["note"] = NONDETERMINISM_NOTE
    else:
        refuted_by(row)
    if not any(k.endswith("/nf4") for k in row["routed"]):
        row["warning"] = "no dequantization went to nf4 during the patched steps: the comparison shows nothing"
    if device.startswith("cuda"):
        row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def gpu_kernel_ms(step, steps: int = 2) -> float:
    """GPU kernel time per call of `step` (ms): torch.profiler's device time of every kernel over `steps` calls.
    Against the step's own time it says how much of the step the GPU spends running kernels (the rest it waits
    for the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()  # outside the profile: a first call after another mode's may allocate
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def refuted_by(row: dict) -> list[str]:
    """The WITNESSES modes of a train row whose own runs differ; where bitsandbytes alone looked deterministic and
    one does, its determinism was chance: every bit-identity claim of the row is withdrawn (None) and said why."""
    modes = row.get("modes") or {}
    found = [m for m in WITNESSES if (modes.get(m) or {}).get("nf4_deterministic") is False]
    if found and row.get("bnb_deterministic"):
        row["bnb_deterministic_by_chance"] = found
        row["bitexact_vs_bnb"] = None
        for stats in modes.values():
            if stats.get("bitexact_vs_bnb") is not None:
                stats["bitexact_vs_bnb"] = None
        row["note"] = CHANCE_NOTE.format(modes=" and ".join(found)) + " " + NONDETERMINISM_NOTE
    return found


def greedy_decode(model, prompt, n: int, device: str):
    """Prompt forward, then n single-token forwards with the KV cache: (prefill s, decode s, generated ids)."""
    import torch

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(n):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            toks.append(tok)
        sync()
        t2 = time.perf_counter()
    if past is None:
        raise RuntimeError("the model returned no past_key_values: no KV cache, not a decode benchmark")
    return t1 - t0, t2 - t1, torch.cat(toks, dim=1)[0].tolist()


def decode_row(model, *, modes: dict, vocab: int, seed: int, tokens: int, reps: int, device: str) -> dict:
    """Interleaved greedy decode runs, one per mode per round (modes as in train_shape)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed + 17)
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device)
    model.eval()
    routed = {}

    def run(mode):
        before = routed_snapshot()
        with modes[mode]():
            result = greedy_decode(model, prompt, tokens, device)
        routed[mode] = counts_delta(before, routed_snapshot())
        return result[1] * 1e3, result

    res = interleave({mode: (lambda mode=mode: run(mode)) for mode in modes}, warmup=1, steps=reps)
    ids = {mode: {tuple(r[2]) for r in res[mode]["records"]} for mode in res}
    tok_s = {mode: tokens / (statistics.median(res[mode]["times"]) / 1e3) for mode in res}
    others = {}
    for mode in modes:
        if mode == "bnb":
            continue
        others[mode] = {"tok_s": tok_s[mode], "speedup": tok_s[mode] / tok_s["bnb"],
                        "decode_ms": summarize_ms(res[mode]["times"]),
                        "prefill_ms": statistics.median(r[0] * 1e3 for r in res[mode]["records"]),
                        "tokens_identical": len(ids["bnb"] | ids[mode]) == 1, "deterministic": len(ids[mode]) == 1,
                        "first_tokens": list(next(iter(ids[mode])))[:16], "routed": routed.get(mode, {})}
        if mode in UNCOMPARED:
            others[mode].update(tokens_identical=None, deterministic=None, first_tokens=[])
        if mode in BOUNDS:
            others[mode]["bound"] = True
    return {"prompt_tokens": PROMPT_TOKENS, "decode_tokens": tokens, "reps": reps, "bnb_tok_s": tok_s["bnb"],
            "nf4_tok_s": tok_s["nf4"], "speedup": tok_s["nf4"] / tok_s["bnb"],
            "bnb_decode_ms": summarize_ms(res["bnb"]["times"]), "nf4_decode_ms": summarize_ms(res["nf4"]["times"]),
            "bnb_prefill_ms": statistics.median(r[0] * 1e3 for r in res["bnb"]["records"]),
            "nf4_prefill_ms": statistics.median(r[0] * 1e3 for r in res["nf4"]["records"]),
            "tokens_identical": len(ids["bnb"] | ids["nf4"]) == 1, "bnb_deterministic": len(ids["bnb"]) == 1,
            "first_tokens": list(next(iter(ids["bnb"])))[:16], "routed": routed.get("nf4", {}),
            "routed_during_bnb_alone": routed.get("bnb", {}), "modes": others,
            "note": "nf4 mode: single-token 4-bit matmuls without grad run bitsandbytes' fused kernel (not routed), "
                    "only the prompt's forward dequantizes; nf4_fused: they run nf4.linear; unsloth: the release's "
                    "fast_gemv"}


# --- the modes ------------------------------------------------------------------------------------

_peer_counts: dict[tuple[str, str], int] = {}


def routed_snapshot() -> dict:
    """nf4's routed counts and the unsloth mode's call counts, together (counts_delta takes the difference)."""
    from nf4.integrations import bitsandbytes as nf4_bnb

    return {**nf4_bnb.routed_counts(), **_peer_counts}


def mode_contexts(names, unsloth_load=None) -> tuple[dict, dict]:
    """({mode: context factory}, {mode: why it is not run}) for the asked modes ("bnb" and "nf4" always);
    unsloth_load: what loads the release (default verify.unsloth_release.load; tests pass their own)."""
    import nf4

    contexts, skipped = {"bnb": contextlib.nullcontext, "nf4": nf4.patched_bitsandbytes}, {}
    if "nf4_fused" in names:
        contexts["nf4_fused"] = lambda: nf4.patched_bitsandbytes(fused_linear=True)
    if "no_matmul" in names:
        contexts["no_matmul"] = no_matmul_context
    if "dense" in names:
        contexts["dense"] = dense_context
    if "unsloth" in names:
        factory, why = unsloth_context(unsloth_load)
        if factory is None:
            skipped["unsloth"] = why
        else:
            contexts["unsloth"] = factory
    return contexts, skipped


_UNSLOTH: dict = {}


def unsloth_context(load=None, counts=None):
    """(context factory, None) running the release's own Linear4bit override (forced on), counting its kernel
    calls in `counts` (default _peer_counts, which routed_snapshot reads); or (None, why not). load: what
    loads the release (default verify.unsloth_release.load)."""
    from verify import unsloth_release

    counts = _peer_counts if counts is None else counts
    try:
        release = (load or unsloth_release.load)()
        override = release.bnb_override()
    except Exception as exc:  # not extracted here, or refused by its checks
        return None, f"Unsloth {unsloth_release.VERSION}'s override not run: {type(exc).__name__}: {exc}"[:400]
    _UNSLOTH.update(release=release, override=override)

    @contextlib.contextmanager
    def counted(name, original):
        def wrapper(*args, **kwargs):
            if not torch_compiling():
                key = (f"unsloth.{name}", "unsloth")
                counts[key] = counts.get(key, 0) + 1
            return original(*args, **kwargs)

        setattr(release, name, wrapper)
        try:
            yield
        finally:
            del release.__dict__[name]  # the class's method again

    @contextlib.contextmanager
    def context():
        with counted("fast_dequantize", release.fast_dequantize), counted("fast_gemv", release.fast_gemv):
            if not override.install(force=True):
                raise RuntimeError("Unsloth's install_bnb_nf4_override() declined even when forced")
            try:
                yield
            finally:
                override.uninstall()

    return context, None


@contextlib.contextmanager
def _matmul_4bit_replaced(mode: str, compute, counts=None):
    """`bitsandbytes.matmul_4bit` (what Linear4bit.forward calls, looked up at call time; bound in bitsandbytes and
    its autograd module) replaced by compute(A, B, quant_state, bias) while active, calls counted in `counts` (default
    _peer_counts) as ("matmul_4bit", mode); the original put back on exit."""
    import bitsandbytes
    import bitsandbytes.autograd._functions as functions

    counts = _peer_counts if counts is None else counts
    original = bitsandbytes.matmul_4bit
    key = ("matmul_4bit", mode)

    def matmul_4bit(A, B, quant_state, out=None, bias=None):
        counts[key] = counts.get(key, 0) + 1
        return compute(A, B, quant_state, bias)

    bitsandbytes.matmul_4bit = functions.matmul_4bit = matmul_4bit
    try:
        yield
    finally:
        bitsandbytes.matmul_4bit = functions.matmul_4bit = original


def no_matmul_context(counts=None):
    """The no_matmul bound: `matmul_4bit` replaced by `no_matmul_4bit` (_matmul_4bit_replaced)."""
    return _matmul_4bit_replaced("no_matmul", lambda A, B, qs, bias: no_matmul_4bit(A, qs.shape[0], bias), counts)


def no_matmul_4bit(A, n: int, bias=None):
    """A tensor shaped like A @ W^T for a weight of n rows, allocated and never written (no kernel); differentiable
    in A, whose gradient is likewise allocated and never written. bias, if any, is added (a bound on Llama's
    bias-free layers launches nothing for it)."""
    if not _NO_MATMUL:  # built at first use: this module imports torch lazily
        _NO_MATMUL.append(_no_matmul_fn())
    out = _NO_MATMUL[0].apply(A, n)
    return out if bias is None else out + bias


def _no_matmul_fn():
    import torch

    class NoMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, A, n):
            ctx.k = A.shape[-1]
            return A.new_empty((*A.shape[:-1], n))

        @staticmethod
        def backward(ctx, grad):
            return grad.new_empty((*grad.shape[:-1], ctx.k)), None

    return NoMatmul


_NO_MATMUL: list = []
_DENSE: dict = {}  # id(QuantState) -> (QuantState, its weight dequantized by bitsandbytes): the dense bound's weights


def dense_context(counts=None, dequantize=None):
    """The dense bound: `matmul_4bit` replaced (_matmul_4bit_replaced) by F.linear on the weight dequantized once (by
    `dequantize`, default bitsandbytes.functional.dequantize_4bit; kept in _DENSE across entries, so only the first
    call per weight pays it)."""
    import bitsandbytes
    import torch

    dequantize = dequantize or bitsandbytes.functional.dequantize_4bit

    def dense(A, B, quant_state, bias):
        entry = _DENSE.get(id(quant_state))
        if entry is None or entry[0] is not quant_state:
            w = dequantize(B, quant_state)
            if tuple(w.shape) != tuple(quant_state.shape):  # a transposed packed view gives W^T
                w = w.t()
            entry = _DENSE[id(quant_state)] = (quant_state, w.to(A.dtype).contiguous())
        return torch.nn.functional.linear(A, entry[1], None if bias is None else bias.to(A.dtype))

    return _matmul_4bit_replaced("dense", dense, counts)


def mode_text(mode: str, device_name: str) -> str:
    """MODE_TEXT[mode], the fused route's row limit on this GPU filled in."""
    from nf4.integrations.routes import matmul_4bit_route_max_m

    return MODE_TEXT[mode].format(max_m=matmul_4bit_route_max_m(device_name))


def torch_compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


# --- the command ----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments qlora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default: build/qlora_<gpu>.json)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192, Llama's is 32000)")
    ap.add_argument("--shapes", nargs="+", default=["1x512", "2x2048", "8x2048"], help="BATCHxSEQ train shapes")
    ap.add_argument("--steps", type=int, default=10, help="timed train steps per mode after 3 warm-ups")
    ap.add_argument("--decode-tokens", type=int, default=200, help="single-token decode steps after the prompt")
    ap.add_argument("--decode-reps", type=int, default=3, help="timed decode runs per mode after 1 warm-up")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                    help="what to run besides bitsandbytes alone and nf4 (both always run; default: all)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG")
    ap.add_argument("--quick", action="store_true", help="tiny model (hidden 256, 1 layer, vocab 1024), shape 1x32, "
                    "2 steps, 8 decode tokens: a smoke run")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of the code path only
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.dims = QUICK_DIMS if args.quick else FULL_DIMS
    try:
        args.shape_list = [parse_shape(s) for s in args.shapes]
    except ValueError as exc:
        ap.error(str(exc))
    if args.steps < 2 or args.layers < 1 or args.decode_tokens < 1 or args.decode_reps < 1:
        ap.error("--steps needs 2 or more; --layers, --decode-tokens and --decode-reps 1 or more")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    missing = missing_requirements(torch.cuda.is_available() or args.allow_cpu)
    if missing:
        print("experiments qlora needs a CUDA GPU, transformers, peft and bitsandbytes; missing: "
              + ", ".join(missing) + ". Nothing measured.", file=sys.stderr)
        return 2
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    import peft
    import transformers

    from verify import timing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = timing.environment()
    env.update(transformers=transformers.__version__, peft=peft.__version__, accelerate=_version("accelerate"))
    out = args.out or default_out(env["device"])
    print(f"{env['device']}  torch {env['torch']}  transformers {env['transformers']}  peft {env['peft']}  "
          f"bnb {env['bitsandbytes']}  commit {env['commit'][:12]}", flush=True)
    modes, skipped = mode_contexts(args.modes)
    unsloth = {"run": "unsloth" in modes, **({"skipped": skipped["unsloth"]} if "unsloth" in skipped else {})}
    if "unsloth" in modes:
        release, override = _UNSLOTH["release"], _UNSLOTH["override"]
        unsloth.update(provenance=override.provenance(), default_on=override.default_on(),
                       how="forced on (the effect of UNSLOTH_BNB_NF4_LINEAR=1); the release's default on this GPU is "
                           "default_on", shim=release.shim)
    elif "unsloth" not in args.modes:
        unsloth["skipped"] = "not asked (--modes)"
    print(f"modes: {', '.join(modes)}" + (f"; skipped: {skipped}" if skipped else ""), flush=True)
    model, config, info = build_model(args.dims, layers=args.layers, vocab=args.vocab, seed=args.seed,
                                      attn=args.attn, device=device)
    params = {n: p for n, p in sorted(model.named_parameters()) if p.requires_grad}
    if not params or not all("lora_" in n for n in params):
        raise RuntimeError(f"unexpected trainable parameters: {list(params)[:5]}")
    payload = {"env": env, "unsloth": unsloth, "modes": {m: mode_text(m, env["device"]) for m in modes}, "config": {
        **args.dims, "num_hidden_layers": args.layers, "vocab_size": args.vocab, "dtype": "bfloat16",
        "attn_implementation": getattr(config, "_attn_implementation", args.attn),
        "quantization": "bitsandbytes Linear4bit nf4, double quant (compress_statistics), blocksize 64, compute bf16; "
                        "built by replacing the decoder nn.Linear layers (lm_head and embeddings bf16)",
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": list(TARGET_MODULES)},
        "lora_params": len(params), "lora_numel": sum(p.numel() for p in params.values()),
        "gradient_checkpointing": False, "warmup": WARMUP, "steps": args.steps, "seed": args.seed,
        "deterministic_algorithms": args.deterministic, "quick": args.quick, **info}, "rows": [], "decode": []}
    timer = _Timer(device)
    for batch, seq in args.shape_list:
        try:
            row = train_shape(model, params, batch, seq, modes=modes, vocab=args.vocab, seed=args.seed,
                              steps=args.steps, timer=timer, device=device)
        except Exception as exc:  # an OOM on the largest shape must not lose the others
            row = {"shape": f"{batch}x{seq}", "error": f"{type(exc).__name__}: {exc}"[:500]}
        for p in params.values():
            p.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        payload["rows"].append(row)
        print("  " + _fmt(row), flush=True)
    try:
        payload["decode"].append(decode_row(model, modes=modes, vocab=args.vocab, seed=args.seed,
                                            tokens=args.decode_tokens, reps=args.decode_reps, device=device))
    except Exception as exc:
        payload["decode"].append({"error": f"{type(exc).__name__}: {exc}"[:500]})
    path = timing.write_json(out, payload)
    print(f"\nwrote {path}\n")
    print(table(payload))
    bad = [r for r in payload["rows"] + payload["decode"]
           if "error" in r or r.get("bitexact_vs_bnb") is False or r.get("tokens_identical") is False]
    return 1 if bad else 0


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']}: ERROR {r['error']}"
    return (f"{r['shape']}: bnb {r['bnb_ms']:.2f} ms, nf4 {r['nf4_ms']:.2f} ms ({r['speedup']:.3f}x), bit-exact "
            f"{_yes(r['bitexact_vs_bnb'])}, bnb deterministic {_yes(r['bnb_deterministic'])}, routed {r['routed']}")


if __name__ == "__main__":
    sys.exit(main())
