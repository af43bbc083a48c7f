"""The first-call template's key (`nf4.dequant.api._template_key`) on a CPU: calls that share a key share
everything the compiled kernel and its bound launch depend on.

A template (`DequantConfig.first_call_template`, on by default) launches a kernel compiled for an earlier call
and passes only this call's six tensor pointers; everything else (the kernel Triton would pick, the grid, the integer
arguments, the launch options) was fixed by the earlier call. So two calls with one key must agree on all of it.
Here every pair of calls of a varied set (sizes, blocksizes, double quantization, storage dtypes, pointer
offsets of each tensor, output dtypes and offsets, ftz, configs) is built with `kernel_launch` and compared
under one key; Triton's specialisation key is computed on a compiled (not interpreted) build of the kernel by
`nf4.runtime.spec_key`. The launch through the template itself needs a GPU (tests/nf4/dequant/test_gpu.py).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import triton

from nf4 import runtime
from nf4.dequant import api
from nf4.dequant.config import DequantConfig
from nf4.dequant.kernel import nf4_dequantize_kernel

_POINTERS = ("packed_ptr", "absmax_ptr", "absmax2_ptr", "code2_ptr", "offset_ptr", "out_ptr")


def _jit_kernel():
    """The kernel as Triton compiles it (what spec_key reads), also when the interpreter is on."""
    if isinstance(nf4_dequantize_kernel, triton.runtime.JITFunction):
        return nf4_dequantize_kernel
    return triton.runtime.jit.JITFunction(nf4_dequantize_kernel.fn, do_not_specialize=["n_words"])


def _at(t: torch.Tensor, shift: int, keep: list) -> torch.Tensor:
    """A copy of t whose data pointer is `shift` bytes past a 64-byte boundary (the buffer kept in `keep`)."""
    width = t.element_size()
    buf = torch.zeros(t.numel() + 64 // width + 1, dtype=t.dtype)
    start = (-buf.data_ptr() % 64 + shift) // width
    keep.append(buf)
    out = buf[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 == shift
    return out


def _calls(nf4h):
    """(key, launch) of varied calls: the launch as the template fixes it, the pointers left out."""
    kernel, keep, rows = _jit_kernel(), [], []
    small, big = DequantConfig(tile_bytes=1024, num_warps=4), DequantConfig(tile_bytes=512, num_warps=2)
    persistent = DequantConfig(programs_per_sm=2)
    grid = itertools.product(
        [(5, 67), (64, 64), (3, 128), (7,), (1, 333)],  # sizes (odd ones leave a half byte and part words)
        [64, 128],  # blocksizes
        [True, False],  # double quantization
        [torch.uint8, torch.bfloat16],  # storage
    )
    for shape, blocksize, nested, storage in grid:
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        if storage is not torch.uint8 and (n + 1) // 2 % storage.itemsize:
            continue  # a storage dtype needs whole elements of packed bytes
        packed0, state = nf4h.quantize(shape, torch.float16, blocksize, nested, quant_storage=storage,
                                       seed=nf4h.case_seed("tmpl-key", shape, blocksize, nested, storage))
        width = packed0.element_size()
        for p_shift, a_shift, out_dtype, o_shift, ftz, config in itertools.product(
                sorted({0, 16, 4 * width, width}), [0, 4], [torch.float16, torch.float32], [0, 16, 4], [True, False],
                [small, big, persistent]):
            if (packed0.numel() * width) % 4 and p_shift % 4 == 0 and p_shift:
                continue
            packed = _at(packed0, p_shift, keep)
            absmax = _at(state.absmax, a_shift if not nested else a_shift + 1, keep)
            if nested:
                absmax2, code2, offset = (_at(state.state2.absmax, 0, keep), _at(state.state2.code, 0, keep),
                                          _at(state.offset.reshape(1), 0, keep).reshape(()))
            else:
                absmax2 = code2 = offset = api._dummy(packed.device)
            out = _at(torch.empty(shape, dtype=out_dtype), o_shift, keep)
            key = api._template_key(packed, absmax, absmax2, code2, offset, out, n, blocksize, nested, ftz, config)
            fn, grid_, args, options = api.kernel_launch(packed, absmax, absmax2, code2, offset, out, n, blocksize,
                                                         nested, ftz, config, vec=packed.data_ptr() % 4 == 0)
            values = runtime.positional(fn, args)
            fixed = tuple((name, value) for name, value in zip(fn.arg_names, values, strict=True)
                          if name not in _POINTERS and not isinstance(value, torch.Tensor))
            launch = (tuple(grid_), fixed, tuple(sorted(options.items())), runtime.spec_key(kernel, values),
                      args["code_ptr"].data_ptr())
            rows.append((key, launch))
    return rows


def test_calls_that_share_a_template_key_share_the_launch(nf4h):
    by_key: dict = {}
    calls = _calls(nf4h)
    for key, launch in calls:
        by_key.setdefault(key, []).append(launch)
    differing = {k: set(v) for k, v in by_key.items() if len(set(v)) > 1}
    example = next(iter(differing.items()), None)
    assert not differing, f"{len(differing)} template keys cover launches that differ, e.g. {example}"
    # the check has calls to compare under one key, and keys that tell calls apart
    assert sum(len(v) > 1 for v in by_key.values()) > 100 and len(by_key) > 100, (len(calls), len(by_key))


def test_a_plan_is_due_the_second_time_a_state_takes_the_full_path(nf4h):
    """`_plan_due`: False the first time (the state is noted by a weak reference), True the second; a new
    object at a freed one's address starts again; a state is never kept alive by the note."""
    import gc

    class State:
        pass

    first = State()
    assert api._plan_due(first) is False
    assert api._plan_due(first) is True
    assert api._plan_due(first) is False  # the note was used up: the next plan is due on the call after
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None, "the note keeps the state alive"
    others = [State() for _ in range(50)]  # some land on the freed address: each starts from its first call
    assert [api._plan_due(s) for s in others] == [False] * 50
    assert [api._plan_due(s) for s in others] == [True] * 50


def test_the_template_is_on_by_default_and_in_every_tuned_config():
    """Measured on both GPUs (nf4/dequant/config.py), the first-call template is what a call takes unless its config
    turns it off."""
    from nf4.dequant import config as dequant_config

    assert DequantConfig().first_call_template is True
    tuned = [config for rows in dequant_config.TUNED.values() for _, config in rows]
    assert tuned and all(c.first_call_template for c in tuned)
