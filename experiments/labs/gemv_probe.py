"""One launch of each GEMV provider inside an NVTX range named "probe", for Nsight Compute to profile.

    ncu --nvtx --nvtx-include "probe/" --set full --import-source yes -o prof \\
        python -m experiments.labs.gemv_probe --shape 14336x4096 --m 1 --providers product pair16 none same_bytes

The TMA skeleton's controls, step by step (bytes only, the absmax chain, MMA fragments with x fixed, x loaded only
in the lanes of real rows, x loaded everywhere, then the prmt decode):

    ... --providers t_stream4x2 t_absmax4x2 t_none4x2_nox t_none4x2_xp t_none4x2 t_prmt4x2_xp same_bytes

Providers: "product" (nf4.linear as its table picks), "product:<kernel>" (nf4.linear with
LinearConfig(kernel=<kernel>) at its defaults plus --fields), a lab candidate of experiments.labs.gemv_lut
(CANDIDATES, and the stream, staged, deep and bulk skeletons' own), "same_bytes" (F.linear on a bf16 [N, K/4]
matrix: cuBLAS's GEMV reading as many bytes) and "dense" (F.linear on the bf16 [N, K] weight). Each is called three
times outside the range (compiles, caches), then once inside it; the order of the providers is printed, so that the
profile's launches can be named. Weights: one bitsandbytes NF4 weight (blocksize 64, nested absmax), x random.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def providers(names, x, packed, qs, n: int, k: int, fields: dict):
    import nf4
    from nf4.linear import LinearConfig

    from . import gemv_lut

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = x.shape[0]
    same = torch.randn((n, k // 4), device="cuda").to(x.dtype)
    xs = torch.randn((m, k // 4), device="cuda").to(x.dtype)
    for name in names:
        if name == "product":
            yield name, lambda: nf4.linear(x, packed, qs)
        elif name.startswith("product:"):
            cfg = LinearConfig(kernel=name.split(":", 1)[1], **fields)
            yield name, lambda cfg=cfg: nf4.linear(x, packed, qs, config=cfg)
        elif name == "same_bytes":
            yield name, lambda: torch.nn.functional.linear(xs, same)
        elif name == "dense":
            import bitsandbytes.functional as F

            wd = F.dequantize_4bit(packed, qs).to(x.dtype)
            yield name, lambda wd=wd: torch.nn.functional.linear(x, wd)
        elif name in gemv_lut.stream.CANDIDATES:
            yield name, lambda name=name: gemv_lut.stream.linear(x, packed, qs, name)
        elif name in gemv_lut.deep.CANDIDATES:
            yield name, lambda name=name: gemv_lut.deep.linear(x, packed, qs, name)
        elif name in gemv_lut.staged.CANDIDATES:
            yield name, lambda name=name: gemv_lut.staged.linear(x, packed, qs, name)
        elif name in gemv_lut.bulk.CANDIDATES:  # the TMA skeleton (b_*, t_*): its tensor map made once, first
            gemv_lut.bulk.prepare(packed, qs)
            yield name, lambda name=name: gemv_lut.bulk.linear(x, packed, qs, name)
        else:
            p = gemv_lut.plan(n, k, m, name, sms)
            out = torch.empty((m, n), dtype=x.dtype, device="cuda")
            part = torch.empty((p["split"], m, n), dtype=torch.float32, device="cuda")
            yield name, lambda name=name, p=p, out=out, part=part: gemv_lut.lab_linear(x, packed, qs, name, out,
                                                                                        part, p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.gemv_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="14336x4096")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--providers", nargs="+", default=["product", "pair16", "none", "same_bytes"])
    ap.add_argument("--fields", default="{}", help="JSON LinearConfig fields for product:<kernel> providers")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_probe needs a CUDA GPU")
        return 2
    import bitsandbytes.functional as F

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    n, k = (int(v) for v in args.shape.lower().split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(dtype)
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    del w
    x = torch.randn((args.m, k), device="cuda", generator=gen).to(dtype)
    order = []
    for name, fn in providers(args.providers, x, packed, qs, n, k, json.loads(args.fields)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("probe")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        order.append(name)
    print("probe order:", " ".join(order), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
