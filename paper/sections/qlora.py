"""results/qlora_<gpu>.json (`python -m experiments qlora`): the QLoRA train step and decode, end to end.

The table puts, per GPU, each mode's speedup over bitsandbytes alone on every train shape and in decode, with its
exactness against bitsandbytes alone (or "bound" for the two modes that time a bound, not an implementation); the
macros carry the end-to-end bars of the fused linear (the train step at 1x512 and decode) with the best of nf4's
own modes, and the bounds beside them: `no_matmul` (the 4-bit matmul at zero device time) and `dense` (a free
dequantize and cuBLAS's matmuls). The bars are constants, evaluated here from the rows.
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, num, pct, ratio, row, tex
from paper.sections.linear import GPUS, load_per_gpu

STEP_SHAPE, STEP_FACTOR, DECODE_FACTOR = "1x512", 1.15, 2.0
OURS = ("nf4", "nf4_fused")  # nf4's modes; the others are a peer (unsloth) or bounds
# (mode, row label) in the table's order
MODES = (("nf4", r"\code{nf4.patched\_bitsandbytes()}"),
         ("nf4_fused", r"\quad \code{fused\_linear=True}"),
         ("unsloth", r"Unsloth's override"),
         ("no_matmul", r"bound: the 4-bit matmul at zero device time"),
         ("dense", r"bound: a free dequantize, cuBLAS's matmuls"))


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (each missing file noted)."""
    data = load_per_gpu(doc, (("qlora", " QLoRA step and decode"),), "qlora", "QLoRA table", folder="")
    return {tag: kinds["qlora"] for tag, kinds in data.items()} if data else None


def _step_row(payload: dict) -> dict:
    """The STEP_SHAPE row of a payload that ran ({} where none did)."""
    return next((r for r in payload.get("rows") or [] if isinstance(r, dict) and r.get("shape") == STEP_SHAPE
                 and "error" not in r), {})


def _modes(entry: dict, exact_key: str) -> dict:
    """{mode: (speedup over bitsandbytes alone, exact (True / False / None), bound)} of one train row
    (exact_key "bitexact_vs_bnb") or decode entry ("tokens_identical"); nf4's own numbers sit at the top level."""
    if not isinstance(entry, dict) or "error" in entry:
        return {}
    out = {"nf4": (entry.get("speedup"), entry.get(exact_key), False)}
    for mode, st in (entry.get("modes") or {}).items():
        if mode != "nf4" and isinstance(st, dict):
            out[mode] = (st.get("speedup"), st.get(exact_key), bool(st.get("bound")))
    return out


def _train(payload: dict) -> dict:
    return {r.get("shape"): _modes(r, "bitexact_vs_bnb") for r in payload.get("rows") or [] if isinstance(r, dict)}


def _decode(payload: dict) -> dict:
    entries = [d for d in payload.get("decode") or [] if isinstance(d, dict)]
    return _modes(entries[0], "tokens_identical") if entries else {}


def _best(modes: dict):
    """(speedup, mode) of nf4's fastest own mode, or None."""
    found = [(modes[m][0], m) for m in OURS if m in modes and modes[m][0] is not None]
    return max(found) if found else None


def _shape(text: str) -> str:
    """'1x512' -> 1$\\times$512 (batch x sequence length)."""
    return r"$\times$".join(tex(part) for part in str(text).split("x"))


def _cell(value) -> str:
    if not value or value[0] is None:
        return NM
    speedup, exact, bound = value
    note = "bound" if bound else {True: "exact", False: "not exact", None: "n/a"}[exact]
    return rf"{ratio(speedup)}$\times$ ({note})"


def build(doc: Document, data: dict | None) -> None:
    data = data if isinstance(data, dict) else {}
    doc.macro("NFqloraStepShape", _shape(STEP_SHAPE))
    doc.macro("NFqloraStepFactor", f"{STEP_FACTOR:g}")
    doc.macro("NFqloraDecodeFactor", f"{DECODE_FACTOR:g}")
    for tag, g, _ in GPUS:
        payload = data.get(tag) or {}
        env = payload.get("env") or {}
        doc.macro(f"NFqloraCommit{g}", tex(str(env.get("commit") or "")[:7]) if env.get("commit") else NM)
        step_row = _step_row(payload)
        kernel, ms = step_row.get("bnb_kernel_ms"), step_row.get("bnb_ms")
        doc.macro(f"NFqloraStepBnbMs{g}", num(ms, 1))
        doc.macro(f"NFqloraStepBnbKernelMs{g}", num(kernel, 1))
        doc.macro(f"NFqloraStepBnbKernelPct{g}", pct(100 * kernel / ms) if kernel and ms else NM)
        step, decode = _train(payload).get(STEP_SHAPE) or {}, _decode(payload)
        bnb = step_row.get("bnb")
        steps = bnb.get("n") if isinstance(bnb, dict) else None
        doc.macro(f"NFqloraSteps{g}", str(steps) if isinstance(steps, int) else NM)
        doc.macro(f"NFqloraStepPlain{g}", ratio((step.get("nf4") or (None,))[0]))
        for name, modes, factor in (("Step", step, STEP_FACTOR), ("Decode", decode, DECODE_FACTOR)):
            best = _best(modes)
            doc.macro(f"NFqloraBar{name}{g}", NM if best is None else ("met" if best[0] >= factor else "missed"))
            doc.macro(f"NFqloraBar{name}Value{g}", ratio(best[0]) if best else NM)
            doc.macro(f"NFqloraBar{name}Mode{g}", tex(best[1]) if best else NM)
            for mode, stem in (("no_matmul", "NoMatmul"), ("dense", "Dense")):
                doc.macro(f"NFqlora{name}{stem}{g}", ratio((modes.get(mode) or (None,))[0]))
    _table(doc, data)


def _table(doc: Document, data: dict) -> None:
    shown = [(tag, label) for tag, _, label in GPUS if data.get(tag)]
    if not shown:
        doc.write("qlora_table.tex", missing_box(r"results/qlora\_<gpu>.json (\texttt{python -m experiments qlora} "
                                                 r"on a GPU)"))
        return
    trains = {tag: _train(data[tag]) for tag, _ in shown}
    decodes = {tag: _decode(data[tag]) for tag, _ in shown}
    shapes = [s for s in dict.fromkeys(s for tag, _ in shown for s in trains[tag]) if s]
    lines = [r"\begin{tabular}{@{}ll" + "r" * len(shown) + "@{}}", r"\toprule",
             " & mode & " + " & ".join(tex(label) for _, label in shown) + r" \\", r"\midrule"]
    for what, per_gpu in [(f"train {_shape(s)}", {tag: trains[tag].get(s) or {} for tag, _ in shown})
                          for s in shapes] + [("decode", decodes)]:
        first = True
        for mode, label in MODES:
            if not any(mode in per_gpu[tag] for tag, _ in shown):
                continue
            cells = [what if first else "", label]
            cells += [_cell(per_gpu[tag].get(mode)) for tag, _ in shown]
            lines.append(row(cells))
            first = False
        lines.append(r"\addlinespace")
    lines[-1:] = [r"\bottomrule", r"\end{tabular}"]
    doc.write("qlora_table.tex", "\n".join(lines) + "\n")
