"""Held-out statistics: additive per-bin sums from which any candidate calibrator is evaluated.

A candidate that lpcal may publish is, on every bin ``v`` of a predictor ``g`` (``R(g(x)) = v``),
either **constant** (``h(x) = c_v``: the group prediction of Algorithm 2 for ``v in B``) or the
**identity** (``h(x) = g(x)``: outside ``B``, or the pre-calibrator alone). Its residuals
``h(x) - y`` on a held-out sample are therefore determined by four per-bin sums of ``g``::

    N_v           samples in bin v
    Y_v[j]        samples in bin v with label j
    G_v[j]        sum of g(x)_j over bin v
    Q_v[j]        sum of (g(x)_j - y_j)^2 over bin v

* identity on ``v``: level set ``v``; ``S = G_v - Y_v`` (sum of residuals), squares ``Q_v``;
* constant ``c`` on ``v``: level set ``R(c)``; ``S = N_v c - Y_v``, squares
  ``N_v c^2 - 2 c Y_v + Y_v`` (one-hot ``y``).

:meth:`HoldoutSums.cells` sums these per level set of ``h``, which gives the sufficient
statistics of ``Err_p(h)`` on ``h``'s own level sets (and of its Brier score) without keeping any
sample. Like the pools, the sums of disjoint batches add (:meth:`HoldoutSums.merge`), so a
held-out share can be streamed, checkpointed and combined across replicas.

The sums are int64: ``Y`` exactly, ``G`` and ``Q`` in fixed point (:data:`SCALE` units per unit,
each term rounded), so addition is exact and associative and the sums (hence a certificate) are
bit-identical however the samples were batched or merged. Rounding costs at most ``2^-33`` per
sample and class; up to ``2^31`` samples per bin fit.

Memory: ``3k + 1`` int64 per observed bin. Complexity: ``O(n k)`` per update, ``O(G k log G)``
per merge or evaluation over ``G`` bins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lpcal.errors import InputError
from lpcal.levels import bin_counts, bin_rows, decode_keys, encode_keys, group_rows, row_hash

__all__ = ["SCALE", "BinSums", "Cells", "HoldoutSums", "group_sum", "merge_bin_sums"]

#: Fixed-point units per unit of the ``G`` and ``Q`` sums.
SCALE = float(1 << 32)


def group_sum(inv: np.ndarray, n_groups: int, values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` summed per group ``inv`` (every group in ``range(n_groups)`` present):
    one stable sort and ``np.add.reduceat``, ``O(n log n + n m)``; several times faster than the
    unbuffered ``np.add.at`` on wide rows, and exact for integers."""
    order = np.argsort(inv, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(inv[order]) != 0])
    out = np.add.reduceat(values[order], starts, axis=0)
    if out.shape[0] != n_groups:
        raise ValueError(f"group_sum: {out.shape[0]} groups present, {n_groups} expected")
    return out


def merge_bin_sums(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The per-bin statistics of two operands with attributes ``rows``, ``hashes`` (sorted),
    ``counts`` and ``sums``, summed per bin: new ``(rows, hashes, counts, sums)`` arrays, one row
    per distinct bin (``sums`` keeps its dtype). ``O(B log B)`` for ``B`` bins in all (one sort,
    checked on the exact rows); an empty operand costs a copy."""
    if not (a.hashes.size and b.hashes.size):
        src = b if not a.hashes.size else a
        return src.rows.copy(), src.hashes.copy(), src.counts.copy(), src.sums.copy()
    rows = np.concatenate([a.rows, b.rows])
    uh, first, inv = group_rows(rows, np.concatenate([a.hashes, b.hashes]))
    counts = np.bincount(inv, weights=np.concatenate([a.counts, b.counts]),
                         minlength=uh.size).astype(np.int64)
    sums = group_sum(inv, uh.size, np.concatenate([a.sums, b.sums]))
    return rows[first], uh, counts, sums


class BinSums:
    """Base of per-bin additive statistics (``ErrSums``, :class:`HoldoutSums`): attributes
    ``rows``, ``hashes`` (sorted), ``counts``, ``sums``; merging is :func:`merge_bin_sums`."""

    __slots__ = ()

    @property
    def n(self) -> int:
        """Number of samples accumulated."""
        return int(self.counts.sum())

    @property
    def n_bins(self) -> int:
        """Number of distinct bins seen."""
        return int(self.hashes.size)


class Cells:
    """Per level set ``u`` of a candidate ``h``: ``counts[u]`` samples, ``S[u, j] = sum (h_j -
    y_j)`` and ``Q[u, j] = sum (h_j - y_j)^2`` over them; ``n`` held-out samples in all (the input
    of :mod:`lpcal.certificate`)."""

    __slots__ = ("Q", "S", "counts", "n", "rows")

    def __init__(self, rows: np.ndarray, counts: np.ndarray, S: np.ndarray, Q: np.ndarray,
                 n: int):
        self.rows, self.counts, self.S, self.Q, self.n = rows, counts, S, Q, int(n)

    @property
    def brier(self) -> float:
        """Held-out Brier score ``mean ||h(x) - y||^2``."""
        return float(self.Q.sum() / self.n) if self.n else float("nan")


class HoldoutSums(BinSums):
    """Per-bin sums ``N, Y, G, Q`` of a predictor on held-out samples (module docstring).

    Attributes: ``k``, ``lam``, ``rows`` (B, k) int32 bins ``lambda R(g)``, ``hashes`` (B,) sorted
    int64 row hashes, ``counts`` (B,) int64 and ``sums`` (B, 3k) int64 = ``[Y | G | Q]``, ``G`` and
    ``Q`` in units of ``1 / SCALE``.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.holdout import HoldoutSums
    >>> g = np.array([[0.95, 0.05], [0.91, 0.09], [0.3, 0.7]])
    >>> h = HoldoutSums(2, 10).update(g, np.array([0, 1, 1]))
    >>> h.n, h.n_bins
    (3, 2)
    >>> round(h.cells().brier, 4)      # the identity candidate: Brier of g itself
    0.6137
    """

    __slots__ = ("counts", "hashes", "k", "lam", "rows", "sums")

    def __init__(self, k: int, lam: int):
        if k < 2 or lam < 1:
            raise InputError(f"HoldoutSums needs k >= 2 and lambda >= 1, got k={k}, lambda={lam}")
        self.k, self.lam = int(k), int(lam)
        self.rows = np.zeros((0, self.k), dtype=np.int32)
        self.hashes = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.sums = np.zeros((0, 3 * self.k), dtype=np.int64)

    # ------------------------------------------------------------------ accumulate
    def update(self, probs: np.ndarray, labels: np.ndarray) -> HoldoutSums:
        """Add validated rows ``probs`` (n, k) of the predictor with labels (n,); returns self."""
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != self.k or y.shape != (x.shape[0],):
            raise InputError(f"HoldoutSums.update: expected probs (n, {self.k}) and labels "
                             f"(n,), got {x.shape} and {y.shape}")
        n = x.shape[0]
        if n == 0:
            return self
        c, h, _ = bin_rows(x, self.lam)
        uh, first, inv = group_rows(c, h)
        k = self.k
        per = np.zeros((n, 3 * k), dtype=np.int64)
        per[np.arange(n), y] = 1
        per[:, k:2 * k] = np.rint(x * SCALE)
        r = x.copy()
        r[np.arange(n), y] -= 1.0
        per[:, 2 * k:] = np.rint(r * r * SCALE)
        sums = group_sum(inv, uh.size, per)
        other = HoldoutSums(k, self.lam)
        other.rows, other.hashes = c[first], uh
        other.counts = np.bincount(inv, minlength=uh.size).astype(np.int64)
        other.sums = sums
        self._assign(self.merge(other))
        return self

    def _assign(self, o: HoldoutSums) -> None:
        self.rows, self.hashes, self.counts, self.sums = o.rows, o.hashes, o.counts, o.sums

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (``28 k + 16`` per bin: row, ``[Y | G | Q]``, hash and count)."""
        return self.rows.nbytes + self.hashes.nbytes + self.counts.nbytes + self.sums.nbytes

    def merge(self, other: HoldoutSums) -> HoldoutSums:
        """A new object holding the sums of both operands (neither is modified)."""
        if (other.k, other.lam) != (self.k, self.lam):
            raise InputError(f"cannot merge HoldoutSums with (k, lambda) = "
                             f"{(other.k, other.lam)} into {(self.k, self.lam)}")
        out = HoldoutSums(self.k, self.lam)
        out.rows, out.hashes, out.counts, out.sums = merge_bin_sums(self, other)
        return out

    __add__ = merge

    # ------------------------------------------------------------------ evaluate
    def cells(self, bin_hashes: np.ndarray | None = None,
              bin_preds: np.ndarray | None = None) -> Cells:
        """Level-set sums of the candidate that is constant ``bin_preds[i]`` on the bin with hash
        ``bin_hashes[i]`` and the identity on every other bin (no arguments: the identity)."""
        k = self.k
        Y = self.sums[:, :k].astype(np.float64)
        G = self.sums[:, k:2 * k] / SCALE
        Q = self.sums[:, 2 * k:] / SCALE
        S = G - Y
        Qc = Q.copy()
        level = self.rows
        if bin_hashes is not None and len(bin_hashes) and self.n_bins:
            bh = np.asarray(bin_hashes, dtype=np.int64)
            order = np.argsort(bh)
            pos = np.searchsorted(bh[order], self.hashes)
            pos = np.minimum(pos, bh.size - 1)
            hit = bh[order][pos] == self.hashes
            if hit.any():
                c = np.asarray(bin_preds, dtype=np.float64)[order][pos[hit]]
                nv = self.counts[hit].astype(np.float64)[:, None]
                S = S.copy()
                S[hit] = nv * c - Y[hit]
                Qc[hit] = nv * c * c - 2.0 * c * Y[hit] + Y[hit]
                level = level.copy()
                level[hit] = bin_counts(c, self.lam)
        if not self.n_bins:
            return Cells(level, self.counts, S, Qc, 0)
        uh, first, inv = group_rows(level, row_hash(level))
        s_u = group_sum(inv, uh.size, S)
        q_u = group_sum(inv, uh.size, Qc)
        n_u = np.bincount(inv, weights=self.counts, minlength=uh.size).astype(np.int64)
        return Cells(level[first], n_u, s_u, q_u, self.n)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "lam": self.lam, "keys": encode_keys(self.rows),
                "counts": self.counts.tolist(), "sums": self.sums.tolist()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "holdout") -> HoldoutSums:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError` naming it."""
        try:
            out = cls(int(d["k"]), int(d["lam"]))
            keys = list(d["keys"])
            cnt = np.asarray(d["counts"], dtype=np.float64).reshape(-1)
            sums = np.asarray(d["sums"], dtype=np.int64)
            rows = decode_keys(keys, out.k, out.lam)
        except (KeyError, TypeError, ValueError, OverflowError, InputError) as e:
            raise InputError(f"{where}: malformed held-out sums ({e})") from None
        g = len(keys)
        if cnt.shape != (g,) or sums.size != g * 3 * out.k:
            raise InputError(f"{where}: {g} keys but counts {cnt.shape} and sums {sums.shape}")
        if g and ((cnt < 1).any() or (cnt != np.floor(cnt)).any() or (sums < 0).any()):
            raise InputError(f"{where}: counts must be positive integers and sums >= 0")
        sums = sums.reshape(g, 3 * out.k)
        if g:
            h = row_hash(rows)
            order = np.argsort(h)
            if np.unique(h).size != g:
                raise InputError(f"{where}: duplicate bin keys")
            out.rows, out.hashes = rows[order], h[order]
            out.counts, out.sums = cnt[order].astype(np.int64), sums[order]
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HoldoutSums):
            return NotImplemented
        return ((self.k, self.lam) == (other.k, other.lam)
                and np.array_equal(self.hashes, other.hashes)
                and np.array_equal(self.counts, other.counts)
                and np.array_equal(self.sums, other.sums))

    def __repr__(self) -> str:
        return f"HoldoutSums(k={self.k}, lam={self.lam}, n={self.n}, n_bins={self.n_bins})"
