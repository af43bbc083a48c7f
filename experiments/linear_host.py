"""Host time of one 4-bit linear layer as a QLoRA step calls it: forward with grad, and forward + backward.

    python -m experiments linear-host --out results/linear/host_h100.json
    python -m experiments linear-host --shapes 4096x4096 --ms 512 --profile --out build/host.json

GPU only (exit code 2 without one). The QLoRA step at 1x512 is host-bound (experiments qlora: the GPU runs kernels
for about a quarter of it), so what a 4-bit linear costs there is its host time, per call, in the form the model
calls it: `Linear4bit.forward` on x of shape (1, M, K) that requires grad, under each mode of experiments qlora
(bitsandbytes alone, nf4 patched, nf4's fused route, and the two bounds `no_matmul` and `dense`), and nf4.linear
called directly with the Params4bit, with the packed tensor and its QuantState, and without grad. Beside them: a
bare F.linear on the dequantized weight (x requiring grad) and one empty Triton JIT launch.

Per (weight, M, form), for two phases, `forward` (y = f(x)) and `step` (torch.autograd.grad(f(x), x, dy): the
forward and the backward to x, as in training with frozen W), in alternating batches against the empty JIT launch
(verify.timing.host_time_pair_us):
- `host_us`: host time per call issued back to back (no synchronisation inside a batch);
- `wall_us`: time per call of a batch including its final synchronisation, so that host_us < wall_us says the GPU,
  not the host, set the pace of that batch.
With --profile, cProfile's top functions (by own time) for the nf4_fused form's forward and for its backward node
called directly (`y.grad_fn.apply(dy)`, on this thread: the autograd engine runs CUDA backward on its own thread,
which cProfile does not see).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

DEFAULT_SHAPES = ("4096x4096", "1024x4096", "14336x4096", "4096x14336")  # a Llama-8B layer's weights (N x K)
DEFAULT_MS = (512,)
FORMS = ("F.linear", "bnb", "nf4", "nf4_fused", "no_matmul", "dense", "nf4.linear(p)", "nf4.linear(packed, qs)")
MODULE_FORMS = ("bnb", "nf4", "nf4_fused", "no_matmul", "dense")  # Linear4bit.forward under experiments qlora's modes


def parse_shape(text: str) -> tuple[int, int]:
    n, k = (int(v) for v in text.lower().split("x"))
    return n, k


def form_call(form: str, layer, dense_weight, contexts: dict):
    """(context factory, callable of x) for a form: the module under a qlora mode, or a direct call."""
    import contextlib

    import torch

    import nf4

    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form in MODULE_FORMS:
        return contexts[form], layer
    p = layer.weight
    if form == "F.linear":
        return contextlib.nullcontext, lambda x: torch.nn.functional.linear(x, dense_weight)
    if form == "nf4.linear(p)":
        return contextlib.nullcontext, lambda x: nf4.linear(x, p)
    if form == "nf4.linear(packed, qs)":
        packed, qs = p.data, p.quant_state
        return contextlib.nullcontext, lambda x: nf4.linear(x, packed, qs)
    raise AssertionError(f"form {form!r} of FORMS has no call")


def _wall_us(fn, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def measure(form: str, phase: str, layer, x, dy, dense_weight, contexts: dict, calls: int) -> dict:
    import torch

    from verify import timing

    context, f = form_call(form, layer, dense_weight, contexts)
    if phase == "forward":
        def call(_):
            return f(x)
    elif phase == "step":
        def call(_):
            return torch.autograd.grad(f(x), x, dy)
    else:  # no grad: inference
        def call(_):
            with torch.no_grad():
                return f(x)
    with context():
        h = timing.host_time_pair_us(call, [0], timing.empty_jit_launch(), [None], calls=calls, batches=9)
        wall = statistics.median(_wall_us(call, calls) for _ in range(3))
    return {"form": form, "phase": phase, "host_us": h["median_us"], "jit_host_us": h["ref_median_us"],
            "wall_us": wall, "calls": calls}


def profile_text(fn, calls: int, top: int = 30) -> str:
    """cProfile's `top` functions by own time over `calls` calls of fn (after two warm-up calls)."""
    for _ in range(2):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def profiles(layer, x, dy, contexts: dict, calls: int = 200) -> dict:
    """cProfile text of the nf4_fused form's forward and of its backward node called on this thread."""
    import torch

    out = {}
    with contexts["nf4_fused"]():
        out["nf4_fused forward"] = profile_text(lambda: layer(x), calls)
        ys = [layer(x) for _ in range(calls + 2)]
        it = iter(ys)
        out["nf4_fused backward node"] = profile_text(lambda: _backward_node(next(it), dy), calls)
        del ys
        torch.cuda.synchronize()
    return out


def _backward_node(y, dy):
    """The backward of the linear's own autograd node on dy, called on this thread (a Python autograd.Function's node
    through its `apply`, which runs the Function's backward; a C++ node is called)."""
    node = y.grad_fn
    while type(node).__name__ in ("ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0"):
        node = node.next_functions[0][0]
    return node.apply(dy) if hasattr(node, "_forward_cls") else node(dy)


def build_layer(n: int, k: int, seed: int):
    """A bnb NF4 Linear4bit (double quant, blocksize 64, bf16 compute) of a seeded random weight, as experiments
    qlora builds its model's layers, and that weight dequantized by bitsandbytes (the dense forms' weight)."""
    import bitsandbytes as bnb
    import torch

    from .qlora import _linear4bit

    gen = torch.Generator(device="cuda").manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn((n, k), device="cuda", generator=gen) * 0.02)
    layer = _linear4bit(bnb, linear, "cuda")
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).contiguous()
    return layer, dense


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments linear-host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="weights N x K")
    ap.add_argument("--ms", nargs="+", type=int, default=list(DEFAULT_MS), help="rows of x (batch 1, seq M)")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--phases", nargs="+", default=["forward", "step", "no_grad"],
                    choices=("forward", "step", "no_grad"))
    ap.add_argument("--calls", type=int, default=40, help="calls per timed batch")
    ap.add_argument("--profile", action="store_true", help="also cProfile the nf4_fused form (first shape and M)")
    ap.add_argument("--out", default="build/linear_host.json", help="result file (JSON)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("linear-host needs a CUDA GPU", file=sys.stderr)
        return 2
    from verify import timing

    from .qlora import mode_contexts

    contexts, _ = mode_contexts([f for f in args.forms if f in MODULE_FORMS])
    rows, profile = [], {}
    for i, shape in enumerate(args.shapes):
        n, k = parse_shape(shape)
        layer, dense = build_layer(n, k, seed=i)
        for m in args.ms:
            gen = torch.Generator(device="cuda").manual_seed(m + i)
            x = torch.randn((1, m, k), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            dy = torch.randn((1, m, n), device="cuda", generator=gen).to(torch.bfloat16)
            for phase in args.phases:
                for form in args.forms:
                    try:
                        row = measure(form, phase, layer, x, dy, dense, contexts, args.calls)
                    except Exception as exc:  # a form that cannot take this case is reported, not fatal
                        row = {"form": form, "phase": phase, "error": f"{type(exc).__name__}: {exc}"[:300]}
                    row.update(N=n, K=k, M=m)
                    rows.append(row)
                    print(f"{shape} M={m} {phase:8s} {form:24s} host {row.get('host_us', float('nan')):7.1f} us "
                          f"(jit {row.get('jit_host_us', float('nan')):5.1f}) "
                          f"wall {row.get('wall_us', float('nan')):7.1f}"
                          f" {row.get('error', '')}", flush=True)
            if args.profile and not profile:
                profile = profiles(layer, x, dy, contexts)
                for name, text in profile.items():
                    print(f"--- {name}\n{text}")
        del layer, dense
        torch.cuda.empty_cache()
    payload = {"env": timing.environment(), "args": vars(args), "rows": rows, "profile": profile}
    print(f"wrote {timing.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
