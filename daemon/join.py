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

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_not, itemgetter, setitem
from typing import Any

import numpy as np

from daemon.native import SPEEDUPS
from lpcal.errors import InputError

__all__ = ["KIND_OUTCOME", "KIND_PREDICTION", "KIND_SAMPLE", "JoinResult", "JoinStore"]

KIND_PREDICTION, KIND_OUTCOME, KIND_SAMPLE = 0, 1, 2  # same codes as daemon.events
_JOINED, _EXPIRED = 0, 1
EVICTION_REASONS = ("ttl", "capacity")
UNMATCHED_KINDS = ("late", "duplicate", "orphan")


_KIND, _TS, _PAYLOAD = itemgetter(0), itemgetter(2), itemgetter(3)  # of a pending entry
_DEAD = -1  # kind of an entry that left ``pending`` (joined) but may still sit in ``queue``
_COMPACT_SLACK = 1024


def _zero(keys: Iterable[str]) -> dict[str, int]:
    return {k: 0 for k in keys}


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


class _ModelJoin:
    """Pending + recent state of one model.

    ``pending[id] = [kind, deadline, ts, payload, id]`` with ``payload`` the label (outcomes) or
    ``(block, row)`` (predictions: row ``row`` of the 2-D array ``block``, a compact copy shared
    by the predictions of one batch). A plain dict keeps its entries in arrival order, which is
    deadline order; ``queue`` holds the same entries in the same order, for the oldest one in
    O(1): an entry that leaves ``pending`` by a join gets kind ``_DEAD`` and is dropped from
    ``queue`` once it reaches the front (or by :meth:`compact`). An OrderedDict did this at
    twice the cost per event (a linked node per entry)."""

    __slots__ = ("evicted", "joined", "pending", "queue", "recent", "recent_order", "unmatched")

    def __init__(self):
        self.pending: dict[str, list] = {}
        self.queue: deque[list] = deque()
        self.recent: dict[str, int] = {}          # id -> _JOINED | _EXPIRED
        self.recent_order: deque[str] = deque()   # ids of ``recent``, oldest first
        self.evicted = _zero(EVICTION_REASONS)
        self.unmatched = _zero(UNMATCHED_KINDS)
        self.joined = 0

    def oldest(self) -> list | None:
        """The oldest pending entry (dropping joined ones from the front of ``queue``)."""
        q = self.queue
        while q:
            e = q[0]
            if e[0] != _DEAD:
                return e
            q.popleft()
        return None

    def pop_oldest(self) -> tuple[str, int]:
        """Remove the oldest pending entry (``pending`` must not be empty); return its id and
        kind (the entry itself is marked ``_DEAD``)."""
        self.oldest()
        e = self.queue.popleft()
        del self.pending[e[4]]
        kind, e[0] = e[0], _DEAD
        return e[4], kind

    def add(self, eid: str, e: list) -> None:
        self.pending[eid] = e
        self.queue.append(e)

    def compact(self) -> None:
        """Drop joined entries from ``queue`` once they outnumber the pending ones (amortised
        O(1) per join: they pile up behind an old entry that waits long for its partner)."""
        q = self.queue
        if len(q) > 2 * len(self.pending) + _COMPACT_SLACK:
            self.queue = deque(compress(q, map(_DEAD.__ne__, map(_KIND, q))))


class JoinStore:
    """Bounded, TTL-expiring join buffer keyed by ``(model, id)``; see the module docstring."""

    def __init__(self, max_pending_per_model: int, ttl_seconds: float,
                 recent_per_model: int | None = None):
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

    # ---------------------------------------------------------------- reading
    def models(self) -> list[str]:
        return list(self._models)

    def pending(self, model: str | None = None) -> int:
        """Number of pending (half-joined) events, of one model or all."""
        if model is not None:
            m = self._models.get(model)
            return 0 if m is None else len(m.pending)
        return sum(len(m.pending) for m in self._models.values())

    def stats(self, model: str) -> dict[str, Any]:
        """Cumulative counters of ``model``: joined, pending, evicted{...}, unmatched{...}."""
        m = self._models.get(model) or _ModelJoin()
        return {"joined": m.joined, "pending": len(m.pending), "evicted": dict(m.evicted),
                "unmatched": dict(m.unmatched)}

    def _model(self, model: str) -> _ModelJoin:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _ModelJoin()
        return m

    # ---------------------------------------------------------------- expiry
    def _expire(self, m: _ModelJoin, clock: float, ev: dict, um: dict) -> None:
        while True:
            entry = m.oldest()
            if entry is None or entry[1] >= clock:
                break
            eid, kind = m.pop_oldest()
            ev["ttl"] += 1
            if kind == KIND_OUTCOME:
                um["orphan"] += 1
            self._remember(m, eid, _EXPIRED)

    def _remember(self, m: _ModelJoin, eid: str, state: int) -> None:
        """Remember ``eid`` (a re-remembered id keeps its place in the forgetting order)."""
        if self.max_recent == 0:
            return
        rec = m.recent
        if eid not in rec:
            order = m.recent_order
            order.append(eid)
            if len(order) > self.max_recent:
                del rec[order.popleft()]
        rec[eid] = state

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
        far in the future (issue 11, finding 5). Returns whether anything was beyond."""
        if not max(self.clock, self.wm[0], self.wm[1]) > limit:
            return False
        self.clock = min(self.clock, limit)
        self.wm = [min(w, limit) for w in self.wm]
        dl_max = limit + self.ttl
        for m in self._models.values():
            for e in m.queue:
                if e[0] != _DEAD:
                    e[2] = min(e[2], limit)
                    e[1] = min(e[1], dl_max)
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
        ev, um = _zero(EVICTION_REASONS), _zero(UNMATCHED_KINDS)
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
        if SPEEDUPS is not None:
            return self._offer_native(m, kind_l, ids, ts_l, probs, lab_l, now is None)
        fast = self._offer_uniform(m, kind, kind_l, ids, ts_l, probs, lab_l, now is None)
        if fast is not None:
            return fast
        event_time = now is None
        pend, recent, ttl, cap = m.pending, m.recent, self.ttl, self.max_pending
        # joined samples; their rows come from this batch (b_*) or from pending blocks (p_*)
        out_ids: list[str] = []
        out_ts: list[float] = []
        out_lab: list[int] = []
        b_out: list[int] = []
        b_idx: list[int] = []
        p_out: list[int] = []
        p_src: list[tuple[np.ndarray, int]] = []
        new_pending: list[tuple[list, int]] = []  # prediction entries whose row is in this batch
        clock = self.clock
        wm0, wm1 = self.wm
        remember = self._remember
        inf = math.inf
        # lower bound on the earliest pending deadline (deadlines are appended in order, and
        # removing entries can only raise the true minimum), so the check below is exact
        e0 = m.oldest()
        front = inf if e0 is None else e0[1]
        for i in range(n):
            t = ts_l[i]
            kd = kind_l[i]
            if event_time:
                if kd != KIND_OUTCOME and t > wm0:
                    wm0 = t
                if kd != KIND_PREDICTION and t > wm1:
                    wm1 = t
                c = wm0 if wm0 < wm1 else wm1
                if c > clock:
                    clock = c
            if front < clock:
                self.clock = clock
                self._expire(m, clock, ev, um)
                e0 = m.oldest()
                front = inf if e0 is None else e0[1]
            eid = ids[i]
            entry = pend.get(eid)
            if kd == KIND_SAMPLE:
                if entry is not None or eid in recent:
                    um["duplicate"] += 1
                    continue
                b_out.append(len(out_ids))
                b_idx.append(i)
                out_ids.append(eid)
                out_ts.append(t)
                out_lab.append(lab_l[i])
                remember(m, eid, _JOINED)
                continue
            if entry is not None:
                if entry[0] == kd:
                    um["duplicate"] += 1
                    continue
                del pend[eid]
                entry[0] = _DEAD
                if kd == KIND_PREDICTION:
                    b_out.append(len(out_ids))
                    b_idx.append(i)
                    out_lab.append(entry[3])
                else:
                    src = entry[3]
                    if type(src) is int:   # a prediction of this batch
                        b_out.append(len(out_ids))
                        b_idx.append(src)
                    else:
                        p_out.append(len(out_ids))
                        p_src.append(src)
                    out_lab.append(lab_l[i])
                out_ids.append(eid)
                out_ts.append(max(entry[2], t))
                remember(m, eid, _JOINED)
                continue
            state = recent.get(eid)
            if state is not None:
                if kd == KIND_OUTCOME or state == _EXPIRED:
                    um["late"] += 1
                else:
                    um["duplicate"] += 1
                continue
            deadline = ((clock if clock > t else t) if event_time else clock) + ttl
            if kd == KIND_PREDICTION:
                e = [kd, deadline, t, i, eid]
                new_pending.append((e, i))
            else:
                e = [kd, deadline, t, lab_l[i], eid]
            if not pend:
                front = e[1]
            m.add(eid, e)
            if len(pend) > cap:
                old_id, _kind = m.pop_oldest()
                ev["capacity"] += 1
                self._remember(m, old_id, _EXPIRED)
        self.clock = clock
        self.wm = [wm0, wm1]
        live = [(e, i) for e, i in new_pending if e[0] != _DEAD]
        groups: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
        for j, (blk, r) in zip(p_out, p_src):
            g = groups.get(id(blk))
            if g is None:
                g = groups[id(blk)] = (blk, [], [])
            g[1].append(j)
            g[2].append(r)
        return self._finish_offer(m, probs, out_ids, out_ts, out_lab, b_out, b_idx,
                                  list(groups.values()), [e for e, _ in live],
                                  [i for _, i in live], ev, um)

    def _offer_native(self, m: _ModelJoin, kind_l: list, ids: Sequence[str], ts_l: list,
                      probs: np.ndarray | None, lab_l: list, event_time: bool) -> JoinResult:
        """:meth:`offer` with its event loop in C (``daemon._speedups.offer_loop``, a line-by-line
        port of the Python loop above, on the same state objects; see :mod:`daemon.native`)."""
        (clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx, p_groups, live_e,
         live_r) = SPEEDUPS.offer_loop(
            m.pending, m.queue, m.recent, m.recent_order, self.max_recent, self.max_pending,
            self.ttl, event_time, self.clock, self.wm[0], self.wm[1], kind_l,
            ids if type(ids) is list else list(ids), ts_l, lab_l, _JOINED, _EXPIRED, _DEAD)
        self.clock = clock
        self.wm = [wm0, wm1]
        ev = dict(zip(EVICTION_REASONS, counts[:2]))
        um = dict(zip(UNMATCHED_KINDS, counts[2:]))
        i64 = np.int64
        return self._finish_offer(
            m, probs, out_ids, np.frombuffer(out_ts, dtype=np.float64),
            np.frombuffer(out_lab, dtype=i64), np.frombuffer(b_out, dtype=i64),
            np.frombuffer(b_idx, dtype=i64),
            [(blk, np.frombuffer(js, dtype=i64), np.frombuffer(rs, dtype=i64))
             for blk, js, rs in p_groups],
            live_e, np.frombuffer(live_r, dtype=i64), ev, um)

    def _finish_offer(self, m: _ModelJoin, probs: np.ndarray | None, out_ids: list[str],
                      out_ts: Sequence[float], out_lab: Sequence[int], b_out: Sequence[int],
                      b_idx: Sequence[int], p_groups: Sequence[Sequence[Any]],
                      live_e: list[list], live_r: Sequence[int], ev: dict, um: dict
                      ) -> JoinResult:
        """After the event loop: gather the joined rows (``out[b_out] = probs[b_idx]`` from this
        batch, ``out[js] = block[rs]`` for each ``(block, js, rs)`` of ``p_groups`` from earlier
        batches) and copy the rows ``live_r`` of the predictions still pending (entries
        ``live_e``) into one compact block. Index sequences: lists or int64 arrays."""
        if p_groups:
            k = p_groups[0][0].shape[1]
        else:
            k = probs.shape[1] if probs is not None else 0
        rows = np.empty((len(out_ids), k), dtype=np.float64)
        if len(b_out):
            rows[b_out] = probs[b_idx]
        for blk, js, rs in p_groups:
            rows[js] = blk[rs]
        if live_e:
            block = probs[live_r]  # fancy indexing copies
            if SPEEDUPS is not None:
                SPEEDUPS.attach_rows(live_e, block)
            else:
                for r, e in enumerate(live_e):
                    e[3] = (block, r)
        m.joined += len(out_ids)
        m.compact()
        _acc(m, ev, um)
        return JoinResult(out_ids, np.asarray(out_ts, dtype=np.float64), rows,
                          np.asarray(out_lab, dtype=np.int64), ev, um)

    def _offer_uniform(self, m: _ModelJoin, kind: Any, kind_l: list, ids: Sequence[str],
                       ts_l: list, probs: np.ndarray | None, lab_l: list, event_time: bool
                       ) -> JoinResult | None:
        """Fast path of :meth:`offer` for the common batch: one kind of event (a partition of
        the predictions or of the outcomes topic), distinct ids, none of them recently joined
        or expired, and no eviction possible (nothing reaches its TTL within the batch, the
        pending buffer cannot overflow). Every event is then independent of the others, so
        the per-event loop of :meth:`offer` reduces to C-level bulk dict operations with the
        same result. Returns None (nothing changed) when a condition does not hold."""
        n = len(kind_l)
        if n == 0:
            return None
        kd = kind_l[0]
        if kind_l.count(kd) != n or kd not in (KIND_PREDICTION, KIND_OUTCOME, KIND_SAMPLE):
            return None
        pend, recent = m.pending, m.recent
        if len(pend) + n > self.max_pending:
            return None
        # the clock before each event (event time: running maximum of ts)
        clock0 = self.clock
        t = np.asarray(ts_l, dtype=np.float64)
        if not np.isfinite(t).all():
            return None
        wm_end = list(self.wm)
        if event_time:  # the watermark before each event: min of the two streams' maxima
            run = np.maximum.accumulate(t)
            w0 = np.maximum(run, self.wm[0]) if kd != KIND_OUTCOME else np.full(n, self.wm[0])
            w1 = np.maximum(run, self.wm[1]) if kd != KIND_PREDICTION else np.full(n, self.wm[1])
            clk = np.maximum(np.minimum(w0, w1), clock0)
            first, last = float(clk[0]), float(clk[-1])
            wm_end = [float(w0[-1]), float(w1[-1])]
        else:
            first = last = clock0
        e0 = m.oldest()
        front = math.inf if e0 is None else e0[1]
        # no expiry: old deadlines >= the final clock, and new ones (>= first + ttl) as well
        if front < last or first + self.ttl < last:
            return None
        uniq = set(ids)  # hashes every id once; later lookups reuse the cached str hashes
        if len(uniq) != n or (recent and not recent.keys().isdisjoint(uniq)):
            return None
        ev, um = _zero(EVICTION_REASONS), _zero(UNMATCHED_KINDS)
        k = probs.shape[1] if probs is not None else 0
        if kd == KIND_SAMPLE:
            entries = list(map(pend.__contains__, ids))
            dup = entries.count(True)
            if dup:
                keep = [i for i, e in enumerate(entries) if not e]
                um["duplicate"] += dup
            else:
                keep = None
            out_ids = list(ids) if keep is None else [ids[i] for i in keep]
            rows = probs.copy() if keep is None else probs[keep]
            out_ts = t.copy()
            out_lab = np.asarray(lab_l, dtype=np.int64)
            if keep is not None:
                out_ts, out_lab = out_ts[keep], out_lab[keep]
            return self._fast_commit(m, last, wm_end, ev, um,
                                     JoinResult(out_ids, out_ts, rows, out_lab, ev, um))
        other = KIND_OUTCOME if kd == KIND_PREDICTION else KIND_PREDICTION
        entries = list(map(pend.get, ids))
        if entries.count(None) == n:
            join_i: list[int] | None = []
            new_i: list[int] | None = None  # all wait
        else:  # events whose partner (or a duplicate) is pending
            hit = np.fromiter(map(is_not, entries, repeat(None)), dtype=bool, count=n)
            hit_i = np.flatnonzero(hit).tolist()
            hit_e = list(compress(entries, hit.tolist())) if len(hit_i) < n else entries
            hit_k = list(map(_KIND, hit_e))
            if hit_k.count(other) == len(hit_k):
                join_i = hit_i
            else:
                partner = np.fromiter(map(other.__eq__, hit_k), dtype=bool, count=len(hit_k))
                um["duplicate"] += len(hit_k) - int(partner.sum())
                join_i = np.asarray(hit_i, dtype=np.int64)[partner].tolist()
            new_i = None if not hit_i else np.flatnonzero(~hit).tolist()
        # joined samples, in event order
        all_join = len(join_i) == n
        out_ids = list(ids) if all_join else [ids[i] for i in join_i]
        jent = list(map(pend.pop, out_ids))
        deque(map(setitem, jent, repeat(0), repeat(_DEAD)), maxlen=0)  # e[0] = _DEAD
        jts = np.fromiter(map(_TS, jent), dtype=np.float64, count=len(jent))
        out_ts = np.maximum(jts, t if all_join else t[join_i])
        if kd == KIND_PREDICTION:
            out_lab = np.fromiter(map(_PAYLOAD, jent), dtype=np.int64, count=len(jent))
            rows = probs[join_i] if join_i else np.empty((0, k))
        else:
            out_lab = np.asarray(lab_l if all_join else [lab_l[i] for i in join_i],
                                 dtype=np.int64)
            rows = _gather_rows(list(map(_PAYLOAD, jent)), k)
        # the others wait: [kind, deadline, ts, payload, id] entries, in event order
        if new_i is None:
            nid, nts = ids, ts_l
        else:
            nid, nts = [ids[i] for i in new_i], [ts_l[i] for i in new_i]
        if nid:
            if event_time:
                dl = np.maximum(clk, t) if new_i is None else np.maximum(clk[new_i], t[new_i])
                dls = (dl + self.ttl).tolist()
            else:
                dls = repeat(clock0 + self.ttl)
            if kd == KIND_PREDICTION:
                block = probs.copy() if new_i is None else probs[new_i]
                payload = zip(repeat(block), range(len(nid)))
            else:
                payload = lab_l if new_i is None else [lab_l[i] for i in new_i]
            ents = list(map(list, zip(repeat(kd), dls, nts, payload, nid)))
            pend.update(zip(nid, ents))
            m.queue.extend(ents)
        return self._fast_commit(m, last, wm_end, ev, um,
                                 JoinResult(out_ids, out_ts, rows, out_lab, ev, um))

    def _fast_commit(self, m: _ModelJoin, clock: float, wm: list, ev: dict, um: dict,
                     res: JoinResult) -> JoinResult:
        """The state changes of a fast-path batch, applied once it is known to succeed."""
        self._remember_new(m, res.ids)
        self.clock = clock
        self.wm = wm
        m.joined += len(res.ids)
        m.compact()
        _acc(m, ev, um)
        return res

    def _remember_new(self, m: _ModelJoin, eids: list[str]) -> None:
        """:meth:`_remember` ``_JOINED`` for distinct ids not in ``recent``, in bulk."""
        if self.max_recent == 0 or not eids:
            return
        rec, order = m.recent, m.recent_order
        order.extend(eids)
        rec.update(zip(eids, repeat(_JOINED)))
        excess = len(order) - self.max_recent
        if excess > 0:  # forget the oldest (popleft: O(excess), not O(max_recent))
            pop = order.popleft
            deque(map(rec.__delitem__, [pop() for _ in range(excess)]), maxlen=0)

    def offer_batch(self, mb: Any, now: float | None = None) -> JoinResult:
        """:meth:`offer` for a :class:`daemon.events.ModelBatch`."""
        return self.offer(mb.model, mb.kind, mb.ids, mb.ts, mb.probs, mb.labels, now)

    # ---------------------------------------------------------------- snapshots
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot; :meth:`from_dict` restores an equal store."""
        models = {}
        for name, m in self._models.items():
            pend = []
            for eid, (kd, deadline, t, payload, _eid) in m.pending.items():
                pl = payload[0][payload[1]].tolist() if kd == KIND_PREDICTION else int(payload)
                pend.append([eid, kd, deadline, t, pl])
            order = list(m.recent_order)
            states = np.fromiter(map(m.recent.__getitem__, order), dtype=np.int8,
                                 count=len(order))
            models[name] = {
                "pending": pend,
                "recent_ids": order,
                "recent_expired": np.flatnonzero(states == _EXPIRED).tolist(),
                "evicted": dict(m.evicted),
                "unmatched": dict(m.unmatched),
                "joined": m.joined,
            }
        return {"max_pending": self.max_pending, "ttl": self.ttl, "max_recent": self.max_recent,
                "clock": None if math.isinf(self.clock) else self.clock,
                "watermarks": [None if math.isinf(w) else w for w in self.wm], "models": models}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "join store") -> JoinStore:
        try:
            store = cls(int(d["max_pending"]), float(d["ttl"]), int(d["max_recent"]))
            clock = d["clock"]
            store.clock = -math.inf if clock is None else float(clock)
            wms = d.get("watermarks", [clock, clock])
            store.wm = [-math.inf if w is None else float(w) for w in wms][:2]
            for name, md in dict(d["models"]).items():
                m = store._model(str(name))
                entries = []
                rows = []
                for item in md["pending"]:
                    eid, kd, deadline, t, pl = item
                    if kd == KIND_PREDICTION:
                        row = np.asarray(pl, dtype=np.float64)
                        if row.ndim != 1:
                            raise ValueError(f"pending row of {eid!r} is not a vector")
                        payload: Any = len(rows)
                        rows.append(row)
                    elif kd == KIND_OUTCOME:
                        payload = int(pl)
                    else:
                        raise ValueError(f"pending kind {kd!r} of {eid!r}")
                    entry = [int(kd), float(deadline), float(t), payload, str(eid)]
                    if entry[4] in m.pending:
                        raise ValueError(f"pending id {eid!r} twice")
                    m.add(entry[4], entry)
                    if kd == KIND_PREDICTION:
                        entries.append(entry)
                if rows:
                    if len({r.shape for r in rows}) != 1:
                        raise ValueError("pending rows differ in length")
                    block = np.stack(rows)
                    for entry in entries:
                        entry[3] = (block, entry[3])
                _restore_recent(m, md)
                for key in EVICTION_REASONS:
                    m.evicted[key] = int(md["evicted"][key])
                for key in UNMATCHED_KINDS:
                    m.unmatched[key] = int(md["unmatched"][key])
                m.joined = int(md["joined"])
        except InputError:
            raise
        except (KeyError, TypeError, ValueError) as e:
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
        states = dict.fromkeys(ids, _JOINED)
        if len(states) != len(ids):
            raise ValueError("a recent id is listed twice")
        if expired and not (0 <= min(expired) and max(expired) < len(ids)):
            raise ValueError("recent_expired position out of range")
        states.update(zip(map(ids.__getitem__, expired), repeat(_EXPIRED)))
        m.recent.update(states)
        m.recent_order.extend(ids)
        return
    for eid, st in md["recent"]:
        if st not in (_JOINED, _EXPIRED):
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
