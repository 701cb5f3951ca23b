"""When has the warm-up determined the temperature? A sandwich interval for ``log T`` from sums.

Temperature scaling maps ``f`` to ``softmax(z / T)`` with ``z = log f``. Write ``theta = ln T``
and ``b = exp(-theta) = 1/T``. Sample ``i``'s negative log-likelihood and its first two
derivatives in ``theta`` are, with ``q = softmax(b z_i)`` and moments of ``z_i`` under ``q``::

    l_i(theta)   = logsumexp(b z_i) - b z_{i, y_i}
    s_i(theta)   = dl_i/dtheta   = -b (E_q[z_i] - z_{i, y_i})                 (the score)
    h_i(theta)   = d2l_i/dtheta2 =  b^2 Var_q[z_i] + b (E_q[z_i] - z_{i, y_i})

The fitted ``theta_hat`` minimises ``sum_i l_i`` (plus the prior of
:mod:`lpcal.precalibrate`), an M-estimator, so whatever the true law of the labels (temperature
scaling is a one-parameter model and rarely exactly right) its standard error is the
**sandwich** (Huber 1967; White 1982)::

    se(theta_hat) = sqrt(K) / J,    J = sum_i h_i(theta_hat) + prior'',   K = sum_i s_i(theta_hat)^2

(``K`` is the empirical variance of the score: its mean ``sum_i s_i / n`` is 0 at the
likelihood's minimum, up to the prior's pull). Under a well-specified model ``K ~ J`` and this
is the usual ``1 / sqrt(Fisher information)``; when the model is wrong for the data ``K``
exceeds ``J`` and the interval widens accordingly, which is the point: a hard model must
warm up longer. The warm-up is **determined** when the two-sided ``1 - alpha`` interval
``theta_hat +- z_{1 - alpha/2} se`` has half-width at most ``tol`` (a relative error of about
``tol`` on ``T``), the fit is not at an end of the grid, and at least ``min_samples`` samples
were summed (the normal approximation needs a few hundred).

Why this rule: temperature scaling's quality on held-out data is a smooth function of
``theta`` with its optimum at the population ``theta*``; once the interval is narrow, a longer
warm-up moves the fitted ``T`` by less than ``tol`` and buys nothing. A fixed count (10,000 in
the daemon's earlier schedule) is both too long for a sharp, well-specified model (1,500 to
3,500 samples determine ``T`` of the CIFAR networks to +-5% at 95%) and possibly too short for
a model temperature scaling describes badly. Measured on the CIFAR records: see docs/benchmarks.md, section ``recovery``.

The sums are additive like :class:`lpcal.precalibrate.TemperatureGrid`'s: :class:`WarmupSums`
holds a grid (NLL per grid temperature) plus ``sum_i s_i``, ``sum_i s_i^2`` and ``sum_i h_i`` at
every grid point, in int64 fixed point (:data:`SCALE` units; each per-sample term clipped to
:data:`CLIP`), so merges are exact and associative and :meth:`WarmupSums.determine` is
bit-identical however the samples were batched. Values between grid points are cubic Lagrange
interpolations in ``log2 T`` through the four nearest grid points (the functions are smooth in
``theta``; measured error of ``se`` below 1% at the grid's spacing of 1/2).

Cost: ``O(n k G)`` exponentials for ``n`` samples, ``k`` classes, ``G = 17`` grid points: the
grid's own, computed once for the NLL and the score sums (and, through ``update(grid=...)``, for
a window bucket's grid fed the same samples); memory ``4 G`` int64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lpcal.errors import InputError
from lpcal.precalibrate import (
    GRID_LOG2_T,
    TemperatureGrid,
    checked_batch,
    chunk_runs,
    grid_exp,
    nll_fixed,
    positive_runs,
    run_bounds,
    shifted_log,
    sum_runs,
)

__all__ = ["CLIP", "SCALE", "Determination", "WarmupSums", "normal_quantile", "update_runs"]

#: Fixed-point units per unit of the score sums (``s``, ``s^2``, ``h``).
SCALE = float(1 << 16)
#: Largest magnitude of a per-sample ``s``, ``h`` (and of ``s^2``) summed.
CLIP = 4096.0
_INV_T = 2.0 ** -GRID_LOG2_T
_INV_COL = _INV_T[:, None]
_NEG_INV_COL = -_INV_COL
_INV2_COL = _INV_COL**2
_LN2 = math.log(2.0)
#: Curvature in ``theta`` of the grid fit's prior ``(log2 T)^2 / 8`` (:mod:`lpcal.precalibrate`).
PRIOR_CURVATURE = 1.0 / (4.0 * _LN2 * _LN2)


def normal_quantile(p: float) -> float:
    """``Phi^-1(p)`` for ``0 < p < 1`` (Acklam's rational approximation refined by one Halley
    step: relative error below 1e-12; numpy has no inverse normal CDF)."""
    if not 0.0 < p < 1.0:
        raise InputError(f"normal_quantile needs 0 < p < 1, got {p!r}")
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00)
    lo = 0.02425
    if p < lo or p > 1 - lo:
        q = math.sqrt(-2.0 * math.log(p if p < lo else 1.0 - p))
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0)
        x = x if p < lo else -x
    else:
        q = p - 0.5
        r = q * q
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0)
    e = 0.5 * math.erfc(-x / math.sqrt(2.0)) - p
    u = e * math.sqrt(2.0 * math.pi) * math.exp(x * x / 2.0)
    return x - u / (1.0 + x * u / 2.0)


def lagrange_weights(x: float, nodes: np.ndarray, order: int = 4) -> tuple[int, np.ndarray]:
    """``(first, w)``: the value at ``x`` of a function sampled on the sorted ``nodes`` is
    ``w @ values[first:first + order]`` (Lagrange interpolation through the ``order`` nodes
    nearest ``x``; extrapolation is not attempted: ``x`` is clamped to the nodes' range)."""
    g = nodes.size
    x = min(max(float(x), float(nodes[0])), float(nodes[-1]))
    j = int(np.searchsorted(nodes, x))
    first = min(max(j - order // 2, 0), g - order)
    xs = nodes[first:first + order]
    w = np.ones(order)
    for a in range(order):
        for b in range(order):
            if a != b:
                w[a] *= (x - xs[b]) / (xs[a] - xs[b])
    return first, w


def _grid_terms(x: np.ndarray, y: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Fixed-point ``(NLL sums, sum s, sum s^2, sum h)`` at every grid point, ``(4, r, G)``,
    of the ``r`` non-empty runs of ``counts`` (m,) rows (:func:`lpcal.precalibrate.run_bounds`:
    each run's sums those of its rows alone, to the bit), from one pass of the grid's exponentials
    (:func:`lpcal.precalibrate.grid_exp`; rows with ``f_y = 0`` are the caller's to drop). The
    NLL sums are those of :class:`TemperatureGrid` to the bit."""
    n = x.shape[0]
    bounds, _ = run_bounds(counts)
    out = np.zeros((4, bounds.size - 1, _INV_T.size), dtype=np.int64)
    if n == 0:
        return out
    z = shifted_log(x)
    zy = z[np.arange(n), y]
    zf = np.where(np.isfinite(z), z, 0.0)
    zf2 = zf * zf
    inv, neg_inv, inv2 = _INV_COL, _NEG_INV_COL, _INV2_COL
    for a, b, e, S in grid_exp(z, _INV_T):
        lo, hi, starts = chunk_runs(bounds, a, b)
        e /= S[None]                                                    # q at each T
        q = np.ascontiguousarray(e.transpose(1, 2, 0))                  # (G, m, k)
        m1 = np.einsum("gmk,mk->gm", q, zf[a:b])
        m2 = np.einsum("gmk,mk->gm", q, zf2[a:b])
        out[0, lo:hi] += nll_fixed(S, zy[a:b], starts).T
        v = np.empty((3, *m1.shape))                                    # s, s^2, h
        gap = m1 - zy[None, a:b]                                        # E_q z - z_y
        np.multiply(neg_inv, gap, out=v[0])
        np.multiply(v[0], v[0], out=v[1])
        m1 *= m1
        np.subtract(m2, m1, out=m2)
        np.maximum(m2, 0.0, out=m2)
        np.multiply(inv2, m2, out=v[2])
        gap *= inv
        v[2] += gap
        np.maximum(v, -CLIP, out=v)                                     # clip to +-CLIP
        np.minimum(v, CLIP, out=v)
        v *= SCALE
        # integers up to 2^28 per sample: their float64 sums over a chunk are exact
        out[1:, lo:hi] += sum_runs(np.rint(v, out=v), starts).transpose(0, 2, 1)
    return out


def update_runs(sums: Sequence[WarmupSums], grids: Sequence[TemperatureGrid | None],
                probs: np.ndarray, labels: np.ndarray, counts) -> None:
    """:meth:`WarmupSums.update` of each ``sums[j]`` (and its ``grids[j]``) with the ``j``-th
    run of ``counts`` (m,) validated rows, in one pass of the kernel for all of them: what
    many models' small deferred batches cost about one model's pass
    (:func:`lpcal.window.flush_many`). Each gets the sums of its own rows, to the bit; a run
    of no rows changes nothing."""
    counts = np.asarray(counts, dtype=np.int64)
    keep, kept, skipped = positive_runs(probs, labels, counts)
    if keep is not None:
        probs, labels = probs[keep], labels[keep]
    terms = _grid_terms(probs, labels, kept)
    ran = 0  # index of the next non-empty run of kept rows
    for j in np.flatnonzero(counts).tolist():
        n, sk = int(kept[j]), int(skipped[j])
        if n:
            nll, s, s2, h = terms[:, ran]
            ran += 1
        else:  # every row skipped: counted, nothing summed
            nll = s = s2 = h = 0
        for g in (sums[j].grid, grids[j]):
            if g is not None:
                g.add_sums(nll, n, sk)
        w = sums[j]
        w.s += s
        w.s2 += s2
        w.h += h


@dataclass(frozen=True)
class Determination:
    """What :meth:`WarmupSums.determine` found.

    ``temperature`` the MAP temperature of the grid (:meth:`TemperatureGrid.fit`),
    ``se_log_t`` the sandwich standard error of ``ln T``, ``half_width`` the interval's
    half-width ``z_{1 - alpha/2} se`` in ``ln T``, ``determined`` the rule's verdict and
    ``reason`` why not (``""`` when determined), ``n`` the samples summed.
    """

    temperature: float
    se_log_t: float
    half_width: float
    determined: bool
    reason: str
    n: int

    @property
    def interval(self) -> tuple[float, float]:
        """The ``1 - alpha`` interval for ``T``."""
        return (self.temperature * math.exp(-self.half_width),
                self.temperature * math.exp(self.half_width))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WarmupSums:
    """Additive sums that fit the warm-up temperature and say when it is determined
    (module docstring). Attributes: ``grid`` (:class:`TemperatureGrid`), ``s``, ``s2``,
    ``h`` (G,) int64 fixed-point sums of the score, its square and the curvature.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.warmup import WarmupSums
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(3000, 10)) * 3
    >>> f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    >>> q = np.exp(z / 2) / np.exp(z / 2).sum(axis=1, keepdims=True)
    >>> y = (q.cumsum(axis=1) > rng.random(3000)[:, None]).argmax(axis=1)
    >>> d = WarmupSums().update(f, y).determine(tol=0.05)
    >>> d.determined, round(d.temperature, 1)
    (True, 2.0)
    """

    __slots__ = ("grid", "h", "s", "s2")

    def __init__(self) -> None:
        self.grid = TemperatureGrid()
        self.s = np.zeros(_INV_T.size, dtype=np.int64)
        self.s2 = np.zeros(_INV_T.size, dtype=np.int64)
        self.h = np.zeros(_INV_T.size, dtype=np.int64)

    @property
    def n(self) -> int:
        """Samples summed (those with ``f_y > 0``)."""
        return self.grid.n

    def update(self, probs: np.ndarray, labels: np.ndarray, *,
               grid: TemperatureGrid | None = None) -> WarmupSums:
        """Add validated rows ``probs`` (n, k) with labels (n,); returns ``self``.

        ``grid``: also add the samples' NLL sums to this grid (a window bucket's, fed the same
        samples), from the same exponentials: they are computed once for both."""
        x, y = checked_batch(probs, labels, "WarmupSums.update")
        if x.shape[0]:
            update_runs([self], [grid], x, y, [x.shape[0]])
        return self

    def merge(self, other: WarmupSums) -> WarmupSums:
        """A new object with the sums of both (neither is modified)."""
        out = WarmupSums()
        out.grid = self.grid.merge(other.grid)
        out.s, out.s2, out.h = self.s + other.s, self.s2 + other.s2, self.h + other.h
        return out

    __add__ = merge

    def determine(self, *, tol: float = 0.05, alpha: float = 0.05,
                  min_samples: int = 500) -> Determination:
        """The rule of the module docstring: is ``ln T`` known to within ``+- tol`` at level
        ``1 - alpha``?

        Parameters
        ----------
        tol : float
            Largest half-width of the interval for ``ln T`` (0.05: ``T`` within about 5%).
        alpha : float
            The interval's level is ``1 - alpha`` (two-sided).
        min_samples : int
            Fewer samples are never determined.
        """
        if not (tol > 0 and 0 < alpha < 1):
            raise InputError(f"determine needs tol > 0 and 0 < alpha < 1, got {tol!r}, "
                             f"{alpha!r}")
        n = self.n
        if n == 0:
            return Determination(1.0, math.inf, math.inf, False, "no samples", 0)
        t = self.grid.fit()
        first, w = lagrange_weights(math.log2(t), GRID_LOG2_T)
        sl = slice(first, first + w.size)
        J = float(w @ self.h[sl]) / SCALE + PRIOR_CURVATURE
        K = float(w @ self.s2[sl]) / SCALE
        se = math.sqrt(max(K, 0.0)) / J if J > 0 else math.inf
        half = normal_quantile(1.0 - alpha / 2.0) * se
        reason = ""
        if n < min_samples:
            reason = f"{n} < {min_samples} samples"
        elif self.grid.at_edge:
            reason = "the fit is at an end of the temperature grid"
        elif not half <= tol:
            reason = f"interval half-width {half:.4f} > {tol:g} in ln T"
        return Determination(t, se, half, not reason, reason, n)

    @property
    def nbytes(self) -> int:
        return self.grid.nll.nbytes + self.s.nbytes + self.s2.nbytes + self.h.nbytes

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.grid.to_dict(), "scale": int(SCALE), "s": self.s.tolist(),
                "s2": self.s2.tolist(), "h": self.h.tolist()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WarmupSums:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`."""
        out = cls()
        try:
            out.grid = TemperatureGrid.from_dict(d["grid"])
            if int(d["scale"]) != int(SCALE):
                raise ValueError(f"scale {d['scale']!r}")
            arrs = [np.asarray(d[f], dtype=np.int64) for f in ("s", "s2", "h")]
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise InputError(f"malformed warm-up sums ({e})") from None
        if any(a.shape != _INV_T.shape for a in arrs) or (arrs[1] < 0).any():
            raise InputError("malformed warm-up sums (arrays out of shape or range)")
        out.s, out.s2, out.h = arrs
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WarmupSums):
            return NotImplemented
        return (self.grid == other.grid and np.array_equal(self.s, other.s)
                and np.array_equal(self.s2, other.s2) and np.array_equal(self.h, other.h))

    def __repr__(self) -> str:
        return f"WarmupSums(n={self.n})"
