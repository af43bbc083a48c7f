"""The operations the experiments know: each supplies its cases, inputs, oracle and call signature.

A variant belongs to the op whose package under `experiments/variants/` holds it
(`variants/dequant/v00_naive.py` is a dequant variant). The runner asks the variant's op for
everything op-specific, so adding an op (a module here plus a `variants/<op>/` package) touches no
other op's code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Op:
    """What the runner needs to know about one operation.

    parse_case(text) -> case (with .text, .shape, .dtype, .numel, .min_bytes)
    make_inputs(case, device, copies) -> list of input sets (tuples); the last item of each set is
        the output buffer the variant writes into
    oracle(inputs, gpu) -> the expected output tensor (bitsandbytes on a GPU, the reference without)
    call: the variant's signature, `run(*inputs, ftz=...)`, written out for the docs
    """

    name: str
    parse_case: Callable[[str], Any]
    make_inputs: Callable[..., list]
    oracle: Callable[..., Any]
    call: str
    gpu_cases: tuple[str, ...]
    interpreter_cases: tuple[str, ...]
    big_cases: tuple[str, ...] = ()  # also run for the variants below `big_root` (the production chain)
    big_root: str | None = None
    oracle_name: Callable[[bool], str] = lambda gpu: ""


_OPS = ("dequant", "linear", "linear_backward")


def get(name: str) -> Op:
    """The op called `name` (KeyError naming the known ones)."""
    if name not in _OPS:
        raise KeyError(f"no op {name!r}; known: {', '.join(_OPS)}")
    return importlib.import_module(f"{__name__}.{name}").OP


def names() -> tuple[str, ...]:
    """Every op the experiments know, in order."""
    return _OPS
