"""Staging of small per-model slices (:class:`StagedEvents`). Pure: the clock is passed in.

A model's share of a fetched batch goes through its state in one
:meth:`daemon.model_state.ModelState.offer` (join, pools, monitor), which costs a few dozen
array operations whatever the share's size. When one replica holds many models, a batch is
spread thin (5,000 records over 1,000 models: 5 events per model), and that fixed cost per call
makes the cost per message grow with the number of models. So a slice smaller than
``min_events`` is held here, and the model is offered its staged events, concatenated in
arrival order, in one call:

* when they reach ``min_events`` (a slice at least that large is offered at once, after any
  staged events of its model: a one-model stream never waits here);
* when the oldest of them was staged ``max_age`` seconds ago (:meth:`StagedEvents.due`);
* when the staged bytes of all models exceed ``max_bytes`` (the oldest models first,
  :meth:`StagedEvents.oldest`);
* before anything reads a model's state for correctness: a checkpoint, the release of its
  partition (revocation, stop), a slice with a different ``k`` (outcomes that came before the
  model's ``k`` was known).

The events of a model keep their order, so its join, pools, window and online calibrator see
the same sequence of events as without staging, in fewer calls: the join is event by event
(:mod:`daemon.join`), the pools' and the window's sums are exact integers or sums whatever the
batching, and the online calibrator decides at exact sample counts. What staging changes is
when: a sample enters the state at most ``max_age`` seconds (and at most one checkpoint) later.

**Pacing** (:class:`StagePacing`): an offer of a few staged events costs about the same as one
of a single event (hundreds of microseconds with the online calibrator, whatever the size), so
the staged offers made by age cost ``models staged x cost per offer`` every ``max_age``: with
10,000 models at 0.8 ms each, 1.6 s of CPU per second at a 5 s age, whatever the event rate.
The age is therefore not fixed: the caller asks :meth:`StagePacing.age` for it, which raises it
from ``max_age`` to ``models staged x fixed cost of a staged offer / max_share`` (the same rule as
:mod:`daemon.checkpoint.pacing`), at most ``max_wait``, so that the offers of small staged
slices take about ``max_share`` of the time. Every other rule above is kept (count, bytes,
checkpoints, releases, ``k``), and an idle poll offers everything.

Memory: a staged event keeps its columns (``k`` float64 probabilities, time, label, kind; copied
out of the parsed batch, so nothing else stays alive) and its id; the batch offered has fresh
positions ``0..n-1`` as its ``index`` (the input positions mean nothing across batches);
:meth:`StagedEvents.add` counts them (:func:`batch_nbytes`), and the caller flushes the oldest
models while the total is above ``max_bytes``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from daemon.event_records import ModelBatch

__all__ = [
    "DEFAULT_MAX_SHARE",
    "DEFAULT_MAX_WAIT",
    "ID_OVERHEAD_BYTES",
    "StagePacing",
    "Staged",
    "StagedEvents",
    "batch_nbytes",
]

#: bytes of a ``str`` object besides its characters (ASCII, CPython 3.11) plus its list slot
ID_OVERHEAD_BYTES = 49 + 8


def batch_nbytes(mb: ModelBatch) -> int:
    """Bytes :meth:`StagedEvents.add` counts for ``mb``: its columns (but ``index``, not kept)
    and its ids (an upper bound for ASCII ids)."""
    ids = mb.ids
    return (mb.kind.nbytes + mb.ts.nbytes + mb.probs.nbytes + mb.labels.nbytes
            + sum(map(len, ids)) + ID_OVERHEAD_BYTES * len(ids))


class Staged(NamedTuple):
    """A model's staged events, taken out of :class:`StagedEvents` to be offered."""

    #: the events in arrival order; its ``ts_limit`` is the first slice's:
    #: :meth:`~daemon.model_state.ModelState.offer` pulls clocks back to it before the events
    #: (as the first slice alone would); the caller raises the state's ``ts_limit`` to
    #: :attr:`ts_limit` after the offer
    batch: ModelBatch
    ts_limit: float     #: the largest ``ts_limit`` of its slices
    slices: int         #: how many slices were staged


class _Entry:
    __slots__ = ("first_limit", "k", "n", "nbytes", "since", "slices", "ts_limit")

    def __init__(self, k: int, since: float):
        self.k, self.since = k, since
        # per slice: (kind, ids, ts, probs, labels), compact copies
        self.slices: list[tuple] = []
        self.n = self.nbytes = 0
        self.ts_limit = -math.inf       # the largest ts_limit of the slices
        self.first_limit: float | None = None  # the first slice's


class StagedEvents:
    """Per model, the small slices not offered yet, in arrival order (see the module
    docstring).

    Parameters
    ----------
    min_events : int
        A model's staged events are due once they reach this count.
    max_age : float
        ... or once the oldest of them was staged this many seconds ago.
    max_bytes : int
        The bytes of all staged events above which the caller flushes the oldest models.
    """

    __slots__ = ("_models", "events", "max_age", "max_bytes", "min_events", "nbytes")

    def __init__(self, min_events: int, max_age: float, max_bytes: int):
        if min_events < 1 or not max_age >= 0 or max_bytes < 0:
            raise ValueError(f"StagedEvents: min_events {min_events} must be >= 1, max_age "
                             f"{max_age} and max_bytes {max_bytes} >= 0")
        self.min_events, self.max_age, self.max_bytes = int(min_events), float(max_age), \
            int(max_bytes)
        # model -> entry; insertion order is the order of their oldest staged slice (an entry
        # is removed when taken), so the models due come first
        self._models: dict[str, _Entry] = {}
        self.nbytes = 0  #: bytes of all staged events (:func:`batch_nbytes`)
        self.events = 0  #: staged events of all models

    def __len__(self) -> int:
        """The models with staged events."""
        return len(self._models)

    def __contains__(self, model: object) -> bool:
        return model in self._models

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def staged_k(self, model: str) -> int | None:
        """The ``k`` of ``model``'s staged slices (None: nothing staged)."""
        e = self._models.get(model)
        return None if e is None else e.k

    def count(self, model: str) -> int:
        """Events staged for ``model``."""
        e = self._models.get(model)
        return 0 if e is None else e.n

    def model_nbytes(self, model: str) -> int:
        """Bytes staged for ``model``."""
        e = self._models.get(model)
        return 0 if e is None else e.nbytes

    def add(self, mb: ModelBatch, now: float) -> bool:
        """Stage ``mb`` (its model's ``k`` must be the staged slices' :meth:`staged_k`, or none
        staged) at time ``now``; True once its model's staged events reach ``min_events``."""
        e = self._models.get(mb.model)
        if e is None:
            e = self._models[mb.model] = _Entry(mb.k, now)
        elif e.k != mb.k:
            raise ValueError(f"StagedEvents: model {mb.model!r} has slices of k={e.k} staged, "
                             f"got k={mb.k}; take them first")
        # compact copies: the parser's slices are views of the whole batch's columns, which a
        # staged view would keep alive beyond what is counted here
        # (the input positions, ``index``, mean nothing once slices of several batches are
        # joined: not kept)
        ids = mb.ids
        n = len(ids)
        cols = (mb.kind.copy(), ids, mb.ts.copy(), mb.probs.copy(), mb.labels.copy())
        size = (cols[0].nbytes + cols[2].nbytes + cols[3].nbytes + cols[4].nbytes
                + sum(map(len, ids)) + ID_OVERHEAD_BYTES * n)
        e.slices.append(cols)
        e.n += n
        e.nbytes += size
        e.ts_limit = max(e.ts_limit, mb.ts_limit)
        if e.first_limit is None:
            e.first_limit = mb.ts_limit
        self.nbytes += size
        self.events += n
        return e.n >= self.min_events

    def take(self, model: str) -> Staged | None:
        """Remove and return ``model``'s staged events (None when nothing is staged)."""
        e = self._models.pop(model, None)
        if e is None:
            return None
        self.nbytes -= e.nbytes
        self.events -= e.n
        sl = e.slices
        if len(sl) == 1:
            kind, ids, ts, probs, labels = sl[0]
        else:
            kind, ts, probs, labels = (np.concatenate([c[i] for c in sl]) for i in (0, 2, 3, 4))
            ids = list(itertools.chain.from_iterable(c[1] for c in sl))
        return Staged(ModelBatch(model, e.k, kind, ids, ts, probs, labels,
                                 np.arange(len(ids), dtype=np.int64), e.first_limit),
                      e.ts_limit, len(sl))

    def due(self, now: float, age: float | None = None) -> list[str]:
        """The models whose oldest staged slice is ``age`` (default ``max_age``) seconds old or
        older at ``now``: O(models due)."""
        out = []
        limit = now - (self.max_age if age is None else age)
        for model, e in self._models.items():
            if e.since > limit:
                break
            out.append(model)
        return out

    def next_due(self, age: float | None = None) -> float | None:
        """When the first model is due at ``age`` (default ``max_age``; None: nothing
        staged)."""
        for e in self._models.values():
            return e.since + (self.max_age if age is None else age)
        return None

    def oldest(self) -> Iterator[str]:
        """The models with staged events, oldest slice first (a snapshot)."""
        return iter(list(self._models))

    @property
    def over_budget(self) -> bool:
        """True while the staged bytes exceed ``max_bytes``."""
        return self.nbytes > self.max_bytes


#: The default of ``join.staging_max_cpu_share``: the offers of small staged slices cost the
#: ingest at most about a tenth of its time, as checkpoints do
#: (:data:`daemon.checkpoint.pacing.DEFAULT_MAX_SHARE`). At the 5 s base age and ~1 ms per offer
#: (the online calibrator at k = 10) the age stays 5 s up to ~500 staged models: a 1-model and a
#: 100-model replica are not paced at all.
DEFAULT_MAX_SHARE = 0.1
#: The default of ``join.staging_max_wait_seconds``: the longest a staged event waits for the
#: pacing (a checkpoint, every ``state.checkpoint_interval_seconds`` or longer, offers it
#: sooner). A minute keeps the monitor's and the change test's view of a model within a minute of
#: its input, far below their windows and drift timers (hours of event time); at 10,000 models
#: and ~1 ms per offer it holds the staged offers to about 0.17 of the time instead of 2.
DEFAULT_MAX_WAIT = 60.0


class StagePacing:
    """How long a model's small staged slices wait, at most, before they are offered: the
    staging age, raised with the number of staged models and the measured fixed cost of a
    staged offer so that those offers take about ``max_share`` of the time (module docstring). Pure:
    the caller measures the offers and passes their cost.

    Parameters
    ----------
    base_age : float
        The age when offers are cheap or few (:data:`daemon.ingest.STAGE_MAX_AGE`); never
        less.
    max_share : float, default :data:`DEFAULT_MAX_SHARE`
        In (0, 1]: the share of the time the offers of small staged slices may take.
    max_wait : float, default :data:`DEFAULT_MAX_WAIT`
        The longest age (``base_age`` or less: no pacing, the age is ``base_age``).
    weight : float, default 1/64
        Weight of one offer in the mean cost (an exponentially weighted mean: the cost follows
        the load within a few hundred offers, and one slow offer, a garbage collection, moves
        it by a 64th).

    Attributes
    ----------
    mean_cost : float
        Seconds a staged offer took, on average (0 before any).
    fixed_cost : float
        The part of ``mean_cost`` that does not grow with the events of an offer (what a longer
        age saves), from the records that gave their event counts: the intercept ``a`` of the
        weighted least-squares line ``cost = a + b x events`` through the same weighted means,
        as a share of the mean cost, clamped to ``[0, 1]``; the whole mean cost while the event
        counts do not vary (nothing to tell the parts apart) or none was given. Without it the
        age would pay for the per-event work too, which no age saves, and climb further as
        longer ages make the offers larger.
    """

    __slots__ = ("_c", "_n", "_nc", "_nn", "_s", "base_age", "max_share", "max_wait",
                 "mean_cost", "weight")

    def __init__(self, base_age: float, max_share: float = DEFAULT_MAX_SHARE,
                 max_wait: float = DEFAULT_MAX_WAIT, *, weight: float = 1 / 64):
        if not (math.isfinite(base_age) and base_age >= 0):
            raise ValueError(f"StagePacing: base age {base_age!r} is not a number >= 0")
        if not (math.isfinite(max_share) and 0 < max_share <= 1):
            raise ValueError(f"StagePacing: max share {max_share!r} is not in (0, 1]")
        if not (math.isfinite(max_wait) and max_wait >= 0):
            raise ValueError(f"StagePacing: max wait {max_wait!r} is not a number >= 0")
        if not 0 < weight <= 1:
            raise ValueError(f"StagePacing: weight {weight!r} is not in (0, 1]")
        self.base_age, self.max_share = float(base_age), float(max_share)
        self.max_wait = max(float(max_wait), self.base_age)
        self.weight = float(weight)
        self.mean_cost = 0.0
        # weighted sums of the records with event counts: total weight, events, cost,
        # events^2, events x cost (per offer; exponentially weighted like mean_cost)
        self._s = self._n = self._c = self._nn = self._nc = 0.0

    @property
    def enabled(self) -> bool:
        """False when ``max_wait`` does not exceed ``base_age`` (the age is always that)."""
        return self.max_wait > self.base_age

    def record(self, seconds: float, offers: int = 1, events: int | None = None) -> None:
        """Count ``offers`` staged offers that took ``seconds`` in all and held ``events``
        events in all (None: not known; each offer moves the means by ``weight``; a negative or
        non-finite time, a clock that jumped, is ignored)."""
        if offers <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        w = 1.0 - (1.0 - self.weight) ** offers
        c = seconds / offers
        self.mean_cost += w * (c - self.mean_cost)
        if events is not None and events >= 0:
            n = events / offers
            self._s += w * (1.0 - self._s)
            self._n += w * (n - self._n)
            self._c += w * (c - self._c)
            self._nn += w * (n * n - self._nn)
            self._nc += w * (n * c - self._nc)

    @property
    def fixed_share(self) -> float:
        """The share of the mean cost that does not grow with the events of an offer (see
        :attr:`fixed_cost`)."""
        s = self._s
        if s <= 0.0:
            return 1.0
        en, ec = self._n / s, self._c / s
        var = self._nn / s - en * en
        if ec <= 0.0 or var <= 1e-9 * max(self._nn / s, 1.0):
            return 1.0
        slope = (self._nc / s - en * ec) / var
        return min(max((ec - slope * en) / ec, 0.0), 1.0)

    @property
    def fixed_cost(self) -> float:
        return self.mean_cost * self.fixed_share

    def age(self, models: int) -> float:
        """The staging age with ``models`` models staged:
        ``clamp(models x fixed_cost / max_share, base_age, max_wait)``."""
        want = models * self.fixed_cost / self.max_share
        return min(max(want, self.base_age), self.max_wait)
