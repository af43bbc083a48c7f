"""results/verify_<device>.json (`python -m verify`): the bit-exact matrix of one device."""

from __future__ import annotations

from collections import Counter

from paper.latex import DASH, NM, Document, integer, missing_box, row, tex

# Known-defect ids (verify/known.py) that the prose names; their cell counts become macros.
DEFECT_MACROS = {
    "bnb-cpu-avx512-absmax-index": "AvxIndex",
    "bnb-cpu-1d-shape": "OneDShape",
    "bnb-cpu-avx512bf16-subnormal": "AvxBfSubnormal",
    "bnb-cuda-odd-storage": "OddStorage",
    "triton-interpreter-bf16-truncation": "InterpreterBf",
    "inductor-fp-fusion": "InductorFusion",
    "ieee-subnormals-on-cuda": "IeeeSubnormals",
}


def build(doc: Document, payload: dict | None, which: str, table_name: str) -> None:
    """Macros and the bit-exact matrix of one verify_<device>.json; `which` is the macro stem, Cpu or Gpu."""
    env = (payload or {}).get("env") or {}
    matrix = (payload or {}).get("matrix") or {}
    summary = matrix.get("summary") or {}
    doc.macro(f"NFverify{which}Device", tex(env["device"]) if env.get("device") else NM)
    for key, stem in (("torch", "Torch"), ("triton", "Triton"), ("bitsandbytes", "Bnb")):
        doc.macro(f"NFverify{which}{stem}", tex(env[key]) if env.get(key) else NM)
    doc.macro(f"NFverify{which}Cases", integer(matrix.get("cases")) if payload else NM)
    doc.macro(f"NFverify{which}Seconds", integer(round(matrix["seconds"])) if matrix.get("seconds") else NM)
    doc.macro(f"NFverify{which}Failed", integer(matrix.get("failed_cells")) if payload else NM)
    doc.macro(f"NFverify{which}Impls", integer(len(matrix.get("implementations") or summary)) if payload else NM)

    def counts(impl, group=None):
        c = Counter()
        for g, cnt in (summary.get(impl) or {}).items():
            if group is None or g == group:
                c.update(cnt)
        return c

    for impl, stem in (("nf4", "NF"), ("reference", "Ref")):
        c = counts(impl)
        run = sum(c[s] for s in ("pass", "known", "rejected", "fail", "error"))
        doc.macro(f"NFverify{which}{stem}Pass", integer(c["pass"]) if payload else NM)
        doc.macro(f"NFverify{which}{stem}Run", integer(run) if payload else NM)
        doc.macro(f"NFverify{which}{stem}Rejected", integer(c["rejected"]) if payload else NM)
    tiny = counts("nf4", "tiny")
    doc.macro(f"NFtiny{which}NFPass", integer(tiny["pass"]) if payload else NM)
    doc.macro(f"NFtiny{which}NFRun", integer(sum(tiny[s] for s in ("pass", "known", "rejected", "fail", "error")))
              if payload else NM)
    seen = {s.get("id"): s for s in ((payload or {}).get("known_defects") or {}).get("seen") or []}
    for defect, stem in DEFECT_MACROS.items():
        doc.macro(f"NFseen{which}{stem}", integer((seen.get(defect) or {}).get("cells", 0)) if payload else NM)
    peers = {p.get("name"): p for p in (payload or {}).get("compile_peers") or [] if isinstance(p, dict)}
    if which == "Gpu":
        for name, stem in (("torch.compile", "Default"), ("torch.compile.no_fp_fusion", "NoFusion")):
            flags = (peers.get(name) or {}).get("enable_fp_fusion_in_code")
            text = ", ".join("on" if f else "off" for f in flags) if flags else NM
            doc.macro(f"NFinductor{stem}FusionInCode", text)

    if not summary:
        doc.write(table_name, missing_box(f"the {which.upper()} bit-exact matrix (\\texttt{{python -m verify}})"))
        return
    groups = list(dict.fromkeys(g for impl in summary.values() for g in impl))
    order = ("shapes", "blocksizes", "all-bytes", "out-dtype", "row-packed", "storage", "tiny", "huge")
    groups.sort(key=lambda g: order.index(g) if g in order else len(order))
    lines = [rf"\begin{{tabular}}{{@{{}}l {'c ' * len(groups)}@{{}}}}", r"\toprule",
             "implementation & " + " & ".join(tex(g) for g in groups) + r" \\", r"\midrule"]
    for impl in summary:
        cells = [_matrix_cell(counts(impl, g)) for g in groups]
        lines.append(tex(impl) + " & " + row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write(table_name, "\n".join(lines) + "\n")


def _matrix_cell(c: Counter) -> str:
    run = sum(c[s] for s in ("pass", "known", "rejected", "fail", "error"))
    if not run:
        return "n/a" if c["n/a"] else (DASH if not c["skip"] else "skip")
    text = f"{c['pass']}/{run}"
    for status, mark in (("known", "K"), ("rejected", "R"), ("fail", "F"), ("error", "E")):
        if c[status]:
            text += f" {mark}{c[status]}"
    if c["fail"] or c["error"]:
        text = rf"\textbf{{{text}}}"
    return text
