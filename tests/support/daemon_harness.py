"""Helpers of the daemon's integration tests (real embedded broker; nothing is mocked).

* :class:`TopicNames` / :func:`daemon_config`: unique topic names and a nested settings dict
  (the same dict builds in-process :class:`~daemon.settings.Settings` and the TOML file of a
  subprocess daemon, see :func:`to_toml`);
* :func:`running_daemon`: an in-process :class:`daemon.service.Daemon` as an async context
  manager (small consumer session timeouts, so Tansu group joins take ~1 s);
* :class:`SubprocessDaemon`: ``python -m daemon.cli serve --config FILE`` with stdout/stderr in
  files, SIGKILL / SIGTERM / restart, log tails for diagnostics;
* :class:`EventProducer` and :func:`synth_samples`: input events (predictions, outcomes, raw);
* readers of the output topics: :func:`read_records`, :func:`read_binmaps`,
  :func:`read_deadletters`, :func:`read_state`;
* HTTP: :func:`http_get`, :func:`http_post`, :func:`scrape_metrics`, :func:`metric_value`;
* :func:`wait_until`: a bounded wait that fails with diagnostics;
* :func:`pool_cells` / :func:`pool_diff`: pools as ``{(pool, bin, label): count}`` to count
  samples lost or doubled between two runs.

Usage::

    names = TopicNames.for_prefix(topic_prefix)
    await create_topics(broker.bootstrap, names, partitions=2)
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(), defaults={"k": 3})
    async with running_daemon(build_settings(cfg, tmp_path)) as rd:
        async with EventProducer(broker.bootstrap) as prod:
            await prod.prediction(names.predictions, "m1", "e1", [0.2, 0.3, 0.5], ts=1.0)
        await wait_until(lambda: "m1" in rd.daemon.registry, 10, "model m1 seen")
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import numpy as np
import orjson
from aiokafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from daemon.checkpoint.store import decode_value, reassemble
from daemon.kafka.clients import make_consumer, make_producer
from daemon.kafka.deadletter import deadletter_info
from daemon.kafka.topics import COMPACT, TopicSpec, ensure_topics
from daemon.model_state import ModelState
from daemon.settings import KafkaSettings, Settings, load_settings
from lpcal.binmap import BinMap
from lpcal.pools import PoolSet

#: Consumer options of in-process daemons: a Tansu group join then takes ~1 s instead of ~5 s.
FAST_CONSUMER = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200}
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A currently free loopback TCP port (bind port 0, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TopicNames:
    predictions: str
    outcomes: str
    binmaps: str
    deadletter: str
    state: str

    @classmethod
    def for_prefix(cls, prefix: str, state_suffix: str = "") -> TopicNames:
        return cls(f"{prefix}.preds", f"{prefix}.outs", f"{prefix}.binmaps",
                   f"{prefix}.dlq", f"{prefix}.state{state_suffix}")

    def with_state(self, state: str) -> TopicNames:
        return TopicNames(self.predictions, self.outcomes, self.binmaps, self.deadletter, state)

    def as_dict(self) -> dict[str, str]:
        return {"predictions": self.predictions, "outcomes": self.outcomes,
                "binmaps": self.binmaps, "deadletter": self.deadletter, "state": self.state}


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), dict) else v
    return out


def daemon_config(bootstrap: str, names: TopicNames, *, http_port: int,
                  group_id: str | None = None, partitions: int = 1,
                  defaults: Mapping[str, Any] | None = None,
                  models: Mapping[str, Mapping[str, Any]] | None = None,
                  state: Mapping[str, Any] | None = None, admin_token: str | None = None,
                  fast_consumer: bool = True, **top: Any) -> dict[str, Any]:
    """Nested settings dict of a test daemon (pass it to :func:`build_settings` or
    :class:`SubprocessDaemon`). ``top`` sets top-level keys (``unknown_models``, ...); nested
    mappings in ``top`` are merged over the defaults built here.

    ``fast_consumer`` also sets ``kafka.session_timeout_ms``/``heartbeat_interval_ms`` when the
    settings model has such fields (it does not yet; in-process daemons get them through
    ``consumer_options`` instead)."""
    kafka: dict[str, Any] = {
        "bootstrap_servers": bootstrap, "enable_idempotence": False, "create_topics": True,
        "offset_gaps": "refetch",  # the embedded broker can skip a batch under load
        "topic_partitions": partitions, "group_id": group_id or f"g-{uuid.uuid4().hex[:10]}",
        "client_id": "lpcal-it", "topics": names.as_dict(),
    }
    if fast_consumer:
        for key, value in (("session_timeout_ms", FAST_CONSUMER["session_timeout_ms"]),
                           ("heartbeat_interval_ms", FAST_CONSUMER["heartbeat_interval_ms"])):
            if key in KafkaSettings.model_fields:
                kafka[key] = value
    cfg: dict[str, Any] = {
        "kafka": kafka,
        "http": {"host": "127.0.0.1", "port": int(http_port)},
        "defaults": {"eps": 0.1, "p": "inf", "k": 3, **(defaults or {})},
        "models": {m: dict(v) for m, v in (models or {}).items()},
        "state": {"backend": "kafka", "checkpoint_interval_seconds": 1.0, **(state or {})},
        "shutdown_grace_seconds": 15,
        "log_level": "INFO",
    }
    if admin_token is not None:
        cfg["http"]["admin_token"] = admin_token
    return _deep_merge(cfg, top)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, (str, os.PathLike)):
        return orjson.dumps(os.fspath(v)).decode()  # JSON string escapes are valid TOML
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"to_toml: unsupported value {v!r}")


def to_toml(d: Mapping[str, Any]) -> str:
    """Minimal TOML writer for nested dicts of str/int/float/bool/list (None values dropped)."""
    lines: list[str] = []

    def key(k: str) -> str:
        return k if k.replace("_", "").replace("-", "").isalnum() else orjson.dumps(k).decode()

    def table(prefix: list[str], m: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in m.items() if not isinstance(v, Mapping) and v is not None}
        subs = {k: v for k, v in m.items() if isinstance(v, Mapping)}
        if prefix and (scalars or not subs):
            lines.append("[" + ".".join(key(p) for p in prefix) + "]")
        for k, v in scalars.items():
            lines.append(f"{key(k)} = {_toml_value(v)}")
        for k, v in subs.items():
            table(prefix + [k], v)

    table([], d)
    return "\n".join(lines) + "\n"


def write_config(cfg: Mapping[str, Any], path: Path) -> Path:
    path.write_text(to_toml(cfg))
    return path


def build_settings(cfg: Mapping[str, Any], tmp_path: Path, name: str = "lpcal") -> Settings:
    """Write ``cfg`` as TOML under ``tmp_path`` and load it like ``lpcal serve --config``."""
    return load_settings(write_config(cfg, tmp_path / f"{name}.toml"))


async def create_topics(bootstrap: str, names: TopicNames, partitions: int) -> None:
    """Create the input topics (``partitions`` each) and the output topics before any client
    touches them (Tansu auto-creates unknown topics with 4 partitions)."""
    await ensure_topics(bootstrap, [
        TopicSpec(names.predictions, partitions),
        TopicSpec(names.outcomes, partitions),
        TopicSpec(names.binmaps, 1, configs=COMPACT),
        TopicSpec(names.deadletter, partitions),
        TopicSpec(names.state, 1, configs=COMPACT)])


# --------------------------------------------------------------------------- waiting


async def wait_until(cond: Callable[[], Any], timeout: float, what: str, *,
                     interval: float = 0.1, diag: Callable[[], Any] | None = None) -> Any:
    """Poll ``cond`` (sync or async) until truthy; fail after ``timeout`` s with diagnostics."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            val = cond()
            if asyncio.iscoroutine(val):
                val = await val
            if val:
                return val
        except (TimeoutError, AssertionError, KeyError, OSError, aiohttp.ClientError) as e:
            last_exc = e
        if time.monotonic() > deadline:
            extra = ""
            if diag is not None:
                d = diag()
                if asyncio.iscoroutine(d):
                    d = await d
                extra = f"\n--- diagnostics ---\n{d}"
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}"
                                 f"{f' (last error: {last_exc!r})' if last_exc else ''}{extra}")
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- in-process daemon


@dataclass
class RunningDaemon:
    daemon: Any
    task: asyncio.Task
    settings: Settings

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.http.port}"

    def describe(self) -> str:
        d = self.daemon
        return (f"daemon group={self.settings.kafka.group_id} ready={d.ready} "
                f"started={d.started} restored={d.restored} broker_ok={d.clients.broker_ok} "
                f"assigned={sorted((tp.topic, tp.partition) for tp in d.partitions.assigned)} "
                f"models={ {m: repr(s) for m, s in d.registry.states().items()} } "
                f"inflight={sorted(d.registry.fitting())} task_done={self.task.done()}")

    async def stop(self, timeout: float = 30.0) -> None:
        if self.task.done():
            self.task.result()
            return
        self.daemon.stopping.set()
        await asyncio.wait_for(self.task, timeout)


async def start_daemon(settings: Settings, *, consumer_options: Mapping | None = None,
                       ready_timeout: float = 30.0, wait_ready: bool = True,
                       **daemon_kw: Any) -> RunningDaemon:
    """Start an in-process daemon (``serve(install_signals=False)``); wait for ``/readyz``.
    ``daemon_kw`` go to :class:`daemon.service.Daemon` (e.g. a ``fit`` stand-in)."""
    from daemon.service import Daemon

    d = Daemon(settings, consumer_options=dict(consumer_options or FAST_CONSUMER), **daemon_kw)
    rd = RunningDaemon(d, asyncio.create_task(d.serve(install_signals=False)), settings)
    if wait_ready:
        async def ready():
            if rd.task.done():
                rd.task.result()  # raise the daemon's startup error
                raise RuntimeError("daemon task ended during startup")
            return d.ready and d.partitions.assigned
        try:
            await wait_until(ready, ready_timeout, "in-process daemon ready",
                             diag=rd.describe)
        except BaseException:
            await _quiet_stop(rd)
            raise
    return rd


async def _quiet_stop(rd: RunningDaemon) -> None:
    with contextlib.suppress(BaseException):
        await rd.stop(20.0)


@contextlib.asynccontextmanager
async def running_daemon(settings: Settings, **kw: Any):
    """``async with running_daemon(settings) as rd``: start, yield, then stop (bounded)."""
    rd = await start_daemon(settings, **kw)
    try:
        yield rd
    finally:
        if not rd.task.done():
            rd.daemon.stopping.set()
            try:
                await asyncio.wait_for(rd.task, 30.0)
            except TimeoutError:
                rd.task.cancel()
                raise AssertionError(f"daemon did not stop within 30 s: {rd.describe()}")


# --------------------------------------------------------------------------- subprocess daemon


class SubprocessDaemon:
    """``python -m daemon.cli serve --config FILE`` in a child process.

    Each :meth:`start` is one *incarnation* with its own stdout/stderr files
    (``<name>-<n>.out/.err`` under ``workdir``). The child runs with ``cwd=workdir`` and no
    ``LPCAL_*`` variables inherited, so only the written TOML file configures it.
    """

    def __init__(self, cfg: Mapping[str, Any], workdir: Path, name: str = "daemon",
                 env: Mapping[str, str] | None = None):
        self.cfg = dict(cfg)
        self.workdir = Path(workdir)
        self.name = name
        self.config_path = write_config(cfg, self.workdir / f"{name}.toml")
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.returncodes: list[int] = []
        self._env = dict(env or {})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg['http']['port']}"

    def start(self) -> SubprocessDaemon:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.incarnation += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("LPCAL_")}
        env.update(PYTHONUNBUFFERED="1", **self._env)
        with open(self._log(".out"), "wb") as out, open(self._log(".err"), "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "serve", "--config", str(self.config_path)],
                cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True)
        return self

    def _log(self, suffix: str, incarnation: int | None = None) -> Path:
        return self.workdir / f"{self.name}-{incarnation or self.incarnation}{suffix}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int:
        """SIGKILL and reap; returns the exit status (-9)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        rc = self.proc.wait(timeout=10)
        self.returncodes.append(rc)
        return rc

    def terminate(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; wait up to ``timeout`` s; returns (exit code, seconds to exit). On timeout
        the child is SIGKILLed and an AssertionError with its logs is raised."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self.name} did not exit within {timeout} s of SIGTERM\n"
                                 + self.logs()) from None
        self.returncodes.append(rc)
        return rc, time.monotonic() - t0

    def stop_quietly(self) -> None:
        if self.alive():
            self.proc.kill()
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)

    def logs(self, n_bytes: int = 3000, incarnations: Iterable[int] | None = None) -> str:
        parts = []
        for i in incarnations or range(1, self.incarnation + 1):
            for suffix in (".out", ".err"):
                p = self._log(suffix, i)
                try:
                    data = p.read_bytes()[-n_bytes:].decode("utf-8", "replace")
                except OSError:
                    continue
                if data.strip():
                    parts.append(f"--- {p.name} (tail) ---\n{data}")
        codes = f"exit codes so far: {self.returncodes}; running: {self.alive()}"
        return "\n".join([codes, *parts])

    async def wait_ready(self, timeout: float) -> None:
        async def ready():
            if not self.alive():  # fail at once (wait_until retries on AssertionError)
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            status, _ = await http_get(self.url, "/readyz", timeout=2.0)
            return status == 200
        try:
            await wait_until(ready, timeout, f"{self.name} /readyz 200", interval=0.2,
                             diag=self.logs)
        except RuntimeError as e:
            raise AssertionError(f"{e} before it was ready\n{self.logs()}") from None


# --------------------------------------------------------------------------- events


def synth_samples(n: int, k: int, seed: int, id_prefix: str) -> tuple[list[str], np.ndarray,
                                                                       np.ndarray]:
    """``n`` samples of a miscalibrated k-class model: ids, probability rows, labels."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(k, 0.5), size=n)
    sharp = probs ** 2
    sharp /= sharp.sum(axis=1, keepdims=True)
    u = rng.random(n)[:, None]
    labels = (u > np.cumsum(sharp, axis=1)).sum(axis=1).clip(0, k - 1)
    ids = [f"{id_prefix}-{i}" for i in range(n)]
    return ids, probs, labels.astype(np.int64)


def prediction(model: str, eid: str, probs, ts: float) -> bytes:
    return orjson.dumps({"model": model, "id": eid, "ts": float(ts),
                         "probs": list(map(float, probs))})


def outcome(model: str, eid: str, label: int, ts: float) -> bytes:
    return orjson.dumps({"model": model, "id": eid, "ts": float(ts), "label": int(label)})


class EventProducer:
    """A non-idempotent aiokafka producer (Tansu has no InitProducerId), keyed by model id."""

    def __init__(self, bootstrap: str):
        self.producer = make_producer(bootstrap, idempotence=False,
                                      client_id="lpcal-it-producer")
        self.sent: Counter = Counter()

    async def __aenter__(self) -> Self:
        await asyncio.wait_for(self.producer.start(), 30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.wait_for(self.producer.stop(), 30)

    async def raw(self, topic: str, value: bytes | None, key: bytes | str | None) -> None:
        if isinstance(key, str):
            key = key.encode()
        await self.producer.send(topic, value=value, key=key)
        self.sent[topic] += 1

    async def prediction(self, topic: str, model: str, eid: str, probs, ts: float) -> None:
        await self.raw(topic, prediction(model, eid, probs, ts), model)

    async def outcome(self, topic: str, model: str, eid: str, label: int, ts: float) -> None:
        await self.raw(topic, outcome(model, eid, label, ts), model)

    async def samples(self, names: TopicNames, model: str, ids, probs, labels, *,
                      ts0: float = 1_764_000_000.0, outcomes: bool = True,
                      predictions: bool = True) -> None:
        """Predictions of the samples, then (``outcomes``) their outcomes 60 s later."""
        if predictions:
            for i, eid in enumerate(ids):
                await self.prediction(names.predictions, model, eid, probs[i], ts0 + i)
        if outcomes:
            for i, eid in enumerate(ids):
                await self.outcome(names.outcomes, model, eid, int(labels[i]), ts0 + i + 60)

    async def flush(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.producer.flush(), timeout)


# --------------------------------------------------------------------------- topic readers


async def read_records(bootstrap: str, topic: str, timeout: float = 20.0) -> list:
    """Every record of ``topic`` up to its end offsets (taken at the start), all partitions.

    Records fetched beyond the end offsets are kept: Tansu 0.6.0 reports the end offset (high
    watermark) as *base offset of the last record batch + 1*, so cutting at the end offset
    would drop all but the first record of the last batch (measured: 5 records in one batch
    at offsets 0..4 give end offset 1). Fetches return whole batches, so keeping what was
    fetched returns every record written before the call."""
    consumer = make_consumer(bootstrap, group_id=None, client_id="lpcal-it-reader")
    out = []
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            await consumer.topics()
            parts = consumer.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            if not tps:
                return []
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.seek_to_beginning(*tps)
            pending = {tp for tp in tps if ends[tp] > 0}
            while pending:
                for tp, msgs in (await consumer.getmany(*pending, timeout_ms=200)).items():
                    out.extend(msgs)
                for tp in list(pending):
                    if await consumer.position(tp) >= ends[tp]:
                        pending.discard(tp)
        finally:
            await consumer.stop()
    return out


async def read_latest(bootstrap: str, topic: str, timeout: float = 20.0) -> dict[str, bytes]:
    """The last value per (UTF-8) key of a compacted topic; tombstones delete. Like
    :func:`daemon.kafka.readers.read_compacted_latest`, but keeps the whole last record batch (see
    :func:`read_records`); never relies on compaction."""
    latest: dict[str, bytes] = {}
    for m in sorted(await read_records(bootstrap, topic, timeout),
                    key=lambda m: (m.partition, m.offset)):
        if m.key is None:
            continue
        if m.value is None:
            latest.pop(m.key.decode(), None)
        else:
            latest[m.key.decode()] = m.value
    return latest


async def end_offsets(bootstrap: str, topic: str, timeout: float = 20.0) -> dict[int, int]:
    consumer = make_consumer(bootstrap, group_id=None, client_id="lpcal-it-reader")
    async with asyncio.timeout(timeout):
        await consumer.start()
        try:
            await consumer.topics()
            tps = [TopicPartition(topic, p)
                   for p in sorted(consumer.partitions_for_topic(topic) or ())]
            ends = await consumer.end_offsets(tps) if tps else {}
        finally:
            await consumer.stop()
    return {tp.partition: int(o) for tp, o in ends.items()}


async def read_binmaps(bootstrap: str, topic: str, timeout: float = 20.0
                       ) -> dict[str, tuple[bytes, BinMap]]:
    """Latest bin map per model on the (compacted) bin-map topic: ``{model: (bytes, BinMap)}``."""
    latest = await read_latest(bootstrap, topic, timeout)
    return {k: (v, BinMap.from_json(v)) for k, v in latest.items()}


async def binmap_contents(bootstrap: str, topic: str, timeout: float = 60.0
                          ) -> dict[str, dict[int, list[dict]]]:
    """Every bin map published on ``topic``, each verified by ``BinMap.from_json``:
    ``{model: {version: [content, ...]}}`` in topic order, contents without ``created_at`` and
    ``checksum`` (two publishes of one fit differ only there)."""
    out: dict[str, dict[int, list[dict]]] = {}
    for rec in await read_records(bootstrap, topic, timeout):
        version = BinMap.from_json(rec.value).version
        body = orjson.loads(rec.value)
        for key in ("created_at", "checksum"):
            body.pop(key, None)
        out.setdefault(rec.key.decode(), {}).setdefault(version, []).append(body)
    return out


@dataclass
class DeadLetter:
    reason: str
    source_topic: str
    source_partition: int
    source_offset: int
    value: bytes
    key: bytes | None


async def read_deadletters(bootstrap: str, topic: str, timeout: float = 20.0
                           ) -> list[DeadLetter]:
    out = []
    for m in await read_records(bootstrap, topic, timeout):
        info = deadletter_info(m.headers)
        out.append(DeadLetter(info["reason"], info["source_topic"], info["source_partition"],
                              info["source_offset"], m.value, m.key))
    return out


@dataclass
class StateSnapshot:
    """Latest records of a daemon's state topic."""

    envelopes: dict[str, dict] = field(default_factory=dict)   # model -> envelope
    models: dict[str, ModelState] = field(default_factory=dict)
    manifests: dict[int, dict] = field(default_factory=dict)   # partition -> manifest

    def summary(self) -> str:
        return (f"models={ {m: repr(s) for m, s in self.models.items()} } "
                f"samples={ {m: s.samples_total for m, s in self.models.items()} } "
                f"offsets={ {m: s.offsets for m, s in self.models.items()} } "
                f"manifests={self.manifests}")


async def read_state(bootstrap: str, topic: str, timeout: float = 20.0) -> StateSnapshot:
    """Parse the ``model/<id>`` envelopes (``{"format","model","partition","state",
    "inflight"}``) and ``partition/<n>`` manifests of a state topic."""
    snap = StateSnapshot()
    latest, _stale = reassemble(await read_latest(bootstrap, topic, timeout))
    for key, value in latest.items():
        if key.startswith("model/"):
            env = orjson.loads(decode_value(value))
            snap.envelopes[key[6:]] = env
            snap.models[key[6:]] = ModelState.from_dict(env["state"])
        elif key.startswith("partition/"):
            snap.manifests[int(key.split("/", 1)[1])] = orjson.loads(value)
    return snap


# --------------------------------------------------------------------------- HTTP


async def http_get(url: str, path: str, timeout: float = 5.0,
                   headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as cs,
                cs.get(url + path, headers=headers) as r):
        return r.status, await r.read()


async def http_post(url: str, path: str, timeout: float = 5.0,
                    headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as cs,
                cs.post(url + path, headers=headers) as r):
        return r.status, await r.read()


Samples = dict[tuple[str, frozenset], float]


async def scrape_metrics(url: str) -> Samples:
    """``GET /metrics`` parsed with ``prometheus_client.parser``:
    ``{(sample name, frozenset(labels.items())): value}``."""
    status, body = await http_get(url, "/metrics")
    assert status == 200, f"/metrics answered {status}: {body[:300]!r}"
    out: Samples = {}
    for fam in text_string_to_metric_families(body.decode("utf-8")):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def metric_value(samples: Samples, name: str, default: float | None = None,
                 **labels: str) -> float:
    """The value of the sample ``name{labels}`` (exact label set); ``default`` if absent."""
    key = (name, frozenset(labels.items()))
    if key in samples:
        return samples[key]
    if default is not None:
        return default
    near = sorted(f"{n}{dict(lb)}" for n, lb in samples if n == name)[:20]
    raise AssertionError(f"metric {name}{labels} not exported; present: {near}")


# --------------------------------------------------------------------------- pools


def pool_cells(pools: PoolSet) -> Counter:
    """``{(pool, bin key, label): count}`` of a pool set."""
    cells: Counter = Counter()
    for name, table in pools.tables.items():
        d = table.to_dict()
        for b, lab, c in zip(d["bin"], d["label"], d["count"]):
            cells[(name, d["bins"][b], lab)] += c
    return cells


def pool_diff(got: PoolSet, ref: PoolSet) -> tuple[int, int]:
    """``(lost, doubled)``: samples in ``ref`` missing from ``got``, and extra in ``got``."""
    g, r = pool_cells(got), pool_cells(ref)
    return sum((r - g).values()), sum((g - r).values())


async def gather_bounded(timeout: float, *aws: Awaitable) -> list:
    return await asyncio.wait_for(asyncio.gather(*aws), timeout)
