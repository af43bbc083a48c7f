"""results/linear/host_<gpu>.json (`python -m experiments linear-host`): one 4-bit linear's host time, as a QLoRA step
calls it.

The table puts, per GPU, at M = 512 rows of x on each weight measured, the host time per call of each form (a bare
F.linear; Linear4bit.forward under bitsandbytes alone, nf4 patched, the fused route and the two bounds) in two
phases, the forward with grad and forward + backward to x, as a multiple of the empty Triton JIT launch timed in
alternating batches beside it (the host's speed drifts within a run, so only paired ratios compare). The macros
carry, for the step phase, the fused route's ratio to the dense bound and to bitsandbytes alone on the largest
weight.
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, num, ratio, row, tex
from paper.sections.linear import GPUS, load_per_gpu

M = 512
PHASES = (("forward", "fwd"), ("step", "fwd + bwd"))
# (form, row label) in the table's order
FORMS = (("F.linear", r"bare \code{F.linear}"),
         ("bnb", "bitsandbytes alone"),
         ("nf4", r"\code{nf4.patched\_bitsandbytes()}"),
         ("nf4_fused", r"\quad \code{fused\_linear=True}"),
         ("dense", r"bound: dense"),
         ("no_matmul", r"bound: \code{no\_matmul}"))


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (each missing file noted)."""
    data = load_per_gpu(doc, (("host", " host time per linear"),), "linear-host", "linear host table")
    return {tag: kinds["host"] for tag, kinds in data.items()} if data else None


def timed(payload: dict) -> dict:
    """{(N, K, M, phase, form): (host us, host time / the paired empty JIT launch)} of a payload's timed rows."""
    out = {}
    for r in payload.get("rows") or []:
        if not isinstance(r, dict) or "error" in r or not r.get("jit_host_us") or r.get("host_us") is None:
            continue
        out[(r.get("N"), r.get("K"), r.get("M"), r.get("phase"), r.get("form"))] = (r["host_us"],
                                                                                    r["host_us"] / r["jit_host_us"])
    return out


def jit_units(payload: dict) -> dict:
    """{(N, K, M, phase, form): host time / the paired empty JIT launch} of a payload's timed rows."""
    return {key: units for key, (_, units) in timed(payload).items()}


def _weights(data: dict) -> list[tuple[int, int]]:
    found = {(r.get("N"), r.get("K")) for p in data.values() for r in p.get("rows") or []
             if isinstance(r, dict) and r.get("M") == M}
    return sorted((w for w in found if None not in w), key=lambda w: (-w[0] * w[1], w))


def build(doc: Document, data: dict | None) -> None:
    data = data if isinstance(data, dict) else {}
    doc.macro("NFlinHostM", str(M))
    weights = _weights(data)
    big = weights[0] if weights else None
    doc.macro("NFlinHostWeight", rf"{big[0]}$\times${big[1]}" if big else NM)
    for tag, g, _ in GPUS:
        units = jit_units(data.get(tag) or {})
        fused = units.get((*big, M, "step", "nf4_fused")) if big else None
        for form, stem in (("dense", "Dense"), ("bnb", "Bnb")):
            other = units.get((*big, M, "step", form)) if big else None
            doc.macro(f"NFlinHostStepFusedOver{stem}{g}", ratio(fused / other) if fused and other else NM)
        doc.macro(f"NFlinHostCommit{g}", tex(str(((data.get(tag) or {}).get("env") or {}).get("commit") or "")[:7])
                  if data.get(tag) else NM)
    _table(doc, data, weights)


def _table(doc: Document, data: dict, weights) -> None:
    shown = [(tag, label) for tag, _, label in GPUS if data.get(tag)]
    if not shown or not weights:
        doc.write("linear_host_table.tex", missing_box(r"results/linear/host\_<gpu>.json (\texttt{python -m "
                                                       r"experiments linear-host} on a GPU)"))
        return
    rows = {tag: timed(data[tag]) for tag, _ in shown}
    cols = [(tag, phase) for tag, _ in shown for phase, _ in PHASES]
    lines = [r"\begin{tabular}{@{}ll" + "r" * len(cols) + "@{}}", r"\toprule",
             " & & " + " & ".join(rf"\multicolumn{{{len(PHASES)}}}{{c}}{{{tex(label)}}}" for _, label in shown)
             + r" \\",
             "weight & form & " + " & ".join(short for _ in shown for _, short in PHASES) + r" \\", r"\midrule"]
    for n, k in weights:
        first = True
        for form, label in FORMS:
            cells = [rf"{n}$\times${k}" if first else "", label]
            for tag, phase in cols:
                h_u = rows[tag].get((n, k, M, phase, form))
                cells.append(f"{num(h_u[0], 0)} ({num(h_u[1], 1)})" if h_u else NM)
            lines.append(row(cells))
            first = False
        lines.append(r"\addlinespace")
    lines[-1:] = [r"\bottomrule", r"\end{tabular}"]
    doc.write("linear_host_table.tex", "\n".join(lines) + "\n")
