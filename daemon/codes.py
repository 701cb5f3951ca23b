"""The codes the ingest path and its C kernels share: event kinds, the pending join entry.

One definition each. :mod:`daemon.events` (the parser's ``ModelBatch.kind``) and
:mod:`daemon.join` re-export the kinds; the C kernels (``daemon/csrc/speedups.h``) keep their
own definitions (``#define``) of every name in :data:`SHARED_WITH_C` and export them as module
constants: :mod:`daemon.native` refuses a built module whose values differ (it runs the
pure-Python path instead) and ``tests/daemon/test_native.py`` asserts that they are equal.

**Pending join entry** (:class:`daemon.join.JoinStore`): a 5-item list, indexed by the ``E_*``
constants, ``[kind, deadline, ts, payload, id]``:

* ``kind``: :data:`KIND_PREDICTION` or :data:`KIND_OUTCOME` while pending; :data:`KIND_DEAD`
  once it has left the pending dict (joined or evicted; it may still sit in the arrival queue);
* ``deadline``: the store's clock at which it expires (TTL); ``ts``: its event time (float);
* ``payload``: the label (an outcome), or ``(block, row)`` (a prediction: row ``row`` of the
  2-D float64 array ``block``), or, only inside one ``offer`` call, the int index of its row in
  that call's batch;
* ``id``: the event id (str), the key of the pending dict.

**The per-model join state** (:class:`daemon.join_loop._ModelJoin`): the C loop reads its
attributes by name; :data:`MODEL_JOIN_ATTRS` are those names, shared with C as the ``MJ_*``
string constants.

A list rather than a class with ``__slots__``: the C join loop creates, reads and marks entries
with the list macros (no attribute look-up or call per event), and the memory bound of the
join (``daemon.join.PENDING_ENTRY_BYTES``) is measured on this layout.
"""

from __future__ import annotations

__all__ = [
    "ENTRY_LEN",
    "EXPIRED",
    "E_DEADLINE",
    "E_ID",
    "E_KIND",
    "E_PAYLOAD",
    "E_TS",
    "JOINED",
    "KIND_DEAD",
    "KIND_OUTCOME",
    "KIND_PREDICTION",
    "KIND_SAMPLE",
    "MODEL_JOIN_ATTRS",
    "SHARED_WITH_C",
]

#: kind of an event (``ModelBatch.kind``, ``JoinStore.offer``) and of a pending entry
KIND_PREDICTION, KIND_OUTCOME, KIND_SAMPLE = 0, 1, 2
#: kind of a pending entry that left the pending dict (joined, evicted or expired)
KIND_DEAD = -1
#: state of an id in the join's ``recent`` set
JOINED, EXPIRED = 0, 1
#: positions in a pending join entry (see the module docstring)
E_KIND, E_DEADLINE, E_TS, E_PAYLOAD, E_ID = 0, 1, 2, 3, 4
ENTRY_LEN = 5

#: the attributes of a model's join state that the C join loop reads by name
MJ_PENDING, MJ_QUEUE, MJ_RECENT, MJ_RECENT_ORDER = "pending", "queue", "recent", "recent_order"
MJ_CAP_PENDING, MJ_CAP_RECENT = "cap_pending", "cap_recent"
MODEL_JOIN_ATTRS: tuple[str, ...] = (MJ_PENDING, MJ_QUEUE, MJ_RECENT, MJ_RECENT_ORDER,
                                     MJ_CAP_PENDING, MJ_CAP_RECENT)

#: every code the C kernels define too (their module exports each under the same name)
SHARED_WITH_C: dict[str, int | str] = {
    "KIND_PREDICTION": KIND_PREDICTION, "KIND_OUTCOME": KIND_OUTCOME,
    "KIND_SAMPLE": KIND_SAMPLE, "KIND_DEAD": KIND_DEAD, "JOINED": JOINED, "EXPIRED": EXPIRED,
    "E_KIND": E_KIND, "E_DEADLINE": E_DEADLINE, "E_TS": E_TS, "E_PAYLOAD": E_PAYLOAD,
    "E_ID": E_ID, "ENTRY_LEN": ENTRY_LEN,
    "MJ_PENDING": MJ_PENDING, "MJ_QUEUE": MJ_QUEUE, "MJ_RECENT": MJ_RECENT,
    "MJ_RECENT_ORDER": MJ_RECENT_ORDER, "MJ_CAP_PENDING": MJ_CAP_PENDING,
    "MJ_CAP_RECENT": MJ_CAP_RECENT,
}
