"""What limits nf4.linear at one row of x: the tensor-core word GEMV split into its memory side and its decode.

    python -m experiments gemv-limit --out results/linear/gemv_limit_h100.json

GPU only. For each weight (default: the three weights of the M = 1 bars) and the table's M = 1 config, in
one run, with rotating weights and CUDA-graph device time:
- `production`: `nf4.linear` at M = 1 with that config (nf4_gemv_mma_kernel), checked on its operand first
  (x the identity row e_0: the output equals column 0 of nf4.dequantize(W), bit for bit);
- `loads`: the same grid, warps and lanes reading the same bytes in the same order (each step's words of two
  rows, their absmax through both levels of double quantization, x's words), the values folded together
  with XOR and one word per thread stored: the kernel's memory traffic and address arithmetic without the
  decode or the products;
- `decode`: the same loop with the packed bytes and absmax held in registers (the first step's, each step
  XOR-ing its words with the step's offset and the absmax bits with its parity so that nothing is hoisted out
  of the loop): the product tables, the prmt lookups, x's loads (from L1) and the mma.sync products, without
  reading the weight from DRAM;
- the byte floor (bench-linear's: the packed weight, its absmax, x and the output at the copy bandwidth measured in
  the same run).
Neither probe kernel is exact (they compute nothing the user wants); they run only here and are not
variants of the registry, whose variants are operand-exact before they are timed.

Offline, on any machine, `sass_mix` compiles the production launch for the GPU's architecture and counts
the SASS instructions of its main loop by opcode (nvdisasm, bundled with Triton): what one step of one warp
issues for its 16 rows x 4 * HALF bytes. The result file carries both, so that the paper can put the
decode's instruction count beside its measured time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
import triton.language as tl

from nf4 import NF4Weight
from nf4.device import load_v4, product_table
from nf4.linear import config as linear_config
from nf4.linear import launch as linear_launch
from nf4.linear import tuned as linear_tuned
from nf4.linear.gemv_mma import mma_absmax, mma_tile, mma_words
from verify import timing

from .bench_linear import floors, make_weights, mismatches

DEFAULT_SHAPES = ("14336x4096", "4096x14336", "4096x4096")
X_DT = {torch.float16: 1, torch.bfloat16: 2}  # the kernels' dtype codes
# part -> gemv_limit_kernel's switches (MODE, ROTATE, STREAM, ABSMAX, XLOAD) and changes to the table's config
_BASE = {"MODE": 3, "ROTATE": False, "STREAM": True, "ABSMAX": True, "XLOAD": True}
MODES: dict[str, tuple[dict, dict]] = {
    "loads": ({"MODE": 1}, {}),
    "decode": ({"MODE": 2}, {}),
    "both": ({}, {}),
    "loads, rotated": ({"MODE": 1, "ROTATE": True}, {}),
    "both, rotated": ({"ROTATE": True}, {}),
    "loads, kept in L1": ({"MODE": 1, "STREAM": False}, {}),
    "loads, no absmax": ({"MODE": 1, "ABSMAX": False}, {}),
    "loads, no x": ({"MODE": 1, "XLOAD": False}, {}),
    "loads, weight words only": ({"MODE": 1, "ABSMAX": False, "XLOAD": False}, {}),
    "loads, 16-byte lanes": ({"MODE": 1}, {"step_bytes": 16}),
    "loads, warps_k 1 (16 steps a warp)": ({"MODE": 1}, {"warps_k": 1, "block_r": 128}),
    "both, warps_k 1 (16 steps a warp)": ({}, {"warps_k": 1, "block_r": 128}),
}


@triton.jit
def _fold4(sink, a0, a1, a2, a3):
    return sink ^ a0 ^ a1 ^ a2 ^ a3


@triton.jit
def _xor8(v0, v1, v2, v3, v4, v5, v6, v7, step):
    return v0 ^ step, v1 ^ step, v2 ^ step, v3 ^ step, v4 ^ step, v5 ^ step, v6 ^ step, v7 ^ step


@triton.jit
def _products(a0, a1, a2, a3, b0, b1, b2, b3, xp, amax_a, amax_b, c0, c1, c2, c3, c4, c5, c6, c7,
              FTZ: tl.constexpr, X_DT: tl.constexpr):
    """One 16-byte tile of the lane's two rows looked up in their blocks' product tables and multiplied with x's
    pairs at xp on the tensor cores (nf4_gemv_mma_kernel's step for one 8-row tile of x)."""
    ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7 = product_table(amax_a, FTZ, X_DT)
    tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = product_table(amax_b, FTZ, X_DT)
    z = tl.zeros_like(c0)
    r = mma_tile(a0, a1, a2, a3, b0, b1, b2, b3, xp, xp, xp, xp, ta0, ta1, ta2, ta3, ta4, ta5, ta6, ta7, tb0, tb1, tb2,
                  tb3, tb4, tb5, tb6, tb7, c0, c1, c2, c3, c4, c5, c6, c7, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
                  z, z, z, z, z, z, z, z, z, X_DT, 1)
    return r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]


@triton.jit
def _fetch(wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE: tl.constexpr,
           DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, NSUB: tl.constexpr, STREAM: tl.constexpr,
           ABSMAX: tl.constexpr):
    """nf4.linear.gemv_mma.mma_fetch with its two switches: STREAM (the weight's words not kept in L1, as there) and
    ABSMAX (read both rows' absmax through both levels, as there; else 1.0 without a read)."""
    a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = mma_words(wa, wb, j, NSUB, STREAM)
    if ABSMAX:
        amax_a, amax_b = mma_absmax(ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                    BLOCKSIZE, DOUBLE_QUANT, FTZ)
    else:
        amax_a = tl.full(ra.shape, 1.0, tl.float32)
        amax_b = amax_a
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, amax_a, amax_b


@triton.jit
def gemv_limit_kernel(x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, zero_ptr, N, KB,
                      BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr, FTZ: tl.constexpr, X_DT: tl.constexpr,
                      THREADS: tl.constexpr, HALF: tl.constexpr, WARPS_K: tl.constexpr, MODE: tl.constexpr,
                      ROTATE: tl.constexpr, STREAM: tl.constexpr, ABSMAX: tl.constexpr, XLOAD: tl.constexpr):
    """nf4_gemv_mma_kernel's loop for one row of x (NTILE 1, SPLIT 1). MODE bit 1: each step reads the next step's
    weight bytes and absmax from memory (else it XORs the held ones with the step's offset); bit 2: each step
    decodes and multiplies (else its words, absmax and x are XOR-ed into one word). MODE 3 is the production
    loop's work. ROTATE: program p takes its steps in the order p, p + 1, ... (mod the steps of a warp) instead of
    0, 1, ...: at any moment the programs read different columns of their rows. STREAM, ABSMAX: `_fetch`'s.
    XLOAD (without DECODE): x's words read too. out: one word per thread."""
    LOADS: tl.constexpr = MODE % 2 == 1
    DECODE: tl.constexpr = MODE // 2 == 1
    NSUB: tl.constexpr = HALF // 16
    STEP: tl.constexpr = 4 * HALF
    GROUPS: tl.constexpr = THREADS // (32 * WARPS_K)
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    KW = KB // 4
    pid = tl.program_id(0)
    i = tl.arange(0, THREADS)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    row0 = pid * (16 * GROUPS)
    row_a = row0 + (i // (32 * WARPS_K)) * 16 + g
    ra = tl.minimum(row_a, N - 1)
    rb = tl.minimum(row_a + 8, N - 1)
    wa = words_ptr + ra * KW
    wb = words_ptr + rb * KW
    always = i >= 0
    kw = (i // 32) % WARPS_K
    zw = zero_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    ROUND: tl.constexpr = STEP * WARPS_K  # bytes of a row the program's warps take per iteration
    n_it = tl.cdiv(KB, ROUND)
    rot = pid % n_it if ROTATE else 0
    j = tl.minimum(rot * ROUND + kw * STEP, KB - STEP) + t * HALF
    (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a, next_b) = _fetch(
        wa, wb, ra, rb, j, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE, DOUBLE_QUANT, FTZ,
        NSUB, STREAM, ABSMAX)
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    sink = tl.zeros((THREADS,), dtype=tl.uint32)
    for it in range(0, n_it):
        a0, a1, a2, a3, a4, a5, a6, a7 = na0, na1, na2, na3, na4, na5, na6, na7
        b0, b1, b2, b3, b4, b5, b6, b7 = nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7
        amax_a, amax_b = next_a, next_b
        here = (it + rot) % n_it
        after = (it + 1 + rot) % n_it if it + 1 < n_it else here  # the last step re-reads itself, unused
        s = here * ROUND + kw * STEP
        j = tl.minimum(s, KB - STEP) + t * HALF
        jn = tl.minimum(after * ROUND + kw * STEP, KB - STEP) + t * HALF
        xp = tl.where(s < KB, xw_ptr + j, zw)
        if LOADS:
            (na0, na1, na2, na3, na4, na5, na6, na7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, next_a,
             next_b) = _fetch(wa, wb, ra, rb, jn, KB, always, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                               BLOCKSIZE, DOUBLE_QUANT, FTZ, NSUB, STREAM, ABSMAX)
        else:
            step = s.to(tl.uint32)
            na0, na1, na2, na3, na4, na5, na6, na7 = _xor8(a0, a1, a2, a3, a4, a5, a6, a7, step)
            nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7 = _xor8(b0, b1, b2, b3, b4, b5, b6, b7, step)
            parity = step & 1
            next_a = (amax_a.to(tl.uint32, bitcast=True) ^ parity).to(tl.float32, bitcast=True)
            next_b = (amax_b.to(tl.uint32, bitcast=True) ^ parity).to(tl.float32, bitcast=True)
        if DECODE:
            c0, c1, c2, c3, c4, c5, c6, c7 = _products(a0, a1, a2, a3, b0, b1, b2, b3, xp, amax_a, amax_b, c0, c1, c2,
                                                       c3, c4, c5, c6, c7, FTZ, X_DT)
            if NSUB == 2:
                c0, c1, c2, c3, c4, c5, c6, c7 = _products(a4, a5, a6, a7, b4, b5, b6, b7, xp + 16, amax_a, amax_b,
                                                           c0, c1, c2, c3, c4, c5, c6, c7, FTZ, X_DT)
        else:
            sink = _fold4(sink, a0, a1, a2, a3)
            sink = _fold4(sink, b0, b1, b2, b3)
            if NSUB == 2:
                sink = _fold4(sink, a4, a5, a6, a7)
                sink = _fold4(sink, b4, b5, b6, b7)
            sink = sink ^ amax_a.to(tl.uint32, bitcast=True) ^ amax_b.to(tl.uint32, bitcast=True)
            if XLOAD:
                for q in tl.static_range(4 * NSUB):  # x's words at this lane's bytes, as the products read them
                    x0, x1, x2, x3 = load_v4(xp + 4 * q, False)
                    sink = _fold4(sink, x0, x1, x2, x3)
    if DECODE:
        y = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
        sink = y.to(tl.uint32, bitcast=True)
    tl.store(out_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + pid * THREADS + i, sink)


# One warp instruction per line, 8 independent chains (outputs $0-$7 from inputs $8-$15, $16 a register operand
# ptxas cannot fold): what the SMs issue of each opcode class the GEMV's loop is made of.
_PIPE_OPS = {
    "prmt": "prmt.b32 $%d, $%d, $%d, $16;",
    "lop3": "lop3.b32 $%d, $%d, $%d, $16, 0x96;",
    "shf": "shf.l.wrap.b32 $%d, $%d, $%d, $16;",
    "imad": "mad.lo.u32 $%d, $%d, $%d, $16;",
    "fmul": "mul.rn.f32 $%d, $%d, $%d;",
}
PIPE_ASM = {name: " ".join(op % (k, 8 + k, 8 + (k + 1) % 8) if op.count("%d") == 3 else op for k in range(8))
            for name, op in _PIPE_OPS.items()}


@triton.jit
def pipe_kernel(in_ptr, out_ptr, reps, ASM: tl.constexpr, THREADS: tl.constexpr):
    """`reps` times 8 independent instructions of one opcode per thread (PIPE_ASM), chained through registers."""
    i = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    a = tl.load(in_ptr + i)
    v0, v1, v2, v3, v4, v5, v6, v7 = a, a ^ 1, a ^ 2, a ^ 3, a ^ 4, a ^ 5, a ^ 6, a ^ 7
    sel = a & 0x7531
    for _ in range(reps):
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [v0, v1, v2, v3, v4, v5, v6, v7, sel],
            dtype=(tl.uint32,) * 8, is_pure=True, pack=1)
    tl.store(out_ptr + i, v0 ^ v1 ^ v2 ^ v3 ^ v4 ^ v5 ^ v6 ^ v7)


def pipe_rates(reps: int = 4096, log=print) -> list[dict]:
    """Warp instructions per clock per multiprocessor of each opcode in PIPE_ASM (8 warps per program, 8 programs
    per multiprocessor), the clock read from the SM clock counter around the run being the GPU's current one:
    the rate is reported per nanosecond as well, which needs no clock."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads, programs = 256, 8 * sms
    src = torch.randint(0, 2**31 - 1, (programs * threads,), dtype=torch.int32, device="cuda").view(torch.uint32)
    out = torch.empty_like(src)
    rows = []
    for name, asm in PIPE_ASM.items():
        def call(_, asm=asm):
            pipe_kernel[(programs,)](src, out, reps, ASM=asm, THREADS=threads, num_warps=8)

        t = timing.device_time_us(call, [None], reps=20)["median_us"]
        warp_instr = programs * (threads // 32) * reps * 8
        per_ns = warp_instr / sms / (t * 1e3)
        rows.append({"op": name, "us": t, "warp_instr_per_ns_per_sm": per_ns})
        log(f"  pipe {name:<5} {t:9.1f} us  {per_ns:6.2f} warp instructions per ns per SM", flush=True)
    return rows


def _probe_args(x, packed, w, out, dummy, config: linear_config.LinearConfig, mode: str) -> tuple[dict, dict]:
    """gemv_limit_kernel's arguments (by name) and launch options for `config`'s lanes and warps."""
    args = {"x_ptr": x, "packed_ptr": packed, "absmax_ptr": w.absmax,
            "absmax2_ptr": w.absmax2 if w.nested else dummy, "code2_ptr": w.code2 if w.nested else dummy,
            "offset_ptr": w.offset if w.nested else dummy, "out_ptr": out, "zero_ptr": dummy, "N": w.shape[0],
            "KB": w.shape[1] // 2,
            "BLOCKSIZE": w.blocksize, "DOUBLE_QUANT": w.nested, "FTZ": True, "X_DT": X_DT[x.dtype],
            "THREADS": 32 * config.num_warps, "HALF": min(w.blocksize // 2, config.step_bytes, 32),
            "WARPS_K": config.warps_k, **_BASE, **MODES[mode][0]}  # fmt: skip
    return args, {"num_warps": config.num_warps}


def probe_launch(x, packed, qs, config: linear_config.LinearConfig, mode: str):
    """A callable launching gemv_limit_kernel in `mode` on (x, packed, qs) with `config`'s grid and lanes (as the
    part changes them)."""
    config = config.with_(**MODES[mode][1])
    w = NF4Weight.from_state(packed, qs)
    programs = triton.cdiv(w.shape[0], config.block_r)
    out = torch.empty(programs * 32 * config.num_warps, dtype=torch.int32, device=x.device)
    dummy = torch.zeros(64, dtype=torch.float32, device=x.device)  # absent tensors; 256 bytes of zeros for x
    args, options = _probe_args(x, packed, w, out, dummy, config, mode)

    def launch(_):
        gemv_limit_kernel[(programs,)](**args, **options)
        return out

    return launch


def _sass_of(fn, args: dict, options: dict, arch: int) -> dict:
    """Registers and the main loop's SASS opcodes of one launch compiled offline for sm_<arch>."""
    from triton.backends.compiler import GPUTarget

    from nf4 import runtime

    from . import sm75

    spec = sm75.source_spec(fn, runtime.positional(fn, args), {**options, "enable_fp_fusion": True})
    src = triton.compiler.ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                                    attrs=spec["attrs"])
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec["options"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([sm75._tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([sm75._tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    loop = _main_loop(sass)
    regs = re.search(r"REG:(\d+)", res)
    return {"kernel": fn.__name__, "num_warps": options["num_warps"], "registers": int(regs.group(1)) if regs else None,
            "loop_instructions": len(loop), "loop_opcodes": dict(Counter(loop).most_common()),
            "wgmma_waits": wgmma_waits(sass), "wgmma_serialized": _ptxas_serialized(compiled.asm["ptx"], arch)}


def wgmma_serialized(log: str) -> str:
    """ptxas's reason for serializing a kernel's wgmma (its C7515 note under -v: "... wgmma.mma_async
    instructions are serialized due to <reason> in the function ..."), "" where its log gives none."""
    found = re.search(r"C7515\).*?serialized due to (.*?) in the function", " ".join(log.split()))
    return found.group(1) if found else ""


def _ptxas_serialized(ptx: str, arch: int) -> str | None:
    """wgmma_serialized of the PTX assembled again with -v by the ptxas bundled with Triton (the one that accepts
    the PTX's version); None where none could assemble it."""
    from . import sm75

    first = sm75._tool("ptxas")
    tools = [t for t in (first, first and os.path.join(os.path.dirname(first), "ptxas-blackwell")) if t]
    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for tool in tools:
            if not os.path.exists(tool):
                continue
            run = subprocess.run([tool, "-v", f"-arch={target}", path, "-o", os.path.join(tmp, "k.o")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                return wgmma_serialized(run.stdout + run.stderr)
    return None


def wgmma_waits(sass: str) -> dict[str, int]:
    """{groups left pending: count} of the kernel's wgmma waits (`WARPGROUP.DEPBAR.LE gsb0, 0xN`): a main loop that
    keeps its wgmma asynchronous waits with N > 0; ptxas serializes them (every wait 0) when it cannot."""
    return {str(int(n, 16)): c for n, c in sorted(Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)",
                                                                     sass)).items())}


def sass_mix(n: int, k: int, dtype, config: linear_config.LinearConfig, arch: int) -> dict:
    """The production launch at M = 1 and both probe modes compiled offline for sm_<arch> (any machine): for each,
    registers and the opcodes of its main loop (the block that branches back to itself), one step of one warp:
    16 rows x 4 * HALF packed bytes."""
    cpu = torch.device("cpu")
    x, packed = torch.empty((1, k), dtype=dtype, device=cpu), torch.empty(64, dtype=torch.uint8, device=cpu)
    # a stand-in weight (no bytes to read: the build needs dtypes and constexprs only); kernel_args launches the
    # config's kernel as it is (nf4_gemv_mma_kernel), with no check that it could run here
    w = NF4Weight(packed, torch.empty(16, dtype=torch.uint8), torch.empty(16), torch.empty(256), torch.empty(()),
                  (n, k), 64, dtype, True)
    (fn, grid, args, options), *_ = linear_launch.kernel_args(x, w, None, torch.empty((1, n), dtype=dtype), 1,
                                                              config, True, False, None)
    out = {"arch": f"sm_{arch}", "weight": f"{n}x{k}", "dtype": str(dtype).removeprefix("torch."),
           "grid": list(grid), "loop_bytes_per_warp": 16 * 4 * args["HALF"],
           "production": {**_sass_of(fn, args, options, arch), "loop_bytes_per_warp": 16 * 4 * args["HALF"]}}
    for mode in MODES:
        pargs, poptions = _probe_args(x, packed, w, torch.empty(16, dtype=torch.int32), torch.empty(64),
                                      config.with_(**MODES[mode][1]), mode)
        out[mode] = _sass_of(gemv_limit_kernel, pargs, poptions, arch)
        out[mode]["loop_bytes_per_warp"] = 16 * 4 * pargs["HALF"]
    return out


def _main_loop(sass: str) -> list[str]:
    """Opcodes (without modifiers) of the longest block that ends in a branch back to its own label."""
    labels, lines = {}, []
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(lines)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[^ ]*)?\s*(.*)$", line)
        if m:
            lines.append((m.group(1), m.group(3)))
    best: list[str] = []
    for end, (op, rest) in enumerate(lines):
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and target and target.group(1) in labels and labels[target.group(1)] <= end:
            body = [o for o, _ in lines[labels[target.group(1)]:end + 1]]
            if len(body) > len(best):
                best = body
    return best


def measure(shape: str, dtype, config, copy_gbs: float, log=print) -> list[dict]:
    """Graph device time of the production GEMV (operand-checked first) and of both probe modes on one weight."""
    import nf4

    n, k = (int(v) for v in shape.lower().split("x"))
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    x = torch.zeros((1, k), dtype=dtype, device="cuda")
    x[0, 0] = 1  # the identity row e_0: the output is column 0 of the operand
    base = {"N": n, "K": k, "M": 1, "dtype": str(dtype).removeprefix("torch."),
            "config": {f: getattr(config, f) for f in ("num_warps", "warps_k", "block_r", "step_bytes", "split_k")}}
    floor = floors(n, k, 1, torch.empty((), dtype=dtype).element_size(), copy_gbs)["byte_floor_us"]
    got = nf4.linear(x, sets[0][0], sets[0][1], config=config)
    want = nf4.dequantize(sets[0][0], sets[0][1])[:, 0].to(dtype)[None, :]
    g = timing.graph_time_us(lambda i: nf4.linear(x, *sets[i % len(sets)], config=config), list(range(len(sets))))
    rows = [{**base, "part": "production", "operand_mismatches": mismatches(got, want),
             "graph_us": g and g.get("median_us"), "byte_floor_us": floor}]
    for mode in MODES:
        calls = [probe_launch(x, p, qs, config, mode) for p, qs in sets]
        calls[0](None)
        g = timing.graph_time_us(lambda i, calls=calls: calls[i % len(calls)](None), list(range(len(calls))))
        rows.append({**base, "part": mode, "graph_us": g and g.get("median_us"), "byte_floor_us": floor})
    for r in rows:
        log(f"  {shape} {r['part']:<10} {r['graph_us'] or float('nan'):7.2f} us (byte floor {floor:.2f})"
            + (f", operand mismatches {r['operand_mismatches']}" if "operand_mismatches" in r else ""), flush=True)
    sets.clear()
    torch.cuda.empty_cache()
    return rows


def add_sass_arguments(ap: argparse.ArgumentParser, out: str) -> None:
    """The options gemv-limit and gemm-limit share: dtype, result file, --sass-only and the SASS target."""
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", default=out, help="result file (JSON)")
    ap.add_argument("--sass-only", action="store_true", help="only the offline SASS count (no GPU needed)")
    ap.add_argument("--arch", type=int, default=None, help="SASS target (default: the GPU's, else 90)")


def rerun_without_interpreter(module: str, argv) -> int | None:
    """Under TRITON_INTERPRET (python -m experiments sets it without a GPU), the exit code of `module` run again in a
    child without it (an offline compile needs it off before triton is imported); None when it is off."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = sys.argv[1:] if argv is None else list(argv)
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments gemv-limit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="weights N x K")
    add_sass_arguments(ap, "build/gemv_limit.json")
    args = ap.parse_args(argv)
    rc = rerun_without_interpreter("experiments.gemv_limit", argv)
    if rc is not None:
        return rc
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gpu = torch.cuda.is_available() and not args.sass_only
    name = torch.cuda.get_device_name() if gpu else linear_tuned.DEFAULT_GPU
    config = linear_tuned.tuned(name, 1)
    if args.arch is None:
        cap = torch.cuda.get_device_capability() if gpu else (9, 0)
        args.arch = cap[0] * 10 + cap[1]
    n, k = (int(v) for v in args.shapes[0].lower().split("x"))
    sass = sass_mix(n, k, dtype, config, args.arch)
    for part in ("production", *MODES):
        r = sass[part]
        print(f"SASS {sass['arch']} {part}: {r['loop_instructions']} instructions per loop step of a warp "
              f"({sass['loop_bytes_per_warp']} packed bytes), {r['registers']} registers: {r['loop_opcodes']}")
    payload = {"env": timing.environment(), "sass": sass, "config": str(config)}
    if gpu:
        copy = timing.copy_bandwidth_gbs()
        print(f"copy {copy['gbs']:.0f} GB/s; config {config}", flush=True)
        payload["copy_bandwidth"] = copy
        payload["rows"] = [r for shape in args.shapes for r in measure(shape, dtype, config, copy["gbs"])]
        payload["pipes"] = pipe_rates()
    elif not args.sass_only:
        print("no CUDA GPU: only the offline SASS count", file=sys.stderr)
    print(f"wrote {timing.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
