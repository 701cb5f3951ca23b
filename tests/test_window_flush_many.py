"""Many windows' deferred rows summed in one pass (:func:`lpcal.window.flush_many`) leave every
window in the very state its own :meth:`~lpcal.window.SlidingWindow.flush` leaves, to the byte.

Online calibrators of several ``k``, configurations and seeds are fed streams with a drift in
small random batches (rows short of a decision point are deferred); at random points every
calibrator is copied, one copy's windows are flushed one at a time and the other's together,
and the checkpoints (both forms) and byte counts are compared. The streams cover windows in the
warm-up, windows whose buckets bin pools at a temperature, warm-ups re-opened by a drift while
the pools keep binning, buckets with and without a certification share, and routings that
differ (which :func:`flush_many` must not mix)."""

from __future__ import annotations

import numpy as np
import pytest

from lpcal.challenger import LossGrid
from lpcal.challenger import update_runs as update_loss_runs
from lpcal.online import OnlineCalibrator, OnlineConfig, run_fit
from lpcal.pools import PoolLayout
from lpcal.precalibrate import TemperatureGrid, grid_nll_runs, run_bounds
from lpcal.warmup import WarmupSums
from lpcal.warmup import update_runs as update_warmup_runs
from lpcal.window import SlidingWindow, flush_many
from tests.test_warmup import tempered
from tests.test_window_deferral import _dump

_SMALL = {"pools_from": 600, "step": 50, "bucket_size": 200, "n_buckets": 6, "fit_delay": 50,
          "certify_buckets": 2, "cert_buckets": 3, "warmup_min": 200, "warmup_tol": 0.3}


def _configs() -> list[tuple[int, OnlineConfig]]:
    return [(10, OnlineConfig(**_SMALL)),
            (10, OnlineConfig(**{**_SMALL, "warmup_min": 1000})),  # still warming: a mixed pass
            (3, OnlineConfig(**{**_SMALL, "cert_share": 0.0})),
            (10, OnlineConfig(**{**_SMALL, "cert_share": 0.3})),
            (100, OnlineConfig(**_SMALL))]


def _streams(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i, (k, _) in enumerate(_configs()):
        drift = n // 2
        f1, y1 = tempered(drift, k=k, t=2.0, seed=10 + i)
        f2, y2 = tempered(n - drift, k=k, t=0.6, seed=20 + i, noise=0.05)
        f = np.concatenate([f1, f2])
        f[::97, 0] = 0.0  # some rows give their label probability 0 (skipped by the grids)
        f /= f.sum(axis=1, keepdims=True)
        out.append((f, np.concatenate([y1, y2])))
    return out


def _state(cal: OnlineCalibrator) -> tuple:
    return _dump(cal.to_dict()), _dump(cal.to_dict(packed=True)), cal.nbytes


def test_flush_many_leaves_every_window_as_its_own_flush_does():
    rng = np.random.default_rng(5)
    n = 3000
    one = [OnlineCalibrator(k, cfg, fit=run_fit) for k, cfg in _configs()]
    many = [OnlineCalibrator(k, cfg, fit=run_fit) for k, cfg in _configs()]
    streams = _streams(n)
    pos = [0] * len(one)
    checks = states = 0
    mixed = 0
    while min(pos) < n:
        for i in range(len(one)):
            f, y = streams[i]
            b = min(n, pos[i] + int(rng.integers(1, 12)))
            for cal in (one[i], many[i]):  # the same batches to both
                a = pos[i]
                while a < b:
                    a += cal.update(f[a:b], y[a:b]).consumed
                if pos[i] < n // 2 <= b:
                    cal.notify_drift()
            pos[i] = b
        if rng.random() < 0.15:
            deferred = [c for c in many if c.window._deferred]
            states += len(deferred)
            kinds = {(c.window._deferred_warm is not None, c.window.open.pools is not None)
                     for c in deferred if c.window.layout.k == 10}
            mixed += {(True, False), (False, True)} <= kinds  # warming and pooled in one pass
            for c in one:
                c.window.flush()
            flush_many([c.window for c in many] + [many[0].window])  # a repeat is flushed once
            assert not any(c.window._deferred for c in many)
            assert [_state(c) for c in many] == [_state(c) for c in one]
            checks += 1
    assert checks >= 20 and states >= 50
    assert mixed >= 3
    assert all(c.window.temperature is not None for c in many)  # pools were filled


def test_flush_many_of_windows_warming_up_while_their_pools_bin():
    """The window allows warm-up sums fed while a temperature bins the pools (the calibrator
    drops its pools when a drift re-opens the warm-up): those windows, windows without a
    certification share, and windows of another routing in the same call."""
    rng = np.random.default_rng(3)
    lay = PoolLayout(10, 10, 2, "shared", {"mu": 5, "PE0": 5, "PE1": 5}, holdout=6)
    other = PoolLayout(10, 10, 2, "shared", {"mu": 3, "PE0": 5, "PE1": 9}, holdout=4)
    kinds = [(lay, 0.5, 1.3, True), (lay, 0.5, None, True), (lay, 0.5, 0.8, False),
             (lay, 0.0, 1.3, True), (other, 0.5, 1.1, True), (lay, 0.5, 0.7, True)]

    def windows():
        out = []
        for layout, share, t, warm in kinds:
            w = SlidingWindow(layout, bucket_size=300, n_buckets=4, holdout_buckets=2,
                              cert_share=share, cert_buckets=3)
            w.set_temperature(t)
            out.append((w, WarmupSums() if warm else None))
        return out

    one, many = windows(), windows()
    f, y = tempered(2000, k=10, t=1.7, seed=9)
    u = rng.random(2000)
    a = 0
    for _ in range(40):
        m = int(rng.integers(1, 30))
        for w, warm in one + many:
            w.add(u[a:a + m], f[a:a + m], y[a:a + m], warmup=warm, defer=True)
        a += m
        if rng.random() < 0.3:
            for w, _ in one:
                w.flush()
            flush_many(w for w, _ in many)
            assert ([(_dump(w.to_dict()), None if s is None else s.to_dict()) for w, s in many]
                    == [(_dump(w.to_dict()), None if s is None else s.to_dict())
                        for w, s in one])


def test_flush_many_cuts_large_batches_into_passes():
    """More rows than ``max_rows`` are summed in several passes, with the same result."""
    k, cfg = _configs()[0]
    one, many = ([OnlineCalibrator(k, cfg, fit=run_fit) for _ in range(6)] for _ in range(2))
    for i in range(6):
        f, y = tempered(40 + i, k=k, t=1.5, seed=i)
        one[i].update(f, y)
        many[i].update(f, y)
        one[i].window.flush()
    flush_many((c.window for c in many), max_rows=7)
    assert [_state(c) for c in many] == [_state(c) for c in one]


@pytest.mark.parametrize("k", [2, 10, 100])
def test_kernel_runs_equal_one_update_per_run(k):
    """The three kernels' runs forms give each run the sums of its own rows (empty runs, runs
    longer than a chunk, rows whose label has probability 0)."""
    rng = np.random.default_rng(k)
    counts = rng.integers(0, 40, 25)
    counts[3] = 0
    counts[7] = 1300  # longer than a chunk of the grid's exponentials
    n = int(counts.sum())
    z = rng.normal(size=(n, k)) * 3
    f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    f[rng.random((n, k)) < 0.05] = 0.0
    f[f.sum(axis=1) == 0, 0] = 1.0
    f /= f.sum(axis=1, keepdims=True)
    y = rng.integers(0, k, n)
    assert (f[np.arange(n), y] == 0).any()
    bounds = np.concatenate([[0], np.cumsum(counts)])
    runs = [slice(bounds[j], bounds[j + 1]) for j in range(counts.size)]

    loss_one = [LossGrid().update(f[r], y[r]) for r in runs]
    loss_runs = [LossGrid() for _ in runs]
    update_loss_runs(loss_runs, f, y, counts)
    assert [g.to_dict() for g in loss_runs] == [g.to_dict() for g in loss_one]

    warm_one, grid_one = [WarmupSums() for _ in runs], [TemperatureGrid() for _ in runs]
    for r, w, g in zip(runs, warm_one, grid_one):
        w.update(f[r], y[r], grid=g)
    warm_runs, grid_runs = [WarmupSums() for _ in runs], [TemperatureGrid() for _ in runs]
    update_warmup_runs(warm_runs, grid_runs, f, y, counts)
    assert [w.to_dict() for w in warm_runs] == [w.to_dict() for w in warm_one]
    assert [g.to_dict() for g in grid_runs] == [g.to_dict() for g in grid_one]

    nll, summed, skipped = grid_nll_runs(f, y, counts)
    for j, r in enumerate(runs):
        g = TemperatureGrid().update(f[r], y[r])
        assert (nll[j] == g.nll).all() and (summed[j], skipped[j]) == (g.n, g.skipped)


def test_run_bounds_skip_empty_runs():
    bounds, owners = run_bounds([2, 0, 3, 0])
    assert bounds.tolist() == [0, 2, 5] and owners.tolist() == [0, 2]
