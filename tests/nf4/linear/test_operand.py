"""The operand check of `nf4.linear` in Triton's interpreter (docs/FORMAT.md §9).

x made of identity rows (plain, signed, scaled by 2**-2 .. 2**2, at permuted or random columns)
picks single weights, so `x @ W^T` must be `scale * nf4.dequantize(W).to(x.dtype) + 0.0` bit for bit,
whatever the summation order; identity rows of dY do the same for the backward `dY @ W` (nf4.dequantize +
cuBLAS, whatever the config). Every weight is checked (a permutation of all columns, or of all rows for the
backward), and a few rows of x at random columns keep the GEMV at the M it is tuned for. Covered: the GEMV
(split-K 1, 2, 3, auto), the word GEMV, the word tl.dot kernel (swapped, unswapped, steps of 32 weights, split-K),
the interpreter's tuned rows (the GPUs' word kernels), every blocksize a linear may have up to 256, N odd and not
a multiple of any tile, double quantization on and off, three quant_storage dtypes, x float16 / bfloat16 against
weights of float16 / bfloat16 / float32, ftz on and off. (The fused backward kernel and the tl.dot kernel that
left nf4.linear are checked with the experiments' variants: tests/experiments/test_linear_variants.py.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4.linear import launch
from nf4.linear.api import entry_of, run
from nf4.linear.gemv import nf4_gemv_kernel
from nf4.linear.tuned import tuned
from nf4.weight import NF4Weight
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_gemv_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

X_DTYPES = (torch.float16, torch.bfloat16)
W_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_PAIRS = list(itertools.product(X_DTYPES, W_DTYPES))  # (x dtype, QuantState dtype)
STORAGES = (torch.uint8, torch.bfloat16, torch.float32)
# blocksize -> K: whole blocks per row (3, 2, 2, 1); 3 steps of 16 bytes at blocksize 32
K_OF = {32: 96, 64: 128, 128: 256, 256: 256}
N = 45  # odd; not a multiple of block_r (8, 16, 32) or block_n (16, 32, 128)
FWD = ("gemv", "gemv-s1", "gemv-s2", "gemv-s3", "gemv-table", "gemm-word", "gemm-word-plain", "gemm-word-k32",
       "tuned")  # keys of lin.FORWARD
BWD = ("tuned", "gemv", "gemm-word")  # keys of lin.BACKWARD
# (x dtype, W dtype, double quant, storage): every dtype pair and storage with double quantization,
# and a third of them (each dtype pair once) without
COMBOS = [(xd, wd, dq, st) for (xd, wd), dq, st in itertools.product(DTYPE_PAIRS, (True, False), STORAGES)
          if dq or (W_DTYPES.index(wd) + STORAGES.index(st)) % 3 == 0]


def _case(i: int):
    """The (x dtype, W dtype, double quant, quant_storage) that case i of a grid cycles to."""
    x_dtype, w_dtype = DTYPE_PAIRS[i % len(DTYPE_PAIRS)]
    return x_dtype, w_dtype, i % 2 == 0, STORAGES[i % len(STORAGES)]


def _check_forward(lin, packed, qs, x_dtype, config, seed, *, ftz=False, name=""):
    """Every weight through a permutation of K identity rows, and 1 and 3 rows at random columns."""
    w = entry_of(packed, qs)
    wt = lin.operand(packed, qs, x_dtype, ftz=ftz).t()  # [K, N]: row k holds column k of W
    k = w.K
    # the word GEMV takes at most 4 rows of x: all columns in chunks of 4 rows reach it
    chunk = 4 if config is not None and config.kernel == "gemv_table" else k
    for label, cols in (("all columns", lin.permutation(k, seed)), ("1 row", lin.columns(k, 1, seed + 1)),
                        ("3 rows", lin.columns(k, 3, seed + 2))):
        x, scales = lin.identity_rows(cols, x_dtype, k, seed + 3)
        got = torch.cat([run(x[i:i + chunk], packed, qs, w, None, config=config, ftz=ftz)
                         for i in range(0, cols.numel(), chunk)])
        assert got.dtype == x_dtype and tuple(got.shape) == (cols.numel(), w.N)
        assert_bitexact(got, lin.picked(wt, cols, scales, x_dtype), name=f"{name} forward, {label}")


def _check_backward(lin, packed, qs, x_dtype, config, seed, *, ftz=False, name=""):
    """dY of N identity rows (a permutation) and 2 rows at random: dY @ W picks rows of W."""
    w = entry_of(packed, qs)
    wd = lin.operand(packed, qs, x_dtype, ftz=ftz)  # [N, K]
    for label, rows in (("all rows", lin.permutation(w.N, seed)), ("2 rows", lin.columns(w.N, 2, seed + 1))):
        dy, scales = lin.identity_rows(rows, x_dtype, w.N, seed + 3)
        with lin.ieee_dense():  # the dequant path's dense product, IEEE on the CPU too (see ieee_dense)
            got = run(dy, packed, qs, w, None, trans=True, config=config, ftz=ftz)
        assert got.dtype == x_dtype and tuple(got.shape) == (rows.numel(), w.K)
        assert_bitexact(got, lin.picked(wd, rows, scales, x_dtype), name=f"{name} backward, {label}")


@pytest.mark.parametrize("blocksize", sorted(K_OF))
@pytest.mark.parametrize("config_name", FWD)
def test_forward_operand(nf4h, lin, config_name, blocksize):
    i = FWD.index(config_name) + len(FWD) * sorted(K_OF).index(blocksize)
    x_dtype, w_dtype, dq, storage = _case(i)
    if config_name.startswith(("gemm-word", "tuned")) and blocksize != 32:
        w_dtype = x_dtype  # the word kernels' own case (bs 32 keeps a weight of another dtype: the dequant path)
    seed = nf4h.case_seed("fwd-operand", config_name, blocksize)
    packed, qs = nf4h.quantize((N, K_OF[blocksize]), w_dtype, blocksize, dq, seed=seed, quant_storage=storage)
    name = f"{config_name} bs={blocksize} x={x_dtype} W={w_dtype} dq={dq} storage={storage}"
    _check_forward(lin, packed, qs, x_dtype, lin.FORWARD[config_name], seed, name=name)


@pytest.mark.parametrize("blocksize", sorted(K_OF))
@pytest.mark.parametrize("config_name", BWD)
def test_backward_operand(nf4h, lin, config_name, blocksize):
    """nf4.linear's backward (run with trans=True, as autograd calls it) on every row of W: the dequant path,
    whatever the config says."""
    i = BWD.index(config_name) + len(BWD) * sorted(K_OF).index(blocksize) + 1
    x_dtype, w_dtype, dq, storage = _case(i)
    seed = nf4h.case_seed("bwd-operand", config_name, blocksize)
    packed, qs = nf4h.quantize((N, K_OF[blocksize]), w_dtype, blocksize, dq, seed=seed, quant_storage=storage)
    w = NF4Weight.from_state(packed, qs)
    x = torch.empty((2, N), dtype=x_dtype)
    config = lin.BACKWARD[config_name]
    assert launch.launch_config(config or tuned("", 2, True), w, x, 2, True).kernel == "dequant"
    name = f"{config_name} bs={blocksize} x={x_dtype} W={w_dtype} dq={dq} storage={storage}"
    _check_backward(lin, packed, qs, x_dtype, config, seed, name=name)


def _combo_id(c):
    xd, wd, dq, st = c
    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8"}
    return f"x{short[xd]}-w{short[wd]}-{'dq' if dq else 'nodq'}-{short[st]}"


@pytest.mark.parametrize(("x_dtype", "w_dtype", "double_quant", "storage"), COMBOS, ids=map(_combo_id, COMBOS))
def test_dtypes_and_storage(nf4h, lin, x_dtype, w_dtype, double_quant, storage):
    """(x dtype, weight dtype, double quant, storage) combinations: the tuned forward at 2 and 33 rows
    (the word GEMV and the word tl.dot kernel where W's dtype is x's, else the codebook-0 GEMV and the dequant
    path), and the tuned backward; N = 45 rows of 128, blocksize 64."""
    seed = nf4h.case_seed("dtypes", x_dtype, w_dtype, double_quant, storage)
    packed, qs = nf4h.quantize((45, 128), w_dtype, 64, double_quant, seed=seed, quant_storage=storage)
    assert packed.dtype == storage and qs.dtype == w_dtype
    w = entry_of(packed, qs)
    wt = lin.operand(packed, qs, x_dtype)
    for m in (2, 33):
        cols = lin.columns(128, m, seed + m)
        x, scales = lin.identity_rows(cols, x_dtype, 128, seed)
        assert_bitexact(nf4.linear(x, packed, qs), lin.picked(wt.t(), cols, scales, x_dtype), name=f"M={m}")
    _check_backward(lin, packed, qs, x_dtype, None, seed, name="tuned")
    assert w.fused


def test_unsigned_identity(nf4h, lin):
    """The plainest form, x = I (K rows) and x = 4 I, through every forward config."""
    packed, qs = nf4h.quantize((33, 64), torch.bfloat16, 32, True, seed=nf4h.case_seed("plain-identity"))
    w = entry_of(packed, qs)
    wd = lin.operand(packed, qs, torch.bfloat16)
    eye = torch.eye(64, dtype=torch.bfloat16)
    for name, config in lin.FORWARD.items():
        for scale in (1.0, 4.0):
            got = run(eye * scale, packed, qs, w, None, config=config)
            assert_bitexact(got, (wd.t().float() * scale + 0.0).to(torch.bfloat16), name=f"{name} x {scale}")


def test_ftz_flushes_subnormal_weights(nf4h, lin):
    """With ftz, a state whose weights would be float32 subnormals decodes to the zeros nf4.dequantize(ftz=True)
    gives (bfloat16 x, float32 W; double quantization on and off)."""
    for double_quant in (True, False):
        packed, qs = nf4h.quantize((40, 128), torch.float32, 64, double_quant,
                                   seed=nf4h.case_seed("tiny-ftz", double_quant))
        tiny = nf4h.tiny_state(qs, seed=3)
        name = "gemv-s2" if double_quant else "gemv-s1"
        _check_forward(lin, packed, tiny, torch.bfloat16, lin.FORWARD[name], 5, ftz=True, name=name)
        _check_backward(lin, packed, tiny, torch.bfloat16, None, 5, ftz=True, name="tuned")
    # the word kernels decode W of x's dtype: bfloat16 weights with the same tiny state
    packed, qs = nf4h.quantize((40, 128), torch.bfloat16, 64, True, seed=nf4h.case_seed("tiny-ftz-word"))
    tiny = nf4h.tiny_state(qs, seed=3)
    for name in ("gemv-table", "gemm-word"):
        _check_forward(lin, packed, tiny, torch.bfloat16, lin.FORWARD[name], 5, ftz=True, name=name)


# --- bfloat16 subnormals in Triton's interpreter ----------------------------------------------------
# Triton 3.9's interpreter widens bfloat16 to float32 (`.to(tl.float32)`, cast_impl -> _convert_float in
# triton/runtime/interpreter.py) by renormalising a subnormal's significand and then clamping the
# exponent at 0, so a bfloat16 subnormal becomes a wrong float32 (0x0040 -> 0.0, 0x801F -> -1.1e-38,
# where a GPU shifts the bits and is exact). The kernels therefore widen bfloat16 with integer ops in the
# interpreter (nf4.device.widen with BF16_BITS): these tests feed bfloat16 subnormals (|v| < 2**-126) as
# weights, activations and dY, which came out wrong before that.


@pytest.mark.parametrize(("path", "double_quant"), [("gemv-s2", True), ("gemv-table", False),
                                                    ("gemm-word", True), ("backward", False)])
def test_subnormal_weights_ieee(nf4h, lin, path, double_quant):
    """Weights among the float32 subnormals (a tiny absmax), kept by bfloat16 x without ftz: the operand
    must be nf4.dequantize(W, ftz=False).to(bfloat16) bit for bit, each product rounded once in float32 (float32
    weights for the GEMV, whose operand converts them; bfloat16 weights, subnormal there too, for the word
    kernels, which take W of x's dtype)."""
    w_dtype = torch.float32 if path.startswith(("gemv-s", "backward")) else torch.bfloat16
    packed, qs = nf4h.quantize((40, 128), w_dtype, 64, double_quant, seed=nf4h.case_seed("tiny", double_quant, path))
    tiny = nf4h.tiny_state(qs, seed=3)
    wd = lin.operand(packed, tiny, torch.bfloat16, ftz=False)
    assert ((wd != 0) & (wd.float().abs() < 2.0**-126)).any(), "no subnormal weight to test"
    if path == "backward":
        _check_backward(lin, packed, tiny, torch.bfloat16, None, 5, ftz=False, name=path)
    else:
        _check_forward(lin, packed, tiny, torch.bfloat16, lin.FORWARD[path], 5, ftz=False, name=path)


SUBNORMAL_SCALES = (2.0**-130, -(2.0**-128), 3 * 2.0**-133)


@pytest.mark.parametrize("path", [
    "gemv",
    "gemv-table",
    "gemm-word",
    "tuned-backward",
])
def test_subnormal_bf16_activations(nf4h, lin, path):
    """Identity rows scaled into bfloat16's subnormals (2**-130, -2**-128, 3 * 2**-133): each output is
    one float32 product rounded once, then rounded to bfloat16."""
    packed, qs = nf4h.quantize((40, 128), torch.bfloat16, 64, True, seed=nf4h.case_seed("subnormal-x", path))
    w = entry_of(packed, qs)
    wd = lin.operand(packed, qs, torch.bfloat16)
    backward = path.endswith("backward")
    width = w.N if backward else w.K
    cols = lin.columns(width, 3, 7)
    x = torch.zeros(3, width, dtype=torch.bfloat16)
    scales = torch.tensor(SUBNORMAL_SCALES, dtype=torch.float32)
    x[torch.arange(3), cols] = scales.to(torch.bfloat16)
    assert torch.equal(x[torch.arange(3), cols].float(), scales)  # exact bfloat16 subnormals
    config = lin.FORWARD[path.removesuffix("-backward")]
    with lin.ieee_dense():  # the backward's dense product (see ieee_dense)
        got = run(x, packed, qs, w, None, trans=backward, config=config)  # the word kernels: x's dtype is W's
    assert_bitexact(got, lin.picked(wd if backward else wd.t(), cols, scales, torch.bfloat16), name=path)
