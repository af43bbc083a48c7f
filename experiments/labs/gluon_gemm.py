"""A Gluon NF4 GEMM whose decode writes wgmma's register operand directly (issue 34, items 1-2).

Why: the GEMM lab (gemm_tma.py) found that a weight tile decoded in registers reaches wgmma through shared memory
and block-wide barriers, because plain Triton converts the decode's layout into wgmma's operand layout. Gluon
(Triton's explicit-layout dialect) lets the kernel state the layout: lane 4g + q of warp w loads words 2q and 2q + 1
of rows 16w + g and 16w + g + 8 of each 64-weight step (`WORDS` below), decodes them with the word GEMV's exact prmt
tables, and the 16 pairs it holds are, after a free relabelling of columns, wgmma's A fragment for those rows. The
relabelling permutes K inside each step, so x's columns are permuted to match (`fragment.perm`, checked on the CPU
against the PTX fragment layout). Swap-AB: out^T = W x^T, the decoded tile the register operand (64 rows of W per
warp group), x^T the shared operand through TMA.

Exactness: every operand is round_bf16(mul.rn.ftz.f32(NF4[nibble], absmax)), the dequantized weight; gemv_lut's
operand check (signed, power-of-two scaled identity rows, int16 views) holds it to that. GPU only (Gluon, PTX, TMA);
Triton 3.6's Gluon API (the GPU machines').

    python -m experiments.labs.gluon_gemm --shapes 4096x4096 --ms 16 128 512 --out build/labs/gluon_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nf4.linear.gemm_gluon import STEP, a_fragment, nf4_permute_x_kernel, quad_tables, quarter_asm, words_layout

from .gluon_common import (
    TABLE_BF16_FTZ,
    _absmax,
    _store_out,
    _tma_load,
    partial_sums,
    splits,
    sum_splits,
    triton_cdiv,
)

QUARTER_BF16_FTZ = gl.constexpr(quarter_asm(True, "bf16"))  # SHARE: a quarter of each table a lane, then swapped


@gluon.jit
def _decode(words, amax, lv0, lv1, lv2, lv3, BN: gl.constexpr, SHARE: gl.constexpr, A_LAYOUT: gl.constexpr):
    """[BN, 8] words (WORDS layout) and their rows' absmax [BN] -> the [BN, 64] bfloat16 A operand in fragment
    column order (column f of a step holds packed element fragment.perm()[f]). SHARE: the quad's lanes make a
    quarter of each table and swap (lv0..lv3: this lane's 4 levels, [BN, 4]; the product GEMM's decode), else each
    lane makes whole tables."""
    w0, w1 = gl.split(gl.reshape(words, [BN, 4, 2]))  # [BN, 4 (q)] each: words 2q and 2q + 1 of the row's step
    if SHARE:
        t0, t1, t2, t3, t4, t5, t6, t7 = quad_tables(w0, amax, lv0, lv1, lv2, lv3, QUARTER_BF16_FTZ)
    else:
        a = gl.expand_dims(gl.convert_layout(amax, gl.SliceLayout(1, w0.type.layout)), 1)
        t0, t1, t2, t3, t4, t5, t6, t7 = gl.inline_asm_elementwise(
            TABLE_BF16_FTZ, "=r,=r,=r,=r,=r,=r,=r,=r,r", [a], dtype=(gl.uint32,) * 8, is_pure=True, pack=1)
    return a_fragment(w0, w1, t0, t1, t2, t3, t4, t5, t6, t7, BN, gl.bfloat16, A_LAYOUT)


@gluon.jit
def _step(s, acc, amax, q_next, w_now, w_next, x_now, x_desc, w_desc, x_smem, w_smem, bars, wptr, xptr, absmax_ptr,
          absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last, lv0, lv1, lv2, lv3,
          step_bytes: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr, W_TMA: gl.constexpr,
          SHARE: gl.constexpr, X_REG: gl.constexpr, WORDS: gl.constexpr, A_LAYOUT: gl.constexpr):
    """One 64-weight step: decode W's words into the A fragment, issue the wgmma, leave WAIT groups in flight, refill
    the stage the retired wgmma read, and carry the absmax and word prefetches one step on. X_REG: x's tile (loaded a
    step ahead, unpermuted) is permuted in registers (a free relabelling) and stored to shared memory here."""
    st = s % STAGES
    q_after = gl.load(absmax_ptr + blk + gl.minimum(s + 2, last))
    if W_TMA:
        mbarrier.wait(bars.index(st), (s // STAGES) & 1)
        words = w_smem.index(st).load(WORDS).to(gl.uint32, bitcast=True)
        w_after = w_next
    else:
        w_after = gl.load(wptr + gl.minimum(s + 2, last) * 8)
        words = w_now.to(gl.uint32, bitcast=True)
    if X_REG:
        x_after = gl.load(xptr + gl.minimum(s + 1, last) * 64)
    a = _decode(words, amax, lv0, lv1, lv2, lv3, BN, SHARE, A_LAYOUT)
    if X_REG:
        BM: gl.constexpr = x_now.shape[0]
        # x's column 32 q1 + 16 q0 + 8 c1 + 4 c0 + 2 h + e goes to fragment column 32 c1 + 16 c0 + 8 h + 4 q1 + 2 q0 + e
        xt = gl.permute(gl.reshape(x_now, [BM, 2, 2, 2, 2, 2, 2]), [0, 3, 4, 5, 1, 2, 6])
        x_smem.index(st).store(gl.reshape(xt, [BM, 64]))
        fence_async_shared()
        gl.thread_barrier()
    elif not W_TMA:
        mbarrier.wait(bars.index(st), (s // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(st).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(WAIT, deps=[acc])
    if not X_REG:
        nxt = s + STAGES - 1
        ns = nxt % STAGES
        ok = nxt < n_steps
        mbarrier.expect(bars.index(ns), step_bytes, pred=ok)
        _tma_load(x_desc, [off_m, (k0 + nxt) * 64], bars.index(ns), x_smem.index(ns), pred=ok)
        if W_TMA:
            _tma_load(w_desc, [off_n, (k0 + nxt) * 8], bars.index(ns), w_smem.index(ns), pred=ok)
        x_after = x_now
    amax = _absmax(q_next, blk + gl.minimum(s + 1, last), row_ok, absmax2_ptr, code2_ptr, offset)
    return acc, amax, q_after, w_next, w_after, x_after


@gluon.jit
def lab_gluon_gemm_kernel(x_desc, x_ptr, w_desc, words_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                          bias_ptr, out_ptr, part_ptr, M, N, K, BM: gl.constexpr, STAGES: gl.constexpr,
                          SPLIT: gl.constexpr, WAIT: gl.constexpr, W_TMA: gl.constexpr, SHARE: gl.constexpr,
                          X_REG: gl.constexpr, HAS_BIAS: gl.constexpr, WORDS: gl.constexpr, num_warps: gl.constexpr):
    """W_TMA: the packed words come through the TMA stages with x (read back from shared memory), else each lane
    loads its 8 bytes a row from global memory two steps ahead. WAIT: wgmma groups left in flight (0 or 1).
    The absmax chain: a block's byte is loaded two steps ahead and turned into its float32 absmax one step ahead."""
    BN: gl.constexpr = 16 * num_warps
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, WORDS)
    KB = K // 64
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    seg = gl.cdiv(KB, SPLIT * (1 + WAIT)) * (1 + WAIT)  # steps of each split (even with WAIT 1: KB is even)
    k0 = gl.program_id(2) * seg
    n_steps = gl.minimum(seg, KB - k0)
    last = n_steps - 1

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 64], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES if W_TMA else 1, BN, 8], w_desc.layout)
    if W_TMA:
        step_bytes: gl.constexpr = BM * 64 * 2 + BN * 8 * 4
    else:
        step_bytes: gl.constexpr = BM * 64 * 2
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    if not X_REG:
        for i in gl.static_range(STAGES - 1):
            ok = i < n_steps
            mbarrier.expect(bars.index(i), step_bytes, pred=ok)
            _tma_load(x_desc, [off_m, (k0 + i) * 64], bars.index(i), x_smem.index(i), pred=ok)
            if W_TMA:
                _tma_load(w_desc, [off_n, (k0 + i) * 8], bars.index(i), w_smem.index(i), pred=ok)

    rows = off_n + gl.arange(0, BN, layout=ROWS)
    row_ok = rows < N
    blk = gl.minimum(rows, N - 1) * KB + k0  # each row's first block (rows past W: its last row's)
    offset = gl.load(offset_ptr)
    amax = _absmax(gl.load(absmax_ptr + blk), blk, row_ok, absmax2_ptr, code2_ptr, offset)
    q_next = gl.load(absmax_ptr + blk + gl.minimum(1, last))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
    wptr = words_ptr + gl.expand_dims(gl.minimum(rows, N - 1) * (K // 8) + k0 * 8, 1) + gl.expand_dims(cols, 0)
    if W_TMA:
        w_now = gl.zeros([BN, 8], gl.int32, WORDS)
        w_next = w_now
    else:
        w_now = gl.load(wptr)
        w_next = gl.load(wptr + gl.minimum(1, last) * 8)
    if X_REG:  # x's rows past M read row M - 1 (their outputs are never stored)
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        xr = gl.minimum(off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
        xptr = x_ptr + gl.expand_dims(xr.to(gl.int64) * K + k0 * 64, 1) + \
            gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, XL)), 0)
        x_now = gl.load(xptr)
    else:
        xptr = x_ptr
        x_now = offset
    # this lane's four levels NF4[4q + j] (code_ptr: the NF4 table), as [BN, 4] tensors in the split words' layout
    c0, _ = gl.split(gl.reshape(gl.zeros([BN, 8], gl.int32, WORDS) + gl.expand_dims(cols, 0), [BN, 4, 2]))
    lv0 = gl.load(code_ptr + 2 * c0)
    lv1 = gl.load(code_ptr + 2 * c0 + 1)
    lv2 = gl.load(code_ptr + 2 * c0 + 2)
    lv3 = gl.load(code_ptr + 2 * c0 + 3)
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    if WAIT == 1:
        # two steps an iteration, each with its own A registers: a wgmma stays in flight while the next step
        # decodes into the other registers (PTX forbids writing an in-flight wgmma's A registers); even steps only
        for s in range(0, n_steps, 2):
            acc, amax, q_next, w_now, w_next, x_now = _step(
                s, acc, amax, q_next, w_now, w_next, x_now, x_desc, w_desc, x_smem, w_smem, bars, wptr, xptr,
                absmax_ptr,
                absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last, lv0, lv1, lv2, lv3,
                step_bytes, BN, STAGES, 1, W_TMA, SHARE, X_REG, WORDS, A_LAYOUT)
            acc, amax, q_next, w_now, w_next, x_now = _step(
                s + 1, acc, amax, q_next, w_now, w_next, x_now, x_desc, w_desc, x_smem, w_smem, bars, wptr, xptr,
                absmax_ptr,
                absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last, lv0, lv1, lv2, lv3,
                step_bytes, BN, STAGES, 1, W_TMA, SHARE, X_REG, WORDS, A_LAYOUT)
    else:
        for s in range(n_steps):
            acc, amax, q_next, w_now, w_next, x_now = _step(
                s, acc, amax, q_next, w_now, w_next, x_now, x_desc, w_desc, x_smem, w_smem, bars, wptr, xptr,
                absmax_ptr,
                absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last, lv0, lv1, lv2, lv3,
                step_bytes, BN, STAGES, 0, W_TMA, SHARE, X_REG, WORDS, A_LAYOUT)
    acc = warpgroup_mma_wait(0, deps=[acc])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    _store_out(acc, off_n, off_m, M, N, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_BIAS)




# name -> (BM: rows of x a tile, wgmma's N; warps: 4 per 64 rows of W; STAGES; split-K: 0 = as many splits as bring
# the programs nearest 2 per multiprocessor with at least 8 steps each; WAIT: wgmma groups left in flight; W_TMA: the
# packed words through the TMA stages, else loaded by each lane two steps ahead; SHARE: each lane of a quad makes a
# quarter of its rows' tables and the quad swaps them by shuffles; X_REG: x unpermuted, loaded a step ahead by the
# kernel's threads and permuted in registers on its way to shared memory: no gather, no TMA)
CANDIDATES = {
    "g_m16_w4": (16, 4, 8, 0, 0, True, False, False),  # M <= 16
    "g_m16_w4_ld": (16, 4, 8, 0, 1, False, False, False),
    "g_m16_w4_ld_sh": (16, 4, 8, 0, 1, False, True, False),
    "g_m32_w4_ld": (32, 4, 6, 0, 1, False, False, False),
    "g_m32_w4_ld_sh": (32, 4, 6, 0, 1, False, True, False),
    "g_m64_w4_ld": (64, 4, 6, 0, 1, False, False, False),
    "g_m64_w4_ld_sh": (64, 4, 6, 0, 1, False, True, False),
    "g_m128_w4": (128, 4, 4, 0, 0, True, False, False),
    "g_m128_w4_a1": (128, 4, 4, 0, 1, True, False, False),
    "g_m128_w4_a1_sh": (128, 4, 4, 0, 1, True, True, False),
    "g_m128_w4_ld_sh": (128, 4, 4, 0, 1, False, True, False),
    "g_m256_w4": (256, 4, 3, 1, 0, True, False, False),
    "g_m256_w4_a1": (256, 4, 3, 1, 1, True, False, False),
    "g_m256_w4_a1_sh": (256, 4, 3, 1, 1, True, True, False),
    "g_m256_w8_ld": (256, 8, 3, 1, 1, False, False, False),
    "g_m256_w8_ld_sh": (256, 8, 3, 1, 1, False, True, False),
    "g_m32_w4_ld_sh_xr": (32, 4, 6, 0, 1, False, True, True),
    "g_m64_w4_ld_sh_xr": (64, 4, 6, 0, 1, False, True, True),
    "g_m128_w4_ld_sh_xr": (128, 4, 4, 0, 1, False, True, True),
}


def permute_x(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous, K a multiple of 64) with each 64-column step in fragment column order: column f of a
    step is column perm()[f]. The product GEMM's gather (nf4_permute_x_kernel, a copy); the interpreter runs it too."""
    m, k = x.shape
    if out is None:
        out = torch.empty_like(x)
    rows, cols = 8, 512
    ncol = triton_cdiv(k, cols)
    nf4_permute_x_kernel[(triton_cdiv(m, rows) * ncol,)](x, out, m, k, ncol, ROWS=rows, COLS=cols)
    return out


def gluon_linear(x: torch.Tensor, packed: torch.Tensor, qs, cand: str, out: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, permuted: bool = False) -> torch.Tensor:
    """out = x W^T + bias (bf16, blocksize 64, double quantization); x is permuted here unless `permuted`."""
    bm, warps, stages, split, wait, w_tma, share, x_reg = CANDIDATES[cand]
    xp = x if permuted or x_reg else permute_x(x)
    m, k = xp.shape
    if wait and (k // 64) % 2:
        raise ValueError(f"candidate {cand} takes two 64-weight steps an iteration: K // 64 must be even, got {k}")
    n = qs.shape[0]
    bn = 16 * warps
    words = packed.reshape(-1).view(torch.int32).view(n, k // 8)
    x_desc = TensorDescriptor.from_tensor(xp, [bm, 64], gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(words, [bn, 8], gl.NVMMASharedLayout.get_default_for([bn, 8], gl.int32))
    if out is None:
        out = torch.empty(m, n, device=xp.device, dtype=xp.dtype)
    tiles = triton_cdiv(n, bn) * triton_cdiv(m, bm)
    split = splits(tiles, k // 64, split)
    part = partial_sums(split, m, n, out)
    grid = (triton_cdiv(n, bn), triton_cdiv(m, bm), split)
    lab_gluon_gemm_kernel[grid](x_desc, xp, w_desc, words, qs.code, qs.absmax, qs.state2.absmax, qs.state2.code,
                                qs.offset, bias if bias is not None else out, out, part, m, n, k, bm, stages, split,
                                wait, w_tma, share, x_reg, bias is not None, words_layout(warps), num_warps=warps,
                                enable_fp_fusion=False)
    sum_splits(part, bias, out, split)
    return out


def build_facts(cand: str, arch: int = 90, sass_path: str | None = None) -> dict:
    """An offline build for sm_<arch> (no GPU): registers, shared memory, whether every wgmma takes A from
    registers, block-wide barriers and shared loads/stores in the K loop, and the loop's instructions by class."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import sass_count as sc

    bm, warps, stages, split, wait, w_tma, share, x_reg = CANDIDATES[cand]
    bn = 16 * warps
    xl = gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([bn, 8], gl.int32)
    sig = {"x_desc": f"tensordesc<bf16[{bm},64],{xl!r}>", "x_ptr": "*bf16", "w_desc": f"tensordesc<i32[{bn},8],{wl!r}>",
           "words_ptr": "*i32", "code_ptr": "*fp32", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32",
           "offset_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32"}
    const = {"BM": bm, "STAGES": stages, "SPLIT": max(split, 2), "WAIT": wait, "W_TMA": w_tma, "SHARE": share,
             "X_REG": x_reg, "HAS_BIAS": False,
             "WORDS": words_layout(warps), "num_warps": warps}
    sig.update({name: "constexpr" for name in const})
    src = GluonASTSource(lab_gluon_gemm_kernel, sig, constexprs=const)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    sass = sc.disassemble(compiled.asm["cubin"])
    if sass_path:
        Path(sass_path).write_text(sass)
    insns, labels = sc.instructions(sass)
    hg = [i for i, (op, _) in enumerate(insns) if op.startswith("HGMMA")]
    loop = []  # the K loop: a backward branch after the last wgmma to a label before the first
    for i, (op, args) in enumerate(insns):
        mt = re.search(r"\((\.L_x_\d+)\)", args)
        if op == "BRA" and mt and hg and i > hg[-1] and labels.get(mt.group(1), i) < hg[0]:
            loop = insns[labels[mt.group(1)]:i + 1]
            break
    ops: dict = {}
    for op, _ in loop:
        ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
    weights = 64 * bn // (32 * warps) * (1 + wait)  # weights each thread decodes per pass of the loop
    alu = sum(v for op, v in ops.items() if op in ("PRMT", "LOP3", "SHF", "IADD3", "LEA", "ISETP", "SEL", "VIADD",
                                                   "IMNMX", "VIMNMX", "SGXT"))
    return {**sc.registers(compiled.asm["cubin"]), "candidate": cand, "arch": f"sm_{arch}",
            "shared_bytes": compiled.metadata.shared,
            "wgmma_register_a": bool(hg) and all(re.search(r"BF16 R\d+, R\d+, gdesc", insns[i][1]) for i in hg),
            "wgmma_in_flight": max((int(v, 16) for v in re.findall(r"gsb0, 0x([0-9a-f]+)", sass)), default=None),
            "loop_instructions": len(loop), "loop_ops": ops, "weights_per_thread_loop": weights,
            "loop_alu_per_weight": alu / weights, "loop_imad_per_weight": ops.get("IMAD", 0) / weights,
            "loop_bar_sync": sum(op.startswith("BAR.SYNC") for op, _ in loop),
            "loop_shared": {op: ops.get(op, 0) for op in ("LDS", "STS", "LDSM", "STSM")}, "triton": triton.__version__}


def fits(cand: str, m: int) -> bool:
    from .gluon_ws import CANDIDATES as WS

    bm = (CANDIDATES.get(cand) or WS[cand])[0]
    return bm == 16 if m <= 16 else bm == 32 if m <= 32 else bm == 64 if m <= 64 else bm >= 128


def run_weight(n: int, k: int, ms, candidates, log=print, race: bool = False) -> list[dict]:
    """Each M: cuBLAS dense, nf4.linear and every fitting candidate, operand-checked then timed. race: no x
    permutation row and no kernel-alone time (the catalog race, where only the user's call counts)."""
    import bitsandbytes.functional as F

    import nf4
    from verify import timing

    from . import gluon_common
    from .gemv_lut import bound_check, lab_inputs, make_weights, operand_mismatches
    from .gluon_ws import CANDIDATES as WS
    from .gluon_ws import ws_linear

    dtype = torch.bfloat16
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    wds = [F.dequantize_4bit(p, q).to(dtype) for p, q in sets]
    rows = []
    for m in ms:
        x, cols, scales, mi, xr = lab_inputs(m, k, dtype)
        xrp = permute_x(xr)
        base = {"N": n, "K": k, "M": m, "dtype": "bfloat16", "copies": len(sets)}

        def timed(fn):
            g = timing.graph_time_us(fn, list(range(len(sets))))
            return g and g.get("median_us")

        rows.append({**base, "provider": "cublas_dense",
                     "graph_us": timed(lambda i, xr=xr: torch.nn.functional.linear(xr, wds[i % len(wds)]))})
        rows.append({**base, "provider": "nf4.linear",
                     "graph_us": timed(lambda i, xr=xr: nf4.linear(xr, *sets[i % len(sets)]))})
        if not race:
            rows.append({**base, "provider": "permute_x", "graph_us": timed(lambda i, xr=xr: permute_x(xr))})
        ref = torch.nn.functional.linear(xr.float(), wds[0].float())
        for cand in [c for c in candidates if fits(c, m)]:
            row = {**base, "provider": cand, "config": CANDIDATES.get(cand) or WS[cand]}
            if cand in WS:
                def call(xx, packed, qs, c, o, permuted=False):
                    return ws_linear(xx, packed, qs, c, o)
            else:
                call = gluon_linear
            try:
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                y = call(x, *sets[0], cand, out)
                torch.cuda.synchronize()
                row["operand_mismatches"] = operand_mismatches(y[:mi], wds[0], cols, scales)
                out.fill_(float("nan"))
                y = call(xr, *sets[0], cand, out)
                row.update(bound_check(y, xr, wds[0], ref))
                row["graph_us"] = timed(lambda i, c=cand, o=out, xr=xr, f=call: f(xr, *sets[i % len(sets)], c, o))
                if not race and cand not in WS and not CANDIDATES[cand][7]:
                    row["kernel_us"] = timed(lambda i, c=cand, o=out, xp=xrp: gluon_linear(xp, *sets[i % len(sets)], c,
                                                                                         o, permuted=True))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            rows.append(row)
        ran = (2 if race else 3) + len([c for c in candidates if fits(c, m)])
        dense = rows[-ran].get("graph_us")
        for r in rows[-ran:]:
            us = r.get("graph_us")
            log(f"  {n}x{k} M={m:<5} {r['provider']:<12} {us or float('nan'):9.2f} us "
                f"{(us / dense if us and dense else float('nan')):5.2f}x dense  kernel {r.get('kernel_us')}"
                f"  mismatches {r.get('operand_mismatches')}  bound {r.get('random_within_bound')}"
                + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
    sets.clear()
    wds.clear()
    gluon_common._PARTS.clear()
    torch.cuda.empty_cache()
    return rows


def run_product(n: int, k: int, ms, dtype, log=print) -> list[dict]:
    """Each M, in the user's call: cuBLAS dense; nf4.linear as this commit's table routes it (the Gluon GEMM where
    tuned.gluon_rule takes the shape), operand-checked and within the float32 bound; nf4.linear with the table's
    choice without the Gluon rule (`tuned(..., gluon=False)`, passed as its config)."""
    import bitsandbytes.functional as F

    import nf4
    from nf4.linear.tuned import NAMES, tuned
    from verify import timing

    from .gemv_lut import bound_check, lab_inputs, make_weights, operand_mismatches

    gpu = torch.cuda.get_device_name()
    sets = make_weights(n, k, dtype, copies=timing.rotation_count(n * k // 2))
    wds = [F.dequantize_4bit(p, q).to(dtype) for p, q in sets]
    rows = []
    for m in ms:
        x, cols, scales, mi, xr = lab_inputs(m, k, dtype)
        base = {"N": n, "K": k, "M": m, "dtype": str(dtype).removeprefix("torch."), "copies": len(sets)}
        routed, table = tuned(gpu, m, n=n, k=k), tuned(gpu, m, n=n, k=k, gluon=False)

        def timed(fn):
            g = timing.graph_time_us(fn, list(range(len(sets))))
            return g and g.get("median_us")

        out = [{**base, "provider": "cublas_dense",
                "graph_us": timed(lambda i, xr=xr: torch.nn.functional.linear(xr, wds[i % len(wds)]))}]
        row = {**base, "provider": "nf4.linear", "config": NAMES.get(routed, repr(routed))}
        try:
            row["operand_mismatches"] = operand_mismatches(nf4.linear(x, *sets[0])[:mi], wds[0], cols, scales)
            ref = torch.nn.functional.linear(xr.float(), wds[0].float())
            row.update(bound_check(nf4.linear(xr, *sets[0]), xr, wds[0], ref))
            row["graph_us"] = timed(lambda i, xr=xr: nf4.linear(xr, *sets[i % len(sets)]))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
        out.append(row)
        out.append({**base, "provider": "nf4.linear_table", "config": NAMES.get(table, repr(table)),
                    "graph_us": timed(lambda i, xr=xr, c=table: nf4.linear(xr, *sets[i % len(sets)], config=c))})
        us = {r["provider"]: r.get("graph_us") or float("nan") for r in out}
        log(f"  {n}x{k} M={m:<4} {base['dtype']:<8} dense {us['cublas_dense']:8.1f}  nf4 {us['nf4.linear']:8.1f} "
            f"({row['config']})  table {us['nf4.linear_table']:8.1f} ({out[-1]['config']})  mismatches "
            f"{row.get('operand_mismatches')}  bound {row.get('random_within_bound')}"
            + (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)
        rows += out
    sets.clear()
    wds.clear()
    torch.cuda.empty_cache()
    return rows


RULE_CANDIDATE = {"GLUON_GEMM128": "g_m128_w4_a1_sh", "GLUON_GEMM256": "g_m256_w4_a1_sh"}  # the lab kernel of each
SLOWER = 1.03  # a routed row slower than the table's choice by more than this counts as slower


def _rule_cells(payload: dict):
    """A race or product file grouped for judging or fitting a Gluon rule: ({(N, K, M, dtype): {provider: row}},
    whether it is a product file, and pair(group, config name) -> (Gluon row, table row), or None where the file has
    no Gluon time for that cell (a product row measured where its commit's rule did not route)."""
    groups: dict = {}
    for r in payload["rows"]:
        groups.setdefault((r["N"], r["K"], r["M"], r.get("dtype", "bfloat16")), {})[r["provider"]] = r
    product = any("nf4.linear_table" in g for g in groups.values())

    def pair(g: dict, name: str):
        gluon, table = (g.get("nf4.linear"), g.get("nf4.linear_table")) if product else (
            g.get(RULE_CANDIDATE[name]), g.get("nf4.linear"))
        if not gluon or not table or (product and gluon.get("config") not in RULE_CANDIDATE):
            return None
        return gluon, table

    return groups, product, pair


def _timed_exact(gluon: dict, table: dict) -> bool:
    """Both rows timed, and the Gluon row operand-exact and within the float32 bound."""
    return bool(gluon.get("operand_mismatches") == 0 and gluon.get("random_within_bound") and gluon.get("graph_us")
                and table.get("graph_us"))


def judge_rule(payload: dict, gpu: str | None = None) -> dict:
    """This commit's Gluon rule (nf4.linear.tuned.gluon_rule) judged on a race (`--race`) or product (`--product`)
    file: per source, dtype, M and catalog subset, the (shape, M) rows it routes, and over them the median and worst of
    the Gluon time over the table's choice without the rule, the rows more than 3 % slower, and the median time over
    dense cuBLAS and the rows faster than it. A race file's table time is its nf4.linear (the commit before the rule),
    its Gluon time the rule's lab kernel; a product file's are nf4.linear_table and nf4.linear (which must have run
    the Gluon GEMM). Only operand-exact Gluon rows within the float32 bound count; rows of K not a multiple of 128,
    which the kernel does not take, are not routed."""
    from statistics import median

    from experiments import catalog
    from nf4.linear.tuned import NAMES, gluon_rule

    gpu = gpu or payload["device"]
    subsets = {(s.n, s.k): s.subset for s in catalog.catalog()}
    groups, product, pair = _rule_cells(payload)
    cells: dict = {}
    for (n, k, m, dt), g in sorted(groups.items()):
        rule = gluon_rule(m, n, k, gpu)
        if rule is None or "cublas_dense" not in g or k % (2 * STEP):
            continue  # (rows not whole pairs of steps: the kernel's `runnable` sends them to the table's choice)
        timed = pair(g, NAMES[rule])
        if timed is None:
            continue
        gluon, table = timed
        cell = cells.setdefault((dt, m, subsets.get((n, k), "uncatalogued")), {"ratios": [], "dense": [], "bad": 0})
        if not _timed_exact(gluon, table):
            cell["bad"] += 1
            continue
        cell["ratios"].append(gluon["graph_us"] / table["graph_us"])
        cell["dense"].append(gluon["graph_us"] / g["cublas_dense"]["graph_us"])
    rows = [{"dtype": dt, "M": m, "subset": sub, "routed": len(c["ratios"]) + c["bad"], "not_exact": c["bad"],
             "median_over_table": median(c["ratios"]) if c["ratios"] else None,
             "worst_over_table": max(c["ratios"], default=None),
             "slower_than_table_3pct": sum(v > SLOWER for v in c["ratios"]),
             "median_over_dense": median(c["dense"]) if c["dense"] else None,
             "faster_than_dense": sum(v < 1 for v in c["dense"])} for (dt, m, sub), c in sorted(cells.items())]
    return {"device": payload["device"], "source": "product" if product else "race",
            "measured_at": payload.get("environment", {}).get("commit"), "part": payload.get("part"),
            "shapes": len({(k[0], k[1]) for k in groups}), "rows": rows}


RULE_LIMITS = (128, 256, 512)  # the rule's rows: M = 65-128, 129-256, 257-512
FIT_LEAST_MI = (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)  # least N * K tried, in Mi weights
FIT_RATIO = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)  # least N / K tried


def fit_rule(payload: dict, within: tuple | None = None) -> tuple:
    """The Gluon rule fit on a race or product file's fit subset: for each row of RULE_LIMITS, the (least N * K, least
    N / K) from the grids that minimises the sum over the row's (shape, M) cells of log(time routed / the table's
    time), a cell not routed counting 0; None where no pair gains. A race file's routed time is the row's lab kernel
    (RULE_CANDIDATE of GLUON_GEMM128 up to M = 128, else GLUON_GEMM256), a product file's nf4.linear where it ran the
    Gluon GEMM. `within`: a rule the fit may only narrow (least N * K and N / K at least its, row by row), for a
    product file, which timed the Gluon GEMM only where the rule of its commit routed it. Ties go to the smaller
    pair. Returns rows (largest M, least N * K, least N / K, config name) as tuned.GLUON_RULES holds them."""
    import math

    from experiments import catalog

    subsets = {(s.n, s.k): s.subset for s in catalog.catalog()}
    groups, _, pair = _rule_cells(payload)
    out = []
    lo = 64
    for i, limit in enumerate(RULE_LIMITS):
        name = "GLUON_GEMM128" if limit <= 128 else "GLUON_GEMM256"
        cells = []
        for (n, k, m, _), g in groups.items():
            if not lo < m <= limit or subsets.get((n, k)) != "fit" or k % (2 * STEP):
                continue
            timed = pair(g, name)
            if timed is None or not _timed_exact(*timed):
                continue
            gluon, table = timed
            cells.append((n, k, math.log(gluon["graph_us"] / table["graph_us"])))
        floor_mi, floor_ratio = (within[i][1] / 2**20, within[i][2]) if within else (0, 0.0)
        best, best_cost = None, 0.0
        for least in [v for v in FIT_LEAST_MI if v >= floor_mi]:
            for ratio in [v for v in FIT_RATIO if v >= floor_ratio]:
                cost = sum(c for n, k, c in cells if n * k >= least * 2**20 and n >= ratio * k)
                if cost < best_cost - 1e-12:
                    best, best_cost = (limit, least << 20, ratio, name), cost
        out.append(best)
        lo = limit
    return tuple(out)


def rule_table(judged: list[dict]) -> str:
    out = []
    for j in judged:
        out += [f"{j['device']}, {j['source']} file ({j['shapes']} shapes, part {j['part']}, measured at "
                f"{str(j['measured_at'])[:7]}): this commit's Gluon rule, Gluon time / the table's without it", "",
                "| dtype | M | subset | routed | median | worst | > 3 % slower | median / dense | faster than dense |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in j["rows"]:
            def f(v):
                return "-" if v is None else f"{v:.2f}"
            out.append(f"| {r['dtype']} | {r['M']} | {r['subset']} | {r['routed']} | {f(r['median_over_table'])} | "
                       f"{f(r['worst_over_table'])} | {r['slower_than_table_3pct']} | {f(r['median_over_dense'])} | "
                       f"{r['faster_than_dense']} |")
        out.append("")
    return "\n".join(out)


def shape_list(shapes, part: str = "0/1") -> list[tuple[int, int]]:
    """(N, K) pairs from 'NxK' strings; 'catalog' stands for the shape catalog's shapes, every n-th from the i-th
    (part 'i/n')."""
    i, n_parts = (int(v) for v in part.split("/"))
    if not 0 <= i < n_parts:
        raise ValueError(f"--part must be i/n with 0 <= i < n, got {part!r}")
    out = []
    for shape in shapes:
        if shape == "catalog":
            from experiments import catalog

            out += [(s.n, s.k) for s in catalog.catalog()[i::n_parts]]
        else:
            out.append(tuple(int(v) for v in shape.lower().split("x")))
    return out


def report(paths) -> str:
    """Per weight and M: time over cuBLAS's dense GEMM of nf4.linear and of the best exact Gluon candidate (with
    x's permutation, and the kernel alone)."""
    out = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        out += [f"{d['device']} ({d['environment'].get('commit', '?')}): time / cuBLAS dense", "",
                "| N x K | M | cuBLAS us | nf4.linear | best Gluon (name) | its kernel alone |",
                "|---|---|---|---|---|---|"]
        groups: dict = {}
        for r in d["rows"]:
            groups.setdefault((r["N"], r["K"], r["M"]), []).append(r)
        for (n, k, m), rows in groups.items():
            us = {r["provider"]: r.get("graph_us") for r in rows if r.get("graph_us")}
            dense = us.get("cublas_dense")
            ok = [r for r in rows if r["provider"].startswith(("g_", "ws_")) and r.get("graph_us")
                  and r.get("operand_mismatches") == 0 and r.get("random_within_bound")]
            if not dense or not ok:
                continue
            best = min(ok, key=lambda r: r["graph_us"])
            out.append(f"| {n} x {k} | {m} | {dense:.1f} | {us.get('nf4.linear', float('nan')) / dense:.2f} | "
                       f"{best['graph_us'] / dense:.2f} ({best['provider']}) | "
                       f"{(best.get('kernel_us') or best['graph_us']) / dense:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.gluon_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096", "4096x14336"],
                    help="NxK ..., or 'catalog' for the shape catalog (with --part)")
    ap.add_argument("--part", default="0/1", help="i/n: the i-th of n interleaved parts of the catalog")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--product", action="store_true",
                    help="nf4.linear as routed (the Gluon rule) against the table without it, in the user's call")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    ap.add_argument("--race", action="store_true",
                    help="the user's call only: no x-permutation row, no kernel-alone time, no build facts")
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 16, 32, 64, 128, 512, 2048])
    from .gluon_ws import CANDIDATES as WS

    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES) + list(WS), choices=list(CANDIDATES) + list(WS))
    ap.add_argument("--out", default="build/labs/gluon_gemm.json")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON", help="print a markdown table and exit")
    ap.add_argument("--report-rule", nargs="+", default=None, metavar="JSON",
                    help="judge this commit's Gluon rule on race or product files of one GPU, print it and exit")
    ap.add_argument("--out-report", default=None, metavar="JSON", help="with --report-rule: also write it here")
    ap.add_argument("--fit-rule", default=None, metavar="JSON",
                    help="fit the Gluon rule's rows on a race or product file's fit subset, print them and exit")
    ap.add_argument("--within", default=None, metavar="GPU",
                    help="with --fit-rule: only narrow tuned.GLUON_RULES[GPU] (a product file timed only its routes)")
    ap.add_argument("--build", nargs="+", default=None, metavar="CANDIDATE",
                    help="offline sm_90 builds of these candidates: print their facts as JSON and exit (no GPU)")
    ap.add_argument("--probe", nargs=3, default=None, metavar=("CANDIDATE", "NxK", "M"),
                    help="one warm-up and one timed launch of a candidate (for ncu -k regex:lab_gluon -s 1 -c 1)")
    args = ap.parse_args(argv)
    if args.fit_rule:
        from nf4.linear.tuned import GLUON_RULES

        within = GLUON_RULES[args.within] if args.within else None
        print(json.dumps(fit_rule(json.loads(Path(args.fit_rule).read_text()), within)))
        return 0
    if args.report_rule:
        from nf4.linear.tuned import GLUON_RULES
        from verify import timing

        judged = [judge_rule(json.loads(Path(p).read_text())) for p in args.report_rule]
        print(rule_table(judged))
        if args.out_report:
            Path(args.out_report).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out_report).write_text(json.dumps(
                {"device": judged[0]["device"], "environment": timing.environment(), "slower_threshold": SLOWER,
                 "rules": {g: [list(r) for r in rows] for g, rows in GLUON_RULES.items()},
                 "sources": [str(p) for p in args.report_rule], "judged": judged}, indent=1))
        return 0
    if args.report:
        print(report(args.report))
        return 0
    if args.probe:
        from .gemv_lut import make_weights

        cand, shape, m = args.probe[0], args.probe[1], int(args.probe[2])
        n, k = (int(v) for v in shape.lower().split("x"))
        (packed, qs), = make_weights(n, k, torch.bfloat16, copies=1)
        x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
        xp = permute_x(x)
        for _ in range(2):
            if cand.startswith("ws_"):
                from .gluon_ws import ws_linear

                ws_linear(x, packed, qs, cand)
            else:
                gluon_linear(xp, packed, qs, cand, permuted=True)
        torch.cuda.synchronize()
        return 0
    if args.build:
        from . import sass_count as sc
        from .gluon_ws import build as ws_build

        print(json.dumps([build_facts(c) if c in CANDIDATES else
                          {"candidate": c, **sc.registers(ws_build(c).asm["cubin"])} for c in args.build]))
        return 0
    if not torch.cuda.is_available():
        print("gluon_gemm needs a CUDA GPU (sm_90)")
        return 2
    from verify import timing

    print(f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
            "environment": timing.environment(), "candidates": CANDIDATES, "part": args.part}
    t0 = time.monotonic()
    for n, k in shape_list(args.shapes, args.part):
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            head["stopped"] = f"--budget-s {args.budget_s} spent before {n}x{k}"
            print(head["stopped"], flush=True)
            break
        if args.product:
            for dt in args.dtypes:
                rows += run_product(n, k, args.ms, getattr(torch, dt))
        else:
            rows += run_weight(n, k, args.ms, args.candidates, race=args.race)
        out.write_text(json.dumps({**head, "rows": rows}, indent=1, default=str))  # a cut run keeps its rows
    facts = []
    for c in [c for c in args.candidates if c in CANDIDATES and not (args.race or args.product)]:
        try:
            facts.append(build_facts(c))
        except Exception as exc:
            facts.append({"candidate": c, "error": f"{type(exc).__name__}: {exc}"[:400]})
    out.write_text(json.dumps({**head, "build_facts": facts, "rows": rows}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
