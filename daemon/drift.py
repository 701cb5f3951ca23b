"""Change test of the live bin map's calibration against its own baseline. Pure: no I/O, no clock.

A newly installed bin map is measured on the calibrated samples that follow it
(:class:`daemon.monitor.WindowMonitor` feeds them here in *blocks* of :data:`BLOCK_SAMPLES`
consecutive joined samples, counted from the installation, so block boundaries depend only on
the sequence of samples, never on batching or on the wall clock). Each block yields, per
statistic ``s`` (:data:`STATISTICS`; :func:`daemon.monitor.block_statistics`), an estimate
``T_s`` and its standard error ``se_s``:

* ``confidence_gap``: accuracy minus mean confidence of the top label (signed: negative when
  over-confident); the test watches its size ``|T|`` (:data:`ABSOLUTE`), so a drift either way
  away from calibration raises it, and a map that removes a gap the previous one had (a
  refinement published without a drift, whose baseline the test keeps) does not alarm;
* ``ece_top``, ``ece_classwise``: the debiased squared l2 top-label and classwise ECE
  (:func:`lpcal.metrics.binned_sq_error`: the per-bin sampling-noise term subtracted);
* ``err_p``: the plug-in Err_p at the live lambda.

(The monitor also exports the Brier reliability term on the level sets; it is not tested here:
which level sets hold two samples or more changes with the sample, and its standard error
underestimated the spread between blocks by a factor 1.5 to 1.8 on the CIFAR records.)

**Baseline.** The first ``baseline_samples`` (rounded up to whole blocks) after the installation:
``B_s`` is the mean of the baseline blocks' ``T_s``, with standard error
``se_B = sqrt(sum se^2) / blocks``. Averaging block values keeps the baseline at the block's
sample size, so a size-dependent bias (Err_p's; bins with fewer than two samples in the
debiased ECEs) cancels.

**Test** (one-sided CUSUM per statistic and direction, Page 1954). A change is an increase of at
least ``min_shift`` in the statistic's own units: for the squared statistics, in their l2 value
(``Delta_s = (sqrt(B_s) + min_shift)^2 - B_s``), for the others directly
(``Delta_s = min_shift``). After the baseline, every block updates::

    z_s = (T_s - B_s - Delta_s / 2 - Z_BASE se_B) / sqrt(se_s^2 + se_B^2)
    C_s = max(0, C_s + z_s - KREF)                                   (KREF = 0.5)

(with ``T_s = |gap|`` for the confidence gap, baseline blocks included); the test *alarms* when some
``C_s > h``. The baseline's own error is shared by every later block, so it is not averaged
away by the CUSUM: the margin ``Z_BASE = 2`` baseline standard errors absorbs it. Under no
change, while the baseline's error is within its margin, and under the normal approximation the
increments ``z_s - KREF`` have mean ``<= -KREF`` and variance at most 1, and Siegmund's approximation of the CUSUM's average run length,
``ARL(h) = (exp(2 a b) - 2 a b - 1) / (2 a^2)`` with ``a = KREF`` and ``b = h + 1.166``, sets ``h``
so that the expected number of samples to a false alarm is ``1 / false_alarm_rate`` over all
the CUSUMs together (each gets ``CUSUMs / rate`` samples, a Bonferroni split). The alarm is
latched until :meth:`ChangeDetector.reset` (a new bin map). ``false_alarm_rate = 0`` disables
the test. The rate is a design value: the drift benchmark (``tests/bench/bench_drift.py``)
measures the realized false alarms and the detection delay on real networks.

Usage::

    det = ChangeDetector(false_alarm_rate=1e-7, baseline_samples=5000, min_shift=0.01)
    det.observe_block({"ece_top": (t, se), ...})   # True when it alarms at this block
    det.alarm, det.score, det.to_dict()
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from lpcal.errors import InputError

__all__ = [
    "ABSOLUTE",
    "BLOCK_SAMPLES",
    "KREF",
    "SQUARED",
    "STATISTICS",
    "Z_BASE",
    "ChangeDetector",
    "cusum_threshold",
]

#: Statistics of the change test, in a fixed order (values of the gauges' ``statistic`` label).
STATISTICS = ("confidence_gap", "ece_top", "ece_classwise", "err_p")
#: Statistics estimated on the squared scale (their minimum shift applies to the square root).
SQUARED = frozenset(("ece_top", "ece_classwise"))
#: Signed statistics whose size is tested (``T_s = |T|``): an increase of the gap either way.
ABSOLUTE = frozenset(("confidence_gap",))
#: Joined samples per block.
BLOCK_SAMPLES = 1_000
#: CUSUM reference value, in standard errors.
KREF = 0.5
#: Baseline margin, in the baseline's standard errors (see the module docstring).
Z_BASE = 2.0
_SIEGMUND = 1.166


def _arl(h: float, a: float) -> float:
    x = 2.0 * a * (h + _SIEGMUND)
    return (math.expm1(x) - x) / (2.0 * a * a)


def cusum_threshold(arl_blocks: float, kref: float = KREF) -> float:
    """The CUSUM threshold ``h`` whose average run length to a false alarm is ``arl_blocks``
    blocks (Siegmund's approximation, standardized normal increments, reference ``kref``).
    A pure function of its arguments, remembered for the last few (every model of a replica
    usually shares one change-test setting, and a new model's state builds two tests)."""
    if not arl_blocks > 0:
        raise InputError(f"arl_blocks must be positive, got {arl_blocks}")
    return _cusum_threshold(float(arl_blocks), float(kref))


@functools.lru_cache(maxsize=64)
def _cusum_threshold(arl_blocks: float, kref: float) -> float:
    lo, hi = 0.0, 1.0
    while _arl(hi, kref) < arl_blocks:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _arl(mid, kref) < arl_blocks:
            lo = mid
        else:
            hi = mid
    return hi


def _usable(stats: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    out = {}
    for name in STATISTICS:
        v = stats.get(name)
        if v is None:
            continue
        t, se = float(v[0]), float(v[1])
        if math.isfinite(t) and math.isfinite(se) and se >= 0.0:
            out[name] = (t, se)
    return out


class ChangeDetector:
    """Baseline, then one-sided CUSUM per statistic (see the module docstring)."""

    def __init__(self, *, false_alarm_rate: float, baseline_samples: int, min_shift: float,
                 block_samples: int = BLOCK_SAMPLES):
        if not (0.0 <= false_alarm_rate < 1.0):
            raise InputError(f"drift_false_alarm_rate must be in [0, 1), got {false_alarm_rate}")
        if int(baseline_samples) < 1 or int(block_samples) < 2:
            raise InputError("drift_baseline_samples must be >= 1 and blocks >= 2 samples")
        if not (min_shift >= 0.0 and math.isfinite(min_shift)):
            raise InputError(f"drift_min_shift must be >= 0, got {min_shift}")
        self.false_alarm_rate = float(false_alarm_rate)
        self.baseline_samples = int(baseline_samples)
        self.min_shift = float(min_shift)
        self.block_samples = int(block_samples)
        self.baseline_blocks = -(-self.baseline_samples // self.block_samples)
        if self.false_alarm_rate > 0.0:
            tests = len(STATISTICS)  # one one-sided CUSUM per statistic
            arl = tests / (self.false_alarm_rate * self.block_samples)
            self.threshold = cusum_threshold(max(arl, 1.0))
        else:
            self.threshold = math.inf
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next block starts a new baseline (a new bin map)."""
        self.blocks = 0                                          # blocks observed
        self.base_sum = dict.fromkeys(STATISTICS, 0.0)           # sum of baseline T_s
        self.base_var = dict.fromkeys(STATISTICS, 0.0)           # sum of baseline se_s^2
        self.base_n = dict.fromkeys(STATISTICS, 0)               # baseline blocks with T_s
        self.cusum = dict.fromkeys(STATISTICS, 0.0)
        self.last = dict.fromkeys(STATISTICS, 0.0)               # last z_s
        self.alarm = False
        self.alarm_statistic: str | None = None
        self.alarm_block: int | None = None

    @property
    def testing(self) -> bool:
        """True once the baseline is complete."""
        return self.blocks >= self.baseline_blocks

    def baseline(self, name: str) -> tuple[float, float] | None:
        """``(B_s, se_B)`` of statistic ``name`` (None before any baseline block had it)."""
        m = self.base_n[name]
        if m == 0:
            return None
        return self.base_sum[name] / m, math.sqrt(self.base_var[name]) / m

    @property
    def score(self) -> float:
        """``max_s C_s / h``: the alarm is at 1 (0 while disabled or in the baseline)."""
        if not math.isfinite(self.threshold):
            return 0.0
        return max(self.cusum.values()) / self.threshold

    def observe_block(self, stats: Mapping[str, tuple[float, float]]) -> bool:
        """Record one block's ``{statistic: (T, se)}``; True exactly when the test alarms now.
        Statistics missing from ``stats`` or not finite are skipped for this block."""
        self.blocks += 1
        usable = _usable(stats)
        for name in ABSOLUTE.intersection(usable):
            t, se = usable[name]
            usable[name] = (abs(t), se)
        if self.blocks <= self.baseline_blocks:
            for name, (t, se) in usable.items():
                self.base_sum[name] += t
                self.base_var[name] += se * se
                self.base_n[name] += 1
            return False
        fired = False
        for name, (t, se) in usable.items():
            base = self.baseline(name)
            if base is None:
                continue
            b, se_b = base
            sd = math.sqrt(se * se + se_b * se_b)
            if sd <= 0.0:
                continue
            if name in SQUARED:
                root = math.sqrt(max(b, 0.0))
                delta = (root + self.min_shift) ** 2 - root * root
            else:
                delta = self.min_shift
            margin = 0.5 * delta + Z_BASE * se_b
            z = (t - b - margin) / sd
            self.last[name] = (t - b) / sd
            self.cusum[name] = max(0.0, self.cusum[name] + z - KREF)
            if not self.alarm and self.cusum[name] > self.threshold:
                self.alarm, fired = True, True
                self.alarm_statistic, self.alarm_block = name, self.blocks
        return fired

    # ---------------------------------------------------------------- snapshots
    def settings(self) -> tuple[float, int, float, int]:
        return (self.false_alarm_rate, self.baseline_samples, self.min_shift, self.block_samples)

    def to_dict(self) -> dict[str, Any]:
        return {"false_alarm_rate": self.false_alarm_rate,
                "baseline_samples": self.baseline_samples, "min_shift": self.min_shift,
                "block_samples": self.block_samples, "blocks": self.blocks,
                "base_sum": dict(self.base_sum), "base_var": dict(self.base_var),
                "base_n": dict(self.base_n), "cusum": dict(self.cusum),
                "last": dict(self.last), "absolute": sorted(ABSOLUTE),
                "alarm": self.alarm, "alarm_statistic": self.alarm_statistic,
                "alarm_block": self.alarm_block}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "change test") -> ChangeDetector:
        try:
            det = cls(false_alarm_rate=float(d["false_alarm_rate"]),
                      baseline_samples=int(d["baseline_samples"]),
                      min_shift=float(d["min_shift"]), block_samples=int(d["block_samples"]))
            det.blocks = int(d["blocks"])
            det.base_sum = {s: float(d["base_sum"][s]) for s in STATISTICS}
            det.base_var = {s: float(d["base_var"][s]) for s in STATISTICS}
            det.base_n = {s: int(d["base_n"][s]) for s in STATISTICS}
            det.cusum = {s: float(d["cusum"][s]) for s in STATISTICS}
            det.last = {s: float(d["last"][s]) for s in STATISTICS}
            # a snapshot written before the gap's size was tested holds a signed baseline:
            # that statistic starts a new baseline at the next reset (a new map)
            for s in ABSOLUTE.difference(d.get("absolute", ())):
                det.base_sum[s] = det.base_var[s] = det.cusum[s] = 0.0
                det.base_n[s] = 0
            det.alarm = bool(d["alarm"])
            stat = d["alarm_statistic"]
            if stat is not None and stat not in STATISTICS:
                raise ValueError(f"unknown statistic {stat!r}")
            det.alarm_statistic = stat
            det.alarm_block = None if d["alarm_block"] is None else int(d["alarm_block"])
            if det.blocks < 0 or any(v < 0 for v in det.cusum.values()):
                raise ValueError("negative block count or CUSUM")
        except InputError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed snapshot ({type(e).__name__}: {e})") from None
        return det

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChangeDetector) and self.to_dict() == other.to_dict()
