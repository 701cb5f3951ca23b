"""The temperature-grid kernels against straightforward references, to the bit.

The grid NLL (:class:`lpcal.precalibrate.TemperatureGrid`), the warm-up score sums
(:class:`lpcal.warmup.WarmupSums`) and the held-out loss grid (:class:`lpcal.challenger.LossGrid`)
share one pass of exponentials (:func:`lpcal.precalibrate.grid_exp`, classes first, sums in
numpy's pairwise order). Their integer sums must be exactly those of the direct computation
below (rows by grid by classes, numpy's own sums), which is what the kernels computed before
they shared the pass: any change in a rounding would show here as a different integer sooner or
later, and the float-level checks catch a different summation order at once.
"""

import numpy as np
import pytest

from lpcal.challenger import LOSS_GRID_LOG2_T, LossGrid
from lpcal.challenger import NLL_CLIP as LOSS_CLIP
from lpcal.challenger import SCALE as LOSS_SCALE
from lpcal.pools import PoolLayout
from lpcal.precalibrate import (
    GRID_LOG2_T,
    GUESS_ROWS,
    NLL_CLIP,
    NLL_SCALE,
    TemperatureGrid,
    fit_grid_temperature,
    grid_exp,
    pairwise_planes,
    shifted_log,
)
from lpcal.warmup import CLIP, SCALE, WarmupSums
from lpcal.window import SlidingWindow

INV_T = 2.0 ** -GRID_LOG2_T
LOSS_INV_T = 2.0 ** -LOSS_GRID_LOG2_T


# ------------------------------------------------------------------ references
def _q_ref(x, inv_t):
    """Shifted log-probabilities and ``q[i, g] = softmax(z_i inv_t[g])`` (rows, grid, classes)."""
    with np.errstate(divide="ignore"):
        z = np.log(x)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z[:, None, :] * inv_t[None, :, None])
    s = e.sum(axis=2)
    return z, e, s


def grid_nll_ref(x, y):
    keep = x[np.arange(len(y)), y] > 0
    x, y = x[keep], y[keep]
    z, _, s = _q_ref(x, INV_T)
    zy = z[np.arange(len(y)), y]
    term = np.log(s) - zy[:, None] * INV_T
    q = np.rint(np.minimum(term, NLL_CLIP) * NLL_SCALE).astype(np.int64)
    return q.sum(axis=0), int(len(keep) - keep.sum())


def score_ref(x, y):
    keep = x[np.arange(len(y)), y] > 0
    x, y = x[keep], y[keep]
    z, e, s = _q_ref(x, INV_T)
    e /= s[:, :, None]
    zy = z[np.arange(len(y)), y]
    zf = np.where(np.isfinite(z), z, 0.0)
    m1 = np.einsum("mgk,mk->mg", e, zf)
    m2 = np.einsum("mgk,mk->mg", e, zf * zf)
    gap = m1 - zy[:, None]
    sc = -INV_T * gap
    h = INV_T**2 * np.maximum(m2 - m1 * m1, 0.0) + INV_T * gap
    return [np.rint(np.clip(v, -CLIP, CLIP) * SCALE).astype(np.int64).sum(axis=0)
            for v in (sc, sc * sc, h)]


def loss_grid_ref(x, y):
    _, e, s = _q_ref(x, LOSS_INV_T)
    e /= s[:, :, None]
    qy = e[np.arange(len(y)), :, y]
    with np.errstate(divide="ignore"):
        per = {"brier": np.einsum("mgk,mgk->mg", e, e) - 2.0 * qy + 1.0,
               "nll": np.minimum(-np.log(qy), LOSS_CLIP)}
    out = {}
    for loss, v in per.items():
        q = np.rint(v * LOSS_SCALE).astype(np.int64)
        iu = np.triu_indices(q.shape[1])
        out[loss] = (q.sum(axis=0), (q.T @ q)[iu])   # int64 products: exact
    return out


def sample(rng, n, k, zeros=0.03):
    """Rows of widely varying sharpness (logit scales 0.3 to 12), some exact zeros."""
    z = rng.normal(size=(n, k)) * rng.uniform(0.3, 12.0, (n, 1))
    x = np.exp(z - z.max(axis=1, keepdims=True))
    x[rng.random((n, k)) < zeros] = 0.0
    x[np.arange(n), rng.integers(0, k, n)] += 1e-3
    x /= x.sum(axis=1, keepdims=True)
    return x, rng.integers(0, k, n)


SHAPES = [(1, 2), (7, 3), (300, 7), (1000, 8), (257, 10), (40, 17), (90, 129), (30, 300)]


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("k", [2, 3, 7, 8, 9, 10, 15, 16, 17, 64, 100, 127, 128, 129, 200,
                               257, 1000])
def test_pairwise_planes_adds_in_numpys_row_order(k):
    rng = np.random.default_rng(k)
    a = rng.random((k, 3, 50)) * np.exp(rng.normal(0, 8, (k, 3, 50)))
    rows = np.ascontiguousarray(np.moveaxis(a, 0, -1))
    assert np.array_equal(pairwise_planes(a), rows.sum(axis=-1))


@pytest.mark.parametrize("chunk", [1, 7, 64, None, 5000])
def test_grid_exp_matches_the_direct_exponentials_whatever_the_chunks(chunk):
    rng = np.random.default_rng(1)
    x, _ = sample(rng, 123, 11)
    _, e_ref, s_ref = _q_ref(x, INV_T)
    rows = 0
    for a, b, e, s in grid_exp(shifted_log(x), INV_T, chunk):
        assert a == rows and b > a
        assert np.array_equal(np.moveaxis(e, 0, -1), e_ref[a:b].transpose(1, 0, 2))
        assert np.array_equal(s, s_ref[a:b].T)
        rows = b
    assert rows == 123


@pytest.mark.parametrize("n,k", SHAPES)
def test_grid_and_warmup_sums_equal_the_reference(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    x, y = sample(rng, n, k)
    nll, skipped = grid_nll_ref(x, y)
    g = TemperatureGrid().update(x, y)
    assert np.array_equal(g.nll, nll) and g.skipped == skipped and g.n == n - skipped
    w = WarmupSums().update(x, y)
    assert w.grid == g
    for got, want in zip((w.s, w.s2, w.h), score_ref(x, y)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("n,k", SHAPES)
def test_loss_grid_equals_the_reference(n, k):
    rng = np.random.default_rng(n * 7 + k)
    x, y = sample(rng, n, k)
    lg = LossGrid().update(x, y)
    for loss, (sums, prods) in loss_grid_ref(x, y).items():
        assert np.array_equal(lg.sums[loss], sums), loss
        assert np.array_equal(lg.prods[loss], prods), loss


def test_loss_grid_products_are_exact_at_the_largest_losses():
    """Labels of probability 0 give the clipped log-loss (2^19 units): products near 2^38 per
    sample, summed over thousands of rows, must still be the exact integers."""
    rng = np.random.default_rng(2)
    x, y = sample(rng, 3000, 4, zeros=0.4)
    y = np.where(rng.random(3000) < 0.5, np.argmin(x, axis=1), y)
    lg = LossGrid().update(x, y)
    sums, prods = loss_grid_ref(x, y)["nll"]
    assert prods.max() > 2**48          # beyond float64's exact range per element sum
    assert np.array_equal(lg.sums["nll"], sums) and np.array_equal(lg.prods["nll"], prods)


def test_warmup_feeds_a_grid_the_very_sums_of_its_own():
    rng = np.random.default_rng(3)
    x, y = sample(rng, 500, 10)
    shared = TemperatureGrid().update(x[:17], y[:17])
    w = WarmupSums().update(x[17:], y[17:], grid=shared)
    assert shared == TemperatureGrid().update(x, y)
    assert w == WarmupSums().update(x[17:], y[17:])


def test_window_feeds_the_warmup_its_fit_share():
    rng = np.random.default_rng(4)
    x, y = sample(rng, 2500, 5)
    u = rng.random(2500)
    lay = PoolLayout(5, 10, 1, "shared", {"mu": 7, "PE0": 7}, holdout=6)
    with_warm, plain = (SlidingWindow(lay, bucket_size=400, n_buckets=10, cert_share=0.5)
                        for _ in range(2))
    warm = WarmupSums()
    for a in range(0, 2500, 333):
        with_warm.add(u[a:a + 333], x[a:a + 333], y[a:a + 333], warmup=warm)
        plain.add(u[a:a + 333], x[a:a + 333], y[a:a + 333])
    assert with_warm == plain
    fit = lay.route_uniforms(u) < len(lay.names)
    assert warm == WarmupSums().update(x[fit], y[fit])
    assert warm.grid == plain.grid()


# ------------------------------------------------------------------ the fit's lazy grid
def _tempered(rng, n, k, scale, t_true):
    """Rows ``softmax(scale z)`` with labels drawn from ``softmax(scale z / t_true)``."""
    z = rng.normal(size=(n, k)) * scale
    x = np.exp(z - z.max(axis=1, keepdims=True))
    x /= x.sum(axis=1, keepdims=True)
    q = np.exp((z - z.max(axis=1, keepdims=True)) / t_true)
    q /= q.sum(axis=1, keepdims=True)
    y = (q.cumsum(axis=1) > rng.random((n, 1)) * q.sum(axis=1, keepdims=True)).argmax(axis=1)
    return x, y


@pytest.mark.parametrize("k,t_true", [(2, 0.3), (3, 8.0), (10, 0.5), (10, 1.0), (10, 2.5),
                                      (10, 0.05), (10, 40.0), (100, 0.7), (100, 3.0)])
def test_lazy_grid_fit_is_the_full_grid_fit_to_the_bit(k, t_true):
    """The certified default fits its temperature evaluating only the grid points that can
    matter: the same float as the full grid's fit, also at the ends of the grid."""
    rng = np.random.default_rng(k * 100 + int(t_true * 10))
    n = 3 * GUESS_ROWS if k == 100 else 6 * GUESS_ROWS
    x, y = _tempered(rng, n, k, 3.0, t_true)
    assert fit_grid_temperature(x, y) == TemperatureGrid().update(x, y).fit()


def test_lazy_grid_fit_widens_when_the_guess_is_wrong():
    """The guess comes from every ``n // GUESS_ROWS``-th row: make those rows a different model
    (much sharper labels), so the guessed argmin is far from the true one; the widened search
    still ends at the full grid's fit."""
    rng = np.random.default_rng(5)
    n = 5 * GUESS_ROWS
    x, y = _tempered(rng, n, 10, 3.0, 6.0)
    stride = n // GUESS_ROWS
    xs, ys = _tempered(rng, n, 10, 3.0, 0.1)
    x[::stride], y[::stride] = xs[::stride], ys[::stride]
    guess = TemperatureGrid().update(x[::stride], y[::stride]).fit()
    full = TemperatureGrid().update(x, y).fit()
    assert abs(np.log2(guess) - np.log2(full)) > 1.5      # the guess is more than 3 steps off
    assert fit_grid_temperature(x, y) == full


def test_lazy_grid_fit_with_clipped_terms_and_zero_probabilities():
    """Labels of probability below e^-64 (their NLL is clipped at the sharp end of the grid),
    exact zeros and labels of probability 0 (left out)."""
    rng = np.random.default_rng(6)
    x, y = sample(rng, 4 * GUESS_ROWS, 10, zeros=0.2)
    tiny = rng.random(x.shape[0]) < 0.02
    x[tiny] = np.where(np.arange(10) == 0, 1e-40, 1.0)[None, :]
    x[tiny] /= x[tiny].sum(axis=1, keepdims=True)
    y[tiny] = 0
    assert fit_grid_temperature(x, y) == TemperatureGrid().update(x, y).fit()
    assert fit_grid_temperature(x[:50], y[:50]) == TemperatureGrid().update(x[:50], y[:50]).fit()


def test_lazy_grid_fit_on_a_real_network():
    from tests.bench.common import load_record
    x, y = load_record("lenet-5-cifar-100")
    assert fit_grid_temperature(x, y) == TemperatureGrid().update(x, y).fit()


def test_grid_and_binning_from_a_log_given_are_the_same_to_the_bit():
    """``TemperatureGrid.update(log_probs=...)`` and ``scale_temperature(log_probs=...)`` (the
    window computes ``log f`` once for both) give the very sums and rows of the plain calls,
    with zeros in the rows and rows whose label has probability 0 (skipped)."""
    from lpcal.kernels import scale_temperature
    from lpcal.precalibrate import TemperatureGrid

    rng = np.random.default_rng(5)
    for k, n in ((3, 1), (10, 700), (100, 90)):
        x = rng.dirichlet(np.full(k, 0.4), n)
        x[rng.random((n, k)) < 0.1] = 0.0
        x[:, 0] += 1e-300 * (x.sum(1) == 0)
        x /= x.sum(1, keepdims=True)
        y = rng.integers(0, k, n)
        with np.errstate(divide="ignore"):
            lx = np.log(x)
        keep = lx.copy()
        want, got = TemperatureGrid().update(x, y), TemperatureGrid().update(x, y, log_probs=lx)
        assert got == want and (want.skipped > 0 or n < 50)
        assert np.array_equal(scale_temperature(x, 1.7, log_probs=lx), scale_temperature(x, 1.7))
        assert np.array_equal(lx, keep)  # not modified
