"""The sections of the daemon's settings: ``[kafka]`` (with ``[kafka.topics]``), ``[http]``,
``[join]``, ``[state]`` and ``[signing]``. Each is a strict model (unknown keys are errors);
checks across fields report each bad field at its own path (:func:`~daemon.settings.base.
field_errors`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, model_validator

from daemon.settings.base import MIB, NonNegFloat, PosFloat, PosInt, Strict, field_errors

__all__ = ["HttpSettings", "JoinSettings", "KafkaSettings", "SigningSettings", "StateSettings",
           "Topics"]


class Topics(Strict):
    predictions: str = Field("lpcal.predictions", min_length=1, max_length=249)
    outcomes: str = Field("lpcal.outcomes", min_length=1, max_length=249)
    binmaps: str = Field("lpcal.binmaps", min_length=1, max_length=249)
    deadletter: str = Field("lpcal.deadletter", min_length=1, max_length=249)
    state: str = Field("lpcal.state", min_length=1, max_length=249)

    @model_validator(mode="after")
    def _distinct(self) -> Topics:
        names = list(self.model_dump().values())
        if len(set(names)) != len(names):
            field_errors("Topics", [((), f"names must be distinct, got {names}")])
        return self


class KafkaSettings(Strict):
    bootstrap_servers: str = Field("localhost:9092", min_length=1)
    """Comma-separated host:port list (passed to aiokafka)."""
    client_id: str = "lpcal"
    group_id: str = Field("lpcal", min_length=1)
    topics: Topics = Topics()
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    enable_idempotence: bool = True
    """Idempotent producer; set false for the embedded test broker, which lacks InitProducerId
    (``profile = "dev"`` does; a broker that refuses it stops startup naming this setting)."""
    max_message_bytes: Annotated[int, Field(ge=1024)] = MIB
    """Largest accepted input message; larger ones are dead-lettered as ``oversize``."""
    create_topics: bool = False
    """Create missing topics at startup (``profile = "dev"`` turns it on); without it, missing
    input topics stop startup with an error naming them."""
    topic_partitions: PosInt = 1
    """Partitions of topics created by the daemon (when ``create_topics``)."""
    session_timeout_ms: Annotated[int, Field(ge=1000, le=300_000)] = 10_000
    """Consumer-group session timeout: a crashed replica's partitions move after this long."""
    heartbeat_interval_ms: Annotated[int, Field(ge=100, le=60_000)] = 3_000
    """Consumer-group heartbeat interval (well below ``session_timeout_ms``)."""
    fetch_max_wait_ms: Annotated[int, Field(ge=0, le=10_000)] = 500
    """Longest time the broker may hold a fetch waiting for data (Kafka's ``fetch.max.wait.ms``,
    whose default this keeps). Measured on the embedded Tansu broker, both ways: with memory
    storage, 100 ms avoided idle fetches (about one ingest run in three idled ~0.8 s at 500);
    with S3 storage after a broker restart, 100 ms made every fetch come back empty (reads
    from the bucket took longer than the wait), so a daemon with lag consumed nothing until
    it was raised again. Lower it only on a broker that returns available data at once."""
    max_partition_fetch_bytes: Annotated[int, Field(ge=64 * 1024, le=256 * MIB)] = 8 * MIB
    """Most bytes one fetch returns per input partition (Kafka's ``max.partition.fetch.bytes``;
    at least ``max_message_bytes`` is used). aiokafka sends the next fetch to a broker only once
    the records of its last one are consumed, so the daemon waits a round trip per fetch: 8 MiB
    instead of Kafka's 1 MiB means fewer of those waits and fuller batches (docs/benchmarks.md,
    ingest). The consumer holds one fetch in flight per broker (at most ``fetch_max_bytes``)
    and the records of earlier fetches not consumed yet (at most this per partition)."""
    fetch_max_bytes: Annotated[int, Field(ge=64 * 1024, le=1024 * MIB)] = 16 * MIB
    """Most bytes one fetch returns over all its partitions (Kafka's ``fetch.max.bytes``,
    whose default is 50 MiB): the consumer's buffer is about twice this per broker at most.
    At least ``max_partition_fetch_bytes``."""
    lean_records: bool = True
    """Read input records as aiokafka decodes them, many of a record batch at once, without
    building a ``ConsumerRecord`` per message (about a third of a plain aiokafka reader's CPU per
    message) or stepping aiokafka's record generator per message (see
    :mod:`daemon.kafka.lean_records`). Falls back to ``ConsumerRecord`` by itself on an
    aiokafka whose internals differ; false: always."""
    offset_gaps: Literal["count", "refetch"] = "count"
    """What to do when a fetch skips input offsets (see :mod:`daemon.offset_gaps`): ``count``
    them and go on (production Kafka: holes are transaction markers or compaction), or
    ``refetch`` from the hole until it fills or persists ``offset_gap_grace_seconds`` (the
    embedded Tansu broker, which under load can hand out a batch before an earlier one is
    visible; ``profile = "dev"`` sets it)."""
    offset_gap_grace_seconds: Annotated[float, Field(ge=0.0, le=60.0)] = 2.0
    """With ``offset_gaps = "refetch"``: how long a hole is read again before it is accepted."""

    @model_validator(mode="after")
    def _cross_fields(self) -> KafkaSettings:
        problems = []
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            problems.append((("heartbeat_interval_ms",),
                             "heartbeat_interval_ms must be below session_timeout_ms"))
        if self.security_protocol.startswith("SASL"):
            required = f"required with security_protocol {self.security_protocol}"
            if self.sasl_mechanism is None:
                problems.append((("sasl_mechanism",), required))
            if not self.sasl_username:
                problems.append((("sasl_username",), required))
            if self.sasl_password is None:
                problems.append((("sasl_password",), required))
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                problems.append(((name,), f"file {str(path)!r} does not exist"))
        if self.fetch_max_bytes < self.max_partition_fetch_bytes:
            problems.append((("fetch_max_bytes",),
                             (f"fetch_max_bytes ({self.fetch_max_bytes}) must be at least "
                              f"max_partition_fetch_bytes ({self.max_partition_fetch_bytes})")))
        if (self.ssl_keyfile is not None) and self.ssl_certfile is None:
            problems.append((("ssl_keyfile",), "needs ssl_certfile"))
        field_errors("KafkaSettings", problems)
        return self

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """Connection/security kwargs shared by aiokafka consumers, producers and admin clients.

        ``ssl_context`` is built with the stdlib ``ssl`` module when the protocol uses SSL.
        """
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL"):
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None)
        if self.security_protocol.endswith("SSL"):
            import ssl

            ctx = ssl.create_default_context(
                cafile=str(self.ssl_cafile) if self.ssl_cafile else None)
            if self.ssl_certfile:
                ctx.load_cert_chain(str(self.ssl_certfile),
                                    str(self.ssl_keyfile) if self.ssl_keyfile else None)
            kw["ssl_context"] = ctx
        return kw


class HttpSettings(Strict):
    host: str = "0.0.0.0"
    """Listen address. All interfaces by default: inside a Kubernetes pod the kubelet's probes
    and Prometheus reach the pod IP, not loopback. Outside a pod, set ``127.0.0.1`` unless the
    port must be reachable from other hosts."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    admin_token: SecretStr | None = None
    """Bearer token of ``POST /v1/models/{model}/recalibrate`` (unset: endpoint disabled).
    Refused at startup when it could never authenticate: empty, with leading or trailing
    blanks (HTTP strips them from header values) or with control characters."""
    max_body_bytes: Annotated[int, Field(ge=1)] = MIB
    max_connections: Annotated[int, Field(ge=1, le=100_000)] = 100
    """Open HTTP connections held at most. A connection accepted at the limit closes the
    oldest one that is not inside a handler, so a fresh probe connection is always served."""
    idle_timeout_seconds: Annotated[float, Field(gt=0.0, le=3600.0)] = 10.0
    """A connection is closed when it has not delivered a complete request head within this
    time of being opened or of its previous response: bounds slow headers and idle
    keep-alive alike (aiohttp's default keep-alive is about an hour)."""
    body_timeout_seconds: Annotated[float, Field(gt=0.0, le=3600.0)] = 10.0
    """Reading a request body must finish within this time, else 408 and the connection is
    closed."""

    @model_validator(mode="after")
    def _usable_token(self) -> HttpSettings:
        if self.admin_token is None:
            return self
        tok = self.admin_token.get_secret_value()
        if not tok.strip():
            why = "is empty and could never authenticate"
        elif tok != tok.strip():
            why = ("has leading or trailing blanks, which HTTP strips from header values, so "
                   "it could never authenticate")
        elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in tok):
            why = "contains control characters and could never authenticate"
        else:
            return self
        field_errors("HttpSettings", [(("admin_token",), (f"the admin token {why} (set a usable "
                                       "token, or unset it to disable the manual trigger)"))])
        return self

    @property
    def manual_trigger_enabled(self) -> bool:
        return self.admin_token is not None and bool(self.admin_token.get_secret_value())


class JoinSettings(Strict):
    ttl_seconds: PosFloat = 3600.0
    """A pending prediction/outcome waits at most this long (event time) for its partner."""
    max_pending_per_model: PosInt = 100_000
    """Pending events per model; the oldest is evicted beyond this."""
    recent_per_model: PosInt | None = None
    """Recently joined/expired ids remembered per model to classify late events (None: = max_pending)."""
    max_bytes_per_model: Annotated[int, Field(ge=MIB)] = 64 * MIB
    """Byte budget of one model's pending events and recent ids (estimated per entry from
    its id and row sizes, see :mod:`daemon.join`): the count bounds above are lowered
    so that full buffers fit it, and the oldest events beyond are evicted (``capacity``)."""
    max_bytes_total: Annotated[int, Field(ge=MIB)] = 384 * MIB
    """Byte budget of the join buffers of all models of a replica: each model gets
    ``min(max_bytes_per_model, max_bytes_total / models)``, updated as models come and go.
    With the shipped 1 GiB memory limit this leaves room for the process (~200 MiB),
    checkpoint encoding and fits."""
    align_inputs: bool = True
    """Flow control between the two input topics (:mod:`daemon.alignment`): when a model's
    join buffer is half full of one topic's events and the other topic's partition is behind
    (records to read, read up to an earlier event time), the first topic's partition is paused
    until the buffer is a quarter full or the other has caught up. Keeps a backlog (restart, new replica) from
    evicting pairs whose partner is merely unread; ``lpcal_input_holds_total``."""
    max_ts_skew_seconds: PosFloat = 300.0
    """Seconds of event time an event's ``ts`` may be ahead of its Kafka record timestamp;
    later events are dead-lettered as ``ts_out_of_range``. Bounds how far one event can move a
    model's clocks (join watermark, monitor window, drift timers)."""
    staging_max_cpu_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.1
    """Largest share of the time the offers of staged events may take (see
    :mod:`daemon.staging`: a model's slices of fewer than 256 events of a batch shared by many
    models are held and offered together; each offer costs about the same, ~1 ms with the
    online calibrator, whatever its size). They are offered 5 s after the oldest, or later,
    ``models staged x measured fixed cost per offer / staging_max_cpu_share`` seconds, when 5 s would
    cost more than this share (``lpcal_staging_age_seconds``). 0.1, as
    ``state.checkpoint_max_cpu_share``: at ~1 ms per offer, replicas of up to ~500 models keep
    5 s (1 and 100 models are never paced), 1,000 models wait ~10 s, 10,000 models
    ``staging_max_wait_seconds``. 1: the age grows only where the offers would take all the
    time."""
    staging_max_wait_seconds: NonNegFloat = 60.0
    """Longest time a staged event waits for the pacing before it is offered (5 or less: no
    pacing, always 5 s). A longer wait means the model's monitor, change test and online
    calibrator see its samples up to that much later, never that a sample is lost or counted
    twice: checkpoints, partition releases and idle polls offer every staged event first. A
    minute keeps that delay far below the monitor's window and the drift timers (hours) while
    it cuts the staged offers at 10,000 models from ~2 s of CPU per second to ~0.17."""


class StateSettings(Strict):
    backend: Literal["kafka", "local"] = "kafka"
    """``kafka``: compacted state topic (no PersistentVolume needed); ``local``: a directory."""
    local_dir: Path = Path(".lpcal-state")
    checkpoint_interval_seconds: PosFloat = 10.0
    """Seconds between the starts of periodic checkpoints (each writes every model that
    changed), unless ``checkpoint_max_cpu_share`` asks for longer."""
    checkpoint_max_cpu_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.1
    """Largest share of the time periodic checkpoints may take: the next one starts no sooner
    than ``max(checkpoint_interval_seconds, last duration / checkpoint_max_cpu_share)`` after
    the last one started (see :mod:`daemon.checkpoint.pacing`; the daemon ingests nothing while
    a checkpoint runs). 0.1 leaves ingest at least ~90 % of the time and, at the default
    interval, only moves checkpoints that take over 1 s (thousands of models). A longer
    interval means more input to replay after a crash, never a lost or doubled sample.
    Checkpoints before a rebalance or a shutdown are never delayed. 1: no pacing beyond
    back-to-back checkpoints."""
    max_record_bytes: Annotated[int, Field(ge=64 * 1024, le=1 << 30)] = MIB
    """Largest record the daemon writes to the state topic (value and key). A model's
    checkpoint that is larger (compressed) is split into records of at most this size, written
    before the record that names them (see :mod:`daemon.checkpoint.store`). At startup the
    daemon reads the topic's ``max.message.bytes`` and refuses to start if it is lower.
    The default fits a Kafka broker's default message limit (1 MiB)."""
    max_state_bytes: Annotated[int, Field(ge=1024, le=1 << 31)] = 128 * MIB
    """Largest state value of one model the daemon decodes on restore, after reassembly and
    decompression: a compressed value that would inflate beyond it (a compression bomb) is not
    inflated further, and it and any larger value are skipped, counted and logged (that model
    starts fresh). Values are decoded one at a time, so restoring needs about this much memory
    beyond the raw records. The default is above what a model within
    ``join.max_bytes_per_model`` writes (~1.5 bytes of JSON per byte of buffer)."""
    max_bytes_per_model: Annotated[int, Field(ge=MIB)] = 128 * MIB
    """Byte budget, in memory, of one model's pools (filling, sealed and in-flight epochs),
    held-out sums and monitoring window, a quarter each for the window (its oldest samples are
    dropped beyond it), the filling epoch (sealed early beyond it), the sealed epochs (the
    model's input partition pauses beyond it) and the epoch being fitted. See
    :mod:`daemon.state_budget`, which also gives sizing figures: a k = 10 model needs ~7 MiB
    to run undegraded, a k = 100 one ~33 MiB."""
    max_bytes_total: Annotated[int, Field(ge=MIB)] = 320 * MIB
    """Byte budget of the pools, held-out sums and windows of all models of a replica: each
    model gets ``min(max_bytes_per_model, max_bytes_total / models)``, updated as models come
    and go. With ``join.max_bytes_total`` (384 MiB) and the process itself (~150 MiB) this
    stays within the shipped 1 GiB memory limit; raise both with the limit for more models."""
    release_heap: bool = True
    """After each periodic checkpoint, give freed heap memory back to the OS (glibc
    ``malloc_trim``, see :mod:`daemon.heap`); without it resident memory ratchets up."""


class SigningSettings(Strict):
    """Ed25519 signatures of the published bin maps (:mod:`lpcal.signing`).

    ``private_key`` comes from the secrets directory (file ``signing__private_key``): PEM
    (PKCS#8, ``openssl genpkey -algorithm ed25519``) or the base64 text of the raw 32-byte seed.
    Unset: bin maps are published unsigned and any map on the topic is adopted (development
    only; a warning is logged at startup)."""

    private_key: SecretStr | None = None
    """Signs every published bin map; its public key is trusted for adoption."""
    public_keys: list[str] = Field(default_factory=list)
    """More public keys (PEM or base64 of the raw 32 bytes) whose maps the daemon adopts on
    assignment: the daemon's own previous key(s) during a rotation. Only ever list keys of
    this deployment: a map adopted on assignment sets the model's version."""

    _signer: Any = PrivateAttr(default=None)
    _ring: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _keys(self) -> SigningSettings:
        from lpcal.signing import KeyRing, Signer, load_public_key

        problems = []
        if self.private_key is not None:
            try:
                self._signer = Signer(self.private_key.get_secret_value())
            except ValueError as e:
                problems.append((("private_key",), str(e)))
        trusted: list[Any] = [] if self._signer is None else [self._signer.public_key]
        for i, k in enumerate(self.public_keys):
            try:
                trusted.append(load_public_key(k))
            except ValueError as e:
                problems.append((("public_keys", i), str(e)))
        field_errors("SigningSettings", problems)
        self._ring = KeyRing(trusted) if trusted else None
        return self

    def signer(self):
        """The :class:`lpcal.signing.Signer` of ``private_key``, or None (unsigned)."""
        return self._signer

    def keyring(self):
        """Keys whose maps are adopted (own key + ``public_keys``), or None (any map)."""
        return self._ring

    def warnings(self) -> list[str]:
        """What to warn about at startup (unsigned operation)."""
        out = []
        if self._signer is None:
            out.append("signing.private_key is not set: bin maps are published unsigned, "
                        "so clients cannot authenticate them (development only)")
        if self._ring is None:
            out.append("no signing key configured: any bin map on the bin-map topic is "
                       "adopted on assignment and can set a model's version")
        return out

