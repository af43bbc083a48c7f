"""The fused NF4 linear op for the experiments: cases, inputs, operand oracle and call signature.

A case is `NxKxM[:fp16|bf16[:BLOCKSIZE]]`: a weight W of N x K (out_features x in_features; blocksize
64 by default, double-quantized by bitsandbytes from seeded random data, in x's dtype) and M rows
of x. A variant is called as `run(x, packed, quant_state, out, *, ftz)` and writes x @ W^T
([M, N], x's dtype) into `out`.

Exactness is judged on the operand (docs/FORMAT.md §9): a matmul's sum order is not defined, so
the checked x is made of signed power-of-two-scaled identity rows at random columns, and row i of
the output must be `scales[i] * W[:, cols[i]] + 0.0` rounded to x's dtype bit for bit (one exact
product plus exact zeros: the in-kernel decode is `nf4.dequantize(W).to(x.dtype)`). W comes from
`nf4.dequantize` on a GPU (ftz=True, what variants run with) and from
`reference.dequantize_nf4(ftz=True)` in the interpreter; both are tested bit-exact with each other.

Timing (GPU): the runner checks input set 0 and times rotating over all sets. Set 0 holds the
identity-row x; every other set holds a random x of the same shape (normal, in x's dtype) and its
own copy of the weight, so that the timed calls multiply ordinary data and L2 holds no weight
(rotation_count sets of at least 256 MiB in all: 9 sets for 14336x4096 at M = 1, one of them the
identity rows). GB/s and % of copy are over the byte floor (packed weight, absmax, state2, x and
the output); at large M the product is bound by flops, not bytes, and those columns say little.

`backward=True` (`experiments.ops.linear_backward`) builds the same for dY @ W: dY [M, N] made of
identity rows picking rows of W, expected `scales[i] * W[rows[i], :] + 0.0` ([M, K]).

The offline sm_75 compile (experiments.sm75) asks this module for `meta_inputs(out_dtype)` (a
14336x4096 weight, M = SM75_M) and `SM75_WEIGHT` (their description). Measured with Triton 3.9:
nf4_gemm_kernel (variants l10-l18, l21) compiles for sm_75 in fp16 and in bf16 alike, because Triton
lowers `tl.dot` to float32 FMAs there (no mma.sync in either dtype; a plain 64x64x32 `tl.dot` does the
same, and gets mma.sync on sm_80), so a T4 would run the tl.dot variants without tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verify import timing
from verify.cases import clone_state

from . import Op

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The weights of the challenge's layer shapes (Llama-3-8B MLP and attention), at M = 1, 16, 256 rows of x.
GPU_CASES = (*(f"{nk}x{m}:bf16" for nk in ("14336x4096", "4096x14336", "4096x4096") for m in (1, 16, 256)),
             "14336x4096x1024:bf16")
# Odd sizes: rows of W not a multiple of any tile (72, 40, 130), M of 1 (GEMV), 3 and 17 (tl.dot,
# a partial M tile), both dtypes, K of two and four absmax blocks.
INTERPRETER_CASES = ("72x128x1:bf16", "40x256x3:fp16", "130x128x17:bf16")
BACKWARD_GPU_CASES = tuple(f"{nk}x{m}:bf16" for nk in ("14336x4096", "4096x14336", "4096x4096") for m in (16, 256))
BACKWARD_INTERPRETER_CASES = ("72x128x3:bf16", "40x256x17:fp16", "130x128x1:bf16")
SCALE_OCTAVES = (-2, 3)  # x's identity rows are +-2^e, e in [-2, 3): exact products, no overflow


@dataclass(frozen=True)
class Case:
    """A product: weight N x K (blocksize, double-quantized), M rows of x, x's dtype (also W's)."""

    text: str
    n: int
    k: int
    m: int
    dtype: torch.dtype
    blocksize: int
    backward: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n, self.k, self.m)

    @property
    def numel(self) -> int:
        """Weights decoded per product (N * K)."""
        return self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Fewest bytes moved: packed weight, absmax, state2, x and the output."""
        size = torch.empty((), dtype=self.dtype).element_size()
        weight = timing.nf4_bytes(self.numel, self.blocksize, 0)
        return weight + self.m * (self.n + self.k) * size


def parse_case(text: str, backward: bool = False) -> Case:
    """'14336x4096x1:bf16' or '72x128x1:fp16:64' (blocksize, default 64) -> Case."""
    parts = text.split(":")
    dims = parts[0].split("x")
    if not 1 <= len(parts) <= 3 or len(dims) != 3 or (len(parts) > 1 and parts[1] not in DTYPES):
        raise ValueError(f"case {text!r}: expected NxKxM[:fp16|bf16[:BLOCKSIZE]]")
    n, k, m = (int(d) for d in dims)
    dtype = DTYPES[parts[1]] if len(parts) > 1 else torch.bfloat16
    return Case(text, n, k, m, dtype, int(parts[2]) if len(parts) > 2 else 64, backward)


def identity_rows(m: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[m, width] rows of the identity at random columns (each column once per `width` rows), each
    scaled by +-2^e (e in SCALE_OCTAVES)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.cat([torch.randperm(width, generator=g) for _ in range(-(-m // width))])[:m]
    scales = torch.exp2(torch.randint(*SCALE_OCTAVES, (m,), generator=g).double())
    scales = scales * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.zeros((m, width), dtype=torch.float64)
    x[torch.arange(m), cols] = scales
    return x.to(dtype)


def make_inputs(case: Case, device: str, copies: int, seed: int = 0) -> list[tuple]:
    """`copies` (x, packed, quant_state, out) sets of one bitsandbytes-quantized weight: set 0 with
    identity rows of x (checked), the others with random x of the same shape (timed)."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn((case.n, case.k), generator=gen, device=device, dtype=torch.float32) * 0.02
    packed, qs = F.quantize_4bit(w.to(case.dtype), blocksize=case.blocksize, compress_statistics=True,
                                 quant_type="nf4")
    del w
    width, n_out = (case.n, case.k) if case.backward else (case.k, case.n)
    x = identity_rows(case.m, width, case.dtype, seed + case.m * 7 + case.n).to(device)
    sets = [(x, packed, qs, torch.empty((case.m, n_out), dtype=case.dtype, device=device))]
    for _ in range(copies - 1):
        xr = torch.randn((case.m, width), generator=gen, device=device, dtype=torch.float32).to(case.dtype)
        sets.append((xr, packed.clone(), clone_state(qs), torch.empty((case.m, n_out), dtype=case.dtype,
                                                                       device=device)))
    return sets


def dequantized(packed, qs, gpu: bool) -> torch.Tensor:
    """W [N, K] in its dtype: nf4.dequantize on a GPU (ftz=True), the NumPy reference (ftz=True) without."""
    if gpu:
        import nf4

        return nf4.dequantize(packed, qs, ftz=True)
    from .dequant import expected_output

    return expected_output(packed, qs, gpu=False)


def expected_operand(x: torch.Tensor, wd: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """The output for identity-row x: row i is scale_i * (column (forward) or row (backward) of W) + 0.0,
    computed exactly in float64 and rounded once to x's dtype."""
    rows = torch.arange(x.shape[0], device=x.device)
    picked = x.abs().argmax(dim=1)
    scales = x[rows, picked].double()
    part = wd.double()[picked] if backward else wd.double()[:, picked].t()
    return (part * scales[:, None] + 0.0).to(x.dtype)  # + 0.0: the sum of exact zeros and -0.0 is +0.0


def _oracle(sets: list[tuple], gpu: bool, backward: bool = False) -> torch.Tensor:
    x, packed, qs, _ = sets[0]
    return expected_operand(x, dequantized(packed, qs, gpu), backward)


def _oracle_name(gpu: bool) -> str:
    w = "nf4.dequantize" if gpu else "reference.dequantize_nf4(ftz=True)"
    return f"operand: identity rows of x against {w}"


def _backward_oracle_name(gpu: bool) -> str:
    w = "nf4.dequantize" if gpu else "reference.dequantize_nf4(ftz=True)"
    return f"operand: identity rows of dY against rows of {w}"


# --- the offline sm_75 compile (experiments.sm75) -------------------------------------------------

SM75_NK = (14336, 4096)
SM75_M = 1  # nf4_gemm_kernel does not specialise on M; the GEMV's BLOCK_M is next_power_of_2(M)
SM75_BACKWARD_M = 16
SM75_WEIGHT = f"{SM75_NK[0]}x{SM75_NK[1]} (N x K), M = {SM75_M}, blocksize 64, double quant, ftz=True"
SM75_BACKWARD_WEIGHT = (f"dY @ W, W {SM75_NK[0]}x{SM75_NK[1]} (N x K), M = {SM75_BACKWARD_M}, blocksize 64, "
                        "double quant, ftz=True")


class _MetaState:
    """A QuantState stand-in on the meta device (nf4.linear remembers states by weak reference)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def meta_inputs(out_dtype, backward: bool = False) -> tuple:
    """(x, packed, quant_state, out) on the meta device: what a launcher needs to record its launches."""
    meta = torch.device("meta")
    n_rows, k = SM75_NK
    m = SM75_BACKWARD_M if backward else SM75_M
    numel, blocksize = n_rows * k, 64
    n_blocks = -(-numel // blocksize)
    state2 = _MetaState(absmax=torch.empty(-(-n_blocks // 256), dtype=torch.float32, device=meta),
                        code=torch.empty(256, dtype=torch.float32, device=meta), blocksize=256)
    qs = _MetaState(absmax=torch.empty(n_blocks, dtype=torch.uint8, device=meta), shape=torch.Size((n_rows, k)),
                    dtype=out_dtype, blocksize=blocksize, quant_type="nf4", nested=True, state2=state2,
                    offset=torch.empty((), dtype=torch.float32, device=meta),
                    code=torch.empty(16, dtype=torch.float32, device=meta))
    packed = torch.empty(numel // 2, 1, dtype=torch.uint8, device=meta)
    width, n_out = (n_rows, k) if backward else (k, n_rows)
    return (torch.empty((m, width), dtype=out_dtype, device=meta), packed, qs,
            torch.empty((m, n_out), dtype=out_dtype, device=meta))


def _op(backward: bool) -> Op:
    if backward:
        return Op(name="linear_backward", parse_case=lambda text: parse_case(text, backward=True),
                  make_inputs=make_inputs, oracle=lambda sets, gpu: _oracle(sets, gpu, backward=True),
                  call="run(dy, packed, quant_state, out, *, ftz) -> out = dy @ W",
                  gpu_cases=BACKWARD_GPU_CASES, interpreter_cases=BACKWARD_INTERPRETER_CASES,
                  oracle_name=_backward_oracle_name)
    return Op(name="linear", parse_case=parse_case, make_inputs=make_inputs, oracle=_oracle,
              call="run(x, packed, quant_state, out, *, ftz) -> out = x @ W^T", gpu_cases=GPU_CASES,
              interpreter_cases=INTERPRETER_CASES, oracle_name=_oracle_name)


OP = _op(backward=False)
