"""The fused NF4 dequantization kernel: both levels of double quantization in one launch.

Work is cut into 32-bit words of packed bytes = 8 weights. A word never straddles an absmax
block (block sizes are multiples of 32), so each word needs one absmax:

    absmax[b] = (code2[absmax_u8[b]] * absmax2[b // ABSMAX_BLOCKSIZE]) + offset    (two float32 roundings)
    out[i]    = round(NF4[nibble(i)] * absmax[i // BLOCKSIZE])         (one float32 product)

Each thread expands a word into its 8 nibbles (element 2k is the HIGH nibble of byte k) and writes
the 8 outputs with one 16-byte store (two for float32); the stores are laid out so that the
threads of a warp write consecutive 16-byte pieces, i.e. a warp's store covers 512 contiguous
bytes. (Giving each thread 16 contiguous packed bytes instead made its four stores land 64 bytes
apart across the warp and ran markedly slower on an H200: results/tuning/.) A thread's words are
a row apart (see _words), and each is loaded on its own, so no word moves through shared memory
between the load and the store. Weights past the last whole word (fewer than 8) and packed
tensors that are not 4-byte aligned take a byte-wise path.

Exactness: the arithmetic is nf4.device's (docs/FORMAT.md §3-5). The default GPU path multiplies
with PTX `mul.rn.ftz.f32`, which the compiler cannot fuse with the following add, and flushes like
bitsandbytes' fast-math CUDA build. The IEEE path (ftz=False, and the interpreter) uses plain
Triton multiplies and depends on the compile option `enable_fp_fusion=False`, which the launcher
passes unless a config asks otherwise: with contraction on, `code2 * absmax2 + offset` becomes one
FMA and rounds once, and some outputs change by one ulp (counted on the GPU by experiment v40
and tests/nf4/dequant/test_gpu.py). Under torch.compile, Inductor compiles the kernel with contraction on
(it has no switch for a user's kernel), so nf4.ops launches it with ASM on for the IEEE path as well:
PTX `mul.rn.f32`, the same product, which no compile option contracts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nf4.device import absmax_of_block, high_nibble, low_nibble, mul, nf4_level, store_rounded, word_nibble_shift


@triton.jit
def _expand_word(word, absmax, code_ptr, FIRST: tl.constexpr, COUNT: tl.constexpr, CODEBOOK: tl.constexpr,
                 FTZ: tl.constexpr, ASM: tl.constexpr):
    """[R, C] uint32 words (4 packed bytes) -> [R, C, COUNT] float32 weights FIRST.. of each word's 8."""
    shift = word_nibble_shift(FIRST + tl.arange(0, COUNT))
    nib = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.int32)
    return mul(nf4_level(nib, code_ptr, CODEBOOK), absmax[:, :, None], FTZ, ASM)


@triton.jit
def _expand_word_pairs(word, absmax, pair_ptr, FIRST: tl.constexpr, COUNT: tl.constexpr, FTZ: tl.constexpr,
                       ASM: tl.constexpr):
    """Like _expand_word, but one 8-byte gather per packed byte from a 256-entry table of level pairs.

    pair_ptr[b] holds the float32 bits of NF4[b >> 4] in its low half and NF4[b & 15] in its high
    half, so a byte's two levels arrive in one load (half the gathers of the 16-entry table).
    """
    j = FIRST // 2 + tl.arange(0, COUNT // 2)
    byte = ((word[:, :, None] >> (j * 8).to(tl.uint32)[None, None, :]) & 0xFF).to(tl.int32)
    pair = tl.load(pair_ptr + byte, eviction_policy="evict_last")
    hi = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    lo = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    levels = tl.reshape(tl.join(hi, lo), (word.shape[0], word.shape[1], COUNT))
    return mul(levels, absmax[:, :, None], FTZ, ASM)


@triton.jit
def _store_word(out_ptr, base, word, absmax, code_ptr, m, CODEBOOK: tl.constexpr, FTZ: tl.constexpr,
                ASM: tl.constexpr, BF16_BITS: tl.constexpr, STORE_CM: tl.constexpr):
    """Write the 8 weights of one word with 16-byte stores: one for 16-bit outputs, two for float32."""
    if out_ptr.dtype.element_ty == tl.float32:
        _store_part(out_ptr, base, word, absmax, code_ptr, m, 0, 4, CODEBOOK, FTZ, ASM, BF16_BITS, STORE_CM)
        _store_part(out_ptr, base, word, absmax, code_ptr, m, 4, 4, CODEBOOK, FTZ, ASM, BF16_BITS, STORE_CM)
    else:
        _store_part(out_ptr, base, word, absmax, code_ptr, m, 0, 8, CODEBOOK, FTZ, ASM, BF16_BITS, STORE_CM)


@triton.jit
def _store_part(out_ptr, base, word, absmax, code_ptr, m, FIRST: tl.constexpr, COUNT: tl.constexpr,
                CODEBOOK: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr, BF16_BITS: tl.constexpr,
                STORE_CM: tl.constexpr):
    """Weights FIRST .. FIRST + COUNT of a word, stored at base + FIRST."""
    if CODEBOOK == 2:
        pair_ptr = code_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
        y = _expand_word_pairs(word, absmax, pair_ptr, FIRST, COUNT, FTZ, ASM)
    else:
        y = _expand_word(word, absmax, code_ptr, FIRST, COUNT, CODEBOOK, FTZ, ASM)
    store_rounded(out_ptr, base + FIRST + tl.arange(0, COUNT)[None, None, :], y, m, BF16_BITS, STORE_CM, "")


@triton.jit
def _words(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, first, n_words,
           TILE: tl.constexpr, ROW: tl.constexpr, BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
           FTZ: tl.constexpr, ASM: tl.constexpr, CODEBOOK: tl.constexpr, EVICT_STREAM: tl.constexpr,
           BF16_BITS: tl.constexpr, STORE_CM: tl.constexpr):
    """The TILE whole 32-bit words from `first`: 8 weights each, one 16-byte store per word (two for float32).

    The words are a [TILE / ROW, ROW] tile, ROW = min(TILE, threads per program): thread t takes
    words t, t + ROW, ..., so each warp-wide store covers 512 contiguous bytes. Words past n_words
    are clamped to the last one for the loads (in bounds; their stores are masked): with no mask on
    the word load, Triton does not merge a thread's words into one wider load, which would then have
    to be moved to the store layout through shared memory.
    """
    w = first + tl.arange(0, TILE // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    ok = w < n_words
    wc = tl.minimum(w, n_words - 1)
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    word = tl.load(words_ptr + wc, eviction_policy=EVICT_STREAM)
    absmax = absmax_of_block(wc // (BLOCKSIZE // 8), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                              DOUBLE_QUANT, FTZ, ASM)
    _store_word(out_ptr, w[:, :, None] * 8, word, absmax, code_ptr, ok[:, :, None], CODEBOOK, FTZ, ASM, BF16_BITS,
                STORE_CM)


@triton.jit
def _bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
           BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
           CODEBOOK: tl.constexpr, BF16_BITS: tl.constexpr):
    """Bytes b read one by one, masked to n_bytes / n: the tail, and packed tensors not 4-byte aligned."""
    ok = b < n_bytes
    byte = tl.load(packed_ptr + b, mask=ok, other=0)
    absmax = absmax_of_block((b * 2) // BLOCKSIZE, ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                             DOUBLE_QUANT, FTZ, ASM)
    hi = mul(nf4_level(high_nibble(byte), code_ptr, CODEBOOK), absmax, FTZ, ASM)
    lo = mul(nf4_level(low_nibble(byte), code_ptr, CODEBOOK), absmax, FTZ, ASM)
    y = tl.interleave(hi, lo)  # element 2k = high nibble of byte k
    idx = tl.interleave(b * 2, b * 2 + 1)
    store_rounded(out_ptr, idx, y, idx < n, BF16_BITS, "", "")


@triton.jit(do_not_specialize=["n_words"])
def nf4_dequantize_kernel(
    # pointers
    packed_ptr,  # packed NF4 bytes, any storage dtype (read as uint8 / uint32)
    absmax_ptr,  # uint8 [n_blocks] when DOUBLE_QUANT, else float32 [n_blocks]
    absmax2_ptr,  # float32 [cdiv(n_blocks, ABSMAX_BLOCKSIZE)] (unused without DOUBLE_QUANT)
    code2_ptr,  # float32 [256] second-level map (unused without DOUBLE_QUANT)
    offset_ptr,  # float32 [1] offset (unused without DOUBLE_QUANT)
    code_ptr,  # float32 [16] NF4 levels; with CODEBOOK == 2 followed by the 256 level pairs
    out_ptr,  # output [n] of the output dtype
    # sizes
    n,  # number of weights
    n_bytes,  # number of packed bytes = cdiv(n, 2)
    n_words,  # whole 32-bit words handled by the word path (0 when VEC is off); not specialised
    # meta-parameters
    BLOCKSIZE: tl.constexpr,  # weights per absmax block (32 ... 4096)
    TILE: tl.constexpr,  # words (VEC) or bytes per program
    ROW: tl.constexpr,  # words per row of the word tile: min(TILE, 32 * num_warps)
    DOUBLE_QUANT: tl.constexpr,
    FTZ: tl.constexpr,  # flush subnormals like bitsandbytes' CUDA build
    ASM: tl.constexpr,  # products in PTX: mul.rn.ftz.f32 with FTZ, else mul.rn.f32 (not in the interpreter)
    CODEBOOK: tl.constexpr,  # 0: 16-entry table gather, 1: select tree, 2: 256-entry pair table (words)
    VEC: tl.constexpr,  # 32-bit word loads (needs a 4-byte aligned packed pointer)
    INDEX_64: tl.constexpr,  # 64-bit offsets for tensors of 2**31 elements and more
    EVICT_STREAM: tl.constexpr,  # eviction policy for the streamed packed bytes
    BF16_BITS: tl.constexpr,  # round to bfloat16 with integer ops (needed in the interpreter)
    STORE_CM: tl.constexpr,  # cache modifier of the output stores ("" or ".cs", ".cg", ...)
    PERSIST: tl.constexpr,  # word path: a fixed grid whose programs stride over the tiles (else one tile each)
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    if VEC and PERSIST:
        # Each program takes tiles pid, pid + P, pid + 2P, ... (P programs); the last program also
        # writes the 1-7 weights after the last whole word.
        n_progs = tl.num_programs(0).to(pid.dtype)
        n_tiles = tl.cdiv(n_words, TILE).to(pid.dtype)
        for t in range(pid, n_tiles, n_progs):
            _words(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, t * TILE, n_words,
                   TILE, ROW, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, EVICT_STREAM, BF16_BITS, STORE_CM)
        if pid == n_progs - 1:
            b = n_words.to(pid.dtype) * 4 + tl.arange(0, 4)
            _bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
                   BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, BF16_BITS)
    elif VEC:
        if pid * TILE < n_words:
            # Consecutive threads take consecutive words, so every warp-wide 16-byte store covers
            # 512 contiguous bytes (16 packed bytes per thread instead made each warp's stores
            # stride 64 bytes apart, and measured 1.7x slower on an H200).
            _words(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, pid * TILE,
                   n_words, TILE, ROW, BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, EVICT_STREAM, BF16_BITS,
                   STORE_CM)
        else:  # the one program past the words: the last 1-4 bytes (fewer than 8 weights)
            b = n_words.to(pid.dtype) * 4 + tl.arange(0, 4)  # int64 with INDEX_64: b * 2 passes 2**31
            _bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
                   BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, BF16_BITS)
    else:
        b = pid * TILE + tl.arange(0, TILE)
        _bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, b, n, n_bytes,
               BLOCKSIZE, DOUBLE_QUANT, FTZ, ASM, CODEBOOK, BF16_BITS)
