"""experiments gemm-limit on a CPU: the wgmma-wait and ptxas-note readers on written text, the config per M, and the
offline build of
the production word GEMM and the probe loops for sm_90, whose opcode counts must follow from the kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.gemm_limit import PROBES, config_for
from experiments.gemv_limit import wgmma_serialized, wgmma_waits
from nf4.linear import tuned as linear_tuned

_SASS = """
        /*0000*/                   WARPGROUP.ARRIVE ;
        /*0010*/                   HGMMA.64x256x16.F32.BF16 R24, R160, gdesc[UR8], R24, gsb0 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE  gsb0, 0x0 ;
        /*0050*/                   DEPBAR.LE SB0, 0x1 ;
"""


def test_wgmma_waits_counts_each_depth():
    """Waits by the groups they leave pending (hex), only the warpgroup's (DEPBAR of cp.async is another barrier)."""
    assert wgmma_waits(_SASS) == {"0": 1, "3": 2}
    assert wgmma_waits(_SASS.replace("0x3", "0xa")) == {"0": 1, "10": 2}
    assert wgmma_waits("") == {}


_PTXAS = """ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non
wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the
function '_gemm_limit'
ptxas info    : 0 bytes gmem
ptxas info    : Used 225 registers, used 1 barriers
"""


def test_wgmma_serialized_reads_the_reason_of_ptxas_note():
    """The reason of ptxas's C7515 note, its line breaks folded; nothing where the log has no such note (a kernel
    whose wgmma stay asynchronous, or one without wgmma)."""
    assert wgmma_serialized(_PTXAS) == ("non wgmma instructions defining accumulator registers of a wgmma between "
                                        "start and end of the pipeline stage")
    assert wgmma_serialized(_PTXAS.replace("C7515", "C7510")) == ""
    assert wgmma_serialized(_PTXAS.split("\n", 3)[3]) == ""


def test_config_per_m_is_the_word_gemm_the_table_runs():
    assert config_for(1) is config_for(128) is linear_tuned.WORD_GEMM128
    assert config_for(129) is config_for(1024) is linear_tuned.WORD_GEMM256
    assert dict(linear_tuned.TUNED["H100"]["forward"])[128] is linear_tuned.WORD_GEMM128
    assert dict(linear_tuned.TUNED["H100"]["forward"])[256] is linear_tuned.WORD_GEMM256


@pytest.mark.slow  # offline sm_90 builds (make test-long)
def test_sass_counts_follow_from_the_kernels(tmp_path):
    """At M = 256 (WORD_GEMM256: 8 warps, 128 rows by 64 weights a step, 4 words a thread) the production loop and
    the lookup probes issue one product table (8 prmt) and 4 x LOOKUP_ASM's prmt per step, and the same HGMMA; the
    no-lookup probe keeps the HGMMA without the lookups, the dense-operand probe neither decodes nor loads words.
    Built offline in a child without TRITON_INTERPRET, written to a temporary file only (no rows: no GPU asked)."""
    from nf4.device import LOOKUP_ASM

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = tmp_path / "limit.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.gemm_limit", "--sass-only", "--ms", "256", "--out",
                           str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert "rows" not in payload
    (sass,) = payload["sass"]
    assert sass["M"] == 256 and set(PROBES) | {"production"} <= set(sass)
    per_word = str(LOOKUP_ASM.value if hasattr(LOOKUP_ASM, "value") else LOOKUP_ASM).count("prmt.b32")
    lookups = [p for p in ("production", *PROBES) if PROBES.get(p, (0,))[0] == 0]
    hgmma = {sass[p]["loop_opcodes"].get("HGMMA") for p in lookups}
    assert len(hgmma) == 1 and hgmma.pop() > 0, {p: sass[p]["loop_opcodes"].get("HGMMA") for p in lookups}
    for part in lookups:
        ops = sass[part]["loop_opcodes"]
        assert ops.get("PRMT", 0) >= 4 * per_word + 8, (part, ops)
    no_lookup = sass["probe: no lookup"]["loop_opcodes"]
    assert no_lookup.get("PRMT", 0) <= 2 and no_lookup.get("HGMMA") == sass["production"]["loop_opcodes"]["HGMMA"]
    dense = sass["probe: dense operand"]["loop_opcodes"]
    assert "PRMT" not in dense and dense.get("LDGSTS", 0) > 0 and dense.get("HGMMA", 0) > 0
    for part in ("production", *PROBES):
        assert isinstance(sass[part]["wgmma_waits"], dict), part
        assert sass[part]["wgmma_serialized"] is None or isinstance(sass[part]["wgmma_serialized"], str), part
