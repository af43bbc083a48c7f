"""What the ops modules share for torch.compile: the per-device tables as it sees them, and the opaque ops'
registration. Imported only by the ops modules, which load only while torch.compile traces
(`torch.compiler.assume_constant_result` imports torch._dynamo, which `import nf4` must not).
"""

from __future__ import annotations

import torch

from . import runtime


@torch.compiler.assume_constant_result
def fill_tables(device: torch.device) -> None:
    """Fill the level tables and the stand-in for `device`. torch.compile calls this instead of tracing it: a trace
    that filled a cold cache would have a side effect, which Dynamo refuses inside an autograd.Function
    (bitsandbytes' MatMul4Bit.backward dequantizes there), and would build the pair table through torch._numpy,
    which has no uint64 shifts."""
    runtime.level_table(device)
    runtime.level_table(device, pairs=True)
    runtime.stand_in(device)


def traced_tables(device: torch.device) -> tuple:
    """(the 16 levels, the 256 level pairs, the stand-in) on `device`, for the ops' inputs."""
    fill_tables(device)
    return runtime.level_table(device), runtime.level_table(device, pairs=True), runtime.stand_in(device)


_LIBRARY: torch.library.Library | None = None


def opaque_op(name: str, schema: str, fake):
    """Decorator: the function as the op nf4::<name><schema>, its own kernel for CPU and CUDA tensors and `fake`
    for FakeTensors. Returns the function itself (a call of it from Python runs it without the dispatcher).

    A torch.library.Library registration: a call crosses into Python once. A torch.library.custom_op crosses three
    times (its autograd kernel, a redispatch, a wrapper around the kernel), which cost about 40 us a call on the
    GPU machines' hosts, on every compiled call without CUDA graphs. The op has no gradient: with grad mode on, an
    input that requires grad is refused with an error, before the dispatcher's autograd fallback could hand back a
    result without one. (Compiled graphs call it with grad mode off; nf4::linear's autograd formula is its own.)
    For ops that return a new tensor: one that writes into an input (nf4::dequantize_opaque) stays a custom_op,
    whose registration also bumps the written tensor's version counter."""
    def register(fn):
        global _LIBRARY
        if _LIBRARY is None:
            _LIBRARY = torch.library.Library("nf4", "FRAGMENT")
        _LIBRARY.define(name + schema)

        def kernel(*args):
            if torch.is_grad_enabled():
                for a in args:
                    if isinstance(a, torch.Tensor) and a.requires_grad:
                        raise RuntimeError(f"nf4::{name} has no gradient and got an input that requires grad: call "
                                           "nf4.linear / nf4.dequantize, whose autograd formulas are their own")
            return fn(*args)

        kernel.__name__ = kernel.__qualname__ = f"nf4_{name}_kernel"
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, kernel, key)
        torch.library.register_fake(f"nf4::{name}", fake, lib=_LIBRARY)
        return fn

    return register
