"""Online recovery (``recovery = "online"``) end to end against the embedded broker, on a real
network's predictions (WideResNet-16-4 on CIFAR-10, ``tests/bench/data``: over-confident, its
temperature about 2), with the shipped online defaults.

The stream is served by three daemons in turn, each stopped (final checkpoint) and the next
restored from it:

1. the first consumes 3,000 samples: still in the warm-up, nothing published;
2. the second continues from the checkpoint and publishes the first map at exactly the sample
   count the library's loop publishes it at on the same samples uninterrupted (the restart lost
   or repeated nothing), a few thousand samples in;
3. the third continues after it: the versions on the topic only go up, and the live version
   never goes back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daemon.model_state import ModelState
from lpcal.binmap import BinMap
from lpcal.client import verify_artifact
from tests.support.daemon_harness import (
    EventProducer,
    read_binmaps,
    read_records,
    running_daemon,
    wait_until,
)

pytestmark = pytest.mark.integration

MODEL = "online-cifar"
DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "wideresnet-16-4-cifar-10.npz"
T0 = 1_764_000_000.0


def _samples():
    d = np.load(DATA)
    probs = d["predictions"].astype(np.float64)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = d["ground_truth"].astype(np.int64)
    ids = [f"{MODEL}-{i}" for i in range(labels.size)]
    return ids, probs, labels


def _reference_first_map(settings, ids, probs, labels) -> tuple[int, int]:
    """(sample count, version) of the first map the library's loop publishes on the samples
    fed in one go (fit requests run at once)."""
    from lpcal.online import run_fit

    st = ModelState.create(MODEL, 10, settings.model_settings(MODEL), settings.join)
    for a in range(0, len(ids), 500):
        res = st.ingest(ids[a:a + 500], probs[a:a + 500], labels[a:a + 500])
        todo = [res]
        while todo:
            r = todo.pop()
            for e in r.events:
                if e.kind == "published":
                    return e.n, e.version
            todo += [st.complete_fit(q, run_fit(q)) for q in r.fit_requests]
    raise AssertionError("the reference loop published nothing")


async def _send(bootstrap, names, ids, probs, labels, a: int, b: int) -> None:
    async with EventProducer(bootstrap) as prod:
        await prod.samples(names, MODEL, ids[a:b], probs[a:b], labels[a:b], ts0=T0 + a)
        await prod.flush()


def _consumed(rd, n: int):
    def cond():
        st = rd.daemon.registry.states().get(MODEL)
        if st is None or st.online is None:
            return False
        waiting = 0 if st.backlog is None else st.backlog[1].size
        return st.online.n_seen + waiting >= n
    return cond


async def _versions(bootstrap: str, topic: str) -> list[int]:
    return [BinMap.from_json(r.value).version for r in
            sorted(await read_records(bootstrap, topic), key=lambda r: r.offset)
            if r.key == MODEL.encode() and r.value is not None]


async def test_online_model_publishes_within_thousands_and_survives_restarts(deployment,
                                                                              broker):
    names = await deployment.topics(1)
    settings = deployment.settings(deployment.config(
        defaults={"drift_threshold": 100.0},
        models={MODEL: {"k": 10, "recovery": "online"}}))
    ids, probs, labels = _samples()
    ref_n, ref_version = _reference_first_map(settings, ids, probs, labels)
    assert ref_version == 1 and ref_n < 8_000, ref_n
    first = 3_000
    assert first < ref_n

    async with running_daemon(settings) as rd:  # 1. the warm-up, interrupted
        await _send(broker.bootstrap, names, ids, probs, labels, 0, first)
        await wait_until(_consumed(rd, first), 60, "the first samples", diag=rd.describe)
        st = rd.daemon.registry.slots[MODEL].state
        assert st.online.warming and st.binmap_version == 0

    async with running_daemon(settings) as rd:  # 2. restored: the first map
        st = rd.daemon.registry.slots[MODEL].state
        assert st.online.n_seen + (0 if st.backlog is None else st.backlog[1].size) == first
        await _send(broker.bootstrap, names, ids, probs, labels, first, 7_000)
        await wait_until(_consumed(rd, 7_000), 90, "the samples to 7,000", diag=rd.describe)
        await wait_until(lambda: not rd.daemon.fitter.publishing(), 30, "the publishes")
        assert st.binmap_version >= 1
        v2 = st.binmap_version
    latest = await read_binmaps(broker.bootstrap, names.binmaps)
    raw, _ = latest[MODEL]
    bm = verify_artifact(raw)
    versions = await _versions(broker.bootstrap, names.binmaps)
    assert versions == list(range(1, v2 + 1))
    first_map = BinMap.from_json(next(
        r.value for r in await read_records(broker.bootstrap, names.binmaps)
        if r.key == MODEL.encode() and BinMap.from_json(r.value).version == 1))
    # the first map: where the uninterrupted loop publishes it, a few thousand samples in
    assert first_map.sizing["evidence"]["samples"] == ref_n
    assert first_map.sizing["evidence"]["mean_diff"] < 0
    assert 1.5 < first_map.temperature < 3.0  # the network is over-confident
    assert bm.version == v2

    async with running_daemon(settings) as rd:  # 3. restored after the map
        st = rd.daemon.registry.slots[MODEL].state
        assert st.binmap_version == v2
        await _send(broker.bootstrap, names, ids, probs, labels, 7_000, 10_000)
        await wait_until(_consumed(rd, 10_000), 90, "the rest", diag=rd.describe)
        await wait_until(lambda: not rd.daemon.fitter.publishing(), 30, "the publishes")
        v3 = st.binmap_version
        assert v3 >= v2
    versions = await _versions(broker.bootstrap, names.binmaps)
    assert versions == sorted(set(versions)) and versions[-1] == v3  # only up, no repeats
