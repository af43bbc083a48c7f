"""results/linear/gemv_limit_<gpu>.json (`python -m experiments gemv-limit`): what limits the GEMV at one row of x.

The table puts the production GEMV beside the probe loops cut from it (loads only, decode only, and the loads
taken apart) on the three weights of the M = 1 bars, for each GPU; the macros carry the main loop's instruction
counts and the issue rate of the integer pipe, and the bound they give: the loop's integer-pipe instructions
over the whole weight at the measured rate, nothing else counted.
"""

from __future__ import annotations

from paper.latex import NM, Document, integer, missing_box, num, ratio, row, shape_tex, tex, us
from paper.sections.linear import BAR_SHAPES, GPUS, load_per_gpu

SHAPES = tuple(shape for shape, _ in BAR_SHAPES)
# (part in the result file, row label)
PARTS = (("production", "production (\\code{nf4.linear}, the table's $M{=}1$ row)"),
         ("both", "probe: loads and decode"),
         ("decode", "probe: decode only (weight in registers)"),
         ("loads", "probe: loads only"),
         ("loads, no absmax", "\\quad without the absmax reads"),
         ("loads, no x", "\\quad without $x$'s reads"),
         ("loads, weight words only", "\\quad the weight's words only"),
         ("loads, 16-byte lanes", "\\quad 16-byte lanes"))
# Opcodes of the integer ALU pipe (the pipe of prmt, lop3 and shf, whose rates the probe measures alike).
ALU_OPS = ("PRMT", "LOP3", "SHF", "IADD3", "ISETP", "LEA", "SEL", "VIMNMX", "VIADDMNMX", "VIADD")


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (noted as missing)."""
    data = load_per_gpu(doc, (("gemv_limit", ""),), "gemv-limit", "GEMV limit")
    return {tag: kinds["gemv_limit"] for tag, kinds in data.items()} if data else None


def _times(payload) -> dict:
    return {(r.get("N"), r.get("K"), r.get("part")): r for r in (payload or {}).get("rows") or []
            if isinstance(r, dict)}


def alu_bound_us(payload, shape) -> float | None:
    """The production loop's integer-pipe instructions for the whole weight at the measured prmt rate (us)."""
    sass = (payload or {}).get("sass") or {}
    prod = sass.get("production") or {}
    ops, step = prod.get("loop_opcodes") or {}, prod.get("loop_bytes_per_warp")
    pipes = (payload or {}).get("pipes") or []
    rate = next((p.get("warp_instr_per_ns_per_sm") for p in pipes if p.get("op") == "prmt"), None)
    sms = ((payload or {}).get("env") or {}).get("sm_count")
    if not (ops and step and rate and sms):
        return None
    alu = sum(int(ops.get(op, 0)) for op in ALU_OPS)
    steps = shape[0] * shape[1] / 2 / step
    return steps * alu / (sms * rate) / 1e3


def build(doc: Document, data: dict | None) -> None:
    data = data if isinstance(data, dict) else {}
    for tag, g, _ in GPUS:
        payload = data.get(tag) or {}
        env = payload.get("env") or {}
        doc.macro(f"NFlimDevice{g}", tex(env["device"]) if env.get("device") else NM)
        doc.macro(f"NFlimCommit{g}", tex(str(env.get("commit") or "")[:7]) if env.get("commit") else NM)
        prod = ((payload.get("sass") or {}).get("production")) or {}
        ops = prod.get("loop_opcodes") or {}
        doc.macro(f"NFlimLoopInstr{g}", integer(prod.get("loop_instructions")))
        doc.macro(f"NFlimLoopPrmt{g}", integer(ops.get("PRMT")))
        doc.macro(f"NFlimLoopAlu{g}", integer(sum(int(ops.get(op, 0)) for op in ALU_OPS)) if ops else NM)
        doc.macro(f"NFlimLoopBytes{g}", integer(prod.get("loop_bytes_per_warp")))
        pipes = {p.get("op"): p.get("warp_instr_per_ns_per_sm") for p in payload.get("pipes") or []}
        doc.macro(f"NFlimRatePrmt{g}", num(pipes.get("prmt"), 2))
        doc.macro(f"NFlimRateFmul{g}", num(pipes.get("fmul"), 2))
        times = _times(payload)
        shape = SHAPES[0]
        bound = alu_bound_us(payload, shape)
        doc.macro(f"NFlimAluBound{g}", us(bound))
        floor = (times.get((*shape, "production")) or {}).get("byte_floor_us")
        doc.macro(f"NFlimFloor{g}", us(floor))
        doc.macro(f"NFlimAluBoundOverFloor{g}", ratio(bound / floor) if bound and floor else NM)
        for part, name in (("production", "Production"), ("decode", "Decode"), ("loads", "Loads"),
                           ("loads, no x", "LoadsNoX"), ("loads, weight words only", "LoadsWords")):
            doc.macro(f"NFlim{name}{g}", us((times.get((*shape, part)) or {}).get("graph_us")))
    _table(doc, data)


def _table(doc: Document, data: dict) -> None:
    if not data:
        doc.write("linear_limit_table.tex", missing_box(r"results/linear/gemv\_limit\_<gpu>.json (\texttt{python -m "
                                                        r"experiments gemv-limit})"))
        return
    times = {tag: _times(data.get(tag)) for tag, _, _ in GPUS}
    cols = [(tag, shape) for shape in SHAPES for tag, _, _ in GPUS]
    head = [""] + [f"{shape_tex(shape)} {label}" for shape in SHAPES for _, _, label in GPUS]
    lines = [r"\begin{tabular}{l" + "r" * len(cols) + "}", r"\toprule", row(head), r"\midrule"]
    floors = [(times[tag].get((*shape, "production")) or {}).get("byte_floor_us") for tag, shape in cols]
    lines.append(row(["byte floor"] + [us(f) for f in floors]))
    lines.append(row(["integer-pipe bound of the production loop"]
                     + [us(alu_bound_us(data.get(tag), shape)) for tag, shape in cols]))
    lines.append(r"\midrule")
    for part, label in PARTS:
        lines.append(row([label] + [us((times[tag].get((*shape, part)) or {}).get("graph_us")) for tag, shape in cols]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("linear_limit_table.tex", "\n".join(lines) + "\n")
