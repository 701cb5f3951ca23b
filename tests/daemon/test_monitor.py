"""daemon.monitor: windowed sums agree with lpcal.metrics; windows; margin; snapshots."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import orjson
import pytest

from daemon.monitor import CellSums, WindowMonitor, window_stats
from lpcal.errors import InputError
from lpcal.metrics import accuracy, brier, err_p, top_label_ece


def data(n, k=4, seed=0, conc=0.5):
    rng = np.random.default_rng(seed)
    x = rng.dirichlet(np.full(k, conc), size=n)
    # miscalibrated labels: drawn from a sharpened version of x
    q = x**2 / (x**2).sum(axis=1, keepdims=True)
    y = (q.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    return x, y


@pytest.mark.parametrize("p", [math.inf, 2.0, 1.5])
def test_full_window_equals_batch_metrics(p):
    x, y = data(3000, seed=1)
    lam = 10
    m = WindowMonitor(4, lam, p, window_samples=10_000)
    for a in range(0, 3000, 250):
        m.update(x[a:a + 250], y[a:a + 250], calibrated=x[a:a + 250])
    raw = m.evaluate(z=3.0)["raw"]
    assert raw.n == 3000
    assert math.isclose(raw.err_p, err_p(x, y, lam, p), rel_tol=1e-9)
    assert math.isclose(raw.ece, top_label_ece(x, y), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(raw.brier, brier(x, y), rel_tol=1e-9)
    assert math.isclose(raw.accuracy, accuracy(x, y), rel_tol=1e-12)
    assert 0.0 <= raw.lower <= raw.err_p and math.isclose(raw.margin, raw.err_p - raw.lower)
    assert raw.stderr > 0
    cal = m.evaluate()["calibrated"]  # same rows fed as "calibrated", which also has the
    assert cal == dataclasses.replace(  # classwise ECE (kept for the calibrated predictor only)
        raw, ece_classwise=cal.ece_classwise, ece_classwise_se=cal.ece_classwise_se)
    assert cal.ece_classwise > 0 and raw.ece_classwise is None


def test_count_window_keeps_the_last_samples():
    x, y = data(5000, seed=2)
    m = WindowMonitor(4, 10, math.inf, window_samples=1000, n_buckets=10)
    for a in range(0, 5000, 333):
        m.update(x[a:a + 333], y[a:a + 333])
    n = m.window_size()
    assert 900 < n <= 1000  # the last N, to a granularity of N / n_buckets
    s = m.evaluate()["raw"]
    assert math.isclose(s.err_p, err_p(x[-n:], y[-n:], 10, math.inf), rel_tol=1e-9)
    assert math.isclose(s.brier, brier(x[-n:], y[-n:]), rel_tol=1e-9)
    assert m.total_samples == 5000


def test_time_window_expires_old_buckets():
    x, y = data(400, seed=3)
    ts = np.repeat(np.arange(40.0), 10)  # 10 samples per second, t = 0..39
    m = WindowMonitor(4, 10, 2.0, window_samples=None, window_seconds=10.0, n_buckets=5)
    for a in range(0, 400, 50):
        m.update(x[a:a + 50], y[a:a + 50], ts[a:a + 50])
    # buckets of 2 s; the window holds buckets [30, 40): t = 30..39
    sel = ts >= 30
    s = m.evaluate()["raw"]
    assert s.n == sel.sum()
    assert math.isclose(s.err_p, err_p(x[sel], y[sel], 10, 2.0), rel_tol=1e-9)
    # late samples older than the window are ignored; advancing the clock drops buckets
    assert m.update(x[:5], y[:5], np.zeros(5)) == 0
    m.advance(45.0)
    assert m.evaluate()["raw"].n == (ts >= 36).sum()
    m.advance(1000.0)
    assert m.evaluate()["raw"] is None
    with pytest.raises(InputError):
        m.update(x[:5], y[:5])  # a time window needs ts


def test_evaluation_is_cached_until_the_window_changes():
    x, y = data(600, seed=8)
    m = WindowMonitor(4, 10, math.inf, window_samples=300, n_buckets=3)
    m.update(x[:200], y[:200])
    a = m.evaluate()
    assert m.evaluate()["raw"] is a["raw"]          # cached
    m.update(x[200:400], y[200:400])
    b = m.evaluate()
    assert b["raw"] is not a["raw"] and b["raw"].n != a["raw"].n
    assert m.evaluate(z=2.0)["raw"].lower >= b["raw"].lower  # cached per z
    m.reset("raw")
    assert m.evaluate()["raw"] is None


def test_one_predictor_evaluated_alone_is_what_both_give():
    """``evaluate_one`` gives what ``evaluate`` gives for that predictor (the same cached
    object, whichever is called first), without computing the other predictor's statistics;
    an unknown predictor is an error naming it."""
    x, y = data(900, seed=9)
    cal = np.clip(x * 0.9 + 0.025, 0.0, None)
    cal /= cal.sum(axis=1, keepdims=True)
    one, both = (WindowMonitor(4, 10, math.inf, window_samples=600, n_buckets=3)
                 for _ in range(2))
    for m in (one, both):
        for a in range(0, 900, 30):  # small updates: their rows wait to be summed
            m.update(x[a:a + 30], y[a:a + 30], calibrated=cal[a:a + 30])
    c = one.evaluate_one("calibrated")
    assert one._cache[3.0].keys() == {"calibrated"}  # the raw predictor left alone
    full = both.evaluate()
    assert c == full["calibrated"] and c.n > 0
    assert one.evaluate()["calibrated"] is c and one.evaluate()["raw"] == full["raw"]
    assert both.evaluate_one("raw") is full["raw"]
    with pytest.raises(InputError, match="unknown predictor 'shadow'"):
        one.evaluate_one("shadow")


def test_reset_calibrated_only():
    x, y = data(500, seed=4)
    m = WindowMonitor(4, 10, math.inf)
    m.update(x, y, calibrated=x)
    m.reset("calibrated")
    out = m.evaluate()
    assert out["calibrated"] is None and out["raw"].n == 500
    m.update(x[:10], y[:10], calibrated=x[:10])
    assert m.evaluate()["calibrated"].n == 10


def test_snapshot_round_trip_is_exact_and_continues_identically():
    x, y = data(2000, seed=5)
    ts = np.linspace(0, 100, 2000)
    for kw in ({"window_samples": 700}, {"window_samples": None, "window_seconds": 30.0}):
        a = WindowMonitor(4, 10, math.inf, **kw)
        a.update(x[:1200], y[:1200], ts[:1200], calibrated=x[:1200][:, ::-1])
        b = WindowMonitor.from_dict(orjson.loads(orjson.dumps(a.to_dict())))
        assert b == a
        for mon in (a, b):
            mon.update(x[1200:], y[1200:], ts[1200:], calibrated=x[1200:][:, ::-1])
        assert b == a
        assert a.evaluate() == b.evaluate()


def test_bad_snapshots_raise():
    m = WindowMonitor(4, 10, math.inf)
    x, y = data(100)
    m.update(x, y)
    d = m.to_dict()
    d["buckets"][0]["raw"]["s"]["b64"] = "AAAA"
    with pytest.raises(InputError, match="bytes"):
        WindowMonitor.from_dict(d)
    d = m.to_dict()
    d["buckets"][0]["n"] = 5
    with pytest.raises(InputError, match="n=5"):
        WindowMonitor.from_dict(d)
    d = m.to_dict()
    del d["k"]
    with pytest.raises(InputError, match="malformed"):
        WindowMonitor.from_dict(d)


def test_cell_sums_merge_is_additive():
    x, y = data(900, seed=6)
    whole = CellSums.from_batch(x, y, 10)
    parts = CellSums.merge_all([CellSums.from_batch(x[a:a + 300], y[a:a + 300], 10)
                                for a in range(0, 900, 300)], 4)
    assert np.array_equal(whole.hashes, parts.hashes)
    assert np.array_equal(whole.counts, parts.counts)
    assert np.allclose(whole.s, parts.s) and np.allclose(whole.q, parts.q)
    assert whole.n == parts.n == 900


def test_stderr_and_lower_bound_match_sampling_noise():
    """Over repeated samples, the delta-method stderr matches the spread of the plug-in, and the
    lower bound at z = 3 rarely exceeds the population value."""
    rng = np.random.default_rng(7)
    _k, lam, n = 3, 10, 4000
    centres = np.array([[0.62, 0.28, 0.10], [0.15, 0.15, 0.70], [0.34, 0.33, 0.33]])
    truth_q = np.array([[0.55, 0.33, 0.12], [0.15, 0.10, 0.75], [0.34, 0.33, 0.33]])
    w = np.array([0.5, 0.3, 0.2])
    # population Err_2: bins are the centres' level sets; Err(v, j) = w_v |f_vj - q_vj|
    true_err = float(np.sqrt(np.sum((w[:, None] * np.abs(centres - truth_q)) ** 2)))
    vals, ses, lowers = [], [], []
    for _ in range(150):
        c = rng.choice(3, size=n, p=w)
        x = centres[c]
        y = (truth_q[c].cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
        s = window_stats(CellSums.from_batch(x, y, lam), 2.0, 3.0)
        vals.append(s.err_p)
        ses.append(s.stderr)
        lowers.append(s.lower)
    assert abs(np.mean(vals) - true_err) < 0.15 * true_err
    assert 0.7 < np.std(vals) / np.mean(ses) < 1.4
    assert np.mean(np.array(lowers) > true_err) < 0.03


def test_input_validation():
    with pytest.raises(InputError):
        WindowMonitor(1, 10, 2.0)
    with pytest.raises(InputError):
        WindowMonitor(3, 10, 0.5)
    with pytest.raises(InputError):
        WindowMonitor(3, 10, 2.0, window_samples=None)
    m = WindowMonitor(3, 10, 2.0)
    with pytest.raises(InputError):
        m.update(np.ones((2, 4)) / 4, np.zeros(2, dtype=int))
    with pytest.raises(InputError):
        m.reset("bogus")


def test_debiased_statistics_agree_with_lpcal_metrics():
    """The window's debiased top-label and classwise ECE (calibrated predictor) are the library
    estimators on the same samples, whatever the batching; the classwise sums are kept for the
    calibrated predictor only."""
    from lpcal.metrics import classwise_ece_debiased, top_label_ece_debiased

    x, y = data(3000, k=5, seed=11)
    m = WindowMonitor(5, 10, math.inf, window_samples=3000)
    for a in range(0, 3000, 700):
        m.update(x[a:a + 700], y[a:a + 700], calibrated=x[a:a + 700])
    w = m.evaluate()["calibrated"]
    top, cw = top_label_ece_debiased(x, y), classwise_ece_debiased(x, y)
    assert w.ece_debiased == pytest.approx(top.value, rel=1e-9)
    assert w.ece_debiased_se == pytest.approx(top.stderr, rel=1e-9)
    assert w.ece_classwise == pytest.approx(cw.value, rel=1e-9)
    assert w.ece_debiased > 0.05  # the sharpened labels: miscalibrated
    raw = m.evaluate()["raw"]
    assert raw.ece_debiased == pytest.approx(top.value, rel=1e-9)
    assert raw.ece_classwise is None and "ece_classwise" not in raw.statistics()
    assert set(w.statistics()) == {"confidence_gap", "ece_top", "ece_classwise",
                                   "brier_reliability", "err_p"}
    assert w.confidence_gap == pytest.approx(float(np.mean(
        (x.argmax(axis=1) == y) - x.max(axis=1))), rel=1e-9)


def test_snapshots_written_before_the_ece_sums_restore():
    """Buckets without the ECE and classwise sums (older checkpoints) load; the debiased
    statistics then cover the samples added since."""
    x, y = data(1200, seed=12)
    a = WindowMonitor(4, 10, math.inf, window_samples=1000)
    a.update(x[:600], y[:600], calibrated=x[:600])
    d = orjson.loads(orjson.dumps(a.to_dict()))
    del d["change"]
    for bd in d["buckets"]:
        del bd["classwise"]
        for name in ("raw", "calibrated"):
            for key in ("ece_n", "ece_q"):
                del bd[name][key]
    b = WindowMonitor.from_dict(d)
    assert b.change is None and b.evaluate()["calibrated"].ece_debiased == 0.0
    b.update(x[600:], y[600:], calibrated=x[600:])
    assert b.evaluate()["calibrated"].ece_debiased > 0.0
    d = a.to_dict()
    d["buckets"][0]["classwise"]["calibrated"]["n"]["b64"] = "AAAA"
    with pytest.raises(InputError, match="bytes"):
        WindowMonitor.from_dict(d)


# --------------------------------------------------------------------------- small updates


def _change(block=200):
    from daemon.drift import ChangeDetector

    return ChangeDetector(false_alarm_rate=0.01, baseline_samples=2 * block, min_shift=0.02,
                          block_samples=block)


def _stats_close(a, b):
    for name in ("raw", "calibrated"):
        sa, sb = a[name], b[name]
        assert sa.n == sb.n
        assert sa.n_bins == sb.n_bins
        for f in ("err_p", "ece", "brier", "accuracy", "ece_debiased", "ece_classwise",
                  "brier_reliability", "confidence_gap"):
            va, vb = getattr(sa, f), getattr(sb, f)
            assert (va is None) == (vb is None), f
            if va is not None:
                assert va == pytest.approx(vb, rel=1e-9, abs=1e-12), f


@pytest.mark.parametrize("window", [{"window_samples": 3000}, {"window_seconds": 40.0}])
def test_small_updates_give_the_sums_of_one_update(window):
    """Updates of 1..5 samples (buffered as rows, summed later) give the window, the change
    test's blocks and the snapshot counts of the same samples offered at once."""
    from daemon.monitor import SMALL_UPDATE

    n = 4000
    x, y = data(n, k=5, seed=3)
    cal = np.sqrt(x) / np.sqrt(x).sum(axis=1, keepdims=True)
    ts = np.linspace(0, 100, n)
    whole = WindowMonitor(5, 10, 2.0, change=_change(), **window)
    pieces = WindowMonitor(5, 10, 2.0, change=_change(), **window)
    whole.update(x, y, ts, calibrated=cal)
    a, rng = 0, np.random.default_rng(1)
    while a < n:
        b = min(n, a + int(rng.integers(1, 6)))
        assert b - a < SMALL_UPDATE
        pieces.update(x[a:b], y[a:b], ts[a:b], calibrated=cal[a:b])
        a = b
    # the change test saw the same completed blocks, as they completed
    assert pieces.change.blocks == whole.change.blocks > 0
    for name in whole.change.cusum:
        assert pieces.change.cusum[name] == pytest.approx(whole.change.cusum[name], abs=1e-9)
    _stats_close(pieces.evaluate(), whole.evaluate())
    dw, dp = whole.to_dict(), pieces.to_dict()
    assert [bk["n"] for bk in dp["buckets"]] == [bk["n"] for bk in dw["buckets"]]
    assert dp["change"]["block_n"] == dw["change"]["block_n"]
    if "window_samples" in window:  # a time window counts what was in it on arrival
        assert pieces.total_samples == whole.total_samples


def test_waiting_rows_count_in_the_bytes_and_are_summed_when_read():
    x, y = data(300, k=6, seed=4)
    mon = WindowMonitor(6, 10, math.inf, window_samples=10_000)
    empty = mon.nbytes
    for i in range(100):  # 100 rows wait: below FLUSH_ROWS
        mon.update(x[i:i + 1], y[i:i + 1], calibrated=x[i:i + 1])
    waiting = mon.nbytes - empty
    assert waiting >= 100 * 2 * (8 * 6 + 8)  # raw and calibrated rows and labels
    from daemon.monitor import sample_bytes
    assert waiting <= 100 * sample_bytes(6)
    assert mon.window_size() == 100  # reading sums the rows
    assert mon.sums("calibrated").n == 100 and mon.classwise().total == 100


def test_snapshot_with_waiting_rows_round_trips_and_continues_identically():
    x, y = data(700, k=4, seed=5)
    a = WindowMonitor(4, 8, 2.0, window_samples=400, change=_change(100))
    for i in range(0, 333, 3):
        a.update(x[i:i + 3], y[i:i + 3], calibrated=x[i:i + 3])
    b = WindowMonitor.from_dict(orjson.loads(orjson.dumps(a.to_dict())))
    assert b == a
    for i in range(333, 700, 2):
        for m in (a, b):
            m.update(x[i:i + 2], y[i:i + 2], calibrated=x[i:i + 2])
    assert b == a
    assert a.evaluate() == b.evaluate()


def test_reset_drops_waiting_calibrated_rows():
    x, y = data(50, k=4, seed=6)
    mon = WindowMonitor(4, 8, 2.0, window_samples=1000, change=_change(100))
    for i in range(50):
        mon.update(x[i:i + 1], y[i:i + 1], calibrated=x[i:i + 1])
    mon.reset("calibrated")
    assert mon.evaluate()["calibrated"] is None and mon.evaluate()["raw"].n == 50
    assert mon.to_dict()["change"]["block_n"] == 0


@pytest.mark.parametrize("window", [{"window_samples": 600}, {"window_seconds": 30.0}])
def test_cached_merge_of_older_buckets_equals_merging_every_bucket(window):
    """sums() caches the merge of the buckets before the newest; after updates (small and
    large, late samples in a time window), resets, trims and expiry it equals merging every
    bucket."""
    x, y = data(6000, k=4, seed=7)
    rng = np.random.default_rng(2)
    mon = WindowMonitor(4, 8, 2.0, n_buckets=6, change=_change(50), **window)
    a, t = 0, 0.0
    for step in range(300):
        b = min(len(y), a + int(rng.choice([1, 3, 70, 150])))
        ts = t + rng.uniform(-8, 1, size=b - a)  # some late samples
        t += 0.3
        mon.update(x[a:b], y[a:b], ts, calibrated=x[a:b])
        a = b % 5000
        if step % 37 == 0:
            mon.reset("calibrated")
        if step % 53 == 0:
            mon.set_max_bytes(int(rng.integers(20_000, 200_000)))
        for name in ("raw", "calibrated"):
            got = mon.sums(name)
            want = CellSums.merge_all([bk.sums(name, 4) for bk in mon.buckets.values()], 4)
            assert got.n == want.n
            assert np.array_equal(got.hashes, want.hashes)
            assert np.array_equal(got.counts, want.counts)
            assert np.allclose(got.s, want.s) and np.allclose(got.q, want.q)


def _monitors_fed(seed):
    """Monitors of several k, lambda, window kinds and change tests, fed small updates (some
    with the raw rows' bin hashes, some with calibrated rows): their rows wait unsummed."""
    from lpcal.levels import bin_rows

    rng = np.random.default_rng(seed)
    specs = [(4, 10, {"window_samples": 300}, True), (4, 10, {"window_samples": 5000}, False),
             (4, 7, {"window_seconds": 20.0}, True), (6, 10, {"window_samples": 1000}, True),
             (4, 10, {"window_samples": 2000}, True)]
    mons = []
    for i, (k, lam, window, change) in enumerate(specs * 3):
        mon = WindowMonitor(k, lam, 2.0 if i % 2 else math.inf,
                            change=_change(50) if change else None, **window)
        n = int(rng.integers(5, 400))
        x, y = data(n, k=k, seed=seed * 100 + i)
        cal = np.sqrt(x) / np.sqrt(x).sum(axis=1, keepdims=True)
        ts = np.sort(rng.uniform(0, 60, n))
        a = 0
        while a < n:
            b = min(n, a + int(rng.integers(1, 120)))
            hashes = bin_rows(x[a:b], lam)[1:] if i % 3 == 0 else None
            mon.update(x[a:b], y[a:b], ts[a:b], calibrated=cal[a:b] if i % 4 else None,
                       hashes=hashes)
            a = b
        mons.append(mon)
    return mons


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_flush_waiting_gives_each_monitor_its_own_sums_to_the_bit(seed):
    """The batched flush of many monitors' waiting rows (one pass per k and lambda) leaves every
    monitor exactly as flushing it alone does: equal snapshots (sums, counts, change test),
    equal evaluations, and equal states after more updates."""
    from daemon.monitor import flush_waiting

    alone, batched = _monitors_fed(seed), _monitors_fed(seed)
    assert any(bk.waiting["raw"].pieces for m in batched for bk in m.buckets.values())
    assert any(m._block_rows.pieces for m in batched)
    flush_waiting(batched)
    assert not any(bk.waiting[name].pieces for m in batched for bk in m.buckets.values()
                   for name in ("raw", "calibrated"))
    for a, b in zip(alone, batched):
        assert orjson.dumps(a.to_dict()) == orjson.dumps(b.to_dict())  # flushes a alone
        assert a.nbytes == b.nbytes
        assert a.evaluate() == b.evaluate()
    x, y = data(90, k=4, seed=seed)
    for a, b in zip(alone, batched):
        if a.k == 4:
            for m in (a, b):
                m.update(x, y, np.full(90, 59.0), calibrated=x)
            flush_waiting([b])
            assert a == b and a.evaluate() == b.evaluate()


def test_flush_waiting_of_nothing_and_of_summed_monitors_changes_nothing():
    from daemon.monitor import flush_waiting

    x, y = data(700, k=4, seed=9)
    mon = WindowMonitor(4, 10, math.inf, window_samples=1000)
    mon.update(x, y, calibrated=x)  # large: summed at once
    before = orjson.dumps(mon.to_dict())
    flush_waiting([mon, WindowMonitor(4, 10, math.inf, window_samples=10)])
    flush_waiting([])
    assert orjson.dumps(mon.to_dict()) == before
