"""v10-v16: eviction and cache modifiers on each memory stream of the production layout, one at a time.

Teaches which hint matters for a streaming kernel: the packed bytes are read once, the tables
(code2, absmax2, the NF4 levels) are reused by every program, the output is written once. The
family runs its own copy of the production kernel's word layout (nf4/dequant/kernel.py when this was
written: consecutive threads take consecutive 4-byte words) with the hint of each stream as a
constexpr string, at production's tile size and warps (nf4.DequantConfig); v10 uses production's hints,
each other member sets one stream to one value.
`--sm75` shows which hints survive into the PTX for a T4 (sm_75 has no L2::cache_hint).
"""

from __future__ import annotations

import triton
import triton.language as tl

from experiments import common
from experiments.common import store_word8, tail_bytes
from experiments.registry import register
from nf4.device import mul

# The baseline is production's current setting of every stream (nf4.DequantConfig), its tile and warps;
# each member sets one stream to one value (a member may coincide with the baseline).
PRODUCTION = {"packed_evict": common.PRODUCTION.evict_stream, "packed_cache": "", "table_evict": "evict_last",
              "store_cache": common.PRODUCTION.store_cm, "store_evict": ""}
# id, parent, the settings changed versus production, the one-line change.
FAMILY = [
    ("v10_cache_production", "v51_cached_launch", {},
     "own copy of the production kernel, each stream's hint a constexpr (production's: packed "
     f"{PRODUCTION['packed_evict'] or 'none'}, tables evict_last, stores {PRODUCTION['store_cache'] or 'none'})"),
    ("v11_packed_no_hint", "v10_cache_production", {"packed_evict": ""}, "packed bytes: no eviction hint"),
    ("v12_packed_evict_last", "v10_cache_production", {"packed_evict": "evict_last"}, "packed bytes: evict_last"),
    ("v13_packed_cg", "v10_cache_production", {"packed_evict": "", "packed_cache": ".cg"},
     "packed bytes: cache_modifier .cg (L2 only), no eviction hint"),
    ("v14_tables_no_hint", "v10_cache_production", {"table_evict": ""}, "code2/absmax2/NF4 tables: no evict_last"),
    ("v15_store_cs", "v10_cache_production", {"store_cache": ".cs", "store_evict": ""},
     "output stores: cache_modifier .cs (streaming), no eviction hint"),
    ("v16_store_evict_first", "v10_cache_production", {"store_cache": "", "store_evict": "evict_first"},
     "output stores: evict_first, no cache modifier"),
    ("v17_store_plain", "v10_cache_production", {"store_cache": "", "store_evict": ""},
     "output stores: no cache modifier, no eviction hint"),
]


@triton.jit(do_not_specialize=["n_words"])
def _cache_kernel(
    # pointers
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    # sizes
    n, n_bytes, n_words,
    # meta-parameters
    BLOCKSIZE: tl.constexpr, TILE_BYTES: tl.constexpr, VEC: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr,
    BF16_BITS: tl.constexpr,
    # the hints under study
    PACKED_EVICT: tl.constexpr, PACKED_CACHE: tl.constexpr, TABLE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
    STORE_EVICT: tl.constexpr,
):
    W: tl.constexpr = TILE_BYTES // 4  # words per program
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    if VEC:
        if pid * W < n_words:
            w = pid * W + tl.arange(0, W)
            ok = w < n_words
            word = tl.load(packed_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + w, mask=ok, other=0,
                           cache_modifier=PACKED_CACHE, eviction_policy=PACKED_EVICT)
            blk = w // (BLOCKSIZE // 8)
            q = tl.load(absmax_ptr + blk, mask=ok, other=0)
            level = tl.load(code2_ptr + q.to(tl.int32), mask=ok, other=0.0, eviction_policy=TABLE_EVICT)
            scale2 = tl.load(absmax2_ptr + blk // 256, mask=ok, other=0.0, eviction_policy=TABLE_EVICT)
            absmax = mul(level, scale2, FTZ, ASM) + tl.load(offset_ptr)
            store_word8(out_ptr, w[:, None] * 8, word, absmax, code_ptr, ok[:, None], FTZ, ASM, BF16_BITS,
                        TABLE_EVICT, STORE_CACHE, STORE_EVICT)
        else:  # the program past the whole words: the last 1-3 bytes
            tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                       n_words * 4 + tl.arange(0, 4), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)
    else:
        tail_bytes(packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
                   pid * TILE_BYTES + tl.arange(0, TILE_BYTES), n, n_bytes, BLOCKSIZE, FTZ, ASM, BF16_BITS)


def _launcher(hints):
    def run(packed, quant_state, out, *, ftz):
        s = common.state_of(packed, quant_state)
        asm, bf16_bits = common.flags(packed, ftz)
        vec, n_words, grid = common.unit_plan(packed, s.n, common.PRODUCTION.tile_bytes, 4)
        common.launch(_cache_kernel, grid, packed, s.absmax_u8, s.absmax2, s.code2, s.offset, s.code, out, s.n,
                      (s.n + 1) // 2, n_words, s.blocksize, common.PRODUCTION.tile_bytes, vec, ftz, asm, bf16_bits,
                      hints["packed_evict"], hints["packed_cache"], hints["table_evict"], hints["store_cache"],
                      hints["store_evict"], num_warps=common.PRODUCTION.num_warps)
        return out

    return run


for _id, _parent, _changed, _change in FAMILY:
    register(_id, parent=_parent, change=_change, kernel=_cache_kernel, module=__name__)(
        _launcher({**PRODUCTION, **_changed}))
