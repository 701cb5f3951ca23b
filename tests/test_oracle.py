"""Oracle test: the TRUE Err_p of the fitted h, computed from known conditional label probabilities.

Synthetic overconfident model: logits ~ N(0, s^2) - skew * log(j + 1) (a few dominant classes when
skew > 0), f = softmax(logits), and the true label distribution is q = softmax(T log f) with T < 1.
On fresh samples, Err(h, v, j) = |E[(h_j - q_j) 1[R(h) = v]]| is estimated with q in place of the
one-hot label (no label noise), and the true Brier score is E[||h||^2 - 2 <h, q> + 1].

Each case first checks that the raw model violates eps (so the test is not vacuous), then that
Err_p(h) <= eps and Brier(h) <= Brier(f) + 0.01, at the stated practical pool sizes (the pool size
is per pool; the sample is split over 1 + 2L pools, L = floor(log2(6 / beta)) + 1).
"""

import math
import warnings

import numpy as np
import pytest

from lpcal.calibrate import fit
from lpcal.levels import beta_for, bin_counts, group_rows
from lpcal.pools import n_levels, pool_names


def synth(n, k, T, scale, skew, seed):
    r = np.random.default_rng(seed)
    logits = r.normal(size=(n, k)) * scale - skew * np.log(np.arange(1, k + 1))
    f = np.exp(logits - logits.max(axis=1, keepdims=True))
    f /= f.sum(axis=1, keepdims=True)
    q = np.exp(np.log(np.maximum(f, 1e-300)) * T)
    q /= q.sum(axis=1, keepdims=True)
    y = (q.cumsum(axis=1) > r.random(n)[:, None]).argmax(axis=1)
    return f, q, y


def true_err_p(h, q, lam, p):
    c = bin_counts(h, lam)
    _, _, inv = group_rows(c, exact=True)
    d = np.zeros((inv.max() + 1, h.shape[1]))
    np.add.at(d, inv, h - q)
    d = np.abs(d) / h.shape[0]
    return float(d.max()) if math.isinf(p) else float((d**p).sum() ** (1.0 / p))


def true_brier(h, q):
    return float(np.mean(np.sum(h * h, axis=1) - 2.0 * np.sum(h * q, axis=1) + 1.0))


CASES = [  # k, p, eps, pool size, T, scale, skew
    (3, math.inf, 0.03, 20_000, 0.15, 12.0, 0.0),
    (3, 2.0, 0.05, 10_000, 0.15, 12.0, 0.0),
    (10, math.inf, 0.02, 20_000, 0.15, 12.0, 0.0),
    (10, 2.0, 0.03, 10_000, 0.15, 12.0, 0.0),
    (100, math.inf, 0.02, 10_000, 0.10, 12.0, 8.0),
    (100, 2.0, 0.03, 10_000, 0.10, 12.0, 8.0),
]


@pytest.mark.parametrize("variant", ["split", "shared"])
@pytest.mark.parametrize("k,p,eps,pool,T,scale,skew", CASES)
def test_true_error_below_eps(k, p, eps, pool, T, scale, skew, variant):
    beta = beta_for(eps, p)
    n = len(pool_names(n_levels(beta), variant)) * pool
    f, _, y = synth(n, k, T, scale, skew, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mu-pool warning is expected for p = 2
        bm = fit(f, y, eps=eps, p=p, pool_size=pool, variant=variant, seed=3)
    f2, q2, _ = synth(100_000, k, T, scale, skew, seed=7)
    h = bm.apply(f2)
    raw, cal = true_err_p(f2, q2, bm.lam, p), true_err_p(h, q2, bm.lam, p)
    assert raw > eps, f"test is vacuous: the raw model already meets eps ({raw:.4f})"
    assert cal <= eps, f"Err_p(h) = {cal:.4f} > eps = {eps} ({bm.stop_reason})"
    assert true_brier(h, q2) <= true_brier(f2, q2) + 0.01
