"""The experiments' registry and runner: every variant bit-exact in the interpreter, and built for sm_75.

- Every variant file registers at least one variant; ids are unique and parents exist.
- Every variant that can run in Triton's interpreter is bit-exact (integer views) with
  `reference.dequantize_nf4(..., ftz=True)` on small odd cases (blocksize 64 and 32, fp16 and
  bf16, a tail after the last whole word/row, two state2 scales) and on an unaligned packed
  pointer (the byte paths). exact_expected=False variants must at least run (the interpreter
  never contracts to FMA, so they come out exact here).
- The runner catches a wrong or unwritten output; results carry device, versions and commit.
- The prmt.b32 codebook PTX of v21 is executed by a small PTX-subset emulator against the table.
- Every variant with a kernel compiles offline for sm_75 in fp16 and bf16 (child process without
  TRITON_INTERPRET) with zero spills unless it declares spills_expected; exact variants compile
  with fp fusion off and no FMA; the hints and asm each variant is about appear in the PTX.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import re

import numpy as np
import pytest
import torch

from experiments import ops, registry, runner
from experiments.ops import dequant as dequant_op
from experiments.registry import Variant

INTERPRETING = not runner.gpu_mode()
ALL_VARIANTS = registry.variants()
VARIANTS = {k: v for k, v in ALL_VARIANTS.items() if v.op == "dequant"}  # the linear ops': test_linear_variants.py
RUNNABLE = [v.id for v in VARIANTS.values() if not v.gpu_only]
WITH_KERNEL = [v.id for v in VARIANTS.values() if v.kernel is not None]
CASES = dequant_op.INTERPRETER_CASES

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="interpreter checks (a GPU run uses the runner)")


@functools.cache
def _inputs(case_text: str):
    case = dequant_op.parse_case(case_text)
    sets = dequant_op.make_inputs(case, "cpu", 1, seed=case.numel)
    return sets, dequant_op.expected_output(sets[0][0], sets[0][1], gpu=False)


def test_registry():
    import importlib

    assert len(VARIANTS) >= 12
    modules = set()
    for op in ops.names():
        package = importlib.import_module(f"experiments.variants.{op}")
        modules |= {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
                    if not m.name.startswith("_")}
    assert modules == {v.module for v in ALL_VARIANTS.values()}, "a variant file registers nothing"
    for v in VARIANTS.values():
        assert v.op in ops.names() and v.module.startswith(f"experiments.variants.{v.op}."), (v.id, v.op)
        assert re.fullmatch(r"v\d\d_[a-z0-9_]+", v.id), v.id
        assert v.parent is None or v.parent in VARIANTS, (v.id, v.parent)
        assert v.change and "\n" not in v.change, v.id
        assert v.teaches, f"{v.module} has no docstring saying what it teaches"
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("v00_naive", parent=None, change="again")(lambda *a, **k: None)
    assert "v00_naive" in runner.list_table()


@needs_interpreter
@pytest.mark.parametrize("case_text", CASES)
@pytest.mark.parametrize("vid", RUNNABLE)
def test_interpreter_exact(vid, case_text):
    variant = VARIANTS[vid]
    sets, expected = _inputs(case_text)
    row = runner.check_variant(variant, sets, expected, gpu=False)
    if variant.exact_expected:
        assert row["status"] == "exact", row
    else:  # runs, and says how many elements differ (the interpreter never fuses: 0)
        assert row["status"] in ("exact", "inexact (expected)") and "mismatches" in row, row


@needs_interpreter
@pytest.mark.parametrize("vid", RUNNABLE)
def test_interpreter_unaligned_packed(vid):
    """A packed tensor one byte off alignment: the byte-wise paths."""
    sets, expected = _inputs(CASES[0])
    packed, qs, out = sets[0]
    buf = torch.empty(packed.numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(packed.shape)
    shifted.copy_(packed)
    assert shifted.data_ptr() % 4 != 0
    row = runner.check_variant(VARIANTS[vid], [(shifted, qs, out)], expected, gpu=False)
    assert row["status"] in (("exact",) if VARIANTS[vid].exact_expected else ("exact", "inexact (expected)")), row


@needs_interpreter
def test_runner_catches_bad_outputs():
    sets, expected = _inputs(CASES[0])
    base = VARIANTS["v02_word4"]

    def off_by_one_ulp(packed, qs, out, *, ftz):
        base.run(packed, qs, out, ftz=ftz)
        out.view(-1)[17:20].view(torch.int16).add_(1)
        return out

    def writes_nothing(packed, qs, out, *, ftz):
        return out

    for run, count in ((off_by_one_ulp, 3), (writes_nothing, expected.numel())):
        bad = Variant(id="v98_mutant", parent=None, change="a wrong kernel", run=run)
        row = runner.check_variant(bad, sets, expected, gpu=False)
        assert row["status"] == "INEXACT" and row["mismatches"] == count, row
        assert row["first_mismatches"]
    inexact_ok = Variant(id="v98_mutant", parent=None, change="x", run=off_by_one_ulp, exact_expected=False)
    assert runner.check_variant(inexact_ok, sets, expected, gpu=False)["status"] == "inexact (expected)"


@needs_interpreter
def test_results_files(tmp_path):
    out = tmp_path / "r.json"
    payload = runner.run(["v02_word4", "v6*", "v99_production"], [CASES[0]], out=str(out), quiet=True)
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(json.dumps(payload["rows"], default=str))
    statuses = {r["variant"]: r["status"] for r in data["rows"]}
    assert statuses == {"v02_word4": "exact", "v60_inductor": "skipped", "v61_inductor_no_fusion": "skipped",
                        "v99_production": "exact"}
    for r in data["rows"]:
        assert r["device"] == "cpu (Triton interpreter)" and r["commit"] and r["triton"] and r["torch"]
    header = (tmp_path / "r.csv").read_text().splitlines()[0].split(",")
    assert header == runner.CSV_FIELDS
    assert "| v02_word4 | 37x129:fp16 | exact | 0 |" in runner.table(payload)


# --- v21's PTX, executed by an emulator of the instructions it uses --------------------------------


def test_prmt_codebook_ptx_emulated(nf4h):
    from experiments.variants.dequant.v21_prmt_lut import PRMT_PTX
    from reference.format import NF4_CODE_BITS

    rng = np.random.default_rng(0)
    words = [int(w) for w in rng.integers(0, 2**32, size=2000, dtype=np.uint64)]
    words += [int("".join([f"{c:x}"] * 8), 16) for c in range(16)]  # every code in every position
    words += [0x01234567, 0x89ABCDEF, 0xFEDCBA98, 0x76543210]
    for word in words:
        regs = nf4h.emulate_ptx(PRMT_PTX, {"$8": word})
        got = [regs[f"${k}"] for k in range(8)]
        expect = []
        for j in range(4):  # element 2j = high nibble of byte j, 2j + 1 = low nibble
            byte = (word >> (8 * j)) & 0xFF
            expect += [int(NF4_CODE_BITS[byte >> 4]), int(NF4_CODE_BITS[byte & 0xF])]
        assert got == expect, f"word {word:#010x}: {[hex(g) for g in got]} != {[hex(e) for e in expect]}"


# --- offline sm_75 builds -------------------------------------------------------------------------


@pytest.fixture(scope="session")  # (a compile of about 15 s on both cores: once a worker, however interleaved)
def sm75_builds():
    from experiments import sm75

    result = sm75.compile_in_child(WITH_KERNEL, jobs=2, timeout=900)
    assert "sm_75" in result["device"] and "offline compile only" in result["device"]
    builds: dict = {}
    for b in result["builds"]:
        builds.setdefault(b["variant"], []).append(b)
    return builds


@pytest.mark.parametrize("vid", WITH_KERNEL)
def test_sm75_build(sm75_builds, vid):
    variant = VARIANTS[vid]
    found = sm75_builds[vid]
    assert sorted(b["out_dtype"] for b in found) == ["bfloat16", "float16"]
    for b in found:
        assert not b.get("error"), f"{vid} {b['out_dtype']}: {b['error']}"
        assert b.get("n_regs", 0) > 0 and "spill_stores" in b, f"{vid}: no resource usage read: {b}"
        print(f"{vid} {b['out_dtype']}: {b['n_regs']} registers, {b['spill_stores']} B spill stores, "
              f"{b['shared_bytes']} B shared (ptxas {b.get('ptxas')})")
        if not variant.spills_expected:
            assert b["spill_stores"] == 0 and b["local_bytes"] == 0, f"{vid} {b['out_dtype']} spills: {b}"
        if variant.exact_expected:
            assert b["enable_fp_fusion"] is False, f"{vid} compiles with fp fusion on"
            assert b["fma"] == 0, f"{vid}: {b['fma']} fma.rn.f32 in the PTX"
        assert b["global_loads"] and b["global_stores"]


def _hints(builds, vid):
    return {h for b in builds[vid] for h in b["cache_hints"]}


def _forms(builds, vid, kind):
    return " ".join(f for b in builds[vid] for f in b[kind])


def test_sm75_variants_show_what_they_change(sm75_builds):
    b = sm75_builds
    assert all(x["fma"] > 0 for x in b["v41_fma_contraction_ieee"]), "control: contraction should produce FMAs"
    assert all(x["prmt"] >= 40 for x in b["v21_prmt_lut"]), "the prmt codebook asm is missing"
    assert "ld.global.nc.L1::no_allocate.v4.b32 (16 B)" in _forms(b, "v22_ld_nc_asm", "global_loads")
    assert ".cg" in _hints(b, "v13_packed_cg") and ".cs" in _hints(b, "v15_store_cs")
    assert "st.global.L1::evict_first" in _forms(b, "v16_store_evict_first", "global_stores")
    assert "L1::evict_first" not in _hints(b, "v11_packed_no_hint")
    assert "v4.b32 (16 B)" in _forms(b, "v03_word16", "global_loads")
    assert all(x["shared_bytes"] > 0 for x in b["v04_rows2d"]), "v04's join/reshape relayout uses shared memory"


def test_variant_modules_import_cleanly():
    for v in VARIANTS.values():
        assert importlib.import_module(v.module).__doc__


def test_bench_fresh_view_form_hands_each_view_once():
    """experiments bench's "fresh view, made beforehand" form: every call gets the next distinct view, never one
    twice (StopIteration past the last), with the QuantState passed through."""
    from experiments.bench import _each_once

    packed = torch.arange(8, dtype=torch.uint8)
    views = [packed.view(-1, 1) for _ in range(3)]
    seen = []
    call = _each_once(lambda v, qs: seen.append((id(v), qs)), views, "qs")
    for _ in range(3):
        call(None)
    assert [i for i, _ in seen] == [id(v) for v in views] and {q for _, q in seen} == {"qs"}
    with pytest.raises(StopIteration):
        call(None)
