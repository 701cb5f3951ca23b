"""Artifacts: corrupt, truncated and schema-incompatible bin maps on the topic.

A subprocess daemon publishes version 1 of four models. The test then publishes on the
bin-map topic, under each model's key: a CORRUPT v2 (content changed, old checksum), a
TRUNCATED v2 (half of a valid v2), a SCHEMA-INCOMPATIBLE v2 (``"schema": 3``, a schema from the future), and, as the
positive control, a VALID v2 for the fourth model. Both readers of the topic must reject the
three bad ones and keep version 1 in force, and adopt the valid one:

* the client: :class:`lpcal.client.BinMapStore` fed by a :class:`lpcal.client.BinMapFollower`
  that reads the whole topic (``rejections`` counted by reason);
* the daemon, restarted so that it re-reads the topic on assignment
  (``Restorer.adopt_published_binmaps``): ``GET /v1/models/{m}/binmap`` returns the same bytes
  as before and ``lpcal_binmaps_rejected_total{reason}`` counts each rejection.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from daemon.kafka.clients import make_consumer, make_producer
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from lpcal.binmap import BinMap
from lpcal.client import BinMapFollower, BinMapStore
from tests.support.daemon_harness import (
    http_get,
    metric_value,
    scrape_metrics,
    wait_until,
)
from tests.support.reliability import FastDaemon, models_view

pytestmark = pytest.mark.integration

MODELS = {"art-corrupt": 3, "art-truncated": 3, "art-schema": 4, "art-valid": 3}
REASON = {"art-corrupt": "checksum", "art-truncated": "truncated", "art-schema": "schema"}


def _bad_artifacts(good: dict[str, bytes]) -> dict[str, bytes]:
    out = {}
    obj = orjson.loads(good["art-corrupt"])
    obj["version"] = 2
    obj["eps"] = obj["eps"] / 2          # content changed, checksum kept: corrupt/tampered
    out["art-corrupt"] = orjson.dumps(obj)
    v2 = BinMap.from_json(good["art-truncated"]).with_version(2).to_json()
    out["art-truncated"] = v2[: len(v2) // 2]
    obj = orjson.loads(good["art-schema"])
    obj["schema"], obj["version"] = 3, 2
    out["art-schema"] = orjson.dumps(obj)
    out["art-valid"] = BinMap.from_json(good["art-valid"]).with_version(2).to_json()
    return out


async def test_bad_binmaps_rejected_by_client_and_daemon_previous_map_stays(
        deployment, broker, tmp_path, figures):
    names = await deployment.topics(2)
    cfg = deployment.config(partitions=2,
                            defaults={"pool": 100, "mu_pool": 100, "warmup": 100, "holdout": 50, "recovery": "epochs",
                                      "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                            models={m: {"k": k} for m, k in MODELS.items()})
    daemon = FastDaemon(cfg, tmp_path, name="art").start()
    try:
        await daemon.wait_ready(60)
        # one epoch is a warm-up of 100, 7 pools of 100 and 50 held out: about 1,000 samples
        # (routing by id hash), so 1,500 per model seal exactly one epoch (v1), never two
        gen = TrafficGenerator([SyntheticModel(m, k, T=0.4, scale=4.0, seed=j)
                                for j, (m, k) in enumerate(MODELS.items())],
                               1500 * len(MODELS), event_rate=500.0, delay=5.0, seed=4,
                               decimals=6)
        await simulate(broker.bootstrap, {"predictions": names.predictions,
                                          "outcomes": names.outcomes}, gen,
                       idempotence=False, create_topics=False)

        async def v1_everywhere():
            view = await models_view(daemon.url)
            return all(m in view and view[m]["binmap_version"] == 1
                       and not view[m]["fit_in_flight"] for m in MODELS)
        await wait_until(v1_everywhere, 30, "bin map v1 of every model",
                         diag=lambda: models_view(daemon.url))
        good = {}
        for m in MODELS:
            status, good[m] = await http_get(daemon.url, f"/v1/models/{m}/binmap")
            assert status == 200 and BinMap.from_json(good[m]).version == 1
        bad = _bad_artifacts(good)
        producer = make_producer(broker.bootstrap, idempotence=False,
                                 client_id="rel-art")
        await producer.start()
        try:
            for m, data in bad.items():
                await producer.send_and_wait(names.binmaps, key=m.encode(), value=data)
        finally:
            await producer.stop()

        # ---- the client: follow the whole topic
        store = BinMapStore()
        consumer = make_consumer(broker.bootstrap, names.binmaps, group_id=None,
                                 client_id="rel-art-client")
        async with BinMapFollower(store, consumer) as follower:
            await follower.wait_ready(30)
        client_versions = store.versions()
        client_rejections = {r: n for r, n in store.rejections.items() if n}

        # ---- the daemon: restart, it re-reads the topic on assignment
        rc, _ = daemon.terminate(60)
        assert rc == 0
        daemon.start()
        await daemon.wait_ready(60)
        served = {}
        for m in MODELS:
            status, served[m] = await http_get(daemon.url, f"/v1/models/{m}/binmap")
            assert status == 200
        mx = await scrape_metrics(daemon.url)
        rejected = {r: metric_value(mx, "lpcal_binmaps_rejected_total", default=0.0, reason=r)
                    for r in ("checksum", "truncated", "schema", "parse")}
        view = await models_view(daemon.url)
        rc, _ = daemon.terminate(60)
    finally:
        daemon.stop_quietly()

    figures("artifacts", {
        "bad bin maps published": {m: REASON[m] for m in REASON},
        "client: versions in force": client_versions,
        "client: rejections by reason": client_rejections,
        "daemon: lpcal_binmaps_rejected_total by reason":
            {r: int(v) for r, v in rejected.items()},
        "daemon: served bin map unchanged": {m: served[m] == good[m] for m in REASON},
        "daemon: valid v2 adopted": served["art-valid"] == bad["art-valid"],
    })
    assert client_versions == {"art-corrupt": 1, "art-truncated": 1, "art-schema": 1,
                               "art-valid": 2}
    assert client_rejections == {"checksum": 1, "truncated": 1, "schema": 1}
    probs = np.random.default_rng(0).dirichlet(np.ones(3), size=50)
    assert np.array_equal(store.apply("art-corrupt", probs),
                          BinMap.from_json(good["art-corrupt"]).apply(probs))
    for m in REASON:
        assert served[m] == good[m], m
        assert view[m]["binmap_version"] == 1
    assert served["art-valid"] == bad["art-valid"] and view["art-valid"]["binmap_version"] == 2
    assert rejected == {"checksum": 1.0, "truncated": 1.0, "schema": 1.0, "parse": 0.0}
    assert rc == 0
