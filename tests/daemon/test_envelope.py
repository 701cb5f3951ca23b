"""The checkpoint records' codec (:mod:`daemon.checkpoint.envelope`): what it encodes decodes
to the same model, and every unusable record is rejected with the reason the restore counts."""

from __future__ import annotations

import orjson

from daemon.checkpoint.envelope import (
    ENVELOPE_FORMAT,
    Envelope,
    Rejected,
    decode_envelope,
    decode_manifest,
    encode_envelope,
    encode_manifest,
)
from daemon.checkpoint.store import encode_value
from daemon.registry import Inflight, ModelSlot
from tests.support.daemon_stubs import MODEL, small_settings, state_with_sealed

LIMIT = 64 << 20


def _slot(n_sealed: int = 1) -> ModelSlot:
    st = state_with_sealed(small_settings(), n_sealed)
    return ModelSlot(st, 2, Inflight(st.pools, "pools_full", 3) if n_sealed else None, 1)


def _decode(raw: bytes, model: str = MODEL, wanted=lambda part: True):
    return decode_envelope(model, raw, limit=LIMIT, wanted=wanted)


def test_an_envelope_decodes_to_its_model_partition_fit_and_prefitted():
    slot = _slot()
    env = _decode(encode_value(encode_envelope(MODEL, slot)))  # compressed or not
    assert isinstance(env, Envelope)
    assert (env.model, env.partition, env.prefitted) == (MODEL, 2, 1)
    assert env.state.model == MODEL and env.state.samples_total == slot.state.samples_total
    assert (env.inflight.trigger, env.inflight.version) == ("pools_full", 3)
    assert env.inflight.pools.fill() == slot.inflight.pools.fill()
    assert env.saved_at is not None and env.saved_at > 1.5e9


def test_a_record_of_a_partition_not_wanted_is_not_decoded():
    raw = encode_envelope(MODEL, _slot(0))
    seen = []
    assert _decode(raw, wanted=lambda part: seen.append(part) and False) is None
    assert seen == [2]


def _body(**changes) -> bytes:
    body = orjson.loads(encode_envelope(MODEL, _slot(0)))
    body.update(changes)
    return orjson.dumps(body)


def test_unusable_records_are_rejected_with_their_reason():
    cases = {
        "too_large": (b"x" * 100, 10),
        "corrupt": (b"not json", LIMIT),
    }
    for reason, (raw, limit) in cases.items():
        got = decode_envelope(MODEL, raw, limit=limit, wanted=lambda part: True)
        assert isinstance(got, Rejected) and got.reason == reason, got
    for raw in (_body(format="lpcal.envelope/0"), _body(partition="2"), _body(prefitted=-1),
                orjson.dumps([ENVELOPE_FORMAT])):
        got = _decode(raw)
        assert isinstance(got, Rejected) and got.reason == "corrupt", got
    got = _decode(_body(model="other"))
    assert got == Rejected("wrong_model", "other")
    got = _decode(encode_envelope(MODEL, _slot(0)), model="renamed")  # the key names another
    assert isinstance(got, Rejected) and got.reason == "wrong_model"
    env = _decode(_body(saved_at=None))  # an envelope of an earlier version
    assert isinstance(env, Envelope) and env.saved_at is None


def test_manifests_round_trip_and_bad_ones_are_rejected():
    raw = encode_manifest({"p": 10, "o": 4}, ["b", "a"])
    assert orjson.loads(raw)["models"] == ["a", "b"]
    assert decode_manifest(raw, ["p", "o", "x"], limit=LIMIT) == {"p": 10, "o": 4}
    for bad in (b"[]", b"{", orjson.dumps({"offsets": {"p": -1}}),
                orjson.dumps({"offsets": {"p": 1.5}})):
        got = decode_manifest(bad, ["p"], limit=LIMIT)
        assert isinstance(got, Rejected) and got.reason == "bad_manifest", (bad, got)
    assert decode_manifest(raw, ["p"], limit=4).reason == "too_large"
