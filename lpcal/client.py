"""Downstream bin-map client: keep the latest verified bin map per model and apply it from any thread.

Pure lpcal (numpy + orjson + the standard library): no Kafka, HTTP-server or metrics package is
imported, and nothing here depends on the ``daemon`` package. Kafka is reached through a consumer
object the caller builds (duck-typed; e.g. an ``aiokafka.AIOKafkaConsumer``).

API::

    store = BinMapStore(public_keys=["/etc/lpcal/binmap-signing.pub"])  # model -> BinMap
    store.offer(raw_bytes, model="fraud-v3", source="x")   # verify; True when it was installed
    store.offer(load_file("fraud-v3.json"))                # a BinMap object works too
    store.offer(load_http("http://lpcal:8080/v1/models/fraud-v3/binmap", timeout=5))
    calibrated = store.apply("fraud-v3", probs)            # thread-safe, lock-free
    store.get("fraud-v3"), store.models(), store.versions(), store.rejections

    follower = BinMapFollower(store, consumer)             # consumer: group_id=None, topic assigned
    task = asyncio.create_task(follower.run()); await follower.wait_ready(30)
    ...; await follower.stop()
    FollowerThread(store, make_consumer).start()           # the same from synchronous programs

Acceptance rules of :meth:`BinMapStore.offer`
---------------------------------------------
* The artifact is verified with :meth:`BinMap.from_json` (checksum, schema, every field). A
  rejected artifact never replaces anything: the previous good map stays in force. Rejections are
  counted by reason (:data:`REJECT_REASONS`):

  - ``truncated``: empty, or the JSON ends early;
  - ``parse``: not JSON / not an object, or a field is malformed although the checksum matches;
  - ``schema``: a schema version this lpcal cannot read;
  - ``checksum``: missing checksum, or the content does not match it (corrupt or tampered);
  - ``model``: the artifact's ``model_id`` differs from the model it was published under (the
    Kafka record key);
  - ``signature``: public keys are configured (``public_keys=``) and the artifact is unsigned,
    signed by a key not among them, or its signature does not verify (forged or tampered). A
    :class:`BinMap` object is accepted only if it was loaded with a key of this store
    (:attr:`BinMap.verified_by`).

* Without ``public_keys`` nothing is authenticated (a warning is logged once): anyone who can
  write to the bin-map topic can then install a map. Configure the daemon's public key(s) in
  production; several keys may be given while a key is rotated.
* Versions are integers in ``[0, 2**53 - 1]`` (:data:`lpcal.binmap.MAX_VERSION`); any other
  version is rejected (``parse``).

* Version order: a map whose ``version`` is lower than the installed one is ignored (``stale``), an
  equal version with the same checksum is ignored (``duplicate``). An equal version with another
  checksum replaces the installed one (last write wins, as on the compacted topic: a refit of the
  same version after a daemon failover differs only in ``created_at``). A higher version is
  swapped in atomically. ``offer(..., force=True)`` installs regardless of version (e.g. after a
  daemon's state was wiped and its versions restarted at 1).

Memory-model argument for the lock-free ``apply``
-------------------------------------------------
The registry is an immutable snapshot: ``self._maps`` is a ``dict`` that is never mutated after it
has been published. A writer (holding ``self._lock``; writers are serialised) builds a new dict
holding the new, completely constructed :class:`BinMap` and publishes it with ONE attribute store
(``self._maps = new``). A reader performs ONE attribute load and one ``dict.get`` and from then on
uses only the :class:`BinMap` it obtained. ``BinMap`` is a frozen dataclass whose arrays are never
written after construction (``apply`` only reads them and the single-row ``dict`` and lookup table
the constructor built, and writes only into its own output and scratch arrays), so:

* the reference a reader obtains is either the old or the new snapshot, never a partial one
  (reference loads/stores are atomic in CPython: a single bytecode under the GIL; in free-threaded
  CPython 3.13+ object attribute and ``dict`` accesses are atomic as well);
* every object reachable from a published reference was fully built before the store, and the
  store happens-before any load that observes it (GIL hand-off, or the per-object synchronisation
  of the free-threaded build), so a reader never sees a half-initialised map;
* a call that started with version 1 finishes with version 1 even if version 2 is installed
  meanwhile: each call's output is exactly the output of one map.

Readers therefore take no lock; the lock only orders writers (version comparison + swap) and
guards the counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import inspect
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

import numpy as np
import orjson

from lpcal.binmap import MAX_VERSION, READABLE_SCHEMAS, BinMap
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.signing import KeyRing, SignatureError

__all__ = [
    "REJECT_REASONS",
    "BinMapFollower",
    "BinMapLoadError",
    "BinMapRejected",
    "BinMapStore",
    "FollowerThread",
    "KeyRing",
    "Rejection",
    "UnknownModelError",
    "fetch_http",
    "load_file",
    "load_http",
    "verify_artifact",
]

log = logging.getLogger("lpcal.client")

REJECT_REASONS: tuple[str, ...] = ("checksum", "truncated", "schema", "parse", "model",
                                   "signature")
"""Bounded reasons under which :class:`BinMapStore` counts rejected artifacts."""

IGNORE_REASONS: tuple[str, ...] = ("stale", "duplicate")
"""Reasons under which valid, but not newer, artifacts are ignored."""

_MISSING = ("error", "identity")


# --------------------------------------------------------------------------- errors


class BinMapRejected(ArtifactError):
    """An artifact failed verification; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BinMapLoadError(LpcalError, OSError):
    """A bin map could not be read (missing file, HTTP error, connection failure, timeout)."""


class UnknownModelError(LpcalError, LookupError):
    """``apply`` was called for a model that has no bin map in the store."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """What :class:`BinMapStore` hands to ``on_reject`` for every rejected artifact."""

    reason: str
    model: str | None
    source: str
    message: str


# --------------------------------------------------------------------------- verification


def _verify(data: bytes | bytearray | memoryview | str, where: str,
            ring: KeyRing | None = None) -> tuple[BinMap, str]:
    """``(bin map, checksum)`` or :class:`BinMapRejected` with the reason classified."""
    if isinstance(data, str):
        data = data.encode()
    data = bytes(data)
    if not data:
        raise BinMapRejected("truncated", f"{where}: empty artifact (0 bytes)")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        if e.pos >= len(data) or "end of data" in e.msg:
            raise BinMapRejected("truncated", f"{where}: truncated artifact: JSON ends early "
                                 f"after {len(data)} bytes ({e.msg})") from None
        raise BinMapRejected("parse", f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BinMapRejected("parse", f"{where}: top level must be a JSON object, "
                             f"got {type(obj).__name__}")
    schema = obj.get("schema")
    if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
        raise BinMapRejected("schema", f"{where}: incompatible schema {schema!r}; this lpcal "
                             f"reads schemas {', '.join(map(str, READABLE_SCHEMAS))}")
    checksum = obj.get("checksum")
    if not isinstance(checksum, str):
        raise BinMapRejected("checksum", f"{where}: missing checksum")
    try:
        bm = BinMap.from_json(data, where=where, public_keys=ring)
    except SignatureError as e:
        raise BinMapRejected("signature", str(e)) from None
    except ArtifactError as e:
        content = {k: v for k, v in obj.items() if k != "checksum"}
        try:
            intact = BinMap._digest(content) == checksum
        except (TypeError, orjson.JSONEncodeError):
            intact = False
        raise BinMapRejected("parse" if intact else "checksum", str(e)) from None
    return bm, checksum


def verify_artifact(data: bytes | str, *, where: str = "bin map",
                    public_keys: Any = None) -> BinMap:
    """Verify and load an artifact; raises :class:`BinMapRejected` (an ``ArtifactError``) whose
    ``reason`` is one of ``truncated | parse | schema | checksum | signature``.

    ``public_keys``: a :class:`KeyRing` or what it takes (PEM, raw or base64 keys, key files);
    when given, a valid signature by one of them is required (``signature`` otherwise)."""
    return _verify(data, where, KeyRing.of(public_keys))[0]


# --------------------------------------------------------------------------- loaders


def load_file(path: str | os.PathLike, *, public_keys: Any = None) -> BinMap:
    """Load and verify a bin map JSON file (``public_keys`` as in :func:`verify_artifact`).
    Errors name the file: :class:`BinMapLoadError` when it cannot be read,
    :class:`BinMapRejected` when its content is not a valid (or not an authentic) artifact."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BinMapLoadError(f"{p}: cannot read bin map file ({e.strerror or e})") from e
    return verify_artifact(data, where=str(p), public_keys=public_keys)


def fetch_http(url: str, timeout: float = 10.0, *,
               headers: Mapping[str, str] | None = None) -> bytes:
    """GET ``url`` (e.g. the daemon's ``/v1/models/{model}/binmap``) and return the body bytes.

    Raises :class:`BinMapLoadError` naming the URL on an HTTP status other than 200 (with the
    start of the body, e.g. the daemon's 404 ``no bin map for this model``), a connection
    failure or a timeout, and :class:`BinMapRejected` (``truncated``) when the connection closes
    before ``Content-Length`` bytes arrived.
    """
    if timeout is None or not timeout > 0:
        raise InputError(f"fetch_http: timeout must be > 0 seconds, got {timeout!r}")
    req = urllib.request.Request(url, headers={"Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            body = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode("utf-8", "replace").strip()
        raise BinMapLoadError(f"{url}: HTTP {e.code} {e.reason}"
                              + (f": {detail}" if detail else "")) from e
    except http.client.IncompleteRead as e:
        raise BinMapRejected("truncated", f"{url}: truncated response: {len(e.partial)} bytes "
                             f"received, {e.expected} more expected") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise BinMapLoadError(f"{url}: cannot fetch bin map ({reason})") from e
    if status != 200:
        raise BinMapLoadError(f"{url}: HTTP {status}, expected 200")
    return body


def load_http(url: str, timeout: float = 10.0, *,
              headers: Mapping[str, str] | None = None, public_keys: Any = None) -> BinMap:
    """Fetch (:func:`fetch_http`) and verify a bin map (``public_keys`` as in
    :func:`verify_artifact`); errors name the URL."""
    return verify_artifact(fetch_http(url, timeout, headers=headers), where=url,
                           public_keys=public_keys)


# --------------------------------------------------------------------------- the store


class BinMapStore:
    """Thread-safe registry ``model -> BinMap`` with atomic hot swaps (see the module docstring).

    ``missing="error"`` (default): :meth:`apply` for an unknown model raises
    :class:`UnknownModelError`; ``missing="identity"`` returns the input unchanged (as float64).
    ``on_reject(Rejection)`` is called for every rejected artifact and ``on_swap(model,
    old_version | None, new BinMap)`` after every installation, outside the lock, from the
    offering thread; exceptions they raise are logged and swallowed. Use them to export counters
    (e.g. to Prometheus) without this module importing a metrics library.

    ``public_keys``: the daemon's Ed25519 public key(s) (a :class:`KeyRing`, or a list of PEM
    texts/bytes, raw or base64 keys, key file paths); every artifact must then be signed by one
    of them (rejection reason ``signature``). None: unauthenticated (development; warned).

    Examples
    --------
    >>> import math, numpy as np
    >>> from lpcal import fit
    >>> from lpcal.client import BinMapStore
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(5000, 3)) * 3
    >>> f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    >>> y = (f.cumsum(axis=1) > rng.random(5000)[:, None]).argmax(axis=1)
    >>> store = BinMapStore(missing="identity")
    >>> store.offer(fit(f, y, eps=0.1, p=math.inf, model_id="fraud-v3").to_json())
    True
    >>> store.apply("fraud-v3", f[:1]).shape, store.apply("other", f[:1]).shape
    ((1, 3), (1, 3))
    >>> store.offer(b"{truncated"), store.rejections["parse"]
    (False, 1)
    """

    def __init__(self, *, missing: str = "error",
                 on_reject: Callable[[Rejection], Any] | None = None,
                 on_swap: Callable[[str, int | None, BinMap], Any] | None = None,
                 public_keys: Any = None):
        if missing not in _MISSING:
            raise InputError(f"BinMapStore: missing must be one of {_MISSING}, got {missing!r}")
        try:
            self.keys: KeyRing | None = KeyRing.of(public_keys)
        except (ValueError, OSError) as e:
            raise InputError(f"BinMapStore: bad public_keys: {e}") from None
        if self.keys is None:
            log.warning("BinMapStore without public_keys: bin maps are not authenticated "
                        "(anyone who can write to the bin-map topic can install one); "
                        "configure the daemon's public key(s) outside development")
        self.missing = missing
        self.on_reject = on_reject
        self.on_swap = on_swap
        self._maps: dict[str, BinMap] = {}  # published snapshot; never mutated in place
        self._checksums: dict[str, str] = {}  # guarded by _lock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._ignored = dict.fromkeys(IGNORE_REASONS, 0)
        self._swaps = 0

    # ------------------------------------------------------------------ readers (lock-free)
    def apply(self, model: str, probs, *, check: bool = True,
              out: np.ndarray | None = None) -> np.ndarray:
        """Calibrate ``probs`` with the current bin map of ``model`` (one map per call).

        Lock-free: one read of the published snapshot, then :meth:`BinMap.apply` of the map
        obtained (``check`` and ``out`` as there). A single row (shape ``(k,)`` or ``(1, k)``)
        takes the map's single-row path, which allocates the result (none with ``out=``) and,
        for maps with bins, one scratch row; nothing is shared between calls.
        """
        bm = self._maps.get(model)  # the single read of the shared reference
        if bm is None:
            if self.missing == "identity":
                if out is None:
                    return np.array(probs, dtype=np.float64)
                out[...] = probs
                return out
            raise UnknownModelError(f"no bin map for model {model!r} (known: "
                                    f"{sorted(self._maps) or 'none'})")
        return bm.apply(probs, check=check, out=out)

    def get(self, model: str) -> BinMap | None:
        """The current bin map of ``model`` or ``None``."""
        return self._maps.get(model)

    def models(self) -> list[str]:
        return sorted(self._maps)

    def versions(self) -> dict[str, int]:
        """``{model: installed version}`` from one consistent snapshot."""
        return {m: bm.version for m, bm in self._maps.items()}

    def __contains__(self, model: object) -> bool:
        return model in self._maps

    def __len__(self) -> int:
        return len(self._maps)

    @property
    def rejections(self) -> dict[str, int]:
        """Rejected artifacts per reason (every reason of :data:`REJECT_REASONS` present)."""
        with self._lock:
            return dict(self._rejected)

    @property
    def ignored(self) -> dict[str, int]:
        """Valid artifacts ignored per reason (``stale``, ``duplicate``)."""
        with self._lock:
            return dict(self._ignored)

    @property
    def swaps(self) -> int:
        """How many times a bin map was installed."""
        with self._lock:
            return self._swaps

    def wait_for(self, model: str, min_version: int | None = None,
                 timeout: float | None = None) -> BinMap:
        """Block until ``model`` has a map (of version >= ``min_version``); ``TimeoutError``."""
        def ok():
            bm = self._maps.get(model)
            return bm is not None and (min_version is None or bm.version >= min_version)

        with self._changed:
            if not self._changed.wait_for(ok, timeout):
                have = self._maps.get(model)
                raise TimeoutError(
                    f"no bin map for model {model!r}"
                    + (f" with version >= {min_version}" if min_version is not None else "")
                    + f" after {timeout} s (installed: "
                    + (f"version {have.version})" if have is not None else "none)"))
            return self._maps[model]

    # ------------------------------------------------------------------ writers
    def offer(self, artifact: bytes | bytearray | str | BinMap, *, model: str | None = None,
              source: str = "offer", force: bool = False) -> bool:
        """Verify ``artifact`` and install it if it is newer; ``True`` when it was installed.

        ``model``: the model it was published under (the Kafka record key); a different
        ``model_id`` inside the artifact is rejected (reason ``model``). ``source`` names the
        origin in logs and rejections (a file, a URL, ``topic[partition]@offset``). A rejected
        artifact returns ``False`` and leaves the installed map in force. See the module
        docstring for the version rules.
        """
        where = f"{source}" + (f" (model {model!r})" if model is not None else "")
        if isinstance(artifact, BinMap):
            bm, checksum = artifact, None
            if self.keys is not None and bm.verified_by not in self.keys:
                self._reject(Rejection(
                    "signature", model, source,
                    f"{where}: a BinMap object not verified against this store's keys "
                    f"{list(self.keys.key_ids)} (verified by: {bm.verified_by}); offer the "
                    f"artifact bytes, or load it with public_keys="))
                return False
            if not (0 <= bm.version <= MAX_VERSION):
                self._reject(Rejection("parse", model, source, f"{where}: version "
                                       f"{bm.version} outside [0, 2**53 - 1]"))
                return False
        elif isinstance(artifact, (bytes, bytearray, memoryview, str)):
            try:
                bm, checksum = _verify(artifact, where, self.keys)
            except BinMapRejected as e:
                self._reject(Rejection(e.reason, model, source, str(e)))
                return False
        else:
            raise InputError(f"offer: expected bytes, str or BinMap from {source}, "
                             f"got {type(artifact).__name__}")
        if model is not None and bm.model_id != model:
            self._reject(Rejection("model", model, source,
                                   f"{where}: artifact is for model {bm.model_id!r}"))
            return False
        if checksum is None:
            checksum = bm.checksum
        name = bm.model_id
        with self._lock:
            cur = self._maps.get(name)
            if cur is not None and not force:
                if bm.version < cur.version:
                    self._ignored["stale"] += 1
                    log.debug("%s: ignored version %d of %r (have %d)", source, bm.version,
                              name, cur.version)
                    return False
                if bm.version == cur.version and checksum == self._checksums.get(name):
                    self._ignored["duplicate"] += 1
                    return False
                if bm.version == cur.version:
                    log.warning("%s: model %r version %d republished with other content; "
                                "installing the later one", source, name, bm.version)
            new = dict(self._maps)
            new[name] = bm
            self._checksums[name] = checksum
            self._maps = new  # the atomic publication (one reference store)
            self._swaps += 1
            self._changed.notify_all()
        old = None if cur is None else cur.version
        log.info("%s: installed bin map %r version %d (was %s)", source, name, bm.version, old)
        if self.on_swap is not None:
            try:
                self.on_swap(name, old, bm)
            except Exception:
                log.exception("on_swap callback failed")
        return True

    def remove(self, model: str) -> bool:
        """Forget ``model`` (e.g. on a tombstone); ``True`` if it was present."""
        with self._lock:
            if model not in self._maps:
                return False
            new = dict(self._maps)
            del new[model]
            self._checksums.pop(model, None)
            self._maps = new
            self._changed.notify_all()
            return True

    def _reject(self, r: Rejection) -> None:
        with self._lock:
            self._rejected[r.reason] += 1
        log.warning("rejected bin map (%s): %s", r.reason, r.message)
        if self.on_reject is not None:
            try:
                self.on_reject(r)
            except Exception:
                log.exception("on_reject callback failed")


# --------------------------------------------------------------------------- Kafka follower


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class BinMapFollower:
    """Follow the compacted bin-map topic into a :class:`BinMapStore`.

    ``consumer`` is built (not started) by the caller and duck-typed: it needs ``start()``,
    ``stop()``, ``getmany(timeout_ms=...) -> {tp: [record, ...]}`` (records with ``.key``,
    ``.value``, ``.offset``) and ``seek_to_beginning(*tps)``; ``assignment()``,
    ``end_offsets(tps)`` and ``position(tp)`` are used when present (sync or async). With
    aiokafka::

        consumer = AIOKafkaConsumer("lpcal.binmaps", bootstrap_servers=..., group_id=None,
                                    auto_offset_reset="earliest")

    :meth:`run` starts the consumer, seeks every assigned partition to the beginning, snapshots
    the end offsets and offers every record to the store (key = model id, value = artifact;
    records without a key and tombstones are skipped and counted in :attr:`skipped`). :attr:`ready`
    is set once the positions reached the end offsets of the snapshot (with no ``end_offsets``:
    after the first empty poll). It never dies on a bad record; consumer errors are logged,
    counted in :attr:`errors` and retried with a capped backoff. :meth:`stop` ends the loop and
    stops the consumer. Records are verified on the event loop (a few ms for a large map).
    """

    def __init__(self, store: BinMapStore, consumer: Any, *, poll_timeout_ms: int = 500,
                 manage_consumer: bool = True, max_backoff: float = 5.0):
        if not isinstance(store, BinMapStore):
            raise InputError(f"BinMapFollower: store must be a BinMapStore, got "
                             f"{type(store).__name__}")
        if int(poll_timeout_ms) <= 0:
            raise InputError(f"BinMapFollower: poll_timeout_ms must be > 0, got {poll_timeout_ms}")
        self.store = store
        self.consumer = consumer
        self.poll_timeout_ms = int(poll_timeout_ms)
        self.manage_consumer = manage_consumer
        self.max_backoff = float(max_backoff)
        self.ready = asyncio.Event()
        self.records = 0
        self.skipped = {"no_key": 0, "tombstone": 0, "error": 0}
        self.errors = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started = False
        self._seeded: set = set()
        self._ends: dict | None = None
        self._last: dict = {}

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def start(self) -> asyncio.Task:
        """Run :meth:`run` as a task of the current loop and return it."""
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())
        return self._task

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until caught up; raises what :meth:`run` raised if it died, or ``TimeoutError``."""
        waiter = asyncio.ensure_future(self.ready.wait())
        pending = {waiter} | ({self._task} if self._task is not None else set())
        try:
            await asyncio.wait(pending, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self.ready.is_set():
            return
        if self._task is not None and self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError("bin-map follower stopped before it caught up") from exc
        raise TimeoutError(f"bin-map follower not caught up after {timeout} s "
                           f"({self.records} records read)")

    async def stop(self, timeout: float | None = None) -> None:
        """Stop following (waits for the current poll, then cancels) and stop the consumer."""
        self._stop.set()
        task = self._task
        if task is None or task.done() or task is asyncio.current_task():
            return
        grace = timeout if timeout is not None else self.poll_timeout_ms / 1000 + 5.0
        done, _ = await asyncio.wait({task}, timeout=grace)
        if not done:
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def run(self) -> None:
        """Follow until :meth:`stop`; see the class docstring."""
        if self._started:
            raise RuntimeError("BinMapFollower.run: a follower runs once (consumers cannot be "
                               "restarted); build a new consumer and follower")
        self._started = True
        if self._task is None:
            self._task = asyncio.current_task()
        c = self.consumer
        try:
            if self.manage_consumer:
                await _maybe_await(c.start())  # a failure here ends run (stop still runs)
            backoff = 0.1
            while not self._stop.is_set():
                try:
                    await self._seed_new_partitions()
                    batch = await c.getmany(timeout_ms=self.poll_timeout_ms)
                    for tp, recs in batch.items():
                        for rec in recs:
                            self._handle(tp, rec)
                    if not self.ready.is_set():
                        await self._check_ready(empty=not any(batch.values()))
                    backoff = 0.1
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the follower outlives broker trouble
                    self.errors += 1
                    log.warning("bin-map follower: %s: %s (retry in %.1f s)",
                                type(e).__name__, e, backoff)
                    try:
                        await asyncio.wait_for(self._stop.wait(), backoff)
                    except TimeoutError:
                        pass
                    backoff = min(self.max_backoff, backoff * 2)
        finally:
            if self.manage_consumer:
                try:
                    await _maybe_await(c.stop())
                except Exception as e:  # noqa: BLE001
                    log.warning("bin-map follower: consumer.stop failed: %s", e)

    # ------------------------------------------------------------------ internals
    async def _seed_new_partitions(self) -> None:
        """Seek partitions not seen before to the beginning; snapshot end offsets once."""
        c = self.consumer
        if not hasattr(c, "assignment"):
            if not self._seeded:
                await _maybe_await(c.seek_to_beginning())
                self._seeded.add(None)
            return
        new = set(c.assignment()) - self._seeded
        if not new:
            return
        tps = sorted(new, key=_tp_sort_key)
        await _maybe_await(c.seek_to_beginning(*tps))
        self._seeded |= new
        if self._ends is None and hasattr(c, "end_offsets"):
            ends = await _maybe_await(c.end_offsets(tps))
            self._ends = {tp: int(ends[tp]) for tp in tps}

    async def _check_ready(self, empty: bool) -> None:
        if self._ends is None:
            if empty and self._seeded:
                self._set_ready()
            return
        c = self.consumer
        for tp, end in self._ends.items():
            if hasattr(c, "position"):
                try:
                    pos = int(await _maybe_await(c.position(tp)))
                except Exception:  # noqa: BLE001 - e.g. revoked; not caught up yet
                    return
            else:
                pos = self._last.get(tp, -1) + 1
            if pos < end:
                return
        self._set_ready()

    def _set_ready(self) -> None:
        self.ready.set()
        log.info("bin-map follower caught up: %d records, models %s", self.records,
                 self.store.versions())

    def _handle(self, tp: Any, rec: Any) -> None:
        self.records += 1
        self._last[tp] = int(getattr(rec, "offset", self._last.get(tp, -1) + 1))
        topic = getattr(rec, "topic", getattr(tp, "topic", "?"))
        part = getattr(rec, "partition", getattr(tp, "partition", "?"))
        source = f"{topic}[{part}]@{getattr(rec, 'offset', '?')}"
        key = rec.key
        try:
            model = key.decode("utf-8") if isinstance(key, (bytes, bytearray)) else key
        except UnicodeDecodeError:
            model = None
        if not isinstance(model, str) or not model:
            self.skipped["no_key"] += 1
            log.warning("%s: record without a usable key (model id); skipped", source)
            return
        if rec.value is None:
            self.skipped["tombstone"] += 1
            return
        try:
            self.store.offer(rec.value, model=model, source=source)
        except Exception:
            self.skipped["error"] += 1
            log.exception("%s: offering the record failed; skipped", source)


def _tp_sort_key(tp: Any) -> tuple:
    return (str(getattr(tp, "topic", "")), getattr(tp, "partition", 0) or 0, repr(tp))


# --------------------------------------------------------------------------- thread helper


class FollowerThread:
    """Run a :class:`BinMapFollower` on its own event loop in a daemon thread (for synchronous
    services). ``consumer_factory()`` is called inside that loop (aiokafka consumers must be
    created on the loop that runs them)::

        store = BinMapStore()
        ft = FollowerThread(store, lambda: AIOKafkaConsumer("lpcal.binmaps", group_id=None,
                                                            bootstrap_servers=BOOTSTRAP))
        ft.start(); ft.wait_ready(30)
        ...; ft.stop()
    """

    def __init__(self, store: BinMapStore, consumer_factory: Callable[[], Any],
                 **follower_kwargs: Any):
        self.store = store
        self.consumer_factory = consumer_factory
        self.follower_kwargs = follower_kwargs
        self.follower: BinMapFollower | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stop_requested = threading.Event()
        self._thread = threading.Thread(target=self._main, name="lpcal-binmap-follower",
                                        daemon=True)

    def start(self) -> FollowerThread:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until caught up; re-raises the follower's failure, or ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._ready.is_set() or self._done.is_set()):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"bin-map follower thread not caught up after {timeout} s")
            self._ready.wait(0.02)
        if not self._ready.is_set():
            raise RuntimeError("bin-map follower thread stopped before it caught up") \
                from self.error

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the follower and its consumer, then join the thread (up to ``timeout`` s)."""
        self._stop_requested.set()
        deadline = time.monotonic() + timeout
        while (self.follower is None and self._thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.01)
        loop, f = self._loop, self.follower
        if loop is not None and f is not None and not self._done.is_set():
            try:
                asyncio.run_coroutine_threadsafe(f.stop(), loop).result(
                    max(0.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError):  # loop already closed / too slow
                pass
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _main(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self.follower = BinMapFollower(self.store, self.consumer_factory(),
                                           **self.follower_kwargs)
            task = self.follower.start()
            if self._stop_requested.is_set():
                await self.follower.stop()

            async def flag():
                await self.follower.ready.wait()
                self._ready.set()

            flagger = asyncio.ensure_future(flag())
            try:
                await task
            finally:
                flagger.cancel()

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported through wait_ready / .error
            self.error = e
            log.error("bin-map follower thread failed: %s: %s", type(e).__name__, e)
        finally:
            self._done.set()

