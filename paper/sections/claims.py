"""paper/published_claims.json: what other people report, quoted with its source."""

from __future__ import annotations

import json
from pathlib import Path

from paper.latex import NM, Document, integer, missing_box, tex


def build(doc: Document, path: Path | None) -> None:
    """The table of what others report (paper/published_claims.json), quoted, never measured here."""
    if path is None or not Path(path).exists():
        doc.macro("NFclaimsCount", NM)
        doc.write("claims_table.tex", missing_box("paper/published\\_claims.json"))
        return
    raw = Path(path).read_bytes()
    claims = json.loads(raw)
    doc.record("paper/published_claims.json", raw, "quoted claims", None)
    doc.macro("NFclaimsCount", integer(len(claims)))
    rag = r">{\raggedright\arraybackslash}p"
    spec = " ".join(rag + "{" + w + "}" for w in ("2.3cm", "2.6cm", "1.6cm", "3.9cm", "3.6cm"))
    lines = [rf"\begin{{tabular}}{{@{{}}{spec}@{{}}}}", r"\toprule",
             r"source & what & GPU & claimed (their words, their clock) & exactness, as stated \\", r"\midrule"]
    for c in claims:
        lines.append(" & ".join([rf"\citet{{{c['key']}}}", tex(c["what"]), tex(c["gpu"]), tex(c["claim"]),
                                 tex(c["exactness"])]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("claims_table.tex", "\n".join(lines) + "\n")
