"""python -m experiments call-forms: host time of every eager repeat-call form of nf4.dequantize and nf4.linear,
each in batches alternating with an empty Triton JIT launch (the yardstick the issues set: at or under one).

Call forms (the same weight, called again): a Linear4bit module, its Params4bit, the packed tensor + QuantState,
a fresh view of the packed bytes each call, a packed tensor at a new address each call (the same bytes copied,
as FSDP hands out), and out= (dequantize). nf4.linear at M = 1, 16 and 128 (where the tuned table's Gluon rule
routes this weight on an H100 or H200: the kernel that launches itself), bf16, with and without autograd recording.
GPU only. Writes JSON with the device, versions, commit and one row per (op, form): host µs, the JIT launch's µs
in the same batches, and their ratio.
"""

from __future__ import annotations

import argparse
import sys

import torch

from verify import timing

SHAPE = (4096, 4096)


def layer_4096(device):
    """The 4096 x 4096 Linear4bit (bf16 compute, nf4, double quantization) the host-time benches call."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(SHAPE[1], SHAPE[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True, quant_storage=torch.uint8)
    layer = layer.to(device)
    layer.weight.quant_state.dtype = torch.bfloat16
    return layer


def forms(layer):
    """(op, form, callable(i), inputs) for every call form."""
    import nf4

    params = layer.weight
    qs = params.quant_state
    packed = params.data
    copies = [packed.clone() for _ in range(4)]  # new addresses, the same bytes
    out = torch.empty(qs.shape, dtype=qs.dtype, device=packed.device)
    rows = [
        ("dequantize", "module", lambda i: nf4.dequantize(layer)),
        ("dequantize", "Params4bit", lambda i: nf4.dequantize(params)),
        ("dequantize", "packed + state", lambda i: nf4.dequantize(packed, qs)),
        ("dequantize", "fresh view", lambda i: nf4.dequantize(packed.view(-1, 1), qs)),
        ("dequantize", "new address", lambda i: nf4.dequantize(copies[i % 4], qs)),
        ("dequantize", "out=", lambda i: nf4.dequantize(packed, qs, out=out)),
    ]
    for m in (1, 16, 128):
        x = torch.randn(m, SHAPE[1], dtype=torch.bfloat16, device=packed.device)
        xg = x.clone().requires_grad_(True)
        rows += [
            ("linear", f"M={m} module", lambda i, x=x: nf4.linear(x, layer)),
            ("linear", f"M={m} Params4bit", lambda i, x=x: nf4.linear(x, params)),
            ("linear", f"M={m} packed + state", lambda i, x=x: nf4.linear(x, packed, qs)),
            ("linear", f"M={m} fresh view", lambda i, x=x: nf4.linear(x, packed.view(-1, 1), qs)),
            ("linear", f"M={m} new address", lambda i, x=x: nf4.linear(x, copies[i % 4], qs)),
            ("linear", f"M={m} packed + state, x requires grad", lambda i, x=xg: nf4.linear(x, packed, qs)),
        ]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments call-forms", description=__doc__)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--batches", type=int, default=15)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("call-forms needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    layer = layer_4096(device)
    jit = timing.empty_jit_launch()
    results = []
    for op, form, fn in forms(layer):
        for i in range(3):
            fn(i)  # the first calls check and bind
        t = timing.host_time_pair_us(fn, list(range(8)), jit, [0], batches=args.batches)
        row = {"op": op, "form": form, "host_us": t["median_us"], "jit_launch_us": t["ref_median_us"],
               "ratio": t["median_us"] / t["ref_median_us"]}
        results.append(row)
        print(f"{op:<10} {form:<38} {row['host_us']:7.2f} us   JIT launch {row['jit_launch_us']:6.2f}   "
              f"{row['ratio']:5.2f}x", flush=True)
    payload = {"device": torch.cuda.get_device_name(device), "environment": timing.environment(),
               "shape": list(SHAPE), "rows": results,
               "at_or_under_one_launch": sum(r["ratio"] <= 1.0 for r in results), "forms": len(results)}
    print(f"{payload['at_or_under_one_launch']} of {len(results)} forms at or under one empty JIT launch")
    if args.out:
        timing.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
