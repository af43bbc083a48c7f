"""results/linear/gemm_limit_<gpu>.json (`python -m experiments gemm-limit`): what limits the word tl.dot kernel.

The table puts, per GPU and M, the production kernel (the word GEMM config the table runs or its sweeps ran at that
M) beside the probe loops cut from it and the cuBLAS references, on the largest weight of the bars; the macros carry
the costs the probes separate at one M (SHOWN_M): the wgmma serialization that ptxas chose for the loop as it was
(with the production's 16-bit store; its reason as ptxas gives it) and that the loop said nonempty removes, the prmt
decode, what Triton's tl.dot loop reaches on a dense operand against cuBLAS, the main loop's instruction counts per
step, and the production's gain over nf4.dequantize + cuBLAS at GAIN_M.
"""

from __future__ import annotations

from paper.latex import NM, Document, integer, missing_box, ratio, row, shape_tex, tex, us
from paper.sections.linear import GPUS, MID_FACTOR, load_per_gpu

SHAPE = (14336, 4096)
SHOWN_M = 512
GAIN_M = 256  # the M of bar (c) where the table runs the word GEMM on SHAPE
OLD_STORE = "probe: lookup, production's store"  # the loop as it was before its tl.assume, the production's store
FIXED_STORE = "probe: lookup, production's store, loop said nonempty"
DENSE_FIXED = "probe: dense operand, loop said nonempty"
# (part in the result file, row label)
PARTS = (("production", r"production (\code{nf4.linear}, the word GEMM config)"),
         ("probe: lookup", "probe: the production loop, float32 store"),
         (OLD_STORE, r"\quad 16-bit store, the loop as it was"),
         (FIXED_STORE, r"\quad 16-bit store, the loop said nonempty"),
         ("probe: lookup, rounded, stored as float32", r"\quad rounded, stored as float32"),
         ("probe: no lookup", "probe: no lookup (bit operations instead)"),
         ("probe: dense operand", "probe: the same loop on the bfloat16 weight"),
         (DENSE_FIXED, r"\quad the loop said nonempty"),
         ("cuBLAS", "cuBLAS on the bfloat16 weight"),
         ("nf4.dequantize + cuBLAS", r"\code{nf4.dequantize} + cuBLAS"))


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (noted as missing)."""
    data = load_per_gpu(doc, (("gemm_limit", ""),), "gemm-limit", "GEMM limit")
    return {tag: kinds["gemm_limit"] for tag, kinds in data.items()} if data else None


def times(payload) -> dict:
    """{(N, K, M, part): graph us} of one payload's rows."""
    return {(r.get("N"), r.get("K"), r.get("M"), r.get("part")): r.get("graph_us")
            for r in (payload or {}).get("rows") or [] if isinstance(r, dict)}


def ms_of(data: dict) -> list[int]:
    """The M values measured on SHAPE on any GPU, ascending."""
    found = {key[2] for tag, _, _ in GPUS for key in times(data.get(tag)) if key[:2] == SHAPE}
    return sorted(m for m in found if isinstance(m, int))


def most_pending(waits) -> int | None:
    """The most wgmma groups any of a kernel's waits leaves pending (0: every wait drains them, the wgmma run one
    after another), from a sass entry's `wgmma_waits`; None where the entry has none."""
    if not isinstance(waits, dict) or not waits:
        return None
    return max(int(k) for k in waits)


def _quotient(t: dict, m: int, num_part: str, den_part: str):
    a, b = t.get((*SHAPE, m, num_part)), t.get((*SHAPE, m, den_part))
    return a / b if a and b else None


def build(doc: Document, data: dict | None) -> None:
    data = data if isinstance(data, dict) else {}
    doc.macro("NFglimShape", shape_tex(SHAPE))
    doc.macro("NFglimM", str(SHOWN_M))
    doc.macro("NFglimGainM", str(GAIN_M))
    for tag, g, _ in GPUS:
        payload = data.get(tag) or {}
        env = payload.get("env") or {}
        doc.macro(f"NFglimCommit{g}", tex(str(env.get("commit") or "")[:7]) if env.get("commit") else NM)
        t = times(payload)
        for part, name in (("production", "Production"), ("probe: lookup", "Lookup"),
                           ("probe: no lookup", "NoLookup"), ("probe: dense operand", "Dense"),
                           ("cuBLAS", "Cublas"), ("nf4.dequantize + cuBLAS", "DequantCublas")):
            doc.macro(f"NFglim{name}{g}", us(t.get((*SHAPE, SHOWN_M, part))))
        for name, num_part, den_part in (("StoreCost", OLD_STORE, "probe: lookup"),
                                         ("SerialCost", OLD_STORE, FIXED_STORE),
                                         ("FixedOverLookup", FIXED_STORE, "probe: lookup"),
                                         ("DecodeCost", "probe: lookup", "probe: no lookup"),
                                         ("DenseOverCublas", DENSE_FIXED, "cuBLAS"),
                                         ("LookupOverDequant", "probe: lookup", "nf4.dequantize + cuBLAS"),
                                         ("NoLookupOverDequant", "probe: no lookup", "nf4.dequantize + cuBLAS")):
            q = _quotient(t, SHOWN_M, num_part, den_part)
            doc.macro(f"NFglim{name}{g}", ratio(q) if q else NM)
        gain = _quotient(t, GAIN_M, "nf4.dequantize + cuBLAS", "production")
        doc.macro(f"NFglimGain{g}", ratio(gain) if gain else NM)
        doc.macro(f"NFglimGainProduction{g}", us(t.get((*SHAPE, GAIN_M, "production"))))
        doc.macro(f"NFglimGainDequant{g}", us(t.get((*SHAPE, GAIN_M, "nf4.dequantize + cuBLAS"))))
        dequant = t.get((*SHAPE, SHOWN_M, "nf4.dequantize + cuBLAS"))
        # bar (c): MID_FACTOR times faster than nf4.dequantize + cuBLAS, i.e. at most this device time
        doc.macro(f"NFglimBarTime{g}", us(dequant / MID_FACTOR) if dequant else NM)
        sass = [s for s in payload.get("sass") or [] if isinstance(s, dict)]
        s256 = next((s for s in sass if s.get("M") == 256), sass[0] if sass else {})
        for part, name in (("production", "Production"), ("probe: no lookup", "NoLookup"),
                           ("probe: dense operand", "Dense")):
            doc.macro(f"NFglimLoop{name}{g}", integer((s256.get(part) or {}).get("loop_instructions")))
        for part, name in (("production", "Production"), ("probe: lookup", "Lookup"), (OLD_STORE, "OldStore"),
                           ("probe: dense operand", "Dense"), (DENSE_FIXED, "DenseFixed")):
            doc.macro(f"NFglimPending{name}{g}", integer(most_pending((s256.get(part) or {}).get("wgmma_waits"))))
        reason = (s256.get(OLD_STORE) or {}).get("wgmma_serialized")
        doc.macro(f"NFglimSerialReason{g}", tex(reason) if isinstance(reason, str) and reason else NM)
    _table(doc, data)


def _table(doc: Document, data: dict) -> None:
    if not data:
        doc.write("gemm_limit_table.tex", missing_box(r"results/linear/gemm\_limit\_<gpu>.json (\texttt{python -m "
                                                      r"experiments gemm-limit})"))
        return
    ms = ms_of(data)
    t = {tag: times(data.get(tag)) for tag, _, _ in GPUS}
    cols = [(tag, m) for tag, _, _ in GPUS for m in ms]
    head = [""] + [f"{label} $M{{=}}{m}$" for _, _, label in GPUS for m in ms]
    lines = [r"\begin{tabular}{l" + "r" * len(cols) + "}", r"\toprule", row(head), r"\midrule"]
    for part, label in PARTS:
        lines.append(row([label] + [us(t[tag].get((*SHAPE, m, part))) for tag, m in cols]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("gemm_limit_table.tex", "\n".join(lines) + "\n")
