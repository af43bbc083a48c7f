"""results/qlora_<gpu>.json (`python -m experiments qlora`): the QLoRA train step and decode, end to end.

The table puts, per GPU, each mode's speedup over bitsandbytes alone on every train shape and in decode, with its
exactness against bitsandbytes alone (or "bound" for the two modes that time a bound, not an implementation); the
macros carry the end-to-end bars of the fused linear (the train step at 1x512 and decode) with the best of nf4's
own modes, and the bounds beside them: `no_matmul` (the 4-bit matmul at zero device time) and `dense` (a free
dequantize and cuBLAS's matmuls). The bars are constants, evaluated here from the rows.

results/qlora_runs/qlora_1x512_<gpu>_r<i>.json (the same command at 1x512 only, repeated at one commit) give the
run-to-run spread of the step bar: the smallest, median and largest speedup of each of nf4's modes over those runs,
and in how many the fused route reached the bar; results/qlora_runs/qlora_1x512_s40_<gpu>_r<i>.json, runs with 40
timed steps per mode (against 10 in the first repeats), the same statistics (and the dense bound's);
results/qlora_runs/qlora_1x512_s100_<gpu>_r<i>.json, runs with 100 timed steps at the current code, the same
statistics and the bar judged by every run, beside the runs of the code before it (qlora_1x512_s100_<gpu>_<commit>_
r<i>.json) made in the same device calls.
"""

from __future__ import annotations

import statistics

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


RUNS = "qlora_runs"  # results/qlora_runs/qlora_1x512_<gpu>_r<i>.json: repeated runs at STEP_SHAPE
LONG = "s40"  # results/qlora_runs/qlora_1x512_s40_<gpu>_r<i>.json: runs of STEP_SHAPE with 40 timed steps a mode
# results/qlora_runs/qlora_1x512_s100_<gpu>_r<i>.json: runs with 100 timed steps a mode at the current code, and
# ..._s100_<gpu>_<commit>_r<i>.json: runs of an earlier commit's code made in the same device calls (a before/after)
LONGER = "s100"


def load(doc: Document) -> dict | None:
    """{gpu tag: payload} for the files present, or None (each missing file noted); each GPU's repeated runs under
    "<tag>_runs", its 40-step runs under "<tag>_long", its 100-step runs under "<tag>_longer" and the earlier
    commit's 100-step runs under "<tag>_before" (lists, empty when there are none)."""
    data = load_per_gpu(doc, (("qlora", " QLoRA step and decode"),), "qlora", "QLoRA table", folder="")
    out = {tag: kinds["qlora"] for tag, kinds in data.items()} if data else {}
    for tag, _, label in GPUS:
        for key, pattern, what in (
                ("runs", f"qlora_{STEP_SHAPE}_{tag}_r*.json", "QLoRA spread"),
                ("long", f"qlora_{STEP_SHAPE}_{LONG}_{tag}_r*.json", "QLoRA 40-step runs"),
                ("longer", f"qlora_{STEP_SHAPE}_{LONGER}_{tag}_r*.json", "QLoRA 100-step runs"),
                ("before", f"qlora_{STEP_SHAPE}_{LONGER}_{tag}_*_r*.json", "QLoRA 100-step runs")):
            out[f"{tag}_{key}"] = _load_runs(doc, pattern, f"{what}, {label}")
    return out or None


def _load_runs(doc: Document, pattern: str, required_for: str) -> list:
    """The payloads of results/qlora_runs/ files matching `pattern`, in name order (unreadable ones left out)."""
    folder = doc.results / RUNS
    names = sorted(p.name for p in folder.glob(pattern)) if folder.is_dir() else []
    runs = [doc.load(f"{RUNS}/{name}", label="experiments qlora", required_for=required_for) for name in names]
    return [r for r in runs if isinstance(r, dict)]


def run_spread(runs: list, modes=OURS) -> dict:
    """{mode: sorted speedups at STEP_SHAPE} of `modes` over repeated runs, and "commits": their commits."""
    spread: dict = {mode: [] for mode in modes}
    commits = set()
    for payload in runs:
        found = _train(payload).get(STEP_SHAPE) or {}
        for mode in modes:
            if mode in found and found[mode][0] is not None:
                spread[mode].append(found[mode][0])
        commits.add(str((payload.get("env") or {}).get("commit") or "")[:7])
    return {**{mode: sorted(v) for mode, v in spread.items()}, "commits": sorted(c for c in commits if c)}


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
        for name, modes, factor in (("Step", step, STEP_FACTOR), ("Decode", decode, DECODE_FACTOR)):
            best = _best(modes)
            doc.macro(f"NFqloraBar{name}{g}", NM if best is None else ("met" if best[0] >= factor else "missed"))
            doc.macro(f"NFqloraBar{name}Value{g}", ratio(best[0]) if best else NM)
            doc.macro(f"NFqloraBar{name}Mode{g}", tex(best[1]) if best else NM)
            for mode, stem in (("no_matmul", "NoMatmul"), ("dense", "Dense")):
                doc.macro(f"NFqlora{name}{stem}{g}", ratio((modes.get(mode) or (None,))[0]))
        _spread_macros(doc, "NFqloraRuns", g, data.get(f"{tag}_runs") or [])
        _long_macros(doc, g, data.get(f"{tag}_long") or [])
        _longer_macros(doc, g, data.get(f"{tag}_longer") or [], data.get(f"{tag}_before") or [])
    _table(doc, data)


WITH_DENSE = (("nf4_fused", "Fused"), ("nf4", "Plain"), ("dense", "Dense"))  # the longer runs' modes


def _steps_macro(doc: Document, name: str, runs: list) -> None:
    """`name`: the timed steps per mode of the runs ("40", or "40/100" where they differ)."""
    steps = sorted({(_step_row(p).get("bnb") or {}).get("n") for p in runs} - {None})
    doc.macro(name, "/".join(str(v) for v in steps) if steps else NM)


def _long_macros(doc: Document, g: str, runs: list) -> None:
    """The runs of STEP_SHAPE with more timed steps: `_spread_macros`' statistics (the dense bound's too), the timed
    steps per mode, and the bar judged by the fused route's median."""
    fused = _spread_macros(doc, "NFqloraLong", g, runs, WITH_DENSE)
    _steps_macro(doc, f"NFqloraLongSteps{g}", runs)
    doc.macro(f"NFqloraLongBarMedian{g}", NM if not fused else
              ("met" if statistics.median(fused) >= STEP_FACTOR else "missed"))


def _longer_macros(doc: Document, g: str, runs: list, before: list) -> None:
    """The 100-step runs: `_long_macros`' statistics under NFqloraLonger (the bar judged by every run, not by their
    median: met when the smallest speedup reaches it) and the fused route's spread in the earlier commit's runs
    made alongside them (NFqloraBefore)."""
    fused = _spread_macros(doc, "NFqloraLonger", g, runs, WITH_DENSE)
    _steps_macro(doc, f"NFqloraLongerSteps{g}", runs)
    doc.macro(f"NFqloraLongerBarEvery{g}", NM if not fused else ("met" if fused[0] >= STEP_FACTOR else "missed"))
    _spread_macros(doc, "NFqloraBefore", g, before)


def _spread_macros(doc: Document, prefix: str, g: str, runs: list,
                   modes=(("nf4_fused", "Fused"), ("nf4", "Plain"))) -> list:
    """<prefix><g> (the number of runs), their commits, each mode's smallest, median and largest speedup at
    STEP_SHAPE, and how many runs the fused route took to the bar; returns the fused route's sorted speedups."""
    spread = run_spread(runs, tuple(mode for mode, _ in modes))
    doc.macro(f"{prefix}{g}", str(len(runs)) if runs else NM)
    doc.macro(f"{prefix}Commit{g}", tex(", ".join(spread["commits"])) if spread["commits"] else NM)
    for mode, stem in modes:
        values = spread[mode]
        doc.macro(f"{prefix}{stem}Min{g}", ratio(values[0]) if values else NM)
        doc.macro(f"{prefix}{stem}Median{g}", ratio(statistics.median(values)) if values else NM)
        doc.macro(f"{prefix}{stem}Max{g}", ratio(values[-1]) if values else NM)
    fused = spread["nf4_fused"]
    doc.macro(f"{prefix}FusedAtBar{g}", str(sum(v >= STEP_FACTOR for v in fused)) if fused else NM)
    return fused


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
