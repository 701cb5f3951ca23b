"""Writing checkpoints (:class:`Checkpointer`): the state of every owned model and the input
offsets it covers, saved to the checkpoint store (:mod:`daemon.checkpoint.store`); the restore
side is :mod:`daemon.checkpoint.restorer`.

Exactly-once accounting (SIGKILL at any moment loses no accepted sample and counts none twice):

* all state of a model (pools, monitor sums, pending joins, bin map, a fit in flight) is
  checkpointed in one record ``model/<id>`` (an envelope,
  :data:`daemon.checkpoint.envelope.ENVELOPE_FORMAT`) together with the input offsets it covers;
* after the model records of input partition ``n`` are acknowledged, the manifest
  ``partition/<n>`` records the offsets of both input topics; consumer offsets are committed
  after that (they only serve lag monitoring);
* on assignment, the daemon restores the models of its partitions and seeks both topics to the
  manifest's offsets (or, without a manifest, to the smallest offsets of the model records, or
  to the beginning); an event at an offset below its model's recorded offset is skipped, since
  that model's checkpoint already contains it. Dead letters are flushed before any checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiokafka import TopicPartition

from daemon.checkpoint.envelope import encode_envelope, encode_manifest
from daemon.checkpoint.pacing import DEFAULT_MAX_SHARE, CheckpointPacing
from daemon.checkpoint.store import CheckpointStore

log = logging.getLogger("lpcal.daemon")

CHECKPOINT_BATCH_BYTES = 32 << 20  # model records encoded and saved together, at most


class Checkpointer:
    """Writes checkpoints (after quixstreams' ``Checkpoint``: the collaborators are given, a
    commit runs in numbered steps).

    Parameters
    ----------
    store : CheckpointStore
    registry : daemon.registry.ModelRegistry
    partitions : daemon.partitions.PartitionTable
        The assignment and the input positions.
    deadletters : daemon.ingest.DeadLetters
        Flushed before every checkpoint.
    clients : daemon.clients.KafkaClients
        Its consumer commits the offsets.
    metrics : daemon.metrics.DaemonMetrics
    interval : float, default 10
        ``state.checkpoint_interval_seconds``.
    max_share : float, default :data:`~daemon.checkpoint.pacing.DEFAULT_MAX_SHARE`
        ``state.checkpoint_max_cpu_share``: periodic checkpoints are paced (:attr:`pacing`,
        :meth:`due`) so that they take at most this share of the time.
    clock : callable, default ``time.monotonic``
        The pacing's clock.
    """

    def __init__(self, store: CheckpointStore, registry, partitions, deadletters, clients,
                 metrics, *, interval: float = 10.0, max_share: float = DEFAULT_MAX_SHARE,
                 clock: Callable[[], float] = time.monotonic,
                 flush_staged: Callable[[set[int]], None] | None = None):
        self.store, self.registry, self.partitions = store, registry, partitions
        self.deadletters, self.clients, self.metrics = deadletters, clients, metrics
        self.flush_staged = flush_staged
        self.topics = (clients.t_pred, clients.t_out)
        self.pacing = CheckpointPacing(interval, max_share, clock=clock)
        metrics.set_checkpoint_pacing(0.0, self.pacing.effective_interval)

    @property
    def last_at(self) -> float:
        """When the last checkpoint started (the pacing's clock)."""
        return self.pacing.last_at

    def due(self) -> bool:
        """True when the next periodic checkpoint may start: ``state.checkpoint_interval_seconds``
        after the last one started, or longer after a checkpoint that took more than
        ``checkpoint_max_cpu_share`` of that (:class:`~daemon.checkpoint.pacing.CheckpointPacing`).
        Checkpoints before a release or a shutdown call :meth:`commit` directly: never paced."""
        return self.pacing.due()

    async def commit(self, parts: set[int] | None = None, *, commit_offsets: bool = True
                     ) -> None:
        """Checkpoint the models of ``parts`` (default: all assigned), then their manifests.

        1. Flush the dead letters (no checkpoint covers an event whose dead letter is not on
           the broker).
        2. Advance every model's covered offsets to the current input positions.
        3. Take the models that changed (dirty) or have a fit in flight, and clear their dirty
           marks (synchronously: marks set while the save is awaited stay for next time).
        4. Save their envelopes in batches of at most :data:`CHECKPOINT_BATCH_BYTES`, so that
           the encoded checkpoints of many models are never all in memory at once.
        5. Save the manifests ``partition/<n>`` (input offsets and models of each partition),
           only after every model record is acknowledged.
        6. On failure, mark the models taken dirty again and count ``error``; else ``ok``.
        7. With ``commit_offsets``, commit the consumer offsets (they only feed lag
           monitoring: a failed commit is logged, never raised).

        A full checkpoint (``parts`` None) that succeeds sets the pacing's last duration
        (``lpcal_checkpoint_duration_seconds``) and so the effective interval
        (``lpcal_checkpoint_interval_seconds``)."""
        pacing = self.pacing
        start = pacing.started()
        full = parts is None
        table = self.partitions
        if parts is None:
            parts = table.numbers()
        reg = self.registry
        if self.flush_staged is not None:  # staged events enter their states (step 2 covers them)
            self.flush_staged(parts)
        try:
            if self.deadletters.pending:                                     # 1
                await self.deadletters.flush()
            models = reg.on_partitions(parts)                                # 2
            for m in models:
                slot = reg.slots[m]
                for topic in self.topics:
                    pos = table.position(topic, slot.partition)
                    if pos is not None:
                        slot.state.advance_offsets(topic, slot.partition, pos)
            todo = {m for m in models                                        # 3
                    if m in reg.dirty or reg.slots[m].inflight is not None}
            reg.dirty -= todo
            try:
                await self._save_models(todo)                                # 4
                manifests = self._manifests(parts, models)                   # 5
                if manifests:
                    await self.store.save(manifests)
            except BaseException:                                            # 6
                reg.dirty |= {m for m in todo if m in reg.slots}
                raise
            self.metrics.inc_checkpoint("ok")
        except Exception:
            pacing.finished(start, full=full, ok=False)
            self.metrics.inc_checkpoint("error")
            raise
        pacing.finished(start, full=full, ok=True)
        if full:
            self.metrics.set_checkpoint_pacing(pacing.last_duration, pacing.effective_interval)
        consumer = self.clients.consumer
        if commit_offsets and consumer is not None:                          # 7
            offsets = {TopicPartition(t, p): o for p in parts
                       if (ps := table.get(p)) is not None for t, o in ps.positions.items()}
            if offsets:
                try:
                    await consumer.commit(offsets)
                except Exception as e:  # noqa: BLE001 - commits only feed lag monitoring
                    log.warning("offset commit failed: %s", e)

    async def _save_models(self, todo: set[str]) -> None:
        """Save the envelopes of ``todo`` (in id order) in byte-bounded batches."""
        records: dict[str, bytes] = {}
        size = 0
        slots = self.registry.slots
        for m in sorted(todo):
            slot = slots.get(m)
            if slot is None:  # dropped while an earlier batch was saved
                continue
            records[f"model/{m}"] = rec = encode_envelope(m, slot)
            size += len(rec)
            if size >= CHECKPOINT_BATCH_BYTES:
                await self.store.save(records)
                records, size = {}, 0
        if records:
            await self.store.save(records)

    def _manifests(self, parts: set[int], models: list[str]) -> dict[str, bytes]:
        """The manifest records of ``parts``: their input offsets and models."""
        slots = self.registry.slots
        manifests = {}
        for p in parts:
            offs = {t: pos for t in self.topics
                    if (pos := self.partitions.position(t, p)) is not None}
            if offs:
                manifests[f"partition/{p}"] = encode_manifest(
                    offs, (m for m in models if m in slots and slots[m].partition == p))
        return manifests
