"""Benchmark `nf4.dequantize` against bitsandbytes, an Unsloth-style baseline and torch.compile.

    python -m experiments bench                   # the bench weights, results/nf4_bench.json
    python -m experiments bench --sweep           # also sweep tile size, warps, codebook, eviction
    python -m experiments bench --shapes 8192x2048:fp16 --out /tmp/b.json

Needs a CUDA GPU and bitsandbytes. Every provider is first checked bit-exact against
bitsandbytes on the same weight; a provider that is not exact is reported and not timed.
Reports median device time (CUDA events, rotating inputs so L2 holds nothing useful), GB/s and
% of the device-to-device copy bandwidth measured in the same run, CUDA-graph replay time, and
host time per call, measured in batches that alternate with an empty Triton kernel's JIT launch
(each row carries both, `host_us` and `jit_host_us`).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys

import torch

from nf4 import DequantConfig, NF4Weight
from nf4.dequant import launch as dequant_launch
from verify import peers, timing
from verify.cases import clone_state
from verify.exact import mismatch_count as bitexact_count
from verify.timing import empty_jit_launch

DEFAULT_CASES = ["8192x2048:fp16", "2048x8192:fp16", "4096x1024:bf16", "1024x4096:bf16",
                 "14336x4096:bf16", "4096x14336:bf16", "28672x8192:bf16", "11008x4096:bf16"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_case(text: str):
    """'8192x2048:fp16' -> ((8192, 2048), torch.float16)."""
    dims, _, dt = text.partition(":")
    return tuple(int(d) for d in dims.split("x")), DTYPES[dt or "fp16"]


def make_weights(shape, dtype, blocksize=64, copies=2, seed=0):
    """Quantize one random weight on the GPU with bitsandbytes; clone it `copies` times for rotation."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=True, quant_type="nf4")
    del w
    sets = [(packed, qs)]
    for _ in range(copies - 1):
        sets.append((packed.clone(), clone_state(qs)))
    return sets


def providers(include_compile=True):
    """name -> callable(packed, quant_state) returning the dequantized weight."""
    import nf4

    def nf4_out(p, q):
        # The caller keeps one output buffer per weight (like Unsloth's global buffer). It is kept on
        # the bench's own QuantState, so the timed call is nf4.dequantize(p, q, out=buf) plus one
        # attribute read, with no bookkeeping of the harness's own in the host time.
        buf = getattr(q, "_nf4_bench_out", None)
        if buf is None:
            buf = q._nf4_bench_out = torch.empty(q.shape, dtype=q.dtype, device=p.device)
        return nf4.dequantize(p, q, out=buf)

    provs = {
        "nf4": lambda p, q: nf4.dequantize(p, q),
        "nf4_out_buffer": nf4_out,
        "bnb.dequantize_4bit": peers.bnb_dequantize,
    }
    if peers.unsloth_release() is not None:  # Unsloth 2026.10.9's own fast_dequantize (its Triton kernel)
        provs["unsloth.2026.10.9"] = lambda p, q: peers.unsloth_release_dequantize(p, q)
        provs["unsloth.2026.10.9_global_buffer"] = lambda p, q: peers.unsloth_release_dequantize(
            p, q, use_global_buffer=True)
    # the legacy path: Unsloth <= 2025 / its ctypes fallback, re-implemented in verify.peers
    provs["unsloth_style"] = lambda p, q: peers.unsloth_fast_dequantize(p, q)
    provs["unsloth_style_global_buffer"] = lambda p, q: peers.unsloth_fast_dequantize(p, q, use_global_buffer=True)
    if include_compile:
        provs["torch.compile"] = peers.make_torch_compile_peer()
    return provs


def bench_case(shape, dtype, provs, copy_gbs, *, reps=100, host=True):
    n = math.prod(shape)
    out_bytes = torch.empty((), dtype=dtype).element_size()
    nbytes = timing.nf4_bytes(n, 64, out_bytes)
    sets = make_weights(shape, dtype, copies=timing.rotation_count(nbytes))
    expected = peers.bnb_dequantize(*sets[0])
    rows = []
    for name, fn in provs.items():
        row = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "provider": name, "numel": n,
               "bytes": nbytes}
        try:
            got = fn(*sets[0])
            row["mismatches"] = bitexact_count(got, expected)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        row["bitexact"] = row["mismatches"] == 0
        if row["bitexact"]:
            call = (lambda f: (lambda s: f(*s)))(fn)
            t = timing.device_time_us(call, sets, reps=reps)
            row.update(device_us=t["median_us"], device_q1_us=t["q1_us"], device_q3_us=t["q3_us"])
            row["gbs"] = nbytes / (t["median_us"] * 1e-6) / 1e9
            row["pct_copy"] = 100 * row["gbs"] / copy_gbs
            g = timing.graph_time_us(call, sets)
            if g and "median_us" in g:
                row["graph_us"] = g["median_us"]
            elif g:
                row["graph_error"] = g.get("error")
            if host:
                # Batches alternate with an empty Triton kernel's JIT launch, so the two host times
                # are compared under the same drift of the host's speed.
                h = timing.host_time_pair_us(call, sets, empty_jit_launch(), [None], calls=100)
                row["host_us"], row["jit_host_us"] = h["median_us"], h["ref_median_us"]
        rows.append(row)
        torch.cuda.empty_cache()
    del sets, expected
    torch.cuda.empty_cache()
    return rows


FRESH_VIEWS = 1000  # more than host_time_pair_us' warm-up and batches call one form (20 + 15 x 50)


def _each_once(f, views: list, qs):
    """A call of f on the next of `views` (each a distinct tensor object) with qs; StopIteration past the last."""
    it = iter(views)
    return lambda _: f(next(it), qs)


def call_forms(case="4096x4096:bf16", calls=100) -> list[dict]:
    """Host time per repeated call in every form a user or bitsandbytes uses, for nf4 and each peer,
    in batches alternating with an empty Triton JIT launch (each row: host_us beside jit_host_us).

    Forms: the Linear4bit module; its Params4bit; packed + QuantState; a fresh `.view(-1, 1)` of the
    packed storage on every call (what bitsandbytes' MatMul4Bit.backward passes), made in the call and, as a
    second row, made before the timed calls (a distinct view object per call); a weight at a new
    address on every call (as FSDP all-gathers it; rotating among copies); a new QuantState object
    every call (a shallow copy, whose cost every row includes; nf4's cache always misses); and, for
nf4, the new-QuantState call with the plan cache turned off, and the miss paired with it. Every
    provider is checked bit-exact on the weight first.
    """
    import bitsandbytes as bnb

    import nf4

    shape, dtype = parse_case(case)
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compute_dtype=dtype, compress_statistics=True,
                              quant_type="nf4").to("cuda")
    w, qs = layer.weight, layer.weight.quant_state
    qs.dtype = dtype
    packed = w.data
    expected = peers.bnb_dequantize(packed, qs)
    copies = [(packed.clone(), qs) for _ in range(4)]  # new addresses, the same QuantState
    no_plan = DequantConfig(plan=False)
    funcs = {"nf4": lambda p, q: nf4.dequantize(p, q), "bnb.dequantize_4bit": peers.bnb_dequantize,
             "unsloth_style": peers.unsloth_fast_dequantize}
    if peers.unsloth_release() is not None:
        funcs["unsloth.2026.10.9"] = peers.unsloth_release_dequantize
    forms = {
        "module": (lambda f: (lambda _: f(layer.weight, layer.weight.quant_state)), [None]),
        "params4bit": (lambda f: (lambda _: f(w, w.quant_state)), [None]),
        "packed + state": (lambda f: (lambda _: f(packed, qs)), [None]),
        "fresh view": (lambda f: (lambda _: f(packed.view(-1, 1), qs)), [None]),
        # the same, the views made before the timed calls (each used once): the provider's cost alone, without the
        # caller's own view (measured alone below)
        "fresh view, made beforehand": (lambda f: _each_once(f, [packed.view(-1, 1) for _ in range(FRESH_VIEWS)], qs),
                                        [None]),
        "new address": (lambda f: (lambda s: f(*s)), copies),
        # a shallow copy per call (its cost is in every provider's row): nf4's cache always misses
        "new QuantState": (lambda f: (lambda _: f(packed, copy.copy(qs))), [None]),
    }
    rows = []
    jit = empty_jit_launch()
    for fname, f in funcs.items():
        got = f(packed, qs)
        bad = bitexact_count(got, expected)
        for form, (make, inputs) in forms.items():
            call = make(f)
            if fname == "nf4" and form == "module":
                call = lambda _: nf4.dequantize(layer)  # noqa: E731 - nf4 takes the module itself
            elif fname == "nf4" and form == "params4bit":
                call = lambda _: nf4.dequantize(w)  # noqa: E731
            row = {"case": case, "provider": fname, "form": form, "mismatches": bad}
            if not bad:
                h = timing.host_time_pair_us(call, inputs, jit, [None], calls=min(calls, len(inputs) * 50))
                row["host_us"], row["jit_host_us"] = h["median_us"], h["ref_median_us"]
            rows.append(row)
            print(f"  host {fname:<20} {form:<16} {row.get('host_us', float('nan')):6.1f} us "
                  f"(JIT launch {row.get('jit_host_us', float('nan')):5.1f})", flush=True)
    # What the caller's own part of two forms costs, with no dequantize at all: the fresh view and the shallow
    # copy of the QuantState that those rows include for every provider (the limit of those rows against a
    # JIT launch is the provider's cost plus this).
    for form, call in (("fresh view alone (packed.view(-1, 1), no dequantize)", lambda _: packed.view(-1, 1)),
                       ("new QuantState alone (copy.copy(qs), no dequantize)", lambda _: copy.copy(qs))):
        h = timing.host_time_pair_us(call, [None], jit, [None], calls=calls)
        rows.append({"case": case, "provider": "caller", "form": form, "mismatches": 0, "host_us": h["median_us"],
                     "jit_host_us": h["ref_median_us"]})
        print(f"  host caller {form:<52} {h['median_us']:6.1f} us (JIT launch {h['ref_median_us']:5.1f})", flush=True)
    h = timing.host_time_pair_us(lambda _: nf4.dequantize(packed, copy.copy(qs), config=no_plan), [None], jit,
                                 [None], calls=calls)
    rows.append({"case": case, "provider": "nf4", "form": "new QuantState, no plan cache (config plan=False)",
                 "mismatches": 0,
                 "host_us": h["median_us"], "jit_host_us": h["ref_median_us"]})
    print(f"  host nf4 without plan cache {h['median_us']:6.1f} us (JIT launch {h['ref_median_us']:5.1f})", flush=True)
    # The cache miss against a call made without any cache, in alternating batches of their own (the two rows
    # above are each paired with a JIT launch, in batches minutes apart).
    # The miss (a QuantState's first call notes the state only) launches through nf4.runtime.launch. The result is
    # checked first.
    for form, config in (("cache miss (new QuantState) paired with no cache", None),):
        bad = sum(bitexact_count(nf4.dequantize(packed, copy.copy(qs), config=config), expected) for _ in range(2))
        row = {"case": case, "provider": "nf4", "form": form, "mismatches": bad}
        if not bad:
            h = timing.host_time_pair_us(lambda _, c=config: nf4.dequantize(packed, copy.copy(qs), config=c), [None],
                                         lambda _: nf4.dequantize(packed, copy.copy(qs), config=no_plan), [None],
                                         calls=calls)
            row.update(host_us=h["median_us"], no_cache_host_us=h["ref_median_us"])
            print(f"  host nf4 {form}: {h['median_us']:6.1f} us, no cache {h['ref_median_us']:6.1f} us", flush=True)
        rows.append(row)
    return rows


def empty_launch_us():
    """Host time of launching an empty Triton kernel through the JIT, and its device time."""
    launch = empty_jit_launch()
    launch(None)
    host = timing.host_time_us(launch, [None], calls=500)
    dev = timing.device_time_us(launch, [None], reps=200)
    return {"host_us": host["median_us"], "device_us": dev["median_us"]}


def sweep(cases, copy_gbs, reps=60, grid=None):
    """Time nf4 over tile size x warps x codebook x eviction x bf16 rounding; every config checked first."""
    rows = []
    if grid is None:
        grid = [(per * 32 * 4 * w, w, cb, cm) for per in (1, 2, 4) for w in (2, 4, 8) for cb in (0, 2)
                for cm in ("", ".cs")]
    for shape, dtype in cases:
        n = math.prod(shape)
        out_bytes = torch.empty((), dtype=dtype).element_size()
        nbytes = timing.nf4_bytes(n, 64, out_bytes)
        sets = make_weights(shape, dtype, copies=timing.rotation_count(nbytes))
        expected = peers.bnb_dequantize(*sets[0])
        weights = [NF4Weight.of(p, q) for p, q in sets]  # checked once, outside the timed calls
        bf16_opts = [False]
        for (tile, warps, codebook, store_cm), bf16_bits in itertools.product(grid, bf16_opts):
            config = DequantConfig(tile_bytes=tile, num_warps=warps, codebook=codebook, evict_stream="evict_first",
                                   store_cm=store_cm, bf16_bits=bf16_bits)

            def call(w, config=config):
                return _launch_cfg(w, config)

            row = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "tile_bytes": tile,
                   "num_warps": warps, "codebook": codebook, "evict_stream": "evict_first", "store_cm": store_cm,
                   "bf16_bits": bf16_bits}
            row["mismatches"] = bitexact_count(call(weights[0]), expected)
            if row["mismatches"] == 0:
                t = timing.device_time_us(call, weights, reps=reps)
                row["device_us"] = t["median_us"]
                row["pct_copy"] = 100 * nbytes / (t["median_us"] * 1e-6) / 1e9 / copy_gbs
            rows.append(row)
            print(f"  sweep {row}", flush=True)
        del sets, weights, expected
        torch.cuda.empty_cache()
    return rows


def _launch_cfg(w: NF4Weight, config: DequantConfig):
    """nf4's launch of a checked weight with `config`, ftz on (no checks in the timed call)."""
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    dequant_launch.launch(w, out, True, config)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_CASES, help="cases like 8192x2048:fp16")
    ap.add_argument("--out", default="results/nf4_bench.json")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's meta-parameters")
    ap.add_argument("--sweep-shapes", nargs="*", default=["8192x2048:fp16", "14336x4096:bf16", "28672x8192:bf16"])
    ap.add_argument("--sweep-grid", type=json.loads, default=None,
                    help='JSON list of [tile_bytes, num_warps, codebook, store_cm] to sweep')
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--no-call-forms", action="store_true", help="skip the host-time table of call forms")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("experiments bench needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    env = timing.environment()
    copy = timing.copy_bandwidth_gbs()
    empty = empty_launch_us()
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  bnb {env['bitsandbytes']}  "
          f"commit {env['commit'][:12]}", flush=True)
    print(f"copy bandwidth {copy['gbs']:.0f} GB/s; empty Triton JIT launch: host {empty['host_us']:.1f} us, "
          f"device {empty['device_us']:.1f} us", flush=True)
    provs = providers(include_compile=not args.no_compile)
    rows = []
    for text in args.shapes:
        shape, dtype = parse_case(text)
        case_rows = bench_case(shape, dtype, provs, copy["gbs"], reps=args.reps)
        rows += case_rows
        for r in case_rows:
            print("  " + _fmt(r), flush=True)
    payload = {"env": env, "copy_bandwidth": copy, "empty_triton_launch": empty, "blocksize": 64,
               "double_quant": True, "rows": rows}
    release = peers.unsloth_release()
    payload["peers"] = {"bitsandbytes": env.get("bitsandbytes"),
                        "unsloth.2026.10.9": release.provenance() if release is not None else peers.release_missing(),
                        "unsloth_style": "re-implementation of Unsloth <= 2025's three-launch path (verify.peers)"}
    if not args.no_call_forms:
        payload["call_forms"] = call_forms()
    if args.sweep:
        grid = [tuple(g) for g in args.sweep_grid] if args.sweep_grid else None
        payload["sweep"] = sweep([parse_case(s) for s in args.sweep_shapes], copy["gbs"], grid=grid)
    path = timing.write_json(args.out, payload)
    print(f"\nwrote {path}")
    print(table(payload))
    return 0


def _fmt(r):
    if "error" in r:
        return f"{r['provider']:<28} {r['shape']} {r['dtype']}: ERROR {r['error']}"
    if not r.get("bitexact"):
        return f"{r['provider']:<28} {r['shape']} {r['dtype']}: NOT bit-exact ({r['mismatches']} elements), not timed"
    return (f"{r['provider']:<28} {r['shape']} {r['dtype']}: {r['device_us']:8.1f} us  {r['gbs']:7.0f} GB/s "
            f"{r['pct_copy']:5.1f}%  graph {r.get('graph_us', float('nan')):7.1f} us  "
            f"host {r.get('host_us', 0):5.1f} us (JIT launch {r.get('jit_host_us', 0):5.1f})")


def table(payload) -> str:
    """Markdown table of device time per case and provider, with the speedup of nf4 over each."""
    rows = payload["rows"]
    cases = []
    for r in rows:
        key = (tuple(r["shape"]), r["dtype"])
        if key not in cases:
            cases.append(key)
    names = list(dict.fromkeys(r["provider"] for r in rows))
    lines = ["| weight | dtype | " + " | ".join(names) + " | nf4 % copy |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for shape, dt in cases:
        by = {r["provider"]: r for r in rows if tuple(r["shape"]) == shape and r["dtype"] == dt}
        cells = []
        for nm in names:
            r = by.get(nm, {})
            cells.append(f"{r['device_us']:.1f}" if "device_us" in r else ("n/e" if "mismatches" in r else "err"))
        pct = by.get("nf4", {}).get("pct_copy")
        pct_cell = f"{pct:.1f}" if pct is not None else "-"
        lines.append(f"| {'x'.join(map(str, shape))} | {dt} | " + " | ".join(cells) + f" | {pct_cell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
