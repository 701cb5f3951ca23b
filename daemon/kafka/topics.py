"""Kafka topics: :class:`TopicSpec`, creating the topics that do not exist, partition counts,
the layout checks (present, co-partitioned) and their errors (see :mod:`daemon.kafka` for what
the embedded broker supports).

API::

    counts = await ensure_topics(bootstrap, [TopicSpec("preds", 3),
                                             TopicSpec("binmaps", 1, configs=COMPACT)])
    check_copartitioned(counts, "preds", "outcomes")        # TopicLayoutError if they differ
    counts = await partition_counts(bootstrap, ["preds", "outcomes"])   # never auto-creates
    require_topics(counts, ["preds", "outcomes"], bootstrap)  # TopicMissingError, names them
    configs = await describe_topic_config(bootstrap, "binmaps")
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from daemon.kafka.clients import make_admin
from lpcal.errors import InputError

__all__ = [
    "COMPACT",
    "CREATE_TOPICS_SETTING",
    "TopicLayoutError",
    "TopicMissingError",
    "TopicSpec",
    "check_copartitioned",
    "describe_topic_config",
    "ensure_topics",
    "partition_counts",
    "require_topics",
]

log = logging.getLogger("lpcal.kafka")

COMPACT: dict[str, str] = {"cleanup.policy": "compact"}
"""Topic config of compacted topics (the bin-map topic)."""

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_ERR_TOPIC_EXISTS = 36


class TopicLayoutError(RuntimeError):
    """Kafka topics are missing, could not be created, or are not laid out as required."""


class TopicMissingError(TopicLayoutError, LookupError):
    """A topic that must exist does not."""


#: How to have the daemon create its topics, for :func:`require_topics`'s message.
CREATE_TOPICS_SETTING = ("set kafka.create_topics = true (LPCAL_KAFKA__CREATE_TOPICS=true) to "
                         "have the daemon create them, or use the dev profile (profile = \"dev\" "
                         "/ LPCAL_PROFILE=dev), which turns it on")


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
