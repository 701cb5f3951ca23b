"""Security.

* Kafka SASL/SSL: the embedded Tansu broker supports neither (see :mod:`daemon.kafka`), so
  the test checks that the aiokafka clients the DAEMON builds receive the settings: a real
  ``Daemon.startup()`` with SASL_SSL settings (CA, client certificate and key generated with
  the ``openssl`` CLI; the password from a secrets-dir file), where only the network calls
  (``start()`` of the producer/consumer, topic creation, partition counts) are replaced; then
  the producer's and consumer's ``AIOKafkaClient`` and the checkpoint store are inspected.
* The admin endpoint refuses requests without the exact bearer token, and compares with
  ``hmac.compare_digest`` (spied on: called once per request, with the full header).
* Secrets never appear in logs, responses or ``Settings.redacted()``/``repr``: the SASL
  password and admin token in the in-process SASL_SSL daemon's DEBUG log (aiokafka included,
  while its broker probe fails); the admin token (from a secrets dir) in a subprocess daemon's
  whole DEBUG log and in every ``/v1``, probe and ``/metrics`` response.
* Bounds: request bodies over ``http.max_body_bytes`` get 413; events over
  ``kafka.max_message_bytes`` are dead-lettered as ``oversize`` (one byte over; an event of
  exactly the limit is accepted).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import subprocess

import aiohttp
import orjson
import pytest

from daemon.http_api import HttpServer
from daemon.kafka import clients as kafka_clients
from daemon.kafka import topics as kafka_topics
from daemon.service import Daemon
from daemon.settings import load_settings
from lpcal.errors import InputError
from tests.support.daemon_harness import (
    EventProducer,
    TopicNames,
    create_topics,
    daemon_config,
    free_port,
    http_get,
    http_post,
    read_deadletters,
    to_toml,
    wait_until,
)
from tests.support.reliability import FastDaemon, wait_settled

TOKEN = "adm-7f3c9e1b5d-SECRET-token"
PASSWORD = "sasl-pw-4e8a2c6f0b-SECRET"


def _openssl(tmp_path):
    """A CA, and a client certificate + key signed by it (EC P-256, valid 2 days)."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=lpcal-test-ca")
    run("req", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=lpcal-client")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "client.pem", "-days", "2")
    run("req", *ec, "-keyout", "other.key", "-out", "other.csr", "-subj", "/CN=other")
    return {n: tmp_path / n for n in ("ca.pem", "client.pem", "client.key", "other.key")}


def _secrets(tmp_path, sasl: bool = True):
    d = tmp_path / "secrets"
    d.mkdir()
    if sasl:
        (d / "kafka__sasl_password").write_text(PASSWORD)
    (d / "http__admin_token").write_text(TOKEN)
    return d


def _sasl_ssl_settings(tmp_path, files, secrets):
    cfg = daemon_config(f"127.0.0.1:{free_port()}", TopicNames.for_prefix("sec"),
                        http_port=free_port(), log_level="DEBUG",
                        kafka={"security_protocol": "SASL_SSL",
                               "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "lpcal-user",
                               "ssl_cafile": str(files["ca.pem"]),
                               "ssl_certfile": str(files["client.pem"]),
                               "ssl_keyfile": str(files["client.key"])})
    path = tmp_path / "sasl.toml"
    path.write_text(to_toml(cfg))
    return load_settings(path, secrets_dir=secrets)


def _check_client(client, where: str) -> None:
    assert client._security_protocol == "SASL_SSL", where
    assert client._sasl_mechanism == "SCRAM-SHA-512", where
    assert client._sasl_plain_username == "lpcal-user", where
    assert client._sasl_plain_password == PASSWORD, where
    ctx = client._ssl_context
    assert isinstance(ctx, ssl.SSLContext), where
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname, where
    cas = [dict(x[0] for x in c["subject"]).get("commonName") for c in ctx.get_ca_certs()]
    assert "lpcal-test-ca" in cas, (where, cas)


async def test_daemon_aiokafka_clients_receive_sasl_ssl_settings(tmp_path, monkeypatch,
                                                                 caplog):
    files = _openssl(tmp_path)
    settings = _sasl_ssl_settings(tmp_path, files, _secrets(tmp_path))
    calls: dict[str, object] = {}

    async def no_network(self):
        calls[type(self).__name__] = True

    async def ensure_topics(bootstrap, specs, *, security=None):
        calls["ensure_topics"] = security
        return {s.name: s.partitions for s in specs}

    async def partition_counts(bootstrap, topics, *, security=None):
        calls["partition_counts"] = security
        return {t: 1 for t in topics}

    monkeypatch.setattr(kafka_clients.AIOKafkaProducer, "start", no_network)
    monkeypatch.setattr(kafka_clients.AIOKafkaConsumer, "start", no_network)
    monkeypatch.setattr(kafka_topics, "ensure_topics", ensure_topics)
    monkeypatch.setattr(kafka_topics, "partition_counts", partition_counts)
    caplog.set_level(logging.DEBUG)
    d = Daemon(settings)
    d.s.kafka.create_topics = True
    await d.startup()
    try:
        _check_client(d.clients.producer.client, "producer")
        _check_client(d.clients.consumer._client, "consumer")
        assert calls["ensure_topics"] is settings.kafka
        assert calls["partition_counts"] is settings.kafka
        assert d.store.backend.security is settings.kafka  # checkpoint reads (admin/consumer)
        kw = kafka_clients.client_kwargs(d.store.backend.security)
        assert kw["sasl_plain_password"] == PASSWORD and kw["security_protocol"] == "SASL_SSL"
        await asyncio.sleep(2.5)  # the broker probe runs (and fails: nothing listens)
    finally:
        d.clients.stop_probe()
        await d.http.stop()
        await d.clients.producer.stop()
    # a client key that does not belong to the certificate is refused, naming the settings
    with pytest.raises(InputError, match="ssl_certfile/ssl_keyfile"):
        kafka_clients.client_kwargs({"security_protocol": "SSL", "ssl_cafile": files["ca.pem"],
                                     "ssl_certfile": files["client.pem"],
                                     "ssl_keyfile": files["other.key"]})
    red = orjson.dumps(settings.redacted()).decode()
    assert PASSWORD not in red and TOKEN not in red and "**********" in red
    assert PASSWORD not in repr(settings) and TOKEN not in repr(settings)
    assert any(r.name.startswith("aiokafka") for r in caplog.records)  # a real log
    assert PASSWORD not in caplog.text and TOKEN not in caplog.text


async def _serve(tmp_path, admin_token, max_body=1024):
    cfg = daemon_config("127.0.0.1:1", TopicNames.for_prefix("adm"), http_port=free_port(),
                        admin_token=admin_token, http={"max_body_bytes": max_body})
    path = tmp_path / "adm.toml"
    path.write_text(to_toml(cfg))
    http = HttpServer(Daemon(load_settings(path)).status())
    await http.start()
    return http, f"http://127.0.0.1:{http.port}"


async def test_admin_endpoint_needs_exact_bearer_token_compared_in_constant_time(
        tmp_path, monkeypatch, figures):
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    http, url = await _serve(tmp_path, TOKEN)
    path = "/v1/models/nobody/recalibrate"
    try:
        bad = [None, "Bearer wrong", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
               f"Basic {TOKEN}", f"Bearer  {TOKEN}", ""]
        for header in bad:
            st, body = await http_post(url, path, headers=None if header is None else
                                       {"Authorization": header})
            assert st == 401 and TOKEN.encode() not in body, (header, st, body)
        st, body = await http_post(url, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert st == 404 and b"not owned" in body  # authorized; the model is not here
    finally:
        await http.stop()
    figures("security: admin endpoint", {
        "requests with a missing/wrong/malformed token": len(bad),
        "answered 401": len(bad), "valid token": "authorized (404: model not on this replica)",
        "hmac.compare_digest calls": len(seen)})
    assert len(seen) == len(bad) + 1
    assert all(b == f"Bearer {TOKEN}".encode() for _, b in seen)
    http, url = await _serve(tmp_path, None)
    try:
        st, _ = await http_post(url, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert st == 403  # no token configured: the endpoint is disabled
    finally:
        await http.stop()


async def test_request_bodies_over_max_body_bytes_get_413(tmp_path):
    http, url = await _serve(tmp_path, TOKEN, max_body=1024)
    try:
        statuses = {}
        async with aiohttp.ClientSession() as cs:
            for auth in (True, False):
                for n in (1025, 5_000_000):
                    hdr = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
                    async with cs.post(url + "/v1/models/m/recalibrate", data=b"x" * n,
                                       headers=hdr) as r:
                        statuses[(auth, n)] = r.status
    finally:
        await http.stop()
    assert set(statuses.values()) == {413}, statuses


@pytest.mark.integration
async def test_secrets_never_in_logs_or_responses_and_events_bounded(broker, topic_prefix,
                                                                     tmp_path):
    names = TopicNames.for_prefix(topic_prefix)
    await create_topics(broker.bootstrap, names, partitions=1)
    limit = 2048
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(), log_level="DEBUG",
                        defaults={"pool": 50, "mu_pool": 50, "warmup": 100, "holdout": 100, "recovery": "epochs"},
                        models={"sec-m": {"k": 3}},
                        kafka={"max_message_bytes": limit})
    secrets = _secrets(tmp_path, sasl=False)  # PLAINTEXT broker: a SASL password is refused
    daemon = FastDaemon(cfg, tmp_path, name="sec", env={"LPCAL_SECRETS_DIR": str(secrets)})
    daemon.start()
    bodies = []
    try:
        await daemon.wait_ready(60)
        base = {"model": "sec-m", "ts": 1.0, "probs": [0.2, 0.3, 0.5]}
        pad = limit - len(orjson.dumps({**base, "id": "at-limit", "pad": ""}))
        at_limit = orjson.dumps({**base, "id": "at-limit", "pad": "x" * pad})
        over = orjson.dumps({**base, "id": "over-lim", "pad": "x" * (pad + 1)})
        assert (len(at_limit), len(over)) == (limit, limit + 1)
        async with EventProducer(broker.bootstrap) as prod:
            await prod.raw(names.predictions, at_limit, "sec-m")
            await prod.raw(names.predictions, over, "sec-m")
            for i in range(600):
                await prod.prediction(names.predictions, "sec-m", f"e{i}", [0.6, 0.3, 0.1], 2.0)
                await prod.outcome(names.outcomes, "sec-m", f"e{i}", i % 3, 3.0)
            await prod.flush()
        await wait_settled(daemon.url, {"sec-m": 600}, 30)
        await wait_until(lambda: http_get(daemon.url, "/v1/models/sec-m/binmap"), 20,
                         "a bin map")
        for path in ("/v1/models", "/v1/models/sec-m/binmap", "/v1/models/nope/binmap",
                     "/metrics", "/readyz", "/healthz"):
            bodies.append(await http_get(daemon.url, path))
        for hdr in ({"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {TOKEN}"}):
            bodies.append(await http_post(daemon.url, "/v1/models/sec-m/recalibrate",
                                          headers=hdr))
        assert [s for s, _ in bodies[-2:]] == [401, 202]
        dl = await wait_until(lambda: read_deadletters(broker.bootstrap, names.deadletter), 20,
                              "the oversize dead letter")
        rc, _ = daemon.terminate(60)
    finally:
        daemon.stop_quietly()
    assert rc == 0
    assert [(d.reason, d.value) for d in dl] == [("oversize", over)]
    log = daemon.all_logs()
    assert "DEBUG" in log and len(log) > 10_000  # a real, verbose log was captured
    assert TOKEN not in log
    for status, body in bodies:
        assert TOKEN.encode() not in body, (status, body[:200])
