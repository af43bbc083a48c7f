"""The fused linear's experiment variants: registered, operand-exact in the interpreter, built for sm_75.

- Every linear variant (ops `linear` and `linear_backward`) registers with an `lNN_` id, a parent
  that exists, a one-line change and a module docstring; its op's cases parse.
- Every one is operand-exact in Triton's interpreter on the op's small odd cases: x (dY) made of
  signed power-of-two-scaled identity rows, the output compared by integer views, in a NaN-poisoned
  buffer, with `scales * W[:, cols] + 0.0` (backward: `scales * W[rows, :] + 0.0`) from
  `reference.dequantize_nf4(ftz=True)`.
- The check has teeth: a wrong element, an unwritten element and a -0.0 for +0.0 are caught.
- The word GEMV variants (kernel "gemv_table", l06-l08) launch nf4_gemv_table_kernel on every slice of x (the
  launches recorded), and refuse a product where nf4.linear would take the codebook-0 GEMV instead.
- The tl.dot kernel that left nf4.linear (nf4_gemm_kernel, `variants/linear/_gemm_kernel.py`: l10-l18, and l21's
  fused backward) launches as the product launched it (frozen_gemm_launches.json, captured before the move) and
  keeps the checks it had there: operand-exact forward and backward (TRANS) at every blocksize up to 256, x
  float16 / bfloat16 against weights of three dtypes and storages, swapped and persistent grids, bfloat16
  subnormal weights and activations, ftz's flush; a persistent grid writes every tile; the float32 sum bound.
- The tensor-core word GEMV variants (l30-l36) are GPU only (listed as skipped by the interpreter run);
  they refuse the fallback nf4.linear would launch (their launches on a GPU: results/linear/
  experiments_gpu_*.json), and their auto split-K is auto_split's.
- Offline sm_75: the production variant (the GEMV with a T4's auto split-K, `nf4.linear.launch.auto_split`)
  and the split-K GEMV with its ordered sum (l05) build in fp16 and bf16 without spills; the tl.dot
  kernel builds in both dtypes as float32 FMAs (Triton lowers tl.dot to FMAs before sm_80: no
  mma.sync), and its spills are declared where measured. The word GEMV variants (l06-l08, l30-l36)
  and the word tl.dot kernel (l40-l42) are recorded as not built (min_arch 80), and that claim is
  checked by compiling the kernels' GPU launches offline: ptxas refuses them for sm_75 and builds them
  for sm_80.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import common, ops, registry, runner
from experiments.ops import linear as linear_op
from experiments.registry import Variant
from experiments.variants.linear import _gemm_kernel as gemm_kernel
from experiments.variants.linear.l30_gemv_mma import MMA, MMA8
from nf4.linear import launch as linear_launch
from nf4.linear import tuned as linear_tuned
from nf4.linear.gemm_word import nf4_gemm_word_kernel
from nf4.linear.gemv import nf4_gemv_kernel
from nf4.linear.gemv_mma import nf4_gemv_mma_kernel
from nf4.linear.gemv_table import nf4_gemv_table_kernel

LINEAR_OPS = ("linear", "linear_backward")
INTERPRETING = not runner.gpu_mode()
VARIANTS = {k: v for k, v in registry.variants().items() if v.op in LINEAR_OPS}
CHECKS = [(v.id, c) for v in VARIANTS.values() if not v.gpu_only for c in ops.get(v.op).interpreter_cases]

WORD_GEMV = ("l06_gemv_word_table", "l07_gemv_word_table_tile16", "l08_gemv_word_table_rows128")
WORD_GEMM = ("l40_gemm_word", "l41_gemm_word_split", "l42_gemm_word_plain")  # nf4_gemm_word_kernel (sm_80+)
# id: (config, rows of W per program, threads per program, bytes per lane and step)
# (GEMV_MMA and GEMV_MMA8, presets nf4 no longer names, are defined by l30_gemv_mma.py as MMA and MMA8)
MMA_GEMV = {"l30_gemv_mma": (MMA, 64, 128, 32),
            "l31_gemv_mma_tile16": (MMA.with_(step_bytes=16), 64, 128, 16),
            "l32_gemv_mma_warps2": (MMA.with_(num_warps=2, block_r=32), 32, 64, 32),
            "l33_gemv_mma8": (MMA8, 64, 128, 16),
            "l34_gemv_mma_warps_k4": (MMA.with_(warps_k=4, block_r=16, split_k=1), 16, 128, 32),
            "l35_gemv_mma_warps_k8": (MMA.with_(num_warps=8, warps_k=8, block_r=16, split_k=1), 16, 256, 32),
            "l36_gemv_mma_warps_k8_tile16": (linear_tuned.GEMV_MMA_WK16, 16, 256, 16)}

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="interpreter checks (a GPU run uses the runner)")


@functools.cache
def _inputs(op_name: str, case_text: str):
    op = ops.get(op_name)
    sets = op.make_inputs(op.parse_case(case_text), "cpu", 1)
    return sets, op.oracle(sets, False)


def test_linear_registry():
    assert set(LINEAR_OPS) <= set(ops.names())
    assert {"l00_production", "l01_gemv", "l10_gemm", "l11_gemm_swap", "l20_dequant_cublas",
            "l21_backward_gemm", *WORD_GEMV, *MMA_GEMV} <= set(VARIANTS)
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
    assert registry.lineage("l07_gemv_word_table_tile16") == ["l07_gemv_word_table_tile16", "l06_gemv_word_table",
                                                              "l01_gemv", "l00_production"]
    assert registry.lineage("l33_gemv_mma8") == ["l33_gemv_mma8", "l31_gemv_mma_tile16", "l30_gemv_mma",
                                                 "l06_gemv_word_table", "l01_gemv", "l00_production"]
    kernels = {**dict.fromkeys(WORD_GEMV, nf4_gemv_table_kernel), **dict.fromkeys(MMA_GEMV, nf4_gemv_mma_kernel),
               **dict.fromkeys(WORD_GEMM, nf4_gemm_word_kernel)}
    for vid, v in VARIANTS.items():  # only the word kernels need a later GPU than a T4; only l30-l36 need one at all
        assert v.min_arch == (80 if vid in kernels else 0), vid
        assert v.kernel is kernels[vid] if vid in kernels else v.kernel not in set(kernels.values()), vid
        assert (v.min_arch > 0) == bool(v.arch_reason), vid
        assert v.gpu_only == (vid in MMA_GEMV), vid
    for vid in MMA_GEMV:
        reason = VARIANTS[vid].arch_reason
        assert "mma.sync.aligned.m16n8k16" in reason and "cvt.rn.bf16x2.f32" in reason, (vid, reason)


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


def _recorded(vid: str, x, packed, qs, out) -> list:
    with common.recording() as calls:
        VARIANTS[vid].run(x, packed, qs, out, ftz=True)
    return calls


@needs_interpreter
@pytest.mark.parametrize("case_text", linear_op.INTERPRETER_CASES)
def test_word_gemv_launches_table_kernel(case_text):
    """l06-l08 launch nf4_gemv_table_kernel once per slice of at most 4 rows of x, with their own
    meta-parameters (split 1 in the interpreter: no second launch), where l01 launches nf4_gemv_kernel."""
    x, packed, qs, out = _inputs("linear", case_text)[0][0]
    m = x.shape[0]
    slices = [min(4, m - i) for i in range(0, m, 4)]
    want = {"l06_gemv_word_table": (64, 32), "l07_gemv_word_table_tile16": (64, 16),
            "l08_gemv_word_table_rows128": (128, 32)}
    for vid, (block_r, half) in want.items():
        calls = _recorded(vid, x, packed, qs, out)
        assert [fn for fn, *_ in calls] == [nf4_gemv_table_kernel] * len(slices), vid
        names = list(nf4_gemv_table_kernel.arg_names)
        for (_, grid, args, _), rows in zip(calls, slices, strict=True):
            got = {k: args[names.index(k)] for k in ("M", "BLOCK_M", "BLOCK_R", "HALF", "PARTIAL")}
            assert got == {"M": rows, "BLOCK_M": 1 << (rows - 1).bit_length(), "BLOCK_R": block_r, "HALF": half,
                           "PARTIAL": False}, (vid, got)
            assert grid[0] == -(-out.shape[1] // block_r), (vid, grid)  # cdiv(N, BLOCK_R) programs, no split
    assert {fn for fn, *_ in _recorded("l01_gemv", x, packed, qs, out)} == {nf4_gemv_kernel}


@needs_interpreter
def test_word_gemv_refuses_the_fallback():
    """Where nf4.linear would run the codebook-0 GEMV (x's dtype is not W's), the word GEMV variants raise
    rather than check another kernel under their name; l01 launches the codebook-0 GEMV for the same product."""
    sets, _ = _inputs("linear", linear_op.INTERPRETER_CASES[0])  # a bfloat16 weight
    x, packed, qs, out = sets[0]
    x16, out16 = x.to(torch.float16), torch.empty_like(out, dtype=torch.float16)
    for vid in WORD_GEMV:
        with pytest.raises(RuntimeError, match=r"nf4_gemv_table_kernel cannot run.*nf4_gemv_kernel instead"):
            _recorded(vid, x16, packed, qs, out16)
        row = runner.check_variant(VARIANTS[vid], [(x16, packed, qs, out16)], None, gpu=False)
        assert row["status"] == "error" and "cannot run" in row["error"], row
    assert [fn for fn, *_ in _recorded("l01_gemv", x16, packed, qs, out16)] == [nf4_gemv_kernel]


def test_mma_gemv_skipped_in_interpreter():
    """The interpreter run lists the tensor-core GEMV variants as skipped (not run, not failed)."""
    sets, expected = _inputs("linear", linear_op.INTERPRETER_CASES[0])
    for vid in MMA_GEMV:
        row = runner.check_variant(VARIANTS[vid], sets, expected, gpu=False)
        assert row["status"] == "skipped" and "GPU only" in row["note"], (vid, row)


def test_mma_gemv_split_per_programs():
    """The lanes' step and programs_per_sm decide the tensor-core variants' auto split-K, as
    nf4.linear.launch.auto_split does for a T4's 40 multiprocessors: l31 (12 programs per SM) splits K in two, l33
    (7) does not. (On a GPU the launches themselves are checked by the expect= guard: results/linear/
    experiments_gpu_*.json, where l30-l33 ran nf4_gemv_mma_kernel and were exact.)"""
    n, k = linear_op.SM75_NK
    for vid, want in (("l31_gemv_mma_tile16", 2), ("l33_gemv_mma8", 1)):
        config = MMA_GEMV[vid][0]
        split = linear_launch.auto_split(-(-n // config.block_r), k // 2 // (4 * 16), config.programs_per_sm * 40)
        assert split == want, (vid, split)


@needs_interpreter
def test_mma_gemv_refuses_the_fallback():
    """Where nf4.linear cannot run the tensor-core GEMV (here: Triton's interpreter, no PTX), l30-l36 raise
    rather than check or time the word GEMV or the codebook-0 GEMV it falls back to. (Every one falls back to the
    word GEMV: l33's GEMV_MMA8 went to the codebook-0 GEMV through its tuned fallback while nf4 named it; a config
    without one takes the next simpler kernel of the same shape.)"""
    x, packed, qs, out = _inputs("linear", linear_op.INTERPRETER_CASES[1])[0][0]
    fallback = {"l30_gemv_mma": "nf4_gemv_table_kernel", "l31_gemv_mma_tile16": "nf4_gemv_table_kernel",
                "l32_gemv_mma_warps2": "nf4_gemv_table_kernel", "l33_gemv_mma8": "nf4_gemv_table_kernel",
                "l34_gemv_mma_warps_k4": "nf4_gemv_table_kernel", "l35_gemv_mma_warps_k8": "nf4_gemv_table_kernel",
                "l36_gemv_mma_warps_k8_tile16": "nf4_gemv_table_kernel"}
    for vid, instead in fallback.items():
        with pytest.raises(RuntimeError, match=rf"nf4_gemv_mma_kernel cannot run.*{instead} instead"):
            _recorded(vid, x, packed, qs, out)


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

SM75_IDS = ["l00_production", "l05_gemv_split8", "l06_gemv_word_table", "l10_gemm", "l13_gemm_tile64",
            "l21_backward_gemm", "l30_gemv_mma", "l33_gemv_mma8"]
NOT_BUILT = {"l06_gemv_word_table": ("nf4_gemv_table_kernel", ("cvt.rn.bf16x2.f32",)),
             "l30_gemv_mma": ("nf4_gemv_mma_kernel", ("mma.sync.aligned.m16n8k16", "cvt.rn.bf16x2.f32")),
             "l33_gemv_mma8": ("nf4_gemv_mma_kernel", ("mma.sync.aligned.m16n8k16", "cvt.rn.bf16x2.f32"))}


@pytest.fixture(scope="module")
def sm75_builds():
    from experiments import sm75

    result = sm75.compile_in_child(SM75_IDS, jobs=2, timeout=600)
    assert "offline compile only" in result["device"] and "linear: 14336x4096" in result["weight"]
    builds: dict = {}
    for b in result["builds"]:
        builds.setdefault(b["variant"], []).append(b)
    return result, builds


def _builds_ok(rows):
    for b in rows:
        assert not b.get("error"), b
        assert b["n_regs"] > 0 and b["spill_stores"] == 0 and b["local_bytes"] == 0, b
        assert b["global_loads"] and b["global_stores"]
        assert b["enable_fp_fusion"] is True  # nf4.linear compiles with contraction on (products of 16-bit floats)


@pytest.mark.slow  # an offline sm_75 build of every linear variant (make test-long)
def test_sm75_production_builds(sm75_builds):
    """At M = 1 a T4 (40 multiprocessors) launches the codebook-0 GEMV with the split nf4.linear.launch.auto_split
    picks for it: 448 blocks of 32 rows, 64 steps, 640 programs at once, so split 2 is two waves of 32 steps,
    no fewer than one wave of 64, and the tie goes to no split (one launch). l05's split-K of 8 is the GEMV
    with float32 partials and their ordered sum (nf4_split_sum_kernel, SUM_BLOCK outputs per program)."""
    _, builds = sm75_builds
    n, k = linear_op.SM75_NK
    gemv = linear_tuned.GEMV
    split = linear_launch.auto_split(-(-n // gemv.block_r), k // 2 // 32, gemv.programs_per_sm * 40)
    assert split == 1
    found = builds["l00_production"]
    assert sorted((b["out_dtype"], "launch" in b) for b in found) == [("bfloat16", False), ("float16", False)]
    _builds_ok(found)
    assert all(b["kernel"].endswith(":nf4_gemv_kernel") and b["constexprs"]["PARTIAL"] is False for b in found)
    assert all(b["constexprs"]["ASM"] is True and b["constexprs"]["BF16_BITS"] is False for b in found)
    found = builds["l05_gemv_split8"]
    assert sorted((b["out_dtype"], b["launch"]) for b in found) == [("bfloat16", 0), ("bfloat16", 1),
                                                                   ("float16", 0), ("float16", 1)]
    _builds_ok(found)
    assert all(b["kernel"].endswith(":nf4_gemv_kernel") and b["constexprs"]["PARTIAL"] for b in found
               if b["launch"] == 0)
    assert all(b["kernel"].endswith(":nf4_split_sum_kernel") and b["constexprs"]["SPLIT"] == 8
               and b["constexprs"]["BLOCK"] == linear_launch.SUM_BLOCK for b in found if b["launch"] == 1)


@pytest.mark.slow  # an offline sm_75 build of every linear variant (make test-long)
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


@pytest.mark.slow  # an offline sm_75 build of every linear variant (make test-long)
def test_sm75_word_gemv_not_built(sm75_builds):
    """The word GEMVs' rows (l06's product table, l30/l33's tensor cores) say why they have no sm_75 build;
    nothing (the codebook-0 fallback least of all) is compiled in their names, and such a row is not a failure."""
    result, builds = sm75_builds
    for vid, (kernel, needs) in NOT_BUILT.items():
        rows = builds[vid]
        assert sorted(b["out_dtype"] for b in rows) == ["bfloat16", "float16"]
        for b in rows:
            assert b["not_built"].startswith("needs sm_80+: ") and all(w in b["not_built"] for w in needs), b
            assert b["kernel"].endswith(f":{kernel}"), b
            assert not {"build", "n_regs", "constexprs", "error"} & set(b), b
    assert not any(b.get("not_built") for vid, rows in builds.items() if vid not in NOT_BUILT for b in rows)
    from experiments import sm75

    assert "not built: needs sm_80+" in sm75.table(result) and not sm75.failures(result)


# The word GEMVs' launches as a GPU would issue them (kernel_args with CPU stand-ins, interpreting=False: ASM on;
# kernel_args launches the config's kernel as it is, the tensor-core GEMV included, as an sm_80+ GPU would) for the
# sm_75 weight at M = 1 with a T4's auto split-K, compiled offline for sm_75 and sm_80 in a child without
# TRITON_INTERPRET.
_WORD_GEMV_BUILD = """
import json, re, torch, triton
from triton.backends.compiler import GPUTarget
from experiments import sm75
from experiments.ops.linear import SM75_NK
from experiments.variants.linear._common import T4_SMS
from experiments.variants.linear.l30_gemv_mma import MMA
from nf4 import NF4Weight, runtime
from nf4.linear import launch, tuned
n, k = SM75_NK
found = {}
configs = {"table": tuned.GEMV_TABLE, "mma": MMA, "mma-warps_k": MMA.with_(warps_k=4, block_r=16, split_k=1),
           "word-gemm": tuned.WORD_GEMM128.with_(split_k=1)}
for name, cfg in configs.items():
    for dt in (torch.float16, torch.bfloat16):
        w = NF4Weight(torch.empty(64, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8), torch.empty(16),
                      torch.empty(256), torch.empty(()), (n, k), 64, dt, True)
        split = cfg.split_k or launch.auto_split(triton.cdiv(n, cfg.block_r),
                                                 triton.cdiv(k // 2, launch.gemv_step(cfg, w)),
                                                 cfg.programs_per_sm * T4_SMS)
        (fn, _, args, options), *_ = launch.kernel_args(
            torch.empty((1, k), dtype=dt), w, None, torch.empty((1, n), dtype=dt), 1,
            cfg.with_(split_k=split), True, False, torch.empty(split * n))
        spec = sm75.source_spec(fn, runtime.positional(fn, args), {**options, "enable_fp_fusion": True})
        for arch in (75, 80):
            key = f"{fn.__name__} {dt} {name} sm_{arch}"
            try:
                src = triton.compiler.ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                                                attrs=spec["attrs"])
                ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec["options"]).asm["ptx"]
                found[key] = {"asm": args.get("ASM"), "cvt_x2": len(re.findall(r"cvt\\.rn\\.b?f16x2\\.f32", ptx)),
                              "prmt": ptx.count("prmt.b32"), "mma": len(re.findall(r"mma\\.sync\\.aligned", ptx)),
                              "bar": ptx.count("bar.sync")}
            except Exception as exc:  # ptxas's refusals, one line per feature (the full message repeats them)
                refused = sorted(set(re.findall(r"Feature '[^']*' requires \\.target sm_\\d+ or higher", str(exc))))
                found[key] = {"asm": args.get("ASM"), "error": "; ".join(refused) or str(exc)[:4000]}
print(json.dumps(found))
"""


@pytest.mark.slow  # offline sm_75 / sm_80 builds (make test-long)
def test_word_gemv_needs_sm80():
    """What the word GEMVs' sm_75 rows claim: ptxas refuses their PTX for sm_75 (the packed conversions, and the
    m16n8k16 mma of nf4_gemv_mma_kernel, need sm_80) and builds the same launches for sm_80, in fp16 and bf16;
    the tensor-core GEMV with 4 warps per row group (warps_k) builds too, its sums added through shared memory."""
    from experiments import sm75

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(sm75.ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _WORD_GEMV_BUILD], cwd=sm75.ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 16, found
    assert {key.split()[0] for key in found} == {"nf4_gemv_table_kernel", "nf4_gemv_mma_kernel", "nf4_gemm_word_kernel"}
    for key, r in found.items():
        mma = key.startswith("nf4_gemv_mma_kernel ")
        if key.startswith("nf4_gemm_word_kernel ") and key.endswith("sm_80"):  # tl.dot: Triton's mma.sync, bar.sync
            assert "error" not in r and r["cvt_x2"] >= 8 and r["prmt"] > 0 and r["mma"] > 0, (key, r)
            continue
        assert r["asm"] is (None if mma else True), (key, r)  # the tensor-core kernel has PTX only (no ASM switch)
        if key.endswith("sm_75"):
            error = r.get("error", "")
            assert re.search(r"Feature 'cvt\.b?f16x2\.f32' requires \.target sm_80 or higher", error), (key, r)
            assert bool(re.search(r"Feature '\.m16n8k16' requires \.target sm_80 or higher", error)) == mma, (key, r)
        else:
            assert "error" not in r and r["cvt_x2"] >= 8 and r["prmt"] > 0, (key, r)
            assert (r["mma"] >= 8) == mma, (key, r)
            assert (r["bar"] > 0) == (" mma-warps_k " in key), (key, r)  # only the warps' sum synchronises


# --- the tl.dot kernel that left nf4.linear (nf4_gemm_kernel: l10-l18, l21) --------------------------------------

FROZEN_GEMM = json.loads((Path(__file__).with_name("frozen_gemm_launches.json")).read_text())
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _stand_in_weight(name: str):
    from nf4 import NF4Weight

    n, k, blocksize, nested, dtype = FROZEN_GEMM["weights"][name]
    blocks = n * k // blocksize
    packed = torch.zeros(n * k // 2, 1, dtype=torch.uint8)
    state = ((torch.zeros(blocks, dtype=torch.uint8), torch.zeros(-(-blocks // 256)), torch.zeros(256),
              torch.zeros(())) if nested else (torch.zeros(blocks), None, None, None))
    return NF4Weight(packed, *state, (n, k), blocksize, _DT[dtype], nested)


@pytest.mark.parametrize("i", range(len(FROZEN_GEMM["cases"])))
def test_gemm_kernel_launches_as_the_product_did(i):
    """_gemm_kernel.launches builds the launches nf4.linear.launch.kernel_args built for kernel "gemm" (captured
    before the move, stand-in tensors named by role)."""
    from nf4 import runtime

    case = FROZEN_GEMM["cases"][i]
    w = _stand_in_weight(case["weight"])
    n, k = w.shape
    m, dtype, trans = case["m"], _DT[case["x"]], case["trans"]
    x = torch.zeros(m, n if trans else k, dtype=dtype)
    out = torch.zeros(m, k if trans else n, dtype=dtype)
    bias = torch.zeros(n, dtype=dtype) if case["bias"] else None
    cpu = torch.device("cpu")
    roles = {"x": x, "packed": w.packed, "absmax": w.absmax, "absmax2": w.absmax2, "code2": w.code2,
             "offset": w.offset, "out": out, "bias": bias, "levels": runtime.level_table(cpu),
             "level_pairs": runtime.level_table(cpu, pairs=True), "dummy": runtime.stand_in(cpu)}
    names = {id(t): role for role, t in roles.items() if t is not None}
    fields = {f: v for f, v in case["fields"].items() if f != "kernel"}
    got = gemm_kernel.launches(x, w, bias, out, m, trans, gemm_kernel.GemmConfig(**fields), case["ftz"],
                               case["interpreting"])
    got = [[fn.__name__, list(grid),
            {a: f"@{names.get(id(v), '?')}" if isinstance(v, torch.Tensor) else v for a, v in args.items()},
            dict(options)] for fn, grid, args, options in got]
    assert got == case["launches"]


GEMM_FORWARD = {
    "plain-cb1": gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64, codebook=1),
    "swap-cb0": gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=128, swap=True, codebook=0),
    # persistent: the interpreter's 3 programs loop over all the output tiles
    "persistent-cb2": gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64, codebook=2, persistent=1),
}
GEMM_BACKWARD = {
    "cb0": gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64, codebook=0),
    "wide": gemm_kernel.GemmConfig(block_m=32, block_n=16, block_k=128, swap=True),  # swap: forward only
    "persistent-cb2": gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64, codebook=2, persistent=2),
}
X_DTYPES = (torch.float16, torch.bfloat16)
W_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STORAGES = (torch.uint8, torch.bfloat16, torch.float32)
K_OF = {32: 96, 64: 128, 128: 256, 256: 256}  # blocksize -> K: whole blocks per row
N_ROWS = 45  # odd; not a multiple of any tile


def _gemm_case(i: int):
    x_dtype = X_DTYPES[i % 2]
    return x_dtype, W_DTYPES[i % 3], i % 2 == 0, STORAGES[(i // 2) % 3]


def _identity_rows(cols, dtype, width: int, seed: int):
    """x[i] = scales[i] * e_{cols[i]}: scales +-2**e (e in -2..2), row 0 plain 1.0."""
    g = torch.Generator().manual_seed(seed)
    m = cols.numel()
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    scales = sign * torch.exp2(torch.randint(-2, 3, (m,), generator=g).float())
    scales[0] = 1.0
    x = torch.zeros(m, width, dtype=dtype)
    x[torch.arange(m), cols] = scales.to(dtype)
    return x, scales


def _picked(wmat, cols, scales, dtype):
    return (scales[:, None].float() * wmat.float()[cols] + 0.0).to(dtype)


def _gemm_run(x, packed, qs, config, *, trans=False, ftz=False, bias=None):
    n, k = qs.shape
    out = torch.empty((x.shape[0], k if trans else n), dtype=x.dtype)
    return gemm_kernel.launch(x, packed, qs, out, config, ftz=ftz, trans=trans, bias=bias)


def _check_gemm(packed, qs, x_dtype, config, seed, *, trans, ftz=False, name=""):
    """Every column of W (forward) or row (backward) through a permutation of identity rows, and 2 rows at random."""
    import nf4
    from verify.exact import assert_bitexact

    n, k = qs.shape
    wd = nf4.dequantize(packed, qs, ftz=ftz).to(x_dtype)
    wmat, width = (wd, n) if trans else (wd.t(), k)
    g = torch.Generator().manual_seed(seed)
    for label, cols in (("all", torch.randperm(width, generator=g)), ("2 rows", torch.randint(0, width, (2,),
                                                                                            generator=g))):
        x, scales = _identity_rows(cols, x_dtype, width, seed + 3)
        got = _gemm_run(x, packed, qs, config, trans=trans, ftz=ftz)
        assert_bitexact(got, _picked(wmat, cols, scales, x_dtype), name=f"{name} {'backward' if trans else 'forward'}"
                        f", {label}")


@needs_interpreter
@pytest.mark.parametrize("blocksize", sorted(K_OF))
@pytest.mark.parametrize(("direction", "config_name"), [("forward", c) for c in GEMM_FORWARD] +
                         [("backward", c) for c in GEMM_BACKWARD])
def test_gemm_kernel_operand(nf4h, direction, config_name, blocksize):
    """nf4_gemm_kernel forward and TRANS (l21's fused backward) on every weight, as nf4.linear's tests checked it
    while the product had it."""
    trans = direction == "backward"
    configs = GEMM_BACKWARD if trans else GEMM_FORWARD
    i = list(configs).index(config_name) + 3 * sorted(K_OF).index(blocksize) + trans
    x_dtype, w_dtype, dq, storage = _gemm_case(i)
    seed = nf4h.case_seed("gemm-kernel-operand", direction, config_name, blocksize)
    packed, qs = nf4h.quantize((N_ROWS, K_OF[blocksize]), w_dtype, blocksize, dq, seed=seed, quant_storage=storage)
    name = f"{config_name} bs={blocksize} x={x_dtype} W={w_dtype} dq={dq} storage={storage}"
    _check_gemm(packed, qs, x_dtype, configs[config_name], seed, trans=trans, name=name)


@needs_interpreter
@pytest.mark.parametrize("trans", [False, True], ids=["forward", "backward"])
def test_gemm_kernel_subnormals(nf4h, trans):
    """Weights among the float32 subnormals kept by bfloat16 x without ftz (each product rounded once in float32),
    the same state flushed with ftz, and bfloat16 subnormal activations (2**-130, -2**-128, 3 * 2**-133)."""
    import nf4
    from verify.exact import assert_bitexact

    config = (GEMM_BACKWARD["cb0"] if trans else GEMM_FORWARD["plain-cb1"])
    for double_quant in (True, False):
        packed, qs = nf4h.quantize((40, 128), torch.float32, 64, double_quant,
                                   seed=nf4h.case_seed("gemm-kernel-tiny", double_quant, trans))
        tiny = nf4h.tiny_state(qs, seed=3)
        wd = nf4.dequantize(packed, tiny, ftz=False).to(torch.bfloat16)
        assert ((wd != 0) & (wd.float().abs() < 2.0**-126)).any(), "no subnormal weight to test"
        _check_gemm(packed, tiny, torch.bfloat16, config, 5, trans=trans, ftz=False, name=f"ieee dq={double_quant}")
        _check_gemm(packed, tiny, torch.bfloat16, config, 5, trans=trans, ftz=True, name=f"ftz dq={double_quant}")
    packed, qs = nf4h.quantize((40, 128), torch.bfloat16, 64, True, seed=nf4h.case_seed("gemm-kernel-subx", trans))
    wd = nf4.dequantize(packed, qs, ftz=False).to(torch.bfloat16)
    width = 40 if trans else 128
    cols = torch.randint(0, width, (3,), generator=torch.Generator().manual_seed(7))
    scales = torch.tensor((2.0**-130, -(2.0**-128), 3 * 2.0**-133), dtype=torch.float32)
    x = torch.zeros(3, width, dtype=torch.bfloat16)
    x[torch.arange(3), cols] = scales.to(torch.bfloat16)
    assert torch.equal(x[torch.arange(3), cols].float(), scales)  # exact bfloat16 subnormals
    got = _gemm_run(x, packed, qs, config, trans=trans)
    assert_bitexact(got, _picked(wd if trans else wd.t(), cols, scales, torch.bfloat16), name="subnormal x")


@needs_interpreter
def test_gemm_kernel_persistent_grid_writes_every_tile(nf4h):
    """A persistent grid (fewer programs than output tiles, each looping over tiles pid, pid + programs, ...)
    writes every element of a poisoned out and nothing outside it, forward and backward, and equals the
    one-program-per-tile grid bit for bit."""
    from nf4 import NF4Weight, runtime
    from verify.exact import assert_bitexact

    config = gemm_kernel.GemmConfig(block_m=16, block_n=16, block_k=64, codebook=0, persistent=1)
    n, k, m = 70, 128, 37  # 5 x 3 forward tiles, 2 x 3 backward (K / 2 = 64 bytes in steps of 32)
    packed, qs = nf4h.quantize((n, k), torch.bfloat16, 64, True, seed=nf4h.case_seed("persistent-gemm"))
    w = NF4Weight.from_state(packed, qs)
    g = torch.Generator().manual_seed(nf4h.case_seed("persistent-gemm-x"))
    for trans, width, n_out, tiles in ((False, k, n, 15), (True, n, k, 6)):
        x = torch.randn(m, width, generator=g).to(torch.bfloat16)
        buf, out = nf4h.poisoned_out((m, n_out), torch.bfloat16, "cpu", lead=3)
        ((fn, grid, args, options),) = gemm_kernel.launches(x, w, None, out, m, trans, config, False, True)
        assert grid == (gemm_kernel.INTERPRET_PROGRAMS,) and gemm_kernel.INTERPRET_PROGRAMS < tiles
        runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
        nf4h.assert_poison_intact(buf, 3, 3 + out.numel())
        expected = _gemm_run(x, packed, qs, config.with_(persistent=0), trans=trans)
        assert_bitexact(out, expected, name=f"persistent gemm, trans={trans}")


@needs_interpreter
@pytest.mark.parametrize("dtype", X_DTYPES, ids=["fp16", "bf16"])
def test_gemm_kernel_within_the_sum_bound(nf4h, dtype):
    """Random x, with and without a bias, forward (plain and swapped) and backward: every output within
    reference.linear.accumulation_bound of the float64 product of the exact operand."""
    import nf4
    from reference.linear import worst_ratio

    n, k = 77, 256
    packed, qs = nf4h.quantize((n, k), dtype, 64, True, seed=nf4h.case_seed("gemm-kernel-sum", dtype))
    wd = nf4.dequantize(packed, qs, ftz=False).to(dtype)
    w64 = wd.double().numpy()
    g = torch.Generator().manual_seed(nf4h.case_seed("gemm-kernel-sum-x", dtype))

    def randn(shape):
        return (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())).to(
            dtype)

    bias = randn((n,))
    for name, config, m in (("plain", gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64), 40),
                            ("swap", gemm_kernel.GemmConfig(block_m=16, block_n=32, block_k=64, swap=True), 20)):
        x = randn((m, k))
        for b in (None, bias):
            y = _gemm_run(x, packed, qs, config, bias=b)
            ratio = worst_ratio(y.double().numpy(), x.double().numpy(), w64, dtype,
                                None if b is None else b.double().numpy())
            assert ratio <= 1.0, (name, b is not None, ratio)
    dy = randn((24, n))
    got = _gemm_run(dy, packed, qs, GEMM_BACKWARD["cb0"], trans=True)
    assert worst_ratio(got.double().numpy(), dy.double().numpy(), wd.t().double().numpy(), dtype) <= 1.0
