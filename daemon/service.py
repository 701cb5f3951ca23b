"""The lpcal daemon: consume, join, pool, monitor, recalibrate, publish, checkpoint.

Lifecycle (after uvicorn's ``Server``): ``startup`` (HTTP first, so probes answer; then producer,
topics, consumer), ``main_loop`` (``getmany`` batches until asked to stop), ``shutdown`` (stop
fetching, let fits in flight finish for up to half the grace period, checkpoint what is left,
commit, leave the group, close), all within ``shutdown_grace_seconds``. SIGTERM/SIGINT start the
shutdown; a second signal exits at once.

Exactly-once accounting (SIGKILL at any moment loses no accepted sample and counts none twice):

* all state of a model (pools, monitor sums, pending joins, bin map, a fit in flight) is
  checkpointed in one record ``model/<id>`` together with the input offsets it covers;
* after the model records of input partition ``n`` are acknowledged, the manifest
  ``partition/<n>`` records the offsets of both input topics; consumer offsets are committed
  after that (they only serve lag monitoring);
* on assignment, the daemon restores the models of its partitions and seeks both topics to the
  manifest's offsets (or, without a manifest, to the smallest offsets of the model records, or
  to the beginning); an event at an offset below its model's recorded offset is skipped, since
  that model's checkpoint already contains it. Dead letters are flushed before any checkpoint.
* every fetched partition batch is checked against the partition's expected offset before it
  is processed (:mod:`daemon.offset_gaps`): a hole is counted, and with ``kafka.offset_gaps =
  "refetch"`` read again, so a broker that hands out a batch before an earlier one (the
  embedded Tansu broker, under load) does not cost the skipped samples.

Co-partitioning: events are keyed by model id and both input topics have the same partition
count, so partition ``n`` of both topics holds the same models; the range assignor gives both to
the same replica, which owns those models. Rebalances checkpoint revoked partitions before
handing them over, and the new owner restores them: this is how a deployment scales out.

Epoch boundaries: pools are count tables, so an epoch's pools do not depend on the order of its
samples. A fit starts after the batch in which the pools became full, so which samples fall in
which epoch can shift by a batch between runs; no sample is lost or counted twice either way.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from daemon import heap, kafka_io, native
from daemon.checkpoint_store import (
    CheckpointStore,
    KafkaCheckpointStore,
    LocalCheckpointStore,
    ValueTooLarge,
    decode_value,
)
from daemon.events import EventParser, ModelBatch
from daemon.metrics import DaemonMetrics
from daemon.model_state import MAX_SEALED, ModelState
from daemon.offset_gaps import OffsetGapGuard
from lpcal.calibrate import fit_pools
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.pools import PoolSet

log = logging.getLogger("lpcal.daemon")

ENVELOPE_FORMAT = "lpcal.envelope/1"
WRONG_PARTITION = "bad_schema"  # a model's events on two partitions: the key contract is broken
STATE_MAX_BYTES = 16 << 20  # checkpoints of large pools and windows are several MB
STATE_TOPIC_CONFIG = {"cleanup.policy": "compact", "max.message.bytes": str(STATE_MAX_BYTES)}
_GAUGE_EVERY = 1.0
_PUBLISH_RETRY_FIRST, _PUBLISH_RETRY_MAX = 0.5, 30.0  # seconds between bin-map publish attempts
_LAG_EVERY = 5.0
RESTORE_ABANDON_SECONDS = 2.0  # shutdown: how long a restore still running may hold the close
_ASSIGN_RETRY_FIRST, _ASSIGN_RETRY_MAX = 0.5, 10.0  # seconds between assignment retries
#: An assignment whose restore keeps failing this long makes /healthz fail (pod restarted)
ASSIGN_UNHEALTHY_SECONDS = 120.0


class StartupStopped(Exception):
    """A stop signal arrived while startup was still retrying (see ``Daemon._retry``)."""


@dataclass
class Inflight:
    """A fit started from an epoch's frozen pools; checkpointed until its bin map is published."""

    pools: PoolSet
    trigger: str
    version: int
    task: asyncio.Future | None = None


def fit_seed(model: str, version: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{model}:{version}".encode(), digest_size=4).digest(),
                          "big")


def subset(mb: ModelBatch, keep: np.ndarray) -> ModelBatch:
    """The events of ``mb`` where ``keep`` holds."""
    idx = np.flatnonzero(keep)
    return ModelBatch(mb.model, mb.k, mb.kind[idx], [mb.ids[i] for i in idx.tolist()],
                      mb.ts[idx], mb.probs[idx], mb.labels[idx], mb.index[idx])


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, daemon: Daemon):
        self.d = daemon

    async def on_partitions_revoked(self, revoked):
        await self.d.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.d.on_assigned(set(assigned))


class Daemon:
    """One replica of the calibration service (see the module docstring)."""

    def __init__(self, settings, *, metrics: DaemonMetrics | None = None,
                 store: CheckpointStore | None = None, consumer_options: dict | None = None):
        self.s = settings
        k = settings.kafka
        self.t_pred, self.t_out = k.topics.predictions, k.topics.outcomes
        self.metrics = metrics or DaemonMetrics(max_models=settings.max_models)
        self.parser = EventParser.from_settings(settings)
        self.models: dict[str, ModelState] = {}
        self.partition_of: dict[str, int] = {}
        self.event_time: dict[str, float] = {}
        self.dirty: set[str] = set()
        self.inflight: dict[str, Inflight] = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.assigned: set[TopicPartition] = set()
        self._store = store
        self._consumer_options = consumer_options or {}
        self.producer = None
        self.consumer = None
        self.http = None
        self.stopping = asyncio.Event()
        self.restored = False
        self.broker_ok = False
        self.last_poll = time.monotonic()
        self.started = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpcal-fit")
        self._last_ckpt = time.monotonic()
        self._last_gauges: dict[str, float] = {}
        # models whose gauges changed since their last export; exported (rate-limited) on every
        # poll until done, so that a model that turns idle does not keep stale gauges
        self._gauges_due: set[str] = set()
        self._publishing: set[asyncio.Task] = set()  # bin-map publishes (with their retries)
        self._last_lag = 0.0
        # dead letters not yet acknowledged (created with the first one: it needs the producer)
        self._dlq: kafka_io.DeadLetterQueue | None = None
        self._dl_reasons: dict[str, int] = {}  # dead letters queued, not counted in metrics yet
        # per model: sealed epochs to come whose bin maps were already published (see
        # _adopt_published_binmaps); checkpointed with the model
        self.prefitted: dict[str, int] = {}
        # models whose partitions were revoked without a successful checkpoint (broker down)
        self._parked: dict[str, tuple[int, ModelState, Inflight | None]] = {}
        # partitions paused because a model on them is backlogged (see _apply_backpressure)
        self.throttled: set[int] = set()
        self._probe_task: asyncio.Task | None = None
        # a failed assignment restore, retried in the background (see on_assigned)
        self._assign_task: asyncio.Task | None = None
        self.assign_failing_since: float | None = None
        self.assign_unhealthy_after = ASSIGN_UNHEALTHY_SECONDS
        # holes in fetched input offsets (see daemon.offset_gaps): counted, or read again
        self.gaps = OffsetGapGuard(refetch=k.offset_gaps == "refetch",
                                   grace_seconds=k.offset_gap_grace_seconds)
        # per input partition: {model: sample_rate} of its models with a rate < 1, for the
        # raw-bytes prefilter of _process (see _sample_out); and the configured models with a
        # rate < 1, which the prefilter samples on any partition until they are placed
        self._sampled: dict[int, dict[str, float]] = {}
        self._hot: dict[str, float] = {
            m: float(ms.sample_rate) for m, ms in settings.configured_models.items()
            if float(getattr(ms, "sample_rate", 1.0)) < 1.0}

    # ================================================================== lifecycle
    async def startup(self) -> None:
        from daemon.http_api import HttpServer

        self.http = HttpServer(self)
        await self.http.start()
        k = self.s.kafka
        sec = k
        self.producer = kafka_io.make_producer(
            k.bootstrap_servers, idempotence=k.enable_idempotence, security=sec,
            client_id=k.client_id, max_request_size=max(k.max_message_bytes, STATE_MAX_BYTES))
        # no producer compression: it runs on the event loop; large checkpoint values are
        # compressed by KafkaCheckpointStore in a worker thread instead
        await self._retry("producer start", self.producer.start)
        if k.create_topics:
            specs = [kafka_io.TopicSpec(self.t_pred, k.topic_partitions),
                     kafka_io.TopicSpec(self.t_out, k.topic_partitions),
                     kafka_io.TopicSpec(k.topics.binmaps, 1, configs=kafka_io.COMPACT),
                     kafka_io.TopicSpec(k.topics.deadletter, k.topic_partitions),
                     kafka_io.TopicSpec(k.topics.state, 1, configs=STATE_TOPIC_CONFIG)]
            await self._retry("topic creation",
                              lambda: kafka_io.ensure_topics(k.bootstrap_servers, specs,
                                                             security=sec))
        counts = await self._retry("partition check", lambda: kafka_io.partition_counts(
            k.bootstrap_servers, [self.t_pred, self.t_out], security=sec))
        kafka_io.check_copartitioned(counts, self.t_pred, self.t_out)
        if self._store is None:
            if self.s.state.backend == "local":
                self._store = LocalCheckpointStore(self.s.state.local_dir)
            else:
                self._store = KafkaCheckpointStore(self.producer, k.bootstrap_servers,
                                                   k.topics.state, security=sec)
        self.consumer = kafka_io.make_consumer(
            k.bootstrap_servers, group_id=k.group_id, security=sec, client_id=k.client_id,
            **self.consumer_options())
        await self._retry("consumer start", self.consumer.start)
        self.consumer.subscribe([self.t_pred, self.t_out], listener=_Rebalance(self))
        self.broker_ok = True
        self._probe_task = asyncio.create_task(self._probe_broker())
        # a long-lived service with a large, stable heap: move start-up objects out of the
        # collector's view and collect young objects less often (ingest allocates many short-
        # lived ones; measured about +30% ingest throughput, see tests/bench/bench_ingest.py)
        gc.freeze()
        gc.set_threshold(50_000, 50, 1000)
        if self.s.state.release_heap and not heap.available():
            log.info("state.release_heap: this C library has no malloc_trim; freed heap "
                     "memory stays resident until reused")
        self.started = True
        log.info("lpcal daemon started: group %s, topics %s/%s", k.group_id, self.t_pred,
                 self.t_out)

    def consumer_options(self) -> dict:
        """Options of the input consumer, from ``kafka.*`` settings (then ``consumer_options``
        given to the constructor, which override them: tests).

        The range assignor gives partition n of both co-partitioned topics to one member
        (aiokafka's default, round robin, would split a model's predictions and outcomes)."""
        k = self.s.kafka
        opts = dict(session_timeout_ms=k.session_timeout_ms,
                    heartbeat_interval_ms=k.heartbeat_interval_ms,
                    fetch_max_wait_ms=k.fetch_max_wait_ms,
                    max_partition_fetch_bytes=max(k.max_message_bytes, 1 << 20),
                    partition_assignment_strategy=(RangePartitionAssignor,))
        opts.update(self._consumer_options)
        return opts

    async def _retry(self, what: str, fn):
        """``await fn()`` until it succeeds; broker errors are retried with a backoff (0.5 s
        doubling to 10 s) that a stop signal cuts short: then :class:`StartupStopped`."""
        delay = 0.5
        while True:
            if self.stopping.is_set():
                raise StartupStopped(what)
            try:
                return await fn()
            except (kafka_io.TopicLayoutError, LpcalError):
                raise
            except Exception as e:  # noqa: BLE001 - broker not reachable yet: retry until stopped
                if self.stopping.is_set():
                    raise StartupStopped(what) from None
                log.warning("%s failed (%s: %s); retrying in %.1f s", what,
                            type(e).__name__, e, delay)
                try:
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(delay * 2, 10.0)

    async def main_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                batch = await self.consumer.getmany(timeout_ms=250, max_records=5000)
            except Exception as e:  # noqa: BLE001 - a broker fault must not kill the loop
                log.warning("fetch failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(0.5)
                batch = {}
            self.last_poll = time.monotonic()
            self.metrics.mark_poll()
            for tp, msgs in batch.items():
                if msgs and tp in self.assigned:
                    msgs = self._up_to_hole(tp, msgs)
                    if msgs:
                        self._process(tp, msgs)
            self._after_batch()
            if self._dlq is not None:
                await self._deadletters_after_batch()
            if time.monotonic() - self._last_ckpt >= self.s.state.checkpoint_interval_seconds:
                try:
                    await self.checkpoint()
                except Exception as e:  # noqa: BLE001 - broker trouble: keep the state, retry
                    log.warning("checkpoint failed (%s: %s); state kept, retrying in %.0f s",
                                type(e).__name__, e, self.s.state.checkpoint_interval_seconds)
                if self.s.state.release_heap:
                    heap.release_free_heap()
            await asyncio.sleep(0)

    async def shutdown(self) -> None:
        """Stop fetching, finish or checkpoint in-flight work, commit and close (bounded)."""
        grace = float(self.s.shutdown_grace_seconds)
        t0 = time.monotonic()
        # fits in flight get half the grace period to finish and publish; the rest stay in
        # flight in the final checkpoint
        pending = [i.task for i in self.inflight.values() if i.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=grace / 2)
            await asyncio.sleep(0)  # their done callbacks start the publishes
        if self._publishing:
            await asyncio.wait(set(self._publishing),
                               timeout=max(0.0, grace / 2 - (time.monotonic() - t0)))
        try:
            if self.consumer is not None and self.assigned:
                left = max(1.0, grace - (time.monotonic() - t0) - 2.0)
                await asyncio.wait_for(self.checkpoint(commit=True), timeout=left)
        except Exception as e:  # noqa: BLE001
            log.error("final checkpoint failed: %s: %s", type(e).__name__, e)
        if self._probe_task:
            self._probe_task.cancel()
        self._cancel_assignment_retry()
        # a restore still running (assignment phase) holds aiokafka's close, which waits for
        # the rebalance listener: it is abandoned after RESTORE_ABANDON_SECONDS (its
        # partitions are paused until restored, so nothing was processed that needs saving)
        restoring = bool(self.assigned) and not self.restored
        for name, closer in (("consumer", self.consumer), ("producer", self.producer)):
            if closer is not None:
                left = max(0.5, grace - (time.monotonic() - t0))
                if name == "consumer" and restoring:
                    left = min(left, RESTORE_ABANDON_SECONDS)
                try:
                    await asyncio.wait_for(closer.stop(), timeout=left)
                except TimeoutError:
                    log.warning("%s close did not finish within %.1f s%s", name, left,
                                ": restore in progress abandoned" if name == "consumer"
                                and restoring else "")
                except Exception as e:  # noqa: BLE001
                    log.warning("%s close: %s", name, e)
        if self.http is not None:
            await self.http.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("lpcal daemon stopped in %.1f s", time.monotonic() - t0)

    async def serve(self, install_signals: bool = True) -> None:
        """Run until SIGTERM/SIGINT (or ``stopping`` is set).

        A stop during startup (broker unreachable and retried, topic checks, a call that
        hangs) ends it at once: the startup task is cancelled, :meth:`shutdown` closes what
        was opened, and ``serve`` returns normally (exit code 0)."""
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            if not await self._start_unless_stopped():
                log.info("stopped during startup")
                return
            await self.main_loop()
        finally:
            await self.shutdown()

    async def _start_unless_stopped(self) -> bool:
        """Run :meth:`startup` until it finishes (True) or a stop is requested (False);
        startup errors other than the stop propagate."""
        start = asyncio.create_task(self.startup(), name="lpcal-startup")
        stop = asyncio.create_task(self.stopping.wait(), name="lpcal-stop-wait")
        try:
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not start.done():
                start.cancel()
            # wait for the cancellation: startup's own cleanup runs before shutdown()
            await asyncio.gather(start, stop, return_exceptions=True)
        if start.cancelled():
            return False
        exc = start.exception()
        if isinstance(exc, StartupStopped):
            return False
        if exc is not None:
            raise exc
        return True  # started (a stop that came meanwhile ends main_loop at once)

    def _on_signal(self, sig) -> None:
        if self.stopping.is_set():
            log.error("second signal: exiting now")
            os._exit(1)
        log.info("received %s: shutting down", signal.Signals(sig).name)
        self.stopping.set()

    @property
    def ready(self) -> bool:
        return self.started and self.restored and self.broker_ok

    async def _probe_broker(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.producer.client.fetch_all_metadata(), 3.0)
                self.broker_ok = True
            except Exception:  # noqa: BLE001
                self.broker_ok = False
            self.metrics.set_ready(self.ready)
            await asyncio.sleep(2.0)

    # ================================================================== rebalance
    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        """Rebalance listener: pause the partitions, restore their models, position them,
        resume. Never raises (aiokafka swallows listener exceptions, which left every partition
        paused for good): a failure is logged and the restore retried in the background with
        a backoff (:meth:`_retry_assignment`); the partitions stay paused until it succeeds,
        and ``/healthz`` fails once it has kept failing for ``assign_unhealthy_after`` s."""
        self._cancel_assignment_retry()
        self.restored = False
        new = {tp for tp in tps if tp not in self.assigned}
        kept = set(tps) - new
        self.assigned = set(tps)
        # aiokafka keeps fetching while this callback awaits the restore: pause the partitions
        # so no record is processed before its model's checkpoint is restored and the
        # partition is positioned (else checkpointed samples would be lost, others doubled)
        if tps:
            self.consumer.pause(*tps)
        try:
            # partitions kept across a rejoin (e.g. after the coordinator was lost): aiokafka
            # may have reset their fetch position to the committed offset; continue where we are
            for tp in kept:
                pos = self.positions.get((tp.topic, tp.partition))
                if pos is not None:
                    self.consumer.seek(tp, pos)
            await self._restore_assignment(set(tps), new)
        except Exception as e:  # noqa: BLE001 - retried; never lost in aiokafka's listener
            self._assignment_failed(e)
            self._assign_task = asyncio.create_task(
                self._retry_assignment(set(tps), new), name="lpcal-assignment-retry")
        else:
            self.assign_failing_since = None

    def _assignment_failed(self, e: BaseException) -> None:
        if self.assign_failing_since is None:
            self.assign_failing_since = time.monotonic()
        log.error("assignment of partitions %s failed (%s: %s); partitions stay paused, "
                  "retrying (failing for %.1f s; /healthz fails after %.0f s)",
                  sorted({tp.partition for tp in self.assigned}), type(e).__name__, e,
                  time.monotonic() - self.assign_failing_since, self.assign_unhealthy_after)

    async def _retry_assignment(self, tps: set[TopicPartition],
                                new: set[TopicPartition]) -> None:
        delay = _ASSIGN_RETRY_FIRST
        while not self.stopping.is_set() and self.assigned == tps:
            try:
                await asyncio.wait_for(self.stopping.wait(), delay)
                return
            except TimeoutError:
                pass
            delay = min(2 * delay, _ASSIGN_RETRY_MAX)
            try:
                await self._restore_assignment(tps, new)
            except Exception as e:  # noqa: BLE001
                self._assignment_failed(e)
                continue
            log.info("assignment restored after failing for %.1f s",
                     time.monotonic() - (self.assign_failing_since or time.monotonic()))
            self.assign_failing_since = None
            return

    def _cancel_assignment_retry(self) -> None:
        if self._assign_task is not None:
            self._assign_task.cancel()
            self._assign_task = None

    @property
    def assignment_unhealthy(self) -> bool:
        """True once restoring the assignment has kept failing for ``assign_unhealthy_after``
        seconds: ``/healthz`` then fails, so that Kubernetes restarts the pod."""
        since = self.assign_failing_since
        return since is not None and time.monotonic() - since > self.assign_unhealthy_after

    async def _restore_assignment(self, tps: set[TopicPartition],
                                  new: set[TopicPartition]) -> None:
        """Restore the models of the ``new`` partitions from their checkpoints, seek them, and
        resume every partition of ``tps`` that is not backlogged. Every state record is decoded
        and restored on its own (:meth:`_restore_model`, :meth:`_read_manifest`): one that
        cannot be used is counted, logged with its location and skipped, never the partition.
        Safe to run again after a failure (models restored already are kept)."""
        parts = {tp.partition for tp in new}
        if parts:
            records = await self._load_checkpoints()  # raw values, decoded one at a time
            where = getattr(self._store, "where", None) or (lambda key: key)
            manifests: dict[int, dict[str, int]] = {}
            for key in [k for k in records if k.startswith("partition/")]:
                part, offsets = self._read_manifest(key, records.pop(key), parts, where)
                if offsets is not None:
                    manifests[part] = offsets
            for key in sorted(k for k in records if k.startswith("model/")):
                self._restore_model(key[6:], records.pop(key), parts, where=where(key))
            records.clear()
            self._unpark(parts)
            await self._adopt_published_binmaps(parts)
            for tp in new:
                off = manifests.get(tp.partition, {}).get(tp.topic)
                if off is None:
                    offs = [st.offsets.get(tp.topic, {}).get(tp.partition) for m, st in
                            self.models.items() if self.partition_of.get(m) == tp.partition]
                    offs = [o for o in offs if o is not None]
                    off = min(offs) if offs else None
                if off is None:
                    await self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, int(off))
                    self.positions[(tp.topic, tp.partition)] = int(off)
            for model, inf in self.inflight.items():
                if inf.task is None and self.partition_of.get(model) in parts:
                    self._launch_fit(model, inf)
        # restored backlogs stay paused (see _apply_backpressure)
        self.throttled = self._backlogged_partitions() & {tp.partition for tp in tps}
        resume = [tp for tp in tps if tp.partition not in self.throttled]
        if resume:
            self.consumer.resume(*resume)
        self.restored = True
        self.metrics.set_ready(self.ready)
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in tps))

    def _read_manifest(self, key: str, raw: bytes, parts: set[int], where
                       ) -> tuple[int, dict[str, int] | None]:
        """``(partition, {topic: offset})`` of a manifest record of one of ``parts``, or
        ``(partition, None)`` (not ours, or unusable: counted and logged, then the partition
        is positioned from its model records as if it had no manifest)."""
        try:
            part = int(key.split("/", 1)[1])
        except ValueError:
            return -1, None  # not a manifest this daemon writes: no partition of ours
        if part not in parts:
            return part, None
        try:
            m = orjson.loads(decode_value(raw, self.s.state.max_record_bytes))
            if not isinstance(m, dict) or not isinstance(m.get("offsets"), dict):
                raise TypeError("not an object with an 'offsets' object")
            offsets = {}
            for topic in (self.t_pred, self.t_out):
                off = m["offsets"].get(topic)
                if off is None:
                    continue
                if type(off) is not int or off < 0:
                    raise ValueError(f"offset of {topic!r} is {off!r}, not an integer >= 0")
                offsets[topic] = off
        except ValueTooLarge as e:
            self.metrics.inc_restore("too_large")
            log.error("ignoring manifest %s at %s: %s", key, where(key), e)
            return part, None
        except (TypeError, ValueError, orjson.JSONDecodeError) as e:
            self.metrics.inc_restore("bad_manifest")
            log.error("ignoring unusable manifest %s at %s: %s", key, where(key), e)
            return part, None
        return part, offsets

    async def _load_checkpoints(self) -> dict[str, bytes]:
        """All checkpoint records; retried while the broker is unreachable (bounded)."""
        delay, deadline = 0.5, time.monotonic() + 60.0
        while True:
            try:
                return await self._store.load_all()
            except Exception as e:
                if time.monotonic() > deadline or self.stopping.is_set():
                    raise
                log.warning("reading checkpoints failed (%s: %s); retrying in %.1f s",
                            type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    def _unpark(self, parts: set[int]) -> None:
        """Reinstate parked states of re-assigned partitions when they are further along than
        the checkpoint restored (or there is none): their covered offsets decide."""
        for model, (part, st, inf) in list(self._parked.items()):
            if part not in parts:
                continue
            del self._parked[model]
            cur = self.models.get(model)

            def covered(s):
                return sum(o for t in s.offsets.values() for o in t.values())

            if cur is not None and covered(cur) >= covered(st):
                continue
            self.models[model] = st
            self.partition_of[model] = part
            self.parser.admit(model, st.k)
            self.metrics.register_model(model, restored=True)
            self.inflight.pop(model, None)
            if inf is not None:
                self.inflight[model] = inf
            self.dirty.add(model)
            log.info("model %s: reinstated the state kept in memory (its checkpoint failed)",
                     model)

    def _restore_model(self, model: str, value: bytes, parts: set[int], *,
                       where: str = "?") -> None:
        """Restore ``model`` from its record (raw, maybe compressed) if it belongs to one of
        ``parts``. The record is decoded here, alone, within ``state.max_record_bytes``; one
        that is too large, unreadable, or holds another model's state (its key and its
        ``model`` differ) is counted in ``lpcal_state_restores_total{outcome}``, logged with
        its location ``where`` and skipped: the model starts fresh. A restored model is always
        admitted (even beyond ``max_models``), and reconciled with the current settings
        (:meth:`ModelState.reconcile`: a changed k or config is logged and counted)."""
        try:
            value = decode_value(value, self.s.state.max_record_bytes)
        except ValueTooLarge as e:
            self.metrics.inc_restore("too_large")
            log.error("cannot restore model %r from %s: %s", model, where, e)
            return
        except ValueError as e:
            self.metrics.inc_restore("corrupt")
            log.error("cannot restore model %r from %s: %s", model, where, e)
            return
        try:
            env = orjson.loads(value)
            del value
            if not isinstance(env, dict):
                raise ArtifactError(f"envelope is a JSON {type(env).__name__}, not an object")
            if env.get("format") != ENVELOPE_FORMAT:
                raise ArtifactError(f"format {env.get('format')!r}")
            part = env.get("partition")
            if type(part) is not int:
                raise ArtifactError(f"partition {part!r} is not an integer")
            if part not in parts or model in self.models:
                return
            owner = env.get("model", model)
            st = ModelState.from_checkpoint(orjson.dumps(env["state"]))
            if owner != model or st.model != model:
                self.metrics.inc_restore("wrong_model")
                log.error("skipping the state record of model %r at %s: it holds the state of "
                          "model %r; model %r starts fresh", model, where,
                          st.model if st.model != model else owner, model)
                return
            prefitted = env.get("prefitted") or 0
            if type(prefitted) is not int or not 0 <= prefitted <= 1_000_000:
                raise ArtifactError(f"prefitted {prefitted!r}")
            inf = env.get("inflight")
            inflight = None
            if inf:
                inflight = Inflight(PoolSet.from_dict(inf["pools"]), str(inf["trigger"]),
                                    int(inf["version"]))
            ms = self.s.model_settings(model)
            outcome, detail = "restored", ""
            if ms is not None:
                st, outcome, detail = st.reconcile(ms, self.s.join, getattr(ms, "k", None))
        except Exception as e:  # noqa: BLE001 - any bad record costs its model only
            self.metrics.inc_restore("corrupt")
            log.error("cannot restore model %r from %s: %s: %s", model, where,
                      type(e).__name__, e)
            return
        if outcome != "restored":
            inflight, prefitted = None, 0  # fitted from pools of the old settings
            log.warning("model %s: settings changed since its checkpoint (%s): %s", model,
                        outcome, detail)
        self.metrics.inc_restore(outcome)
        self.models[model] = st
        self.partition_of[model] = part
        self.parser.admit(model, st.k)
        self.metrics.register_model(model, restored=True)
        st.sample_rate = ms.sample_rate if ms is not None else 1.0  # the settings decide it
        if st.sample_rate < 1.0:
            self._sampled.setdefault(part, {})[model] = st.sample_rate
        self.prefitted[model] = prefitted
        if inflight is not None:
            self.inflight[model] = inflight
        if outcome != "restored":
            self.dirty.add(model)
        if st.binmap is not None:
            self.metrics.set_binmap_published(model, st.binmap_version)
            self._export_certificate(model, st.binmap)

    async def _adopt_published_binmaps(self, parts: set[int]) -> None:
        """Install bin maps published after the last checkpoint (a crash between publishing and
        checkpointing). Every record is verified (:meth:`verify_binmap`); a corrupt, truncated
        or incompatible one, one not signed by this daemon's key(s) when signing is configured,
        and one whose k or lambda does not fit the model's state are rejected and counted, and
        the model keeps its previous good map: only maps this deployment signed set a version."""
        try:
            latest = await kafka_io.read_compacted_latest(
                self.s.kafka.bootstrap_servers, self.s.kafka.topics.binmaps, timeout=30.0,
                security=self.s.kafka, missing_ok=True)
        except Exception as e:  # noqa: BLE001 - the checkpointed maps stay in force
            log.warning("cannot read %s: %s", self.s.kafka.topics.binmaps, e)
            return
        for model, data in latest.items():
            st = self.models.get(model)
            if st is None or self.partition_of.get(model) not in parts or data is None:
                continue
            bm = self.verify_binmap(data, model)
            if bm is None or bm.version <= st.binmap_version:
                continue
            # versions after the checkpoint's were fitted from the fit in flight, then from the
            # oldest sealed epochs, in order: those epochs are consumed, not fitted again
            steps = bm.version - st.binmap_version
            inf = self.inflight.get(model)
            if inf is not None and inf.version <= bm.version:
                del self.inflight[model]  # its result was published before the crash
                steps -= 1
            while steps > 0 and st.pools.full:
                st.start_new_epoch()
                steps -= 1
            # epochs still filling at the checkpoint: the replay seals them again; they were
            # fitted already (as the adopted versions), so they are consumed without a refit
            if steps > 0:
                self.prefitted[model] = self.prefitted.get(model, 0) + steps
            log.info("model %s: adopting version %d over checkpointed %d (in flight: %s, "
                     "prefitted now %d)", model, bm.version, st.binmap_version,
                     None if inf is None else inf.version, self.prefitted.get(model, 0))
            st.install_binmap(data, bm.version)
            self.dirty.add(model)
            self.metrics.set_binmap_published(model, bm.version)
            self._export_certificate(model, bm.certificate)
            log.info("model %s: adopted published bin map version %d", model, bm.version)

    def verify_binmap(self, data: bytes, model: str):
        """``BinMap`` of ``data`` if it verifies, is signed by one of the daemon's keys (when
        ``signing`` is configured), belongs to ``model`` and has the k and lambda of the model's
        state; else None, counted in ``lpcal_binmaps_rejected_total{reason}``."""
        from lpcal.client import BinMapRejected, verify_artifact

        try:
            bm = verify_artifact(data, where=f"bin map of {model!r}",
                                 public_keys=self.s.signing.keyring())
        except BinMapRejected as e:
            self.metrics.inc_binmap_rejected(e.reason)
            log.error("rejected %s", e)
            return None
        if bm.model_id != model:
            self.metrics.inc_binmap_rejected("model")
            log.error("rejected bin map under key %r: it is for model %r", model, bm.model_id)
            return None
        st = self.models.get(model)
        if st is not None and (bm.k, bm.lam) != (st.k, st.lam):
            self.metrics.inc_binmap_rejected("config")
            log.error("rejected bin map version %d of model %r: (k, lambda) = (%d, %d), but the "
                      "model's state has (%d, %d)", bm.version, model, bm.k, bm.lam, st.k,
                      st.lam)
            return None
        return bm

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        self._cancel_assignment_retry()
        self.assign_failing_since = None
        parts = {tp.partition for tp in tps}
        if parts:
            self.restored = False  # not ready again until the new assignment is restored
            self.metrics.set_ready(False)
        saved = True
        if parts and self.consumer is not None:
            try:
                await self.checkpoint(parts, commit=True)
            except Exception as e:  # noqa: BLE001
                saved = False
                log.error("checkpoint on revoke failed (%s: %s): keeping the state of "
                          "partitions %s in memory in case they come back", type(e).__name__,
                          e, sorted(parts))
        for model in [m for m, p in self.partition_of.items() if p in parts]:
            inf = self.inflight.pop(model, None)
            if inf is not None and inf.task is not None:
                inf.task.cancel()
            st = self.models.pop(model)
            if not saved:  # parked: on reassignment, the state further along wins
                inf_copy = None if inf is None else Inflight(inf.pools, inf.trigger, inf.version)
                self._parked[model] = (self.partition_of[model], st, inf_copy)
            self.partition_of.pop(model, None)
            self.dirty.discard(model)
            self._gauges_due.discard(model)
            self._last_gauges.pop(model, None)
            self.metrics.remove_model(model)
        for tp in tps:
            self.positions.pop((tp.topic, tp.partition), None)
            self.gaps.forget((tp.topic, tp.partition))
            self._sampled.pop(tp.partition, None)
        self.assigned -= set(tps)

    # ================================================================== ingest
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
        import gc
        from operator import attrgetter

        from daemon.events import RecordTimestamps

        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            topic_kind = self._topic_kind(tp.topic)
            end = msgs[-1].offset + 1
            self.metrics.inc_consumed(topic_kind, len(msgs))
            rates = self._sampled.get(tp.partition)
            if (rates or self._hot) and native.SPEEDUPS is not None:
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
                self.dirty.add(model)
                if res.sampled_out:
                    self.metrics.inc_sampled_out(model, topic_kind, res.sampled_out)
                if st.sample_rate < 1.0:
                    self._sampled.setdefault(tp.partition, {})[model] = st.sample_rate
                if res.joined:
                    self.metrics.inc_joined(model, res.joined)
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
        partition holds yet (``self._hot`` minus ``self.partition_of``), so that a hot model is
        sampled from its first batch on; a model placed on another partition is not sampled
        here (its events are dead-lettered there, as on the Python path). Events it cannot
        decide there (escaped or non-ASCII ids, anything unusual) are parsed and sampled by
        ``ModelState.offer`` with the same rule; so is everything on the pure-Python path.
        Dropped events are counted, not validated (an invalid event of a sampled model is
        dead-lettered only if kept). Returns the records kept and their values."""
        kept, values, counts = native.SPEEDUPS.sample_records(
            msgs if type(msgs) is list else list(msgs), rates, self.parser.max_bytes,
            self.parser.max_id_len, self._hot or None, self.partition_of)
        for model, k in counts.items():
            self.metrics.inc_sampled_out(model, topic_kind, k)
        return kept, values

    def _state_for(self, model: str, mb: ModelBatch, tp: TopicPartition) -> ModelState | None:
        st = self.models.get(model)
        if st is not None:
            return st if self.partition_of[model] == tp.partition else None
        # k = 0: outcomes before the first prediction of a model whose k is learned; they
        # wait in its join buffer (issue 11, finding 6)
        k = mb.k or self.parser.k.get(model) or 0
        ms = self.s.model_settings(model)
        st = ModelState.create(model, int(k), ms, self.s.join)
        self.models[model] = st
        self.partition_of[model] = tp.partition
        self.metrics.register_model(model)
        self.metrics.set_drift_threshold(model, st.config["drift_threshold"])
        return st

    def _deadletter(self, tp: TopicPartition, msg, reason: str) -> None:
        """Queue ``msg`` for the dead-letter topic with its reason: produced in batches and
        pipelined by :class:`daemon.kafka_io.DeadLetterQueue`. Counted in the metrics per batch
        (:meth:`_count_deadletters`, before the main loop awaits anything)."""
        headers = [(kafka_io.DLQ_REASON, reason.encode()),
                   (kafka_io.DLQ_SOURCE_TOPIC, tp.topic.encode()),
                   (kafka_io.DLQ_SOURCE_PARTITION, str(tp.partition).encode()),
                   (kafka_io.DLQ_SOURCE_OFFSET, str(msg.offset).encode())]
        if self._dlq is None:
            self._dlq = kafka_io.DeadLetterQueue(self.producer, self.s.kafka.topics.deadletter)
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

    # ================================================================== triggers and fits
    def _after_batch(self) -> None:
        now = time.monotonic()
        # models with sealed epochs too: a restored backlog on a paused partition brings no
        # new events (so never turns dirty), yet its fits must run for ingest to resume
        waiting = {m for m, st in self.models.items() if st.sealed}
        for model in list(self.dirty | waiting):
            self._check_model(model, now)
        self._export_due_gauges(now)
        self._apply_backpressure()
        if now - self._last_lag >= _LAG_EVERY:
            self._last_lag = now
            self._export_lag()

    def _check_model(self, model: str, now: float) -> None:
        """Ask ``model``'s triggers what to do; launch a fit or a refill; export its gauges."""
        st = self.models.get(model)
        if st is None:
            return
        firing = st.check_triggers(self.event_time.get(model, 0.0),
                                   busy=model in self.inflight)
        if (firing is not None and firing.action == "fit" and st.pools.full
                and self.prefitted.get(model, 0) > 0):
            st.start_new_epoch()  # this epoch's bin map was published before a crash
            self.prefitted[model] -= 1
            firing = None
            log.info("model %s: epoch already fitted as version %d before a restart; "
                     "not fitted again", model, st.binmap_version)
        if firing is not None:
            if firing.action == "refill":
                log.info("model %s: drift detected, refilling pools", model)
                st.start_new_epoch()
            elif st.pools.tables["mu"].total > 0:
                st.pools.compact()  # the fit thread then only reads these tables
                inf = Inflight(st.pools, firing.trigger, st.binmap_version + 1)
                st.start_new_epoch()
                self.inflight[model] = inf
                self._launch_fit(model, inf)
        self._gauges_due.add(model)

    def _export_due_gauges(self, now: float) -> None:
        """Export the gauges of models checked since their last export, at most once per
        :data:`_GAUGE_EVERY` seconds per model; the others stay due for a later poll."""
        for model in list(self._gauges_due):
            st = self.models.get(model)
            if st is None:
                self._gauges_due.discard(model)
            elif now - self._last_gauges.get(model, 0.0) >= _GAUGE_EVERY:
                self._last_gauges[model] = now
                self._gauges_due.discard(model)
                self._export_gauges(model, st)

    def _backlogged_partitions(self) -> set[int]:
        return {self.partition_of[m] for m, st in self.models.items()
                if st.backlogged and m in self.partition_of}

    def _apply_backpressure(self) -> None:
        """Pause the input partitions of backlogged models, resume them once fits caught up.

        A model is backlogged while :data:`daemon.model_state.MAX_SEALED` full epochs wait for
        their fit (a backlog consumed faster than fits run: after a restart, or with pools that
        fill in milliseconds). Pausing instead of dropping epochs keeps every published version
        a function of the input alone; the cost is consumer lag, which is exported and alerted
        on. Pausing is lossless: aiokafka discards fetched records of a paused partition and
        fetches again from the consumed position on resume."""
        if self.consumer is None:
            return
        assigned = {tp.partition for tp in self.assigned}
        want = self._backlogged_partitions() & assigned
        pause = want - self.throttled
        resume = (self.throttled - want) & assigned
        if pause:
            self.consumer.pause(*[tp for tp in self.assigned if tp.partition in pause])
            log.info("partitions %s paused: fits are behind (%d+ sealed epochs waiting)",
                     sorted(pause), MAX_SEALED)
        if resume:
            self.consumer.resume(*[tp for tp in self.assigned if tp.partition in resume])
            log.info("partitions %s resumed: fits caught up", sorted(resume))
        self.throttled = want

    def _export_gauges(self, model: str, st: ModelState) -> None:
        m = self.metrics
        m.set_pool_fill(model, st.pools.fill())
        m.set_join_pending(model, st.join.pending(model))
        m.set_epochs_waiting(model, len(st.sealed))
        stats = st.evaluate()
        for pred in ("raw", "calibrated"):
            w = stats.get(pred)
            if w is not None:
                m.observe_quality(model, pred, w.err_p, min(w.ece, 1.0), min(w.brier, 2.0),
                                  w.accuracy)
        raw = stats.get("raw")
        m.set_window_samples(model, raw.n if raw is not None else 0)

    def _export_certificate(self, model: str, certificate: Any) -> None:
        """Export a bin map's held-out certificate (a dict, or the map's JSON bytes); a map
        without one clears the gauges. A malformed certificate is logged, never fatal."""
        try:
            if isinstance(certificate, (bytes, bytearray)):
                certificate = orjson.loads(certificate).get("certificate")
            self.metrics.set_certificate(model, certificate)
        except (InputError, orjson.JSONDecodeError, AttributeError) as e:
            log.warning("model %s: certificate not exported: %s", model, e)

    def _export_lag(self) -> None:
        lags = {"predictions": 0, "outcomes": 0}
        for tp in self.assigned:
            hw = self.consumer.highwater(tp)
            pos = self.positions.get((tp.topic, tp.partition))
            if hw is not None and pos is not None:
                lags[self._topic_kind(tp.topic)] += max(0, hw - pos)
        self.metrics.set_consumer_lags(lags)

    def _launch_fit(self, model: str, inf: Inflight) -> None:
        st = self.models[model]
        cfg = st.config
        loop = asyncio.get_running_loop()

        def work():
            t0 = time.perf_counter()
            bm = fit_pools(inf.pools, eps=cfg["eps"], p=cfg["p"], delta=cfg["delta"],
                           seed=fit_seed(model, inf.version), model_id=model,
                           version=inf.version, mode=cfg["mode"], outside=cfg["outside"])
            return bm, time.perf_counter() - t0

        inf.task = loop.run_in_executor(self._executor, work)
        inf.task.add_done_callback(
            lambda fut: self._track_publish(self._fit_done(model, inf, fut)))

    def _track_publish(self, coro) -> None:
        """Run ``coro`` (a :meth:`_fit_done`) as a task that :meth:`shutdown` can wait for."""
        task = asyncio.ensure_future(coro)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _fit_done(self, model: str, inf: Inflight, fut) -> None:
        """Publish the bin map of a finished fit, then install it and chain the next fit.

        A fit that raised is counted and its epoch dropped (the same pools would raise again).
        A publish that fails is counted and retried with backoff while the fit stays in flight
        (checkpointed, so a restart refits it: fits are deterministic); on shutdown it is left
        to the checkpoint."""
        if fut.cancelled() or self.inflight.get(model) is not inf:
            return
        try:
            bm, seconds = fut.result()
            data = bm.to_json(signer=self.s.signing.signer())  # signed when a key is set
        except Exception as e:  # noqa: BLE001 - a failed fit is counted, never fatal
            log.error("model %s: recalibration (version %d) failed: %s: %s", model,
                      inf.version, type(e).__name__, e)
            self.metrics.inc_calibration_failure(model)
            self.inflight.pop(model, None)
            self.dirty.add(model)
            return
        delay = _PUBLISH_RETRY_FIRST
        while True:
            if self.inflight.get(model) is not inf:
                log.info("model %s: bin map version %d not published: the model was revoked "
                         "(its new owner fits it again from the checkpoint)", model, inf.version)
                return
            try:
                await self.producer.send_and_wait(
                    self.s.kafka.topics.binmaps, key=model.encode(), value=data,
                    headers=[("lpcal.version", str(inf.version).encode())])
                break
            except Exception as e:  # noqa: BLE001 - broker trouble: retried, never fatal
                if self.stopping.is_set():
                    log.info("model %s: bin map version %d not published before shutdown "
                             "(%s); it stays in flight in the checkpoint and is fitted again "
                             "after a restart", model, inf.version, type(e).__name__)
                    return
                self.metrics.inc_calibration_failure(model)
                log.warning("model %s: publishing bin map version %d failed (%s: %s); "
                            "retrying in %.1f s", model, inf.version, type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _PUBLISH_RETRY_MAX)
        st = self.models.get(model)
        if st is None or self.inflight.get(model) is not inf:
            return
        st.install_binmap(data, inf.version)
        del self.inflight[model]
        self.dirty.add(model)
        self.metrics.observe_fit(model, inf.trigger, seconds, bm.iterations, bm.n_bins)
        self.metrics.set_binmap_published(model, inf.version)
        self._export_certificate(model, bm.certificate)
        log.info("model %s: published bin map version %d (%s, |B|=%d, %d iterations, %s, "
                 "%.3f s)", model, inf.version, inf.trigger, bm.n_bins, bm.iterations,
                 bm.stop_reason, seconds)
        # the next sealed epoch (if any) need not wait for the next poll, which may be idle
        # for a whole fetch timeout when its partitions are paused
        self._check_model(model, time.monotonic())
        self._apply_backpressure()

    def request_recalibration(self, model: str) -> bool:
        st = self.models.get(model)
        if st is None:
            return False
        st.triggers.request_manual()
        self.dirty.add(model)
        return True

    # ================================================================== checkpoints
    def _envelope(self, model: str) -> bytes:
        st = self.models[model]
        inf = self.inflight.get(model)
        return orjson.dumps({
            "format": ENVELOPE_FORMAT,
            "model": model,
            "partition": self.partition_of[model],
            "state": orjson.Fragment(st.to_checkpoint()),
            "inflight": None if inf is None else {
                "pools": inf.pools.to_dict(), "trigger": inf.trigger, "version": inf.version},
            "prefitted": self.prefitted.get(model, 0),
        })

    async def checkpoint(self, parts: set[int] | None = None, commit: bool = True) -> None:
        """Checkpoint the models of ``parts`` (default: all assigned), then their manifests."""
        self._last_ckpt = time.monotonic()
        if parts is None:
            parts = {tp.partition for tp in self.assigned}
        try:
            if self._dlq:
                await self._flush_deadletters()
            models = [m for m, p in self.partition_of.items() if p in parts]
            for m in models:
                st, p = self.models[m], self.partition_of[m]
                for topic in (self.t_pred, self.t_out):
                    pos = self.positions.get((topic, p))
                    if pos is not None:
                        st.advance_offsets(topic, p, pos)
            # snapshot synchronously; marks set while the save is awaited stay for next time
            todo = {m for m in models if m in self.dirty or m in self.inflight}
            self.dirty -= todo
            try:
                records = {f"model/{m}": self._envelope(m) for m in sorted(todo)}
                manifests = {}
                for p in parts:
                    offs = {t: self.positions[(t, p)] for t in (self.t_pred, self.t_out)
                            if (t, p) in self.positions}
                    if offs:
                        manifests[f"partition/{p}"] = orjson.dumps(
                            {"offsets": offs, "models": sorted(m for m in models
                                                               if self.partition_of[m] == p)})
                if records:
                    await self._store.save(records)
                if manifests:
                    await self._store.save(manifests)
            except BaseException:
                self.dirty |= {m for m in todo if m in self.models}
                raise
            self.metrics.inc_checkpoint("ok")
        except Exception:
            self.metrics.inc_checkpoint("error")
            raise
        if commit and self.consumer is not None:
            offsets = {TopicPartition(t, p): o for (t, p), o in self.positions.items()
                       if p in parts}
            if offsets:
                try:
                    await self.consumer.commit(offsets)
                except Exception as e:  # noqa: BLE001 - commits only feed lag monitoring
                    log.warning("offset commit failed: %s", e)
