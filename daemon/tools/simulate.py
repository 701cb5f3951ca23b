"""``lpcal simulate``: play synthetic, miscalibrated model traffic into Kafka.

Two layers:

* A pure, seeded generator (no I/O). :class:`SyntheticModel` is an overconfident classifier
  over ``k`` classes: logits ``z ~ N(0, scale^2) - skew * log(j + 1)`` (``j = 0..k-1``; a few
  dominant classes when ``skew > 0``), prediction ``f = softmax(z)``, and the TRUE conditional
  label distribution ``q = softmax(T log f)``, i.e. ``q_j ∝ f_j^T``; ``T < 1`` makes ``f``
  overconfident. Labels are drawn from ``q``. :class:`TrafficGenerator` interleaves the traffic
  of several models as a Kafka-like stream: event ``i`` belongs to model ``i mod M`` and has
  event time ``ts_i = start + i / event_rate``; its outcome (the label) is emitted ``delay *
  (1 + jitter * U(-1, 1))`` seconds of event time LATER, so predictions of new events
  interleave with outcomes of old ones. Messages are emitted in event-time order, which makes
  the stream independent of the chunk size. Optional fractions of orphans (no outcome ever),
  complete samples (vector and label in one event), logits instead of probabilities, and
  malformed events (see :data:`MALFORMED_KINDS`); optional drift (after ``drift_after`` events
  every model's ``T`` becomes ``drift_T``).
* An async Kafka driver (:func:`simulate`) and the CLI (:func:`main`).

Payloads follow the event contract of :mod:`daemon.events`::

    prediction  {"model": "fraud-v3", "id": "fraud-v3-123", "ts": 1764000000.5, "probs": [...]}
    outcome     {"model": "fraud-v3", "id": "fraud-v3-123", "ts": 1764000005.1, "label": 1}

and the Kafka key is the model id (UTF-8), so a model's predictions and outcomes land in the
same partition of co-partitioned topics.

Usage::

    gen = TrafficGenerator([SyntheticModel("fraud-v3", k=3, T=0.3, scale=5.0, skew=0.0, seed=1)],
                           events=10_000, delay=5.0, orphan_frac=0.05)
    for topic_kind, key, value in gen:          # "predictions" | "outcomes", bytes, bytes
        ...
    f, q, y = SyntheticModel("m", 3, 0.3, 5.0, 0.0, seed=9).sample(100_000)
    print(true_err_p(f, q, lam=20, p=2.0), true_err_p(binmap.apply(f), q, 20, 2.0))

    report = asyncio.run(simulate("127.0.0.1:9092", {"predictions": "lpcal.predictions",
                                                     "outcomes": "lpcal.outcomes"}, gen,
                                  rate=1000, idempotence=False))

CLI: ``lpcal simulate --bootstrap HOST:PORT [--models fraud-v3,churn-v1:5] [--k 3] [--events N]
[--rate R] [--delay S] [--T 0.3] ... [--no-idempotence]`` (``--help`` lists every option). Each
run draws a random run id that is part of every event id (``fraud-v3-<run>-123``), so a second
run never repeats the first's ids (which the daemon would count as duplicates); ``--events``
defaults to enough events for one bin map of each model under the daemon's settings
(:func:`default_events`); a progress line goes to stderr every 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from lpcal.errors import InputError, LpcalError
from lpcal.levels import bin_counts, group_rows

__all__ = [
    "DEFAULT_START",
    "MALFORMED_KINDS",
    "SimulationReport",
    "SyntheticModel",
    "TrafficGenerator",
    "build_parser",
    "default_events",
    "events_for_binmap",
    "generator_from_args",
    "main",
    "simulate",
    "true_brier",
    "true_err_p",
    "true_label_dist",
]

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
_MAX_MODEL_LEN = 255


# --------------------------------------------------------------------------- math helpers


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


def true_label_dist(f: np.ndarray, T: float | np.ndarray) -> np.ndarray:
    """``q = softmax(T log f)`` row-wise (``q_j ∝ f_j^T``); ``T`` a scalar or one per row."""
    f = np.asarray(f, dtype=np.float64)
    T = np.asarray(T, dtype=np.float64)
    if T.ndim == 1:
        T = T[:, None]
    return _softmax(np.log(np.maximum(f, 1e-300)) * T)


def true_err_p(h: np.ndarray, q: np.ndarray, lam: int, p: float) -> float:
    """TRUE lp calibration error of predictions ``h`` given the true label distributions ``q``.

    ``Err(h, v, j) = |E[(h_j - q_j) 1[R(h) = v]]|`` over the level sets ``v`` of ``h`` (bins of
    ``lambda * R(h)``), estimated on the rows given (no label noise: ``q`` replaces the one-hot
    label); returns ``(sum_{v,j} Err^p)^(1/p)``, or the max for ``p = inf``.
    """
    h = np.atleast_2d(np.asarray(h, dtype=np.float64))
    q = np.atleast_2d(np.asarray(q, dtype=np.float64))
    if h.shape != q.shape or h.shape[0] == 0:
        raise InputError(f"true_err_p: h {h.shape} and q {q.shape} must be equal, non-empty")
    c = bin_counts(h, lam)
    _, _, inv = group_rows(c, exact=True)
    d = np.zeros((int(inv.max()) + 1, h.shape[1]))
    np.add.at(d, inv, h - q)
    d = np.abs(d) / h.shape[0]
    return float(d.max()) if math.isinf(p) else float((d ** p).sum() ** (1.0 / p))


def true_brier(h: np.ndarray, q: np.ndarray) -> float:
    """TRUE Brier score ``E[||h||^2 - 2 <h, q> + 1]`` given the true label distributions ``q``."""
    h, q = np.asarray(h, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return float(np.mean(np.sum(h * h, axis=1) - 2.0 * np.sum(h * q, axis=1) + 1.0))


# --------------------------------------------------------------------------- the model


class SyntheticModel:
    """A seeded, overconfident ``k``-class model (see the module docstring for the math).

    Draws are sequential: the logits and the labels come from two generators spawned from
    ``seed``, so ``draw(a)`` then ``draw(b)`` equals ``draw(a + b)`` (chunking does not matter).
    """

    def __init__(self, model_id: str, k: int, T: float, scale: float, skew: float = 0.0,
                 seed: int | Sequence[int] = 0):
        where = f"SyntheticModel {model_id!r}"
        if not isinstance(model_id, str) or not 0 < len(model_id) <= _MAX_MODEL_LEN:
            raise InputError(f"{where}: model id must be a string of 1..{_MAX_MODEL_LEN} chars")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
            raise InputError(f"{where}: k must be an integer >= 2, got {k!r}")
        for name, v in (("T", T), ("scale", scale), ("skew", skew)):
            if not math.isfinite(float(v)):
                raise InputError(f"{where}: {name} must be finite, got {v!r}")
        if T <= 0:
            raise InputError(f"{where}: T must be > 0, got {T}")
        if scale < 0:
            raise InputError(f"{where}: scale must be >= 0, got {scale}")
        self.model_id, self.k = model_id, int(k)
        self.T, self.scale, self.skew = float(T), float(scale), float(skew)
        ss = np.random.SeedSequence(seed)
        self._rng_z, self._rng_y = (np.random.default_rng(s) for s in ss.spawn(2))
        self._offset = -self.skew * np.log(np.arange(1, self.k + 1, dtype=np.float64))

    def __repr__(self) -> str:
        return (f"SyntheticModel({self.model_id!r}, k={self.k}, T={self.T}, scale={self.scale}, "
                f"skew={self.skew})")

    def draw(self, n: int, T: float | np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(logits, f, q, y)`` of ``n`` events; ``T`` overrides the model's (scalar or per row).

        ``f = softmax(logits)``, ``q = softmax(T log f)``, ``y ~ q`` (inverse CDF of one uniform
        per row).
        """
        z = self._rng_z.normal(size=(n, self.k)) * self.scale + self._offset
        f = _softmax(z.copy())
        q = true_label_dist(f, self.T if T is None else T)
        u = self._rng_y.random(n)
        y = (np.cumsum(q, axis=1) > u[:, None]).argmax(axis=1)
        # float rounding: cumsum may end just below u ~ 1; such rows take the last class with q > 0
        short = np.cumsum(q, axis=1)[:, -1] <= u
        if short.any():
            y[short] = q.shape[1] - 1 - np.argmax(q[short, ::-1] > 0, axis=1)
        return z, f, q, y.astype(np.int64)

    def sample(self, n: int, T: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(f, q, y)`` of ``n`` fresh events (as ``tests/test_oracle.py``'s ``synth``)."""
        _, f, q, y = self.draw(n, T)
        return f, q, y


# --------------------------------------------------------------------------- the stream


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


def _check_frac(name: str, v: float) -> float:
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
    ``logits_frac``. From event ``drift_after`` on, labels follow ``T = drift_T``.
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
                 drift_T: float | None = None, seed: int = 0, decimals: int | None = None,
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
        self.orphan_frac = _check_frac("orphan_frac", orphan_frac)
        self.sample_frac = _check_frac("sample_frac", sample_frac)
        self.logits_frac = _check_frac("logits_frac", logits_frac)
        self.malformed_frac = _check_frac("malformed_frac", malformed_frac)
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

    @property
    def produced(self) -> int:
        """Events generated so far (``<= events``)."""
        return self._next

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
        T_row: np.ndarray | None = None
        # per model: draw the vectors and labels of its events in this chunk
        vecs: list[Any] = [None] * n
        labels = np.zeros(n, dtype=np.int64)
        for m, model in enumerate(self.models):
            rows = np.flatnonzero(idx % M == m)
            if rows.size == 0:
                continue
            if self.drift_after is not None:
                T_row = np.where(idx[rows] >= self.drift_after, self.drift_T, model.T)
            z, f, _, y = model.draw(rows.size, T_row)
            labels[rows] = y
            f_out = self._round(f)
            lg = use_logits[rows]
            fl, zl = f_out.tolist(), z.tolist()
            for r, j in enumerate(rows.tolist()):
                vecs[j] = zl[r] if lg[r] else fl[r]
        # outcomes of this chunk's predictions join the pending ones
        has_outcome = (kind == _KIND_PRED) & ~orphan
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
            name = ("unknown-" + model.model_id)[:_MAX_MODEL_LEN]
            d["model"], d["probs"] = name, vec
            return PREDICTIONS, name.encode(), orjson.dumps(d)
        else:  # pragma: no cover - kinds are validated in __init__
            raise InputError(f"unknown malformed kind {kind!r}")
        return PREDICTIONS, key, orjson.dumps(d)


# --------------------------------------------------------------------------- Kafka driver


@dataclass
class SimulationReport:
    """What :func:`simulate` sent."""

    events: int
    messages: dict[str, int]           # per topic name
    counts: dict[str, int]             # per message kind (TrafficGenerator.counts)
    seconds: float
    topics: dict[str, str]             # topic kind -> topic name
    partitions: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Messages per second of wall time."""
        return sum(self.messages.values()) / self.seconds if self.seconds > 0 else math.inf

    def summary(self) -> str:
        msgs = ", ".join(f"{t}: {n}" for t, n in self.messages.items())
        kinds = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return (f"simulate: sent {self.events} events in {self.seconds:.1f} s "
                f"({self.rate:,.0f} messages/s); {msgs}; {kinds}")


def _topic_names(topics: Mapping[str, str]) -> dict[str, str]:
    names = {PREDICTIONS: topics.get(PREDICTIONS), OUTCOMES: topics.get(OUTCOMES)}
    missing = [k for k, v in names.items() if not v]
    if missing:
        raise InputError(f"topics: need names for {missing} (got {dict(topics)})")
    return names  # type: ignore[return-value]


async def simulate(bootstrap: str, topics: Mapping[str, str], generator: TrafficGenerator, *,
                   rate: float = 0.0, idempotence: bool = True, partitions: int = 1,
                   create_topics: bool = True, security: Any = None,
                   flush_every: int = 5000, progress: Callable[[str], None] | None = None,
                   progress_interval: float = 2.0, **producer_kwargs: Any) -> SimulationReport:
    """Produce ``generator``'s stream to Kafka; return what was sent.

    ``topics`` maps ``"predictions"`` and ``"outcomes"`` to topic names (they may be equal).
    ``rate``: events (not messages) per second of wall time; 0 = as fast as possible. With
    ``create_topics`` the topics are created with ``partitions`` partitions when missing
    (:func:`daemon.kafka_io.ensure_topics`; existing topics are kept). Messages are sent
    asynchronously (``send``) and every ``flush_every`` messages the delivery futures are
    awaited, so a delivery error stops the run. ``idempotence`` must be False against the
    embedded Tansu broker. ``progress`` (e.g. ``print``) receives a line every
    ``progress_interval`` seconds.
    """
    from daemon.kafka_io import TopicSpec, ensure_topics, make_producer, start_producer

    if not (math.isfinite(rate) and rate >= 0):
        raise InputError(f"rate must be >= 0 events per second (0 = as fast as possible), "
                         f"got {rate}")
    names = _topic_names(topics)
    distinct = list(dict.fromkeys(names.values()))
    counts: dict[str, int] = {}
    if create_topics:
        counts = await ensure_topics(bootstrap, [TopicSpec(t, partitions) for t in distinct],
                                     security=security)
    producer_kwargs.setdefault("linger_ms", 5)
    producer = make_producer(bootstrap, idempotence=idempotence, security=security,
                             client_id="lpcal-simulate", **producer_kwargs)
    sent = {t: 0 for t in distinct}
    t0 = time.monotonic()
    last = t0
    try:
        await start_producer(producer, idempotence=idempotence, fix=_IDEMPOTENCE_FIX)
    except BaseException:
        await producer.stop()
        raise
    try:
        futures: list[asyncio.Future] = []
        for msgs in generator.chunks():
            for topic_kind, key, value in msgs:
                topic = names[topic_kind]
                futures.append(await producer.send(topic, value=value, key=key))
                sent[topic] += 1
                if len(futures) >= flush_every:
                    await asyncio.gather(*futures)
                    futures.clear()
            now = time.monotonic()
            if rate > 0:  # pace: event i is due at t0 + i / rate
                wait = t0 + generator.produced / rate - now
                if wait > 0:
                    await asyncio.sleep(wait)
                    now = time.monotonic()
            if progress is not None and now - last >= progress_interval:
                last = now
                total = sum(sent.values())
                done = generator.produced / max(generator.events, 1)
                eta = (now - t0) * (1 - done) / done if done > 0 else math.inf
                progress(f"simulate: {generator.produced}/{generator.events} events "
                         f"({100 * done:.0f}%), {total} messages, "
                         f"{total / max(now - t0, 1e-9):,.0f} messages/s, {now - t0:.0f} s"
                         + (f", about {eta:.0f} s left" if math.isfinite(eta) else ""))
        if futures:
            await asyncio.gather(*futures)
        await producer.flush()
    finally:
        await producer.stop()
    return SimulationReport(events=generator.produced, messages=sent, counts=dict(generator.counts),
                            seconds=time.monotonic() - t0, topics=names, partitions=counts)


# --------------------------------------------------------------------------- CLI

_IDEMPOTENCE_FIX = "pass --no-idempotence (the embedded broker needs it)"
#: Safety margin of :func:`events_for_binmap`: every pool's expected count at the returned
#: number of events is this many standard deviations above its target.
_ROUTING_SIGMAS = 6.0


def events_for_binmap(model_settings: Sequence[Any], ks: Sequence[int], *,
                      keep: float = 1.0) -> int:
    """Events that give every model one bin map (one full epoch of pools) in the daemon.

    ``model_settings``: the daemon's merged settings of each model (``ModelSettings``); ``ks``
    their classes; ``keep``: share of events that become joined samples (no orphans, no
    malformed events: 1). An epoch takes ``warmup`` samples in arrival order, then routes the
    others by a hash of their id to the pools and the held-out share in proportion to their
    targets (:meth:`lpcal.pools.PoolLayout.route`), so it is full only when the slowest
    destination is: the count returned gives each destination an expected count
    ``_ROUTING_SIGMAS`` binomial standard deviations above its target, divided by the
    model's ``sample_rate`` and ``keep``. Events go to the models in turn, so the total is
    the largest per-model count times the number of models, rounded up to a thousand."""
    per_model = 0
    for ms, k in zip(model_settings, ks, strict=True):
        layout = ms.epoch_spec().layout(int(k))
        targets = [layout.targets[n] for n in layout.names] + (
            [layout.holdout] if layout.holdout else [])
        total = float(sum(targets))
        n = total
        while any(n * t / total - _ROUTING_SIGMAS * math.sqrt(n * t / total * (1 - t / total))
                  < t for t in targets):
            n *= 1.01
        need = (layout.warmup + n) / float(getattr(ms, "sample_rate", 1.0)) / keep
        per_model = max(per_model, math.ceil(need))
    return -(-per_model * len(ks) // 1000) * 1000


def _models_arg(text: str) -> list[tuple[str, int | None]]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, k = part.rpartition(":") if ":" in part else (part, "", "")
        if not name:
            raise argparse.ArgumentTypeError(f"--models: empty model name in {part!r}")
        try:
            out.append((name, int(k) if k else None))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--models: k of {name!r} must be an integer, "
                                             f"got {k!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("--models: at least one model name")
    return out


def _kinds_arg(text: str) -> list[str]:
    kinds = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in kinds if x not in MALFORMED_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"--malformed-kinds: unknown {bad or text!r}; known: "
                                         + ", ".join(MALFORMED_KINDS))
    return kinds


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lpcal simulate",
        description="Play synthetic traffic of overconfident models into Kafka: predictions "
                    "f = softmax(z), z ~ N(0, scale^2) - skew*log(j+1), labels ~ "
                    "softmax(T log f), each outcome DELAY s of event time after its prediction.")
    g = ap.add_argument_group("Kafka")
    g.add_argument("--bootstrap", help="HOST:PORT[,...] (default: from --config, else "
                                       "localhost:9092)")
    g.add_argument("--config", help="daemon TOML config: bootstrap, topics, security, "
                                    "idempotence and partitions default to its [kafka] section")
    g.add_argument("--topic-prefix", default="", help="prepended to both topic names")
    g.add_argument("--predictions-topic", help="default lpcal.predictions")
    g.add_argument("--outcomes-topic", help="default lpcal.outcomes")
    g.add_argument("--partitions", type=int, help="partitions of created topics (default 1)")
    g.add_argument("--no-create-topics", action="store_true",
                   help="do not create missing topics")
    g.add_argument("--idempotence", action=argparse.BooleanOptionalAction, default=None,
                   help="idempotent producer (default on; use --no-idempotence with the "
                        "embedded broker)")
    m = ap.add_argument_group("traffic")
    m.add_argument("--models", type=_models_arg, default=_models_arg("fraud-v3"),
                   help="comma-separated model ids, each optionally NAME:K (default fraud-v3)")
    m.add_argument("--k", type=int, default=3, help="classes of models without :K (default 3)")
    m.add_argument("--events", type=int, default=None,
                   help="events to generate, each 1-2 messages (default: enough for one bin map "
                        "of every model under the daemon settings `lpcal serve` reads here: "
                        "--config, else $LPCAL_CONFIG or config/lpcal.toml, and LPCAL_*; "
                        "printed at the start)")
    m.add_argument("--rate", type=float, default=0.0,
                   help="events per second of wall time; 0 = as fast as possible (default)")
    m.add_argument("--event-rate", type=float, default=None,
                   help="events per second of EVENT time (default: --rate, or 1000 if 0)")
    m.add_argument("--start", type=float, default=None,
                   help="event time (Unix s) of the first event (default: now)")
    m.add_argument("--delay", type=float, default=5.0,
                   help="seconds of event time from a prediction to its outcome (default 5)")
    m.add_argument("--jitter", type=float, default=0.5,
                   help="delay jitter: delay * (1 + jitter * U(-1, 1)), in [0, 1) (default 0.5)")
    m.add_argument("--T", type=float, default=0.3, help="true q = softmax(T log f); T < 1 is "
                                                        "overconfident (default 0.3)")
    m.add_argument("--scale", type=float, default=5.0, help="logit scale (default 5)")
    m.add_argument("--skew", type=float, default=0.0, help="logit skew (default 0)")
    m.add_argument("--orphan-frac", type=float, default=0.0,
                   help="fraction of predictions whose outcome never arrives")
    m.add_argument("--sample-frac", type=float, default=0.0,
                   help="fraction of complete samples (probs and label in one event)")
    m.add_argument("--logits-frac", type=float, default=0.0,
                   help="fraction of vectors sent as logits instead of probs")
    m.add_argument("--malformed-frac", type=float, default=0.0,
                   help="fraction of malformed events (dead-letter demo)")
    m.add_argument("--malformed-kinds", type=_kinds_arg, default=None,
                   help="comma-separated subset of " + ",".join(MALFORMED_KINDS) + " (default all)")
    m.add_argument("--drift-after", type=int, default=None,
                   help="after this many events switch every model's T to --drift-T")
    m.add_argument("--drift-T", type=float, default=None)
    m.add_argument("--decimals", type=int, default=None,
                   help="round probabilities to this many decimals (default: full precision)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--run-id", default=None,
                   help="part of every event id (MODEL-RUN-N), so that runs never repeat an "
                        "id (default: 8 random hex digits per run; '' for MODEL-N)")
    m.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def _resolve(a: argparse.Namespace) -> dict[str, Any]:
    """Kafka options: explicit flags > --config's [kafka] section > built-in defaults."""
    kafka = None
    if a.config:
        from daemon.settings import SettingsError, load_settings

        try:
            kafka = load_settings(a.config).kafka
        except SettingsError as e:
            raise InputError(f"--config {a.config}: {e}") from None
    topics = kafka.topics if kafka is not None else None
    preds = a.predictions_topic or (topics.predictions if topics else "lpcal.predictions")
    outs = a.outcomes_topic or (topics.outcomes if topics else "lpcal.outcomes")
    idem = a.idempotence if a.idempotence is not None else (
        kafka.enable_idempotence if kafka is not None else True)
    parts = a.partitions if a.partitions is not None else (
        kafka.topic_partitions if kafka is not None else 1)
    if parts < 1:
        raise InputError(f"--partitions must be >= 1, got {parts}")
    return {
        "bootstrap": a.bootstrap or (kafka.bootstrap_servers if kafka else "localhost:9092"),
        "topics": {PREDICTIONS: a.topic_prefix + preds, OUTCOMES: a.topic_prefix + outs},
        "idempotence": bool(idem), "partitions": int(parts), "security": kafka,
    }


def default_events(a: argparse.Namespace) -> tuple[int, str]:
    """``--events`` when it is not given, and where the settings it was sized for came from:
    :func:`events_for_binmap` of the models under the daemon settings ``lpcal serve`` would
    read here (``--config``, else ``$LPCAL_CONFIG`` or ``config/lpcal.toml``, and the
    ``LPCAL_*`` environment), or under the built-in defaults when those cannot be read."""
    from daemon.settings import ModelSettings, SettingsError, load_settings

    for name in ("orphan_frac", "sample_frac", "malformed_frac"):  # the generator's messages
        _check_frac(name, getattr(a, name))
    try:
        settings = load_settings(a.config)
    except SettingsError as e:
        if a.config:
            raise InputError(f"--config {a.config}: {e}") from None
        settings = None
    if settings is None:
        where = "the built-in daemon defaults (the settings here do not load)"
        per_model = [ModelSettings() for _ in a.models]
    else:
        source = a.config or os.environ.get("LPCAL_CONFIG") or (
            "config/lpcal.toml" if Path("config/lpcal.toml").is_file() else None)
        where = (f"the daemon settings of {source}" if source
                 else "the built-in daemon defaults")
        per_model = [settings.model_settings(name) or settings.defaults for name, _ in a.models]
    keep = 1.0 - a.malformed_frac - a.orphan_frac * (1.0 - a.malformed_frac - a.sample_frac)
    if not keep > 0:
        raise InputError("--events is required when no event becomes a joined sample "
                         "(--orphan-frac / --malformed-frac)")
    ks = [k if k is not None else a.k for _, k in a.models]
    return events_for_binmap(per_model, ks, keep=keep), where


def generator_from_args(a: argparse.Namespace) -> TrafficGenerator:
    """The :class:`TrafficGenerator` the CLI arguments describe (model ``i`` gets seed
    ``[seed, i]``; ``--events`` unset: :func:`default_events`; ``--run-id`` unset: ids
    without a run part, :func:`main` draws a random one per run)."""
    models = [SyntheticModel(name, k if k is not None else a.k, a.T, a.scale, a.skew,
                             seed=[a.seed, i]) for i, (name, k) in enumerate(a.models)]
    if a.rate < 0 or not math.isfinite(a.rate):
        raise InputError(f"--rate must be >= 0, got {a.rate}")
    if a.events is None:
        a.events = default_events(a)[0]
    event_rate = a.event_rate if a.event_rate is not None else (a.rate if a.rate > 0 else 1000.0)
    return TrafficGenerator(
        models, a.events, event_rate=event_rate,
        start=a.start if a.start is not None else time.time(), delay=a.delay, jitter=a.jitter,
        orphan_frac=a.orphan_frac, sample_frac=a.sample_frac, logits_frac=a.logits_frac,
        malformed_frac=a.malformed_frac, malformed_kinds=a.malformed_kinds,
        drift_after=a.drift_after, drift_T=a.drift_T, seed=a.seed, decimals=a.decimals,
        run_id=getattr(a, "run_id", None))


def main(argv: list[str] | None = None) -> int:
    """``lpcal simulate ARGS``; exit codes: 0 done, 2 bad arguments, 1 Kafka or other errors,
    130 interrupted."""
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    if a.run_id is None:  # every run its own ids: a second run never repeats the first's
        a.run_id = secrets.token_hex(4)
    sized = None
    try:
        if a.events is None:
            a.events, sized = default_events(a)
        gen = generator_from_args(a)
        kw = _resolve(a)
    except LpcalError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 2
    say = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if say:
        ids = f"{gen.models[0].model_id}-{a.run_id}-0, ..." if a.run_id else "MODEL-N"
        say(f"simulate: {len(gen.models)} model(s) "
            f"{', '.join(f'{m.model_id} (k={m.k})' for m in gen.models)}, {gen.events} events"
            + (f" (enough for one bin map of each model under {sized})" if sized else "")
            + f", ids {ids} -> {kw['bootstrap']} {kw['topics'][PREDICTIONS]} / "
            f"{kw['topics'][OUTCOMES]}")
    from aiokafka.errors import KafkaError

    from daemon.kafka_io import BrokerSettingsError, TopicLayoutError

    try:
        report = asyncio.run(simulate(
            kw["bootstrap"], kw["topics"], gen, rate=a.rate, idempotence=kw["idempotence"],
            partitions=kw["partitions"], create_topics=not a.no_create_topics,
            security=kw["security"], progress=say))
    except KeyboardInterrupt:
        print(f"lpcal simulate: interrupted after {gen.produced} events", file=sys.stderr)
        return 130
    except LpcalError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 2
    except BrokerSettingsError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 1
    except (KafkaError, TopicLayoutError, OSError, TimeoutError) as e:
        print(f"lpcal simulate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
