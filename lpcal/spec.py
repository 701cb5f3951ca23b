"""The fit specification: every option of a calibration fit, typed and validated in one place.

:class:`FitSpec` is what :func:`lpcal.fit` takes (as ``spec=`` or as keyword options) and what the
daemon builds from each model's settings, so the library and the stream size and run their fits
the same way. It is a frozen dataclass: options are checked once, when it is built, against the
declarative table :data:`FitSpec.RULES` (type, allowed values), and string options become enums.

Sizing (:meth:`FitSpec.pool_sizing`) is the one place where the pools of an epoch are derived:
``theory`` from the paper's constants, ``practical`` from explicit sizes (or, for a fit from one
sample, by splitting the sample evenly over the pools).

Examples
--------
>>> import math
>>> from lpcal.spec import FitSpec, Mode
>>> spec = FitSpec(eps=0.05, p=math.inf)
>>> spec.mode is Mode.CERTIFIED, spec.lam, str(spec.prescale_value), spec.holdout_fraction_value
(True, 20, 'temperature', 0.3)
>>> FitSpec(eps=0.05, p=math.inf, mode="fast")
Traceback (most recent call last):
...
lpcal.errors.InputError: mode must be one of 'certified', 'paper', got 'fast'
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from enum import StrEnum
from typing import Any, ClassVar

from lpcal.errors import InputError, shown
from lpcal.levels import beta_for, lambda_for
from lpcal.p_norm import ERR_P_DOMAIN, P_DOMAIN, parse_p
from lpcal.pools import n_levels, pool_names
from lpcal.sizing import practical_sizing, theory_sizing

__all__ = ["EPS_AUTO", "ERR_P_DOMAIN", "P_DOMAIN", "FitSpec", "Mode", "Outside", "Prescale", "SizingRule",
           "Variant", "parse_p"]

#: The ``eps`` that asks :func:`lpcal.fit` to choose the target from the data.
EPS_AUTO = "auto"

class Mode(StrEnum):
    """``certified``: held-out certificate, temperature pre-calibration, selection;
    ``paper``: Algorithm 2 as published (see :mod:`lpcal.calibrate`)."""

    CERTIFIED = "certified"
    PAPER = "paper"


class SizingRule(StrEnum):
    """``practical``: explicit pool sizes; ``theory``: the paper's constants."""

    PRACTICAL = "practical"
    THEORY = "theory"


class Variant(StrEnum):
    """``shared``: a group's P and E from one pool per level; ``split``: the paper's pools."""

    SHARED = "shared"
    SPLIT = "split"


class Prescale(StrEnum):
    """The pre-calibrator fitted before binning."""

    TEMPERATURE = "temperature"
    NONE = "none"


class Outside(StrEnum):
    """What a bin map returns outside ``B``: the (pre-calibrated) input, or ``rho(R(.))``."""

    IDENTITY = "identity"
    RHO = "rho"


#: What each mode implies for the options left at None.
MODE_DEFAULTS: dict[Mode, dict[str, Any]] = {
    Mode.CERTIFIED: {"prescale": Prescale.TEMPERATURE, "outside": Outside.IDENTITY,
                     "holdout_fraction": 0.3},
    Mode.PAPER: {"prescale": Prescale.NONE, "outside": Outside.RHO, "holdout_fraction": 0.0},
}


def _real(lo: float, hi: float, *, lo_open: bool = True, hi_open: bool = True,
          inf: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return False
        v = float(v)
        if math.isinf(v):
            return inf and v > 0
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
    return ok


def _int(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= lo


@dataclasses.dataclass(frozen=True)
class FitSpec:
    """Every option of a fit (module docstring); build it once, pass it to :func:`lpcal.fit`.

    Parameters
    ----------
    eps : float or "auto"
        Target lp calibration error, in ``(0, 1)``; ``"auto"``: chosen from the data by
        :func:`lpcal.fit` (:data:`EPS_AUTO`, :func:`lpcal.calibrate.auto_eps`), on the share
        it fits on, never the held-out share.
    p : float or str
        The ``p`` of ``Err_p``: a number > 1, or ``math.inf`` (also ``"inf"``): :func:`parse_p`.
    delta : float, default 0.1
        Failure probability of the guarantee; the certificate's level is ``1 - delta``.
    mode : {"certified", "paper"}, default "certified"
        See :class:`Mode`.
    sizing : {"practical", "theory"}, default "practical"
        See :class:`SizingRule` and :meth:`pool_sizing`.
    pool_size, mu_pool : int, optional
        Practical sizes: samples per estimation pool and for ``mu`` (default ``pool_size``).
    variant : {"shared", "split"}, default "shared"
        See :class:`Variant`.
    noise : bool, optional
        Laplace noise of Lemma adaptive-samples (default: on for ``theory``, off otherwise).
    prescale : {"temperature", "none"}, optional
        Pre-calibrator (default from ``mode``: :data:`MODE_DEFAULTS`).
    outside : {"identity", "rho"}, optional
        Bin map outside ``B`` (default from ``mode``).
    holdout_fraction : float, optional
        Share of a sample held out for the certificate, in ``[0, 1)`` (default from ``mode``).
    seed : int, default 0
        Seed of the sample split and of the kernel's noise.
    max_iter : int, optional
        Cap on the kernel's iterations (default: the paper's bound).

    Raises
    ------
    InputError
        An option of the wrong type or outside its allowed values, naming it.
    """

    eps: float | str
    p: float
    delta: float = 0.1
    mode: Mode = Mode.CERTIFIED
    sizing: SizingRule = SizingRule.PRACTICAL
    pool_size: int | None = None
    mu_pool: int | None = None
    variant: Variant = Variant.SHARED
    noise: bool | None = None
    prescale: Prescale | None = None
    outside: Outside | None = None
    holdout_fraction: float | None = None
    seed: int = 0
    max_iter: int | None = None

    #: option -> (check, what is allowed); enums are checked by their type.
    RULES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "eps": (lambda v: v == EPS_AUTO or _real(0.0, 1.0)(v), "a number in (0, 1) or 'auto'"),
        "delta": (_real(0.0, 1.0), "a number in (0, 1)"),
        "pool_size": (_int(1), "a positive integer"),
        "mu_pool": (_int(1), "a positive integer"),
        "noise": (lambda v: isinstance(v, bool), "True or False"),
        "holdout_fraction": (_real(0.0, 1.0, lo_open=False), "a number in [0, 1)"),
        "seed": (_int(0), "a non-negative integer"),
        "max_iter": (_int(0), "a non-negative integer"),
    }
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {
        "mode": Mode, "sizing": SizingRule, "variant": Variant, "prescale": Prescale,
        "outside": Outside,
    }

    def __post_init__(self) -> None:
        for name, enum in self.ENUMS.items():
            v = getattr(self, name)
            if v is None or isinstance(v, enum):
                continue
            try:
                object.__setattr__(self, name, enum(v))
            except ValueError:
                allowed = ", ".join(repr(e.value) for e in enum)
                raise InputError(f"{name} must be one of {allowed}, got {shown(v)}") from None
        object.__setattr__(self, "p", parse_p(self.p))
        for name, (ok, allowed) in self.RULES.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise InputError(f"{name} must be {allowed}, got {shown(v)}")

    @classmethod
    def from_options(cls, spec: FitSpec | None = None, **options: Any) -> FitSpec:
        """``spec`` with ``options`` replaced, or a new spec from ``options``; unknown option
        names raise :class:`InputError` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InputError(f"unknown fit option(s) {unknown}; known: {sorted(known)}")
        if spec is None:
            missing = [n for n in ("eps", "p") if n not in options]
            if missing:
                raise InputError(f"a fit needs {missing} (or spec=FitSpec(...))")
            return cls(**options)
        return dataclasses.replace(spec, **options)

    # ------------------------------------------------------------------ derived values
    @property
    def eps_auto(self) -> bool:
        """``eps = "auto"``: :func:`lpcal.fit` resolves it from the data before fitting."""
        return self.eps == EPS_AUTO

    @property
    def beta(self) -> float:
        """``beta = eps^(p/(p-1)) / 2^(1/(p-1))`` (``eps`` for ``p = inf``)."""
        if self.eps_auto:
            raise InputError("eps='auto' has no beta until lpcal.fit resolves it from the data")
        return beta_for(self.eps, self.p)

    @property
    def lam(self) -> int:
        """``lambda = ceil(1/beta)``: level sets of width ``1/lambda``."""
        return lambda_for(self.beta)

    def _from_mode(self, name: str) -> Any:
        v = getattr(self, name)
        return MODE_DEFAULTS[self.mode][name] if v is None else v

    @property
    def prescale_value(self) -> Prescale:
        return self._from_mode("prescale")

    @property
    def outside_value(self) -> Outside:
        return self._from_mode("outside")

    @property
    def holdout_fraction_value(self) -> float:
        return float(self._from_mode("holdout_fraction"))

    # ------------------------------------------------------------------ sizing
    def pool_sizing(self, k: int, *, n_fit: int | None = None, holdout: int = 0,
                    warmup: int = 0):
        """The :class:`lpcal.sizing.Sizing` of one epoch with ``k`` classes.

        ``theory``: the paper's sizes (``n_fit``, if given, must cover them). ``practical``:
        ``pool_size`` per estimation pool and ``mu_pool`` (default ``pool_size``) for ``mu``;
        without ``pool_size``, ``n_fit`` samples are split evenly over the pools (``mu`` takes
        the remainder). ``holdout`` and ``warmup`` are recorded in the sizing and its layout.

        Raises
        ------
        InputError
            Too few samples for the requested pools, or neither ``pool_size`` nor ``n_fit``.
        """
        if self.sizing is SizingRule.THEORY:
            sz = theory_sizing(self.eps, self.p, self.delta, k, self.variant.value,
                               noise=True if self.noise is None else self.noise)
            if n_fit is not None and sz.total > n_fit:
                raise InputError(
                    f"theory sizing needs {sz.total:.3g} samples ({sz.levels} levels, mu pool "
                    f"{sz.targets['mu']:.3g}, largest pool {max(sz.targets.values()):.3g}); "
                    f"got {n_fit}. Use practical sizing (pool_size=...) instead.")
        else:
            pool, mu = self.pool_size, self.mu_pool
            if pool is None:
                if n_fit is None:
                    raise InputError("practical sizing needs pool_size (or a sample to split)")
                n_pools = len(pool_names(n_levels(self.beta), self.variant.value))
                pool = n_fit // n_pools
                if pool < 1:
                    raise InputError(f"{n_fit} samples cannot fill {n_pools} pools")
                mu = mu or n_fit - pool * (n_pools - 1)
            sz = practical_sizing(self.eps, self.p, self.delta, k, mu_pool=mu or pool,
                                  pool=pool, variant=self.variant.value,
                                  noise=bool(self.noise))
            if n_fit is not None and sz.total > n_fit:
                raise InputError(f"practical sizing with pool_size={pool} needs {sz.total} "
                                 f"samples besides the {holdout} held out; got {n_fit}")
        return dataclasses.replace(sz, holdout=int(holdout), warmup=int(warmup))
