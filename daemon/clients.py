"""The daemon's Kafka clients (:class:`KafkaClients`): starting the producer, creating
(``kafka.create_topics``) and checking the topics, the input consumer and its options, retrying
broker calls during startup, and the broker probe behind ``/readyz``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from daemon import retry
from daemon.checkpoint.store import state_topic_config
from daemon.kafka import clients as kafka_clients
from daemon.kafka import lean_records
from daemon.kafka import topics as kafka_topics
from lpcal.errors import LpcalError

log = logging.getLogger("lpcal.daemon")

_FATAL = (kafka_topics.TopicLayoutError, kafka_clients.BrokerSettingsError, LpcalError)  # not retried
PROBE_EVERY = 2.0  # seconds between broker probes


class KafkaClients:
    """The producer and the input consumer of one replica.

    Parameters
    ----------
    settings : daemon.settings.Settings
    metrics : daemon.metrics.DaemonMetrics
    stopping : asyncio.Event
        Set by a stop signal: cuts the startup retries short.
    consumer_options : dict, optional
        Options of the input consumer that override those of the settings (tests).
    """

    def __init__(self, settings, metrics, stopping: asyncio.Event,
                 consumer_options: dict | None = None):
        self.s, self.metrics, self.stopping = settings, metrics, stopping
        self.t_pred = settings.kafka.topics.predictions
        self.t_out = settings.kafka.topics.outcomes
        self._consumer_options = consumer_options or {}
        self.producer = None
        self.consumer = None
        self.input_partitions = 1  # of each input topic, once checked (start_producer)
        self.broker_ok = False  # the broker answered the last probe
        self._probe_task: asyncio.Task | None = None

    def topic_kind(self, topic: str) -> str:
        """The ``topic`` label of an input topic's metrics: predictions | outcomes."""
        return "predictions" if topic == self.t_pred else "outcomes"

    async def start_producer(self) -> None:
        """Start the producer, then create the topics (if configured) and check their layout:
        both input topics present and co-partitioned."""
        k = self.s.kafka
        sec = k
        self.producer = kafka_clients.make_producer(
            k.bootstrap_servers, idempotence=k.enable_idempotence, security=sec,
            client_id=k.client_id,
            max_request_size=max(k.max_message_bytes, self.s.state.max_record_bytes))
        # no producer compression: it runs on the event loop; large checkpoint values are
        # compressed by KafkaCheckpointStore in a worker thread instead
        # a broker that refuses idempotence fails at once, naming the setting (not retried)
        await self.retry("producer start", lambda: kafka_clients.start_producer(
            self.producer, idempotence=k.enable_idempotence))
        if k.create_topics:
            specs = [kafka_topics.TopicSpec(self.t_pred, k.topic_partitions),
                     kafka_topics.TopicSpec(self.t_out, k.topic_partitions),
                     kafka_topics.TopicSpec(k.topics.binmaps, 1, configs=kafka_topics.COMPACT),
                     kafka_topics.TopicSpec(k.topics.deadletter, k.topic_partitions),
                     kafka_topics.TopicSpec(k.topics.state, 1, configs=state_topic_config(
                         self.s.state.max_record_bytes))]
            await self.retry("topic creation",
                             lambda: kafka_topics.ensure_topics(k.bootstrap_servers, specs,
                                                            security=sec))
        counts = await self.retry("partition check", lambda: kafka_topics.partition_counts(
            k.bootstrap_servers, list(k.topics.model_dump().values()), security=sec))
        kafka_topics.require_topics(counts, [self.t_pred, self.t_out], k.bootstrap_servers,
                                    optional=list(k.topics.model_dump().values()))
        kafka_topics.check_copartitioned(counts, self.t_pred, self.t_out)
        self.input_partitions = int(counts.get(self.t_pred) or 1)

    async def start_consumer(self, listener) -> None:
        """Create and start the input consumer, subscribed to both input topics with the
        rebalance ``listener``."""
        k = self.s.kafka
        self.consumer = kafka_clients.make_consumer(
            k.bootstrap_servers, group_id=k.group_id, security=k, client_id=k.client_id,
            **self.consumer_options())
        await self.retry("consumer start", self.consumer.start)
        self.consumer.subscribe([self.t_pred, self.t_out], listener=listener)
        self.broker_ok = True

    def consumer_options(self) -> dict:
        """Options of the input consumer, from ``kafka.*`` settings (then ``consumer_options``
        given to the constructor, which override them: tests).

        The range assignor gives partition n of both co-partitioned topics to one member
        (aiokafka's default, round robin, would split a model's predictions and outcomes).
        With ``kafka.lean_records``, records come as aiokafka decodes them
        (:mod:`daemon.kafka.lean_records`)."""
        k = self.s.kafka
        opts = {"session_timeout_ms": k.session_timeout_ms,
                "heartbeat_interval_ms": k.heartbeat_interval_ms,
                "fetch_max_wait_ms": k.fetch_max_wait_ms,
                "max_partition_fetch_bytes": max(k.max_message_bytes,
                                                 k.max_partition_fetch_bytes),
                "fetch_max_bytes": max(k.max_message_bytes, k.fetch_max_bytes),
                "partition_assignment_strategy": (RangePartitionAssignor,)}
        if k.lean_records and lean_records.install():
            opts["value_deserializer"] = lean_records.LEAN
        opts.update(self._consumer_options)
        return opts

    async def retry(self, what: str, fn):
        """``await fn()`` until it succeeds (:func:`daemon.retry.retry`: 0.5 s doubling to
        10 s); a stop signal cuts it short: then :class:`daemon.retry.Stopped`
        (``daemon.service.StartupStopped``)."""
        def warn(e: Exception, delay: float) -> None:
            log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e,
                        delay)

        return await retry.retry(what, fn, stop=self.stopping, first=0.5, cap=10.0,
                                 fatal=_FATAL, on_error=warn)

    def start_probe(self, report: Callable[[], None]) -> None:
        """Probe the broker (metadata) every :data:`PROBE_EVERY` s into ``broker_ok``, calling
        ``report()`` after each probe (the daemon exports its readiness)."""
        self._probe_task = asyncio.create_task(self._probe(report))

    def stop_probe(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()

    async def _probe(self, report: Callable[[], None]) -> None:
        while True:
            try:
                await asyncio.wait_for(self.producer.client.fetch_all_metadata(), 3.0)
                self.broker_ok = True
            except Exception:  # noqa: BLE001
                self.broker_ok = False
            report()
            await asyncio.sleep(PROBE_EVERY)
