"""Baseline calibrators of the quality benchmark: scaling, isotonic and histogram binning.

Every class has ``fit(probs, labels) -> self`` and ``predict(probs) -> probs``: ``probs`` is an
``(n, k)`` array of probability rows, ``labels`` an ``(n,)`` array of classes in ``[0, k)``, and
``predict`` returns ``(n, k)`` float64 rows on the simplex (non-negative, summing to 1).

* :class:`TemperatureScaling`: one temperature for all classes (Guo et al. 2017).
* :class:`VectorScaling`: a scale and a bias per class on the log-probabilities (Guo et al. 2017).
* :class:`IsotonicOvR`: isotonic regression per class, one-vs-rest (Zadrozny & Elkan 2002).
* :class:`HistogramBinningOvR`: equal-mass histogram binning per class, one-vs-rest (Zadrozny &
  Elkan 2001).

The one-vs-rest methods calibrate each class score ``f_j`` separately into ``g_j(f_j)`` and then
renormalise, ``h_j = g_j(f_j) / sum_i g_i(f_i)``; a row whose calibrated scores are all 0 (possible
when no fitted class explains the region of the input) becomes the uniform vector ``1/k``, as in
scikit-learn's ``CalibratedClassifierCV``.

netcal (``pip install netcal``) is not wrapped: its 1.4.0 release requires torch, gpytorch and
pyro-ppl even for its numpy methods, which the benchmark does not pull in.

scikit-learn and scipy (the ``test`` extra) are imported lazily, inside the methods that need
them.
"""

from __future__ import annotations

import numpy as np

from lpcal.io import softmax_rows, validate_labels, validate_probs
from lpcal.temperature import apply_temperature, fit_temperature

LOG_FLOOR = 1e-30
"""Probabilities are clipped below at this value before a log (``log 1e-30 = -69``)."""


def _check_fit(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    x = validate_probs(probs, "probs")
    return x, validate_labels(labels, x.shape[1], "labels", n=x.shape[0])


def _check_predict(obj, probs) -> np.ndarray:
    k = getattr(obj, "k_", None)
    if k is None:
        raise RuntimeError(f"{type(obj).__name__}: call fit() before predict()")
    return validate_probs(probs, "probs", expected_k=k)


def _renormalise(g: np.ndarray) -> np.ndarray:
    """Rows of ``g >= 0`` divided by their sums; all-zero rows become uniform ``1/k``."""
    s = g.sum(axis=1, keepdims=True)
    zero = s[:, 0] <= 0.0
    out = np.divide(g, s, out=np.zeros_like(g), where=s > 0.0)
    out[zero] = 1.0 / g.shape[1]
    return out


class TemperatureScaling:
    r"""Temperature scaling (Guo et al. 2017) on probability vectors.

    .. math:: h(f)_j = \frac{f_j^{1/T}}{\sum_i f_i^{1/T}} = \mathrm{softmax}(\log f / T)_j,

    with :math:`T > 0` minimising the NLL on the fit data
    (:func:`lpcal.temperature.fit_temperature`, bounded search on :math:`\log T`).

    Attributes
    ----------
    temperature_ : float
        The fitted temperature (``> 1`` softens an overconfident model).
    k_ : int
        Number of classes seen by ``fit``.
    """

    def fit(self, probs, labels) -> TemperatureScaling:
        """Fit :math:`T` by NLL on ``(probs, labels)``; returns ``self``."""
        x, y = _check_fit(probs, labels)
        self.temperature_ = fit_temperature(x, y)
        self.k_ = x.shape[1]
        return self

    def predict(self, probs) -> np.ndarray:
        """Apply the fitted temperature; returns (n, k) rows on the simplex."""
        return apply_temperature(_check_predict(self, probs), self.temperature_)


class VectorScaling:
    r"""Vector scaling (Guo et al. 2017): a scale and a bias per class on the log-probabilities.

    With :math:`z = \log \max(f, 10^{-30})` playing the logits,

    .. math:: h(f) = \mathrm{softmax}(a \odot z + b), \qquad a, b \in \mathbb{R}^k,

    fitted by minimising the mean negative log-likelihood plus an optional ridge penalty towards
    the identity map (:math:`a = 1, b = 0`),

    .. math::
        L(a, b) = \frac{1}{n} \sum_i \Big[ \log \sum_j e^{u_{ij}} - u_{i y_i} \Big]
                  + \frac{\rho}{2} \big( \lVert a - 1 \rVert^2 + \lVert b \rVert^2 \big),
        \qquad u_{ij} = a_j z_{ij} + b_j,

    whose gradient, with :math:`h_{ij} = \mathrm{softmax}(u_i)_j` and one-hot :math:`Y`, is

    .. math::
        \partial L / \partial a_j = \frac{1}{n} \sum_i (h_{ij} - Y_{ij}) z_{ij} + \rho (a_j - 1),
        \qquad
        \partial L / \partial b_j = \frac{1}{n} \sum_i (h_{ij} - Y_{ij}) + \rho b_j.

    :math:`L` is convex in :math:`(a, b)` (log-sum-exp of affine functions minus an affine
    function); it is minimised by L-BFGS (``scipy.optimize.minimize``) with this analytic
    gradient, starting from the identity. Without the penalty :math:`b` is determined up to a
    common constant, which the softmax ignores.

    Parameters
    ----------
    reg : float, default 0
        Ridge weight :math:`\rho \ge 0` (0: plain maximum likelihood, as Guo et al.).
    maxiter : int, default 1000
        Iteration limit of L-BFGS.

    Attributes
    ----------
    scale_, bias_ : ndarray of shape (k,)
        The fitted :math:`a` and :math:`b`.
    k_ : int
        Number of classes.
    result_ : scipy.optimize.OptimizeResult
        The optimiser's report.
    """

    def __init__(self, reg: float = 0.0, maxiter: int = 1000):
        if not reg >= 0.0:
            raise ValueError(f"reg must be >= 0, got {reg!r}")
        self.reg = float(reg)
        self.maxiter = int(maxiter)

    @staticmethod
    def logits(probs: np.ndarray) -> np.ndarray:
        """:math:`z = \\log \\max(f, 10^{-30})`."""
        return np.log(np.maximum(probs, LOG_FLOOR))

    def objective(
        self, params: np.ndarray, z: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """``(L, grad L)`` at ``params = concat(a, b)`` for logits ``z`` (n, k), labels ``y``."""
        n, k = z.shape
        a, b = params[:k], params[k:]
        u = z * a + b
        u -= u.max(axis=1, keepdims=True)
        e = np.exp(u)
        s = e.sum(axis=1)
        rows = np.arange(n)
        loss = float(np.mean(np.log(s) - u[rows, y]))
        r = e / s[:, None]
        r[rows, y] -= 1.0  # h - Y
        ga = np.einsum("ij,ij->j", r, z) / n
        gb = r.sum(axis=0) / n
        if self.reg:
            loss += 0.5 * self.reg * (float(np.sum((a - 1.0) ** 2)) + float(np.sum(b * b)))
            ga += self.reg * (a - 1.0)
            gb += self.reg * b
        return loss, np.concatenate([ga, gb])

    def fit(self, probs, labels) -> VectorScaling:
        """Fit :math:`(a, b)` by penalised NLL with L-BFGS; returns ``self``."""
        from scipy.optimize import minimize

        x, y = _check_fit(probs, labels)
        k = x.shape[1]
        z = self.logits(x)
        x0 = np.concatenate([np.ones(k), np.zeros(k)])
        res = minimize(self.objective, x0, args=(z, y), jac=True, method="L-BFGS-B",
                       options={"maxiter": self.maxiter})
        self.scale_, self.bias_ = res.x[:k].copy(), res.x[k:].copy()
        self.bias_ -= self.bias_.mean()  # fix the free constant (no effect on the softmax)
        self.result_ = res
        self.k_ = k
        return self

    def predict(self, probs) -> np.ndarray:
        """:math:`\\mathrm{softmax}(a \\odot z + b)`; returns (n, k) rows on the simplex."""
        x = _check_predict(self, probs)
        return softmax_rows(self.logits(x) * self.scale_ + self.bias_)


class IsotonicOvR:
    r"""Isotonic regression per class, one-vs-rest, then renormalised (Zadrozny & Elkan 2002).

    For each class :math:`j`, :math:`g_j` is the non-decreasing function minimising
    :math:`\sum_i (g_j(f_{ij}) - 1[y_i = j])^2` (pool-adjacent-violators,
    ``sklearn.isotonic.IsotonicRegression`` with outputs in [0, 1], linear interpolation between
    the fitted points and constant extrapolation outside them). Then

    .. math:: h_j = \frac{g_j(f_j)}{\sum_i g_i(f_i)},

    and rows with :math:`\sum_i g_i(f_i) = 0` become uniform. A class never observed during
    ``fit`` gets :math:`g_j \equiv 0`.

    Attributes
    ----------
    models_ : list of sklearn.isotonic.IsotonicRegression
        One fitted regression per class.
    k_ : int
        Number of classes.
    """

    def fit(self, probs, labels) -> IsotonicOvR:
        """Fit one isotonic regression per class on ``(f_j, 1[y = j])``; returns ``self``."""
        from sklearn.isotonic import IsotonicRegression

        x, y = _check_fit(probs, labels)
        k = x.shape[1]
        self.models_ = [
            IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(
                x[:, j], (y == j).astype(np.float64))
            for j in range(k)
        ]
        self.k_ = k
        return self

    def predict(self, probs) -> np.ndarray:
        """Calibrate each column, renormalise; returns (n, k) rows on the simplex."""
        x = _check_predict(self, probs)
        g = np.column_stack([m.predict(x[:, j]) for j, m in enumerate(self.models_)])
        return _renormalise(np.clip(g, 0.0, 1.0))


class HistogramBinningOvR:
    r"""Equal-mass histogram binning per class, one-vs-rest, renormalised (Zadrozny & Elkan 2001).

    For each class :math:`j` the fit scores :math:`f_{ij}` are cut into ``n_bins`` bins at their
    empirical quantiles :math:`e_{jb} = Q_j(b / B)`, right-closed as in
    :func:`lpcal.metrics.top_label_ece` (the first bin also holds everything below :math:`e_{j1}`,
    the last everything above). The calibrated score of bin :math:`b` is the frequency of the
    class among the fit samples in it,

    .. math::
        \theta_{jb} = \frac{\sum_i 1[f_{ij} \in b]\, 1[y_i = j]}{\sum_i 1[f_{ij} \in b]},
        \qquad g_j(f_j) = \theta_{j, b(f_j)}, \qquad h_j = \frac{g_j(f_j)}{\sum_i g_i(f_i)}.

    A bin without fit samples (between tied quantiles, or above a tie at the largest scores) takes
    the middle of its edges, i.e. roughly keeps the score; rows whose calibrated scores are all 0
    become uniform; a class never observed during ``fit`` gets :math:`g_j \equiv 0` (except in
    such empty bins).

    Parameters
    ----------
    n_bins : int, default 15
        Number :math:`B` of equal-mass bins per class.

    Attributes
    ----------
    edges_ : ndarray of shape (k, n_bins - 1)
        Inner bin edges per class (non-decreasing along each row).
    values_ : ndarray of shape (k, n_bins)
        :math:`\theta_{jb}`.
    k_ : int
        Number of classes.
    """

    def __init__(self, n_bins: int = 15):
        if int(n_bins) < 1:
            raise ValueError(f"n_bins must be >= 1, got {n_bins!r}")
        self.n_bins = int(n_bins)

    def _bins(self, x: np.ndarray) -> np.ndarray:
        """Flat cell index ``j * n_bins + b`` of every entry of ``x`` (n, k)."""
        k, nb = self.k_, self.n_bins
        # classes side by side on one sorted axis: scores and edges of class j shifted by 2j
        shift = 2.0 * np.arange(k)
        flat_edges = (self.edges_ + shift[:, None]).ravel()
        pos = np.searchsorted(flat_edges, x + shift, side="left")
        b = pos - np.arange(k) * (nb - 1)
        return b + np.arange(k) * nb

    def fit(self, probs, labels) -> HistogramBinningOvR:
        """Find the per-class quantile edges and bin frequencies; returns ``self``."""
        x, y = _check_fit(probs, labels)
        n, k = x.shape
        nb = self.n_bins
        levels = np.linspace(0.0, 1.0, nb + 1)[1:-1]
        self.edges_ = np.quantile(x, levels, axis=0).T.reshape(k, nb - 1)
        self.k_ = k
        cell = self._bins(x)
        counts = np.bincount(cell.ravel(), minlength=k * nb).reshape(k, nb)
        hits = np.bincount(cell[np.arange(n), y], minlength=k * nb).reshape(k, nb)
        lo = np.concatenate([np.zeros((k, 1)), self.edges_], axis=1)
        hi = np.concatenate([self.edges_, np.ones((k, 1))], axis=1)
        empty = 0.5 * (lo + hi)
        self.values_ = np.divide(hits, counts, out=empty, where=counts > 0)
        return self

    def predict(self, probs) -> np.ndarray:
        """Replace each score by its bin frequency, renormalise; rows on the simplex."""
        x = _check_predict(self, probs)
        return _renormalise(self.values_.ravel()[self._bins(x)])


BASELINES = {
    "temperature": TemperatureScaling,
    "vector scaling": VectorScaling,
    "isotonic OvR": IsotonicOvR,
    "histogram OvR (15 bins)": HistogramBinningOvR,
}
"""Method name -> class (constructed with its defaults) used by the benchmark scripts."""
