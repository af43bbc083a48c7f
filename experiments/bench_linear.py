"""Benchmark `nf4.linear` against its peers: the released code, run in the same process on the same GPU.

    python -m experiments bench-linear                        # results under build/linear/ (--out to choose)
    python -m experiments bench-linear --sweep                # also time the config grid (tuning)
    python -m experiments bench-linear --shapes 14336x4096 --ms 1 16 256 --dtypes bf16

Needs a CUDA GPU and bitsandbytes (Unsloth 2026.10.9 from `.peers/`, see verify/unsloth_release.py).
For each weight (N x K, NF4, blocksize 64, double-quantized, as bitsandbytes quantizes it on the GPU)
and each M (rows of x), every provider is first checked, then timed:
- operand check: x made of signed power-of-two-scaled identity rows at random columns; the output must
  equal the dequantized weight's columns (exactly scaled) bit for bit (docs/FORMAT.md §10). A
  provider that fails is still timed (peers are what they are), and the row says so; a config of
  nf4 that fails is not timed;
- sum check: for the random x, the worst ratio of |y - x @ W (float64)| to the float32 accumulation
  bound K * 2^-24 * sum|x w| + u * |x @ W| (u: the output dtype's unit roundoff), over x's first rows;
- CUDA-graph device time with rotating weights and x (L2 holds nothing useful), and host time per
  call at M = 1 and 512, in batches alternating with an empty Triton JIT launch.
Rows also carry the byte floor (packed bytes + absmax + x + output at the copy bandwidth measured in
the same run) and the flop floor at NOMINAL_TFLOPS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from nf4.linear import LinearConfig, autotune
from nf4.weight import NF4Weight
from verify import timing
from verify.cases import clone_state
from verify.timing import empty_jit_launch

SHAPES = ["14336x4096", "4096x14336", "4096x4096", "1024x4096", "8192x2048", "2048x8192"]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NOMINAL_TFLOPS = 989.4  # NVIDIA's dense bf16/fp16 tensor-core figure for the H100 SXM and the H200
HOST_MS = (1, 512)
# a kernel's family, the `path` of result rows (paper.sections.linear groups the table's choices by it)
PATHS = {"gemv": "gemv", "gemv_table": "gemv", "gemv_mma": "gemv", "gemv_pair": "gemv", "gemm_word": "gemm",
         "dequant": "dequant"}

# (block_r, warps, codebook, programs_per_sm); 32 bytes per row and step (half the blocksize of 64)
GEMV_GRID = [(32, 2, 2, 16), (64, 4, 2, 8), (64, 4, 2, 4), (32, 2, 2, 8), (16, 1, 2, 16), (128, 4, 2, 4),
             (64, 2, 2, 8), (32, 2, 0, 16), (64, 4, 0, 8),
             # codebook 3: the word GEMV with a product table per absmax block (kernel gemv_table, M <= 4)
             (256, 2, 3, 16), (256, 2, 3, 8), (128, 2, 3, 16), (128, 1, 3, 16), (256, 4, 3, 8), (64, 2, 3, 16),
             (512, 4, 3, 8), (128, 2, 3, 8)]
# the word GEMV on tensor cores (kernel gemv_mma, mma.sync, M <= 32): (warps, bytes a lane decodes of each of its
# rows per step, programs_per_sm); block_r is 16 * warps. At 76 registers (32-byte lanes) an H100 holds 6 programs
# of 4 warps per multiprocessor, 12 of 2 and 3 of 8 (offline sm_90 build); 16-byte lanes take 68.
MMA_GRID = [(2, 32, 12), (4, 32, 6), (8, 32, 3), (2, 16, 14), (4, 16, 7), (4, 32, 4), (4, 32, 12), (2, 32, 6),
            (4, 32, 3), (4, 16, 3), (4, 32, 2), (2, 16, 6), (8, 16, 2)]  # the last four: fewer programs for M > 8
# (104 registers at 9-16 rows, 138 at 17-32)
# The tensor-core GEMV whose warps split K inside a program (LinearConfig.warps_k): (warps, warps_k, step_bytes,
# split_k, programs_per_sm); split_k 1 is a single launch (no second kernel to add the partial sums).
MMA_WK_GRID = [(w, wk, sb, 1, 8) for w in (4, 8, 16) for wk in (2, 4, 8, 16) if wk <= w for sb in (16, 32)] + [
    (4, 2, 32, 0, 12), (4, 4, 32, 0, 12), (8, 4, 16, 0, 4), (8, 8, 16, 0, 4), (4, 4, 16, 2, 8), (8, 8, 32, 2, 8)]
# The same single-launch grid with the registers capped at 64 per thread (LinearConfig.maxnreg; --sweep-paths
# mma-wk-reg): 4 programs of 256 threads per multiprocessor instead of 3 at the 80 registers Triton 3.6 gives these
# kernels; offline sm_90a builds spill nothing with 16-byte steps and 68 bytes with 32-byte ones.
MMA_WK_REG_GRID = [(w, wk, sb, 1, 8) for w in (4, 8, 16) for wk in (4, 8, 16) if wk <= w for sb in (16, 32)]
WK_MAXNREG = 64
# (The grid of the gathering tl.dot kernel, nf4_gemm_kernel, forward and backward, left with that kernel: no GPU row
# took it, and it is an experiment variant now, experiments/variants/linear/l10_gemm.py to l18 and l21; its sweeps
# are in results/linear/tuning/ and git history.)

# The word tl.dot kernel (kernel gemm_word: nf4_gemm_word_kernel, forward only):
# (block_m, block_n, warps, stages, split_k, programs_per_sm); the decoded tile is tl.dot's first operand (swap; the
# unswapped form is l42, not in this grid: Triton 3.9's offline sm_90 build stores its tile to shared memory 2 bytes
# at a time); block_n is 32 rows per warp (a thread decodes one row's step); split_k 0: the split nearest
# programs_per_sm programs per multiprocessor
WORD_GRID = [(bm, 128, 4, 3, sk, 8) for bm in (16, 32, 64, 128) for sk in (1, 2, 4, 8, 16)] + [
    (bm, 128, 4, 3, 0, pps) for bm in (32, 64, 128) for pps in (2, 3, 4, 6)] + [
    (bm, 256, 8, 3, sk, 8) for bm in (64, 128) for sk in (1, 2, 4)] + [(128, 128, 4, 2, 1, 8), (128, 128, 4, 2, 2, 8)]
# two threads per row of a 128-row tile (8 warps), and 256 rows of x per W tile (its decode shared by twice the rows)
WORD_GRID += [
    (bm, 128, 8, 3, sk, 8) for bm in (64, 128, 256) for sk in (1, 2, 4)] + [
    (256, 64, 4, 3, sk, 8) for sk in (1, 2, 4)] + [(256, 128, 8, 3, 0, pps) for pps in (1, 2)] + [
    (256, 64, 4, 3, 0, pps) for pps in (2, 3)]


def sweep_configs(m: int) -> list[LinearConfig]:
    """The tuning grid at M rows: GEMV shapes for M <= 8, tensor-core GEMV shapes for M <= 32, word tl.dot tiles
    whose BLOCK_M suits M, and nf4.dequantize + cuBLAS."""
    out = []
    if m <= 8:
        out += [LinearConfig(kernel="gemv", block_r=r, num_warps=w, codebook=cb, programs_per_sm=p) if cb < 3
                else LinearConfig(kernel="gemv_table", block_r=r, num_warps=w, programs_per_sm=p)
                for r, w, cb, p in GEMV_GRID]
    if m <= 32:
        out += [LinearConfig(kernel="gemv_mma", block_r=16 * w, num_warps=w, step_bytes=sb,
                             programs_per_sm=p) for w, sb, p in MMA_GRID]
        out += [LinearConfig(kernel="gemv_mma", block_r=16 * w // wk, num_warps=w, warps_k=wk,
                             step_bytes=sb, split_k=sk, programs_per_sm=p) for w, wk, sb, sk, p in MMA_WK_GRID]
        out += [LinearConfig(kernel="gemv_mma", block_r=16 * w // wk, num_warps=w, warps_k=wk,
                             step_bytes=sb, split_k=sk, programs_per_sm=p, maxnreg=WK_MAXNREG)
                for w, wk, sb, sk, p in MMA_WK_REG_GRID]
    top = max(16, triton_next_pow2(m))
    out += [LinearConfig(kernel="gemm_word", block_m=bm, block_n=bn, block_k=64, num_warps=w, num_stages=st,
                         swap=True, split_k=sk, programs_per_sm=pps) for bm, bn, w, st, sk, pps in WORD_GRID
            if bm <= top and (m <= 64 or bm >= 64) and (m <= 128 or sk <= 2)]
    out.append(LinearConfig(kernel="dequant"))  # nf4.dequantize + cuBLAS, what the fused tiles must beat
    return out


def _family(config: LinearConfig) -> str:
    """The --sweep-paths name of a config: gemv, mma (tensor-core GEMV), mma-wk (its warps splitting K; mma-wk-reg with
    its registers capped), wgemm (the word tl.dot kernel), dequant."""
    if config.kernel == "gemm_word":
        return "wgemm"
    if config.kernel == "gemv_mma" and config.warps_k > 1:
        return "mma-wk-reg" if config.maxnreg is not None else "mma-wk"
    return "mma" if config.kernel == "gemv_mma" else PATHS[config.kernel]


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def parse_shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def make_weights(n: int, k: int, dtype, copies: int, seed: int = 0):
    """(packed, QuantState) pairs: one weight quantized by bitsandbytes on the GPU, cloned for rotation."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn((n, k), dtype=torch.float32, device="cuda", generator=gen) * 0.02).to(dtype)
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    del w
    return [(packed, qs)] + [(packed.clone(), clone_state(qs)) for _ in range(copies - 1)]


def providers(m: int, k: int, unsloth) -> dict:
    """name -> callable(x, packed, qs, dense) for M rows of x; the peers' released code."""
    import bitsandbytes as bnb
    from bitsandbytes.backends.cuda import ops as bnb_cuda_ops

    import nf4

    def bnb_args(qs):
        s2 = qs.state2
        return dict(bias=None, absmax_8bit=qs.absmax, absmax_code=s2.code, absmax_offset=qs.offset), s2.absmax

    def bnb_fused(x, p, qs, d):
        kw, absmax = bnb_args(qs)
        return bnb_cuda_ops._gemm_4bit_kernel_impl(x, p.view(-1, 1), qs.shape, absmax, qs.blocksize, "nf4", **kw)

    def bnb_fallback(x, p, qs, d):
        kw, absmax = bnb_args(qs)
        return bnb_cuda_ops._dequant_linear_fallback(x, p.view(-1, 1), qs.shape, absmax, qs.blocksize, "nf4", **kw)

    provs = {
        "nf4.linear": lambda x, p, qs, d: nf4.linear(x, p, qs),
        "bnb.matmul_4bit": lambda x, p, qs, d: bnb.matmul_4bit(x, p.t(), quant_state=qs),
        "bnb.gemm_4bit.fused_kernel": bnb_fused,
        "bnb.gemm_4bit.fallback": bnb_fallback,
        "nf4.dequantize+F.linear": lambda x, p, qs, d: torch.nn.functional.linear(x, nf4.dequantize(p, qs)),
        "dense.F.linear(dequantized)": lambda x, p, qs, d: torch.nn.functional.linear(x, d),
        "torch.compile(dequantize+linear)": _compile_peer(),
    }
    if unsloth is not None and m == 1:
        provs["unsloth.2026.10.9.fast_gemv"] = lambda x, p, qs, d: unsloth.fast_gemv(x.view(1, 1, k), p, qs).view(1, -1)
    return provs


_compiled: list = []


def _compile_peer():
    """torch.compile of the plain PyTorch dequantization (verify.peers.torch_dequantize) + F.linear."""
    from reference.format import NF4_CODE
    from verify import peers

    if not _compiled:
        def deq_linear(x, packed, absmax_u8, absmax2, code2, offset, code, n, blocksize, shape0, shape1):
            w = peers.torch_dequantize(packed, absmax_u8, absmax2, code2, offset, code, n, blocksize, x.dtype)
            return torch.nn.functional.linear(x, w.view(shape0, shape1))

        _compiled.append(torch.compile(deq_linear, dynamic=True))  # one compile for every shape and M
    fn = _compiled[0]

    codes = {}

    def peer(x, p, qs, d):
        code = codes.get(x.device)
        if code is None:
            code = codes[x.device] = torch.tensor(NF4_CODE, device=x.device)
        s2 = qs.state2
        return fn(x, p, qs.absmax, s2.absmax, s2.code, qs.offset, code, qs.shape[0] * qs.shape[1], qs.blocksize,
                  qs.shape[0], qs.shape[1])

    return peer


def identity_rows(m: int, k: int, dtype, seed: int):
    """x = signed power-of-two-scaled identity rows at random columns; returns (x, columns, scales)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.cat([torch.randperm(k, generator=g) for _ in range(-(-m // k))])[:m]
    scales = torch.exp2(torch.randint(-2, 3, (m,), generator=g).double())
    scales = scales * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.zeros((m, k), dtype=torch.float64)
    x[torch.arange(m), cols] = scales
    return x.to(dtype).cuda(), cols.cuda(), scales.cuda()


def operand_expected(wd: torch.Tensor, cols, scales, dtype):
    """Row i of the output: scales[i] * W[:, cols[i]], with the IEEE zero of an exact sum (+0 + -0 = +0)."""
    return (wd.double()[:, cols].t() * scales[:, None] + 0.0).to(dtype)


def sum_ratio(y, x, wd, rows: int = 16) -> float:
    """Worst |y - x @ W^T| / bound over x's first rows (bound: docs/FORMAT.md §10)."""
    xs, ys = x[:rows].double(), y[:rows].double()
    ref = xs @ wd.double().t()
    k = x.shape[-1]
    u = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-11
    bound = k * 2.0**-24 * (xs.abs() @ wd.double().abs().t()) + u * ref.abs()
    bound = torch.where(bound > 0, bound, torch.full_like(bound, 2.0**-149))
    return float(((ys - ref).abs() / bound).max())


def mismatches(got, want) -> int:
    if got.shape != want.shape or got.dtype != want.dtype:
        return -1
    return int((got.view(torch.int16) != want.view(torch.int16)).sum())


def floors(n, k, m, dtype_bytes, copy_gbs):
    packed = n * k // 2
    n_blocks = n * k // 64
    absmax = n_blocks + (-(-n_blocks // 256)) * 4 + 256 * 4 + 4
    xb, ob = m * k * dtype_bytes, m * n * dtype_bytes
    byte_floor = (packed + absmax + xb + ob) / (copy_gbs * 1e9) * 1e6
    flop_floor = 2.0 * m * n * k / (NOMINAL_TFLOPS * 1e12) * 1e6
    return {"byte_floor_us": byte_floor, "flop_floor_us": flop_floor, "floor_us": max(byte_floor, flop_floor),
            "packed_bytes": packed + absmax}


def time_call(call, count):
    g = timing.graph_time_us(call, list(range(count)))
    return g


def bench_weight(n, k, dtype, ms, copy_gbs, unsloth, *, sweep=False, backward=False, log=print, save=None,
                 with_peers=True, sweep_paths=("gemv", "mma")):
    """Rows for one weight at every M (`save(rows)` is called after each M: a cut-off run keeps them)."""
    import nf4

    dtype_bytes = 2
    copies = timing.rotation_count(n * k // 2, minimum=3)
    sets = make_weights(n, k, dtype, copies)
    wd = nf4.dequantize(*sets[0])
    dense = [wd] + [wd.clone() for _ in range(max(1, timing.rotation_count(n * k * 2, minimum=2)) - 1)]
    rows = []
    for m in ms:
        xcopies = max(copies, timing.rotation_count(m * k * 2, minimum=2))
        gen = torch.Generator(device="cuda").manual_seed(m)
        xs = [torch.randn((m, k), device="cuda", generator=gen).to(dtype) for _ in range(min(xcopies, 8))]
        xid, cols, scales = identity_rows(m, k, dtype, seed=m * 7 + n)
        want = operand_expected(wd, cols, scales, dtype)
        fl = floors(n, k, m, dtype_bytes, copy_gbs)
        base = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."), **fl}
        count = max(len(sets), len(xs), len(dense))

        for name, fn in (providers(m, k, unsloth) if with_peers else {}).items():
            row = dict(base, provider=name)
            try:
                got = fn(xid, *sets[0], wd)
                row["operand_mismatches"] = mismatches(got.reshape(m, n), want)
                y = fn(xs[0], *sets[0], wd)
                row["sum_ratio"] = sum_ratio(y.reshape(m, n), xs[0], wd)
                g = time_call(_rotating(fn, xs, sets, dense), count)
                if g and "median_us" in g:
                    row["graph_us"] = g["median_us"]
                    row["pct_of_floor"] = 100 * fl["floor_us"] / g["median_us"]
                elif g:
                    row["graph_error"] = g.get("error")
                if m in HOST_MS:
                    call = _rotating(fn, xs, sets, dense)
                    h = timing.host_time_pair_us(call, list(range(count)), empty_jit_launch(), [None], calls=100,
                                                 batches=9)
                    row["host_us"], row["jit_host_us"] = h["median_us"], h["ref_median_us"]
                if name == "nf4.linear":
                    row["config"] = _config_dict(autotune.pick_for(xs[0], NF4Weight.from_state(*sets[0])))
            except Exception as exc:  # a peer that cannot take this case is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            log(_fmt(row))
        if sweep:
            for config in [c for c in sweep_configs(m) if _family(c) in sweep_paths]:
                rows.append(_sweep_row(base, config, xid, want, xs, sets, wd, count, fl, log, backward=False))
        if backward and m >= 16:  # the table's backward (nf4.dequantize + cuBLAS, the only one) beside dense cuBLAS
            dys = [torch.randn((m, n), device="cuda", generator=gen).to(dtype) for _ in range(min(xcopies, 4))]
            rows.append(_backward_row(base, None, dys, sets, wd, count, log))
            rows.append(_backward_dense_row(base, dys, dense, log))
        torch.cuda.empty_cache()
        if save is not None:
            save(rows)
    return rows


def _rotating(fn, xs, sets, dense):
    """callable(i): fn on the i-th x, weight and dense weight, each list rotated on its own."""
    def call(i):
        p, qs = sets[i % len(sets)]
        return fn(xs[i % len(xs)], p, qs, dense[i % len(dense)])

    return call


def _config_dict(config: LinearConfig) -> dict:
    """The config's fields, with `path` (the kernel's family: gemv, gemm or dequant), which the result files
    carried before configs named their kernel and paper.sections.linear reads."""
    from dataclasses import asdict

    return {**asdict(config), "path": PATHS[config.kernel]}


def _sweep_row(base, config, xid, want, xs, sets, wd, count, fl, log, backward):
    from nf4.linear.api import entry_of, run

    row = dict(base, provider="nf4.linear.sweep", config=_config_dict(config))
    try:
        def fn(x, p, qs):
            return run(x, p, qs, entry_of(p, qs), None, config=config)

        got = fn(xid, *sets[0])
        row["operand_mismatches"] = mismatches(got, want)
        if row["operand_mismatches"] == 0:
            row["sum_ratio"] = sum_ratio(fn(xs[0], *sets[0]), xs[0], wd)
            g = time_call(lambda i: fn(xs[i % len(xs)], *sets[i % len(sets)]), count)
            if g and "median_us" in g:
                row["graph_us"] = g["median_us"]
                row["pct_of_floor"] = 100 * fl["floor_us"] / g["median_us"]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    log(_fmt(row))
    return row


def _backward_row(base, config, dys, sets, wd, count, log):
    from nf4.linear.api import entry_of, run

    m, n, k = base["M"], base["N"], base["K"]
    row = dict(base, provider="nf4.linear.backward" + (".sweep" if config is not None else ""),
               config=_config_dict(config) if config is not None else None)
    try:
        def fn(dy, p, qs):
            return run(dy, p, qs, entry_of(p, qs), None, trans=True, config=config)

        # operand: identity rows of dY pick rows of W
        g = torch.Generator().manual_seed(m + k)
        rows_ = torch.randint(0, n, (m,), generator=g).cuda()
        did = torch.zeros((m, n), dtype=dys[0].dtype, device="cuda")
        did[torch.arange(m, device="cuda"), rows_] = 1
        want = (wd.double()[rows_] + 0.0).to(dys[0].dtype)
        row["operand_mismatches"] = mismatches(fn(did, *sets[0]), want)
        y = fn(dys[0], *sets[0])
        row["sum_ratio"] = sum_ratio(y, dys[0], wd.t())
        t = time_call(lambda i: fn(dys[i % len(dys)], *sets[i % len(sets)]), count)
        if t and "median_us" in t:
            row["graph_us"] = t["median_us"]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    log(_fmt(row))
    return row


def _backward_dense_row(base, dys, dense, log):
    row = dict(base, provider="dense.matmul(dY, W) backward")
    t = time_call(lambda i: dys[i % len(dys)] @ dense[i % len(dense)], max(len(dys), len(dense)))
    if t and "median_us" in t:
        row["graph_us"] = t["median_us"]
    log(_fmt(row))
    return row


def _fmt(r) -> str:
    cfg = r.get("config")
    c = ""
    if cfg:
        kernel = cfg["kernel"]
        c = (f" {kernel} r{cfg['block_r']} w{cfg['num_warps']} cb{cfg['codebook']} p{cfg['programs_per_sm']}"
             + (f" wk{cfg['warps_k']} s{cfg['step_bytes']}" if kernel == "gemv_mma" else "")
             + (f" reg{cfg['maxnreg']}" if cfg.get("maxnreg") else "")
             if cfg["path"] == "gemv" else
             f" {kernel} {cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} "
             f"w{cfg['num_warps']} st{cfg['num_stages']}{' swap' if cfg.get('swap') else ''} cb{cfg['codebook']}")
    g = r.get("graph_us")
    return (f"{r['N']}x{r['K']} M={r['M']:<5} {r['dtype']:<8} {r['provider']:<34}{c:<28} "
            f"{'' if g is None else f'{g:9.2f} us'} op_mis={r.get('operand_mismatches')} "
            f"sum={r.get('sum_ratio', float('nan')):.3g} host={r.get('host_us', '')} {r.get('error', '')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments bench-linear", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="N x K (out_features x in_features)")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--sweep", action="store_true", help="also time every config of the tuning grid")
    ap.add_argument("--backward", action="store_true", help="also time dY @ W (the table's choice)")
    ap.add_argument("--sweep-shapes", nargs="+", default=None, help="restrict --sweep/--backward to these shapes")
    ap.add_argument("--sweep-dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--no-peers", action="store_true", help="only nf4's sweep rows (tuning runs)")
    ap.add_argument("--sweep-paths", nargs="+", default=["gemv", "mma"],
                    help="config families to sweep (gemv, mma: the tensor-core GEMV, mma-wk: its warps splitting K, "
                         "mma-wk-reg: the same with 64 registers per thread, wgemm: the word tl.dot kernel, "
                         "dequant: nf4.dequantize + cuBLAS)")
    ap.add_argument("--out", default=os.path.join("build", "linear", "bench.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-linear needs a CUDA GPU", file=sys.stderr)
        return 2
    from verify import peers

    unsloth = None if peers.release_missing() else peers.unsloth_release()
    copy_gbs = timing.copy_bandwidth_gbs()["gbs"]
    env = timing.environment()
    env["unsloth"] = unsloth.provenance() if unsloth is not None else peers.release_missing()
    payload = {"env": env, "copy_gbs": copy_gbs, "nominal_tflops": NOMINAL_TFLOPS, "rows": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.time()
    for shape in args.shapes:
        n, k = parse_shape(shape)
        for dt in args.dtypes:
            tune = (args.sweep_shapes is None or shape in args.sweep_shapes) and dt in args.sweep_dtypes
            done = list(payload["rows"])

            def save(rows, done=done):
                payload["rows"] = done + rows
                payload["elapsed_s"] = time.time() - t0
                with open(args.out, "w") as f:
                    json.dump(payload, f, indent=1, sort_keys=True, default=str)

            bench_weight(n, k, DTYPES[dt], args.ms, copy_gbs, unsloth, sweep=args.sweep and tune,
                         backward=args.backward and tune, save=save, with_peers=not args.no_peers,
                         sweep_paths=args.sweep_paths)
    print(f"wrote {args.out} ({len(payload['rows'])} rows, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
