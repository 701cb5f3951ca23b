"""What the daemon runs per model, typed: its epochs (:class:`EpochSpec`) and its monitor
(:class:`MonitorSpec`). Pure: no I/O, no pydantic.

Both are frozen dataclasses built once, by :meth:`daemon.settings.ModelSettings.epoch_spec` and
:meth:`~daemon.settings.ModelSettings.monitor_spec` (the only translation from settings) or from
a checkpoint (:mod:`daemon.model_state`), and compared whole: a :class:`daemon.model_state.
ModelState` restored with other settings starts a new epoch when its :class:`EpochSpec` differs,
and only rebuilds its window, change test or drift trigger when its :class:`MonitorSpec` does.

* :class:`EpochSpec`: the :class:`lpcal.spec.FitSpec` of the epoch's fit (``eps``, ``p``,
  ``delta``, pool sizes, ``mode``, ``prescale``, ``outside``, with every default resolved) plus
  what only a stream has: the ``holdout`` samples per epoch that certify the fit and the
  ``warmup`` samples that fit its temperature first. :meth:`EpochSpec.layout` is the epoch's
  :class:`lpcal.pools.PoolLayout`.
* :class:`MonitorSpec`: the monitoring window, the absolute drift trigger and the change test.
* :class:`OnlineSpec`: how a model recovers: fixed epochs (``recovery = "epochs"``, the
  :class:`EpochSpec`) or the online loop (``"online"``, :class:`lpcal.online.OnlineCalibrator`:
  warm-up until the temperature is determined, a sliding window, champion/challenger) with its
  knobs; :meth:`OnlineSpec.config` is the calibrator's :class:`lpcal.online.OnlineConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from daemon.drift import ChangeDetector
from daemon.trigger import DriftTrigger
from lpcal.errors import InputError
from lpcal.online import OnlineConfig
from lpcal.pools import PoolLayout
from lpcal.spec import FitSpec, Prescale, SizingRule

__all__ = ["DEFAULT_POOL", "RECOVERY", "EpochSpec", "MonitorSpec", "OnlineSpec"]

DEFAULT_POOL = 5_000
"""Samples per estimation pool of a practical epoch whose ``pool`` setting is unset."""


#: The ``recovery`` choices: fixed epochs or the online loop. :class:`OnlineSpec` defaults to
#: epochs (a checkpoint without ``recovery`` is an epochs state); the settings default to the
#: online loop in the certified mode (:data:`daemon.settings.model.DEFAULT_RECOVERY`).
RECOVERY = ("epochs", "online")


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{name} must be an integer >= 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class EpochSpec:
    """How a model's epochs are filled and fitted.

    Parameters
    ----------
    fit : FitSpec
        The fit of a sealed epoch (:func:`lpcal.calibrate.fit_pools`) and the sizes of its pools
        (:meth:`lpcal.spec.FitSpec.pool_sizing`); practical pools without a ``pool_size`` hold
        :data:`DEFAULT_POOL` samples each (a stream has no sample to split).
    holdout : int
        Held-out samples per epoch (their sums certify the fit; 0: no certificate).
    warmup : int
        Samples per epoch, taken first, that fit the temperature; > 0 exactly when
        ``fit.prescale_value`` is ``temperature``.

    Raises
    ------
    InputError
        A count below 0, or a warm-up that disagrees with the pre-calibrator.
    """

    fit: FitSpec
    holdout: int = 0
    warmup: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.fit, FitSpec):
            raise InputError(f"fit must be a lpcal.spec.FitSpec, got {type(self.fit).__name__}")
        _count("holdout", self.holdout)
        _count("warmup", self.warmup)
        prescale = self.fit.prescale_value
        if (prescale is Prescale.TEMPERATURE) != (self.warmup > 0):
            raise InputError(f"prescale={prescale.value!r} with warmup={self.warmup}: the "
                             "temperature needs warm-up samples, and only it uses them")

    @property
    def lam(self) -> int:
        """``lambda`` of the epoch's level sets (from ``eps`` and ``p``)."""
        return self.fit.lam

    def layout(self, k: int) -> PoolLayout:
        """The pool layout of an epoch with ``k`` classes: the fit's pool sizing (practical
        pools of :data:`DEFAULT_POOL` samples when ``pool_size`` is unset) plus the ``holdout``
        share and the ``warmup`` samples."""
        fit = self.fit
        if fit.sizing is SizingRule.PRACTICAL and fit.pool_size is None:
            fit = dataclasses.replace(fit, pool_size=DEFAULT_POOL)
        return fit.pool_sizing(k, holdout=self.holdout, warmup=self.warmup).layout()


@dataclasses.dataclass(frozen=True)
class MonitorSpec:
    """The monitoring window, the drift trigger and the change test of one model (the fields
    are the model settings of the same names; ``drift_threshold`` is resolved, ``eps`` when
    the setting is unset)."""

    drift_threshold: float
    window_samples: int | None
    window_seconds: float | None
    drift_sustain_seconds: float
    drift_confidence: float
    drift_min_samples: int
    drift_false_alarm_rate: float
    drift_baseline_samples: int
    drift_min_shift: float

    #: Fields of the monitoring window: a change discards the window's sums.
    WINDOW: ClassVar[tuple[str, ...]] = ("window_samples", "window_seconds")
    #: Fields of the drift trigger and the change test: a change rebuilds the triggers.
    DRIFT: ClassVar[tuple[str, ...]] = (
        "drift_threshold", "drift_sustain_seconds", "drift_confidence", "drift_min_samples",
        "drift_false_alarm_rate", "drift_baseline_samples", "drift_min_shift")

    def __post_init__(self) -> None:
        if self.window_samples is None and self.window_seconds is None:
            raise InputError("one of window_samples or window_seconds must be set")

    def same(self, other: MonitorSpec, fields: tuple[str, ...]) -> bool:
        """Whether ``other`` has the same values of ``fields`` (:data:`WINDOW`, :data:`DRIFT`)."""
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def change_detector(self) -> ChangeDetector:
        """A fresh change test (:mod:`daemon.drift`) with these settings."""
        return ChangeDetector(false_alarm_rate=float(self.drift_false_alarm_rate),
                              baseline_samples=int(self.drift_baseline_samples),
                              min_shift=float(self.drift_min_shift))

    def drift_trigger(self) -> DriftTrigger:
        """A fresh absolute drift trigger (:class:`daemon.trigger.DriftTrigger`)."""
        return DriftTrigger(self.drift_threshold, self.drift_sustain_seconds,
                            min_samples=self.drift_min_samples)


@dataclasses.dataclass(frozen=True)
class OnlineSpec:
    """How a model recovers (``recovery``) and, for ``"online"``, the knobs of its
    :class:`lpcal.online.OnlineCalibrator` (the model settings of the same names; the rest of
    :class:`lpcal.online.OnlineConfig` keeps its defaults, ``eps``, ``p`` and ``delta`` come
    from the fit spec).

    Parameters
    ----------
    recovery : {"epochs", "online"}
        Fixed epochs (each fitted when full, the next from nothing) or the online loop.
    warmup_tol : float
        The warm-up ends when the 95% interval of ``ln T`` is narrower than this (> 0).
    bucket_size, window_buckets : int
        The sliding window: ``window_buckets`` (>= 2) buckets of ``bucket_size`` samples (a
        multiple of :data:`lpcal.online.OnlineConfig.step`, 250).
    challenger_alpha : float
        Total level of the champion/challenger tests against one live map, in (0, 0.5).
    fit_delay : int
        Samples after a fit request at which its result takes effect (a multiple of 250);
        the model's input pauses there until the fit is back.

    Raises
    ------
    InputError
        A value out of range (the message names it).
    """

    recovery: str = "epochs"
    warmup_tol: float = 0.05
    bucket_size: int = 1_000
    window_buckets: int = 32
    challenger_alpha: float = 0.05
    fit_delay: int = 1_000

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERY:
            raise InputError(f"recovery must be one of {RECOVERY}, got {self.recovery!r}")
        step = OnlineConfig.step
        bad = [f"{name} = {getattr(self, name)!r} ({why})" for name, ok, why in (
            ("warmup_tol", self.warmup_tol > 0, "must be > 0"),
            ("bucket_size", self.bucket_size >= step and self.bucket_size % step == 0,
             f"must be a positive multiple of {step}"),
            ("window_buckets", self.window_buckets >= 2, "must be >= 2"),
            ("challenger_alpha", 0 < self.challenger_alpha < 0.5, "must be in (0, 0.5)"),
            ("fit_delay", self.fit_delay >= step and self.fit_delay % step == 0,
             f"must be a positive multiple of {step}"),
        ) if not ok]
        if bad:
            raise InputError(f"online recovery: {'; '.join(bad)}")
        self.config(FitSpec(eps=0.1, p=math.inf))  # anything else OnlineConfig refuses

    @property
    def online(self) -> bool:
        return self.recovery == "online"

    def config(self, fit: FitSpec, max_bytes: int | None = None) -> OnlineConfig:
        """The calibrator's settings for fits ``fit`` (its ``eps``, ``p``, ``delta``) and a
        byte bound on the window's sealed buckets."""
        return OnlineConfig(eps=fit.eps, p=fit.p, delta=fit.delta,
                            warmup_tol=self.warmup_tol, bucket_size=self.bucket_size,
                            n_buckets=self.window_buckets, alpha=self.challenger_alpha,
                            fit_delay=self.fit_delay, max_bytes=max_bytes)

    #: The :class:`lpcal.online.OnlineConfig` fields that :meth:`config` sets from these
    #: settings and the fit spec (the others are the library's defaults at creation).
    SET_FIELDS: ClassVar[tuple[str, ...]] = (
        "eps", "p", "delta", "warmup_tol", "bucket_size", "n_buckets", "alpha", "fit_delay",
        "max_bytes")

    def accepts(self, config: OnlineConfig, fit: FitSpec) -> bool:
        """Whether a restored calibrator's ``config`` is what these settings and ``fit`` make
        (:meth:`config`, at its own byte bound), on every field they set. The library's own
        knobs (the held-out and certification shares, ``pools_from``, ...) stay as the
        calibrator was created with: a checkpoint written before their defaults changed
        restores exactly (its window is routed by them), and a fresh calibrator (a new model,
        a changed online setting) takes the current defaults."""
        want = self.config(fit, config.max_bytes)
        return all(getattr(config, f) == getattr(want, f) for f in self.SET_FIELDS)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
