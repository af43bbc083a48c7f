"""The implementations the matrix checks: one registry, looked up by name at run time.

Each takes (packed, quant_state) and returns the weight as bitsandbytes does: `quant_state.shape`,
`quant_state.dtype`, transposed when the packed tensor's shape[0] is 1. The expected output of every
row is the NumPy reference (ftz=False on a CPU, ftz=True on CUDA); the `reference` row itself is
checked against the device's bitsandbytes oracle instead (`oracle`), so that the two declared
ground truths are seen to agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import peers
from .cases import DTYPE_NAMES, Case

ORACLE = {"cpu": "bnb.default", "cuda": "bnb.dequantize_4bit"}


@dataclass(frozen=True)
class Impl:
    """An implementation: name, what it is, where it runs, and when it does not apply."""

    name: str
    summary: str
    devices: tuple[str, ...]
    fn: Callable
    needs_double_quant: bool = False
    half_outputs_only: bool = False  # Unsloth's kernels write fp16 or bf16 only
    compile_subset: bool = False  # runs only on cases flagged `compile` (each is a compilation)
    two_d_only: bool = False  # sizes its buffers from shape[0] * shape[1] (Unsloth's global buffer)
    unavailable: Callable[[], str | None] = lambda: None  # why it cannot run in this environment

    def not_applicable(self, case: Case, device: str) -> str | None:
        """Why this implementation does not run on `case` (None when it does)."""
        if device not in self.devices:
            return f"runs on {'/'.join(self.devices)} only"
        if self.needs_double_quant and not case.double_quant:
            return "needs double quantization (state2)"
        if self.half_outputs_only and case.out_dtype == torch.float32:
            return "writes fp16/bf16 only (fp32 would get the bf16 kernel's bytes)"
        if self.two_d_only and len(case.shape) != 2:
            return "sizes its output buffer as shape[0] * shape[1]: 2-D weights only"
        return None


def reference_dequantize(packed, qs, *, ftz: bool) -> torch.Tensor:
    """`reference.dequantize_nf4(reference.from_bnb(packed, qs))` as a CPU tensor, with bitsandbytes' `.t()` shim."""
    import reference

    arr = reference.dequantize_nf4(reference.from_bnb(packed, qs), DTYPE_NAMES[qs.dtype], ftz=ftz)
    return to_torch(arr, qs.dtype, transpose=packed.shape[0] == 1)


def to_torch(arr: np.ndarray, dtype: torch.dtype, *, transpose: bool = False) -> torch.Tensor:
    """A reference/model array (bf16 as uint16 bits) as a CPU tensor of `dtype`, `.t()` if asked."""
    if dtype == torch.bfloat16:
        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.t() if transpose else t


def _reference(packed, qs):
    return reference_dequantize(packed, qs, ftz=packed.device.type == "cuda")


def _nf4(packed, qs):
    import nf4

    return nf4.dequantize(packed, qs)


def _unsloth(packed, qs):
    return peers.unsloth_fast_dequantize(packed, qs)


def _unsloth_global(packed, qs):
    return peers.unsloth_fast_dequantize(packed, qs, use_global_buffer=True)


def _release(packed, qs):
    return peers.unsloth_release_dequantize(packed, qs)


def _release_global(packed, qs):
    # the release hands back its shared scratch buffer: copy it, as the next call overwrites it
    return peers.unsloth_release_dequantize(packed, qs, use_global_buffer=True).clone()


_compile_peers: dict = {}


def compile_peer(fp_fusion: bool):
    """The process-wide torch.compile peer (one per fusion setting), created on first use."""
    from .inductor import CompilePeer, raise_recompile_limits

    peer = _compile_peers.get(fp_fusion)
    if peer is None:
        raise_recompile_limits()
        name = "torch.compile" if fp_fusion else "torch.compile.no_fp_fusion"
        peer = CompilePeer(name, fp_fusion=fp_fusion, save_dir=_compile_save_dir[0])
        _compile_peers[fp_fusion] = peer
    return peer


_compile_save_dir: list = [None]  # where the compile peers save their generated code (set_compile_save_dir)
_compile_label: list = [""]  # the case being run: names the file the generated code is saved to


def set_compile_save_dir(path, *, only_if_unset: bool = False) -> None:
    """Where the torch.compile peers save their generated code (before their first compile)."""
    if not (only_if_unset and _compile_save_dir[0] is not None):
        _compile_save_dir[0] = path


def set_compile_label(label: str) -> None:
    """Name the file the next compile peer call saves its generated code to (the case id)."""
    _compile_label[0] = label


def _compiled(packed, qs):
    peer = compile_peer(True)
    peer.label = _compile_label[0]
    return peer(packed, qs)


def _compiled_no_fusion(packed, qs):
    peer = compile_peer(False)
    peer.label = _compile_label[0]
    return peer(packed, qs)


def _no_fusion_unavailable() -> str | None:
    from .inductor import fusion_switch_missing

    return fusion_switch_missing()


IMPLEMENTATIONS: dict[str, Impl] = {
    impl.name: impl
    for impl in [
        Impl("reference", "NumPy reference (checked against the device's bitsandbytes oracle)", ("cpu", "cuda"),
             _reference),
        Impl("bnb.default", "bitsandbytes pure-torch default backend, eager (absmax recovered as bitsandbytes does)",
             ("cpu", "cuda"), peers.bnb_default_dequantize),
        Impl("bnb.dequantize_4bit", "bitsandbytes functional.dequantize_4bit (native CPU routine / CUDA kernels)",
             ("cpu", "cuda"), peers.bnb_dequantize),
        Impl("bnb.triton", "bitsandbytes' own Triton kernel (kernels_4bit.dequantize_4bit_impl), called directly",
             ("cpu", "cuda"), peers.bnb_triton_dequantize),
        Impl("nf4", "nf4.dequantize (Triton interpreter on CPU, compiled on CUDA)", ("cpu", "cuda"), _nf4),
        Impl("unsloth", "Unsloth <= 2025 fast_dequantize / its ctypes fallback (re-implemented in verify.peers: "
             "bitsandbytes CUDA kernels, 3 launches)", ("cuda",), _unsloth, needs_double_quant=True,
             half_outputs_only=True),
        Impl("unsloth.global_buffer", "the same legacy path, use_global_buffer=True", ("cuda",),
             _unsloth_global, needs_double_quant=True, half_outputs_only=True),
        Impl("unsloth.2026.10.9", "Unsloth 2026.10.9 fast_dequantize (its one-launch Triton dequantize_nf4, run from "
             "the release's files)", ("cuda",), _release, unavailable=peers.release_missing),
        Impl("unsloth.2026.10.9.global_buffer", "Unsloth 2026.10.9 fast_dequantize, use_global_buffer=True",
             ("cuda",), _release_global, two_d_only=True, unavailable=peers.release_missing),
        Impl("torch.compile", "torch.compile(verify.peers.torch_dequantize), inductor defaults", ("cuda",), _compiled,
             needs_double_quant=True, compile_subset=True),
        Impl("torch.compile.no_fp_fusion", "the same under inductor emulate_precision_casts=True (enable_fp_fusion "
             "off)", ("cuda",), _compiled_no_fusion, needs_double_quant=True, compile_subset=True,
             unavailable=_no_fusion_unavailable),
    ]
}
