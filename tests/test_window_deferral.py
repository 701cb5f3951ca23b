"""Deferred rows: the window and the online calibrator sum small batches at the next decision
point, in one pass, and end in the very state of summing every batch at once (to the byte).

The reference is the path without deferral: the window fed with ``defer=False``, and the
calibrator whose window never defers (its :meth:`~lpcal.window.SlidingWindow.defer` declines
every row, so every batch is summed when it arrives, and every decision reads sums that hold
every row before it), fed in batches that end at decision points."""

import json

import numpy as np
import pytest

from lpcal.challenger import LossGrid
from lpcal.online import OnlineCalibrator, OnlineConfig, index_uniforms, run_fit
from lpcal.pools import PoolLayout
from lpcal.warmup import WarmupSums
from lpcal.window import SlidingWindow
from tests.test_warmup import tempered


def _cuts(rng, n, largest):
    """Random batch ends covering ``0..n``: sizes 1 to ``largest``."""
    out, a = [], 0
    while a < n:
        a = min(n, a + int(rng.integers(1, largest + 1)))
        out.append(a)
    return out


def _plain(v):
    """``v`` without the maps' wall-clock stamps (``created_at`` and the digests over them);
    maps nested as JSON strings are parsed."""
    if isinstance(v, str) and v.startswith("{"):
        return _plain(json.loads(v))
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if k != "created_at"
                and not (isinstance(x, str) and x.startswith("sha256:"))}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _dump(state) -> str:
    """The state as JSON, without wall-clock stamps."""
    return json.dumps(_plain(state), sort_keys=True)


def test_deferred_window_equals_the_window_fed_at_once():
    """Deferred batches, flushed by a later call without ``defer``, by a read, by a new
    temperature and by a reset, give the same buckets, sums, kept samples and warm-up sums."""
    rng = np.random.default_rng(0)
    n = 4000
    f, y = tempered(n)
    u = index_uniforms(0, n)
    lay = PoolLayout(10, 10, 2, "shared", {"mu": 5, "PE0": 5, "PE1": 5}, holdout=6)
    ref, got = (SlidingWindow(lay, bucket_size=500, n_buckets=6, holdout_buckets=3,
                              cert_share=0.5, cert_buckets=4) for _ in range(2))
    warm_ref, warm_got = WarmupSums(), WarmupSums()
    a = 0
    for i, b in enumerate(_cuts(rng, n, 60)):
        if a < 1500:  # the warm-up takes the fit share, then a pool temperature is set
            ref.add(u[a:b], f[a:b], y[a:b], warmup=warm_ref)
            got.add(u[a:b], f[a:b], y[a:b], warmup=warm_got, defer=i % 5 != 0)
        else:
            if ref.temperature is None:
                ref.set_temperature(1.7)
                got.set_temperature(1.7)
            ref.add(u[a:b], f[a:b], y[a:b])
            got.add(u[a:b], f[a:b], y[a:b], defer=True)
        assert got.n == ref.n
        if i % 17 == 3:  # a read flushes
            assert got.grid() == ref.grid() and got.held() == ref.held()
        if i % 17 == 9 and b < n - 600:  # so does the certification count (deferred rows hold some)
            deferred = bool(got._deferred)
            assert got.n_cert == ref.n_cert > 0
            assert not (deferred and got._deferred)
        if i == 40:  # a drift mid-bucket drops the open bucket, deferred rows included
            ref.reset_after(ref.open.index - 1)
            got.reset_after(got.open.index - 1)
        a = b
    assert got._deferred  # the last rows are still deferred here
    assert got.nbytes > sum(bk.nbytes for bk in got.buckets)
    assert _dump(got.to_dict()) == _dump(ref.to_dict())
    assert got == ref and warm_got == warm_ref
    assert got.nbytes == ref.nbytes


def test_rows_never_deferred_past_the_open_bucket():
    f, y = tempered(300)
    u = index_uniforms(0, 300)
    lay = PoolLayout(10, 10, 1, "shared", {"mu": 7, "PE0": 7}, holdout=6)
    w = SlidingWindow(lay, bucket_size=100, n_buckets=4)
    w.add(u[:90], f[:90], y[:90], defer=True)
    assert w.n == 90 and w.open.n == 0
    w.add(u[90:150], f[90:150], y[90:150], defer=True)  # crosses the bucket: summed at once
    assert [b.n for b in w.buckets] == [100, 50] and not w._deferred


def _never_defer(cal: OnlineCalibrator) -> OnlineCalibrator:
    """``cal`` with a window that declines to defer any row (the reference path)."""
    cal.window.defer = lambda u, x, y, warmup: False
    return cal


def _run(k, cfg, f, y, cuts, *, checkpoints=(), drift_at=None, defer=True):
    """Feed ``f, y`` in the batches ending at ``cuts``: run fits at once, write a checkpoint
    (and go on from its restore) at the cut positions in ``checkpoints``, notify a drift
    after the batch ending at ``drift_at``; ``defer=False``: the window never defers rows.
    Returns the trace and the final state."""
    own = (lambda c: c) if defer else _never_defer
    cal = own(OnlineCalibrator(k, cfg, fit=run_fit))
    events, a = [], 0
    for b in cuts:
        events += [(e.n, e.kind, e.version, e.temperature, e.detail)
                   for e in cal.update(f[a:b], y[a:b])]
        if b in checkpoints:
            cal = own(OnlineCalibrator.from_dict(json.loads(json.dumps(cal.to_dict())),
                                                 fit=run_fit))
        if b == drift_at:
            events.append(cal.notify_drift().kind)
        a = b
    return events, cal


@pytest.mark.parametrize("k,n,largest", [(10, 14000, 40), (10, 9000, 700), (100, 5000, 30)])
def test_calibrator_state_is_the_same_whatever_the_batching(k, n, largest):
    """Small random batches (deferred, also across decision points once the warm-up is over)
    against the window that never defers: the same events and the same checkpoint, byte for
    byte, through the warm-up, Algorithm 2's fits, certificates, checkpoints mid-step and a
    drift mid-step."""
    rng = np.random.default_rng(k + n)
    f, y = tempered(n, k=k, t=2.0)
    cfg = OnlineConfig(pools_from=2000, step=250, bucket_size=500, fit_delay=250)
    drift = n // 2 + 123
    ref_cuts = sorted({*range(250, n, 250), drift, n})
    cuts = sorted({*_cuts(rng, n, largest), drift})
    marks = tuple(int(c) for c in rng.choice(cuts[:-1], 5, replace=False))
    want, ref = _run(k, cfg, f, y, ref_cuts, drift_at=drift, defer=False)
    got, cal = _run(k, cfg, f, y, cuts, checkpoints=marks, drift_at=drift)
    assert got == want
    assert any(e[1] == "published" for e in want if isinstance(e, tuple))
    assert _dump(cal.to_dict()) == _dump(ref.to_dict())
    assert cal.nbytes == ref.nbytes


def test_online_calls_benchmark_quick_table():
    from tests.bench import bench_online_calls

    (tab,) = bench_online_calls.run(quick=True)
    rows = tab.to_markdown().splitlines()
    body = [r for r in rows if r.startswith("| 10 |")]
    assert len(body) == 6                        # two phases, three batch sizes
    assert all(r.rstrip(" |").endswith("x") for r in body)


def test_held_out_loss_grid_summed_when_read_equals_summed_at_once():
    """Kept held-out samples enter a bucket's loss grid when it is read: the same sums as
    reading it after every batch, through a new pool temperature mid-bucket and buckets
    that drop their held-out samples (holdout_buckets) before their grid was read."""
    rng = np.random.default_rng(7)
    n = 6000
    f, y = tempered(n)
    u = index_uniforms(0, n)
    lay = PoolLayout(10, 10, 1, "shared", {"mu": 7, "PE0": 7}, holdout=6)
    lazy, eager = (SlidingWindow(lay, bucket_size=400, n_buckets=8, holdout_buckets=2)
                   for _ in range(2))
    for w in (lazy, eager):
        w.set_temperature(1.5)
    a = 0
    for i, b in enumerate(_cuts(rng, n, 150)):
        for w in (lazy, eager):
            if i == 20:
                w.set_temperature(2.5)
            w.add(u[a:b], f[a:b], y[a:b])
        for bk in eager.buckets:
            bk.held  # noqa: B018 -- summed after every batch
        assert any(bk._held_lazy for bk in lazy.buckets)
        a = b
    assert _dump(lazy.to_dict()) == _dump(eager.to_dict())
    hold = lay.route_uniforms(u) >= len(lay.names)
    kept = np.zeros(n, bool)
    kept[n - sum(bk.n for bk in lazy.buckets):] = True
    assert lazy.held() == LossGrid().update(f[hold & kept], y[hold & kept])


def test_defer_keeps_checked_rows_only_when_they_fit_the_open_bucket():
    """:meth:`SlidingWindow.defer` (the calibrator's path for rows it checked already): rows
    that fit in the open bucket with the same warm-up sums are kept; others are refused and
    nothing changes, and the window then ends as one fed with ``add``."""
    f, y = tempered(400)
    u = index_uniforms(0, 400)
    lay = PoolLayout(10, 10, 1, "shared", {"mu": 7, "PE0": 7}, holdout=6)
    got, ref = (SlidingWindow(lay, bucket_size=100, n_buckets=4) for _ in range(2))
    warm = WarmupSums()
    assert got.defer(u[:60], f[:60], y[:60], None)
    assert not got.defer(u[60:70], f[60:70], y[60:70], warm)  # other warm-up sums
    assert not got.defer(u[60:101], f[60:101], y[60:101], None)  # past the open bucket
    assert got.n == 60 and got.open.n == 0 and got._deferred_n == 60
    got.add(u[60:101], f[60:101], y[60:101])
    ref.add(u[:101], f[:101], y[:101])
    assert got.defer(u[101:150], f[101:150], y[101:150], None)
    got.add(u[150:400], f[150:400], y[150:400])
    ref.add(u[101:400], f[101:400], y[101:400])
    assert _dump(got.to_dict()) == _dump(ref.to_dict()) and got == ref


@pytest.mark.parametrize("cert_share", [0.0, 0.6, 0.3])
def test_the_test_share_mask_is_the_routing_one(cert_share):
    """``SlidingWindow.testing`` (the shadow's samples) is the mask of the routing and of
    ``certifying``, uniforms on and around the shares' boundaries included."""
    lay = OnlineConfig().layout(10)
    w = SlidingWindow(lay, bucket_size=100, n_buckets=2, cert_share=cert_share)
    cw = lay.cumulative_weights()
    a = cw[len(lay.names) - 1]
    c = 1.0 - (1.0 - a) * cert_share
    edges = np.array([0.0, a, c, *cw, 1.0 - 2**-53])
    u = np.concatenate([np.random.default_rng(0).random(20_000), edges,
                        np.nextafter(edges, 0.0), np.nextafter(edges, 1.0)])
    u = u[(u >= 0) & (u < 1)]
    want = ~(lay.route_uniforms(u) < len(lay.names)) & ~w.certifying(u)
    assert np.array_equal(w.testing(u), want) and want.any()


def _drifting_defaults():
    from tests.test_online_calls import _stream

    f, y, drift = _stream(10, 60_000, 3)
    return f, y, drift, OnlineConfig(), {"published", "shadow", "fit_done"}


def _recertifying():
    # a small eps: the first map's certificate (few certification samples) does not certify
    from tests.test_online_certificate import tempered_truth

    f, _, y = tempered_truth(10_000, 0)
    return f, y, None, OnlineConfig(eps=0.025, pools_from=10**9, growth=4.0), {"recertified"}


@pytest.mark.parametrize("stream", [_drifting_defaults, _recertifying])
def test_deferring_across_decision_points_decides_as_summing_every_batch(stream):
    """The calibrator that defers rows (across decision points once its warm-up is over) and
    the one whose window never defers, in the same random batches: they publish, certify and
    recertify the same maps at the same samples, test the same shadows (scored from the test
    share kept since each fit request), and write the same checkpoint. Two streams: the
    shipped defaults over a drift (fits, shadows), and a small eps whose first map is
    certified again later."""
    f, y, drift, cfg, seen = stream()
    rng = np.random.default_rng(3)
    cuts = sorted({*_cuts(rng, f.shape[0], 3000), *([drift] if drift else [])})
    want, ref = _run(10, cfg, f, y, cuts, drift_at=drift, defer=False)
    got, cal = _run(10, cfg, f, y, cuts, drift_at=drift)
    kinds = {e[1] for e in want if isinstance(e, tuple)}
    kinds |= {e[4] for e in want if isinstance(e, tuple) and e[1] == "published"}
    assert seen <= kinds
    assert got == want
    assert _dump(cal.to_dict()) == _dump(ref.to_dict())
