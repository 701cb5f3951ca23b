"""Ingest, mixed into :class:`daemon.service.Daemon`: checking fetched batches for holes in
their offsets, the raw-bytes sampling prefilter, parsing, routing events to their models'
states (creating a model on its first event) and dead letters.

Every fetched partition batch is checked against the partition's expected offset before it is
processed (:mod:`daemon.offset_gaps`): a hole is counted, and with ``kafka.offset_gaps =
"refetch"`` read again, so a broker that hands out a batch before an earlier one (the embedded
Tansu broker, under load) does not cost the skipped samples. An event at an offset below its
model's recorded offset is skipped: that model's checkpoint already contains it.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from operator import attrgetter

import numpy as np
from aiokafka import TopicPartition

from daemon import native
from daemon.events import ModelBatch, RecordTimestamps
from daemon.kafka.deadletter import (
    DLQ_REASON,
    DLQ_SOURCE_OFFSET,
    DLQ_SOURCE_PARTITION,
    DLQ_SOURCE_TOPIC,
    DeadLetterQueue,
)
from daemon.model_state import ModelState
from daemon.offset_gaps import OffsetGapGuard

log = logging.getLogger("lpcal.daemon")

WRONG_PARTITION = "bad_schema"  # a model's events on two partitions: the key contract is broken


def subset(mb: ModelBatch, keep: np.ndarray) -> ModelBatch:
    """The events of ``mb`` where ``keep`` holds."""
    idx = np.flatnonzero(keep)
    return ModelBatch(mb.model, mb.k, mb.kind[idx], [mb.ids[i] for i in idx.tolist()],
                      mb.ts[idx], mb.probs[idx], mb.labels[idx], mb.index[idx])


class Ingest:
    """The ingest half of the daemon (uses ``registry``, ``parser``, ``metrics``, ``consumer``,
    ``producer`` and the settings ``s`` of :class:`daemon.service.Daemon`)."""

    def _init_ingest(self, settings) -> None:
        k = settings.kafka
        self.event_time: dict[str, float] = {}  # per model: the latest event time seen
        self.positions: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset
        # dead letters not yet acknowledged (created with the first one: it needs the producer)
        self._dlq: DeadLetterQueue | None = None
        self._dl_reasons: dict[str, int] = {}  # dead letters queued, not counted in metrics yet
        # holes in fetched input offsets (see daemon.offset_gaps): counted, or read again
        self.gaps = OffsetGapGuard(refetch=k.offset_gaps == "refetch",
                                   grace_seconds=k.offset_gap_grace_seconds)
        # the configured models with a rate < 1, which the prefilter samples on any partition
        # until they are placed (see _sample_out)
        self._hot: dict[str, float] = {
            m: float(ms.sample_rate) for m, ms in settings.configured_models.items()
            if float(getattr(ms, "sample_rate", 1.0)) < 1.0}

    def _topic_kind(self, topic: str) -> str:
        """The ``topic`` label of an input topic's metrics: predictions | outcomes."""
        return "predictions" if topic == self.t_pred else "outcomes"

    def _up_to_hole(self, tp: TopicPartition, msgs):
        """``msgs``, or (policy ``refetch``) the records before the first hole in their offsets,
        with the partition sought back to the hole (:mod:`daemon.offset_gaps`)."""
        key = (tp.topic, tp.partition)
        v = self.gaps.check(key, self.positions.get(key), msgs[0].offset, msgs[-1].offset,
                            len(msgs), lambda: [m.offset for m in msgs], time.monotonic())
        if v.hole is None and v.closed is None:
            return msgs
        kind = self._topic_kind(tp.topic)
        if v.closed is not None:
            self.metrics.inc_offset_gap(kind, "filled")
            log.info("%s[%d]: offsets %d..%d, skipped by a fetch, arrived on reading again",
                     tp.topic, tp.partition, v.closed.start, v.closed.end - 1)
        if v.skipped:
            self.metrics.inc_offset_gap(kind, "skipped")
            log.log(logging.WARNING if self.gaps.refetch else logging.DEBUG,
                    "%s[%d]: offsets %d..%d were not delivered; going on without them",
                    tp.topic, tp.partition, v.hole.start, v.hole.end - 1)
        if v.seek is None:
            return msgs
        self.consumer.seek(tp, v.seek)
        return msgs[:v.keep]

    def _process(self, tp: TopicPartition, msgs) -> None:
        """Ingest one partition's batch.

        The cyclic garbage collector is paused meanwhile: the batch allocates many short-lived
        acyclic objects (parsed JSON, id lists), which reference counting frees, and a
        collection triggered mid-batch would traverse them and every long-lived object for
        nothing (it doubled the cost of parsing and joining); collection resumes after the
        batch. Per-message work is done with C-level passes (``map``); record timestamps are
        only read for events without ``ts``, offsets only when a replay may skip events."""
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            topic_kind = self._topic_kind(tp.topic)
            end = msgs[-1].offset + 1
            self.metrics.inc_consumed(topic_kind, len(msgs))
            sampled = self.registry.sampled
            rates = sampled.get(tp.partition)
            if (rates or self._hot) and native.KERNELS.sample_records is not None:
                msgs, values = self._sample_out(topic_kind, msgs, rates or {})
                if not msgs:
                    self.positions[(tp.topic, tp.partition)] = end
                    return
            else:
                values = list(map(attrgetter("value"), msgs))
            if None in values:
                values = [v or b"" for v in values]
            n = len(msgs)
            pb = self.parser.parse_batch(values, RecordTimestamps(msgs))
            for i, bad in pb.invalid:
                self._deadletter(tp, msgs[i], bad.reason)
            offset_of = attrgetter("offset")
            lowest = msgs[0].offset  # a partition's records come in offset order
            offsets = None
            dirty = self.registry.dirty
            for model, mb in pb.by_model.items():
                st = self._state_for(model, mb, tp)
                if st is None:
                    for i in mb.index.tolist():
                        self._deadletter(tp, msgs[i], WRONG_PARTITION)
                    continue
                floor = st.offsets.get(tp.topic, {}).get(tp.partition, -1)
                if lowest < floor:  # replay after a restore: some events are in the checkpoint
                    if offsets is None:
                        offsets = np.fromiter(map(offset_of, msgs), dtype=np.int64, count=n)
                    offs = offsets[mb.index]
                    if offs.min() < floor:
                        mb = subset(mb, offs >= floor)
                        if not len(mb):
                            continue
                res = st.offer(mb)
                self.event_time[model] = max(self.event_time.get(model, -math.inf),
                                             float(mb.ts.max()))
                dirty.add(model)
                if res.sampled_out:
                    self.metrics.inc_sampled_out(model, topic_kind, res.sampled_out)
                if st.sample_rate < 1.0:
                    sampled.setdefault(tp.partition, {})[model] = st.sample_rate
                if res.joined:
                    self.metrics.inc_joined(model, res.joined)
                if res.sealed_early:
                    self.metrics.inc_sealed_early(model, res.sealed_early)
                if res.window_trimmed:
                    self.metrics.inc_window_trimmed(model, res.window_trimmed)
                if res.label_out_of_range:
                    self.metrics.inc_invalid("label_out_of_range", res.label_out_of_range)
                for reason, k in res.evicted.items():
                    if k:
                        self.metrics.inc_evicted(model, reason, k)
                for kind, k in res.unmatched.items():
                    if k:
                        self.metrics.inc_unmatched(model, kind, k)
            self.positions[(tp.topic, tp.partition)] = end
        finally:
            if paused:
                gc.enable()

    def _sample_out(self, topic_kind: str, msgs: list, rates: dict[str, float]
                    ) -> tuple[list, list]:
        """Drop, on their raw bytes and before any parsing, the events of sampled models that
        :meth:`ModelState.sample` would drop: one C call per partition batch
        (``daemon._speedups.sample_records``), which scans each message for ``model`` and
        ``id``, hashes the ids of sampled models side by side (blake2b in vector lanes) and
        returns the records kept; no Python object is made for a dropped one. Sampled models:
        ``rates`` (this partition's), and the configured models with a rate < 1 that no
        partition holds yet (``self._hot`` minus the registry's models), so that a hot model is
        sampled from its first batch on; a model placed on another partition is not sampled
        here (its events are dead-lettered there, as on the Python path). Events it cannot
        decide there (escaped or non-ASCII ids, anything unusual) are parsed and sampled by
        ``ModelState.offer`` with the same rule; so is everything on the pure-Python path.
        Dropped events are counted, not validated (an invalid event of a sampled model is
        dead-lettered only if kept). Returns the records kept and their values."""
        kept, values, counts = native.KERNELS.sample_records(
            msgs if type(msgs) is list else list(msgs), rates, self.parser.max_bytes,
            self.parser.max_id_len, self._hot or None, self.registry.slots)
        for model, k in counts.items():
            self.metrics.inc_sampled_out(model, topic_kind, k)
        return kept, values

    def _state_for(self, model: str, mb: ModelBatch, tp: TopicPartition) -> ModelState | None:
        slot = self.registry.get(model)
        if slot is not None:
            return slot.state if slot.partition == tp.partition else None
        # k = 0: outcomes before the first prediction of a model whose k is learned; they
        # wait in its join buffer
        k = mb.k or self.parser.k.get(model) or 0
        return self.registry.create(model, int(k), tp.partition)

    # ------------------------------------------------------------------ dead letters
    def _deadletter(self, tp: TopicPartition, msg, reason: str) -> None:
        """Queue ``msg`` for the dead-letter topic with its reason: produced in batches and
        pipelined by :class:`daemon.kafka.deadletter.DeadLetterQueue`. Counted in the metrics per
        batch (:meth:`_count_deadletters`, before the main loop awaits anything)."""
        headers = [(DLQ_REASON, reason.encode()),
                   (DLQ_SOURCE_TOPIC, tp.topic.encode()),
                   (DLQ_SOURCE_PARTITION, str(tp.partition).encode()),
                   (DLQ_SOURCE_OFFSET, str(msg.offset).encode())]
        if self._dlq is None:
            self._dlq = DeadLetterQueue(self.producer, self.s.kafka.topics.deadletter)
        self._dlq.put(tp.partition, msg.key, bytes(msg.value or b""), headers)
        self._dl_reasons[reason] = self._dl_reasons.get(reason, 0) + 1

    def _count_deadletters(self) -> None:
        if self._dl_reasons:
            reasons, self._dl_reasons = self._dl_reasons, {}
            self.metrics.inc_invalid_many(reasons)
            self.metrics.inc_deadletter(sum(reasons.values()))

    async def _deadletters_after_batch(self) -> None:
        """Count the batch's dead letters; backpressure: while the unsent dead letters fill
        their byte budget, wait (nothing is fetched meanwhile; nothing is dropped)."""
        self._count_deadletters()
        if self._dlq.over_budget:
            await self._dlq.wait_for_room(self.stopping)

    async def _flush_deadletters(self) -> None:
        """Wait until every dead letter is acknowledged; re-send failures and raise, so that no
        checkpoint covers an event whose dead letter is not on the broker."""
        self._count_deadletters()
        if self._dlq is not None:
            await self._dlq.flush()
