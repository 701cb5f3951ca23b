"""The byte budget of a model's pools, held-out sums and window: the
per-sample bounds of :mod:`daemon.state_budget` hold for the arrays, a model fed samples that
all fall in distinct bins stays within its share (measured with ``tracemalloc``), real models'
samples at a realistic share are not degraded, and the registry shares the replica's total."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from daemon.events import EventParser
from daemon.metrics import DaemonMetrics
from daemon.model_state import ModelState
from daemon.monitor import WindowMonitor, fixed_bytes
from daemon.registry import ModelRegistry
from daemon.settings import Settings
from daemon.state_budget import (
    epoch_bytes,
    holdout_sample_bytes,
    monitor_sample_bytes,
    pool_sample_bytes,
)
from lpcal.holdout import HoldoutSums
from lpcal.levels import beta_for, lambda_for
from lpcal.pools import COMPACT_MIN_BYTES, CountTable

MIB = 1 << 20
DATA = Path(__file__).resolve().parents[1] / "bench" / "data"
LAM = lambda_for(beta_for(0.1, float("inf")))  # the default eps and p: lambda = 10


def distinct_bins(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows whose level sets at lambda = 10 are (almost surely) all different: nine random
    classes at 0.1005 (level 1 each), the rest spread; labels among the nine (so a fitted
    temperature stays near 1 and the scaled rows keep their distinct bins)."""
    top = np.argsort(rng.random((n, k)), axis=1)[:, :9]
    x = np.full((n, k), (1 - 9 * 0.1005) / (k - 9))
    np.put_along_axis(x, top, 0.1005, axis=1)
    return x, top[np.arange(n), rng.integers(0, 9, size=n)]


@pytest.mark.parametrize("k", [10, 300])
def test_per_sample_bounds_hold_for_distinct_bins(k):
    rng = np.random.default_rng(k)
    n = 3000
    x, y = distinct_bins(rng, n, k)
    t = CountTable(k, LAM)
    for a in range(0, n, 100):
        t.add(x[a:a + 100], y[a:a + 100])
    assert t.nbytes <= n * pool_sample_bytes(k, LAM) + COMPACT_MIN_BYTES
    t.compact()
    assert t.n_bins > 0.9 * n if k > 10 else t.n_bins > 0  # k = 10: nine of ten at level 1
    assert t.nbytes <= n * pool_sample_bytes(k, LAM) // 2
    h = HoldoutSums(k, LAM).update(x, y)
    assert h.nbytes * 2 <= n * holdout_sample_bytes(k)
    mon = WindowMonitor(k, LAM, float("inf"), window_samples=n)
    mon.update(x, y, calibrated=x)
    assert 0 < mon.nbytes <= n * monitor_sample_bytes(k) + fixed_bytes(k, mon.n_buckets)


def test_buffered_rows_are_compacted_by_bytes():
    """At k = 1000 a buffered row takes 4 KB: rows are folded in once they take more than the
    table (or the floor), not after 65,536 of them (256 MB)."""
    k, rng = 1000, np.random.default_rng(1)
    t = CountTable(k, LAM)
    x, y = distinct_bins(rng, 400, k)
    row = 4 * k + 12
    for _ in range(40):  # 16,000 rows added, 400 distinct bins
        t.add(x, y)
        assert t._pbytes <= max(COMPACT_MIN_BYTES, t._compacted_bytes()) + 400 * row
    assert t.total == 16_000 and t.n_bins == 400


def test_window_is_trimmed_oldest_first_to_its_budget():
    k, rng = 200, np.random.default_rng(2)
    mon = WindowMonitor(k, LAM, float("inf"), window_samples=4000, n_buckets=8)
    x, y = distinct_bins(rng, 4000, k)
    for a in range(0, 4000, 250):
        mon.update(x[a:a + 250], y[a:a + 250])
    full = mon.nbytes
    assert mon.window_size() == 4000 and mon.trimmed == 0
    cut = mon.set_max_bytes(full // 3)
    assert mon.nbytes <= full // 3 and cut == mon.trimmed > 0
    assert mon.window_size() == 4000 - cut
    newest = next(reversed(mon.buckets))
    x2, y2 = distinct_bins(rng, 1000, k)
    mon.update(x2, y2)  # ingest keeps trimming
    assert mon.nbytes <= full // 3 and mon.trimmed > cut
    assert next(reversed(mon.buckets)) > newest  # the newest samples are the ones kept
    # a time window: unbounded in samples without a budget, bounded with one
    tw = WindowMonitor(k, LAM, float("inf"), window_seconds=60.0, max_bytes=full // 4)
    for a in range(0, 4000, 500):
        tw.update(x[a:a + 500], y[a:a + 500], ts=np.full(500, 10.0))  # one bucket of time
    assert tw.nbytes <= full // 4 and tw.trimmed > 0


def _state(budget: int | None, k: int = 1000) -> ModelState:
    s = Settings(defaults={"recovery": "epochs"})
    st = ModelState.create("m", k, s.defaults, s.join)
    st.set_budget(budget)
    return st


def _feed(st: ModelState, x, y, batch: int, start: int = 0, fit=True) -> dict[str, int]:
    early = sealed = 0
    for a in range(0, len(y), batch):
        ids = [f"s{start + a + i}" for i in range(min(batch, len(y) - a))]
        res = st.ingest(ids, x[a:a + batch], y[a:a + batch], np.full(len(ids), 100.0 + a))
        early, sealed = early + res.sealed_early, sealed + res.sealed
        while fit and st.backlogged:
            st.start_new_epoch()  # as the daemon does: a fit takes the oldest sealed epoch
    return {"early": early, "sealed": sealed}


def test_a_model_with_distinct_bins_stays_within_its_share():
    """k = 1000, every sample a new bin: ~170 MB per epoch and 320 MB of window without a
    budget (206 MiB held after these 24,000 samples, 294 MiB at the peak). With a 16 MiB share
    the state stays within it and the traced peak within the share plus one batch's transients
    (250 rows of k = 1000: input, per-batch sums, a held-out merge); epochs are sealed early,
    the window trimmed but never emptied."""
    budget, k, batch = 16 * MIB, 1000, 250
    x, y = distinct_bins(np.random.default_rng(3), 24_000, k)
    gc.collect()
    tracemalloc.start()
    try:
        st = _state(budget, k)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        counts = _feed(st, x, y, batch)
        held, peak = (v - base for v in tracemalloc.get_traced_memory())
    finally:
        tracemalloc.stop()
    assert counts["early"] >= 1 and st.monitor.trimmed > 0
    assert st.monitor.window_size() >= 100 and st.monitor.nbytes <= budget // 4
    assert st.nbytes <= budget // 2 + batch * (holdout_sample_bytes(k) + pool_sample_bytes(k, LAM))
    assert held <= budget, f"{held / MIB:.1f} MiB held for a {budget / MIB} MiB share"
    assert peak <= budget + 20 * MIB, f"{peak / MIB:.1f} MiB peak for a {budget / MIB} MiB share"


def test_backlogged_when_sealed_epochs_take_a_quarter():
    budget, k = 16 * MIB, 1000
    st = _state(budget, k)
    x, y = distinct_bins(np.random.default_rng(4), 16_000, k)
    _feed(st, x, y, 250, fit=False)
    assert st.sealed and len(st.sealed) < 4 and st.backlogged
    assert sum(ps.nbytes for _, ps in st.sealed) >= 0.25 * budget
    st.set_budget(None)
    assert not st.backlogged  # only the count bound (MAX_SEALED) is left


@pytest.mark.parametrize("record,share", [("lenet-5-cifar-10", 8 * MIB),
                                          ("densenet-bc-100-cifar-100", 36 * MIB)])
def test_real_models_are_not_degraded_at_their_sizing_share(record, share):
    """The sizing of :mod:`daemon.state_budget`: at the share it gives, real networks' samples
    fill whole epochs and a whole window, and the epochs seal at the same samples as without a
    budget (so replays stay exact)."""
    d = np.load(DATA / f"{record}.npz")
    p = d["predictions"].astype(np.float64)
    p /= p.sum(axis=1, keepdims=True)
    idx = np.random.default_rng(5).integers(0, len(p), 60_000)
    x, y = p[idx], d["ground_truth"].astype(np.int64)[idx]
    runs = []
    for budget in (share, None):
        st = _state(budget, p.shape[1])
        sealed_at = []
        for a in range(0, len(y), 500):
            res = st.ingest([f"r{a + i}" for i in range(500)], x[a:a + 500], y[a:a + 500],
                            np.full(500, float(a)))
            assert res.sealed_early == 0
            if res.sealed:
                sealed_at.append((a, st.sealed[-1][1].total))
            while st.sealed:
                st.start_new_epoch()
        assert st.monitor.trimmed == 0
        runs.append(sealed_at)
    assert runs[0] == runs[1] and len(runs[0]) >= 1


def test_epoch_bound_covers_a_full_epoch():
    st = _state(None, 300)
    x, y = distinct_bins(np.random.default_rng(6), 60_000, 300)
    _feed(st, x, y, 1000, fit=False)
    assert st.sealed
    ps = st.sealed[0][1]
    ps.compact()
    assert ps.nbytes <= epoch_bytes(ps.layout)
    assert ps.nbytes > 0.3 * epoch_bytes(ps.layout)  # the bound is not vacuous


def test_registry_shares_the_total_and_counts_trims():
    s = Settings(state={"max_bytes_per_model": 64 * MIB, "max_bytes_total": 96 * MIB},
                 defaults={"k": 300})
    reg = ModelRegistry(s, DaemonMetrics(max_models=s.max_models), EventParser.from_settings(s))
    a = reg.create("a", 300, 0)
    assert a.budget == 64 * MIB and a.monitor.max_bytes == 16 * MIB
    x, y = distinct_bins(np.random.default_rng(7), 10_000, 300)
    _feed(a, x, y, 500)
    assert a.monitor.nbytes > 8 * MIB  # more than the window's quarter of a three-way share
    trimmed = a.monitor.trimmed  # while ingesting (counted by the daemon's ingest)
    b = reg.create("b", 300, 0)
    reg.create("c", 300, 1)
    assert a.budget == b.budget == 32 * MIB and a.monitor.nbytes <= 8 * MIB
    counted = reg.metrics.window_trimmed.labels(model="a")._value.get()
    assert counted == a.monitor.trimmed - trimmed > 0
