"""The bin-map store of :mod:`lpcal.client`: :class:`BinMapStore`, model -> latest verified
bin map, applied lock-free from any thread.

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

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from lpcal.binmap import MAX_VERSION, BinMap
from lpcal.client.loaders import (
    REJECT_REASONS,
    BinMapRejected,
    Rejection,
    UnknownModelError,
    _verify,
)
from lpcal.errors import InputError
from lpcal.signing import KeyRing

log = logging.getLogger("lpcal.client")

IGNORE_REASONS: tuple[str, ...] = ("stale", "duplicate")
"""Reasons under which valid, but not newer, artifacts are ignored."""

_MISSING = ("error", "identity")


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

