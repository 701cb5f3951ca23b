"""Merging many pool tables in one pass gives the arrays of pairwise merges, and a window's fit
pools are the same whether its buckets are merged at once or pairwise."""

import numpy as np
import pytest

from lpcal.binmap import scale_temperature
from lpcal.errors import InputError
from lpcal.levels import HashCollision
from lpcal.online import OnlineCalibrator, OnlineConfig, run_fit
from lpcal.pools import CountTable, PoolSet, tree_sum
from tests.test_warmup import tempered

ARRAYS = ("_h", "_ptr", "_idx", "_val", "_pb", "_pl", "_pc")


def _same_tables(a: CountTable, b: CountTable) -> None:
    a.compact(), b.compact()
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def _parts(k, n_parts, seed, empty=()):
    """Pool sets of one layout fed overlapping samples (the bins repeat across parts)."""
    rng = np.random.default_rng(seed)
    lay = OnlineConfig().layout(k)
    x, y = tempered(400 * n_parts, k=k, seed=seed)
    g = scale_temperature(x, 1.3)
    parts = []
    for i in range(n_parts):
        ps = PoolSet(lay, temperature=1.3)
        if i not in empty:
            m = int(rng.integers(1, 400))
            rows = rng.integers(0, x.shape[0], m)
            ps.add(rng.integers(0, len(lay.names), m), g[rows], y[rows])
        parts.append(ps)
    return parts


@pytest.mark.parametrize("k,n_parts,empty", [(10, 2, ()), (10, 7, (3,)), (100, 12, (0, 5)),
                                             (3, 33, ()), (10, 5, (0, 1, 2, 3))])
def test_merge_many_gives_the_arrays_of_pairwise_merges(k, n_parts, empty):
    parts = _parts(k, n_parts, seed=k * n_parts, empty=empty)
    pairwise = tree_sum(parts, PoolSet.merge)
    once = PoolSet.merge_many(parts)
    assert sum(t.total for t in once.tables.values()) == sum(
        t.total for ps in parts for t in ps.tables.values())
    for name in once.layout.names:
        _same_tables(once.tables[name], pairwise.tables[name])
        # the inputs are unchanged: a second merge gives the same again
        _same_tables(CountTable.merge_many([ps.tables[name] for ps in parts]),
                     pairwise.tables[name])
    assert once.holdout.to_dict() == pairwise.holdout.to_dict()
    assert once.grid is None or once.grid.to_dict() == pairwise.grid.to_dict()


def test_merge_many_of_one_or_only_empty_tables_is_a_copy():
    t = CountTable.from_samples(np.full((3, 4), 0.25), np.array([0, 1, 2]), 8)
    out = CountTable.merge_many([t, CountTable(4, 8)])
    assert out is not t and out.total == 3
    _same_tables(out, t)
    assert CountTable.merge_many([CountTable(4, 8), CountTable(4, 8)]).total == 0
    with pytest.raises(InputError, match="no tables"):
        CountTable.merge_many([])
    with pytest.raises(InputError, match="cannot merge pools"):
        CountTable.merge_many([t, CountTable(4, 9)])


def test_merge_many_detects_two_bins_sharing_a_hash():
    a = CountTable.from_samples(np.array([[1.0, 0.0, 0.0, 0.0]]), np.array([0]), 8)
    b = CountTable.from_samples(np.array([[0.0, 1.0, 0.0, 0.0]]), np.array([1]), 8)
    a.compact(), b.compact()
    forged = CountTable._raw(4, 8, a._h.copy(), b._ptr, b._idx, b._val, b._pb, b._pl, b._pc)
    with pytest.raises(HashCollision):
        a.merge(forged)
    with pytest.raises(HashCollision):
        CountTable.merge_many([a, b, forged])


@pytest.mark.parametrize("k", [10, 100])
def test_a_windows_fit_pools_are_the_pairwise_merge_of_its_buckets(k):
    x, y = tempered(9_000, k=k, seed=k)
    cal = OnlineCalibrator(k, OnlineConfig(), fit=run_fit)
    for a in range(0, x.shape[0], 1000):
        cal.update(x[a:a + 1000], y[a:a + 1000])
    snap = cal.window.snapshot()
    assert snap is not None and len(snap.parts) > 2
    built = snap.build()
    pairwise = tree_sum(snap.parts, PoolSet.merge)
    for name in built.layout.names:
        _same_tables(built.tables[name], pairwise.tables[name])
