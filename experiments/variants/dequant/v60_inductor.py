"""v60-v61: torch.compile (inductor) of verify.peers.torch_dequantize: the Triton kernel a compiler writes.

Teaches what a generic compiler makes of the same formula, and one of its traps: inductor
compiles with fp fusion on, so `code2 * absmax2 + offset` may contract into an FMA (v60, not
expected exact); `emulate_precision_casts=True` turns fusion off in the kernels it emits (v61).
The generated code is saved as data (`.py.txt`) under experiments.common.current_artifact_dir()
(results/inductor/ by default; the runner's --inductor-dir), with inductor's debug trace next to
it. GPU only; the function returns a new tensor (it ignores `out`) and ignores ftz (torch semantics).
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments import common
from experiments.registry import register
from verify import peers

_compiled: dict = {}


def _launcher(variant_id: str, options: dict):
    def run(packed, quant_state, out, *, ftz):
        from torch._inductor.utils import run_and_get_code

        s = common.state_of(packed, quant_state)
        args = (packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, s.n, s.blocksize, out.dtype)
        key = (variant_id, packed.device, tuple(quant_state.shape), out.dtype, s.blocksize)
        fn = _compiled.get(key)
        if fn is not None:
            return fn(*args).view(quant_state.shape)
        name = f"{variant_id}_{'x'.join(map(str, quant_state.shape))}_{str(out.dtype).removeprefix('torch.')}"
        folder = Path(common.current_artifact_dir())
        folder.mkdir(parents=True, exist_ok=True)
        fn = torch.compile(peers.torch_dequantize, dynamic=False,
                           options={**options, "trace.enabled": True, "trace.debug_dir": str(folder / name),
                                    "fx_graph_cache": False})
        y, codes = run_and_get_code(fn, *args)
        text = "\n\n# ---- next generated module ----\n\n".join(codes)
        (folder / f"{name}{common.GENERATED_CODE_SUFFIX}").write_text(text)
        _compiled[key] = fn
        return y.view(quant_state.shape)

    return run


register("v60_inductor", parent=None, change="torch.compile of a PyTorch formulation (inductor, default config)",
         exact_expected=False, gpu_only=True, module=__name__,
         note="inductor's default fp fusion may contract code2*absmax2+offset")(_launcher("v60_inductor", {}))
register("v61_inductor_no_fusion", parent="v60_inductor",
         change="inductor with emulate_precision_casts=True (its kernels compile with fp fusion off)",
         gpu_only=True, module=__name__)(_launcher("v61_inductor_no_fusion", {"emulate_precision_casts": True}))
