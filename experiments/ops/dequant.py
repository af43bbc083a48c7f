"""The dequantize op for the experiments: cases, inputs, oracle and call signature of its variants.

A case is `ROWSxCOLS[:fp16|bf16|fp32[:BLOCKSIZE]]` (blocksize 64 by default; double quantization
always on; weights quantized by bitsandbytes from seeded random data). A variant is called as
`run(packed, quant_state, out, *, ftz)` and writes the weight into `out`. The oracle is
bitsandbytes' CUDA `dequantize_4bit` on a GPU (flush-to-zero semantics, so variants run with
ftz=True), else `reference.dequantize_nf4(..., ftz=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verify import timing
from verify.cases import clone_state

from . import Op

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GPU_CASES = ("8192x2048:fp16", "4096x1024:bf16", "14336x4096:bf16")  # the challenge configs' weights (bs 64)
GPU_BIG_CASES = ("28672x8192:bf16",)  # also run for the production kernel's chain (PRODUCTION_ROOT and below)
PRODUCTION_ROOT = "v50_jit_launch"
# Odd numel, a tail after the last whole word and row; 3x2905 at blocksize 32 spans 273 blocks (two state2 scales).
INTERPRETER_CASES = ("37x129:fp16", "37x129:bf16", "3x2905:fp16:32", "3x2905:bf16:32")


@dataclass(frozen=True)
class Case:
    """A weight to dequantize: shape, output dtype, blocksize (double quantization on)."""

    text: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def min_bytes(self) -> int:
        """Fewest bytes moved: packed weights, absmax, state2, and the output."""
        return timing.nf4_bytes(self.numel, self.blocksize, torch.empty((), dtype=self.dtype).element_size())


def parse_case(text: str) -> Case:
    """'8192x2048:fp16' or '3x2905:bf16:32' (blocksize, default 64) -> Case."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or (len(parts) > 1 and parts[1] not in DTYPES):
        raise ValueError(f"case {text!r}: expected ROWSxCOLS[:fp16|bf16|fp32[:BLOCKSIZE]]")
    shape = tuple(int(d) for d in parts[0].split("x"))
    dtype = DTYPES[parts[1]] if len(parts) > 1 else torch.float16
    return Case(text, shape, dtype, int(parts[2]) if len(parts) > 2 else 64)


def make_inputs(case: Case, device: str, copies: int, seed: int = 0) -> list[tuple]:
    """`copies` independent (packed, quant_state, out) sets of one bitsandbytes-quantized random weight."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(case.shape, generator=gen, device=device, dtype=torch.float32)
    x *= torch.exp2(torch.randint(-4, 5, case.shape, generator=gen, device=device).float())  # a few octaves
    x.view(-1)[::13] = 0.0
    packed, qs = F.quantize_4bit(x.to(case.dtype), blocksize=case.blocksize, compress_statistics=True,
                                 quant_type="nf4")
    del x
    sets = [(packed, qs, torch.empty(case.shape, dtype=case.dtype, device=device))]
    for _ in range(copies - 1):
        sets.append((packed.clone(), clone_state(qs), torch.empty(case.shape, dtype=case.dtype, device=device)))
    return sets


def expected_output(packed, qs, gpu: bool) -> torch.Tensor:
    """The oracle: bitsandbytes' CUDA dequantize_4bit on a GPU, else the NumPy reference with ftz=True."""
    if gpu:
        import bitsandbytes.functional as F

        return F.dequantize_4bit(packed, qs, quant_type="nf4")
    import numpy as np

    import reference

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[qs.dtype]
    arr = reference.dequantize_nf4(reference.from_bnb(packed, qs), name, ftz=True)
    t = torch.from_numpy(np.ascontiguousarray(arr))
    t = t.view(torch.int16).view(torch.bfloat16) if qs.dtype == torch.bfloat16 else t
    return t.reshape(qs.shape)


def _oracle_name(gpu: bool) -> str:
    return "bitsandbytes CUDA dequantize_4bit" if gpu else "reference.dequantize_nf4(ftz=True)"


def _oracle(sets: list[tuple], gpu: bool) -> torch.Tensor:
    packed, qs, _ = sets[0]
    return expected_output(packed, qs, gpu)


OP = Op(name="dequant", parse_case=parse_case, make_inputs=make_inputs, oracle=_oracle,
        call="run(packed, quant_state, out, *, ftz) -> out", gpu_cases=GPU_CASES,
        interpreter_cases=INTERPRETER_CASES, big_cases=GPU_BIG_CASES, big_root=PRODUCTION_ROOT,
        oracle_name=_oracle_name)
