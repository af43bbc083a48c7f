"""Named configs of nf4.linear's tuned table, raced on the same weights: operand check, then CUDA-graph time.

    python -m experiments.labs.config_race --configs GEMV_MMA16 GEMV_MMA_WK16 --ms 9 12 16 \\
        --shapes 14336x4096 4096x14336 4096x4096 28672x8192 1024x4096 --out results/labs/config_race_<gpu>.json
    python -m experiments.labs.config_race --configs GEMV_MMA_WK GEMV_MMA_WK16 GEMV_MMA_WK4 --ms 1 2 4 8 \\
        --shapes all --part 0/4 --out /tmp/race0.json          (the shape catalog, or its fit / held-out subset)
    python -m experiments.labs.config_race --report /tmp/race0.json /tmp/race1.json ...

--shapes takes NxK items and the catalog's names (all, fit, held-out); --part i/n races shapes i, i + n, ... of
them, so a catalog sweep can be split over device calls. The file is written after every shape. --report prints,
per subset of the catalog, how far the table's pick ("tuned") is from the best config raced at each shape, M and
dtype (`summary`: the catalog issue's bar is within 10 %); with --current it judges this commit's table instead of the
one timed, from the raced configs' times, and counts inversions.

For each weight (bitsandbytes NF4, blocksize 64, nested, rotated through more than L2 as in gemv_lut) and M, each
config (a name of nf4/linear/tuned.json's configs) runs through `nf4.linear(x, packed, state, config=...)`: first on
signed power-of-two identity rows of x, whose outputs must equal the dequantized weight's columns bit for bit
(gemv_lut.operand_mismatches), then timed (verify.timing.graph_time_us). Each row also says how many kernel launches a
call makes (split-K's partial sums take a second launch: host time). The table's own pick is timed as "tuned".
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def race(n: int, k: int, ms, names, dtype, log=print, count_launches: bool = True) -> list[dict]:
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
                if count_launches:
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


def _groups(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """{(N, K, M, dtype): {config: graph us}} of the exact timed rows."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("graph_us") and r.get("operand_mismatches") == 0:
            groups.setdefault((r["N"], r["K"], r["M"], r["dtype"]), {})[r["config"]] = r["graph_us"]
    return groups


def summary(rows: list[dict], fit: set | None = None, pick=None, single: bool = False) -> dict:
    """Per subset ("fit" where (N, K) is in `fit`, else "held-out"; "all" when fit is None): the rows (shape, M,
    dtype) where "tuned" and at least one raced config ran exactly, the tuned time over the best raced time there
    (min, median, max), how many are within 10 %, and the worst with its best config.

    pick(n, k, m): the config name to judge instead of the one timed as "tuned" (the table of another commit; rows
    where it was not raced are left out). single: the best is taken over one-launch configs only at M <= 8
    (SPLIT_K_CONFIGS cost a second launch there)."""
    out: dict[str, dict] = {}
    for (n, k, m, dtype), times in sorted(_groups(rows).items()):
        raced = {c: t for c, t in times.items() if c != "tuned" and not (single and m <= 8 and c in SPLIT_K_CONFIGS)}
        choice = "tuned" if pick is None else pick(n, k, m)
        if choice not in times or not raced:
            continue
        best = min(raced, key=raced.get)
        ratio = times[choice] / min(times[choice], raced[best])
        subset = "all" if fit is None else ("fit" if (n, k) in fit else "held-out")
        s = out.setdefault(subset, {"rows": 0, "within_10pct": 0, "ratios": [], "worst": None})
        s["rows"] += 1
        s["within_10pct"] += ratio <= 1.10
        s["ratios"].append(ratio)
        if s["worst"] is None or ratio > s["worst"]["ratio"]:
            s["worst"] = {"N": n, "K": k, "M": m, "dtype": dtype, "ratio": ratio, "best": best}
    for s in out.values():
        r = sorted(s.pop("ratios"))
        s.update(min=r[0], median=statistics.median(r), max=r[-1])
    return out


SPLIT_K_CONFIGS = ("GEMV_MMA16",)  # the raced configs whose auto split-K sums in a second launch


def inversions(rows: list[dict], pick=None) -> dict:
    """Pairs of M (M <= 16) on one shape and dtype where the larger M runs more than 3 % faster than the smaller, for
    the timed "tuned" config or pick(n, k, m)'s: {"pairs": .., "inversions": ..}."""
    per: dict[tuple, dict[int, float]] = {}
    for (n, k, m, dtype), times in _groups(rows).items():
        choice = "tuned" if pick is None else pick(n, k, m)
        if m <= 16 and choice in times:
            per.setdefault((n, k, dtype), {})[m] = times[choice]
    pairs = inv = 0
    for ts in per.values():
        for a in ts:
            for b in ts:
                if a < b:
                    pairs += 1
                    inv += ts[b] < ts[a] / 1.03
    return {"pairs": pairs, "inversions": inv}


def current_pick(device: str):
    """pick(n, k, m) of the tuned table at this commit on the named GPU (nf4.linear.tuned), as a config name."""
    from nf4.linear import tuned

    return lambda n, k, m: tuned.NAMES.get(tuned.tuned(device, m, n=n, k=k))


def expand_shapes(items) -> list[tuple[int, int]]:
    """NxK items and catalog names (all, fit, held-out), in order, each shape once."""
    from experiments.catalog_bench import parse_shapes

    return list(dict.fromkeys(s for item in items for s in parse_shapes(item)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.config_race", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=None, help="names of nf4/linear/tuned.json's configs")
    ap.add_argument("--ms", nargs="+", type=int, default=[9, 12, 16])
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "4096x4096", "28672x8192",
                                                      "1024x4096"], help="NxK items and catalog names")
    ap.add_argument("--part", default="0/1", help="i/n: shapes i, i + n, ... of --shapes")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", default="build/labs/config_race.json")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON", help="print the summary of race files")
    ap.add_argument("--no-launches", action="store_true", help="skip the profiler's launch count (faster)")
    ap.add_argument("--out-report", default=None, metavar="JSON", help="with --report --current: also write it here")
    ap.add_argument("--current", action="store_true",
                    help="with --report: judge this commit's table (its pick among the raced configs) beside the timed "
                         "one, against the best one-launch config at M <= 8, and count inversions")
    args = ap.parse_args(argv)
    from experiments import catalog as cat
    from experiments.catalog_bench import parse_part, select_part

    fit = {(sh.n, sh.k) for sh in cat.fit_shapes()}
    if args.report:
        payloads = [json.loads(Path(path).read_text()) for path in args.report]
        rows = [r for p in payloads for r in p["rows"]]
        if not args.current:
            print(json.dumps(summary(rows, fit), indent=1))
            return 0
        pick = current_pick(payloads[0].get("device", ""))

        def judged(rows):
            return {"timed_table": {"vs_one_launch": summary(rows, fit, single=True), "inversions": inversions(rows)},
                    "current_table": {"vs_one_launch": summary(rows, fit, pick, single=True),
                                      "vs_all": summary(rows, fit, pick), "inversions": inversions(rows, pick)}}

        from verify import timing

        out = {"device": payloads[0].get("device"), "judged_at": timing.git_commit(), "sources": args.report,
               **judged(rows)}
        repeat = [r for p in payloads for r in (p.get("repeat") or {}).get("rows") or []]
        if repeat:
            out["repeat"] = judged(repeat)
        text = json.dumps(out, indent=1)
        print(text)
        if args.out_report:
            Path(args.out_report).write_text(text + "\n")
        return 0
    from nf4.linear import tuned

    if not args.configs:
        ap.error("--configs is required (or --report)")
    unknown = [c for c in args.configs if c not in tuned.CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {sorted(tuned.CONFIGS)}")
    try:
        shapes = select_part(expand_shapes(args.shapes), parse_part(args.part))
    except (argparse.ArgumentTypeError, ValueError) as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("config_race needs a CUDA GPU")
        return 2
    from verify import timing

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    out = {"device": torch.cuda.get_device_name(), "environment": timing.environment(), "part": args.part,
           "configs": args.configs, "ms": args.ms, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for n, k in shapes:
        out["rows"] += race(n, k, args.ms, args.configs, dtype, count_launches=not args.no_launches)
        out["summary"] = summary(out["rows"], fit)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))  # after every shape: a cut run keeps them
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
