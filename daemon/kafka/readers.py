"""Reading Kafka topics: every record from the beginning, the last value per key of a compacted
topic, the record at a position ``topic[partition]@offset``, and consumer lag (see
:mod:`daemon.kafka` for what the embedded broker supports, in particular its under-reported end
offsets).

API::

    records = await read_records(bootstrap, "preds", timeout=10)      # [ConsumerRecord, ...]
    latest = await read_compacted_latest(bootstrap, "binmaps", timeout=10)  # {key: value}
    where = format_position("binmaps", 0, 41)           # "binmaps[0]@41"
    parse_position(where)                               # ("binmaps", 0, 41); None if malformed
    ts = await record_timestamp(bootstrap, where)       # Unix seconds, or None
    lag = await end_offsets_lag(consumer)               # sum over assigned partitions
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError

from daemon.kafka.clients import make_consumer
from daemon.kafka.topics import TopicMissingError

__all__ = [
    "end_offsets_lag",
    "format_position",
    "parse_position",
    "partition_lags",
    "read_compacted_latest",
    "read_records",
    "record_timestamp",
]

log = logging.getLogger("lpcal.kafka")

_POSITION = re.compile(r"^(?P<topic>.+)\[(?P<partition>\d+)\]@(?P<offset>\d+)$")


def format_position(topic: str, partition: int, offset: int) -> str:
    """Where a record was read, as ``topic[partition]@offset`` (logs, checkpoints, errors)."""
    return f"{topic}[{partition}]@{offset}"


def parse_position(position: str) -> tuple[str, int, int] | None:
    """``(topic, partition, offset)`` of a :func:`format_position` string, or None when
    ``position`` is not of that form."""
    m = _POSITION.match(position)
    if m is None:
        return None
    return m["topic"], int(m["partition"]), int(m["offset"])


async def _scan(bootstrap: str, topic: str, timeout: float,
                on_records: Callable[[TopicPartition, list[Any]], None], *, security: Any,
                client_id: str) -> bool:
    """Fetch ``topic`` from the beginning at least up to its end offsets (taken at the start),
    handing each fetched list of records of a partition to ``on_records``, in offset order per
    partition. Records fetched past the end offsets are handed over too: they are newer, and
    Tansu under-reports end offsets after multi-record batches. False when the topic does not
    exist; ``TimeoutError`` when the end is not reached within ``timeout`` seconds."""
    consumer = make_consumer(bootstrap, group_id=None, security=security, client_id=client_id)
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            await consumer.topics()  # all-topics metadata: does not auto-create
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                return False
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.seek_to_beginning(*tps)
            pending = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
            while pending:
                batch = await consumer.getmany(*pending, timeout_ms=200)
                for tp, msgs in batch.items():
                    on_records(tp, msgs)
                for tp in list(pending):
                    if await consumer.position(tp) >= ends[tp]:
                        pending.discard(tp)
        finally:
            await consumer.stop()
    return True


async def read_records(bootstrap: str, topic: str, timeout: float = 30.0, *,
                       security: Any = None, missing_ok: bool = False,
                       client_id: str = "lpcal-topic-reader") -> list[Any]:
    """Every record of ``topic`` from the beginning at least up to its end offsets (taken at the
    start), as aiokafka ``ConsumerRecord`` objects, partition by partition in fetch order
    (offset order within a partition).

    Records fetched past the end offsets are kept: Tansu reports the end offset after a
    multi-record batch as the batch's base offset + 1, so cutting there would drop all but the
    first record of the last batch; fetches return whole batches, so every record written
    before the call is returned. Raises :class:`~daemon.kafka.topics.TopicMissingError` when
    the topic does not exist (unless ``missing_ok``: then ``[]``), ``TimeoutError`` when the
    end is not reached within ``timeout`` seconds.
    """
    out: list[Any] = []
    found = await _scan(bootstrap, topic, timeout, lambda _tp, msgs: out.extend(msgs),
                        security=security, client_id=client_id)
    if not found and not missing_ok:
        raise TopicMissingError(f"read_records: topic {topic!r} does not exist")
    return out


async def read_compacted_latest(bootstrap: str, topic: str, timeout: float = 30.0, *,
                                security: Any = None, decode_keys: bool = True,
                                missing_ok: bool = False, where: dict[Any, str] | None = None,
                                timestamps: dict[Any, float] | None = None,
                                client_id: str = "lpcal-compacted-reader") -> dict[Any, bytes]:
    """Read ``topic`` from the beginning at least up to its end offsets (taken at the start)
    and return the last value per key; a tombstone (value ``None``) deletes its key. Records
    fetched past the end offsets (same fetch) are applied too, as newer values.

    This is the view a compacted topic converges to, whether or not the broker has compacted
    yet. Keys are ``str`` (UTF-8) when ``decode_keys`` (undecodable and missing keys are
    skipped with a warning), else ``bytes``. Values are returned as read (nothing is decoded),
    and a value replaced by a later one is dropped as soon as the later one is read. ``where``
    (a dict), if given, is filled with the position each returned value was read at
    (:func:`format_position`), and ``timestamps`` with its record timestamp (Unix seconds).
    Raises :class:`~daemon.kafka.topics.TopicMissingError` when the topic does not exist
    (unless ``missing_ok``: then ``{}``), ``TimeoutError`` when the end is not reached within
    ``timeout`` seconds.
    """
    latest: dict[Any, bytes] = {}
    skipped = 0

    def apply(tp: TopicPartition, msgs: list[Any]) -> None:
        nonlocal skipped
        for m in msgs:
            key: Any = m.key
            if key is None:
                skipped += 1
                continue
            if decode_keys:
                try:
                    key = key.decode("utf-8")
                except UnicodeDecodeError:
                    skipped += 1
                    continue
            if m.value is None:
                latest.pop(key, None)
                if where is not None:
                    where.pop(key, None)
                if timestamps is not None:
                    timestamps.pop(key, None)
            else:
                latest[key] = m.value
                if where is not None:
                    where[key] = format_position(topic, tp.partition, m.offset)
                if timestamps is not None:
                    timestamps[key] = m.timestamp / 1000.0

    found = await _scan(bootstrap, topic, timeout, apply, security=security,
                        client_id=client_id)
    if not found:
        if missing_ok:
            return {}
        raise TopicMissingError(f"read_compacted_latest: topic {topic!r} does not exist")
    if skipped:
        log.warning("read_compacted_latest %s: skipped %d records without a usable key",
                    topic, skipped)
    return latest


async def record_timestamp(bootstrap: str, position: str, *, security: Any = None,
                           timeout: float = 10.0, fetch_bytes: int = 1 << 20) -> float | None:
    """The timestamp (Unix seconds) of the record at ``position``, ``topic[partition]@offset``
    (as :func:`read_compacted_latest` reports positions), or None when there is no such
    record or ``position`` is not of that form."""
    parsed = parse_position(position)
    if parsed is None:
        return None
    topic, partition, offset = parsed
    tp = TopicPartition(topic, partition)
    consumer = make_consumer(bootstrap, group_id=None, security=security,
                             client_id="lpcal-timestamp-reader",
                             max_partition_fetch_bytes=max(fetch_bytes, 1 << 20) + (64 << 10))
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            consumer.assign([tp])
            end = (await consumer.end_offsets([tp]))[tp]
            if offset >= end + 1:  # Tansu reports the last batch's base offset + 1
                return None
            consumer.seek(tp, offset)
            while True:
                for rec in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                    if rec.offset == offset:
                        return rec.timestamp / 1000.0
                    if rec.offset > offset:
                        return None
        finally:
            await consumer.stop()


async def partition_lags(consumer: AIOKafkaConsumer,
                         partitions: Iterable[TopicPartition] | None = None,
                         ) -> dict[TopicPartition, int]:
    """``end offset - position`` (>= 0) of each assigned partition (or of ``partitions``).

    Partitions revoked while this runs are left out.
    """
    tps = list(partitions if partitions is not None else consumer.assignment())
    if not tps:
        return {}
    ends = await consumer.end_offsets(tps)
    lags = {}
    for tp in tps:
        try:
            pos = await consumer.position(tp)
        except IllegalStateError:  # no longer assigned (rebalance)
            continue
        lags[tp] = max(0, int(ends[tp]) - int(pos))
    return lags


async def end_offsets_lag(consumer: AIOKafkaConsumer) -> int:
    """Total consumer lag: sum over assigned partitions of ``end offset - position``."""
    return sum((await partition_lags(consumer)).values())
