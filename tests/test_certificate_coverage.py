"""Coverage of the held-out bound against truth-known families (a small R; the R >= 100 run is
``tests/bench/bench_certificate.py``).

Each draw holds out a fresh sample of a family whose label law ``q`` is known, bounds the
``Err_p`` of fixed candidates (the raw model and temperature scaling at the true temperature)
with :func:`lpcal.certificate.err_p_bound`, and compares the bound to the TRUE ``Err_p``
computed with ``q`` on a large independent sample. At ``delta = 0.1`` a valid bound misses in
about 2 of 20 draws at most, so more than 4 misses fails; the bound must also be informative
(not vacuous) and, at ``p = 2``, ``eps = 0.1``, ``k = 10`` and the default held-out share of
5,000 samples, certify the calibrated candidate in most draws.
"""

import math

import numpy as np
import pytest

from lpcal.certificate import err_p_bound, min_certifiable_holdout
from lpcal.holdout import HoldoutSums
from lpcal.levels import beta_for, lambda_for
from lpcal.metrics import err_p_true
from lpcal.temperature import apply_temperature
from tests.test_oracle import synth, synth_class_dependent

R = 20
DELTA = 0.1


def _family(name, n, k, seed):
    if name == "tempered":  # overconfident, outputs near the vertices: q = softmax(0.15 z)
        f, q, y = synth(n, k, 0.15, 12.0, 0.0, seed)
        return {"raw": f, "ts": apply_temperature(f, 1.0 / 0.15)}, q, y
    f, q, y = synth_class_dependent(n, k, seed)
    return {"raw": f}, q, y


@pytest.mark.parametrize("family,k,p,eps,n_hold", [
    ("tempered", 10, 2.0, 0.1, 1500),
    ("tempered", 10, math.inf, 0.05, 1500),
    ("class_dependent", 3, math.inf, 0.03, 2000),
    ("class_dependent", 3, 2.0, 0.04, 2000),
])
def test_bound_covers_the_true_error_of_fixed_candidates(family, k, p, eps, n_hold):
    lam = lambda_for(beta_for(eps, p))
    big, q_big, _ = _family(family, 200_000, k, seed=12345)
    truth = {nm: err_p_true(h, q_big, lam, p) for nm, h in big.items()}
    misses = dict.fromkeys(truth, 0)
    bounds = {nm: [] for nm in truth}
    for s in range(R):
        cands, _, y = _family(family, n_hold, k, seed=s)
        for nm, h in cands.items():
            est, bound = err_p_bound(HoldoutSums(k, lam).update(h, y).cells(), p, DELTA)
            assert bound >= est
            misses[nm] += bound < truth[nm]
            bounds[nm].append(bound)
    for nm, true in truth.items():
        assert misses[nm] <= 4, (f"{family} {nm}: the bound missed the true Err_p "
                                 f"{true:.4f} in {misses[nm]}/{R} draws")
        # informative: within a small multiple of the truth plus the held-out noise floor
        floor = 3.0 * math.sqrt(1.0 / n_hold) if p == 2.0 else 0.03
        assert np.median(bounds[nm]) < 3.0 * true + floor, (nm, true, bounds[nm])
    if family == "tempered" and p == 2.0:
        assert truth["ts"] < 0.02 < truth["raw"]  # the test separates the two candidates
        certified = sum(b <= eps for b in bounds["ts"])
        assert certified >= 16, f"temperature scaling certified in {certified}/{R} draws only"


def test_min_certifiable_holdout_is_the_floor_of_the_bound():
    """No data certify below it, not even residuals of exactly zero; with enough such data the
    bound does go below eps."""
    for p, eps, k in ((math.inf, 0.05, 10), (2.0, 0.1, 10), (1.5, 0.2, 3)):
        need = min_certifiable_holdout(eps, p, DELTA, k)
        assert need > 1 and min_certifiable_holdout(eps, p, DELTA / 2, k) >= need
        lam = lambda_for(beta_for(eps, p))
        for n, ok in ((need - 1, False), (8 * need, True)):
            y = np.arange(n) % k
            perfect = HoldoutSums(k, lam).update(np.eye(k)[y], y).cells()
            assert (err_p_bound(perfect, p, DELTA, k)[1] <= eps) is ok, (p, eps, n)
            if not ok:
                f, _, y = synth(n, k, 0.15, 12.0, 0.0, seed=1)
                cells = HoldoutSums(k, lam).update(f, y).cells()
                assert err_p_bound(cells, p, DELTA, k)[1] > eps


def _two_level_sets(n, seed, k=10, off=0.03):
    """Outputs on two level sets of mass 1/2 (class 0, resp. 1, at 0.65), labels whose law
    moves ``off`` of class 0's probability to class 2 on the first: Err_inf = off / 2."""
    r = np.random.default_rng(seed)
    which = r.integers(0, 2, size=n)
    h = np.full((2, k), 0.35 / (k - 1))
    h[0, 0] = h[1, 1] = 0.65
    q = h.copy()
    q[0, 0] -= off
    q[0, 2] += off
    y = (q[which].cumsum(1) > r.random(n)[:, None]).argmax(1)
    return h[which], q[which], y


def test_inf_bound_on_few_heavy_level_sets_covers_and_is_tighter_than_a_uniform_union():
    """Where the p = inf bound is decided (a few level sets holding the mass, cells of variance
    about 0.11), the mass-weighted second-moment union and the split of delta that gives the
    means 3/4 of it: the bound covers the truth, and its margin (bound minus plug-in) at
    n = 1,000 and delta = 0.05 has a median below 0.0455 (the even split with a uniform union
    over the K heavy cells gave 0.047 on these draws, with off = 0.01)."""
    h, q, _ = _two_level_sets(200_000, 12345)
    true = err_p_true(h, q, 20, math.inf)
    assert 0.01 < true < 0.02
    misses, margins = 0, []
    for s in range(R):
        h, _, y = _two_level_sets(1000, s, off=0.01)
        est, bound = err_p_bound(HoldoutSums(10, 20).update(h, y).cells(), math.inf, 0.05)
        margins.append(bound - est)
        h, _, y = _two_level_sets(1000, s)
        misses += err_p_bound(HoldoutSums(10, 20).update(h, y).cells(), math.inf, DELTA)[1] < true
    assert misses <= 4, misses
    assert np.median(margins) < 0.0455, np.median(margins)
