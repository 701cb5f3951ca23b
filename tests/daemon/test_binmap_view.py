"""The replica's view of the bin-map topic (:mod:`daemon.binmap_view`): hostile records are
skipped and counted by reason, the served bytes are the published ones, versions only go up,
and memory stays within its bounds on models and bytes. (The follower on a real broker, with
two replicas, is tested in ``tests/integration/test_daemon_serving.py``.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from aiokafka import TopicPartition

from daemon.binmap_view import BinMapView, ServedBinMaps, map_cost, settings_fit
from daemon.metrics import DaemonMetrics
from lpcal import fit
from lpcal.binmap import BinMap
from lpcal.signing import Signer, generate_keypair


def _keypair():
    priv, pub = generate_keypair()
    return SimpleNamespace(priv=priv, pub=pub)


@pytest.fixture(scope="module")
def keys():
    return SimpleNamespace(own=_keypair(), other=_keypair())


@pytest.fixture(scope="module")
def base():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(3) * 0.7, size=4000)
    y = np.minimum((f.cumsum(axis=1) < rng.random((len(f), 1))).sum(axis=1), 2)
    return fit(f, y, eps=0.3, p=2.0, seed=0, model_id="m0", mode="paper")


def _map(base, model: str, version: int, signer=None) -> bytes:
    bm = base.with_version(version)
    object.__setattr__(bm, "model_id", model)
    return bm.to_json(signer=signer)


def _view(keys, *, max_models=3, max_bytes=1 << 30, max_record_bytes=1 << 20, metrics=None):
    skipped: list[str] = []

    def on_skip(reason, source, message):
        skipped.append(reason)
        if metrics is not None:
            metrics.inc_binmap_record_skipped(reason)

    maps = ServedBinMaps(public_keys=[keys.own.pub], max_models=max_models, max_bytes=max_bytes,
                         max_record_bytes=max_record_bytes, on_skip=on_skip)
    return maps, skipped


def test_hostile_records_are_skipped_by_reason_and_the_good_map_stays(keys, base):
    own = Signer(keys.own.priv)
    dm = DaemonMetrics(max_models=4)
    maps, skipped = _view(keys, max_record_bytes=64 << 10, metrics=dm)
    good = _map(base, "m0", 2, own)
    assert maps.offer(good, model="m0", source="t[0]@0")
    hostile = {
        "parse": b"\x00garbage",
        "truncated": good[: len(good) // 2],
        "signature": _map(base, "m0", 3, Signer(keys.other.priv)),
        "model": _map(base, "m1", 3, own),  # another model's map under this key
        "too_large": b"{" + b" " * (64 << 10) + b"}",
    }
    for reason, data in hostile.items():
        assert not maps.offer(data, model="m0", source=f"t[0]@{reason}"), reason
    unsigned = _map(base, "m0", 4)
    assert not maps.offer(unsigned, model="m0", source="t[0]@9")
    assert skipped == [*hostile, "signature"]
    for reason in hostile:
        assert dm.registry.get_sample_value("lpcal_binmap_records_skipped_total",
                                            {"reason": reason}) >= 1
    served = maps.served("m0")
    assert served.raw == good and served.version == 2 and served.etag == f'"{served.checksum}"'
    # an older version is ignored, a newer one replaces it (the bytes as published)
    assert not maps.offer(_map(base, "m0", 1, own), model="m0", source="t[0]@10")
    newer = _map(base, "m0", 5, own)
    assert maps.offer(newer, model="m0", source="t[0]@11")
    assert maps.served("m0").raw == newer and maps.served("m0").source == "t[0]@11"


def test_models_and_bytes_are_bounded(keys, base):
    own = Signer(keys.own.priv)
    one = _map(base, "m0", 1, own)
    cost = map_cost(one, BinMap.from_json(one))
    assert cost > len(one)
    maps, skipped = _view(keys, max_models=2, max_bytes=int(2.5 * cost))
    assert maps.offer(_map(base, "m0", 1, own), model="m0", source="a")
    assert maps.offer(_map(base, "m1", 1, own), model="m1", source="b")
    assert not maps.offer(_map(base, "m2", 1, own), model="m2", source="c")  # 3rd model
    assert skipped == ["capacity"] and len(maps) == 2
    assert maps.bytes <= maps.max_bytes
    maps, skipped = _view(keys, max_models=10, max_bytes=int(1.5 * cost))
    assert maps.offer(_map(base, "m0", 1, own), model="m0", source="a")
    assert not maps.offer(_map(base, "m1", 1, own), model="m1", source="b")  # bytes
    assert skipped == ["capacity"] and maps.bytes <= maps.max_bytes
    # replacing a model's map frees its old bytes first
    assert maps.offer(_map(base, "m0", 2, own), model="m0", source="c")
    assert maps.bytes <= maps.max_bytes and maps.served("m0").version == 2


def test_maps_that_do_not_fit_the_settings_are_skipped_as_config(keys, base):
    """The check the daemon makes before installing a map in a model's state (k when pinned,
    lambda from eps and p), applied to every model served."""
    own = Signer(keys.own.priv)
    pinned = {"m0": SimpleNamespace(k=3, eps=0.3, p=2.0),   # the base map's k and lambda
              "m1": SimpleNamespace(k=4, eps=0.3, p=2.0),   # another k
              "m2": SimpleNamespace(k=None, eps=0.01, p=2.0)}  # another lambda
    settings = SimpleNamespace(model_settings=pinned.get)
    skipped: list[str] = []
    maps = ServedBinMaps(public_keys=[keys.own.pub], max_models=8, max_bytes=1 << 30,
                         max_record_bytes=1 << 20, fits=settings_fit(settings),
                         on_skip=lambda reason, source, message: skipped.append(reason))
    assert maps.offer(_map(base, "m0", 1, own), model="m0", source="a")
    assert not maps.offer(_map(base, "m1", 1, own), model="m1", source="b")
    assert not maps.offer(_map(base, "m2", 1, own), model="m2", source="c")
    assert maps.offer(_map(base, "m3", 1, own), model="m3", source="d")  # no settings: served
    assert skipped == ["config", "config"] and maps.models() == ["m0", "m3"]


class _Consumer:
    """A consumer of one partition holding ``records`` (duck-typed like aiokafka's, as
    :class:`lpcal.client.BinMapFollower` uses it); ``fail`` makes ``start`` raise."""

    tp = TopicPartition("binmaps", 0)

    def __init__(self, records: list[tuple[bytes, bytes]], fail: bool = False):
        self.records, self.fail, self.pos, self.stopped = records, fail, 0, False

    async def start(self):
        if self.fail:
            raise ConnectionError("broker unreachable")

    async def stop(self):
        self.stopped = True

    def assignment(self):
        return {self.tp}

    async def seek_to_beginning(self, *tps):
        self.pos = 0

    async def end_offsets(self, tps):
        return {self.tp: len(self.records)}

    async def position(self, tp):
        return self.pos

    async def getmany(self, timeout_ms=0):
        if self.pos >= len(self.records):
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        recs = [SimpleNamespace(key=k, value=v, offset=i, topic="binmaps", partition=0)
                for i, (k, v) in enumerate(self.records) if i >= self.pos]
        self.pos = len(self.records)
        return {self.tp: recs}


async def test_a_failed_follower_is_replaced_and_the_view_catches_up(keys, base):
    own = Signer(keys.own.priv)
    records = [(b"m0", _map(base, "m0", 1, own)), (b"m0", b"garbage"),
               (b"m1", _map(base, "m1", 2, own))]
    made: list[_Consumer] = []

    def make_consumer():
        made.append(_Consumer(records, fail=not made))  # the first one cannot start
        return made[-1]

    dm = DaemonMetrics(max_models=4)
    view = BinMapView(make_consumer, public_keys=[keys.own.pub], metrics=dm, max_models=4,
                      max_record_bytes=1 << 20)
    view.start()
    try:
        assert await view.sync(10.0)
        assert view.ready and len(made) == 2
        assert (view.version("m0"), view.version("m1"), view.version("m2")) == (1, 2, 0)
        assert view.get("m0").raw == records[0][1]
        assert dm.registry.get_sample_value("lpcal_binmap_records_skipped_total",
                                            {"reason": "parse"}) == 1
        assert dm.registry.get_sample_value("lpcal_binmaps_served") == 2
    finally:
        await view.stop()
    assert made[-1].stopped
