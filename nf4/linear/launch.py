"""nf4.linear's launches: the kernels by name, what each can run, and their arguments.

`KERNELS` maps a config's kernel name to its @triton.jit function: adding a kernel is one file in
this folder plus one entry here (and, where it has conditions, one line in `runnable`).
`launch_config` turns a tuned or given config into one that can run on this call's tensors (its
tuned fallback otherwise); `kernel_args` builds its launches, shared by the eager path (nf4.linear.api)
and the torch.library op (nf4.linear.ops).
"""

from __future__ import annotations

import torch
import triton

from .. import runtime
from ..weight import NF4Weight
from .common import nf4_split_sum_kernel
from .config import LinearConfig
from .gemm import nf4_gemm_kernel
from .gemm_word import nf4_gemm_word_kernel
from .gemv import nf4_gemv_kernel
from .gemv_mma import nf4_gemv_mma_kernel
from .gemv_table import nf4_gemv_table_kernel
from .tuned import INTERPRET_PROGRAMS, fallback

KERNELS = {
    "gemv": nf4_gemv_kernel,
    "gemv_table": nf4_gemv_table_kernel,
    "gemv_mma": nf4_gemv_mma_kernel,
    "gemm": nf4_gemm_kernel,
    "gemm_word": nf4_gemm_word_kernel,
}
GEMV_KERNELS = ("gemv", "gemv_table", "gemv_mma")
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TABLE_MAX_M = 4  # rows of x the word GEMV (gemv_table) takes
MMA_MAX_M = 32  # rows of x the tensor-core GEMV (gemv_mma) takes: up to 4 tiles of B's 8 columns
SUM_BLOCK = 128  # one output per thread of 4 warps: the split sum is a few loads deep, spread wide


def fused(w: NF4Weight) -> bool:
    """Whether the fused kernels take this weight: 2-D, not empty, whole absmax blocks per row (bitsandbytes'
    own condition for its fused path)."""
    return len(w.shape) == 2 and w.shape[0] * w.shape[1] > 0 and w.shape[1] % w.blocksize == 0


def gemm_block_k(config: LinearConfig, w: NF4Weight) -> int:
    """Weights of a row per step of the word tl.dot kernel: 64 or 32, at most the blocksize."""
    return min(64, config.block_k, w.blocksize)


def gemv_step(config: LinearConfig, w: NF4Weight) -> int:
    """Bytes of a row one GEMV forward step covers (a split's length is a whole number of them): one absmax
    block at most; the tensor-core GEMV's step is 4 lanes' worth (4 * min(that, 32))."""
    half = min(w.blocksize // 2, config.step_bytes)
    return 4 * min(half, 32) if config.kernel == "gemv_mma" else half


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


def split_k(config: LinearConfig, w: NF4Weight, m: int, trans: bool, device) -> tuple[int, int]:
    """(programs along K, bytes of a row each) for the GEMV forward and the word tl.dot kernel (1 in the
    interpreter where auto); (1, K / 2) for everything else."""
    n, k = w.shape
    kb = k // 2
    word = config.kernel == "gemm_word" and not trans
    if not word and (config.kernel not in GEMV_KERNELS or trans):
        return 1, kb
    unit = gemm_block_k(config, w) // 2 if word else gemv_step(config, w)
    steps = triton.cdiv(kb, unit)
    split = config.split_k
    on_gpu = not runtime.interpreting(device) and device.type == "cuda"
    if split == 0 and word:  # the split nearest programs_per_sm programs per multiprocessor, >= 4 steps each
        split = 1
        if on_gpu:
            tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
            want = config.programs_per_sm * runtime.sm_count(device)
            split = max(1, min((want + tiles // 2) // tiles, steps // 4))
    elif split == 0:  # auto: the fewest steps per program over waves of programs_per_sm per multiprocessor
        split = auto_split(triton.cdiv(n, config.block_r), steps,
                           config.programs_per_sm * runtime.sm_count(device)) if on_gpu else 1
    split = max(1, min(split, steps))
    seg = triton.cdiv(steps, split) * unit
    return triton.cdiv(kb, seg), seg


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


def runnable(config: LinearConfig, w: NF4Weight, x: torch.Tensor, m: int) -> bool:
    """Whether `config`'s kernel can run this forward product (x is the (M, K) operand the kernels read)."""
    packed = w.packed
    if config.kernel == "gemv_table":  # W's dtype is x's, 4-byte aligned packed bytes, a step of whole words
        half = min(w.blocksize // 2, config.step_bytes)
        return (m <= TABLE_MAX_M and w.dtype == x.dtype and packs_16bit(packed.device) and aligned(packed, 4)
                and half % 16 == 0)
    if config.kernel == "gemv_mma":  # CUDA sm_80+, x contiguous, x and W 16-byte aligned, rows of whole steps
        half = min(w.blocksize // 2, config.step_bytes, 32)
        return (m <= MMA_MAX_M and w.dtype == x.dtype and packed.device.type == "cuda"
                and packs_16bit(packed.device) and half % 16 == 0 and (w.shape[1] // 2) % (4 * half) == 0
                and x.is_contiguous() and aligned(x, 16) and aligned(packed, 16))
    if config.kernel == "gemm_word":  # W's dtype is x's, steps of 32 or 64 weights, 4-byte aligned packed bytes
        return w.dtype == x.dtype and w.blocksize >= 32 and packs_16bit(packed.device) and aligned(packed, 4)
    return True


def launch_config(config: LinearConfig, w: NF4Weight, x: torch.Tensor, m: int, trans: bool) -> LinearConfig:
    """The config to launch: the backward takes the FMA GEMV or tl.dot kernel of the config's family (with the
    16-entry table); a kernel that cannot run this forward product (`runnable`) its tuned fallback, else the
    next simpler kernel with the same shape (_DOWN)."""
    if trans:
        if config.kernel in ("gemv_table", "gemv_mma"):
            return config.with_(kernel="gemv", codebook=0, warps_k=1)
        if config.kernel == "gemm_word":
            return config.with_(kernel="gemm", codebook=0)
        return config
    while not runnable(config, w, x, m):
        # an untuned config keeps its shape: gemv_mma -> gemv_table -> gemv, gemm_word -> gemm (16-entry table)
        config = fallback(config, m) or config.with_(kernel=_DOWN[config.kernel], codebook=0, warps_k=1)
    return config


_DOWN = {"gemv_mma": "gemv_table", "gemv_table": "gemv", "gemm_word": "gemm"}


def kernel_args(x, w: NF4Weight, bias, out, m: int, trans: bool, config: LinearConfig, ftz: bool,
                interpreting: bool, part=None, *, code=None, dummy=None) -> list[tuple]:
    """The launches of one fused product with a runnable config, [(kernel, grid, args, options)]: one, or for a
    split-K kernel the partial products into `part` (float32, split * m * N) and their ordered sum. `code` and
    `dummy` (the level table and a stand-in for absent tensors) are looked up unless given."""
    device = w.packed.device
    if dummy is None:
        dummy = runtime.stand_in(device)
    if code is None:
        code = runtime.level_table(device, pairs=config.codebook == 2 and config.kernel in ("gemv", "gemm"))
    n, k = w.shape
    kb = k // 2
    args = {
        "x_ptr": x, "packed_ptr": w.packed, "absmax_ptr": w.absmax,
        "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
        "offset_ptr": w.offset if w.nested else dummy, "code_ptr": code,
        "bias_ptr": bias if bias is not None else dummy, "out_ptr": out,
        "M": m, "N": n, "K": k, "KB": kb,
        "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": ftz, "ASM": not interpreting,
        "CODEBOOK": config.codebook, "W_DT": DT[w.dtype], "X_DT": DT[x.dtype], "TRANS": trans,
        "HAS_BIAS": bias is not None, "BF16_BITS": interpreting or config.bf16_bits, "EVICT": config.evict,
    }  # fmt: skip
    fn = KERNELS[config.kernel]
    if config.kernel in GEMV_KERNELS:
        half = min(w.blocksize // 2, config.step_bytes)  # one absmax block per row and step
        split, seg = split_k(config, w, m, trans, x.device)
        args.update(BLOCK_M=triton.next_power_of_2(m), BLOCK_R=config.block_r, HALF=half, SPLIT=split, SEG=seg,
                    PARTIAL=split > 1 and not trans)
        options = {"num_warps": config.num_warps}
        if config.maxnreg is not None:
            options["maxnreg"] = config.maxnreg
        if trans:
            return [(fn, (triton.cdiv(kb, half),), args, options)]
        if config.kernel == "gemv_mma":
            for name in ("CODEBOOK", "W_DT", "TRANS", "ASM", "EVICT", "BLOCK_M", "BLOCK_R"):
                del args[name]
            args.update(THREADS=32 * config.num_warps, HALF=min(half, 32),
                        NTILE=triton.next_power_of_2(triton.cdiv(m, 8)),  # 8-row tiles of x: 1, 2 or 4
                        WARPS_K=config.warps_k, zero_ptr=dummy)  # dummy: zeros, enough for a step of x
        elif config.kernel == "gemv_table":
            for name in ("CODEBOOK", "W_DT", "TRANS"):
                del args[name]
            args["HALF"] = min(half, 32)
        grid = (triton.cdiv(n, config.block_r) * split,)
        return _with_split_sum((fn, grid, args, options), split, part, out, bias, m, n)
    if config.kernel == "gemm_word":
        split, seg = split_k(config, w, m, trans, x.device)
        for name in ("CODEBOOK", "W_DT", "TRANS"):
            del args[name]
        args.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=gemm_block_k(config, w),
                    GROUP=config.group, SWAP=config.swap, SPLIT=split, SEG=seg, PARTIAL=split > 1,
                    DOT_F32=interpreting)
        grid = (split * triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        return _with_split_sum((fn, grid, args, options), split, part, out, bias, m, n)
    block_k = min(w.blocksize, config.block_k)  # one absmax block per row and step
    args.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP=config.group,
                SWAP=config.swap and not trans, DOT_F32=interpreting, PERSIST=config.persistent > 0)
    tiles = triton.cdiv(kb, block_k // 2) if trans else triton.cdiv(n, config.block_n)
    tiles *= triton.cdiv(m, config.block_m)
    if config.persistent:
        on_gpu = x.device.type == "cuda" and not interpreting  # (meta tensors: an offline compile, any grid)
        programs = config.persistent * runtime.sm_count(x.device) if on_gpu else INTERPRET_PROGRAMS
        tiles = min(tiles, programs)
    return [(fn, (tiles,), args, {"num_warps": config.num_warps, "num_stages": config.num_stages})]


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


def dense_product(x, wt, bias, trans: bool) -> torch.Tensor:
    """The cuBLAS product of the dequant path on the dequantized weight wt [N, K] converted to x's dtype: x @ W
    (trans) or F.linear(x, W, bias); nf4.linear.ops' opaque op runs this same call under torch.compile."""
    if wt.dtype is not x.dtype:
        wt = wt.to(x.dtype)
    return x @ wt if trans else torch.nn.functional.linear(x, wt, bias)
