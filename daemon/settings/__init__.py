"""Settings of the lpcal daemon (pydantic-settings v2): the package's public face.

The package is split along its seams: :mod:`daemon.settings.sections` (``[kafka]``, ``[http]``,
``[join]``, ``[state]``, ``[signing]``), :mod:`daemon.settings.model` (the per-model settings,
with :meth:`ModelSettings.fit_spec` and ``monitor_spec``), :mod:`daemon.settings.sources` (the
TOML file and the secrets directory), :mod:`daemon.settings.root` (:class:`Settings`),
:mod:`daemon.settings.load` (:func:`load_settings` and its error report) and
:mod:`daemon.settings.base` (field types, :class:`SettingsError`, per-field errors); import from
here.

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
    spec = ms.fit_spec()                         # the lpcal.spec.FitSpec of its fits
    log.info("settings %s", s.redacted())        # secrets masked
"""

from daemon.settings.base import MIB, SettingsError
from daemon.settings.load import PROCESS_ENV, load_settings, unknown_env
from daemon.settings.model import DEFAULT_HOLDOUT, DEFAULT_WARMUP, ModelOverrides, ModelSettings
from daemon.settings.root import DEV_PROFILE, Settings
from daemon.settings.sections import (
    HttpSettings,
    JoinSettings,
    KafkaSettings,
    SigningSettings,
    StateSettings,
    Topics,
)
from daemon.settings.sources import DEFAULT_CONFIG_PATH, DEFAULT_SECRETS_DIR

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_HOLDOUT",
    "DEFAULT_SECRETS_DIR",
    "DEFAULT_WARMUP",
    "DEV_PROFILE",
    "MIB",
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
