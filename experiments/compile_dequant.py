"""torch.compile'd `nf4.dequantize` on a GPU: through the triton_op (Inductor sees the kernel), through the opaque
custom op that torch.compile used before, and eager; device time and host time per call.

    python -m experiments compile-dequant                                  # the default weights
    python -m experiments compile-dequant --shapes 8192x2048:fp16 --out /tmp/c.json

Providers, each a callable (packed, quant_state) -> weight, all with the tuned config, ftz on (the CUDA default):
- `eager`: `nf4.dequantize(p, q)` (its repeat call: the plan cache's launch, no dispatcher);
- `compile_triton_op`: torch.compile(fullgraph=True) of that call, which traces `nf4::dequantize`, a triton_op
  whose kernel Inductor launches from its own generated code;
- `compile_opaque`: torch.compile(fullgraph=True) of the call as torch.compile traced it before, an empty output
  and `nf4::dequantize_opaque` (Inductor calls the op, which launches through nf4.runtime);
- each again with `_out`: out= a buffer kept per weight (`nf4::dequantize_into`, a triton_op that writes `out`:
  Inductor should write the caller's buffer in place, with no copy).
Every provider is first checked bit-exact (integer views) against bitsandbytes' `dequantize_4bit` and eager nf4;
one that is not is reported and not timed. Per row: median device time (CUDA events, weights rotated so that L2
holds nothing useful), CUDA-graph replay time per call, host time per call in batches alternating with an empty
Triton kernel's JIT launch (`host_us` beside `jit_host_us`), and for the compiled ones whether Inductor's code holds
the kernel (`inductor_code_has_kernel`) and how many graphs torch.compile made. Needs a CUDA GPU and bitsandbytes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from verify import peers, timing
from verify.exact import mismatch_count

from .bench import make_weights, parse_case

DEFAULT_CASES = ["8192x2048:fp16", "4096x1024:bf16", "14336x4096:bf16"]
KERNEL_NAME = "nf4_dequantize_kernel"


def _opaque(p, q, out=None):
    """What nf4.dequantize's compiled path was before the triton_ops: the opaque op into `out` (an empty one when
    None)."""
    s2 = q.state2
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=p.device)
    torch.ops.nf4.dequantize_opaque(p, q.absmax, s2.absmax, s2.code, q.offset, out, q.blocksize, True)
    return out


def _into_buffer(fn):
    """fn(p, q, out) as a callable(p, q) that keeps one output buffer per QuantState (outside the compiled code)."""
    buffers = {}

    def call(p, q):
        kept = buffers.get(id(q))
        if kept is None or kept[0] is not q:  # the state is kept too, so that its id is not reused
            kept = buffers[id(q)] = (q, torch.empty(q.shape, dtype=q.dtype, device=p.device))
        return fn(p, q, kept[1])

    return call


def providers() -> dict:
    """name -> (callable(packed, quant_state), compiled: bool). The `_out` rows pass a kept buffer as out=."""
    import nf4
    import nf4.dequant.ops  # registers the ops

    def dequantize(p, q, out=None):
        return nf4.dequantize(p, q, out=out)

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, dynamic=False)

    return {
        "eager": (dequantize, False),
        "eager_out": (_into_buffer(dequantize), False),
        "compile_triton_op": (compiled(dequantize), True),
        "compile_triton_op_out": (_into_buffer(compiled(dequantize)), True),
        "compile_opaque": (compiled(_opaque), True),
        "compile_opaque_out": (_into_buffer(compiled(_opaque)), True),
    }


def bench_case(shape, dtype, provs, *, reps=100) -> list[dict]:
    """Check, then time every provider on one weight (double quantization, blocksize 64)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    n = math.prod(shape)
    nbytes = timing.nf4_bytes(n, 64, torch.empty((), dtype=dtype).element_size())
    sets = make_weights(shape, dtype, copies=timing.rotation_count(nbytes))
    expected = peers.bnb_dequantize(*sets[0])
    eager = None
    rows = []
    torch._dynamo.reset()  # every compile (and graph count) below belongs to this weight
    for name, (fn, compiled) in provs.items():
        row = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "provider": name, "numel": n,
               "bytes": nbytes}
        try:
            if compiled:
                counters.clear()
                got, codes = run_and_get_code(fn, *sets[0])
                row["inductor_code_has_kernel"] = any(KERNEL_NAME in code for code in codes)
                for s in sets[1:]:  # a new QuantState per set: the same graph, or a recompile (counted)
                    fn(*s)
                row["graphs"] = counters["stats"]["unique_graphs"]
            else:
                got = fn(*sets[0])
                eager = got if eager is None else eager  # the first provider's, a fresh tensor
            row["mismatches"] = mismatch_count(got, expected)
            row["mismatches_vs_eager"] = mismatch_count(got, eager) if eager is not None else None
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        row["bitexact"] = row["mismatches"] == 0 and not row["mismatches_vs_eager"]
        if row["bitexact"]:
            call = (lambda f: (lambda s: f(*s)))(fn)
            t = timing.device_time_us(call, sets, reps=reps)
            row.update(device_us=t["median_us"], device_q1_us=t["q1_us"], device_q3_us=t["q3_us"])
            g = timing.graph_time_us(call, sets)
            if g and "median_us" in g:
                row["graph_us"] = g["median_us"]
            elif g:
                row["graph_error"] = g.get("error")
            h = timing.host_time_pair_us(call, sets, timing.empty_jit_launch(), [None], calls=100)
            row["host_us"], row["jit_host_us"] = h["median_us"], h["ref_median_us"]
        rows.append(row)
        print("  " + _fmt(row), flush=True)
    del sets, expected, eager
    torch.cuda.empty_cache()
    return rows


def _fmt(r: dict) -> str:
    head = f"{r['provider']:<18} {'x'.join(map(str, r['shape']))} {r['dtype']}"
    if "error" in r:
        return f"{head}: ERROR {r['error']}"
    if not r.get("bitexact"):
        return f"{head}: NOT bit-exact ({r['mismatches']} vs bitsandbytes, {r['mismatches_vs_eager']} vs eager)"
    return (f"{head}: device {r['device_us']:7.1f} us  graph {r.get('graph_us', float('nan')):7.1f} us  "
            f"host {r['host_us']:5.1f} us (JIT launch {r['jit_host_us']:5.1f})  "
            f"kernel in Inductor's code: {r.get('inductor_code_has_kernel', '-')}  graphs: {r.get('graphs', '-')}")


def table(payload: dict) -> str:
    """Markdown: device, CUDA-graph and host microseconds per weight and provider."""
    lines = ["| weight | provider | device us | graph us | host us | JIT launch us | kernel in Inductor code |",
             "|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if not r.get("bitexact"):
            lines.append(f"| {'x'.join(map(str, r['shape']))} {r['dtype']} | {r['provider']} | "
                         f"{r.get('error', 'not bit-exact')} | | | | |")
            continue
        lines.append(f"| {'x'.join(map(str, r['shape']))} {r['dtype']} | {r['provider']} | {r['device_us']:.1f} | "
                     f"{r.get('graph_us', float('nan')):.1f} | {r['host_us']:.1f} | {r['jit_host_us']:.1f} | "
                     f"{r.get('inductor_code_has_kernel', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments compile-dequant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_CASES, help="cases like 8192x2048:fp16")
    ap.add_argument("--out", default=None, help="JSON path (default build/compile_dequant_<gpu>.json)")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("experiments compile-dequant needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    env = timing.environment()
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit'][:12]}", flush=True)
    provs = providers()
    rows = []
    for text in args.shapes:
        rows += bench_case(*parse_case(text), provs, reps=args.reps)
    payload = {"env": env, "blocksize": 64, "double_quant": True, "ftz": True, "rows": rows}
    path = timing.write_json(args.out or f"build/compile_dequant_{timing.device_slug(env['device'])}.json", payload)
    print(f"\nwrote {path}\n{table(payload)}")
    return 1 if any(not r.get("bitexact") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
