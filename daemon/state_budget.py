"""Byte budget of a model's calibration state: pools, held-out sums and monitoring window. Pure.

A model's join buffer has its own budget (:mod:`daemon.join`). What remains of its memory grows
with the number of *distinct bins* its samples fall in, times ``k``, which the input decides: a
stream whose predictions all round to different level sets (hostile, or ``k = 1000`` with spread
probabilities) makes every sample a new bin, while real models' samples share few bins. Upper
bounds per sample, from the arrays that hold them:

===================  ===============================  ============================================
structure            bytes per sample, at most        why
===================  ===============================  ============================================
pool table           ``2 (36 + 8 min(k, lambda))``    hash, CSR pointer, a level-set row ``c =
                                                      lambda R(x)`` has at most ``min(k, lambda)``
                                                      non-zeros (its entries sum to at most
                                                      lambda), one (bin, label, count) entry;
                                                      buffered rows never take more than the
                                                      compacted table (``x 2``)
held-out sums        ``2 (28 k + 16)``                two :class:`lpcal.holdout.HoldoutSums`
                                                      (scaled and raw predictor): int32 row, int64
                                                      ``[Y | G | Q]``, hash, count
monitoring window    ``2 (16 k + 16)``                raw and calibrated sums ``S, Q``
===================  ===============================  ============================================

At ``k = 1000`` and the default sizes (35,000 pool and 3,000 held-out samples per epoch, a
10,000-sample window) the worst case is ~170 MB per epoch and 320 MB of window; at ``k = 10``
about 6 MB and 3.5 MB (:func:`epoch_bytes`, :func:`monitor_sample_bytes`).

**The budget** of a model is ``share = min(state.max_bytes_per_model, state.max_bytes_total /
planned)``, where ``planned`` is at least the number of models and at most ``STEP**2`` times it
(:class:`BudgetShares`: the registry asks it as models come and go, at O(1) amortised cost). It is enforced on the bytes the
arrays actually take, in four quarters:

* the monitoring window: :meth:`daemon.monitor.WindowMonitor.set_max_bytes` drops its oldest
  buckets beyond a quarter (the window covers fewer samples; counted in
  ``lpcal_window_trimmed_samples_total``);
* the filling epoch: one that, compacted, takes more than a quarter after a batch is sealed
  then, before its pools are full, and fitted as it is (counted in
  ``lpcal_epochs_sealed_early_total``; smaller pools, a looser certificate);
* the sealed epochs waiting for their fit: while they take a quarter or more, the model is
  backlogged (its input partition pauses until fits catch up, as at ``MAX_SEALED`` epochs);
* the epoch being fitted (one per model; at most a quarter, as it was filled under the rule
  above).

So a model's state stays within its share plus one batch (and the transient copies of a fit or
an evaluation), and the replica's within ``state.max_bytes_total``. Epoch boundaries depend only
on the samples while no epoch reaches the budget; one sealed early depends on the batching too,
so a replay after a crash may seal it at another sample.

**Sizing.** Real models' samples share bins: measured on the CIFAR records of
``tests/bench/data`` at the default sizes, a full epoch takes 1.7 MiB and the window 1.1 MiB
for LeNet-5 on CIFAR-10 (k = 10), and 6.4 MiB and 8.2 MiB for DenseNet on CIFAR-100 (k = 100).
A model runs undegraded when its share is four times the larger of the two (7 MiB and 33 MiB
there): the default ``max_bytes_total`` (320 MiB) holds about 45 such k = 10 models or 9 such
k = 100 models.
"""

from __future__ import annotations

import math

from daemon import monitor
from lpcal.pools import COMPACT_MIN_BYTES, PoolLayout

__all__ = ["EPOCH_SHARE", "MONITOR_SHARE", "SEALED_SHARE", "STEP", "BudgetShares", "epoch_bytes",
           "holdout_sample_bytes", "monitor_sample_bytes", "pool_sample_bytes"]

MONITOR_SHARE = 0.25
EPOCH_SHARE = 0.25
SEALED_SHARE = 0.25


def pool_sample_bytes(k: int, lam: int) -> int:
    """Upper bound of the bytes one sample adds to a pool table (module docstring)."""
    return 2 * (36 + 8 * min(int(k), int(lam)))


def holdout_sample_bytes(k: int) -> int:
    """Upper bound of the bytes one held-out sample adds to an epoch's two held-out sums."""
    return 2 * (28 * int(k) + 16)


def monitor_sample_bytes(k: int) -> int:
    """Upper bound of the bytes one sample adds to the monitoring window's sums
    (:func:`daemon.monitor.sample_bytes`, which the window's own slicing uses)."""
    return monitor.sample_bytes(k)


def epoch_bytes(layout: PoolLayout) -> int:
    """Upper bound of the bytes of one full epoch of ``layout``: every sample in its own bin,
    plus each table's floor of buffered rows and the warm-up grid (for sizing the budget)."""
    fixed = len(layout.names) * COMPACT_MIN_BYTES + 4096
    pools = sum(layout.targets.values()) * pool_sample_bytes(layout.k, layout.lam)
    return fixed + pools + layout.holdout * holdout_sample_bytes(layout.k)


#: growth factor of :class:`BudgetShares`' planned model count
STEP = 1.25


class BudgetShares:
    """Per-model shares of the replica's two byte budgets (join buffers, and pools + windows),
    kept with O(1) amortised work per admission and release.

    The exact rule, ``share = min(per_model, total // models)``, changes with every model that
    comes or goes, and each change has to be applied to every model: O(models) per admission,
    O(models^2) to admit ``models`` models. Here the shares follow a *planned* count instead:
    ``share = min(per_model, total // planned)`` with ``models <= planned``, so that
    ``models * share <= total`` always holds: **the budgets are never exceeded**.

    * :meth:`admit`: while ``models <= planned`` a new model gets the current shares at once and
      nothing else changes; when it goes beyond, ``planned`` becomes ``ceil(models * step)`` and
      every model is given the new (smaller) shares.
    * :meth:`release`: ``planned`` is lowered (to ``ceil(models * step)``, so shares grow) only
      once ``models * step**2 <= planned``. Between the two thresholds nothing changes, so
      admitting and releasing one model at a boundary does not walk the models each time
      (hysteresis).

    Both walks happen only after the count changed by a fixed fraction of itself (at least
    ``step - 1`` of it up, ``1 - 1/step`` down), so their cost, O(models), is O(1) per
    admission or release, amortised. **The trade-off**: a model's share can be up to
    ``step**2`` (1.56 at the default :data:`STEP`; at a handful of models ``ceil(models * step)
    / models``) below ``total / models``: up to ``1 - 1/step**2`` of the total budget can sit
    unused because of it, and never more than the total is handed out. With ``per_model`` binding (few models) the shares are exactly ``per_model``.

    Methods return True when the shares changed (the caller then gives every model the new
    ``join_share`` and ``state_share``), else False (only the model admitted needs them).
    """

    __slots__ = ("join_per_model", "join_total", "models", "planned", "state_per_model",
                 "state_total", "step")

    def __init__(self, join_per_model: int, join_total: int, state_per_model: int,
                 state_total: int, *, step: float = STEP, models: int = 0):
        if not step > 1.0 or not math.isfinite(step):
            raise ValueError(f"BudgetShares: step={step!r} must be a finite number > 1")
        for name, v in (("join_per_model", join_per_model), ("join_total", join_total),
                        ("state_per_model", state_per_model), ("state_total", state_total)):
            if int(v) < 1:
                raise ValueError(f"BudgetShares: {name}={v!r} must be >= 1")
        self.join_per_model, self.join_total = int(join_per_model), int(join_total)
        self.state_per_model, self.state_total = int(state_per_model), int(state_total)
        self.step = float(step)
        self.models = 0
        self.planned = 1
        self.set_count(models)

    @classmethod
    def from_settings(cls, join, state, **kw) -> BudgetShares:
        """From the ``join`` and ``state`` settings (``max_bytes_per_model``,
        ``max_bytes_total``)."""
        return cls(join.max_bytes_per_model, join.max_bytes_total, state.max_bytes_per_model,
                   state.max_bytes_total, **kw)

    # ---------------------------------------------------------------- the shares
    @property
    def join_share(self) -> int:
        """Each model's byte budget of its join buffer."""
        return max(1, min(self.join_per_model, self.join_total // self.planned))

    @property
    def state_share(self) -> int:
        """Each model's byte budget of its pools, held-out sums and window."""
        return max(1, min(self.state_per_model, self.state_total // self.planned))

    def shares(self) -> tuple[int, int]:
        """``(join_share, state_share)``."""
        return self.join_share, self.state_share

    # ---------------------------------------------------------------- models come and go
    def admit(self, n: int = 1) -> bool:
        """``n`` models more; True when the shares changed (walk every model)."""
        return self.set_count(self.models + int(n))

    def release(self, n: int = 1) -> bool:
        """``n`` models fewer; True when the shares changed (walk every model)."""
        return self.set_count(self.models - int(n))

    def set_count(self, models: int) -> bool:
        """The replica now holds ``models`` models (after a bulk restore, say); True when the
        shares changed."""
        models = int(models)
        if models < 0:
            raise ValueError(f"BudgetShares: {models} models")
        self.models = models
        before = self.shares()
        if models > self.planned or models * self.step * self.step <= self.planned:
            self.planned = max(1, math.ceil(models * self.step))
        return self.shares() != before
