"""Unit tests of daemon.tools.simulate's pure generator and CLI argument handling (no broker)."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from daemon.codes import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE
from daemon.event_records import Invalid, ModelPolicy, Outcome, Prediction, Sample
from daemon.events import EventParser
from daemon.tools.simulate.cli import build_parser, generator_from_args, main
from daemon.tools.simulate.model import SyntheticModel, true_label_dist
from daemon.tools.simulate.traffic import MALFORMED_KINDS, TrafficGenerator
from lpcal.errors import InputError
from lpcal.metrics import brier_true, err_p_true


def _models(k=(3, 4), T=0.3, scale=5.0, skew=0.0):
    return [SyntheticModel(f"m{i}-v1", kk, T, scale, skew, seed=[7, i])
            for i, kk in enumerate(k)]


def _gen(events=2000, k=(3, 4), T=0.3, scale=5.0, skew=0.0, **kw):
    kw.setdefault("event_rate", 50.0)
    return TrafficGenerator(_models(k, T, scale, skew), events, **kw)


def _parser(ks: dict[str, int | None], reject_unknown: bool = True) -> EventParser:
    def policy(model):
        if model in ks:
            return ModelPolicy(k=ks[model])
        return None if reject_unknown else ModelPolicy()
    return EventParser(policy)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_stream_regardless_of_chunk_size():
    kw = {"orphan_frac": 0.1, "sample_frac": 0.1, "logits_frac": 0.1, "malformed_frac": 0.1,
          "drift_after": 500, "drift_T": 0.8, "seed": 3}
    a = list(_gen(1500, chunk=1000, **kw))
    b = list(_gen(1500, chunk=1000, **kw))
    c = list(_gen(1500, chunk=7, **kw))
    assert a == b
    assert a == c
    d = list(_gen(1500, chunk=1000, **{**kw, "seed": 4}))
    assert a != d


def test_generator_is_single_use():
    g = _gen(10)
    list(g)
    with pytest.raises(RuntimeError, match="single-use"):
        list(g)


def test_synthetic_model_draws_are_sequential():
    m1, m2 = SyntheticModel("a", 5, 0.3, 4.0, 1.0, seed=1), SyntheticModel("a", 5, 0.3, 4.0, 1.0,
                                                                             seed=1)
    z1, f1, q1, y1 = m1.draw(300)
    parts = [m2.draw(100) for _ in range(3)]
    assert np.array_equal(z1, np.concatenate([p[0] for p in parts]))
    assert np.array_equal(y1, np.concatenate([p[3] for p in parts]))
    # f = softmax(z) and q = softmax(T log f), both on the simplex
    assert np.allclose(f1, np.exp(z1) / np.exp(z1).sum(axis=1, keepdims=True))
    assert np.allclose(q1, f1 ** 0.3 / (f1 ** 0.3).sum(axis=1, keepdims=True))
    assert np.allclose(q1.sum(axis=1), 1.0)


# --------------------------------------------------------------------------- ordering, contract


def _decoded(gen):
    return [(t, key, orjson.loads(v) if not note.startswith("malformed") else None, note, v)
            for msgs in gen.chunks(annotate=True) for t, key, v, note in msgs]


def test_outcomes_come_later_in_event_time_and_stream_order():
    delay, jitter = 4.0, 0.5
    gen = _gen(3000, delay=delay, jitter=jitter, orphan_frac=0.2, sample_frac=0.1, chunk=256)
    msgs = _decoded(gen)
    pred_at, pred_ts = {}, {}
    last_ts = -math.inf
    n_out = 0
    for pos, (topic, key, d, note, _) in enumerate(msgs):
        assert d["ts"] >= last_ts, "stream is not in event-time order"
        last_ts = d["ts"]
        assert key == d["model"].encode()
        if note == "outcome":
            assert topic == "outcomes"
            n_out += 1
            eid = d["id"]
            assert eid in pred_at, f"outcome {eid} before its prediction"
            assert pred_at[eid] < pos
            lag = d["ts"] - pred_ts[eid]
            assert delay * (1 - jitter) - 1e-6 <= lag <= delay * (1 + jitter) + 1e-6
            assert lag > 0
            del pred_at[eid]  # at most one outcome per prediction
        else:
            assert topic == "predictions"
            assert d["id"] not in pred_ts, "duplicate event id"
            pred_ts[d["id"]] = d["ts"]
            if note == "prediction":
                pred_at[d["id"]] = pos
    c = gen.counts
    assert len(pred_at) == c["orphan"]  # predictions never answered = the orphans
    assert n_out == c["outcome"] == c["prediction"] - c["orphan"]
    assert c["prediction"] + c["sample"] == 3000
    # the fractions are as configured (binomial, 5 standard errors)
    assert abs(c["sample"] - 300) < 5 * math.sqrt(3000 * 0.1 * 0.9)
    assert abs(c["orphan"] - 0.2 * c["prediction"]) < 5 * math.sqrt(c["prediction"] * 0.16)
    # interleaving: outcomes of old events arrive between predictions of new ones
    kinds = [note for *_, note, _ in msgs]
    first_out = kinds.index("outcome")
    assert "prediction" in kinds[first_out + 1:]
    assert first_out > 0 and msgs[first_out][2]["ts"] >= 1764000000.0 + delay * (1 - jitter)


def test_payloads_follow_the_contract():
    gen = _gen(1000, sample_frac=0.2, logits_frac=0.2, decimals=None)
    ks = {m.model_id: m.k for m in gen.models}
    for topic, key, d, note, raw in _decoded(gen):
        model = d["model"]
        assert isinstance(d["id"], str) and d["id"].startswith(model + "-")
        assert isinstance(d["ts"], float)
        if note == "outcome":
            assert set(d) == {"model", "id", "ts", "label"}
            assert type(d["label"]) is int and 0 <= d["label"] < ks[model]
            continue
        vec_key = "logits" if "logits" in d else "probs"
        want = {"model", "id", "ts", vec_key} | ({"label"} if note == "sample" else set())
        assert set(d) == want
        v = d[vec_key]
        assert len(v) == ks[model] and all(type(x) is float for x in v)
        if vec_key == "probs":
            assert min(v) >= 0.0 and abs(sum(v) - 1.0) <= 1e-6


def test_rounded_probabilities_still_sum_to_one():
    gen = _gen(500, k=(10,), decimals=4)
    rows = [orjson.loads(v)["probs"] for t, _, v in gen if t == "predictions"]
    a = np.array(rows)
    assert np.all(a >= 0) and np.all(np.abs(a.sum(axis=1) - 1.0) <= 1e-6)
    # rounded: all but the largest entry have at most 4 decimals
    a[np.arange(len(a)), a.argmax(axis=1)] = 0.0
    assert np.allclose(a, np.round(a, 4), atol=1e-12)


@pytest.mark.parametrize("learn_k", [False, True])
def test_valid_events_parse_as_intended_by_daemon_events(learn_k):
    gen = _gen(2000, sample_frac=0.1, logits_frac=0.2, orphan_frac=0.1, malformed_frac=0.1,
               malformed_kinds=["negative", "wrong_length"])
    ks = {m.model_id: (None if learn_k else m.k) for m in gen.models}
    msgs = [m for c in gen.chunks(annotate=True) for m in c]
    batch = _parser(ks).parse_batch([v for _, _, v, _ in msgs])
    recs = batch.records()
    want = {"prediction": Prediction, "outcome": Outcome, "sample": Sample}
    for (topic, _, raw, note), rec in zip(msgs, recs):
        if note.startswith("malformed"):
            assert isinstance(rec, Invalid)
            continue
        assert isinstance(rec, want[note]), (note, raw, rec)
        d = orjson.loads(raw)
        if "logits" in d:  # the daemon's softmax of the logits gives the model's f
            z = np.array(d["logits"])
            assert np.allclose(rec.probs, np.exp(z - z.max()) / np.exp(z - z.max()).sum())
    by_kind = {KIND_PREDICTION: 0, KIND_OUTCOME: 0, KIND_SAMPLE: 0}
    for mb in batch.by_model.values():
        for kd, n in zip(*np.unique(mb.kind, return_counts=True)):
            by_kind[int(kd)] += int(n)
    c = gen.counts
    assert by_kind == {KIND_PREDICTION: c["prediction"], KIND_OUTCOME: c["outcome"],
                       KIND_SAMPLE: c["sample"]}
    assert len(batch.invalid) == c["malformed"] > 0


@pytest.mark.parametrize("kind", list(MALFORMED_KINDS))
def test_each_malformed_kind_gets_its_invalid_reason(kind):
    gen = _gen(400, malformed_frac=0.3, malformed_kinds=[kind], orphan_frac=0.1)
    ks = {m.model_id: m.k for m in gen.models}
    msgs = [m for c in gen.chunks(annotate=True) for m in c]
    recs = _parser(ks).parse_batch([v for _, _, v, _ in msgs]).records()
    n_bad = 0
    for (topic, key, raw, note), rec in zip(msgs, recs):
        if note == f"malformed:{kind}":
            n_bad += 1
            assert isinstance(rec, Invalid), (raw, rec)
            assert rec.reason == MALFORMED_KINDS[kind], (raw, rec)
            assert topic == ("outcomes" if kind == "label_out_of_range" else "predictions")
        else:
            assert not isinstance(rec, Invalid), (raw, rec)
    assert n_bad == gen.counts["malformed"]
    assert gen.valid_messages == len(msgs) - n_bad  # what a daemon counts as consumed
    assert abs(n_bad - 0.3 * 398) < 5 * math.sqrt(398 * 0.21)  # first event per model is valid


def test_first_event_of_each_model_is_never_malformed():
    gen = _gen(50, k=(3, 4, 5), malformed_frac=1.0)
    notes = {}
    for msgs in gen.chunks(annotate=True):
        for _, key, raw, note in msgs:
            if note != "malformed:bad_json" and note != "malformed:nan":
                notes.setdefault(orjson.loads(raw)["id"].rsplit("-", 1)[0], note)
    assert notes == {"m0-v1": "prediction", "m1-v1": "prediction", "m2-v1": "prediction"}
    assert gen.counts["malformed"] == 47


# --------------------------------------------------------------------------- labels follow q


def _joined(gen):
    """(model -> (f rows, labels)) of the valid prediction/outcome pairs and samples."""
    preds, out = {}, {}
    for t, _, v in gen:
        d = orjson.loads(v)
        if "probs" in d:
            preds[d["id"]] = (d["model"], d["probs"])
            if "label" in d:
                out[d["id"]] = d["label"]
        else:
            out[d["id"]] = d["label"]
    by_model: dict[str, tuple[list, list]] = {}
    for eid, y in out.items():
        model, f = preds[eid]
        fs, ys = by_model.setdefault(model, ([], []))
        fs.append(f)
        ys.append(y)
    return {m: (np.array(fs), np.array(ys)) for m, (fs, ys) in by_model.items()}


def _check_freqs(f, y, T, vacuous_too=True):
    q = true_label_dist(f, T)
    n, k = q.shape
    counts = np.bincount(y, minlength=k)
    se = np.sqrt((q * (1 - q)).sum(axis=0))  # std of a sum of independent Bernoulli(q_ij)
    assert np.all(np.abs(counts - q.sum(axis=0)) <= 4.5 * se + 1), (counts, q.sum(axis=0))
    # stronger, per confidence: accuracy on the argmax of f matches mean q there, not mean f
    top = f.argmax(axis=1)
    hit = (y == top)
    q_top = q[np.arange(n), top]
    f_top = f[np.arange(n), top]
    se_top = math.sqrt((q_top * (1 - q_top)).sum())
    assert abs(hit.sum() - q_top.sum()) <= 4.5 * se_top
    if vacuous_too:  # the data can tell q from f: f is clearly overconfident
        assert f_top.sum() - hit.sum() > 6 * se_top


def test_labels_follow_the_true_distribution_q():
    gen = _gen(20_000, k=(3, 5), T=0.3, scale=4.0, skew=0.5, sample_frac=0.1, orphan_frac=0.05)
    joined = _joined(gen)
    assert set(joined) == {"m0-v1", "m1-v1"}
    for f, y in joined.values():
        _check_freqs(f, y, 0.3)


def test_drift_switches_T():
    n, after = 20_000, 10_000
    gen = _gen(n, k=(3,), T=0.3, scale=4.0, drift_after=after, drift_T=1.0)
    f, y = _joined(gen)["m0-v1"]
    # events are in id order per model: seq == event index for one model
    _check_freqs(f[:after], y[:after], 0.3)
    _check_freqs(f[after:], y[after:], 1.0, vacuous_too=False)  # T=1: calibrated, q = f
    with pytest.raises(AssertionError):
        _check_freqs(f[after:], y[after:], 0.3, vacuous_too=False)


# --------------------------------------------------------------------------- oracle helpers


def test_synthetic_model_is_overconfident_against_its_truth():
    f, q, _ = SyntheticModel("m", 3, 0.2, 8.0, 0.0, seed=5).sample(20_000)
    assert err_p_true(f, q, lam=10, p=2.0) > 0.05
    assert err_p_true(q, q, lam=10, p=2.0) == pytest.approx(0.0, abs=1e-12)
    assert brier_true(q, q) < brier_true(f, q)


# --------------------------------------------------------------------------- validation, CLI


@pytest.mark.parametrize("kw,match", [
    ({"delay": 0.0}, "delay"),
    ({"jitter": 1.0}, "jitter"),
    ({"orphan_frac": 1.5}, "orphan_frac"),
    ({"malformed_frac": 0.7, "sample_frac": 0.5}, "sample_frac"),
    ({"malformed_kinds": ["nope"]}, "malformed_kinds"),
    ({"drift_after": 10}, "drift"),
    ({"event_rate": 0.0}, "event_rate"),
    ({"decimals": 0}, "decimals"),
    ({"id_digits": 0}, "id_digits"),
    ({"id_digits": 31}, "id_digits"),
])
def test_bad_generator_arguments_raise(kw, match):
    with pytest.raises(InputError, match=match):
        _gen(10, **kw)


def test_fixed_width_ids_are_the_plain_ids_zero_padded():
    """``id_digits``: every id of a model has the same length; otherwise the same stream."""
    plain = [orjson.loads(v) for _, _, v in _gen(300, orphan_frac=0.1, sample_frac=0.2)]
    padded = [orjson.loads(v) for _, _, v in _gen(300, orphan_frac=0.1, sample_frac=0.2,
                                                   id_digits=6)]
    assert len(plain) == len(padded) > 300
    assert {len(e["id"]) - len(e["model"]) for e in padded} == {7}
    for a, b in zip(plain, padded):
        model, n = a.pop("id").rsplit("-", 1)
        assert b.pop("id") == f"{model}-{int(n):06d}"
        assert a == b
    assert _gen(20, id_digits=1)    # 10 events per model: ids 0..9 fit in one digit
    with pytest.raises(InputError, match="fit 11 events per model"):
        _gen(22, id_digits=1)


def test_bad_model_arguments_raise():
    with pytest.raises(InputError, match="k must be"):
        SyntheticModel("m", 1, 0.3, 1.0)
    with pytest.raises(InputError, match="T must be"):
        SyntheticModel("m", 3, 0.0, 1.0)
    with pytest.raises(InputError, match="duplicate"):
        TrafficGenerator([SyntheticModel("m", 3, 0.3, 1.0), SyntheticModel("m", 3, 0.3, 1.0)], 1)


def test_cli_arguments():
    a = build_parser().parse_args(["--bootstrap", "h:1", "--models", "fraud-v3,churn-v1:5",
                                   "--events", "40", "--start", "1000", "--seed", "2"])
    assert a.idempotence is None  # resolved to True (production Kafka) unless configured
    gen = generator_from_args(a)
    assert [(m.model_id, m.k) for m in gen.models] == [("fraud-v3", 3), ("churn-v1", 5)]
    assert gen.event_rate == 1000.0 and gen.start == 1000.0
    first = orjson.loads(next(iter(gen))[2])
    assert first["ts"] == 1000.0 and first["id"] == "fraud-v3-0"
    again = generator_from_args(build_parser().parse_args(
        ["--models", "fraud-v3,churn-v1:5", "--events", "40", "--start", "1000", "--seed", "2"]))
    assert list(again) == list(generator_from_args(a))
    from daemon.tools.simulate.cli import _resolve
    assert _resolve(a)["idempotence"] is True
    kw = _resolve(build_parser().parse_args(["--no-idempotence", "--topic-prefix", "x.",
                                             "--partitions", "3"]))
    assert kw["idempotence"] is False and kw["partitions"] == 3
    assert kw["topics"] == {"predictions": "x.lpcal.predictions", "outcomes": "x.lpcal.outcomes"}


def test_cli_bad_arguments_exit_2(capsys):
    assert main(["--orphan-frac", "2", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "orphan_frac must be in [0, 1]" in capsys.readouterr().err
    assert main(["--models", "a:x"]) == 2
    assert "k of 'a' must be an integer" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--idempotence" in capsys.readouterr().out


def test_cli_unreachable_broker_exits_1(capsys):
    assert main(["--bootstrap", "127.0.0.1:1", "--events", "5", "--quiet"]) == 1
    assert "lpcal simulate: error: KafkaConnectionError" in capsys.readouterr().err


def test_stream_joins_in_the_daemon_join_store():
    """Parsed in batches like the daemon does, the stream joins to exactly the expected samples."""
    from daemon.join import JoinStore

    gen = _gen(3000, delay=5.0, orphan_frac=0.1, sample_frac=0.1, logits_frac=0.1,
               malformed_frac=0.05)
    parser = _parser({m.model_id: None for m in gen.models})
    store = JoinStore(max_pending_per_model=100_000, ttl_seconds=3600.0)
    msgs = [v for _, _, v in gen]
    joined, unmatched = {}, 0
    for s in range(0, len(msgs), 500):
        batch = parser.parse_batch(msgs[s:s + 500])
        for model, mb in batch.by_model.items():
            res = store.offer(model, mb.kind, mb.ids, mb.ts, mb.probs, mb.labels)
            unmatched += sum(res.unmatched.values())
            for eid, y in zip(res.ids, res.labels.tolist()):
                assert eid not in joined
                joined[eid] = y
    c = gen.counts
    assert unmatched == 0
    assert len(joined) == c["prediction"] - c["orphan"] + c["sample"]
    assert store.pending() == c["orphan"]  # the orphans wait (until their TTL expires)


def test_cli_reads_kafka_settings_from_config(tmp_path, monkeypatch):
    from daemon.tools.simulate.cli import _resolve

    for var in [v for v in __import__("os").environ if v.startswith("LPCAL_")]:
        monkeypatch.delenv(var)
    cfg = tmp_path / "lpcal.toml"
    cfg.write_text('[kafka]\nbootstrap_servers = "kafka-1:9092"\nenable_idempotence = false\n'
                   'topic_partitions = 4\n[kafka.topics]\npredictions = "in.preds"\n')
    kw = _resolve(build_parser().parse_args(["--config", str(cfg)]))
    assert kw["bootstrap"] == "kafka-1:9092" and kw["idempotence"] is False
    assert kw["partitions"] == 4
    assert kw["topics"] == {"predictions": "in.preds", "outcomes": "lpcal.outcomes"}
    assert kw["security"].security_protocol == "PLAINTEXT"
    # explicit flags win over the file
    kw = _resolve(build_parser().parse_args(["--config", str(cfg), "--bootstrap", "b:1",
                                             "--idempotence", "--partitions", "2"]))
    assert (kw["bootstrap"], kw["idempotence"], kw["partitions"]) == ("b:1", True, 2)
    bad = tmp_path / "bad.toml"
    bad.write_text('[kafka]\ntopic_partitions = 0\n')
    with pytest.raises(InputError, match="topic_partitions"):
        _resolve(build_parser().parse_args(["--config", str(bad)]))
