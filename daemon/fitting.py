"""Fit scheduling (:class:`Fitter`): asking a model's triggers after each batch, launching fits
in the worker thread, publishing their bin maps (retried while the broker is down) and
backpressure (pausing the partitions of models whose fits are behind).

A fit starts after the batch in which the pools became full, from the epoch's frozen pools
(:class:`daemon.registry.Inflight`); fits are deterministic (:func:`fit_seed`), so a fit still
in flight at a checkpoint is fitted again after a restore.

Epoch boundaries: pools are count tables, so an epoch's pools do not depend on the order of its
samples. Which samples fall in which epoch can shift by a batch between runs (a fit starts
after the batch that filled the pools); no sample is lost or counted twice either way.
``fit_pools`` and the publish retry delays are looked up in :mod:`daemon.service` when used
(tests replace them there).

Online models (``recovery = "online"``, :meth:`Fitter.online_result`): the calibrator decides
when to fit and what to publish. Its maps are installed in the state when published and sent
here in version order (one publish chain per model); its fit requests run in the worker thread
(``online_fit``) and go back with :meth:`daemon.model_state.ModelState.complete_fit`. While the
stream is blocked on a fit the model is backlogged, so its partition pauses through the same
backpressure path as sealed epochs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NamedTuple

from daemon import retry
from daemon.model_state import MAX_SEALED
from daemon.registry import Inflight
from lpcal.binmap import BinMap
from lpcal.calibrate import fit_pools
from lpcal.online import FitRequest, run_fit

log = logging.getLogger("lpcal.daemon")

def fit_seed(model: str, version: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{model}:{version}".encode(), digest_size=4).digest(),
                          "big")


#: ``fit(pools, spec, *, seed, model_id, version) -> BinMap``, run in the worker thread
FitFunction = Callable[..., BinMap]
#: ``online_fit(request) -> BinMap``: an online model's fit request, run in the worker thread
OnlineFitFunction = Callable[[FitRequest], BinMap]


class RetryPolicy(NamedTuple):
    """Delays between bin-map publish attempts: ``first``, doubling up to ``cap`` (seconds)."""

    first: float = 0.5
    cap: float = 30.0


#: the daemon's publish retry delays: 0.5 s doubling to 30 s
PUBLISH_RETRY = RetryPolicy()


class Fitter:
    """Runs the fits of the owned models and publishes their bin maps.

    Parameters
    ----------
    settings : daemon.settings.Settings
    registry : daemon.registry.ModelRegistry
    partitions : daemon.partitions.PartitionTable
        Backpressure pauses and resumes its partitions (``paused``).
    clients : daemon.clients.KafkaClients
        Its consumer pauses and resumes partitions, its producer publishes.
    metrics : daemon.metrics.DaemonMetrics
    gauges : daemon.gauges.GaugeExporter
        Exports a published map's certificate.
    stopping : asyncio.Event
    executor : concurrent.futures.Executor
        The worker thread that fits run in.
    fit : callable, default :func:`lpcal.calibrate.fit_pools`
    retry_policy : RetryPolicy, default :data:`PUBLISH_RETRY`
    clock : callable, default ``time.monotonic``
        The time a finished fit asks its model's triggers at.
    online_fit : callable, default :func:`lpcal.online.run_fit`
        Runs an online model's :class:`lpcal.online.FitRequest` (``recovery = "online"``).
    """

    def __init__(self, settings, registry, partitions, clients, metrics, gauges,
                 stopping: asyncio.Event, executor: Executor, *,
                 fit: FitFunction = fit_pools, retry_policy: RetryPolicy = PUBLISH_RETRY,
                 clock: Callable[[], float] = time.monotonic,
                 online_fit: OnlineFitFunction = run_fit):
        self.s, self.registry, self.partitions = settings, registry, partitions
        self.clients, self.metrics, self.gauges = clients, metrics, gauges
        self.stopping, self.executor = stopping, executor
        self.fit, self.retry_policy, self.clock = fit, retry_policy, clock
        self.online_fit = online_fit
        self._publishing: set[asyncio.Task] = set()  # bin-map publishes (with their retries)
        # online mode: per model, the fit requests running and the last publish queued (each
        # publish waits for the one before, so versions go out in order)
        self._online_fits: dict[str, dict[int, tuple[object, asyncio.Future]]] = {}
        self._online_tail: dict[str, asyncio.Task] = {}
        # online mode: per model, what asked for its next map (drift, manual; the trigger
        # label of that map's publish) and the (version, seconds) of its last fit
        self._online_cause: dict[str, str] = {}
        self._online_seconds: dict[str, tuple[int, float]] = {}

    def forget(self, models) -> None:
        """Drop what this fitter keeps per model for ``models``, released from this replica
        (revoked partitions): the cause and fit time of their next online map. Their fits still
        running and publishes still queued end on their own (neither acts on a model no longer
        owned), so memory stays bounded by the models owned."""
        for model in models:
            self._online_cause.pop(model, None)
            self._online_seconds.pop(model, None)

    def after_batch(self, now: float) -> None:
        """After each fetched batch: ask the triggers of the models the batch touched
        (``registry.touched``: events or a recalibration request) and of those with sealed
        epochs waiting (``registry.waiting``) (:meth:`check_model`), then apply backpressure.
        The work follows those models, not the number of models: triggers take the model's
        event time, so a model without events needs no check."""
        # models with sealed epochs too: a restored backlog on a paused partition brings no
        # new events (so is never touched), yet its fits must run for ingest to resume
        reg = self.registry
        touched, reg.touched = reg.touched, set()
        for model in touched | reg.waiting:
            self.check_model(model, now)
        self.apply_backpressure()

    def pending(self) -> list[asyncio.Future]:
        """The fits running in the worker thread: what a shutdown waits for first (then
        :meth:`publishing`)."""
        return [slot.inflight.task for slot in self.registry.slots.values()
                if slot.inflight is not None and slot.inflight.task is not None] + [
            fut for fits in self._online_fits.values() for _, fut in fits.values()]

    def publishing(self) -> set[asyncio.Task]:
        """The bin-map publishes running (with their retries)."""
        return set(self._publishing)

    def check_model(self, model: str, now: float) -> None:
        """Ask ``model``'s triggers what to do; launch a fit or a refill; schedule its gauges
        (:meth:`daemon.gauges.GaugeExporter.schedule`) and keep ``registry.waiting``."""
        slot = self.registry.get(model)
        if slot is None:
            return
        st = slot.state
        if st.online_spec.online:
            self.check_online(model, now)
        else:
            self._check_epochs(model, slot)
        self.registry.mark_waiting(model, st)
        self.gauges.schedule(model, slot.gauges_at + self.gauges.every)

    def _check_epochs(self, model: str, slot) -> None:
        """The epochs mode of :meth:`check_model`: a full epoch's pools are fitted, a drift
        refills them."""
        st = slot.state
        event_time = 0.0 if slot.event_time is None else slot.event_time
        firing = st.check_triggers(event_time, busy=slot.inflight is not None, lazy=True)
        if (firing is not None and firing.action == "fit" and st.pools.full
                and slot.prefitted > 0):
            st.start_new_epoch()  # this epoch's bin map was published before a crash
            slot.prefitted -= 1
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
                slot.inflight = inf
                self.launch(model, inf)

    def request_recalibration(self, model: str) -> bool:
        slot = self.registry.get(model)
        if slot is None:
            return False
        slot.state.triggers.request_manual()
        self.registry.dirty.add(model)
        self.registry.touched.add(model)  # asked after the next batch
        return True

    # ------------------------------------------------------------------ backpressure
    def backlogged_partitions(self) -> set[int]:
        """The input partitions of backlogged models (only models in ``registry.waiting``
        can be)."""
        slots = self.registry.slots
        return {slots[m].partition for m in self.registry.waiting
                if m in slots and slots[m].state.backlogged}

    def apply_backpressure(self) -> None:
        """Pause the input partitions of backlogged models, resume them once fits caught up.

        A model is backlogged while :data:`daemon.model_state.MAX_SEALED` full epochs wait for
        their fit (a backlog consumed faster than fits run: after a restart, or with pools that
        fill in milliseconds). Pausing instead of dropping epochs keeps every published version
        a function of the input alone; the cost is consumer lag, which is exported and alerted
        on. Pausing is lossless: aiokafka discards fetched records of a paused partition and
        fetches again from the consumed position on resume."""
        consumer = self.clients.consumer
        if consumer is None:
            return
        table = self.partitions
        assigned = table.numbers()
        want = self.backlogged_partitions() & assigned
        throttled = table.paused()
        if want == throttled:
            return
        pause, resume = table.set_paused(want)  # a topic held by daemon.alignment stays paused
        if pause:
            consumer.pause(*pause)
        if want - throttled:
            log.info("partitions %s paused: fits are behind (%d+ sealed epochs, or an online fit due)",
                     sorted(want - throttled), MAX_SEALED)
        if resume:
            consumer.resume(*resume)
        if (throttled - want) & assigned:
            log.info("partitions %s resumed: fits caught up", sorted((throttled - want) & assigned))

    # ------------------------------------------------------------------ fits and publishing
    def launch(self, model: str, inf: Inflight) -> None:
        """Fit ``inf`` (``model``'s fit in flight) in the worker thread; its done callback
        publishes and installs the bin map (:meth:`_fit_done`)."""
        spec = self.registry.slots[model].state.fit_spec
        loop = asyncio.get_running_loop()
        fit = self.fit

        def work():
            t0 = time.perf_counter()
            bm = fit(inf.pools, spec, seed=fit_seed(model, inf.version), model_id=model,
                     version=inf.version)
            return bm, time.perf_counter() - t0

        inf.task = loop.run_in_executor(self.executor, work)
        inf.task.add_done_callback(
            lambda fut: self._track_publish(self._fit_done(model, inf, fut)))

    def _track_publish(self, coro) -> None:
        """Run ``coro`` (a :meth:`_fit_done`) as a task that ``shutdown`` can wait for."""
        task = asyncio.ensure_future(coro)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    def _still_inflight(self, model: str, inf: Inflight) -> bool:
        slot = self.registry.get(model)
        return slot is not None and slot.inflight is inf

    async def _fit_done(self, model: str, inf: Inflight, fut) -> None:
        """Publish the bin map of a finished fit, then install it and chain the next fit.

        A fit that raised is counted and its epoch dropped (the same pools would raise again).
        A publish that fails is counted and retried with backoff while the fit stays in flight
        (checkpointed, so a restart refits it: fits are deterministic); on shutdown it is left
        to the checkpoint."""
        if fut.cancelled() or not self._still_inflight(model, inf):
            return
        slot = self.registry.slots[model]
        try:
            bm, seconds = fut.result()
            data = bm.to_json(signer=self.s.signing.signer())  # signed when a key is set
        except Exception as e:  # noqa: BLE001 - a failed fit is counted, never fatal
            log.error("model %s: recalibration (version %d) failed: %s: %s", model,
                      inf.version, type(e).__name__, e)
            self.metrics.inc_calibration_failure(model)
            slot.inflight = None
            self.registry.dirty.add(model)
            return
        if self._superseded(model, slot, inf):
            return
        if not await self._publish(model, inf, data):
            return
        slot = self.registry.get(model)
        if slot is None or slot.inflight is not inf:
            return
        slot.state.install_binmap(data, inf.version)
        slot.inflight = None
        self.registry.dirty.add(model)
        self.metrics.observe_fit(model, inf.trigger, seconds, bm.iterations, bm.n_bins)
        self.metrics.set_binmap_published(model, inf.version)
        self.gauges.export_certificate(model, bm.certificate)
        log.info("model %s: published bin map version %d (%s, |B|=%d, %d iterations, %s, "
                 "%.3f s)", model, inf.version, inf.trigger, bm.n_bins, bm.iterations,
                 bm.stop_reason, seconds)
        if bm.certificate is not None and bm.certificate.vacuous:
            log.info("model %s: eps %g is vacuous: the raw model already meets it on the "
                     "held-out share (bound %.4f)", model, bm.eps, bm.certificate.raw_bound)
        # the next sealed epoch (if any) need not wait for the next poll, which may be idle
        # for a whole fetch timeout when its partitions are paused
        self.check_model(model, self.clock())
        self.apply_backpressure()

    def _superseded(self, model: str, slot, inf: Inflight) -> bool:
        """True (and the fit dropped) when the bin-map topic, as this replica's view of it
        reads it now, already holds version ``inf.version`` or a newer one of ``model``: a
        restore that could not see the latest maps (the topic read lagging the records a
        killed predecessor had published) relaunched a fit whose version was published
        meanwhile. Publishing it would put an older version after a newer one; the newer one
        is installed instead (when its k and lambda fit), and versions go on after it."""
        served = None if self.registry.published is None else self.registry.published(model)
        if served is None or served.version < inf.version:
            return False
        log.warning("model %s: the bin-map topic holds version %d already; the fit of version "
                    "%d is dropped, versions go on after %d",
                    model, served.version, inf.version, served.version)
        self.registry.follow_served(model, slot.state, served)
        slot.inflight = None
        self.metrics.set_binmap_published(model, served.version)
        self.check_model(model, self.clock())
        return True

    async def _publish(self, model: str, inf: Inflight, data: bytes) -> bool:
        """Send ``data`` while the fit ``inf`` is still in flight (:meth:`_send`); False on a
        stop or a revocation: the checkpoint keeps the fit, fitted again after a restart."""
        return await self._send(
            model, inf.version, data, lambda: self._still_inflight(model, inf),
            revoked="its new owner fits it again from the checkpoint",
            stopped="it stays in flight in the checkpoint and is fitted again after a restart")

    # ------------------------------------------------------------------ online mode
    def check_online(self, model: str, now: float) -> None:
        """An online model's triggers (``recovery = "online"``), acted on by
        :meth:`daemon.model_state.ModelState.respond_online`: a drift the change test declared
        keeps only the post-drift buckets; the absolute threshold and a manual request fit at
        the next decision point and keep the window. The calibrator decides when to fit and
        publish otherwise (never ``pools_full``)."""
        slot = self.registry.get(model)
        if slot is None:
            return
        st = slot.state
        if st.online is None:  # k not known yet
            return
        event_time = 0.0 if slot.event_time is None else slot.event_time
        firing = st.check_triggers(event_time, busy=False, lazy=True)
        if firing is None:
            return
        did = st.respond_online(firing)
        self._online_cause[model] = "manual" if firing.trigger == "manual" else "drift"
        if did == "window_reset":
            log.info("model %s: drift detected; the online window keeps only samples from here "
                     "on (the live map stays until a candidate beats it)", model)
            # a fit the stream was blocked on is dropped with the pre-drift window: the rows
            # waiting behind it go on
            self.online_result(model, st.feed_backlog())
            self.apply_backpressure()
        elif firing.trigger == "manual":
            log.info("model %s: manual recalibration: the online loop fits at its next "
                     "decision point", model)
        else:
            log.info("model %s: the live map's windowed Err_p stays above drift_threshold: the "
                     "online loop fits at its next decision point (window kept)", model)

    def online_result(self, model: str, res) -> None:
        """Act on what an online model's :meth:`~daemon.model_state.ModelState.offer` or
        :meth:`~daemon.model_state.ModelState.complete_fit` did (an
        :class:`daemon.model_state.IngestResult`): publish the maps it published (installed
        already), in order, and run the fit requests it issued (:meth:`launch_online`)."""
        if not res.events:
            return
        slot = self.registry.get(model)
        if slot is None:
            return
        for bm in res.published:
            self.publish_online(model, slot.state, bm)
        for req in res.fit_requests:
            self.launch_online(model, slot.state, req)
        self.registry.dirty.add(model)

    def launch_online(self, model: str, st, req: FitRequest) -> None:
        """Run ``req`` (``online_fit``) in the worker thread; back on the loop its result goes
        to ``st`` (:meth:`_online_fit_done`). Also what a restore calls for every
        :attr:`~daemon.model_state.ModelState.fit_requests_outstanding`."""
        loop = asyncio.get_running_loop()
        fit = self.online_fit

        def work():
            t0 = time.perf_counter()
            bm = fit(req)
            return bm, time.perf_counter() - t0

        fut = loop.run_in_executor(self.executor, work)
        self._online_fits.setdefault(model, {})[req.id] = (st, fut)
        fut.add_done_callback(lambda f: self._online_fit_done(model, st, req, f))

    def relaunch_online(self, model: str) -> None:
        """Run ``model``'s outstanding fit requests that are not running (after a restore:
        the checkpoint holds them; the stream stays blocked at their ``due`` sample until
        they are back)."""
        slot = self.registry.get(model)
        if slot is None:
            return
        running = self._online_fits.get(model, {})
        for req in slot.state.fit_requests_outstanding:
            if running.get(req.id, (None, None))[0] is not slot.state:
                self.launch_online(model, slot.state, req)

    def _owned(self, model: str, st) -> bool:
        """``st`` is still ``model``'s state here (not revoked, not restored anew)."""
        slot = self.registry.get(model)
        return slot is not None and slot.state is st

    def _online_fit_done(self, model: str, st, req: FitRequest, fut) -> None:
        """Hand a finished fit back to its state (None if it raised: counted and logged, the
        calibrator goes on without the candidate), then act on what that did; resume the
        partition once the model is no longer backlogged."""
        fits = self._online_fits.get(model, {})
        if fits.get(req.id, (None, None))[1] is fut:
            del fits[req.id]
            if not fits:
                self._online_fits.pop(model, None)
        if fut.cancelled() or not self._owned(model, st):
            return  # revoked: its new owner re-issues the request from the checkpoint
        try:
            bm, seconds = fut.result()
            self._online_seconds[model] = (req.version, seconds)
        except Exception as e:  # noqa: BLE001 - a failed fit is counted, never fatal
            log.error("model %s: online fit (request %d, sample %d) failed: %s: %s", model,
                      req.id, req.n, type(e).__name__, e)
            self.metrics.inc_calibration_failure(model)
            bm = None
        self.online_result(model, st.complete_fit(req, bm))
        self.registry.dirty.add(model)
        self.registry.touched.add(model)  # its triggers and waiting mark, after the next batch
        self.apply_backpressure()

    def publish_online(self, model: str, st, bm: BinMap) -> None:
        """Queue the publish of ``bm``, an online map already installed in ``st``: signed,
        sent after the model's previous publishes (versions go out in order), retried while
        the broker is down, dropped once ``model`` is no longer owned here (its new owner
        republishes what its checkpoint installed but the topic lacks:
        :meth:`daemon.checkpoint.restorer.Restorer.adopt_published_binmaps`)."""
        data = bm.to_json(signer=self.s.signing.signer())
        prev = self._online_tail.get(model)
        # the trigger label: a drift's or a manual request's first map, else a scheduled refit
        cause = self._online_cause.pop(model, "pools_full")
        task = asyncio.ensure_future(self._publish_online(model, st, bm, data, prev, cause))
        self._online_tail[model] = task
        self._publishing.add(task)

        def done(t: asyncio.Task) -> None:
            self._publishing.discard(t)
            if self._online_tail.get(model) is t:
                del self._online_tail[model]

        task.add_done_callback(done)

    async def _publish_online(self, model: str, st, bm: BinMap, data: bytes,
                              prev: asyncio.Task | None, cause: str) -> bool:
        if prev is not None:
            await asyncio.wait([prev])
        sent = await self._send(
            model, bm.version, data, lambda: self._owned(model, st),
            revoked="its new owner publishes it from the checkpoint",
            stopped="the checkpoint holds it installed and the next owner publishes it")
        if not sent:
            return False
        if st.use_published_bytes(bm.version, data):  # serve and checkpoint the signed bytes
            self.registry.dirty.add(model)
        seconds = 0.0
        last = self._online_seconds.get(model)
        if last is not None and last[0] == bm.version:
            seconds = last[1]
        self.metrics.observe_fit(model, cause, seconds, bm.iterations, bm.n_bins)
        self.metrics.set_binmap_published(model, bm.version)
        self.gauges.export_certificate(model, bm.certificate)
        ev = (bm.sizing or {}).get("evidence") or {}
        log.info("model %s: published online bin map version %d (%s, T=%s, |B|=%d, beat "
                 "version %s on %s held-out samples)", model, bm.version, cause,
                 bm.temperature, bm.n_bins, ev.get("champion_version"),
                 ev.get("n_heldout"))
        return True

    async def _send(self, model: str, version: int, data: bytes, owned: Callable[[], bool],
                    *, revoked: str, stopped: str) -> bool:
        """Send ``data`` (bin map ``version`` of ``model``) to the bin-map topic while
        ``owned()``, retried with backoff (:func:`daemon.retry.retry`, ``retry_policy``). A stop
        request does not cut the retry short: the first attempt that fails after it ends it.
        False when not sent; ``revoked`` and ``stopped`` say in the log what happens to the
        map then."""
        async def attempt() -> bool:
            if not owned():
                log.info("model %s: bin map version %d not published here: the model was "
                         "revoked (%s)", model, version, revoked)
                return False
            await self.clients.producer.send_and_wait(
                self.s.kafka.topics.binmaps, key=model.encode(), value=data,
                headers=[("lpcal.version", str(version).encode())])
            return True

        def failed(e: Exception, delay: float) -> None:  # broker trouble: retried, never fatal
            self.metrics.inc_calibration_failure(model)
            log.warning("model %s: publishing bin map version %d failed (%s: %s); "
                        "retrying in %.1f s", model, version, type(e).__name__, e, delay)

        try:
            return await retry.retry(
                "bin-map publish", attempt, stop=self.stopping,
                first=self.retry_policy.first, cap=self.retry_policy.cap,
                on_error=failed, stop_on_failure_only=True)
        except retry.Stopped as stop:
            log.info("model %s: bin map version %d not published before shutdown (%s); %s",
                     model, version, type(stop.__cause__).__name__, stopped)
            return False

    def republish(self, model: str, st) -> None:
        """Publish the map installed in ``st`` again (a restore found the topic behind the
        checkpoint: a crash between installing and publishing): the same bytes, re-signed
        (signatures are deterministic), queued like :meth:`publish_online`."""
        self.publish_online(model, st, BinMap.from_json(st.binmap))
