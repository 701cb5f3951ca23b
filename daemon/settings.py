"""Settings of the lpcal daemon (pydantic-settings v2).

Sources, highest priority first::

    init arguments  >  environment (LPCAL_*)  >  secrets dir  >  TOML file  >  defaults

* **Environment**: prefix ``LPCAL_``, nested delimiter ``__``, case-insensitive:
  ``LPCAL_KAFKA__BOOTSTRAP_SERVERS=broker:9092``, ``LPCAL_DEFAULTS__EPS=0.05``,
  ``LPCAL_MODELS__FRAUD-V3__K=3`` (env names are lower-cased, so model names set through the
  environment must be lower-case).
* **Secrets dir** (Kubernetes secret volume), default ``/var/run/secrets/lpcal``, ignored when
  absent; override with ``LPCAL_SECRETS_DIR`` or ``load_settings(secrets_dir=...)``. One file per
  setting, named like the env var without the prefix: ``kafka__sasl_password``,
  ``http__admin_token``, ``signing__private_key`` (the Ed25519 key that signs bin maps).
* **TOML file**: ``config/lpcal.toml`` (relative to the working directory) by default, ignored
  when absent; override with ``LPCAL_CONFIG`` or ``load_settings(path=...)`` (then it must exist).
* **Unknown environment variables**: an ``LPCAL_*`` variable that names no setting (a typo
  such as ``LPCAL_DEFAULT__EPS``) stops :func:`load_settings` with its name; the variables
  of :data:`PROCESS_ENV` (``LPCAL_CONFIG``, ``LPCAL_SECRETS_DIR``, ...) are not settings and
  pass.
* **Profile**: ``profile = "dev"`` (``LPCAL_PROFILE=dev``) changes three defaults for a
  development broker (the embedded one, ``lpcal broker``), see :data:`DEV_PROFILE`; settings
  given explicitly in any source still win. The default profile, ``production``, changes
  nothing.

Per-model settings: ``[defaults]`` is a full :class:`ModelSettings`; ``[models."<name>"]`` holds
partial overrides merged over it (:meth:`Settings.model_settings`). ``k`` may be pinned per model;
when it is not, the daemon learns it from the length of the model's first valid prediction and
keeps it (in the checkpoint) from then on. Pinning ``k`` is recommended: it lets the very first
event be validated against the right length.

Usage::

    from daemon.settings import load_settings, SettingsError
    try:
        s = load_settings()                      # or load_settings("my.toml", http={"port": 9000})
    except SettingsError as e:                   # message lists every bad field
        raise SystemExit(str(e))
    ms = s.model_settings("fraud-v3")            # merged ModelSettings, or None if rejected
    print(ms.eps, ms.drift_threshold_value, s.kafka.topics.predictions)
    log.info("settings %s", s.redacted())        # secrets masked
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
import os
import re
import tomllib
import typing
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NestedSecretsSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError as SourceError

from daemon.specs import DEFAULT_POOL, EpochSpec, MonitorSpec
from lpcal.spec import MODE_DEFAULTS, FitSpec, Mode, parse_p

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_HOLDOUT",
    "DEFAULT_SECRETS_DIR",
    "DEFAULT_WARMUP",
    "DEV_PROFILE",
    "PROCESS_ENV",
    "HttpSettings",
    "JoinSettings",
    "KafkaSettings",
    "ModelOverrides",
    "ModelSettings",
    "Settings",
    "SettingsError",
    "SigningSettings",
    "StateSettings",
    "Topics",
    "load_settings",
    "unknown_env",
]

DEFAULT_CONFIG_PATH = Path("config/lpcal.toml")
DEFAULT_SECRETS_DIR = Path("/var/run/secrets/lpcal")
MAX_K = 100_000
MIB = 1 << 20


class SettingsError(ValueError):
    """Invalid settings; ``str(e)`` lists every bad field as ``path: reason`` lines."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.errors = errors or []


# --------------------------------------------------------------------------- field types


def _upper(v: Any) -> Any:
    return v.strip().upper() if isinstance(v, str) else v


Prob = Annotated[float, Field(gt=0.0, lt=1.0)]
#: The ``p`` of ``Err_p``: :func:`lpcal.spec.parse_p` (its ``InputError`` is a ``ValueError``),
#: the domain the library and CLI use.
PNorm = Annotated[float, BeforeValidator(parse_p)]
PosInt = Annotated[int, Field(gt=0)]
PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]

#: Held-out samples per epoch implied by each ``mode`` when ``holdout`` is unset; ``prescale``
#: and ``outside`` follow :data:`lpcal.spec.MODE_DEFAULTS`.
DEFAULT_HOLDOUT = {"certified": 3_000, "paper": 0}
#: Warm-up samples per epoch when ``warmup`` is unset and ``prescale = "temperature"``.
DEFAULT_WARMUP = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, ser_json_inf_nan="strings")


class ModelSettings(_Strict):
    """Calibration and monitoring settings of one model (``[defaults]`` or merged per model)."""

    eps: Prob = 0.1
    """Target lp calibration error epsilon."""
    p: PNorm = math.inf
    """The p of the lp error (> 1); ``inf`` (also ``"inf"``) for l_inf."""
    delta: Prob = 0.1
    """Failure probability of Algorithm 2."""
    sizing: Literal["practical", "theory"] = "practical"
    """Pool sizes: the paper's bounds (``theory``) or the practical constants."""
    mu_pool: PosInt | None = None
    """Target size of the mu pool (None: from ``sizing``)."""
    pool: PosInt | None = None
    """Target size of every P/E pool (None: from ``sizing``)."""
    variant: Literal["split", "shared"] = "shared"
    """``split``: separate P and E pools per level (the paper's); ``shared``: one PE pool."""
    k: Annotated[int, Field(ge=2, le=MAX_K)] | None = None
    """Number of classes (None: learned from the model's first valid prediction)."""
    mode: Literal["certified", "paper"] = "certified"
    """``certified`` (default): every epoch warms up a temperature pre-calibrator, holds out
    ``holdout`` samples and publishes the candidate (temperature scaling alone, or Algorithm 2 on
    the temperature-scaled bins) with the best held-out certificate; ``paper``: Algorithm 2 as
    in the paper (no pre-calibration, ``rho`` outside B, no held-out share)."""
    prescale: Literal["none", "temperature"] | None = None
    """Pre-calibrator fitted on each epoch's first ``warmup`` samples (None: from ``mode``:
    ``temperature`` certified, ``none`` paper)."""
    outside: Literal["rho", "identity"] | None = None
    """What the bin map returns for bins outside the high-probability set B (None: from
    ``mode``: ``identity`` certified, ``rho`` paper)."""
    holdout: NonNegInt | None = None
    """Held-out samples per epoch, for the certificate (None: 3000 certified, 0 paper)."""
    warmup: NonNegInt | None = None
    """Samples per epoch, taken first, that fit the temperature (None: 10000 with
    ``prescale = "temperature"``, else 0)."""
    drift_threshold: PosFloat | None = None
    """Calibrated Err_p above which drift is declared (None: ``eps``)."""
    window_samples: PosInt | None = 10_000
    """Monitoring window: the last N joined samples (used when window_seconds is None)."""
    window_seconds: PosFloat | None = None
    """Monitoring window: the last T seconds of event time (takes precedence when set)."""
    sample_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Share of the model's events kept, in (0, 1]: an event is kept iff the blake2b hash of its
    id, as a uniform in [0, 1), is below the rate, so a prediction and its outcome are kept or
    dropped together on every replica and in every replay. Dropped events cost one hash and a
    count (``lpcal_events_sampled_out_total``), not a join entry. Kept samples are a uniform
    random subsample: the monitor's estimates stay unbiased, pools fill 1/rate times slower in
    events. For models whose traffic exceeds what calibration needs (docs/scaling.md)."""
    sum_tolerance: Annotated[float, Field(ge=0.0, lt=1.0)] = 1e-3
    """|sum(probs) - 1| allowed before ``normalize`` applies."""
    normalize: Literal["renormalize", "reject"] = "renormalize"
    """Rows off the simplex by more than ``sum_tolerance``: rescale them, or reject the event."""
    drift_sustain_seconds: NonNegFloat = 300.0
    """Seconds of EVENT time (the model's latest event ``ts``, not the wall clock) the drift
    condition must hold continuously before the drift trigger fires: the timer advances only
    as the model's events arrive, and a backlog replayed fast covers it in less wall time."""
    drift_confidence: NonNegFloat = 3.0
    """z of the confidence margin: drift needs ``Err_p - margin(z) > drift_threshold``."""
    drift_min_samples: PosInt = 1_000
    """Minimum samples in the monitoring window before drift can be declared."""
    drift_false_alarm_rate: Annotated[float, Field(ge=0.0, lt=1.0)] = 1e-7
    """Change test of the live bin map (daemon/drift.py): expected false alarms per joined
    sample of a stationary stream (design value); 0 disables the test."""
    drift_baseline_samples: PosInt = 5_000
    """Change test: calibrated samples after a map's installation that form its baseline."""
    drift_min_shift: NonNegFloat = 0.01
    """Change test: the smallest increase, in a statistic's own units (l2 ECE, Err_p), it is
    tuned to detect."""

    @model_validator(mode="after")
    def _window(self) -> ModelSettings:
        if self.window_samples is None and self.window_seconds is None:
            raise ValueError("window_samples: one of window_samples or window_seconds must be set")
        return self

    @model_validator(mode="after")
    def _fit_mode(self) -> ModelSettings:
        """Reject at startup every mode/prescale/holdout/warmup combination an epoch cannot run."""
        problems = []
        if self.prescale_value == "temperature" and self.warmup_value == 0:
            problems.append("warmup: prescale = 'temperature' needs warmup > 0 (the samples "
                            "each epoch fits its temperature on): set warmup > 0 or prescale "
                            "= 'none'")
        if self.prescale_value == "none" and self.warmup_value > 0:
            problems.append(f"warmup: warmup = {self.warmup_value} is only used with prescale = "
                            "'temperature': remove it, or set prescale = 'temperature'")
        if self.mode == "certified" and self.holdout_value == 0:
            problems.append("holdout: mode = 'certified' needs held-out samples (holdout > 0) "
                            "to certify each bin map: set holdout > 0, or mode = 'paper' to "
                            "fit without a certificate")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def fit_spec(self) -> FitSpec:
        """The :class:`lpcal.spec.FitSpec` of this model's fits, every default resolved
        (``pool``: :data:`daemon.specs.DEFAULT_POOL` when unset; ``prescale`` and
        ``outside`` from ``mode``): the one translation of these settings into fit options."""
        return FitSpec(eps=self.eps, p=self.p, delta=self.delta, sizing=self.sizing,
                       pool_size=DEFAULT_POOL if self.pool is None else self.pool,
                       mu_pool=self.mu_pool, variant=self.variant, mode=self.mode,
                       prescale=self.prescale_value, outside=self.outside_value)

    def epoch_spec(self) -> EpochSpec:
        """How this model's epochs are filled and fitted (:class:`daemon.specs.EpochSpec`):
        :meth:`fit_spec` with the held-out and warm-up samples per epoch."""
        return EpochSpec(self.fit_spec(), holdout=self.holdout_value, warmup=self.warmup_value)

    def monitor_spec(self) -> MonitorSpec:
        """This model's window, drift trigger and change test (:class:`daemon.specs.
        MonitorSpec`; ``drift_threshold`` resolved)."""
        return MonitorSpec(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(MonitorSpec)
                              if f.name != "drift_threshold"},
                           drift_threshold=self.drift_threshold_value)

    @property
    def prescale_value(self) -> str:
        """``prescale`` with its default (from ``mode``) applied."""
        return self._from_mode("prescale", self.prescale)

    @property
    def outside_value(self) -> str:
        """``outside`` with its default (from ``mode``) applied."""
        return self._from_mode("outside", self.outside)

    def _from_mode(self, name: str, value: str | None) -> str:
        """``value``, or the default ``mode`` implies for option ``name``
        (:data:`lpcal.spec.MODE_DEFAULTS`)."""
        return MODE_DEFAULTS[Mode(self.mode)][name].value if value is None else value

    @property
    def holdout_value(self) -> int:
        """``holdout`` with its default (from ``mode``) applied."""
        return DEFAULT_HOLDOUT[self.mode] if self.holdout is None else self.holdout

    @property
    def warmup_value(self) -> int:
        """``warmup`` with its default (from ``prescale``) applied."""
        if self.warmup is not None:
            return self.warmup
        return DEFAULT_WARMUP if self.prescale_value == "temperature" else 0

    @property
    def drift_threshold_value(self) -> float:
        """``drift_threshold`` with its default (``eps``) applied."""
        return self.eps if self.drift_threshold is None else self.drift_threshold


def _overrides_model() -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for name, info in ModelSettings.model_fields.items():
        fields[name] = (Optional[info.rebuild_annotation()], None)  # noqa: UP045 (runtime)
    return create_model("ModelOverrides", __base__=_Strict, **fields)


ModelOverrides = _overrides_model()
ModelOverrides.__doc__ = "Per-model overrides: any subset of ModelSettings' fields."


class Topics(_Strict):
    predictions: str = Field("lpcal.predictions", min_length=1, max_length=249)
    outcomes: str = Field("lpcal.outcomes", min_length=1, max_length=249)
    binmaps: str = Field("lpcal.binmaps", min_length=1, max_length=249)
    deadletter: str = Field("lpcal.deadletter", min_length=1, max_length=249)
    state: str = Field("lpcal.state", min_length=1, max_length=249)

    @model_validator(mode="after")
    def _distinct(self) -> Topics:
        names = list(self.model_dump().values())
        if len(set(names)) != len(names):
            raise ValueError(f"topics: names must be distinct, got {names}")
        return self


class KafkaSettings(_Strict):
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
    offset_gaps: Literal["count", "refetch"] = "count"
    """What to do when a fetch skips input offsets (see :mod:`daemon.offset_gaps`): ``count``
    them and go on (production Kafka: holes are transaction markers or compaction), or
    ``refetch`` from the hole until it fills or persists ``offset_gap_grace_seconds`` (the
    embedded Tansu broker, which under load can hand out a batch before an earlier one is
    visible; ``profile = "dev"`` sets it)."""
    offset_gap_grace_seconds: Annotated[float, Field(ge=0.0, le=60.0)] = 2.0
    """With ``offset_gaps = "refetch"``: how long a hole is read again before it is accepted."""

    @model_validator(mode="after")
    def _heartbeat(self) -> KafkaSettings:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be below session_timeout_ms")
        return self

    @model_validator(mode="after")
    def _security(self) -> KafkaSettings:
        problems = []
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism is None:
                problems.append(f"sasl_mechanism: required with security_protocol "
                                f"{self.security_protocol}")
            if not self.sasl_username:
                problems.append(f"sasl_username: required with security_protocol "
                                f"{self.security_protocol}")
            if self.sasl_password is None:
                problems.append(f"sasl_password: required with security_protocol "
                                f"{self.security_protocol}")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                problems.append(f"{name}: file {str(path)!r} does not exist")
        if (self.ssl_keyfile is not None) and self.ssl_certfile is None:
            problems.append("ssl_keyfile: needs ssl_certfile")
        if problems:
            raise ValueError("; ".join(problems))
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


class HttpSettings(_Strict):
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
        raise ValueError(f"admin_token: the admin token {why} (set a usable token, or "
                         "unset it to disable the manual trigger)")

    @property
    def manual_trigger_enabled(self) -> bool:
        return self.admin_token is not None and bool(self.admin_token.get_secret_value())


class JoinSettings(_Strict):
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
    max_ts_skew_seconds: PosFloat = 300.0
    """Seconds of event time an event's ``ts`` may be ahead of its Kafka record timestamp;
    later events are dead-lettered as ``ts_out_of_range``. Bounds how far one event can move a
    model's clocks (join watermark, monitor window, drift timers)."""


class StateSettings(_Strict):
    backend: Literal["kafka", "local"] = "kafka"
    """``kafka``: compacted state topic (no PersistentVolume needed); ``local``: a directory."""
    local_dir: Path = Path(".lpcal-state")
    checkpoint_interval_seconds: PosFloat = 10.0
    max_record_bytes: Annotated[int, Field(ge=64 * 1024, le=1 << 30)] = MIB
    """Largest record the daemon writes to the state topic (value and key). A model's
    checkpoint that is larger (compressed) is split into records of at most this size, written
    before the record that names them (see :mod:`daemon.checkpoint_store`). At startup the
    daemon reads the topic's ``max.message.bytes`` and refuses to start if it is lower.
    The default fits a Kafka broker's default message limit (1 MiB)."""
    max_state_bytes: Annotated[int, Field(ge=1024, le=1 << 31)] = 128 * MIB
    """Largest state value of one model the daemon decodes on restore, after reassembly and
    decompression: a compressed value that would inflate beyond it (a zlib bomb) is not
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


class SigningSettings(_Strict):
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
                problems.append(f"private_key: {e}")
        trusted: list[Any] = [] if self._signer is None else [self._signer.public_key]
        for i, k in enumerate(self.public_keys):
            try:
                trusted.append(load_public_key(k))
            except ValueError as e:
                problems.append(f"public_keys[{i}]: {e}")
        if problems:
            raise ValueError("; ".join(problems))
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


# --------------------------------------------------------------------------- settings

_CONFIG_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "lpcal_config_path", default=None)


def _config_path() -> tuple[Path, bool]:
    """The TOML path and whether it was chosen explicitly (then it must exist)."""
    p = _CONFIG_PATH.get()
    if p is not None:
        return p, True
    env = os.environ.get("LPCAL_CONFIG")
    if env:
        return Path(env), True
    return DEFAULT_CONFIG_PATH, False


def _read_toml(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise SettingsError(f"config file {str(path)!r} not found",
                                [("config", f"file {str(path)!r} not found")])
        return {}
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {str(path)!r} is not valid TOML: {e}",
                            [("config", f"invalid TOML: {e}")]) from None


#: Defaults that ``profile = "dev"`` sets (under the settings given explicitly) for a
#: development broker such as the embedded one (``lpcal broker``), which rejects idempotent
#: producers, can hand out a batch before an earlier one, and starts without topics.
DEV_PROFILE: dict[str, dict[str, Any]] = {
    "kafka": {"enable_idempotence": False, "offset_gaps": "refetch", "create_topics": True},
}

#: ``LPCAL_*`` environment variables that are not settings: read by :func:`load_settings`
#: (``CONFIG``, ``SECRETS_DIR``), the ingest path (``NATIVE``), the embedded broker
#: (``TANSU_BIN``) and the long test runs (``SOAK``, ``SOAK_RATE``).
PROCESS_ENV = frozenset({"LPCAL_CONFIG", "LPCAL_SECRETS_DIR", "LPCAL_NATIVE", "LPCAL_TANSU_BIN",
                         "LPCAL_SOAK", "LPCAL_SOAK_RATE"})


def _lower(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


class Settings(BaseSettings):
    """All daemon settings. Build with :func:`load_settings` (it formats errors)."""

    model_config = SettingsConfigDict(
        env_prefix="LPCAL_",
        env_nested_delimiter="__",
        case_sensitive=False,
        extra="forbid",
        secrets_dir=str(DEFAULT_SECRETS_DIR),
        secrets_dir_missing="ok",
        validate_default=True,
        ser_json_inf_nan="strings",
    )

    profile: Annotated[Literal["production", "dev"], BeforeValidator(_lower)] = "production"
    """``dev``: the defaults of :data:`DEV_PROFILE` for a development broker (the embedded one:
    ``kafka.enable_idempotence = false``, ``kafka.offset_gaps = "refetch"``,
    ``kafka.create_topics = true``); settings given explicitly in any source still win.
    ``production`` (default): every default as documented."""
    kafka: KafkaSettings = KafkaSettings()
    http: HttpSettings = HttpSettings()
    defaults: ModelSettings = ModelSettings()
    models: dict[str, ModelOverrides] = Field(default_factory=dict)  # type: ignore[valid-type]
    unknown_models: Literal["defaults", "reject"] = "defaults"
    """Events of models not in ``models``: calibrate them with ``defaults``, or reject them."""
    max_models: PosInt = 100
    """At most this many models are admitted (bounds Prometheus label cardinality)."""
    max_k: Annotated[int, Field(ge=2, le=MAX_K)] = 1000
    """Largest number of classes a model may have. A learned k above it is rejected
    (``k_too_large``), a configured one stops startup. A pending prediction holds 8 k bytes,
    so k bounds the memory of the join buffer (see ``join.max_bytes_per_model``)."""
    join: JoinSettings = JoinSettings()
    state: StateSettings = StateSettings()
    signing: SigningSettings = SigningSettings()
    shutdown_grace_seconds: PosFloat = 30.0
    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_upper)
    ] = "INFO"

    _merged: dict[str, ModelSettings] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path, required = _config_path()
        toml = InitSettingsSource(settings_cls, init_kwargs=_read_toml(path, required))
        secrets = NestedSecretsSettingsSource(
            file_secret_settings, secrets_prefix="", secrets_nested_delimiter="__",
            secrets_dir_missing="ok")
        return init_settings, env_settings, secrets, toml

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: Any) -> Any:
        """Under ``profile = "dev"``, the :data:`DEV_PROFILE` values fill the settings that no
        source gave (the sources are merged by now: init, environment, secrets, file)."""
        if not isinstance(data, dict) or _lower(data.get("profile")) != "dev":
            return data
        out = dict(data)
        for section, values in DEV_PROFILE.items():
            given = out.get(section)
            if given is None:
                out[section] = dict(values)
            elif isinstance(given, dict):
                out[section] = {**values, **given}
            # a section given as a model instance (init arguments) is explicit: kept as is
        return out

    @model_validator(mode="after")
    def _merge_models(self) -> Settings:
        if len(self.models) > self.max_models:
            raise ValueError(f"models: {len(self.models)} models configured but max_models is "
                             f"{self.max_models}")
        base = self.defaults.model_dump()
        merged: dict[str, ModelSettings] = {}
        problems: list[str] = []
        for name, ov in self.models.items():
            if not name or len(name) > 255:
                problems.append(f"models.{name}: model names must have 1..255 characters")
                continue
            try:
                merged[name] = ModelSettings(**{**base, **ov.model_dump(exclude_unset=True)})
            except ValidationError as e:
                for err in e.errors():
                    loc = ".".join(str(x) for x in err["loc"])
                    msg = err["msg"]
                    if err["type"] == "value_error" and not loc and msg.startswith(
                            "Value error, "):  # a model validator: "field: reason; ..."
                        for part in msg[len("Value error, "):].split("; "):
                            problems.append(f"models.{name}.{part}" if _PART.match(part)
                                            else f"models.{name}: {part}")
                        continue
                    problems.append(f"models.{name}{'.' + loc if loc else ''}: {msg}")
        if self.defaults.k is not None and self.defaults.k > self.max_k:
            problems.append(f"defaults.k: {self.defaults.k} is above max_k = {self.max_k}")
        problems += [f"models.{name}.k: {ms.k} is above max_k = {self.max_k}"
                     for name, ms in merged.items() if ms.k is not None and ms.k > self.max_k]
        if problems:
            raise ValueError("; ".join(problems))
        self._merged = merged
        return self

    # ---------------------------------------------------------------- per-model view
    def model_settings(self, model: str) -> ModelSettings | None:
        """Merged settings of ``model``; ``defaults`` for unknown models, or None if rejected."""
        ms = self._merged.get(model)
        if ms is not None:
            return ms
        return self.defaults if self.unknown_models == "defaults" else None

    @property
    def configured_models(self) -> dict[str, ModelSettings]:
        """Merged settings of the models listed under ``[models]``."""
        return dict(self._merged)

    def redacted(self) -> dict[str, Any]:
        """JSON-safe dict of the effective settings, secrets masked (``**********``).

        ``models`` holds the *merged* per-model settings; infinite floats are ``"Infinity"``.
        """
        out = json.loads(self.model_dump_json())
        out["models"] = {n: json.loads(m.model_dump_json()) for n, m in self._merged.items()}
        return out


_PART = re.compile(r"^([A-Za-z_][\w.\-]*): (.+)$", re.DOTALL)


def _format_errors(e: ValidationError) -> list[tuple[str, str]]:
    """Flatten pydantic errors to ``(field.path, reason)``.

    Model-level validators report ``"field: reason; field: reason"``; each part becomes its own
    item, its field appended to the validator's location (``kafka`` + ``sasl_mechanism``).
    """
    items: list[tuple[str, str]] = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "value_error" and msg.startswith("Value error, "):
            parts = msg[len("Value error, "):].split("; ")
            for part in parts:
                m = _PART.match(part)
                if m:
                    field, why = m.group(1), m.group(2)
                    if field == "topics" and loc.endswith("topics"):
                        field = ""
                    path = ".".join(x for x in (loc, field) if x)
                    items.append((path, why))
                else:
                    items.append((loc or "<settings>", part))
            continue
        if err["type"] == "extra_forbidden":
            msg = f"unknown setting{_did_you_mean(err['loc'])}"
        items.append((loc or "<settings>", msg))
    return items


def _did_you_mean(loc: tuple) -> str:
    """``"; did you mean 'x'?"`` for an unknown key at ``loc`` (a typo of a setting of the same
    section, by :func:`difflib.get_close_matches`), else ``""``."""
    cls: Any = Settings
    parts = list(loc)
    while len(parts) > 1 and cls is not None:
        field = cls.model_fields.get(str(parts.pop(0))) if hasattr(cls, "model_fields") else None
        ann = None if field is None else field.annotation
        if typing.get_origin(ann) is dict:  # models."<name>": the next part is the name
            parts.pop(0)
            ann = typing.get_args(ann)[1]
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if cls is None or len(parts) != 1:
        return ""
    close = get_close_matches(str(parts[0]), sorted(cls.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def load_settings(path: str | os.PathLike | None = None, *,
                  secrets_dir: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Load settings from all sources; raise :class:`SettingsError` naming every bad field.

    ``path``: TOML file (default: ``$LPCAL_CONFIG`` or ``config/lpcal.toml`` if present).
    ``secrets_dir``: secrets directory (default: ``$LPCAL_SECRETS_DIR`` or
    ``/var/run/secrets/lpcal``; a missing directory is ignored).
    ``overrides``: init arguments (highest priority), e.g. ``http={"port": 9000}``.
    """
    token = _CONFIG_PATH.set(Path(path) if path is not None else None)
    try:
        sd = secrets_dir if secrets_dir is not None else os.environ.get("LPCAL_SECRETS_DIR")
        if sd is not None:
            overrides["_secrets_dir"] = str(sd)
        items = [(name, _unknown_env_reason(name)) for name in unknown_env()]
        try:
            settings = Settings(**overrides)
        except ValidationError as e:
            items += _format_errors(e)
        except SourceError as e:  # a value a source cannot parse (LPCAL_KAFKA=x: not JSON)
            items.append(("<environment>", f"{e}" + (f": {e.__cause__}" if e.__cause__ else "")))
        if items:
            lines = "\n".join(f"  - {p}: {why}" for p, why in items)
            raise SettingsError(f"invalid settings ({len(items)} problem"
                                f"{'s' if len(items) != 1 else ''}):\n{lines}", items) from None
        return settings
    finally:
        _CONFIG_PATH.reset(token)


def _nested_fields() -> set[str]:
    """Settings fields set through ``LPCAL_<FIELD>__<KEY>``: sections and the models map."""
    out = set()
    for name, info in Settings.model_fields.items():
        ann = info.annotation
        if typing.get_origin(ann) is dict or (isinstance(ann, type)
                                              and issubclass(ann, BaseModel)):
            out.add(name)
    return out


def unknown_env(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """Names of the ``LPCAL_*`` variables of ``environ`` (default ``os.environ``, any case)
    that name no setting: neither ``LPCAL_<FIELD>`` of a top-level setting nor
    ``LPCAL_<SECTION>__<KEY>...`` of a section (or of ``models``), nor one of
    :data:`PROCESS_ENV`. Unknown keys inside a known section are left to validation, which
    names them (``kafka.bootstrap: unknown setting; did you mean 'bootstrap_servers'?``)."""
    env = os.environ if environ is None else environ
    fields, nested = set(Settings.model_fields), _nested_fields()
    out = []
    for name in env:
        if not name.upper().startswith("LPCAL_") or name.upper() in PROCESS_ENV:
            continue
        head, sep, tail = name[len("LPCAL_"):].lower().partition("__")
        if head not in fields or (sep and (head not in nested or not tail)):
            out.append(name)
    return sorted(out)


def _unknown_env_reason(name: str) -> str:
    """Why ``name`` is unknown, with the likely intended variable when one is close."""
    rest = name[len("LPCAL_"):]
    head = rest.lower().partition("__")[0]
    if head in _nested_fields():  # LPCAL_KAFKA__ with nothing after the delimiter
        return f"unknown environment variable: {head!r} needs a key after '__'"
    if head in Settings.model_fields:  # a plain setting given as a section
        return f"unknown environment variable: {head!r} is a setting, not a section"
    close = get_close_matches(head, sorted(Settings.model_fields), n=1, cutoff=0.6)
    hint = (f"; did you mean LPCAL_{close[0].upper()}{rest[len(head):]}?" if close
            else "; see config/README.md")
    return f"unknown environment variable: {head!r} is no setting or section{hint}"
