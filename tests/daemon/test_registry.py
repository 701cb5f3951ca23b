"""The model registry (:mod:`daemon.registry`) and the retry helper (:mod:`daemon.retry`) on
their own, without a broker."""

from __future__ import annotations

import asyncio

import pytest

from daemon import retry
from daemon.events import EventParser
from daemon.metrics import DaemonMetrics
from daemon.registry import Inflight, ModelRegistry
from tests.support.daemon_stubs import MODEL, K, small_settings, state_with_sealed


@pytest.fixture
def reg():
    s = small_settings()
    return ModelRegistry(s, DaemonMetrics(max_models=s.max_models), EventParser.from_settings(s))


def test_views_follow_the_slots(reg):
    st = reg.create(MODEL, K, 2)
    slot = reg.get(MODEL)
    assert reg.states() == {MODEL: st} and slot.partition == 2
    assert not reg.fitting() and slot.prefitted == 0 and slot.event_time is None
    slot.inflight = inf = Inflight(st.pools, "manual", 1)
    assert reg.fitting() == {MODEL: inf} and [i.model for i in reg.snapshot()] == [MODEL]
    assert reg.snapshot()[0].fit_in_flight


def test_place_puts_a_prepared_state_without_metrics(reg):
    st = state_with_sealed(reg.s, 0)
    slot = reg.place(MODEL, st, 3)
    assert reg.get(MODEL) is slot and (slot.state, slot.partition) == (st, 3)
    assert not reg.dirty and not reg.touched and not reg.waiting
    other = state_with_sealed(reg.s, 1)
    assert reg.place(MODEL, other, 1) is slot and (slot.state, slot.partition) == (other, 1)


def test_park_then_unpark_keeps_the_state_further_along(reg):
    st = reg.create(MODEL, K, 1)
    st.advance_offsets("p", 1, 10)
    reg.release({1}, park=True)
    assert MODEL not in reg and MODEL in reg.parked
    older = state_with_sealed(reg.s, 0)
    older.advance_offsets("p", 1, 5)
    reg.restore(MODEL, older, 1, sample_rate=1.0, inflight=None, prefitted=0, dirty=False)
    reg.unpark({1})
    assert reg.get(MODEL).state is st and MODEL in reg.dirty and not reg.parked


def test_release_without_park_drops(reg):
    reg.create(MODEL, K, 0)
    reg.dirty.add(MODEL)
    reg.release({0}, park=False)
    assert not reg.slots and not reg.parked and not reg.dirty


async def test_retry_backs_off_then_returns():
    calls, delays = [], []

    async def attempt():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "ok"

    got = await retry.retry("x", attempt, stop=asyncio.Event(), first=0.001, cap=0.002,
                            on_error=lambda e, d: delays.append(d))
    assert got == "ok" and delays == [0.001, 0.002]


async def test_retry_stops_fatal_and_deadline():
    stop = asyncio.Event()
    stop.set()

    async def failing():
        raise ConnectionError("down")

    with pytest.raises(retry.Stopped):
        await retry.retry("x", failing, stop=stop)
    with pytest.raises(KeyError):
        async def fatal():
            raise KeyError("bad")
        await retry.retry("x", fatal, stop=asyncio.Event(), fatal=(KeyError,))
    with pytest.raises(ConnectionError):
        await retry.retry("x", failing, stop=asyncio.Event(), first=0.001, deadline=0.0)
