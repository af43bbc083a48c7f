"""nf4.linear's launches: the kernels by name, what each can run, and their arguments.

`KERNELS` maps a config's kernel name to its kernel file. A kernel file holds the @triton.jit kernel and what
only it needs to launch:
- `launches(call) -> [(kernel, grid, args, options)]`, from a `Call` (nf4.linear.call) whose `args` are the
  base arguments every kernel takes (`base_args`);
- where it has conditions, `runnable(config, w, x, m) -> bool` (else it runs anywhere);
- where it splits K over programs, `split(config, w, m, sms) -> (programs along K, bytes of a row each)` for a
  GPU of `sms` multiprocessors (None: the interpreter or meta tensors; else one program along K), and
  `step(config, w)` for the GEMVs whose split is in whole steps (GEMV_KERNELS);
- where it reads the 256 level pairs, `level_pairs(config) -> bool` (else the 16 levels);
- where a simpler kernel of the same shape takes over when it cannot run, `SIMPLER` (its name; else the dequant
  path);
- a kernel that launches itself (a Gluon kernel, whose arguments include TMA descriptors) has `run(call)` in
  place of `launches`: `direct(config)` says so, and `run_direct` runs it (eager, or inside the opaque op).
Adding a kernel is one file in this folder plus one entry in `KERNELS` (and its name in LinearConfig's).
`launch_config` turns a tuned or given config into one that can run on this call's tensors (its tuned fallback
otherwise; the backward always takes the dequant path); `kernel_args` builds its launches, shared by the eager
path (nf4.linear.api) and the torch.library op (nf4.linear.ops).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..weight import NF4Weight
from . import gemm_word, gemv, gemv_mma, gemv_pair, gemv_table, gluon_launch
from .call import DT, SUM_BLOCK, Call, auto_split, gpu_sms  # noqa: F401 (DT, SUM_BLOCK, auto_split: re-exported)
from .config import LinearConfig
from .gemv_table import TABLE_MAX_M  # noqa: F401 (re-exported)
from .tuned import DEQUANT, fallback

KERNELS = {
    "gemv": gemv,
    "gemv_table": gemv_table,
    "gemv_mma": gemv_mma,
    "gemm_word": gemm_word,
    "gemv_pair": gemv_pair,
    "gemm_gluon": gluon_launch,  # gemm_gluon.py's kernel, launched by gluon_launch.py
}
GEMV_KERNELS = tuple(name for name, kernel in KERNELS.items() if hasattr(kernel, "step"))  # split in whole steps


def fused(w: NF4Weight) -> bool:
    """Whether the fused kernels take this weight: 2-D, not empty, whole absmax blocks per row (bitsandbytes'
    own condition for its fused path)."""
    return len(w.shape) == 2 and w.shape[0] * w.shape[1] > 0 and w.shape[1] % w.blocksize == 0


def gemm_block_k(config: LinearConfig, w: NF4Weight) -> int:
    """Weights of a row per step of the word tl.dot kernel: 64 or 32, at most the blocksize."""
    return gemm_word.block_k(config, w)


def gemv_step(config: LinearConfig, w: NF4Weight) -> int:
    """Bytes of a row one step of a GEMV (GEMV_KERNELS) covers: a split's length is a whole number of them."""
    return KERNELS[config.kernel].step(config, w)


def split_k(config: LinearConfig, w: NF4Weight, m: int, device) -> tuple[int, int]:
    """(programs along K, bytes of a row each) of the config's kernel for M rows of x on `device` (1 in the
    interpreter where auto); (1, K / 2) for a kernel that does not split K."""
    split = getattr(KERNELS.get(config.kernel), "split", None)
    return split(config, w, m, gpu_sms(device)) if split is not None else (1, w.shape[1] // 2)


def level_pairs(config: LinearConfig) -> bool:
    """Whether the config's kernel reads the 256-entry table of level pairs (else the 16 levels)."""
    pairs = getattr(KERNELS.get(config.kernel), "level_pairs", None)
    return pairs is not None and pairs(config)


def runnable(config: LinearConfig, w: NF4Weight, x: torch.Tensor, m: int) -> bool:
    """Whether `config`'s kernel can run this forward product (x is the (M, K) operand the kernels read)."""
    check = getattr(KERNELS.get(config.kernel), "runnable", None)
    return check is None or check(config, w, x, m)


def launch_config(config: LinearConfig, w: NF4Weight, x: torch.Tensor, m: int, trans: bool) -> LinearConfig:
    """The config to launch: the backward (trans) takes the dequant path; a kernel that cannot run this forward
    product (`runnable`) its tuned fallback, else the next simpler kernel with the same shape (its file's SIMPLER,
    with the 16-entry table), else the dequant path."""
    if trans:
        return DEQUANT
    while not runnable(config, w, x, m):
        simpler = getattr(KERNELS[config.kernel], "SIMPLER", None)
        config = fallback(config, m, *w.shape, runtime.device_name(x.device)) or (
            config.with_(kernel=simpler, codebook=0, warps_k=1) if simpler is not None else DEQUANT)
    return config


def base_args(x, w: NF4Weight, bias, out, m: int, config: LinearConfig, ftz: bool, interpreting: bool, code,
              dummy) -> dict:
    """The arguments every kernel starts from (a kernel's `launches` adds its own and drops what it lacks)."""
    n, k = w.shape
    return {
        "x_ptr": x, "packed_ptr": w.packed, "absmax_ptr": w.absmax,
        "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
        "offset_ptr": w.offset if w.nested else dummy, "code_ptr": code,
        "bias_ptr": bias if bias is not None else dummy, "out_ptr": out,
        "M": m, "N": n, "K": k, "KB": k // 2,
        "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": ftz, "ASM": not interpreting,
        "CODEBOOK": config.codebook, "W_DT": DT[w.dtype], "X_DT": DT[x.dtype],
        "HAS_BIAS": bias is not None, "BF16_BITS": interpreting or config.bf16_bits, "EVICT": config.evict,
    }  # fmt: skip


def kernel_args(x, w: NF4Weight, bias, out, m: int, config: LinearConfig, ftz: bool, interpreting: bool,
                part=None, *, code=None, dummy=None) -> list[tuple]:
    """The launches of one fused forward product x @ W^T (+ bias) with a runnable config, [(kernel, grid, args,
    options)]: one, or for a split-K kernel the partial products into `part` (float32, split * m * N) and their
    ordered sum. `code` and `dummy` (the level table and a stand-in for absent tensors) are looked up unless
    given. The config's kernel is trusted (an offline build passes the config it wants)."""
    device = w.packed.device
    if dummy is None:
        dummy = runtime.stand_in(device)
    if code is None:
        code = runtime.level_table(device, pairs=level_pairs(config))
    args = base_args(x, w, bias, out, m, config, ftz, interpreting, code, dummy)
    return KERNELS[config.kernel].launches(Call(x, w, bias, out, m, config, ftz, interpreting, part, code, dummy,
                                                args, gpu_sms(x.device)))


def direct(config: LinearConfig) -> bool:
    """Whether the config's kernel launches itself (`run(call)`) rather than handing back launches."""
    return hasattr(KERNELS.get(config.kernel), "run")


def _direct_call(x, w: NF4Weight, bias, out, m: int, config: LinearConfig, ftz: bool, part) -> Call:
    device = w.packed.device
    code = runtime.level_table(device, pairs=level_pairs(config))
    dummy = runtime.stand_in(device)
    args = base_args(x, w, bias, out, m, config, ftz, False, code, dummy)
    return Call(x, w, bias, out, m, config, ftz, False, part, code, dummy, args, gpu_sms(x.device))


def run_direct(x, w: NF4Weight, bias, out, m: int, config: LinearConfig, ftz: bool, part=None) -> torch.Tensor:
    """One fused forward product by a kernel that launches itself (`direct`), with a runnable config, into out."""
    KERNELS[config.kernel].run(_direct_call(x, w, bias, out, m, config, ftz, part))
    return out


def bind_direct(x, w: NF4Weight, bias, out, m: int, config: LinearConfig, ftz: bool, part=None):
    """`run_direct`, returning the kernel's launches bound for repeat calls (its `bind(call)`: a callable
    `(x, packed, bias, out) -> out`), or None where the kernel binds nothing."""
    kernel = KERNELS[config.kernel]
    call = _direct_call(x, w, bias, out, m, config, ftz, part)
    return kernel.bind(call) if hasattr(kernel, "bind") else kernel.run(call)


def dense_product(x, wt, bias, trans: bool) -> torch.Tensor:
    """The cuBLAS product of the dequant path on the dequantized weight wt [N, K] converted to x's dtype: x @ W
    (trans) or F.linear(x, W, bias); nf4.linear.ops' opaque op runs this same call under torch.compile."""
    if wt.dtype is not x.dtype:
        wt = wt.to(x.dtype)
    return x @ wt if trans else torch.nn.functional.linear(x, wt, bias)
