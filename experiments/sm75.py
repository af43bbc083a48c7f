"""Offline compilation of every variant's kernel for a T4 (sm_75): registers, spills, shared memory, PTX facts.

Compile-only: no T4 runs anything. `triton.compile(ASTSource(...), target=GPUTarget("cuda", 75, 32))`
builds PTX and a cubin with the ptxas bundled with triton, on any machine. What is compiled is
what the variant's own launcher would launch for an 8192x2048 weight (blocksize 64, double
quantization, ftz=True): the launcher runs on meta tensors inside `experiments.common.recording()`
and its launch is turned into a signature (pointer dtypes, 16-divisibility, int widths, as Triton's
JIT specialises them), constexprs and options (num_warps, enable_fp_fusion). nf4.dequant.launch on
meta tensors takes its interpreter branch; ASM and BF16_BITS are given their GPU values.

Per build: registers, stack, static shared and local memory (`cuobjdump -res-usage` on the cubin),
spill stores/loads (`ptxas -v` on the same PTX with triton's fmad setting), Triton's dynamic shared
memory, and from the PTX the global load/store forms with their widths in bytes, the cache hints
(L1::evict_*, L1::no_allocate, L2::cache_hint, .cs, .cg, .nc), and counts of fma.rn.f32,
mul.rn.ftz.f32, prmt.b32, selp, shared-memory accesses and barriers.

Other ops: the inputs are the variant's op's (`experiments.ops.<op>`): an op module may define
`meta_inputs(out_dtype)` (the variant's positional inputs, its output buffer last, on the meta
device) and `SM75_WEIGHT` (what they describe); without them, the dequant defaults below. A launcher
that issues several launches (split-K and its ordered sum) gets one row per launch, numbered in
`launch`. Builds also count mma.sync and cp.async where present (tl.dot kernels). A variant whose
kernel needs a later GPU (`Variant.min_arch` above 75: PTX that ptxas refuses for sm_75) gets one row
per dtype with `not_built` (the reason) and no build: nothing is compiled in its name.

Triton's interpreter must be off to compile, so `compile_in_child` runs this module as a child
process (`python -m experiments.sm75`) without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
TARGET_ARCH = 75  # GPUTarget("cuda", 75, 32): a Tesla T4
SHAPE, BLOCKSIZE = (8192, 2048), 64
DEVICE_NOTE = "sm_75 (Tesla T4) offline compile only: nothing was run on a T4"
CSV_FIELDS = ["variant", "out_dtype", "device", "n_regs", "spill_stores", "spill_loads", "stack_bytes", "local_bytes",
              "static_shared_bytes", "shared_bytes", "num_warps", "enable_fp_fusion", "global_loads", "global_stores",
              "cache_hints", "fma", "mul_ftz", "prmt", "selp", "shared_ld", "shared_st", "bar_sync", "ptxas",
              "triton", "kernel", "not_built", "error"]
_WIDTH = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}


def _pointer_type(dtype) -> str:
    import torch

    return {torch.uint8: "*u8", torch.int8: "*i8", torch.float16: "*fp16", torch.bfloat16: "*bf16",
            torch.float32: "*fp32", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}[dtype]


def meta_inputs(out_dtype):
    """(packed, quant_state, out) on the meta device for the SHAPE weight: what a launcher needs to launch."""
    import torch

    meta = torch.device("meta")
    n = SHAPE[0] * SHAPE[1]
    n_blocks = -(-n // BLOCKSIZE)
    state2 = SimpleNamespace(absmax=torch.empty(-(-n_blocks // 256), dtype=torch.float32, device=meta),
                             code=torch.empty(256, dtype=torch.float32, device=meta), blocksize=256)
    qs = SimpleNamespace(absmax=torch.empty(n_blocks, dtype=torch.uint8, device=meta), shape=torch.Size(SHAPE),
                         dtype=out_dtype, blocksize=BLOCKSIZE, quant_type="nf4", nested=True, state2=state2,
                         offset=torch.empty((), dtype=torch.float32, device=meta),
                         code=torch.empty(16, dtype=torch.float32, device=meta))
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=meta)
    return packed, qs, torch.empty(SHAPE, dtype=out_dtype, device=meta)


def _op_module(op: str):
    return importlib.import_module(f"{__package__}.ops.{op}")


def op_meta_inputs(op: str, out_dtype) -> tuple:
    """The op's meta inputs for its variants' launchers (the dequant defaults when it defines none)."""
    return getattr(_op_module(op), "meta_inputs", meta_inputs)(out_dtype)


def op_weight(op: str) -> str:
    """What the op's meta inputs describe."""
    return getattr(_op_module(op), "SM75_WEIGHT", f"{SHAPE[0]}x{SHAPE[1]}, blocksize {BLOCKSIZE}, double quant, "
                                                  "ftz=True")


def recorded_launches(variant, out_dtype) -> list:
    """The (kernel, grid, args, options) the variant's launcher issues for its op's meta inputs."""
    from . import common

    *inputs, out = op_meta_inputs(variant.op, out_dtype)
    with common.recording() as calls:
        variant.run(*inputs, out, ftz=True)
    return list(calls)


def source_spec(kernel, args, options) -> dict:
    """Signature, constexprs, attrs and compile options of one launch, as Triton's JIT specialises it."""
    import torch

    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, args, strict=True)):
        name = param.name
        specialize = not getattr(param, "do_not_specialize", False)
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _pointer_type(value.dtype)
            if value.data_ptr() % 16 == 0:  # fresh allocations are 16-byte aligned (meta: 0)
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, str) and value.startswith("*"):  # a pointer given by its type ("*bf16"), aligned
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            if specialize and value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialize and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r} for an offline compile")
    opts = {"num_warps": options.get("num_warps", 4), "enable_fp_fusion": options.get("enable_fp_fusion", True)}
    return {"signature": signature, "constexprs": constexprs, "attrs": attrs, "options": opts}


def _tool(name: str) -> str | None:
    import shutil

    import triton

    try:
        return getattr(triton.knobs.nvidia, name).path
    except Exception:
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(bundled) if bundled.exists() else shutil.which(name)


def resource_usage(cubin: bytes, ptx: str, fp_fusion: bool) -> dict:
    """REG/STACK/SHARED/LOCAL from cuobjdump; spill stores/loads from `ptxas -v` on the PTX."""
    found: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path, ptx_path = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin_path.write_bytes(cubin)
        ptx_path.write_text(ptx)
        cuobjdump = _tool("cuobjdump")
        if cuobjdump:
            text = subprocess.run([cuobjdump, "-res-usage", str(cubin_path)], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
            if m:
                names = ("n_regs", "stack_bytes", "static_shared_bytes", "local_bytes")
                found.update(zip(names, map(int, m.groups()), strict=True))
        ptxas = _tool("ptxas")
        if ptxas:
            cmd = [ptxas, "-v", "--gpu-name=sm_75", str(ptx_path), "-o", str(Path(tmp) / "v.cubin")]
            if not fp_fusion:
                cmd.insert(1, "--fmad=false")
            text = subprocess.run(cmd, capture_output=True, text=True).stderr
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
            if m:
                found["spill_stores"], found["spill_loads"] = int(m.group(1)), int(m.group(2))
            v = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
            found["ptxas"] = (re.findall(r"release [^\s,]+, V[\d.]+", v) or ["?"])[-1]
    return found


def ptx_facts(ptx: str) -> dict:
    """Global load/store forms (with widths in bytes), cache hints and instruction counts found in the PTX."""

    def forms(op: str) -> dict:
        found = Counter(re.findall(rf"\b({op}\.global[\w.:]*)", ptx))
        out = {}
        for form, count in sorted(found.items()):
            vec = re.search(r"\.v(\d)\.", form + ".")
            bits = re.search(r"\.[bsuf](\d+)$", form)
            width = (int(vec.group(1)) if vec else 1) * (_WIDTH.get(bits.group(1), 0) if bits else 0)
            out[f"{form} ({width} B)"] = count
        return out

    ops = re.findall(r"\b(?:ld|st)\.global[\w.:]*", ptx)
    hints = set()
    for op in ops:
        hints.update(re.findall(r"L[12]::\w+", op))
        hints.update(h for h in (".cs", ".cg", ".ca", ".cv", ".lu", ".wt", ".nc") if h + "." in op + ".")
    if "createpolicy" in ptx:
        hints.add("createpolicy")
    return {"global_loads": forms("ld"), "global_stores": forms("st"), "cache_hints": sorted(hints),
            "fma": len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32", ptx)), "mul_ftz": ptx.count("mul.rn.ftz.f32"),
            "prmt": ptx.count("prmt.b32"), "selp": len(re.findall(r"\bselp\.", ptx)),
            "shared_ld": len(re.findall(r"\bld(?:matrix)?[\w.]*\.shared", ptx)),
            "shared_st": len(re.findall(r"\bst(?:matrix)?[\w.]*\.shared", ptx)),
            "bar_sync": len(re.findall(r"\bbar\.sync|\bbarrier\.sync", ptx)), **_matmul_facts(ptx)}


def _matmul_facts(ptx: str) -> dict:
    """Tensor-core MMAs and cp.async copies, only where present (the dequant kernels have neither, so
    their rows stay as they were; ldmatrix is already counted in shared_ld)."""
    found = {"mma": len(re.findall(r"\bmma\.sync", ptx)), "cp_async": len(re.findall(r"\bcp\.async\.(?:ca|cg)", ptx))}
    return {k: v for k, v in found.items() if v}


def _build(task):
    """Compile one spec for sm_75 (a worker process): resource usage and PTX facts, or the error."""
    key, kernel_ref, spec, ptx_dir = task
    import triton
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    module, _, qualname = kernel_ref.partition(":")
    kernel = getattr(importlib.import_module(module), qualname)
    result = {"kernel": kernel_ref, "triton": triton.__version__, "num_warps": spec["options"]["num_warps"],
              "enable_fp_fusion": spec["options"]["enable_fp_fusion"]}
    try:
        src = triton.compiler.ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"],
                                        attrs=spec["attrs"])
        compiled = triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32), options=spec["options"])
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        return key, result
    ptx = compiled.asm.get("ptx", "")
    if ptx_dir:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
        (Path(ptx_dir) / f"{key}.ptx").write_text(ptx)
    result["shared_bytes"] = int(compiled.metadata.shared)
    result.update(resource_usage(compiled.asm.get("cubin", b""), ptx, spec["options"]["enable_fp_fusion"]))
    result.update(ptx_facts(ptx))
    return key, result


def _kernel_ref(kernel) -> str:
    """'module:name' of a @triton.jit kernel, importable in a worker."""
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}:{fn.__name__}"


def compile_variants(ids: list[str], dtypes=("float16", "bfloat16"), jobs: int = 1, ptx_dir: str | None = None) -> dict:
    """Compile every (variant, out dtype) for sm_75; identical launches are compiled once."""
    import hashlib

    import torch

    from . import registry

    tasks, builds = {}, []
    for vid in ids:
        variant = registry.get(vid)
        for dt in dtypes:
            base = {"variant": vid, "out_dtype": dt, "device": DEVICE_NOTE, "spills_expected": variant.spills_expected}
            if variant.min_arch > TARGET_ARCH:  # on meta tensors its launcher would record another kernel, if any
                builds.append(dict(base, kernel=_kernel_ref(variant.kernel) if variant.kernel is not None else None,
                                   not_built=f"needs sm_{variant.min_arch}+"
                                   + (f": {variant.arch_reason}" if variant.arch_reason else "")))
                continue
            try:
                launches = recorded_launches(variant, getattr(torch, dt))
                if not launches:
                    raise RuntimeError("the launcher issued no launch")
                specs = [(kernel, source_spec(kernel, args, options)) for kernel, _, args, options in launches]
            except Exception as exc:
                builds.append(dict(base, error=f"recording: {type(exc).__name__}: {exc}"[:1000]))
                continue
            for i, (kernel, spec) in enumerate(specs):
                row = dict(base, launch=i) if len(specs) > 1 else dict(base)
                ref = _kernel_ref(kernel)
                constexprs = sorted((k, repr(v)) for k, v in spec["constexprs"].items())
                text = repr((ref, sorted(spec["signature"].items()), constexprs, sorted(spec["attrs"].items()),
                             sorted(spec["options"].items())))
                key = f"{kernel.__name__}_{dt}_{hashlib.sha1(text.encode()).hexdigest()[:10]}"
                tasks[key] = (key, ref, spec, ptx_dir)
                row["build"] = key
                row["constexprs"] = {k: v for k, v in spec["constexprs"].items()}
                builds.append(row)
    if jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            done = dict(pool.map(_build, tasks.values()))
    else:
        done = dict(map(_build, tasks.values()))
    for row in builds:
        if "build" in row:
            row.update(done[row["build"]])
    import triton

    op_names = list(dict.fromkeys(registry.get(vid).op for vid in ids)) or ["dequant"]
    weight = "; ".join(op_weight(op) if op_names == ["dequant"] else f"{op}: {op_weight(op)}" for op in op_names)
    return {"device": DEVICE_NOTE, "target": "cuda sm_75, warp 32", "triton": triton.__version__,
            "weight": weight, "unique_builds": len(tasks), "builds": builds}


def compile_in_child(ids: list[str], *, jobs: int | None = None, ptx_dir: str | None = None,
                     dtypes=("float16", "bfloat16"), timeout: int = 1800) -> dict:
    """Run compile_variants in a child process without TRITON_INTERPRET (which cannot compile)."""
    jobs = jobs or min(4, os.cpu_count() or 1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sm75.json"
        cmd = [sys.executable, "-m", "experiments.sm75", "--out", str(out), "--jobs", str(jobs),
               "--dtypes", *dtypes, *(["--ptx-dir", ptx_dir] if ptx_dir else []), "--", *ids]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"sm_75 compile child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def failures(result: dict) -> list[dict]:
    """Builds that failed, or spill although their variant does not expect it."""
    return [b for b in result["builds"]
            if b.get("error") or (b.get("spill_stores", 0) > 0 and not b.get("spills_expected"))]


def table(result: dict) -> str:
    """Markdown table: registers, spills, shared memory, global access widths, cache hints, FMAs."""
    lines = [f"{result['device']}; triton {result['triton']}; {result['weight']}", "",
             "| variant | dtype | regs | spill st/ld B | stack B | smem B | ld.global | st.global | hints | fma |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in result["builds"]:
        if b.get("error"):
            lines.append(f"| {b['variant']} | {b['out_dtype']} | error: {b['error'][:80]} |||||||| ")
            continue
        if b.get("not_built"):
            lines.append(f"| {b['variant']} | {b['out_dtype']} | not built: {b['not_built'][:80]} |||||||| ")
            continue

        def short(forms):
            return ", ".join(f"{re.sub(r'^(ld|st)[.]global[.]?', '', k).split(' (')[0] or 'plain'}"
                             f"{k[k.index(' ('):].replace(' B)', 'B)')}x{v}" for k, v in forms.items())

        name = b["variant"] + (f" #{b['launch']}" if "launch" in b else "")
        lines.append(f"| {name} | {b['out_dtype'].replace('float', 'fp').replace('bfp', 'bf')} | "
                     f"{b.get('n_regs', '?')} | {b.get('spill_stores', '?')}/{b.get('spill_loads', '?')} | "
                     f"{b.get('stack_bytes', '?')} | {b.get('shared_bytes', 0) + b.get('static_shared_bytes', 0)} | "
                     f"{short(b['global_loads'])} | {short(b['global_stores'])} | {' '.join(b['cache_hints'])} | "
                     f"{b['fma']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="variant ids (default: every variant with a kernel)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--ptx-dir", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    from . import registry

    ids = args.ids or [v.id for v in registry.variants().values() if v.kernel is not None]
    result = compile_variants(ids, tuple(args.dtypes), jobs=args.jobs, ptx_dir=args.ptx_dir)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
