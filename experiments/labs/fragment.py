"""A NumPy model of a decode that writes wgmma's register operand directly, with x permuted instead of the weight.

Why: the GEMM lab (gemm_tma.py) found that a tile decoded in registers reaches wgmma through shared memory and
block-wide barriers, because Triton converts the decode's layout into wgmma's operand layout. If each thread decodes
exactly the weights its fragment holds, no conversion is needed. The weights a thread's fragment holds are not
contiguous in bitsandbytes' packed rows, but K's order does not change the sum: permute x's columns inside each
64-weight step instead, and let each thread decode 8 contiguous bytes.

The fragment (PTX ISA, wgmma .m64nNk16 with A in registers, 16-bit types; per warp the m16n8k16 A fragment): in a
warp group, lane 4g + q of warp w holds, for each 16-wide K chunk c of the step, rows r0 = 16w + g and r1 = r0 + 8 at
columns 16c + 2q + {0, 1} (registers a0 a1 of r0, a2 a3 of r1) and 16c + 2q + 8 + {0, 1} (a4 a5, a6 a7).
The decode: that lane takes words 2q and 2q + 1 (bytes 8q .. 8q + 7: packed elements 16q .. 16q + 15) of both rows'
32-byte step; `nf4.device.table_pairs` turns word v into 4 pairs, pair j holding packed elements 8v + 2j (low half)
and 8v + 2j + 1 (high half). Pair P = 4 (v - 2q) + j of the lane goes to chunk c = P // 2 at half h = P % 2
(columns 16c + 2q + 8h + {0, 1}). So fragment column f holds packed element PERM[f], and x's column f of the step
must be x's column PERM[f]. A Gluon kernel (explicit layouts) is the next step; this model is what it is checked
against off the GPU.
"""

from __future__ import annotations

import numpy as np

STEP = 64  # weights of a row per step: one absmax block


def fragment_column(c: int, q: int, h: int, e: int) -> int:
    """The step's column of element e (0, 1) of half h (0: a0 a1 / a2 a3, 1: a4 a5 / a6 a7) of chunk c, lane q."""
    return 16 * c + 2 * q + 8 * h + e


def packed_element(q: int, v: int, j: int, e: int) -> int:
    """The step's packed element of pair j (0-3) of the lane's word v (0, 1: words 2q, 2q + 1), half e."""
    return 16 * q + 8 * v + 2 * j + e


def perm() -> np.ndarray:
    """PERM[f]: the packed element of the step that fragment column f holds (a permutation of 0..63)."""
    out = np.full(STEP, -1, dtype=np.int64)
    for q in range(4):
        for v in range(2):
            for j in range(4):
                p = 4 * v + j
                for e in range(2):
                    out[fragment_column(p // 2, q, p % 2, e)] = packed_element(q, v, j, e)
    return out


def lane_bytes(q: int) -> range:
    """The bytes of a row's 32-byte step that lane q decodes: 8 contiguous bytes."""
    return range(8 * q, 8 * q + 8)


def fragment_order(a: np.ndarray) -> np.ndarray:
    """a [rows, K] (K a multiple of STEP) with each step's columns in fragment order: column f of a step is the step's
    column PERM[f]. For the decoded weight it is where the fragments hold each weight; for x, what must multiply them.
    """
    k = a.shape[1]
    return a[:, (np.arange(k) // STEP) * STEP + np.tile(perm(), k // STEP)]
