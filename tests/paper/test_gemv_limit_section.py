"""paper.sections.gemv_limit: the integer-pipe bound from a result file's SASS counts and measured rate."""

from __future__ import annotations

import pytest

from paper.sections.gemv_limit import ALU_OPS, alu_bound_us


def _payload(ops, rate=2.0, sms=100, step=2048):
    return {"env": {"sm_count": sms}, "pipes": [{"op": "fmul", "warp_instr_per_ns_per_sm": 9.0},
                                                 {"op": "prmt", "warp_instr_per_ns_per_sm": rate}],
            "sass": {"production": {"loop_opcodes": ops, "loop_bytes_per_warp": step}}}


def test_bound_counts_integer_pipe_ops_only():
    """1024 x 4096 at 2048 packed bytes a step is 1024 warp steps; 100 prmt + 20 lop3 (fmul and HMMA are other
    pipes) at 2 warp instructions per ns on each of 100 multiprocessors: 1024 * 120 / 200 ns."""
    ops = {"PRMT": 100, "LOP3": 20, "FMUL": 50, "HMMA": 4}
    assert alu_bound_us(_payload(ops), (1024, 4096)) == pytest.approx(1024 * 120 / 200 / 1e3)
    assert alu_bound_us(_payload(ops, rate=4.0), (1024, 4096)) == pytest.approx(1024 * 120 / 400 / 1e3)
    assert {"PRMT", "LOP3", "SHF"} <= set(ALU_OPS) and not {"FMUL", "HMMA", "LDG", "IMAD"} & set(ALU_OPS)


@pytest.mark.parametrize("payload", [None, {}, _payload({}), {**_payload({"PRMT": 1}), "pipes": []},
                                     {**_payload({"PRMT": 1}), "env": {}}])
def test_bound_is_none_without_its_inputs(payload):
    assert alu_bound_us(payload, (1024, 4096)) is None
