"""Ingest (:class:`Ingest`): checking fetched batches for holes in their offsets, the raw-bytes
sampling prefilter, parsing, routing events to their models' states (creating a model on its
first event) and dead letters (:class:`DeadLetters`).

Every fetched partition batch is checked against the partition's expected offset before it is
processed (:mod:`daemon.offset_gaps`): a hole is counted, and with ``kafka.offset_gaps =
"refetch"`` read again, so a broker that hands out a batch before an earlier one (the embedded
Tansu broker, under load) does not cost the skipped samples. An event at an offset below its
model's recorded offset is skipped: that model's checkpoint already contains it.

A model's slice of a batch shared by several models, smaller than :data:`STAGE_MIN_EVENTS`
events, is staged (:mod:`daemon.staging`) and offered to its state with the model's next slices,
in one call:

* once they reach that count;
* :data:`STAGE_MAX_AGE` seconds after the oldest, or later when paced
  (:class:`daemon.staging.StagePacing` raises the age with the number of staged models and the
  measured fixed cost of their offers, within ``join.staging_max_cpu_share`` of the time and at
  most ``join.staging_max_wait_seconds``);
* when the staged bytes exceed their budget, and when a poll brings nothing (the input is idle);
* always before a checkpoint and before the model's partition is released
  (:meth:`Ingest.flush_staged`, which the daemon hands to its checkpointer and calls before a
  release).

Large slices, and the batches of a single model, are offered at once: a batch of one model
costs one offer already.

A batch of several models sharing one ``k`` and policy stays in columns from the parser
(:class:`daemon.event_records.GroupedBatch`) to the staging (one chunk for all its small
slices): what the ingest does per batch grows with its rows and the offers it makes, not with
the models in it (:meth:`Ingest._route_grouped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import numpy as np
from aiokafka import TopicPartition

from daemon import native
from daemon.event_records import GroupedBatch, ModelBatch
from daemon.events import RecordTimestamps
from daemon.kafka import deadletter as kafka_deadletter
from daemon.monitor import flush_waiting, largest
from daemon.registry import ModelSlot
from daemon.staging import DEFAULT_MAX_SHARE, DEFAULT_MAX_WAIT, StagedEvents, StagePacing
from lpcal.window import flush_many

log = logging.getLogger("lpcal.daemon")

WRONG_PARTITION = "bad_schema"  # a model's events on two partitions: the key contract is broken
#: a model's slice of a batch smaller than this is staged (:mod:`daemon.staging`)
STAGE_MIN_EVENTS = 256
#: seconds a staged event waits before it is offered when the staged offers are cheap or few
#: (besides checkpoints and releases); the pacing may raise it (:class:`StagePacing`)
STAGE_MAX_AGE = 5.0
#: bytes staged at most: the smaller of this and an eighth of ``join.max_bytes_total``
STAGE_MAX_BYTES = 64 << 20

_OFFSETS = attrgetter("offsets")
_OFFSET = attrgetter("offset")
_NO_OFFSETS: dict = {}


class _Floors:
    """The replay floors of a partition batch: an event at an offset below its model's
    recorded offset for the partition is in the model's restored checkpoint (skipped)."""

    __slots__ = ("lowest", "msgs", "offsets", "part", "topic")

    def __init__(self, tp: TopicPartition, msgs):
        self.topic, self.part, self.msgs = tp.topic, tp.partition, msgs
        self.lowest = msgs[0].offset  # a partition's records come in offset order
        self.offsets: np.ndarray | None = None

    def clear(self, states) -> bool:
        """True when no event of the batch is below the floors of ``states``."""
        topic, part, lowest = self.topic, self.part, self.lowest
        for o in map(_OFFSETS, states):
            if o.get(topic, _NO_OFFSETS).get(part, -1) > lowest:
                return False
        return True

    def above(self, st, mb: ModelBatch) -> ModelBatch | None:
        """``mb`` without the events below ``st``'s floor (None: nothing left)."""
        floor = st.offsets.get(self.topic, _NO_OFFSETS).get(self.part, -1)
        if self.lowest >= floor:
            return mb
        if self.offsets is None:
            msgs = self.msgs
            self.offsets = np.fromiter(map(_OFFSET, msgs), dtype=np.int64, count=len(msgs))
        offs = self.offsets[mb.index]
        if offs.min() < floor:
            mb = mb.select(offs >= floor)
            if not len(mb):
                return None
        return mb


@contextlib.contextmanager
def _gc_paused():
    """The cyclic garbage collector paused meanwhile (if it was on): a batch allocates many
    short-lived acyclic objects (parsed JSON, id lists), which reference counting frees, and a
    collection triggered mid-batch would traverse them and every long-lived object for
    nothing; collection resumes after."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


class DeadLetters:
    """The dead letters of the daemon: queued for the dead-letter topic in batches and
    pipelined by :class:`daemon.kafka.deadletter.DeadLetterQueue` (created with the first one: it
    needs the producer), counted in the metrics per batch, flushed before every checkpoint."""

    def __init__(self, clients, metrics, topic: str):
        self.clients, self.metrics, self.topic = clients, metrics, topic
        self._dlq: kafka_deadletter.DeadLetterQueue | None = None
        self._reasons: dict[str, int] = {}  # dead letters queued, not counted in metrics yet

    @property
    def pending(self) -> bool:
        """True once any dead letter was queued (then a checkpoint flushes them first)."""
        return bool(self._dlq)

    @property
    def queue(self) -> kafka_deadletter.DeadLetterQueue | None:
        return self._dlq

    def put(self, tp: TopicPartition, msg, reason: str) -> None:
        """Queue ``msg`` for the dead-letter topic with its reason. Counted in the metrics per
        batch (:meth:`count`, before the main loop awaits anything)."""
        headers = [(kafka_deadletter.DLQ_REASON, reason.encode()),
                   (kafka_deadletter.DLQ_SOURCE_TOPIC, tp.topic.encode()),
                   (kafka_deadletter.DLQ_SOURCE_PARTITION, str(tp.partition).encode()),
                   (kafka_deadletter.DLQ_SOURCE_OFFSET, str(msg.offset).encode())]
        if self._dlq is None:
            self._dlq = kafka_deadletter.DeadLetterQueue(self.clients.producer, self.topic)
        self._dlq.put(tp.partition, msg.key, bytes(msg.value or b""), headers)
        self._reasons[reason] = self._reasons.get(reason, 0) + 1

    def count(self) -> None:
        """Count the dead letters queued since the last count in the metrics."""
        if self._reasons:
            reasons, self._reasons = self._reasons, {}
            self.metrics.inc_invalid_many(reasons)
            self.metrics.inc_deadletter(sum(reasons.values()))

    async def after_batch(self, stopping: asyncio.Event) -> None:
        """Count the batch's dead letters; backpressure: while the unsent dead letters fill
        their byte budget, wait (nothing is fetched meanwhile; nothing is dropped)."""
        if self._dlq is None:
            return
        self.count()
        if self._dlq.over_budget:
            await self._dlq.wait_for_room(stopping)

    async def flush(self) -> None:
        """Wait until every dead letter is acknowledged; re-send failures and raise, so that no
        checkpoint covers an event whose dead letter is not on the broker."""
        self.count()
        if self._dlq is not None:
            await self._dlq.flush()


class Ingest:
    """Processes fetched batches into the models' states.

    Parameters
    ----------
    settings : daemon.settings.Settings
    registry : daemon.registry.ModelRegistry
        Where events go; a model seen for the first time is created there.
    partitions : daemon.partitions.PartitionTable
        Per input partition: the next offset, the gap guard, the sample rates.
    parser : daemon.events.EventParser
    metrics : daemon.metrics.DaemonMetrics
    clients : daemon.clients.KafkaClients
        Its consumer seeks back to a hole in the offsets.
    deadletters : DeadLetters
    clock : callable, default ``time.monotonic``
        The time of the offset-gap guard's grace period.
    on_online : callable, optional
        ``on_online(model, result)``: what an online model's offer did (its
        :class:`daemon.model_state.IngestResult` with events: maps to publish, fits to run);
        the daemon passes :meth:`daemon.fitting.Fitter.online_result`.
    stage_min_events : int, default :data:`STAGE_MIN_EVENTS`
        Slices smaller than this are staged (1: nothing is staged).
    stage_max_age : float, default :data:`STAGE_MAX_AGE`
        Seconds (of ``clock``) a staged event waits when its offer is cheap (:meth:`flush_due`):
        the pacing's base age.
    stage_max_share, stage_max_wait : float, optional
        The pacing's share of the time and longest age (:class:`daemon.staging.StagePacing`);
        default ``join.staging_max_cpu_share`` and ``join.staging_max_wait_seconds`` of
        ``settings`` (or the pacing's defaults). The cost of each offer of fewer than
        ``stage_min_events`` staged events is measured with ``clock``.
    """

    def __init__(self, settings, registry, partitions, parser, metrics, clients, deadletters, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_online: Callable[[str, Any], None] | None = None,
                 stage_min_events: int = STAGE_MIN_EVENTS,
                 stage_max_age: float = STAGE_MAX_AGE,
                 stage_max_share: float | None = None,
                 stage_max_wait: float | None = None):
        self.registry, self.partitions, self.parser = registry, partitions, parser
        self.metrics, self.clients, self.deadletters = metrics, clients, deadletters
        self.clock, self.on_online = clock, on_online
        join = getattr(settings, "join", None)
        total = getattr(join, "max_bytes_total", None)
        #: the small slices not offered yet (:mod:`daemon.staging`)
        self.staged = StagedEvents(stage_min_events, stage_max_age,
                                   STAGE_MAX_BYTES if total is None
                                   else min(STAGE_MAX_BYTES, int(total) // 8))
        #: the staging age, raised when the staged offers would cost more than their share
        self.pacing = StagePacing(
            stage_max_age,
            getattr(join, "staging_max_cpu_share", DEFAULT_MAX_SHARE)
            if stage_max_share is None else stage_max_share,
            getattr(join, "staging_max_wait_seconds", DEFAULT_MAX_WAIT)
            if stage_max_wait is None else stage_max_wait)
        self._age_shown = self.pacing.base_age  # the age last set in the metrics
        metrics.set_staging_age(self._age_shown)
        self._fed = False  # a batch was processed since the last flush_due
        #: per model code of :attr:`staged`: the input partition on which the model was found
        #: placed, not sampled and past its restored offsets (-1: not known); see
        #: :meth:`_route_grouped`
        self._routable = np.full(64, -1, dtype=np.int64)
        self._routable_gen = getattr(registry, "generation", None)
        #: per (topic, partition): the end of the furthest batch processed (the checkpoints
        #: record positions up to it)
        self._high: dict[tuple[str, int], int] = {}
        # the configured models with a rate < 1, which the prefilter samples on any partition
        # until they are placed (see _sample_out)
        self._hot: dict[str, float] = {
            m: float(ms.sample_rate) for m, ms in settings.configured_models.items()
            if float(getattr(ms, "sample_rate", 1.0)) < 1.0}

    def up_to_hole(self, tp: TopicPartition, msgs):
        """``msgs``, or (policy ``refetch``) the records before the first hole in their offsets,
        with the partition sought back to the hole (:mod:`daemon.offset_gaps`)."""
        ps = self.partitions.ensure(tp.partition)
        gaps = ps.gaps
        v = gaps.check(tp.topic, ps.positions.get(tp.topic), msgs[0].offset, msgs[-1].offset,
                       len(msgs), lambda: [m.offset for m in msgs], self.clock())
        if v.hole is None and v.closed is None:
            return msgs
        kind = self.clients.topic_kind(tp.topic)
        if v.closed is not None:
            self.metrics.inc_offset_gap(kind, "filled")
            log.info("%s[%d]: offsets %d..%d, skipped by a fetch, arrived on reading again",
                     tp.topic, tp.partition, v.closed.start, v.closed.end - 1)
        if v.skipped:
            self.metrics.inc_offset_gap(kind, "skipped")
            log.log(logging.WARNING if gaps.refetch else logging.DEBUG,
                    "%s[%d]: offsets %d..%d were not delivered; going on without them",
                    tp.topic, tp.partition, v.hole.start, v.hole.end - 1)
        if v.seek is None:
            return msgs
        self.clients.consumer.seek(tp, v.seek)
        return msgs[:v.keep]

    def process(self, tp: TopicPartition, msgs) -> None:
        """Ingest one partition's batch.

        The cyclic garbage collector is paused meanwhile: the batch allocates many short-lived
        acyclic objects (parsed JSON, id lists), which reference counting frees, and a
        collection triggered mid-batch would traverse them and every long-lived object for
        nothing (it doubled the cost of parsing and joining); collection resumes after the
        batch. Per-message work is done with C-level passes (``map``); record timestamps are
        only read for events without ``ts``, offsets only when a replay may skip events."""
        with _gc_paused():
            self._process(tp, msgs)

    def _process(self, tp: TopicPartition, msgs) -> None:
        topic_kind = self.clients.topic_kind(tp.topic)
        end = msgs[-1].offset + 1
        self.metrics.inc_consumed(topic_kind, len(msgs))
        ps = self.partitions.ensure(tp.partition)
        rates = ps.sampled
        if rates or self._hot:
            msgs, values = self._sample_out(topic_kind, msgs, rates)
            if not msgs:
                ps.positions[tp.topic] = end
                return
        else:
            values = list(map(attrgetter("value"), msgs))
        if None in values:
            values = [v or b"" for v in values]
        pb = self.parser.parse_batch(values, RecordTimestamps(msgs))
        deadletter = self.deadletters.put
        for i, bad in pb.invalid:
            deadletter(tp, msgs[i], bad.reason)
        self._fed = True
        g = pb.grouped
        key = (tp.topic, tp.partition)
        high = self._high.get(key)
        if g is not None and len(g.models) > 1:
            self._route_grouped(tp, msgs, g, topic_kind, rates,
                                high is not None and msgs[0].offset >= high)
        else:
            by_model = pb.by_model
            self._route(tp, msgs, list(by_model.items()), len(by_model) > 1, topic_kind, rates)
        staged = self.staged
        if staged.over_budget:  # the oldest models first, down to half the budget
            self._flush_models(staged.oldest_over_budget())
            if staged.over_budget:
                staged.compact()
        if high is None or end > high:
            self._high[key] = end
        ps.positions[tp.topic] = end
        ts_max = pb.max_ts()
        if ts_max > ps.event_times.get(tp.topic, -math.inf):
            ps.event_times[tp.topic] = ts_max

    def _route(self, tp: TopicPartition, msgs, items: list[tuple[str, ModelBatch]],
               shared: bool, topic_kind: str, rates: dict[str, float],
               floors: _Floors | None = None) -> None:
        """Route the slices ``items`` of a batch one model at a time (the general path; the
        models of a grouped batch that :meth:`_route_grouped` cannot take whole): create
        models on their first event, dead-letter a model's events on the wrong partition, skip
        events already in a restored checkpoint, sample, then offer a large slice at once
        (after its model's staged events) and stage the small ones of a batch ``shared`` by
        several models, all in one chunk."""
        staged, deadletter = self.staged, self.deadletters.put
        get, part, min_events = self.registry.slots.get, tp.partition, staged.min_events
        staged_k = staged.staged_k
        floors = _Floors(tp, msgs) if floors is None else floors
        to_stage: list[ModelBatch] = []
        flush_after: list[str] = []
        for model, mb in items:
            slot = get(model)
            if slot is None or slot.partition != part:
                slot = self._slot_for(model, mb, tp)
            if slot is None:
                for i in mb.index.tolist():
                    deadletter(tp, msgs[i], WRONG_PARTITION)
                continue
            st = slot.state
            mb = floors.above(st, mb)
            if mb is None:
                continue
            if st.sample_rate < 1.0:
                rates[model] = st.sample_rate
            # staged: small slices of batches shared by several models (a batch of one
            # model costs one offer per batch already)
            small = shared and len(mb.ids) < min_events
            k_staged = staged_k(model)
            if k_staged is None:
                if not small:
                    self._offer(model, slot, mb, topic_kind)
                    continue
            elif k_staged != mb.k:
                self._flush_models([model])  # outcomes staged before the model's k was known
            if st.sample_rate < 1.0:  # counted by topic here; offer() then keeps them all
                mb, dropped = st.sample(mb)
                if dropped:
                    self.metrics.inc_sampled_out(model, topic_kind, dropped)
            to_stage.append(mb)
            if not small:
                flush_after.append(model)
        if to_stage:
            reached = staged.add_many(to_stage, self.clock())
            if flush_after:
                reached = list(dict.fromkeys(reached + flush_after))
            if reached:
                self._flush_models(reached)

    def _route_grouped(self, tp: TopicPartition, msgs, g: GroupedBatch, topic_kind: str,
                       rates: dict[str, float], contiguous: bool) -> None:
        """Route a batch of several models in columns (:class:`GroupedBatch`): the models
        placed on this partition, not sampled and past their restored offsets are staged in
        one chunk, or offered at once when their slice is large and nothing of theirs is
        staged; the others go through :meth:`_route`.

        Which models qualify is known per model code (:attr:`_routable`: the partition they
        were found to qualify on), so a batch touches no model's objects but for the offers
        it makes. The facts are forgotten when the registry puts a state in place of another
        or removes one (:attr:`daemon.registry.ModelRegistry.generation`), and for the
        partition when a batch starts below the end of the furthest batch processed on it
        (``contiguous`` False: read again after a seek back, its events may be below a
        model's recorded offsets): its models are then checked one by one again. A checkpoint
        records only positions already processed, so the recorded offsets of a model found
        past them stay behind the contiguous batches that follow."""
        models = g.models
        m = len(models)
        part = tp.partition
        staged = self.staged
        codes = staged.codes(models)
        routable = self._routable_for(staged.known)
        if contiguous:
            known = routable[codes] == part
        else:  # read again below what was processed: every model of the partition checked again
            routable[routable == part] = -1
            known = np.zeros(m, dtype=bool)
        fmask = None
        if not known.all():  # check the others one by one (new models, sampled, replayed...)
            get = self.registry.slots.get
            floors = _Floors(tp, msgs)
            fast = known.copy()
            for c in np.flatnonzero(~known).tolist():
                s = get(models[c])
                if (s is not None and s.partition == part and s.state.sample_rate == 1.0
                        and floors.clear((s.state,))):
                    fast[c] = True
            routable[codes[fast]] = part
            slow = np.flatnonzero(~fast).tolist()
            if slow:
                routable[codes[slow]] = -1
                self._route(tp, msgs, [(models[c], g.model_batch(c)) for c in slow], True,
                            topic_kind, rates, floors)
                if len(slow) == m:
                    return
                fmask = fast
        on = staged.staged_mask(codes)
        if fmask is not None:
            on &= fmask
        wrong_k = np.flatnonzero(on & (staged.k_of(codes) != g.k))
        if wrong_k.size:  # outcomes staged before the models' k was known
            self._flush_models([models[c] for c in wrong_k.tolist()])
            on[wrong_k] = False
        large = g.counts() >= staged.min_events
        direct = large & ~on
        stage = ~direct
        if fmask is not None:
            direct &= fmask
            stage &= fmask
        reached = staged.add_grouped(g, stage, codes, self.clock()) if stage.any() else []
        also = np.flatnonzero(large & stage)  # large slices after their staged events
        if also.size:
            reached = list(dict.fromkeys(reached + [models[c] for c in also.tolist()]))
        if reached:
            self._flush_models(reached)
        get = self.registry.slots.get
        for c in np.flatnonzero(direct).tolist():
            self._offer(models[c], get(models[c]), g.model_batch(c), topic_kind)

    def _routable_for(self, n: int) -> np.ndarray:
        """:attr:`_routable` for ``n`` model codes, forgotten if the registry changed."""
        gen = getattr(self.registry, "generation", None)
        r = self._routable
        if gen != self._routable_gen:
            r.fill(-1)
            self._routable_gen = gen
        if r.shape[0] < n:
            grown = np.full(max(n, 2 * r.shape[0]), -1, dtype=np.int64)
            grown[:r.shape[0]] = r
            r = self._routable = grown
        return r

    def _offer(self, model: str, slot: ModelSlot, mb: ModelBatch, topic_kind: str | None
               ) -> None:
        """Offer ``mb`` to ``model``'s state and count what the offer did (``topic_kind``: of
        the slice's topic; None for staged slices, sampled when staged)."""
        st = slot.state
        res = st.offer(mb)
        if res.events and self.on_online is not None:
            self.on_online(model, res)
        if len(mb):
            t = largest(mb.ts)  # float(mb.ts.max()), in Python for the few times of an offer
            if slot.event_time is None or t > slot.event_time:
                slot.event_time = t
        self.registry.dirty.add(model)
        self.registry.touched.add(model)
        metrics = self.metrics
        if res.sampled_out and topic_kind is not None:
            metrics.inc_sampled_out(model, topic_kind, res.sampled_out)
        if res.joined:
            metrics.inc_joined(model, res.joined)
        if res.sealed_early:
            metrics.inc_sealed_early(model, res.sealed_early)
        if res.window_trimmed:
            metrics.inc_window_trimmed(model, res.window_trimmed)
        if res.label_out_of_range:
            metrics.inc_invalid("label_out_of_range", res.label_out_of_range)
        for reason, k in res.evicted.items():
            if k:
                metrics.inc_evicted(model, reason, k)
        for kind, k in res.unmatched.items():
            if k:
                metrics.inc_unmatched(model, kind, k)

    def _flush_models(self, models: list[str]) -> None:
        """Offer each of ``models`` its staged events, in order, in one call (their rows taken
        out of the staging together, :meth:`StagedEvents.take_many`); each offer of fewer than
        ``min_events`` (by age, bytes, a checkpoint...) is timed for the pacing."""
        if not models:
            return
        clock = self.clock
        get, min_events, record = self.registry.get, self.staged.min_events, self.pacing.record
        taken = self.staged.take_many(models)
        t0 = clock()  # the offers only: taking the rows costs per row, which no age saves
        for model, staged in taken:
            slot = get(model)
            if slot is None:  # released meanwhile (the daemon flushes before it releases)
                continue
            self._offer(model, slot, staged.batch, None)
            st = slot.state
            if staged.ts_limit > st.ts_limit:  # the offer pulled clocks back to the first one's
                st.ts_limit = float(staged.ts_limit)
            n = len(staged.batch.ids)
            t1 = clock()
            if n < min_events:
                record(t1 - t0, events=n)
            t0 = t1

    def flush_staged(self, parts: set[int] | None = None) -> None:
        """Offer the staged events of the models on input partitions ``parts`` (default:
        every model): before a checkpoint advances the models' offsets, and before their
        partitions are released. Then sum the rows their small offers left waiting in the
        monitors of the models changed since their last checkpoint on those partitions, in one
        pass (:func:`daemon.monitor.flush_waiting`: the same sums, to the bit, as each
        snapshot would compute for its own model, at about one model's cost), and likewise the
        rows their online calibrators deferred (until their open buckets fill)
        (:func:`lpcal.window.flush_many`: one pass of the temperature kernels for all models,
        instead of one per model when its checkpoint is encoded)."""
        get = self.registry.get
        with _gc_paused():
            gone, due = [], []
            for model in self.staged.oldest():
                slot = get(model)
                if slot is None:
                    gone.append(model)
                elif parts is None or slot.partition in parts:
                    due.append(model)
            if gone:
                self.staged.take_many(gone)
            self._flush_models(due)
            slots = self.registry.slots
            states = [slots[m].state for m in self.registry.dirty
                      if m in slots and (parts is None or slots[m].partition in parts)]
            flush_waiting(st.monitor for st in states)
            flush_many(st.online.window for st in states if st.online is not None)

    def staged_bytes(self, model: str) -> int:
        """Bytes of ``model``'s staged events (part of its join buffer in the gauges)."""
        return self.staged.model_nbytes(model)

    @property
    def stage_age(self) -> float:
        """The staging age now: :meth:`daemon.staging.StagePacing.age` of the staged models."""
        return self.pacing.age(len(self.staged))

    def flush_due(self, now: float) -> None:
        """After each poll: offer the staged events of the models whose oldest staged event
        waited :attr:`stage_age` seconds at ``now`` (a time of ``clock``), O(models due); or,
        when no batch was processed since the last call (the input is idle: nothing to
        amortise a call over), every model's. Sets ``lpcal_staging_age_seconds`` when the age
        changed."""
        if not self._fed:
            if len(self.staged):
                self.flush_staged()
            return
        self._fed = False
        age = self.stage_age
        if age != self._age_shown:
            self._age_shown = age
            self.metrics.set_staging_age(age)
        due = self.staged.due(now, age)
        if not due:
            return
        with _gc_paused():
            self._flush_models(due)

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

    def _slot_for(self, model: str, mb: ModelBatch, tp: TopicPartition) -> ModelSlot | None:
        """``model``'s slot if it lives on ``tp``'s partition (created on its first event),
        else None (its events are dead-lettered)."""
        slot = self.registry.get(model)
        if slot is not None:
            return slot if slot.partition == tp.partition else None
        # k = 0: outcomes before the first prediction of a model whose k is learned; they
        # wait in its join buffer
        k = mb.k or self.parser.k.get(model) or 0
        self.registry.create(model, int(k), tp.partition)
        return self.registry.get(model)
