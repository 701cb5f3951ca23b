"""The per-offer shortcuts of small offers against the code they replace: the largest event
time of a few times as a Python list (:func:`daemon.monitor.largest`), the joined and pending
rows gathered with ``ndarray.take`` (:meth:`daemon.join.JoinStore._finish_offer`), a fully
consumed online update passed on without views (``ModelState._feed_online``) and the window's
bytes summed with an attribute getter (:attr:`daemon.monitor.WindowMonitor.nbytes`).

The references are the older code, kept here; the stream is cut into random small and large
offers, with invalid events (labels >= k, duplicates, blocked online updates), under byte
budgets or none: every checkpoint must be byte-identical.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from daemon.event_records import ModelPolicy
from daemon.events import EventParser
from daemon.join import JoinStore
from daemon.model_state import ModelState
from daemon.monitor import LIST_MAX, WindowMonitor, largest
from daemon.settings import JoinSettings
from lpcal.online import run_fit
from tests.daemon.test_offer_paths import (
    MODEL,
    ReferenceJoin,
    ReferenceState,
    _checkpoint,
    _messages,
    _settings,
)


def _reference_largest(a) -> float:
    """The clock's reduction as it was."""
    return float(a.max() if type(a) is np.ndarray else np.max(a))


def _same_float(a: float, b: float) -> bool:
    """Equal to the bit (NaN equal to NaN, 0.0 not equal to -0.0)."""
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a)
                                                 == math.copysign(1.0, b))


def test_largest_is_numpys_max_to_the_bit():
    rng = np.random.default_rng(5)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e308, -1e308, 5e-324]
    cases = [np.array(v) for v in ([0.0, -0.0], [-0.0, 0.0], [-0.0], [1.0, np.nan],
                                   [np.nan, 1.0], [np.inf, -np.inf], [1e308, 1e308, -np.inf],
                                   [-5.0, -0.0, -1.0])]
    for _ in range(3000):
        n = int(rng.choice([1, 2, 5, 17, LIST_MAX, LIST_MAX + 1, 300]))
        a = rng.normal(size=n) * 10.0 ** int(rng.integers(-5, 300))
        for _ in range(int(rng.integers(0, 3))):
            a[int(rng.integers(0, n))] = special[int(rng.integers(0, len(special)))]
        cases.append(a)
    cases += [np.arange(5), np.arange(5, dtype=np.float32), np.ones((2, 3)), [3.0, 1.0],
              np.arange(10.0)[::3]]
    for a in cases:
        assert _same_float(largest(a), _reference_largest(a)), a
    with pytest.raises(ValueError):
        largest(np.zeros(0))


class ReferenceFeedState(ReferenceState):
    """:class:`ReferenceState` with ``_feed_online`` as it was: the consumed rows always
    passed on as views."""

    def _feed_online(self, res, probs, labels, u, ts) -> None:
        cal = self.online
        start = cal.n_seen
        up = cal.update(probs, labels, uniforms=u)
        m = up.consumed
        self._take_events(res, up.events, start, probs[:m], labels[:m],
                          None if ts is None else np.asarray(ts)[:m])
        if m < labels.size:
            self.backlog = (probs[m:].copy(), labels[m:].copy(), u[m:].copy(),
                            None if ts is None else np.asarray(ts, dtype=np.float64)[m:])
        res.blocked = cal.blocked


class ReferenceBytesMonitor(WindowMonitor):
    """:attr:`WindowMonitor.nbytes` as it was (the trim and the bucket closes read it)."""

    @property
    def nbytes(self) -> int:
        return (sum(bk.nbytes for bk in self.buckets.values())
                + sum(s.nbytes for s in self._block) + self._block_rows.nbytes
                + (self._block_cw.nbytes if self._block_cw is not None else 0))


def _pair(recovery: str, budget: int | None, join_budget: int | None):
    join = JoinSettings(ttl_seconds=50, max_pending_per_model=5000)
    ms = _settings(recovery)
    new = ModelState.create(MODEL, 4, ms, join)
    ref = ReferenceFeedState.create(MODEL, 4, ms, join)
    ref.join = ReferenceJoin(new.join.max_pending, new.join.ttl, new.join.max_recent)
    for st in (new, ref):
        if budget is not None:
            st.set_budget(budget)
        if join_budget is not None:
            st.join.set_budget(join_budget)
    return new, ref


def _complete_outstanding(new: ModelState, ref: ModelState) -> int:
    """Run the fits both states wait for (the same requests) and hand them back (the fits
    this requests in turn wait for a later call); returns how many backlogs were fed."""
    fed = 0
    for a, b in zip(new.fit_requests_outstanding, ref.fit_requests_outstanding, strict=True):
        backlog = new.backlog is not None
        bm = run_fit(a)
        r1, r2 = new.complete_fit(a, bm), ref.complete_fit(b, bm)
        assert (r1.joined, r1.blocked, len(r1.events)) == (r2.joined, r2.blocked, len(r2.events))
        fed += backlog
    return fed


@pytest.mark.parametrize(("recovery", "budget", "join_budget", "seed"), [
    ("online", None, None, 20), ("online", 1_500_000, 1_000_000, 21),
    ("epochs", None, None, 22), ("epochs", 60_000, 1_000_000, 23)])
def test_small_and_large_offers_leave_the_checkpoint_of_the_reference_paths(
        recovery, budget, join_budget, seed):
    # online: enough samples for the window's pools to be fitted (fit requests, backlogs)
    msgs = _messages(16_000 if recovery == "online" else 5000, seed, bad_labels=True)
    parser = EventParser(lambda m: ModelPolicy())
    new, ref = _pair(recovery, budget, join_budget)
    rng = np.random.default_rng(seed)
    a = 0
    blocked = fed = 0
    while a < len(msgs):
        size = int(rng.choice([1, 2, 5, 10, 20, 20, 64, 65, 400, 2000]))
        mb = parser.parse_batch(msgs[a:a + size]).by_model[MODEL]
        a += size
        res, res_ref = new.offer(mb), ref.offer(mb)
        for f in ("joined", "sampled_out", "label_out_of_range", "evicted", "unmatched",
                  "sealed", "sealed_early", "window_trimmed", "blocked"):
            assert getattr(res, f) == getattr(res_ref, f), f
        blocked += res.blocked
        if rng.random() < 0.1:  # joined samples with labels >= k, both ways of checking them
            n = int(rng.choice([1, 7, 64, 65, 300]))
            x = rng.dirichlet(np.ones(4), size=n)
            y = rng.integers(0, 6, n)
            ids = [f"x{a}-{j}" for j in range(n)]
            t = np.full(n, float(mb.ts.max()))
            r1, r2 = new.ingest(ids, x, y, t), ref.ingest(ids, x, y, t)
            assert (r1.label_out_of_range, r1.joined) == (r2.label_out_of_range, r2.joined)
        if recovery == "online" and rng.random() < 0.3:  # else the fits wait: backlogs
            fed += _complete_outstanding(new, ref)
        if rng.random() < 0.15:
            assert _checkpoint(new) == _checkpoint(ref)
            assert new.monitor.nbytes == ref.monitor.nbytes
    if recovery == "online":
        assert blocked and fed and new.binmap_version > 0  # backlogs fed, maps installed
    assert new.dropped_labels > 0 and new.dropped_labels == ref.dropped_labels
    assert new.join.stats(MODEL) == ref.join.stats(MODEL)
    assert _checkpoint(new) == _checkpoint(ref)
    assert new.join.memory_bytes() == ref.join.memory_bytes()


def test_window_bytes_and_trims_under_a_budget_equal_the_reference():
    """Small and large updates of a window under byte budgets: the bytes it counts (which
    decide its trims and bucket closes), its trims and its sums are the reference's."""
    rng = np.random.default_rng(9)
    k = 5
    for max_bytes in (20_000, 80_000, None):
        new = WindowMonitor(k, 10, math.inf, window_samples=1500, max_bytes=max_bytes)
        ref = ReferenceBytesMonitor(k, 10, math.inf, window_samples=1500, max_bytes=max_bytes)
        for i in range(300):
            n = int(rng.choice([1, 3, 10, 20, 100, 700]))
            x = rng.dirichlet(np.ones(k) * 0.5, size=n)
            y = rng.integers(0, k, n)
            c = np.sqrt(x) / np.sqrt(x).sum(axis=1, keepdims=True) if i > 20 else None
            t = np.arange(n) + 10.0 * i
            assert new.update(x, y, t, calibrated=c) == ref.update(x, y, t, calibrated=c)
            assert new.nbytes == ref.nbytes
            if i % 50 == 0:
                assert new.evaluate() == ref.evaluate()
        assert new.trimmed == ref.trimmed and new.clock == ref.clock


def test_join_rows_of_small_and_large_offers_equal_the_reference():
    """Random offers of predictions, outcomes and complete samples (duplicates, late events,
    capacity evictions): the joined rows and the pending rows are the reference's."""
    rng = np.random.default_rng(4)
    k = 3
    new = JoinStore(max_pending_per_model=300, ttl_seconds=40.0)
    ref = ReferenceJoin(max_pending_per_model=300, ttl_seconds=40.0)
    t = 0.0
    for _ in range(400):
        n = int(rng.choice([1, 4, 10, 20, 150]))
        kind = rng.choice([0, 0, 1, 1, 2], size=n).astype(np.int8)
        ids = [f"e{int(v)}" for v in rng.integers(0, 2000, n)]
        ts = t + rng.random(n) * 5.0
        t += 1.0
        probs = rng.dirichlet(np.ones(k), size=n)
        labels = np.where(kind == 0, -1, rng.integers(0, k, n))
        a = new.offer(MODEL, kind, ids, ts, probs, labels)
        b = ref.offer(MODEL, kind, ids, ts, probs, labels)
        assert a.ids == b.ids and a.evicted == b.evicted and a.unmatched == b.unmatched
        assert np.array_equal(a.probs, b.probs) and a.probs.dtype == b.probs.dtype
        assert a.probs.shape == b.probs.shape and a.probs.flags.c_contiguous
        assert np.array_equal(a.labels, b.labels) and np.array_equal(a.ts, b.ts)
    assert new.memory_bytes() == ref.memory_bytes()
