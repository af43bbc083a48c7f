"""The per-device tables as torch.compile sees them: imported only by the ops modules, which load only while
torch.compile traces (`torch.compiler.assume_constant_result` imports torch._dynamo, which `import nf4` must not).
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
