"""The paper's numbers come only from committed results: fresh tables, and no number typed into main.tex.

1. Freshness: `python -m paper.generate` run on the committed results/ (and paper/published_claims.json)
   reproduces paper/generated/ byte for byte. It fails when a result file or a generated file was
   edited by hand, or when results changed without regenerating (fix: `make tables`). The provenance
   table holds the SHA-256 of every input, so any edit of an input shows, not only edits of the
   numbers the paper quotes.
2. No typed numbers: main.tex (comments aside) holds no decimal number and no measured quantity
   written as a literal (an integer followed by %, µs, ms, GB/s, TB/s, MB, ulp or a ×), except
   inside \\version{...} (a software version named as a fact), citation keys, labels, references,
   inputs and URLs. Numbers reach the text only as \\NF... macros from paper/generated/macros.tex.
3. Every \\NF macro main.tex uses is defined, every generated file it inputs exists, and the
   generator survives missing and malformed result files (placeholders, never a crash).
No TeX is needed; everything runs in a few seconds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from paper import generate

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is tests/paper/test_paper.py)

MAIN_TEX = ROOT / "paper" / "main.tex"
GENERATED = ROOT / "paper" / "generated"

# Contexts where digits with a decimal point are allowed: a named software version, citation
# keys, labels and references, file inputs, URLs, the bibliography.
_ALLOWED = re.compile(
    r"\\(?:version|cite[tp]?\*?(?:\[[^\]]*\]){0,2}|label|ref|eqref|pageref|autoref|input|include|url|href"
    r"|bibliography|bibliographystyle|usepackage(?:\[[^\]]*\])?|documentclass(?:\[[^\]]*\])?)\{[^{}]*\}"
)
_DECIMAL = re.compile(r"\d[.,]\d|(?<![\w.\\])\.\d")
# A literal integer followed by a unit of a measurement: a typed result.
_UNIT = (r"\\%|\\us\b|\$\\mu\$\s*s|\\textmu|µs|ms\b|GB/s|TB/s|MB\b|ulp|\\x\b|\$\\times\$|×"
         r"|x\s+(?:faster|slower|speedup)")
_MEASURED = re.compile(r"(?<![\w\\^_{])\d+\s*(?:\\,|~|\\ )?\s*(?:" + _UNIT + ")")


def strip_comments(text: str) -> str:
    """Drop TeX comments (an unescaped % to the end of the line)."""
    return "\n".join(re.sub(r"(?<!\\)%.*", "", line) for line in text.splitlines())


def typed_numbers(text: str) -> list[tuple[int, str]]:
    """(line number, offending text) for every number typed outside the allowed contexts."""
    found = []
    for lineno, line in enumerate(strip_comments(text).splitlines(), start=1):
        visible = _ALLOWED.sub("", line)
        for pattern in (_DECIMAL, _MEASURED):
            for m in pattern.finditer(visible):
                start = max(0, m.start() - 25)
                found.append((lineno, visible[start:m.end() + 15].strip()))
    return found


# --- 1. freshness ---------------------------------------------------------------------------------


def test_generated_files_match_committed_results():
    """Regenerating from results/ gives exactly the committed paper/generated/ (no hand edits anywhere)."""
    files, _ = generate.generate(generate.RESULTS, generate.CLAIMS)
    problems = generate.compare(files, GENERATED)
    assert not problems, ("paper/generated/ does not match what results/ produces; run `make tables` "
                          "(python -m paper.generate) and commit the result, never edit either by hand:\n  "
                          + "\n  ".join(problems))


def test_generation_is_deterministic(tmp_path):
    """Two runs on the same inputs give the same bytes (no dates, no set order, no environment)."""
    first, _ = generate.generate(generate.RESULTS, generate.CLAIMS)
    second, _ = generate.generate(generate.RESULTS, generate.CLAIMS)
    assert first == second


# --- 2. no typed numbers ----------------------------------------------------------------------------


def test_main_tex_types_no_numbers():
    """main.tex quotes numbers only through \\NF macros (decimals only inside \\version{} and friends)."""
    found = typed_numbers(MAIN_TEX.read_text())
    assert not found, "numbers typed into paper/main.tex (use a macro from paper/generated/macros.tex):\n" + "\n".join(
        f"  line {n}: ...{t}..." for n, t in found)


@pytest.mark.parametrize("text", [
    r"reaches 93.5\,\% of the copy bandwidth",
    r"it is 2.1$\times$ faster",
    r"took 12\us{} per call",
    r"moves 94\,\% of the floor",
    r"a speedup of 3\x{}",
    r"up to 6 ulp",
    r"about .5 of it",
    r"4\,250~GB/s",
])
def test_checker_rejects_typed_numbers(text):
    assert typed_numbers(text), text


@pytest.mark.parametrize("text", [
    r"bitsandbytes \version{0.50.2} on a CPU",
    r"see Section~\ref{sec:2.1} and \cite{qi2026.fast}",
    r"reaches \NFbwLarge\,\% of the copy bandwidth",
    r"one fp32 scale per 256 absmax values, $256 \times 64 = 16384$ weights",
    r"below $2^{-126}$; 16-byte stores; sm\_75; \code{mul.rn.ftz.f32}; \code{ld.global.nc.v4.b32}",
    r"three runs % a comment may say 1.5 or 94\,\%",
])
def test_checker_allows_macros_versions_and_format_constants(text):
    assert not typed_numbers(text), typed_numbers(text)


# --- 3. macros, inputs, robustness ------------------------------------------------------------------


def _defined(macros_tex: str) -> set[str]:
    return set(re.findall(r"\\(?:new|provide)command\{\\(NF[A-Za-z]+)\}", macros_tex))


def test_every_macro_used_is_defined_and_every_input_exists():
    text = strip_comments(MAIN_TEX.read_text())
    used = set(re.findall(r"\\(NF[A-Za-z]+)", text))
    defined = _defined((GENERATED / "macros.tex").read_text())
    assert not used - defined, f"main.tex uses undefined macros: {sorted(used - defined)}"
    inputs = re.findall(r"\\input\{generated/([^}]+)\}", text)
    assert inputs, "main.tex inputs no generated file"
    missing = [name for name in inputs if not (GENERATED / (name if name.endswith(".tex") else name + ".tex")).exists()]
    assert not missing, f"main.tex inputs generated files that do not exist: {missing}"


def test_missing_results_give_placeholders_not_errors(tmp_path):
    """With no result file at all, every macro is still defined (as 'not measured') and inputs are named."""
    files, missing = generate.generate(tmp_path / "nothing", generate.CLAIMS)
    assert any("nf4_bench.json" in m for m in missing) and any("experiments.json" in m for m in missing)
    full, _ = generate.generate(generate.RESULTS, generate.CLAIMS)
    assert set(files) == set(full) or set(files) <= set(full) | {"ablation.dat", "speedup.dat"}
    assert _defined(files["macros.tex"]) == _defined(full["macros.tex"])
    assert generate.NM in files["macros.tex"]
    for name in ("bench_table.tex", "ablation_table.tex", "challenge_table.tex", "fig_bandwidth.tex"):
        assert r"\NFmissingbox" in files[name], name


def test_malformed_results_are_marked_not_crashed(tmp_path):
    """Result files with missing keys, wrong types or garbage still give a complete set of macros."""
    (tmp_path / "nf4_bench.json").write_text(json.dumps({
        "env": {"device": "GPU X"}, "copy_bandwidth": {"gbs": "fast"},
        "rows": [{"shape": [64, 64], "dtype": "float16", "provider": "nf4", "device_us": "n/a"},
                 {"provider": "torch.compile", "bytes": 10, "device_us": 3.0, "mismatches": 0},
                 "not a row"]}))
    (tmp_path / "experiments.json").write_text(json.dumps({"rows": [{"variant": "v02_word4", "case": "8x8:fp16",
                                                                     "status": "exact", "pct_copy": 50.0}]}))
    (tmp_path / "verify_gpu.json").write_text(json.dumps({"device": "cuda", "matrix": {"summary": {"nf4": {}}},
                                                          "challenge": {"configs": [{"impls": {"nf4": {}}}]}}))
    (tmp_path / "verify_cpu.json").write_text("{ not json")
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    full, _ = generate.generate(generate.RESULTS, generate.CLAIMS)
    assert _defined(files["macros.tex"]) == _defined(full["macros.tex"])
    assert any("verify_cpu.json" in m for m in missing)
    assert r"\newcommand{\NFbenchDevice}{GPU X}" in files["macros.tex"]


def test_check_mode_reports_a_hand_edit(tmp_path):
    """`python -m paper.generate --check` exits 1 when a generated file was edited by hand."""
    out = tmp_path / "generated"
    assert generate.main(["--out", str(out)]) == 0
    assert generate.main(["--out", str(out), "--check"]) == 0
    macros = out / "macros.tex"
    macros.write_text(macros.read_text().replace(r"\newcommand{\NFlutSize}", r"\newcommand{\NFlutSize}{1}%"))
    assert generate.main(["--out", str(out), "--check"]) == 1


def _wellformed(tmp: Path) -> None:
    """A small, complete set of result files shaped like the real writers' output (numbers invented)."""
    env = {"device": "GPU Y", "torch": "t", "triton": "tr", "bitsandbytes": "b", "commit": "c" * 40}

    def bench_row(shape, dtype, provider, us):
        n = shape[0] * shape[1]
        return {"shape": list(shape), "dtype": dtype, "provider": provider, "numel": n, "bytes": 3 * n,
                "mismatches": 0, "bitexact": True, "device_us": us, "gbs": 3 * n / us / 1e3,
                "pct_copy": 30 * n / us / 1e3 / 40, "graph_us": us, "host_us": 5}

    rows = [bench_row(s, d, p, us * k) for s, d, us in (((64, 64), "float16", 2.0), ((128, 64), "bfloat16", 3.0))
            for p, k in (("nf4", 1), ("bnb.dequantize_4bit", 2), ("torch.compile", 1.5))]
    sweep = [{"shape": [64, 64], "dtype": "float16", "tile_bytes": t, "num_warps": 4, "codebook": 0, "store_cm": "",
              "mismatches": 0, "device_us": t / 100, "pct_copy": 50} for t in (512, 1024)]
    (tmp / "nf4_bench.json").write_text(json.dumps({"env": env, "copy_bandwidth": {"gbs": 4000.0},
                                                    "empty_triton_launch": {"host_us": 9, "device_us": 2},
                                                    "rows": rows, "sweep": sweep}))
    cases = ["8192x2048:fp16", "14336x4096:bf16"]
    ids = {"v00_naive": (None, True), "v02_word4": ("v01", True), "v03_word16": ("v02_word4", True),
           "v40_fma_contraction": ("v51_cached_launch", False),
           "v41_fma_contraction_ieee": ("v40_fma_contraction", False),
           "v50_jit_launch": (None, True), "v51_cached_launch": ("v50_jit_launch", True),
           "v99_production": ("v51_cached_launch", True), "v30_t1024_w8": ("v51_cached_launch", True)}
    erows = []
    for i, (vid, (parent, exact)) in enumerate(ids.items()):
        for c in cases:
            r = {"variant": vid, "parent": parent, "change": f"change {i}", "exact_expected": exact, "case": c,
                 "status": "exact" if exact else "inexact (expected)", "mismatches": 0 if exact else 7, "total": 99}
            if exact:
                r.update(device_us=10.0 + i, pct_copy=50.0 + i, host_us=4.0, wall_us=20.0)
            erows.append(r)
    builds = [{"variant": vid, "out_dtype": "float16", "n_regs": 40, "spill_stores": 0, "spill_loads": 0,
               "shared_bytes": 512, "static_shared_bytes": 0, "bar_sync": 1, "fma": 3 if vid.startswith("v41") else 0,
               "global_stores": {"st.global.v4.b32 (16 B)": 1}} for vid in ids]
    (tmp / "experiments.json").write_text(json.dumps({
        "env": env, "mode": "gpu", "device": "GPU Y", "cases": cases, "rows": erows,
        "variants": {vid: {"parent": p, "change": "c", "exact_expected": e, "module": vid}
                     for vid, (p, e) in ids.items()},
        "sm75": {"triton": "tr", "unique_builds": 3, "builds": builds}}))
    summary = {"nf4": {"shapes": {"pass": 3}, "tiny": {"pass": 2}}, "reference": {"shapes": {"pass": 3}}}
    seen = [{"id": "inductor-fp-fusion", "cells": 4, "implementations": {"torch.compile": 4}}]
    entries = [{"id": "inductor-fp-fusion", "owner": "inductor", "kind": "deviation"}]
    impls = {"nf4": {"status": "pass", "bitexact": True, "wall": {"per_call_us": 50.0, "total_s": 0.15},
                     "device": {"gate_proj": {"device_us": 20.0}}},
             "unsloth": {"status": "pass", "bitexact": True, "wall": {"per_call_us": 80.0, "total_s": 0.24},
                         "device": {"gate_proj": {"device_us": 40.0}}}}
    challenge = {"env": env, "baseline": "unsloth", "iters": 1000,
                 "configs": [{"config": {"label": "2x3 fp16"}, "impls": impls,
                              "speedup": {"nf4": 1.6, "unsloth": 1.0}}],
                 "overall": {"nf4": {"speedup": 1.6}, "unsloth": {"speedup": 1.0}}, "failures": []}
    for name, device in (("verify_gpu-y.json", "cuda"), ("verify_cpu.json", "cpu")):
        (tmp / name).write_text(json.dumps({
            "env": env, "device": device, "matrix": {"cases": 3, "summary": summary, "failed_cells": 0, "seconds": 9},
            "known_defects": {"entries": entries, "seen": seen},
            "compile_peers": [{"name": "torch.compile", "enable_fp_fusion_in_code": [True]}],
            "challenge": challenge if device == "cuda" else None}))
    (tmp / "tuning").mkdir()
    (tmp / "tuning" / "README.md").write_text("| file | layout |\n|---|---|\n| h200_word_layout.json | words |\n")
    for name, us in (("h200_row16_layout.json", 90.0), ("h200_word_layout.json", 45.0)):
        (tmp / "tuning" / name).write_text(json.dumps({"env": env, "rows": [
            {"shape": [14336, 4096], "dtype": "bfloat16", "provider": "nf4", "device_us": us, "pct_copy": 40.0}]}))


def test_wellformed_results_fill_every_section(tmp_path):
    """Complete result files: no section falls back to placeholders, and the prose macros get numbers."""
    _wellformed(tmp_path)
    files, missing = generate.generate(tmp_path, generate.CLAIMS)
    assert not [m for m in missing if "unreadable" in m], missing
    macros = dict(re.findall(r"\\newcommand\{\\(NF[A-Za-z]+)\}\{(.*)\}", files["macros.tex"]))
    expected = {"NFbwLarge": None, "NFspeedupBnbMin": "2.00", "NFwordSixteenSlowdownA": None,
                "NFchallengeSpeedupOverall": "1.60", "NFsmRegsProd": "40", "NFtuneRowSixteenSlowdownMid": "2.00",
                "NFtilesBestPct": None, "NFverifyGpuNFPass": "5", "NFseenGpuInductorFusion": "4",
                "NFfmaIeeeMismatchesA": "7", "NFsweepExact": "2", "NFhostJitUs": "4.0"}
    for name, value in expected.items():
        assert macros[name] != generate.NM, name
        if value is not None:
            assert macros[name] == value, (name, macros[name])
    for name in ("bench_table.tex", "ablation_table.tex", "challenge_table.tex", "tuning_table.tex", "fma_table.tex",
                 "verify_matrix_gpu.tex", "fig_bandwidth.tex", "fig_speedup.tex", "fig_ablation.tex"):
        assert r"\NFmissingbox" not in files[name], name
