"""Euclidean simplex projection: KKT conditions, idempotence, and an independent bisection."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lpcal.simplex import lift_zeros, project_simplex, projection_threshold


def _bisect(v):
    lo, hi = v.min() - 1.0, v.max()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.maximum(v - mid, 0).sum() > 1:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - (lo + hi) / 2, 0)


finite = st.floats(-5, 5, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 8), st.integers(1, 12)), elements=finite))
def test_kkt(v):
    u = project_simplex(v)
    assert u.shape == v.shape
    assert np.all(u >= 0)
    np.testing.assert_allclose(u.sum(axis=1), 1.0, atol=1e-9)
    theta = projection_threshold(v)
    pos = u > 0
    # u_i = v_i - theta on the support, v_i - theta <= 0 off it
    np.testing.assert_allclose(np.where(pos, v - u, theta[:, None]),
                               np.broadcast_to(theta[:, None], v.shape), atol=1e-9)
    assert np.all(np.where(pos, 0.0, v - theta[:, None]) <= 1e-9)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.integers(1, 10), elements=finite))
def test_matches_bisection(v):
    np.testing.assert_allclose(project_simplex(v), _bisect(v), atol=1e-7)


def test_idempotent_on_simplex():
    u = np.random.default_rng(0).dirichlet(np.ones(7), size=100)
    np.testing.assert_allclose(project_simplex(u), u, atol=1e-12)


def test_lift_zeros_floors_only_rows_with_a_zero_on_the_given_classes():
    v = np.array([[0.5, 0.5, 0.0, 0.0],    # zero on class 2 (given) and 3 (not given)
                  [0.7, 0.1, 0.2, 0.0],    # zero only on class 3: unchanged
                  [0.25, 0.25, 0.25, 0.25]])
    classes = np.array([True, True, True, False])
    out = lift_zeros(v, classes, 0.01)
    np.testing.assert_array_equal(out[1:], v[1:])
    np.testing.assert_allclose(out[0], [0.5 * 0.97 + 0.01, 0.5 * 0.97 + 0.01, 0.01, 0.0])
    assert out.sum(axis=1) == pytest.approx(1.0)
    assert np.abs(out - v).sum(axis=1).max() <= 2 * 3 * 0.01 + 1e-15  # ||u' - u||_1 <= 2 m eta
    assert v[0, 2] == 0.0  # the input is not written without out=
    row = v[0].copy()
    assert lift_zeros(row, classes, 0.01, out=row) is row and row[2] == 0.01
    with pytest.raises(ValueError, match="does not fit"):
        lift_zeros(v, classes, 0.5)
