"""The columnar fast path of :meth:`daemon.events.EventParser.parse_batch`. Pure: no I/O.

A batch whose every message is a well-formed event of a model with a known ``k`` is parsed as
columns: :func:`daemon.native.KERNELS.scan <daemon.native.Kernels>` (a C kernel when :mod:`daemon.native` has it,
otherwise C-level ``map`` passes) parses every value and takes its fields out in one pass; the
vectors of each model become one float64 matrix, checked at once with numpy
(:func:`validate_rows`: non-finite, negative, not normalized, logits through softmax). Models
sharing one ``k`` and one policy are validated in a single pass over the whole batch and split
by model afterwards (:func:`_finish_grouped`). The cost is a few dozen array operations per
batch or per model, with no Python work per event other than the list of ids.

:func:`parse_columnar` returns None, with no state changed, for a batch it cannot take whole (an
unusual event anywhere: bad JSON, a missing field, a bool or a string in a vector, an unknown
``k``, a model rejected or over ``max_models``); the caller then runs the general per-message
path (:mod:`daemon.event_general`), which gives every event its own verdict. For the batches
accepted here both paths produce the same records, invalid events and parser state.

:func:`finish_columns` and :func:`validate_rows` are shared: the general path ends each model's
batch with them, so both paths apply the same vector checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np
import orjson

from daemon import native
from daemon.codes import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE  # defined there, once
from daemon.event_policies import ModelPolicies
from daemon.event_records import (
    BAD_SCHEMA,
    LABEL_OUT_OF_RANGE,
    NEGATIVE,
    NON_FINITE,
    NOT_NORMALIZED,
    GroupedBatch,
    Invalid,
    ModelBatch,
    ModelPolicy,
    ParsedBatch,
)
from lpcal.io import softmax_rows

__all__ = ["finish_columns", "parse_columnar", "validate_rows"]


def parse_columnar(raws: Sequence[bytes], policies: ModelPolicies, max_bytes: int,
                   max_model_len: int, max_id_len: int) -> ParsedBatch | None:
    """Parse a batch of well-formed events of known models, or return None.

    The per-message checks of the general loop are done over the whole batch:
    :attr:`daemon.native.Kernels.scan` (a C kernel, or C-level ``map`` passes) parses
    every value (bytes within ``max_bytes``) and takes out the fields if every event has
    the common shape; every model has a policy and a known ``k`` (admitted, or admissible
    under ``max_models``), every label is below its model's ``k`` and every vector has
    ``k`` numeric entries. The vectors of a model become one matrix, validated exactly as in
    the general path (:func:`validate_rows`). Returns None, with no state changed, when any
    condition fails; the caller then runs the general per-message loop, which produces the
    same result for the batches accepted here (models not admitted yet are admitted in order
    of first appearance, as it would). On success, ``policies`` records the models admitted
    and the policies looked up (:meth:`ModelPolicies.admit_all`)."""
    n = len(raws)
    if n == 0:
        return None
    # the C kernel parses, reads and drops one message at a time, so that the parsed batch is
    # never alive as a whole (as in a plain ``loads`` loop: its memory stays in cache)
    cols = native.KERNELS.scan(raws, max_model_len, max_id_len, orjson.loads, max_bytes)
    if cols is None:
        return None
    models = cols.models
    first = models[0]
    umodels = [first] if models.count(first) == n else list(dict.fromkeys(models))
    known_k, admitted = policies.k, policies.admitted
    ks, pols = [], []
    uncached, new_models = [], []  # committed only once the batch is accepted
    cached = policies.cached(umodels) if len(umodels) > 1 else None
    if cached is not None:  # every model admitted, its policy cached: no Python per model
        ks = list(map(known_k.get, umodels))
        if None in ks:
            ks = []
        else:
            pols = cached
    for model in () if pols else umodels:
        pol, cached = policies.peek(model)
        if not cached:  # cached (as admitted) once the batch is accepted
            uncached.append((model, pol))
        if pol is None:
            return None
        k = known_k.get(model)
        if k is None and pol.k is not None:
            k = int(pol.k)
        if k is None:
            return None
        if model not in admitted:
            new_models.append(model)
        ks.append(k)
        pols.append(pol)
    if new_models and not policies.has_room(len(new_models)):
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
        # one k and policy (most often the very same policy object): validate once
        p0 = pols[0]
        if len(set(ks)) == 1 and (pols.count(p0) == len(pols) or len(set(pols)) == 1):
            vall = np.flatnonzero(hv)
            mat = cols.matrix(vall, ks[0]) if vall.size else None
            if vall.size and mat is None:
                return None
            policies.admit_all(new_models, uncached)
            return _finish_grouped(cols, umodels, ks[0], pols[0], kind, order, bounds,
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
    policies.admit_all(new_models, uncached)
    out = ParsedBatch(n)
    ts = cols.ts
    for c, (model, sel, m_ids, mat) in enumerate(parts):
        mb = finish_columns(model, pols[c], ks[c], kind[sel], m_ids,
                                  ts[sel], labels[sel], sel, None,
                                  np.flatnonzero(hv[sel]), None, (), out.invalid, mat)
        if mb is not None:
            out.by_model[model] = mb
    if len(out.invalid) > 1:
        out.invalid.sort(key=lambda t: t[0])
    return out

def _finish_grouped(cols: Any, umodels: list[str], k: int, policy: ModelPolicy,
                    kind: np.ndarray, order: np.ndarray, bounds: list[int],
                    ordered_ids: list[str], vall: np.ndarray, mat: np.ndarray | None
                    ) -> ParsedBatch:
    """The end of :func:`parse_columnar` for a batch of several models sharing one ``k``
    and one policy: the vectors of the whole batch are validated in one pass
    (:func:`validate_rows`), the columns are put in model order once (``order``: a stable
    sort by model, ``bounds``: each model's range in it), and each model's
    :class:`ModelBatch` is slices of them, made only when read: the batch is one
    :class:`GroupedBatch` (``out.grouped``), which the ingest takes whole. The same records and invalid events as the
    per-model validation of :func:`finish_columns`, at a cost per batch instead of a few
    dozen array operations per model."""
    n = order.shape[0]
    out = ParsedBatch(n)
    models = cols.models
    reasons = {} if mat is None else validate_rows(
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
    g: GroupedBatch | None = GroupedBatch(list(umodels), k,
                                          np.asarray(bounds, dtype=np.int64), kind_s,
                                          ordered_ids, ts_s, probs, lab_s, order)
    if keep_s is not None:
        g = g.select(keep_s)
    out.grouped = g
    return out

def finish_columns(model: str, policy: ModelPolicy, k: int, kind: np.ndarray,
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
            reasons = validate_rows(rows, logit, ok, policy)
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

def _strict_row(v: list) -> bool:
    for x in v:
        t = type(x)
        if t is not float and t is not int:
            return False
    return True

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

def validate_rows(rows: np.ndarray, logit: np.ndarray, ok: np.ndarray, pol: ModelPolicy
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
            rows[li] = softmax_rows(rows[li])
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
