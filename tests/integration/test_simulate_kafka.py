"""daemon.tools.simulate against the embedded Kafka broker (never mocked)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import orjson
import pytest

from daemon.kafka.readers import read_records
from daemon.kafka.topics import partition_counts
from daemon.tools.simulate.cli import main
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import Drift, TrafficGenerator

integration = pytest.mark.integration


async def _read_all(bootstrap: str, topic: str, timeout: float = 20.0):
    """Every record of ``topic`` (up to the end offsets at the start) as (partition, key, value)."""
    return [(m.partition, m.key, m.value) for m in await read_records(bootstrap, topic, timeout)]


def _gen(seed=1, **kw):
    models = [SyntheticModel(name, k, 0.3, 5.0, 0.0, seed=[seed, i])
              for i, (name, k) in enumerate([("fraud-v3", 3), ("churn-v1", 2), ("ltv-v2", 5)])]
    return TrafficGenerator(models, 2000, event_rate=200.0, delay=3.0, orphan_frac=0.1,
                            sample_frac=0.05, malformed_frac=0.02, seed=seed, **kw)


@integration
async def test_simulate_2000_events_round_trip(broker, topic_prefix):
    topics = {"predictions": f"{topic_prefix}.preds", "outcomes": f"{topic_prefix}.outs"}
    gen = _gen()
    lines = []
    report = await simulate(broker.bootstrap, topics, gen, rate=0, idempotence=False,
                            partitions=2, flush_every=700, progress=lines.append,
                            progress_interval=0.0)
    expected = list(_gen())  # same seed: the same stream
    want = {t: [(k, v) for kind, k, v in expected if topics[kind] == t] for t in topics.values()}
    assert report.events == 2000
    assert report.messages == {t: len(want[t]) for t in topics.values()}
    assert report.partitions == {topics["predictions"]: 2, topics["outcomes"]: 2}
    assert sum(report.messages.values()) == len(expected) > 3000
    assert report.counts["outcome"] == report.counts["prediction"] - report.counts["orphan"]
    assert lines and "/2000 events" in lines[-1]
    assert await partition_counts(broker.bootstrap, topics.values()) == report.partitions

    part_of_key: dict[bytes, int] = {}
    for t in topics.values():
        got = await _read_all(broker.bootstrap, t)
        assert Counter((k, v) for _, k, v in got) == Counter(want[t])
        for p, k, v in got:
            # keyed by model: one partition per model, the same on both topics (co-partitioned)
            assert part_of_key.setdefault(k, p) == p
            if not k.startswith(b"unknown-"):
                try:
                    assert orjson.loads(v)["model"].encode() == k
                except orjson.JSONDecodeError:
                    pass  # a malformed (bad_json/nan) event
        # per partition, the order of a model's messages is the stream order
        for key in {k for _, k, _ in got}:
            assert [v for _, k, v in got if k == key] == [v for k, v in want[t] if k == key]
    assert {b"fraud-v3", b"churn-v1", b"ltv-v2"} <= set(part_of_key)


@integration
async def test_rate_paces_wall_time(broker, topic_prefix):
    topics = {"predictions": f"{topic_prefix}.p", "outcomes": f"{topic_prefix}.o"}
    gen = TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 400, event_rate=1000.0, chunk=50)
    t0 = time.monotonic()
    report = await simulate(broker.bootstrap, topics, gen, rate=1000.0, idempotence=False)
    assert time.monotonic() - t0 >= 0.35  # 400 events at 1000/s: at least ~0.4 s of pacing
    assert report.events == 400


@integration
async def test_between_chunks_hook_changes_and_holds_the_running_stream(broker, topic_prefix):
    """The hook runs after each chunk is sent: it can add a drift step (the demo's switch) and
    hold the stream (awaited) without losing or reordering messages."""
    topics = {"predictions": f"{topic_prefix}.p", "outcomes": f"{topic_prefix}.o"}
    gen = TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0, seed=2)], 600, event_rate=100.0,
                           chunk=100)
    seen = []

    async def hook(g):
        seen.append(g.produced)
        if g.produced == 300:
            g.add_drift(Drift(g.produced, logit_scale=0.5))
            await asyncio.sleep(0.3)

    t0 = time.monotonic()
    report = await simulate(broker.bootstrap, topics, gen, idempotence=False,
                            between_chunks=hook)
    assert time.monotonic() - t0 >= 0.3
    assert seen == [100, 200, 300, 400, 500, 600, 600]  # the last: the late outcomes' chunk
    want = list(TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0, seed=2)], 600,
                                 event_rate=100.0, drifts=[Drift(300, logit_scale=0.5)]))
    assert report.messages[topics["predictions"]] == sum(1 for t, *_ in want
                                                         if t == "predictions")
    got = await _read_all(broker.bootstrap, topics["predictions"])
    assert [v for _, _, v in got] == [v for t, _, v in want if t == "predictions"]


@integration
def test_cli_end_to_end(broker, topic_prefix, capsys):
    rc = main(["--bootstrap", broker.bootstrap, "--no-idempotence", "--topic-prefix",
               topic_prefix + ".", "--models", "fraud-v3,churn-v1:4", "--events", "300",
               "--partitions", "3", "--malformed-frac", "0.1", "--quiet", "--seed", "5"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "sent 300 events" in out.out
    preds, outs = topic_prefix + ".lpcal.predictions", topic_prefix + ".lpcal.outcomes"
    assert await_counts(broker.bootstrap, [preds, outs]) == {preds: 3, outs: 3}
    got = asyncio.run(_read_all(broker.bootstrap, preds))
    assert len(got) >= 300 - 10  # events minus the label_out_of_range ones (outcomes topic)


def await_counts(bootstrap, topics):
    return asyncio.run(partition_counts(bootstrap, topics))


@integration
def test_cli_idempotent_producer_fails_cleanly_on_tansu(broker, topic_prefix, capsys):
    # the embedded broker lacks InitProducerId: the default (idempotent) producer must fail
    # with exit code 1 and a message, not a traceback
    rc = main(["--bootstrap", broker.bootstrap, "--topic-prefix", topic_prefix + ".",
               "--events", "10", "--quiet"])
    assert rc == 1
    assert "lpcal simulate: error:" in capsys.readouterr().err
