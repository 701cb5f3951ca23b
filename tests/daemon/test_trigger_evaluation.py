"""Where the window evaluations of triggers and gauges run: ``ModelState.check_triggers(lazy=
True)`` (what the Fitter asks) skips the evaluation while the drift condition cannot hold and
decides exactly what an evaluating check decides; ``GaugeExporter.export_due`` evaluates within
a time budget and keeps the models it did not reach first in line."""

from __future__ import annotations

import math

import numpy as np
import orjson

from daemon.events import EventParser
from daemon.model_state import ModelState
from daemon.settings import Settings
from lpcal.calibrate import fit_pools
from tests.support.daemon_stubs import broker_free_daemon

MODEL, K = "eval-unit", 3


def settings(**kw) -> Settings:
    model = {"k": K, "pool": 40, "mu_pool": 80, "mode": "paper", "recovery": "epochs",
             "drift_threshold": 0.001, "drift_sustain_seconds": 0.0, "drift_min_samples": 300,
             "drift_false_alarm_rate": 0.0}
    model.update(kw)
    return Settings(models={MODEL: model})


def offer(s: Settings, st: ModelState, start: int, n: int, power: float = 1.0) -> None:
    """``n`` complete samples (ids from ``start``, ``ts = id``); ``power > 1``: overconfident."""
    rng = np.random.default_rng(start)
    x = rng.dirichlet(np.ones(K), size=n)
    y = (x.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    p = x**power / (x**power).sum(axis=1, keepdims=True)
    values = [orjson.dumps({"model": MODEL, "id": f"u{start + i}", "ts": float(start + i),
                            "probs": p[i].tolist(), "label": int(y[i])}) for i in range(n)]
    for mb in EventParser.from_settings(s).parse_batch(values).by_model.values():
        st.offer(mb)


def counting(st: ModelState) -> list[float]:
    """Count the trigger checks' evaluations of ``st``'s window (of its calibrated predictor,
    the one the drift condition reads; on this instance only)."""
    calls: list[float] = []
    real = st.monitor.evaluate_one

    def evaluate_one(predictor, z=3.0):
        assert predictor == "calibrated"
        calls.append(z)
        return real(predictor, z)

    st.monitor.evaluate_one = evaluate_one
    return calls


def test_lazy_checks_evaluate_only_when_the_drift_condition_can_hold_and_decide_the_same():
    s = settings()
    lazy, eager = (ModelState.create(MODEL, K, s.model_settings(MODEL), s.join)
                   for _ in range(2))
    lazy_calls, eager_calls = counting(lazy), counting(eager)
    for st in (lazy, eager):
        offer(s, st, 0, 600)
    for t in (1.0, 2.0, 3.0):  # no bin map: nothing to evaluate
        assert lazy.check_triggers(t, lazy=True) == eager.check_triggers(t)
    assert lazy_calls == [] and len(eager_calls) == 3
    pools = lazy.pools
    assert pools.full
    bm = fit_pools(pools, lazy.fit_spec, model_id=MODEL, version=1)
    firings = {"lazy": [], "eager": []}
    for st in (lazy, eager):
        st.start_new_epoch()
        st.install_binmap(bm.to_json(), 1)
    n = 600
    for step in range(12):  # then an overconfident model: the calibrated window drifts
        for st in (lazy, eager):
            offer(s, st, n, 50, power=1.0 if step < 4 else 4.0)
            while st.sealed:
                st.start_new_epoch()
        n += 50
        t = 10.0 + step
        firings["lazy"].append(lazy.check_triggers(t, lazy=True))
        firings["eager"].append(eager.check_triggers(t))
    assert firings["lazy"] == firings["eager"]
    assert any(f is not None and f.trigger == "drift" for f in firings["lazy"])
    assert lazy_calls  # evaluated once the window could satisfy the condition
    assert lazy.triggers == eager.triggers
    # a bin map, but fewer samples in the window than min_samples: nothing to evaluate either
    small = ModelState.create(MODEL, K, s.model_settings(MODEL), s.join)
    small.install_binmap(bm.to_json(), 1)
    small_calls = counting(small)
    offer(s, small, 0, 299, power=4.0)
    assert small.check_triggers(1.0, lazy=True) is None and small_calls == []
    offer(s, small, 299, 1, power=4.0)
    small.check_triggers(2.0, lazy=True)
    assert len(small_calls) == 1


def test_gauge_evaluations_keep_to_their_budget_and_the_rest_stay_first_in_line():
    s = Settings(max_models=30, defaults={"pool": 40, "mu_pool": 80, "mode": "paper",
                                          "recovery": "epochs"})
    d = broker_free_daemon(s)
    models = [f"g{i:02d}" for i in range(20)]
    for m in models:
        d.registry.create(m, K, 0)
        offer_to = d.registry.slots[m].state
        values = [orjson.dumps({"model": m, "id": f"{m}-{i}", "ts": float(i),
                                "probs": [0.5, 0.3, 0.2], "label": i % K}) for i in range(30)]
        d.parser.admit(m, K)
        for mb in d.parser.parse_batch(values).by_model.values():
            offer_to.offer(mb)
        d.gauges.schedule(m, 5.0)
    assert d.gauges.export_due(4.0, budget=math.inf) == 0     # none due yet
    first = d.gauges.export_due(6.0, budget=0.0)               # at least one, not all
    assert 1 <= first < len(models) and len(d.gauges.due) == len(models) - first
    late = d.gauges.due.pop_due(6.0, 1)[0]
    d.gauges.due.schedule(late, -math.inf)
    d.gauges.schedule("not-yet", 100.0)
    assert d.gauges.export_due(7.0, budget=math.inf) == len(models) - first
    assert list(d.gauges.due) == ["not-yet"]
    rows = {r.model: r for r in d.gauges.rows()}
    assert all(rows[m].window_samples == 30 for m in models)
    assert d.registry.slots[late].gauges_at == 7.0


def test_the_change_score_is_read_at_scrape_time_not_at_the_evaluation_cadence():
    """The window gauges wait for their evaluation; the change test's score (the alert's
    condition) is the detector's current value at every scrape."""
    s = Settings(max_models=3, defaults={"drift_baseline_samples": 1_000})
    d = broker_free_daemon(s)
    d.registry.create(MODEL, K, 0)
    st = d.registry.slots[MODEL].state
    change = st.monitor.change
    assert change is not None
    d.gauges.export_due(0.0, budget=math.inf)
    before = {r.model: r for r in d.gauges.rows()}[MODEL].drift_change_score
    assert before == 0.0
    # the test sees blocks (as the monitor hands them over while samples arrive) and alarms;
    # the window is not evaluated again: the row shows the new score
    from daemon.drift import STATISTICS

    name = STATISTICS[0]
    for _ in range(change.baseline_blocks):
        change.observe_block({name: (0.02, 0.001)})
    while not change.alarm:
        change.observe_block({name: (0.5, 0.001)})
    assert change.score >= 1.0
    row = {r.model: r for r in d.gauges.rows()}[MODEL]
    assert row.drift_change_score == change.score
