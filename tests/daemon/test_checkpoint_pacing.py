"""Checkpoint pacing (:mod:`daemon.checkpoint.pacing`): periodic checkpoints start every
interval, but no sooner than the last full checkpoint's duration over the share; release and
shutdown checkpoints are never paced. Driven by an injected clock (no timing)."""

from __future__ import annotations

import asyncio

import pytest

from daemon.checkpoint.checkpointer import Checkpointer
from daemon.checkpoint.pacing import DEFAULT_MAX_SHARE, CheckpointPacing
from daemon.metrics import DaemonMetrics


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_short_checkpoints_keep_the_configured_interval():
    clock = Clock()
    p = CheckpointPacing(10.0, 0.1, clock=clock)
    assert not p.due()
    clock.t += 9.99
    assert not p.due()
    clock.t += 0.01
    assert p.due()
    start = p.started()
    clock.t += 0.5          # took 0.5 s: 0.5 / 0.1 = 5 s < 10 s
    p.finished(start, full=True, ok=True)
    assert p.last_duration == 0.5 and p.effective_interval == 10.0
    clock.t = start + 9.9
    assert not p.due()
    clock.t = start + 10.0
    assert p.due()


def test_a_long_checkpoint_spaces_the_next_by_its_duration_over_the_share():
    clock = Clock()
    p = CheckpointPacing(10.0, 0.1, clock=clock)
    clock.t += 10
    start = p.started()
    clock.t += 3.0          # a 3 s round: the next starts 30 s after this one started
    p.finished(start, full=True, ok=True)
    assert p.effective_interval == pytest.approx(30.0)
    clock.t = start + 29.9
    assert not p.due()
    clock.t = start + 30.0
    assert p.due()
    # the share of the time spent checkpointing is at most the share
    assert p.last_duration / p.effective_interval <= 0.1 + 1e-12
    # a fast round afterwards brings the configured interval back
    start = p.started()
    clock.t += 0.2
    p.finished(start, full=True, ok=True)
    assert p.effective_interval == 10.0


def test_partial_and_failed_checkpoints_do_not_set_the_duration_but_restart_the_interval():
    clock = Clock()
    p = CheckpointPacing(10.0, 0.1, clock=clock)
    start = p.started()
    clock.t += 5.0
    p.finished(start, full=False, ok=True)   # a release: partial
    start = p.started()
    clock.t += 7.0
    p.finished(start, full=True, ok=False)   # failed (a broker timeout)
    assert p.last_duration == 0.0 and p.effective_interval == 10.0
    assert p.last_at == start
    clock.t = start + 10.0
    assert p.due()


def test_a_share_of_one_allows_back_to_back_checkpoints_and_bad_values_are_refused():
    clock = Clock()
    p = CheckpointPacing(1.0, 1.0, clock=clock)
    start = p.started()
    clock.t += 4.0
    p.finished(start, full=True, ok=True)
    assert p.effective_interval == 4.0 and p.due()
    assert DEFAULT_MAX_SHARE == 0.1
    for interval, share in ((0.0, 0.1), (10.0, 0.0), (10.0, 1.5), (float("nan"), 0.1)):
        with pytest.raises(ValueError):
            CheckpointPacing(interval, share, clock=clock)


# ------------------------------------------------------------- the checkpointer's use of it
class _Registry:
    def __init__(self):
        self.slots, self.dirty = {}, set()

    def on_partitions(self, parts):
        return []


class _Partitions:
    def numbers(self):
        return {0, 1}

    def position(self, topic, partition):
        return 5  # every partition has input: its manifest is saved

    def get(self, p):
        return None


class _DeadLetters:
    pending = False


class _Clients:
    t_pred, t_out, consumer = "lpcal.predictions", "lpcal.outcomes", None


class _Store:
    """Saving takes ``cost`` seconds of the test's clock; fails when ``fail``."""

    def __init__(self, clock: Clock, cost: float):
        self.clock, self.cost, self.fail, self.saved = clock, cost, False, []

    async def save(self, records):
        self.clock.t += self.cost
        if self.fail:
            raise ConnectionError("broker down")
        self.saved.append(dict(records))


def _checkpointer(clock: Clock, cost: float, interval: float = 10.0, share: float = 0.1):
    metrics = DaemonMetrics()
    store = _Store(clock, cost)
    cp = Checkpointer(store, _Registry(), _Partitions(), _DeadLetters(), _Clients(), metrics,
                      interval=interval, max_share=share, clock=clock)
    return cp, store, metrics


def _gauge(metrics: DaemonMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name)


def test_the_checkpointer_paces_periodic_checkpoints_and_exports_the_interval():
    clock = Clock()
    cp, store, metrics = _checkpointer(clock, cost=2.5)  # saving the manifests takes 2.5 s
    assert _gauge(metrics, "lpcal_checkpoint_interval_seconds") == 10.0
    clock.t += 10
    assert cp.due()
    start = clock.t
    asyncio.run(cp.commit(commit_offsets=False))
    assert len(store.saved) == 1 and set(store.saved[0]) == {"partition/0", "partition/1"}
    assert cp.last_at == start and cp.pacing.last_duration == pytest.approx(2.5)
    assert _gauge(metrics, "lpcal_checkpoint_duration_seconds") == pytest.approx(2.5)
    assert _gauge(metrics, "lpcal_checkpoint_interval_seconds") == pytest.approx(25.0)
    clock.t = start + 24.0
    assert not cp.due()
    # a release is never delayed: commit() of its partitions runs now, and does not change
    # the duration the pacing goes by
    asyncio.run(cp.commit({1}, commit_offsets=False))
    assert set(store.saved[-1]) == {"partition/1"}
    assert cp.pacing.last_duration == pytest.approx(2.5) and cp.last_at == start + 24.0
    clock.t = start + 24.0 + 24.9
    assert not cp.due()
    clock.t = start + 24.0 + 25.0
    assert cp.due()


def test_a_failed_checkpoint_is_retried_after_the_configured_interval():
    clock = Clock()
    cp, store, metrics = _checkpointer(clock, cost=8.0)
    store.fail = True
    clock.t += 10
    start = clock.t
    with pytest.raises(ConnectionError):
        asyncio.run(cp.commit(commit_offsets=False))
    assert cp.pacing.effective_interval == 10.0
    assert metrics.registry.get_sample_value("lpcal_checkpoints_total",
                                             {"outcome": "error"}) == 1
    clock.t = start + 10.0
    assert cp.due()
