"""daemon.trigger: sustained drift with a confidence margin; the Triggers state machine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from daemon.monitor import WindowMonitor, WindowStats
from daemon.trigger import DriftTrigger, Firing, Triggers
from lpcal.errors import InputError


def stats(lower: float, n: int = 5000, err: float | None = None) -> WindowStats:
    err = lower + 0.01 if err is None else err
    return WindowStats(n=n, err_p=err, lower=lower, margin=err - lower, stderr=0.005, z=3.0,
                       ece=0.0, brier=0.0, accuracy=0.0, n_bins=1)


def test_fires_only_after_the_condition_is_sustained():
    t = DriftTrigger(threshold=0.1, sustain_seconds=60, min_samples=100)
    assert not t.observe(stats(0.2), 0.0)
    assert not t.observe(stats(0.2), 30.0)
    assert t.drifting_for == 30.0
    assert not t.observe(stats(0.05), 40.0)          # dips below: the run restarts
    assert t.drifting_for == 0.0
    assert not t.observe(stats(0.2), 50.0)
    assert not t.observe(stats(0.2), 109.0)
    assert t.observe(stats(0.2), 110.0)              # 60 s continuously
    assert not t.observe(stats(0.2), 500.0)          # disarmed after firing
    t.rearm()
    assert not t.observe(stats(0.2), 501.0)
    assert t.observe(stats(0.2), 561.0) and t.fired == 2


def test_needs_min_samples_and_lower_bound_not_estimate():
    t = DriftTrigger(threshold=0.1, sustain_seconds=0, min_samples=1000)
    assert not t.observe(stats(0.5, n=999), 0.0)
    assert not t.observe(None, 1.0)
    assert not t.observe(stats(0.09, err=0.2), 2.0)  # estimate above, lower bound below
    assert t.observe(stats(0.11, err=0.2), 3.0)


def test_clock_never_goes_back():
    t = DriftTrigger(threshold=0.1, sustain_seconds=10, min_samples=1)
    t.observe(stats(0.2), 100.0)
    assert not t.observe(stats(0.2), 50.0)   # treated as t=100
    assert t.observe(stats(0.2), 110.0)


def test_bad_parameters():
    with pytest.raises(InputError):
        DriftTrigger(threshold=0.0, sustain_seconds=1)
    with pytest.raises(InputError):
        DriftTrigger(threshold=0.1, sustain_seconds=-1)


def test_triggers_state_machine():
    tr = Triggers(DriftTrigger(threshold=0.1, sustain_seconds=10, min_samples=1))
    assert tr.check(now=0, pools_full=False, stats=stats(0.0)) is None
    assert tr.check(now=1, pools_full=True) == Firing("pools_full", "fit")
    tr.request_manual()
    assert tr.check(now=2, pools_full=False, busy=True) is None     # waits for the fit
    assert tr.check(now=3, pools_full=True) == Firing("manual", "fit")  # manual first
    assert tr.check(now=4, pools_full=False) is None
    # drift: refill, and the fit after the refill is labelled "drift"
    assert tr.check(now=10, pools_full=False, stats=stats(0.3)) is None
    assert tr.check(now=20, pools_full=False, stats=stats(0.3)) == Firing("drift", "refill")
    assert tr.check(now=40, pools_full=False, stats=stats(0.3)) is None  # disarmed
    assert tr.check(now=50, pools_full=True, stats=stats(0.3)) == Firing("drift", "fit")
    tr.recalibrated()
    assert tr.refill_cause is None and tr.drift.armed
    assert tr.check(now=60, pools_full=True) == Firing("pools_full", "fit")
    assert Triggers.from_dict(tr.to_dict()) == tr
    d = tr.to_dict()
    d["refill_cause"] = "bogus"
    with pytest.raises(InputError):
        Triggers.from_dict(d)


# ----------------------------------------------------------------------------- simulation

EPS = 0.1
LAM = 10  # lambda for eps = 0.1, p = inf
# A calibrated-looking predictor: four level-set bins of mass 1/4 whose class-0 conditional
# error is 0.4, so Err(v, 0) = 0.25 * 0.4 = 0.1 = eps exactly: the boundary of "calibrated".
CENTRES = np.array([[0.7, 0.2, 0.1], [0.15, 0.7, 0.15], [0.1, 0.1, 0.8], [0.45, 0.45, 0.1]])
AT_EPS = np.array([[0.3, 0.6, 0.1], [0.55, 0.3, 0.15], [0.5, 0.1, 0.4], [0.05, 0.85, 0.1]])
DRIFTED = np.array([[0.0, 0.9, 0.1], [0.95, 0.0, 0.05], [0.9, 0.0, 0.1], [0.0, 0.9, 0.1]])


def population_err(q):
    return float((0.25 * np.abs(CENTRES - q)).max())


def simulate(seed, drift_at=None, seconds=600, per_second=200):
    """Feed a stream through a monitor and a drift trigger; return firing times and how often a
    naive 'plug-in estimate above threshold' rule would have been true."""
    rng = np.random.default_rng(seed)
    mon = WindowMonitor(3, LAM, math.inf, window_samples=4000)
    trig = DriftTrigger(threshold=EPS, sustain_seconds=30, min_samples=1000)
    fired, naive = [], 0
    for t in range(seconds):
        q = DRIFTED if (drift_at is not None and t >= drift_at) else AT_EPS
        c = rng.integers(0, 4, size=per_second)
        x = CENTRES[c]
        y = (q[c].cumsum(axis=1) > rng.random((per_second, 1))).argmax(axis=1)
        mon.update(x, y, calibrated=x)
        s = mon.evaluate(z=3.0)["calibrated"]
        naive += s.err_p > EPS
        if trig.observe(s, float(t)):
            fired.append(t)
            trig.rearm()
    return fired, naive / seconds


def test_population_errors():
    assert math.isclose(population_err(AT_EPS), EPS)
    assert population_err(DRIFTED) >= 2 * EPS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_alone_does_not_fire(seed):
    fired, naive_rate = simulate(seed)
    assert fired == []
    # without the margin the plug-in sits above the threshold much of the time
    assert naive_rate > 0.3


def test_a_real_drift_fires_soon_after_it_starts():
    fired, _ = simulate(3, drift_at=200, seconds=320)
    assert fired, "drift never detected"
    assert 200 + 30 <= fired[0] <= 200 + 30 + 20  # sustain + at most one window of 20 s
