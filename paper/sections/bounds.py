"""results/linear/bounds/bounds_<gpu>.json (`python -m experiments linear-bounds`): the bars of the fused linear as
times, next to released kernels that decode nothing and torch's own 4-bit kernel.

The table puts, per bar, weight and M, the bar's target time, nf4.linear's time, the decode-free control's time and
torch's int4 GEMM's for each GPU, from the result file's `bars` (written by experiments.linear_bounds.bars from the
same run's rows); the macros count the lines nf4.linear meets, those the control meets, those the control meets and
nf4.linear does not (where the gap is nf4's kernel, not Triton or the GPU) and those the int4 GEMM meets; and they
carry bar (a)'s times on the smallest and the largest weight.
"""

from __future__ import annotations

from paper.latex import NM, Document, integer, missing_box, row, shape_tex, tex, us
from paper.sections.linear import GPUS, load_per_gpu

SQUARE = (4096, 4096)  # the smallest weight of the M = 1 bar
UP = (14336, 4096)  # the largest (the MLP's up projection)
CONTROL_LABEL = {"cuBLAS GEMV, the packed bytes' count": "cuBLAS GEMV, same bytes",
                 "Triton dense GEMM (inductor max-autotune)": "Triton dense GEMM"}


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (noted as missing)."""
    data = load_per_gpu(doc, (("bounds", ""),), "linear-bounds", "linear bounds", folder="linear/bounds/")
    return {tag: kinds["bounds"] for tag, kinds in data.items()} if data else None


def lines(payload) -> dict:
    """{(bar, N, K, M): line} of one payload's `bars` (lines that are not dicts, or lack their keys, dropped)."""
    out = {}
    for b in (payload or {}).get("bars") or []:
        if isinstance(b, dict) and all(k in b for k in ("bar", "N", "K", "M")):
            out[(b["bar"], b["N"], b["K"], b["M"])] = b
    return out


def counts(by_key: dict) -> dict:
    """Of a payload's `lines`: those with a verdict for nf4.linear and how many it meets; the same for the control
    (lines that have one) and for the int4 GEMM; and the lines whose control meets the target where nf4.linear does
    not."""
    ls = list(by_key.values())
    judged = [b for b in ls if isinstance(b.get("nf4_meets"), bool)]
    ctrl = [b for b in ls if isinstance(b.get("control_meets"), bool)]
    int4 = [b for b in ls if isinstance(b.get("int4_meets"), bool)]
    return {"lines": len(judged), "nf4_meets": sum(b["nf4_meets"] for b in judged),
            "control_lines": len(ctrl), "control_meets": sum(b["control_meets"] for b in ctrl),
            "gap_ours": sum(1 for b in ctrl if b["control_meets"] and b.get("nf4_meets") is False),
            "int4_lines": len(int4), "int4_meets": sum(b["int4_meets"] for b in int4)}


def _mark(v) -> str:
    return {True: "yes", False: "no"}.get(v, NM)


def build(doc: Document, data: dict | None) -> None:
    data = data if isinstance(data, dict) else {}
    for tag, g, _ in GPUS:
        payload = data.get(tag) or {}
        env = payload.get("env") or {}
        doc.macro(f"NFbndCommit{g}", tex(str(env.get("commit") or "")[:7]) if env.get("commit") else NM)
        doc.macro(f"NFbndTorch{g}", tex(env["torch"]) if env.get("torch") else NM)
        by_key = lines(payload)
        c = counts(by_key) if payload else {}
        for key, name in (("lines", "Lines"), ("nf4_meets", "NfMeets"), ("control_lines", "ControlLines"),
                          ("control_meets", "ControlMeets"), ("gap_ours", "GapOurs"), ("int4_lines", "IntLines"),
                          ("int4_meets", "IntMeets")):
            doc.macro(f"NFbnd{name}{g}", integer(c.get(key)) if payload else NM)
        a = by_key.get(("a", *SQUARE, 1)) or {}
        doc.macro(f"NFbndReadSquare{g}", us(a.get("control_us")))
        doc.macro(f"NFbndTargetSquare{g}", us(a.get("target_us")))
        up = by_key.get(("a", *UP, 1)) or {}
        for key, name in (("target_us", "Target"), ("nf4_us", "Nf"), ("int4_us", "Int"), ("control_us", "Read")):
            doc.macro(f"NFbnd{name}Up{g}", us(up.get(key)))
    doc.macro("NFbndSquare", shape_tex(SQUARE))
    doc.macro("NFbndUp", shape_tex(UP))
    _table(doc, data)


def _table(doc: Document, data: dict) -> None:
    if not data:
        doc.write("linear_bounds_table.tex", missing_box(r"results/linear/bounds/bounds\_<gpu>.json (\texttt{python -m "
                                                         r"experiments linear-bounds})"))
        return
    per = {tag: lines(data.get(tag)) for tag, _, _ in GPUS}
    keys = sorted({k for ls in per.values() for k in ls}, key=lambda k: (k[0], -k[1] * k[2], k[1], k[3]))
    head = ["bar", "weight", "$M$", "control"]
    for _, _, label in GPUS:
        head += [f"{label} target", r"\code{nf4}", "control", "int4", "meets"]
    lines_tex = [r"\begin{tabular}{lllr" + "rrrrl" * len(GPUS) + "}", r"\toprule", row(head), r"\midrule"]
    for key in keys:
        bar, n, k, m = key
        first = next((per[tag][key] for tag, _, _ in GPUS if key in per[tag]), {})
        control = first.get("control")
        cells = [f"({bar})", shape_tex((n, k)), str(m), tex(CONTROL_LABEL.get(control, control or "--"))]
        for tag, _, _ in GPUS:
            b = per[tag].get(key) or {}
            meets = f"{_mark(b.get('nf4_meets'))} / {_mark(b.get('control_meets'))}" if control else \
                _mark(b.get("nf4_meets"))
            cells += [us(b.get("target_us")), us(b.get("nf4_us")), us(b.get("control_us")) if control else "--",
                      us(b.get("int4_us")) if b.get("int4_us") is not None else "--", meets]
        lines_tex.append(row(cells))
    lines_tex += [r"\bottomrule", r"\end{tabular}"]
    doc.write("linear_bounds_table.tex", "\n".join(lines_tex) + "\n")
