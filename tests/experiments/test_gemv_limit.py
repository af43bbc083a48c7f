"""experiments gemv-limit on a CPU: the SASS loop finder on written SASS, and the offline build of the production
GEMV's M = 1 launch and the probe loops for sm_90, whose opcode counts must follow from the kernels' PTX."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.gemv_limit import MODES, _main_loop

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   PRMT R2, R3, 0x7531, R4 ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
        /*0030*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0040*/                   LOP3.LUT R5, R6, R7, R8, 0x96, !PT ;
        /*0050*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0060*/                   IMAD R9, R9, R10, R11 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""


def test_main_loop_is_the_longest_backward_branch():
    """Of two blocks that branch back to their own label, the longer; a forward branch is no loop; predicates and
    modifiers are dropped."""
    assert _main_loop(_SASS) == ["LOP3", "HMMA", "IMAD", "BRA"]
    assert _main_loop(_SASS.replace("@P1 BRA `(.L_x_1)", "@P1 BRA `(.L_x_2)")) == ["PRMT", "BRA"]
    assert _main_loop("") == []


@pytest.mark.slow  # offline sm_90 builds (make test-long)
def test_sass_counts_follow_from_the_kernels(tmp_path):
    """The production loop at M = 1 (H100 row: 32-byte lanes, two rows per lane) looks up 2 x 32 / 4 = 16 words per
    lane and step, 16 prmt each (nf4.device's LOOKUP_ASM), after 2 product tables of 8 prmt each: 272 prmt; its
    8 word pairs (a word of each row) make 2 mma.sync each: 16 HMMA. The decode probe issues the same, the loads
    probe neither. Built offline in a child without TRITON_INTERPRET, written to a temporary file only."""
    from nf4.device import LOOKUP_ASM

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = tmp_path / "limit.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.gemv_limit", "--sass-only", "--out", str(out)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sass = json.loads(out.read_text())["sass"]
    per_word = str(LOOKUP_ASM.value if hasattr(LOOKUP_ASM, "value") else LOOKUP_ASM).count("prmt.b32")
    words = 2 * 32 // 4
    assert sass["loop_bytes_per_warp"] == 16 * 4 * 32
    for part in ("production", "decode", "both", "both, rotated"):
        ops = sass[part]["loop_opcodes"]
        assert ops.get("PRMT") == words * per_word + 2 * 8, (part, ops)
        assert ops.get("HMMA") == words, (part, ops)
    for part in ("loads", "loads, rotated"):
        ops = sass[part]["loop_opcodes"]
        assert "PRMT" not in ops and "HMMA" not in ops and ops.get("LDG", 0) > 0, (part, ops)
    assert set(MODES) <= set(sass)
