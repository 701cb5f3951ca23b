"""Read the two input topics at the same pace, so the join does not drop what it could join.

A prediction and its outcome arrive on two topics, read by one consumer. aiokafka fetches each
partition by bytes, so the topic with the smaller messages (outcomes: a label, against a row of
``k`` probabilities) can run far ahead of the other while a backlog is read (a restart, a new
replica, a slow partition). The first half of every pair then waits in the model's join buffer
(:mod:`daemon.join`) for a partner that is still unread, and beyond the buffer's bound the oldest
are evicted (``capacity``) and their partners, read later, are counted ``late``: samples lost
for nothing but the order of reading. Measured through the embedded broker, without this: on a
200,000-pair backlog of one model (``k = 10``, buffer bound 100,000) 0 to 89% of the pairs
lost from run to run (8 runs); on a 30,000-pair backlog with a bound of 10,000, 3 of 4 runs
joined none (``tests/integration/test_daemon_alignment.py``).

The fix is flow control, as Kafka Streams synchronises the partitions of a task by timestamp:
when a model's join buffer fills up with events of one topic, that topic's partition is *held*
(paused) while the other topic's partition of the same number is behind it; it is resumed once
the buffer has drained, or once the other partition has caught up (read to its end, or to the
held one's record time: then the partners are not in the topic yet, and holding back would
only delay, while the buffer's TTL and bound do their job as before). Holding is lossless: aiokafka drops the fetched records of a
paused partition and fetches them again from the consumed position on resume.

:class:`InputAlignment` is the pure state machine; :class:`Aligner` feeds it after each batch
from the models the batch touched and applies its holds to the consumer.

Which topic: the join's *leading* stream, the one whose largest event time is ahead
(:meth:`daemon.join.JoinStore.pressure`). An outcome follows its prediction in event time, so
the events waiting are those of the stream read further ahead.

When (hysteresis, on a model's pending events over its bound in force, ``pressure``):

* a model starts *pressing* at ``pressure >= HOLD_AT`` (half full: one batch of up to 5,000
  events cannot overflow a buffer of 10,000 or more from there) and stops at
  ``pressure <= RELEASE_AT``;
* a partition's topic is held while a model on it presses with that topic leading and the
  other topic's partition of the same number is *behind*: it has records left to read (its
  high watermark above the next offset to process) and the largest event time read from it is
  below the largest read from the held topic (event time as the join's watermark reads it,
  bounded by ``join.max_ts_skew_seconds``). The second condition is what
  keeps a model whose partners never come (a model without outcomes) from stalling its
  partition: once both topics are read up to the same time, nothing is held, and its pending
  events expire by TTL or bound as before. Both topics of one partition are never held at
  once (models leading on both sides): neither is, so reading never stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

from aiokafka.errors import KafkaError

log = logging.getLogger("lpcal.daemon")

#: a model presses on its partition from this share of its join bound in force ...
HOLD_AT = 0.5
#: ... until its pending events fall to this share
RELEASE_AT = 0.25
#: seconds to wait for the consumer's position of a partition not read yet (it is known at
#: once unless the consumer is still resetting it)
POSITION_WAIT = 0.1
#: the two input streams, in the join's order (``JoinStore.wm``)
STREAMS = ("predictions", "outcomes")


class Press(NamedTuple):
    """A model pressing on ``partition``: its pending events are of stream ``leading``."""

    partition: int
    leading: int  # 0 predictions, 1 outcomes


class InputAlignment:
    """Which input stream of which partition to hold back (see the module docstring). Pure:
    the caller reports the join pressure of the models a batch touched (:meth:`observe`) and
    asks for the holds given which partitions are behind (:meth:`holds`)."""

    def __init__(self, hold_at: float = HOLD_AT, release_at: float = RELEASE_AT):
        if not 0.0 < release_at < hold_at <= 1.0:
            raise ValueError(f"need 0 < release_at < hold_at <= 1, got {release_at}, {hold_at}")
        self.hold_at, self.release_at = float(hold_at), float(release_at)
        self.pressing: dict[str, Press] = {}

    def observe(self, model: str, partition: int, pressure: float, leading: int | None) -> None:
        """Note ``model``'s join ``pressure`` (pending events over their bound in force) and
        its leading stream (None: neither leads)."""
        if pressure >= self.hold_at and leading is not None:
            self.pressing[model] = Press(int(partition), int(leading))
        elif pressure <= self.release_at or leading is None:
            self.pressing.pop(model, None)
        elif model in self.pressing and self.pressing[model].leading != leading:
            self.pressing[model] = Press(int(partition), int(leading))

    def forget(self, models: Iterable[str]) -> None:
        """Drop released models."""
        for m in models:
            self.pressing.pop(m, None)

    def holds(self, behind: Callable[[int, int], bool | None]) -> dict[int, int]:
        """``{partition: stream held}``: for each partition a model presses on, its leading
        stream, while ``behind(partition, leading stream)`` says the other stream's partition is
        behind it (None: unknown, as False). A partition pressed on both streams holds
        neither."""
        wanted: dict[int, set[int]] = {}
        for p in self.pressing.values():
            wanted.setdefault(p.partition, set()).add(p.leading)
        out = {}
        for part, streams in wanted.items():
            if len(streams) == 1:
                (s,) = streams
                if behind(part, s):
                    out[part] = s
        return out


class Aligner:
    """The adapter: after each batch, the join pressure of the models the batch touched goes
    into an :class:`InputAlignment`; its holds are set on the partition table and applied to
    the consumer (pause and resume), counted in ``lpcal_input_holds_total`` and
    ``lpcal_input_held_partitions``. Constructed with what it reads: the settings (input topic
    names, ``join.align_inputs``), the registry (models, their partition and join), the
    partition table (positions, event times, holds), the Kafka clients (the consumer's high
    watermarks and positions) and the metrics."""

    def __init__(self, settings, registry, partitions, clients, metrics,
                 alignment: InputAlignment | None = None):
        t = settings.kafka.topics
        self.topics = (t.predictions, t.outcomes)
        self.enabled = bool(settings.join.align_inputs)
        self.registry, self.partitions = registry, partitions
        self.clients, self.metrics = clients, metrics
        self.alignment = alignment or InputAlignment()

    async def after_batch(self, touched: Iterable[str]) -> None:
        """Observe the ``touched`` models (call before the triggers take ``registry.touched``)
        and the models still pressing, then apply the holds."""
        if not self.enabled:
            return
        a, slots = self.alignment, self.registry.slots
        for model in set(touched) | set(a.pressing):
            slot = slots.get(model)
            if slot is None:
                a.forget((model,))
                continue
            pressure, leading = slot.state.join.pressure(model)
            a.observe(model, slot.partition, pressure, leading)
        if not a.pressing and not self.partitions.held():
            return
        need = {(p.partition, p.leading) for p in a.pressing.values()}
        behind = {key: await self.behind(*key) for key in need}
        self.apply(lambda part, stream: behind.get((part, stream)))

    async def behind(self, partition: int, leading: int) -> bool | None:
        """Whether the other stream's input partition ``partition`` is behind stream
        ``leading``'s: it has records past the next offset to process (by its last fetched
        high watermark) and the largest event time read from it is below ``leading``'s (none
        read yet counts as below). None: unknown (before its first fetch).
        The next offset is the partition table's, or before the partition's first batch the
        consumer's (``position``, waited for at most :data:`POSITION_WAIT` s)."""
        consumer = self.clients.consumer
        topic, lead_topic = self.topics[1 - leading], self.topics[leading]
        tp = self.partitions.input_partition(topic, partition)
        ps = self.partitions.get(partition)
        if consumer is None or tp is None or ps is None:
            return None
        high = consumer.highwater(tp)
        if high is None:
            return None
        mine, lead = ps.event_times.get(topic), ps.event_times.get(lead_topic)
        if mine is not None and lead is not None and mine >= lead:
            return False
        pos = ps.positions.get(topic)
        if pos is None:
            try:
                pos = await asyncio.wait_for(consumer.position(tp), POSITION_WAIT)
            except (TimeoutError, KafkaError):
                return None
        return high > pos

    def apply(self, behind: Callable[[int, int], bool | None]) -> None:
        """Set the holds (:meth:`InputAlignment.holds` given ``behind``) on the partition table
        and pause or resume what changed."""
        holds = {n: self.topics[s] for n, s in self.alignment.holds(behind).items()
                 if n in self.partitions}
        pause, resume = self.partitions.set_held(holds)
        consumer = self.clients.consumer
        if consumer is None:
            return
        if pause:
            consumer.pause(*pause)
        if resume:
            consumer.resume(*resume)
        for tp in pause:
            kind = STREAMS[self.topics.index(tp.topic)]
            self.metrics.inc_input_hold(kind)
            log.debug("input %s[%d] held: the join waits for the other topic", tp.topic,
                      tp.partition)
        if pause or resume:
            held = {s: 0 for s in STREAMS}
            for topic in holds.values():
                held[STREAMS[self.topics.index(topic)]] += 1
            self.metrics.set_input_held(held)

    def forget(self, models: Iterable[str]) -> None:
        """Drop released models (their partitions were revoked)."""
        self.alignment.forget(models)
