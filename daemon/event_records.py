"""The event contract's records and rejection reasons. Pure: no I/O.

:class:`Prediction`, :class:`Outcome`, :class:`Sample` and :class:`Invalid` are what
:class:`daemon.events.EventParser` makes of one message; :class:`ModelBatch` holds one model's
valid events of a batch as columns and :class:`ParsedBatch` a whole parsed batch.
:class:`ModelPolicy` says how a model's vectors are validated. :data:`REASONS` are the rejection
reasons (the label values of ``lpcal_events_invalid_total{reason}``); :mod:`daemon.events`
documents when each applies. Defined here, once, so that the parser and its two parse paths
(:mod:`daemon.event_columnar`, :mod:`daemon.event_general`) share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.codes import KIND_OUTCOME, KIND_PREDICTION  # defined there, once

__all__ = [
    "BAD_ENCODING",
    "BAD_JSON",
    "BAD_SCHEMA",
    "K_TOO_LARGE",
    "LABEL_OUT_OF_RANGE",
    "NEGATIVE",
    "NON_FINITE",
    "NOT_NORMALIZED",
    "OVERSIZE",
    "REASONS",
    "TS_OUT_OF_RANGE",
    "UNKNOWN_MODEL",
    "WRONG_LENGTH",
    "GroupedBatch",
    "Invalid",
    "ModelBatch",
    "ModelPolicy",
    "Outcome",
    "ParsedBatch",
    "Prediction",
    "Sample",
]

BAD_JSON = "bad_json"
OVERSIZE = "oversize"
BAD_SCHEMA = "bad_schema"
UNKNOWN_MODEL = "unknown_model"
WRONG_LENGTH = "wrong_length"
NON_FINITE = "non_finite"
NEGATIVE = "negative"
NOT_NORMALIZED = "not_normalized"
LABEL_OUT_OF_RANGE = "label_out_of_range"
BAD_ENCODING = "bad_encoding"
TS_OUT_OF_RANGE = "ts_out_of_range"
K_TOO_LARGE = "k_too_large"
#: Every reason an event can be rejected for (Prometheus label values; exact strings).
REASONS: tuple[str, ...] = (
    BAD_JSON, OVERSIZE, BAD_SCHEMA, UNKNOWN_MODEL, WRONG_LENGTH, NON_FINITE, NEGATIVE,
    NOT_NORMALIZED, LABEL_OUT_OF_RANGE, BAD_ENCODING, TS_OUT_OF_RANGE, K_TOO_LARGE,
)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Invalid:
    """A rejected event: ``reason`` in :data:`REASONS`, ``detail`` a human-readable explanation."""

    reason: str
    detail: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Prediction:
    model: str
    id: str
    ts: float
    probs: np.ndarray


@dataclass(frozen=True, slots=True)
class Outcome:
    model: str
    id: str
    ts: float
    label: int


@dataclass(frozen=True, slots=True)
class Sample:
    model: str
    id: str
    ts: float
    probs: np.ndarray
    label: int


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """How one model's events are validated."""

    k: int | None = None
    sum_tolerance: float = 1e-3
    normalize: str = "renormalize"  # or "reject"


@dataclass(slots=True)
class ModelBatch:
    """The valid events of one model in a batch, columnar, in input order.

    ``kind[i]`` is KIND_PREDICTION / KIND_OUTCOME / KIND_SAMPLE; ``probs`` is ``(m, k)`` float64
    on the simplex (zero rows for outcomes); ``labels`` is int64 with -1 for predictions;
    ``index[i]`` is the event's position in the input batch. ``ts_limit``: the largest event
    time the parser allowed in this batch (the largest record timestamp of its messages plus
    ``max_ts_skew``; ``inf`` when unbounded). :meth:`daemon.model_state.ModelState.offer` uses
    it to pull back clocks that a checkpoint written before the bound carried into the future.
    """

    model: str
    k: int
    kind: np.ndarray
    ids: list[str]
    ts: np.ndarray
    probs: np.ndarray
    labels: np.ndarray
    index: np.ndarray
    ts_limit: float = math.inf

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, keep: np.ndarray) -> ModelBatch:
        """The events where the bool array ``keep`` holds, in order."""
        idx = np.flatnonzero(keep)
        ids = self.ids
        return ModelBatch(self.model, self.k, self.kind[idx], [ids[i] for i in idx.tolist()],
                          self.ts[idx], self.probs[idx], self.labels[idx], self.index[idx],
                          self.ts_limit)

    def record(self, i: int) -> Prediction | Outcome | Sample:
        kd, m, eid, ts = int(self.kind[i]), self.model, self.ids[i], float(self.ts[i])
        if kd == KIND_PREDICTION:
            return Prediction(m, eid, ts, self.probs[i].copy())
        if kd == KIND_OUTCOME:
            return Outcome(m, eid, ts, int(self.labels[i]))
        return Sample(m, eid, ts, self.probs[i].copy(), int(self.labels[i]))


@dataclass(slots=True)
class GroupedBatch:
    """The valid events of several models sharing one ``k`` in a batch, as columns in model
    order: model ``c`` (``models[c]``) has rows ``bounds[c]:bounds[c + 1]``, in input order,
    and at least one row. The columns are those of :class:`ModelBatch` (``index``: the input
    positions); ``ts_limits[c]`` is model ``c``'s ``ts_limit`` (None: ``inf`` for all).

    What the columnar parser makes of a batch spread over many models: one set of arrays for
    the batch instead of one :class:`ModelBatch` per model, so that the work done per batch
    grows with its rows, not with the models in it. :meth:`model_batch` makes one model's."""

    models: list[str]
    k: int
    bounds: np.ndarray
    kind: np.ndarray
    ids: list[str]
    ts: np.ndarray
    probs: np.ndarray
    labels: np.ndarray
    index: np.ndarray
    ts_limits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def counts(self) -> np.ndarray:
        """Rows of each model (int64)."""
        return np.diff(self.bounds)

    def model_batch(self, c: int) -> ModelBatch:
        """Model ``c``'s :class:`ModelBatch` (views of the columns)."""
        a, b = int(self.bounds[c]), int(self.bounds[c + 1])
        return ModelBatch(self.models[c], self.k, self.kind[a:b], self.ids[a:b], self.ts[a:b],
                          self.probs[a:b], self.labels[a:b], self.index[a:b],
                          math.inf if self.ts_limits is None else float(self.ts_limits[c]))

    def by_model(self) -> dict[str, ModelBatch]:
        """``{model: ModelBatch}`` in model order."""
        return {m: self.model_batch(c) for c, m in enumerate(self.models)}

    def select(self, keep: np.ndarray) -> GroupedBatch | None:
        """The rows where the bool array ``keep`` holds (models left without rows dropped;
        None: no row left)."""
        idx = np.flatnonzero(keep)
        if idx.size == 0:
            return None
        counts = np.add.reduceat(keep.astype(np.int64), self.bounds[:-1]) \
            if len(keep) else np.zeros(0, np.int64)
        live = np.flatnonzero(counts)
        bounds = np.zeros(live.size + 1, dtype=np.int64)
        np.cumsum(counts[live], out=bounds[1:])
        ids = self.ids
        return GroupedBatch([self.models[c] for c in live.tolist()], self.k, bounds,
                            self.kind[idx], [ids[i] for i in idx.tolist()], self.ts[idx],
                            self.probs[idx], self.labels[idx], self.index[idx],
                            None if self.ts_limits is None else self.ts_limits[live])


class ParsedBatch:
    """Result of :meth:`daemon.events.EventParser.parse_batch`: valid events grouped per model +
    the invalid.

    ``by_model`` (``{model: ModelBatch}``) is made on first use when the parser left the batch
    as one :class:`GroupedBatch` (``grouped``); from then on ``by_model`` is the batch and
    ``grouped`` is None. Readers that can take the columns whole read ``grouped`` first."""

    __slots__ = ("_by_model", "grouped", "invalid", "n")

    def __init__(self, n: int, by_model: dict[str, ModelBatch] | None = None,
                 invalid: list[tuple[int, Invalid]] | None = None,
                 grouped: GroupedBatch | None = None):
        self.n = n
        self._by_model = {} if by_model is None else by_model
        self.invalid = [] if invalid is None else invalid
        self.grouped = grouped

    @property
    def by_model(self) -> dict[str, ModelBatch]:
        g = self.grouped
        if g is not None:
            self._by_model = g.by_model()
            self.grouped = None
        return self._by_model

    def max_ts(self) -> float:
        """The largest event time (``ts``) of the valid events (``-inf``: none)."""
        g = self.grouped
        if g is not None:
            return float(g.ts.max()) if len(g) else -math.inf
        return max((float(mb.ts.max()) for mb in self._by_model.values() if len(mb)),
                   default=-math.inf)

    @property
    def models(self) -> int:
        """How many models have valid events in the batch."""
        g = self.grouped
        return len(self._by_model) if g is None else len(g.models)

    def records(self) -> list[Prediction | Outcome | Sample | Invalid]:
        """One record per input message, in input order (convenient, not fast)."""
        out: list[Any] = [None] * self.n
        for mb in self.by_model.values():
            for j, i in enumerate(mb.index.tolist()):
                out[i] = mb.record(j)
        for i, bad in self.invalid:
            out[i] = bad
        return out
