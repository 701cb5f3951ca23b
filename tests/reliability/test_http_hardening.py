"""HTTP hardening: timeouts, connection limits, bearer parsing, admin tokens.

* Slow clients: a connection that does not deliver a complete request head within
  ``http.idle_timeout_seconds`` (of opening it, or of its previous response) is closed, and so
  is a request body that takes longer than ``http.body_timeout_seconds`` (408).
* Connection limit: at most ``http.max_connections`` connections are held; a new connection
  at the limit closes the oldest one that is not inside a handler, so ``/healthz`` (kubelet
  opens a fresh connection per probe) keeps answering while an attacker holds the limit.
  Proven against a real ``lpcal serve`` subprocess whose descriptor limit is lowered below the
  number of slow connections: before the fix the 3,000-connection finding reproduced with 400
  (accept failed with EMFILE and ``/healthz`` timed out).
* Authorization: the scheme is case-insensitive (RFC 7235), non-UTF-8 bytes get 401 (not
  500).

Every connection goes to 127.0.0.1, counts and waits are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time

import pytest

from daemon.http_api import HttpServer
from daemon.service import Daemon
from daemon.settings import load_settings
from tests.support.daemon_harness import (
    TopicNames,
    daemon_config,
    free_port,
    http_get,
    http_post,
    to_toml,
    wait_until,
)
from tests.support.reliability import FastDaemon

# serial: times connects, /healthz answers and server-side timeouts: `make test` runs the
# module alone, not on pytest-xdist workers
pytestmark = pytest.mark.serial

TOKEN = "adm-5b1e-hardening-token"
PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


async def _serve(tmp_path, **http):
    cfg = daemon_config("127.0.0.1:1", TopicNames.for_prefix("hh"), http_port=free_port(),
                        admin_token=TOKEN, http=http)
    path = tmp_path / "hh.toml"
    path.write_text(to_toml(cfg))
    server = HttpServer(Daemon(load_settings(path)).status())
    await server.start()
    return server, f"http://127.0.0.1:{server.port}"


async def _open_slow(port: int, n: int, connect_timeout: float = 2.0):
    """Open up to ``n`` connections that send a request head that never ends; stops at the
    first connect that does not complete within ``connect_timeout`` (accept queue full)."""
    conns = []
    for _ in range(n):
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port),
                                          connect_timeout)
        except (TimeoutError, OSError):
            break
        w.write(PARTIAL_HEAD)
        conns.append((r, w))
    return conns


async def _closed_by_server(reader: asyncio.StreamReader, wait: float) -> bool:
    """True if the server closed the connection (EOF or reset) within ``wait`` seconds."""
    try:
        data = await asyncio.wait_for(reader.read(65536), wait)
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    if not data:
        return True
    # a response (e.g. 408): the close follows
    try:
        rest = await asyncio.wait_for(reader.read(65536), wait)
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return not rest


def _close_all(conns) -> None:
    for _, w in conns:
        with contextlib.suppress(Exception):
            w.close()


async def _raw_request(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(request)
        await w.drain()
        return await asyncio.wait_for(r.readline(), timeout)
    finally:
        w.close()


# --------------------------------------------------------------------------- timeouts and limits


@pytest.mark.slow
async def test_slow_connections_cannot_exhaust_descriptors_healthz_keeps_answering(
        tmp_path, figures):
    """A real daemon (broker unreachable: it is still starting, and /healthz answers 200),
    default HTTP settings, descriptor limit 256; 400 connections that never finish their
    headers; then /healthz must answer within 5 s."""
    fd_limit, n_slow = 256, 400
    cfg = daemon_config(f"127.0.0.1:{free_port()}", TopicNames.for_prefix("hh-fd"),
                        http_port=free_port())
    d = FastDaemon(cfg, tmp_path, name="fd").start()
    conns = []
    try:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
        await wait_until(lambda: http_get(d.url, "/healthz", timeout=2.0), 30, "/healthz")
        port = cfg["http"]["port"]
        t0 = time.monotonic()
        conns = await _open_slow(port, n_slow)
        opened, n_conns = time.monotonic() - t0, len(conns)
        await asyncio.sleep(0.5)
        closed = sum(await asyncio.gather(*(_closed_by_server(r, 1.0) for r, _ in conns)))
        t1 = time.monotonic()
        try:
            status, _ = await http_get(d.url, "/healthz", timeout=5.0)
        except Exception as e:  # noqa: BLE001 - a timeout or a refused connection
            status = f"no answer ({type(e).__name__})"
        healthz_s = round(time.monotonic() - t1, 3)
        _close_all(conns)
        conns = []
        rc, _ = d.terminate(30)
    finally:
        _close_all(conns)
        d.stop_quietly()
    figures("hardening: slow connections vs /healthz", {
        "descriptor limit of the daemon": fd_limit, "slow connections opened": n_slow,
        "connects completed": f"{n_conns} in {opened:.2f} s",
        "closed by the server (oldest first)": closed,
        "/healthz": f"{status} in {healthz_s} s", "exit code after SIGTERM": rc})
    assert status == 200, (status, d.all_logs()[-3000:])
    assert healthz_s < 5.0
    assert closed >= n_conns - 100, closed  # http.max_connections (default 100) held at most
    assert rc == 0, d.all_logs()[-3000:]
    assert "Too many open files" not in d.all_logs()


async def test_connection_limit_closes_the_oldest_and_healthz_answers(tmp_path):
    server, url = await _serve(tmp_path, max_connections=10)
    conns = []
    try:
        conns = await _open_slow(server.port, 30)
        assert len(conns) == 30
        await asyncio.sleep(0.3)
        status, _ = await http_get(url, "/healthz", timeout=2.0)
        assert status == 200
        await asyncio.sleep(0.2)
        closed = await asyncio.gather(*(_closed_by_server(r, 0.3) for r, _ in conns))
        assert len(server.runner.server.connections) <= 10
        # the oldest went first: 20 to make room for the slow ones, then one for /healthz
        assert all(closed[:21]), closed
        assert not any(closed[21:]), closed
    finally:
        _close_all(conns)
        await server.stop()


async def test_partial_heads_idle_keepalive_and_slow_bodies_time_out(tmp_path):
    server, url = await _serve(tmp_path, idle_timeout_seconds=1.0, body_timeout_seconds=1.0)
    try:
        port = server.port
        t0 = time.monotonic()
        head = await _open_slow(port, 1)
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        idle_w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await idle_r.readline()).startswith(b"HTTP/1.1 200")
        body_r, body_w = await asyncio.open_connection("127.0.0.1", port)
        body_w.write(b"POST /v1/models/m/recalibrate HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
        results = await asyncio.gather(
            _closed_by_server(head[0][0], 4.0), _closed_by_server(idle_r, 4.0),
            asyncio.wait_for(body_r.readline(), 4.0))
        took = time.monotonic() - t0
        assert results[0] and results[1], results
        assert results[2].startswith(b"HTTP/1.1 408"), results[2]
        assert await _closed_by_server(body_r, 4.0)
        assert took < 4.0
        _close_all(head + [(idle_r, idle_w), (body_r, body_w)])
        # a normal request is unaffected
        assert (await http_get(url, "/healthz"))[0] == 200
    finally:
        await server.stop()


# --------------------------------------------------------------------------- tokens and bearer parsing


async def test_authorization_scheme_is_case_insensitive_and_bad_bytes_get_401(tmp_path):
    server, url = await _serve(tmp_path)
    path = "/v1/models/nobody/recalibrate"
    try:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            st, body = await http_post(url, path, headers={"Authorization": f"{scheme} {TOKEN}"})
            assert st == 404 and b"not owned" in body, (scheme, st, body)  # authorized
        for raw in (b"Bearer \xff\xfe\xfd", b"\xff\xfe " + TOKEN.encode(),
                    b"Bearer " + TOKEN.encode() + b"\xff", b"bearer\xa0" + TOKEN.encode()):
            line = await _raw_request(server.port, b"POST " + path.encode() + b" HTTP/1.1\r\n"
                                      b"Host: x\r\nAuthorization: " + raw + b"\r\n"
                                      b"Content-Length: 0\r\n\r\n")
            assert line.startswith(b"HTTP/1.1 401"), (raw, line)
        st, _ = await http_post(url, path, headers={"Authorization": f"Basic {TOKEN}"})
        assert st == 401
    finally:
        await server.stop()
