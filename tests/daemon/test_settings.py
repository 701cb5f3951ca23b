"""daemon.settings: sources, precedence, per-model merging, error reporting, redaction."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from daemon.settings import ModelSettings, Settings, SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolate_every_test(isolated):
    """Every test here runs ``isolated`` (tests/daemon/conftest.py)."""
    return isolated


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_without_any_source():
    s = load_settings()
    assert s.kafka.topics.predictions == "lpcal.predictions"
    assert s.kafka.topics.deadletter == "lpcal.deadletter"
    assert s.kafka.enable_idempotence is True
    assert s.kafka.max_message_bytes == 1 << 20
    assert s.http.port == 8080 and not s.http.manual_trigger_enabled
    assert s.defaults.eps == 0.1 and math.isinf(s.defaults.p) and s.defaults.delta == 0.1
    assert s.defaults.drift_threshold_value == 0.1  # defaults to eps
    assert s.shutdown_grace_seconds == 30
    assert s.model_settings("anything") == s.defaults


def test_env_nesting_and_inf_strings(monkeypatch):
    monkeypatch.setenv("LPCAL_KAFKA__BOOTSTRAP_SERVERS", "b1:9092,b2:9092")
    monkeypatch.setenv("LPCAL_KAFKA__TOPICS__OUTCOMES", "my.outcomes")
    monkeypatch.setenv("LPCAL_KAFKA__ENABLE_IDEMPOTENCE", "false")
    monkeypatch.setenv("LPCAL_DEFAULTS__P", "Infinity")
    monkeypatch.setenv("LPCAL_DEFAULTS__EPS", "0.05")
    monkeypatch.setenv("LPCAL_MODELS__FRAUD-V3__K", "3")
    monkeypatch.setenv("LPCAL_LOG_LEVEL", "debug")
    s = load_settings()
    assert s.kafka.bootstrap_servers == "b1:9092,b2:9092"
    assert s.kafka.topics.outcomes == "my.outcomes"
    assert s.kafka.topics.predictions == "lpcal.predictions"
    assert s.kafka.enable_idempotence is False
    assert math.isinf(s.defaults.p) and s.defaults.eps == 0.05
    m = s.model_settings("fraud-v3")
    assert m.k == 3 and m.eps == 0.05  # override merged over env defaults
    assert s.log_level == "DEBUG"


def test_toml_file_and_model_overrides(isolated):
    cfg = write(isolated / "c.toml", """
shutdown_grace_seconds = 12
unknown_models = "reject"
[kafka]
group_id = "g1"
[defaults]
eps = 0.2
p = "inf"
window_samples = 500
[models."fraud-v3"]
k = 3
p = 2
drift_threshold = 0.3
window_seconds = 60
[models.other]
eps = 0.05
""")
    s = load_settings(cfg)
    assert s.shutdown_grace_seconds == 12 and s.kafka.group_id == "g1"
    f = s.model_settings("fraud-v3")
    assert (f.k, f.p, f.eps, f.drift_threshold_value, f.window_seconds, f.window_samples) == \
        (3, 2.0, 0.2, 0.3, 60.0, 500)
    o = s.model_settings("other")
    assert o.eps == 0.05 and o.drift_threshold_value == 0.05 and o.k is None
    assert s.model_settings("unknown") is None  # unknown_models = "reject"
    assert set(s.configured_models) == {"fraud-v3", "other"}


def test_config_path_from_env_and_default_location(isolated, monkeypatch):
    write(isolated / "env.toml", "[http]\nport = 9001\n")
    monkeypatch.setenv("LPCAL_CONFIG", str(isolated / "env.toml"))
    assert load_settings().http.port == 9001
    # explicit path argument beats LPCAL_CONFIG
    write(isolated / "arg.toml", "[http]\nport = 9002\n")
    assert load_settings(isolated / "arg.toml").http.port == 9002
    monkeypatch.delenv("LPCAL_CONFIG")
    (isolated / "config").mkdir()
    write(isolated / "config" / "lpcal.toml", "[http]\nport = 9003\n")
    assert load_settings().http.port == 9003  # config/lpcal.toml relative to the cwd


def test_explicit_missing_or_broken_config_is_an_error(isolated):
    with pytest.raises(SettingsError, match="not found"):
        load_settings(isolated / "nope.toml")
    write(isolated / "bad.toml", "[kafka\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(isolated / "bad.toml")


def test_secrets_dir_files(isolated):
    secrets = isolated / "secrets"
    write(secrets / "kafka__sasl_password", "s3cret\n")
    write(secrets / "http__admin_token", "tok")
    s = load_settings(kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                             "sasl_username": "u"})
    assert s.kafka.sasl_password.get_secret_value().strip() == "s3cret"
    assert s.http.admin_token.get_secret_value() == "tok"
    assert s.http.manual_trigger_enabled
    kw = s.kafka.aiokafka_kwargs()
    assert kw["sasl_mechanism"] == "SCRAM-SHA-512" and kw["sasl_plain_username"] == "u"
    assert kw["sasl_plain_password"].strip() == "s3cret" and "ssl_context" in kw


def test_missing_secrets_dir_is_ignored(isolated):
    assert load_settings(secrets_dir=isolated / "does-not-exist").http.port == 8080


def test_precedence_init_env_secrets_toml_defaults(isolated, monkeypatch):
    secrets = isolated / "secrets"
    cfg = write(isolated / "c.toml", """
[http]
port = 1001
host = "toml-host"
max_body_bytes = 1001
[kafka]
client_id = "toml-client"
""")
    write(secrets / "http__port", "2002")
    write(secrets / "http__host", "secret-host")
    write(secrets / "kafka__client_id", "secret-client")
    monkeypatch.setenv("LPCAL_HTTP__PORT", "3003")
    monkeypatch.setenv("LPCAL_HTTP__HOST", "env-host")
    s = load_settings(cfg, http={"port": 4004})
    assert s.http.port == 4004                 # init > env
    assert s.http.host == "env-host"           # env > secrets
    assert s.kafka.client_id == "secret-client"  # secrets > toml
    assert s.http.max_body_bytes == 1001       # toml > defaults
    assert s.kafka.group_id == "lpcal"         # defaults


def test_every_bad_field_is_named(isolated, monkeypatch):
    cfg = write(isolated / "c.toml", """
[kafka]
security_protocol = "SASL_SSL"
max_message_bytes = 10
[defaults]
eps = 1.5
p = 0.5
[models."fraud-v3"]
delta = 2
""")
    monkeypatch.setenv("LPCAL_HTTP__PORT", "70000")
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg, join={"ttl_seconds": -1})
    msg = str(ei.value)
    paths = {p for p, _ in ei.value.errors}
    for path in ("kafka.max_message_bytes", "defaults.eps", "defaults.p", "http.port",
                 "join.ttl_seconds"):
        assert path in paths and path in msg, path
    # cross-field errors (reported once field errors are fixed) also name their fields
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg, kafka={"max_message_bytes": 4096}, defaults={"eps": 0.1, "p": 2})
    paths = {p for p, _ in ei.value.errors}
    assert {"kafka.sasl_mechanism", "kafka.sasl_username", "kafka.sasl_password"} <= paths
    write(cfg, "[models.\"fraud-v3\"]\ndelta = 2\nepss = 1\n")
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg)
    paths = {p for p, _ in ei.value.errors}
    assert {"models.fraud-v3.delta", "models.fraud-v3.epss"} <= paths


def test_merged_model_settings_are_validated(isolated):
    cfg = write(isolated / "c.toml", """
[defaults]
window_samples = 100
[models.a]
window_samples = -3
""")
    with pytest.raises(SettingsError, match=r"models\.a\.window_samples"):
        load_settings(cfg)
    with pytest.raises(SettingsError, match="max_models"):
        load_settings(max_models=1, models={"a": {}, "b": {}})
    with pytest.raises(SettingsError, match=r"kafka\.topics"):
        load_settings(kafka={"topics": {"state": "lpcal.binmaps"}})


def test_ssl_files_must_exist(isolated):
    with pytest.raises(SettingsError, match="kafka.ssl_cafile"):
        load_settings(kafka={"security_protocol": "SSL", "ssl_cafile": str(isolated / "no.pem")})


def test_redacted_masks_secrets_and_is_json_safe(isolated):
    s = load_settings(http={"admin_token": "very-secret"},
                      kafka={"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                             "sasl_username": "u", "sasl_password": "hunter2"},
                      models={"m": {"eps": 0.2}})
    r = s.redacted()
    text = json.dumps(r, allow_nan=False)  # JSON-safe: inf is rendered as a string
    assert "very-secret" not in text and "hunter2" not in text
    assert r["http"]["admin_token"] == "**********"
    assert r["kafka"]["sasl_password"] == "**********"
    assert r["models"]["m"]["eps"] == 0.2 and r["models"]["m"]["p"] == "Infinity"
    assert float(r["defaults"]["p"]) == math.inf


def test_example_config_file_loads_and_documents_every_setting(isolated):
    shutil.copy(REPO / "config" / "lpcal.toml", isolated / "lpcal.toml")
    s = load_settings(isolated / "lpcal.toml")
    f = s.model_settings("fraud-v3")
    assert f is not None and f.k == 3 and f.eps == 0.05
    assert s.shutdown_grace_seconds == 30
    readme = (REPO / "config" / "README.md").read_text()
    for section, model in (("kafka", Settings.model_fields["kafka"].annotation),
                           ("http", Settings.model_fields["http"].annotation),
                           ("join", Settings.model_fields["join"].annotation),
                           ("state", Settings.model_fields["state"].annotation),
                           ("defaults", ModelSettings)):
        for name in model.model_fields:
            assert f"`{name}`" in readme, f"config/README.md does not document {section}.{name}"
    for name in Settings.model_fields:
        assert f"`{name}`" in readme, f"config/README.md does not document {name}"


def test_consumer_settings_reach_the_input_consumer(isolated):
    """kafka.session_timeout_ms / heartbeat_interval_ms / fetch_max_wait_ms are what the
    daemon's input consumer gets (they were once hard-coded); constructor overrides win."""
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor

    from daemon.service import Daemon

    s = Settings(kafka={"session_timeout_ms": 4000, "heartbeat_interval_ms": 500,
                        "fetch_max_wait_ms": 37, "max_message_bytes": 4 << 20})
    opts = Daemon(s).clients.consumer_options()
    assert (opts["session_timeout_ms"], opts["heartbeat_interval_ms"],
            opts["fetch_max_wait_ms"]) == (4000, 500, 37)
    assert opts["max_partition_fetch_bytes"] == 8 << 20 and opts["fetch_max_bytes"] == 16 << 20
    assert opts["partition_assignment_strategy"] == (RangePartitionAssignor,)
    d = Settings().kafka
    defaults = Daemon(Settings()).clients.consumer_options()
    assert defaults["fetch_max_wait_ms"] == d.fetch_max_wait_ms
    assert (defaults["max_partition_fetch_bytes"], defaults["fetch_max_bytes"]) == (8 << 20,
                                                                                   16 << 20)
    # a message of max_message_bytes stays fetchable above the fetch sizes
    big = Settings(kafka={"max_message_bytes": 32 << 20})
    assert Daemon(big).clients.consumer_options()["max_partition_fetch_bytes"] == 32 << 20
    small = Settings(kafka={"max_partition_fetch_bytes": 1 << 20, "fetch_max_bytes": 2 << 20})
    opts = Daemon(small).clients.consumer_options()
    assert (opts["max_partition_fetch_bytes"], opts["fetch_max_bytes"]) == (1 << 20, 2 << 20)
    assert Daemon(s, consumer_options={"session_timeout_ms": 2000}).clients.consumer_options()[
        "session_timeout_ms"] == 2000


def test_a_fetch_smaller_than_one_partitions_fetch_is_refused(isolated):
    """kafka.fetch_max_bytes bounds a whole fetch: below max_partition_fetch_bytes, one
    partition's fetch could not be returned whole; the error names both settings."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fetch_max_bytes .* max_partition_fetch_bytes"):
        Settings(kafka={"max_partition_fetch_bytes": 8 << 20, "fetch_max_bytes": 4 << 20})
    with pytest.raises(ValidationError, match="max_partition_fetch_bytes"):
        Settings(kafka={"max_partition_fetch_bytes": 1024})


def test_fit_mode_defaults_follow_the_mode(isolated):
    d = ModelSettings()
    assert (d.mode, d.prescale, d.outside, d.holdout, d.warmup) == (
        "certified", None, None, None, None)
    assert (d.prescale_value, d.outside_value, d.holdout_value, d.warmup_value) == (
        "temperature", "identity", 3000, 10000)
    paper = ModelSettings(mode="paper")
    assert (paper.prescale_value, paper.outside_value, paper.holdout_value,
            paper.warmup_value) == ("none", "rho", 0, 0)
    # the paper's mode, pre-scaled: the warm-up follows prescale; held-out share on request
    scaled = ModelSettings(mode="paper", prescale="temperature", holdout=500)
    assert (scaled.warmup_value, scaled.holdout_value, scaled.outside_value) == (10000, 500, "rho")
    # per-model overrides resolve over the merged settings, not over [defaults]' resolution
    (isolated / "lpcal.toml").write_text(
        '[defaults]\nrecovery = "epochs"\nwarmup = 500\n[models.a]\nmode = "paper"\nwarmup = 0\n'
        '[models.b]\nholdout = 100\n')
    s = load_settings(isolated / "lpcal.toml")
    a, b = s.model_settings("a"), s.model_settings("b")
    assert (a.prescale_value, a.warmup_value, a.holdout_value) == ("none", 0, 0)
    assert (b.mode, b.warmup_value, b.holdout_value) == ("certified", 500, 100)


def test_recovery_defaults_to_online_for_the_certified_mode_and_epochs_for_the_paper(isolated):
    d, paper = ModelSettings(), ModelSettings(mode="paper")
    assert (d.recovery, d.recovery_value, d.online_spec().online) == (None, "online", True)
    assert (paper.recovery_value, paper.online_spec().online) == ("epochs", False)
    assert ModelSettings(recovery="epochs").online_spec().recovery == "epochs"
    # what the online loop runs anyway may be said explicitly
    ok = ModelSettings(prescale="temperature", outside="identity", sizing="practical",
                       variant="shared")
    assert ok.recovery_value == "online" and ok.epoch_only_set() == []
    # per model: [defaults] keeps the epochs for one model, the paper's mode for another
    (isolated / "lpcal.toml").write_text(
        '[models.a]\nrecovery = "epochs"\npool = 2000\n[models.b]\nmode = "paper"\n'
        '[models.c]\nbucket_size = 500\n')
    s = load_settings(isolated / "lpcal.toml")
    got = {m: s.model_settings(m).online_spec() for m in "abc"}
    assert [got[m].recovery for m in "abc"] == ["epochs", "epochs", "online"]
    assert got["c"].bucket_size == 500 and s.model_settings("zz").recovery_value == "online"


@pytest.mark.parametrize("toml, field, words", [
    ('[defaults]\nprescale = "temperature"\nwarmup = 0\n', "defaults.warmup", "warmup > 0"),
    # the library's data-driven eps: refused with what to do instead, per model too
    ('[defaults]\neps = "auto"\n', "defaults.eps", "lpcal fit --eps auto"),
    ('[models.m]\neps = "AUTO"\n', "models.m.eps", "before its first sample"),
    # the paper's mode is Algorithm 2 exactly: fixed epochs only
    ('[defaults]\nmode = "paper"\nrecovery = "online"\n', "defaults.recovery",
     "Algorithm 2 exactly"),
    # epoch options never silently ignored by the online loop (the default)
    ('[defaults]\nwarmup = 500\n', "defaults.warmup", "set recovery = 'epochs' to keep it"),
    ('[defaults]\npool = 500\n', "defaults.pool", "recovery = 'epochs' only"),
    ('[defaults]\nholdout = 500\n', "defaults.holdout", "recovery = 'epochs' only"),
    ('[defaults]\nmu_pool = 500\n', "defaults.mu_pool", "recovery = 'epochs' only"),
    ('[defaults]\nsizing = "theory"\n', "defaults.sizing", "recovery = 'epochs' only"),
    ('[defaults]\nvariant = "split"\n', "defaults.variant", "recovery = 'epochs' only"),
    ('[defaults]\nprescale = "none"\nholdout = 10\nrecovery = "online"\n',
     "defaults.prescale", "recovery = 'epochs' only"),
    ('[defaults]\noutside = "rho"\n', "defaults.outside", "recovery = 'epochs' only"),
    ('[defaults]\nwarmup = 500\n[models.m]\nrecovery = "online"\n', "defaults.warmup",
     "recovery = 'epochs' only"),
    ('[defaults]\nrecovery = "epochs"\nwarmup = 500\n[models.m]\nrecovery = "online"\n',
     "models.m.warmup", "recovery = 'epochs' only"),
    ('[defaults]\nmode = "paper"\nwarmup = 10\n', "defaults.warmup",
     "only used with prescale"),
    ('[defaults]\nholdout = 0\n', "defaults.holdout", "mode = 'certified' needs"),
    ('[defaults]\nholdout = -1\n', "defaults.holdout", "greater than or equal to 0"),
    ('[defaults]\nwarmup = -5\n', "defaults.warmup", "greater than or equal to 0"),
    ('[defaults]\nmode = "bayes"\n', "defaults.mode", "certified"),
    ('[models.m]\nprescale = "temperature"\nmode = "paper"\nwarmup = 0\n', "models.m.warmup",
     "warmup > 0"),
    ('[models.m]\nholdout = 0\nprescale = "none"\n', "models.m.holdout", "mode = 'paper'"),
])
def test_impossible_fit_mode_combinations_fail_at_startup(isolated, toml, field, words):
    """Rejected when the settings load (naming the field), never at a model's first event."""
    (isolated / "lpcal.toml").write_text(toml)
    with pytest.raises(SettingsError) as ei:
        load_settings(isolated / "lpcal.toml")
    assert any(path == field and words in why for path, why in ei.value.errors), ei.value.errors


@pytest.mark.parametrize("source", ["toml", "secrets", "env", "init"])
@pytest.mark.parametrize("value", ["", "   ", " s3cr3t", "s3cr3t\n ", "s3\x00cr3t"])
def test_admin_token_that_can_never_authenticate_is_refused(isolated, monkeypatch, source,
                                                            value):
    """An empty admin token was accepted but could never authenticate (nor one with
    surrounding blanks, which HTTP strips from header values, or control characters)."""
    if source == "secrets" and value != value.strip():
        pytest.skip("the secrets dir strips file contents (a valid token)")
    if source == "env" and "\x00" in value:
        pytest.skip("environment values cannot hold NUL")
    args, kw = (), {}
    if source == "toml":
        args = (write(isolated / "lpcal.toml", f"[http]\nadmin_token = {json.dumps(value)}\n"),)
    elif source == "secrets":
        write(isolated / "secrets" / "http__admin_token", value)
    elif source == "env":
        monkeypatch.setenv("LPCAL_HTTP__ADMIN_TOKEN", value)
    else:
        kw = {"http": {"admin_token": value}}
    with pytest.raises(SettingsError) as e:
        load_settings(*args, **kw)
    assert [p for p, _ in e.value.errors] == ["http.admin_token"], str(e.value)
    assert "unset it to disable" in str(e.value)
    assert value.strip() == "" or value.strip() not in str(e.value)  # no secret in the message


def test_http_hardening_settings_are_validated(isolated):
    s = load_settings()
    assert s.http.max_connections >= 16 and s.http.idle_timeout_seconds > 0
    assert s.http.body_timeout_seconds > 0
    for bad in ({"max_connections": 0}, {"idle_timeout_seconds": 0},
                {"body_timeout_seconds": -1}):
        with pytest.raises(SettingsError, match=f"http.{next(iter(bad))}"):
            load_settings(http=bad)


def test_toml_typos_get_a_did_you_mean(isolated):
    write(isolated / "typo.toml", 'max_modles = 3\n[kafka]\nbootstrap_server = "x"\n'
          '[defaults]\nepss = 0.1\nzzz = 1\n[models."m"]\neps_ = 0.2\n'
          '[signing]\nprivate_kye = "x"\n')
    with pytest.raises(SettingsError) as e:
        load_settings(isolated / "typo.toml")
    assert dict(e.value.errors) == {
        "max_modles": "unknown setting; did you mean 'max_models'?",
        "kafka.bootstrap_server": "unknown setting; did you mean 'bootstrap_servers'?",
        "defaults.epss": "unknown setting; did you mean 'eps'?",
        "defaults.zzz": "unknown setting",
        "models.m.eps_": "unknown setting; did you mean 'eps'?",
        "signing.private_kye": "unknown setting; did you mean 'private_key'?",
    }


def test_keygen_directory_is_a_secrets_dir(isolated):
    from lpcal.signing import PRIVATE_KEY_FILE, keygen

    private, _, kid = keygen(isolated / "keys")
    assert private.name == PRIVATE_KEY_FILE == "signing__private_key"
    signer = load_settings(secrets_dir=isolated / "keys").signing.signer()
    assert signer is not None and signer.key_id == kid


def test_checks_across_fields_are_errors_at_each_field(isolated):
    """Validators that check several fields raise one error per bad field, at its location
    (no message joined and parsed back): kafka's SASL fields and heartbeat, a merged model's
    warm-up, a signing key by its index."""
    from pydantic import ValidationError

    errors = {}
    for kw in ({"kafka": {"security_protocol": "SASL_SSL", "heartbeat_interval_ms": 20_000,
                          "session_timeout_ms": 10_000}},
               {"models": {"m": {"mode": "paper", "warmup": 5}}}):
        with pytest.raises(ValidationError) as ei:
            Settings(**kw, _secrets_dir=str(isolated))
        errors.update({e["loc"]: e for e in ei.value.errors()})
    for loc in (("kafka", "sasl_mechanism"), ("kafka", "sasl_username"),
                ("kafka", "sasl_password"), ("kafka", "heartbeat_interval_ms"),
                ("models", "m", "warmup")):
        assert errors[loc]["type"] == "lpcal_setting", loc
    assert errors[("models", "m", "warmup")]["msg"].startswith("warmup = 5 is only used")
    with pytest.raises(SettingsError) as e:
        load_settings(signing={"public_keys": ["zz"]},
                      kafka={"heartbeat_interval_ms": 20_000, "session_timeout_ms": 10_000})
    assert {p for p, _ in e.value.errors} == {"signing.public_keys.0",
                                              "kafka.heartbeat_interval_ms"}


def test_model_settings_are_the_only_translation_into_specs():
    ms = ModelSettings(eps=0.05, p=2, mode="paper", pool=700, drift_threshold=None,
                       window_seconds=60.0)
    f = ms.fit_spec()
    assert (f.eps, f.p, f.mode, f.prescale, f.outside, f.pool_size) == (
        0.05, 2.0, "paper", "none", "rho", 700)
    e = ms.epoch_spec()
    assert (e.fit, e.holdout, e.warmup) == (f, 0, 0)
    m = ms.monitor_spec()
    assert (m.drift_threshold, m.window_seconds, m.drift_min_samples) == (0.05, 60.0, 1000)
    unset = ModelSettings().epoch_spec()
    assert unset.fit.pool_size is None and unset.layout(3).targets["mu"] == 5000


def test_checkpoint_pacing_share_defaults_to_a_tenth_and_must_be_a_share(isolated):
    s = load_settings()
    assert s.state.checkpoint_max_cpu_share == 0.1
    assert load_settings(state={"checkpoint_max_cpu_share": 1}).state.checkpoint_max_cpu_share == 1
    cfg = write(isolated / "c.toml", "[state]\ncheckpoint_max_cpu_share = 0.25\n")
    assert load_settings(cfg).state.checkpoint_max_cpu_share == 0.25
    for bad in (0, -0.1, 1.5):
        with pytest.raises(SettingsError) as ei:
            load_settings(state={"checkpoint_max_cpu_share": bad})
        assert "state.checkpoint_max_cpu_share" in {p for p, _ in ei.value.errors}
