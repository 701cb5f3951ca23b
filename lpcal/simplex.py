"""Euclidean projection onto the probability simplex, ``pi(v) = argmin_{u in Delta_k} ||u - v||_2``.

Sort-based algorithm (Held, Wolfe & Crowder 1974; Duchi, Shalev-Shwartz, Singer & Chandra 2008):
sort ``v`` decreasingly into ``s``, find ``rho = max{j : s_j - (sum_{i<=j} s_i - 1)/j > 0}``, set
``theta = (sum_{i<=rho} s_i - 1)/rho`` and return ``max(v - theta, 0)``. The KKT conditions are
``u_i = v_i - theta`` where ``u_i > 0`` and ``v_i - theta <= 0`` where ``u_i = 0``.

Complexity ``O(n k log k)`` for ``n`` rows, vectorised over rows.

:func:`lift_zeros` lifts the exact zeros of given classes to a floor by mixing a row with the
uniform vector on those classes (the probability floor of published bin maps).
"""

from __future__ import annotations

import numpy as np


def project_simplex(v: np.ndarray) -> np.ndarray:
    """Project each row of ``v`` (shape ``(k,)`` or ``(n, k)``) onto the probability simplex."""
    x = np.asarray(v, dtype=np.float64)
    one_d = x.ndim == 1
    x = np.atleast_2d(x)
    n, k = x.shape
    s = -np.sort(-x, axis=1)
    css = np.cumsum(s, axis=1) - 1.0
    j = np.arange(1, k + 1, dtype=np.float64)
    cond = s - css / j > 0
    r = k - np.argmax(cond[:, ::-1], axis=1)  # last index where cond holds (1-based)
    theta = css[np.arange(n), r - 1] / r
    out = np.maximum(x - theta[:, None], 0.0)
    return out[0] if one_d else out


def projection_threshold(v: np.ndarray) -> np.ndarray:
    """``theta`` of each row's projection: ``u = max(v - theta, 0)`` (used by KKT checks)."""
    x = np.atleast_2d(np.asarray(v, dtype=np.float64))
    u = project_simplex(x)
    pos = u > 0
    return np.sum(np.where(pos, x - u, 0.0), axis=1) / pos.sum(axis=1)



def lift_zeros(v: np.ndarray, classes: np.ndarray, eta: float, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """Rows of ``v`` (on the simplex) with no exact 0 on ``classes``: the probability floor.

    ``classes`` is a boolean mask of length ``k`` (``m`` classes true). A row with a 0 on one of
    them becomes the mixture ``(1 - m eta) u + eta 1_classes``: still on the simplex, at least
    ``eta`` on every class of ``classes``, and ``||u' - u||_1 <= 2 m eta``. Other rows are left
    exactly as they are. Requires ``0 <= m eta < 1``. ``out`` (may be ``v``) receives the result;
    by default a new array.
    """
    x = np.array(v, dtype=np.float64) if out is None else out
    if out is not None and out is not v:
        np.copyto(x, v)
    mask = np.asarray(classes, dtype=bool)
    m = int(mask.sum())
    if not 0.0 <= m * eta < 1.0:
        raise ValueError(f"floor {eta} on {m} classes does not fit on the simplex")
    if x.size == 0 or m == 0 or eta <= 0.0:
        return x
    rows = x[None, :] if x.ndim == 1 else x  # views: writes land in x
    if rows.min() > 0.0:  # the usual case, one pass without temporaries
        return x
    k = rows.shape[1]
    flat = np.flatnonzero(rows.ravel() <= 0.0)  # zeros are few: index them, not every row
    if m < k:
        flat = flat[mask[flat % k]]
    low = np.unique(flat // k)
    if low.size:
        rows[low] *= 1.0 - m * eta
        rows[np.ix_(low, np.flatnonzero(mask))] += eta
    return x
