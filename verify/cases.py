"""The seeded case grid of the bit-exact matrix, and how each case's inputs are built.

A case is quantized by bitsandbytes itself on the device under test (then crafted where the case
says so), so every implementation reads exactly what bitsandbytes would hand it. The expected
output is the NumPy reference: `ftz=False` on a CPU (bitsandbytes' CPU routes keep IEEE
subnormals), `ftz=True` on CUDA (bitsandbytes' CUDA build flushes them).

Groups:
  shapes       odd, 1-D, 3-D and tail-block shapes x every blocksize x fp16/bf16/fp32 x DQ on/off
  blocksizes   1-D, odd numel, > 256 blocks (two state2 scales) for blocksizes <= 512, tail block
  all-bytes    packed bytes overwritten with all 256 values, permuted (every nibble pair)
  out-dtype    quantized in one dtype, dequantized to another (quant_state.dtype overridden)
  row-packed   packed tensor reshaped to (1, k): bitsandbytes returns the transpose
  storage      quant_storage bf16/fp16/fp32, including odd byte counts bitsandbytes' CUDA
               quantize truncates (see verify.known)
  tiny         crafted absmax2/offset (or absmax) so products are float32 subnormals
  huge         absmax > 65504: fp16 overflows to inf (quantized large data, crafted states)
"""

from __future__ import annotations

import copy
import itertools
import zlib
from dataclasses import dataclass, field
from math import prod

import numpy as np
import torch

from reference.format import BLOCKSIZES

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8"}
GROUPS = ("shapes", "blocksizes", "all-bytes", "out-dtype", "row-packed", "storage", "tiny", "huge")

SHAPES = [(7,), (100,), (1, 333), (3, 5, 67), (9, 41, 341), (64, 64), (2, 4100)]
BIG = (9, 41, 341)


@dataclass(frozen=True)
class Case:
    """One input of the matrix. `dtype` is what was quantized, `out_dtype` what is asked for."""

    group: str
    shape: tuple[int, ...]
    blocksize: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    double_quant: bool
    storage: torch.dtype = torch.uint8
    variant: str = "random"  # random | all-bytes | tiny | huge-data | huge-state
    row_packed: bool = False
    quick: bool = False
    compile: bool = False  # also run the torch.compile peers (each case is one more compilation)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def id(self) -> str:
        parts = [self.group, "x".join(map(str, self.shape)), f"bs{self.blocksize}",
                 f"{SHORT[self.dtype]}->{SHORT[self.out_dtype]}", "dq" if self.double_quant else "nodq"]
        if self.storage != torch.uint8:
            parts.append(f"storage-{SHORT[self.storage]}")
        if self.variant != "random":
            parts.append(self.variant)
        if self.row_packed:
            parts.append("row")
        return "/".join(parts)

    @property
    def bytes_needed(self) -> int:
        return (self.numel + 1) // 2

    @property
    def cuda_truncates(self) -> bool:
        """bitsandbytes' CUDA quantize_4bit allocates (n + 1) // (2 * itemsize) storage elements."""
        return self.storage.itemsize > 1 and self.bytes_needed % self.storage.itemsize != 0


def seed_of(*key) -> int:
    """A stable seed from a case's parameters (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


# --- the grid -----------------------------------------------------------------------------------


def _shapes_group() -> list[Case]:
    cases = []
    quick_bs = {(7,): (32, 4096), (100,): (64,), (1, 333): (64, 4096), (3, 5, 67): (32, 128), BIG: (64,),
                (64, 64): (128, 256), (2, 4100): (64, 2048)}
    for shape, bs, dt, dq in itertools.product(SHAPES, BLOCKSIZES, DTYPES, (True, False)):
        quick = bs in quick_bs[shape] and (dq or dt == torch.bfloat16)
        if shape == BIG:
            quick = quick and dt == torch.float16 and dq
        compile_ = dq and ((bs == 64 and shape in ((1, 333), BIG)) or
                           (bs == 4096 and shape == (3, 5, 67) and dt == torch.float16))
        cases.append(Case("shapes", shape, bs, dt, dt, dq, quick=quick, compile=compile_))
    return cases


def blocksizes_shape(blocksize: int) -> tuple[int]:
    """Odd numel, a tail block of blocksize // 2 + 1, > 256 blocks (two state2 scales) up to blocksize 512."""
    n_blocks = 300 if blocksize <= 512 else 40
    return ((n_blocks - 1) * blocksize + blocksize // 2 + 1,)


def _blocksizes_group() -> list[Case]:
    cases = []
    for bs, dt, dq in itertools.product(BLOCKSIZES, DTYPES, (True, False)):
        quick = bs in (32, 64, 1024) and dq and dt == (torch.bfloat16 if bs != 64 else torch.float16)
        cases.append(Case("blocksizes", blocksizes_shape(bs), bs, dt, dt, dq, quick=quick,
                          compile=dq and dt == torch.bfloat16 and bs in (64, 256)))
    return cases


def _all_bytes_group() -> list[Case]:
    cases = []
    for shape, bs, dt, dq in itertools.product([(33, 520), (5, 1031)], BLOCKSIZES, DTYPES, (True, False)):
        quick = shape == (33, 520) and (dq or bs == 64) and (dt == DTYPES[BLOCKSIZES.index(bs) % 3] or bs == 64)
        cases.append(Case("all-bytes", shape, bs, dt, dt, dq, variant="all-bytes", quick=quick,
                          compile=dq and bs == 64 and shape == (33, 520)))
    return cases


def _out_dtype_group() -> list[Case]:
    return [Case("out-dtype", (96, 200), 64, a, b, dq, quick=dq, compile=dq and b == torch.float32)
            for a, b in itertools.product(DTYPES, DTYPES) if a != b for dq in (True, False)]


def _row_packed_group() -> list[Case]:
    return [Case("row-packed", shape, 64, dt, dt, dq, row_packed=True, quick=dt == torch.bfloat16,
                 compile=dq and dt == torch.float16 and shape == (40, 96))
            for shape, dt, dq in itertools.product([(40, 96), (7,), (1, 333)], DTYPES, (True, False))]


def _storage_group() -> list[Case]:
    cases = []
    for storage, shape, dq in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                                [(7,), (33, 96), (5, 4099)], (True, False)):
        dt = torch.bfloat16 if storage == torch.bfloat16 else torch.float16
        cases.append(Case("storage", shape, 64, dt, dt, dq, storage=storage, quick=shape == (33, 96) and dq,
                          compile=dq and shape == (33, 96) and storage == torch.bfloat16))
    # Odd byte counts: bitsandbytes' CUDA quantize_4bit truncates them (known defect bnb-cuda-odd-storage).
    for storage, shape, dq in itertools.product((torch.bfloat16, torch.float32), [(3, 5, 67), BIG], (True, False)):
        cases.append(Case("storage", shape, 64, torch.bfloat16, torch.bfloat16, dq, storage=storage,
                          quick=shape == (3, 5, 67) and storage == torch.bfloat16))
    return cases


def _tiny_group() -> list[Case]:
    shapes = [((300 * 32 + 7,), 32), ((4, 64), 64), ((4, 42), 64), ((4, 63), 64)]
    return [Case("tiny", shape, bs, torch.float32, dt, dq, variant="tiny",
                 quick=shape != (300 * 32 + 7,) or dt == torch.bfloat16,
                 compile=dq and shape == (4, 64) and dt == torch.float32)
            for (shape, bs), dt, dq in itertools.product(shapes, DTYPES, (True, False))]


def _huge_group() -> list[Case]:
    return [Case("huge", shape, 64, torch.float32, dt, dq, variant=variant,
                 quick=shape == (33, 96) and (variant == "huge-state" or dt == torch.float16),
                 compile=dq and shape == (33, 96) and dt == torch.float16)
            for variant, shape, dt, dq in itertools.product(("huge-data", "huge-state"), [(33, 96), (4, 63)], DTYPES,
                                                            (True, False))]


_BUILDERS = {"shapes": _shapes_group, "blocksizes": _blocksizes_group, "all-bytes": _all_bytes_group,
             "out-dtype": _out_dtype_group, "row-packed": _row_packed_group, "storage": _storage_group,
             "tiny": _tiny_group, "huge": _huge_group}


def grid(*, quick: bool = False, groups=None) -> list[Case]:
    """The cases of the matrix, in a fixed order; `quick` keeps the CI subset."""
    groups = GROUPS if groups is None else tuple(groups)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown case groups {sorted(unknown)}; known: {GROUPS}")
    cases = [c for g in groups for c in _BUILDERS[g]()]
    if quick:
        cases = [c for c in cases if c.quick]
    # The quick subset first (every group early, should a time budget cut the run short); within
    # each part truncated storage last: bitsandbytes reads past the end of those tensors on CUDA.
    return sorted(cases, key=lambda c: (not c.quick, c.cuda_truncates))


# --- building the inputs ------------------------------------------------------------------------


@dataclass
class Built:
    """A case's inputs on the device, and what the reference reads (the same, unless truncated)."""

    case: Case
    device: str
    packed: torch.Tensor
    state: object  # bitsandbytes.functional.QuantState
    ref_packed: torch.Tensor
    ref_state: object
    truncated: bool = False
    notes: dict = field(default_factory=dict)


def make_weights(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random weights with magnitudes spread over a few octaves and some exact zeros (CPU, float32 math)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    x = x * torch.exp2(torch.randint(-4, 5, shape, generator=g).float()) * scale
    x.view(-1)[::13] = 0.0
    return x.to(dtype)


def clone_state(state, **changes):
    """A new QuantState whose tensors (and state2) are clones; `changes` replace attributes after."""
    new = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(new, name, value.clone())
        elif type(value).__name__ == "QuantState":
            setattr(new, name, clone_state(value))
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def _quantize(case: Case, device: str, storage: torch.dtype):
    import bitsandbytes.functional as F

    scale = 3e5 if case.variant == "huge-data" else 1.0
    x = make_weights(case.shape, case.dtype, seed_of(case.shape, case.blocksize, case.dtype, case.variant), scale)
    return F.quantize_4bit(x.to(device), blocksize=case.blocksize, compress_statistics=case.double_quant,
                           quant_type="nf4", quant_storage=storage)


def _cuda_layout(packed_u8: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """The packed tensor bitsandbytes' CUDA quantize_4bit returns for `storage`: (n + 1) // (2 * itemsize)
    elements. For an odd byte count that drops the last bytes (the CPU route cannot view them at all)."""
    elements = packed_u8.numel() // storage.itemsize
    return packed_u8.reshape(-1)[: elements * storage.itemsize].view(storage).reshape(-1, 1)


def _all_bytes(packed: torch.Tensor, seed: int) -> None:
    """Overwrite the packed bytes with every byte value, repeated and permuted (in place)."""
    flat = packed.view(torch.uint8).reshape(-1)
    reps = -(-flat.numel() // 256)
    rng = np.random.default_rng(seed)
    values = np.concatenate([rng.permutation(256) for _ in range(reps)])[: flat.numel()].astype(np.uint8)
    flat.copy_(torch.from_numpy(values).to(flat.device))


def tiny_state(state, seed: int):
    """A copy of `state` whose scales sit near 2**-126, so products land among the float32 subnormals.

    With double quantization state2.absmax mixes normal and subnormal scales and the offset is
    tiny, so `code2 * absmax2`, `+ offset` and `NF4 * absmax` are all subnormal somewhere;
    without it the float32 absmax spans 1e-40 .. 1e-37.
    """
    device = state.absmax.device
    if state.nested:
        n2 = state.state2.absmax.numel()
        absmax2 = torch.tensor([3e-38, 9e-39, 2.5e-38, 1.5e-39] * n2, dtype=torch.float32)[:n2]
        state2 = clone_state(state.state2, absmax=absmax2.to(device))
        offset = torch.tensor(1.25e-38, dtype=torch.float32, device=device)
        return clone_state(state, state2=state2, offset=offset)
    g = torch.Generator().manual_seed(seed)
    exponent = torch.empty(state.absmax.numel(), dtype=torch.float64).uniform_(-40, -37, generator=g)
    return clone_state(state, absmax=torch.pow(10.0, exponent).float().to(device))


def huge_state(state, seed: int):
    """A copy of `state` with absmax between 1e5 and 1e38 (finite float32, far above fp16's 65504)."""
    device = state.absmax.device
    if state.nested:
        n2 = state.state2.absmax.numel()
        absmax2 = torch.tensor([1e36, 7e5, 3e20, 1e37] * n2, dtype=torch.float32)[:n2]
        state2 = clone_state(state.state2, absmax=absmax2.to(device))
        offset = torch.tensor(2e36, dtype=torch.float32, device=device)
        return clone_state(state, state2=state2, offset=offset)
    g = torch.Generator().manual_seed(seed)
    exponent = torch.empty(state.absmax.numel(), dtype=torch.float64).uniform_(5, 38, generator=g)
    return clone_state(state, absmax=torch.pow(10.0, exponent).float().to(device))


def build(case: Case, device: str) -> Built:
    """Quantize the case's weights with bitsandbytes on `device`, then craft what the case asks for."""
    seed = seed_of("craft", case.id)
    notes = {}
    truncated = False
    if case.storage == torch.uint8 or not (case.cuda_truncates and device == "cpu"):
        packed, state = _quantize(case, device, case.storage)
    else:  # the CPU route raises on an odd byte count; build what the CUDA route returns
        packed_u8, state = _quantize(case, device, torch.uint8)
        packed = _cuda_layout(packed_u8, case.storage)
        notes["storage_layout"] = "built as bitsandbytes' CUDA quantize_4bit lays it out (CPU cannot)"
    ref_packed, ref_state = packed, state
    have = packed.numel() * packed.element_size()
    if have < case.bytes_needed:
        truncated = True
        ref_packed, ref_state = _quantize(case, device, torch.uint8)
        prefix = ref_packed.reshape(-1)[:have].cpu()
        stored = packed.reshape(-1).view(torch.uint8).cpu()
        notes.update(packed_bytes=have, bytes_needed=case.bytes_needed,
                     prefix_equals_uint8_quantization=bool(torch.equal(prefix, stored)))
    if case.variant == "all-bytes":
        _all_bytes(packed, seed)
    elif case.variant == "tiny":
        state = tiny_state(state, seed)
    elif case.variant == "huge-state":
        state = huge_state(state, seed)
    if not truncated:
        ref_packed, ref_state = packed, state
    state.dtype = case.out_dtype
    ref_state.dtype = case.out_dtype
    if case.row_packed:
        packed = packed.reshape(1, -1)
        ref_packed = ref_packed.reshape(1, -1)
    return Built(case, device, packed, state, ref_packed, ref_state, truncated, notes)
