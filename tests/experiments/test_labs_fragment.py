"""experiments.labs.fragment: the x permutation that lets each thread decode 8 contiguous packed bytes straight into
wgmma's register fragment. Checked by hand against the PTX fragment layout and the table_pairs pair order, and on
seeded random data: the permuted product is the product. NumPy only."""

from __future__ import annotations

import numpy as np

from experiments.labs import fragment as fr


def test_perm_is_a_permutation_and_each_lane_reads_its_own_eight_bytes():
    p = fr.perm()
    assert sorted(p.tolist()) == list(range(fr.STEP))
    for q in range(4):  # the 16 columns lane q holds per row come from its 8 bytes (2 nibbles a byte)
        cols = [fr.fragment_column(c, q, h, e) for c in range(4) for h in range(2) for e in range(2)]
        assert {int(p[f]) // 2 for f in cols} == set(fr.lane_bytes(q))


def test_perm_by_hand():
    p = fr.perm()
    # lane 0: pair 0 of word 0 (elements 0, 1) -> chunk 0, columns 0-1; pair 1 (2, 3) -> chunk 0, half 1: columns 8-9
    assert p[[0, 1, 8, 9]].tolist() == [0, 1, 2, 3]
    # lane 0, word 1 (elements 8-15): pairs 4-7 -> chunks 2 and 3
    assert p[[32, 33, 40, 41, 48, 49, 56, 57]].tolist() == list(range(8, 16))
    # lane 3, word 1, pair 3: elements 62, 63 -> chunk 3, half 1, columns 16*3 + 6 + 8 + {0, 1}
    assert p[[62, 63]].tolist() == [62, 63] and p[[6, 7]].tolist() == [48, 49]


def test_the_permuted_product_is_the_product():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 3 * fr.STEP))
    x = rng.standard_normal((5, 3 * fr.STEP))
    assert np.allclose(fr.fragment_order(x) @ fr.fragment_order(w).T, x @ w.T, rtol=1e-12, atol=1e-12)
    # exact on integer-valued data (every partial sum representable)
    wi, xi = rng.integers(-8, 8, w.shape).astype(np.float64), rng.integers(-8, 8, x.shape).astype(np.float64)
    assert np.array_equal(fr.fragment_order(xi) @ fr.fragment_order(wi).T, xi @ wi.T)
    # the same columns move on both sides: permuting only one breaks it
    assert not np.allclose(x @ fr.fragment_order(w).T, x @ w.T)
