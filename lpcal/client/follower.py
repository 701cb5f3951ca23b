"""Follow the compacted bin-map topic into a :class:`~lpcal.client.BinMapStore` (part of
:mod:`lpcal.client`): :class:`BinMapFollower` on a running event loop, :class:`FollowerThread`
on its own loop in a daemon thread.

Kafka is reached through a consumer object the caller builds (duck-typed; e.g. an
``aiokafka.AIOKafkaConsumer``): this module imports no Kafka package.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Self

from lpcal.client.store import BinMapStore
from lpcal.errors import InputError

log = logging.getLogger("lpcal.client")


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

