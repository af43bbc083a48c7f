"""What nf4.linear's launch table (`launch.py`) hands a kernel file, and the launch helpers the kernel files share.

`Call` is one fused product to launch with a runnable config; a kernel file's `launches(call)` turns it into
[(kernel, grid, args, options)], starting from `call.args` (the arguments every kernel takes, built by
`launch.base_args`). The rest: the dtype codes, the split-K arithmetic (`split_by`, `gemv_split`, `auto_split`),
the split-K sum's launch (`with_split_sum`), the GEMV launch options, and the alignment and architecture checks
the kernels' `runnable` use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from .. import runtime
from ..weight import NF4Weight
from .common import nf4_split_sum_kernel
from .config import LinearConfig

DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernels' dtype codes (W_DT, X_DT)
SUM_BLOCK = 128  # one output per thread of 4 warps: the split sum is a few loads deep, spread wide


@dataclass(frozen=True, eq=False)
class Call:
    """One fused product x @ W^T (+ bias) with a config its kernel can run (`launch.launch_config`).

    x: [m, K] contiguous rows (16-bit); w: the weight [N, K]; out: [m, N] in x's dtype; part: float32 scratch for
    split-K partial sums (split * m * N, or None where the split is 1); code: the level table the kernel asked
    for (`level_pairs`), dummy: a stand-in for absent tensors (256 bytes of zeros); interpreting: Triton's
    interpreter runs the launch (no PTX); args: the base arguments (`launch.base_args`), a dict of this call's
    own that `launches` may copy and change; sms: the multiprocessors of the GPU the launch runs on (`gpu_sms`:
    None in the interpreter and for meta tensors)."""

    x: torch.Tensor
    w: NF4Weight
    bias: torch.Tensor | None
    out: torch.Tensor
    m: int
    config: LinearConfig
    ftz: bool
    interpreting: bool
    part: torch.Tensor | None
    code: torch.Tensor
    dummy: torch.Tensor
    args: dict
    sms: int | None


def gpu_sms(device: torch.device) -> int | None:
    """The multiprocessors of `device` where launches on it run compiled on a CUDA GPU; None in Triton's
    interpreter and for meta tensors (offline builds), where the kernels' auto splits are 1."""
    if runtime.interpreting(device) or device.type != "cuda":
        return None
    return runtime.sm_count(device)


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


def split_by(config: LinearConfig, w: NF4Weight, unit: int, auto: Callable[[int], int]) -> tuple[int, int]:
    """(programs along K, bytes of a row each) for steps of `unit` bytes: config.split_k, or where it is 0
    auto(steps), capped at the steps; each program a whole number of steps."""
    kb = w.shape[1] // 2
    steps = triton.cdiv(kb, unit)
    split = max(1, min(config.split_k or auto(steps), steps))
    seg = triton.cdiv(steps, split) * unit
    return triton.cdiv(kb, seg), seg


def gemv_split(config: LinearConfig, w: NF4Weight, sms: int | None, unit: int) -> tuple[int, int]:
    """The GEMVs' split: auto is the fewest steps per program over waves of programs_per_sm programs per
    multiprocessor (`auto_split`), 1 off the GPU (sms None)."""
    n = w.shape[0]

    def auto(steps: int) -> int:
        if sms is None:
            return 1
        return auto_split(triton.cdiv(n, config.block_r), steps, config.programs_per_sm * sms)

    return split_by(config, w, unit, auto)


def gemv_options(config: LinearConfig) -> dict:
    """The GEMV kernels' launch options: num_warps, and maxnreg where the config caps the registers."""
    options = {"num_warps": config.num_warps}
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    return options


def with_split_sum(launch: tuple, split: int, call: Call) -> list[tuple]:
    """A launch as is (split 1), or writing float32 partial sums [split, m, N] into `call.part` followed by
    nf4_split_sum_kernel, which adds them in split order, adds the bias and rounds once into `call.out`."""
    kernel, grid, args, options = launch
    if split == 1:
        return [launch]
    m, n = call.m, call.w.shape[0]
    sum_args = {"part_ptr": call.part, "bias_ptr": args["bias_ptr"], "out_ptr": call.out, "MN": m * n, "N": n,
                "SPLIT": split, "HAS_BIAS": call.bias is not None, "X_DT": args["X_DT"],
                "BF16_BITS": args["BF16_BITS"], "BLOCK": SUM_BLOCK}
    args.update(out_ptr=call.part, HAS_BIAS=False)
    return [(kernel, grid, args, options),
            (nf4_split_sum_kernel, (triton.cdiv(m * n, SUM_BLOCK),), sum_args, {"num_warps": 4})]


def aligned(t: torch.Tensor, n: int) -> bool:
    """Whether the tensor's data start on an n-byte boundary. A FakeTensor (torch.compile's trace) has no data
    pointer: its offset into the storage decides, as storages start aligned."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return t.storage_offset() * t.element_size() % n == 0
    return t.data_ptr() % n == 0


def packs_16bit(device: torch.device) -> bool:
    """Whether PTX's cvt.rn.{f16,bf16}x2.f32 (sm_80 and later) can run on `device`: a CUDA device of compute
    capability 8.0 or more, or Triton's interpreter (no PTX); not the meta device (offline builds)."""
    if device.type == "cuda":
        return runtime.capability(device) >= (8, 0)
    return device.type != "meta"
