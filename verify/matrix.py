"""The bit-exact matrix: every implementation on every case, judged against the oracle.

`run(cases, names, device)` builds each case (verify.cases), runs every applicable implementation
(verify.impls), and judges each output (verify.known.classify): against the reference for every
row but `reference`, which is judged against the device's bitsandbytes oracle. Returns one dict per
cell, ready for JSON.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from functools import cached_property

import numpy as np
import torch

from . import impls as impls_mod
from . import known
from .cases import DTYPE_NAMES, Built, Case, build

_CUDA_FATAL = ("illegal memory access", "device-side assert", "unspecified launch failure", "CUDA error: an illegal")


class CaseContext:
    """What the known-defect rules and models may ask about a case (see verify.known)."""

    def __init__(self, built: Built):
        self.built = built
        self.case: Case = built.case
        self.device = built.device
        self.truncated = built.truncated
        self.interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self._models: dict = {}

    @cached_property
    def q(self):
        """The reference's view of the (uint8, untruncated) inputs."""
        import reference

        return reference.from_bnb(self.built.ref_packed, self.built.ref_state)

    @property
    def transposed(self) -> bool:
        return self.built.ref_packed.shape[0] == 1

    def reference(self, *, ftz: bool) -> torch.Tensor:
        """The reference's output (CPU tensor, `.t()` shim applied)."""
        return self.model_array(("reference", ftz))

    @cached_property
    def expected(self) -> torch.Tensor:
        """The ground truth on this device: the reference with ftz=False on a CPU, ftz=True on CUDA."""
        return self.reference(ftz=self.device == "cuda")

    @cached_property
    def has_subnormal_products(self) -> bool:
        """Whether flushing subnormals changes this case's output (the two reference modes differ)."""
        return not known.compare(self.reference(ftz=True), self.reference(ftz=False)).ok

    def model(self, **keywords) -> torch.Tensor:
        """verify.models.model_dequant with these keywords, laid out like `expected`."""
        return self.model_array(tuple(sorted(keywords.items())))

    def model_array(self, key) -> torch.Tensor:
        t = self._models.get(key)
        if t is None:
            import reference

            from .models import model_dequant

            out_name = DTYPE_NAMES[self.case.out_dtype]
            if key and key[0] == "reference":
                arr = reference.dequantize_nf4(self.q, out_name, ftz=key[1])
            else:
                arr = model_dequant(self.q, out_name, **dict(key))
            t = impls_mod.to_torch(arr, self.case.out_dtype, transpose=self.transposed)
            self._models[key] = t
        return t


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _run_one(impl, built: Built):
    """(output on the CPU or the exception, seconds)."""
    t0 = time.perf_counter()
    try:
        out = impl.fn(built.packed, built.state)
        _sync(built.device)
        out = out.detach().to("cpu", copy=True)
    except Exception as exc:  # judged by verify.known: a rejection may be the expected outcome
        out = exc
    return out, time.perf_counter() - t0


def cuda_context_lost(exc: BaseException) -> bool:
    """A CUDA error after which nothing else on the device can be trusted."""
    text = str(exc)
    return any(s in text for s in _CUDA_FATAL)


def run(cases: list[Case], names: list[str], device: str, *, progress=None, compile_all: bool = False,
        budget_s: float | None = None) -> list[dict]:
    """Run `names` on `cases`; one cell dict per (implementation, case).

    progress: an iterable wrapper (tqdm). budget_s: past this many seconds the remaining cases are
    recorded as skipped (so that one GPU command still reaches the challenge harness).
    """
    cells: list[dict] = []
    lost = None
    t0 = time.perf_counter()
    for case in progress(cases) if progress is not None else cases:
        if lost is None and budget_s is not None and time.perf_counter() - t0 > budget_s:
            lost = f"time budget of {budget_s:.0f} s spent (--matrix-budget-s)"
            print(f"\nverify: {lost}; the remaining cases are skipped", file=sys.stderr)
        if lost is not None:
            cells += [_cell(n, case, "skip", note=f"not run: {lost}") for n in names]
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # huge cases overflow fp16 on purpose
            case_cells, lost = run_case(case, names, device, compile_all=compile_all)
        cells += case_cells
        if lost is not None:
            print(f"\nverify: stopping the matrix, {lost}", file=sys.stderr)
    return cells


def run_case(case: Case, names: list[str], device: str, *, compile_all: bool = False):
    """All implementations on one case: (cells, None) or (cells, why the CUDA context is lost)."""
    try:
        built = build(case, device)
    except Exception as exc:
        text = f"building the case failed: {type(exc).__name__}: {exc}"[:400]
        return [_cell(n, case, "error", detail=text) for n in names], None
    ctx = CaseContext(built)
    cells, outputs, seconds = [], {}, {}
    lost = None
    for name in names:
        impl = impls_mod.IMPLEMENTATIONS[name]
        reason = impl.not_applicable(case, device)
        if reason is not None:
            cells.append(_cell(name, case, "n/a", note=reason))
        elif impl.compile_subset and not (case.compile or compile_all):
            cells.append(_cell(name, case, "skip", note="not in the torch.compile subset (--compile-all)"))
        else:
            if impl.compile_subset:
                impls_mod.set_compile_label(case.id)
            outputs[name], seconds[name] = _run_one(impl, built)
            if isinstance(outputs[name], Exception) and device == "cuda" and cuda_context_lost(outputs[name]):
                lost = f"{name} on {case.id}: {outputs[name]}"[:300]
                break
    for name, out in outputs.items():
        expected = _expected(ctx)
        if name == "reference":
            oracle = impls_mod.ORACLE[device]
            if oracle not in outputs:
                cells.append(_cell(name, case, "skip", note=f"its oracle {oracle} did not run"))
                continue
            expected = None if isinstance(outputs[oracle], Exception) else outputs[oracle]
        try:
            verdict = known.classify(name, ctx, out, expected)
        except Exception:  # a bug in judging must show as an error cell, not end the run
            verdict = known.Verdict("error", detail="judging raised: " + traceback.format_exc()[-1500:])
        cells.append(_cell(name, case, verdict.status, verdict=verdict, seconds=seconds[name],
                           notes=built.notes or None))
    return cells, lost


def _expected(ctx: CaseContext):
    try:
        return ctx.expected
    except Exception:  # the reference cannot read the inputs: every row then needs a known defect
        return None


def _cell(name: str, case: Case, status: str, *, verdict=None, note: str = "", detail: str = "", seconds=None,
          notes=None) -> dict:
    cell = {"impl": name, "case": case.id, "group": case.group, "status": status,
            "shape": list(case.shape), "blocksize": case.blocksize, "dtype": DTYPE_NAMES[case.dtype],
            "out_dtype": DTYPE_NAMES[case.out_dtype], "double_quant": case.double_quant,
            "storage": str(case.storage).removeprefix("torch."), "variant": case.variant,
            "row_packed": case.row_packed}
    if verdict is not None:
        cell.update(mismatches=verdict.mismatches, total=verdict.total, first=[list(i) for i in verdict.first],
                    detail=verdict.detail, defects=list(verdict.defects), model=verdict.model, note=verdict.note)
    else:
        cell.update(note=note, detail=detail)
    if seconds is not None:
        cell["seconds"] = round(seconds, 4)
    if notes:
        cell["case_notes"] = notes
    return cell
