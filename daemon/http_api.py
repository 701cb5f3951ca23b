"""HTTP adapter (aiohttp): probes, metrics and the small admin API.

* ``GET /metrics``: Prometheus exposition of :class:`daemon.metrics.DaemonMetrics`;
* ``GET /healthz``: 200 while the poll loop advances (it also advances while the broker is
  down, since the process can recover); 503 when it has stalled for ``stall_seconds``, or when
  restoring the assigned partitions has kept failing for ``ASSIGN_UNHEALTHY_SECONDS`` (120 s,
  see ``Daemon.on_assigned``);
* ``GET /readyz``: 200 once started, partitions assigned and state restored, and the broker
  answers metadata requests; 503 otherwise;
* ``GET /v1/models``: the models this replica owns, with pool fill, fit mode, bin-map version
  and the current bin map's held-out certificate (``{"selected", "certified", "bound", "eps",
  "n_holdout"}``, or null);
* ``GET /v1/models/{model}/binmap``: the latest verified bin map of ANY model, on every replica:
  the bytes published, from the replica's view of the bin-map topic
  (:mod:`daemon.binmap_view`), or the map this replica installed when that one is newer.
  ``ETag`` is the map's checksum (quoted) and ``X-Lpcal-Version`` its version; a request whose
  ``If-None-Match`` names the current checksum gets 304 without a body. 404 only when no map
  exists for the model; 503 (``Retry-After``) while the replica has not yet read the topic to
  its end once;
* ``GET /v1/models/{model}``: the model's summary: latest version, checksum, created_at, mode,
  k, certified (or null without a certificate) and the certificate, and ``owner``: this
  replica's state of the model when it owns it (as in ``/v1/models``), else null; the version
  also in ``X-Lpcal-Version``. 404 when the model has no map and is not owned here;
* ``GET /v1/config``: the effective settings (:meth:`daemon.settings.Settings.redacted`: every
  source applied, per-model settings merged), secrets masked as ``**********`` (the SASL
  password, the admin token, the signing key, and any other ``password``, ``token``,
  ``secret`` or ``private_key`` value); like the other ``GET /v1`` routes, no token needed;
* ``POST /v1/models/{model}/recalibrate``: manual trigger, ``Authorization: Bearer <token>``
  (the scheme in any case, RFC 7235) compared in constant time; disabled (403) when no admin
  token is configured; any other header, including bytes that are not UTF-8, gets 401.

Request bodies are capped at ``http.max_body_bytes``; no response carries settings secrets.

Slow and idle clients cannot hold the server:

* a connection that has not delivered a complete request head within
  ``http.idle_timeout_seconds`` of opening or of its previous response is closed (aiohttp's
  keep-alive timer, whose default is about an hour, runs from those moments and is not reset
  by partial data);
* a request body must arrive within ``http.body_timeout_seconds`` (else 408, then close);
* at most ``http.max_connections`` connections are held: a connection accepted at the limit
  closes the oldest connection that is not inside a handler. The kubelet opens a fresh
  connection per probe and sends its request at once, so ``/healthz`` keeps answering while
  slow clients hold the limit, and descriptors stay bounded.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from daemon.binmap_view import BinMapView
from daemon.registry import ModelInfo
from lpcal.errors import LpcalError

log = logging.getLogger("lpcal.daemon")

STALL_SECONDS = 30.0
_EVICT_LOG_EVERY = 60.0  # seconds between warnings about connections closed at the limit
_FD_RESERVE = 64         # descriptors left for Kafka clients, files and the listener


class HttpListenError(LpcalError):
    """The HTTP listener cannot be opened (port in use, address not available); ``lpcal serve``
    prints the message, which names ``http.port``/``http.host``, and exits 2."""


@dataclass(frozen=True)
class DaemonStatus:
    """What the HTTP API reads of a daemon (:meth:`daemon.service.Daemon.status`): the
    settings, read-only views (each a call, answered at the time of the request) and one
    command."""

    settings: object
    exposition: Callable[[], bytes]  # the Prometheus text of the daemon's metrics
    #: ``(started, restored, broker_ok, ready)``
    lifecycle: Callable[[], tuple[bool, bool, bool, bool]]
    last_poll: Callable[[], float]  # time.monotonic() of the last poll
    assignment_unhealthy: Callable[[], bool]
    assigned: Callable[[], list[tuple[str, int]]]  # (topic, partition), sorted
    paused: Callable[[], set[int]]  # input partitions paused by backpressure
    models: Callable[[], list[ModelInfo]]  # the owned models, sorted by id
    model: Callable[[str], ModelInfo | None]  # one owned model
    binmaps: Callable[[], BinMapView | None]  # the bin-map view, once started
    request_recalibration: Callable[[str], bool]  # False: the model is not owned here


class _MapAnswer(NamedTuple):
    """What the bin-map routes answer for one model (see :meth:`HttpServer._latest`)."""

    raw: bytes
    version: int
    checksum: str
    created_at: str | None
    mode: str | None
    k: int | None
    certificate: dict | None

    @property
    def etag(self) -> str:
        return f'"{self.checksum}"'


def certificate_summary(cert: Any) -> dict | None:
    """``{"selected", "certified", "bound", "eps", "n_holdout"}`` of a bin map's certificate
    (a dict), or None (none, or malformed)."""
    try:
        if not cert:
            return None
        return {"selected": cert["selected"], "certified": cert["certified"],
                "bound": cert["estimates"][cert["selected"]]["bound"],
                "eps": cert["eps"], "n_holdout": cert["n_holdout"]}
    except (AttributeError, KeyError, TypeError):
        return None


def _not_modified(request: web.Request, etag: str) -> bool:
    """True when ``If-None-Match`` names ``etag`` (or is ``*``; weak tags compare equal)."""
    header = request.headers.get("If-None-Match")
    if not header:
        return False
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == etag:
            return True
    return False


class _LimitedSite(web.BaseSite):
    """A TCP site whose protocol factory is :meth:`HttpServer._accept` (the connection limit);
    otherwise :class:`aiohttp.web.TCPSite`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, factory,
                 backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._lpcal = (host, port, factory)

    @property
    def name(self) -> str:
        host, port, _ = self._lpcal
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        host, port, factory = self._lpcal
        self._server = await asyncio.get_running_loop().create_server(
            factory, host, port, backlog=self._backlog)


class HttpServer:
    """The daemon's HTTP API over ``status``, a :class:`DaemonStatus` (what it
    reads of the daemon, and the one command it gives: recalibrate)."""

    def __init__(self, status, stall_seconds: float = STALL_SECONDS):
        self.status = status
        self.settings = status.settings
        self.stall = stall_seconds
        self._signer = self.settings.signing.signer()  # None: this replica publishes unsigned
        s = self.settings.http
        self.app = web.Application(client_max_size=s.max_body_bytes,
                                   middlewares=[self._bounded_body])
        self.app.add_routes([
            web.get("/metrics", self.metrics),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}/binmap", self.binmap),
            web.get("/v1/models/{model}", self.model),
            web.get("/v1/config", self.config),
            web.post("/v1/models/{model}/recalibrate", self.recalibrate),
        ])
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        self._certs: dict[str, tuple[bytes, dict | None]] = {}  # model -> (bin map, summary)
        self._own: dict[str, tuple[bytes, _MapAnswer | None]] = {}  # owned maps, parsed once
        self._busy: set = set()  # connections (request handlers) inside a route handler
        # connection -> True once connected, else the time it was created (see _accept)
        self._conns: dict = {}
        self.evicted = 0  # connections closed to make room at http.max_connections
        self._evict_logged = 0.0

    @web.middleware
    async def _bounded_body(self, request: web.Request, handler):
        """413 for bodies over ``http.max_body_bytes``, declared or streamed, on every route;
        408 for bodies not received within ``http.body_timeout_seconds``."""
        s = self.settings.http
        limit = s.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit,
                                                actual_size=request.content_length)
        if request.body_exists:
            try:
                async with asyncio.timeout(s.body_timeout_seconds):
                    await request.read()  # enforces client_max_size on chunked bodies (413)
            except TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=f"request body not received within {s.body_timeout_seconds:g} s",
                    headers={"Connection": "close"}) from None
        conn = request.protocol
        self._busy.add(conn)
        try:
            return await handler(request)
        finally:
            self._busy.discard(conn)

    def _accept(self):
        """Protocol factory of the listener: a new connection at ``http.max_connections``
        first closes the oldest connections not inside a handler.

        Connections are tracked here from their creation (``self._conns``, oldest first):
        the event loop accepts a burst of connections before any of them is registered with
        aiohttp's server, so its list of connections would undercount."""
        now = time.monotonic()
        for h, seen in list(self._conns.items()):
            if h.transport is not None:
                if seen is not True:
                    self._conns[h] = True
            elif seen is True or now - seen > 5.0:  # closed, or never connected
                del self._conns[h]
        excess = len(self._conns) + 1 - self.settings.http.max_connections
        if excess > 0:
            for h, seen in list(self._conns.items()):  # oldest first (insertion order)
                if excess <= 0:
                    break
                if seen is not True or h in self._busy:
                    continue
                h.force_close()
                del self._conns[h]
                excess -= 1
                self.evicted += 1
            if now - self._evict_logged >= _EVICT_LOG_EVERY:
                self._evict_logged = now
                log.warning("http: %d connections open (http.max_connections = %d): closing "
                            "the oldest; %d closed so far", len(self._conns),
                            self.settings.http.max_connections, self.evicted)
        handler = self.runner.server()
        self._conns[handler] = now
        return handler

    async def start(self) -> None:
        s = self.settings.http
        # keepalive_timeout: also bounds a connection's wait for its first/next request head
        # (the timer starts at connect and after each response, and partial data does not
        # reset it); lingering_time: how long the unread rest of a refused body is drained
        self.runner = web.AppRunner(
            self.app, access_log=None, keepalive_timeout=s.idle_timeout_seconds,
            lingering_time=min(2.0, s.body_timeout_seconds), shutdown_timeout=2.0)
        await self.runner.setup()
        # the listen backlog is also how many connections asyncio accepts in one go before any
        # protocol (so the limit above) sees them: keep such a burst within the descriptors
        # reserved beyond the limit
        site = _LimitedSite(self.runner, s.host, s.port, self._accept,
                            backlog=_FD_RESERVE // 2)
        try:
            await site.start()
        except OSError as e:
            await self.runner.cleanup()
            self.runner = None
            raise HttpListenError(
                f"cannot listen for HTTP on {s.host}:{s.port} "
                f"({os.strerror(e.errno) if e.errno else e}): set "
                f"http.port (LPCAL_HTTP__PORT) to a free port, or http.host to an address of "
                f"this host") from None
        self.port = self.runner.addresses[0][1] if self.runner.addresses else s.port
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and s.max_connections + _FD_RESERVE > soft:
            log.warning("http.max_connections = %d leaves fewer than %d of the process's %d "
                        "file descriptors to the rest of the daemon; lower it or raise the "
                        "limit (ulimit -n)", s.max_connections, _FD_RESERVE, soft)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.status.exposition(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def healthz(self, request: web.Request) -> web.Response:
        if self.status.assignment_unhealthy():
            # restoring the assigned partitions has kept failing (they stay paused): only a
            # restart can help (Daemon.on_assigned)
            return web.json_response({"status": "assignment_failing"}, status=503)
        age = time.monotonic() - self.status.last_poll()
        if age > self.stall and self.status.lifecycle()[0]:
            return web.json_response({"status": "stalled", "poll_age_seconds": age}, status=503)
        return web.json_response({"status": "ok", "poll_age_seconds": round(age, 3)})

    async def readyz(self, request: web.Request) -> web.Response:
        started, restored, broker_ok, ready = self.status.lifecycle()
        body = {"started": started, "restored": restored, "broker": broker_ok,
                "partitions": [[t, p] for t, p in self.status.assigned()]}
        return web.json_response(body, status=200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        paused = self.status.paused()
        return web.json_response({"models": [self._row(m, paused)
                                             for m in self.status.models()]})

    def _row(self, m, paused: set[int]) -> dict:
        """An owned model's state (a :class:`daemon.registry.ModelInfo`), as listed;
        ``paused``: the partitions paused by backpressure."""
        st = m.state
        return {
            "model": m.model, "k": st.k, "partition": m.partition,
            "epoch": st.epoch, "binmap_version": st.binmap_version,
            "fit_in_flight": m.fit_in_flight,
            "epochs_waiting": len(st.sealed),
            "paused": m.partition in paused,
            "recovery": st.online_spec.recovery,  # online: no epoch pools to fill (null)
            "pool_fill": None if (fill := st.pool_fill()) is None else {
                n: {"count": c, "target": t} for n, (c, t) in fill.items()},
            "samples_total": st.samples_total,
            "mode": st.fit_spec.mode.value,
            "certificate": self._certificate(m.model, st.binmap),
        }

    def _certificate(self, model: str, binmap: bytes | None) -> dict | None:
        """Summary of the bin map's certificate (parsed once per installed map)."""
        if binmap is None:
            return None
        cached = self._certs.get(model)
        if cached is not None and cached[0] is binmap:
            return cached[1]
        try:
            summary = certificate_summary(orjson.loads(binmap).get("certificate"))
        except (orjson.JSONDecodeError, AttributeError):
            summary = None
        self._certs[model] = (binmap, summary)
        return summary

    def _owned_map(self, model: str) -> _MapAnswer | None:
        """The map this replica installed for ``model`` (its own fit, checkpoint or adoption;
        parsed once per installed map), or None. When this replica signs its maps, an
        unsigned installed map is not served: the online loop installs its maps at the
        sample it decides and the daemon signs them when it publishes them, so until then
        the topic's (signed) map is the answer."""
        owned = self.status.model(model)
        if owned is None or owned.state.binmap is None:
            self._own.pop(model, None)
            return None
        raw = owned.state.binmap
        cached = self._own.get(model)
        if cached is not None and cached[0] is raw:
            return cached[1]
        answer = None
        try:
            obj = orjson.loads(raw)
            if obj.get("signature") is not None or self._signer is None:
                answer = _MapAnswer(raw, int(obj["version"]), str(obj["checksum"]),
                                    obj.get("created_at"), obj.get("mode"), obj.get("k"),
                                    obj.get("certificate"))
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            answer = None
        self._own[model] = (raw, answer)
        return answer

    def _latest(self, model: str) -> _MapAnswer | None:
        """The newest map of ``model`` known here: the replica's view of the bin-map topic,
        or the map this replica installed when it is newer (published, not read back yet)."""
        view = self.status.binmaps()
        served = None if view is None else view.get(model)
        own = self._owned_map(model)
        if served is None or (own is not None and own.version > served.version):
            return own
        bm = served.bm
        return _MapAnswer(served.raw, bm.version, bm.checksum, bm.created_at, bm.mode, bm.k,
                          bm.certificate and bm.certificate.to_dict())

    def _unknown(self, model: str) -> web.Response:
        """404 (no map exists) once the view has read the topic, else 503."""
        view = self.status.binmaps()
        if view is not None and not view.ready:
            return web.json_response(
                {"error": "this replica has not read the bin-map topic to its end yet"},
                status=503, headers={"Retry-After": "1"})
        return web.json_response({"error": f"no bin map for model {model!r}"}, status=404)

    async def binmap(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        answer = self._latest(model)
        if answer is None:
            return self._unknown(model)
        headers = {"ETag": answer.etag, "X-Lpcal-Version": str(answer.version),
                   "Cache-Control": "no-cache"}
        if _not_modified(request, answer.etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=answer.raw, content_type="application/json", headers=headers)

    async def model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        answer = self._latest(model)
        owned = self.status.model(model)
        if answer is None and owned is None:
            return self._unknown(model)
        cert = None if answer is None else certificate_summary(answer.certificate)
        body = {
            "model": model,
            "version": None if answer is None else answer.version,
            "checksum": None if answer is None else answer.checksum,
            "created_at": None if answer is None else answer.created_at,
            "mode": None if answer is None else answer.mode,
            "k": None if answer is None else answer.k,
            "certified": None if cert is None else bool(cert["certified"]),
            "certificate": cert,
            "owner": None if owned is None else {"replica": "this",
                                                 **self._row(owned, self.status.paused())},
        }
        headers = {} if answer is None else {"X-Lpcal-Version": str(answer.version)}
        return web.json_response(body, headers=headers)

    async def config(self, request: web.Request) -> web.Response:
        return web.json_response(redact(self.settings.redacted()),
                                 dumps=lambda v: orjson.dumps(v).decode())

    async def recalibrate(self, request: web.Request) -> web.Response:
        token = self.settings.http.admin_token
        if token is None:
            return web.json_response({"error": "manual trigger disabled: no admin token set"},
                                     status=403)
        expected = b"Bearer " + token.get_secret_value().encode()
        if not hmac.compare_digest(_bearer(request), expected):
            return web.json_response({"error": "unauthorized"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        model = request.match_info["model"]
        if not self.status.request_recalibration(model):
            return web.json_response({"error": f"model {model!r} is not owned by this replica"},
                                     status=404)
        return web.json_response({"model": model, "status": "recalibration requested"},
                                 status=202)


MASK = "**********"
_SECRET_KEY = re.compile(r"password|token|secret|private_key", re.IGNORECASE)


def redact(value: Any, key: str = "") -> Any:
    """``value`` (JSON-like) with every non-empty string or number under a key that names a
    secret (``password``, ``token``, ``secret``, ``private_key``) replaced by ``MASK``: a
    second line of defence behind the settings' ``SecretStr`` fields, for ``/v1/config``."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if key and _SECRET_KEY.search(key) and value not in (None, "", MASK) \
            and not isinstance(value, bool):
        return MASK
    return value


def _bearer(request: web.Request) -> bytes:
    """The Authorization header as bytes, its scheme spelled ``Bearer`` when it is that scheme
    in any case (RFC 7235: schemes are case-insensitive); the credentials stay exactly as sent.
    Header bytes that are not UTF-8 reach aiohttp as surrogate escapes; they are encoded back
    to the bytes sent (which then cannot match), never an error."""
    got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    scheme, sep, credentials = got.partition(b" ")
    if sep and scheme.lower() == b"bearer":
        return b"Bearer " + credentials
    return got
