"""`python -m verify` on a CPU: the quick matrix passes, and its judge cannot be fooled.

The quick CPU matrix runs in-process once (about 40 s on 2 cores): every cell must pass or be a
known third-party defect recognised by its model (verify/known.py). Then the judge itself: one
flipped bit in nf4's output is reported as 1 mismatch at the right index with exit status 1; a
known defect's case with one more flipped bit is no longer explained; a truncated packed tensor
must be rejected by nf4. Also the models behind the known defects, the torch.compile peer's
plumbing (inductor's C++ backend here), and the challenge harness on a tiny CPU configuration.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from math import prod

import numpy as np
import pytest
import torch

pytest.importorskip("bitsandbytes")

import reference
from verify import __main__ as cli
from verify import cases, challenge, impls, inductor, known, matrix, models, report
from verify.exact import compare

try:
    from triton.runtime.interpreter import InterpretedFunction

    from nf4.dequant.kernel import nf4_dequantize_kernel

    INTERPRETED = isinstance(nf4_dequantize_kernel, InterpretedFunction)
except ImportError:  # pragma: no cover
    INTERPRETED = False

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="the CPU matrix needs Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA)")
CPU_IMPLS = [n for n, impl in impls.IMPLEMENTATIONS.items() if "cpu" in impl.devices]


def _flip_bit(fn, flat_index: int):
    """Wrap an implementation so that the lowest bit of one output element is flipped."""
    def flipped(packed, qs):
        out = fn(packed, qs).clone()
        view = {2: torch.int16, 4: torch.int32}[out.element_size()]
        out.view(view).view(-1)[flat_index] ^= 1
        return out
    return flipped


def _one_case(case: cases.Case, names=None):
    cells, lost = matrix.run_case(case, names or CPU_IMPLS, "cpu")
    assert lost is None
    return {c["impl"]: c for c in cells}


# --- the quick matrix ---------------------------------------------------------------------------


# The quick matrix takes about 15 s on one core: the fixture lives for the session, so that an xdist worker makes it
# once however its tests are interleaved with other modules' (a module fixture is made again each time).
@pytest.fixture(scope="session")
def quick_cells():
    with np.errstate(over="ignore", invalid="ignore"):
        return matrix.run(cases.grid(quick=True), CPU_IMPLS, "cpu")


@needs_interpreter
def test_quick_matrix_has_no_failures(quick_cells):
    bad = [c for c in quick_cells if c["status"] in ("fail", "error")]
    assert not bad, report.failures(quick_cells)


@needs_interpreter
def test_quick_matrix_nf4_and_oracles_exact(quick_cells):
    """nf4, the reference and bitsandbytes' default backend pass everywhere, except the truncated inputs,
    which they reject or fail on as verify.known says."""
    for c in quick_cells:
        if c["impl"] in ("nf4", "reference", "bnb.default"):
            expected = "rejected" if "storage" in c["case"] and c["shape"] == [3, 5, 67] else "pass"
            assert c["status"] == expected, (c["case"], c["impl"], c["status"], c.get("detail"))


@needs_interpreter
def test_quick_matrix_covers_every_group_and_sees_the_defects(quick_cells):
    assert {c["group"] for c in quick_cells} == set(cases.GROUPS)
    seen = {d for c in quick_cells for d in c.get("defects") or []}
    assert {"bnb-cuda-odd-storage", "triton-interpreter-bf16-truncation"} <= seen
    if known.native_takes_avx512((64, 64), 128):
        assert "bnb-cpu-avx512-absmax-index" in seen


@needs_interpreter
def test_table_and_summary(quick_cells):
    table = report.matrix_table(quick_cells)
    assert table.splitlines()[0].startswith("| implementation")
    assert all(f"| {name}" in table for name in CPU_IMPLS)
    summary = report.summarize(quick_cells)
    assert sum(sum(g.values()) for g in summary["nf4"].values()) == len(cases.grid(quick=True))


# --- the judge --------------------------------------------------------------------------------


@needs_interpreter
def test_one_flipped_bit_fails_with_its_index(monkeypatch, tmp_path):
    """A wrong nf4 output: 1 mismatch at the flipped index in every cell, exit status 1, in the JSON too."""
    index = 12345  # (61, 145) in the (96, 200) weights of the out-dtype group
    original = impls.IMPLEMENTATIONS["nf4"]
    monkeypatch.setitem(impls.IMPLEMENTATIONS, "nf4", dataclasses.replace(original, fn=_flip_bit(original.fn, index)))
    out = tmp_path / "verify.json"
    status = cli.main(["--quick", "--groups", "out-dtype", "--impls", "nf4", "bnb.default", "--out", str(out),
                       "--no-progress"])
    assert status == 1
    payload = json.loads(out.read_text())
    nf4_cells = [c for c in payload["matrix"]["cells"] if c["impl"] == "nf4"]
    assert nf4_cells and payload["exit_status"] == 1
    for c in nf4_cells:
        assert (c["status"], c["mismatches"], c["first"]) == ("fail", 1, [[61, 145]]), c
    assert all(c["status"] == "pass" for c in payload["matrix"]["cells"] if c["impl"] == "bnb.default")


@needs_interpreter
def test_clean_run_exits_zero(tmp_path):
    out = tmp_path / "verify.json"
    assert cli.main(["--quick", "--groups", "row-packed", "--out", str(out), "--no-progress"]) == 0
    payload = json.loads(out.read_text())
    assert payload["skipped"]["challenge harness"].startswith("needs CUDA")
    assert "unsloth" in payload["skipped"]["implementations"]


def test_known_defect_is_recognised_by_its_model():
    """bitsandbytes' AVX512 CPU branch on (64, 64) at blocksize 128: explained by index=avx512, not tolerated."""
    if not known.native_takes_avx512((64, 64), 128):
        pytest.skip("the native AVX512 branch is not taken on this CPU")
    case = cases.Case("shapes", (64, 64), 128, torch.float16, torch.float16, True)
    cell = _one_case(case, ["bnb.dequantize_4bit"])["bnb.dequantize_4bit"]
    assert cell["status"] == "known" and cell["defects"] == ["bnb-cpu-avx512-absmax-index"]
    assert cell["mismatches"] > 0 and cell["model"] == "index=avx512"


def test_known_defect_with_an_extra_wrong_bit_fails(monkeypatch):
    if not known.native_takes_avx512((64, 64), 128):
        pytest.skip("the native AVX512 branch is not taken on this CPU")
    original = impls.IMPLEMENTATIONS["bnb.dequantize_4bit"]
    monkeypatch.setitem(impls.IMPLEMENTATIONS, "bnb.dequantize_4bit",
                        dataclasses.replace(original, fn=_flip_bit(original.fn, 7)))
    case = cases.Case("shapes", (64, 64), 128, torch.float16, torch.float16, True)
    cell = _one_case(case, ["bnb.dequantize_4bit"])["bnb.dequantize_4bit"]
    assert cell["status"] == "fail"
    assert "do not explain" in cell["note"]


@needs_interpreter
def test_truncated_storage_must_be_rejected_by_nf4(monkeypatch):
    case = cases.Case("storage", (3, 5, 67), 64, torch.bfloat16, torch.bfloat16, True, storage=torch.bfloat16)
    assert case.cuda_truncates
    cell = _one_case(case, ["nf4"])["nf4"]
    assert cell["status"] == "rejected" and cell["defects"] == ["bnb-cuda-odd-storage"]
    assert "502 bytes, expected 503" in cell["detail"]

    def accepts(packed, qs):  # an nf4 that would read the truncated bytes instead of refusing them
        return torch.zeros(qs.shape, dtype=qs.dtype)

    monkeypatch.setitem(impls.IMPLEMENTATIONS, "nf4", dataclasses.replace(impls.IMPLEMENTATIONS["nf4"], fn=accepts))
    cell = _one_case(case, ["nf4"])["nf4"]
    assert cell["status"] == "fail" and "expected a ValueError" in cell["note"]


def test_every_entry_is_complete():
    ids = [d.id for d in known.DEFECTS]
    assert len(ids) == len(set(ids))
    for d in known.DEFECTS:
        assert d.summary and d.evidence and d.when and d.implementations and d.devices
        assert d.expect in ("mismatch", "reject", "any")
        assert d.expect != "mismatch" or d.alternatives, d.id
        assert set(d.implementations) <= set(impls.IMPLEMENTATIONS), d.id
        for alt in d.alternatives:
            assert set(alt) <= {"absmax", "product", "index", "convert_mode"}, d.id
    assert all(d.expectation("nf4") == "reject" for d in known.DEFECTS if "nf4" in d.implementations)


# --- the grid ---------------------------------------------------------------------------------


def test_grid_is_well_formed():
    full, quick = cases.grid(), cases.grid(quick=True)
    assert len({c.id for c in full}) == len(full)
    assert {c.id for c in quick} < {c.id for c in full}
    assert {c.blocksize for c in full} == set(reference.BLOCKSIZES)
    assert {c.blocksize for c in quick} == set(reference.BLOCKSIZES)
    for group in cases.GROUPS:
        sub = [c for c in full if c.group == group]
        assert sub and {c.out_dtype for c in sub} >= {torch.float16, torch.bfloat16}, group
    assert any(c.cuda_truncates for c in quick)
    assert cases.Case("storage", (9, 41, 341), 64, torch.bfloat16, torch.bfloat16, True,
                      storage=torch.bfloat16).cuda_truncates


def test_all_bytes_case_holds_every_byte_value():
    built = cases.build(cases.Case("all-bytes", (5, 1031), 64, torch.float16, torch.float16, True,
                                   variant="all-bytes"), "cpu")
    values = set(built.packed.view(torch.uint8).reshape(-1).tolist())
    assert values == set(range(256))


@pytest.mark.parametrize("variant", ["tiny", "huge-state", "huge-data"])
@pytest.mark.parametrize("dq", [True, False], ids=["dq", "nodq"])
def test_extreme_cases_are_extreme(variant, dq):
    case = cases.Case("x", (33, 96), 64, torch.float32, torch.float16, dq, variant=variant)
    built = cases.build(case, "cpu")
    q = reference.from_bnb(built.packed, built.state)
    absmax = reference.recover_absmax(q)
    if variant == "tiny":
        assert absmax.max() < 1e-36
        products = np.abs(reference.NF4_CODE[reference.unpack_nibbles(q.packed, q.numel)] *
                          np.repeat(absmax, 64)[: q.numel])
        assert ((products > 0) & (products < np.finfo(np.float32).tiny)).any()
    else:
        assert absmax.max() > 65504 and np.isfinite(absmax).all()
        with np.errstate(over="ignore"):
            assert np.isinf(reference.dequantize_nf4(q, "float16")).any()


# --- the models -------------------------------------------------------------------------------


def test_fma_is_correctly_rounded_once():
    rng = np.random.default_rng(5)
    a = rng.standard_normal(4000).astype(np.float32)
    b = (rng.standard_normal(4000) * 1e-3).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(4000) * 1e-6)).astype(np.float32)  # cancellation
    got = models.fma_f32(a, b, c)
    for i in range(0, 4000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        want = np.float32(_round_fraction_to_f32(exact))
        assert got[i].view(np.uint32) == want.view(np.uint32), i
    two_roundings = ((a * b).astype(np.float32) + c).astype(np.float32)
    assert (got.view(np.uint32) != two_roundings.view(np.uint32)).any()


def _round_fraction_to_f32(x: Fraction) -> float:
    """Round an exact rational to the nearest float32 (ties to even), through exact neighbours."""
    f = np.float32(float(x))  # within an ulp; fix up by comparing exact distances
    best = None
    for cand in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        d = abs(Fraction(float(cand)) - x)
        even = int(np.float32(cand).view(np.uint32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, cand)
    return float(best[1])


def test_interpreter_bf16_is_truncation_for_normals():
    rng = np.random.default_rng(3)
    y = (rng.standard_normal(10000) * 10.0 ** rng.uniform(-30, 30, 10000)).astype(np.float32)
    trunc = models.interpreter_to_bf16(y)
    assert (trunc == models.truncate_to_bf16(y)).all()
    assert (trunc != reference.float32_to_bf16(y)).any()


def test_base_models_equal_the_reference():
    case = cases.Case("x", (4, 63), 64, torch.float32, torch.bfloat16, True, variant="tiny")
    q = reference.from_bnb(*(lambda b: (b.packed, b.state))(cases.build(case, "cpu")))
    for ftz in (False, True):
        model = models.model_dequant(q, "bfloat16", **known.BASE_MODEL["cuda" if ftz else "cpu"])
        assert compare(model, reference.dequantize_nf4(q, "bfloat16", ftz=ftz)).ok
    ieee = models.model_dequant(q, "bfloat16")
    assert not compare(ieee, models.model_dequant(q, "bfloat16", absmax="ftz", product="ftz")).ok


def test_avx512_index_model_matches_the_format_when_rows_hold_whole_blocks():
    built = cases.build(cases.Case("x", (4, 128), 64, torch.float16, torch.float16, True), "cpu")
    q = reference.from_bnb(built.packed, built.state)
    assert (models.block_index(q, "avx512") == models.block_index(q, "format")).all()
    built = cases.build(cases.Case("x", (64, 64), 128, torch.float16, torch.float16, True), "cpu")
    q = reference.from_bnb(built.packed, built.state)
    index = models.block_index(q, "avx512").reshape(64, 64)
    assert index[2, 0] == 0 and prod(q.shape) // 128 == 32  # element 128 reads block 0, not block 1


# --- the GPU parts, as far as a CPU can run them ----------------------------------------------


def test_fusion_flags_and_output_capture(tmp_path):
    src = "@triton_heuristics.pointwise(triton_meta={'signature': {}, 'enable_fp_fusion': False, 'x': 1})"
    assert inductor.fusion_flags(src) == [False]
    from torch._inductor.graph import GraphLowering

    before = GraphLowering.save_output_code
    sink = []
    with inductor.capture_output_code(sink):
        GraphLowering.save_output_code("code")
    assert sink == ["code"] and GraphLowering.save_output_code is before


def test_compile_peer_plumbing_on_cpu(tmp_path):
    """The torch.compile peer through inductor's C++ backend: separate caches per variant, code saved.

    The shape has no tail block: torch 2.13.0+cpu's inductor writes garbage into a padded tail when the
    output is fp16/bf16 (the GPU matrix checks the Triton backend on tails).
    """
    built = cases.build(cases.Case("x", (33, 128), 64, torch.bfloat16, torch.bfloat16, True), "cpu")
    expected = impls.reference_dequantize(built.packed, built.state, ftz=False)
    peers_ = [inductor.CompilePeer(f"peer{f}", fp_fusion=f, save_dir=tmp_path) for f in (True, False)]
    for peer in peers_:
        peer.label = "case"
        assert compare(peer(built.packed, built.state), expected).ok
        assert compare(peer.call_warm(built.packed, built.state), expected).ok
        summary = peer.summary()
        assert summary["compilations"] == 1 and len(summary["files"]) == 1
    assert len(list(tmp_path.glob("*.py.txt"))) == 2


@needs_interpreter
def test_challenge_harness_on_a_tiny_cpu_config():
    cfg = challenge.Config(1, 5, 64, 128, 7, torch.bfloat16)
    impls_ = challenge.implementations("cpu", names=["nf4", "nf4.out_buffer", "bnb.dequantize_4bit"])
    row = challenge.run_config(cfg, impls_, device="cpu", iters=1, baseline="bnb.dequantize_4bit")
    for name in ("nf4", "nf4.out_buffer", "bnb.dequantize_4bit"):
        r = row["impls"][name]
        assert r["status"] == "pass" and r["bitexact"] and r["forward_linear_bitexact"], r
        assert r["wall"]["iters"] == 3
    assert row["speedup"]["bnb.dequantize_4bit"] == 1.0
    payload = {"baseline": "bnb.dequantize_4bit", "iters": 1, "configs": [row],
               "overall": challenge._overall([row], "bnb.dequantize_4bit")}
    assert "overall" in challenge.table(payload)
