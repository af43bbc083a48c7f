"""`nf4.linear`: x @ W^T (+ bias) for a bitsandbytes NF4 weight, decoded inside the matmul.

    y = nf4.linear(x, linear4bit.weight)                      # Params4bit (or the module itself)
    y = nf4.linear(x, packed, quant_state, bias=b)             # packed tensor + QuantState

The operand is the dequantized weight bit for bit (`nf4.dequantize(W).to(x.dtype)`, what
bitsandbytes' `matmul_4bit` fallback multiplies by); the sum is float32 (docs/FORMAT.md §10).
Differentiable in x and bias (W frozen, as in QLoRA): the backward computes dY @ W with the same
kernels, reading the packed bytes transposed, never materialising W (except where the measured
table takes nf4.dequantize + cuBLAS: then a scratch weight lives for the one product).

The repeat call is kept short like `nf4.dequantize`'s: a QuantState validated once is remembered
(`_Weight`, holding the state's tensors but never the packed weight), and each (M, dtype, bias)
seen twice gets a launch bound by nf4.runtime (or, where the table takes nf4.dequantize + cuBLAS,
a mark that sends it there), so the next call checks x and launches; with autograd recording too,
as a QLoRA step calls it.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import triton

from .. import runtime
from ..dequant.api import _check_state, _dummy, _unpack_module, code_table, contiguous_strides
from ..dequant.api import dequantize as _dequantize
from .config import INTERPRET_PROGRAMS, LinearConfig, fallback, tuned
from .kernel import (
    nf4_gemm_kernel,
    nf4_gemm_word_kernel,
    nf4_gemv_kernel,
    nf4_gemv_mma_kernel,
    nf4_gemv_table_kernel,
    nf4_split_sum_kernel,
)

_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_X_DTYPES = (torch.float16, torch.bfloat16)
_INT32_LIMIT = 2**31 - 1
_weights: dict[int, _Weight] = {}
_device_names: dict[int, str] = {}


class _Weight:
    """A validated NF4 weight state: what the kernels need besides the packed bytes and x."""

    __slots__ = (
        "K",
        "N",
        "__weakref__",
        "absmax",
        "absmax2",
        "blocksize",
        "code2",
        "device",
        "dtype",
        "fast",
        "fused",
        "index",
        "launches",
        "nested",
        "offset",
        "offset_ref",
        "packed_dtype",
        "packed_numel",
        "qs_absmax",
        "qs_shape",
        "state2",
        "state2_absmax",
        "state2_code",
        "view",
    )

    def matches(self, qs, packed) -> bool:
        return (qs.absmax is self.qs_absmax and qs.shape is self.qs_shape and qs.dtype is self.dtype
                and getattr(qs, "state2", None) is self.state2 and getattr(qs, "offset", None) is self.offset_ref
                and (self.state2 is None or (self.state2.absmax is self.state2_absmax
                                             and self.state2.code is self.state2_code))
                and packed.dtype is self.packed_dtype and packed.numel() == self.packed_numel
                and packed.get_device() == self.index)


def _device_name(device: torch.device) -> str:
    if runtime.interpreting(device):
        return ""
    name = _device_names.get(device.index)
    if name is None:
        name = _device_names[device.index] = torch.cuda.get_device_name(device)
    return name


def new_weight(n_out: int, k: int, blocksize: int, nested: bool, dtype, absmax, absmax2, code2, offset,
               device) -> _Weight:
    """A `_Weight` holding what the kernels read (no cache fields); nf4.ops builds one from its op's inputs."""
    w = _Weight()
    w.N, w.K, w.blocksize, w.nested, w.dtype = n_out, k, blocksize, nested, dtype
    w.absmax, w.absmax2, w.code2, w.offset, w.device = absmax, absmax2, code2, offset, device
    # the kernels need whole absmax blocks per row (bitsandbytes' own condition for its fused path)
    w.fused = n_out * k > 0 and k % blocksize == 0
    return w


def _checked_weight(packed, qs) -> _Weight:
    """The full checks of (packed, qs) for a linear, as a `_Weight` without cache fields."""
    shape, _, _, blocksize, _, nested, absmax, absmax2, code2, offset = _check_state(packed, qs, None)
    if len(shape) != 2:
        raise ValueError(f"quant_state.shape must be 2-D (out_features, in_features) for a linear, got {shape}")
    return new_weight(shape[0], shape[1], blocksize, nested, qs.dtype, absmax, absmax2, code2, offset, packed.device)


def weight_state(packed: torch.Tensor, qs) -> _Weight:
    """The validated state of (packed, qs) that `run` takes: remembered per QuantState (never holding
    the packed weight or the QuantState itself), checked in full the first time."""
    w = _weights.get(id(qs))
    if w is not None and w.matches(qs, packed):
        return w
    w = _checked_weight(packed, qs)
    w.qs_absmax, w.qs_shape = qs.absmax, qs.shape
    w.state2 = getattr(qs, "state2", None)
    w.state2_absmax = w.state2.absmax if w.state2 is not None else None
    w.state2_code = w.state2.code if w.state2 is not None else None
    w.offset_ref = getattr(qs, "offset", None)
    w.packed_dtype, w.packed_numel = packed.dtype, packed.numel()
    # what x.get_device() says for an x on the weight's device: the CUDA index, -1 for the CPU (the interpreter);
    # -2 (nothing) elsewhere (the meta device of an offline compile: never a repeat call)
    w.index = packed.device.index if packed.device.type == "cuda" else -1 if packed.device.type == "cpu" else -2
    w.launches = {}
    w.fast = {}
    key = id(qs)
    if key not in _weights:
        weakref.finalize(qs, _weights.pop, key, None)
    _weights[key] = w
    return w


_weight = weight_state


def forget(quant_state) -> None:
    """Drop what was remembered for `quant_state` (tests and benchmarks)."""
    _weights.pop(id(quant_state), None)


def split_k(config: LinearConfig, w: _Weight, m: int, trans: bool, device) -> tuple[int, int]:
    """(programs along K, bytes of a row each) for the GEMV forward and the word tl.dot kernel (1 in the
    interpreter where auto); (1, K / 2) for everything else."""
    kb = w.K // 2
    word = word_gemm(config, trans)
    if not word and (config.path != "gemv" or trans):
        return 1, kb
    unit = gemm_block_k(config, w) // 2 if word else gemv_step(config, w)
    steps = triton.cdiv(kb, unit)
    split = config.split_k
    if split == 0 and word:  # the split nearest programs_per_sm programs per multiprocessor, >= 4 steps each
        split = 1
        if not runtime.interpreting(device) and device.type == "cuda":
            tiles = triton.cdiv(m, config.block_m) * triton.cdiv(w.N, config.block_n)
            want = config.programs_per_sm * runtime.sm_count(device)
            split = max(1, min((want + tiles // 2) // tiles, steps // 4))
    elif split == 0:  # auto: the fewest steps per program over waves of programs_per_sm per multiprocessor
        if runtime.interpreting(device):
            split = 1
        else:
            split = auto_split(triton.cdiv(w.N, config.block_r), steps,
                               config.programs_per_sm * runtime.sm_count(device))
    split = max(1, min(split, steps))
    seg = triton.cdiv(steps, split) * unit
    return triton.cdiv(kb, seg), seg


def word_gemm(config: LinearConfig, trans: bool) -> bool:
    """Whether `config` (as launch_config returns it) runs the word tl.dot kernel (nf4_gemm_word_kernel): a
    forward tl.dot config with codebook 3."""
    return config.path == "gemm" and config.codebook == 3 and not trans


def gemm_block_k(config: LinearConfig, w: _Weight) -> int:
    """Weights of a row per step of the word tl.dot kernel: 64 or 32, at most the blocksize."""
    return min(64, config.block_k, w.blocksize)


def gemv_step(config: LinearConfig, w: _Weight) -> int:
    """Bytes of a row one GEMV forward step covers (a split's length is a whole number of them): one absmax
    block at most; the tensor-core GEMV's step is 4 lanes' worth (4 * min(that, 32))."""
    half = min(w.blocksize // 2, config.step_bytes)
    return 4 * min(half, 32) if config.mma else half


def auto_split(row_blocks: int, steps: int, capacity: int) -> int:
    """Programs along K for `row_blocks` blocks of rows of `steps` steps each, when `capacity` programs run at
    once: the split with the fewest (waves x steps per program), the smallest such split. Rounding the split
    up to fill the GPU can add a second, almost empty wave (14336 rows of 64: 10 splits of 7 steps are 2240
    programs, 1.06 waves of 2112 on an H100; 8 splits of 8 steps are one wave)."""
    best, best_cost = 1, None
    for split in range(1, min(steps, max(1, triton.cdiv(capacity, row_blocks))) + 1):
        per = triton.cdiv(steps, split)
        cost = triton.cdiv(row_blocks * triton.cdiv(steps, per), capacity) * per
        if best_cost is None or cost < best_cost:
            best, best_cost = split, cost
    return best


def kernel_args(x, packed, w, bias, out, m: int, trans: bool, config: LinearConfig, ftz: bool,
                interpreting: bool, part=None, *, code=None, dummy=None, mma_check=None) -> list[tuple]:
    """The launches of one fused product, [(kernel, grid, args, options)] (shared by the eager path and
    nf4.ops): one, or for a split-K GEMV the partial products into `part` (float32, split * m * N)
    and their ordered sum. `code` and `dummy` (the level table and a stand-in for absent tensors)
    are looked up unless given (nf4.ops passes them as the op's inputs). mma_check: what decides whether
    the tensor-core GEMV runs (default `mma_ok`, below; an offline build for a GPU that is not here passes
    its own)."""
    if dummy is None:
        dummy = _dummy(packed.device)
    if code is None:
        code = code_table(packed.device, config.codebook)
    kb = w.K // 2
    args = {
        "x_ptr": x, "packed_ptr": packed, "absmax_ptr": w.absmax,
        "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
        "offset_ptr": w.offset if w.nested else dummy, "code_ptr": code,
        "bias_ptr": bias if bias is not None else dummy, "out_ptr": out,
        "M": m, "N": w.N, "K": w.K, "KB": kb,
        "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": ftz, "ASM": not interpreting,
        "CODEBOOK": config.codebook % 3, "W_DT": _DT[w.dtype], "X_DT": _DT[x.dtype], "TRANS": trans,
        "HAS_BIAS": bias is not None, "BF16_BITS": interpreting or config.bf16_bits, "EVICT": config.evict,
    }  # fmt: skip
    if config.path == "gemv":
        half = min(w.blocksize // 2, config.step_bytes)  # one absmax block per row and step
        split, seg = split_k(config, w, m, trans, x.device)
        args.update(BLOCK_M=triton.next_power_of_2(m), BLOCK_R=config.block_r, HALF=half, SPLIT=split, SEG=seg,
                    PARTIAL=split > 1 and not trans)
        options = {"num_warps": config.num_warps}
        if config.maxnreg is not None:
            options["maxnreg"] = config.maxnreg
        if trans:
            return [(nf4_gemv_kernel, (triton.cdiv(kb, half),), args, options)]
        kernel = nf4_gemv_kernel
        if config.mma and (mma_check or mma_ok)(w, x, packed, half, m):
            kernel = nf4_gemv_mma_kernel
            for name in ("CODEBOOK", "W_DT", "TRANS", "ASM", "EVICT", "BLOCK_M", "BLOCK_R"):
                del args[name]
            args.update(THREADS=32 * config.num_warps, HALF=min(half, 32),
                        NTILE=triton.next_power_of_2(triton.cdiv(m, 8)),  # 8-row tiles of x: 1, 2 or 4
                        WARPS_K=config.warps_k, zero_ptr=dummy)  # dummy: zeros, enough for a step of x
        elif config.codebook == 3:
            if table_ok(w, x.dtype, packed, half, m):
                kernel = nf4_gemv_table_kernel
                for name in ("CODEBOOK", "W_DT", "TRANS"):
                    del args[name]
                args["HALF"] = min(half, 32)
        grid = (triton.cdiv(w.N, config.block_r) * split,)
        return _with_split_sum((kernel, grid, args, options), split, part, out, bias, m, w.N)
    if word_gemm(config, trans):
        split, seg = split_k(config, w, m, trans, x.device)
        for name in ("CODEBOOK", "W_DT", "TRANS"):
            del args[name]
        args.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=gemm_block_k(config, w),
                    GROUP=config.group, SWAP=config.swap, SPLIT=split, SEG=seg, PARTIAL=split > 1,
                    DOT_F32=interpreting)
        grid = (split * triton.cdiv(m, config.block_m) * triton.cdiv(w.N, config.block_n),)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        return _with_split_sum((nf4_gemm_word_kernel, grid, args, options), split, part, out, bias, m, w.N)
    block_k = min(w.blocksize, config.block_k)  # one absmax block per row and step
    args.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP=config.group,
                SWAP=config.swap and not trans, DOT_F32=interpreting, PERSIST=config.persistent > 0)
    tiles = triton.cdiv(kb, block_k // 2) if trans else triton.cdiv(w.N, config.block_n)
    tiles *= triton.cdiv(m, config.block_m)
    if config.persistent:
        on_gpu = x.device.type == "cuda" and not interpreting  # (meta tensors: an offline compile, any grid)
        programs = config.persistent * runtime.sm_count(x.device) if on_gpu else INTERPRET_PROGRAMS
        tiles = min(tiles, programs)
    grid = (tiles,)
    return [(nf4_gemm_kernel, grid, args, {"num_warps": config.num_warps, "num_stages": config.num_stages})]


SUM_BLOCK = 128  # one output per thread of 4 warps: the split sum is a few loads deep, spread wide


def _with_split_sum(launch: tuple, split: int, part, out, bias, m: int, n: int) -> list[tuple]:
    """A forward launch as is (split 1), or writing float32 partial sums [split, m, n] into `part` followed by
    nf4_split_sum_kernel, which adds them in split order, adds the bias and rounds once into `out`."""
    kernel, grid, args, options = launch
    if split == 1:
        return [launch]
    sum_args = {"part_ptr": part, "bias_ptr": args["bias_ptr"], "out_ptr": out, "MN": m * n, "N": n, "SPLIT": split,
                "HAS_BIAS": bias is not None, "X_DT": args["X_DT"], "BF16_BITS": args["BF16_BITS"],
                "BLOCK": SUM_BLOCK}
    args.update(out_ptr=part, HAS_BIAS=False)
    return [(kernel, grid, args, options),
            (nf4_split_sum_kernel, (triton.cdiv(m * n, SUM_BLOCK),), sum_args, {"num_warps": 4})]


TABLE_MAX_M = 4  # rows of x the word GEMV (codebook 3, nf4_gemv_table_kernel) takes


def table_ok(w: _Weight, x_dtype: torch.dtype, packed: torch.Tensor, half: int, m: int) -> bool:
    """Whether codebook 3's GEMV (nf4_gemv_table_kernel) takes this product: at most TABLE_MAX_M rows of x, W's
    dtype is x's, the packed bytes are 4-byte aligned and a step is whole words; otherwise codebook 3 runs
    nf4_gemv_kernel with the 16-entry table (codebook 0)."""
    return (m <= TABLE_MAX_M and w.dtype == x_dtype and _packs_16bit(packed.device) and _aligned4(packed)
            and half % 16 == 0)


def _aligned4(packed: torch.Tensor) -> bool:
    return _aligned(packed, 4)


def _aligned(t: torch.Tensor, n: int) -> bool:
    """Whether the tensor's data start on an n-byte boundary. A FakeTensor (torch.compile's trace) has no data
    pointer: its offset into the storage decides, as storages start aligned."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return t.storage_offset() * t.element_size() % n == 0
    return t.data_ptr() % n == 0


def word_gemm_ok(w: _Weight, x_dtype: torch.dtype, packed: torch.Tensor) -> bool:
    """Whether the word tl.dot kernel (nf4_gemm_word_kernel) takes this product: W's dtype is x's, a step is 32
    or 64 weights (blocksize >= 32), PTX's cvt.rn.*x2 (sm_80+) or Triton's interpreter, and 4-byte aligned
    packed bytes."""
    return (w.dtype == x_dtype and w.blocksize >= 32 and _packs_16bit(packed.device) and _aligned4(packed))


MMA_MAX_M = 32


def mma_ok(w: _Weight, x: torch.Tensor | None, packed: torch.Tensor, half: int, m: int) -> bool:
    """Whether the tensor-core word GEMV (nf4_gemv_mma_kernel) takes this product: at most MMA_MAX_M rows of x
    (up to 4 tiles of B's 8 columns), W's dtype is x's, a CUDA GPU of sm_80 or later (PTX mma.sync,
    cvt.rn.*x2), x contiguous and x and the packed bytes 16-byte aligned (vector loads without masks), and
    every row a whole number of steps."""
    half = min(half, 32)
    return (x is not None and m <= MMA_MAX_M and w.dtype == x.dtype and packed.device.type == "cuda"
            and _packs_16bit(packed.device) and half % 16 == 0 and (w.K // 2) % (4 * half) == 0
            and x.is_contiguous() and _aligned(x, 16) and _aligned(packed, 16))


_capabilities: dict[int, bool] = {}


def _packs_16bit(device: torch.device) -> bool:
    """Whether the word GEMV's PTX (cvt.rn.{f16,bf16}x2.f32: sm_80 and later) can run on `device`: a CUDA
    device of compute capability 8.0 or more, or Triton's interpreter (no PTX); not the meta device, which the
    offline sm_75 builds (experiments sm75) launch on."""
    if device.type == "cuda":
        ok = _capabilities.get(device.index)
        if ok is None:
            ok = _capabilities[device.index] = torch.cuda.get_device_capability(device) >= (8, 0)
        return ok
    return device.type != "meta"


def launch_config(config: LinearConfig, w: _Weight, x: torch.Tensor, packed: torch.Tensor, m: int,
                  trans: bool) -> LinearConfig:
    """The config to launch: a tensor-core GEMV where it cannot run (`mma_ok`) and a codebook-3 GEMV where the
    word GEMV cannot run (`table_ok`) become their tuned fallback (config.fallback), else the same shape
    without mma (block_r 16 * num_warps) or with codebook 0. Callers pass the result to both `split_k` and
    `kernel_args`; x is the (M, K) operand the kernels read."""
    if word_gemm(config, trans) and not word_gemm_ok(w, x.dtype, packed):
        return fallback(config, m) or config.with_(codebook=0)
    if config.path == "gemv" and config.codebook == 3 and not trans:
        half = min(w.blocksize // 2, config.step_bytes)
        if config.mma and not mma_ok(w, x, packed, half, m):
            config = fallback(config, m) or config.with_(mma=False, warps_k=1)
        if config.codebook == 3 and not config.mma and not table_ok(w, x.dtype, packed, half, m):
            return fallback(config, m) or config.with_(codebook=0)
    return config


def _check_x(x, w: _Weight, trans: bool):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    want = w.N if trans else w.K
    if x.dim() == 0 or x.shape[-1] != want:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (..., {want}): the last dimension must be "
                         f"{'out' if trans else 'in'}_features of the weight {(w.N, w.K)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, expected {w.device} like the weight")


def _check_bias(bias, x, w: _Weight):
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({w.N},)")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias has dtype {bias.dtype}, expected {x.dtype} like x")
    if bias.device != w.device:
        raise ValueError(f"bias is on {bias.device}, expected {w.device} like the weight")


def _fused_ok(x, w: _Weight, m: int) -> bool:
    return w.fused and x.dtype in _X_DTYPES and m * max(w.N, w.K) <= _INT32_LIMIT


def run(x, packed, w: _Weight, bias, *, trans: bool = False, config: LinearConfig | None = None,
        ftz: bool = True) -> torch.Tensor:
    """One fused launch on checked inputs: x [..., K] -> [..., N] (trans: x [..., N] -> [..., K])."""
    numel = x.numel()
    if numel and x.is_contiguous():  # the repeat call: from the plan to the bound launches, nothing else
        # (a contiguous x of any leading dimensions is its (M, K) matrix already: only its pointer is passed)
        k_in = x.shape[-1]
        m = numel // k_in
        plan = w.launches.get((m, x.dtype, bias is not None, trans, config, ftz))
        if plan is _DEQUANT and x.data_ptr() % 4 == 0:  # the table's dequant path, chosen for this key
            # x as it is: F.linear and matmul fold a contiguous x of any leading dimensions into the one (M, K)
            # GEMM the full path runs on its 2-D view (the same cuBLAS call, so the same bits), and two views
            # fewer cost less host time (about 3 us each on a CPU for an x that requires grad)
            return _dequant_run(x, packed, w, bias, trans, ftz)
        if plan and _aligned_ptrs(x, packed, bias):  # (x is contiguous here)
            n_out = w.K if trans else w.N
            return _run_plan(plan, x, packed, bias, m, n_out, w.device.index, x.new_empty((*x.shape[:-1], n_out)))
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 4:
        x2 = x2.contiguous() if x2.data_ptr() % 4 == 0 else x2.clone(memory_format=torch.contiguous_format)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    n_out = w.K if trans else w.N
    if m == 0 or n_out == 0:
        return torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    asked = config
    key = (m, x.dtype, bias is not None, trans, asked, ftz)
    if config is None:
        config = tuned(_device_name(x.device), m, trans, n=w.N, k=w.K)
    if config.path == "dequant":
        w.launches[key] = _DEQUANT  # the same key always takes this path (the table depends on nothing else)
        return _dequant_run(x2, packed, w, bias, trans, ftz).reshape(*lead, n_out)
    interpreting = runtime.interpreting(x.device)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    plan = w.launches.get(key)
    if plan and _plan_fits(x2, packed, bias):
        return _run_plan(plan, x2, packed, bias, m, n_out, w.device.index, out).reshape(*lead, n_out)
    config = launch_config(config, w, x2, packed, m, trans)
    if config.path == "dequant":  # a tuned tensor-core GEMV's fallback
        return _dequant_run(x2, packed, w, bias, trans, ftz).reshape(*lead, n_out)
    split, _ = split_k(config, w, m, trans, x.device)
    part = torch.empty(split * m * n_out, dtype=torch.float32, device=x.device) if split > 1 else None
    launches = kernel_args(x2, packed, w, bias, out, m, trans, config, ftz, interpreting, part)
    compiled = [runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
                for fn, grid, args, options in launches]
    if compiled[0] is not None and config.plan and not runtime.hooks_active() and all(
            t.data_ptr() % 16 == 0 for t in (x2, packed, out) + ((bias,) if bias is not None else ())):
        if plan is None:
            w.launches[key] = 0  # seen once: bound on the second call, so a one-off M costs no bind
        else:
            with_bias = ("bias_ptr",) if bias is not None else ()
            fn, grid, args, _ = launches[0]
            main = runtime.bind(compiled[0], fn, grid, args, ("x_ptr", "packed_ptr", "out_ptr")
                                + (with_bias if part is None else ()), x.device.index)
            finish = None
            if part is not None:
                fn, grid, args, _ = launches[1]
                finish = runtime.bind(compiled[1], fn, grid, args, ("part_ptr", "out_ptr", *with_bias),
                                      x.device.index)
            w.launches[key] = (main, finish, split * m * n_out)
    return out.reshape(*lead, n_out)


def _plan_fits(x2, packed, bias) -> bool:
    """x (M, K), the packed bytes and the bias as a bound launch was made for: contiguous, 16-byte aligned."""
    return x2.is_contiguous() and _aligned_ptrs(x2, packed, bias)


def _aligned_ptrs(x, packed, bias) -> bool:
    """`_plan_fits` for an x known to be contiguous (of any leading dimensions): the pointers 16-byte aligned, the
    bias contiguous."""
    return (x.data_ptr() % 16 == 0 and packed.data_ptr() % 16 == 0
            and (bias is None or (bias.is_contiguous() and bias.data_ptr() % 16 == 0)))


def _run_plan(plan, x2, packed, bias, m: int, n_out: int, device_index: int, out=None) -> torch.Tensor:
    """The bound launches of a plan (`w.launches`) on x2 (contiguous, m rows of K): out, m rows of n_out
    (allocated [m, n_out] when None)."""
    main, finish, part_numel = plan
    if out is None:
        out = x2.new_empty((m, n_out))
    stream = runtime.raw_stream(device_index)
    if finish is None:
        if bias is None:
            main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), out.data_ptr())
        else:
            main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), out.data_ptr(), bias.data_ptr())
    else:
        part = x2.new_empty(part_numel, dtype=torch.float32)
        main.fn(main.ctx, stream, x2.data_ptr(), packed.data_ptr(), part.data_ptr())
        if bias is None:
            finish.fn(finish.ctx, stream, part.data_ptr(), out.data_ptr())
        else:
            finish.fn(finish.ctx, stream, part.data_ptr(), out.data_ptr(), bias.data_ptr())
    return out


_DEQUANT = ("dequant",)  # w.launches' mark of a key that the table sends to the dequant path


def _dequant_run(x, packed, w: _Weight, bias, trans: bool, ftz: bool) -> torch.Tensor:
    """nf4.dequantize into a scratch weight, then cuBLAS (the table's dequant path); x (..., K), or (..., N) for
    trans, contiguous."""
    return dense_product(x, _dequantize(packed, _qs_of(w, packed), ftz=ftz), bias, trans)


def dense_product(x, wt, bias, trans: bool) -> torch.Tensor:
    """The cuBLAS product of the dequant path on the dequantized weight wt [N, K] converted to x's dtype: x @ W
    (trans) or F.linear(x, W, bias); nf4.ops' opaque op runs this same call under torch.compile."""
    if wt.dtype is not x.dtype:
        wt = wt.to(x.dtype)
    return x @ wt if trans else torch.nn.functional.linear(x, wt, bias)


def _qs_of(w: _Weight, packed):
    """A QuantState-like view of a validated weight for nf4.dequantize (the dequant path), one per weight,
    so that nf4.dequantize's repeat-call plan serves it (it holds the state's tensors, not the state)."""
    view = getattr(w, "view", None)
    if view is None:
        view = w.view = _StateView(w)
    return view


class _StateView:
    __slots__ = ("__weakref__", "absmax", "blocksize", "dtype", "nested", "offset", "quant_type", "shape", "state2")

    def __init__(self, w: _Weight):
        self.absmax, self.shape, self.blocksize, self.dtype = w.qs_absmax, w.qs_shape, w.blocksize, w.dtype
        self.nested, self.state2, self.offset, self.quant_type = w.nested, w.state2, w.offset, "nf4"


class _LinearFn(torch.autograd.Function):
    """x -> x @ W^T + bias with W frozen; backward dY @ W with the same kernels."""

    @staticmethod
    def forward(ctx, x, bias, packed, w, config, ftz):
        ctx.packed, ctx.w, ctx.config, ctx.ftz = packed, w, config, ftz
        ctx.has_bias = bias is not None
        return _forward(x, packed, w, bias, config, ftz)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            g = grad
            if ctx.w.fused and g.dtype in _X_DTYPES:
                grad_x = run(g, ctx.packed, ctx.w, None, trans=True, config=None, ftz=ctx.ftz)
            else:
                wt = _dequantize(ctx.packed, _qs_of(ctx.w, ctx.packed), ftz=ctx.ftz)
                grad_x = dense_product(g, wt, None, True)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None, None, None


def _forward(x, packed, w, bias, config, ftz):
    m = math.prod(x.shape[:-1])
    if _fused_ok(x, w, m):
        return run(x, packed, w, bias, config=config, ftz=ftz)
    # not fused: blocks that straddle rows, float32 x, or more than 2**31 elements of x or out
    wt = _dequantize(packed, _qs_of(w, packed), ftz=ftz)
    return torch.nn.functional.linear(x, wt.to(x.dtype), bias)


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


def _repeat(x, packed, quant_state, w: _Weight, bias):
    """`run` (or, where autograd records, `_LinearFn`) for a repeat call that needs no checks beyond these (else
    None: the full path decides), through `_fast_call` where it applies. The caller disables __torch_function__ for a
    Params4bit `packed`."""
    if bias is None:
        y = _fast_call(x, packed, quant_state, w)
        if y is not None:
            return y
    if (x.dtype in _X_DTYPES and w.fused and x.get_device() == w.index and x.shape[-1] == w.K
            and w.matches(quant_state, packed)
            and (bias is None or (type(bias) is torch.Tensor and bias.dtype is x.dtype and bias.dim() == 1
                                  and bias.shape[0] == w.N and bias.get_device() == w.index))
            and not torch.compiler.is_compiling()):
        ftz = w.index >= 0  # the device's default, as the full path sets it: on for CUDA, off on the CPU
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            # training: the backward runs later on autograd's thread, with __torch_function__ on again, so it gets
            # a plain alias of the packed bytes (no copy)
            return _LinearFn.apply(x, bias, _plain(packed), w, None, ftz)
        y = run(x, packed, w, bias, ftz=ftz)
        if bias is None and x.is_contiguous():
            _remember_fast(x, w, ftz)
        return y
    return None


def _remember_fast(x, w: _Weight, ftz: bool, stream=runtime.raw_stream) -> None:
    """Note the bound single launch of (x's shape and dtype, no bias, the default config) in `w.fast`, for
    `_fast_call`; nothing where that key has no bound launch yet, or has two (a split-K sum) or the dequant
    path. stream: what gives the current stream of a device index to launch on (a stand-in in tests)."""
    shape = x.shape
    plan = w.launches.get((x.numel() // shape[-1], x.dtype, False, False, None, ftz))
    if type(plan) is tuple and plan is not _DEQUANT and plan[1] is None:
        if len(w.fast) >= _FAST_LIMIT:
            w.fast.clear()
        out_shape = (*shape[:-1], w.N)
        w.fast[shape] = (x.dtype, plan[0], out_shape, contiguous_strides(out_shape), stream)


_FAST_LIMIT = 64  # shapes of x per weight with a fast entry


def _fast_call(x, packed, qs, w: _Weight):
    """The shortest repeat call: x of a shape and dtype that `_remember_fast` noted, no bias, no autograd
    recording, the weight still as validated (`_Weight.matches`), x contiguous and both pointers 16-byte aligned
    (as the bound launch was made for). The output, or None (then `_repeat` decides). The caller disables
    __torch_function__ for a Params4bit `packed`."""
    entry = w.fast.get(x.shape)
    if (entry is None or entry[0] is not x.dtype or x.get_device() != w.index or not w.matches(qs, packed)
            or not x.is_contiguous() or (x.requires_grad and torch.is_grad_enabled())
            or torch.compiler.is_compiling()):
        return None
    x_ptr, packed_ptr = x.data_ptr(), packed.data_ptr()
    if (x_ptr | packed_ptr) & 15:
        return None
    out = x.new_empty_strided(entry[2], entry[3])  # (cheaper to call than new_empty: the strides are given)
    bound = entry[1]
    bound.fn(bound.ctx, entry[4](w.index), x_ptr, packed_ptr, out.data_ptr())
    return out


def _plain(packed: torch.Tensor) -> torch.Tensor:
    """A plain torch.Tensor over the same storage as `packed` (itself when it is one): a Params4bit's methods
    dispatch through Python __torch_function__, about 2 us each, and the backward calls several."""
    if type(packed) is torch.Tensor:
        return packed
    with _NO_TORCH_FUNCTION():
        return packed.as_subclass(torch.Tensor)


def linear(x: torch.Tensor, weight, quant_state=None, bias: torch.Tensor | None = None, *,
           config: LinearConfig | None = None, ftz: bool | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for an NF4 weight W of shape (out_features, in_features).

    x: float16 or bfloat16 (float32 is accepted and goes through `nf4.dequantize` + F.linear),
    any leading dimensions, last dimension in_features. weight: a `bnb.nn.Linear4bit`, a
    `Params4bit`, or the packed tensor with its `quant_state` (double-quantized or not, any
    quant_storage, bitsandbytes' packed layout). bias: (out_features,) in x's dtype, or None.
    Returns (..., out_features) in x's dtype, accumulated in float32. Differentiable in x and
    bias. config: a `nf4.LinearConfig` (default: the tuned table's choice for this GPU and M).
    ftz: as in `nf4.dequantize` (default on for CUDA, off on CPU). Inputs are never modified.
    """
    # The repeat call: a validated weight, x of a fused dtype on its device, not compiling (with or without grad).
    if config is None and ftz is None and type(x) is torch.Tensor and isinstance(weight, torch.Tensor):
        qs = quant_state if quant_state is not None else getattr(weight, "quant_state", None)  # a Params4bit's own
        w = _weights.get(id(qs)) if qs is not None else None
        if w is not None:
            if type(weight) is torch.Tensor:
                y = _repeat(x, weight, qs, w, bias)
            else:
                # A Params4bit (bitsandbytes' Linear4bit passes its weight so) turns every method call into a
                # Python __torch_function__ dispatch; none is needed to read its metadata and pointer.
                with _NO_TORCH_FUNCTION():
                    y = _repeat(x, weight, qs, w, bias)
            if y is not None:
                return y
    if quant_state is None and not isinstance(weight, torch.Tensor) and bias is None:
        bias = getattr(weight, "bias", None)  # a Linear4bit brings its bias
        if isinstance(bias, torch.Tensor) and isinstance(x, torch.Tensor) and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)  # as Linear4bit.forward does (its bias stays float32 while x is 16-bit)
    packed, qs = _unpack_module(weight, quant_state)
    w = _weight(packed, qs) if not torch.compiler.is_compiling() else _checked_weight(packed, qs)  # no cache
    _check_x(x, w, False)
    _check_bias(bias, x, w)
    if ftz is not None and not isinstance(ftz, (bool, np.bool_)):
        raise TypeError(f"ftz must be True, False or None (the device's default), got {type(ftz).__name__} {ftz!r}")
    if config is not None and not isinstance(config, LinearConfig):
        raise TypeError(f"config must be a nf4.LinearConfig, got {type(config).__name__}")
    ftz = x.device.type == "cuda" if ftz is None else bool(ftz)
    if torch.compiler.is_compiling():
        from ..ops import linear_op

        if not _fused_ok(x, w, math.prod(x.shape[:-1])):
            return torch.nn.functional.linear(x, _dequantize(packed, qs, ftz=ftz).to(x.dtype), bias)

        return linear_op(x, packed, (w.absmax, w.absmax2, w.code2, w.offset, w.N, w.K, w.blocksize, w.dtype), bias,
                         ftz)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearFn.apply(x, bias, _plain(packed), w, config, ftz)
    return _forward(x, packed, w, bias, config, ftz)
