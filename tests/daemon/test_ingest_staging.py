"""Staging of small per-model slices (:mod:`daemon.staging`, :class:`daemon.ingest.Ingest`):
the pure buffer, and a broker-free daemon fed batches spread over many models, against the
same daemon with staging off (``stage_min_events=1``)."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from daemon.checkpoint.store import LocalCheckpointStore
from daemon.codes import KIND_OUTCOME, KIND_PREDICTION
from daemon.event_records import ModelBatch
from daemon.ingest import Ingest
from daemon.settings import Settings
from daemon.staging import StagedEvents, batch_nbytes
from tests.support.daemon_stubs import broker_free_daemon

K = 3
MODELS = [f"stage-m{i:02d}" for i in range(40)]


def settings(**kw) -> Settings:
    return Settings(max_models=len(MODELS) + 1,
                    defaults={"pool": 40, "mu_pool": 80, "mode": "paper", "recovery": "epochs",
                              "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                    models={m: {"k": K} for m in MODELS}, **kw)


def stream(n: int, seed: int = 0) -> list[tuple[str, int, bytes, int, float]]:
    """``n`` events over :data:`MODELS` (event ``i`` to model ``i mod 40``), as ``(topic kind,
    order, value, model number, ts)`` messages: each prediction, and its outcome 60 events
    later (one in nine outcomes comes before its prediction; one id in 50 repeats an id of
    the same model: a duplicate, or a late outcome)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(K), size=n)
    labels = rng.integers(0, K, size=n)
    msgs = []
    for i in range(n):
        j = i % len(MODELS)
        model = MODELS[j]
        eid = f"e{i - len(MODELS) if i % 50 == 49 and i >= len(MODELS) else i}"
        ts = 1e9 + i
        msgs.append(("predictions", 2 * i, orjson.dumps(
            {"model": model, "id": eid, "ts": ts, "probs": probs[i].tolist()}), j, ts))
        msgs.append(("outcomes", 2 * i + (-11 if i % 9 == 0 else 121), orjson.dumps(
            {"model": model, "id": eid, "ts": ts + 1.0, "label": int(labels[i])}), j,
            ts + 1.0))
    return sorted(msgs, key=lambda m: m[1])


def feed(d, ingest: Ingest, msgs, batch: int) -> None:
    """Process ``msgs`` as partition batches of at most ``batch`` records per topic (as
    ``getmany`` hands them out: a batch of each topic in turn), at the partition's next
    offsets."""
    t = d.s.kafka.topics
    topic = {"predictions": t.predictions, "outcomes": t.outcomes}
    positions = d.partitions.ensure(0).positions
    by_topic = {"predictions": [], "outcomes": []}
    for kind, _order, value, _j, ts in msgs:
        recs = by_topic[kind]
        offset = positions.get(topic[kind], 0) + len(recs)
        recs.append(ConsumerRecord(topic[kind], 0, offset, int(ts * 1000), 0, b"k", value,
                                   None, 0, 0, ()))
    longest = max(len(r) for r in by_topic.values())
    for a in range(0, longest, batch):
        for kind in ("predictions", "outcomes"):
            part = by_topic[kind][a:a + batch]
            if part:
                ingest.process(TopicPartition(topic[kind], 0), part)


def daemon(stage_min_events: int, **kw):
    d = broker_free_daemon(settings(), **kw)
    ing = Ingest(d.s, d.registry, d.partitions, d.parser, d.metrics, d.clients, d.deadletters,
                 stage_min_events=stage_min_events)
    return d, ing


def samples(d) -> dict[str, int]:
    return {m: s.state.samples_total for m, s in d.registry.slots.items()}


def batch(model: str, kinds: list[int], start: int, ts_limit: float = np.inf) -> ModelBatch:
    n = len(kinds)
    return ModelBatch(model, K, np.asarray(kinds, dtype=np.int8),
                      [f"id{start + i}" for i in range(n)], np.arange(start, start + n, dtype=float),
                      np.full((n, K), 1.0 / K), np.full(n, -1, dtype=np.int64),
                      np.arange(n, dtype=np.int64), ts_limit)


# ------------------------------------------------------------------ the pure buffer


def test_staged_events_keep_order_count_bytes_and_hand_out_the_oldest_first():
    s = StagedEvents(min_events=5, max_age=1.0, max_bytes=10_000)
    a1, b1, a2 = (batch("a", [KIND_PREDICTION] * 2, 0, 7.0),
                  batch("b", [KIND_OUTCOME], 10), batch("a", [KIND_OUTCOME] * 2, 2, 9.0))
    assert s.add(a1, now=0.0) is False and s.add(b1, now=0.5) is False
    assert s.add(a2, now=0.9) is False  # 4 < 5 events staged for "a"
    assert (s.count("a"), s.events, len(s)) == (4, 5, 2)
    assert s.nbytes == batch_nbytes(a1) + batch_nbytes(b1) + batch_nbytes(a2) > 0
    assert s.due(0.99) == [] and s.due(1.0) == ["a"] and s.due(1.5) == ["a", "b"]
    assert s.next_due() == 1.0
    got = s.take("a")
    assert got.slices == 2 and got.ts_limit == 9.0 and got.batch.ts_limit == 7.0
    assert got.batch.ids == ["id0", "id1", "id2", "id3"]           # arrival order
    assert got.batch.kind.tolist() == [KIND_PREDICTION] * 2 + [KIND_OUTCOME] * 2
    assert s.nbytes == batch_nbytes(b1) and s.events == 1 and "a" not in s
    # "a" comes back behind "b": its new oldest slice is younger
    s.add(batch("a", [KIND_PREDICTION], 20), now=2.0)
    assert list(s.oldest()) == ["b", "a"] and s.due(3.0) == ["b", "a"]
    assert s.add(batch("b", [KIND_PREDICTION] * 4, 30), now=2.0) is True   # 5 events: due
    with pytest.raises(ValueError, match="k=3"):
        s.add(ModelBatch("a", 0, np.zeros(1, np.int8), ["x"], np.zeros(1), np.zeros((1, 0)),
                         np.zeros(1, np.int64), np.zeros(1, np.int64)), now=2.0)
    assert s.take("nobody") is None


def test_staged_slices_are_compact_copies_counted_in_bytes():
    big = batch("a", [KIND_PREDICTION] * 1000, 0)
    view = ModelBatch("a", K, big.kind[:3], big.ids[:3], big.ts[:3], big.probs[:3],
                      big.labels[:3], big.index[:3])
    s = StagedEvents(min_events=10, max_age=1.0, max_bytes=1 << 20)
    s.add(view, now=0.0)
    got = s.take("a").batch
    assert got.probs.base is None or got.probs.base.nbytes == got.probs.nbytes
    assert not np.shares_memory(got.probs, big.probs)


# ------------------------------------------------------------------ in the daemon


@pytest.mark.parametrize("size", [7, 64, 500])
def test_staged_ingest_reaches_the_same_states_as_unstaged(size):
    msgs = stream(3000)
    staged_d, staged = daemon(256)
    plain_d, plain = daemon(1)
    feed(staged_d, staged, msgs, size)
    feed(plain_d, plain, msgs, size)
    if size < 256:  # slices of 40 models in batches of `size`: staged, not in the states yet
        assert staged.staged.events > 0
        assert sum(samples(staged_d).values()) < sum(samples(plain_d).values())
    staged.flush_staged()
    assert staged.staged.events == 0 and len(staged.staged) == 0
    assert samples(staged_d) == samples(plain_d)
    assert sum(samples(plain_d).values()) > 2000
    for m in MODELS:
        a, b = staged_d.registry.slots[m].state, plain_d.registry.slots[m].state
        assert a == b, m       # pools, window, join buffer, offsets, clocks: all of it
        assert a.join.stats(m) == b.join.stats(m)
    for name in ("lpcal_joined_samples_total", "lpcal_join_unmatched_total"):
        for labels in ({"model": MODELS[3]}, {"model": MODELS[3], "kind": "duplicate"}):
            assert (staged_d.metrics.registry.get_sample_value(name, labels)
                    == plain_d.metrics.registry.get_sample_value(name, labels))


def _waiting_rows(d) -> int:
    """Rows of small updates waiting unsummed in the monitors of ``d``'s models."""
    return sum(buf.nrows for slot in d.registry.slots.values()
               for bk in slot.state.monitor.buckets.values() for buf in bk.waiting.values())


@pytest.mark.parametrize("recovery", ["epochs", "online"])
def test_flush_staged_sums_every_changed_monitor_in_one_pass_as_each_alone(recovery):
    """Before a checkpoint, ``flush_staged`` sums the rows the models' small offers left in
    their monitors in one batched pass (``daemon.monitor.flush_waiting``); every state is then
    what summing its own rows alone gives (the unstaged daemon's monitors are summed one by
    one by their snapshots): equal to the bit."""
    def make(stage_min_events):
        s = Settings(max_models=len(MODELS) + 1,
                     defaults={"recovery": recovery, "drift_threshold": 100.0,
                               "drift_false_alarm_rate": 0.0,
                               **({"pool": 40, "mu_pool": 80, "mode": "paper"}
                                  if recovery == "epochs" else {})},
                     models={m: {"k": K} for m in MODELS})
        d = broker_free_daemon(s)
        return d, Ingest(d.s, d.registry, d.partitions, d.parser, d.metrics, d.clients,
                         d.deadletters, stage_min_events=stage_min_events)

    msgs = stream(2000, seed=4)
    (staged_d, staged), (plain_d, plain) = make(256), make(1)
    feed(staged_d, staged, msgs, 120)
    feed(plain_d, plain, msgs, 120)
    staged.flush_staged()
    assert _waiting_rows(staged_d) == 0 and _waiting_rows(plain_d) > 0
    assert sum(samples(plain_d).values()) > 1000
    for m in MODELS:
        a, b = staged_d.registry.slots[m].state, plain_d.registry.slots[m].state
        assert orjson.dumps(a.to_dict()) == orjson.dumps(b.to_dict()), m


def test_a_model_is_offered_once_its_staged_events_reach_the_threshold():
    d, ing = daemon(20)
    preds = [m for m in stream(800) if m[0] == "predictions"]
    feed(d, ing, preds[:200], 200)   # 5 per model: all staged
    assert ing.staged.events == 200 and d.registry.touched == set()
    feed(d, ing, preds[200:400], 200)   # 10 per model: staged still (< 20)
    assert ing.staged.events == 400
    feed(d, ing, preds[400:800], 400)   # 20 per model: every model offered, in one call each
    assert ing.staged.events == 0
    assert d.registry.touched == set(MODELS) and d.registry.dirty >= set(MODELS)
    duplicates = len([i for i in range(40, 800) if i % 50 == 49])
    assert sum(d.registry.slots[m].state.join.pending(m) for m in MODELS) == 800 - duplicates


def test_staged_events_wait_at_most_max_age_and_not_while_the_input_is_idle():
    now = [100.0]
    d = broker_free_daemon(settings())
    ing = Ingest(d.s, d.registry, d.partitions, d.parser, d.metrics, d.clients, d.deadletters,
                 clock=lambda: now[0], stage_max_age=2.0)
    msgs = stream(400)
    feed(d, ing, [m for m in msgs if m[3] < 20], 100)     # staged at 100.0
    now[0] = 101.0
    feed(d, ing, [m for m in msgs if m[3] >= 20], 100)    # staged at 101.0
    held = {m: ing.staged.count(m) for m in ing.staged}
    assert set(held) == set(MODELS)
    ing.flush_due(101.9)              # all younger than 2 s: they stay
    assert {m: ing.staged.count(m) for m in ing.staged} == held
    feed(d, ing, [m for m in stream(480)[800:] if m[3] >= 20], 100)  # a batch in between
    ing.flush_due(102.0)              # the models staged at 100.0 went in, only they
    assert set(ing.staged) == set(MODELS[20:])
    assert all(d.registry.slots[m].state.samples_total > 0 for m in MODELS[:20])
    ing.flush_due(102.5)              # no batch since the last poll: idle, all of it
    assert ing.staged.events == 0 and len(ing.staged) == 0


def test_staged_bytes_stay_within_their_budget():
    s = Settings(max_models=len(MODELS) + 1, join={"max_bytes_total": 1 << 20},
                 defaults={"pool": 40, "mu_pool": 80, "mode": "paper", "recovery": "epochs",
                           "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                 models={m: {"k": K} for m in MODELS})
    d, plain_d = broker_free_daemon(s), broker_free_daemon(s)
    plain = Ingest(plain_d.s, plain_d.registry, plain_d.partitions, plain_d.parser,
                   plain_d.metrics, plain_d.clients, plain_d.deadletters, stage_min_events=1)
    ing = d.ingest
    assert ing.staged.max_bytes == (1 << 20) // 8
    preds = [m for m in stream(6000) if m[0] == "predictions"]
    peak = 0
    for a in range(0, len(preds), 200):
        feed(d, ing, preds[a:a + 200], 200)
        feed(plain_d, plain, preds[a:a + 200], 200)
        peak = max(peak, ing.staged.nbytes)
    assert ing.staged.max_bytes // 2 < peak <= ing.staged.max_bytes
    ing.flush_staged()
    for m in MODELS:
        assert d.registry.slots[m].state == plain_d.registry.slots[m].state
    assert all(d.registry.slots[m].state.join.pending(m) >= 1 for m in MODELS)


def test_a_checkpoint_and_a_release_offer_the_staged_events_first(tmp_path):
    d = broker_free_daemon(settings(), store=LocalCheckpointStore(tmp_path))
    msgs = stream(1600)
    feed(d, d.ingest, msgs[:1600], 100)
    assert d.ingest.staged.events > 0
    asyncio.run(d.checkpointer.commit(commit_offsets=False))
    assert d.ingest.staged.events == 0
    saved = asyncio.run(LocalCheckpointStore(tmp_path).load_all())
    assert {f"model/{m}" for m in MODELS} <= set(saved)
    # the checkpoint holds every event fed: the same states as an unstaged run
    plain_d, plain = daemon(1)
    feed(plain_d, plain, msgs[:1600], 100)
    for m in MODELS:
        a, b = d.registry.slots[m].state, plain_d.registry.slots[m].state
        assert a.samples_total == b.samples_total and a.join.stats(m) == b.join.stats(m)
    # a revocation whose checkpoint fails: the staged events go into the parked states
    down = broker_free_daemon(settings(), store=_Unwritable())
    feed(down, down.ingest, msgs, 100)
    assert down.ingest.staged.events > 0
    before = sum(samples(down).values())
    asyncio.run(down.on_revoked(set(down.partitions.assigned)))
    assert down.ingest.staged.events == 0 and len(down.registry) == 0
    assert sum(s.state.samples_total for s in down.registry.parked.values()) > before


class _Unwritable(LocalCheckpointStore):
    """A checkpoint store whose saves fail (the broker is down)."""

    def __init__(self):
        pass

    async def load_all(self) -> dict[str, bytes]:
        return {}

    async def save(self, records) -> None:
        raise OSError("checkpoint store unreachable (stand-in)")

    def where(self, key: str) -> str:
        return key
