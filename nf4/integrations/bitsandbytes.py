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
  (`nf4.linear.config.routes_gemm_4bit`: the rows of x from which nf4.linear's path, nf4.dequantize +
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
  100 us on an H100, was what the fallback paid before).
* Opt-in, `patch_bitsandbytes(fused_linear=True)`: also routes `bitsandbytes.matmul_4bit` itself. A call
  with an NF4 QuantState in [N, K] orientation, fp16 or bf16 x of M rows on a CUDA GPU (or the CPU with
  the interpreter), M within the GPU's measured limit (`nf4.linear.config.routes_matmul_4bit`: the rows
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
import functools
import sys
import threading

import numpy as np
import torch

from ..dequant.api import dequantize

__all__ = [
    "fused_linear_on",
    "patch_bitsandbytes",
    "patched_bitsandbytes",
    "patched_names",
    "reset_routed_counts",
    "route_dequant_linear_fallback",
    "route_dequantize_4bit",
    "route_gemm_4bit_choice",
    "route_matmul_4bit",
    "routed_counts",
    "unpatch_bitsandbytes",
]

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (module name, attribute) -> (original object, replacement) for every binding patched now.
# The replacements route only while this is non-empty.
_patches: dict[tuple[str, str], tuple[object, object]] = {}
_replacements: dict[object, object] = {}  # original -> its replacement (one per original, reused)
_lock = threading.Lock()
_counts: dict[tuple[str, str], int] = {}
_fused_linear = False  # the opt-in mode: matmul_4bit of few rows to nf4.linear (patch_bitsandbytes(fused_linear=True))
_interpreting: bool | None = None  # cached: fixed when triton decorated the kernel


def _interpreter_on() -> bool:
    """Whether nf4's kernel runs in Triton's interpreter (TRITON_INTERPRET was set when triton was imported)."""
    global _interpreting
    if _interpreting is None:
        from triton.runtime.interpreter import InterpretedFunction

        from ..dequant import kernel

        _interpreting = isinstance(kernel.nf4_dequantize_kernel, InterpretedFunction)
    return _interpreting


def _nf4_device(device: torch.device) -> bool:
    """nf4 runs bit-exact with bitsandbytes here: NVIDIA CUDA, or a CPU with the interpreter on."""
    if device.type == "cuda":
        return torch.version.hip is None
    return device.type == "cpu" and _interpreter_on()


def _count(function: str, route: str) -> None:
    if torch.compiler.is_compiling():
        # not counted while torch.compile traces: Dynamo refuses a side effect inside an autograd.Function
        # (MatMul4Bit.backward calls the patched dequantize_4bit), and a compiled graph would not count anyway
        return
    key = (function, route)
    _counts[key] = _counts.get(key, 0) + 1


def routed_counts() -> dict[tuple[str, str], int]:
    """Calls taken by each replacement since the last reset: {(function, "nf4" | "bitsandbytes"): n}."""
    return dict(_counts)


def reset_routed_counts() -> None:
    """Zero `routed_counts()`."""
    _counts.clear()


# --- the replacements ---------------------------------------------------------------------------


def _nf4_takes(A, quant_state, absmax, out, blocksize) -> bool:
    """A `dequantize_4bit` call nf4 computes exactly as bitsandbytes would."""
    if quant_state is None or getattr(quant_state, "quant_type", None) != "nf4":
        return False  # FP4, or absmax + out without a QuantState: bitsandbytes builds its own state
    # bitsandbytes ignores absmax and blocksize when given a QuantState; one that disagrees with the
    # state is left to it anyway, so that nothing the caller passed is dropped by nf4.
    if absmax is not None and absmax is not quant_state.absmax:
        return False
    if blocksize is not None and blocksize != quant_state.blocksize:
        return False
    if not isinstance(A, torch.Tensor) or not _nf4_device(A.device):
        return False
    if out is not None:
        # bitsandbytes' .out kernels demand QuantState's shape and dtype; nf4 also needs contiguity.
        if (not isinstance(out, torch.Tensor) or out.dtype != quant_state.dtype or out.device != A.device
                or tuple(out.shape) != tuple(quant_state.shape) or not out.is_contiguous()):
            return False
    return True


def route_dequantize_4bit(original):
    """The replacement for `bitsandbytes.functional.dequantize_4bit` (`original`), same signature.

    Exposed so that the route can be exercised on its own; `patch_bitsandbytes()` installs it.
    """
    replacement = _replacements.get(original)
    if replacement is not None:
        return replacement

    @functools.wraps(original)
    def dequantize_4bit(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        if _patches and _nf4_takes(A, quant_state, absmax, out, blocksize):
            try:
                # nf4 returns quant_state.shape (or its transpose for a (1, k) packed tensor) and
                # `out` itself when given, as bitsandbytes does.
                result = dequantize(A, quant_state, out=out)
            except (ValueError, TypeError):
                pass  # nf4 checks before it launches: nothing was written; bitsandbytes decides
            else:
                _count("dequantize_4bit", "nf4")
                return result
        _count("dequantize_4bit", "bitsandbytes")
        return original(A, quant_state, absmax, out, blocksize, quant_type)

    dequantize_4bit._nf4_original = original
    _replacements[original] = dequantize_4bit
    return dequantize_4bit


def _state_from_parts(shape, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset):
    """The QuantState that gemm_4bit's arguments describe (nested: absmax is state2's float32 scales)."""
    from bitsandbytes.functional import QuantState

    if absmax_8bit is None:
        return QuantState(absmax=absmax, shape=torch.Size(shape), blocksize=blocksize, quant_type="nf4", dtype=dtype)
    state2 = QuantState(absmax=absmax, code=absmax_code, blocksize=256, dtype=torch.float32)
    return QuantState(absmax=absmax_8bit, shape=torch.Size(shape), blocksize=blocksize, quant_type="nf4",
                      dtype=dtype, offset=absmax_offset, state2=state2)


_calling = threading.local()  # .state: the QuantState of the matmul_4bit call in progress on this thread


def _state_of_call(shapeB, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset):
    """The QuantState of the matmul_4bit call in progress (handed over by its replacement) when gemm_4bit's
    arguments are that state's own tensors and it dequantizes to `dtype`; else None. Using it instead of a
    state rebuilt from the parts is the same computation (the same tensors), and lets nf4.dequantize take
    its repeat-call plan, which is kept per QuantState object."""
    state = getattr(_calling, "state", None)
    if state is None or state.dtype is not dtype or state.blocksize != blocksize or state.shape is not shapeB:
        return None
    if absmax_8bit is None:
        return state if not state.nested and state.absmax is absmax else None
    state2 = state.state2
    if (state.nested and state2 is not None and state2.blocksize == 256 and state.absmax is absmax_8bit
            and state2.absmax is absmax and state2.code is absmax_code and state.offset is absmax_offset):
        return state
    return None


def route_dequant_linear_fallback(original):
    """The replacement for `bitsandbytes.backends.cuda.ops._dequant_linear_fallback` (`original`).

    Same signature. Like the original, it dequantizes into a fresh buffer of shapeB in A's dtype
    (the double-quantized scales recovered as `code2[absmax_8bit] * absmax + offset` in float32) and
    returns `F.linear(A, weight, bias)`; only the dequantization is nf4's. Exposed so that the route
    can be exercised where that module cannot be imported (a CPU-only torch).
    """
    replacement = _replacements.get(original)
    if replacement is not None:
        return replacement

    @functools.wraps(original)
    def _dequant_linear_fallback(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                                 absmax_code=None, absmax_offset=None):
        if (_patches and quant_type == "nf4" and isinstance(B, torch.Tensor) and _nf4_device(B.device)
                and A.dtype in _OUT_DTYPES):
            state = (_state_of_call(shapeB, absmax, blocksize, A.dtype, absmax_8bit, absmax_code, absmax_offset)
                     or _state_from_parts(shapeB, absmax, blocksize, A.dtype, absmax_8bit, absmax_code,
                                          absmax_offset))
            weight = torch.empty(shapeB, dtype=A.dtype, device=A.device)
            try:
                # Into `weight`, never through the return value: B is the (-1, 1) view, and nf4 would
                # transpose the result of a (1, 1) one (a weight of two elements).
                dequantize(B, state, out=weight)
            except (ValueError, TypeError):
                pass
            else:
                _count("_dequant_linear_fallback", "nf4")
                return torch.nn.functional.linear(A, weight, bias)
        _count("_dequant_linear_fallback", "bitsandbytes")
        return original(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit=absmax_8bit,
                        absmax_code=absmax_code, absmax_offset=absmax_offset)

    _dequant_linear_fallback._nf4_original = original
    _replacements[original] = _dequant_linear_fallback
    return _dequant_linear_fallback


_device_names: dict = {}


def _device_name(device_index) -> str:
    """The GPU's name, cached: the heuristic is asked on every gemm_4bit call (decode: every token)."""
    name = _device_names.get(device_index)
    if name is None:
        name = _device_names[device_index] = torch.cuda.get_device_name(device_index)
    return name


def route_gemm_4bit_choice(original, device_name=None):
    """The replacement for `bitsandbytes.backends.cuda.ops._gemm_4bit_use_custom_fn` (`original`).

    Same signature, (device_index, dtype, M, N, K) -> use bitsandbytes' fused kernel. Returns False
    (take the fallback, routed to nf4) for M at or above the measured threshold of the GPU in
    `nf4.linear.config.ROUTE_GEMM_4BIT_MIN_M`, else what the original heuristic says. device_name:
    device index -> GPU name (default `torch.cuda.get_device_name`; tests pass their own).
    """
    name_of = device_name or _device_name
    replacement = _replacements.get(original)
    if replacement is not None:
        return replacement

    from ..linear.config import routes_gemm_4bit

    @functools.wraps(original)
    def _gemm_4bit_use_custom_fn(device_index, dtype, M, N, K):
        if _patches and dtype in (torch.float16, torch.bfloat16) and routes_gemm_4bit(name_of(device_index), M):
            _count("_gemm_4bit_use_custom_fn", "nf4")
            return False
        _count("_gemm_4bit_use_custom_fn", "bitsandbytes")
        return original(device_index, dtype, M, N, K)

    _gemm_4bit_use_custom_fn._nf4_original = original
    _replacements[original] = _gemm_4bit_use_custom_fn
    return _gemm_4bit_use_custom_fn


def _flag(obj, name: str):
    """getattr(obj, name, False), without calling bitsandbytes' QuantState.__getattr__ for a name the state lacks.
    That __getattr__ answers only names of packed state-dict keys and raises otherwise, and `packing_format_for_cpu`
    is set only by bitsandbytes' CPU repacking, so the plain getattr raised and caught an AttributeError in Python on
    every routed call (1.3 us on this CPU). Any other class's __getattr__ is consulted as getattr would (it might
    answer the name)."""
    cls = type(obj)
    d = getattr(obj, "__dict__", None)
    if d is None or name in d or cls.__name__ != "QuantState" or cls.__module__ != "bitsandbytes.functional":
        return getattr(obj, name, False)
    value = getattr(cls, name, False)  # a class attribute, or the default
    return getattr(obj, name, False) if hasattr(value, "__get__") else value


def _linear_rows(A, quant_state, out, bias) -> int:
    """The rows of a `matmul_4bit` call the fused route may give to nf4.linear, else 0."""
    if (not isinstance(A, torch.Tensor) or A.dtype not in (torch.float16, torch.bfloat16) or A.dim() == 0
            or getattr(quant_state, "quant_type", None) != "nf4"
            or _flag(quant_state, "packing_format_for_cpu") or not _nf4_device(A.device)):
        return 0
    shape = getattr(quant_state, "shape", None)
    if shape is None or len(shape) != 2 or A.shape[-1] != shape[1] or A.numel() == 0:
        return 0  # a [K, N] weight, or no rows: bitsandbytes' own handling
    state2 = getattr(quant_state, "state2", None)
    if getattr(quant_state, "nested", False) and (state2 is None or state2.blocksize != 256):
        return 0  # bitsandbytes raises for these: keep its behaviour
    if out is not None and not isinstance(out, torch.Tensor):
        return 0
    if bias is not None and not isinstance(bias, torch.Tensor):
        return 0
    return A.numel() // A.shape[-1]


def route_matmul_4bit(original, device_name=None):
    """The replacement for `bitsandbytes.matmul_4bit` (`original`) in the fused_linear mode, same signature.

    A call `_linear_rows` accepts, of M rows within `nf4.linear.config.routes_matmul_4bit` for the GPU, is
    `nf4.linear(A, B, quant_state, bias)` (copied into `out` when given, as bitsandbytes does); a call
    nf4.linear refuses (ValueError/TypeError, raised before anything is written) and every other call go
    to the original unchanged. device_name: device index -> GPU name (tests pass their own).
    """
    name_of = device_name or _device_name
    replacement = _replacements.get(original)
    if replacement is not None:
        return replacement

    from ..linear.api import linear
    from ..linear.config import routes_matmul_4bit

    @functools.wraps(original)
    def matmul_4bit(A, B, quant_state, out=None, bias=None):
        if _patches and _fused_linear:
            m = _linear_rows(A, quant_state, out, bias)
            index = A.get_device() if m else -1  # -1: a CPU tensor (the interpreter: the default GPU's limit)
            if m and routes_matmul_4bit(name_of(index) if index >= 0 else "", m):
                try:
                    result = linear(A, B, quant_state, bias)
                except (ValueError, TypeError):
                    pass
                else:
                    _count("matmul_4bit", "nf4")
                    if out is not None:
                        out.copy_(result)
                        return out
                    return result
            _count("matmul_4bit", "bitsandbytes")
        if not _patches or torch.compiler.is_compiling():
            return original(A, B, quant_state, out, bias)
        previous = getattr(_calling, "state", None)
        _calling.state = quant_state  # for the fallback's replacement (_state_of_call), while this call runs
        try:
            return original(A, B, quant_state, out, bias)
        finally:
            _calling.state = previous

    matmul_4bit._nf4_original = original
    _replacements[original] = matmul_4bit
    return matmul_4bit


# --- patching -------------------------------------------------------------------------------------


def _original_of(value):
    """The function a replacement of ours stands for, else the value itself."""
    original = getattr(value, "_nf4_original", None)
    return original if original is not None and _replacements.get(original) is value else value


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
    global _fused_linear
    if not isinstance(fused_linear, (bool, np.bool_)):
        raise TypeError(f"fused_linear must be True or False, got {type(fused_linear).__name__} {fused_linear!r}")
    with _lock:
        fused_linear = bool(fused_linear)
        _fused_linear = fused_linear
        targets = _targets(fused_linear)
        wanted = {id(original) for original, _ in targets}
        for key, (original, _) in list(_patches.items()):
            if id(original) not in wanted:  # patched for a mode no longer asked for (matmul_4bit on a CPU)
                _restore(key)
        for name, module in _bitsandbytes_modules():
            for attr, value in list(vars(module).items()):
                for original, replacement in targets:
                    if value is original:
                        setattr(module, attr, replacement)
                        _patches[(name, attr)] = (original, replacement)
                    elif value is replacement:
                        # patched already, or bound while patched (an import by value): recorded, so
                        # that unpatching gives it the original
                        _patches[(name, attr)] = (original, replacement)


def _restore(key) -> None:
    original, replacement = _patches.pop(key)
    module = sys.modules.get(key[0])
    # Only if the binding still holds our replacement: whatever replaced it since is not ours to undo.
    if module is not None and getattr(module, key[1], None) is replacement:
        setattr(module, key[1], original)


def unpatch_bitsandbytes() -> None:
    """Put back the original objects in every binding patched. A no-op when nothing is patched."""
    global _fused_linear
    with _lock:
        for key in list(_patches):
            _restore(key)
        _fused_linear = False


def fused_linear_on() -> bool:
    """Whether the fused_linear mode is on (bitsandbytes' matmul_4bit of few rows goes to nf4.linear)."""
    return bool(_patches) and _fused_linear


def patched_names() -> list[tuple[str, str]]:
    """The (module name, attribute) bindings patched now, sorted."""
    return sorted(_patches)


@contextlib.contextmanager
def patched_bitsandbytes(*, fused_linear: bool = False):
    """Patch for the duration of a `with` block; on exit (an exception too) restore the state before it.

    Bindings this block patched are unpatched; bindings patched before it stay patched (and are
    patched again if something inside the block unpatched them); the fused_linear mode comes back too.
    """
    global _fused_linear
    with _lock:
        before, mode_before = dict(_patches), _fused_linear
    patch_bitsandbytes(fused_linear=fused_linear)
    try:
        yield
    finally:
        with _lock:
            _fused_linear = mode_before
            for key in list(_patches):
                if key not in before:
                    _restore(key)
            for key, (original, replacement) in before.items():
                module = sys.modules.get(key[0])
                if key not in _patches and module is not None and getattr(module, key[1], None) is original:
                    setattr(module, key[1], replacement)
                    _patches[key] = (original, replacement)
