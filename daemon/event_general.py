"""The general per-message path of :meth:`daemon.events.EventParser.parse_batch`. Pure: no I/O.

Every message is decoded with orjson and checked field by field, in the order of the reasons in
:mod:`daemon.events` (size, encoding, JSON, schema, model admission, vector length, label
range), and becomes an :class:`~daemon.event_records.Invalid` with its own reason and detail, or
a row of its model's accumulator (:class:`_Acc`). This is the path that learns a model's ``k``
from its first vector and that admits models one by one under ``max_models``. Each model's
vectors are then validated together with numpy by the same code as the columnar fast path
(:func:`daemon.event_columnar.finish_columns`), so both paths produce the same records.

It runs for any batch that the fast path (:mod:`daemon.event_columnar`) declines: a batch with
any unusual event. Its cost is a Python loop over the messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import orjson

from daemon.codes import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE  # defined there, once
from daemon.event_columnar import finish_columns
from daemon.event_policies import ModelPolicies
from daemon.event_records import (
    BAD_ENCODING,
    BAD_JSON,
    BAD_SCHEMA,
    K_TOO_LARGE,
    LABEL_OUT_OF_RANGE,
    OVERSIZE,
    UNKNOWN_MODEL,
    WRONG_LENGTH,
    Invalid,
    ModelBatch,
    ModelPolicy,
    ParsedBatch,
)

__all__ = ["parse_general"]


def parse_general(raws: Sequence[bytes], timestamps: Sequence[float] | None,
                  policies: ModelPolicies, max_bytes: int, max_model_len: int, max_id_len: int,
                  max_k: int) -> ParsedBatch:
    """Parse every message on its own: each event gets its own verdict. Never raises.

    ``timestamps[i]``: the fallback ``ts`` of message ``i`` (None: no fallback). Models are
    admitted in order of first appearance (``policies.admit_new``), and a model without a
    configured ``k`` learns it from its first vector of 2..``max_k`` entries.
    """
    out = ParsedBatch(len(raws))
    invalid = out.invalid
    accs: dict[str, _Acc] = {}
    loads = orjson.loads
    max_id, max_model = max_id_len, max_model_len
    known_k = policies.k
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
            acc = _start_model(policies, model)
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
                if n > max_k:
                    invalid.append((i, Invalid(K_TOO_LARGE, f"vector of length {n}: k above "
                                               f"max_k={max_k}", model)))
                    continue
                if n < 2:
                    invalid.append((i, Invalid(WRONG_LENGTH, f"vector of length {n}: k must "
                                               f"be at least 2", model)))
                    continue
                k = acc.k = n
                known_k[model] = n
            elif n != k:
                invalid.append((i, Invalid(WRONG_LENGTH, f"vector of length {n}, model has "
                                           f"k={k}", model)))
                continue
        if label is not None:
            if type(label) is not int:
                invalid.append((i, Invalid(BAD_SCHEMA, "'label' must be an integer", model)))
                continue
            if label < 0 or label >= (k if k is not None else max_k):
                invalid.append((i, Invalid(LABEL_OUT_OF_RANGE, f"label {label} outside "
                                           f"[0, {k if k is not None else max_k})",
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
        mb = _finish_model(model, acc, invalid)
        if mb is not None:
            out.by_model[model] = mb
    if len(invalid) > 1:
        invalid.sort(key=lambda t: t[0])
    return out


class _Acc:
    """Per-model accumulator during one batch."""

    __slots__ = ("k", "policy", "rows", "vecs", "vmeta")

    def __init__(self, policy: ModelPolicy, k: int | None):
        self.policy, self.k = policy, k
        self.rows: list[tuple] = []     # (kind, id, ts, label or -1, input index)
        self.vecs: list[list] = []      # vectors of the events that have one
        self.vmeta: list[tuple] = []    # (position in rows, is_logits, needs strict check)


def _start_model(policies: ModelPolicies, model: str) -> _Acc | Invalid:
    """The accumulator of ``model``'s first event in a batch, or why it is rejected."""
    pol = policies.policy(model)
    if pol is None:
        return Invalid(UNKNOWN_MODEL, f"model {model[:64]!r} is not configured", model)
    if model not in policies.admitted and not policies.admit_new(model, pol):
        return Invalid(UNKNOWN_MODEL, f"model {model[:64]!r} not admitted: max_models="
                       f"{policies.max_models} reached", model)
    return _Acc(pol, policies.k.get(model))


def _finish_model(model: str, acc: _Acc, invalid: list) -> ModelBatch | None:
    """``model``'s accumulated rows as columns, validated by :func:`finish_columns`."""
    m = len(acc.rows)
    if m == 0:
        return None
    kind_t, ids_t, ts_t, lab_t, idx_t = zip(*acc.rows)
    kind = np.asarray(kind_t, dtype=np.int8)
    ts = np.asarray(ts_t, dtype=np.float64)
    labels = np.asarray(lab_t, dtype=np.int64)
    index = np.asarray(idx_t, dtype=np.int64)
    if acc.k is None:  # only outcomes so far: k unknown, labels were checked against MAX_K
        return finish_columns(model, acc.policy, 0, kind, list(ids_t), ts, labels,
                              index, [], None, None, (), invalid)
    vidx_t, logit_t, strict_t = zip(*acc.vmeta) if acc.vecs else ((), (), ())
    return finish_columns(model, acc.policy, acc.k, kind, list(ids_t), ts, labels,
                          index, acc.vecs, np.asarray(vidx_t, dtype=np.int64),
                          np.asarray(logit_t, dtype=bool), strict_t, invalid)


def _json_error(raw: bytes, e: Exception) -> Invalid:
    """Why ``raw`` is not JSON: not UTF-8 (and where), not bytes, or the decoder's message."""
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError as ue:
        return Invalid(BAD_ENCODING, f"not UTF-8 at byte {ue.start}")
    except TypeError:
        return Invalid(BAD_SCHEMA, f"message value is {type(raw).__name__}, not bytes")
    return Invalid(BAD_JSON, str(e)[:200])
