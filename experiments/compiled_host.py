"""python -m experiments compiled-host: host time of nf4.linear's compiled calls without CUDA graphs.

torch.compile(fullgraph=True) in its default mode runs a graph's launches from the host on every call, as compiled
prefill and training do. Each nf4 form is timed beside a compiled dense matmul of the same shape, in alternating
batches (verify.timing.host_time_pair_us: the host's drift hits both): the compiled nf4.linear, the eager call, and
the opaque ops called directly (the ops a compiled graph calls where the route is a self-launching kernel or the
dequant path; `route` names the tuned table's kernel). One 4096 x 4096 weight (bf16, double quantization), M = 64
(a Triton kernel inside the graph), 128 (the Gluon GEMM on an H100 or H200: the opaque linear) and 512 (the dequant
path: the opaque dequantize + cuBLAS): shapes whose device time is below the host time, so the issue time is the
host's. GPU only; writes JSON with the device, versions, commit and one row per (M, form).
"""

from __future__ import annotations

import argparse
import sys

import torch

from verify import timing

from .call_forms import SHAPE, layer_4096

N, K = SHAPE  # call-forms' weight
MS = (64, 128, 512)


def _forms(packed, qs, x, n: int, k: int):
    import nf4
    from nf4.linear.autotune import pick_for
    from nf4.weight import NF4Weight

    state = (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset)
    route = pick_for(x, NF4Weight.from_state(packed, qs)).kernel
    linear_opaque = torch.ops.nf4.linear_opaque.default
    dequant_opaque = torch.ops.nf4.dequantize_matmul_opaque.default
    compiled = torch.compile(lambda x: nf4.linear(x, packed, qs), fullgraph=True, dynamic=False)
    return route, [
        ("compiled", compiled),
        ("eager", lambda x: nf4.linear(x, packed, qs)),
        ("nf4::linear_opaque", lambda x: linear_opaque(x, packed, *state, None, n, k, 64, torch.bfloat16, True)),
        ("nf4::dequantize_matmul_opaque",
         lambda x: dequant_opaque(x, packed, *state, None, n, k, 64, torch.bfloat16, True, False)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments compiled-host", description=__doc__)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--batches", type=int, default=15)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled-host needs a CUDA GPU", file=sys.stderr)
        return 2
    import nf4.linear.ops  # noqa: F401  (registers the ops called directly)

    device = torch.device("cuda", torch.cuda.current_device())
    layer = layer_4096(device)
    packed, qs = layer.weight.data, layer.weight.quant_state
    dense = torch.randn(N, K, dtype=torch.bfloat16, device=device)
    rows = []
    for m in MS:
        x = torch.randn(m, K, dtype=torch.bfloat16, device=device)
        dense_fn = torch.compile(lambda x: x @ dense.t(), fullgraph=True, dynamic=False)
        route, forms = _forms(packed, qs, x, N, K)
        for form, fn in forms:
            for _ in range(3):
                fn(x)  # compile, check and bind
            t = timing.host_time_pair_us(fn, [x], dense_fn, [x], batches=args.batches)
            row = {"M": m, "route": route, "form": form, "host_us": t["median_us"],
                   "compiled_dense_us": t["ref_median_us"], "ratio": t["median_us"] / t["ref_median_us"]}
            rows.append(row)
            print(f"M={m:<4} {route:<12} {form:<30} {row['host_us']:7.1f} us   compiled dense "
                  f"{row['compiled_dense_us']:6.1f}   {row['ratio']:5.2f}x", flush=True)
        torch._dynamo.reset()
    payload = {"device": torch.cuda.get_device_name(device), "environment": timing.environment(),
               "shape": [N, K], "dtype": "bfloat16", "rows": rows}
    if args.out:
        timing.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
