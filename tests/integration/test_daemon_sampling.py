"""Per-model ``sample_rate`` end to end: ``lpcal serve`` as a SUBPROCESS on
the embedded broker, with one model at rate 1 and one at :data:`RATE`, fed the same kind of
:class:`daemon.tools.simulate.traffic.TrafficGenerator` stream (predictions, their outcomes 5 s of event time
later, orphans and complete samples).

Predictions and outcomes arrive in both orders: the predictions of every :data:`HELD`-th event
with an outcome are held back and produced only after the daemon has consumed everything else,
so for those ids the outcome is consumed first and waits in the join.

The expected sets come from the stream itself and from ``lpcal.pools.route_uniform`` (the hash
the daemon samples with): the sampled model must join exactly the ids whose hash is below its
rate, count every other event of its per topic in ``lpcal_events_sampled_out_total``, and
neither dead-letter a dropped event nor leave one pending in the join. Checked over ``/metrics``
and ``/v1/models``, and at the end in the final checkpoint (pools cell by cell against a
:class:`~daemon.model_state.ModelState` fed exactly the expected samples; pending joins).

The daemon runs with a checkpoint interval longer than the test, so a SIGKILL after the first
phase leaves no checkpoint: the restarted daemon replays the input from the beginning and must
arrive at identical counts (sampled out, joined, consumed, pending, ``samples_total``).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import orjson
import pytest

from daemon.model_state import ModelState
from daemon.settings import load_settings
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from lpcal.pools import route_uniform
from tests.support.daemon_harness import (
    EventProducer,
    SubprocessDaemon,
    TopicNames,
    create_topics,
    daemon_config,
    free_port,
    http_get,
    pool_cells,
    read_deadletters,
    read_state,
    scrape_metrics,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.integration

FULL, HOT = "sm-full", "sm-hot"
RATE = 0.2
K = 3
EVENTS = 6000          # both models together; ~12,000 messages
HELD = 4               # every 4th event with an outcome: its prediction is produced last
GRACE = 10
HUGE = 10**6           # pool targets: no epoch fills, every joined sample stays in the pools


def _stream():
    """The generator's messages, and per model the ids that must be joined / left pending."""
    gen = TrafficGenerator([SyntheticModel(FULL, K, T=0.5, scale=3.0, seed=1),
                            SyntheticModel(HOT, K, T=0.5, scale=3.0, seed=2)],
                           events=EVENTS, delay=5.0, orphan_frac=0.05, sample_frac=0.05, seed=3)
    msgs = [m for chunk in gen.chunks(annotate=True) for m in chunk]
    preds: dict[str, dict[str, bytes]] = {FULL: {}, HOT: {}}
    outs: dict[str, set[str]] = {FULL: set(), HOT: set()}
    complete: dict[str, set[str]] = {FULL: set(), HOT: set()}
    for topic_kind, _key, value, kind in msgs:
        d = orjson.loads(value)
        if kind == "outcome":
            outs[d["model"]].add(d["id"])
        elif kind == "sample":
            complete[d["model"]].add(d["id"])
        else:
            assert kind == "prediction" and topic_kind == "predictions", kind
            preds[d["model"]][d["id"]] = value
    # held back: the predictions of every HELD-th id (in stream order) that has an outcome
    held = set()
    for m in (FULL, HOT):
        answered = [i for i in preds[m] if i in outs[m]]
        held |= set(answered[::HELD])
    first = [(t, k, v) for t, k, v, kind in msgs
             if not (kind == "prediction" and orjson.loads(v)["id"] in held)]
    last = [(t, k, v) for t, k, v, kind in msgs
            if kind == "prediction" and orjson.loads(v)["id"] in held]
    expect = {}
    for m in (FULL, HOT):
        joined = (set(preds[m]) & outs[m]) | complete[m]
        pending = set(preds[m]) - outs[m]  # orphans: no outcome ever
        expect[m] = {"joined": joined, "pending": pending,
                     "pred_msgs": set(preds[m]) | complete[m], "out_msgs": outs[m]}
    return first, last, held, expect, msgs


def _sample(ids: set[str], rate: float) -> set[str]:
    """The ids the daemon keeps at ``rate``: route_uniform (blake2b of the id) below it."""
    if rate >= 1.0:
        return set(ids)
    order = sorted(ids)
    return {i for i, u in zip(order, route_uniform(order)) if u < rate}


async def _models(d: SubprocessDaemon) -> dict[str, dict]:
    status, body = await http_get(d.url, "/v1/models", timeout=2.0)
    assert status == 200, status
    return {e["model"]: e for e in orjson.loads(body)["models"]}


def _counts(metrics: dict) -> dict:
    """The counters and gauges the replay must reproduce (label sets as sorted tuples)."""
    keep = ("lpcal_events_consumed_total", "lpcal_events_sampled_out_total",
            "lpcal_joined_samples_total", "lpcal_join_pending", "lpcal_events_invalid_total",
            "lpcal_deadletter_published_total", "lpcal_join_unmatched_total",
            "lpcal_join_evictions_total")
    return {(name, tuple(sorted(labels))): v for (name, labels), v in metrics.items()
            if name in keep and v}


def _value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


async def _produce(bootstrap: str, names: TopicNames, msgs) -> dict[str, int]:
    sent = {"predictions": 0, "outcomes": 0}
    async with EventProducer(bootstrap) as prod:
        for topic_kind, key, value in msgs:
            await prod.raw(names.predictions if topic_kind == "predictions" else names.outcomes,
                           value, key)
            sent[topic_kind] += 1
        await prod.flush()
    return sent


async def _settled(d: SubprocessDaemon, consumed: dict[str, int], models: set[str],
                   timeout: float) -> tuple[dict, dict]:
    """Wait until ``d`` consumed ``consumed`` messages per topic and its pending gauges agree
    with ``/v1/models`` (gauges are exported at most once a second); return (metrics, models)."""
    out: dict = {}

    async def done():
        met = await scrape_metrics(d.url)
        if any(_value(met, "lpcal_events_consumed_total", topic=t) != n
               for t, n in consumed.items()):
            return False
        info = await _models(d)
        if set(info) != models:
            return False
        await asyncio.sleep(1.2)  # one gauge export interval after the last event
        met2 = await scrape_metrics(d.url)
        if _counts(met2) != _counts(met):
            return False
        out.update(metrics=met2, models=await _models(d))
        return True

    await wait_until(done, timeout, f"daemon consumed {consumed}", interval=0.3, diag=d.logs)
    return out["metrics"], out["models"]


async def _scenario(bootstrap: str, workdir) -> dict:
    prefix = f"it-sample-{uuid.uuid4().hex[:8]}"
    names = TopicNames.for_prefix(prefix)
    await create_topics(bootstrap, names, partitions=2)
    cfg = daemon_config(bootstrap, names, http_port=free_port(), partitions=2,
                        group_id=f"{prefix}-g",
                        defaults={"mode": "paper", "pool": HUGE, "mu_pool": HUGE},
                        models={FULL: {"k": K}, HOT: {"k": K, "sample_rate": RATE}},
                        state={"checkpoint_interval_seconds": 3600.0},
                        shutdown_grace_seconds=GRACE)
    first, last, held, expect, _ = _stream()
    d = SubprocessDaemon(cfg, workdir, "sampling")
    res: dict = {"events": [], "names": names, "expect": expect, "held": held, "cfg": cfg}
    t0 = time.monotonic()

    def note(what: str) -> None:
        res["events"].append(f"{time.monotonic() - t0:6.1f} s  {what}")

    try:
        d.start()
        sent1 = await _produce(bootstrap, names, first)  # while the daemon starts
        await d.wait_ready(40)
        note(f"ready; phase 1 produced {sent1}")
        res["phase1"] = await _settled(d, sent1, {FULL, HOT}, 30)
        note("phase 1 consumed")
        res["kill_rc"] = d.kill()
        d.start()
        await d.wait_ready(40)
        note("restarted and ready")
        res["replay"] = await _settled(d, sent1, {FULL, HOT}, 30)
        note("replayed after SIGKILL")
        sent2 = await _produce(bootstrap, names, last)
        res["sent"] = {t: sent1[t] + sent2[t] for t in sent1}
        res["final"] = await _settled(d, res["sent"], {FULL, HOT}, 30)
        note(f"phase 2 consumed ({sent2})")
        res["term"] = await asyncio.to_thread(d.terminate, GRACE + 5)
        note(f"SIGTERM: {res['term']}")
        res["state"] = await read_state(bootstrap, names.state)
        res["dlq"] = await read_deadletters(bootstrap, names.deadletter)
        res["logs"] = d.logs(1500)
    except BaseException:
        print("\n".join(res["events"]))
        print(d.logs())
        raise
    finally:
        d.stop_quietly()
    note("scenario done")
    print("\n".join(res["events"]))
    return res


@pytest.fixture(scope="module")
def scenario(broker, tmp_path_factory):
    return asyncio.run(_scenario(broker.bootstrap, tmp_path_factory.mktemp("sampling")))


def _kept(sc, model: str, key: str) -> set[str]:
    return _sample(sc["expect"][model][key], RATE if model == HOT else 1.0)


def test_sampled_model_joins_exactly_the_ids_below_its_rate(scenario):
    sc = scenario
    met, info = sc["final"]
    for model in (FULL, HOT):
        joined = _kept(sc, model, "joined")
        pending = _kept(sc, model, "pending")
        assert info[model]["samples_total"] == len(joined), (model, info[model])
        assert _value(met, "lpcal_joined_samples_total", model=model) == len(joined), model
        assert _value(met, "lpcal_join_pending", model=model) == len(pending), model
    # the stream has what the test needs: outcome-first joins of both models, kept and dropped
    exp = sc["expect"][HOT]
    assert 0.15 < len(_kept(sc, HOT, "joined")) / len(exp["joined"]) < 0.25
    held_hot = sc["held"] & exp["joined"]
    assert len(_sample(held_hot, RATE)) >= 20 and len(held_hot - _sample(held_hot, RATE)) >= 80


def test_dropped_events_are_counted_per_topic_and_nothing_else(scenario):
    sc = scenario
    met, _ = sc["final"]
    exp = sc["expect"][HOT]
    for topic, key in (("predictions", "pred_msgs"), ("outcomes", "out_msgs")):
        dropped = len(exp[key]) - len(_sample(exp[key], RATE))
        assert dropped > 0
        assert _value(met, "lpcal_events_sampled_out_total", model=HOT, topic=topic) == dropped
        assert _value(met, "lpcal_events_sampled_out_total", model=FULL, topic=topic) == 0
        assert _value(met, "lpcal_events_consumed_total", topic=topic) == sc["sent"][topic]
    # no dropped event was dead-lettered, counted invalid or unmatched, or evicted
    assert sc["dlq"] == []
    assert _value(met, "lpcal_deadletter_published_total") == 0
    for (name, _labels), v in met.items():
        if name in ("lpcal_events_invalid_total", "lpcal_join_unmatched_total",
                    "lpcal_join_evictions_total"):
            assert v == 0, (name, _labels, v)


def test_restart_after_sigkill_replays_to_identical_counts(scenario):
    sc = scenario
    assert sc["kill_rc"] == -9
    met1, info1 = sc["phase1"]
    met2, info2 = sc["replay"]
    assert _counts(met2) == _counts(met1)
    assert _value(met1, "lpcal_events_sampled_out_total", model=HOT, topic="outcomes") > 0
    for model in (FULL, HOT):
        assert info2[model]["samples_total"] == info1[model]["samples_total"] > 0
        assert info2[model]["pool_fill"] == info1[model]["pool_fill"]
    # after phase 1 the held-back predictions' outcomes (the kept ones) wait in the join
    exp = sc["expect"][HOT]
    want = len(_sample(exp["pending"], RATE)) + len(_sample(sc["held"] & exp["joined"], RATE))
    assert _value(met1, "lpcal_join_pending", model=HOT) == want


def test_final_checkpoint_holds_exactly_the_expected_samples(scenario, tmp_path):
    """Pools cell by cell against a ModelState fed exactly the expected samples (paper mode:
    the pools are count tables, independent of the order of the samples)."""
    sc = scenario
    rc, seconds = sc["term"]
    assert rc == 0 and seconds < GRACE, (rc, seconds, sc["logs"])
    settings = load_settings(write_config(sc["cfg"], tmp_path / "ref.toml"))
    st = sc["state"]
    _, _, _, _, msgs = _stream()
    rows: dict[str, dict[str, list]] = {FULL: {}, HOT: {}}
    labels: dict[str, dict[str, int]] = {FULL: {}, HOT: {}}
    for _topic, _key, value, kind in msgs:
        d = orjson.loads(value)
        if "probs" in d:
            rows[d["model"]][d["id"]] = d["probs"]
        if "label" in d:
            labels[d["model"]][d["id"]] = d["label"]
    for model in (FULL, HOT):
        got = st.models[model]
        ids = sorted(_kept(sc, model, "joined"))
        ref = ModelState.create(model, K, settings.model_settings(model), settings.join)
        assert ref.sample_rate == (RATE if model == HOT else 1.0)
        ref.ingest(ids, np.array([rows[model][i] for i in ids]),
                   np.array([labels[model][i] for i in ids]))
        assert got.samples_total == ref.samples_total == len(ids)
        assert pool_cells(got.filling) == pool_cells(ref.filling), model
        assert got.join.pending(model) == len(_kept(sc, model, "pending"))
