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

Layout: :mod:`lpcal.client.loaders` (verification, file and HTTP loaders, errors),
:mod:`lpcal.client.store` (:class:`BinMapStore`, its acceptance rules and the memory-model
argument for the lock-free ``apply``) and :mod:`lpcal.client.follower` (:class:`BinMapFollower`,
:class:`FollowerThread`). Import from ``lpcal.client``: every name below is re-exported here.
"""

from __future__ import annotations

from lpcal.client.follower import BinMapFollower, FollowerThread
from lpcal.client.loaders import (
    REJECT_REASONS,
    BinMapLoadError,
    BinMapRejected,
    Rejection,
    UnknownModelError,
    fetch_http,
    load_file,
    load_http,
    verify_artifact,
)
from lpcal.client.store import (
    IGNORE_REASONS,  # noqa: F401 - public, not in __all__ (as before)
    BinMapStore,
)
from lpcal.signing import KeyRing

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
