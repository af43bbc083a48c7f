"""torch.compile peers: `verify.peers.torch_dequantize` through inductor, with and without FP fusion.

On CUDA inductor generates a Triton kernel. Whether Triton may contract `code2 * absmax2 + offset`
into an FMA is decided by `enable_fp_fusion` in the kernel's compile options, and inductor sets it
itself (torch 2.13, `_inductor/codegen/triton.py`, `triton_meta_common`):

    "enable_fp_fusion": not config.emulate_precision_casts

Triton's environment variable `TRITON_DEFAULT_FP_FUSION` only sets the default for callers that pass
nothing, so it cannot reach inductor's kernels; `TRITON_FORCE_DISABLE_FP_FUSION` would, but for every
kernel of the process and only where the compile runs in-process. The per-peer switch used here is
`torch._inductor.config.patch(emulate_precision_casts=True)` around the calls that compile (which
also keeps low-precision round trips; the peer's only low-precision step is the final cast).

Every compiled variant wraps its own function object, so dynamo keeps separate caches for them.
The generated code of each compilation is captured (`GraphLowering.save_output_code`, the hook
`torch._inductor.utils.run_and_get_code` uses, without its `torch._dynamo.reset()`) and written to
`save_dir`, with what it says about `enable_fp_fusion`.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import torch

from . import peers

_FUSION_RE = re.compile(r"['\"]enable_fp_fusion['\"]\s*:\s*(True|False)")


def _torch_dequantize_default(*args):
    return peers.torch_dequantize(*args)


def _torch_dequantize_no_fusion(*args):
    return peers.torch_dequantize(*args)


def fusion_switch_missing() -> str | None:
    """Why this torch cannot compile with fusion off per peer (None when it can)."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError as exc:  # pragma: no cover
        return f"torch._inductor unavailable: {exc}"
    if not hasattr(inductor_config, "emulate_precision_casts"):
        return f"torch {torch.__version__} has no torch._inductor.config.emulate_precision_casts"
    return None


def raise_recompile_limits(limit: int = 4096) -> None:
    """Every case is a new specialisation (dynamic=False): keep dynamo from falling back to eager."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


@contextlib.contextmanager
def capture_output_code(sink: list):
    """Append the source of every graph inductor compiles inside the block to `sink`."""
    try:
        from torch._inductor.graph import GraphLowering
    except ImportError:  # pragma: no cover - very old torch
        yield
        return
    old = GraphLowering.__dict__.get("save_output_code")
    GraphLowering.save_output_code = staticmethod(sink.append)
    try:
        yield
    finally:
        if old is None:
            GraphLowering.save_output_code = None
        else:
            GraphLowering.save_output_code = old


def fusion_flags(source: str) -> list[bool]:
    """The `enable_fp_fusion` values the generated kernels' triton_meta carry (empty if none is named)."""
    return [m.group(1) == "True" for m in _FUSION_RE.finditer(source)]


def graph_count() -> int:
    """Graphs dynamo has compiled so far in this process (to see whether a call compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompilePeer:
    """A callable (packed, quant_state) -> weight, like bitsandbytes (shape, dtype, `.t()` shim).

    fp_fusion=False compiles under `emulate_precision_casts=True`. Compilations are recorded in
    `self.compiles` (case label, seconds are not measured here, fusion flags, saved file).
    """

    def __init__(self, name: str, *, fp_fusion: bool, save_dir: str | Path | None = None):
        self.name = name
        self.fp_fusion = fp_fusion
        self.save_dir = Path(save_dir) if save_dir is not None else None
        fn = _torch_dequantize_default if fp_fusion else _torch_dequantize_no_fusion
        self._compiled = torch.compile(fn, dynamic=False)
        self.compiles: list[dict] = []
        self.label = ""  # set by the caller to name the next saved file

    def _config(self):
        if self.fp_fusion:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config

        return inductor_config.patch(emulate_precision_casts=True)

    def _args(self, packed, qs):
        if isinstance(packed, torch.nn.Parameter):  # Params4bit: hand dynamo a plain tensor
            packed = packed.data
        s2 = qs.state2
        code = peers._nf4_code(packed.device, _nf4_values())
        n = math.prod(qs.shape)
        return (packed, qs.absmax, s2.absmax, s2.code, qs.offset, code, n, qs.blocksize, qs.dtype)

    def __call__(self, packed, qs):
        """Dequantize; compiles (and records the generated code) on a new specialisation."""
        sink: list[str] = []
        before = graph_count()
        with self._config(), capture_output_code(sink):
            y = self._compiled(*self._args(packed, qs))
        if graph_count() != before or sink:
            self._record(sink)
        y = y.view(qs.shape)
        return y.t() if packed.shape[0] == 1 else y

    def call_warm(self, packed, qs):
        """Dequantize without the config patch or code capture (for timing, once compiled)."""
        y = self._compiled(*self._args(packed, qs)).view(qs.shape)
        return y.t() if packed.shape[0] == 1 else y

    def _record(self, sink: list[str]) -> None:
        entry = {"label": self.label, "graphs": len(sink), "fp_fusion_requested": self.fp_fusion,
                 "enable_fp_fusion_in_code": sorted({f for src in sink for f in fusion_flags(src)})}
        if self.save_dir is not None and sink:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.name}__{self.label or len(self.compiles)}")
            path = self.save_dir / f"{stem}.py.txt"  # data, not source: linters leave it alone
            path.write_text("\n\n# ---- next graph ----\n\n".join(sink))
            entry["saved"] = str(path)
        self.compiles.append(entry)

    def summary(self) -> dict:
        """What the compilations said about fusion: requested, and what the generated code carries."""
        seen = sorted({f for c in self.compiles for f in c["enable_fp_fusion_in_code"]})
        return {"name": self.name, "fp_fusion_requested": self.fp_fusion, "compilations": len(self.compiles),
                "enable_fp_fusion_in_code": seen, "files": [c.get("saved") for c in self.compiles if c.get("saved")]}


def _nf4_values():
    from reference.format import NF4_CODE

    return NF4_CODE
