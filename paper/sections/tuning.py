"""results/tuning/: the design history (bench runs of intermediate kernels and the last two labs)."""

from __future__ import annotations

from paper.latex import (
    DASH,
    NM,
    Document,
    dtype_short,
    integer,
    missing_box,
    pct,
    ratio,
    result_rows,
    row,
    shape_tex,
    tex,
    us,
)
from paper.sections import PROBE_CASES


def load(doc: Document) -> dict | None:
    """The bench files of results/tuning/ and their labels from its README table, or None (noted as missing)."""
    folder = doc.results / "tuning"
    names = sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []
    if not names:
        doc.missing.append("results/tuning/*.json (design history of the layout)")
        return None
    labels = {}
    readme = folder / "README.md"
    if readme.exists():
        raw = readme.read_bytes()
        doc.record("results/tuning/README.md", raw, "tuning notes", None)
        for line in raw.decode().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and cells[0].endswith(".json"):
                labels[cells[0]] = cells[1]
    files = {}
    for name in names:
        payload = doc.load(f"tuning/{name}", label="nf4.bench (design history)", required_for="history")
        if isinstance(payload, dict):
            files[name] = payload
    return {"labels": labels, "files": files}


def build(doc: Document, data: dict | None) -> None:
    """Macros and the table of the layouts measured while choosing the design (results/tuning/)."""
    shapes = (((8192, 2048), "float16"), ((14336, 4096), "bfloat16"), ((28672, 8192), "bfloat16"))
    files = (data or {}).get("files") or {}
    labels = (data or {}).get("labels") or {}
    nf4 = {}
    for name, payload in files.items():
        for r in result_rows(payload.get("rows")):
            if r.get("provider") == "nf4":
                nf4[(name, tuple(r.get("shape") or ()), str(r.get("dtype")))] = r

    def slowdown(shape, key="device_us"):
        a = (nf4.get(("h200_row16_layout.json", *shape)) or {}).get(key)
        b = (nf4.get(("h200_word_layout.json", *shape)) or {}).get(key)
        return a / b if a and b else None

    doc.macro("NFtuneFiles", integer(len(files)) if files else NM)
    doc.macro("NFtuneDevice", tex(((next(iter(files.values()), {}) or {}).get("env") or {}).get("device") or "")
              if files else NM)
    doc.macro("NFtuneMidShape", shape_tex(shapes[1][0]) + " " + dtype_short(shapes[1][1]))
    doc.macro("NFtuneLargeShape", shape_tex(shapes[2][0]) + " " + dtype_short(shapes[2][1]))
    doc.macro("NFtuneRowSixteenSlowdownMid", ratio(slowdown(shapes[1])))
    doc.macro("NFtuneRowSixteenSlowdownLarge", ratio(slowdown(shapes[2])))
    doc.macro("NFtuneRowSixteenGraphSlowdownSmall", ratio(slowdown(shapes[0], "graph_us")))
    doc.macro("NFtuneSmallShape", shape_tex(shapes[0][0]) + " " + dtype_short(shapes[0][1]))
    _pipe_lab(doc, files.get("h200_lab_pipe.json"), files.get("h200_lab_l2hint.json"))
    shown = [n for n in files if any((n, *s) in nf4 for s in shapes)]
    if not shown:
        doc.write("tuning_table.tex", missing_box("results/tuning/ (layouts measured while choosing the design)"))
        return
    head = " & ".join(rf"\multicolumn{{2}}{{c}}{{{shape_tex(s[0])} {dtype_short(s[1])}}}" for s in shapes)
    rule = "".join(rf"\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(shapes)))
    lines = [rf"\begin{{tabular}}{{@{{}}>{{\raggedright\arraybackslash}}p{{5.4cm}} {'r r ' * len(shapes)}@{{}}}}",
             r"\toprule", rf"layout measured (file) & {head} \\", rule,
             " & " + " & ".join([r"$\mu$s & \% copy"] * len(shapes)) + r" \\", r"\midrule"]
    for name in shown:
        cells = [tex(labels.get(name, "")) + rf" (\texttt{{{tex(name.removesuffix('.json'))}}})"]
        for s in shapes:
            r = nf4.get((name, *s)) or {}
            cells += [us(r.get("device_us")) if r.get("device_us") else DASH,
                      pct(r.get("pct_copy")) if r.get("pct_copy") else DASH]
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("tuning_table.tex", "\n".join(lines) + "\n")


def _pipe_lab(doc: Document, pipe: dict | None, hint: dict | None) -> None:
    """Macros from the last two labs at the mid weight: double buffer / TMA stores, and the L2 prefetch hint."""
    mid = PROBE_CASES[1]
    rows = [r for r in result_rows((pipe or {}).get("lab")) if r.get("case") == mid and r.get("device_us")]
    default = next((r["device_us"] for r in rows if r.get("what") == "nf4 with its defaults"), None)
    variants = [r for r in result_rows((pipe or {}).get("lab")) if r.get("what") != "nf4 with its defaults"]
    defaults = {r.get("case"): r.get("device_us") for r in result_rows((pipe or {}).get("lab"))
                if r.get("what") == "nf4 with its defaults"}
    timed = [r for r in variants if r.get("device_us") and defaults.get(r.get("case"))]
    doc.macro("NFpipeCommit", tex(str(((pipe or {}).get("env") or {}).get("commit") or "")[:7]) if pipe else NM)
    doc.macro("NFpipeVariantCount", integer(len({r["what"] for r in timed})) if timed else NM)
    doc.macro("NFpipeCaseCount", integer(len({r["case"] for r in timed})) if timed else NM)
    doc.macro("NFpipeTimedCount", integer(len(timed)) if timed else NM)
    doc.macro("NFpipeFasterCount", integer(sum(r["device_us"] < defaults[r["case"]] for r in timed))
              if timed else NM)
    doc.macro("NFpipeDefaultUsMid", us(default) if default else NM)
    for name, pick in (("Buffer", lambda r: r.get("prefetch_next") and not r.get("tma_store")),
                       ("Tma", lambda r: r.get("tma_store"))):
        best = min((r for r in rows if pick(r)), key=lambda r: r["device_us"], default=None)
        doc.macro(f"NFpipeBest{name}UsMid", us(best["device_us"]) if best else NM)
        doc.macro(f"NFpipeBest{name}Slowdown", ratio(best["device_us"] / default) if best and default else NM)
    hint_rows = {r.get("what"): r.get("device_us") for r in result_rows((hint or {}).get("lab"))
                 if r.get("case") == mid and r.get("device_us")}
    doc.macro("NFhintCommit", tex(str(((hint or {}).get("env") or {}).get("commit") or "")[:7]) if hint else NM)
    plain = hint_rows.get("lab nf4, 2 words/thread, 2 warps, load 4")
    hinted = [hint_rows.get(f"lab nf4, 2 words/thread, 2 warps, load {k}") for k in (5, 6)]
    hinted = [h for h in hinted if h]
    doc.macro("NFhintPlainUsMid", us(plain) if plain else NM)
    doc.macro("NFhintBestUsMid", us(min(hinted)) if hinted else NM)
