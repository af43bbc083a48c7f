"""Check every variant bit-exact, then time it: the experiments' one runner.

For each case (weight shape, output dtype, blocksize; double quantization always on) and each
selected variant:
1. check: the variant's output is compared by integer views with the oracle, into an output
   buffer first filled with a NaN pattern (an element never written cannot pass). On a GPU the
   oracle is bitsandbytes' CUDA `dequantize_4bit` (flush-to-zero semantics, so variants run
   with ftz=True); without one, variants run in Triton's interpreter on small odd cases and the
   oracle is `reference.dequantize_nf4(..., ftz=True)`.
2. time (GPU only, only when exact; a variant with exact_expected=False is never timed): median
   device time by CUDA events over rotating input sets that overflow L2, CUDA-graph replay time,
   GB/s over the fewest bytes a dequantization must move, and % of the device-to-device copy
   bandwidth measured in the same run. Host time per call and the challenge's synchronised wall
   clock for variants marked host_timing.
Results: one JSON (environment, variants, rows) and a CSV next to it, written after every case;
a table is printed last. `--sm75` adds the offline sm_75 compile of every kernel (compile-only).
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import torch

from verify import timing

from . import common, ops, registry

POISON = {torch.float16: 0x7D5A, torch.bfloat16: 0x7FA5, torch.float32: 0x7FA55A5A}  # NaNs no kernel writes
CSV_FIELDS = ["variant", "parent", "case", "device", "mode", "status", "exact_expected", "mismatches", "total",
              "device_us", "device_q1_us", "device_q3_us", "graph_us", "gbs", "pct_copy", "host_us", "wall_us",
              "bytes", "numel", "blocksize", "dtype", "ftz", "oracle", "torch", "triton", "bitsandbytes", "commit",
              "change", "note", "error"]


def gpu_mode() -> bool:
    """True when variants run on a CUDA GPU (not in Triton's interpreter)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def poison(out: torch.Tensor) -> None:
    """Fill `out` with a NaN bit pattern no kernel writes."""
    width = out.element_size()
    bits = POISON[out.dtype]
    if bits >= 1 << (8 * width - 1):
        bits -= 1 << (8 * width)
    out.view({2: torch.int16, 4: torch.int32}[width]).fill_(bits)


def mismatches(got: torch.Tensor, expected: torch.Tensor, limit: int = 3) -> tuple[int, int, str]:
    """(differing elements, total, report of the first few) by integer views; -0.0 differs from 0.0."""
    total = expected.numel()
    if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
        return total, total, f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(expected.shape)} {expected.dtype}"
    iv = {2: torch.int16, 4: torch.int32}[got.element_size()]
    a, e = got.contiguous().view(iv).reshape(-1), expected.contiguous().view(iv).reshape(-1)
    diff = a != e
    count = int(diff.sum().item())
    if not count:
        return 0, total, ""
    idx = torch.nonzero(diff)[:limit, 0].tolist()
    mask = (1 << (8 * got.element_size())) - 1
    first = "; ".join(f"[{i}] got {got.reshape(-1)[i].item()!r} (0x{int(a[i]) & mask:x}) expected "
                      f"{expected.reshape(-1)[i].item()!r} (0x{int(e[i]) & mask:x})" for i in idx)
    return count, total, first


def cases_for(variant: registry.Variant, gpu: bool, case_texts: list[str] | None = None) -> list:
    """The variant's cases: those given, else its op's defaults (on a GPU, plus the big ones for the
    production kernel's chain)."""
    op = ops.get(variant.op)
    if case_texts:
        return [op.parse_case(c) for c in case_texts]
    if not gpu:
        return [op.parse_case(c) for c in op.interpreter_cases]
    texts = list(op.gpu_cases)
    if op.big_root and op.big_root in registry.lineage(variant.id):
        texts += op.big_cases
    return [op.parse_case(c) for c in texts]


class _Progress:
    """tqdm when importable, else a counter on stderr."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._bar = None
        self.total, self.done = total, 0

    def step(self, text: str):
        self.done += 1
        if self._bar is not None:
            self._bar.set_description_str(text[:40])
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def check_variant(variant: registry.Variant, sets: list[tuple], expected: torch.Tensor, *, gpu: bool) -> dict:
    """Run once into a poisoned buffer and compare bit for bit: status, mismatches, total, first_mismatches."""
    if variant.gpu_only and not gpu:
        return {"status": "skipped", "note": "GPU only: not run in the interpreter"}
    *inputs, out = sets[0]
    poison(out)
    try:
        got = variant.run(*inputs, out, ftz=True)
        if gpu:
            torch.cuda.synchronize()
    except Exception as exc:  # a failing variant is a row, not the end of the run
        return {"status": "error", "error": _short_error(exc)}
    count, total, first = mismatches(got, expected)
    if count == 0:
        status = "exact"
    else:
        status = "inexact (expected)" if not variant.exact_expected else "INEXACT"
    return {"status": status, "mismatches": count, "total": total, "first_mismatches": first}


def time_variant(variant: registry.Variant, sets: list[tuple], case, copy_gbs: float, reps: int) -> dict:
    """Device time (events, rotating inputs), graph replay time, GB/s, % of copy; host and wall time if marked."""

    def call(s):
        return variant.run(*s, ftz=True)

    t = timing.device_time_us(call, sets, reps=reps)
    row = {"device_us": t["median_us"], "device_q1_us": t["q1_us"], "device_q3_us": t["q3_us"],
           "device_min_us": t["min_us"], "reps": reps}
    row["gbs"] = case.min_bytes / (t["median_us"] * 1e-6) / 1e9
    row["pct_copy"] = 100 * row["gbs"] / copy_gbs
    g = timing.graph_time_us(call, sets)
    if g and "median_us" in g:
        row["graph_us"] = g["median_us"]
        row["graph_pct_copy"] = 100 * case.min_bytes / (g["median_us"] * 1e-6) / 1e9 / copy_gbs
    elif g:
        row["graph_error"] = g.get("error")
    if variant.host_timing:
        row["host_us"] = timing.host_time_us(call, sets, calls=200)["median_us"]
        row["wall_us"] = timing.wall_time_us(call, sets, iters=200)["per_call_us"]
    return row


def run(ids: list[str] | None = None, case_texts: list[str] | None = None, *, check_only: bool = False,
        out: str | None = "results/experiments.json", sm75: bool = False, reps: int = 100,
        inductor_dir: str | None = None, quiet: bool = False) -> dict:
    """Check (and on a GPU time) the selected variants; write JSON + CSV when `out`; return the payload.

    inductor_dir: where v60/v61 save inductor's generated code (default common.ARTIFACT_DIR)."""
    with common.artifact_dir(inductor_dir):
        return _run(ids, case_texts, check_only=check_only, out=out, sm75=sm75, reps=reps, quiet=quiet)


def _run(ids, case_texts, *, check_only, out, sm75, reps, quiet) -> dict:
    chosen = registry.select(ids)
    gpu = gpu_mode()
    env = timing.environment()
    device_name = env["device"] if gpu else "cpu (Triton interpreter)"
    plan = {v.id: cases_for(v, gpu, case_texts) for v in chosen}
    op_of = {v.id: v.op for v in chosen}
    cases = list(dict.fromkeys((op_of[v], c) for v, cs in plan.items() for c in cs))
    oracles = {op: ops.get(op).oracle_name(gpu) for op in dict.fromkeys(op_of.values())}
    copy = timing.copy_bandwidth_gbs() if gpu and not check_only else None
    payload = {
        "env": env, "mode": "gpu" if gpu else "interpreter", "device": device_name,
        "oracle": "; ".join(oracles.values()), "oracles": oracles,
        "ftz": True, "copy_bandwidth": copy, "cases": [c.text for _, c in cases], "double_quant": True,
        "variants": {v.id: {"op": v.op, "parent": v.parent, "change": v.change, "exact_expected": v.exact_expected,
                            "module": v.module, "teaches": v.teaches, "note": v.note} for v in chosen},
        "rows": [],
    }
    progress = _Progress(sum(len(cs) for cs in plan.values()))
    for op_name, case in cases:
        op = ops.get(op_name)
        todo = [v for v in chosen if v.op == op_name and case in plan[v.id]]
        copies = timing.rotation_count(case.min_bytes) if gpu and not check_only else 1
        sets = op.make_inputs(case, "cuda" if gpu else "cpu", copies)
        expected = op.oracle(sets, gpu)
        for v in todo:
            row = {"variant": v.id, "op": v.op, "parent": v.parent, "change": v.change,
                   "exact_expected": v.exact_expected, "case": case.text, "shape": list(case.shape),
                   "dtype": str(case.dtype).removeprefix("torch."), "blocksize": getattr(case, "blocksize", None),
                   "numel": case.numel, "bytes": case.min_bytes, "device": device_name,
                   "mode": payload["mode"], "ftz": True, "oracle": oracles[op_name], "note": v.note,
                   **{k: env.get(k) for k in ("torch", "triton", "bitsandbytes", "commit")}}
            row.update(check_variant(v, sets, expected, gpu=gpu))
            if gpu and not check_only and row["status"] == "exact" and v.exact_expected:
                try:
                    row.update(time_variant(v, sets, case, copy["gbs"], reps))
                except Exception as exc:
                    row["error"] = "timing: " + _short_error(exc)
            payload["rows"].append(row)
            progress.step(f"{v.id} {case.text}")
        del sets, expected
        if gpu:
            torch.cuda.empty_cache()
        if out:
            write(payload, out)
    progress.close()
    if sm75:
        from . import sm75 as sm75_module

        payload["sm75"] = sm75_module.compile_in_child([v.id for v in chosen if v.kernel is not None])
    if out:
        paths = write(payload, out)
        if not quiet:
            print("wrote " + ", ".join(map(str, paths)))
    if not quiet:
        print(table(payload))
        if "sm75" in payload:
            from . import sm75 as sm75_module

            print()
            print(sm75_module.table(payload["sm75"]))
    return payload


def write(payload: dict, out: str) -> list[Path]:
    """The JSON payload at `out` and its rows as CSV next to it (plus _sm75.csv when compiled)."""
    path = timing.write_json(out, payload)
    paths = [path, _write_csv(path.with_suffix(".csv"), payload["rows"], CSV_FIELDS)]
    if payload.get("sm75"):
        from .sm75 import CSV_FIELDS as SM75_FIELDS

        paths.append(_write_csv(path.with_name(path.stem + "_sm75.csv"), payload["sm75"]["builds"], SM75_FIELDS))
    return paths


def _write_csv(path: Path, rows: list[dict], fields: list[str]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _cell(r.get(k)) for k in fields})
    return path


def _cell(v):
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else v)


def table(payload: dict) -> str:
    """A markdown table of the rows (device named in the header)."""
    timed = any("device_us" in r for r in payload["rows"])
    head = f"device: {payload['device']}, oracle: {payload['oracle']}"
    if payload.get("copy_bandwidth"):
        head += f", copy bandwidth {payload['copy_bandwidth']['gbs']:.0f} GB/s"
    cols = ["variant", "case", "status", "mismatches"]
    if timed:
        cols += ["device_us", "graph_us", "gbs", "pct_copy", "host_us", "wall_us"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in payload["rows"]:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:.1f}" if isinstance(v, float) else ("" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def list_table() -> str:
    """id, parent, change, exact_expected of every registered variant."""
    found = registry.variants()
    width = max(len(i) for i in found)
    pwidth = max(len(str(v.parent)) for v in found.values())
    lines = [f"{'id':<{width}}  {'parent':<{pwidth}}  exact  change"]
    for v in found.values():
        flags = "yes" if v.exact_expected else "no "
        extra = " [GPU only]" if v.gpu_only else ""
        lines.append(f"{v.id:<{width}}  {v.parent or '-':<{pwidth}}  {flags}    {v.change}{extra}")
    lines.append(f"{len(found)} variants")
    return "\n".join(lines)


def _short_error(exc: BaseException) -> str:
    """Type, first and last lines of an exception (a Triton CompilationError puts its reason last)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 600 else text[:200] + " ... " + text[-400:]
