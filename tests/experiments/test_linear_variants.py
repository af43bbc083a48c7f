"""The fused linear's experiment variants: registered, operand-exact in the interpreter, built for sm_75.

- Every linear variant (ops `linear` and `linear_backward`) registers with an `lNN_` id, a parent
  that exists, a one-line change and a module docstring; its op's cases parse.
- Every one is operand-exact in Triton's interpreter on the op's small odd cases: x (dY) made of
  signed power-of-two-scaled identity rows, the output compared by integer views, in a NaN-poisoned
  buffer, with `scales * W[:, cols] + 0.0` (backward: `scales * W[rows, :] + 0.0`) from
  `reference.dequantize_nf4(ftz=True)`.
- The check has teeth: a wrong element, an unwritten element and a -0.0 for +0.0 are caught.
- Offline sm_75: the production variant (GEMV and its split-K sum, as a T4 would launch them) builds
  in fp16 and bf16 without spills; the tl.dot kernel builds in both dtypes as float32 FMAs (Triton
  lowers tl.dot to FMAs before sm_80: no mma.sync), and its spills are declared where measured.
"""

from __future__ import annotations

import functools
import importlib
import re

import pytest
import torch

from experiments import ops, registry, runner
from experiments.ops import linear as linear_op
from experiments.registry import Variant

LINEAR_OPS = ("linear", "linear_backward")
INTERPRETING = not runner.gpu_mode()
VARIANTS = {k: v for k, v in registry.variants().items() if v.op in LINEAR_OPS}
CHECKS = [(v.id, c) for v in VARIANTS.values() for c in ops.get(v.op).interpreter_cases]

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="interpreter checks (a GPU run uses the runner)")


@functools.cache
def _inputs(op_name: str, case_text: str):
    op = ops.get(op_name)
    sets = op.make_inputs(op.parse_case(case_text), "cpu", 1)
    return sets, op.oracle(sets, False)


def test_linear_registry():
    assert set(LINEAR_OPS) <= set(ops.names())
    assert {"l00_production", "l01_gemv", "l10_gemm", "l11_gemm_swap", "l20_dequant_cublas",
            "l21_backward_gemm"} <= set(VARIANTS)
    for v in VARIANTS.values():
        assert re.fullmatch(r"l\d\d_[a-z0-9_]+", v.id), v.id
        assert v.module.startswith(f"experiments.variants.{v.op}."), (v.id, v.module)
        assert v.parent is None or v.parent in registry.variants(), (v.id, v.parent)
        assert v.change and "\n" not in v.change, v.id
        assert v.teaches and importlib.import_module(v.module).__doc__, v.id
        assert v.kernel is not None, f"{v.id}: no kernel, so no sm_75 build"
        for case in ops.get(v.op).interpreter_cases + ops.get(v.op).gpu_cases:
            ops.get(v.op).parse_case(case)
    assert len({v.id[:3] for v in VARIANTS.values()}) == len(VARIANTS), "two variants share a number"
    assert registry.lineage("l05_gemv_split8") == ["l05_gemv_split8", "l01_gemv", "l00_production"]


def test_cases_and_bytes():
    case = linear_op.parse_case("14336x4096x16:bf16")
    assert (case.n, case.k, case.m, case.dtype, case.blocksize) == (14336, 4096, 16, torch.bfloat16, 64)
    n_blocks = 14336 * 4096 // 64
    assert case.min_bytes == 14336 * 4096 // 2 + n_blocks + n_blocks // 256 * 4 + 256 * 4 + 4 + 16 * (14336 + 4096) * 2
    assert linear_op.parse_case("40x256x3:fp16:32").blocksize == 32
    with pytest.raises(ValueError, match="NxKxM"):
        linear_op.parse_case("40x256:fp16")


def test_expected_operand_signs():
    """+0.0 where a negative scale meets a zero weight (the exact sum of zeros); exact power-of-two scaling."""
    wd = torch.tensor([[0.0, 1.5], [-0.25, 3.0], [2.0, -0.0]], dtype=torch.bfloat16)  # N=3, K=2
    x = torch.tensor([[-2.0, 0.0], [0.0, 0.5]], dtype=torch.bfloat16)  # column 0 scaled -2, column 1 scaled 0.5
    got = linear_op.expected_operand(x, wd)
    want = torch.tensor([[0.0, 0.5, -4.0], [0.75, 1.5, 0.0]], dtype=torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    dy = torch.tensor([[0.0, 0.0, -1.0]], dtype=torch.bfloat16)  # row 2 of W, negated
    assert torch.equal(linear_op.expected_operand(dy, wd, backward=True).view(torch.int16),
                       torch.tensor([[-2.0, 0.0]], dtype=torch.bfloat16).view(torch.int16))


def test_identity_rows():
    x = linear_op.identity_rows(300, 128, torch.float16, seed=3)
    nonzero = (x != 0).sum(dim=1)
    assert torch.equal(nonzero, torch.ones(300, dtype=torch.long))
    vals = x[x != 0].double().abs()
    assert set(torch.log2(vals).tolist()) <= set(range(*linear_op.SCALE_OCTAVES))
    assert (x[x != 0] < 0).any() and (x[x != 0] > 0).any()
    cols = x.abs().argmax(dim=1)
    assert len(set(cols[:128].tolist())) == 128, "each column once per K rows"


@needs_interpreter
@pytest.mark.parametrize(("vid", "case_text"), CHECKS)
def test_interpreter_operand_exact(vid, case_text):
    variant = VARIANTS[vid]
    sets, expected = _inputs(variant.op, case_text)
    row = runner.check_variant(variant, sets, expected, gpu=False)
    assert row["status"] == "exact", row


@needs_interpreter
def test_runner_catches_bad_linear_outputs():
    sets, expected = _inputs("linear", linear_op.INTERPRETER_CASES[1])
    base = VARIANTS["l10_gemm"]

    def off_by_one_ulp(x, packed, qs, out, *, ftz):
        base.run(x, packed, qs, out, ftz=ftz)
        out.view(-1)[5:7].view(torch.int16).add_(1)
        return out

    def last_row_unwritten(x, packed, qs, out, *, ftz):
        base.run(x[:-1], packed, qs, out[:-1], ftz=ftz)
        return out

    def negative_zeros(x, packed, qs, out, *, ftz):  # -0.0 where the exact sum is +0.0
        base.run(x, packed, qs, out, ftz=ftz)
        flat = out.view(-1).view(torch.int16)
        flat[flat == 0] = -(2**15)
        return out

    zeros = int((expected.view(torch.int16) == 0).sum())
    assert zeros > 0
    n_out = expected.shape[1]
    for run, count in ((off_by_one_ulp, 2), (last_row_unwritten, n_out), (negative_zeros, zeros)):
        bad = Variant(id="l98_mutant", parent=None, change="a wrong kernel", run=run, op="linear")
        row = runner.check_variant(bad, sets, expected, gpu=False)
        assert row["status"] == "INEXACT" and row["mismatches"] == count, row


@needs_interpreter
def test_linear_results_files(tmp_path):
    out = tmp_path / "r.json"
    payload = runner.run(["l00_production", "l22_backward_production"], [], out=str(out), quiet=True)
    rows = {(r["variant"], r["case"]): r for r in payload["rows"]}
    assert set(rows) == {("l00_production", c) for c in linear_op.INTERPRETER_CASES} | {
        ("l22_backward_production", c) for c in linear_op.BACKWARD_INTERPRETER_CASES}
    assert all(r["status"] == "exact" for r in rows.values())
    assert set(payload["oracles"]) == {"linear", "linear_backward"}
    assert "identity rows of dY" in payload["oracles"]["linear_backward"]
    assert (tmp_path / "r.csv").read_text().splitlines()[0].split(",") == runner.CSV_FIELDS


# --- offline sm_75 builds -------------------------------------------------------------------------

SM75_IDS = ["l00_production", "l10_gemm", "l13_gemm_tile64", "l21_backward_gemm"]


@pytest.fixture(scope="module")
def sm75_builds():
    from experiments import sm75

    result = sm75.compile_in_child(SM75_IDS, jobs=2, timeout=600)
    assert "offline compile only" in result["device"] and "linear: 14336x4096" in result["weight"]
    builds: dict = {}
    for b in result["builds"]:
        builds.setdefault(b["variant"], []).append(b)
    return result, builds


def test_sm75_production_builds(sm75_builds):
    """At M = 1 a T4 launches the GEMV with split-K (40 multiprocessors) and the ordered sum of the partials."""
    _, builds = sm75_builds
    found = builds["l00_production"]
    assert sorted((b["out_dtype"], b["launch"]) for b in found) == [("bfloat16", 0), ("bfloat16", 1),
                                                                   ("float16", 0), ("float16", 1)]
    for b in found:
        assert not b.get("error"), b
        assert b["n_regs"] > 0 and b["spill_stores"] == 0 and b["local_bytes"] == 0, b
        assert b["global_loads"] and b["global_stores"]
        assert b["enable_fp_fusion"] is True  # nf4.linear compiles with contraction on (products of 16-bit floats)
    gemv = [b for b in found if b["launch"] == 0]
    assert all(b["kernel"].endswith(":nf4_gemv_kernel") and b["constexprs"]["PARTIAL"] for b in gemv)
    assert all(b["constexprs"]["ASM"] is True and b["constexprs"]["BF16_BITS"] is False for b in gemv)
    assert all(b["kernel"].endswith(":nf4_split_sum_kernel") for b in found if b["launch"] == 1)


def test_sm75_tl_dot_is_fma(sm75_builds):
    """tl.dot compiles for sm_75 in fp16 and bf16, as float32 FMAs (no mma.sync before sm_80 in this Triton)."""
    result, builds = sm75_builds
    for vid in ("l10_gemm", "l13_gemm_tile64", "l21_backward_gemm"):
        assert sorted(b["out_dtype"] for b in builds[vid]) == ["bfloat16", "float16"]
        for b in builds[vid]:
            assert not b.get("error"), b
            assert b["kernel"].endswith(":nf4_gemm_kernel") and b["constexprs"]["DOT_F32"] is False
            assert b["fma"] >= 1024 and "mma" not in b, b
            assert (b["spill_stores"] > 0) == VARIANTS[vid].spills_expected, (vid, b["spill_stores"])
    assert builds["l21_backward_gemm"][0]["constexprs"]["TRANS"] is True
    from experiments import sm75

    assert not sm75.failures(result)
