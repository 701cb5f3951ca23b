"""The due-time heap of time-based per-model work (:class:`daemon.due_times.DueTimes`)."""

from __future__ import annotations

import random

import pytest

from daemon.due_times import DueTimes


def test_keys_come_out_when_due_earliest_first_and_once():
    d = DueTimes()
    d.schedule("b", 2.0)
    d.schedule("a", 1.0)
    d.schedule("c", 3.0)
    assert d.pop_due(0.5) == []
    assert d.next_due() == 1.0
    assert d.pop_due(2.0) == ["a", "b"]
    assert d.pop_due(2.5) == []
    assert len(d) == 1 and "c" in d and "a" not in d
    assert d.pop_due(10.0) == ["c"]
    assert d.next_due() is None


def test_rescheduling_replaces_and_earliest_keeps_the_sooner():
    d = DueTimes()
    d.schedule("m", 5.0)
    d.schedule("m", 1.0)
    assert d.due_at("m") == 1.0
    d.schedule("m", 3.0, earliest=True)  # later: kept at 1.0
    assert d.due_at("m") == 1.0
    d.schedule("m", 4.0)                 # replaced
    assert d.pop_due(2.0) == []
    assert d.pop_due(4.0) == ["m"]
    assert d.pop_due(100.0) == []        # the stale entries at 1.0 and 5.0 are not handed out


def test_cancel_and_limit():
    d = DueTimes()
    for i in range(10):
        d.schedule(i, float(i))
    assert d.cancel(3) and not d.cancel(3)
    assert d.pop_due(100.0, limit=4) == [0, 1, 2, 4]
    assert d.pop_due(100.0) == [5, 6, 7, 8, 9]


def test_heap_stays_proportional_to_the_keys():
    """Rescheduling the same keys over and over does not grow the heap without bound."""
    d = DueTimes()
    for t in range(10_000):
        d.schedule(t % 10, float(t))
    assert len(d) == 10
    assert len(d._heap) <= 2 * 10 + 64 + 1


def test_matches_a_brute_force_schedule():
    rng = random.Random(5)
    d, ref = DueTimes(), {}
    now = 0.0
    for _ in range(5000):
        op = rng.random()
        key = rng.randrange(50)
        if op < 0.5:
            when = now + rng.uniform(0, 10)
            early = rng.random() < 0.3
            d.schedule(key, when, earliest=early)
            if not (early and key in ref and ref[key] <= when):
                ref[key] = when
        elif op < 0.6:
            assert d.cancel(key) == (ref.pop(key, None) is not None)
        else:
            now += rng.uniform(0, 2)
            want = sorted((t, k) for k, t in ref.items() if t <= now)
            got = d.pop_due(now)
            assert sorted(got) == sorted(k for _, k in want)
            assert [ref[k] for k in got] == sorted(ref[k] for k in got)  # earliest first
            for k in got:
                del ref[k]
        assert len(d) == len(ref)


def test_nan_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        DueTimes().schedule("m", float("nan"))
