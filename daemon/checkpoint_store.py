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
of earlier versions, manifests). The local backend writes values as they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import urllib.parse
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from daemon.kafka_io import read_compacted_latest

log = logging.getLogger("lpcal.daemon")

COMPRESSED = b"lpcal-zlib:"          # prefix of a value compressed by encode_value
COMPRESS_MIN_BYTES = 64 * 1024       # smaller values (manifests, small models) stay plain
MAX_INFLATED_BYTES = 1 << 30         # a compressed value must not inflate beyond this


def encode_value(value: bytes) -> bytes:
    """``value``, zlib-compressed (level 1) behind :data:`COMPRESSED` if it is large."""
    if len(value) < COMPRESS_MIN_BYTES:
        return value
    return COMPRESSED + zlib.compress(value, 1)


def decode_value(value: bytes) -> bytes:
    """Inverse of :func:`encode_value`; raises ValueError for a corrupt compressed value."""
    if not value.startswith(COMPRESSED):
        return value
    d = zlib.decompressobj()
    try:
        out = d.decompress(memoryview(value)[len(COMPRESSED):], MAX_INFLATED_BYTES)
    except zlib.error as e:
        raise ValueError(f"corrupt compressed checkpoint ({e})") from None
    if d.unconsumed_tail:
        raise ValueError(f"compressed checkpoint inflates beyond {MAX_INFLATED_BYTES} bytes")
    if not d.eof:
        raise ValueError("truncated compressed checkpoint")
    return out


class CheckpointStore(Protocol):
    async def load_all(self) -> dict[str, bytes]: ...

    async def save(self, records: Mapping[str, bytes]) -> None: ...


class KafkaCheckpointStore:
    """Checkpoints on a compacted topic; ``save`` returns once the broker acknowledged all."""

    def __init__(self, producer, bootstrap: str, topic: str, security: Mapping | None = None,
                 read_timeout: float = 30.0):
        self.producer, self.bootstrap, self.topic = producer, bootstrap, topic
        self.security, self.read_timeout = security, read_timeout

    async def load_all(self) -> dict[str, bytes]:
        latest = await read_compacted_latest(self.bootstrap, self.topic,
                                             timeout=self.read_timeout, security=self.security,
                                             missing_ok=True)
        out = {}
        for k, v in latest.items():
            if v is None:
                continue
            key = k.decode() if isinstance(k, bytes) else str(k)
            try:
                out[key] = decode_value(v)
            except ValueError as e:  # kept as is: restoring it fails with a logged error
                log.error("checkpoint record %s: %s", key, e)
                out[key] = v
        return out

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


class LocalCheckpointStore:
    """Checkpoints as files in a folder, each replaced atomically (write, fsync, rename)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.dir / (urllib.parse.quote(key, safe="") + ".ckpt")

    async def load_all(self) -> dict[str, bytes]:
        out = {}
        for p in sorted(self.dir.glob("*.ckpt")):
            out[urllib.parse.unquote(p.name[: -len(".ckpt")])] = p.read_bytes()
        return out

    async def save(self, records: Mapping[str, bytes]) -> None:
        for key, value in records.items():
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
