"""results/catalog/dequant_<gpu>.json (`python -m experiments catalog-bench dequant`): nf4.dequantize over the shape
catalog (every distinct linear-layer shape of the public models in experiments/shapes.json), beside its peers in the
same run; and results/labs/gemv_skeletons_<gpu>.json (`python -m experiments.labs.gemv_lut`): the GEMV lab's
skeletons beside cuBLAS's GEMV on as many bf16 bytes.

The catalog table gives, per GPU and peer, the minimum, median and maximum of the peer's time over nf4's (a speedup)
and the count of rows where nf4 is slower; then nf4's time over the byte floor, and the rows of 16 Mi weights or more
that reach less than 90 % of the copy bandwidth measured in the run. The figure draws nf4's time over the floor
against the weight's size. The lab table gives each skeleton's time at M = 1 over the same-bytes GEMV's.
"""

from __future__ import annotations

import statistics

from paper.latex import NM, Document, integer, missing_box, ratio, row, tex
from paper.sections.linear import GPUS, load_present

BIG = 16 * 2**20  # weights: the bar on copy bandwidth applies from here
BANDWIDTH_BAR = 0.9
DASHES = "---"
PEER_NAMES = {"bnb_dequantize_4bit": "bitsandbytes dequantize\\_4bit",
              "unsloth_dequantize": "Unsloth fast\\_dequantize"}
# the bulk-copy skeleton's ablation (results/labs/gemv_bulk_<gpu>.json), in the order it adds work; (key, head, macro)
BULK = (("nf4.linear", "nf4.linear", "Product"), ("t_stream4x2", "TMA stream", "Stream"),
        ("t_absmax4x2", "+ absmax", "Absmax"), ("t_none4x2_nox", "+ products, x fixed", "Nox"),
        ("t_none4x2", "+ x, every lane", "None"), ("t_none4x2_xp", "x, real rows", "Xp"),
        ("t_prmt4x2_xp", "prmt decode", "Prmt"), ("none_fs_xp", "first control, x real rows", "FirstXp"),
        ("pair16_fs_xp", "first, pair table", "FirstPair"), ("sc_w4", "scaled contract", "Scaled"))
LAB = (("nf4.linear", "nf4.linear"), ("none_fs", "control, no decode"), ("prmt", "prmt table"),
       ("pair16_fs", "pair table"), ("d_none", "deep control"), ("d_pair16", "deep pair"))
# the lookups split between the ALU pipe and shared memory (results/labs/gemv_split_<gpu>.json): the first skeleton
# with whole-sector loads and x in the lanes of real rows, the first n of a lane's 8 words by prmt
SPLIT = (("nf4.linear", "nf4.linear"), ("none_fs_xp", "control, no decode"), ("prmt_fs_xp", "prmt, 8 of 8"),
         ("pair16_fs_xp_p3", "prmt 3, pair 5"), ("pair16_fs_xp_p2", "prmt 2, pair 6"),
         ("pair16_fs_xp_p1", "prmt 1, pair 7"), ("pair16_fs_xp", "pair, 8 of 8"))
SPLIT_BEST = "pair16_fs_xp_p2"


def load(doc: Document) -> dict:
    """{"dequant": {gpu tag: payload}, "lab": {gpu tag: payload}}: the files present (each missing one noted)."""
    out = {"dequant": {}, "lab": {}, "sass": None, "linear": {},
           "race": load_present(doc, "labs/config_race_judged_{tag}.json",
                                "experiments.labs.config_race --report --current", "config race paragraph"),
           "bulk": load_present(doc, "labs/gemv_bulk_{tag}.json", "experiments.labs.gemv_lut", "bulk lab table"),
           "split": load_present(doc, "labs/gemv_split_{tag}.json", "experiments.labs.gemv_lut", "split lab table"),
           "autotune": load_present(doc, "catalog/autotune_{tag}.json", "experiments catalog-bench races",
                                    "autotuning paragraph")}
    if (doc.results / "labs/sass_sm90.json").exists():  # offline builds: no GPU, one file
        payload = doc.load("labs/sass_sm90.json", label="experiments.labs.sass_count", required_for="SASS table")
        out["sass"] = payload if isinstance(payload, dict) else None
    else:
        doc.missing.append("results/labs/sass_sm90.json (python -m experiments.labs.sass_count --json ...)")
    for tag, _, label in GPUS:
        for kind, name, command in (("dequant", f"catalog/dequant_{tag}.json", "experiments catalog-bench dequant"),
                                    ("linear", f"catalog/linear_{tag}.json", "experiments catalog-bench linear"),
                                    ("lab", f"labs/gemv_skeletons_{tag}.json", "experiments.labs.gemv_lut")):
            if not (doc.results / name).exists():
                doc.missing.append(f"results/{name} ({label}: python -m {command})")
                continue
            payload = doc.load(name, label=command, required_for=f"catalog section, {label}")
            if isinstance(payload, dict):
                out[kind][tag] = payload
    return out


def _timed(payload: dict) -> list[dict]:
    return [r for r in payload.get("rows") or [] if isinstance(r, dict) and r.get("nf4_us") and r.get("floor_us")
            and r.get("exact", True)]


def summary(payload: dict) -> dict:
    """Per peer (min, median, max speedup, rows slower, rows), nf4 over the floor (min, median, max), and the
    (rows under the bandwidth bar, rows) of 16 Mi weights or more."""
    rows = _timed(payload)
    peers = {}
    for peer in sorted({p for r in rows for p in (r.get("peers_us") or {})}):
        s = [r["peers_us"][peer] / r["nf4_us"] for r in rows if (r.get("peers_us") or {}).get(peer)]
        if s:
            peers[peer] = (min(s), statistics.median(s), max(s), sum(v < 1 for v in s), len(s))
    over = [r["nf4_us"] / r["floor_us"] for r in rows]
    big = [r for r in rows if r["N"] * r["K"] >= BIG]
    under = sum(r["floor_us"] / r["nf4_us"] < BANDWIDTH_BAR for r in big)
    return {"peers": peers, "floor": (min(over), statistics.median(over), max(over)) if over else None,
            "big": (under, len(big)), "rows": len(rows)}


def build(doc: Document, data: dict) -> None:
    dequant = data.get("dequant") or {}
    sums = {tag: summary(p) for tag, p in dequant.items()}
    doc.macro("NFcatBandwidthBar", str(round(BANDWIDTH_BAR * 100)))
    doc.macro("NFcatBigMi", str(BIG // 2**20))
    for tag, g, _ in GPUS:
        s = sums.get(tag)
        doc.macro(f"NFcatRows{g}", integer(s["rows"]) if s else NM)
        for peer, stem in (("bnb_dequantize_4bit", "Bnb"), ("unsloth_dequantize", "Unsloth")):
            p = (s or {}).get("peers", {}).get(peer)
            doc.macro(f"NFcat{stem}Min{g}", ratio(p[0]) if p else NM)
            doc.macro(f"NFcat{stem}Median{g}", ratio(p[1]) if p else NM)
            doc.macro(f"NFcat{stem}Slower{g}", integer(p[3]) if p else NM)
        doc.macro(f"NFcatFloorMedian{g}", ratio(s["floor"][1]) if s and s["floor"] else NM)
        doc.macro(f"NFcatBigUnder{g}", integer(s["big"][0]) if s else NM)
        doc.macro(f"NFcatBig{g}", integer(s["big"][1]) if s else NM)
    _table(doc, sums)
    _figure(doc, dequant)
    _linear_bars(doc, data.get("linear") or {})
    _lab(doc, data.get("lab") or {}, LAB, "gemv_skeletons")
    _lab(doc, data.get("split") or {}, SPLIT, "gemv_split")
    _split(doc, data.get("split") or {})
    _bulk(doc, data.get("bulk") or {})
    _sass(doc, data.get("sass"))
    _race(doc, data.get("race") or {})
    _autotune(doc, data.get("autotune") or {}, data.get("linear") or {})


def _autotune(doc: Document, races: dict, linear: dict) -> None:
    """The autotuner's races per GPU: keys raced, the catalog's inversions before and after, and the catalog's time of
    the choice over the fastest raced time (median over M of the per-M medians' range, rows over 10 %); the rows of
    the linear catalog per commit."""
    for tag, g, _ in GPUS:
        r = races.get(tag) or {}
        judged = [j for j in (r.get("judged") or {}).values() if isinstance(j, dict) and j.get("keys")]
        doc.macro(f"NFautotuneKeys{g}", integer(len(r["entries"])) if r.get("entries") else NM)
        doc.macro(f"NFautotuneJudged{g}", integer(sum(j["keys"] for j in judged)) if judged else NM)
        doc.macro(f"NFautotuneOverTen{g}", integer(sum(j["over_10pct"] for j in judged)) if judged else NM)
        doc.macro(f"NFautotuneMedianMax{g}", ratio(max(j["median"] for j in judged)) if judged else NM)
        small = [g for m, g in (r.get("table_over_choice") or {}).items() if int(m) <= 16 and isinstance(g, dict)]
        doc.macro(f"NFautotuneChangedSmall{g}", integer(sum(x["changed"] for x in small)) if small else NM)
        doc.macro(f"NFautotuneKeysSmall{g}", integer(sum(x["keys"] for x in small)) if small else NM)
        doc.macro(f"NFautotuneGainMaxSmall{g}", ratio(max(x["max"] for x in small)) if small else NM)
        for when, stem in (("before", "Before"), ("catalog", "After")):
            inv = ((r.get(when) or {}).get("inversions") or {})
            doc.macro(f"NFautotuneInversions{stem}{g}", integer(inv["count"]) if "count" in inv else NM)
        commits = (linear.get(tag) or {}).get("row_commits") or {}  # written by catalog-bench merge
        doc.macro(f"NFcatLinearRowCommits{g}", tex(", ".join(f"{c} ({n:,} rows)" for c, n in commits.items()))
                  if commits else NM)


def _race(doc: Document, race: dict) -> None:
    """Macros of the config race's judged report per GPU: rows, rows more than 10 % slower than the best one-launch
    config (the table as timed, and this commit's), inversions; the same on the repeat run."""
    doc.macro("NFraceBarPct", "10")  # the catalog issue's bar: within 10 % of the best config a sweep finds
    for tag, g, _ in GPUS:
        p = race.get(tag) or {}
        doc.macro(f"NFraceCommit{g}", tex(str(p.get("judged_at", NM))[:7]) if p else NM)
        for run, stem in ((p, ""), (p.get("repeat") or {}, "Rep")):
            for table, tstem in (("timed_table", "Timed"), ("current_table", "Now")):
                t = run.get(table) or {}
                for sub, sstem in (("fit", "Fit"), ("held-out", "Held")):
                    v = (t.get("vs_one_launch") or {}).get(sub)
                    doc.macro(f"NFrace{stem}{tstem}{sstem}Rows{g}", integer(v["rows"]) if v else NM)
                    doc.macro(f"NFrace{stem}{tstem}{sstem}Over{g}", integer(v["rows"] - v["within_10pct"]) if v else NM)
                inv = t.get("inversions")
                doc.macro(f"NFrace{stem}{tstem}Inv{g}", integer(inv["inversions"]) if inv else NM)
                doc.macro(f"NFrace{stem}{tstem}Pairs{g}", integer(inv["pairs"]) if inv else NM)


def _table(doc: Document, sums: dict) -> None:
    if not sums:
        doc.write("catalog_dequant_table.tex", missing_box(r"results/catalog/dequant\_<gpu>.json (\texttt{python -m "
                                                           r"experiments catalog-bench dequant} on a GPU)"))
        return
    lines = [r"\begin{tabular}{llrrrr}", r"\toprule",
             row(["GPU", "against", "min", "median", "max", "nf4 slower"]), r"\midrule"]
    for tag, _, label in GPUS:
        s = sums.get(tag)
        if not s:
            continue
        for peer, (lo, med, hi, slower, n) in s["peers"].items():
            lines.append(row([label, PEER_NAMES.get(peer, tex(peer)), ratio(lo), ratio(med), ratio(hi),
                              f"{slower} of {n}"]))
        lo, med, hi = s["floor"]
        under, big = s["big"]
        lines.append(row([label, "nf4 time / byte floor", ratio(lo), ratio(med), ratio(hi), DASHES]))
        lines.append(row([label, rf"$\geq${BIG // 2**20}\,Mi weights under {round(BANDWIDTH_BAR * 100)}\,\% of copy "
                                 r"bandwidth", "", "", "",
                          f"{under} of {big}"]))
        lines.append(r"\midrule" if tag != GPUS[-1][0] else "")
    lines = [ln for ln in lines if ln] + [r"\bottomrule", r"\end{tabular}"]
    doc.write("catalog_dequant_table.tex", "\n".join(lines) + "\n")



# issue 34's forward bars as the linear catalog's summary names them (experiments.catalog_bench.BARS): (key, label)
LINEAR_BARS = (("m1_same_bytes", r"$M{=}1$: $\leq$1.3$\times$ cuBLAS on as many bytes ($\geq$16\,Mi weights)"),
               ("m1_best_4bit_peer", r"$M{=}1$: $\geq$2$\times$ the best 4-bit peer"),
               ("m1_dense", r"$M{=}1$: $\geq$2.5$\times$ dense bf16 cuBLAS"),
               ("m2_16_dense", r"$M{=}2$--16: $\geq$2$\times$ dense"),
               ("m17_128_dense", r"$M{=}17$--128: faster than dense"),
               ("m129_512_dense", r"$M{=}129$--512: $\leq$1.1$\times$ dense time"),
               ("m1024_dense", r"$M\geq1024$: $\leq$1.05$\times$ dense time"))


INVERSION_PCT = 3  # the catalog issue's bar: at M <= 16 a larger M never more than 3 % faster


def _linear_bars(doc: Document, linear: dict) -> None:
    """The linear catalog's bars per GPU: rows that hold of the rows the bar applies to, and the worst ratio; the
    inversion bar of the catalog issue beside them."""
    doc.macro("NFcatInversionPct", str(INVERSION_PCT))
    for tag, g, _ in GPUS:
        summ = (linear.get(tag) or {}).get("summary") or {}
        inv = summ.get("inversions") or {}
        doc.macro(f"NFcatLinearInversions{g}", integer(inv["count"]) if "count" in inv else NM)
        doc.macro(f"NFcatLinearRows{g}", integer(summ["rows"]) if "rows" in summ else NM)
        doc.macro(f"NFcatLinearExact{g}", integer(summ["exact"]) if "exact" in summ else NM)
        commits = sorted({str(((part.get("environment") or {}).get("commit")) or "")[:7]
                          for part in ((linear.get(tag) or {}).get("parts") or [])} - {""})
        doc.macro(f"NFcatLinearCommits{g}", tex(", ".join(commits)) if commits else NM)
        for peer, stem in (("bnb_matmul_4bit", "Bnb"), ("dense_cublas", "Dense"), ("unsloth_gemv", "Unsloth"),
                           ("same_bytes_cublas", "SameBytes")):
            p = (summ.get("peers") or {}).get(peer) or {}
            doc.macro(f"NFcatLinear{stem}Median{g}", ratio(p["speedup_median"]) if p.get("speedup_median") else NM)
            doc.macro(f"NFcatLinear{stem}Slower{g}", integer(p["nf4_slower"]) if "nf4_slower" in p else NM)
            doc.macro(f"NFcatLinear{stem}Rows{g}", integer(p["n"]) if "n" in p else NM)
    if not linear:
        doc.write("catalog_linear_bars_table.tex", missing_box(r"results/catalog/linear\_<gpu>.json (\texttt{python "
                                                               r"-m experiments catalog-bench linear} on a GPU)"))
        return
    shown = [(tag, label) for tag, _, label in GPUS if tag in linear]
    lines = [r"\begin{tabular}{l" + "rr" * len(shown) + "}", r"\toprule",
             row(["bar", *[x for _, label in shown for x in (f"{label}: held", "worst")]]), r"\midrule"]
    for key, label in LINEAR_BARS:
        cells = []
        for tag, _ in shown:
            b = (((linear[tag].get("summary") or {}).get("bars") or {}).get(key)) or {}
            worst = (b.get("worst") or {}).get("value")
            cells += [f"{b['held']} of {b['rows']}" if b.get("rows") else NM, ratio(worst) if worst else NM]
        lines.append(row([label, *cells]))
    inv = [((linear[tag].get("summary") or {}).get("inversions") or {}) for tag, _ in shown]
    lines.append(row([rf"$M\leq16$: no inversion over {INVERSION_PCT}\,\%",
                      *[x for i in inv for x in ((f"{i['count']} found" if "count" in i else NM), DASHES)]]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("catalog_linear_bars_table.tex", "\n".join(lines) + "\n")


def _figure(doc: Document, dequant: dict) -> None:
    plots = []
    for tag, _, label in GPUS:
        p = dequant.get(tag)
        if not p:
            continue
        pts = sorted((r["N"] * r["K"], r["nf4_us"] / r["floor_us"]) for r in _timed(p))
        name = f"catalog_dequant_{tag}.dat"
        doc.write(name, "weights over\n" + "".join(f"{w} {o:.4f}\n" for w, o in pts))
        plots.append(rf"\addplot+[only marks, mark size=1pt] table[x=weights, y=over] {{generated/{name}}};"
                     rf" \addlegendentry{{{label}}}")
    if not plots:
        doc.write("fig_catalog_dequant.tex", missing_box(r"results/catalog/dequant\_<gpu>.json"))
        return
    body = [r"\begin{tikzpicture}", r"\begin{axis}[width=\linewidth, height=5cm, xmode=log, ymode=log,",
            r"  xlabel={weights ($N \times K$)}, ylabel={nf4 time / byte floor}, legend pos=north east]",
            *plots, r"\end{axis}", r"\end{tikzpicture}"]
    doc.write("fig_catalog_dequant.tex", "\n".join(body) + "\n")


def _lab(doc: Document, lab: dict, columns: tuple, stem: str) -> None:
    """Table <stem>_table.tex from results/labs/<stem>_<gpu>.json: each provider's time at M = 1 over the same
    run's cuBLAS GEMV on as many bf16 bytes, per GPU and weight."""
    if not lab:
        doc.write(f"{stem}_table.tex", missing_box(rf"results/labs/{tex(stem)}\_<gpu>.json"))
        return
    shown = [(key, head) for key, head in columns if any(r.get("provider") == key for p in lab.values()
                                                         for r in p.get("rows") or [])]
    lines = [r"\begin{tabular}{ll" + "r" * (len(shown) + 1) + "}", r"\toprule",
             row(["GPU", r"$N \times K$", r"same bytes (\textmu s)", *[tex(h) for _, h in shown]]), r"\midrule"]
    for tag, _, label in GPUS:
        p = lab.get(tag)
        if not p:
            continue
        rows = [r for r in p.get("rows") or [] if r.get("M") == 1]
        for n, k in dict.fromkeys((r["N"], r["K"]) for r in rows):
            here = {r["provider"]: r for r in rows if (r["N"], r["K"]) == (n, k)}
            base = (here.get("dense F.linear [N, K/4]") or {}).get("graph_us")
            cells = []
            for key, _ in shown:
                us = (here.get(key) or {}).get("graph_us")
                cells.append(ratio(us / base) if us and base else NM)
            lines.append(row([label, rf"{n}$\times${k}", f"{base:.1f}" if base else NM, *cells]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write(f"{stem}_table.tex", "\n".join(lines) + "\n")


def split_ratios(payload: dict, key: str = SPLIT_BEST) -> dict:
    """{(N, K): the provider's time over nf4.linear's} at M = 1, where both ran and the provider was exact."""
    here: dict = {}
    for r in payload.get("rows") or []:
        if isinstance(r, dict) and r.get("M") == 1 and r.get("graph_us"):
            here.setdefault((r["N"], r["K"]), {})[r["provider"]] = r
    return {nk: v[key]["graph_us"] / v["nf4.linear"]["graph_us"] for nk, v in here.items()
            if key in v and "nf4.linear" in v and v[key].get("operand_mismatches") == 0}


def _split(doc: Document, split: dict) -> None:
    """Macros: the best split candidate's time over nf4.linear's on weights of 16 Mi or more (min, max) and on every
    weight timed (how many it beats), per GPU."""
    for tag, g, _ in GPUS:
        ratios = split_ratios(split[tag]) if tag in split else {}
        big = [v for (n, k), v in ratios.items() if n * k >= BIG]
        doc.macro(f"NFsplitBigMin{g}", ratio(min(big)) if big else NM)
        doc.macro(f"NFsplitBigMax{g}", ratio(max(big)) if big else NM)
        doc.macro(f"NFsplitFaster{g}", integer(sum(v < 1 for v in ratios.values())) if ratios else NM)
        doc.macro(f"NFsplitShapes{g}", integer(len(ratios)) if ratios else NM)


def bulk_ratios(payload: dict) -> dict:
    """{(N, K): {provider: time / its own run's same-bytes cuBLAS time}} at M = 1."""
    out = {}
    for r in payload.get("rows") or []:
        if not isinstance(r, dict) or r.get("M") != 1 or not r.get("graph_us") or not r.get("same_bytes_us"):
            continue
        out.setdefault((r["N"], r["K"]), {})[r["provider"]] = r["graph_us"] / r["same_bytes_us"]
    return out


def _bulk(doc: Document, bulk: dict) -> None:
    for tag, g, _ in GPUS:
        ratios = bulk_ratios(bulk[tag]) if tag in bulk else {}
        big = [v for (n, k), v in ratios.items() if n * k >= BIG]
        for key, _, stem in BULK:
            vals = [v[key] for v in big if key in v]
            doc.macro(f"NFbulk{stem}Min{g}", ratio(min(vals)) if vals else NM)
            doc.macro(f"NFbulk{stem}Max{g}", ratio(max(vals)) if vals else NM)
        errs = [r["contract"]["max_err_over_bound"] for r in (bulk.get(tag) or {}).get("rows") or []
                if isinstance(r, dict) and isinstance(r.get("contract"), dict)]
        beyond = sum(r["contract"].get("beyond", 0) for r in (bulk.get(tag) or {}).get("rows") or []
                     if isinstance(r, dict) and isinstance(r.get("contract"), dict))
        doc.macro(f"NFbulkScaledErr{g}", f"{max(errs):.2f}" if errs else NM)
        doc.macro(f"NFbulkScaledBeyond{g}", integer(beyond) if errs else NM)
    if not bulk:
        doc.write("gemv_bulk_table.tex", missing_box(r"results/labs/gemv\_bulk\_<gpu>.json"))
        return
    lines = [r"\begin{tabular}{ll" + "r" * (len(BULK) + 1) + "}", r"\toprule",
             row(["GPU", r"$N \times K$", r"same bytes (\textmu s)", *[tex(h) for _, h, _ in BULK]]), r"\midrule"]
    for tag, _, label in GPUS:
        p = bulk.get(tag)
        if not p:
            continue
        base = {(r["N"], r["K"]): r.get("graph_us") for r in p.get("rows") or []
                if r.get("M") == 1 and r.get("provider") == "dense F.linear [N, K/4]"}
        for (n, k), v in bulk_ratios(p).items():
            lines.append(row([label, rf"{n}$\times${k}", f"{base[(n, k)]:.1f}" if base.get((n, k)) else NM,
                              *[ratio(v[key]) if key in v else NM for key, _, _ in BULK]]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("gemv_bulk_table.tex", "\n".join(lines) + "\n")


# the offline sm_90 builds in the SASS table, in this order: (build, label)
SASS = (("baseline", "nf4.linear's GEMV (prmt table)"), ("gemv_pair", "product pair table"),
        ("s_none", "control, second skeleton"), ("b_none", "control, bulk copies"),
        ("t_none8", "control, tensor copies"), ("prmt", "prmt table"), ("pair16", "pair table (fp32, 16 copies)"),
        ("pair16_p1", "pair table, 1 of 8 words by prmt"), ("pair16_p2", "pair table, 2 of 8 by prmt"),
        ("pair16_p3", "pair table, 3 of 8 by prmt"), ("pair16_p4", "pair table, half by prmt"),
        ("level_prmt", "16-level table, prmt address"),
        ("t_prmt8", "prmt, tensor copies"), ("scaled", "scaled contract: level pairs"))


SASS_BUDGET = 1.25  # issue 34's decode budget: instructions per weight on any one pipe


def _sass(doc: Document, payload) -> None:
    doc.macro("NFsassBudget", ratio(SASS_BUDGET))
    rows = {r.get("build"): r for r in (payload or {}).get("builds") or [] if isinstance(r, dict) and "error" not in r}
    for build, stem in (("prmt", "Prmt"), ("pair16", "Pair"), ("scaled", "Scaled"), ("pair16_p2", "PairPTwo")):
        p = (rows.get(build) or {}).get("per_weight") or {}
        doc.macro(f"NFsass{stem}Alu", ratio(p.get("alu")) if p else NM)
        doc.macro(f"NFsass{stem}Imad", ratio(p.get("imad")) if p else NM)
        doc.macro(f"NFsass{stem}Wavefronts", ratio(p.get("shared_wavefronts")) if p else NM)
        doc.macro(f"NFsass{stem}Total", ratio(p.get("total")) if p else NM)
    doc.macro("NFsassTriton", tex((payload or {}).get("environment", {}).get("triton", NM)) if payload else NM)
    if not rows:
        doc.write("sass_table.tex", missing_box(r"results/labs/sass\_sm90.json"))
        return
    lines = [r"\begin{tabular}{lrrrrrrr}", r"\toprule",
             row(["kernel (main loop)", "regs", "ALU", "IMAD", "FP32", "shared wavefronts", "LSU", "all"]),
             r"\midrule"]
    for build, label in SASS:
        r = rows.get(build)
        if not r or label is None:
            continue
        p = r["per_weight"]
        lines.append(row([tex(label), str(r.get("registers", NM)), ratio(p["alu"]), ratio(p["imad"]),
                          ratio(p["fp32"]), ratio(p["shared_wavefronts"]), ratio(p["lsu"]), ratio(p["total"])]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("sass_table.tex", "\n".join(lines) + "\n")
