"""Loading the settings: :func:`load_settings` reads every source and reports every bad
field at once, as ``path: reason`` lines (:class:`~daemon.settings.base.SettingsError`), with
a did-you-mean for a mistyped key and for an ``LPCAL_*`` variable that names no setting
(:func:`unknown_env`)."""

from __future__ import annotations

import os
import typing
from difflib import get_close_matches
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings.exceptions import SettingsError as SourceError

from daemon.settings.base import SettingsError
from daemon.settings.root import Settings, reason
from daemon.settings.sources import using_config

__all__ = ["PROCESS_ENV", "format_errors", "load_settings", "unknown_env"]

#: ``LPCAL_*`` environment variables that are not settings: read by :func:`load_settings`
#: (``CONFIG``, ``SECRETS_DIR``), the ingest path (``NATIVE``), the embedded broker
#: (``TANSU_BIN``) and the long test runs (``SOAK``, ``SOAK_RATE``).
PROCESS_ENV = frozenset({"LPCAL_CONFIG", "LPCAL_SECRETS_DIR", "LPCAL_NATIVE", "LPCAL_TANSU_BIN",
                         "LPCAL_SOAK", "LPCAL_SOAK_RATE"})


def format_errors(e: ValidationError) -> list[tuple[str, str]]:
    """Flatten pydantic errors to ``(field.path, reason)``: every error is at its field already
    (cross-field checks raise one error per field, :func:`~daemon.settings.base.field_errors`);
    an unknown key says which setting it is likely a typo of."""
    items: list[tuple[str, str]] = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        why = (f"unknown setting{_did_you_mean(err['loc'])}" if err["type"] == "extra_forbidden"
               else reason(err))
        items.append((loc or "<settings>", why))
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
    with using_config(path):
        sd = secrets_dir if secrets_dir is not None else os.environ.get("LPCAL_SECRETS_DIR")
        if sd is not None:
            overrides["_secrets_dir"] = str(sd)
        items = [(name, _unknown_env_reason(name)) for name in unknown_env()]
        try:
            settings = Settings(**overrides)
        except ValidationError as e:
            items += format_errors(e)
        except SourceError as e:  # a value a source cannot parse (LPCAL_KAFKA=x: not JSON)
            items.append(("<environment>", f"{e}" + (f": {e.__cause__}" if e.__cause__ else "")))
        if items:
            lines = "\n".join(f"  - {p}: {why}" for p, why in items)
            raise SettingsError(f"invalid settings ({len(items)} problem"
                                f"{'s' if len(items) != 1 else ''}):\n{lines}", items) from None
        return settings


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
