"""The fused NF4 linear kernels: `x @ W^T` and its backward `dY @ W`, decoding W inside the kernel.

W is bitsandbytes' NF4 weight of shape [N, K] (out_features, in_features) in its native packed
layout: row n is K / 2 bytes starting at byte n * K / 2, element 2j of a row is the high nibble of
byte j, and absmax block b covers elements b * BLOCKSIZE .. (b + 1) * BLOCKSIZE of the flattened
weight. The API requires BLOCKSIZE to divide K (bitsandbytes' own condition for its fused path), so
a block never straddles two rows and each row is a whole number of blocks.

Decoding (nf4.device, docs/FORMAT.md §3-5 and §10): every weight is `NF4[code] * absmax` rounded
once in float32 (FTZ like bitsandbytes' CUDA build), rounded to the weight's dtype (what
`nf4.dequantize` returns) and converted to x's dtype where that differs (bitsandbytes'
`dequantize_4bit(W).to(x.dtype)`): the kernels' operand is the dequantized weight bit for bit.
A decoded tile is [rows, CHUNKS, CH] bytes: CH consecutive bytes lie in one absmax block
(CH = min(bytes per block, bytes per step)), so the absmax is recovered once per (row, chunk)
and broadcast over its bytes rather than gathered per weight.

Two kernels:
- `nf4_gemv_kernel` (small M): plain FMAs into a [BLOCK_M, rows, CHUNKS, CH] float32 accumulator,
  one lane per (m, row, byte); the byte's two weights meet x[2j] and x[2j + 1]. Forward: a program
  owns BLOCK_R rows of W and walks along K; the lanes are summed once at the end (two `tl.sum`s).
  TRANS (backward, dX = dY @ W): a program owns BLOCK_C bytes of every row (2 * BLOCK_C columns of
  dX) and walks down the rows; even and odd columns keep separate accumulators. The products of
  two 16-bit floats are exact in float32, so an FMA and a multiply-add give the same sum; the
  order of the float32 additions is the kernel's own (modelled bit for bit by
  reference.linear.gemv_model for Triton's interpreter).
- `nf4_gemm_kernel` (larger M): `tl.dot` (wgmma on Hopper, mma.sync on sm_80, sm_75 for float16)
  on the decoded tile, float32 accumulation. The decoded halves are interleaved in registers
  (`tl.join` + reshape) into the [BLOCK_N, BLOCK_K] tile. TRANS: out[M, K] += dY[M, BLOCK_N] @
  W[BLOCK_N, BLOCK_K], the same tile untransposed.
Both add an optional bias in float32 before the one rounding to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nf4.device import (
    absmax_of_block,
    high_nibble,
    load_v4,
    low_nibble,
    mma_16x8x16,
    mul,
    nf4_level,
    operand,
    product_table,
    round_to,
    table_pairs,
    widen,
)


@triton.jit
def _load_bytes(packed_ptr, rows, row_ok, c0, KB, end, HALF: tl.constexpr, EVICT: tl.constexpr):
    """Bytes c0 .. c0 + HALF of W's `rows` (rows of KB bytes) as [R, HALF] uint8; zeros from byte `end`
    of a row on and in rows past the weight."""
    j = c0 + tl.arange(0, HALF)
    ok = row_ok[:, None] & (j < end)[None, :]
    return tl.load(packed_ptr + rows[:, None] * KB + j[None, :], mask=ok, other=0, eviction_policy=EVICT)


@triton.jit
def _load_row_bytes(packed_ptr, rows, row_ok, c0, KB, HALF: tl.constexpr, EVICT: tl.constexpr):
    """Bytes c0 .. c0 + HALF (inside the row) of W's `rows` as [R, HALF] uint8; zeros in rows past the weight."""
    j = c0 + tl.arange(0, HALF)
    return tl.load(packed_ptr + rows[:, None] * KB + j[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)


@triton.jit
def _decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok, c0, KB,
            BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
            CODEBOOK: tl.constexpr, W_DT: tl.constexpr, X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """[R, HALF] bytes from c0 (HALF <= BLOCKSIZE / 2 and c0 a multiple of HALF: one absmax block per
    row) -> (even, odd) weights [R, HALF] in x's dtype; rows past the weight decode as zeros."""
    blk = (rows * KB + c0) // (BLOCKSIZE // 2)
    # (c0 < KB always: the loops and the grids stay inside the row)
    absmax = absmax_of_block(blk, row_ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, DOUBLE_QUANT, FTZ, ASM)
    absmax = tl.where(row_ok, absmax, 0.0)[:, None]
    if CODEBOOK == 2:  # one 8-byte gather per byte: both levels (see nf4.dequant.api.code_table)
        pair = tl.load(code_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + byte.to(tl.int32),
                       eviction_policy="evict_last")
        hi_level = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        lo_level = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        hi_level = nf4_level(high_nibble(byte), code_ptr, CODEBOOK)
        lo_level = nf4_level(low_nibble(byte), code_ptr, CODEBOOK)
    hi = mul(hi_level, absmax, FTZ, ASM)
    lo = mul(lo_level, absmax, FTZ, ASM)
    return operand(hi, W_DT, X_DT, BF16_BITS), operand(lo, W_DT, X_DT, BF16_BITS)


@triton.jit
def _split_pairs(pair, X_DT: tl.constexpr):
    """uint32 pairs of 16-bit x values (little-endian: element 2j in the low half) -> float32 (even, odd)."""
    if X_DT == 2:
        even = (pair << 16).to(tl.float32, bitcast=True)
        odd = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        even = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _split_pairs16(pair, X_DT: tl.constexpr):
    """uint32 pairs of 16-bit x values -> (even, odd) in x's dtype (bit moves only)."""
    if X_DT == 2:
        dt = tl.bfloat16
    else:
        dt = tl.float16
    even = (pair & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    odd = (pair >> 16).to(tl.uint16).to(dt, bitcast=True)
    return even, odd


@triton.jit
def _bits16(y, X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """float32 -> the output dtype's 16 bits, as uint32."""
    r = round_to(y, X_DT, BF16_BITS)
    return r.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_kernel(
    x_ptr,  # [M, K] (TRANS: [M, N]) contiguous rows, float16 / bfloat16
    packed_ptr,  # W's packed bytes (any storage dtype, read as uint8)
    absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,  # first / second-level state (see nf4.dequant.kernel)
    code_ptr,  # float32 [16] NF4 levels
    bias_ptr,  # [N] in x's dtype (unused without HAS_BIAS)
    out_ptr,  # [M, N] (TRANS: [M, K]) in x's dtype
    M, N, K,
    KB,  # bytes per row of W (K / 2); an argument so that Triton sees its divisibility by 16
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    CODEBOOK: tl.constexpr,  # 0: 16-entry table gather, 1: select tree, 2: 256-entry table of level pairs
    W_DT: tl.constexpr, X_DT: tl.constexpr,  # dtype codes (0 float32, 1 float16, 2 bfloat16)
    TRANS: tl.constexpr,  # False: out = x @ W^T; True: out = x @ W
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= M, a power of two
    BLOCK_R: tl.constexpr,  # rows of W per program (forward) or per step (TRANS)
    HALF: tl.constexpr,  # bytes of a row per step (forward) or per program (TRANS); at most BLOCKSIZE / 2
    SPLIT,  # forward: programs along K per block of rows (split-K)
    SEG,  # forward: bytes of a row per split (a multiple of HALF)
    PARTIAL: tl.constexpr,  # forward: write float32 partial sums [SPLIT, M, N] (SPLIT > 1)
    BF16_BITS: tl.constexpr, EVICT: tl.constexpr,
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    if not TRANS:
        # x as uint32 pairs: x[m, 2j] and x[m, 2j + 1] in one load
        xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        pid_k = pid % SPLIT
        rows = (pid // SPLIT) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        first = pid_k * SEG
        end = tl.minimum(first + SEG, KB)
        acc = tl.zeros((BLOCK_M, BLOCK_R, HALF), dtype=tl.float32)  # a lane per (m, row, byte)
        # Every step is whole (HALF divides SEG and KB), so the loads are masked by row only and
        # vectorise; the prefetch after the last step re-reads that step (in bounds, unused).
        nxt = _load_row_bytes(packed_ptr, rows, row_ok, first, KB, HALF, EVICT)
        for c0 in range(first, end, HALF):
            # the next step's bytes are requested before this step's are decoded
            byte = nxt
            nxt = _load_row_bytes(packed_ptr, rows, row_ok, tl.minimum(c0 + HALF, end - HALF), KB, HALF, EVICT)
            w_even, w_odd = _decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            j = c0 + tl.arange(0, HALF)
            pair = tl.load(xw_ptr + m[:, None] * KB + j[None, :], mask=m_ok[:, None], other=0)
            x_even, x_odd = _split_pairs(pair, X_DT)
            # products of 16-bit floats are exact in float32: fma(w, x, acc) == acc + w * x
            acc = tl.fma(widen(w_even, BF16_BITS)[None], x_even[:, None, :], acc)
            acc = tl.fma(widen(w_odd, BF16_BITS)[None], x_odd[:, None, :], acc)
        y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_R]
        ok = m_ok[:, None] & row_ok[None, :]
        if PARTIAL:  # float32 partials [SPLIT, M, N], summed in order by nf4_split_sum_kernel
            tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], y, mask=ok)
        else:
            if HAS_BIAS:
                y = y + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)[None, :]
            tl.store(out_ptr + m[:, None] * N + rows[None, :], round_to(y, X_DT, BF16_BITS), mask=ok)
    else:
        # this program's HALF bytes of every row: dX columns 2j and 2j + 1
        c0 = pid * HALF
        acc_even = tl.zeros((BLOCK_M, BLOCK_R, HALF), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, BLOCK_R, HALF), dtype=tl.float32)
        for r0 in range(0, N, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < N
            byte = _load_bytes(packed_ptr, rows, row_ok, c0, KB, KB, HALF, EVICT)
            w_even, w_odd = _decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            dy = tl.load(x_ptr + m[:, None] * N + rows[None, :], mask=m_ok[:, None] & row_ok[None, :], other=0.0)
            dy = widen(dy, BF16_BITS)[:, :, None]
            acc_even = tl.fma(widen(w_even, BF16_BITS)[None], dy, acc_even)
            acc_odd = tl.fma(widen(w_odd, BF16_BITS)[None], dy, acc_odd)
        y_even = tl.sum(acc_even, axis=1)  # [BLOCK_M, HALF]
        y_odd = tl.sum(acc_odd, axis=1)
        # one 32-bit store per column pair: column 2j in the low half
        j = c0 + tl.arange(0, HALF)
        pair = _bits16(y_even, X_DT, BF16_BITS) | (_bits16(y_odd, X_DT, BF16_BITS) << 16)
        outw_ptr = out_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        tl.store(outw_ptr + m[:, None] * KB + j[None, :], pair, mask=m_ok[:, None] & (j < KB)[None, :])


@triton.jit
def _word_pairs(word, absmax, code_ptr, FTZ: tl.constexpr, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """[R, W] uint32 words of packed bytes, absmax [R, 1] (their block's) -> 4 [R, W] uint32 pairs of the
    16-bit weights (pair j: element 2j low, 2j + 1 high), each nibble decoded as in `_decode`: the values
    nf4.device.product_table + table_pairs give on the GPU (Triton's interpreter has no PTX)."""
    p0 = _byte_pair(word & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p1 = _byte_pair((word >> 8) & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p2 = _byte_pair((word >> 16) & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p3 = _byte_pair(word >> 24, absmax, code_ptr, FTZ, DT, BF16_BITS)
    return p0, p1, p2, p3


@triton.jit
def _byte_pair(byte, absmax, code_ptr, FTZ: tl.constexpr, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    hi = mul(nf4_level(high_nibble(byte), code_ptr, 0), absmax, FTZ, False)
    lo = mul(nf4_level(low_nibble(byte), code_ptr, 0), absmax, FTZ, False)
    return _bits16(hi, DT, BF16_BITS) | (_bits16(lo, DT, BF16_BITS) << 16)


@triton.jit
def _fma_word(p0, p1, p2, p3, xrow_ptr, xw, acc, X_DT: tl.constexpr):
    """acc [R, W] + the 8 products of each word with x's row (pairs at xrow_ptr + xw + 0..3), in element
    order: per byte j, w[2j] x[2j] then w[2j + 1] x[2j + 1] (exact products: FMAs)."""
    acc = _fma_pair(p0, tl.load(xrow_ptr + xw), acc, X_DT)
    acc = _fma_pair(p1, tl.load(xrow_ptr + xw + 1), acc, X_DT)
    acc = _fma_pair(p2, tl.load(xrow_ptr + xw + 2), acc, X_DT)
    return _fma_pair(p3, tl.load(xrow_ptr + xw + 3), acc, X_DT)


@triton.jit
def _fma_pair(w_pair, x_pair, acc, X_DT: tl.constexpr):
    w_even, w_odd = _split_pairs(w_pair, X_DT)
    x_even, x_odd = _split_pairs(x_pair, X_DT)
    acc = tl.fma(w_even, x_even[None, :], acc)
    return tl.fma(w_odd, x_odd[None, :], acc)


@triton.jit
def _fma_rows(p0, p1, p2, p3, xw, x0, x1, x2, x3, acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr,
              X_DT: tl.constexpr):
    """`_fma_word` for each of the BLOCK_M (1, 2 or 4) rows of x (row pointers x0..x3) into its accumulator."""
    acc0 = _fma_word(p0, p1, p2, p3, x0, xw, acc0, X_DT)
    if BLOCK_M > 1:
        acc1 = _fma_word(p0, p1, p2, p3, x1, xw, acc1, X_DT)
    if BLOCK_M > 2:
        acc2 = _fma_word(p0, p1, p2, p3, x2, xw, acc2, X_DT)
        acc3 = _fma_word(p0, p1, p2, p3, x3, xw, acc3, X_DT)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(acc, ptr, bias_ptr, rows, row_ok, m, M, N, pid_k, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """Row m of the result from its lanes [BLOCK_R, 4]: float32 partials [SPLIT, M, N] at ptr (PARTIAL), else
    (+ bias) rounded once into out [M, N] at ptr."""
    y = tl.sum(acc, axis=1)  # [BLOCK_R]
    ok = row_ok & ((rows * 0 + m) < M)
    if PARTIAL:
        tl.store(ptr + (pid_k * M + m) * N + rows, y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)
        tl.store(ptr + m * N + rows, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_table_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x: 1, 2 or 4 (next power of two of M)
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,  # bytes of a row per step: 16 or 32, at most BLOCKSIZE / 2
    SPLIT, SEG, PARTIAL: tl.constexpr, BF16_BITS: tl.constexpr, EVICT: tl.constexpr,
):
    """The GEMV forward of `nf4_gemv_kernel` (x @ W^T, split-K with float32 partials) reading W as 32-bit
    words and decoding each absmax block through its 16-entry product table (codebook 3), built once
    per row and step. A step is one or two 16-byte tiles of a row (4 words each); for each row m of
    x, lane t of a row takes word t of each tile in turn and adds its 8 products in element order;
    the 4 lanes of a row are summed once at the end. Needs M <= 4, W's dtype == x's dtype and 4-byte
    aligned packed bytes (the API checks them)."""
    NSUB: tl.constexpr = HALF // 16  # 16-byte tiles per step (1 or 2): a lane takes word t of each
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] in one load
    KW = KB // 4  # words per row of W
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    rows = (pid // SPLIT) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    # a lane per (row, word of a 16-byte tile) for each row of x; rows of x past M read row M - 1 and
    # are not stored
    acc0 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_R, 4), dtype=tl.float32)
    x1 = xw_ptr + tl.minimum(1, M - 1) * KB
    x2 = xw_ptr + tl.minimum(2, M - 1) * KB
    x3 = xw_ptr + tl.minimum(3, M - 1) * KB
    wi = tl.arange(0, 4)
    wrow = packed_ptr + rows[:, None] * KW
    nxt0 = tl.load(wrow + (first // 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
    nxt1 = nxt0
    if NSUB == 2:
        nxt1 = tl.load(wrow + (first // 4 + 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
    for c0 in range(first, end, HALF):
        word0 = nxt0
        word1 = nxt1
        c1 = tl.minimum(c0 + HALF, end - HALF)  # the last step re-reads itself (in bounds, unused)
        nxt0 = tl.load(wrow + (c1 // 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        if NSUB == 2:
            nxt1 = tl.load(wrow + (c1 // 4 + 4 + wi)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        blk = (rows * KB + c0) // (BLOCKSIZE // 2)
        absmax = absmax_of_block(blk, row_ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, DOUBLE_QUANT, FTZ,
                                 ASM)
        absmax = tl.where(row_ok, absmax, 0.0)[:, None]
        if ASM:  # the block's table once for both tiles
            t0, t1, t2, t3, t4, t5, t6, t7 = product_table(absmax, FTZ, X_DT)
            p0, p1, p2, p3 = table_pairs(word0, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            p0, p1, p2, p3 = _word_pairs(word0, absmax, code_ptr, FTZ, X_DT, BF16_BITS)
        xw = c0 + 4 * wi  # x's pair for byte 0 of each word
        acc0, acc1, acc2, acc3 = _fma_rows(p0, p1, p2, p3, xw, xw_ptr, x1, x2, x3, acc0, acc1, acc2, acc3, BLOCK_M,
                                           X_DT)
        if NSUB == 2:
            if ASM:
                p0, p1, p2, p3 = table_pairs(word1, t0, t1, t2, t3, t4, t5, t6, t7)
            else:
                p0, p1, p2, p3 = _word_pairs(word1, absmax, code_ptr, FTZ, X_DT, BF16_BITS)
            acc0, acc1, acc2, acc3 = _fma_rows(p0, p1, p2, p3, xw + 16, xw_ptr, x1, x2, x3, acc0, acc1, acc2, acc3,
                                               BLOCK_M, X_DT)
    _store_row(acc0, out_ptr, bias_ptr, rows, row_ok, 0, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    if BLOCK_M > 1:
        _store_row(acc1, out_ptr, bias_ptr, rows, row_ok, 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    if BLOCK_M > 2:
        _store_row(acc2, out_ptr, bias_ptr, rows, row_ok, 2, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
        _store_row(acc3, out_ptr, bias_ptr, rows, row_ok, 3, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


@triton.jit
def _mma_pairs(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp, c0, c1, c2, c3, c4, c5, c6, c7, X_DT: tl.constexpr):
    """One word's looked-up pairs of rows g (pa) and g + 8 (pb) against x's 4 matching pairs at xp (B's column g
    of one 8-row tile of x): pairs 0 and 1 as the lane's A columns 2t.. and 2t + 8.. of one mma.sync, pairs 2
    and 3 of a second, into the two accumulator sets (c0..c3, c4..c7)."""
    x0, x1, x2, x3 = load_v4(xp, False)
    c0, c1, c2, c3 = mma_16x8x16(pa0, pb0, pa1, pb1, x0, x1, c0, c1, c2, c3, X_DT)
    c4, c5, c6, c7 = mma_16x8x16(pa2, pb2, pa3, pb3, x2, x3, c4, c5, c6, c7, X_DT)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _mma_word(wa, wb, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
              xp0, xp1, xp2, xp3,
              c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23,
              c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37,
              X_DT: tl.constexpr, NTILE: tl.constexpr):
    """One word of each of the lane's two rows (wa: row g, wb: row g + 8), looked up once, against each of the
    NTILE 8-row tiles of x (pairs at xp0..xp3; accumulators c<tile><0..7>)."""
    pa0, pa1, pa2, pa3 = table_pairs(wa, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7)
    pb0, pb1, pb2, pb3 = table_pairs(wb, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7)
    c00, c01, c02, c03, c04, c05, c06, c07 = _mma_pairs(
        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp0, c00, c01, c02, c03, c04, c05, c06, c07, X_DT)
    if NTILE > 1:
        c10, c11, c12, c13, c14, c15, c16, c17 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp1, c10, c11, c12, c13, c14, c15, c16, c17, X_DT)
    if NTILE > 2:
        c20, c21, c22, c23, c24, c25, c26, c27 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp2, c20, c21, c22, c23, c24, c25, c26, c27, X_DT)
        c30, c31, c32, c33, c34, c35, c36, c37 = _mma_pairs(
            pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, xp3, c30, c31, c32, c33, c34, c35, c36, c37, X_DT)
    return (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
            c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37)


@triton.jit
def mma_tile(a0, a1, a2, a3, b0, b1, b2, b3, xp0, xp1, xp2, xp3,
              ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7,
              c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23,
              c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37,
              X_DT: tl.constexpr, NTILE: tl.constexpr):
    """A lane's 16-byte tile of each of its rows (words a0..a3 of row g, b0..b3 of row g + 8) against x's 16
    matching pairs in each 8-row tile of x (at xp0..xp3): 8 mma.sync steps per tile of x."""
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a0, b0, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0, xp1, xp2, xp3,
        c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
        c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a1, b1, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 4, xp1 + 4,
        xp2 + 4, xp3 + 4, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a2, b2, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 8, xp1 + 8,
        xp2 + 8, xp3 + 8, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = _mma_word(
        a3, b3, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, xp0 + 12, xp1 + 12,
        xp2 + 12, xp3 + 12, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21,
        c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    return (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
            c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37)


@triton.jit
def _mma_store(y, ptr, bias_ptr, rows, m, M, N, pid_k, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """One output per thread (W row `rows`, x row `m`): a float32 partial, or (+ bias) rounded once."""
    ok = (rows < N) & (m < M)
    if PARTIAL:
        tl.store(ptr + (pid_k * M + m) * N + rows, y, mask=ok)
    else:
        if HAS_BIAS:
            y = y + widen(tl.load(bias_ptr + rows, mask=ok, other=0.0), BF16_BITS)
        tl.store(ptr + m * N + rows, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit
def mma_words(wa, wb, j, NSUB: tl.constexpr, STREAM: tl.constexpr):
    """A lane's words of its two rows of W (at wa, wb) for the step at byte j, NSUB 16-byte tiles each (with one,
    the second four words repeat the first). STREAM: not kept in L1 (as mma_fetch reads them)."""
    a0, a1, a2, a3 = load_v4(wa + j // 4, STREAM)
    b0, b1, b2, b3 = load_v4(wb + j // 4, STREAM)
    a4, a5, a6, a7 = a0, a1, a2, a3
    b4, b5, b6, b7 = b0, b1, b2, b3
    if NSUB == 2:
        a4, a5, a6, a7 = load_v4(wa + j // 4 + 4, STREAM)
        b4, b5, b6, b7 = load_v4(wb + j // 4 + 4, STREAM)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def mma_absmax(ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE: tl.constexpr,
               DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr):
    """The absmax of rows ra and rb at byte j of their rows (the lane's block of the step)."""
    amax_a = absmax_of_block((ra * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    amax_b = absmax_of_block((rb * KB + j) // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, DOUBLE_QUANT, FTZ, True)
    return amax_a, amax_b


@triton.jit
def mma_fetch(wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
              BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, NSUB: tl.constexpr):
    """A lane's words of its two rows of W (at wa, wb: rows ra, rb) for the step at byte j (`mma_words`) and the
    two rows' absmax there (`mma_absmax`)."""
    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = mma_words(wa, wb, j, NSUB, True)
    amax_a, amax_b = mma_absmax(ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE,
                                DOUBLE_QUANT, FTZ)
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a, amax_b


@triton.jit
def _warps_sum(y, GROUPS: tl.constexpr, WARPS_K: tl.constexpr):
    """[THREADS] (thread i: group i // (32 * WARPS_K), warp (i // 32) % WARPS_K, lane i % 32) -> [GROUPS, 32]:
    each group's WARPS_K warps added lane by lane."""
    return tl.sum(tl.reshape(y, (GROUPS, WARPS_K, 32)), axis=1)


@triton.jit
def _mma_store_tile(c0, c1, c2, c3, c4, c5, c6, c7, m0, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N, pid_k,
                    PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, X_DT: tl.constexpr, BF16_BITS: tl.constexpr,
                    GROUPS: tl.constexpr, WARPS_K: tl.constexpr):
    """The lane's 4 outputs of one 8-row tile of x (from row m0): the two accumulator sets added. With WARPS_K > 1
    the group's warps are added too (`_warps_sum`), and the [GROUPS, 32] sums go to the rows of lane 4g + t of
    each group (from the program's first row, row0)."""
    y0, y1, y2, y3 = c0 + c4, c1 + c5, c2 + c6, c3 + c7
    if WARPS_K > 1:
        y0, y1 = _warps_sum(y0, GROUPS, WARPS_K), _warps_sum(y1, GROUPS, WARPS_K)
        y2, y3 = _warps_sum(y2, GROUPS, WARPS_K), _warps_sum(y3, GROUPS, WARPS_K)
        lane = tl.arange(0, 32)[None, :]
        row_a = row0 + tl.arange(0, GROUPS)[:, None] * 16 + lane // 4
        row_b = row_a + 8
        t = lane % 4
    m = m0 + 2 * t
    _mma_store(y0, out_ptr, bias_ptr, row_a, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y1, out_ptr, bias_ptr, row_a, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y2, out_ptr, bias_ptr, row_b, m, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)
    _mma_store(y3, out_ptr, bias_ptr, row_b, m + 1, M, N, pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemv_mma_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    zero_ptr,  # WARPS_K > 1: 128 bytes of zeros, the x a warp reads for a step past its program's range
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    THREADS: tl.constexpr,  # 32 * num_warps: every 1-D tensor here holds one element per thread
    HALF: tl.constexpr,  # bytes of each of its two rows a thread decodes per step: 16 or 32 (<= BLOCKSIZE / 2)
    NTILE: tl.constexpr,  # 8-row tiles of x (B's 8 columns each): 1, 2 or 4 (M <= 8 * NTILE)
    SPLIT, SEG, PARTIAL: tl.constexpr, BF16_BITS: tl.constexpr,
    WARPS_K: tl.constexpr,  # warps of a program that share its 16-row groups and split its K range
):
    """The word GEMV (codebook 3's product table and prmt lookup) with its products on tensor cores:
    x @ W^T for M <= 32 by PTX `mma.sync.m16n8k16` (float32 accumulation), split-K like nf4_gemv_kernel.
    Each warp owns 16 rows of W; lane 4g + t decodes rows g and g + 8, bytes t * HALF .. (t + 1) * HALF of
    each 4 * HALF-byte step. An mma's 16 columns of K are any 16 of the step, provided A's and B's agree:
    the lane's own word pairs are its A columns 2t.. / 2t + 8.., and its B registers are x's pairs at
    the same bytes, from row 8u + g of x (B's column g of the u-th 8-row tile of x); a word is looked up once
    for all NTILE tiles. D's lane 4g + t holds outputs (row g / g + 8, x row 8u + 2t / 8u + 2t + 1). Needs an
    sm_80+ GPU, 16-byte aligned x and packed bytes, K / 2 a multiple of 4 * HALF and W's dtype == x's (the
    API checks them); GPU only (no PTX in Triton's interpreter).

    WARPS_K > 1: the program's warps form groups of WARPS_K that own the same 16 rows, warp k of a group taking
    steps k, k + WARPS_K, ... of the program's range (a step past the range reads its last step's weights
    against zeros at zero_ptr); the group's sums are added in the program (`_warps_sum`, through shared memory)
    before the store, so that a single launch (SPLIT 1) can spread a row's K over several warps."""
    NSUB: tl.constexpr = HALF // 16
    STEP: tl.constexpr = 4 * HALF
    GROUPS: tl.constexpr = THREADS // (32 * WARPS_K)  # 16-row groups per program
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)  # x[m, 2j] and x[m, 2j + 1] as one word
    KW = KB // 4
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    row0 = (pid // SPLIT) * (16 * GROUPS)  # the program's first row
    row_a = row0 + (i // (32 * WARPS_K)) * 16 + g  # the warp's 16-row group
    row_b = row_a + 8
    ra = tl.minimum(row_a, N - 1)  # rows past the weight decode its last row (their outputs are not stored)
    rb = tl.minimum(row_b, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    # B's column g of tile u: x's row 8u + g (past M: row M - 1, not stored)
    xr0 = xw_ptr + tl.minimum(g, M - 1) * KB
    xr1 = xw_ptr + tl.minimum(8 + g, M - 1) * KB
    xr2 = xw_ptr + tl.minimum(16 + g, M - 1) * KB
    xr3 = xw_ptr + tl.minimum(24 + g, M - 1) * KB
    always = i >= 0
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    kw = (i // 32) % WARPS_K  # the warp's place in its group (0 without WARPS_K)
    zw = zero_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25,
     c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = (
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero,
        zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    # the first step's words and absmax; each step then requests the next step's before decoding its own
    # (the last step re-reads itself: in bounds, unused)
    if WARPS_K == 1:
        j = first + t * HALF  # this lane's bytes of the step (one absmax block)
    else:
        j = tl.minimum(first + kw * STEP, end - STEP) + t * HALF
    (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = mma_fetch(
        wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT, FTZ,
        NSUB)
    for c0 in range(first, end, STEP * WARPS_K):
        a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
        b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
        amax_a, amax_b = next_a, next_b
        if WARPS_K == 1:
            j = c0 + t * HALF
            jn = tl.minimum(c0 + STEP, end - STEP) + t * HALF
            x0, x1, x2, x3 = xr0 + j, xr1 + j, xr2 + j, xr3 + j
        else:
            s = c0 + kw * STEP  # this warp's step; past `end` it re-reads the last step, against zeros
            j = tl.minimum(s, end - STEP) + t * HALF
            jn = tl.minimum(s + STEP * WARPS_K, end - STEP) + t * HALF
            live = s < end
            x0, x1, x2, x3 = (tl.where(live, xr0 + j, zw), tl.where(live, xr1 + j, zw), tl.where(live, xr2 + j, zw),
                              tl.where(live, xr3 + j, zw))
        (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = mma_fetch(
            wa, wb, ra, rb, jn, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT,
            FTZ, NSUB)
        ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = product_table(amax_a, FTZ, X_DT)
        tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = product_table(amax_b, FTZ, X_DT)
        (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
         c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = mma_tile(
            a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, ta0, ta1, ta2, ta3, ta4, ta5, ta6,
            ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13,
            c14, c15, c16, c17, c20, c21, c22, c23, c24, c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37, X_DT,
            NTILE)
        if NSUB == 2:
            (c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24,
             c25, c26, c27, c30, c31, c32, c33, c34, c35, c36, c37) = mma_tile(
                a4, a5, a6, a7, b4, b5, b6, b7, x0 + 16, x1 + 16, x2 + 16, x3 + 16, ta0, ta1,
                ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, c00, c01, c02, c03, c04, c05,
                c06, c07, c10, c11, c12, c13, c14, c15, c16, c17, c20, c21, c22, c23, c24, c25, c26, c27, c30, c31,
                c32, c33, c34, c35, c36, c37, X_DT, NTILE)
    _mma_store_tile(c00, c01, c02, c03, c04, c05, c06, c07, 0, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                    pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
    if NTILE > 1:
        _mma_store_tile(c10, c11, c12, c13, c14, c15, c16, c17, 8, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
    if NTILE > 2:
        _mma_store_tile(c20, c21, c22, c23, c24, c25, c26, c27, 16, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)
        _mma_store_tile(c30, c31, c32, c33, c34, c35, c36, c37, 24, out_ptr, bias_ptr, row_a, row_b, t, row0, M, N,
                        pid_k, PARTIAL, HAS_BIAS, X_DT, BF16_BITS, GROUPS, WARPS_K)


@triton.jit
def nf4_split_sum_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         X_DT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = round(((part[0] + part[1]) + ...) + bias) over MN = M * N outputs: split-K's second pass."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    y = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        y = y + widen(tl.load(bias_ptr + i % N, mask=ok, other=0.0), BF16_BITS)
    tl.store(out_ptr + i, round_to(y, X_DT, BF16_BITS), mask=ok)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        acc = tl.dot(widen(a, True), widen(b, True), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def grouped(pid, n_m, n_o, GROUP: tl.constexpr):
    """(tile along M, tile along the output dimension) of program `pid` in the tl.dot kernels' order: GROUP tiles
    along M for each output tile, so the programs that share a decoded W tile run together."""
    per_group = GROUP * n_o
    first_m = (pid // per_group) * GROUP
    size = tl.minimum(n_m - first_m, GROUP)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


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
        nxt = _load_bytes(packed_ptr, rows, row_ok, 0, KB, KB, HALF, EVICT)
        for c0 in range(0, KB, HALF):
            byte = nxt
            nxt = _load_bytes(packed_ptr, rows, row_ok, c0 + HALF, KB, KB, HALF, EVICT)
            w_even, w_odd = _decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            j = c0 + tl.arange(0, HALF)
            pair = tl.load(xw_ptr + m[:, None] * KB + j[None, :], mask=m_ok[:, None] & (j < KB)[None, :], other=0)
            x_even, x_odd = _split_pairs16(pair, X_DT)
            if SWAP:
                acc = _dot(w_even, tl.trans(x_even), acc, DOT_F32)
                acc = _dot(w_odd, tl.trans(x_odd), acc, DOT_F32)
            else:
                acc = _dot(x_even, tl.trans(w_even), acc, DOT_F32)
                acc = _dot(x_odd, tl.trans(w_odd), acc, DOT_F32)
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
        nxt = _load_bytes(packed_ptr, tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_N) < N, c0, KB, KB, HALF, EVICT)
        for r0 in range(0, N, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            row_ok = rows < N
            byte = nxt
            nxt = _load_bytes(packed_ptr, rows + BLOCK_N, rows + BLOCK_N < N, c0, KB, KB, HALF, EVICT)
            w_even, w_odd = _decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok,
                                    c0, KB, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, W_DT, X_DT, BF16_BITS)
            dy = tl.load(x_ptr + m[:, None] * N + rows[None, :], mask=m_ok[:, None] & row_ok[None, :], other=0.0)
            acc_even = _dot(dy, w_even, acc_even, DOT_F32)
            acc_odd = _dot(dy, w_odd, acc_odd, DOT_F32)
        # columns 2j and 2j + 1 of dX as one 32-bit word
        j = c0 + tl.arange(0, HALF)
        pair = _bits16(acc_even, X_DT, BF16_BITS) | (_bits16(acc_odd, X_DT, BF16_BITS) << 16)
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


@triton.jit
def word_tile(p0, p1, p2, p3, X_DT: tl.constexpr):
    """Four [H, R, W] uint32 tensors of weight pairs (`table_pairs`' order: pair j of word w holds elements
    8w + 2j (low half) and 8w + 2j + 1 (high half)) -> the [R, 8WH] tile of 16-bit weights in x's dtype (word
    w of part h at columns 8(hW + w) ..). Each join adds its new axis as the fastest register of a thread, so
    a thread's 8WH weights of a row stay in column order in its registers (vector stores to shared memory)."""
    H: tl.constexpr = p0.shape[0]
    R: tl.constexpr = p0.shape[1]
    W: tl.constexpr = p0.shape[2]
    q = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [H, R, W, 2, 2]: entry [.., i, o] is pair 2i + o
    q = tl.reshape(q, (H, R, 4 * W))
    if X_DT == 2:
        dt = tl.bfloat16
    else:
        dt = tl.float16
    lo = (q & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    hi = (q >> 16).to(tl.uint16).to(dt, bitcast=True)
    t = tl.reshape(tl.join(lo, hi), (H, R, 8 * W))
    if H == 1:
        return tl.reshape(t, (R, 8 * W))
    else:
        return tl.reshape(tl.permute(t, (1, 0, 2)), (R, 8 * W * H))


@triton.jit(do_not_specialize=["M", "SPLIT"])
def nf4_gemm_word_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, KB,
    BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype code, also the weight's (1 float16, 2 bfloat16)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # weights of a row per step: 32 or 64, at most BLOCKSIZE (one absmax per row and step)
    GROUP: tl.constexpr, SWAP: tl.constexpr,
    SPLIT,  # programs along K per output tile (split-K)
    SEG,  # bytes of a row per split (a multiple of BLOCK_K / 2)
    PARTIAL: tl.constexpr,  # write float32 partial sums [SPLIT, M, N] (SPLIT > 1), summed by nf4_split_sum_kernel
    BF16_BITS: tl.constexpr, EVICT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """x @ W^T (+ bias) by `tl.dot` (wgmma on Hopper) on W tiles decoded like the word GEMV's: a row's step is
    BLOCK_K / 8 words of packed bytes looked up with `prmt` in the row's 16-entry product table
    (`product_table`, built once per row and step), each 4 words laid out in element order as a
    [BLOCK_N, 32] tile (`word_tile`) and multiplied with x's 32 matching columns. Grid:
    SPLIT * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs, GROUP tiles along M next to each other per W tile.
    SWAP: out^T = W @ x^T (the decoded tile as tl.dot's first operand). Needs W's dtype == x's, 4-byte aligned
    packed bytes and K a multiple of BLOCK_K (the API checks them); Triton's interpreter decodes with
    `_word_pairs` instead of PTX."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    pid_m, pid_n = grouped(pid // SPLIT, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r = tl.minimum(rows, N - 1)  # rows past the weight decode its last row (not stored)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    H: tl.constexpr = BLOCK_K // 32  # 4-word parts of a row's step: [H, BLOCK_N, 4] words, a thread per row
    wp = words_ptr + r[None, :, None] * KW + (4 * tl.arange(0, H)[:, None, None] + tl.arange(0, 4)[None, None, :])
    xp = x_ptr + m[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    blk = r * (KB // (BLOCKSIZE // 2))  # the row's first absmax block
    always = r >= 0
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    # Every split has a step (split_k: SPLIT = cdiv(KB, SEG), K > 0). Said to the compiler, the loop has no
    # zero-trip path: without it LLVM set the accumulator to zero again on that path, after the loop, where ptxas
    # (CUDA 12.8-12.9) counts it as a non-wgmma definition of wgmma accumulators and serializes every wgmma of the
    # loop (C7515) whenever the epilogue rounds to 16 bits (experiments gemm-limit).
    tl.assume(end > first)
    for c0 in range(first, end, BLOCK_K // 2):
        amax = absmax_of_block(blk + c0 // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                               DOUBLE_QUANT, FTZ, ASM)[None, :, None]
        word = tl.load(wp + c0 // 4, eviction_policy=EVICT)
        if ASM:  # the row's table once for the step
            t0, t1, t2, t3, t4, t5, t6, t7 = product_table(amax, FTZ, X_DT)
            p0, p1, p2, p3 = table_pairs(word, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            p0, p1, p2, p3 = _word_pairs(word, amax, code_ptr, FTZ, X_DT, BF16_BITS)
        w = word_tile(p0, p1, p2, p3, X_DT)
        xk = tl.load(xp + 2 * c0, mask=m_ok[:, None], other=0.0)
        if SWAP:
            acc = _dot(w, tl.trans(xk), acc, DOT_F32)
        else:
            acc = _dot(xk, tl.trans(w), acc, DOT_F32)
    if SWAP:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & row_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc = acc + widen(tl.load(bias_ptr + rows, mask=row_ok, other=0.0), BF16_BITS)[None, :]
        tl.store(out_ptr + m[:, None] * N + rows[None, :], round_to(acc, X_DT, BF16_BITS), mask=ok)
