"""daemon.events: every rejection reason, logits, renormalisation, batch == single, fuzzing."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon import codes
from daemon.event_columnar import parse_columnar
from daemon.event_general import parse_general
from daemon.event_records import (
    REASONS,
    Invalid,
    ModelPolicy,
    Outcome,
    Prediction,
    Sample,
)
from daemon.events import EventParser


def parser(k=3, **kw) -> EventParser:
    policies = {"m": ModelPolicy(k=k, **kw), "free": ModelPolicy(k=None)}
    return EventParser(policies.get, max_bytes=2000)


def msg(**fields) -> bytes:
    base = {"model": "m", "id": "e-1", "ts": 1764000000.5}
    base.update(fields)
    return orjson.dumps({k: v for k, v in base.items() if v is not None})


def reason(rec) -> str:
    assert isinstance(rec, Invalid), rec
    assert rec.reason in REASONS
    return rec.reason


def test_reasons_are_the_prometheus_label_values():
    from daemon.metrics import InvalidReason

    assert set(REASONS) == {r.value for r in InvalidReason}


def test_valid_prediction_outcome_and_sample():
    p = parser()
    rec = p.parse(msg(probs=[0.1, 0.7, 0.2]))
    assert isinstance(rec, Prediction) and rec.model == "m" and rec.id == "e-1"
    assert rec.ts == 1764000000.5 and np.allclose(rec.probs, [0.1, 0.7, 0.2])
    out = p.parse(msg(label=2, ts=5))
    assert isinstance(out, Outcome) and out.label == 2 and out.ts == 5.0
    s = p.parse(msg(probs=[0.5, 0.5, 0.0], label=0))
    assert isinstance(s, Sample) and s.label == 0 and s.probs.tolist() == [0.5, 0.5, 0.0]


def test_logits_use_a_stable_softmax():
    p = parser()
    rec = p.parse(msg(logits=[1000.0, 1000.0, -1000.0]))
    assert isinstance(rec, Prediction)
    assert np.allclose(rec.probs, [0.5, 0.5, 0.0]) and np.isfinite(rec.probs).all()
    z = np.array([0.3, -1.2, 2.0])
    rec = p.parse(msg(logits=z.tolist()))
    assert np.allclose(rec.probs, np.exp(z) / np.exp(z).sum(), rtol=1e-12)


@pytest.mark.parametrize("raw, expected", [
    (b"x" * 2001, "oversize"),
    (b"\xff\xfe{}", "bad_encoding"),
    (b'{"model": "m", "id": "\xed\xa0\x80"}', "bad_encoding"),
    (b"{", "bad_json"),
    (b'{"model":"m","id":"a","ts":1,"probs":[NaN,0.5,0.5]}', "bad_json"),
    (b'{"model":"m","id":"a","ts":1,"probs":[1e999,0.5,0.5]}', "bad_json"),
    (b"[1, 2]", "bad_schema"),
    (b'"just a string"', "bad_schema"),
    (msg(model=None, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(model="", probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(model="m" * 256, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(id=None, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(id=17, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(id="x" * 257, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(ts=None, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(ts="yesterday", probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(ts=True, probs=[0.2, 0.3, 0.5]), "bad_schema"),
    (msg(), "bad_schema"),  # neither vector nor label
    (msg(probs=[0.2, 0.3, 0.5], logits=[0, 0, 0]), "bad_schema"),
    (msg(probs="0.2,0.3,0.5"), "bad_schema"),
    (msg(probs=[0.2, "0.3", 0.5]), "bad_schema"),
    (msg(probs=[0.2, True, 0.5]), "bad_schema"),
    (msg(probs=[0.2, None, 0.5]), "bad_schema"),
    (msg(probs=[0.2, [0.3], 0.5]), "bad_schema"),
    (msg(label=1.0), "bad_schema"),
    (msg(label=True), "bad_schema"),
    (msg(model="nope", probs=[0.2, 0.3, 0.5]), "unknown_model"),
    (msg(probs=[0.5, 0.5]), "wrong_length"),
    (msg(probs=[0.25, 0.25, 0.25, 0.25]), "wrong_length"),
    (msg(probs=[1e308, 1e308, 0.0]), "non_finite"),
    (msg(probs=[-0.1, 0.6, 0.5]), "negative"),
    (msg(label=3), "label_out_of_range"),
    (msg(label=-1), "label_out_of_range"),
    (msg(probs=[0.2, 0.3, 0.5], label=7), "label_out_of_range"),
])
def test_each_fault_has_its_reason(raw, expected):
    assert reason(parser().parse(raw)) == expected


def test_sum_tolerance_renormalize_or_reject():
    off = msg(probs=[0.2, 0.3, 0.6])            # sums to 1.1
    near = msg(probs=[0.2, 0.3, 0.5005])        # within 1e-3
    ren = parser(sum_tolerance=1e-3, normalize="renormalize")
    rec = ren.parse(off)
    assert isinstance(rec, Prediction) and math.isclose(rec.probs.sum(), 1.0)
    assert np.allclose(rec.probs, np.array([0.2, 0.3, 0.6]) / 1.1)
    rej = parser(sum_tolerance=1e-3, normalize="reject")
    assert reason(rej.parse(off)) == "not_normalized"
    kept = rej.parse(near)
    assert isinstance(kept, Prediction) and kept.probs[2] == 0.5005  # within tolerance: as sent
    assert reason(ren.parse(msg(probs=[0.0, 0.0, 0.0]))) == "not_normalized"  # sum 0: unfixable
    loose = parser(sum_tolerance=0.2, normalize="reject")
    assert isinstance(loose.parse(off), Prediction)


def test_k_is_learned_from_the_first_well_formed_vector():
    p = parser()
    assert reason(p.parse(msg(model="free", probs=[1.0]))) == "wrong_length"  # k >= 2
    assert "free" not in p.k
    assert isinstance(p.parse(msg(model="free", label=40)), Outcome)  # k unknown: label >= 0 ok
    assert isinstance(p.parse(msg(model="free", probs=[0.5, 0.25, 0.25, 0.0])), Prediction)
    assert p.k["free"] == 4
    assert reason(p.parse(msg(model="free", probs=[0.5, 0.5]))) == "wrong_length"
    assert reason(p.parse(msg(model="free", label=4))) == "label_out_of_range"
    q = parser()
    q.set_k("free", 2)  # restored from a checkpoint
    assert reason(q.parse(msg(model="free", probs=[0.2, 0.3, 0.5]))) == "wrong_length"


def test_label_checked_against_k_learned_later_in_the_same_batch():
    p = parser()
    b = p.parse_batch([msg(model="free", id="a", label=5),
                       msg(model="free", id="b", probs=[0.5, 0.5])])
    recs = b.records()
    assert reason(recs[0]) == "label_out_of_range" and isinstance(recs[1], Prediction)


def test_max_models_bounds_admitted_models():
    p = EventParser(lambda m: ModelPolicy(k=2), max_models=2)
    for name in ("a", "b"):
        assert isinstance(p.parse(msg(model=name, probs=[0.5, 0.5])), Prediction)
    assert reason(p.parse(msg(model="c", probs=[0.5, 0.5]))) == "unknown_model"
    assert isinstance(p.parse(msg(model="a", label=1)), Outcome)  # admitted ones keep working


def test_non_bytes_values():
    p = parser()
    ok = msg(probs=[0.2, 0.3, 0.5])
    recs = p.parse_batch([bytearray(ok), memoryview(ok), None, 17]).records()
    assert isinstance(recs[0], Prediction) and isinstance(recs[1], Prediction)
    assert reason(recs[2]) == "bad_schema" and reason(recs[3]) == "bad_schema"


def test_fallback_timestamp_when_ts_absent():
    p = parser()
    rec = p.parse(msg(ts=None, probs=[0.2, 0.3, 0.5]), ts=123.25)
    assert isinstance(rec, Prediction) and rec.ts == 123.25
    assert reason(p.parse(msg(ts=None, label=1), ts=math.nan)) == "non_finite"


def test_from_settings():
    from daemon.settings import load_settings

    s = load_settings(secrets_dir="/nonexistent", unknown_models="reject",
                      models={"fraud-v3": {"k": 3, "normalize": "reject"}},
                      kafka={"max_message_bytes": 1024})
    p = EventParser.from_settings(s)
    assert p.k["fraud-v3"] == 3 and "fraud-v3" in p.admitted
    assert isinstance(p.parse(msg(model="fraud-v3", probs=[0.2, 0.3, 0.5])), Prediction)
    assert reason(p.parse(msg(model="fraud-v3", probs=[0.2, 0.3, 0.6]))) == "not_normalized"
    assert reason(p.parse(msg(model="other", probs=[0.2, 0.3, 0.5]))) == "unknown_model"
    assert reason(p.parse(b" " * 1025)) == "oversize"


def test_batch_groups_by_model_in_input_order():
    p = EventParser(lambda m: ModelPolicy(k=2))
    raws = [msg(model="a", id="1", probs=[0.5, 0.5]), b"junk",
            msg(model="b", id="2", label=1), msg(model="a", id="3", label=0),
            msg(model="a", id="4", probs=[0.9, 0.1], label=1)]
    b = p.parse_batch(raws)
    assert [i for i, _ in b.invalid] == [1]
    a = b.by_model["a"]
    assert a.ids == ["1", "3", "4"] and a.index.tolist() == [0, 3, 4]
    assert a.kind.tolist() == [codes.KIND_PREDICTION, codes.KIND_OUTCOME, codes.KIND_SAMPLE]
    assert a.labels.tolist() == [-1, 0, 1]
    assert a.probs.shape == (3, 2) and a.probs[1].tolist() == [0.0, 0.0]
    assert b.by_model["b"].kind.tolist() == [codes.KIND_OUTCOME]


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Invalid):
        return a.reason == b.reason
    for name in a.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(-2, 2, allow_nan=False)
    | st.text(max_size=4),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=8,
)
events = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "free", "zzz", ""]) | json_values,
        "id": st.text(max_size=5) | json_values,
        "ts": st.floats(0, 2e9, allow_nan=False) | json_values,
        "probs": st.lists(st.floats(-0.5, 1.5, allow_nan=False) | st.integers(0, 1), min_size=0,
                          max_size=5) | json_values,
        "logits": st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=4) | json_values,
        "label": st.integers(-2, 5) | json_values,
    },
)


# mostly well-formed events, so that valid records and the value checks are exercised too
probs3 = st.lists(st.floats(0, 1), min_size=3, max_size=3)
near_valid = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "free"]), "id": st.text(min_size=1, max_size=4),
     "ts": st.floats(0, 2e9)},
    optional={"probs": probs3 | st.lists(st.floats(-1, 2), min_size=2, max_size=4),
              "logits": st.lists(st.floats(-800, 800), min_size=3, max_size=3),
              "label": st.integers(-1, 4)},
)
any_message = st.binary(max_size=80) | events.map(orjson.dumps) | near_valid.map(orjson.dumps)


def test_fuzz_strategies_reach_valid_and_invalid_records():
    from hypothesis import Phase, find

    quick = settings(max_examples=3000, phases=[Phase.generate], database=None,
                     derandomize=True)
    find(st.lists(any_message, min_size=1, max_size=4),
         lambda raws: any(isinstance(r, Sample) for r in parser().parse_batch(raws).records()),
         settings=quick)
    for why in ("negative", "not_normalized", "wrong_length", "label_out_of_range"):
        rej = EventParser({"m": ModelPolicy(k=3, normalize="reject")}.get)
        find(near_valid.map(orjson.dumps),
             lambda raw, why=why, rej=rej: getattr(rej.parse(raw), "reason", None) == why,
             settings=quick)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_message, min_size=1, max_size=8))
def test_fuzz_any_bytes_never_raise_and_batch_equals_single(raws):
    batch = parser().parse_batch(raws).records()
    single = parser()  # fresh parser: same learning order as the batch
    for raw, rec in zip(raws, batch):
        assert isinstance(rec, (Prediction, Outcome, Sample, Invalid))
        if isinstance(rec, Invalid):
            assert rec.reason in REASONS
        else:
            assert rec.model in ("m", "free") and 0 < len(rec.id) <= 256
            if not isinstance(rec, Outcome):
                assert np.isfinite(rec.probs).all() and (rec.probs >= 0).all()
                assert abs(rec.probs.sum() - 1.0) <= 1e-3
        one = single.parse(raw)
        # learning k may happen later in a batch than in a single-message stream only for labels
        # seen before the vector; otherwise the records agree exactly.
        assert _same(rec, one) or (isinstance(one, Outcome) and isinstance(rec, Invalid))


# ----------------------------------------------------------------------------- fast path


class _GeneralOnly(EventParser):
    """The same parser whose batches always take the general per-message path."""

    def parse_batch(self, raws, timestamps=None):
        return parse_general(raws, timestamps, self.policies, self.max_bytes, self.max_model_len,
                             self.max_id_len, self.max_k)


def _columnar(p: EventParser, raws):
    """The columnar fast path alone on ``p``'s state (None: it declines the batch)."""
    return parse_columnar(raws, p.policies, p.max_bytes, p.max_model_len, p.max_id_len)


def _parsers(max_models=None):
    policies = {"m": ModelPolicy(k=3), "n": ModelPolicy(k=3, normalize="reject"),
                "free": ModelPolicy(k=None)}
    return (EventParser(policies.get, max_bytes=2000, max_models=max_models),
            _GeneralOnly(policies.get, max_bytes=2000, max_models=max_models))


def _parser_state(p):
    return sorted(p.admitted), dict(p.k), sorted(p.policies.cached_admitted())


entry = st.floats(0, 1) | st.sampled_from([0, 1, 0.0, 1.0, 2, True, False, "0.5", None])
well_formed = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "n", "free", "zzz"]), "id": st.text(min_size=0, max_size=3),
     "ts": st.floats(0, 2e9) | st.integers(0, 10) | st.just("1")},
    optional={"probs": st.lists(entry, min_size=2, max_size=4),
              "label": st.integers(-1, 3) | st.just(True)},
)


# batches the fast path mostly accepts: rare non-numeric entries, labels and vectors present
vec3 = st.lists(st.floats(0, 1) | st.sampled_from([0, 1, 0.5]), min_size=3, max_size=3) | \
    st.lists(entry, min_size=3, max_size=3)
fast_event = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "n"]), "id": st.text(min_size=1, max_size=3),
     "ts": st.floats(0, 2e9)},
    optional={"extra": st.booleans()},
).flatmap(lambda d: st.one_of(
    st.builds(lambda v: {**d, "probs": v}, vec3),
    st.builds(lambda y: {**d, "label": y}, st.integers(0, 2)),
    st.builds(lambda v, y: {**d, "probs": v, "label": y}, vec3, st.integers(0, 3))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(fast_event.map(orjson.dumps), min_size=1, max_size=8)
       | st.lists(well_formed.map(orjson.dumps) | any_message, min_size=1, max_size=8),
       st.sampled_from([None, 1, 2]))
def test_fast_path_equals_general_loop(raws, max_models):
    """Whatever the fast path accepts, it parses exactly as the per-message loop: same records,
    reasons and parser state (admitted models, learned k, cached policies). Vectors holding
    bools, 0/1, ints or strings, new models and max_models are all exercised."""
    fast, slow = _parsers(max_models)
    for _ in range(2):  # a second pass sees the models admitted and learned by the first
        a, b = fast.parse_batch(raws), slow.parse_batch(raws)
        ra, rb = a.records(), b.records()
        assert all(_same(x, y) for x, y in zip(ra, rb)), (ra, rb)
        assert [(i, x.reason, x.detail) for i, x in a.invalid] == \
            [(i, x.reason, x.detail) for i, x in b.invalid]
        assert _parser_state(fast) == _parser_state(slow)


def test_fast_path_admits_new_models_and_rejects_bools_in_vectors():
    p = EventParser({"m": ModelPolicy(k=3)}.get)
    raws = [msg(id=f"e{i}", probs=[0.2, 0.3, 0.5]) for i in range(4)]
    out = _columnar(p, raws)  # model "m" is not admitted yet: still the fast path
    assert out is not None and len(out.by_model["m"]) == 4 and p.admitted == {"m"}
    assert p.k == {"m": 3}
    # an exact 0/1 entry is type-checked: a bool (not a number) makes the batch take the loop
    bad = raws + [msg(id="b", probs=[True, 0.0, 0.0])]
    assert _columnar(p, bad) is None
    assert reason(p.parse_batch(bad).records()[-1]) == "bad_schema"
    ok = raws + [msg(id="c", probs=[1, 0.0, 0])]
    assert _columnar(p, ok).by_model["m"].probs[-1].tolist() == [1.0, 0.0, 0.0]
    # a model over max_models is never admitted by the fast path
    q = EventParser({"a": ModelPolicy(k=2), "b": ModelPolicy(k=2)}.get, max_models=1)
    two = [msg(model="a", id="1", label=0), msg(model="b", id="2", label=1)]
    assert _columnar(q, two) is None and q.admitted == set()
    recs = q.parse_batch(two).records()
    assert isinstance(recs[0], Outcome) and reason(recs[1]) == "unknown_model"


# several models with one k and one policy: the batch is validated once and split by model
shared_event = st.fixed_dictionaries(
    {"model": st.sampled_from(["a", "b", "c"]), "id": st.text(min_size=1, max_size=3),
     "ts": st.floats(0, 2e9)},
).flatmap(lambda d: st.one_of(
    st.builds(lambda v: {**d, "probs": v}, vec3),
    st.builds(lambda y: {**d, "label": y}, st.integers(0, 2)),
    st.builds(lambda v, y: {**d, "probs": v, "label": y}, vec3, st.integers(0, 2))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(shared_event.map(orjson.dumps), min_size=2, max_size=12),
       st.sampled_from(["renormalize", "reject"]), st.sampled_from([None, 2]))
def test_grouped_fast_path_equals_general_loop(raws, normalize, max_models):
    """Models sharing k and policy take the grouped fast path (one validation per batch, each
    model's batch a slice of the columns in model order): the same records, invalid events
    (negative, not normalized, non-finite entries) and parser state as the per-message loop."""
    pol = ModelPolicy(k=3, normalize=normalize)
    fast = EventParser(lambda m: pol, max_bytes=2000, max_models=max_models)
    slow = _GeneralOnly(lambda m: pol, max_bytes=2000, max_models=max_models)
    for _ in range(2):
        a, b = fast.parse_batch(raws), slow.parse_batch(raws)
        ra, rb = a.records(), b.records()
        assert all(_same(x, y) for x, y in zip(ra, rb)), (ra, rb)
        assert [(i, x.reason, x.detail) for i, x in a.invalid] == \
            [(i, x.reason, x.detail) for i, x in b.invalid]
        assert list(a.by_model) == list(b.by_model)
        for model, mb in a.by_model.items():
            assert mb.index.tolist() == b.by_model[model].index.tolist()
        assert _parser_state(fast) == _parser_state(slow)


def test_grouped_fast_path_is_taken_and_splits_in_input_order():
    pol = ModelPolicy(k=2)
    p = EventParser(lambda m: pol, max_bytes=2000)
    raws = [orjson.dumps({"model": m, "id": str(i), "ts": float(i), "probs": [0.25, 0.75]})
            for i, m in enumerate(["b", "a", "b", "c", "a"])]
    raws.append(orjson.dumps({"model": "a", "id": "x", "ts": 9.0, "probs": [-0.5, 1.5]}))
    out = _columnar(p, raws)
    assert out is not None and list(out.by_model) == ["b", "a", "c"]
    assert out.by_model["a"].index.tolist() == [1, 4]   # the negative row is invalid
    assert out.by_model["b"].ids == ["0", "2"] and out.by_model["c"].ids == ["3"]
    assert [(i, bad.reason, bad.model) for i, bad in out.invalid] == [(5, "negative", "a")]
    assert out.by_model["b"].probs.tolist() == [[0.25, 0.75], [0.25, 0.75]]


def test_event_time_bound_of_a_batch_of_many_models_matches_the_per_model_bound():
    """A batch of many models is bounded in a few array passes: the same ``ts_limit`` per model
    as one model at a time, and an event beyond the bound still rejected as ts_out_of_range."""
    models = [f"m{i}" for i in range(30)]
    pol = ModelPolicy(k=3)
    rng = np.random.default_rng(4)
    n = 300
    record_ts = (1000.0 + rng.permutation(n)).tolist()  # record timestamps, any order
    owner = [models[i % 30] for i in range(n)]
    raws = [orjson.dumps({"model": owner[i], "id": f"x{i}", "ts": record_ts[i] - 1.0,
                          "probs": [0.2, 0.3, 0.5], "label": i % 3}) for i in range(n)]
    many = EventParser(lambda m: pol, max_ts_skew=60.0).parse_batch(raws, list(record_ts))
    assert not many.invalid and set(many.by_model) == set(models)
    for m in models:  # each model alone: the per-model bound
        idx = [i for i in range(n) if owner[i] == m]
        alone = EventParser(lambda _m: pol, max_ts_skew=60.0).parse_batch(
            [raws[i] for i in idx], [record_ts[i] for i in idx])
        assert many.by_model[m].ts_limit == alone.by_model[m].ts_limit == max(
            record_ts[i] for i in idx) + 60.0
    raws[17] = orjson.dumps({"model": owner[17], "id": "x17", "ts": record_ts[17] + 61.0,
                             "probs": [0.2, 0.3, 0.5], "label": 0})
    bad = EventParser(lambda m: pol, max_ts_skew=60.0).parse_batch(raws, list(record_ts))
    assert [(i, r.reason) for i, r in bad.invalid] == [(17, "ts_out_of_range")]
    assert "x17" not in bad.by_model[owner[17]].ids
    assert bad.by_model[owner[18]].ts_limit == many.by_model[owner[18]].ts_limit
