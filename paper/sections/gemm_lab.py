"""results/labs/gemm_tma_<gpu>.json (`python -m experiments.labs.gemm_tma`): the GEMM lab.

Per GPU, weight and M: cuBLAS's dense GEMM time, and over it nf4.linear, the fastest lab candidate that decodes
exactly (operand-exact on identity rows and within the float32 bound on random x), the fastest dense control (the
lab's loop on the dequantized bf16 weight) and the no-lookup control. Macros: the ranges of those ratios at
M >= BIG_M, where tiles fill the GPU.
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, ratio, row, us
from paper.sections.linear import GPUS, load_present

BIG_M = 512
MODES = {0: "exact", 1: "dense", 2: "nolookup"}


def load(doc: Document) -> dict:
    """{gpu tag: payload} of the files present (a lab run: no note where a GPU has none)."""
    return load_present(doc, "labs/gemm_tma_{tag}.json", "experiments.labs.gemm_tma", "GEMM lab table")


def summary(payload: dict) -> dict:
    """{(N, K, M): {"cublas": us, "nf4": ratio, "exact": (ratio, name), "dense": ratio, "nolookup": ratio}}."""
    modes = {name: MODES.get(c[0]) for name, c in (payload.get("candidates") or {}).items()
             if isinstance(c, (list, tuple)) and c}
    groups: dict = {}
    for r in payload.get("rows") or []:
        if isinstance(r, dict) and isinstance(r.get("graph_us"), (int, float)) and r["graph_us"] > 0:
            groups.setdefault((r["N"], r["K"], r["M"]), []).append(r)
    out = {}
    for key, rows in groups.items():
        dense = next((r["graph_us"] for r in rows if r["provider"] == "cublas_dense"), None)
        if not dense:
            continue
        s = {"cublas": dense}
        nf4 = next((r["graph_us"] for r in rows if r["provider"] == "nf4.linear"), None)
        s["nf4"] = nf4 / dense if nf4 else None
        for mode in ("exact", "dense", "nolookup"):
            c = [(r["graph_us"] / dense, r["provider"]) for r in rows if modes.get(r["provider"]) == mode
                 and (mode != "exact" or (r.get("operand_mismatches") == 0 and r.get("random_within_bound")))]
            s[mode] = min(c) if c else (None, None)
        out[key] = s
    return out


def build(doc: Document, data: dict) -> None:
    sums = {tag: summary(p) for tag, p in data.items()}
    for tag, g, _ in GPUS:
        big = [s for (n, k, m), s in sums.get(tag, {}).items() if m >= BIG_M]
        for stem, key in (("Exact", "exact"), ("Dense", "dense"), ("Nolookup", "nolookup")):
            vals = [s[key][0] for s in big if s[key][0] is not None]
            doc.macro(f"NFgemmLab{stem}Min{g}", ratio(min(vals)) if vals else NM)
            doc.macro(f"NFgemmLab{stem}Max{g}", ratio(max(vals)) if vals else NM)
        vals = [s["nf4"] for s in big if s["nf4"] is not None]
        doc.macro(f"NFgemmLabProductMin{g}", ratio(min(vals)) if vals else NM)
        doc.macro(f"NFgemmLabProductMax{g}", ratio(max(vals)) if vals else NM)
    doc.macro("NFgemmLabBigM", str(BIG_M))
    if not sums:
        doc.write("gemm_lab_table.tex", missing_box(r"results/labs/gemm\_tma\_<gpu>.json"))
        return
    lines = [r"\begin{tabular}{llrrrrrr}", r"\toprule",
             row(["GPU", r"$N \times K$", "$M$", r"cuBLAS (\textmu s)", r"\code{nf4.linear}", "best exact lab",
                  "dense control", "no lookup"]), r"\midrule"]
    for tag, _, label in GPUS:
        for (n, k, m), s in sorted(sums.get(tag, {}).items()):
            lines.append(row([label, rf"{n}$\times${k}", str(m), us(s["cublas"]),
                              ratio(s["nf4"]) if s["nf4"] is not None else NM,
                              *[ratio(s[key][0]) if s[key][0] is not None else NM
                                for key in ("exact", "dense", "nolookup")]]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("gemm_lab_table.tex", "\n".join(lines) + "\n")
