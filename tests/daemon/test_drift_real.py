"""The change test on a real network's predictions (CIFAR-10 WideResNet record): a x0.5 logit
drift after a published map is detected within 5,000 joined samples, a stationary stream is
not flagged, and the absolute Err_p trigger misses the same drift. Not timed (the delay and
false-alarm figures over seeds and networks are in the drift benchmark)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.bench_drift import Published, drift_run, false_alarms


@pytest.fixture(scope="module")
def published():
    return Published("wideresnet-16-4-cifar-10", seed=0)


def test_halved_logits_are_detected_within_5000_samples(published):
    r = drift_run(published, seed=0, scale=0.5, before=6_000, drifted=6_000)
    assert r["ece"][1] > r["ece"][0] + 0.1           # the drift users see: ECE x10
    assert r["delay"] is not None and 0 < r["delay"] <= 5_000
    assert r["old"] is None                           # Err_p vs eps stays blind to it


def test_a_stationary_stream_is_not_flagged(published):
    assert false_alarms(published, seed=0, n=30_000) == 0
    # and the monitor saw the map's own calibration: the test was running
    mon = published.monitor()
    x, y = published.draw(np.random.default_rng(1), 8_000)
    mon.update(x, y, calibrated=published.bm.apply(x, check=False))
    assert mon.change.testing and mon.change.blocks == 8 and not mon.change.alarm
