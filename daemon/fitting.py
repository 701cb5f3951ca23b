"""Fit scheduling, mixed into :class:`daemon.service.Daemon`: asking a model's triggers after
each batch, launching fits in the worker thread, publishing their bin maps (retried while the
broker is down) and backpressure (pausing the partitions of models whose fits are behind).

A fit starts after the batch in which the pools became full, from the epoch's frozen pools
(:class:`daemon.registry.Inflight`); fits are deterministic (:func:`fit_seed`), so a fit still
in flight at a checkpoint is fitted again after a restore.

Epoch boundaries: pools are count tables, so an epoch's pools do not depend on the order of its
samples. Which samples fall in which epoch can shift by a batch between runs (a fit starts
after the batch that filled the pools); no sample is lost or counted twice either way.
``fit_pools`` and the publish retry delays are looked up in :mod:`daemon.service` when used
(tests replace them there).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from daemon import retry
from daemon.model_state import MAX_SEALED
from daemon.registry import Inflight

log = logging.getLogger("lpcal.daemon")

_LAG_EVERY = 5.0  # seconds between consumer lag exports


def fit_seed(model: str, version: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{model}:{version}".encode(), digest_size=4).digest(),
                          "big")


def _service():
    """:mod:`daemon.service`, which holds ``fit_pools`` and ``_PUBLISH_RETRY_FIRST``/``_MAX``."""
    from daemon import service

    return service


class Fitting:
    """The fit half of the daemon (uses ``registry``, ``metrics``, ``consumer``, ``producer``,
    ``assigned``, ``throttled`` and ``_executor`` of :class:`daemon.service.Daemon`)."""

    def _after_batch(self) -> None:
        now = time.monotonic()
        # models with sealed epochs too: a restored backlog on a paused partition brings no
        # new events (so never turns dirty), yet its fits must run for ingest to resume
        waiting = {m for m, slot in self.registry.slots.items() if slot.state.sealed}
        for model in list(self.registry.dirty | waiting):
            self._check_model(model, now)
        self._export_due_gauges(now)
        self._apply_backpressure()
        if now - self._last_lag >= _LAG_EVERY:
            self._last_lag = now
            self._export_lag()

    def _check_model(self, model: str, now: float) -> None:
        """Ask ``model``'s triggers what to do; launch a fit or a refill; export its gauges."""
        slot = self.registry.get(model)
        if slot is None:
            return
        st = slot.state
        firing = st.check_triggers(self.event_time.get(model, 0.0),
                                   busy=slot.inflight is not None)
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
                self._launch_fit(model, inf)
        self.registry.gauges_due.add(model)

    def request_recalibration(self, model: str) -> bool:
        slot = self.registry.get(model)
        if slot is None:
            return False
        slot.state.triggers.request_manual()
        self.registry.dirty.add(model)
        return True

    # ------------------------------------------------------------------ backpressure
    def _backlogged_partitions(self) -> set[int]:
        return {slot.partition for slot in self.registry.slots.values()
                if slot.state.backlogged}

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

    # ------------------------------------------------------------------ fits and publishing
    def _launch_fit(self, model: str, inf: Inflight) -> None:
        spec = self.registry.slots[model].state.fit_spec
        loop = asyncio.get_running_loop()
        fit_pools = _service().fit_pools

        def work():
            t0 = time.perf_counter()
            bm = fit_pools(inf.pools, spec, seed=fit_seed(model, inf.version), model_id=model,
                           version=inf.version)
            return bm, time.perf_counter() - t0

        inf.task = loop.run_in_executor(self._executor, work)
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
        self._export_certificate(model, bm.certificate and bm.certificate.to_dict())
        log.info("model %s: published bin map version %d (%s, |B|=%d, %d iterations, %s, "
                 "%.3f s)", model, inf.version, inf.trigger, bm.n_bins, bm.iterations,
                 bm.stop_reason, seconds)
        if bm.certificate is not None and bm.certificate.vacuous:
            log.info("model %s: eps %g is vacuous: the raw model already meets it on the "
                     "held-out share (bound %.4f)", model, bm.eps, bm.certificate.raw_bound)
        # the next sealed epoch (if any) need not wait for the next poll, which may be idle
        # for a whole fetch timeout when its partitions are paused
        self._check_model(model, time.monotonic())
        self._apply_backpressure()

    async def _publish(self, model: str, inf: Inflight, data: bytes) -> bool:
        """Send ``data`` to the bin-map topic, retried with backoff (:func:`daemon.retry.retry`)
        while the fit is still in flight. A stop request does not cut the retry short: the
        first attempt that fails after it ends it (then False: the checkpoint keeps the fit)."""
        service = _service()

        async def attempt() -> bool:
            if not self._still_inflight(model, inf):
                log.info("model %s: bin map version %d not published: the model was revoked "
                         "(its new owner fits it again from the checkpoint)", model, inf.version)
                return False
            await self.producer.send_and_wait(
                self.s.kafka.topics.binmaps, key=model.encode(), value=data,
                headers=[("lpcal.version", str(inf.version).encode())])
            return True

        def failed(e: Exception, delay: float) -> None:  # broker trouble: retried, never fatal
            self.metrics.inc_calibration_failure(model)
            log.warning("model %s: publishing bin map version %d failed (%s: %s); "
                        "retrying in %.1f s", model, inf.version, type(e).__name__, e, delay)

        try:
            return await retry.retry(
                "bin-map publish", attempt, stop=self.stopping,
                first=service._PUBLISH_RETRY_FIRST, cap=service._PUBLISH_RETRY_MAX,
                on_error=failed, stop_on_failure_only=True)
        except retry.Stopped as stopped:
            log.info("model %s: bin map version %d not published before shutdown (%s); it "
                     "stays in flight in the checkpoint and is fitted again after a restart",
                     model, inf.version, type(stopped.__cause__).__name__)
            return False
