"""Where checkpoints live: a compacted Kafka topic (no PersistentVolume needed) or a local folder.

A checkpoint is a set of records ``key -> bytes``:

* ``model/<id>``: one model's envelope (see :mod:`daemon.service`): its ``ModelState`` (pools,
  monitor sums, pending joins, bin map, offsets covered) plus any fit in flight;
* ``partition/<n>``: the manifest of input partition ``n``, written *after* the model records of
  that partition: the input offsets every model of the partition covers at least.

Both backends keep only the latest value per key. The Kafka backend writes with the key as the
record key, so the compacted topic converges to one record per key; reads take the last value per
key (compaction is lazy, so readers never rely on it).

The Kafka backend compresses values of at least :data:`COMPRESS_MIN_BYTES` itself (zlib level
1, behind the prefix :data:`COMPRESSED`) in a worker thread, and its producer compresses
nothing: a model's checkpoint holds its recently joined ids and is MBs at the default join
bounds, and the producer's gzip (level 9) runs on the event loop (gzip of a 5.6 MB checkpoint
took 134 ms even at level 6), blocking consumption. zlib releases the GIL, so the loop keeps
polling meanwhile (level 1: 41 ms for 3.5 MB, to 44 %).
:func:`decode_value` reads both forms (values without the prefix pass unchanged: checkpoints
of earlier versions, manifests). The local backend writes values as they are, one file per
key with a bounded file name (see :class:`LocalCheckpointStore`).

Reading is bounded (issue 11, finding 4): ``load_all`` of the Kafka backend keeps only the raw
bytes of the latest value per key, *not decoded*, and remembers where each came from
(:meth:`KafkaCheckpointStore.where`: ``topic[partition]@offset``); the daemon decodes them one
at a time while restoring, each with :func:`decode_value`'s ``limit`` (``state.max_record_bytes``),
so a zlib bomb on the state topic inflates to at most that limit and is then rejected
(:class:`ValueTooLarge`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import urllib.parse
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

log = logging.getLogger("lpcal.daemon")

COMPRESSED = b"lpcal-zlib:"          # prefix of a value compressed by encode_value
COMPRESS_MIN_BYTES = 64 * 1024       # smaller values (manifests, small models) stay plain
MAX_INFLATED_BYTES = 1 << 30         # a compressed value must not inflate beyond this


def encode_value(value: bytes) -> bytes:
    """``value``, zlib-compressed (level 1) behind :data:`COMPRESSED` if it is large."""
    if len(value) < COMPRESS_MIN_BYTES:
        return value
    return COMPRESSED + zlib.compress(value, 1)


class ValueTooLarge(ValueError):
    """A state value (decoded) larger than the limit it was read with."""


def decode_value(value: bytes, limit: int | None = None) -> bytes:
    """Inverse of :func:`encode_value`; raises ValueError for a corrupt compressed value and
    :class:`ValueTooLarge` for a value that is, or would inflate to, more than ``limit`` bytes
    (default :data:`MAX_INFLATED_BYTES`). Inflation stops at ``limit + 1`` bytes, so a zlib
    bomb costs at most that much memory."""
    limit = MAX_INFLATED_BYTES if limit is None else int(limit)
    if not value.startswith(COMPRESSED):
        if len(value) > limit:
            raise ValueTooLarge(f"value of {len(value)} bytes is larger than {limit} bytes")
        return value
    d = zlib.decompressobj()
    try:
        out = d.decompress(memoryview(value)[len(COMPRESSED):], limit + 1)
    except zlib.error as e:
        raise ValueError(f"corrupt compressed checkpoint ({e})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ValueTooLarge(f"compressed checkpoint inflates beyond {limit} bytes")
    if not d.eof:
        raise ValueError("truncated compressed checkpoint")
    return out


class CheckpointStore(Protocol):
    async def load_all(self) -> dict[str, bytes]: ...

    async def save(self, records: Mapping[str, bytes]) -> None: ...


class KafkaCheckpointStore:
    """Checkpoints on a compacted topic; ``save`` returns once the broker acknowledged all.

    ``load_all`` returns the latest *raw* value per key (compressed values stay compressed:
    decode each with :func:`decode_value` when it is used, one at a time) and records each
    key's position for :meth:`where`."""

    def __init__(self, producer, bootstrap: str, topic: str, security: Mapping | None = None,
                 read_timeout: float = 30.0):
        self.producer, self.bootstrap, self.topic = producer, bootstrap, topic
        self.security, self.read_timeout = security, read_timeout
        self._where: dict[str, str] = {}

    def where(self, key: str) -> str:
        """Where ``key``'s value returned by the last ``load_all`` was read:
        ``topic[partition]@offset``."""
        return self._where.get(key, f"{self.topic}[?]@?")

    async def load_all(self) -> dict[str, bytes]:
        latest, where = await read_latest_with_positions(
            self.bootstrap, self.topic, timeout=self.read_timeout, security=self.security)
        self._where = where
        return latest

    async def save(self, records: Mapping[str, bytes]) -> None:
        items = list(records.items())
        if any(len(v) >= COMPRESS_MIN_BYTES for _, v in items):
            values = await asyncio.to_thread(lambda: [encode_value(v) for _, v in items])
        else:
            values = [v for _, v in items]
        futs = [await self.producer.send(self.topic, key=k.encode(), value=v)
                for (k, _), v in zip(items, values)]
        for f in futs:
            await f


async def read_latest_with_positions(bootstrap: str, topic: str, timeout: float = 30.0, *,
                                     security=None) -> tuple[dict[str, bytes],
                                                             dict[str, str]]:
    """The latest raw value per key of ``topic`` (as :func:`daemon.kafka_io.read_compacted_latest`
    with ``missing_ok``: tombstones delete, records without a UTF-8 key are skipped) and, per
    key, where that value was read (``topic[partition]@offset``). Nothing is decoded, and a
    value replaced by a later one is dropped as soon as the later one is read."""
    from aiokafka import TopicPartition

    from daemon.kafka_io import make_consumer

    consumer = make_consumer(bootstrap, group_id=None, security=security,
                             client_id="lpcal-state-reader")
    latest: dict[str, bytes] = {}
    where: dict[str, str] = {}
    skipped = 0
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            await consumer.topics()  # all-topics metadata: does not auto-create
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                return {}, {}
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.seek_to_beginning(*tps)
            pending = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
            while pending:
                batch = await consumer.getmany(*pending, timeout_ms=200)
                for tp, msgs in batch.items():
                    for m in msgs:  # records past the end snapshot are newer values: kept
                        try:
                            key = m.key.decode("utf-8")
                        except (AttributeError, UnicodeDecodeError):
                            skipped += 1
                            continue
                        if m.value is None:
                            latest.pop(key, None)
                            where.pop(key, None)
                        else:
                            latest[key] = m.value
                            where[key] = f"{topic}[{tp.partition}]@{m.offset}"
                for tp in list(pending):
                    if await consumer.position(tp) >= ends[tp]:
                        pending.discard(tp)
        finally:
            await consumer.stop()
    if skipped:
        log.warning("state topic %s: skipped %d records without a usable key", topic, skipped)
    return latest, where


class CheckpointSaveError(OSError):
    """Some records of a ``save`` could not be written; ``failed`` maps their keys to the error.
    The other records of the same call were written."""

    def __init__(self, failed: Mapping[str, BaseException]):
        self.failed = dict(failed)
        detail = "; ".join(f"{k[:80]}{'...' if len(k) > 80 else ''}: {type(e).__name__}: {e}"
                           for k, e in self.failed.items())
        super().__init__(f"{len(self.failed)} checkpoint record(s) not saved: {detail}")


NAME_MAX = 255                 # bytes of a file name on common file systems (ext4, xfs, ...)
HASHED_PREFIX_CHARS = 150      # escaped key characters kept in a hashed file name
KEY_HEADER = b"lpcal-key:"     # first line of a hashed file: the escaped key


class LocalCheckpointStore:
    """Checkpoints as files in a folder, each replaced atomically (write, fsync, rename).

    A key whose escaped form fits the file-name limit is stored as ``<escaped key>.ckpt`` (the
    layout of earlier versions, kept so their files are read and replaced in place). A longer
    key (model names have up to 255 characters, and escaping can triple them or more) is
    stored as ``<first 150 escaped characters>~<sha256 of the key, 32 hex>.hckpt``, whose first
    line is ``lpcal-key:<escaped key>``; the file name is bounded and unique per key.

    ``save`` writes every record it can: a record that fails does not stop the others; the
    failures are raised together afterwards (:class:`CheckpointSaveError`).
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> tuple[Path, bool]:
        """The file of ``key`` and whether it is a hashed (``.hckpt``) file."""
        escaped = urllib.parse.quote(key, safe="")
        if len(escaped) + len(".ckpt") <= NAME_MAX:
            return self.dir / (escaped + ".ckpt"), False
        stem = escaped[:HASHED_PREFIX_CHARS]
        cut = stem.rfind("%", len(stem) - 2)
        if cut >= 0:  # do not end inside a %XX escape
            stem = stem[:cut]
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return self.dir / f"{stem}~{digest}.hckpt", True

    async def load_all(self) -> dict[str, bytes]:
        out = {}
        for p in sorted(self.dir.glob("*.ckpt")):
            out[urllib.parse.unquote(p.name[: -len(".ckpt")])] = p.read_bytes()
        for p in sorted(self.dir.glob("*.hckpt")):
            data = p.read_bytes()
            head, sep, value = data.partition(b"\n")
            key = urllib.parse.unquote(head[len(KEY_HEADER):].decode("ascii", "replace"))
            if not (sep and head.startswith(KEY_HEADER)) or self._path(key)[0] != p:
                log.error("ignoring checkpoint file %s: no key header matching its name", p.name)
                continue
            out[key] = value
        return out

    def where(self, key: str) -> str:
        """The file ``key`` is stored in (for log lines about its value)."""
        return str(self._path(key)[0])

    def _write(self, key: str, value: bytes) -> None:
        path, hashed = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                if hashed:
                    f.write(KEY_HEADER + urllib.parse.quote(key, safe="").encode() + b"\n")
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    async def save(self, records: Mapping[str, bytes]) -> None:
        failed: dict[str, BaseException] = {}
        for key, value in records.items():
            try:
                self._write(key, value)
            except Exception as e:  # noqa: BLE001 - one record must not stop the others
                failed[key] = e
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        if failed:
            raise CheckpointSaveError(failed)
