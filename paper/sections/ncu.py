"""results/linear/ncu/ (Nsight Compute's text reports of nf4.linear's kernels) and results/linear/tuning/
sweep_wkreg_<gpu>.json (`experiments bench-linear --sweep-paths mma-wk mma-wk-reg`): what the hardware counters say
limits the M = 1 GEMV and the M = 128 word GEMM, and what capping the GEMV's registers did.

The reports are ncu's own output, one kernel launch each (results/linear/ncu/README.md gives the commands, the
device and the commits): `ncu_<gpu>_<N>x<K>_M<M>.txt` with the launch, occupancy, speed-of-light and scheduler
sections, `ncu_stalls_<gpu>_<N>x<K>_M<M>.txt` with the warp-stall reasons per issued instruction. The section reads
the numbers out of the text; a report that is absent or lacks a metric reads as not measured. The "selected" state
(the warp issuing) is not a stall and is left out of the reasons.
"""

from __future__ import annotations

import re
from pathlib import Path

from paper.latex import NM, Document, missing_box, num, pct, ratio, row, shape_tex, tex, us

# (N, K, M, kernel) in the table's order, and the macro stem of each
CASES = (((14336, 4096, 1), "nf4\\_gemv\\_mma\\_kernel", "GemvTall"),
         ((4096, 14336, 1), "nf4\\_gemv\\_mma\\_kernel", "GemvWide"),
         ((14336, 4096, 128), "nf4\\_gemm\\_word\\_kernel", "WordGemm"))
# (metric name in ncu's tables, row label, formatter)
METRICS = (("Duration", "duration under ncu (\\textmu s)", us),
           ("Registers Per Thread", "registers per thread", lambda v: num(v, 0)),
           ("Block Limit Registers", "programs per multiprocessor (register limit)", lambda v: num(v, 0)),
           ("Waves Per SM", "waves of programs", lambda v: num(v, 2)),
           ("Achieved Occupancy", "achieved occupancy (\\%)", pct),
           ("DRAM Throughput", "DRAM throughput (\\% of peak)", pct),
           ("Issue Slots Busy", "issue slots busy (\\%)", pct),
           ("Warp Cycles Per Issued Instruction", "warp cycles per issued instruction", lambda v: num(v, 2)))
FORMAT = {key: fmt for key, _, fmt in METRICS}
# (macro name part, metric name): the macros per kernel, formatted as the table formats them
MACROS = (("Regs", "Registers Per Thread"), ("PerSm", "Block Limit Registers"), ("Waves", "Waves Per SM"),
          ("Occupancy", "Achieved Occupancy"), ("Dram", "DRAM Throughput"), ("IssueBusy", "Issue Slots Busy"))
STALL = re.compile(r"smsp__average_warps_issue_stalled_([a-z_]+?)_per_issue_active\.ratio\s+\S+\s+([-\d.,]+)")
GRID = re.compile(r"^\s+(\w+) \((\d+), 1, 1\)x\((\d+), 1, 1\)", re.M)
GPU_TAG = "h100"  # the reports were taken on the H100 (ncu reads the counters on its machines)


def metric(text: str, name: str) -> float | None:
    """The value of a metric row `name` in an ncu text report (the last column), or None."""
    m = re.search(rf"^\s+{re.escape(name)}\s+(?:\S+\s+)?([-\d.,]+)\s*$", text, re.M)
    return float(m.group(1).replace(",", "")) if m else None


def stalls(text: str) -> dict[str, float]:
    """{stall reason: warps stalled per issued instruction} from the report's stall metrics."""
    return {reason: float(value.replace(",", "")) for reason, value in STALL.findall(text) if reason != "selected"}


def launch(text: str) -> tuple[str, int, int] | None:
    """(kernel name, programs, threads per program) of the report's profiled launch, or None."""
    m = GRID.search(text)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def top_stalls(text: str) -> list[tuple[str, float]]:
    """The report's three largest stall reasons, largest first."""
    return sorted(stalls(text).items(), key=lambda kv: -kv[1])[:3]


def load(doc: Document) -> dict:
    """{(N, K, M): {"report": text, "stalls": text}} for the reports present, recorded in the provenance."""
    found: dict = {}
    for (n, k, m), _, _ in CASES:
        for kind, stalls_report in (("report", False), ("stalls", True)):
            path = report_path(doc.results, n, k, m, stalls_report)
            if path.exists():
                raw = path.read_bytes()
                doc.record(f"results/linear/ncu/{path.name}", raw, "ncu report", None)
                found.setdefault((n, k, m), {})[kind] = raw.decode(errors="replace")
    if not found:
        doc.missing.append("results/linear/ncu/ncu_<gpu>_<N>x<K>_M<M>.txt (ncu on a GPU)")
    return found


def load_sweep(doc: Document) -> dict:
    """{gpu tag: results/linear/tuning/sweep_wkreg_<gpu>.json} for the files present."""
    out = {}
    for tag in ("h100", "h200"):
        if (doc.results / "linear" / "tuning" / f"sweep_wkreg_{tag}.json").exists():
            out[tag] = doc.load(f"linear/tuning/sweep_wkreg_{tag}.json", label="bench-linear mma-wk sweep",
                                required_for="register cap")
    return out


def cap_cost(payload) -> tuple[float, float] | None:
    """(smallest, largest) over the swept weights at M = 1 of: the best 64-register config's time over the best
    uncapped config's, from one sweep file (operand-exact rows only)."""
    best: dict = {}
    for r in (payload or {}).get("rows") or []:
        if not isinstance(r, dict) or r.get("M") != 1 or r.get("operand_mismatches") != 0 or not r.get("graph_us"):
            continue
        capped = bool((r.get("config") or {}).get("maxnreg"))
        key = (r.get("N"), r.get("K"), capped)
        best[key] = min(best.get(key, float("inf")), float(r["graph_us"]))
    ratios = [best[(n, k, True)] / best[(n, k, False)] for (n, k, capped) in best
              if capped and (n, k, False) in best]
    return (min(ratios), max(ratios)) if ratios else None


def build(doc: Document, data: dict | None, sweeps: dict | None = None) -> None:
    data = data if isinstance(data, dict) else {}
    for (n, k, m), _, stem in CASES:
        texts = data.get((n, k, m)) or {}
        report = texts.get("report") or ""
        for name, key in MACROS:
            doc.macro(f"NFncu{stem}{name}", FORMAT[key](metric(report, key)))
        found = launch(report)
        doc.macro(f"NFncu{stem}Programs", str(found[1]) if found else NM)
        top = top_stalls(texts.get("stalls") or "")
        for i, word in enumerate(("First", "Second", "Third")):
            reason, value = top[i] if i < len(top) else (None, None)
            doc.macro(f"NFncu{stem}Stall{word}", tex(reason.replace("_", " ")) if reason else NM)
            doc.macro(f"NFncu{stem}Stall{word}Value", num(value, 2) if reason else NM)
    sweeps = sweeps if isinstance(sweeps, dict) else {}
    for tag, g in (("h100", "HOneHundred"), ("h200", "HTwoHundred")):
        cost = cap_cost(sweeps.get(tag))
        doc.macro(f"NFncuCapMin{g}", ratio(cost[0]) if cost else NM)
        doc.macro(f"NFncuCapMax{g}", ratio(cost[1]) if cost else NM)
    _table(doc, data)


def _table(doc: Document, data: dict) -> None:
    if not data:
        doc.write("ncu_table.tex", missing_box(r"results/linear/ncu/ (ncu reports of nf4.linear's kernels)"))
        return
    head = [""] + [f"{shape_tex((n, k))}, $M{{=}}{m}$" for (n, k, m), _, _ in CASES]
    lines = [r"\begin{tabular}{l" + "r" * len(CASES) + "}", r"\toprule", row(head),
             row(["kernel"] + [rf"\code{{{kernel}}}" for _, kernel, _ in CASES]), r"\midrule"]
    reports = [(data.get(case) or {}).get("report") or "" for case, _, _ in CASES]
    launches = [launch(t) for t in reports]
    lines.append(row(["programs $\\times$ threads"] + [f"{lp[1]} $\\times$ {lp[2]}" if lp else NM for lp in launches]))
    for key, label, fmt in METRICS:
        lines.append(row([label] + [fmt(metric(t, key)) for t in reports]))
    lines.append(r"\midrule")
    lines.append(row([r"\multicolumn{" + str(len(CASES) + 1) + r"}{l}{warps stalled per issued instruction, "
                      r"the three largest reasons}"]))
    tops = [top_stalls((data.get(case) or {}).get("stalls") or "") for case, _, _ in CASES]
    for i in range(3):
        lines.append(row([f"{i + 1}."] + [f"{tex(t[i][0].replace('_', ' '))} {num(t[i][1], 2)}" if i < len(t) else NM
                                          for t in tops]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("ncu_table.tex", "\n".join(lines) + "\n")


def report_path(results: Path, n: int, k: int, m: int, stalls_report: bool = False) -> Path:
    """Where a report of this section lives under `results`."""
    return results / "linear" / "ncu" / f"{'ncu_stalls' if stalls_report else 'ncu'}_{GPU_TAG}_{n}x{k}_M{m}.txt"
