"""The dequantize kernel's meta-parameters as a frozen value, and the tuned table that picks them.

A launch takes a `DequantConfig`; nothing configures the kernel by assigning module globals. The
tuned table is keyed by GPU name (a substring of `torch.cuda.get_device_name`) and output size;
`tuned(device_name, out_bytes)` reads it. Where a GPU has no measured row, the H200's rows apply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DequantConfig:
    """Meta-parameters of `nf4.dequant.kernel.nf4_dequantize_kernel` and how it is launched."""

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
    plan: bool = True  # remember a validated call, so that the next one with its QuantState skips the checks
    native_launch: bool = True  # repeat calls through nf4's own C launch function where it applies
    direct_launch: bool = True  # else through Triton's C launch function (not its Python wrapper)
    # A QuantState's first call (no plan yet) through a launch bound once per launch signature, every tensor
    # pointer passed anew (nf4.dequant.api._Template), instead of Triton's launcher. experiments bench at 7dbc63e
    # (results/nf4_bench_{h100,h200}_7dbc63e.json, each paired with a call without any cache in
    # alternating batches): a new QuantState per call took 48.4 us against 107.2 on the H100 and 24.8 against 54.7
    # on the H200 with it, 121.5 against 105.9 and 61.3 against 54.1 without it.
    first_call_template: bool = True

    def __post_init__(self):
        if self.tile_bytes < 4 or self.tile_bytes & (self.tile_bytes - 1):
            raise ValueError(f"DequantConfig.tile_bytes must be a power of two >= 4, got {self.tile_bytes}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"DequantConfig.num_warps must be a power of two up to 32, got {self.num_warps}")
        if self.codebook not in (0, 1, 2):
            raise ValueError(f"DequantConfig.codebook must be 0, 1 or 2, got {self.codebook}")

    def with_(self, **changes) -> DequantConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)


# Tuned on an H200 (results/tuning/h200_sweep_rows_layout.json, results/tuning/h200_lab_*.json):
# packed bytes per program and warps. Both give each thread two 32-bit words; programs of 4 warps
# ran faster on weights whose output is at most 48 MiB (the challenge's 8192x2048 and 4096x1024),
# programs of 2 warps slightly faster on larger ones.
SMALL_OUT_BYTES = 48 << 20
TUNED: dict[str, tuple[tuple[int | None, DequantConfig], ...]] = {
    "H200": ((SMALL_OUT_BYTES, DequantConfig(tile_bytes=1024, num_warps=4)),
             (None, DequantConfig(tile_bytes=512, num_warps=2))),
}
DEFAULT_GPU = "H200"  # whose rows apply to a GPU with none of its own


def tuned(device_name: str, out_bytes: int) -> DequantConfig:
    """The tuned config for a weight whose output has `out_bytes` bytes on the named GPU."""
    rows = next((rows for gpu, rows in TUNED.items() if gpu in device_name), TUNED[DEFAULT_GPU])
    for limit, config in rows:
        if limit is None or out_bytes <= limit:
            return config
    return rows[-1][1]
