"""results/nf4_bench.json (`python -m experiments bench`): timings of nf4 and its peers, bandwidth, the sweep."""

from __future__ import annotations

import math

from paper.latex import (
    DASH,
    NM,
    Document,
    camel,
    dtype_short,
    integer,
    missing_box,
    num,
    number,
    pct,
    ratio,
    result_rows,
    shape_tex,
    slug,
    stack,
    tex,
    us,
)

# Display names of the bench providers and the verify implementations (anything else: its own name).
PROVIDERS = {
    "nf4": "nf4 (ours)",
    "nf4_out_buffer": "nf4, out= buffer",
    "bnb.dequantize_4bit": "bitsandbytes",
    "unsloth.2026.10.9": "Unsloth 2026.10.9",
    "unsloth.2026.10.9_global_buffer": "Unsloth 2026.10.9, global buf.",
    "unsloth_style": "Unsloth <= 2025 path (re-impl.)",
    "unsloth_style_global_buffer": "Unsloth <= 2025, global buf.",
    "torch.compile": "torch.compile",
}
# Peers the prose quotes speedups against: provider -> macro stem.
PEERS = {"bnb.dequantize_4bit": "Bnb", "unsloth.2026.10.9": "UnslothRelease",
         "unsloth.2026.10.9_global_buffer": "UnslothReleaseGlobal",
         "unsloth_style": "Unsloth", "unsloth_style_global_buffer": "UnslothGlobal",
         "torch.compile": "Compile"}


def build(doc: Document, bench: dict | None) -> None:
    """Macros, tables and figures from results/nf4_bench.json (`python -m experiments bench`): speed vs the peers."""
    env = (bench or {}).get("env") or {}
    rows = result_rows((bench or {}).get("rows"))
    doc.macro("NFbenchBnbVersion", tex(env["bitsandbytes"]) if env.get("bitsandbytes") else NM)
    release = ((bench or {}).get("peers") or {}).get("unsloth.2026.10.9")
    doc.macro("NFbenchUnslothVersion", tex(release["version"]) if isinstance(release, dict) and release.get("version")
              else NM)
    copy_gbs = number(((bench or {}).get("copy_bandwidth") or {}).get("gbs"))
    empty = (bench or {}).get("empty_triton_launch") or {}
    doc.macro("NFbenchDevice", tex(env["device"]) if env.get("device") else NM)
    for key, stem in (("torch", "Torch"), ("triton", "Triton"), ("bitsandbytes", "Bnb"), ("cuda", "Cuda")):
        doc.macro(f"NFbench{stem}", tex(env[key]) if env.get(key) else NM)
    doc.macro("NFcopyGBs", integer(round(copy_gbs)) if copy_gbs else NM)
    doc.macro("NFcopyTBs", num(copy_gbs / 1000, 2) if copy_gbs else NM)
    doc.macro("NFemptyLaunchHostUs", us(empty.get("host_us")))
    doc.macro("NFemptyLaunchDeviceUs", us(empty.get("device_us")))

    cases = list(dict.fromkeys((tuple(r.get("shape") or ()), str(r.get("dtype"))) for r in rows))
    providers = list(dict.fromkeys(str(r.get("provider")) for r in rows))
    by = {(tuple(r.get("shape") or ()), str(r.get("dtype")), str(r.get("provider"))): r for r in rows}
    doc.macro("NFbenchCases", integer(len(cases)) if rows else NM)

    def nf4(case):
        return by.get((*case, "nf4"), {})

    exact_cases = sum(1 for c in cases if nf4(c).get("mismatches") == 0)
    doc.macro("NFbenchNFExactCases", integer(exact_cases) if rows else NM)
    timed = [c for c in cases if nf4(c).get("device_us")]
    if timed:
        large = max(timed, key=lambda c: by[(*c, "nf4")].get("numel") or math.prod(c[0]))
        small = min(timed, key=lambda c: by[(*c, "nf4")].get("numel") or math.prod(c[0]))
    else:
        large = small = None
    for name, case in (("Large", large), ("Small", small)):
        r = nf4(case) if case else {}
        doc.macro(f"NF{name.lower()}Shape", shape_tex(case[0]) if case else NM)
        doc.macro(f"NF{name.lower()}Dtype", dtype_short(case[1]) if case else NM)
        doc.macro(f"NFbw{name}", pct(r.get("pct_copy")))
        doc.macro(f"NFus{name}", us(r.get("device_us")))
        doc.macro(f"NFgbs{name}", integer(round(r["gbs"])) if r.get("gbs") else NM)
        floor = r["bytes"] / (copy_gbs * 1e3) if r.get("bytes") and copy_gbs else None
        doc.macro(f"NFfloorUs{name}", us(floor))
        doc.macro(f"NFhostUs{name}", us(r.get("host_us")))
        doc.macro(f"NFgraphUs{name}", us(r.get("graph_us")))
        ob = (by.get((*case, "nf4_out_buffer"), {}) if case else {}).get("device_us")
        doc.macro(f"NFoutBufferUs{name}", us(ob))
        doc.macro(f"NFoutBufferGapUs{name}", us(ob - r["device_us"]) if ob and r.get("device_us") else NM)
        for peer, stem in PEERS.items():
            p = by.get((*case, peer), {}) if case else {}
            doc.macro(f"NFus{stem}{name}", us(p.get("device_us")))
            doc.macro(f"NFhostUs{stem}{name}", us(p.get("host_us")))
    # Host time per call against an empty JIT launch measured in alternating batches (same row).
    for prov, stem in (("nf4", "Call"), ("nf4_out_buffer", "Out")):
        paired = [by.get((*c, prov), {}) for c in timed]
        paired = [r for r in paired if r.get("host_us") and r.get("jit_host_us")]
        doc.macro(f"NFhost{stem}HalfJitCount", integer(sum(r["host_us"] <= r["jit_host_us"] / 2 for r in paired))
                  if paired else NM)
        doc.macro(f"NFhost{stem}PairedCount", integer(len(paired)) if paired else NM)
        fractions = [r["host_us"] / r["jit_host_us"] for r in paired]
        doc.macro(f"NFhost{stem}JitFracMin", pct(100 * min(fractions)) if fractions else NM)
        doc.macro(f"NFhost{stem}JitFracMax", pct(100 * max(fractions)) if fractions else NM)
    jits = [nf4(c).get("jit_host_us") for c in timed if nf4(c).get("jit_host_us")]
    doc.macro("NFhostPairedJitMin", us(min(jits)) if jits else NM)
    doc.macro("NFhostPairedJitMax", us(max(jits)) if jits else NM)
    pcts = [nf4(c)["pct_copy"] for c in timed if nf4(c).get("pct_copy") is not None]
    doc.macro("NFpctCopyMin", pct(min(pcts)) if pcts else NM)
    doc.macro("NFpctCopyMax", pct(max(pcts)) if pcts else NM)
    speedups: dict[str, list] = {peer: [] for peer in PEERS}
    for c in timed:
        for peer in PEERS:
            p = by.get((*c, peer), {})
            if p.get("device_us"):
                speedups[peer].append(p["device_us"] / nf4(c)["device_us"])
    for peer, stem in PEERS.items():
        s = speedups[peer]
        doc.macro(f"NFspeedup{stem}Min", ratio(min(s)) if s else NM)
        doc.macro(f"NFspeedup{stem}Max", ratio(max(s)) if s else NM)
    for peer, stem in PEERS.items():
        bad = [by[(*c, peer)]["mismatches"] for c in cases if (by.get((*c, peer)) or {}).get("mismatches")]
        doc.macro(f"NFbenchInexact{stem}Cases", integer(len(bad)) if rows else NM)
        doc.macro(f"NFbenchMismatch{stem}Max", integer(max(bad)) if bad else (integer(0) if rows else NM))
    exact_peers = {p: all(by.get((*c, p), {}).get("mismatches") == 0 for c in cases) for p in PEERS}
    doc.macro("NFbenchPeersExact", integer(sum(exact_peers.values())) if rows else NM)
    doc.macro("NFbenchPeers", integer(sum(1 for p in PEERS if p in providers)) if rows else NM)

    if not rows:
        for name in ("bench_table.tex", "bench_detail_table.tex", "fig_bandwidth.tex", "fig_speedup.tex"):
            doc.write(name, missing_box("results/nf4\\_bench.json (\\texttt{python -m experiments bench} on a GPU)"))
        doc.write("sweep_table.tex", missing_box("results/nf4\\_bench.json sweep"))
        doc.macro("NFsweepConfigs", NM)
        doc.macro("NFsweepExact", NM)
        return

    def cell(r):
        if not r:
            return DASH
        if r.get("error"):
            return "error"
        if r.get("mismatches"):
            return f"n/e ({integer(r['mismatches'])})"
        return us(r.get("device_us")) if r.get("device_us") is not None else DASH

    cols = len(providers)
    lines = [rf"\begin{{tabular}}{{@{{}}l l r r {'r ' * cols}r@{{}}}}", r"\toprule",
             r"weight & out & MB & floor & " + " & ".join(stack(PROVIDERS.get(p, p)) for p in providers)
             + r" & \shortstack{nf4\\\% copy} \\",
             r"\midrule"]
    for c in cases:
        r0 = nf4(c) or next((by[(*c, p)] for p in providers if (*c, p) in by), {})
        mb = r0.get("bytes", 0) / 1e6 if r0.get("bytes") else None
        floor = r0["bytes"] / (copy_gbs * 1e3) if r0.get("bytes") and copy_gbs else None
        lines.append(" & ".join([shape_tex(c[0]), dtype_short(c[1]), num(mb, 1), us(floor)]
                                + [cell(by.get((*c, p))) for p in providers] + [pct(nf4(c).get("pct_copy"))])
                     + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("bench_table.tex", "\n".join(lines) + "\n")

    peers = [p for p in PEERS if p in providers]
    lines = [rf"\begin{{tabular}}{{@{{}}l l r r r r {'r ' * len(peers)}@{{}}}}", r"\toprule",
             r"weight & out & GB/s & graph & host & \% copy & "
             + " & ".join(r"\shortstack{$\times$ over\\" + stack(PROVIDERS.get(p, p)) + "}" for p in peers)
             + r" \\", r"\midrule"]
    for c in cases:
        r = nf4(c)
        sp = [ratio(by[(*c, p)]["device_us"] / r["device_us"]) if r.get("device_us")
              and by.get((*c, p), {}).get("device_us") else DASH for p in peers]
        gbs = integer(round(r["gbs"])) if r.get("gbs") else DASH
        graph = us(r.get("graph_us")) if r.get("graph_us") else DASH
        host = us(r.get("host_us")) if r.get("host_us") else DASH
        lines.append(" & ".join([shape_tex(c[0]), dtype_short(c[1]), gbs, graph, host, pct(r.get("pct_copy")), *sp])
                     + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("bench_detail_table.tex", "\n".join(lines) + "\n")
    _fig_bandwidth(doc, cases, providers, by, copy_gbs)
    _fig_speedup(doc, timed, peers, by)
    _sweep(doc, (bench or {}).get("sweep") or [])


def _fig_bandwidth(doc: Document, cases, providers, by, copy_gbs) -> None:
    plots, xs = [], []
    marks = ["*", "square*", "triangle*", "diamond*", "pentagon*", "o", "x"]
    for i, p in enumerate(providers):
        pts = sorted((by[(*c, p)]["bytes"] / 1e6, by[(*c, p)]["gbs"]) for c in cases
                     if by.get((*c, p), {}).get("gbs") and by[(*c, p)].get("bytes"))
        if not pts:
            continue
        name = f"bw_{slug(p)}.dat"
        doc.write(name, "mb gbs\n" + "".join(f"{x:.3f} {y:.1f}\n" for x, y in pts))
        xs += [x for x, _ in pts]
        style = "very thick" if p == "nf4" else "thin"
        plots.append(rf"\addplot+[{style}, mark={marks[i % len(marks)]}] table[x=mb, y=gbs] "
                     rf"{{generated/{name}}};" + "\n" + rf"\addlegendentry{{{tex(PROVIDERS.get(p, p))}}}")
    if copy_gbs and xs:
        plots.append(rf"\addplot[dashed, black, domain={min(xs) * 0.8:.3f}:{max(xs) * 1.25:.3f}, samples=2] "
                     rf"{{{copy_gbs:.1f}}};" + "\n" + r"\addlegendentry{device-to-device copy}")
    body = [r"\begin{tikzpicture}", r"\begin{axis}[width=\linewidth, height=6.2cm, xmode=log, ymin=0,",
            r"  xlabel={bytes a call must move (MB, log scale)}, ylabel={GB/s (read + write)},",
            r"  legend style={font=\scriptsize, at={(0.5,-0.2)}, anchor=north, legend columns=3}, grid=major,",
            r"  log ticks with fixed point, /pgf/number format/1000 sep={\,},",
            r"  tick label style={font=\footnotesize}]"]
    doc.write("fig_bandwidth.tex", "\n".join(body + plots + [r"\end{axis}", r"\end{tikzpicture}"]) + "\n")


def _fig_speedup(doc: Document, timed, peers, by) -> None:
    if not timed or not peers:
        doc.write("fig_speedup.tex", missing_box("speedups (no timed case with a timed peer)"))
        return
    cols = [camel(PEERS[p]) for p in peers]
    lines = ["idx label " + " ".join(cols)]
    for i, c in enumerate(timed):
        base = by[(*c, "nf4")]["device_us"]
        vals = [f"{by[(*c, p)]['device_us'] / base:.3f}" if by.get((*c, p), {}).get("device_us") else "nan"
                for p in peers]
        lines.append(f"{i} {'x'.join(map(str, c[0]))}-{dtype_short(c[1])} " + " ".join(vals))
    doc.write("speedup.dat", "\n".join(lines) + "\n")
    plots = [rf"\addplot table[x=idx, y={col}] {{generated/speedup.dat}};" + "\n"
             + rf"\addlegendentry{{over {tex(PROVIDERS.get(p, p))}}}" for p, col in zip(peers, cols, strict=True)]
    body = [r"\begin{tikzpicture}",
            r"\begin{axis}[ybar, bar width=4pt, width=\linewidth, height=6cm, ymin=0,",
            r"  ylabel={speedup of nf4 (device time)}, xtick=data, /pgf/number format/1000 sep={\,},",
            r"  xticklabels from table={generated/speedup.dat}{label},",
            r"  x tick label style={rotate=30, anchor=east, font=\scriptsize},",
            r"  legend style={font=\scriptsize, at={(0.5,1.03)}, anchor=south, legend columns=4}, ymajorgrids,",
            r"  extra y ticks={1}, extra y tick style={grid=major, major grid style={black, dashed}}]"]
    doc.write("fig_speedup.tex", "\n".join(body + plots + [r"\end{axis}", r"\end{tikzpicture}"]) + "\n")


def _sweep(doc: Document, sweep: list) -> None:
    rows = result_rows(sweep)
    doc.macro("NFsweepConfigs", integer(len(rows)) if rows else NM)
    doc.macro("NFsweepExact", integer(sum(1 for r in rows if r.get("mismatches") == 0)) if rows else NM)
    if not rows:
        doc.write("sweep_table.tex", missing_box("the sweep (\\texttt{python -m experiments bench --sweep})"))
        return
    cases = list(dict.fromkeys((tuple(r.get("shape") or ()), str(r.get("dtype"))) for r in rows))
    lines = [r"\begin{tabular}{@{}l l r r r l l r r@{}}", r"\toprule",
             r"weight & out & configs & exact & tile B & warps & codebook/store & best $\mu$s & \% copy \\",
             r"\midrule"]
    for c in cases:
        rs = [r for r in rows if (tuple(r.get("shape") or ()), str(r.get("dtype"))) == c]
        timed = [r for r in rs if r.get("device_us")]
        best = min(timed, key=lambda r: r["device_us"]) if timed else {}
        cb = f"{best.get('codebook', DASH)}/{best.get('store_cm') or 'none'}" if best else DASH
        lines.append(" & ".join([shape_tex(c[0]), dtype_short(c[1]), integer(len(rs)),
                                 integer(sum(1 for r in rs if r.get("mismatches") == 0)),
                                 integer(best.get("tile_bytes")) if best else DASH,
                                 integer(best.get("num_warps")) if best else DASH, tex(cb),
                                 us(best.get("device_us")) if best else DASH,
                                 pct(best.get("pct_copy")) if best else DASH]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("sweep_table.tex", "\n".join(lines) + "\n")
