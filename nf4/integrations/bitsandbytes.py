"""Route bitsandbytes' NF4 dequantization through `nf4.dequantize`, in place, reversibly.

    import nf4
    nf4.patch_bitsandbytes()             # from now on bitsandbytes dequantizes NF4 with nf4's kernel
    nf4.unpatch_bitsandbytes()           # the original functions are back (the same objects)
    with nf4.patched_bitsandbytes():     # or for a block; the previous state comes back on exit
        loss = model(x).sum(); loss.backward()

What is patched (bitsandbytes 0.50.2), and why:

* `bitsandbytes.functional.dequantize_4bit`, the one Python function through which bitsandbytes
  dequantizes a QuantState: `MatMul4Bit.backward` (`F.dequantize_4bit(B, ctx.state)`, the weight of
  every 4-bit layer in training), `matmul_4bit`'s forward for a weight quantized in [K, N]
  orientation, `Embedding4bit`, `nn.parametrize`, and `functional.dequantize_nf4`/`dequantize_fp4`.
  Every one of them looks the name up at call time (`F.dequantize_4bit`,
  `bnb.functional.dequantize_4bit`, or the global in `functional` itself), so rebinding it in
  `bitsandbytes.functional` reaches them all, and any code outside bitsandbytes that calls it as
  `bnb.functional.dequantize_4bit` (peft's and transformers' dequantize helpers do). No bitsandbytes
  module imports it by value; in case one does (another version), every loaded `bitsandbytes.*`
  module is scanned and each binding of the original object is patched. A module outside
  bitsandbytes that imported it by value before the patch keeps the original.
* `bitsandbytes.backends.cuda.ops._dequant_linear_fallback`: the 4-bit forward is `Linear4bit.forward
  -> bnb.matmul_4bit -> MatMul4Bit -> torch.ops.bitsandbytes.gemm_4bit`, whose CUDA kernel either runs
  the fused cgemm_4bit kernel (no separate dequantization: nothing to route) or, past 1536 rows, for
  K not a multiple of blocksize, or where the per-architecture heuristic prefers it, calls this
  function: dequantize into a fresh buffer, then `F.linear`. The kernel looks the name up in its
  module's globals at call time, so rebinding it routes that dequantization. Patched only where that
  module is loaded (bitsandbytes imports it when CUDA is available).

* `bitsandbytes.backends.cuda.ops._gemm_4bit_use_custom_fn`: the per-architecture heuristic that the
  CUDA `gemm_4bit` kernel consults (for M up to 1536 rows) to choose between its fused cgemm_4bit
  kernel and `_dequant_linear_fallback`. The replacement answers "fallback" where nf4's measured table
  (`nf4.integrations.routes.routes_gemm_4bit`: the rows of x from which nf4.linear's path, nf4.dequantize +
  cuBLAS there, measured faster than bitsandbytes' own choice on that GPU) says so, and asks the
  original heuristic elsewhere; the fallback it then takes is the patched one above, so those
  forwards run nf4.linear's path bit for bit (`F.linear(A, nf4.dequantize(B))`).

* `bitsandbytes.matmul_4bit` (bound in `bitsandbytes` and `bitsandbytes.autograd._functions`;
  `Linear4bit.forward` looks up `bnb.matmul_4bit` at call time), where CUDA's fallback above is patched:
  the replacement calls the original and, while it runs, hands its QuantState to the fallback's
  replacement, which gets only the state's tensors from gemm_4bit. When they are that state's own, nf4
  dequantizes with the state itself rather than one rebuilt from its parts (the same tensors, so the
  same bits), so nf4.dequantize's repeat-call plan, kept per QuantState object, serves the forward of a
  training step as it serves the backward (the host time of a new QuantState per call, measured about
  100 us on an H100, was what the fallback paid before). gemm_4bit's shape arrives through torch.ops as a new
  list, so it is compared by value. Where no call hands its state over (a compiled forward), the state made of
  the parts is kept per weight, by its absmax tensor (`routes._state_of_parts`: inductor hands the packed
  weight over as a new alias each call, the absmax tensor as the same object), and made again only for other parts.
* Opt-in, `patch_bitsandbytes(fused_linear=True)`: also routes `bitsandbytes.matmul_4bit` itself. A call
  with an NF4 QuantState in [N, K] orientation, fp16 or bf16 x of M rows on a CUDA GPU (or the CPU with
  the interpreter), M within the GPU's measured limit (`nf4.integrations.routes.routes_matmul_4bit`: the rows
  where nf4.linear measured faster than bitsandbytes' own choice: up to 4096, the most measured, on the H100
  and H200), goes to `nf4.linear(A, B, quant_state, bias)`, differentiable in x and bias as
  MatMul4Bit is. This is not bit-identical to bitsandbytes: its fused kernel sums in its own order
  (and is not operand-exact for a few rows, docs/FORMAT.md), nf4.linear in the tensor cores' order, both
  in float32 on the same bf16/fp16 weights; so it is off unless asked for. Every other call, and every
  call while the mode is off, is bitsandbytes' (through the routes above). The mode is what the last
  `patch_bitsandbytes` call asked; `patched_bitsandbytes(fused_linear=...)` restores the previous mode on
  exit.

Not routed: the CPU forward (`gemm_4bit`'s "default" kernel calls the op
`torch.ops.bitsandbytes.dequantize_4bit`, not the Python function; the dispatcher holds its own
reference to the kernel, and overriding a torch.library registration is process-global and cannot be
restored as the same object), `gemv_4bit` (inference with the CPU packing format, or a backend's
gemv), and the fused CUDA kernel. Those keep running bitsandbytes' code.

Only what nf4 computes bit for bit like bitsandbytes goes to nf4: an NF4 QuantState on a CUDA
tensor (not ROCm: nf4's flush-to-zero path is PTX), or on a CPU tensor when Triton's interpreter is
on. Everything else (FP4, no QuantState, an `absmax`/`blocksize` argument other than the state's,
an `out` of another dtype, shape or device or not contiguous, and any call nf4 rejects with
ValueError/TypeError) goes to the original function with the caller's arguments, unchanged. Two
deliberate differences on bitsandbytes' CPU route, where nf4 follows the format and CUDA: `out=`
works (bitsandbytes' CPU build has no `dequantize_4bit.out` kernel and raises), and a 1-D
QuantState.shape comes back in that shape (bitsandbytes' CPU kernel returns (1, n)).

A replacement that outlives its patch (someone kept a reference) calls the original unchanged.
`routed_counts()` says how many calls each replacement sent to nf4 and to bitsandbytes (tests use
it to see that nf4 was actually used).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch

from .routes import (
    STATE,
    matmul_4bit_route_max_m,
    reset_routed_counts,
    route_dequant_linear_fallback,
    route_dequantize_4bit,
    route_gemm_4bit_choice,
    route_matmul_4bit,
    routed_counts,
    routes_gemm_4bit,
    routes_matmul_4bit,
)

__all__ = [
    "fused_linear_on",
    "matmul_4bit_route_max_m",
    "patch_bitsandbytes",
    "patched_bitsandbytes",
    "patched_names",
    "reset_routed_counts",
    "route_dequant_linear_fallback",
    "route_dequantize_4bit",
    "route_gemm_4bit_choice",
    "route_matmul_4bit",
    "routed_counts",
    "routes_gemm_4bit",
    "routes_matmul_4bit",
    "unpatch_bitsandbytes",
]


# --- patching -------------------------------------------------------------------------------------


def _original_of(value):
    """The function a replacement of ours stands for, else the value itself."""
    original = getattr(value, "_nf4_original", None)
    return original if original is not None and STATE.replacements.get(original) is value else value


def _targets(fused_linear: bool) -> list[tuple[object, object]]:
    """(original, replacement) for each function this bitsandbytes has that is routed in this mode."""
    import bitsandbytes.functional  # runs bitsandbytes/__init__, which loads the CUDA backend when CUDA is there

    found = [(bitsandbytes.functional.dequantize_4bit, route_dequantize_4bit)]
    cuda_ops = sys.modules.get("bitsandbytes.backends.cuda.ops")
    fallback = cuda_ops is not None and callable(getattr(cuda_ops, "_dequant_linear_fallback", None))
    if (fused_linear or fallback) and callable(getattr(bitsandbytes, "matmul_4bit", None)):
        found.append((bitsandbytes.matmul_4bit, route_matmul_4bit))
    if fallback:
        found.append((cuda_ops._dequant_linear_fallback, route_dequant_linear_fallback))
    if (cuda_ops is not None and callable(getattr(cuda_ops, "_gemm_4bit_use_custom_fn", None))
            and torch.version.hip is None):
        found.append((cuda_ops._gemm_4bit_use_custom_fn, route_gemm_4bit_choice))
    targets = []
    for value, make in found:
        original = _original_of(value)  # patched already: the replacement's original
        targets.append((original, make(original)))
    return targets


def _bitsandbytes_modules():
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "bitsandbytes" or name.startswith("bitsandbytes.")):
            yield name, module


def patch_bitsandbytes(*, fused_linear: bool = False) -> None:
    """Route bitsandbytes' NF4 dequantization through nf4 (see the module docstring). Idempotent.

    Imports bitsandbytes. Every binding in a loaded `bitsandbytes.*` module that holds one of the
    routed functions is replaced; a binding patched already is left as it is.
    fused_linear: also send bitsandbytes' `matmul_4bit` of few rows to `nf4.linear` (faster, not
    bit-identical to bitsandbytes; see the module docstring). The mode is what the last call asked:
    a call without it puts `matmul_4bit` back.
    """
    if not isinstance(fused_linear, (bool, np.bool_)):
        raise TypeError(f"fused_linear must be True or False, got {type(fused_linear).__name__} {fused_linear!r}")
    with STATE.lock:
        fused_linear = bool(fused_linear)
        STATE.fused_linear = fused_linear
        targets = _targets(fused_linear)
        wanted = {id(original) for original, _ in targets}
        for key, (original, _) in list(STATE.patches.items()):
            if id(original) not in wanted:  # patched for a mode no longer asked for (matmul_4bit on a CPU)
                _restore(key)
        for name, module in _bitsandbytes_modules():
            for attr, value in list(vars(module).items()):
                for original, replacement in targets:
                    if value is original:
                        setattr(module, attr, replacement)
                        STATE.patches[(name, attr)] = (original, replacement)
                    elif value is replacement:
                        # patched already, or bound while patched (an import by value): recorded, so
                        # that unpatching gives it the original
                        STATE.patches[(name, attr)] = (original, replacement)


def _restore(key) -> None:
    original, replacement = STATE.patches.pop(key)
    module = sys.modules.get(key[0])
    # Only if the binding still holds our replacement: whatever replaced it since is not ours to undo.
    if module is not None and getattr(module, key[1], None) is replacement:
        setattr(module, key[1], original)


def unpatch_bitsandbytes() -> None:
    """Put back the original objects in every binding patched. A no-op when nothing is patched."""
    with STATE.lock:
        for key in list(STATE.patches):
            _restore(key)
        STATE.fused_linear = False


def fused_linear_on() -> bool:
    """Whether the fused_linear mode is on (bitsandbytes' matmul_4bit of few rows goes to nf4.linear)."""
    return bool(STATE.patches) and STATE.fused_linear


def patched_names() -> list[tuple[str, str]]:
    """The (module name, attribute) bindings patched now, sorted."""
    return sorted(STATE.patches)


@contextlib.contextmanager
def patched_bitsandbytes(*, fused_linear: bool = False):
    """Patch for the duration of a `with` block; on exit (an exception too) restore the state before it.

    Bindings this block patched are unpatched; bindings patched before it stay patched (and are
    patched again if something inside the block unpatched them); the fused_linear mode comes back too.
    """
    with STATE.lock:
        before, mode_before = dict(STATE.patches), STATE.fused_linear
    patch_bitsandbytes(fused_linear=fused_linear)
    try:
        yield
    finally:
        with STATE.lock:
            STATE.fused_linear = mode_before
            for key in list(STATE.patches):
                if key not in before:
                    _restore(key)
            for key, (original, replacement) in before.items():
                module = sys.modules.get(key[0])
                if key not in STATE.patches and module is not None and getattr(module, key[1], None) is original:
                    setattr(module, key[1], replacement)
                    STATE.patches[key] = (original, replacement)
