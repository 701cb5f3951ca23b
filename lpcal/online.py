"""Online calibration: publish at any time, refit on a sliding window, recover from drift fast.

:class:`OnlineCalibrator` is the library-level loop of the streaming daemon, pure (no I/O, no
clock) and deterministic: feed it batches of ``(probs, labels)`` and it says when to publish
which bin map. It replaces the fixed epoch schedule (a 10,000-sample warm-up, then pools of 5,000
per estimation pool and 3,000 held out, each epoch from nothing: about 48,000 samples before a
k = 10 model's first map) with four pieces:

1. **The warm-up ends when the temperature is determined** (:mod:`lpcal.warmup`): the sandwich
   interval for ``ln T`` from additive score sums is narrower than ``warmup_tol``, checked every
   ``step`` samples (at most ``warmup_max``): a few thousand samples on the CIFAR networks
   (the fit share's 70% of them), against 10,000.
2. **Pools and held-out sums cover a sliding window** (:mod:`lpcal.window`): a ring of
   ``n_buckets`` buckets of ``bucket_size`` samples. The warm-up's temperature ``T0`` bins
   Algorithm 2's pools from then on, and every refit uses the whole window: nothing is thrown
   away at an epoch boundary.
3. **Candidates are fitted as samples accrue**, at the sample counts (since the warm-up began)
   ``n_warm * growth^j`` (geometric: a refit when the window has grown by a factor ``growth``,
   so ``O(log n)`` fits): the temperature of the window's fit share (temperature scaling) and,
   once the pools hold ``pools_from`` samples, Algorithm 2 on the window's pools through
   :func:`lpcal.calibrate.fit_pools` (its held-out certificate picks the pre-calibrator or the
   corrected map; only a corrected map is a new candidate). While the pools hold fewer, the
   next fit point is brought forward to the decision point at which the fit share will have
   filled them (and the schedule continues from there): Algorithm 2 is not held back to the
   next geometric point, up to a factor ``growth`` later.
4. **Champion and challenger** (:mod:`lpcal.challenger`): a candidate is published only when the
   paired held-out loss difference against the live map (the identity before the first map) has
   a one-sided upper bound below 0 at level ``alpha_j = alpha / (j (j + 1))`` for the ``j``-th
   test against that live map (so at most ``alpha`` in all that a map no better than the live
   one is ever published; a *refinement*, the live temperature re-estimated on ``growth``
   times as many samples of the same regime, needs only a lower held-out mean loss).
   Temperature candidates are tested at once on the window's held-out
   :class:`lpcal.challenger.LossGrid` (held out of every fit by routing); a corrected map is
   tested prospectively (*shadow*): both maps score the test-share samples that arrived after
   the snapshot it was fitted on, those that came while the fit ran (kept raw in the window's
   buckets) and those that follow, and it is tested when their count reaches ``min_heldout``,
   then each time it grew by a factor ``growth``. The samples after the snapshot are
   independent of the candidate (a function of the samples before it) and of the live map,
   if that is still the one live at the request (otherwise only the samples from the fit's
   ``due`` sample on count); so the test keeps its level, and the fit delay no longer delays
   it.

:meth:`OnlineCalibrator.notify_drift` (a detected drift: the daemon's change test) keeps only the
buckets after the drift (:meth:`lpcal.window.SlidingWindow.reset_after`), re-opens the warm-up
and restarts the test count; the live map stays until a candidate beats it on post-drift
held-out data. So after a drift the first candidate comes as soon as the new temperature is
determined, and a badly drifted live map is beaten by a wide margin, i.e. after few held-out
samples.

**Fits run off the caller's loop.** The calibrator never runs Algorithm 2 itself (100 ms and
more at k = 100): at a fit point it returns a ``"fit_requested"`` event carrying a
:class:`FitRequest` (a frozen snapshot of the window's pools, the seed, the version), the caller
runs :func:`run_fit` wherever it likes (a worker thread) and hands the map back with
:meth:`OnlineCalibrator.complete`. The result takes effect at sample ``n + fit_delay``, never
earlier or later: if it is not back when the stream gets there, :meth:`OnlineCalibrator.update`
stops at that exact sample and reports ``blocked`` with the rows it consumed (the caller pauses
its input and feeds the rest after ``complete``). So the decisions depend on the input order
only, not on how long fits take. ``fit=run_fit`` in the constructor runs each request at once
(tests, benchmarks, batch use) through the same path. An outstanding request is part of the
checkpoint; a restore re-issues it (fits are deterministic given their pools and seed).

**Evidence on published maps.** Every map published carries the champion/challenger decision it
was published on in ``sizing["evidence"]`` (:func:`evidence`: paired loss, held-out samples,
mean difference, standard error, level spent, the version it beat).

**Certificates.** Every map published also carries a :class:`lpcal.certificate.Certificate` of
its ``Err_p`` at the model's ``eps``, ``p``, ``delta`` and ``lambda`` (:func:`certify_map`),
computed on a **certification share** that no fit and no selection saw. The routing uniform
``u`` of a sample (a hash of its position or event id, independent of its content) sends it to
the fit share ``F`` (``u < a``), the test share ``H`` (``a <= u < c``) or the certification
share ``C`` (``u >= c``, ``c = 1 - (1 - a) cert_share``: ``cert_share`` of the held-out
share; :meth:`lpcal.window.SlidingWindow.certifying`). Within a regime (since the last drift
notification) let the samples be i.i.d. from ``D``:

* every candidate is a function of ``F`` (the temperature of the window's fit share;
  Algorithm 2 on the pools), and every decision, i.e. which candidate is published and when,
  is a function of ``F``, ``H`` and the routing uniforms: the champion/challenger test reads
  only ``H`` (the loss grids, the shadow's paired losses), so does Algorithm 2's own choice
  between the pre-calibrator and the corrected map (its held-out sums are ``H``'s), and the
  decision points are sample counts;
* so given ``F`` and ``H``, the published map ``h`` and its publication sample ``s`` are fixed,
  and the certification samples of the newest ``cert_buckets`` buckets at ``s`` are a fixed
  set of positions whose samples are i.i.d. from ``D`` and independent of ``h``:
  :func:`lpcal.certificate.err_p_bound` there bounds ``Err_p(h)`` with probability
  ``1 - delta'``, as for any fixed map. No union over the candidates tested is needed: the
  selection never looked at ``C``.

**Looks.** A map published before ``C`` held enough samples is not certified at first. While
the live map (published by this loop) is not certified, it is certified again at the next
decision point after the regime's samples grew by ``cert_growth`` (so the certification
samples grew, or were renewed as buckets left the window; at least
:func:`lpcal.certificate.min_certifiable_holdout` of them), and published anew (the same map,
the next version, ``sizing["recertified"]``) only if it is certified now: a choice made on
``C``. So
the ``j``-th certificate of one map is bounded at ``delta' = delta / (j (j + 1))``
(``Certificate.selectable = j (j + 1)``; the first, at publication, at ``delta / 2``), and by a
union bound over the looks, ``sum_j delta / (j (j + 1)) = delta``: with probability at least
``1 - delta`` every certificate published for the map holds at once, whichever one a user
reads. The raw model is bounded at the same level (``vacuous`` when its bound is ``<= eps``).
A re-certified copy is a publication like any other (in the daemon, the change test of the live
map starts a new baseline with it).
Algorithm 2's own certificate of a corrected map (on ``H``) is kept in
``sizing["fit_certificate"]``.

What it does not cover: the drift notifications (the daemon's change test sees every sample,
``C`` included) are taken as given: the argument holds conditionally on where the regimes
start. A certificate is about the distribution of its certification samples (the newest
``cert_buckets`` buckets: 3,600 samples at the defaults); a drift not yet detected inside
them makes it a statement about the mixture. The price is the test share: with
``cert_share = 0.6`` the champion/challenger test reads 12% of the samples instead of 30%
(docs/benchmarks.md, sections ``recovery`` and ``families``, measure what that costs). The
certification share is the larger one because a certificate at ``p = inf`` needs more samples
than a test between a poor live map and a good candidate (on the families benchmark's
family that needs Algorithm 2's correction, the first corrected map's certificate, not its
test, is what the first certified map waits for at an even split).

Determinism: every decision happens at a multiple of ``step`` samples (batches are split there),
every sum is an exact integer, samples are routed by ``uniforms`` (given, e.g. a hash of the event
id, or a counter-based hash of the sample's position in the stream) and fit seeds are sample
counts. The same samples in the same order give the same decisions and the same maps (up to
their ``created_at`` stamp), however they were batched. Memory is bounded: ``n_buckets`` buckets,
and ``max_bytes`` (if set) drops the oldest sealed buckets beyond it.

Measured on the CIFAR records (samples to a good map at the start and after a logit-scale drift,
against the fixed epoch schedule and temperature scaling): docs/benchmarks.md, section
``recovery``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lpcal.binmap import BinMap, utc_now
from lpcal.certificate import (
    Certificate,
    Estimate,
    bound_method,
    err_p_bound,
    min_certifiable_holdout,
)
from lpcal.challenger import LOSSES, Decision, PairedLoss, challenge
from lpcal.errors import InputError
from lpcal.holdout import HoldoutSums
from lpcal.levels import beta_for, lambda_for
from lpcal.p_norm import parse_p
from lpcal.pools import PoolLayout, PoolSet, n_levels, pool_names
from lpcal.warmup import WarmupSums
from lpcal.window import Memo, PoolsSnapshot, SlidingWindow

__all__ = ["Event", "FitRequest", "OnlineCalibrator", "OnlineConfig", "Update",
           "certify_map", "fit_window_pools", "index_uniforms", "run_fit"]

_ROUTE_KEY = np.uint64(0x9E3779B97F4A7C15)
#: The result of a fit request that failed (:meth:`OnlineCalibrator.complete` with None).
_FAILED = object()


def index_uniforms(start: int, n: int) -> np.ndarray:
    """Uniforms in [0, 1) for the samples at stream positions ``start .. start + n - 1``: the
    splitmix64 finaliser of the position (a counter-based hash: the same position always gets
    the same uniform, whatever the batching)."""
    with np.errstate(over="ignore"):
        z = (np.arange(start, start + n, dtype=np.uint64) + np.uint64(1)) * _ROUTE_KEY
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def fit_window_pools(pools: PoolSet, cfg: OnlineConfig, *, seed: int, model_id: str,
                     version: int) -> BinMap:
    """The one call of :func:`lpcal.calibrate.fit_pools` (certified mode, identity outside
    ``B``): a change of its signature lands here."""
    from lpcal.calibrate import fit_pools
    from lpcal.spec import FitSpec

    return fit_pools(pools, FitSpec(eps=cfg.eps, p=cfg.p, delta=cfg.delta), seed=seed,
                     model_id=model_id, version=version)


@dataclass(frozen=True)
class OnlineConfig:
    """Settings of an :class:`OnlineCalibrator` (module docstring).

    Parameters
    ----------
    eps, p, delta : float
        The fit's target and level (as :func:`lpcal.calibrate.fit_pools`).
    holdout_share : float
        Share of samples routed to the held-out sums (never fitted on).
    bucket_size, n_buckets : int
        The sliding window: ``n_buckets`` buckets of ``bucket_size`` samples.
    step : int
        Decisions (warm-up check, fits, tests) happen at multiples of ``step`` samples.
    warmup_tol, warmup_alpha, warmup_min, warmup_max
        :meth:`lpcal.warmup.WarmupSums.determine`'s ``tol``, ``alpha``, ``min_samples``; the
        warm-up ends at ``warmup_max`` samples whatever the interval.
    alpha : float
        Total level of the champion/challenger tests against one live map.
    loss : {"nll", "brier"}
        The paired loss of the test. Default the log-loss: the objective temperature scaling
        minimises, and the more powerful of the two on the CIFAR networks (the paired z-score
        of temperature scaling against the identity 1.3 to 1.6 times the Brier score's on three
        of four networks, equal on the fourth), so a first map goes out sooner.
    min_heldout : int
        Held-out samples below which no test decides.
    growth : float
        Candidates are fitted when the samples since the warm-up began grow by this factor; a
        shadow challenger is tested again when its paired samples grew by this factor.
    pools_from : int
        Fit-share samples in the window's pools before Algorithm 2 is run (the first fit point
        of a regime comes when the pools are expected to hold them, if that is earlier than
        the geometric schedule's). Fewer samples give a corrected map sooner but a worse one
        (a larger true ``Err_p`` that the certificate then cannot separate from ``eps``):
        3,500 gave the first certified map soonest on the families benchmark (2,500 to
        4,000 tried).
    fit_delay : int
        Samples after a fit request at which its result takes effect (a multiple of ``step``,
        at least ``step``): decisions depend on the input order only, never on how long the
        fit took; if the result is not back by then, :meth:`OnlineCalibrator.update` stops
        there (``blocked``).
    certify_buckets : int
        Newest buckets whose held-out samples are kept (10 buckets of 1,000 at a 30% share:
        3,000 held-out samples, what an epoch of the fixed schedule held out): the test
        share's certify Algorithm 2's fits (its choice between the pre-calibrator and the
        corrected map), the certification share's certify the published maps; the loss grids
        of the champion/challenger test cover the whole window.
    cert_share : float
        Share of the held-out samples kept apart to certify published maps (module
        docstring, *Certificates*): the rest is the test share (champion/challenger and
        Algorithm 2's own selection). 0: published maps carry no certificate of their own.
    cert_growth : float
        An uncertified live map is certified again (a *look*) when the samples of the regime
        have grown by this factor since its last look (module docstring, *Looks*).
    cert_buckets : int
        Newest buckets whose certification samples are kept (20 buckets of 1,000 at an 18%
        share: 3,600 samples).
    max_bytes : int, optional
        Bound on the bytes of the sealed buckets (oldest dropped first).
    """

    eps: float = 0.1
    p: float = math.inf
    delta: float = 0.1
    holdout_share: float = 0.3
    bucket_size: int = 1_000
    n_buckets: int = 32
    step: int = 250
    warmup_tol: float = 0.05
    warmup_alpha: float = 0.05
    warmup_min: int = 500
    warmup_max: int = 10_000
    alpha: float = 0.05
    loss: str = "nll"
    min_heldout: int = 200
    growth: float = 1.5
    pools_from: int = 3_500
    certify_buckets: int = 10
    max_bytes: int | None = None
    fit_delay: int = 1_000
    cert_share: float = 0.6
    cert_growth: float = 1.25
    cert_buckets: int = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", parse_p(self.p))
        checks = {
            "eps": 0 < self.eps < 1, "delta": 0 < self.delta < 1,
            "holdout_share": 0 < self.holdout_share < 1,
            "bucket_size": self.bucket_size >= 1, "n_buckets": self.n_buckets >= 2,
            "step": self.step >= 1 and self.bucket_size % self.step == 0,
            "warmup_tol": self.warmup_tol > 0, "warmup_alpha": 0 < self.warmup_alpha < 1,
            "warmup_max": self.warmup_max >= self.warmup_min >= 1,
            "alpha": 0 < self.alpha < 0.5, "loss": self.loss in LOSSES,
            "min_heldout": self.min_heldout >= 2, "growth": self.growth > 1,
            "pools_from": self.pools_from >= 1, "certify_buckets": self.certify_buckets >= 1,
            "max_bytes": self.max_bytes is None or self.max_bytes > 0,
            "fit_delay": self.fit_delay >= self.step and self.fit_delay % self.step == 0,
            "cert_share": 0 <= self.cert_share < 1, "cert_growth": self.cert_growth > 1,
            "cert_buckets": self.cert_buckets >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise InputError(f"OnlineConfig: invalid {bad} (step must divide bucket_size, "
                             "fit_delay must be a multiple of step)")

    def layout(self, k: int) -> PoolLayout:
        """The window's routing: Algorithm 2's pools (shared variant) in equal shares of the
        fit share, and the held-out share."""
        beta = beta_for(self.eps, self.p)
        names = pool_names(n_levels(beta), "shared")
        per = 1_000
        hold = round(per * len(names) * self.holdout_share / (1.0 - self.holdout_share))
        return PoolLayout(k, lambda_for(beta), n_levels(beta), "shared",
                          dict.fromkeys(names, per), holdout=max(1, hold))


@functools.lru_cache(maxsize=256)
def _layout(config: OnlineConfig, k: int) -> PoolLayout:
    """``config.layout(k)``, one object per configuration (a layout is immutable): the models
    of one configuration share it instead of holding a copy each."""
    return config.layout(k)


#: ``method`` of an online map's certificate without certification samples yet.
NO_CERT_SAMPLES = "none: no certification samples yet"


def certify_map(bm: BinMap, x: np.ndarray, y: np.ndarray, *, look: int = 1) -> Certificate:
    """The :class:`lpcal.certificate.Certificate` of ``bm``'s Err_p at its ``eps``, ``p``,
    ``delta`` and ``lambda`` on certification samples ``(x, y)`` (raw model outputs and labels
    no fit and no selection of ``bm`` used), the ``look``-th certificate of the same map: its
    bound, and the raw model's (reported, for ``vacuous``), at level
    ``1 - delta / (look (look + 1))`` (``selectable = look (look + 1)``; module docstring,
    *Certificates*). The candidate is named ``"corrected"`` (a map with bins) or
    ``"precalibrator"`` (temperature scaling alone, as :func:`lpcal.calibrate.fit` names it)."""
    m = look * (look + 1)
    name = "corrected" if bm.n_bins else "precalibrator"
    y = np.asarray(y, dtype=np.int64)
    if y.size == 0:
        return Certificate(NO_CERT_SAMPLES, float(bm.eps), float(bm.p), int(bm.lam),
                           float(bm.delta), 0, {}, name, False, m)
    x = np.asarray(x, dtype=np.float64)
    est = {}
    for cand, h in (("raw", x), (name, bm.apply(x, check=False))):
        cells = HoldoutSums(bm.k, bm.lam).update(h, y).cells()
        e, b = err_p_bound(cells, bm.p, bm.delta / m, bm.k)
        est[cand] = Estimate(e, b, cells.brier)
    method = f"{bound_method(bm.p)}, certification share, look {look} at delta/{m}"
    return Certificate(method, float(bm.eps), float(bm.p), int(bm.lam), float(bm.delta),
                       int(y.size), est, name, bool(est[name].bound <= bm.eps), m,
                       bool(est["raw"].bound <= bm.eps))


def evidence(dec: Decision, cal: OnlineCalibrator) -> dict[str, Any]:
    """The held-out evidence a map was published on, for its ``sizing["evidence"]``.

    A map the online loop publishes was chosen by the champion/challenger test
    (:func:`lpcal.challenger.challenge`) on the test share; this is that test's evidence
    (its certificate, on the certification share, is ``BinMap.certificate``), JSON-safe::

        {"test": "paired-nll" | "paired-brier", "n_heldout": int,   # paired held-out samples
         "mean_diff": float,      # mean loss, challenger minus champion (< 0: better)
         "stderr": float,         # its standard error
         "upper_bound": float,    # one-sided bound the decision compared with 0
         "alpha": float,          # level spent on this test (0.5: a refinement, no significance)
         "significance": bool, "champion_version": int,  # the live map it beat (0: identity)
         "samples": int}          # the calibrator's sample count at the decision

    Algorithm 2's own certificate of a corrected map is kept in ``sizing["fit_certificate"]``."""
    return {"evidence": {
        "test": f"paired-{dec.loss}", "n_heldout": int(dec.n), "mean_diff": float(dec.mean_diff),
        "stderr": float(dec.stderr), "upper_bound": float(dec.upper_bound),
        "alpha": float(dec.alpha), "significance": dec.alpha < 0.5,
        "champion_version": int(cal.version - 1), "samples": int(cal.n_seen)}}


@dataclass(frozen=True, eq=False)
class FitRequest:
    """A run of Algorithm 2 the calibrator wants (it never runs one itself): the caller runs
    :func:`run_fit` (or :func:`fit_window_pools` on ``pools``) wherever it likes, e.g. in a worker
    thread, and hands the map back with :meth:`OnlineCalibrator.complete`.

    ``id`` numbers the requests of one calibrator; ``n`` is the sample count at which it was
    requested and ``due`` (``n + fit_delay``) the one at which its result takes effect;
    ``snapshot`` is a frozen snapshot of the window's pools
    (:class:`lpcal.window.PoolsSnapshot`), merged into :attr:`pools` on first use, i.e. in the
    thread that runs the fit; ``seed`` and ``version`` the fit's arguments. The fit is
    deterministic given these, so a restore re-issues the request and gets the same map (the
    checkpoint holds the snapshot unmerged: :meth:`lpcal.window.PoolsSnapshot.to_dict`).
    ``held_from``: ``(bucket index, test-share samples it held)`` of the window's open bucket
    at the request, i.e. where the test-share samples that arrive after the snapshot begin
    (the shadow test of a corrected result scores them at once: module docstring, 4.); None in
    a request restored from a state written without it."""

    id: int
    n: int
    due: int
    seed: int
    version: int
    model_id: str
    snapshot: PoolsSnapshot = field(repr=False)
    config: OnlineConfig = field(repr=False)
    held_from: tuple[int, int] | None = None
    _built: list = field(default_factory=list, repr=False)

    @property
    def pools(self) -> PoolSet:
        """The merged pools of the snapshot (built once, in the first thread that asks)."""
        if not self._built:
            self._built.append(self.snapshot.build())
        return self._built[0]

    def to_dict(self, *, packed: bool = False) -> dict[str, Any]:
        out = {"id": self.id, "n": self.n, "due": self.due, "seed": self.seed,
               "version": self.version, "snapshot": self.snapshot.to_dict(packed=packed)}
        if self.held_from is not None:  # absent from a request restored without it
            out["held_from"] = list(self.held_from)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, model_id: str,
                  config: OnlineConfig) -> FitRequest:
        mark = d.get("held_from")
        return cls(int(d["id"]), int(d["n"]), int(d["due"]), int(d["seed"]),
                   int(d["version"]), model_id, PoolsSnapshot.from_dict(d["snapshot"]),
                   config, None if mark is None else (int(mark[0]), int(mark[1])))


def _config_dict(config: OnlineConfig) -> dict[str, Any]:
    """The JSON-safe dict of an :class:`OnlineConfig` (``p = inf`` as ``"inf"``): a fresh
    copy of the one made once per distinct configuration (``dataclasses.asdict`` deep-copies
    every field, about a tenth of a millisecond, which every model of one configuration paid
    at its first checkpoint)."""
    try:
        return dict(_config_dict_once(config))
    except TypeError:  # a field that does not hash
        return _make_config_dict(config)


def _make_config_dict(config: OnlineConfig) -> dict[str, Any]:
    cfg = dataclasses.asdict(config)
    cfg["p"] = "inf" if math.isinf(cfg["p"]) else cfg["p"]
    return cfg


_config_dict_once = functools.lru_cache(maxsize=64)(_make_config_dict)


def run_fit(request: FitRequest) -> BinMap:
    """Run a :class:`FitRequest` (Algorithm 2 on its pools, :func:`fit_window_pools`): the
    call a worker makes; pure, so safe in any thread."""
    return fit_window_pools(request.pools, request.config, seed=request.seed,
                            model_id=request.model_id, version=request.version)


@dataclass
class Update:
    """What one :meth:`OnlineCalibrator.update` did: ``events`` in order, ``consumed`` rows
    of the batch (all of them unless ``blocked``), and ``blocked``: the stream reached the
    ``due`` sample of a :class:`FitRequest` whose result is not back. Feed the rows from
    ``consumed`` on after :meth:`OnlineCalibrator.complete` (which runs the decision that was
    waiting and returns its events)."""

    events: list[Event] = field(default_factory=list)
    consumed: int = 0
    blocked: bool = False

    @property
    def requests(self) -> list[FitRequest]:
        """Fit requests issued by this call (run them, then :meth:`~OnlineCalibrator.complete`)."""
        return [e.request for e in self.events if e.request is not None]

    @property
    def published(self) -> list[BinMap]:
        """Maps published by this call, in order."""
        return [e.binmap for e in self.events if e.kind == "published"]

    def __iter__(self):
        return iter(self.events)


@dataclass(frozen=True)
class Event:
    """Something the calibrator did at sample ``n``: ``kind`` is ``"warmup_end"``,
    ``"published"``, ``"kept"`` (a candidate lost its test), ``"shadow"`` (a corrected map is
    now tested prospectively; ``detail`` says how many paired test-share samples it starts
    with, those that arrived while it was fitted), ``"fit_requested"`` (``request``: run
    it), ``"fit_scheduled"`` (:meth:`OnlineCalibrator.request_fit`), ``"fit_done"`` (a
    request's result took effect; ``detail`` says whether it was a corrected map) or
    ``"drift"``; ``version`` and ``temperature`` of the map concerned, the test's
    :class:`Decision` (if any), and ``binmap`` when published."""

    n: int
    kind: str
    version: int = 0
    temperature: float | None = None
    decision: Decision | None = None
    binmap: BinMap | None = field(default=None, repr=False)
    detail: str = ""
    request: FitRequest | None = field(default=None, repr=False)


class OnlineCalibrator:
    """The online calibration loop for one model with ``k`` classes (module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.online import OnlineCalibrator, OnlineConfig
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(6000, 10)) * 3
    >>> f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)          # overconfident model
    >>> q = np.exp(z / 2) / np.exp(z / 2).sum(axis=1, keepdims=True)  # labels follow T = 2
    >>> y = (q.cumsum(axis=1) > rng.random(6000)[:, None]).argmax(axis=1)
    >>> cal = OnlineCalibrator(10, OnlineConfig(pools_from=10**9))
    >>> events = cal.update(f, y)
    >>> pub = [e for e in events if e.kind == "published"]
    >>> pub[0].n < 5000, abs(cal.live.temperature - 2.0) < 0.15
    (True, True)
    """

    def __init__(self, k: int, config: OnlineConfig | None = None, *,
                 model_id: str = "model",
                 fit: Callable[[FitRequest], BinMap] | None = None) -> None:
        if not isinstance(k, (int, np.integer)) or k < 2:
            raise InputError(f"OnlineCalibrator needs k >= 2 classes, got {k!r}")
        self.k = int(k)
        self.config = config or OnlineConfig()
        self.model_id = model_id
        self.window = SlidingWindow(_layout(self.config, self.k),
                                    bucket_size=self.config.bucket_size,
                                    n_buckets=self.config.n_buckets,
                                    holdout_buckets=self.config.certify_buckets,
                                    cert_share=self.config.cert_share,
                                    cert_buckets=self.config.cert_buckets)
        self.n_seen = 0
        self.regime_start = 0
        self.warm: WarmupSums | None = WarmupSums()
        self.warm_n = 0
        self.pool_temperature: float | None = None
        self.live: BinMap | None = None
        self.version = 0
        self.tests = 0
        self.next_fit_at: int | None = None
        self.shadow: tuple[BinMap, PairedLoss] | None = None
        self.shadow_next_test = 0
        self.live_fit_n = 0        # fit-share samples behind the live temperature
        self.live_regime = -1      # regime_start when the live map was published
        #: runs a fit request at once (tests, benchmarks, the CLI); None: the caller runs
        #: each request and calls :meth:`complete`
        self.fit = fit
        self.pending: FitRequest | None = None    # at most one fit request outstanding
        self.result: BinMap | None = None         # its result, once complete
        self.requests_issued = 0
        self.waiting = False       # the decision at ``pending.due`` waits for its result
        #: certificates computed for the live map (0: not published by this loop) and the
        #: regime's sample count from which the next is due while it is not certified
        self.cert_looks = 0
        self.cert_next = 0

    # ------------------------------------------------------------------ feeding
    def update(self, probs, labels, uniforms=None) -> Update:
        """Feed validated rows ``probs`` (n, k) and labels (n,) in stream order (``uniforms``:
        routing uniforms in [0, 1), default :func:`index_uniforms` of the stream positions).

        Never runs Algorithm 2: a fit is a ``"fit_requested"`` event whose result takes effect
        at sample ``request.due``. If the stream reaches that sample before
        :meth:`complete` was called, the update stops there: ``blocked``, with ``consumed``
        rows taken (feed the rest after :meth:`complete`). So the decisions, and the maps
        published, depend only on the samples and their order.

        Returns
        -------
        Update
            What happened, in order, and how many rows were consumed."""
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        n = y.shape[0]
        if x.shape != (n, self.k) or y.ndim != 1:
            raise InputError(f"OnlineCalibrator.update: expected probs (n, {self.k}) and "
                             f"labels (n,), got {x.shape} and {y.shape}")
        if n <= 32:  # a few labels: Python's min and max cost less than two reductions
            yl = y.tolist()
            lo, hi = (min(yl), max(yl)) if n else (0, 0)
        else:
            lo, hi = y.min(), y.max()
        if lo < 0 or hi >= self.k:
            bad = int(np.flatnonzero((y < 0) | (y >= self.k))[0])
            raise InputError(f"label {int(y[bad])} at row {bad} outside [0, {self.k})")
        u = (index_uniforms(self.n_seen, n) if uniforms is None
             else np.asarray(uniforms, dtype=np.float64))
        if u.shape != (n,):
            raise InputError(f"uniforms must have shape ({n},), got {u.shape}")
        out = Update()
        if self.waiting:
            if self.result is None:
                out.blocked = True
                return out
            self.waiting = False
            out.events.extend(self._decide())
        step = self.config.step
        if self.n_seen % step + n < step:  # short of the next decision point: one call
            self._ingest(u, x, y)
            out.consumed = n
            return out
        a = 0
        while a < n:
            b = min(n, a + step - self.n_seen % step)
            self._ingest(u[a:b], x[a:b], y[a:b])
            a = b
            if self.n_seen % step == 0:
                if self.blocked:
                    self.waiting = True
                    out.consumed, out.blocked = a, True
                    return out
                out.events.extend(self._decide())
        out.consumed = n
        return out

    @property
    def blocked(self) -> bool:
        """True when the stream is at the ``due`` sample of the outstanding fit request and its
        result is not back: feed nothing until :meth:`complete`."""
        return (self.pending is not None and self.result is None
                and self.n_seen >= self.pending.due)

    def complete(self, request: FitRequest, binmap: BinMap | None) -> list[Event]:
        """Hand back the result of ``request`` (its :func:`run_fit`; None: the fit failed, and
        the request is done without a candidate, so a fit that raises never stalls the stream).
        ``request`` must be the very object this calibrator handed out (or, after a restore,
        one of :attr:`outstanding`): a result of a request no longer outstanding (dropped by a
        drift, completed before, or of another calibrator) is ignored. If the stream was
        blocked waiting for it, the decision that waited runs now: returns its events."""
        if request is not self.pending or self.result is not None:
            return []
        if binmap is not None and not isinstance(binmap, BinMap):
            raise InputError(f"complete: expected a BinMap or None, got "
                             f"{type(binmap).__name__}")
        self.result = _FAILED if binmap is None else binmap
        if self.waiting:
            self.waiting = False
            return self._decide()
        return []

    @property
    def outstanding(self) -> list[FitRequest]:
        """Requests whose result has not been handed back (after a restore: run them again)."""
        return [self.pending] if self.pending is not None and self.result is None else []

    def _ingest(self, u: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        if self.shadow is not None:
            hold = self.window.testing(u)  # the test share
            if hold.any():
                bm, acc = self.shadow
                xs, ys = x[hold], y[hold]
                self.shadow = (bm, acc + PairedLoss.score(bm.apply(xs, check=False),
                                                          self._live_apply(xs), ys,
                                                          self.config.loss))
        n = y.shape[0]
        if not n:
            return
        window = self.window
        before = window.buckets[-1].index
        # rows are summed when the open bucket is full or something reads the window (its
        # readers flush first), all at once: the sums are exact integers, so the state is the
        # same, in fewer passes. During the warm-up a decision point reads the warm-up sums,
        # which the window does not own: rows ending at one are summed there.
        if not (((self.n_seen + n) % self.config.step or self.warm is None)
                and window.defer(u, x, y, self.warm)):
            window.add(u, x, y, warmup=self.warm)
        if window.buckets[-1].index != before:  # a bucket was sealed
            self._trim()
        self.n_seen += n

    def _live_apply(self, x: np.ndarray) -> np.ndarray:
        return x if self.live is None else self.live.apply(x, check=False)

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Bound the bytes of the window's sealed buckets (None: no bound); trims at once."""
        if max_bytes is not None and max_bytes <= 0:
            raise InputError(f"max_bytes must be > 0 or None, got {max_bytes!r}")
        self.config = dataclasses.replace(self.config, max_bytes=max_bytes)
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest sealed buckets beyond ``max_bytes`` (sealed buckets are compacted:
        their size depends on their content only, so trimming is replay-deterministic)."""
        limit = self.config.max_bytes
        if limit is None:
            return
        buckets = self.window.buckets
        sizes = [b.nbytes for b in buckets[:-1]]  # summed once: the dropped ones come off
        total, drop = sum(sizes), 0
        while drop < len(sizes) and total > limit:
            total -= sizes[drop]
            drop += 1
        del buckets[:drop]

    # ------------------------------------------------------------------ deciding
    def _decide(self) -> list[Event]:
        cfg = self.config
        n_reg = self.n_seen - self.regime_start
        events: list[Event] = []
        if self.pending is not None and self.n_seen >= self.pending.due:
            events.extend(self._apply_fit())
        if self.warm is not None:
            d = self.warm.determine(tol=cfg.warmup_tol, alpha=cfg.warmup_alpha,
                                    min_samples=cfg.warmup_min)
            if not d.determined and not (n_reg >= cfg.warmup_max and self.warm.n):
                return events
            self.warm_n, self.warm = self.warm.n, None
            self.pool_temperature = d.temperature
            self.window.set_temperature(d.temperature)
            self.next_fit_at = max(cfg.step, math.ceil(n_reg * cfg.growth / cfg.step) * cfg.step)
            self._fit_when_pools_ready(0)
            events.append(Event(self.n_seen, "warmup_end", temperature=d.temperature,
                                detail=d.reason or f"+-{d.half_width:.3f} in ln T"))
            events.extend(self._challenge_temperature(d.temperature, self.warm_n))
            return events
        if self.shadow is not None and self.shadow[1].n >= self.shadow_next_test:
            events.extend(self._test_shadow())
        if self.next_fit_at is not None and n_reg >= self.next_fit_at:
            events.extend(self._scheduled_fit())
        if not any(e.kind == "published" for e in events):
            events.extend(self._recertify())
        return events

    def _scheduled_fit(self) -> list[Event]:
        """A fit point of the growth schedule: the candidates of the window."""
        cfg = self.config
        n_reg = self.n_seen - self.regime_start
        self.next_fit_at = math.ceil(n_reg * cfg.growth / cfg.step) * cfg.step
        grid = self.window.grid()
        events: list[Event] = []
        if self.live is not None and self.live.n_bins:
            # a corrected live map: Algorithm 2's refit is the likelier challenger, and
            # one shadow is tested at a time: temperature scaling is tested only if the
            # refit does not give a corrected map (when it takes effect)
            req = self._request_fit()
            if req:
                events.extend(req)
            elif grid.n:
                events.extend(self._challenge_temperature(grid.fit(), grid.n))
        else:
            if grid.n:
                events.extend(self._challenge_temperature(grid.fit(), grid.n))
            events.extend(self._request_fit())
        return events

    def _alpha(self) -> float:
        self.tests += 1
        return self.config.alpha / (self.tests * (self.tests + 1))

    def _temperature_map(self, t: float) -> BinMap:
        cfg = self.config
        beta = beta_for(cfg.eps, cfg.p)
        return BinMap(
            model_id=self.model_id, version=self.version + 1, created_at=utc_now(),
            eps=float(cfg.eps), p=float(cfg.p), delta=float(cfg.delta), beta=beta,
            lam=lambda_for(beta), k=self.k, temperature=float(t), outside="identity",
            sizing={"mode": "online-temperature", "samples": self.n_seen,
                    "window": self.window.n},
            iterations=0, stop_reason="not_run", est_error={}, bins=(),
            group=np.zeros(0, np.int64), preds=np.zeros((0, self.k)), mode="certified")

    def _challenge_temperature(self, t: float, fit_n: int) -> list[Event]:
        """Test temperature scaling at ``t`` (fitted on ``fit_n`` samples) against the live map
        on the window's held-out loss grid (or prospectively, when the live map has bins). A
        refinement of the live temperature (same regime, ``growth`` times its samples) needs
        only a lower held-out mean loss (:func:`lpcal.challenger.challenge`)."""
        if self.live is not None and self.live.n_bins:
            return self._start_shadow(self._temperature_map(t))
        live_t = None if self.live is None else self.live.temperature
        held = self.window.held()
        if held.n < self.config.min_heldout:
            return [Event(self.n_seen, "kept", temperature=t,
                          detail=f"{held.n} held-out samples")]
        refine = (self.live is not None and self.live_regime == self.regime_start
                  and fit_n >= self.config.growth * self.live_fit_n)
        paired = held.paired(t, live_t, self.config.loss)
        if refine:
            dec = challenge(paired, min_samples=self.config.min_heldout, significance=False)
        else:
            dec = challenge(paired, alpha=self._alpha(), min_samples=self.config.min_heldout)
        if not dec.publish:
            return [Event(self.n_seen, "kept", temperature=t, decision=dec)]
        event = self._publish(self._temperature_map(t), dec)
        self.live_fit_n = fit_n
        return [event]

    def _publish(self, bm: BinMap, dec: Decision | None) -> Event:
        self.version += 1
        if bm.version != self.version:
            bm = dataclasses.replace(bm, version=self.version)
        sizing = dict(bm.sizing)
        if dec is not None:
            sizing.update(evidence(dec, self))
        self.cert_looks = 0
        if self.config.cert_share:
            if bm.certificate is not None:  # Algorithm 2's own, on the test share
                sizing["fit_certificate"] = bm.certificate.to_dict()
            bm = dataclasses.replace(bm, certificate=self._certify(bm, 1))
        bm = dataclasses.replace(bm, sizing=sizing)
        self.live = bm
        self.live_regime = self.regime_start
        self.live_fit_n = 0
        self.tests = 0
        self.shadow = None
        return Event(self.n_seen, "published", self.version, bm.temperature, dec, bm)

    def _certify(self, bm: BinMap, look: int) -> Certificate:
        """The ``look``-th certificate of ``bm`` on the window's certification samples (module
        docstring, *Certificates*); sets when the next look is due."""
        x, y = self.window.cert_samples()
        self.cert_looks = look
        self.cert_next = math.ceil((self.n_seen - self.regime_start) * self.config.cert_growth)
        return certify_map(bm, x, y, look=look)

    def _recertify(self) -> list[Event]:
        """The live map, published by this loop and not certified, certified again once the
        regime's samples grew by ``cert_growth``: published anew (the same map, the next
        version) only if it is certified now."""
        live = self.live
        if (not self.cert_looks or live is None or live.certificate is None
                or live.certificate.certified):
            return []
        if self.n_seen - self.regime_start < self.cert_next or (
                self.window.n_cert < min_certifiable_holdout(
                    live.eps, live.p, live.delta, self.k,
                    candidates=(self.cert_looks + 1) * (self.cert_looks + 2))):
            return []
        cert = self._certify(live, self.cert_looks + 1)
        if not cert.certified:
            return []
        self.version += 1
        self.live = dataclasses.replace(
            live, version=self.version, created_at=utc_now(), certificate=cert,
            sizing={**live.sizing, "recertified": {"look": self.cert_looks,
                                                   "samples": self.n_seen}})
        return [Event(self.n_seen, "published", self.version, self.live.temperature, None,
                      self.live, "recertified")]

    def _request_fit(self) -> list[Event]:
        """Ask for Algorithm 2 on a snapshot of the window's pools (none while one request is
        outstanding: that depends only on the sample count, so it is replay-deterministic);
        its result takes effect at ``n + fit_delay`` (:meth:`_apply_fit`)."""
        if self.pending is not None:
            return []
        snap = self.window.snapshot()
        if snap is None or snap.fit_samples < self.config.pools_from:
            self._fit_when_pools_ready(0 if snap is None else snap.fit_samples)
            return []
        self.requests_issued += 1
        req = FitRequest(self.requests_issued, self.n_seen, self.n_seen + self.config.fit_delay,
                         self.n_seen, self.version + 1, self.model_id, snap, self.config,
                         self.window.held_mark())
        self.pending, self.result = req, None
        if self.fit is not None:
            self.result = self.fit(req)
        return [Event(self.n_seen, "fit_requested", req.version, request=req)]

    def _fit_when_pools_ready(self, fit_samples: int) -> None:
        """The pools hold ``fit_samples < pools_from``: bring the next fit point forward to the
        first decision point at which they will hold ``pools_from`` (the fit share's expected
        samples, rounded up to a decision point; if routing leaves them short, the point after
        that is set the same way), instead of holding Algorithm 2 back to the next point of the
        geometric schedule, up to a factor ``growth`` later. The schedule continues from that
        point (no extra fit point, unless routing left the pools short). Only while no bucket
        of the regime was dropped (otherwise the pools do not grow at that rate)."""
        cfg = self.config
        n_reg = self.n_seen - self.regime_start
        if self.warm is not None or self.window.n < n_reg:
            return
        share = float(self.window.layout.cumulative_weights()[len(self.window.layout.names) - 1])
        need = math.ceil((cfg.pools_from - fit_samples) / share)
        at = n_reg + max(1, math.ceil(need / cfg.step)) * cfg.step
        if self.next_fit_at is None or at < self.next_fit_at:
            self.next_fit_at = at

    def _apply_fit(self) -> list[Event]:
        """The outstanding request's result takes effect (at ``due``): a corrected map becomes
        the shadow challenger; otherwise (the pre-calibrator won its certificate) temperature
        scaling of the window is the candidate when the live map is a corrected one."""
        req, bm = self.pending, self.result
        self.pending, self.result = None, None
        if bm is _FAILED:
            return [Event(self.n_seen, "fit_done", req.version, detail="failed")]
        done = Event(self.n_seen, "fit_done", req.version, bm.temperature,
                     detail="corrected" if bm.n_bins else "pre-calibrator")
        if bm.n_bins:
            bm = dataclasses.replace(bm, version=req.version)
            return [done, *self._start_shadow(bm, self._paired_since(req, bm))]
        if self.live is not None and self.live.n_bins and self.warm is None:
            grid = self.window.grid()
            if grid.n:
                return [done, *self._challenge_temperature(grid.fit(), grid.n)]
        return [done]

    def _paired_since(self, req: FitRequest, bm: BinMap) -> PairedLoss:
        """The paired losses of ``bm`` (the result of ``req``) against the live map on the
        test-share samples that arrived after ``req``'s snapshot, i.e. while the fit ran
        (module docstring, 4.): independent of ``bm`` (a function of the samples before the
        request) and of the live map, if that is still the one live at the request (else,
        and for a request without ``held_from``, none: the test is prospective from now)."""
        acc = PairedLoss(self.config.loss)
        if req.held_from is None or self.version + 1 != req.version:
            return acc
        x, y = self.window.held_since(req.held_from)
        if not y.size:
            return acc
        return PairedLoss.score(bm.apply(x, check=False), self._live_apply(x), y,
                                self.config.loss)

    def _start_shadow(self, bm: BinMap, paired: PairedLoss | None = None) -> list[Event]:
        self.shadow = (bm, PairedLoss(self.config.loss) if paired is None else paired)
        self.shadow_next_test = self.config.min_heldout
        return [Event(self.n_seen, "shadow", bm.version, bm.temperature,
                      detail=f"{self.shadow[1].n} paired since the request")]

    def _test_shadow(self) -> list[Event]:
        bm, acc = self.shadow
        dec = challenge(acc, alpha=self._alpha(), min_samples=self.config.min_heldout)
        if dec.publish:
            return [self._publish(bm, dec)]
        self.shadow_next_test = math.ceil(self.config.growth * acc.n)
        return [Event(self.n_seen, "kept", bm.version, bm.temperature, dec)]

    def install(self, binmap: BinMap | None, version: int) -> None:
        """Make ``binmap`` the live map (the champion), with ``version``, from outside the loop
        (a map restored or published by another path): the tests against the live map start
        over and a shadow challenger is dropped; the next publication is ``version + 1``."""
        self.live = binmap
        self.version = int(version)
        self.live_regime, self.live_fit_n = -1, 0
        self.cert_looks, self.cert_next = 0, 0
        self.tests = 0
        self.shadow = None

    def request_fit(self) -> list[Event]:
        """A manual request: the next decision point (the next multiple of ``step``) fits and
        tests candidates as a scheduled refit does, so champion/challenger still decides what
        is published. Nothing while the warm-up runs (no pool temperature yet)."""
        if self.warm is not None:
            return []
        step = self.config.step
        at = ((self.n_seen - self.regime_start) // step + 1) * step
        self.next_fit_at = at if self.next_fit_at is None else min(self.next_fit_at, at)
        return [Event(self.n_seen, "fit_scheduled", detail=f"at {self.regime_start + at}")]

    # ------------------------------------------------------------------ drift
    def notify_drift(self) -> Event:
        """A drift was detected at this point of the stream: keep only later buckets, re-open
        the warm-up, restart the test count (the live map stays until beaten)."""
        self.window.reset_after(self.window.open.index)
        self.window.set_temperature(None)
        self.warm = WarmupSums()
        self.pool_temperature = None
        self.regime_start = self.n_seen
        self.next_fit_at = None
        self.shadow = None
        self.tests = 0
        self.cert_next = 0  # the regime, and its certification samples, start over
        # a fit of pre-drift pools is moot: dropped (a late complete() is ignored)
        self.pending, self.result, self.waiting = None, None, False
        return Event(self.n_seen, "drift")

    # ------------------------------------------------------------------ state
    @property
    def warming(self) -> bool:
        """True while the warm-up has not determined the temperature."""
        return self.warm is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the window and the warm-up sums."""
        return self.window.nbytes + (self.warm.nbytes if self.warm is not None else 0)

    def to_dict(self, *, packed: bool = False, memo: Memo | None = None) -> dict[str, Any]:
        """The whole state, JSON-safe (a checkpoint); :meth:`from_dict` restores it exactly.

        ``packed``: pools as packed arrays (:meth:`lpcal.pools.PoolSet.to_dict`). ``memo``
        (:meth:`lpcal.window.SlidingWindow.to_dict`): the window's sealed buckets, the live
        and shadow maps' JSON and a pending request's snapshot are encoded once each."""
        if memo is None:
            def memo(owner, refs, make):  # no cache: encode every time
                return make()
        self.window.flush()  # rows deferred to the open bucket's end enter the sums now
        window = (self.window.to_dict(packed=packed, memo=memo) if packed
                  else self.window.to_dict())
        cfg = memo(self.config, (), lambda: _config_dict(self.config))
        return {
            "format": "lpcal.online/2", "k": self.k, "model_id": self.model_id, "config": cfg,
            "n_seen": self.n_seen, "regime_start": self.regime_start,
            "warm": None if self.warm is None else self.warm.to_dict(),
            "pool_temperature": self.pool_temperature, "window": window,
            "live": None if self.live is None else memo(self.live, (),
                                                        lambda: self.live.to_json().decode()),
            "version": self.version, "tests": self.tests, "next_fit_at": self.next_fit_at,
            "live_fit_n": self.live_fit_n, "live_regime": self.live_regime,
            "warm_n": self.warm_n, "requests_issued": self.requests_issued,
            "waiting": self.waiting, "cert_looks": self.cert_looks,
            "cert_next": self.cert_next,
            "pending": None if self.pending is None else {
                **self.pending.to_dict(packed=packed),
                "result": (None if self.result is None else "failed" if self.result is _FAILED
                           else self.result.to_json().decode())},
            "shadow": None if self.shadow is None else {
                "binmap": memo(self.shadow[0], (), lambda: self.shadow[0].to_json().decode()),
                "paired": self.shadow[1].to_dict(), "next_test": self.shadow_next_test},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *,
                  fit: Callable[[FitRequest], BinMap] | None = None) -> OnlineCalibrator:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`. A fit request
        outstanding at the checkpoint is outstanding again (:attr:`outstanding`; run at once
        with ``fit``): fits are deterministic given their pools and seed."""
        try:
            if d["format"] not in ("lpcal.online/1", "lpcal.online/2"):
                raise ValueError(f"unknown format {d['format']!r}")
            out = cls(int(d["k"]), OnlineConfig(**d["config"]), model_id=str(d["model_id"]),
                      fit=fit)
            out.n_seen, out.regime_start = int(d["n_seen"]), int(d["regime_start"])
            out.warm = None if d["warm"] is None else WarmupSums.from_dict(d["warm"])
            t = d["pool_temperature"]
            out.pool_temperature = None if t is None else float(t)
            out.window = SlidingWindow.from_dict(d["window"])
            if "cert_share" not in d["window"]:  # written before the certification share
                out.window.cert_share = out.config.cert_share
                out.window.cert_buckets = out.config.cert_buckets
            out.live = None if d["live"] is None else BinMap.from_json(d["live"])
            out.version, out.tests = int(d["version"]), int(d["tests"])
            out.live_fit_n, out.live_regime = int(d["live_fit_n"]), int(d["live_regime"])
            out.warm_n = int(d["warm_n"])
            out.next_fit_at = None if d["next_fit_at"] is None else int(d["next_fit_at"])
            out.requests_issued = int(d.get("requests_issued", 0))
            out.waiting = bool(d.get("waiting", False))
            out.cert_looks = int(d.get("cert_looks", 0))
            out.cert_next = int(d.get("cert_next", 0))
            pend = d.get("pending")
            if pend is not None:
                out.pending = FitRequest.from_dict(pend, model_id=out.model_id,
                                                   config=out.config)
                if pend["result"] == "failed":
                    out.result = _FAILED
                elif pend["result"] is not None:
                    out.result = BinMap.from_json(pend["result"])
                elif fit is not None:
                    out.result = fit(out.pending)
            if d["shadow"] is not None:
                out.shadow = (BinMap.from_json(d["shadow"]["binmap"]),
                              PairedLoss.from_dict(d["shadow"]["paired"]))
                out.shadow_next_test = int(d["shadow"]["next_test"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"malformed online calibrator state ({e})") from None
        if out.window.layout != out.config.layout(out.k):
            raise InputError("online calibrator state: the window's layout does not match "
                             "the config")
        return out
