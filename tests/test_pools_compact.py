"""Compacting a pool set's tables together gives each table the arrays of its own compaction."""

import numpy as np
import pytest

from lpcal.binmap import scale_temperature
from lpcal.online import OnlineConfig
from lpcal.pools import CountTable, PoolSet, compact_tables
from tests.test_warmup import tempered

ARRAYS = ("_h", "_ptr", "_idx", "_val", "_pb", "_pl", "_pc")


def _filled(k, n, seed, compact_at=None):
    """A pool set fed in batches of random sizes (compacted once at ``compact_at`` rows, so
    that buffered rows meet a compacted part), and a copy of every table fed alike."""
    rng = np.random.default_rng(seed)
    x, y = tempered(n, k=k, seed=seed)
    g = scale_temperature(x, 1.7)
    lay = OnlineConfig().layout(k)
    route = rng.integers(0, len(lay.names), n)
    ps, alone = PoolSet(lay, temperature=1.7), PoolSet(lay, temperature=1.7)
    a = 0
    while a < n:
        b = min(n, a + int(rng.integers(1, 200)))
        ps.add(route[a:b], g[a:b], y[a:b])
        alone.add(route[a:b], g[a:b], y[a:b])
        if compact_at is not None and a < compact_at <= b:
            ps.tables["PE0"].compact()
            alone.tables["PE0"].compact()
        a = b
    return ps, alone


@pytest.mark.parametrize("k,n,compact_at", [(10, 700, None), (10, 3000, 1200), (100, 900, 300),
                                             (3, 2000, None)])
def test_joint_compaction_gives_each_table_its_own_arrays(k, n, compact_at):
    ps, alone = _filled(k, n, seed=k + n, compact_at=compact_at)
    assert sum(bool(t._pending) for t in ps.tables.values()) >= 2
    ps.compact()                                  # jointly
    for t in alone.tables.values():               # one table at a time
        t.compact()
    for name, t in ps.tables.items():
        ref = alone.tables[name]
        assert not t._pending and t._npend == 0 and t._pbytes == 0
        for attr in ARRAYS:
            got, want = getattr(t, attr), getattr(ref, attr)
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, attr)
        assert t.to_dict(packed=True) == ref.to_dict(packed=True)
        assert t.nbytes == ref.nbytes
    assert ps == alone


def test_joint_compaction_of_one_busy_table_or_none():
    ps, alone = _filled(10, 50, seed=1)
    for t in list(ps.tables.values())[1:]:
        t.compact()
    compact_tables(list(ps.tables.values()))
    compact_tables([CountTable(10, 10), CountTable(10, 10)])
    assert ps == alone
