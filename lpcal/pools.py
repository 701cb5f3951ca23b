"""Sample pools of Algorithm 2 as additive, mergeable count tables over (bin, label).

A labelled sample ``(x, y)`` enters Algorithm 2 only as ``(R(f(x)), y)``, so a pool is fully
described by the number of samples per (bin, label) pair. Count tables are small, additive
(``a.merge(b)`` is the pool of the union of samples), order-independent and cheap to checkpoint.

Pools of Algorithm 2 (``L = floor(log2(6/beta)) + 1`` levels; since the estimated masses sum to
one, ``|B| <= 6/beta`` always, so ``L`` is known before ``B`` is):

* ``mu``: estimates the bin masses ``mu_hat_v`` that select ``B = {v : mu_hat_v >= beta/6}``;
* ``P{i}`` and ``E{i}`` for ``i < L`` (variant ``split``, the paper's): estimate ``P_hat_S`` and
  ``E_hat_S`` of estimation groups ``S`` in ``M`` of size ``2^i``;
* ``PE{i}`` (variant ``shared``): both estimates of size ``2^i`` from one pool, so that
  ``sum_j E_hat_S,j = P_hat_S`` holds exactly.

Events are routed to pools deterministically by a hash of their id (``PoolLayout.route``), with
probabilities proportional to the pools' target sizes, so a replay of the same events fills
identical pools.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lpcal.errors import InputError
from lpcal.holdout import HoldoutSums
from lpcal.kernels import scale_temperature
from lpcal.levels import (
    MAX_LAMBDA,
    HashCollision,
    _combine,
    _weights,
    bin_counts,
    bin_counts_hashed,
    decode_keys,
    encode_keys,
    group_rows,
    pairs_agree,
    row_hash,
    run_starts,
    scan_rows,
)
from lpcal.precalibrate import TemperatureGrid
from lpcal.temperature import check_temperature

_COMPACT_EVERY = 1 << 16
#: Buffered (dense, ``4 k`` bytes per row) rows of a table are folded in once they take more
#: than ``max(COMPACT_MIN_BYTES, the compacted table's bytes)``: amortised O(1) compactions
#: per doubling, and buffered rows never cost more than the table itself plus this floor.
COMPACT_MIN_BYTES = 1 << 18


def _locked(method):
    """Run a CountTable method under the table's re-entrant lock."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _checked_rows(counts, labels, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin rows and labels of samples to add, checked, as int32 arrays; InputError if not
    ``(n, k)`` rows with ``n`` integer labels in ``[0, k)``."""
    labels = np.asarray(labels)
    c = np.atleast_2d(np.asarray(counts))
    if c.shape[1] != k:
        raise InputError(f"pool has k={k} classes, got rows of length {c.shape[1]}")
    if labels.shape != (c.shape[0],):
        raise InputError(f"labels must have shape ({c.shape[0]},), got {labels.shape}")
    if c.shape[0] == 0:
        return c, labels
    if labels.dtype.kind not in "iu":
        raise InputError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.min() < 0 or labels.max() >= k:
        bad = int(np.flatnonzero((labels < 0) | (labels >= k))[0])
        raise InputError(f"label {int(labels[bad])} at row {bad} outside [0, {k})")
    return c.astype(np.int32, copy=False), labels.astype(np.int32)


def _csr_from_dense(rows: np.ndarray):
    ii, jj = np.nonzero(rows)
    indptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(ii, minlength=rows.shape[0]), out=indptr[1:])
    return indptr, jj.astype(np.int32), rows[ii, jj].astype(np.int32)


def _csr_take(indptr, indices, values, pos):
    """Rows ``pos`` of a CSR matrix, as a new CSR (vectorised gather)."""
    starts, ends = indptr[pos], indptr[pos + 1]
    lens = ends - starts
    new_ptr = np.zeros(len(pos) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_ptr[1:])
    flat = np.repeat(starts - new_ptr[:-1], lens) + np.arange(new_ptr[-1])
    return new_ptr, indices[flat], values[flat]


def _csr_to_dense(indptr, indices, values, k):
    n = indptr.size - 1
    out = np.zeros((n, k), dtype=np.int32)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    out[rows, indices] = values
    return out


# ---------------------------------------------------------------------------- packed arrays
#: The largest ``k`` of a packed table or held-out sums (the row hash's weights are ``16 k``
#: bytes; the daemon's ``max_k`` is at most 100,000).
MAX_PACKED_K = 1 << 17
#: The dtypes a packed array may have: integers as the narrowest unsigned type that holds
#: them (or int64), floats as float64; little-endian.
PACKED_DTYPES = ("<u1", "<u2", "<u4", "<i8", "<f8")


def _narrow(a: np.ndarray) -> str:
    """The narrowest of :data:`PACKED_DTYPES` that holds the integers of ``a`` exactly."""
    if a.dtype.kind == "f":
        return "<f8"
    if not a.size:
        return "<u1"
    lo, hi = int(a.min()), int(a.max())
    if lo < 0:
        return "<i8"
    return "<u1" if hi < 1 << 8 else "<u2" if hi < 1 << 16 else "<u4" if hi < 1 << 32 else "<i8"


def pack_arrays(arrays: Iterable[np.ndarray]) -> dict:
    """``{"dtypes": [...], "data": base64}``: the arrays' raw little-endian bytes, each in the
    narrowest of :data:`PACKED_DTYPES` that holds it, one after the other in one base64 string
    (the checkpoint formats ``lpcal.model_state/5`` and /6: exact, no per-element Python work). The
    reader knows every array's length (:func:`unpack_arrays`)."""
    dts, raw = [], []
    for a in arrays:
        a = np.asarray(a)
        dt = _narrow(a)
        dts.append(dt)
        raw.append(np.ascontiguousarray(a, dtype=dt).tobytes())
    return {"dtypes": dts, "data": base64.b64encode(b"".join(raw)).decode("ascii")}


def unpack_arrays(d: Mapping, sizes: Iterable[int], where: str) -> list[np.ndarray]:
    """Inverse of :func:`pack_arrays` for arrays of ``sizes`` elements: native int64 (float64
    for ``<f8``) copies. The sizes are checked against the decoded length *before* anything is
    allocated from them, so a corrupt size costs nothing; :class:`InputError` names what is
    wrong."""
    sizes = list(sizes)
    try:
        dts, data = list(d["dtypes"]), d["data"]
    except (KeyError, TypeError) as e:
        raise InputError(f"{where}: malformed packed arrays ({type(e).__name__}: {e})") from None
    if type(data) is not str or len(dts) != len(sizes) or any(
            dt not in PACKED_DTYPES for dt in dts):
        raise InputError(f"{where}: packed arrays need {len(sizes)} dtypes of "
                         f"{PACKED_DTYPES} and a base64 string")
    for n in sizes:
        if type(n) is not int or n < 0:
            raise InputError(f"{where}: array length {n!r} is not an integer >= 0")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{where}: packed arrays are not base64 ({e})") from None
    want = sum(n * int(dt[-1]) for n, dt in zip(sizes, dts))
    if len(raw) != want:
        raise InputError(f"{where}: {len(raw)} bytes of packed arrays, expected {want}")
    out, at = [], 0
    for n, dt in zip(sizes, dts):
        a = np.frombuffer(raw, dtype=dt, count=n, offset=at)
        at += a.nbytes
        out.append(a.astype(np.float64 if dt == "<f8" else np.int64))
    return out


#: The dtypes of a packed empty table (six arrays)
_EMPTY = ("<u1",) * 6


def pack_rows(ptr: np.ndarray, idx: np.ndarray, val: np.ndarray) -> tuple:
    """``(lens, idx, val)``: the sparse bin rows of a CSR matrix, as :func:`unpack_rows` reads
    them (row lengths instead of the pointer array)."""
    return np.diff(ptr), idx, val


def unpack_rows(lens: np.ndarray, idx: np.ndarray, val: np.ndarray, k: int, lam: int,
                where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(hashes, ptr, idx, val)`` of sparse bin rows as :func:`pack_rows` wrote them, checked
    without a dense copy: every row a level set of ``lambda V^k`` (entries in ``[0, k)``,
    strictly increasing, counts positive, row sum ``s`` with ``0 <= lambda - s < k``) and the
    rows in the canonical order of their :func:`lpcal.levels.row_hash` (strictly increasing,
    so no bin twice); the hashes are computed here from the rows, never read."""
    n = lens.size
    if not 2 <= k <= MAX_PACKED_K or not 1 <= lam <= MAX_LAMBDA:
        raise InputError(f"{where}: k={k} outside [2, {MAX_PACKED_K}] or lambda={lam} outside "
                         f"[1, {MAX_LAMBDA}]")
    if (lens < 0).any() or int(lens.sum()) != idx.size or idx.size != val.size:
        raise InputError(f"{where}: bin row lengths do not add up to the entries")
    if idx.size and (idx.min() < 0 or idx.max() >= k or val.min() <= 0 or val.max() > lam):
        raise InputError(f"{where}: a bin entry is outside [0, {k}) or its count outside "
                         f"[1, {lam}]")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    row = np.repeat(np.arange(n), lens)
    if idx.size > 1:
        step = np.diff(idx)
        start = np.zeros(idx.size, dtype=bool)
        start[ptr[1:-1][lens[1:] > 0]] = True
        if (step[~start[1:]] <= 0).any():
            raise InputError(f"{where}: bin entries are not strictly increasing in a row")
    s = np.bincount(row, weights=val, minlength=n)
    if n and ((s > lam) | (lam - s >= k)).any():
        raise InputError(f"{where}: a bin row is not a level set of V_{lam}^{k}")
    w = _weights(k)
    hh = np.empty((n, 2), dtype=np.float64)
    for c in range(2):  # exact: integer sums below 2^53 (see lpcal.levels.row_hash)
        hh[:, c] = np.bincount(row, weights=val * w[idx, c], minlength=n)
    h = _combine(hh)
    if n > 1 and (h[1:] <= h[:-1]).any():  # (np.diff would overflow)
        raise InputError(f"{where}: bins are not in canonical order, or one is there twice")
    return h, ptr, idx.astype(np.int32), val.astype(np.int32)


#: Count tables and held-out sums with fewer (bin, label) pairs or bins than this are packed at
#: every checkpoint instead of through the checkpoint cache (:meth:`PoolSet.to_dict`): for them
#: the cache's lookup costs more than the packing.
MEMO_MIN_PAIRS = 256


def pack_holdout(h) -> dict:
    """The packed form of :class:`lpcal.holdout.HoldoutSums` (bins as in
    :meth:`CountTable.to_dict`, in their hash order; the counts, then the sums' three blocks
    of ``k`` columns, each in its narrowest dtype)."""
    if h.rows.shape[0] == 0 and h.counts.size == 0:  # no held-out sample yet (common)
        return {"k": h.k, "lam": h.lam, "n": 0, "nnz": 0, "dtypes": ["<u1"] * 7, "data": ""}
    ptr, idx, val = _csr_from_dense(h.rows)
    return {"k": h.k, "lam": h.lam, "n": int(h.rows.shape[0]), "nnz": int(idx.size),
            **pack_arrays([np.diff(ptr), idx, val, h.counts,
                           *(h.sums[:, i * h.k:(i + 1) * h.k] for i in range(3))])}


def unpack_holdout(d: Mapping, where: str = "holdout"):
    """Inverse of :func:`pack_holdout`; the unpacked form goes to
    :meth:`lpcal.holdout.HoldoutSums.from_dict`. Checks what that does (bins level sets, each
    once; counts positive, sums >= 0) on the packed arrays."""
    if not (isinstance(d, Mapping) and "data" in d):
        return HoldoutSums.from_dict(d, where)
    try:
        out = HoldoutSums(int(d["k"]), int(d["lam"]))
        n, nnz = d["n"], d["nnz"]
    except (KeyError, TypeError, ValueError, InputError) as e:
        raise InputError(f"{where}: malformed held-out sums ({e})") from None
    k = out.k
    if type(n) is not int or not 0 <= n or k > MAX_PACKED_K:
        raise InputError(f"{where}: {n!r} bins of k={k}")
    if n == nnz == 0 and d.get("data") == "":  # no held-out sample yet (common)
        return out
    lens, idx, val, cnt, *yqg = unpack_arrays(d, [n, nnz, nnz, n, n * k, n * k, n * k], where)
    sums = np.concatenate([a.reshape(n, k) for a in yqg], axis=1)
    h, ptr, idx, val = unpack_rows(lens, idx, val, k, out.lam, where)
    if n and ((cnt < 1).any() or (sums < 0).any()):
        raise InputError(f"{where}: counts must be positive integers and sums >= 0")
    out.rows = _csr_to_dense(ptr, idx, val, k)
    out.hashes, out.counts, out.sums = h, cnt, sums
    return out


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


#: The arrays of an empty :class:`CountTable` (``_h``, ``_ptr``, ``_idx``, ``_val``, ``_pb``,
#: ``_pl``, ``_pc``): shared by every empty table, read-only.
_EMPTY_ARRAYS = tuple(_read_only(np.zeros(n, dtype=t)) for n, t in (
    (0, np.int64), (1, np.int64), (0, np.int32), (0, np.int32), (0, np.int64), (0, np.int32),
    (0, np.int64)))
#: Serialises the creation of the tables' locks (:attr:`CountTable._lock`).
_LOCK_INIT = threading.Lock()


def tree_sum(items: Sequence[Any], add: Callable[[Any, Any], Any]) -> Any:
    """``items[0] + items[1] + ...`` added pairwise in a balanced tree (``log2`` depth: each
    operand of a merge is about as large as the other). ``items`` must not be empty."""
    level = list(items)
    if not level:
        raise InputError("tree_sum of no items")
    while len(level) > 1:
        level = [add(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def _merge_compacted_tables(tables: list[CountTable]) -> CountTable:
    """The pool of the union of compacted, materialised, non-empty ``tables`` (``(k, lambda)``
    checked by the caller): one ``np.unique`` over their bins (sorted, each row taken from the
    first table holding the bin; :class:`HashCollision` if another holder's sparse row differs)
    and one over their (bin, label) pairs. The arrays do not depend on how the tables are
    grouped: adding them pairwise in any order gives the same, to the dtype."""
    k, lam = tables[0].k, tables[0].lam
    sizes = [t._h.size for t in tables]
    h_all = np.concatenate([t._h for t in tables])
    uh, first_pos, inv = _unique_first(h_all)
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
    order = np.argsort(pair)
    ps = pair[order]
    starts = np.flatnonzero(run_starts(ps))
    up, pc = ps[starts], np.add.reduceat(cnt[order], starts)  # int64 counts, exact
    return CountTable._raw(k, lam, uh, ptr, idx.astype(np.int32, copy=False),
                           val.astype(np.int32, copy=False), up // k, up % k, pc)


class CountTable:
    """A sample pool: the number of samples per (bin, label), with ``k`` classes at ``lambda``.

    Bins are kept once each, sparsely (CSR rows of ``c = lambda * R(u)``), indexed by their 64-bit
    row hash (sorted); counts are a COO list of (bin position, label, count). ``add`` buffers and
    compacts lazily, so streaming many small batches costs amortised ``O(batch * k)``.
    """

    __slots__ = (
        "_h",
        "_idx",
        "_lazy",
        "_lk",
        "_npend",
        "_pb",
        "_pbytes",
        "_pc",
        "_pending",
        "_pl",
        "_ptr",
        "_val",
        "k",
        "lam",
    )

    def __init__(self, k: int, lam: int):
        if k < 2 or lam < 1:
            raise InputError(f"CountTable needs k >= 2 and lambda >= 1, got k={k}, lambda={lam}")
        self.k, self.lam = int(k), int(lam)
        # an empty table shares read-only empty arrays (never written in place: every change
        # assigns new arrays), so an idle pool holds no array of its own
        (self._h, self._ptr, self._idx, self._val, self._pb, self._pl,
         self._pc) = _EMPTY_ARRAYS
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._npend = 0
        self._pbytes = 0
        # (probability rows, one row index per bin): bin rows not materialised yet
        self._lazy: tuple[np.ndarray, np.ndarray] | None = None
        self._lk: threading.RLock | None = None  # :attr:`_lock`, made on first use

    @property
    def _lock(self) -> threading.RLock:
        """Reads compact pending rows and materialise lazy ones, i.e. they write: one
        re-entrant lock per table makes a table safe to read from one thread while another
        serialises it. Made on first use (under a module lock, so two threads get the same)."""
        lk = self._lk
        if lk is None:
            with _LOCK_INIT:
                lk = self._lk
                if lk is None:
                    lk = self._lk = threading.RLock()
        return lk

    def _materialize(self) -> None:
        """Compute the sparse rows of lazily held bins (see :func:`tables_from_rows`)."""
        if self._lazy is not None:
            src, rows = self._lazy
            self._ptr, self._idx, self._val = _csr_from_dense(bin_counts(src[rows], self.lam))
            self._lazy = None

    # ------------------------------------------------------------------ building
    @_locked
    def add(self, probs: np.ndarray | None, labels, counts: np.ndarray | None = None,
            hashes: np.ndarray | None = None) -> None:
        """Add samples given as probability rows (binned here) or as precomputed bin rows
        (optionally with their ``row_hash``)."""
        if counts is None:
            if probs is None:
                raise InputError("add() needs probs or counts")
            counts, hashes = bin_counts_hashed(probs, self.lam)
        c, y = _checked_rows(counts, labels, self.k)
        if c.shape[0] == 0:
            return
        if hashes is None:
            hashes = row_hash(c)
        self._append(c, y, np.asarray(hashes, dtype=np.int64))

    @_locked
    def _append(self, c: np.ndarray, y: np.ndarray, h: np.ndarray) -> None:
        """Buffer checked rows (int32 bins, int32 labels, int64 hashes; see :meth:`add`)."""
        self._pending.append((c, y, h))
        self._npend += c.shape[0]
        self._pbytes += c.nbytes + y.nbytes + h.nbytes
        if self._npend >= _COMPACT_EVERY or (self._pbytes >= COMPACT_MIN_BYTES
                                             and self._pbytes >= self._compacted_bytes()):
            self._compact()

    def compact(self) -> None:
        """Fold buffered rows in now (reads then never write; see ``_lock``)."""
        with self._lock:
            self._compact()
            self._materialize()

    def _compact(self) -> None:
        if not self._pending:
            return
        c = np.concatenate([p[0] for p in self._pending])
        y = np.concatenate([p[1] for p in self._pending])
        h = np.concatenate([p[2] for p in self._pending])
        self._pending, self._npend, self._pbytes = [], 0, 0
        uh, first, inv = group_rows(c, h)
        ptr, idx, val = _csr_from_dense(c[first])
        pair = inv.astype(np.int64) * self.k + y
        up, pc = np.unique(pair, return_counts=True)
        other = CountTable._raw(self.k, self.lam, uh, ptr, idx, val, up // self.k, up % self.k, pc)
        merged = self._merge_compacted(other)
        self._assign(merged)

    @classmethod
    def _raw(cls, k, lam, h, ptr, idx, val, pb, pl, pc, lazy=None) -> CountTable:
        t = cls(k, lam)
        t._h, t._ptr, t._idx, t._val = h, ptr, idx, val
        t._pb, t._pl, t._pc = pb.astype(np.int64), pl.astype(np.int32), pc.astype(np.int64)
        t._lazy = lazy
        return t

    def _assign(self, o: CountTable) -> None:
        self._h, self._ptr, self._idx, self._val = o._h, o._ptr, o._idx, o._val
        self._pb, self._pl, self._pc = o._pb, o._pl, o._pc
        self._lazy = o._lazy

    @classmethod
    def from_samples(cls, probs, labels, lam: int, k: int | None = None) -> CountTable:
        probs = np.atleast_2d(np.asarray(probs))
        t = cls(k or probs.shape[1], lam)
        t.add(probs, labels)
        t._compact()
        return t

    # ------------------------------------------------------------------ combining
    def _merge_compacted(self, o: CountTable) -> CountTable:
        self._materialize()
        o._materialize()
        if self._h.size == 0:
            return o
        if o._h.size == 0:
            return self
        return _merge_compacted_tables([self, o])

    @classmethod
    def merge_many(cls, tables: list[CountTable]) -> CountTable:
        """The pool of the union of all ``tables``' samples in one pass (none is modified):
        the same arrays, to the dtype, as adding them pairwise in any order
        (:func:`_merge_compacted_tables`, which :meth:`merge` runs on two). A window of ``B``
        buckets builds its fit pools with one merge per table instead of ``B - 1``."""
        if not tables:
            raise InputError("merge_many of no tables")
        first = tables[0]
        for t in tables[1:]:
            if (t.k, t.lam) != (first.k, first.lam):
                raise InputError(f"cannot merge pools with (k, lambda) = {(first.k, first.lam)} "
                                 f"and {(t.k, t.lam)}")
        with contextlib.ExitStack() as stack:
            for t in tables:
                stack.enter_context(t._lock)
                t._compact()
                t._materialize()
            full = [t for t in tables if t._h.size]
            if len(full) <= 1:  # nothing to add up: a copy of the one table (or of the first)
                return (full[0] if full else first).copy()
            return _merge_compacted_tables(full)

    @_locked
    def merge(self, other: CountTable) -> CountTable:
        """The pool of the union of both pools' samples (neither input is modified)."""
        if (self.k, self.lam) != (other.k, other.lam):
            raise InputError(
                f"cannot merge pools with (k, lambda) = {(self.k, self.lam)} and "
                f"{(other.k, other.lam)}"
            )
        with other._lock:
            self._compact()
            other._compact()
            out = self._merge_compacted(other)
            return out.copy() if (out is self or out is other) else out

    __add__ = merge

    @_locked
    def copy(self) -> CountTable:
        self._compact()
        t = CountTable._raw(self.k, self.lam, self._h, self._ptr, self._idx, self._val,
                            self._pb, self._pl, self._pc, self._lazy)
        return t

    # ------------------------------------------------------------------ reading
    def _compacted_bytes(self) -> int:
        return (self._h.nbytes + self._ptr.nbytes + self._idx.nbytes + self._val.nbytes
                + self._pb.nbytes + self._pl.nbytes + self._pc.nbytes)

    @property
    @_locked
    def nbytes(self) -> int:
        """Bytes of the table's arrays: the compacted bins and counts plus the buffered rows
        (the probability rows a lazy table refers to are not counted: they are the caller's)."""
        return self._compacted_bytes() + self._pbytes

    @property
    @_locked
    def total(self) -> int:
        return int(self._pc.sum()) + self._npend

    @property
    @_locked
    def empty(self) -> bool:
        """No bin and no sample (buffered ones included): equal to a new table."""
        return (self._h.size == 0 and self._pb.size == 0 and self._npend == 0
                and not self._pending and self._lazy is None)

    @property
    @_locked
    def n_bins(self) -> int:
        self._compact()
        return int(self._h.size)

    @_locked
    def class_counts(self) -> np.ndarray:
        """``(k,)`` int64: samples per label over every bin (O(stored pairs), no dense table)."""
        self._compact()
        return np.bincount(self._pl, weights=self._pc, minlength=self.k).astype(np.int64)

    @_locked
    def bin_mass(self) -> tuple[np.ndarray, np.ndarray]:
        """``(hashes, counts)``: number of samples per stored bin."""
        self._compact()
        return self._h, np.bincount(self._pb, weights=self._pc, minlength=self._h.size).astype(np.int64)

    @_locked
    def bin_rows(self, positions: np.ndarray) -> np.ndarray:
        """Dense int32 rows ``c`` of the stored bins at ``positions``."""
        self._compact()
        positions = np.asarray(positions, dtype=np.int64)
        if self._lazy is not None:
            src, rows = self._lazy
            return bin_counts(src[rows[positions]], self.lam)
        sub = _csr_take(self._ptr, self._idx, self._val, positions)
        return _csr_to_dense(*sub, self.k)

    @_locked
    def label_counts(self, hashes: np.ndarray) -> np.ndarray:
        """Dense ``(len(hashes), k)`` label counts for the bins with these hashes (0 if absent)."""
        self._compact()
        hashes = np.asarray(hashes, dtype=np.int64)
        out = np.zeros((hashes.size, self.k), dtype=np.int64)
        if self._h.size == 0 or hashes.size == 0:
            return out
        pos = np.searchsorted(self._h, hashes)
        pos_c = np.minimum(pos, self._h.size - 1)
        present = self._h[pos_c] == hashes
        # map stored bin position -> requested row
        req = np.full(self._h.size, -1, dtype=np.int64)
        req[pos_c[present]] = np.flatnonzero(present)
        rows = req[self._pb]
        keep = rows >= 0
        np.add.at(out, (rows[keep], self._pl[keep]), self._pc[keep])
        return out

    @_locked
    def keys(self) -> list[str]:
        self._compact()
        self._materialize()
        return encode_keys(_csr_to_dense(self._ptr, self._idx, self._val, self.k)) \
            if self._h.size * self.k <= 1 << 24 else self._keys_chunked()

    def _keys_chunked(self) -> list[str]:
        out: list[str] = []
        step = max(1, (1 << 22) // self.k)
        for a in range(0, self._h.size, step):
            pos = np.arange(a, min(a + step, self._h.size))
            out.extend(encode_keys(self.bin_rows(pos)))
        return out

    # ------------------------------------------------------------------ serialisation
    @_locked
    def to_dict(self, *, packed: bool = False) -> dict:
        """JSON-safe dict; ``from_dict(to_dict())`` round-trips.

        Default: canonical bin keys and lists of integers (``lpcal.model_state/4`` and
        earlier; a Python loop over the bins). ``packed``: the sparse bin rows and the
        (bin, label, count) triples as one base64 string of little-endian arrays
        (:func:`pack_arrays`: row lengths, entries, counts, bins, labels, counts), with their lengths ``n`` (bins), ``nnz``
        (entries) and ``pairs``: no per-bin Python work (``lpcal.model_state/5`` and /6)."""
        self._compact()
        if not packed:
            return {
                "k": self.k,
                "lam": self.lam,
                "bins": self.keys(),
                "bin": self._pb.tolist(),
                "label": self._pl.tolist(),
                "count": self._pc.tolist(),
            }
        self._materialize()
        return {"k": self.k, "lam": self.lam, "n": int(self._h.size), "nnz": int(self._idx.size),
                "pairs": int(self._pb.size),
                **pack_arrays([*pack_rows(self._ptr, self._idx, self._val), self._pb, self._pl,
                               self._pc])}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "pool") -> CountTable:
        """Inverse of :meth:`to_dict` (either form); malformed input raises
        :class:`InputError` naming ``where``."""
        if isinstance(d, Mapping) and "data" in d:
            return cls._from_packed(d, where)
        try:
            k, lam = int(d["k"]), int(d["lam"])
            keys = list(d["bins"])
            arrays = [np.asarray(d[f]) for f in ("bin", "label", "count")]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed pool ({e})") from None
        for name, a in zip(("bin", "label", "count"), arrays):
            bools = a.dtype.kind == "O" or any(type(x) is bool for x in d[name])
            if a.size and (a.dtype.kind not in "iu" or bools):
                raise InputError(f"{where}: '{name}' must hold integers (not floats or booleans)")
        pb, pl, pc = (a.astype(np.int64) for a in arrays)
        if not (pb.shape == pl.shape == pc.shape) or pb.ndim != 1:
            raise InputError(f"{where}: bin/label/count arrays differ in shape")
        if pb.size and (pb.min() < 0 or pb.max() >= len(keys)):
            raise InputError(f"{where}: bin position outside [0, {len(keys)})")
        if pl.size and (pl.min() < 0 or pl.max() >= k):
            raise InputError(f"{where}: label outside [0, {k})")
        if pc.size and pc.min() <= 0:
            raise InputError(f"{where}: counts must be positive")
        rows = decode_keys(keys, k, lam)
        t = cls(k, lam)
        if rows.shape[0]:
            h = row_hash(rows)
            uh, first, inv = group_rows(rows, h)
            if uh.size != rows.shape[0]:
                raise InputError(f"{where}: duplicate bin keys")
            ptr, idx, val = _csr_from_dense(rows[first])
            pair = inv[pb] * k + pl
            up, where_ = np.unique(pair, return_inverse=True)
            cnt = np.bincount(where_.reshape(-1), weights=pc, minlength=up.size).astype(np.int64)
            t._assign(CountTable._raw(k, lam, uh, ptr, idx, val, up // k, up % k, cnt))
        return t

    @classmethod
    def _from_packed(cls, d: Mapping, where: str) -> CountTable:
        """The packed form of :meth:`to_dict`: checked (rows as :func:`unpack_rows` says;
        (bin, label) pairs strictly increasing, so canonical and unique; counts positive)."""
        try:
            k, lam = int(d["k"]), int(d["lam"])
            n, nnz, pairs = d["n"], d["nnz"], d["pairs"]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed pool ({type(e).__name__}: {e})") from None
        if not 2 <= k <= MAX_PACKED_K or not 1 <= lam <= MAX_LAMBDA:
            raise InputError(f"{where}: k={k}, lambda={lam}")
        if n == nnz == pairs == 0 and d.get("data") == "":  # an empty pool (common)
            if not isinstance(d.get("dtypes"), list) or len(d["dtypes"]) != len(_EMPTY):
                raise InputError(f"{where}: malformed packed arrays")
            return cls(k, lam)
        lens, idx, val, pb, pl, pc = unpack_arrays(d, (n, nnz, nnz, pairs, pairs, pairs), where)
        h, ptr, idx, val = unpack_rows(lens, idx, val, k, lam, where)
        if pb.size:
            if pb.min() < 0 or pb.max() >= n:
                raise InputError(f"{where}: bin position outside [0, {n})")
            if pl.min() < 0 or pl.max() >= k:
                raise InputError(f"{where}: label outside [0, {k})")
            if pc.min() <= 0:
                raise InputError(f"{where}: counts must be positive")
            pair = pb * k + pl
            if pb.size > 1 and (pair[1:] <= pair[:-1]).any():
                raise InputError(f"{where}: (bin, label) pairs are not in canonical order")
        return cls._raw(k, lam, h, ptr, idx, val, pb, pl, pc)

    @_locked
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CountTable):
            return NotImplemented
        self._compact()
        other._compact()
        self._materialize()
        other._materialize()
        return (
            (self.k, self.lam) == (other.k, other.lam)
            and np.array_equal(self._h, other._h)
            and np.array_equal(self._ptr, other._ptr)
            and np.array_equal(self._idx, other._idx)
            and np.array_equal(self._val, other._val)
            and np.array_equal(self._pb, other._pb)
            and np.array_equal(self._pl, other._pl)
            and np.array_equal(self._pc, other._pc)
        )

    def __repr__(self) -> str:
        return f"CountTable(k={self.k}, lam={self.lam}, total={self.total})"


def _sorted_counts(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_counts=True)`` (values and dtypes) with one sort and no more
    passes than it needs."""
    s = np.sort(key)
    new = np.empty(s.size + 1, dtype=bool)
    new[0] = new[-1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:-1])
    starts = np.flatnonzero(new)
    return s[starts[:-1]], np.diff(starts)


def _unique_first(h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(h, return_index=True, return_inverse=True)`` (values; the inverse flat)
    of int64 ``h`` from one stable sort."""
    order = np.argsort(h, kind="stable")
    hs = h[order]
    new = run_starts(hs)
    gid = np.cumsum(new) - 1
    inv = np.empty_like(gid)
    inv[order] = gid
    return hs[new], order[new], inv


def _group_hashed(c: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(unique_hashes, first_index, inverse)`` of bin rows ``c`` with row hashes ``h``, as
    :func:`lpcal.levels.group_rows` gives them (sorted hashes, the first row holding each, the
    group of every row), from one stable sort; the rows of a group are compared entry by entry
    (:class:`HashCollision` if two differ: a stricter check than the hashes' pair)."""
    uh, first, inv = _unique_first(h)
    if first.size != h.size:  # the rows that are not their group's first, against it
        rep = first[inv]
        dup = np.flatnonzero(rep != np.arange(h.size))
        step = max(1, (1 << 20) // max(c.shape[1], 1))
        for a in range(0, dup.size, step):
            d = dup[a:a + step]
            if not np.array_equal(c[rep[d]], c[d]):
                raise HashCollision("two distinct bins share a 64-bit hash")
    return uh, first, inv


def _dense_to_csr(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_csr_from_dense` of int32 ``rows`` (the same arrays and dtypes) from the flat
    positions of the non-zero entries alone: a row's pointer is where its first flat position
    would sort (fewer passes than a 2-d ``nonzero`` and a count per row)."""
    n, k = rows.shape
    flat = rows.reshape(-1)
    pos = np.flatnonzero(flat)
    ptr = np.searchsorted(pos, np.arange(0, (n + 1) * k, k, dtype=np.int64))
    return ptr, (pos % k).astype(np.int32), flat[pos].astype(np.int32, copy=False)


def _route_rows(tables: list[CountTable], routed) -> None:
    """Append rows ``routed`` (``(table index, bins, labels, hashes)`` chunks, checked, in
    arrival order) to ``tables[index]`` as :meth:`PoolSet.add` did when it split every batch at
    once: per chunk, sorted by table (stable), one contiguous slice per table."""
    for pool_idx, c, y, h in routed:
        order = np.argsort(pool_idx, kind="stable")
        ps = pool_idx[order]
        c, y, h = c[order], y[order], h[order]
        cuts = (np.flatnonzero(ps[1:] != ps[:-1]) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, ps.size]):
            tables[int(ps[a])]._append(c[a:b], y[a:b], h[a:b])


def compact_tables(tables: list[CountTable], routed=()) -> None:
    """:meth:`CountTable.compact` of every table, with the buffered rows of all of them
    (and the rows ``routed`` to them: ``(table index, bins, labels, hashes)`` chunks, in
    arrival order, as :meth:`PoolSet.add` keeps them) grouped in one pass: one grouping of
    the bins by row hash, one sparse encoding of the bins, one count of the (table, bin,
    label) triples, then each table's share merged into its compacted part as :meth:`CountTable._compact` merges its own (a table without a
    compacted part takes its share as it is: slices of the pass's arrays). The tables end with
    the very arrays their own compaction gives (values and dtypes; tested). A hash shared by
    two distinct bins raises :class:`HashCollision` even when the two are in different
    tables."""
    if len({(t.k, t.lam) for t in tables}) != 1 or not routed and sum(
            bool(t._pending) for t in tables) < 2:
        _route_rows(tables, routed)
        for t in tables:
            t.compact()
        return
    locks = [t._lock for t in tables]
    for lk in locks:
        lk.acquire()
    try:
        _compact_jointly(tables, routed)
    finally:
        for lk in reversed(locks):
            lk.release()
    for t in tables:
        if t._pending or t._lazy is not None:
            t.compact()  # the tables without buffered rows (and lazy bins) as before


def _compact_jointly(tables: list[CountTable], routed) -> None:
    """The one pass of :func:`compact_tables` (the tables locked, of one ``(k, lambda)``)."""
    k, lam = tables[0].k, tables[0].lam
    own = [(i, p) for i, t in enumerate(tables) for p in t._pending]
    parts = [p for _, p in own] + [r[1:] for r in routed]
    c = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    h = np.concatenate([p[2] for p in parts])
    tid = np.concatenate([np.repeat(np.array([i for i, _ in own], dtype=np.int64),
                                    np.array([p[2].size for _, p in own], dtype=np.int64))]
                         + [np.asarray(r[0], dtype=np.int64) for r in routed])
    for t in tables:
        if t._pending:
            t._pending, t._npend, t._pbytes = [], 0, 0
    uh, first, inv = _group_hashed(c, h)
    nb = uh.size
    # one sort: the (table, bin, label) triples, sorted; their (table, bin) pairs are
    # then sorted too, and numbered in order (what a unique of the pairs would give)
    up, pc = _sorted_counts((tid * nb + inv) * k + y)
    tb, plab = np.divmod(up, k)
    new = run_starts(tb)
    ukey = tb[new]                                                # (table, bin), sorted
    pbin = np.cumsum(new) - 1                                     # its number
    tbl, gbin = np.divmod(ukey, nb)
    start = np.searchsorted(tbl, np.arange(len(tables) + 1))      # each table's bins
    pstart = np.searchsorted(pbin, start)                         # and its pairs
    ptr, idx, val = _dense_to_csr(c[first[gbin]])
    hb = uh[gbin]
    pbin -= np.repeat(start[:-1], np.diff(pstart))                # numbered per table
    plab = plab.astype(np.int32)
    bounds, pbounds, offs = start.tolist(), pstart.tolist(), ptr[start].tolist()
    for i, t in enumerate(tables):
        a, b = bounds[i], bounds[i + 1]
        if a == b:  # no row for this table
            continue
        pa, pb = pbounds[i], pbounds[i + 1]
        arrays = (hb[a:b], ptr[a:b + 1] - offs[i], idx[offs[i]:offs[i + 1]],
                  val[offs[i]:offs[i + 1]], pbin[pa:pb], plab[pa:pb], pc[pa:pb])
        if t._h.size == 0:  # nothing compacted yet: its share is its table
            (t._h, t._ptr, t._idx, t._val, t._pb, t._pl, t._pc) = arrays
            t._lazy = None
        else:
            t._assign(t._merge_compacted(CountTable._raw(k, lam, *arrays)))


def tables_from_rows(probs: np.ndarray, labels: np.ndarray, assign: np.ndarray, n_tables: int,
                     k: int, lam: int, scan=None) -> list[CountTable]:
    """Build ``n_tables`` pools at once: row ``i`` goes to pool ``assign[i]`` (-1: unused).

    One fused pass hashes every row's bin (:func:`lpcal.levels.scan_rows`, or its result passed as
    ``scan``); rows are grouped by hash with one sort (checked on both exact hashes), and one
    ``np.unique`` over (pool, bin, label) keys gives every pool's counts. Bin rows stay lazy: the
    tables keep a reference to ``probs`` and compute a bin's row only when asked for it (for the
    bins of ``B`` during a fit, or for all of them when serialised).
    """
    h, pair = (scan_rows(probs, lam)[:2] if scan is None else scan[:2])
    sel = np.flatnonzero(assign >= 0)
    if sel.size < assign.size:
        h, pair = h[sel], pair[sel]
    uh, first, inv = _unique_first(h)
    if not pairs_agree(pair, first, inv):
        raise HashCollision("two distinct bins share a 64-bit hash")
    m = uh.size
    key = (assign[sel].astype(np.int64) * m + inv) * k + np.asarray(labels)[sel]
    uk, cnt = np.unique(key, return_counts=True)
    k_pool, rest = np.divmod(uk, m * k)
    k_bin, k_lab = np.divmod(rest, k)
    bounds = np.searchsorted(k_pool, np.arange(n_tables + 1))
    src_rows = sel[first]
    out = []
    empty_ptr = np.zeros(1, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int32)
    for t in range(n_tables):
        a, b = bounds[t], bounds[t + 1]
        bins, local = np.unique(k_bin[a:b], return_inverse=True)
        out.append(CountTable._raw(k, lam, uh[bins], empty_ptr, empty, empty, local.reshape(-1),
                                   k_lab[a:b], cnt[a:b], lazy=(probs, src_rows[bins])))
    return out


# ============================================================================ layout


def n_levels(beta: float) -> int:
    """``L = floor(log2(6/beta)) + 1``: group sizes ``1, 2, ..., 2^(L-1)`` cover ``|B| <= 6/beta``."""
    return math.floor(math.log2(6.0 / beta) + 1e-12) + 1


def pool_names(levels: int, variant: str) -> list[str]:
    if variant == "split":
        return ["mu"] + [f"P{i}" for i in range(levels)] + [f"E{i}" for i in range(levels)]
    if variant == "shared":
        return ["mu"] + [f"PE{i}" for i in range(levels)]
    raise InputError(f"variant must be 'split' or 'shared', got {variant!r}")


def route_uniform(ids: Iterable[str | bytes]) -> np.ndarray:
    """Map event ids to uniforms in [0, 1) with blake2b (stable across processes and versions).

    ``u = int.from_bytes(blake2b(id.encode(), digest_size=8).digest(), "big") / 2**64`` (str ids
    UTF-8 encoded; bytes-like ids as they are). The 8-byte digests are concatenated and read at
    once as big-endian uint64 (no Python int per id); the value is unchanged."""
    blake2b = hashlib.blake2b
    enc = [i.encode() if isinstance(i, str) else bytes(i) for i in ids]
    digests = b"".join([blake2b(b, digest_size=8).digest() for b in enc])
    return np.frombuffer(digests, dtype=">u8").astype(np.float64) / 2.0**64


@dataclass(frozen=True)
class PoolLayout:
    """The pools of one calibration epoch: names, target sizes and the routing of events.

    Beyond Algorithm 2's pools (``names``), an epoch of the certified mode has

    * ``warmup`` samples, taken in arrival order before any other pool, that fit the epoch's
      temperature pre-calibrator (:class:`lpcal.precalibrate.TemperatureGrid`); the other pools
      then hold bins of the pre-calibrated predictor ``g = softmax(log f / T)``;
    * a held-out share ``holdout`` (routed like a pool, under the name ``"hold"``) whose
      :class:`lpcal.holdout.HoldoutSums` certify the fitted bin map.

    Both are 0 in the paper's mode.
    """

    k: int
    lam: int
    levels: int
    variant: str
    targets: Mapping[str, int]
    holdout: int = 0
    warmup: int = 0
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        names = tuple(pool_names(self.levels, self.variant))
        missing = [n for n in names if n not in self.targets]
        if missing:
            raise InputError(f"pool targets missing for {missing}")
        bad = [n for n in names if int(self.targets[n]) <= 0]
        if bad:
            raise InputError(f"pool targets must be positive: {bad}")
        if int(self.holdout) < 0 or int(self.warmup) < 0:
            raise InputError(f"holdout and warmup must be >= 0, got {self.holdout}, "
                             f"{self.warmup}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "targets", {n: int(self.targets[n]) for n in names})
        object.__setattr__(self, "holdout", int(self.holdout))
        object.__setattr__(self, "warmup", int(self.warmup))
        object.__setattr__(self, "_cumulative", self._cumulative_weights())

    @property
    def total_target(self) -> int:
        return sum(self.targets.values()) + self.holdout + self.warmup

    @property
    def routes(self) -> tuple[str, ...]:
        """Names of the routed destinations: the pools, then ``"hold"`` if any."""
        return self.names + (("hold",) if self.holdout else ())

    def cumulative_weights(self) -> np.ndarray:
        """Cumulative shares of the routed destinations (read-only; computed once)."""
        return self._cumulative

    def _cumulative_weights(self) -> np.ndarray:
        t = np.array([self.targets[n] for n in self.names]
                     + ([self.holdout] if self.holdout else []), dtype=np.float64)
        cw = np.cumsum(t) / t.sum()
        cw.flags.writeable = False
        return cw

    def route(self, ids: Iterable[str | bytes]) -> np.ndarray:
        """Destination index (into :attr:`routes`) of each event id, with probability
        proportional to the target sizes."""
        return self.route_uniforms(route_uniform(ids))

    def route_uniforms(self, u: np.ndarray) -> np.ndarray:
        """Destination index of each uniform ``u`` in [0, 1) (``route(ids)`` is
        ``route_uniforms(route_uniform(ids))``; for callers that hash ids their own way)."""
        return np.minimum(np.searchsorted(self.cumulative_weights(), u, side="right"),
                          len(self.routes) - 1)

    def to_dict(self) -> dict:
        d = {"k": self.k, "lam": self.lam, "levels": self.levels, "variant": self.variant,
             "targets": dict(self.targets)}
        if self.holdout or self.warmup:
            d["holdout"], d["warmup"] = self.holdout, self.warmup
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> PoolLayout:
        try:
            return cls(int(d["k"]), int(d["lam"]), int(d["levels"]), str(d["variant"]),
                       dict(d["targets"]), int(d.get("holdout", 0)), int(d.get("warmup", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"malformed pool layout ({e})") from None


class PoolSet:
    """All pools of one epoch: a :class:`PoolLayout` and one :class:`CountTable` per pool; in
    the certified mode also the warm-up :class:`TemperatureGrid`, the epoch's pre-calibration
    ``temperature`` (fixed when the warm-up is complete; the tables hold bins of
    ``softmax(log f / T)``) and the held-out sums of the pre-calibrated (``holdout``) and raw
    (``holdout_raw``) predictors.

    Samples enter in arrival order through :meth:`add_samples`, which stops at the exact sample
    that makes the set :attr:`full` (so epoch boundaries depend only on the sample sequence), or
    per pool through :meth:`add` (Algorithm 2's pools only).

    :meth:`add` keeps its checked rows as they came (with their pool) and hands them to the
    tables only when they are read through :attr:`tables` or when a table's compaction would
    start (:meth:`_hold`); :meth:`compact` groups them without splitting them by pool first.
    The tables then hold the very rows, in the same order, and compact at the same sample, as
    if every batch had been split at once. The owner thread adds; :meth:`compact` before
    handing the pools to another thread (as before).
    """

    def __init__(self, layout: PoolLayout, tables: Mapping[str, CountTable] | None = None, *,
                 temperature: float | None = None):
        self.layout = layout
        self._tables = {n: CountTable(layout.k, layout.lam) for n in layout.names}
        #: rows of :meth:`add` not handed to the tables yet (``(pool index, bins, labels,
        #: hashes)`` chunks, in arrival order; None: none)
        self._routed: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._routed_rows = self._routed_bytes = 0  # their rows and array bytes
        if tables:
            for n, t in tables.items():
                if n not in self._tables:
                    raise InputError(f"unknown pool {n!r} for layout {layout.names}")
                self._tables[n] = t
        self.grid = TemperatureGrid() if layout.warmup else None
        self.temperature = None if temperature is None else float(temperature)
        self.holdout = HoldoutSums(layout.k, layout.lam) if layout.holdout else None
        self.holdout_raw = HoldoutSums(layout.k, layout.lam) if layout.holdout else None

    @property
    def tables(self) -> dict[str, CountTable]:
        """One :class:`CountTable` per pool of the layout (the rows :meth:`add` kept are
        handed to them first)."""
        if self._routed is not None:
            self._hand_over()
        return self._tables

    def _take_routed(self) -> list | tuple:
        """The rows :meth:`add` kept (``()`` if none), no longer kept here."""
        routed, self._routed = self._routed or (), None
        self._routed_rows = self._routed_bytes = 0
        return routed

    def _hand_over(self) -> None:
        """Give the rows :meth:`add` kept to their tables (:func:`_route_rows`)."""
        _route_rows([self._tables[n] for n in self.layout.names], self._take_routed())

    def _hold(self, chunk) -> None:
        """Keep a checked chunk of :meth:`add`, or hand every kept row to the tables if one
        of them might compact with it (its buffered rows reaching ``_COMPACT_EVERY`` rows or
        :data:`COMPACT_MIN_BYTES`: a table then decides at the same sample as before)."""
        if self._routed is None:
            self._routed = []
        self._routed.append(chunk)
        self._routed_rows += chunk[2].size
        self._routed_bytes += chunk[1].nbytes + chunk[2].nbytes + chunk[3].nbytes
        tabs = self._tables.values()
        if (self._routed_rows + max(t._npend for t in tabs) >= _COMPACT_EVERY
                or self._routed_bytes + max(t._pbytes for t in tabs) >= COMPACT_MIN_BYTES):
            self._hand_over()

    @property
    def warming(self) -> bool:
        """True while warm-up samples are still needed to fix the temperature."""
        return self.grid is not None and self.grid.n + self.grid.skipped < self.layout.warmup

    def add(self, pool_idx: np.ndarray, probs: np.ndarray | None, labels,
            counts: np.ndarray | None = None, hashes: np.ndarray | None = None) -> None:
        """Add samples, each to Algorithm 2's pool ``pool_idx[i]``: checked once and kept as
        they came, with their pool (class docstring); the tables get them sorted by pool
        (stable), one contiguous slice per pool. ``probs``/``counts`` are bins of the
        predictor the pools hold (pre-calibrated, if :attr:`temperature` is set); rows given
        as ``counts`` are copied (the pools never share the caller's arrays)."""
        pool_idx = np.asarray(pool_idx)
        given = counts is not None
        if counts is None:
            counts, hashes = bin_counts_hashed(probs, self.layout.lam)
        elif hashes is None:
            hashes = row_hash(counts)
        c, y = _checked_rows(counts, labels, self.layout.k)
        if pool_idx.shape != y.shape:
            raise InputError(f"pool_idx must have shape {y.shape}, got {pool_idx.shape}")
        if y.size == 0:
            return
        names = len(self.layout.names)
        if pool_idx.min() < 0 or pool_idx.max() >= names:
            raise InputError(f"pool_idx outside [0, {names})")
        h = np.asarray(hashes, dtype=np.int64)
        if given:
            c, h = c.copy(), h.copy()
        self._hold((pool_idx.astype(np.uint8 if names <= 256 else np.int64), c, y, h))

    def _need(self) -> list[int]:
        """Samples each routed destination still needs (order of :attr:`PoolLayout.routes`)."""
        need = [self.layout.targets[n] - self.tables[n].total for n in self.layout.names]
        if self.holdout is not None:
            need.append(self.layout.holdout - self.holdout.n)
        return need

    def _fill_point(self, route: np.ndarray) -> int | None:
        """Position in ``route`` of the sample that makes every destination full (None: not
        reached)."""
        pos = -1
        for p, need in enumerate(self._need()):
            if need <= 0:
                continue
            occ = np.flatnonzero(route == p)
            if occ.size < need:
                return None
            pos = max(pos, int(occ[need - 1]))
        return pos if pos >= 0 else None

    def add_samples(self, uniforms: np.ndarray, probs: np.ndarray, labels: np.ndarray, *,
                    raw_bins: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Add samples in order until the set is :attr:`full`; return how many were consumed.

        ``uniforms`` route each sample (:meth:`PoolLayout.route_uniforms`; a hash of the event id
        in the daemon, so a replay routes identically). ``probs`` are the raw predictor's
        validated rows; ``raw_bins = (counts, hashes)`` of ``probs`` may be passed to save the
        binning when no temperature applies. Warm-up samples come first (see
        :class:`PoolLayout`); then the rest is routed to the pools and the held-out share.
        """
        y = np.asarray(labels, dtype=np.int64)
        n = y.shape[0]
        x = np.asarray(probs, dtype=np.float64).reshape(n, self.layout.k)
        a = 0
        if self.warming:
            a = min(n, self.layout.warmup - self.grid.n - self.grid.skipped)
            self.grid.update(x[:a], y[:a])
            if not self.warming:
                self.temperature = self.grid.fit() if self.grid.n else None
            if a == n:
                return n
        if self.full:
            return a
        route = self.layout.route_uniforms(np.asarray(uniforms)[a:])
        cut = self._fill_point(route)
        b = n if cut is None else a + cut + 1
        route = route[: b - a]
        xs, ys = x[a:b], y[a:b]
        if self.temperature is not None:
            g = scale_temperature(xs, self.temperature)
            counts, hashes = bin_counts_hashed(g, self.layout.lam)
        else:
            g = xs
            if raw_bins is not None:
                counts, hashes = raw_bins[0][a:b], raw_bins[1][a:b]
            else:
                counts, hashes = bin_counts_hashed(xs, self.layout.lam)
        pools = len(self.layout.names)
        in_pool = route < pools
        if in_pool.all():
            self.add(route, None, ys, counts=counts, hashes=hashes)
        else:
            sel = np.flatnonzero(in_pool)
            self.add(route[sel], None, ys[sel], counts=counts[sel], hashes=hashes[sel])
            hold = np.flatnonzero(~in_pool)
            self.holdout.update(g[hold], ys[hold])
            self.holdout_raw.update(xs[hold], ys[hold])
        return b

    def compact(self) -> None:
        """Compact every table (before handing the pools to another thread): the buffered
        rows of all tables are grouped in one pass (:func:`compact_tables`); nothing to do
        for a compacted set (a sealed bucket's, at every snapshot of a window)."""
        routed = self._take_routed()
        tables = [self._tables[n] for n in self.layout.names]
        if routed or any(t._pending or t._lazy is not None for t in tables):
            compact_tables(tables, routed)

    def fill(self) -> dict[str, tuple[int, int]]:
        out = {n: (self.tables[n].total, self.layout.targets[n]) for n in self.layout.names}
        if self.grid is not None:
            out["warmup"] = (self.grid.n + self.grid.skipped, self.layout.warmup)
        if self.holdout is not None:
            out["hold"] = (self.holdout.n, self.layout.holdout)
        return out

    @property
    def full(self) -> bool:
        """Every part of :meth:`fill` at its target: the warm-up and held-out counts first
        (read at once), the tables' totals (a sum over each table) only then."""
        if self.warming or (self.holdout is not None
                            and self.holdout.n < self.layout.holdout):
            return False
        tables, targets = self.tables, self.layout.targets
        return all(tables[n].total >= targets[n] for n in self.layout.names)

    @property
    def nbytes(self) -> int:
        """Bytes of the epoch's arrays (tables, held-out sums, warm-up grid)."""
        return self.table_nbytes + self.holdout_nbytes

    @property
    def table_nbytes(self) -> int:
        """The tables' bytes (rows routed to them and not yet compacted included) and the
        warm-up grid's: what :attr:`nbytes` counts besides the held-out sums. Once no row is
        added any more and the tables are compacted, it no longer changes."""
        n = sum(t.nbytes for t in self._tables.values()) + self._routed_bytes
        return n + (self.grid.nll.nbytes if self.grid is not None else 0)

    @property
    def holdout_nbytes(self) -> int:
        """Bytes of the held-out sums (both predictors)."""
        return sum(h.nbytes for h in (self.holdout, self.holdout_raw) if h is not None)

    @property
    def total(self) -> int:
        return sum(c for c, _ in self.fill().values())

    @classmethod
    def merge_many(cls, parts: list[PoolSet]) -> PoolSet:
        """``parts[0].merge(parts[1]).merge(...)`` as one :meth:`CountTable.merge_many` per
        pool (the same tables); the temperature grids and held-out sums are added pairwise in
        a balanced tree (:func:`tree_sum`)."""
        if not parts:
            raise InputError("merge_many of no pool sets")
        first = parts[0]
        for ps in parts[1:]:
            first._check_mergeable(ps)
        out = PoolSet(first.layout, {n: CountTable.merge_many([ps.tables[n] for ps in parts])
                                     for n in first.layout.names},
                      temperature=first.temperature)
        if first.grid is not None:
            out.grid = tree_sum([ps.grid for ps in parts], TemperatureGrid.merge)
        if first.holdout is not None:
            out.holdout = tree_sum([ps.holdout for ps in parts], HoldoutSums.merge)
            out.holdout_raw = tree_sum([ps.holdout_raw for ps in parts], HoldoutSums.merge)
        return out

    def _check_mergeable(self, other: PoolSet) -> None:
        if self.layout != other.layout:
            raise InputError("cannot merge pool sets with different layouts")
        if self.temperature != other.temperature:
            raise InputError("cannot merge pool sets binned at different temperatures")

    def merge(self, other: PoolSet) -> PoolSet:
        self._check_mergeable(other)
        out = PoolSet(self.layout, {n: self.tables[n].merge(other.tables[n])
                                    for n in self.layout.names}, temperature=self.temperature)
        if self.grid is not None:
            out.grid = self.grid.merge(other.grid)
        if self.holdout is not None:
            out.holdout = self.holdout.merge(other.holdout)
            out.holdout_raw = self.holdout_raw.merge(other.holdout_raw)
        return out

    def to_dict(self, *, packed: bool = False, memo=None,
                memo_min_pairs: int = MEMO_MIN_PAIRS) -> dict:
        """JSON-safe dict; ``packed``: tables and held-out sums as packed arrays
        (:meth:`CountTable.to_dict`, :func:`pack_holdout`), empty tables left out (the
        checkpoint format ``lpcal.model_state/6``; :meth:`from_dict` makes every table of the
        layout, empty, before it reads those given).

        ``memo(owner, refs, make)`` (with ``packed``; the daemon's checkpoint cache, see
        :meth:`lpcal.window.SlidingWindow.to_dict`): a table or held-out sums with at least
        ``memo_min_pairs`` (bin, label) pairs or bins whose arrays are the same objects as at
        the last call is not encoded again (their arrays are replaced, never written in place,
        when samples are added); smaller ones are packed every time, which costs less than
        their cache entry."""
        if not packed:
            tables = {n: t.to_dict() for n, t in self.tables.items()}
        else:
            # packed (lpcal.model_state/6): empty tables are left out (the reader makes every
            # table of the layout empty first); small ones are encoded every time, which costs
            # less than their cache entry
            tables = {}
            for n, t in self.tables.items():
                t.compact()
                if t.empty:
                    continue
                if memo is None or t._pb.size < memo_min_pairs:
                    tables[n] = t.to_dict(packed=True)
                else:
                    tables[n] = memo(t, (t._h, t._ptr, t._idx, t._val, t._pb, t._pl, t._pc),
                                     lambda t=t: t.to_dict(packed=True))
        d = {"layout": self.layout.to_dict(), "tables": tables}
        if self.temperature is not None:
            d["temperature"] = self.temperature
        if self.grid is not None:
            d["grid"] = self.grid.to_dict()
        if self.holdout is not None:
            for key in ("holdout", "holdout_raw"):
                h = getattr(self, key)
                if not packed:
                    d[key] = h.to_dict()
                elif memo is None or h.rows.shape[0] < memo_min_pairs:
                    d[key] = pack_holdout(h)
                else:
                    d[key] = memo(h, (h.rows, h.hashes, h.counts, h.sums),
                                  lambda h=h: pack_holdout(h))
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> PoolSet:
        """Inverse of :meth:`to_dict` (either form)."""
        try:
            layout = PoolLayout.from_dict(d["layout"])
            tables = {n: CountTable.from_dict(t, where=f"pool {n}") for n, t in d["tables"].items()}
            t = d.get("temperature")
            out = cls(layout, None, temperature=None if t is None else check_temperature(t))
            if layout.warmup:
                out.grid = TemperatureGrid.from_dict(d["grid"])
            if layout.holdout:
                out.holdout = unpack_holdout(d["holdout"], "pool hold")
                out.holdout_raw = unpack_holdout(d["holdout_raw"], "pool hold (raw)")
                for h in (out.holdout, out.holdout_raw):
                    if (h.k, h.lam) != (layout.k, layout.lam):
                        raise InputError("held-out sums: (k, lambda) does not match the layout")
        except (KeyError, TypeError, AttributeError) as e:
            raise InputError(f"malformed pool set ({e})") from None
        for n, t in tables.items():
            if (t.k, t.lam) != (layout.k, layout.lam):
                raise InputError(f"pool {n}: (k, lambda) does not match the layout")
            if n not in out.tables:
                raise InputError(f"unknown pool {n!r} for layout {layout.names}")
            out.tables[n] = t
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolSet):
            return NotImplemented
        return (self.layout == other.layout and self.temperature == other.temperature
                and all(self.tables[n] == other.tables[n] for n in self.layout.names)
                and self.grid == other.grid and self.holdout == other.holdout
                and self.holdout_raw == other.holdout_raw)
