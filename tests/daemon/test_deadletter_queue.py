"""Dead letters in batches, pipelined, bounded, none lost: unit tests of
:class:`daemon.kafka.deadletter.DeadLetterQueue` with a producer stand-in (aiokafka's own batch
builder, delivery futures the test resolves), and of the daemon's use of it. The timing on a real
broker is tests/reliability/test_deadletter_burst.py."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.producer.message_accumulator import BatchBuilder

from daemon.kafka.deadletter import DLQ_REASON, DLQ_SOURCE_OFFSET, DeadLetterQueue
from daemon.service import Daemon
from tests.support.daemon_stubs import small_settings

TOPIC = "dlq"


class StandInProducer:
    """``partitions_for``, ``create_batch`` (16 KiB, aiokafka's builder) and ``send_batch``,
    which records the batch and returns a delivery future; ``auto``: acknowledge at once."""

    def __init__(self, partitions: int = 2, auto: bool = True):
        self.partitions = partitions
        self.auto = auto
        self.sent: list[tuple[int, list[bytes], asyncio.Future]] = []
        self.fail_next = 0

    async def partitions_for(self, topic):
        assert topic == TOPIC
        return set(range(self.partitions))

    def create_batch(self):
        return RecordingBuilder()

    async def send_batch(self, batch, topic, *, partition):
        assert topic == TOPIC
        values = batch.values
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((partition, values, fut))
        if self.fail_next:
            self.fail_next -= 1
            fut.set_exception(ConnectionError("broker down"))
        elif self.auto:
            fut.set_result(None)
        return fut

    def delivered(self) -> list[tuple[int, bytes]]:
        return [(p, v) for p, vs, f in self.sent if f.done() and not f.cancelled()
                and f.exception() is None for v in vs]


class RecordingBuilder:
    """aiokafka's batch builder (its size limit), recording the values appended."""

    def __init__(self):
        self.builder = BatchBuilder(16384, 0)
        self.values: list[bytes] = []

    def append(self, **kw):
        meta = self.builder.append(**kw)
        if meta is not None:
            self.values.append(kw["value"])
        return meta


def _put(q: DeadLetterQueue, n: int, src: int = 0, size: int = 200, start: int = 0):
    for i in range(start, start + n):
        q.put(src, None, f"{i:06d}".encode().ljust(size, b"x"),
              [(DLQ_REASON, b"bad_json"), (DLQ_SOURCE_OFFSET, str(i).encode())])


async def test_dead_letters_go_in_batches_in_order_to_the_source_partition():
    prod = StandInProducer(partitions=2)
    q = DeadLetterQueue(prod, TOPIC)
    _put(q, 3000, src=0)
    _put(q, 1000, src=3, start=3000)
    assert len(q) == 4000
    await q.flush()
    assert len(q) == 0 and q.unacked_bytes == 0
    # about 16 KiB of 200-byte values per batch: some 50 batches, not 4000 sends
    assert len(prod.sent) <= 4000 * 300 // 16384 + 4, len(prod.sent)
    got = prod.delivered()
    assert [v[:6] for p, v in got if p == 0] == [f"{i:06d}".encode() for i in range(3000)]
    assert [v[:6] for p, v in got if p == 1] == [f"{i:06d}".encode() for i in range(3000, 4000)]


async def test_put_does_not_wait_and_the_sender_runs_beside_the_caller():
    prod = StandInProducer(auto=False)
    q = DeadLetterQueue(prod, TOPIC)
    _put(q, 1000)  # synchronous: nothing is sent until the caller yields
    assert prod.sent == []
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert prod.sent  # batches handed over while nothing is acknowledged yet: pipelined
    for _, _, f in prod.sent:
        f.set_result(None)
    await asyncio.wait_for(q.flush(), 5)


async def test_budget_applies_backpressure_and_drops_nothing():
    prod = StandInProducer(auto=False)
    q = DeadLetterQueue(prod, TOPIC, budget=50_000)
    _put(q, 400)  # about 180 KB with the per-record allowance
    assert q.over_budget
    waiter = asyncio.ensure_future(q.wait_for_room())
    await asyncio.sleep(0.05)
    assert not waiter.done()  # nothing acknowledged: the caller waits
    while not waiter.done():
        for _, _, f in prod.sent:
            if not f.done():
                f.set_result(None)
        await asyncio.sleep(0.01)
    assert not q.over_budget
    for _, _, f in prod.sent:
        if not f.done():
            f.set_result(None)
    await asyncio.wait_for(q.flush(), 5)
    assert sorted(v[:6] for _, v in prod.delivered()) == [f"{i:06d}".encode()
                                                          for i in range(400)]


async def test_stopping_ends_the_backpressure_wait():
    prod = StandInProducer(auto=False)
    q = DeadLetterQueue(prod, TOPIC, budget=1_000)
    _put(q, 20)
    stopping = asyncio.Event()
    waiter = asyncio.ensure_future(q.wait_for_room(stopping))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    stopping.set()
    await asyncio.wait_for(waiter, 1)


async def test_failed_dead_letters_are_resent_and_flush_raises_until_delivered():
    prod = StandInProducer()
    prod.fail_next = 2
    q = DeadLetterQueue(prod, TOPIC)
    _put(q, 500)
    with pytest.raises(RuntimeError, match="dead letters not delivered yet"):
        await q.flush()
    assert len(q) > 0  # kept, and re-sent
    await q.flush()
    assert len(q) == 0 and q.unacked_bytes == 0
    assert sorted(v[:6] for _, v in prod.delivered()) == [f"{i:06d}".encode()
                                                          for i in range(500)]


async def test_backpressure_resends_failures_when_nothing_is_in_flight():
    prod = StandInProducer()
    prod.fail_next = 10**6  # the broker is down
    q = DeadLetterQueue(prod, TOPIC, budget=10_000)
    _put(q, 100)
    waiter = asyncio.ensure_future(q.wait_for_room(retry_after=0.01))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    prod.fail_next = 0  # back: the next re-send goes through
    await asyncio.wait_for(waiter, 2)
    await q.flush()
    assert len(prod.delivered()) == 100


async def test_daemon_dead_letters_through_the_queue_counted_per_batch():
    s = small_settings()
    s.kafka.topics.deadletter = TOPIC
    d = Daemon(s)
    d.clients.producer = StandInProducer()

    class Msg:
        def __init__(self, offset):
            self.offset, self.key, self.value = offset, b"k", b"{bad"

    tp = TopicPartition("preds", 1)
    for i in range(300):
        d.deadletters.put(tp, Msg(i), "bad_json")
    await d.deadletters.after_batch(d.stopping)
    assert d.metrics.events_invalid.labels(reason="bad_json")._value.get() == 300
    assert d.metrics.deadletter_published._value.get() == 300
    await d.deadletters.flush()
    assert not d.deadletters.queue
    delivered = d.clients.producer.delivered()
    assert len(delivered) == 300 and {p for p, _ in delivered} == {1}
