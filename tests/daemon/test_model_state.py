"""daemon.model_state: ingest pipeline, epochs, bin maps, exact checkpoint round trips."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from daemon.event_records import ModelPolicy
from daemon.events import EventParser
from daemon.model_state import MAX_SEALED, ModelState
from daemon.settings import JoinSettings, ModelSettings
from daemon.specs import EpochSpec
from lpcal.binmap import BinMap
from lpcal.calibrate import fit_pools
from lpcal.errors import ArtifactError, InputError
from lpcal.pools import PoolSet
from lpcal.spec import FitSpec

MODEL = "fraud-v3"
K = 3


#: small certified epochs: 80 warm-up samples, then the pools and 50 held out
CERTIFIED = {"mode": "certified", "recovery": "epochs", "holdout": 50, "warmup": 80}


def settings(**kw) -> ModelSettings:
    """Small pools; the paper's mode unless ``kw`` says otherwise (most tests here are about
    the pipeline, not the fit mode; the certified tests pass ``**CERTIFIED``, the online ones
    ``**ONLINE``, without the epoch options)."""
    base = {"eps": 0.1, "p": math.inf, "pool": 60, "mu_pool": 100, "window_samples": 2000,
            "variant": "split", "mode": "paper",
            "drift_min_samples": 100}
    if kw.get("recovery") == "online":
        for name in ("pool", "mu_pool", "variant"):
            del base[name]
    base.update(kw)
    return ModelSettings(**base)


def new_state(**kw) -> ModelState:
    return ModelState.create(MODEL, K, settings(**kw), JoinSettings(ttl_seconds=50,
                                                                  max_pending_per_model=5000))


def traffic(n, seed=0, start=0, power=2.0):
    """Prediction and outcome messages; outcomes 5 s after their predictions (the model raises
    the true probabilities to ``power`` and renormalises: overconfident above 1)."""
    rng = np.random.default_rng(seed)
    x = rng.dirichlet(np.ones(K), size=n)
    y = (x.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    raw = x**power / (x**power).sum(axis=1, keepdims=True)
    preds = [orjson.dumps({"model": MODEL, "id": f"e{start + i}", "ts": (start + i) * 0.01,
                           "probs": raw[i].tolist()}) for i in range(n)]
    outs = [orjson.dumps({"model": MODEL, "id": f"e{start + i}", "ts": (start + i) * 0.01 + 5.0,
                          "label": int(y[i])}) for i in range(n)]
    msgs = []
    for a in range(0, n, 100):  # interleave: outcomes trail predictions by one block
        msgs += preds[a:a + 100] + outs[max(0, a - 100):a]
    msgs += outs[max(0, n - 100 if n % 100 == 0 else n - n % 100):]
    return msgs


def feed(state, parser, msgs, batch=97, fit=False, topic="lpcal.predictions"):
    for a in range(0, len(msgs), batch):
        b = parser.parse_batch(msgs[a:a + batch])
        assert not b.invalid
        for mb in b.by_model.values():
            state.offer(mb)
        state.advance_offsets(topic, 0, a + min(batch, len(msgs) - a))
        while fit and state.sealed:
            pools = state.pools
            assert pools.full and pools is state.sealed[0][1]
            state.start_new_epoch()  # hand the sealed epoch off to the fit
            bm = fit_pools(pools, state.fit_spec, model_id=MODEL,
                           version=state.binmap_version + 1)
            state.install_binmap(bm.to_json(), bm.version)


def parser():
    return EventParser(lambda m: ModelPolicy(k=K))


def test_ingest_routes_by_id_and_updates_monitors():
    st = new_state()
    msgs = traffic(600)
    feed(st, parser(), msgs)
    assert st.samples_total == 600 and st.join.pending() == 0
    # pools equal a direct routing of the same joined samples
    ref = PoolSet(st.layout)
    b = parser().parse_batch(msgs)
    mb = b.by_model[MODEL]
    pred = mb.kind == 0
    ids = [i for i, k in zip(mb.ids, pred) if k]
    labels = dict(zip([i for i, k in zip(mb.ids, ~pred) if k], mb.labels[~pred].tolist()))
    ref.add(st.layout.route(ids), mb.probs[pred], np.array([labels[i] for i in ids]))
    assert st.pools == ref
    out = st.evaluate()
    assert out["raw"].n == 600 and out["calibrated"] is None  # no bin map yet
    assert st.offsets == {"lpcal.predictions": {0: len(msgs)}}


def test_epochs_seal_at_the_exact_fill_point():
    st = new_state()
    total = st.layout.total_target
    feed(st, parser(), traffic(3000, seed=1))
    assert len(st.sealed) == st.fill_epoch >= 1
    assert st.pools is st.sealed[0][1] and st.epoch == 0
    for e, (epoch, pools) in enumerate(st.sealed):
        assert epoch == e and pools.full
        # sealed at the sample that filled the last pool: some pool is exactly at its target
        fill = pools.fill()
        assert any(c == t for c, t in fill.values()) and pools.total >= total
    assert not st.filling.full
    assert sum(p.total for _, p in st.sealed) + st.filling.total == st.samples_total
    # one big batch gives the same epochs as many small ones
    other = new_state()
    feed(other, parser(), traffic(3000, seed=1), batch=6000)
    assert [p for _, p in other.sealed] == [p for _, p in st.sealed]
    assert other.filling == st.filling
    # handing off: pops sealed epochs first, then discards the filling pools
    n = len(st.sealed)
    st.start_new_epoch()
    assert len(st.sealed) == n - 1
    while st.sealed:
        st.start_new_epoch()
    before = st.fill_epoch
    st.start_new_epoch()
    assert st.fill_epoch == before + 1 and st.filling.total == 0 and st.pools is st.filling


def test_fit_install_and_new_epoch():
    st = new_state()
    feed(st, parser(), traffic(6000, seed=1), fit=True)
    assert st.epoch >= 1 and st.binmap_version == st.epoch and not st.sealed
    assert st.pools is st.filling
    assert st.binmap is not None and st.calibrator is not None
    cal = st.evaluate()["calibrated"]
    assert cal is not None and 0 < cal.n < st.samples_total  # restarted at the last install
    assert st.triggers.drift.armed


@pytest.mark.parametrize("mode", [{}, CERTIFIED], ids=["paper", "certified"])
def test_checkpoint_round_trip_is_exact_and_restart_continues_identically(mode):
    msgs = traffic(5000, seed=2)
    cut = 2717  # mid-epoch, with pending joins
    full = new_state(**mode)
    feed(full, parser(), msgs, fit=True)

    first = new_state(**mode)
    feed(first, parser(), msgs[:cut], fit=True)
    assert first.join.pending() > 0 and first.filling.total > 0 and first.binmap is not None
    blob = first.to_checkpoint()
    restored = ModelState.from_checkpoint(blob)
    # first: comparing states merges their monitor sums (a checkpoint writes them as held)
    assert restored.to_checkpoint() == blob
    assert restored == first
    assert restored.filling == first.filling
    assert restored.monitor == first.monitor
    assert restored.join == first.join
    assert restored.binmap == first.binmap and restored.binmap_version == first.binmap_version
    assert restored.offsets == first.offsets
    # restart from the checkpoint: the parser learns k from the restored state; the rest of
    # the input gives exactly the state of an uninterrupted run
    p = parser()
    p.set_k(MODEL, restored.k)
    feed(restored, p, msgs[cut:], fit=True)
    full_d, rest_d = full.to_dict(), restored.to_dict()
    for key in ("filling", "sealed", "join", "fill_epoch", "binmap_version", "samples_total"):
        assert rest_d[key] == full_d[key], key
    assert restored.filling == full.filling
    a, b = orjson.loads(restored.binmap), orjson.loads(full.binmap)
    for volatile in ("created_at", "checksum"):
        a.pop(volatile), b.pop(volatile)
    assert a == b  # the same fitted bin map (fits are deterministic)


def test_outcome_before_k_is_known_is_dropped_when_label_out_of_range():
    st = ModelState.create(MODEL, 2, settings(), JoinSettings())
    from daemon.join import KIND_OUTCOME, KIND_PREDICTION

    st.join.offer(MODEL, [KIND_OUTCOME], ["a"], [0.0], None, [2])
    res = st.offer(_batch([KIND_PREDICTION], ["a"], [[0.3, 0.7]], [-1]))
    assert res.joined == 0 and res.label_out_of_range == 1 and st.dropped_labels == 1


def _batch(kind, ids, probs, labels):
    from daemon.event_records import ModelBatch

    n = len(ids)
    return ModelBatch(MODEL, 2, np.array(kind, dtype=np.int8), list(ids), np.zeros(n),
                      np.array(probs, dtype=float), np.array(labels), np.arange(n))


def test_check_triggers_pools_full_and_manual():
    st = new_state()
    assert st.check_triggers(0.0) is None
    st.triggers.request_manual()
    assert st.check_triggers(1.0).trigger == "manual"
    feed(st, parser(), traffic(6000, seed=3))
    assert st.sealed
    assert st.check_triggers(2.0, busy=True) is None
    f = st.check_triggers(2.0)
    assert (f.trigger, f.action) == ("pools_full", "fit")
    # seal() queues partial pools; none is ever dropped: past MAX_SEALED waiting epochs the
    # state reports itself backlogged (the daemon then pauses the model's partition)
    e = st.fill_epoch
    before = [ep for ep, _ in st.sealed]
    assert st.seal() == e and st.sealed[-1][0] == e and st.fill_epoch == e + 1
    assert st.backlogged == (len(st.sealed) >= MAX_SEALED)
    for _ in range(MAX_SEALED + 1):
        st.seal()
    assert st.backlogged
    assert [ep for ep, _ in st.sealed] == before + list(range(e, e + MAX_SEALED + 2))
    while st.sealed:  # handing the epochs off, oldest first, clears the backlog
        st.start_new_epoch()
        assert st.backlogged == (len(st.sealed) >= MAX_SEALED)
    assert not st.backlogged


def test_trigger_checks_reuse_the_window_evaluation_within_eval_interval():
    """The triggers evaluate the calibrated predictor only (the drift condition reads
    nothing else), at most once per ``eval_interval`` of a clock that moves forward."""
    st = new_state()
    calls = []
    real = st.monitor.evaluate_one

    def counting(predictor, z=3.0):
        calls.append(predictor)
        return real(predictor, z)

    st.monitor.evaluate_one = counting
    for t in (0.0, 0.3, 0.9):
        st.check_triggers(t)
    assert calls == ["calibrated"]
    st.check_triggers(1.0)
    assert len(calls) == 2
    st.check_triggers(0.5)  # the clock went back: evaluate again rather than trust the cache
    assert len(calls) == 3


def resolved(st: ModelState) -> dict:
    """The fit mode values a state runs with (every default resolved)."""
    f, e = st.fit_spec, st.epoch_spec
    return {"mode": f.mode.value, "prescale": f.prescale_value.value,
            "outside": f.outside_value.value, "holdout": e.holdout, "warmup": e.warmup}


def test_epoch_layout_sizes():
    lay = ModelSettings(mode="paper").epoch_spec().layout(3)
    assert lay.variant == "shared" and set(lay.targets.values()) == {5000}  # pool unset
    lay = ModelSettings(mode="paper", pool=70, mu_pool=90, variant="split").epoch_spec().layout(3)
    assert lay.targets["mu"] == 90 and lay.targets["P0"] == 70 and lay.targets["E0"] == 70


def test_epoch_layout_adds_the_holdout_and_the_warmup():
    spec = EpochSpec(FitSpec(eps=0.1, p=math.inf, pool_size=70, mu_pool=90), holdout=30,
                     warmup=40)
    lay = spec.layout(3)
    assert (lay.holdout, lay.warmup) == (30, 40) and lay.routes[-1] == "hold"
    assert lay.total_target == 90 + 70 * (len(lay.names) - 1) + 30 + 40
    with pytest.raises(InputError, match="warm-up"):
        EpochSpec(FitSpec(eps=0.1, p=math.inf, pool_size=70), holdout=30, warmup=0)


def test_default_settings_are_the_certified_mode():
    st = ModelState.create(MODEL, K, ModelSettings(), JoinSettings())
    assert resolved(st) == {"mode": "certified", "prescale": "temperature",
                            "outside": "identity", "holdout": 3000, "warmup": 10000}
    assert st.fit_spec == ModelSettings().fit_spec() and st.fit_spec.pool_size is None
    assert set(st.layout.targets.values()) == {5000}  # pool unset: DEFAULT_POOL
    assert (st.layout.holdout, st.layout.warmup) == (3000, 10000)


def test_prescale_temperature_is_accepted_and_ingests():
    """It used to pass validation and then kill the daemon at the model's first event."""
    st = new_state(prescale="temperature", warmup=80)  # the paper's mode, pre-scaled
    assert st.fit_spec.prescale_value == "temperature" and st.layout.warmup == 80
    feed(st, parser(), traffic(3000, seed=5), fit=True)
    assert st.binmap_version >= 1
    bm = BinMap.from_json(st.binmap)
    assert bm.temperature is not None and bm.temperature > 0 and bm.certificate is None


def test_certified_epochs_warm_up_then_fill_the_pools_then_seal():
    st = new_state(**CERTIFIED)
    lay = st.layout
    assert (lay.warmup, lay.holdout) == (80, 50)
    msgs = traffic(60, seed=6)
    feed(st, parser(), msgs)
    # the first 80 joined samples only warm the temperature up, in arrival order
    assert st.samples_total == 60 and st.filling.warming
    assert all(t.total == 0 for t in st.filling.tables.values()) and st.filling.holdout.n == 0
    assert st.filling.temperature is None
    feed(st, parser(), traffic(3000, seed=6, start=60))
    assert len(st.sealed) >= 2
    for e, (epoch, pools) in enumerate(st.sealed):
        assert epoch == e and pools.full and not pools.warming
        assert pools.temperature is not None and pools.temperature > 0
        assert pools.grid.n + pools.grid.skipped == 80
        assert pools.holdout.n >= 50 and pools.holdout_raw.n == pools.holdout.n
        fill = pools.fill()
        assert any(c == t for name, (c, t) in fill.items() if name != "warmup")
    assert sum(p.total for _, p in st.sealed) + st.filling.total == st.samples_total
    # epoch boundaries depend only on the sample sequence: one big batch gives the same epochs
    other = new_state(**CERTIFIED)
    feed(other, parser(), traffic(60, seed=6) + traffic(3000, seed=6, start=60), batch=10_000)
    assert [p for _, p in other.sealed] == [p for _, p in st.sealed]
    assert other.filling == st.filling
    # the fit of a sealed epoch carries a certificate and the epoch's temperature
    pools = st.pools
    st.start_new_epoch()
    bm = fit_pools(pools, st.fit_spec, model_id=MODEL, version=1)
    data = bm.to_json()
    back = BinMap.from_json(data)
    assert back.mode == "certified" and back.temperature == pools.temperature
    cert = back.certificate
    assert cert.n_holdout == pools.holdout.n and cert.selected in ("precalibrator", "corrected")
    assert set(cert.estimates) == {"raw", "precalibrator", "corrected"}
    st.install_binmap(data, bm.version)
    feed(st, parser(), traffic(500, seed=6, start=3060))
    assert st.evaluate()["calibrated"].n == 500


def test_checkpoints_without_the_mode_keys_restore_as_the_paper_mode():
    """Checkpoints written before the certified mode lack mode/holdout/warmup (and could only
    hold prescale "none"); they restore with the paper-mode values they ran with."""
    st = new_state(outside="identity")
    feed(st, parser(), traffic(2500, seed=7), fit=True)
    blob = st.to_checkpoint()
    d = orjson.loads(blob)
    for key in ("mode", "holdout", "warmup"):
        del d["config"][key]
    old = ModelState.from_checkpoint(orjson.dumps(d))
    assert resolved(old) == {"mode": "paper", "prescale": "none", "outside": "identity",
                             "holdout": 0, "warmup": 0}
    assert old.to_checkpoint() == blob
    # and it keeps running exactly like the state it was written from
    more = traffic(2500, seed=7, start=2500)
    p = parser()
    p.set_k(MODEL, K)
    feed(old, p, more, fit=True)
    feed(st, parser(), more, fit=True)
    assert old.to_dict()["filling"] == st.to_dict()["filling"]
    assert old.binmap_version == st.binmap_version


@pytest.mark.parametrize("config, match", [
    ({"prescale": "temperature", "warmup": 0}, "warmup"),
    ({"prescale": "none", "warmup": 10}, "warmup"),
    ({"holdout": -1}, "holdout"),
    ({"mode": "bayes"}, "mode"),
])
def test_checkpoints_with_an_impossible_config_are_refused(config, match):
    st = new_state()
    d = orjson.loads(st.to_checkpoint())
    d["config"].update(config)
    with pytest.raises(ArtifactError, match=f"config.*{match}"):
        ModelState.from_checkpoint(orjson.dumps(d))


def test_checkpoints_of_format_1_still_restore():
    """/1 listed the join's recent ids as [id, state] pairs; a daemon upgraded over a state
    topic written by the previous version restores it to the same state."""
    st = new_state()
    feed(st, parser(), traffic(2500, seed=4), fit=True)
    d = st.to_dict()
    assert d["format"] == "lpcal.model_state/3"
    for m in d["join"]["models"].values():
        expired = set(m.pop("recent_expired"))
        m["recent"] = [[eid, int(i in expired)] for i, eid in enumerate(m.pop("recent_ids"))]
        assert len(m["recent"]) > 1000
    d["format"] = "lpcal.model_state/1"
    old = ModelState.from_checkpoint(orjson.dumps(d))
    assert old.to_checkpoint() == st.to_checkpoint()


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format="other/9"), "format"),
    (lambda d: d.update(model=""), "model"),
    (lambda d: d["filling"]["tables"]["mu"].update(label=[99]), "filling"),
    (lambda d: d["monitor"].update(k=7), "monitor"),
    (lambda d: d["join"].pop("models"), "join"),
    (lambda d: d["triggers"]["drift"].pop("armed"), "triggers"),
    (lambda d: d["offsets"]["lpcal.predictions"].update({"0": -4}), "offsets"),
    (lambda d: d.update(binmap='{"truncated": '), "binmap"),
    (lambda d: d["config"].pop("eps"), "config"),
])
def test_bad_checkpoints_raise_artifact_errors_naming_the_part(mutate, match):
    st = new_state()
    feed(st, parser(), traffic(2500, seed=4), fit=True)
    d = st.to_dict()
    mutate(d)
    with pytest.raises(ArtifactError, match=match):
        ModelState.from_checkpoint(orjson.dumps(d))
    with pytest.raises(ArtifactError, match="JSON"):
        ModelState.from_checkpoint(b"\x00not json")


def test_manual_request_waits_for_the_warm_up_then_fits():
    """A manual recalibration asked for while the epoch's warm-up is still fixing its
    temperature has no pools to fit: it stays pending (it used to fire, fail in fit_pools and
    drop the epoch), and fires once the warm-up is complete."""
    st = new_state(**CERTIFIED)  # warm-up first
    assert st.filling.warming
    st.triggers.request_manual()
    assert st.check_triggers(0.0) is None and st.triggers.manual_pending
    feed(st, parser(), traffic(st.layout.warmup + 50, seed=4))
    assert not st.filling.warming
    f = st.check_triggers(1.0)
    assert (f.trigger, f.action) == ("manual", "fit") and not st.triggers.manual_pending


def test_the_change_test_restarts_with_each_map_and_checkpoints_with_the_monitor():
    st, p = new_state(drift_baseline_samples=1000), parser()
    feed(st, p, traffic(6000, seed=11), fit=True)
    feed(st, p, traffic(2500, seed=11, start=6000))  # no fit: the last map stays live
    det = st.monitor.change
    assert det is not None and (det.false_alarm_rate, det.baseline_samples, det.min_shift) == (
        1e-7, 1000, 0.01)
    blocks = det.blocks
    assert 0 < blocks * det.block_samples <= st.evaluate()["calibrated"].n  # since the install
    back = ModelState.from_checkpoint(st.to_checkpoint())
    assert back.monitor.change == det and back.to_checkpoint() == st.to_checkpoint()
    st.install_binmap(st.binmap, st.binmap_version + 1)
    assert st.monitor.change.blocks == 0 and not st.change_alarm


def test_checkpoints_without_the_change_test_restore_with_its_defaults():
    """Checkpoints written before the change test lack its settings and state: they restore
    with the defaults, and the test starts its baseline with the next samples."""
    st = new_state()
    feed(st, parser(), traffic(3000, seed=12), fit=True)
    d = orjson.loads(st.to_checkpoint())
    for key in ("drift_false_alarm_rate", "drift_baseline_samples", "drift_min_shift"):
        del d["config"][key]
    del d["monitor"]["change"]
    del d["triggers"]["drift"]["cause"]
    old = ModelState.from_checkpoint(orjson.dumps(d))
    assert old.monitor_spec.drift_baseline_samples == 5000 and old.monitor.change.blocks == 0
    assert old.reconcile(settings(), JoinSettings(ttl_seconds=50,
                                                  max_pending_per_model=5000))[1] == "restored"


def test_a_changed_change_test_setting_keeps_the_window_and_restarts_the_test():
    st, p = new_state(drift_baseline_samples=1000), parser()
    feed(st, p, traffic(6000, seed=13), fit=True)
    feed(st, p, traffic(2500, seed=13, start=6000))
    assert st.monitor.change.blocks > 0
    new, outcome, detail = st.reconcile(settings(drift_baseline_samples=1000,
                                                 drift_min_shift=0.05),
                                        JoinSettings(ttl_seconds=50, max_pending_per_model=5000))
    assert outcome == "config_changed" and "drift_min_shift" in detail
    assert new.monitor is st.monitor and new.monitor.change.min_shift == 0.05
    assert new.monitor.change.blocks == 0


def test_a_checkpoint_written_before_the_specs_restores_into_them():
    """``tests/data/model_state_3.json`` was written by the daemon that kept a config dict
    (certified, ``pool`` unset, 280 joined samples, 20 predictions waiting): it restores into
    the specs its settings give, reconciles as unchanged and is written back as it was, but for
    the change test's snapshot (the confidence gap is tested by its size since: the signed
    test's ``cusum_low`` is gone, ``absolute`` names the statistics tested by size)."""
    from pathlib import Path

    data = (Path(__file__).parents[1] / "data" / "model_state_3.json").read_bytes()
    ms = ModelSettings(eps=0.1, p=math.inf, mu_pool=100, window_samples=2000, mode="certified",
                       recovery="epochs", holdout=50, warmup=80, drift_min_samples=100)
    join = JoinSettings(ttl_seconds=50, max_pending_per_model=5000)
    st = ModelState.from_checkpoint(data)
    assert st.epoch_spec == ms.epoch_spec() and st.monitor_spec == ms.monitor_spec()
    assert (st.samples_total, st.join.pending()) == (280, 20) and st.fit_spec.pool_size is None
    assert st.reconcile(ms, join) == (st, "restored", "")
    back, orig = st.to_dict(), orjson.loads(data)
    test, orig_test = back["monitor"]["change"]["test"], orig["monitor"]["change"]["test"]
    assert orig_test.pop("cusum_low") == {"confidence_gap": 0.0}
    assert test.pop("absolute") == ["confidence_gap"] and test == orig_test
    back["monitor"]["change"]["test"] = orig["monitor"]["change"]["test"] = None
    assert orjson.dumps(back) == orjson.dumps(orig)
    # and it runs on like a state created from these settings and fed the same events
    fresh = ModelState.create(MODEL, K, ms, join)
    assert fresh.layout == st.layout and fresh.monitor.change == st.monitor.change


def test_reconcile_compares_the_epoch_spec_and_the_monitor_spec():
    st, p = new_state(), parser()
    feed(st, p, traffic(2500, seed=14), fit=True)
    assert st.binmap is not None
    join = JoinSettings(ttl_seconds=50, max_pending_per_model=5000)
    # the monitor spec only: pools, epoch and map kept, a new window, the same triggers
    new, outcome, detail = st.reconcile(settings(window_samples=500), join)
    assert (outcome, detail) == ("config_changed", "window_samples 2000 -> 500")
    assert new.filling is st.filling and new.sealed is st.sealed and new.binmap == st.binmap
    assert new.monitor is not st.monitor and new.triggers is st.triggers
    # an option of the epoch spec: a new epoch; the same lambda keeps the map and the window
    new, outcome, detail = st.reconcile(settings(delta=0.05), join)
    assert (outcome, detail) == ("config_changed", "delta 0.1 -> 0.05; a new epoch starts")
    assert new.filling is not st.filling and new.fill_epoch == st.fill_epoch + len(st.sealed) + 1
    assert new.monitor is st.monitor and new.binmap == st.binmap
    assert new.epoch_spec == settings(delta=0.05).epoch_spec()
    # eps moves lambda: the window and the map go too
    with pytest.warns(UserWarning, match="mu pool"):  # 100 samples, below 6/beta at eps 0.05
        new, _, detail = st.reconcile(settings(eps=0.05), join)
    assert "eps 0.1 -> 0.05" in detail and "lambda 10 -> 20" in detail and new.binmap is None
    assert new.lam == 20 and new.layout.lam == 20


# ---------------------------------------------------------------- online recovery mode
ONLINE = {"recovery": "online", "mode": "certified", "bucket_size": 500, "fit_delay": 500,
          "warmup_tol": 0.2}


def online_trace(res_list):
    return [(e.n, e.kind, e.version, e.temperature) for r in res_list for e in r.events]


def feed_online(state, p, msgs, batch=97, complete="when_blocked"):
    """Feed like the daemon: run each fit request (here at once, or only when the state is
    backlogged, i.e. the input must pause) and hand it back with complete_fit."""
    from lpcal.online import run_fit

    out, queue = [], []
    for a in range(0, len(msgs), batch):
        b = p.parse_batch(msgs[a:a + batch])
        for mb in b.by_model.values():
            res = state.offer(mb)
            out.append(res)
            queue += res.fit_requests
            while queue and (complete == "at_once" or state.backlogged):
                req = queue.pop(0)
                res = state.complete_fit(req, run_fit(req))
                out.append(res)
                queue += res.fit_requests
            assert not state.backlogged
        state.advance_offsets("lpcal.predictions", 0, a + min(batch, len(msgs) - a))
    return out


def test_online_mode_publishes_and_installs_maps_from_the_calibrator():
    st, p = new_state(**ONLINE), parser()
    assert st.online is not None and st.filling.total == 0
    out = feed_online(st, p, traffic(6000, seed=3))
    pubs = [bm for r in out for bm in r.published]
    assert pubs and st.binmap_version == pubs[-1].version == st.online.version
    assert BinMap.from_json(st.binmap).temperature == pytest.approx(2.0, rel=0.1)
    assert st.filling.total == 0 and not st.sealed          # the epochs' pools stay empty
    assert st.evaluate()["calibrated"] is not None
    assert st.samples_total == st.online.n_seen


def test_online_mode_replay_gives_the_same_decisions_whatever_the_batching_and_fit_timing():
    msgs = traffic(9000, seed=4)
    a, b = new_state(**ONLINE), new_state(**ONLINE)
    ta = online_trace(feed_online(a, parser(), msgs, batch=97))
    tb = online_trace(feed_online(b, parser(), msgs, batch=640, complete="at_once"))
    assert ta == tb
    kinds = {kind for _, kind, _, _ in ta}
    assert {"warmup_end", "published", "fit_requested", "fit_done"} <= kinds
    assert a.online.to_dict()["window"] == b.online.to_dict()["window"]
    assert a.binmap_version == b.binmap_version and a.binmap is not None
    # the calibrated window restarted at the same sample (its float sums depend on batching)
    assert a.evaluate()["calibrated"].n == b.evaluate()["calibrated"].n


def _calibrator_state(st) -> dict:
    """The online calibrator's checkpoint without what differs between two runs making the
    same decisions: the maps' ``created_at`` and ``checksum``."""
    import orjson

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("created_at", "checksum")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        if isinstance(x, str) and x.startswith("{"):
            return strip(orjson.loads(x))
        return x

    return strip(st.online.to_dict())


def test_several_maps_published_in_one_batch_leave_the_loop_as_small_batches_do():
    """A batch in which the loop publishes more than one map installs them in the state in
    order without installing them back into the loop (which would reset its tests and its
    record of the live map depending on batching): its whole state is the one of small
    batches."""
    msgs = traffic(30_000, seed=7)
    small, big = new_state(**ONLINE), new_state(**ONLINE)
    feed_online(small, parser(), msgs, batch=50, complete="at_once")
    out = feed_online(big, parser(), msgs, batch=10_000, complete="at_once")
    assert max(len(r.published) for r in out) >= 2  # the case this is about
    assert big.binmap_version == small.binmap_version == big.online.version >= 3
    assert _calibrator_state(big) == _calibrator_state(small)
    live = [BinMap.from_json(st.binmap) for st in (big, small)]
    assert live[0].temperature == live[1].temperature and live[0].n_bins == live[1].n_bins


def test_online_mode_blocks_until_the_fit_is_back_then_drains_the_backlog():
    from lpcal.online import run_fit

    st, p = new_state(**ONLINE), parser()
    reqs = []
    for a in range(0, 18000, 1000):
        for mb in p.parse_batch(traffic(9000, seed=5)[a:a + 1000]).by_model.values():
            res = st.offer(mb)
            reqs += res.fit_requests
        if st.backlogged:
            break
    assert st.backlogged and reqs and st.online.blocked
    req = reqs[0]
    assert st.online.n_seen == req.due and st.backlog is not None
    assert st.fit_requests_outstanding == [req]
    # a checkpoint while blocked keeps the backlog and re-issues the request
    back = ModelState.from_checkpoint(st.to_checkpoint())
    assert back.backlogged and [r.id for r in back.fit_requests_outstanding] == [req.id]
    assert np.array_equal(back.backlog[0], st.backlog[0])
    assert back.to_checkpoint() == st.to_checkpoint()
    waiting = st.backlog[1].size
    res = st.complete_fit(req, run_fit(req))
    assert res.events and res.events[0].kind == "fit_done" and res.events[0].n == req.due
    assert st.online.n_seen == req.due + waiting and st.backlog is None and not st.backlogged
    res2 = back.complete_fit(back.fit_requests_outstanding[0],
                             run_fit(back.fit_requests_outstanding[0]))
    assert online_trace([res]) == online_trace([res2])


def test_online_checkpoint_round_trip_is_exact_and_epochs_states_have_no_recovery():
    st, p = new_state(**ONLINE), parser()
    feed_online(st, p, traffic(4000, seed=6))
    blob = st.to_checkpoint()
    assert orjson.loads(blob)["format"] == "lpcal.model_state/6"
    back = ModelState.from_checkpoint(blob)
    assert back.to_checkpoint() == blob and back == st and back.online_spec == st.online_spec
    # the rest of the stream gives the same decisions restored or not
    rest = traffic(7000, seed=6)[len(traffic(4000, seed=6)):]
    q = parser()
    q.set_k(MODEL, K)
    assert online_trace(feed_online(back, q, rest)) == online_trace(feed_online(st, parser(),
                                                                                rest))
    ep = new_state()
    feed(ep, parser(), traffic(500, seed=6))
    d = orjson.loads(ep.to_checkpoint())
    assert d["format"] == "lpcal.model_state/6" and "recovery" not in d and "online" not in d
    bad = orjson.loads(blob)
    bad["backlog"] = {"n": 2, "probs": "AAAA", "labels": "", "uniforms": "", "ts": None}
    with pytest.raises(ArtifactError, match="backlog"):
        ModelState.from_dict(bad)


def test_online_drift_refill_keeps_only_post_drift_samples_and_the_live_map():
    st, p = new_state(**ONLINE), parser()
    feed_online(st, p, traffic(6000, seed=7))
    live, version = st.binmap, st.binmap_version
    assert live is not None and st.online.window.n > 0
    ev = st.notify_drift()
    assert ev.kind == "drift" and st.online.warming and st.online.window.n == 0
    assert st.binmap == live and st.binmap_version == version   # kept until beaten
    assert st.request_fit() == []                                # nothing to fit: warming


class _Stats:
    """A window evaluation whose Err_p lower bound is far above any drift threshold."""
    n, lower = 10**6, 1.0


def test_online_threshold_firing_fits_and_keeps_the_window_a_change_alarm_resets_it():
    """The absolute threshold says the live map is not good enough, not that the data changed:
    the window stays and the next decision point fits; only the change test resets it."""
    st, p = new_state(**ONLINE), parser()
    feed_online(st, p, traffic(6000, seed=7))
    n, start = st.online.window.n, st.online.regime_start
    drift = st.triggers.drift
    assert drift.observe(_Stats(), 0.0) is False or drift.sustain == 0
    f = st.triggers.check(now=drift.sustain + 1.0, pools_full=False, stats=_Stats())
    assert (f.trigger, f.action, drift.cause) == ("drift", "refill", "threshold")
    assert st.respond_online(f) == "fit_requested"
    assert st.online.window.n == n and st.online.regime_start == start
    assert st.online.next_fit_at is not None and not st.online.warming
    assert drift.armed                    # the change test can still declare a drift
    f = st.triggers.check(now=drift.sustain + 2.0, pools_full=False, stats=None, change=True)
    assert (f.action, drift.cause) == ("refill", "change")
    assert st.respond_online(f) == "window_reset"
    assert st.online.window.n == 0 and st.online.warming and not drift.armed


def test_online_manual_request_schedules_a_fit_at_the_next_decision_point():
    st, p = new_state(**ONLINE), parser()
    st.triggers.request_manual()
    assert st.online.warming and st.check_triggers(0.0) is None   # waits for the warm-up
    msgs = traffic(6100, seed=8)
    feed_online(st, p, msgs[:-200], complete="at_once")   # no request left unrun
    assert not st.online.warming
    f = st.check_triggers(1.0)
    assert (f.trigger, f.action) == ("manual", "fit")
    ev = st.request_fit()
    assert [e.kind for e in ev] == ["fit_scheduled"]
    step = st.online.config.step
    at = (st.online.n_seen // step + 1) * step
    assert st.online.next_fit_at + st.online.regime_start == at
    out = feed_online(st, p, msgs[-200:] + traffic(6600, seed=8)[-500:], batch=50)
    assert any(e.n == at and e.kind in ("fit_requested", "kept", "published", "shadow")
               for r in out for e in r.events)


def test_pool_fill_is_the_epoch_pools_and_none_online():
    ep, on = new_state(), new_state(**ONLINE)
    fill = ep.pool_fill()
    assert fill == ep.pools.fill() and set(fill) >= {"mu"} and fill["mu"][1] > 0
    assert on.pool_fill() is None


def test_online_state_bytes_follow_the_budget():
    st, p = new_state(**{**ONLINE, "window_buckets": 20}), parser()
    st.set_budget(400_000)
    feed_online(st, p, traffic(9000, seed=9))
    sealed = sum(b.nbytes for b in st.online.window.buckets[:-1])
    assert sealed <= 0.5 * 400_000 and st.online.config.max_bytes == 200_000
    assert len(st.online.window.buckets) < 18     # trimmed below the ring's 20 buckets
    assert st.nbytes >= st.online.nbytes > 0


def test_reconcile_switches_between_epochs_and_online_keeping_the_live_map():
    st, p = new_state(), parser()
    feed(st, p, traffic(2500, seed=10), fit=True)
    assert st.binmap is not None
    join = JoinSettings(ttl_seconds=50, max_pending_per_model=5000)
    on, outcome, detail = st.reconcile(settings(recovery="online", mode="certified"), join)
    assert outcome == "config_changed" and "recovery 'epochs' -> 'online'" in detail
    assert on.online is not None and on.binmap == st.binmap
    assert on.binmap_version == on.online.version == st.binmap_version
    assert on.online.live is not None and on.filling.total == 0
    # a knob of the online loop: a fresh calibrator, the same map
    on2, _, detail = on.reconcile(settings(recovery="online", mode="certified",
                                              challenger_alpha=0.01), join)
    assert "challenger_alpha 0.05 -> 0.01" in detail and on2.online is not on.online
    assert on2.online.config.alpha == 0.01 and on2.binmap == st.binmap
    same, outcome, _ = on2.reconcile(settings(recovery="online", mode="certified",
                                              challenger_alpha=0.01), join)
    assert outcome == "restored" and same is on2
    back, _, detail = on2.reconcile(settings(), join)
    assert "recovery 'online' -> 'epochs'" in detail and back.online is None
    assert back.binmap == st.binmap and back.binmap_version == st.binmap_version


@pytest.mark.parametrize("kw, match", [
    ({"bucket_size": 300}, "bucket_size"), ({"fit_delay": 100}, "fit_delay"),
    ({"window_buckets": 1}, "window_buckets"), ({"challenger_alpha": 0.7}, "challenger_alpha"),
    ({"recovery": "eager"}, "recovery"), ({"warmup_tol": 0}, "warmup_tol")])
def test_online_settings_are_validated(kw, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        settings(**kw)


def test_online_checkpoint_with_mismatched_calibrator_settings_is_refused():
    st, p = new_state(**ONLINE), parser()
    feed_online(st, p, traffic(1000, seed=11))
    d = orjson.loads(st.to_checkpoint())
    d["recovery"]["challenger_alpha"] = 0.01
    with pytest.raises(ArtifactError, match="online: .*settings do not match"):
        ModelState.from_dict(d)
    d = orjson.loads(st.to_checkpoint())
    d["recovery"]["recovery"] = "epochs"
    with pytest.raises(ArtifactError, match="recovery"):
        ModelState.from_dict(d)


def test_online_state_learns_k_from_its_first_prediction():
    st = ModelState.create(MODEL, 0, settings(**ONLINE),
                           JoinSettings(ttl_seconds=50, max_pending_per_model=5000))
    assert st.online is None and not st.backlogged
    blob = st.to_checkpoint()
    assert orjson.loads(blob)["online"] is None
    assert ModelState.from_checkpoint(blob).to_checkpoint() == blob
    p = EventParser(lambda m: ModelPolicy(k=None))
    feed_online(st, p, traffic(3000, seed=12))
    assert st.k == K and st.online is not None and st.online.k == K
    assert st.online.n_seen == st.samples_total > 0


def test_a_map_installed_from_outside_becomes_the_online_champion():
    st, p = new_state(**ONLINE), parser()
    feed_online(st, p, traffic(3000, seed=13))
    bm = BinMap.from_json(st.binmap)
    st.install_binmap(bm.to_json(), st.binmap_version + 5)   # e.g. restored from the topic
    assert st.online.version == st.binmap_version == bm.version + 5
    assert st.online.live is not None and st.online.tests == 0
    v = st.online.version
    out = feed_online(st, p, traffic(9000, seed=13)[len(traffic(3000, seed=13)):])
    # the loop now tests its candidates against the installed map, which is as good as they
    # are: kept (a refinement needs the loop's own live estimate, so none is published)
    kept = [e for r in out for e in r.events if e.kind == "kept"]
    assert kept and not [b for r in out for b in r.published]
    assert st.online.version == st.binmap_version == v


def test_the_change_test_keeps_its_baseline_across_maps_of_one_regime():
    """A map the online loop publishes in the regime of the live map (a refinement, a
    re-certified copy) keeps the change test's baseline and CUSUM (restarting them at every
    map leaves the test blind while maps come often); the first map after a drift notification
    restarts them."""
    st = new_state(**ONLINE, drift_baseline_samples=1_000)
    p = parser()
    versions, kept, start = [], [], 0
    for chunk in range(12):
        msgs = traffic(2_000, seed=40 + chunk, start=start)
        start += 2_000
        before = (st.binmap_version, st.monitor.change.blocks)
        feed_online(st, p, msgs, batch=500, complete="at_once")
        if st.binmap_version > before[0] and before[0] >= 1:
            kept.append(st.monitor.change.blocks >= before[1])
        versions.append(st.binmap_version)
    assert st.binmap_version >= 3 and kept, versions  # maps replaced maps of the regime
    assert all(kept) and st.monitor.change.testing
    v, blocks = st.binmap_version, st.monitor.change.blocks
    st.notify_drift()
    while st.binmap_version == v and start < 120_000:  # the model drifted: underconfident
        feed_online(st, p, traffic(2_000, seed=start, start=start, power=0.5), batch=500,
                    complete="at_once")
        start += 2_000
    assert st.binmap_version > v, "no map after the drift notification"
    # the map after the drift restarted the test: fewer blocks than had been counted
    assert st.monitor.change.blocks < blocks
