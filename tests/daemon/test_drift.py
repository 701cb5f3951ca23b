"""daemon.drift: the change test of the live bin map (baseline, CUSUMs, false-alarm rate),
fed by the monitor in blocks that depend only on the samples; snapshots; the trigger wiring."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from daemon.drift import (
    BLOCK_SAMPLES,
    STATISTICS,
    ChangeDetector,
    _arl,
    cusum_threshold,
)
from daemon.monitor import WindowMonitor
from daemon.trigger import DriftTrigger, Firing, Triggers
from lpcal.errors import InputError


def block(rng, mean: float = 0.0, se: float = 1.0, gap: float | None = None) -> dict:
    """One block's statistics: every statistic ~ N(mean, se^2) (``gap``: the confidence gap's
    mean instead)."""
    out = {s: (float(rng.normal(mean, se)), se) for s in STATISTICS}
    if gap is not None:
        out["confidence_gap"] = (float(rng.normal(gap, se)), se)
    return out


def test_threshold_inverts_siegmunds_run_length():
    for arl in (10.0, 1e3, 1e6):
        h = cusum_threshold(arl)
        assert _arl(h, 0.5) == pytest.approx(arl, rel=1e-6)
    assert cusum_threshold(1e6) > cusum_threshold(1e3) > cusum_threshold(10.0)
    # a lower false-alarm rate means a higher threshold
    lo = ChangeDetector(false_alarm_rate=1e-8, baseline_samples=1000, min_shift=0.0)
    hi = ChangeDetector(false_alarm_rate=1e-4, baseline_samples=1000, min_shift=0.0)
    assert lo.threshold > hi.threshold


def test_false_alarms_stay_below_the_design_rate_under_no_change():
    """Normal blocks with no change: the mean number of blocks to a false alarm is at least
    the design run length (Siegmund's approximation is conservative for KREF = 0.5 with the
    baseline margin)."""
    rate = 1.0 / (200 * BLOCK_SAMPLES)            # design: 200 blocks per statistic
    det = ChangeDetector(false_alarm_rate=rate, baseline_samples=5 * BLOCK_SAMPLES,
                         min_shift=0.0)
    design = len(STATISTICS) / (rate * BLOCK_SAMPLES)  # blocks per false alarm
    rng = np.random.default_rng(0)
    blocks, alarms = 0, 0
    while blocks < 20 * design:
        blocks += 1
        if det.observe_block(block(rng)):
            alarms += 1
            det.reset()
    assert alarms <= 20 * 2  # expected <= 20 at the design rate; 40 is far in the tail


def test_detects_a_shift_after_the_baseline_and_latches():
    rng = np.random.default_rng(1)
    det = ChangeDetector(false_alarm_rate=1e-7, baseline_samples=5 * BLOCK_SAMPLES,
                         min_shift=0.0)
    for _ in range(5):
        assert not det.observe_block(block(rng, mean=10.0))  # the baseline: no test yet
    assert det.testing
    for _ in range(50):
        assert not det.observe_block(block(rng, mean=10.0))  # its own level: no alarm
    fired = [det.observe_block(block(rng, mean=14.0)) for _ in range(10)]
    assert fired.count(True) == 1 and det.alarm and det.score >= 1.0
    assert fired.index(True) <= 4 and det.alarm_statistic in STATISTICS
    det.reset()
    assert not det.alarm and det.blocks == 0 and det.score == 0.0


def _gap_detector(min_shift: float = 0.0) -> ChangeDetector:
    return ChangeDetector(false_alarm_rate=1e-7, baseline_samples=5 * BLOCK_SAMPLES,
                          min_shift=min_shift)


@pytest.mark.parametrize("drifted", [-0.1, 0.1])
def test_a_confidence_gap_opening_either_way_alarms(drifted):
    rng = np.random.default_rng(2)
    det = _gap_detector()
    for _ in range(5):
        det.observe_block(block(rng, se=0.01, gap=0.0))
    hits = [det.observe_block(block(rng, se=0.01, gap=drifted)) for _ in range(5)]
    assert any(hits) and det.alarm_statistic == "confidence_gap"
    # the same shift, below a minimum shift of 0.5: never declared
    det = _gap_detector(min_shift=0.5)
    for _ in range(5):
        det.observe_block(block(rng, se=0.01, gap=0.0))
    assert not any(det.observe_block(block(rng, se=0.01, gap=drifted)) for _ in range(200))


@pytest.mark.parametrize("baseline_gap", [-0.08, 0.08])
def test_a_confidence_gap_closing_never_alarms(baseline_gap):
    """A map that removes the gap its predecessor had (a refinement in one regime, whose
    baseline the test keeps) is not a drift; a signed two-sided test alarmed here."""
    rng = np.random.default_rng(5)
    det = _gap_detector()
    for _ in range(5):
        det.observe_block(block(rng, se=0.01, gap=baseline_gap))
    assert not any(det.observe_block(block(rng, se=0.01, gap=0.0)) for _ in range(500))
    # the gap opening past its baseline size, on the other side, still alarms
    assert any(det.observe_block(block(rng, se=0.01, gap=-2.5 * baseline_gap))
               for _ in range(5))


def test_a_snapshot_with_a_signed_gap_baseline_restarts_that_baseline_only():
    rng = np.random.default_rng(6)
    det = _gap_detector()
    for _ in range(6):
        det.observe_block(block(rng, se=0.01, gap=0.05))
    old = det.to_dict()
    del old["absolute"]  # written before the gap's size was tested
    restored = ChangeDetector.from_dict(old)
    assert restored.baseline("confidence_gap") is None
    assert restored.baseline("ece_top") == det.baseline("ece_top")
    assert restored.blocks == det.blocks and restored.testing
    # the other statistics keep testing: a shift of them still alarms
    assert any(restored.observe_block(block(rng, mean=1.0, se=0.01)) for _ in range(5))
    restored.reset()
    assert restored.baseline("confidence_gap") is None and restored.blocks == 0


def test_disabled_at_rate_zero_and_validation():
    det = ChangeDetector(false_alarm_rate=0.0, baseline_samples=1, min_shift=0.0)
    rng = np.random.default_rng(3)
    det.observe_block(block(rng))
    assert not any(det.observe_block(block(rng, mean=1e6)) for _ in range(10))
    assert det.score == 0.0 and math.isinf(det.threshold)
    for bad in ({"false_alarm_rate": 1.0}, {"false_alarm_rate": -1e-3},
                {"baseline_samples": 0}, {"min_shift": -0.1}, {"min_shift": math.inf}):
        kw = {"false_alarm_rate": 1e-7, "baseline_samples": 100, "min_shift": 0.01, **bad}
        with pytest.raises(InputError):
            ChangeDetector(**kw)


def test_snapshot_round_trip_continues_identically():
    rng = np.random.default_rng(4)
    det = ChangeDetector(false_alarm_rate=1e-6, baseline_samples=3 * BLOCK_SAMPLES,
                         min_shift=0.01)
    seq = [block(rng, mean=m) for m in [0.0] * 8 + [3.0] * 10]
    for b in seq[:9]:
        det.observe_block(b)
    copy = ChangeDetector.from_dict(det.to_dict())
    assert copy == det
    for b in seq[9:]:
        assert copy.observe_block(b) == det.observe_block(b)
    assert copy == det and det.alarm
    d = det.to_dict()
    d["cusum"]["err_p"] = -1.0
    with pytest.raises(InputError, match="negative"):
        ChangeDetector.from_dict(d)
    with pytest.raises(InputError, match="malformed"):
        ChangeDetector.from_dict({"false_alarm_rate": 1e-6})
    d = det.to_dict()
    d["alarm_statistic"] = "nope"
    with pytest.raises(InputError, match="unknown statistic"):
        ChangeDetector.from_dict(d)


def _stream(k: int, n: int, seed: int, scale: float = 1.0):
    """Calibrated-by-construction rows (labels drawn from the rows) of k classes; ``scale``
    rescales the log-probabilities of the *reported* rows after the labels were drawn."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 2.0, size=(n, k))
    x = np.exp(z - z.max(axis=1, keepdims=True))
    x /= x.sum(axis=1, keepdims=True)
    y = (x.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    if scale != 1.0:
        x = np.exp(scale * np.log(x))
        x /= x.sum(axis=1, keepdims=True)
    return x, y


def _monitor() -> WindowMonitor:
    return WindowMonitor(5, 10, math.inf, window_samples=4000,
                         change=ChangeDetector(false_alarm_rate=1e-7, baseline_samples=3000,
                                               min_shift=0.01))


def test_monitor_blocks_do_not_depend_on_batching_and_checkpoint_mid_block():
    """The same samples in batches of 1..997 give the same blocks and test state (up to float
    rounding of the sums); a snapshot taken mid-block restores and continues identically."""
    x, y = _stream(5, 7_300, 5)
    a, b = _monitor(), _monitor()
    a.update(x, y, calibrated=x)
    sizes = np.random.default_rng(6).integers(1, 998, size=200)
    edges = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), y.size)
    for lo, hi in itertools.pairwise(edges):
        if hi > lo:
            b.update(x[lo:hi], y[lo:hi], calibrated=x[lo:hi])
    assert a.change.blocks == b.change.blocks == 7
    assert a.change.base_n == b.change.base_n and a.change.alarm == b.change.alarm
    for s in STATISTICS:  # the same blocks; sums merged in another order (float rounding)
        assert a.change.base_sum[s] == pytest.approx(b.change.base_sum[s], rel=1e-9, abs=1e-15)
        assert a.change.last[s] == pytest.approx(b.change.last[s], rel=1e-6, abs=1e-9)
    snap = WindowMonitor.from_dict(a.to_dict())
    assert snap.change == a.change and snap._block_n == a._block_n == 300
    x2, y2 = _stream(5, 2_000, 7, scale=3.0)
    a.update(x2, y2, calibrated=x2)
    snap.update(x2, y2, calibrated=x2)
    assert snap.change == a.change and snap.to_dict() == a.to_dict()


def test_monitor_detects_rescaled_logits_and_reset_starts_a_new_baseline():
    mon = _monitor()
    x, y = _stream(5, 6_000, 8)
    mon.update(x, y, calibrated=x)
    assert mon.change.testing and not mon.change.alarm
    xd, yd = _stream(5, 3_000, 9, scale=2.0)  # over-confident
    mon.update(xd, yd, calibrated=xd)
    assert mon.change.alarm
    mon.reset("calibrated")                   # a new bin map
    assert not mon.change.alarm and mon.change.blocks == 0 and mon._block_n == 0
    mon.update(xd[:1500], yd[:1500], calibrated=xd[:1500])
    assert mon.change.blocks == 1 and not mon.change.testing


def test_raw_only_updates_do_not_feed_the_test():
    mon = _monitor()
    x, y = _stream(5, 3_000, 10)
    mon.update(x, y)                          # no bin map yet
    assert mon.change.blocks == 0


def test_trigger_fires_once_on_the_change_alarm():
    t = DriftTrigger(threshold=0.1, sustain_seconds=300, min_samples=100)
    assert t.observe(None, 0.0, change=True) and t.cause == "change" and t.fired == 1
    assert not t.observe(None, 1.0, change=True)       # disarmed until a new map
    t.rearm()
    assert t.observe(None, 2.0, change=True)
    restored = DriftTrigger.from_dict(t.to_dict())
    assert restored == t and restored.cause == "change"
    old = t.to_dict()
    del old["cause"]                                    # written before the change test
    assert DriftTrigger.from_dict(old).cause is None
    trig = Triggers(DriftTrigger(threshold=0.1, sustain_seconds=300, min_samples=100))
    assert trig.check(now=0.0, pools_full=False, change=False) is None
    assert trig.check(now=1.0, pools_full=False, change=True) == Firing("drift", "refill")
    assert trig.refill_cause == "drift"
    assert trig.check(now=2.0, pools_full=False, change=True) is None


def test_settings_defaults_are_the_legacy_checkpoint_defaults():
    """A checkpoint written before the change test restores with the settings' defaults."""
    from daemon.model_state import _CHANGE_CONFIG
    from daemon.settings import ModelSettings

    ms = ModelSettings()
    assert {key: getattr(ms, key) for key in _CHANGE_CONFIG} == _CHANGE_CONFIG
