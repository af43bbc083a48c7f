"""results/probe_<gpu>.json (`python -m experiments probe`): where the time goes, on the device and on the host."""

from __future__ import annotations

from paper.latex import (
    DASH,
    NM,
    Document,
    case_tex,
    integer,
    missing_box,
    number,
    pct,
    ratio,
    result_rows,
    row,
    tex,
    us,
    us_range,
)
from paper.sections import PROBE_CASES

PROBE_ROWS = (("copy of the same byte count", "torch copy, same byte count"),
              ("fill of the output (writes only)", "torch fill of the output only"),
              ("driver memset of the output (writes only)", "driver memset of the output only"),
              ("same loads/stores, no dequantization", "nf4's loads and stores, no arithmetic"),
              ("nf4 with its defaults", "nf4"))
PROBE_HOST = (("empty Triton kernel, JIT launch", "empty Triton kernel, JIT launch"),
              ("plan lookup + match", "fast path: plan lookup and checks"),
              ("torch.empty(shape, dtype=, device=)", "torch.empty(shape, dtype=, device=)"),
              ("Tensor.new_empty(shape)", "Tensor.new_empty(shape) (used at the probe's commit)"),
              ("plan.run(out) via CompiledKernel.run", "launch via CompiledKernel.run"),
              ("plan.run(out) via the C launch function", "launch via Triton's C launch function"),
              ("plan.run(out) via nf4's own launch function", "launch via nf4's own launch function (used)"),
              ("driver cuLaunchKernel of an empty kernel (ctypes)",
               "the driver's cuLaunchKernel of an empty kernel, through ctypes"),
              ("nf4.dequantize(p, q, out=buf)", "nf4.dequantize(w, qs, out=buf)"),
              ("nf4.dequantize(p, q)", "nf4.dequantize(w, qs)"))


def load(doc: Document) -> dict | None:
    """The newest results/probe_<gpu>.json (by name), or None (noted as missing)."""
    found = sorted(p.name for p in doc.results.glob("probe_*.json")) if doc.results.is_dir() else []
    if not found:
        doc.missing.append("results/probe_<gpu>.json (python -m experiments probe on a GPU)")
        return None
    return doc.load(found[-1], label="experiments probe", required_for="floor and host tables")


def build(doc: Document, data: dict | None) -> None:
    """Macros and the floor and host tables from results/probe_<gpu>.json."""
    rows = [r for r in result_rows((data or {}).get("device")) if "device_us" in r]
    by = {(r.get("case"), r.get("what")): r for r in rows}
    host = ((data or {}).get("host") or {}).get("us") or {}
    host2 = ((data or {}).get("host") or {}).get("us_second_pass") or {}
    doc.macro("NFprobeDevice", tex(((data or {}).get("env") or {}).get("device") or "") if data else NM)
    doc.macro("NFprobeCommit", tex(str(((data or {}).get("env") or {}).get("commit") or "")[:7]) if data else NM)
    mid = PROBE_CASES[1]
    doc.macro("NFmidShapeProbe", case_tex(mid))
    doc.macro("NFhostShapeProbe", case_tex(((data or {}).get("host") or {}).get("case") or "") if data else NM)

    def get(case, what, key="device_us"):
        return (by.get((case, what)) or {}).get(key)

    for case, tag in zip(PROBE_CASES, ("Small", "Mid", "Large"), strict=True):
        for (what, _), name in zip(PROBE_ROWS, ("Copy", "Fill", "Memset", "Floor", "NF"), strict=True):
            doc.macro(f"NFprobe{name}Pct{tag}", pct(get(case, what, "pct_copy")))
            doc.macro(f"NFprobe{name}Us{tag}", us(get(case, what)))
    persist = [r for r in rows if r.get("programs_per_sm")]
    best = {c: min((r for r in persist if r.get("case") == c), key=lambda r: r["device_us"], default=None)
            for c in PROBE_CASES}
    slower = [c for c in PROBE_CASES if best.get(c) and number(get(c, PROBE_ROWS[4][0]))
              and best[c]["device_us"] > get(c, PROBE_ROWS[4][0])]
    compared = [c for c in PROBE_CASES if best.get(c) and number(get(c, PROBE_ROWS[4][0]))]
    doc.macro("NFprobePersistSlowerCount", integer(len(slower)) if compared else NM)
    doc.macro("NFprobeCaseCount", integer(len(compared)) if compared else NM)
    nf_mid, floor_mid = number(get(mid, PROBE_ROWS[4][0])), number(get(mid, PROBE_ROWS[3][0]))
    doc.macro("NFprobeNFOverFloorMid", ratio(nf_mid / floor_mid) if nf_mid and floor_mid else NM)
    bm = best.get(mid)
    doc.macro("NFprobePersistBestUsMid", us(bm["device_us"]) if bm else NM)
    doc.macro("NFprobePersistBestPerSmMid", integer(bm["programs_per_sm"]) if bm else NM)
    doc.macro("NFprobePersistSlowdownMid", ratio(bm["device_us"] / nf_mid) if bm and nf_mid else NM)
    for key, name in (("empty Triton kernel, JIT launch", "Jit"), ("torch.empty(shape, dtype=, device=)", "Empty"),
                      ("Tensor.new_empty(shape)", "NewEmpty"),
                      ("plan.run(out) via the C launch function", "Launch"),
                      ("plan.run(out) via CompiledKernel.run", "LaunchWrapper"),
                      ("nf4.dequantize(p, q, out=buf)", "CallOut"), ("nf4.dequantize(p, q)", "Call"),
                      ("driver cuLaunchKernel of an empty kernel (ctypes)", "Driver"),
                      ("plan.run(out) via nf4's own launch function", "OwnLaunch")):
        doc.macro(f"NFprobeHost{name}", us_range(host.get(key), host2.get(key)))
    used = ("plan.run(out) via nf4's own launch function" if host.get("plan.run(out) via nf4's own launch function")
            and (data or {}).get("host", {}).get("own_launch_used") else "plan.run(out) via the C launch function")
    steps = ("Tensor.new_empty(shape)", used, "empty Triton kernel, JIT launch")
    (alloc, launch, jit), (alloc2, launch2, jit2) = ([number(h.get(k)) for k in steps] for h in (host, host2))
    doc.macro("NFprobeHostAllocLaunch", us_range(alloc + launch, alloc2 + launch2)
              if alloc and launch and alloc2 and launch2 else NM)
    doc.macro("NFprobeHostHalfJit", us_range(jit / 2, jit2 / 2) if jit and jit2 else NM)
    if not rows:
        doc.write("floor_table.tex", missing_box("results/probe\\_<gpu>.json (\\texttt{python -m experiments probe})"))
    else:
        head = " & ".join(rf"\multicolumn{{2}}{{c}}{{{case_tex(c)}}}" for c in PROBE_CASES)
        rule = "".join(rf"\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(PROBE_CASES)))
        lines = [r"\begin{tabular}{@{}l " + "r r " * len(PROBE_CASES) + "@{}}", r"\toprule",
                 rf"what moves the bytes & {head} \\", rule,
                 " & " + " & ".join([r"$\mu$s & \% copy"] * len(PROBE_CASES)) + r" \\", r"\midrule"]
        for what, label in PROBE_ROWS:
            cells = [tex(label)]
            for c in PROBE_CASES:
                cells += [us(get(c, what)), pct(get(c, what, "pct_copy"))]
            lines.append(row(cells))
        cells = ["nf4, best fixed (persistent) grid"]
        for c in PROBE_CASES:
            b = best.get(c)
            cells += [us(b["device_us"]) if b else DASH, pct(b.get("pct_copy")) if b else DASH]
        lines.append(row(cells))
        lines += [r"\bottomrule", r"\end{tabular}"]
        doc.write("floor_table.tex", "\n".join(lines) + "\n")
    if not host:
        doc.write("host_table.tex", missing_box("results/probe\\_<gpu>.json host steps"))
    else:
        lines = [r"\begin{tabular}{@{}l r r@{}}", r"\toprule", r"step & $\mu$s & again \\", r"\midrule"]
        for key, label in PROBE_HOST:
            lines.append(row([r"\code{" + tex(label) + "}" if label.startswith(("torch", "Tensor", "nf4"))
                              else tex(label), us(host.get(key)), us(host2.get(key))]))
        lines += [r"\bottomrule", r"\end{tabular}"]
        doc.write("host_table.tex", "\n".join(lines) + "\n")
