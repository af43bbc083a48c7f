"""`nf4.dequantize` in Triton's interpreter (CPU tensors) against the NumPy reference, bit for bit.

Inputs come from bitsandbytes' own `quantize_4bit` on the CPU. Every case compares integer views
(`verify.exact.assert_bitexact`) with `reference.dequantize_nf4(reference.from_bnb(packed, state))`,
transposed like bitsandbytes when the packed tensor has shape (1, k). The interpreter's default is
ftz=False (IEEE subnormals), the reference's too; ftz=True is checked on crafted states whose
products are subnormal. bitsandbytes' own CPU `dequantize_4bit` is not the oracle here: its native
C++ route misreads absmax for rows that do not hold whole blocks (see test_reference_bnb.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
from nf4 import DequantConfig, NF4Weight
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.dequant.launch import launch
from reference.format import BLOCKSIZES
from verify.exact import assert_bitexact, compare

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_dequantize_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
ODD_SHAPES = [(7,), (1, 333), (9, 41, 341), (3, 5, 67)]


def _grid_shape(blocksize: int) -> tuple[int]:
    """Odd numel with a tail block of blocksize // 2 + 1; past 256 blocks (two state2 scales) when cheap."""
    n_blocks = 257 if blocksize <= 256 else 3
    return ((n_blocks - 1) * blocksize + blocksize // 2 + 1,)


def _check(nf4h, packed, state, out_dtype=None, **kwargs):
    got = nf4.dequantize(packed, state, dtype=out_dtype, **kwargs)
    assert_bitexact(got, nf4h.reference_dequant(packed, state, out_dtype, ftz=bool(kwargs.get("ftz"))))
    return got


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
def test_blocksizes(nf4h, blocksize, dtype, double_quant):
    shape = _grid_shape(blocksize)
    packed, state = nf4h.quantize(shape, dtype, blocksize, double_quant,
                                  seed=nf4h.case_seed("bs", blocksize, dtype, double_quant))
    got = _check(nf4h, packed, state)
    assert got.dtype == dtype and tuple(got.shape) == shape


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [(a, b) for a, b in itertools.product(DTYPES, DTYPES) if a != b],
                         ids=lambda d: DT[d])
def test_out_dtype_differs(nf4h, dtype, out_dtype, double_quant):
    packed, state = nf4h.quantize((33, 100), dtype, 64, double_quant,
                                  seed=nf4h.case_seed("dtype", dtype, out_dtype, double_quant))
    got = _check(nf4h, packed, state, out_dtype)
    assert got.dtype == out_dtype


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("blocksize", [32, 64, 4096])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes(nf4h, shape, blocksize, dtype, double_quant):
    packed, state = nf4h.quantize(shape, dtype, blocksize, double_quant,
                                  seed=nf4h.case_seed("odd", shape, blocksize, dtype, double_quant))
    got = _check(nf4h, packed, state)
    assert tuple(got.shape) == shape


# Byte counts divisible by 4, so every storage dtype can hold them.
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("shape", [(7,), (33, 96), (5, 4099)], ids=str)
@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quant_storage(nf4h, quant_storage, shape, double_quant):
    dtype = torch.bfloat16 if quant_storage == torch.bfloat16 else torch.float16
    packed, state = nf4h.quantize(shape, dtype, 64, double_quant, quant_storage=quant_storage,
                                  seed=nf4h.case_seed("storage", quant_storage, shape, double_quant))
    assert packed.dtype == quant_storage
    _check(nf4h, packed, state)


@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("shape", [(40, 96), (1, 333), (7,), (2,), (1, 1)], ids=str)
def test_row_packed_is_transposed(nf4h, shape, double_quant, with_out):
    """A packed tensor of shape (1, k) gives the weight transposed, as bitsandbytes' shim does."""
    packed, state = nf4h.quantize(shape, torch.bfloat16, 64, double_quant,
                                  seed=nf4h.case_seed("shim", shape, double_quant))
    row = packed.t() if packed.shape[0] != 1 else packed
    assert row.shape[0] == 1 and row.is_contiguous()
    out = torch.empty(shape, dtype=torch.bfloat16) if with_out else None
    got = nf4.dequantize(row, state, out=out)
    expect = nf4h.reference_dequant(row, state)
    assert tuple(got.shape) == tuple(expect.shape)
    assert_bitexact(got, expect)
    if with_out:
        assert got.data_ptr() == out.data_ptr()
        assert_bitexact(out, nf4h.reference_dequant(packed, state) if packed.shape[0] != 1 else expect.t())


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_subnormal_products_ftz(nf4h, double_quant, out_dtype):
    shape = (300 * 32 + 7,)  # 301 blocks: two state2 scales
    packed, state = nf4h.quantize(shape, torch.float32, 32, double_quant,
                                  seed=nf4h.case_seed("ftz", double_quant, out_dtype))
    tiny = nf4h.tiny_state(state, nf4h.case_seed("tiny", double_quant))
    before = nf4h.snapshot(packed, tiny)
    flushed = _check(nf4h, packed, tiny, out_dtype, ftz=True)
    ieee = _check(nf4h, packed, tiny, out_dtype, ftz=False)
    default = nf4.dequantize(packed, tiny, dtype=out_dtype)  # ftz=None: off on the CPU
    assert_bitexact(default, ieee, name="ftz=None on the CPU")
    nf4h.assert_unchanged(before, packed, tiny)
    if out_dtype != torch.float16:  # float16 rounds all of these to a signed zero either way
        differ = compare(flushed, ieee).count
        assert differ > 0, "the crafted state produced no subnormal output: the ftz check tested nothing"


@pytest.mark.parametrize("byte_offset", [1, 8])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("shape", [(7,), (33, 96), (3, 5, 67)], ids=str)
def test_misaligned_packed(nf4h, shape, double_quant, byte_offset):
    """Packed bytes that do not start on a 16-byte boundary (a view into a larger buffer)."""
    packed, state = nf4h.quantize(shape, torch.bfloat16, 64, double_quant,
                                  seed=nf4h.case_seed("misaligned", shape, double_quant, byte_offset))
    buf = torch.zeros(packed.numel() + 32, dtype=torch.uint8)
    view = buf[byte_offset : byte_offset + packed.numel()].view(-1, 1)
    view.copy_(packed)
    assert view.data_ptr() % 16 != 0 and view.is_contiguous()
    _check(nf4h, view, state)


# (tile_bytes, blocksize, numel). In the interpreter each program costs tens of milliseconds, so
# the 16-byte tile gets a small weight (still many programs per absmax block and a tail).
TILE_CASES = [(16, 32, 20 * 32 - 5), (16, 64, 10 * 64 - 5)] + [
    (tile, bs, 259 * bs - 5 if bs < 4096 else 3 * bs - 5) for tile in (512, 2048, 8192) for bs in (32, 64, 4096)
]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=DT.get)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize(("tile_bytes", "blocksize", "numel"), TILE_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("codebook", [0, 1], ids=["gather", "select"])
def test_codebook_and_tile(nf4h, codebook, tile_bytes, blocksize, numel, double_quant, out_dtype):
    packed, state = nf4h.quantize((numel,), torch.float32, blocksize, double_quant,
                                  seed=nf4h.case_seed("tile", codebook, tile_bytes, blocksize, double_quant))
    out = torch.empty(numel, dtype=out_dtype)
    got, *_ = launch(NF4Weight.of(packed, state), out, False, DequantConfig(tile_bytes=tile_bytes, codebook=codebook))
    assert got is out
    assert_bitexact(out, nf4h.reference_dequant(packed, state, out_dtype))


# (tile_bytes, blocksize, numel): the tiles outnumber the programs, numel % 8 covers 0 and odd tails.
PERSIST_CASES = [(16, 32, 37 * 32 - 3), (16, 64, 9 * 64), (512, 64, 259 * 64 - 5), (16, 4096, 8)]


@pytest.mark.parametrize("programs", [1, 3, 1000], ids=lambda v: f"p{v}")
@pytest.mark.parametrize(("tile_bytes", "blocksize", "numel"), PERSIST_CASES, ids=lambda v: str(v))
def test_persistent_grid(nf4h, programs, tile_bytes, blocksize, numel):
    """The fixed-grid word path: each program strides over the tiles; the last one writes the tail."""
    packed, state = nf4h.quantize((numel,), torch.float32, blocksize, True,
                                  seed=nf4h.case_seed("persist", programs, tile_bytes, blocksize, numel))
    out = torch.full((numel + 64,), float("nan"), dtype=torch.bfloat16)
    got, *_ = launch(NF4Weight.of(packed, state), out[:numel], False,
                     DequantConfig(tile_bytes=tile_bytes, programs_per_sm=1, interpret_programs=programs))
    assert got.data_ptr() == out.data_ptr()
    assert_bitexact(out[:numel], nf4h.reference_dequant(packed, state, torch.bfloat16))
    assert torch.isnan(out[numel:]).all(), "wrote past the end of out"


@pytest.mark.parametrize("ftz", [False, True], ids=["ieee", "ftz"])
def test_select_codebook_through_api(nf4h, ftz):
    """The select-tree codebook through `nf4.dequantize(..., config=)`, the way a tuned table would switch it."""
    config = DequantConfig(codebook=1)
    packed, state = nf4h.quantize((9, 41, 341), torch.bfloat16, 64, True, seed=nf4h.case_seed("api-cb", ftz))
    _check(nf4h, packed, state, ftz=ftz, config=config)
    tiny = nf4h.tiny_state(state, 1)
    _check(nf4h, packed, tiny, torch.float32, ftz=ftz, config=config)


def _linear4bit(nf4h, in_features, out_features, seed, *, via, quant_storage=torch.uint8, blocksize=64):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compress_statistics=True, quant_type="nf4",
                              quant_storage=quant_storage)  # no blocksize argument: Params4bit carries it
    data = nf4h.make_weight((out_features, in_features), torch.float32, seed)
    if via == "quantize":
        layer.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                         quant_storage=quant_storage, blocksize=blocksize)._quantize("cpu")
    else:  # like the harness: created in float32, quantized when moved to a device
        layer.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                         quant_storage=quant_storage, blocksize=blocksize)
        layer = layer.to("cpu")
    assert layer.weight.bnb_quantized and layer.weight.dtype == quant_storage
    return layer


@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DT.get)
@pytest.mark.parametrize("via", ["quantize", "to"])
def test_linear4bit_and_params4bit(nf4h, via, compute_dtype):
    layer = _linear4bit(nf4h, 96, 40, nf4h.case_seed("linear", via, compute_dtype), via=via)
    qs = layer.weight.quant_state
    qs.dtype = compute_dtype  # as the challenge harness does; this state belongs to this test alone
    expect = nf4h.reference_dequant(layer.weight.data, qs)
    assert tuple(expect.shape) == (40, 96)
    weight, before = layer.weight, layer.weight.data.clone()
    assert_bitexact(nf4.dequantize(layer), expect, name="Linear4bit")
    assert_bitexact(nf4.dequantize(layer.weight), expect, name="Params4bit")
    assert_bitexact(nf4.dequantize(layer.weight, qs), expect, name="Params4bit + quant_state")
    assert_bitexact(nf4.fast_dequantize(layer.weight, qs), expect, name="fast_dequantize")
    # the checks read a plain alias of the Params4bit's storage: the parameter itself is left as it was
    assert layer.weight is weight and type(weight).__name__ == "Params4bit" and weight.quant_state is qs
    assert_bitexact(weight.data, before, name="Params4bit bytes after the calls")


class _Wrapper(torch.nn.Module):
    """A module holding no parameter named `weight` whose `weight` is a property (as PEFT's LoRA layers wrap
    their base layer), beside a decoy parameter of another module's weight under another name."""

    def __init__(self, base, decoy):
        super().__init__()
        self.base_layer = base
        self.decoy = decoy

    @property
    def weight(self):
        return self.base_layer.weight


def test_module_weight_lookup(nf4h):
    """nf4.dequantize(module) reads the module's `weight` (its parameter dict first, the attribute otherwise):
    a Linear4bit and a wrapper whose `weight` is a property give their own weight's values, not a decoy's."""
    layer = _linear4bit(nf4h, 96, 40, nf4h.case_seed("module-lookup", 0), via="quantize")
    other = _linear4bit(nf4h, 96, 40, nf4h.case_seed("module-lookup", 1), via="quantize")
    expect = nf4h.reference_dequant(layer.weight.data, layer.weight.quant_state)
    wrapper = _Wrapper(layer, other.weight)
    assert "weight" not in wrapper._parameters and "weight" in layer._parameters
    for i in range(3):  # the full path, the call that makes the plan, then the plan's fast path
        assert_bitexact(nf4.dequantize(layer), expect, name=f"Linear4bit, call {i}")
        assert_bitexact(nf4.dequantize(wrapper), expect, name=f"wrapper with a weight property, call {i}")


def test_linear4bit_bf16_storage(nf4h):
    layer = _linear4bit(nf4h, 100, 36, nf4h.case_seed("linear-bf16"), via="quantize", quant_storage=torch.bfloat16,
                        blocksize=128)
    expect = nf4h.reference_dequant(layer.weight.data, layer.weight.quant_state)
    assert_bitexact(nf4.dequantize(layer), expect)


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
def test_fast_dequantize(nf4h, double_quant):
    packed, state = nf4h.quantize((64, 72), torch.float16, 64, double_quant,
                                  seed=nf4h.case_seed("fast", double_quant))
    expect = nf4h.reference_dequant(packed, state)
    assert_bitexact(nf4.fast_dequantize(packed, state), expect)
    out = torch.empty(64, 72, dtype=torch.float16)
    got = nf4.fast_dequantize(packed, state, out=out, use_global_buffer=True)
    assert got.data_ptr() == out.data_ptr()
    assert_bitexact(out, expect)
    row = packed.t()
    assert_bitexact(nf4.fast_dequantize(row, state), nf4h.reference_dequant(row, state), name="(1, k) packed")


def test_fast_dequantize_unquantized_passthrough():
    w = torch.randn(5, 3)
    assert nf4.fast_dequantize(w) is w
    assert nf4.fast_dequantize(w, None) is w
