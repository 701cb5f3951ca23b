"""The lpcal daemon: consume, join, pool, monitor, recalibrate, publish, checkpoint.

Lifecycle (after uvicorn's ``Server``): ``startup`` (HTTP first, so probes answer; then producer,
topics, consumer), ``main_loop`` (``getmany`` batches until asked to stop), ``shutdown`` (stop
fetching, let fits in flight finish for up to half the grace period, checkpoint what is left,
commit, leave the group, close), all within ``shutdown_grace_seconds``. SIGTERM/SIGINT start the
shutdown; a second signal exits at once.

Code map (docs/development.md, "Architecture"): this module holds the lifecycle and the
rebalance callbacks and composes the objects that do the work, each receiving what it uses:
:class:`~daemon.clients.KafkaClients` (producer, topics, consumer, broker probe),
:class:`~daemon.registry.ModelRegistry` (one slot per owned model),
:class:`~daemon.partitions.PartitionTable` (one state per assigned input partition),
:class:`~daemon.ingest.Ingest` (batches, parsing, dead letters), :class:`~daemon.fitting.Fitter`
(triggers, fits, publishing, backpressure), :class:`~daemon.alignment.Aligner` (the flow
control that reads both input topics at the join's pace), :class:`~daemon.gauges.GaugeExporter`,
:class:`~daemon.checkpoint.checkpointer.Checkpointer` (writing checkpoints; the exactly-once
accounting) and :class:`~daemon.checkpoint.restorer.Restorer` (restoring an assignment); broker
calls are retried by :mod:`daemon.retry`. :class:`~daemon.http_api.HttpServer` reads a
:class:`~daemon.http_api.DaemonStatus`.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson
from aiokafka import ConsumerRebalanceListener, TopicPartition

from daemon import blas, heap, retry
from daemon.alignment import Aligner
from daemon.binmap_view import BinMapView, settings_fit
from daemon.checkpoint.checkpointer import Checkpointer
from daemon.checkpoint.restorer import Restorer
from daemon.checkpoint.store import CheckpointStore, ConfiguredStore
from daemon.clients import KafkaClients
from daemon.events import EventParser
from daemon.fitting import PUBLISH_RETRY, FitFunction, Fitter, OnlineFitFunction, RetryPolicy
from daemon.gauges import GaugeExporter
from daemon.http_api import DaemonStatus, HttpServer
from daemon.ingest import DeadLetters, Ingest
from daemon.kafka.clients import make_consumer
from daemon.metrics import DaemonMetrics
from daemon.partitions import PartitionTable
from daemon.registry import ModelRegistry
from lpcal.calibrate import fit_pools
from lpcal.online import run_fit

log = logging.getLogger("lpcal.daemon")

RESTORE_ABANDON_SECONDS = 2.0  # shutdown: how long a restore still running may hold the close
#: shutdown: how long a consumer-group join in progress may hold the consumer's close (aiokafka
#: waits for the join to finish, seconds on a slow coordinator); nothing is assigned to save
JOIN_ABANDON_SECONDS = 1.0
_ASSIGN_RETRY_FIRST, _ASSIGN_RETRY_MAX = 0.5, 10.0  # seconds between assignment retries
#: An assignment whose restore keeps failing this long makes /healthz fail (pod restarted)
ASSIGN_UNHEALTHY_SECONDS = 120.0


#: a stop signal arrived while startup was still retrying (``KafkaClients.retry``)
StartupStopped = retry.Stopped


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, daemon: Daemon):
        self.d = daemon

    async def on_partitions_revoked(self, revoked):
        await self.d.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.d.on_assigned(set(assigned))


class Daemon:
    """One replica of the calibration service (see the module docstring).

    Parameters
    ----------
    settings : daemon.settings.Settings
    metrics : DaemonMetrics, optional
    store : CheckpointStore, optional
        Default: the store of ``state.backend``, opened at startup.
    consumer_options : dict, optional
        Options of the input consumer over those of the settings (tests).
    fit : callable, optional
        ``fit(pools, spec, *, seed, model_id, version) -> BinMap`` (default
        :func:`lpcal.calibrate.fit_pools`).
    retry_policy : daemon.fitting.RetryPolicy, optional
        Delays between bin-map publish attempts.
    online_fit : callable, optional
        ``online_fit(request) -> BinMap``: runs online models' fit requests (default
        :func:`lpcal.online.run_fit`).
    """

    def __init__(self, settings, *, metrics: DaemonMetrics | None = None,
                 store: CheckpointStore | None = None, consumer_options: dict | None = None,
                 fit: FitFunction = fit_pools, retry_policy: RetryPolicy = PUBLISH_RETRY,
                 online_fit: OnlineFitFunction = run_fit):
        self.s = settings
        self.metrics = metrics or DaemonMetrics(max_models=settings.max_models)
        self.stopping = asyncio.Event()
        self.stop_requested_at: float | None = None  # time.monotonic() of the stop signal
        self._stop_waiter: asyncio.Future | None = None  # stopping.wait(), in main_loop
        self.clients = KafkaClients(settings, self.metrics, self.stopping, consumer_options)
        self.parser = EventParser.from_settings(settings)
        self.registry = ModelRegistry(settings, self.metrics, self.parser)
        self.partitions = PartitionTable.from_settings(settings)
        self.store = store if store is not None else ConfiguredStore(settings)
        self.deadletters = DeadLetters(self.clients, self.metrics,
                                       settings.kafka.topics.deadletter)
        self.ingest = Ingest(settings, self.registry, self.partitions, self.parser,
                             self.metrics, self.clients, self.deadletters,
                             on_online=lambda model, res: self.fitter.online_result(model, res))
        self.gauges = GaugeExporter(self.registry, self.partitions, self.metrics, self.clients,
                                    staged_bytes=self.ingest.staged_bytes)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpcal-fit")
        self.fitter = Fitter(settings, self.registry, self.partitions, self.clients,
                             self.metrics, self.gauges, self.stopping, self.executor, fit=fit,
                             retry_policy=retry_policy, online_fit=online_fit)
        self.aligner = Aligner(settings, self.registry, self.partitions, self.clients,
                               self.metrics)
        self.checkpointer = Checkpointer(
            self.store, self.registry, self.partitions, self.deadletters, self.clients,
            self.metrics, interval=settings.state.checkpoint_interval_seconds,
            max_share=settings.state.checkpoint_max_cpu_share,
            flush_staged=lambda parts: self.ingest.flush_staged(parts))
        self.restorer = Restorer(settings, self.store, self.registry, self.partitions,
                                 self.clients, self.fitter, self.gauges, lambda: self.binmaps,
                                 self.metrics, self.stopping)
        self.http = None
        #: every model's latest verified bin map, from the bin-map topic (see startup)
        self.binmaps: BinMapView | None = None
        self.restored = self.started = False
        self.last_poll = time.monotonic()
        # a failed assignment restore, retried in the background (see on_assigned)
        self._assign_task: asyncio.Task | None = None
        self.assign_failing_since: float | None = None
        self.assign_unhealthy_after = ASSIGN_UNHEALTHY_SECONDS
        # puts back the BLAS thread limits found at startup (daemon.blas)
        self._restore_blas: Callable[[], None] = lambda: None

    def status(self) -> DaemonStatus:
        """The read-only view of this daemon that the HTTP API serves."""
        return DaemonStatus(
            settings=self.s, exposition=self.metrics.exposition,
            lifecycle=lambda: (self.started, self.restored, self.clients.broker_ok, self.ready),
            last_poll=lambda: self.last_poll,
            assignment_unhealthy=lambda: self.assignment_unhealthy,
            assigned=lambda: sorted((tp.topic, tp.partition)
                                    for tp in self.partitions.assigned),
            paused=self.partitions.paused, models=self.registry.snapshot,
            model=self.registry.info, binmaps=lambda: self.binmaps,
            request_recalibration=self.fitter.request_recalibration)

    # ================================================================== lifecycle
    async def startup(self) -> None:
        self.http = HttpServer(self.status())
        await self.http.start()
        if hasattr(self.s, "redacted"):  # served at GET /v1/config too
            log.info("effective settings (secrets redacted): %s",
                     orjson.dumps(self.s.redacted(), option=orjson.OPT_SORT_KEYS).decode())
        k = self.s.kafka
        clients = self.clients
        await clients.start_producer()  # and the topics: created (if configured) and checked
        self._start_binmap_view()
        if isinstance(self.store, ConfiguredStore):
            await self.store.open(clients.producer)
        await clients.start_consumer(_Rebalance(self))
        clients.start_probe(self._report_ready)
        # a long-lived service with a large, stable heap: move start-up objects out of the
        # collector's view and collect young objects less often (ingest allocates many short-
        # lived ones; measured about +30% ingest throughput, see tests/bench/bench_ingest.py)
        gc.freeze()
        gc.set_threshold(50_000, 50, 1000)
        self._restore_blas = blas.limit_threads(self.s.blas_threads)
        if self.s.state.release_heap and not heap.available():
            log.info("state.release_heap: this C library has no malloc_trim; freed heap "
                     "memory stays resident until reused")
        self.started = True
        log.info("lpcal daemon started: group %s, topics %s/%s", k.group_id, clients.t_pred,
                 clients.t_out)

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
            max_models=self.s.max_models * max(1, self.clients.input_partitions),
            max_record_bytes=k.max_message_bytes, fits=settings_fit(self.s))
        self.registry.published = self.binmaps.get
        self.binmaps.start()

    async def _fetch(self) -> dict:
        """One ``getmany``, cut short by a stop request: aiokafka's fetch waits while the
        consumer group is (re)joining, seconds on a slow coordinator, and a stop must not
        (two futures per poll: microseconds, against a batch of up to 5000 records)."""
        fetch = asyncio.ensure_future(
            self.clients.consumer.getmany(timeout_ms=250, max_records=5000))
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
            assigned, ingest = self.partitions.assigned, self.ingest
            for tp, msgs in batch.items():
                if msgs and tp in assigned:
                    msgs = ingest.up_to_hole(tp, msgs)
                    if msgs:
                        ingest.process(tp, msgs)
            now = time.monotonic()
            ingest.flush_due(now)  # staged events that waited their longest (daemon.staging)
            await self.aligner.after_batch(self.registry.touched)  # before the triggers take them
            self.fitter.after_batch(now)
            self.gauges.after_batch(now)
            await self.deadletters.after_batch(self.stopping)
            if self.checkpointer.due():  # paced: see daemon.checkpoint.pacing
                try:
                    await self.checkpointer.commit()
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
        clients, assigned = self.clients, self.partitions.assigned
        joining = not assigned
        # fits in flight get half the grace period to finish and publish; the rest stay in
        # flight in the final checkpoint
        pending = self.fitter.pending()
        if pending:
            await asyncio.wait(pending, timeout=grace / 2)
            await asyncio.sleep(0)  # their done callbacks start the publishes
        publishing = self.fitter.publishing()
        if publishing:
            await asyncio.wait(publishing,
                               timeout=max(0.0, grace / 2 - (time.monotonic() - t0)))
        try:
            if clients.consumer is not None and self.partitions.assigned:
                left = max(1.0, grace - (time.monotonic() - t0) - 2.0)
                await asyncio.wait_for(self.checkpointer.commit(), timeout=left)
        except Exception as e:  # noqa: BLE001
            log.error("final checkpoint failed: %s: %s", type(e).__name__, e)
        clients.stop_probe()
        self._cancel_assignment_retry()
        # a restore still running (assignment phase) holds aiokafka's close, which waits for
        # the rebalance listener: it is abandoned after RESTORE_ABANDON_SECONDS (its
        # partitions are paused until restored, so nothing was processed that needs saving)
        restoring = bool(self.partitions.assigned) and not self.restored
        for name, closer in (("consumer", clients.consumer), ("producer", clients.producer)):
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
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._restore_blas()
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
        return self.started and self.restored and self.clients.broker_ok

    def _report_ready(self) -> None:
        self.metrics.set_ready(self.ready)

    # ================================================================== rebalance
    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        """Rebalance listener: pause the partitions, restore their models, position them,
        resume. Never raises (aiokafka swallows listener exceptions, which left every partition
        paused for good): a failure is logged and the restore retried in the background with
        a backoff (:meth:`_retry_assignment`); the partitions stay paused until it succeeds,
        and ``/healthz`` fails once it has kept failing for ``assign_unhealthy_after`` s."""
        self._cancel_assignment_retry()
        consumer = self.clients.consumer
        if self.stopping.is_set():  # a join that finished during shutdown: nothing to restore
            if tps:
                consumer.pause(*tps)
            return
        self.restored = False
        new = self.partitions.assign(tps)
        kept = set(tps) - new
        # aiokafka keeps fetching while this callback awaits the restore: pause the partitions
        # so no record is processed before its model's checkpoint is restored and the
        # partition is positioned (else checkpointed samples would be lost, others doubled)
        if tps:
            consumer.pause(*tps)
        try:
            # partitions kept across a rejoin (e.g. after the coordinator was lost): aiokafka
            # may have reset their fetch position to the committed offset; continue where we are
            for tp in kept:
                pos = self.partitions.position(tp.topic, tp.partition)
                if pos is not None:
                    consumer.seek(tp, pos)
            await self._restore_assignment(set(tps), new)
        except Exception as e:  # noqa: BLE001 - retried; never lost in aiokafka's listener
            self._assignment_failed(e)
            self._assign_task = asyncio.create_task(
                self._retry_assignment(set(tps), new), name="lpcal-assignment-retry")
        else:
            self.assign_failing_since = None

    async def _restore_assignment(self, tps: set[TopicPartition],
                                  new: set[TopicPartition]) -> None:
        await self.restorer.restore(tps, new)
        self.restored = True
        self.metrics.set_ready(self.ready)
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in tps))

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        self._cancel_assignment_retry()
        self.assign_failing_since = None
        parts = {tp.partition for tp in tps}
        if parts:
            self.restored = False  # not ready again until the new assignment is restored
            self.metrics.set_ready(False)
        saved = True
        if parts and self.clients.consumer is not None:
            try:
                await self.checkpointer.commit(parts)
            except Exception as e:  # noqa: BLE001
                saved = False
                log.error("checkpoint on revoke failed (%s: %s): keeping the state of "
                          "partitions %s in memory in case they come back", type(e).__name__,
                          e, sorted(parts))
        released = self.registry.on_partitions(parts)
        self.ingest.flush_staged(parts)  # (after a failed checkpoint: into the parked states)
        self.registry.release(parts, park=not saved)  # parked: the state further along wins
        self.fitter.forget(released)
        self.aligner.forget(released)
        self.partitions.release(tps)

    # ------------------------------------------------------------------ assignment retries
    def _assignment_failed(self, e: BaseException) -> None:
        if self.assign_failing_since is None:
            self.assign_failing_since = time.monotonic()
        log.error("assignment of partitions %s failed (%s: %s); partitions stay paused, "
                  "retrying (failing for %.1f s; /healthz fails after %.0f s)",
                  sorted(self.partitions.numbers()), type(e).__name__, e,
                  time.monotonic() - self.assign_failing_since, self.assign_unhealthy_after)

    async def _retry_assignment(self, tps: set[TopicPartition],
                                new: set[TopicPartition]) -> None:
        """Restore ``tps`` again with a backoff until it succeeds, a stop is requested or the
        assignment changes."""
        async def attempt() -> bool:
            if self.partitions.assigned != tps:
                return False
            await self._restore_assignment(tps, new)
            return True

        try:
            restored = await retry.retry(
                "assignment", attempt, stop=self.stopping, first=_ASSIGN_RETRY_FIRST,
                cap=_ASSIGN_RETRY_MAX, wait_first=True,
                on_error=lambda e, _delay: self._assignment_failed(e))
        except retry.Stopped:
            return
        if restored:
            log.info("assignment restored after failing for %.1f s",
                     time.monotonic() - (self.assign_failing_since or time.monotonic()))
            self.assign_failing_since = None

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
