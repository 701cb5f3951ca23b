"""Temperature scaling (Guo et al. 2017) on probability vectors, numpy only.

With ``z = log f(x)`` playing the logits (they are logits up to a per-row constant, which the
softmax ignores), temperature ``T > 0`` maps ``f`` to::

    q_T(x) = softmax(log f(x) / T),   i.e.   q_T(x)_j = f(x)_j^(1/T) / sum_i f(x)_i^(1/T).

Zero probabilities stay exactly zero for every ``T``. ``T > 1`` softens, ``T < 1`` sharpens.

:func:`fit_temperature` minimises the negative log-likelihood
``L(T) = mean_i [ logsumexp(z_i / T) - z_{i, y_i} / T ]`` over ``log T`` in bounds. ``L`` is convex
in ``1/T`` (a log-sum-exp of linear functions minus a linear function), hence unimodal in
``log T``, so a bounded 1-D search finds the global minimum within the bounds. The search is
Brent's method (golden section with parabolic interpolation, Forsythe-Malcolm-Moler ``fmin``,
the algorithm behind ``scipy.optimize.fminbound``). The default bounds ``log T in [-10, 10]`` are
scikit-learn's (``CalibratedClassifierCV(method="temperature")`` searches ``log(1/T)`` in
``[-10, 10]``); a result at a bound means the likelihood keeps improving beyond it.

Samples whose observed class has probability exactly 0 have likelihood 0 for every ``T``: they
carry no information about ``T`` and are left out of ``L`` (all of them -> :class:`InputError`).
"""

from __future__ import annotations

import math

import numpy as np

from lpcal.errors import InputError, shown
from lpcal.io import DEFAULT_TOL, validate_labels, validate_probs

LOG_T_BOUNDS = (-10.0, 10.0)
"""Default search interval for ``log T`` (scikit-learn's)."""

_GOLDEN = 0.5 * (3.0 - math.sqrt(5.0))
_SQRT_EPS = math.sqrt(np.finfo(np.float64).eps)


def _log_probs(x: np.ndarray) -> np.ndarray:
    """``log x`` with ``-inf`` at zeros (without a divide-by-zero warning)."""
    z = np.full(x.shape, -np.inf)
    np.log(x, out=z, where=x > 0)
    return z


def check_temperature(temperature) -> float:
    """A positive finite float, else :class:`InputError` saying what was given."""
    return _check_t(temperature)


def _check_t(temperature) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise InputError(f"temperature must be a positive number, got {shown(temperature)}") from None
    if not (t > 0.0 and math.isfinite(t)):
        raise InputError(f"temperature must be positive and finite, got {shown(temperature)}")
    return t


def apply_temperature(probs, temperature: float, *, tol: float = DEFAULT_TOL) -> np.ndarray:
    """``softmax(log(probs) / T)`` row-wise (zeros stay zero); ``T = 1`` just renormalises."""
    t = _check_t(temperature)
    x = validate_probs(probs, "probs", tol=tol)
    z = _log_probs(x)
    z -= z.max(axis=1, keepdims=True)  # row max is finite: every row has a positive entry
    e = np.exp(z / t)
    return e / e.sum(axis=1, keepdims=True)


class _Objective:
    """NLL of ``softmax(z / T)`` as a function of ``log T``, with ``z`` shifted so ``max_j z = 0``."""

    def __init__(self, probs: np.ndarray, labels: np.ndarray):
        z = _log_probs(probs)
        z -= z.max(axis=1, keepdims=True)
        rows = np.arange(z.shape[0])
        keep = np.isfinite(z[rows, labels])
        if not keep.any():
            raise InputError(
                "temperature scaling: every sample gives probability 0 to its observed class"
            )
        self.z = z[keep]
        self.zy = z[rows, labels][keep]
        self.n_used = int(keep.sum())
        self._buf = np.empty_like(self.z)
        self.evals = 0

    def __call__(self, log_t: float) -> float:
        self.evals += 1
        b = math.exp(-log_t)  # inverse temperature
        e = np.multiply(self.z, b, out=self._buf)
        np.exp(e, out=e)
        lse = np.log(e.sum(axis=1))  # >= log 1 = 0, since max_j z = 0
        return float(np.mean(lse) - b * np.mean(self.zy))


def nll_at_temperature(probs, labels, temperature: float, *, tol: float = DEFAULT_TOL) -> float:
    """The fitted objective ``L(T)`` (mean NLL in nats over samples with ``f_y > 0``)."""
    t = _check_t(temperature)
    x = validate_probs(probs, "probs", tol=tol)
    y = validate_labels(labels, x.shape[1], "labels", n=x.shape[0])
    return _Objective(x, y)(math.log(t))


def _brent_bounded(f, a: float, b: float, xatol: float, maxiter: int) -> tuple[float, float, int]:
    """Minimise a unimodal ``f`` on ``[a, b]`` (Brent 1973 / FMM ``fmin``). Returns (x, f(x), evals).

    Stops when the bracket around the best point is within ``2 * (sqrt(eps) |x| + xatol / 3)``.
    """
    v = w = x = a + _GOLDEN * (b - a)
    fv = fw = fx = f(x)
    d = e = 0.0
    evals = 1
    while evals < maxiter:
        xm = 0.5 * (a + b)
        tol1 = _SQRT_EPS * abs(x) + xatol / 3.0
        tol2 = 2.0 * tol1
        if abs(x - xm) <= tol2 - 0.5 * (b - a):
            break
        golden = True
        if abs(e) > tol1:  # try a parabola through (v, fv), (w, fw), (x, fx)
            r = (x - w) * (fx - fv)
            q = (x - v) * (fx - fw)
            pnum = (x - v) * q - (x - w) * r
            q = 2.0 * (q - r)
            if q > 0.0:
                pnum = -pnum
            q = abs(q)
            e_old, e = e, d
            if abs(pnum) < abs(0.5 * q * e_old) and q * (a - x) < pnum < q * (b - x):
                d = pnum / q
                u = x + d
                if (u - a) < tol2 or (b - u) < tol2:
                    d = tol1 if xm >= x else -tol1
                golden = False
        if golden:
            e = (a - x) if x >= xm else (b - x)
            d = _GOLDEN * e
        u = x + (d if abs(d) >= tol1 else (tol1 if d >= 0 else -tol1))
        fu = f(u)
        evals += 1
        if fu <= fx:
            if u >= x:
                a = x
            else:
                b = x
            v, fv, w, fw, x, fx = w, fw, x, fx, u, fu
        else:
            if u < x:
                a = u
            else:
                b = u
            if fu <= fw or w == x:
                v, fv, w, fw = w, fw, u, fu
            elif fu <= fv or v == x or v == w:
                v, fv = u, fu
    return x, fx, evals


def fit_temperature(
    probs,
    labels,
    *,
    log_t_bounds: tuple[float, float] = LOG_T_BOUNDS,
    xatol: float = 1e-9,
    maxiter: int = 200,
    tol: float = DEFAULT_TOL,
) -> float:
    """The NLL-minimising temperature ``T`` for ``softmax(log(probs) / T)`` (see module docstring).

    ``log_t_bounds``: search interval for ``log T`` (default ``[-10, 10]``, scikit-learn's).
    ``xatol``: absolute tolerance on ``log T`` (plus Brent's relative ``sqrt(eps) |log T|``).
    """
    x = validate_probs(probs, "probs", tol=tol)
    y = validate_labels(labels, x.shape[1], "labels", n=x.shape[0])
    try:
        lo, hi = (float(v) for v in log_t_bounds)
    except (TypeError, ValueError):
        raise InputError(f"log_t_bounds must be two numbers, got {log_t_bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InputError(f"log_t_bounds must be finite with lower < upper, got {log_t_bounds!r}")
    if not (xatol > 0.0):
        raise InputError(f"xatol must be positive, got {shown(xatol)}")
    log_t, _, _ = _brent_bounded(_Objective(x, y), lo, hi, float(xatol), int(maxiter))
    return math.exp(log_t)
