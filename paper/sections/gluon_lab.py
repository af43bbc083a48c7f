"""results/labs/gluon_gemm_<gpu>.json (`python -m experiments.labs.gluon_gemm`): the Gluon GEMM lab.

Per GPU, weight and M: cuBLAS's dense GEMM time, and over it nf4.linear and the fastest exact Gluon candidate (operand-
exact on identity rows, within the float32 bound on random x), timed with x's column permutation (the register-operand
kernels need it) and without it. Macros: the ranges of the kernel-alone ratio at M >= BIG_M and at M = 17-128, and how
many (weight, M) cells at M = 17-128 the kernel alone, and the kernel with x's permutation, beat cuBLAS in.
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, ratio, row, us
from paper.sections.linear import GPUS, load_present

BIG_M = 512


def load(doc: Document) -> dict:
    return load_present(doc, "labs/gluon_gemm_{tag}.json", "experiments.labs.gluon_gemm", "Gluon lab table")


def summary(payload: dict) -> dict:
    """{(N, K, M): {"cublas": us, "nf4": ratio, "best": ratio, "kernel": ratio, "name": provider}}."""
    groups: dict = {}
    for r in payload.get("rows") or []:
        if isinstance(r, dict) and isinstance(r.get("graph_us"), (int, float)) and r["graph_us"] > 0:
            groups.setdefault((r["N"], r["K"], r["M"]), []).append(r)
    out = {}
    for key, rows in groups.items():
        dense = next((r["graph_us"] for r in rows if r["provider"] == "cublas_dense"), None)
        exact = [r for r in rows if str(r["provider"]).startswith(("g_", "ws_"))
                 and r.get("operand_mismatches") == 0 and r.get("random_within_bound")]
        if not dense or not exact:
            continue
        nf4 = next((r["graph_us"] for r in rows if r["provider"] == "nf4.linear"), None)
        best = min(exact, key=lambda r: r["graph_us"])
        kernel = min((r.get("kernel_us") or r["graph_us"]) for r in exact)
        out[key] = {"cublas": dense, "nf4": nf4 / dense if nf4 else None, "best": best["graph_us"] / dense,
                    "kernel": kernel / dense, "name": best["provider"]}
    return out


def build(doc: Document, data: dict) -> None:
    sums = {tag: summary(p) for tag, p in data.items()}
    for tag, g, _ in GPUS:
        cells = sums.get(tag, {})
        big = [s["kernel"] for (n, k, m), s in cells.items() if m >= BIG_M]
        mid = [s["kernel"] for (n, k, m), s in cells.items() if 17 <= m <= 128]
        mid_best = [s["best"] for (n, k, m), s in cells.items() if 17 <= m <= 128]
        doc.macro(f"NFgluonBigMin{g}", ratio(min(big)) if big else NM)
        doc.macro(f"NFgluonBigMax{g}", ratio(max(big)) if big else NM)
        doc.macro(f"NFgluonMidMin{g}", ratio(min(mid)) if mid else NM)
        doc.macro(f"NFgluonMidMax{g}", ratio(max(mid)) if mid else NM)
        doc.macro(f"NFgluonMidFaster{g}", str(sum(v < 1 for v in mid)) if mid else NM)
        doc.macro(f"NFgluonMidCells{g}", str(len(mid)) if mid else NM)
        doc.macro(f"NFgluonMidFasterPermuted{g}", str(sum(v < 1 for v in mid_best)) if mid_best else NM)
    doc.macro("NFgluonBigM", str(BIG_M))
    if not sums:
        doc.write("gluon_lab_table.tex", missing_box(r"results/labs/gluon\_gemm\_<gpu>.json"))
        return
    lines = [r"\begin{tabular}{llrrrrr}", r"\toprule",
             row(["GPU", r"$N \times K$", "$M$", r"cuBLAS (\textmu s)", r"\code{nf4.linear}", "best Gluon",
                  "kernel alone"]), r"\midrule"]
    for tag, _, label in GPUS:
        for (n, k, m), s in sorted(sums.get(tag, {}).items()):
            lines.append(row([label, rf"{n}$\times${k}", str(m), us(s["cublas"]),
                              ratio(s["nf4"]) if s["nf4"] is not None else NM, ratio(s["best"]),
                              ratio(s["kernel"])]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("gluon_lab_table.tex", "\n".join(lines) + "\n")
