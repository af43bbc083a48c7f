"""Tables and summaries of the matrix cells (plain text; the JSON report holds everything)."""

from __future__ import annotations

from collections import Counter, defaultdict

from .cases import GROUPS

STATUSES = ("pass", "known", "rejected", "fail", "error", "n/a", "skip")
LEGEND = ("cell: passed/run, then K known defect (mismatch explained by its model), R rejected as a known "
          "defect demands, F FAIL (unexplained mismatch), E error; n/a: does not apply; skip: not run")


def summarize(cells: list[dict]) -> dict:
    """{impl: {group: {status: count}}}."""
    out: dict = defaultdict(lambda: defaultdict(Counter))
    for c in cells:
        out[c["impl"]][c["group"]][c["status"]] += 1
    return {impl: {g: dict(cnt) for g, cnt in groups.items()} for impl, groups in out.items()}


def _cell_text(counts: Counter) -> str:
    run = sum(counts[s] for s in ("pass", "known", "rejected", "fail", "error"))
    if not run:
        if counts["n/a"]:
            return "n/a"
        return "skip" if counts["skip"] else "-"
    text = f"{counts['pass']}/{run}"
    for status, mark in (("known", "K"), ("rejected", "R"), ("fail", "F"), ("error", "E")):
        if counts[status]:
            text += f" {mark}{counts[status]}"
    return text


def matrix_table(cells: list[dict]) -> str:
    """Implementations x case groups, as a Markdown table."""
    impls = list(dict.fromkeys(c["impl"] for c in cells))
    groups = [g for g in GROUPS if any(c["group"] == g for c in cells)]
    counts: dict = defaultdict(Counter)
    for c in cells:
        counts[(c["impl"], c["group"])][c["status"]] += 1
    text = {(i, g): _cell_text(counts[(i, g)]) for i in impls for g in groups}
    widths = [max([len(g)] + [len(text[(i, g)]) for i in impls]) for g in groups]
    first = max([len(i) for i in impls] + [len("implementation")])
    lines = [f"| {'implementation':<{first}} | " + " | ".join(g.ljust(w) for g, w in zip(groups, widths, strict=True))
             + " |",
             f"|{'-' * (first + 2)}|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for impl in impls:
        row = [text[(impl, g)].ljust(w) for g, w in zip(groups, widths, strict=True)]
        lines.append(f"| {impl:<{first}} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def mismatch_table(cells: list[dict]) -> str:
    """Per implementation and group with mismatching cells: element counts and the first mismatch."""
    rows: dict = {}
    for c in cells:
        if not c.get("mismatches"):
            continue
        key = (c["impl"], c["group"], c["status"])
        row = rows.setdefault(key, {"cells": 0, "elements": 0, "total": 0, "first": None})
        row["cells"] += 1
        row["elements"] += c["mismatches"]
        row["total"] += c["total"]
        if row["first"] is None:
            first = tuple(c["first"][0]) if c.get("first") else ()
            row["first"] = f"{c['case']} @ {first}"
    if not rows:
        return ""
    lines = ["| implementation | group | status | cells | elements differing | first mismatch (case @ index) |",
             "|---|---|---|---|---|---|"]
    for (impl, group, status), r in rows.items():
        lines.append(f"| {impl} | {group} | {status} | {r['cells']} | {r['elements']} of {r['total']} | {r['first']} |")
    return "\n".join(lines)


def failures(cells: list[dict], limit: int = 20) -> str:
    """The failing cells with their mismatch reports (count and first indices with both values)."""
    bad = [c for c in cells if c["status"] in ("fail", "error")]
    if not bad:
        return ""
    lines = [f"{len(bad)} failing cell(s):"]
    for c in bad[:limit]:
        lines.append(f"- {c['impl']} on {c['case']}: {c['status'].upper()}"
                     + (f" ({c['mismatches']} of {c['total']} elements)" if c.get("mismatches") else ""))
        if c.get("note"):
            lines.append(f"    note: {c['note']}")
        for line in (c.get("detail") or "").splitlines()[:7]:
            lines.append(f"    {line}")
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more (see the JSON report)")
    return "\n".join(lines)


def known_summary(cells: list[dict]) -> list[dict]:
    """Per known defect: how many cells it explained, on which implementations, one example each."""
    seen: dict = {}
    for c in cells:
        for d in c.get("defects") or []:
            entry = seen.setdefault(d, {"id": d, "cells": 0, "implementations": Counter(), "examples": {}})
            entry["cells"] += 1
            entry["implementations"][c["impl"]] += 1
            entry["examples"].setdefault(c["impl"], {"case": c["case"], "status": c["status"],
                                                     "mismatches": c.get("mismatches"), "model": c.get("model"),
                                                     "detail": (c.get("detail") or "")[:300]})
    return [dict(v, implementations=dict(v["implementations"])) for v in seen.values()]


def known_text(summary: list[dict]) -> str:
    if not summary:
        return ""
    lines = ["known defects seen (recognised by their models, see verify/known.py):"]
    for s in summary:
        impls = ", ".join(f"{k} x{v}" for k, v in s["implementations"].items())
        lines.append(f"- {s['id']}: {s['cells']} cell(s): {impls}")
    return "\n".join(lines)


def unexpected_passes(cells: list[dict]) -> list[dict]:
    """Cells where a known defect was predicted but the output was exact (the rule may be too wide)."""
    return [{"impl": c["impl"], "case": c["case"], "note": c["note"]} for c in cells
            if c["status"] == "pass" and (c.get("note") or "").startswith("predicted")]
