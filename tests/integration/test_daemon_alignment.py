"""A backlog on both input topics is joined without loss: the join's flow control
(:mod:`daemon.alignment`) holds back the topic read ahead.

Both topics hold a backlog of ``N`` pairs before the daemon starts. aiokafka fetches each
partition by bytes, and an outcome is a quarter of the size of a ``k = 10`` prediction, so the
outcomes run ahead and wait in the model's join buffer (bound ``CAP``, far below ``N``). Without
the flow control the buffer evicts the oldest (``capacity``) and their predictions, read later,
are ``late``: with ``join.align_inputs = false`` in this very setup, 0, 0, 0 and 20,000 of
the 30,000 pairs were joined in 4 runs (the outcome topic read first, or most of it). With it, every pair must be joined, nothing evicted, and
the holds must have been counted. Modes and pools are set so that nothing but the join works
(epochs with pools no backlog fills: no fit)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from tests.support.daemon_harness import (
    EventProducer,
    daemon_config,
    free_port,
    metric_value,
    running_daemon,
    scrape_metrics,
    wait_until,
)

pytestmark = pytest.mark.integration

MODEL, K = "align-a", 10
N = 30_000        # pairs in the backlog
CAP = 10_000      # the join buffer's bound: a hold at half of it leaves room for one batch


async def test_a_backlog_read_faster_on_one_topic_loses_no_pair(deployment, broker):
    names = await deployment.topics(1)
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(), partitions=1,
                        defaults={"k": K, "recovery": "epochs", "pool": 10**7,
                                  "mu_pool": 10**7},
                        models={MODEL: {"k": K}},
                        join={"max_pending_per_model": CAP})
    settings = deployment.settings(cfg)
    assert settings.join.align_inputs  # the shipped default
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(K), size=N)
    labels = rng.integers(0, K, size=N)
    ts0 = 1_764_000_000.0
    async with EventProducer(broker.bootstrap) as prod:
        for i in range(N):
            await prod.raw(names.predictions, orjson.dumps(
                {"model": MODEL, "id": f"e{i}", "ts": ts0 + i / 100, "probs": probs[i].tolist()}),
                MODEL)
        for i in range(N):
            await prod.raw(names.outcomes, orjson.dumps(
                {"model": MODEL, "id": f"e{i}", "ts": ts0 + i / 100 + 5, "label": int(labels[i])}),
                MODEL)
        await prod.flush()

    async with running_daemon(settings) as rd:
        d = rd.daemon

        def settled():
            st = d.registry.states().get(MODEL)
            if st is None:
                return False
            s = st.join.stats(MODEL)
            return s["joined"] + sum(s["unmatched"].values()) + s["pending"] >= N and (
                s["joined"] == N or not st.join.pending(MODEL) or s["evicted"]["capacity"])

        await wait_until(settled, 120, f"{N} pairs read", diag=rd.describe)
        st = d.registry.states()[MODEL]
        stats = st.join.stats(MODEL)
        assert stats["evicted"] == {"ttl": 0, "capacity": 0}, stats
        assert stats["unmatched"] == {"late": 0, "duplicate": 0, "orphan": 0}, stats
        assert stats["joined"] == N and st.samples_total == N
        mx = await scrape_metrics(rd.url)
        holds = sum(metric_value(mx, "lpcal_input_holds_total", 0.0, topic=t)
                    for t in ("predictions", "outcomes"))
        assert holds >= 1  # the outcomes were read ahead and held back
        assert not d.partitions.held() and not d.clients.consumer.paused()
