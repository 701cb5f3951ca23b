"""Pool sizes: the paper's constants recomputed by hand, practical sizes, warnings and errors."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from lpcal.calibrate import fit
from lpcal.errors import InputError
from lpcal.pools import n_levels
from lpcal.sizing import practical_sizing, theory_sizing


def _theory_by_hand(eps, p, delta, k, variant):
    """Section 3.1 of the paper, written out independently.

    beta = eps^(p/(p-1)) / 2^(1/(p-1)); lambda = ceil(1/beta); |B| <= 6/beta, so the group sizes
    2^i, i < L = floor(log2(6/beta)) + 1, cover every group of M.
    mu pool (Lemma samples-probabilities, alpha_1 = beta/12, delta_1 = delta/3):
        m_1 = ln(4/(alpha_1 delta_1)) / (2 alpha_1^2),  m_2 = 4/(3 alpha_1) ln(2 |V| / delta_1)
        with |V| <= C(lambda + k, k).
    level-i pools (Lemma adaptive-samples with n = floor(|B|max / 2^i) disjoint events,
    alpha = beta/(36 L), delta_i = delta/(3 L), d = 1 for P, k for E, k + 1 for both):
        m = 32 ln(4 n d / delta_i) / alpha^2,  Laplace noise Lap(8/(m alpha)).
    """
    beta = eps if math.isinf(p) else eps ** (p / (p - 1)) / 2 ** (1 / (p - 1))
    inv = 1 / beta
    lam = round(inv) if abs(inv - round(inv)) < 1e-9 * inv else math.ceil(inv)
    b_max = math.floor(6 / beta + 1e-9)
    L = math.floor(math.log2(b_max)) + 1
    a1, d1 = beta / 12, delta / 3
    V = math.comb(lam + k, k)
    mu = math.ceil(math.log(4 / (a1 * d1)) / (2 * a1**2) + 4 / (3 * a1) * math.log(2 * V / d1))
    alpha, di = beta / (36 * L), delta / (3 * L)
    pools = {"mu": mu}
    for i in range(L):
        n_i = max(1, b_max // 2**i)
        dims = {"P": 1, "E": k} if variant == "split" else {"PE": k + 1}
        for name, d in dims.items():
            pools[f"{name}{i}"] = math.ceil(32 * math.log(4 * n_i * d / di) / alpha**2)
    noise = {n: (0.0 if n == "mu" else 8 / (m * alpha)) for n, m in pools.items()}
    return beta, lam, L, pools, noise


@pytest.mark.parametrize("eps,p,delta,k,variant", [
    (0.1, 2.0, 0.1, 3, "split"),
    (0.05, math.inf, 0.05, 10, "shared"),
    (0.2, 3.0, 0.2, 100, "split"),
])
def test_theory_matches_hand_computation(eps, p, delta, k, variant):
    beta, lam, L, pools, noise = _theory_by_hand(eps, p, delta, k, variant)
    sz = theory_sizing(eps, p, delta, k, variant)
    assert sz.beta == pytest.approx(beta, rel=1e-12)
    assert (sz.lam, sz.levels, sz.mode, sz.variant) == (lam, L, "theory", variant)
    assert set(sz.targets) == set(pools)
    for name, m in pools.items():  # ceil() of the same real number; allow one for rounding
        assert abs(sz.targets[name] - m) <= 1, (name, sz.targets[name], m)
        assert sz.noise_scales[name] == pytest.approx(noise[name], rel=1e-6)
    assert sz.total == sum(sz.targets.values())
    # the larger the groups, the fewer disjoint events per pool, the smaller the pool
    est = [sz.targets[f"{'E' if variant == 'split' else 'PE'}{i}"] for i in range(L)]
    assert est == sorted(est, reverse=True)


def test_theory_total_is_astronomical():
    sz = theory_sizing(0.05, math.inf, 0.1, 10)
    assert 5e10 < sz.total < 5e11
    assert sz.to_dict()["total"] == sz.total and sz.to_dict()["mode"] == "theory"


def test_theory_noise_can_be_turned_off():
    sz = theory_sizing(0.1, 2.0, 0.1, 3, noise=False)
    assert all(v == 0.0 for v in sz.noise_scales.values())


def test_levels_cover_B():
    """2^L > |B|max = floor(6/beta): a group of M never outgrows the pools."""
    for beta in [0.5, 0.3, 0.2, 0.1875, 0.1, 0.09375, 0.05, 0.01, 0.005, 1e-4]:
        L = n_levels(beta)
        b_max = math.floor(6 / beta + 1e-9)
        assert math.floor(math.log2(b_max)) + 1 <= L
        assert 2 ** (L - 1) <= b_max  # and no level is wasted


def test_practical_sizes_and_noise_scales():
    sz = practical_sizing(0.2, math.inf, 0.1, 4, mu_pool=5000, pool=700, noise=True)
    L = n_levels(0.2)
    assert sz.levels == L and sz.mode == "practical"
    assert sz.targets["mu"] == 5000
    assert all(v == 700 for n, v in sz.targets.items() if n != "mu")
    assert sz.total == 5000 + 700 * 2 * L
    alpha = 0.2 / (36 * L)
    assert sz.noise_scales["mu"] == 0.0
    for n, s in sz.noise_scales.items():
        if n != "mu":
            assert s == pytest.approx(8 / (700 * alpha), rel=1e-12)
    off = practical_sizing(0.2, math.inf, 0.1, 4, mu_pool=5000, pool=700)
    assert all(v == 0.0 for v in off.noise_scales.values())
    lay = sz.layout()
    assert lay.names[0] == "mu" and dict(lay.targets) == sz.targets


def test_practical_warns_below_six_over_beta():
    # beta = 0.2: 6/beta = 30
    with pytest.warns(UserWarning, match="below 6/beta"):
        sz = practical_sizing(0.2, math.inf, 0.1, 3, mu_pool=29, pool=100)
    assert len(sz.warnings) == 1 and "every observed bin" in sz.warnings[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sz = practical_sizing(0.2, math.inf, 0.1, 3, mu_pool=30, pool=100)
    assert sz.warnings == ()


@pytest.mark.parametrize("call,message", [
    (lambda: theory_sizing(0.1, 2.0, 0.1, 3, variant="mixed"), "variant"),
    (lambda: theory_sizing(0.1, 2.0, 1.5, 3), "delta"),
    (lambda: theory_sizing(1.5, 2.0, 0.1, 3), "eps"),
    (lambda: theory_sizing(0.1, 1.0, 0.1, 3), "p must be a number > 1, or inf, got 1.0"),
    (lambda: practical_sizing(0.1, 2.0, 0.1, 3, mu_pool=0, pool=10), "positive"),
    (lambda: practical_sizing(0.1, 2.0, 0.1, 3, mu_pool=10, pool=-1), "positive"),
])
def test_sizing_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_fit_theory_on_small_sample_quotes_needed_count():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(3), size=2000)
    y = rng.integers(0, 3, size=2000)
    need = theory_sizing(0.2, math.inf, 0.1, 3, "shared").total  # fit's default variant
    with pytest.raises(InputError, match="theory sizing needs") as ei:
        fit(f, y, eps=0.2, p=math.inf, sizing="theory", mode="paper")
    msg = str(ei.value)
    assert f"{need:.3g}" in msg and "2000" in msg and "practical" in msg
    with pytest.raises(InputError, match="sizing must be"):
        fit(f, y, eps=0.2, p=math.inf, sizing="huge")
    with pytest.raises(InputError, match="needs"):
        fit(f, y, eps=0.2, p=math.inf, pool_size=1000)
