"""`nf4.dequantize`: the public entry point, a drop-in for bitsandbytes' and Unsloth's dequantize.

The call path is kept short: inputs are checked, the output is allocated, and a compiled kernel
cached for this configuration is launched directly (nf4.runtime: Triton's JIT dispatch costs more
host time than the whole kernel on small weights); a repeat call with the same weight skips the
checks too (`_Plan`, holding a launch bound by nf4.runtime). No device-to-host synchronisation
happens per call: the offset is read by the kernel from device memory.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import triton

from reference.format import ABSMAX_BLOCKSIZE, BLOCKSIZES, NF4_CODE

from .. import runtime
from .config import DequantConfig, tuned
from .kernel import nf4_dequantize_kernel

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PACKED_DTYPES = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int16, torch.int32)
_INT32_LIMIT = 2**31 - 1

_code_cache: dict[tuple, torch.Tensor] = {}
_dummy_cache: dict[torch.device, torch.Tensor] = {}
_plans: dict[int, _Plan] = {}
_seen: dict[int, weakref.ref] = {}  # QuantStates that took the full path once (a plan is made the second time)
_SEEN_LIMIT = 4096
_templates: dict[tuple, _Template] = {}  # bound launches per launch signature, for a QuantState's first call
_TEMPLATE_LIMIT = 512
_TEMPLATE_REBIND = ("packed_ptr", "absmax_ptr", "absmax2_ptr", "code2_ptr", "offset_ptr", "out_ptr")
_device_names: dict[int, str] = {}


class _Plan:
    """A validated QuantState with its bound launch, for the fast repeat call.

    Keyed by the QuantState object; it holds that state's tensors (alive as long as the state is)
    and never the packed weight, so it keeps no freed weight alive. A call reuses it when the state
    still holds the same tensors, shape, dtype and blocksize, and the packed tensor it is handed has
    the validated byte count, dtype, device, contiguity and pointer alignment (mod 16): any view of
    the same bytes, a `.t()`, a Params4bit, or a weight re-allocated at a new address (FSDP) takes
    it. The packed and output pointers are passed anew on every launch (`bound`: nf4.runtime.bind
    rebinding `packed_ptr` and `out_ptr`), so nothing stale is ever served: the kernel reads the
    bytes that are there at launch time.
    """

    __slots__ = (
        "absmax",
        "blocksize",
        "bound",
        "compiled",
        "config",
        "device_index",
        "dtype",
        "grid_x",
        "offset",
        "out_aligned",
        "out_dtype",
        "packed_dtype",
        "packed_numel",
        "ptr_mod",
        "shape",
        "state2",
        "state2_absmax",
        "strides",
        "template",
    )

    def matches(self, qs) -> bool:
        """The QuantState still holds what was validated."""
        return (qs.absmax is self.absmax and qs.shape is self.shape and qs.dtype is self.dtype
                and qs.state2 is self.state2 and qs.offset is self.offset and qs.blocksize == self.blocksize
                and (self.state2 is None or self.state2.absmax is self.state2_absmax))

    def packed_ptr(self, packed) -> int:
        """The packed tensor's data pointer when it fits this plan, else -1; negated minus one (-ptr - 1)
        when the packed tensor is a row (shape[0] == 1), whose result is returned transposed."""
        if type(packed) is not torch.Tensor:
            if not isinstance(packed, torch.Tensor):
                return -1
            # A tensor subclass with its own __torch_function__ (bitsandbytes' Params4bit) turns every
            # method call into a Python dispatch, several times the cost of the call itself.
            with _NO_TORCH_FUNCTION():
                return self._ptr(packed)
        return self._ptr(packed)

    def _ptr(self, packed) -> int:
        if (packed.dtype is not self.packed_dtype or packed.numel() != self.packed_numel
                or packed.get_device() != self.device_index or not packed.is_contiguous()):
            return -1
        ptr = packed.data_ptr()
        if ptr % 16 != self.ptr_mod:
            return -1
        return -ptr - 1 if packed.shape[0] == 1 else ptr

    def fits_out(self, out) -> bool:
        """A caller's `out` the kernel can write: the plan's shape, dtype and device, contiguous, and
        16-byte aligned where the compiled kernel assumes it (a fresh allocation always is)."""
        return (type(out) is torch.Tensor and out.dtype is self.out_dtype and out.shape == self.shape
                and out.get_device() == self.device_index and out.is_contiguous()
                and (not self.out_aligned or out.data_ptr() % 16 == 0))

    def run(self, packed_ptr: int, transpose: bool, out=None) -> torch.Tensor:
        """Launch on the packed bytes at packed_ptr into `out` (allocated when None)."""
        if out is None:
            # cheaper to call than torch.empty(shape, dtype=, device=) and than new_empty (the strides are given)
            out = self.template.new_empty_strided(self.shape, self.strides)
        bound = self.bound
        bound.fn(bound.ctx, _raw_stream(self.device_index), packed_ptr, out.data_ptr())
        return out.t() if transpose else out


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_raw_stream = runtime.raw_stream


def cached_plan(quant_state) -> _Plan | None:
    """The plan kept for `quant_state`, or None (an internal hook for tests and the probe)."""
    return _plans.get(id(quant_state))


def forget_plan(quant_state) -> None:
    """Drop the plan kept for `quant_state`; the next two calls take the full path (tests and the probe)."""
    _plans.pop(id(quant_state), None)
    _seen.pop(id(quant_state), None)


class _Template:
    """A compiled launch bound for every weight of one launch signature (`_template_key`: sizes, dtypes,
    flags, the config and the pointers' alignment), all six tensor pointers passed anew per launch.

    With `DequantConfig.first_call_template` (the default) it serves a QuantState's first call, validated but
    without a plan yet (a plan is made the second time): the launch then skips building the kernel's
    arguments, Triton's specialisation key and its launcher. It holds no tensor (pointers are bound per
    call) and keeps its config alive, so the config's id in the key stays its own.
    """

    __slots__ = ("bound", "config")


def _template_key(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, config) -> tuple:
    """What the compiled kernel, its grid and its non-pointer arguments depend on, beyond the device (the
    QuantState's dtypes follow from `nested` once validated)."""
    return (packed.get_device(), id(config), n, blocksize, nested, ftz, packed.dtype, packed.data_ptr() % 16,
            absmax.data_ptr() % 16 == 0, absmax2.data_ptr() % 16 == 0, code2.data_ptr() % 16 == 0,
            offset.data_ptr() % 16 == 0, out.dtype, out.data_ptr() % 16 == 0)


def _plan_due(qs) -> bool:
    """Note a QuantState's pass through the full path: True when a plan should be made now.

    A plan is made the second time a QuantState takes the full path (or when its plan no longer fits
    the call), so that a caller handing a new QuantState to every call pays no more than a call without
    the cache (one weak reference); with `first_call_template`, its first call launches through a template.
    """
    key = id(qs)
    if key in _plans:
        return True
    seen = _seen.get(key)
    if seen is None or seen() is not qs:
        if len(_seen) >= _SEEN_LIMIT:
            _seen.clear()
        _seen[key] = weakref.ref(qs)
        return False
    del _seen[key]
    return True


def _make_plan(packed, qs, compiled, args, grid_x, config, asked=None) -> None:
    """Remember a validated call so the next one with this QuantState can skip straight to the launcher."""
    key = id(qs)
    old = _plans.get(key)
    if runtime.hooks_active():
        return  # profiling hooks want the full path
    if (old is not None and old.compiled is compiled and old.grid_x == grid_x and old.config is asked
            and old.matches(qs) and old.packed_ptr(packed) != -1):
        return  # the same plan again (a caller that passes ftz or out on every call)
    out = args["out_ptr"]
    plan = _Plan()
    plan.compiled, plan.config = compiled, asked  # asked: the config the caller passed (None: tuned)
    plan.absmax, plan.shape, plan.dtype = qs.absmax, qs.shape, qs.dtype
    plan.state2 = getattr(qs, "state2", None) if getattr(qs, "nested", False) else None
    plan.offset = getattr(qs, "offset", None) if plan.state2 is not None else None
    plan.state2_absmax = plan.state2.absmax if plan.state2 is not None else None
    plan.packed_dtype, plan.packed_numel = packed.dtype, packed.numel()
    plan.ptr_mod = packed.data_ptr() % 16
    plan.device_index = packed.device.index
    plan.out_dtype = out.dtype
    plan.out_aligned = out.data_ptr() % 16 == 0  # the kernel was specialised on it
    plan.template = torch.empty(0, dtype=out.dtype, device=packed.device)
    plan.strides = contiguous_strides(plan.shape)
    plan.grid_x, plan.blocksize = grid_x, qs.blocksize
    plan.bound = runtime.bind(compiled, nf4_dequantize_kernel, (grid_x,), args, ("packed_ptr", "out_ptr"),
                              plan.device_index, native=config.native_launch, direct=config.direct_launch)
    if key not in _plans:
        weakref.finalize(qs, _plans.pop, key, None)
    _plans[key] = plan


def code_table(device: torch.device, codebook: int = 0) -> torch.Tensor:
    """The NF4 levels on `device`: 16 float32, or (codebook 2) 256 pairs packed as uint64 words.

    Pair b holds the float32 bits of NF4[b >> 4] (low half) and NF4[b & 15] (high half).
    """
    key = (device, codebook == 2)
    t = _code_cache.get(key)
    if t is None:
        if codebook == 2:
            bits = NF4_CODE.view(np.uint32).astype(np.uint64)
            b = np.arange(256)
            pairs = bits[b >> 4] | (bits[b & 15] << np.uint64(32))
            t = torch.from_numpy(pairs.view(np.int64).copy()).to(device)
        else:
            t = torch.from_numpy(NF4_CODE.copy()).to(device)
        _code_cache[key] = t
    return t


def _dummy(device: torch.device) -> torch.Tensor:
    """A stand-in for absent tensors (never read where it stands in), also 256 bytes of zeros that a kernel may
    read (nf4.linear's tensor-core GEMV with warps_k > 1)."""
    t = _dummy_cache.get(device)
    if t is None:
        t = torch.zeros(64, dtype=torch.float32, device=device)
        _dummy_cache[device] = t
    return t


def traced_tables(device: torch.device) -> tuple:
    """(code_table(device, 0), code_table(device, 2), the stand-in for absent tensors), for code that
    torch.compile traces (nf4.ops passes them to its ops as inputs); see nf4.ops.fill_tables."""
    from ..ops import fill_tables  # nf4.ops is imported only when compiling (it imports torch._dynamo)

    fill_tables(device)
    return _code_cache[(device, False)], _code_cache[(device, True)], _dummy_cache[device]


def contiguous_strides(shape) -> tuple:
    """The strides torch gives a contiguous tensor of `shape` (for Tensor.new_empty_strided)."""
    strides, step = [], 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _module_weight(module):
    """A module's `weight`: read from its parameter dict where nn.Module keeps it (a plain `module.weight`
    fails the instance and class lookups before nn.Module.__getattr__ finds it there, about 0.6 us of host
    time per call); any other module's attribute otherwise. nn.Module refuses to register a parameter whose
    name a class attribute already holds, so the two lookups agree wherever the dict has the name."""
    params = getattr(module, "_parameters", None)
    inner = params.get("weight") if isinstance(params, dict) else None
    return inner if inner is not None else getattr(module, "weight", None)


def _unpack_module(weight, quant_state):
    """Accept a Linear4bit module, a Params4bit, or (packed tensor, QuantState)."""
    if quant_state is None:
        inner = _module_weight(weight)
        if inner is not None and hasattr(inner, "quant_state"):  # bnb.nn.Linear4bit
            weight = inner
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            raise TypeError("quant_state is required unless weight is a bitsandbytes Linear4bit or Params4bit "
                            f"carrying one; got {type(weight).__name__} without quant_state")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a packed torch.Tensor, Params4bit or Linear4bit, got {type(weight).__name__}")
    if isinstance(quant_state, (torch.Tensor, dict, list, tuple)) or not all(
            hasattr(quant_state, f) for f in ("absmax", "shape", "blocksize", "dtype", "quant_type")):
        raise TypeError("quant_state must be a bitsandbytes QuantState (absmax, shape, blocksize, dtype, quant_type), "
                        f"got {type(quant_state).__name__}")
    if weight.device.type == "meta" and not runtime.is_recording():  # recording: an offline compile's stand-ins
        raise ValueError("weight is on the meta device, which holds no bytes to dequantize; expected a CUDA tensor "
                         "(or a CPU tensor with TRITON_INTERPRET=1)")
    if weight.device.type == "cpu" and not _interpreter_on():
        raise ValueError("weight is a CPU tensor, which nf4 runs in Triton's interpreter, but the interpreter is off: "
                         "set TRITON_INTERPRET=1 in the environment before triton is first imported (torch.compile "
                         "and bitsandbytes import it too), or move the weight to CUDA")
    return weight, quant_state


def _interpreter_on() -> bool:
    """Whether @triton.jit made interpreted functions (TRITON_INTERPRET was set when the kernel was defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(nf4_dequantize_kernel, InterpretedFunction)


def _as_int(value, field: str) -> int:
    """An integral value (int, NumPy integer, integral float, 0-d tensor) as int; TypeError/ValueError otherwise."""
    v = value
    if isinstance(v, torch.Tensor):
        if v.dim() != 0 or v.dtype.is_complex or v.dtype == torch.bool:
            raise TypeError(f"{field} must be an integer, got a {v.dtype} tensor of shape {tuple(v.shape)}")
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{field} must be an integer, got {type(value).__name__} {value!r}")
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise ValueError(f"{field} must be an integral value, got {value!r}")
    return int(v)


def _check_state(packed: torch.Tensor, qs, dtype):
    """Validate a QuantState against its packed tensor; return the launch parameters."""
    quant_type = getattr(qs, "quant_type", None)
    if quant_type != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {quant_type!r}")
    blocksize = qs.blocksize if type(qs.blocksize) is int else _as_int(qs.blocksize, "quant_state.blocksize")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"quant_state.blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")
    out_dtype = qs.dtype if dtype is None else dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {out_dtype}")
    if packed.dtype not in _PACKED_DTYPES:
        raise TypeError(f"packed weight has dtype {packed.dtype}, expected a quant_storage dtype: {_PACKED_DTYPES}")
    if not packed.is_contiguous():
        raise ValueError("packed weight must be contiguous")
    if not isinstance(qs.shape, (tuple, list, torch.Size)):
        raise TypeError(f"quant_state.shape must be a torch.Size or a tuple of integers, got {type(qs.shape).__name__}")
    shape = tuple(qs.shape)
    if not all(type(d) is int for d in shape):  # (a torch.Size holds ints; anything else is checked one by one)
        shape = tuple(_as_int(d, f"quant_state.shape[{i}]") for i, d in enumerate(qs.shape))
    if any(d < 0 for d in shape):
        raise ValueError(f"quant_state.shape must hold non-negative integers, got {tuple(qs.shape)}")
    n = math.prod(shape)
    have = packed.numel() * packed.element_size()
    if have != (n + 1) // 2:
        raise ValueError(f"packed weight holds {have} bytes, expected {(n + 1) // 2} for quant_state.shape {shape}")
    device = packed.device
    n_blocks = -(-n // blocksize)
    absmax = qs.absmax
    if not isinstance(absmax, torch.Tensor):
        raise TypeError(f"quant_state.absmax must be a tensor, got {type(absmax).__name__}")
    if absmax.device != device:
        raise ValueError(f"quant_state.absmax is on {absmax.device}, expected {device} like the packed weight")
    if absmax.numel() != n_blocks:
        raise ValueError(f"quant_state.absmax has {absmax.numel()} elements, expected {n_blocks} "
                         f"(shape {shape}, blocksize {blocksize})")
    if not absmax.is_contiguous():
        raise ValueError("quant_state.absmax must be contiguous")
    nested = getattr(qs, "nested", False)
    if nested:
        if absmax.dtype != torch.uint8:
            raise TypeError(f"quant_state.absmax must be uint8 with double quantization, got {absmax.dtype}")
        s2 = qs.state2
        if s2 is None:
            raise ValueError("quant_state.state2 is required with double quantization")
        if s2.blocksize != ABSMAX_BLOCKSIZE:
            raise ValueError(f"quant_state.state2.blocksize must be {ABSMAX_BLOCKSIZE}, got {s2.blocksize}")
        absmax2, code2, offset = s2.absmax, s2.code, qs.offset
        for name, t, numel in (("state2.absmax", absmax2, -(-n_blocks // ABSMAX_BLOCKSIZE)),
                               ("state2.code", code2, 256), ("offset", offset, 1)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"quant_state.{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise TypeError(f"quant_state.{name} must be float32, got {t.dtype}")
            if t.numel() != numel:
                raise ValueError(f"quant_state.{name} has {t.numel()} elements, expected {numel}")
            if t.device != device:
                raise ValueError(f"quant_state.{name} is on {t.device}, expected {device} like the packed weight")
            if not t.is_contiguous():
                raise ValueError(f"quant_state.{name} must be contiguous")
    else:
        if absmax.dtype != torch.float32:
            raise TypeError(f"quant_state.absmax must be float32 without double quantization, got {absmax.dtype}")
        absmax2 = code2 = offset = None
    return shape, n, n_blocks, blocksize, out_dtype, nested, absmax, absmax2, code2, offset


def _check_out(out: torch.Tensor, shape, out_dtype, device):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out.dtype != out_dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {out_dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device} like the packed weight")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device.index)
    if name is None:
        name = _device_names[device.index] = torch.cuda.get_device_name(device)
    return name


def tuned_config(device: torch.device, out_bytes: int) -> DequantConfig:
    """The tuned table's config for an output of `out_bytes` bytes on `device` (the default of `launch`)."""
    return tuned(_device_name(device) if not runtime.interpreting(device) else "", out_bytes)


def kernel_launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, config: DequantConfig, *,
                  vec: bool, fusion_proof: bool = False, code=None, dummy=None) -> tuple:
    """The kernel's launch on prepared tensors as (kernel, grid, args, options): built here once for
    `launch` (eager, through nf4.runtime) and for nf4.ops (torch.compile, through `wrap_triton`).

    vec: the packed pointer is 4-byte aligned (the 32-bit word path). fusion_proof: the IEEE product
    (ftz off) in PTX too, like the flushing one, so that no compile option can contract it into an
    FMA; Inductor compiles the kernels handed to it with contraction on and has no switch to turn
    it off, so nf4.ops asks for this, and options then carry num_warps only. code, dummy: the level
    table of config.codebook and the stand-in for absent double-quantization tensors (nf4.ops passes
    its op's inputs; looked up otherwise).
    """
    device = packed.device
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
    if absmax2 is None:
        absmax2 = code2 = offset = _dummy(device) if dummy is None else dummy
    args = {
        "packed_ptr": packed, "absmax_ptr": absmax, "absmax2_ptr": absmax2, "code2_ptr": code2,
        "offset_ptr": offset, "code_ptr": code_table(device, config.codebook) if code is None else code,
        "out_ptr": out, "n": n, "n_bytes": n_bytes, "n_words": n_words,
        "BLOCKSIZE": blocksize, "TILE": tile, "ROW": min(tile, 32 * num_warps),  # words per row: one per thread
        "DOUBLE_QUANT": nested, "FTZ": ftz, "ASM": (ftz or fusion_proof) and not interpreting,
        "CODEBOOK": config.codebook, "VEC": vec, "INDEX_64": index_64, "EVICT_STREAM": config.evict_stream,
        "BF16_BITS": interpreting or config.bf16_bits, "STORE_CM": config.store_cm, "PERSIST": persist and vec,
    }  # fmt: skip
    if fusion_proof:
        return nf4_dequantize_kernel, grid, args, {"num_warps": num_warps}
    return nf4_dequantize_kernel, grid, args, {"num_warps": num_warps, "enable_fp_fusion": config.fp_fusion}


def launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, *,
           config: DequantConfig | None = None, plan_for=None):
    """Launch the fused kernel on prepared tensors (no checks). Returns `out`.

    config: the meta-parameters (default: the tuned table's choice for this device and size).
    `DequantConfig(fp_fusion=True)` lets the compiler contract multiply-adds into FMAs (not
    bit-exact; never used by `dequantize`). plan_for: (packed, quant_state) to remember
    this launch for the fast repeat call.
    """
    device = packed.device
    asked = config
    if config is None:
        config = tuned_config(device, n * out.element_size())
    cacheable = config.plan and not config.fp_fusion
    due, key = False, None
    # (runtime.launch compiles, and returns the compiled kernel, exactly when this holds)
    if cacheable and device.type == "cuda" and not runtime.is_recording() and not runtime.interpreting(device):
        due = plan_for is not None and _plan_due(plan_for[1])
        if config.first_call_template:
            if absmax2 is None:
                absmax2 = code2 = offset = _dummy(device)
            key = _template_key(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, config)
            template = None if due else _templates.get(key)
            if template is not None and template.config is config and not runtime.hooks_active():
                bound = template.bound
                bound.fn(bound.ctx, _raw_stream(device.index), packed.data_ptr(), absmax.data_ptr(),
                         absmax2.data_ptr(), code2.data_ptr(), offset.data_ptr(), out.data_ptr())
                return out
    fn, grid, args, options = kernel_launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz,
                                            config, vec=packed.data_ptr() % 4 == 0)
    compiled = runtime.launch(fn, grid, args, device=device, **options)
    if compiled is not None and cacheable:
        if due:
            _make_plan(plan_for[0], plan_for[1], compiled, args, grid[0], config, asked)
        if key is not None and key not in _templates and not runtime.hooks_active():
            _remember_template(key, compiled, fn, grid, args, config, device.index)
    return out


def _remember_template(key, compiled, fn, grid, args, config, device_index) -> None:
    template = _Template()
    template.config = config
    template.bound = runtime.bind(compiled, fn, grid, args, _TEMPLATE_REBIND, device_index,
                                  native=config.native_launch, direct=config.direct_launch)
    if len(_templates) >= _TEMPLATE_LIMIT:
        _templates.clear()
    _templates[key] = template


def dequantize(weight, quant_state=None, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               ftz: bool | None = None, config: DequantConfig | None = None) -> torch.Tensor:
    """Dequantize an NF4 weight (double-quantized or not) with one fused Triton kernel.

    weight: a `bnb.nn.Linear4bit`, a `Params4bit`, or the packed tensor (any quant_storage).
    quant_state: the `bitsandbytes.functional.QuantState` (taken from `weight` when omitted).
    out: optional preallocated output of `quant_state.shape`, contiguous, on the same device.
    dtype: output dtype (float16, bfloat16, float32); defaults to `quant_state.dtype`.
    ftz: flush subnormal float32 operands and products to zero. Default: on for CUDA tensors,
    matching bitsandbytes' CUDA build; off on CPU (interpreter), matching its CPU routes and
    the reference's default.
    config: meta-parameters (`nf4.DequantConfig`); default: the tuned table's choice.
    Returns the weight in `quant_state.shape`, or its transpose when the packed tensor's
    `shape[0] == 1` (as bitsandbytes and Unsloth do). Inputs are never modified.
    """
    # Plans exist only for CUDA tensors with ftz on (the CUDA default), so an explicit ftz=True may use one.
    if dtype is None and (ftz is None or ftz is True) and not torch.compiler.is_compiling():
        packed, qs = weight, quant_state
        if qs is None:  # a Linear4bit (its weight) or a Params4bit (its quant_state)
            if not isinstance(packed, torch.Tensor):
                packed = _module_weight(packed)
            qs = getattr(packed, "quant_state", None)
        plan = _plans.get(id(qs))
        if plan is not None and plan.config is config and plan.matches(qs):
            ptr = plan.packed_ptr(packed)
            if ptr != -1:
                transpose = ptr < 0
                if transpose:
                    ptr = -ptr - 1
                if out is None:
                    return plan.run(ptr, transpose)
                if plan.fits_out(out):
                    return plan.run(ptr, transpose, out)
    if ftz is not None and not isinstance(ftz, (bool, np.bool_)):
        raise TypeError(f"ftz must be True, False or None (the device's default), got {type(ftz).__name__} {ftz!r}")
    packed, qs = _unpack_module(weight, quant_state)
    compiling = torch.compiler.is_compiling()
    if type(packed) is not torch.Tensor and not compiling:
        # A tensor subclass with its own __torch_function__ (bitsandbytes' Params4bit) makes each of the checks'
        # tensor calls a Python dispatch; a plain alias of the same storage (not a copy) answers them directly.
        with _NO_TORCH_FUNCTION():
            packed = packed.as_subclass(torch.Tensor)
    shape, n, _, blocksize, out_dtype, nested, absmax, absmax2, code2, offset = _check_state(packed, qs, dtype)
    device = packed.device
    ftz = device.type == "cuda" if ftz is None else bool(ftz)
    if out is None:
        if n == 0 or not compiling:  # under torch.compile the op allocates its result
            out = torch.empty(shape, dtype=out_dtype, device=device)
    else:
        _check_out(out, shape, out_dtype, device)
    if n == 0:  # an empty weight: an empty result, as bitsandbytes returns
        return out.t() if packed.dim() == 2 and packed.shape[0] == 1 else out
    if compiling:  # the triton_ops of nf4.ops, with the tuned table's config
        from ..ops import dequantize_op

        out = dequantize_op(packed, absmax, absmax2, code2, offset, out, shape, out_dtype, blocksize, ftz)
    else:
        plan_for = (packed, qs) if dtype is None and ftz == (device.type == "cuda") else None
        launch(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, config=config, plan_for=plan_for)
    if packed.shape[0] == 1:
        return out.t()
    return out
