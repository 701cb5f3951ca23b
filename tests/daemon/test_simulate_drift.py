"""The simulator's drift schedule (daemon.tools.simulate.traffic.Drift): logit-scale and label
drifts per model, steps added during a run, the CLI form, and the stream's end (no broker)."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from daemon.tools.simulate.cli import build_parser, generator_from_args, main
from daemon.tools.simulate.model import SyntheticModel, true_label_dist
from daemon.tools.simulate.traffic import Drift, TrafficGenerator
from lpcal.errors import InputError
from lpcal.temperature import fit_temperature


def _gen(events=4000, ks=(3,), drifts=(), T=0.3, scale=5.0, **kw):
    models = [SyntheticModel(f"m{i}", k, T, scale, 0.5, seed=[3, i]) for i, k in enumerate(ks)]
    kw.setdefault("event_rate", 100.0)
    return TrafficGenerator(models, events, drifts=drifts, **kw)


def _by_id(gen) -> dict[str, dict]:
    """Event id -> {"probs": [...], "label": y} of the stream's predictions and outcomes."""
    out: dict[str, dict] = {}
    for _, _, v in gen:
        d = orjson.loads(v)
        row = out.setdefault(d["id"], {"model": d["model"]})
        row.update({k: d[k] for k in ("probs", "label") if k in d})
    return out


def _seq(eid: str) -> int:
    return int(eid.rsplit("-", 1)[1])


def _arrays(rows: dict[str, dict], model: str, lo: int, hi: int):
    ids = sorted((e for e, r in rows.items() if r["model"] == model and lo <= _seq(e) < hi),
                 key=_seq)
    return (np.array([rows[e]["probs"] for e in ids]), np.array([rows[e]["label"] for e in ids]),
            ids)


def test_logit_scale_drift_changes_the_predictions_and_keeps_the_truth():
    """From the step on, the model outputs softmax(s z) of the same draws; the labels still
    follow softmax(T z), i.e. temperature T / s of the drifted predictions."""
    n, at, s = 40_000, 20_000, 0.5
    drifted = _by_id(_gen(n, drifts=[Drift(at, logit_scale=s)]))
    plain = _by_id(_gen(n))
    f0, y0, ids = _arrays(plain, "m0", 0, n)
    f1, y1, ids1 = _arrays(drifted, "m0", 0, n)
    assert ids == ids1
    assert np.array_equal(y0, y1)                       # the labels (the world) did not change
    assert np.array_equal(f0[:at], f1[:at])             # before the step: the same predictions
    want = f0[at:] ** s / (f0[at:] ** s).sum(axis=1, keepdims=True)
    assert np.allclose(f1[at:], want, atol=1e-12)       # after it: the logits times s
    assert not np.allclose(f1[at:], f0[at:], atol=1e-3)
    # the truth in terms of the drifted predictions is temperature T / s: TS recovers it
    t_before = fit_temperature(f1[:at], y1[:at])
    t_after = fit_temperature(f1[at:], y1[at:])
    assert t_before == pytest.approx(1 / 0.3, rel=0.1)
    assert t_after == pytest.approx(s / 0.3, rel=0.1)
    q = true_label_dist(f1[at:], 0.3 / s)
    assert abs((y1[at:] == f1[at:].argmax(axis=1)).mean()
               - q[np.arange(len(q)), f1[at:].argmax(axis=1)].mean()) < 0.02


def test_schedule_per_model_and_later_steps_override_earlier_ones():
    n = 6000
    steps = [Drift(4000, logit_scale=1.0), Drift(2000, logit_scale=2.0, model="m0")]
    drifted, plain = _by_id(_gen(n, ks=(3, 4), drifts=steps)), _by_id(_gen(n, ks=(3, 4)))
    assert {e: r for e, r in drifted.items() if r["model"] == "m1"} == \
        {e: r for e, r in plain.items() if r["model"] == "m1"}   # m1 is not named: unchanged
    # m0: event index i = 2 * seq (two models interleaved): steps at events 2000 and 4000
    for lo, hi, scale in ((0, 1000, 1.0), (1000, 2000, 2.0), (2000, 3000, 1.0)):
        f1, y1, _ = _arrays(drifted, "m0", lo, hi)
        f0, y0, _ = _arrays(plain, "m0", lo, hi)
        assert np.array_equal(y0, y1)
        assert np.allclose(f1, f0 ** scale / (f0 ** scale).sum(axis=1, keepdims=True),
                           atol=1e-12), (lo, hi)


def test_label_drift_step_is_the_drift_after_shorthand_and_chunks_do_not_matter():
    a = list(_gen(3000, drift_after=1000, drift_T=0.9))
    b = list(_gen(3000, drifts=[Drift(1000, T=0.9)]))
    assert a == b
    assert a != list(_gen(3000))
    steps = [Drift(1000, T=0.9), Drift(1700, logit_scale=3.0)]
    assert list(_gen(3000, drifts=steps, chunk=7)) == list(_gen(3000, drifts=steps[::-1]))


def test_a_step_added_during_the_run_equals_the_same_schedule_given_up_front():
    up_front = list(_gen(5000, ks=(3, 4), drifts=[Drift(3000, logit_scale=0.5, model="m1")],
                         chunk=500))
    gen = _gen(5000, ks=(3, 4), chunk=500)
    got = []
    for msgs in gen.chunks():
        got.extend(msgs)
        if gen.produced == 3000:
            gen.add_drift(Drift(gen.produced, logit_scale=0.5, model="m1"))
    assert got == up_front
    gen = _gen(2000, chunk=500)
    it = gen.chunks()
    next(it)
    with pytest.raises(InputError, match="already generated"):
        gen.add_drift(Drift(100, logit_scale=0.5))
    with pytest.raises(InputError, match="unknown model 'nope'"):
        gen.add_drift(Drift(600, logit_scale=0.5, model="nope"))


def test_labelled_counts_and_stop():
    gen = _gen(4000, ks=(3, 4), orphan_frac=0.2, sample_frac=0.1, malformed_frac=0.05,
               chunk=500)
    it = gen.chunks()
    msgs = [m for _ in range(3) for m in next(it)]
    gen.stop()
    msgs += [m for chunk in it for m in chunk]
    assert gen.produced == 1500                       # no event after the chunk being made
    c = gen.counts
    assert c["outcome"] == c["prediction"] - c["orphan"]   # the pending outcomes were emitted
    joined: dict[str, int] = {}
    preds = set()
    for _, _, v in msgs:
        try:
            d = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        vector = "probs" in d or "logits" in d
        # a complete sample, or the outcome of a valid prediction
        if "label" in d and (vector or d["id"] in preds):
            joined[d["model"]] = joined.get(d["model"], 0) + 1
        elif vector:
            preds.add(d["id"])
    assert gen.labelled == joined and sum(joined.values()) > 1000


@pytest.mark.parametrize("text,want", [
    ("30000:logits=0.5", Drift(30000, logit_scale=0.5)),
    ("10:T=0.8", Drift(10, T=0.8)),
    ("7:logits=2,T=0.5,model=fraud-v3", Drift(7, 2.0, 0.5, "fraud-v3")),
])
def test_drift_parse(text, want):
    assert Drift.parse(text) == want
    assert Drift.parse(text).describe().startswith(f"from event {want.at}")


@pytest.mark.parametrize("text,match", [
    ("30000", "expected AT:"), ("x:logits=0.5", "not an integer"),
    ("5:logits=abc", "must be a number"), ("5:scale=2", "expected logits=S"),
    ("5:logits=0", "logit_scale must be > 0"), ("-1:logits=2", ">= 0"),
    ("5:T=-1", "T must be > 0"), ("5:logits=nan", "logit_scale must be > 0"),
])
def test_drift_parse_errors_say_what_is_wrong(text, match):
    with pytest.raises(InputError, match=match):
        Drift.parse(text)


def test_cli_drift_schedule(capsys):
    a = build_parser().parse_args(["--models", "a,b:4", "--events", "4000", "--start", "0",
                                   "--drift", "2000:logits=0.5,model=a",
                                   "--drift", "3000:logits=1"])
    gen = generator_from_args(a)
    assert gen.drifts == [Drift(2000, 0.5, None, "a"), Drift(3000, 1.0)]
    assert main(["--drift", "100:logits=-2", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "--drift: drift at event 100: logit_scale must be > 0" in capsys.readouterr().err
    assert main(["--models", "a", "--events", "10", "--drift", "5:logits=2,model=b",
                 "--bootstrap", "127.0.0.1:1", "--quiet"]) == 2
    assert "unknown model 'b'" in capsys.readouterr().err


def test_model_rejects_a_bad_logit_scale():
    m = SyntheticModel("m", 3, 0.3, 5.0, seed=1)
    for bad in (0.0, -1.0, math.inf, np.array([1.0, 0.0])):
        with pytest.raises(InputError, match="logit_scale must be > 0"):
            m.draw(2, logit_scale=bad)
