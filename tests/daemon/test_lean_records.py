"""Lean input records (:mod:`daemon.kafka.lean_records`): a :data:`LEAN` consumer gets aiokafka's
decoded records with the attributes the daemon reads equal to the ``ConsumerRecord`` s any other
consumer gets from the same bytes; other consumers are untouched. Built on real record batches
(aiokafka's own builder and fetcher classes, compressed or not, with and without headers); the
daemon reading through the embedded broker is every integration test."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka.consumer import fetcher
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord

from daemon.kafka import lean_records
from daemon.kafka.lean_records import LEAN
from daemon.settings import Settings

TP = TopicPartition("preds", 3)
ATTRS = ("offset", "timestamp", "key", "value")  # what the daemon reads of an input record


def _batch(base: int, n: int, compression: int, headers: bool) -> bytes:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=compression, is_transactional=0,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                  batch_size=1 << 20)
    for i in range(n):
        b.append(i, timestamp=1_764_000_000_000 + 7 * i,
                 key=None if i % 3 == 0 else f"model-{i % 5}".encode(),
                 value=None if i == n - 1 else f'{{"id": "e{base + i}"}}'.encode(),
                 headers=[("h", f"{i}".encode())] if headers else [])
    return bytes(b.build())


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
