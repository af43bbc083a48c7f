"""Helpers the linear kernels share (loading, decoding, splitting x's pairs, rounding), and the split-K sum.

W is bitsandbytes' NF4 weight [N, K] in its packed layout: row n is K / 2 bytes from byte n * K / 2, element
2j of a row is the high nibble of byte j, and a block of BLOCKSIZE weights never straddles two rows (the API
requires BLOCKSIZE to divide K). Every weight is `NF4[code] * absmax` rounded once in float32 (FTZ like
bitsandbytes' CUDA build), rounded to the weight's dtype and converted to x's dtype where that differs: the
kernels' operand is the dequantized weight bit for bit (docs/FORMAT.md §3-5, §10).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import absmax_of_block, high_nibble, low_nibble, mul, nf4_level, operand, round_to, widen


@triton.jit
def load_row_bytes(packed_ptr, rows, row_ok, c0, KB, HALF: tl.constexpr, EVICT: tl.constexpr):
    """Bytes c0 .. c0 + HALF (inside the row) of W's `rows` as [R, HALF] uint8; zeros in rows past the weight."""
    j = c0 + tl.arange(0, HALF)
    return tl.load(packed_ptr + rows[:, None] * KB + j[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)


@triton.jit
def decode(byte, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rows, row_ok, c0, KB,
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
def split_pairs(pair, X_DT: tl.constexpr):
    """uint32 pairs of 16-bit x values (little-endian: element 2j in the low half) -> float32 (even, odd)."""
    if X_DT == 2:
        even = (pair << 16).to(tl.float32, bitcast=True)
        odd = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        even = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def bits16(y, X_DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """float32 -> the output dtype's 16 bits, as uint32."""
    r = round_to(y, X_DT, BF16_BITS)
    return r.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def word_pairs(word, absmax, code_ptr, FTZ: tl.constexpr, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """[R, W] uint32 words of packed bytes, absmax [R, 1] (their block's) -> 4 [R, W] uint32 pairs of the
    16-bit weights (pair j: element 2j low, 2j + 1 high), each nibble decoded as in `decode`: the values
    nf4.device.product_table + table_pairs give on the GPU (Triton's interpreter has no PTX)."""
    p0 = byte_pair(word & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p1 = byte_pair((word >> 8) & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p2 = byte_pair((word >> 16) & 0xFF, absmax, code_ptr, FTZ, DT, BF16_BITS)
    p3 = byte_pair(word >> 24, absmax, code_ptr, FTZ, DT, BF16_BITS)
    return p0, p1, p2, p3


@triton.jit
def byte_pair(byte, absmax, code_ptr, FTZ: tl.constexpr, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    hi = mul(nf4_level(high_nibble(byte), code_ptr, 0), absmax, FTZ, False)
    lo = mul(nf4_level(low_nibble(byte), code_ptr, 0), absmax, FTZ, False)
    return bits16(hi, DT, BF16_BITS) | (bits16(lo, DT, BF16_BITS) << 16)


@triton.jit
def dot(a, b, acc, DOT_F32: tl.constexpr):
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
