"""Pacing of the staging age (:class:`daemon.staging.StagePacing`, wired in
:class:`daemon.ingest.Ingest`): the age after which a model's small staged slices are offered
grows with the staged models and the measured cost of a staged offer, within a share of the
time and a longest wait; the states (and checkpoints) are those of unpaced and of unstaged
ingest. Driven by an injected clock (no timing)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from daemon.checkpoint.store import LocalCheckpointStore
from daemon.ingest import STAGE_MAX_AGE, Ingest
from daemon.settings import Settings
from daemon.staging import DEFAULT_MAX_SHARE, DEFAULT_MAX_WAIT, StagePacing
from tests.daemon.test_ingest_staging import MODELS, K, stream
from tests.support.daemon_stubs import broker_free_daemon

# ------------------------------------------------------------------ the pure rule


def test_cheap_or_few_offers_keep_the_base_age():
    p = StagePacing(5.0, 0.1, 60.0)
    assert p.enabled and p.mean_cost == 0.0 and p.age(10_000) == 5.0   # nothing measured yet
    p.record(10.0, offers=10_000)                                       # 1 ms per offer
    assert p.mean_cost == pytest.approx(0.001)
    assert p.age(1) == 5.0 and p.age(100) == 5.0 and p.age(500) == 5.0  # 500 x 1 ms / 0.1 = 5
    assert p.age(0) == 5.0


def test_the_age_grows_with_models_and_cost_and_stops_at_max_wait():
    p = StagePacing(5.0, 0.1, 60.0)
    p.record(0.8, offers=1000)   # 0.8 ms per offer, well past the weight's memory: the mean
    assert p.mean_cost == pytest.approx(0.0008)
    assert p.age(1000) == pytest.approx(8.0)       # 1000 x 0.8 ms / 0.1
    assert p.age(5000) == pytest.approx(40.0)
    assert p.age(10_000) == 60.0                   # 80 s wanted, max_wait
    # the offers of small slices stay within the share while the age is not clamped
    for models in (1000, 5000):
        assert models * p.mean_cost / p.age(models) == pytest.approx(0.1)
    # a larger share: shorter ages
    q = StagePacing(5.0, 0.4, 60.0)
    q.record(0.8, offers=1000)
    assert q.age(5000) == pytest.approx(10.0)


def test_a_max_wait_at_or_below_the_base_age_turns_pacing_off():
    for wait in (0.0, 2.0, 5.0):
        p = StagePacing(5.0, 0.1, wait)
        p.record(1.0, offers=100)       # 10 ms per offer: 10,000 models would want 1000 s
        assert not p.enabled and p.max_wait == 5.0 and p.age(10_000) == 5.0


def test_the_mean_cost_is_an_exponentially_weighted_mean_per_offer():
    a, b = StagePacing(5.0, weight=0.25), StagePacing(5.0, weight=0.25)
    a.record(0.004)
    assert a.mean_cost == pytest.approx(0.001)     # a quarter of the way from 0
    for _ in range(3):
        b.record(0.002)
    c = StagePacing(5.0, weight=0.25)
    c.record(0.006, offers=3)                      # 3 offers of 2 ms each, in one call
    assert c.mean_cost == pytest.approx(b.mean_cost)
    before = c.mean_cost
    for bad in (-1.0, math.nan, math.inf):
        c.record(bad)
    c.record(1.0, offers=0)
    assert c.mean_cost == before                   # clock jumps and empty records ignored
    # it follows the load: a cheaper calibrator brings the age back down
    d = StagePacing(5.0, 0.1, 60.0)
    d.record(1.6, offers=2000)                     # 0.8 ms per offer
    assert d.age(2000) == pytest.approx(16.0)
    d.record(0.1, offers=2000)                     # 50 us per offer
    assert d.age(2000) == 5.0


def test_defaults_and_bad_parameters():
    p = StagePacing(STAGE_MAX_AGE)
    assert (p.max_share, p.max_wait) == (DEFAULT_MAX_SHARE, DEFAULT_MAX_WAIT) == (0.1, 60.0)
    s = Settings()
    assert s.join.staging_max_cpu_share == DEFAULT_MAX_SHARE
    assert s.join.staging_max_wait_seconds == DEFAULT_MAX_WAIT
    assert Settings(join={"staging_max_wait_seconds": 0}).join.staging_max_wait_seconds == 0
    for bad in ({"staging_max_cpu_share": 0}, {"staging_max_cpu_share": 1.5},
                {"staging_max_wait_seconds": -1}, {"staging_max_wait_seconds": math.inf}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(join=bad)
    for kw in ({"base_age": -1.0}, {"max_share": 0.0}, {"max_share": 1.5},
               {"max_share": math.nan}, {"max_wait": -1.0}, {"max_wait": math.inf},
               {"weight": 0.0}):
        args = {"base_age": 5.0, **kw}
        with pytest.raises(ValueError, match="StagePacing"):
            StagePacing(**args)


# ------------------------------------------------------------------ in the daemon


class TickingClock:
    """A clock that advances ``tick`` seconds at every reading (each staged offer then
    measures ``tick``), and by hand between polls."""

    def __init__(self, t: float = 1000.0, tick: float = 0.0):
        self.t, self.tick = t, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def online_settings(**join) -> Settings:
    return Settings(max_models=len(MODELS) + 1,
                    defaults={"recovery": "online", "drift_threshold": 100.0,
                              "drift_false_alarm_rate": 0.0},
                    models={m: {"k": K} for m in MODELS}, join=join)


def make(clock, tmp_path=None, stage_min_events=256, **join):
    d = broker_free_daemon(online_settings(**join),
                           **({"store": LocalCheckpointStore(tmp_path)} if tmp_path else {}))
    ing = Ingest(d.s, d.registry, d.partitions, d.parser, d.metrics, d.clients, d.deadletters,
                 clock=clock, stage_min_events=stage_min_events)
    d.ingest = ing
    d.checkpointer.flush_staged = ing.flush_staged
    return d, ing


def records(d, msgs) -> list[tuple[str, list]]:
    """``msgs`` as partition batches of 60 records of one topic at a time, at offsets from 0."""
    t = d.s.kafka.topics
    topic = {"predictions": t.predictions, "outcomes": t.outcomes}
    by_topic: dict[str, list] = {"predictions": [], "outcomes": []}
    for kind, _order, value, _j, ts in msgs:
        recs = by_topic[kind]
        recs.append(ConsumerRecord(topic[kind], 0, len(recs), int(ts * 1000), 0, b"k", value,
                                   None, 0, 0, ()))
    out = []
    for a in range(0, max(len(r) for r in by_topic.values()), 60):
        for kind in ("predictions", "outcomes"):
            if by_topic[kind][a:a + 60]:
                out.append((topic[kind], by_topic[kind][a:a + 60]))
    return out


def run(d, ing, clock, batches, seconds_per_poll=1.0) -> list[int]:
    """Each batch as one poll ``seconds_per_poll`` after the last; the staged events after
    each poll."""
    held = []
    for topic, recs in batches:
        ing.process(TopicPartition(topic, 0), recs)
        clock.t += seconds_per_poll
        ing.flush_due(clock())
        held.append(ing.staged.events)
    return held


def test_expensive_staged_offers_raise_the_age_and_the_gauge_shows_it():
    clock = TickingClock(tick=0.02)   # every staged offer measures 20 ms
    d, ing = make(clock, staging_max_cpu_share=0.05, staging_max_wait_seconds=30.0)
    assert ing.pacing.max_share == 0.05 and ing.pacing.max_wait == 30.0
    batches = records(d, stream(2400, seed=3))
    run(d, ing, clock, batches[:40])
    assert 0.015 < ing.pacing.mean_cost <= 0.02   # from 0 towards the 20 ms measured
    # 40 models x ~20 ms / 0.05 = ~16 s
    assert len(ing.staged) == len(MODELS)
    assert ing.stage_age == pytest.approx(len(MODELS) * ing.pacing.mean_cost / 0.05)
    assert 5.0 < ing.stage_age <= 30.0
    gauge = d.metrics.registry.get_sample_value("lpcal_staging_age_seconds")
    assert gauge == pytest.approx(ing.stage_age, rel=0.2) and gauge > 5.0
    # cheap offers (the default share, a fast clock): the base age, shown as 5
    clock2 = TickingClock(tick=0.0001)
    d2, ing2 = make(clock2)
    run(d2, ing2, clock2, batches[:40])
    assert ing2.stage_age == STAGE_MAX_AGE
    assert d2.metrics.registry.get_sample_value("lpcal_staging_age_seconds") == 5.0


def test_paced_ingest_offers_less_often_and_reaches_the_same_checkpoints(tmp_path):
    """The same stream, with pacing on (the age grows to 30 s), off (max_wait 5: always 5 s)
    and without staging: the paced daemon holds more events between polls, and after a
    checkpoint every model's record is the same, byte for byte but its wall-clock ``saved_at``, in the three (online
    calibrator: the default recovery)."""
    msgs = stream(3000, seed=5)
    runs = {}
    for name, join, min_events in (("paced", {"staging_max_cpu_share": 0.05,
                                              "staging_max_wait_seconds": 30.0}, 256),
                                   ("unpaced", {"staging_max_wait_seconds": 5.0}, 256),
                                   ("unstaged", {}, 1)):
        clock = TickingClock(tick=0.02)
        path = tmp_path / name
        path.mkdir()
        d, ing = make(clock, path, stage_min_events=min_events, **join)
        held = run(d, ing, clock, records(d, msgs))
        runs[name] = (d, ing, held, path)
    paced, unpaced, unstaged = (runs[n] for n in ("paced", "unpaced", "unstaged"))
    assert max(unstaged[2]) == 0
    assert unpaced[1].stage_age == 5.0 and paced[1].stage_age > 10.0
    # the paced daemon waited longer: more events held, fewer staged offers
    assert sum(paced[2]) > 1.5 * sum(unpaced[2]) > 0
    assert paced[1].staged.events > 0
    for d, *_ in runs.values():
        asyncio.run(d.checkpointer.commit(commit_offsets=False))
    saved = {n: asyncio.run(LocalCheckpointStore(r[3]).load_all()) for n, r in runs.items()}
    assert paced[1].staged.events == 0      # the checkpoint offered them first
    models = {f"model/{m}" for m in MODELS}
    assert models <= set(saved["paced"])
    assert sum(s.state.samples_total for s in paced[0].registry.slots.values()) > 2000
    for key in sorted(models):
        assert (without_saved_at(saved["paced"][key]) == without_saved_at(saved["unpaced"][key])
                == without_saved_at(saved["unstaged"][key])), key
    for m in MODELS:
        a, b = paced[0].registry.slots[m].state, unstaged[0].registry.slots[m].state
        assert orjson.dumps(a.to_dict()) == orjson.dumps(b.to_dict()), m
        # the checkpoint's offsets cover every event fed, none of them staged any more
        assert a.offsets == b.offsets and a.offsets


def without_saved_at(record: bytes) -> bytes:
    """A model's checkpoint record without its wall-clock ``saved_at`` (the only field that
    differs between two runs), re-encoded with the same key order."""
    env = orjson.loads(record)
    assert isinstance(env.pop("saved_at"), float)
    return orjson.dumps(env)


def test_an_idle_poll_still_offers_everything_whatever_the_age():
    clock = TickingClock(tick=0.05)
    d, ing = make(clock, staging_max_cpu_share=0.01, staging_max_wait_seconds=600.0)
    batches = records(d, stream(1200, seed=6))
    run(d, ing, clock, batches[:30])
    assert ing.stage_age > 60.0 and ing.staged.events > 0
    ing.flush_due(clock())          # no batch since the last poll: the input is idle
    assert ing.staged.events == 0 and len(ing.staged) == 0


def test_the_age_pays_only_for_the_fixed_part_of_an_offer():
    """Offers whose cost grows with their events (``a + b x events``): the age follows the
    intercept ``a``, what a longer age saves, not the mean cost, which the per-event part
    inflates as ages grow and offers get larger."""
    rng = np.random.default_rng(5)
    p = StagePacing(5.0, 0.1, 600.0)
    for n in rng.integers(1, 256, 3000).tolist():
        p.record(3e-4 + 2e-6 * n, events=n)
    assert p.mean_cost == pytest.approx(3e-4 + 2e-6 * 128, rel=0.1)   # per-event part in it
    assert p.fixed_cost == pytest.approx(3e-4, rel=1e-6)
    assert p.age(10_000) == pytest.approx(10_000 * 3e-4 / 0.1, rel=1e-6)      # 30 s, not ~56
    assert p.age(10_000) < 10_000 * p.mean_cost / 0.1 * 0.6


def test_without_varying_event_counts_the_whole_mean_cost_is_fixed():
    same, unknown, falling = (StagePacing(5.0, 0.1, 600.0) for _ in range(3))
    for n in range(1, 200):
        same.record(1e-3, events=40)              # the counts do not vary: nothing to split
        unknown.record(1e-3 + 1e-5 * n)           # no counts given
        falling.record(2e-3 - 5e-6 * n, events=n)  # cost falls with events: noise, all fixed
    for p in (same, unknown, falling):
        assert p.fixed_cost == p.mean_cost and p.fixed_share == 1.0
    free = StagePacing(5.0, 0.1, 600.0)
    for n in range(1, 200):
        free.record(1e-5 * n, events=n)          # no fixed part: the base age
    assert free.fixed_cost == pytest.approx(0.0, abs=1e-12) and free.age(10_000) == 5.0
