"""The GEMM lab (issue 34, item 2): the structure of inductor's fastest dense Triton GEMM on Hopper, with the NF4
weight decoded in the K loop.

Why: `experiments gemm-limit` cut the word GEMM (nf4/linear/gemm_word.py) into parts, and its dense-operand probe
(the same loop fed a bf16 weight, nothing decoded) already took 1.6x cuBLAS at M = 512-1024 on the H200. inductor's
max-autotune on the same shapes picks `triton_mm_persistent_tma` (BLOCK 128 x 256 x 64, 8 warps, 3 stages) and
meets the bars (results/linear/bounds/). So the skeleton comes first: x and the packed words arrive by TMA tensor
descriptors, pipelined by Triton (`num_stages`), programs are persistent over output tiles (GROUP_M tiles along M
share a weight tile), and each 64-weight step of a row is one absmax block. MODE:
- 0 `decode`: the packed words of a [BN, 8]-word step (32 bytes a row) are looked up in each row's 16-entry
  product table (`nf4.device.product_table` + `table_pairs`, the word GEMV's exact prmt decode), laid out as the
  [BN, 64] tile of 16-bit weights and multiplied by `tl.dot` (wgmma): out = x @ W^T (or, SWAP, out^T = W @ x^T,
  the decoded tile as the first operand, which wgmma can take from registers).
- 1 `dense`: the control. The same loop reads the dequantized bf16 weight [BN, 64] by TMA: what the skeleton
  costs with nothing to decode.
- 2 `nolookup`: a control. The words stand in for the pairs (no table, no prmt tree; not exact).
The absmax chain (byte, code2[byte] * absmax2 + offset) of step s + 1 is loaded during step s.
Exactness: every operand is round_{x dtype}(mul.rn.ftz.f32(NF4[nibble], absmax)), the dequantized weight; the check
is `gemv_lut`'s (signed, power-of-two scaled identity rows, int16 views). GPU only (inline PTX, TMA).

    python -m experiments.labs.gemm_tma --shapes 4096x4096 14336x4096 4096x14336 --ms 128 256 512 1024 \\
        --out build/labs/gemm_tma_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from nf4.device import absmax_of_block, product_table, table_pairs

# name -> (MODE, BM (rows of x per tile), BN (rows of W), num_warps, num_stages, SWAP, persistent, split-K)
# (split-K 0: as many splits as bring the jobs nearest 2 per multiprocessor, at least 8 steps each)
CANDIDATES = {
    "dense_m128_n256": (1, 128, 256, 8, 3, False, True, 1),  # inductor's pick on the bounds' shapes
    "dense_m128_n128": (1, 128, 128, 8, 4, False, True, 1),
    "dense_swap_n128_m128": (1, 128, 128, 8, 4, True, True, 1),
    "tma_m128_n128": (0, 128, 128, 8, 4, False, True, 1),
    "swap_n128_m32": (0, 32, 128, 4, 4, True, True, 0),
    "swap_n128_m64": (0, 64, 128, 4, 4, True, True, 0),
    "swap_n128_m128": (0, 128, 128, 8, 4, True, True, 1),
    "swap_n128_m256": (0, 256, 128, 8, 3, True, True, 1),
    "swap_n256_m128": (0, 128, 256, 8, 3, True, True, 1),
    "swap_n64_m256": (0, 256, 64, 4, 3, True, True, 1),
    "swap_n128_m128_np": (0, 128, 128, 8, 4, True, False, 1),
    "nolookup_swap_n128_m128": (2, 128, 128, 8, 4, True, True, 1),
    "gemv_n128_m16": (0, 16, 128, 4, 6, True, True, 0),  # M <= 16: swap-AB wgmma, TMA stages, split-K
    "gemv_n64_m16": (0, 16, 64, 4, 8, True, True, 0),
    "gemv_n128_m16_w8": (0, 16, 128, 8, 6, True, True, 0),
    "nolookup_gemv_n128_m16": (2, 16, 128, 4, 6, True, True, 0),
}


@triton.jit
def _halves(q):
    """uint32 pairs -> (low, high) 16-bit halves as bfloat16 bits, no instructions (register aliasing)."""
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [q], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=1)


@triton.jit
def _tile(p0, p1, p2, p3, BN: tl.constexpr):
    """4 [BN, 8] uint32 pairs (pair j of word w: elements 8w + 2j low, 8w + 2j + 1 high) -> [BN, 64] bfloat16."""
    q = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BN, 32))
    lo, hi = _halves(q)
    return tl.reshape(tl.join(lo, hi), (BN, 64))


@triton.jit
def _amax(blk, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr):
    always = blk >= 0
    return absmax_of_block(blk, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, True, True, True)


@triton.jit
def lab_gemm_tma_kernel(x_desc, w_desc, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, part_ptr, M, N, K,
                        MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                        PROGS: tl.constexpr, STAGES: tl.constexpr, SWAP: tl.constexpr, SPLIT: tl.constexpr):
    KB = K // 64  # steps per row = absmax blocks per row
    SEG = tl.cdiv(KB, SPLIT)  # steps per split
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tiles = num_m * num_n
    per_group = GROUP_M * num_n
    for job in range(tl.program_id(0), tiles * SPLIT, PROGS):
        tile = job // SPLIT
        k0 = (job % SPLIT) * SEG
        k1 = tl.minimum(k0 + SEG, KB)
        first_m = (tile // per_group) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size
        pid_n = (tile % per_group) // size
        off_m = pid_m * BM
        off_n = pid_n * BN
        rows = off_n + tl.arange(0, BN)
        blk = tl.minimum(rows, N - 1) * KB  # each row's first absmax block (rows past W: its last row's)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        amax = _amax(blk + k0, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr)
        for s in tl.range(k0, k1, num_stages=STAGES):
            amax_next = _amax(blk + tl.minimum(s + 1, KB - 1), absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr)
            xk = x_desc.load([off_m, s * 64])
            if MODE == 1:
                wk = w_desc.load([off_n, s * 64])
            else:
                words = w_desc.load([off_n, s * 8]).to(tl.uint32, bitcast=True)
                if MODE == 0:
                    t0, t1, t2, t3, t4, t5, t6, t7 = product_table(amax[:, None], True, 2)
                    p0, p1, p2, p3 = table_pairs(words, t0, t1, t2, t3, t4, t5, t6, t7)
                else:
                    a = amax[:, None].to(tl.uint32, bitcast=True)
                    p0, p1, p2, p3 = words ^ a, words + a, words | a, words - a
                wk = _tile(p0, p1, p2, p3, BN)
            if SWAP:
                acc = tl.dot(wk, tl.trans(xk), acc)
            else:
                acc = tl.dot(xk, tl.trans(wk), acc)
            amax = amax_next
        if SWAP:
            acc = tl.trans(acc)
        m = off_m + tl.arange(0, BM)
        ok = (m < M)[:, None] & (rows < N)[None, :]
        if SPLIT > 1:
            tl.store(part_ptr + ((job % SPLIT) * M + m[:, None]) * N + rows[None, :], acc, mask=ok)
        else:
            tl.store(out_ptr + m[:, None] * N + rows[None, :], acc.to(tl.bfloat16), mask=ok)


_DESC = {}
_PARTS = {}


def _descs(x, words, wd, cand):
    """Host tensor descriptors, cached by the tensors' addresses and shapes (the lab's tensors are contiguous)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    mode, bm, bn = CANDIDATES[cand][:3]
    key = (cand, x.data_ptr(), x.shape, words.data_ptr(), words.shape, wd.data_ptr() if wd is not None else 0)
    d = _DESC.get(key)
    if d is None:
        xd = TensorDescriptor.from_tensor(x, [bm, 64])
        wdesc = TensorDescriptor.from_tensor(wd, [bn, 64]) if mode == 1 else TensorDescriptor.from_tensor(words,
                                                                                                          [bn, 8])
        d = _DESC[key] = (xd, wdesc)
    return d


def lab_gemm(x: torch.Tensor, packed: torch.Tensor, qs, cand: str, out: torch.Tensor, wd=None) -> torch.Tensor:
    """out = x @ W^T (bf16, M x N) by candidate `cand`; W = (packed, qs): blocksize 64, nested, bf16; wd: the
    dequantized weight (MODE 1 only)."""
    from nf4.linear.common import nf4_split_sum_kernel

    mode, bm, bn, warps, stages, swap, persistent, split = CANDIDATES[cand]
    m, k = x.shape
    n = qs.shape[0]
    assert qs.blocksize == 64 and qs.nested and k % 64 == 0 and x.dtype == torch.bfloat16
    words = packed.view(torch.uint8).view(n, k // 2).view(torch.int32)
    xd, wdesc = _descs(x, words, wd, cand)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if split == 0:
        split = max(1, min(round(2 * sms / tiles), k // 64 // 8))
        split = triton.cdiv(k // 64, triton.cdiv(k // 64, split))  # no empty split
    jobs = tiles * split
    progs = min(jobs, 2 * sms if split > 1 else sms) if persistent else jobs
    part = _PARTS.get((m, n, split))
    if split > 1 and part is None:
        part = _PARTS[(m, n, split)] = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    st = qs.state2
    lab_gemm_tma_kernel[(progs,)](xd, wdesc, qs.absmax, st.absmax, st.code, qs.offset, out, part if split > 1 else out,
                                  m, n, k, MODE=mode, BM=bm, BN=bn, GROUP_M=8, PROGS=progs, STAGES=stages, SWAP=swap,
                                  SPLIT=split, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if split > 1:
        mn = m * n
        nf4_split_sum_kernel[(triton.cdiv(mn, 1024),)](part, out, out, mn, n, SPLIT=split, HAS_BIAS=False, X_DT=2,
                                                       BF16_BITS=False, BLOCK=1024)
    return out


def build_facts(cand: str, arch: int = 90) -> dict:
    """An offline build of candidate `cand` for sm_<arch> (no GPU; TRITON_INTERPRET must be off): registers, local
    memory, whether a wgmma takes its A operand from registers, the most wgmma groups a wait leaves in flight, and
    the block-wide barriers in the kernel."""
    import re

    import triton.compiler
    from triton.backends.compiler import GPUTarget

    from . import sass_count as sc

    mode, bm, bn, warps, stages, swap, _, split = CANDIDATES[cand]
    w = f"tensordesc<bf16[{bn}, 64]>" if mode == 1 else f"tensordesc<i32[{bn}, 8]>"
    sig = {"x_desc": f"tensordesc<bf16[{bm}, 64]>", "w_desc": w, "absmax_ptr": "*u8", "absmax2_ptr": "*fp32",
           "code2_ptr": "*fp32", "offset_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32",
           "N": "i32", "K": "i32"}
    const = {"MODE": mode, "BM": bm, "BN": bn, "GROUP_M": 8, "PROGS": 132, "STAGES": stages, "SWAP": swap,
             "SPLIT": split or 4}
    fn = lab_gemm_tma_kernel
    sig.update({name: "constexpr" for name in const})
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    sass = sc.disassemble(compiled.asm["cubin"])
    waits = [int(v, 16) for v in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", sass)]
    return {**sc.registers(compiled.asm["cubin"]), "candidate": cand, "arch": f"sm_{arch}",
            "wgmma_register_a": bool(re.search(r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)),
            "wgmma_in_flight": max(waits) if waits else None,
            "bar_sync": len(re.findall(r"BAR\.SYNC", sass)), "triton": triton.__version__}


def _set_allocator():
    """Triton asks for a global scratch allocator when a kernel makes device-side descriptors; harmless here."""
    try:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    except Exception:
        pass


def fits(cand: str, m: int) -> bool:
    """The candidates worth timing at M: tiles of 16 rows of x up to M = 16, 32-64 up to 64, 128 or more above."""
    bm = CANDIDATES[cand][1]
    return bm == 16 if m <= 16 else (bm in (32, 64) if m <= 64 else bm >= 128)


def run_weight(n: int, k: int, ms, candidates, log=print) -> list[dict]:
    import bitsandbytes.functional as F

    import nf4
    from verify import timing

    from .gemv_lut import bound_check, lab_inputs, make_weights, operand_mismatches

    dtype = torch.bfloat16
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    wds = [F.dequantize_4bit(p, q).to(dtype) for p, q in sets]
    rows = []
    for m in ms:
        x, cols, scales, mi, xr = lab_inputs(m, k, dtype)
        base = {"N": n, "K": k, "M": m, "dtype": "bfloat16", "copies": len(sets),
                "flops_tflops_at_1us": 2 * m * n * k / 1e6}

        def timed(fn):
            g = timing.graph_time_us(fn, list(range(len(sets))))
            return g and g.get("median_us")

        rows.append({**base, "provider": "cublas_dense",
                     "graph_us": timed(lambda i, xr=xr: torch.nn.functional.linear(xr, wds[i % len(wds)]))})
        y = nf4.linear(x, *sets[0])
        rows.append({**base, "provider": "nf4.linear",
                     "operand_mismatches": operand_mismatches(y[:mi], wds[0], cols, scales),
                     "graph_us": timed(lambda i, xr=xr: nf4.linear(xr, *sets[i % len(sets)]))})
        rows.append({**base, "provider": "nf4.dequantize+cublas",
                     "graph_us": timed(lambda i, xr=xr: torch.nn.functional.linear(
                         xr, nf4.dequantize(*sets[i % len(sets)])))})
        ref = torch.nn.functional.linear(xr.float(), wds[0].float())
        for cand in [c for c in candidates if fits(c, m)]:
            row = {**base, "provider": cand, "config": CANDIDATES[cand]}
            try:
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                y = lab_gemm(x, sets[0][0], sets[0][1], cand, out, wds[0])
                torch.cuda.synchronize()
                row["operand_mismatches"] = operand_mismatches(y[:mi], wds[0], cols, scales)
                y = lab_gemm(xr, sets[0][0], sets[0][1], cand, out, wds[0])
                row.update(bound_check(y, xr, wds[0], ref))
                row["graph_us"] = timed(lambda i, c=cand, o=out, xr=xr: lab_gemm(xr, sets[i % len(sets)][0],
                                                                           sets[i % len(sets)][1], c, o,
                                                                           wds[i % len(wds)]))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:600]
            rows.append(row)
        ran = 3 + len([c for c in candidates if fits(c, m)])
        dense = rows[-ran].get("graph_us")
        for r in rows[-ran:]:
            us = r.get("graph_us")
            ratio = us / dense if us and dense else float("nan")
            log(f"  {n}x{k} M={m:<5} {r['provider']:<24} {us if us else float('nan'):9.2f} us  {ratio:5.2f}x dense"
                f"  mismatches {r.get('operand_mismatches')}  bound {r.get('random_within_bound')}"
                + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
    sets.clear()
    wds.clear()
    _DESC.clear()
    _PARTS.clear()
    torch.cuda.empty_cache()
    return rows


def report(paths) -> str:
    """Per weight and M: time over cuBLAS's dense GEMM of nf4.linear, the best exact lab candidate, the best dense
    control (the skeleton with nothing to decode) and the no-lookup control."""
    out = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        out += [f"{d['device']} ({d['environment'].get('commit', '?')}): time / cuBLAS dense", "",
                "| N x K | M | cuBLAS us | nf4.linear | best exact lab (name) | best dense control | no lookup |",
                "|---|---|---|---|---|---|---|"]
        groups: dict = {}
        for r in d["rows"]:
            groups.setdefault((r["N"], r["K"], r["M"]), []).append(r)
        for (n, k, m), rows in groups.items():
            us = {r["provider"]: r.get("graph_us") for r in rows if r.get("graph_us")}
            dense = us.get("cublas_dense")
            if not dense:
                continue

            def best(pred, rows=rows, us=us):
                c = [(us[r["provider"]], r["provider"]) for r in rows if r["provider"] in us and pred(r)]
                return min(c) if c else (float("nan"), "-")

            exact = best(lambda r: r["provider"] in CANDIDATES and CANDIDATES[r["provider"]][0] == 0
                         and r.get("operand_mismatches") == 0 and r.get("random_within_bound"))
            control = best(lambda r: r["provider"] in CANDIDATES and CANDIDATES[r["provider"]][0] == 1)
            nolookup = best(lambda r: r["provider"] in CANDIDATES and CANDIDATES[r["provider"]][0] == 2)
            out.append(f"| {n} x {k} | {m} | {dense:.1f} | {us.get('nf4.linear', float('nan')) / dense:.2f} | "
                       f"{exact[0] / dense:.2f} ({exact[1]}) | {control[0] / dense:.2f} | {nolookup[0] / dense:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.gemm_tma", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096", "4096x14336"])
    ap.add_argument("--ms", nargs="+", type=int, default=[128, 256, 512, 1024])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--out", default="build/labs/gemm_tma.json")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON", help="print a markdown table and exit")
    ap.add_argument("--build", nargs="+", default=None, metavar="CANDIDATE",
                    help="offline sm_90 builds of these candidates: print their facts as JSON and exit (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.build:
        print(json.dumps([build_facts(c) for c in args.build]))
        return 0
    if not torch.cuda.is_available():
        print("gemm_tma needs a CUDA GPU (sm_90)")
        return 2
    from verify import timing

    _set_allocator()
    print(f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        rows += run_weight(n, k, args.ms, args.candidates)
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "environment": timing.environment(), "candidates": CANDIDATES, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
