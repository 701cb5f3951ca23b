"""Checkpoints fit the broker, on the embedded broker with the real daemon.

At the default join bounds, a model with k = 100 and 256-byte ids fills its join buffer to the
byte budget (~24,000 pending predictions) and its checkpoint is ~25 MB: before, it failed with
``MessageSizeTooLargeError`` on every attempt, the final one at shutdown included. Now every
record on the state topic is at most ``state.max_record_bytes`` (1 MiB), the checkpoint is
split into parts, and a second daemon restores the whole join buffer from them.
"""

from __future__ import annotations

import numpy as np
import pytest

from daemon.checkpoint.store import PART, RecordLimitError
from daemon.codes import KIND_PREDICTION
from daemon.join import JoinStore
from daemon.kafka import topics as kafka_topics
from daemon.kafka.clients import make_producer
from tests.support.daemon_harness import (
    build_settings,
    metric_value,
    read_records,
    read_state,
    running_daemon,
    scrape_metrics,
    wait_until,
)

pytestmark = pytest.mark.integration

MIB = 1 << 20
K = 100
MODEL = "wide"


def _expected_capacity(settings) -> int:
    """Pending events a model with k = 100 and 256-byte ids keeps within its byte budget."""
    j = settings.join
    store = JoinStore(j.max_pending_per_model, j.ttl_seconds, j.recent_per_model,
                      max_bytes=min(j.max_bytes_per_model, j.max_bytes_total))
    store.offer(MODEL, [KIND_PREDICTION], ["x" * 256], [0.0], np.full((1, K), 1 / K), [-1])
    return store.capacity(MODEL)[0]


async def _send_predictions(bootstrap: str, topic: str, n: int) -> None:
    rng = np.random.default_rng(5)
    prod = make_producer(bootstrap, idempotence=False, client_id="state-limits",
                         linger_ms=20)
    await prod.start()
    try:
        futs = []
        for i in range(n):
            p = rng.dirichlet(np.ones(K)).round(4)
            p[0] += 1.0 - p.sum()
            eid = f"{i}-".ljust(256, "i")
            value = (f'{{"model":"{MODEL}","id":"{eid}","ts":{1000.0 + i * 0.01},"probs":['
                     + ",".join(f"{x:.4f}" for x in np.abs(p)) + "]}").encode()
            futs.append(await prod.send(topic, value=value, key=MODEL.encode()))
            if len(futs) >= 2000:
                for f in futs:
                    await f
                futs.clear()
        for f in futs:
            await f
    finally:
        await prod.stop()


async def test_large_checkpoints_are_split_into_records_the_broker_accepts(
        deployment, broker, tmp_path):
    names = await deployment.topics(1)
    cfg = deployment.config(defaults={"k": K, "normalize": "renormalize"})
    settings = deployment.settings(cfg)
    assert settings.state.max_record_bytes == MIB  # the default under test
    cap = _expected_capacity(settings)
    sent = cap + 1_000
    async with running_daemon(settings) as rd:
        await _send_predictions(broker.bootstrap, names.predictions, sent)

        async def full():
            mx = await scrape_metrics(rd.url)
            return metric_value(mx, "lpcal_join_pending", default=0.0, model=MODEL) >= cap

        await wait_until(full, 120, f"{cap} predictions pending", interval=0.5,
                         diag=rd.describe)
        ok0 = metric_value(await scrape_metrics(rd.url), "lpcal_checkpoints_total",
                           outcome="ok")

        async def checkpointed():
            return metric_value(await scrape_metrics(rd.url), "lpcal_checkpoints_total",
                                outcome="ok") >= ok0 + 2

        await wait_until(checkpointed, 60, "two checkpoints of the full buffer", interval=0.5)
        mx = await scrape_metrics(rd.url)
        assert metric_value(mx, "lpcal_checkpoints_total", outcome="error") == 0
        assert metric_value(mx, "lpcal_join_pending", model=MODEL) == cap
        assert metric_value(mx, "lpcal_join_evictions_total", model=MODEL,
                            reason="capacity") == sent - cap
    records = await read_records(broker.bootstrap, names.state)
    sizes = [len(r.key) + len(r.value or b"") for r in records]
    parts = [r for r in records if r.key.decode().startswith(f"{PART}model/{MODEL}/")]
    assert max(sizes) <= MIB, max(sizes)
    assert len(parts) >= 10, f"a ~25 MB checkpoint in {len(parts)} parts"
    snap = await read_state(broker.bootstrap, names.state)
    assert snap.models[MODEL].join.pending(MODEL) == cap

    # a second daemon (same group, fresh process state) restores the whole buffer
    settings2 = build_settings(cfg, tmp_path, name="second")
    async with running_daemon(settings2) as rd2:
        mx = await scrape_metrics(rd2.url)
        assert metric_value(mx, "lpcal_state_restores_total", outcome="restored") == 1
        assert rd2.daemon.registry.slots[MODEL].state.join.pending(MODEL) == cap

        async def gauge():
            mx = await scrape_metrics(rd2.url)
            return metric_value(mx, "lpcal_join_buffer_bytes", default=0.0, model=MODEL)

        nbytes = await wait_until(gauge, 30, "join buffer gauge exported")
        assert 32 * MIB < nbytes <= 64 * MIB


async def test_a_state_topic_with_a_lower_record_limit_stops_startup(
        deployment):
    """``state.max_record_bytes`` above the topic's ``max.message.bytes``: one clear error."""
    names = deployment.names.with_state(deployment.names.state + ".small")
    await kafka_topics.ensure_topics(deployment.bootstrap, [kafka_topics.TopicSpec(
        names.state, 1, configs={"cleanup.policy": "compact",
                                 "max.message.bytes": str(512 * 1024)})])
    await deployment.topics(1, names)
    cfg = deployment.config(names=names)
    with pytest.raises(RecordLimitError, match=r"max.message.bytes.*state.max_record_bytes"):
        async with running_daemon(deployment.settings(cfg)):
            pass
    cfg = deployment.config(names=names, state={"max_record_bytes": 512 * 1024})
    async with running_daemon(deployment.settings(cfg, name="fits")) as rd:
        assert rd.daemon.ready
