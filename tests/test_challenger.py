"""Champion/challenger: paired loss sums, the loss grid over temperatures, the decision."""

import json

import numpy as np
import pytest

from lpcal.binmap import scale_temperature
from lpcal.challenger import LossGrid, PairedLoss, challenge, per_sample_loss
from lpcal.errors import InputError
from tests.test_warmup import tempered


@pytest.mark.parametrize("loss", ["brier", "nll"])
def test_grid_pair_matches_direct_scoring(loss):
    f, y = tempered(3000, t=2.0)
    g = LossGrid().update(f, y)
    for a, b in [(2.0, None), (0.5, 4.0), (1.7, 2.3)]:   # on the grid, and between its points
        pg = g.paired(a, b, loss)
        ref = PairedLoss.score(scale_temperature(f, a), f if b is None else scale_temperature(f, b),
                               y, loss)
        assert pg.n == ref.n
        assert pg.mean == pytest.approx(ref.mean, abs=2e-3 * abs(ref.mean) + 2e-5)
        assert pg.stderr == pytest.approx(ref.stderr, rel=0.02)
    assert g.mean_loss(2.0, loss) == pytest.approx(
        per_sample_loss(scale_temperature(f, 2.0), y, loss).mean(), rel=1e-4)


def test_loss_grid_is_additive_and_round_trips():
    f, y = tempered(2000)
    whole = LossGrid().update(f, y)
    assert LossGrid().update(f[:700], y[:700]).merge(LossGrid().update(f[700:], y[700:])) == whole
    assert LossGrid.from_dict(json.loads(json.dumps(whole.to_dict()))) == whole
    with pytest.raises(InputError, match="loss grid"):
        LossGrid.from_dict({**whole.to_dict(), "grid": "other"})


def test_publishes_the_better_map_and_keeps_against_a_worse_one():
    f, y = tempered(4000, t=2.0)
    held = LossGrid().update(f, y)
    better = challenge(held.paired(2.0, None))          # TS at the true T vs identity
    assert better.publish and better.mean_diff < 0 and better.upper_bound < 0
    worse = challenge(held.paired(None, 2.0))           # the identity vs TS at the true T
    assert not worse.publish and worse.mean_diff > 0
    assert worse.reason == "held-out loss is worse"


def test_never_publishes_when_the_held_out_mean_is_not_lower():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 5000))
        sd = int(rng.integers(0, 10**6))
        sd2 = int(sd * sd / n + rng.integers(0, 10**9))
        for significance in (True, False):
            d = challenge(PairedLoss("brier", n, sd, sd2), alpha=0.49, min_samples=2,
                          significance=significance)
            assert not d.publish


def test_a_refinement_needs_a_lower_mean_not_significance():
    noisy = PairedLoss("brier", 1000, -50, 10**12)     # mean slightly below 0, se large
    assert not challenge(noisy).publish
    d = challenge(noisy, significance=False)
    assert d.publish and d.mean_diff < 0


def test_too_few_samples_keep_the_champion():
    d = challenge(PairedLoss("brier", 50, -10**9, 10**13), min_samples=200)
    assert not d.publish and "held-out samples" in d.reason


def test_paired_sums_add_and_check_their_loss():
    a = PairedLoss("brier", 3, -5, 20)
    assert (a + a).n == 6 and (a + a).sd == -10
    with pytest.raises(InputError, match="cannot add"):
        _ = a + PairedLoss("nll")
    assert PairedLoss.from_dict(a.to_dict()) == a


def test_an_empty_loss_grid_holds_no_arrays_until_its_first_update():
    """Empty grids share read-only zeros (an idle model's open bucket holds none of its own);
    the first update, a merge and a restore give the grid its own arrays, and the shared zeros
    are never written."""
    from lpcal.challenger import _ZERO_PRODS, _ZERO_SUMS

    rng = np.random.default_rng(3)
    f = rng.dirichlet(np.ones(4), 50)
    y = rng.integers(0, 4, 50)
    a, b = LossGrid(), LossGrid()
    assert a.sums is b.sums is _ZERO_SUMS and a.prods is _ZERO_PRODS
    assert a.nbytes == b.nbytes > 0  # the bytes it holds once used: budgets do not move
    with pytest.raises(TypeError):
        a.sums["nll"] = np.zeros(3)
    with pytest.raises(ValueError):
        a.sums["nll"] += 1
    empty = a.merge(b)
    assert empty.sums is _ZERO_SUMS and empty == LossGrid()
    a.update(f, y)
    assert a.sums is not _ZERO_SUMS and a.sums["nll"].flags.writeable
    assert all(not v.any() for v in (*_ZERO_SUMS.values(), *_ZERO_PRODS.values()))
    assert b == LossGrid() and b.mean_loss(1.0, "nll") == 0.0
    c = a.merge(b)
    c.update(f, y)  # the merge's arrays are its own
    assert c != a and a == LossGrid().update(f, y)
    for packed in (False, True):
        d = LossGrid.from_dict(b.to_dict(packed=packed))
        assert d == b and d.to_dict(packed=packed) == b.to_dict(packed=packed)
        d.update(f, y)
        assert d == a and b == LossGrid()
        r = LossGrid.from_dict(a.to_dict(packed=packed))
        r.update(f, y)
        assert r == c
