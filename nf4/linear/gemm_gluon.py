"""`nf4_gemm_gluon_kernel`: a Gluon GEMM (Hopper, wgmma) whose decode writes wgmma's register operand directly,
M = 65-512 on large weights (kernel "gemm_gluon"), and the gather of x its fragments need.

Swap-AB: out^T = W x^T. Lane 4g + q of warp w loads words 2q and 2q + 1 of rows 16w + g and 16w + g + 8 of each
64-weight step through the TMA engine, decodes them with the word GEMV's exact product tables (each lane of a quad
makes a quarter of its rows' tables; the quad swaps them by shuffles), and the pairs it holds are, after a
relabelling that costs no instruction, wgmma's A fragment for those rows. The relabelling permutes K inside each
step; x's columns are permuted to match by `nf4_permute_x_kernel` (any K order gives the same products). x^T is the
shared operand, STAGES deep through TMA; two steps an iteration, so one wgmma stays in flight while the next step
decodes into other registers. Split-K (float32 partials summed in order by nf4_split_sum_kernel) where tiles do not
fill the GPU. Measured in experiments/labs/gluon_gemm.py (the candidates g_m128_w4_a1_sh, g_m256_w4_a1_sh).

Its launches (the table's entry for kernel "gemm_gluon": runnable, split, run, bind) are in gluon_launch.py.

Exactness: every operand is round_DT(mul.rn[.ftz].f32(NF4[nibble], absmax)), the dequantized weight; the sum is
float32. GPU only (Gluon has no interpreter): `runnable` is False off an sm_90 GPU or where this Triton has no
Gluon Hopper API, and the call takes the table's other kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.format import ABSMAX_BLOCKSIZE

from ..device import LOOKUP_ASM

try:  # Triton 3.6+ (the API's names changed between releases: the TMA load below)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover (an older Triton)
    AVAILABLE = False

STEP = 64  # weights of a row per step (one absmax block: blocksize 64)
DTYPES = (torch.bfloat16, torch.float16)


def quarter_asm(ftz: bool, dtype: str) -> str:
    """Plane q of a row's product table from its absmax ($2) and the lane's 4 levels NF4[4q + j] ($3..$6): the low
    bytes ($0) and high bytes ($1) of entries 4q .. 4q + 3, rounded to `dtype` ("bf16" or "f16")."""
    mul = "mul.rn.ftz.f32" if ftz else "mul.rn.f32"
    return " ".join(["{", ".reg .b32 p0, p1, p2, p3, q0, q1;", *[f"{mul} p{j}, $2, ${3 + j};" for j in range(4)],
                     f"cvt.rn.{dtype}x2.f32 q0, p1, p0;", f"cvt.rn.{dtype}x2.f32 q1, p3, p2;",
                     "prmt.b32 $0, q0, q1, 0x6420;", "prmt.b32 $1, q0, q1, 0x7531;", "}"])


# the quad swaps planes with segmented shuffles (width 4: source lane (lane & ~3) | i)
SWAP_PLANES = " ".join([f"shfl.sync.idx.b32 ${i}, $8, {i}, 0x1c1f, -1;" for i in range(4)]
                       + [f"shfl.sync.idx.b32 ${4 + i}, $9, {i}, 0x1c1f, -1;" for i in range(4)])
SINGLE_MUL = {True: "mul.rn.ftz.f32 $0, $1, $2;", False: "mul.rn.f32 $0, $1, $2;"}


@triton.jit
def nf4_permute_x_kernel(x_ptr, out_ptr, M, K, NCOL, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[:, 64 s + f] = x[:, 64 s + perm(f)]: fragment column f = 16 c + 8 h + 2 q + e of a step holds packed
    element 16 q + 8 (c >> 1) + 4 (c & 1) + 2 h + e (experiments/labs/fragment.py checks it against PTX's layout).
    Program p: rows ROWS (p // NCOL) .., columns COLS (p % NCOL) .. (a 1-D grid: a bound launch can repeat it)."""
    pid = tl.program_id(0)
    r = (pid // NCOL) * ROWS + tl.arange(0, ROWS)
    col = (pid % NCOL) * COLS + tl.arange(0, COLS)
    f = col % 64
    src = col - f + 16 * ((f >> 1) & 3) + 8 * (f >> 5) + 4 * ((f >> 4) & 1) + 2 * ((f >> 3) & 1) + (f & 1)
    ok = (r[:, None] < M) & (col[None, :] < K)
    row = r[:, None].to(tl.int64) * K
    tl.store(out_ptr + row + col[None, :], tl.load(x_ptr + row + src[None, :], mask=ok), mask=ok)


if AVAILABLE:
    ABSMAX_BLOCK = gl.constexpr(ABSMAX_BLOCKSIZE)  # first-level absmax values per second-level scale
    SWAP = gl.constexpr(SWAP_PLANES)

    def words_layout(warps: int):
        """[16 * warps, 8] words of a step: lane 4g + q of warp w holds words 2q, 2q + 1 of rows 16w + g, + 8."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)], block_bases=[],
            shape=[16 * warps, 8])

    @gluon.jit
    def block_absmax(q, blk, ok, absmax2_ptr, code2_ptr, offset, DOUBLE_QUANT: gl.constexpr, MUL: gl.constexpr):
        """The float32 absmax of blocks blk from what was loaded for them (q): with double quantization
        code2[q] * absmax2[blk // ABSMAX_BLOCK] + offset (two roundings, as bitsandbytes), else q itself."""
        if DOUBLE_QUANT:
            level = gl.load(code2_ptr + q.to(gl.int32), mask=ok, other=0.0)
            scale2 = gl.load(absmax2_ptr + blk // ABSMAX_BLOCK, mask=ok, other=0.0)
            prod = gl.inline_asm_elementwise(MUL, "=r,r,r", [level, scale2], dtype=gl.float32, is_pure=True, pack=1)
            return prod + offset
        else:
            return q

    @gluon.jit
    def quad_tables(w0, amax, lv0, lv1, lv2, lv3, QUARTER: gl.constexpr):
        """The byte planes t0..t7 of each row's product table (nf4.device.product_table's), each lane of a quad
        making a quarter (its 4 levels lv0..lv3) and the quad swapping them; rows' absmax [BN], w0 a [BN, 4] tensor
        of the split words' layout."""
        a = gl.expand_dims(gl.convert_layout(amax, gl.SliceLayout(1, w0.type.layout)), 1)
        lo, hi = gl.inline_asm_elementwise(QUARTER, "=r,=r,r,r,r,r,r", [a, lv0, lv1, lv2, lv3],
                                           dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
        return gl.inline_asm_elementwise(SWAP, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [lo, hi], dtype=(gl.uint32,) * 8,
                                         is_pure=True, pack=1)

    @gluon.jit
    def a_fragment(w0, w1, t0, t1, t2, t3, t4, t5, t6, t7, BN: gl.constexpr, DT: gl.constexpr,
                  A_LAYOUT: gl.constexpr):
        """Words 2q (w0) and 2q + 1 (w1) of each row's step, looked up in the rows' tables, as the [BN, 64] A operand
        in fragment column order (column f of a step holds packed element perm(f), `nf4_permute_x_kernel`)."""
        p00, p01, p02, p03 = gl.inline_asm_elementwise(
            LOOKUP_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [w0, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        p10, p11, p12, p13 = gl.inline_asm_elementwise(
            LOOKUP_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [w1, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        p0, p1, p2, p3 = gl.join(p00, p10), gl.join(p01, p11), gl.join(p02, p12), gl.join(p03, p13)
        q = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, 4, 2 (v), 2 (j0), 2 (j1)]: pair j = 2 j1 + j0
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [q], dtype=(gl.uint16, gl.uint16),
                                           is_pure=True, pack=1)
        # [BN, 4 (q), 2 (v: word 2q + v), 2 (j0), 2 (j1), 2 (e)]: element 2j + e of the word
        t = gl.join(lo, hi).to(DT, bitcast=True)
        t = gl.permute(t, [0, 2, 4, 3, 1, 5])  # column 32 v + 16 j1 + 8 j0 + 2 q + e
        return gl.convert_layout(gl.reshape(t, [BN, 64]), A_LAYOUT)

    @gluon.jit
    def _decode(words, amax, lv0, lv1, lv2, lv3, QUARTER: gl.constexpr, BN: gl.constexpr, DT: gl.constexpr,
                A_LAYOUT: gl.constexpr):
        """[BN, 8] words (words_layout) and their rows' absmax [BN] -> the [BN, 64] A operand (`a_fragment`)."""
        w0, w1 = gl.split(gl.reshape(words, [BN, 4, 2]))  # [BN, 4 (q)]: words 2q and 2q + 1 of the row's step
        t0, t1, t2, t3, t4, t5, t6, t7 = quad_tables(w0, amax, lv0, lv1, lv2, lv3, QUARTER)
        return a_fragment(w0, w1, t0, t1, t2, t3, t4, t5, t6, t7, BN, DT, A_LAYOUT)

    @gluon.jit
    def store_tile(acc, off_n, off_m, M, N, bias_ptr, out_ptr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                  DT: gl.constexpr):
        """The swap-AB epilogue: acc [BN rows of W, BM rows of x] (float32) -> out[m, n] rounded to DT (+ bias), or
        (PARTIAL) the float32 partial sums of split program_id(2) of [split, M, N]."""
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        ACC: gl.constexpr = acc.type.layout
        n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
        mask = gl.expand_dims(n < N, 1) & gl.expand_dims(m < M, 0)
        idx = gl.expand_dims(m.to(gl.int64), 0) * N + gl.expand_dims(n, 1)
        if PARTIAL:
            gl.store(out_ptr + gl.program_id(2).to(gl.int64) * M * N + idx, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + idx, acc.to(DT), mask=mask)

    @gluon.jit
    def _step(s, acc, amax, q_next, x_desc, w_desc, x_smem, w_smem, bars, absmax_ptr, absmax2_ptr, code2_ptr,
              offset, blk, row_ok, off_m, off_n, k0, n_steps, last, lv0, lv1, lv2, lv3, step_bytes: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, DOUBLE_QUANT: gl.constexpr, QUARTER: gl.constexpr,
              MUL: gl.constexpr, DT: gl.constexpr, WORDS: gl.constexpr, A_LAYOUT: gl.constexpr):
        """One step: decode the stage's words into the A fragment, issue the wgmma, leave one in flight, refill
        the stage the retired wgmma read; the absmax chain (loaded two steps ahead, made one step ahead)."""
        st = s % STAGES
        q_after = gl.load(absmax_ptr + blk + gl.minimum(s + 2, last))
        mbarrier.wait(bars.index(st), (s // STAGES) & 1)
        words = w_smem.index(st).load(WORDS).to(gl.uint32, bitcast=True)
        a = _decode(words, amax, lv0, lv1, lv2, lv3, QUARTER, BN, DT, A_LAYOUT)
        acc = warpgroup_mma(a, x_smem.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        nxt = s + STAGES - 1
        ns = nxt % STAGES
        ok = nxt < n_steps
        mbarrier.expect(bars.index(ns), step_bytes, pred=ok)
        tma_load(x_desc, [off_m, (k0 + nxt) * 64], bars.index(ns), x_smem.index(ns), pred=ok)
        tma_load(w_desc, [off_n, (k0 + nxt) * 8], bars.index(ns), w_smem.index(ns), pred=ok)
        amax = block_absmax(q_next, blk + gl.minimum(s + 1, last), row_ok, absmax2_ptr, code2_ptr, offset, DOUBLE_QUANT,
                       MUL)
        return acc, amax, q_after

    @gluon.jit
    def nf4_gemm_gluon_kernel(x_desc, w_desc, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, bias_ptr,
                              out_ptr, M, N, K, SEG, BM: gl.constexpr, STAGES: gl.constexpr,
                              DOUBLE_QUANT: gl.constexpr, PARTIAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                              QUARTER: gl.constexpr, MUL: gl.constexpr, WORDS: gl.constexpr,
                              num_warps: gl.constexpr):
        """Program (i, j, s): rows 16 num_warps i .. of W against rows BM j .. of x (permuted), steps SEG s ..
        (SEG even; every split non-empty); out [M, N] in x's dtype, or float32 partials [split, M, N]."""
        BN: gl.constexpr = 16 * num_warps
        DT: gl.constexpr = x_desc.dtype
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BM, 16])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, WORDS)
        KB = K // 64
        off_n = gl.program_id(0) * BN
        off_m = gl.program_id(1) * BM
        k0 = gl.program_id(2) * SEG
        n_steps = gl.minimum(SEG, KB - k0)
        last = n_steps - 1

        x_smem = gl.allocate_shared_memory(DT, [STAGES, BM, 64], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 8], w_desc.layout)
        step_bytes: gl.constexpr = BM * 64 * 2 + BN * 8 * 4
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES - 1):
            ok = i < n_steps
            mbarrier.expect(bars.index(i), step_bytes, pred=ok)
            tma_load(x_desc, [off_m, (k0 + i) * 64], bars.index(i), x_smem.index(i), pred=ok)
            tma_load(w_desc, [off_n, (k0 + i) * 8], bars.index(i), w_smem.index(i), pred=ok)

        rows = off_n + gl.arange(0, BN, layout=ROWS)
        row_ok = rows < N
        blk = gl.minimum(rows, N - 1) * KB + k0  # each row's first block (rows past W: its last row's)
        if DOUBLE_QUANT:
            offset = gl.load(offset_ptr)
        else:
            offset = 0.0
        amax = block_absmax(gl.load(absmax_ptr + blk), blk, row_ok, absmax2_ptr, code2_ptr, offset, DOUBLE_QUANT, MUL)
        q_next = gl.load(absmax_ptr + blk + gl.minimum(1, last))
        # this lane's four levels NF4[4q + j], as [BN, 4] tensors in the split words' layout
        cols = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
        c0, _ = gl.split(gl.reshape(gl.zeros([BN, 8], gl.int32, WORDS) + gl.expand_dims(cols, 0), [BN, 4, 2]))
        lv0 = gl.load(code_ptr + 2 * c0)
        lv1 = gl.load(code_ptr + 2 * c0 + 1)
        lv2 = gl.load(code_ptr + 2 * c0 + 2)
        lv3 = gl.load(code_ptr + 2 * c0 + 3)
        acc = gl.zeros([BN, BM], gl.float32, ACC)
        # two steps an iteration, each with its own A registers: PTX forbids writing an in-flight wgmma's A
        for s in range(0, n_steps, 2):
            acc, amax, q_next = _step(s, acc, amax, q_next, x_desc, w_desc, x_smem, w_smem, bars, absmax_ptr,
                                      absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last,
                                      lv0, lv1, lv2, lv3, step_bytes, BN, STAGES, DOUBLE_QUANT, QUARTER, MUL, DT,
                                      WORDS, A_LAYOUT)
            acc, amax, q_next = _step(s + 1, acc, amax, q_next, x_desc, w_desc, x_smem, w_smem, bars, absmax_ptr,
                                      absmax2_ptr, code2_ptr, offset, blk, row_ok, off_m, off_n, k0, n_steps, last,
                                      lv0, lv1, lv2, lv3, step_bytes, BN, STAGES, DOUBLE_QUANT, QUARTER, MUL, DT,
                                      WORDS, A_LAYOUT)
        acc = warpgroup_mma_wait(0, deps=[acc])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        store_tile(acc, off_n, off_m, M, N, bias_ptr, out_ptr, PARTIAL, HAS_BIAS, DT)
