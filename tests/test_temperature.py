"""Tests of lpcal.temperature: temperature scaling by bounded Brent search on log T."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lpcal import temperature as T
from lpcal.datasets import load_cifar_record
from lpcal.errors import InputError
from lpcal.metrics import nll, top_label_ece


def synthetic(rng, n, k, t0, alpha=0.5):
    """Predictions f ~ Dirichlet(alpha); labels drawn from softmax(log f / t0)."""
    f = rng.dirichlet(np.full(k, alpha), size=n)
    q = T.apply_temperature(f, t0)
    labels = (q.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    return f, labels


@pytest.mark.parametrize("t0", [0.4, 1.0, 2.5])
def test_recovers_known_temperature(t0):
    rng = np.random.default_rng(int(t0 * 100))
    f, labels = synthetic(rng, 20000, 5, t0)
    t = T.fit_temperature(f, labels)
    assert t == pytest.approx(t0, rel=0.05)


def test_fit_is_the_minimum_of_the_objective():
    rng = np.random.default_rng(7)
    f, labels = synthetic(rng, 3000, 4, 1.7)
    t = T.fit_temperature(f, labels)
    grid = np.exp(np.linspace(-3, 3, 601))
    losses = np.array([T.nll_at_temperature(f, labels, g) for g in grid])
    best = T.nll_at_temperature(f, labels, t)
    assert best <= losses.min() + 1e-9
    # the grid minimiser is next to the fitted value
    assert abs(math.log(grid[losses.argmin()]) - math.log(t)) <= 0.01 + 1e-12
    # at T = 1 the objective is the plain NLL
    assert T.nll_at_temperature(f, labels, 1.0) == pytest.approx(nll(f, labels), rel=1e-12)


def test_brent_on_known_functions():
    x, _, evals = T._brent_bounded(lambda v: (v - 1.234) ** 2, -10, 10, 1e-10, 200)
    assert x == pytest.approx(1.234, abs=1e-7) and evals < 60
    x, _, _ = T._brent_bounded(lambda v: abs(v + 3.5), -10, 10, 1e-10, 500)
    assert x == pytest.approx(-3.5, abs=1e-6)
    x, _, _ = T._brent_bounded(lambda v: math.exp(-v), -10, 10, 1e-10, 500)  # decreasing
    assert 10 - x < 1e-5
    x, _, _ = T._brent_bounded(lambda v: v**4 - 2 * v, -10, 10, 1e-12, 500)
    assert x == pytest.approx(0.5 ** (1 / 3), abs=1e-6)


def test_solution_at_a_bound_when_likelihood_keeps_improving():
    # every prediction's argmax is the label: sharper is always better, T -> lower bound
    f = np.array([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2]])
    labels = np.array([0, 1, 0])
    t = T.fit_temperature(f, labels, log_t_bounds=(-3.0, 3.0))
    assert math.log(t) == pytest.approx(-3.0, abs=1e-4)


def test_apply_temperature_properties():
    rng = np.random.default_rng(1)
    f = rng.dirichlet(np.full(6, 0.3), size=200)
    f[:10, 0] = 0.0
    f[:10] /= f[:10].sum(axis=1, keepdims=True)
    np.testing.assert_allclose(T.apply_temperature(f, 1.0), f, rtol=1e-12, atol=1e-15)
    for t in (0.3, 2.0, 40.0):
        q = T.apply_temperature(f, t)
        np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=1e-12)
        assert (q[:10, 0] == 0.0).all()  # zeros stay zero
        np.testing.assert_array_equal(q.argmax(axis=1), f.argmax(axis=1))
        # q_j proportional to f_j^(1/T)
        expect = f ** (1 / t)
        np.testing.assert_allclose(q, expect / expect.sum(axis=1, keepdims=True), rtol=1e-9)
    # composition: T1 then T2 equals T1 * T2
    np.testing.assert_allclose(
        T.apply_temperature(T.apply_temperature(f, 2.0), 1.5),
        T.apply_temperature(f, 3.0),
        rtol=1e-9,
        atol=1e-15,
    )
    # sharpening by a tiny T approaches one-hot without overflow
    q = T.apply_temperature(f, 1e-3)
    assert np.isfinite(q).all() and (q.max(axis=1) > 0.99).all()


def test_zero_probability_on_label_is_ignored():
    rng = np.random.default_rng(3)
    f, labels = synthetic(rng, 2000, 3, 1.5)
    extra = np.array([[0.0, 0.5, 0.5]])
    t_with = T.fit_temperature(np.vstack([f, extra]), np.append(labels, 0))
    assert t_with == pytest.approx(T.fit_temperature(f, labels), rel=1e-6)
    with pytest.raises(InputError, match="every sample gives probability 0"):
        T.fit_temperature(extra, [0])


def test_invalid_arguments():
    f = np.full((2, 2), 0.5)
    for bad in (0.0, -1.0, math.inf, math.nan, "x"):
        with pytest.raises(InputError, match="temperature must"):
            T.apply_temperature(f, bad)
    with pytest.raises(InputError, match="log_t_bounds"):
        T.fit_temperature(f, [0, 1], log_t_bounds=(1.0, -1.0))
    with pytest.raises(InputError, match=r"labels: row 1: label 5 outside"):
        T.fit_temperature(f, [0, 5])
    with pytest.raises(InputError, match=r"probs: row 0: probabilities sum"):
        T.fit_temperature([[0.5, 0.6]], [0])


def test_cifar_network_is_overconfident_and_scaling_helps():
    probs, labels = load_cifar_record()
    t = T.fit_temperature(probs, labels)
    assert t > 1.2  # modern networks are overconfident (Guo et al. 2017)
    scaled = T.apply_temperature(probs, t)
    assert nll(scaled, labels) < nll(probs, labels)
    assert top_label_ece(scaled, labels) < 0.5 * top_label_ece(probs, labels)
