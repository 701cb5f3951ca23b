"""Kafka clients: the security keyword arguments aiokafka receives, unstarted admin / producer /
consumer factories, and starting a producer (see :mod:`daemon.kafka` for what the embedded broker
supports).

API::

    client_kwargs(sec)          # pure: the security kwargs aiokafka receives
    producer = make_producer(bootstrap, idempotence=False, security=sec)   # not started
    await start_producer(producer, idempotence=False)   # BrokerSettingsError if idempotence refused
    consumer = make_consumer(bootstrap, group_id="lpcal", security=sec)    # not started
    admin = make_admin(bootstrap, security=sec)                            # not started
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import BrokerResponseError, SaslAuthenticationFailed

from lpcal.errors import InputError

__all__ = [
    "IDEMPOTENCE_SETTING",
    "PROTOCOLS",
    "SASL_MECHANISMS",
    "BrokerSettingsError",
    "client_kwargs",
    "make_admin",
    "make_consumer",
    "make_producer",
    "start_producer",
]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class BrokerSettingsError(RuntimeError):
    """The broker refuses what the settings ask of it (an idempotent producer); the message
    names the setting to change."""


#: How to turn idempotence off, for :func:`start_producer`'s message (the daemon's settings).
IDEMPOTENCE_SETTING = ("set kafka.enable_idempotence = false (LPCAL_KAFKA__ENABLE_IDEMPOTENCE="
                       "false), or use the dev profile (profile = \"dev\" / LPCAL_PROFILE=dev), "
                       "which turns it off")


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
