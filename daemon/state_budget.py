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
models)`` (the registry recomputes it as models come and go). It is enforced on the bytes the
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

from daemon import monitor
from lpcal.pools import COMPACT_MIN_BYTES, PoolLayout

__all__ = ["EPOCH_SHARE", "MONITOR_SHARE", "SEALED_SHARE", "epoch_bytes",
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
