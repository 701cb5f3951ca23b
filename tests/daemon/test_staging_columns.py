"""Staging in columns (:class:`daemon.staging.StagedEvents` chunks, the grouped route of
:class:`daemon.ingest.Ingest`): many models in interleaved batches reach, model by model, the
states and checkpoints of each model fed alone without staging; a model's events keep their
arrival order through chunk merges, compactions and partial takes."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from daemon.codes import KIND_OUTCOME, KIND_PREDICTION
from daemon.event_records import GroupedBatch
from daemon.events import EventParser, ModelPolicy
from daemon.ingest import Ingest
from daemon.settings import Settings
from daemon.staging import StagedEvents, batch_nbytes
from tests.support.daemon_stubs import broker_free_daemon

K = 3
MODELS = [f"col-m{i:03d}" for i in range(150)]


def settings(recovery: str) -> Settings:
    return Settings(max_models=len(MODELS) + 1,
                    defaults={"recovery": recovery, "drift_threshold": 100.0,
                              "drift_false_alarm_rate": 0.0,
                              **({"pool": 40, "mu_pool": 80, "mode": "paper"}
                                 if recovery == "epochs" else {})},
                    models={m: {"k": K} for m in MODELS})


def stream(n: int, seed: int) -> list[tuple[str, int, bytes, str, float]]:
    """``n`` predictions over :data:`MODELS`, a few models much busier than the others (their
    slices of a batch exceed the staging threshold), each with its outcome 37 events later
    (one in seven before its prediction; one id in 40 repeated): ``(topic kind, order,
    value, model, ts)``."""
    rng = np.random.default_rng(seed)
    weights = np.r_[np.full(3, 40.0), np.ones(len(MODELS) - 3)]
    which = rng.choice(len(MODELS), size=n, p=weights / weights.sum())
    probs = rng.dirichlet(np.ones(K), size=n)
    labels = rng.integers(0, K, size=n)
    msgs = []
    for i in range(n):
        model = MODELS[which[i]]
        eid = f"e{i - 7 if i % 40 == 39 else i}"
        ts = 1e9 + i
        msgs.append(("predictions", 2 * i, orjson.dumps(
            {"model": model, "id": eid, "ts": ts, "probs": probs[i].tolist()}), model, ts))
        msgs.append(("outcomes", 2 * i + (-9 if i % 7 == 0 else 75), orjson.dumps(
            {"model": model, "id": eid, "ts": ts + 1.0, "label": int(labels[i])}), model,
            ts + 1.0))
    return sorted(msgs, key=lambda m: m[1])


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(recovery: str, stage_min_events: int, clock=None):
    d = broker_free_daemon(settings(recovery))
    ing = Ingest(d.s, d.registry, d.partitions, d.parser, d.metrics, d.clients, d.deadletters,
                 stage_min_events=stage_min_events, stage_max_age=3.0,
                 **({} if clock is None else {"clock": clock}))
    return d, ing


def batches(msgs, sizes) -> list[tuple[str, list]]:
    """``msgs`` as partition batches (``sizes`` records each, in turn) of each topic in turn:
    ``(topic kind, [(value, ts, model), ...])``."""
    by_topic: dict[str, list] = {"predictions": [], "outcomes": []}
    for kind, _order, value, model, ts in msgs:
        by_topic[kind].append((value, ts, model))
    out, pos, j = [], {"predictions": 0, "outcomes": 0}, 0
    while any(pos[k] < len(by_topic[k]) for k in pos):
        for kind in ("predictions", "outcomes"):
            size = sizes[j % len(sizes)]
            j += 1
            part = by_topic[kind][pos[kind]:pos[kind] + size]
            pos[kind] += size
            if part:
                out.append((kind, part))
    return out


def feed(d, ing: Ingest, batch_list, clock=None) -> int:
    """Process the batches at the partition's next offsets; with ``clock``, a poll one second
    after each batch (:meth:`Ingest.flush_due`). Returns the batches that went through the
    grouped route."""
    t = d.s.kafka.topics
    topic = {"predictions": t.predictions, "outcomes": t.outcomes}
    positions = d.partitions.ensure(0).positions
    grouped = 0
    for kind, part in batch_list:
        start = positions.get(topic[kind], 0)
        recs = [ConsumerRecord(topic[kind], 0, start + i, int(ts * 1000), 0, b"k", value,
                               None, 0, 0, ()) for i, (value, ts, _m) in enumerate(part)]
        pb = d.parser.parse_batch([r.value for r in recs])  # what the route will see
        grouped += pb.grouped is not None and len(pb.grouped.models) > 1
        ing.process(TopicPartition(topic[kind], 0), recs)
        if clock is not None:
            clock.t += 1.0
            ing.flush_due(clock())
    return grouped


def state_bytes(d) -> dict[str, bytes]:
    return {m: orjson.dumps(s.state.to_dict()) for m, s in d.registry.slots.items()}


@pytest.mark.parametrize("recovery", ["epochs", "online"])
def test_interleaved_models_reach_the_states_of_each_model_fed_alone(recovery):
    msgs = stream(6000, seed=11)
    clock = Clock()
    staged_d, staged = make(recovery, 20, clock)
    schedule = batches(msgs, [300, 1000, 45, 2000])
    grouped = feed(staged_d, staged, schedule, clock)
    assert grouped > 10                      # the columnar route did the work
    assert staged.staged.events > 0          # small slices still staged
    staged.flush_staged()
    assert staged.staged.events == 0 and staged.staged.nbytes == 0
    # each model alone, unstaged: its own messages of each batch, as a batch of its own
    alone_d, alone = make(recovery, 1)
    for m in MODELS:
        feed(alone_d, alone, [(kind, mine) for kind, part in schedule
                              if (mine := [r for r in part if r[2] == m])])
    a, b = state_bytes(staged_d), state_bytes(alone_d)
    assert set(a) == set(MODELS) == set(b)
    assert sum(s.state.samples_total for s in staged_d.registry.slots.values()) > 4000
    for m in MODELS:
        assert a[m] == b[m], m


def test_the_byte_budget_and_ages_keep_the_states_of_unstaged_ingest():
    """A small staging budget (flushes of the oldest models, compactions) and no polls: every
    model's state is that of the same batches unstaged."""
    msgs = stream(5000, seed=3)
    staged_d, staged = make("epochs", 20)
    staged.staged.max_bytes = 12_000
    plain_d, plain = make("epochs", 1)
    peak = 0
    for a in range(0, len(msgs), 500):
        feed(staged_d, staged, batches(msgs[a:a + 500], [250, 90]))
        feed(plain_d, plain, batches(msgs[a:a + 500], [250, 90]))
        peak = max(peak, staged.staged.nbytes)
        assert staged.staged.nbytes <= staged.staged.max_bytes
        assert staged.staged.live_nbytes <= staged.staged.nbytes
    assert peak > staged.staged.max_bytes // 2
    staged.flush_staged()
    a, b = staged_d.registry.slots, plain_d.registry.slots
    assert set(a) == set(b) == set(MODELS)
    for m in MODELS:
        x, y = a[m].state.to_dict(), b[m].state.to_dict()
        # the monitor's float sums may differ in their last bit with how the rows were
        # grouped into offers (as with the per-model staging before; the monitor's own
        # matter): everything else to the byte, those to 1e-12
        mx, my = x.pop("monitor"), y.pop("monitor")
        assert orjson.dumps(x) == orjson.dumps(y), m
        assert_close(mx, my, m)


def assert_close(x, y, where: str) -> None:
    """``x == y`` (JSON-like), floats and base64 float64 arrays to a relative 1e-12."""
    if isinstance(x, dict) and isinstance(x.get("b64"), str):
        import base64
        u = np.frombuffer(base64.b64decode(x["b64"]), dtype=np.float64)
        v = np.frombuffer(base64.b64decode(y["b64"]), dtype=np.float64)
        assert u.shape == v.shape and np.allclose(u, v, rtol=1e-12, atol=0), where
    elif isinstance(x, dict):
        assert set(x) == set(y), where
        for key in x:
            assert_close(x[key], y[key], f"{where}/{key}")
    elif isinstance(x, list):
        assert len(x) == len(y), where
        for i, (p, q) in enumerate(zip(x, y)):
            assert_close(p, q, f"{where}[{i}]")
    elif isinstance(x, float):
        assert x == pytest.approx(y, rel=1e-12, abs=0), where
    else:
        assert x == y, where


# ------------------------------------------------------------------ the pure buffer


def grouped(rows: list[tuple[str, str]], ts_limit: float) -> GroupedBatch:
    """A grouped batch of ``(model, id)`` rows (given in input order), in model order."""
    models = list(dict.fromkeys(m for m, _ in rows))
    code = {m: c for c, m in enumerate(models)}
    codes = np.array([code[m] for m, _ in rows])
    order = np.argsort(codes, kind="stable")
    n = len(rows)
    bounds = np.searchsorted(codes[order], np.arange(len(models) + 1))
    ids = [rows[i][1] for i in order.tolist()]
    probs = np.random.default_rng(n).dirichlet(np.ones(K), size=n)
    kind = np.where(np.arange(n) % 3 == 0, KIND_OUTCOME, KIND_PREDICTION).astype(np.int8)
    return GroupedBatch(models, K, bounds.astype(np.int64), kind, ids,
                        np.arange(n, dtype=np.float64), probs,
                        np.full(n, -1, dtype=np.int64), order.astype(np.int64),
                        np.full(len(models), ts_limit))


def test_arrival_order_within_a_model_survives_merges_compactions_and_partial_takes():
    rng = np.random.default_rng(7)
    names = [f"m{i}" for i in range(30)]
    s = StagedEvents(min_events=10 ** 9, max_age=1.0, max_bytes=1 << 30)
    seq = 0
    expected: dict[str, list[str]] = {}
    taken: dict[str, list[str]] = {m: [] for m in names}
    for step in range(120):
        n = int(rng.integers(1, 80))
        rows = []
        for m in rng.choice(names, size=n).tolist():
            rows.append((m, f"{m}:{seq:06d}"))
            seq += 1
        g = grouped(rows, float(step))
        stage = rng.random(len(g.models)) < 0.9
        s.add_grouped(g, stage, s.codes(g.models), now=float(step))
        for c in np.flatnonzero(stage).tolist():
            a, b = g.bounds[c], g.bounds[c + 1]
            expected.setdefault(g.models[c], []).extend(g.ids[a:b])
        assert s.events == sum(map(len, expected.values()))
        if step % 7 == 3:   # take a few models, oldest and not
            some = [m for m in rng.choice(names, size=5, replace=False).tolist() if m in s]
            for m, st in s.take_many(some):
                assert st.batch.model == m and st.batch.ts_limit <= st.ts_limit
                taken[m].extend(st.batch.ids)
                assert st.batch.ids == expected.pop(m), m
        assert s.nbytes >= s.live_nbytes
    assert len(s._chunks) < 20                                   # merged as they came
    s.compact()
    assert s.nbytes == s.live_nbytes == sum(s.model_nbytes(m) for m in s)
    for m, st in s.take_many(list(s.oldest())):
        assert st.batch.ids == expected.pop(m)
        assert sorted(st.batch.ids) == st.batch.ids             # arrival order: ids ascend
        assert len(st.batch.kind) == len(st.batch.ts) == len(st.batch.probs) == len(st.batch)
    assert not expected and s.events == 0 and s.nbytes == 0 and len(s) == 0
    assert any(taken.values())


def test_a_take_returns_each_rows_columns_with_its_id():
    """The columns of a taken row are those staged with its id (not a neighbour's)."""
    s = StagedEvents(min_events=100, max_age=1.0, max_bytes=1 << 20)
    rows = [("a", "a0"), ("b", "b0"), ("a", "a1"), ("c", "c0"), ("b", "b1")]
    g = grouped(rows, 5.0)
    s.add_grouped(g, np.ones(3, dtype=bool), s.codes(g.models), now=0.0)
    g2 = grouped([("b", "b2"), ("a", "a2")], 9.0)
    s.add_grouped(g2, np.ones(2, dtype=bool), s.codes(g2.models), now=1.0)
    want = {}
    for gg in (g, g2):
        for c, m in enumerate(gg.models):
            mb = gg.model_batch(c)
            for j, i in enumerate(mb.ids):
                want[i] = (m, int(mb.kind[j]), float(mb.ts[j]), mb.probs[j].tolist())
    got = dict(s.take_many(["b", "a", "c"]))
    assert list(got) == ["b", "a", "c"]
    for m, st in got.items():
        mb = st.batch
        assert mb.ids == sorted(mb.ids)
        for j, i in enumerate(mb.ids):
            assert want[i] == (m, int(mb.kind[j]), float(mb.ts[j]), mb.probs[j].tolist())
    assert got["a"].ts_limit == 9.0 and got["a"].batch.ts_limit == 5.0
    assert got["c"].ts_limit == 5.0 and got["c"].slices == 1 and got["a"].slices == 2


def test_grouped_batches_count_the_bytes_of_their_rows():
    s = StagedEvents(min_events=100, max_age=1.0, max_bytes=1 << 20)
    g = grouped([("a", "x" * 10), ("b", "y"), ("a", "zz")], math.inf)
    s.add_grouped(g, np.ones(2, dtype=bool), s.codes(g.models), now=0.0)
    assert s.nbytes == sum(batch_nbytes(g.model_batch(c)) for c in range(2))
    assert s.model_nbytes("a") == batch_nbytes(g.model_batch(0))
    assert s.model_nbytes("b") == batch_nbytes(g.model_batch(1))


def test_the_parser_leaves_a_batch_of_many_models_in_columns_and_by_model_the_same():
    p = EventParser(lambda m: ModelPolicy(k=K))
    raws = [orjson.dumps({"model": f"m{i % 5}", "id": f"e{i}", "ts": 1.0 + i,
                          "probs": [0.2, 0.3, 0.5]}) for i in range(40)]
    raws[7] = orjson.dumps({"model": "m2", "id": "bad", "ts": 1.0, "probs": [0.2, -0.3, 1.1]})
    pb = p.parse_batch(raws, [100.0] * 40)
    g = pb.grouped
    assert g is not None and g.models == [f"m{i}" for i in range(5)]
    assert [i for i, _ in pb.invalid] == [7]
    assert g.counts().tolist() == [8, 8, 7, 8, 8]
    by = pb.by_model                                 # made from the columns on first use
    assert pb.grouped is None and list(by) == g.models
    assert by["m2"].ids == [f"e{i}" for i in range(2, 40, 5) if i != 7]
    assert by["m2"].index.tolist() == [i for i in range(2, 40, 5) if i != 7]


# ------------------------------------------------------------------ routing facts kept per model


def records(d, part, start: int) -> tuple[TopicPartition, list]:
    """``part`` (``(topic kind, [(value, ts, model)])``) as records from offset ``start``."""
    kind, rows = part
    topic = getattr(d.s.kafka.topics, kind)
    return TopicPartition(topic, 0), [
        ConsumerRecord(topic, 0, start + i, int(ts * 1000), 0, b"k", value, None, 0, 0, ())
        for i, (value, ts, _m) in enumerate(rows)]


def test_a_batch_read_again_below_the_recorded_offsets_is_skipped():
    """A seek back (the batch does not start at the partition's position) after a checkpoint
    recorded the offsets: the models' facts found earlier are not trusted, every event below
    a model's recorded offset is skipped, whatever the grouped route knew."""
    msgs = stream(3000, seed=8)
    d, ing = make("epochs", 20)
    schedule = batches(msgs, [500])
    preds = [b for b in schedule if b[0] == "predictions"]
    for i, part in enumerate(preds):
        ing.process(*records(d, part, 500 * i))
    ing.flush_staged()
    pos = d.partitions.position(d.s.kafka.topics.predictions, 0)
    assert pos == 3000
    for slot in d.registry.slots.values():     # what a checkpoint records
        slot.state.advance_offsets(d.s.kafka.topics.predictions, 0, pos)
    before = state_bytes(d)
    grouped_before = ing._routable_gen
    for i, part in enumerate(preds[:3]):        # read again from offset 0
        ing.process(*records(d, part, 500 * i))
    ing.flush_staged()
    assert ing._routable_gen == grouped_before   # no registry change: only the seek back
    assert state_bytes(d) == before
    # a new batch past them goes in
    ing.process(*records(d, preds[0], pos))
    ing.flush_staged()
    assert state_bytes(d) != before


def test_a_state_put_in_place_is_checked_again():
    """A state put in place of another (a restore) with offsets ahead of the next batch: the
    registry's generation makes the route check the model again, and its events below the
    recorded offset are skipped (the other models' are not)."""
    msgs = stream(2000, seed=9)
    d, ing = make("epochs", 20)
    preds = [b for b in batches(msgs, [400]) if b[0] == "predictions"]
    for i, part in enumerate(preds[:3]):
        ing.process(*records(d, part, 400 * i))
    ing.flush_staged()
    topic = d.s.kafka.topics.predictions
    in_next = [r[2] for r in preds[3][1]]
    light = next(m for m in in_next if m not in MODELS[:3])
    victims = [MODELS[1], light]          # a slice offered at once, and a staged one
    assert in_next.count(MODELS[1]) >= 20 and 0 < in_next.count(light) < 20
    mine = {}
    for victim in victims:
        old = d.registry.slots[victim].state
        restored = type(old).from_dict(old.to_dict())
        restored.advance_offsets(topic, 0, 400 * 4)      # covers the next batch
        d.registry.place(victim, restored, 0)
        mine[victim] = orjson.dumps(restored.to_dict())
    others = {m: b for m, b in state_bytes(d).items() if m not in victims}
    ing.process(*records(d, preds[3], 400 * 3))
    ing.flush_staged()
    for victim in victims:
        assert orjson.dumps(d.registry.slots[victim].state.to_dict()) == mine[victim]
    after = {m: b for m, b in state_bytes(d).items() if m not in victims}
    assert any(after[m] != others[m] for m in others)
