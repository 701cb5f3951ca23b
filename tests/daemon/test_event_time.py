"""Event time and join order on the state machines (parser, join, monitor, triggers, state).

* Event time is bounded: one schema-valid event with ``ts = 1e12`` expired all
  pending joins of its model, made the following outcomes ``late``, shrank the monitor's time
  window to one sample and froze the drift clock, and a checkpoint kept all of it. Now such an
  event is dead-lettered as ``ts_out_of_range`` (more than ``max_ts_skew`` seconds after its
  record timestamp), and a state restored from a poisoned checkpoint has its clocks pulled back
  at its first batch.
* Joins in either order, for pinned and learned k alike: outcomes of a model whose
  k is learned, arriving before its first prediction, wait (a state with ``k = 0``) instead of
  being dead-lettered.

Each test runs on the C accelerator (when built) and on the pure-Python path.
"""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from daemon import native
from daemon.event_records import TS_OUT_OF_RANGE, ModelPolicy
from daemon.events import EventParser
from daemon.model_state import ModelState
from daemon.settings import JoinSettings, ModelSettings

MODEL = "m"
K = 3
T0 = 1_764_000_000.0
SKEW = 300.0
N = 500


@pytest.fixture(params=["c", "python"])
def path(request):
    if request.param == "c":
        if native.KERNELS.module is None:
            pytest.skip("C accelerator not built")
        yield "c"
    else:
        with native.pure_python():
            yield "python"


def ms(**kw) -> ModelSettings:
    base = {"eps": 0.1, "p": math.inf, "pool": 10_000, "mu_pool": 10_000, "mode": "paper",
            "window_seconds": 3600.0, "drift_min_samples": 100, "drift_sustain_seconds": 60.0}
    base.update(kw)
    return ModelSettings(**base)


JOIN = JoinSettings(ttl_seconds=3600, max_pending_per_model=100_000)


def parser(k: int | None = K, skew: float | None = SKEW) -> EventParser:
    return EventParser(lambda model: ModelPolicy(k=k), max_ts_skew=skew)


def probs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(K), size=n)


def preds(ids, ts, seed=0) -> list[bytes]:
    p = probs(len(ids), seed)
    return [orjson.dumps({"model": MODEL, "id": e, "ts": t, "probs": p[i].tolist()})
            for i, (e, t) in enumerate(zip(ids, ts))]


def outs(ids, ts) -> list[bytes]:
    return [orjson.dumps({"model": MODEL, "id": e, "ts": t, "label": i % K})
            for i, (e, t) in enumerate(zip(ids, ts))]


def offer(st: ModelState, p: EventParser, raws: list[bytes], rec_ts: list[float]):
    """Parse with record timestamps ``rec_ts``, offer the model's batch; (result, invalid)."""
    pb = p.parse_batch(raws, rec_ts)
    mb = pb.by_model.get(MODEL)
    return (st.offer(mb) if mb is not None else None), pb.invalid


POISON = orjson.dumps({"model": MODEL, "id": "poison", "ts": 1e12,
                       "probs": [0.2, 0.3, 0.5], "label": 1})


# --------------------------------------------------------------------------- bounded event time


def test_one_future_ts_is_dead_lettered_and_does_not_destroy_joins(path):
    """The reproduction of the poisoned clock: 500 pending predictions, one sample event with
    ``ts = 1e12`` (record time now), then the 500 outcomes. Before: every prediction evicted
    by TTL, 500 outcomes ``late``, a one-sample window, drift clock at 1e12."""
    st = ModelState.create(MODEL, K, ms(), JOIN)
    p = parser()
    ids = [f"e{i}" for i in range(N)]
    pts = [T0 + i for i in range(N)]
    offer(st, p, preds(ids, pts), pts)
    assert st.join.pending(MODEL) == N
    res, invalid = offer(st, p, [POISON], [T0 + N])
    assert res is None and [b.reason for _, b in invalid] == [TS_OUT_OF_RANGE]
    ots = [t + 60 for t in pts]
    res, invalid = offer(st, p, outs(ids, ots), ots)
    assert not invalid
    assert res.joined == N
    assert res.unmatched.get("late", 0) == 0 and res.evicted.get("ttl", 0) == 0
    assert st.join.pending(MODEL) == 0
    assert st.monitor.window_size() == N
    st.check_triggers(ots[-1])
    assert st.triggers.drift.last == ots[-1]
    for clock in (st.join.clock, *st.join.wm, st.monitor.clock):
        assert clock <= ots[-1] + SKEW


def test_skew_bound_is_relative_to_each_record_timestamp(path):
    """An event exactly ``skew`` ahead passes; one a millisecond more does not; an event
    without ``ts`` takes its record timestamp; a record without a timestamp is not bounded."""
    p = parser()
    ok = orjson.dumps({"model": MODEL, "id": "a", "ts": T0 + SKEW, "label": 0})
    late = orjson.dumps({"model": MODEL, "id": "b", "ts": T0 + SKEW + 1e-3, "label": 0})
    no_ts = orjson.dumps({"model": MODEL, "id": "c", "label": 0})
    pb = p.parse_batch([ok, late, no_ts], [T0, T0, T0])
    assert [(i, b.reason) for i, b in pb.invalid] == [(1, TS_OUT_OF_RANGE)]
    mb = pb.by_model[MODEL]
    assert mb.ids == ["a", "c"] and mb.ts.tolist() == [T0 + SKEW, T0]
    assert mb.ts_limit == T0 + SKEW
    # without record timestamps (or with the bound off) nothing is bounded
    assert not parser().parse_batch([late]).invalid
    assert not parser(skew=None).parse_batch([late], [T0]).invalid


def _poisoned_checkpoint() -> bytes:
    """A checkpoint as the daemon wrote it before the bound: the join, the monitor's window and
    the drift clock all at 1e12, and no ``ts_limit``."""
    st = ModelState.create(MODEL, K, ms(), JOIN)
    p = parser(skew=None)  # the parser before the fix
    ids = [f"old{i}" for i in range(10)]
    ts = [T0 + i for i in range(10)]
    offer(st, p, preds(ids, ts), ts)
    offer(st, p, [POISON], [T0 + 10])
    st.check_triggers(1e12)
    assert st.join.clock == 1e12 and st.monitor.clock == 1e12 and st.triggers.drift.last == 1e12
    d = orjson.loads(st.to_checkpoint())
    d.pop("ts_limit", None)
    return orjson.dumps(d)


def test_poisoned_checkpoint_recovers_on_restore(path):
    """Before: after the restore the TTL never fired again, genuine samples fell outside the
    monitor's window (size 0) and the drift clock stayed at 1e12."""
    st = ModelState.from_checkpoint(_poisoned_checkpoint())
    p = parser()
    t1 = T0 + 100
    ids = [f"e{i}" for i in range(N)]
    pts = [t1 + i for i in range(N)]
    ots = [t + 60 for t in pts]
    offer(st, p, preds(ids, pts), pts)
    assert st.clocks_repaired == 1
    res, _ = offer(st, p, outs(ids, ots), ots)
    assert res.joined == N and res.unmatched.get("late", 0) == 0
    assert st.monitor.window_size() == N
    assert st.join.clock <= ots[-1] + SKEW and st.monitor.clock <= ots[-1] + SKEW
    # the drift clock is back within the skew of the record timestamps, and moves again
    assert st.triggers.drift.last <= pts[-1] + SKEW
    st.check_triggers(ots[-1] + 1000)
    assert st.triggers.drift.last == ots[-1] + 1000
    # the TTL works again: a prediction without an outcome expires an hour of event time later
    offer(st, p, preds(["lonely"], [ots[-1]]), [ots[-1]])
    t2 = ots[-1] + SKEW + 3601  # the repaired clocks may stand up to SKEW ahead
    offer(st, p, preds(["p2"], [t2]), [t2])
    res, _ = offer(st, p, outs(["p2"], [t2]), [t2])
    assert res.joined == 1 and res.evicted["ttl"] >= 1
    assert "lonely" not in st.join._models[MODEL].pending
    # the bound survives a checkpoint, and a repaired state needs no more repair
    st2 = ModelState.from_checkpoint(st.to_checkpoint())
    assert st2 == st and st2.ts_limit == st.ts_limit
    assert not st2.bound_clocks(st2.ts_limit)


# --------------------------------------------------------------------------- join order


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned_k", "learned_k"])
def test_outcomes_before_the_first_prediction_join(path, pinned):
    """Before (learned k): the outcome-only batch had no state to go to (dead-lettered as
    ``bad_schema``), and its predictions then waited forever."""
    p = parser(k=K if pinned else None)
    ids = [f"e{i}" for i in range(N)]
    ots = [T0 + 60 + i for i in range(N)]
    pb = p.parse_batch(outs(ids, ots), ots)
    assert not pb.invalid
    mb = pb.by_model[MODEL]
    k = mb.k or p.k.get(MODEL) or 0
    assert k == (K if pinned else 0)
    st = ModelState.create(MODEL, k, ms(), JOIN)
    res = st.offer(mb)
    assert res.joined == 0 and st.join.pending(MODEL) == N
    # the waiting outcomes survive a checkpoint; a restored k = 0 is not learned by the parser
    st = ModelState.from_checkpoint(st.to_checkpoint())
    p2 = parser(k=K if pinned else None)
    p2.admit(MODEL, st.k)
    assert p2.k.get(MODEL) == (K if pinned else None)
    pts = [T0 + i for i in range(N)]
    res, invalid = offer(st, p2, preds(ids, pts), [t + 120 for t in pts])
    assert not invalid
    assert st.k == K and res.joined == N and st.join.pending(MODEL) == 0
    assert st.monitor.window_size() == N and st.monitor.k == K
    assert st.pools.layout.k == K and st.samples_total == N
    st2 = ModelState.from_checkpoint(st.to_checkpoint())
    assert st2 == st


def test_learned_k_state_is_reconciled_with_a_pinned_k_keeping_the_outcomes():
    """A k = 0 state restored under settings that now pin k learns it; nothing is lost."""
    st = ModelState.create(MODEL, 0, ms(), JOIN)
    pb = parser(k=None).parse_batch(outs(["a", "b"], [T0, T0]), [T0, T0])
    st.offer(pb.by_model[MODEL])
    st2, outcome, _ = st.reconcile(ms(), JOIN, k=K)
    assert outcome == "restored" and st2.k == K and st2.join.pending(MODEL) == 2
