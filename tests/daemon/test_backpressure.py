"""Backpressure in :class:`daemon.service.Daemon` without a broker: the trigger/fit step
(``_after_batch``) and the pause/resume bookkeeping (``_apply_backpressure``), driven with a
consumer stand-in that only records ``pause``/``resume`` calls (the end-to-end behaviour against
the real broker is ``tests/integration/test_daemon_backpressure.py``)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from daemon.events import EventParser
from daemon.model_state import MAX_SEALED, ModelState
from daemon.service import Daemon
from daemon.settings import Settings

MODEL, K = "bp-unit", 3


class RecordingConsumer:
    """Records which partitions are paused (``highwater``: the lag export's only other call)."""

    def __init__(self):
        self.paused: set[TopicPartition] = set()
        self.calls: list[tuple[str, tuple]] = []

    def pause(self, *tps):
        self.calls.append(("pause", tps))
        self.paused |= set(tps)

    def resume(self, *tps):
        self.calls.append(("resume", tps))
        self.paused -= set(tps)

    def highwater(self, tp):
        return None


def _settings() -> Settings:
    return Settings(defaults={"pool": 40, "mu_pool": 80, "drift_threshold": 100.0},
                    models={MODEL: {"k": K}})


def _state_with_sealed(settings: Settings, n_sealed: int) -> ModelState:
    st = ModelState.create(MODEL, K, settings.model_settings(MODEL), settings.join)
    per_epoch = sum(st.layout.targets.values())
    rng = np.random.default_rng(1)
    n = 3 * per_epoch * (n_sealed + 1)  # routing by id hash fills pools unevenly
    probs = rng.dirichlet(np.ones(K), size=n)
    labels = rng.integers(0, K, size=n)
    values = [orjson.dumps({"model": MODEL, "id": f"u{i}", "ts": float(i),
                            "probs": probs[i].tolist(), "label": int(labels[i])})
              for i in range(n)]
    for mb in EventParser.from_settings(settings).parse_batch(values).by_model.values():
        st.offer(mb)
    while len(st.sealed) > n_sealed:
        st.start_new_epoch()
    assert len(st.sealed) == n_sealed
    return st


@pytest.fixture
def daemon(monkeypatch):
    s = _settings()
    d = Daemon(s)
    d.consumer = RecordingConsumer()
    d.assigned = {TopicPartition(s.kafka.topics.predictions, 0),
                  TopicPartition(s.kafka.topics.outcomes, 0),
                  TopicPartition(s.kafka.topics.predictions, 1),
                  TopicPartition(s.kafka.topics.outcomes, 1)}
    launched = []
    monkeypatch.setattr(d, "_launch_fit", lambda model, inf: launched.append((model, inf)))
    d.launched = launched
    return d


def test_restored_backlog_on_a_paused_partition_is_fitted_without_new_events(daemon):
    # as after a restore: sealed epochs, not dirty (no event arrived), no fit in flight
    st = _state_with_sealed(daemon.s, MAX_SEALED + 1)
    daemon.models[MODEL], daemon.partition_of[MODEL] = st, 0
    assert not daemon.dirty and not daemon.inflight
    daemon._after_batch()
    assert [m for m, _ in daemon.launched] == [MODEL]       # the oldest epoch's fit started
    assert daemon.launched[0][1].version == st.binmap_version + 1
    assert len(st.sealed) == MAX_SEALED                     # handed off to the fit
    # still backlogged: partition 0 (both topics) paused, partition 1 untouched
    assert daemon.throttled == {0}
    assert {tp.partition for tp in daemon.consumer.paused} == {0}
    assert len(daemon.consumer.paused) == 2


def test_pause_at_the_mark_and_resume_below_it(daemon):
    st = _state_with_sealed(daemon.s, MAX_SEALED - 1)
    daemon.models[MODEL], daemon.partition_of[MODEL] = st, 1
    daemon._apply_backpressure()
    assert not daemon.throttled and not daemon.consumer.calls   # below the mark: nothing
    st.seal()
    assert st.backlogged
    daemon._apply_backpressure()
    daemon._apply_backpressure()                                # idempotent
    assert daemon.throttled == {1}
    assert [c for c, _ in daemon.consumer.calls] == ["pause"]
    st.start_new_epoch()                                        # a fit took the oldest
    daemon._apply_backpressure()
    assert not daemon.throttled and not daemon.consumer.paused
    assert [c for c, _ in daemon.consumer.calls] == ["pause", "resume"]


def test_revoked_partition_is_neither_paused_nor_resumed(daemon):
    st = _state_with_sealed(daemon.s, MAX_SEALED)
    daemon.models[MODEL], daemon.partition_of[MODEL] = st, 1
    daemon.assigned = {tp for tp in daemon.assigned if tp.partition == 0}
    daemon._apply_backpressure()
    assert not daemon.throttled and not daemon.consumer.calls
