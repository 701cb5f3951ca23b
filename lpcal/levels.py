"""Level sets V_lambda^k, the rounding R, the canonical distribution rho, and bin keys.

Notation (Bairaktari & Nguyen, *Sample-efficient Multiclass Calibration under lp Error*, Sec. 2):

* ``beta = eps^(p/(p-1)) / 2^(1/(p-1))`` (``beta = eps`` for ``p = inf``) is the per-(bin, class)
  error the algorithm aims for; ``lambda = ceil(1/beta)`` is the discretisation.
* ``R(u)_i = floor(u_i * lambda) / lambda`` rounds a probability vector down coordinatewise. Its
  image is the set of *level sets* ``V_lambda^k``: integer vectors ``c = lambda * R(u)`` with
  ``c >= 0`` and ``lambda - k < sum(c) <= lambda`` (the upper bound because ``u`` sums to one,
  the lower one because each coordinate loses less than ``1/lambda``).
* ``rho(v)`` is the point of the simplex closest to ``v`` in l_inf with ``R(rho(v)) = v``; in closed
  form the deficit ``1 - sum(v)`` is spread evenly over the ``k`` coordinates.

A *bin* is the integer vector ``c``. It has at most ``lambda`` nonzero entries, so it is keyed
sparsely: the canonical key is the string ``"i:c_i,j:c_j,..."`` over the nonzero entries in
increasing index order (``""`` for the zero vector, which is a level set only when ``k > lambda``).
The same key is used in memory, in bin-map artifacts and in the daemon's pools, so ``k`` up to
10,000 classes costs only ``O(lambda)`` per bin.

For bulk work (millions of rows) bins are identified by a row hash: two exact integer dot products
``sum_j c_j W_rj`` with fixed random integer weights ``W_rj < 2^33`` (computed with BLAS in float64,
exact because every partial sum stays below ``2^53``), folded into one int64 key. Grouping checks
both dot products inside every group, and ``BinIndex`` lookups compare the rows themselves, so a
collision raises instead of silently merging two bins.

Floating point: ``(c/lambda)*lambda`` can land one ulp below ``c``; the floor therefore adds
``FLOOR_TOL`` (in units of bins) before flooring. ``lambda = ceil(1/beta)`` snaps ``1/beta`` to the
nearest integer when it is within a relative ``1e-9`` of it, so that ``0.1**2/2`` (which is
``0.005000000000000001``) gives ``lambda = 200``, not 201.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from lpcal.errors import InputError, shown
from lpcal.p_norm import parse_p

FLOOR_TOL = 1e-9
_SNAP_REL = 1e-9
_HASH_SEED = 0x6C70_6361_6C21  # "lpcal!"


def beta_for(eps: float, p: float) -> float:
    """Return ``beta = eps^(p/(p-1)) / 2^(1/(p-1))``, or ``eps`` for ``p = inf``."""
    if not (0.0 < eps < 1.0) or not math.isfinite(eps):
        raise InputError(f"eps must lie in (0, 1), got {shown(eps)}")
    if not (isinstance(p, float | int) and p > 1.0):
        p = parse_p(p)  # the one statement of p's domain (raises)
    if math.isinf(p):
        return float(eps)
    return float(eps ** (p / (p - 1.0)) / 2.0 ** (1.0 / (p - 1.0)))


def lambda_for(beta: float) -> int:
    """Return ``ceil(1/beta)``, snapping ``1/beta`` to an integer within a relative 1e-9."""
    if not (0.0 < beta <= 1.0):
        raise InputError(f"beta must lie in (0, 1], got {shown(beta)}")
    x = 1.0 / beta
    r = round(x)
    lam = max(1, int(r)) if abs(x - r) <= _SNAP_REL * x else math.ceil(x)
    if lam > MAX_LAMBDA:
        raise InputError(f"beta = {beta:g} needs lambda = {lam} > {MAX_LAMBDA} (eps too small)")
    return lam


def level_set_bound(lam: int, k: int) -> int:
    """The paper's bound ``|V_lambda^k| <= C(lambda + k, k)`` (Lemma size-of-V)."""
    return math.comb(lam + k, k)


def level_set_count(lam: int, k: int) -> int:
    """Exact ``|V_lambda^k|``: integer vectors ``c >= 0`` with ``lambda - k < sum(c) <= lambda``.

    Equals the bound ``C(lambda + k, k)`` only when ``k > lambda`` (then every ``c`` with
    ``sum(c) <= lambda`` is a level set); otherwise it is smaller.
    """
    lo = max(0, lam - k + 1)
    return sum(math.comb(s + k - 1, k - 1) for s in range(lo, lam + 1))


def floor_into(src: np.ndarray, lam: int, t: np.ndarray) -> np.ndarray:
    """``lambda * R(u)`` of the rows ``src`` as floats, written into the buffer ``t``: the one
    kernel of R, shared by every chunked pass (R, hashing, scanning, applying a bin map)."""
    np.multiply(src, lam, out=t)
    t += FLOOR_TOL
    np.floor(t, out=t)
    np.clip(t, 0, lam, out=t)
    return t


def bin_counts(probs: np.ndarray, lam: int) -> np.ndarray:
    """``lambda * R(u)`` as int32 rows: ``floor(u * lambda + FLOOR_TOL)`` clipped to ``[0, lambda]``.

    Computed in cache-sized chunks of rows (one read of ``u``, one write of the result).
    """
    u = np.asarray(probs, dtype=np.float64)
    if u.ndim != 2:
        c = np.floor(u * lam + FLOOR_TOL)
        np.clip(c, 0, lam, out=c)
        return c.astype(np.int32)
    n, k = u.shape
    out = np.empty((n, k), dtype=np.int32)
    step = _rows_per_chunk(k)
    buf = np.empty((min(step, n), k))
    for a in range(0, n, step):
        b = min(a + step, n)
        t = floor_into(u[a:b], lam, buf[: b - a])
        out[a:b] = t
    return out


def round_down(probs: np.ndarray, lam: int) -> np.ndarray:
    """``R(u)``: each coordinate rounded down to a multiple of ``1/lambda``."""
    return bin_counts(probs, lam) / float(lam)


def is_level_set(counts: np.ndarray, lam: int) -> np.ndarray:
    """Membership of integer rows ``c`` in ``lambda * V_lambda^k`` (vectorised over rows)."""
    c = np.atleast_2d(np.asarray(counts))
    k = c.shape[1]
    s = c.sum(axis=1)
    return (c >= 0).all(axis=1) & (s <= lam) & (lam - s < k)


def rho(counts: np.ndarray, lam: int) -> np.ndarray:
    """Canonical distribution of level sets given as integer rows ``c = lambda * v``.

    ``rho(v) = v + (1 - sum v) / k``: the deficit spread evenly. Rows that are not level sets raise.
    """
    c = np.asarray(counts)
    two_d = c.ndim == 2
    c = np.atleast_2d(c)
    ok = is_level_set(c, lam)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise InputError(f"row {bad} is not a level set of V_{lam}^{c.shape[1]}: {c[bad].tolist()}")
    k = c.shape[1]
    deficit = (lam - c.sum(axis=1, dtype=np.int64)).astype(np.float64) / k
    out = (c + deficit[:, None]) / float(lam)
    return out if two_d else out[0]


# ----------------------------------------------------------------------------- keys


def encode_key(row: Sequence[int] | np.ndarray) -> str:
    """Canonical sparse key of one integer bin row, e.g. ``"0:3,7:2"``."""
    r = np.asarray(row)
    nz = np.flatnonzero(r)
    return ",".join(f"{i}:{int(r[i])}" for i in nz)


def encode_keys(rows: np.ndarray) -> list[str]:
    """Keys of many bin rows (a Python loop over *unique bins*, never over samples)."""
    rows = np.atleast_2d(rows)
    ii, jj = np.nonzero(rows)
    vals = rows[ii, jj]
    out = [""] * rows.shape[0]
    if ii.size == 0:
        return out
    starts = np.searchsorted(ii, np.arange(rows.shape[0] + 1))
    jl, vl = jj.tolist(), vals.tolist()
    for r in range(rows.shape[0]):
        a, b = starts[r], starts[r + 1]
        if a != b:
            out[r] = ",".join(f"{j}:{v}" for j, v in zip(jl[a:b], vl[a:b]))
    return out


def decode_key(key: str, k: int, lam: int | None = None) -> np.ndarray:
    """Parse a canonical key back to an int32 row of length ``k``; malformed keys raise."""
    row = np.zeros(k, dtype=np.int32)
    if key == "":
        return row
    last = -1
    for part in key.split(","):
        try:
            i_s, c_s = part.split(":")
            i, c = int(i_s), int(c_s)
        except ValueError:
            raise InputError(f"bin key {key!r}: entry {part!r} is not 'index:count'") from None
        if not (0 <= i < k):
            raise InputError(f"bin key {key!r}: class index {i} outside [0, {k})")
        if i <= last:
            raise InputError(f"bin key {key!r}: indices must be strictly increasing")
        if c <= 0:
            raise InputError(f"bin key {key!r}: count {c} must be positive")
        row[i] = c
        last = i
    if lam is not None and not is_level_set(row[None, :], lam)[0]:
        raise InputError(f"bin key {key!r} is not a level set of V_{lam}^{k}")
    return row


def decode_keys(keys: Iterable[str], k: int, lam: int | None = None) -> np.ndarray:
    keys = list(keys)
    out = np.zeros((len(keys), k), dtype=np.int32)
    for r, key in enumerate(keys):
        out[r] = decode_key(key, k, lam)
    return out


# ----------------------------------------------------------------------------- hashing / index

_WEIGHT_BITS = 33
MAX_LAMBDA = 1 << 19
_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
_W: dict[int, np.ndarray] = {}


def _weights(k: int) -> np.ndarray:
    """``(k, 2)`` float64 matrix of independent random integers in ``[0, 2^33)``."""
    w = _W.get(k)
    if w is None:
        rng = np.random.Generator(np.random.PCG64(_HASH_SEED))
        w = rng.integers(0, 1 << _WEIGHT_BITS, size=(k, 2)).astype(np.float64)
        _W[k] = w
    return w


def _combine(hh: np.ndarray) -> np.ndarray:
    """Fold the two exact 53-bit hashes into one int64 key (wrapping arithmetic)."""
    a = hh[:, 0].astype(np.int64)
    b = hh[:, 1].astype(np.int64)
    with np.errstate(over="ignore"):
        return a * _MIX + b


def _rows_per_chunk(k: int) -> int:
    return max(1, (1 << 16) // max(k, 1))


def bin_counts_hashed(probs: np.ndarray, lam: int) -> tuple[np.ndarray, np.ndarray]:
    """``(c, h)``: ``bin_counts`` and the row hash of ``c`` in one fused, cache-resident pass."""
    c, h, _ = bin_rows(probs, lam)
    return c, h


def bin_rows(probs: np.ndarray, lam: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(c, h, pair)``: :func:`bin_counts_hashed` plus ``pair``, the two exact 53-bit hashes of
    every row that ``h`` folds (as :func:`scan_rows` returns them), for callers that need both
    the bins and a checked grouping of the rows (:func:`group_hashed`)."""
    u = np.atleast_2d(np.asarray(probs, dtype=np.float64))
    n, k = u.shape
    if lam > MAX_LAMBDA:
        raise InputError(f"lambda = {lam} exceeds the supported maximum {MAX_LAMBDA}")
    w = _weights(k)
    c = np.empty((n, k), dtype=np.int32)
    hh = np.empty((n, 2), dtype=np.float64)
    step = _rows_per_chunk(k)
    buf = np.empty((min(step, n), k))
    for a in range(0, n, step):
        b = min(a + step, n)
        t = floor_into(u[a:b], lam, buf[: b - a])
        c[a:b] = t
        np.dot(t, w, out=hh[a:b])
    return c, _combine(hh), hh


def scan_rows(probs: np.ndarray, lam: int):
    """One fused, cache-resident pass over probability rows, without materialising ``c``.

    Returns ``(h, pair, row_sum, row_min)``: the folded hash and the two exact 53-bit hashes of
    every row's bin ``c = lambda R(u)`` (as :func:`bin_counts_hashed`), and each row's sum and
    minimum (for validation). Reads ``probs`` once; writes O(n).
    """
    u = np.atleast_2d(np.asarray(probs, dtype=np.float64))
    n, k = u.shape
    if lam > MAX_LAMBDA:
        raise InputError(f"lambda = {lam} exceeds the supported maximum {MAX_LAMBDA}")
    w = _weights(k)
    hh = np.empty((n, 2), dtype=np.float64)
    rs = np.empty(n)
    rm = np.empty(n)
    step = _rows_per_chunk(k)
    buf = np.empty((min(step, n), k))
    for a in range(0, n, step):
        b = min(a + step, n)
        src = u[a:b]
        np.sum(src, axis=1, out=rs[a:b])
        np.min(src, axis=1, out=rm[a:b])
        t = floor_into(src, lam, buf[: b - a])
        np.dot(t, w, out=hh[a:b])
    return _combine(hh), hh, rs, rm


def run_starts(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal values of the grouped (e.g. sorted) 1-d ``keys`` starts: a
    bool mask, True at element 0 and at every element that differs from the one before. Its
    ``flatnonzero`` gives the runs' first positions (for ``np.add.reduceat``), its cumulative
    sum minus one each element's run number."""
    new = np.empty(keys.size, dtype=bool)
    new[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    return new


def pairs_agree(pair: np.ndarray, first: np.ndarray, inv: np.ndarray) -> bool:
    """Whether every row's exact hashes ``pair[i]`` equal those of its group's first row
    ``pair[first[inv[i]]]`` (the check behind :class:`HashCollision`): one gather of rows, a
    fifth of the cost of ``np.array_equal(pair[first][inv], pair)``, with the same answer.
    True at once when every row is its own group (nothing to compare)."""
    if first.size == inv.size:
        return True
    return bool((pair.take(first.take(inv), axis=0) == pair).all())


def group_hashed(h: np.ndarray, pair: np.ndarray):
    """:func:`group_rows` from the hashes of :func:`bin_rows` (no bin rows needed): returns
    ``(unique_hashes, first_index, inverse)``; rows of a group must share both exact hashes
    (checked, :class:`HashCollision` otherwise)."""
    uh, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if not pairs_agree(pair, first, inv):
        raise HashCollision("two distinct bins share a 64-bit hash")
    return uh, first, inv


def row_hash(counts: np.ndarray) -> np.ndarray:
    """Hash of integer bin rows: two exact integer dot products with random weights, folded.

    ``h_r = sum_j c_j W_rj`` with integer ``W_rj < 2^33`` is computed in float64; every partial sum
    is an integer below ``2^53`` (as ``sum c <= 2 lambda <= 2^20``), so the result is exact and
    independent of the summation order. Two distinct rows collide in one ``h_r`` with probability
    at most ``2^-33``, in both with ``2^-66``; the folded int64 key is checked against both.
    """
    c = np.atleast_2d(counts)
    n, k = c.shape
    w = _weights(k)
    hh = np.empty((n, 2), dtype=np.float64)
    step = _rows_per_chunk(k)
    for a in range(0, n, step):
        np.dot(c[a : a + step].astype(np.float64), w, out=hh[a : a + step])
    return _combine(hh)


def _pair_hash(counts: np.ndarray) -> np.ndarray:
    c = np.atleast_2d(counts)
    return np.dot(c.astype(np.float64), _weights(c.shape[1]))


class HashCollision(RuntimeError):
    """Two different bins share a hash (probability about n^2 2^-66 for n distinct bins)."""


def group_rows(counts: np.ndarray, hashes: np.ndarray | None = None, *, exact: bool = False):
    """Group identical bin rows.

    Returns ``(unique_hashes, first_index, inverse)``: ``unique_hashes`` sorted, ``first_index``
    the row holding each unique bin, ``inverse`` the group of every row. Rows of a group share both
    33-bit-weight hashes (checked); ``exact=True`` also compares the rows themselves.
    """
    c = np.atleast_2d(counts)
    h = row_hash(c) if hashes is None else hashes
    uh, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if uh.size != c.shape[0]:
        # rows sharing a folded key must agree on the pair of exact hashes (cheap: O(n))
        pair = _pair_hash(c[first])
        step = _rows_per_chunk(c.shape[1]) * 16
        for a in range(0, c.shape[0], step):
            blk = c[a : a + step]
            if not np.array_equal(_pair_hash(blk), pair[inv[a : a + step]]):
                raise HashCollision("two distinct bins share a 64-bit hash")
            if exact and not np.array_equal(blk, c[first[inv[a : a + step]]]):
                raise HashCollision("two distinct bins share a hash")
    return uh, first, inv


class BinIndex:
    """Vectorised lookup of bins in a fixed set of bins (e.g. the set B).

    ``lookup(h, pair)`` returns, for every row hash, the position of that bin in ``rows`` or -1.
    A hit is confirmed on both exact 33-bit-weight hashes (a false hit needs a simultaneous
    collision of both, probability ``2^-66`` per pair of distinct bins). Complexity: one
    ``searchsorted`` (O(n log m)) plus O(hits) checks; the hashes come from the caller's pass
    over the data (:func:`scan_rows`, :func:`bin_counts_hashed`).
    """

    __slots__ = ("_order", "_pair", "_sorted_h", "k", "rows")

    def __init__(self, rows: np.ndarray):
        rows = np.ascontiguousarray(np.atleast_2d(rows), dtype=np.int32)
        self.rows = rows
        self.k = rows.shape[1]
        pair = _pair_hash(rows) if rows.shape[0] else np.zeros((0, 2))
        h = _combine(pair) if rows.shape[0] else np.zeros(0, dtype=np.int64)
        if np.unique(h).size != h.size:
            raise InputError("BinIndex: duplicate bins (or a hash collision)")
        order = np.argsort(h, kind="stable")
        self._sorted_h = h[order]
        self._order = order
        self._pair = pair

    def __len__(self) -> int:
        return self.rows.shape[0]

    def lookup_hashed(self, h: np.ndarray, pair: np.ndarray) -> np.ndarray:
        m = self._sorted_h.size
        if m == 0:
            return np.full(h.shape[0], -1, dtype=np.int64)
        pos = np.searchsorted(self._sorted_h, h)
        np.minimum(pos, m - 1, out=pos)
        hit = self._sorted_h[pos] == h
        idx = np.where(hit, self._order[pos], -1)
        rows_hit = np.flatnonzero(hit)
        if rows_hit.size and not np.array_equal(pair[rows_hit], self._pair[idx[rows_hit]]):
            raise HashCollision("bin hash collision during lookup")
        return idx.astype(np.int64, copy=False)

    def lookup(self, counts: np.ndarray, hashes: np.ndarray | None = None) -> np.ndarray:
        c = np.atleast_2d(counts)
        if c.shape[1] != self.k:
            raise InputError(f"expected {self.k} classes, got {c.shape[1]}")
        idx = self.lookup_hashed(row_hash(c) if hashes is None else hashes, _pair_hash(c))
        hit = np.flatnonzero(idx >= 0)
        if hit.size and not (c[hit] == self.rows[idx[hit]]).all():
            raise HashCollision("bin hash collision during lookup")
        return idx
