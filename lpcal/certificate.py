"""Held-out certificates: an upper confidence bound on ``Err_p`` and the choice between candidates.

Setting
-------
For a candidate ``h`` and held-out samples ``(x_i, y_i)``, ``i = 1..n``, never seen by its fit, let
``Z_i[u, j] = (h(x_i)_j - y_ij) 1[R(h(x_i)) = u]`` (one cell ``c = (u, j)`` per level set ``u``
and class ``j``). Then ``Err_p(h) = ||mu||_p`` with ``mu = E[Z]``, the plug-in estimate is
``||Zbar||_p``, and :class:`lpcal.holdout.Cells` gives per cell ``S_c = sum_i Z_i[c]`` and
``Q_c = sum_i Z_i[c]^2``. Two facts are used throughout: ``|Z_i[c]| <= 1[R(h(x_i)) = u]`` (so
``|mu[u, j]| <= P(u)``, the mass of ``u``) and ``||Z_i||_2^2 = ||h(x_i) - e_{y_i}||^2 <= 2``.

Two Bernstein inequalities, for i.i.d. ``X_i`` with ``|X - E X| <= b`` and ``Var X <= v``
(Bernstein 1924), at confidence ``1 - e^-L`` per side::

    |Xbar - E X| <= b L / (3n) + sqrt((b L / (3n))^2 + 2 v L / n)              (B)

and, for ``W in [0, 1]`` (so ``Var W <= E W``), solving (B) with ``v = E W``, ``b = 1`` for
``E W`` (the *relative* Bernstein bound, one-sided)::

    E W <= m+(Wbar, L) = a + sqrt(a^2 - (Wbar + c)^2 + c^2),  c = L/(3n),  a = Wbar + c + L/n   (R)

Bound for p = inf: Bernstein per cell, union over the heavy cells, mass for the light ones
-------------------------------------------------------------------------------------------
Fix a mass threshold ``t`` (a function of ``n, delta`` only, below). Level sets with
``P(u) > t`` are *heavy*: there are at most ``1/t`` of them, so at most ``K = ceil(k/t)`` heavy
cells, a fixed (unknown) set ``H``. Every light cell has ``|mu_c| <= P(u) <= t``. ``delta`` is
split between three events: ``delta_q = delta/10`` (masses), ``delta_m = 3 delta/20`` (second
moments) and ``delta_mu = 3 delta/4`` (means):

1. masses (confidence ``delta_q``): ``P(Bin(n, q) <= N) <= exp(-n kl(N/n, q))`` (Chernoff), so
   with ``L_q = log(1/(t delta_q))`` every heavy ``u`` has ``P(u) <= q+_u``, the largest ``q``
   with ``n kl(N_u/n, q) <= L_q`` (``N_u`` its held-out count; ``q+_0 = 1 - exp(-L_q/n)``
   unseen);
2. second moments (confidence ``delta_m``), a union weighted by mass: for each cell
   ``c = (u, j)`` of a level set with ``P(u) > 0``, (R) at ``L_c = log(k / (delta_m P(u)))``
   fails with probability at most ``delta_m P(u) / k``; over all cells, at most
   ``delta_m sum_u P(u) <= delta_m``. ``P(u)`` is unknown, but ``m_c = E[Z_c^2] <= P(u)``
   (``|Z_c| <= 1[u]``), so ``L_c <= log(k / (delta_m m_c))`` and, (R) growing with ``L``,
   ``m_c <= m+(Q_c/n, log(k / (delta_m m_c)))``. The right side decreases in ``m_c``, so the
   ``m`` that satisfy it are an interval ``(0, m*_c]``: ``E[Z_c^2] <= m*_c``, its upper end
   (bisection). A cell of a level set of mass ``P(u)`` pays ``log(k / (delta_m P(u)))`` instead
   of a uniform union's ``log(K / delta_m)`` over all ``K`` heavy cells (``K`` is about
   1,000 at ``n = 1000``, ``k = 10``): about 9.0 against 11.4 for a cell with
   ``Q_c / n = 0.11`` (``m* = 0.168`` against 0.177), the level sets that hold the mass, where the bound is decided. On
   events 1 and 2, ``Var Z_c <= v_c := min(m*_c, q+_u)``, and ``v_0 = min(m*(0), q+_0)`` for a
   cell no sample fell in;
3. means (confidence ``delta_mu``): let ``x*`` be the smallest ``x`` with
   ``sum_{c in H} 2 exp(-n x^2 / (2 Var Z_c + 4x/3)) <= delta_mu`` (Bernstein, ``b = 2``); then
   ``|Zbar_c - mu_c| <= x*`` for all ``c in H``. ``x*`` involves ``H`` and the true variances,
   but on events 1 and 2 it is at most the smallest ``x`` with ``T(x) <= delta_mu``, where
   ``T(x)`` sums the ``K`` largest tails ``2 exp(-n x^2 / (2 v_c + 4x/3))`` over the observed
   cells and ``K`` copies of ``v_0`` (``H`` is ``K`` cells at most, each observed or not).
   ``v_c`` is rounded up to a geometric grid of ratio 1.02 to count the ``K`` largest without a
   sort (tails grow with ``v``: conservative). Bisection gives ``x``.

A cell is heavy or light, so with probability ``1 - delta``::

    Err_inf(h) <= max( t, min(x, q+_0), max_c min(|Zbar_c| + x, q+_u(c)) )

``t`` is the fixed point ``t = q+_0(t)``: a heavy level set that no sample fell in has mass at
most ``t`` (0.0068 at ``n = 1500``, ``delta = 0.05``). No normal approximation: the bound is
finite-sample valid for every distribution.

The split: the mean event decides the bound where it matters (a few cells of large variance),
so it gets most of ``delta``; the mass event only sets ``t`` and caps light cells, whose
bounds are far below any ``eps`` one certifies at (``t`` grows like ``log(1/delta_q)/n``);
the second-moment event enters the variance of the deciding cells through ``sqrt(L_c)``.
Against the earlier even split (``delta/4``, ``delta/4``, ``delta/2``) with a uniform union over
the ``K`` heavy cells for the second moments, the margin (bound minus plug-in) is about 7%
smaller on the two-prototype family of ``tests/bench/bench_families.py`` at ``n = 800`` to
``1400``; the price is a larger floor ``t`` (162 held-out samples instead of 144 before any
data can certify at ``eps = 0.05``, ``delta = 0.1``, two candidates).

Bound for 2 <= p < inf: Bousquet's inequality on the whole residual vector
--------------------------------------------------------------------------
Level sets seen once or never dominate at large ``lambda`` (at ``p = 2``, ``lambda = 200``,
``k = 10`` almost every held-out level set holds one sample), so no per-cell tail and no mass
term can be small there (a mass term is ``2 sqrt(t M)`` with ``M`` near 1). Instead,
``||.||_p <= ||.||_2`` for ``p >= 2``, and ``Z`` lives in the Hilbert space ``l2`` over all
cells with ``||Z|| <= sqrt 2``::

    Err_p(h) = ||mu||_p <= ||Zbar||_p + ||Zbar - mu||_2

``n ||Zbar - mu||_2`` is the supremum over the unit ball of ``sum_i <a, Z_i - mu>``, functions
bounded by ``b = 2 sqrt 2``, so Bousquet's inequality (2002, Thm 2.3) gives, with probability
``1 - delta/2`` and ``L = log(2/delta)``::

    ||Zbar - mu||_2 <= e + sqrt(2 L (sigma_w^2 + 2 b e) / n) + b L / (3n)

where ``e >= E||Zbar - mu||_2`` and ``sigma_w^2 >= sup_a Var <a, Z>`` (the *weak* variance):

* ``E||Zbar - mu||^2 = E||Z - mu||^2 / n <= Brier(h) / n``, and by (R) on ``||Z||^2 / 2``
  (confidence ``delta/4``), ``Brier(h) <= 2 m+(Brier_hat / 2, log(4/delta))``: ``e`` is the
  square root of that over ``n``;
* ``Z`` is non-zero on one level set per sample, so ``E<a, Z>^2 <= max_u E[||Z||^2 1[u]]``. A
  level set of mass ``<= t_w`` contributes at most ``2 t_w``; the others (at most ``1/t_w``) are
  bounded by (R) on ``||Z||^2 1[u] / 2`` with a union bound (confidence ``delta/4``,
  ``L_w = log(4/(t_w delta))``), ``t_w`` the fixed point ``t_w = m+(0, L_w)``.

The deviation of the whole vector, unseen cells included, is bounded at once: no missing-mass
term. Its size is set by the Brier score and, through ``sigma_w``, by the heaviest level set;
a level set seen once adds its own residual ``||Z_i|| / n`` to ``||Zbar||``, not a mass bound.
Finite-sample valid for every distribution.

Bound for 1 <= p < 2 (unchanged, asymptotic)
--------------------------------------------
Observed cells (confidence ``delta/2``) under the normal approximation
``Zbar_c - mu_c ~ N(0, s_c^2)``, ``s_c^2 = (Q_c/n - Zbar_c^2)/n``: Gaussian concentration of the
``s``-weighted norm, ``E||xi||_p + L sqrt(2 log(2/delta))`` with ``E||xi||_p <= (m_p sum_c
s_c^p)^(1/p)``, ``m_p = E|N(0,1)|^p``, Lipschitz constant ``L = ||s||_{2p/(2-p)}``; level sets
no held-out sample fell in: every level set of mass above ``t`` was observed with probability
``1 - delta/4``, ``(1/t) exp(-t n) = delta/4``, giving ``(2^p t^(p-1) M)^(1/p)`` with the unobserved
mass ``M`` bounded by its Good-Turing estimate plus McAllester & Schapire's deviation
``(2 sqrt 2 + sqrt 3) sqrt(log(12/delta)/n)`` (confidence ``delta/4``).

Selection
---------
:func:`certify_and_select` evaluates every candidate on the same held-out sums, calls a
candidate *certified* when its bound is at most ``eps``, and selects the certified candidate with
the lowest held-out Brier score. The choice looks at the same data as the bounds, so each of the
``m`` selectable candidates is bounded at level ``1 - delta/m`` (Bonferroni): all ``m`` bounds
hold together with probability ``1 - delta``, hence so does the published one, whichever it is.
(Certifying on a second share the selection did not see was the alternative; halving the share
costs far more than ``log(2m/delta)`` versus ``log(2/delta)``: ``docs/benchmarks.md``,
certificate.) With none certified (typically a held-out share too small to certify anything) it
selects the candidate with the lowest held-out Brier score among all, and the certificate says
``certified: no`` (the daemon's alert fires on it).

``reported`` candidates (the raw model) are bounded at the same level, never selected; when the
raw model's own bound is ``<= eps`` the target is **vacuous** (the uncalibrated model already
meets it) and the certificate says so (``vacuous: true``).

Cost: ``O(cells)`` plus 8 fixed-point passes over the distinct second moments of the cells their
mass does not already cap and 40 bisection steps over the distinct grid values of at most ``K``
tails (``p = inf``), ``O(cells)`` otherwise; 1 to 3 ms per candidate on 1,500 held-out samples
at ``k = 10`` to ``100`` (``docs/benchmarks.md``, certificate).

References: S. Bernstein, 1924; O. Bousquet, *A Bennett concentration inequality and its
application to suprema of empirical processes*, C. R. Acad. Sci. Paris 2002; H. Chernoff, 1952;
D. McAllester, R. Schapire, *On the convergence rate of Good-Turing estimators*, COLT 2000.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lpcal.errors import InputError, shown
from lpcal.holdout import Cells

__all__ = ["NO_HOLDOUT", "Certificate", "Estimate", "bound_method", "certify_and_select",
           "err_p_bound", "min_certifiable_holdout"]

#: ``method`` of a certificate, by ``p`` (module docstring).
BOUND_INF = "bernstein-union+mass"
BOUND_HILBERT = "bousquet-l2"
BOUND_NORMAL = "normal-union+missing-mass"
#: ``method`` of a certificate that could not be computed: too few samples to hold any out.
NO_HOLDOUT = "none: sample too small to certify"
_MS_CONST = 2.0 * math.sqrt(2.0) + math.sqrt(3.0)


def _lp(a: np.ndarray, p: float) -> float:
    a = np.abs(a).ravel()
    if a.size == 0:
        return 0.0
    m = float(a.max())
    if m == 0.0 or math.isinf(p):
        return m
    return m * float(np.sum((a / m) ** p)) ** (1.0 / p)


def _max_unobserved_mass(n: int, delta: float) -> float:
    """``t`` with ``(1/t) exp(-t n) = delta``: every level set of mass > t is observed w.p. >=
    1 - delta (fixed-point iteration of ``t = log(1/(delta t)) / n``, increasing in ``t``)."""
    t = min(1.0, math.log(1.0 / delta) / n)
    for _ in range(100):
        nt = min(1.0, math.log(1.0 / (delta * t)) / n)
        if abs(nt - t) <= 1e-12 * t:
            break
        t = nt
    return t


def _tail(n: int, p: float, delta: float, m_hat: float | None = None) -> float:
    """The unobserved-level-set term of the bound (module docstring, term 2); ``m_hat`` None:
    its smallest value over all data (no level set seen once: the deviation term alone)."""
    if math.isinf(p):
        return _max_unobserved_mass(n, delta / 2.0)
    t = _max_unobserved_mass(n, delta / 4.0)
    if m_hat is None:
        m_hat = min(1.0, _MS_CONST * math.sqrt(math.log(12.0 / delta) / n))
    return (2.0**p * t ** (p - 1.0) * m_hat) ** (1.0 / p)


def bound_method(p: float) -> str:
    """The name of the bound used at ``p`` (module docstring), as recorded in certificates."""
    if math.isinf(p):
        return BOUND_INF
    return BOUND_HILBERT if p >= 2.0 else BOUND_NORMAL


def _bernstein(v: np.ndarray | float, n: int, L: float, b: float) -> np.ndarray | float:
    """Deviation (B) of a mean of ``n`` samples with variance ``<= v``, range ``b``, per side at
    confidence ``1 - e^-L``."""
    c = b * L / (3.0 * n)
    return c + np.sqrt(c * c + 2.0 * v * L / n)


def _second_moment_ucb(wbar: np.ndarray | float, n: int, L: float) -> np.ndarray | float:
    """Relative Bernstein (R): an upper bound on ``E W`` for ``W in [0, 1]`` from its mean."""
    c = L / (3.0 * n)
    a = wbar + c + L / n
    return np.minimum(a + np.sqrt(np.maximum(a * a - (wbar + c) ** 2 + c * c, 0.0)), 1.0)


def _inf_tail_sum(x: float, v: np.ndarray, w: np.ndarray, n: int) -> float:
    """``sum_i w_i 2 exp(-n x^2 / (2 v_i + 4x/3))``: Bernstein tails of ``w_i`` cells each."""
    return float(np.dot(w, np.exp(-n * x * x / (2.0 * v + 4.0 * x / 3.0)))) * 2.0


@functools.lru_cache(maxsize=4096)
def _mass_ucb_one(count: int, n: int, L: float) -> float:
    """Chernoff (KL) upper bound on a level set's mass from its count: the largest ``q >= N/n``
    with ``n kl(N/n, q) <= L`` (``P(Bin(n, q) <= N) <= exp(-n kl(N/n, q))``); bisection."""
    ph = count / n
    if count == 0:
        return -math.expm1(-L / n)
    a = ph * math.log(ph) + ((1.0 - ph) * math.log1p(-ph) if ph < 1.0 else 0.0)
    lo, hi = ph, 1.0
    for _ in range(50):
        q = 0.5 * (lo + hi)
        if n * (a - ph * math.log(q) - (1.0 - ph) * math.log1p(-q)) <= L:
            lo = q
        else:
            hi = q
    return hi


def _mass_ucb(counts: np.ndarray, n: int, L: float) -> np.ndarray:
    """:func:`_mass_ucb_one` of every count (computed once per distinct count)."""
    uniq, inv = np.unique(np.asarray(counts, dtype=np.int64), return_inverse=True)
    return np.array([_mass_ucb_one(int(c), n, L) for c in uniq])[inv.ravel()]


_BUCKET = math.log(1.02)


def _top_k_tails(v: np.ndarray, K: int, v0: float) -> tuple[np.ndarray, np.ndarray]:
    """``(values, weights)`` whose tails sum to at least those of the ``K`` largest of ``v``
    together with ``K`` copies of ``v0`` (the ``K`` largest in all): ``v`` rounded up to a
    geometric grid of ratio 1.02 (tails grow with ``v``, so rounding up is conservative) and
    counted per grid value from the top, ``O(len(v))`` without a sort."""
    b = np.ceil(np.log(v) / _BUCKET).astype(np.int64)
    b0 = int(b.min())
    cnt = np.bincount(b - b0).astype(np.float64)
    vals = np.exp((np.arange(cnt.size) + b0) * _BUCKET)
    nz = np.flatnonzero(cnt)[::-1]
    vals, cnt = np.append(vals[nz], v0), np.append(cnt[nz], float(K))
    keep = np.minimum(cnt, np.maximum(K - (np.cumsum(cnt) - cnt), 0.0))
    return vals[keep > 0], keep[keep > 0]


#: Shares of ``delta`` of the three events of the p = inf bound (module docstring): masses,
#: second moments, means.
_SHARE_MASS, _SHARE_MOMENT = 0.1, 0.15
_SHARE_MEAN = 1.0 - _SHARE_MASS - _SHARE_MOMENT


@functools.lru_cache(maxsize=256)
def _mass_threshold(n: int, delta: float) -> float:
    """``t``: the fixed point ``t = 1 - exp(-log(1 / (t delta_q)) / n)``, ``delta_q`` the mass
    event's share of ``delta``: the mass bound of an unobserved heavy level set at ``t``
    (module docstring, p = inf); deterministic."""
    dq = _SHARE_MASS * delta
    t = 1.0
    for _ in range(200):
        nt = -math.expm1(-math.log(1.0 / (t * dq)) / n)
        if abs(nt - t) <= 1e-12 * t:
            break
        t = nt
    return min(1.0, t)


def _second_moment_fixed(wbar: np.ndarray, n: int, k: int, delta_m: float,
                         cap: np.ndarray | None = None) -> np.ndarray:
    """The mass-weighted second-moment bound (module docstring, p = inf, event 2), capped at
    ``cap`` (broadcast to ``wbar``): per entry of ``wbar`` (a cell's ``Q_c / n``),
    ``min(m*, cap)`` with ``m*`` the largest ``m`` such that
    ``m <= phi(m) := m+(wbar, log(k / (delta_m m)))``.

    ``phi`` decreases in ``m``, so the feasible ``m`` are ``(0, m*]`` with ``m* = phi(m*)``, and
    for any ``m``: ``m <= m*`` implies ``phi(m) >= phi(m*) = m*``. Starting from
    ``x_0 = phi(1) <= m*`` (``m* <= 1``), the iterates ``x_{i+1} = phi(x_i)`` alternate around
    ``m*`` (every odd one is above it, every even one below), so ``x_7`` is an upper bound on
    ``m*`` whatever the convergence (``|phi'|`` is small: ``L`` moves with ``log m``; 7 steps
    agree with a 60-step bisection to 1e-6 relative). An entry whose ``x_0`` is already at
    least ``cap`` gets ``cap`` without iterating (most cells of light level sets). Computed
    once per distinct value."""
    w = np.asarray(wbar, dtype=np.float64)
    c = np.ones_like(w) if cap is None else np.broadcast_to(cap, w.shape)
    out = np.array(c, dtype=np.float64)
    x0 = _second_moment_ucb(w, n, math.log(k / delta_m))
    need = x0 < c
    if need.any():
        uniq, inv = np.unique(w[need], return_inverse=True)
        x = _second_moment_ucb(uniq, n, math.log(k / delta_m))
        for _ in range(7):
            x = _second_moment_ucb(uniq, n, np.log(k / (delta_m * x)))
        out[need] = np.minimum(x[inv.ravel()], c[need])
    return out


def _inf_bound(cells: Cells | None, n: int, k: int, delta: float) -> float:
    """The p = inf bound ``max(t, min(x, q+_0), max_c min(|Zbar_c| + x, q+_c))`` (module
    docstring); ``cells`` None: data with zero residuals."""
    t = _mass_threshold(n, delta)
    K = math.ceil(k / t)
    lq = math.log(1.0 / (t * _SHARE_MASS * delta))
    dm, dmu = _SHARE_MOMENT * delta, _SHARE_MEAN * delta
    q0 = _mass_ucb_one(0, n, lq)
    v0 = float(_second_moment_fixed(np.zeros(1), n, k, dm, q0)[0])
    if cells is None or cells.S.size == 0:
        v, w, zabs, qplus = np.array([v0]), np.array([float(K)]), np.zeros(0), np.zeros(0)
    else:
        qplus = _mass_ucb(cells.counts, n, lq)
        v = _second_moment_fixed(np.asarray(cells.Q, dtype=np.float64) / n, n, k, dm,
                                 qplus[:, None]).ravel()
        v, w = _top_k_tails(np.maximum(v, v0), K, v0)
        zabs = np.abs(cells.S) / n
    vmax = float(v.max())
    lo = float(_bernstein(vmax, n, math.log(2.0 / dmu), 2.0))
    hi = float(_bernstein(vmax, n, math.log(2.0 * float(w.sum()) / dmu), 2.0))
    while _inf_tail_sum(hi, v, w, n) > dmu:  # not reached: w sums to K
        hi *= 2.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _inf_tail_sum(mid, v, w, n) <= dmu:
            hi = mid
        else:
            lo = mid
    worst = max(t, min(hi, q0))
    if zabs.size:
        worst = max(worst, float(np.minimum(zabs + hi, qplus[:, None]).max()))
    return worst


def _hilbert_margin(cells: Cells | None, n: int, delta: float) -> float:
    """Bousquet's ``||Zbar - mu||_2`` bound (module docstring, 2 <= p < inf); ``cells`` None: data with
    zero residuals."""
    if cells is None:
        brier_hat, wmax = 0.0, 0.0
    else:
        brier_hat = float(np.sum(cells.Q)) / n
        wmax = float(np.asarray(cells.Q).sum(axis=1).max()) / (2.0 * n) if cells.Q.size else 0.0
    sigma2 = 2.0 * float(_second_moment_ucb(brier_hat / 2.0, n, math.log(4.0 / delta)))
    e = math.sqrt(sigma2 / n)
    t = _weak_threshold(n, delta)
    lw = math.log(4.0 / (t * delta))
    weak = 2.0 * max(t, float(_second_moment_ucb(wmax, n, lw)))
    L = math.log(2.0 / delta)
    b = 2.0 * math.sqrt(2.0)
    return e + math.sqrt(2.0 * L * (weak + 2.0 * b * e) / n) + b * L / (3.0 * n)


def _weak_threshold(n: int, delta: float) -> float:
    """``t = m+(0, log(4 / (t delta)))``: the level-set mass below which the weak variance is
    bounded by mass (fixed point, deterministic in ``n, delta``)."""
    t = 1.0
    for _ in range(100):
        nt = float(_second_moment_ucb(0.0, n, math.log(4.0 / (t * delta))))
        if abs(nt - t) <= 1e-12 * t:
            break
        t = nt
    return t


def _empty_margin(n: int, p: float, delta: float, k: int) -> float:
    """The bound on data that leave nothing to estimate (every residual 0): below ``eps`` only
    from this many samples on."""
    if math.isinf(p):
        return _inf_bound(None, n, k, delta)
    if p >= 2.0:
        return _hilbert_margin(None, n, delta)
    return _tail(n, p, delta)


def min_certifiable_holdout(eps: float, p: float, delta: float, k: int = 2,
                            candidates: int = 1) -> int:
    """Fewest held-out samples whose bound can be ``<= eps`` at all, for ``k`` classes and
    ``candidates`` selectable candidates (each bounded at ``delta / candidates``): below it,
    the bound on data with zero residuals exceeds ``eps``, so no data certify. The default
    ``k = 2`` gives the smallest value over all ``k``. Binary search, ``O(log n)``."""
    d = delta / max(1, int(candidates))
    lo, hi = 1, 1
    while _empty_margin(hi, p, d, k) > eps:
        hi *= 2
        if hi > 1 << 40:
            return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if _empty_margin(mid, p, d, k) > eps:
            lo = mid + 1
        else:
            hi = mid
    return lo


def err_p_bound(cells: Cells, p: float, delta: float, k: int | None = None
                ) -> tuple[float, float]:
    """``(plug-in Err_p, upper confidence bound at level 1 - delta)`` (module docstring);
    ``k`` defaults to the width of ``cells.S``."""
    n = cells.n
    if n < 1:
        raise InputError("cannot bound Err_p without held-out samples")
    if not (0.0 < delta < 1.0):
        raise InputError(f"delta must be in (0, 1), got {shown(delta)}")
    k = int(cells.S.shape[1]) if k is None else int(k)
    zbar = cells.S / n
    est = _lp(zbar, p)
    if math.isinf(p):
        return est, max(est, _inf_bound(cells, n, k, delta))
    if p >= 2.0:
        return est, est + _hilbert_margin(cells, n, delta)
    s = np.sqrt(np.maximum(cells.Q / n - zbar * zbar, 0.0) / n).ravel()
    m_p = 2.0 ** (p / 2.0) * math.gamma((p + 1.0) / 2.0) / math.sqrt(math.pi)
    mean = (m_p * float(np.sum(s**p))) ** (1.0 / p)
    lip = _lp(s, 2.0 * p / (2.0 - p)) if p < 2.0 else float(s.max())
    noise = mean + lip * math.sqrt(2.0 * math.log(2.0 / delta))
    singletons = int(np.count_nonzero(cells.counts == 1))  # Good-Turing
    m_hat = min(1.0, singletons / n + _MS_CONST * math.sqrt(math.log(12.0 / delta) / n))
    return est, est + noise + _tail(n, p, delta, m_hat)


@dataclass(frozen=True)
class Estimate:
    """Held-out figures of one candidate."""

    err_p: float      # plug-in Err_p on the held-out share, at the map's lambda
    bound: float      # upper confidence bound at level 1 - delta
    brier: float      # held-out Brier score

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Certificate:
    """What a bin map's held-out evaluation found (stored in the artifact, printed by ``eval``).

    Every candidate's bound is at level ``1 - delta / selectable`` (Bonferroni over the
    ``selectable`` candidates the selection chose among), so the published one holds at
    ``1 - delta``. ``vacuous``: the raw model's own bound is ``<= eps``, so the target says
    nothing about this model. Certificates written before these fields read as
    ``selectable = 1`` and ``vacuous = False``.
    """

    method: str
    eps: float
    p: float
    lam: int
    delta: float
    n_holdout: int
    estimates: Mapping[str, Estimate]   # candidate name -> figures ("raw" is reported only)
    selected: str
    certified: bool                     # estimates[selected].bound <= eps
    selectable: int = 1
    vacuous: bool = False

    @property
    def bound(self) -> float:
        """The published candidate's bound (``inf`` when nothing could be held out)."""
        e = self.estimates.get(self.selected)
        return math.inf if e is None else e.bound

    @property
    def raw_bound(self) -> float:
        """The raw model's bound (``inf`` when it was not reported)."""
        e = self.estimates.get("raw")
        return math.inf if e is None else e.bound

    @classmethod
    def without_holdout(cls, *, eps: float, p: float, lam: int, delta: float) -> Certificate:
        """The certificate of a map fitted on a sample too small to hold a certifiable share
        out (:func:`min_certifiable_holdout`): nothing estimated, not certified."""
        return cls(NO_HOLDOUT, float(eps), float(p), int(lam), float(delta), 0, {},
                   "precalibrator", False)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "eps": self.eps,
                "p": "inf" if math.isinf(self.p) else self.p, "lam": self.lam,
                "delta": self.delta, "n_holdout": self.n_holdout,
                "estimates": {k: v.to_dict() for k, v in self.estimates.items()},
                "selected": self.selected, "certified": self.certified,
                "selectable": self.selectable, "vacuous": self.vacuous}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Certificate) -> Certificate:
        """The certificate of its JSON form (:meth:`to_dict`; certificates written before
        ``selectable`` and ``vacuous`` existed read with their defaults); a
        :class:`Certificate` is returned as it is (what ``BinMap.certificate`` now holds).

        Raises
        ------
        InputError
            A missing or malformed field, naming it.
        """
        if isinstance(d, Certificate):
            return d
        try:
            est = {str(k): Estimate(float(v["err_p"]), float(v["bound"]), float(v["brier"]))
                   for k, v in dict(d["estimates"]).items()}
            cert = cls(str(d["method"]), float(d["eps"]),
                       math.inf if d["p"] == "inf" else float(d["p"]), int(d["lam"]),
                       float(d["delta"]), int(d["n_holdout"]), est, str(d["selected"]),
                       bool(d["certified"]), int(d.get("selectable", 1)),
                       bool(d.get("vacuous", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"malformed certificate ({type(e).__name__}: {e})") from None
        if cert.selected not in est and cert.n_holdout > 0:
            raise InputError(f"certificate selects {cert.selected!r}, which it does not "
                             "estimate")
        if cert.selectable < 1:
            raise InputError(f"certificate: selectable must be >= 1, got {cert.selectable}")
        if not isinstance(d.get("vacuous", False), bool):
            raise InputError(f"certificate: vacuous must be true or false, got "
                             f"{d.get('vacuous')!r}")
        return cert

    def format(self) -> str:
        """Human-readable table (``lpcal fit`` and ``lpcal eval``): the candidates, then
        ``certified: yes`` or ``certified: no`` and, when the raw model already meets ``eps``,
        ``vacuous: yes``."""
        p = "inf" if math.isinf(self.p) else f"{self.p:g}"
        if self.n_holdout == 0:
            return (f"certificate: none ({self.method}); published: {self.selected}\n"
                    f"  certified: no (Err_{p} <= eps {self.eps:g} not checked)")
        level = (f"level {1 - self.delta:g}" if self.selectable == 1 else
                 f"level {1 - self.delta:g} for the published one, each of "
                 f"{self.selectable} at {1 - self.delta / self.selectable:g}")
        head = (f"certificate: Err_{p} at lambda={self.lam} on {self.n_holdout} held-out "
                f"samples; bounds at {level} ({self.method})")
        lines = [head, f"  {'candidate':<15} {'Err_p':>8} {'bound':>8} {'Brier':>8}"]
        order = ["raw", "precalibrator", "corrected"]
        for name in sorted(self.estimates, key=lambda nm: (order.index(nm) if nm in order
                                                            else len(order), nm)):
            e = self.estimates[name]
            mark = "  <- published" if name == self.selected else ""
            lines.append(f"  {name:<15} {e.err_p:8.4f} {e.bound:8.4f} {e.brier:8.4f}{mark}")
        lines.append(f"  certified: {'yes' if self.certified else 'no'} (bound "
                     f"{self.bound:.4f} {'<=' if self.certified else '>'} eps {self.eps:g})")
        if self.vacuous:
            lines.append(f"  vacuous: yes (the raw model's bound {self.raw_bound:.4f} <= eps "
                         f"{self.eps:g}: the uncalibrated model already meets eps; a smaller "
                         "eps, or eps='auto', makes the certificate informative)")
        return "\n".join(lines)


def certify_and_select(candidates: Mapping[str, Cells], *, eps: float, p: float, lam: int,
                       delta: float, reported: Mapping[str, Cells] | None = None
                       ) -> Certificate:
    """Evaluate ``candidates`` (in preference order for ties) and pick one (module docstring).

    Each candidate, and each ``reported`` one (e.g. the raw model: estimated and recorded,
    never selected), is bounded at level ``1 - delta / len(candidates)``.
    """
    if not candidates:
        raise InputError("no candidate to certify")
    m = len(candidates)
    est = {}
    for name, cells in {**(reported or {}), **candidates}.items():
        e, b = err_p_bound(cells, p, delta / m)
        est[name] = Estimate(e, b, cells.brier)
    names = list(candidates)
    ok = [nm for nm in names if est[nm].bound <= eps]
    pick = min(ok or names, key=lambda nm: (est[nm].brier, names.index(nm)))
    n = next(iter(candidates.values())).n
    vacuous = "raw" in est and est["raw"].bound <= eps
    method = bound_method(p) + (f", bonferroni over {m}" if m > 1 else "")
    return Certificate(method, float(eps), float(p), int(lam), float(delta), int(n), est,
                       pick, bool(ok), m, bool(vacuous))
