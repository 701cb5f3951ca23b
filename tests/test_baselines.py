"""Tests of the benchmark's baseline calibrators (tests/bench/baselines.py) on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("scipy")
pytest.importorskip("sklearn")

from lpcal.io import softmax_rows
from lpcal.metrics import classwise_ece, nll, top_label_ece
from tests.bench.baselines import (
    BASELINES,
    HistogramBinningOvR,
    IsotonicOvR,
    TemperatureScaling,
    VectorScaling,
)


def _draw(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (q.cumsum(axis=1) > rng.random((q.shape[0], 1))).argmax(axis=1)


def overconfident(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``f = softmax(3 z)`` with labels drawn from ``softmax(z)``, ``z ~ N(0, 1)``."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k))
    return softmax_rows(3.0 * z), _draw(softmax_rows(z), rng)


@pytest.fixture(scope="module")
def fit_eval():
    return overconfident(6000, 5, 1), overconfident(6000, 5, 2)


def assert_simplex(h: np.ndarray, shape: tuple[int, int]) -> None:
    assert h.shape == shape
    assert np.isfinite(h).all()
    assert (h >= 0).all()
    np.testing.assert_allclose(h.sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize("name", list(BASELINES))
def test_rows_on_simplex(name, fit_eval):
    (xf, yf), (xe, _) = fit_eval
    h = BASELINES[name]().fit(xf, yf).predict(xe)
    assert_simplex(h, xe.shape)


@pytest.mark.parametrize("name", list(BASELINES))
def test_improves_ece_of_overconfident_model(name, fit_eval):
    (xf, yf), (xe, ye) = fit_eval
    h = BASELINES[name]().fit(xf, yf).predict(xe)
    before, after = top_label_ece(xe, ye), top_label_ece(h, ye)
    assert before > 0.1  # the synthetic model is badly overconfident
    assert after < 0.5 * before
    assert classwise_ece(h, ye) < classwise_ece(xe, ye)


@pytest.mark.parametrize("cls", [TemperatureScaling, VectorScaling])
def test_scaling_improves_nll(cls, fit_eval):
    (xf, yf), (xe, ye) = fit_eval
    h = cls().fit(xf, yf).predict(xe)
    assert nll(h, ye) < 0.8 * nll(xe, ye)


def test_temperature_recovers_three(fit_eval):
    (xf, yf), _ = fit_eval
    assert TemperatureScaling().fit(xf, yf).temperature_ == pytest.approx(3.0, rel=0.1)


def test_vector_scaling_recovers_per_class_scale():
    rng = np.random.default_rng(7)
    n, k = 40000, 4
    a_true = np.array([0.4, 0.8, 1.2, 1.6])
    b_true = np.array([0.3, -0.2, 0.0, -0.1])
    f = softmax_rows(rng.normal(0.0, 2.0, size=(n, k)))
    y = _draw(softmax_rows(a_true * np.log(f) + b_true), rng)
    vs = VectorScaling().fit(f, y)
    assert vs.result_.success
    np.testing.assert_allclose(vs.scale_, a_true, atol=0.06)
    np.testing.assert_allclose(vs.bias_, b_true - b_true.mean(), atol=0.1)


def test_vector_scaling_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    f, y = overconfident(200, 4, 3)
    vs = VectorScaling(reg=0.1)
    z = vs.logits(f)
    p = rng.normal(1.0, 0.3, size=8)
    _, g = vs.objective(p, z, y)
    step = 1e-6
    num = np.array([
        (vs.objective(p + step * e, z, y)[0] - vs.objective(p - step * e, z, y)[0]) / (2 * step)
        for e in np.eye(8)
    ])
    np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-8)


def test_vector_scaling_ridge_shrinks_towards_identity(fit_eval):
    (xf, yf), _ = fit_eval
    free = VectorScaling().fit(xf, yf)
    tied = VectorScaling(reg=10.0).fit(xf, yf)
    assert np.abs(tied.scale_ - 1.0).max() < 0.5 * np.abs(free.scale_ - 1.0).max()


@pytest.mark.parametrize("cls", [IsotonicOvR, HistogramBinningOvR])
def test_unseen_class_stays_finite(cls):
    f, y = overconfident(3000, 4, 5)
    keep = y != 3  # class 3 never observed during fit
    m = cls().fit(f[keep], y[keep])
    h = m.predict(f)
    assert_simplex(h, f.shape)
    uniform = np.all(h == 0.25, axis=1)  # rows no fitted class explains fall back to uniform
    assert uniform.mean() < 0.01
    np.testing.assert_array_equal(h[~uniform, 3], 0.0)


@pytest.mark.parametrize("cls", [IsotonicOvR, HistogramBinningOvR])
def test_all_zero_row_becomes_uniform(cls):
    # fit: label 1 wherever f_0 = 0.1, label 0 wherever f_1 = 0.1, class 2 never seen. The point
    # (0.1, 0.1, 0.8) gets 0 from every per-class calibrator; (0.6, 0.1, 0.3) is plainly class 0.
    s = np.linspace(0.2, 0.7, 60)
    f = np.concatenate([np.column_stack([np.full(60, 0.1), 0.1 + s, 0.8 - s]),
                        np.column_stack([0.1 + s, np.full(60, 0.1), 0.8 - s])])
    y = np.array([1] * 60 + [0] * 60)
    h = cls().fit(f, y).predict(np.array([[0.1, 0.1, 0.8], [0.6, 0.1, 0.3]]))
    np.testing.assert_allclose(h[0], 1.0 / 3.0)
    np.testing.assert_allclose(h[1], [1.0, 0.0, 0.0])


def test_histogram_bins_are_equal_mass_and_frequencies():
    rng = np.random.default_rng(11)
    f = rng.dirichlet([1.0, 1.0], size=1500)
    y = (rng.random(1500) < f[:, 1]).astype(int)
    m = HistogramBinningOvR(n_bins=15).fit(f, y)
    cell = m._bins(f)[:, 1] - 15  # class 1's bins
    np.testing.assert_array_equal(np.bincount(cell, minlength=15), 100)
    expected = np.array([np.mean(y[cell == b] == 1) for b in range(15)])
    np.testing.assert_allclose(m.values_[1], expected)


def test_isotonic_output_is_monotone_in_the_class_score():
    f, y = overconfident(2000, 2, 9)  # binary: the renormalised h_1 is monotone in f_1
    m = IsotonicOvR().fit(f, y)
    grid = np.linspace(0.0, 1.0, 201)
    h = m.predict(np.column_stack([1.0 - grid, grid]))
    assert (np.diff(h[:, 1]) >= -1e-12).all()
    assert h[-1, 1] > h[0, 1]


@pytest.mark.parametrize("name", list(BASELINES))
def test_predict_before_fit_and_wrong_k_raise(name):
    m = BASELINES[name]()
    with pytest.raises(RuntimeError):
        m.predict(np.full((2, 3), 1.0 / 3.0))
    f, y = overconfident(500, 3, 4)
    m.fit(f, y)
    with pytest.raises(Exception, match="expected 3 classes"):
        m.predict(np.full((2, 4), 0.25))


def test_compare_baselines_rows_on_a_real_record():
    from tests.bench import compare_baselines as cb
    from tests.bench.make_sklearn_records import RECORDS

    assert set(RECORDS) <= set(cb.records())
    rows = cb.baseline_rows("mlp-digits", seeds=(0,))
    assert list(rows) == ["uncalibrated", *BASELINES]
    for vals in rows.values():
        assert list(vals) == cb.METRICS
        assert all(np.isfinite(v) and v >= 0 for v in vals.values())
    # the record's MLP is overconfident: temperature scaling cuts its NLL and keeps the argmax
    assert rows["temperature"]["NLL"] < 0.8 * rows["uncalibrated"]["NLL"]
    assert rows["temperature"]["accuracy"] == rows["uncalibrated"]["accuracy"]
