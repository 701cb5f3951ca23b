"""Where checkpoints live: a compacted Kafka topic (no PersistentVolume needed) or a local folder.

A checkpoint is a set of records ``key -> bytes``:

* ``model/<id>``: one model's envelope (:mod:`daemon.checkpoint.envelope`): its ``ModelState``
  (pools, monitor sums, pending joins, bin map, offsets covered) plus any fit in flight;
* ``partition/<n>``: the manifest of input partition ``n``, written *after* the model records of
  that partition: the input offsets every model of the partition covers at least.

Both backends keep only the latest value per key. The Kafka backend writes with the key as the
record key, so the compacted topic converges to one record per key; reads take the last value per
key (compaction is lazy, so readers never rely on it).

The Kafka backend compresses values of at least :data:`COMPRESS_MIN_BYTES` itself (zstd level
1, behind the prefix :data:`COMPRESSED`) in a worker thread, and its producer compresses
nothing: a model's checkpoint holds its recently joined ids and is MBs at the default join
bounds, and the producer's gzip (level 9) runs on the event loop (gzip of a 5.6 MB checkpoint
took 134 ms even at level 6), blocking consumption. The checkpoint waits for its values, so
their compression is part of every checkpoint's pause of consumption. Checkpoints are mostly
base64 of float64 arrays, which compress to about two thirds: measured on a 1.9 MB online
model's checkpoint, zlib level 1 (what earlier versions wrote, behind :data:`ZLIB`) ran at
36 MB/s to 0.70 of the size, zstd level 1 at 579 MB/s to 0.67. With 100 online models (174 MB
of checkpoints) zlib took 5.0 s of CPU per checkpoint and the checkpoint paused consumption
for 7 to 9 s.
:func:`decode_value` reads all three forms (values without a prefix pass unchanged: manifests,
small models and checkpoints of earlier versions). The local backend writes values as they
are, one file per key with a bounded file name (see :class:`LocalCheckpointStore`).

Records fit the broker. The Kafka backend writes no record larger than
``max_record_bytes`` (``state.max_record_bytes``, default 1 MiB: a Kafka broker's default
message limit). A larger value (after compression) is split, in four steps:

1. its bytes are cut into *parts* ``part/<key>/<digest>/<i>`` (``digest``: the first 16 hex
   of the value's sha256, so the keys are new whenever the content is), each small enough.
   No model or manifest key starts with ``part/``, whatever a model is named;
2. every part is written and acknowledged;
3. the *head* ``<key>`` is written: :data:`CHUNKED` + JSON ``{"parts", "bytes", "sha256"}``;
4. once the head is acknowledged, the parts of the value it replaced are deleted (tombstones).

A crash before step 3 leaves the previous head and its parts intact (the new parts are
unreferenced and deleted at the next save of that key after a restore); a crash before step 4
leaves stale parts that the next save deletes. ``load_all`` reassembles each head from its
parts and checks length and sha256; a head whose parts are missing or do not match stays as it
is, and :func:`decode_value` rejects it (``ValueError``), so that model starts fresh.

Reading is bounded: ``load_all`` of the Kafka backend keeps only the raw
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

import orjson
import zstandard

log = logging.getLogger("lpcal.daemon")

COMPRESSED = b"lpcal-zstd:"          # prefix of a value compressed by encode_value (a zstd frame)
ZLIB = b"lpcal-zlib:"                # prefix of a zlib-compressed value (earlier versions; read)
CHUNKED = b"lpcal-chunks:"           # prefix of the head of a value split into parts
PART = "part/"                       # part/<key>/<digest>/<i>: the parts of a split value
RECORD_OVERHEAD = 512                # bytes of a record and its batch besides key and value
COMPRESS_MIN_BYTES = 64 * 1024       # smaller values (manifests, small models) stay plain
MAX_INFLATED_BYTES = 1 << 30         # a compressed value must not inflate beyond this
#: largest zstd window a decompression accepts (level 1 writes 512 KiB windows): a frame that
#: asks for more is corrupt, not an allocation
MAX_WINDOW_BYTES = 1 << 24


def encode_value(value: bytes) -> bytes:
    """``value``, zstd-compressed (level 1, with its size in the frame) behind
    :data:`COMPRESSED` if it is large."""
    if len(value) < COMPRESS_MIN_BYTES:
        return value
    # a compressor per value: instances are not thread-safe, and saves run in worker threads
    return COMPRESSED + zstandard.ZstdCompressor(level=1).compress(value)


class ValueTooLarge(ValueError):
    """A state value (decoded) larger than the limit it was read with."""


def decode_value(value: bytes, limit: int | None = None) -> bytes:
    """Inverse of :func:`encode_value` (and of the zlib form of earlier versions, :data:`ZLIB`);
    raises ValueError for a corrupt or truncated compressed value and :class:`ValueTooLarge`
    for a value that is, or would inflate to, more than ``limit`` bytes (default
    :data:`MAX_INFLATED_BYTES`). Inflation stops at ``limit + 1`` bytes, so a compression bomb
    costs at most that much memory (and a zstd window at most :data:`MAX_WINDOW_BYTES`)."""
    limit = MAX_INFLATED_BYTES if limit is None else int(limit)
    if value.startswith(CHUNKED):
        raise ValueError("checkpoint split into parts that are missing or do not match its "
                         f"head ({bytes(value[:200]).decode('utf-8', 'replace')})")
    if value.startswith(COMPRESSED):
        return _inflate_zstd(memoryview(value)[len(COMPRESSED):], limit)
    if value.startswith(ZLIB):
        return _inflate_zlib(memoryview(value)[len(ZLIB):], limit)
    if len(value) > limit:
        raise ValueTooLarge(f"value of {len(value)} bytes is larger than {limit} bytes")
    return value


def _inflate_zstd(frame: memoryview, limit: int) -> bytes:
    """One zstd frame that states its content size (as :func:`encode_value` writes it)."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt compressed checkpoint ({e})") from None
    if size < 0:
        raise ValueError("corrupt compressed checkpoint (the frame does not state its size)")
    if size > limit:
        raise ValueTooLarge(f"compressed checkpoint inflates to {size} bytes, beyond {limit}")
    d = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
    try:
        with d.stream_reader(frame, read_across_frames=False) as r:
            out = r.read(size + 1)  # more than the frame states: corrupt, and bounded
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt compressed checkpoint ({e})") from None
    if len(out) != size:
        raise ValueError(f"truncated or corrupt compressed checkpoint ({len(out)} bytes where "
                         f"its frame states {size})")
    return out


def _inflate_zlib(data: memoryview, limit: int) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise ValueError(f"corrupt compressed checkpoint ({e})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ValueTooLarge(f"compressed checkpoint inflates beyond {limit} bytes")
    if not d.eof:
        raise ValueError("truncated compressed checkpoint")
    return out


def state_topic_config(max_record_bytes: int) -> dict[str, str]:
    """Configs of the state topic the daemon creates: compacted, records up to the size the
    daemon writes (``state.max_record_bytes``; larger checkpoints are split into parts)."""
    return {"cleanup.policy": "compact", "max.message.bytes": str(int(max_record_bytes))}


class CheckpointStore(Protocol):
    """What the daemon needs of a store: read every record, save some, say where a record
    was read from (for logs)."""

    async def load_all(self) -> dict[str, bytes]: ...

    async def save(self, records: Mapping[str, bytes]) -> None: ...

    def where(self, key: str) -> str: ...


class ConfiguredStore:
    """The store of ``state.backend``, opened at startup (:meth:`open`, once the producer
    runs): a :class:`LocalCheckpointStore` or a :class:`KafkaCheckpointStore` whose state
    topic must accept records of ``state.max_record_bytes``."""

    def __init__(self, settings):
        self.s = settings
        self.backend: LocalCheckpointStore | KafkaCheckpointStore | None = None

    async def open(self, producer) -> None:
        k, state = self.s.kafka, self.s.state
        if state.backend == "local":
            self.backend = LocalCheckpointStore(state.local_dir)
        else:
            await check_record_limit(k.bootstrap_servers, k.topics.state,
                                     state.max_record_bytes, security=k)
            self.backend = KafkaCheckpointStore(
                producer, k.bootstrap_servers, k.topics.state, security=k,
                max_record_bytes=state.max_record_bytes)

    async def load_all(self) -> dict[str, bytes]:
        return await self.backend.load_all()

    async def save(self, records: Mapping[str, bytes]) -> None:
        await self.backend.save(records)

    def where(self, key: str) -> str:
        return key if self.backend is None else self.backend.where(key)


def reassemble(latest: dict[str, bytes]) -> tuple[dict[str, bytes], dict[str, set[str]]]:
    """``(values, stale)`` of the latest records of a state topic: each complete head replaced
    by the value of its parts (length and sha256 checked), the parts dropped; ``stale`` maps a
    key to its part keys that no head uses. A head whose parts are missing or do not match
    stays as it is (:func:`decode_value` rejects it). ``latest`` is emptied as it is read, so
    a value and its parts are not held twice for long."""
    parts: dict[str, dict[str, bytes]] = {}
    for key in [k for k in latest if k.startswith(PART)]:
        parts.setdefault(key[len(PART):].rsplit("/", 2)[0], {})[key] = latest.pop(key)
    for key, value in latest.items():
        if not value.startswith(CHUNKED):
            continue
        mine = parts.get(key, {})
        try:
            head = orjson.loads(value[len(CHUNKED):])
            n, size, digest = int(head["parts"]), int(head["bytes"]), str(head["sha256"])
            names = [f"{PART}{key}/{digest[:16]}/{i}" for i in range(n)]
            if not 0 < n <= 1 << 16 or any(name not in mine for name in names):
                continue
            whole = b"".join(mine.pop(name) for name in names)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if len(whole) == size and hashlib.sha256(whole).hexdigest() == digest:
            latest[key] = whole
    return latest, {key: set(left) for key, left in parts.items() if left}


class KafkaCheckpointStore:
    """Checkpoints on a compacted topic; ``save`` returns once the broker acknowledged all.

    ``load_all`` returns the latest *raw* value per key (compressed values stay compressed:
    decode each with :func:`decode_value` when it is used, one at a time; values split into
    parts come back reassembled) and records each key's position for :meth:`where`. No record
    written is larger than ``max_record_bytes`` (see the module docstring)."""

    def __init__(self, producer, bootstrap: str, topic: str, security: Mapping | None = None,
                 read_timeout: float = 30.0, max_record_bytes: int = 1 << 20):
        self.producer, self.bootstrap, self.topic = producer, bootstrap, topic
        self.security, self.read_timeout = security, read_timeout
        if max_record_bytes < 4 * RECORD_OVERHEAD + 1024:
            raise ValueError(f"max_record_bytes {max_record_bytes} is too small")
        self.max_record_bytes = int(max_record_bytes)
        self._where: dict[str, str] = {}
        #: per key, part keys written or read that its current head does not use: deleted by
        #: the next save of that key
        self._stale: dict[str, set[str]] = {}

    def where(self, key: str) -> str:
        """Where ``key``'s value returned by the last ``load_all`` was read:
        ``topic[partition]@offset``."""
        return self._where.get(key, f"{self.topic}[?]@?")

    async def load_all(self) -> dict[str, bytes]:
        latest, where = await read_latest_with_positions(
            self.bootstrap, self.topic, timeout=self.read_timeout, security=self.security)
        self._where = where
        return self._reassemble(latest)

    def _reassemble(self, latest: dict[str, bytes]) -> dict[str, bytes]:
        values, stale = reassemble(latest)
        for key, parts in stale.items():
            self._stale.setdefault(key, set()).update(parts)
        return values

    def _split(self, key: str, value: bytes) -> tuple[list[tuple[str, bytes]], bytes]:
        """``(parts, head)`` of a value too large for one record."""
        digest = hashlib.sha256(value).hexdigest()
        stem = f"{PART}{key}/{digest[:16]}/"
        size = self.max_record_bytes - RECORD_OVERHEAD - len((stem + "99999").encode())
        n = -(-len(value) // size)
        parts = [(f"{stem}{i}", value[i * size:(i + 1) * size]) for i in range(n)]
        head = CHUNKED + orjson.dumps({"parts": n, "bytes": len(value), "sha256": digest})
        return parts, head

    async def save(self, records: Mapping[str, bytes]) -> None:
        items = list(records.items())
        if any(len(v) >= COMPRESS_MIN_BYTES for _, v in items):
            values = await asyncio.to_thread(lambda: [encode_value(v) for _, v in items])
        else:
            values = [v for _, v in items]
        limit = self.max_record_bytes - RECORD_OVERHEAD
        whole, split = [], []
        for (key, _), value in zip(items, values):
            if len(value) + len(key.encode()) <= limit:
                whole.append((key, value))
            else:
                split.append((key, *self._split(key, value)))
        send = self.producer.send
        # steps 1-2: the parts of split values, acknowledged before any head names them
        futs = [await send(self.topic, key=pk.encode(), value=pv)
                for _key, parts, _head in split for pk, pv in parts]
        for f in futs:
            await f
        # step 3: heads and whole values
        futs = [await send(self.topic, key=key.encode(), value=value)
                for key, value in [*whole, *((key, head) for key, _p, head in split)]]
        for f in futs:
            await f
        # step 4: delete the parts the new values no longer use (an unchanged value has the
        # same digest, so the same part keys: those stay); the new parts become stale once a
        # later value replaces them
        live = {key: {pk for pk, _ in parts} for key, parts, _head in split}
        dead = sorted(pk for key, _v in items
                      for pk in self._stale.pop(key, set()) - live.get(key, set()))
        self._stale.update(live)
        futs = [await send(self.topic, key=pk.encode(), value=None) for pk in dead]
        for f in futs:
            await f


async def check_record_limit(bootstrap: str, topic: str, max_record_bytes: int, *,
                             security=None, timeout: float = 10.0) -> int | None:
    """The ``max.message.bytes`` of ``topic``, after checking that ``max_record_bytes`` fits
    it (:class:`RecordLimitError` naming both settings otherwise); None, with a warning, if the
    broker does not report it (then nothing could be checked)."""
    from daemon.kafka.topics import describe_topic_config

    try:
        configs = await describe_topic_config(bootstrap, topic, security=security,
                                              timeout=timeout)
        limit = configs.get("max.message.bytes")
        limit = None if limit is None else int(limit)
    except Exception as e:  # noqa: BLE001 - unsupported or unreachable: reported as unknown
        log.warning("could not read max.message.bytes of state topic %s (%s: %s); cannot check "
                    "state.max_record_bytes = %d against it", topic, type(e).__name__, e,
                    max_record_bytes)
        return None
    if limit is None:
        log.warning("state topic %s: the broker does not report max.message.bytes; cannot "
                    "check state.max_record_bytes = %d against it", topic, max_record_bytes)
        return None
    if limit < max_record_bytes:
        raise RecordLimitError(
            f"state topic {topic!r} accepts records of at most {limit} bytes "
            f"(max.message.bytes) but state.max_record_bytes is {max_record_bytes}: lower "
            f"state.max_record_bytes to {limit} or raise the topic's max.message.bytes")
    return limit


class RecordLimitError(ValueError):
    """``state.max_record_bytes`` is above the state topic's ``max.message.bytes``."""


async def read_latest_with_positions(bootstrap: str, topic: str, timeout: float = 30.0, *,
                                     security=None) -> tuple[dict[str, bytes],
                                                             dict[str, str]]:
    """The latest raw value per key of ``topic`` and, per key, where that value was read
    (``topic[partition]@offset``): :func:`daemon.kafka.readers.read_compacted_latest` with
    ``missing_ok`` (a missing topic holds no checkpoint)."""
    from daemon.kafka.readers import read_compacted_latest

    where: dict[str, str] = {}
    latest = await read_compacted_latest(bootstrap, topic, timeout, security=security,
                                         missing_ok=True, where=where,
                                         client_id="lpcal-state-reader")
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
