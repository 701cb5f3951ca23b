"""The join's per-model state and its event loop, in Python: the reference of the C kernels
``offer_loop`` and ``attach_rows`` (``daemon/csrc/join.c``). Pure.

:class:`daemon.join.JoinStore` keeps one :class:`_ModelJoin` per model (pending entries,
recently joined or expired ids, count bounds) and runs :func:`offer_loop` over each batch of
one model's events through ``daemon.native.KERNELS.offer_loop``: the C kernel (a line-by-line
port of :func:`offer_loop`) or this function. Both have one signature and one result (the C
wrapper of :mod:`daemon.native` turns the kernel's byte buffers into int64/float64 arrays), so
the store never asks which one runs. What stays in :mod:`daemon.join`: the snapshot
(``to_dict``/``from_dict``), the byte budget and the gathering of joined rows.

The C loop reads the attributes of :class:`_ModelJoin` by name: those names are in
:data:`daemon.codes.SHARED_WITH_C` (``MJ_*``), checked here at import against ``__slots__``
and by :mod:`daemon.native` against the built module's constants.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

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
    MODEL_JOIN_ATTRS,
)

__all__ = ["EVICTION_REASONS", "UNMATCHED_KINDS", "attach_rows", "expire", "hashed_dict",
           "offer_loop", "remember"]

EVICTION_REASONS = ("ttl", "capacity")
UNMATCHED_KINDS = ("late", "duplicate", "orphan")

_KIND = itemgetter(E_KIND)  # of a pending entry (layout: daemon.codes)
if (E_KIND, E_DEADLINE, E_TS, E_PAYLOAD, E_ID) != (0, 1, 2, 3, 4):  # the list literals below
    raise ImportError("daemon.join_loop builds pending entries as [kind, deadline, ts, payload, "
                      "id]")
_COMPACT_SLACK = 1024


class _RowBytes:
    """Bytes of the row blocks of one model that are still allocated (a block is released,
    by ``weakref.finalize``, when its last pending row has left)."""

    __slots__ = ("__weakref__", "_refs", "nbytes")

    def __init__(self):
        self.nbytes = 0
        #: id(weak reference) -> (the weak reference to a tracked block, its bytes): a
        #: ``weakref.ref`` with a callback costs about half of a ``weakref.finalize``
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def track(self, block: np.ndarray) -> None:
        nbytes = block.nbytes
        self.nbytes += nbytes
        ref = weakref.ref(block, self._released)
        self._refs[id(ref)] = (ref, nbytes)

    def _released(self, ref: weakref.ref) -> None:
        self.release(self._refs.pop(id(ref))[1])

    def release(self, nbytes: int) -> None:
        self.nbytes -= nbytes


def _zero(keys: Iterable[str]) -> dict[str, int]:
    return {k: 0 for k in keys}


def hashed_dict(items: Any = ()) -> dict:
    """A dict (of ``items``, a mapping or pairs) that keeps each key's hash in its table.

    CPython gives a dict whose keys are all str a compact layout without the hashes, so each
    probe of a lookup reads the key object itself to compare hashes: a cache miss per probe in
    a large table of ids, and a lookup of an absent id (every new event asks ``recent``) probes
    several slots. A dict that once held a non-str key keeps the general layout (hash stored
    next to the key) through inserts, deletions (also of every key) and resizes; the sentinel
    key leaves at once, so the content is the same. About 0.1 us less per event at 100k recent
    ids (one model, event-time join), for about 16 bytes more per entry. ``clear``, a new dict,
    or ``update`` of an empty dict from a compact one give the compact layout again: the join
    does none of these (a restore builds its dicts here). ``tests/daemon/test_join.py`` checks
    the layout after offers and restores."""
    d: dict = {None: None}
    d.update(items)
    del d[None]
    return d


class _ModelJoin:
    """Pending + recent state of one model.

    ``pending[id]`` is a pending entry ``[kind, deadline, ts, payload, id]``, indexed by the
    ``E_*`` constants of :mod:`daemon.codes` (which documents it), with ``payload`` the label
    (outcomes) or ``(block, row)`` (predictions: row ``row`` of the 2-D array ``block``, a
    compact copy shared by the predictions of one batch). A plain dict keeps its entries in
    arrival order, which is deadline order; ``queue`` holds the same entries in the same order,
    for the oldest one in O(1): an entry that leaves ``pending`` by a join gets kind
    ``KIND_DEAD`` and is dropped from ``queue`` once it reaches the front (or by
    :meth:`compact`). An OrderedDict did this at twice the cost per event (a linked node per
    entry). The C join loop (``offer_loop``) reads the attributes of this object by name."""

    __slots__ = ("cap_pending", "cap_recent", "evicted", "id_bytes", "joined", "k", "pending",
                 "queue", "recent", "recent_order", "rows", "unmatched")

    def __init__(self, cap_pending: int = 1, cap_recent: int = 0):
        #: the count bounds in force (the store's, lowered by its byte budget)
        self.cap_pending, self.cap_recent = cap_pending, cap_recent
        self.id_bytes = 0          # largest ``sys.getsizeof`` of an id of this model so far
        self.k = 0                 # width of its probability rows
        self.rows = _RowBytes()
        #: both dicts keep their keys' hashes (see :func:`hashed_dict`)
        self.pending: dict[str, list] = hashed_dict()
        self.queue: deque[list] = deque()
        self.recent: dict[str, int] = hashed_dict()  # id -> JOINED | EXPIRED
        self.recent_order: deque[str] = deque()   # ids of ``recent``, oldest first
        self.evicted = _zero(EVICTION_REASONS)
        self.unmatched = _zero(UNMATCHED_KINDS)
        self.joined = 0

    def oldest(self) -> list | None:
        """The oldest pending entry (dropping joined ones from the front of ``queue``)."""
        q = self.queue
        while q:
            e = q[0]
            if e[E_KIND] != KIND_DEAD:
                return e
            q.popleft()
        return None

    def pop_oldest(self) -> tuple[str, int]:
        """Remove the oldest pending entry (``pending`` must not be empty); return its id and
        kind (the entry itself is marked ``KIND_DEAD``)."""
        self.oldest()
        e = self.queue.popleft()
        del self.pending[e[E_ID]]
        kind, e[E_KIND] = e[E_KIND], KIND_DEAD
        return e[E_ID], kind

    def add(self, eid: str, e: list) -> None:
        self.pending[eid] = e
        self.queue.append(e)

    def compact(self) -> None:
        """Drop joined entries from ``queue`` once they outnumber the pending ones (amortised
        O(1) per join: they pile up behind an old entry that waits long for its partner)."""
        q = self.queue
        if len(q) > 2 * len(self.pending) + _COMPACT_SLACK:
            if not self.pending:  # every entry left (a batch joined them all)
                q.clear()
            else:
                self.queue = deque(compress(q, map(KIND_DEAD.__ne__, map(_KIND, q))))


if not set(MODEL_JOIN_ATTRS) <= set(_ModelJoin.__slots__):  # what the C loop reads by name
    raise ImportError(f"daemon.join_loop: _ModelJoin lacks {set(MODEL_JOIN_ATTRS) - set(_ModelJoin.__slots__)}, "
                      "which daemon.codes.SHARED_WITH_C says the C join loop reads")


def expire(m: _ModelJoin, clock: float, ev: dict, um: dict) -> None:
    """Evict ``m``'s pending entries whose deadline is before ``clock`` (counted in ``ev``
    as ``ttl``, outcomes also in ``um`` as ``orphan``) and remember their ids as expired."""
    while True:
        entry = m.oldest()
        if entry is None or entry[E_DEADLINE] >= clock:
            break
        eid, kind = m.pop_oldest()
        ev["ttl"] += 1
        if kind == KIND_OUTCOME:
            um["orphan"] += 1
        remember(m, eid, EXPIRED)


def remember(m: _ModelJoin, eid: str, state: int) -> None:
    """Remember ``eid`` (a re-remembered id keeps its place in the forgetting order)."""
    if m.cap_recent == 0:
        return
    rec = m.recent
    if eid not in rec:
        order = m.recent_order
        order.append(eid)
        if len(order) > m.cap_recent:
            del rec[order.popleft()]
    rec[eid] = state


def attach_rows(entries: list[list], block: np.ndarray) -> None:
    """``entry[E_PAYLOAD] = (block, r)`` for the ``r``-th of ``entries`` (the reference of the C
    ``attach_rows``)."""
    for r, e in enumerate(entries):
        e[E_PAYLOAD] = (block, r)


def offer_loop(m: _ModelJoin, ttl: float, event_time: bool, clock: float, wm0: float,
               wm1: float, kind_l: list, ids: Sequence[str], ts_l: list, lab_l: list
               ) -> tuple[Any, ...]:
    """The event loop of :meth:`daemon.join.JoinStore.offer` for one model's events (the
    reference of the C ``offer_loop``): updates ``m``'s ``pending``, ``queue``, ``recent`` and
    ``recent_order`` in place, within ``m.cap_pending`` and ``m.cap_recent``.

    Returns ``(clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx, p_groups,
    live_e, live_r)``: the clock and watermarks after the batch; ``counts`` the evictions
    (``ttl``, ``capacity``) and unmatched events (``late``, ``duplicate``, ``orphan``); the
    joined samples' ids, times and labels; their rows, ``out[b_out] = probs[b_idx]`` from this
    batch and ``out[js] = block[rs]`` for each ``(block, js, rs)`` of ``p_groups`` from earlier
    batches; the entries ``live_e`` of this batch's predictions still pending and their rows
    ``live_r`` in the batch. Index sequences are lists here, int64 arrays from the C kernel.
    """
    n = len(kind_l)
    ev, um = _zero(EVICTION_REASONS), _zero(UNMATCHED_KINDS)
    pend, recent, cap = m.pending, m.recent, m.cap_pending
    # joined samples; their rows come from this batch (b_*) or from pending blocks (p_*)
    out_ids: list[str] = []
    out_ts: list[float] = []
    out_lab: list[int] = []
    b_out: list[int] = []
    b_idx: list[int] = []
    p_out: list[int] = []
    p_src: list[tuple[np.ndarray, int]] = []
    new_pending: list[tuple[list, int]] = []  # prediction entries whose row is in this batch
    inf = math.inf
    # lower bound on the earliest pending deadline (deadlines are appended in order, and
    # removing entries can only raise the true minimum), so the check below is exact
    e0 = m.oldest()
    front = inf if e0 is None else e0[E_DEADLINE]
    for i in range(n):
        t = ts_l[i]
        kd = kind_l[i]
        if event_time:
            if kd != KIND_OUTCOME and t > wm0:
                wm0 = t
            if kd != KIND_PREDICTION and t > wm1:
                wm1 = t
            # comparisons, not min()/max(): this runs once per event
            c = wm0 if wm0 < wm1 else wm1  # noqa: FURB136
            if c > clock:  # noqa: PLR1730
                clock = c
        if front < clock:
            expire(m, clock, ev, um)
            e0 = m.oldest()
            front = inf if e0 is None else e0[E_DEADLINE]
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
            remember(m, eid, JOINED)
            continue
        if entry is not None:
            if entry[E_KIND] == kd:
                um["duplicate"] += 1
                continue
            del pend[eid]
            entry[E_KIND] = KIND_DEAD
            if kd == KIND_PREDICTION:
                b_out.append(len(out_ids))
                b_idx.append(i)
                out_lab.append(entry[E_PAYLOAD])
            else:
                src = entry[E_PAYLOAD]
                if type(src) is int:   # a prediction of this batch
                    b_out.append(len(out_ids))
                    b_idx.append(src)
                else:
                    p_out.append(len(out_ids))
                    p_src.append(src)
                out_lab.append(lab_l[i])
            out_ids.append(eid)
            out_ts.append(max(entry[E_TS], t))
            remember(m, eid, JOINED)
            continue
        state = recent.get(eid)
        if state is not None:
            if kd == KIND_OUTCOME or state == EXPIRED:
                um["late"] += 1
            else:
                um["duplicate"] += 1
            continue
        deadline = ((clock if clock > t else t) if event_time else clock) + ttl  # noqa: FURB136
        # a pending entry, [E_KIND, E_DEADLINE, E_TS, E_PAYLOAD, E_ID] (daemon.codes)
        if kd == KIND_PREDICTION:
            e = [kd, deadline, t, i, eid]
            new_pending.append((e, i))
        else:
            e = [kd, deadline, t, lab_l[i], eid]
        if not pend:
            front = e[E_DEADLINE]
        m.add(eid, e)
        if len(pend) > cap:
            old_id, _kind = m.pop_oldest()
            ev["capacity"] += 1
            remember(m, old_id, EXPIRED)
    live = [(e, i) for e, i in new_pending if e[E_KIND] != KIND_DEAD]
    groups: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
    for j, (blk, r) in zip(p_out, p_src):
        g = groups.get(id(blk))
        if g is None:
            g = groups[id(blk)] = (blk, [], [])
        g[1].append(j)
        g[2].append(r)
    counts = [ev["ttl"], ev["capacity"], um["late"], um["duplicate"], um["orphan"]]
    return (clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx,
            list(groups.values()), [e for e, _ in live], [i for _, i in live])
