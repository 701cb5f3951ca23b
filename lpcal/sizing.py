"""Pool sizes of Algorithm 2: the paper's constants (``theory``) or explicit sizes (``practical``).

``theory`` follows Section 3.1 with ``L = floor(log2(6/beta)) + 1`` levels and ``|B| <= 6/beta``:

* the ``mu`` pool (Lemma samples-probabilities with ``alpha_1 = beta/12``, ``delta_1 = delta/3``)::

      m_1 = ln(4 / (alpha_1 delta_1)) / (2 alpha_1^2)
      m_2 = 4 / (3 alpha_1) * ln(2 |V| / delta_1),      |V| <= C(lambda + k, k)

* every level-``i`` estimation pool (Lemma adaptive-samples with ``alpha = beta / (36 L)``,
  ``delta_i = delta / (3 L)`` and ``n_i = floor(|B|max / 2^i)`` disjoint groups of size ``2^i``)::

      m = 32 ln(4 n_i d / delta_i) / alpha^2     (d = 1 for P, k for E, k + 1 for a shared pool)

  with Laplace noise of scale ``8 / (m alpha)`` on every reported estimate.

These sizes give the theorem's guarantee but are astronomically large for practical ``eps``
(about 1.2e11 samples in total for ``eps = 0.05, p = inf, k = 10, delta = 0.1``); they are reported
honestly, never silently reduced. ``practical`` takes explicit sizes; the Laplace noise is off by
default there because at practical sizes its scale swamps the estimates.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from lpcal.errors import InputError, shown
from lpcal.levels import beta_for, lambda_for
from lpcal.pools import PoolLayout, n_levels, pool_names


def log_level_set_bound(lam: int, k: int) -> float:
    """``ln C(lambda + k, k)`` without forming the (possibly huge) integer."""
    return math.lgamma(lam + k + 1) - math.lgamma(k + 1) - math.lgamma(lam + 1)


@dataclass(frozen=True)
class Sizing:
    """Pool sizes of one calibration, with how they were derived."""

    mode: str  # "theory" | "practical"
    variant: str  # "split" | "shared"
    eps: float
    p: float
    delta: float
    beta: float
    lam: int
    k: int
    levels: int
    targets: dict[str, int]
    noise_scales: dict[str, float] = field(default_factory=dict)  # Laplace scale per pool, 0 = off
    warnings: tuple[str, ...] = ()
    holdout: int = 0  # held-out samples of the certificate (certified mode)
    warmup: int = 0   # warm-up samples of the temperature pre-calibrator (streaming epochs)

    @property
    def total(self) -> int:
        """Samples of one epoch: every pool, the held-out share and the warm-up."""
        return sum(self.targets.values()) + self.holdout + self.warmup

    def layout(self) -> PoolLayout:
        return PoolLayout(self.k, self.lam, self.levels, self.variant, self.targets,
                          self.holdout, self.warmup)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "variant": self.variant,
            "levels": self.levels,
            "pools": dict(self.targets),
            "holdout": self.holdout,
            "warmup": self.warmup,
            "total": self.total,
            "noise_scales": dict(self.noise_scales),
            "warnings": list(self.warnings),
        }


def _check_variant(variant: str) -> None:
    if variant not in ("split", "shared"):
        raise InputError(f"variant must be 'split' or 'shared', got {variant!r}")


def theory_sizing(eps: float, p: float, delta: float, k: int, variant: str = "split",
                  noise: bool = True) -> Sizing:
    """Every pool size from the paper's constants (see the module docstring)."""
    _check_variant(variant)
    if not (0 < delta < 1):
        raise InputError(f"delta must lie in (0, 1), got {shown(delta)}")
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    L = n_levels(beta)
    b_max = math.floor(6.0 / beta + 1e-9)
    a1, d1 = beta / 12.0, delta / 3.0
    m1 = math.log(4.0 / (a1 * d1)) / (2.0 * a1 * a1)
    m2 = 4.0 / (3.0 * a1) * (math.log(2.0 / d1) + log_level_set_bound(lam, k))
    targets = {"mu": math.ceil(m1 + m2)}
    alpha, d_i = beta / (36.0 * L), delta / (3.0 * L)
    scales: dict[str, float] = {"mu": 0.0}

    def pool(n_i: int, dim: int) -> int:
        return math.ceil(32.0 * math.log(4.0 * n_i * dim / d_i) / alpha**2)

    for i in range(L):
        n_i = max(1, b_max >> i)
        if variant == "split":
            targets[f"P{i}"] = pool(n_i, 1)
            targets[f"E{i}"] = pool(n_i, k)
        else:
            targets[f"PE{i}"] = pool(n_i, k + 1)
    for name, m in targets.items():
        if name != "mu":
            scales[name] = 8.0 / (m * alpha) if noise else 0.0
    return Sizing("theory", variant, eps, p, delta, beta, lam, k, L, targets, scales)


def practical_sizing(eps: float, p: float, delta: float, k: int, *, mu_pool: int, pool: int,
                     variant: str = "split", noise: bool = False) -> Sizing:
    """Explicit sizes: ``mu_pool`` samples for ``mu``, ``pool`` for every estimation pool.

    Warns when ``mu_pool < 6/beta``: below that a single sample gives mass ``>= beta/6``, so
    every observed bin enters ``B``. ``noise=True`` adds the theory's Laplace noise, with scale
    ``8/(m alpha)``, ``alpha = beta/(36 L)``.
    """
    _check_variant(variant)
    if mu_pool < 1 or pool < 1:
        raise InputError(f"pool sizes must be positive, got mu_pool={mu_pool}, pool={pool}")
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    L = n_levels(beta)
    names = pool_names(L, variant)
    targets = {n: int(mu_pool if n == "mu" else pool) for n in names}
    alpha = beta / (36.0 * L)
    scales = {n: (8.0 / (targets[n] * alpha) if (noise and n != "mu") else 0.0) for n in names}
    warns = []
    if mu_pool < 6.0 / beta:
        msg = (f"mu pool of {mu_pool} samples is below 6/beta = {6.0 / beta:.0f}: every observed "
               f"bin will enter B")
        warnings.warn(msg, stacklevel=2)
        warns.append(msg)
    return Sizing("practical", variant, eps, p, delta, beta, lam, k, L, targets, scales,
                  tuple(warns))
