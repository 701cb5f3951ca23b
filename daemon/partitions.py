"""The input partitions a replica is assigned: one :class:`PartitionState` per partition number.

Both input topics are co-partitioned (events are keyed by model id), so partition ``n`` of the
predictions topic and partition ``n`` of the outcomes topic hold the same models and are
assigned together: one :class:`PartitionState` holds what the daemon keeps about both (after
aiokafka's ``TopicPartitionState``: the state of one unit of assignment in one object):

* ``positions``: the next offset to process, per input topic (set by ingest after each batch and
  by the restore when it seeks; written into the manifest ``partition/<n>`` by the checkpoint);
* ``event_times``: the largest event time (``ts``, seconds) of the events processed, per input
  topic (set by ingest after each batch; the join's flow control compares the two topics by
  it; not checkpointed);
* ``gaps``: its offset-gap guard (:class:`daemon.offset_gaps.OffsetGapGuard`, keyed by topic);
* ``paused``: paused by backpressure (a model on it has too many sealed epochs waiting);
* ``held``: the input topic held back by the join's flow control (:mod:`daemon.alignment`:
  its events wait in a join buffer for the other topic's), or None;
* ``sampled``: ``{model: sample_rate}`` of its models with a rate < 1, for the raw-bytes
  prefilter of :mod:`daemon.ingest`.

:class:`PartitionTable` owns them and the assignment (``assigned``, the input
``TopicPartition``\\ s). Its mutators say who calls them and what they affect.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from daemon.offset_gaps import OffsetGapGuard


@dataclass(eq=False)
class PartitionState:
    """What the daemon keeps about input partition ``number`` of both input topics."""

    number: int
    gaps: OffsetGapGuard
    positions: dict[str, int] = field(default_factory=dict)  # topic -> next offset
    event_times: dict[str, float] = field(default_factory=dict)  # topic -> largest ts read
    paused: bool = False  # by backpressure
    held: str | None = None  # the input topic held back by daemon.alignment
    sampled: dict[str, float] = field(default_factory=dict)  # model -> sample rate < 1

    def seek(self, topic: str, offset: int) -> None:
        """Caller: the restore, after seeking the consumer. Affects: ``positions[topic]``."""
        self.positions[topic] = int(offset)

    def sample(self, model: str, rate: float) -> None:
        """Caller: ingest (a model's rate after its batch) and the restore. Affects:
        ``sampled`` (the prefilter samples ``model`` on this partition when ``rate < 1``)."""
        if rate < 1.0:
            self.sampled[model] = rate


class PartitionTable:
    """The assigned input partitions: ``assigned`` and one :class:`PartitionState` per
    partition number (created on first use, dropped on revocation)."""

    def __init__(self, *, refetch: bool, grace_seconds: float):
        self._refetch, self._grace = refetch, float(grace_seconds)
        self.assigned: set[TopicPartition] = set()
        self._states: dict[int, PartitionState] = {}

    @classmethod
    def from_settings(cls, settings) -> PartitionTable:
        k = settings.kafka
        return cls(refetch=k.offset_gaps == "refetch", grace_seconds=k.offset_gap_grace_seconds)

    def __iter__(self) -> Iterator[PartitionState]:
        return iter(list(self._states.values()))

    def __contains__(self, n: object) -> bool:
        return n in self._states

    def get(self, n: int) -> PartitionState | None:
        return self._states.get(n)

    def ensure(self, n: int) -> PartitionState:
        """Caller: ingest (each batch), the restore. Affects: creates partition ``n``'s state."""
        ps = self._states.get(n)
        if ps is None:
            ps = self._states[n] = PartitionState(n, OffsetGapGuard(self._refetch, self._grace))
        return ps

    def position(self, topic: str, n: int) -> int | None:
        """The next offset of ``topic[n]`` to process, or None."""
        ps = self._states.get(n)
        return None if ps is None else ps.positions.get(topic)

    def numbers(self) -> set[int]:
        """The assigned partition numbers."""
        return {tp.partition for tp in self.assigned}

    def paused(self) -> set[int]:
        """The partition numbers paused by backpressure."""
        return {n for n, ps in self._states.items() if ps.paused}

    def held(self) -> dict[int, str]:
        """``{partition number: input topic}`` held back by the join's flow control."""
        return {n: ps.held for n, ps in self._states.items() if ps.held is not None}

    def input_partition(self, topic: str, n: int) -> TopicPartition | None:
        """The assigned ``TopicPartition`` of ``topic[n]``, or None."""
        tp = TopicPartition(topic, n)
        return tp if tp in self.assigned else None

    def stopped(self) -> set[TopicPartition]:
        """The assigned input partitions this table wants paused: both topics of a partition
        paused by backpressure, the held topic of a held one."""
        out = set()
        for tp in self.assigned:
            ps = self._states.get(tp.partition)
            if ps is not None and (ps.paused or ps.held == tp.topic):
                out.add(tp)
        return out

    # ------------------------------------------------------------------ mutators
    def assign(self, tps: Iterable[TopicPartition]) -> set[TopicPartition]:
        """Caller: ``Daemon.on_assigned``. Affects: ``assigned`` (becomes ``tps``), ``held`` of
        every partition (cleared: the assignment pauses and resumes them all). Returns the
        partitions that are new (not assigned before)."""
        tps = set(tps)
        new = tps - self.assigned
        self.assigned = tps
        for ps in self._states.values():
            ps.held = None
        return new

    def set_paused(self, parts: set[int]) -> tuple[set[TopicPartition], set[TopicPartition]]:
        """Caller: backpressure (:class:`daemon.fitting.Fitter`) and the restore. Affects:
        ``paused`` of every partition: set exactly for ``parts``. Returns the assigned input
        partitions to pause and to resume (what :meth:`stopped` gained and lost)."""
        before = self.stopped()
        for n in parts:
            self.ensure(n)
        for n, ps in self._states.items():
            ps.paused = n in parts
        after = self.stopped()
        return after - before, before - after

    def set_held(self, held: dict[int, str]) -> tuple[set[TopicPartition], set[TopicPartition]]:
        """Caller: the join's flow control (:class:`daemon.alignment.Aligner`). Affects:
        ``held`` of every partition: set exactly to ``held`` (partition number -> input topic).
        Returns the assigned input partitions to pause and to resume."""
        before = self.stopped()
        for n in held:
            self.ensure(n)
        for n, ps in self._states.items():
            ps.held = held.get(n)
        after = self.stopped()
        return after - before, before - after

    def release(self, tps: Iterable[TopicPartition]) -> set[int]:
        """Caller: ``Daemon.on_revoked``, after the revoked partitions were checkpointed.
        Affects: ``assigned`` loses ``tps``; the states of their partition numbers are dropped
        (positions, gap guard, paused flag, sampled rates). Returns those numbers."""
        tps = set(tps)
        parts = {tp.partition for tp in tps}
        for n in parts:
            self._states.pop(n, None)
        self.assigned -= tps
        return parts
