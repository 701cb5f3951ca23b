"""The downstream bin-map client against the real embedded broker (never mocked) and a real
aiohttp server.

Bin maps are published exactly as the daemon publishes them (``daemon/service.py::_fit_done``):
topic ``*.binmaps`` (compacted), key = model id bytes, value = the bin-map JSON, header
``lpcal.version``. The tests may import ``daemon``; the client (``lpcal.client``) may not. The
maps and the artifact helpers are shared with the unit tests (``tests/support/client_fixtures.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from aiokafka import AIOKafkaConsumer

from daemon.kafka.clients import make_producer
from daemon.kafka.topics import COMPACT, TopicSpec, ensure_topics
from lpcal.client import (
    BinMapFollower,
    BinMapLoadError,
    BinMapStore,
    FollowerThread,
    fetch_http,
    load_http,
)
from tests.support.client_fixtures import MODEL, fitted_maps, flip_digit, schema_future

integration = pytest.mark.integration


@pytest.fixture(scope="module")
def maps():
    """Two real fitted maps of MODEL (v1, v2; a mixture would match neither) and test inputs."""
    return fitted_maps(data_seed=3, x_seed=11, n_x=400)


async def _until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


class _Publisher:
    """Publishes like the daemon: key = model id, value = JSON, header lpcal.version."""

    def __init__(self, bootstrap, topic):
        self.topic = topic
        self.producer = make_producer(bootstrap, idempotence=False)

    async def __aenter__(self):
        await self.producer.start()
        return self

    async def __aexit__(self, *exc):
        await self.producer.stop()

    async def publish(self, value: bytes, version: int, model: str = MODEL):
        await self.producer.send_and_wait(self.topic, key=model.encode(), value=value,
                                          headers=[("lpcal.version", str(version).encode())])


def _consumer(bootstrap, topic):
    return AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                            auto_offset_reset="earliest", client_id="lpcal-client-test")


@integration
async def test_readers_switch_from_v1_to_v2_and_never_see_a_half_loaded_map(
        broker, topic_prefix, maps):
    topic = f"{topic_prefix}.binmaps"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 1, configs=COMPACT)])
    rejected = []
    store = BinMapStore(on_reject=rejected.append)
    stop = threading.Event()
    seqs: list[list[int]] = [[], []]  # per reader: 1 = v1 output, 2 = v2 output, 0 = neither

    def reader(seq):
        while not stop.is_set():
            out = store.apply(MODEL, maps.x)
            seq.append(1 if np.array_equal(out, maps.out1)
                       else 2 if np.array_equal(out, maps.out2) else 0)

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in seqs]
    async with _Publisher(broker.bootstrap, topic) as pub:
        await pub.publish(maps.v1.to_json(), 1)
        follower = BinMapFollower(store, _consumer(broker.bootstrap, topic), poll_timeout_ms=100)
        async with follower:
            await follower.wait_ready(20)
            assert store.versions() == {MODEL: 1}
            for t in threads:
                t.start()
            try:
                # corrupt, truncated and schema-incompatible records: rejected, v1 stays
                good2 = maps.v2.to_json()
                await pub.publish(flip_digit(good2), 2)
                await pub.publish(good2[: len(good2) // 3], 2)
                await pub.publish(schema_future(good2), 2)
                await _until(lambda: len(rejected) == 3, 15, "three rejections")
                assert store.rejections == {"checksum": 1, "truncated": 1, "schema": 1,
                                            "parse": 0, "model": 0, "signature": 0}
                assert [r.reason for r in rejected] == ["checksum", "truncated", "schema"]
                assert all(r.model == MODEL and r.source.startswith(topic) for r in rejected)
                assert store.versions() == {MODEL: 1}
                await _until(lambda: all(len(s) >= 5 for s in seqs), 10, "reader calls on v1")
                assert all(set(s) == {1} for s in seqs)

                # version 2: every reader switches
                await pub.publish(good2, 2)
                bm = await asyncio.to_thread(store.wait_for, MODEL, 2, 15)
                assert bm.checksum == maps.v2.checksum
                marks = [len(s) for s in seqs]
                await _until(lambda: all(len(s) >= m + 20 for s, m in zip(seqs, marks)), 10,
                             "reader calls on v2")
            finally:
                stop.set()
                for t in threads:
                    t.join(10)
            assert follower.records == 5 and follower.errors == 0
        assert not follower.running

    for s in seqs:
        assert 0 not in s, "a call saw a map that was neither v1 nor v2"
        first2 = s.index(2)
        assert first2 > 0 and set(s[:first2]) == {1} and set(s[first2:]) == {2}, \
            "after the switch a reader went back to v1"
    assert store.versions() == {MODEL: 2} and store.swaps == 2
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)


@integration
async def test_follower_thread_catches_up_to_the_latest_version_per_model(
        broker, topic_prefix, maps):
    topic = f"{topic_prefix}.binmaps"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 2, configs=COMPACT)])
    churn = dataclasses.replace(maps.v2, model_id="churn", version=4)
    async with _Publisher(broker.bootstrap, topic) as pub:
        await pub.publish(maps.v1.to_json(), 1)
        await pub.publish(maps.v2.with_version(3).to_json(), 3)
        await pub.publish(maps.v1.with_version(2).to_json(), 2)  # stale: ignored
        await pub.publish(churn.to_json(), 4, model="churn")
        await pub.publish(b"", 5, model="churn")  # an empty value: truncated

    store = BinMapStore()
    ft = FollowerThread(store, lambda: _consumer(broker.bootstrap, topic), poll_timeout_ms=100)
    ft.start()
    try:
        await asyncio.to_thread(ft.wait_ready, 20)
        # ready means caught up with everything published before the start
        assert store.versions() == {MODEL: 3, "churn": 4}
        assert store.ignored["stale"] == 1 and store.rejections["truncated"] == 1
        np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)
        np.testing.assert_array_equal(store.apply("churn", maps.x), maps.out2)
    finally:
        await asyncio.to_thread(ft.stop, 10)
    assert ft.error is None and not ft._thread.is_alive()


@integration
async def test_follower_thread_reports_an_unreachable_broker():
    ft = FollowerThread(BinMapStore(),
                        lambda: AIOKafkaConsumer("x", bootstrap_servers="127.0.0.1:1",
                                                 group_id=None, request_timeout_ms=1000,
                                                 connections_max_idle_ms=2000))
    ft.start()
    with pytest.raises(RuntimeError, match="stopped before it caught up"):
        await asyncio.to_thread(ft.wait_ready, 15)
    assert ft.error is not None
    await asyncio.to_thread(ft.stop, 5)


# --------------------------------------------------------------------------- HTTP


async def test_load_http_from_an_aiohttp_server(maps):
    artifacts = {MODEL: maps.v1.to_json()}

    async def binmap(request):  # the daemon's GET /v1/models/{model}/binmap contract
        data = artifacts.get(request.match_info["model"])
        if data is None:
            return web.json_response({"error": "no bin map for this model on this replica"},
                                     status=404)
        return web.Response(body=data, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models/{model}/binmap", binmap)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}/v1/models"
    try:
        bm = await asyncio.to_thread(load_http, f"{base}/{MODEL}/binmap", 5)
        assert bm.version == 1 and bm.checksum == maps.v1.checksum
        np.testing.assert_array_equal(bm.apply(maps.x), maps.out1)

        store = BinMapStore()
        assert store.offer(bm, source="http")
        artifacts[MODEL] = maps.v2.to_json()
        raw = await asyncio.to_thread(fetch_http, f"{base}/{MODEL}/binmap", 5)
        assert store.offer(raw, model=MODEL, source="http") is True
        np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)

        with pytest.raises(BinMapLoadError, match=r"/v1/models/churn/binmap: HTTP 404.*no bin"):
            await asyncio.to_thread(load_http, f"{base}/churn/binmap", 5)
    finally:
        await runner.cleanup()


@integration
async def test_the_documented_example_runs(broker, topic_prefix, maps, capsys, tmp_path):
    """Run the first code block of lpcal/CLIENT.md (the README example) against the broker, with
    its public key file replaced by a key pair made here and the map signed by it."""
    import lpcal
    from lpcal.signing import Signer, keygen

    doc = (Path(lpcal.__file__).parent / "CLIENT.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert code.rstrip().endswith("asyncio.run(main())")
    code = code.rstrip().removesuffix("asyncio.run(main())")  # we are inside a running loop
    private, public, _ = keygen(tmp_path / "keys")
    assert '"/etc/lpcal/binmap-signing.pub"' in code
    code = code.replace('"/etc/lpcal/binmap-signing.pub"', repr(str(public)))
    topic = f"{topic_prefix}.binmaps"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 1, configs=COMPACT)])
    async with _Publisher(broker.bootstrap, topic) as pub:
        await pub.publish(maps.v1.to_json(signer=Signer(private.read_bytes())), 1)
    ns: dict = {}
    exec(compile(code, "CLIENT.md", "exec"), ns)  # noqa: S102 - our own documentation
    await asyncio.wait_for(ns["main"](broker.bootstrap, topic), 30)
    assert ns["store"].versions() == {MODEL: 1}
    assert capsys.readouterr().out.strip() == str(maps.v1.apply(np.array([[0.7, 0.2, 0.1]])))
