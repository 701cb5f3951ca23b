"""Offset-gap guard: notice input records a fetch skipped, and optionally read them again.

Within one partition, Kafka offsets are consecutive except where the broker leaves a legitimate
hole: transaction markers and aborted records of transactional producers, and records removed
by compaction or retention. A consumer whose next record after offset ``e - 1`` has offset
``e + j`` (``j > 0``) has therefore either met such a hole, or been handed a later record batch
before an earlier one became visible: a broker fault, and samples lost if it goes unnoticed.

The embedded Tansu broker (0.6.0, memory storage) has that fault. When two producers write one
partition and the machine is loaded, a live consumer is sometimes handed the batch after one
that is still being appended; the skipped batch is on the broker (a later read from the start
returns it). Measured with a plain aiokafka consumer, no lpcal code involved
(``python -m tests.reliability.offset_hole_probe``): 1 trial in 8 under three CPU hogs skipped
one batch of 34 records. It made the crash-safety test's never-killed reference daemon miss 115
samples in CI.

Two policies (``kafka.offset_gaps``):

* ``count`` (the default, for production Kafka, whose holes are legitimate): every hole is
  counted in ``lpcal_input_offset_gaps_total{resolution="skipped"}`` and consumption goes on.
* ``refetch`` (the embedded broker): the records before the hole are processed, the partition
  is sought back to the hole's first offset and read again, until the hole fills (counted as
  ``filled``) or has persisted for ``grace_seconds`` (then it is accepted as a real hole and
  counted as ``skipped``). A transactional upstream producer leaves a marker hole at every
  commit, which ``refetch`` would wait out each time: keep ``count`` on real Kafka.

The check costs O(1) per fetched partition batch (first and last offset against the batch
length and the expected position); offsets are only scanned when a batch is not contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GapVerdict", "Hole", "OffsetGapGuard", "find_hole"]


@dataclass(frozen=True)
class Hole:
    """Offsets ``[start, end)`` missing before record ``index`` of a batch."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GapVerdict:
    """What to do with a batch: process its first ``keep`` records, then (if ``seek`` is not
    None) seek the partition to ``seek``. ``hole`` is the batch's first hole; ``closed`` an
    earlier hole whose records this batch brought. ``filled``/``skipped`` count resolved holes."""

    keep: int
    seek: int | None = None
    hole: Hole | None = None
    closed: Hole | None = None
    skipped: int = 0

    @property
    def filled(self) -> int:
        return int(self.closed is not None)


def find_hole(expected: int | None, first: int, last: int, n: int,
              offsets: Callable[[], Sequence[int]]) -> Hole | None:
    """The first hole of a batch of ``n`` records with offsets ``first..last`` (increasing), read
    at position ``expected`` (None: unknown, e.g. the first fetch after a reset). ``offsets``
    returns all offsets; it is only called when ``last - first + 1 != n``."""
    if n <= 0:
        return None
    if expected is not None and first > expected:
        return Hole(0, expected, first)
    if last - first + 1 == n:
        return None
    offs = np.asarray(offsets(), dtype=np.int64)
    steps = np.flatnonzero(np.diff(offs) != 1)
    if not len(steps):  # pragma: no cover - first/last/n said otherwise
        return None
    i = int(steps[0]) + 1
    return Hole(i, int(offs[i - 1]) + 1, int(offs[i]))


class OffsetGapGuard:
    """Per-partition hole tracking for the ``refetch`` / ``count`` policies (module docstring).

    ``check`` is called for every fetched partition batch before it is processed; ``forget``
    when a partition is revoked or sought elsewhere. Pure: the caller seeks and counts.
    """

    def __init__(self, refetch: bool, grace_seconds: float = 2.0):
        if grace_seconds < 0:
            raise ValueError(f"OffsetGapGuard: grace_seconds={grace_seconds} must be >= 0")
        self.refetch = refetch
        self.grace_seconds = float(grace_seconds)
        self._open: dict[Hashable, tuple[Hole, float]] = {}  # key -> (hole, first seen)

    @property
    def open_holes(self) -> int:
        return len(self._open)

    def forget(self, key: Hashable) -> None:
        self._open.pop(key, None)

    def check(self, key: Hashable, expected: int | None, first: int, last: int, n: int,
              offsets: Callable[[], Sequence[int]], now: float) -> GapVerdict:
        hole = find_hole(expected, first, last, n, offsets)
        closed = None
        opened = self._open.get(key)
        if opened is not None and (hole is None or hole.start != opened[0].start):
            # the records at the open hole's start arrived (this batch begins there)
            del self._open[key]
            closed, opened = opened[0], None
        if hole is None:
            return GapVerdict(keep=n, closed=closed)
        if not self.refetch:
            return GapVerdict(keep=n, hole=hole, closed=closed, skipped=1)
        since = now if opened is None else opened[1]
        if now - since >= self.grace_seconds:
            self._open.pop(key, None)
            return GapVerdict(keep=n, hole=hole, closed=closed, skipped=1)
        self._open[key] = (hole, since)
        return GapVerdict(keep=hole.index, seek=hole.start, hole=hole, closed=closed)
