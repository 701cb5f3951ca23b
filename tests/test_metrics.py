"""Tests of lpcal.metrics against the paper's definitions and an independent brute-force reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lpcal import metrics as M
from lpcal.errors import InputError
from lpcal.io import softmax_rows
from lpcal.levels import bin_counts

try:
    from tests import reference_metrics as ref
except ImportError:  # pragma: no cover - depends on how pytest puts tests/ on sys.path
    import reference_metrics as ref

P_VALUES = [1.0, 1.5, 2.0, 3.0, math.inf]


def close(a: float, b: float, rel: float = 1e-9, abs_: float = 1e-12) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@st.composite
def samples(draw, max_n: int = 25, max_k: int = 5):
    """Probability rows from small integer weights (exact bin edges happen a lot) plus labels."""
    k = draw(st.integers(1, max_k))
    n = draw(st.integers(1, max_n))
    weights = draw(
        st.lists(
            st.lists(st.integers(0, 12), min_size=k, max_size=k).filter(lambda r: sum(r) > 0),
            min_size=n,
            max_size=n,
        )
    )
    w = np.asarray(weights, dtype=np.float64)
    probs = w / w.sum(axis=1, keepdims=True)
    labels = np.asarray(draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n)))
    lam = draw(st.integers(1, 12))
    return probs, labels, lam


def dirichlet_sample(rng, n, k, alpha=1.0):
    probs = rng.dirichlet(np.full(k, alpha), size=n)
    labels = rng.integers(0, k, size=n)
    return probs, labels


# ----------------------------------------------------------------------------- Err_p identities


@settings(max_examples=60, deadline=None)
@given(samples(), st.sampled_from(P_VALUES))
def test_err_p_matches_bruteforce_reference(data, p):
    probs, labels, lam = data
    assert close(M.err_p(probs, labels, lam, p), ref.err_p(probs, labels, lam, p))


@settings(max_examples=60, deadline=None)
@given(samples())
def test_err_1_is_the_papers_ece_form(data):
    probs, labels, lam = data
    assert close(M.err_p(probs, labels, lam, 1), ref.err_1_ece_form(probs, labels, lam))


@settings(max_examples=60, deadline=None)
@given(samples(), st.floats(1.0, 50.0))
def test_err_p_is_sandwiched_between_err_inf_and_err_1(data, p):
    probs, labels, lam = data
    e1 = M.err_p(probs, labels, lam, 1)
    ep = M.err_p(probs, labels, lam, p)
    einf = M.err_p(probs, labels, lam, math.inf)
    slack = 1e-12
    assert einf <= ep + slack and ep <= e1 + slack
    # and non-increasing in p
    assert M.err_p(probs, labels, lam, p + 1.0) <= ep + slack


@settings(max_examples=40, deadline=None)
@given(samples(), st.sampled_from(P_VALUES))
def test_breakdown_parts_add_up(data, p):
    probs, labels, lam = data
    b = M.err_p_breakdown(probs, labels, lam, p)
    table, n = ref.err_table(probs, labels, lam)
    assert b.n == n and close(b.value, ref.err_p(probs, labels, lam, p))
    assert sorted(b.keys) == sorted(ref.sparse_key(v) for v in table)
    assert close(float(b.mass.sum()), 1.0)
    by_key = dict(zip(b.keys, range(len(b.keys))))
    for v, sums in table.items():
        g = by_key[ref.sparse_key(v)]
        np.testing.assert_allclose(b.error[g], np.abs(sums) / n, rtol=1e-9, atol=1e-12)
        assert b.mass[g] == pytest.approx(
            sum(1 for r in probs if ref.bin_of(r, lam) == v) / n, rel=1e-12
        )
    if math.isinf(p):
        assert close(float(b.per_class.max()), b.value)
        assert close(float(b.per_bin.max()), b.value)
    else:
        assert close(float(b.per_class.sum()), b.value**p, rel=1e-8)
        assert close(float(b.per_bin.sum()), b.value**p, rel=1e-8)
    top = b.top_bins(3)
    assert [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
    assert len(top) == min(3, len(b.keys))


def test_err_p_known_value_by_hand():
    # two samples, k = 2, lambda = 2: f = (0.75, 0.25) in bin (1, 0) with labels 0 and 1.
    probs = np.array([[0.75, 0.25], [0.75, 0.25]])
    labels = np.array([0, 1])
    # S = (0.75-1 + 0.75, 0.25 + 0.25-1) = (0.5, -0.5); Err = (0.25, 0.25)
    assert M.err_p(probs, labels, 2, 1) == pytest.approx(0.5)
    assert M.err_p(probs, labels, 2, 2) == pytest.approx(math.sqrt(2) * 0.25)
    assert M.err_p(probs, labels, 2, math.inf) == pytest.approx(0.25)
    # perfectly calibrated within the bin: one label 0 three times out of four
    probs4 = np.tile([0.75, 0.25], (4, 1))
    assert M.err_p(probs4, [0, 0, 0, 1], 2, 2) == pytest.approx(0.0, abs=1e-15)


def test_err_p_is_permutation_invariant_and_vectorised():
    rng = np.random.default_rng(1)
    probs, labels = dirichlet_sample(rng, 5000, 7, alpha=0.3)
    perm = rng.permutation(5000)
    a = M.err_p(probs, labels, 20, 2)
    b = M.err_p(probs[perm], labels[perm], 20, 2)
    assert a == pytest.approx(b, rel=1e-10)


# ----------------------------------------------------------------------------- streaming sums


@settings(max_examples=40, deadline=None)
@given(samples(max_n=30), st.integers(0, 30), st.sampled_from(P_VALUES))
def test_errsums_merge_equals_whole_batch(data, cut, p):
    probs, labels, lam = data
    cut = min(cut, len(labels) - 1)
    whole = M.ErrSums.from_batch(probs, labels, lam)
    if cut == 0:
        parts = M.ErrSums(probs.shape[1], lam).merge(whole)
    else:
        a = M.ErrSums.from_batch(probs[:cut], labels[:cut], lam)
        b = M.ErrSums.from_batch(probs[cut:], labels[cut:], lam)
        parts = a.merge(b)
        assert parts.compute(p) == pytest.approx(b.merge(a).compute(p), rel=1e-9, abs=1e-12)
        assert a.n == cut and b.n == len(labels) - cut  # operands untouched
    assert parts.n == whole.n == len(labels)
    np.testing.assert_array_equal(parts.hashes, whole.hashes)
    np.testing.assert_array_equal(parts.rows, whole.rows)
    np.testing.assert_array_equal(parts.counts, whole.counts)
    np.testing.assert_allclose(parts.sums, whole.sums, rtol=1e-9, atol=1e-12)
    assert parts.compute(p) == pytest.approx(whole.compute(p), rel=1e-9, abs=1e-12)


def test_errsums_update_in_place_and_windowing():
    rng = np.random.default_rng(2)
    probs, labels = dirichlet_sample(rng, 3000, 4)
    acc = M.ErrSums(4, 10)
    windows = []
    for a in range(0, 3000, 500):
        assert acc.update(probs[a : a + 500], labels[a : a + 500]) is acc
        windows.append(M.ErrSums.from_batch(probs[a : a + 500], labels[a : a + 500], 10))
    assert acc.n == 3000
    assert acc.compute(2) == pytest.approx(M.err_p(probs, labels, 10, 2), rel=1e-10)
    # a sliding window of the last three intervals is the merge of their sums
    last3 = windows[3].merge(windows[4]).merge(windows[5])
    assert last3.compute(3) == pytest.approx(M.err_p(probs[1500:], labels[1500:], 10, 3), rel=1e-10)


def test_errsums_roundtrip_and_errors():
    rng = np.random.default_rng(3)
    probs, labels = dirichlet_sample(rng, 400, 5)
    s = M.ErrSums.from_batch(probs, labels, 8)
    d = json.loads(json.dumps(s.to_dict()))
    back = M.ErrSums.from_dict(d)
    np.testing.assert_array_equal(back.rows, s.rows)
    np.testing.assert_array_equal(back.counts, s.counts)
    np.testing.assert_array_equal(back.sums, s.sums)
    assert back.compute(2) == s.compute(2)
    empty = M.ErrSums(5, 8)
    assert M.ErrSums.from_dict(json.loads(json.dumps(empty.to_dict()))).n == 0
    with pytest.raises(InputError, match="no samples"):
        empty.compute(2)
    with pytest.raises(InputError, match="cannot merge"):
        s.merge(M.ErrSums(5, 9))
    with pytest.raises(InputError, match="expected 5 classes"):
        s.update(np.full((2, 4), 0.25), [0, 1])
    bad = dict(d, counts=d["counts"][:-1])
    with pytest.raises(InputError, match="keys but counts"):
        M.ErrSums.from_dict(bad)
    with pytest.raises(InputError, match="duplicate"):
        M.ErrSums.from_dict(dict(d, keys=[d["keys"][0]] * len(d["keys"])))
    with pytest.raises(InputError, match="not a level set"):
        M.ErrSums.from_dict(dict(d, keys=["0:9"] + d["keys"][1:]))


# ----------------------------------------------------------------------------- debiased estimate


@settings(max_examples=30, deadline=None)
@given(samples(max_n=12, max_k=3).filter(lambda d: len(d[1]) >= 2))
def test_debiased_p2_is_the_u_statistic(data):
    probs, labels, lam = data
    u = ref.err_2_squared_ustat(probs, labels, lam)
    got = M.err_p_debiased(probs, labels, lam, 2)
    # compare squares: sqrt would amplify rounding noise around a true value of 0
    assert got**2 == pytest.approx(max(0.0, u), rel=1e-7, abs=1e-13)


def _discrete_population(rng, n, miscal):
    """f takes three values (one bin each at lambda=10); the label law is f shifted by ``miscal``."""
    atoms = np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    true = atoms + miscal * np.array([[-1, 1, 0], [1, 0, -1], [0, -1, 1]])
    mass = np.array([0.5, 0.3, 0.2])
    which = rng.choice(3, size=n, p=mass)
    u = rng.random(n)
    labels = (true[which].cumsum(axis=1) > u[:, None]).argmax(axis=1)
    exact = {p: (np.abs(mass[:, None] * (atoms - true)) ** p).sum() ** (1 / p) for p in (1.5, 2, 3)}
    return atoms[which], labels, exact


@pytest.mark.parametrize("miscal", [0.0, 0.02, 0.1])
def test_debiased_removes_sampling_bias(miscal):
    rng = np.random.default_rng(10)
    reps, n = 150, 600
    plug = {p: [] for p in (1.5, 2, 3)}
    deb = {p: [] for p in (1.5, 2, 3)}
    exact = None
    for _ in range(reps):
        probs, labels, exact = _discrete_population(rng, n, miscal)
        for p, values in plug.items():
            values.append(M.err_p(probs, labels, 10, p) ** p)
            deb[p].append(M.err_p_debiased(probs, labels, 10, p) ** p)
    for p, values in plug.items():
        target = exact[p] ** p
        bias_plug = np.mean(values) - target
        bias_deb = np.mean(deb[p]) - target
        assert bias_plug > 0  # the plug-in overestimates
        assert abs(bias_deb) < 0.5 * bias_plug, (p, miscal, bias_plug, bias_deb)
    if miscal > 0.05:  # far from 0 the clip at 0 never binds: unbiased for Err_2^2 (3 s.e.)
        se = np.std(deb[2]) / math.sqrt(reps)
        assert abs(np.mean(deb[2]) - exact[2] ** 2) < 3 * se


def test_debiased_inf_and_validation():
    rng = np.random.default_rng(4)
    probs, labels, _ = _discrete_population(rng, 2000, 0.1)
    d = M.err_p_debiased(probs, labels, 10, math.inf)
    assert 0.0 <= d <= M.err_p(probs, labels, 10, math.inf)
    with pytest.raises(InputError, match="at least 2 samples"):
        M.err_p_debiased(probs[:1], labels[:1], 10, 2)


# ----------------------------------------------------------------------------- ECE family etc.


@settings(max_examples=50, deadline=None)
@given(samples(max_n=30), st.integers(1, 20))
def test_width_eces_brier_nll_accuracy_match_reference(data, n_bins):
    probs, labels, _ = data
    assert close(
        M.top_label_ece(probs, labels, n_bins=n_bins), ref.top_label_ece(probs, labels, n_bins)
    )
    assert close(
        M.classwise_ece(probs, labels, n_bins=n_bins), ref.classwise_ece(probs, labels, n_bins)
    )
    assert close(M.brier(probs, labels), ref.brier(probs, labels))
    assert close(M.nll(probs, labels), ref.nll(probs, labels))
    assert M.accuracy(probs, labels) == ref.accuracy(probs, labels)


@pytest.mark.parametrize("n,n_bins", [(101, 7), (60, 4), (240, 13)])
def test_mass_binned_eces_match_rank_reference(n, n_bins):
    rng = np.random.default_rng(n)
    probs, labels = dirichlet_sample(rng, n, 4, alpha=0.7)
    if math.gcd(n - 1, n_bins) != 1:
        pytest.skip("reference needs gcd(n - 1, n_bins) = 1")
    got = M.top_label_ece(probs, labels, n_bins=n_bins, binning="mass")
    assert close(got, ref.top_label_ece(probs, labels, n_bins, "mass"))
    got_cw = M.classwise_ece(probs, labels, n_bins=n_bins, binning="mass")
    assert close(got_cw, ref.classwise_ece(probs, labels, n_bins, "mass"))
    # equal mass: bin sizes differ by at most one
    conf = probs.max(axis=1)
    idx = M._bin_index(conf, n_bins, "mass")
    sizes = np.bincount(idx, minlength=n_bins)
    assert sizes.max() - sizes.min() <= 1


def test_ece_binning_matters_when_gaps_change_sign():
    # confidence 0.7 always right (under-confident), 0.95 always wrong (over-confident)
    probs = np.array([[0.7, 0.3]] * 50 + [[0.95, 0.05]] * 50)
    labels = np.array([0] * 50 + [1] * 50)
    # one bin holds everything: |mean(hit) - mean(conf)| = |0.5 - 0.825|
    assert M.top_label_ece(probs, labels, n_bins=1) == pytest.approx(0.325)
    # separate bins: 0.5 * 0.3 + 0.5 * 0.95
    assert M.top_label_ece(probs, labels, n_bins=10) == pytest.approx(0.625)
    assert M.top_label_ece(probs, labels, n_bins=2, binning="mass") == pytest.approx(0.625)


def test_perfect_predictor_scores():
    labels = np.array([0, 2, 1, 2])
    probs = np.eye(3)[labels]
    assert M.top_label_ece(probs, labels) == 0.0
    assert M.classwise_ece(probs, labels) == 0.0
    assert M.brier(probs, labels) == 0.0
    assert M.nll(probs, labels) == 0.0
    assert M.accuracy(probs, labels) == 1.0
    assert M.err_p(probs, labels, 5, 2) == 0.0
    # confidently wrong: Brier 2, NLL = -log(clip)
    wrong = np.eye(3)[(labels + 1) % 3]
    assert M.brier(wrong, labels) == pytest.approx(2.0)
    assert M.nll(wrong, labels, clip=1e-6) == pytest.approx(-math.log(1e-6))


def test_summary_has_all_metrics():
    rng = np.random.default_rng(5)
    probs, labels = dirichlet_sample(rng, 500, 3)
    s = M.summary(probs, labels, 10, 2)
    assert s["n"] == 500
    assert s["err_p"] == pytest.approx(M.err_p(probs, labels, 10, 2))
    assert s["accuracy"] == pytest.approx(M.accuracy(probs, labels))
    json.dumps(s)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "probs,labels,match",
    [
        ([[0.5, 0.5], [np.nan, 1.0]], [0, 1], r"probs: row 1: .*NaN"),
        ([[0.5, 0.5], [1.2, -0.2]], [0, 1], r"probs: row 1: .*negative"),
        ([[0.5, 0.5], [0.5, 0.4]], [0, 1], r"row 1: probabilities sum to 0\.9"),
        ([[0.5, 0.5], [0.5, 0.5]], [0, 2], r"labels: row 1: label 2 outside \[0, 2\)"),
        ([[0.5, 0.5], [0.5, 0.5]], [0.0, 0.5], r"labels: row 1: label 0\.5 is not an integer"),
        ([[0.5, 0.5], [0.5, 0.5]], [0], r"1 labels for 2 probability rows"),
        ([0.5, 0.5], [0], r"expected a 2-D array"),
        (np.zeros((0, 3)), [], r"empty input"),
    ],
)
def test_invalid_inputs_raise_with_location(probs, labels, match):
    with pytest.raises(InputError, match=match):
        M.err_p(probs, labels, 4, 2)


def test_invalid_parameters():
    probs, labels = np.full((2, 2), 0.5), [0, 1]
    for bad_p in (0.5, float("nan"), "x"):
        with pytest.raises(InputError, match="p must"):
            M.err_p(probs, labels, 4, bad_p)
    for bad_lam in (0, 2.5, True):
        with pytest.raises(InputError, match="lambda"):
            M.err_p(probs, labels, bad_lam, 2)
    with pytest.raises(InputError, match="binning"):
        M.top_label_ece(probs, labels, binning="quantile")
    with pytest.raises(InputError, match="n_bins"):
        M.classwise_ece(probs, labels, n_bins=0)


# ----------------------------------------------------------------------------- known truth


def _truth_sample(n_proto: int = 2000, n_free: int = 1000, k: int = 4, seed: int = 0):
    """Predictions ``f = softmax(z)`` (most rows on 5 prototype logit vectors, so bins hold many
    rows) and their true label law ``q = softmax(z / 2)``."""
    rng = np.random.default_rng(seed)
    protos = rng.normal(0.0, 2.0, (5, k))
    z = np.concatenate([protos[rng.integers(5, size=n_proto)], rng.normal(0.0, 2.0, (n_free, k))])
    return softmax_rows(z), softmax_rows(0.5 * z)


def test_err_p_true_is_the_binned_error_against_the_true_conditionals():
    f, q = _truth_sample()
    assert M.err_p_true(q, q, 10, math.inf) == 0.0
    err: dict[tuple, np.ndarray] = {}  # brute force over bins and classes
    for i, key in enumerate(map(tuple, bin_counts(f, 10))):
        err[key] = err.get(key, 0.0) + (f[i] - q[i])
    e = np.abs(np.array(list(err.values()))) / len(f)
    assert M.err_p_true(f, q, 10, math.inf) == pytest.approx(e.max(), rel=1e-12)
    assert M.err_p_true(f, q, 10, 2.0) == pytest.approx(np.sqrt((e**2).sum()), rel=1e-12)
    assert M.err_p_true(f, q, 10, 1) == pytest.approx(e.sum(), rel=1e-12)
    assert M.err_p_true(f, q, 10, math.inf) > 0.02  # f = softmax(z) is overconfident for q


def test_err_p_true_is_what_err_p_converges_to_with_labels_drawn_from_q():
    f, q = _truth_sample(n_proto=200_000, n_free=0)  # 5 bins: the plug-in noise is small
    rng = np.random.default_rng(1)
    y = (q.cumsum(axis=1) > rng.random((len(q), 1))).argmax(axis=1)
    truth = M.err_p_true(f, q, 10, 2.0)
    assert M.err_p(f, y, 10, 2.0) == pytest.approx(truth, rel=0.05)
    assert M.brier(f, y) == pytest.approx(M.brier_true(f, q), rel=0.01)


def test_brier_true_is_the_expected_brier_score_under_q():
    f, q = _truth_sample()
    per_label = ((f[:, None, :] - np.eye(f.shape[1])[None]) ** 2).sum(axis=2)  # (n, k)
    assert M.brier_true(f, q) == pytest.approx(float((per_label * q).sum(axis=1).mean()),
                                               rel=1e-12)
    assert M.brier_true(q, q) < M.brier_true(f, q)  # the truth minimises it


@pytest.mark.parametrize("call,match", [
    (lambda f, q: M.err_p_true(f, q[:, :2], 10, 2.0), r"err_p_true: h \(3000, 4\) and q"),
    (lambda f, q: M.err_p_true(f[:0], q[:0], 10, 2.0), "non-empty"),
    (lambda f, q: M.err_p_true(f, np.full_like(q, np.nan), 10, 2.0), "finite"),
    (lambda f, q: M.err_p_true(f, q, 0, 2.0), "lambda"),
    (lambda f, q: M.err_p_true(f, q, 10, 0.5), "p must be"),
    (lambda f, q: M.brier_true(f, q.T), "brier_true"),
])
def test_truth_metrics_reject_bad_input(call, match):
    f, q = _truth_sample()
    with pytest.raises(InputError, match=match):
        call(f, q)


# ----------------------------------------------------------------------------- debiased ECE


def _calibrated_sample(rng, n: int, k: int, temp: float = 1.0):
    """Rows with labels drawn from them (calibrated by construction), reported at temperature
    ``temp`` (1: calibrated)."""
    z = rng.normal(0.0, 2.0, size=(n, k))
    x = softmax_rows(z)
    y = (x.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    return softmax_rows(np.log(x) / temp), y


def test_bin_sums_match_the_plug_in_eces():
    rng = np.random.default_rng(0)
    x, y = _calibrated_sample(rng, 3000, 6, temp=0.6)
    c, s, _ = M.top_label_bin_sums(x, y)
    assert c.sum() == 3000 and np.abs(s).sum() / 3000 == pytest.approx(M.top_label_ece(x, y))
    cc, cs, cq = M.classwise_bin_sums(x, y)
    assert cc.shape == (6, 15) and (cc.sum(axis=1) == 3000).all()
    assert np.abs(cs).sum() / 3000 / 6 == pytest.approx(M.classwise_ece(x, y))
    # sums of squares, by a direct loop over one class
    j = 2
    b = np.searchsorted(np.linspace(0, 1, 16)[1:-1], x[:, j], side="left")
    r = (y == j) - x[:, j]
    assert cq[j] == pytest.approx(np.bincount(b, weights=r * r, minlength=15))


def test_debiased_squared_error_is_unbiased_where_the_plug_in_is_not():
    """On calibrated data the true squared top-label ECE is 0: the plug-in's mean over draws
    is clearly positive, the debiased estimate's is 0 within its standard error; the reported
    standard error is of the order of the spread over draws, and not below it."""
    rng = np.random.default_rng(1)
    plug, deb, ses = [], [], []
    for _ in range(300):
        x, y = _calibrated_sample(rng, 400, 5)
        c, s, q = M.top_label_bin_sums(x, y)
        n = int(c.sum())
        ok = c > 0
        plug.append(float(np.sum(s[ok] ** 2 / c[ok]) / n))
        e = M.binned_sq_error(c, s, q, n)
        deb.append(e.value)
        ses.append(e.stderr)
    deb = np.asarray(deb)
    assert np.mean(plug) > 5 * deb.std() / np.sqrt(deb.size)
    assert abs(deb.mean()) < 3 * deb.std() / np.sqrt(deb.size)
    # conservative, not smaller: at 27 samples per bin the plug-in sigma^4 and mu^2 >= 0 are
    # biased up (about 1.4 times the spread here; see binned_sq_error)
    assert 1.0 < np.mean(ses) / deb.std() < 1.6


def test_debiased_ece_moves_with_miscalibration():
    rng = np.random.default_rng(2)
    x, y = _calibrated_sample(rng, 20_000, 10)
    xo, yo = _calibrated_sample(rng, 20_000, 10, temp=0.5)  # over-confident
    good, bad = M.top_label_ece_debiased(x, y), M.top_label_ece_debiased(xo, yo)
    assert good.value < 0.02 and bad.value > 0.05 and bad.value > good.value + 5 * bad.stderr
    cg, cb = M.classwise_ece_debiased(x, y), M.classwise_ece_debiased(xo, yo)
    assert cb.value > cg.value + 5 * cb.stderr
    # the l2 value of a squared estimate: delta method away from 0, noise scale near it
    assert M.l2_of_squared(M.Estimate(0.04, 0.004)) == pytest.approx(
        M.Estimate(0.2, 0.01))
    assert M.l2_of_squared(M.Estimate(-1e-4, 1e-4)) == M.Estimate(0.0, 0.01)
    assert M.binned_sq_error(np.ones(3), np.ones(3), np.ones(3), 3) == M.Estimate(
        0.0, 0.0)  # bins seen once count 0
