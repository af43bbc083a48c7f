"""Issue 14's bars as times, next to what released kernels that decode nothing reach on the same GPU in the same run.

    python -m experiments linear-bounds --out results/linear/bounds_h100.json

GPU only. For each weight (default: the bars' 14336x4096, 4096x14336 and 4096x4096) and each M (default 1, 128,
256, 512, 1024, 4096), bf16, rotating weights, CUDA-graph device time:
- `nf4.linear` as a user calls it (the tuned table), checked on its operand first (x signed power-of-two identity
  rows at random columns: the output is those columns of nf4.dequantize(W), scaled, bit for bit);
- `bnb.matmul_4bit` (bitsandbytes' released 4-bit linear) and `nf4.dequantize + cuBLAS`: the peers bar (c) names;
- `cuBLAS`: F.linear on the dequantized bfloat16 weight [N, K], the reference of bars (b) and (d);
- at M = 1, `cuBLAS GEMV, the packed bytes' count`: F.linear of one row on a bfloat16 weight [N, K / 4], which holds
  as many bytes as the packed NF4 weight: how long cuBLAS's own GEMV takes to read that many bytes (and nothing
  to decode), against the byte floor of bar (a);
- at M <= INT4_MAX_M, `torch int4 GEMM (tinygemm)`: torch's own released 4-bit linear (`aten._weight_int4pack_mm`,
  the tinygemm kernel) on a random weight of N x K with a bfloat16 scale and zero per 64 weights (0.5625 bytes a
  weight against NF4's 0.516): a 4-bit kernel whose decode is linear (no codebook), beside nf4's. It is checked to
  compute x times one fixed weight first: its output on identity rows is that weight, and its output on random x
  stays within the float32 accumulation bound of the product with it;
- at M >= TRITON_MIN_M, `Triton dense GEMM (inductor max-autotune)`: torch.compile of F.linear on the dequantized
  weight with inductor's GEMM autotuning restricted to its Triton templates (INDUCTOR_OPTIONS: no cuBLAS choice,
  the persistent TMA template allowed where this torch has it): the fastest dense Triton GEMM that torch's released
  autotuner finds for the shape, reading a weight it need not decode. Its result is checked against a float64
  product (the float32 accumulation bound of bench-linear's `sum_ratio`) so that a wrong kernel is not timed.

`bars(rows)` turns the rows into one line per bar, weight and M: the bar's target time, nf4.linear's time and, where
one applies, the decode-free control and whether it reaches the target:
- (a) M = 1: target the lesser of 1.5x the byte floor (bench-linear's: packed weight, absmax, x and output at the
  copy bandwidth measured in the same run) and half bitsandbytes' time (the bar asks for half the best peer's, so
  this target is at most as strict as the bar); control: cuBLAS's GEMV reading the packed bytes' count;
- (b) M <= 128: target cuBLAS's time; no control bounds it (nf4 reads a quarter of cuBLAS's bytes), the Triton dense
  GEMM is reported beside it;
- (c) 256 <= M <= 512: target the faster of nf4.dequantize + cuBLAS and bnb.matmul_4bit, divided by 1.5; control:
  the Triton dense GEMM;
- (d) M >= 1024: target 1.10x cuBLAS's time; control: the Triton dense GEMM.
A control that misses a target says that a Triton kernel which also had to decode would miss it too, where the time
is set by the tensor cores (the flop floor above nf4's byte floor: M >= 512 on these weights) or by the bytes read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from verify import timing

from .bench_linear import (
    NOMINAL_TFLOPS,
    floors,
    identity_rows,
    make_weights,
    mismatches,
    operand_expected,
    parse_shape,
    sum_ratio,
)

DEFAULT_SHAPES = ("14336x4096", "4096x14336", "4096x4096")
DEFAULT_MS = (1, 128, 256, 512, 1024, 4096)
INT4_MAX_M = 512  # torch's int4 GEMM is timed up to this many rows of x (tinygemm is built for few rows)
INT4_GROUP, INT4_INNER_K_TILES = 64, 8
TRITON_MIN_M = 16  # the Triton dense GEMM is timed from this many rows of x (a GEMV is not what its templates are for)
INDUCTOR_OPTIONS = {"max_autotune": True, "max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON",
                    "autotune_fallback_to_aten": False, "triton.enable_persistent_tma_matmul": True,
                    "triton.cudagraphs": False}
NF4, BNB, DEQ, CUBLAS = "nf4.linear", "bnb.matmul_4bit", "nf4.dequantize + cuBLAS", "cuBLAS"
READ = "cuBLAS GEMV, the packed bytes' count"
TRITON = "Triton dense GEMM (inductor max-autotune)"
INT4 = "torch int4 GEMM (tinygemm)"


def inductor_options() -> dict:
    """INDUCTOR_OPTIONS less those this torch's inductor does not have (the result file records what was used)."""
    import torch._inductor.config as config

    def has(name):
        obj = config
        for part in name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    return {k: v for k, v in INDUCTOR_OPTIONS.items() if has(k)}


def triton_dense(options: dict):
    """A fresh torch.compile of F.linear with inductor's GEMM autotuning over its Triton templates only."""
    torch._dynamo.reset()  # each (weight, M) compiles and autotunes on its own

    def linear(x, w):
        return torch.nn.functional.linear(x, w)

    return torch.compile(linear, dynamic=False, fullgraph=True, options=options)


def measure(shape: str, ms, dtype, copy_gbs: float, options: dict, log=print, save=None) -> list[dict]:
    """The rows of one weight at every M (see the module's docstring); `save(rows)` after each M."""
    import nf4

    n, k = parse_shape(shape)
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    wd = nf4.dequantize(*sets[0]).to(dtype)
    dense = [wd] + [wd.clone() for _ in range(timing.rotation_count(n * k * 2) - 1)]
    int4 = None  # (weights, the weight they multiply by), or the error text the rows that would use them report
    if min(ms) <= INT4_MAX_M:
        try:
            sets4 = int4_weights(n, k, timing.rotation_count(n * k // 2))
            int4 = (sets4, int4_weight(sets4, k))
        except Exception as exc:  # this torch or GPU cannot build or check them
            int4 = f"{type(exc).__name__}: {exc}"[:300]
    rows = []
    for m in ms:
        rows += _at_m(shape, m, sets, wd, dense, dtype, copy_gbs, options, log, int4)
        torch.cuda.empty_cache()
        if save is not None:
            save(rows)
    sets.clear()
    dense.clear()
    torch.cuda.empty_cache()
    return rows


def int4_weights(n: int, k: int, copies: int):
    """(packed, scales and zeros) pairs for torch's int4 GEMM: one random 4-bit weight of n x k (bytes [n, k / 2] as
    `aten._convert_weight_to_int4pack` takes them) with random bfloat16 scales and zeros per INT4_GROUP weights,
    cloned for rotation."""
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    raw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack(raw, INT4_INNER_K_TILES)
    scale = torch.rand((k // INT4_GROUP, n, 1), device="cuda", generator=gen) * 0.01 + 0.001
    zero = (torch.rand((k // INT4_GROUP, n, 1), device="cuda", generator=gen) - 0.5) * 0.01
    sz = torch.cat([scale, zero], dim=2).to(torch.bfloat16).contiguous()
    return [(packed, sz)] + [(packed.clone(), sz.clone()) for _ in range(copies - 1)]


def int4_mm(x, packed, sz):
    return torch.ops.aten._weight_int4pack_mm(x, packed, INT4_GROUP, sz)


def int4_weight(int4, k: int):
    """The [N, K] weight the int4 GEMM multiplies by (its output on identity rows, in two halves of K), after
    checking that 16 identity rows alone give the same columns (one weight whatever the number of rows)."""
    packed, sz = int4[0]
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    w = torch.cat([int4_mm(eye[: k // 2], packed, sz), int4_mm(eye[k // 2:], packed, sz)]).t()
    if not torch.equal(int4_mm(eye[:16], packed, sz).t(), w[:, :16]):
        raise AssertionError("the int4 GEMM's identity rows do not give one weight")
    return w.contiguous()


def _at_m(shape, m, sets, wd, dense, dtype, copy_gbs, options, log, int4=None) -> list[dict]:
    """The rows of one weight at M rows of x."""
    import bitsandbytes as bnb

    import nf4

    n, k = parse_shape(shape)
    base = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."),
            **floors(n, k, m, torch.empty((), dtype=dtype).element_size(), copy_gbs)}
    xid, cols, scales = identity_rows(m, k, dtype, seed=m * 7 + n)
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn((m, k), device="cuda", generator=gen).to(dtype)
    rows = []

    def row(part, fn, count, **extra):
        fn(0)
        g = timing.graph_time_us(fn, list(range(count)))
        r = {**base, "part": part, "graph_us": g and g.get("median_us"), **extra}
        rows.append(r)
        log(f"  {shape} M={m:<5} {part:<44} {r['graph_us'] or float('nan'):9.2f} us"
            + "".join(f", {key} {val}" for key, val in extra.items()), flush=True)

    row(NF4, lambda i: nf4.linear(xid, *sets[i % len(sets)]), len(sets),
        operand_mismatches=mismatches(nf4.linear(xid, *sets[0]), operand_expected(wd, cols, scales, dtype)))
    row(BNB, lambda i: bnb.matmul_4bit(xid, sets[i % len(sets)][0].t(), quant_state=sets[i % len(sets)][1]),
        len(sets))
    row(DEQ, lambda i: torch.nn.functional.linear(xid, nf4.dequantize(*sets[i % len(sets)])), len(sets))
    row(CUBLAS, lambda i: torch.nn.functional.linear(xid, dense[i % len(dense)]), len(dense))
    if m == 1:
        small = [torch.randn((n, k // 4), device="cuda", generator=gen).to(dtype)
                 for _ in range(timing.rotation_count(n * k // 2))]
        x4 = x[:, : k // 4].contiguous()
        row(READ, lambda i: torch.nn.functional.linear(x4, small[i % len(small)]), len(small),
            weight_bytes=n * (k // 4) * 2)
        small.clear()
    if m <= INT4_MAX_M and int4 is not None:
        try:
            if isinstance(int4, str):
                raise RuntimeError(int4)
            sets4, w4 = int4
            ratio = sum_ratio(int4_mm(x, *sets4[0]), x, w4)
            if not ratio <= 1.0:
                raise AssertionError(f"outside the float32 accumulation bound: sum_ratio {ratio}")
            row(INT4, lambda i: int4_mm(xid, *sets4[i % len(sets4)]), len(sets4), sum_ratio=round(ratio, 4))
        except Exception as exc:  # reported in the row, not fatal
            rows.append({**base, "part": INT4, "graph_us": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"  {shape} M={m:<5} {INT4}: {rows[-1]['error']}", flush=True)
    if m >= TRITON_MIN_M:
        t0 = time.time()
        try:
            fn = triton_dense(options)
            ratio = sum_ratio(fn(x, wd), x, wd)
            compile_s = time.time() - t0
            if not ratio <= 1.0:
                raise AssertionError(f"outside the float32 accumulation bound: sum_ratio {ratio}")
            row(TRITON, lambda i: fn(xid, dense[i % len(dense)]), len(dense), sum_ratio=round(ratio, 4),
                compile_s=round(compile_s, 1))
        except Exception as exc:  # reported in the row, not fatal: the other rows stand
            rows.append({**base, "part": TRITON, "graph_us": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"  {shape} M={m:<5} {TRITON}: {rows[-1]['error']}", flush=True)
        torch._dynamo.reset()
    return rows


def bars(rows: list[dict]) -> list[dict]:
    """One line per bar, weight and M: target time, nf4.linear's time, the control where one applies (module
    docstring). Rows without a time (a failed part) leave None in the line."""
    times: dict[tuple, float | None] = {}
    floor: dict[tuple, float] = {}
    for r in rows:
        key = (r["N"], r["K"], r["M"], r["dtype"])
        times[(*key, r["part"])] = r.get("graph_us")
        floor[key] = r["byte_floor_us"]
    out = []
    for key in sorted(floor):
        n, k, m, dtype = key

        def t(part, key=key):
            return times.get((*key, part))

        if m == 1:  # both halves of the bar: bitsandbytes stands for the best peer (a slower one only loosens it)
            half = [v / 2 for v in (t(BNB),) if v is not None]
            bar, target, control = "a", min([1.5 * floor[key], *half]), READ
        elif m <= 128:
            bar, target, control = "b", t(CUBLAS), None
        elif m <= 512:
            peers = [v for v in (t(DEQ), t(BNB)) if v is not None]
            bar, target, control = "c", (min(peers) / 1.5 if peers else None), TRITON
        else:
            bar, target, control = "d", (1.10 * t(CUBLAS) if t(CUBLAS) is not None else None), TRITON
        nf4_us, control_us = t(NF4), (t(control) if control else None)
        line = {"bar": bar, "N": n, "K": k, "M": m, "dtype": dtype, "target_us": target, "nf4_us": nf4_us,
                "nf4_meets": None if None in (target, nf4_us) else nf4_us <= target,
                "control": control, "control_us": control_us,
                "control_meets": None if None in (target, control_us) else control_us <= target,
                "cublas_us": t(CUBLAS), "triton_dense_us": t(TRITON), "byte_floor_us": floor[key],
                "int4_us": t(INT4), "int4_meets": None if None in (target, t(INT4)) else t(INT4) <= target}
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments linear-bounds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="weights N x K")
    ap.add_argument("--ms", nargs="+", type=int, default=list(DEFAULT_MS), help="rows of x")
    ap.add_argument("--out", default=os.path.join("build", "linear", "bounds.json"), help="result file (JSON)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("linear-bounds needs a CUDA GPU (it times released GPU kernels)", file=sys.stderr)
        return 2
    copy = timing.copy_bandwidth_gbs()
    options = inductor_options()
    payload = {"env": timing.environment(), "copy_bandwidth": copy, "nominal_tflops": NOMINAL_TFLOPS,
               "inductor_options": options, "rows": []}
    print(f"copy {copy['gbs']:.0f} GB/s; inductor options {options}", flush=True)
    t0 = time.time()
    for shape in args.shapes:
        done = list(payload["rows"])

        def save(rows, done=done):  # after each M: a cut-off run keeps what it measured
            payload["rows"] = done + rows
            payload["bars"] = bars(payload["rows"])
            payload["elapsed_s"] = time.time() - t0
            timing.write_json(args.out, payload)

        measure(shape, args.ms, torch.bfloat16, copy["gbs"], options, save=save)
    for b in payload["bars"]:
        print(f"bar ({b['bar']}) {b['N']}x{b['K']} M={b['M']}: target {b['target_us'] or float('nan'):.1f} us, "
              f"nf4.linear {b['nf4_us'] or float('nan'):.1f}"
              + (f", {b['control']} {b['control_us'] or float('nan'):.1f} (meets: {b['control_meets']})"
                 if b["control"] else ""))
    print(f"wrote {args.out} ({len(payload['rows'])} rows, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
