"""The one registry of experiment variants.

A variant is one file in `experiments/variants/<op>/` that calls `register(...)` at import time;
its op (`experiments.ops`) is the package it lives in. `variants()` imports every module of every
op's package (pkgutil; names starting with "_" are helpers, not variants), so no list of variants
is kept anywhere by hand. A module may register a family from a grid written in that one file
(see variants/dequant/v30_tiles.py).

    @register("v01_byte_pairs", parent="v00_naive", change="one packed byte per lane, both nibbles")
    def run(packed, quant_state, out, *, ftz):
        ...  # launch, write the weight into `out`
        return out
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_REGISTRY: dict[str, Variant] = {}
_DISCOVERED = False


@dataclass(frozen=True)
class Variant:
    """One numbered kernel version: what it is, what changed, and how to launch it.

    run(packed, quant_state, out, *, ftz) -> tensor: dequantizes into `out` (contiguous, of
    `quant_state.shape` and the output dtype) and returns it; a variant that cannot write into a
    given buffer (torch.compile) may return a new tensor of the same shape and dtype instead.
    Works on CUDA tensors, and on CPU tensors in Triton's interpreter unless `gpu_only`.
    """

    id: str  # "v03_word16": the number orders the table, the words say what it is
    parent: str | None  # the variant this one changes one thing of
    change: str  # one line: what changed versus the parent
    run: Callable[..., Any]
    exact_expected: bool = True  # False: the runner reports mismatches and never times it
    kernel: Any = None  # the @triton.jit kernel its launcher launches (enables --sm75)
    # Optional override of the offline compile: out_dtype -> list of (kernel, signature, constexprs,
    # attrs, options). By default the launcher is run on meta tensors and its launch recorded.
    compile_spec: Callable[..., Any] | None = None
    gpu_only: bool = False  # cannot run in Triton's interpreter (skipped there)
    host_timing: bool = False  # also record host time per call and the harness's wall clock
    spills_expected: bool = False  # known to spill registers (measured); tests assert it stays so
    # The lowest CUDA compute capability (major * 10 + minor) its kernel builds for; 0: any. Above 75 the
    # offline sm_75 compile records a row saying why (`not_built`: arch_reason) and builds nothing in its name.
    min_arch: int = 0
    arch_reason: str = ""  # what needs min_arch (e.g. an instruction of the kernel's PTX)
    note: str = ""  # caveats the result table should carry (e.g. what the interpreter cannot check)
    op: str = "dequant"  # the operation (experiments.ops) the variant implements: its package's name
    module: str = field(default="", compare=False)
    teaches: str = field(default="", compare=False)  # first line of the module docstring


def register(id: str, *, parent: str | None, change: str, **fields) -> Callable:
    """Decorator: register the decorated launcher `run(packed, quant_state, out, *, ftz)` as a Variant.

    Extra keyword arguments are Variant fields (exact_expected, kernel, gpu_only, ...). Returns the
    launcher unchanged, so a module may call `register(...)(partial_launcher)` in a loop.
    """

    def deco(run: Callable) -> Callable:
        if id in _REGISTRY:
            raise ValueError(f"variant {id!r} registered twice ({_REGISTRY[id].module} and {run.__module__})")
        module = fields.pop("module", getattr(run, "__module__", ""))
        prefix = __package__ + ".variants."
        if "op" not in fields and module.startswith(prefix) and module.count(".") >= 3:
            fields["op"] = module[len(prefix):].split(".")[0]
        doc = (sys.modules[module].__doc__ or "") if module in sys.modules else ""
        teaches = doc.strip().splitlines()[0] if doc.strip() else ""
        _REGISTRY[id] = Variant(id=id, parent=parent, change=change, run=run, module=module, teaches=teaches,
                                **fields)
        return run

    return deco


def variants() -> dict[str, Variant]:
    """Every registered variant by id, sorted by id; imports experiments.variants.<op>.* on first use."""
    global _DISCOVERED
    if not _DISCOVERED:
        from . import ops

        for op in ops.names():
            package = importlib.import_module(f"{__package__}.variants.{op}")
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{package.__name__}.{info.name}")
        _DISCOVERED = True
        missing = {v.parent for v in _REGISTRY.values() if v.parent and v.parent not in _REGISTRY}
        if missing:
            raise ValueError(f"variants name parents that are not registered: {sorted(missing)}")
    return dict(sorted(_REGISTRY.items()))


def get(id: str) -> Variant:
    """The variant registered under `id` (KeyError with the known ids otherwise)."""
    found = variants()
    if id not in found:
        raise KeyError(f"no variant {id!r}; known: {', '.join(found)}")
    return found[id]


def select(patterns: list[str] | None) -> list[Variant]:
    """Variants whose id matches any of the shell-style patterns (all when none are given)."""
    import fnmatch

    found = variants()
    if not patterns:
        return list(found.values())
    chosen = [v for v in found.values() if any(fnmatch.fnmatchcase(v.id, p) or v.id == p for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(v, p) for v in found)]
    if unknown:
        raise KeyError(f"no variant matches {unknown}; known: {', '.join(found)}")
    return chosen


def lineage(id: str) -> list[str]:
    """The id followed by its ancestors, nearest first."""
    chain, seen = [], set()
    current: str | None = id
    while current and current not in seen:
        seen.add(current)
        chain.append(current)
        current = variants()[current].parent if current in variants() else None
    return chain
