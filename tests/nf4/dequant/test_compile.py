"""nf4's dequantize ops under torch.compile, without a GPU.

- `torch.library.opcheck` of `nf4::dequantize`, `nf4::dequantize_into` and `nf4::dequantize_opaque` (schema,
  fake tensors, AOT dispatch), in Triton's interpreter.
- torch.compile(fullgraph=True) of `nf4.dequantize` in the interpreter: the triton_ops take the opaque op there
  (`wrap_triton` cannot trace an InterpretedFunction), bit-exact; a first call compiled with nf4's caches still
  empty makes one graph (the caches are filled outside the trace).
- The GPU route's graph, traced in a child process without the interpreter (CPU tensors; nothing runs): the graph
  torch.compile hands its backend holds the production kernel as Inductor sees a user's Triton kernel, a
  `triton_kernel_wrapper_functional` node, with the launch `nf4.dequant.launch.kernel_launch` builds, and no opaque op.
- A bitsandbytes Linear4bit with nf4 patched in, forward and backward compiled fullgraph (the backward's
  `dequantize_4bit` is nf4's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import nf4
import nf4.dequant.ops  # registers the nf4:: dequantize ops (nf4.dequantize imports them only when compiling)
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.traced import traced_tables
from verify.exact import assert_bitexact

pytestmark = pytest.mark.skipif(
    not isinstance(nf4_dequantize_kernel, InterpretedFunction),
    reason="needs Triton's interpreter: TRITON_INTERPRET=1 before triton is imported (conftest sets it without CUDA)",
)

ROOT = Path(__file__).resolve().parents[3]


def _parts(state):
    """(absmax, absmax2, code2, offset) of a QuantState, None for the absent second level."""
    if state.nested:
        return state.absmax, state.state2.absmax, state.state2.code, state.offset
    return state.absmax, None, None, None


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("op", ["dequantize", "dequantize_into", "dequantize_opaque"])
def test_opcheck(nf4h, op, double_quant):
    packed, state = nf4h.quantize((33, 100), torch.bfloat16, 64, double_quant, seed=nf4h.case_seed("opcheck", op))
    parts = _parts(state)
    out = torch.empty(33, 100, dtype=torch.bfloat16)
    tables = traced_tables(packed.device)
    args = {
        "dequantize": (packed, *parts, *tables, [33, 100], torch.bfloat16, 64, False),
        "dequantize_into": (packed, *parts, *tables, out, 64, False),
        "dequantize_opaque": (packed, *parts, out, 64, False),
    }[op]
    torch.library.opcheck(getattr(torch.ops.nf4, op).default, args)
    got = torch.ops.nf4.dequantize(packed, *parts, *tables, [33, 100], torch.bfloat16, 64, False)
    assert_bitexact(got, nf4h.reference_dequant(packed, state), name="the op called eagerly")


@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
def test_eager_calls_dispatch_no_nf4_op(nf4h, with_out):
    """Outside torch.compile nf4.dequantize launches the kernel itself: no nf4:: op goes through the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    packed, state = nf4h.quantize((33, 100), torch.bfloat16, 64, True, seed=nf4h.case_seed("eager-no-op", with_out))
    out = torch.empty(33, 100, dtype=torch.bfloat16) if with_out else None
    with Ops():
        for _ in range(2):
            got = nf4.dequantize(packed, state, out=out)
    assert not [name for name in seen if name.startswith("nf4.")], seen
    assert_bitexact(got, nf4h.reference_dequant(packed, state))


class _Graphs:
    """An aot_autograd backend that keeps the forward and backward graphs it is handed, then runs them."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.graphs = []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def targets(self, i: int) -> list[str]:
        """The call targets of graph i, with the op an auto_functionalized node wraps."""
        found = []
        for node in self.graphs[i].graph.nodes:
            if node.op == "call_function":
                found.append(str(node.target))
                if node.args and isinstance(node.args[0], torch._ops.OpOverload):
                    found.append(str(node.args[0]))
        return found


@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
def test_compile_takes_the_opaque_op_in_the_interpreter(nf4h, with_out):
    from torch._dynamo.utils import counters

    packed, state = nf4h.quantize((96, 200), torch.float16, 64, True, seed=nf4h.case_seed("compile-graph", with_out))
    expect = nf4h.reference_dequant(packed, state)
    buf = torch.empty(96, 200, dtype=torch.float16)

    def fn(p):
        return nf4.dequantize(p, state, out=buf if with_out else None)

    graphs = _Graphs()
    torch._dynamo.reset()
    counters.clear()
    try:
        got = torch.compile(fn, fullgraph=True, backend=graphs.backend)(packed)
    finally:
        torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_bitexact(got, expect, name="compiled")
    if with_out:
        assert got.data_ptr() == buf.data_ptr()
        assert_bitexact(buf, expect, name="out after the compiled call")
    targets = graphs.targets(0)
    assert "nf4.dequantize_opaque.default" in targets, targets
    assert not any("triton_kernel_wrapper" in t for t in targets), targets


def _child(code: str, *argv: str, interpret: bool) -> str:
    """Run `code` in a fresh Python (no GPU; Triton's interpreter on or off); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


COLD_CHILD = r"""
import torch
import bitsandbytes.functional as F
import nf4
from nf4 import runtime
from verify.exact import assert_bitexact

torch.manual_seed(0)
p1, s1 = F.quantize_4bit(torch.randn(33, 100, dtype=torch.bfloat16), blocksize=64, compress_statistics=True,
                         quant_type="nf4")
p2, s2 = F.quantize_4bit(torch.randn(64, 64, dtype=torch.float16), blocksize=64, compress_statistics=False,
                         quant_type="nf4")
assert not runtime._tables
graphs = []


def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward


def fn(a, b):
    return nf4.dequantize(a, s1), nf4.dequantize(b, s2)


compiled = torch.compile(fn, fullgraph=True, backend=backend)
for _ in range(3):
    got = compiled(p1, p2)
expect = fn(p1, p2)
assert_bitexact(got[0], expect[0], name="first weight")
assert_bitexact(got[1], expect[1], name="second weight")
levels = [key for key in runtime._tables if key[1] in (False, True)]  # (device, pairs): the level tables
stand_ins = [key for key in runtime._tables if key[1] == "zeros"]
assert len(runtime._tables) == len(levels) + len(stand_ins), list(runtime._tables)
print(len(graphs), len(levels), len(stand_ins))
"""


def test_first_call_compiled_with_empty_caches_makes_one_graph():
    """A fresh process whose first nf4 call is compiled (two weights in one function): the level tables are
    built outside the trace, so the graph does not build them itself, and the second call takes the same graph."""
    assert _child(COLD_CHILD, interpret=True).split() == ["1", "2", "1"]


GPU_ROUTE_CHILD = r"""
import itertools
import json
import logging

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

from nf4 import NF4Weight, runtime
from nf4.dequant import ops
from nf4.dequant.kernel import nf4_dequantize_kernel
from nf4.dequant.launch import kernel_launch, tuned_config

# Without a GPU, Triton has no target to read the kernel's IR for the arguments it writes; torch then takes every
# tensor argument as written and says so in a warning with a traceback.
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
assert not runtime.interpreter_on()
shape, blocksize, dtype = (33, 100), 64, torch.bfloat16
n = shape[0] * shape[1]
n_blocks = -(-n // blocksize)


class Captured(Exception):
    pass


def facts(with_out, byte_offset, double_quant):
    buf = torch.zeros((n + 1) // 2 + 16, dtype=torch.uint8)
    packed = buf[byte_offset : byte_offset + (n + 1) // 2].view(-1, 1)
    if double_quant:
        parts = (torch.zeros(n_blocks, dtype=torch.uint8), torch.ones(1), torch.zeros(256), torch.zeros(()))
    else:
        parts = (torch.ones(n_blocks), None, None, None)
    out = torch.empty(shape, dtype=dtype)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        raise Captured  # the graph is what is checked; the kernel cannot run on a CPU tensor

    def fn(p, o):
        w = NF4Weight(p, *parts, shape, blocksize, dtype, double_quant)
        return ops.dequantize_op(w, o if with_out else None, dtype, True)

    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep))(packed, out)
    except Exception as exc:
        assert graphs, exc
    nodes = [node for node in graphs[0].graph.nodes if node.op == "call_function"]
    calls = [node for node in nodes if "triton_kernel_wrapper" in str(node.target)]
    wrapped = kernel_side_table.get_kernel(calls[0].kwargs["kernel_idx"])  # an Autotuner of one config: num_warps
    traced = {k: v for k, v in calls[0].kwargs["kwargs"].items() if not isinstance(v, torch.fx.Node)}
    traced.update(kernel_side_table.get_constant_args(calls[0].kwargs["constant_args_idx"]))
    config = tuned_config(packed.device, n * out.element_size())
    w = NF4Weight(packed, *parts, shape, blocksize, dtype, double_quant)
    _, grid, args, options = kernel_launch(w, out, True, config, vec=byte_offset % 16 == 0, fusion_proof=True)
    return {
        "calls": len(calls), "kernel_is_production": getattr(wrapped, "fn", wrapped) is nf4_dequantize_kernel,
        "opaque": sum("dequantize_opaque" in str(node.target) or "dequantize_opaque" in str(node.args[:1])
                      for node in nodes),
        "grid": [list(g) for g in calls[0].kwargs["grid"]], "launch_grid": list(grid) + [1] * (3 - len(grid)),
        "traced": traced, "launch": {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)},
        "num_warps": wrapped.configs[0].num_warps, "options": options,
    }


print(json.dumps({f"{o}-{b}-{d}": facts(o == "out", b, d == "dq")
                  for o, b, d in itertools.product(("alloc", "out"), (0, 4), ("dq", "nodq"))}))
"""


@pytest.fixture(scope="module")
def gpu_route():
    """The facts GPU_ROUTE_CHILD prints, per case "alloc|out-<byte offset>-dq|nodq"."""
    return json.loads(_child(GPU_ROUTE_CHILD, interpret=False).strip().splitlines()[-1])


@pytest.mark.parametrize("double_quant", ["dq", "nodq"])
@pytest.mark.parametrize("byte_offset", [0, 4])
@pytest.mark.parametrize("with_out", ["alloc", "out"])
def test_traced_graph_holds_the_production_kernel(gpu_route, with_out, byte_offset, double_quant):
    """Without the interpreter (a child process): the graph torch.compile(fullgraph=True) hands its backend calls
    the production kernel through `triton_kernel_wrapper_functional` (what Inductor compiles into its own code),
    with the grid, constexprs and num_warps of `kernel_launch` for the tuned config, and no opaque op. The word path
    is taken where the storage offset keeps the packed bytes 16-byte aligned (at +4 bytes: the byte path)."""
    facts = gpu_route[f"{with_out}-{byte_offset}-{double_quant}"]
    assert facts["calls"] == 1 and facts["kernel_is_production"] and facts["opaque"] == 0, facts
    assert facts["grid"] == [facts["launch_grid"]], facts
    assert facts["traced"] == facts["launch"], facts
    assert facts["launch"]["VEC"] is (byte_offset == 0)
    assert facts["options"] == {"num_warps": facts["num_warps"]}, facts


# --- bitsandbytes' Linear4bit with nf4 patched in --------------------------------------------------------------


def _linear4bit(nf4h, seed):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(128, 37, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                              quant_type="nf4", quant_storage=torch.uint8)
    layer.weight = bnb.nn.Params4bit(nf4h.make_weight((37, 128), torch.float32, seed), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8,
                                     blocksize=64)
    return layer.to("cpu").train()


def _step(f, x0, dy):
    x = x0.detach().clone().requires_grad_(True)
    y = f(x)
    y.backward(dy)
    return y.detach(), x.grad


def _patched_linear4bit_compiles(nf4h):
    seed = nf4h.case_seed("compile-linear4bit")
    layer = _linear4bit(nf4h, seed)
    x0 = nf4h.make_weight((6, 128), torch.bfloat16, seed + 1)
    dy = nf4h.make_weight((6, 37), torch.bfloat16, seed + 2)
    y0, g0 = _step(layer, x0, dy)
    graphs = _Graphs()
    torch._dynamo.reset()
    try:
        with nf4.patched_bitsandbytes():
            y1, g1 = _step(torch.compile(layer, fullgraph=True, backend=graphs.backend), x0, dy)
    finally:
        torch._dynamo.reset()
    assert_bitexact(y1, y0, name="output")
    assert_bitexact(g1, g0, name="input gradient")
    forward, backward = graphs.targets(0), graphs.targets(1)
    assert "bitsandbytes.gemm_4bit.default" in forward, forward
    assert "nf4.dequantize_opaque.default" in backward, backward  # the interpreter's route of nf4::dequantize


def test_patched_linear4bit_forward_backward_compiles_fullgraph(nf4h):
    """A patched Linear4bit's forward and backward compile fullgraph, bit-identical to bitsandbytes alone; the
    forward runs bitsandbytes' gemm_4bit op, the backward nf4 (routed-call counts are skipped while compiling:
    Dynamo refuses that side effect inside MatMul4Bit.backward, an autograd.Function)."""
    _patched_linear4bit_compiles(nf4h)
