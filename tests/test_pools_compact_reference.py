"""The pools' add, compaction and merge against the implementations they replaced (kept here
verbatim as ``_reference_add``, ``_reference_compact_tables`` and
``_reference_merge_compacted_tables``): the same buffered rows, arrays, values and dtypes, in
every table, for fresh tables, tables with a compacted part, lazy tables and tables without
buffered rows."""

import contextlib

import numpy as np
import pytest

from lpcal.binmap import scale_temperature
from lpcal.levels import HashCollision, bin_counts_hashed, group_rows
from lpcal.online import OnlineConfig
from lpcal.pools import (
    CountTable,
    PoolSet,
    _checked_rows,
    _csr_from_dense,
    _csr_take,
    _merge_compacted_tables,
    compact_tables,
    tables_from_rows,
)
from tests.test_warmup import tempered

ARRAYS = ("_h", "_ptr", "_idx", "_val", "_pb", "_pl", "_pc")


def _reference_compact_tables(tables: list[CountTable]) -> None:
    """:meth:`CountTable.compact` of every table, with the buffered rows of all of them
    grouped in one pass: one grouping of the bins by row hash, one sparse encoding of the
    bins, one count of the (table, bin, label) triples, then each table's share merged into
    its compacted part as :meth:`CountTable._compact` merges its own. The tables end with the
    very arrays their own compaction gives (values and dtypes; tested). A hash shared by two
    distinct bins raises :class:`HashCollision` even when the two are in different tables."""
    busy = [t for t in tables if t._pending]
    if len(busy) < 2 or len({(t.k, t.lam) for t in busy}) != 1:
        for t in tables:
            t.compact()
        return
    with contextlib.ExitStack() as stack:
        for t in busy:
            stack.enter_context(t._lock)
        k, lam = busy[0].k, busy[0].lam
        parts = [p for t in busy for p in t._pending]
        sizes = [t._npend for t in busy]
        c = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        h = np.concatenate([p[2] for p in parts])
        for t in busy:
            t._pending, t._npend, t._pbytes = [], 0, 0
        tid = np.repeat(np.arange(len(busy), dtype=np.int64), sizes)
        uh, first, inv = group_rows(c, h)
        nb = uh.size
        # one sort: the (table, bin, label) triples, sorted; their (table, bin) pairs are
        # then sorted too, and numbered in order (what a unique of the pairs would give)
        up, pc = np.unique((tid * nb + inv) * k + y, return_counts=True)
        tb = up // k
        new = np.empty(tb.size, dtype=bool)
        new[:1] = True
        np.not_equal(tb[1:], tb[:-1], out=new[1:])
        ukey = tb[new]                                                # (table, bin), sorted
        pbin = np.cumsum(new) - 1                                     # its number
        gbin = ukey % nb
        start = np.searchsorted(ukey // nb, np.arange(len(busy) + 1))  # each table's bins
        ptr, idx, val = _csr_from_dense(c[first[gbin]])
        plab = up % k
        pstart = np.searchsorted(pbin, start)
        for i, t in enumerate(busy):
            a, b = start[i], start[i + 1]
            pa, pb = pstart[i], pstart[i + 1]
            other = CountTable._raw(k, lam, uh[gbin[a:b]], ptr[a:b + 1] - ptr[a],
                                    idx[ptr[a]:ptr[b]], val[ptr[a]:ptr[b]], pbin[pa:pb] - a,
                                    plab[pa:pb], pc[pa:pb])
            t._assign(t._merge_compacted(other))
        for t in tables:
            t.compact()  # the tables without buffered rows (and lazy bins) as before



def _fed(k, n, seed, *, compact_at=(), lazy=False):
    """Two identical pool sets fed in batches of random sizes (both compacted at the rows in
    ``compact_at`` by a table's own compaction, so buffered rows meet a compacted part;
    ``lazy``: some tables start from :func:`tables_from_rows`, whose bins are lazy)."""
    rng = np.random.default_rng(seed)
    x, y = tempered(n, k=k, seed=seed)
    g = scale_temperature(x, 1.7)
    lay = OnlineConfig().layout(k)
    route = rng.integers(0, len(lay.names), n)
    out = []
    for _ in range(2):
        ps = PoolSet(lay, temperature=1.7)
        if lazy:
            m = n // 4
            first = tables_from_rows(g[:m], y[:m], route[:m], len(lay.names), k, lay.lam)
            for name, t in zip(lay.names[::2], first[::2]):
                ps.tables[name] = t
        out.append(ps)
    a = n // 4 if lazy else 0
    while a < n:
        b = min(n, a + int(rng.integers(1, 300)))
        for ps in out:
            ps.add(route[a:b], g[a:b], y[a:b])
            if any(a < m <= b for m in compact_at):
                for name in lay.names[1::2]:
                    ps.tables[name].compact()
        a = b
    return out


def _same(got: PoolSet, want: PoolSet) -> None:
    for name, t in got.tables.items():
        ref = want.tables[name]
        assert not t._pending and t._npend == 0 and t._pbytes == 0 and t._lazy is None
        for attr in ARRAYS:
            a, b = getattr(t, attr), getattr(ref, attr)
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, attr)
        assert t.nbytes == ref.nbytes
        assert t.to_dict(packed=True) == ref.to_dict(packed=True)
        assert t.to_dict() == ref.to_dict()
    assert got == want


@pytest.mark.parametrize("k,n,compact_at,lazy", [
    (10, 700, (), False), (10, 5000, (1500, 3100), False), (100, 1200, (400,), False),
    (3, 3000, (), False), (10, 4000, (2000,), True), (2, 500, (), True)])
def test_one_pass_compaction_matches_the_reference(k, n, compact_at, lazy):
    new, old = _fed(k, n, seed=k * 7 + n, compact_at=compact_at, lazy=lazy)
    assert sum(bool(t._pending) for t in new.tables.values()) >= 2
    compact_tables(list(new.tables.values()))
    _reference_compact_tables(list(old.tables.values()))
    _same(new, old)
    # a later round: buffered rows meet the parts these compactions made
    x, y = tempered(900, k=k, seed=n)
    route = np.random.default_rng(n).integers(0, len(new.layout.names), 900)
    for ps in (new, old):
        ps.add(route, scale_temperature(x, 1.7), y)
    compact_tables(list(new.tables.values()))
    _reference_compact_tables(list(old.tables.values()))
    _same(new, old)


def test_one_pass_compaction_detects_a_hash_shared_by_two_bins():
    lay = OnlineConfig().layout(3)
    ps = PoolSet(lay, temperature=1.0)
    c = np.array([[10, 0, 0], [0, 10, 0], [0, 0, 10], [10, 0, 0]], dtype=np.int32)
    h = np.array([5, 6, 7, 5], dtype=np.int64)
    h_bad = h.copy()
    h_bad[2] = 6  # a distinct bin with the hash of another, in another table
    ps.add(np.array([0, 1, 2, 3]), None, np.array([0, 1, 2, 0]), counts=c, hashes=h_bad)
    with pytest.raises(HashCollision):
        compact_tables(list(ps.tables.values()))
    ok = PoolSet(lay, temperature=1.0)
    ok.add(np.array([0, 1, 2, 3]), None, np.array([0, 1, 2, 0]), counts=c, hashes=h)
    compact_tables(list(ok.tables.values()))
    assert ok.tables["mu"].total == 1 and ok.tables["PE0"].total == 1


def _reference_add(ps: PoolSet, pool_idx, probs, labels) -> None:
    """The former :meth:`PoolSet.add`: every batch split by pool at once (stable sort, one
    contiguous slice per pool) into the tables' buffers."""
    pool_idx = np.asarray(pool_idx)
    counts, hashes = bin_counts_hashed(probs, ps.layout.lam)
    c, y = _checked_rows(counts, labels, ps.layout.k)
    order = np.argsort(pool_idx, kind="stable")
    p = pool_idx[order]
    c, y, h = c[order], y[order], np.asarray(hashes, dtype=np.int64)[order]
    cuts = (np.flatnonzero(p[1:] != p[:-1]) + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, p.size]):
        ps.tables[ps.layout.names[int(p[a])]]._append(c[a:b], y[a:b], h[a:b])


def _buffers(t: CountTable) -> tuple:
    if not t._pending:
        return (t._npend, t._pbytes)
    return (t._npend, t._pbytes, *(np.concatenate([p[i] for p in t._pending]).tobytes()
                                    for i in range(3)))


@pytest.mark.parametrize("k,n,largest", [(10, 6000, 400), (100, 14000, 900), (3, 3000, 50)])
def test_rows_kept_by_add_reach_the_tables_as_the_former_split_did(k, n, largest):
    """Rows kept by :meth:`PoolSet.add` reach each table as the former add put them there:
    the same buffered rows, in order, the same compactions (at k = 100 tables compact on
    their buffered bytes while rows are added), the same byte counts; and a pool set
    compacted from its kept rows has the arrays of the former path."""
    rng = np.random.default_rng(k + n)
    x, y = tempered(n, k=k, seed=k)
    g = scale_temperature(x, 1.3)
    lay = OnlineConfig().layout(k)
    route = rng.integers(0, len(lay.names), n)
    new, old = PoolSet(lay, temperature=1.3), PoolSet(lay, temperature=1.3)
    a, batches, looks, compactions = 0, 0, 0, 0
    while a < n:
        b = min(n, a + int(rng.integers(1, largest)))
        new.add(route[a:b], g[a:b], y[a:b])
        _reference_add(old, route[a:b], g[a:b], y[a:b])
        assert new.nbytes == old.nbytes
        batches += 1
        if batches % 3 == 0:  # a read hands the kept rows over
            looks += 1
            for name, t in new.tables.items():
                ref = old.tables[name]
                assert _buffers(t) == _buffers(ref), name
                compactions += bool(ref._h.size)
                for attr in ARRAYS:
                    assert np.array_equal(getattr(t, attr), getattr(ref, attr)), (name, attr)
        a = b
    assert looks > 3 and (compactions > 0 or k != 100)
    assert new.fill() == old.fill() and new.total == old.total
    new.add(route[:300], g[:300], y[:300])
    _reference_add(old, route[:300], g[:300], y[:300])
    new.compact()  # from the kept rows, without a split by pool
    _reference_compact_tables(list(old.tables.values()))
    _same(new, old)


def test_rows_given_as_counts_are_copied():
    lay = OnlineConfig().layout(10)
    x, y = tempered(200, k=10, seed=3)
    c, h = bin_counts_hashed(x, lay.lam)
    ps, ref = PoolSet(lay, temperature=1.0), PoolSet(lay, temperature=1.0)
    route = np.arange(200) % len(lay.names)
    ps.add(route, None, y, counts=c, hashes=h)
    ref.add(route, None, y, counts=c.copy(), hashes=h.copy())
    c[:] = 0
    h[:] = 0
    route[:] = 0
    assert ps == ref and ps.tables["mu"].total == ref.tables["mu"].total > 0


def _reference_merge_compacted_tables(tables: list[CountTable]) -> CountTable:
    """The pool of the union of compacted, materialised, non-empty ``tables`` (``(k, lambda)``
    checked by the caller): one ``np.unique`` over their bins (sorted, each row taken from the
    first table holding the bin; :class:`HashCollision` if another holder's sparse row differs)
    and one over their (bin, label) pairs. The arrays do not depend on how the tables are
    grouped: adding them pairwise in any order gives the same, to the dtype."""
    k, lam = tables[0].k, tables[0].lam
    sizes = [t._h.size for t in tables]
    h_all = np.concatenate([t._h for t in tables])
    uh, first_pos, inv = np.unique(h_all, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    # the tables' CSR offsets shifted past the entries of the tables before them (the
    # cumulative sum of all row lengths, without a difference per table)
    nnz = [int(t._ptr[-1] - t._ptr[0]) for t in tables]
    ptr_all = np.zeros(h_all.size + 1, dtype=np.int64)
    ptr_all[1:] = np.concatenate([t._ptr[1:] - t._ptr[0] for t in tables])
    ptr_all[1:] += np.repeat(np.cumsum([0] + nnz[:-1], dtype=np.int64), sizes)
    idx_all = np.concatenate([t._idx for t in tables])
    val_all = np.concatenate([t._val for t in tables])
    rep = first_pos[inv]  # each bin's first holder
    dup = np.flatnonzero(rep != np.arange(h_all.size))
    if dup.size:
        pa = _csr_take(ptr_all, idx_all, val_all, dup)
        pb = _csr_take(ptr_all, idx_all, val_all, rep[dup])
        if not all(np.array_equal(x, y) for x, y in zip(pa, pb)):
            raise HashCollision("two distinct bins share a 64-bit hash")
    ptr, idx, val = _csr_take(ptr_all, idx_all, val_all, first_pos)
    npairs = [t._pb.size for t in tables]
    offs = np.repeat(np.cumsum([0] + sizes[:-1], dtype=np.int64), npairs)
    pair = (inv[np.concatenate([t._pb for t in tables]) + offs] * k
            + np.concatenate([t._pl for t in tables]))
    cnt = np.concatenate([t._pc for t in tables])
    up, where = np.unique(pair, return_inverse=True)
    pc = np.bincount(where.reshape(-1), weights=cnt, minlength=up.size).astype(np.int64)
    return CountTable._raw(k, lam, uh, ptr, idx.astype(np.int32, copy=False),
                           val.astype(np.int32, copy=False), up // k, up % k, pc)


@pytest.mark.parametrize("k,n_parts", [(10, 2), (10, 19), (100, 6), (3, 12)])
def test_merge_matches_the_reference(k, n_parts):
    rng = np.random.default_rng(k * n_parts)
    lay = OnlineConfig().layout(k)
    x, y = tempered(500 * n_parts, k=k, seed=n_parts)
    g = scale_temperature(x, 1.3)
    parts = []
    for _ in range(n_parts):  # overlapping samples: bins repeat across the parts
        m = int(rng.integers(1, 500))
        rows = rng.integers(0, x.shape[0], m)
        t = CountTable(k, lay.lam)
        t.add(g[rows], y[rows])
        t.compact()
        parts.append(t)
    got = _merge_compacted_tables(parts)
    want = _reference_merge_compacted_tables(parts)
    for attr in ARRAYS:
        a, b = getattr(got, attr), getattr(want, attr)
        assert a.dtype == b.dtype and np.array_equal(a, b), attr
    assert CountTable.merge_many(parts) == want


def test_merge_detects_a_hash_shared_by_two_bins():
    a = CountTable(3, 10)
    a.add(None, [0], counts=np.array([[10, 0, 0]]), hashes=np.array([5]))
    b = CountTable(3, 10)
    b.add(None, [1], counts=np.array([[0, 10, 0]]), hashes=np.array([5]))
    a.compact(), b.compact()
    with pytest.raises(HashCollision):
        _merge_compacted_tables([a, b])


def test_compacting_a_compacted_or_lazy_set():
    """A compacted set's compaction keeps its arrays (the very objects); lazy bins are still
    materialised."""
    new, old = _fed(10, 3000, seed=5, lazy=True)
    new.compact()
    _reference_compact_tables(list(old.tables.values()))
    _same(new, old)
    before = {n: [getattr(t, a) for a in ARRAYS] for n, t in new.tables.items()}
    new.compact()
    assert all(all(x is y for x, y in zip(before[n], (getattr(t, a) for a in ARRAYS)))
               for n, t in new.tables.items())
    lay = new.layout
    x, y = tempered(400, k=10, seed=9)
    lazy = PoolSet(lay, dict(zip(lay.names, tables_from_rows(
        x, y, np.arange(400) % len(lay.names), len(lay.names), 10, lay.lam))))
    assert all(t._lazy is not None for t in lazy.tables.values())
    lazy.compact()
    assert all(t._lazy is None and t._idx.size for t in lazy.tables.values())
