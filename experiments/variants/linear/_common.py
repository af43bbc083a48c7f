"""What the linear variants share: the product's launches for one LinearConfig, written into the runner's buffer.

`launch(x, packed, quant_state, out, config, ftz=..., trans=...)` issues exactly the launches
`nf4.linear.api.run` issues for that config (`nf4.linear.launch.launch_config`, then `kernel_args`'s
launches through `nf4.runtime.launch`: the compiled kernel cached per specialisation, contraction
on as in the product), but into `out`
rather than a fresh tensor, so that the runner's NaN-poisoned buffer proves every element was
written. What it skips is api.run's bound plan (the cheap repeat call): device time is the
product's, host time is not (no linear variant is marked host_timing). config=None is the tuned
table's choice for this GPU and M, as api.run resolves it; kernel "dequant" is nf4.dequantize into a
scratch weight, then cuBLAS (`torch.matmul(x, W^T, out=out)`, what F.linear runs without a bias). trans
(dY @ W) is always that path, as in nf4.linear (the fused backward kernel is l21's: `_gemm_kernel.py`).

On meta tensors (recording for the offline sm_75 compile) the launches are built as on a GPU
(ASM on, DOT_F32 off, the table's GPU rows) for a T4: the auto split-K of the GEMV is resolved
with the T4's 40 multiprocessors, the way nf4.linear.launch.split_k resolves it on a device (auto_split).
"""

from __future__ import annotations

import torch
import triton

import nf4
from nf4 import NF4Weight, runtime
from nf4.linear import launch as linear_launch
from nf4.linear import tuned as linear_tuned
from nf4.linear.config import LinearConfig

SM75_DEVICE = "Tesla T4"  # the device name the tuned table is read for on meta tensors (no rows: the default's)
T4_SMS = 40


def launch(x: torch.Tensor, packed, quant_state, out: torch.Tensor, config: LinearConfig | None, *, ftz: bool,
           trans: bool = False, max_rows: int | None = None, expect=None) -> torch.Tensor:
    """out = x @ W^T (trans: x @ W) by the launches of `config` (None: the tuned table's); returns out.

    max_rows: launch for slices of at most this many rows of x (the GEMV family, see l01_gemv.py).
    expect: the kernel the (first) launch must be, else RuntimeError before anything is launched:
    `nf4.linear.launch.launch_config` turns a config whose kernel cannot run this product
    (`launch.runnable`) into its tuned fallback or the next simpler kernel: "gemv_mma" where mma cannot run
    (Triton's interpreter, M > 32, unaligned x or packed bytes, K / 2 not whole steps), "gemv_table" where the
    word GEMV cannot run (M > 4, W dtype != x dtype, unaligned packed bytes, before sm_80, the meta device),
    and a variant must not check or time another kernel under its name (l06_gemv_word_table.py,
    l30_gemv_mma.py)."""
    if max_rows is not None and x.shape[0] > max_rows:
        for i in range(0, x.shape[0], max_rows):
            launch(x[i:i + max_rows], packed, quant_state, out[i:i + max_rows], config, ftz=ftz, trans=trans,
                   expect=expect)
        return out
    w = NF4Weight.from_state(packed, quant_state)  # the validated weight kernel_args takes
    n, k = w.shape
    m = x.shape[0]
    meta = x.is_meta
    interpreting = runtime.interpreting(x.device) and not meta
    if config is None:  # the rows api.run reads: the GPU's name, "" for the interpreter
        name = SM75_DEVICE if meta else "" if interpreting else torch.cuda.get_device_name(x.device)
        config = linear_tuned.tuned(name, m, trans, n=n, k=k)
    if config.kernel != "dequant":
        config = linear_launch.launch_config(config, w, x, m, trans)
    if config.kernel == "dequant":  # the table's, or a kernel's fallback
        if expect is not None:
            raise RuntimeError(f"{expect.__name__} cannot run for this product (M = {m}, W {w.dtype}, x {x.dtype}, "
                               f"{x.device}); nf4.linear would run nf4.dequantize + cuBLAS instead")
        wt = nf4.dequantize(packed, quant_state, ftz=ftz).to(x.dtype)
        return torch.matmul(x, wt if trans else wt.t(), out=out)
    if meta and config.kernel in linear_launch.GEMV_KERNELS and config.split_k == 0:
        steps = triton.cdiv(k // 2, linear_launch.gemv_step(config, w))
        config = config.with_(split_k=linear_launch.auto_split(triton.cdiv(n, config.block_r), steps,
                                                               config.programs_per_sm * T4_SMS))
    split, _ = linear_launch.split_k(config, w, m, x.device)
    part = torch.empty(split * m * out.shape[1], dtype=torch.float32, device=x.device) if split > 1 else None
    launches = linear_launch.kernel_args(x, w, None, out, m, config, ftz, interpreting, part)
    if expect is not None and launches[0][0] is not expect:
        raise RuntimeError(f"{expect.__name__} cannot run for this product (M = {m}, W {w.dtype}, x {x.dtype}, "
                           f"{x.device}); nf4.linear would launch {launches[0][0].__name__} instead")
    for fn, grid, args, options in launches:
        runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
    return out


def launcher(config: LinearConfig | None, trans: bool = False, max_rows: int | None = None, expect=None):
    """run(x, packed, quant_state, out, *, ftz) for one config (a registry launcher)."""

    def run(x, packed, quant_state, out, *, ftz):
        return launch(x, packed, quant_state, out, config, ftz=ftz, trans=trans, max_rows=max_rows, expect=expect)

    return run
