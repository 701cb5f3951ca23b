"""The parser's memory does not grow with input: policies are cached for
admitted models plus a bounded number of others, and a learned k above ``max_k`` is rejected
with its own reason before anything is kept."""

from __future__ import annotations

import orjson
import pytest

from daemon.event_policies import OTHER_POLICIES, ModelPolicies
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


def test_model_policies_admit_up_to_max_models_and_peek_changes_nothing():
    """ModelPolicies on its own: admission bounded by max_models (restores are not), peek
    leaves the caches and admissions as they were, admit_all commits what peek found."""
    calls = []

    def policy_for(model):
        calls.append(model)
        return None if model == "bad" else ModelPolicy(k=4)

    pol = ModelPolicies(policy_for, max_models=2)
    assert pol.peek("a") == (ModelPolicy(k=4), False) and pol.peek("bad") == (None, False)
    assert pol.admitted == set() and pol.k == {} and list(pol.cached_admitted()) == []
    assert pol.n_cached_others() == 0
    pol.admit_all(["a"], [("a", ModelPolicy(k=4))])
    assert pol.admitted == {"a"} and pol.k == {"a": 4} and pol.peek("a")[1] is True
    assert pol.policy("bad") is None and pol.n_cached_others() == 1
    assert pol.admit_new("b", pol.policy("b")) and not pol.has_room(1)
    assert not pol.admit_new("c", pol.policy("c")) and "c" not in pol.admitted
    pol.admit("restored", 7)  # a checkpoint's model is admitted beyond max_models
    assert pol.k["restored"] == 7 and len(pol.admitted) == 3
    pol.set_k("a", 0)  # 0: no learned k, the known one stays
    assert pol.k["a"] == 4
    n = len(calls)
    assert pol.policy("a") == ModelPolicy(k=4) and pol.policy("bad") is None and len(calls) == n
