"""The newcomer path without a broker: the ``lpcal`` console script and the layout
(``daemon.cli`` dispatches, ``lpcal`` imports nothing from ``daemon``), the dev profile, unknown
``LPCAL_*`` variables, ``GET /v1/config``, the "invalid settings" header, and the simulator's run
ids and default event count. The broker side (``lpcal broker``, the idempotence and missing-topic
errors, the startup log line) is in ``tests/integration/test_broker_cli.py``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest

from daemon import cli as daemon_cli
from daemon.settings import DEV_PROFILE, PROCESS_ENV, SettingsError, load_settings, unknown_env
from tests.support.daemon_harness import free_port

REPO = Path(__file__).resolve().parents[2]




def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LPCAL_")}
    env.update(extra)
    return env


def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env or _clean_env())


# --------------------------------------------------------------------------- layout, console script


def test_lpcal_package_imports_nothing_from_daemon_and_dispatches_nothing():
    """``lpcal/`` stays free of daemon imports, and its CLI has no importlib dispatch."""
    for path in sorted((REPO / "lpcal").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name != "daemon" and not name.startswith("daemon."), (path, name)
    cli_src = (REPO / "lpcal" / "cli.py").read_text()
    assert "importlib" not in cli_src and "__import__" not in cli_src


def test_library_cli_alone_points_daemon_commands_to_the_console_script():
    code = ("import sys, lpcal.cli; rc = lpcal.cli.main(['serve', '--config', 'x.toml']); "
            "print(rc, sorted(m for m in sys.modules if m == 'daemon' or "
            "m.startswith('daemon.')))")
    proc = _run("-c", code)
    assert proc.stdout.split() == ["2", "[]"], (proc.stdout, proc.stderr)
    assert "python -m daemon.cli serve" in proc.stderr and "lpcal[daemon]" in proc.stderr


def test_console_script_is_daemon_cli_and_lists_every_command(capsys):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lpcal"] == "daemon.cli:main"
    with pytest.raises(SystemExit) as e:
        daemon_cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("fit", "apply", "eval", "serve", "simulate", "broker"):
        assert command in out, out


def test_console_script_delegates_library_commands(tmp_path, capsys):
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=500)
    labels = np.array([rng.choice(3, p=p) for p in probs])
    np.savez(tmp_path / "preds.npz", probs=probs, labels=labels)
    assert daemon_cli.main(["eval", "--input", str(tmp_path / "preds.npz")]) == 0
    assert "raw" in capsys.readouterr().out
    # errors of library commands keep their format and exit code
    assert daemon_cli.main(["eval", "--input", str(tmp_path / "missing.npz")]) == 2
    assert "lpcal eval: error:" in capsys.readouterr().err
    # ... and so do the daemon's commands given bad arguments
    assert daemon_cli.main(["simulate", "--models", "a:x"]) == 2
    assert "k of 'a' must be an integer" in capsys.readouterr().err


def test_missing_daemon_extra_is_one_clear_error():
    code = ("import sys; sys.modules['aiokafka'] = None; from daemon.cli import main; "
            "sys.exit(main(['serve']))")
    proc = _run("-c", code)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("lpcal serve: error: 'lpcal serve' needs the daemon extra: "
                                  "pip install 'lpcal[daemon]'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_tools_live_in_their_own_subpackage():
    tools = REPO / "daemon" / "tools"
    for name in ("embedded_broker.py", "demo.py", "simulate/__init__.py"):
        assert (tools / name).is_file() and not (REPO / "daemon" / name).exists(), name
    makefile = (REPO / "Makefile").read_text()
    assert "-m daemon.tools.demo" in makefile
    # the daemon itself never imports the tools
    for path in (REPO / "daemon").glob("*.py"):
        if path.name != "cli.py":
            assert "daemon.tools" not in path.read_text(), path


def test_demo_uses_the_dev_profile_and_the_moved_modules(isolated):
    """``make demo`` runs ``python -m daemon.tools.demo``, whose daemon config is the dev
    profile (its three settings are not repeated) and whose daemon is ``daemon.cli serve``."""
    from daemon.tools import demo

    text = demo.daemon_config("127.0.0.1:1", 8080)
    parsed = tomllib.loads(text)
    assert parsed["profile"] == "dev" and "enable_idempotence" not in parsed["kafka"]
    assert "offset_gaps" not in parsed["kafka"] and "create_topics" not in parsed["kafka"]
    assert '"-m", "daemon.cli", "serve"' in (REPO / "daemon" / "tools" / "demo.py").read_text()
    (isolated / "demo.toml").write_text(text)
    s = load_settings(isolated / "demo.toml")
    assert (s.kafka.enable_idempotence, s.kafka.offset_gaps, s.kafka.create_topics) == (
        False, "refetch", True)


# --------------------------------------------------------------------------- invalid settings


def test_invalid_settings_header_is_printed_once(isolated, capsys):
    (isolated / "bad.toml").write_text('[defaults]\neps = 1.5\n[kafka]\ngroup_id = ""\n')
    assert daemon_cli.main(["serve", "--config", str(isolated / "bad.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("invalid settings") == 1, err
    assert err.startswith("lpcal serve: invalid settings (2 problems):\n"), err
    assert "defaults.eps" in err and "kafka.group_id" in err
    assert daemon_cli.main(["serve", "--config", str(isolated / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("invalid settings") == 1 and "nope.toml" in err, err


# --------------------------------------------------------------------------- dev profile


def test_dev_profile_sets_three_defaults_that_explicit_settings_override(isolated, monkeypatch):
    prod = load_settings()
    assert prod.profile == "production"
    assert (prod.kafka.enable_idempotence, prod.kafka.offset_gaps, prod.kafka.create_topics) \
        == (True, "count", False)  # production defaults unchanged
    monkeypatch.setenv("LPCAL_PROFILE", "DEV")  # any case
    dev = load_settings()
    assert dev.profile == "dev"
    assert (dev.kafka.enable_idempotence, dev.kafka.offset_gaps, dev.kafka.create_topics) \
        == (False, "refetch", True)
    assert {k: getattr(dev.kafka, k) for k in DEV_PROFILE["kafka"]} == DEV_PROFILE["kafka"]
    # explicit settings win, from any source: file, environment, init arguments
    (isolated / "c.toml").write_text('[kafka]\nenable_idempotence = true\ngroup_id = "g"\n')
    monkeypatch.setenv("LPCAL_KAFKA__CREATE_TOPICS", "false")
    s = load_settings(isolated / "c.toml", kafka={"offset_gaps": "count"})
    assert (s.kafka.enable_idempotence, s.kafka.offset_gaps, s.kafka.create_topics) \
        == (True, "count", False)
    assert s.kafka.group_id == "g"
    # the profile set in the file (top level), no environment
    monkeypatch.delenv("LPCAL_PROFILE")
    monkeypatch.delenv("LPCAL_KAFKA__CREATE_TOPICS")
    (isolated / "d.toml").write_text('profile = "dev"\n[kafka]\nbootstrap_servers = "h:1"\n')
    s = load_settings(isolated / "d.toml")
    assert (s.kafka.enable_idempotence, s.kafka.offset_gaps, s.kafka.create_topics,
            s.kafka.bootstrap_servers) == (False, "refetch", True, "h:1")
    assert s.redacted()["profile"] == "dev" and s.redacted()["kafka"]["create_topics"] is True
    (isolated / "e.toml").write_text('profile = "staging"\n')
    with pytest.raises(SettingsError) as e:
        load_settings(isolated / "e.toml")
    assert [p for p, _ in e.value.errors] == ["profile"]


def test_shipped_config_leaves_the_profile_its_three_settings(isolated, monkeypatch):
    """config/lpcal.toml (also the Kubernetes ConfigMap) must not pin what the dev profile
    sets, or ``LPCAL_PROFILE=dev lpcal serve`` in the repository would not take effect."""
    monkeypatch.setenv("LPCAL_PROFILE", "dev")
    s = load_settings(REPO / "config" / "lpcal.toml")
    assert (s.kafka.enable_idempotence, s.kafka.offset_gaps, s.kafka.create_topics) \
        == (False, "refetch", True)
    monkeypatch.delenv("LPCAL_PROFILE")
    s = load_settings(REPO / "config" / "lpcal.toml")
    assert (s.kafka.enable_idempotence, s.kafka.offset_gaps, s.kafka.create_topics) \
        == (True, "count", False)


# --------------------------------------------------------------------------- unknown LPCAL_*


def test_unknown_lpcal_variables_stop_startup_with_their_names(isolated, monkeypatch):
    monkeypatch.setenv("LPCAL_DEFAULT__EPS", "0.2")
    monkeypatch.setenv("LPCAL_MODEL__M1__K", "3")
    monkeypatch.setenv("LPCAL_LOGLEVEL", "debug")
    monkeypatch.setenv("lpcal_http__port", "9001")  # legitimate, any case
    with pytest.raises(SettingsError) as e:
        load_settings()
    paths = dict(e.value.errors)
    assert set(paths) == {"LPCAL_DEFAULT__EPS", "LPCAL_MODEL__M1__K", "LPCAL_LOGLEVEL"}
    assert "LPCAL_DEFAULTS__EPS" in paths["LPCAL_DEFAULT__EPS"]  # the likely intended name
    assert "LPCAL_MODELS__M1__K" in paths["LPCAL_MODEL__M1__K"]
    assert "LPCAL_LOG_LEVEL" in paths["LPCAL_LOGLEVEL"]
    assert str(e.value).startswith("invalid settings (3 problems):")


def test_legitimate_lpcal_variables_still_work(isolated, monkeypatch):
    (isolated / "c.toml").write_text("[http]\nport = 9002\n")
    legit = {"LPCAL_CONFIG": str(isolated / "c.toml"), "LPCAL_NATIVE": "1",
             "LPCAL_TANSU_BIN": "/nonexistent/tansu", "LPCAL_SOAK": "0",
             "LPCAL_SOAK_RATE": "10", "LPCAL_PROFILE": "production",
             "LPCAL_KAFKA__BOOTSTRAP_SERVERS": "b:9092", "LPCAL_KAFKA__TOPICS__OUTCOMES": "o",
             "LPCAL_DEFAULTS__EPS": "0.05", "LPCAL_MODELS__FRAUD-V3__K": "3",
             "LPCAL_LOG_LEVEL": "debug", "LPCAL_MAX_MODELS": "7",
             "LPCAL_HTTP__ADMIN_TOKEN": "tok", "LPCAL_SIGNING__PUBLIC_KEYS": "[]"}
    for k, v in legit.items():
        monkeypatch.setenv(k, v)
    assert set(PROCESS_ENV) <= set(legit) | {"LPCAL_SECRETS_DIR"}
    assert unknown_env() == []
    s = load_settings()
    assert s.http.port == 9002 and s.kafka.bootstrap_servers == "b:9092"
    assert s.kafka.topics.outcomes == "o" and s.defaults.eps == 0.05
    assert s.model_settings("fraud-v3").k == 3 and s.max_models == 7
    # a variable no source can parse is a settings error too, not a traceback
    monkeypatch.setenv("LPCAL_KAFKA", "not json")
    with pytest.raises(SettingsError, match="kafka"):
        load_settings()


def test_unknown_env_rules():
    env = {"LPCAL_KAFKA__SASL_PASSWORD": "x", "LPCAL_MODELS__A__K": "2",
           "LPCAL_KAFKA__": "x", "LPCAL_LOG_LEVEL__X": "1", "LPCAL_STATE__BACKEND": "local",
           "OTHER": "1", "LPCAL_SECRETS_DIR": "/x", "LPCAL_JOINS__TTL_SECONDS": "1"}
    assert unknown_env(env) == ["LPCAL_JOINS__TTL_SECONDS", "LPCAL_KAFKA__",
                                "LPCAL_LOG_LEVEL__X"]


def test_serve_names_an_unknown_variable_and_exits_2(tmp_path):
    proc = _run("-m", "daemon.cli", "serve", cwd=tmp_path,
                env=_clean_env(LPCAL_DEFAULT__EPS="0.2", LPCAL_SECRETS_DIR=str(tmp_path)))
    assert proc.returncode == 2, proc.stderr
    assert "LPCAL_DEFAULT__EPS" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("invalid settings") == 1


# --------------------------------------------------------------------------- GET /v1/config


async def test_v1_config_serves_the_effective_settings_with_secrets_redacted(isolated):
    from daemon.http_api import HttpServer, redact
    from daemon.service import Daemon
    from lpcal.signing import keygen

    key_file, _, _ = keygen(isolated / "keys")
    secrets = isolated / "secrets"
    (secrets / "signing__private_key").write_bytes(key_file.read_bytes())
    (secrets / "kafka__sasl_password").write_text("hunter2-sasl")
    (secrets / "http__admin_token").write_text("very-secret-token")
    (isolated / "c.toml").write_text(
        'profile = "dev"\n[kafka]\nsecurity_protocol = "SASL_PLAINTEXT"\n'
        'sasl_mechanism = "PLAIN"\nsasl_username = "lpcal"\n'
        f'[http]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        '[models."fraud-v3"]\nk = 3\neps = 0.05\n')
    settings = load_settings(isolated / "c.toml")
    assert settings.signing.signer() is not None
    http = HttpServer(Daemon(settings).status())
    await http.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{http.port}/v1/config") as r:
                assert r.status == 200  # no token needed, like GET /v1/models
                assert r.content_type == "application/json"
                text = await r.text()
            async with session.post(f"http://127.0.0.1:{http.port}/v1/config") as r:
                assert r.status == 405
    finally:
        await http.stop()
    secret_key_text = key_file.read_text()
    for secret in ("hunter2-sasl", "very-secret-token", secret_key_text.strip().splitlines()[1]):
        assert secret not in text
    body = json.loads(text)
    assert body["kafka"]["sasl_password"] == "**********"
    assert body["http"]["admin_token"] == "**********"
    assert body["signing"]["private_key"] == "**********"
    # the effective values: profile applied, models merged over the defaults, inf as a string
    assert body["profile"] == "dev" and body["kafka"]["enable_idempotence"] is False
    assert body["kafka"]["sasl_username"] == "lpcal"
    assert body["models"]["fraud-v3"]["eps"] == 0.05 and body["models"]["fraud-v3"]["k"] == 3
    assert body["models"]["fraud-v3"]["p"] == "Infinity"
    assert body == redact(orjson.loads(orjson.dumps(settings.redacted())))
    # the second line of defence masks secret-looking keys wherever they are
    assert redact({"a": {"db_password": "p", "token": 3, "ok": "v", "secret_x": None,
                         "list": [{"private_key": "k"}], "flag_token": True}}) == {
        "a": {"db_password": "**********", "token": "**********", "ok": "v", "secret_x": None,
              "list": [{"private_key": "**********"}], "flag_token": True}}


# --------------------------------------------------------------------------- simulator


def test_simulate_run_ids_are_unique_per_run_and_reproducible_when_given():
    from daemon.tools.simulate.cli import build_parser, generator_from_args
    from daemon.tools.simulate.model import SyntheticModel
    from daemon.tools.simulate.traffic import TrafficGenerator

    def ids(gen):
        return {orjson.loads(v)["id"] for kind, _, v in gen if kind == "predictions"}

    a = ids(TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 50, run_id="r1"))
    b = ids(TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 50, run_id="r2"))
    assert len(a) == len(b) == 50 and not a & b
    assert "m-r1-0" in a and "m-r2-49" in b
    assert "m-r1-007" in ids(TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 50,
                                              run_id="r1", id_digits=3))
    with pytest.raises(Exception, match="run_id"):
        TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 5, run_id="a b")
    args = ["--events", "30", "--run-id", "fixed", "--start", "1000"]
    assert list(generator_from_args(build_parser().parse_args(args))) == \
        list(generator_from_args(build_parser().parse_args(args)))
    # '' keeps the ids of earlier versions
    assert "fraud-v3-0" in ids(generator_from_args(build_parser().parse_args(
        ["--events", "4", "--run-id", ""])))


def test_simulate_main_draws_a_new_run_id_each_run(monkeypatch, capsys):
    """Two runs of ``lpcal simulate`` never share an id: each draws its own run id (checked
    on the header line; the broker round trip is in tests/integration/test_broker_cli.py)."""
    from daemon.tools.simulate.cli import main

    runs = []
    for _ in range(2):
        assert main(["--bootstrap", "127.0.0.1:1", "--events", "5", "--no-idempotence"]) == 1
        err = capsys.readouterr().err
        line = next(x for x in err.splitlines() if ", ids fraud-v3-" in x)
        runs.append(line.split(", ids fraud-v3-")[1].split("-0,")[0])
    assert len(runs[0]) == 8 and runs[0] != runs[1], runs


def test_default_event_count_yields_a_bin_map_under_the_default_pools(isolated):
    """``lpcal simulate`` without ``--events`` produces enough joined samples for the daemon's
    default layout to seal an epoch (10,000 never did); the count follows the settings."""
    from daemon.event_records import ModelPolicy
    from daemon.events import EventParser
    from daemon.model_state import ModelState
    from daemon.settings import Settings
    from daemon.tools.simulate.cli import build_parser, default_events, generator_from_args

    a = build_parser().parse_args(["--run-id", "t", "--start", "1764000000"])
    n, where = default_events(a)
    assert where == "the built-in daemon defaults" and 48_000 < n <= 60_000
    two, _ = default_events(build_parser().parse_args(["--models", "a,b"]))
    assert 2 * n - 2000 <= two <= 2 * n  # the per-model count, rounded up to thousands
    shipped, where = default_events(build_parser().parse_args(
        ["--config", str(REPO / "config" / "lpcal.toml")]))
    assert shipped > n and "config/lpcal.toml" in where  # its fraud-v3 has eps 0.05: L = 7

    s = Settings(defaults={"recovery": "epochs"})  # the event count covers an epoch
    st = ModelState.create("fraud-v3", 3, s.defaults, s.join)
    layout = st.filling.layout
    need = layout.warmup + layout.holdout + sum(layout.targets.values())
    assert need > 10_000  # the old default could never fill it
    gen = generator_from_args(a)
    assert gen.events == n
    parser = EventParser(lambda model: ModelPolicy(k=3))
    msgs = [v for _, _, v in gen]
    sealed = 0
    for i in range(0, len(msgs), 5000):
        batch = parser.parse_batch(msgs[i:i + 5000])
        for model, mb in batch.by_model.items():
            assert model == "fraud-v3"
            sealed += st.offer(mb).sealed
    assert sealed >= 1, st.filling.fill()
    assert st.samples_total >= need



def test_serve_with_invalid_settings_exits_2_naming_each_bad_field(tmp_path):
    """(From the former ``tests/integration/test_daemon_crash.py``.)"""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[defaults]\neps = 1.5\n[http]\nport = 0\n[kafka]\ngroup_id = ""\n')
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config", str(cfg)],
                          check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("LPCAL_")})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    for field in ("defaults.eps", "http.port", "kafka.group_id"):
        assert field in proc.stderr, proc.stderr
