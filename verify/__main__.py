"""python -m verify: every implementation against the oracles, bit for bit; then the challenge harness.

    python -m verify                          # full matrix (+ challenge and timing on a GPU)
    python -m verify --quick                  # the CI subset (CPU: about a minute on 2 cores)
    python -m verify --out results/verify_h200.json
    python -m verify --groups tiny huge --impls nf4 bnb.dequantize_4bit
    python -m verify --challenge-only --iters 200

Without CUDA the CPU part runs (the reference, bitsandbytes' CPU routes, bitsandbytes' Triton kernel
and nf4 under Triton's interpreter) and the GPU-only parts are listed as skipped. Exit status: 0
when every cell passed or is explained by a known defect (verify/known.py), 1 otherwise, 2 when
nothing could run.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI subset of the case grid")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", help="JSON report (default build/verify_<device>.json, an ignored folder: a run never "
                                  "replaces the committed results unless --out names them)")
    ap.add_argument("--groups", nargs="+", help="case groups to run (default: all)")
    ap.add_argument("--impls", nargs="+", help="implementations to run (default: all that run on the device)")
    ap.add_argument("--list", action="store_true", help="list the cases and implementations, run nothing")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    ap.add_argument("--compile-all", action="store_true", help="torch.compile peers on every case, not a subset")
    ap.add_argument("--inductor-trace", action="store_true",
                    help="also set torch._inductor.config.trace (full debug dumps under <out dir>/inductor/trace)")
    ap.add_argument("--matrix-budget-s", type=float,
                    help="skip the cases left after this many seconds (default: 330 on CUDA, so that one "
                         "10-minute command still reaches the challenge; none on CPU)")
    ap.add_argument("--skip-matrix", "--challenge-only", dest="skip_matrix", action="store_true")
    ap.add_argument("--skip-challenge", action="store_true")
    ap.add_argument("--iters", type=int, default=1000, help="challenge: iterations of the three weights (1000)")
    ap.add_argument("--configs", nargs="+", type=int, help="challenge: config indices 0 1 2 (default all)")
    ap.add_argument("--reps", type=int, default=100, help="challenge: CUDA-event repetitions per device time")
    return ap.parse_args(argv)


def choose_device(requested: str) -> str:
    """'cuda' when asked for or available; decided with torch alone, before anything imports triton."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("verify: --device cuda, but torch.cuda.is_available() is False")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def device_slug() -> str:
    """'cpu', or the GPU's name in lower case without the vendor, e.g. 'h200'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def _progress(enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machines have no tqdm
        return _plain_progress

    def wrap(items):
        return tqdm(items, desc="verify", unit="case", file=sys.stderr, dynamic_ncols=True)

    return wrap


def _plain_progress(items):
    items = list(items)
    step = max(1, len(items) // 20)
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        if i % step == 0:
            print(f"verify: case {i}/{len(items)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        yield item


def _quiet_logs() -> None:
    # bitsandbytes warns about an optional CPU package; dynamo warns when bitsandbytes' own
    # torch.compile wrapper hits its recompile limit (it then runs eagerly, which is still checked).
    for name in ("bitsandbytes", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = choose_device(args.device)
    if device == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before bitsandbytes imports triton
    _quiet_logs()
    from . import cases as cases_mod
    from . import impls as impls_mod
    from . import matrix, report, timing

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        print(f"verify: bitsandbytes is needed for every case ({exc}); pip install bitsandbytes==0.50.2",
              file=sys.stderr)
        return 2
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device == "cpu" and not interpreting:
        print("verify: warning: triton was imported before TRITON_INTERPRET=1 could be set; nf4 cannot run on "
              "CPU tensors", file=sys.stderr)
    if device == "cuda" and interpreting:
        print("verify: warning: TRITON_INTERPRET is set on a CUDA machine: the Triton kernels run interpreted",
              file=sys.stderr)

    slug = device_slug() if device == "cuda" else "cpu"
    out_path = Path(args.out) if args.out else ROOT / "build" / f"verify_{slug}.json"
    impls_mod.set_compile_save_dir(out_path.parent / "inductor")
    if args.inductor_trace and device == "cuda":
        import torch._inductor.config as inductor_config

        inductor_config.trace.enabled = True
        inductor_config.trace.debug_dir = str(out_path.parent / "inductor" / "trace")

    registry = impls_mod.IMPLEMENTATIONS
    if args.impls:
        unknown = sorted(set(args.impls) - set(registry))
        if unknown:
            print(f"verify: unknown implementations {unknown}; known: {list(registry)}", file=sys.stderr)
            return 2
    selected = [n for n in registry if args.impls is None or n in args.impls]
    skipped = {}
    for n in selected:
        impl = registry[n]
        if device not in impl.devices:
            skipped[n] = f"{'/'.join(impl.devices)} only"
        elif args.no_compile and impl.compile_subset:
            skipped[n] = "--no-compile"
        elif impl.unavailable():
            skipped[n] = impl.unavailable()
    names = [n for n in selected if n not in skipped]
    grid = cases_mod.grid(quick=args.quick, groups=args.groups)

    if args.list:
        for c in grid:
            print(c.id + ("  [compile]" if c.compile else ""))
        print(f"{len(grid)} cases; implementations on {device}: {', '.join(names)}")
        return 0

    env = timing.environment()
    t0 = time.perf_counter()
    budget = args.matrix_budget_s if args.matrix_budget_s is not None else (330.0 if device == "cuda" else None)
    cells = [] if args.skip_matrix else matrix.run(grid, names, device, progress=_progress(not args.no_progress),
                                                   compile_all=args.compile_all, budget_s=budget)
    matrix_seconds = time.perf_counter() - t0
    failed = [c for c in cells if c["status"] in ("fail", "error")]
    not_run = sorted({c["case"] for c in cells if (c.get("note") or "").startswith("not run:")})

    skipped_parts = {}
    challenge = None
    if device == "cuda" and not args.skip_challenge:
        if cells:  # a checkpoint: the matrix survives whatever the harness does
            timing.write_json(out_path, {"env": env, "device": device, "partial": "matrix only (challenge running)",
                                         "matrix": {"cells": cells, "summary": report.summarize(cells)}})
        from . import challenge as challenge_mod

        try:
            challenge = challenge_mod.run(configs=args.configs, iters=args.iters, reps=args.reps,
                                          include_compile=not args.no_compile, save_dir=out_path.parent / "inductor")
        except Exception:
            challenge = {"failed": True, "error": traceback.format_exc()[-3000:], "configs": [],
                         "baseline": challenge_mod.BASELINE, "iters": args.iters}
            print(f"verify: the challenge harness raised:\n{challenge['error']}", file=sys.stderr)
    elif device != "cuda":
        skipped_parts = {"challenge harness": "needs CUDA (verify/challenge.py)",
                         "timing": "needs CUDA (device time, wall time, copy bandwidth)"}
    else:
        skipped_parts = {"challenge harness": "--skip-challenge"}
    challenge_failed = bool(challenge and challenge.get("failed"))

    compile_peers = [p.summary() for p in impls_mod._compile_peers.values()]
    known_seen = report.known_summary(cells)
    status = 1 if failed or challenge_failed else 0
    if not cells and challenge is None:
        status = 2 if not args.skip_matrix else status
    from . import known

    payload = {
        "env": env,
        "device": device,
        "args": vars(args),
        "matrix": {"cases": len(grid) if not args.skip_matrix else 0, "implementations": names,
                   "seconds": round(matrix_seconds, 1), "summary": report.summarize(cells), "cells": cells,
                   "failed_cells": len(failed), "unexpected_passes": report.unexpected_passes(cells),
                   "cases_not_run": not_run, "budget_s": budget,
                   "oracle": {"cpu": "reference(ftz=False); reference row checked against bnb.default (eager)",
                              "cuda": "reference(ftz=True); reference row checked against bnb.dequantize_4bit (CUDA)"}
                   [device]},
        "known_defects": {"entries": [d.as_dict() for d in known.DEFECTS], "seen": known_seen},
        "compile_peers": compile_peers,
        "skipped": {"implementations": skipped, **skipped_parts},
        "challenge": challenge,
        "exit_status": status,
    }
    path = timing.write_json(out_path, payload)

    print()
    if known_seen:
        print(report.known_text(known_seen))
    if failed:
        print(report.failures(cells))
    for peer in compile_peers:
        print(f"{peer['name']}: {peer['compilations']} compilation(s), fp fusion requested "
              f"{peer['fp_fusion_requested']}, enable_fp_fusion in generated code {peer['enable_fp_fusion_in_code']}")
    for what, why in {**{f"implementation {k}": v for k, v in skipped.items()}, **skipped_parts}.items():
        print(f"skipped: {what} ({why})")
    print(f"wrote {path}")
    if cells:
        print(f"\nbit-exact matrix on {env['device']}: {len(grid)} cases in {matrix_seconds:.0f} s; "
              f"expected = {payload['matrix']['oracle']}")
        mismatches = report.mismatch_table(cells)
        if mismatches:
            print("mismatching cells (known defects are explained by their models; fail is not):")
            print(mismatches)
        print(report.LEGEND)
        print(report.matrix_table(cells))
    if challenge is not None:
        from . import challenge as challenge_mod

        print()
        print(challenge_mod.table(challenge))
    print(f"\nverify: {'FAILED' if status else 'ok'}: {len(failed)} failing cell(s)"
          + (", challenge check failed" if challenge_failed else "")
          + (f"; {len(not_run)} case(s) NOT RUN (time budget: rerun with --groups/--matrix-budget-s)" if not_run
             else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
