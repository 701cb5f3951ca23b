"""The daemon end to end against the embedded broker (in-process daemon, real Kafka, real HTTP):
events in -> joined samples -> pools -> bin map on the bin-map topic and over HTTP; metrics
scraped over HTTP; malformed events dead-lettered with their reason."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import orjson
import pytest

from daemon.model_state import ModelState
from lpcal.binmap import BinMap
from tests.support.daemon_harness import (
    EventProducer,
    http_get,
    http_post,
    metric_value,
    read_binmaps,
    read_deadletters,
    running_daemon,
    scrape_metrics,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
POOL = 100  # every pool's target: small, so a fit happens after a few thousand samples
HOLDOUT, WARMUP = 300, 200  # the certified default's held-out share and warm-up, made small


def _one_epoch_samples(settings, model: str, seed: int):
    """Samples of ``model`` that fill every pool at least once and some pool less than twice,
    so that exactly one epoch seals (routing is a hash of the id; in the certified mode the
    first ``warmup`` joined samples, in the order produced, fit the temperature and the rest is
    routed to the pools and the held-out share). The count is derived from the pool layout the
    daemon will use (not hard-coded)."""
    k = settings.model_settings(model).k
    st = ModelState.create(model, k, settings.model_settings(model), settings.join)
    lay = st.layout
    targets = np.array([lay.targets[n] for n in lay.names]
                       + ([lay.holdout] if lay.holdout else []))
    for n in range(int(1.2 * targets.sum()) + lay.warmup, int(1.9 * targets.sum()) + lay.warmup,
                   50):
        ids, probs, labels = synth_samples(n, k, seed, model)
        counts = np.bincount(lay.route(ids[lay.warmup:]), minlength=targets.size)
        if (counts >= targets).all() and (counts < 2 * targets).any():
            return ids, probs, labels
    raise AssertionError(f"no sample count gives exactly one epoch for {st.layout.targets}")


async def test_events_to_binmap_on_topic_and_http_metrics_and_manual_trigger(deployment, broker):
    names = await deployment.topics(2)
    cfg = deployment.config(partitions=2, admin_token=TOKEN,
                            defaults={"pool": POOL, "mu_pool": POOL, "holdout": HOLDOUT,
                                      "warmup": WARMUP, "recovery": "epochs"},
                            models={"flow-a": {"k": 3}, "flow-b": {"k": 4}})
    settings = deployment.settings(cfg)
    assert settings.defaults.mode == "certified"  # the default mode, end to end
    data = {m: _one_epoch_samples(settings, m, seed) for seed, m in enumerate(("flow-a",
                                                                             "flow-b"))}
    n = {m: len(ids) for m, (ids, _, _) in data.items()}

    async with running_daemon(settings) as rd:
        url = rd.url
        st, body = await http_get(url, "/healthz")
        assert st == 200, body
        st, body = await http_get(url, "/readyz")
        assert st == 200 and orjson.loads(body)["restored"] is True, body

        async with EventProducer(broker.bootstrap) as prod:
            for m, (ids, probs, labels) in data.items():  # predictions first, outcomes later
                await prod.samples(names, m, ids, probs, labels, outcomes=False)
            await prod.flush()
            for m, (ids, probs, labels) in data.items():
                await prod.samples(names, m, ids, probs, labels, predictions=False)
            await prod.flush()

        def done():
            ms = rd.daemon.registry.states()
            return all(m in ms and ms[m].samples_total == n[m] and ms[m].binmap_version >= 1
                       and m not in rd.daemon.registry.fitting() for m in data)
        await wait_until(done, 30, f"{n} joined samples and bin map v1 for both models",
                         diag=rd.describe)

        # ---- the bin map on the compacted topic and over HTTP: same bytes, version 1
        maps = await wait_until(lambda: _maps_with(broker, names, {m: 1 for m in data}), 15,
                                "bin maps v1 on the bin-map topic")
        for m in data:
            k = settings.model_settings(m).k
            raw, bm = maps[m]
            assert bm.version == 1 and bm.model_id == m and bm.k == k
            assert bm.eps == pytest.approx(0.1) and bm.p == float("inf")
            back = BinMap.from_json(raw)
            assert back.n_bins == bm.n_bins
            # the certified default: temperature fitted on the warm-up, a held-out certificate
            assert back.mode == "certified" and back.temperature is not None
            cert = back.certificate
            assert cert.n_holdout >= HOLDOUT and cert.eps == pytest.approx(0.1)
            assert cert.selected in ("precalibrator", "corrected")
            assert set(cert.estimates) == {"raw", "precalibrator", "corrected"}
            out = bm.apply(data[m][1][:50])
            assert np.allclose(out.sum(axis=1), 1.0) and (out >= 0).all()
            st, body = await http_get(url, f"/v1/models/{m}/binmap")
            assert st == 200 and body == raw
        st, _ = await http_get(url, "/v1/models/nope/binmap")
        assert st == 404

        st, body = await http_get(url, "/v1/models")
        assert st == 200
        listed = {e["model"]: e for e in orjson.loads(body)["models"]}
        assert set(listed) == set(data)
        for m in data:
            assert listed[m]["samples_total"] == n[m]
            assert listed[m]["binmap_version"] == 1
            assert listed[m]["k"] == settings.model_settings(m).k
            assert listed[m]["mode"] == "certified"
            cert = maps[m][1].certificate
            assert listed[m]["certificate"]["bound"] == pytest.approx(cert.bound)

        # ---- metrics scraped over HTTP, parsed with prometheus_client's parser
        mx = await scrape_metrics(url)
        for m in data:
            assert metric_value(mx, "lpcal_joined_samples_total", model=m) == n[m]
            assert metric_value(mx, "lpcal_calibrations_total", model=m,
                                trigger="pools_full") == 1
            assert metric_value(mx, "lpcal_calibrations_total", model=m, trigger="manual",
                                default=0.0) == 0
            assert metric_value(mx, "lpcal_binmap_version", model=m) == 1
            assert metric_value(mx, "lpcal_high_probability_bins", model=m) == maps[m][1].n_bins
            assert metric_value(mx, "lpcal_fit_duration_seconds_count", model=m) == 1
            cert = maps[m][1].certificate
            assert metric_value(mx, "lpcal_certificate_bound", model=m) == pytest.approx(
                cert.bound)
            assert metric_value(mx, "lpcal_certificate_target", model=m) == pytest.approx(0.1)
            assert metric_value(mx, "lpcal_certificate_estimate", model=m,
                                candidate="raw") == pytest.approx(cert.estimates["raw"].err_p)
        total = sum(n.values())
        assert metric_value(mx, "lpcal_events_consumed_total", topic="predictions") == total
        assert metric_value(mx, "lpcal_events_consumed_total", topic="outcomes") == total
        assert sum(v for (n, _), v in mx.items() if n == "lpcal_events_invalid_total") == 0
        assert metric_value(mx, "lpcal_ready") == 1

        # ---- manual trigger of partial pools: in the certified mode they need the epoch's
        # warm-up done (its temperature) first, so flow-a gets WARMUP + 400 more samples
        ids, probs, labels = synth_samples(WARMUP + 400, 3, 99, "flow-a-extra")
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, "flow-a", ids, probs, labels)
            await prod.flush()
        await wait_until(lambda: rd.daemon.registry.slots["flow-a"].state.samples_total == n["flow-a"]
                         + len(ids), 30, "the extra samples of flow-a", diag=rd.describe)
        assert not rd.daemon.registry.slots["flow-a"].state.filling.warming

        # ---- manual trigger: bearer token required
        path = "/v1/models/flow-a/recalibrate"
        st, _ = await http_post(url, path)
        assert st == 401
        st, _ = await http_post(url, path, headers={"Authorization": "Bearer wrong"})
        assert st == 401
        st, _ = await http_post(url, path, headers={"Authorization": TOKEN})  # no scheme
        assert st == 401
        st, _ = await http_post(url, "/v1/models/nope/recalibrate",
                                headers={"Authorization": f"Bearer {TOKEN}"})
        assert st == 404
        st, body = await http_post(url, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert st == 202, body

        await wait_until(lambda: rd.daemon.registry.slots["flow-a"].state.binmap_version == 2, 15,
                         "manual recalibration of flow-a -> version 2", diag=rd.describe)
        maps2 = await wait_until(
            lambda: _maps_with(broker, names, {"flow-a": 2, "flow-b": 1}), 15,
            "bin map v2 of flow-a on the topic")
        st, body = await http_get(url, "/v1/models/flow-a/binmap")
        assert st == 200 and body == maps2["flow-a"][0]
        assert BinMap.from_json(body).version == 2
        assert maps2["flow-b"][0] == maps["flow-b"][0]  # untouched
        mx = await scrape_metrics(url)
        assert metric_value(mx, "lpcal_calibrations_total", model="flow-a",
                            trigger="manual") == 1
        assert metric_value(mx, "lpcal_binmap_version", model="flow-a") == 2
        assert metric_value(mx, "lpcal_binmap_version", model="flow-b") == 1


async def _maps_with(broker, names, versions: dict[str, int]):
    maps = await read_binmaps(broker.bootstrap, names.binmaps)
    ok = all(m in maps and maps[m][1].version == v for m, v in versions.items())
    return maps if ok else None


def _bad_events(k: int) -> list[tuple[str, bytes, str]]:
    """(model key, raw bytes, expected reason) of malformed events for a k-class model."""
    big = orjson.dumps({"model": "dl-a", "id": "big", "ts": 1.0,
                        "probs": [1.0 / k] * k, "pad": "x" * 1500})
    third = [1.0 / k] * k
    return [
        ("dl-a", b"{not json", "bad_json"),
        ("dl-a", b'{"model":"dl-a","id":"nan","ts":1,"probs":[NaN,0.5,0.5]}', "bad_json"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "ovf", "ts": 1.0,
                               "probs": [1e308, 1e308, 0.0]}), "non_finite"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "len", "ts": 1.0,
                               "probs": [0.25] * (k + 1)}), "wrong_length"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "neg", "ts": 1.0,
                               "probs": [-0.1, 0.6, 0.5]}), "negative"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "unn", "ts": 1.0,
                               "probs": [0.5, 0.5, 0.5]}), "not_normalized"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "lab", "ts": 1.0, "label": k}),
         "label_out_of_range"),
        ("dl-a", orjson.dumps({"model": "dl-a", "id": "lab2", "ts": 1.0, "probs": third,
                               "label": -1}), "label_out_of_range"),
        ("nobody", orjson.dumps({"model": "nobody", "id": "u", "ts": 1.0, "probs": third}),
         "unknown_model"),
        ("dl-a", big, "oversize"),
        ("dl-a", orjson.dumps({"model": "dl-a", "ts": 1.0, "probs": third}), "bad_schema"),
        ("dl-a", b"\xff\xfe{}", "bad_encoding"),
    ]


async def test_malformed_events_are_deadlettered_with_reason_and_valid_ones_joined(
        deployment, broker):
    names = await deployment.topics(2)
    cfg = deployment.config(partitions=2, defaults={"normalize": "reject"},
                            models={"dl-a": {"k": 3}, "dl-b": {"k": 2}}, unknown_models="reject",
                            kafka={"max_message_bytes": 1024})
    settings = deployment.settings(cfg)
    bad = _bad_events(3)
    assert len(bad[9][1]) > 1024
    n = 240
    data = {m: synth_samples(n, settings.model_settings(m).k, 7 + i, m)
            for i, m in enumerate(("dl-a", "dl-b"))}

    async with running_daemon(settings) as rd:
        expected: Counter = Counter()
        async with EventProducer(broker.bootstrap) as prod:
            # interleave: after every 20 valid events, one malformed event on alternating topics
            j = 0
            for phase in ("predictions", "outcomes"):
                topic = getattr(names, phase)
                for i in range(n):
                    for m, (ids, probs, labels) in data.items():
                        if phase == "predictions":
                            await prod.prediction(topic, m, ids[i], probs[i], 1000.0 + i)
                        else:
                            await prod.outcome(topic, m, ids[i], int(labels[i]), 1100.0 + i)
                    if i % 20 == 0:
                        key, raw, reason = bad[j % len(bad)]
                        await prod.raw(topic, raw, key)
                        expected[(reason, raw, topic)] += 1
                        j += 1
            await prod.flush()
        assert j >= len(bad)

        def joined():
            ms = rd.daemon.registry.states()
            return all(m in ms and ms[m].samples_total >= n for m in data)
        await wait_until(joined, 30, f"{n} joined samples per model", diag=rd.describe)
        want = sum(expected.values())

        last: list = []

        async def dl():
            last[:] = await read_deadletters(broker.bootstrap, names.deadletter)
            return list(last) if len(last) >= want else None
        got = await wait_until(dl, 20, f"{want} dead letters", diag=lambda: (
            f"read {len(last)}: {Counter(d.reason for d in last)}; expected "
            f"{Counter(r for r, _, _ in expected.elements())}"))
        seen = Counter((d.reason, d.value, d.source_topic) for d in got)
        assert seen == expected, (seen - expected, expected - seen)
        for d in got:
            assert d.source_partition >= 0 and d.source_offset >= 0

        mx = await scrape_metrics(rd.url)
        by_reason = Counter()
        for (reason, _, _), c in expected.items():
            by_reason[reason] += c
        for reason, c in by_reason.items():
            assert metric_value(mx, "lpcal_events_invalid_total", reason=reason) == c, reason
        assert sum(v for (nm, _), v in mx.items() if nm == "lpcal_events_invalid_total") == want
        assert metric_value(mx, "lpcal_deadletter_published_total") == want
        for m in data:
            assert rd.daemon.registry.slots[m].state.samples_total == n
            assert metric_value(mx, "lpcal_joined_samples_total", model=m) == n
        assert "nobody" not in rd.daemon.registry.states()


async def test_backlog_present_at_start_is_consumed_exactly_once(deployment, broker):
    names = await deployment.topics(1)
    cfg = deployment.config()
    settings = deployment.settings(cfg)
    n = 3000
    ids, probs, labels = synth_samples(n, 3, 3, "bl")
    async with EventProducer(broker.bootstrap) as prod:
        await prod.samples(names, "bl", ids, probs, labels)
        await prod.flush()
    async with running_daemon(settings) as rd:
        await wait_until(lambda: "bl" in rd.daemon.registry.states()
                         and rd.daemon.registry.slots["bl"].state.samples_total >= n, 20,
                         "backlog joined", diag=rd.describe)
        await asyncio.sleep(1.0)
        mx = await scrape_metrics(rd.url)
        consumed = {t: metric_value(mx, "lpcal_events_consumed_total", topic=t)
                    for t in ("predictions", "outcomes")}
        dup = metric_value(mx, "lpcal_join_unmatched_total", model="bl", kind="duplicate",
                           default=0.0)
        assert rd.daemon.registry.slots["bl"].state.samples_total == n
        assert consumed == {"predictions": n, "outcomes": n} and dup == 0, (consumed, dup)
