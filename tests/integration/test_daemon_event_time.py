"""Event time and join order against the real daemon on the embedded broker.

* One schema-valid event with ``ts = 1e12`` is dead-lettered as ``ts_out_of_range``;
  the model's 500 pending predictions still join their outcomes (before: all 500 evicted, the
  outcomes counted ``late``, a one-sample monitor window, the drift clock at 1e12).
* Outcomes that arrive before their model's first prediction wait in the join
  buffer, across a restart, for pinned and learned k (before, with learned k: dead-lettered as
  ``bad_schema``, and their predictions waited forever).
"""

from __future__ import annotations

import orjson
import pytest

from tests.support.daemon_harness import (
    EventProducer,
    metric_value,
    read_deadletters,
    running_daemon,
    scrape_metrics,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration
TS0 = 1_764_000_000.0
N = 500


def _alive(rd):
    if rd.task.done():
        rd.task.result()
        raise RuntimeError("daemon ended")


async def test_future_ts_is_dead_lettered_and_pending_joins_survive(deployment, broker):
    names = await deployment.topics(1)
    cfg = deployment.config(defaults={"k": 3, "window_seconds": 3600.0})
    settings = deployment.settings(cfg)
    ids, probs, labels = synth_samples(N, 3, 5, "m")
    poison = orjson.dumps({"model": "m", "id": "poison", "ts": 1e12,
                           "probs": [0.2, 0.3, 0.5], "label": 1})
    async with running_daemon(settings) as rd:
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, "m", ids, probs, labels, ts0=TS0, outcomes=False)
            await prod.raw(names.predictions, poison, "m")
            await prod.flush()

            def consumed():
                _alive(rd)
                return rd.daemon.partitions.position(names.predictions, 0) == N + 1
            await wait_until(consumed, 30, "predictions and the poison consumed",
                             diag=rd.describe)
            assert rd.daemon.registry.slots["m"].state.join.pending("m") == N
            await prod.samples(names, "m", ids, probs, labels, ts0=TS0, predictions=False)
            await prod.flush()

        def joined():
            _alive(rd)
            return rd.daemon.registry.slots["m"].state.samples_total == N
        await wait_until(joined, 30, f"{N} samples joined", diag=rd.describe)
        st = rd.daemon.registry.slots["m"].state
        samples = await scrape_metrics(rd.url)
        assert metric_value(samples, "lpcal_events_invalid_total",
                            reason="ts_out_of_range") == 1
        assert metric_value(samples, "lpcal_join_unmatched_total", default=0.0,
                            model="m", kind="late") == 0
        assert metric_value(samples, "lpcal_join_evictions_total", default=0.0,
                            model="m", reason="ttl") == 0
        assert st.monitor.window_size() == N
        bound = TS0 + N + 60
        assert rd.daemon.registry.slots["m"].event_time <= bound
        assert max(st.join.clock, *st.join.wm, st.monitor.clock) <= bound
    dls = await read_deadletters(broker.bootstrap, names.deadletter)
    assert [(d.reason, d.source_offset) for d in dls] == [("ts_out_of_range", N)]


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned_k", "learned_k"])
async def test_outcomes_first_join_across_a_restart(deployment, broker, pinned):
    names = await deployment.topics(1)
    cfg = deployment.config(defaults={"k": 3 if pinned else None})
    settings = deployment.settings(cfg)
    n = 300
    ids, probs, labels = synth_samples(n, 3, 9, "o")
    async with running_daemon(settings) as rd:
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, "m", ids, probs, labels, ts0=TS0, predictions=False)
            await prod.flush()

        def waiting():
            _alive(rd)
            st = rd.daemon.registry.states().get("m")
            return st is not None and st.join.pending("m") == n
        await wait_until(waiting, 30, f"{n} outcomes waiting", diag=rd.describe)
        assert rd.daemon.registry.slots["m"].state.k == (3 if pinned else 0)
    async with running_daemon(settings) as rd:  # restored from the shutdown checkpoint
        assert rd.daemon.registry.slots["m"].state.join.pending("m") == n
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, "m", ids, probs, labels, ts0=TS0, outcomes=False)
            await prod.flush()

        def joined():
            _alive(rd)
            return rd.daemon.registry.slots["m"].state.samples_total == n
        await wait_until(joined, 30, f"{n} samples joined", diag=rd.describe)
        st = rd.daemon.registry.slots["m"].state
        assert st.k == 3 and st.join.pending("m") == 0
        samples = await scrape_metrics(rd.url)
        assert metric_value(samples, "lpcal_joined_samples_total", model="m") == n
        for reason in ("bad_schema", "wrong_length"):
            assert metric_value(samples, "lpcal_events_invalid_total", default=0.0,
                                reason=reason) == 0
    assert await read_deadletters(broker.bootstrap, names.deadletter, timeout=5) == []
