"""`nf4_gemm_kernel`: tl.dot on a decoded tile (forward x @ W^T and TRANS dY @ W), float32 accumulation.

Once nf4.linear's kernel "gemm"; no GPU row of the tuned table took it (the word tl.dot kernel and nf4.dequantize +
cuBLAS did), and the backward on every GPU measured was nf4.dequantize + cuBLAS, so only Triton's interpreter ran it
(its rows now take the GPUs' own kernels). It lives here for the variants that study it: l10-l18 (the forward
tile and its meta-parameters) and l21 (the fused backward, TRANS). `launches` builds exactly the launches
nf4.linear.launch.kernel_args built for a "gemm" config (tests/experiments/test_linear_variants.py holds them,
captured from the product before the move); `launch` runs them through nf4.runtime (the compiled-kernel cache,
contraction on, recordable for the offline sm_75 compile), into the runner's buffer.

A step decodes BLOCK_K / 2 bytes of BLOCK_N rows into their even and odd weights and multiplies each half with
the matching half of x's columns (two tl.dot of K = BLOCK_K / 2); PERSIST loops a fixed grid over the tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nf4 import NF4Weight, runtime
from nf4.device import round_to, widen
from nf4.linear.common import bits16, decode, dot, grouped
from nf4.linear.launch import DT

INTERPRET_PROGRAMS = 3  # programs of a persistent grid in Triton's interpreter (several tiles each on small cases)


@dataclass(frozen=True)
class GemmConfig:
    """nf4_gemm_kernel's meta-parameters (the fields of nf4.linear.LinearConfig it read, with their defaults)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128  # weights of a row per step, capped at the blocksize (one absmax per row and step)
    group: int = 8  # programs along M that share a W tile
    swap: bool = False  # forward: out^T = W @ x^T, the decoded tile as tl.dot's first operand
    persistent: int = 0  # programs per multiprocessor that loop over the output tiles; 0: one program per tile
    num_stages: int = 3
    num_warps: int = 4
    codebook: int = 2  # 0 16-entry table gather, 1 select tree, 2 256-entry table of level pairs
    evict: str = "evict_first"
    bf16_bits: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "group"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {v}")
        if self.codebook not in (0, 1, 2) or self.persistent < 0:
            raise ValueError(f"GemmConfig: codebook in 0..2 and persistent >= 0, got {self.codebook}, "
                             f"{self.persistent}")

    def with_(self, **changes) -> GemmConfig:
        return replace(self, **changes)


# nf4.linear.tuned.GEMM while nf4 named it: the interpreter's tl.dot row
GEMM = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=1, codebook=0)


@triton.jit
def load_bytes(packed_ptr, rows, row_ok, c0, KB, end, HALF: tl.constexpr, EVICT: tl.constexpr):
    """Bytes c0 .. c0 + HALF of W's `rows` (rows of KB bytes) as [R, HALF] uint8; zeros from byte `end`
    of a row on and in rows past the weight."""
    j = c0 + tl.arange(0, HALF)
    ok = row_ok[:, None] & (j < end)[None, :]
    return tl.load(packed_ptr + rows[:, None] * KB + j[None, :], mask=ok, other=0, eviction_policy=EVICT)


@triton.jit
def split_pairs16(pair, X_DT: tl.constexpr):
    """uint32 pairs of 16-bit x values -> (even, odd) in x's dtype (bit moves only)."""
    if X_DT == 2:
        dt = tl.bfloat16
    else:
        dt = tl.float16
    even = (pair & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    odd = (pair >> 16).to(tl.uint16).to(dt, bitcast=True)
    return even, odd


@triton.jit
def _gemm_tile(pid, x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
               M, N, K, KB, BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr,
               ASM: tl.constexpr, CODEBOOK: tl.constexpr, W_DT: tl.constexpr, X_DT: tl.constexpr,
               TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SWAP: tl.constexpr, BF16_BITS: tl.constexpr,
               EVICT: tl.constexpr, DOT_F32: tl.constexpr):
    """Output tile `pid` (in the program order below) of nf4_gemm_kernel, whose parameters these are."""
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    HALF: tl.constexpr = BLOCK_K // 2
    if not TRANS:
        n_o = tl.cdiv(N, BLOCK_N)
    else:
        n_o = tl.cdiv(KB, HALF)
    pid_m, pid_o = grouped(pid, tl.cdiv(M, BLOCK_M), n_o, GROUP)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    if not TRANS:
        xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] in one load
        rows = pid_o * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        nxt = load_bytes(packed_ptr, rows, row_ok, 0, KB, KB, HALF, EVICT)
        for c0 in range(0, KB, HALF):
            byte = nxt
            nxt = load_bytes(packed_ptr, rows, row_ok, c0 + HALF, KB, KB, HALF, EVICT)
            w_even, w_odd = decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            j = c0 + tl.arange(0, HALF)
            pair = tl.load(xw_ptr + m[:, None] * KB + j[None, :], mask=m_ok[:, None] & (j < KB)[None, :], other=0)
            x_even, x_odd = split_pairs16(pair, X_DT)
            if SWAP:
                acc = dot(w_even, tl.trans(x_even), acc, DOT_F32)
                acc = dot(w_odd, tl.trans(x_odd), acc, DOT_F32)
            else:
                acc = dot(x_even, tl.trans(w_even), acc, DOT_F32)
                acc = dot(x_odd, tl.trans(w_odd), acc, DOT_F32)
        if SWAP:
            acc = tl.trans(acc)
        if HAS_BIAS:
            acc = acc + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)[None, :]
        out = round_to(acc, X_DT, BF16_BITS)
        tl.store(out_ptr + m[:, None] * N + rows[None, :], out, mask=m_ok[:, None] & row_ok[None, :])
    else:
        c0 = pid_o * HALF
        acc_even = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
        nxt = load_bytes(packed_ptr, tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_N) < N, c0, KB, KB, HALF, EVICT)
        for r0 in range(0, N, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            row_ok = rows < N
            byte = nxt
            nxt = load_bytes(packed_ptr, rows + BLOCK_N, rows + BLOCK_N < N, c0, KB, KB, HALF, EVICT)
            w_even, w_odd = decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            dy = tl.load(x_ptr + m[:, None] * N + rows[None, :], mask=m_ok[:, None] & row_ok[None, :], other=0.0)
            acc_even = dot(dy, w_even, acc_even, DOT_F32)
            acc_odd = dot(dy, w_odd, acc_odd, DOT_F32)
        # columns 2j and 2j + 1 of dX as one 32-bit word
        j = c0 + tl.arange(0, HALF)
        pair = bits16(acc_even, X_DT, BF16_BITS) | (bits16(acc_odd, X_DT, BF16_BITS) << 16)
        outw_ptr = out_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        tl.store(outw_ptr + m[:, None] * KB + j[None, :], pair, mask=m_ok[:, None] & (j < KB)[None, :])


@triton.jit(do_not_specialize=["M"])
def nf4_gemm_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    CODEBOOK: tl.constexpr, W_DT: tl.constexpr, X_DT: tl.constexpr, TRANS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # weights of a row per step (at most BLOCKSIZE): BLOCK_K / 2 bytes
    GROUP: tl.constexpr,  # output tiles along M that run next to each other (W tile reuse in L2)
    SWAP: tl.constexpr,  # forward: compute out^T = W @ x^T (the decoded tile is tl.dot's first operand)
    BF16_BITS: tl.constexpr, EVICT: tl.constexpr,
    DOT_F32: tl.constexpr,  # multiply float32 copies of the 16-bit operands (exact; Triton's interpreter
    # multiplies bfloat16 tiles as their integer bits)
    PERSIST: tl.constexpr,  # the programs loop over the output tiles (grid: fewer programs than tiles)
):
    """Forward: out[M, N] = x[M, K] @ W^T (+ bias); TRANS: out[M, K] = x[M, N] @ W. The grid is
    cdiv(M, BLOCK_M) * cdiv(N or K, BLOCK_N or BLOCK_K) programs. A step decodes BLOCK_K / 2 bytes of
    BLOCK_N rows into their even and odd weights and multiplies each half with the matching half of
    x's columns (two tl.dot of K = BLOCK_K / 2), so no interleave of the decoded tile is needed. PERSIST: a
    grid of any size, each program taking tiles pid, pid + programs, ... in the same order."""
    if PERSIST:
        if not TRANS:
            n_o = tl.cdiv(N, BLOCK_N)
        else:
            n_o = tl.cdiv(KB, BLOCK_K // 2)
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * n_o, tl.num_programs(0)):
            _gemm_tile(tile, x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr,
                       out_ptr, M, N, K, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, TRANS, HAS_BIAS,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP, SWAP, BF16_BITS, EVICT, DOT_F32)
    else:
        _gemm_tile(tl.program_id(0), x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr,
                   bias_ptr, out_ptr, M, N, K, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, TRANS,
                   HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, SWAP, BF16_BITS, EVICT, DOT_F32)


def launches(x, w: NF4Weight, bias, out, m: int, trans: bool, config: GemmConfig, ftz: bool, interpreting: bool,
             *, code=None, dummy=None) -> list[tuple]:
    """[(nf4_gemm_kernel, grid, args, options)]: one launch of x [m, K] @ W^T (trans: x [m, N] @ W) into `out`."""
    device = w.packed.device
    if dummy is None:
        dummy = runtime.stand_in(device)
    if code is None:
        code = runtime.level_table(device, pairs=config.codebook == 2)
    n, k = w.shape
    kb = k // 2
    block_k = min(w.blocksize, config.block_k)  # one absmax block per row and step
    args = {
        "x_ptr": x, "packed_ptr": w.packed, "absmax_ptr": w.absmax,
        "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
        "offset_ptr": w.offset if w.nested else dummy, "code_ptr": code,
        "bias_ptr": bias if bias is not None else dummy, "out_ptr": out,
        "M": m, "N": n, "K": k, "KB": kb,
        "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": ftz, "ASM": not interpreting,
        "CODEBOOK": config.codebook, "W_DT": DT[w.dtype], "X_DT": DT[x.dtype], "TRANS": trans,
        "HAS_BIAS": bias is not None, "BF16_BITS": interpreting or config.bf16_bits, "EVICT": config.evict,
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": block_k, "GROUP": config.group,
        "SWAP": config.swap and not trans, "DOT_F32": interpreting, "PERSIST": config.persistent > 0,
    }  # fmt: skip
    tiles = triton.cdiv(kb, block_k // 2) if trans else triton.cdiv(n, config.block_n)
    tiles *= triton.cdiv(m, config.block_m)
    if config.persistent:
        on_gpu = x.device.type == "cuda" and not interpreting  # (meta tensors: an offline compile, any grid)
        programs = config.persistent * runtime.sm_count(x.device) if on_gpu else INTERPRET_PROGRAMS
        tiles = min(tiles, programs)
    return [(nf4_gemm_kernel, (tiles,), args, {"num_warps": config.num_warps, "num_stages": config.num_stages})]


def launch(x: torch.Tensor, packed, quant_state, out: torch.Tensor, config: GemmConfig, *, ftz: bool,
           trans: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W^T + bias (trans: x @ W) by nf4_gemm_kernel, through nf4.runtime's launch as nf4.linear launched
    its kernels (enable_fp_fusion on); meta tensors (the offline sm_75 compile) launch as a GPU would."""
    w = NF4Weight.from_state(packed, quant_state)
    interpreting = runtime.interpreting(x.device) and not x.is_meta
    for fn, grid, args, options in launches(x, w, bias, out, x.shape[0], trans, config, ftz, interpreting):
        runtime.launch(fn, grid, args, device=x.device, enable_fp_fusion=True, **options)
    return out


def launcher(config: GemmConfig, trans: bool = False):
    """run(x, packed, quant_state, out, *, ftz) for one config (a registry launcher)."""

    def run(x, packed, quant_state, out, *, ftz):
        return launch(x, packed, quant_state, out, config, ftz=ftz, trans=trans)

    return run
