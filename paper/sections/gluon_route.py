"""results/labs/gluon_rule_judged_<gpu>.json (`python -m experiments.labs.gluon_gemm --report-rule ... --out-report`):
the Gluon GEMM as nf4.linear routes it.

Per GPU and source file (the lab race over the whole catalog, or nf4.linear itself over part of it), dtype and M: the
(shape, M) rows the rule routes, the fit and held-out subsets' medians and the worst of its time over the table's
choice without it, how many rows are more than 3 % slower, and the fit subset's median over dense cuBLAS. Macros give
the range of the subsets' medians, the held-out ones, and the rows that are not exact (0 expected).
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, ratio, row, tex
from paper.sections.linear import GPUS, load_present


def load(doc: Document) -> dict:
    return load_present(doc, "labs/gluon_rule_judged_{tag}.json", "experiments.labs.gluon_gemm --report-rule",
                        "Gluon route table")


def cells(payload: dict) -> list[dict]:
    """One row per (source, dtype, M): routed rows (fit + held-out), the two subsets' medians of the time over the
    table's choice, the worst row, the rows more than 3 % slower, the fit subset's median over dense cuBLAS, and
    the rows that were not exact."""
    out = []
    for j in payload.get("judged") or []:
        groups: dict = {}
        for r in j.get("rows") or []:
            groups.setdefault((r["dtype"], r["M"]), {})[r["subset"]] = r
        for (dt, m), subs in sorted(groups.items()):
            rows = list(subs.values())
            fit, held = subs.get("fit", {}), subs.get("held-out", {})
            worst = [r["worst_over_table"] for r in rows if r.get("worst_over_table") is not None]
            out.append({"source": j.get("source"), "shapes": j.get("shapes"), "dtype": dt, "M": m,
                        "routed": sum(r["routed"] for r in rows), "not_exact": sum(r["not_exact"] for r in rows),
                        "fit": fit.get("median_over_table"), "held_out": held.get("median_over_table"),
                        "worst": max(worst) if worst else None,
                        "slower": sum(r["slower_than_table_3pct"] for r in rows),
                        "dense": fit.get("median_over_dense")})
    return out


def build(doc: Document, data: dict) -> None:
    all_cells = {tag: cells(p) for tag, p in data.items()}
    slower = {p.get("slower_threshold") for p in data.values()} - {None}
    doc.macro("NFgluonRouteSlowerPct", str(round((slower.pop() - 1) * 100)) if len(slower) == 1 else NM)
    for tag, g, _ in GPUS:
        cs = all_cells.get(tag, [])
        meds = [v for c in cs for v in (c["fit"], c["held_out"]) if v is not None]
        doc.macro(f"NFgluonRouteMedMin{g}", ratio(min(meds)) if meds else NM)
        doc.macro(f"NFgluonRouteMedMax{g}", ratio(max(meds)) if meds else NM)
        doc.macro(f"NFgluonRouteRows{g}", str(sum(c["routed"] for c in cs)) if cs else NM)
        doc.macro(f"NFgluonRouteSlower{g}", str(sum(c["slower"] for c in cs)) if cs else NM)
        doc.macro(f"NFgluonRouteNotExact{g}", str(sum(c["not_exact"] for c in cs)) if cs else NM)
        held = [c["held_out"] for c in cs if c["held_out"] is not None]
        doc.macro(f"NFgluonRouteHeldMin{g}", ratio(min(held)) if held else NM)
        doc.macro(f"NFgluonRouteHeldMax{g}", ratio(max(held)) if held else NM)
    if not any(all_cells.values()):
        doc.write("gluon_route_table.tex", missing_box(r"results/labs/gluon\_rule\_judged\_<gpu>.json"))
        return
    lines = [r"\begin{tabular}{lllrrrrrrr}", r"\toprule",
             row(["GPU", "source", "dtype", "$M$", "routed", "fit", "held-out", "worst", r"$>$3\,\% slower",
                  "fit / dense"]), r"\midrule"]
    for tag, _, label in GPUS:
        for c in all_cells.get(tag, []):
            src = f"{c['source']} ({c['shapes']})"
            lines.append(row([label, tex(src), tex(c["dtype"]), str(c["M"]), str(c["routed"]),
                              ratio(c["fit"]) if c["fit"] is not None else NM,
                              ratio(c["held_out"]) if c["held_out"] is not None else NM,
                              ratio(c["worst"]) if c["worst"] is not None else NM, str(c["slower"]),
                              ratio(c["dense"]) if c["dense"] is not None else NM]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("gluon_route_table.tex", "\n".join(lines) + "\n")
