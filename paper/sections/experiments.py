"""results/experiments.json (`python -m experiments`): the ablation variants and their sm_75 builds."""

from __future__ import annotations

import re
from collections import Counter

from paper.latex import DASH, NM, Document, case_tex, integer, missing_box, num, pct, ratio, result_rows, row, tex, us

EXP_CASES = ("8192x2048:fp16", "14336x4096:bf16")  # preferred ablation columns, if the results have them


def load(doc: Document) -> dict | None:
    """experiments.json (or its CSV), with the sm_75 builds of the same run or of `experiments sm75`."""
    exp = doc.load("experiments.json", label="python -m experiments run", required_for="ablations")
    if exp is not None and not isinstance(exp, dict):
        doc.missing.append("results/experiments.json (unreadable: not a JSON object)")
        exp = None
    if exp is None and (doc.results / "experiments.csv").exists():
        rows = doc.load_csv("experiments.csv", label="python -m experiments run (CSV)") or []
        doc.missing = [m for m in doc.missing if not m.startswith("results/experiments.json (ablations)")]
        exp = {"rows": [_csv_row(r) for r in rows], "mode": rows[0].get("mode") if rows else None,
               "device": rows[0].get("device") if rows else None}
    # The standalone compile (python -m experiments sm75) is read whenever it exists, so that it is in
    # the provenance; the run's own sm_75 section wins when both exist (same kernels as the timings).
    sm = None
    if (doc.results / "experiments_sm75.json").exists():
        sm = doc.load("experiments_sm75.json", label="python -m experiments sm75", required_for="sm_75 columns")
    elif (doc.results / "experiments_sm75.csv").exists():
        sm = {"builds": [_csv_row(r) for r in doc.load_csv("experiments_sm75.csv",
                                                              label="python -m experiments sm75 (CSV)") or []]}
    if not isinstance(sm, dict):
        sm = None
    if exp is not None and not (exp.get("sm75") or {}).get("builds") and sm:
        exp = {**exp, "sm75": sm}
    elif exp is None and sm:
        exp = {"rows": [], "sm75": sm}
    if not ((exp or {}).get("sm75") or {}).get("builds"):
        doc.missing.append("results/experiments_sm75.json (sm_75 columns: python -m experiments sm75, no GPU)")
    return exp


def build(doc: Document, exp: dict | None) -> None:
    """Macros, tables and the figure of the ablations (`python -m experiments`), with their sm_75 builds."""
    rows = result_rows((exp or {}).get("rows"))
    variants = dict((exp or {}).get("variants") or {})
    for r in rows:
        variants.setdefault(r.get("variant"), {"parent": r.get("parent"), "change": r.get("change"),
                                               "exact_expected": r.get("exact_expected", True)})
    builds = result_rows(((exp or {}).get("sm75") or {}).get("builds"))
    for b in builds:
        variants.setdefault(b.get("variant"), {"parent": None, "change": "", "exact_expected": True})
    variants = dict(sorted((k, v) for k, v in variants.items() if k))
    env = (exp or {}).get("env") or {}
    mode = (exp or {}).get("mode")
    doc.macro("NFexpDevice", tex((exp or {}).get("device") or env.get("device")) if exp and
              ((exp or {}).get("device") or env.get("device")) else NM)
    doc.macro("NFexpMode", tex(mode) if mode else NM)
    doc.macro("NFexpVariants", integer(len(variants)) if variants else NM)
    doc.macro("NFexpTriton", tex(env["triton"]) if env.get("triton") else NM)
    doc.macro("NFsmTriton", tex(((exp or {}).get("sm75") or {}).get("triton")) if builds else NM)
    doc.macro("NFsmBuilds", integer(len(builds)) if builds else NM)
    doc.macro("NFsmUniqueBuilds", integer(((exp or {}).get("sm75") or {}).get("unique_builds"))
              if builds and (exp or {}).get("sm75", {}).get("unique_builds") is not None else NM)
    doc.macro("NFexpRows", integer(len(rows)) if rows else NM)
    doc.macro("NFexpExactRows", integer(sum(1 for r in rows if r.get("status") == "exact")) if rows else NM)
    doc.macro("NFexpUnexpected", integer(sum(1 for r in rows if r.get("status") in ("INEXACT", "error")))
              if rows else NM)

    cases = list(dict.fromkeys(str(r.get("case")) for r in rows))
    chosen = [c for c in EXP_CASES if c in cases] + [c for c in cases if c not in EXP_CASES]
    case_a = chosen[0] if chosen else None
    case_b = chosen[1] if len(chosen) > 1 else None
    doc.macro("NFexpCaseA", case_tex(case_a) if case_a else NM)
    doc.macro("NFexpCaseB", case_tex(case_b) if case_b else NM)
    by_vc = {(str(r.get("variant")), str(r.get("case"))): r for r in rows}
    sm = {}
    for b in builds:
        key = str(b.get("variant"))
        if key not in sm or b.get("out_dtype") == "float16":
            sm[key] = b

    def get(vid, case, key):
        return (by_vc.get((vid, case)) or {}).get(key) if case else None

    # Prose numbers.
    def ratio_of(a, b, case):
        x, y = get(a, case, "device_us"), get(b, case, "device_us")
        return x / y if x and y else None

    doc.macro("NFwordSixteenSlowdownA", ratio(ratio_of("v03_word16", "v02_word4", case_a)))
    doc.macro("NFwordSixteenSlowdownB", ratio(ratio_of("v03_word16", "v02_word4", case_b)))
    doc.macro("NFnaiveToProdA", ratio(ratio_of("v00_naive", "v99_production", case_a)))
    doc.macro("NFnaiveToProdB", ratio(ratio_of("v00_naive", "v99_production", case_b)))
    for vid, stem in (("v00_naive", "Naive"), ("v02_word4", "WordFour"), ("v03_word16", "WordSixteen"),
                      ("v04_rows2d", "RowsTwoD"), ("v05_rows3d", "RowsThreeD"), ("v99_production", "Prod"),
                      ("v51_cached_launch", "Cached"), ("v20_select_tree", "SelectTree"),
                      ("v21_prmt_lut", "Prmt"), ("v61_inductor_no_fusion", "Inductor")):
        for case, suffix in ((case_a, "A"), (case_b, "B")):
            doc.macro(f"NFpct{stem}{suffix}", pct(get(vid, case, "pct_copy")))
            doc.macro(f"NFus{stem}{suffix}", us(get(vid, case, "device_us")))
    for vid, stem in (("v50_jit_launch", "Jit"), ("v51_cached_launch", "Cached"), ("v99_production", "Prod")):
        doc.macro(f"NFhost{stem}Us", us(get(vid, case_a, "host_us")))
        doc.macro(f"NFwall{stem}Us", us(get(vid, case_a, "wall_us")))
        doc.macro(f"NFdevice{stem}Us", us(get(vid, case_a, "device_us")))
    for vid, stem in (("v99_production", "Prod"), ("v02_word4", "WordFour"), ("v03_word16", "WordSixteen"),
                      ("v04_rows2d", "RowsTwoD"), ("v05_rows3d", "RowsThreeD"), ("v41_fma_contraction_ieee", "Fma"),
                      ("v40_fma_contraction", "FmaFtz"), ("v21_prmt_lut", "Prmt")):
        b = sm.get(vid) or {}
        ok = bool(b) and not b.get("error")
        doc.macro(f"NFsmRegs{stem}", integer(b.get("n_regs")) if ok and b.get("n_regs") is not None else NM)
        doc.macro(f"NFsmSpill{stem}", integer(b.get("spill_stores")) if ok and b.get("spill_stores") is not None
                  else NM)
        smem = (b.get("shared_bytes") or 0) + (b.get("static_shared_bytes") or 0)
        doc.macro(f"NFsmSmem{stem}", integer(smem) if ok else NM)
        doc.macro(f"NFsmBar{stem}", integer(b.get("bar_sync")) if ok and b.get("bar_sync") is not None else NM)
        doc.macro(f"NFsmFma{stem}", integer(b.get("fma")) if ok and b.get("fma") is not None else NM)
        doc.macro(f"NFsmStore{stem}", tex(_widest(b.get("global_stores"))) if ok else NM)
    spilling = [b for b in builds if (b.get("spill_stores") or 0) > 0]
    doc.macro("NFsmSpillingBuilds", integer(len(spilling)) if builds else NM)
    doc.macro("NFsmFailedBuilds", integer(sum(1 for b in builds if b.get("error"))) if builds else NM)
    for vid, stem in (("v40_fma_contraction", "Ftz"), ("v41_fma_contraction_ieee", "Ieee"),
                      ("v60_inductor", "Inductor"), ("v61_inductor_no_fusion", "InductorNoFusion")):
        for case, suffix in ((case_a, "A"), (case_b, "B")):
            r = by_vc.get((vid, case)) or {}
            doc.macro(f"NFfma{stem}Mismatches{suffix}",
                      integer(r.get("mismatches")) if r.get("mismatches") is not None else NM)
            doc.macro(f"NFfma{stem}Total{suffix}", integer(r.get("total")) if r.get("total") else NM)
            ppm = 1e6 * r["mismatches"] / r["total"] if r.get("total") and r.get("mismatches") is not None else None
            doc.macro(f"NFfma{stem}Ppm{suffix}", num(ppm, 2))

    if not variants:
        for name in ("ablation_table.tex", "tiles_table.tex", "fma_table.tex", "launch_table.tex",
                     "fig_ablation.tex"):
            doc.write(name, missing_box("results/experiments.json (\\texttt{python -m experiments run})"))
        _tiles_macros(doc, None)
        return
    tiles = {v for v in variants if re.fullmatch(r"v30_t\d+_w\d+", v)}
    main_ids = [v for v in variants if v not in tiles]
    show_cases = [c for c in (case_a, case_b) if c]
    _ablation_table(doc, main_ids, variants, show_cases, get, sm, by_vc)
    _tiles_table(doc, sorted(tiles), case_a, get, sm)
    _fma_table(doc, variants, show_cases, by_vc, sm)
    _launch_table(doc, show_cases, get)
    _fig_ablation(doc, main_ids, variants, show_cases, get)


def _ablation_table(doc: Document, ids, variants, cases, get, sm, by_vc) -> None:
    head_cases = " & ".join(rf"\multicolumn{{2}}{{c}}{{{case_tex(c)}}}" for c in cases)
    rule = "".join(rf"\cmidrule(lr){{{4 + 2 * i}-{5 + 2 * i}}}" for i in range(len(cases)))
    spec = r"@{}l >{\raggedright\arraybackslash}p{5.2cm} c " + "r r " * len(cases) + "r r@{}"
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             rf"variant & what changed (vs.\ parent) & exact & {head_cases} & \multicolumn{{2}}{{c}}{{sm\_75}} \\",
             rule + rf"\cmidrule(l){{{4 + 2 * len(cases)}-{5 + 2 * len(cases)}}}",
             " & & & " + " & ".join([r"$\mu$s & \% copy"] * len(cases)) + r" & regs & spill B \\",
             r"\midrule"]
    for vid in ids:
        v = variants[vid]
        statuses = [str((by_vc.get((vid, c)) or {}).get("status")) for c in cases if by_vc.get((vid, c))]
        cells = [rf"\texttt{{{tex(vid)}}}", tex(v.get("change") or ""), _exact_cell(statuses)]
        for c in cases:
            cells += [us(get(vid, c, "device_us")) if get(vid, c, "device_us") else DASH,
                      pct(get(vid, c, "pct_copy")) if get(vid, c, "pct_copy") else DASH]
        b = sm.get(vid) or {}
        if b.get("error"):
            cells += ["err", DASH]
        else:
            spill = b.get("spill_stores")
            cells += [integer(b["n_regs"]) if b.get("n_regs") is not None else DASH,
                      f"{integer(spill)}/{integer(b.get('spill_loads', 0))}" if spill is not None else DASH]
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("ablation_table.tex", "\n".join(lines) + "\n")


def _tiles_macros(doc: Document, best, configs=None, spilling=None) -> None:
    doc.macro("NFtilesConfigs", integer(configs))
    doc.macro("NFtilesSpilling", integer(spilling))
    doc.macro("NFtilesBestPct", pct(best[2]) if best else NM)
    doc.macro("NFtilesBestTile", integer(best[0]) if best else NM)
    doc.macro("NFtilesBestWarps", integer(best[1]) if best else NM)


def _tiles_table(doc: Document, ids, case, get, sm) -> None:
    grid = {}
    for vid in ids:
        m = re.fullmatch(r"v30_t(\d+)_w(\d+)", vid)
        grid[(int(m.group(1)), int(m.group(2)))] = vid
    spills = sum(1 for vid in grid.values() if ((sm.get(vid) or {}).get("spill_stores") or 0) > 0)
    configs, spilling = (len(grid) if grid else None), (spills if grid and sm else None)
    if not grid:
        _tiles_macros(doc, None, configs, spilling)
        doc.write("tiles_table.tex", missing_box("the tile $\\times$ warps family (v30)"))
        return
    tiles = sorted({t for t, _ in grid})
    warps = sorted({w for _, w in grid})
    timed = [(t, w, get(v, case, "pct_copy")) for (t, w), v in grid.items() if get(v, case, "pct_copy")]
    best = max(timed, key=lambda x: x[2]) if timed else None
    _tiles_macros(doc, best, configs, spilling)
    lines = [rf"\begin{{tabular}}{{@{{}}r {'r ' * len(warps)}@{{}}}}", r"\toprule",
             rf"tile (packed B) & \multicolumn{{{len(warps)}}}{{c}}{{num\_warps}} \\",
             rf"\cmidrule(l){{2-{1 + len(warps)}}}", " & " + " & ".join(str(w) for w in warps) + r" \\",
             r"\midrule"]
    for t in tiles:
        cells = [str(t)]
        for w in warps:
            vid = grid.get((t, w))
            if vid is None:
                cells.append(DASH)
                continue
            p = get(vid, case, "pct_copy")
            text = pct(p) if p else DASH
            if best and (t, w) == best[:2]:
                text = rf"\textbf{{{text}}}"
            b = sm.get(vid) or {}
            if (b.get("spill_stores") or 0) > 0:
                text += r"$^{s}$"
            cells.append(text)
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("tiles_table.tex", "\n".join(lines) + "\n")


def _fma_table(doc: Document, variants, cases, by_vc, sm) -> None:
    inexact = {v for v, d in variants.items() if d.get("exact_expected") in (False, "False")}
    related = {v for v, d in variants.items() if d.get("parent") in inexact}
    ids = sorted(inexact | related | ({"v99_production"} & set(variants)))
    if not ids:
        doc.write("fma_table.tex", missing_box("the FMA-contraction variants"))
        return
    head = " & ".join(rf"\multicolumn{{2}}{{c}}{{{case_tex(c)}}}" for c in cases)
    rule = "".join(rf"\cmidrule(lr){{{3 + 2 * i}-{4 + 2 * i}}}" for i in range(len(cases)))
    lines = [rf"\begin{{tabular}}{{@{{}}l >{{\raggedright\arraybackslash}}p{{4.6cm}} {'r r ' * len(cases)}r@{{}}}}",
             r"\toprule",
             rf"variant & what changed & {head} & FMA \\", rule,
             " & & " + " & ".join(["differ & per $10^6$"] * len(cases)) + r" & in PTX \\", r"\midrule"]
    for vid in ids:
        cells = [rf"\texttt{{{tex(vid)}}}", tex(variants[vid].get("change") or "")]
        for c in cases:
            r = by_vc.get((vid, c)) or {}
            if r.get("status") == "skipped":
                cells += [r"\multicolumn{2}{c}{not run}"]
                continue
            m, t = r.get("mismatches"), r.get("total")
            cells += [integer(m) if m is not None else DASH, num(1e6 * m / t, 2) if m is not None and t else DASH]
        b = sm.get(vid) or {}
        cells.append(integer(b["fma"]) if b.get("fma") is not None and not b.get("error") else DASH)
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("fma_table.tex", "\n".join(lines) + "\n")


def _launch_table(doc: Document, cases, get) -> None:
    ids = [("v50_jit_launch", "Triton JIT dispatch"), ("v51_cached_launch", "cached compiled launch"),
           ("v99_production", "checks + cached launch")]
    if not any(get(v, c, key) is not None for v, _ in ids for c in cases for key in ("host_us", "device_us")):
        doc.write("launch_table.tex", missing_box("host and wall times of the launch paths (v50, v51, v99)"))
        return
    lines = [r"\begin{tabular}{@{}l l l r r r@{}}", r"\toprule",
             r"variant & launch path & weight & device $\mu$s & host $\mu$s & wall $\mu$s \\", r"\midrule"]
    for c in cases:
        for vid, what in ids:
            cells = [rf"\texttt{{{tex(vid)}}}", tex(what), case_tex(c)]
            for key in ("device_us", "host_us", "wall_us"):
                x = get(vid, c, key)
                cells.append(us(x) if x is not None else DASH)
            lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("launch_table.tex", "\n".join(lines) + "\n")


def _fig_ablation(doc: Document, ids, variants, cases, get) -> None:
    modules = Counter(str(variants[v].get("module") or v) for v in ids)
    steps = [v for v in ids if modules[str(variants[v].get("module") or v)] <= 2
             and any(get(v, c, "pct_copy") for c in cases)]
    if not steps:
        doc.write("fig_ablation.tex", missing_box("timed ablation steps (\\texttt{python -m experiments run} "
                                                  "on a GPU)"))
        return
    cols = ["pctA", "pctB"][: len(cases)]
    lines = ["idx label " + " ".join(cols)]
    for i, v in enumerate(reversed(steps)):  # first step at the top
        vals = [f"{get(v, c, 'pct_copy'):.2f}" if get(v, c, "pct_copy") else "nan" for c in cases]
        lines.append(f"{i} {v.replace('_', '-')} " + " ".join(vals))
    doc.write("ablation.dat", "\n".join(lines) + "\n")
    plots = [rf"\addplot table[y=idx, x={col}] {{generated/ablation.dat}};" + "\n"
             + rf"\addlegendentry{{{case_tex(c)}}}" for col, c in zip(cols, cases, strict=True)]
    height = max(5.0, 0.55 * len(steps) + 1.5)
    body = [r"\begin{tikzpicture}",
            rf"\begin{{axis}}[xbar, bar width=3pt, width=0.8\linewidth, height={height:.1f}cm, xmin=0, xmax=100,",
            r"  xlabel={\% of the device-to-device copy bandwidth}, ytick=data,",
            r"  yticklabels from table={generated/ablation.dat}{label},",
            r"  y tick label style={font=\scriptsize\ttfamily}, xmajorgrids, enlarge y limits=0.04,",
            r"  legend style={font=\scriptsize, at={(0.5,1.02)}, anchor=south, legend columns=2}]"]
    doc.write("fig_ablation.tex", "\n".join(body + plots + [r"\end{axis}", r"\end{tikzpicture}"]) + "\n")


def _exact_cell(statuses: list[str]) -> str:
    if not statuses:
        return DASH
    if any(s == "INEXACT" for s in statuses):
        return r"\textbf{NO}"
    if any(s == "error" for s in statuses):
        return "error"
    if any(s.startswith("inexact") for s in statuses):
        return r"no$^\dagger$"
    if all(s == "exact" for s in statuses):
        return "yes"
    if all(s == "skipped" for s in statuses):
        return "GPU"
    return "yes" if any(s == "exact" for s in statuses) else DASH


def _widest(forms) -> str:
    """'st.global.v4.b32 (16 B)' -> the widest access width in bytes, as text ('16 B')."""
    widths = [int(m.group(1)) for k in (forms or {}) for m in [re.search(r"\((\d+) B\)", k)] if m]
    return f"{max(widths)} B" if widths else DASH


def _csv_row(r: dict) -> dict:
    """A CSV row with numbers parsed back (empty cells dropped)."""
    out = {}
    for k, v in r.items():
        if v in ("", None):
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = {"True": True, "False": False}.get(v, v)
    return out
