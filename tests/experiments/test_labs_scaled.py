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


def _simulate(x, packed, absmax, n, k, warps=2, split=2, x_dtype="bf16"):
    """The kernel's arithmetic followed index by index in float64 (NumPy): programs, warps, lanes 4g + t, steps,
    blocks, the lane's two words, the SHFL of block b's absmax from lane 4g + b, the PTX m16n8k16 fragments (A: a0
    row g cols 2t, 2t + 1; a1 row g + 8; a2 / a3 the same at cols 2t + 8, 2t + 9; B: b0 rows 2t, 2t + 1, b1 rows
    2t + 8, 2t + 9 of column g; D: rows g / g + 8, cols 2t, 2t + 1), the stores and the split-K sum. Indices as the
    kernel writes them: a slip there shows here as a mismatch with the model."""
    levels, _ = scaled.rounded_levels(x_dtype)
    m_rows = x.shape[0]
    kb = k // 2
    words = packed.view(np.uint32).reshape(n, kb // 4)
    xw = x.reshape(m_rows, kb, 2)  # x's word i: elements 2i, 2i + 1
    threads = 32 * warps
    rows = -(-n // (threads // 2))
    steps = kb // 128
    seg = -(-steps // split) * 128
    split = -(-kb // seg)
    part = np.zeros((split, m_rows, n))

    def pairs(word):  # the lookup: pair p = (L[byte p >> 4], L[byte p & 15])
        return [(levels[(int(word) >> (8 * p + 4)) & 15], levels[(int(word) >> (8 * p)) & 15]) for p in range(4)]

    for pid in range(rows * split):
        rblk, pid_k = divmod(pid, split)
        first, end = pid_k * seg, min(pid_k * seg + seg, kb)
        for w in range(warps):
            tot = np.zeros((32, 4))
            for c in range(first, end, 128):
                lanes = []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    row_a = rblk * (threads // 2) + w * 16 + g
                    lanes.append((g, t, min(row_a, n - 1), min(row_a + 8, n - 1)))
                for b in range(4):
                    # lane t makes block t of its rows; every lane reads block b's from lane 4g + b (SHFL)
                    amax = [(absmax[lanes[4 * g + b][2], c // 32 + b], absmax[lanes[4 * g + b][3], c // 32 + b])
                            for g, _, _, _ in lanes]
                    d = np.zeros((16, 8))
                    for word in range(2):
                        for half in range(2):
                            A, B = np.zeros((16, 16)), np.zeros((16, 8))
                            for g, t, ra, rb in lanes:
                                jw = c // 4 + 2 * t + 8 * b + word  # the lane's word
                                pa, pb = pairs(words[ra, jw]), pairs(words[rb, jw])
                                xi = 4 * (c // 4 + 2 * t) + 32 * b + 4 * word  # x words of this packed word
                                xr = min(g, m_rows - 1)
                                xs = [xw[xr, xi + q] if g < m_rows else (np.nan, np.nan) for q in range(4)]
                                p0, p1 = 2 * half, 2 * half + 1  # mma of pairs (0, 1) then (2, 3)
                                A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = pa[p0], pb[p0]
                                A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = pa[p1], pb[p1]
                                B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = xs[p0], xs[p1]
                            with np.errstate(invalid="ignore"):
                                d = d + A @ B
                    for lane, (g, t, _, _) in enumerate(lanes):
                        aa, ab = amax[lane]
                        tot[lane] += (aa * d[g, 2 * t], aa * d[g, 2 * t + 1], ab * d[g + 8, 2 * t],
                                      ab * d[g + 8, 2 * t + 1])
            for lane in range(32):
                g, t = divmod(lane, 4)
                row_a = rblk * (threads // 2) + w * 16 + g
                for r, m, v in ((row_a, 2 * t, tot[lane, 0]), (row_a, 2 * t + 1, tot[lane, 1]),
                                (row_a + 8, 2 * t, tot[lane, 2]), (row_a + 8, 2 * t + 1, tot[lane, 3])):
                    if r < n and m < m_rows:
                        part[pid_k, m, r] = v
    return part.sum(axis=0)


@pytest.mark.parametrize("m, n", [(1, 64), (3, 70), (8, 32)])
def test_the_kernels_index_math_computes_the_contract(m, n):
    """Following the kernel's indices (programs, lanes, blocks, fragments, SHFL, stores, split-K) gives the model's
    y: every weight meets its own x element and its own block's absmax once. Rows past N and x rows past M too."""
    k = 512
    rng = np.random.default_rng(m * 100 + n)
    packed = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
    x = rng.standard_normal((m, k))
    absmax = rng.uniform(0.1, 2.0, (n, k // 64))
    q = packed.reshape(n, k // 2)
    codes = np.stack([q >> 4, q & 15], axis=2).reshape(n, k)
    got = _simulate(x, packed, absmax, n, k)
    assert np.allclose(got, scaled.model(x, codes, absmax, "bf16"), rtol=1e-10, atol=1e-10)
