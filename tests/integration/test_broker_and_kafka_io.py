"""Real-broker tests of daemon.tools.embedded_broker and daemon.kafka, plus unit tests of
client_kwargs (which need no broker). The broker is never mocked."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from daemon.kafka.clients import client_kwargs, make_consumer, make_producer
from daemon.kafka.deadletter import deadletter_info, publish_deadletter
from daemon.kafka.readers import (
    end_offsets_lag,
    format_position,
    parse_position,
    partition_lags,
    read_compacted_latest,
    read_records,
    record_timestamp,
)
from daemon.kafka.topics import (
    COMPACT,
    TopicLayoutError,
    TopicMissingError,
    TopicSpec,
    check_copartitioned,
    describe_topic_config,
    ensure_topics,
    partition_counts,
)
from daemon.tools import embedded_broker as eb
from daemon.tools.embedded_broker import BrokerStartError, EmbeddedBroker, kafka_metadata_ping
from lpcal.errors import InputError

integration = pytest.mark.integration
FAST_GROUP = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists"; ours are reaped by Popen.wait, so this means alive
    return True


# --------------------------------------------------------------------------- embedded broker


@integration
def test_broker_answers_kafka_metadata_and_logs(broker):
    host, port = broker.bootstrap.split(":")
    assert host == "127.0.0.1" and int(port) == broker.port and broker.running
    brokers = kafka_metadata_ping(host, int(port))
    assert [(h, p) for _, h, p in brokers] == [("127.0.0.1", broker.port)]
    assert "ready in" in broker.log_path.read_text()


@integration
async def test_restart_keeps_port_and_loses_data(tmp_path):
    b = EmbeddedBroker(log_path=tmp_path / "tansu.log")
    with b:
        port, pid = b.port, b.pid
        counts = await ensure_topics(b.bootstrap, [TopicSpec("before-restart", 2)])
        assert counts == {"before-restart": 2}
        b.restart()
        assert b.port == port and b.bootstrap == f"127.0.0.1:{port}"
        assert b.pid != pid and not _pid_alive(pid)
        # memory storage: the restarted broker is empty
        assert await partition_counts(b.bootstrap, ["before-restart"]) == {}
    assert not b.running and not _pid_alive(b.pid or pid)
    log = (tmp_path / "tansu.log").read_text()
    assert log.count("ready in") == 2 and "stopped (exit code" in log


@integration
def test_stop_escalates_to_sigkill(tmp_path):
    b = EmbeddedBroker(log_path=tmp_path / "t.log", stop_timeout=0.5).start()
    proc = b._proc
    os.kill(proc.pid, signal.SIGSTOP)  # a stopped process ignores SIGTERM until continued
    t0 = time.monotonic()
    b.stop()
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


@integration
def test_start_retries_when_the_picked_port_is_taken(tmp_path, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        picks = iter([busy_port])
        real_free_port = eb._free_port
        monkeypatch.setattr(eb, "_free_port", lambda host: next(picks, None) or real_free_port(host))
        with EmbeddedBroker(log_path=tmp_path / "t.log") as b:
            assert b.port != busy_port
            assert kafka_metadata_ping("127.0.0.1", b.port)
        assert "AddrInUse" in (tmp_path / "t.log").read_text()
        # a fixed port cannot move: a clear error
        with pytest.raises(BrokerStartError, match="port in use"):
            EmbeddedBroker(port=busy_port, port_attempts=1, log_path=tmp_path / "f.log").start()


# --------------------------------------------------------------------------- topics


@integration
async def test_ensure_topics_creates_compacted_and_reports_actual_counts(broker, topic_prefix):
    bin_maps, preds = f"{topic_prefix}.binmaps", f"{topic_prefix}.preds"
    # nothing exists yet, and asking does not auto-create
    assert await partition_counts(broker.bootstrap, [bin_maps, preds]) == {}
    specs = [TopicSpec(bin_maps, 3, configs=COMPACT), {"name": preds, "partitions": 2}]
    assert await ensure_topics(broker.bootstrap, specs) == {bin_maps: 3, preds: 2}
    assert (await describe_topic_config(broker.bootstrap, bin_maps))["cleanup.policy"] == "compact"
    # existing topics are kept: a second call with other counts reports the ACTUAL counts
    again = await ensure_topics(broker.bootstrap, [TopicSpec(bin_maps, 5), TopicSpec(preds, 2)])
    assert again == {bin_maps: 3, preds: 2}


def test_topic_spec_validation():
    with pytest.raises(InputError, match="partitions must be an integer >= 1"):
        TopicSpec("t", 0)
    with pytest.raises(InputError, match="replication"):
        TopicSpec("t", 1, replication=0)
    with pytest.raises(InputError, match="name"):
        TopicSpec("bad topic!")
    with pytest.raises(InputError, match="configs"):
        TopicSpec("t", configs={"retention.ms": 1000})


@integration
async def test_check_copartitioned_on_real_counts(broker, topic_prefix):
    a, b, c = (f"{topic_prefix}.{x}" for x in "abc")
    counts = await ensure_topics(broker.bootstrap, [TopicSpec(a, 3), TopicSpec(b, 3),
                                                    TopicSpec(c, 2)])
    assert check_copartitioned(counts, a, b) == 3
    with pytest.raises(TopicLayoutError, match=r"\(3 partitions\).*\(2 partitions\).*co-part"):
        check_copartitioned(counts, a, c)
    with pytest.raises(TopicMissingError, match="nope"):
        check_copartitioned(counts, a, "nope")


# --------------------------------------------------------------------------- producing


@integration
async def test_deadletter_headers_round_trip(broker, topic_prefix):
    dlq = f"{topic_prefix}.dlq"
    await ensure_topics(broker.bootstrap, [TopicSpec(dlq, 1)])
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:
        raw = b'{"id": 1, "probs": [0.5, "x"]}\xff'
        md = await publish_deadletter(producer, dlq, raw, "bad_probs", "preds", 2, 1041)
        assert md.topic == dlq and md.offset == 0
    finally:
        await producer.stop()
    consumer = make_consumer(broker.bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(dlq, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        batch = await consumer.getmany(tp, timeout_ms=5000)
    finally:
        await consumer.stop()
    (msg,) = batch[tp]
    assert msg.value == raw
    assert deadletter_info(msg.headers) == {"reason": "bad_probs", "source_topic": "preds",
                                            "source_partition": 2, "source_offset": 1041}
    with pytest.raises(InputError, match="missing or bad header"):
        deadletter_info([("lpcal.reason", b"x")])


@integration
async def test_idempotence_off_works_and_on_fails_on_tansu(broker, topic_prefix):
    topic = f"{topic_prefix}.t"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 1)])
    plain = make_producer(broker.bootstrap, idempotence=False)
    await plain.start()
    try:
        offsets = [(await plain.send_and_wait(topic, b"v%d" % i)).offset for i in range(3)]
    finally:
        await plain.stop()
    assert offsets == [0, 1, 2]
    # Known Tansu limit, reliable in every run so far: InitProducerId is not implemented and
    # aiokafka raises UnknownError from start(). If this starts passing, Tansu gained
    # idempotent producers: delete this half of the test and allow idempotence in tests.
    idem = make_producer(broker.bootstrap, idempotence=True)
    try:
        with pytest.raises(KafkaError):
            await asyncio.wait_for(idem.start(), 15)
    finally:
        await idem.stop()


# --------------------------------------------------------------------------- reading


@integration
async def test_read_compacted_latest_keeps_last_value_per_key(broker, topic_prefix):
    topic = f"{topic_prefix}.binmaps"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 3, configs=COMPACT)])
    assert await read_compacted_latest(broker.bootstrap, topic, timeout=10) == {}
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:  # batched sends on purpose: Tansu then under-reports end offsets (see daemon.kafka)
        for version in range(4):
            for model in ("fraud", "churn", "spam", "ads"):
                await producer.send(topic, key=model.encode(), value=f"{model}@{version}".encode())
        await producer.send(topic, key=b"spam", value=None)  # tombstone
        await producer.send(topic, key=b"ads", value=None)
        await producer.send(topic, key=b"ads", value=b"ads@back")  # re-created after deletion
        await producer.send(topic, key=None, value=b"keyless")  # skipped
        await producer.flush()
    finally:
        await producer.stop()
    latest = await read_compacted_latest(broker.bootstrap, topic, timeout=10)
    # (no assertion that the broker compacted anything: Tansu compacts lazily, if at all)
    assert latest == {"fraud": b"fraud@3", "churn": b"churn@3", "ads": b"ads@back"}
    raw_keys = await read_compacted_latest(broker.bootstrap, topic, timeout=10, decode_keys=False)
    assert set(raw_keys) == {b"fraud", b"churn", b"ads"}


@integration
async def test_read_compacted_latest_missing_topic(broker, topic_prefix):
    missing = f"{topic_prefix}.absent"
    with pytest.raises(TopicMissingError, match="does not exist"):
        await read_compacted_latest(broker.bootstrap, missing, timeout=10)
    assert await read_compacted_latest(broker.bootstrap, missing, timeout=10, missing_ok=True) == {}
    assert await partition_counts(broker.bootstrap, [missing]) == {}  # still not auto-created


@integration
async def test_read_compacted_latest_reports_where_each_value_was_read(broker, topic_prefix):
    """The checkpoint store's reader (positions for its log lines) is this same read."""
    from daemon.checkpoint.store import read_latest_with_positions

    topic = f"{topic_prefix}.state"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 1, configs=COMPACT)])
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:  # offsets 0-5
        for key, value in [(b"a", b"a1"), (b"b", b"b1"), (b"a", b"a2"), (None, b"keyless"),
                           (b"b", None), (b"c", b"c1")]:
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()
    where: dict[str, str] = {}
    latest = await read_compacted_latest(broker.bootstrap, topic, timeout=10, where=where)
    assert latest == {"a": b"a2", "c": b"c1"}
    assert where == {"a": f"{topic}[0]@2", "c": f"{topic}[0]@5"}  # b's tombstone drops it
    assert await read_latest_with_positions(broker.bootstrap, topic, timeout=10) == (
        latest, where)
    missing = f"{topic_prefix}.absent"
    assert await read_latest_with_positions(broker.bootstrap, missing, timeout=10) == ({}, {})
    # every record, the batched ones past the (under-reported) end offset included
    records = await read_records(broker.bootstrap, topic, timeout=10)
    assert [(r.offset, r.key, r.value) for r in records] == [
        (0, b"a", b"a1"), (1, b"b", b"b1"), (2, b"a", b"a2"), (3, None, b"keyless"),
        (4, b"b", None), (5, b"c", b"c1")]
    with pytest.raises(TopicMissingError, match="does not exist"):
        await read_records(broker.bootstrap, missing, timeout=10)
    assert await read_records(broker.bootstrap, missing, timeout=10, missing_ok=True) == []


@integration
async def test_record_timestamp_reads_the_record_at_a_position(broker, topic_prefix):
    topic = f"{topic_prefix}.stamps"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 1)])
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:  # one record per request: Tansu reports exact end offsets then
        sent = [await producer.send_and_wait(topic, value=b"x", timestamp_ms=ms)
                for ms in (1_764_000_000_000, 1_764_000_001_500)]
    finally:
        await producer.stop()
    assert [md.offset for md in sent] == [0, 1]
    assert await record_timestamp(broker.bootstrap, format_position(topic, 0, 1)) == 1_764_000_001.5
    assert await record_timestamp(broker.bootstrap, format_position(topic, 0, 0)) == 1_764_000_000.0
    # past the end (beyond the one-record slack kept for Tansu's under-reported end offsets)
    assert await record_timestamp(broker.bootstrap, format_position(topic, 0, 3)) is None
    assert await record_timestamp(broker.bootstrap, "not a position") is None


def test_positions_format_and_parse():
    assert format_position("lpcal.state", 3, 41) == "lpcal.state[3]@41"
    assert parse_position("lpcal.state[3]@41") == ("lpcal.state", 3, 41)
    assert parse_position("a[b][0]@7") == ("a[b]", 0, 7)  # the last [partition]@offset counts
    for bad in ("lpcal.state", "t[x]@1", "t[1]@", "[1]@2", "t[1]@2 "):
        assert parse_position(bad) is None, bad


@integration
async def test_end_offsets_lag_follows_position_and_seek(broker, topic_prefix):
    topic = f"{topic_prefix}.t"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 2)])
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:
        for i in range(10):  # one record per request: Tansu's end offsets are wrong after
            await producer.send_and_wait(topic, b"x", partition=i % 2)  # multi-record batches
    finally:
        await producer.stop()
    consumer = make_consumer(broker.bootstrap)
    await consumer.start()
    try:
        assert await end_offsets_lag(consumer) == 0  # nothing assigned
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        assert await end_offsets_lag(consumer) == 10
        consumer.seek(tps[0], 3)
        assert await partition_lags(consumer) == {tps[0]: 2, tps[1]: 5}
        seen = 0
        deadline = time.monotonic() + 10
        while seen < 7 and time.monotonic() < deadline:
            seen += sum(len(v) for v in (await consumer.getmany(timeout_ms=200)).values())
        assert seen == 7
        assert await end_offsets_lag(consumer) == 0
    finally:
        await consumer.stop()


@integration
async def test_consumer_group_commits_and_rebalances_between_two_members(broker, topic_prefix):
    """Two members of one group split 4 partitions 2+2; committed offsets survive a restart."""
    topic, group = f"{topic_prefix}.t", f"{topic_prefix}.g"
    await ensure_topics(broker.bootstrap, [TopicSpec(topic, 4)])
    producer = make_producer(broker.bootstrap, idempotence=False)
    await producer.start()
    try:
        for i in range(8):
            await producer.send(topic, b"m%d" % i, partition=i % 4)
        await producer.flush()
    finally:
        await producer.stop()

    async def poll(c, seconds):
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            n += sum(len(v) for v in (await c.getmany(timeout_ms=100)).values())
        return n

    c1 = make_consumer(broker.bootstrap, topic, group_id=group, **FAST_GROUP)
    c2 = make_consumer(broker.bootstrap, topic, group_id=group, **FAST_GROUP)
    await c1.start()
    try:
        assert await poll(c1, 0.5) == 8
        await c1.commit()
        assert await c1.committed(TopicPartition(topic, 0)) == 2
        t0 = time.monotonic()
        await asyncio.gather(c2.start(), poll(c1, 0.3))
        deadline = t0 + 15
        while time.monotonic() < deadline:
            await asyncio.gather(poll(c1, 0.2), poll(c2, 0.2))
            a1, a2 = c1.assignment(), c2.assignment()
            if a1 and a2:
                break
        assert len(a1) == 2 and len(a2) == 2 and not (a1 & a2)
        assert {tp.partition for tp in a1 | a2} == {0, 1, 2, 3}
        # c2 leaves: c1 takes over all partitions. Wait for that before c1 leaves too: on Tansu,
        # a group leader leaving DURING a rebalance leaves a stale leader behind and no new
        # member can join that group again (measured: still stuck after 60 s).
        await c2.stop()
        deadline = time.monotonic() + 15
        while len(c1.assignment()) != 4 and time.monotonic() < deadline:
            await poll(c1, 0.2)
        assert {tp.partition for tp in c1.assignment()} == {0, 1, 2, 3}
    finally:
        await c2.stop()
        await c1.stop()
    # a new member resumes from the committed offsets: nothing left to read
    c3 = make_consumer(broker.bootstrap, topic, group_id=group, **FAST_GROUP)
    await c3.start()
    try:
        assert await poll(c3, 0.5) == 0
        assert {tp.partition: await c3.position(tp) for tp in c3.assignment()} == {
            0: 2, 1: 2, 2: 2, 3: 2}
    finally:
        await c3.stop()


# --------------------------------------------------------------------------- client_kwargs


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A self-signed CA/server cert and key made with openssl (skipped without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-subj", "/CN=lpcal-test-ca"],
        check=True, capture_output=True)
    return d


def test_client_kwargs_plaintext_defaults():
    assert client_kwargs(None) == {"security_protocol": "PLAINTEXT"}
    assert client_kwargs({}) == {"security_protocol": "PLAINTEXT"}
    assert client_kwargs({"security_protocol": "plaintext", "ssl_cafile": None}) == {
        "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("mech", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_client_kwargs_sasl_plaintext(mech):
    kw = client_kwargs({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mech,
                        "sasl_plain_username": "alice", "sasl_plain_password": "s3cret"})
    assert kw == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mech,
                  "sasl_plain_username": "alice", "sasl_plain_password": "s3cret"}


def test_client_kwargs_unwraps_secrets_and_reads_settings_objects():
    from pydantic import BaseModel, SecretStr

    class Kafka(BaseModel):  # shaped like daemon.settings.KafkaSettings
        bootstrap_servers: str = "b:9092"
        security_protocol: str = "SASL_PLAINTEXT"
        sasl_mechanism: str = "SCRAM-SHA-512"
        sasl_username: str = "bob"
        sasl_password: SecretStr = SecretStr("pw")
        ssl_cafile: None = None

    kw = client_kwargs(Kafka())
    assert kw["sasl_plain_password"] == "pw" and kw["sasl_plain_username"] == "bob"
    assert kw["sasl_mechanism"] == "SCRAM-SHA-512" and "bootstrap_servers" not in kw


@pytest.mark.parametrize("proto", ["SASL_PLAINTEXT", "SSL", "SASL_SSL"])
def test_client_kwargs_agrees_with_daemon_settings(pki, proto):
    from daemon.settings import KafkaSettings

    sasl = {"sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u", "sasl_password": "p"}
    ks = KafkaSettings(security_protocol=proto, **(sasl if proto.startswith("SASL") else {}),
                       **({"ssl_cafile": pki / "cert.pem"} if proto.endswith("SSL") else {}))
    ours, theirs = client_kwargs(ks), ks.aiokafka_kwargs()
    assert set(ours) == set(theirs) - {"bootstrap_servers", "client_id"}
    for k, v in ours.items():
        if k == "ssl_context":
            assert v.get_ca_certs() == theirs[k].get_ca_certs() and v.verify_mode == ssl.CERT_REQUIRED
        else:
            assert v == theirs[k]


def test_client_kwargs_sasl_ssl_builds_verifying_context(pki):
    kw = client_kwargs({"security_protocol": "SASL_SSL", "cafile": pki / "cert.pem",
                        "sasl_mechanism": "scram-sha-256", "sasl_username": "u",
                        "sasl_password": "p"})
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    subjects = [dict(x[0] for x in c["subject"]) for c in ctx.get_ca_certs()]
    assert {"commonName": "lpcal-test-ca"} in subjects
    assert kw["sasl_mechanism"] == "SCRAM-SHA-256"


def test_client_kwargs_mtls_loads_cert_and_key(pki):
    kw = client_kwargs({"security_protocol": "SSL", "ssl_cafile": str(pki / "cert.pem"),
                        "ssl_certfile": str(pki / "cert.pem"), "ssl_keyfile": str(pki / "key.pem")})
    assert kw["security_protocol"] == "SSL" and isinstance(kw["ssl_context"], ssl.SSLContext)
    with pytest.raises(InputError, match="ssl_certfile/ssl_keyfile: cannot load"):
        # a certificate is not a private key
        client_kwargs({"security_protocol": "SSL", "ssl_certfile": str(pki / "key.pem"),
                       "ssl_keyfile": str(pki / "cert.pem")})


@pytest.mark.parametrize("security, match", [
    ({"security_protocol": "TLS"}, "security_protocol: 'TLS' is not one of"),
    ({"protocol": "SSL"}, r"security.protocol: unknown setting"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u",
      "sasl_password": "p"}, "sasl_mechanism: 'GSSAPI' is not one of"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u", "sasl_password": "p"},
     "sasl_mechanism: None is not one of"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_password": "p"},
     "sasl_username: required with SASL_PLAINTEXT"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "u"},
     "sasl_password: required"),
    ({"security_protocol": "PLAINTEXT", "ssl_cafile": "/x.pem"}, "ssl_cafile: set, but"),
    ({"security_protocol": "SSL", "sasl_mechanism": "PLAIN"}, "sasl_mechanism: set, but"),
    ({"security_protocol": "SSL", "ssl_cafile": "/no/such/ca.pem"}, "ssl_cafile: file"),
    ({"sasl_username": "a", "sasl_plain_username": "b", "security_protocol": "SASL_PLAINTEXT"},
     "conflicts"),
    ("SSL", "expected a mapping"),
])
def test_client_kwargs_rejects_bad_settings(security, match):
    with pytest.raises(InputError, match=match):
        client_kwargs(security)


def test_client_kwargs_keyfile_needs_certfile(pki):
    with pytest.raises(InputError, match="ssl_keyfile: needs ssl_certfile"):
        client_kwargs({"security_protocol": "SSL", "ssl_keyfile": str(pki / "key.pem")})


async def test_factories_pass_security_through():
    sec = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
           "sasl_username": "u", "sasl_password": "p"}
    producer = make_producer("127.0.0.1:1", idempotence=False, security=sec)
    consumer = make_consumer("127.0.0.1:1", group_id="g", security=sec)
    for client in (producer.client, consumer._client):  # unstarted: no connection is made
        assert client._security_protocol == "SASL_PLAINTEXT"
        assert client._sasl_mechanism == "SCRAM-SHA-512"
        assert client._sasl_plain_username == "u" and client._sasl_plain_password == "p"
    with pytest.raises(InputError):
        make_producer("127.0.0.1:1", idempotence=False, security={"security_protocol": "X"})
