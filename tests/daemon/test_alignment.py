"""The join's flow control between the input topics (:mod:`daemon.alignment`): the pure state
machine, the partition table's holds, and the adapter in a broker-free daemon (the consumer a
stand-in that records pause/resume and reports high watermarks). The end-to-end behaviour, a
backlog read through the embedded broker without a capacity eviction, is
``tests/integration/test_daemon_alignment.py``."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from daemon.alignment import HOLD_AT, RELEASE_AT, InputAlignment
from daemon.events import EventParser
from daemon.join import KIND_OUTCOME, KIND_PREDICTION, JoinStore
from daemon.model_state import ModelState
from daemon.partitions import PartitionTable
from daemon.settings import Settings
from tests.support.daemon_stubs import RecordingConsumer, broker_free_daemon

P, O = "preds", "outs"
MODEL, K = "al-a", 3


# ---------------------------------------------------------------- InputAlignment (pure)


def test_a_model_presses_from_half_full_until_a_quarter_full():
    a = InputAlignment()
    a.observe("m", 0, HOLD_AT - 0.01, 1)
    assert a.holds(lambda p, s: True) == {}
    a.observe("m", 0, HOLD_AT, 1)
    assert a.holds(lambda p, s: True) == {0: 1}
    a.observe("m", 0, (HOLD_AT + RELEASE_AT) / 2, 1)    # between the marks: still pressing
    assert a.holds(lambda p, s: True) == {0: 1}
    a.observe("m", 0, RELEASE_AT, 1)
    assert a.holds(lambda p, s: True) == {}


def test_a_hold_needs_the_other_topic_behind():
    a = InputAlignment()
    a.observe("m", 3, 0.9, 0)        # predictions lead: hold them while outcomes are behind
    asked = []

    def behind(part, stream):
        asked.append((part, stream))
        return answer

    for answer, want in ((True, {3: 0}), (False, {}), (None, {})):
        assert a.holds(behind) == want
    assert set(asked) == {(3, 0)}


def test_a_partition_pressed_on_both_topics_holds_neither():
    a = InputAlignment()
    a.observe("m1", 0, 0.9, 0)
    a.observe("m2", 0, 0.9, 1)
    a.observe("m3", 1, 0.9, 1)
    assert a.holds(lambda p, s: True) == {1: 1}
    a.forget(["m1"])
    assert a.holds(lambda p, s: True) == {0: 1, 1: 1}


def test_a_model_whose_lead_changes_or_vanishes_follows_it():
    a = InputAlignment()
    a.observe("m", 0, 0.9, 0)
    a.observe("m", 0, 0.4, 1)        # still above the release mark, the other stream leads
    assert a.holds(lambda p, s: True) == {0: 1}
    a.observe("m", 0, 0.4, None)     # no stream ahead: nothing to wait for
    assert a.holds(lambda p, s: True) == {}


def test_marks_are_validated():
    with pytest.raises(ValueError, match="release_at < hold_at"):
        InputAlignment(hold_at=0.3, release_at=0.3)


# ---------------------------------------------------------------- JoinStore.pressure


def test_join_pressure_is_pending_over_the_bound_and_the_stream_ahead():
    store = JoinStore(max_pending_per_model=10, ttl_seconds=1e9)
    assert store.pressure("m") == (0.0, None)
    store.offer("m", [KIND_OUTCOME] * 4, [f"e{i}" for i in range(4)],
                [100.0 + i for i in range(4)], None, [1] * 4)
    assert store.pressure("m") == (0.4, 1)               # outcomes read ahead: they wait
    probs = np.full((6, K), 1 / K)
    store.offer("m", [KIND_PREDICTION] * 6, [f"p{i}" for i in range(6)],
                [200.0 + i for i in range(6)], probs, [-1] * 6)
    assert store.pressure("m") == (1.0, 0)


# ---------------------------------------------------------------- PartitionTable holds


def _table(*parts):
    table = PartitionTable(refetch=True, grace_seconds=2.0)
    table.assign({TopicPartition(t, p) for p in parts for t in (P, O)})
    return table


def test_holds_and_backpressure_pause_the_union_and_resume_only_what_neither_wants():
    table = _table(0, 1)
    pause, resume = table.set_held({0: O})
    assert (pause, resume) == ({TopicPartition(O, 0)}, set())
    pause, resume = table.set_paused({0})                  # backpressure: both topics
    assert (pause, resume) == ({TopicPartition(P, 0)}, set())
    pause, resume = table.set_paused(set())                # fits caught up: outcomes stay held
    assert (pause, resume) == (set(), {TopicPartition(P, 0)})
    assert table.stopped() == {TopicPartition(O, 0)} and table.held() == {0: O}
    pause, resume = table.set_held({})
    assert (pause, resume) == (set(), {TopicPartition(O, 0)})


def test_an_assignment_clears_the_holds():
    table = _table(0)
    table.set_held({0: P})
    table.assign({TopicPartition(t, p) for p in (0, 1) for t in (P, O)})
    assert table.held() == {} and table.stopped() == set()


# ---------------------------------------------------------------- the adapter, broker-free


class HighwaterConsumer(RecordingConsumer):
    """Also reports high watermarks (``high``) and positions (``positions``: the consumer's,
    asked only for a partition the daemon has not read yet)."""

    def __init__(self):
        super().__init__()
        self.high: dict[TopicPartition, int] = {}
        self.positions: dict[TopicPartition, int] = {}

    def highwater(self, tp):
        return self.high.get(tp)

    async def position(self, tp):
        if tp not in self.positions:
            await asyncio.sleep(3600)  # a position being reset: the aligner does not wait
        return self.positions[tp]


def _settings(**join) -> Settings:
    return Settings(defaults={"mode": "paper"}, models={MODEL: {"k": K}},
                    join={"max_pending_per_model": 100, **join})


def _offer(d, kind: str, start: int, n: int) -> None:
    """Offer ``n`` events of ``kind`` (ids ``e{start}``...) to the model's state, as ingest
    does (the registry's touched list included)."""
    st = d.registry.slots[MODEL].state
    rng = np.random.default_rng(start)
    vals = []
    for i in range(start, start + n):
        ev = {"model": MODEL, "id": f"e{i}", "ts": 1000.0 + i + (5 if kind == "o" else 0)}
        if kind == "p":
            ev["probs"] = rng.dirichlet(np.ones(K)).tolist()
        else:
            ev["label"] = int(rng.integers(0, K))
        vals.append(orjson.dumps(ev))
    for mb in EventParser.from_settings(d.s).parse_batch(vals).by_model.values():
        st.offer(mb)
    d.registry.touched.add(MODEL)


@pytest.fixture
def daemon():
    s = _settings()
    d = broker_free_daemon(s, partitions=(0,))
    d.clients.consumer = HighwaterConsumer()
    d.registry.place(MODEL, ModelState.create(MODEL, K, s.model_settings(MODEL), s.join), 0)
    t = s.kafka.topics
    d.tp = {"p": TopicPartition(t.predictions, 0), "o": TopicPartition(t.outcomes, 0)}
    ps = d.partitions.ensure(0)
    ps.seek(t.predictions, 10)
    ps.seek(t.outcomes, 60)
    # the outcomes were read further in event time
    ps.event_times.update({t.predictions: 1_010.0, t.outcomes: 1_065.0})
    return d


async def test_outcomes_read_ahead_are_held_until_the_predictions_join_them(daemon):
    d, con = daemon, daemon.clients.consumer
    con.high = {d.tp["p"]: 500, d.tp["o"]: 500}           # records left on both
    _offer(d, "o", 0, 60)                                  # 60 of 100 pending: outcomes
    await d.aligner.after_batch(d.registry.touched)
    assert con.paused == {d.tp["o"]} and d.partitions.held() == {0: d.tp["o"].topic}
    _offer(d, "p", 0, 30)                                  # 30 pending: between the marks
    await d.aligner.after_batch(d.registry.touched)
    assert con.paused == {d.tp["o"]}
    _offer(d, "p", 30, 10)                                 # 20 pending: drained
    await d.aligner.after_batch(d.registry.touched)
    assert con.paused == set() and not d.partitions.held()
    assert [c for c, _ in con.calls] == ["pause", "resume"]


async def test_no_hold_once_the_other_topic_is_read_to_its_end(daemon):
    d, con = daemon, daemon.clients.consumer
    con.high = {d.tp["p"]: 10, d.tp["o"]: 500}             # predictions all read (position 10)
    _offer(d, "o", 0, 60)
    await d.aligner.after_batch(d.registry.touched)
    assert not con.calls                                   # their partners are not there yet
    con.high[d.tp["p"]] = 11                               # a new prediction arrives
    await d.aligner.after_batch(set())                           # the pressing model is kept
    assert con.paused == {d.tp["o"]}
    con.high = {}                                          # unknown: as read to the end
    await d.aligner.after_batch(set())
    assert con.paused == set()


async def test_no_hold_once_the_other_topic_is_read_up_to_the_same_time(daemon):
    # e.g. a model whose partners never come: the other topic keeps records to read (other
    # models'), but once it is read as far in time, holding back would stall the partition
    d, con = daemon, daemon.clients.consumer
    con.high = {d.tp["p"]: 500, d.tp["o"]: 500}
    _offer(d, "o", 0, 60)
    await d.aligner.after_batch(d.registry.touched)
    assert con.paused == {d.tp["o"]}
    d.partitions.get(0).event_times[d.tp["p"].topic] = 1_065.0  # predictions caught up in time
    await d.aligner.after_batch(set())
    assert con.paused == set() and not d.partitions.held()


async def test_a_released_model_stops_pressing_and_flow_control_can_be_off(daemon):
    d, con = daemon, daemon.clients.consumer
    con.high = {d.tp["p"]: 500, d.tp["o"]: 500}
    _offer(d, "o", 0, 60)
    await d.aligner.after_batch(d.registry.touched)
    assert con.paused == {d.tp["o"]}
    d.aligner.forget([MODEL])
    await d.aligner.after_batch(set())
    assert con.paused == set()

    off = broker_free_daemon(_settings(align_inputs=False), partitions=(0,))
    off.clients.consumer = HighwaterConsumer()
    off.clients.consumer.high = dict(con.high)
    off.registry.place(MODEL, ModelState.create(MODEL, K, off.s.model_settings(MODEL),
                                                off.s.join), 0)
    _offer(off, "o", 0, 90)
    await off.aligner.after_batch(off.registry.touched)
    assert not off.clients.consumer.calls


async def test_holds_are_counted(daemon):
    d, con = daemon, daemon.clients.consumer
    con.high = {d.tp["p"]: 500, d.tp["o"]: 500}
    _offer(d, "o", 0, 60)
    await d.aligner.after_batch(d.registry.touched)
    text = d.metrics.exposition().decode()
    assert 'lpcal_input_holds_total{topic="outcomes"} 1.0' in text
    assert 'lpcal_input_held_partitions{topic="outcomes"} 1.0' in text


async def test_a_partition_not_read_yet_is_asked_of_the_consumer(daemon):
    d, con = daemon, daemon.clients.consumer
    t = d.s.kafka.topics
    d.partitions.release({d.tp["p"]})          # forget the predictions' position ...
    d.partitions.assign(set(d.tp.values()))    # ... as before the partition's first batch
    d.partitions.ensure(0).seek(t.outcomes, 60)
    con.high = {d.tp["p"]: 500, d.tp["o"]: 500}
    _offer(d, "o", 0, 60)
    await d.aligner.after_batch(d.registry.touched)  # the consumer's position is being reset
    assert con.paused == set()
    con.positions[d.tp["p"]] = 0                      # known now: 500 records unread
    await d.aligner.after_batch(set())
    assert con.paused == {d.tp["o"]}
    con.positions[d.tp["p"]] = 500                    # read to its end
    await d.aligner.after_batch(set())
    assert con.paused == set()


class Msg:
    """The attributes ingest reads of an input record."""

    def __init__(self, value: bytes, offset: int, timestamp_ms: int):
        self.value, self.offset, self.timestamp, self.key = value, offset, timestamp_ms, None


def test_ingest_keeps_the_largest_event_time_read_per_topic():
    s = _settings()
    d = broker_free_daemon(s, partitions=(0,))
    tp = TopicPartition(s.kafka.topics.outcomes, 0)
    ts = [1_764_000_030.0, 1_764_000_050.0, 1_764_000_040.0]
    vals = [orjson.dumps({"model": MODEL, "id": f"e{i}", "ts": t, "label": 1})
            for i, t in enumerate(ts)]
    d.ingest.process(tp, [Msg(v, i, 1_764_000_100_000) for i, v in enumerate(vals)])
    assert d.partitions.get(0).event_times == {tp.topic: 1_764_000_050.0}
    d.ingest.process(tp, [Msg(vals[0], 3, 1_764_000_100_000)])  # an older one: kept as is
    assert d.partitions.get(0).event_times == {tp.topic: 1_764_000_050.0}
    assert d.partitions.position(tp.topic, 0) == 4
