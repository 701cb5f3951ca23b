"""The synthetic model: a seeded, overconfident ``k``-class classifier with a known truth.

:class:`SyntheticModel` draws logits ``z ~ N(0, scale^2) - skew * log(j + 1)`` (``j = 0..k-1``; a
few dominant classes when ``skew > 0``), predicts ``f = softmax(z)``, and has the TRUE conditional
label distribution ``q = softmax(T log f)``, i.e. ``q_j ∝ f_j^T``; ``T < 1`` makes ``f``
overconfident. Labels are drawn from ``q``. The true ``Err_p`` and Brier score of any predictions
of it are :func:`lpcal.metrics.err_p_true` and :func:`lpcal.metrics.brier_true` of ``q``.

A *logit-scale drift* ``s`` (``draw(..., logit_scale=s)``) multiplies the logits the model
outputs, ``f = softmax(s z)``, while the truth stays ``q = softmax(T log softmax(z))``: the
deployed model changed, the world did not (``s = 0.5``: under-confident relative to before, as
the halved logits of the drift benchmark; ``s = 2``: over-confident). In terms of the drifted
predictions ``q = softmax((T / s) log f)``, so temperature scaling still fixes it exactly.

Usage::

    f, q, y = SyntheticModel("m", 3, 0.3, 5.0, 0.0, seed=9).sample(100_000)
    err_p_true(f, q, lam=20, p=2.0)          # from lpcal.metrics
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from daemon.limits import MAX_MODEL_LEN
from lpcal.errors import InputError
from lpcal.io import softmax_rows

__all__ = ["SyntheticModel", "true_label_dist"]


def true_label_dist(f: np.ndarray, T: float | np.ndarray) -> np.ndarray:
    """``q = softmax(T log f)`` row-wise (``q_j ∝ f_j^T``); ``T`` a scalar or one per row."""
    f = np.asarray(f, dtype=np.float64)
    T = np.asarray(T, dtype=np.float64)
    if T.ndim == 1:
        T = T[:, None]
    z = np.log(np.maximum(f, 1e-300)) * T
    return softmax_rows(z, out=z)


class SyntheticModel:
    """A seeded, overconfident ``k``-class model (see the module docstring for the math).

    Draws are sequential: the logits and the labels come from two generators spawned from
    ``seed``, so ``draw(a)`` then ``draw(b)`` equals ``draw(a + b)`` (chunking does not matter).
    """

    def __init__(self, model_id: str, k: int, T: float, scale: float, skew: float = 0.0,
                 seed: int | Sequence[int] = 0):
        where = f"SyntheticModel {model_id!r}"
        if not isinstance(model_id, str) or not 0 < len(model_id) <= MAX_MODEL_LEN:
            raise InputError(f"{where}: model id must be a string of 1..{MAX_MODEL_LEN} chars")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
            raise InputError(f"{where}: k must be an integer >= 2, got {k!r}")
        for name, v in (("T", T), ("scale", scale), ("skew", skew)):
            if not math.isfinite(float(v)):
                raise InputError(f"{where}: {name} must be finite, got {v!r}")
        if T <= 0:
            raise InputError(f"{where}: T must be > 0, got {T}")
        if scale < 0:
            raise InputError(f"{where}: scale must be >= 0, got {scale}")
        self.model_id, self.k = model_id, int(k)
        self.T, self.scale, self.skew = float(T), float(scale), float(skew)
        ss = np.random.SeedSequence(seed)
        self._rng_z, self._rng_y = (np.random.default_rng(s) for s in ss.spawn(2))
        self._offset = -self.skew * np.log(np.arange(1, self.k + 1, dtype=np.float64))

    def __repr__(self) -> str:
        return (f"SyntheticModel({self.model_id!r}, k={self.k}, T={self.T}, scale={self.scale}, "
                f"skew={self.skew})")

    def draw(self, n: int, T: float | np.ndarray | None = None,
             logit_scale: float | np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(logits, f, q, y)`` of ``n`` events; ``T`` overrides the model's (scalar or per row);
        ``logit_scale`` (scalar or per row, > 0) multiplies the logits the model outputs.

        With ``z`` the model's logits, ``q = softmax(T log softmax(z))``, ``y ~ q`` (inverse CDF
        of one uniform per row), and the output logits are ``s z`` with ``f = softmax(s z)``
        (``s = 1`` when ``logit_scale`` is None). The random draws do not depend on ``T`` or
        ``logit_scale``, so a drift changes the events, not the stream of draws.
        """
        z = self._rng_z.normal(size=(n, self.k)) * self.scale + self._offset
        f = softmax_rows(z)
        q = true_label_dist(f, self.T if T is None else T)
        if logit_scale is not None:
            s = np.asarray(logit_scale, dtype=np.float64)
            if not np.all(np.isfinite(s) & (s > 0)):
                raise InputError(f"SyntheticModel {self.model_id!r}: logit_scale must be > 0")
            z = z * (s[:, None] if s.ndim == 1 else s)
            f = softmax_rows(z)
        u = self._rng_y.random(n)
        y = (np.cumsum(q, axis=1) > u[:, None]).argmax(axis=1)
        # float rounding: cumsum may end just below u ~ 1; such rows take the last class with q > 0
        short = np.cumsum(q, axis=1)[:, -1] <= u
        if short.any():
            y[short] = q.shape[1] - 1 - np.argmax(q[short, ::-1] > 0, axis=1)
        return z, f, q, y.astype(np.int64)

    def sample(self, n: int, T: float | None = None, logit_scale: float | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(f, q, y)`` of ``n`` fresh events (as ``tests/test_oracle.py``'s ``synth``)."""
        _, f, q, y = self.draw(n, T, logit_scale)
        return f, q, y
