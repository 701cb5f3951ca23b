"""The certified default: temperature grid, held-out sums, the Err_p bound, selection, pools with
warm-up and held-out share, bin-map schema 2 (and schema 1 still readable), and the CLI."""

import math
import warnings

import numpy as np
import orjson
import pytest

from lpcal import fit, metrics
from lpcal.binmap import BinMap
from lpcal.certificate import Certificate, certify_and_select, err_p_bound
from lpcal.cli import main as cli_main
from lpcal.errors import ArtifactError, InputError
from lpcal.holdout import HoldoutSums
from lpcal.io import load_predictions, save_npz, softmax_rows
from lpcal.levels import bin_counts
from lpcal.metrics import err_p_true
from lpcal.pools import PoolLayout, PoolSet
from lpcal.precalibrate import TemperatureGrid
from lpcal.spec import FitSpec
from lpcal.temperature import apply_temperature, fit_temperature

RECORD = "lpcal/data/wideresnet-16-4-cifar-10.npz"


def _tempered(n, k, t_true, seed, scale=3.0):
    """Overconfident model ``f = softmax(z)``, labels from ``softmax(z / t_true)``."""
    r = np.random.default_rng(seed)
    z = r.normal(size=(n, k)) * scale
    f = softmax_rows(z)
    q = softmax_rows(z / t_true)
    y = (q.cumsum(1) > r.random(n)[:, None]).argmax(1)
    return f, q, y


# ----------------------------------------------------------------------------- temperature grid


def test_grid_is_additive_and_matches_the_exact_fit():
    f, _, y = _tempered(6000, 5, 2.5, seed=0)
    whole = TemperatureGrid().update(f, y)
    parts = TemperatureGrid().update(f[:1000], y[:1000]).merge(
        TemperatureGrid().update(f[1000:], y[1000:]))
    np.testing.assert_allclose(parts.nll, whole.nll, rtol=1e-12)
    assert parts.n == whole.n == 6000
    t_exact = fit_temperature(f, y)
    assert abs(whole.fit() / t_exact - 1) < 0.005  # parabolic refinement of the grid
    back = TemperatureGrid.from_dict(orjson.loads(orjson.dumps(whole.to_dict())))
    assert back == whole and back.fit() == whole.fit()


def test_grid_errors_and_edges():
    with pytest.raises(InputError, match="no sample"):
        TemperatureGrid().fit()
    with pytest.raises(InputError, match="malformed temperature grid"):
        TemperatureGrid.from_dict({"grid": "log2T:-4:4:1/8", "nll": [0.0], "n": 1,
                                   "skipped": 0})
    # a label with probability 0 carries no information: skipped, not summed
    g = TemperatureGrid().update(np.array([[1.0, 0.0], [0.7, 0.3]]), np.array([1, 0]))
    assert (g.n, g.skipped) == (1, 1)
    # labels that always follow the top class push T to the lower edge of the grid
    f, _, _ = _tempered(500, 3, 1.0, seed=1)
    g = TemperatureGrid().update(f, f.argmax(1))
    assert g.at_edge and g.fit() == pytest.approx(1 / 16)
    # ... but on a handful of such samples the prior on log2 T keeps T off the edge
    g = TemperatureGrid().update(f[:30], f[:30].argmax(1))
    assert not g.at_edge and 1 / 16 < g.fit() < 1


# ----------------------------------------------------------------------------- held-out sums


def test_holdout_identity_cells_equal_the_plug_in_metrics():
    f, _, y = _tempered(3000, 4, 2.0, seed=2)
    h = HoldoutSums(4, 20).update(f[:1000], y[:1000])
    h.update(f[1000:], y[1000:])
    c = h.cells()
    assert c.n == 3000 and c.counts.sum() == 3000
    assert np.abs(c.S / c.n).max() == pytest.approx(metrics.err_p(f, y, 20, math.inf), rel=1e-9)
    assert c.brier == pytest.approx(metrics.brier(f, y), rel=1e-9)
    back = HoldoutSums.from_dict(orjson.loads(orjson.dumps(h.to_dict())))
    assert back == h
    with pytest.raises(InputError, match="hold"):
        HoldoutSums.from_dict({**h.to_dict(), "counts": [0] * h.n_bins}, "hold")


def test_holdout_constant_candidate_equals_direct_evaluation():
    f, _, y = _tempered(2000, 3, 2.0, seed=3)
    h = HoldoutSums(3, 10).update(f, y)
    # the candidate: constant on the 5 heaviest bins, identity elsewhere
    top = np.argsort(-h.counts)[:5]
    consts = np.random.default_rng(0).dirichlet(np.ones(3), size=5)
    c = h.cells(h.hashes[top], consts)
    # direct: apply the candidate row by row and compute Err_inf and Brier on its level sets
    rows = bin_counts(f, 10)
    out = f.copy()
    for i, b in enumerate(top):
        out[(rows == h.rows[b]).all(axis=1)] = consts[i]
    assert np.abs(c.S / c.n).max() == pytest.approx(metrics.err_p(out, y, 10, math.inf),
                                                    rel=1e-9)
    assert c.brier == pytest.approx(metrics.brier(out, y), rel=1e-9)


# ----------------------------------------------------------------------------- the bound


@pytest.mark.parametrize("p,lam", [(math.inf, 20), (2.0, 50)])
def test_bound_covers_the_true_error(p, lam):
    """Coverage at delta = 0.1 over independent held-out samples of a known distribution."""
    f_big, q_big, _ = _tempered(200_000, 3, 1.6, seed=10)
    truth = err_p_true(f_big, q_big, lam, p)
    covered, widths = 0, []
    for s in range(20):
        f, _, y = _tempered(2000, 3, 1.6, seed=100 + s)
        est, bound = err_p_bound(HoldoutSums(3, lam).update(f, y).cells(), p, 0.1)
        assert bound >= est
        covered += bound >= truth
        widths.append(bound - truth)
    assert covered >= 18, f"the bound covered the true Err_p {truth:.4f} in {covered}/20"
    assert np.median(widths) < 0.15  # and is not vacuous


def test_selection_prefers_certified_brier_then_lowest_bound():
    f, _, y = _tempered(3000, 3, 2.0, seed=4)
    good = HoldoutSums(3, 20).update(apply_temperature(f, 2.0), y).cells()
    bad = HoldoutSums(3, 20).update(f, y).cells()
    cert = certify_and_select({"precalibrator": good, "corrected": bad}, eps=0.5, p=math.inf,
                              lam=20, delta=0.1)
    assert cert.certified and cert.selected == "precalibrator"  # both certified: best Brier
    cert = certify_and_select({"precalibrator": bad, "corrected": good}, eps=1e-4, p=math.inf,
                              lam=20, delta=0.1, reported={"raw": bad})
    assert not cert.certified and cert.selected == "corrected"  # none: lowest bound
    assert set(cert.estimates) == {"raw", "precalibrator", "corrected"}
    assert Certificate.from_dict(orjson.loads(orjson.dumps(cert.to_dict()))) == cert
    text = cert.format()
    assert "certified: no (bound" in text and "NOT certified" not in text
    # each of the two selectable candidates is bounded at delta/2, the raw model too
    assert cert.selectable == 2 and "bonferroni over 2" in cert.method
    assert cert.estimates["corrected"].bound == err_p_bound(good, math.inf, 0.05)[1]
    assert not cert.vacuous  # the raw model does not meet eps = 1e-4


def test_vacuous_when_the_raw_model_already_meets_eps():
    f, _, y = _tempered(3000, 3, 2.0, seed=4)
    ts = HoldoutSums(3, 20).update(apply_temperature(f, 2.0), y).cells()
    raw = HoldoutSums(3, 20).update(f, y).cells()
    raw_bound = err_p_bound(raw, math.inf, 0.05)[1]
    loose = certify_and_select({"precalibrator": ts, "corrected": ts}, eps=raw_bound + 0.01,
                               p=math.inf, lam=20, delta=0.1, reported={"raw": raw})
    tight = certify_and_select({"precalibrator": ts, "corrected": ts}, eps=raw_bound - 1e-6,
                               p=math.inf, lam=20, delta=0.1, reported={"raw": raw})
    assert loose.vacuous and loose.raw_bound == pytest.approx(raw_bound)
    assert "vacuous: yes" in loose.format()
    assert not tight.vacuous and "vacuous" not in tight.format()
    assert Certificate.from_dict(loose.to_dict()).vacuous
    # certificates written before the field read as not vacuous, one candidate
    old = {k: v for k, v in loose.to_dict().items() if k not in ("vacuous", "selectable")}
    back = Certificate.from_dict(old)
    assert (back.vacuous, back.selectable) == (False, 1)
    with pytest.raises(InputError, match="vacuous must be true or false"):
        Certificate.from_dict({**loose.to_dict(), "vacuous": "false"})


# ----------------------------------------------------------------------------- fit and artifact


def test_default_on_a_real_network_is_within_noise_of_temperature_scaling():
    x, y = load_predictions(RECORD)
    perm = np.random.default_rng(0).permutation(len(y))
    a, b = perm[:5000], perm[5000:]
    bm = fit(x[a], y[a], eps=0.05, p=math.inf)
    assert bm.mode == "certified" and bm.certificate.certified
    h = bm.apply(x[b])
    ts = apply_temperature(x[b], fit_temperature(x[a], y[a]))
    assert metrics.top_label_ece(h, y[b]) <= metrics.top_label_ece(ts, y[b]) + 0.003
    assert metrics.classwise_ece(h, y[b]) <= metrics.classwise_ece(ts, y[b]) + 0.001
    assert metrics.brier(h, y[b]) <= metrics.brier(ts, y[b]) + 0.001
    assert metrics.nll(h, y[b]) <= metrics.nll(ts, y[b]) + 0.01
    assert metrics.accuracy(h, y[b]) >= metrics.accuracy(ts, y[b]) - 0.001
    # and better than the raw model on every metric practitioners read
    for m in (metrics.top_label_ece, metrics.classwise_ece, metrics.brier, metrics.nll):
        assert m(h, y[b]) < m(x[b], y[b])


def test_paper_mode_is_algorithm_2_without_extensions():
    f, _, y = _tempered(8000, 3, 2.0, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = fit(f, y, eps=0.1, p=math.inf, mode="paper")
    assert (bm.mode, bm.temperature, bm.outside, bm.certificate) == ("paper", None, "rho", None)
    assert bm.sizing["holdout"] == 0 and bm.n_bins > 0
    with pytest.raises(InputError, match="mode must be one of"):
        fit(f, y, eps=0.1, p=math.inf, mode="fast")
    with pytest.raises(InputError, match="holdout_fraction"):
        fit(f, y, eps=0.1, p=math.inf, holdout_fraction=1.0)


def test_schema_2_round_trip_and_schema_1_still_reads():
    f, _, y = _tempered(8000, 3, 2.0, seed=6)
    bm = fit(f, y, eps=0.1, p=math.inf)
    back = BinMap.from_json(bm.to_json())
    assert back.certificate == bm.certificate and back.mode == "certified"
    np.testing.assert_array_equal(back.apply(f[:100]), bm.apply(f[:100]))
    # a schema-1 artifact, as lpcal 0.1 wrote it: no mode, no certificate
    obj = orjson.loads(bm.to_json())
    for key in ("mode", "certificate", "checksum"):
        obj.pop(key)
    obj["schema"] = 1
    obj["checksum"] = BinMap._digest(obj)
    old = BinMap.from_json(orjson.dumps(obj))
    assert old.mode == "paper" and old.certificate is None
    np.testing.assert_array_equal(old.apply(f[:100]), bm.apply(f[:100]))
    # a forged certificate that selects a candidate it does not estimate is refused
    obj = orjson.loads(bm.to_json())
    obj.pop("checksum")
    obj["certificate"]["selected"] = "magic"
    obj["checksum"] = BinMap._digest(obj)
    with pytest.raises(ArtifactError, match="magic"):
        BinMap.from_json(orjson.dumps(obj))


def test_precalibrator_map_is_temperature_scaling():
    f, _, y = _tempered(20_000, 4, 3.0, seed=7)
    bm = fit(f, y, eps=0.05, p=math.inf)
    assert bm.certificate.selected == "precalibrator" and bm.n_bins == 0
    np.testing.assert_allclose(bm.apply(f[:500]), apply_temperature(f[:500], bm.temperature),
                               atol=1e-12)
    assert 2.7 < bm.temperature < 3.3


# ----------------------------------------------------------------------------- streaming pools


def _layout(holdout=300, warmup=200):
    import dataclasses

    from lpcal.sizing import practical_sizing

    sz = practical_sizing(0.1, math.inf, 0.1, 3, mu_pool=400, pool=150, variant="shared")
    return dataclasses.replace(sz, holdout=holdout, warmup=warmup).layout()


def test_pool_set_warm_up_route_and_exact_fill_point():
    lay = _layout()
    f, _, y = _tempered(lay.total_target * 3, 3, 2.0, seed=8)
    u = np.random.default_rng(1).random(len(y))
    ps = PoolSet(lay)
    used = ps.add_samples(u[:150], f[:150], y[:150])
    assert used == 150 and ps.warming and ps.temperature is None
    used += ps.add_samples(u[150:], f[150:], y[150:])
    assert ps.full and not ps.warming and 1.6 < ps.temperature < 2.5
    fill = ps.fill()
    assert fill["warmup"] == (200, 200) and fill["hold"][0] >= 300
    # the sample at the fill point completed the last destination: one fewer is not full
    again = PoolSet(lay)
    assert again.add_samples(u[: used - 1], f[: used - 1], y[: used - 1]) == used - 1
    assert not again.full
    assert again.add_samples(u[used - 1:], f[used - 1:], y[used - 1:]) == 1 and again.full
    assert again == ps
    # serialised and restored exactly; fit_pools certifies from the held-out sums
    back = PoolSet.from_dict(orjson.loads(orjson.dumps(ps.to_dict())))
    assert back == ps
    from lpcal.calibrate import fit_pools

    bm = fit_pools(back, FitSpec(eps=0.1, p=math.inf))
    assert bm.temperature == ps.temperature and bm.certificate.n_holdout == ps.holdout.n


def test_pool_layout_round_trip_and_validation():
    lay = _layout()
    assert PoolLayout.from_dict(lay.to_dict()) == lay
    assert lay.routes[-1] == "hold"
    with pytest.raises(InputError, match="holdout and warmup"):
        PoolLayout(3, 10, lay.levels, "shared", lay.targets, -1, 0)


# ----------------------------------------------------------------------------- CLI


def test_cli_fit_and_eval_print_the_certificate(tmp_path, capsys):
    x, y = load_predictions(RECORD)
    save_npz(tmp_path / "fit.npz", x[:5000], y[:5000])
    save_npz(tmp_path / "eval.npz", x[5000:], y[5000:])
    out = tmp_path / "bm.json"
    assert cli_main(["fit", "--input", str(tmp_path / "fit.npz"), "--eps", "0.05", "--p", "inf",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "certificate: Err_inf at lambda=20 on 1500 held-out samples" in text
    assert "<- published" in text and "certified: yes (bound" in text
    assert cli_main(["eval", "--input", str(tmp_path / "eval.npz"), "--binmap", str(out)]) == 0
    text = capsys.readouterr().out
    assert "raw" in text and "precalibrator" in text and "corrected" in text
    assert cli_main(["fit", "--input", str(tmp_path / "fit.npz"), "--eps", "0.05", "--p", "inf",
                     "--mode", "paper", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["eval", "--input", str(tmp_path / "eval.npz"), "--binmap", str(out)]) == 0
    assert "certificate: none" in capsys.readouterr().out


def test_sample_too_small_to_certify_gets_temperature_scaling_on_all_of_it():
    from lpcal.certificate import NO_HOLDOUT, min_certifiable_holdout

    need = min_certifiable_holdout(0.05, math.inf, 0.1, 4, candidates=2)
    # the bound on zero residuals: above eps one sample below `need`, at most eps at `need`
    from lpcal.certificate import _empty_margin
    assert _empty_margin(need - 1, math.inf, 0.05, 4) > 0.05 >= _empty_margin(need, math.inf,
                                                                               0.05, 4)
    assert min_certifiable_holdout(0.05, math.inf, 0.1) <= need  # k = 2, one candidate
    f, _, y = _tempered(int(need / 0.3) - 10, 4, 2.0, seed=9)  # 30% is just below `need`
    bm = fit(f, y, eps=0.05, p=math.inf)
    cert = bm.certificate
    assert cert.method == NO_HOLDOUT and not cert.certified and cert.bound == math.inf
    assert bm.n_bins == 0 and bm.temperature == pytest.approx(fit_temperature(f, y), rel=0.05)
    np.testing.assert_allclose(bm.apply(f), apply_temperature(f, bm.temperature), atol=1e-12)
    assert "certified: no" in cert.format()
    assert BinMap.from_json(bm.to_json()).certificate == bm.certificate
    # an explicit share is respected: held out and evaluated, just not certifiable
    bm = fit(f, y, eps=0.05, p=math.inf, holdout_fraction=0.3)
    assert bm.certificate.n_holdout == round(len(y) * 0.3)
    assert not bm.certificate.certified


# ----------------------------------------------------------------------------- eps = "auto"


def test_eps_auto_is_certifiable_and_never_reads_the_held_out_share(capsys, tmp_path):
    from lpcal.calibrate import AUTO_EPS_GRID, auto_eps

    f, _, y = _tempered(5000, 4, 2.5, seed=11)
    bm = fit(f, y, eps="auto", p=math.inf)
    assert bm.eps in AUTO_EPS_GRID and bm.certificate.eps == bm.eps
    assert bm.certificate.certified
    # a smaller grid value would not have met the margin on the fitting share
    i = AUTO_EPS_GRID.index(bm.eps)
    assert i > 0 and auto_eps(f, y, FitSpec(eps="auto", p=math.inf)) == bm.eps
    # the held-out share (the first 30% of the seeded permutation) does not move it
    hold = np.random.default_rng(0).permutation(len(y))[:1500]
    y2 = y.copy()
    y2[hold] = (y2[hold] + 1) % 4
    assert auto_eps(f, y2, FitSpec(eps="auto", p=math.inf)) == bm.eps
    with pytest.raises(InputError, match="'auto'"):
        FitSpec(eps="small", p=math.inf)
    with pytest.raises(InputError, match="resolves it"):
        _ = FitSpec(eps="auto", p=math.inf).lam
    with pytest.raises(InputError, match="held-out share"):
        fit(f, y, eps="auto", p=math.inf, holdout_fraction=0.0)
    save_npz(tmp_path / "fit.npz", f, y)
    assert cli_main(["fit", "--input", str(tmp_path / "fit.npz"), "--eps", "auto", "--p",
                     "inf", "--out", str(tmp_path / "bm.json")]) == 0
    out = capsys.readouterr().out
    assert f"eps auto: {bm.eps:g}" in out and "mode=certified" in out and "certified: yes" in out


# ----------------------------------------------------------------------------- probability floor


def _halves(seed):
    probs, labels = load_predictions(RECORD)
    perm = np.random.default_rng(seed).permutation(len(labels))
    a, b = perm[: len(perm) // 2], perm[len(perm) // 2:]
    return probs[a], labels[a], probs[b], labels[b]


@pytest.mark.parametrize("options", [
    {"mode": "paper"},
    # certified mode without the pre-calibrator: the corrected map is certified and published
    {"mode": "certified", "prescale": "none", "outside": "rho"},
])
def test_map_never_outputs_zero_for_a_seen_class_on_a_real_network(options):
    # the network outputs exactly 1.0 (float32) for some images: bins outside B whose rho is
    # one-hot, and the kernel's projection sets classes to 0 inside B; without the floor one
    # evaluation image of its true class gets probability 0 (NLL infinite)
    x, y, xt, yt = _halves(1)
    bm = fit(x, y, eps=0.02, p=math.inf, seed=1, **options)
    assert bm.certificate is None or bm.certificate.selected == "corrected"
    h = bm.apply(xt)
    seen = np.unique(y)
    assert seen.size == 10 and (h[:, seen] > 0).all()
    assert np.isfinite(metrics.nll(h, yt))
    # the floor changed only outputs that had a zero, by at most 2 m eta in l1 (= eps / 50)
    eta = bm.floor["eta"]
    assert bm.floor["classes"] == seen.tolist() and eta == pytest.approx(0.01 * 0.02 / 10)
    raw = BinMap(**{**_fields(bm), "floor": None}).apply(xt)
    moved = np.abs(h - raw).sum(axis=1)
    assert ((moved > 0) == (raw[:, seen] == 0).any(axis=1)).all()
    assert moved.max() <= 2 * seen.size * eta + 1e-12
    # the same holds for single rows and survives the JSON round trip
    again = BinMap.from_json(bm.to_json())
    assert again.floor == bm.floor
    i = int(np.flatnonzero(moved)[0])
    np.testing.assert_allclose(again.apply(xt[i]), h[i], rtol=0, atol=1e-15)


@pytest.mark.parametrize("mode", ["certified", "paper"])
def test_certificate_covers_the_floored_map(mode):
    x, y, _, _ = _halves(2)
    bm = fit(x, y, eps=0.02, p=math.inf, mode=mode, prescale="none", outside="rho",
             holdout_fraction=0.3, seed=2)
    n_hold = round(len(y) * 0.3)
    hold = np.random.default_rng(2).permutation(len(y))[:n_hold]
    h = bm.apply(x[hold])
    assert (h > 0).all()
    est = bm.certificate.estimates["corrected"]
    assert est.err_p == pytest.approx(metrics.err_p(h, y[hold], bm.lam, math.inf), rel=1e-9)
    assert est.brier == pytest.approx(metrics.brier(h, y[hold]), rel=1e-9)


def test_floor_field_is_checked_and_old_maps_load_without_it():
    x, y, _, _ = _halves(3)
    bm = fit(x[:3000], y[:3000], eps=0.05, p=math.inf, mode="paper")
    obj = orjson.loads(bm.to_json())
    assert "floor" in obj
    del obj["floor"], obj["checksum"]
    old = BinMap.from_json(orjson.dumps({**obj, "checksum": BinMap._digest(obj)}))
    assert old.floor is None and "floor" not in orjson.loads(old.to_json())
    for bad, message in (({"eta": 0.5, "classes": list(range(10))}, "does not fit"),
                         ({"eta": 1e-4, "classes": [10]}, r"indices in \[0, 10\)"),
                         ({"classes": [1]}, "floor is malformed")):
        with pytest.raises(ArtifactError, match=message):
            BinMap(**{**_fields(bm), "floor": bad})


def _fields(bm):
    import dataclasses

    return {f.name: getattr(bm, f.name) for f in dataclasses.fields(bm)}
