"""Dead letters: the raw bytes of rejected records, sent to the dead-letter topic with headers
that say why and where from; :class:`DeadLetterQueue` batches and pipelines them in bounded
memory.

API::

    await publish_deadletter(producer, "lpcal.deadletter", raw, "bad_json", "preds", 2, 1041)
    dlq = DeadLetterQueue(producer, "lpcal.deadletter")     # batched, pipelined, bounded
    dlq.put(2, key, raw, headers); await dlq.wait_for_room(); await dlq.flush()
    deadletter_info(record.headers)   # {reason, source_topic, source_partition, source_offset}
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer

from lpcal.errors import InputError

__all__ = [
    "DLQ_MAX_UNSENT_BYTES",
    "DLQ_REASON",
    "DLQ_SOURCE_OFFSET",
    "DLQ_SOURCE_PARTITION",
    "DLQ_SOURCE_TOPIC",
    "DeadLetterQueue",
    "deadletter_info",
    "publish_deadletter",
]

log = logging.getLogger("lpcal.kafka")

#: Header names of a dead letter (values: UTF-8 text, the partition and offset in decimal).
DLQ_REASON = "lpcal.reason"
DLQ_SOURCE_TOPIC = "lpcal.source.topic"
DLQ_SOURCE_PARTITION = "lpcal.source.partition"
DLQ_SOURCE_OFFSET = "lpcal.source.offset"


async def publish_deadletter(producer: AIOKafkaProducer, topic: str, raw: bytes, reason: str,
                             source_topic: str, partition: int, offset: int, *,
                             key: bytes | None = None) -> Any:
    """Send the raw bytes of a rejected message to the dead-letter ``topic`` and wait for it.

    Headers: ``lpcal.reason`` (a short, bounded reason code), ``lpcal.source.topic``,
    ``lpcal.source.partition``, ``lpcal.source.offset`` (decimal ASCII); see
    :func:`deadletter_info`. Returns aiokafka's ``RecordMetadata``.
    """
    if not reason:
        raise InputError("publish_deadletter: reason must be a non-empty string")
    if raw is None:
        raw = b""
    headers = [
        (DLQ_REASON, reason.encode()),
        (DLQ_SOURCE_TOPIC, source_topic.encode()),
        (DLQ_SOURCE_PARTITION, str(int(partition)).encode()),
        (DLQ_SOURCE_OFFSET, str(int(offset)).encode()),
    ]
    return await producer.send_and_wait(topic, value=bytes(raw), key=key, headers=headers)


DLQ_MAX_UNSENT_BYTES = 16 << 20
"""Default byte budget of :class:`DeadLetterQueue`: dead letters not acknowledged yet."""

# bytes counted per dead letter besides its key and value: its headers (four names, about 70
# bytes, and short values) and the record's framing, approximately
_DLQ_RECORD_OVERHEAD = 256
_DLQ_RETRY_SECONDS = 1.0


class DeadLetterQueue:
    """Dead letters produced in batches and pipelined, in bounded memory, none lost.

    :meth:`put` (synchronous, cheap: the consume loop calls it per rejected event) queues a
    record; one sender task per queue takes the queued records in order, appends them to
    aiokafka batches (``create_batch``, one per dead-letter partition, up to the producer's
    ``max_batch_size``) and hands each full batch to ``send_batch``, whose delivery future is
    tracked per batch: a dead letter costs an append, not a task and a round trip of its own
    (one ``send`` task per dead letter made 30,000 tasks take 32 s while the consume loop waited).

    A dead letter goes to partition ``source partition % partitions`` of ``topic``, so those of
    one input partition stay in order (unless a batch fails and is re-sent after later ones).

    ``budget``: bytes (key and value, plus a fixed allowance per record for its headers and
    framing) of the dead letters put and not acknowledged yet. :attr:`over_budget` tells the
    consume loop to await :meth:`wait_for_room` (backpressure) before it fetches more; nothing
    is dropped.

    Failures: the records of a batch that was not delivered (or could not be handed to the
    producer) are kept; :meth:`flush` (before a checkpoint) waits for everything put so far,
    re-sends the failed records and raises, so that no checkpoint covers an event whose dead
    letter is not on the broker; :meth:`wait_for_room` re-sends them too (after a pause) when
    nothing else is in flight, so that backpressure cannot wait forever.
    """

    def __init__(self, producer: Any, topic: str, budget: int = DLQ_MAX_UNSENT_BYTES) -> None:
        self.producer = producer
        self.topic = topic
        self.budget = int(budget)
        self.unacked_bytes = 0
        self._queue: deque[tuple] = deque()        # (source partition, key, value, headers, size)
        self._inflight: dict[asyncio.Future, list[tuple]] = {}   # delivery future -> records
        self._failed: list[tuple] = []
        self._error: BaseException | None = None    # the last failure, for the log
        self._sender: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.batches_sent = 0

    def __len__(self) -> int:
        """Dead letters put and not acknowledged yet."""
        return (len(self._queue) + len(self._failed)
                + sum(len(r) for r in self._inflight.values()))

    @property
    def over_budget(self) -> bool:
        return self.unacked_bytes >= self.budget

    def put(self, source_partition: int, key: bytes | None, value: bytes,
            headers: list[tuple[str, bytes]]) -> None:
        size = len(value) + (len(key) if key else 0) + _DLQ_RECORD_OVERHEAD
        self._queue.append((source_partition, key, value, headers, size))
        self.unacked_bytes += size
        self._kick()

    def _kick(self) -> None:
        if self._sender is None and self._queue:
            self._sender = asyncio.ensure_future(self._send_queued())

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _send_queued(self) -> None:
        """Hand every queued record to the producer, one batch per partition at a time;
        ``send_batch`` waits while the partition's previous batch is not drained to the broker
        (the pipeline's depth), and lets the consume loop run meanwhile."""
        builders: dict[int, tuple[Any, list[tuple]]] = {}
        try:
            parts = sorted(await self.producer.partitions_for(self.topic))
            while self._queue or builders:
                full = None
                while self._queue:
                    rec = self._queue[0]
                    p = parts[rec[0] % len(parts)]
                    b = builders.get(p)
                    if b is None:
                        b = builders[p] = (self.producer.create_batch(), [])
                    if b[0].append(timestamp=None, key=rec[1], value=rec[2],
                                   headers=rec[3]) is None:
                        full = p
                        break
                    b[1].append(self._queue.popleft())
                # the full batch, else (the queue is empty) every batch
                for p in [full] if full is not None else list(builders):
                    batch, recs = builders[p]
                    fut = await self.producer.send_batch(batch, self.topic, partition=p)
                    del builders[p]
                    self.batches_sent += 1
                    self._inflight[fut] = recs
                    fut.add_done_callback(self._delivered)
        except Exception as e:  # noqa: BLE001 - kept and re-sent by flush / wait_for_room
            self._error = e
            for _batch, recs in builders.values():
                self._failed.extend(recs)
            log.warning("dead letters: sending failed (%s: %s); %d kept for a re-send",
                        type(e).__name__, e, len(self._failed) + len(self._queue))
        finally:
            self._sender = None
            self._wake()

    def _delivered(self, fut: asyncio.Future) -> None:
        recs = self._inflight.pop(fut, None)
        if recs is None:
            return
        if fut.cancelled() or fut.exception() is not None:
            self._error = None if fut.cancelled() else fut.exception()
            self._failed.extend(recs)
        else:
            self.unacked_bytes -= sum(r[4] for r in recs)
        self._wake()

    def _resend_failed(self) -> int:
        """Put the failed records (and any left queued) back in front of the queue, in order;
        start sending. Returns how many were re-sent."""
        n = len(self._failed) + len(self._queue)
        if self._failed:
            self._queue.extendleft(reversed(self._failed))
            self._failed = []
        self._kick()
        return n

    async def flush(self) -> None:
        """Wait until every dead letter put so far is acknowledged; re-send failures and raise
        (``RuntimeError``)."""
        self._kick()
        while self._sender is not None or self._inflight:
            await self._wait_change()
        if self._failed or self._queue:
            n = self._resend_failed()
            raise RuntimeError(f"{n} dead letters not delivered yet ({self._error!r})")

    async def wait_for_room(self, stopping: asyncio.Event | None = None,
                            retry_after: float = _DLQ_RETRY_SECONDS) -> None:
        """Return once the dead letters not acknowledged take less than :attr:`budget` bytes
        (or ``stopping`` is set). Failed records are re-sent after ``retry_after`` seconds
        when nothing else is in flight."""
        while self.over_budget and not (stopping is not None and stopping.is_set()):
            if self._sender is None and not self._inflight:
                if stopping is not None:
                    try:
                        await asyncio.wait_for(stopping.wait(), retry_after)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(retry_after)
                self._resend_failed()
                continue
            self._changed.clear()  # here, not in the task: a wake-up before it runs counts
            waits = [asyncio.ensure_future(self._changed.wait())]
            if stopping is not None:
                waits.append(asyncio.ensure_future(stopping.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


def deadletter_info(headers: Iterable[tuple[str, bytes]]) -> dict[str, Any]:
    """Decode dead-letter headers to ``{reason, source_topic, source_partition, source_offset}``."""
    h = {k: v for k, v in headers}
    try:
        return {
            "reason": h[DLQ_REASON].decode(),
            "source_topic": h[DLQ_SOURCE_TOPIC].decode(),
            "source_partition": int(h[DLQ_SOURCE_PARTITION]),
            "source_offset": int(h[DLQ_SOURCE_OFFSET]),
        }
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"deadletter_info: missing or bad header ({e!r}) in {sorted(h)}") from e
