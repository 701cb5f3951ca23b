"""Certificates of the maps the online loop publishes: the certification share, the fields,
coverage of the true Err_p on truth-known families, looks, replay and checkpoint determinism."""

import itertools
import json
import math

import numpy as np

from lpcal.binmap import BinMap
from lpcal.certificate import BOUND_INF, Certificate
from lpcal.io import softmax_rows
from lpcal.metrics import err_p_true
from lpcal.online import OnlineCalibrator, OnlineConfig, certify_map, index_uniforms, run_fit
from tests.test_oracle import synth_class_dependent

CFG = OnlineConfig(eps=0.05, pools_from=10**9)  # temperature candidates only: fast


def tempered_truth(n, seed, k=10, scale=3.0, t=2.0):
    """``(f, q, y)``: f = softmax(z), labels from q = softmax(z / t) (temperature scaling at
    ``t`` is exactly calibrated)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * scale
    f, q = softmax_rows(z), softmax_rows(z / t)
    y = (q.cumsum(1) > rng.random(n)[:, None]).argmax(1)
    return f, q, y


def published(events):
    return [e.binmap for e in events if e.kind == "published"]


def test_certification_samples_enter_no_test_and_no_fit():
    f, _, y = tempered_truth(6000, 0)
    cal = OnlineCalibrator(10, CFG)
    cal.update(f, y)
    w = cal.window
    u = index_uniforms(0, 6000)
    route = w.layout.route_uniforms(u)
    fit = route < len(w.layout.names)
    cert = w.certifying(u)
    assert not (cert & fit).any()                      # a subset of the held-out share
    share = CFG.cert_share
    assert share - 0.05 < cert.sum() / (~fit).sum() < share + 0.05   # cert_share of it
    # every bucket: fit share + test share + certification share = its samples
    assert all(b.grid.n + b.grid.skipped + b.held.n + b.cert_n == b.n for b in w.buckets)
    assert w.held().n == int((~fit & ~cert).sum())     # the loss grids: test share only
    x, yc = w.cert_samples()
    assert np.array_equal(x, f[cert]) and np.array_equal(yc, y[cert])
    assert sum(b.n_cert for b in w.buckets) == yc.size


def test_published_maps_carry_a_certificate_of_their_err_p():
    f, _, y = tempered_truth(9000, 1)
    cal = OnlineCalibrator(10, CFG)
    up = cal.update(f, y)
    maps = up.published
    assert maps
    for bm in maps:
        c = bm.certificate
        assert isinstance(c, Certificate) and c.selected == "precalibrator"
        assert (c.eps, c.p, c.delta, c.lam) == (CFG.eps, math.inf, CFG.delta, bm.lam)
        assert c.method.startswith(BOUND_INF) and "certification share" in c.method
        assert c.selectable == 2 and set(c.estimates) == {"raw", "precalibrator"}
        assert c.certified == (c.bound <= CFG.eps)
        assert c.raw_bound > c.bound            # the raw model is over-confident
        assert "evidence" in bm.sizing          # the test's evidence is kept
        back = BinMap.from_json(bm.to_json())
        assert back.certificate.to_dict() == c.to_dict()
    # the certificate of the last map is the bound on the window's certification samples
    x, yc = cal.window.cert_samples()
    last = maps[-1]
    if last.sizing["samples"] == cal.n_seen:
        assert certify_map(last, x, yc).to_dict() == last.certificate.to_dict()
    # the certification share only grows within the first 20 buckets
    sizes = [bm.certificate.n_holdout for bm in maps]
    assert sizes[0] > 0 and sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


def test_certificates_cover_the_true_error_on_truth_known_families():
    # every certificate published (temperature maps, Algorithm 2's corrected maps, and the
    # raw model's bound each carries) against the true Err_inf from the known label law
    fb, qb, _ = tempered_truth(20_000, 10**6)
    cases, misses = 0, 0
    for seed in range(5):
        f, _, y = tempered_truth(8000, seed)
        for bm in published(OnlineCalibrator(10, CFG).update(f, y).events):
            c = bm.certificate
            misses += c.bound < err_p_true(bm.apply(fb), qb, bm.lam, math.inf)
            misses += c.raw_bound < err_p_true(fb, qb, bm.lam, math.inf)
            cases += 2
    cfb, cqb, _ = synth_class_dependent(20_000, 3, seed=10**6)
    cfg = OnlineConfig(eps=0.1, pools_from=2000)
    corrected = 0
    for seed in range(2):
        f, _, y = synth_class_dependent(12_000, 3, seed=seed)
        for bm in published(OnlineCalibrator(3, cfg, fit=run_fit).update(f, y).events):
            c = bm.certificate
            corrected += bool(bm.n_bins)
            misses += c.bound < err_p_true(bm.apply(cfb), cqb, bm.lam, math.inf)
            cases += 1
    print(f"{misses} misses in {cases} bounds, {corrected} corrected maps")
    assert cases >= 15 and corrected >= 1
    # each bound holds with probability >= 1 - delta = 0.9 (look 1: 0.95): more than a
    # fifth missed would be far outside that
    assert misses <= cases // 5


def test_an_uncertified_map_is_certified_again_as_samples_accrue():
    # a small eps: the first map's certificate (few certification samples) does not certify
    cfg = OnlineConfig(eps=0.025, pools_from=10**9, growth=4.0)   # few refits
    hits = 0
    for seed in range(2):
        f, _, y = tempered_truth(10_000, seed)
        ev = OnlineCalibrator(10, cfg).update(f, y).events
        pubs = [e for e in ev if e.kind == "published"]
        for a, b in itertools.pairwise(pubs):
            if b.detail != "recertified":
                continue
            hits += 1
            assert not a.binmap.certificate.certified and b.binmap.certificate.certified
            assert b.version == a.version + 1 and b.temperature == a.temperature
            assert b.binmap.certificate.selectable > a.binmap.certificate.selectable
            assert b.binmap.certificate.n_holdout > a.binmap.certificate.n_holdout
            assert b.binmap.sizing["recertified"]["look"] >= 2
            assert b.binmap.sizing["evidence"] == a.binmap.sizing["evidence"]
    assert hits == 2


def test_certificates_are_replay_and_checkpoint_deterministic():
    f, _, y = tempered_truth(9000, 3)

    def certs(events):
        return [(e.n, e.version, e.binmap.certificate.to_dict()) for e in events
                if e.kind == "published"]

    whole = certs(OnlineCalibrator(10, CFG).update(f, y).events)
    cal = OnlineCalibrator(10, CFG)
    ev = []
    for a, b in itertools.pairwise([0, 17, 1000, 2999, 4100, 9000]):
        ev += cal.update(f[a:b], y[a:b]).events
    assert certs(ev) == whole and whole
    cal = OnlineCalibrator(10, CFG)
    first = cal.update(f[:4100], y[:4100]).events
    back = OnlineCalibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.window == cal.window and back.cert_looks == cal.cert_looks
    assert certs(first + back.update(f[4100:], y[4100:]).events) == whole


def test_without_a_certification_share_maps_keep_the_fit_certificate_only():
    f, _, y = tempered_truth(6000, 0)
    bm = OnlineCalibrator(10, OnlineConfig(pools_from=10**9, cert_share=0.0)).update(
        f, y).published[0]
    assert bm.certificate is None
    empty = certify_map(bm, np.zeros((0, 10)), np.zeros(0, np.int64))
    assert empty.n_holdout == 0 and not empty.certified and math.isinf(empty.bound)


def test_a_state_written_before_the_certification_share_restores_and_adopts_it():
    f, _, y = tempered_truth(9000, 2)
    old = OnlineCalibrator(10, OnlineConfig(pools_from=10**9, cert_share=0.0))
    old.update(f[:3000], y[:3000])
    d = json.loads(json.dumps(old.to_dict()))
    for key in ("cert_share", "cert_growth", "cert_buckets"):
        del d["config"][key]
    for key in ("cert_share", "cert_buckets"):
        del d["window"][key]
    del d["cert_looks"], d["cert_next"]
    back = OnlineCalibrator.from_dict(d)
    assert back.config.cert_share == back.window.cert_share == OnlineConfig().cert_share
    maps = back.update(f[3000:], y[3000:]).published
    assert maps and maps[-1].certificate.n_holdout > 0
