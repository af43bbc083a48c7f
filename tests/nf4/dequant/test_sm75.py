"""Offline compilation of the fused kernel for a T4 (sm_75) and for Hopper (sm_90), on any machine.

No GPU is needed: `triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))` builds PTX
and a cubin with the ptxas bundled with triton. The compile runs in a child process without
TRITON_INTERPRET (in the interpreter, `@triton.jit` yields functions that cannot be compiled).

What is compiled is what `nf4.dequant.launch.launch` would launch for the challenge's 8192x2048 weight (blocksize
64, double quantization): the child calls the dequant launch inside `nf4.runtime.recording()`, on
stand-in tensors that report a CUDA device (so launch takes its GPU path; the interpreter path
passes other meta-parameters), and turns the recorded arguments and options into the signature,
constexprs and compile options.

Checked: PTX and an ELF cubin come out; no register spills (cuobjdump's LOCAL bytes / 4, the way
triton's driver computes `n_spills`); no float32 FMA in the PTX (`fma.rn.f32`, or `fma.rn.ftz.f32`:
contraction off) but float32 multiplies (`mul.rn.f32`, `mul.f32`, or the `.ftz` forms that the FTZ
path writes in inline PTX); and a control build with enable_fp_fusion=True does contain FMAs, so
the check can see them. Registers, spills and shared memory go to a JSON file when NF4_SM75_RECORD
names one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = r'''
import json, re, shutil, subprocess, sys, tempfile
from pathlib import Path

import torch
import triton
import triton.compiler
from triton.backends.compiler import GPUTarget

from nf4 import NF4Weight, runtime
from nf4.dequant.kernel import nf4_dequantize_kernel as KERNEL
from nf4.dequant.launch import launch, tuned_config
POINTER = {torch.uint8: "*u8", torch.int8: "*i8", torch.float16: "*fp16", torch.bfloat16: "*bf16",
           torch.float32: "*fp32"}
N, BLOCKSIZE = 8192 * 2048, 64


class CudaLikeDevice(str):
    """A device that says "cuda" to launch's checks but that torch reads as "cpu" (the string itself),
    so whatever launch allocates on it (tables, dummies) is made on the CPU of a CUDA-less build."""
    type = "cuda"
    index = 0


class FakeCudaTensor:
    """Just enough of a CUDA tensor for the dequant launch to take its GPU path on a machine without one."""
    device = CudaLikeDevice("cpu")

    def __init__(self, dtype, numel):
        self.dtype, self._numel = dtype, numel

    def data_ptr(self):
        return 1 << 24  # 16-byte aligned, like a fresh allocation

    def numel(self):
        return self._numel

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


def recorded_launch(out_dtype, ftz):
    n_blocks = N // BLOCKSIZE
    # The config the tuned table gives the challenge's 8192x2048 weight (no GPU here to name).
    config = tuned_config(torch.device("cpu"), N * torch.empty((), dtype=out_dtype).element_size())
    w = NF4Weight(FakeCudaTensor(torch.uint8, N // 2), FakeCudaTensor(torch.uint8, n_blocks),
                  FakeCudaTensor(torch.float32, -(-n_blocks // 256)), FakeCudaTensor(torch.float32, 256),
                  FakeCudaTensor(torch.float32, 1), (N,), BLOCKSIZE, out_dtype, True)
    with runtime.recording() as calls:
        launch(w, FakeCudaTensor(out_dtype, N), ftz, config)
    if len(calls) != 1 or calls[0].fn is not KERNEL:
        raise RuntimeError(f"the dequant launch made {len(calls)} launches, expected one of nf4_dequantize_kernel")
    return calls[0].grid, calls[0].args, calls[0].options


def source_for(args):
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(KERNEL.params, args, strict=True)):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif hasattr(value, "data_ptr"):
            signature[name] = POINTER[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compiler.ASTSource(fn=KERNEL, signature=signature, constexprs=constexprs, attrs=attrs), constexprs


def tool(name):
    try:
        return getattr(triton.knobs.nvidia, name).path
    except Exception:
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(bundled) if bundled.exists() else shutil.which(name)


def ptxas_version(cap):
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            path = get_ptxas(cap).path
        except TypeError:
            path = get_ptxas().path
        text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        return path, (re.findall(r"release [^\s,]+, V[\d.]+", text) or [text.strip()])[-1]
    except Exception as e:
        return None, f"unknown ({e})"


def resource_usage(cubin):
    cuobjdump = tool("cuobjdump")
    if not cuobjdump:
        return {"usage_error": "cuobjdump not found"}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        Path(f.name).unlink()
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not m:
        return {"usage_error": f"no resource line in cuobjdump output: {text!r}"}
    regs, stack, static_shared, local = map(int, m.groups())
    return {"n_regs": regs, "n_spills": local // 4, "local_bytes": local, "stack_bytes": stack,
            "static_shared_bytes": static_shared}


def build(name, cap, out_dtype, ftz, fusion=None):
    grid, args, kwargs = recorded_launch(out_dtype, ftz)
    src, constexprs = source_for(args)
    options = dict(kwargs)
    if fusion is not None:
        options["enable_fp_fusion"] = fusion
    path, version = ptxas_version(cap)
    result = {"name": name, "cap": cap, "out_dtype": str(out_dtype), "ftz": ftz, "options": options,
              "launch_options": kwargs, "grid": list(grid), "numel": N, "blocksize": BLOCKSIZE,
              "constexprs": {k: v for k, v in constexprs.items()}, "ptxas": path, "ptxas_version": version,
              "triton": triton.__version__}
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        result["error"] = text[:4000]
        result["ptxas_error"] = "ptxas" in text.lower() or "PTXASError" in text
        return result
    cubin = compiled.asm.get("cubin", b"")
    result.update(ptx=compiled.asm.get("ptx", ""), cubin_bytes=len(cubin), cubin_is_elf=cubin[:4] == b"\x7fELF",
                  shared=int(compiled.metadata.shared), num_warps=int(compiled.metadata.num_warps))
    result.update(resource_usage(cubin))
    result.update(ints=[v for v in args if isinstance(v, int) and not isinstance(v, bool)][:3])
    return result


variants = []
for cap in (75, 90):
    for dt in (torch.float16, torch.bfloat16):
        variants.append(build(f"sm{cap}-{str(dt)[6:]}", cap, dt, True))
    variants.append(build(f"sm{cap}-float16-ieee", cap, torch.float16, False))
    variants.append(build(f"sm{cap}-float16-ieee-fused", cap, torch.float16, False, fusion=True))
Path(sys.argv[1]).write_text(json.dumps(variants, default=str))
'''

FMA = re.compile(r"\bfma\.rn(\.ftz)?(\.sat)?\.f32\b")
MUL = re.compile(r"\bmul(\.rn)?(\.ftz)?\.f32\b")
MAIN = ["sm75-float16", "sm75-bfloat16", "sm90-float16", "sm90-bfloat16"]
UNFUSED = [*MAIN, "sm75-float16-ieee", "sm90-float16-ieee"]
FUSED = ["sm75-float16-ieee-fused", "sm90-float16-ieee-fused"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Compile every variant once, in a child process without TRITON_INTERPRET."""
    path = tmp_path_factory.mktemp("sm75") / "builds.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"offline compile child failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    found = {b["name"]: b for b in json.loads(path.read_text())}
    record_to = os.environ.get("NF4_SM75_RECORD")
    if record_to:
        record = [{k: v for k, v in b.items() if k != "ptx"} for b in found.values()]
        Path(record_to).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return found


def _built(builds, name):
    build = builds[name]
    if "error" in build:
        if build["ptxas_error"]:
            pytest.xfail(f"{name}: the bundled ptxas ({build['ptxas_version']}) could not build "
                         f"sm_{build['cap']}; no cubin to check: {build['error'][:600]}")
        pytest.fail(f"{name}: compile failed: {build['error']}")
    return build


@pytest.mark.parametrize("name", MAIN)
def test_ptx_and_cubin(builds, name):
    build = _built(builds, name)
    assert f".target sm_{build['cap']}" in build["ptx"], "PTX for the wrong target"
    assert ".entry nf4_dequantize_kernel" in build["ptx"]
    assert build["cubin_is_elf"] and build["cubin_bytes"] > 0, "no cubin"
    assert build["launch_options"]["enable_fp_fusion"] is False, "the dequant launch must compile with contraction off"


@pytest.mark.parametrize("name", MAIN)
def test_no_spills(builds, name):
    build = _built(builds, name)
    if "usage_error" in build:
        pytest.fail(f"{name}: could not read the resource usage: {build['usage_error']}")
    print(f"{name}: {build['n_regs']} registers, {build['n_spills']} spills, {build['shared']} B shared "
          f"(ptxas {build['ptxas_version']}, num_warps {build['num_warps']})")
    # ptxas places spill slots in the stack frame (STACK), so both must be zero.
    assert build["n_spills"] == 0 and build["local_bytes"] == 0 and build["stack_bytes"] == 0, (
        f"{name} spills: {build['local_bytes']} bytes of local memory with {build['n_regs']} registers")
    assert build["n_regs"] <= 255


@pytest.mark.parametrize("name", UNFUSED)
def test_no_contraction(builds, name):
    build = _built(builds, name)
    ptx = build["ptx"]
    fmas = [line.strip() for line in ptx.splitlines() if FMA.search(line)]
    assert not fmas, f"{name}: {len(fmas)} float32 FMAs in the PTX, first: {fmas[:3]}"
    assert MUL.search(ptx), f"{name}: no float32 multiply in the PTX"


@pytest.mark.parametrize("name", FUSED)
def test_contraction_control(builds, name):
    """With enable_fp_fusion=True (and no flush between multiply and add) FMAs appear: the check sees them."""
    build = _built(builds, name)
    assert FMA.search(build["ptx"]), f"{name}: no FMA even with fusion on; test_no_contraction proves nothing"


@pytest.mark.parametrize("name", UNFUSED)
def test_launch_passes_the_three_sizes(builds, name):
    """The launch's integer arguments are the three sizes the kernel reads: n, packed bytes, whole words."""
    build = _built(builds, name)
    n, n_bytes, n_words = build["ints"]
    assert (n, n_bytes, n_words) == (build["numel"], build["numel"] // 2, build["numel"] // 8)

