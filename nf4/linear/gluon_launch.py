"""The launches of kernel "gemm_gluon" (nf4.linear's launch table): where the Gluon GEMM of gemm_gluon.py may run,
its split-K, x's gather, the TMA descriptors, and its launches, through Triton's JIT (`run`) or bound for repeat
calls (`bind`, `Bound`).

It launches itself (`run`): its arguments include TMA descriptors, which a launch tuple cannot carry. `bind` also
returns the launches bound for nf4.linear's repeat calls: Triton's JIT dispatch and the descriptors' layouts cost a
few hundred microseconds of host time a call on the GPU machines (an H100 profile, session 27), the bound call a
gather, a descriptor and two or three launches.
"""

from __future__ import annotations

import torch
import triton

from .. import runtime
from ..weight import NF4Weight
from .call import Call, aligned, split_by
from .common import nf4_split_sum_kernel
from .config import LinearConfig
from .gemm_gluon import AVAILABLE, DTYPES, SINGLE_MUL, STEP, nf4_permute_x_kernel, quarter_asm

if AVAILABLE:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gemm_gluon import gl, nf4_gemm_gluon_kernel, words_layout


PERMUTE_ROWS, PERMUTE_COLS = 8, 512  # the gather's program: rows x columns of x


def permute_launch(x: torch.Tensor, out: torch.Tensor) -> tuple:
    """(grid, args) of the gather of x [M, K] into `out`."""
    m, k = x.shape
    ncol = triton.cdiv(k, PERMUTE_COLS)
    return ((triton.cdiv(m, PERMUTE_ROWS) * ncol,),
            {"x_ptr": x, "out_ptr": out, "M": m, "K": k, "NCOL": ncol, "ROWS": PERMUTE_ROWS, "COLS": PERMUTE_COLS})


def permute_x(x: torch.Tensor, out: torch.Tensor):
    """x [M, K] (contiguous, K a multiple of 64) into `out` with each step's columns in fragment order; returns
    `out`."""
    grid, args = permute_launch(x, out)
    runtime.launch(nf4_permute_x_kernel, grid, args, device=x.device)
    return out


def runnable(config: LinearConfig, w: NF4Weight, x, m: int) -> bool:
    """A CUDA sm_90 GPU with Triton's Gluon Hopper API (not the interpreter), W's dtype x's (16-bit), blocksize 64,
    rows of whole pairs of steps (K a multiple of 128), x and the packed bytes contiguous and 16-byte aligned (TMA:
    the weight's descriptor is made on the packed tensor itself)."""
    device = w.packed.device
    return (AVAILABLE and device.type == "cuda" and not runtime.interpreting(device)
            and runtime.capability(device) == (9, 0) and w.dtype == x.dtype and x.dtype in DTYPES
            and w.blocksize == STEP and w.shape[1] % (2 * STEP) == 0 and x.is_contiguous()
            and w.packed.is_contiguous() and aligned(x, 16) and aligned(w.packed, 16))


def split(config: LinearConfig, w: NF4Weight, m: int, sms: int | None) -> tuple[int, int]:
    """(programs along K, bytes of a row each): config.split_k, or auto (0): the count (at most 16, at least 8 steps
    each) that brings tiles x splits nearest programs_per_sm programs a multiprocessor; whole pairs of steps, every
    split non-empty."""
    def auto(units: int) -> int:
        if sms is None:
            return 1
        tiles = triton.cdiv(w.shape[0], 16 * config.num_warps) * triton.cdiv(m, config.block_m)
        want, best = config.programs_per_sm * sms, 1
        for s in range(1, 17):
            if units // s < 4:
                break
            if abs(tiles * s - want) < abs(tiles * best - want):
                best = s
        return best

    return split_by(config, w, STEP, auto)  # a unit of two steps: STEP bytes of a row


_LAYOUTS: dict = {}


def layouts(bm: int, warps: int, dtype: torch.dtype) -> tuple:
    """(x's shared layout, the words' shared layout, the words' register layout) of a launch, made once each."""
    key = (bm, warps, dtype)
    got = _LAYOUTS.get(key)
    if got is None:
        dt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        got = _LAYOUTS[key] = (gl.NVMMASharedLayout.get_default_for([bm, 64], dt),
                               gl.NVMMASharedLayout.get_default_for([16 * warps, 8], gl.int32), words_layout(warps))
    return got


def x_descriptor(xp: torch.Tensor, bm: int, layout) -> TensorDescriptor:
    """The TMA descriptor of the permuted x [M, K]: boxes of BM rows x 64 columns."""
    m, k = xp.shape
    return TensorDescriptor(xp, [m, k], [k, 1], [bm, 64], layout)


def w_descriptor(packed: torch.Tensor, n: int, k: int, warps: int, layout) -> TensorDescriptor:
    """The TMA descriptor of the packed bytes as [N, K / 8] int32 words: boxes of 16 * warps rows x 8 words."""
    words = packed.reshape(-1).view(torch.int32).view(n, k // 8)
    return TensorDescriptor(words, [n, k // 8], [k // 8, 1], [16 * warps, 8], layout)


def _gemm(call: Call, x_desc, w_desc) -> tuple:
    """(grid, args by parameter name, split count) of the GEMM launch of `call`."""
    w, config, m = call.w, call.config, call.m
    n, k = w.shape
    bm, warps = config.block_m, config.num_warps
    parts, seg = split(config, w, m, call.sms)
    a = call.args
    args = {"x_desc": x_desc, "w_desc": w_desc, "code_ptr": a["code_ptr"], "absmax_ptr": a["absmax_ptr"],
            "absmax2_ptr": a["absmax2_ptr"], "code2_ptr": a["code2_ptr"], "offset_ptr": a["offset_ptr"],
            "bias_ptr": a["bias_ptr"], "out_ptr": call.part if parts > 1 else call.out, "M": m, "N": n, "K": k,
            "SEG": seg // 32, "BM": bm, "STAGES": config.num_stages, "DOUBLE_QUANT": w.nested,
            "PARTIAL": parts > 1, "HAS_BIAS": call.bias is not None,
            "QUARTER": quarter_asm(call.ftz, "bf16" if call.x.dtype == torch.bfloat16 else "f16"),
            "MUL": SINGLE_MUL[call.ftz], "WORDS": layouts(bm, warps, call.x.dtype)[2], "num_warps": warps}
    return (triton.cdiv(n, 16 * warps), triton.cdiv(m, bm), parts), args, parts


def _sum_args(call: Call, parts: int) -> dict:
    a = call.args
    return {"part_ptr": call.part, "bias_ptr": a["bias_ptr"], "out_ptr": call.out, "MN": call.m * call.w.shape[0],
            "N": call.w.shape[0], "SPLIT": parts, "HAS_BIAS": call.bias is not None, "X_DT": a["X_DT"],
            "BF16_BITS": False, "BLOCK": 128}


def _launch(call: Call) -> tuple:
    """One call's launches through Triton's JIT (the gather, the GEMM, the split sum where split): returns their
    compiled kernels and the GEMM's grid and arguments."""
    x, w, config = call.x, call.w, call.config
    n, k = w.shape
    x_layout, w_layout, _ = layouts(config.block_m, config.num_warps, x.dtype)
    xp = torch.empty_like(x)
    grid, args = permute_launch(x, xp)
    permute = runtime.launch(nf4_permute_x_kernel, grid, args, device=x.device)
    ggrid, gargs, parts = _gemm(call, x_descriptor(xp, config.block_m, x_layout),
                                w_descriptor(w.packed, n, k, config.num_warps, w_layout))
    names = nf4_gemm_gluon_kernel.arg_names
    gemm = nf4_gemm_gluon_kernel[ggrid](*[gargs[p] for p in names if p != "num_warps"],
                                        num_warps=config.num_warps, enable_fp_fusion=False)
    finish = None
    if parts > 1:
        finish = runtime.launch(nf4_split_sum_kernel, (triton.cdiv(call.m * n, 128),), _sum_args(call, parts),
                                device=x.device)
    return permute, gemm, finish, ggrid, gargs, parts


def run(call: Call) -> None:
    """x @ W^T (+ bias) into call.out: x permuted into a scratch copy, the GEMM (into call.part where split), the
    split sum. Launched here (Gluon kernels take TMA descriptors): eager, or inside nf4.linear's opaque op."""
    _launch(call)


class Bound:
    """The launches of one call kept for repeat calls that change only x, the packed tensor, out and the bias
    (nf4.linear's repeat-call cache holds it per checked weight and call key, as it holds other kernels' bound
    launches): `bound(x, packed, bias, out)` gathers x, makes x's descriptor and launches the compiled GEMM and
    split sum, without Triton's JIT dispatch. The weight's descriptor is remade when the packed tensor moves."""

    __slots__ = ("bm", "device_index", "finish", "grid", "head", "k", "launch", "n", "part_numel", "permute", "slots",
                 "state_slots", "values", "w_layout", "warps", "wdesc", "x_layout", "x_shape")

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias, out: torch.Tensor, *state) -> torch.Tensor:
        """state: the weight's absmax, absmax2, code2 and offset tensors where they are not the bound ones (the
        opaque op's plans, shared by weights of the same launch facts); None keeps a bound one."""
        stream = runtime.raw_stream(self.device_index)
        xp = torch.empty_like(x)
        self.permute(stream, x.data_ptr(), xp.data_ptr())
        values = list(self.values)
        for i, t in zip(self.state_slots, state, strict=False):
            if t is not None:
                values[i] = t.data_ptr()
        ix, iw, iout, ibias = self.slots
        values[ix] = TensorDescriptor(xp, self.x_shape, [self.k, 1], [self.bm, 64], self.x_layout)
        wdesc = self.wdesc
        if wdesc[0] != packed.data_ptr():  # (ptr, descriptor): one tuple, swapped whole
            wdesc = self.wdesc = (packed.data_ptr(),
                                  w_descriptor(packed, self.n, self.k, self.warps, self.w_layout))
        values[iw] = wdesc[1]
        if bias is not None:
            values[ibias] = bias.data_ptr()
        if self.finish is None:
            values[iout] = out.data_ptr()
            self.launch(*self.grid, stream, *self.head, *values)
            return out
        part = x.new_empty(self.part_numel, dtype=torch.float32)
        values[iout] = part.data_ptr()
        self.launch(*self.grid, stream, *self.head, *values)
        if bias is None:
            self.finish(stream, part.data_ptr(), out.data_ptr())
        else:
            self.finish(stream, part.data_ptr(), out.data_ptr(), bias.data_ptr())
        return out


def bind(call: Call) -> Bound | None:
    """Run `call` (as `run`) and return its launches bound for repeat calls (`Bound`), or None where a launch
    has no compiled kernel to bind (Triton's interpreter, a recording)."""
    permute, gemm, finish, grid, args, parts = _launch(call)
    if permute is None or gemm is None or (parts > 1 and finish is None):
        return None
    x, w, config = call.x, call.w, call.config
    n, k = w.shape
    bound = Bound()
    bound.device_index = x.device.index
    pgrid, pargs = permute_launch(x, x)
    bound.permute = runtime.bind(permute, nf4_permute_x_kernel, pgrid, pargs, ("x_ptr", "out_ptr"))
    bound.launch, bound.head = runtime.launch_head(gemm)
    bound.grid = grid
    names = list(nf4_gemm_gluon_kernel.arg_names)
    bound.values = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in (args[p] for p in names))
    bound.slots = tuple(names.index(p) for p in ("x_desc", "w_desc", "out_ptr", "bias_ptr"))
    bound.state_slots = tuple(names.index(p) for p in ("absmax_ptr", "absmax2_ptr", "code2_ptr", "offset_ptr"))
    bound.x_shape, bound.bm, bound.n, bound.k, bound.warps = [call.m, k], config.block_m, n, k, config.num_warps
    bound.x_layout, bound.w_layout, _ = layouts(config.block_m, config.num_warps, x.dtype)
    bound.wdesc = (w.packed.data_ptr(), args["w_desc"])
    bound.finish, bound.part_numel = None, parts * call.m * n
    if parts > 1:
        with_bias = ("bias_ptr",) if call.bias is not None else ()
        bound.finish = runtime.bind(finish, nf4_split_sum_kernel, (triton.cdiv(call.m * n, 128),),
                                    _sum_args(call, parts), ("part_ptr", "out_ptr", *with_bias))
    return bound
