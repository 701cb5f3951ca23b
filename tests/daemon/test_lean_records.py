"""Lean input records (:mod:`daemon.kafka.lean_records`): a :data:`LEAN` consumer gets aiokafka's
decoded records with the attributes the daemon reads equal to the ``ConsumerRecord`` s any other
consumer gets from the same bytes, a batch at a time: every ``getall`` and ``getone`` returns the
records and leaves the position that aiokafka's own would; other consumers are untouched. Built
on real record batches (aiokafka's own builder, fetcher and assignment classes, compressed or
not, with and without headers, transactional and control batches); the daemon reading through
the embedded broker is every integration test."""

from __future__ import annotations

import struct

import pytest
from aiokafka import TopicPartition
from aiokafka.consumer import fetcher
from aiokafka.consumer.subscription_state import Assignment
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import ConsumerRecord

from daemon.kafka import lean_records
from daemon.kafka.lean_records import LEAN
from daemon.settings import Settings

TP = TopicPartition("preds", 3)
ATTRS = ("offset", "timestamp", "key", "value")  # what the daemon reads of an input record


def _batch(base: int, n: int, compression: int, headers: bool, *, producer: int = -1,
           control: bool = False, compacted: int = 0) -> bytes:
    """A record batch of ``n`` records at offsets ``base ..``; ``producer >= 0``: a
    transactional batch of that producer id; ``control``: its one record an abort marker;
    ``compacted``: that many offsets after its last record still belong to the batch (as
    after compaction removed its last records)."""
    b = DefaultRecordBatchBuilder(magic=2, compression_type=compression,
                                  is_transactional=int(producer >= 0), producer_id=producer,
                                  producer_epoch=0 if producer >= 0 else -1, base_sequence=-1,
                                  batch_size=1 << 20)
    for i in range(n):
        if control:  # version 0, type 0: ABORT
            b.append(i, timestamp=1_764_000_000_000, key=b"\x00\x00\x00\x00", value=b"",
                     headers=[])
            continue
        b.append(i, timestamp=1_764_000_000_000 + 7 * i,
                 key=None if i % 3 == 0 else f"model-{i % 5}".encode(),
                 value=None if i == n - 1 else f'{{"id": "e{base + i}"}}'.encode(),
                 headers=[("h", f"{i}".encode())] if headers else [])
    data = bytearray(b.build())
    struct.pack_into(">q", data, 0, base)  # the base offset (not covered by the CRC)
    if control:  # the control bit of the attributes
        struct.pack_into(">h", data, 21, struct.unpack_from(">h", data, 21)[0] | 0x20)
    if compacted:  # the last offset delta
        struct.pack_into(">i", data, 23, n - 1 + compacted)
    if control or compacted:  # the CRC over the attributes and what follows, again
        struct.pack_into(">I", data, 17, calc_crc32c(bytes(data[21:])))
    return bytes(data)


def _records(data: bytes, deserializer, fetch_offset: int = 0) -> list:
    pr = fetcher.PartitionRecords(TP, MemoryRecords(data), [], fetch_offset, None,
                                  deserializer, True, 0)
    return list(pr)


@pytest.mark.parametrize("compression", [0, 1])  # none, gzip
@pytest.mark.parametrize("headers", [False, True])
def test_lean_records_read_as_consumer_records(compression, headers):
    assert lean_records.install() and lean_records.installed()
    data = _batch(0, 50, compression, headers)
    plain = _records(data, None)
    lean = _records(data, LEAN)
    assert len(plain) == len(lean) == 50
    assert all(isinstance(r, ConsumerRecord) for r in plain)
    assert not any(isinstance(r, ConsumerRecord) for r in lean)  # no wrapper built
    for p, q in zip(plain, lean):
        assert tuple(getattr(p, a) for a in ATTRS) == tuple(getattr(q, a) for a in ATTRS)
    assert plain[-1].value is None and lean[-1].value is None
    # a fetch from the middle of a batch skips the same records either way
    assert [r.offset for r in _records(data, LEAN, 20)] == list(range(20, 50))


def test_other_consumers_keep_consumer_records_and_lean_is_an_identity_without_it():
    lean_records.install()
    data = _batch(0, 5, 0, False)
    other = _records(data, lambda v: v)  # any other deserializer: wrapped as before
    assert all(isinstance(r, ConsumerRecord) for r in other)
    assert LEAN(b"x") == b"x"  # where aiokafka's internals differ, LEAN deserializes as None would


def test_the_daemon_consumer_opts_in_unless_turned_off():
    import asyncio

    from daemon.clients import KafkaClients
    from daemon.metrics import DaemonMetrics

    def options(**kafka):
        s = Settings(kafka=kafka)
        return KafkaClients(s, DaemonMetrics(), asyncio.Event(), None).consumer_options()

    assert options()["value_deserializer"] is LEAN
    assert "value_deserializer" not in options(lean_records=False)


# --------------------------------------------------------------------------- a batch at a time
async def _drain(data: bytes, deserializer, fetch_offset: int, max_records: int | None,
                 isolation: int = 0, aborted=(), one: bool = False) -> list:
    """Every ``getall(max_records)`` (``one``: ``getone()``) of one fetch result until it is
    used up: per call the records' attributes, the consumer's position after it and whether
    the result still had records."""
    assignment = Assignment([TP])
    assignment.state_value(TP).reset_to(fetch_offset)
    pr = fetcher.PartitionRecords(TP, MemoryRecords(data), list(aborted), fetch_offset, None,
                                  deserializer, True, isolation)
    result = fetcher.FetchResult(TP, assignment=assignment, partition_records=pr, backoff=0)
    calls = []
    for _ in range(10_000):
        if not result.has_more():
            return calls
        got = result.getone() if one else result.getall(max_records)
        recs = [] if got is None else [got] if one else got
        calls.append(([tuple(getattr(r, a) for a in ATTRS) for r in recs],
                      assignment.state_value(TP).position, result.has_more()))
    raise AssertionError("the fetch result never ran out")


def _batches(compression: int, headers: bool, first: int = 0) -> bytes:
    """Batches of offsets 0-39, 40-44 and 45-104, from the one holding offset ``first`` (a
    broker's fetch response begins with the batch that holds the fetch offset), then offsets
    105-109 of a batch that ends at 112 (its last records compacted away)."""
    spans = [(0, 40), (40, 5), (45, 60)]
    return (b"".join(_batch(a, n, compression, headers) for a, n in spans if a + n > first)
            + _batch(105, 5, compression, headers, compacted=3))


@pytest.mark.parametrize("compression", [0, 1])
@pytest.mark.parametrize("max_records", [None, 1, 7, 40, 45, 5000])
async def test_getall_takes_whole_batches_as_aiokafka_hands_out_records(compression,
                                                                        max_records):
    assert lean_records.install()
    for fetch_offset in (0, 23, 44, 45):  # from a batch's start or middle, or its last record
        data = _batches(compression, compression == 1, fetch_offset)
        plain = await _drain(data, None, fetch_offset, max_records)
        lean = await _drain(data, LEAN, fetch_offset, max_records)
        assert lean == plain
        offsets = [r[0] for recs, _, _ in lean for r in recs]
        assert offsets == list(range(fetch_offset, 110))
        assert lean[-1][1] == 113  # past the compacted batch


async def test_getone_and_getall_share_one_position():
    lean_records.install()
    data = _batches(0, False)
    assert await _drain(data, LEAN, 3, None, one=True) == await _drain(data, None, 3, None,
                                                                       one=True)
    # getone, then getall, on one result: each record once, in order
    assignment = Assignment([TP])
    assignment.state_value(TP).reset_to(0)
    pr = fetcher.PartitionRecords(TP, MemoryRecords(data), [], 0, None, LEAN, True, 0)
    result = fetcher.FetchResult(TP, assignment=assignment, partition_records=pr, backoff=0)
    first = result.getone()
    rest = result.getall(30) + result.getall()
    assert [first.offset] + [r.offset for r in rest] == list(range(110))
    assert not result.has_more() and assignment.state_value(TP).position == 113


async def test_aborted_transactions_and_control_batches_are_skipped_as_aiokafka_skips_them():
    lean_records.install()
    data = (_batch(0, 5, 0, False, producer=7) + _batch(5, 1, 0, False, producer=7,
                                                        control=True)
            + _batch(6, 4, 0, False) + _batch(10, 3, 0, False, producer=8)
            + _batch(13, 1, 0, False, producer=8, control=True) + _batch(14, 2, 0, False)
            + _batch(16, 2, 0, False, producer=7))  # producer 7's next transaction
    for isolation in (0, 1):  # read_uncommitted, read_committed
        for max_records in (None, 2):
            plain = await _drain(data, None, 0, max_records, isolation, aborted=[(7, 0)])
            lean = await _drain(data, LEAN, 0, max_records, isolation, aborted=[(7, 0)])
            assert lean == plain
            offsets = [r[0] for recs, _, _ in lean for r in recs]
            # producer 7's first transaction aborted: left out when reading committed records
            # only, up to its abort marker
            assert offsets == ([6, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17] if isolation else
                               [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16, 17])
            assert lean[-1][1] == 18


async def test_a_corrupt_batch_raises_and_the_fetch_restarts_where_the_call_began():
    lean_records.install()
    good = _batch(0, 10, 0, False)
    bad = bytearray(_batch(10, 10, 0, False))
    at = bad.index(b'"e15"') + 1
    bad[at:at + 1] = b"f"  # a byte of a record's value: it decodes, its CRC no longer matches
    data = good + bytes(bad) + _batch(20, 5, 0, False)
    assignment = Assignment([TP])
    assignment.state_value(TP).reset_to(0)
    pr = fetcher.PartitionRecords(TP, MemoryRecords(data), [], 0, None, LEAN, True, 0)
    result = fetcher.FetchResult(TP, assignment=assignment, partition_records=pr, backoff=0)
    assert [r.offset for r in result.getall(4)] == [0, 1, 2, 3]
    with pytest.raises(CorruptRecordException):
        result.getall()  # records 4 to 9 were taken before the corrupt batch: not handed out
    # the records' position is back where the failed call began: the refetch hands out 4 to 9
    assert pr.next_fetch_offset == 4
    assert result.getall() == [] and not result.has_more()
    assert assignment.state_value(TP).position == 4


async def test_used_up_records_are_freed_without_the_cyclic_collector():
    """aiokafka creates its record generator with the records object; left unstarted, the two
    form a cycle that holds the fetch response's bytes until a cyclic collection (the daemon
    runs them rarely): the lean path closes it."""
    import gc
    import weakref

    lean_records.install()
    assignment = Assignment([TP])
    assignment.state_value(TP).reset_to(0)
    pr = fetcher.PartitionRecords(TP, MemoryRecords(_batches(0, False)), [], 0, None, LEAN,
                                  True, 0)
    result = fetcher.FetchResult(TP, assignment=assignment, partition_records=pr, backoff=0)
    gone = weakref.ref(pr)
    gc.disable()
    try:
        del pr
        assert len(result.getall()) == 110 and not result.has_more()
        del result
        assert gone() is None
    finally:
        gc.enable()
