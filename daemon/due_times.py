"""When each model's time-based work is next due: a min-heap of due times. Pure.

Per-batch work should be proportional to the batch, yet some of a model's work depends on time,
not on its events: its gauges are refreshed at most once per second, a drift rule fires only
after the condition held for its sustain time, an idle model's join buffer expires. Walking
every model on every batch to ask "is it time?" costs O(models) per batch. :class:`DueTimes`
keeps, per key (a model id), the time its work is next due, and hands out the keys whose time
has come: O(log n) per :meth:`schedule`, O(1) per key handed out (amortised), nothing per batch
for keys not yet due.

Stale heap entries (a key rescheduled or cancelled) are skipped lazily when they reach the top
and dropped all at once when they outnumber the live ones, so memory stays O(keys).

Usage::

    due = DueTimes()
    due.schedule("m1", now + 1.0)            # a model touched by this batch: gauges in 1 s
    due.schedule("m1", now + 5.0, earliest=True)   # keeps now + 1.0
    for model in due.pop_due(now):           # on a timer, or after each batch
        refresh(model)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterator

__all__ = ["DueTimes"]

_COMPACT_MIN = 64


class DueTimes:
    """Keys with the time each is next due; :meth:`pop_due` hands out those due, earliest
    first. Times are plain floats on any clock (``time.monotonic()`` in the daemon)."""

    __slots__ = ("_due", "_heap", "_seq")

    def __init__(self) -> None:
        self._due: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()  # ties: first scheduled first; keys are never compared

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._due)

    def due_at(self, key: Hashable) -> float | None:
        """When ``key`` is due, or None if it is not scheduled."""
        return self._due.get(key)

    def schedule(self, key: Hashable, when: float, *, earliest: bool = False) -> None:
        """Make ``key`` due at ``when`` (replacing its time; with ``earliest``, only if that is
        sooner than the time it has). A NaN time is refused."""
        when = float(when)
        if math.isnan(when):
            raise ValueError(f"DueTimes: due time of {key!r} is NaN")
        cur = self._due.get(key)
        if cur is not None and (cur == when or (earliest and cur <= when)):
            return
        self._due[key] = when
        heapq.heappush(self._heap, (when, next(self._seq), key))
        if len(self._heap) > 2 * len(self._due) + _COMPACT_MIN:
            self._compact()

    def cancel(self, key: Hashable) -> bool:
        """Forget ``key`` (a model released); True if it was scheduled."""
        return self._due.pop(key, None) is not None

    def next_due(self) -> float | None:
        """The earliest due time, or None when nothing is scheduled (how long a timer may
        sleep)."""
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float, limit: int | None = None) -> list[Hashable]:
        """The keys due at or before ``now``, earliest first (at most ``limit`` of them), each
        removed: schedule a key again to have it handed out again."""
        out: list[Hashable] = []
        heap, due = self._heap, self._due
        while heap and heap[0][0] <= now and (limit is None or len(out) < limit):
            when, _, key = heapq.heappop(heap)
            if due.get(key) == when:
                del due[key]
                out.append(key)
        return out

    def _drop_stale(self) -> None:
        heap, due = self._heap, self._due
        while heap and due.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)

    def _compact(self) -> None:
        due = self._due
        self._heap = [e for e in self._heap if due.get(e[2]) == e[0]]
        heapq.heapify(self._heap)
