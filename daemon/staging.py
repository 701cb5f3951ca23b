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

__all__ = ["ID_OVERHEAD_BYTES", "Staged", "StagedEvents", "batch_nbytes"]

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

    def due(self, now: float) -> list[str]:
        """The models whose oldest staged slice is ``max_age`` seconds old or older at
        ``now``: O(models due)."""
        out = []
        limit = now - self.max_age
        for model, e in self._models.items():
            if e.since > limit:
                break
            out.append(model)
        return out

    def next_due(self) -> float | None:
        """When the first model is due (None: nothing staged)."""
        for e in self._models.values():
            return e.since + self.max_age
        return None

    def oldest(self) -> Iterator[str]:
        """The models with staged events, oldest slice first (a snapshot)."""
        return iter(list(self._models))

    @property
    def over_budget(self) -> bool:
        """True while the staged bytes exceed ``max_bytes``."""
        return self.nbytes > self.max_bytes
