"""experiments.labs: the GEMV candidates' operand (their own asm, emulated) equals the reference decode bit for bit,
and the SASS counter finds a known loop. Offline; no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.labs import kernels as K
from experiments.labs import models
from reference.format import DYNAMIC_MAP
from reference.nf4 import NF4Quantized


def random_weight(n: int, k: int, dtype: str, seed: int, tiny: bool = False) -> NF4Quantized:
    """Seeded random packed bytes and double-quantized absmax (blocksize 64); `tiny`: some second-level scales
    near the float32 subnormal range, so that FTZ matters in both multiplies."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 64
    absmax2 = rng.uniform(0.01, 3.0, -(-blocks // 256)).astype(np.float32)
    if tiny:
        absmax2[::2] = np.float32(3e-38)
    return NF4Quantized(packed=rng.integers(0, 256, n * k // 2, dtype=np.uint8), shape=(n, k), dtype=dtype,
                        blocksize=64, absmax_u8=rng.integers(0, 256, blocks, dtype=np.uint8), absmax2=absmax2,
                        code2=DYNAMIC_MAP.copy(), offset=np.float32(0.0 if tiny else rng.uniform(0.0, 0.1)))


X_DT = {"bfloat16": 2, "float16": 1}
CASES = [  # (mode, copies, prmt_words, dtype, split)
    ("pair", 16, 0, "bfloat16", 1), ("pair", 8, 0, "float16", 2), ("pair", 4, 2, "bfloat16", 1),
    ("pair", 1, 0, "bfloat16", 1), ("level_prmt", 1, 0, "bfloat16", 1), ("level_imad", 1, 0, "float16", 1),
    ("prmt", 16, 0, "bfloat16", 1),
]


@pytest.mark.parametrize("mode, copies, prmt_words, dtype, split", CASES)
def test_operand_is_the_reference_decode(mode, copies, prmt_words, dtype, split):
    q = random_weight(80, 512, dtype, seed=hash((mode, copies, dtype)) % 1000)  # 80 rows: a partial 64-row tile
    got = models.operand_matrix(K.MODES[mode], q, X_DT[dtype], copies, prmt_words, split=split)
    want = models.expected_operand(q, X_DT[dtype])
    assert (got == want).all(), f"{int((got != want).sum())} weights differ"


@pytest.mark.parametrize("mode", ["pair", "level_prmt", "level_imad"])
def test_decode_flushes_like_bitsandbytes(mode):
    q = random_weight(16, 256, "bfloat16", seed=7, tiny=True)
    got = models.operand_matrix(K.MODES[mode], q, 2, 16 if mode == "pair" else 1)
    assert (got == models.expected_operand(q, 2)).all()


def test_pair_table_lookups_are_conflict_free():
    """16 copies: in each half-warp the 16 lanes read 16 distinct 8-byte bank pairs, whatever the bytes."""
    rng = np.random.default_rng(3)
    s = K.pair_shift(16)
    lane = np.arange(32)
    for _ in range(20):
        b = rng.integers(0, 256, 32)
        addr = models.SHARED_BASE + (b << s) + 8 * (lane % 16)
        for half in (lane < 16, lane >= 16):
            pairs = (addr[half] // 8) % 16
            assert len(set(pairs.tolist())) == 16


def test_pair_addressing_stays_in_32_bits():
    """X = lanebase << (16 - s) plus a byte at bits 16-23 must not overflow for the shared window's addresses."""
    for copies in (1, 4, 8, 16):
        s = K.pair_shift(copies)
        lanebase = models.SHARED_BASE + 48 * 1024 + 8 * (copies - 1)  # a table after Triton's own shared memory
        assert (lanebase << (16 - s)) + (255 << 16) + 255 < 2**32


def test_asm_is_one_line():
    """Inductor copies constexpr globals into generated source: the PTX text must not hold a newline."""
    for text in (K.PAIR_BF16, K.PAIR_F16, K.LEVEL_PRMT_BF16, K.LEVEL_IMAD_F16, K.DECLARE_PAIRS_16):
        assert "\n" not in text.value


SASS_TINY = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ;
        /*0020*/                   IMAD.HI.U32 R3, R2, R4, RZ ;
        /*0030*/                   LDS.64 R6, [R3+UR4] ;
        /*0040*/                   FMUL.FTZ R6, R6, R5 ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R6, R7, R6 ;
        /*0060*/                   HMMA.16816.F32.BF16 R8, R12, R6, R8 ;
        /*0070*/               @P0 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_1:
        /*0090*/                   BRA `(.L_x_1);
"""


def test_sass_histogram_of_a_known_loop():
    from experiments.labs import sass_count as sc

    body = sc.main_loop(SASS_TINY)
    assert body == ["LOP3.LUT", "IMAD.HI.U32", "LDS.64", "FMUL.FTZ", "F2FP.BF16.F32.PACK_AB",
                    "HMMA.16816.F32.BF16", "BRA"]
    h = sc.histogram(body, 8)
    assert h["pipes"] == {"alu": 2, "fma": 2, "lsu": 1, "tensor": 1, "other": 1}
    assert h["per_weight"]["imad"] == 1 / 8 and h["per_weight"]["shared_wavefronts"] == 2 / 8


@pytest.fixture(scope="module")
def tiny_build():
    """A compiled kernel with a known loop: per iteration 2 dependent PRMT, 1 FMUL (the unit), an LDG."""
    from experiments.labs import sass_count as sc

    rows = sc.count_builds(["tiny"])
    return rows[0]


def test_sass_counter_on_a_compiled_loop(tiny_build):
    r = tiny_build
    assert "error" not in r, r.get("error")
    ops = r["opcodes"]
    assert ops.get("PRMT", 0) == 2 * r["weights"] and ops.get("FMUL", 0) + ops.get("FMUL.FTZ", 0) == r["weights"]
    assert r["per_weight"]["alu"] >= 2 and r["per_weight"]["fp32"] == 1


# --- the pair candidate as a product kernel: nf4/linear/gemv_pair.py (kernel "gemv_pair") -------------------------


def plain_weight(n: int, k: int, dtype: str, seed: int) -> NF4Quantized:
    """Seeded random packed bytes with a float32 absmax per block of 64 (no double quantization), some of them
    near the float32 subnormals."""
    rng = np.random.default_rng(seed)
    absmax = rng.uniform(0.01, 3.0, n * k // 64).astype(np.float32)
    absmax[::3] = np.float32(2e-38)
    return NF4Quantized(packed=rng.integers(0, 256, n * k // 2, dtype=np.uint8), shape=(n, k), dtype=dtype,
                        blocksize=64, absmax=absmax)


PAIR_CASES = [  # (dtype, ftz, double quant, tiny scales, split, warps)
    ("bfloat16", True, True, False, 1, 4), ("float16", True, True, True, 2, 4), ("bfloat16", False, True, True, 1, 8),
    ("float16", False, False, False, 1, 4), ("bfloat16", True, False, False, 3, 2), ("bfloat16", False, False, False,
                                                                                     2, 4),
]


@pytest.mark.parametrize("dtype, ftz, nested, tiny, split, warps", PAIR_CASES)
def test_product_pair_asm_decodes_the_reference_operand(dtype, ftz, nested, tiny, split, warps):
    """nf4.linear.gemv_pair's own asm text (FTZ: mul.rn.ftz.f32, else mul.rn.f32), run by the lab's PTX emulator
    along the kernel's loop (experiments.labs.models.operand_matrix), gives reference.dequantize_nf4's operand
    (ftz as the call's) bit for bit, every weight formed once; seeded weights of 80 rows (a partial row block)."""
    from nf4.linear import gemv_pair

    seed = 1000 + PAIR_CASES.index((dtype, ftz, nested, tiny, split, warps))
    q = random_weight(80, 512, dtype, seed=seed, tiny=tiny) if nested else plain_weight(80, 512, dtype, seed)
    got = models.operand_matrix(1, q, X_DT[dtype], gemv_pair.COPIES, num_warps=warps, split=split,
                                pair_asm=lambda d: gemv_pair.pair_asm(d, ftz), ftz=ftz)
    want = models.expected_operand(q, X_DT[dtype], ftz=ftz)
    assert (got == want).all(), f"{int((got != want).sum())} weights differ"
    if dtype == "bfloat16" and (tiny or not nested):
        # bfloat16 keeps float32's subnormals (float16 rounds them to zero either way): the flush shows in these
        # weights, and the other text gives other bits (the check can fail)
        other = models.operand_matrix(1, q, X_DT[dtype], gemv_pair.COPIES, num_warps=warps, split=split,
                                      pair_asm=lambda d: gemv_pair.pair_asm(d, not ftz), ftz=ftz)
        assert (other != want).any()


def test_product_pair_kernel_is_the_labs_pair_mode():
    """The product kernel's texts and table are the lab's pair mode with 16 copies: the same asm (FTZ), the same
    address arithmetic, the kernel's constexprs those texts, one line each (Inductor copies constexpr globals)."""
    from nf4.linear import gemv_pair

    assert gemv_pair.COPIES == 16 and gemv_pair.pair_shift() == K.pair_shift(16)
    assert gemv_pair.pair_constants(16, 0x400) == K.pair_constants(16, 0x400)
    for dtype in ("bf16", "f16"):
        assert gemv_pair.pair_asm(dtype) == K.pair_asm(dtype)
        assert gemv_pair.pair_asm(dtype, ftz=False) == K.pair_asm(dtype).replace("mul.rn.ftz.f32", "mul.rn.f32")
    assert gemv_pair.PAIR_BF16.value == gemv_pair.pair_asm("bf16") and gemv_pair.PAIR_F16.value == K.pair_asm("f16")
    assert gemv_pair.PAIR_BF16_IEEE.value == gemv_pair.pair_asm("bf16", ftz=False)
    assert gemv_pair.PAIR_F16_IEEE.value == gemv_pair.pair_asm("f16", ftz=False)
    assert gemv_pair.DECLARE_PAIRS.value.replace(gemv_pair.PAIR_TABLE, K.PAIR_TABLE) == K.DECLARE_PAIRS_16.value
    for text in (gemv_pair.PAIR_BF16, gemv_pair.PAIR_F16_IEEE, gemv_pair.DECLARE_PAIRS, gemv_pair.ST_V2):
        assert "\n" not in text.value


@pytest.fixture(scope="module")
def pair_builds():
    """Offline sm_90 builds of the product's nf4_gemv_pair_kernel (the arguments nf4.linear.launch.kernel_args
    gives it, M = 1 bf16 and M = 16 fp16) and of the lab's pair16."""
    from experiments.labs import sass_count as sc

    return {r["build"]: r for r in sc.count_builds(["gemv_pair", "gemv_pair_m16", "pair16"])}


@pytest.mark.slow  # three offline sm_90 builds (make test-long)
def test_product_pair_kernel_builds_for_sm90(pair_builds):
    """nf4/linear/gemv_pair.py compiles for sm_90 with its own launch's arguments: no local memory, its 32 KiB
    table in static shared memory, 4 conflict-free LDS.64 per 8 weights, and at M = 1 the lab pair16's main loop
    opcode for opcode (the same registers)."""
    product, lab, m16 = pair_builds["gemv_pair"], pair_builds["pair16"], pair_builds["gemv_pair_m16"]
    for r in (product, lab, m16):
        assert "error" not in r, r.get("error")
        assert r["local"] == 0 and r["static_shared"] >= 256 * 8 * 16, r
        assert r["per_weight"]["shared_wavefronts"] == 1.0 and r["opcodes"].get("LDS.64", 0) == r["weights"] // 2
    assert product["opcodes"] == lab["opcodes"] and product["registers"] == lab["registers"]
    assert m16["per_weight"]["tensor"] == 2 * product["per_weight"]["tensor"]  # two 8-row tiles of x per word


def test_bound_check_by_hand():
    import torch

    from experiments.labs.gemv_lut import bound_check

    gen = torch.Generator().manual_seed(3)
    xr = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    wd = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    ref = torch.nn.functional.linear(xr.float(), wd.float())
    ok = bound_check(ref.to(torch.bfloat16), xr, wd, ref)  # one bf16 rounding of the float32 product: within
    assert ok["random_within_bound"] and ok["random_max_err_over_bound"] <= 1.0
    off = ref.clone()
    off[1, 2] += 0.25 * ref.abs().max() + 1.0  # far outside: caught, and reported over the bound
    bad = bound_check(off, xr, wd, ref)
    assert not bad["random_within_bound"] and bad["random_max_err_over_bound"] > 1.0
