"""l01-l05: the split-K GEMV (FMAs, no tensor cores) at every M, and one of its meta-parameters at a time.

Teaches what the small-M kernel's choices are worth: how each weight's level is found (l02: a
select tree of 15 comparisons, l03: one 8-byte gather of both levels of a byte from a 256-entry
pair table, against l01's two gathers from the 16-entry table) and how K is split across programs
(l04: one program per 32 rows walks the whole row; l05: 8 programs along K, float32 partials
summed in order by a second kernel; l01: enough programs for 16 per multiprocessor).

The GEMV keeps a [BLOCK_M, rows, bytes] float32 accumulator with BLOCK_M = next_power_of_2(M): from
M = 16 it spills (sm_75 offline: 1.9 KB of spill stores per thread), and at M = 256 one build took
373 s and 5 GB of host memory (offline, sm_90). So "the GEMV at every M" runs x in slices of at most
GEMV_ROWS = 4 rows (the word GEMV's limit), one launch (or split-K pair) per slice:
above that M each slice re-reads W, which is what the table's switch to tl.dot avoids.

Of the ablations asked for the linear, this family covers K traversal by split-K (l04 against l01
and l05: a whole row per program versus K split across programs). Persistent programs are not a
config of the current kernels (one program per block of rows, its grid sized by programs_per_sm).
"""

from __future__ import annotations

from experiments.registry import register
from nf4.linear import launch as linear_launch
from nf4.linear import tuned as linear_tuned
from nf4.linear.gemv import nf4_gemv_kernel

from ._common import launcher

GEMV = linear_tuned.GEMV
# The slice size of this family: the most rows of x the word GEMV takes (4), which the codebook-0 GEMV takes without
# spilling; the tuned table's first GEMV row took 4 rows too until its rows up to M = 8 went to one launch
# (nf4.linear.tuned.GEMV_MMA_WK), and the family's results were measured on slices of 4.
GEMV_ROWS = linear_launch.TABLE_MAX_M
# id, parent, the LinearConfig fields changed versus the table's GEMV, the one-line change.
FAMILY = [
    ("l01_gemv", "l00_production", {},
     f"the table's GEMV at every M (32 rows x 2 warps, 16-entry table gather, split-K for 16 programs per SM), "
     f"on slices of {GEMV_ROWS} rows of x"),
    ("l02_gemv_select_tree", "l01_gemv", {"codebook": 1}, "NF4 levels by a select tree (codebook 1), no gather"),
    ("l03_gemv_pair_table", "l01_gemv", {"codebook": 2},
     "both levels of a byte by one 8-byte gather from a 256-entry pair table (codebook 2)"),
    ("l04_gemv_no_split", "l01_gemv", {"split_k": 1}, "no split-K: one program per 32 rows walks the whole row"),
    ("l05_gemv_split8", "l01_gemv", {"split_k": 8},
     "split-K of 8 programs along K (float32 partials summed in order by a second kernel)"),
]

for _id, _parent, _changed, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=nf4_gemv_kernel, module=__name__)(
        launcher(GEMV.with_(**_changed), max_rows=GEMV_ROWS))
