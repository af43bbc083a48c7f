"""`nf4.linear` on a CUDA GPU: the operand check over every weight, the sum check, torch.compile and
CUDA graphs (docs/FORMAT.md §9-10).

Skipped without CUDA (and under TRITON_INTERPRET). Weights are quantized on the GPU by bitsandbytes;
ftz takes its CUDA default (on) in nf4.dequantize and nf4.linear alike, so the operand is
`nf4.dequantize(W).to(x.dtype)`. The operand check feeds a signed, power-of-two-scaled permutation
of the identity in chunks of M rows (every column of W, or every row for the backward, once), so
each config is checked on every weight at the M it is called with, through the repeat-call plans
too (every chunk after the second takes the bound launch).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from triton.runtime.interpreter import InterpretedFunction

    import nf4
    from nf4.linear import LinearConfig
    from nf4.linear.api import entry_of, run
    from nf4.linear.gemv import nf4_gemv_kernel
    from nf4.linear.tuned import tuned
    from nf4.weight import NF4Weight
    from reference.linear import worst_ratio
    from verify.exact import assert_bitexact

    if isinstance(nf4_gemv_kernel, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET is set: these tests need compiled kernels", allow_module_level=True)

    FORWARD = {  # name -> (rows of x per call, config)
        "tuned-M1": (1, None), "tuned-M3": (3, None), "tuned-M16": (16, None), "tuned-M32": (32, None),
        "tuned-M64": (64, None), "tuned-M128": (128, None), "tuned-M300": (300, None),
        "gemv": (4, LinearConfig(kernel="gemv")),
        "gemv-split1": (2, LinearConfig(kernel="gemv", split_k=1, codebook=0)),
        "gemv-split3": (3, LinearConfig(kernel="gemv", split_k=3, step_bytes=16, codebook=1)),
        "gemv-table": (4, LinearConfig(kernel="gemv_table", block_r=128)),
        "gemv-table-M1": (1, LinearConfig(kernel="gemv_table", block_r=64, split_k=1)),
        # the tensor-core word GEMV (mma.sync): M = 1, 5 (B columns past M), 8 (all of B's columns), 13, 19, 32
        "gemv-mma-M1": (1, LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4)),
        "gemv-mma-M5": (5, LinearConfig(kernel="gemv_mma", block_r=32, num_warps=2, split_k=1,
                                        step_bytes=16)),
        "gemv-mma-M8": (8, LinearConfig(kernel="gemv_mma", block_r=128, num_warps=8, split_k=3)),
        # two and four 8-row tiles of x (B's columns), the last one partly past M
        "gemv-mma-M13": (13, LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, split_k=2)),
        "gemv-mma-M32": (32, LinearConfig(kernel="gemv_mma", block_r=32, num_warps=2,
                                          step_bytes=16)),
        "gemv-mma-M19": (19, LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, split_k=1)),
        # warps that split K inside a program (warps_k): one launch with 4 warps per 16 rows (some warps past the
        # last step on short rows), 2 warps per 16 rows beside split-K, 8 warps per 16 rows at four tiles of x
        "gemv-mma-wk4-M1": (1, LinearConfig(kernel="gemv_mma", block_r=16, num_warps=4, warps_k=4,
                                            split_k=1)),
        "gemv-mma-wk2-M13": (13, LinearConfig(kernel="gemv_mma", block_r=32, num_warps=4, warps_k=2,
                                              split_k=2, step_bytes=16)),
        "gemv-mma-wk8-M32": (32, LinearConfig(kernel="gemv_mma", block_r=16, num_warps=8, warps_k=8,
                                              split_k=1, step_bytes=16)),
        # the word tl.dot kernel (nf4_gemm_word_kernel): split-K 3 (ordered sum) with M not a multiple of the tile,
        # one launch with 8 warps, and a split from the programs-per-multiprocessor rule
        "word-gemm-M19": (19, LinearConfig(kernel="gemm_word", block_m=32, block_n=128, swap=True, num_stages=3,
                                           split_k=3)),
        "word-gemm-M100": (100, LinearConfig(kernel="gemm_word", block_m=128, block_n=256, num_warps=8,
                                             swap=True, split_k=1)),
        "word-gemm-M64": (64, LinearConfig(kernel="gemm_word", block_m=64, block_n=128, swap=True, num_stages=3,
                                           split_k=0, programs_per_sm=2)),
        # 256 rows of x per tile, 8 warps, one program per multiprocessor (WORD_GEMM256): two tiles along M
        "word-gemm-M300": (300, LinearConfig(kernel="gemm_word", block_m=256, block_n=128, num_warps=8, swap=True,
                                             num_stages=3, split_k=0, programs_per_sm=1)),
        # WORD_GEMM128's tile with 8 warps in one launch (WORD_GEMM128_W8, the table's on large weights at M = 128)
        "word-gemm-M128-w8": (128, LinearConfig(kernel="gemm_word", block_m=128, block_n=128, block_k=64,
                                                num_warps=8, swap=True, num_stages=3, split_k=1, programs_per_sm=2)),
        "dequant": (8, LinearConfig(kernel="dequant")),
        # the Gluon GEMM (sm_90; elsewhere, and at blocksize 128, the table's choice without its rule runs): a tile of
        # 128 rows of x with split-K auto and 3, and of 256 rows (GLUON_GEMM256) over two tiles along M
        "gluon-M100": (100, LinearConfig(kernel="gemm_gluon", block_m=128, num_warps=4, num_stages=4, split_k=0,
                                         programs_per_sm=2)),
        "gluon-M77-s3": (77, LinearConfig(kernel="gemm_gluon", block_m=128, num_warps=4, num_stages=4, split_k=3)),
        "gluon-M300": (300, LinearConfig(kernel="gemm_gluon", block_m=256, num_warps=4, num_stages=3, split_k=1)),
    }
    # the backward is nf4.dequantize + cuBLAS whatever the config (nf4.linear.launch.launch_config): the table's rows
    BACKWARD = {"tuned-M1": (1, None), "tuned-M16": (16, None), "tuned-M300": (300, None)}
    # kernel "gemv_pair" (nf4/linear/gemv_pair.py, in no tuned row): split-K to fill 6 programs per multiprocessor
    # (the lab's pair16) with its ordered sum, and one launch of 8 warps (the bias added in the kernel)
    GEMV_PAIR = {"auto": LinearConfig(kernel="gemv_pair", programs_per_sm=6),
                 "one-launch": LinearConfig(kernel="gemv_pair", num_warps=8, split_k=1, programs_per_sm=2)}

CUDA = "cuda"
SHAPES = [(1024, 4096), (4096, 1024), (333, 512), (45, 384)]  # (N, K); N odd in the last two


def _forward_all(lin, packed, qs, dtype, name, seed):
    """Every column of W through K identity rows (a signed, scaled permutation) in chunks of M rows."""
    m, config = FORWARD[name]
    n, k = qs.shape
    wd = lin.operand(packed, qs, dtype)
    perm = lin.permutation(k, seed)
    x, scales = lin.identity_rows(perm, dtype, k, seed + 1, device=CUDA)
    got = torch.cat([nf4.linear(x[i:i + m], packed, qs, config=config) for i in range(0, k, m)])
    assert got.dtype == dtype and tuple(got.shape) == (k, n)
    assert_bitexact(got, lin.picked(wd.t(), perm, scales, dtype), name=f"forward {name}")


def _backward_all(lin, packed, qs, dtype, name, seed):
    """Every row of W through N identity rows of dY in chunks of M rows: dY @ W."""
    m, config = BACKWARD[name]
    n, k = qs.shape
    wd = lin.operand(packed, qs, dtype)
    w = entry_of(packed, qs)
    perm = lin.permutation(n, seed)
    dy, scales = lin.identity_rows(perm, dtype, n, seed + 1, device=CUDA)
    got = torch.cat([run(dy[i:i + m], packed, qs, w, None, trans=True, config=config) for i in range(0, n, m)])
    assert got.dtype == dtype and tuple(got.shape) == (n, k)
    assert_bitexact(got, lin.picked(wd, perm, scales, dtype), name=f"backward {name}")


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_operand(nf4h, lin, shape, blocksize, dtype, double_quant):
    """Every forward config (the tuned table at M = 1, 3, 16, 32, 64, 128, 300; GEMV with split-K auto, 1, 3; the
    word GEMV; the tensor-core GEMV; the word tl.dot kernel; nf4.dequantize + cuBLAS) and the backward, on every
    weight; autograd's x.grad through identity rows of dY."""
    seed = nf4h.case_seed("gpu-operand", shape, blocksize, dtype, double_quant)
    packed, qs = nf4h.quantize(shape, dtype, blocksize, double_quant, seed=seed, device=CUDA)
    for name in FORWARD:
        config = FORWARD[name][1]
        if config is not None and config.kernel == "gemv_mma" and FORWARD[name][0] > 4 and (shape[1] // 2) % (
                4 * min(32, config.step_bytes, blocksize // 2)):
            continue  # rows not whole steps of this tensor-core config: its fallback, the codebook-0 GEMV at M > 4
        _forward_all(lin, packed, qs, dtype, name, seed)
    for name in BACKWARD:
        _backward_all(lin, packed, qs, dtype, name, seed)
    n, k = shape
    rows = lin.columns(n, 16, seed)
    dy, scales = lin.identity_rows(rows, dtype, n, seed + 2, device=CUDA)
    x = torch.randn(16, k, device=CUDA).to(dtype).requires_grad_()
    nf4.linear(x, packed, qs).backward(dy)
    assert_bitexact(x.grad, lin.picked(lin.operand(packed, qs, dtype), rows, scales, dtype), name="autograd x.grad")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mma_gemv_is_what_runs(nf4h, dtype):
    """The gemv-mma configs above launch nf4_gemv_mma_kernel (not a fallback) on the shapes whose rows are a
    whole number of its steps, and fall back where they are not (K = 384 with 32-byte lanes) or where x is not
    16-byte aligned: to the word GEMV up to M = 4, to the codebook-0 GEMV above."""
    from nf4.linear import launch as linear_launch
    from nf4.linear.gemv import nf4_gemv_kernel
    from nf4.linear.gemv_mma import nf4_gemv_mma_kernel
    from nf4.linear.gemv_table import nf4_gemv_table_kernel

    def kernel(shape, name, x=None):
        m, config = FORWARD[name]
        packed, qs = nf4h.quantize(shape, dtype, 64, True, seed=nf4h.case_seed("gpu-mma-runs", shape), device=CUDA)
        w = NF4Weight.from_state(packed, qs)
        x = torch.zeros((m, shape[1]), dtype=dtype, device=CUDA) if x is None else x
        out = torch.empty((m, shape[0]), dtype=dtype, device=CUDA)
        config = linear_launch.launch_config(config, w, x, m, False)
        split, _ = linear_launch.split_k(config, w, m, x.device)
        part = torch.empty(split * m * shape[0], dtype=torch.float32, device=CUDA)
        return linear_launch.kernel_args(x, w, None, out, m, config, True, False, part)[0][0]

    for shape in SHAPES[:3]:
        for name in ("gemv-mma-M1", "gemv-mma-M5", "gemv-mma-M8", "gemv-mma-M13", "gemv-mma-M19", "gemv-mma-M32",
                     "gemv-mma-wk4-M1", "gemv-mma-wk2-M13", "gemv-mma-wk8-M32"):
            assert kernel(shape, name) is nf4_gemv_mma_kernel, (shape, name)
    # K = 384: 192 bytes a row, whole 64-byte steps (16-byte lanes) but not whole 128-byte steps (32-byte lanes)
    assert kernel((45, 384), "gemv-mma-M5") is nf4_gemv_mma_kernel
    assert kernel((45, 384), "gemv-mma-M1") is nf4_gemv_table_kernel
    assert kernel((45, 384), "gemv-mma-M8") is nf4_gemv_kernel  # M = 8: past the word GEMV too
    shifted = torch.zeros(4 * 512 + 2, dtype=dtype, device=CUDA)[2:].view(4, 512)  # 4-byte, not 16-byte aligned
    assert kernel((333, 512), "gemv-mma-M1", shifted[:1]) is nf4_gemv_table_kernel


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1024, 4096), (333, 512)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_pair_operand(nf4h, lin, shape, dtype, double_quant):
    """nf4_gemv_pair_kernel (checked to be what launches, not a fallback) at M = 1, 4 and 16: every column of W
    through signed, power-of-two-scaled identity rows, bit for bit (int16 views), once with a bias (scale * w +
    bias rounded once), and with ftz off (the kernel's IEEE asm text; the same bits on these normal weights)."""
    from nf4.linear import launch as linear_launch
    from nf4.linear.gemv_pair import nf4_gemv_pair_kernel

    seed = nf4h.case_seed("gpu-gemv-pair", shape, dtype, double_quant)
    packed, qs = nf4h.quantize(shape, dtype, 64, double_quant, seed=seed, device=CUDA)
    n, k = shape
    w = NF4Weight.from_state(packed, qs)
    wd = lin.operand(packed, qs, dtype)
    perm = lin.permutation(k, seed)
    x, scales = lin.identity_rows(perm, dtype, k, seed + 1, device=CUDA)
    want = lin.picked(wd.t(), perm, scales, dtype)
    for name, config in GEMV_PAIR.items():
        for m in (1, 4, 16):
            launched = linear_launch.launch_config(config, w, x[:m], m, False)
            split, _ = linear_launch.split_k(launched, w, m, x.device)
            part = torch.empty(split * m * n, dtype=torch.float32, device=CUDA)
            out = torch.empty((m, n), dtype=dtype, device=CUDA)
            fn = linear_launch.kernel_args(x[:m], w, None, out, m, launched, True, False, part)[0][0]
            assert launched is config and fn is nf4_gemv_pair_kernel, (name, m)
            got = torch.cat([nf4.linear(x[i:i + m], packed, qs, config=config) for i in range(0, k, m)])
            assert_bitexact(got, want, name=f"gemv_pair {name} M={m}")
        bias = lin.randn((n,), dtype, seed + 2, device=CUDA)
        with_bias = (lin.picked(wd.t(), perm[:4], scales[:4], torch.float32) + bias.float()).to(dtype)
        assert_bitexact(nf4.linear(x[:4], packed, qs, bias=bias, config=config), with_bias, name=f"{name} bias")
    wt = lin.operand(packed, qs, dtype, ftz=False)
    got = torch.cat([nf4.linear(x[i:i + 4], packed, qs, config=GEMV_PAIR["auto"], ftz=False) for i in range(0, k, 4)])
    assert_bitexact(got, lin.picked(wt.t(), perm, scales, dtype), name="gemv_pair ftz=False")


def test_gemv_pair_falls_back_where_it_cannot_run(nf4h):
    """K not a multiple of 256, x of another dtype than W, M > 16, x not 16-byte aligned: the word GEMV of the
    config's shape (up to M = 4), the codebook-0 GEMV above it."""
    from nf4.linear import launch as linear_launch

    config = GEMV_PAIR["auto"]
    for shape, m, dtype, want in (((45, 384), 1, torch.bfloat16, "gemv_table"),
                                  ((333, 512), 1, torch.float16, "gemv"),
                                  ((333, 512), 17, torch.bfloat16, "gemv"),
                                  ((333, 512), 8, torch.bfloat16, "gemv")):
        packed, qs = nf4h.quantize(shape, torch.bfloat16, 64, True, seed=nf4h.case_seed("gpu-pair-fb", shape),
                                   device=CUDA)
        w = NF4Weight.from_state(packed, qs)
        x = torch.zeros((m, shape[1]), dtype=dtype, device=CUDA)
        if m == 8:  # 16-byte aligned rows, but x starts 4 bytes in
            x = torch.zeros(m * shape[1] + 2, dtype=dtype, device=CUDA)[2:].view(m, shape[1])
        assert linear_launch.launch_config(config, w, x, m, False).kernel == want, (shape, m, dtype)


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gluon_gemm_is_what_runs(nf4h, lin, dtype):
    """On an H100 or H200 the table picks the Gluon GEMM at M = 65-512 on large weights (tuned.gluon_rule), and it
    is what runs: its kernel launches (the profiler's CUDA kernels), its result is the operand's
    bits on identity rows, with a bias scale * w + bias rounded once; x, the packed bytes and the state unchanged.
    Where it cannot run (blocksize 128, x 4 bytes off 16-byte alignment, x of another dtype than W) the table's
    choice without the rule runs instead."""
    from nf4.linear import gemm_gluon
    from nf4.linear import launch as linear_launch

    if not _hopper() or not gemm_gluon.AVAILABLE:
        pytest.skip("the Gluon GEMM runs on sm_90 with Triton's Gluon API")
    name = torch.cuda.get_device_name()
    shape = (4096, 4096)  # 16Mi weights: the rule's at M = 65-128 on both GPUs
    seed = nf4h.case_seed("gpu-gluon", dtype)
    packed, qs = nf4h.quantize(shape, dtype, 64, True, seed=seed, device=CUDA)
    n, k = shape
    assert tuned(name, 96, n=n, k=k).kernel == "gemm_gluon"
    assert tuned(name, 64, n=n, k=k).kernel != "gemm_gluon" and tuned(name, 600, n=n, k=k).kernel != "gemm_gluon"
    wd = lin.operand(packed, qs, dtype)
    perm = lin.permutation(k, seed)[:96]
    x, scales = lin.identity_rows(perm, dtype, k, seed + 1, device=CUDA)
    bias = lin.randn((n,), dtype, seed + 2, device=CUDA)
    before = [t.clone() for t in (x, packed, qs.absmax, bias)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = nf4.linear(x, packed, qs)
        got_bias = nf4.linear(x, packed, qs, bias=bias)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("nf4_gemm_gluon_kernel" in s for s in names) == 2, names
    assert sum("nf4_permute_x_kernel" in s for s in names) == 2, names
    assert_bitexact(got, lin.picked(wd.t(), perm, scales, dtype), name="gluon tuned M=96")
    want = (lin.picked(wd.t(), perm, scales, torch.float32) + bias.float()).to(dtype)
    assert_bitexact(got_bias, want, name="gluon bias")
    for t, b in zip((x, packed, qs.absmax, bias), before, strict=True):
        assert torch.equal(t, b)
    w = NF4Weight.from_state(packed, qs)
    config = tuned(name, 96, n=n, k=k)
    shifted = torch.zeros(96 * k + 2, dtype=dtype, device=CUDA)[2:].view(96, k)
    other = x.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    table = tuned(name, 96, n=n, k=k, gluon=False)
    for xx in (shifted, other):  # what the table's own choice runs (the dequant path for x of another dtype)
        got = linear_launch.launch_config(config, w, xx, 96, False)
        assert got.kernel != "gemm_gluon" and got == linear_launch.launch_config(table, w, xx, 96, False)
    packed128, qs128 = nf4h.quantize(shape, dtype, 128, True, seed=seed, device=CUDA)
    w128 = NF4Weight.from_state(packed128, qs128)
    assert linear_launch.launch_config(config, w128, x, 96, False).kernel != "gemm_gluon"


@pytest.mark.parametrize("w_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["wfp16", "wbf16", "wfp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_operand_mixed_dtypes_and_storage(nf4h, lin, dtype, w_dtype):
    """A weight of another dtype than x (the operand is rounded to W's dtype, then converted), stored as
    bfloat16: the tuned forward at M = 1 and 64, the GEMV with the select tree (split-K 3) and the backward."""
    seed = nf4h.case_seed("gpu-mixed", dtype, w_dtype)
    packed, qs = nf4h.quantize((333, 512), w_dtype, 64, True, seed=seed, device=CUDA, quant_storage=torch.bfloat16)
    for name in ("tuned-M1", "tuned-M64", "gemv-split3"):
        _forward_all(lin, packed, qs, dtype, name, seed)
    _backward_all(lin, packed, qs, dtype, "tuned-M16", seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sum_within_bound(nf4h, lin, record_property, shape, dtype):
    """Random x (and a bias): the worst ratio of |y - exact| to the float32 accumulation bound is <= 1 for
    every forward config and the backward; dense cuBLAS on the dequantized weight is reported beside it."""
    seed = nf4h.case_seed("gpu-sum", shape, dtype)
    packed, qs = nf4h.quantize(shape, dtype, 64, True, seed=seed, device=CUDA)
    n, k = shape
    wd = lin.operand(packed, qs, dtype)
    w64 = lin.np64(wd)
    bias = lin.randn((n,), dtype, seed + 1, device=CUDA)
    rows = 16  # the ratio over the first rows (the float64 product of all 300 would dominate the test's time)
    for name, (m, config) in FORWARD.items():
        x = lin.randn((max(m, 1), k), dtype, seed + m, device=CUDA)
        for b in (None, bias):
            y = nf4.linear(x, packed, qs, bias=b, config=config)
            dense = torch.nn.functional.linear(x, wd, b)
            b64 = None if b is None else lin.np64(b)
            x64 = lin.np64(x[:rows])
            ours = worst_ratio(lin.np64(y[:rows]), x64, w64, dtype, b64)
            theirs = worst_ratio(lin.np64(dense[:rows]), x64, w64, dtype, b64)
            label = f"{name}-{'bias' if b is not None else 'nobias'}"
            record_property(f"{label}_nf4_ratio", ours)
            record_property(f"{label}_cublas_ratio", theirs)
            print(f"\n{label}: worst ratio nf4.linear {ours:.3g}, dense cuBLAS {theirs:.3g}")
            if (config or tuned(torch.cuda.get_device_name(), x.shape[0], n=n, k=k)).kernel == "dequant":
                # nf4.dequantize + cuBLAS: cuBLAS's own sum (which can exceed the float32 bound: 3.93 at
                # 333x512 on an H100 with torch's default reduced-precision reductions), bit for bit
                assert_bitexact(y, dense, name=label)
            else:
                assert ours <= 1.0, f"{label}: {ours}"
    w = entry_of(packed, qs)
    for name, (m, config) in BACKWARD.items():
        dy = lin.randn((max(m, 1), n), dtype, seed + 100 + m, device=CUDA)
        got = run(dy, packed, qs, w, None, trans=True, config=config)
        ours = worst_ratio(lin.np64(got[:rows]), lin.np64(dy[:rows]), lin.np64(wd.t()), dtype)
        theirs = worst_ratio(lin.np64((dy @ wd)[:rows]), lin.np64(dy[:rows]), lin.np64(wd.t()), dtype)
        record_property(f"backward-{name}_nf4_ratio", ours)
        print(f"\nbackward-{name}: worst ratio nf4.linear {ours:.3g}, dense cuBLAS {theirs:.3g}")
        assert ours <= 1.0, f"backward {name}: {ours}"


# --- torch.compile and CUDA graphs ----------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_compile_forward(nf4h, lin, dtype, m):
    """torch.compile(fullgraph=True) (Inductor) of a function calling nf4.linear: the same bits as eager
    (the tuned path at each M on an H100: the tensor-core GEMV at 1 and 16, the word tl.dot kernel at 64)."""
    packed, qs = nf4h.quantize((333, 512), dtype, 64, True, seed=nf4h.case_seed("gpu-compile", dtype, m), device=CUDA)
    _compiled_is_eager(lin, packed, qs, (m, 512), dtype, f"compiled vs eager, M={m}")


def _compiled_is_eager(lin, packed, qs, x_shape, dtype, name):
    """torch.compile(fullgraph=True, dynamic=False) of nf4.linear with a bias: eager's bits on two inputs, no graph
    break. Returns the eager function."""
    from torch._dynamo.utils import counters

    bias = lin.randn((qs.shape[0],), dtype, 1, device=CUDA)

    def fn(x):
        return nf4.linear(x, packed, qs, bias=bias)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for seed in (2, 3):
        x = lin.randn(x_shape, dtype, seed, device=CUDA)
        assert_bitexact(compiled(x), fn(x), name=name)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
    return fn


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_opaque_dequantize_repeat_calls_are_exact(nf4h, lin, double_quant):
    """The dequant path's opaque op (what a compiled linear of many rows runs every call) binds its dequantize on the
    first call and rebinds every pointer after: later calls on the same tensors, on a clone of the packed weight and
    of the state's tensors (other addresses), and on a packed weight 4 bytes off its alignment (a new plan), each
    give eager's bits; a clone changed in place gives the changed weight's bits."""
    import nf4.linear.ops  # registers the ops

    n, k, dtype = 333, 512, torch.bfloat16
    packed, qs = nf4h.quantize((n, k), dtype, 64, double_quant, seed=nf4h.case_seed("gpu-opaque", double_quant),
                               device=CUDA)
    x = lin.randn((300, k), dtype, 7, device=CUDA)

    def op(p, state):
        s2 = state.state2
        nested = (s2.absmax, s2.code, state.offset) if double_quant else (None, None, None)
        return torch.ops.nf4.dequantize_matmul_opaque(x, p, state.absmax, *nested, None, n, k, 64, dtype, True,
                                                      False)

    def want(p, state):
        return torch.nn.functional.linear(x, nf4.dequantize(p, state))

    for _ in range(3):
        assert_bitexact(op(packed, qs), want(packed, qs), name="same tensors")
    twin, twin_qs = packed.clone(), nf4h.clone_state(qs)
    assert_bitexact(op(twin, twin_qs), want(twin, twin_qs), name="clones")
    raw = torch.empty(packed.numel() + 16, dtype=torch.uint8, device=CUDA)
    shifted = raw[4:4 + packed.numel()].view(packed.shape)
    shifted.copy_(packed)
    for _ in range(2):
        assert_bitexact(op(shifted, qs), want(shifted, qs), name="4 bytes off")
    twin.bitwise_xor_(0x11)
    assert_bitexact(op(twin, twin_qs), want(twin, twin_qs), name="changed in place")


@pytest.mark.parametrize("m", [1, 16, 64])
def test_torch_compile_forward_backward(nf4h, lin, m):
    """Forward and backward compiled: y and x.grad bit for bit as eager; bias.grad (a sum over rows,
    whose order Inductor may choose) to within its rounding."""
    dtype = torch.bfloat16
    packed, qs = nf4h.quantize((333, 512), dtype, 64, True, seed=nf4h.case_seed("gpu-compile-bwd", m), device=CUDA)

    def fn(x, bias):
        return nf4.linear(x, packed, qs, bias=bias)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    x0 = lin.randn((m, 512), dtype, 4, device=CUDA)
    b0 = lin.randn((333,), dtype, 5, device=CUDA)
    dy = lin.randn((m, 333), dtype, 6, device=CUDA)
    results = []
    for f in (fn, compiled):
        x, b = x0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = f(x, b)
        y.backward(dy)
        results.append((y.detach(), x.grad, b.grad))
    (ye, gxe, gbe), (yc, gxc, gbc) = results
    assert_bitexact(yc, ye, name="compiled y")
    assert_bitexact(gxc, gxe, name="compiled x.grad")
    torch.testing.assert_close(gbc, gbe, rtol=2**-7, atol=2**-14)
    torch._dynamo.reset()


@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_graph_capture(nf4h, lin, dtype, m):
    """nf4.linear captured in a CUDA graph (after warm-up on a side stream) and replayed on new inputs
    copied into the static x: the same bits as eager calls on those inputs (the tuned kernels at M = 1, 3, 16 and
    64 on an H100: the tensor-core GEMVs and the word tl.dot kernel)."""
    packed, qs = nf4h.quantize((1024, 4096), dtype, 64, True, seed=nf4h.case_seed("gpu-graph", dtype, m), device=CUDA)
    bias = lin.randn((1024,), dtype, 7, device=CUDA)
    static_x = lin.randn((m, 4096), dtype, 8, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, then bind the repeat-call plan, then use it
            nf4.linear(static_x, packed, qs, bias=bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = nf4.linear(static_x, packed, qs, bias=bias)
    for seed in (9, 10, 11):
        x = lin.randn((m, 4096), dtype, seed, device=CUDA)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitexact(static_y, nf4.linear(x, packed, qs, bias=bias), name=f"graph replay, input {seed}")


def test_gluon_gemm_repeat_calls_are_bound(nf4h, lin):
    """From the second call of a key nf4.linear runs the Gluon GEMM through its bound launches (gluon_launch.Bound in
    the repeat-call cache, no JIT dispatch): each call's x, bias and out, the packed bytes copied to new addresses
    (the weight's descriptor remade), split-K (auto at M = 100 on 4096 x 4096) and not (M = 300); every call's
    result is the operand's bits on identity rows (with a bias: scale * w + bias rounded once)."""
    from nf4.linear import api as linear_api
    from nf4.linear import gemm_gluon, gluon_launch

    if not _hopper() or not gemm_gluon.AVAILABLE:
        pytest.skip("the Gluon GEMM runs on sm_90 with Triton's Gluon API")
    dtype, (n, k) = torch.bfloat16, (4096, 4096)
    seed = nf4h.case_seed("gpu-gluon-bound")
    packed, qs = nf4h.quantize((n, k), dtype, 64, True, seed=seed, device=CUDA)
    copies = [packed, packed.clone(), packed.clone()]
    wd = lin.operand(packed, qs, dtype)
    perm = lin.permutation(k, seed)
    x, scales = lin.identity_rows(perm, dtype, k, seed + 1, device=CUDA)
    bias = lin.randn((n,), dtype, seed + 2, device=CUDA)
    entry = linear_api.entry_of(packed, qs)
    for name in ("gluon-M100", "gluon-M300"):
        m, config = FORWARD[name]
        for b in (None, bias):
            for i in range(4):
                rows = slice(i * m, (i + 1) * m)
                got = nf4.linear(x[rows].clone(), copies[i % 3], qs, bias=b, config=config)
                want = lin.picked(wd.t(), perm[rows], scales[rows], torch.float32)
                want = (want + b.float() if b is not None else want).to(dtype)
                assert_bitexact(got, want, name=f"{name} bias={b is not None} call {i}")
            plan = entry.launches.get((m, dtype, b is not None, False, config, True))
            assert isinstance(plan, gluon_launch.Bound), (name, plan)
            assert (plan.finish is not None) == (name == "gluon-M100")


def test_gluon_gemm_compiled_binds_per_launch_facts(nf4h, lin):
    """Under torch.compile (no CUDA graph) the opaque op binds the Gluon GEMM's launches once per set of launch facts
    (nf4.linear.ops._PLANS) and rebinds each weight's packed bytes and state: two weights of one shape applied in
    turn, nested and not, give eager's bits on every call."""
    from torch._dynamo.utils import counters

    from nf4.linear import gemm_gluon, gluon_launch
    from nf4.linear import ops as linear_ops

    if not _hopper() or not gemm_gluon.AVAILABLE:
        pytest.skip("the Gluon GEMM runs on sm_90 with Triton's Gluon API")
    dtype, (n, k, m) = torch.bfloat16, (4096, 4096, 96)
    assert tuned(torch.cuda.get_device_name(), m, n=n, k=k).kernel == "gemm_gluon"
    for nested in (True, False):
        seed = nf4h.case_seed("gpu-gluon-plans", nested)
        first = nf4h.quantize((n, k), dtype, 64, nested, seed=seed, device=CUDA)
        second = nf4h.quantize((n, k), dtype, 64, nested, seed=seed + 1, device=CUDA)

        def fn(x, first=first, second=second):
            return nf4.linear(nf4.linear(x, *first), *second)

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        for i in range(4):
            x = lin.randn((m, k), dtype, seed + 2 + i, scale=0.05, device=CUDA)
            assert_bitexact(compiled(x), fn(x), name=f"gluon compiled, two weights, nested={nested}, call {i}")
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert any(isinstance(v, gluon_launch.Bound) for v in linear_ops._PLANS.values())
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gluon_gemm_compiled_and_graphed(nf4h, lin, dtype):
    """The Gluon GEMM (the table's at M = 96 on 4096 x 4096, sm_90) under torch.compile(fullgraph=True), where it
    runs inside the opaque op, and captured in a CUDA graph: the same bits as eager calls, no graph break."""
    from nf4.linear import gemm_gluon

    if not _hopper() or not gemm_gluon.AVAILABLE:
        pytest.skip("the Gluon GEMM runs on sm_90 with Triton's Gluon API")
    n, k, m = 4096, 4096, 96
    assert tuned(torch.cuda.get_device_name(), m, n=n, k=k).kernel == "gemm_gluon"
    packed, qs = nf4h.quantize((n, k), dtype, 64, True, seed=nf4h.case_seed("gpu-gluon-compile", dtype), device=CUDA)
    fn = _compiled_is_eager(lin, packed, qs, (m, k), dtype, "gluon compiled vs eager")
    static_x = lin.randn((m, k), dtype, 8, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x)
    for seed in (9, 10):
        x = lin.randn((m, k), dtype, seed, device=CUDA)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitexact(static_y, fn(x), name=f"gluon graph replay, input {seed}")
