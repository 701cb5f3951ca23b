"""Backpressure: when fits fall behind the input (a backlog consumed after a restart, or pools
that fill in milliseconds), the daemon pauses the model's partition instead of dropping sealed
epochs, so every epoch is fitted and the published versions depend on the input alone.

Found by the crash-safety test (``tests/reliability/test_crash_safety.py``): a restarted daemon
consumed a backlog of several epochs in a few batches, the queue of sealed epochs overflowed and
its oldest entry was dropped, so the restarted run published 7 versions where the uninterrupted
run published 8, and versions 4-7 differed.

Here a backlog of many epochs is on the topic before the daemon starts and every fit is slowed
(the daemon's ``fit`` wrapped with a sleep in the worker thread), so ingest is far
faster than fits. The published versions must be exactly 1..E for the E epochs an offline
:class:`daemon.model_state.ModelState` seals from the same stream, each equal to the offline fit
of that epoch; the partition must have been paused, the waiting queue bounded, and ingest
resumed at the end. Midway the daemon is stopped while paused and a new one restores the
checkpointed backlog of sealed epochs and must finish it. (The restored backlog whose paused
partition brings no event to wake its model, with no fit in flight to chain the next one, is
pinned by the unit test ``tests/daemon/test_backpressure.py``.)"""

from __future__ import annotations

import asyncio
import math
import time

import orjson
import pytest

from daemon.events import EventParser
from daemon.fitting import fit_seed
from daemon.model_state import MAX_SEALED, ModelState
from lpcal.calibrate import fit_pools
from tests.support.daemon_harness import (
    EventProducer,
    daemon_config,
    free_port,
    metric_value,
    read_records,
    running_daemon,
    scrape_metrics,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

MODEL, K = "bp-a", 3
POOL = 40
FIT_DELAY = 0.2  # seconds each fit sleeps in the worker thread: far slower than ingest


def _complete(ids, probs, labels, ts0=1_764_000_000.0) -> list[bytes]:
    return [orjson.dumps({"model": MODEL, "id": e, "ts": ts0 + i, "probs": probs[i].tolist(),
                          "label": int(labels[i])}) for i, e in enumerate(ids)]


def _offline_epochs(settings, values: list[bytes]) -> list:
    """Sealed epochs (PoolSets, oldest first) of the stream, as one ModelState seals them."""
    st = ModelState.create(MODEL, K, settings.model_settings(MODEL), settings.join)
    batch = EventParser.from_settings(settings).parse_batch(values)
    assert not batch.invalid
    for mb in batch.by_model.values():
        st.offer(mb)
    return [ps for _, ps in st.sealed]


async def test_backlog_faster_than_fits_pauses_ingest_and_fits_every_epoch(
        deployment, broker, monkeypatch):
    names = await deployment.topics(1)
    cfg = daemon_config(broker.bootstrap, names, http_port=free_port(), partitions=1,
                        defaults={"pool": POOL, "mu_pool": 2 * POOL, "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0,
                                  "mode": "paper"},  # about backpressure, not the fit mode
                        models={MODEL: {"k": K}})
    settings = deployment.settings(cfg)
    per_epoch = sum(ModelState.create(MODEL, K, settings.model_settings(MODEL),
                                      settings.join).layout.targets.values())
    ids, probs, labels = synth_samples(per_epoch * (3 * MAX_SEALED + 2), K, 7, MODEL)
    values = _complete(ids, probs, labels)
    epochs = _offline_epochs(settings, values)
    assert len(epochs) >= 2 * MAX_SEALED + 2  # enough to overflow the queue many times over

    async with EventProducer(broker.bootstrap) as prod:  # the backlog, before the daemon
        for v in values:
            await prod.raw(names.predictions, v, MODEL)
        await prod.flush()

    def slow_fit(*a, **kw):
        time.sleep(FIT_DELAY)
        return fit_pools(*a, **kw)

    seen = {"max_waiting": 0, "paused": False, "restored_waiting": 0}

    def watcher(d, first: bool):
        async def watch():
            while True:
                st = d.registry.states().get(MODEL)
                if st is not None:
                    if not first and not seen["restored_waiting"]:
                        seen["restored_waiting"] = len(st.sealed)
                    seen["max_waiting"] = max(seen["max_waiting"], len(st.sealed))
                    seen["paused"] |= bool(d.partitions.paused())
                await asyncio.sleep(0.005)
        return asyncio.create_task(watch())

    # 1) stop (like SIGTERM) while paused with a backlog of sealed epochs: they are checkpointed
    async with running_daemon(settings, fit=slow_fit) as rd:
        d = rd.daemon
        w = watcher(d, True)
        try:
            await wait_until(lambda: d.partitions.paused() and 1 <= d.registry.slots[
                MODEL].state.binmap_version < len(epochs) - MAX_SEALED, 60,
                "paused with epochs waiting", diag=rd.describe)
        finally:
            w.cancel()
    # 2) a new daemon restores that backlog on a paused partition (no new events arrive to
    #    wake the model up) and must still fit every epoch, then resume
    async with running_daemon(settings, fit=slow_fit) as rd:
        d = rd.daemon
        w = watcher(d, False)
        try:
            def done():
                st = d.registry.states().get(MODEL)
                return (st is not None and st.samples_total == len(values)
                        and st.binmap_version == len(epochs) and MODEL not in d.registry.fitting())
            await wait_until(done, 60 + 2 * FIT_DELAY * len(epochs),
                             f"{len(values)} samples and {len(epochs)} bin maps",
                             diag=rd.describe)
            await asyncio.sleep(0.3)  # a surplus fit would have started by now
            st = d.registry.slots[MODEL].state
            assert st.binmap_version == len(epochs) and not st.sealed
            assert MODEL not in d.registry.fitting()
            assert not d.partitions.paused()  # resumed once the fits caught up
            # the gauge follows within a gauge period (1 s), though the model is idle now

            async def gauge_drained():
                mx = await scrape_metrics(rd.url)
                return metric_value(mx, "lpcal_epochs_waiting", model=MODEL) == 0
            await wait_until(gauge_drained, 5.0, "lpcal_epochs_waiting back to 0")
        finally:
            w.cancel()

    assert seen["restored_waiting"] >= 1, "the second daemon restored no waiting epoch"
    assert seen["paused"], "ingest was never paused although fits were far behind"
    # bounded: the mark plus what one fetched batch (at most 5000 records) can seal
    assert MAX_SEALED <= seen["max_waiting"] <= MAX_SEALED + math.ceil(5000 / per_epoch)

    published: dict[int, dict] = {}
    for rec in await read_records(broker.bootstrap, names.binmaps, timeout=30):
        body = orjson.loads(rec.value)
        for key in ("created_at", "checksum"):
            body.pop(key)
        assert body.get("version") not in published or published[body["version"]] == body
        published[body["version"]] = body
    assert sorted(published) == list(range(1, len(epochs) + 1))
    spec = ModelState.create(MODEL, K, settings.model_settings(MODEL), settings.join).fit_spec
    for v, pools in enumerate(epochs, start=1):
        bm = fit_pools(pools, spec, seed=fit_seed(MODEL, v), model_id=MODEL, version=v)
        want = orjson.loads(bm.to_json())
        for key in ("created_at", "checksum"):
            want.pop(key)
        assert published[v] == want, f"version {v} is not the fit of epoch {v}"
