"""Euclidean projection onto the probability simplex, ``pi(v) = argmin_{u in Delta_k} ||u - v||_2``.

Sort-based algorithm (Held, Wolfe & Crowder 1974; Duchi, Shalev-Shwartz, Singer & Chandra 2008):
sort ``v`` decreasingly into ``s``, find ``rho = max{j : s_j - (sum_{i<=j} s_i - 1)/j > 0}``, set
``theta = (sum_{i<=rho} s_i - 1)/rho`` and return ``max(v - theta, 0)``. The KKT conditions are
``u_i = v_i - theta`` where ``u_i > 0`` and ``v_i - theta <= 0`` where ``u_i = 0``.

Complexity ``O(n k log k)`` for ``n`` rows, vectorised over rows.
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
