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

Layout: this module is the contract and the entry point. :class:`EventParser` owns the per-model
state (:class:`daemon.event_policies.ModelPolicies`: admission, policies, ``k``) and the limits;
:meth:`EventParser.parse_batch` first tries the columnar fast path
(:func:`daemon.event_columnar.parse_columnar`: every message parsed and its fields taken out in
one pass, a C kernel when :mod:`daemon.native` has it, the vectors validated per batch with
numpy). A batch with any unusual event goes through the general per-message path
(:func:`daemon.event_general.parse_general`), which gives every event its own verdict; both
produce the same records. ``parse_batch`` then applies the ``ts`` bound. The records and reasons
are defined in :mod:`daemon.event_records`.

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
from operator import attrgetter
from typing import Any

import numpy as np

from daemon.event_columnar import parse_columnar
from daemon.event_general import parse_general
from daemon.event_policies import ModelPolicies
from daemon.event_records import (  # defined there, once
    TS_OUT_OF_RANGE,
    Invalid,
    ModelPolicy,
    Outcome,
    ParsedBatch,
    Prediction,
    Sample,
)
from daemon.limits import MAX_ID_LEN, MAX_K, MAX_MODEL_LEN  # defined there, once

__all__ = ["EventParser", "RecordTimestamps", "reason_counts"]

_TIMESTAMP = attrgetter("timestamp")


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


class EventParser:
    """Stateful validator: knows each model's policy, learns unknown ``k``, bounds model count.

    ``policy_for(model)`` returns a :class:`ModelPolicy`, or None to reject the model as
    ``unknown_model``. ``max_models`` bounds how many distinct models are admitted (the first
    ones seen, plus those restored with :meth:`admit`). The per-model state is
    :attr:`policies` (:class:`daemon.event_policies.ModelPolicies`).
    """

    def __init__(self, policy_for: Callable[[str], ModelPolicy | None], *,
                 max_bytes: int = 1 << 20, max_models: int | None = None,
                 max_id_len: int = MAX_ID_LEN, max_model_len: int = MAX_MODEL_LEN,
                 max_ts_skew: float | None = None, max_k: int | None = None):
        #: admission, policies and ``k`` of every model seen
        self.policies = ModelPolicies(policy_for, max_models)
        #: events with ts > record timestamp + max_ts_skew are ``ts_out_of_range`` (None: off)
        self.max_ts_skew = None if max_ts_skew is None else float(max_ts_skew)
        self.max_bytes = int(max_bytes)
        self.max_id_len = int(max_id_len)
        self.max_model_len = int(max_model_len)
        self.max_k = MAX_K if max_k is None else int(max_k)

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
    @property
    def k(self) -> dict[str, int]:
        """Each model's ``k`` (configured, learned, or set with :meth:`set_k`)."""
        return self.policies.k

    @property
    def max_models(self) -> int | None:
        """At most this many models are admitted from the input (None: no bound)."""
        return self.policies.max_models

    @property
    def admitted(self) -> set[str]:
        """The admitted models."""
        return self.policies.admitted

    def admit(self, model: str, k: int | None = None) -> None:
        """Admit ``model`` (e.g. restored from a checkpoint), optionally with its learned ``k``."""
        self.policies.admit(model, k)

    def set_k(self, model: str, k: int) -> None:
        """Set ``model``'s learned ``k``; ``0`` (a state whose outcomes came first) is none."""
        self.policies.set_k(model, k)

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
        out = parse_columnar(raws, self.policies, self.max_bytes, self.max_model_len,
                             self.max_id_len)
        if out is None:
            out = parse_general(raws, timestamps, self.policies, self.max_bytes,
                                self.max_model_len, self.max_id_len, self.max_k)
        if self.max_ts_skew is not None and timestamps is not None and out.models:
            _bound_ts(out, timestamps, self.max_ts_skew)
        return out


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
    g = out.grouped
    if g is not None:  # the columns of many models: a few array passes in all
        lim = limit[g.index]
        bad = g.ts > lim
        if bad.any():
            codes = np.repeat(np.arange(len(g.models)), g.counts())
            for j in np.flatnonzero(bad).tolist():
                out.invalid.append((int(g.index[j]), Invalid(
                    TS_OUT_OF_RANGE, f"ts {float(g.ts[j]):.17g} is more than {skew:g} s after "
                    f"the record timestamp", g.models[int(codes[j])])))
            if len(out.invalid) > 1:
                out.invalid.sort(key=lambda t: t[0])
            keep = ~bad
            g = out.grouped = g.select(keep)
            if g is None:
                return
            lim = lim[keep]
        g.ts_limits = np.maximum.reduceat(lim, g.bounds[:-1])
        return
    mbs = list(out.by_model.values())
    if len(mbs) > 1 and all(map(len, mbs)):  # several models: a few array passes in all
        lim = limit[np.concatenate([mb.index for mb in mbs])]
        if not (np.concatenate([mb.ts for mb in mbs]) > lim).any():
            starts = np.zeros(len(mbs), dtype=np.int64)
            np.cumsum(np.fromiter(map(len, mbs), dtype=np.int64, count=len(mbs))[:-1],
                      out=starts[1:])
            for mb, top in zip(mbs, np.maximum.reduceat(lim, starts).tolist()):
                mb.ts_limit = top
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


def reason_counts(batch: ParsedBatch) -> Mapping[str, int]:
    """``{reason: count}`` of a batch's invalid events (for ``lpcal_events_invalid_total``)."""
    out: dict[str, int] = {}
    for _, bad in batch.invalid:
        out[bad.reason] = out.get(bad.reason, 0) + 1
    return out
