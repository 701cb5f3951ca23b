"""Restoring an assignment (:class:`Restorer`): reading the checkpoint records
(:class:`daemon.checkpoint.checkpointer.Checkpointer` writes them), restoring the models of the
assigned partitions, reinstating parked ones, adopting bin maps published after the last
checkpoint, positioning the partitions and resuming them.

Steps of :meth:`Restorer.restore`, for the newly assigned partitions:

1. read every checkpoint record (retried while the broker is unreachable, bounded);
2. read the manifests ``partition/<n>`` of those partitions;
3. restore each model record ``model/<id>`` on its own (:meth:`Restorer.restore_model`); one
   that cannot be used is counted, logged with its location and skipped, never the partition;
4. reinstate parked models further along than their checkpoints
   (:meth:`daemon.registry.ModelRegistry.unpark`), then rebalance the join budgets;
5. adopt bin maps newer than the checkpoint (:meth:`Restorer.adopt_published_binmaps`): the
   model's versions continue after the latest verified one, and only epochs the checkpoint
   shows, or that were fitted after it was written, are not fitted again;
6. seek each partition to its manifest's offset, else the smallest offset of its models'
   records, else the beginning;
7. relaunch the fits that were in flight (online models: their outstanding fit requests);
8. resume every assigned partition that is not backlogged (those stay paused).

The daemon then reports ready (``Daemon.on_assigned``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

from daemon import retry
from daemon.binmap_view import BinMapView
from daemon.checkpoint.envelope import Rejected, decode_envelope, decode_manifest
from daemon.checkpoint.store import CheckpointStore
from daemon.kafka import readers

log = logging.getLogger("lpcal.daemon")

_LOAD_RETRY_FIRST, _LOAD_RETRY_MAX, _LOAD_DEADLINE = 0.5, 5.0, 60.0  # reading checkpoints
_VIEW_SYNC_SECONDS = 10.0  # restore: wait this long for the bin-map view to read the topic


class Restorer:
    """Restores the models of newly assigned partitions from the checkpoint store.

    Parameters
    ----------
    settings : daemon.settings.Settings
    store : CheckpointStore
    registry : daemon.registry.ModelRegistry
    partitions : daemon.partitions.PartitionTable
        Positions and sample rates of the restored partitions, their paused flags.
    clients : daemon.clients.KafkaClients
        Its consumer seeks and resumes the partitions.
    fitter : daemon.fitting.Fitter
        Relaunches the fits in flight; knows the backlogged partitions.
    gauges : daemon.gauges.GaugeExporter
        Exports the certificates of restored and adopted maps.
    binmaps : callable
        ``binmaps()``: the replica's :class:`daemon.binmap_view.BinMapView` once started,
        else None.
    metrics : daemon.metrics.DaemonMetrics
    stopping : asyncio.Event
    read_latest : callable, optional
        Reads the latest record per model of the bin-map topic (default
        :func:`daemon.kafka.readers.read_compacted_latest`).
    """

    def __init__(self, settings, store: CheckpointStore, registry, partitions, clients, fitter,
                 gauges, binmaps: Callable[[], BinMapView | None], metrics,
                 stopping: asyncio.Event, *,
                 read_latest: Callable[..., Awaitable[dict[str, bytes]]] | None = None):
        self.s, self.store, self.registry, self.partitions = settings, store, registry, partitions
        #: ``await read_latest(bootstrap, topic, ...)``: the latest record per key of the
        #: bin-map topic (:func:`daemon.kafka.readers.read_compacted_latest`; tests: a stand-in)
        self.read_latest = read_latest or readers.read_compacted_latest
        self.clients, self.fitter, self.gauges, self.binmaps = clients, fitter, gauges, binmaps
        self.metrics, self.stopping = metrics, stopping
        self.topics = (clients.t_pred, clients.t_out)
        # model -> (where its record was, its snapshot's saved_at or None), during a restore
        self._restored_from: dict[str, tuple[str, float | None]] = {}
        # models whose restored state the current settings changed (a new epoch or calibrator:
        # a replay does not repeat what the checkpoint's state published), during a restore
        self._reconciled: set[str] = set()

    async def restore(self, tps: set[TopicPartition], new: set[TopicPartition]) -> None:
        """Restore the models of the ``new`` partitions from their checkpoints, seek them, and
        resume every partition of ``tps`` that is not backlogged (see the module docstring).
        Safe to run again after a failure (models restored already are kept)."""
        parts = {tp.partition for tp in new}
        reg, consumer = self.registry, self.clients.consumer
        if parts:
            records = await self._load_checkpoints()  # 1. raw values, decoded one at a time
            where = self.store.where
            manifests: dict[int, dict[str, int]] = {}
            for key in [k for k in records if k.startswith("partition/")]:  # 2.
                part, offsets = self.read_manifest(key, records.pop(key), parts)
                if offsets is not None:
                    manifests[part] = offsets
            self._restored_from, self._reconciled = {}, set()
            for key in sorted(k for k in records if k.startswith("model/")):  # 3.
                self.restore_model(key[6:], records.pop(key), parts, where=where(key))
            records.clear()
            reg.unpark(parts)  # 4.
            reg.rebudget()
            try:
                await self.adopt_published_binmaps(parts)  # 5.
            finally:
                self._restored_from, self._reconciled = {}, set()
            for tp in new:  # 6.
                off = manifests.get(tp.partition, {}).get(tp.topic)
                if off is None:
                    offs = [slot.state.offsets.get(tp.topic, {}).get(tp.partition)
                            for slot in reg.slots.values() if slot.partition == tp.partition]
                    offs = [o for o in offs if o is not None]
                    off = min(offs) if offs else None
                if off is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, int(off))
                    self.partitions.ensure(tp.partition).seek(tp.topic, int(off))
            for model, slot in list(reg.slots.items()):  # 7.
                inf = slot.inflight
                if inf is not None and inf.task is None and slot.partition in parts:
                    self.fitter.launch(model, inf)
                if slot.partition in parts:
                    self.fitter.relaunch_online(model)
        # 8. restored backlogs stay paused (see Fitter.apply_backpressure)
        throttled = self.fitter.backlogged_partitions() & {tp.partition for tp in tps}
        self.partitions.set_paused(throttled)
        resume = [tp for tp in tps if tp.partition not in throttled]
        if resume:
            consumer.resume(*resume)

    async def _load_checkpoints(self) -> dict[str, bytes]:
        """All checkpoint records; retried while the broker is unreachable (bounded)."""
        def warn(e: Exception, delay: float) -> None:
            log.warning("reading checkpoints failed (%s: %s); retrying in %.1f s",
                        type(e).__name__, e, delay)

        try:
            return await retry.retry(
                "reading checkpoints", self.store.load_all, stop=self.stopping,
                first=_LOAD_RETRY_FIRST, cap=_LOAD_RETRY_MAX, deadline=_LOAD_DEADLINE,
                on_error=warn, check_stop_first=False)
        except retry.Stopped as stopped:  # the last error, as before a stop
            raise (stopped.__cause__ or stopped) from None

    def read_manifest(self, key: str, raw: bytes, parts: set[int]
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
        got = decode_manifest(raw, self.topics, limit=self.s.state.max_state_bytes)
        if isinstance(got, Rejected):
            self.metrics.inc_restore(got.reason)
            if got.reason == "too_large":
                log.error("ignoring manifest %s at %s: %s", key, self.store.where(key),
                          got.detail)
            else:
                log.error("ignoring unusable manifest %s at %s: %s", key,
                          self.store.where(key), got.detail)
            return part, None
        return part, got

    def restore_model(self, model: str, value: bytes, parts: set[int], *,
                      where: str = "?") -> None:
        """Restore ``model`` from its record (raw, maybe compressed) if it belongs to one of
        ``parts``. The record is decoded here, alone, within ``state.max_state_bytes``; one
        that is too large, unreadable, or holds another model's state (its key and its
        ``model`` differ) is counted in ``lpcal_state_restores_total{outcome}``, logged with
        its location ``where`` and skipped: the model starts fresh. A restored model is always
        admitted (even beyond ``max_models``), and reconciled with the current settings
        (:meth:`ModelState.reconcile`: a changed k or config is logged and counted)."""
        env = decode_envelope(model, value, limit=self.s.state.max_state_bytes,
                              wanted=lambda part: part in parts and model not in self.registry)
        del value
        if env is None:
            return
        if isinstance(env, Rejected):
            self.metrics.inc_restore(env.reason)
            if env.reason == "wrong_model":
                log.error("skipping the state record of model %r at %s: it holds the state of "
                          "model %r; model %r starts fresh", model, where, env.detail, model)
            else:
                log.error("cannot restore model %r from %s: %s", model, where, env.detail)
            return
        st, inflight, prefitted = env.state, env.inflight, env.prefitted
        try:
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
            self._reconciled.add(model)
            inflight, prefitted = None, 0  # fitted from pools of the old settings
            log.warning("model %s: settings changed since its checkpoint (%s): %s", model,
                        outcome, detail)
        self.metrics.inc_restore(outcome)
        self._restored_from[model] = (where, env.saved_at)
        rate = ms.sample_rate if ms is not None else 1.0  # the settings decide the sample rate
        self.registry.restore(model, st, env.partition, sample_rate=rate, inflight=inflight,
                              prefitted=prefitted, dirty=outcome != "restored")
        self.partitions.ensure(env.partition).sample(model, rate)
        if st.binmap is not None:
            self.metrics.set_binmap_published(model, st.binmap_version)
            self.gauges.export_certificate(model, st.binmap)

    async def adopt_published_binmaps(self, parts: set[int]) -> None:
        """Install the latest verified bin map of each restored model when it is newer than
        its checkpoint's, so that its versions continue after it (a crash between publishing
        and checkpointing; a state record lost, or written by a release whose versions went
        back).

        Two sources: the topic read now (latest record per model) and the replica's view of
        it (:mod:`daemon.binmap_view`, the highest verified version), first brought up to date.
        Every record is verified (:meth:`verify_binmap`); a corrupt, truncated or incompatible
        one, one not signed by this daemon's key(s) when signing is configured, and one whose
        k or lambda does not fit the model's state are rejected and counted, and the model
        keeps its previous good map: only maps this deployment signed set a version.

        Epochs not fitted again: the fit in flight and the sealed epochs of the checkpoint,
        which are fitted first and in order; then, as many as the versions still missing, the
        epochs that were filling at the checkpoint, but only when the map was published after
        the checkpoint was written (record timestamps, :meth:`_published_after_checkpoint`):
        a map older than the checkpoint came from a state this one does not continue, and its
        version is a floor, not a count of fitted epochs."""
        view = self.binmaps()
        if view is not None:
            await view.sync(_VIEW_SYNC_SECONDS)
        stamps: dict[str, float] = {}
        try:
            latest = await self.read_latest(
                self.s.kafka.bootstrap_servers, self.s.kafka.topics.binmaps, timeout=30.0,
                security=self.s.kafka, missing_ok=True, timestamps=stamps)
            topic_read = True
        except Exception as e:  # noqa: BLE001 - the checkpointed maps stay in force
            log.warning("cannot read %s: %s", self.s.kafka.topics.binmaps, e)
            latest, topic_read = {}, False
        for model, slot in list(self.registry.slots.items()):
            if slot.partition not in parts:
                continue
            st = slot.state
            data, bm = latest.get(model), None
            if data is not None:
                bm = self.verify_binmap(data, model)
            served = None if view is None else view.get(model)
            if served is not None and (bm is None or served.version > bm.version) \
                    and (served.bm.k, served.bm.lam) == (st.k, st.lam):
                data, bm, published_at = served.raw, served.bm, served.source
            else:
                published_at = stamps.get(model)
            if st.online_spec.online:
                self._adopt_online(model, slot, data, bm, topic_read=topic_read)
                continue
            if bm is None or bm.version <= st.binmap_version:
                continue
            # versions after the checkpoint's were fitted from the fit in flight, then from the
            # oldest sealed epochs, in order: those epochs are consumed, not fitted again
            steps = bm.version - st.binmap_version
            inf = slot.inflight
            if inf is not None and inf.version <= bm.version:
                slot.inflight = None  # its result was published before the crash
                steps -= 1
            while steps > 0 and st.pools.full:
                st.start_new_epoch()
                steps -= 1
            # epochs still filling at the checkpoint: if the map came after the checkpoint, the
            # replay seals them again and they were fitted already (as the adopted versions)
            if steps > 0:
                if await self._published_after_checkpoint(model, published_at):
                    slot.prefitted += steps
                else:
                    log.warning("model %s: version %d on the topic is %d versions beyond its "
                                "checkpoint (version %d) but was not published after it: its "
                                "versions continue after %d, no epoch is skipped", model,
                                bm.version, steps, st.binmap_version, bm.version)
            log.info("model %s: adopting version %d over checkpointed %d (in flight: %s, "
                     "prefitted now %d)", model, bm.version, st.binmap_version,
                     None if inf is None else inf.version, slot.prefitted)
            st.install_binmap(data, bm.version)
            self.registry.dirty.add(model)
            self.metrics.set_binmap_published(model, bm.version)
            self.gauges.export_certificate(model, bm.certificate)
            log.info("model %s: adopted published bin map version %d", model, bm.version)

    def _adopt_online(self, model: str, slot, data: bytes | None, bm, *,
                      topic_read: bool) -> None:
        """An online model (``recovery = "online"``) installs its maps before they are
        published, so its checkpoint can be ahead of the topic or behind it. Ahead (a crash
        between installing and publishing): the installed map is published again, the same
        bytes re-signed. Behind (maps published after the checkpoint): the newest published
        map is adopted (:meth:`daemon.model_state.ModelState.adopt_published`): when the state
        is the checkpoint's, unchanged by the settings, the replay from the checkpoint's offsets
        publishes the same maps again; they are installed without being sent, and the topic's
        map when the replay reaches it, so the run continues as the uninterrupted one did.
        Otherwise (a state reconciled with new settings, or a replay that diverges) the topic's
        map becomes the live map. Either way versions never go back. Nothing is
        published again when the topic could not be read (``topic_read`` False): it may hold
        a newer version, which an older one must not follow."""
        st = slot.state
        published = 0 if bm is None else bm.version
        if published > st.binmap_version:
            checkpointed = st.binmap_version
            if st.adopt_published(data, bm, replay=model in self._restored_from
                                   and model not in self._reconciled):
                log.info("model %s: the topic holds online bin map version %d, the checkpoint "
                         "%d: the replay publishes the versions between again; they are "
                         "installed, not sent, and version %d is adopted when the replay "
                         "reaches it", model, bm.version, checkpointed, bm.version)
            else:
                log.info("model %s: adopting published online bin map version %d over "
                         "checkpointed %d", model, bm.version, checkpointed)
            self.registry.dirty.add(model)
            self.metrics.set_binmap_published(model, bm.version)
            self.gauges.export_certificate(model, bm.certificate)
        elif st.binmap is not None and published < st.binmap_version and not topic_read:
            log.warning("model %s: cannot tell whether its online bin map version %d is on "
                        "the topic (not read); not publishing it again", model,
                        st.binmap_version)
        elif st.binmap is not None and published < st.binmap_version:
            log.info("model %s: online bin map version %d was installed before the last "
                     "checkpoint but the topic holds %s: publishing it again", model,
                     st.binmap_version, published or "none")
            self.fitter.republish(model, st)

    async def _published_after_checkpoint(self, model: str, published: float | str | None
                                          ) -> bool:
        """True when the bin map published at ``published`` (Unix seconds, or its position
        ``topic[partition]@offset`` on the bin-map topic) came after ``model``'s checkpoint
        snapshot was taken (its envelope's ``saved_at``; for envelopes without it, its record
        timestamp, or its file's modification time with the local backend). The record is
        written after the snapshot, and a map published in between came after the snapshot:
        comparing with the record's time would fit that map's epoch again. False when either
        time is unknown: then no epoch is skipped (one may be fitted twice, under two versions;
        none is lost)."""
        where, saved_at = self._restored_from.get(model, (None, None))
        if where is None or published is None:
            return False
        k = self.s.kafka
        try:
            if isinstance(published, str):
                published = await readers.record_timestamp(
                    k.bootstrap_servers, published, security=k,
                    fetch_bytes=k.max_message_bytes)
            if saved_at is not None:
                written = saved_at
            elif os.path.isfile(where):
                written = os.stat(where).st_mtime
            else:
                written = await readers.record_timestamp(
                    k.bootstrap_servers, where, security=k,
                    fetch_bytes=self.s.state.max_record_bytes)
        except Exception as e:  # noqa: BLE001 - unknown: skip nothing
            log.warning("model %s: cannot read when its checkpoint or bin map was written "
                        "(%s: %s)", model, type(e).__name__, e)
            return False
        return published is not None and written is not None and published >= written

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
        slot = self.registry.get(model)
        st = None if slot is None else slot.state
        if st is not None and (bm.k, bm.lam) != (st.k, st.lam):
            self.metrics.inc_binmap_rejected("config")
            log.error("rejected bin map version %d of model %r: (k, lambda) = (%d, %d), but the "
                      "model's state has (%d, %d)", bm.version, model, bm.k, bm.lam, st.k,
                      st.lam)
            return None
        return bm
