"""When to recalibrate: the drift, pools-full and manual triggers. Pure; the clock is passed in.

**Drift** (:class:`DriftTrigger`) fires on either of two conditions, and then disarms:

* the **change test** (:mod:`daemon.drift`): the live bin map's calibration (debiased top-label
  and classwise ECE, Brier reliability, Err_p) moved away from its own baseline, measured on the
  samples right after the map's installation, by a sequential test with a stated false-alarm
  rate. The monitor runs it; ``observe(..., change=True)`` passes its (latched) alarm. This is
  what reacts to the miscalibration of real networks (a rescaled logit, a data shift).
* the **absolute threshold** (below): the calibrated Err_p stays above ``drift_threshold``.
  At real-network k the windowed Err_p rarely reaches a useful eps, so this is a backstop.

**Absolute threshold.** The monitor reports, for the calibrated predictor over its
window, the plug-in ``Err_p`` and its confidence-shrunk lower bound
``lower = Err_p - margin(z)`` (:mod:`daemon.monitor`: every cell shrunk by ``z`` standard
errors). The drift condition at time ``t`` is::

    n >= min_samples   and   lower > drift_threshold

The trigger fires when the condition has held at every observation for at least
``sustain_seconds`` (``t - t_first >= sustain_seconds`` with ``t_first`` the first observation of
the current run); any observation where it fails restarts the run. After firing it is *disarmed*
until :meth:`DriftTrigger.rearm` (the daemon rearms it when a new bin map is installed), so one
drift episode causes one recalibration.

**Pools full**: all pools of the epoch reached their targets. **Manual**: an operator request
(``POST /v1/models/{model}/recalibrate``), kept until served.

:class:`Triggers` combines them and tells the daemon what to do:

* ``Firing("manual", "fit")``: fit now on the current pools;
* ``Firing("pools_full", "fit")``: pools are full; fit. Its ``trigger`` is ``"drift"`` instead
  when this epoch was started to refill the pools after a drift;
* ``Firing("drift", "refill")``: discard the current pools and start a new epoch (the pools then
  fill with post-drift data, and the resulting fit is labelled ``drift``).

Nothing fires while a fit is in flight (``busy=True``); a manual request waits, and it also waits
while the current epoch has nothing to fit (``manual_ready=False``: the epoch's warm-up is still
fixing its temperature, so its pools are empty). The drift
trigger observes only when neither a manual request nor full pools take precedence (skipped
observations do not break a drifting run).

Usage::

    trig = Triggers(DriftTrigger(threshold=0.1, sustain_seconds=300, min_samples=1000))
    f = trig.check(now=t, pools_full=state.pools.full, stats=mon.evaluate(3.0)["calibrated"],
                   change=mon.change.alarm)
    if f and f.action == "refill": state.start_new_epoch()
    if f and f.action == "fit": submit_fit(...)  # then, when installed: trig.recalibrated()
    trig.request_manual()                        # from the HTTP handler
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lpcal.errors import InputError

__all__ = ["TRIGGERS", "DriftTrigger", "Firing", "Triggers"]

TRIGGERS = ("pools_full", "drift", "manual")


class DriftTrigger:
    """Sustained, confidence-margined drift detector (see the module docstring)."""

    def __init__(self, threshold: float, sustain_seconds: float, *, min_samples: int = 1000):
        if not (threshold > 0 and math.isfinite(threshold)):
            raise InputError(f"drift threshold must be positive, got {threshold}")
        if not (sustain_seconds >= 0 and math.isfinite(sustain_seconds)):
            raise InputError(f"sustain_seconds must be >= 0, got {sustain_seconds}")
        self.threshold = float(threshold)
        self.sustain = float(sustain_seconds)
        self.min_samples = int(min_samples)
        self.since: float | None = None   # start of the current run of "drifting" observations
        self.armed = True
        self.last: float | None = None    # last observation time
        self.fired = 0
        self.cause: str | None = None     # what fired last: "change" | "threshold"

    def condition(self, stats: Any) -> bool:
        """The instantaneous drift condition for :class:`daemon.monitor.WindowStats` ``stats``."""
        return (stats is not None and stats.n >= self.min_samples
                and stats.lower > self.threshold)

    def observe(self, stats: Any, now: float, change: bool = False) -> bool:
        """Record one observation at time ``now``; True exactly when the trigger fires.
        ``change``: the change test's alarm (fires at once while armed)."""
        if self.last is not None and now < self.last:
            now = self.last  # the clock never goes back
        self.last = now
        if change and self.armed:
            self.armed = False
            self.since = None
            self.fired += 1
            self.cause = "change"
            return True
        if not self.condition(stats):
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if self.armed and now - self.since >= self.sustain:
            self.armed = False
            self.since = None
            self.fired += 1
            self.cause = "threshold"
            return True
        return False

    @property
    def drifting_for(self) -> float:
        """Seconds the condition has held continuously (0 when it does not hold)."""
        if self.since is None or self.last is None:
            return 0.0
        return self.last - self.since

    def bound_clock(self, limit: float) -> bool:
        """Pull ``last`` and ``since`` back to at most ``limit`` (the clock never goes back on
        its own, so one observation far in the future would freeze it).
        Returns whether either was beyond."""
        hit = False
        if self.last is not None and self.last > limit:
            self.last, hit = float(limit), True
        if self.since is not None and self.since > limit:
            self.since, hit = float(limit), True
        return hit

    def rearm(self) -> None:
        """Re-enable firing and restart the run (call when a new bin map is installed)."""
        self.armed = True
        self.since = None

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "sustain": self.sustain,
                "min_samples": self.min_samples, "since": self.since, "armed": self.armed,
                "last": self.last, "fired": self.fired, "cause": self.cause}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DriftTrigger:
        try:
            t = cls(float(d["threshold"]), float(d["sustain"]), min_samples=int(d["min_samples"]))
            t.since = None if d["since"] is None else float(d["since"])
            t.last = None if d["last"] is None else float(d["last"])
            t.armed = bool(d["armed"])
            t.fired = int(d["fired"])
            cause = d.get("cause")  # absent: written before the change test
            if cause not in (None, "change", "threshold"):
                raise ValueError(f"unknown drift cause {cause!r}")
            t.cause = cause
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"drift trigger: malformed snapshot ({type(e).__name__}: {e})") \
                from None
        return t

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DriftTrigger) and self.to_dict() == other.to_dict()


@dataclass(frozen=True)
class Firing:
    """A trigger decision: ``trigger`` (metric label) and ``action`` ("fit" | "refill")."""

    trigger: str
    action: str


class Triggers:
    """Manual > pools-full > drift, with the drift-refill bookkeeping (see the module docstring)."""

    def __init__(self, drift: DriftTrigger):
        self.drift = drift
        self.manual_pending = False
        self.refill_cause: str | None = None  # "drift" while refilling after a drift

    def request_manual(self) -> None:
        self.manual_pending = True

    def check(self, *, now: float, pools_full: bool, stats: Any = None,
              busy: bool = False, manual_ready: bool = True,
              change: bool = False) -> Firing | None:
        """Decide what to do at time ``now``. ``stats``: calibrated-predictor WindowStats;
        ``manual_ready``: the current pools can be fitted (a manual request waits otherwise);
        ``change``: the change test's alarm on the live map."""
        if busy:
            return None
        if self.manual_pending and manual_ready:
            self.manual_pending = False
            return Firing("manual", "fit")
        if pools_full:
            return Firing(self.refill_cause or "pools_full", "fit")
        if self.drift.observe(stats, now, change):
            self.refill_cause = "drift"
            return Firing("drift", "refill")
        return None

    def recalibrated(self) -> None:
        """A new bin map was installed: clear the refill cause and rearm the drift trigger."""
        self.refill_cause = None
        self.drift.rearm()

    def to_dict(self) -> dict[str, Any]:
        return {"drift": self.drift.to_dict(), "manual_pending": self.manual_pending,
                "refill_cause": self.refill_cause}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Triggers:
        try:
            t = cls(DriftTrigger.from_dict(d["drift"]))
            t.manual_pending = bool(d["manual_pending"])
            rc = d["refill_cause"]
        except (KeyError, TypeError) as e:
            raise InputError(f"triggers: malformed snapshot ({type(e).__name__}: {e})") from None
        if rc not in (None, *TRIGGERS):
            raise InputError(f"triggers: unknown refill cause {rc!r}")
        t.refill_cause = rc
        return t

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Triggers) and self.to_dict() == other.to_dict()
