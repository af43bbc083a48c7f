"""nf4.linear's Gluon GEMM (kernel "gemm_gluon") off the GPU: x's permutation in the interpreter against the NumPy
fragment model, the split-K arithmetic on a GPU of 132 multiprocessors, and where it may run. The kernel itself runs
on an sm_90 GPU only (tests/nf4/linear/test_gpu.py); experiments/labs' tests replay its column bookkeeping."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import triton

from experiments.labs import fragment
from nf4.linear import LinearConfig
from nf4.linear import launch as linear_launch
from nf4.linear.tuned import CONFIGS
from nf4.weight import NF4Weight

gg = importlib.import_module("nf4.linear.gemm_gluon")
gll = importlib.import_module("nf4.linear.gluon_launch")  # its launches


def _weight(n: int, k: int, blocksize: int = 64, dtype=torch.bfloat16, device="cpu") -> NF4Weight:
    blocks = n * k // blocksize
    return NF4Weight(torch.zeros(n * k // 2, 1, dtype=torch.uint8, device=device),
                     torch.zeros(blocks, dtype=torch.uint8, device=device),
                     torch.zeros(-(-blocks // 256), device=device), torch.zeros(256, device=device),
                     torch.zeros((), device=device), (n, k), blocksize, dtype, True)


@pytest.mark.parametrize("m, k", [(1, 64), (5, 128), (9, 1088), (3, 4096)])
def test_permute_x_is_the_fragment_model(m, k):
    """Every column of x lands where fragment.fragment_order puts it (poisoned output: every element written): in the
    interpreter on CPU tensors, compiled on a CUDA GPU (where the interpreter is off)."""
    gen = torch.Generator().manual_seed(m * 7919 + k)
    x = torch.randn((m, k), generator=gen).to(torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full_like(x, float("nan"), device=device)
    got = gll.permute_x(x.to(device), out)
    want = torch.from_numpy(fragment.fragment_order(x.float().numpy())).to(torch.bfloat16)
    assert got is out
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got.cpu(), x) or k < 64  # a permutation, not the identity


def test_split_on_a_gpu():
    """Auto: nearest programs_per_sm x 132 programs, at least 8 steps each, at most 16; every split non-empty and
    an even number of steps (two an iteration); split_k fixed as given."""
    g128, g256 = CONFIGS["GLUON_GEMM128"], CONFIGS["GLUON_GEMM256"]
    for (n, k, m), want in {(4096, 4096, 128): 4, (14336, 4096, 128): 1, (4096, 14336, 96): 4,
                            (2048, 4096, 100): 8, (1024, 1024, 65): 2}.items():
        parts, seg = gll.split(g128, _weight(n, k), m, 132)
        assert parts == want, (n, k, m, parts)
        steps = seg // 32
        assert steps % 2 == 0 and (parts - 1) * steps < k // 64 <= parts * steps
        assert parts == 1 or steps >= 8
    assert gll.split(g256, _weight(4096, 4096), 512, 132) == (1, 2048)
    assert gll.split(g128, _weight(4096, 4096), 128, None) == (1, 2048)  # off the GPU: one
    parts, seg = gll.split(g128.with_(split_k=3), _weight(512, 1280), 77, 132)  # 20 steps in 3: 8, 8, 4
    assert (parts, seg) == (3, 256)


def test_not_runnable_off_a_hopper_gpu():
    """On the CPU (the interpreter) the kernel never runs: the table's choice without the Gluon rule does."""
    config = CONFIGS["GLUON_GEMM128"]
    w = _weight(2048, 4096)
    x = torch.zeros((96, 4096), dtype=torch.bfloat16)
    assert not gll.runnable(config, w, x, 96)
    assert linear_launch.launch_config(config, w, x, 96, False).kernel != "gemm_gluon"
    assert linear_launch.direct(config) and not linear_launch.direct(LinearConfig(kernel="gemm_word"))


def test_quarter_tables_cover_the_dtypes():
    """The quarter-table asm names the multiply (ftz or IEEE) and the rounding (bf16 or f16) it is asked for."""
    for ftz, mul in ((True, "mul.rn.ftz.f32"), (False, "mul.rn.f32 ")):
        for dt in ("bf16", "f16"):
            text = gg.quarter_asm(ftz, dt)
            assert text.count(mul.strip()) == 4 and text.count(f"cvt.rn.{dt}x2.f32") == 2
            assert ("ftz" in text) == ftz
    assert np.array_equal(np.sort(fragment.perm()), np.arange(64))


class _Recorder:
    """Stands in for a compiled kernel, a launch function and a bound launch: records each call's arguments."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __call__(self, *args, **kwargs):
        self.log.append((self.name, args, kwargs))
        return self


@pytest.mark.parametrize("split_k, bias", [(1, False), (1, True), (3, False), (3, True)])
def test_bound_launch_places_each_call_s_tensors(monkeypatch, split_k, bias):
    """The repeat call's bound launches (`bind`) pass what the first call's JIT launch passed, with this call's
    gathered x (a new descriptor), the weight's descriptor remade for a packed tensor at a new address, this call's
    out (or float32 partials and the split sum into out) and bias: Triton's launches stood in for, on the CPU."""
    log: list = []
    kernel = gg.nf4_gemm_gluon_kernel

    class _Grid:  # kernel[grid](*args, **options)
        arg_names = kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kw: _Recorder("jit", log)(grid, *args, **kw)

    monkeypatch.setattr(gll, "nf4_gemm_gluon_kernel", _Grid())
    monkeypatch.setattr(gll.runtime, "launch", lambda fn, grid, args, **kw: _Recorder(fn.__name__, log)(grid, args))
    monkeypatch.setattr(gll.runtime, "launch_head", lambda compiled: (_Recorder("gemm", log), ("HEAD",)))
    monkeypatch.setattr(gll.runtime, "bind", lambda c, fn, grid, args, rebind: _Recorder(f"bound {fn.__name__}", log))
    monkeypatch.setattr(gll.runtime, "raw_stream", lambda index: 7)
    n, k, m = 512, 1280, 77
    w = _weight(n, k)
    config = CONFIGS["GLUON_GEMM128"].with_(split_k=split_k)
    x = torch.randn((m, k)).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    out = torch.empty((m, n), dtype=torch.bfloat16)
    part = torch.empty(split_k * m * n) if split_k > 1 else None
    call = linear_launch._direct_call(x, w, b, out, m, config, True, part)
    bound = gll.bind(call)
    names = list(kernel.arg_names)
    first = next(args for name, args, _ in log if name == "jit")
    grid, given = first[0], first[1:]
    assert [p for p in names if p != "num_warps"] == names[:len(given)]
    assert grid == (triton.cdiv(n, 16 * config.num_warps), 1, split_k) == bound.grid
    log.clear()
    x2, out2 = torch.randn((m, k)).to(torch.bfloat16), torch.empty((m, n), dtype=torch.bfloat16)
    b2 = torch.randn(n).to(torch.bfloat16) if bias else None
    packed2 = w.packed.clone()  # the same bytes at a new address
    assert bound(x2, packed2, b2, out2) is out2
    calls = {name: args for name, args, _ in log}
    xp_ptr = calls["bound nf4_permute_x_kernel"][1:]
    assert calls["bound nf4_permute_x_kernel"][0] == 7 and xp_ptr[0] == x2.data_ptr()
    launched = calls["gemm"]
    assert launched[:5] == (*grid, 7, "HEAD")
    values = dict(zip(names, launched[5:], strict=True))
    assert values["x_desc"].base.data_ptr() == xp_ptr[1] and list(values["x_desc"].block_shape) == [128, 64]
    assert values["w_desc"].base.data_ptr() == packed2.data_ptr() and list(values["w_desc"].shape) == [n, k // 8]
    for p, v in zip(names[2:len(given)], given[2:], strict=True):  # everything else as the first launch had it
        if p not in ("out_ptr", "bias_ptr"):
            assert values[p] == (v.data_ptr() if isinstance(v, torch.Tensor) else v), p
    if bias:
        assert values["bias_ptr"] == b2.data_ptr()
    log.clear()  # the opaque op's form: the state's tensors rebound too (None keeps the bound one)
    absmax2, offset2 = w.absmax.clone(), w.offset.clone()
    bound(x2, packed2, b2, out2, absmax2, None, None, offset2)
    again = dict(zip(names, next(args for name, args, _ in log if name == "gemm")[5:], strict=True))
    assert again["absmax_ptr"] == absmax2.data_ptr() != values["absmax_ptr"]
    assert again["offset_ptr"] == offset2.data_ptr() != values["offset_ptr"]
    assert again["absmax2_ptr"] == values["absmax2_ptr"] and again["code2_ptr"] == values["code2_ptr"]
    if split_k == 1:
        assert values["out_ptr"] == out2.data_ptr() and "bound nf4_split_sum_kernel" not in calls
    else:
        summed = calls["bound nf4_split_sum_kernel"]
        assert summed[0] == 7 and summed[1] == values["out_ptr"] != out2.data_ptr() and summed[2] == out2.data_ptr()
        assert summed[3:] == ((b2.data_ptr(),) if bias else ())
