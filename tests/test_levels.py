"""Level sets, R, rho, keys and the bin index: exhaustive for small (lambda, k), hypothesis beyond."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lpcal.errors import InputError
from lpcal.levels import (
    BinIndex,
    HashCollision,
    beta_for,
    bin_counts,
    bin_rows,
    decode_key,
    encode_key,
    encode_keys,
    group_hashed,
    is_level_set,
    lambda_for,
    level_set_bound,
    level_set_count,
    pairs_agree,
    rho,
    round_down,
)


def _all_vectors(lam, k):
    return np.array(list(itertools.product(range(lam + 1), repeat=k)), dtype=np.int32)


@pytest.mark.parametrize("lam,k", [(1, 2), (2, 2), (3, 3), (5, 2), (4, 4), (6, 3), (2, 5)])
def test_level_sets_exhaustive(lam, k):
    cand = _all_vectors(lam, k)
    member = is_level_set(cand, lam)
    # each claimed member has a witness u = rho(v) on the simplex with R(u) = v
    V = cand[member]
    u = rho(V, lam)
    assert np.all(u >= 0) and np.allclose(u.sum(axis=1), 1.0, atol=1e-12)
    assert np.array_equal(bin_counts(u, lam), V)
    # every R(u) of a dense grid of the simplex is a claimed member (no member is missed)
    grid = np.array([c for c in itertools.product(range(3 * lam + 1), repeat=k)
                     if sum(c) == 3 * lam], dtype=float) / (3 * lam)
    rng = np.random.default_rng(lam * 10 + k)
    pts = np.vstack([grid, rng.dirichlet(np.ones(k), size=4000)])
    seen = {tuple(r) for r in bin_counts(pts, lam)}
    claimed = {tuple(r) for r in V}
    assert seen <= claimed
    # exact count and the paper's bound
    assert member.sum() == level_set_count(lam, k) <= level_set_bound(lam, k)
    if k > lam:
        assert level_set_count(lam, k) == level_set_bound(lam, k)


@pytest.mark.parametrize("lam,k", [(3, 3), (4, 2), (5, 3)])
def test_non_members_have_no_preimage(lam, k):
    """A vector outside V: no point of the simplex rounds to it (checked on a fine grid)."""
    cand = _all_vectors(lam, k)
    outside = cand[~is_level_set(cand, lam)]
    m = 12 * lam
    grid = np.array([c for c in itertools.product(range(m + 1), repeat=k) if sum(c) == m],
                    dtype=float) / m
    hit = {tuple(r) for r in bin_counts(grid, lam)}
    assert not any(tuple(r) in hit for r in outside)


def test_rho_is_linf_closest():
    lam, k = 5, 3
    rng = np.random.default_rng(0)
    u = rng.dirichlet(np.ones(k) * 0.7, size=20000)
    c = bin_counts(u, lam)
    d_rho = np.abs(rho(c, lam) - c / lam).max(axis=1)
    d_u = np.abs(u - c / lam).max(axis=1)
    assert np.all(d_rho <= d_u + 1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.integers(2, 60), st.integers(0, 2**32 - 1))
def test_R_of_rho_is_identity(lam, k, seed):
    rng = np.random.default_rng(seed)
    u = rng.dirichlet(np.full(k, rng.uniform(0.05, 3.0)), size=50)
    c = bin_counts(u, lam)
    assert is_level_set(c, lam).all()
    assert np.array_equal(bin_counts(rho(c, lam), lam), c)


def test_floor_tolerance_one_ulp_below():
    """(c/lam)*lam lands one ulp below c for some (c, lam); R must still return c."""
    trapped = [(c, lam) for lam in range(1, 200) for c in range(lam + 1)
               if np.floor((c / lam) * lam) != c]
    assert trapped, "expected at least one (c, lambda) where the plain floor is off by one"
    for c, lam in trapped:
        u = np.array([[c / lam, 1 - c / lam]])
        assert bin_counts(u, lam)[0, 0] == c


def test_lambda_rounding():
    assert beta_for(0.1, 2) == 0.1**2 / 2
    assert 0.1**2 / 2 == 0.005000000000000001  # the trap
    assert lambda_for(beta_for(0.1, 2)) == 200
    assert lambda_for(0.1) == 10
    assert lambda_for(0.3) == 4
    assert lambda_for(1 / 7) == 7
    assert beta_for(0.05, math.inf) == 0.05
    assert math.isclose(beta_for(0.1, 3), 0.1**1.5 / 2**0.5)
    for bad in [(0.0, 2), (1.0, 2), (0.1, 1.0), (0.1, 0.5), (float("nan"), 2)]:
        with pytest.raises(InputError):
            beta_for(*bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=40))
def test_key_round_trip(row):
    r = np.array(row, dtype=np.int32)
    key = encode_key(r)
    assert np.array_equal(decode_key(key, r.size), r)
    assert encode_keys(r[None, :]) == [key]


def test_keys_are_sparse_for_large_k():
    k, lam = 10_000, 20
    u = np.zeros(k)
    u[[3, 777, 9999]] = [0.5, 0.25, 0.25]
    c = bin_counts(u[None, :], lam)
    key = encode_keys(c)[0]
    assert key == "3:10,777:5,9999:5"
    assert np.array_equal(decode_key(key, k, lam), c[0])


@pytest.mark.parametrize("key,msg", [("3", "index:count"), ("1:2,1:3", "increasing"),
                                     ("0:0", "positive"), ("9:1", "outside"), ("a:b", "index")])
def test_bad_keys(key, msg):
    with pytest.raises(InputError, match=msg):
        decode_key(key, 5)


def test_decode_checks_membership():
    with pytest.raises(InputError, match="not a level set"):
        decode_key("0:9", 3, lam=5)


def test_bin_index_against_dict_reference():
    rng = np.random.default_rng(3)
    lam, k = 8, 6
    u = rng.dirichlet(np.ones(k) * 0.4, size=5000)
    c = bin_counts(u, lam)
    uniq = np.unique(c, axis=0)
    chosen = uniq[rng.permutation(len(uniq))[: len(uniq) // 2]]
    idx = BinIndex(chosen).lookup(c)
    ref = {tuple(r): i for i, r in enumerate(chosen)}
    expect = np.array([ref.get(tuple(r), -1) for r in c])
    assert np.array_equal(idx, expect)
    assert round_down(u, lam).max() <= 1.0


def test_run_starts_marks_the_first_element_of_each_run():
    """``run_starts`` of grouped keys: True where a run of equal values begins; its nonzero
    positions are what ``np.unique(..., return_index=True)`` gives for sorted keys."""
    from lpcal.levels import run_starts

    assert run_starts(np.zeros(0, dtype=np.int64)).tolist() == []
    assert run_starts(np.array([7])).tolist() == [True]
    keys = np.array([3, 3, 5, 5, 5, 9, 12, 12], dtype=np.int64)
    assert run_starts(keys).tolist() == [True, False, True, False, False, True, True, False]
    rng = np.random.default_rng(0)
    sk = np.sort(rng.integers(0, 50, size=1000))
    _, first = np.unique(sk, return_index=True)
    assert np.array_equal(np.flatnonzero(run_starts(sk)), first)


def test_pairs_agree_finds_any_row_whose_exact_hashes_differ_from_its_group():
    """The collision check: every row's two exact hashes against its group's first row's,
    the answer of ``np.array_equal(pair[first][inv], pair)``; a grouping by the folded hash
    that puts two distinct bins together raises ``HashCollision``."""
    rng = np.random.default_rng(5)
    c = rng.integers(0, 3, size=(300, 6))
    _, h, pair = bin_rows(c / 10.0, 10)
    uh, first, inv = group_hashed(h, pair)
    assert uh.size < h.size and pairs_agree(pair, first, inv)
    shared = np.flatnonzero(np.bincount(inv)[inv] > 1)   # rows of groups of two or more
    later = shared[first[inv[shared]] != shared]          # not their group's first row
    for row in (int(later[0]), int(later[-1]), int(first[inv[later[0]]])):
        for col in (0, 1):
            bad = pair.copy()
            bad[row, col] += 1.0
            assert not pairs_agree(bad, first, inv)
            assert not np.array_equal(bad[first][inv], bad)
    ones = np.arange(5)  # every row its own group: nothing to compare
    assert pairs_agree(pair[:5], ones, ones)
    h2 = h.copy()  # two distinct bins forced under one folded hash
    j = int(np.flatnonzero(~np.all(pair == pair[0], axis=1))[0])
    h2[j] = h2[0]
    with pytest.raises(HashCollision):
        group_hashed(h2, pair)
