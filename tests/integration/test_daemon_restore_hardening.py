"""The restore on partition assignment is total.

Each test runs real daemons on the embedded broker and writes the state topic directly:

* a model's valid checkpoint under another model's key is skipped, counted and
  logged with its topic, partition and offset; the model starts fresh (was a crash loop);
* state values and manifests the daemon cannot use (``[]``, a non-integer offset, ...) cost
  that record only, never the partition (it used to pause every partition for good);
* a rolling update that hands one replica more restored models than ``max_models``;
* an assignment that fails anyway is retried, and ``/healthz`` fails after a bounded time;
* compression bombs on the state topic: the daemon's peak RSS stays bounded;
* a changed ``k`` or ``eps`` in the settings on restore.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from pathlib import Path

import orjson
import pytest
import zstandard
from aiokafka.partitioner import murmur2

from daemon.checkpoint.envelope import ENVELOPE_FORMAT
from daemon.checkpoint.store import COMPRESSED, ZLIB
from daemon.model_state import ModelState
from tests.support.daemon_harness import (
    EventProducer,
    SubprocessDaemon,
    TopicNames,
    build_settings,
    daemon_config,
    free_port,
    http_get,
    metric_value,
    running_daemon,
    scrape_metrics,
    start_daemon,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration
RESTORES = "lpcal_state_restores_total"


def _restores(samples, outcome: str) -> float:
    return metric_value(samples, RESTORES, default=0.0, outcome=outcome)


def _envelope(st: ModelState, partition: int = 0, model: str | None = None) -> bytes:
    return orjson.dumps({"format": ENVELOPE_FORMAT, "model": model or st.model,
                         "partition": partition, "state": orjson.Fragment(st.to_checkpoint()),
                         "inflight": None, "prefitted": 0})


def _state(settings, model: str, n: int, k: int = 3) -> ModelState:
    """A state of ``model`` with ``n`` joined samples."""
    st = ModelState.create(model, k, settings.model_settings(model), settings.join)
    ids, probs, labels = synth_samples(n, k, 7, f"{model}-old")
    st.ingest(ids, probs, labels)
    return st


async def _send(names: TopicNames, bootstrap: str, model: str, n: int, k: int = 3,
                seed: int = 1, prefix: str = "new") -> None:
    ids, probs, labels = synth_samples(n, k, seed, f"{model}-{prefix}")
    async with EventProducer(bootstrap) as prod:
        await prod.samples(names, model, ids, probs, labels)
        await prod.flush()


async def test_checkpoint_under_another_models_key_is_skipped_not_a_crash_loop(
        deployment, broker, caplog):
    """Model ``ma``'s valid checkpoint stored under ``model/mb``."""
    names = await deployment.topics(1)
    cfg = deployment.config(defaults={"k": 3})
    settings = deployment.settings(cfg)
    async with EventProducer(broker.bootstrap) as prod:
        await prod.raw(names.state, _envelope(_state(settings, "ma", 40)), "model/mb")
        await prod.flush()
    caplog.set_level(logging.INFO, logger="lpcal.daemon")
    async with running_daemon(settings) as rd:
        await _send(names, broker.bootstrap, "mb", 30)

        def consumed():
            if rd.task.done():
                rd.task.result()
                raise RuntimeError("daemon ended")
            st = rd.daemon.registry.states().get("mb")
            return st is not None and st.samples_total == 30
        await wait_until(consumed, 30, "mb's 30 samples joined", diag=rd.describe)
        st = rd.daemon.registry.slots["mb"].state
        assert st.model == "mb" and "ma" not in rd.daemon.registry.states()
        samples = await scrape_metrics(rd.url)
        assert _restores(samples, "wrong_model") == 1
        assert not rd.task.done()
    text = caplog.text
    assert f"{names.state}[0]@0" in text and "'ma'" in text, text[-3000:]


async def test_unusable_state_values_and_manifests_cost_only_their_record(deployment, broker):
    """A state value ``[]``, a manifest offset that is not an integer, and other
    shapes; the good model on the same partition is restored and the partition consumed."""
    names = await deployment.topics(1)
    cfg = deployment.config(defaults={"k": 3})
    settings = deployment.settings(cfg)
    good = _state(settings, "good", 25)
    bad_values = {"model/list": b"[]", "model/null": b"null", "model/str": b'"x"',
                  "model/num": b"1e999", "model/bytes": b"\xff\xfe",
                  "model/badstate": orjson.dumps({"format": ENVELOPE_FORMAT, "model": "badstate",
                                                  "partition": 0, "state": []}),
                  "model/badpart": orjson.dumps({"format": ENVELOPE_FORMAT, "model": "badpart",
                                                 "partition": "zero", "state": {}}),
                  "model/hugepart": (b'{"format": "%s", "model": "hugepart", "partition": '
                                     b'1000000000000000000000000000000, "state": {}}'
                                     % ENVELOPE_FORMAT.encode()),
                  "model/good": _envelope(good)}
    async with EventProducer(broker.bootstrap) as prod:
        for key, value in bad_values.items():
            await prod.raw(names.state, value, key)
        await prod.raw(names.state, orjson.dumps(
            {"offsets": {names.predictions: "abc", names.outcomes: [1]}}), "partition/0")
        await prod.flush()
    rd = await start_daemon(settings, ready_timeout=40)
    try:
        await _send(names, broker.bootstrap, "good", 20)
        await wait_until(lambda: rd.daemon.registry.slots["good"].state.samples_total == 45, 30,
                         "good restored (25) and 20 more joined", diag=rd.describe)
        samples = await scrape_metrics(rd.url)
        assert _restores(samples, "restored") == 1
        assert _restores(samples, "corrupt") == 8
        assert _restores(samples, "bad_manifest") == 1
        status, _ = await http_get(rd.url, "/readyz")
        assert status == 200
    finally:
        await rd.stop(30)

    # a manifest that is not an object at all, and a non-integer offset in a good one
    async with EventProducer(broker.bootstrap) as prod:
        await prod.raw(names.state, b"[]", "partition/0")
        await prod.flush()
    async with running_daemon(settings, ready_timeout=40) as rd:
        assert rd.daemon.registry.slots["good"].state.samples_total >= 45


def _models_on_distinct_partitions(n: int, partitions: int) -> list[str]:
    out: dict[int, str] = {}
    i = 0
    while len(out) < n:
        m = f"roll-{i}"
        out.setdefault((murmur2(m.encode()) & 0x7FFFFFFF) % partitions, m)
        i += 1
    return [out[p] for p in sorted(out)]


async def test_rolling_update_restores_more_models_than_max_models(
        deployment, broker, topic_prefix, tmp_path):
    """Failover: 2 replicas, 4 models, ``max_models = 2``; one replica leaves and
    the survivor restores all 4 (restored models are always admitted) and keeps consuming."""
    names = await deployment.topics(4)
    models = _models_on_distinct_partitions(4, 4)
    group = f"{topic_prefix}-g"
    settings = [build_settings(daemon_config(
        broker.bootstrap, names, http_port=free_port(), group_id=group, partitions=4,
        defaults={"k": 3}, max_models=2), tmp_path,
        f"r{r}") for r in "AB"]
    a = await start_daemon(settings[0])
    b = None
    try:
        b = await start_daemon(settings[1])

        def split():
            pa = {tp.partition for tp in a.daemon.partitions.assigned}
            pb = {tp.partition for tp in b.daemon.partitions.assigned}
            return (a.daemon.ready and b.daemon.ready and len(pa) == 2 and len(pb) == 2
                    and not pa & pb)
        await wait_until(split, 40, "A and B own 2 partitions each",
                         diag=lambda: f"A {a.describe()}\nB {b.describe()}")
        for m in models:
            await _send(names, broker.bootstrap, m, 20)

        def all_seen():
            owned = {**{m: s.samples_total for m, s in a.daemon.registry.states().items()},
                     **{m: s.samples_total for m, s in b.daemon.registry.states().items()}}
            return owned == {m: 20 for m in models}
        await wait_until(all_seen, 30, "each replica joined its 2 models",
                         diag=lambda: f"A {a.describe()}\nB {b.describe()}")
        assert len(a.daemon.registry.states()) == 2 and len(b.daemon.registry.states()) == 2
        await asyncio.sleep(1.5)  # a periodic checkpoint
        await b.stop(30)
        await wait_until(lambda: len(a.daemon.partitions.assigned) == 8 and a.daemon.ready, 40,
                         "A owns every partition and is ready after B left",
                         diag=a.describe)
        for m in models:
            await _send(names, broker.bootstrap, m, 10, seed=2, prefix="late")
        await wait_until(lambda: {m: s.samples_total for m, s in a.daemon.registry.states().items()}
                         == {m: 30 for m in models}, 30, "A consumes all 4 models",
                         diag=a.describe)
        samples = await scrape_metrics(a.url)
        assert _restores(samples, "restored") >= 4  # every rebalance restores what A owns
        # a new model is still refused: A owns 4 >= max_models (label cardinality bound)
        await _send(names, broker.bootstrap, "roll-new", 5)

        async def refused():
            s = await scrape_metrics(a.url)
            return metric_value(s, "lpcal_events_invalid_total", reason="unknown_model") >= 10
        await wait_until(refused, 30, "the new model's 10 events refused", diag=a.describe)
        assert "roll-new" not in a.daemon.registry.states()
    finally:
        for rd in (a, b):
            if rd is not None and not rd.task.done():
                rd.daemon.stopping.set()
                try:
                    await asyncio.wait_for(rd.task, 20)
                except BaseException:  # noqa: BLE001
                    rd.task.cancel()


async def test_failing_assignment_is_retried_then_healthz_fails(deployment):
    """Invariant: an assignment that fails anyway is retried with backoff (the partitions
    stay paused meanwhile) and, while it keeps failing past a bound, ``/healthz`` is 503."""
    from daemon.service import Daemon
    from tests.support.daemon_harness import FAST_CONSUMER, RunningDaemon

    await deployment.topics(1)
    cfg = deployment.config(defaults={"k": 3})
    settings = deployment.settings(cfg)

    for fail_times, healthy in ((2, True), (10 ** 6, False)):
        d = Daemon(settings, consumer_options=dict(FAST_CONSUMER))
        d.assign_unhealthy_after = 3.0
        calls = {"n": 0}
        real = d.restorer.adopt_published_binmaps

        async def flaky(parts, real=real, calls=calls, fail_times=fail_times):
            calls["n"] += 1
            if calls["n"] <= fail_times:
                raise RuntimeError("injected assignment failure")
            await real(parts)
        d.restorer.adopt_published_binmaps = flaky
        rd = RunningDaemon(d, asyncio.create_task(d.serve(install_signals=False)), settings)
        try:
            if healthy:
                await wait_until(lambda d=d: d.ready, 40, "ready after 2 failed attempts",
                                 diag=rd.describe)
                assert calls["n"] == 3
                status, _ = await http_get(rd.url, "/healthz")
                assert status == 200
            else:
                async def unhealthy(rd=rd):
                    status, _ = await http_get(rd.url, "/healthz")
                    return status == 503
                await wait_until(unhealthy, 40, "/healthz 503 after the bound",
                                 diag=rd.describe)
                assert calls["n"] >= 3 and not d.ready
        finally:
            d.stopping.set()
            await asyncio.wait_for(rd.task, 30)


async def test_compression_bomb_on_the_state_topic_keeps_memory_bounded(deployment, broker,
                                                                        tmp_path):
    """Records that inflate to 1 GiB each (1 MiB of zlib, the form of earlier versions, and
    a zstd frame), under model keys and a manifest key; the daemon (a subprocess) becomes
    ready, counts them, and its peak RSS stays low."""
    names = await deployment.topics(1)
    zeros = b"0" * (1 << 30)
    bomb = ZLIB + zlib.compress(zeros, 9)  # the form of earlier versions
    zbomb = COMPRESSED + zstandard.ZstdCompressor(level=19).compress(zeros)
    del zeros
    assert len(bomb) < 1.1 * (1 << 20)
    async with EventProducer(broker.bootstrap) as prod:
        for key in ("model/bomb1", "model/bomb2", "model/bomb3", "partition/0"):
            await prod.raw(names.state, bomb, key)
        await prod.raw(names.state, zbomb, "model/bomb4")
        await prod.flush()
    del bomb, zbomb
    cfg = deployment.config(defaults={"k": 3})
    d = SubprocessDaemon(cfg, tmp_path).start()
    try:
        await d.wait_ready(90)
        status = await asyncio.to_thread(Path(f"/proc/{d.pid}/status").read_text)
        hwm = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmHWM:"))
        peak_mib = hwm / 1024
        print(f"peak RSS with 5 compression bombs on the state topic: {peak_mib:.0f} MiB")
        assert peak_mib < 400, d.logs()
        samples = await scrape_metrics(d.url)
        assert metric_value(samples, RESTORES, outcome="too_large") == 5
        rc, _ = d.terminate(30)
        assert rc == 0, d.logs()
    finally:
        d.stop_quietly()


async def test_changed_k_and_eps_on_restore(deployment, broker, tmp_path):
    """k 3 -> 4 discards the restored pools (no event dead-lettered as
    ``wrong_length``); then eps 0.1 -> 0.05 starts a new epoch with the new config."""
    names = await deployment.topics(1)
    port = free_port()

    def settings(k: int, eps: float, name: str):
        return build_settings(daemon_config(
            broker.bootstrap, names, http_port=port, defaults={"eps": 0.1, "recovery": "epochs"},
            models={"mk": {"k": k, "eps": eps}}), tmp_path, name)

    async with running_daemon(settings(3, 0.1, "k3")) as rd:
        await _send(names, broker.bootstrap, "mk", 40, k=3)
        await wait_until(lambda: "mk" in rd.daemon.registry.states()
                         and rd.daemon.registry.slots["mk"].state.samples_total == 40, 30, "k=3 joined",
                         diag=rd.describe)
        await asyncio.sleep(1.5)
    async with running_daemon(settings(4, 0.1, "k4")) as rd:
        st = rd.daemon.registry.slots["mk"].state
        assert st.k == 4 and st.filling.total == 0 and st.binmap is None
        assert rd.daemon.parser.k["mk"] == 4
        await _send(names, broker.bootstrap, "mk", 30, k=4, seed=3, prefix="k4")
        await wait_until(lambda: rd.daemon.registry.slots["mk"].state.filling.total == 30, 30,
                         "k=4 events joined", diag=rd.describe)
        samples = await scrape_metrics(rd.url)
        assert metric_value(samples, "lpcal_events_invalid_total", reason="wrong_length") == 0
        assert _restores(samples, "k_changed") == 1
        await asyncio.sleep(1.5)
    async with running_daemon(settings(4, 0.05, "eps")) as rd:
        st = rd.daemon.registry.slots["mk"].state
        assert st.k == 4 and st.fit_spec.eps == 0.05
        assert st.filling.total == 0 and st.fill_epoch >= 1
        assert st.filling.layout.lam == st.lam
        samples = await scrape_metrics(rd.url)
        assert _restores(samples, "config_changed") == 1
        await _send(names, broker.bootstrap, "mk", 10, k=4, seed=4, prefix="eps")
        await wait_until(lambda: rd.daemon.registry.slots["mk"].state.filling.total == 10, 30,
                         "events joined after the eps change", diag=rd.describe)
        samples = await scrape_metrics(rd.url)
        assert metric_value(samples, "lpcal_events_invalid_total", reason="wrong_length") == 0
