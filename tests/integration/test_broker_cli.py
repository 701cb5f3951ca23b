"""The newcomer path against the real embedded broker (never mocked): ``lpcal broker`` in the
foreground, a daemon on it with nothing but the dev profile and the printed settings, the
clear errors of a broker that refuses idempotence and of missing topics, the effective settings
in the startup log, and ``lpcal simulate``'s run ids and progress lines."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from daemon.kafka.clients import BrokerSettingsError
from daemon.kafka.topics import TopicMissingError, TopicSpec, ensure_topics, partition_counts
from daemon.service import Daemon
from daemon.tools.embedded_broker import kafka_metadata_ping
from daemon.tools.simulate.cli import main
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from tests.support.daemon_harness import (
    TopicNames,
    build_settings,
    daemon_config,
    free_port,
    http_get,
    read_records,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.integration


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LPCAL_")}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


class _Broker:
    """``python -m daemon.cli broker --port 0`` (the ``lpcal broker`` command)."""

    def __init__(self, tmp_path: Path):
        self.out_path = tmp_path / "broker.out"
        self.out = open(self.out_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "broker", "--port", "0",
             "--log", str(tmp_path / "tansu.log")],
            stdout=self.out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(),
            start_new_session=True)

    def text(self) -> str:
        return self.out_path.read_text()

    def wait_banner(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while "stops the broker" not in self.text():
            assert self.proc.poll() is None, f"lpcal broker exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"no banner after {timeout} s:\n{self.text()}"
            time.sleep(0.1)
        m = re.search(r"^bootstrap: (127\.0\.0\.1:\d+)$", self.text(), re.MULTILINE)
        assert m, self.text()
        return m.group(1)

    def signal(self, sig: int, timeout: float = 20.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.out.close()


def _tansu_pid(broker: _Broker) -> int:
    m = re.search(r"\(pid (\d+),", broker.text())
    assert m, broker.text()
    return int(m.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _ready_config(url: str, daemon: subprocess.Popen, log: Path) -> dict:
    """Wait for the daemon's /readyz, then return its GET /v1/config."""
    async def ready():
        assert daemon.poll() is None, log.read_text()
        return (await http_get(url, "/readyz"))[0] == 200
    await wait_until(ready, 60, "dev-profile daemon ready on the lpcal broker",
                     diag=lambda: log.read_text()[-3000:])
    status, body = await http_get(url, "/v1/config")
    assert status == 200, body
    return orjson.loads(body)


def test_lpcal_broker_runs_a_dev_profile_daemon_and_stops_on_sigterm(tmp_path):
    b = _Broker(tmp_path)
    daemon = None
    log = tmp_path / "daemon.log"
    try:
        bootstrap = b.wait_banner()
        text = b.text()
        # the settings to use: environment and TOML lines of the dev profile, a simulator line
        for line in ("export LPCAL_PROFILE=dev",
                     f"export LPCAL_KAFKA__BOOTSTRAP_SERVERS={bootstrap}",
                     'profile = "dev"', f'bootstrap_servers = "{bootstrap}"',
                     f"lpcal simulate --bootstrap {bootstrap} --no-idempotence"):
            assert line in text, (line, text)
        host, port = bootstrap.split(":")
        assert [b_[1:] for b_ in kafka_metadata_ping(host, int(port))] == [(host, int(port))]
        # a daemon configured by nothing but the printed environment lines (no settings file)
        http_port = free_port()
        with open(log, "w") as out:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "serve"], cwd=tmp_path,
                stdout=out, stderr=subprocess.STDOUT,
                env=_env(LPCAL_PROFILE="dev", LPCAL_KAFKA__BOOTSTRAP_SERVERS=bootstrap,
                         LPCAL_HTTP__HOST="127.0.0.1", LPCAL_HTTP__PORT=str(http_port),
                         LPCAL_KAFKA__SESSION_TIMEOUT_MS="2000",
                         LPCAL_KAFKA__HEARTBEAT_INTERVAL_MS="200",
                         LPCAL_SECRETS_DIR=str(tmp_path / "no-secrets")))
        cfg = asyncio.run(_ready_config(f"http://127.0.0.1:{http_port}", daemon, log))
        assert cfg["profile"] == "dev"
        assert (cfg["kafka"]["enable_idempotence"], cfg["kafka"]["offset_gaps"],
                cfg["kafka"]["create_topics"]) == (False, "refetch", True)
        # the dev profile created the daemon's topics
        counts = asyncio.run(partition_counts(
            bootstrap, ["lpcal.predictions", "lpcal.outcomes", "lpcal.state"]))
        assert set(counts) == {"lpcal.predictions", "lpcal.outcomes", "lpcal.state"}
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert "effective settings (secrets redacted): " in log.read_text()
        # SIGTERM stops the broker cleanly: exit 0, Tansu gone, the port closed
        pid = _tansu_pid(b)
        assert _alive(pid)
        assert b.signal(signal.SIGTERM) == 0, b.text()
        assert "stopped on SIGTERM" in b.text()
        assert not _alive(pid)
        with pytest.raises(OSError):
            kafka_metadata_ping(host, int(port), timeout=1.0)
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)
        b.stop()


def test_lpcal_broker_stops_on_ctrl_c(tmp_path):
    b = _Broker(tmp_path)
    try:
        bootstrap = b.wait_banner()
        pid = _tansu_pid(b)
        assert b.signal(signal.SIGINT) == 0, b.text()
        assert "stopped on SIGINT" in b.text() and "Traceback" not in b.text()
        assert not _alive(pid)
        host, port = bootstrap.split(":")
        with pytest.raises(OSError):
            kafka_metadata_ping(host, int(port), timeout=1.0)
    finally:
        b.stop()


async def test_broker_refusing_idempotence_is_one_clear_error(broker, topic_prefix, tmp_path,
                                                              caplog):
    """The embedded broker fails InitProducerId: startup stops at once (it was retried
    forever) with one error naming the setting and the dev profile. The effective settings
    were logged first, secrets redacted."""
    names = TopicNames.for_prefix(topic_prefix)
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(),
                        admin_token="tok-very-secret", kafka={"enable_idempotence": True})
    settings = build_settings(cfg, tmp_path)
    caplog.set_level(logging.INFO, logger="lpcal.daemon")
    d = Daemon(settings)
    t0 = time.monotonic()
    with pytest.raises(BrokerSettingsError) as e:
        await asyncio.wait_for(d.serve(install_signals=False), 30)
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "kafka.enable_idempotence = false" in msg and "LPCAL_PROFILE=dev" in msg
    assert "InitProducerId" in msg
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert not retries, [r.getMessage() for r in retries]
    logged = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("effective settings (secrets redacted): ")]
    assert len(logged) == 1
    assert "tok-very-secret" not in caplog.text
    payload = orjson.loads(logged[0].split(": ", 1)[1])
    assert payload == orjson.loads(orjson.dumps(settings.redacted()))
    assert payload["http"]["admin_token"] == "**********"
    assert payload["kafka"]["enable_idempotence"] is True


def test_serve_exits_2_naming_missing_topics_and_create_topics(broker, topic_prefix, tmp_path):
    names = TopicNames.for_prefix(topic_prefix)  # never created
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(),
                        kafka={"create_topics": False})
    path = write_config(cfg, tmp_path / "missing.toml")
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config", str(path)],
                          check=False, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=_env(LPCAL_SECRETS_DIR=str(tmp_path)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lpcal serve: error: topics missing on "), proc.stderr[-3000:]
    assert names.predictions in last and names.outcomes in last
    assert "kafka.create_topics = true" in last and "LPCAL_PROFILE=dev" in last
    assert "Traceback" not in proc.stderr


async def test_missing_topics_error_in_process(broker, topic_prefix, tmp_path):
    names = TopicNames.for_prefix(topic_prefix)
    await ensure_topics(broker.bootstrap, [TopicSpec(names.predictions, 1)])
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(),
                        kafka={"create_topics": False})
    d = Daemon(build_settings(cfg, tmp_path))
    with pytest.raises(TopicMissingError) as e:
        await asyncio.wait_for(d.serve(install_signals=False), 30)
    msg = str(e.value)
    assert f"missing on {broker.bootstrap}: {names.outcomes}" in msg  # not the existing one
    assert names.predictions not in msg.split("(also missing")[0]
    assert names.binmaps in msg  # the daemon's other absent topics are named too


def test_simulate_runs_never_share_ids(broker, topic_prefix, capsys):
    args = ["--bootstrap", broker.bootstrap, "--no-idempotence", "--topic-prefix",
            topic_prefix + ".", "--events", "200", "--seed", "3"]
    assert main(args) == 0
    assert main(args) == 0  # the same arguments, a second run
    err = capsys.readouterr().err
    assert err.count(", ids fraud-v3-") == 2
    got = asyncio.run(read_records(broker.bootstrap, topic_prefix + ".lpcal.predictions"))
    ids = [orjson.loads(r.value)["id"] for r in got]
    assert len(ids) == 400 and len(set(ids)) == 400
    runs = {i.rsplit("-", 1)[0] for i in ids}
    assert len(runs) == 2 and all(r.startswith("fraud-v3-") for r in runs)


def test_simulate_idempotence_error_names_the_flag(broker, topic_prefix, capsys):
    rc = main(["--bootstrap", broker.bootstrap, "--topic-prefix", topic_prefix + ".",
               "--events", "10", "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "lpcal simulate: error: the broker refused an idempotent producer" in err
    assert "--no-idempotence" in err and "Traceback" not in err


async def test_simulate_progress_lines(broker, topic_prefix):
    topics = {"predictions": f"{topic_prefix}.p", "outcomes": f"{topic_prefix}.o"}
    lines: list[str] = []
    gen = TrafficGenerator([SyntheticModel("m", 3, 0.3, 5.0)], 300, chunk=50, run_id="r")
    await simulate(broker.bootstrap, topics, gen, idempotence=False, progress=lines.append,
                   progress_interval=0.0)
    assert len(lines) >= 5
    assert re.fullmatch(r"simulate: 50/300 events \(17%\), \d+ messages, [\d,]+ messages/s, "
                        r"\d+ s, about \d+ s left", lines[0]), lines[0]
    assert lines[-1].startswith("simulate: 300/300 events (100%)")



@pytest.mark.slow
def test_example_config_certifies_with_the_simulators_defaults(broker, topic_prefix, tmp_path,
                                                               capsys):
    """The hands-on path of docs/development.md: ``lpcal serve`` on config/lpcal.toml (dev
    profile) and ``lpcal simulate`` with its defaults publish a *certified* bin map for the
    simulated model (its [models."fraud-v3"] override once gave a bound of 0.136 against eps
    0.05). Only the topic names, group and port are moved out of the way of other tests."""
    example = Path(__file__).resolve().parents[2] / "config" / "lpcal.toml"
    prefix = topic_prefix + "."
    http_port = free_port()
    log = tmp_path / "daemon.log"
    env = _env(LPCAL_PROFILE="dev", LPCAL_KAFKA__BOOTSTRAP_SERVERS=broker.bootstrap,
               LPCAL_KAFKA__GROUP_ID=topic_prefix, LPCAL_HTTP__HOST="127.0.0.1",
               LPCAL_HTTP__PORT=str(http_port), LPCAL_SECRETS_DIR=str(tmp_path / "none"),
               **{f"LPCAL_KAFKA__TOPICS__{t.upper()}": f"{prefix}lpcal.{t}"
                  for t in ("predictions", "outcomes", "binmaps", "deadletter", "state")})
    with open(log, "w") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "serve", "--config", str(example)],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http_port}"
    try:
        asyncio.run(_ready_config(url, daemon, log))
        # the simulator's defaults; --config only names the settings it sizes --events for
        assert main(["--bootstrap", broker.bootstrap, "--no-idempotence",
                     "--topic-prefix", prefix, "--config", str(example)]) == 0
        assert "one bin map of each model under the daemon settings of" in (
            capsys.readouterr().err)

        async def published():
            assert daemon.poll() is None, log.read_text()[-3000:]
            status, body = await http_get(url, "/v1/models")
            models = {m["model"]: m for m in orjson.loads(body)["models"]} if status == 200 else {}
            got = models.get("fraud-v3") or {}
            # the online loop (the default) publishes as soon as a map beats the live one, and
            # certifies it once its certification samples suffice: wait for a certified map
            return got if (got.get("certificate") or {}).get("certified") else None
        model = asyncio.run(wait_until(published, 180, "a certified bin map of fraud-v3",
                                       diag=lambda: log.read_text()[-3000:]))
        cert = model["certificate"]
        assert model["mode"] == "certified" and cert["eps"] == 0.05
        assert cert["certified"] is True and cert["bound"] <= cert["eps"], cert
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=40)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=10)
