"""The simulated stream: predictions and, later, their outcomes, of several synthetic models.

:class:`TrafficGenerator` interleaves the traffic of several models
(:class:`~daemon.tools.simulate.model.SyntheticModel`) as a Kafka-like stream: event ``i`` belongs
to model ``i mod M`` and has event time ``ts_i = start + i / event_rate``; its outcome (the label)
is emitted ``delay * (1 + jitter * U(-1, 1))`` seconds of event time LATER, so predictions of new
events interleave with outcomes of old ones. Messages are emitted in event-time order, which makes
the stream independent of the chunk size. Optional fractions of orphans (no outcome ever),
complete samples (vector and label in one event), logits instead of probabilities, and malformed
events (see :data:`MALFORMED_KINDS`); an optional drift schedule (:class:`Drift`: from an event
index on, a model's output logits are scaled and/or its true ``T`` changes; ``drift_after`` /
``drift_T`` is the one-step shorthand of the label drift). Pure and seeded: no I/O.

Payloads follow the event contract of :mod:`daemon.events`::

    prediction  {"model": "fraud-v3", "id": "fraud-v3-123", "ts": 1764000000.5, "probs": [...]}
    outcome     {"model": "fraud-v3", "id": "fraud-v3-123", "ts": 1764000005.1, "label": 1}

and the Kafka key is the model id (UTF-8), so a model's predictions and outcomes land in the
same partition of co-partitioned topics.

Usage::

    gen = TrafficGenerator([SyntheticModel("fraud-v3", k=3, T=0.3, scale=5.0, skew=0.0, seed=1)],
                           events=10_000, delay=5.0, orphan_frac=0.05,
                           drifts=[Drift(at=6_000, logit_scale=0.5)])
    for topic_kind, key, value in gen:          # "predictions" | "outcomes", bytes, bytes
        ...
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from daemon.limits import MAX_MODEL_LEN
from daemon.tools.simulate.model import SyntheticModel
from lpcal.errors import InputError

__all__ = ["DEFAULT_START", "MALFORMED_KINDS", "OUTCOMES", "PREDICTIONS", "Drift",
           "TrafficGenerator", "check_frac"]

#: Default event time of the first event (fixed, so generator output is reproducible).
DEFAULT_START = 1764000000.0

#: Malformed event kinds -> the :mod:`daemon.events` reason each one is rejected with.
#: ``unknown_model`` is only rejected when the daemon runs with ``unknown_models = "reject"``
#: (the event names a model ``"unknown-<model>"``); with the default ``"defaults"`` policy the
#: daemon admits it as a new model. ``nan`` writes a ``NaN`` literal, which is not JSON;
#: ``overflow`` writes finite entries whose sum overflows (``non_finite``); ``unnormalized``
#: writes an all-zero vector (rejected under both normalize policies).
MALFORMED_KINDS: dict[str, str] = {
    "bad_json": "bad_json",
    "nan": "bad_json",
    "overflow": "non_finite",
    "wrong_length": "wrong_length",
    "negative": "negative",
    "unnormalized": "not_normalized",
    "label_out_of_range": "label_out_of_range",
    "unknown_model": "unknown_model",
}

PREDICTIONS, OUTCOMES = "predictions", "outcomes"
_RUN_ID = re.compile(r"[A-Za-z0-9._]{1,32}")
_KIND_PRED, _KIND_SAMPLE, _KIND_BAD = 0, 1, 2


@dataclass
class _Pending:
    """Outcomes not emitted yet (columnar): event index, outcome time, label."""

    idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    label: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add(self, idx: np.ndarray, ts: np.ndarray, label: np.ndarray) -> None:
        self.idx = np.concatenate([self.idx, idx])
        self.ts = np.concatenate([self.ts, ts])
        self.label = np.concatenate([self.label, label])

    def pop_until(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        due = self.ts <= t
        out = self.idx[due], self.ts[due], self.label[due]
        keep = ~due
        self.idx, self.ts, self.label = self.idx[keep], self.ts[keep], self.label[keep]
        return out


@dataclass(frozen=True)
class Drift:
    """One step of a drift schedule: from event index ``at`` on (the generator's global event
    index, all models interleaved), the events of ``model`` (None: every model) have their
    output logits multiplied by ``logit_scale`` (see :class:`~daemon.tools.simulate.model.
    SyntheticModel`: the truth stays, the predictions change) and their labels follow ``T``
    (None: the model's own ``T``). A later step replaces an earlier one for the models it names;
    ``Drift(at, logit_scale=1.0)`` undoes a drift.

    :meth:`parse` reads the command-line form ``AT:logits=S[,T=T2][,model=NAME]``.
    """

    at: int
    logit_scale: float = 1.0
    T: float | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.at, bool) or not isinstance(self.at, (int, np.integer)) or self.at < 0:
            raise InputError(f"drift: the event index must be an integer >= 0, got {self.at!r}")
        if not (math.isfinite(self.logit_scale) and self.logit_scale > 0):
            raise InputError(f"drift at event {self.at}: logit_scale must be > 0, got "
                             f"{self.logit_scale}")
        if self.T is not None and not (math.isfinite(self.T) and self.T > 0):
            raise InputError(f"drift at event {self.at}: T must be > 0, got {self.T}")

    @classmethod
    def parse(cls, text: str) -> Drift:
        """``"AT:logits=S[,T=T2][,model=NAME]"`` (e.g. ``"30000:logits=0.5"``) as a Drift."""
        at, sep, rest = text.partition(":")
        if not sep or not rest:
            raise InputError(f"drift {text!r}: expected AT:logits=S[,T=T2][,model=NAME]")
        try:
            kw: dict[str, Any] = {"at": int(at)}
        except ValueError:
            raise InputError(f"drift {text!r}: the event index {at!r} is not an integer") \
                from None
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or key not in ("logits", "T", "model") or not value.strip():
                raise InputError(f"drift {text!r}: expected logits=S, T=T2 or model=NAME, "
                                 f"got {part!r}")
            if key == "model":
                kw["model"] = value.strip()
                continue
            try:
                kw["logit_scale" if key == "logits" else "T"] = float(value)
            except ValueError:
                raise InputError(f"drift {text!r}: {key} must be a number, got {value!r}") \
                    from None
        return cls(**kw)

    def describe(self) -> str:
        what = [f"logits x{self.logit_scale:g}"] if self.logit_scale != 1.0 else []
        if self.T is not None:
            what.append(f"T={self.T:g}")
        who = f" of {self.model}" if self.model else ""
        return f"from event {self.at}{who}: " + (", ".join(what) or "no drift")


def check_frac(name: str, v: float) -> float:
    """``v`` as a float in ``[0, 1]`` (a fraction of events), else :class:`InputError` naming
    ``name``."""
    v = float(v)
    if not 0.0 <= v <= 1.0:
        raise InputError(f"{name} must be in [0, 1], got {v}")
    return v


class TrafficGenerator:
    """The interleaved prediction/outcome stream of ``models`` (see the module docstring).

    Event ``i`` (``0 <= i < events``) belongs to model ``i mod M`` with id
    ``f"{model}-{i // M}"`` (``id_digits``: the counter zero-padded to that many digits, so that
    every id of a model has the same length, as UUIDs do; ``run_id``: ``f"{model}-{run_id}-{i //
    M}"``, so that streams of different runs never share an id) and time
    ``start + i / event_rate``.
    Each event is, independently:
    malformed with probability ``malformed_frac`` (never a model's first event, so a daemon
    that learns ``k`` learns the right one), else a complete sample with probability
    ``sample_frac``, else a prediction whose outcome is dropped (an orphan) with probability
    ``orphan_frac``. Valid vectors are logits instead of probabilities with probability
    ``logits_frac``. ``drifts`` is the drift schedule (:class:`Drift` steps, in any order;
    :meth:`add_drift` appends a step during the run); ``drift_after``/``drift_T`` adds the step
    ``Drift(drift_after, T=drift_T)`` (from that event on, labels follow ``T = drift_T``).
    ``decimals`` rounds probabilities (the largest entry absorbs the rounding residual, so rows
    still sum to 1); ``None`` writes full precision.

    Iterating yields ``(topic_kind, key, value)`` with ``topic_kind`` ``"predictions"`` or
    ``"outcomes"``, in event-time order. :meth:`chunks` yields lists of those per chunk of
    ``chunk`` events; ``annotate=True`` adds a fourth item, the message's kind:
    ``"prediction"``, ``"outcome"``, ``"sample"`` or ``"malformed:<kind>"``. :attr:`counts`
    holds message counts by kind after (or during) iteration. A generator is single-use.
    """

    def __init__(self, models: Sequence[SyntheticModel], events: int, *,
                 event_rate: float = 100.0, start: float = DEFAULT_START, delay: float = 5.0,
                 jitter: float = 0.5, orphan_frac: float = 0.0, sample_frac: float = 0.0,
                 logits_frac: float = 0.0, malformed_frac: float = 0.0,
                 malformed_kinds: Sequence[str] | None = None, drift_after: int | None = None,
                 drift_T: float | None = None, drifts: Sequence[Drift] = (), seed: int = 0,
                 decimals: int | None = None,
                 chunk: int = 1000, id_digits: int | None = None, run_id: str | None = None):
        self.models = list(models)
        if not self.models:
            raise InputError("TrafficGenerator: at least one model is required")
        ids = [m.model_id for m in self.models]
        if len(set(ids)) != len(ids):
            raise InputError(f"TrafficGenerator: duplicate model ids in {ids}")
        if isinstance(events, bool) or not isinstance(events, (int, np.integer)) or events < 0:
            raise InputError(f"events must be an integer >= 0, got {events!r}")
        if not (math.isfinite(event_rate) and event_rate > 0):
            raise InputError(f"event_rate must be a positive number of events per second of "
                             f"event time, got {event_rate}")
        if not math.isfinite(start):
            raise InputError(f"start must be a finite Unix time, got {start}")
        if not (math.isfinite(delay) and delay > 0):
            raise InputError(f"delay must be > 0 seconds (outcomes arrive after predictions), "
                             f"got {delay}")
        if not 0.0 <= jitter < 1.0:
            raise InputError(f"jitter must be in [0, 1) (a fraction of delay), got {jitter}")
        self.orphan_frac = check_frac("orphan_frac", orphan_frac)
        self.sample_frac = check_frac("sample_frac", sample_frac)
        self.logits_frac = check_frac("logits_frac", logits_frac)
        self.malformed_frac = check_frac("malformed_frac", malformed_frac)
        if self.sample_frac + self.malformed_frac > 1.0:
            raise InputError(f"sample_frac + malformed_frac must be <= 1, got "
                             f"{self.sample_frac} + {self.malformed_frac}")
        kinds = list(MALFORMED_KINDS) if malformed_kinds is None else list(malformed_kinds)
        unknown = [x for x in kinds if x not in MALFORMED_KINDS]
        if unknown or not kinds:
            raise InputError(f"malformed_kinds: unknown or empty {unknown or kinds}; known: "
                             + ", ".join(MALFORMED_KINDS))
        self.malformed_kinds = kinds
        if (drift_after is None) != (drift_T is None):
            raise InputError("drift_after and drift_T must be given together")
        if drift_after is not None and (drift_after < 0 or not drift_T > 0):
            raise InputError(f"drift_after must be >= 0 and drift_T > 0, got {drift_after}, "
                             f"{drift_T}")
        self.drifts: list[Drift] = []
        for d in drifts:
            self._check_drift(d)
            self.drifts.append(d)
        if drift_after is not None:
            self.drifts.append(Drift(int(drift_after), T=drift_T))
        self.drifts.sort(key=lambda d: d.at)
        if decimals is not None and not 1 <= decimals <= 17:
            raise InputError(f"decimals must be in [1, 17] or None, got {decimals}")
        if chunk < 1:
            raise InputError(f"chunk must be >= 1, got {chunk}")
        per_model = -(-int(events) // len(self.models))
        if id_digits is not None and not (1 <= id_digits <= 30 and per_model <= 10 ** id_digits):
            raise InputError(f"id_digits must be in [1, 30] and fit {per_model} events per "
                             f"model, got {id_digits}")
        if run_id and not _RUN_ID.fullmatch(run_id):
            raise InputError(f"run_id must be 1-32 characters of [A-Za-z0-9._], got {run_id!r}")
        self.run_id = run_id or None
        run = f"{run_id}-" if run_id else ""
        self._id = ("{}-" + run + "{}" if id_digits is None
                    else f"{{}}-{run}{{:0{id_digits}d}}")
        self.events, self.event_rate, self.start = int(events), float(event_rate), float(start)
        self.delay, self.jitter = float(delay), float(jitter)
        self.drift_after, self.drift_T = drift_after, drift_T
        self.decimals, self.chunk = decimals, int(chunk)
        self._rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5EED]))
        self._keys = [m.model_id.encode() for m in self.models]
        self._pending = _Pending()
        self._next = 0
        self.counts: dict[str, int] = {"prediction": 0, "outcome": 0, "sample": 0, "orphan": 0,
                                       "malformed": 0}
        #: Per model id: events generated so far that become a labelled sample (a prediction
        #: with an outcome, or a complete sample), whether or not the outcome is emitted yet.
        self.labelled: dict[str, int] = dict.fromkeys(ids, 0)

    def _check_drift(self, d: Drift) -> None:
        if not isinstance(d, Drift):
            raise InputError(f"drifts: expected Drift steps, got {d!r}")
        if d.model is not None and d.model not in {m.model_id for m in self.models}:
            raise InputError(f"drift {d.describe()}: unknown model {d.model!r}; models: "
                             + ", ".join(m.model_id for m in self.models))

    def add_drift(self, drift: Drift) -> None:
        """Append a step to the schedule during a run; it must start at or after the next event
        not generated yet (:attr:`produced`), so the events already sent never change.
        Call it between chunks (e.g. from :func:`~daemon.tools.simulate.driver.simulate`'s
        ``between_chunks`` hook), not while a chunk is being generated."""
        self._check_drift(drift)
        if drift.at < self._next:
            raise InputError(f"drift {drift.describe()}: events up to {self._next} are already "
                             f"generated; a step added now starts at {self._next} or later")
        self.drifts.append(drift)
        self.drifts.sort(key=lambda d: d.at)

    def drift_rows(self, model: SyntheticModel, idx: np.ndarray
                   ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per-row ``(T, logit_scale)`` of ``model``'s events ``idx`` under the schedule
        (None, None when no step applies to it)."""
        steps = [d for d in self.drifts if d.model in (None, model.model_id)]
        if not steps or idx.size == 0 or idx[-1] < steps[0].at:
            return None, None
        T = np.full(idx.size, model.T)
        scale = np.ones(idx.size)
        for d in steps:  # sorted by `at`: a later step overrides an earlier one
            on = idx >= d.at
            T[on] = model.T if d.T is None else d.T
            scale[on] = d.logit_scale
        return T, scale

    def stop(self) -> None:
        """End the stream after the chunk being generated: no new events; the outcomes still
        pending are emitted. Safe to call from another thread."""
        self.events = min(self.events, max(self._next, 0))

    @property
    def produced(self) -> int:
        """Events generated so far (``<= events``)."""
        return self._next

    @property
    def valid_messages(self) -> int:
        """Messages of valid events generated so far: predictions (orphans among them),
        outcomes and complete samples, not malformed ones; what a daemon that consumed all of
        them counts in ``lpcal_events_consumed_total``."""
        c = self.counts
        return c["prediction"] + c["outcome"] + c["sample"]

    def __iter__(self) -> Iterator[tuple[str, bytes, bytes]]:
        for msgs in self.chunks():
            yield from msgs

    # ------------------------------------------------------------------ chunks
    def chunks(self, annotate: bool = False) -> Iterator[list[tuple]]:
        """Lists of messages, one per chunk of events (plus a final list of late outcomes)."""
        if self._next:
            raise RuntimeError("TrafficGenerator is single-use: create a new one")
        while self._next < self.events:
            i0 = self._next
            i1 = min(self.events, i0 + self.chunk)
            if i1 <= i0:  # stop() from another thread
                break
            self._next = i1
            yield self._chunk(i0, i1, annotate)
        idx, ts, label = self._pending.pop_until(math.inf)
        if idx.size:
            order = np.lexsort((idx, ts))
            yield self._encode_outcomes(idx[order], ts[order], label[order], annotate)

    def _chunk(self, i0: int, i1: int, annotate: bool) -> list[tuple]:
        n, M = i1 - i0, len(self.models)
        idx = np.arange(i0, i1, dtype=np.int64)
        ts = self.start + idx / self.event_rate
        # one row of uniforms per event, drawn sequentially: the stream is chunk-independent
        u = self._rng.random((n, 5))
        seq = idx // M
        kind = np.full(n, _KIND_PRED, dtype=np.int8)
        roll_bad = u[:, 0] < self.malformed_frac
        bad = roll_bad & (seq > 0)  # a model's first event stays a valid prediction
        kind[bad] = _KIND_BAD
        kind[~roll_bad & (u[:, 0] < self.malformed_frac + self.sample_frac)] = _KIND_SAMPLE
        orphan = (kind == _KIND_PRED) & (u[:, 1] < self.orphan_frac)
        use_logits = (u[:, 2] < self.logits_frac) & ~bad
        out_ts = ts + self.delay * (1.0 + self.jitter * (2.0 * u[:, 3] - 1.0))
        bad_kind = np.minimum((u[:, 4] * len(self.malformed_kinds)).astype(np.int64),
                              len(self.malformed_kinds) - 1)
        # per model: draw the vectors and labels of its events in this chunk
        vecs: list[Any] = [None] * n
        labels = np.zeros(n, dtype=np.int64)
        for m, model in enumerate(self.models):
            rows = np.flatnonzero(idx % M == m)
            if rows.size == 0:
                continue
            T_row, scale_row = self.drift_rows(model, idx[rows])
            z, f, _, y = model.draw(rows.size, T_row, scale_row)
            labels[rows] = y
            f_out = self._round(f)
            lg = use_logits[rows]
            fl, zl = f_out.tolist(), z.tolist()
            for r, j in enumerate(rows.tolist()):
                vecs[j] = zl[r] if lg[r] else fl[r]
        # outcomes of this chunk's predictions join the pending ones
        has_outcome = (kind == _KIND_PRED) & ~orphan
        labelled = has_outcome | (kind == _KIND_SAMPLE)
        for m, model in enumerate(self.models):
            self.labelled[model.model_id] += int(labelled[idx % M == m].sum())
        self._pending.add(idx[has_outcome], out_ts[has_outcome], labels[has_outcome])
        o_idx, o_ts, o_lab = self._pending.pop_until(float(ts[-1]))
        # merge: this chunk's events (all at ts <= ts[-1]) and the due outcomes, by event time
        all_ts = np.concatenate([ts, o_ts])
        tie = np.concatenate([2 * idx, 2 * o_idx + 1])
        order = np.lexsort((tie, all_ts))
        c = self.counts
        c["prediction"] += int((kind == _KIND_PRED).sum())
        c["sample"] += int((kind == _KIND_SAMPLE).sum())
        c["orphan"] += int(orphan.sum())
        c["malformed"] += int(bad.sum())
        c["outcome"] += int(o_idx.size)
        dumps, keys, models, eid = orjson.dumps, self._keys, self.models, self._id.format
        out: list[tuple] = []
        append = out.append
        ts_l, o_ts_l, o_idx_l, o_lab_l = ts.tolist(), o_ts.tolist(), o_idx.tolist(), \
            o_lab.tolist()
        kind_l, lg_l, lab_l, bk_l = kind.tolist(), use_logits.tolist(), labels.tolist(), \
            bad_kind.tolist()
        for o in order.tolist():
            if o >= n:  # an outcome
                r = o - n
                i = o_idx_l[r]
                m = i % M
                model_id = models[m].model_id
                v = dumps({"model": model_id, "id": eid(model_id, i // M), "ts": o_ts_l[r],
                           "label": o_lab_l[r]})
                append((OUTCOMES, keys[m], v, "outcome") if annotate else (OUTCOMES, keys[m], v))
                continue
            i = i0 + o
            m = i % M
            model_id = models[m].model_id
            d: dict[str, Any] = {"model": model_id, "id": eid(model_id, i // M), "ts": ts_l[o]}
            d["logits" if lg_l[o] else "probs"] = vecs[o]
            kd = kind_l[o]
            if kd == _KIND_PRED:
                msg: tuple = (PREDICTIONS, keys[m], dumps(d), "prediction")
            elif kd == _KIND_SAMPLE:
                d["label"] = lab_l[o]
                msg = (PREDICTIONS, keys[m], dumps(d), "sample")
            else:
                bk = self.malformed_kinds[bk_l[o]]
                topic, key, v = self._malformed(bk, d, models[m], keys[m])
                msg = (topic, key, v, "malformed:" + bk)
            append(msg if annotate else msg[:3])
        return out

    def _round(self, f: np.ndarray) -> np.ndarray:
        if self.decimals is None:
            return f
        r = np.round(f, self.decimals)
        top = r.argmax(axis=1)
        rows = np.arange(r.shape[0])
        r[rows, top] += 1.0 - r.sum(axis=1)
        return r

    def _encode_outcomes(self, idx: np.ndarray, ts: np.ndarray, label: np.ndarray,
                         annotate: bool) -> list[tuple]:
        M, dumps, out = len(self.models), orjson.dumps, []
        self.counts["outcome"] += int(idx.size)
        for i, t, y in zip(idx.tolist(), ts.tolist(), label.tolist()):
            model_id = self.models[i % M].model_id
            v = dumps({"model": model_id, "id": self._id.format(model_id, i // M), "ts": t,
                       "label": y})
            key = self._keys[i % M]
            out.append((OUTCOMES, key, v, "outcome") if annotate else (OUTCOMES, key, v))
        return out

    @staticmethod
    def _malformed(kind: str, d: dict[str, Any], model: SyntheticModel, key: bytes
                   ) -> tuple[str, bytes, bytes]:
        """One malformed message built from a valid prediction ``d`` (see MALFORMED_KINDS)."""
        d = dict(d)
        vec = list(d.pop("probs"))  # malformed events are built from probabilities, not logits
        k = model.k
        if kind == "bad_json":
            d["probs"] = vec
            raw = orjson.dumps(d)
            return PREDICTIONS, key, raw[: len(raw) // 2]
        if kind == "nan":
            d["probs"] = ["__lpcal_nan__"] + vec[1:]
            return PREDICTIONS, key, orjson.dumps(d).replace(b'"__lpcal_nan__"', b"NaN")
        if kind == "overflow":
            d["probs"] = [1e308] * k
        elif kind == "wrong_length":
            d["probs"] = vec + [0.0]
        elif kind == "negative":
            j = int(np.argmin(vec))
            d["probs"] = vec[:j] + [-max(vec[j], 0.01)] + vec[j + 1:]
        elif kind == "unnormalized":
            d["probs"] = [0.0] * k
        elif kind == "label_out_of_range":
            return OUTCOMES, key, orjson.dumps({"model": d["model"], "id": d["id"],
                                                "ts": d["ts"], "label": k})
        elif kind == "unknown_model":
            name = ("unknown-" + model.model_id)[:MAX_MODEL_LEN]
            d["model"], d["probs"] = name, vec
            return PREDICTIONS, name.encode(), orjson.dumps(d)
        else:  # pragma: no cover - kinds are validated in __init__
            raise InputError(f"unknown malformed kind {kind!r}")
        return PREDICTIONS, key, orjson.dumps(d)
