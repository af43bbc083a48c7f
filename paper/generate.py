"""python -m paper.generate: every number of the paper, written as LaTeX from committed result files.

    python -m paper.generate                       # results/ -> paper/generated/
    python -m paper.generate --results /tmp/r      # other result files (e.g. a fresh GPU run)
    python -m paper.generate --check               # compare with paper/generated/, write nothing

Inputs (all optional; a missing one gives tables and macros marked "not measured", and is named on
stderr):

    results/nf4_bench.json        nf4.bench: env, copy_bandwidth, empty_triton_launch, rows, sweep
    results/verify_<device>.json  python -m verify: the bit-exact matrix, known defects, the challenge
                                  harness (device "cuda"); verify_cpu.json is the CPU matrix
    results/experiments.json      python -m experiments run: variants, rows, optionally sm75
                                  (results/experiments.csv is read when the JSON is missing)
    results/experiments_sm75.json python -m experiments sm75: the offline sm_75 builds (or .csv), used
                                  when experiments.json carries no sm75 section
    results/catalog/dequant_<gpu>.json  python -m experiments catalog-bench dequant: the shape catalog
    results/labs/gemv_skeletons_<gpu>.json  python -m experiments.labs.gemv_lut: the GEMV lab's skeletons
    results/labs/gemm_tma_<gpu>.json  python -m experiments.labs.gemm_tma: the GEMM lab
    results/linear/bench_<gpu>.json   python -m experiments bench-linear (gpu: h100, h200): the fused
    results/linear/bench2_<gpu>.json  linear against its peers, bf16 on the bar weights (bench) and fp16
                                  on four more weights (bench2)

Two inputs are not measurements and live outside results/: `paper/published_claims.json` (what other
people report, quoted with its source, so that no number of theirs is typed into main.tex) and the
format's own constants, computed here from `reference/` (the codebook table, how far a 4-decimal or a
float64 rebuild of it lands, the dynamic map's dependence on FMA contraction, the 8-bit table's
unreachable indices). No device is involved in either.

Outputs: `macros.tex` (\\newcommand{\\NF...}{...} for every number used in prose), booktabs tables
(`*_table.tex`), pgfplots figures (`fig_*.tex`) with their data (`*.dat`), and `provenance.tex`
(every input with its SHA-256). Output is a pure function of the inputs: tests/paper/test_paper.py
regenerates it and compares byte for byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paper.latex import NM, Document
from paper.sections import (
    bench,
    bounds,
    catalog,
    challenge,
    claims,
    codebook,
    decode,
    experiments,
    fsdp,
    gemm_lab,
    gemm_limit,
    gemv_limit,
    gluon_lab,
    gluon_route,
    known,
    linear,
    linear_host,
    ncu,
    probe,
    qlora,
    tuning,
    verify,
)

# This module reads the inputs that several sections share and runs the sections in order; paper/sections/
# holds one module per section, paper/latex.py what they share. NM is re-exported for the tests.
__all__ = ["CLAIMS", "NM", "OUT", "RESULTS", "compare", "generate", "main", "run", "write_files"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
OUT = ROOT / "paper" / "generated"
CLAIMS = ROOT / "paper" / "published_claims.json"


def run(results: Path, claims_path: Path = CLAIMS) -> Document:
    """Every section on the inputs in `results` (and the quoted claims): the filled document."""
    doc = Document(results)
    # The order is part of the output: macros.tex lists the macros in the order they are defined.
    bench_data = doc.load("nf4_bench.json", label="nf4.bench", required_for="bench tables, bandwidth figure")
    verify_cpu, verify_gpu = _load_verify(doc, bench_data)
    experiments_data = experiments.load(doc)
    codebook.build(doc)
    doc.section("results/nf4_bench.json", bench.build, bench_data)
    doc.section("results/verify_cpu.json", verify.build, verify_cpu, "Cpu", "verify_matrix_cpu.tex")
    doc.section("results/verify_<gpu>.json", verify.build, verify_gpu, "Gpu", "verify_matrix_gpu.tex")
    doc.section("results/verify_*.json known defects", known.build, verify_cpu, verify_gpu)
    doc.section("results/verify_<gpu>.json challenge", challenge.build, (verify_gpu or {}).get("challenge"))
    doc.section("results/experiments.json", experiments.build, experiments_data)
    doc.section("results/tuning/", tuning.build, tuning.load(doc))
    doc.section("results/probe_<gpu>.json", probe.build, probe.load(doc))
    doc.section("results/linear/", linear.build, linear.load(doc))
    doc.section("results/linear/gemv_limit_<gpu>.json", gemv_limit.build, gemv_limit.load(doc))
    doc.section("results/linear/gemm_limit_<gpu>.json", gemm_limit.build, gemm_limit.load(doc))
    doc.section("results/labs/gemm_tma_<gpu>.json", gemm_lab.build, gemm_lab.load(doc))
    doc.section("results/labs/gluon_gemm_<gpu>.json", gluon_lab.build, gluon_lab.load(doc))
    doc.section("results/labs/gluon_rule_judged_<gpu>.json", gluon_route.build, gluon_route.load(doc))
    doc.section("results/linear/bounds/bounds_<gpu>.json", bounds.build, bounds.load(doc))
    doc.section("results/linear/ncu/", ncu.build, ncu.load(doc), ncu.load_sweep(doc))
    doc.section("results/qlora_<gpu>.json", qlora.build, qlora.load(doc))
    doc.section("results/decode/decode_<gpu>.json", decode.build, decode.load(doc))
    doc.section("results/fsdp/fsdp_qlora_<gpu>x2.json", fsdp.build, fsdp.load(doc))
    doc.section("results/linear/host_<gpu>.json", linear_host.build, linear_host.load(doc))
    doc.section("results/catalog/, results/labs/", catalog.build, catalog.load(doc))
    doc.section("paper/published_claims.json", claims.build, Path(claims_path))
    doc.provenance()
    doc.write("macros.tex", doc.macros_tex())
    return doc


def _load_verify(doc: Document, bench):
    """(CPU payload, GPU payload) of results/verify_*.json; the GPU one from the bench's device when several."""
    found = sorted(p.name for p in doc.results.glob("verify_*.json")) if doc.results.is_dir() else []
    cpu = gpu = None
    gpu_names = []
    for name in found:
        payload = doc.load(name, label="python -m verify", required_for="bit-exact matrix")
        if not isinstance(payload, dict):
            continue
        if payload.get("device") == "cuda":
            gpu_names.append((name, payload))
        elif cpu is None:
            cpu = payload
    if gpu_names:
        device = ((bench or {}).get("env") or {}).get("device")
        same = [p for n, p in gpu_names if (p.get("env") or {}).get("device") == device]
        gpu = (same or [gpu_names[0][1]])[0]
    if cpu is None:
        doc.missing.append("results/verify_cpu.json (CPU matrix: python -m verify)")
    if gpu is None:
        doc.missing.append("results/verify_<gpu>.json (GPU matrix, challenge harness: python -m verify on a GPU)")
    return cpu, gpu


# --- entry point ----------------------------------------------------------------------------------


def generate(results: Path = RESULTS, claims: Path = CLAIMS) -> tuple[dict[str, str], list[str]]:
    """(file name -> content, missing inputs) for the given results folder."""
    doc = run(results, claims)
    return dict(sorted(doc.files.items())), sorted(set(doc.missing))


def write_files(files: dict[str, str], out: Path) -> None:
    """Replace the contents of `out` with `files` (stale generated files are removed)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file() and old.name not in files:
            old.unlink()
    for name, content in files.items():
        path = out / name
        if not path.exists() or path.read_text() != content:
            path.write_text(content)


def compare(files: dict[str, str], out: Path) -> list[str]:
    """Differences between `files` and the folder `out`: one line per stale, missing or extra file."""
    problems = []
    present = {p.name for p in out.iterdir() if p.is_file()} if out.is_dir() else set()
    for name, content in files.items():
        if name not in present:
            problems.append(f"missing: {name}")
        elif (out / name).read_text() != content:
            problems.append(f"differs: {name}")
    problems += [f"extra: {name}" for name in sorted(present - set(files))]
    return problems


def main(argv=None) -> int:
    """The command line (see the module docstring); 0 on success, 1 when --check finds a difference."""
    ap = argparse.ArgumentParser(prog="python -m paper.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files (default results/)")
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (default paper/generated/)")
    ap.add_argument("--claims", type=Path, default=CLAIMS, help="default paper/published_claims.json")
    ap.add_argument("--check", action="store_true", help="compare with --out, write nothing; exit 1 on a difference")
    args = ap.parse_args(argv)
    files, missing = generate(args.results, args.claims)
    for m in missing:
        print(f"paper.generate: missing input, marked 'not measured': {m}", file=sys.stderr)
    if args.check:
        problems = compare(files, args.out)
        for p in problems:
            print(f"paper.generate --check: {p}", file=sys.stderr)
        return 1 if problems else 0
    write_files(files, args.out)
    print(f"paper.generate: wrote {len(files)} files to {args.out}" + (f" ({len(missing)} inputs missing)"
                                                                      if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
