"""The known defects recorded by `python -m verify` in verify_cpu.json and verify_<gpu>.json."""

from __future__ import annotations

from paper.latex import DASH, Document, integer, missing_box, row, tex


def build(doc: Document, cpu: dict | None, gpu: dict | None) -> None:
    """The table of known defects and deviations (verify/known.py) with the cells each matrix saw."""
    entries: dict[str, dict] = {}
    for payload in (cpu, gpu):
        for e in ((payload or {}).get("known_defects") or {}).get("entries") or []:
            entries.setdefault(e.get("id"), e)
    if not entries:
        doc.write("known_defects_table.tex", missing_box("known defects (\\texttt{python -m verify})"))
        return
    seen = {}
    for which, payload in (("cpu", cpu), ("gpu", gpu)):
        seen[which] = {s.get("id"): s.get("cells", 0)
                       for s in ((payload or {}).get("known_defects") or {}).get("seen") or []}
    lines = [r"\begin{tabular}{@{}l l l r r@{}}", r"\toprule",
             r"known defect or deviation & whose & kind & cells (CPU) & cells (GPU) \\", r"\midrule"]
    for did, e in entries.items():
        cells = [rf"\texttt{{{tex(did)}}}", tex(e.get("owner", "")), tex(e.get("kind", ""))]
        for which, payload in (("cpu", cpu), ("gpu", gpu)):
            cells.append(integer(seen[which].get(did, 0)) if payload else DASH)
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("known_defects_table.tex", "\n".join(lines) + "\n")
