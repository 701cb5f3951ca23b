"""Parse and validate input events (raw Kafka message values) into typed records. Pure: no I/O.

Event contract (JSON objects; unknown extra fields are ignored)::

    prediction  {"model": "fraud-v3", "id": "e-123", "ts": 1764000000.5, "probs": [0.1, 0.7, 0.2]}
    outcome     {"model": "fraud-v3", "id": "e-123", "ts": 1764000090.0, "label": 1}
    sample      both a vector and "label" (a complete labelled sample, on either topic)

``logits`` may replace ``probs`` (mapped by a numerically stable softmax). ``ts`` is event time in
Unix seconds; when absent, the caller's per-message fallback (e.g. the Kafka record timestamp) is
used. ``model`` has 1..255 characters, ``id`` 1..256.

Nothing here raises on bad input: every message becomes a :class:`Prediction`, :class:`Outcome`,
:class:`Sample` or :class:`Invalid` whose ``reason`` is one of :data:`REASONS` (the label values of
``lpcal_events_invalid_total{reason}``), checked in this order:

* ``oversize``: more than ``max_bytes`` bytes;
* ``bad_encoding``: not UTF-8; ``bad_json``: not JSON (also NaN/Infinity literals, overflowing
  numbers);
* ``bad_schema``: not an object, missing/mistyped ``model``/``id``/``ts``/vector/``label``, both
  ``probs`` and ``logits``, neither a vector nor a label, non-numeric vector entries;
* ``unknown_model``: the policy rejects the model (``unknown_models = "reject"`` or ``max_models``
  models already admitted);
* ``wrong_length``: vector length differs from the model's ``k`` (or, while ``k`` is being
  learned, is below 2);
* ``k_too_large``: while ``k`` is being learned, a vector longer than ``max_k`` (the daemon's
  ``max_k`` setting, default 1000: a pending prediction holds 8 k bytes, so k bounds memory);
* ``non_finite``: a NaN/inf entry (or a sum that overflows);
* ``negative``: a negative probability;
* ``not_normalized``: ``|sum(probs) - 1| > sum_tolerance`` and ``normalize = "reject"`` (or the
  sum is 0); with ``"renormalize"`` such rows are divided by their sum instead;
* ``label_out_of_range``: label not an integer in ``[0, k)``;
* ``ts_out_of_range``: ``ts`` more than ``max_ts_skew`` seconds after the message's record
  timestamp (the broker's; ``[join] max_ts_skew_seconds`` in the daemon). Event time drives the
  join watermark, the monitor's time window and the drift timers, which only move forward: one
  event far in the future would expire every pending join and freeze those clocks.
  Checked only when the caller passes record timestamps; a message without one
  (missing or negative) is not bounded.

``k``: a model's ``k`` comes from its policy; when the policy has none, the parser learns it from
the model's first event whose vector is a list of 2..``max_k`` entries and keeps it
(:meth:`EventParser.set_k` restores it from a checkpoint; :attr:`EventParser.k` exposes it).

Throughput: :meth:`EventParser.parse_batch` first tries a batch fast path: every message parsed
and its fields taken out in one pass (:func:`daemon.columns.parse_columns`, a C kernel when
:mod:`daemon.native` has it), all vectors of a model validated at once with numpy. A batch with
any unusual event goes through the general per-message loop, which gives every event its own
verdict; both paths produce the same records.

Usage::

    parser = EventParser(lambda model: ModelPolicy(k=3), max_bytes=1 << 20)
    rec = parser.parse(b'{"model":"m","id":"a","ts":1,"probs":[0.2,0.3,0.5]}')   # Prediction
    batch = parser.parse_batch([msg.value for msg in msgs], timestamps=[m.timestamp / 1e3 ...])
    for model, mb in batch.by_model.items():        # ModelBatch: columnar, input order
        ...mb.kind, mb.ids, mb.ts, mb.probs, mb.labels, mb.index
    for i, bad in batch.invalid:                    # (input position, Invalid)
        deadletter(msgs[i], bad.reason)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import orjson

from daemon.codes import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE  # defined there, once
from daemon.columns import parse_columns
from daemon.limits import MAX_ID_LEN, MAX_K, MAX_MODEL_LEN  # defined there, once
from lpcal.io import softmax_rows

__all__ = [
    "BAD_ENCODING",
    "BAD_JSON",
    "BAD_SCHEMA",
    "KIND_OUTCOME",
    "KIND_PREDICTION",
    "KIND_SAMPLE",
    "LABEL_OUT_OF_RANGE",
    "MAX_ID_LEN",
    "MAX_K",
    "MAX_MODEL_LEN",
    "NEGATIVE",
    "NON_FINITE",
    "NOT_NORMALIZED",
    "OVERSIZE",
    "REASONS",
    "TS_OUT_OF_RANGE",
    "UNKNOWN_MODEL",
    "WRONG_LENGTH",
    "EventParser",
    "Invalid",
    "ModelBatch",
    "ModelPolicy",
    "Outcome",
    "ParsedBatch",
    "Prediction",
    "RecordTimestamps",
    "Sample",
    "softmax",
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

OTHER_POLICIES = 4096    # policies cached for models that are not admitted
_UNKNOWN = object()
_TIMESTAMP = attrgetter("timestamp")
_NUM = (int, float)


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
class ParsedBatch:
    """Result of :meth:`EventParser.parse_batch`: valid events grouped per model + the invalid."""

    n: int
    by_model: dict[str, ModelBatch] = field(default_factory=dict)
    invalid: list[tuple[int, Invalid]] = field(default_factory=list)

    def records(self) -> list[Prediction | Outcome | Sample | Invalid]:
        """One record per input message, in input order (convenient, not fast)."""
        out: list[Any] = [None] * self.n
        for mb in self.by_model.values():
            for j, i in enumerate(mb.index.tolist()):
                out[i] = mb.record(j)
        for i, bad in self.invalid:
            out[i] = bad
        return out


class RecordTimestamps(Sequence):
    """``[r.timestamp / 1000.0 for r in records]`` (Kafka record time in seconds), computed
    lazily: :meth:`EventParser.parse_batch` reads it only for events without ``ts``."""

    __slots__ = ("records",)

    def __init__(self, records: Sequence[Any]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [r.timestamp / 1000.0 for r in self.records[i]]
        return self.records[i].timestamp / 1000.0


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise ``exp(z - max z) / sum exp(z - max z)`` (stable for any finite logits):
    :func:`lpcal.io.softmax_rows`."""
    return softmax_rows(logits)


# --------------------------------------------------------------------------- parser


class _Acc:
    """Per-model accumulator during one batch."""

    __slots__ = ("k", "policy", "rows", "vecs", "vmeta")

    def __init__(self, policy: ModelPolicy, k: int | None):
        self.policy, self.k = policy, k
        self.rows: list[tuple] = []     # (kind, id, ts, label or -1, input index)
        self.vecs: list[list] = []      # vectors of the events that have one
        self.vmeta: list[tuple] = []    # (position in rows, is_logits, needs strict check)


def _strict_row(v: list) -> bool:
    for x in v:
        t = type(x)
        if t is not float and t is not int:
            return False
    return True


class EventParser:
    """Stateful validator: knows each model's policy, learns unknown ``k``, bounds model count.

    ``policy_for(model)`` returns a :class:`ModelPolicy`, or None to reject the model as
    ``unknown_model``. ``max_models`` bounds how many distinct models are admitted (the first
    ones seen, plus those restored with :meth:`admit`).
    """

    def __init__(self, policy_for: Callable[[str], ModelPolicy | None], *,
                 max_bytes: int = 1 << 20, max_models: int | None = None,
                 max_id_len: int = MAX_ID_LEN, max_model_len: int = MAX_MODEL_LEN,
                 max_ts_skew: float | None = None, max_k: int | None = None):
        self._policy_for = policy_for
        #: events with ts > record timestamp + max_ts_skew are ``ts_out_of_range`` (None: off)
        self.max_ts_skew = None if max_ts_skew is None else float(max_ts_skew)
        self.max_bytes = int(max_bytes)
        self.max_models = max_models
        self.max_id_len = int(max_id_len)
        self.max_model_len = int(max_model_len)
        #: policies of admitted models (as many as are admitted: bounded by ``max_models`` plus
        #: the models restored) and, at most :data:`OTHER_POLICIES` of them, of other models
        #: (rejected, or not admitted yet), oldest forgotten first
        self._policies: dict[str, ModelPolicy | None] = {}
        self._others: dict[str, ModelPolicy | None] = {}
        self.max_k = MAX_K if max_k is None else int(max_k)
        self.k: dict[str, int] = {}
        self.admitted: set[str] = set()

    @classmethod
    def from_settings(cls, settings: Any) -> EventParser:
        """Build from a :class:`daemon.settings.Settings` (duck-typed; no pydantic import here)."""

        def policy_for(model: str) -> ModelPolicy | None:
            ms = settings.model_settings(model)
            if ms is None:
                return None
            return ModelPolicy(k=ms.k, sum_tolerance=ms.sum_tolerance, normalize=ms.normalize)

        p = cls(policy_for, max_bytes=settings.kafka.max_message_bytes,
                max_models=settings.max_models,
                max_ts_skew=getattr(settings.join, "max_ts_skew_seconds", None),
                max_k=getattr(settings, "max_k", None))
        for name, ms in settings.configured_models.items():
            p.admit(name, ms.k)
        return p

    # ---------------------------------------------------------------- model registry
    def admit(self, model: str, k: int | None = None) -> None:
        """Admit ``model`` (e.g. restored from a checkpoint), optionally with its learned ``k``."""
        self.admitted.add(model)
        if k:
            self.set_k(model, k)
        pol = self._others.pop(model, _UNKNOWN)
        if pol is not _UNKNOWN:
            self._cache_policy(model, pol)

    def set_k(self, model: str, k: int) -> None:
        """Set ``model``'s learned ``k``; ``0`` (a state whose outcomes came first) is none."""
        if k:
            self.k[model] = int(k)

    def _policy(self, model: str) -> ModelPolicy | None:
        pol = self._policies.get(model, _UNKNOWN)
        if pol is _UNKNOWN:
            pol = self._others.get(model, _UNKNOWN)
            if pol is _UNKNOWN:
                pol = self._policy_for(model)
                self._cache_policy(model, pol)
        return pol

    def _cache_policy(self, model: str, pol: ModelPolicy | None) -> None:
        """Remember ``model``'s policy (and, once admitted, its configured ``k`` unless one is
        known). Policies of models not admitted go to a bounded cache (
        200,000 distinct model names grew an unbounded one by 127 MiB)."""
        if model in self.admitted:
            self._others.pop(model, None)
            self._policies[model] = pol
            if pol is not None and pol.k is not None:
                self.k.setdefault(model, int(pol.k))
            return
        others = self._others
        if model not in others and len(others) >= OTHER_POLICIES:
            del others[next(iter(others))]
        others[model] = pol

    # ---------------------------------------------------------------- parsing
    def parse(self, raw: bytes, ts: float | None = None
              ) -> Prediction | Outcome | Sample | Invalid:
        """Parse one message; never raises on bad input."""
        return self.parse_batch([raw], None if ts is None else [ts]).records()[0]

    def parse_batch(self, raws: Sequence[bytes], timestamps: Sequence[float] | None = None
                    ) -> ParsedBatch:
        """Parse many messages; vectors are validated per model with numpy. Never raises.
        ``timestamps``: the messages' record timestamps (seconds), the fallback ``ts`` and,
        with ``max_ts_skew``, the bound of event time (``ts_out_of_range``)."""
        out = self._parse_uniform(raws)
        if out is None:
            out = self._parse_general(raws, timestamps)
        if self.max_ts_skew is not None and timestamps is not None and out.by_model:
            _bound_ts(out, timestamps, self.max_ts_skew)
        return out

    def _parse_general(self, raws: Sequence[bytes], timestamps: Sequence[float] | None
                       ) -> ParsedBatch:
        out = ParsedBatch(len(raws))
        invalid = out.invalid
        accs: dict[str, _Acc] = {}
        loads = orjson.loads
        max_bytes, max_id, max_model = self.max_bytes, self.max_id_len, self.max_model_len
        for i, raw in enumerate(raws):
            if type(raw) is not bytes:
                if raw is None:
                    invalid.append((i, Invalid(BAD_SCHEMA, "empty message (null value)")))
                    continue
                if not isinstance(raw, (bytearray, memoryview)):
                    invalid.append((i, Invalid(BAD_SCHEMA, f"message value is "
                                                           f"{type(raw).__name__}, not bytes")))
                    continue
                raw = bytes(raw)
            if len(raw) > max_bytes:
                invalid.append((i, Invalid(OVERSIZE, f"{len(raw)} bytes > {max_bytes}")))
                continue
            try:
                d = loads(raw)
            except orjson.JSONDecodeError as e:
                invalid.append((i, _json_error(raw, e)))
                continue
            if type(d) is not dict:
                invalid.append((i, Invalid(BAD_SCHEMA, "event is not a JSON object")))
                continue
            model = d.get("model")
            eid = d.get("id")
            if type(model) is not str or not 0 < len(model) <= max_model:
                invalid.append((i, Invalid(BAD_SCHEMA, f"'model' must be a string of 1..{max_model}"
                                                       " characters")))
                continue
            if type(eid) is not str or not 0 < len(eid) <= max_id:
                invalid.append((i, Invalid(BAD_SCHEMA, f"'id' must be a string of 1..{max_id}"
                                                       " characters", model)))
                continue
            ts = d.get("ts")
            if ts is None and timestamps is not None:
                ts = timestamps[i]
            if type(ts) is not float and type(ts) is not int:
                invalid.append((i, Invalid(BAD_SCHEMA, "'ts' must be a number (Unix seconds)",
                                           model)))
                continue
            acc = accs.get(model)
            if acc is None:
                acc = self._start_model(model)
                if type(acc) is Invalid:
                    invalid.append((i, acc))
                    continue
                accs[model] = acc
            vec = d.get("probs")
            logit = False
            lg = d.get("logits")
            if lg is not None:
                if vec is not None:
                    invalid.append((i, Invalid(BAD_SCHEMA, "both 'probs' and 'logits'", model)))
                    continue
                vec, logit = lg, True
            label = d.get("label")
            if vec is None and label is None:
                invalid.append((i, Invalid(BAD_SCHEMA, "event has neither 'probs'/'logits' nor"
                                                       " 'label'", model)))
                continue
            k = acc.k
            if vec is not None:
                if type(vec) is not list:
                    invalid.append((i, Invalid(BAD_SCHEMA, "'probs'/'logits' must be a list",
                                               model)))
                    continue
                n = len(vec)
                if k is None:
                    if n > self.max_k:
                        invalid.append((i, Invalid(K_TOO_LARGE, f"vector of length {n}: k above "
                                                   f"max_k={self.max_k}", model)))
                        continue
                    if n < 2:
                        invalid.append((i, Invalid(WRONG_LENGTH, f"vector of length {n}: k must "
                                                   f"be at least 2", model)))
                        continue
                    k = acc.k = n
                    self.k[model] = n
                elif n != k:
                    invalid.append((i, Invalid(WRONG_LENGTH, f"vector of length {n}, model has "
                                               f"k={k}", model)))
                    continue
            if label is not None:
                if type(label) is not int:
                    invalid.append((i, Invalid(BAD_SCHEMA, "'label' must be an integer", model)))
                    continue
                if label < 0 or label >= (k if k is not None else self.max_k):
                    invalid.append((i, Invalid(LABEL_OUT_OF_RANGE, f"label {label} outside "
                                               f"[0, {k if k is not None else self.max_k})",
                                               model)))
                    continue
            if vec is not None:
                acc.vmeta.append((len(acc.rows), logit, b"true" in raw or b"false" in raw))
                acc.vecs.append(vec)
                if label is None:
                    acc.rows.append((KIND_PREDICTION, eid, ts, -1, i))
                else:
                    acc.rows.append((KIND_SAMPLE, eid, ts, label, i))
            else:
                acc.rows.append((KIND_OUTCOME, eid, ts, label, i))
        for model, acc in accs.items():
            mb = self._finish_model(model, acc, invalid)
            if mb is not None:
                out.by_model[model] = mb
        if len(invalid) > 1:
            invalid.sort(key=lambda t: t[0])
        return out

    def _parse_uniform(self, raws: Sequence[bytes]) -> ParsedBatch | None:
        """Fast path of :meth:`parse_batch` for a batch of well-formed events of known models.

        The per-message checks of the general loop are done over the whole batch:
        :func:`daemon.columns.parse_columns` (a C kernel, or C-level ``map`` passes) parses
        every value (bytes within ``max_bytes``) and takes out the fields if every event has
        the common shape; every model has a policy and a known ``k`` (admitted, or admissible
        under ``max_models``), every label is below its model's ``k`` and every vector has
        ``k`` numeric entries. The vectors of a model become one matrix, validated exactly as in
        the general path (:func:`_validate_rows`). Returns None, with no state changed, when any condition
        fails; the caller then runs the general per-message loop, which produces the same
        result for the batches accepted here (models not admitted yet are admitted in order of
        first appearance, as it would)."""
        n = len(raws)
        if n == 0:
            return None
        cols = parse_columns(raws, self.max_bytes, self.max_model_len, self.max_id_len)
        if cols is None:
            return None
        models = cols.models
        first = models[0]
        umodels = [first] if models.count(first) == n else list(dict.fromkeys(models))
        ks, pols = [], []
        uncached, new_models = [], []  # committed only once the batch is accepted
        for model in umodels:
            pol = self._policies.get(model, _UNKNOWN)
            if pol is _UNKNOWN:  # cached (as admitted) once the batch is accepted
                pol = self._others.get(model, _UNKNOWN)
                if pol is _UNKNOWN:
                    pol = self._policy_for(model)
                uncached.append((model, pol))
            if pol is None:
                return None
            k = self.k.get(model)
            if k is None and pol.k is not None:
                k = int(pol.k)
            if k is None:
                return None
            if model not in self.admitted:
                new_models.append(model)
            ks.append(k)
            pols.append(pol)
        if (new_models and self.max_models is not None
                and len(self.admitted) + len(new_models) > self.max_models):
            return None
        hv, labels, ids = cols.has_vec, cols.labels, cols.ids
        hl = labels >= 0
        kind = np.where(hv, np.where(hl, KIND_SAMPLE, KIND_PREDICTION), KIND_OUTCOME
                        ).astype(np.int8)
        if len(umodels) == 1:
            codes = None
            kv = ks[0]
        else:
            code_of = {m: c for c, m in enumerate(umodels)}
            codes = np.fromiter(map(code_of.__getitem__, models), dtype=np.int64, count=n)
            kv = np.asarray(ks, dtype=np.int64)[codes]
        if not (labels < kv).all():  # absent labels are -1
            return None
        # per model: its rows and the matrix of its vectors (None: not all numeric/length k)
        parts = []
        if codes is not None:  # each model's rows, in input order: one stable sort, O(n log n)
            order = np.argsort(codes, kind="stable")
            bounds = np.searchsorted(codes[order], np.arange(len(umodels) + 1)).tolist()
            ids_of = itemgetter(*order.tolist()) if n > 1 else None
            ordered_ids = list(ids_of(ids)) if ids_of is not None else list(ids)
            if len(set(ks)) == 1 and len(set(pols)) == 1:  # one k and policy: validate once
                vall = np.flatnonzero(hv)
                mat = cols.matrix(vall, ks[0]) if vall.size else None
                if vall.size and mat is None:
                    return None
                self.admitted.update(new_models)
                for model, pol in uncached:  # as self._policy(model) would have
                    self._cache_policy(model, pol)
                return self._finish_grouped(cols, umodels, ks[0], pols[0], kind, order, bounds,
                                            ordered_ids, vall, mat)
        for c, model in enumerate(umodels):
            if codes is None:
                sel, m_ids = np.arange(n), ids
            else:
                a, b = bounds[c], bounds[c + 1]
                sel, m_ids = order[a:b], ordered_ids[a:b]
            vrows = sel[hv[sel]]
            mat = cols.matrix(vrows, ks[c]) if vrows.size else None
            if vrows.size and mat is None:
                return None
            parts.append((model, sel, m_ids, mat))
        self.admitted.update(new_models)
        for model, pol in uncached:  # as self._policy(model) would have
            self._cache_policy(model, pol)
        out = ParsedBatch(n)
        ts = cols.ts
        for c, (model, sel, m_ids, mat) in enumerate(parts):
            mb = self._finish_columns(model, pols[c], ks[c], kind[sel], m_ids,
                                      ts[sel], labels[sel], sel, None,
                                      np.flatnonzero(hv[sel]), None, (), out.invalid, mat)
            if mb is not None:
                out.by_model[model] = mb
        if len(out.invalid) > 1:
            out.invalid.sort(key=lambda t: t[0])
        return out

    @staticmethod
    def _finish_grouped(cols: Any, umodels: list[str], k: int, policy: ModelPolicy,
                        kind: np.ndarray, order: np.ndarray, bounds: list[int],
                        ordered_ids: list[str], vall: np.ndarray, mat: np.ndarray | None
                        ) -> ParsedBatch:
        """The end of :meth:`_parse_uniform` for a batch of several models sharing one ``k``
        and one policy: the vectors of the whole batch are validated in one pass
        (:func:`_validate_rows`), the columns are put in model order once (``order``: a stable
        sort by model, ``bounds``: each model's range in it), and each model's
        :class:`ModelBatch` is slices of them. The same records and invalid events as the
        per-model validation of :meth:`_finish_columns`, at a cost per batch instead of a few
        dozen array operations per model."""
        n = order.shape[0]
        out = ParsedBatch(n)
        models = cols.models
        reasons = {} if mat is None else _validate_rows(
            mat, np.zeros(mat.shape[0], dtype=bool), np.ones(mat.shape[0], dtype=bool), policy)
        ts = cols.ts
        bad_ts = ~np.isfinite(ts)
        pos = np.empty(n, dtype=np.int64)  # position of each event in model order
        pos[order] = np.arange(n)
        probs = np.zeros((n, k), dtype=np.float64)
        if mat is not None:
            probs[pos[vall]] = mat
        kind_s, ts_s, lab_s = kind[order], ts[order], cols.labels[order]
        keep_s = None
        if reasons or bad_ts.any():
            keep = np.ones(n, dtype=bool)
            for r, (reason, detail) in reasons.items():
                i = int(vall[r])
                keep[i] = False
                out.invalid.append((i, Invalid(reason, detail, models[i])))
            for i in np.flatnonzero(bad_ts & keep).tolist():
                keep[i] = False
                out.invalid.append((i, Invalid(NON_FINITE, "non-finite 'ts'", models[i])))
            keep_s = keep[order]
            if len(out.invalid) > 1:
                out.invalid.sort(key=lambda t: t[0])
        by_model = out.by_model
        for c, model in enumerate(umodels):
            a, b = bounds[c], bounds[c + 1]
            if keep_s is None or keep_s[a:b].all():
                by_model[model] = ModelBatch(model, k, kind_s[a:b], ordered_ids[a:b], ts_s[a:b],
                                             probs[a:b], lab_s[a:b], order[a:b])
                continue
            idx = a + np.flatnonzero(keep_s[a:b])
            if idx.size:
                by_model[model] = ModelBatch(model, k, kind_s[idx],
                                             [ordered_ids[j] for j in idx.tolist()], ts_s[idx],
                                             probs[idx], lab_s[idx], order[idx])
        return out

    def _start_model(self, model: str) -> _Acc | Invalid:
        pol = self._policy(model)
        if pol is None:
            return Invalid(UNKNOWN_MODEL, f"model {model[:64]!r} is not configured", model)
        if model not in self.admitted:
            if self.max_models is not None and len(self.admitted) >= self.max_models:
                return Invalid(UNKNOWN_MODEL, f"model {model[:64]!r} not admitted: max_models="
                               f"{self.max_models} reached", model)
            self.admitted.add(model)
            self._cache_policy(model, pol)
        return _Acc(pol, self.k.get(model))

    def _finish_model(self, model: str, acc: _Acc, invalid: list) -> ModelBatch | None:
        m = len(acc.rows)
        if m == 0:
            return None
        kind_t, ids_t, ts_t, lab_t, idx_t = zip(*acc.rows)
        kind = np.asarray(kind_t, dtype=np.int8)
        ts = np.asarray(ts_t, dtype=np.float64)
        labels = np.asarray(lab_t, dtype=np.int64)
        index = np.asarray(idx_t, dtype=np.int64)
        if acc.k is None:  # only outcomes so far: k unknown, labels were checked against MAX_K
            return self._finish_columns(model, acc.policy, 0, kind, list(ids_t), ts, labels,
                                        index, [], None, None, (), invalid)
        vidx_t, logit_t, strict_t = zip(*acc.vmeta) if acc.vecs else ((), (), ())
        return self._finish_columns(model, acc.policy, acc.k, kind, list(ids_t), ts, labels,
                                    index, acc.vecs, np.asarray(vidx_t, dtype=np.int64),
                                    np.asarray(logit_t, dtype=bool), strict_t, invalid)

    @staticmethod
    def _finish_columns(model: str, policy: ModelPolicy, k: int, kind: np.ndarray,
                        ids: list[str], ts: np.ndarray, labels: np.ndarray, index: np.ndarray,
                        vecs: list[list] | None, vidx: np.ndarray | None,
                        logit: np.ndarray | None,
                        strict: Sequence[bool], invalid: list,
                        matrix: np.ndarray | None = None) -> ModelBatch | None:
        """Validate one model's columns (``vecs[r]`` is the vector of row ``vidx[r]``; ``k = 0``:
        no vector yet) and build its :class:`ModelBatch`; rejected rows go to ``invalid``.
        ``matrix``: the vectors already stacked as float64 rows, all numeric (``vecs`` unused)."""
        m = len(ids)
        keep = np.ones(m, dtype=bool)
        index_of = index.item  # an event's input position (only for the invalid ones)
        if k == 0:
            probs = np.zeros((m, 0), dtype=np.float64)
        else:
            # labels of events accepted before k was learned in this batch
            if labels.size and labels.max() >= k:
                for j in np.flatnonzero(labels >= k).tolist():
                    keep[j] = False
                    invalid.append((index_of(j), Invalid(
                        LABEL_OUT_OF_RANGE, f"label {int(labels[j])} outside [0, {k})", model)))
            nvec = len(matrix) if matrix is not None else len(vecs or ())
            probs = None
            if nvec:
                if matrix is not None:
                    rows, ok = matrix, np.ones(nvec, dtype=bool)
                else:
                    rows, ok = _to_matrix(vecs, strict, k)
                if logit is None:
                    logit = np.zeros(nvec, dtype=bool)
                for r in np.flatnonzero(~ok).tolist():
                    keep[vidx[r]] = False
                    invalid.append((index_of(int(vidx[r])), Invalid(
                        BAD_SCHEMA, "vector entries must be numbers", model)))
                reasons = _validate_rows(rows, logit, ok, policy)
                for r, (reason, detail) in reasons.items():
                    keep[vidx[r]] = False
                    invalid.append((index_of(int(vidx[r])), Invalid(reason, detail, model)))
                if nvec == m and rows.flags.c_contiguous and rows.flags.writeable:
                    probs = rows  # every event has a vector, in order: no copy (vidx = 0..m-1)
            if probs is None:
                probs = np.zeros((m, k), dtype=np.float64)
                if nvec:
                    probs[vidx] = rows
        sel = None if keep.all() else np.flatnonzero(keep)
        if sel is not None:
            if sel.size == 0:
                return None
            kind, ts, index, labels, probs = kind[sel], ts[sel], index[sel], labels[sel], probs[sel]
            ids = [ids[j] for j in sel.tolist()]
        bad_ts = ~np.isfinite(ts)
        if bad_ts.any():  # only possible from a non-finite fallback timestamp
            good = np.flatnonzero(~bad_ts)
            for j in np.flatnonzero(bad_ts).tolist():
                invalid.append((int(index[j]), Invalid(NON_FINITE, "non-finite 'ts'", model)))
            if good.size == 0:
                return None
            kind, ts, index, labels, probs = kind[good], ts[good], index[good], labels[good], \
                probs[good]
            ids = [ids[j] for j in good.tolist()]
        return ModelBatch(model, k, kind, ids, ts, probs, labels, index)


def _record_times(timestamps: Sequence[Any]) -> np.ndarray:
    """Record timestamps in seconds as float64; ``inf`` where a message has none (a missing or
    negative Kafka timestamp), so that it is not bounded."""
    if isinstance(timestamps, RecordTimestamps):
        raw = list(map(_TIMESTAMP, timestamps.records))  # C-level passes, no Python loop
        scale = 1000.0
    else:
        raw, scale = list(timestamps), 1.0
    if None in raw:
        raw = [-1.0 if x is None else x for x in raw]
    t = np.array(raw, dtype=np.float64)
    if scale != 1.0:
        t /= scale
    t[~(t >= 0)] = math.inf
    return t


def _bound_ts(out: ParsedBatch, timestamps: Sequence[Any], skew: float) -> None:
    """Move every event with ``ts > record timestamp + skew`` from ``out.by_model`` to
    ``out.invalid`` as ``ts_out_of_range``; set each batch's ``ts_limit``."""
    limit = _record_times(timestamps) + skew
    if limit.shape[0] != out.n:
        return
    moved = False
    for model in list(out.by_model):
        mb = out.by_model[model]
        lim = limit[mb.index]
        bad = mb.ts > lim
        if bad.any():
            for j in np.flatnonzero(bad).tolist():
                out.invalid.append((int(mb.index[j]), Invalid(
                    TS_OUT_OF_RANGE, f"ts {float(mb.ts[j]):.17g} is more than {skew:g} s after "
                    f"the record timestamp", model)))
            moved = True
            if bad.all():
                del out.by_model[model]
                continue
            mb = out.by_model[model] = mb.select(~bad)
            lim = lim[~bad]
        mb.ts_limit = float(lim.max())
    if moved and len(out.invalid) > 1:
        out.invalid.sort(key=lambda t: t[0])


def _json_error(raw: bytes, e: Exception) -> Invalid:
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError as ue:
        return Invalid(BAD_ENCODING, f"not UTF-8 at byte {ue.start}")
    except TypeError:
        return Invalid(BAD_SCHEMA, f"message value is {type(raw).__name__}, not bytes")
    return Invalid(BAD_JSON, str(e)[:200])


def _to_matrix(vecs: list[list], strict: Sequence[bool], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack vectors (each of length k) into float64 rows; ``ok[r]`` False for non-numeric rows."""
    n = len(vecs)
    ok = np.ones(n, dtype=bool)
    try:
        a = np.array(vecs)
        fast = a.dtype.kind in "fiu" and a.shape == (n, k)
    except (ValueError, TypeError, OverflowError):
        fast = False
    if fast and not any(strict):
        return a.astype(np.float64, copy=False), ok
    rows = np.zeros((n, k), dtype=np.float64)
    for r, v in enumerate(vecs):
        if _strict_row(v):
            try:
                rows[r] = v
                continue
            except (ValueError, TypeError, OverflowError):
                pass
        ok[r] = False
    return rows, ok


def _validate_rows(rows: np.ndarray, logit: np.ndarray, ok: np.ndarray, pol: ModelPolicy
                   ) -> dict[int, tuple[str, str]]:
    """Vectorised checks; rewrites ``rows`` in place to probabilities. Returns row -> reason."""
    bad: dict[int, tuple[str, str]] = {}
    finite = np.isfinite(rows).all(axis=1)
    for r in np.flatnonzero(~finite & ok).tolist():
        bad[r] = (NON_FINITE, "vector has a NaN or infinite entry")
    live = ok & finite
    if logit.any():
        li = np.flatnonzero(logit & live)
        if li.size:
            rows[li] = softmax(rows[li])
    pi = ~logit & live
    if pi.any():
        neg = pi & (rows < 0).any(axis=1)
        for r in np.flatnonzero(neg).tolist():
            bad[r] = (NEGATIVE, "probability vector has a negative entry")
        pi &= ~neg
        with np.errstate(over="ignore", invalid="ignore"):
            s = rows.sum(axis=1)
        off = pi & ~(np.abs(s - 1.0) <= pol.sum_tolerance)
        if off.any():
            fixable = off & np.isfinite(s) & (s > 0)
            if pol.normalize == "renormalize":
                fi = np.flatnonzero(fixable)
                rows[fi] /= s[fi, None]
                rest = off & ~fixable
            else:
                rest = off
            for r in np.flatnonzero(rest).tolist():
                why = (NON_FINITE, "probabilities sum to infinity") if not math.isfinite(s[r]) \
                    else (NOT_NORMALIZED, (f"probabilities sum to {float(s[r]):.6g}, tolerance "
                                          f"{pol.sum_tolerance:g}"))
                bad[r] = why
    rows[~ok] = 0.0
    for r in bad:
        rows[r] = 0.0
    return bad


def reason_counts(batch: ParsedBatch) -> Mapping[str, int]:
    """``{reason: count}`` of a batch's invalid events (for ``lpcal_events_invalid_total``)."""
    out: dict[str, int] = {}
    for _, bad in batch.invalid:
        out[bad.reason] = out.get(bad.reason, 0) + 1
    return out
