"""Checkpoints, mixed into :class:`daemon.service.Daemon`: the state of every owned model and
the input offsets it covers, saved to the checkpoint store (:mod:`daemon.checkpoint_store`);
the restore side is :mod:`daemon.restore`.

Exactly-once accounting (SIGKILL at any moment loses no accepted sample and counts none twice):

* all state of a model (pools, monitor sums, pending joins, bin map, a fit in flight) is
  checkpointed in one record ``model/<id>`` (an envelope, :data:`ENVELOPE_FORMAT`) together
  with the input offsets it covers;
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

import orjson
from aiokafka import TopicPartition

from daemon.checkpoint_store import KafkaCheckpointStore, LocalCheckpointStore, check_record_limit

log = logging.getLogger("lpcal.daemon")

ENVELOPE_FORMAT = "lpcal.envelope/1"
CHECKPOINT_BATCH_BYTES = 32 << 20  # model records encoded and saved together, at most


def state_topic_config(max_record_bytes: int) -> dict[str, str]:
    """Configs of the state topic the daemon creates: compacted, records up to the size the
    daemon writes (``state.max_record_bytes``; larger checkpoints are split into parts)."""
    return {"cleanup.policy": "compact", "max.message.bytes": str(int(max_record_bytes))}


class Checkpointing:
    """The checkpoint writer of the daemon (uses ``registry``, ``positions``, ``assigned``,
    ``consumer``, ``metrics`` and ``_store`` of :class:`daemon.service.Daemon`)."""

    async def _open_store(self) -> None:
        """The checkpoint store of ``state.backend``, unless one was given (tests); a Kafka
        state topic must accept records of ``state.max_record_bytes``."""
        if self._store is not None:
            return
        k, state = self.s.kafka, self.s.state
        if state.backend == "local":
            self._store = LocalCheckpointStore(state.local_dir)
        else:
            await check_record_limit(k.bootstrap_servers, k.topics.state,
                                     state.max_record_bytes, security=k)
            self._store = KafkaCheckpointStore(
                self.producer, k.bootstrap_servers, k.topics.state, security=k,
                max_record_bytes=state.max_record_bytes)

    def _envelope(self, model: str) -> bytes:
        """The checkpoint record of ``model``: its state, partition, fit in flight, prefitted
        count and ``saved_at``, the wall-clock time of this snapshot (:data:`ENVELOPE_FORMAT`).
        The restore compares bin maps on the topic with ``saved_at``, not with the record's
        time: a map published while the snapshot was being written came after it."""
        slot = self.registry.slots[model]
        inf = slot.inflight
        return orjson.dumps({
            "format": ENVELOPE_FORMAT,
            "model": model,
            "partition": slot.partition,
            "state": orjson.Fragment(slot.state.to_checkpoint()),
            "inflight": None if inf is None else {
                "pools": inf.pools.to_dict(), "trigger": inf.trigger, "version": inf.version},
            "prefitted": slot.prefitted,
            "saved_at": time.time(),
        })

    async def checkpoint(self, parts: set[int] | None = None, commit: bool = True) -> None:
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
        7. With ``commit``, commit the consumer offsets (they only feed lag monitoring: a
           failed commit is logged, never raised)."""
        self._last_ckpt = time.monotonic()
        if parts is None:
            parts = {tp.partition for tp in self.assigned}
        reg = self.registry
        try:
            if self._dlq:                                                    # 1
                await self._flush_deadletters()
            models = reg.on_partitions(parts)                                # 2
            for m in models:
                slot = reg.slots[m]
                for topic in (self.t_pred, self.t_out):
                    pos = self.positions.get((topic, slot.partition))
                    if pos is not None:
                        slot.state.advance_offsets(topic, slot.partition, pos)
            todo = {m for m in models                                        # 3
                    if m in reg.dirty or reg.slots[m].inflight is not None}
            reg.dirty -= todo
            try:
                await self._save_models(todo)                                # 4
                manifests = self._manifests(parts, models)                   # 5
                if manifests:
                    await self._store.save(manifests)
            except BaseException:                                            # 6
                reg.dirty |= {m for m in todo if m in reg.slots}
                raise
            self.metrics.inc_checkpoint("ok")
        except Exception:
            self.metrics.inc_checkpoint("error")
            raise
        if commit and self.consumer is not None:                             # 7
            offsets = {TopicPartition(t, p): o for (t, p), o in self.positions.items()
                       if p in parts}
            if offsets:
                try:
                    await self.consumer.commit(offsets)
                except Exception as e:  # noqa: BLE001 - commits only feed lag monitoring
                    log.warning("offset commit failed: %s", e)

    async def _save_models(self, todo: set[str]) -> None:
        """Save the envelopes of ``todo`` (in id order) in byte-bounded batches."""
        records: dict[str, bytes] = {}
        size = 0
        for m in sorted(todo):
            if m not in self.registry.slots:  # dropped while an earlier batch was saved
                continue
            records[f"model/{m}"] = rec = self._envelope(m)
            size += len(rec)
            if size >= CHECKPOINT_BATCH_BYTES:
                await self._store.save(records)
                records, size = {}, 0
        if records:
            await self._store.save(records)

    def _manifests(self, parts: set[int], models: list[str]) -> dict[str, bytes]:
        """The manifest records of ``parts``: their input offsets and models."""
        partition_of = self.registry.partition_of
        manifests = {}
        for p in parts:
            offs = {t: self.positions[(t, p)] for t in (self.t_pred, self.t_out)
                    if (t, p) in self.positions}
            if offs:
                manifests[f"partition/{p}"] = orjson.dumps(
                    {"offsets": offs, "models": sorted(m for m in models
                                                       if partition_of.get(m) == p)})
        return manifests
