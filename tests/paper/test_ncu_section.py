"""paper.sections.ncu: the ncu table and macros read out of Nsight Compute's text reports (seeded random values
written in ncu's layout), the register-cap ratios from a sweep file, and the placeholders without them."""

from __future__ import annotations

import json
import random
import re

from paper.latex import NM, Document
from paper.sections import ncu

STALL_NAMES = ("long_scoreboard", "math_pipe_throttle", "not_selected", "wait", "short_scoreboard", "barrier")


def _report(rng, programs: int) -> tuple[str, dict]:
    """A report in ncu's text layout with random values, and the values."""
    values = {"Duration": round(rng.uniform(5, 90), 2), "Registers Per Thread": rng.randrange(40, 200),
              "Block Limit Registers": rng.randrange(1, 8), "Waves Per SM": round(rng.uniform(0.2, 3), 2),
              "Achieved Occupancy": round(rng.uniform(5, 60), 2), "DRAM Throughput": round(rng.uniform(5, 90), 2),
              "Issue Slots Busy": round(rng.uniform(5, 90), 2),
              "Warp Cycles Per Issued Instruction": round(rng.uniform(2, 20), 2)}
    units = {"Duration": "us", "Registers Per Thread": "register/thread", "Block Limit Registers": "block",
             "Waves Per SM": "", "Achieved Occupancy": "%", "DRAM Throughput": "%", "Issue Slots Busy": "%",
             "Warp Cycles Per Issued Instruction": "cycle"}
    lines = ["==PROF== Connected to process 1 (/usr/bin/python3)",
             f"  nf4_some_kernel ({programs}, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
             "    Section: GPU Speed Of Light Throughput", "    ----------------------- ----------- ------------",
             "    Memory Throughput                 %        12.50"]
    lines += [f"    {name:<40} {units[name]:>15} {v:>12}" for name, v in values.items()]
    return "\n".join(lines) + "\n", values


def _stalls(rng) -> tuple[str, dict]:
    values = {name: round(rng.uniform(0, 4), 2) for name in STALL_NAMES}
    lines = [f"    smsp__average_warps_issue_stalled_{name}_per_issue_active.ratio          inst {v:>12}"
             for name, v in values.items()]
    lines.append("    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio          inst            9")
    return "\n".join(lines) + "\n", values


def _macros(doc: Document) -> dict:
    return dict(re.findall(r"\\newcommand\{\\(NF[A-Za-z]+)\}\{(.*)\}", doc.macros_tex()))


def test_reports_read_into_macros_and_table(tmp_path):
    rng = random.Random(20261124)
    folder = tmp_path / "linear" / "ncu"
    folder.mkdir(parents=True)
    want = {}
    for (n, k, m), _, stem in ncu.CASES:
        programs = rng.randrange(50, 1000)
        text, values = _report(rng, programs)
        stall_text, stall_values = _stalls(rng)
        ncu.report_path(tmp_path, n, k, m).write_text(text)
        ncu.report_path(tmp_path, n, k, m, stalls_report=True).write_text(stall_text)
        want[stem] = (programs, values, stall_values)
    doc = Document(tmp_path)
    ncu.build(doc, ncu.load(doc), ncu.load_sweep(doc))
    macros = _macros(doc)
    table = doc.files["ncu_table.tex"]
    for stem, (programs, values, stall_values) in want.items():
        assert macros[f"NFncu{stem}Programs"] == str(programs)
        assert macros[f"NFncu{stem}Regs"] == f"{values['Registers Per Thread']:.0f}"
        assert macros[f"NFncu{stem}PerSm"] == f"{values['Block Limit Registers']:.0f}"
        assert macros[f"NFncu{stem}Waves"] == f"{values['Waves Per SM']:.2f}"
        assert macros[f"NFncu{stem}Dram"] == f"{values['DRAM Throughput']:.1f}"
        top = sorted(stall_values.items(), key=lambda kv: -kv[1])
        assert macros[f"NFncu{stem}StallFirst"] == top[0][0].replace("_", " ")  # never "selected" (9 above)
        assert macros[f"NFncu{stem}StallFirstValue"] == f"{top[0][1]:.2f}"
        assert f"{programs} $\\times$ 256" in table
        assert f"{values['Warp Cycles Per Issued Instruction']:.2f}" in table
    assert "selected 9" not in table
    assert macros["NFncuCapMinHOneHundred"] == NM  # no sweep file


def test_register_cap_ratios_from_a_sweep(tmp_path):
    rng = random.Random(7)
    rows, best = [], {}
    for n, k in ((14336, 4096), (4096, 4096)):
        for capped in (False, True):
            times = [round(rng.uniform(5, 30), 3) for _ in range(3)]
            best[(n, k, capped)] = min(times)
            rows += [{"N": n, "K": k, "M": 1, "graph_us": t, "operand_mismatches": 0,
                      "config": {"maxnreg": 64 if capped else None}} for t in times]
    rows.append({"N": 14336, "K": 4096, "M": 1, "graph_us": 0.001, "operand_mismatches": 3,
                 "config": {"maxnreg": 64}})  # not exact: not counted
    rows.append({"N": 14336, "K": 4096, "M": 4, "graph_us": 0.001, "operand_mismatches": 0,
                 "config": {"maxnreg": 64}})  # another M: not counted
    (tmp_path / "linear" / "tuning").mkdir(parents=True)
    (tmp_path / "linear" / "tuning" / "sweep_wkreg_h200.json").write_text(json.dumps({"env": {}, "rows": rows}))
    doc = Document(tmp_path)
    ncu.build(doc, ncu.load(doc), ncu.load_sweep(doc))
    macros = _macros(doc)
    ratios = [best[(n, k, True)] / best[(n, k, False)] for n, k in ((14336, 4096), (4096, 4096))]
    assert macros["NFncuCapMinHTwoHundred"] == f"{min(ratios):.2f}"
    assert macros["NFncuCapMaxHTwoHundred"] == f"{max(ratios):.2f}"
    assert macros["NFncuCapMinHOneHundred"] == NM
    assert "ncu reports" in doc.files["ncu_table.tex"]  # no reports: the missing box


def test_placeholders_without_inputs(tmp_path):
    doc = Document(tmp_path)
    ncu.build(doc, None, None)
    macros = _macros(doc)
    assert macros["NFncuGemvTallRegs"] == NM and macros["NFncuWordGemmStallFirst"] == NM
    assert "ncu reports" in doc.files["ncu_table.tex"]


def test_committed_reports_read_as_their_text_says():
    """The committed H100 reports: each macro equals the number on its line of the file, read here by splitting."""
    from paper.generate import RESULTS

    doc = Document(RESULTS)
    ncu.build(doc, ncu.load(doc), ncu.load_sweep(doc))
    macros = _macros(doc)
    for (n, k, m), _, stem in ncu.CASES:
        text = ncu.report_path(RESULTS, n, k, m).read_text()
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("Registers Per Thread"))
        assert macros[f"NFncu{stem}Regs"] == line.split()[-1]
