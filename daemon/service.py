"""The lpcal daemon: consume, join, pool, monitor, recalibrate, publish, checkpoint.

Lifecycle (after uvicorn's ``Server``): ``startup`` (HTTP first, so probes answer; then producer,
topics, consumer), ``main_loop`` (``getmany`` batches until asked to stop), ``shutdown`` (stop
fetching, let fits in flight finish for up to half the grace period, checkpoint what is left,
commit, leave the group, close), all within ``shutdown_grace_seconds``. SIGTERM/SIGINT start the
shutdown; a second signal exits at once.

Code map: this module holds the lifecycle and the rebalance callbacks; the owned models live in
a :class:`~daemon.registry.ModelRegistry` (one slot per model; ``models``, ``partition_of``,
``inflight``, ``prefitted`` and ``dirty`` are its views); the rest of :class:`Daemon` is mixed
in from :mod:`daemon.clients` (producer, topics, consumer options, broker probe),
:mod:`daemon.ingest` (batches, parsing, dead letters), :mod:`daemon.fitting` (triggers, fits,
publishing, backpressure), :mod:`daemon.gauges`, :mod:`daemon.checkpointing` (writing
checkpoints; the exactly-once accounting) and :mod:`daemon.restore` (restoring an assignment);
broker calls are retried by :mod:`daemon.retry`.

Co-partitioning: events are keyed by model id and both input topics have the same partition
count, so partition ``n`` of both topics holds the same models; the range assignor gives both to
the same replica, which owns those models. Rebalances checkpoint revoked partitions before
handing them over, and the new owner restores them: this is how a deployment scales out.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
from aiokafka import ConsumerRebalanceListener, TopicPartition

from daemon import heap, retry
from daemon.binmap_view import BinMapView, settings_fit
from daemon.checkpoint_store import CheckpointStore
from daemon.checkpointing import (  # noqa: F401 - re-exported (tests write envelopes)
    CHECKPOINT_BATCH_BYTES,
    ENVELOPE_FORMAT,
    Checkpointing,
    state_topic_config,
)
from daemon.clients import KafkaClients
from daemon.events import EventParser
from daemon.fitting import Fitting, fit_seed  # noqa: F401 - fit_seed: re-exported
from daemon.gauges import _GAUGE_EVERY, Gauges  # noqa: F401 - _GAUGE_EVERY: re-exported
from daemon.ingest import WRONG_PARTITION, Ingest, subset  # noqa: F401 - re-exported
from daemon.kafka.clients import make_consumer
from daemon.metrics import DaemonMetrics
from daemon.registry import Inflight, ModelRegistry  # noqa: F401 - Inflight: re-exported
from daemon.restore import ASSIGN_UNHEALTHY_SECONDS, Restore
from lpcal.calibrate import fit_pools  # noqa: F401 - daemon.fitting calls it here (tests patch)

log = logging.getLogger("lpcal.daemon")

_PUBLISH_RETRY_FIRST, _PUBLISH_RETRY_MAX = 0.5, 30.0  # seconds between bin-map publish attempts
RESTORE_ABANDON_SECONDS = 2.0  # shutdown: how long a restore still running may hold the close
#: shutdown: how long a consumer-group join in progress may hold the consumer's close (aiokafka
#: waits for the join to finish, seconds on a slow coordinator); nothing is assigned to save
JOIN_ABANDON_SECONDS = 1.0


#: a stop signal arrived while startup was still retrying (``Daemon._retry``, daemon.clients)
StartupStopped = retry.Stopped


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, daemon: Daemon):
        self.d = daemon

    async def on_partitions_revoked(self, revoked):
        await self.d.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.d.on_assigned(set(assigned))


class Daemon(KafkaClients, Ingest, Fitting, Gauges, Checkpointing, Restore):
    """One replica of the calibration service (see the module docstring)."""

    def __init__(self, settings, *, metrics: DaemonMetrics | None = None,
                 store: CheckpointStore | None = None, consumer_options: dict | None = None):
        self.s = settings
        self.t_pred, self.t_out = settings.kafka.topics.predictions, settings.kafka.topics.outcomes
        self.metrics = metrics or DaemonMetrics(max_models=settings.max_models)
        self.parser = EventParser.from_settings(settings)
        self.registry = ModelRegistry(settings, self.metrics, self.parser)
        self.assigned: set[TopicPartition] = set()
        self._store = store
        self._consumer_options = consumer_options or {}
        self.producer = self.consumer = self.http = None
        self.stopping = asyncio.Event()
        self.stop_requested_at: float | None = None  # time.monotonic() of the stop signal
        self._stop_waiter: asyncio.Future | None = None  # stopping.wait(), in main_loop
        #: every model's latest verified bin map, from the bin-map topic (see startup)
        self.binmaps: BinMapView | None = None
        self.restored = self.broker_ok = self.started = False
        self.last_poll = time.monotonic()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpcal-fit")
        self._last_ckpt = time.monotonic()
        self._publishing: set[asyncio.Task] = set()  # bin-map publishes (with their retries)
        self._last_lag = 0.0
        # partitions paused because a model on them is backlogged (see _apply_backpressure)
        self.throttled: set[int] = set()
        self._probe_task: asyncio.Task | None = None
        # a failed assignment restore, retried in the background (see on_assigned)
        self._assign_task: asyncio.Task | None = None
        self.assign_failing_since: float | None = None
        self.assign_unhealthy_after = ASSIGN_UNHEALTHY_SECONDS
        # restore: model -> (where its record was, its snapshot's saved_at or None)
        self._restored_from: dict[str, tuple[str, float | None]] = {}
        self._init_ingest(settings)

    # the registry's views, under the names the daemon always had (read-only)
    models = property(lambda self: self.registry.models)
    partition_of = property(lambda self: self.registry.partition_of)
    inflight = property(lambda self: self.registry.inflight)
    prefitted = property(lambda self: self.registry.prefitted)
    dirty = property(lambda self: self.registry.dirty)
    _gauges_due = property(lambda self: self.registry.gauges_due)
    _sampled = property(lambda self: self.registry.sampled)

    # ================================================================== lifecycle
    async def startup(self) -> None:
        from daemon.http_api import HttpServer

        self.http = HttpServer(self)
        await self.http.start()
        if hasattr(self.s, "redacted"):  # served at GET /v1/config too
            log.info("effective settings (secrets redacted): %s",
                     orjson.dumps(self.s.redacted(), option=orjson.OPT_SORT_KEYS).decode())
        k = self.s.kafka
        await self._start_producer()  # and the topics: created (if configured) and checked
        self._start_binmap_view()
        await self._open_store()
        self.consumer = make_consumer(
            k.bootstrap_servers, group_id=k.group_id, security=k, client_id=k.client_id,
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

    def _start_binmap_view(self) -> None:
        """Follow the bin-map topic: every model's latest verified map, served over HTTP and
        the version floor of models without state (:mod:`daemon.binmap_view`)."""
        k = self.s.kafka

        def consumer():
            return make_consumer(
                k.bootstrap_servers, k.topics.binmaps, group_id=None, security=k,
                client_id=f"{k.client_id}-binmaps",
                max_partition_fetch_bytes=max(k.max_message_bytes, 1 << 20))

        self.binmaps = BinMapView(
            consumer, public_keys=self.s.signing.keyring(), metrics=self.metrics,
            # the models of the whole group: input partitions x max_models
            max_models=self.s.max_models * max(1, getattr(self, "input_partitions", 1)),
            max_record_bytes=k.max_message_bytes, fits=settings_fit(self.s))
        self.registry.published = self.binmaps.get
        self.binmaps.start()

    async def _fetch(self) -> dict:
        """One ``getmany``, cut short by a stop request: aiokafka's fetch waits while the
        consumer group is (re)joining, seconds on a slow coordinator, and a stop must not
        (two futures per poll: microseconds, against a batch of up to 5000 records)."""
        fetch = asyncio.ensure_future(self.consumer.getmany(timeout_ms=250, max_records=5000))
        if self._stop_waiter is None:
            self._stop_waiter = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((fetch, self._stop_waiter), return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done():
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)
            return {}
        return fetch.result()

    async def main_loop(self) -> None:
        self._stop_waiter = None
        try:
            await self._main_loop()
        finally:
            if self._stop_waiter is not None:
                self._stop_waiter.cancel()

    async def _main_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                batch = await self._fetch()
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
        # the close ends the group membership: a join still in progress (nothing assigned
        # yet, or since a revocation) is abandoned after JOIN_ABANDON_SECONDS
        joining = not self.assigned
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
                elif name == "consumer" and joining:
                    left = min(left, JOIN_ABANDON_SECONDS)
                try:
                    await asyncio.wait_for(closer.stop(), timeout=left)
                except TimeoutError:
                    why = ""
                    if name == "consumer":
                        why = (": restore in progress abandoned" if restoring else
                               ": group join in progress abandoned" if joining else "")
                    log.warning("%s close did not finish within %.1f s%s", name, left, why)
                except Exception as e:  # noqa: BLE001
                    log.warning("%s close: %s", name, e)
        if self.binmaps is not None:
            await self.binmaps.stop(timeout=1.0)
        if self.http is not None:
            await self.http.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        now = time.monotonic()
        if self.stop_requested_at is not None:
            log.info("lpcal daemon stopped in %.1f s (from the stop signal; shutdown %.1f s)",
                     now - self.stop_requested_at, now - t0)
        elif self.started:
            log.info("lpcal daemon stopped in %.1f s", now - t0)
        else:  # startup failed: its error is what the operator needs to read
            log.debug("lpcal daemon stopped in %.1f s", now - t0)

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
        self.stop_requested_at = time.monotonic()
        log.info("received %s: shutting down", signal.Signals(sig).name)
        self.stopping.set()

    @property
    def ready(self) -> bool:
        return self.started and self.restored and self.broker_ok

    # ================================================================== rebalance
    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        """Rebalance listener: pause the partitions, restore their models, position them,
        resume. Never raises (aiokafka swallows listener exceptions, which left every partition
        paused for good): a failure is logged and the restore retried in the background with
        a backoff (:meth:`_retry_assignment`); the partitions stay paused until it succeeds,
        and ``/healthz`` fails once it has kept failing for ``assign_unhealthy_after`` s."""
        self._cancel_assignment_retry()
        if self.stopping.is_set():  # a join that finished during shutdown: nothing to restore
            if tps:
                self.consumer.pause(*tps)
            return
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
        self.registry.release(parts, park=not saved)  # parked: the state further along wins
        for tp in tps:
            self.positions.pop((tp.topic, tp.partition), None)
            self.gaps.forget((tp.topic, tp.partition))
        self.assigned -= set(tps)
