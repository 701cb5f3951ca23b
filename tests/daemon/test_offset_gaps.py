"""Holes in fetched input offsets (:mod:`daemon.offset_gaps`): the pure guard, and the daemon's
main loop driven by a consumer stand-in that, like the embedded Tansu broker under load, hands
out a record batch while an earlier one is not visible yet.

The fault itself was measured on the real broker with a plain aiokafka consumer (see the
module docstring of :mod:`daemon.offset_gaps`); it is too rare to reproduce on demand, so the
daemon's handling is tested here against a scripted log."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from daemon.offset_gaps import Hole, OffsetGapGuard, find_hole
from daemon.service import Daemon
from daemon.settings import Settings
from tests.support.daemon_stubs import MODEL, K, RecordingConsumer

# ------------------------------------------------------------------ the pure guard


def offsets_of(*ranges):
    return lambda: [o for r in ranges for o in r]


def test_find_hole_contiguous_leading_internal_and_unknown_position():
    assert find_hole(5, 5, 9, 5, offsets_of(range(5, 10))) is None
    assert find_hole(5, 8, 12, 5, offsets_of(range(8, 13))) == Hole(0, 5, 8)
    assert find_hole(0, 0, 29, 20, offsets_of(range(10), range(20, 30))) == Hole(10, 10, 20)
    # first fetch after a reset: no expected position, only holes inside the batch count
    assert find_hole(None, 7, 9, 3, offsets_of(range(7, 10))) is None
    assert find_hole(None, 7, 12, 3, offsets_of([7, 8, 12])) == Hole(2, 9, 12)
    assert find_hole(3, 3, 3, 0, offsets_of()) is None


def test_contiguous_batches_never_scan_the_offsets():
    def boom():
        raise AssertionError("offsets scanned for a contiguous batch")
    g = OffsetGapGuard(refetch=True)
    v = g.check("p0", 100, 100, 4099, 4000, boom, now=0.0)
    assert (v.keep, v.seek, v.hole, v.filled, v.skipped) == (4000, None, None, 0, 0)


def test_count_policy_processes_everything_and_counts_the_hole():
    g = OffsetGapGuard(refetch=False)
    v = g.check("p0", 0, 0, 29, 20, offsets_of(range(10), range(20, 30)), now=0.0)
    assert (v.keep, v.seek, v.skipped, v.filled) == (20, None, 1, 0)
    assert v.hole.size == 10 and g.open_holes == 0


def test_refetch_keeps_the_records_before_the_hole_then_counts_it_filled():
    g = OffsetGapGuard(refetch=True, grace_seconds=2.0)
    v = g.check("p0", 0, 0, 29, 20, offsets_of(range(10), range(20, 30)), now=0.0)
    assert (v.keep, v.seek, v.skipped, v.filled) == (10, 10, 0, 0)
    # read again from 10, still hidden: the same hole, nothing kept, seek again
    v = g.check("p0", 10, 20, 29, 10, offsets_of(range(20, 30)), now=0.5)
    assert (v.keep, v.seek, v.skipped, v.filled) == (0, 10, 0, 0)
    # now visible: contiguous from 10, the hole is filled (counted once)
    v = g.check("p0", 10, 10, 29, 20, offsets_of(range(10, 30)), now=0.6)
    assert (v.keep, v.seek, v.skipped, v.filled) == (20, None, 0, 1)
    assert (v.closed.start, v.closed.end) == (10, 20) and g.open_holes == 0
    v = g.check("p0", 30, 30, 31, 2, offsets_of(range(30, 32)), now=0.7)
    assert (v.filled, v.skipped) == (0, 0)


def test_refetch_accepts_a_hole_that_persists_for_the_grace_period():
    g = OffsetGapGuard(refetch=True, grace_seconds=2.0)
    hidden = offsets_of(range(20, 30))
    assert g.check("p0", 10, 20, 29, 10, hidden, now=100.0).seek == 10
    assert g.check("p0", 10, 20, 29, 10, hidden, now=101.9).seek == 10
    v = g.check("p0", 10, 20, 29, 10, hidden, now=102.0)  # e.g. a transaction marker
    assert (v.keep, v.seek, v.skipped, v.filled) == (10, None, 1, 0)
    assert g.open_holes == 0


def test_a_partly_filled_hole_closes_and_the_rest_opens_a_new_one():
    g = OffsetGapGuard(refetch=True)
    assert g.check("p0", 0, 20, 29, 10, offsets_of(range(20, 30)), now=0.0).seek == 0
    # 0..9 arrived, 10..19 still hidden
    v = g.check("p0", 0, 0, 29, 20, offsets_of(range(10), range(20, 30)), now=0.1)
    assert (v.keep, v.seek, v.filled) == (10, 10, 1)
    assert g.open_holes == 1


def test_partitions_are_independent_and_forget_drops_an_open_hole():
    g = OffsetGapGuard(refetch=True)
    g.check("a", 0, 5, 9, 5, offsets_of(range(5, 10)), now=0.0)
    v = g.check("b", 0, 0, 4, 5, offsets_of(range(5)), now=0.0)
    assert (v.filled, v.seek) == (0, None) and g.open_holes == 1
    g.forget("a")
    assert g.open_holes == 0
    with pytest.raises(ValueError, match="grace_seconds"):
        OffsetGapGuard(refetch=True, grace_seconds=-1)


# ------------------------------------------------------------------ the daemon's main loop

N = 30
HIDDEN = range(10, 20)  # the batch appended last but not yet visible


class ScriptedLog(RecordingConsumer):
    """One partition holding ``N`` complete samples. Offsets in ``HIDDEN`` stay invisible for
    the first ``hidden_for`` fetches; the daemon stops once it has read to the end."""

    def __init__(self, daemon: Daemon, tp: TopicPartition, hidden_for: int):
        super().__init__()
        self.daemon, self.tp, self.hidden_for = daemon, tp, hidden_for
        self.position, self.fetches, self.seeks = 0, 0, []
        rng = np.random.default_rng(1)
        probs, labels = rng.dirichlet(np.ones(K), size=N), rng.integers(0, K, size=N)
        self.log = [ConsumerRecord(
            tp.topic, tp.partition, o, 1_764_000_000_000 + o, 0, MODEL.encode(),
            orjson.dumps({"model": MODEL, "id": f"g{o}", "ts": 1_764_000_000.0 + o,
                          "probs": probs[o].tolist(), "label": int(labels[o])}),
            None, 0, 0, ()) for o in range(N)]

    async def getmany(self, timeout_ms=0, max_records=None):
        await asyncio.sleep(0.002)
        self.fetches += 1
        visible = [r for r in self.log[self.position:]
                   if self.fetches > self.hidden_for or r.offset not in HIDDEN]
        if not visible:
            self.daemon.stopping.set()
            return {}
        self.position = visible[-1].offset + 1
        return {self.tp: visible}

    def seek(self, tp, offset):
        assert tp == self.tp
        self.seeks.append(offset)
        self.position = offset


def run_loop(policy: str, hidden_for: int, grace: float = 2.0) -> tuple[Daemon, ScriptedLog]:
    s = Settings(kafka={"offset_gaps": policy, "offset_gap_grace_seconds": grace},
                 state={"checkpoint_interval_seconds": 3600.0},
                 defaults={"drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                 models={MODEL: {"k": K}})
    d = Daemon(s)
    tp = TopicPartition(s.kafka.topics.predictions, 0)
    d.clients.consumer = ScriptedLog(d, tp, hidden_for)
    d.partitions.assign({tp})
    d.partitions.ensure(0).seek(tp.topic, 0)
    asyncio.run(asyncio.wait_for(d.main_loop(), 10))
    return d, d.clients.consumer


def gaps(d: Daemon, resolution: str) -> float:
    return d.metrics.registry.get_sample_value(
        "lpcal_input_offset_gaps_total", {"topic": "predictions", "resolution": resolution})


def test_refetch_reads_the_hidden_batch_again_and_loses_nothing():
    d, c = run_loop("refetch", hidden_for=1)
    assert c.seeks == [10]                       # back to the hole, once
    assert d.registry.slots[MODEL].state.samples_total == N    # every sample...
    assert not d.metrics.registry.get_sample_value(  # ...none offered twice (20..29)
        "lpcal_join_unmatched_total", {"model": MODEL, "kind": "duplicate"})
    assert (gaps(d, "filled"), gaps(d, "skipped")) == (1, 0)
    assert d.partitions.position(c.tp.topic, 0) == N


def test_refetch_gives_up_on_a_hole_that_never_fills():
    d, c = run_loop("refetch", hidden_for=10**9, grace=0.05)
    assert len(c.seeks) >= 2 and set(c.seeks) == {10}
    assert d.registry.slots[MODEL].state.samples_total == N - len(HIDDEN)
    assert (gaps(d, "filled"), gaps(d, "skipped")) == (0, 1)


def test_count_policy_goes_on_and_counts_the_hole():
    d, c = run_loop("count", hidden_for=1)
    assert c.seeks == []
    assert d.registry.slots[MODEL].state.samples_total == N - len(HIDDEN)  # what a broker fault costs
    assert (gaps(d, "filled"), gaps(d, "skipped")) == (0, 1)


# ------------------------------------------------------------------ Ingest with a given clock

def test_ingest_reads_a_hole_again_until_its_grace_period_ends_on_the_given_clock():
    """``Ingest.up_to_hole`` with the offset-gap guard's time from an injected clock: before
    the grace period it seeks back to the hole and keeps the records before it; after it, it
    goes on with the whole batch and counts the hole as skipped."""
    import asyncio

    from daemon.clients import KafkaClients
    from daemon.events import EventParser
    from daemon.ingest import DeadLetters, Ingest
    from daemon.metrics import DaemonMetrics
    from daemon.partitions import PartitionTable
    from daemon.registry import ModelRegistry

    s = Settings(kafka={"offset_gaps": "refetch", "offset_gap_grace_seconds": 2.0})
    metrics = DaemonMetrics(max_models=s.max_models)
    parser = EventParser.from_settings(s)
    clients = KafkaClients(s, metrics, asyncio.Event())
    seeks = []

    class Seeking(RecordingConsumer):
        def seek(self, tp, offset):
            seeks.append(offset)

    clients.consumer = Seeking()
    table = PartitionTable.from_settings(s)
    now = [100.0]
    ingest = Ingest(s, ModelRegistry(s, metrics, parser), table, parser, metrics, clients,
                    DeadLetters(clients, metrics, "dl"), clock=lambda: now[0])
    tp = TopicPartition(s.kafka.topics.predictions, 0)
    table.ensure(0).seek(tp.topic, 0)

    class Rec:
        def __init__(self, offset):
            self.offset = offset

    batch = [Rec(o) for o in (0, 1, 2, 6, 7)]  # 3..5 missing
    assert [r.offset for r in ingest.up_to_hole(tp, batch)] == [0, 1, 2] and seeks == [3]
    now[0] += 1.9  # within the grace period: read again
    assert [r.offset for r in ingest.up_to_hole(tp, batch)] == [0, 1, 2] and seeks == [3, 3]
    now[0] += 0.2  # past it: go on without 3..5
    assert ingest.up_to_hole(tp, batch) is batch and seeks == [3, 3]
    assert gaps_of(metrics, "skipped") == 1


def gaps_of(metrics, resolution: str) -> float:
    return metrics.registry.get_sample_value(
        "lpcal_input_offset_gaps_total", {"topic": "predictions", "resolution": resolution})
