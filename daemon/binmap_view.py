"""Every replica's view of the bin-map topic: the latest verified bin map of every model.

Every replica follows the compacted bin-map topic from the beginning (a consumer without a
group, :class:`lpcal.client.BinMapFollower`) into a :class:`ServedBinMaps`, a
:class:`lpcal.client.BinMapStore` that also keeps the published bytes, so that ``GET
/v1/models/{model}/binmap`` answers for every model, not only the models this replica owns, and
a model whose state was lost starts its versions above the latest verified one
(:meth:`daemon.registry.ModelRegistry.create`).

Verification and version order are the client's (:mod:`lpcal.client.store`): each record is
verified with the daemon's keys (``signing``: its own key and ``public_keys``), a record of a
lower version than the one held is ignored (``stale``), a higher one replaces it. Every record
is possibly hostile. A record that cannot be used is skipped, logged with its position
(``topic[partition]@offset``) and counted in ``lpcal_binmap_records_skipped_total{reason}``:

* a verification failure, under the client's reason (``checksum``, ``truncated``, ``schema``,
  ``parse``, ``model``, ``signature``);
* ``too_large``: more than ``max_record_bytes`` (``kafka.max_message_bytes``), not parsed;
* ``no_key``: no model id as its key (tombstones are not counted: they delete nothing here,
  the last verified map stays served);
* ``config``: a map that cannot apply to the model under this replica's settings (its k when
  the settings pin one, or its lambda, differs): the check the daemon makes before installing
  a map in a model's state, so that no replica serves a map its owner would refuse;
* ``capacity``: a new model beyond ``max_models``, or a map that would take the view beyond
  ``max_bytes``.

Memory is bounded: one map per model (its bytes and its parsed arrays, estimated by
:func:`map_cost`), at most ``max_models`` models and ``max_bytes`` bytes in all
(``lpcal_binmaps_served`` and ``lpcal_binmaps_served_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from lpcal.binmap import BinMap
from lpcal.client import BinMapFollower, BinMapRejected, BinMapStore, Rejection, verify_artifact
from lpcal.levels import beta_for, lambda_for

log = logging.getLogger("lpcal.daemon")

#: Default bound on the models the view holds: many replicas' worth of ``max_models``.
VIEW_MODELS_PER_REPLICA_MODELS = 16
#: Default bound on the bytes the view holds (bytes and parsed maps, see :func:`map_cost`).
VIEW_MAX_BYTES = 256 << 20
_STR_OVERHEAD = 56  # bytes of a CPython str beyond its characters (a bin key)


def map_cost(raw: bytes, bm: BinMap) -> int:
    """Estimated resident bytes of one served map: its published bytes, its arrays and its
    bin keys (one Python string each)."""
    return (len(raw) + int(bm.preds.nbytes) + int(bm.group.nbytes)
            + sum(len(b) + _STR_OVERHEAD for b in bm.bins))


@dataclass(frozen=True)
class Served:
    """One served bin map: the verified map, the exact bytes published, and where it was read."""

    bm: BinMap
    raw: bytes
    source: str
    cost: int

    @property
    def version(self) -> int:
        return self.bm.version

    @property
    def checksum(self) -> str:
        return self.bm.checksum

    @property
    def etag(self) -> str:
        return f'"{self.bm.checksum}"'


class ServedBinMaps(BinMapStore):
    """A :class:`~lpcal.client.BinMapStore` bounded in models and bytes that keeps each
    installed map's bytes (:meth:`served`); see the module docstring.

    ``on_skip(reason, source, message)`` is called for every skipped record (counters),
    ``on_served(model, served)`` after every installation (gauges); ``fits(model, bm)``, when
    given, returns why a verified map cannot apply to the model (skipped as ``config``), or
    None."""

    def __init__(self, *, public_keys: Any, max_models: int, max_bytes: int,
                 max_record_bytes: int, on_skip=None, on_served=None, fits=None):
        super().__init__(public_keys=public_keys, on_reject=self._rejected)
        self.max_models, self.max_bytes = int(max_models), int(max_bytes)
        self.max_record_bytes = int(max_record_bytes)
        self.on_skip, self.on_served = on_skip, on_served
        self.fits = fits
        self.bytes = 0
        self._served: dict[str, Served] = {}

    def served(self, model: str) -> Served | None:
        return self._served.get(model)

    def skip(self, reason: str, source: str, message: str) -> None:
        log.warning("bin-map topic: skipped the record at %s (%s): %s", source, reason, message)
        if self.on_skip is not None:
            self.on_skip(reason, source, message)

    def _rejected(self, r: Rejection) -> None:
        if self.on_skip is not None:  # logged by the store already
            self.on_skip(r.reason, r.source, r.message)

    def offer(self, artifact, *, model: str | None = None, source: str = "offer",
              force: bool = False) -> bool:
        """Verify the record ``artifact`` (bytes) published under ``model`` and serve it if it
        is newer; ``True`` when installed. Records beyond the bounds are skipped (counted)."""
        if not isinstance(artifact, (bytes, bytearray, memoryview)):
            raise TypeError(f"ServedBinMaps.offer: bytes expected, got {type(artifact).__name__}")
        raw = bytes(artifact)
        if len(raw) > self.max_record_bytes:
            self.skip("too_large", source, f"{len(raw)} bytes, more than the "
                      f"{self.max_record_bytes} of kafka.max_message_bytes")
            return False
        if model is None or not model:
            self.skip("no_key", source, "no model id as its key")
            return False
        if model not in self._served and len(self._served) >= self.max_models:
            self.skip("capacity", source, f"model {model!r} would be model "
                      f"{len(self._served) + 1}; the view holds at most {self.max_models}")
            return False
        try:
            bm = verify_artifact(raw, where=f"{source} (model {model!r})",
                                 public_keys=self.keys)
        except BinMapRejected as e:
            self._reject(Rejection(e.reason, model, source, str(e)))
            return False
        why = None if self.fits is None or bm.model_id != model else self.fits(model, bm)
        if why is not None:
            self.skip("config", source, f"version {bm.version} of model {model!r}: {why}")
            return False
        cur = self._served.get(model)
        cost = map_cost(raw, bm)
        if self.bytes - (cur.cost if cur else 0) + cost > self.max_bytes:
            self.skip("capacity", source, f"version {bm.version} of model {model!r} "
                      f"({cost} bytes) would take the view beyond {self.max_bytes} bytes")
            return False
        if not super().offer(bm, model=model, source=source, force=force):
            return False
        self._served[model] = Served(bm, raw, source, cost)
        self.bytes += cost - (cur.cost if cur else 0)
        if self.on_served is not None:
            self.on_served(model, self._served[model])
        return True


def settings_fit(settings):
    """``fits(model, bm)`` for :class:`ServedBinMaps` from the daemon's settings: why ``bm``
    cannot apply to ``model`` (k pinned and different, or another lambda), else None."""
    def fits(model: str, bm: BinMap) -> str | None:
        ms = settings.model_settings(model)
        if ms is None:
            return None
        k = getattr(ms, "k", None)
        if k and bm.k != k:
            return f"k = {bm.k}, but the settings pin k = {k}"
        lam = lambda_for(beta_for(ms.eps, float(ms.p)))
        if bm.lam != lam:
            return f"lambda = {bm.lam}, but the settings (eps, p) give lambda = {lam}"
        return None

    return fits


class _Follower(BinMapFollower):
    """:class:`lpcal.client.BinMapFollower` whose records without a usable key are counted
    (``no_key``) in the view's metrics too."""

    def _handle(self, tp: Any, rec: Any) -> None:
        key = rec.key
        try:
            usable = isinstance(key, (bytes, bytearray)) and bool(key.decode("utf-8"))
        except UnicodeDecodeError:
            usable = False
        if not usable and self.store.on_skip is not None:
            self.store.on_skip("no_key", f"{getattr(rec, 'topic', '?')}"
                               f"[{getattr(rec, 'partition', '?')}]@{rec.offset}",
                               "no model id as its key")
        super()._handle(tp, rec)  # logs and counts it in ``skipped`` (or offers it)


class BinMapView:
    """Follow the bin-map topic into a :class:`ServedBinMaps` (see the module docstring).

    ``make_consumer()`` builds the (unstarted) consumer of the topic, without a group.
    :meth:`start` runs the follower as a task (a follower that fails, e.g. its consumer cannot
    start, is replaced by a new one after a backoff of 0.5 s doubling to 10 s; it reads the
    topic again from the beginning); :meth:`sync` waits until everything on the topic when it
    is called has been read; :meth:`stop` ends it."""

    def __init__(self, make_consumer, *, public_keys: Any, metrics=None, max_models: int,
                 max_bytes: int = VIEW_MAX_BYTES, max_record_bytes: int, fits=None):
        self.metrics = metrics
        self.maps = ServedBinMaps(public_keys=public_keys, max_models=max_models,
                                  max_bytes=max_bytes, max_record_bytes=max_record_bytes,
                                  fits=fits,
                                  on_skip=self._count_skip,
                                  on_served=lambda model, served: self._export())
        self._make_consumer = make_consumer
        self.follower: BinMapFollower | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        delay = 0.5
        while not self._stopping:
            self.follower = _Follower(self.maps, self._make_consumer())
            try:
                await self.follower.run()
                return  # stopped
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the view outlives broker trouble
                log.warning("bin-map view: following the bin-map topic failed (%s: %s); "
                            "again in %.1f s", type(e).__name__, e, delay)
            await asyncio.sleep(delay)
            delay = min(10.0, delay * 2)

    async def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        task = self._task
        if task is None or task.done():
            return
        if self.follower is not None:  # its run() is this task's: stop() waits, then cancels
            await self.follower.stop(timeout=timeout)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    @property
    def ready(self) -> bool:
        """True once the topic was read to its end at least once."""
        return self.follower is not None and self.follower.ready.is_set()

    async def sync(self, timeout: float) -> bool:
        """Wait until the records on the topic now have been read (its end offsets, taken
        now); False when that took longer than ``timeout`` s or the view is not running."""
        if self._task is None or self._task.done():
            return False
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                while not self.ready:  # the current follower (one that failed is replaced)
                    await asyncio.sleep(0.02)
                c = self.follower.consumer
                tps = sorted(c.assignment(), key=lambda tp: (tp.topic, tp.partition))
                ends = await c.end_offsets(tps) if tps else {}
                while True:
                    positions = [await c.position(tp) for tp in tps]
                    if all(p >= ends[tp] for p, tp in zip(positions, tps)):
                        return True
                    await asyncio.sleep(0.02)
        except TimeoutError:
            log.warning("bin-map view: not caught up with the bin-map topic within %.1f s",
                        timeout)
            return False
        except Exception as e:  # noqa: BLE001 - broker trouble: the caller goes on without
            log.warning("bin-map view: cannot check its position (%s: %s)", type(e).__name__,
                        e)
            await asyncio.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
            return False

    # ------------------------------------------------------------------ reads
    def get(self, model: str) -> Served | None:
        return self.maps.served(model)

    def version(self, model: str) -> int:
        """The latest verified version of ``model`` on the topic (0 when there is none)."""
        s = self.maps.served(model)
        return 0 if s is None else s.version

    def offer(self, data: bytes, model: str, source: str) -> bool:
        """Serve a map this replica holds (its own publish, a checkpoint) if it is newer."""
        return self.maps.offer(data, model=model, source=source)

    def _count_skip(self, reason: str, source: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.inc_binmap_record_skipped(reason)
        self._export()

    def _export(self) -> None:
        if self.metrics is not None:
            self.metrics.set_binmaps_served(len(self.maps), self.maps.bytes)
