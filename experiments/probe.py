"""Where the time of an `nf4.dequantize` call goes, on the host and on the GPU.

    python -m experiments probe --out results/tuning/h200_probe.json

Host: the cost of each step of the fast repeat call (plan lookup, output allocation, the current
stream, Triton's launch wrapper versus its C launch function), next to the whole call and an
empty Triton kernel's JIT launch. Device: the kernel beside what the same bytes cost when moved
by other means (a copy of the same byte count, a fill of the output, and a Triton kernel with the
same access pattern that does no dequantization arithmetic), and the fixed-grid (persistent)
variants of the kernel. Every kernel variant is checked bit-exact against bitsandbytes first.
Exploratory: the repository's figures come from `python -m experiments bench` and `python -m verify`.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import triton
import triton.language as tl

import nf4
from nf4 import DequantConfig, NF4Weight, runtime
from nf4.dequant import api as dequant_api
from nf4.dequant import launch as dequant_launch
from nf4.device import absmax_of_block, mul, nf4_level, store_rounded, word_nibble_shift
from verify import peers, timing
from verify.exact import mismatch_count as bitexact_count
from verify.timing import empty_jit_launch

from .bench import make_weights, parse_case


@triton.jit
def _store_floor_kernel(out_ptr, n_words, TILE: tl.constexpr, STORE_CM: tl.constexpr):
    """Only nf4's stores (zeros): 8 outputs per 32-bit word, a warp's store covering contiguous bytes."""
    w = tl.program_id(0) * TILE + tl.arange(0, TILE)
    k = tl.arange(0, 8)
    zeros = tl.zeros((TILE, 8), dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + w[:, None] * 8 + k[None, :], zeros, mask=(w < n_words)[:, None], cache_modifier=STORE_CM)


@triton.jit
def _store3d_kernel(out_ptr, n_words, R: tl.constexpr, T: tl.constexpr, STORE_CM: tl.constexpr):
    """Zeros in nf4's output pattern, R words per thread, thread t of T taking words t, t + T, ..."""
    w = tl.program_id(0) * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    k = tl.arange(0, 8)
    zeros = tl.zeros((R, T, 8), dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + w[:, :, None] * 8 + k[None, None, :], zeros, mask=(w < n_words)[:, :, None],
             cache_modifier=STORE_CM)


@triton.jit
def _load_word(ptr, mask, LOAD: tl.constexpr):
    """A 32-bit load per element: tl.load (LOAD 0) or inline PTX, whose result takes the layout of its
    use, so that Triton does not vectorise the load and then move the words through shared memory."""
    if LOAD == 0:
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
    elif LOAD == 4:  # as nf4/kernel.py: the index is clamped in bounds, the load is not masked
        return tl.load(ptr, eviction_policy="evict_first")
    elif LOAD == 1:
        return tl.inline_asm_elementwise("ld.global.cs.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    elif LOAD == 5:  # non-coherent, and L2 fetches the whole 256-byte block around each miss
        return tl.inline_asm_elementwise("ld.global.nc.L2::256B.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    elif LOAD == 6:  # the same prefetch-size hint on a coherent streaming load
        return tl.inline_asm_elementwise("ld.global.cs.L2::256B.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    elif LOAD == 2:
        return tl.inline_asm_elementwise("ld.global.L1::no_allocate.u32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.L1::no_allocate.u32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _expand3d_kernel(words_ptr, out_ptr, n_words, R: tl.constexpr, T: tl.constexpr, STORE_CM: tl.constexpr,
                     LOAD: tl.constexpr):
    """nf4's loads and stores with R words per thread (thread t of T: words t, t + T, ...), no arithmetic."""
    words_ptr = words_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    w = tl.program_id(0) * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    ok = w < n_words
    word = _load_word(words_ptr + tl.minimum(w, n_words - 1), ok, LOAD)
    k = tl.arange(0, 8)
    shift = word_nibble_shift(k)
    nib = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.float32)
    tl.store(out_ptr + w[:, :, None] * 8 + k[None, None, :], nib.to(out_ptr.dtype.element_ty),
             mask=ok[:, :, None], cache_modifier=STORE_CM)


@triton.jit
def _nf4_3d_kernel(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, n_words,
                   BLOCKSIZE: tl.constexpr, R: tl.constexpr, T: tl.constexpr, STORE_CM: tl.constexpr,
                   LOAD: tl.constexpr):
    """The nf4 word path (double quant, ftz, 16-bit output) with R words per thread laid out as above."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    w = tl.program_id(0) * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    ok = w < n_words
    wc = tl.minimum(w, n_words - 1)
    word = _load_word(words_ptr + wc, ok, LOAD)
    absmax = absmax_of_block(wc // (BLOCKSIZE // 8), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                              True, True, True)
    k = tl.arange(0, 8)
    shift = word_nibble_shift(k)
    nib = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.int32)
    y = mul(nf4_level(nib, code_ptr, 0), absmax[:, :, None], True, True)
    store_rounded(out_ptr, w[:, :, None] * 8 + k[None, None, :], y, ok[:, :, None], False, STORE_CM, "")


@triton.jit
def _prefetch_lines(addr):
    """prefetch.global.L2::evict_last of the 128-byte line at each address (returns zeros)."""
    return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk(addr, size):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `addr` where size != 0 (sm_90; returns zeros)."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _nf4_pf_kernel(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, n_words,
                   n_bytes, n_prefetchers, BLOCKSIZE: tl.constexpr, R: tl.constexpr, T: tl.constexpr,
                   PF: tl.constexpr):
    """_nf4_3d_kernel whose first n_prefetchers programs first prefetch the whole packed input into L2
    (PF 1: one prefetch per 128-byte line; PF 2: one bulk prefetch per program), so that DRAM serves
    the reads in one burst and then only writes."""
    pid = tl.program_id(0)
    if PF != 0:
        if pid < n_prefetchers:
            per = tl.cdiv(tl.cdiv(n_bytes, n_prefetchers), 128) * 128
            start = pid * per
            if PF == 1:
                for j in range(0, per, 128 * T):
                    off = start + j + tl.arange(0, T) * 128
                    off = tl.minimum(off, n_bytes - 1)
                    _prefetch_lines(packed_ptr + off)
            else:
                size = tl.maximum(tl.minimum(per, n_bytes - start), 0) // 16 * 16
                lane = tl.arange(0, T)
                _prefetch_bulk(packed_ptr + tl.minimum(start, n_bytes - 1) + lane * 0,
                               tl.where(lane == 0, size, 0).to(tl.uint32))
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    w = pid * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    ok = w < n_words
    wc = tl.minimum(w, n_words - 1)
    word = tl.load(words_ptr + wc)
    absmax = absmax_of_block(wc // (BLOCKSIZE // 8), ok, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                              True, True, True)
    k = tl.arange(0, 8)
    shift = word_nibble_shift(k)
    nib = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.int32)
    y = mul(nf4_level(nib, code_ptr, 0), absmax[:, :, None], True, True)
    store_rounded(out_ptr, w[:, :, None] * 8 + k[None, None, :], y, ok[:, :, None], False, ".cs", "")


PF_GRID = tuple((r, w, pf, per_sm) for r, w in ((2, 2), (2, 4), (1, 4)) for pf, per_sm in
                ((0, 0), (1, 8), (1, 32), (2, 8), (2, 32)))


def prefetch_lab(case, copy_gbs, reps=100) -> list[dict]:
    """The upfront-prefetch variants of the nf4 kernel (each checked bit-exact first)."""

    shape, dtype, n, nbytes, sets, expected = _case_inputs(case)
    n_words, n_bytes = n // 8, (n + 1) // 2
    code = runtime.level_table(sets[0][0].device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for r, warps, pf, per_sm in PF_GRID:
        t = 32 * warps
        grid = (triton.cdiv(n_words, r * t),)

        def dq(s, r=r, t=t, warps=warps, grid=grid, pf=pf, per_sm=per_sm):
            p, q = s
            out = torch.empty(shape, dtype=dtype, device="cuda")
            _nf4_pf_kernel[grid](p, q.absmax, q.state2.absmax, q.state2.code, q.offset, code, out, n_words,
                                 n_bytes, max(1, min(grid[0], per_sm * sms)), BLOCKSIZE=q.blocksize, R=r, T=t,
                                 PF=pf, num_warps=warps, enable_fp_fusion=False)
            return out

        name = f"pf nf4, {r} words/thread, {warps} warps, prefetch {pf}, {per_sm} prefetchers/SM"
        if _inexact(rows, case, name, dq, sets, expected):
            continue
        _add_row(rows, case, name, _device_us(dq, sets, reps), nbytes, copy_gbs, 64, words_per_thread=r,
                 num_warps=warps, prefetch=pf, prefetchers_per_sm=per_sm)
    del sets, expected
    torch.cuda.empty_cache()
    return rows


@triton.jit
def _pipe_tile(words_ptr, absmax_ptr, t, n_words, R: tl.constexpr, T: tl.constexpr, BLOCKSIZE: tl.constexpr):
    """The words and absmax bytes of tile t (indices clamped in bounds: a tile past the end reads the last word)."""
    w = t * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    wc = tl.minimum(w, n_words - 1)
    return tl.load(words_ptr + wc, eviction_policy="evict_first"), tl.load(absmax_ptr + wc // (BLOCKSIZE // 8))


@triton.jit
def _pipe_finish(word, q, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, t, n_words,
                 R: tl.constexpr, T: tl.constexpr, BLOCKSIZE: tl.constexpr, TMA: tl.constexpr):
    """Dequantize a loaded tile (double quant, ftz) and store it: st.global, or one TMA store per tile (TMA)."""
    w = t * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]
    ok = w < n_words
    blk = tl.minimum(w, n_words - 1) // (BLOCKSIZE // 8)
    level = tl.load(code2_ptr + q.to(tl.int32), eviction_policy="evict_last")
    scale2 = tl.load(absmax2_ptr + blk // 256, eviction_policy="evict_last")
    absmax = mul(level, scale2, True, True) + tl.load(offset_ptr)
    k = tl.arange(0, 8)
    shift = word_nibble_shift(k)
    nib = ((word[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.int32)
    y = mul(nf4_level(nib, code_ptr, 0), absmax[:, :, None], True, True)
    if TMA:
        # out_ptr is a tensor descriptor over the output viewed as [n / (8 * T), 8 * T]; a tile is R rows.
        out_ptr.store([t * R, 0], tl.reshape(y.to(out_ptr.dtype), (R, T * 8)))
    else:
        store_rounded(out_ptr, w[:, :, None] * 8 + k[None, None, :], y, ok[:, :, None], False, ".cs", "")


@triton.jit
def _nf4_pipe_kernel(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, n_words,
                     BLOCKSIZE: tl.constexpr, R: tl.constexpr, T: tl.constexpr, PIPE: tl.constexpr,
                     TMA: tl.constexpr):
    """Fixed grid, programs striding over tiles of R x T words. PIPE: the next tile's words and absmax
    bytes are loaded before the current tile is dequantized and stored (a register double buffer), so
    a program keeps a read in flight while it writes."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_words, R * T)
    if PIPE:
        word, q = _pipe_tile(words_ptr, absmax_ptr, pid, n_words, R, T, BLOCKSIZE)
        for t in range(pid, n_tiles, n_progs):
            word_next, q_next = _pipe_tile(words_ptr, absmax_ptr, t + n_progs, n_words, R, T, BLOCKSIZE)
            _pipe_finish(word, q, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, t, n_words, R, T,
                         BLOCKSIZE, TMA)
            word, q = word_next, q_next
    else:
        for t in range(pid, n_tiles, n_progs):
            word, q = _pipe_tile(words_ptr, absmax_ptr, t, n_words, R, T, BLOCKSIZE)
            _pipe_finish(word, q, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr, t, n_words, R, T,
                         BLOCKSIZE, TMA)


# (words per thread, warps, pipelined, TMA store, programs per SM; 0: one tile per program)
PIPE_GRID = tuple((r, w, pipe, tma, per_sm) for tma in (False, True) for r, w in ((2, 2), (2, 4), (1, 4), (4, 4))
                  for pipe, per_sm in ((False, 0), (False, 16), (True, 4), (True, 8), (True, 16)))


def pipe_lab(case, copy_gbs, reps=100) -> list[dict]:
    """Fixed-grid variants with a register double buffer, and with TMA stores (each checked bit-exact first)."""

    shape, dtype, n, nbytes, sets, expected = _case_inputs(case)
    n_words = n // 8
    code = runtime.level_table(sets[0][0].device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    weights = {id(q): NF4Weight.of(p, q) for p, q in sets}  # checked once, outside the timed calls

    def default(s):
        out = torch.empty(shape, dtype=dtype, device="cuda")
        dequant_launch.launch(weights[id(s[1])], out, True)
        return out

    if bitexact_count(default(sets[0]), expected):
        raise RuntimeError(f"nf4 with its defaults is not bit-exact on {case}")
    _add_row(rows, case, "nf4 with its defaults", _device_us(default, sets, reps), nbytes, copy_gbs, 72,
             graph_us=(timing.graph_time_us(default, sets) or {}).get("median_us"))
    for r, warps, pipe, tma, per_sm in PIPE_GRID:
        t = 32 * warps
        tiles = triton.cdiv(n_words, r * t)
        grid = (min(tiles, per_sm * sms) if per_sm else tiles,)
        name = (f"pipe nf4, {r} words/thread, {warps} warps, " + ("prefetch next tile" if pipe else "no prefetch")
                + (", TMA store" if tma else "") + (f", {per_sm} programs/SM" if per_sm else ", one tile/program"))
        if tma and n % (8 * t):
            continue

        def dq(s, r=r, t=t, warps=warps, grid=grid, pipe=pipe, tma=tma):
            p, q = s
            out = torch.empty(shape, dtype=dtype, device="cuda")
            dst = out
            if tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                dst = TensorDescriptor.from_tensor(out.view(-1, 8 * t), [r, 8 * t])
            _nf4_pipe_kernel[grid](p, q.absmax, q.state2.absmax, q.state2.code, q.offset, code, dst, n_words,
                                   BLOCKSIZE=q.blocksize, R=r, T=t, PIPE=pipe, TMA=tma, num_warps=warps,
                                   enable_fp_fusion=False)
            return out

        try:
            if _inexact(rows, case, name, dq, sets, expected):
                continue
        except Exception as exc:  # a variant that does not compile is a finding, not a crash
            rows.append({"case": case, "what": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"  {case} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        _add_row(rows, case, name, _device_us(dq, sets, reps), nbytes, copy_gbs, 72, words_per_thread=r,
                 num_warps=warps, prefetch_next=pipe, tma_store=tma, programs_per_sm=per_sm,
                 graph_us=(timing.graph_time_us(dq, sets) or {}).get("median_us"))
    del sets, expected
    torch.cuda.empty_cache()
    return rows


LAB_GRID = ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8), (16, 4))
LAB_LOADS = ((2, 2), (2, 4), (4, 4), (8, 4), (4, 8))  # also timed with every LOAD mode


def layout_lab(case, copy_gbs, reps=100) -> list[dict]:
    """Words per thread (R) x warps for a store-only, a load+store and an nf4 kernel with R words per
    thread taken T apart (the store layout, so no relayout is needed)."""

    shape, dtype, n, nbytes, sets, expected = _case_inputs(case)
    outs = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(2)]
    n_words = n // 8
    code = runtime.level_table(sets[0][0].device)
    rows = []

    def add(name, us, **extra):
        _add_row(rows, case, name, us, nbytes, copy_gbs, 52, **extra)

    for r, warps in LAB_GRID:
        t = 32 * warps
        grid = (triton.cdiv(n_words, r * t),)

        def store(o, r=r, t=t, warps=warps, grid=grid):
            _store3d_kernel[grid](o, n_words, R=r, T=t, STORE_CM=".cs", num_warps=warps)

        def expand(s, r=r, t=t, warps=warps, grid=grid):
            out = torch.empty(shape, dtype=dtype, device="cuda")
            _expand3d_kernel[grid](s[0], out, n_words, R=r, T=t, STORE_CM=".cs", LOAD=1, num_warps=warps)
            return out

        tag = f"{r} words/thread, {warps} warps"
        add(f"lab stores only, {tag}", _device_us(store, outs, reps), words_per_thread=r, num_warps=warps)
        add(f"lab loads+stores, {tag}", _device_us(expand, sets, reps), words_per_thread=r, num_warps=warps)
        for load in (0, 1, 2, 3, 4, 5, 6) if (r, warps) in LAB_LOADS else (1,):
            def dq(s, r=r, t=t, warps=warps, grid=grid, load=load):
                p, q = s
                out = torch.empty(shape, dtype=dtype, device="cuda")
                _nf4_3d_kernel[grid](p, q.absmax, q.state2.absmax, q.state2.code, q.offset, code, out, n_words,
                                     BLOCKSIZE=q.blocksize, R=r, T=t, STORE_CM=".cs", LOAD=load, num_warps=warps,
                                     enable_fp_fusion=False)
                return out

            name = f"lab nf4, {tag}, load {load}"
            if not _inexact(rows, case, name, dq, sets, expected):
                add(name, _device_us(dq, sets, reps), words_per_thread=r, num_warps=warps, load=load)
    del sets, expected, outs
    torch.cuda.empty_cache()
    return rows


def _driver_memset():
    """The CUDA driver's cuMemsetD32Async (the device's own fill), through ctypes."""
    import ctypes

    fn = ctypes.CDLL("libcuda.so.1").cuMemsetD32Async
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def memset(t):
        rc = fn(t.data_ptr(), 0, t.numel() * t.element_size() // 4, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cuMemsetD32Async returned {rc}")
        return t

    return memset


def _case_inputs(case):
    """(shape, dtype, n, bytes nf4 moves, rotated (packed, quant_state) sets, bitsandbytes' output)."""
    shape, dtype = parse_case(case)
    n = math.prod(shape)
    nbytes = timing.nf4_bytes(n, 64, torch.empty((), dtype=dtype).element_size())
    sets = make_weights(shape, dtype, copies=timing.rotation_count(nbytes))
    return shape, dtype, n, nbytes, sets, peers.bnb_dequantize(*sets[0])


def _add_row(rows, case, name, us, nbytes, copy_gbs, width, **extra):
    """Append a timed row (device us, % of the copy bandwidth for nf4's bytes) and print it."""
    row = {"case": case, "what": name, "device_us": round(us, 3), "bytes": nbytes,
           "pct_copy": round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs, 2), **extra}
    rows.append(row)
    print(f"  {case:<16} {name:<{width}} {us:8.2f} us {row['pct_copy']:6.1f}%", flush=True)


@triton.jit
def _nothing_kernel():
    pass


def _driver_launch():
    """cuLaunchKernel of an argument-free Triton kernel straight through ctypes, every argument prepared
    once: the driver's own launch cost plus one ctypes call, with no Triton code on the way."""
    import ctypes

    compiled = _nothing_kernel[(1,)]()
    torch.cuda.synchronize()
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    # Triton appends scratch pointers to the kernel's parameters (their number varies by release):
    # point every slot at a null pointer; the driver reads only as many as the kernel declares.
    nulls = (ctypes.c_uint64 * 8)()
    params = (ctypes.c_void_p * 8)(*[ctypes.addressof(nulls) + 8 * i for i in range(8)])
    func, threads = compiled.function, 32 * compiled.metadata.num_warps
    shared = compiled.metadata.shared
    stream = torch.cuda.current_stream().cuda_stream

    def launch(_):
        rc = fn(func, 1, 1, 1, threads, 1, 1, shared, stream, params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel returned {rc}")

    return launch


def _inexact(rows, case, name, call, sets, expected, words_only=True) -> bool:
    """Run `call` on the first input set and compare it with bitsandbytes' output; record and print
    a row when it differs. words_only: the lab kernels write whole words only, so a weight with a
    partial last word counts as inexact (-1) without running them."""
    whole = not words_only or expected.numel() % 8 == 0
    bad = bitexact_count(call(sets[0]), expected) if whole else -1
    if bad:
        rows.append({"case": case, "what": name, "mismatches": bad})
        print(f"  {case} {name}: NOT bit-exact ({bad})", flush=True)
    return bool(bad)


def _host(fn, calls=300):
    return round(timing.host_time_us(fn, [None], calls=calls)["median_us"], 3)


def host_parts(case="1024x1024:bf16") -> dict:
    """Host microseconds per step of the fast path (a small weight, so the GPU keeps up)."""
    shape, dtype = parse_case(case)
    (p, q), = make_weights(shape, dtype, copies=1)
    dev, idx, shp = p.device, p.device.index, q.shape
    buf = torch.empty(shp, dtype=dtype, device=dev)
    tmpl = torch.empty(0, dtype=dtype, device=dev)

    tuned = dequant_launch.tuned_config(dev, math.prod(shp) * buf.element_size())

    def plan_with(direct):
        config = tuned.with_(direct_launch=direct)
        dequant_api.CACHE.forget(q)
        nf4.dequantize(p, q, config=config)
        nf4.dequantize(p, q, config=config)  # the plan (the bound launch) is made on the second full-path call
        return dequant_api.CACHE.peek(q)

    wrapper, direct = plan_with(False), plan_with(True)
    dequant_api.CACHE.forget(q)
    nf4.dequantize(p, q)
    nf4.dequantize(p, q)  # the plan of a call without a config stays for the nf4.dequantize rows
    parts = {
        "empty Triton kernel, JIT launch": empty_jit_launch(),
        "driver cuLaunchKernel of an empty kernel (ctypes)": _driver_launch(),
        "python call of a no-op": lambda _: _noop(p, q),
        "torch.compiler.is_compiling()": lambda _: torch.compiler.is_compiling(),
        "plan lookup + match": lambda _: dequant_api.CACHE.get(q, p),
        "torch.empty(shape, dtype=, device=)": lambda _: torch.empty(shp, dtype=dtype, device=dev),
        "torch.empty(shape, dtype=, device=index)": lambda _: torch.empty(shp, dtype=dtype, device=idx),
        "Tensor.new_empty(shape)": lambda _: tmpl.new_empty(shp),
        "current raw stream": lambda _: torch._C._cuda_getCurrentRawStream(idx),
        "plan.run(out) via CompiledKernel.run": lambda _: wrapper.run(p, buf),
        "plan.run(out) via the C launch function": lambda _: direct.run(p, buf),
        "plan.run() via the C launch function": lambda _: direct.run(p, None),
        "nf4.dequantize(p, q, out=buf)": lambda _: nf4.dequantize(p, q, out=buf),
        "nf4.dequantize(p, q)": lambda _: nf4.dequantize(p, q),
    }
    for fn in parts.values():  # warm every path once (compiles the empty kernel)
        fn(None)
    torch.cuda.synchronize()
    result = {"case": case, "direct_launch_used": direct.bound.ctx[0] is not wrapper.bound.ctx[0]}
    result["us"] = {name: _host(fn) for name, fn in parts.items()}
    # Second pass in reverse order: the spread between the passes shows the noise.
    result["us_second_pass"] = {name: _host(parts[name]) for name in reversed(parts)}
    return result


def _noop(p, q):
    return None


def _device_us(call, sets, reps, flush=None):
    if flush is None:
        return timing.device_time_us(call, sets, reps=reps)["median_us"]
    # Diagnostic: read `flush` (larger than L2) before each timed call, so the call starts with no
    # dirty lines of the previous call left in L2 to write back.
    import statistics

    for i in range(5):
        call(sets[i % len(sets)])
    times = []
    for i in range(reps):
        flush.sum()
        torch.cuda._sleep(timing.SPIN_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call(sets[i % len(sets)])
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def device_parts(case, copy_gbs, reps=100, grid=None) -> list[dict]:

    shape, dtype, n, nbytes, sets, expected = _case_inputs(case)
    out_bytes = expected.element_size()
    rows = []

    def add(name, us, **extra):
        _add_row(rows, case, name, us, nbytes, copy_gbs, 48, **extra)

    half = nbytes // 2
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(timing.rotation_count(nbytes))]
    add("copy of the same byte count", _device_us(lambda s: s[1].copy_(s[0]), pairs, reps))
    del pairs
    outs = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(2)]
    fill_us = _device_us(lambda o: o.fill_(0), outs, reps)
    add("fill of the output (writes only)", fill_us, note="counted against all the bytes nf4 moves")
    memset = _driver_memset()
    add("driver memset of the output (writes only)", _device_us(memset, outs, reps),
        note="cuMemsetD32Async; counted against all the bytes nf4 moves")
    n_words = n // 8
    for tile, warps, cm in ((128, 2, ".cs"), (128, 2, ""), (512, 4, ".cs")):
        def store_call(o, tile=tile, warps=warps, cm=cm):
            _store_floor_kernel[(triton.cdiv(n_words, tile),)](o, n_words, TILE=tile, STORE_CM=cm, num_warps=warps)
            return o

        add(f"nf4's stores only: {tile} words, {warps} warps, cache '{cm}'", _device_us(store_call, outs, reps))

    tuned = dequant_launch.tuned_config(torch.device("cuda", torch.cuda.current_device()), n * out_bytes)
    tile_words, warps = tuned.tile_bytes // 4, tuned.num_warps
    row = min(tile_words, 32 * warps)

    def floor_call(s):  # nf4's tile, warps, word layout, loads and stores, with no dequantization
        out = torch.empty(shape, dtype=dtype, device="cuda")
        _expand3d_kernel[(triton.cdiv(n_words, tile_words),)](s[0], out, n_words, R=tile_words // row, T=row,
                                                              STORE_CM=".cs", LOAD=4, num_warps=warps)
        return out

    add("same loads/stores, no dequantization", _device_us(floor_call, sets, reps))
    flush = torch.empty(timing.L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda").zero_()

    weights = {id(q): NF4Weight.of(p, q) for p, q in sets}  # checked once, outside the timed calls

    def cfg_call(tile, warps, per_sm):
        def call(s):
            p, q = s
            out = torch.empty(q.shape, dtype=q.dtype, device=p.device)
            config = None if tile is None else DequantConfig(tile_bytes=tile, num_warps=warps, programs_per_sm=per_sm)
            dequant_launch.launch(weights[id(q)], out, True, config)
            return out
        return call

    base = cfg_call(None, None, None)  # nf4.dequantize's own choice for this size
    bad = bitexact_count(base(sets[0]), expected)
    if bad:
        raise RuntimeError(f"nf4 with its defaults is not bit-exact on {case}: {bad} elements")
    add("nf4 with its defaults", _device_us(base, sets, reps))

    grid = grid or ([(512, 2, 0)] + [(t, w, k) for t in (512, 1024) for w in (2, 4) for k in (4, 8, 16, 32)
                                     if not (w == 4 and k == 32)])
    for tile, warps, per_sm in grid:
        call = cfg_call(tile, warps, per_sm)
        name = f"nf4 tile {tile} B, {warps} warps, " + (f"{per_sm} programs/SM" if per_sm else "one tile per program")
        if _inexact(rows, case, name, call, sets, expected, words_only=False):
            continue
        add(name, _device_us(call, sets, reps), tile_bytes=tile, num_warps=warps, programs_per_sm=per_sm,
            graph_us=(timing.graph_time_us(call, sets) or {}).get("median_us"))
    add("nf4 with its defaults, L2 read-flushed before each call", _device_us(base, sets, reps, flush=flush))
    add("copy of the same byte count, L2 read-flushed", _device_us(
        lambda s: s[1].copy_(s[0]), [(torch.empty(half, dtype=torch.uint8, device="cuda"),
                                      torch.empty(half, dtype=torch.uint8, device="cuda"))], reps, flush=flush))
    del sets, expected, flush, outs
    torch.cuda.empty_cache()
    return rows


def _print_host(host: dict) -> dict:
    for name, us in host["us"].items():
        print(f"  host {name:<48} {us:7.2f} us  (second pass {host['us_second_pass'][name]:.2f})", flush=True)
    return host


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=["8192x2048:fp16", "14336x4096:bf16", "28672x8192:bf16"])
    ap.add_argument("--out", default="results/tuning/probe.json")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--lab", action="store_true", help="only the words-per-thread x warps layout lab")
    ap.add_argument("--prefetch-lab", action="store_true", help="only the upfront L2 prefetch variants")
    ap.add_argument("--host", action="store_true", help="only the host steps")
    ap.add_argument("--pipe-lab", action="store_true",
                    help="only the fixed-grid variants with a register double buffer and/or TMA stores")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("experiments probe needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    env = timing.environment()
    print(f"{env['device']} triton {env['triton']}", flush=True)
    if args.host:
        payload = {"env": env, "host": _print_host(host_parts())}
        print(f"wrote {timing.write_json(args.out, payload)}")
        return 0
    copy = timing.copy_bandwidth_gbs()
    print(f"copy {copy['gbs']:.0f} GB/s", flush=True)
    lab = pipe_lab if args.pipe_lab else prefetch_lab if args.prefetch_lab else layout_lab if args.lab else None
    if lab is not None:
        rows = [row for case in args.cases for row in lab(case, copy["gbs"], reps=args.reps)]
        print(f"wrote {timing.write_json(args.out, {'env': env, 'copy_bandwidth': copy, 'lab': rows})}")
        return 0
    host = _print_host(host_parts())
    rows = []
    for case in args.cases:
        rows += device_parts(case, copy["gbs"], reps=args.reps)
    path = timing.write_json(args.out, {"env": env, "copy_bandwidth": copy, "host": host, "device": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
