"""Held-out certificates: an upper confidence bound on ``Err_p`` and the choice between candidates.

Bound
-----
For a candidate ``h`` and held-out samples ``(x_i, y_i)``, ``i = 1..n``, never seen by its fit, let
``Z_i[u, j] = (h(x_i)_j - y_ij) 1[R(h(x_i)) = u]``. Then ``Err_p(h) = ||mu||_p`` with
``mu = E[Z]`` and the plug-in estimate is ``||Zbar||_p`` (:class:`lpcal.holdout.Cells` gives the
sums per level set ``u``). By the triangle inequality::

    Err_p(h) <= ||Zbar||_p  +  ||(Zbar - mu) on observed level sets||_p  +  ||mu on the others||_p

and the bound replaces the two error terms by their ``1 - delta`` quantiles:

1. **observed level sets** (confidence ``delta/2``), under the normal approximation
   ``Zbar_c - mu_c ~ N(0, s_c^2)``, ``s_c^2 = (Q_c/n - Zbar_c^2)/n`` per cell ``c = (u, j)``:

   * ``p = inf``: the union bound with ``P(|N(0, s^2)| > x) <= exp(-x^2 / (2 s^2))``: the ``x``
     that solves ``sum_c exp(-x^2 / (2 s_c^2)) = delta/2`` (bisection);
   * ``p < inf``: Gaussian concentration of the ``s_c``-weighted norm,
     ``E||xi||_p + L sqrt(2 log(2/delta))`` with ``E||xi||_p <= (m_p sum_c s_c^p)^(1/p)``,
     ``m_p = E|N(0,1)|^p``, and Lipschitz constant ``L = max_c s_c`` (``p >= 2``) or
     ``||s||_{2p/(2-p)}`` (``p < 2``);

2. **level sets no held-out sample fell in**: each has ``|mu[u, j]| <= P(u)`` and
   ``sum_j |mu[u, j]| <= 2 P(u)``. With probability ``1 - delta/4`` every level set of mass above
   ``t`` was observed, where ``(1/t) exp(-t n) = delta/4`` (at most ``1/t`` such sets, each missed
   with probability ``(1-t)^n``). So the term is ``t`` for ``p = inf`` and
   ``(2^p t^(p-1) M)^(1/p)`` otherwise, with the unobserved mass ``M`` bounded by its Good-Turing
   estimate plus McAllester & Schapire's deviation ``(2 sqrt 2 + sqrt 3) sqrt(log(12/delta)/n)``
   (confidence ``delta/4``; for ``p = inf`` that ``delta/4`` goes to ``t``).

The bound is a finite-sample guarantee except for the normal approximation of term 1, which is
asymptotic (cells with few samples are the least accurate, and also the lightest). It is named
``"normal-union+missing-mass"`` in artifacts. Cost: ``O(cells)`` (plus 60 bisection steps).

Selection
---------
:func:`certify_and_select` evaluates every candidate on the same held-out sums, calls a
candidate *certified* when its bound is at most ``eps``, and selects the certified candidate with
the lowest held-out Brier score. With none certified (typically a held-out share too small to
certify anything: the unobserved-mass term alone is ``t ~ log(1/delta)/n``) it selects the
candidate with the lowest held-out Brier score among all, and the certificate says
``certified: false`` (the daemon's alert fires on it). The lowest bound was tried first as that
fallback; on the small scikit-learn records it published corrected maps chosen on noise (top-label
ECE 0.007 above temperature scaling), so the proper score decides.

References: D. McAllester, R. Schapire, *On the convergence rate of Good-Turing estimators*, COLT
2000; B. Tsirelson, I. Ibragimov, V. Sudakov, *Norms of Gaussian sample functions*, 1976.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lpcal.errors import InputError
from lpcal.holdout import Cells

__all__ = ["BOUND_METHOD", "NO_HOLDOUT", "Certificate", "Estimate", "certify_and_select",
           "err_p_bound", "min_certifiable_holdout"]

BOUND_METHOD = "normal-union+missing-mass"
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


_PRUNE = 12.0  # cells with s below x_lo / 12 contribute at most exp(-72) each


def _union_quantile(s: np.ndarray, delta: float) -> float:
    """Smallest ``x`` (bisection, relative precision ~1e-12) with
    ``sum exp(-x^2 / (2 s^2)) <= delta``.

    ``x`` is at least ``x_lo = max(s) sqrt(2 log(1/delta))`` (the largest cell alone), so a cell
    with ``s < x_lo / 12`` adds less than ``exp(-72)`` at any feasible ``x``: such cells are
    summed once as that bound instead of at every step (conservative; on 3 million cells of a
    k = 100 held-out share most of them)."""
    s = s[s > 0]
    if s.size == 0:
        return 0.0
    s_max = float(s.max())
    lo = s_max * math.sqrt(2.0 * math.log(1.0 / delta))
    keep = s[s >= lo / _PRUNE]
    budget = delta - (s.size - keep.size) * math.exp(-0.5 * _PRUNE**2)
    hi = s_max * math.sqrt(2.0 * math.log(2.0 * s.size / delta))
    inv = 1.0 / (2.0 * keep * keep)
    for _ in range(45):
        mid = 0.5 * (lo + hi)
        if float(np.exp(-mid * mid * inv).sum()) <= budget:
            hi = mid
        else:
            lo = mid
    return hi


def _tail(n: int, p: float, delta: float, m_hat: float | None = None) -> float:
    """The unobserved-level-set term of the bound (module docstring, term 2); ``m_hat`` None:
    its smallest value over all data (no level set seen once: the deviation term alone)."""
    if math.isinf(p):
        return _max_unobserved_mass(n, delta / 2.0)
    t = _max_unobserved_mass(n, delta / 4.0)
    if m_hat is None:
        m_hat = min(1.0, _MS_CONST * math.sqrt(math.log(12.0 / delta) / n))
    return (2.0**p * t ** (p - 1.0) * m_hat) ** (1.0 / p)


def min_certifiable_holdout(eps: float, p: float, delta: float) -> int:
    """Fewest held-out samples whose bound can be ``<= eps`` at all: below it, the
    unobserved-level-set term alone exceeds ``eps`` whatever the data (for ``p < inf`` at its
    smallest, with no level set seen once). Binary search, ``O(log n)``."""
    lo, hi = 1, 1
    while _tail(hi, p, delta) > eps:
        hi *= 2
        if hi > 1 << 40:
            return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if _tail(mid, p, delta) > eps:
            lo = mid + 1
        else:
            hi = mid
    return lo


def err_p_bound(cells: Cells, p: float, delta: float) -> tuple[float, float]:
    """``(plug-in Err_p, upper confidence bound at level 1 - delta)`` (module docstring)."""
    n = cells.n
    if n < 1:
        raise InputError("cannot bound Err_p without held-out samples")
    if not (0.0 < delta < 1.0):
        raise InputError(f"delta must be in (0, 1), got {delta!r}")
    zbar = cells.S / n
    est = _lp(zbar, p)
    s = np.sqrt(np.maximum(cells.Q / n - zbar * zbar, 0.0) / n).ravel()
    if math.isinf(p):
        noise = _union_quantile(s, delta / 2.0)
        tail = _tail(n, p, delta)
    else:
        m_p = 2.0 ** (p / 2.0) * math.gamma((p + 1.0) / 2.0) / math.sqrt(math.pi)
        mean = (m_p * float(np.sum(s**p))) ** (1.0 / p)
        lip = float(s.max()) if p >= 2.0 else _lp(s, 2.0 * p / (2.0 - p))
        noise = mean + lip * math.sqrt(2.0 * math.log(2.0 / delta))
        singletons = int(np.count_nonzero(cells.counts == 1))  # Good-Turing
        m_hat = min(1.0, singletons / n + _MS_CONST * math.sqrt(math.log(12.0 / delta) / n))
        tail = _tail(n, p, delta, m_hat)
    return est, est + noise + tail


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
    """What a bin map's held-out evaluation found (stored in the artifact, printed by ``eval``)."""

    method: str
    eps: float
    p: float
    lam: int
    delta: float
    n_holdout: int
    estimates: Mapping[str, Estimate]   # candidate name -> figures ("raw" is reported only)
    selected: str
    certified: bool                     # estimates[selected].bound <= eps

    @property
    def bound(self) -> float:
        """The published candidate's bound (``inf`` when nothing could be held out)."""
        e = self.estimates.get(self.selected)
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
                "selected": self.selected, "certified": self.certified}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Certificate:
        try:
            est = {str(k): Estimate(float(v["err_p"]), float(v["bound"]), float(v["brier"]))
                   for k, v in dict(d["estimates"]).items()}
            cert = cls(str(d["method"]), float(d["eps"]),
                       math.inf if d["p"] == "inf" else float(d["p"]), int(d["lam"]),
                       float(d["delta"]), int(d["n_holdout"]), est, str(d["selected"]),
                       bool(d["certified"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"malformed certificate ({type(e).__name__}: {e})") from None
        if cert.selected not in est and cert.n_holdout > 0:
            raise InputError(f"certificate selects {cert.selected!r}, which it does not "
                             "estimate")
        return cert

    def format(self) -> str:
        """Human-readable table (``lpcal eval``)."""
        p = "inf" if math.isinf(self.p) else f"{self.p:g}"
        if self.n_holdout == 0:
            return (f"certificate: none ({self.method}); published: {self.selected}, "
                    f"NOT certified for Err_{p} <= eps {self.eps:g}")
        head = (f"certificate: Err_{p} at lambda={self.lam} on {self.n_holdout} held-out "
                f"samples; bound at level {1 - self.delta:g} ({self.method})")
        lines = [head, f"  {'candidate':<15} {'Err_p':>8} {'bound':>8} {'Brier':>8}"]
        order = ["raw", "precalibrator", "corrected"]
        for name in sorted(self.estimates, key=lambda nm: (order.index(nm) if nm in order
                                                            else len(order), nm)):
            e = self.estimates[name]
            mark = "  <- published" if name == self.selected else ""
            lines.append(f"  {name:<15} {e.err_p:8.4f} {e.bound:8.4f} {e.brier:8.4f}{mark}")
        verdict = "certified" if self.certified else "NOT certified"
        lines.append(f"  {verdict}: bound {self.bound:.4f} {'<=' if self.certified else '>'} "
                     f"eps {self.eps:g}")
        return "\n".join(lines)


def certify_and_select(candidates: Mapping[str, Cells], *, eps: float, p: float, lam: int,
                       delta: float, reported: Mapping[str, Cells] | None = None
                       ) -> Certificate:
    """Evaluate ``candidates`` (in preference order for ties) and pick one (module docstring).

    ``reported`` cells (e.g. the raw model) are estimated and recorded, never selected.
    """
    if not candidates:
        raise InputError("no candidate to certify")
    est = {}
    for name, cells in {**(reported or {}), **candidates}.items():
        e, b = err_p_bound(cells, p, delta)
        est[name] = Estimate(e, b, cells.brier)
    names = list(candidates)
    ok = [nm for nm in names if est[nm].bound <= eps]
    pick = min(ok or names, key=lambda nm: (est[nm].brier, names.index(nm)))
    n = next(iter(candidates.values())).n
    return Certificate(BOUND_METHOD, float(eps), float(p), int(lam), float(delta), int(n), est,
                       pick, bool(ok))
