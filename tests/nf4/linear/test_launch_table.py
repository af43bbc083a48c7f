"""nf4.linear's launch table: kernels by name, each kernel file building its own launches.

- The names agree: LinearConfig's KERNELS are nf4.linear.launch.KERNELS' plus "dequant", every tuned config
  names one of them, and every kernel file has its `launches`.
- The launches are what they were before each kernel file built its own: `kernel_args` on a grid of configs
  (every kernel, named tuned configs and configs of their own), weights (blocksizes 32-256, double quantization
  on and off, W float16 / bfloat16 / float32), M, x's dtype, bias, ftz and interpreting gives the grids,
  arguments and options in frozen_launches.json, captured from the code before the change (its `about` says
  how); the kernels' splits on a GPU of 132 multiprocessors give the captured auto splits.
No kernel runs here: the tensors are stand-ins.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nf4 import runtime
from nf4.linear import config as linear_config
from nf4.linear import launch, tuned
from nf4.linear.call import Call
from nf4.linear.config import LinearConfig
from nf4.weight import NF4Weight

DATA = json.loads(Path(__file__).with_name("frozen_launches.json").read_text())
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU = torch.device("cpu")


def _weight(name: str) -> NF4Weight:
    """A stand-in weight of the named shape, blocksize, nesting and dtype (zeros; never read)."""
    n, k, blocksize, nested, dtype = DATA["weights"][name]
    blocks = n * k // blocksize
    packed = torch.zeros(n * k // 2, 1, dtype=torch.uint8)
    if nested:
        state = (torch.zeros(blocks, dtype=torch.uint8), torch.zeros(-(-blocks // 256)), torch.zeros(256),
                 torch.zeros(()))
    else:
        state = (torch.zeros(blocks), None, None, None)
    return NF4Weight(packed, *state, (n, k), blocksize, DT[dtype], nested)


def _launches(case: dict) -> list:
    """kernel_args for a frozen case, each launch as [kernel name, grid, args (tensors by role), options]."""
    w = _weight(case["weight"])
    n, k = w.shape
    m, dtype = case["m"], DT[case["x"]]
    x, out = torch.zeros(m, k, dtype=dtype), torch.zeros(m, n, dtype=dtype)
    bias = torch.zeros(n, dtype=dtype) if case["bias"] else None
    part = torch.zeros(8 * m * n)
    roles = {"x": x, "packed": w.packed, "absmax": w.absmax, "absmax2": w.absmax2, "code2": w.code2,
             "offset": w.offset, "out": out, "part": part, "bias": bias, "levels": runtime.level_table(CPU),
             "level_pairs": runtime.level_table(CPU, pairs=True), "dummy": runtime.stand_in(CPU)}
    names = {id(t): role for role, t in roles.items() if t is not None}
    config = LinearConfig(**case["fields"])
    got = launch.kernel_args(x, w, bias, out, m, config, case["ftz"], case["interpreting"], part)
    return [[fn.__name__, list(grid),
             {a: f"@{names.get(id(v), '?')}" if isinstance(v, torch.Tensor) else v for a, v in args.items()},
             dict(options)] for fn, grid, args, options in got]


def test_kernel_names_agree():
    assert linear_config.KERNELS == (*launch.KERNELS, "dequant")
    assert {c.kernel for c in tuned.CONFIGS.values()} <= set(linear_config.KERNELS)
    for name, kernel in launch.KERNELS.items():  # launches handed back, or (direct) a kernel that launches itself
        assert callable(getattr(kernel, "run", None) or kernel.launches), name
        assert hasattr(kernel, "launches") != hasattr(kernel, "run"), name
        simpler = getattr(kernel, "SIMPLER", None)
        assert simpler is None or simpler in launch.KERNELS, (name, simpler)
    assert set(launch.GEMV_KERNELS) == {"gemv", "gemv_table", "gemv_mma"}
    with pytest.raises(ValueError, match="kernel must be one of"):
        LinearConfig(kernel="gemm")  # nf4_gemm_kernel left the product (experiments/variants/linear)


def test_frozen_grid_covers_every_kernel():
    kernels = {case["fields"]["kernel"] for case in DATA["cases"]}
    # gemv_pair came after the capture; gemm_gluon launches itself (its GPU tests: tests/nf4/linear/test_gpu.py)
    assert kernels == set(launch.KERNELS) - {"gemv_pair", "gemm_gluon"}
    launched = {fn for case in DATA["cases"] for fn, *_ in case["launches"]}
    assert "nf4_split_sum_kernel" in launched and len(DATA["cases"]) >= 60


@pytest.mark.parametrize("i", range(len(DATA["cases"])))
def test_launches_are_the_frozen_ones(i):
    case = DATA["cases"][i]
    assert _launches(case) == case["launches"], case["fields"]


def _gpu_split(config: LinearConfig, w: NF4Weight, m: int, sms: int) -> list:
    """split_k's answer on a GPU of `sms` multiprocessors: the kernel file's split (launch.split_k passes it
    call.gpu_sms(device)), one program along K for a kernel without one."""
    split = getattr(launch.KERNELS[config.kernel], "split", None)
    return list(split(config, w, m, sms)) if split is not None else [1, w.shape[1] // 2]


def test_splits_on_a_gpu_are_the_frozen_ones():
    """The auto split-K of every kernel on a GPU of 132 multiprocessors (no GPU needed: the count is an argument)."""
    got = [_gpu_split(LinearConfig(**r["fields"]), _weight(r["weight"]), r["m"], 132) for r in DATA["gpu_splits"]]
    assert got == [r["split"] for r in DATA["gpu_splits"]]
    assert len({tuple(s) for s in got}) > 10  # the auto splits vary: the check can fail
    assert launch.split_k(LinearConfig(split_k=0), _weight("w45x128b64dq"), 1, CPU) == (1, 64)  # off the GPU: 1


# --- a kernel added as one file and one entry: gemv_pair ---------------------------------------------------------


def test_gemv_pair_is_one_file_and_one_entry():
    """nf4/linear/gemv_pair.py is reached by name only: its KERNELS entry and LinearConfig's name; no tuned row or
    fallback names it, and its file says what launch.py needs (launches, runnable, split, SIMPLER)."""
    from nf4.linear import gemv_pair

    assert launch.KERNELS["gemv_pair"] is gemv_pair and "gemv_pair" in linear_config.KERNELS
    assert all(c.kernel != "gemv_pair" for c in tuned.CONFIGS.values())
    assert "gemv_pair" not in launch.GEMV_KERNELS  # its split is its own (persistent programs), not auto_split's
    assert {"launches", "runnable", "split"} <= set(vars(gemv_pair)) and gemv_pair.SIMPLER == "gemv_table"


def _gpu_call(x, w, out, m, config, part=None) -> Call:
    """The Call kernel_args makes for a launch on a GPU of 132 multiprocessors (stand-in CPU tensors)."""
    code, dummy = runtime.level_table(CPU), runtime.stand_in(CPU)
    args = launch.base_args(x, w, None, out, m, config, True, False, code, dummy)
    return Call(x, w, None, out, m, config, True, False, part, code, dummy, args, 132)


def test_gemv_pair_launches():
    """What nf4.linear launches for kernel "gemv_pair" on a GPU of 132 multiprocessors: persistent programs_per_sm
    programs per multiprocessor over (row block, K segment) tiles, K split into segments of whole 128-byte steps
    until the row blocks fill the programs, the split sum beside it; one or two 8-row tiles of x; the 16 NF4
    levels (the kernel builds its pair table from them); every kernel parameter given."""
    from nf4.linear import gemv_pair
    from nf4.linear.gemv_pair import nf4_gemv_pair_kernel

    stand_in = _weight("w45x128b64dq")  # (its tensors; never read) as a weight of 1000 rows of 4096
    w = NF4Weight(*(getattr(stand_in, f) for f in ("packed", "absmax", "absmax2", "code2", "offset")), (1000, 4096),
                  64, torch.bfloat16, True)
    config = LinearConfig(kernel="gemv_pair", programs_per_sm=6)
    # 16 blocks of 64 rows, 792 programs: cdiv(792, 16) = 50 segments, capped at the 16 steps of 128 bytes
    assert gemv_pair.split(config, w, 1, 132) == (16, 128) and gemv_pair.split(config, w, 1, None) == (1, 2048)
    assert gemv_pair.split(config.with_(split_k=3), w, 1, 132) == (3, 128 * 6)
    for m, ntile in ((1, 1), (8, 1), (9, 2), (16, 2)):
        x, out = torch.zeros(m, 4096, dtype=torch.bfloat16), torch.zeros(m, 1000, dtype=torch.bfloat16)
        ((fn, grid, args, options),) = gemv_pair.launches(_gpu_call(x, w, out, m, config.with_(split_k=1,
                                                                                               num_warps=8)))
        assert fn is nf4_gemv_pair_kernel and grid == (8,) and options == {"num_warps": 8}  # 8 blocks of 128 rows
        assert (args["NTILE"], args["THREADS"], args["SPLIT"], args["SEG"], args["TILES"], args["ONE"]) == (
            ntile, 256, 1, 2048, 8, 1)
        assert args["code_ptr"] is runtime.level_table(CPU) and set(args) == set(fn.arg_names)
    part = torch.zeros(16 * 1000)
    launches = gemv_pair.launches(_gpu_call(x[:1], w, out[:1], 1, config, part))
    assert [fn.__name__ for fn, *_ in launches] == ["nf4_gemv_pair_kernel", "nf4_split_sum_kernel"]
    assert launches[0][1] == (256,) and launches[0][2]["TILES"] == 256  # 16 blocks x 16 segments, under 792
    assert launches[0][2]["out_ptr"] is part and launches[0][2]["PARTIAL"] and launches[1][2]["SPLIT"] == 16
    # off the GPU (an offline build's launch): one segment, one program per row block
    ((_, grid, args, _),) = launch.kernel_args(x[:1], w, None, out[:1], 1, config, True, False)
    assert grid == (16,) and args["SPLIT"] == 1 and not args["PARTIAL"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors in Triton's interpreter (off on a CUDA machine)")
def test_gemv_pair_runs_only_where_it_can(nf4h):
    """runnable: a CUDA GPU (sm_80+), so never here; a gemv_pair config falls back to the word GEMV of its shape
    (then the GEMV), and nf4.linear's product with it is that kernel's, operand-exact."""
    import nf4
    from nf4.linear.gemv_pair import runnable
    from verify.exact import assert_bitexact

    packed, qs = nf4h.quantize((45, 256), torch.bfloat16, 64, True, seed=nf4h.case_seed("gemv-pair-cpu"))
    w = NF4Weight.from_state(packed, qs)
    config = LinearConfig(kernel="gemv_pair", programs_per_sm=6)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not runnable(config, w, x, 4) and not launch.runnable(config, w, x, 4)
    assert launch.launch_config(config, w, x, 4, False) == config.with_(kernel="gemv_table", codebook=0)
    assert launch.launch_config(config, w, torch.zeros(9, 256, dtype=torch.bfloat16), 9, False) == config.with_(
        kernel="gemv", codebook=0)
    assert launch.launch_config(config, w, x, 4, True).kernel == "dequant"
    eye = torch.eye(256, dtype=torch.bfloat16)[:8] * -2
    want = (nf4.dequantize(packed, qs).to(torch.bfloat16).t()[:8].float() * -2 + 0.0).to(torch.bfloat16)
    assert_bitexact(nf4.linear(eye, packed, qs, config=config), want, name="gemv_pair's fallback")
