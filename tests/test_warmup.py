"""Warm-up determination: additive score sums, the sandwich interval, and when it ends."""

import json
import math

import numpy as np
import pytest

from lpcal.errors import InputError
from lpcal.warmup import WarmupSums, lagrange_weights, normal_quantile


def tempered(n, k=10, scale=3.0, t=2.0, seed=0, noise=0.0):
    """Rows f = softmax(z) with labels from softmax(z / t); a share ``noise`` of the labels is
    replaced by uniform draws (a model temperature scaling cannot describe)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * scale
    f = np.exp(z - z.max(1, keepdims=True))
    f /= f.sum(1, keepdims=True)
    q = np.exp(z / t - (z / t).max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    y = (q.cumsum(1) > rng.random(n)[:, None]).argmax(1)
    flip = rng.random(n) < noise
    y[flip] = rng.integers(0, k, int(flip.sum()))
    return f, y


def first_determined(f, y, step=250, **kw):
    w = WarmupSums()
    for a in range(0, y.size, step):
        w.update(f[a:a + step], y[a:a + step])
        if w.determine(**kw).determined:
            return a + step
    return None


def test_sums_are_additive_and_batching_invariant():
    f, y = tempered(3000)
    whole = WarmupSums().update(f, y)
    parts = WarmupSums().update(f[:1234], y[:1234]).merge(WarmupSums().update(f[1234:], y[1234:]))
    assert parts == whole
    assert parts.determine() == whole.determine()


def test_round_trip_through_json():
    f, y = tempered(1000)
    w = WarmupSums().update(f, y)
    back = WarmupSums.from_dict(json.loads(json.dumps(w.to_dict())))
    assert back == w
    with pytest.raises(InputError, match="warm-up sums"):
        WarmupSums.from_dict({**w.to_dict(), "s": [1, 2]})


def test_interval_covers_the_true_temperature_and_narrows():
    f, y = tempered(8000, t=2.0)
    small = WarmupSums().update(f[:1000], y[:1000]).determine()
    big = WarmupSums().update(f, y).determine()
    assert big.half_width < small.half_width / 2   # ~ 1 / sqrt(n)
    lo, hi = big.interval
    assert lo < 2.0 < hi


def test_sandwich_is_wider_when_the_model_is_wrong():
    f, y = tempered(6000, t=2.0)
    fb, yb = tempered(6000, t=2.0, noise=0.5, seed=1)
    good = WarmupSums().update(f, y).determine()
    bad = WarmupSums().update(fb, yb).determine()
    assert bad.se_log_t > 1.5 * good.se_log_t


def test_warmup_ends_earlier_on_a_well_specified_model_than_on_a_hard_one():
    f, y = tempered(20000, t=2.0)
    fb, yb = tempered(20000, t=2.0, noise=0.5, seed=1)
    easy = first_determined(f, y)
    hard = first_determined(fb, yb)
    assert easy is not None and easy <= 5000
    assert hard is None or hard > 2 * easy


def test_not_determined_below_min_samples_or_at_the_grid_edge():
    f, y = tempered(2000)
    d = WarmupSums().update(f, y).determine(tol=10.0, min_samples=5000)
    assert not d.determined and "samples" in d.reason
    # labels always the top class: the likelihood keeps improving as T -> 0
    sharp = WarmupSums().update(f, f.argmax(1)).determine(tol=10.0)
    assert not sharp.determined and "end of the temperature grid" in sharp.reason


def test_normal_quantile_and_interpolation():
    assert normal_quantile(0.975) == pytest.approx(1.959963984540054, abs=1e-12)
    assert normal_quantile(0.001) == pytest.approx(-3.090232306167814, abs=1e-10)
    nodes = np.arange(8.0)
    first, w = lagrange_weights(2.3, nodes)
    assert w @ (nodes[first:first + 4] ** 3) == pytest.approx(2.3**3)   # exact on cubics
    assert math.isclose(w.sum(), 1.0)
