"""GPU entry point of the lab GEMV candidates: operand check, then CUDA-graph timing beside nf4.linear and cuBLAS.

    python -m experiments.labs.gemv_lut --out results/labs/gemv_lut_h100.json [--shapes 14336x4096 ...]
        [--ms 1 4 16] [--candidates pair16 pair8 pair16_p2 level_prmt ...] [--dtype bf16]

For each weight N x K (default 14336x4096, 4096x14336, 4096x4096) and M (default 1, 4, 16): a random bf16 weight
quantized by bitsandbytes (`quantize_4bit`, blocksize 64, compress_statistics=True, nf4), as many copies as
rotate more than 256 MiB through L2 (verify.timing.rotation_count). Per candidate (`CANDIDATES`, kernels of
experiments.labs.kernels through `lab_linear` below):
- operand check: x = M rows of the identity at random columns, each negated or not and scaled by a power of
  two; then x @ W^T must equal scale * W[:, col] (+ 0.0) with W = bitsandbytes' `dequantize_4bit(...).to(x's
  dtype)`, compared as int16 views (`operand_mismatches`, 0 = exact);
- CUDA-graph device time over rotating weights (verify.timing.graph_time_us), beside `nf4.linear(x, packed,
  quant_state)` (the product, whatever config its table picks) and torch's F.linear on a bf16 [N, K / 4]
  matrix (the same bytes as the packed weight: the honest dense control), and the byte floor at the copy
  bandwidth measured in the same run.
Prints a table and writes JSON (with the offline SASS counts of experiments.labs.sass_count when it can build
them on this machine's Triton) to --out. Only `nf4.linear(x, packed, quant_state)` is used from the product.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

from . import bulk, deep, scaled, staged, stream
from . import kernels as K

# name -> (mode, copies, prmt_words, num_warps, programs per SM)
CANDIDATES = {
    "pair16": ("pair", 16, 0, 4, 6),
    "pair16_w8": ("pair", 16, 0, 8, 3),
    "pair8": ("pair", 8, 0, 4, 8),
    "pair16_p2": ("pair", 16, 2, 4, 6),
    "pair16_p4": ("pair", 16, 4, 4, 6),
    "level_prmt": ("level_prmt", 1, 0, 4, 8),
    "level_imad": ("level_imad", 1, 0, 4, 8),
    "prmt": ("prmt", 1, 0, 4, 8),
    "none": ("none", 1, 0, 4, 8),  # control: the skeleton without a decode (not exact)
    "none_fs": ("none", 1, 0, 4, 8),  # _fs: whole-sector loads (kernels._fetch FULLSEC)
    "pair16_fs": ("pair", 16, 0, 4, 6),
    "pair16_fs5": ("pair", 16, 0, 4, 5),
    "none_fs_xp": ("none", 1, 0, 4, 8),  # _xp: x's loads only in lanes whose x row exists (kernels.mma_pairs_x)
    "prmt_fs_xp": ("prmt", 1, 0, 4, 8),
    "pair16_fs_xp": ("pair", 16, 0, 4, 6),
    # (d) the split: the first n of a lane's 8 words a row and step by the prmt tree (ALU pipe), the rest by the pair
    # table (shared memory), so that neither pipe carries every lookup
    "pair16_p1": ("pair", 16, 1, 4, 6),
    "pair16_p3": ("pair", 16, 3, 4, 6),
    "pair16_fs_xp_p1": ("pair", 16, 1, 4, 6),
    "pair16_fs_xp_p2": ("pair", 16, 2, 4, 6),
    "pair16_fs_xp_p3": ("pair", 16, 3, 4, 6),
    "pair16_fs_xp_p4": ("pair", 16, 4, 4, 6),
}
DEFAULT_CANDIDATES = ("pair16", "pair16_w8", "pair8", "pair16_p2", "pair16_p4", "level_prmt", "prmt")
_code = K.levels  # (the name this module's callers used)


def plan(n: int, k: int, m: int, candidate: str, sms: int) -> dict:
    """Grid and split-K of a launch: persistent programs (sms * programs per SM), the K range cut so that there are
    at least as many tiles (64-row blocks x K segments) as programs."""
    mode, copies, prmt_words, num_warps, per_sm = CANDIDATES[candidate]
    kb = k // 2
    steps = kb // K.STEP_BYTES
    row_blocks = triton.cdiv(n, 16 * num_warps)
    programs = sms * per_sm
    split = max(1, min(steps, triton.cdiv(programs, row_blocks)))
    seg = triton.cdiv(steps, split) * K.STEP_BYTES
    split = triton.cdiv(kb, seg)
    tiles = row_blocks * split
    return {"mode": K.MODES[mode], "copies": copies, "prmt_words": prmt_words, "num_warps": num_warps,
            "split": split, "seg": seg, "tiles": tiles, "grid": min(tiles, programs), "ntile": 1 if m <= 8 else 2}


def lab_linear(x: torch.Tensor, packed: torch.Tensor, qs, candidate: str, out: torch.Tensor | None = None,
               part: torch.Tensor | None = None, p: dict | None = None) -> torch.Tensor:
    """x @ W^T by a lab candidate: x [M <= 16, K] bf16/fp16 contiguous, W bitsandbytes NF4 (blocksize 64, nested
    absmax, quant dtype = x's dtype), K % 256 == 0. Returns [M, N] in x's dtype."""
    m, k = x.shape
    n = qs.shape[0]
    if m > 16 or k % 256 or qs.blocksize != 64 or not qs.nested or qs.shape[1] != k:
        raise ValueError("lab kernels: M <= 16, K % 256 == 0, blocksize 64, nested absmax")
    if x.data_ptr() % 16 or packed.data_ptr() % 16 or not x.is_contiguous():
        raise ValueError("lab kernels: x and the packed bytes contiguous and 16-byte aligned")
    p = p or plan(n, k, m, candidate, torch.cuda.get_device_properties(x.device).multi_processor_count)
    x_dt = 2 if x.dtype == torch.bfloat16 else 1
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = p["split"] > 1
    if partial and part is None:
        part = torch.empty((p["split"], m, n), dtype=torch.float32, device=x.device)
    K.lab_gemv_kernel[(p["grid"],)](
        x, packed, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, _code(x.device), part if partial else out,
        m, n, k // 2, p["split"], p["seg"], p["tiles"], 1,
        MODE=p["mode"], PRMT_WORDS=p["prmt_words"], COPIES=p["copies"], SHIFT=K.pair_shift(p["copies"]),
        X_DT=x_dt, NTILE=p["ntile"], THREADS=32 * p["num_warps"], PARTIAL=partial, FTZ=True,
        FULLSEC=int("_fs" in candidate), XPRED=int("_xp" in candidate),
        num_warps=p["num_warps"])
    if partial:
        block = 256
        K.split_sum_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT=p["split"], X_DT=x_dt, BLOCK=block)
    return out


def identity_rows(m: int, k: int, dtype, seed: int):
    """x = signed power-of-two-scaled identity rows at random columns: (x on the GPU, columns, scales)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.randperm(k, generator=g)[:m]
    scales = torch.exp2(torch.randint(-2, 3, (m,), generator=g).double())
    scales = scales * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.zeros((m, k), dtype=torch.float64)
    x[torch.arange(m), cols] = scales
    return x.to(dtype).cuda(), cols.cuda(), scales.cuda()


def lab_inputs(m: int, k: int, dtype):
    """The GEMM labs' inputs at M: identity rows (`identity_rows`, zero rows past K when M > K), their columns and
    scales, how many are identity rows, and seeded random x."""
    mi = min(m, k)
    x, cols, scales = identity_rows(mi, k, dtype, seed=m)
    if mi < m:
        x = torch.cat([x, torch.zeros((m - mi, k), dtype=dtype, device=x.device)])
    xr = torch.randn((m, k), device=x.device, generator=torch.Generator(device=x.device).manual_seed(m)).to(dtype)
    return x, cols, scales, mi, xr


def bound_check(y: torch.Tensor, xr: torch.Tensor, wd: torch.Tensor, ref: torch.Tensor) -> dict:
    """y = xr W^T against `ref` (xr @ W^T in float32): whether every error is within K 2^-24 |xr| |W|^T + 2^-8 |ref|
    (float32 accumulation, then one bf16 rounding), and the largest error over that bound."""
    err = (y.float() - ref).abs()
    bound = (xr.float().abs() @ wd.float().abs().t()) * (xr.shape[1] * 2.0**-24) + ref.abs() * 2.0**-8
    return {"random_within_bound": bool((err <= bound).all()),
            "random_max_err_over_bound": float((err / bound.clamp_min(1e-30)).max())}


def operand_mismatches(y: torch.Tensor, wd: torch.Tensor, cols, scales) -> int:
    """Outputs that differ (int16 views) from scale * W[:, col] + 0.0, W the dequantized weight in y's dtype."""
    want = (wd.double()[:, cols].t() * scales[:, None] + 0.0).to(y.dtype)
    return int((y.view(torch.int16) != want.view(torch.int16)).sum())


def make_weights(n: int, k: int, dtype, copies: int, seed: int = 0) -> list:
    import bitsandbytes.functional as F

    sets = []
    for c in range(copies):
        gen = torch.Generator(device="cuda").manual_seed(seed + c)
        w = (torch.randn((n, k), dtype=torch.float32, device="cuda", generator=gen) * 0.02).to(dtype)
        sets.append(F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4"))
        del w
    return sets


def floor_us(n: int, k: int, m: int, elt: int, copy_gbs: float) -> float:
    blocks = n * k // 64
    nbytes = n * k // 2 + blocks + math.ceil(blocks / 256) * 4 + 256 * 4 + 4 + m * k * elt + m * n * elt
    return nbytes / (copy_gbs * 1e9) * 1e6


def run_weight(n: int, k: int, ms, candidates, dtype, copy_gbs: float, log=print) -> list[dict]:
    import bitsandbytes.functional as F

    import nf4
    from verify import timing

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    dense = [torch.randn((n, k // 4), device="cuda").to(dtype) for _ in range(len(sets))]
    wd = F.dequantize_4bit(sets[0][0], sets[0][1]).to(dtype)
    rows = []
    for m in ms:
        x, cols, scales = identity_rows(m, k, dtype, seed=m)
        xd = torch.randn((m, k // 4), device="cuda").to(dtype)
        elt = torch.empty((), dtype=dtype).element_size()
        base = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."),
                "byte_floor_us": floor_us(n, k, m, elt, copy_gbs), "copies": len(sets)}

        def timed(fn):
            g = timing.graph_time_us(fn, list(range(len(sets))))
            return g and g.get("median_us")

        y = nf4.linear(x, sets[0][0], sets[0][1])
        rows.append({**base, "provider": "nf4.linear", "operand_mismatches": operand_mismatches(y, wd, cols, scales),
                     "graph_us": timed(lambda i, x=x: nf4.linear(x, *sets[i % len(sets)]))})
        rows.append({**base, "provider": "dense F.linear [N, K/4]", "operand_mismatches": None,
                     "graph_us": timed(lambda i, xd=xd: torch.nn.functional.linear(xd, dense[i % len(dense)]))})
        for cand in candidates:
            lab = next((mod for mod in (stream, staged, deep, bulk, scaled) if cand in mod.CANDIDATES), None)
            if lab is not None:
                row = {**base, "provider": cand}
                try:
                    for packed, qs in sets if hasattr(lab, "prepare") else ():
                        lab.prepare(packed, qs)  # host-side set-up a CUDA graph cannot capture
                    y = lab.linear(x, sets[0][0], sets[0][1], cand)
                    torch.cuda.synchronize()
                    row["plan"] = lab.plan_of(cand, x, sets[0][1])
                    if hasattr(lab, "check"):  # another numerical contract: its model and bound, on random x
                        xr = torch.randn((m, k), generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
                        row["contract"] = lab.check(lab.linear(xr, sets[0][0], sets[0][1], cand), xr,
                                                    sets[0][0], sets[0][1])
                        row["operand_mismatches"] = None
                    else:
                        row["operand_mismatches"] = operand_mismatches(y, wd, cols, scales)
                    row["graph_us"] = timed(lambda i, c=cand, x=x, lab=lab: lab.linear(
                        x, sets[i % len(sets)][0], sets[i % len(sets)][1], c))
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                rows.append(row)
                continue
            p = plan(n, k, m, cand, sms)
            row = {**base, "provider": cand, "plan": p}
            try:
                out = torch.empty((m, n), dtype=dtype, device="cuda")
                part = torch.empty((p["split"], m, n), dtype=torch.float32, device="cuda")
                y = lab_linear(x, sets[0][0], sets[0][1], cand, out, part, p)
                torch.cuda.synchronize()
                row["operand_mismatches"] = operand_mismatches(y, wd, cols, scales)
                row["graph_us"] = timed(lambda i, c=cand, o=out, q=part, p=p, x=x: lab_linear(
                    x, sets[i % len(sets)][0], sets[i % len(sets)][1], c, o, q, p))
            except Exception as exc:  # a candidate that fails to build or run is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
        for r in rows[-(2 + len(candidates)):]:
            us = r.get("graph_us")
            log(f"  {n}x{k} M={m:<2} {r['provider']:<24} {us if us else float('nan'):8.2f} us "
                f"({(us / r['byte_floor_us']) if us else float('nan'):5.2f}x floor {r['byte_floor_us']:.2f})"
                f"  operand mismatches {r.get('operand_mismatches')}"
                + (f"  contract {r['contract']}" if "contract" in r else "")
                + (f"  ERROR {r['error']}" if "error" in r else ""),
                flush=True)
    sets.clear()
    dense.clear()
    torch.cuda.empty_cache()
    return rows


def report(paths) -> str:
    """Markdown: per file (GPU), shape and M, each provider's graph time over the same-bytes cuBLAS GEMV's."""
    lines = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        rows = d["rows"]
        provs = list(dict.fromkeys(r["provider"] for r in rows if r["provider"] != "dense F.linear [N, K/4]"))
        lines += [f"{d['device']} ({d['environment'].get('commit', '?')}): time / same-bytes cuBLAS", "",
                  "| N x K | M | same-bytes us | " + " | ".join(provs) + " |",
                  "|---|---|---|" + "---|" * len(provs)]
        keys = list(dict.fromkeys((r["N"], r["K"], r["M"]) for r in rows))
        for n, k, m in keys:
            here = {r["provider"]: r for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m)}
            base = here["dense F.linear [N, K/4]"]["graph_us"]
            cells = []
            for p in provs:
                us = here.get(p, {}).get("graph_us")
                bad = here.get(p, {}).get("operand_mismatches")
                mark = "" if bad in (0, None) or p.startswith(("none", "s_none", "c_none", "d_none")) else " (inexact)"
                ref = here.get(p, {}).get("same_bytes_us") or base  # a merged file: the row's own run's cuBLAS
                cells.append(f"{us / ref:.2f}{mark}" if us else "-")
            lines.append(f"| {n} x {k} | {m} | {base:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.gemv_lut", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "4096x4096"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES),
                    choices=sorted(CANDIDATES) + sorted(stream.CANDIDATES) + sorted(staged.CANDIDATES)
                    + sorted(deep.CANDIDATES) + sorted(bulk.CANDIDATES) + sorted(scaled.CANDIDATES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", default="build/labs/gemv_lut.json")
    ap.add_argument("--no-sass", action="store_true", help="skip the offline SASS counts")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print a markdown table of result files (time over cuBLAS on as many bf16 bytes) and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if not torch.cuda.is_available():
        print("gemv_lut needs a CUDA GPU (the SASS counts alone: python -m experiments.labs.sass_count)")
        return 2
    from verify import timing

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    copy_gbs = float(timing.copy_bandwidth_gbs()["gbs"])
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        rows += run_weight(n, k, args.ms, args.candidates, dtype, copy_gbs)
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "copy_gbs": copy_gbs, "environment": timing.environment(), "rows": rows}
    if not args.no_sass:
        try:
            from . import sass_count

            cap = torch.cuda.get_device_capability()
            result["sass"] = sass_count.count_builds(arch=cap[0] * 10 + cap[1])
            print(sass_count.table(result["sass"]))
        except Exception as exc:
            result["sass_error"] = f"{type(exc).__name__}: {exc}"[:500]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
