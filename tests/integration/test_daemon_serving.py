"""Every replica serves every model's bin map (two in-process replicas, real broker).

Input topics have 4 partitions and 4 models, one per partition, so each of the two replicas of
one consumer group owns 2 models. Each model publishes version 1. Then, on BOTH replicas:

* ``GET /v1/models/{m}/binmap`` answers 200 for all 4 models (8 of 8 answers; a replica used
  to answer 404 for the models it does not own), with the same bytes on both replicas, ``ETag``
  the map's quoted checksum and ``X-Lpcal-Version: 1``; ``If-None-Match`` with that ETag gets a
  304 without a body;
* ``GET /v1/models/{m}`` answers the summary (version, checksum, certified) for all 4, with an
  ``owner`` on exactly one replica;
* a model that has no map gets 404, on both routes.

Then hostile records go to the bin-map topic under the models' keys (garbage bytes, a record
larger than ``kafka.max_message_bytes``, a map of another model, a record without a key): both
replicas skip and count them by reason in ``lpcal_binmap_records_skipped_total`` and keep
serving version 1.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiokafka.partitioner import murmur2

from daemon.kafka.clients import make_producer
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from lpcal.binmap import BinMap
from tests.support.daemon_harness import (
    RunningDaemon,
    build_settings,
    daemon_config,
    free_port,
    metric_value,
    scrape_metrics,
    start_daemon,
    wait_until,
)

pytestmark = pytest.mark.integration

PARTITIONS = 4
MAX_MESSAGE_BYTES = 256 << 10


def _one_model_per_partition() -> list[str]:
    """Model ids (keys) that aiokafka's default partitioner puts on partitions 0..3."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < PARTITIONS:
        m = f"sv-m{i}"
        found.setdefault((murmur2(m.encode()) & 0x7FFFFFFF) % PARTITIONS, m)
        i += 1
    return [found[p] for p in range(PARTITIONS)]


MODELS = _one_model_per_partition()


async def _get(url: str, path: str, headers: dict | None = None
               ) -> tuple[int, Any, bytes]:
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as cs,
                cs.get(url + path, headers=headers) as r):
        return r.status, r.headers.copy(), await r.read()


async def test_every_replica_serves_every_model(deployment, broker, topic_prefix, tmp_path):
    names = await deployment.topics(PARTITIONS)
    group = f"{topic_prefix}-group"
    settings = [build_settings(daemon_config(
        broker.bootstrap, names, http_port=free_port(), group_id=group, partitions=PARTITIONS,
        kafka={"max_message_bytes": MAX_MESSAGE_BYTES},
        defaults={"pool": 100, "mu_pool": 100, "warmup": 100, "holdout": 50, "recovery": "epochs",
                  "drift_threshold": 100.0},
        models={m: {"k": 3} for m in MODELS}), tmp_path, f"replica-{r}") for r in "AB"]
    a = await start_daemon(settings[0])
    b: RunningDaemon | None = None
    try:
        b = await start_daemon(settings[1])
        replicas = (a, b)

        def diag():
            return "\n".join(rd.describe() for rd in replicas)

        def split():
            pa = {tp.partition for tp in a.daemon.partitions.assigned}
            pb = {tp.partition for tp in b.daemon.partitions.assigned}
            return (a.daemon.ready and b.daemon.ready and pa and pb and not pa & pb
                    and pa | pb == set(range(PARTITIONS)))
        await wait_until(split, 40, "A and B split the partitions", diag=diag)

        # one epoch: a warm-up of 100, 7 pools of 100 and 50 held out, about 1,000 samples
        # routed by id hash: 1,500 per model publish version 1
        gen = TrafficGenerator([SyntheticModel(m, 3, T=0.4, scale=4.0, seed=j)
                                for j, m in enumerate(MODELS)], 1500 * len(MODELS),
                               event_rate=500.0, delay=5.0, seed=7, decimals=6)
        await simulate(broker.bootstrap, {"predictions": names.predictions,
                                          "outcomes": names.outcomes}, gen,
                       idempotence=False, create_topics=False)

        def published():
            owners = {m: rd for rd in replicas for m, st in rd.daemon.registry.states().items()}
            return set(owners) == set(MODELS) and all(
                owners[m].daemon.registry.slots[m].state.binmap_version >= 1 for m in MODELS)
        await wait_until(published, 60, "version 1 of every model published", diag=diag)
        owned = {rd.url: set(rd.daemon.registry.states()) for rd in replicas}
        assert all(0 < len(ms) < len(MODELS) for ms in owned.values()), owned

        # ---- every replica answers for every model (the view follows the topic)
        async def all_served():
            for rd in replicas:
                for m in MODELS:
                    status, headers, _ = await _get(rd.url, f"/v1/models/{m}/binmap")
                    if status != 200 or headers.get("X-Lpcal-Version") != "1":
                        return False
            return True
        await wait_until(all_served, 20, "every replica serves version 1 of every model",
                         diag=diag)
        bodies: dict[str, set[bytes]] = {m: set() for m in MODELS}
        for rd in replicas:
            for m in MODELS:
                status, headers, body = await _get(rd.url, f"/v1/models/{m}/binmap")
                assert status == 200, (rd.url, m, status, body[:200])
                bm = BinMap.from_json(body)
                assert bm.model_id == m and bm.version == 1
                assert headers["ETag"] == f'"{bm.checksum}"'
                assert headers["X-Lpcal-Version"] == "1"
                bodies[m].add(body)
                status, headers, body304 = await _get(
                    rd.url, f"/v1/models/{m}/binmap", {"If-None-Match": f'"{bm.checksum}"'})
                assert status == 304 and body304 == b"", (status, body304[:100])
                assert headers["ETag"] == f'"{bm.checksum}"'
                status, _, body = await _get(rd.url, f"/v1/models/{m}/binmap",
                                             {"If-None-Match": '"sha256:other"'})
                assert status == 200 and BinMap.from_json(body).version == 1
                status, headers, body = await _get(rd.url, f"/v1/models/{m}")
                assert status == 200, (status, body[:200])
                summary = orjson.loads(body)
                assert summary["version"] == 1 and summary["checksum"] == bm.checksum
                assert headers["X-Lpcal-Version"] == "1"
                assert isinstance(summary["certified"], bool)
                assert (summary["owner"] is not None) == (m in owned[rd.url]), summary
        assert all(len(v) == 1 for v in bodies.values()), "replicas serve different bytes"
        for rd in replicas:
            for path in ("/v1/models/sv-none/binmap", "/v1/models/sv-none"):
                status, _, body = await _get(rd.url, path)
                assert status == 404 and b"no bin map" in body, (path, status, body)

        # ---- hostile records on the bin-map topic: skipped, counted, version 1 stays
        good = next(iter(bodies[MODELS[1]]))
        producer = make_producer(broker.bootstrap, idempotence=False,
                                 client_id="it-serving", max_request_size=1 << 20)
        await producer.start()
        try:
            await producer.send_and_wait(names.binmaps, key=MODELS[0].encode(),
                                         value=b"\x00garbage{")
            await producer.send_and_wait(names.binmaps, key=MODELS[0].encode(),
                                         value=b"{" + b" " * (MAX_MESSAGE_BYTES + 10) + b"}")
            await producer.send_and_wait(names.binmaps, key=MODELS[0].encode(), value=good)
            await producer.send_and_wait(names.binmaps, key=None, value=good)
        finally:
            await producer.stop()

        async def counted():
            for rd in replicas:
                mx = await scrape_metrics(rd.url)
                got = {r: metric_value(mx, "lpcal_binmap_records_skipped_total", reason=r)
                       for r in ("parse", "too_large", "model", "no_key")}
                if got != {"parse": 1, "too_large": 1, "model": 1, "no_key": 1}:
                    return False
            return True
        await wait_until(counted, 20, "the hostile records counted by reason on both replicas",
                         diag=diag)
        for rd in replicas:
            status, headers, body = await _get(rd.url, f"/v1/models/{MODELS[0]}/binmap")
            assert status == 200 and body in bodies[MODELS[0]]
            mx = await scrape_metrics(rd.url)
            assert metric_value(mx, "lpcal_binmaps_served") == len(MODELS)
            assert 0 < metric_value(mx, "lpcal_binmaps_served_bytes") < 4 * MAX_MESSAGE_BYTES
    finally:
        for rd in (b, a):
            if rd is not None:
                await rd.stop()
