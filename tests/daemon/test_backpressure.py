"""Backpressure in :class:`daemon.service.Daemon` without a broker: the trigger/fit step
(``_after_batch``) and the pause/resume bookkeeping (``_apply_backpressure``), driven with a
consumer stand-in that only records ``pause``/``resume`` calls (the end-to-end behaviour against
the real broker is ``tests/integration/test_daemon_backpressure.py``)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from daemon.model_state import MAX_SEALED
from daemon.service import Daemon
from tests.daemon.daemon_stubs import MODEL, RecordingConsumer, small_settings, state_with_sealed


@pytest.fixture
def daemon(monkeypatch):
    s = small_settings()
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
    st = state_with_sealed(daemon.s, MAX_SEALED + 1)
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
    st = state_with_sealed(daemon.s, MAX_SEALED - 1)
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
    st = state_with_sealed(daemon.s, MAX_SEALED)
    daemon.models[MODEL], daemon.partition_of[MODEL] = st, 1
    daemon.assigned = {tp for tp in daemon.assigned if tp.partition == 0}
    daemon._apply_backpressure()
    assert not daemon.throttled and not daemon.consumer.calls
