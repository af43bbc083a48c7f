"""What the variant files share: the state's tensors, GPU-or-interpreter flags, one launch path.

`launch(kernel, grid, *args, ...)` is how every experiment kernel is launched: through nf4's own
launch mechanism (`nf4.runtime`: the compiled kernel cached per specialisation), so that variants
compare kernels and not Triton's JIT dispatch (v50_jit_launch asks for the JIT on purpose). While
`recording()` is active nothing runs: launches are recorded (`nf4.runtime.recording`), so that
`experiments.sm75` can rebuild the exact signature and constexprs of a launch on meta tensors and
compile it offline. The device-side helpers are nf4's own (`nf4.device`); the ones below only
combine them into the shapes the variants share.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nf4 import DequantConfig, NF4Weight, runtime
from nf4.dequant import launch as dequant_launch
from nf4.device import absmax_of_block, high_nibble, low_nibble, mul, nf4_level, store_rounded, word_nibble_shift

PRODUCTION = DequantConfig()  # the defaults variants compare against (bf16_bits, evict_stream, ...)


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
    return State(quant_state.absmax, s2.absmax, s2.code, quant_state.offset, code_table(packed.device), n,
                 quant_state.blocksize)


def code_table(device: torch.device, codebook: int = 0) -> torch.Tensor:
    """The NF4 level table the production kernel reads on `device` (16 float32; 256 pairs for codebook 2)."""
    return runtime.level_table(device, pairs=codebook == 2)


def interpreting(t: torch.Tensor) -> bool:
    """True when a launch on `t` runs in Triton's interpreter (never while recording for a compile)."""
    return not runtime.is_recording() and runtime.interpreting(t.device)


def flags(t: torch.Tensor, ftz: bool) -> tuple[bool, bool]:
    """(ASM, BF16_BITS) as nf4's launch chooses them: PTX FTZ multiply and native bf16 rounding on a GPU."""
    interp = interpreting(t)
    return bool(ftz) and not interp, interp or PRODUCTION.bf16_bits


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


def launch(kernel, grid, *args, jit: bool = False, **options):
    """Launch `kernel[grid](*args, **options)` through nf4's compiled-kernel cache; contraction off by default.

    options: num_warps (default 4), enable_fp_fusion (default False), any other launch option.
    jit=True goes through Triton's JIT dispatch on every call (what a plain `kernel[grid](...)` costs).
    """
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device = first.device if first is not None else torch.device("cpu")
    runtime.launch(kernel, grid, dict(zip(kernel.arg_names, _as_gpu_launch(kernel, args), strict=True)),
                   device=device, jit=jit or first is None, **options)


def _as_gpu_launch(kernel, args: tuple) -> tuple:
    """A launch on meta tensors (recorded for the offline compile) believes it is interpreting: give
    ASM and BF16_BITS their GPU values."""
    if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        return args
    names = list(kernel.arg_names)
    args = list(args)
    if "ASM" in names and "FTZ" in names:
        args[names.index("ASM")] = args[names.index("FTZ")]
    if "BF16_BITS" in names:
        args[names.index("BF16_BITS")] = PRODUCTION.bf16_bits
    return tuple(args)


@contextlib.contextmanager
def recording():
    """Record launches instead of running them (this module's `launch` and nf4's). Yields a list that
    holds, once the block exits, each launch as (kernel, grid, args, options), with a meta-tensor
    launch's ASM and BF16_BITS at their GPU values."""
    calls: list = []
    with runtime.recording() as raw:
        try:
            yield calls
        finally:
            calls.extend((r.fn, r.grid, _as_gpu_launch(r.fn, r.args), r.options) for r in raw)


@contextlib.contextmanager
def artifact_dir(path: str | None):
    """Save v60/v61's inductor code under `path` inside the block (None: the default, ARTIFACT_DIR)."""
    _artifact_dirs.append(path or ARTIFACT_DIR)
    try:
        yield
    finally:
        _artifact_dirs.pop()


def current_artifact_dir() -> str:
    """Where v60/v61 save inductor's generated code now."""
    return _artifact_dirs[-1] if _artifact_dirs else ARTIFACT_DIR


def launch_production(packed, quant_state, out, ftz, **changes):
    """The production kernel through nf4's own launch (cached compiled launch): the tuned config for
    this weight, with the DequantConfig fields in `changes` changed (the experiment's one change)."""
    w = weight_of(packed, quant_state)
    config = None
    if changes:
        config = dequant_launch.tuned_config(out.device, w.n * out.element_size()).with_(**changes)
    return dequant_launch.launch(w, out, ftz, config)[0]


def weight_of(packed: torch.Tensor, quant_state) -> NF4Weight:
    """The double-quantized weight as nf4.dequant.launch takes it, with `state_of`'s checks only, not
    nf4.dequantize's (the variants' inputs are well formed; v51 times the launch alone)."""
    if not getattr(quant_state, "nested", False):
        raise ValueError("the experiments need a double-quantized state (compress_statistics=True)")
    shape = tuple(quant_state.shape)
    if math.prod(shape) > 2**31 - 2**16:
        raise ValueError(f"{math.prod(shape)} weights: the experiment kernels use 32-bit offsets (nf4.dequantize "
                         "does not)")
    s2 = quant_state.state2
    return NF4Weight(packed, quant_state.absmax, s2.absmax, s2.code, quant_state.offset, shape, quant_state.blocksize,
                     quant_state.dtype, True)


@triton.jit
def word_levels(word, code_ptr, TABLE_EVICT: tl.constexpr):
    """[R] uint32 words (4 packed bytes) -> [R, 8] float32 NF4 levels, gathered from the 16-entry table.

    Little-endian: byte j of the word is bits 8j..8j+7, and element 2j is its HIGH nibble.
    """
    shift = word_nibble_shift(tl.arange(0, 8))
    nib = ((word[:, None] >> shift[None, :]) & 0xF).to(tl.int32)
    return tl.load(code_ptr + nib, eviction_policy=TABLE_EVICT)


@triton.jit
def store_word8(out_ptr, base, word, absmax, code_ptr, mask, FTZ: tl.constexpr, ASM: tl.constexpr,
                BF16_BITS: tl.constexpr, TABLE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
                STORE_EVICT: tl.constexpr):
    """The 8 weights of each word [R] -> outputs base .. base + 7 ([R, 1] base; one 16-byte store in 16 bits)."""
    y = mul(word_levels(word, code_ptr, TABLE_EVICT), absmax[:, None], FTZ, ASM)
    store_rounded(out_ptr, base + tl.arange(0, 8)[None, :], y, mask, BF16_BITS, STORE_CACHE, STORE_EVICT)


@triton.jit
def tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
               BLOCKSIZE: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr):
    """Packed bytes b, one by one, masked to n_bytes / n: the bytes after the last whole vector,
    and every byte when the packed pointer is not aligned for the vector load."""
    ok = b < n_bytes
    byte = tl.load(packed_ptr + b, mask=ok, other=0)
    absmax = absmax_of_block((b * 2) // BLOCKSIZE, ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, FTZ,
                             ASM)
    hi = mul(nf4_level(high_nibble(byte), code_ptr, 0), absmax, FTZ, ASM)
    lo = mul(nf4_level(low_nibble(byte), code_ptr, 0), absmax, FTZ, ASM)
    y = tl.reshape(tl.join(hi, lo), (2 * b.shape[0],))  # element 2k = high nibble of byte k
    idx = tl.reshape(tl.join(b * 2, b * 2 + 1), (2 * b.shape[0],))
    store_rounded(out_ptr, idx, y, idx < n, BF16_BITS, "", "")

ARTIFACT_DIR = "results/inductor"  # where v60/v61 save inductor's generated code by default
_artifact_dirs: list[str] = []
# Saved generated code is data, not source: a suffix that linters and import tools leave alone.
GENERATED_CODE_SUFFIX = ".py.txt"
