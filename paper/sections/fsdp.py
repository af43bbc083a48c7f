"""results/fsdp/fsdp_qlora_<gpu>x2.json (`python -m experiments fsdp-qlora --interleave`): FSDP-QLoRA training
steps on two GPUs, bitsandbytes alone, nf4 patched in and bitsandbytes again, their steps interleaved.

The macros carry, per pair of GPUs, each run's median step and interquartile range over the timed steps, nf4's
speedup over the first bitsandbytes run (the file's verdict), the number of timed steps, and whether the LoRA
weights were identical across ranks. The bar (issue 35) is a speedup of at least 1.0.
"""

from __future__ import annotations

from paper.latex import NM, Document, num, ratio
from paper.sections.linear import GPUS

RUNS = (("bnb", "Bnb"), ("nf4", "Nf"), ("bnb_repeat", "BnbRepeat"))


def load(doc: Document) -> dict:
    """{gpu tag: payload} of the two-GPU files present (one pair of either kind is the measurement: a missing
    one is not noted)."""
    out = {}
    for tag, _, label in GPUS:
        name = f"fsdp/fsdp_qlora_{tag}x2.json"
        if not (doc.results / name).exists():
            continue
        payload = doc.load(name, label="experiments fsdp-qlora", required_for=f"FSDP macros, two {label}s")
        if isinstance(payload, dict):
            out[tag] = payload
    return out


def build(doc: Document, data: dict | None) -> None:
    data = data or {}
    for tag, g, _ in GPUS:
        p = data.get(tag) or {}
        runs = p.get("runs") or {}
        for key, stem in RUNS:
            t = (runs.get(key) or {}).get("time") or {}
            for field, part in (("median_ms", "Median"), ("q1_ms", "Low"), ("q3_ms", "High")):
                doc.macro(f"NFfsdp{stem}{part}{g}", num(t[field], 1) if t.get(field) else NM)
        verdicts = p.get("verdicts") or {}
        speedup = verdicts.get("speedup_nf4_vs_bnb")
        doc.macro(f"NFfsdpSpeedup{g}", ratio(speedup) if speedup else NM)
        steps = ((runs.get("nf4") or {}).get("time") or {}).get("n")
        doc.macro(f"NFfsdpSteps{g}", str(steps) if steps else NM)
        same = verdicts.get("weights_identical_across_ranks")
        doc.macro(f"NFfsdpRanksIdentical{g}", {True: "identical", False: "not identical"}.get(same, NM))
        doc.macro(f"NFfsdpLayers{g}", str((p.get("config") or {}).get("layers") or NM))
