"""Where checkpoints live: a compacted Kafka topic (no PersistentVolume needed) or a local folder.

A checkpoint is a set of records ``key -> bytes``:

* ``model/<id>``: one model's envelope (see :mod:`daemon.service`): its ``ModelState`` (pools,
  monitor sums, pending joins, bin map, offsets covered) plus any fit in flight;
* ``partition/<n>``: the manifest of input partition ``n``, written *after* the model records of
  that partition: the input offsets every model of the partition covers at least.

Both backends keep only the latest value per key. The Kafka backend writes with the key as the
record key, so the compacted topic converges to one record per key; reads take the last value per
key (compaction is lazy, so readers never rely on it).
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from daemon.kafka_io import read_compacted_latest


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
        return {(k.decode() if isinstance(k, bytes) else str(k)): v
                for k, v in latest.items() if v is not None}

    async def save(self, records: Mapping[str, bytes]) -> None:
        futs = [await self.producer.send(self.topic, key=k.encode(), value=v)
                for k, v in records.items()]
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
