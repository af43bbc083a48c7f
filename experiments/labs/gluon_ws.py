"""A warp-specialized Gluon NF4 GEMM: decoder warps write the decoded weight tile to shared memory, a math warp
group multiplies it by wgmma (issue 34, item 2).

Why: the register-operand kernel (gluon_gemm.py) removed the shared-memory round trip, but its warps both decode and
issue the wgmmas; ncu on the H200 (M = 2048) found the tensor pipe 68 % busy with 1.8 warps a scheduler, most cycles
with no eligible warp. Here each job has its own warps (Gluon `warp_specialize`), synchronized by mbarriers:
- the loader (1 warp) brings x's [BM, 64] tile and the packed words [BN, 8] of each 64-weight step by TMA;
- the decoder (4 warps, one row of W a thread, so one product table per row and step) turns the words into the
  [BN, 64] bfloat16 tile with the word GEMV's exact prmt tables and stores it in K order (x is not permuted);
- the math warps (the default partition, BN / 16 warps) issue wgmma on the two shared tiles, one group in flight.
Exactness: the operand is round_bf16(mul.rn.ftz.f32(NF4[nibble], absmax)), checked as gluon_gemm's candidates are.
GPU only (Gluon, TMA, wgmma); Triton 3.6's API. Timed by `python -m experiments.labs.gluon_gemm` (its candidates
whose names start with `ws_`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nf4.device import LOOKUP_ASM

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

NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# name -> (BM: rows of x a tile; BN: rows of W (16 math warps per 256); STAGES; split-K (0: fill the GPU);
# decoder warps (4: a row a thread, 8: half a row), their registers, the kernel's maxnreg)
# (8 math warps, 1 loader rounded to a warp group, 4 or 8 decoders: maxnreg 128 or 96 fits one program an SM)
CANDIDATES = {
    "ws_m16_n128": (16, 128, 6, 0, 4, 128, 128),
    "ws_m64_n128": (64, 128, 5, 0, 4, 128, 128),
    "ws_m128_n128": (128, 128, 4, 0, 4, 128, 128),
    "ws_m16_n128_d8": (16, 128, 6, 0, 8, 96, 96),
    "ws_m64_n128_d8": (64, 128, 5, 0, 8, 96, 96),
    "ws_m128_n128_d8": (128, 128, 4, 0, 8, 96, 96),
}


@gluon.jit
def _loader(x_desc, w_desc, x_bufs, w_bufs, a_bufs, ready, empty, a_ready, a_empty, absmax_ptr, absmax2_ptr,
            code2_ptr, offset_ptr, off_m, off_n, k0, n_steps, N, K):
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for s in range(n_steps):
        st = s % STAGES
        mbarrier.wait(empty.index(st), ((s // STAGES) & 1) ^ 1)  # the decoder and the math warps let go of it
        mbarrier.expect(ready.index(st), nbytes)
        _tma_load(x_desc, [off_m, (k0 + s) * 64], ready.index(st), x_bufs.index(st))
        _tma_load(w_desc, [off_n, (k0 + s) * 8], ready.index(st), w_bufs.index(st))


@gluon.jit
def _decoder(x_desc, w_desc, x_bufs, w_bufs, a_bufs, ready, empty, a_ready, a_empty, absmax_ptr, absmax2_ptr,
             code2_ptr, offset_ptr, off_m, off_n, k0, n_steps, N, K):
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BN: gl.constexpr = w_bufs.type.shape[1]
    DEC: gl.constexpr = gl.num_warps()
    # a thread: one row's 8 words (BN = 32 x decoder warps) or half a row's (BN = 16 x decoder warps)
    if BN == 32 * DEC:
        WL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [DEC, 1], [1, 0])
    else:
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [DEC, 1], [1, 0])
    PAIRS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    KB = K // 64
    last = n_steps - 1
    rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    row_ok = rows < N
    blk = gl.minimum(rows, N - 1) * KB + k0
    offset = gl.load(offset_ptr)
    amax = _absmax(gl.load(absmax_ptr + blk), blk, row_ok, absmax2_ptr, code2_ptr, offset)
    q_next = gl.load(absmax_ptr + blk + gl.minimum(1, last))
    for s in range(n_steps):
        st = s % STAGES
        ph = (s // STAGES) & 1
        q_after = gl.load(absmax_ptr + blk + gl.minimum(s + 2, last))
        mbarrier.wait(ready.index(st), ph)
        words = w_bufs.index(st).load(WL).to(gl.uint32, bitcast=True)
        fence_async_shared()  # the generic read before the next TMA write of this buffer
        mbarrier.arrive(empty.index(st), count=1)
        t0, t1, t2, t3, t4, t5, t6, t7 = gl.inline_asm_elementwise(
            TABLE_BF16_FTZ, "=r,=r,=r,=r,=r,=r,=r,=r,r", [gl.expand_dims(amax, 1)], dtype=(gl.uint32,) * 8,
            is_pure=True, pack=1)
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            LOOKUP_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [words, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        q = gl.join(gl.join(p0, p2), gl.join(p1, p3))  # [BN, 8, 2 (j1), 2 (j0)]: pair j = 2 j1 + j0
        # pair 4 w + j holds the weights of columns 8 w + 2 j (low half) and + 1: the tile's 32-bit view in K order
        mbarrier.wait(a_empty.index(st), ph ^ 1)
        if NEW_REINTERPRET:  # Triton 3.9's name (CI's offline builds); 3.6's below
            a32 = a_bufs.index(st).reinterpret(gl.int32, [BN, 32], PAIRS)
        else:
            a32 = a_bufs.index(st)._reinterpret(gl.int32, [BN, 32], PAIRS)
        a32.store(gl.reshape(q, [BN, 32]).to(gl.int32, bitcast=True))
        fence_async_shared()  # the tile is read by wgmma (the async proxy)
        mbarrier.arrive(a_ready.index(st), count=1)
        amax = _absmax(q_next, blk + gl.minimum(s + 1, last), row_ok, absmax2_ptr, code2_ptr, offset)
        q_next = q_after


@gluon.jit
def _math(x_bufs, a_bufs, ready, empty, a_ready, a_empty, n_steps, bias_ptr, out_ptr, part_ptr, M, N, off_m, off_n,
          BM: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BN: gl.constexpr = a_bufs.type.shape[1]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for s in range(n_steps):
        st = s % STAGES
        ph = (s // STAGES) & 1
        mbarrier.wait(ready.index(st), ph)
        mbarrier.wait(a_ready.index(st), ph)
        acc = warpgroup_mma(a_bufs.index(st), x_bufs.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        prev = (s + STAGES - 1) % STAGES  # step s - 1's wgmma has retired: its buffers are free
        mbarrier.arrive(empty.index(prev), count=1, pred=s > 0)
        mbarrier.arrive(a_empty.index(prev), count=1, pred=s > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_out(acc, off_n, off_m, M, N, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_BIAS)


@gluon.jit
def lab_gluon_ws_kernel(x_desc, w_desc, a_layout: gl.constexpr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                        bias_ptr, out_ptr, part_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                        STAGES: gl.constexpr, SPLIT: gl.constexpr, DEC_WARPS: gl.constexpr, DEC_REGS: gl.constexpr,
                        HAS_BIAS: gl.constexpr,
                        num_warps: gl.constexpr):
    KB = K // 64
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    seg = gl.cdiv(KB, SPLIT)
    k0 = gl.program_id(2) * seg
    n_steps = gl.minimum(seg, KB - k0)

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 64], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 8], w_desc.layout)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64], a_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # the decoder (words read) and the math warps (x read)
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    wargs = (x_desc, w_desc, x_bufs, w_bufs, a_bufs, ready, empty, a_ready, a_empty, absmax_ptr, absmax2_ptr,
             code2_ptr, offset_ptr, off_m, off_n, k0, n_steps, N, K)
    gl.warp_specialize([
        (_math, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, n_steps, bias_ptr, out_ptr, part_ptr, M, N, off_m,
                 off_n, BM, SPLIT, HAS_BIAS, num_warps)),
        (_loader, wargs),
        (_decoder, wargs),
    ], [1, DEC_WARPS], [24, DEC_REGS])




def layouts(bm: int, bn: int):
    return (gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bn, 8], gl.int32),
            gl.NVMMASharedLayout.get_default_for([bn, 64], gl.bfloat16))


def ws_linear(x: torch.Tensor, packed: torch.Tensor, qs, cand: str, out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """out = x W^T + bias (bf16, blocksize 64, double quantization); x in its own column order."""
    bm, bn, stages, split, dec_warps, dec_regs, maxnreg = CANDIDATES[cand]
    m, k = x.shape
    n = qs.shape[0]
    words = packed.reshape(-1).view(torch.int32).view(n, k // 8)
    xl, wl, al = layouts(bm, bn)
    x_desc = TensorDescriptor.from_tensor(x, [bm, 64], xl)
    w_desc = TensorDescriptor.from_tensor(words, [bn, 8], wl)
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    split = splits(triton_cdiv(n, bn) * triton_cdiv(m, bm), k // 64, split)
    part = partial_sums(split, m, n, out)
    grid = (triton_cdiv(n, bn), triton_cdiv(m, bm), split)
    lab_gluon_ws_kernel[grid](x_desc, w_desc, al, qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset,
                              bias if bias is not None else out, out, part, m, n, k, bm, bn, stages, split, dec_warps,
                              dec_regs, bias is not None, num_warps=bn // 16, enable_fp_fusion=False, maxnreg=maxnreg)
    sum_splits(part, bias, out, split)
    return out


def build(cand: str, arch: int = 90, options: dict | None = None):
    """An offline build for sm_<arch> (no GPU): the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, stages, split, dec_warps, dec_regs, maxnreg = CANDIDATES[cand]
    xl, wl, al = layouts(bm, bn)
    sig = {"x_desc": f"tensordesc<bf16[{bm},64],{xl!r}>", "w_desc": f"tensordesc<i32[{bn},8],{wl!r}>",
           "a_layout": "constexpr", "absmax_ptr": "*u8", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32",
           "offset_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32",
           "N": "i32", "K": "i32"}
    const = {"a_layout": al, "BM": bm, "BN": bn, "STAGES": stages, "SPLIT": max(split, 2), "DEC_WARPS": dec_warps,
             "DEC_REGS": dec_regs,
             "HAS_BIAS": False, "num_warps": bn // 16}
    sig.update({name: "constexpr" for name in const})
    src = GluonASTSource(lab_gluon_ws_kernel, sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": bn // 16, "enable_fp_fusion": False, "maxnreg": maxnreg,
                                   **(options or {})})
