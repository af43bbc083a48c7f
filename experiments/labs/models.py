"""NumPy models of the lab GEMV candidates (experiments.labs.kernels): their inline asm run by a vectorised PTX
emulator, and the kernel's assignment of weights to mma fragments, so that the operand can be checked against
`reference.nf4.dequantize_nf4` on a machine without a GPU (Triton's interpreter cannot run inline PTX).

- `run_ptx(asm, inputs, shared)`: runs one inline-asm text (the kernels' own constexpr strings) on arrays of
  32-bit registers, one element per simulated thread; `ld.shared` reads the emulated shared window `shared`
  (`Shared`: bytes at a base address, like the CTA's window on sm_90: the first static variable at 0x400).
- `fill_shared(mode, copies, base)`: the table `fill_table` writes, laid out by the same address formula.
- `decode_word(mode, words, absmax, ...)`: the 4 pairs of 16-bit weights of 32-bit words, as the mode's asm
  (and, for MODE 0, nf4.device's product_table + table_pairs asm) computes them, for lanes `lane`; for MODE 1
  `pair_asm` may give another text with the same operands (nf4.linear.gemv_pair's, the product kernel).
- `operand_matrix(mode, q, x_dtype, ...)`: for a whole weight, every (row n, column k of x) product the kernel
  forms, as [N, K] uint16 bits of the weight that meets x[:, k] in row n's output; each (n, k) must be formed
  exactly once (checked) by following the kernel's loop: program tiles, warps, lanes 4g + t, steps, words, the
  two mma.sync of a word and the PTX m16n8k16 fragment layout (A: a0 row g cols 2t, 2t + 1; a1 row g + 8; a2 /
  a3 the same at cols 2t + 8, 2t + 9; B: b0 rows 2t, 2t + 1 and b1 rows 2t + 8, 2t + 9 of column g).
The operand is exact iff operand_matrix == dequantize_nf4(q, x_dtype, ftz=True) bit for bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from reference.floats import cast_float32, flush_subnormal
from reference.format import NF4_CODE
from reference.nf4 import NF4Quantized, recover_absmax

from . import kernels as K

MASK = np.uint64(0xFFFFFFFF)
SHARED_BASE = 0x400  # where ptxas puts the first static .shared variable on sm_90 (cluster rank 0)


@dataclass
class Shared:
    """An emulated shared window: `data` bytes starting at address `base`."""

    base: int
    data: np.ndarray  # uint8

    def load32(self, addr: np.ndarray) -> np.ndarray:
        off = addr.astype(np.int64) - self.base
        if (off < 0).any() or (off + 4 > self.data.size).any() or (off % 4).any():
            raise IndexError("ld.shared outside the table or misaligned")
        words = self.data.view(np.uint32)
        return words[off // 4].astype(np.uint64)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint64) & MASK).astype(np.uint32).view(np.float32)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)


def _prmt(a, b, c):
    src = (a & MASK) | ((b & MASK) << np.uint64(32))
    d = np.zeros_like(a)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> (np.uint64(8) * (sel & np.uint64(7)))) & np.uint64(0xFF)
        byte = np.where((sel & np.uint64(8)) != 0, np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)),
                        byte)
        d |= byte << np.uint64(8 * i)
    return d


def _cvt(dtype):
    def f(hi, lo):
        h = cast_float32(_f32(hi), dtype).view(np.uint16).astype(np.uint64)
        l_ = cast_float32(_f32(lo), dtype).view(np.uint16).astype(np.uint64)
        return (h << np.uint64(16)) | l_
    return f


def _mul_ftz(a, b):
    return _bits(flush_subnormal(flush_subnormal(_f32(a)) * flush_subnormal(_f32(b))))


OPS = {
    "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
    "shl.b32": lambda a, b: a << b, "shr.b32": lambda a, b: (a & MASK) >> b,
    "add.u32": lambda a, b: a + b,
    "mul.lo.u32": lambda a, b: (a & MASK) * (b & MASK),
    "mad.lo.u32": lambda a, b, c: (a & MASK) * (b & MASK) + c,
    "mul.hi.u32": lambda a, b: (((a & MASK) * (b & MASK)) >> np.uint64(32)) if (b <= 0xFFFFFFFF).all() else None,
    "prmt.b32": _prmt,
    "mul.rn.ftz.f32": _mul_ftz,
    "mul.rn.f32": lambda a, b: _bits(_f32(a) * _f32(b)),
    "cvt.rn.bf16x2.f32": _cvt("bfloat16"),
    "cvt.rn.f16x2.f32": _cvt("float16"),
}


def _mul_hi(a, b):
    """hi32 of a 32 x 32-bit product without overflowing uint64: split b in halves."""
    a, b = a & MASK, b & MASK
    lo = a * (b & np.uint64(0xFFFF))
    hi = a * (b >> np.uint64(16))
    return (hi + (lo >> np.uint64(16))) >> np.uint64(16)


def _mul_lo(a, b):
    a, b = a & MASK, b & MASK
    return (a * (b & np.uint64(0xFFFF)) + ((a * (b >> np.uint64(16))) << np.uint64(16))) & MASK


OPS["mul.hi.u32"] = _mul_hi
OPS["mul.lo.u32"] = _mul_lo
OPS["mad.lo.u32"] = lambda a, b, c: (_mul_lo(a, b) + c) & MASK
OPS["mad.hi.u32"] = lambda a, b, c: (_mul_hi(a, b) + c) & MASK


def _value(token: str, regs: dict):
    token = token.strip()
    if token.startswith("0f"):
        return np.uint64(int(token[2:], 16))
    if token[0].isdigit():
        return np.uint64(int(token, 0))
    return regs[token]


def run_ptx(asm, inputs: dict, shared: Shared | None = None) -> dict:
    """Run inline-asm text on arrays of 32-bit registers (inputs: {"$4": array or int}); returns every register.
    Knows the instructions of experiments.labs.kernels and nf4.device's product table / lookup."""
    text = getattr(asm, "value", asm)
    regs = {k: np.asarray(v, dtype=np.uint64) & MASK for k, v in inputs.items()}
    for stmt in text.split(";"):
        stmt = stmt.replace("{", " ", 1) if stmt.strip().startswith("{") else stmt
        stmt = stmt.strip().lstrip("{").strip().rstrip("}").strip()
        if not stmt or stmt.startswith(".reg") or stmt == "}":
            continue
        m = re.match(r"^ld\.shared\.v2\.f32\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*\[(\S+)\]$", stmt)
        if m:
            addr = regs[m.group(3)]
            regs[m.group(1)] = shared.load32(addr)
            regs[m.group(2)] = shared.load32(addr + np.uint64(4))
            continue
        m = re.match(r"^ld\.shared\.(?:f32|b32)\s+(\S+)\s*,\s*\[(\S+)\]$", stmt)
        if m:
            regs[m.group(1)] = shared.load32(regs[m.group(2)])
            continue
        op, rest = stmt.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        vals = [_value(s, regs) for s in srcs]
        regs[dst] = np.asarray(OPS[op](*vals), dtype=np.uint64) & MASK
    return regs


# --- the tables -------------------------------------------------------------------------------------------------

def fill_shared(mode: int, copies: int, base: int = SHARED_BASE, code=NF4_CODE) -> Shared:
    """The shared table as `fill_table` writes it (same address formulas), in an emulated window at `base`."""
    code = np.asarray(code, dtype=np.float32)
    if mode == 1:
        data = np.zeros(256 * 8 * copies, dtype=np.uint8)
        words = data.view(np.uint32)
        idx = np.arange(256 * copies)
        e = idx // copies
        addr = e * (8 * copies) + (idx % copies) * 8
        words[addr // 4] = code[e >> 4].view(np.uint32)
        words[addr // 4 + 1] = code[e & 15].view(np.uint32)
    else:
        if base % 256:
            raise ValueError("the level table is 256-byte aligned")
        data = np.zeros(64, dtype=np.uint8)
        e = np.arange(16)
        data.view(np.uint32)[e] = code[e].view(np.uint32)
    return Shared(base, data)


def _x_dtype_name(x_dt: int) -> str:
    return {1: "float16", 2: "bfloat16"}[x_dt]


def decode_word(mode: int, words: np.ndarray, absmax: np.ndarray, lane: np.ndarray, x_dt: int = 2,
                copies: int = 16, shared: Shared | None = None, pair_asm=None) -> np.ndarray:
    """[..., 4] uint32 pairs of the words (uint32) with their blocks' absmax (float32), for lanes `lane`
    (their table copy), by the mode's own asm text (MODE 1: `pair_asm(dtype)`'s where given)."""
    dtype = "bf16" if x_dt == 2 else "f16"
    words = np.asarray(words, dtype=np.uint64)
    absmax_bits = _bits(absmax)
    if mode == 0:
        from nf4.device import LOOKUP_ASM, table_asm

        t = run_ptx(table_asm(True, dtype), {"$8": absmax_bits})
        inputs = {"$4": words, **{f"${5 + i}": t[f"${i}"] for i in range(8)}}
        out = run_ptx(LOOKUP_ASM, inputs)
    elif mode == 1:
        shared = shared or fill_shared(1, copies)
        lanebase = np.uint64(shared.base) + (np.asarray(lane, dtype=np.uint64) % np.uint64(copies)) * np.uint64(8)
        consts = K.pair_constants(copies, 0)
        x = lanebase << np.uint64(16 - K.pair_shift(copies))
        inputs = {"$4": words, "$5": lanebase, "$6": absmax_bits, "$7": x,
                  **{f"${8 + i}": np.uint64(c) for i, c in enumerate(consts[1:])}}
        out = run_ptx((pair_asm or K.pair_asm)(dtype), inputs, shared)
    elif mode == 2:
        shared = shared or fill_shared(2, 1)
        out = run_ptx(K.level_prmt_asm(dtype), {"$4": words, "$5": np.uint64(shared.base), "$6": absmax_bits},
                      shared)
    else:
        shared = shared or fill_shared(3, 1)
        inputs = {"$4": words, "$5": np.uint64(shared.base), "$6": absmax_bits, "$15": np.uint64(1),
                  **{f"${7 + i}": np.uint64(1 << e) for i, e in enumerate(K.LEVEL_MULTIPLIERS)}}
        out = run_ptx(K.level_imad_asm(dtype), inputs, shared)
    return np.stack([out[f"${i}"] for i in range(4)], axis=-1).astype(np.uint32)


def operand_matrix(mode: int, q: NF4Quantized, x_dt: int = 2, copies: int = 16, prmt_words: int = 0,
                   num_warps: int = 4, split: int = 1, *, pair_asm=None, ftz: bool = True) -> np.ndarray:
    """[N, K] uint16: the weight bits the kernel multiplies with x[:, k] for output row n, following its loop
    (see the module doc); raises if a product is formed twice or never. Needs blocksize 64, K % 256 == 0.
    pair_asm: MODE 1's asm text by dtype (default the lab's; nf4.linear.gemv_pair's takes the same loop); ftz: the
    absmax recovered with ftz (as the kernel's FTZ), the decode's own flush is its asm text's."""
    n_rows, k_cols = q.shape
    kb = k_cols // 2
    if q.blocksize != 64 or kb % K.STEP_BYTES:
        raise ValueError("the lab kernels take blocksize 64 and K a multiple of 256")
    absmax = recover_absmax(q, ftz=ftz)
    packed = np.asarray(q.packed, dtype=np.uint8).reshape(-1)
    words_all = packed.view(np.uint32)
    shared = fill_shared(mode if mode else 1, copies if mode == 1 else 1) if mode else None
    out = np.zeros((n_rows, k_cols), dtype=np.uint16)
    seen = np.zeros((n_rows, k_cols), dtype=np.int32)
    threads = 32 * num_warps
    i = np.arange(threads)
    lane, g, t = i % 32, (i % 32) // 4, i % 4
    seg = -(-kb // split)
    seg = -(-seg // K.STEP_BYTES) * K.STEP_BYTES
    tiles = -(-n_rows // (threads // 2)) * split
    for tile in range(tiles):
        pid_k = tile % split
        row_a = (tile // split) * (threads // 2) + (i // 32) * 16 + g
        row_b = row_a + 8
        ra, rb = np.minimum(row_a, n_rows - 1), np.minimum(row_b, n_rows - 1)
        first, end = pid_k * seg, min(pid_k * seg + seg, kb)
        for c0 in range(first, end, K.STEP_BYTES):
            j = c0 + t * 32  # the lane's first byte of the step
            amax = {r: absmax[(rr * kb + j) // 32] for r, rr in (("a", ra), ("b", rb))}
            for qw in range(8):
                byte0 = j + 4 * qw
                pairs = {}
                for r, rr in (("a", ra), ("b", rb)):
                    w = words_all[(rr * kb + byte0) // 4]
                    pairs[r] = decode_word(0 if qw < prmt_words else mode, w, amax[r], lane, x_dt, copies, shared,
                                           pair_asm)
                # mma 1: a0 = pa[0] (row g, slots 2t, 2t+1) with b0 = x pair of byte0; a2 = pa[1] with b1 = byte0 + 1
                # mma 2: the same with pairs 2, 3 (bytes byte0 + 2, + 3); a1 / a3: row g + 8 (pb)
                for p in range(4):
                    xbyte = byte0 + p  # the B register's x pair: x[2 * xbyte], x[2 * xbyte + 1]
                    for r, row in (("a", row_a), ("b", row_b)):
                        ok = row < n_rows
                        val = pairs[r][:, p]
                        for half in range(2):
                            col = 2 * xbyte + half
                            rows_ok, cols_ok = row[ok], col[ok]
                            out[rows_ok, cols_ok] = ((val[ok] >> (16 * half)) & 0xFFFF).astype(np.uint16)
                            np.add.at(seen, (rows_ok, cols_ok), 1)
    if (seen != 1).any():
        bad = np.argwhere(seen != 1)[:5]
        raise AssertionError(f"products formed {seen[tuple(bad.T)]} times at {bad.tolist()}")
    return out


def expected_operand(q: NF4Quantized, x_dt: int = 2, ftz: bool = True) -> np.ndarray:
    """dequantize_nf4(q, x dtype, ftz) as uint16 bits (W's dtype is x's in these kernels)."""
    from reference.nf4 import dequantize_nf4

    w = dequantize_nf4(q, _x_dtype_name(x_dt), ftz=ftz)
    return np.asarray(w).view(np.uint16).reshape(q.shape)
