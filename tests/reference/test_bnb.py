"""The NumPy reference against bitsandbytes 0.50.2 on the CPU, bit for bit (integer views).

Quantization: `reference.quantize_nf4` against `bitsandbytes.functional.quantize_4bit`, field by
field (packed bytes, absmax, absmax_u8, absmax2, offset, code2). Dequantization:
`reference.dequantize_nf4(reference.from_bnb(packed, state), out_dtype)` against both CPU routes of
bitsandbytes (helpers below): (a) the pure-torch default backend, eager on the whole grid and
compiled on a few cases, and (b) `functional.dequantize_4bit` (native C++ kernel plus fallbacks).
The grid: every blocksize, every input and output dtype (out_dtype may differ from the quantized
dtype: the state's dtype is overridden, as the Unsloth harness does), double quantization on and
off, 1-D / odd / tail / 3-D / (9, 41, 341) shapes, packed tensors of shape (1, n), and
quant_storage=torch.bfloat16.

Disagreements, and which side is wrong (first principles: docs/FORMAT.md §3-§4, the weight is
one exact float32 product `NF4[nibble] * absmax[i // blocksize]`, rounded to nearest even once):

1. bitsandbytes, route (b), absmax index. The AVX512 branch of `dequantizeBlockwise4bitCpu`
   (csrc/cpu_ops.cpp; taken when the last dim is a multiple of 16 and blocksize < 2048) views the
   tensor as [rows, n] and reads the scale of element (row, col) at
   `row * (n / blocksize) + (col rounded down to 16) / blocksize`, integer divisions. The format's
   block is `(row * n + col) // blocksize`. The two agree only when every row holds whole blocks.
   Example: shape (64, 64), blocksize 128: element (2, 0) is flat index 128, block 1, but the kernel
   reads absmax[2 * (64 / 128) + 0] = absmax[0]; every row reads absmax[0]. bitsandbytes' output
   equals that wrong-index product bit for bit (`test_native_absmax_index_bug_mechanism`), so the
   reference is right and bitsandbytes is wrong. (The Python wrapper already routes blocksize >= 2048
   to the default backend "as AVX512 implementation has accuracy issues with blocksize >= 2048":
   this indexing is the accuracy issue, and it is not limited to blocksize >= 2048.)
2. bitsandbytes, route (b), shape. For a 1-D `QuantState.shape` (n,) with n even the CPU kernel sets
   `shape = (1, n)` and returns its output in that shape: the values are right, the shape is not
   `QuantState.shape` (the default backend and CUDA return (n,)); with a packed tensor of shape
   (1, ...) the `out.t()` shim then gives (n, 1).
3. bitsandbytes, route (b), bf16 subnormals. On a CPU with AVX512_BF16 the AVX512 branch converts
   with `_mm512_cvtneps_pbh`, which treats subnormal float32 inputs as zero: a product such as
   1e-39 (bits 0x000AE398) comes out as bf16 0x0000, where round-to-nearest-even gives 0x000B (what
   torch's `.to(torch.bfloat16)`, the default backend and the C++ scalar branch give). The
   disassembly of the 0.50.2 libbitsandbytes_cpu.so shows it: the AVX512 loop body (0x85d0, NF4 and
   FP4 folded) tests has_avx512bf16() and then runs `vcvtneps2bf16`, else a software RNE. Only absmax
   values near 1e-38 reach it. Its output is the IEEE product flushed at that one conversion, not the
   reference's `ftz=True` mode, which also flushes inside the absmax recovery (as CUDA does).
4. The reference, quantization of an all-zero tail block: bitsandbytes stores the clamped absmax
   `1e-38` for the tail block (`A_flat[full:].abs().max().clamp(min=1e-38)` is what is concatenated),
   the reference stores 0.0. bitsandbytes defines the format here: the reference is wrong.
5. The reference, absmax_u8: the nearest-code 8-bit quantizer it had picked the neighbouring code
   in some blocks and gave a block of exact zeros 255 (0 / 0 = NaN) where bitsandbytes writes 0.
   `reference.binsearch` (bitsandbytes 0.50.2's 65536-point table) replaced it; every absmax_u8
   case here now matches.
Items 1-3 are `xfail(strict=True)`; item 4 is a plain failure until the reference is fixed.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import zlib
from math import prod

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a warning about an optional CPU package

import bitsandbytes.functional as F  # noqa: E402
from bitsandbytes.backends.cpu import ops as bnb_cpu_ops  # noqa: E402
from bitsandbytes.backends.default import ops as bnb_default_ops  # noqa: E402
from bitsandbytes.backends.utils import _get_4bit_code  # noqa: E402

import reference  # noqa: E402
from reference.bnb import bnb_transposes  # noqa: E402
from reference.floats import cast_float32, flush_subnormal  # noqa: E402
from verify.exact import assert_bitexact, compare  # noqa: E402

DTYPE_NAMES = ("float16", "bfloat16", "float32")

# --- helpers: seeded data, the two routes, and which branch of route (b) a case takes -----------


def case_seed(*key) -> int:
    """A stable seed from a test's parameters (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


def random_weights(shape, seed: int, *, scale: float | None = None) -> np.ndarray:
    """float32 normal weights with a per-case scale, some exact zeros and a few 4x outliers.

    The zeros exercise nibble 7. A 16x ramp along the flattened tensor keeps distant blocks'
    absmax apart even after rounding to bf16, so reading a wrong block's absmax always shows.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat *= np.exp2(np.linspace(-2.0, 2.0, flat.size)).astype(np.float32)
    if flat.size >= 8:
        flat[rng.choice(flat.size, size=max(1, flat.size // 20), replace=False)] = 0.0
        flat[rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)] *= np.float32(4.0)
    s = np.float32(10.0 ** rng.uniform(-2.0, 1.0)) if scale is None else np.float32(scale)
    return (x * s).astype(np.float32)


def torch_dtype(name: str):
    """The torch dtype named 'float16', 'bfloat16' or 'float32'."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


@functools.cache
def bnb_quantized(shape, blocksize, dtype, cs, storage="uint8", threads=None, scale=None):
    """bitsandbytes' quantize_4bit of seeded weights, cached: never mutate what it returns.

    Returns (x, packed, state, threads used for the offset's mean).
    """
    x = torch.from_numpy(random_weights(shape, case_seed(shape, blocksize, dtype, cs, scale), scale=scale))
    x = x.to(torch_dtype(dtype))
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used = torch.get_num_threads()
        packed, state = F.quantize_4bit(
            x,
            blocksize=blocksize,
            compress_statistics=cs,
            quant_type="nf4",
            quant_storage=torch.uint8 if storage == "uint8" else torch_dtype(storage),
        )
    finally:
        torch.set_num_threads(old)
    return x, packed, state, used


def bnb_absmax(state):
    """The float32 absmax as bitsandbytes recovers it: `dequantize_blockwise(absmax, state2) + offset`."""
    if not state.nested:
        return state.absmax
    return F.dequantize_blockwise(state.absmax, state.state2) + state.offset


def route_default(packed, state, out_dtype: str, *, compiled: bool = False):
    """Route (a): the default backend's `_dequantize_4bit_compute`, eager unless `compiled`."""
    fn = bnb_default_ops._dequantize_4bit_compute
    if not compiled:
        fn = fn.__wrapped__
    a = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    code = _get_4bit_code("nf4", a.device)
    return fn(a.reshape(-1), bnb_absmax(state), code, state.blocksize, state.shape, torch_dtype(out_dtype))


def route_native(packed, state, out_dtype: str):
    """Route (b): `F.dequantize_4bit` on a shallow copy of the state with its dtype overridden."""
    state = copy.copy(state)
    state.dtype = torch_dtype(out_dtype)
    return F.dequantize_4bit(packed, state, quant_type="nf4")


def reference_dequant(packed, state, out_dtype: str, *, ftz: bool = False, transpose: bool = True):
    """`reference.dequantize_nf4(reference.from_bnb(packed, state), out_dtype)`, transposed like
    bitsandbytes' `out.t()` when the packed tensor's shape[0] is 1 (and `transpose`)."""
    out = reference.dequantize_nf4(reference.from_bnb(packed, state), out_dtype, ftz=ftz)
    if transpose and bnb_transposes(packed):
        out = out.T  # like torch's t(): a no-op on 1-D
    return out


def native_takes_cpp(shape, blocksize: int) -> bool:
    """Route (b) runs the C++ kernel: not an odd last dim, not blocksize >= 2048 on AVX512."""
    avx512_fallback = bnb_cpu_ops._has_avx512 and blocksize >= 2048
    return not (avx512_fallback or shape[-1] % 2 != 0)


def native_takes_avx512(shape, blocksize: int) -> bool:
    """The C++ kernel takes its AVX512 branch: AVX512F CPU, last dim a multiple of 16."""
    has_avx512f = bool(F.lib.has_avx512f_cpu()) if hasattr(F.lib, "has_avx512f_cpu") else bnb_cpu_ops._has_avx512
    return native_takes_cpp(shape, blocksize) and has_avx512f and shape[-1] % 16 == 0 and blocksize >= 16


def native_absmax_index_bug(shape, blocksize: int) -> bool:
    """Disagreement 1 applies: AVX512 branch, >= 2 rows, last dim not a multiple of blocksize,
    more than one block (then some element reads another block's absmax)."""
    rows = prod(shape[:-1]) if len(shape) > 1 else 1
    return (
        native_takes_avx512(shape, blocksize) and rows >= 2 and shape[-1] % blocksize != 0 and prod(shape) > blocksize
    )


def native_returns_2d_for_1d(shape, blocksize: int) -> bool:
    """Disagreement 2 applies: the C++ route and a 1-D shape."""
    return len(shape) == 1 and native_takes_cpp(shape, blocksize)


def native_bf16_flushes_subnormals() -> bool:
    """Disagreement 3 applies: the library converts to bf16 with AVX512_BF16's vcvtneps2bf16."""
    return bool(F.has_avx512bf16())


def native_avx512_model(q, out_dtype: str) -> np.ndarray:
    """What the C++ AVX512 branch computes, rebuilt from the reference's arrays.

    Element (row, col) of the [rows, n] view is `NF4[nibble] * absmax[row * (n // blocksize) +
    (col // 16 * 16) // blocksize]`, one float32 product, rounded to `out_dtype` (bf16 after
    vcvtneps2bf16's flush of subnormals where the CPU has AVX512_BF16).
    """
    shape = q.shape if len(q.shape) > 1 else (1, q.shape[0])
    rows, n = prod(shape[:-1]), shape[-1]
    absmax = reference.recover_absmax(q)
    levels = reference.NF4_CODE[reference.unpack_nibbles(q.packed, q.numel)].reshape(rows, n)
    index = np.arange(rows)[:, None] * (n // q.blocksize) + (np.arange(n)[None, :] // 16 * 16) // q.blocksize
    y = (levels * absmax[index]).astype(np.float32)
    if out_dtype == "bfloat16" and native_bf16_flushes_subnormals():
        y = flush_subnormal(y)
    return cast_float32(y, out_dtype).reshape(shape)


# Small shapes take the full blocksize x dtype x compress_statistics cross product.
SMALL_SHAPES = [
    (1,),
    (2,),  # packed (1, 1): bitsandbytes transposes
    (7,),
    (100,),  # 1-D, even, tail at every blocksize
    (1, 2),  # packed (1, 1): out.t() gives (2, 1)
    (3, 48),
    (9, 42),  # even last dim, not a multiple of 16: C++ scalar branch
    (64, 64),
    (33, 130),
    (5, 7, 3),
    (2, 3, 64),
]
# Larger shapes, trimmed: (9, 41, 341) every blocksize and dtype with double quantization, three
# blocksizes without; (64, 4096) (rows of whole blocks: the AVX512 branch's good case) four blocksizes.
CASES = list(itertools.product(SMALL_SHAPES, reference.BLOCKSIZES, DTYPE_NAMES, (True, False)))
CASES += itertools.product([(9, 41, 341)], reference.BLOCKSIZES, DTYPE_NAMES, (True,))
CASES += itertools.product([(9, 41, 341)], (32, 256, 4096), DTYPE_NAMES, (False,))
CASES += itertools.product([(64, 4096)], (64, 128, 1024, 4096), DTYPE_NAMES, (True,))


def _case_id(shape, bs, dtype, cs, *rest) -> str:
    parts = ["x".join(map(str, shape)), f"bs{bs}", dtype, "dq" if cs else "nodq", *(str(r) for r in rest if r)]
    return "-".join(parts)


def _params(cases, marks_for=None):
    out = []
    for case in cases:
        marks = marks_for(*case) if marks_for else ()
        out.append(pytest.param(*case, id=_case_id(*case), marks=marks))
    return out


XFAIL_INDEX = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="bitsandbytes bug: the AVX512 branch of dequantizeBlockwise4bitCpu reads absmax[row * (n // blocksize) "
    "+ col // blocksize] instead of absmax[(row * n + col) // blocksize] when rows do not hold whole blocks",
)
XFAIL_1D = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="bitsandbytes bug: the CPU dequantize_4bit kernel returns shape (1, n) for a 1-D QuantState.shape (n,)",
)
XFAIL_BF16_DAZ = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="bitsandbytes: the AVX512 branch converts to bf16 with _mm512_cvtneps_pbh (AVX512_BF16), which flushes "
    "subnormal float32 products to zero instead of rounding them to nearest even",
)


def _native_marks(shape, bs, *_):
    marks = []
    if native_absmax_index_bug(shape, bs):
        marks.append(XFAIL_INDEX)
    if native_returns_2d_for_1d(shape, bs):
        marks.append(XFAIL_1D)
    return marks


def _check_all(results) -> None:
    bad = [str(r) for r in results if not r.ok]
    assert not bad, "\n".join(bad)


def _quantize_both(shape, bs, dtype, cs, storage="uint8", threads=None):
    x, packed, state, used = bnb_quantized(shape, bs, dtype, cs, storage, threads)
    mine = reference.quantize_nf4(reference.tensor_to_numpy(x), bs, double_quant=cs, dtype=dtype, mean_threads=used)
    return mine, reference.from_bnb(packed, state), packed, state


# --- packing ----------------------------------------------------------------------------------


def test_packing_order_matches_bnb():
    """Element 2k is the high nibble: [1.0, -1.0, 0.5, 0.0] packs to F0 C7 in both."""
    x = np.array([1.0, -1.0, 0.5, 0.0], dtype=np.float32)
    packed, _ = F.quantize_4bit(torch.from_numpy(x), blocksize=64, quant_type="nf4")
    expected = np.array([0xF0, 0xC7], dtype=np.uint8)
    assert_bitexact(packed.reshape(-1), expected, name="bitsandbytes packed")
    assert_bitexact(reference.quantize_nf4(x, 64).packed, expected, name="reference packed")


@pytest.mark.parametrize("n", [1, 3, 65, 127, 4097])
def test_odd_numel_pads_with_zero_nibble_like_bnb(n):
    """The last low nibble of an odd numel is the nibble of 0.0 (7) in both."""
    x = np.random.default_rng(case_seed("pad", n)).standard_normal(n).astype(np.float32) + np.float32(3.0)
    packed, _ = F.quantize_4bit(torch.from_numpy(x), blocksize=64, quant_type="nf4")
    assert int(packed.reshape(-1)[-1]) & 0xF == reference.format.NF4_ZERO_INDEX
    assert int(reference.quantize_nf4(x, 64).packed[-1]) & 0xF == reference.format.NF4_ZERO_INDEX


# --- quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(CASES))
def test_quantize_matches_bnb(shape, bs, dtype, cs):
    """Packed bytes, absmax (no DQ) or absmax2 / offset / code2 (DQ), and the metadata."""
    mine, theirs, _, _ = _quantize_both(shape, bs, dtype, cs)
    assert (mine.shape, mine.dtype, mine.blocksize) == (theirs.shape, theirs.dtype, theirs.blocksize)
    assert mine.double_quant == theirs.double_quant == cs
    results = [compare(mine.packed, theirs.packed, name="packed")]
    if cs:
        results += [
            compare(mine.absmax2, theirs.absmax2, name="absmax2"),
            compare(np.atleast_1d(mine.offset), np.atleast_1d(theirs.offset), name="offset"),
            compare(mine.code2, theirs.code2, name="code2"),
        ]
    else:
        results.append(compare(mine.absmax, theirs.absmax, name="absmax"))
    _check_all(results)


ABSMAX_U8_CASES = [c for c in CASES if c[3]] + [((1024, 1056), 32, "bfloat16", True)]


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(ABSMAX_U8_CASES))
def test_quantize_absmax_u8_matches_bnb(shape, bs, dtype, cs):
    """The 8-bit codes of the double-quantized absmax (bitsandbytes' native CPU quantize_blockwise)."""
    mine, theirs, _, _ = _quantize_both(shape, bs, dtype, cs)
    assert_bitexact(mine.absmax_u8, theirs.absmax_u8, name="absmax_u8")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bs", [32, 4096])
def test_quantize_offset_follows_thread_count(bs, threads):
    """1024 x 1056 at blocksize 32 has 33792 absmax values: torch's mean splits them over threads
    (from 32768 on), and the offset depends on the split. At blocksize 4096 (264 values) it does not."""
    mine, theirs, _, _ = _quantize_both((1024, 1056), bs, "bfloat16", True, threads=threads)
    _check_all(
        [
            compare(mine.packed, theirs.packed, name="packed"),
            compare(mine.absmax2, theirs.absmax2, name="absmax2"),
            compare(np.atleast_1d(mine.offset), np.atleast_1d(theirs.offset), name="offset"),
        ]
    )
    if bs == 32:  # the case has teeth: the other thread count's model gives another offset
        x = reference.tensor_to_numpy(bnb_quantized((1024, 1056), bs, "bfloat16", True, "uint8", threads)[0])
        other = reference.quantize_nf4(x, bs, dtype="bfloat16", mean_threads=3 - threads)
        assert other.offset != theirs.offset


@pytest.mark.parametrize("cs", [False, True], ids=["nodq", "dq"])
@pytest.mark.parametrize("case", ["zero-tail", "all-zero"])
def test_quantize_zero_tail_block(case, cs):
    """bitsandbytes stores an all-zero tail block's absmax as 1e-38 (the clamped divisor), a full
    zero block's as 0.0. Disagreement 4: the reference stores 0.0 for both, so the no-DQ cases
    and the all-zero DQ case (offset 5e-39, not 0) fail until it is fixed."""
    x = np.zeros(100, dtype=np.float32)
    if case == "zero-tail":
        x[:64] = np.random.default_rng(case_seed("zero-tail", cs)).standard_normal(64).astype(np.float32)
    packed, state = F.quantize_4bit(torch.from_numpy(x), blocksize=64, compress_statistics=cs, quant_type="nf4")
    mine, theirs = reference.quantize_nf4(x, 64, double_quant=cs), reference.from_bnb(packed, state)
    if not cs:
        assert theirs.absmax[-1] == np.float32(1e-38)  # what bitsandbytes stores
        assert_bitexact(mine.absmax, theirs.absmax, name="absmax")
    else:
        _check_all(
            [
                compare(np.atleast_1d(mine.offset), np.atleast_1d(theirs.offset), name="offset"),
                compare(mine.absmax2, theirs.absmax2, name="absmax2"),
                compare(mine.absmax_u8, theirs.absmax_u8, name="absmax_u8"),
            ]
        )


# --- dequantization: route (a), the pure-torch default backend --------------------------------


def _dequant_results(route, packed, state, dtype: str, *, transpose: bool):
    """Compare one route with the reference for every out_dtype (the quantized dtype and the two
    others, as when the state's dtype is overridden); every mismatch is reported, not just the first."""
    results = []
    for out_dtype in DTYPE_NAMES:
        theirs = route(packed, state, out_dtype)
        assert theirs.dtype == torch_dtype(out_dtype)
        mine = reference_dequant(packed, state, out_dtype, transpose=transpose)
        results.append(compare(theirs, mine, name=f"{route.__name__} ({dtype} -> {out_dtype})"))
    return results


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(CASES))
def test_dequantize_default_backend_eager(shape, bs, dtype, cs):
    """Route (a), eager: `_dequantize_4bit_compute.__wrapped__` with bitsandbytes' recovered absmax."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs)
    _check_all(_dequant_results(route_default, packed, state, dtype, transpose=False))


COMPILED_CASES = [
    ((64, 64), 64, "bfloat16", True, "bfloat16", None),
    ((9, 41, 341), 4096, "float16", True, "float32", None),
    ((100,), 32, "float32", False, "float16", None),
    ((5, 7, 3), 128, "float32", True, "bfloat16", None),
    ((4, 64), 64, "float32", True, "bfloat16", 2e-38),  # subnormal products stay subnormal
]


@pytest.mark.parametrize("shape, bs, dtype, cs, out_dtype, scale", _params(COMPILED_CASES))
def test_dequantize_default_backend_compiled(shape, bs, dtype, cs, out_dtype, scale):
    """Route (a) through bitsandbytes' torch.compile wrapper (inductor's generated C++)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the wrapper falls back to eager silently; make sure this call compiles
    graphs = counters["stats"]["unique_graphs"]
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs, scale=scale)
    theirs = route_default(packed, state, out_dtype, compiled=True)
    assert counters["stats"]["unique_graphs"] > graphs, "torch.compile did not compile (eager fallback)"
    mine = reference_dequant(packed, state, out_dtype, transpose=False)
    if scale is not None:
        assert not compare(mine, reference_dequant(packed, state, out_dtype, ftz=True, transpose=False)).ok
    assert_bitexact(theirs, mine, name=f"compiled default backend ({dtype} -> {out_dtype})")


# --- dequantization: route (b), functional.dequantize_4bit ------------------------------------


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(CASES, _native_marks))
def test_dequantize_functional(shape, bs, dtype, cs):
    """Route (b): `F.dequantize_4bit` (native C++ kernel, or the default backend for odd last dims and
    for blocksize >= 2048 on AVX512), with `out.t()` when the packed tensor's shape[0] is 1."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs)
    _check_all(_dequant_results(route_native, packed, state, dtype, transpose=True))


INDEX_BUG_CASES = [(*c, out) for c in CASES if native_absmax_index_bug(c[0], c[1]) for out in DTYPE_NAMES]


@pytest.mark.parametrize("shape, bs, dtype, cs, out_dtype", _params(INDEX_BUG_CASES[::5]))
def test_native_absmax_index_bug_mechanism(shape, bs, dtype, cs, out_dtype):
    """Evidence for disagreement 1: bitsandbytes' output is, bit for bit, NF4 times the absmax of the
    block the AVX512 branch computes (`native_avx512_model`), and that differs from the format's."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs)
    theirs = route_native(packed, state, out_dtype)
    q = reference.from_bnb(packed, state)
    assert_bitexact(theirs, native_avx512_model(q, out_dtype).reshape(shape), name="bnb vs wrong-index model")
    assert not compare(theirs, reference_dequant(packed, state, out_dtype)).ok


@pytest.mark.parametrize("n", [2, 4, 100, 4096])
def test_native_1d_shape_mechanism(n):
    """Evidence for disagreement 2: (1, n) comes back for a 1-D state, with the right values."""
    _, packed, state, _ = bnb_quantized((n,), 64, "float32", True)
    theirs = route_native(packed, state, "float32")
    expected_shape = (n, 1) if bnb_transposes(packed) else (1, n)
    assert tuple(theirs.shape) == expected_shape
    assert_bitexact(theirs.reshape(n), reference_dequant(packed, state, "float32"), name="values")


TRANSPOSE_CASES = [
    (shape, bs, "float32", True, out)
    for shape, bs, out in itertools.product([(6, 10), (5, 7), (64, 64), (100,), (7,)], [64, 128, 4096], DTYPE_NAMES)
]


@pytest.mark.parametrize("shape, bs, dtype, cs, out_dtype", _params(TRANSPOSE_CASES, _native_marks))
def test_packed_row_vector_is_transposed(shape, bs, dtype, cs, out_dtype):
    """A packed tensor reshaped to (1, -1): bitsandbytes returns `out.t()`; `bnb_transposes` says so."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs)
    row = packed.reshape(1, -1)
    assert bnb_transposes(row)
    theirs = route_native(row, state, out_dtype)
    mine = reference_dequant(row, state, out_dtype)
    assert tuple(mine.shape) == (tuple(reversed(shape)) if len(shape) == 2 else shape)
    assert_bitexact(theirs, mine, name=f"dequantize_4bit of packed (1, -1) ({out_dtype})")


# --- quant_storage=torch.bfloat16 (FSDP-QLoRA) ------------------------------------------------

# Shapes with an even number of packed bytes: bitsandbytes cannot view an odd byte count as bf16.
STORAGE_CASES = list(
    itertools.product([(3,), (7,), (64, 64), (12, 42), (2, 3, 64)], reference.BLOCKSIZES, DTYPE_NAMES, (True, False))
)
STORAGE_CASES += itertools.product([(9, 41, 343)], (64, 4096), DTYPE_NAMES, (True, False))


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(STORAGE_CASES))
def test_quant_storage_bf16_quantize(shape, bs, dtype, cs):
    """Same bytes as uint8 storage, viewed as bf16: the reference's packed equals them."""
    x, packed, _, used = bnb_quantized(shape, bs, dtype, cs, "bfloat16")
    assert packed.dtype == torch.bfloat16 and tuple(packed.shape) == ((prod(shape) + 1) // 4, 1)
    mine = reference.quantize_nf4(reference.tensor_to_numpy(x), bs, double_quant=cs, dtype=dtype, mean_threads=used)
    assert_bitexact(mine.packed, packed.reshape(-1).view(torch.uint8), name="packed (bf16 storage)")
    _, packed_u8, _, _ = bnb_quantized(shape, bs, dtype, cs)
    assert_bitexact(packed.reshape(-1).view(torch.uint8), packed_u8.reshape(-1), name="bf16 vs uint8 storage")


STORAGE_DEQUANT_CASES = [c for c in STORAGE_CASES if c[1] in (64, 256, 4096)]


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(STORAGE_DEQUANT_CASES))
def test_quant_storage_bf16_dequantize_default_backend(shape, bs, dtype, cs):
    """Route (a) reads bf16-stored bytes as uint8."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs, "bfloat16")
    _check_all(_dequant_results(route_default, packed, state, dtype, transpose=False))


@pytest.mark.parametrize("shape, bs, dtype, cs", _params(STORAGE_DEQUANT_CASES, _native_marks))
def test_quant_storage_bf16_dequantize_functional(shape, bs, dtype, cs):
    """Route (b) too; (3,) packs into one bf16 of shape (1, 1), so its output comes back transposed."""
    _, packed, state, _ = bnb_quantized(shape, bs, dtype, cs, "bfloat16")
    _check_all(_dequant_results(route_native, packed, state, dtype, transpose=True))


# --- subnormal products and rounding ties -----------------------------------------------------

SUBNORMAL_CASES = [
    (shape, 64, dt, cs, out)
    for shape, dt, cs, out in itertools.product(
        [(4, 64), (4, 42), (4, 63)], ["float32", "bfloat16"], (True, False), DTYPE_NAMES
    )
]


def _subnormal_marks(shape, bs, dtype, cs, out_dtype):
    if out_dtype == "bfloat16" and native_takes_avx512(shape, bs) and native_bf16_flushes_subnormals():
        return [XFAIL_BF16_DAZ]
    return []


def _subnormal_quantized(shape, bs, dtype, cs):
    # absmax around 5e-38: products with the small NF4 levels fall below 2^-126
    return bnb_quantized(shape, bs, dtype, cs, scale=2e-38)


@pytest.mark.parametrize("shape, bs, dtype, cs, out_dtype", _params(SUBNORMAL_CASES))
def test_subnormal_products_default_backend(shape, bs, dtype, cs, out_dtype):
    """Route (a) keeps IEEE subnormals: it equals the reference with ftz=False, not ftz=True."""
    _, packed, state, _ = _subnormal_quantized(shape, bs, dtype, cs)
    mine = reference_dequant(packed, state, out_dtype, transpose=False)
    if out_dtype != "float16":  # fp16 rounds these to zero either way
        assert not compare(mine, reference_dequant(packed, state, out_dtype, ftz=True, transpose=False)).ok
    assert_bitexact(route_default(packed, state, out_dtype), mine, name="default backend, subnormal products")


@pytest.mark.parametrize("shape, bs, dtype, cs, out_dtype", _params(SUBNORMAL_CASES, _subnormal_marks))
def test_subnormal_products_functional(shape, bs, dtype, cs, out_dtype):
    """Route (b) against ftz=False; bf16 output on the AVX512 branch flushes (disagreement 3)."""
    _, packed, state, _ = _subnormal_quantized(shape, bs, dtype, cs)
    assert_bitexact(
        route_native(packed, state, out_dtype),
        reference_dequant(packed, state, out_dtype),
        name="dequantize_4bit, subnormal products",
    )


@pytest.mark.parametrize("cs", [True, False], ids=["dq", "nodq"])
def test_native_bf16_flush_mechanism(cs):
    """Evidence for disagreement 3: the AVX512 bf16 output is the IEEE float32 product with subnormals
    flushed at the bf16 conversion only (`native_avx512_model`), not the RNE the format asks for."""
    if not (native_takes_avx512((4, 64), 64) and native_bf16_flushes_subnormals()):
        pytest.skip("needs the AVX512 branch with AVX512_BF16")
    _, packed, state, _ = _subnormal_quantized((4, 64), 64, "float32", cs)
    theirs = route_native(packed, state, "bfloat16")
    model = native_avx512_model(reference.from_bnb(packed, state), "bfloat16")
    assert_bitexact(theirs, model, name="dequantize_4bit bf16 vs product flushed at the conversion")
    assert not compare(theirs, reference_dequant(packed, state, "bfloat16")).ok


# float32 bit patterns exactly halfway between two neighbours of the output dtype, plus a few others.
TIE_BITS = {
    # 1 + 2^-11 -> 1.0; 1 + 3 * 2^-11 -> 1 + 2^-9; 1.5 subnormal units -> 2; half a unit -> 0;
    # 65520 -> inf; the smallest normal plus half an ulp -> the smallest normal; 3.0 exact
    "float16": [0x3F801000, 0x3F803000, 0x33C00000, 0x33000000, 0x477FF000, 0x38801000, 0x40400000],
    # 1 + 2^-8 -> 1.0; 1 + 3 * 2^-8 -> 1 + 2^-6; smallest normal plus half an ulp; max finite plus
    # half an ulp -> inf; just above a tie -> up; 3.0 exact
    "bfloat16": [0x3F808000, 0x3F818000, 0x00808000, 0x7F7F8000, 0x3F808001, 0x40400000],
    # float32 output keeps the product: 1 + 2^-23, the smallest subnormal, 3.0
    "float32": [0x3F800001, 0x00000001, 0x40400000],
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 65520 -> inf is the point
@pytest.mark.parametrize("shape", [(7, 64), (7, 42), (7, 63)], ids=["avx512", "scalar", "fallback"])
@pytest.mark.parametrize("out_dtype", DTYPE_NAMES)
def test_round_to_nearest_even_ties(out_dtype, shape):
    """Crafted absmax (no DQ) whose products with NF4 +-1.0 are exact ties of the output dtype:
    every route must round them to nearest even, as the format says."""
    values = np.array(TIE_BITS[out_dtype], dtype=np.uint32).view(np.float32)
    n = prod(shape)
    blocks = -(-n // 64)
    absmax = np.resize(values, blocks).astype(np.float32)
    packed = torch.full(((n + 1) // 2, 1), 0xF0, dtype=torch.uint8)  # levels +1.0, -1.0, +1.0, ...
    state = F.QuantState(
        absmax=torch.from_numpy(absmax),
        shape=torch.Size(shape),
        dtype=torch_dtype(out_dtype),
        blocksize=64,
        quant_type="nf4",
        code=F.get_4bit_type("nf4", device="cpu"),
    )
    mine = reference_dequant(packed, state, out_dtype)
    assert_bitexact(route_default(packed, state, out_dtype), mine, name="default backend ties")
    assert_bitexact(route_native(packed, state, out_dtype), mine, name="dequantize_4bit ties")
