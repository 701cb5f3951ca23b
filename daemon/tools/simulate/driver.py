"""Producing a simulated stream to Kafka: :func:`simulate` sends a
:class:`~daemon.tools.simulate.traffic.TrafficGenerator`'s messages, paced to a rate of events
per second of wall time, and reports what it sent (:class:`SimulationReport`).

Usage::

    report = asyncio.run(simulate("127.0.0.1:9092", {"predictions": "lpcal.predictions",
                                                     "outcomes": "lpcal.outcomes"}, gen,
                                  rate=1000, idempotence=False))
    print(report.summary())
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daemon.kafka.clients import make_producer, start_producer
from daemon.kafka.topics import TopicSpec, ensure_topics
from daemon.tools.simulate.traffic import OUTCOMES, PREDICTIONS, TrafficGenerator
from lpcal.errors import InputError

__all__ = ["SimulationReport", "simulate"]

_IDEMPOTENCE_FIX = "pass --no-idempotence (the embedded broker needs it)"


@dataclass
class SimulationReport:
    """What :func:`simulate` sent."""

    events: int
    messages: dict[str, int]           # per topic name
    counts: dict[str, int]             # per message kind (TrafficGenerator.counts)
    seconds: float
    topics: dict[str, str]             # topic kind -> topic name
    partitions: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Messages per second of wall time."""
        return sum(self.messages.values()) / self.seconds if self.seconds > 0 else math.inf

    def summary(self) -> str:
        msgs = ", ".join(f"{t}: {n}" for t, n in self.messages.items())
        kinds = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return (f"simulate: sent {self.events} events in {self.seconds:.1f} s "
                f"({self.rate:,.0f} messages/s); {msgs}; {kinds}")


def _topic_names(topics: Mapping[str, str]) -> dict[str, str]:
    names = {PREDICTIONS: topics.get(PREDICTIONS), OUTCOMES: topics.get(OUTCOMES)}
    missing = [k for k, v in names.items() if not v]
    if missing:
        raise InputError(f"topics: need names for {missing} (got {dict(topics)})")
    return names  # type: ignore[return-value]


async def simulate(bootstrap: str, topics: Mapping[str, str], generator: TrafficGenerator, *,
                   rate: float = 0.0, idempotence: bool = True, partitions: int = 1,
                   create_topics: bool = True, security: Any = None,
                   flush_every: int = 5000, progress: Callable[[str], None] | None = None,
                   progress_interval: float = 2.0,
                   between_chunks: Callable[[TrafficGenerator], Awaitable[None] | None]
                   | None = None,
                   **producer_kwargs: Any) -> SimulationReport:
    """Produce ``generator``'s stream to Kafka; return what was sent.

    ``topics`` maps ``"predictions"`` and ``"outcomes"`` to topic names (they may be equal).
    ``rate``: events (not messages) per second of wall time; 0 = as fast as possible. With
    ``create_topics`` the topics are created with ``partitions`` partitions when missing
    (:func:`daemon.kafka.topics.ensure_topics`; existing topics are kept). Messages are sent
    asynchronously (``send``) and every ``flush_every`` messages the delivery futures are
    awaited, so a delivery error stops the run. ``idempotence`` must be False against the
    embedded Tansu broker. ``progress`` (e.g. ``print``) receives a line every
    ``progress_interval`` seconds. ``between_chunks(generator)`` is called after each chunk's
    messages are sent, before the next chunk is generated (awaited when it returns an
    awaitable, e.g. to hold the stream until a consumer catches up): the place to change the
    stream as it runs (e.g. :meth:`TrafficGenerator.add_drift` when a condition outside holds).
    """
    if not (math.isfinite(rate) and rate >= 0):
        raise InputError(f"rate must be >= 0 events per second (0 = as fast as possible), "
                         f"got {rate}")
    names = _topic_names(topics)
    distinct = list(dict.fromkeys(names.values()))
    counts: dict[str, int] = {}
    if create_topics:
        counts = await ensure_topics(bootstrap, [TopicSpec(t, partitions) for t in distinct],
                                     security=security)
    producer_kwargs.setdefault("linger_ms", 5)
    producer = make_producer(bootstrap, idempotence=idempotence, security=security,
                             client_id="lpcal-simulate", **producer_kwargs)
    sent = {t: 0 for t in distinct}
    t0 = time.monotonic()
    last = t0
    try:
        await start_producer(producer, idempotence=idempotence, fix=_IDEMPOTENCE_FIX)
    except BaseException:
        await producer.stop()
        raise
    try:
        futures: list[asyncio.Future] = []
        for msgs in generator.chunks():
            for topic_kind, key, value in msgs:
                topic = names[topic_kind]
                futures.append(await producer.send(topic, value=value, key=key))
                sent[topic] += 1
                if len(futures) >= flush_every:
                    await asyncio.gather(*futures)
                    futures.clear()
            if between_chunks is not None:
                held = between_chunks(generator)
                if inspect.isawaitable(held):
                    await held
            now = time.monotonic()
            if rate > 0:  # pace: event i is due at t0 + i / rate
                wait = t0 + generator.produced / rate - now
                if wait > 0:
                    await asyncio.sleep(wait)
                    now = time.monotonic()
            if progress is not None and now - last >= progress_interval:
                last = now
                total = sum(sent.values())
                done = generator.produced / max(generator.events, 1)
                eta = (now - t0) * (1 - done) / done if done > 0 else math.inf
                progress(f"simulate: {generator.produced}/{generator.events} events "
                         f"({100 * done:.0f}%), {total} messages, "
                         f"{total / max(now - t0, 1e-9):,.0f} messages/s, {now - t0:.0f} s"
                         + (f", about {eta:.0f} s left" if math.isfinite(eta) else ""))
        if futures:
            await asyncio.gather(*futures)
        await producer.flush()
    finally:
        await producer.stop()
    return SimulationReport(events=generator.produced, messages=sent, counts=dict(generator.counts),
                            seconds=time.monotonic() - t0, topics=names, partitions=counts)
