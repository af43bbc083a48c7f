"""The replacements nf4 puts into bitsandbytes (nf4.integrations.bitsandbytes installs them), their shared state,
and the measured thresholds that decide which calls they route.

Each `route_*(original)` builds (once per original) a function of the original's signature that sends
the calls nf4 computes exactly as bitsandbytes would (or, in the opt-in fused_linear mode, faster) to
nf4, and every other call to the original. They route only while `STATE.patches` is non-empty. See
nf4.integrations.bitsandbytes for what is patched and why.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from .. import runtime
from ..dequant import dequantize


class _State:
    """What the patch functions set and the replacements read (one object, so no module assigns another's
    globals)."""

    def __init__(self):
        # (module name, attribute) -> (original object, replacement) for every binding patched now
        self.patches: dict[tuple[str, str], tuple[object, object]] = {}
        self.replacements: dict[object, object] = {}  # original -> its replacement (one per original, reused)
        self.fused_linear = False  # the opt-in mode: matmul_4bit of few rows to nf4.linear
        self.lock = threading.Lock()


STATE = _State()
_counts: dict[tuple[str, str], int] = {}
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Rows of x from which nf4 (nf4.linear's tuned path) measured faster than bitsandbytes 0.50.2's own choice for
# `gemm_4bit` (its fused kernel or its dequantize + F.linear fallback), per GPU; below, a patched bitsandbytes
# keeps its own kernel. GPUs without an entry take DEFAULT_GPU's.
ROUTE_GEMM_4BIT_MIN_M: dict[str, int] = {"H100": 128}
# Rows of x up to which nf4.linear measured faster than bitsandbytes 0.50.2's `matmul_4bit` on every bench weight
# (results/linear/bench_{h100,h200}.json, bf16 and fp16, M = 1-4096: 4096 is the most measured). Used only by the
# opt-in fused route, whose outputs are nf4.linear's (float32 sums in another order than bitsandbytes' kernel).
ROUTE_MATMUL_4BIT_MAX_M: dict[str, int] = {"H100": 4096, "H200": 4096}
DEFAULT_GPU = "H100"
_ROUTE_TABLES = {"matmul_4bit": ROUTE_MATMUL_4BIT_MAX_M, "gemm_4bit": ROUTE_GEMM_4BIT_MIN_M}
_limits: dict[tuple[str, str], int] = {}


def _gpu_limit(route: str, device_name: str) -> int:
    """The entry of a route's per-GPU table whose key is in the GPU's name (DEFAULT_GPU's otherwise), cached: the
    routes ask on every bitsandbytes call. Keyed by the route's name, which torch.compile can trace."""
    key = (route, device_name)
    limit = _limits.get(key)
    if limit is None:
        table = _ROUTE_TABLES[route]
        limit = _limits[key] = next((v for gpu, v in table.items() if gpu in device_name), table[DEFAULT_GPU])
    return limit


def matmul_4bit_route_max_m(device_name: str) -> int:
    """The most rows of a matmul_4bit call that the fused route sends to nf4.linear on this GPU ("" for Triton's
    interpreter: the default GPU's limit)."""
    return _gpu_limit("matmul_4bit", device_name)


def routes_matmul_4bit(device_name: str, m: int) -> bool:
    """Whether the fused route sends a matmul_4bit of m rows to nf4.linear on this GPU."""
    return 1 <= m <= _gpu_limit("matmul_4bit", device_name)


def routes_gemm_4bit(device_name: str, m: int) -> bool:
    """Whether a patched bitsandbytes should send a gemm_4bit of m rows to nf4 on this GPU."""
    return m >= _gpu_limit("gemm_4bit", device_name)


def _nf4_device(device: torch.device) -> bool:
    """nf4 runs bit-exact with bitsandbytes here: NVIDIA CUDA, or a CPU with the interpreter on."""
    if device.type == "cuda":
        return torch.version.hip is None
    return device.type == "cpu" and runtime.interpreter_on()


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


_device_names: dict = {}


def _device_name(device_index) -> str:
    """The GPU's name, cached: the heuristic is asked on every gemm_4bit call (decode: every token)."""
    name = _device_names.get(device_index)
    if name is None:
        name = _device_names[device_index] = torch.cuda.get_device_name(device_index)
    return name


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
    replacement = STATE.replacements.get(original)
    if replacement is not None:
        return replacement

    @functools.wraps(original)
    def dequantize_4bit(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        if STATE.patches and _nf4_takes(A, quant_state, absmax, out, blocksize):
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
    STATE.replacements[original] = dequantize_4bit
    return dequantize_4bit


def _state_from_parts(shape, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset):
    """The QuantState that gemm_4bit's arguments describe (nested: absmax is state2's float32 scales)."""
    from bitsandbytes.functional import QuantState

    if absmax_8bit is None:
        return QuantState(absmax=absmax, shape=torch.Size(shape), blocksize=blocksize, quant_type="nf4", dtype=dtype)
    state2 = QuantState(absmax=absmax, code=absmax_code, blocksize=256, dtype=torch.float32)
    return QuantState(absmax=absmax_8bit, shape=torch.Size(shape), blocksize=blocksize, quant_type="nf4",
                      dtype=dtype, offset=absmax_offset, state2=state2)


def _holds(state, absmax, absmax_8bit, absmax_code, absmax_offset) -> bool:
    """Whether `state` is made of exactly these gemm_4bit tensors (nested: absmax_8bit the state's absmax, absmax
    state2's float32 scales; by identity)."""
    if absmax_8bit is None:
        return not state.nested and state.absmax is absmax
    state2 = state.state2
    return (state.nested and state2 is not None and state2.blocksize == 256 and state.absmax is absmax_8bit
            and state2.absmax is absmax and state2.code is absmax_code and state.offset is absmax_offset)


# id(the state's own absmax tensor) -> {(shape, dtype, blocksize): (weak references to the parts, the QuantState made
# of them)}. The state is made of detached aliases of the parts (the same memory and version counters, other tensor
# objects), so it holds no reference to the absmax tensor it is kept by: an entry goes with that tensor (a
# weakref.finalize), and nothing outlives the weight.
_FROM_PARTS: dict[int, dict] = {}
_FROM_PARTS_LIMIT = 4096  # weights kept at most (then the dict starts again, as nf4's RepeatCache does)


def _state_of_parts(shape, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset):
    """`_state_from_parts`, made once per weight and handed out again while gemm_4bit receives the same tensor
    objects (compared through weak references), shape, dtype and blocksize. A compiled forward reaches the
    fallback without matmul_4bit's handover, and with its packed weight as an alias that inductor makes anew for
    every call (no `_base` to keep anything by); a new QuantState per call is nf4.dequantize's slow path (its
    repeat-call plan is kept per QuantState). So the state is kept by the weight's own absmax tensor (absmax_8bit
    where nested), which inductor passes as the same object every call. nf4.dequantize still checks the state's
    tensors on every call (an alias shares its tensor's pointer and version counter, so an in-place change is
    seen). Nothing is kept on any tensor (torch.save pickles a tensor's __dict__)."""
    owner = absmax if absmax_8bit is None else absmax_8bit
    parts = (absmax, absmax_8bit, absmax_code, absmax_offset)
    key = (tuple(shape), dtype, blocksize)
    kept = _FROM_PARTS.get(id(owner))
    entry = kept.get(key) if kept is not None else None
    if entry is not None and all((r is None and t is None) or (r is not None and r() is t)
                                 for r, t in zip(entry[0], parts, strict=True)):
        return entry[1]
    try:
        refs = tuple(None if t is None else weakref.ref(t) for t in parts)
    except TypeError:  # a part that takes no weak references: keep nothing
        return _state_from_parts(shape, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset)
    a, a8, code, offset = (None if t is None else t.detach() for t in parts)
    state = _state_from_parts(shape, a, blocksize, dtype, a8, code, offset)
    if kept is None:
        if len(_FROM_PARTS) >= _FROM_PARTS_LIMIT:
            _FROM_PARTS.clear()
        weakref.finalize(owner, _FROM_PARTS.pop, id(owner), None)
        kept = _FROM_PARTS[id(owner)] = {}
    if len(kept) >= 8:  # a weight dequantized to many dtypes or with many shapes: start again
        kept.clear()
    kept[key] = (refs, state)
    return state


_calling = threading.local()  # .state: the QuantState of the matmul_4bit call in progress on this thread


def _state_of_call(shapeB, absmax, blocksize, dtype, absmax_8bit, absmax_code, absmax_offset):
    """The QuantState of the matmul_4bit call in progress (handed over by its replacement) when gemm_4bit's
    arguments are that state's own tensors and it dequantizes to `dtype`; else None. Using it instead of a
    state rebuilt from the parts is the same computation (the same tensors), and lets nf4.dequantize take
    its repeat-call plan, which is kept per QuantState object."""
    state = getattr(_calling, "state", None)
    # shapeB by value: gemm_4bit's CUDA kernel is reached through torch.ops, whose int[] argument arrives as a new
    # list (the tensors keep their identity), so `state.shape is shapeB` never held there
    if (state is None or state.dtype is not dtype or state.blocksize != blocksize
            or tuple(state.shape) != tuple(shapeB)):
        return None
    return state if _holds(state, absmax, absmax_8bit, absmax_code, absmax_offset) else None


def route_dequant_linear_fallback(original):
    """The replacement for `bitsandbytes.backends.cuda.ops._dequant_linear_fallback` (`original`).

    Same signature. Like the original, it dequantizes into a fresh buffer of shapeB in A's dtype
    (the double-quantized scales recovered as `code2[absmax_8bit] * absmax + offset` in float32) and
    returns `F.linear(A, weight, bias)`; only the dequantization is nf4's. Exposed so that the route
    can be exercised where that module cannot be imported (a CPU-only torch).
    """
    replacement = STATE.replacements.get(original)
    if replacement is not None:
        return replacement

    @functools.wraps(original)
    def _dequant_linear_fallback(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                                 absmax_code=None, absmax_offset=None):
        if (STATE.patches and quant_type == "nf4" and isinstance(B, torch.Tensor) and _nf4_device(B.device)
                and A.dtype in _OUT_DTYPES):
            state = (_state_of_call(shapeB, absmax, blocksize, A.dtype, absmax_8bit, absmax_code, absmax_offset)
                     or _state_of_parts(shapeB, absmax, blocksize, A.dtype, absmax_8bit, absmax_code, absmax_offset))
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
    STATE.replacements[original] = _dequant_linear_fallback
    return _dequant_linear_fallback


def route_gemm_4bit_choice(original, device_name=None):
    """The replacement for `bitsandbytes.backends.cuda.ops._gemm_4bit_use_custom_fn` (`original`).

    Same signature, (device_index, dtype, M, N, K) -> use bitsandbytes' fused kernel. Returns False
    (take the fallback, routed to nf4) for M at or above the measured threshold of the GPU in
    `ROUTE_GEMM_4BIT_MIN_M`, else what the original heuristic says. device_name:
    device index -> GPU name (default `torch.cuda.get_device_name`; tests pass their own).
    """
    name_of = device_name or _device_name
    replacement = STATE.replacements.get(original)
    if replacement is not None:
        return replacement

    @functools.wraps(original)
    def _gemm_4bit_use_custom_fn(device_index, dtype, M, N, K):
        if STATE.patches and dtype in (torch.float16, torch.bfloat16) and routes_gemm_4bit(name_of(device_index), M):
            _count("_gemm_4bit_use_custom_fn", "nf4")
            return False
        _count("_gemm_4bit_use_custom_fn", "bitsandbytes")
        return original(device_index, dtype, M, N, K)

    _gemm_4bit_use_custom_fn._nf4_original = original
    STATE.replacements[original] = _gemm_4bit_use_custom_fn
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

    A call `_linear_rows` accepts, of M rows within `routes_matmul_4bit` for the GPU, is
    `nf4.linear(A, B, quant_state, bias)` (copied into `out` when given, as bitsandbytes does); a call
    nf4.linear refuses (ValueError/TypeError, raised before anything is written) and every other call go
    to the original unchanged. device_name: device index -> GPU name (tests pass their own).
    """
    name_of = device_name or _device_name
    replacement = STATE.replacements.get(original)
    if replacement is not None:
        return replacement

    from ..linear.api import linear

    @functools.wraps(original)
    def matmul_4bit(A, B, quant_state, out=None, bias=None):
        if STATE.patches and STATE.fused_linear:
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
        if not STATE.patches or torch.compiler.is_compiling():
            return original(A, B, quant_state, out, bias)
        previous = getattr(_calling, "state", None)
        _calling.state = quant_state  # for the fallback's replacement (_state_of_call), while this call runs
        try:
            return original(A, B, quant_state, out, bias)
        finally:
            _calling.state = previous

    matmul_4bit._nf4_original = original
    STATE.replacements[original] = matmul_4bit
    return matmul_4bit
