"""The settings of one model: ``[defaults]`` (a full :class:`ModelSettings`) and
``[models."<name>"]`` (a :data:`ModelOverrides`, merged over the defaults by
:meth:`daemon.settings.Settings.model_settings`).

:meth:`ModelSettings.fit_spec`, :meth:`~ModelSettings.epoch_spec`,
:meth:`~ModelSettings.monitor_spec` and :meth:`~ModelSettings.online_spec` are the only translation of these settings into what the
daemon runs (:class:`lpcal.spec.FitSpec`, :mod:`daemon.specs`); the fit options' choices are
those of :mod:`lpcal.spec`'s enums.
"""

from __future__ import annotations

import dataclasses
import math
from enum import StrEnum
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from daemon.limits import MAX_K
from daemon.settings.base import (
    ERROR_TYPE,
    NonNegFloat,
    NonNegInt,
    PNorm,
    PosFloat,
    PosInt,
    Prob,
    Strict,
    field_errors,
)
from daemon.specs import EpochSpec, MonitorSpec, OnlineSpec
from lpcal.spec import MODE_DEFAULTS, FitSpec, Mode, Outside, Prescale, SizingRule, Variant

__all__ = ["DEFAULT_HOLDOUT", "DEFAULT_RECOVERY", "DEFAULT_WARMUP", "EPOCH_ONLY", "ModelOverrides",
           "ModelSettings"]


def choices(enum: type[StrEnum]) -> Any:
    """``Literal`` of the values of one of :mod:`lpcal.spec`'s enums (a setting's choices)."""
    return Literal[tuple(e.value for e in enum)]


#: Held-out samples per epoch implied by each ``mode`` when ``holdout`` is unset; ``prescale``
#: and ``outside`` follow :data:`lpcal.spec.MODE_DEFAULTS`.
DEFAULT_HOLDOUT = {"certified": 3_000, "paper": 0}
#: Warm-up samples per epoch when ``warmup`` is unset and ``prescale = "temperature"``.
DEFAULT_WARMUP = 10_000
#: Why ``eps = "auto"`` is refused in the daemon, and what to do instead.
EPS_AUTO_REFUSED = (
    "eps = 'auto' is for lpcal fit and the library only: the daemon fixes lambda (from eps) "
    "when it creates a model, before its first sample. Run `lpcal fit --eps auto` on a sample "
    "of the model's predictions and labels; it prints the eps it resolves to: set that number")


def _refuse_eps_auto(value: Any) -> Any:
    """``eps = "auto"`` (the library's and the CLI's data-driven target) is refused with what to
    do instead (:data:`EPS_AUTO_REFUSED`): the daemon fixes lambda (from eps) when it creates a
    model, before its first sample (its window, pools and the checks of published maps are
    binned at it), and a target computed without data is no target: the smallest eps a
    held-out share of 3,000 samples can certify at all is the bottom of the library's grid
    (0.005) at p = inf, for every k."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise PydanticCustomError(ERROR_TYPE, EPS_AUTO_REFUSED)
    return value


#: ``recovery`` implied by each ``mode`` when unset: the online loop for the certified mode;
#: the paper's mode is Algorithm 2 exactly, which runs on fixed epochs.
DEFAULT_RECOVERY = {"certified": "online", "paper": "epochs"}
#: Options of the fixed epochs, with the values the online loop runs anyway (allowed with it):
#: any other value set with ``recovery = "online"`` is a startup error, never silently ignored.
EPOCH_ONLY: dict[str, tuple[Any, ...]] = {
    "sizing": ("practical",), "mu_pool": (), "pool": (), "variant": ("shared",),
    "prescale": ("temperature",), "outside": ("identity",), "holdout": (), "warmup": ()}


class ModelSettings(Strict):
    """Calibration and monitoring settings of one model (``[defaults]`` or merged per model)."""

    eps: Annotated[Prob, BeforeValidator(_refuse_eps_auto)] = 0.1
    """Target lp calibration error epsilon (a number: ``"auto"`` is refused, see
    :data:`EPS_AUTO_REFUSED`)."""
    p: PNorm = math.inf
    """The p of the lp error (> 1); ``inf`` (also ``"inf"``) for l_inf."""
    delta: Prob = 0.1
    """Failure probability of Algorithm 2."""
    sizing: choices(SizingRule) = "practical"
    """Pool sizes: the paper's bounds (``theory``) or the practical constants."""
    mu_pool: PosInt | None = None
    """Target size of the mu pool (None: from ``sizing``)."""
    pool: PosInt | None = None
    """Target size of every P/E pool (None: from ``sizing``)."""
    variant: choices(Variant) = "shared"
    """``split``: separate P and E pools per level (the paper's); ``shared``: one PE pool."""
    k: Annotated[int, Field(ge=2, le=MAX_K)] | None = None
    """Number of classes (None: learned from the model's first valid prediction)."""
    mode: choices(Mode) = "certified"
    """``certified`` (default): a temperature pre-calibrator and held-out evidence: with the
    online loop (``recovery``'s default here) candidates are published when held-out data says
    they beat the live map; with epochs every epoch warms up a temperature, holds out
    ``holdout`` samples and publishes the candidate (temperature scaling alone, or Algorithm 2
    on the temperature-scaled bins) with the best held-out certificate. ``paper``: Algorithm 2
    as in the paper (no pre-calibration, ``rho`` outside B, no held-out share), on epochs."""
    prescale: choices(Prescale) | None = None
    """Pre-calibrator fitted on each epoch's first ``warmup`` samples (None: from ``mode``:
    ``temperature`` certified, ``none`` paper)."""
    outside: choices(Outside) | None = None
    """What the bin map returns for bins outside the high-probability set B (None: from
    ``mode``: ``identity`` certified, ``rho`` paper)."""
    holdout: NonNegInt | None = None
    """Held-out samples per epoch, for the certificate (None: 3000 certified, 0 paper)."""
    warmup: NonNegInt | None = None
    """Samples per epoch, taken first, that fit the temperature (None: 10000 with
    ``prescale = "temperature"``, else 0)."""
    drift_threshold: PosFloat | None = None
    """Calibrated Err_p above which drift is declared (None: ``eps``)."""
    window_samples: PosInt | None = 10_000
    """Monitoring window: the last N joined samples (used when window_seconds is None)."""
    window_seconds: PosFloat | None = None
    """Monitoring window: the last T seconds of event time (takes precedence when set)."""
    sample_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Share of the model's events kept, in (0, 1]: an event is kept iff the blake2b hash of its
    id, as a uniform in [0, 1), is below the rate, so a prediction and its outcome are kept or
    dropped together on every replica and in every replay. Dropped events cost one hash and a
    count (``lpcal_events_sampled_out_total``), not a join entry. Kept samples are a uniform
    random subsample: the monitor's estimates stay unbiased, pools fill 1/rate times slower in
    events. For models whose traffic exceeds what calibration needs (docs/scaling.md)."""
    sum_tolerance: Annotated[float, Field(ge=0.0, lt=1.0)] = 1e-3
    """|sum(probs) - 1| allowed before ``normalize`` applies."""
    normalize: Literal["renormalize", "reject"] = "renormalize"
    """Rows off the simplex by more than ``sum_tolerance``: rescale them, or reject the event."""
    drift_sustain_seconds: NonNegFloat = 300.0
    """Seconds of EVENT time (the model's latest event ``ts``, not the wall clock) the drift
    condition must hold continuously before the drift trigger fires: the timer advances only
    as the model's events arrive, and a backlog replayed fast covers it in less wall time."""
    drift_confidence: NonNegFloat = 3.0
    """z of the confidence margin: drift needs ``Err_p - margin(z) > drift_threshold``."""
    drift_min_samples: PosInt = 1_000
    """Minimum samples in the monitoring window before drift can be declared."""
    drift_false_alarm_rate: Annotated[float, Field(ge=0.0, lt=1.0)] = 1e-7
    """Change test of the live bin map (daemon/drift.py): expected false alarms per joined
    sample of a stationary stream (design value); 0 disables the test."""
    drift_baseline_samples: PosInt = 5_000
    """Change test: calibrated samples after a map's installation that form its baseline."""
    drift_min_shift: NonNegFloat = 0.01
    """Change test: the smallest increase, in a statistic's own units (l2 ECE, Err_p), it is
    tuned to detect."""
    recovery: Literal["epochs", "online"] | None = None
    """How the model is (re)calibrated (None: from ``mode``: ``online`` certified, ``epochs``
    paper). ``online`` (the default of the certified mode): the online loop (lpcal.online):
    the warm-up ends when the temperature is determined, pools and held-out samples cover a
    sliding window of ``window_buckets`` buckets of ``bucket_size`` samples, and a candidate is
    published only when held-out data says it beats the live map; after a drift only
    post-drift buckets count. ``epochs``: fixed epochs, each fitted when its pools are full and
    the next filled from nothing (the only choice of ``mode = "paper"``, which is Algorithm 2
    exactly, on epochs). The epoch options (``sizing``, ``mu_pool``, ``pool``, ``variant``,
    ``prescale``, ``outside``, ``holdout``, ``warmup``) apply to ``epochs`` only; the settings
    below to ``online`` only. Samples to a first and a repaired map: docs/benchmarks.md,
    section recovery."""
    warmup_tol: PosFloat = 0.05
    """Online: the warm-up ends when the 95% interval of ln T (the temperature) is narrower
    than this."""
    bucket_size: PosInt = 1_000
    """Online: samples per bucket of the sliding window (a multiple of 250)."""
    window_buckets: Annotated[int, Field(ge=2)] = 32
    """Online: buckets in the sliding window (the window covers the last
    ``(window_buckets - 1) * bucket_size`` to ``window_buckets * bucket_size`` samples)."""
    challenger_alpha: Annotated[float, Field(gt=0.0, lt=0.5)] = 0.05
    """Online: total probability, over all the tests against one live map, of publishing a
    candidate that is not better than it on held-out data."""
    fit_delay: PosInt = 1_000
    """Online: samples after a fit request at which its result takes effect (a multiple of
    250): decisions depend on the input order only, and the model's input pauses at that
    sample until the fit is back."""

    @model_validator(mode="after")
    def _window(self) -> ModelSettings:
        if self.window_samples is None and self.window_seconds is None:
            field_errors("ModelSettings", [(("window_samples",), ("one of window_samples or "
                                            "window_seconds must be set"))])
        return self

    @model_validator(mode="after")
    def _fit_mode(self) -> ModelSettings:
        """Reject at startup every mode/prescale/holdout/warmup combination an epoch cannot run."""
        problems = []
        if self.prescale_value == "temperature" and self.warmup_value == 0:
            problems.append((("warmup",), ("prescale = 'temperature' needs warmup > 0 (the "
                             "samples each epoch fits its temperature on): set warmup > 0 or "
                             "prescale = 'none'")))
        if self.prescale_value == "none" and self.warmup_value > 0:
            problems.append((("warmup",), (f"warmup = {self.warmup_value} is only used with "
                             "prescale = 'temperature': remove it, or set prescale = "
                             "'temperature'")))
        for name in ("bucket_size", "fit_delay"):
            if getattr(self, name) % 250:
                problems.append(((name,), (f"{name} = {getattr(self, name)} must be a "
                                 "multiple of 250 (the online loop's decision step)")))
        if self.mode == "paper" and self.recovery == "online":
            problems.append((("recovery",), ("mode = 'paper' is Algorithm 2 exactly, on fixed "
                             "epochs; the online loop pre-calibrates and tests candidates on "
                             "held-out data: set recovery = 'epochs' (or remove it), or mode = "
                             "'certified'")))
        elif self.recovery_value == "online":
            problems += [((name,), (f"{name} = {getattr(self, name)!r} applies to recovery = "
                          "'epochs' only (the online loop sizes its own sliding window: "
                          "bucket_size, window_buckets): set recovery = 'epochs' to keep it, "
                          "or remove it")) for name in self.epoch_only_set()]
        if self.mode == "certified" and self.holdout_value == 0:
            problems.append((("holdout",), ("mode = 'certified' needs held-out samples "
                             "(holdout > 0) to certify each bin map: set holdout > 0, or mode "
                             "= 'paper' to fit without a certificate")))
        field_errors("ModelSettings", problems)
        return self

    def fit_spec(self) -> FitSpec:
        """The :class:`lpcal.spec.FitSpec` of this model's fits, ``prescale`` and ``outside``
        resolved from ``mode`` (``pool`` unset stays unset: an epoch's layout then uses
        :data:`daemon.specs.DEFAULT_POOL`): the one translation of these settings into fit
        options."""
        return FitSpec(eps=self.eps, p=self.p, delta=self.delta, sizing=self.sizing,
                       pool_size=self.pool, mu_pool=self.mu_pool, variant=self.variant,
                       mode=self.mode, prescale=self.prescale_value, outside=self.outside_value)

    def epoch_spec(self) -> EpochSpec:
        """How this model's epochs are filled and fitted (:class:`daemon.specs.EpochSpec`):
        :meth:`fit_spec` with the held-out and warm-up samples per epoch."""
        return EpochSpec(self.fit_spec(), holdout=self.holdout_value, warmup=self.warmup_value)

    def monitor_spec(self) -> MonitorSpec:
        """This model's window, drift trigger and change test (:class:`daemon.specs.
        MonitorSpec`; ``drift_threshold`` resolved)."""
        return MonitorSpec(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(MonitorSpec)
                              if f.name != "drift_threshold"},
                           drift_threshold=self.drift_threshold_value)

    def online_spec(self) -> OnlineSpec:
        """How this model recovers (:class:`daemon.specs.OnlineSpec`): ``recovery`` (resolved
        from ``mode``) and the online loop's knobs."""
        return OnlineSpec(recovery=self.recovery_value, warmup_tol=self.warmup_tol,
                          bucket_size=self.bucket_size, window_buckets=self.window_buckets,
                          challenger_alpha=self.challenger_alpha, fit_delay=self.fit_delay)

    @property
    def recovery_value(self) -> str:
        """``recovery`` with its default (from ``mode``) applied: :data:`DEFAULT_RECOVERY`."""
        return DEFAULT_RECOVERY[self.mode] if self.recovery is None else self.recovery

    def epoch_only_set(self) -> list[str]:
        """The epoch options (:data:`EPOCH_ONLY`) set to something the online loop does not
        run (``prescale = "temperature"`` and ``outside = "identity"`` are what it runs)."""
        return [name for name, runs in EPOCH_ONLY.items()
                if getattr(self, name) is not None and getattr(self, name) not in runs]

    @property
    def prescale_value(self) -> str:
        """``prescale`` with its default (from ``mode``) applied."""
        return self._from_mode("prescale", self.prescale)

    @property
    def outside_value(self) -> str:
        """``outside`` with its default (from ``mode``) applied."""
        return self._from_mode("outside", self.outside)

    def _from_mode(self, name: str, value: str | None) -> str:
        """``value``, or the default ``mode`` implies for option ``name``
        (:data:`lpcal.spec.MODE_DEFAULTS`)."""
        return MODE_DEFAULTS[Mode(self.mode)][name].value if value is None else value

    @property
    def holdout_value(self) -> int:
        """``holdout`` with its default (from ``mode``) applied."""
        return DEFAULT_HOLDOUT[self.mode] if self.holdout is None else self.holdout

    @property
    def warmup_value(self) -> int:
        """``warmup`` with its default (from ``prescale``) applied."""
        if self.warmup is not None:
            return self.warmup
        return DEFAULT_WARMUP if self.prescale_value == "temperature" else 0

    @property
    def drift_threshold_value(self) -> float:
        """``drift_threshold`` with its default (``eps``) applied."""
        return self.eps if self.drift_threshold is None else self.drift_threshold


def _overrides_model() -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for name, info in ModelSettings.model_fields.items():
        fields[name] = (Optional[info.rebuild_annotation()], None)  # noqa: UP045 (runtime)
    return create_model("ModelOverrides", __base__=Strict, **fields)


ModelOverrides = _overrides_model()
ModelOverrides.__doc__ = "Per-model overrides: any subset of ModelSettings' fields."

