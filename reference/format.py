"""The NF4 format as bitsandbytes stores it: the one home of its constants.

Everything else in the repository (the NumPy reference, the Triton kernels, the tests, the
experiments) imports these names instead of repeating them. Pure Python and NumPy only.
"""

from __future__ import annotations

import numpy as np

# The 16 NF4 levels as float32 bit patterns, index = 4-bit code. Taken bit for bit from
# bitsandbytes (functional.get_4bit_type("nf4"), the CUDA kernel's dDequantizeNF4 and the CPU
# routine agree). Sorted ascending; code 7 is the exact zero.
NF4_CODE_BITS = np.array(
    [
        0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0,
        0xBE91A24D, 0xBE3D353F, 0xBDBA7871, 0x00000000,
        0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A,
        0x3EE1A4B8, 0x3F1007AB, 0x3F3913B3, 0x3F800000,
    ],
    dtype=np.uint32,
)  # fmt: skip
NF4_CODE = NF4_CODE_BITS.view(np.float32)
NF4_CODE.setflags(write=False)
NF4_ZERO_INDEX = 7  # the nibble a zero (and bitsandbytes' padding nibble) quantizes to

# QLoRA's normal-quantile offset, as bitsandbytes' create_normal_map spells it.
QLORA_OFFSET = 0.9677083

# First-level block sizes that bitsandbytes accepts for 4-bit quantization.
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCKSIZE = 64

# Double quantization: the float32 absmax vector is itself quantized to 8 bits with this
# block size (over the absmax vector, not over the weights) and the signed dynamic map.
ABSMAX_BLOCKSIZE = 256
CODE2_SIZE = 256

# bitsandbytes' signed 8-bit dynamic map (`functional.create_dynamic_map()`, the default
# `state2.code` of double quantization), as float32 bits. Recorded from bitsandbytes 0.50.2 with
# torch 2.13.0+cpu on an x86-64 AVX512 machine. Another CPU build of torch can differ in up to
# 1-2 ulp on some entries (see reference.codebook.dynamic_map); dequantization always uses the
# map stored in the state, this table is only the default for quantizing.
DYNAMIC_MAP_BITS = np.array(
    [
        0xBF7E3333, 0xBF7A999A, 0xBF770000, 0xBF736666, 0xBF6FCCCD, 0xBF6C3333, 0xBF68999A, 0xBF650000,
        0xBF616666, 0xBF5DCCCD, 0xBF5A3333, 0xBF56999A, 0xBF530000, 0xBF4F6666, 0xBF4BCCCD, 0xBF483333,
        0xBF44999A, 0xBF410000, 0xBF3D6666, 0xBF39CCCD, 0xBF363334, 0xBF32999A, 0xBF2F0000, 0xBF2B6666,
        0xBF27CCCD, 0xBF243334, 0xBF20999A, 0xBF1D0000, 0xBF196666, 0xBF15CCCD, 0xBF123334, 0xBF0E999A,
        0xBF0B0000, 0xBF076666, 0xBF03CCCC, 0xBF003333, 0xBEF93332, 0xBEF20000, 0xBEEACCCC, 0xBEE3999A,
        0xBEDC6666, 0xBED53333, 0xBECE0000, 0xBEC6CCCC, 0xBEBF999A, 0xBEB86666, 0xBEB13333, 0xBEAA0000,
        0xBEA2CCCC, 0xBE9B999A, 0xBE946666, 0xBE8D3334, 0xBE860000, 0xBE7D9999, 0xBE6F3333, 0xBE60CCCD,
        0xBE526666, 0xBE440000, 0xBE35999A, 0xBE273333, 0xBE18CCCD, 0xBE0A6666, 0xBDF80000, 0xBDDB3334,
        0xBDC9EB85, 0xBDC428F7, 0xBDBE6667, 0xBDB8A3D7, 0xBDB2E148, 0xBDAD1EB8, 0xBDA75C2A, 0xBDA1999A,
        0xBD9BD70A, 0xBD96147B, 0xBD9051EB, 0xBD8A8F5D, 0xBD84CCCD, 0xBD7E147B, 0xBD728F5D, 0xBD670A3D,
        0xBD5B851F, 0xBD500000, 0xBD447AE1, 0xBD38F5C3, 0xBD2D70A3, 0xBD21EB85, 0xBD166667, 0xBD0AE148,
        0xBCFEB852, 0xBCE7AE15, 0xBCD0A3D7, 0xBCB9999A, 0xBCA28F5D, 0xBC8B851F, 0xBC68F5C3, 0xBC3AE148,
        0xBC1F3B64, 0xBC160418, 0xBC0CCCCD, 0xBC039581, 0xBBF4BC6A, 0xBBE24DD3, 0xBBCFDF3B, 0xBBBD70A4,
        0xBBAB020D, 0xBB989374, 0xBB8624DD, 0xBB676C8A, 0xBB428F5C, 0xBB1DB22D, 0xBAF1A9FC, 0xBAA7EF9D,
        0xBA7765FF, 0xBA59E83E, 0xBA3C6A80, 0xBA1EECC1, 0xBA016F01, 0xB9C7E283, 0xB98CE705, 0xB923D70B,
        0xB8BA1F4B, 0xB88AEFB3, 0xB8378034, 0xB7B24206, 0xB70205FF, 0xB65A1A94, 0xB513A3B7, 0x00000000,
        0x3513A3B7, 0x365A1A94, 0x370205FF, 0x37B24206, 0x38378034, 0x388AEFB3, 0x38BA1F4B, 0x3923D70B,
        0x398CE705, 0x39C7E283, 0x3A016F01, 0x3A1EECC1, 0x3A3C6A80, 0x3A59E83E, 0x3A7765FF, 0x3AA7EF9D,
        0x3AF1A9FC, 0x3B1DB22D, 0x3B428F5C, 0x3B676C8A, 0x3B8624DD, 0x3B989374, 0x3BAB020D, 0x3BBD70A4,
        0x3BCFDF3B, 0x3BE24DD3, 0x3BF4BC6A, 0x3C039581, 0x3C0CCCCD, 0x3C160418, 0x3C1F3B64, 0x3C3AE148,
        0x3C68F5C3, 0x3C8B851F, 0x3CA28F5D, 0x3CB9999A, 0x3CD0A3D7, 0x3CE7AE15, 0x3CFEB852, 0x3D0AE148,
        0x3D166667, 0x3D21EB85, 0x3D2D70A3, 0x3D38F5C3, 0x3D447AE1, 0x3D500000, 0x3D5B851F, 0x3D670A3D,
        0x3D728F5D, 0x3D7E147B, 0x3D84CCCD, 0x3D8A8F5D, 0x3D9051EB, 0x3D96147B, 0x3D9BD70A, 0x3DA1999A,
        0x3DA75C2A, 0x3DAD1EB8, 0x3DB2E148, 0x3DB8A3D7, 0x3DBE6667, 0x3DC428F7, 0x3DC9EB85, 0x3DDB3334,
        0x3DF80000, 0x3E0A6666, 0x3E18CCCD, 0x3E273333, 0x3E35999A, 0x3E440000, 0x3E526666, 0x3E60CCCD,
        0x3E6F3333, 0x3E7D9999, 0x3E860000, 0x3E8D3334, 0x3E946666, 0x3E9B999A, 0x3EA2CCCC, 0x3EAA0000,
        0x3EB13333, 0x3EB86666, 0x3EBF999A, 0x3EC6CCCC, 0x3ECE0000, 0x3ED53333, 0x3EDC6666, 0x3EE3999A,
        0x3EEACCCC, 0x3EF20000, 0x3EF93332, 0x3F003333, 0x3F03CCCC, 0x3F076666, 0x3F0B0000, 0x3F0E999A,
        0x3F123334, 0x3F15CCCD, 0x3F196666, 0x3F1D0000, 0x3F20999A, 0x3F243334, 0x3F27CCCD, 0x3F2B6666,
        0x3F2F0000, 0x3F32999A, 0x3F363334, 0x3F39CCCD, 0x3F3D6666, 0x3F410000, 0x3F44999A, 0x3F483333,
        0x3F4BCCCD, 0x3F4F6666, 0x3F530000, 0x3F56999A, 0x3F5A3333, 0x3F5DCCCD, 0x3F616666, 0x3F650000,
        0x3F68999A, 0x3F6C3333, 0x3F6FCCCD, 0x3F736666, 0x3F770000, 0x3F7A999A, 0x3F7E3333, 0x3F800000,
    ],
    dtype=np.uint32,
)  # fmt: skip
DYNAMIC_MAP = DYNAMIC_MAP_BITS.view(np.float32)
DYNAMIC_MAP.setflags(write=False)

# Nibble order inside one packed byte: element 2k is the HIGH nibble, 2k+1 the LOW one.
HIGH_NIBBLE_SHIFT = 4
LOW_NIBBLE_MASK = 0b0000_1111

# Output dtypes, by name (NumPy has no bfloat16; the reference stores bf16 as uint16 bits).
OUT_DTYPES = ("float16", "bfloat16", "float32")

# Smallest normal float32: products below it are subnormal and the CUDA build flushes them.
FLT_MIN = np.float32(np.finfo(np.float32).tiny)

# bitsandbytes' C entry points take a 32-bit element count.
BNB_MAX_NUMEL = 2**31 - 1


def packed_size(numel: int) -> int:
    """Number of packed bytes for `numel` 4-bit elements (the last low nibble pads odd numel)."""
    return (numel + 1) // 2


def num_blocks(numel: int, blocksize: int) -> int:
    """Number of absmax blocks for `numel` elements; the tail block holds `numel % blocksize`."""
    return -(-numel // blocksize)


def check_blocksize(blocksize: int) -> int:
    """Return `blocksize` if bitsandbytes accepts it for NF4, else raise ValueError naming it."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, (int, np.integer)):
        raise TypeError(f"blocksize must be an int, got {type(blocksize).__name__}")
    if int(blocksize) not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    return int(blocksize)


def check_out_dtype(out_dtype: str) -> str:
    """Normalise an output dtype name ('float16', 'bfloat16', 'float32'); raise on anything else."""
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
    name = str(out_dtype).removeprefix("torch.")
    name = aliases.get(name, name)
    if name not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    return name
