"""Join predictions and outcomes by (model, id) into labelled samples. Pure and deterministic.

A prediction (probability row) and an outcome (label) with the same ``(model, id)`` make a sample,
whichever arrives first; a complete sample event passes straight through. The first half to
arrive waits in a per-model *pending* buffer, bounded two ways:

* capacity: at most ``max_pending_per_model`` pending events; beyond it the oldest is evicted
  (``evictions["capacity"]``);
* TTL: an event pending for more than ``ttl_seconds`` of the store's clock is evicted
  (``evictions["ttl"]``). An outcome evicted by TTL is also an ``orphan`` (its prediction never
  arrived).

The clock never reads the wall time. By default it is an *event-time watermark*: the smaller of
the largest ``ts`` seen on the prediction stream and the largest ``ts`` seen on the outcome stream
(a complete sample advances both). So when one input topic is read ahead of the other (a backlog
after downtime, a slow partition), pairs whose partner is still unread do not expire; and the
result does not depend on how events were batched, so a replay after a crash joins exactly the
same samples. A pending event expires once the watermark passes ``max(watermark, ts) + ttl`` as
of its arrival. With an explicit ``now`` per call, the clock is ``now`` instead. While one stream
is idle the watermark stands still, and only the capacity bound evicts.

*Memory* is bounded in bytes as well, when the store has a budget (``max_bytes``; the daemon
gives each model a share of ``join.max_bytes_total``, see :meth:`JoinStore.set_budget`). The
budget lowers both count bounds by one factor, from a per-entry cost that is an upper bound of
what an entry holds (measured with ``tracemalloc`` in ``tests/daemon/test_join_budget.py``):

* a pending event: :data:`PENDING_ENTRY_BYTES` + its id (``sys.getsizeof``, the largest id of
  the model so far) + ``2 * 8 k`` for its probability row: rows live in per-batch blocks that
  stay allocated while any of their rows is pending, and the blocks of a model are compacted
  into one (:meth:`JoinStore._compact_rows`, amortised O(1) per row) whenever they hold more
  than twice the rows that could still be pending;
* a recent id: :data:`RECENT_ENTRY_BYTES` + its id.

A larger id or a wider row than seen before lowers the bounds at once, and the oldest entries
beyond them are evicted (``evictions["capacity"]``). :meth:`JoinStore.memory_bytes` is the
estimate the bounds keep under the budget.

Ids that were joined or expired are remembered in a bounded *recent* set (``recent_per_model``,
oldest forgotten first) to classify stragglers:

==================================================  =========================================
event                                               counted as (event dropped)
==================================================  =========================================
prediction/outcome for an id pending as the same    ``unmatched["duplicate"]``
kind, or prediction/sample for a recently joined id
outcome for an id recently joined or expired,       ``unmatched["late"]``
or prediction for a recently expired id
a pending outcome expires by TTL                    ``unmatched["orphan"]`` (+ eviction ttl)
==================================================  =========================================

Usage::

    store = JoinStore(max_pending_per_model=100_000, ttl_seconds=3600)
    res = store.offer("fraud-v3", kind, ids, ts, probs, labels)   # columnar, e.g. a ModelBatch
    res.probs, res.labels, res.ids, res.ts                          # the joined samples, in order
    res.evicted, res.unmatched                                      # counts caused by this call
    snap = store.to_dict(); store2 = JoinStore.from_dict(snap)      # exact round trip
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from daemon import native
from daemon.codes import (
    E_DEADLINE,
    E_ID,
    E_KIND,
    E_PAYLOAD,
    E_TS,
    EXPIRED,
    JOINED,
    KIND_DEAD,
    KIND_OUTCOME,
    KIND_PREDICTION,
    KIND_SAMPLE,
)
from daemon.join_loop import (
    EVICTION_REASONS,
    UNMATCHED_KINDS,
    _ModelJoin,
    _zero,
    expire,
    hashed_dict,
    remember,
)
from lpcal.errors import InputError

__all__ = ["KIND_OUTCOME", "KIND_PREDICTION", "KIND_SAMPLE", "JoinResult", "JoinStore"]

#: bytes per pending entry besides its id and row: the entry list, its floats, its dict and
#: deque slots, the (block, row) tuple (measured: ~290 on CPython 3.11, x86-64, about 16 more
#: with the hashes a :func:`daemon.join_loop.hashed_dict` keeps), plus one
#: joined entry that ``queue`` may still hold (up to one per pending entry + 1024, ~150 each)
PENDING_ENTRY_BYTES = 448
#: bytes per recent id besides the id itself: its dict slot and deque slot (measured: ~75, and
#: up to 16 more with the hash its :func:`daemon.join_loop.hashed_dict` keeps)
RECENT_ENTRY_BYTES = 128
#: row-block bytes tolerated beyond twice the live rows before the blocks are compacted
ROW_SLACK_BYTES = 256 * 1024
MAX_ROW_WIDTH = 1 << 20  # sanity bound of a snapshot's k (the daemon's max_k is far lower)
_getsizeof = sys.getsizeof
#: ``sys.getsizeof`` of an ASCII str of length ``n`` is ``_ASCII_STR_BYTES + n`` (CPython's
#: compact ASCII strings: a fixed header and the terminator; tested)
_ASCII_STR_BYTES = sys.getsizeof("")
_isascii = str.isascii
_F64 = np.dtype(np.float64)
if EVICTION_REASONS != ("ttl", "capacity") or UNMATCHED_KINDS != ("late", "duplicate",
                                                                 "orphan"):
    raise ImportError("daemon.join builds the counters of an offer as literals of "
                      "EVICTION_REASONS and UNMATCHED_KINDS, in this order")


def largest_str_bytes(ids: Sequence[str]) -> int:
    """``max(map(sys.getsizeof, ids))`` of a non-empty sequence of str: from the longest
    length when every id is ASCII (``str.isascii`` reads a flag, ``len`` a field: a fifth of
    the cost of sizing every id), sized one by one otherwise."""
    if all(map(_isascii, ids)):
        return _ASCII_STR_BYTES + max(map(len, ids))
    return max(map(_getsizeof, ids))


@dataclass
class JoinResult:
    """Samples completed by one :meth:`JoinStore.offer` call, and what it evicted/dropped."""

    ids: list[str]
    ts: np.ndarray          # completion time: max(ts of prediction, ts of outcome)
    probs: np.ndarray       # (n, k)
    labels: np.ndarray      # (n,) int64
    evicted: dict[str, int] = field(default_factory=lambda: _zero(EVICTION_REASONS))
    unmatched: dict[str, int] = field(default_factory=lambda: _zero(UNMATCHED_KINDS))

    def __len__(self) -> int:
        return len(self.ids)


class JoinStore:
    """Bounded, TTL-expiring join buffer keyed by ``(model, id)``; see the module docstring."""

    def __init__(self, max_pending_per_model: int, ttl_seconds: float,
                 recent_per_model: int | None = None, max_bytes: int | None = None):
        if int(max_pending_per_model) < 1:
            raise InputError(f"max_pending_per_model must be >= 1, got {max_pending_per_model}")
        if not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
            raise InputError(f"ttl_seconds must be a positive finite number, got {ttl_seconds}")
        self.max_pending = int(max_pending_per_model)
        self.ttl = float(ttl_seconds)
        self.max_recent = int(recent_per_model if recent_per_model is not None
                              else max_pending_per_model)
        if self.max_recent < 0:
            raise InputError("recent_per_model must be >= 0")
        self.clock = -math.inf
        self.wm = [-math.inf, -math.inf]  # largest ts seen: predictions, outcomes
        self._models: dict[str, _ModelJoin] = {}
        #: byte budget of each model's pending and recent entries (None: counts only)
        self.max_bytes: int | None = None
        self.set_budget(max_bytes)

    # ---------------------------------------------------------------- reading
    def models(self) -> list[str]:
        return list(self._models)

    def pending(self, model: str | None = None) -> int:
        """Number of pending (half-joined) events, of one model or all."""
        if model is not None:
            m = self._models.get(model)
            return 0 if m is None else len(m.pending)
        return sum(len(m.pending) for m in self._models.values())

    def pressure(self, model: str) -> tuple[float, int | None]:
        """``(pending events / their bound in force, leading stream)`` of ``model``: how full
        its buffer is, and which stream was read further ahead in event time, 0 predictions or
        1 outcomes (None: neither), whose events are the ones waiting
        (:mod:`daemon.alignment`)."""
        m = self._models.get(model)
        if m is None:
            return 0.0, None
        p, o = self.wm
        return len(m.pending) / m.cap_pending, (0 if p > o else 1 if o > p else None)

    def stats(self, model: str) -> dict[str, Any]:
        """Cumulative counters of ``model``: joined, pending, evicted{...}, unmatched{...}."""
        m = self._models.get(model) or _ModelJoin()
        return {"joined": m.joined, "pending": len(m.pending), "evicted": dict(m.evicted),
                "unmatched": dict(m.unmatched)}

    def _model(self, model: str) -> _ModelJoin:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _ModelJoin(self.max_pending, self.max_recent)
            self._set_caps(m)
        return m

    # ---------------------------------------------------------------- byte budget
    def _costs(self, m: _ModelJoin) -> tuple[int, int]:
        """Upper bounds of the bytes of one pending entry and one recent id of ``m``."""
        return (PENDING_ENTRY_BYTES + m.id_bytes + 16 * m.k,
                RECENT_ENTRY_BYTES + m.id_bytes)

    def _set_caps(self, m: _ModelJoin) -> None:
        """Lower ``m``'s count bounds so that full buffers stay within ``max_bytes``."""
        if self.max_bytes is None:
            m.cap_pending, m.cap_recent = self.max_pending, self.max_recent
            return
        pend, rec = self._costs(m)
        full = self.max_pending * pend + self.max_recent * rec
        room = max(self.max_bytes - ROW_SLACK_BYTES, 0)
        f = min(1.0, room / full)
        m.cap_pending = max(1, min(self.max_pending, int(self.max_pending * f)))
        m.cap_recent = min(self.max_recent, int(self.max_recent * f))

    def _trim(self, m: _ModelJoin) -> int:
        """Evict the oldest pending entries and forget the oldest recent ids beyond ``m``'s
        bounds (after the bounds were lowered); returns the number of evictions."""
        n = 0
        while len(m.pending) > m.cap_pending:
            eid, _kind = m.pop_oldest()
            n += 1
            self._remember(m, eid, EXPIRED)
        order, rec = m.recent_order, m.recent
        while len(order) > m.cap_recent:
            del rec[order.popleft()]
        if n:
            m.evicted["capacity"] += n
            m.compact()
            self._maybe_compact_rows(m)
        return n

    def _observe(self, m: _ModelJoin, ids: Sequence[str], probs: np.ndarray | None) -> int:
        """Note the largest id and the row width of a batch; when either is new, lower the
        bounds and trim (returns the evictions). Ids are sized only under a budget."""
        sz = largest_str_bytes(ids) if self.max_bytes is not None and len(ids) else 0
        k = probs.shape[1] if probs is not None else 0
        if sz <= m.id_bytes and k <= m.k:
            return 0
        m.id_bytes, m.k = max(sz, m.id_bytes), max(k, m.k)
        self._set_caps(m)
        return self._trim(m)

    def set_budget(self, max_bytes: int | None) -> int:
        """Set the byte budget of each model (None: none) and trim to it; returns the number
        of pending events evicted (counted as ``capacity`` evictions)."""
        if max_bytes is not None and int(max_bytes) < 1:
            raise InputError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        n = 0
        for m in self._models.values():
            self._set_caps(m)
            n += self._trim(m)
        return n

    def capacity(self, model: str) -> tuple[int, int]:
        """``(pending, recent)`` count bounds in force for ``model``."""
        m = self._models.get(model)
        if m is None:
            return self.max_pending, self.max_recent
        return m.cap_pending, m.cap_recent

    def memory_bytes(self, model: str | None = None) -> int:
        """Estimated bytes held by the pending and recent entries of one model or all: the
        per-entry costs of the module docstring, with the row blocks counted exactly."""
        if model is None:
            ms = list(self._models.values())
        else:
            ms = [self._models[model]] if model in self._models else []
        total = 0
        for m in ms:
            pend, rec = self._costs(m)
            total += (len(m.pending) * (pend - 16 * m.k) + m.rows.nbytes
                      + len(m.recent_order) * rec)
        return total

    def _maybe_compact_rows(self, m: _ModelJoin) -> None:
        if m.rows.nbytes > 16 * m.k * len(m.pending) + ROW_SLACK_BYTES:
            self._compact_rows(m)

    def _compact_rows(self, m: _ModelJoin) -> None:
        """Copy the rows of ``m``'s pending predictions into one block, releasing the blocks
        that held them together with rows that left. O(pending + k * predictions pending);
        run only when the blocks hold more than twice the rows that could be pending, so
        amortised O(k) per row that left."""
        m.queue = deque(e for e in m.queue if e[E_KIND] != KIND_DEAD)  # joined ones keep rows
        entries = [e for e in m.pending.values() if e[E_KIND] == KIND_PREDICTION]
        if not entries:
            return
        block = _gather_rows([e[E_PAYLOAD] for e in entries], m.k)
        m.rows.track(block)
        for r, e in enumerate(entries):
            e[E_PAYLOAD] = (block, r)

    # ---------------------------------------------------------------- expiry
    def _expire(self, m: _ModelJoin, clock: float, ev: dict, um: dict) -> None:
        expire(m, clock, ev, um)

    def _remember(self, m: _ModelJoin, eid: str, state: int) -> None:
        remember(m, eid, state)

    def advance(self, now: float) -> JoinResult:
        """Move the clock to ``now`` (if later) and expire what the TTL allows, in every model."""
        if now > self.clock:
            self.clock = float(now)
        res = _empty_result()
        for m in self._models.values():
            ev, um = _zero(EVICTION_REASONS), _zero(UNMATCHED_KINDS)
            self._expire(m, self.clock, ev, um)
            m.compact()
            _acc(m, ev, um)
            _acc_result(res, ev, um)
        return res

    def bound_clock(self, limit: float) -> bool:
        """Pull every clock of the store back to at most ``limit`` (a largest event time the
        input allows; see ``max_ts_skew_seconds``): the clock, both watermarks, and the ts and
        TTL deadline of pending entries (deadlines to at most ``limit + ttl``, which keeps
        them in arrival order). Repairs a state (e.g. an old checkpoint) poisoned by an event
        far in the future. Returns whether anything was beyond."""
        if not max(self.clock, self.wm[0], self.wm[1]) > limit:
            return False
        self.clock = min(self.clock, limit)
        self.wm = [min(w, limit) for w in self.wm]
        dl_max = limit + self.ttl
        for m in self._models.values():
            for e in m.queue:
                if e[E_KIND] != KIND_DEAD:
                    e[E_TS] = min(e[E_TS], limit)
                    e[E_DEADLINE] = min(e[E_DEADLINE], dl_max)
        return True

    # ---------------------------------------------------------------- joining
    def offer(self, model: str, kind: Sequence[int], ids: Sequence[str], ts: Sequence[float],
              probs: np.ndarray | None, labels: Sequence[int], now: float | None = None
              ) -> JoinResult:
        """Offer one model's events, in arrival order; return the samples they complete.

        ``kind[i]`` is KIND_PREDICTION (row ``probs[i]``), KIND_OUTCOME (``labels[i]``) or
        KIND_SAMPLE (both). ``now=None``: event time (the clock follows each ``ts[i]``);
        otherwise the clock moves to ``now`` first and ignores ``ts`` for expiry.
        """
        m = self._model(model)
        kind_l = kind.tolist() if isinstance(kind, np.ndarray) else list(kind)
        ts_l = ts.tolist() if isinstance(ts, np.ndarray) else [float(t) for t in ts]
        lab_l = labels.tolist() if isinstance(labels, np.ndarray) else list(labels)
        n = len(kind_l)
        if not (len(ids) == len(ts_l) == len(lab_l) == n):
            raise InputError(f"offer: kind/ids/ts/labels lengths differ "
                             f"({n}, {len(ids)}, {len(ts_l)}, {len(lab_l)})")
        if probs is not None and (probs.ndim != 2 or probs.shape[0] != n):
            raise InputError(f"offer: probs must have shape ({n}, k), got {probs.shape}")
        if now is not None and now > self.clock:
            self.clock = float(now)
        trimmed = self._observe(m, ids, probs)
        res = self._offer(m, kind_l, ids, ts_l, probs, lab_l, now is None)
        if trimmed:
            res.evicted["capacity"] += trimmed
        self._maybe_compact_rows(m)
        return res

    def _offer(self, m: _ModelJoin, kind_l: list, ids: Sequence[str], ts_l: list,
               probs: np.ndarray | None, lab_l: list, event_time: bool) -> JoinResult:
        """The event loop of :meth:`offer`, ``daemon.native.KERNELS.offer_loop``: the C kernel
        or its reference :func:`daemon.join_loop.offer_loop` (one signature, one result)."""
        (clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx, p_groups, live_e,
         live_r) = native.KERNELS.offer_loop(
            m, self.ttl, event_time, self.clock, self.wm[0], self.wm[1], kind_l,
            ids if type(ids) is list else list(ids), ts_l, lab_l)
        self.clock = clock
        self.wm = [wm0, wm1]
        # literals, not dict(zip(...)): a quarter of the cost, paid at every offer (the key
        # order is checked against EVICTION_REASONS and UNMATCHED_KINDS at import)
        ttl, capacity, late, duplicate, orphan = counts
        ev = {"ttl": ttl, "capacity": capacity}
        um = {"late": late, "duplicate": duplicate, "orphan": orphan}
        return self._finish_offer(m, probs, out_ids, out_ts, out_lab, b_out, b_idx, p_groups,
                                  live_e, live_r, ev, um)

    def _finish_offer(self, m: _ModelJoin, probs: np.ndarray | None, out_ids: list[str],
                      out_ts: Sequence[float], out_lab: Sequence[int], b_out: Sequence[int],
                      b_idx: Sequence[int], p_groups: Sequence[Sequence[Any]],
                      live_e: list[list], live_r: Sequence[int], ev: dict, um: dict
                      ) -> JoinResult:
        """After the event loop: gather the joined rows (``out[b_out] = probs[b_idx]`` from this
        batch, ``out[js] = block[rs]`` for each ``(block, js, rs)`` of ``p_groups`` from earlier
        batches) and copy the rows ``live_r`` of the predictions still pending (entries
        ``live_e``) into one compact block. Index sequences: lists or int64 arrays."""
        n = len(out_ids)
        if p_groups:
            k = p_groups[0][0].shape[1]
        else:
            k = probs.shape[1] if probs is not None else 0
        # ``a.take(i, axis=0)``, not ``a[i]``: the same rows (a new array), at a quarter of
        # the cost of fancy indexing on the few rows of a small offer
        if n and len(p_groups) == 1 and len(p_groups[0][1]) == n and p_groups[0][0].dtype == _F64:
            # every row from one earlier block (positions pushed in order: js is 0..n-1)
            rows = p_groups[0][0].take(p_groups[0][2], axis=0)
        elif n and len(b_out) == n and probs.dtype == _F64:  # type: ignore[union-attr]
            rows = probs.take(b_idx, axis=0)  # type: ignore[union-attr]
        else:
            rows = np.empty((n, k), dtype=np.float64)
            if len(b_out):
                rows[b_out] = probs[b_idx]  # type: ignore[index]
            for blk, js, rs in p_groups:
                rows[js] = blk[rs]
        if live_e:
            block = probs.take(live_r, axis=0)  # type: ignore[union-attr]  # a copy
            m.rows.track(block)
            native.KERNELS.attach_rows(live_e, block)
        m.joined += n
        m.compact()
        if any(ev.values()) or any(um.values()):
            _acc(m, ev, um)
        return JoinResult(out_ids, np.asarray(out_ts, dtype=np.float64), rows,
                          np.asarray(out_lab, dtype=np.int64), ev, um)

    def offer_batch(self, mb: Any, now: float | None = None) -> JoinResult:
        """:meth:`offer` for a :class:`daemon.events.ModelBatch`."""
        return self.offer(mb.model, mb.kind, mb.ids, mb.ts, mb.probs, mb.labels, now)

    # ---------------------------------------------------------------- snapshots
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot; :meth:`from_dict` restores an equal store. The rows of a
        model's pending predictions are one base64 string of little-endian float64
        (``pending_rows``, row-major, in pending order; their entries hold ``None``): exact,
        and about 1.3 bytes of JSON per byte of row instead of about 2.5 as decimal text."""
        models = {}
        for name, m in self._models.items():
            pend, srcs = [], []
            for eid, e in m.pending.items():
                kd, deadline, t, payload = e[E_KIND], e[E_DEADLINE], e[E_TS], e[E_PAYLOAD]
                if kd == KIND_PREDICTION:
                    srcs.append(payload)
                    pend.append([eid, kd, deadline, t, None])
                else:
                    pend.append([eid, kd, deadline, t, int(payload)])
            rows = _gather_rows(srcs, m.k)
            order = list(m.recent_order)
            states = np.fromiter(map(m.recent.__getitem__, order), dtype=np.int8,
                                 count=len(order))
            models[name] = {
                "pending": pend,
                "k": int(rows.shape[1]) if srcs else 0,
                "pending_rows": base64.b64encode(rows.astype("<f8", copy=False).tobytes()
                                                 ).decode("ascii"),
                "recent_ids": order,
                "recent_expired": np.flatnonzero(states == EXPIRED).tolist(),
                "evicted": dict(m.evicted),
                "unmatched": dict(m.unmatched),
                "joined": m.joined,
            }
        return {"max_pending": self.max_pending, "ttl": self.ttl, "max_recent": self.max_recent,
                "max_bytes": self.max_bytes,
                "clock": None if math.isinf(self.clock) else self.clock,
                "watermarks": [None if math.isinf(w) else w for w in self.wm], "models": models}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "join store") -> JoinStore:
        try:
            mb = d.get("max_bytes")
            store = cls(int(d["max_pending"]), float(d["ttl"]), int(d["max_recent"]),
                        None if mb is None else int(mb))
            clock = d["clock"]
            store.clock = -math.inf if clock is None else float(clock)
            wms = d.get("watermarks", [clock, clock])
            store.wm = [-math.inf if w is None else float(w) for w in wms][:2]
            for name, md in dict(d["models"]).items():
                m = store._model(str(name))
                packed = md.get("pending_rows")
                k = int(md.get("k", 0))
                if packed is not None:
                    if type(packed) is not str or not 0 <= k <= MAX_ROW_WIDTH:
                        raise ValueError("pending_rows must be a string, k an int in range")
                    flat = np.frombuffer(base64.b64decode(packed, validate=True), dtype="<f8")
                    if k == 0 and flat.size or k and flat.size % k:
                        raise ValueError(f"pending_rows: {flat.size} values, not rows of {k}")
                    block = flat.reshape(-1, k) if k else np.empty((0, 0))
                entries = []
                rows = []
                for item in md["pending"]:
                    eid, kd, deadline, t, pl = item
                    if kd == KIND_PREDICTION:
                        if packed is None:  # snapshots before pending_rows: one list per row
                            row = np.asarray(pl, dtype=np.float64)
                            if row.ndim != 1:
                                raise ValueError(f"pending row of {eid!r} is not a vector")
                            rows.append(row)
                        payload: Any = len(entries)
                    elif kd == KIND_OUTCOME:
                        payload = int(pl)
                    else:
                        raise ValueError(f"pending kind {kd!r} of {eid!r}")
                    entry = [int(kd), float(deadline), float(t), payload, str(eid)]  # E_*
                    if entry[E_ID] in m.pending:
                        raise ValueError(f"pending id {eid!r} twice")
                    m.add(entry[E_ID], entry)
                    if kd == KIND_PREDICTION:
                        entries.append(entry)
                if packed is None and rows:
                    if len({r.shape for r in rows}) != 1:
                        raise ValueError("pending rows differ in length")
                    block = np.stack(rows)
                if entries:
                    if block.shape[0] != len(entries):
                        raise ValueError(f"{len(entries)} pending predictions but "
                                         f"{block.shape[0]} pending rows")
                    block = block.copy()  # owned and writable, released with its rows
                    m.rows.track(block)
                    m.k = max(m.k, block.shape[1])
                    for entry in entries:
                        entry[E_PAYLOAD] = (block, entry[E_PAYLOAD])
                _restore_recent(m, md)
                for key in EVICTION_REASONS:
                    m.evicted[key] = int(md["evicted"][key])
                for key in UNMATCHED_KINDS:
                    m.unmatched[key] = int(md["unmatched"][key])
                m.joined = int(md["joined"])
                ids = (*m.pending, *m.recent_order)
                m.id_bytes = largest_str_bytes(ids) if ids else 0
                store._set_caps(m)
                store._trim(m)
        except InputError:
            raise
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise InputError(f"{where}: malformed snapshot ({type(e).__name__}: {e})") from None
        return store

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JoinStore):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        return a == b


def _restore_recent(m: _ModelJoin, md: Mapping[str, Any]) -> None:
    """Fill ``m.recent`` from a snapshot: ``recent_ids`` (oldest first) with the positions of
    the expired ones in ``recent_expired``, or the ``recent`` ``[[id, state], ...]`` pairs of
    snapshots written before that (same content, one list object per id)."""
    if "recent_ids" in md:
        ids, expired = md["recent_ids"], md["recent_expired"]
        if type(ids) is not list or set(map(type, ids)) - {str}:
            raise ValueError("recent_ids must be a list of strings")
        if type(expired) is not list or set(map(type, expired)) - {int}:
            raise ValueError("recent_expired must be a list of integers")
        states = dict.fromkeys(ids, JOINED)
        if len(states) != len(ids):
            raise ValueError("a recent id is listed twice")
        if expired and not (0 <= min(expired) and max(expired) < len(ids)):
            raise ValueError("recent_expired position out of range")
        states.update(zip(map(ids.__getitem__, expired), repeat(EXPIRED)))
        # not m.recent.update(states): an empty dict updated from a dict copies its layout
        m.recent = hashed_dict({**m.recent, **states})
        m.recent_order.extend(ids)
        return
    for eid, st in md["recent"]:
        if st not in (JOINED, EXPIRED):
            raise ValueError(f"recent state {st!r}")
        if str(eid) in m.recent:
            raise ValueError(f"recent id {eid!r} listed twice")
        m.recent[str(eid)] = int(st)
        m.recent_order.append(str(eid))


def _gather_rows(srcs: list[tuple[np.ndarray, int]], k: int) -> np.ndarray:
    """Rows ``block[r]`` for ``(block, r)`` payloads, one gather per distinct block."""
    if not srcs:
        return np.empty((0, k), dtype=np.float64)
    rows = np.empty((len(srcs), srcs[0][0].shape[1]), dtype=np.float64)
    blocks, rr = zip(*srcs)
    r = np.array(rr, dtype=np.int64)
    keys = np.fromiter(map(id, blocks), dtype=np.int64, count=len(blocks))
    if (keys == keys[0]).all():  # common: one block
        rows[:] = blocks[0][r]
        return rows
    _, pos, inv = np.unique(keys, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    for g, p in enumerate(pos.tolist()):
        sel = np.flatnonzero(inv == g)
        rows[sel] = blocks[p][r[sel]]
    return rows


def _empty_result() -> JoinResult:
    return JoinResult([], np.zeros(0), np.zeros((0, 0)), np.zeros(0, dtype=np.int64))


def _acc(m: _ModelJoin, ev: dict, um: dict) -> None:
    for key, v in ev.items():
        m.evicted[key] += v
    for key, v in um.items():
        m.unmatched[key] += v


def _acc_result(res: JoinResult, ev: dict, um: dict) -> None:
    for key, v in ev.items():
        res.evicted[key] += v
    for key, v in um.items():
        res.unmatched[key] += v
