"""Calibration metrics: the paper's lp calibration error Err_p, its debiased estimate, ECE, Brier, NLL.

lp calibration error (Bairaktari & Nguyen, Sec. 3, Definition)
----------------------------------------------------------------
For a predictor ``f`` with rounding ``R(u) = floor(u * lambda) / lambda`` and one-hot label ``y``::

    Err(f, v, j) = | E[(f(x)_j - y_j) * 1[R(f(x)) = v]] |
                 = | E[f(x)_j - y_j | R(f(x)) = v] | * P[R(f(x)) = v]
    Err_p(f)     = ( sum_{v in V_lambda^k} sum_{j=1}^k Err(f, v, j)^p )^(1/p),   Err_inf = max.

:func:`err_p` is the plug-in estimate on a sample of ``n`` pairs: the expectation becomes the
sample mean, i.e. ``Err(v, j) = |S_vj| / n`` with ``S_vj = sum_{i: R(f(x_i)) = v} (f(x_i)_j - y_ij)``.
Bins that no sample falls in contribute zero. ``p = 1`` is the paper's ECE form
``sum_v P(v) sum_j |E[f_j - y_j | v]|``; ``Err_inf <= Err_p <= Err_1`` for ``p >= 1``.

Bins are ``c = lambda * R(u)`` from :func:`lpcal.levels.bin_counts_hashed`, grouped with
:func:`lpcal.levels.group_rows` (64-bit row hash, exactly verified).

Structure (as torchmetrics' validate / update / compute): inputs are validated by
:func:`_check_inputs`, reduced to additive sufficient statistics :class:`ErrSums` (per bin: the
count and the k-vector ``S_v``), and :meth:`ErrSums.compute` evaluates Err_p. ``ErrSums`` objects
built from disjoint batches ``merge`` into the statistics of the union, so monitoring can be
streamed and windowed.

Other metrics (top-label / classwise ECE, Brier, NLL, accuracy) follow their usual definitions; see
each function. :func:`binned_sq_error` is the debiased squared l2 calibration error of binned
residual sums (with its standard error), behind :func:`top_label_ece_debiased` and
:func:`classwise_ece_debiased` and the daemon's windowed statistics. :func:`err_p_true` and
:func:`brier_true` are the true ``Err_p`` and Brier score of predictions on a synthetic family whose
conditional label distribution ``q`` is known (the simulator, the tests, the benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpcal.errors import InputError, shown
from lpcal.holdout import BinSums, merge_bin_sums
from lpcal.io import DEFAULT_TOL, validate_labels, validate_probs
from lpcal.levels import bin_counts_hashed, decode_keys, encode_keys, group_rows, row_hash
from lpcal.p_norm import parse_p

_QUAD_CHUNK = 1 << 21  # cells * nodes evaluated at once by the debiasing quadrature

# ----------------------------------------------------------------------------- validation


def _check_inputs(probs, labels, *, tol: float = DEFAULT_TOL) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``probs`` (n, k) rows on the simplex within ``tol`` and labels (n,) in ``[0, k)``."""
    x = validate_probs(probs, "probs", tol=tol)
    y = validate_labels(labels, x.shape[1], "labels", n=x.shape[0])
    return x, y


def _check_lam(lam) -> int:
    if isinstance(lam, bool) or not isinstance(lam, (int, np.integer)) or lam < 1:
        raise InputError(f"lambda must be a positive integer, got {shown(lam)}")
    return int(lam)


def _check_p(p) -> float:
    return parse_p(p, evaluate=True)  # the one statement of p's domain


def _lp_norm(values: np.ndarray, p: float) -> float:
    """``(sum |values|^p)^(1/p)`` (max for ``p = inf``), scaled by the max to avoid under/overflow."""
    a = np.abs(np.asarray(values, dtype=np.float64)).ravel()
    if a.size == 0:
        return 0.0
    m = float(a.max())
    if m == 0.0 or math.isinf(p):
        return m
    if p == 1.0:
        return float(a.sum())
    return m * float(np.sum((a / m) ** p)) ** (1.0 / p)


# ----------------------------------------------------------------------------- grouping helpers


def _reduce_groups(inv: np.ndarray, n_groups: int, values: np.ndarray) -> np.ndarray:
    """Sum the rows of ``values`` per group index ``inv`` (unbuffered ``np.add.at``)."""
    out = np.zeros((n_groups,) + values.shape[1:], dtype=np.float64)
    np.add.at(out, inv, values)
    return out


def _batch_stats(x: np.ndarray, y: np.ndarray, lam: int, *, squares: bool = False):
    """Per-bin sufficient statistics of a validated batch.

    Returns ``(rows, hashes, counts, S, Q)``: unique bin rows ``c`` (G, k), their hashes (sorted),
    sample counts (G,), ``S[g, j] = sum_{i in g} (f_ij - y_ij)`` and, if ``squares``,
    ``Q[g, j] = sum_{i in g} (f_ij - y_ij)^2`` (else ``None``).
    """
    c, h = bin_counts_hashed(x, lam)
    uh, first, inv = group_rows(c, h)
    g = uh.size
    counts = np.bincount(inv, minlength=g).astype(np.int64)
    s = _reduce_groups(inv, g, x)
    np.subtract.at(s, (inv, y), 1.0)
    q = None
    if squares:
        # (f - y)^2 = f^2 - y * (2 f - 1) for one-hot y.
        q = _reduce_groups(inv, g, x * x)
        np.subtract.at(q, (inv, y), 2.0 * x[np.arange(x.shape[0]), y] - 1.0)
    return c[first], uh, counts, s, q


# Public names for the building blocks (daemon/monitor.py uses them on validated arrays).
batch_stats = _batch_stats
lp_norm = _lp_norm


# ----------------------------------------------------------------------------- additive sums


class ErrSums(BinSums):
    """Additive sufficient statistics of Err_p: per bin ``v`` the count ``N_v`` and ``S_v``.

    ``S_v[j] = sum over samples with R(f(x)) = v of (f(x)_j - y_j)``. Then the plug-in
    ``Err(v, j) = |S_v[j]| / n`` with ``n = sum_v N_v``. Statistics of disjoint batches add, so
    ``a.merge(b)`` equals the statistics of the concatenated data (up to float rounding), and a
    sliding window is a merge of per-interval sums.

    Attributes: ``k``, ``lam``, ``rows`` (G, k) int32 bin rows ``c = lambda * v``, ``hashes`` (G,)
    int64 sorted row hashes, ``counts`` (G,) int64, ``sums`` (G, k) float64.
    """

    __slots__ = ("counts", "hashes", "k", "lam", "rows", "sums")

    def __init__(self, k: int, lam: int):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {shown(k)}")
        self.k = int(k)
        self.lam = _check_lam(lam)
        self.rows = np.zeros((0, self.k), dtype=np.int32)
        self.hashes = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.sums = np.zeros((0, self.k), dtype=np.float64)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_batch(cls, probs, labels, lam: int, *, tol: float = DEFAULT_TOL) -> ErrSums:
        """Statistics of one batch (validated)."""
        lam = _check_lam(lam)
        x, y = _check_inputs(probs, labels, tol=tol)
        out = cls(x.shape[1], lam)
        out.rows, out.hashes, out.counts, out.sums, _ = _batch_stats(x, y, lam)
        return out

    def update(self, probs, labels, *, tol: float = DEFAULT_TOL) -> ErrSums:
        """Accumulate a batch into ``self`` (in place) and return ``self``."""
        b = ErrSums.from_batch(probs, labels, self.lam, tol=tol)
        if b.k != self.k:
            raise InputError(f"probs: expected {self.k} classes, got {b.k}")
        m = self.merge(b)
        self.rows, self.hashes, self.counts, self.sums = m.rows, m.hashes, m.counts, m.sums
        return self

    def merge(self, other: ErrSums) -> ErrSums:
        """A new ``ErrSums`` holding the statistics of both operands (neither is modified)."""
        if not isinstance(other, ErrSums):
            raise TypeError(f"cannot merge ErrSums with {type(other).__name__}")
        if (other.k, other.lam) != (self.k, self.lam):
            raise InputError(
                f"cannot merge ErrSums with (k, lambda) = {(other.k, other.lam)} "
                f"into {(self.k, self.lam)}"
            )
        out = ErrSums(self.k, self.lam)
        out.rows, out.hashes, out.counts, out.sums = merge_bin_sums(self, other)
        return out

    __add__ = merge

    # -- results (n and n_bins: BinSums) ---------------------------------------------------------

    def error_matrix(self) -> np.ndarray:
        """``Err(v, j) = |S_v[j]| / n`` for every seen bin (G, k)."""
        n = self.n
        if n == 0:
            raise InputError("ErrSums: no samples accumulated")
        return np.abs(self.sums) / n

    def compute(self, p: float) -> float:
        """Plug-in ``Err_p`` of the accumulated samples (raises when empty)."""
        return _lp_norm(self.error_matrix(), _check_p(p))

    def breakdown(self, p: float) -> ErrBreakdown:
        """Err_p together with its per-bin and per-class contributions."""
        pf = _check_p(p)
        e = self.error_matrix()
        n = self.n
        if math.isinf(pf):
            per_bin = e.max(axis=1)
            per_class = e.max(axis=0)
        else:
            m = float(e.max()) if e.size else 0.0
            scaled = (e / m) ** pf if m > 0 else np.zeros_like(e)
            # contributions to Err_p^p, computed as m^p * sum (e/m)^p to stay finite
            per_bin = scaled.sum(axis=1) * (m**pf)
            per_class = scaled.sum(axis=0) * (m**pf)
        return ErrBreakdown(
            p=pf,
            lam=self.lam,
            k=self.k,
            n=n,
            value=_lp_norm(e, pf),
            keys=encode_keys(self.rows),
            mass=self.counts / n,
            error=e,
            per_bin=per_bin,
            per_class=per_class,
        )

    # -- serialisation --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form: ``{"k", "lam", "keys", "counts", "sums"}`` (keys as in bin maps)."""
        return {
            "k": self.k,
            "lam": self.lam,
            "keys": encode_keys(self.rows),
            "counts": self.counts.tolist(),
            "sums": self.sums.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ErrSums:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`."""
        try:
            out = cls(d["k"], d["lam"])
            keys, counts, sums = list(d["keys"]), d["counts"], d["sums"]
        except (KeyError, TypeError) as exc:
            raise InputError(f"ErrSums.from_dict: missing or bad field ({exc})") from None
        g = len(keys)
        rows = decode_keys(keys, out.k, out.lam)
        cnt = np.asarray(counts, dtype=np.float64).reshape(-1)
        s = np.asarray(sums, dtype=np.float64)
        if cnt.shape != (g,) or (g and s.shape != (g, out.k)) or (not g and s.size):
            raise InputError(
                f"ErrSums.from_dict: {g} keys but counts {cnt.shape} and sums {s.shape}"
            )
        if (cnt < 1).any() or (cnt != np.floor(cnt)).any():
            raise InputError("ErrSums.from_dict: counts must be positive integers")
        if not np.isfinite(s).all():
            raise InputError("ErrSums.from_dict: sums contain NaN/inf")
        h = row_hash(rows)
        if g:
            uh, _, _ = group_rows(rows, h)
            if uh.size != g:
                raise InputError("ErrSums.from_dict: duplicate bin keys")
            order = np.argsort(h)
            rows, h, cnt, s = rows[order], h[order], cnt[order], s[order]
        out.rows, out.hashes = rows, h
        out.counts, out.sums = cnt.astype(np.int64), s.reshape(g, out.k)
        return out

    def __repr__(self) -> str:
        return f"ErrSums(k={self.k}, lam={self.lam}, n={self.n}, n_bins={self.n_bins})"


@dataclass(frozen=True)
class ErrBreakdown:
    """Err_p with its pieces (plug-in estimate).

    * ``keys[g]``, ``mass[g] = P(v_g)``, ``error[g, j] = Err(v_g, j)`` for every seen bin ``v_g``.
    * ``per_bin[g] = sum_j Err(v_g, j)^p`` and ``per_class[j] = sum_v Err(v, j)^p``: additive
      contributions to ``value^p`` (for ``p = inf`` the maxima instead, and ``value`` is their max).
    """

    p: float
    lam: int
    k: int
    n: int
    value: float
    keys: list[str]
    mass: np.ndarray
    error: np.ndarray
    per_bin: np.ndarray
    per_class: np.ndarray

    def top_bins(self, m: int = 10) -> list[tuple[str, float, float]]:
        """The ``m`` bins contributing most: ``(key, mass, contribution)``, largest first."""
        order = np.argsort(-self.per_bin, kind="stable")[: max(0, int(m))]
        return [(self.keys[g], float(self.mass[g]), float(self.per_bin[g])) for g in order]


# ----------------------------------------------------------------------------- Err_p


def err_p(probs, labels, lam: int, p: float, *, tol: float = DEFAULT_TOL) -> float:
    """Plug-in lp calibration error ``Err_p`` of the sample (paper, Sec. 3; see module docstring).

    Parameters
    ----------
    probs : array_like, shape (n, k)
        Predicted probabilities, rows on the simplex within ``tol``.
    labels : array_like, shape (n,)
        Observed classes in ``[0, k)``.
    lam : int
        The discretisation lambda of the rounding ``R`` (level sets of width ``1/lam``).
    p : float
        In ``[1, inf]``.
    tol : float
        Allowed deviation of a row sum from 1.

    Returns
    -------
    float
        ``(sum_v sum_j |mean((f_j - y_j) 1[R(f) = v])|^p)^(1/p)`` over the sample.

    Raises
    ------
    InputError
        Bad probabilities or labels (naming the first bad row), ``lam < 1`` or ``p < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.metrics import err_p
    >>> probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.2, 0.8]])
    >>> round(err_p(probs, np.array([0, 1, 1]), lam=10, p=float("inf")), 4)  # |0.9+0.9-1| / 3
    0.2667
    """
    pf = _check_p(p)
    return ErrSums.from_batch(probs, labels, lam, tol=tol).compute(pf)


def err_p_breakdown(probs, labels, lam: int, p: float, *, tol: float = DEFAULT_TOL) -> ErrBreakdown:
    """:func:`err_p` with per-bin (key, mass, error vector) and per-class contributions."""
    pf = _check_p(p)
    return ErrSums.from_batch(probs, labels, lam, tol=tol).breakdown(pf)


def err_p_debiased(
    probs, labels, lam: int, p: float, *, tol: float = DEFAULT_TOL, quad_nodes: int = 48
) -> float:
    """DEBIASED estimate of ``Err_p`` (not the plug-in value; can be smaller, and is >= 0).

    The plug-in ``|mean|`` overestimates ``Err(v, j) = |mu_vj|`` by sampling noise: with
    ``Z_i = (f(x_i)_j - y_ij) * 1[R(f(x_i)) = v]`` and ``mu_vj = E[Z]``, the plug-in is
    ``|Zbar|`` and ``E|Zbar|^p > |mu|^p`` when ``mu`` is small. Per cell ``(v, j)`` this function
    applies the first-order (parametric bootstrap) bias correction under the normal approximation
    ``Zbar ~ N(mu, s^2)``, ``s^2 = Var(Z) / n`` with the unbiased sample variance (over all ``n``
    samples, zeros outside the bin)::

        T_vj = |Zbar|^p - (E_xi |Zbar + s xi|^p - |Zbar|^p) = 2 |Zbar|^p - E_xi |Zbar + s xi|^p,

    ``xi ~ N(0, 1)``, evaluated by ``quad_nodes``-point Gauss-Hermite quadrature. It then returns
    ``max(0, sum_vj T_vj)^(1/p)``; cells are not clipped individually, so the sum stays unbiased
    where ``T`` is.

    * ``p = 2``: ``T_vj = Zbar^2 - s^2 = (S_vj^2 - Q_vj) / (n (n - 1))`` exactly (``S`` the sum
      and ``Q`` the sum of squares of ``Z``), the U-statistic ``mean_{i != i'} Z_i Z_i'``, an
      *unbiased* estimator of ``Err(v, j)^2``. So the squared result is unbiased for ``Err_2^2``
      (before the clip at 0); the square root itself is biased slightly low.
    * other finite ``p``: removes the first-order bias of ``|Zbar|^p``; approximate.
    * ``p = inf``: ``max_vj max(0, 2|Zbar| - E|Zbar + s xi|)`` (the ``p = 1`` correction per
      cell); it does not correct the upward selection bias of the max over cells.

    Needs ``n >= 2``. Bins with no sample contribute nothing (their ``Z`` is identically 0).
    """
    pf = _check_p(p)
    lam = _check_lam(lam)
    x, y = _check_inputs(probs, labels, tol=tol)
    n = x.shape[0]
    if n < 2:
        raise InputError(f"err_p_debiased needs at least 2 samples, got {n}")
    if not (isinstance(quad_nodes, (int, np.integer)) and quad_nodes >= 2):
        raise InputError(f"quad_nodes must be an integer >= 2, got {shown(quad_nodes)}")
    _, _, _, s, q = _batch_stats(x, y, lam, squares=True)
    s = s.ravel()
    q = q.ravel()
    zbar = s / n
    var = np.maximum(q - s * s / n, 0.0) / (n - 1)  # unbiased variance of Z; clip rounding
    se = np.sqrt(var / n)
    if pf == 2.0:  # closed form of the quadrature below: E(Zbar + s xi)^2 = Zbar^2 + s^2
        return max(0.0, float(np.sum(zbar * zbar - se * se))) ** 0.5
    pq = 1.0 if math.isinf(pf) else pf
    nodes, weights = np.polynomial.hermite.hermgauss(int(quad_nodes))
    nodes = nodes * math.sqrt(2.0)
    weights = weights / math.sqrt(math.pi)
    t = np.empty_like(zbar)
    step = max(1, _QUAD_CHUNK // nodes.size)
    for a in range(0, zbar.size, step):
        zb, sd = zbar[a : a + step], se[a : a + step]
        moment = np.abs(zb[:, None] + sd[:, None] * nodes[None, :]) ** pq @ weights
        t[a : a + step] = 2.0 * np.abs(zb) ** pq - moment
    if math.isinf(pf):
        return float(max(0.0, t.max()))
    total = float(t.sum())
    return max(0.0, total) ** (1.0 / pf)



# ----------------------------------------------------------------------------- known truth


def _check_truth(h, q, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``h`` and ``q`` as float64 (n, k) arrays of one shape, non-empty and finite."""
    h = np.atleast_2d(np.asarray(h, dtype=np.float64))
    q = np.atleast_2d(np.asarray(q, dtype=np.float64))
    if h.ndim != 2 or h.shape != q.shape or h.shape[0] == 0:
        raise InputError(f"{where}: h {h.shape} and q {q.shape} must be 2-D arrays of one shape, "
                         "non-empty")
    if not (np.isfinite(h).all() and np.isfinite(q).all()):
        raise InputError(f"{where}: h and q must be finite")
    return h, q


def err_p_true(h, q, lam: int, p: float) -> float:
    """The TRUE lp calibration error of predictions ``h`` whose true label distributions ``q``
    are known (a synthetic family), instead of observed labels.

    ``Err(h, v, j) = |E[(h_j - q_j) 1[R(h) = v]]|`` over the level sets ``v`` of ``h`` (bins of
    ``lambda * R(h)``), the expectation taken over the rows given: as :func:`err_p` with each
    one-hot label replaced by its conditional distribution ``q``, so there is no label noise and
    the result converges to the population ``Err_p`` as rows are added.

    Parameters
    ----------
    h : array_like, shape (n, k)
        Predictions (calibrated or not) of ``n`` inputs.
    q : array_like, shape (n, k)
        The true conditional label distribution of each input, ``P(y = j | x_i)``.
    lam : int
        The discretisation lambda of the rounding ``R``.
    p : float
        In ``[1, inf]``.

    Returns
    -------
    float
        ``(sum_{v,j} Err(h, v, j)^p)^(1/p)``, or the max over cells for ``p = inf``.

    Raises
    ------
    InputError
        ``h`` and ``q`` of different shapes, empty or not finite; ``lam < 1`` or ``p < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.metrics import err_p_true
    >>> q = np.array([[0.7, 0.3], [0.7, 0.3]])
    >>> err_p_true(q, q, lam=10, p=2.0)  # the true conditionals are calibrated
    0.0
    >>> round(err_p_true(np.array([[0.9, 0.1], [0.9, 0.1]]), q, lam=10, p=np.inf), 3)
    0.2
    """
    pf = _check_p(p)
    lam = _check_lam(lam)
    h, q = _check_truth(h, q, "err_p_true")
    c, hashes = bin_counts_hashed(h, lam)
    uh, _, inv = group_rows(c, hashes)
    d = _reduce_groups(inv, uh.size, h - q)
    return _lp_norm(d / h.shape[0], pf)


def brier_true(h, q) -> float:
    """The TRUE Brier score of predictions ``h`` whose true label distributions ``q`` are known:
    ``E_{y ~ q}[sum_j (h_j - y_j)^2] = mean_i (|h_i|^2 - 2 <h_i, q_i> + 1)``.

    Parameters
    ----------
    h, q : array_like, shape (n, k)
        Predictions and the true conditional label distribution of each input.

    Returns
    -------
    float
        In ``[0, 2]`` for probability rows; :func:`brier` on labels drawn from ``q`` converges
        to it.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.metrics import brier_true
    >>> q = np.array([[0.5, 0.5]])
    >>> brier_true(q, q), brier_true(np.array([[1.0, 0.0]]), q)
    (0.5, 1.0)
    """
    h, q = _check_truth(h, q, "brier_true")
    return float(np.mean(np.einsum("ij,ij->i", h, h) - 2.0 * np.einsum("ij,ij->i", h, q) + 1.0))


# ----------------------------------------------------------------------------- ECE family


def _bin_index(scores: np.ndarray, n_bins: int, binning: str) -> np.ndarray:
    """Bin of every score. Bins are right-closed ``(e_b, e_{b+1}]`` (the first also holds ``e_0``).

    ``"width"``: edges ``0, 1/B, ..., 1``. ``"mass"``: edges at the empirical quantiles
    ``b/B`` of ``scores`` (``np.quantile``, linear), so ties share a bin and bins may be empty.
    """
    if binning == "width":
        inner = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    elif binning == "mass":
        inner = np.quantile(scores, np.linspace(0.0, 1.0, n_bins + 1)[1:-1])
    else:
        raise InputError(f"binning must be 'width' or 'mass', got {binning!r}")
    return np.searchsorted(inner, scores, side="left")


def _check_bins(n_bins) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise InputError(f"n_bins must be a positive integer, got {shown(n_bins)}")
    return int(n_bins)


def _binned_gap(scores: np.ndarray, hits: np.ndarray, n_bins: int, binning: str) -> float:
    """``sum_b (n_b / n) |mean_b(hits) - mean_b(scores)| = sum_b |sum_{i in b}(hits - scores)| / n``."""
    idx = _bin_index(scores, n_bins, binning)
    gap = np.bincount(idx, weights=hits - scores, minlength=n_bins)
    return float(np.abs(gap).sum() / scores.size)


def top_label_ece(
    probs, labels, *, n_bins: int = 15, binning: str = "width", tol: float = DEFAULT_TOL
) -> float:
    """Top-label ECE (Guo et al. 2017): ``sum_b (n_b / n) |acc_b - conf_b|``.

    Confidence is ``max_j f_j``, correctness ``argmax_j f_j == y`` (ties: lowest index).
    ``binning="width"``: ``n_bins`` equal-width bins of [0, 1]; ``"mass"``: equal-mass bins
    (edges at confidence quantiles). Bins are right-closed, see :func:`_bin_index`.
    """
    nb = _check_bins(n_bins)
    x, y = _check_inputs(probs, labels, tol=tol)
    pred = x.argmax(axis=1)
    conf = x[np.arange(x.shape[0]), pred]
    return _binned_gap(conf, (pred == y).astype(np.float64), nb, binning)


def classwise_ece(
    probs, labels, *, n_bins: int = 15, binning: str = "width", tol: float = DEFAULT_TOL
) -> float:
    """Classwise ECE (Kull et al. 2019): ``(1/k) sum_j sum_b (n_jb / n) |mean_b(y_j) - mean_b(f_j)|``.

    Each class ``j`` bins the scores ``f_j`` separately (equal width or equal mass).
    """
    nb = _check_bins(n_bins)
    x, y = _check_inputs(probs, labels, tol=tol)
    n, k = x.shape
    if binning != "width":  # per-class quantile edges: loop over classes, vectorised over samples
        total = 0.0
        for j in range(k):
            total += _binned_gap(x[:, j], (y == j).astype(np.float64), nb, binning)
        return total / k
    # equal width: all classes at once, cell (j, b) -> j * n_bins + b, in row chunks
    gap = np.zeros(k * nb)
    offset = np.arange(k) * nb
    step = max(1, _QUAD_CHUNK // k)
    for a in range(0, n, step):
        blk = x[a : a + step]
        cell = (_bin_index(blk, nb, "width") + offset).ravel()
        gap -= np.bincount(cell, weights=blk.ravel(), minlength=k * nb)
        rows = np.arange(blk.shape[0])
        hit_cell = cell.reshape(blk.shape)[rows, y[a : a + step]]
        gap += np.bincount(hit_cell, minlength=k * nb)
    return float(np.abs(gap).sum() / n / k)


@dataclass(frozen=True)
class Estimate:
    """An estimate and its standard error (plain floats)."""

    value: float
    stderr: float


def binned_sq_error(counts, s, q, n: int) -> Estimate:
    """DEBIASED squared l2 calibration error of binned residuals, and its standard error.

    Per bin ``b`` (any array shape; ``counts``, ``s``, ``q`` broadcast together) the residuals
    ``r_i`` of its ``n_b`` samples (``hit - confidence`` for top-label ECE, ``y_j - f_j`` for
    classwise ECE, ``f_j - y_j`` for a level set's class ``j``) have sum ``S_b`` and sum of
    squares ``Q_b``. The plug-in squared error ``sum_b (n_b / n) (S_b / n_b)^2`` overestimates
    ``sum_b (n_b / n) mu_b^2`` by the sampling-noise term ``sum_b sigma_b^2 / n`` (Kumar et al.
    2019; T-Cal, Lee et al. 2022). Subtracting the unbiased within-bin variance
    ``s_b^2 = (Q_b - S_b^2 / n_b) / (n_b - 1)`` gives the U-statistic::

        T_b = (n_b / n) (S_b^2 - Q_b) / (n_b (n_b - 1)) = (S_b^2 - Q_b) / (n (n_b - 1)),

    unbiased for ``(n_b / n) mu_b^2`` given ``n_b >= 2`` (bins with fewer samples count 0). The
    value is ``sum_b T_b`` (can be slightly negative under perfect calibration). Its variance,
    from the U-statistic's Hoeffding decomposition with plug-in moments::

        Var T_b ~ (n_b / n)^2 (4 mu_b^2 sigma_b^2 / n_b + 2 sigma_b^4 / (n_b (n_b - 1))),

    with ``mu_b^2 -> max(0, T_b n / n_b)`` and ``sigma_b^2 -> s_b^2``; ``stderr`` is the square
    root of the sum over bins (bin counts taken as fixed). Both plug-ins are biased up in small
    bins, so ``stderr`` errs on the large side (about 1.4 times the spread over draws for a
    calibrated predictor with ~30 samples per bin; tests/test_metrics.py). Pure; vectorized.
    """
    nb = np.asarray(counts, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if n <= 0:
        return Estimate(0.0, 0.0)
    nb, s, q = np.broadcast_arrays(nb, s, q)
    ok = nb >= 2
    nb, s, q = nb[ok], s[ok], q[ok]
    if nb.size == 0:
        return Estimate(0.0, 0.0)
    var = np.maximum(q - s * s / nb, 0.0) / (nb - 1.0)
    mu2 = (s * s - q) / (nb * (nb - 1.0))
    t = mu2 * nb / n
    w = nb / n
    v = w * w * (4.0 * np.maximum(mu2, 0.0) * var / nb + 2.0 * var * var / (nb * (nb - 1.0)))
    return Estimate(float(t.sum()), float(math.sqrt(float(v.sum()))))


def l2_of_squared(est: Estimate) -> Estimate:
    """The l2 error ``sqrt(max(0, T))`` of a squared-error :class:`Estimate`, with the
    delta-method standard error ``se_T / (2 sqrt(T))``, or ``sqrt(se_T)`` (the noise scale of
    the root) where ``T`` is within one standard error of 0."""
    t, se = est.value, est.stderr
    if t > se and t > 0.0:
        return Estimate(math.sqrt(t), se / (2.0 * math.sqrt(t)))
    return Estimate(math.sqrt(max(t, 0.0)), math.sqrt(se))


def top_label_bin_sums(probs, labels, *, n_bins: int = 15, tol: float = DEFAULT_TOL):
    """``(counts, S, Q)`` per equal-width confidence bin of the top-label residual
    ``1[argmax f = y] - max f`` (bins as :func:`top_label_ece`)."""
    nb = _check_bins(n_bins)
    x, y = _check_inputs(probs, labels, tol=tol)
    pred = x.argmax(axis=1)
    conf = x[np.arange(x.shape[0]), pred]
    r = (pred == y) - conf
    idx = _bin_index(conf, nb, "width")
    return (np.bincount(idx, minlength=nb), np.bincount(idx, weights=r, minlength=nb),
            np.bincount(idx, weights=r * r, minlength=nb))


def classwise_bin_sums(probs, labels, *, n_bins: int = 15, tol: float = DEFAULT_TOL):
    """``(counts, S, Q)``, each (k, n_bins): per class ``j`` and equal-width bin of ``f_j``, the
    residual ``1[y = j] - f_j`` (bins as :func:`classwise_ece`)."""
    nb = _check_bins(n_bins)
    x, y = _check_inputs(probs, labels, tol=tol)
    n, k = x.shape
    cell = (_bin_index(x, nb, "width") + np.arange(k) * nb).ravel()
    hit = cell.reshape(n, k)[np.arange(n), y]
    r = -x.ravel()
    cnt = np.bincount(cell, minlength=k * nb)
    s = np.bincount(cell, weights=r, minlength=k * nb) + np.bincount(hit, minlength=k * nb)
    # (1 - f)^2 - f^2 = 1 - 2 f on the true class' cell
    qq = np.bincount(cell, weights=r * r, minlength=k * nb)
    qq += np.bincount(hit, weights=1.0 - 2.0 * x[np.arange(n), y], minlength=k * nb)
    return cnt.reshape(k, nb), s.reshape(k, nb), qq.reshape(k, nb)


def top_label_ece_debiased(probs, labels, *, n_bins: int = 15,
                           tol: float = DEFAULT_TOL) -> Estimate:
    """DEBIASED l2 top-label ECE ``sqrt(sum_b (n_b / n) (acc_b - conf_b)^2)`` (T-Cal's
    quantity, equal-width bins) with its standard error; see :func:`binned_sq_error`."""
    c, s, q = top_label_bin_sums(probs, labels, n_bins=n_bins, tol=tol)
    return l2_of_squared(binned_sq_error(c, s, q, int(c.sum())))


def classwise_ece_debiased(probs, labels, *, n_bins: int = 15,
                           tol: float = DEFAULT_TOL) -> Estimate:
    """DEBIASED l2 classwise ECE ``sqrt((1/k) sum_j sum_b (n_jb / n) (mean_b y_j -
    mean_b f_j)^2)`` with its standard error; see :func:`binned_sq_error`."""
    c, s, q = classwise_bin_sums(probs, labels, n_bins=n_bins, tol=tol)
    k = c.shape[0]
    e = binned_sq_error(c, s, q, int(c[0].sum()))
    return l2_of_squared(Estimate(e.value / k, e.stderr / k))


def brier(probs, labels, *, tol: float = DEFAULT_TOL) -> float:
    """Multiclass Brier score ``mean_i sum_j (f_ij - y_ij)^2`` (in [0, 2])."""
    x, y = _check_inputs(probs, labels, tol=tol)
    fy = x[np.arange(x.shape[0]), y]
    return float(np.mean(np.einsum("ij,ij->i", x, x) - 2.0 * fy + 1.0))


def nll(probs, labels, *, clip: float = 1e-12, tol: float = DEFAULT_TOL) -> float:
    """Negative log-likelihood ``-mean_i log f_{i, y_i}`` in nats.

    The true-class probability is clipped to ``[clip, 1]`` before the log, so a zero probability on
    the observed class costs ``-log(clip)`` (27.6 nats for the default ``1e-12``) instead of inf.
    """
    if not (0.0 < clip < 1.0):
        raise InputError(f"clip must lie in (0, 1), got {shown(clip)}")
    x, y = _check_inputs(probs, labels, tol=tol)
    fy = np.clip(x[np.arange(x.shape[0]), y], clip, 1.0)
    return float(-np.mean(np.log(fy)))


def accuracy(probs, labels, *, tol: float = DEFAULT_TOL) -> float:
    """Fraction of samples with ``argmax_j f_j == y`` (ties: lowest index)."""
    x, y = _check_inputs(probs, labels, tol=tol)
    return float(np.mean(x.argmax(axis=1) == y))


def summary(
    probs, labels, lam: int, p: float, *, n_bins: int = 15, tol: float = DEFAULT_TOL
) -> dict[str, float | int]:
    """All metrics at once (JSON-safe numbers), e.g. for a CLI report."""
    return {
        "n": int(np.asarray(labels).shape[0]),
        "err_p": err_p(probs, labels, lam, p, tol=tol),
        "err_p_debiased": err_p_debiased(probs, labels, lam, p, tol=tol),
        "top_label_ece": top_label_ece(probs, labels, n_bins=n_bins, tol=tol),
        "top_label_ece_mass": top_label_ece(probs, labels, n_bins=n_bins, binning="mass", tol=tol),
        "classwise_ece": classwise_ece(probs, labels, n_bins=n_bins, tol=tol),
        "brier": brier(probs, labels, tol=tol),
        "nll": nll(probs, labels, tol=tol),
        "accuracy": accuracy(probs, labels, tol=tol),
    }
