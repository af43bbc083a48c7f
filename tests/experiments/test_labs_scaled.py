"""experiments.labs.scaled (the second numerical contract, opt-in): its decode's asm gives the rounded level pairs
for every byte (PTX emulator), its NumPy model matches a direct float64 sum, a float32 simulation of the kernel's
order stays within its bound, and it builds for sm_90 with the instruction mix it claims. No GPU."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.labs import models, scaled


def _table(x_dtype: str, copies: int = scaled.LEVEL_COPIES, base: int = models.SHARED_BASE) -> models.Shared:
    """The table `_fill` writes: entry e's copy c at base + e * 4 * copies + 4c, level of e >> 4 in the low half."""
    _, bits = scaled.rounded_levels(x_dtype)
    data = np.zeros(256 * 4 * copies, dtype=np.uint8)
    idx = np.arange(256 * copies)
    e = idx // copies
    data.view(np.uint32)[(e * 4 * copies + (idx % copies) * 4) // 4] = (
        bits[e >> 4].astype(np.uint32) | (bits[e & 15].astype(np.uint32) << 16))
    return models.Shared(base, data)


@pytest.mark.parametrize("x_dtype", ["bf16", "fp16"])
def test_lookup_gives_the_rounded_level_pairs_of_every_byte(x_dtype):
    rng = np.random.default_rng(0)
    lanes = np.arange(32)
    s = scaled.table_shift()
    lanebase = models.SHARED_BASE + 4 * (lanes % scaled.LEVEL_COPIES)
    # every byte value in every byte position, and random words, in every lane
    words = np.concatenate([np.repeat(np.arange(256, dtype=np.uint64), 32) * np.uint64(0x01010101),
                            rng.integers(0, 2**32, 32 * 64, dtype=np.uint64)])
    lane = np.resize(lanes, words.size)
    base = lanebase[lane]
    regs = models.run_ptx(scaled.LOOKUP, {"$4": words, "$5": base << (16 - s), "$6": 1 << 16, "$7": 1 << 8,
                                          "$8": 1, "$9": 1 << (16 + s), "$10": 1 << (8 + s), "$11": base},
                          _table(x_dtype))
    _, bits = scaled.rounded_levels(x_dtype)
    for k in range(4):
        byte = (words >> np.uint64(8 * k)) & np.uint64(255)
        want = bits[byte >> np.uint64(4)].astype(np.uint64) | (bits[byte & np.uint64(15)].astype(np.uint64) << 16)
        assert np.array_equal(regs[f"${k}"], want), (x_dtype, k)


def test_table_lookups_are_conflict_free():
    """Lane l reads copy l % 32: 32 distinct banks for any bytes."""
    s = scaled.table_shift()
    rng = np.random.default_rng(1)
    for _ in range(100):
        byte = rng.integers(0, 256, 32)
        addr = models.SHARED_BASE + byte * 2**s + 4 * (np.arange(32) % scaled.LEVEL_COPIES)
        assert len(set((addr // 4) % 32)) == 32


def _case(seed: int, m: int = 3, n: int = 5, k: int = 256):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    codes = rng.integers(0, 16, (n, k))
    absmax = rng.uniform(0.01, 3.0, (n, k // 64)).astype(np.float32)
    return x, codes, absmax


@pytest.mark.parametrize("x_dtype", ["bf16", "fp16"])
def test_model_is_the_contract(x_dtype):
    x, codes, absmax = _case(2)
    levels, _ = scaled.rounded_levels(x_dtype)
    direct = np.zeros((x.shape[0], codes.shape[0]))
    for mm in range(x.shape[0]):
        for n in range(codes.shape[0]):
            for b in range(codes.shape[1] // 64):
                ks = slice(64 * b, 64 * b + 64)
                direct[mm, n] += float(absmax[n, b]) * float(np.dot(x[mm, ks].astype(np.float64), levels[codes[n, ks]]))
    assert np.allclose(scaled.model(x, codes, absmax, x_dtype), direct, rtol=1e-12, atol=1e-12)
    # the rounded levels are the NF4 levels to the dtype's precision, and exact at 0 and +-1
    from reference.format import NF4_CODE

    rel = np.abs(levels - np.asarray(NF4_CODE, dtype=np.float64)) / np.maximum(np.abs(NF4_CODE), 1e-30)
    assert rel.max() <= (2.0**-8 if x_dtype == "bf16" else 2.0**-11) and levels[7] == 0.0  # unit roundoff
    assert levels[0] == -1.0 and levels[15] == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_a_float32_run_in_another_order_stays_within_the_bound(seed):
    """The kernel's arithmetic in float32 (each block's 64 exact products summed in a shuffled order, then scaled
    and added in block order) against the model: within `bound`, and the bound is not vacuous."""
    x, codes, absmax = _case(10 + seed, m=2, n=3, k=1024)
    xb = x.astype(np.float32)  # stands in for bf16 x: exact products either way
    levels, _ = scaled.rounded_levels("bf16")
    rng = np.random.default_rng(seed)
    got = np.zeros((2, 3), dtype=np.float32)
    for mm in range(2):
        for n in range(3):
            total = np.float32(0)
            for b in range(16):
                ks = np.arange(64 * b, 64 * b + 64)
                rng.shuffle(ks)
                part = np.float32(0)
                for kk in ks:
                    part = np.float32(part + np.float32(xb[mm, kk] * np.float32(levels[codes[n, kk]])))
                total = np.float32(total + np.float32(absmax[n, b] * part))
            got[mm, n] = total
    want = scaled.model(xb, codes, absmax, "bf16")
    tol = scaled.bound(xb, codes, absmax, "bf16")
    assert (np.abs(got - want) <= tol).all()
    assert (tol < 1e-3 * np.abs(want).max()).all()


@pytest.mark.slow  # an offline sm_90 build (make test-long)
def test_scaled_kernel_builds_for_sm90():
    """No local memory; per 8 weights of a lane: 4 LDS.32 lookups, 2 tensor-core products (4 per block of a lane's
    16 weights of each row), 8 SHFL a step for the absmax, under 0.6 ALU and 1.1 IMAD per weight in the loop."""
    from experiments.labs import sass_count as sc

    (r,) = sc.count_builds(["scaled"])
    assert "error" not in r, r.get("error")
    assert r["local"] == 0
    ops = r["opcodes"]
    assert ops.get("LDS", 0) == r["weights"] // 2, ops  # one 32-bit lookup per byte
    p = r["per_weight"]
    assert p["alu"] < 0.6 and p["imad"] < 1.1 and ops.get("SHFL.IDX", 0) == r["weights"] // 16, p


def test_check_accepts_the_model_and_refuses_a_perturbed_output():
    """`check` (gemv_lut's for this contract) on a bitsandbytes weight: the model's own output, rounded to bf16,
    passes; one output moved by 1 % of its size does not."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from reference.nf4 import NF4Quantized, recover_absmax

    gen = torch.Generator().manual_seed(3)
    packed, qs = bnb.functional.quantize_4bit((torch.randn(32, 256, generator=gen) * 0.02).bfloat16(), blocksize=64,
                                              compress_statistics=True, quant_type="nf4")
    x = torch.randn(2, 256, generator=gen).bfloat16()
    q = packed.reshape(-1).numpy()
    codes = np.stack([q >> 4, q & 15], axis=1).reshape(32, 256)
    quant = NF4Quantized(packed=q, shape=(32, 256), dtype="bfloat16", blocksize=64, absmax_u8=qs.absmax.numpy(),
                         absmax2=qs.state2.absmax.numpy(), code2=qs.state2.code.numpy(), offset=float(qs.offset))
    want = scaled.model(x.float().numpy(), codes, recover_absmax(quant, ftz=True).reshape(32, 4), "bf16")
    y = torch.from_numpy(want).float().bfloat16()
    assert scaled.check(y, x, packed, qs)["beyond"] == 0
    y[1, 7] = y[1, 7] + 0.01 * y.float().abs().max()
    r = scaled.check(y, x, packed, qs)
    assert r["beyond"] == 1 and r["max_err_over_bound"] > 1
