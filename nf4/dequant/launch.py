"""The dequantize kernel's launch: kernel choice by name and argument building, on a checked NF4Weight.

`kernel_launch` builds (kernel, grid, args, options) once, for `launch` (eager, through nf4.runtime)
and for nf4.dequant.ops (torch.compile, through `wrap_triton`).
"""

from __future__ import annotations

import triton

from .. import runtime
from ..weight import NF4Weight
from .config import DequantConfig
from .kernel import nf4_dequantize_kernel
from .tuned import tuned

KERNELS = {"dequantize": nf4_dequantize_kernel}  # DequantConfig.kernel -> the @triton.jit function
_INT32_LIMIT = 2**31 - 1


def tuned_config(device, out_bytes: int) -> DequantConfig:
    """The tuned table's config for an output of `out_bytes` bytes on `device` (the default of `launch`)."""
    return tuned(runtime.device_name(device), out_bytes)


def kernel_launch(w: NF4Weight, out, ftz: bool, config: DequantConfig, *, vec: bool, fusion_proof: bool = False,
                  code=None, dummy=None) -> tuple:
    """The kernel's launch on a checked weight into `out` (contiguous, w.n elements) as (kernel, grid, args,
    options).

    vec: the packed pointer is 4-byte aligned (the 32-bit word path). fusion_proof: the IEEE product
    (ftz off) in PTX too, like the flushing one, so that no compile option can contract it into an
    FMA; Inductor compiles the kernels handed to it with contraction on and has no switch to turn
    it off, so nf4.dequant.ops asks for this, and options then carry num_warps only. code, dummy: the level
    table of config.codebook and the stand-in for absent double-quantization tensors (the ops pass
    their inputs; looked up otherwise).
    """
    device = w.device
    n = w.n
    interpreting = runtime.interpreting(device)
    tile_bytes, num_warps = config.tile_bytes, config.num_warps
    persist = bool(config.programs_per_sm)
    n_bytes = (n + 1) // 2
    if vec:
        tile = max(1, tile_bytes // 4)  # words per program
        # Only words whose 8 weights all exist: with odd n the last byte's low nibble is padding,
        # and a word holding it would write out[n].
        n_words = n // 8
        if persist:
            programs = config.interpret_programs if interpreting else config.programs_per_sm * runtime.sm_count(device)
            grid = (max(1, min(programs, triton.cdiv(n_words, tile))),)
        else:
            grid = (triton.cdiv(n_words, tile) + (1 if n % 8 else 0),)
    else:
        tile = max(1, tile_bytes)  # bytes per program
        n_words = 0
        grid = (triton.cdiv(n_bytes, tile),)
    index_64 = n + tile_bytes * 2 + 64 > _INT32_LIMIT
    if dummy is None:
        dummy = runtime.stand_in(device)
    if code is None:
        code = runtime.level_table(device, pairs=config.codebook == 2)
    args = {
        "packed_ptr": w.packed, "absmax_ptr": w.absmax, "absmax2_ptr": w.absmax2 if w.nested else dummy,
        "code2_ptr": w.code2 if w.nested else dummy, "offset_ptr": w.offset if w.nested else dummy,
        "code_ptr": code, "out_ptr": out, "n": n, "n_bytes": n_bytes, "n_words": n_words,
        "BLOCKSIZE": w.blocksize, "TILE": tile, "ROW": min(tile, 32 * num_warps),  # words per row: one per thread
        "DOUBLE_QUANT": w.nested, "FTZ": ftz, "ASM": (ftz or fusion_proof) and not interpreting,
        "CODEBOOK": config.codebook, "VEC": vec, "INDEX_64": index_64, "EVICT_STREAM": config.evict_stream,
        "BF16_BITS": interpreting or config.bf16_bits, "STORE_CM": config.store_cm, "PERSIST": persist and vec,
    }  # fmt: skip
    fn = KERNELS[config.kernel]
    if fusion_proof:
        return fn, grid, args, {"num_warps": num_warps}
    return fn, grid, args, {"num_warps": num_warps, "enable_fp_fusion": config.fp_fusion}


def launch(w: NF4Weight, out, ftz: bool, config: DequantConfig | None = None):
    """Launch the kernel on a checked weight into `out` (no checks). Returns (out, the compiled kernel or None,
    its grid and args) so that the caller can bind a repeat call.

    config: the meta-parameters (default: the tuned table's choice for this device and size).
    `DequantConfig(fp_fusion=True)` lets the compiler contract multiply-adds into FMAs (not
    bit-exact; never used by `dequantize`).
    """
    if config is None:
        config = tuned_config(w.device, w.n * out.element_size())
    fn, grid, args, options = kernel_launch(w, out, ftz, config, vec=w.packed.data_ptr() % 4 == 0)
    compiled = runtime.launch(fn, grid, args, device=w.device, **options)
    return out, compiled, fn, grid, args
