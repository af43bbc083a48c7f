"""Offline SASS counts of a kernel's main loop, by pipe, per weight (sm_90 by default; no GPU needed).

    python -m experiments.labs.sass_count [--arch 90] [--json out.json] [builds...]

`count_sass(kernel, args, num_warps, unit)` compiles one launch of a @triton.jit kernel for sm_<arch> with
the ptxas bundled with Triton (`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`),
disassembles the cubin (`nvdisasm -c`, bundled too) and takes its main loop: among the innermost loops
(a block that ends in a branch back to its own label and holds no other such branch), the one with the most
tensor-core instructions, then the longest. Its opcodes are classified by the pipe that issues them on
Hopper (`PIPES`; IMAD/IMUL issue on the FMA pipe's heavy half, F2FP on the ALU pipe) and divided by the
weights (per thread) the loop decodes: `unit` is either that number or (opcode, weights per such opcode),
e.g. ("HMMA", 8 / NTILE) for the m16n8k16 GEMVs (a lane's share of a 16x16 A fragment is 8 weights, each used
by NTILE tiles of x), which stays right when the compiler unrolls the loop.

`BUILDS` names the launches this lab compares (the product's nf4_gemv_mma_kernel at its M = 1 config, each
candidate of experiments.labs.kernels, and the pair candidate as the product kernel nf4.linear.gemv_pair with the
arguments nf4.linear launches it with); `count_builds(names)` counts them, in a child process when Triton's
interpreter is on (an offline compile needs it off before triton is imported). Counts are of one thread's
instruction stream: a warp issues each once for its 32 lanes, so "per weight" is per weight per thread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl

# Hopper issue pipes by SASS opcode (the name before the first dot). ALU: logic, shifts, prmt, integer adds and
# compares, selects, fast float->16-bit conversion (F2FP). FMA: float32 FMA/MUL/ADD and, on its heavy half,
# IMAD/IMUL (IMAD.MOV included). LSU: memory and shuffles. XU: transcendentals and the slow conversions.
PIPES = {
    "alu": {"LOP3", "LOP", "VIADD", "SHF", "SHL", "SHR", "PRMT", "IADD3", "IADD", "IADD32I", "ISETP", "FSETP", "HSETP2",
            "SEL", "FSEL", "F2FP", "LEA", "IMNMX", "VIMNMX", "FMNMX", "IABS", "MOV", "PLOP3", "P2R", "R2P", "BMSK",
            "SGXT", "POPC", "FLO", "BREV", "VOTE", "ICMP", "CSET", "CSETP", "I2FP", "F2IP", "HMNMX2", "VABSDIFF",
            "IDP"},
    "fma": {"FFMA", "FMUL", "FADD", "FFMA32I", "FMUL32I", "FADD32I", "IMAD", "IMUL", "IMAD32I", "IMUL32I", "HFMA2",
            "HADD2", "HMUL2", "FSWZADD", "FCHK", "DFMA", "DMUL", "DADD"},
    "lsu": {"LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "LDSM", "STSM", "SHFL", "ATOM", "ATOMS", "ATOMG",
            "RED", "REDG", "LDGSTS", "LDGDEPBAR", "MATCH", "CCTL", "SUST", "SULD", "TLD", "TEX"},
    "tensor": {"HMMA", "IMMA", "HGMMA", "IGMMA", "DMMA", "BMMA", "QGMMA", "WARPGROUP"},
    "xu": {"MUFU", "I2F", "F2I", "F2F", "FRND", "I2I"},
}
SHARED_OPS = {"LDS", "STS", "SHFL", "LDSM", "STSM", "ATOMS"}  # the 32-lane shared-memory / shuffle path


def pipe_of(opcode: str) -> str:
    """'alu', 'fma', 'lsu', 'tensor', 'xu', 'uniform' (the U* datapath) or 'other' (branches, barriers, S2R...)."""
    name = opcode.split(".")[0]
    for pipe, names in PIPES.items():
        if name in names:
            return pipe
    if name.startswith("U") and name not in ("UNKNOWN",):
        return "uniform"
    return "other"


def shared_wavefronts(opcode: str) -> int:
    """Shared-memory wavefronts of one warp instruction without bank conflicts (128 bytes a clock)."""
    name, *mods = opcode.split(".")
    if name not in SHARED_OPS:
        return 0
    return {"64": 2, "128": 4}.get(next((m for m in mods if m in ("64", "128")), ""), 1)


# --- disassembly and the main loop -------------------------------------------------------------------------------

def tool(name: str) -> str:
    """A CUDA binary utility: Triton's bundled one, else the nvidia-cuda-* wheels', else PATH."""
    import shutil

    import triton

    candidates = [Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name]
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(Path(root).glob(f"*/bin/{name}"))
    except ImportError:
        pass
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found (pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump)")
    return found


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout


_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*(.*?)\s*;?\s*$")


def instructions(sass: str) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """[(opcode with modifiers, operands)] of nvdisasm -c output and {label: index of its first instruction}."""
    labels, insns = {}, []
    for line in sass.splitlines():
        s = line.strip()
        m = re.match(r"^(\.L_x_\d+):", s)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if m:
            insns.append((m.group(2), m.group(3)))
    return insns, labels


SPIN_OPS = ("SYNCS", "UBLKCP", "UTMALDG")


def loops(sass: str) -> list[list[str]]:
    """Opcodes of every innermost loop: a block from a label to a branch back to it, holding no other such branch.
    Short loops (at most 12 instructions) that spin on an mbarrier (SYNCS) or walk the lanes of a bulk copy issued
    with per-lane operands (UBLKCP or UTMALDG under BRA.U.ANY: one copy a trip) are not loops here: they count in
    their loop once, so such a loop's static count misses the extra trips."""
    insns, labels = instructions(sass)
    found = []
    for end, (op, rest) in enumerate(insns):
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op.split(".")[0] == "BRA" and target and target.group(1) in labels:
            start = labels[target.group(1)]
            spin = end - start < 12 and any(o.startswith(SPIN_OPS) for o, _ in insns[start:end + 1])
            if start < end and not spin:
                found.append((start, end))
    inner = [(s, e) for s, e in found if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in found)]
    return [[op for op, _ in insns[s:e + 1]] for s, e in inner]


def main_loop(sass: str) -> list[str]:
    """The innermost loop with the most tensor-core instructions, then the most instructions."""
    found = loops(sass)
    if not found:
        raise ValueError("no loop (backward branch) in the SASS")
    return max(found, key=lambda body: (sum(pipe_of(o) == "tensor" for o in body), len(body)))


def histogram(body: list[str], weights: float) -> dict:
    """Opcode histogram and per-pipe totals of a loop body, absolute and per weight."""
    ops = Counter(body)
    pipes = Counter()
    for op, n in ops.items():
        pipes[pipe_of(op)] += n
    imad = sum(n for op, n in ops.items() if op.split(".")[0] in ("IMAD", "IMUL", "IMAD32I", "IMUL32I"))
    fp32 = pipes["fma"] - imad
    shared = sum(n for op, n in ops.items() if op.split(".")[0] in SHARED_OPS)
    wavefronts = sum(n * shared_wavefronts(op) for op, n in ops.items())
    per = {p: pipes[p] / weights for p in ("alu", "fma", "lsu", "tensor", "xu", "uniform", "other")}
    per.update(imad=imad / weights, fp32=fp32 / weights, shared=shared / weights,
               shared_wavefronts=wavefronts / weights, total=len(body) / weights)
    return {"weights": weights, "instructions": len(body), "pipes": dict(pipes), "per_weight": per,
            "opcodes": dict(ops.most_common())}


# --- building a launch offline ----------------------------------------------------------------------------------

def source_spec(kernel, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch with arguments `args` (by parameter name), as Triton's JIT
    specialises them (experiments.sm75.source_spec): pointers given as type strings ("*bf16") are assumed 16-byte
    aligned."""
    from experiments.sm75 import source_spec as spec

    missing = [p.name for p in kernel.params if p.name not in args]
    if missing:
        raise TypeError(f"{kernel.__name__}: no value for {missing}")
    s = spec(kernel, [args[p.name] for p in kernel.params], {})
    return s["signature"], s["constexprs"], s["attrs"]


def compile_offline(kernel, args: dict, num_warps: int, arch: int = 90, fp_fusion: bool = False):
    """The compiled launch (Triton's CompiledKernel: .asm['cubin'], ['ptx'], .metadata)."""
    import triton
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    signature, constexprs, attrs = source_spec(kernel, args)
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})


def registers(cubin: bytes) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups()), strict=True)) if m else {}


def count_sass(kernel, args: dict, num_warps: int, unit, arch: int = 90) -> dict:
    """Compile one launch for sm_<arch> and count its main loop (see the module doc). unit: weights per loop body,
    or (opcode prefix, weights per instruction with that prefix)."""
    compiled = compile_offline(kernel, args, num_warps, arch)
    sass = disassemble(compiled.asm["cubin"])
    body = main_loop(sass)
    if isinstance(unit, (tuple, list)):
        prefix, per = unit
        n = sum(1 for op in body if op == prefix or op.startswith(prefix + "."))
        if not n:
            raise ValueError(f"no {prefix} in the main loop")
        weights = n * per
    else:
        weights = float(unit)
    out = histogram(body, weights)
    out.update(kernel=kernel.__name__, arch=f"sm_{arch}", num_warps=num_warps, **registers(compiled.asm["cubin"]))
    out["shared_bytes_triton"] = int(compiled.metadata.shared)
    return out


# --- the lab's builds -------------------------------------------------------------------------------------------

N_DEMO, K_DEMO = 14336, 4096  # the weight the counts are built for (M = 1): only divisibility hints depend on it


def baseline_args(ntile: int = 1, dtype: str = "bf16") -> dict:
    """nf4_gemv_mma_kernel's arguments at the table's M = 1 config (4 warps, HALF 32, split-K partials)."""
    kb = K_DEMO // 2
    return {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32",
            "code2_ptr": "*fp32", "offset_ptr": "*fp32", "code_ptr": "*fp32", "bias_ptr": "*fp32",
            "out_ptr": "*fp32", "zero_ptr": "*fp32", "M": 1, "N": N_DEMO, "K": K_DEMO, "KB": kb,
            "BLOCKSIZE": 64, "DOUBLE_QUANT": True, "FTZ": True, "X_DT": 2 if dtype == "bf16" else 1,
            "HAS_BIAS": False, "THREADS": 128, "HALF": 32, "NTILE": ntile, "SPLIT": 2, "SEG": kb // 2,
            "PARTIAL": True, "BF16_BITS": False, "WARPS_K": 1}


def lab_args(mode: str, prmt_words: int = 0, copies: int = 16, ntile: int = 1, dtype: str = "bf16",
             num_warps: int = 4) -> dict:
    from .kernels import MODES, pair_shift

    kb = K_DEMO // 2
    return {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32",
            "code2_ptr": "*fp32", "offset_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": "*fp32",
            "M": 1, "N": N_DEMO, "KB": kb, "SPLIT": 2, "SEG": kb // 2, "TILES": 448, "ONE": 1,
            "MODE": MODES[mode], "PRMT_WORDS": prmt_words, "COPIES": copies, "SHIFT": pair_shift(copies),
            "X_DT": 2 if dtype == "bf16" else 1, "NTILE": ntile, "THREADS": 32 * num_warps, "PARTIAL": True,
            "FTZ": True, "FULLSEC": 0, "XPRED": 0}


BASELINE_MODULES = ("nf4.linear.gemv_mma", "nf4.linear.kernel")  # where nf4_gemv_mma_kernel has lived


def _baseline_kernel():
    """The product's tensor-core GEMV kernel, wherever the restructured nf4.linear keeps it."""
    import importlib
    import pkgutil

    package = importlib.import_module("nf4.linear")  # (the attribute nf4.linear may be the function)
    names = list(BASELINE_MODULES) + [f"nf4.linear.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    for name in dict.fromkeys(names):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nf4_gemv_mma_kernel"):
            return module.nf4_gemv_mma_kernel
    raise ImportError("nf4_gemv_mma_kernel not found in nf4.linear")


@triton.jit
def tiny_loop_kernel(in_ptr, out_ptr, n, ASM: tl.constexpr):
    """A known loop for the counter's test: per iteration one load, two dependent PRMT and one FMUL (its unit)."""
    i = tl.arange(0, 128)
    acc = tl.zeros((128,), dtype=tl.float32)
    for r in range(n):
        v = tl.load(in_ptr + r * 128 + i)
        acc = tl.inline_asm_elementwise(ASM, "=r,r,r", [v, acc], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(out_ptr + i, acc)


TINY_ASM = ("{ .reg .b32 p, q; prmt.b32 p, $1, $2, 0x5140; prmt.b32 q, p, $1, 0x7362; mov.b32 $0, q; "
            "mul.rn.ftz.f32 $0, $0, $2; }")


def _tiny_kernel():
    return tiny_loop_kernel


def _lab_kernel():
    from .kernels import lab_gemv_kernel

    return lab_gemv_kernel


def _product_pair_kernel():
    from nf4.linear.gemv_pair import nf4_gemv_pair_kernel

    return nf4_gemv_pair_kernel


_POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "uint8": "*u8"}


def product_args(kernel: str = "gemv_pair", m: int = 1, dtype: str = "bf16", **fields):
    """A callable giving the arguments nf4.linear's own launch builds (nf4.linear.launch.kernel_args, as on an
    sm_80+ GPU: ASM on, split-K 2 as in baseline_args) for kernel `kernel` at M rows on the N_DEMO x K_DEMO
    weight (blocksize 64, nested), pointers as type strings; evaluated when the build runs (it imports nf4)."""

    def build() -> dict:
        import torch

        from nf4 import NF4Weight
        from nf4.linear import LinearConfig, launch

        dt = torch.bfloat16 if dtype == "bf16" else torch.float16
        n, k = N_DEMO, K_DEMO
        w = NF4Weight(torch.empty(64, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8), torch.empty(16),
                      torch.empty(256), torch.empty(()), (n, k), 64, dt, True)
        config = LinearConfig(kernel=kernel, **{"split_k": 2, **fields})
        (_, _, args, _), *_ = launch.kernel_args(torch.empty((m, k), dtype=dt), w, None,
                                                  torch.empty((m, n), dtype=dt), m, config, True, False,
                                                  torch.empty(1))
        return {name: _POINTER[str(v.dtype).removeprefix("torch.")] if isinstance(v, torch.Tensor) else v
                for name, v in args.items()}

    return build


def _stream_kernel():
    from .stream import lab_gemv2_kernel

    return lab_gemv2_kernel


def _staged_kernel():
    from .staged import lab_staged_kernel

    return lab_staged_kernel


def _deep_kernel():
    from .deep import lab_deep_kernel

    return lab_deep_kernel


def _scaled_kernel():
    from .scaled import lab_scaled_kernel

    return lab_scaled_kernel


def scaled_args() -> dict:
    """Arguments of the scaled-contract GEMV (scaled.py) at M = 1, bf16, split 2, 4 warps."""
    from .scaled import table_shift

    kb = K_DEMO // 2
    return {"x_ptr": "*bf16", "packed_ptr": "*u8", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32",
            "offset_ptr": "*fp32", "lev_ptr": "*i32", "out_ptr": "*fp32", "M": 1, "N": N_DEMO, "KB": kb, "SPLIT": 2,
            "SEG": kb // 2, "ONE": 1, "X_DT": 2, "THREADS": 128, "SHIFT": table_shift(), "PARTIAL": True,
            "FTZ": True}


def _bulk_kernel():
    from .bulk import lab_bulk_kernel

    return lab_bulk_kernel


def bulk_args(mode: str, shape: int, copies: int = 1, ntile: int = 1) -> dict:
    """Arguments of the bulk-copy skeleton (bulk.py) at M = 1, bf16, split 2, for SHAPES[shape]."""
    from .bulk import SHAPES

    stages, warps, sps, tensor = SHAPES[shape]
    args = skeleton_args(mode, copies=copies, warps=warps, stages=stages, ntile=ntile)
    args.update(SHAPE=shape, SPS=sps, TENSOR=tensor, tmap_ptr="*u8", NOX=0, XPRED=0)
    return args


def skeleton_args(mode: str, copies: int = 1, warps: int = 4, xpre: bool | None = None, stages: int | None = None,
                  ntile: int = 1) -> dict:
    """Arguments of the second (stream.py, XPRE) and third (staged.py, STAGES) skeletons at M = 1, bf16, split 2."""
    from .kernels import MODES, pair_shift

    kb = K_DEMO // 2
    args = {"x_ptr": "*bf16", "packed_ptr": "*u8", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32",
            "offset_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
            "M": 1, "N": N_DEMO, "KB": kb, "SPLIT": 2, "SEG": kb // 2, "ONE": 1, "MODE": MODES[mode],
            "COPIES": copies, "SHIFT": pair_shift(copies), "X_DT": 2, "NTILE": ntile, "THREADS": 32 * warps,
            "FTZ": True, "PARTIAL": True}
    if xpre is None and stages is None:  # deep.py
        args.update(TILES=896)
    elif stages is None:
        args.update(PRMT_WORDS=0, XPRE=bool(xpre))
    else:
        args.update(STAGES=stages)
    return args


# name -> (kernel getter, args, num_warps, unit, what it is)
BUILDS = {
    "tiny": (_tiny_kernel, {"in_ptr": "*u32", "out_ptr": "*fp32", "n": 7, "ASM": TINY_ASM}, 4, ("FMUL", 1),
             "test kernel: 2 PRMT + 1 FMUL per iteration"),
    "baseline": (_baseline_kernel, baseline_args(), 4, ("HMMA", 8), "nf4_gemv_mma_kernel (product), M=1 config"),
    "prmt": (_lab_kernel, lab_args("prmt"), 4, ("HMMA", 8), "lab skeleton with the product's prmt decode"),
    "pair16": (_lab_kernel, lab_args("pair"), 4, ("HMMA", 8), "(c) level-pair table, 16 copies, IMAD.HI address"),
    "pair8": (_lab_kernel, lab_args("pair", copies=8), 4, ("HMMA", 8), "(c) level-pair table, 8 copies"),
    "level_prmt": (_lab_kernel, lab_args("level_prmt"), 4, ("HMMA", 8), "(a) 16-level table, PRMT address"),
    "level_imad": (_lab_kernel, lab_args("level_imad"), 4, ("HMMA", 8), "(a') 16-level table, IMAD.HI address"),
    "pair16_p2": (_lab_kernel, lab_args("pair", prmt_words=2), 4, ("HMMA", 8),
                  "(d) pair table, 2 of 8 words by prmt"),
    "pair16_p1": (_lab_kernel, lab_args("pair", prmt_words=1), 4, ("HMMA", 8),
                  "(d) pair table, 1 of 8 words by prmt"),
    "pair16_p3": (_lab_kernel, lab_args("pair", prmt_words=3), 4, ("HMMA", 8),
                  "(d) pair table, 3 of 8 words by prmt"),
    "pair16_p4": (_lab_kernel, lab_args("pair", prmt_words=4), 4, ("HMMA", 8),
                  "(d) pair table, 4 of 8 words by prmt"),
    "pair16_m16": (_lab_kernel, lab_args("pair", ntile=2), 4, ("HMMA", 4), "(c) pair table, M <= 16 (2 tiles)"),
    "pair16_fp16": (_lab_kernel, lab_args("pair", dtype="fp16"), 4, ("HMMA", 8), "(c) pair table, fp16"),
    "gemv_pair": (_product_pair_kernel, product_args(), 4, ("HMMA", 8),
                  "nf4_gemv_pair_kernel (product, kernel gemv_pair): (c) as nf4.linear launches it, M = 1"),
    "gemv_pair_m16": (_product_pair_kernel, product_args(m=16, dtype="fp16"), 4, ("HMMA", 4),
                      "nf4_gemv_pair_kernel, M = 16 (2 tiles), fp16"),
    "s_none": (_stream_kernel, skeleton_args("none", xpre=True), 4, ("HMMA", 8),
               "second skeleton (stream.py), no decode, x prefetched"),
    "s_prmt": (_stream_kernel, skeleton_args("prmt", xpre=True), 4, ("HMMA", 8),
               "second skeleton, prmt decode, x prefetched"),
    "c_none3": (_staged_kernel, skeleton_args("none", stages=3), 4, ("HMMA", 8),
                "third skeleton (staged.py), no decode, 3 cp.async stages"),
    "d_none": (_deep_kernel, skeleton_args("none"), 4, ("HMMA", 8), "fourth skeleton (deep.py), no decode"),
    "d_pair16": (_deep_kernel, skeleton_args("pair", copies=16), 4, ("HMMA", 8),
                 "fourth skeleton, pair table (16 copies)"),
    "c_prmt3": (_staged_kernel, skeleton_args("prmt", stages=3), 4, ("HMMA", 8),
                "third skeleton, prmt decode, 3 cp.async stages"),
    "b_none": (_bulk_kernel, lambda: bulk_args("none", 0), 2, ("HMMA", 8),
               "bulk-copy skeleton (bulk.py), no decode, 4 stages of 2 steps, 2 warps"),
    "b_prmt": (_bulk_kernel, lambda: bulk_args("prmt", 0), 2, ("HMMA", 8),
               "bulk-copy skeleton, prmt decode, 4 stages of 2 steps, 2 warps"),
    "b_pair8": (_bulk_kernel, lambda: bulk_args("pair", 1, copies=8), 2, ("HMMA", 8),
                "bulk-copy skeleton, pair table (8 copies), 3 stages of 2 steps, 2 warps"),
    "scaled": (_scaled_kernel, scaled_args, 4, ("HMMA", 8),
               "second contract (scaled.py): constant level-pair table, the block's scale on float32 partials"),
    "t_none8": (_bulk_kernel, lambda: bulk_args("none", 6), 2, ("HMMA", 8),
                "bulk-copy skeleton with tensor copies, no decode, 8 stages of 1 step, 2 warps"),
    "t_stream8": (_bulk_kernel, lambda: {**bulk_args("none", 6), "MODE": 5}, 2, 1,
                  "bulk-copy skeleton with tensor copies, the stream control (no absmax, x or products)"),
    "t_prmt8": (_bulk_kernel, lambda: bulk_args("prmt", 6), 2, ("HMMA", 8),
                "bulk-copy skeleton with tensor copies, prmt decode, 8 stages of 1 step, 2 warps"),
}
DEFAULT_BUILDS = ("baseline", "prmt", "pair16", "pair8", "level_prmt", "level_imad", "pair16_p2", "pair16_p4",
                  "pair16_m16")


def count_build(name: str, arch: int = 90) -> dict:
    getter, args, num_warps, unit, what = BUILDS[name]
    try:
        out = count_sass(getter(), args() if callable(args) else args, num_warps, unit, arch)
    except Exception as exc:  # a build that does not compile is a result too
        return {"build": name, "what": what, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"build": name, "what": what, **out}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def count_builds(names=DEFAULT_BUILDS, arch: int = 90, timeout: int = 1200) -> list[dict]:
    """count_build for each name; in a child process without TRITON_INTERPRET when it is on."""
    if not _interpreting():
        return [count_build(n, arch) for n in names]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.json")
        subprocess.run([sys.executable, "-m", "experiments.labs.sass_count", "--arch", str(arch), "--json", out,
                        "--quiet", *names], env=env, check=True, timeout=timeout,
                       cwd=str(Path(__file__).resolve().parents[2]))
        return json.loads(Path(out).read_text())["builds"]


def table(rows: list[dict]) -> str:
    head = (f"{'build':<12} {'regs':>4} {'ALU':>5} {'FMA':>5} {'IMAD':>5} {'FP32':>5} {'LSU':>5} {'LDS':>5} "
            f"{'wavef':>5} {'HMMA':>5} {'other':>5} {'total':>6}  top ALU opcodes")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['build']:<12} ERROR {r['error'][:150]}")
            continue
        p = r["per_weight"]
        alu = Counter({op: n for op, n in r["opcodes"].items() if pipe_of(op) == "alu"})
        top = ", ".join(f"{op} {n / r['weights']:.3f}" for op, n in alu.most_common(4))
        lines.append(f"{r['build']:<12} {r.get('registers', 0):>4} {p['alu']:5.3f} {p['fma']:5.3f} {p['imad']:5.3f} "
                     f"{p['fp32']:5.3f} {p['lsu']:5.3f} {p['shared']:5.3f} {p['shared_wavefronts']:5.3f} "
                     f"{p['tensor']:5.3f} {p['other'] + p['uniform'] + p['xu']:5.3f} {p['total']:6.3f}  {top}")
    lines.append("per weight per thread in the main K loop (sm_90 SASS); LDS: shared loads + shuffles; wavef: their "
                 "conflict-free shared wavefronts (LDS.64 = 2)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.sass_count", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", default=list(DEFAULT_BUILDS), help=f"of {sorted(BUILDS)}")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", default=None, help="write the counts here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    rows = count_builds(args.builds, args.arch)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        from verify.timing import environment

        payload = {"arch": args.arch, "environment": environment(), "builds": rows}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if not args.quiet:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
