"""python -m experiments {list, run, sm75, bench, bench-linear, probe, gemv-limit, gemm-limit, linear-bounds,
linear-host, qlora, fsdp-qlora, catalog}: see experiments/README.md.

Without a CUDA device, TRITON_INTERPRET=1 is set here, before anything imports triton, so that
`run` checks the variants in Triton's interpreter. `sm75` (and `run --sm75`) compiles in a child
process without it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="GPU: nf4.dequantize against its peers, device and host time (experiments.bench)",
                   add_help=False)
    sub.add_parser("bench-linear", help="GPU: nf4.linear against its peers, operand and sum checks, device and "
                   "host time (experiments.bench_linear)", add_help=False)
    sub.add_parser("probe", help="GPU: where host and device time go, and the layout labs (experiments.probe)",
                   add_help=False)
    sub.add_parser("qlora", help="GPU: QLoRA train step and decode, bitsandbytes alone against nf4 patched in "
                   "(experiments.qlora)", add_help=False)
    sub.add_parser("decode", help="GPU: greedy decode and prefill of full-depth Llama-3-8B / Qwen2.5-7B-shaped 4-bit "
                   "models, dense, bitsandbytes alone and nf4 patched, eager and compiled (experiments.decode)",
                   add_help=False)
    sub.add_parser("fsdp-qlora", help="GPUs (or --cpu): FSDP-QLoRA training steps sharded over one process per GPU, "
                   "bitsandbytes alone against nf4 patched in (experiments.fsdp_qlora)", add_help=False)
    sub.add_parser("compile-dequant", help="GPU: torch.compile'd nf4.dequantize, triton_op against the opaque op "
                   "and eager (experiments.compile_dequant)", add_help=False)
    sub.add_parser("gemv-limit", help="GPU (or --sass-only): nf4.linear at M = 1 cut into its loads and its decode, "
                   "and its main loop's SASS (experiments.gemv_limit)", add_help=False)
    sub.add_parser("gemm-limit", help="GPU (or --sass-only): nf4.linear's tl.dot kernel at M = 128-1024 cut into "
                   "its decode, its layout and its tensor-core loop, and their SASS (experiments.gemm_limit)",
                   add_help=False)
    sub.add_parser("linear-bounds", help="GPU: the bars of nf4.linear as times beside cuBLAS, bitsandbytes and "
                   "the fastest dense Triton GEMM inductor finds, none decoding (experiments.linear_bounds)",
                   add_help=False)
    sub.add_parser("linear-host", help="GPU: host time of one 4-bit linear as a QLoRA step calls it, per mode and "
                   "call form (experiments.linear_host)", add_help=False)
    sub.add_parser("catalog", help="the shape catalog: every (N, K) of the decoder linears of public open models at "
                   "tp 1 and 2, with its fit / held-out subset (experiments.catalog)", add_help=False)
    sub.add_parser("catalog-bench", help="GPU: nf4 against its peers on every catalog shape, and merge of parts "
                   "(experiments.catalog_bench)", add_help=False)
    sub.add_parser("tune-dequant", help="GPU sweep of nf4.dequantize's configs on the catalog, and the tuned table's "
                   "rules fit on its fit subset (experiments.tune_dequant)", add_help=False)
    sub.add_parser("call-forms", help="GPU: host time of every eager repeat-call form of nf4.dequantize and nf4.linear "
                   "against an empty Triton JIT launch (experiments.call_forms)", add_help=False)
    sub.add_parser("compiled-host", help="GPU: host time of nf4.linear's compiled calls without CUDA graphs, beside "
                   "a compiled dense matmul (experiments.compiled_host)", add_help=False)
    sub.add_parser("list", help="table of variants: id, parent, change, exact_expected")
    run = sub.add_parser("run", help="check every variant bit-exact, then time it (GPU)")
    run.add_argument("ids", nargs="*", help="variant ids or shell patterns (v3*); default all")
    run.add_argument("--cases", nargs="+", help="cases like 8192x2048:fp16 or 3x2905:bf16:32 (blocksize); "
                     "default: the challenge shapes on a GPU, small odd ones in the interpreter")
    run.add_argument("--check-only", action="store_true", help="check exactness, do not time")
    run.add_argument("--out", default=None,
                     help="JSON path, a CSV is written next to it (default: results/experiments.json on a GPU, "
                          "results/experiments_interpreter.json without one, so a CPU check never overwrites "
                          "the GPU results)")
    run.add_argument("--sm75", action="store_true", help="also compile every kernel offline for sm_75 (T4)")
    run.add_argument("--reps", type=int, default=100, help="timed calls per variant and case")
    run.add_argument("--inductor-dir", default="results/inductor", help="where v60/v61 save inductor's code")
    sm = sub.add_parser("sm75", help="only the offline sm_75 compile (no GPU needed)")
    sm.add_argument("ids", nargs="*")
    sm.add_argument("--out", default=None,
                    help="JSON path (default: results/experiments_sm75.json for all variants; a subset writes "
                         "under build/ so that it never replaces the committed file)")
    sm.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    sm.add_argument("--ptx-dir", default=None, help="also save each build's PTX here")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("bench", "bench-linear", "probe", "qlora", "fsdp-qlora", "compile-dequant", "gemv-limit",
                            "gemm-limit", "linear-bounds", "linear-host", "call-forms", "compiled-host", "catalog",
                            "catalog-bench", "tune-dequant", "decode"):
        import importlib

        return importlib.import_module(f"{__package__}.{argv[0].replace('-', '_')}").main(argv[1:])
    args = ap.parse_args(argv)

    from . import runner

    if args.command == "list":
        print(runner.list_table())
        return 0
    if args.command == "sm75":
        from . import registry, sm75

        ids = [v.id for v in registry.select(args.ids) if v.kernel is not None]
        if args.out is None:
            args.out = "build/experiments_sm75_subset.json" if args.ids else "results/experiments_sm75.json"
        result = sm75.compile_in_child(ids, jobs=args.jobs, ptx_dir=args.ptx_dir)
        from verify.timing import write_json

        path = write_json(args.out, result)
        runner._write_csv(path.with_suffix(".csv"), result["builds"], sm75.CSV_FIELDS)
        print(f"wrote {path} and {path.with_suffix('.csv')}")
        print(sm75.table(result))
        return 1 if sm75.failures(result) else 0
    if args.out is None:
        import torch

        interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        gpu = torch.cuda.is_available() and not interpreting
        args.out = "results/experiments.json" if gpu else "results/experiments_interpreter.json"
    payload = runner.run(args.ids, args.cases, check_only=args.check_only, out=args.out, sm75=args.sm75,
                         reps=args.reps, inductor_dir=args.inductor_dir)
    bad = [r for r in payload["rows"] if r["status"] in ("INEXACT", "error") or r.get("error")]
    if bad:
        print(f"\n{len(bad)} rows failed: " + ", ".join(f"{r['variant']} {r['case']} ({r['status']})" for r in bad),
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
