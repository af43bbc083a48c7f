"""Greedy decode and prefill of full-depth 4-bit models in users' hands: dense, bitsandbytes alone, nf4 patched in.

    python -m experiments decode --out results/decode/decode_h100.json
    python -m experiments decode --models llama3-8b --batches 1,8 --compiled off --tokens 32 --budget-s 600
    python -m experiments decode merge results/decode/decode_h200.json old.json new.json  # one device's runs, one file

Needs a CUDA GPU, transformers and bitsandbytes (exit code 2 and no file without them). Nothing comes from the hub.

Models (--models): `llama3-8b` (the catalog's Llama 3.1 8B numbers, which Meta-Llama-3-8B shares: hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, head_dim 128; `transformers.LlamaConfig`) and `qwen2.5-7b` (the catalog's
Qwen2.5 7B: hidden 3584, intermediate 18944, 28 heads, 4 KV heads, q/k/v with bias; `transformers.Qwen2Config`),
their numbers read from experiments/shapes.json, --layers decoder layers (32 by default: Llama 3 8B's depth; Qwen2.5
7B has 28). The vocabulary is cut to --vocab (32000 by default, not 128256 / 152064) to keep the bf16 embedding and
lm_head small; the result says so (`config.vocab_note`). The model is built with random weights
(`torch.manual_seed(--seed)`) in bf16 straight on the GPU. Quantization, as transformers + bitsandbytes load a 4-bit
checkpoint: every nn.Linear of the decoder layers becomes a `bitsandbytes.nn.Linear4bit` (nf4, double quantization
`compress_statistics=True`, blocksize 64, compute dtype bf16) quantized on the GPU by bitsandbytes' own
`Params4bit._quantize` (experiments.qlora's construction); embeddings and lm_head stay bf16.

Modes (--modes): `dense` (the bf16 model before quantization), `bnb` (bitsandbytes alone), `nf4`
(`nf4.patch_bitsandbytes()`), `nf4-fused` (`nf4.patch_bitsandbytes(fused_linear=True)`). Each model is built once:
the dense rows run first, then its linears are quantized in place (the bf16 weights freed as each is replaced) and
the 4-bit modes run on that one quantized model, each inside its patch, in the order --modes names them (so that a
--budget-s stop cuts the last named). Only one model is alive at a time.

Each (model, mode, compiled, batch): a transformers StaticCache of max(--prefill) + --tokens + 1 positions; for each
prefill length P a seeded random prompt (batch x P) is run through the model (logits of the last position only) and
timed (`phase` prefill); then, after the prompt of the first --prefill length, --tokens greedy single-token steps
are timed (`phase` decode). Compiled (--compiled on): the decode step is `torch.compile(mode="reduce-overhead",
fullgraph=True)` (CUDA graphs); the prefill `torch.compile(fullgraph=True, dynamic=False)`; where fullgraph=True
fails, the same without it, and `fullgraph` is False with the graph breaks counted (torch._dynamo's counters) and
the error kept. Eager rows have `fullgraph` None. Times: torch.cuda.synchronize + perf_counter, median of --reps
runs after one warm-up. Decode: `ms_per_token` is ms per step (one token for each of the batch's sequences),
`tokens_per_s` = batch * steps / s. Prefill: `ms_per_token` = ms / (batch * P), `tokens_per_s` = batch * P / s; `ms`
is the phase's total. `linear_share`: one more run under torch.profiler (CUDA activity): the device time of the
4-bit linear's kernels (names containing "nf4_", or bitsandbytes' kDequantize* / *gemm_4bit*) over all kernels' (None
in dense mode, and where the profiler saw no kernel, e.g. inside CUDA-graph replays on some versions; the cuBLAS
GEMM after a dequantization is not counted); `top_kernels`: the same run's ten kernels with the most device time
(name, us; every mode, dense included), after the sum over all its kernels, named "(all kernels)": beside the
phase's wall time it tells device time from host time. `token_agreement`: the fraction of generated tokens (the prompt's
next token and every decoded one, all sequences) equal to bitsandbytes alone's at the same (model, compiled,
batch); 1.0 for bnb itself, filled in on the dense rows once bnb has run (their printed line says n/a); prefill rows
have None. Decode rows also carry `routed`: the bitsandbytes calls nf4 routed during the whole unit (prefill, decode,
warm-ups, profiling), by function and route; under the plain patch on a GPU, bitsandbytes' fused single-token kernel
is not replaced (see experiments.qlora), so the nf4 mode's decode steps may route nothing.

--budget-s stops cleanly before the next unit once the time is spent; the file is saved after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import re
import statistics
import sys
import time
from pathlib import Path

MODELS = {  # key -> (catalog family, size, transformers config class, its real vocabulary, config extras)
    "llama3-8b": ("Llama 3.1", "8B", "LlamaConfig", 128256, {"rope_theta": 500000.0, "rms_norm_eps": 1e-5}),
    "qwen2.5-7b": ("Qwen2.5", "7B", "Qwen2Config", 152064, {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                                                           "use_sliding_window": False}),
}
MODES = ("dense", "bnb", "nf4", "nf4-fused")
COMPILED = {"both": (False, True), "on": (True,), "off": (False,)}
PHASES = ("prefill", "decode")
ROW_KEYS = ("model", "layers", "batch", "mode", "compiled", "phase", "tokens_per_s", "ms_per_token", "fullgraph",
            "linear_share", "token_agreement")
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_KERNEL = re.compile(r"nf4_|kDequantize|gemm_4bit")
TINY_DIMS = {"hidden_size": 64, "intermediate_size": 128, "heads": 4, "kv_heads": 2, "head_dim": 16}
PROFILE_STEPS = 8
TOP_KERNELS = 10  # kernels kept per profiled row (`top_kernels`)


# --- pure helpers (tested on the CPU) -------------------------------------------------------------


def parse_ints(text: str, what: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: positive integers, comma separated, each once, in the given order."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a comma-separated list of integers, e.g. 1,8,32") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{what} {text!r} needs one or more distinct positive integers")
    return values


def parse_names(text: str, choices, what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `choices`, each once."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in choices]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"{what} {text!r}: pick distinct names among {', '.join(choices)}")
    return names


def token_agreement(tokens, reference) -> float | None:
    """The fraction of positions where two (batch, steps) token grids (nested lists or tensors) hold the same id;
    None where either is missing. Different shapes raise."""
    if tokens is None or reference is None:
        return None
    a, b = _as_lists(tokens), _as_lists(reference)
    if [len(r) for r in a] != [len(r) for r in b]:
        raise ValueError(f"token grids differ in shape: {[len(r) for r in a]} vs {[len(r) for r in b]}")
    total = sum(len(r) for r in a)
    if total == 0:
        raise ValueError("no tokens to compare")
    return sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) / total


def _as_lists(grid) -> list[list[int]]:
    grid = grid.tolist() if hasattr(grid, "tolist") else grid
    return [[int(v) for v in row] for row in grid]


def is_linear_kernel(name: str) -> bool:
    """Whether a GPU kernel is the 4-bit linear's: nf4's (names containing "nf4_") or bitsandbytes' dequantize and
    4-bit GEMM kernels (kDequantizeBlockwise, kDequantize, kgemm_4bit_inference_naive, cgemm_4bit...)."""
    return bool(LINEAR_KERNEL.search(name))


def linear_share(kernels) -> float | None:
    """Share of device time in the 4-bit linear's kernels: kernels is an iterable of (name, device time); None
    where the total is 0 (no kernel seen)."""
    kernels = [(name, float(t)) for name, t in kernels]
    total = sum(t for _, t in kernels)
    if total <= 0:
        return None
    return sum(t for name, t in kernels if is_linear_kernel(name)) / total


def make_row(**fields) -> dict:
    """A result row: every ROW_KEYS key (missing ones None), checked (phase, mode, types), extras kept after."""
    unknown_required = [k for k in ("model", "layers", "batch", "mode", "compiled", "phase") if fields.get(k) is None]
    if unknown_required:
        raise ValueError(f"a row needs {', '.join(unknown_required)}")
    if fields["phase"] not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {fields['phase']!r}")
    if fields["mode"] not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {fields['mode']!r}")
    for key in ("compiled",) + (("fullgraph",) if fields.get("fullgraph") is not None else ()):
        if not isinstance(fields[key], bool):
            raise TypeError(f"{key} must be a bool, got {fields[key]!r}")
    for key in ("linear_share", "token_agreement"):
        v = fields.get(key)
        if v is not None and not 0.0 <= v <= 1.0:
            raise ValueError(f"{key} must lie in [0, 1], got {v!r}")
    row = {key: fields.get(key) for key in ROW_KEYS}
    row.update({k: v for k, v in fields.items() if k not in row})
    return row


def timing_fields(phase: str, batch: int, tokens: int, seconds: float) -> dict:
    """tokens_per_s, ms_per_token and ms of a phase that took `seconds`: prefill of batch x tokens prompt
    positions (ms per position), or decode of `tokens` steps (ms per step, batch tokens each)."""
    if seconds <= 0 or tokens < 1 or batch < 1:
        raise ValueError("timing needs positive seconds, tokens and batch")
    ms = seconds * 1e3
    per = batch * tokens if phase == "prefill" else tokens
    return {"tokens_per_s": batch * tokens / seconds, "ms_per_token": ms / per, "ms": ms}


def format_row(row: dict) -> str:
    """One line: what the row measured."""
    head = (f"{row['model']} L{row['layers']} b{row['batch']} {row['mode']:<9} "
            f"{'compiled' if row['compiled'] else 'eager':<8} {row['phase']:<7}")
    if row.get("error"):
        return f"{head} ERROR {row['error']}"

    def num(key, fmt):
        return "n/a" if row.get(key) is None else format(row[key], fmt)

    ctx = f" P={row['prompt_tokens']}" if row.get("prompt_tokens") else ""
    return (f"{head}{ctx} {num('tokens_per_s', '.1f')} tok/s {num('ms_per_token', '.4f')} ms/tok fullgraph "
            f"{row.get('fullgraph')} linear share {num('linear_share', '.3f')} agreement "
            f"{num('token_agreement', '.4f')}")


def default_out(device_name: str) -> str:
    """build/decode/decode_<gpu>.json (a committed result is written only where --out names it)."""
    from verify.timing import device_slug

    return f"build/decode/decode_{device_slug(device_name)}.json"


def missing_requirements(cuda_available: bool) -> list[str]:
    """What this benchmark needs and cannot find: a CUDA GPU, transformers, bitsandbytes."""
    missing = [] if cuda_available else ["a CUDA GPU (torch.cuda.is_available() is False)"]
    return missing + [n for n in ("transformers", "bitsandbytes") if importlib.util.find_spec(n) is None]


def save(path, payload: dict):
    """Write the result file (verify.timing.write_json): rows checked for every ROW_KEYS key first."""
    from verify.timing import write_json

    for row in payload.get("rows", []):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"row lacks {missing}: {row}")
    return write_json(path, payload)


def model_dims(key: str, tiny: bool = False) -> dict:
    """hidden_size, intermediate_size, heads, kv_heads, head_dim of a --models key, from the shape catalog."""
    if tiny:
        return dict(TINY_DIMS)
    from . import catalog

    family, size = MODELS[key][:2]
    found = [m for m in catalog.models() if m["family"] == family and m["size"] == size]
    if len(found) != 1:
        raise RuntimeError(f"{family} {size} is not in experiments/shapes.json once")
    return {k: found[0][k] for k in ("hidden_size", "intermediate_size", "heads", "kv_heads", "head_dim")}


# --- the model (transformers and bitsandbytes imported here) ----------------------------------------


def build_config(key: str, *, layers: int, vocab: int, max_positions: int, tiny: bool = False):
    """The transformers config of a --models key (LlamaConfig / Qwen2Config) from the catalog's numbers."""
    import transformers

    cls_name, extras = MODELS[key][2], MODELS[key][4]
    d = model_dims(key, tiny)
    config = getattr(transformers, cls_name)(
        hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"], num_hidden_layers=layers, vocab_size=vocab,
        max_position_embeddings=max_positions, tie_word_embeddings=False, **extras)
    config.use_cache = True
    with contextlib.suppress(AttributeError, ValueError):
        config._attn_implementation = "sdpa"
    return config


def build_model(key: str, *, layers: int, vocab: int, max_positions: int, seed: int, device: str,
                tiny: bool = False):
    """The bf16 model with random weights, built on `device`, eval mode."""
    import torch
    import transformers

    config = build_config(key, layers=layers, vocab=vocab, max_positions=max_positions, tiny=tiny)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
            model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_arg: torch.bfloat16})
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def quantize_linears(model, device: str) -> int:
    """Every nn.Linear of the decoder layers replaced, in place, by a bitsandbytes nf4 Linear4bit (double quant,
    blocksize 64, compute bf16) quantized on `device`; returns how many (7 per layer)."""
    import bitsandbytes as bnb
    import torch

    from .qlora import _linear4bit

    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if name in TARGET_MODULES and type(child) is torch.nn.Linear:
                    setattr(parent, name, _linear4bit(bnb, child, device))
                    del child
                    replaced += 1
    expected = len(TARGET_MODULES) * len(model.model.layers)
    if replaced != expected:
        raise RuntimeError(f"replaced {replaced} linears, expected {expected}: the model's layout changed?")
    return replaced


def mode_context(mode: str):
    """The context a mode runs in: nothing for dense and bnb, nf4's patch (plain or fused_linear) otherwise."""
    import nf4

    if mode == "nf4":
        return nf4.patched_bitsandbytes()
    if mode == "nf4-fused":
        return nf4.patched_bitsandbytes(fused_linear=True)
    return contextlib.nullcontext()


def make_cache(model, batch: int, max_len: int, device: str):
    """A transformers StaticCache of max_len positions for `batch` sequences (either constructor generation)."""
    import torch
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": max_len}
    if "max_batch_size" in params:  # transformers 4.x
        kwargs.update(max_batch_size=batch, device=device, dtype=torch.bfloat16)
    return StaticCache(**kwargs)


class Runner:
    """Forward calls of one model through one StaticCache: prefill (a prompt) and step (one token per sequence),
    each returning the greedy next token (batch, 1); the cache argument named as this transformers names it."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.positions = "cache_position" in params  # transformers 4.x wants them; 5.x keeps its own
        self.keep = "logits_to_keep" if "logits_to_keep" in params else None
        self.pos = 0

    def reset(self):
        self.cache.reset()
        self.pos = 0

    def _kwargs(self, n: int, device) -> dict:
        import torch

        kw = {self.cache_arg: self.cache, "use_cache": True}
        if self.positions:
            kw["cache_position"] = torch.arange(self.pos, self.pos + n, device=device)
        if self.keep:
            kw[self.keep] = 1
        self.pos += n
        return kw

    def forward(self, ids, **kw):
        return self.model(input_ids=ids, **kw).logits[:, -1:].argmax(-1)

    def prefill(self, fn, ids):
        return fn(ids, **self._kwargs(ids.shape[1], ids.device))

    def step(self, fn, tok):
        return fn(tok, **self._kwargs(1, tok.device))


def compile_fn(fn, call, *, mode):
    """(compiled fn, fullgraph, graph_breaks, error): torch.compile(fn, mode, fullgraph=True), first called by
    `call(compiled)`; where that fails, torch.compile without fullgraph, its graph breaks counted."""
    import torch

    counters = torch._dynamo.utils.counters
    try:
        compiled = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
        call(compiled)
        return compiled, True, 0, None
    except Exception as exc:  # a graph break under fullgraph=True (Unsupported) or another compile error
        error = f"{type(exc).__name__}: {exc}"[:400]
    before = sum(counters["graph_break"].values())
    compiled = torch.compile(fn, mode=mode, dynamic=False)
    call(compiled)
    return compiled, False, sum(counters["graph_break"].values()) - before, error


def _kernel_times(prof):
    """(name, self device time in us) of every GPU kernel the profiler saw."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            out.append((e.key, e.self_device_time_total))
    return out


# --- one (model, mode, compiled, batch) -------------------------------------------------------------


def run_batch(model, *, key: str, layers: int, mode: str, compiled: bool, batch: int, prefills: list[int],
              tokens: int, reps: int, vocab: int, seed: int, device: str, emit) -> tuple[dict, list]:
    """Prefill rows (one per --prefill length), each passed to emit(row) when ready; returns the decode row (not
    emitted: its token_agreement comes after) and the generated tokens (batch, tokens + 1) as lists."""
    import torch

    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cache = make_cache(model, batch, max(prefills) + tokens + 1, device)
    run = Runner(model, cache)
    prompts = {}
    for p in prefills:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 10_007 + p)
        prompts[p] = torch.randint(0, vocab, (batch, p), generator=gen).to(device)
    base = {"model": key, "layers": layers, "batch": batch, "mode": mode, "compiled": compiled, "reps": reps}
    with torch.no_grad():
        run.reset()
        run.prefill(run.forward, prompts[prefills[0]][:, :1])  # eager: the static cache's lazy init happens here
        prefill_fn = step_fn = run.forward
        info = {"prefill": {"fullgraph": None}, "decode": {"fullgraph": None}}
        if compiled:
            def call_prefill(fn):
                run.reset()
                return run.prefill(fn, prompts[prefills[0]])

            def call_step(fn):
                run.reset()
                tok = run.prefill(run.forward, prompts[prefills[0]])
                for _ in range(3):  # reduce-overhead records its CUDA graph on the 3rd call or so
                    torch.compiler.cudagraph_mark_step_begin()
                    tok = run.step(fn, tok).clone()

            prefill_fn, *pre = compile_fn(run.forward, call_prefill, mode=None)
            step_fn, *dec = compile_fn(run.forward, call_step, mode="reduce-overhead")
            for name, (fg, breaks, err) in (("prefill", pre), ("decode", dec)):
                info[name] = {"fullgraph": fg, "graph_breaks": breaks, **({"fullgraph_error": err} if err else {})}

        def do_prefill(p):
            run.reset()
            sync()
            t0 = time.perf_counter()
            tok = run.prefill(prefill_fn, prompts[p])
            sync()
            return time.perf_counter() - t0, tok

        def do_decode(n):
            run.reset()
            tok = run.prefill(prefill_fn, prompts[prefills[0]]).clone()
            toks = [tok]
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                if compiled:
                    torch.compiler.cudagraph_mark_step_begin()
                tok = run.step(step_fn, tok).clone()
                toks.append(tok)
            sync()
            return time.perf_counter() - t0, torch.cat(toks, dim=1)

        for p in prefills:
            times = [do_prefill(p)[0] for _ in range(reps + 1)][1:]
            share, top = _profile(lambda p=p: do_prefill(p), cuda, mode != "dense")
            emit(make_row(**base, **info["prefill"], phase="prefill", prompt_tokens=p,
                          **timing_fields("prefill", batch, p, statistics.median(times)), linear_share=share,
                          top_kernels=top))
        runs = [do_decode(tokens) for _ in range(reps + 1)][1:]
        generated = runs[-1][1].tolist()
        share, top = _profile(lambda: do_decode(min(tokens, PROFILE_STEPS)), cuda, mode != "dense")
        row = make_row(**base, **info["decode"], phase="decode", prompt_tokens=prefills[0], decode_tokens=tokens,
                       **timing_fields("decode", batch, tokens, statistics.median(r[0] for r in runs)),
                       linear_share=share, deterministic=all(r[1].tolist() == generated for r in runs),
                       top_kernels=top)
    return row, generated


def _profile(fn, cuda: bool, share: bool) -> tuple:
    """(linear_share where `share`, else None; the TOP_KERNELS kernels with the most device time as [name, us])
    of one call of fn under torch.profiler's CUDA activity ((None, None) without CUDA)."""
    if not cuda:
        return None, None
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = _kernel_times(prof)
    top = top_kernels(kernels)
    return linear_share(kernels) if share else None, [["(all kernels)", round(sum(t for _, t in kernels), 1)], *top]


def top_kernels(kernels, count: int = 0) -> list:
    """The `count` (default TOP_KERNELS) kernels with the most device time, most first: [name (cut to 120
    characters), us rounded to 0.1]."""
    ranked = sorted(((name, float(t)) for name, t in kernels), key=lambda kt: -kt[1])
    return [[name[:120], round(t, 1)] for name, t in ranked[:count or TOP_KERNELS]]


# --- merging runs ----------------------------------------------------------------------------------

RUN_KEY = ("model", "layers", "batch", "mode", "compiled", "phase", "prompt_tokens")


def merge(payloads: list[dict], names: list[str] | None = None) -> dict:
    """One device's decode runs as one file: the rows of every run, a later run's row replacing an earlier one of
    the same (model, layers, batch, mode, compiled, phase, prompt length); each row carries its run's commit, and
    `runs` lists each run (file, commit, date, what it was asked to run, rows, why it stopped). The newest run's
    environment and config head the file. ValueError for runs of different devices or a row without its keys."""
    if not payloads:
        raise ValueError("merge needs at least one run")
    devices = {p.get("device") for p in payloads}
    if len(devices) != 1:
        raise ValueError(f"runs of different devices cannot be merged: {sorted(map(str, devices))}")
    names = names or [f"run {i}" for i in range(len(payloads))]
    rows: dict = {}
    runs = []
    for name, p in zip(names, payloads, strict=True):
        for part in p.get("runs") or [{"file": name, "commit": (p.get("environment") or {}).get("commit"),
                                       "date_utc": (p.get("environment") or {}).get("date_utc"),
                                       "asked": {k: (p.get("config") or {}).get(k) for k in
                                                 ("batches", "modes", "compiled", "prefill", "tokens", "reps")},
                                       "rows": len(p.get("rows") or []), "stopped": p.get("stopped")}]:
            runs.append(part)
        commit = (p.get("environment") or {}).get("commit")
        for r in p.get("rows") or []:
            missing = [k for k in ROW_KEYS if k not in r]
            if missing:
                raise ValueError(f"{name}: a row lacks {missing}")
            r = {"commit": commit, **r}
            rows[tuple(r.get(k) for k in RUN_KEY)] = r
    newest = payloads[-1]
    return {"device": newest.get("device"), "environment": newest.get("environment"), "config": newest.get("config"),
            "runs": runs, "rows": list(rows.values()), "stopped": None}


def merge_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments decode merge",
                                 description="join decode runs of one device into one file (`merge`)")
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    args = ap.parse_args(argv)
    try:
        payloads = [json.loads(Path(f).read_text()) for f in args.inputs]
        merged = merge(payloads, list(args.inputs))
    except (OSError, ValueError) as exc:
        print(f"decode merge: {exc}", file=sys.stderr)
        return 2
    save(args.out, merged)
    print(f"wrote {args.out} ({len(merged['rows'])} rows from {len(payloads)} runs)")
    return 0


# --- the command ----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default: build/decode/decode_<gpu>.json)")
    ap.add_argument("--models", default="llama3-8b,qwen2.5-7b", help=f"comma separated among {', '.join(MODELS)}")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, Llama 3 8B's depth)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary, cut from the models' own (default 32000)")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes (default 1,8,32)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma separated among {', '.join(MODES)}")
    ap.add_argument("--compiled", default="both", choices=tuple(COMPILED), help="eager, compiled or both")
    ap.add_argument("--prefill", default="512,2048", help="prompt lengths timed (default 512,2048); decode "
                    "follows the first")
    ap.add_argument("--tokens", type=int, default=64, help="greedy decode steps timed (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per phase after one warm-up (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None, help="stop cleanly before the next unit after this "
                    "many seconds (the file holds every row so far)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # hidden 64: a smoke run of the code
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of the code path only
    args = ap.parse_args(argv)
    try:
        args.model_list = parse_names(args.models, MODELS, "--models")
        modes = parse_names(args.modes, MODES, "--modes")
        # dense first (it runs before the linears are quantized in place), then the order given: under --budget-s
        # the modes named first are the ones that run
        args.mode_list = [m for m in modes if m == "dense"] + [m for m in modes if m != "dense"]
        args.batch_list = parse_ints(args.batches, "--batches")
        args.prefill_list = parse_ints(args.prefill, "--prefill")
    except ValueError as exc:
        ap.error(str(exc))
    if args.layers < 1 or args.tokens < 1 or args.reps < 1 or args.vocab < 2:
        ap.error("--layers, --tokens and --reps need 1 or more, --vocab 2 or more")
    if args.budget_s is not None and args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    args.compiled_list = COMPILED[args.compiled]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = parse_args(argv)
    import torch

    missing = missing_requirements(torch.cuda.is_available() or args.allow_cpu)
    if missing:
        print("experiments decode needs a CUDA GPU, transformers and bitsandbytes; missing: " + ", ".join(missing)
              + ". Nothing measured, no file written.", file=sys.stderr)
        return 2
    import transformers

    from verify import timing

    start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = timing.environment()
    env["transformers"] = transformers.__version__
    out = args.out or default_out(env["device"])
    max_positions = max(8192, max(args.prefill_list) + args.tokens + 1)
    payload = {"device": env["device"], "environment": env, "rows": [], "stopped": None, "config": {
        "models": {k: {"catalog": f"{MODELS[k][0]} {MODELS[k][1]}", "config_class": MODELS[k][2],
                       **model_dims(k, args.tiny), **MODELS[k][4], "real_vocab_size": MODELS[k][3]}
                   for k in args.model_list},
        "layers": args.layers, "vocab_size": args.vocab, "batches": args.batch_list, "modes": args.mode_list,
        "compiled": [bool(c) for c in args.compiled_list], "prefill": args.prefill_list, "tokens": args.tokens,
        "reps": args.reps, "seed": args.seed, "tiny": args.tiny, "dtype": "bfloat16", "attn_implementation": "sdpa",
        "vocab_note": f"vocabulary cut to {args.vocab} (embedding and lm_head), not the models' own "
                      + ", ".join(f"{k} {MODELS[k][3]}" for k in args.model_list),
        "quantization": "bitsandbytes Linear4bit nf4, double quant (compress_statistics), blocksize 64, compute "
                        "bf16, quantized on the device; every decoder nn.Linear replaced (lm_head and embeddings "
                        "bf16)",
        "compile": "decode step torch.compile(mode='reduce-overhead', fullgraph=True); prefill "
                   "torch.compile(fullgraph=True, dynamic=False); fullgraph=False rows fell back to graph breaks",
        "cache": "transformers StaticCache of max(prefill) + tokens + 1 positions; decode follows the first prefill"}}
    print(f"{env['device']}  torch {env['torch']}  transformers {env['transformers']}  bnb {env['bitsandbytes']}  "
          f"commit {env['commit'][:12]}", flush=True)
    reference: dict = {}  # (model, compiled, batch) -> bitsandbytes alone's tokens
    pending: dict = {}  # (model, compiled, batch) -> dense decode rows waiting for them

    def emit(row):
        payload["rows"].append(row)
        timing.write_json(out, payload)
        print("  " + format_row(row), flush=True)

    def out_of_time() -> bool:
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            payload["stopped"] = f"--budget-s {args.budget_s:g} spent after {time.monotonic() - start:.0f} s"
            return True
        return False

    for key in args.model_list:
        if payload["stopped"] or out_of_time():
            break
        model = build_model(key, layers=args.layers, vocab=args.vocab, max_positions=max_positions, seed=args.seed,
                            device=device, tiny=args.tiny)
        quantized = False
        for mode in args.mode_list:
            if mode != "dense" and not quantized:
                payload["config"].setdefault("linears_replaced", {})[key] = quantize_linears(model, device)
                quantized = True
                if device == "cuda":
                    torch.cuda.empty_cache()
            for compiled in args.compiled_list:
                for batch in args.batch_list:
                    if payload["stopped"] or out_of_time():
                        break
                    if compiled:
                        torch._dynamo.reset()
                    try:
                        before = routed_snapshot()
                        with mode_context(mode):
                            row, toks = run_batch(
                                model, key=key, layers=args.layers, mode=mode, compiled=compiled, batch=batch,
                                prefills=args.prefill_list, tokens=args.tokens, reps=args.reps, vocab=args.vocab,
                                seed=args.seed, device=device, emit=emit)
                        row["routed"] = counts_delta(before, routed_snapshot())  # the whole unit's calls
                        record_agreement(row, toks, reference, pending)
                    except Exception as exc:  # an OOM at batch 32 must not lose the other rows
                        row = make_row(model=key, layers=args.layers, batch=batch, mode=mode, compiled=compiled,
                                       phase="decode", error=f"{type(exc).__name__}: {exc}"[:500])
                    emit(row)
                    if device == "cuda":
                        torch._dynamo.reset()
                        torch.cuda.empty_cache()
        del model
        if device == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    timing.write_json(out, payload)
    print(f"\nwrote {out}" + (f" (stopped: {payload['stopped']})" if payload["stopped"] else ""))
    bad = [r for r in payload["rows"] if r.get("error")]
    return 1 if bad else 0


def routed_snapshot() -> dict:
    """nf4's counts of the bitsandbytes calls it routed, by (function, route)."""
    from nf4.integrations import bitsandbytes as nf4_bnb

    return dict(nf4_bnb.routed_counts())


def counts_delta(before: dict, after: dict) -> dict[str, int]:
    """routed counts after minus before, as {"function/route": n}, zeros dropped (experiments.qlora's)."""
    from .qlora import counts_delta as delta

    return delta(before, after)


def record_agreement(row: dict, toks, reference: dict, pending: dict) -> None:
    """A decode row of a unit (model, compiled, batch) gets token_agreement against bitsandbytes alone's tokens
    (reference: unit -> them); a row that ran before bnb (dense) waits in `pending` and is filled in, in place
    (it was saved already; the next save carries the value), when bnb's tokens come."""
    unit = (row["model"], row["compiled"], row["batch"])
    if row["mode"] == "bnb":
        reference[unit] = toks
        for waiting, their in pending.pop(unit, []):
            waiting["token_agreement"] = token_agreement(their, toks)
    if unit in reference:
        row["token_agreement"] = token_agreement(toks, reference[unit])
    else:
        pending.setdefault(unit, []).append((row, toks))

if __name__ == "__main__":
    sys.exit(main())
