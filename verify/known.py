"""Known third-party defects and deviations: the only mismatches `python -m verify` accepts.

Each entry names the implementations it concerns, how a case is recognised (`applies`), what the
implementation does instead, and the evidence. A mismatch is accepted only when

  * the entry applies to this implementation, device and case, and
  * the output equals, bit for bit, a model of what the implementation does instead (see
    `verify.models`): the device's ground truth (`BASE_MODEL`) with the entry's deviation applied,
    one of its `alternatives`. When several entries apply, the smallest set of them whose
    deviations together reproduce the output is credited. The mechanism is reproduced, not
    tolerated. Entries with `expect="reject"` instead require the implementation to raise
    ValueError/TypeError; `expect="any"` accepts any outcome (the input itself is broken).

Anything else is a failure, and so is nf4 mismatching anywhere: no entry names it except to demand
a rejection. To add an entry, append a `KnownDefect` to `DEFECTS`; nothing else lists them.

Context objects (`ctx`) come from `verify.matrix.CaseContext`: `case`, `device`, `truncated`,
`interpreting`, `has_subnormal_products`, and `model(**keywords)` (a model's output laid out like
the expected tensor).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

import torch

from .exact import compare

# --- which branch bitsandbytes' native CPU dequantize_4bit takes --------------------------------


def _bnb_cpu_flags() -> dict:
    """CPU features as bitsandbytes sees them (cached after the first call)."""
    if not _FLAGS:
        try:
            import bitsandbytes.functional as F
            from bitsandbytes.backends.cpu import ops as cpu_ops

            has_avx512 = bool(getattr(cpu_ops, "_has_avx512", False))
            lib = F.lib
            avx512f = bool(lib.has_avx512f_cpu()) if hasattr(lib, "has_avx512f_cpu") else has_avx512
            _FLAGS.update(avx512=has_avx512, avx512f=avx512f, avx512bf16=bool(F.has_avx512bf16()))
        except Exception:  # no CPU backend: nothing of the native routine applies
            _FLAGS.update(avx512=False, avx512f=False, avx512bf16=False)
    return _FLAGS


_FLAGS: dict = {}


def native_takes_cpp(shape, blocksize: int) -> bool:
    """The CPU `dequantize_4bit` runs its C++ kernel: even last dim, and not blocksize >= 2048 with AVX512
    (bitsandbytes' Python wrapper sends those to the default backend)."""
    return not ((_bnb_cpu_flags()["avx512"] and blocksize >= 2048) or shape[-1] % 2 != 0)


def native_takes_avx512(shape, blocksize: int) -> bool:
    """The C++ kernel takes its AVX512 branch: AVX512F CPU and a last dim that is a multiple of 16."""
    return native_takes_cpp(shape, blocksize) and _bnb_cpu_flags()["avx512f"] and shape[-1] % 16 == 0


def native_absmax_index_bug(shape, blocksize: int) -> bool:
    """AVX512 branch, >= 2 rows, rows that do not hold whole blocks, more than one block."""
    rows = prod(shape[:-1]) if len(shape) > 1 else 1
    return (native_takes_avx512(shape, blocksize) and rows >= 2 and shape[-1] % blocksize != 0
            and prod(shape) > blocksize)


# --- the entries ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownDefect:
    """A known defect (`kind="defect"`) or a documented deviation from the format (`kind="deviation"`)."""

    id: str
    owner: str  # whose code: bitsandbytes, triton, inductor
    implementations: tuple[str, ...]
    devices: tuple[str, ...]
    summary: str
    evidence: str
    applies: Callable  # ctx -> bool: how a case is recognised
    when: str  # the same in words (for the report)
    alternatives: tuple[dict, ...] = ()  # deviations from BASE_MODEL (keywords of verify.models.model_dequant)
    expect: str = "mismatch"  # mismatch | reject | any
    expect_by_impl: dict = field(default_factory=dict)
    reshape: bool = False  # compare values after reshaping to the expected shape
    kind: str = "defect"

    def expectation(self, impl: str) -> str:
        return self.expect_by_impl.get(impl, self.expect)

    def as_dict(self) -> dict:
        return {"id": self.id, "owner": self.owner, "kind": self.kind, "implementations": list(self.implementations),
                "devices": list(self.devices), "when": self.when, "summary": self.summary, "evidence": self.evidence,
                "expect": self.expect, "expect_by_impl": dict(self.expect_by_impl),
                "alternatives": [dict(m) for m in self.alternatives]}


def _shape(ctx):
    return ctx.case.shape


DEFECTS: list[KnownDefect] = [
    KnownDefect(
        id="bnb-cpu-avx512-absmax-index",
        owner="bitsandbytes",
        implementations=("bnb.dequantize_4bit",),
        devices=("cpu",),
        summary="native CPU dequantize_4bit (AVX512 branch) scales element (row, col) by absmax[row * (n // blocksize)"
                " + (col // 16 * 16) // blocksize] instead of absmax[(row * n + col) // blocksize]",
        evidence="docs/FORMAT.md §3-§4: element i is scaled by the absmax of block i // blocksize over the flat "
                 "tensor. csrc/cpu_ops.cpp dequantizeBlockwise4bitCpu views the tensor as [rows, n] and indexes per "
                 "row with integer divisions; the two agree only when every row holds whole blocks. Shape (64, 64) at "
                 "blocksize 128: element (2, 0) is flat index 128, block 1, but the kernel reads "
                 "absmax[2 * (64 // 128)] = absmax[0]. The output equals that wrong-index product bit for bit "
                 "(deviation index=avx512), and the pure-torch default backend and the CUDA kernels follow the "
                 "format. bitsandbytes' own wrapper already routes blocksize >= 2048 away 'as AVX512 implementation "
                 "has accuracy issues'.",
        when="AVX512F CPU, C++ route (even last dim; blocksize < 2048), last dim % 16 == 0, >= 2 rows, last dim % "
             "blocksize != 0, more than one block",
        applies=lambda ctx: native_absmax_index_bug(_shape(ctx), ctx.case.blocksize),
        alternatives=({"index": "avx512"},),
    ),
    KnownDefect(
        id="bnb-cpu-1d-shape",
        owner="bitsandbytes",
        implementations=("bnb.dequantize_4bit",),
        devices=("cpu",),
        summary="native CPU dequantize_4bit returns shape (1, n) for a 1-D QuantState.shape (n,); values are right",
        evidence="backends/cpu/ops.py sets shape = (1, shape[0]) for len(shape) == 1 and allocates the output in "
                 "that shape; the default backend and CUDA return QuantState.shape. Recognised only when the values, "
                 "reshaped, equal the reference bit for bit.",
        when="1-D QuantState.shape with an even length on the C++ route",
        applies=lambda ctx: len(_shape(ctx)) == 1 and native_takes_cpp(_shape(ctx), ctx.case.blocksize),
        alternatives=({},),
        reshape=True,
    ),
    KnownDefect(
        id="bnb-cpu-avx512bf16-subnormal",
        owner="bitsandbytes",
        implementations=("bnb.dequantize_4bit",),
        devices=("cpu",),
        summary="native CPU dequantize_4bit, AVX512 branch on an AVX512_BF16 CPU: subnormal float32 products become "
                "bf16 zero (vcvtneps2bf16 treats subnormal inputs as zero) instead of rounding to nearest even",
        evidence="docs/FORMAT.md §4: one float32 product, then round-to-nearest-even to the output dtype; 1e-39 "
                 "(0x000AE398) rounds to bf16 0x000B, as torch's .to(bfloat16), the default backend and the C++ "
                 "scalar branch give. The AVX512 loop of libbitsandbytes_cpu.so tests has_avx512bf16() and runs "
                 "vcvtneps2bf16. Recognised when the output equals the IEEE product flushed at the bf16 conversion "
                 "only (deviation convert_mode=bf16-daz), which is not the reference's ftz=True.",
        when="bf16 output, AVX512 branch, a CPU with AVX512_BF16 (only subnormal products show it)",
        applies=lambda ctx: (ctx.case.out_dtype == torch.bfloat16 and _bnb_cpu_flags()["avx512bf16"]
                             and native_takes_avx512(_shape(ctx), ctx.case.blocksize)),
        alternatives=({"convert_mode": "bf16-daz"},),
    ),
    KnownDefect(
        id="bnb-cuda-odd-storage",
        owner="bitsandbytes",
        implementations=("reference", "bnb.default", "bnb.dequantize_4bit", "bnb.triton", "nf4", "unsloth",
                         "unsloth.global_buffer", "torch.compile", "torch.compile.no_fp_fusion"),
        devices=("cpu", "cuda"),
        summary="quant_storage with itemsize > 1 and an odd packed byte count: bitsandbytes' CUDA quantize_4bit "
                "allocates (n + 1) // (2 * itemsize) elements, one byte short (e.g. (9, 41, 341) in bf16 storage: "
                "62914 bytes for 62915), and its dequantize then reads past the end",
        evidence="backends/cuda/ops.py quantize_4bit: torch.empty(((n + 1) // (quant_storage.itemsize * 2), 1)); the "
                 "format needs (n + 1) // 2 bytes (docs/FORMAT.md §2). The CPU route cannot view an odd byte count as "
                 "bf16 at all (RuntimeError), so on a CPU the case is built in the CUDA layout. nf4.dequantize must "
                 "reject it (ValueError naming the byte counts); the reference rejects it too; the other "
                 "implementations' outcomes are recorded, not judged: the input is not a valid NF4 tensor.",
        when="the packed tensor holds fewer than (n + 1) // 2 bytes (quant_storage itemsize > 1, odd byte count)",
        applies=lambda ctx: ctx.truncated,
        expect="any",
        expect_by_impl={"nf4": "reject"},
    ),
    KnownDefect(
        id="triton-interpreter-bf16-truncation",
        owner="triton",
        implementations=("bnb.triton",),
        devices=("cpu",),
        summary="Triton's interpreter converts float32 to bfloat16 by truncation (no rounding), so a kernel that "
                "stores float32 into a bf16 pointer differs from the compiled kernel by up to 1 ulp toward zero",
        evidence="triton/runtime/interpreter.py: cast_impl -> _convert_float(..., rounding_mode=None), which shifts "
                 "the significand right without rounding. docs/FORMAT.md §4 asks for round-to-nearest-even (what the "
                 "compiled cvt.rn.bf16.f32 does). Recognised when the output equals the format's float32 products "
                 "converted by the interpreter's routine (deviation convert_mode=interpreter; for normal numbers "
                 "that is bits >> 16, checked in tests). nf4 rounds with integer ops under the interpreter, so it "
                 "is unaffected.",
        when="bf16 output under TRITON_INTERPRET=1",
        applies=lambda ctx: ctx.case.out_dtype == torch.bfloat16 and ctx.interpreting,
        alternatives=({"convert_mode": "interpreter"},),
    ),
    KnownDefect(
        id="inductor-fp-fusion",
        owner="inductor",
        implementations=("torch.compile",),
        devices=("cuda",),
        summary="inductor compiles its Triton kernels with enable_fp_fusion=True (unless emulate_precision_casts), so "
                "code2 * absmax2 + offset becomes one FMA: one rounding instead of two",
        evidence="docs/FORMAT.md §3 and §5.1: absmax = (code2[u8] * absmax2) + offset with two float32 roundings. "
                 "torch 2.13 _inductor/codegen/triton.py triton_meta_common: 'enable_fp_fusion': not "
                 "config.emulate_precision_casts. Recognised when the output equals the format with the absmax "
                 "recovered by a correctly rounded fma (deviation absmax=fma); the generated kernel is saved under "
                 "results/inductor/.",
        when="double quantization (there is a multiply-add to contract)",
        applies=lambda ctx: ctx.case.double_quant,
        alternatives=({"absmax": "fma"},),
        kind="deviation",
    ),
    KnownDefect(
        id="ieee-subnormals-on-cuda",
        owner="bitsandbytes/triton/inductor",
        implementations=("bnb.default", "bnb.triton", "torch.compile", "torch.compile.no_fp_fusion"),
        devices=("cuda",),
        summary="implementations that multiply with IEEE float32 on CUDA keep subnormal products that bitsandbytes' "
                "CUDA build (fast math) flushes to zero; only crafted absmax near 1e-38 reaches this",
        evidence="docs/FORMAT.md §5.2: the CUDA oracle flushes, so the expected output is the reference with "
                 "ftz=True. torch's CUDA ops and Triton's plain multiply do not flush. The default backend and "
                 "bitsandbytes' Triton kernel take the absmax from bitsandbytes' CUDA dequantize_blockwise (flushed) "
                 "and multiply in IEEE (deviation product=ieee); the torch.compile peers compute everything in IEEE "
                 "(product=ieee, absmax=ieee; with inductor-fp-fusion absmax=fma). Applies only where the two "
                 "reference modes differ.",
        when="the reference with ftz=True and with ftz=False differ on this case (crafted tiny absmax)",
        applies=lambda ctx: ctx.has_subnormal_products,
        alternatives=({"product": "ieee"}, {"product": "ieee", "absmax": "ieee"}),
        kind="deviation",
    ),
]


def by_id(defect_id: str) -> KnownDefect:
    """The entry with this id (KeyError naming the known ids otherwise)."""
    for d in DEFECTS:
        if d.id == defect_id:
            return d
    raise KeyError(f"no known defect {defect_id!r}; known: {[d.id for d in DEFECTS]}")


def applicable(impl: str, ctx) -> list[KnownDefect]:
    """The entries that apply to `impl` on this case and device."""
    return [d for d in DEFECTS if impl in d.implementations and ctx.device in d.devices and d.applies(ctx)]


# --- classification -------------------------------------------------------------------------


@dataclass
class Verdict:
    """The status of one cell of the matrix, and why."""

    status: str  # pass | fail | known | rejected | error
    mismatches: int = 0
    total: int = 0
    first: tuple = ()
    detail: str = ""
    defects: tuple[str, ...] = ()
    model: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "error")


# The device's ground truth as a model: IEEE on a CPU, flush-to-zero like bitsandbytes' CUDA build on CUDA.
BASE_MODEL = {"cpu": {}, "cuda": {"absmax": "ftz", "product": "ftz"}}


def _merge(deviations) -> dict | None:
    """One model from several entries' deviations; None when two set the same step differently."""
    merged: dict = {}
    for dev in deviations:
        for key, value in dev.items():
            if merged.get(key, value) != value:
                return None
            merged[key] = value
    return merged


def explain(impl: str, ctx, outcome, expected, defects) -> tuple[tuple[str, ...], str] | None:
    """The smallest set of applicable entries whose deviations reproduce `outcome` bit for bit.

    Returns (entry ids, the deviation as text) or None. Sets are tried by size, then in DEFECTS order.
    """
    from .models import describe

    candidates = [d for d in defects if d.expectation(impl) == "mismatch"]
    for size in range(1, len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            got = outcome
            if any(d.reshape for d in subset):
                if outcome.numel() != expected.numel():
                    continue
                got = outcome.reshape(expected.shape)
            for deviations in itertools.product(*(d.alternatives for d in subset)):
                merged = _merge(deviations)
                if merged is None:
                    continue
                if compare(got, ctx.model(**{**BASE_MODEL[ctx.device], **merged})).ok:
                    return tuple(d.id for d in subset), describe(merged)
    return None


def classify(impl: str, ctx, outcome, expected) -> Verdict:
    """Judge one implementation's `outcome` (a tensor or the exception it raised) against `expected`."""
    defects = applicable(impl, ctx)
    if isinstance(outcome, BaseException):
        text = f"{type(outcome).__name__}: {outcome}"[:400]
        tolerant = [d for d in defects if d.expectation(impl) == "any" or
                    (d.expectation(impl) == "reject" and isinstance(outcome, ValueError | TypeError))]
        if tolerant:
            return Verdict("rejected", detail=text, defects=tuple(d.id for d in tolerant))
        return Verdict("error", detail=text)
    if expected is None:
        return Verdict("error", detail="no expected output (the oracle failed)")
    result = compare(outcome, expected, name=impl)
    verdict = Verdict("pass", result.count, result.total, result.first, result.detail)
    must_reject = [d for d in defects if d.expectation(impl) == "reject"]
    if must_reject:
        verdict.status = "fail"
        verdict.note = f"expected a ValueError/TypeError ({', '.join(d.id for d in must_reject)}), got an output"
        return verdict
    if result.ok:
        predicted = [d.id for d in defects if d.expectation(impl) == "mismatch"]
        if predicted:
            verdict.note = f"predicted but not observed: {', '.join(predicted)}"
        return verdict
    anything = [d.id for d in defects if d.expectation(impl) == "any"]
    if anything:
        verdict.status, verdict.defects = "known", tuple(anything)
        return verdict
    found = explain(impl, ctx, outcome, expected, defects)
    if found is not None:
        verdict.status, (verdict.defects, verdict.model) = "known", found
        return verdict
    verdict.status = "fail"
    if defects:
        verdict.note = f"applicable entries {[d.id for d in defects]} do not explain it (no model matches)"
    return verdict
