"""nf4.runtime.native's parameter layout and PTX parsing, on any machine (the launch itself is tested on the GPU).

The layout must give one slot per parameter of the kernel's PTX entry, in order and of the same size:
the non-constexpr arguments, then Triton's two scratch pointers. tests/nf4/dequant/test_sm75.py checks
it against the PTX of the production kernel compiled offline; these tests check the pieces on their own,
with a stand-in kernel.
"""

from __future__ import annotations

import random
import struct

import pytest

from nf4.runtime import native

PTX = """
.visible .entry my_kernel(
\t.param .u64 .ptr .global .align 1 my_kernel_param_0,
\t.param .u32 my_kernel_param_1,
\t.param .u64 my_kernel_param_2,
\t.param .u64 .ptr .global .align 1 my_kernel_param_3,
\t.param .u64 .ptr .global .align 1 my_kernel_param_4
)
.reqntid 64
{
\tret;
}
"""


class Ptr:
    """Anything with data_ptr(), as a tensor."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


def _slots(values: bytes) -> list[int]:
    return [struct.unpack_from("<Q", values, 8 * i)[0] for i in range(len(values) // 8)]


def test_ptx_param_sizes():
    assert native.ptx_param_sizes(PTX, "my_kernel") == [8, 4, 8, 8, 8]
    assert native.ptx_param_sizes(PTX, "other_kernel") is None
    assert native.ptx_param_sizes(PTX.replace(".u32", ".f16x2"), "my_kernel") is None
    assert native.ptx_param_sizes(".entry k(\n)\n{ ret; }", "k") == []


def test_layout_order_sizes_and_values():
    rng = random.Random(20261122)
    a, out = rng.randrange(1, 2**47) * 16, rng.randrange(1, 2**47) * 16
    n32, n64 = rng.randrange(-(2**31), 2**31), rng.randrange(2**31, 2**62)
    signature = {"a": "*u8", "n": "i32", "BLOCK": "constexpr", "m": "i64", "out_ptr": "*bf16", "one": "constexpr"}
    values, rebind_slots, sizes = native.layout(signature, (Ptr(a), n32, 64, n64, out, 1))
    assert sizes == [8, 4, 8, 8, 8, 8]  # a, n, m, out_ptr, then the two scratch pointers
    assert rebind_slots == [3]
    _, two, _ = native.layout(signature, (Ptr(a), n32, 64, n64, out, 1), rebind=("out_ptr", "a"))
    assert two == [3, 0]  # slots in the order the names were given
    slots = _slots(values)
    assert slots[0] == a and slots[2] == n64 and slots[3] == out and slots[4:] == [0, 0]
    assert struct.unpack_from("<i", values, 8)[0] == n32 and values[12:16] == b"\0" * 4


@pytest.mark.parametrize(("signature", "args"), [
    ({"x": "*fp32", "out_ptr": "*fp16"}, (Ptr(16),)),  # lengths differ
    ({"x": "*fp32", "s": "fp32", "out_ptr": "*fp16"}, (Ptr(16), 1.5, Ptr(32))),  # a float scalar
    ({"x": "*fp32", "flag": "i1", "out_ptr": "*fp16"}, (Ptr(16), True, Ptr(32))),  # a 1-bit scalar
    ({"x": "*fp32", "n": "i32", "out_ptr": "*fp16"}, (Ptr(16), True, Ptr(32))),  # a bool passed as an int
    ({"x": "*fp32", "y": "*fp16"}, (Ptr(16), Ptr(32))),  # no out_ptr
    ({"x": "*fp32", "out_ptr": "i64"}, (Ptr(16), 32)),  # out_ptr not a pointer
], ids=["length", "float", "i1", "bool", "no-out", "not-a-pointer"])
def test_layout_refuses_what_it_does_not_bind(signature, args):
    assert native.layout(signature, args) is None


def test_layout_matches_ptx_of_the_same_parameters():
    signature = {"out_ptr": "*u8", "n": "i32", "K": "constexpr", "q": "i64"}
    _, _, sizes = native.layout(signature, (Ptr(16), 3, 8, 2**40))
    assert sizes == native.ptx_param_sizes(PTX, "my_kernel")


class _Meta:
    name = "my_kernel"  # the PTX entry bind looks for
    num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
    global_scratch_size = profile_scratch_size = 0
    num_warps, shared = 2, 0


class _Src:
    def __init__(self):
        self.signature = {"out_ptr": "*u8", "n": "i32", "K": "constexpr", "q": "i64"}


class _Compiled:
    """What nf4.native.bind reads of a Triton CompiledKernel."""

    def __init__(self, ptx=None, **meta):
        if ptx is None:
            ptx = PTX
        self.metadata = _Meta()
        for k, v in meta.items():
            setattr(self.metadata, k, v)
        self.src, self.asm, self.function = _Src(), {"ptx": ptx}, 0xABC


class _FakeModule:
    def __init__(self):
        self.calls = []

    def bind(self, *args):
        self.calls.append(args)
        return ("bound", args)


@pytest.fixture
def fake_module():
    with native.module_override(_FakeModule()) as mod:
        yield mod


def test_bind_passes_the_checked_layout(fake_module):
    args = (Ptr(1 << 20), 12345, 8, 2**40)
    bound = native.bind(_Compiled(), args, grid_x=77, device_index=3)
    assert bound is not None and len(fake_module.calls) == 1
    function, device, grid_x, block_x, shared, rebind, values = fake_module.calls[0]
    assert (function, device, grid_x, block_x, shared) == (0xABC, 3, 77, 64, 0)
    assert struct.unpack("<i", rebind) == (0,)  # out_ptr is the first slot
    assert _slots(values) == [1 << 20, 12345, 2**40, 0, 0]


@pytest.mark.parametrize("meta", [{"num_ctas": 2}, {"launch_cooperative_grid": True}, {"launch_pdl": True},
                                  {"global_scratch_size": 128}, {"profile_scratch_size": 64}], ids=str)
def test_bind_refuses_launches_that_need_more_than_cuLaunchKernel(fake_module, meta):
    assert native.bind(_Compiled(**meta), (Ptr(16), 1, 8, 2), grid_x=1, device_index=0) is None
    assert fake_module.calls == []


def test_bind_refuses_a_layout_the_ptx_does_not_confirm(fake_module):
    other = PTX.replace(".param .u32", ".param .u64")
    assert native.bind(_Compiled(ptx=other), (Ptr(16), 1, 8, 2), grid_x=1, device_index=0) is None
    renamed = PTX.replace("my_kernel", "other_kernel")
    assert native.bind(_Compiled(ptx=renamed), (Ptr(16), 1, 8, 2), grid_x=1, device_index=0) is None  # no such entry
    assert fake_module.calls == []


def test_bind_falls_back_when_the_module_cannot_be_built():
    with native.module_override(None):
        assert native.bind(_Compiled(), (Ptr(16), 1, 8, 2), grid_x=1, device_index=0) is None


def test_bind_with_a_kernel_object_that_takes_no_attributes(fake_module):
    class Slotted:
        __slots__ = ("asm", "function", "metadata", "src")

    plain = _Compiled()
    compiled = Slotted()
    for name in Slotted.__slots__:
        setattr(compiled, name, getattr(plain, name))
    assert native.bind(compiled, (Ptr(16), 1, 8, 2), grid_x=1, device_index=0) is not None
