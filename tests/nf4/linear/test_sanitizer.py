"""compute-sanitizer memcheck (and racecheck) over nf4.linear's fused kernels on small odd cases (GPU only).

The tensor-core and word GEMVs read with unmasked 16-byte and 4-byte vector loads, clamping rows past
the weight (and rows of x past M) to the last one instead of masking; this checks that nothing is read
or written outside the tensors. PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor an allocation of
its own, so a read past one is a read outside an allocation. The cases: N odd and not a multiple of
any tile, K = 384 (not a whole number of the 32-byte-lane steps: the fallbacks) and 512, blocksize 64
and 128, M = 1, 3, 5, 19, 32, float16 and bfloat16, double quantization on and off, split-K auto and
1, warps splitting K inside a program (warps_k 4 and 8), the word tl.dot kernel (split-K 1 and 3; 4 and 8
warps), through the first call and the bound plan. racecheck covers the shared memory those warps add their sums
through. x is made of identity rows, so each output must equal the
dequantized weight bit for bit: the runs the sanitizer sees are exact ones. Set NF4_SANITIZER_LOG to a
folder to keep the tool's output there.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHILD = r"""
import torch
import bitsandbytes.functional as F
import nf4
from nf4.linear import LinearConfig
from nf4.linear.tuned import GEMV_MMA_WK2, GEMV_TABLE
from verify.exact import assert_bitexact

# the tensor-core GEMV of 4 warps and 32-byte lanes (a preset the tuned table no longer names)
GEMV_MMA = LinearConfig(kernel="gemv_mma", block_r=64, num_warps=4, step_bytes=32, programs_per_sm=12)

torch.manual_seed(11)
# (config, the largest M it takes here); None: the tuned rows (GEMV_MMA_WK to 2 (on the H100 and the H200
# GEMV_MMA_WK16 on rows of 192 bytes; elsewhere GEMV_MMA_WK4 on these short rows), GEMV_MMA_WK16 to 8, GEMV_MMA16 to
# 16, GEMV_MMA32 to 32 on these small weights)
configs = [(None, 32), (GEMV_TABLE, 4), (GEMV_MMA.with_(split_k=1), 4),
           (LinearConfig(kernel="gemv_mma", block_r=32, num_warps=2, step_bytes=16, split_k=3), 32),
           # warps that split K inside a program (their sums through shared memory; steps past the range read zeros)
           (GEMV_MMA.with_(warps_k=4, block_r=16, split_k=1), 4),
           (LinearConfig(kernel="gemv_mma", block_r=16, num_warps=8, warps_k=8, step_bytes=16, split_k=2), 32),
           # 16 warps in 8 pairs that split K (GEMV_MMA_WK2, 14336x4096's row at M <= 4): 128 rows a program,
           # most of them past these weights' last row
           (GEMV_MMA_WK2, 4),
           # the word tl.dot kernel (unmasked word loads from rows clamped to the weight), alone and split-K 3
           (LinearConfig(kernel="gemm_word", block_m=32, block_n=128, swap=True, num_stages=3, split_k=1), 32),
           (LinearConfig(kernel="gemm_word", block_m=16, block_n=128, swap=True, num_stages=3, split_k=3), 32),
           # 256 rows of x per tile over 8 warps (WORD_GEMM256's shape), split-K 2
           (LinearConfig(kernel="gemm_word", block_m=256, block_n=128, num_warps=8, swap=True, num_stages=3,
                         split_k=2), 32),
           # 128 rows over 8 warps in one launch (WORD_GEMM128_W8's shape: its 16-bit store from the tl.dot loop
           # said to run at least once)
           (LinearConfig(kernel="gemm_word", block_m=128, block_n=128, block_k=64, num_warps=8, swap=True,
                         num_stages=3, split_k=1), 32)]
n_checked = 0
for n, k in ((45, 384), (333, 512)):
    for blocksize in (64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for dq in (True, False):
                w = (torch.randn(n, k, device="cuda") * 0.05).to(dtype)
                packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=dq, quant_type="nf4")
                wd = nf4.dequantize(packed, qs)
                for m in (1, 3, 5, 19, 32):
                    x = torch.zeros(m, k, device="cuda", dtype=dtype)
                    cols = torch.randperm(k, device="cuda")[:m]
                    x[torch.arange(m, device="cuda"), cols] = 1.0
                    want = wd[:, cols].t() + 0.0
                    for config, max_m in configs:
                        if m > max_m:
                            continue
                        for call in range(2):  # the first call, then the plan
                            got = nf4.linear(x, packed, qs, config=config)
                            assert_bitexact(got, want, name=f"{n}x{k} bs{blocksize} {dtype} dq={dq} M={m} {config}")
                        n_checked += 1
torch.cuda.synchronize()
print(f"bit-exact: {n_checked} cases")
"""


def test_memcheck_is_clean(nf4h):
    # nf4's kernels only (bitsandbytes' quantize kernels are not ours); every tensor its own allocation
    returncode, stdout, log = nf4h.run_sanitizer("memcheck", CHILD, "nf4_", "sanitizer_linear_memcheck.log",
                                                 env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert "bit-exact:" in stdout, log[-4000:]
    assert returncode == 0, log[-4000:]


def test_racecheck_is_clean(nf4h):
    # the warps_k configs add their warps' sums through shared memory (Triton's reduction)
    returncode, stdout, log = nf4h.run_sanitizer("racecheck", CHILD, "nf4_", "sanitizer_linear_racecheck.log",
                                                 env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert "bit-exact:" in stdout, log[-4000:]
    assert returncode == 0, log[-4000:]
