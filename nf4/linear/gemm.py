"""`nf4_gemm_kernel`: tl.dot on a decoded tile (forward x @ W^T and TRANS dY @ W), float32 accumulation.

A step decodes BLOCK_K / 2 bytes of BLOCK_N rows into their even and odd weights and multiplies each half with
the matching half of x's columns (two tl.dot of K = BLOCK_K / 2). Triton's interpreter runs it at every M
(nf4.linear.tuned.INTERPRETER); PERSIST loops a fixed grid over the tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import round_to, widen
from .common import bits16, decode, dot, grouped, load_bytes, split_pairs16


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
