"""The root of the daemon's settings: its sections, ``[defaults]`` and ``[models]`` merged
per model, the ``profile`` and the order of the sources (:mod:`daemon.settings.sources`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from daemon.limits import MAX_K, MAX_MODEL_LEN
from daemon.settings.base import Lower, PosFloat, PosInt, Upper, field_errors
from daemon.settings.model import ModelOverrides, ModelSettings
from daemon.settings.sections import (
    HttpSettings,
    JoinSettings,
    KafkaSettings,
    SigningSettings,
    StateSettings,
)
from daemon.settings.sources import DEFAULT_SECRETS_DIR, TomlFileSource, secrets_source

__all__ = ["DEV_PROFILE", "Settings", "reason"]

#: Defaults that ``profile = "dev"`` sets (under the settings given explicitly) for a
#: development broker such as the embedded one (``lpcal broker``), which rejects idempotent
#: producers, can hand out a batch before an earlier one, and starts without topics.
DEV_PROFILE: dict[str, dict[str, Any]] = {
    "kafka": {"enable_idempotence": False, "offset_gaps": "refetch", "create_topics": True},
}


def reason(err: Any) -> str:
    """What a pydantic error says, without the ``Value error, `` pydantic puts in front of the
    message of a ``ValueError`` raised by a validator."""
    return str(err["msg"]).removeprefix("Value error, ")


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

    profile: Annotated[Literal["production", "dev"], Lower] = "production"
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
    blas_threads: Annotated[int, Field(ge=0, le=1024)] = 1
    """Threads of numpy's BLAS library (OpenBLAS or MKL) in the daemon process, applied at
    startup (:mod:`daemon.blas`). The daemon computes on its event loop and one fit worker;
    the library's default, one thread per CPU of the host (not of the container's CPU limit),
    only competes with them. 0: keep the library's default."""
    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], Upper
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
        return (init_settings, env_settings, secrets_source(file_secret_settings),
                TomlFileSource(settings_cls))

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: Any) -> Any:
        """Under ``profile = "dev"``, the :data:`DEV_PROFILE` values fill the settings that no
        source gave (the sources are merged by now: init, environment, secrets, file)."""
        if not isinstance(data, dict) or str(data.get("profile")).strip().lower() != "dev":
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
            field_errors("Settings", [(("models",), (f"{len(self.models)} models configured but "
                                       f"max_models is {self.max_models}"))])
        base = self.defaults.model_dump()
        merged: dict[str, ModelSettings] = {}
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name, ov in self.models.items():
            if not name or len(name) > MAX_MODEL_LEN:
                problems.append((("models", name), f"model names must have 1..{MAX_MODEL_LEN} characters"))
                continue
            try:
                merged[name] = ModelSettings(**{**base, **ov.model_dump(exclude_unset=True)})
            except ValidationError as e:  # the merge is invalid: each error at its field
                problems += [(("models", name, *err["loc"]), reason(err)) for err in e.errors()]
        if self.defaults.k is not None and self.defaults.k > self.max_k:
            problems.append((("defaults", "k"), (f"{self.defaults.k} is above max_k = "
                             f"{self.max_k}")))
        problems += [(("models", name, "k"), f"{ms.k} is above max_k = {self.max_k}")
                     for name, ms in merged.items() if ms.k is not None and ms.k > self.max_k]
        field_errors("Settings", problems)
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

