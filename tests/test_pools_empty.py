"""Empty count tables: no arrays and no lock of their own until they are used."""

import threading

import numpy as np
import pytest

from lpcal.pools import _EMPTY_ARRAYS, CountTable, PoolLayout, PoolSet


def test_empty_tables_share_read_only_arrays_and_get_their_own_when_filled():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(5), 40)
    y = rng.integers(0, 5, 40)
    a, b = CountTable(5, 10), CountTable(5, 10)
    assert a._h is b._h is _EMPTY_ARRAYS[0] and a._pc is _EMPTY_ARRAYS[6]
    assert all(not x.flags.writeable for x in _EMPTY_ARRAYS)
    with pytest.raises(ValueError):
        a._ptr[0] = 1
    a.add(f, y)
    a.compact()
    assert a._h is not _EMPTY_ARRAYS[0] and a.total == 40 and b.total == 0
    assert a == CountTable.from_samples(f, y, 10, 5)
    assert b == CountTable(5, 10) and b.empty
    assert (a + b) == a and (b + a) == a and b.merge(CountTable(5, 10)).empty
    assert CountTable.from_dict(b.to_dict(packed=True)) == b
    assert [int(x.size) for x in _EMPTY_ARRAYS] == [0, 1, 0, 0, 0, 0, 0]


def test_a_tables_lock_is_made_once_even_when_threads_race_for_it():
    for _ in range(20):
        t = CountTable(3, 10)
        assert t._lk is None
        got, go = [], threading.Barrier(4)

        def take(t=t, got=got, go=go):
            go.wait()
            got.append(t._lock)

        threads = [threading.Thread(target=take) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len({id(x) for x in got}) == 1 and got[0] is t._lock


def test_an_empty_pool_set_holds_tables_without_arrays():
    lay = PoolLayout(4, 10, 2, "shared", {"mu": 5, "PE0": 5, "PE1": 5}, holdout=3)
    ps = PoolSet(lay, temperature=1.5)
    assert all(t._h is _EMPTY_ARRAYS[0] and t._lk is None for t in ps.tables.values())
    rng = np.random.default_rng(1)
    ps.add(rng.integers(0, 3, 30), rng.dirichlet(np.ones(4), 30), rng.integers(0, 4, 30))
    ps.compact()
    assert sum(t.total for t in ps.tables.values()) == 30
    assert PoolSet.from_dict(ps.to_dict(packed=True)) == ps
