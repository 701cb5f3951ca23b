"""The parser's memory does not grow with input: policies are cached for
admitted models plus a bounded number of others, and a learned k above ``max_k`` is rejected
with its own reason before anything is kept."""

from __future__ import annotations

import orjson
import pytest

from daemon.event_policies import OTHER_POLICIES
from daemon.event_records import K_TOO_LARGE, UNKNOWN_MODEL, ModelPolicy
from daemon.events import EventParser
from daemon.settings import SettingsError, load_settings


def _outcome(model: str) -> bytes:
    return orjson.dumps({"model": model, "id": "x", "ts": 1.0, "label": 0})


def _prediction(model: str, k: int) -> bytes:
    return orjson.dumps({"model": model, "id": "p", "ts": 1.0, "probs": [1.0] + [0.0] * (k - 1)})


@pytest.mark.parametrize("batch", [1, 500], ids=["one-by-one", "batches"])
def test_distinct_model_names_do_not_grow_the_policy_cache(batch):
    calls = []

    def policy_for(model):
        calls.append(model)
        return ModelPolicy(k=3)

    p = EventParser(policy_for, max_models=10)
    names = [f"name-{i}" for i in range(3 * OTHER_POLICIES)]
    reasons = []
    for s in range(0, len(names), batch):
        out = p.parse_batch([_outcome(m) for m in names[s:s + batch]], None)
        reasons += [bad.reason for _, bad in out.invalid]
    assert len(p.admitted) == 10
    assert reasons.count(UNKNOWN_MODEL) == len(names) - 10
    assert set(p.policies.cached_admitted()) == p.admitted and set(p.k) <= p.admitted
    assert p.policies.n_cached_others() <= OTHER_POLICIES
    # admitted models keep their cached policy: no new lookups for them
    before = len(calls)
    p.parse_batch([_outcome(m) for m in sorted(p.admitted)], None)
    assert len(calls) == before


def test_a_learned_k_above_max_k_is_rejected_with_its_reason():
    p = EventParser(lambda m: ModelPolicy(k=None), max_k=1000)
    out = p.parse_batch([_prediction("wide", 1001), _prediction("ok", 1000)], None)
    assert [(i, bad.reason) for i, bad in out.invalid] == [(0, K_TOO_LARGE)]
    assert "max_k=1000" in out.invalid[0][1].detail
    assert "wide" not in p.k and p.k["ok"] == 1000
    assert list(out.by_model) == ["ok"]
    # a label of a model whose k is unknown is checked against max_k, not 100,000
    bad = p.parse_batch([orjson.dumps({"model": "new", "id": "y", "ts": 1.0,
                                       "label": 5000})], None)
    assert bad.invalid[0][1].reason == "label_out_of_range"


def test_a_configured_k_above_max_k_stops_startup(tmp_path):
    with pytest.raises(SettingsError, match=r"models\.big\.k.*above max_k = 100"):
        load_settings(None, max_k=100, models={"big": {"k": 200}, "small": {"k": 10}})
    with pytest.raises(SettingsError, match=r"defaults\.k.*above max_k"):
        load_settings(None, max_k=100, defaults={"k": 101})
    assert load_settings(None, max_k=200, models={"big": {"k": 200}}).max_k == 200
