"""Per-model ``sample_rate``: deterministic hash sampling before the join.

An event is kept iff ``u = route_uniform([id]) < sample_rate``; kept samples are routed to the
pools with ``u / sample_rate``. The daemon drops most sampled-out events on their raw bytes
(``daemon._speedups.sample_out``) and the rest in ``ModelState.offer`` (the reference)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from daemon import native
from daemon.codes import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE
from daemon.event_records import ModelBatch
from daemon.events import EventParser
from daemon.model_state import ModelState
from daemon.native import route_uniform_fast
from daemon.settings import Settings
from daemon.tools.simulate.model import SyntheticModel
from lpcal.metrics import brier_true, err_p_true
from lpcal.pools import route_uniform

MODEL, K = "hot", 3
RATE = 0.1


def settings(rate: float = RATE, **defaults) -> Settings:
    return Settings(defaults={"pool": 200, "mu_pool": 200, "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0,
                              "mode": "paper", **defaults},
                    models={MODEL: {"k": K, "sample_rate": rate}})


def state(s: Settings) -> ModelState:
    return ModelState.create(MODEL, K, s.model_settings(MODEL), s.join)


def batch(kind: int, ids: list[str], probs: np.ndarray | None, labels: np.ndarray | None,
          ts0: float = 0.0) -> ModelBatch:
    n = len(ids)
    return ModelBatch(MODEL, K, np.full(n, kind, dtype=np.int8), list(ids),
                      ts0 + np.arange(n, dtype=np.float64),
                      np.zeros((n, K)) if probs is None else np.asarray(probs, dtype=np.float64),
                      np.full(n, -1, dtype=np.int64) if labels is None else labels,
                      np.arange(n, dtype=np.int64))


def stream(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = [f"ev-{seed}-{i}" for i in range(n)]
    return ids, rng.dirichlet(np.ones(K), size=n), rng.integers(0, K, size=n)


def test_settings_validate_the_rate():
    assert Settings().defaults.sample_rate == 1.0
    assert settings(0.25).model_settings(MODEL).sample_rate == 0.25
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            Settings(defaults={"sample_rate": bad})


def test_decision_is_a_deterministic_function_of_the_id():
    st = state(settings())
    ids, probs, labels = stream(5000)
    mb = batch(KIND_SAMPLE, ids, probs, labels)
    kept1, dropped1 = st.sample(mb)
    kept2, _ = state(settings()).sample(mb)
    u = route_uniform(ids)
    assert kept1.ids == kept2.ids == [i for i, x in zip(ids, u) if x < RATE]
    assert dropped1 == int((u >= RATE).sum())
    assert 0.08 < len(kept1) / len(ids) < 0.12
    # rate 1: nothing dropped, the batch passes through untouched
    full = state(settings(1.0))
    assert full.sample(mb) == (mb, 0)


@pytest.mark.parametrize("outcomes_first", [False, True])
def test_prediction_and_outcome_are_kept_or_dropped_together(outcomes_first):
    st = state(settings())
    ids, probs, labels = stream(4000, seed=1)
    preds = batch(KIND_PREDICTION, ids, probs, None)
    outs = batch(KIND_OUTCOME, ids, None, labels, ts0=1.0)
    first, second = (outs, preds) if outcomes_first else (preds, outs)
    r1, r2 = st.offer(first), st.offer(second)
    kept = int((route_uniform(ids) < RATE).sum())
    assert r1.joined + r2.joined == kept
    assert r1.sampled_out == r2.sampled_out == len(ids) - kept
    assert st.join.pending(MODEL) == 0
    assert not any(r1.unmatched.values()) and not any(r2.unmatched.values())


def test_replay_and_batching_give_identical_pools_routed_over_all_pools():
    s = settings()
    ids, probs, labels = stream(30_000, seed=2)
    a, b = state(s), state(s)
    a.offer(batch(KIND_SAMPLE, ids, probs, labels))
    for lo in range(0, len(ids), 777):  # another batching, as a replay after a crash
        sl = slice(lo, lo + 777)
        b.offer(batch(KIND_SAMPLE, ids[sl], probs[sl], labels[sl]))
    assert a.filling.to_dict() == b.filling.to_dict()
    assert [(e, ps.to_dict()) for e, ps in a.sealed] == [(e, ps.to_dict()) for e, ps in b.sealed]
    # kept samples are routed with u / rate: every pool receives some (with u alone, only the
    # pools covering [0, rate) would)
    filled = {name: t.total for name, t in a.filling.tables.items()}
    assert len(filled) > 2 and all(v > 0 for v in filled.values()), filled


def test_ingest_called_directly_drops_ids_outside_the_sample():
    st = state(settings())
    ids, probs, labels = stream(2000, seed=3)
    res = st.ingest(ids, probs, labels)
    assert res.joined == int((route_uniform(ids) < RATE).sum())


def _raw(model: str, eid: str, probs=None, label=None, **extra) -> bytes:
    d = {"model": model, "id": eid, "ts": 1.0, **extra}
    if probs is not None:
        d["probs"] = list(probs)
    if label is not None:
        d["label"] = label
    return orjson.dumps(d)


@pytest.mark.skipif(native.KERNELS.module is None, reason="C accelerator not built")
def test_raw_prefilter_drops_only_what_the_reference_drops():
    ids = [f"id-{i}" for i in range(3000)]
    values = [_raw(MODEL, e, probs=[0.2, 0.3, 0.5]) if i % 2 else _raw(MODEL, e, label=1)
              for i, e in enumerate(ids)]
    mask, counts = native.KERNELS.sample_out(values, {MODEL: RATE}, 1 << 20, 256)
    ref = route_uniform(ids) >= RATE
    assert np.array_equal(np.frombuffer(mask, dtype=np.uint8).astype(bool), ref)
    assert counts == {MODEL: int(ref.sum())}
    # undecided (left to the parser): escapes, non-ASCII, duplicate keys, other models, junk
    odd = [b'{"model":"hot","id":"a\\u0062c","label":1}', _raw(MODEL, "h\u00e9", label=1),
           b'{"model":"hot","id":"x1","id":"x2","label":1}', _raw("other", "x3", label=1),
           b'{"model":"hot","id":"x4"', b"not json", b'["hot","x5"]',
           b'{"model":"hot","label":1}', _raw(MODEL, "x" * 300, label=1)]
    mask, counts = native.KERNELS.sample_out(odd, {MODEL: RATE}, 1 << 20, 256)
    assert set(mask) == {0} and counts == {}
    # whitespace, key order and nested values do not change the decision
    drop = next(e for e, x in zip(ids, route_uniform(ids)) if x >= RATE)
    spaced = (b' { "ts" : 1 , "extra" : {"a": [1, "}"]}, "id" : "' + drop.encode()
              + b'" ,"label":1, "model":"hot" } ')
    mask, counts = native.KERNELS.sample_out([spaced], {MODEL: RATE}, 1 << 20, 256)
    assert mask == b"\x01" and counts == {MODEL: 1}


@dataclass
class Msg:
    value: bytes
    offset: int
    timestamp: int = 0


def _daemon_run(s: Settings, values: dict[str, list[bytes]]):
    from daemon.service import Daemon

    d = Daemon(s)
    for topic, vals in values.items():
        tp = TopicPartition(topic, 0)
        d.partitions.assigned.add(tp)
        for lo in range(0, len(vals), 500):  # several batches: the prefilter takes over
            d.ingest.process(tp, [Msg(v, lo + i) for i, v in enumerate(vals[lo:lo + 500])])
    return d


@pytest.mark.parametrize("path", ["c", "python"])
def test_daemon_counts_sampled_out_events_per_topic(path):
    if path == "c" and native.KERNELS.module is None:
        pytest.skip("C accelerator not built")
    s = settings()
    ids, probs, labels = stream(3000, seed=4)
    preds = [_raw(MODEL, e, probs=p.tolist()) for e, p in zip(ids, probs)]
    outs = [_raw(MODEL, e, label=int(y)) for e, y in zip(ids, labels)]
    t = s.kafka.topics
    if path == "python":
        with native.pure_python():
            d = _daemon_run(s, {t.predictions: preds, t.outcomes: outs})
    else:
        d = _daemon_run(s, {t.predictions: preds, t.outcomes: outs})
    dropped = int((route_uniform(ids) >= RATE).sum())
    reg = d.metrics.registry
    for topic in ("predictions", "outcomes"):
        assert reg.get_sample_value("lpcal_events_sampled_out_total",
                                    {"model": MODEL, "topic": topic}) == dropped
    assert reg.get_sample_value("lpcal_joined_samples_total", {"model": MODEL}) == \
        len(ids) - dropped
    st = d.registry.slots[MODEL].state
    assert st.join.pending(MODEL) == 0
    # the same pools on both paths and against the reference (ModelState.offer alone)
    ref = state(s)
    for vals in (preds, outs):
        for mb in EventParser.from_settings(s).parse_batch(vals).by_model.values():
            ref.offer(mb)
    assert st.filling.to_dict() == ref.filling.to_dict()
    assert d.partitions.get(0).sampled == {MODEL: RATE}


def _window(rate: float, events: int, seed: int = 7):
    """Window statistics of a synthetic model with known truth at ``rate`` (window 20,000;
    eps 0.3 and p = 2: 529 bins, so Err_p is not all bin noise), the true Err_p and Brier."""
    s = settings(rate, window_samples=20_000, p=2.0, eps=0.3, pool=10**9, mu_pool=10**9)
    st = state(s)
    model = SyntheticModel("truth", k=K, T=0.6, scale=2.0, seed=seed)
    f_all, q_all = [], []
    for lo in range(0, events, 50_000):
        n = min(50_000, events - lo)
        f, q, y = model.sample(n)
        ids = [f"t{seed}-{lo + i}" for i in range(n)]
        st.offer(batch(KIND_SAMPLE, ids, f, y, ts0=float(lo)))
        f_all.append(f)
        q_all.append(q)
    stats = st.evaluate()["raw"]
    f, q = np.concatenate(f_all), np.concatenate(q_all)
    return stats, err_p_true(f, q, st.lam, 2.0), brier_true(f, q)


def test_monitor_estimates_stay_unbiased_at_rate_one_tenth():
    """Known truth: the synthetic model's q gives the true Err_p (at the window's bins) and
    Brier. The window holds ~20,000 samples either way: the last 20,000 events at rate 1, or
    the kept tenth of the last ~200,000 at rate 0.1. Tolerances: the spread of these
    estimates over seeds at rate 1 (Err_p 0.0117 to 0.0134 around a true 0.0112: the plug-in
    is biased up by its bin noise at any rate; ECE 0.10 to 0.12; Brier +-0.01), not the
    delta-method stderr, which underestimates it."""
    full, err_true, brier_true = _window(1.0, 20_000)
    sampled, _, _ = _window(RATE, 250_000, seed=8)
    assert full.n == 20_000 and sampled.n >= 18_000  # the window drops whole time buckets
    for w in (full, sampled):
        assert abs(w.err_p - err_true) <= 0.004, (w, err_true)
        assert abs(w.brier - brier_true) <= 0.02, (w, brier_true)
    assert abs(full.err_p - sampled.err_p) <= 0.003
    assert abs(full.ece - sampled.ece) <= 0.025
    assert abs(full.brier - sampled.brier) <= 0.025
    assert abs(full.accuracy - sampled.accuracy) <= 0.025


def _widths() -> list[int]:
    """The hash widths (ids side by side: 1 scalar, 4 AVX2, 8 AVX-512F) this CPU runs."""
    s = native.KERNELS.module
    prev, out = s.hash_lanes(), []
    for w in (1, 4, 8):
        try:
            s.hash_lanes(w)
        except ValueError:
            continue
        out.append(w)
    s.hash_lanes(prev)
    return out


@pytest.mark.skipif(native.KERNELS.module is None, reason="C accelerator not built")
def test_prefilter_decides_as_the_reference_at_every_hash_width():
    """Ids of one and of two blake2b blocks, several blocks of candidates and a tail that is no
    multiple of the lane count, interleaved with a model that is not sampled."""
    s = native.KERNELS.module
    ids = [f"w{i}-" + "x" * (i % 200) for i in range(1001)]
    values = []
    for i, e in enumerate(ids):
        values.append(_raw(MODEL, e, label=1))
        if i % 7 == 0:
            values.append(_raw("other", e, label=1))
    mine = np.array([orjson.loads(v)["model"] == MODEL for v in values])
    ref = route_uniform(ids) >= RATE
    prev = s.hash_lanes()
    assert prev == max(_widths())
    try:
        for w in _widths():
            assert s.hash_lanes(w) in _widths()
            mask, counts = s.sample_out(values, {MODEL: RATE}, 1 << 20, 256)
            got = np.frombuffer(mask, dtype=np.uint8).astype(bool)
            assert np.array_equal(got[mine], ref), w
            assert not got[~mine].any() and counts == {MODEL: int(ref.sum())}
            assert np.array_equal(np.frombuffer(s.route_u64(ids), dtype=np.uint64),
                                  np.frombuffer(s.route_u64(ids[::-1]), dtype=np.uint64)[::-1])
            assert np.array_equal(route_uniform_fast(ids), route_uniform(ids)), w
    finally:
        s.hash_lanes(prev)
    with pytest.raises(ValueError):
        s.hash_lanes(3)


@pytest.mark.skipif(native.KERNELS.module is None, reason="C accelerator not built")
def test_prefilter_samples_configured_models_until_they_are_placed():
    s = native.KERNELS.module
    ids = [f"p-{i}" for i in range(2000)]
    values = [_raw(MODEL, e, label=1) for e in ids]
    ref = route_uniform(ids) >= RATE

    def dropped(*args):
        mask, counts = s.sample_out(values, *args)
        got = np.frombuffer(mask, dtype=np.uint8).astype(bool)
        assert counts == ({MODEL: int(got.sum())} if got.any() else {})
        return got

    assert np.array_equal(dropped({}, 1 << 20, 256, {MODEL: RATE}, {}), ref)     # not placed
    assert np.array_equal(dropped({}, 1 << 20, 256, {MODEL: RATE}, None), ref)
    assert not dropped({}, 1 << 20, 256, {MODEL: RATE}, {MODEL: 1}).any()        # placed
    assert not dropped({MODEL: 1.0}, 1 << 20, 256, {MODEL: RATE}, {}).any()      # rates win
    assert not dropped({}, 1 << 20, 256).any()


@pytest.mark.parametrize("path", ["c", "python"])
def test_configured_hot_model_sampled_from_its_first_batch_and_only_on_its_partition(path):
    """On the C path the first batch of a configured model with a rate < 1 is already
    prefiltered (only kept events are parsed); both paths count the same events sampled out,
    and dead-letter every event of the model that arrives on another partition."""
    if path == "c" and native.KERNELS.module is None:
        pytest.skip("C accelerator not built")
    from daemon.service import Daemon

    s = settings()
    ids, probs, _ = stream(3000, seed=5)
    preds = [_raw(MODEL, e, probs=p.tolist()) for e, p in zip(ids, probs)]
    stray = [_raw(MODEL, f"stray-{i}", label=1) for i in range(300)]

    def run():
        d = Daemon(s)
        parsed, dead = [], []
        parse = d.parser.parse_batch
        d.parser.parse_batch = lambda values, ts=None: parsed.append(len(values)) or parse(values,
                                                                                          ts)
        d.deadletters.put = lambda tp, msg, reason: dead.append((tp.partition, msg.offset, reason))
        tp0, tp1 = TopicPartition(s.kafka.topics.predictions, 0), \
            TopicPartition(s.kafka.topics.outcomes, 1)
        d.partitions.assigned |= {tp0, tp1}
        d.ingest.process(tp0, [Msg(v, i) for i, v in enumerate(preds)])
        d.ingest.process(tp1, [Msg(v, i) for i, v in enumerate(stray)])
        return d, parsed, dead

    if path == "python":
        with native.pure_python():
            d, parsed, dead = run()
    else:
        d, parsed, dead = run()
    dropped = int((route_uniform(ids) >= RATE).sum())
    assert parsed == ([len(ids) - dropped] if path == "c" else [len(ids)]) + [len(stray)]
    reg = d.metrics.registry
    assert reg.get_sample_value("lpcal_events_sampled_out_total",
                                {"model": MODEL, "topic": "predictions"}) == dropped
    assert not reg.get_sample_value("lpcal_events_sampled_out_total",
                                    {"model": MODEL, "topic": "outcomes"})
    assert {m: slot.partition for m, slot in d.registry.slots.items()} == {MODEL: 0}
    assert d.registry.slots[MODEL].state.join.pending(MODEL) == len(ids) - dropped
    assert dead == [(1, i, "bad_schema") for i in range(len(stray))]
