"""Backpressure in :class:`daemon.service.Daemon` without a broker: the trigger/fit step
(``Fitter.after_batch``) and the pause/resume bookkeeping (``Fitter.apply_backpressure``), driven with a
consumer stand-in that only records ``pause``/``resume`` calls (the end-to-end behaviour against
the real broker is ``tests/integration/test_daemon_backpressure.py``)."""

from __future__ import annotations

import time

import pytest

from daemon.model_state import MAX_SEALED
from tests.support.daemon_stubs import MODEL, broker_free_daemon, small_settings, state_with_sealed


@pytest.fixture
def daemon(monkeypatch):
    d = broker_free_daemon(small_settings(), partitions=(0, 1))
    launched = []  # the fits the trigger step starts, recorded instead of run
    monkeypatch.setattr(d.fitter, "launch", lambda model, inf: launched.append((model, inf)))
    d.launched = launched
    return d


def test_restored_backlog_on_a_paused_partition_is_fitted_without_new_events(daemon):
    # as after a restore: sealed epochs, not dirty (no event arrived), no fit in flight
    st = state_with_sealed(daemon.s, MAX_SEALED + 1)
    daemon.registry.place(MODEL, st, 0)
    assert not daemon.registry.dirty and not daemon.registry.fitting()
    daemon.fitter.after_batch(time.monotonic())
    assert [m for m, _ in daemon.launched] == [MODEL]       # the oldest epoch's fit started
    assert daemon.launched[0][1].version == st.binmap_version + 1
    assert len(st.sealed) == MAX_SEALED                     # handed off to the fit
    # still backlogged: partition 0 (both topics) paused, partition 1 untouched
    assert daemon.partitions.paused() == {0}
    assert {tp.partition for tp in daemon.clients.consumer.paused} == {0}
    assert len(daemon.clients.consumer.paused) == 2


def test_pause_at_the_mark_and_resume_below_it(daemon):
    st = state_with_sealed(daemon.s, MAX_SEALED - 1)
    daemon.registry.place(MODEL, st, 1)
    daemon.fitter.apply_backpressure()
    assert not daemon.partitions.paused() and not daemon.clients.consumer.calls   # below the mark: nothing
    st.seal()
    assert st.backlogged
    daemon.fitter.apply_backpressure()
    daemon.fitter.apply_backpressure()                                # idempotent
    assert daemon.partitions.paused() == {1}
    assert [c for c, _ in daemon.clients.consumer.calls] == ["pause"]
    st.start_new_epoch()                                        # a fit took the oldest
    daemon.fitter.apply_backpressure()
    assert not daemon.partitions.paused() and not daemon.clients.consumer.paused
    assert [c for c, _ in daemon.clients.consumer.calls] == ["pause", "resume"]


def test_revoked_partition_is_neither_paused_nor_resumed(daemon):
    st = state_with_sealed(daemon.s, MAX_SEALED)
    daemon.registry.place(MODEL, st, 1)
    daemon.partitions.assign({tp for tp in daemon.partitions.assigned if tp.partition == 0})
    daemon.fitter.apply_backpressure()
    assert not daemon.partitions.paused() and not daemon.clients.consumer.calls
