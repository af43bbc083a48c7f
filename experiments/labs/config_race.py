"""Named configs of nf4.linear's tuned table, raced on the same weights: operand check, then CUDA-graph time.

    python -m experiments.labs.config_race --configs GEMV_MMA16 GEMV_MMA_WK16 --ms 9 12 16 \\
        --shapes 14336x4096 4096x14336 4096x4096 28672x8192 1024x4096 --out results/labs/config_race_<gpu>.json

For each weight (bitsandbytes NF4, blocksize 64, nested, rotated through more than L2 as in gemv_lut) and M, each
config (a name of nf4/linear/tuned.json's configs) runs through `nf4.linear(x, packed, state, config=...)`: first on
signed power-of-two identity rows of x, whose outputs must equal the dequantized weight's columns bit for bit
(gemv_lut.operand_mismatches), then timed (verify.timing.graph_time_us). Each row also says how many kernel launches a
call makes (split-K's partial sums take a second launch: host time). The table's own pick is timed as "tuned".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def launches_of(fn) -> int:
    """Kernel launches one call of `fn` makes (torch.profiler's CUDA kernel events)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy")
               and not e.name.startswith("Memset"))


def race(n: int, k: int, ms, names, dtype, log=print) -> list[dict]:
    import bitsandbytes.functional as F

    import nf4
    from nf4.linear import tuned
    from verify import timing

    from .gemv_lut import identity_rows, make_weights, operand_mismatches

    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    wd = F.dequantize_4bit(sets[0][0], sets[0][1]).to(dtype)
    rows = []
    for m in ms:
        x, cols, scales = identity_rows(m, k, dtype, seed=m)
        for name in ("tuned", *names):
            config = None if name == "tuned" else tuned.CONFIGS[name]
            row = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."), "config": name}
            try:
                y = nf4.linear(x, sets[0][0], sets[0][1], config=config)
                row["operand_mismatches"] = operand_mismatches(y, wd, cols, scales)
                row["launches"] = launches_of(lambda x=x, c=config: nf4.linear(x, sets[0][0], sets[0][1], config=c))
                g = timing.graph_time_us(lambda i, x=x, c=config: nf4.linear(x, *sets[i % len(sets)], config=c),
                                         list(range(len(sets))))
                row["graph_us"] = g and g.get("median_us")
            except Exception as exc:  # a config that cannot run here is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            log(f"  {n}x{k} M={m:<3} {name:<16} {row.get('graph_us') or float('nan'):8.2f} us  launches "
                f"{row.get('launches')}  mismatches {row.get('operand_mismatches')}  {row.get('error', '')}",
                flush=True)
    sets.clear()
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.config_race", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--ms", nargs="+", type=int, default=[9, 12, 16])
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "4096x4096", "28672x8192",
                                                      "1024x4096"])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", default="build/labs/config_race.json")
    args = ap.parse_args(argv)
    from nf4.linear import tuned

    unknown = [c for c in args.configs if c not in tuned.CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {sorted(tuned.CONFIGS)}")
    if not torch.cuda.is_available():
        print("config_race needs a CUDA GPU")
        return 2
    from verify import timing

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        rows += race(n, k, args.ms, args.configs, dtype)
    out = {"device": torch.cuda.get_device_name(), "environment": timing.environment(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
