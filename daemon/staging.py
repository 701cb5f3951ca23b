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

**Columns**: when one replica holds thousands of models, a batch of 5,000 records holds a slice
of one or two events for most of its models, and any work per (model, slice) costs as much as
the events themselves. So the small slices of a batch are staged together, as one chunk of
rows (each row's model code, kind, time, probabilities, label, id), with the per-model counts,
bytes, ages and ``ts_limit`` kept in arrays indexed by model code and updated for the whole
chunk at once (:meth:`StagedEvents.add_grouped`); the models due are taken together
(:meth:`StagedEvents.take_many`): their rows are gathered from the chunks and grouped per model
by one stable sort, which keeps each model's arrival order, and each model gets one
:class:`~daemon.event_records.ModelBatch`. The cost is per row and per offer, not per
(model, slice). Chunks are merged as they come (a new chunk with the ones before it while they
hold no more staged rows than it: about log2(rows / batch size) chunks) and compacted once less
than half of their rows are still staged.

Memory: a staged event keeps its columns (``k`` float64 probabilities, time, label, kind, its
model code and live flag; copied out of the parsed batch, or the parsed batch's own columns
when the whole of it is staged, so nothing else stays alive) and its id; the batch offered has
fresh positions ``0..n-1`` as its ``index`` (the input positions mean nothing across batches).
:attr:`StagedEvents.nbytes` counts every row kept (:func:`batch_nbytes`), those already taken
but not yet compacted away included, and the caller flushes the oldest models while the total
is above ``max_bytes``, then compacts (:meth:`StagedEvents.compact`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import NamedTuple

import numpy as np

from daemon.event_records import GroupedBatch, ModelBatch

__all__ = [
    "DEFAULT_MAX_SHARE",
    "DEFAULT_MAX_WAIT",
    "ID_OVERHEAD_BYTES",
    "ROW_OVERHEAD_BYTES",
    "StagePacing",
    "Staged",
    "StagedEvents",
    "batch_nbytes",
]

#: bytes of a ``str`` object besides its characters (ASCII, CPython 3.11) plus its array slot
ID_OVERHEAD_BYTES = 49 + 8
#: bytes a staged event takes besides its columns and its id: its model's code (int32) and
#: its live flag (bool)
ROW_OVERHEAD_BYTES = 4 + 1
_LEN = len


def batch_nbytes(mb: ModelBatch) -> int:
    """Bytes :meth:`StagedEvents.add` counts for ``mb``: its columns (but ``index``, not kept),
    its ids (an upper bound for ASCII ids) and :data:`ROW_OVERHEAD_BYTES` per event."""
    ids = mb.ids
    return (mb.kind.nbytes + mb.ts.nbytes + mb.probs.nbytes + mb.labels.nbytes
            + sum(map(len, ids)) + (ID_OVERHEAD_BYTES + ROW_OVERHEAD_BYTES) * len(ids))


class Staged(NamedTuple):
    """A model's staged events, taken out of :class:`StagedEvents` to be offered."""

    #: the events in arrival order; its ``ts_limit`` is the first slice's:
    #: :meth:`~daemon.model_state.ModelState.offer` pulls clocks back to it before the events
    #: (as the first slice alone would); the caller raises the state's ``ts_limit`` to
    #: :attr:`ts_limit` after the offer
    batch: ModelBatch
    ts_limit: float     #: the largest ``ts_limit`` of its slices
    slices: int         #: how many slices were staged


class _Chunk:
    """Staged rows of one ``k``, in arrival order within each model: the model code of each
    row, its columns, and whether it is still staged (``live``; taken rows stay until the
    chunk is compacted or empty)."""

    __slots__ = ("codes", "ids", "k", "kind", "labels", "live", "nbytes", "nlive", "probs",
                 "ts")

    def __init__(self, k: int, codes: np.ndarray, kind: np.ndarray, ids: np.ndarray,
                 ts: np.ndarray, probs: np.ndarray, labels: np.ndarray,
                 id_chars: int | None = None):
        self.k, self.codes, self.kind, self.ids = k, codes, kind, ids
        self.ts, self.probs, self.labels = ts, probs, labels
        n = codes.shape[0]
        self.live = np.ones(n, dtype=bool)
        self.nlive = n
        if id_chars is None:
            id_chars = sum(map(_LEN, ids))
        self.nbytes = n * _row_fixed(self) + id_chars

    def __len__(self) -> int:
        return self.codes.shape[0]

    def rows(self, idx: np.ndarray) -> _Chunk:
        """A new chunk of the rows ``idx`` (copies)."""
        return _Chunk(self.k, self.codes[idx], self.kind[idx], self.ids[idx], self.ts[idx],
                      self.probs[idx], self.labels[idx])


def _row_fixed(c) -> int:
    """Bytes of one row of ``c`` (a chunk) besides its id's characters."""
    return (c.kind.itemsize + c.ts.itemsize + c.probs.itemsize * c.probs.shape[1]
            + c.labels.itemsize + ID_OVERHEAD_BYTES + ROW_OVERHEAD_BYTES)


def _id_array(ids: Iterable[str], n: int) -> np.ndarray:
    a = np.empty(n, dtype=object)
    a[:] = ids if isinstance(ids, list) else list(ids)
    return a


class StagedEvents:
    """Per model, the small slices not offered yet, in arrival order (see the module
    docstring), kept in columns: a batch's small slices of all its models are staged in one
    :meth:`add_grouped` (one chunk of rows with each row's model code), and the models taken
    together (:meth:`take_many`) have their rows gathered from the chunks and grouped by one
    stable sort. The bookkeeping per model (events, bytes, when staged, ``ts_limit``) is in
    arrays indexed by a model code, updated for all the models of a chunk at once: staging
    costs per row and per offer, not per (model, slice).

    Parameters
    ----------
    min_events : int
        A model's staged events are due once they reach this count.
    max_age : float
        ... or once the oldest of them was staged this many seconds ago.
    max_bytes : int
        The bytes of all staged events above which the caller flushes the oldest models.
    """

    __slots__ = ("_bytes", "_chunks", "_code", "_first", "_k", "_lim", "_models", "_n",
                 "_names", "_since", "_slices", "events", "max_age", "max_bytes", "min_events",
                 "nbytes")

    def __init__(self, min_events: int, max_age: float, max_bytes: int):
        if min_events < 1 or not max_age >= 0 or max_bytes < 0:
            raise ValueError(f"StagedEvents: min_events {min_events} must be >= 1, max_age "
                             f"{max_age} and max_bytes {max_bytes} >= 0")
        self.min_events, self.max_age, self.max_bytes = int(min_events), float(max_age), \
            int(max_bytes)
        # staged model -> its code; insertion order is the order of their oldest staged slice
        # (an entry is removed when taken), so the models due come first
        self._models: dict[str, int] = {}
        self._code: dict[str, int] = {}   # every model ever staged -> its code
        self._names: list[str] = []       # code -> model
        cap = 64
        self._n = np.zeros(cap, dtype=np.int64)        # events staged (0: none)
        self._bytes = np.zeros(cap, dtype=np.int64)    # their bytes
        self._slices = np.zeros(cap, dtype=np.int64)   # slices staged
        self._k = np.zeros(cap, dtype=np.int64)        # their k
        self._since = np.zeros(cap, dtype=np.float64)  # when the oldest was staged
        self._first = np.zeros(cap, dtype=np.float64)  # the first slice's ts_limit
        self._lim = np.zeros(cap, dtype=np.float64)    # the largest ts_limit
        self._chunks: list[_Chunk] = []
        #: bytes of the staged rows kept (:func:`batch_nbytes` per row), those taken but not
        #: released yet included (a chunk is compacted once less than half of it is staged)
        self.nbytes = 0
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
        c = self._models.get(model)
        return None if c is None else int(self._k[c])

    def count(self, model: str) -> int:
        """Events staged for ``model``."""
        c = self._models.get(model)
        return 0 if c is None else int(self._n[c])

    def model_nbytes(self, model: str) -> int:
        """Bytes staged for ``model`` (its rows: :func:`batch_nbytes`)."""
        c = self._models.get(model)
        return 0 if c is None else int(self._bytes[c])

    @property
    def live_nbytes(self) -> int:
        """Bytes of the events staged now (:attr:`nbytes` without the rows taken)."""
        return int(self._bytes[list(self._models.values())].sum()) if self._models else 0

    # ------------------------------------------------------------------ codes
    @property
    def known(self) -> int:
        """How many model codes were given out (codes are ``0..known-1``)."""
        return len(self._names)

    def codes(self, models: Sequence[str]) -> np.ndarray:
        """The codes of ``models`` (int64), new models numbered on the way."""
        code = self._code
        cs = list(map(code.get, models))
        if None in cs:
            names = self._names
            for i, c in enumerate(cs):
                if c is None:
                    m = models[i]
                    c = code.get(m)
                    if c is None:
                        c = code[m] = len(names)
                        names.append(m)
                    cs[i] = c
            cap = self._n.shape[0]
            if len(names) > cap:
                grow = max(2 * cap, len(names))
                for name in ("_n", "_bytes", "_slices", "_k", "_since", "_first", "_lim"):
                    old = getattr(self, name)
                    new = np.zeros(grow, dtype=old.dtype)
                    new[:cap] = old
                    setattr(self, name, new)
        return np.asarray(cs, dtype=np.int64)

    def staged_mask(self, codes: np.ndarray) -> np.ndarray:
        """For each code, True when its model has staged events."""
        return self._n[codes] > 0

    def k_of(self, codes: np.ndarray) -> np.ndarray:
        """The ``k`` of the staged slices of each code (meaningless where none is staged)."""
        return self._k[codes]

    # ------------------------------------------------------------------ adding
    def add(self, mb: ModelBatch, now: float) -> bool:
        """Stage ``mb`` (its model's ``k`` must be the staged slices' :meth:`staged_k`, or none
        staged) at time ``now``; True once its model's staged events reach ``min_events``."""
        return bool(self.add_many([mb], now))

    def add_many(self, mbs: Sequence[ModelBatch], now: float) -> list[str]:
        """Stage slices of distinct models (:meth:`add` for each), one chunk per ``k``; the
        models whose staged events reached ``min_events``."""
        mbs = [mb for mb in mbs if len(mb)]
        if not mbs:
            return []
        out: list[str] = []
        ks = {mb.k for mb in mbs}
        for k in sorted(ks):
            group = mbs if len(ks) == 1 else [mb for mb in mbs if mb.k == k]
            models = [mb.model for mb in group]
            codes = self.codes(models)
            counts = np.fromiter(map(len, group), dtype=np.int64, count=len(group))
            n = int(counts.sum())
            ids = _id_array(chain.from_iterable(mb.ids for mb in group), n)
            idlen = np.fromiter(map(_LEN, ids), dtype=np.int64, count=n)
            chunk = _Chunk(int(k), np.repeat(codes, counts).astype(np.int32),
                           np.concatenate([mb.kind for mb in group]), ids,
                           np.concatenate([mb.ts for mb in group]),
                           np.concatenate([mb.probs for mb in group]).reshape(n, int(k)),
                           np.concatenate([mb.labels for mb in group]), int(idlen.sum()))
            lims = np.fromiter((mb.ts_limit for mb in group), dtype=np.float64,
                               count=len(group))
            out += self._stage(chunk, models, codes, counts, lims, idlen, now)
        return out

    def add_grouped(self, g: GroupedBatch, stage: np.ndarray, codes: np.ndarray,
                    now: float) -> list[str]:
        """Stage the models ``stage`` (a bool per model of ``g``) of ``g`` at ``now``, in one
        chunk (``codes``: :meth:`codes` of ``g.models``; their staged ``k``, if any, must be
        ``g.k``); the models whose staged events reached ``min_events``."""
        sel = np.flatnonzero(stage)
        if sel.size == 0:
            return []
        counts = g.counts()
        lims = (np.full(len(g.models), math.inf) if g.ts_limits is None
                else np.asarray(g.ts_limits, dtype=np.float64))
        ids = _id_array(g.ids, len(g.ids))
        idlen = np.fromiter(map(_LEN, g.ids), dtype=np.int64, count=len(g.ids))
        if sel.size == len(g.models):  # all of it: the batch's columns (nobody else's)
            chunk = _Chunk(g.k, np.repeat(codes, counts).astype(np.int32), g.kind, ids, g.ts,
                           g.probs, g.labels, int(idlen.sum()))
            models = g.models
        else:
            rows = np.flatnonzero(np.repeat(stage, counts))
            idlen = idlen[rows]
            chunk = _Chunk(g.k, np.repeat(codes[sel], counts[sel]).astype(np.int32),
                           g.kind[rows], ids[rows], g.ts[rows], g.probs[rows], g.labels[rows],
                           int(idlen.sum()))
            models = [g.models[c] for c in sel.tolist()]
            codes, counts, lims = codes[sel], counts[sel], lims[sel]
        return self._stage(chunk, models, codes, counts, lims, idlen, now)

    def _stage(self, chunk: _Chunk, models: Sequence[str], codes: np.ndarray,
               counts: np.ndarray, lims: np.ndarray, idlen: np.ndarray,
               now: float) -> list[str]:
        """Account for ``chunk``, whose rows are ``counts[i]`` events of ``models[i]`` (code
        ``codes[i]``, distinct) in model order, ``idlen`` the characters of their ids."""
        was = self._n[codes] > 0
        if was.any():
            bad = np.flatnonzero(was & (self._k[codes] != chunk.k))
            if bad.size:
                c = int(bad[0])
                raise ValueError(f"StagedEvents: model {models[c]!r} has slices of "
                                 f"k={int(self._k[codes[c]])} staged, got k={chunk.k}; take "
                                 "them first")
        new = np.flatnonzero(~was)
        if new.size:
            nc = codes[new]
            self._since[nc] = now
            self._k[nc] = chunk.k
            self._first[nc] = lims[new]
            self._lim[nc] = -math.inf
            self._slices[nc] = 0
            if new.size == len(models):
                self._models.update(zip(models, codes.tolist()))
            else:
                self._models.update((models[i], int(codes[i])) for i in new.tolist())
        # bytes of each model's rows: the fixed part per row plus its ids' characters
        starts = np.zeros(len(models), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        per_model = counts * _row_fixed(chunk) + np.add.reduceat(idlen, starts)
        self._n[codes] += counts
        self._bytes[codes] += per_model
        self._slices[codes] += 1
        self._lim[codes] = np.maximum(self._lim[codes], lims)
        self._add_chunk(chunk)
        self.events += int(counts.sum())
        due = np.flatnonzero(self._n[codes] >= self.min_events)
        return [models[i] for i in due.tolist()]

    def _add_chunk(self, chunk: _Chunk) -> None:
        """Append ``chunk``; merge it with the chunks before it while they hold no more staged
        rows than it (their staged rows only; one ``k``): the chunks stay few (about log2 of
        the rows over the batch size) whatever the batch size, each row copied a few times."""
        chunks = self._chunks
        self.nbytes += chunk.nbytes
        chunks.append(chunk)
        while len(chunks) >= 2 and chunks[-2].k == chunks[-1].k \
                and chunks[-2].nlive <= chunks[-1].nlive:
            b, a = chunks.pop(), chunks.pop()
            self.nbytes -= a.nbytes + b.nbytes
            merged = _merge(a, b)
            self.nbytes += merged.nbytes
            chunks.append(merged)

    # ------------------------------------------------------------------ taking
    def take(self, model: str) -> Staged | None:
        """Remove and return ``model``'s staged events (None when nothing is staged)."""
        got = self.take_many([model])
        return got[0][1] if got else None

    def take_many(self, models: Iterable[str]) -> list[tuple[str, Staged]]:
        """Remove and return the staged events of ``models`` (those with none are skipped), in
        the order given: their rows are gathered from the chunks (arrival order) and grouped
        per model by one stable sort, whatever the number of models."""
        pop = self._models.pop
        codes = [c for c in map(pop, models, repeat(None)) if c is not None]
        if not codes:
            return []
        ca = np.asarray(codes, dtype=np.int64)
        want = np.zeros(self._n.shape[0], dtype=bool)
        want[ca] = True
        by_k: dict[int, list[tuple[_Chunk, np.ndarray]]] = {}
        for chunk in self._chunks:
            sel = want[chunk.codes]
            sel &= chunk.live
            idx = np.flatnonzero(sel)
            if idx.size:
                chunk.live[idx] = False
                chunk.nlive -= idx.size
                by_k.setdefault(chunk.k, []).append((chunk, idx))
        out: dict[int, Staged] = {}
        names = self._names
        for k, parts in by_k.items():
            if len(parts) == 1:
                ch, idx = parts[0]
                pc, kind, ids, ts, probs, labels = (ch.codes[idx], ch.kind[idx], ch.ids[idx],
                                                    ch.ts[idx], ch.probs[idx], ch.labels[idx])
            else:
                pc, kind, ids, ts, probs, labels = (
                    np.concatenate([getattr(ch, f)[idx] for ch, idx in parts])
                    for f in ("codes", "kind", "ids", "ts", "probs", "labels"))
            if len(codes) > 1:
                order = np.argsort(pc, kind="stable")
                pc, kind, ids, ts, probs, labels = (pc[order], kind[order], ids[order],
                                                    ts[order], probs[order], labels[order])
            starts = np.flatnonzero(np.diff(pc)) + 1
            bounds = [0, *starts.tolist(), len(pc)]
            ids_l = ids.tolist()
            for j, c in enumerate(pc[[0, *starts.tolist()]].tolist()):
                a, b = bounds[j], bounds[j + 1]
                out[c] = Staged(ModelBatch(names[c], k, kind[a:b], ids_l[a:b], ts[a:b],
                                           probs[a:b], labels[a:b],
                                           np.arange(b - a, dtype=np.int64),
                                           float(self._first[c])),
                                float(self._lim[c]), int(self._slices[c]))
        self.events -= int(self._n[ca].sum())
        self._n[ca] = 0
        self._bytes[ca] = 0
        self._release()
        return [(names[c], out[c]) for c in codes if c in out]

    def _release(self, force: bool = False) -> None:
        """Drop the chunks with nothing staged; compact those less than half staged (with
        ``force``: every chunk with a row taken)."""
        keep = []
        for ch in self._chunks:
            if ch.nlive == len(ch):
                keep.append(ch)
                continue
            self.nbytes -= ch.nbytes
            if ch.nlive == 0:
                continue
            if force or 2 * ch.nlive < len(ch):
                ch = ch.rows(np.flatnonzero(ch.live))
            self.nbytes += ch.nbytes
            keep.append(ch)
        self._chunks = keep

    def compact(self) -> None:
        """Release the rows taken: :attr:`nbytes` is then the bytes of the events staged."""
        self._release(force=True)

    # ------------------------------------------------------------------ due
    def due(self, now: float, age: float | None = None) -> list[str]:
        """The models whose oldest staged slice is ``age`` (default ``max_age``) seconds old or
        older at ``now``: O(models due)."""
        out = []
        limit = now - (self.max_age if age is None else age)
        since = self._since
        for model, c in self._models.items():
            if since[c] > limit:
                break
            out.append(model)
        return out

    def next_due(self, age: float | None = None) -> float | None:
        """When the first model is due at ``age`` (default ``max_age``; None: nothing
        staged)."""
        for c in self._models.values():
            return float(self._since[c]) + (self.max_age if age is None else age)
        return None

    def oldest(self) -> Iterator[str]:
        """The models with staged events, oldest slice first (a snapshot)."""
        return iter(list(self._models))

    def oldest_over_budget(self) -> list[str]:
        """The oldest models to offer so that the events staged are within half of
        ``max_bytes`` (none when they already are)."""
        target = self.max_bytes // 2
        models = list(self._models)
        if not models:
            return []
        b = self._bytes[list(self._models.values())]
        left = int(b.sum()) - np.cumsum(b)   # staged bytes left after the first i + 1
        if int(b.sum()) <= target:
            return []
        i = int(np.argmax(left <= target))
        return models[:i + 1]

    @property
    def over_budget(self) -> bool:
        """True while the staged bytes exceed ``max_bytes``."""
        return self.nbytes > self.max_bytes


def _merge(a: _Chunk, b: _Chunk) -> _Chunk:
    """The staged rows of ``a`` then ``b`` (one ``k``) as one chunk."""
    ia = None if a.nlive == len(a) else np.flatnonzero(a.live)
    ib = None if b.nlive == len(b) else np.flatnonzero(b.live)

    def col(f):
        x, y = getattr(a, f), getattr(b, f)
        return np.concatenate([x if ia is None else x[ia], y if ib is None else y[ib]])

    return _Chunk(a.k, col("codes"), col("kind"), col("ids"), col("ts"), col("probs"),
                  col("labels"))


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
