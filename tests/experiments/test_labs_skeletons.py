"""experiments.labs.stream and .staged (the GEMV lab's second and third skeletons): their split plans cover every K
step once, and they build for sm_90 with the loop they claim. Offline; no GPU."""

from __future__ import annotations

import pytest

from experiments.labs import deep, staged, stream


@pytest.mark.parametrize("plan", [stream.plan, staged.plan, deep.plan])  # fill steps 0, 4, 3
@pytest.mark.parametrize("n, k, warps, slots", [(14336, 4096, 4, 528), (4096, 14336, 2, 924), (1024, 512, 4, 660),
                                                (129, 4352, 4, 132)])
def test_plan_covers_every_step_once(plan, n, k, warps, slots):
    p = plan(n, k, warps, slots)
    steps = (k // 2) // 128
    seg_steps = p["seg"] // 128
    assert p["seg"] % 128 == 0 and p["split"] >= 1
    assert (p["split"] - 1) * seg_steps < steps <= p["split"] * seg_steps  # no empty segment, none missing
    assert p["tiles"] == p["row_blocks"] * p["split"] and p["row_blocks"] * 16 * warps >= n


def test_occupancy_limits():
    assert stream.occupancy(64, 4, 4) == 8  # registers: 64 x 32 x 4 warps = 8 Ki a program
    assert stream.occupancy(255, 4, 4) == 2
    assert stream.occupancy(32, 4, 1) == 32  # the 32-program cap
    assert stream.occupancy(32, 100 * 1024, 4) == 2  # shared memory


@pytest.fixture(scope="module")
def builds():
    from experiments.labs import sass_count as sc

    return {r["build"]: r for r in sc.count_builds(["s_none", "s_prmt", "c_none3", "c_prmt3", "d_none", "d_pair16"])}


@pytest.mark.slow  # six offline sm_90 builds (make test-long)
def test_skeletons_build_for_sm90(builds):
    """No local memory; one tensor-core product per 8 weights of a lane; the staged skeleton's loop issues its 6
    cp.async copies (LDGSTS) and reads its slot with 4 LDS.128 + 1 LDS.64 per step (16 words a lane: 128 weights)."""
    for name, r in builds.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["local"] == 0, name
        assert r["opcodes"].get("HMMA.16816.F32.BF16", 0) == r["weights"] // 8, name
    for name in ("c_none3", "c_prmt3"):
        ops = builds[name]["opcodes"]
        per_step = builds[name]["weights"] // 128
        assert sum(n for op, n in ops.items() if op.startswith("LDGSTS")) == 6 * per_step, (name, ops)
        assert ops.get("LDS.128", 0) == 4 * per_step and ops.get("LDS.64", 0) == per_step, (name, ops)
    assert builds["s_prmt"]["per_weight"]["alu"] > 3 * builds["s_none"]["per_weight"]["alu"]  # the decode's cost
    pair = builds["d_pair16"]
    assert pair["opcodes"].get("LDS.64", 0) == pair["weights"] // 2  # one pair lookup per 2 weights


def test_deep_plan_is_one_round_when_tiles_fit():
    p = deep.plan(14336, 4096, 4, 528)
    assert p["rounds"] == 1 and p["grid"] == p["tiles"] <= 528


# --- the bulk-copy skeleton (bulk.py) ---------------------------------------------------------------------------


@pytest.mark.parametrize("sps, stages", [(1, 8), (2, 4)])
@pytest.mark.parametrize("n, k, warps, slots", [(14336, 4096, 2, 924), (4096, 14336, 4, 330), (1024, 1024, 2, 132)])
def test_bulk_plan_covers_every_stage_once(sps, stages, n, k, warps, slots):
    from experiments.labs import bulk

    p = bulk.plan(n, k, warps, slots, sps, stages)
    sb = 128 * sps
    stages_total = (k // 2) // sb
    assert p["seg"] % sb == 0 and p["split"] >= 1
    seg = p["seg"] // sb
    assert (p["split"] - 1) * seg < stages_total <= p["split"] * seg


def test_bulk_static_shared_memory_fits():
    """Every candidate's static shared memory (stages, barriers and the pair table) stays under 48 KiB, and the
    tensor copies' stages are whole 1024-byte units (the 128-byte swizzle's period)."""
    from experiments.labs import bulk

    for name, (mode, copies, shape) in bulk.CANDIDATES.items():
        stages, warps, sps, tensor = bulk.SHAPES[shape]
        table = 256 * 8 * copies if mode == "pair" else 0
        assert bulk.shared_bytes(stages, warps, sps, tensor) + table < 48 * 1024, name
        if tensor:
            assert bulk.stage_bytes(sps, tensor) % 1024 == 0, name
    assert "nf4bulk_buf[32768]" in bulk.declare_asm(8, 2, 1, True)
    assert "nf4bulk_buf[9216]" in bulk.declare_asm(2, 2, 1, False)  # 2 warps x 2 stages x 16 rows x (128 + 16)


def test_bulk_issue_text():
    from experiments.labs import bulk

    one = bulk.tensor_issue_asm(1)
    assert one.count("cp.async.bulk.tensor.2d") == 1 and "expect_tx.shared::cta.b64 _, [$3], 2048;" in one
    two = bulk.tensor_issue_asm(2)
    assert two.count("cp.async.bulk.tensor.2d") == 2 and "], 4096;" in two
    assert "[$4], [$5], 256, [$3]" in bulk.issue_asm(2) and "], 4096;" in bulk.issue_asm(2)  # 16 rows x 256 bytes


@pytest.fixture(scope="module")
def bulk_builds():
    from experiments.labs import sass_count as sc

    return {r["build"]: r for r in sc.count_builds(["b_none", "t_none8", "t_prmt8", "t_stream8"])}


@pytest.mark.slow  # four offline sm_90 builds (make test-long)
def test_bulk_skeletons_build_for_sm90(bulk_builds):
    """No local memory; per-row copies issue UBLKCP, tensor copies UTMALDG; the tensor skeleton reads a step with 4
    LDS.128 (16 words a lane) and, with a decode, issues one tensor-core product per 8 weights of a lane."""
    for name, r in bulk_builds.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["local"] == 0, name
    assert any(op.startswith("UBLKCP") for op in bulk_builds["b_none"]["opcodes"])
    for name in ("t_none8", "t_prmt8"):
        r = bulk_builds[name]
        assert r["opcodes"].get("HMMA.16816.F32.BF16", 0) == r["weights"] // 8, name
        assert r["opcodes"].get("LDS.128", 0) == 4 * (r["weights"] // 128), name
        assert any(op.startswith("UTMALDG") for op in r["opcodes"]), name
    assert bulk_builds["t_prmt8"]["per_weight"]["alu"] > 3 * bulk_builds["t_none8"]["per_weight"]["alu"]
    assert "HMMA.16816.F32.BF16" not in bulk_builds["t_stream8"]["opcodes"]
