"""Where the settings come from, highest priority first: init arguments, the environment
(``LPCAL_*``), the secrets directory, the TOML file (:class:`TomlFileSource`), the defaults.

The TOML file is pydantic-settings' :class:`~pydantic_settings.TomlConfigSettingsSource` with two
rules of ours: a file chosen explicitly (``load_settings(path)`` or ``LPCAL_CONFIG``) must exist,
and a file that is not valid TOML is a :class:`~daemon.settings.base.SettingsError` naming it
(the default ``config/lpcal.toml`` is ignored when absent).
"""

from __future__ import annotations

import contextvars
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    NestedSecretsSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from daemon.settings.base import SettingsError

__all__ = ["DEFAULT_CONFIG_PATH", "DEFAULT_SECRETS_DIR", "TomlFileSource", "config_path",
           "secrets_source", "using_config"]

DEFAULT_CONFIG_PATH = Path("config/lpcal.toml")
DEFAULT_SECRETS_DIR = Path("/var/run/secrets/lpcal")

_CONFIG_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "lpcal_config_path", default=None)


@contextmanager
def using_config(path: str | os.PathLike | None) -> Iterator[None]:
    """Within the block, settings read the TOML file ``path`` (None: the default rule of
    :func:`config_path`)."""
    token = _CONFIG_PATH.set(Path(path) if path is not None else None)
    try:
        yield
    finally:
        _CONFIG_PATH.reset(token)


def config_path() -> tuple[Path, bool]:
    """The TOML path and whether it was chosen explicitly (then it must exist): the path of
    :func:`using_config`, else ``$LPCAL_CONFIG``, else :data:`DEFAULT_CONFIG_PATH`."""
    p = _CONFIG_PATH.get()
    if p is not None:
        return p, True
    env = os.environ.get("LPCAL_CONFIG")
    if env:
        return Path(env), True
    return DEFAULT_CONFIG_PATH, False


class TomlFileSource(TomlConfigSettingsSource):
    """The TOML file of :func:`config_path` (pydantic-settings' TOML source): a missing file
    is an error when it was chosen explicitly, and invalid TOML always is."""

    def __init__(self, settings_cls: type[BaseSettings]):
        path, required = config_path()
        if required and not path.is_file():
            raise SettingsError(f"config file {str(path)!r} not found",
                                [("config", f"file {str(path)!r} not found")])
        self.path = path
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        try:
            return super()._read_file(file_path)
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"config file {str(file_path)!r} is not valid TOML: {e}",
                                [("config", f"invalid TOML: {e}")]) from None


def secrets_source(file_secret_settings: PydanticBaseSettingsSource
                   ) -> PydanticBaseSettingsSource:
    """The secrets directory, one file per setting named like its environment variable without
    the prefix (``kafka__sasl_password``); a missing directory is ignored."""
    return NestedSecretsSettingsSource(file_secret_settings, secrets_prefix="",
                                       secrets_nested_delimiter="__", secrets_dir_missing="ok")
