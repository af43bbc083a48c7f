"""What limits nf4.linear's tl.dot kernel at M = 128-1024: the word GEMM split into its decode, its layout and its
tensor-core loop.

    python -m experiments gemm-limit --out results/linear/gemm_limit_h100.json

GPU only (with --sass-only: the offline SASS count, any machine). For each weight (default: 14336x4096 and
4096x4096, the weights of bars (b)-(d)), each M (default 128, 256, 512, 1024) and the word GEMM config the table
uses at that M (WORD_GEMM128 up to 128 rows, WORD_GEMM256 above, as the sweeps ran it), in one run, with rotating
weights and CUDA-graph device time:
- `production`: `nf4.linear` with that config (nf4_gemm_word_kernel, and its split sum where split-K), checked on
  its operand first (x identity rows: the output is nf4.dequantize(W)^T, bit for bit);
- `probe: lookup` (`gemm_limit_kernel` MODE 0): the production loop itself (the same grid, tile, stages, loads,
  product tables, prmt lookups, layout of the decoded tile and tl.dot) with its float32 partial sums stored as
  they are (no split sum), built with M and SPLIT specialized by Triton's JIT; `..., M and SPLIT unspecialized`: the
  same, built as nf4_gemm_word_kernel declares them (`do_not_specialize`, one build for every M);
- the same loop with other stores of its output (EPILOGUE): the production's (rounded to x's dtype after the
  transpose of the swapped accumulator), rounded before the transpose, stored untransposed, as uint16, as 32-bit
  pairs, rounded with integer operations, or rounded and widened back to float32. On the H100 and H200 (Triton 3.6)
  every store of 16-bit values, the pairs too, measured slower than the float32 stores at M >= 256 on 14336x4096;
  the SASS says how: ptxas waits for every wgmma of the main loop (`wgmma_waits`: each wait leaves 0 groups
  pending) where Triton stores the accumulator so, and keeps them asynchronous where it stores float32. ptxas -v
  says why (`wgmma_serialized`, its C7515 note): "non wgmma instructions defining accumulator registers of a wgmma
  between start and end of the pipeline stage". In the PTX those are the accumulator's zeros set again on the
  loop's zero-trip path, a block that LLVM lays out between the loop and its last wgmma wait when the epilogue
  rounds (with a float32 store the zeros are set once, before the loop's guard). `..., loop said nonempty` is the
  production's store with the loop told to run at least once (`tl.assume`), which removes that path: the fix the
  production took (nf4_gemm_word_kernel); the other probes keep the loop as it was;
- `probe: no lookup` (MODE 1): the same loop with the product tables and the prmt lookups replaced by four bit
  operations per word that keep every load live (words and both absmax levels still read): the decode's cost;
- `probe: dense operand` (MODE 2): the same grid and tile multiplying the bfloat16 weight (nf4.dequantize's)
  read from memory instead of the packed bytes (Triton stages both operands through shared memory): what
  Triton's tl.dot loop reaches with no decode at all, reading 4x the bytes;
- `cuBLAS` (F.linear on the dequantized weight) and `nf4.dequantize + cuBLAS` (the table's row past 128 rows).
None of the probes is exact (they compute nothing the user wants); they run only here, are not variants of the
registry (whose variants are operand-exact before they are timed), and are reached from no product code.

`sass_mix` compiles the production launch and each probe for the GPU's architecture with the installed Triton and
counts the SASS instructions of its main loop by opcode (nvdisasm, bundled with Triton), and the kernel's wgmma waits
by the groups each leaves pending. Where ptxas serializes the wgmma depends on the Triton and ptxas versions: the
GPU run records the GPU machine's (the offline --sass-only count uses this machine's).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from nf4 import NF4Weight
from nf4.device import absmax_of_block, product_table, table_pairs
from nf4.linear import config as linear_config
from nf4.linear import launch as linear_launch
from nf4.linear import tuned as linear_tuned
from nf4.linear.common import grouped
from nf4.linear.gemm_word import word_tile
from verify import timing

from .bench_linear import floors, make_weights, mismatches
from .gemv_limit import add_sass_arguments, rerun_without_interpreter

DEFAULT_SHAPES = ("14336x4096", "4096x4096")
DEFAULT_MS = (128, 256, 512, 1024)
X_DT = {torch.float16: 1, torch.bfloat16: 2}  # the kernels' dtype codes
# part -> (gemm_limit_kernel's MODE, whether M and SPLIT are passed unspecialized as nf4_gemm_word_kernel takes them,
# its EPILOGUE, its NONEMPTY). The probes keep the loop as the production had it before its tl.assume (NONEMPTY
# off), but for the one that adds it to the production's store.
PROBES = {"probe: lookup": (0, False, 0, False), "probe: lookup, M and SPLIT unspecialized": (0, True, 0, False),
          "probe: lookup, production's store": (0, True, 1, False),
          "probe: lookup, production's store, loop said nonempty": (0, True, 1, True),
          "probe: lookup, rounded before the transpose": (0, True, 2, False),
          "probe: lookup, stored untransposed": (0, True, 3, False),
          "probe: lookup, stored as 16-bit integers": (0, True, 4, False),
          "probe: lookup, rounded, stored as float32": (0, True, 5, False),
          "probe: lookup, stored as 32-bit pairs": (0, True, 6, False),
          "probe: lookup, rounded with 32-bit integers": (0, True, 8, False),
          "probe: no lookup": (1, False, 0, False), "probe: dense operand": (2, False, 0, False),
          "probe: dense operand, loop said nonempty": (2, False, 0, True)}


def config_for(m: int) -> linear_config.LinearConfig:
    """The word GEMM config the tuned table runs (or, past 256 rows, the one its sweeps ran) at M rows of x."""
    return linear_tuned.WORD_GEMM128 if m <= 128 else linear_tuned.WORD_GEMM256


def _gemm_limit(x_ptr, packed_ptr, dense_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
                M, N, K, KB, SPLIT, SEG,
                BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, X_DT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                SWAP: tl.constexpr, EVICT: tl.constexpr, MODE: tl.constexpr, EPILOGUE: tl.constexpr,
                NONEMPTY: tl.constexpr):
    """nf4_gemm_word_kernel's loop (PARTIAL: float32 sums [SPLIT, M, N] stored, no bias). MODE 0: its decode
    (product tables, prmt lookups); 1: each word's four pairs from bit operations on the word and the absmax bits
    instead; 2: the tile read as bfloat16/float16 from dense_ptr [N, K] (no packed bytes, no absmax). EPILOGUE 0:
    the float32 sums stored; 1: rounded to x's dtype after the transpose of SWAP's accumulator (the production's
    store, into [M, N] of split 0); 2: rounded before the transpose; 3: rounded, SWAP's accumulator stored as it is
    through transposed addresses; 4: as 1 with the rounded bits stored as uint16; 5: rounded, then widened back and
    stored as float32; 6: rounded, two neighbouring outputs of a row packed into one 32-bit word and stored; 8:
    rounded (RNE, bfloat16 only) with 32-bit integer operations, truncated to 16 bits just before Triton's store.
    NONEMPTY: the loop told to the compiler to run at least once (`tl.assume`), as the production's is."""
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    pid = tl.program_id(0)
    pid_k = pid % SPLIT
    pid_m, pid_n = grouped(pid // SPLIT, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r = tl.minimum(rows, N - 1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    H: tl.constexpr = BLOCK_K // 32
    wp = words_ptr + r[None, :, None] * KW + (4 * tl.arange(0, H)[:, None, None] + tl.arange(0, 4)[None, None, :])
    dp = dense_ptr + r[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    xp = x_ptr + m[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    blk = r * (KB // (BLOCKSIZE // 2))
    always = r >= 0
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * SEG
    end = tl.minimum(first + SEG, KB)
    if NONEMPTY:
        tl.assume(end > first)
    for c0 in range(first, end, BLOCK_K // 2):
        if MODE == 2:
            w = tl.load(dp + 2 * c0, eviction_policy=EVICT)
        else:
            amax = absmax_of_block(blk + c0 // (BLOCKSIZE // 2), always, absmax_ptr, absmax2_ptr, code2_ptr,
                                   offset_ptr, DOUBLE_QUANT, FTZ, True)[None, :, None]
            word = tl.load(wp + c0 // 4, eviction_policy=EVICT)
            if MODE == 0:
                t0, t1, t2, t3, t4, t5, t6, t7 = product_table(amax, FTZ, X_DT)
                p0, p1, p2, p3 = table_pairs(word, t0, t1, t2, t3, t4, t5, t6, t7)
            else:
                a = amax.to(tl.uint32, bitcast=True) & 0x00010001
                p0 = ((word & 0x0F0F0F0F) | 0x3C003C00) ^ a
                p1 = (((word >> 4) & 0x0F0F0F0F) | 0x3C003C00) ^ a
                p2 = (((word >> 8) & 0x0F0F0F0F) | 0x3C003C00) ^ a
                p3 = (((word >> 12) & 0x0F0F0F0F) | 0x3C003C00) ^ a
            w = word_tile(p0, p1, p2, p3, X_DT)
        xk = tl.load(xp + 2 * c0, mask=m_ok[:, None], other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(xk), acc)
        else:
            acc = tl.dot(xk, tl.trans(w), acc)
    ok = m_ok[:, None] & row_ok[None, :]
    if X_DT == 2:
        dt = tl.bfloat16
    else:
        dt = tl.float16
    if EPILOGUE == 0:
        if SWAP:
            acc = tl.trans(acc)
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], acc, mask=ok)
    elif EPILOGUE == 3:
        y = acc.to(dt)
        if SWAP:
            tl.store(out_ptr.to(tl.pointer_type(dt)) + m[None, :] * N + rows[:, None], y,
                     mask=m_ok[None, :] & row_ok[:, None])
        else:
            tl.store(out_ptr.to(tl.pointer_type(dt)) + m[:, None] * N + rows[None, :], y, mask=ok)
    elif EPILOGUE == 5:
        if SWAP:
            acc = tl.trans(acc)
        tl.store(out_ptr + (pid_k * M + m[:, None]) * N + rows[None, :], acc.to(dt).to(tl.float32), mask=ok)
    elif EPILOGUE == 6:
        if SWAP:
            acc = tl.trans(acc)
        even, odd = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        pair = (even.to(dt).to(tl.uint16, bitcast=True).to(tl.uint32)
                | (odd.to(dt).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
        j = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + m[:, None] * (N // 2) + j[None, :], pair,
                 mask=m_ok[:, None] & (j < N // 2)[None, :])
    elif EPILOGUE == 8:
        if SWAP:
            acc = tl.trans(acc)
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + m[:, None] * N + rows[None, :], bits.to(tl.uint16), mask=ok)
    elif EPILOGUE == 4:
        if SWAP:
            acc = tl.trans(acc)
        y = acc.to(dt).to(tl.uint16, bitcast=True)
        tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + m[:, None] * N + rows[None, :], y, mask=ok)
    else:
        if EPILOGUE == 2:
            y = acc.to(dt)
            if SWAP:
                y = tl.trans(y)
        else:
            if SWAP:
                acc = tl.trans(acc)
            y = acc.to(dt)
        tl.store(out_ptr.to(tl.pointer_type(dt)) + m[:, None] * N + rows[None, :], y, mask=ok)


gemm_limit_kernel = triton.jit(_gemm_limit)
# the same kernel with M and SPLIT unspecialized, as nf4_gemm_word_kernel declares them (one build for every M)
gemm_limit_kernel_dynamic = triton.jit(_gemm_limit, do_not_specialize=["M", "SPLIT"])


def kernel_of(part: str):
    return gemm_limit_kernel_dynamic if PROBES[part][1] else gemm_limit_kernel


def probe_args(x, w, dense, out, config: linear_config.LinearConfig, part: str) -> tuple[tuple, dict, dict]:
    """(grid, kernel arguments, launch options) of a probe with the production launch's grid, tile and split, for
    the validated weight `w` (real tensors, or meta ones for an offline build)."""
    m = x.shape[0]
    n, k = w.shape
    split, seg = linear_launch.split_k(config, w, m, x.device)
    dummy = torch.zeros(16, dtype=torch.float32, device=x.device)
    mode, _, epilogue, nonempty = PROBES[part]
    args = {"x_ptr": x, "packed_ptr": w.packed, "dense_ptr": dense, "absmax_ptr": w.absmax,
            "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
            "offset_ptr": w.offset if w.nested else dummy, "out_ptr": out,
            "M": m, "N": n, "K": k, "KB": k // 2, "SPLIT": split, "SEG": seg,
            "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": True, "X_DT": X_DT[x.dtype],
            "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": linear_launch.gemm_block_k(config, w),
            "GROUP": config.group, "SWAP": config.swap, "EVICT": config.evict, "MODE": mode, "EPILOGUE": epilogue,
            "NONEMPTY": nonempty}
    grid = (split * triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    return grid, args, {"num_warps": config.num_warps, "num_stages": config.num_stages}


def probe_call(x, packed, qs, dense, config: linear_config.LinearConfig, part: str):
    """A callable launching one probe (its float32 partial sums into a buffer of its own)."""
    grid, args, options = probe_args(x, NF4Weight.from_state(packed, qs), dense, None, config, part)
    kernel = kernel_of(part)
    args["out_ptr"] = torch.empty((args["SPLIT"], x.shape[0], args["N"]), dtype=torch.float32, device=x.device)

    def call(_):
        kernel[grid](**args, **options)

    return call


def identity_rows(m: int, k: int, dtype) -> torch.Tensor:
    """x of m identity rows e_0 .. e_{m-1} (m <= k): x @ W^T is the operand's first m columns, transposed."""
    x = torch.zeros((m, k), dtype=dtype, device="cuda")
    x[torch.arange(m), torch.arange(m)] = 1
    return x


def measure(shape: str, m: int, dtype, copy_gbs: float, log=print) -> list[dict]:
    """Graph device time of production, the probes and the cuBLAS references on one weight at M rows."""
    import nf4

    n, k = (int(v) for v in shape.lower().split("x"))
    config = config_for(m)
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    dense = [nf4.dequantize(p, qs).to(dtype) for p, qs in sets[:2]]  # two: the dense rows' rotation
    x = identity_rows(m, k, dtype)
    base = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."),
            "config": {f: getattr(config, f) for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                                       "split_k", "programs_per_sm")},
            **floors(n, k, m, torch.empty((), dtype=dtype).element_size(), copy_gbs)}
    got = nf4.linear(x, sets[0][0], sets[0][1], config=config)
    want = dense[0][:, :m].t().contiguous()
    rows = []

    def row(part, fn, count, **extra):
        fn(0)
        g = timing.graph_time_us(fn, list(range(count)))
        rows.append({**base, "part": part, "graph_us": g and g.get("median_us"), **extra})

    row("production", lambda i: nf4.linear(x, *sets[i % len(sets)], config=config), len(sets),
        operand_mismatches=mismatches(got, want))
    for part in PROBES:
        calls = [probe_call(x, p, qs, dense[i % 2], config, part) for i, (p, qs) in enumerate(sets)]
        row(part, lambda i, calls=calls: calls[i % len(calls)](None), len(calls))
    row("cuBLAS", lambda i: torch.nn.functional.linear(x, dense[i % 2]), 2)
    row("nf4.dequantize + cuBLAS", lambda i: torch.nn.functional.linear(x, nf4.dequantize(*sets[i % len(sets)])),
        len(sets))
    for r in rows:
        log(f"  {shape} M={m:<5} {r['part']:<24} {r['graph_us'] or float('nan'):8.2f} us"
            + (f", operand mismatches {r['operand_mismatches']}" if "operand_mismatches" in r else ""), flush=True)
    sets.clear()
    dense.clear()
    torch.cuda.empty_cache()
    return rows


def sass_mix(n: int, k: int, m: int, dtype, arch: int) -> dict:
    """Main-loop SASS of the production launch and of each probe at M rows, compiled offline for sm_<arch>."""
    from .gemv_limit import _sass_of

    config = config_for(m)
    meta = torch.device("meta")
    packed = torch.empty((n * k // 2, 1), dtype=torch.uint8, device=meta)
    w = NF4Weight(packed, torch.empty(n * k // 64, dtype=torch.uint8, device=meta),
                  torch.empty(-(-n * k // 64 // 256), device=meta), torch.empty(256, device=meta),
                  torch.empty((), device=meta), (n, k), 64, dtype, True)
    x = torch.empty((m, k), dtype=dtype, device=meta)
    dense = torch.empty((n, k), dtype=dtype, device=meta)
    launches = linear_launch.kernel_args(x, w, None, torch.empty((m, n), dtype=dtype, device=meta), m,
                                         config, True, False, torch.empty(1, device=meta))
    fn, _, args, options = launches[0]
    builds = {"production": (fn, args, options)}
    for part in PROBES:
        _, pargs, _ = probe_args(x, w, dense, torch.empty(1, device=meta), config, part)
        builds[part] = (kernel_of(part), pargs, options)
    out = {"arch": arch, "M": m, "N": n, "K": k, "config": str(config)}
    for part, (kernel, kargs, opts) in builds.items():
        out[part] = _sass_of(kernel, kargs, opts, arch)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments gemm-limit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="weights N x K")
    ap.add_argument("--ms", nargs="+", type=int, default=list(DEFAULT_MS), help="rows of x")
    add_sass_arguments(ap, "build/gemm_limit.json")
    args = ap.parse_args(argv)
    rc = rerun_without_interpreter("experiments.gemm_limit", argv)
    if rc is not None:
        return rc
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gpu = torch.cuda.is_available() and not args.sass_only
    if args.arch is None:
        cap = torch.cuda.get_device_capability() if gpu else (9, 0)
        args.arch = cap[0] * 10 + cap[1]
    n, k = (int(v) for v in args.shapes[0].lower().split("x"))
    sass = [sass_mix(n, k, m, dtype, args.arch) for m in sorted({128, 256} & set(args.ms)) or [args.ms[0]]]
    for s in sass:
        for part in ("production", *PROBES):
            r = s[part]
            print(f"SASS {s['arch']} M={s['M']} {part}: {r['loop_instructions']} instructions per loop step of a warp, "
                  f"{r['registers']} registers: {r['loop_opcodes']}")
    payload = {"env": timing.environment(), "sass": sass}
    if gpu:
        copy = timing.copy_bandwidth_gbs()
        print(f"copy {copy['gbs']:.0f} GB/s", flush=True)
        payload["copy_bandwidth"] = copy
        payload["rows"] = [r for shape in args.shapes for m in args.ms for r in measure(shape, m, dtype, copy["gbs"])]
    elif not args.sass_only:
        print("no CUDA GPU: only the offline SASS count", file=sys.stderr)
    print(f"wrote {timing.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
