"""HTTP adapter (aiohttp): probes, metrics and the small admin API.

* ``GET /metrics``: Prometheus exposition of :class:`daemon.metrics.DaemonMetrics`;
* ``GET /healthz``: 200 while the poll loop advances (it also advances while the broker is
  down, since the process can recover); 503 when it has stalled for ``stall_seconds``;
* ``GET /readyz``: 200 once started, partitions assigned and state restored, and the broker
  answers metadata requests; 503 otherwise;
* ``GET /v1/models``: the models this replica owns, with pool fill, fit mode, bin-map version
  and the current bin map's held-out certificate (``{"selected", "certified", "bound", "eps",
  "n_holdout"}``, or null);
* ``GET /v1/models/{model}/binmap``: the current bin map JSON (404 if none yet);
* ``POST /v1/models/{model}/recalibrate``: manual trigger, ``Authorization: Bearer <token>``
  compared in constant time; disabled (403) when no admin token is configured.

Request bodies are capped at ``http.max_body_bytes``; no response carries settings secrets.
"""

from __future__ import annotations

import hmac
import time

import orjson
from aiohttp import web

STALL_SECONDS = 30.0


class HttpServer:
    def __init__(self, daemon, stall_seconds: float = STALL_SECONDS):
        self.d = daemon
        self.stall = stall_seconds
        s = daemon.s.http
        self.app = web.Application(client_max_size=s.max_body_bytes,
                                   middlewares=[self._bounded_body])
        self.app.add_routes([
            web.get("/metrics", self.metrics),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}/binmap", self.binmap),
            web.post("/v1/models/{model}/recalibrate", self.recalibrate),
        ])
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        self._certs: dict[str, tuple[bytes, dict | None]] = {}  # model -> (bin map, summary)

    @web.middleware
    async def _bounded_body(self, request: web.Request, handler):
        """413 for bodies over ``http.max_body_bytes``, declared or streamed, on every route."""
        limit = self.d.s.http.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit,
                                                actual_size=request.content_length)
        if request.body_exists:
            await request.read()  # enforces client_max_size on chunked bodies (413)
        return await handler(request)

    async def start(self) -> None:
        s = self.d.s.http
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.host, s.port)
        await site.start()
        self.port = self.runner.addresses[0][1] if self.runner.addresses else s.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.d.metrics.exposition(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def healthz(self, request: web.Request) -> web.Response:
        age = time.monotonic() - self.d.last_poll
        if age > self.stall and self.d.started:
            return web.json_response({"status": "stalled", "poll_age_seconds": age}, status=503)
        return web.json_response({"status": "ok", "poll_age_seconds": round(age, 3)})

    async def readyz(self, request: web.Request) -> web.Response:
        body = {"started": self.d.started, "restored": self.d.restored,
                "broker": self.d.broker_ok,
                "partitions": sorted([tp.topic, tp.partition] for tp in self.d.assigned)}
        return web.json_response(body, status=200 if self.d.ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        out = []
        for model, st in sorted(self.d.models.items()):
            out.append({
                "model": model, "k": st.k, "partition": self.d.partition_of.get(model),
                "epoch": st.epoch, "binmap_version": st.binmap_version,
                "fit_in_flight": model in self.d.inflight,
                "epochs_waiting": len(st.sealed),
                "paused": self.d.partition_of.get(model) in self.d.throttled,
                "pool_fill": {n: {"count": c, "target": t} for n, (c, t) in st.pools.fill().items()},
                "samples_total": st.samples_total,
                "mode": st.config.get("mode"),
                "certificate": self._certificate(model, st.binmap),
            })
        return web.json_response({"models": out})

    def _certificate(self, model: str, binmap: bytes | None) -> dict | None:
        """Summary of the bin map's certificate (parsed once per installed map)."""
        if binmap is None:
            return None
        cached = self._certs.get(model)
        if cached is not None and cached[0] is binmap:
            return cached[1]
        summary = None
        try:
            cert = orjson.loads(binmap).get("certificate")
            if cert:
                summary = {"selected": cert["selected"], "certified": cert["certified"],
                           "bound": cert["estimates"][cert["selected"]]["bound"],
                           "eps": cert["eps"], "n_holdout": cert["n_holdout"]}
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
            summary = None
        self._certs[model] = (binmap, summary)
        return summary

    async def binmap(self, request: web.Request) -> web.Response:
        st = self.d.models.get(request.match_info["model"])
        if st is None or st.binmap is None:
            return web.json_response({"error": "no bin map for this model on this replica"},
                                     status=404)
        return web.Response(body=st.binmap, content_type="application/json")

    async def recalibrate(self, request: web.Request) -> web.Response:
        token = self.d.s.http.admin_token
        if token is None:
            return web.json_response({"error": "manual trigger disabled: no admin token set"},
                                     status=403)
        got = request.headers.get("Authorization", "")
        expected = b"Bearer " + token.get_secret_value().encode()
        if not hmac.compare_digest(got.encode(), expected):
            return web.json_response({"error": "unauthorized"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        model = request.match_info["model"]
        if not self.d.request_recalibration(model):
            return web.json_response({"error": f"model {model!r} is not owned by this replica"},
                                     status=404)
        return web.json_response({"model": model, "status": "recalibration requested"},
                                 status=202)
