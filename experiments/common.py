"""What the variant files share: the state's tensors, GPU-or-interpreter flags, one launch path.

`launch(kernel, grid, *args, ...)` is how every experiment kernel is launched. On a GPU it caches
the compiled kernel per specialisation (as `nf4.api` does), so that variants compare kernels and
not Triton's JIT dispatch (v50_jit_launch asks for the JIT on purpose). While `recording()` is
active nothing runs: launches are recorded, so that `experiments.sm75` can rebuild the exact
signature and constexprs of a launch on meta tensors and compile it offline.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import nf4.api
from nf4.kernel import _absmax_of_block, _mul, _nf4_level, _to_bf16_rne

_recorder: list | None = None
_compiled: dict = {}


@dataclass(frozen=True)
class State:
    """The tensors and sizes of a double-quantized NF4 QuantState."""

    absmax_u8: torch.Tensor  # uint8 [n_blocks]
    absmax2: torch.Tensor  # float32 [cdiv(n_blocks, 256)]
    code2: torch.Tensor  # float32 [256]
    offset: torch.Tensor  # float32 [1]
    code: torch.Tensor  # float32 [16] NF4 levels, on the device
    n: int
    blocksize: int

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.blocksize)


def state_of(packed: torch.Tensor, quant_state) -> State:
    """Unpack a double-quantized QuantState (the experiments only study double quantization)."""
    if not getattr(quant_state, "nested", False):
        raise ValueError("the experiments need a double-quantized state (compress_statistics=True)")
    n = math.prod(quant_state.shape)
    if n > 2**31 - 2**16:
        raise ValueError(f"{n} weights: the experiment kernels use 32-bit offsets (nf4.dequantize does not)")
    s2 = quant_state.state2
    return State(quant_state.absmax, s2.absmax, s2.code, quant_state.offset, nf4.api._code_table(packed.device), n,
                 quant_state.blocksize)


def interpreting(t: torch.Tensor) -> bool:
    """True when a launch on `t` runs in Triton's interpreter (never while recording for a compile)."""
    if _recorder is not None:
        return False
    return t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def flags(t: torch.Tensor, ftz: bool) -> tuple[bool, bool]:
    """(ASM, BF16_BITS) as nf4.api chooses them: PTX FTZ multiply and native bf16 rounding on a GPU."""
    interp = interpreting(t)
    return bool(ftz) and not interp, interp or nf4.api.BF16_BITS


def unit_plan(packed: torch.Tensor, n: int, tile_bytes: int, unit: int) -> tuple[bool, int, tuple]:
    """(VEC, n_units, grid) for kernels that load `unit` packed bytes per thread (4: words, 16: rows).

    Whole units take the vector path when the packed pointer is `unit`-byte aligned; one more
    program handles the last partial unit byte by byte. Unaligned inputs go byte by byte everywhere
    (tile_bytes bytes per program).
    """
    n_bytes = (n + 1) // 2
    if packed.data_ptr() % unit == 0:
        # Only units whose 2 * unit weights all exist: with odd n the last low nibble is padding,
        # and a unit holding it would write out[n].
        n_units = n // (2 * unit)
        return True, n_units, (triton.cdiv(n_units, tile_bytes // unit) + (1 if n % (2 * unit) else 0),)
    return False, 0, (triton.cdiv(n_bytes, tile_bytes),)


def _spec_key(kernel, args) -> tuple:
    """What Triton specialises a launch on: constexpr values, dtypes, 16-divisibility, == 1, int width."""
    key = []
    for param, arg in zip(kernel.params, args, strict=True):
        if param.is_constexpr:
            key.append(arg)
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, bool):
            key.append(("b", arg))
        elif isinstance(arg, int):
            key.append((arg % 16 == 0, arg == 1, -(2**31) <= arg < 2**31))
        else:
            key.append(type(arg).__name__)
    return tuple(key)


def launch(kernel, grid, *args, jit: bool = False, **options):
    """Launch `kernel[grid](*args, **options)` through a compiled-kernel cache; contraction off by default.

    options: num_warps (default 4), enable_fp_fusion (default False), any other launch option.
    jit=True goes through Triton's JIT dispatch on every call (what a plain `kernel[grid](...)` costs).
    """
    options = {"num_warps": 4, "enable_fp_fusion": False, **options}
    grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled kernel reads grid[0], grid[1], grid[2]
    if _recorder is not None:
        _recorder.append((kernel, grid, args, options))
        return
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if jit or first is None or interpreting(first):
        kernel[grid](*args, **options)
        return
    key = (kernel, first.device.index, tuple(sorted(options.items())), _spec_key(kernel, args))
    compiled = _compiled.get(key)
    if compiled is None:
        _compiled[key] = kernel[grid](*args, **options)
    else:
        compiled[grid](*args)


def _as_gpu_launch(kernel, args: tuple) -> tuple:
    """nf4.api.launch on meta tensors believes it is interpreting: give ASM and BF16_BITS their GPU values."""
    if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        return args
    names = [p.name for p in kernel.params]
    args = list(args)
    if "ASM" in names and "FTZ" in names:
        args[names.index("ASM")] = args[names.index("FTZ")]
    if "BF16_BITS" in names:
        args[names.index("BF16_BITS")] = nf4.api.BF16_BITS
    return tuple(args)


class _KernelRecorder:
    """Stands in for nf4.api's kernel while recording: `kernel[grid](*args, **options)` is recorded."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **options):
            _recorder.append((self.kernel, grid, _as_gpu_launch(self.kernel, args), options))

        return record


@contextlib.contextmanager
def recording():
    """Record launches instead of running them (experiments.common.launch and nf4.api.launch).

    Yields the list of (kernel, grid, args, options). nf4.api's compiled-kernel cache is swapped
    for an empty one meanwhile, so that its launch reaches the (recorded) kernel call. Nests.
    """
    global _recorder
    saved = _recorder, nf4.api.nf4_dequantize_kernel, nf4.api._compiled
    kernel = saved[1].kernel if isinstance(saved[1], _KernelRecorder) else saved[1]
    _recorder = []
    nf4.api.nf4_dequantize_kernel, nf4.api._compiled = _KernelRecorder(kernel), {}
    try:
        yield _recorder
    finally:
        _recorder, nf4.api.nf4_dequantize_kernel, nf4.api._compiled = saved


def launch_production(packed, quant_state, out, ftz, **meta):
    """nf4.api.launch (the production kernel, cached compiled launch) with experiment meta-parameters."""
    s = state_of(packed, quant_state)
    return nf4.api.launch(packed, s.absmax_u8, s.absmax2, s.code2, s.offset, out, s.n, s.blocksize, True, ftz,
                          **meta)


@triton.jit
def word_levels(word, code_ptr, TABLE_EVICT: tl.constexpr):
    """[R] uint32 words (4 packed bytes) -> [R, 8] float32 NF4 levels, gathered from the 16-entry table.

    Little-endian: byte j of the word is bits 8j..8j+7, and element 2j is its HIGH nibble.
    """
    k = tl.arange(0, 8)
    shift = ((k // 2) * 8 + 4 - (k % 2) * 4).to(tl.uint32)
    nib = ((word[:, None] >> shift[None, :]) & 0xF).to(tl.int32)
    return tl.load(code_ptr + nib, eviction_policy=TABLE_EVICT)


@triton.jit
def store_word8(out_ptr, base, word, absmax, code_ptr, mask, FTZ: tl.constexpr, ASM: tl.constexpr,
                BF16_BITS: tl.constexpr, TABLE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
                STORE_EVICT: tl.constexpr):
    """The 8 weights of each word [R] -> outputs base .. base + 7 ([R, 1] base; one 16-byte store in 16 bits)."""
    y = _mul(word_levels(word, code_ptr, TABLE_EVICT), absmax[:, None], FTZ, ASM)
    store_rounded(out_ptr, base + tl.arange(0, 8)[None, :], y, mask, BF16_BITS, STORE_CACHE, STORE_EVICT)


@triton.jit
def store_rounded(out_ptr, idx, y, mask, BF16_BITS: tl.constexpr, STORE_CACHE: tl.constexpr,
                  STORE_EVICT: tl.constexpr):
    # No default values on constexpr parameters: Triton 3.6 cannot compile a call that relies on one.
    """Round float32 `y` to the output dtype (RNE; integer ops for bf16 when BF16_BITS) and store it."""
    if BF16_BITS and out_ptr.dtype.element_ty == tl.bfloat16:
        y_out = _to_bf16_rne(y)
    else:
        y_out = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, y_out, mask=mask, cache_modifier=STORE_CACHE, eviction_policy=STORE_EVICT)


@triton.jit
def tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
               BLOCKSIZE: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr):
    """Packed bytes b, one by one, masked to n_bytes / n: the bytes after the last whole vector,
    and every byte when the packed pointer is not aligned for the vector load."""
    ok = b < n_bytes
    byte = tl.load(packed_ptr + b, mask=ok, other=0)
    absmax = _absmax_of_block((b * 2) // BLOCKSIZE, ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                              ASM)
    hi = _mul(_nf4_level((byte >> 4).to(tl.int32), code_ptr, 0), absmax, FTZ, ASM)
    lo = _mul(_nf4_level((byte & 0xF).to(tl.int32), code_ptr, 0), absmax, FTZ, ASM)
    y = tl.reshape(tl.join(hi, lo), (2 * b.shape[0],))  # element 2k = high nibble of byte k
    idx = tl.reshape(tl.join(b * 2, b * 2 + 1), (2 * b.shape[0],))
    store_rounded(out_ptr, idx, y, idx < n, BF16_BITS, "", "")

ARTIFACT_DIR = "results/inductor"  # where v60/v61 save inductor's generated code; the runner may change it
