"""Bad input: fuzzed malformed events interleaved with a valid stream.

The fuzzer (:mod:`tests.support.fuzz`) makes events with one defect each, so the expected
dead-letter reason is known by construction. They are interleaved at seeded random positions
(and topics) with a valid two-model stream and played into a subprocess daemon. Checks: the
daemon never dies; every malformed event is on the dead-letter topic with its reason and its
exact bytes (``Counter`` of (reason, value) equal), the per-reason metric equals the per-reason
count, and every valid event is joined (``samples_total`` exact, nothing unmatched).
Short: 2,000 malformed events; long (LPCAL_SOAK=1): 100,000.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from daemon.event_records import REASONS
from daemon.events import EventParser
from daemon.kafka.clients import make_producer
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from tests.support.daemon_harness import (
    TopicNames,
    build_settings,
    daemon_config,
    free_port,
    metric_value,
    read_deadletters,
    scrape_metrics,
    wait_until,
)
from tests.support.fuzz import LEARNED_K_MODEL, TS, malformed_events
from tests.support.reliability import FastDaemon, wait_settled

MODELS = {"bad-a": 3, "bad-b": 4}
MAX_BYTES = 4096


def _cfg(bootstrap: str, names: TopicNames) -> dict:
    return daemon_config(bootstrap, names, http_port=free_port(), partitions=2,
                         defaults={"normalize": "reject", "pool": 10**6, "mu_pool": 10**6, "recovery": "epochs",
                                   "k": None},  # learned (LEARNED_K_MODEL); pinned below
                         models={**{m: {"k": k} for m, k in MODELS.items()},
                                 LEARNED_K_MODEL: {}},
                         unknown_models="reject", kafka={"max_message_bytes": MAX_BYTES})


def test_fuzzer_reasons_match_the_parser(tmp_path, soak):
    """The fuzzer's labels agree with ``daemon.events`` (a check of the fuzzer, and of the
    parser's reason order), on many more events than the integration test plays."""
    settings = build_settings(_cfg("127.0.0.1:1", TopicNames.for_prefix("fz")), tmp_path)
    parser = EventParser.from_settings(settings)
    events = list(malformed_events(200_000 if soak else 20_000, MODELS, 77, MAX_BYTES))
    pb = parser.parse_batch([v for _, v, _ in events], [TS] * len(events))
    got = {i: bad.reason for i, bad in pb.invalid}
    wrong = Counter((r, got.get(i, "ACCEPTED")) for i, (_, _, r) in enumerate(events)
                    if got.get(i) != r)
    assert not wrong, wrong
    assert not pb.by_model
    assert {r for _, _, r in events} == set(REASONS)  # every reason is exercised


@pytest.mark.integration
@pytest.mark.soak
async def test_malformed_events_dead_lettered_by_reason_valid_ones_all_joined(
        deployment, broker, tmp_path, soak, figures):
    n_bad = 100_000 if soak else 2_000
    n_valid = 100_000 if soak else 4_000
    names = await deployment.topics(2)
    gen = TrafficGenerator([SyntheticModel(m, k, T=0.4, scale=4.0, seed=j)
                            for j, (m, k) in enumerate(MODELS.items())], n_valid,
                           event_rate=500.0, delay=5.0, seed=21, decimals=6)
    valid = [(kind, key, value) for chunk in gen.chunks() for kind, key, value in chunk]
    per_model = {m: len(range(j, n_valid, len(MODELS))) for j, m in enumerate(MODELS)}
    rng = random.Random(5)
    stream = [(kind, key, value, None) for kind, key, value in valid]
    expected: Counter = Counter()
    for key, value, reason in malformed_events(n_bad, MODELS, 1234, MAX_BYTES):
        kind = rng.choice(("predictions", "outcomes"))
        stream.insert(rng.randrange(len(stream) + 1), (kind, key, value, reason))
        expected[(reason, value, getattr(names, kind))] += 1
    by_reason = Counter()
    for (reason, _, _), c in expected.items():
        by_reason[reason] += c

    daemon = FastDaemon(_cfg(broker.bootstrap, names), tmp_path, name="badin").start()
    try:
        await daemon.wait_ready(60)
        producer = make_producer(broker.bootstrap, idempotence=False,
                                 client_id="rel-bad", linger_ms=5,
                                 max_request_size=16 << 20)
        await producer.start()
        try:
            futs = []
            for kind, key, value, _ in stream:
                futs.append(await producer.send(getattr(names, kind), value=value, key=key))
                if len(futs) >= 5000:
                    await asyncio.gather(*futs)
                    futs.clear()
            await asyncio.gather(*futs)
        finally:
            await producer.stop()
        async def consumed_all():  # every message of the stream went through the parser
            mx = await scrape_metrics(daemon.url)
            return sum(v for (n, _), v in mx.items()
                       if n == "lpcal_events_consumed_total") >= len(stream)
        await wait_until(consumed_all, 900 if soak else 60, "the whole stream consumed",
                         interval=1.0, diag=daemon.logs)
        view = await wait_settled(daemon.url, per_model, 120 if soak else 30)
        last: list = []

        async def dl():
            last[:] = await read_deadletters(broker.bootstrap, names.deadletter, timeout=60)
            return len(last) >= n_bad
        try:
            await wait_until(dl, 120 if soak else 30, f"{n_bad} dead letters", interval=1.0)
        except AssertionError:
            pass  # measured below
        mx = await scrape_metrics(daemon.url)
        alive = daemon.alive()
        rc, _ = daemon.terminate(60)
    finally:
        daemon.stop_quietly()

    seen = Counter((d.reason, d.value, d.source_topic) for d in last)
    seen_reason = Counter(d.reason for d in last)
    metric = {r: metric_value(mx, "lpcal_events_invalid_total", default=0.0, reason=r)
              for r in set(by_reason) | set(seen_reason)}
    joined = {m: view.get(m, {}).get("samples_total", 0) for m in per_model}
    unmatched = sum(v for (n, _), v in mx.items() if n == "lpcal_join_unmatched_total")
    figures("bad input", {
        "malformed events": n_bad, "valid events": n_valid,
        "malformed by reason": dict(sorted(by_reason.items())),
        "dead letters by reason": dict(sorted(seen_reason.items())),
        "lpcal_events_invalid_total by reason": {r: int(v) for r, v in sorted(metric.items())},
        "dead letters with wrong reason/bytes/topic": sum((seen - expected).values()),
        "malformed events missing from the DLQ": sum((expected - seen).values()),
        "valid samples joined": sum(joined.values()),
        "valid samples expected": sum(per_model.values()),
        "unmatched valid events": int(unmatched),
        "daemon crashed": not alive, "exit code": rc,
    })
    assert alive and rc == 0, daemon.logs()
    assert seen == expected, (seen - expected, expected - seen)
    assert metric == {r: float(c) for r, c in by_reason.items()}, (metric, by_reason)
    assert metric_value(mx, "lpcal_deadletter_published_total") == n_bad
    assert joined == per_model and unmatched == 0, (joined, per_model, unmatched)
    for d in last:
        assert d.source_partition >= 0 and d.source_offset >= 0
