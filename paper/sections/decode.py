"""results/decode/decode_<gpu>.json (`python -m experiments decode`): greedy decode and prefill of a full-depth
Llama-3-8B-shaped model with random weights, as fast inference runs it (static KV cache; compiled: torch.compile
mode="reduce-overhead", fullgraph, CUDA graphs) and eager, in four modes: dense bf16, bitsandbytes alone, nf4
patched in (plain) and nf4 patched with fused_linear=True.

The table gives, per GPU, model, batch and mode, the decode's ms per token eager and compiled, the compiled one's
speedup over dense bf16 and over bitsandbytes alone, the profiler's share of device time in the 4-bit linear's
kernels, and whether the compiled decode captured one full graph. The macros carry the compiled batch-1 figures of
the fused mode (the issue's bars: 2x dense bf16 and 2x bitsandbytes at batch 1).
"""

from __future__ import annotations

from paper.latex import NM, Document, missing_box, num, pct, ratio, row, tex
from paper.sections.linear import GPUS, load_present

MODES = (("dense", "dense bf16"), ("bnb", "bitsandbytes alone"), ("nf4", r"nf4 patched"),
         ("nf4-fused", r"nf4, \code{fused\_linear}"))
MODELS = {"llama3-8b": "Llama-3-8B", "qwen2.5-7b": "Qwen2.5-7B"}
BAR = 2.0  # the compiled decode's bar at batch 1, over dense bf16 and over bitsandbytes alone
BAR_BATCH8 = 1.5  # issue 34's bar at batch 8, over dense bf16


def load(doc: Document) -> dict:
    """{gpu tag: payload} of the files present (each missing one noted)."""
    out = {}
    for tag, _, label in GPUS:
        name = f"decode/decode_{tag}.json"
        if not (doc.results / name).exists():
            doc.missing.append(f"results/{name} ({label}: python -m experiments decode)")
            continue
        payload = doc.load(name, label="experiments decode", required_for=f"decode table, {label}")
        if isinstance(payload, dict):
            out[tag] = payload
    # a shorter model's compiled run after a change (decode_8layers_<gpu>.json), where one was made
    short = load_present(doc, "decode/decode_8layers_{tag}.json", "experiments decode --layers 8", "prefill macros")
    return {**out, "short": short} if short else out


def _decode_rows(payload: dict) -> dict:
    """{(model, layers, batch, mode, compiled): row} of the decode rows that ran."""
    return {(r.get("model"), r.get("layers"), r.get("batch"), r.get("mode"), bool(r.get("compiled"))): r
            for r in payload.get("rows") or []
            if isinstance(r, dict) and r.get("phase") == "decode" and not r.get("error") and r.get("ms_per_token")}


def summary(payload: dict) -> list[dict]:
    """Per (model, layers, batch, mode): eager and compiled ms per token, the compiled speedups over dense and
    bitsandbytes alone, the compiled linear share and fullgraph, and the commit of the run that measured it (the
    compiled row's; rows merged from several runs keep theirs, so a ratio between two commits is visible)."""
    rows = _decode_rows(payload)
    out = []
    for model, layers, batch in dict.fromkeys(k[:3] for k in rows):
        dense = rows.get((model, layers, batch, "dense", True))
        bnb = rows.get((model, layers, batch, "bnb", True))
        for mode, _ in MODES:
            eager = rows.get((model, layers, batch, mode, False))
            comp = rows.get((model, layers, batch, mode, True))
            if not eager and not comp:
                continue
            ms = comp["ms_per_token"] if comp else None
            out.append({"model": model, "layers": layers, "batch": batch, "mode": mode,
                        "eager_ms": eager["ms_per_token"] if eager else None, "compiled_ms": ms,
                        "vs_dense": dense["ms_per_token"] / ms if dense and ms else None,
                        "vs_bnb": bnb["ms_per_token"] / ms if bnb and ms else None,
                        "linear_share": (comp or {}).get("linear_share"),
                        "fullgraph": (comp or {}).get("fullgraph"),
                        "deterministic": (comp or {}).get("deterministic"),
                        "commit": str((comp or eager).get("commit") or "")[:7]})
    return out


def _prefill_rows(payload: dict) -> list[dict]:
    """The prefill rows that ran without an error."""
    return [r for r in payload.get("rows") or [] if isinstance(r, dict) and r.get("phase") == "prefill"
            and not r.get("error")]


def _key(r: dict) -> tuple:
    return r.get("model"), r.get("batch"), r.get("mode"), bool(r.get("compiled"))


def prefill_device_ms(payload: dict) -> dict:
    """{(model, batch, mode, compiled): (wall ms, device ms)} of the prefill rows whose profile kept the sum over
    all kernels (top_kernels' "(all kernels)"), at the first prompt length."""
    out = {}
    for r in _prefill_rows(payload):
        total = next((t for name, t in r.get("top_kernels") or [] if name == "(all kernels)"), None)
        if total and r.get("ms"):
            out.setdefault(_key(r), (r["ms"], total / 1000))
    return out


def prefill(payload: dict, with_commit: bool = False) -> dict:
    """{(model, batch, mode, compiled): ms per token} of the prefill rows that ran, at the first prompt length
    (with_commit: (ms per token, the row's commit, for a merged file's rows))."""
    out = {}
    for r in _prefill_rows(payload):
        if r.get("ms_per_token"):
            out.setdefault(_key(r), (r["ms_per_token"], r.get("commit")) if with_commit else r["ms_per_token"])
    return out


def build(doc: Document, data: dict | None) -> None:
    data = dict(data or {})
    short = data.pop("short", None) or {}
    doc.macro("NFdecodeBar", ratio(BAR))
    doc.macro("NFdecodeBarBatchEight", ratio(BAR_BATCH8))
    for tag, g, _ in GPUS:
        p = short.get(tag) or {}
        pre = prefill(p, with_commit=True)
        layers = (p.get("config") or {}).get("layers")
        doc.macro(f"NFshortLayers{g}", str(layers) if layers else NM)
        bnb, bnb_commit = pre.get(("llama3-8b", 1, "bnb", True), (None, None))
        commit = bnb_commit or (p.get("environment") or {}).get("commit") or ""
        doc.macro(f"NFshortCommit{g}", tex(commit[:7]) or NM)
        for mode, stem in (("nf4", "Plain"), ("nf4-fused", "Fused")):
            ours, ours_commit = pre.get(("llama3-8b", 1, mode, True), (None, None))
            same_run = ours_commit == bnb_commit  # a merged file: only rows of bitsandbytes' own run compare
            doc.macro(f"NFshortPrefill{stem}VsBnb{g}", ratio(bnb / ours) if bnb and ours and same_run else NM)
        wall, device = prefill_device_ms(p).get(("llama3-8b", 1, "nf4-fused", True), (None, None))
        doc.macro(f"NFshortPrefillFusedWallMs{g}", num(wall, 1) if wall else NM)
        doc.macro(f"NFshortPrefillFusedDeviceMs{g}", num(device, 1) if device else NM)
    sums = {tag: summary(p) for tag, p in data.items()}
    for tag, g, _ in GPUS:
        pre = prefill(data[tag]) if tag in data else {}
        for mode, stem in (("nf4", "Plain"), ("nf4-fused", "Fused")):
            for compiled, when in ((False, "Eager"), (True, "Compiled")):
                bnb, ours = (pre.get(("llama3-8b", 1, m, compiled)) for m in ("bnb", mode))
                # bitsandbytes' prefill time over nf4's: above 1, nf4 is faster
                doc.macro(f"NFprefill{stem}VsBnb{when}{g}", ratio(bnb / ours) if bnb and ours else NM)
        dev = prefill_device_ms(data[tag]) if tag in data else {}
        for mode, stem in (("bnb", "Bnb"), ("nf4-fused", "Fused")):
            wall, device = dev.get(("llama3-8b", 1, mode, True), (None, None))
            doc.macro(f"NFprefill{stem}WallMs{g}", num(wall, 1) if wall else NM)
            doc.macro(f"NFprefill{stem}DeviceMs{g}", num(device, 1) if device else NM)
        fused = next((s for s in sums.get(tag) or [] if s["mode"] == "nf4-fused" and s["batch"] == 1), None)
        doc.macro(f"NFdecodeFusedVsDense{g}", ratio(fused["vs_dense"]) if fused and fused["vs_dense"] else NM)
        doc.macro(f"NFdecodeFusedVsBnb{g}", ratio(fused["vs_bnb"]) if fused and fused["vs_bnb"] else NM)
        doc.macro(f"NFdecodeFusedMs{g}", num(fused["compiled_ms"], 2) if fused and fused["compiled_ms"] else NM)
        doc.macro(f"NFdecodeFusedLinearShare{g}", pct(100 * fused["linear_share"]) if fused and fused["linear_share"]
                  else NM)
        doc.macro(f"NFdecodeLayers{g}", str(fused["layers"]) if fused else NM)
        for batch, word in ((8, "Eight"), (32, "ThirtyTwo")):  # the batch bars: compiled, fused mode
            at = next((s for s in sums.get(tag) or [] if s["mode"] == "nf4-fused" and s["batch"] == batch), None)
            doc.macro(f"NFdecodeFusedVsDenseB{word}{g}", ratio(at["vs_dense"]) if at and at["vs_dense"] else NM)
            doc.macro(f"NFdecodeFusedVsBnbB{word}{g}", ratio(at["vs_bnb"]) if at and at["vs_bnb"] else NM)
            doc.macro(f"NFdecodeFusedLinearShareB{word}{g}",
                      pct(100 * at["linear_share"]) if at and at["linear_share"] else NM)
    if not sums:
        doc.write("decode_table.tex", missing_box(r"results/decode/decode\_<gpu>.json (\texttt{python -m experiments "
                                                  r"decode} on a GPU)"))
        return
    lines = [r"\begin{tabular}{llllrrrrrll}", r"\toprule",
             row(["GPU", "model", "batch", "mode", "eager ms/token", "compiled ms/token", "vs dense", "vs bnb",
                  r"4-bit linear (\%)", "full graph", "commit"]), r"\midrule"]
    for tag, _, label in GPUS:
        for s in sums.get(tag) or []:
            model = tex(MODELS.get(s["model"], s["model"]))
            lines.append(row([label, model, str(s["batch"]), dict(MODES).get(s["mode"], tex(s["mode"])),
                              num(s["eager_ms"], 2) if s["eager_ms"] else NM,
                              num(s["compiled_ms"], 2) if s["compiled_ms"] else NM,
                              ratio(s["vs_dense"]) if s["vs_dense"] else NM,
                              ratio(s["vs_bnb"]) if s["vs_bnb"] else NM,
                              pct(100 * s["linear_share"]) if s["linear_share"] else "---",
                              {True: "yes", False: "no"}.get(s["fullgraph"], "---"),
                              rf"\code{{{tex(s['commit'])}}}" if s["commit"] else "---"]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("decode_table.tex", "\n".join(lines) + "\n")
