"""The challenge harness (Unsloth puzzle A, docs/FORMAT.md §8): correctness, then timing.

An MLP of three `bnb.nn.Linear4bit` layers (nf4, compress_statistics=True, quant_storage=uint8,
compute_dtype=dt), created in float32 and quantized when moved to the GPU, then each
`weight.quant_state.dtype = dt`; forward = down(silu(gate(x)) * up(x)). Per configuration and
implementation, called as the puzzle calls its candidate, `fx(layer)` with the `Linear4bit`
module (so each candidate's own attribute access is inside the timed loop), and also as
`fx(layer.weight, layer.weight.quant_state)` (the second table):

  check   the MLP forward with the dequantized weights (`F.linear`, and the puzzle's `x @ W.t()`)
          against the module's own forward (`torch.testing.assert_close`, dtype checked), and every
          weight against the baseline: the puzzle's assert_close (stride checked) and bit for bit (a
          mismatch is judged by verify.known, like a matrix cell)
  wall    `iters` iterations of the three weights, a `torch.cuda.synchronize()` after each call
          (verify.timing.wall_time_us), in both call forms; speedup = baseline total / candidate
          total, over two baselines: Unsloth 2026.10.9's own fast_dequantize (its Triton kernel, run
          from the release's files, when they are here) and the legacy three-launch path
          (Unsloth <= 2025 / its ctypes fallback, re-implemented in verify.peers)
  device  per weight: median CUDA-event time with rotating inputs, GB/s and % of the copy
          bandwidth measured once per run; host issue time per call

nf4 must be bit-exact to be timed (check before you time); a peer is timed when it passes
the puzzle's checks, and its bit-exactness is reported beside its times.
"""

from __future__ import annotations

import math
import random
import sys
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from . import known, peers, timing
from .cases import DTYPE_NAMES, SHORT, clone_state
from .exact import compare


@dataclass(frozen=True)
class Config:
    """One puzzle configuration: (bsz, qlen, hd, m, seed, dt)."""

    bsz: int
    qlen: int
    hd: int
    m: int
    seed: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.bsz}x{self.qlen} hd{self.hd} m{self.m} {SHORT[self.dtype]}"


CONFIGS = (
    Config(2, 3333, 2048, 8192, 3407, torch.float16),
    Config(5, 777, 1024, 4096, 3409, torch.bfloat16),
    Config(3, 2048, 4096, 14336, 3408, torch.bfloat16),
)
LEGACY = "unsloth"  # Unsloth <= 2025's three-launch path (its ctypes fallback today), re-implemented
RELEASE = "unsloth.2026.10.9"  # the current release's fast_dequantize, run from its files
BASELINE = RELEASE  # the puzzle's baseline: fast_dequantize as the current Unsloth release runs it
LAYERS = ("up_proj", "gate_proj", "down_proj")  # the puzzle's mlp_dequantize order


class MLP(torch.nn.Module):
    """The puzzle's MLP: gate and up Linear4bit(hd, m), down Linear4bit(m, hd), quantized by `.to(device)`."""

    def __init__(self, hd: int, m: int, dtype: torch.dtype, device: str):
        super().__init__()
        import bitsandbytes as bnb

        def layer(fan_in, fan_out):
            lin = bnb.nn.Linear4bit(fan_in, fan_out, bias=None, compute_dtype=dtype, compress_statistics=True,
                                    quant_type="nf4", quant_storage=torch.uint8)
            return lin.to(device)

        self.gate_proj = layer(hd, m)
        self.up_proj = layer(hd, m)
        self.down_proj = layer(m, hd)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.quant_state.dtype = dtype  # bitsandbytes keeps float32 from creation (the puzzle's fix)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def set_seed(seed: int) -> None:
    """What transformers.set_seed does for the puzzle."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build(cfg: Config, device: str):
    """(mlp, x) seeded as the puzzle does."""
    set_seed(cfg.seed)
    torch.set_default_dtype(torch.float32)
    mlp = MLP(cfg.hd, cfg.m, cfg.dtype, device)
    x = torch.randn((cfg.bsz, cfg.qlen, cfg.hd), device=device, dtype=cfg.dtype)
    return mlp, x


# --- implementations, called as fx(layer.weight, layer.weight.quant_state) ------------------------


def implementations(device: str, *, include_compile: bool = True, names=None) -> dict:
    """name -> (callable(weight, quant_state), callable for timing once warm)."""
    import nf4

    impls = {}
    impls["nf4"] = (nf4.dequantize, nf4.dequantize)  # the puzzle's fx is the function itself
    buffers: dict = {}

    def nf4_out_fn(w, qs):  # like Unsloth's use_global_buffer: one output buffer per shape and dtype
        key = (tuple(qs.shape), qs.dtype, w.device)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = torch.empty(qs.shape, dtype=qs.dtype, device=w.device)
        return nf4.dequantize(w, qs, out=buf)

    impls["nf4.out_buffer"] = (nf4_out_fn, nf4_out_fn)
    if device == "cuda" and peers.unsloth_release() is not None:
        impls[RELEASE] = (peers.unsloth_release_dequantize,) * 2

        def release_global(w, qs):
            return peers.unsloth_release_dequantize(w, qs, use_global_buffer=True)

        impls[RELEASE + ".global_buffer"] = (release_global, release_global)
    if device == "cuda":
        impls["unsloth"] = (peers.unsloth_fast_dequantize,) * 2

        def global_fn(w, qs):
            return peers.unsloth_fast_dequantize(w, qs, use_global_buffer=True)

        impls["unsloth.global_buffer"] = (global_fn, global_fn)
    impls["bnb.dequantize_4bit"] = (peers.bnb_dequantize,) * 2
    if include_compile and device == "cuda":
        from .impls import compile_peer
        from .inductor import fusion_switch_missing

        for fusion, name in ((True, "torch.compile"), (False, "torch.compile.no_fp_fusion")):
            if fusion or fusion_switch_missing() is None:
                peer = compile_peer(fusion)
                impls[name] = (peer, peer.call_warm)
    if names is not None:
        impls = {k: v for k, v in impls.items() if k in names}
    return impls


# --- correctness ------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _close(a, b, **kw) -> str | None:
    """None when torch.testing.assert_close passes, else the first lines of its message."""
    try:
        torch.testing.assert_close(a, b, **kw)
        return None
    except AssertionError as exc:
        return " | ".join(str(exc).splitlines()[:4])[:400]


def _bit_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bit patterns differ, counted on the device (every element if shape/dtype differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum().item())


class WeightContext:
    """verify.known's view of one challenge weight (see verify.matrix.CaseContext)."""

    def __init__(self, weight, qs, device: str):
        self.case = SimpleNamespace(shape=tuple(qs.shape), blocksize=qs.blocksize, out_dtype=qs.dtype,
                                    double_quant=qs.nested, group="challenge", id="challenge")
        self.device = device
        self.truncated = False
        self.interpreting = False
        self.has_subnormal_products = False  # trained-scale weights: no absmax near 1e-38
        self._weight, self._qs = weight, qs

    def model(self, **keywords) -> torch.Tensor:
        import reference

        from .impls import to_torch
        from .models import model_dequant

        q = reference.from_bnb(self._weight, self._qs)
        arr = model_dequant(q, DTYPE_NAMES[self._qs.dtype], **keywords)
        return to_torch(arr, self._qs.dtype, transpose=self._weight.shape[0] == 1)


def forward_with(x, weights: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP forward with given weights: (F.linear form, the puzzle's mlp_forward: x @ W.t())."""
    u, g, d = (weights[k] for k in LAYERS)
    linear = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
    up = x @ u.t()
    gate = x @ g.t()
    matmul = (F.silu(gate) * up) @ d.t()
    return linear, matmul


def state_problems(layer, dtype: torch.dtype) -> list[str]:
    """The puzzle's assert_correct_bnb (18 Feb 2025), as a list of what does not hold."""
    w, qs = layer.weight, layer.weight.quant_state
    checks = {"weight.dtype == uint8": w.dtype == torch.uint8, "quant_state.dtype == dt": qs.dtype == dtype,
              "absmax.dtype == uint8": qs.absmax.dtype == torch.uint8,
              "code.dtype == float32": qs.code.dtype == torch.float32,
              "offset.dtype == float32": qs.offset.dtype == torch.float32, "blocksize == 64": qs.blocksize == 64,
              "state2.absmax.dtype == float32": qs.state2.absmax.dtype == torch.float32,
              "state2.code.dtype == float32": qs.state2.code.dtype == torch.float32,
              "state2.blocksize == 256": qs.state2.blocksize == 256}
    return [name for name, ok in checks.items() if not ok]


def check(name: str, fn, mlp, x, expected_y, baseline: dict, device: str, baseline_forward_ok: bool = True) -> dict:
    """The puzzle's checks for one implementation, and bit-exactness against the baseline's weights.

    A forward mismatch counts against the implementation unless its weights equal the baseline's bit
    for bit and the baseline fails the same forward check (then the harness, not the weights, differs).
    """
    layers = {k: getattr(mlp, k) for k in LAYERS}
    result: dict = {"weights": {}}
    try:
        weights = {}
        for k, layer in layers.items():
            weights[k] = fn(layer.weight, layer.weight.quant_state).clone()
            _sync(device)
    except Exception as exc:
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
    status = "pass"
    for k, w in weights.items():
        ref = baseline[k]
        entry = {"mismatches": _bit_mismatches(w, ref), "allclose_error": _close(w.t(), ref.t(), check_stride=True)}
        if entry["mismatches"]:
            qs = layers[k].weight.quant_state
            verdict = known.classify(name, WeightContext(layers[k].weight, qs, device), w.cpu(), ref.cpu())
            entry.update(status=verdict.status, defects=list(verdict.defects), model=verdict.model,
                         first=[list(i) for i in verdict.first], detail=verdict.detail[:600])
            if verdict.failed:
                status = "fail"
            elif status == "pass":
                status = "known"
        if entry["allclose_error"]:
            status = "fail"
        result["weights"][k] = entry
    y_linear, y_matmul = forward_with(x, weights)
    result["forward_linear_error"] = _close(y_linear, expected_y, check_dtype=True)
    # the puzzle's assert_same: dtype asserted, assert_close with check_stride
    result["forward_matmul_error"] = (None if y_matmul.dtype == x.dtype else f"dtype {y_matmul.dtype}") or \
        _close(y_matmul, expected_y, check_stride=True)
    result["forward_linear_bitexact"] = compare(y_linear, expected_y).ok
    result["bitexact"] = all(e["mismatches"] == 0 for e in result["weights"].values())
    if result["forward_linear_error"] or result["forward_matmul_error"]:
        result["puzzle_check"] = "fail"
        if result["bitexact"] and not baseline_forward_ok:
            result["note"] = "the forward check fails for the baseline too: the module's forward differs"
        elif status == "known":
            # Every differing weight is explained by a known third-party defect (e.g. inductor's FMA):
            # the implementation fails the puzzle's check, as reported, but nothing here is unexplained.
            defects = sorted({d for e in result["weights"].values() for d in e.get("defects", [])})
            result["note"] = "fails the puzzle's forward check because of known defect(s): " + ", ".join(defects)
        else:
            status = "fail"
    else:
        result["puzzle_check"] = "pass"
    result["status"] = status
    return result


# --- timing -----------------------------------------------------------------------------------


def rotated_inputs(layer) -> tuple[list, int]:
    """Copies of one layer's (packed, quant_state) so that L2 never holds the next call's data; and its bytes."""
    w, qs = layer.weight, layer.weight.quant_state
    n = math.prod(qs.shape)
    nbytes = timing.nf4_bytes(n, qs.blocksize, torch.empty((), dtype=qs.dtype).element_size(), qs.nested)
    inputs = [(w.data, qs)] + [(w.data.clone(), clone_state(qs)) for _ in range(timing.rotation_count(nbytes) - 1)]
    return inputs, nbytes


def by_layer(name: str, fn):
    """The candidate as the puzzle calls it, fx(layer): nf4 takes the module itself; a peer whose
    signature is (weight, quant_state) reads them from the layer inside the call, as the puzzle's
    baseline does."""
    if name == "nf4":
        import nf4

        return nf4.dequantize
    return lambda layer: fn(layer.weight, layer.weight.quant_state)


def time_impl(name, timed_fn, mlp, iters: int, reps: int, copy_gbs: float | None, device: str) -> dict:
    """Wall clock of the puzzle's loop in both call forms, and per-weight device and host times."""
    from .inductor import graph_count

    layers = [getattr(mlp, k) for k in LAYERS]
    calls = [(lin.weight, lin.weight.quant_state) for lin in layers]
    before = graph_count()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # as the puzzle's mlp_dequantize: fx(layer).t(), then a synchronize, for up, gate, down
    layer_fn = by_layer(name, timed_fn)
    out = {"wall": timing.wall_time_us(lambda s: layer_fn(s).t(), layers, iters=3 * iters, sync=sync),
           "wall_state_form": timing.wall_time_us(lambda s: timed_fn(*s).t(), calls, iters=3 * iters, sync=sync)}
    for key in ("wall", "wall_state_form"):
        out[key]["total_s_per_1000_iters"] = out[key]["total_s"] * 1000 / iters
    if device == "cuda":
        out["device"] = {}
        for k, lin in zip(LAYERS, layers, strict=True):
            inputs, nbytes = rotated_inputs(lin)
            t = timing.device_time_us(lambda s: timed_fn(*s), inputs, reps=reps)
            h = timing.host_time_us(lambda s: timed_fn(*s), inputs, calls=200)
            entry = {"device_us": t["median_us"], "q1_us": t["q1_us"], "q3_us": t["q3_us"], "host_us": h["median_us"],
                     "bytes": nbytes, "gbs": nbytes / (t["median_us"] * 1e-6) / 1e9, "rotation": len(inputs)}
            if copy_gbs:
                entry["pct_copy"] = 100 * entry["gbs"] / copy_gbs
            out["device"][k] = entry
            del inputs
            torch.cuda.empty_cache()
    if graph_count() != before:
        out["warning"] = "dynamo compiled during timing: the warm call path recompiled; times include compilation"
    return out


# --- the run ----------------------------------------------------------------------------------


def run_config(cfg: Config, impls: dict, *, device: str = "cuda", iters: int = 1000, reps: int = 100,
               baseline: str = BASELINE, copy_gbs: float | None = None, timing_on: bool = True) -> dict:
    """Check every implementation on one configuration, then time those that passed."""
    mlp, x = build(cfg, device)
    row = {"config": {"bsz": cfg.bsz, "qlen": cfg.qlen, "hd": cfg.hd, "m": cfg.m, "seed": cfg.seed,
                      "dtype": DTYPE_NAMES[cfg.dtype], "label": cfg.label}, "impls": {},
           "state_problems": {k: state_problems(getattr(mlp, k), cfg.dtype) for k in LAYERS}}
    expected_y = mlp(x)  # no torch.no_grad(): the puzzle runs without it (nothing requires grad)
    base_fn = impls[baseline][0]
    baseline_w = {k: base_fn(getattr(mlp, k).weight, getattr(mlp, k).weight.quant_state).clone() for k in LAYERS}
    _sync(device)
    baseline_forward_ok = True
    for name, (fn, timed_fn) in sorted(impls.items(), key=lambda kv: kv[0] != baseline):  # the baseline first
        if hasattr(fn, "label"):  # a torch.compile peer: names the file its generated code goes to
            fn.label = f"challenge_{cfg.label}"
        t0 = time.perf_counter()
        result = check(name, fn, mlp, x, expected_y, baseline_w, device, baseline_forward_ok)
        if name == baseline:
            baseline_forward_ok = not (result.get("forward_linear_error") or result.get("forward_matmul_error"))
        result["check_seconds"] = round(time.perf_counter() - t0, 2)
        # Check before time: only implementations whose weights are bit-exact are timed (as in nf4.bench).
        timeable = result["status"] in ("pass", "known") and bool(result.get("bitexact"))
        if timing_on and timeable:
            result.update(time_impl(name, timed_fn, mlp, iters, reps, copy_gbs, device))
        elif timing_on:
            checked = result["status"] in ("pass", "known")
            result["not_timed"] = "not bit-exact: not timed" if checked else "failed its check"
        row["impls"][name] = result
        print(f"challenge {cfg.label}: {name}: {result['status']}"
              + (f", {result['wall']['per_call_us']:.1f} us/call wall" if "wall" in result else ""),
              file=sys.stderr, flush=True)
    for suffix, base, wall in (("", baseline, "wall"), ("_legacy", LEGACY, "wall"),
                               ("_state_form", baseline, "wall_state_form"),
                               ("_state_form_legacy", LEGACY, "wall_state_form")):
        base_total = row["impls"].get(base, {}).get(wall, {}).get("total_s")
        row["speedup" + suffix] = {name: base_total / r[wall]["total_s"] for name, r in row["impls"].items()
                                   if base_total and wall in r}
    del mlp, x, expected_y, baseline_w
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def run(*, configs=None, iters: int = 1000, reps: int = 100, include_compile: bool = True, save_dir=None,
        device: str = "cuda", baseline: str = BASELINE, names=None, timing_on: bool = True) -> dict:
    """The whole harness; returns the JSON-ready payload (with `failed` set when any check failed)."""
    chosen = [CONFIGS[i] for i in configs] if configs is not None else list(CONFIGS)
    if save_dir is not None:
        from . import impls as impls_mod

        impls_mod.set_compile_save_dir(save_dir, only_if_unset=True)
    impls = implementations(device, include_compile=include_compile, names=names)
    if baseline not in impls and baseline == RELEASE and LEGACY in impls:
        print(f"challenge: {RELEASE} is not here ({peers.release_missing()}); the baseline is the legacy path",
              file=sys.stderr)
        baseline = LEGACY
    if baseline not in impls:
        raise ValueError(f"baseline {baseline!r} is not among the implementations {list(impls)}")
    copy_bw = timing.copy_bandwidth_gbs() if device == "cuda" and timing_on else None
    release = peers.unsloth_release()
    payload = {"env": timing.environment(), "baseline": baseline, "legacy_baseline": LEGACY, "iters": iters,
               "reps": reps, "copy_bandwidth": copy_bw, "call_form": "fx(layer); second table fx(weight, quant_state)",
               "peers": {RELEASE: release.provenance() if release is not None else peers.release_missing(),
                         LEGACY: "re-implementation of Unsloth <= 2025's three-launch path (verify.peers)"},
               "configs": []}
    for cfg in chosen:
        try:
            row = run_config(cfg, impls, device=device, iters=iters, reps=reps, baseline=baseline,
                             copy_gbs=copy_bw["gbs"] if copy_bw else None, timing_on=timing_on)
        except Exception:  # one configuration's failure must not lose the others
            row = {"config": {"label": cfg.label}, "impls": {}, "speedup": {}, "state_problems": {},
                   "error": traceback.format_exc()[-3000:]}
            print(f"challenge {cfg.label}: raised\n{row['error']}", file=sys.stderr)
            if device == "cuda":
                torch.cuda.empty_cache()
        payload["configs"].append(row)
    payload["overall"] = _overall(payload["configs"], baseline)
    payload["overall_legacy"] = _overall(payload["configs"], LEGACY)
    payload["overall_state_form"] = _overall(payload["configs"], baseline, "wall_state_form")
    payload["overall_state_form_legacy"] = _overall(payload["configs"], LEGACY, "wall_state_form")
    failures = [f"{c['config']['label']}: {n}: {r['status']}" for c in payload["configs"]
                for n, r in c["impls"].items() if r["status"] in ("fail", "error")]
    failures += [f"{c['config']['label']}: {k}: assert_correct_bnb: {', '.join(p)}" for c in payload["configs"]
                 for k, p in c["state_problems"].items() if p]
    failures += [f"{c['config']['label']}: raised (see its 'error')" for c in payload["configs"] if c.get("error")]
    payload["failures"] = failures
    payload["failed"] = bool(failures)
    payload["compile_peers"] = [p.summary() for p in _compile_peers()]
    return payload


def _compile_peers():
    from .impls import _compile_peers as peers_by_fusion

    return list(peers_by_fusion.values())


def _overall(rows: list[dict], baseline: str, wall: str = "wall") -> dict:
    """Total wall time over the configurations per implementation, and the speedup of the totals."""
    names = list(dict.fromkeys(n for r in rows for n in r["impls"]))
    totals = {}
    for name in names:
        times = [r["impls"].get(name, {}).get(wall, {}).get("total_s") for r in rows]
        if all(t is not None for t in times):
            totals[name] = sum(times)
    base = totals.get(baseline)
    return {name: {"total_s": t, "speedup": base / t if base else None} for name, t in totals.items()}


def table(payload: dict) -> str:
    """Short Markdown tables: wall-clock speedup per configuration and overall; device time per weight."""
    rows = payload.get("configs") or []
    names = list(dict.fromkeys(n for r in rows for n in r["impls"]))
    if payload.get("error"):
        return "challenge harness: RAISED (see the JSON report's challenge.error)"
    lines = [f"challenge harness (baseline {payload['baseline']}, {payload['iters']} iterations x 3 weights, "
             "sync after each call): wall us/call (speedup)",
             "| config | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            res = r["impls"].get(n, {})
            if "wall" in res:
                cells.append(f"{res['wall']['per_call_us']:.1f} ({r.get('speedup', {}).get(n, float('nan')):.2f}x)"
                             + ("" if res.get("bitexact") else " inexact"))
            else:
                cells.append(res.get("status", "-").upper())
        lines.append(f"| {r['config']['label']} | " + " | ".join(cells) + " |")
    for key, label in (("overall", f"overall vs {payload['baseline']}"),
                       ("overall_legacy", f"overall vs {payload.get('legacy_baseline', LEGACY)} (legacy)"),
                       ("overall_state_form", "fx(w, qs) overall vs " + payload["baseline"]),
                       ("overall_state_form_legacy", "fx(w, qs) overall vs legacy")):
        overall = payload.get(key) or {}
        if overall:
            lines.append(f"| {label} | " + " | ".join(
                f"{overall[n]['total_s']:.3f} s ({overall[n]['speedup']:.2f}x)"
                if n in overall and overall[n]["speedup"] else "-" for n in names) + " |")
    dev_rows = [(r, k) for r in rows for k in LAYERS]
    if any("device" in res for r in rows for res in r["impls"].values()):
        bw = payload.get("copy_bandwidth") or {}
        lines += ["", f"device time per weight, median us (% of copy bandwidth {bw.get('gbs', float('nan')):.0f} GB/s)",
                  "| config | weight | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r, k in dev_rows:
            cells = []
            for n in names:
                d = r["impls"].get(n, {}).get("device", {}).get(k)
                cells.append(f"{d['device_us']:.1f} ({d.get('pct_copy', float('nan')):.0f}%)" if d else "-")
            lines.append(f"| {r['config']['label']} | {k} | " + " | ".join(cells) + " |")
    if payload.get("failures"):
        lines.append("FAILED: " + "; ".join(payload["failures"]))
    return "\n".join(lines)
