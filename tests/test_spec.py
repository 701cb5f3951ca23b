"""FitSpec: declarative validation of every fit option, and the one sizing rule."""

import math
import re

import numpy as np
import pytest

from lpcal import fit
from lpcal.errors import InputError
from lpcal.spec import FitSpec, Mode, Outside, Prescale, SizingRule, Variant


@pytest.mark.parametrize("options,message", [
    ({"eps": 0.0}, "eps must be a number in (0, 1) or 'auto', got 0.0"),
    ({"eps": 1.5}, "eps must be a number in (0, 1)"),
    ({"eps": True}, "eps must be a number in (0, 1) or 'auto', got True"),
    ({"p": 0.5}, "p must be a number > 1, or inf, got 0.5"),
    ({"p": 1}, "p must be a number > 1, or inf, got 1"),
    ({"p": -math.inf}, "p must be a number > 1, or inf, got -inf"),
    ({"p": "two"}, "p must be a number > 1, or inf, got 'two'"),
    ({"p": np.float64(0.5)}, "p must be a number > 1, or inf, got 0.5"),
    ({"eps": np.float64(1.1)}, "eps must be a number in (0, 1) or 'auto', got 1.1"),
    ({"pool_size": np.int64(0)}, "pool_size must be a positive integer, got 0"),
    ({"delta": 1.0}, "delta must be a number in (0, 1)"),
    ({"pool_size": 0}, "pool_size must be a positive integer, got 0"),
    ({"pool_size": 2.5}, "pool_size must be a positive integer"),
    ({"holdout_fraction": 1.0}, "holdout_fraction must be a number in [0, 1)"),
    ({"noise": 1}, "noise must be True or False"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"mode": "fast"}, "mode must be one of 'certified', 'paper', got 'fast'"),
    ({"variant": "both"}, "variant must be one of 'shared', 'split'"),
    ({"prescale": "vector"}, "prescale must be one of 'temperature', 'none'"),
    ({"outside": "zero"}, "outside must be one of 'identity', 'rho'"),
    ({"sizing": "huge"}, "sizing must be one of 'practical', 'theory'"),
])
def test_every_bad_option_is_named(options, message):
    with pytest.raises(InputError) as ei:
        FitSpec(**{"eps": 0.05, "p": math.inf, **options})
    assert message in str(ei.value)


def test_strings_become_enums_and_mode_defaults_apply():
    s = FitSpec(eps=0.1, p=2, mode="paper", variant="split", sizing="theory")
    assert (s.mode, s.variant, s.sizing) == (Mode.PAPER, Variant.SPLIT, SizingRule.THEORY)
    assert isinstance(s.p, float) and s.lam == lambda_ref(0.1, 2.0)
    assert (s.prescale_value, s.outside_value, s.holdout_fraction_value) == (
        Prescale.NONE, Outside.RHO, 0.0)
    c = FitSpec(eps=0.1, p=math.inf, outside="rho")
    assert (c.prescale_value, c.outside_value, c.holdout_fraction_value) == (
        Prescale.TEMPERATURE, Outside.RHO, 0.3)


def lambda_ref(eps, p):
    beta = eps ** (p / (p - 1)) / 2 ** (1 / (p - 1))
    return math.ceil(1 / beta - 1e-9)


def test_from_options_replaces_and_rejects_unknown_names():
    base = FitSpec(eps=0.1, p=math.inf)
    assert FitSpec.from_options(base, seed=3).seed == 3 and base.seed == 0
    with pytest.raises(InputError, match=r"unknown fit option\(s\) \['prescale_fraction'\]"):
        FitSpec.from_options(base, prescale_fraction=0.1)
    with pytest.raises(InputError, match=r"a fit needs \['p'\]"):
        FitSpec.from_options(None, eps=0.1)


def test_pool_sizing_is_the_one_sizing_rule():
    s = FitSpec(eps=0.05, p=math.inf, pool_size=500)
    sz = s.pool_sizing(10, holdout=100, warmup=50)
    assert set(sz.targets.values()) == {500} and (sz.holdout, sz.warmup) == (100, 50)
    assert sz.layout().total_target == 8 * 500 + 150
    even = FitSpec(eps=0.05, p=math.inf).pool_sizing(10, n_fit=8003)
    assert sum(even.targets.values()) == 8003 and even.targets["PE0"] == 1000
    with pytest.raises(InputError, match="needs pool_size"):
        FitSpec(eps=0.05, p=math.inf).pool_sizing(10)
    with pytest.raises(InputError, match="theory sizing needs"):
        FitSpec(eps=0.05, p=math.inf, sizing="theory").pool_sizing(10, n_fit=10_000)


def test_fit_with_a_spec_equals_fit_with_keywords():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6000, 3)) * 3
    f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    y = (f.cumsum(axis=1) > rng.random(6000)[:, None]).argmax(axis=1)
    spec = FitSpec(eps=0.1, p=math.inf, mode="paper", seed=2)
    a, b = fit(f, y, spec), fit(f, y, eps=0.1, p=math.inf, mode="paper", seed=2)
    assert a.with_version(1, "t").to_json() == b.with_version(1, "t").to_json()
    c = fit(f, y, spec, seed=5)  # keywords replace the spec's options
    d = fit(f, y, eps=0.1, p=math.inf, mode="paper", seed=5)
    assert c.with_version(1, "t").to_json() == d.with_version(1, "t").to_json()


@pytest.mark.parametrize("given", ["inf", "INF", "Infinity", " +inf ", math.inf, np.inf])
def test_p_inf_is_accepted_as_a_string_like_the_cli_and_the_daemon(given):
    assert FitSpec(eps=0.05, p=given).p == math.inf
    assert FitSpec(eps=0.05, p="2.5").p == 2.5


def test_p_domain_is_defined_once(tmp_path):
    from daemon import settings
    from lpcal.cli import build_parser
    from lpcal.p_norm import P_DOMAIN, parse_p

    assert parse_p("inf") == math.inf and parse_p(2) == 2.0
    for bad in (1, 1.0, "1", 0.5, "nan", float("nan"), True, None):
        with pytest.raises(InputError, match=f"p must be {P_DOMAIN}"):
            parse_p(bad)
    # the CLI and the daemon's settings say the same
    err = pytest.raises(SystemExit, build_parser().parse_args,
                        ["fit", "--input", "x.npz", "--eps", "0.1", "--p", "1", "--out", "m"])
    assert err.value.code == 2
    toml = tmp_path / "lpcal.toml"
    toml.write_text("[defaults]\np = 1\n")
    with pytest.raises(settings.SettingsError, match=f"defaults.p: p must be {P_DOMAIN}"):
        settings.load_settings(toml, secrets_dir=tmp_path)
    toml.write_text('[defaults]\np = "Infinity"\n')
    assert settings.load_settings(toml, secrets_dir=tmp_path).defaults.p == math.inf
    # evaluating Err_p also allows p = 1, with the same parser
    from lpcal import metrics
    from lpcal.p_norm import ERR_P_DOMAIN

    probs, labels = np.full((4, 2), 0.5), np.array([0, 1, 0, 1])
    assert metrics.err_p(probs, labels, 10, 1) == metrics.err_p(probs, labels, 10, "1")
    for bad in (0.5, "nan", True):
        with pytest.raises(InputError, match=re.escape(f"p must be {ERR_P_DOMAIN}")):
            metrics.err_p(probs, labels, 10, bad)


def test_library_messages_print_numpy_scalars_as_plain_numbers():
    from lpcal import metrics
    from lpcal.binmap import BinMap
    from lpcal.errors import shown
    from lpcal.levels import beta_for

    assert shown(np.float64(1.1)) == "1.1" and shown(np.int64(3)) == "3" and shown("x") == "'x'"
    probs = np.full((4, 2), 0.5)
    labels = np.array([0, 1, 0, 1])
    cases = [
        (lambda: beta_for(np.float64(1.5), 2.0), "eps must lie in (0, 1), got 1.5"),
        (lambda: metrics.err_p(probs, labels, np.int64(0), 2.0),
         "lambda must be a positive integer, got 0"),
        (lambda: metrics.err_p(probs, labels, 10, np.float64(0.5)), "got 0.5"),
        (lambda: fit(probs, labels, eps=0.1, p=2, delta=np.float64(2.0)), "got 2.0"),
    ]
    bm = BinMap.from_json(fit(np.tile(probs, (500, 1)), np.tile(labels, 500), eps=0.2,
                              p=math.inf, mode="paper").to_json())
    cases.append((lambda: bm.apply(np.array([[0.5, 0.7], [0.5, 0.5]])),
                  "not a probability vector (sum 1.2, min 0.5)"))
    for call, message in cases:
        with pytest.raises(InputError) as e:
            call()
        assert message in str(e.value) and "np." not in str(e.value), str(e.value)


def test_the_package_exports_the_fit_the_artifact_and_the_spec():
    """``lpcal`` exports the fit, the bin map, its certificate, the spec with its enums and
    the metrics; pools and sizing are imported from their modules."""
    import lpcal

    assert set(lpcal.__all__) == {
        "fit", "fit_pools", "BinMap", "Certificate", "FitSpec", "EPS_AUTO", "Mode", "Outside",
        "Prescale", "SizingRule", "Variant", "metrics", "ArtifactError", "InputError",
        "LpcalError"}
    assert all(hasattr(lpcal, name) for name in lpcal.__all__)
    for internal in ("PoolSet", "PoolLayout", "CountTable", "practical_sizing",
                     "theory_sizing"):
        assert not hasattr(lpcal, internal), internal
