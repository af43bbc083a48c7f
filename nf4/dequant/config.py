"""The dequantize kernel's meta-parameters as a frozen value, checked when it is built.

A launch takes a `DequantConfig`; nothing configures the kernel by assigning module globals. The
tuned choice per GPU and size is data (`tuned.json`, read by `nf4.dequant.tuned`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..runtime import check_fields

KERNELS = ("dequantize",)  # the names nf4.dequant.launch knows
EVICTIONS = ("", "evict_first", "evict_last", "evict_normal")  # Triton's eviction policies
STORE_MODIFIERS = ("", ".wb", ".cg", ".cs", ".wt")  # PTX st cache operators Triton accepts
MAX_TILE_BYTES = 1 << 16  # packed bytes per program: larger tiles exhaust registers at compile time


def _pow2(v) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class DequantConfig:
    """Meta-parameters of `nf4.dequant.kernel.nf4_dequantize_kernel` and how it is launched."""

    kernel: str = "dequantize"  # the kernel by name (nf4.dequant.launch.KERNELS)
    tile_bytes: int = 512  # packed bytes per program (word path: tile_bytes // 4 words)
    num_warps: int = 2
    codebook: int = 0  # 0: 16-entry table gather, 1: select tree, 2: 256-entry pair table
    evict_stream: str = "evict_first"  # eviction policy of the streamed packed bytes
    store_cm: str = ".cs"  # streaming stores: the output is not read back by this kernel
    bf16_bits: bool = False  # on the GPU: native cvt.rn.bf16.f32; the interpreter always rounds with integer ops
    # Word path with a fixed grid of programs_per_sm programs per multiprocessor striding over the
    # tiles (0: one program per tile). The interpreter uses interpret_programs programs instead.
    programs_per_sm: int = 0
    interpret_programs: int = 3
    fp_fusion: bool = False  # True lets the compiler contract multiply-adds (not bit-exact; experiments only)
    plan: bool = True  # keep a checked call in the repeat-call cache, so the next one skips the checks
    direct_launch: bool = True  # repeat calls through Triton's C launch function (not its Python wrapper)

    def __post_init__(self):
        check_fields(self)
        if self.kernel not in KERNELS:
            raise ValueError(f"DequantConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.tile_bytes < 4 or not _pow2(self.tile_bytes) or self.tile_bytes > MAX_TILE_BYTES:
            raise ValueError(f"DequantConfig.tile_bytes must be a power of two in 4..{MAX_TILE_BYTES}, "
                             f"got {self.tile_bytes}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"DequantConfig.num_warps must be a power of two up to 32, got {self.num_warps}")
        if self.codebook not in (0, 1, 2):
            raise ValueError(f"DequantConfig.codebook must be 0, 1 or 2, got {self.codebook}")
        if self.evict_stream not in EVICTIONS:
            raise ValueError(f"DequantConfig.evict_stream must be one of {EVICTIONS}, got {self.evict_stream!r}")
        if self.store_cm not in STORE_MODIFIERS:
            raise ValueError(f"DequantConfig.store_cm must be one of {STORE_MODIFIERS}, got {self.store_cm!r}")
        if self.programs_per_sm < 0 or self.interpret_programs < 1:
            raise ValueError("DequantConfig: programs_per_sm must be >= 0 and interpret_programs >= 1, got "
                             f"{self.programs_per_sm}, {self.interpret_programs}")

    def with_(self, **changes) -> DequantConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)
