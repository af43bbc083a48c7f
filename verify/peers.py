"""The implementations `nf4` is checked and timed against, each written here from its documented behaviour.

Every peer takes (packed, quant_state) and returns the dequantized weight like bitsandbytes:
shape `quant_state.shape`, dtype `quant_state.dtype`, transposed when packed.shape[0] == 1.
"""

from __future__ import annotations

import math

import torch

_global_buffers: dict = {}


def bnb_dequantize(packed, qs):
    """bitsandbytes' own `functional.dequantize_4bit` (CUDA kernels on GPU, C++/torch on CPU)."""
    import bitsandbytes.functional as F

    return F.dequantize_4bit(packed, qs, quant_type="nf4")


def bnb_absmax(qs):
    """The float32 absmax as bitsandbytes recovers it: `dequantize_blockwise(absmax, state2) + offset`."""
    if not qs.nested:
        return qs.absmax
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset


def bnb_default_dequantize(packed, qs):
    """bitsandbytes' pure-torch default backend, eager (`_dequantize_4bit_compute.__wrapped__`).

    The absmax is recovered as bitsandbytes does it (`bnb_absmax`). The `out.t()` shim for a packed
    tensor of shape (1, k) is applied here, as `functional.dequantize_4bit` would around the op.
    """
    from bitsandbytes.backends.default import ops as default_ops
    from bitsandbytes.backends.utils import _get_4bit_code

    a = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    code = _get_4bit_code("nf4", a.device)
    fn = default_ops._dequantize_4bit_compute
    fn = getattr(fn, "__wrapped__", fn)  # bitsandbytes wraps it in torch.compile
    out = fn(a.reshape(-1), bnb_absmax(qs), code, qs.blocksize, qs.shape, qs.dtype)
    return out.t() if packed.shape[0] == 1 else out


def bnb_triton_dequantize(packed, qs):
    """bitsandbytes' own Triton NF4 kernel (`backends/triton/kernels_4bit.dequantize_4bit_impl`), called directly.

    bitsandbytes registers it for XPU only; the kernel itself is plain Triton and takes CUDA tensors
    (or CPU tensors under TRITON_INTERPRET=1). `backends/triton/ops.py` is not imported: at import it
    asks `torch.accelerator` for a device type, which fails without one. The absmax is recovered by
    bitsandbytes first (`bnb_absmax`), as `functional.dequantize_4bit` does around the op.
    """
    from bitsandbytes.backends.triton import kernels_4bit

    a = packed.reshape(-1).view(torch.uint8)
    out = torch.empty(qs.shape, dtype=qs.dtype, device=packed.device)
    absmax = bnb_absmax(qs)
    if packed.device.type == "cuda":
        with torch.cuda.device(packed.device):
            kernels_4bit.dequantize_4bit_impl(a, absmax, qs.blocksize, "nf4", qs.dtype, out=out)
    else:
        kernels_4bit.dequantize_4bit_impl(a, absmax, qs.blocksize, "nf4", qs.dtype, out=out)
    return out.t() if packed.shape[0] == 1 else out


_BNB_LIB = [None]


def _bnb_lib():
    """bitsandbytes' native library, imported once (Unsloth imports it at module level)."""
    import bitsandbytes.backends.cuda.ops  # noqa: F401 - sets the ctypes signatures used below
    from bitsandbytes.cextension import lib

    _BNB_LIB[0] = lib
    return lib


_RELEASE: list = []  # [Release] once loaded, [reason] when it cannot be


def unsloth_release():
    """The released Unsloth (verify.unsloth_release.load()), or None when it is not here (see release_missing)."""
    if not _RELEASE:
        try:
            from . import unsloth_release

            _RELEASE.append(unsloth_release.load())
        except Exception as exc:  # not fetched, hashes differ, a torch that cannot import it
            _RELEASE.append(f"{type(exc).__name__}: {exc}"[:400])
    return _RELEASE[0] if not isinstance(_RELEASE[0], str) else None


def release_missing() -> str | None:
    """Why the released Unsloth cannot run here (None when it can)."""
    unsloth_release()
    return _RELEASE[0] if isinstance(_RELEASE[0], str) else None


def unsloth_release_dequantize(W, quant_state, out=None, use_global_buffer=False):
    """Unsloth 2026.10.9's own `fast_dequantize` for NF4 on CUDA (its one-launch Triton kernel), run from
    the release's files (verify.unsloth_release)."""
    release = unsloth_release()
    if release is None:
        raise RuntimeError(f"the Unsloth release is not available: {release_missing()}")
    return release.fast_dequantize(W, quant_state, out=out, use_global_buffer=use_global_buffer)


def unsloth_fast_dequantize(W, quant_state, out=None, use_global_buffer=False):
    """Unsloth <= 2025's three-launch `fast_dequantize` (today its ctypes fallback), re-implemented here
    as docs/FORMAT.md §7 describes it (CUDA only): the legacy path, kept as history.

    Three launches, two allocations: bitsandbytes' 8-bit blockwise kernel recovers the absmax
    into a float32 buffer, a torch op adds the offset, bitsandbytes' NF4 kernel writes the
    weight (fp16 kernel for float16, bf16 kernel for anything else). With
    `use_global_buffer=True` the output and absmax buffers are reused across calls.
    """
    lib = _BNB_LIB[0] or _bnb_lib()
    if quant_state is None:
        return W
    qs = quant_state
    absmax, shape, dtype, blocksize = qs.absmax, qs.shape, qs.dtype, qs.blocksize
    offset, state2 = qs.offset, qs.state2
    absmax2, code2, blocksize2 = state2.absmax, state2.code, state2.blocksize
    device = W.device
    n_absmax = absmax.numel()
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    if use_global_buffer:
        key = (device, dtype, tuple(shape), n_absmax)
        bufs = _global_buffers.get(key)
        if bufs is None:
            bufs = (torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(n_absmax, dtype=torch.float32, device=device))
            _global_buffers[key] = bufs
        out, out_absmax = out if out is not None else bufs[0], bufs[1]
    else:
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
        out_absmax = torch.empty(n_absmax, dtype=torch.float32, device=device)
    lib.cdequantize_blockwise_fp32(code2.data_ptr(), absmax.data_ptr(), absmax2.data_ptr(), out_absmax.data_ptr(),
                                   blocksize2, n_absmax, stream)
    out_absmax += offset
    fn = lib.cdequantize_blockwise_fp16_nf4 if dtype == torch.float16 else lib.cdequantize_blockwise_bf16_nf4
    fn(None, W.data_ptr(), out_absmax.data_ptr(), out.data_ptr(), blocksize, out.numel(), stream)
    return out.t() if W.shape[0] == 1 else out


def torch_dequantize(packed, absmax_u8, absmax2, code2, offset, code, n: int, blocksize: int, out_dtype):
    """A plain PyTorch formulation of NF4 dequantization (double quantization on), flat output.

    Written to be exact in eager mode: every float32 operation rounds once, as the format says.
    Under torch.compile, inductor emits a Triton kernel whose `code2 * absmax2 + offset` may be
    contracted into an FMA unless Triton's fp fusion is off (TRITON_DEFAULT_FP_FUSION=0).
    """
    bytes_ = packed.reshape(-1).view(torch.uint8)
    nib = torch.stack((bytes_ >> 4, bytes_ & 0xF), dim=-1).reshape(-1)[:n]
    scale2 = absmax2.repeat_interleave(256)[: absmax_u8.numel()]
    absmax = code2[absmax_u8.long()] * scale2 + offset
    n_blocks = absmax.numel()
    levels = code[nib.long()]
    pad = n_blocks * blocksize - n
    if pad:
        levels = torch.nn.functional.pad(levels, (0, pad))
    y = (levels.view(n_blocks, blocksize) * absmax[:, None]).reshape(-1)[:n]
    return y.to(out_dtype)


def make_torch_compile_peer(mode: str | None = None):
    """torch.compile of `torch_dequantize` (inductor generates its own Triton kernel)."""
    compiled = torch.compile(torch_dequantize, mode=mode, dynamic=False)

    def peer(packed, qs):
        from reference.format import NF4_CODE

        code = _nf4_code(packed.device, NF4_CODE)
        s2 = qs.state2
        n = math.prod(qs.shape)
        y = compiled(packed, qs.absmax, s2.absmax, s2.code, qs.offset, code, n, qs.blocksize, qs.dtype)
        y = y.view(qs.shape)
        return y.t() if packed.shape[0] == 1 else y

    return peer


_code_tables: dict = {}


def _nf4_code(device, values):
    t = _code_tables.get(device)
    if t is None:
        t = torch.tensor(values, dtype=torch.float32, device=device)
        _code_tables[device] = t
    return t
