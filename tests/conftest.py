"""Shared test setup: Triton's interpreter on machines without CUDA, then helpers by topic.

Without a CUDA device, TRITON_INTERPRET=1 must be in the environment before anything imports
triton (bitsandbytes does, on import), so it is set here, at the top of the first conftest that
pytest loads, and decided with torch alone. The repository root is importable through pytest's
`pythonpath` setting (pyproject.toml); tests are grouped in folders per package and op.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# nf4.linear's first calls on a GPU race configs (nf4/linear/autotune.py); the tests run the tuned table's
# configs, the same on every run, and tests/nf4/linear/test_autotune.py turns the race on where it tests it
os.environ.setdefault("NF4_AUTOTUNE", "0")

import copy
import zlib
from typing import ClassVar

import numpy as np
import pytest

# --- helpers for the kernel tests (test_nf4_*.py), reached through the `nf4h` fixture ---------


class KernelTestHelpers:
    """Helpers of the nf4 kernel tests; a class so that its names cannot clash with other helpers."""

    DTYPE_NAMES: ClassVar[dict] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    # A NaN of each width with a payload no computation produces: "still poisoned" is a bit test.
    POISON_BITS: ClassVar[dict] = {torch.float16: 0x7D5A, torch.bfloat16: 0x7FA5, torch.float32: 0x7FA5_5A5A}
    INT_VIEW: ClassVar[dict] = {2: torch.int16, 4: torch.int32}

    @staticmethod
    def emulate_ptx(asm, inputs: dict[str, int]) -> dict[str, int]:
        """The kernels' inline asm run by an emulator (`_emulate_ptx` below); returns every register."""
        return _emulate_ptx(asm, inputs)

    @staticmethod
    def run_sanitizer(tool: str, child: str, kernels: str, log_name: str, env: dict | None = None):
        """`python -c child` from the repository root under compute-sanitizer's `tool` (memcheck without leak
        checks, racecheck, ...), judging only the kernels whose names start with `kernels` (not bitsandbytes'
        that compute expected values); skips where compute-sanitizer is not installed. With NF4_SANITIZER_LOG
        set, the tool's output is kept there as `log_name`. Returns (returncode, the child's stdout, the whole
        output)."""
        import shutil
        import subprocess
        import sys
        from pathlib import Path

        exe = shutil.which("compute-sanitizer") or next(
            (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
        if exe is None:
            pytest.skip("compute-sanitizer is not installed")
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        cmd = [exe, "--tool", tool, "--error-exitcode", "9", "--target-processes", "all", "--kernel-name",
               f"kns={kernels}", *(["--leak-check", "no"] if tool == "memcheck" else [])]
        proc = subprocess.run([*cmd, sys.executable, "-c", child], cwd=root, env=env, capture_output=True, text=True,
                              timeout=1200)
        log = proc.stdout + proc.stderr
        folder = os.environ.get("NF4_SANITIZER_LOG")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / log_name).write_text(log)
        return proc.returncode, proc.stdout, log

    @staticmethod
    def case_seed(*key) -> int:
        """A seed derived from a test's parameters: fresh, reproducible data for every case."""
        return zlib.crc32(repr(key).encode())

    @staticmethod
    def make_weight(shape, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
        """Random weights with magnitudes spread over a few octaves and some exact zeros."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        x = x * torch.exp2(torch.randint(-4, 5, shape, generator=g).float())
        x.view(-1)[::13] = 0.0
        return x.to(dtype).to(device)

    @classmethod
    def quantize(cls, shape, dtype=torch.float16, blocksize=64, double_quant=True, *, seed,
                 quant_storage=torch.uint8, device="cpu"):
        """(packed, QuantState) from bitsandbytes' own `quantize_4bit` on `device`, nf4."""
        import bitsandbytes.functional as F

        x = cls.make_weight(shape, dtype, seed, device)
        return F.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4",
                               quant_storage=quant_storage)

    @classmethod
    def reference_dequant(cls, packed, state, out_dtype: torch.dtype | None = None, *, ftz: bool = False):
        """`reference.dequantize_nf4` as a CPU tensor, transposed like bitsandbytes for a (1, k) packed."""
        import reference

        out_dtype = state.dtype if out_dtype is None else out_dtype
        arr = reference.dequantize_nf4(reference.from_bnb(packed, state), cls.DTYPE_NAMES[out_dtype], ftz=ftz)
        if out_dtype == torch.bfloat16:
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        return t.t() if packed.shape[0] == 1 else t

    @classmethod
    def clone_state(cls, state, **changes):
        """A new QuantState whose tensors (and state2) are clones; `changes` replace attributes after.

        Bad and crafted states are built with this, so no shared state is ever mutated.
        """
        new = copy.copy(state)
        for name, value in vars(state).items():
            if isinstance(value, torch.Tensor):
                setattr(new, name, value.clone())
            elif type(value).__name__ == "QuantState":
                setattr(new, name, cls.clone_state(value))
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    @classmethod
    def tiny_state(cls, state, seed: int):
        """A copy of `state` whose absmax (or state2.absmax and offset) sit near 2**-126, same device.

        With double quantization state2.absmax mixes normal and subnormal scales and the offset is
        tiny, so `code2 * absmax2`, `+ offset` and `NF4 * absmax` all land among the subnormals;
        without it the float32 absmax spans 1e-40 .. 1e-37.
        """
        device = state.absmax.device
        if state.nested:
            n2 = state.state2.absmax.numel()
            absmax2 = torch.tensor([3e-38, 9e-39, 2.5e-38, 1.5e-39] * n2, dtype=torch.float32)[:n2]
            state2 = cls.clone_state(state.state2, absmax=absmax2.to(device))
            offset = torch.tensor(1.25e-38, dtype=torch.float32, device=device)
            return cls.clone_state(state, state2=state2, offset=offset)
        g = torch.Generator().manual_seed(seed)
        exponent = torch.empty(state.absmax.numel(), dtype=torch.float64).uniform_(-40, -37, generator=g)
        return cls.clone_state(state, absmax=torch.pow(10.0, exponent).float().to(device))

    @staticmethod
    def input_tensors(packed, state) -> dict[str, torch.Tensor]:
        """Every tensor a dequantize call reads, by name."""
        found = {"packed": packed}
        for name, value in vars(state).items():
            if isinstance(value, torch.Tensor):
                found[f"quant_state.{name}"] = value
        state2 = getattr(state, "state2", None)
        if state2 is not None:
            for name, value in vars(state2).items():
                if isinstance(value, torch.Tensor):
                    found[f"quant_state.state2.{name}"] = value
        return found

    @classmethod
    def snapshot(cls, packed, state) -> dict[str, torch.Tensor]:
        """Clones of every input tensor, to check after a call that nothing was written."""
        return {name: t.detach().clone() for name, t in cls.input_tensors(packed, state).items()}

    @classmethod
    def assert_unchanged(cls, before: dict[str, torch.Tensor], packed, state) -> None:
        """Every input tensor still equals its snapshot bit for bit (same dtype and shape too)."""
        from verify.exact import assert_bitexact

        after = cls.input_tensors(packed, state)
        assert after.keys() == before.keys()
        for name, old in before.items():
            new = after[name]
            assert (new.dtype, tuple(new.shape)) == (old.dtype, tuple(old.shape)), name
            if not old.is_meta:
                assert_bitexact(new, old, name=f"{name} after the call")

    @classmethod
    def poisoned_out(cls, shape, dtype: torch.dtype, device, *, lead: int = 0, guard: int = 67):
        """(buffer, out): `out` of `shape` is a contiguous view `lead` elements into a NaN-filled
        buffer with `guard` more NaNs after its end. The NaN is POISON_BITS, written as integers."""
        n = int(np.prod(shape, dtype=np.int64))
        buf = cls.poison(torch.empty(lead + n + guard, dtype=dtype, device=device))
        out = buf[lead : lead + n].view(shape)
        assert out.is_contiguous()
        return buf, out

    @classmethod
    def poison(cls, buf: torch.Tensor) -> torch.Tensor:
        """Fill `buf` with POISON_BITS (a NaN), written as integers; returns buf."""
        width = buf.element_size()
        bits = cls.POISON_BITS[buf.dtype]
        if bits >= 1 << (8 * width - 1):  # as the signed integer view reads it
            bits -= 1 << (8 * width)
        buf.view(cls.INT_VIEW[width]).fill_(bits)
        return buf

    @classmethod
    def assert_poison_intact(cls, buf: torch.Tensor, start: int, stop: int) -> None:
        """The buffer outside [start, stop) still holds the poison bit pattern, bit for bit."""
        from verify.exact import assert_bitexact

        width = buf.element_size()
        got = buf.view(cls.INT_VIEW[width]).cpu().to(torch.int64) & ((1 << (8 * width)) - 1)
        expect = torch.full_like(got, cls.POISON_BITS[buf.dtype])
        assert_bitexact(got[:start], expect[:start], name="guard before out")
        assert_bitexact(got[stop:], expect[stop:], name="guard after out")


# --- a PTX emulator for the inline asm of the kernels (Triton's interpreter cannot run PTX) ---------


def _prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (default mode): byte i of d = byte (c nibble i & 7) of {b, a}, sign-replicated if bit 3."""
    src, d = a | (b << 32), 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << (8 * i)
    return d


def _mul_f32(a: int, b: int, ftz: bool) -> int:
    """mul.rn(.ftz).f32 on float32 bit patterns (.ftz: subnormal inputs and result flushed to signed zero)."""
    from reference.floats import flush_subnormal

    x, y = (np.asarray([v], dtype=np.uint32).view(np.float32) for v in (a, b))
    p = flush_subnormal(flush_subnormal(x) * flush_subnormal(y)) if ftz else (x * y).astype(np.float32)
    return int(p.view(np.uint32)[0])


def _cvt_x2(dtype: str, hi: int, lo: int) -> int:
    """cvt.rn.{bf16,f16}x2.f32 d, hi, lo: both rounded to nearest even, hi in the upper half."""
    from reference.floats import cast_float32

    halves = cast_float32(np.asarray([hi, lo], dtype=np.uint32).view(np.float32), dtype)
    return (int(halves.view(np.uint16)[0]) << 16) | int(halves.view(np.uint16)[1])


_PTX_OPS = {"shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b, "and.b32": lambda a, b: a & b,
            "or.b32": lambda a, b: a | b, "prmt.b32": _prmt, "mul.rn.f32": lambda a, b: _mul_f32(a, b, False),
            "mul.rn.ftz.f32": lambda a, b: _mul_f32(a, b, True),
            "cvt.rn.bf16x2.f32": lambda a, b: _cvt_x2("bfloat16", a, b),
            "cvt.rn.f16x2.f32": lambda a, b: _cvt_x2("float16", a, b)}


def _emulate_ptx(asm, inputs: dict[str, int]) -> dict[str, int]:
    """Run the inline-asm text `asm` (a string or tl.constexpr) on 32-bit registers: `inputs` maps operands
    ("$8") to values; returns every register. Knows the instructions the kernels' asm uses (shifts, and, or,
    prmt, mul.rn(.ftz).f32, cvt.rn.{bf16,f16}x2.f32); immediates are integers or 0f-prefixed float32 bits."""
    text = "\n".join(line.split("//")[0] for line in getattr(asm, "value", asm).splitlines())
    regs = dict(inputs)
    for stmt in text.split(";"):
        stmt = stmt.replace("{", " ").replace("}", " ").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        vals = [int(s[2:], 16) if s.startswith("0f") else int(s, 0) if s[0].isdigit() else regs[s] for s in srcs]
        regs[dst] = _PTX_OPS[op](*vals) & 0xFFFFFFFF
    return regs


@pytest.fixture
def nf4h():
    """The kernel tests' helpers (KernelTestHelpers)."""
    return KernelTestHelpers
