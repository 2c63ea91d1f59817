"""The per-epoch order: a keyed bijection of [0, N) for any N, O(1) per index, seed- and epoch-dependent."""

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from titan_audit.data.permutation import FeistelPermutation


@given(st.integers(1, 3000), st.integers(0, 2**64 - 1), st.integers(0, 1000))
def test_bijection_for_any_n(n, seed, epoch):
    perm = FeistelPermutation.for_epoch(n, seed, epoch)
    image = perm(np.arange(n))
    assert image.min() >= 0 and image.max() < n
    assert np.array_equal(np.sort(image), np.arange(n))  # onto and one-to-one
    assert np.array_equal(perm.inverse(image), np.arange(n))


@given(st.integers(1, 2**62), st.integers(0, 2**32), st.lists(st.integers(0, 2**62), min_size=1, max_size=20))
def test_huge_domains_stay_in_range_and_invert(n, seed, raw):
    perm = FeistelPermutation.for_epoch(n, seed, 0)
    x = np.array([r % n for r in raw])
    y = perm(x)
    assert ((0 <= y) & (y < n)).all()
    assert np.array_equal(perm.inverse(y), x)


@pytest.mark.control
def test_same_key_same_order_and_controls():
    n = 10_000
    a = FeistelPermutation.for_epoch(n, 3, 5)(np.arange(n))
    assert np.array_equal(a, FeistelPermutation.for_epoch(n, 3, 5)(np.arange(n)))
    # negative controls: another epoch or seed gives another order, and the order is not the identity
    assert not np.array_equal(a, FeistelPermutation.for_epoch(n, 3, 6)(np.arange(n)))
    assert not np.array_equal(a, FeistelPermutation.for_epoch(n, 4, 5)(np.arange(n)))
    assert (a != np.arange(n)).mean() > 0.99


def test_order_looks_shuffled():
    n = 1 << 16
    y = FeistelPermutation.for_epoch(n, 0, 0)(np.arange(n)).astype(np.float64)
    corr = np.corrcoef(np.arange(n), y)[0, 1]
    assert abs(corr) < 0.02  # no visible trend between position and sequence index
    steps = np.abs(np.diff(y))
    assert steps.mean() > n / 4  # neighbours land far apart (uniform pairs: n / 3)


def test_cost_does_not_depend_on_the_index():
    perm = FeistelPermutation.for_epoch(10**12, 0, 0)
    for start in (0, 10**11):  # warm, then time both
        perm(np.arange(start, start + 4096))
    t0 = time.perf_counter()
    for _ in range(20):
        perm(np.arange(0, 4096))
    early = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        perm(np.arange(10**12 - 4096, 10**12))
    late = time.perf_counter() - t0
    assert late < 3 * early + 0.05
