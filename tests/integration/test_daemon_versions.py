"""Bin-map versions never go backwards, and a version adopted from the topic is not a count of
fitted epochs (in-process daemons, real broker).

Both tests first run a daemon until model ``vm`` has published version V >= 3, and stop it.

* Its state record ``model/vm`` is then overwritten with bytes that are not a checkpoint (as a
  corrupt or lost state record). The restarted daemon starts the model without state: its next
  map must be version V + 1 (it used to publish version 1 while V was on the topic, which a
  following :class:`lpcal.client.BinMapStore` ignores as stale), and it is what every reader
  gets.
* Its state record is overwritten with a valid checkpoint of a fresh model (version 0), as a
  release that restarted versions at 0 wrote it. The restarted daemon adopts version V from the
  topic, but the V versions were published BEFORE that checkpoint: it must not count them as
  fitted epochs (it counted V, and its next V epochs published nothing), so its next epoch
  publishes version V + 1.
"""

from __future__ import annotations

import orjson
import pytest

from daemon.checkpoint.envelope import ENVELOPE_FORMAT
from daemon.kafka.clients import make_consumer
from daemon.model_state import ModelState
from lpcal.binmap import BinMap
from lpcal.client import BinMapFollower, BinMapStore
from tests.support.daemon_harness import (
    EventProducer,
    RunningDaemon,
    TopicNames,
    http_get,
    read_records,
    running_daemon,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

MODEL = "vm"
# one epoch: a warm-up of 100, 7 pools of 100 and 50 held out, about 1,000 samples by id hash
SMALL_EPOCHS = {"pool": 100, "mu_pool": 100, "warmup": 100, "holdout": 50, "recovery": "epochs",
                "drift_threshold": 100.0}


class Traffic:
    """Complete samples of ``vm`` in chunks, each with new ids."""

    def __init__(self, names: TopicNames, bootstrap: str):
        self.names, self.bootstrap, self.sent = names, bootstrap, 0

    async def send(self, n: int) -> None:
        ids, probs, labels = synth_samples(n, 3, self.sent + 1, f"{MODEL}-{self.sent}")
        async with EventProducer(self.bootstrap) as prod:
            await prod.samples(self.names, MODEL, ids, probs, labels,
                               ts0=1_764_000_000.0 + self.sent)
            await prod.flush()
        self.sent += n


async def _publish_until(rd: RunningDaemon, traffic: Traffic, version: int) -> int:
    """Send traffic until ``vm`` has published ``version`` (or more); its version."""
    for _ in range(12):
        st = rd.daemon.registry.states().get(MODEL)
        if st is not None and st.binmap_version >= version:
            break
        before = 0 if st is None else st.samples_total
        await traffic.send(500)
        def consumed(before=before):
            st = rd.daemon.registry.states().get(MODEL)
            return st is not None and st.samples_total >= before + 500 and not rd.daemon.registry.fitting()
        await wait_until(consumed, 30, "the chunk consumed and fitted", diag=rd.describe)
    st = rd.daemon.registry.slots[MODEL].state
    assert st.binmap_version >= version, rd.describe()
    return st.binmap_version


async def _topic_versions(bootstrap: str, topic: str) -> list[int]:
    return [BinMap.from_json(r.value).version for r in
            sorted(await read_records(bootstrap, topic), key=lambda r: r.offset)
            if r.key == MODEL.encode() and r.value is not None]


async def _first_run(deployment):
    names = await deployment.topics(1)
    settings = deployment.settings(deployment.config(defaults=SMALL_EPOCHS))
    traffic = Traffic(names, deployment.bootstrap)
    async with running_daemon(settings) as rd:
        v = await _publish_until(rd, traffic, 3)
    assert await _topic_versions(deployment.bootstrap, names.binmaps) == list(range(1, v + 1))
    return names, settings, traffic, v


async def _replace_state_record(bootstrap: str, names: TopicNames, value: bytes) -> None:
    async with EventProducer(bootstrap) as prod:
        await prod.raw(names.state, value, f"model/{MODEL}")
        await prod.flush()


async def _follow(bootstrap: str, topic: str) -> dict[str, int]:
    store = BinMapStore()
    consumer = make_consumer(bootstrap, topic, group_id=None, client_id="it-versions")
    async with BinMapFollower(store, consumer) as follower:
        await follower.wait_ready(30)
    return store.versions()


async def test_a_model_whose_state_record_is_lost_continues_after_the_topics_version(
        deployment, broker, topic_prefix, tmp_path):
    names, settings, traffic, v = await _first_run(deployment)
    await _replace_state_record(broker.bootstrap, names, b"\x00 not a checkpoint")
    async with running_daemon(settings) as rd:
        assert MODEL not in rd.daemon.registry.states()  # the record could not be used
        await traffic.send(300)
        await wait_until(lambda: MODEL in rd.daemon.registry.states(), 30, "vm seen", diag=rd.describe)
        # no state: it starts after the latest verified version on the topic
        assert rd.daemon.registry.slots[MODEL].state.binmap_version == v
        new = await _publish_until(rd, traffic, v + 1)
        assert new == v + 1
        status, body = await http_get(rd.url, f"/v1/models/{MODEL}/binmap")
        assert status == 200 and BinMap.from_json(body).version == v + 1
    assert await _topic_versions(broker.bootstrap, names.binmaps) == list(range(1, v + 2))
    assert await _follow(broker.bootstrap, names.binmaps) == {MODEL: v + 1}


async def test_versions_adopted_from_before_the_checkpoint_are_not_fitted_epochs(
        deployment, broker, topic_prefix, tmp_path):
    names, settings, traffic, v = await _first_run(deployment)
    fresh = ModelState.create(MODEL, 3, settings.model_settings(MODEL), settings.join)
    assert fresh.binmap_version == 0
    await _replace_state_record(broker.bootstrap, names, orjson.dumps({
        "format": ENVELOPE_FORMAT, "model": MODEL, "partition": 0,
        "state": orjson.Fragment(fresh.to_checkpoint()), "inflight": None, "prefitted": 0}))
    async with running_daemon(settings) as rd:
        st = rd.daemon.registry.slots[MODEL].state  # restored from the fresh checkpoint ...
        assert st.binmap_version == v  # ... and version v adopted from the topic,
        assert rd.daemon.registry.slots[MODEL].prefitted == 0  # but no epoch counted as fitted
        new = await _publish_until(rd, traffic, v + 1)  # the next epoch is published
        assert new == v + 1
    assert await _topic_versions(broker.bootstrap, names.binmaps) == list(range(1, v + 2))


async def test_versions_published_after_the_checkpoint_are_fitted_epochs(
        deployment, broker, topic_prefix, tmp_path):
    """The positive control: a map published after the checkpoint was written (a crash between
    a publish and the next checkpoint) stands for an epoch that was filling at the checkpoint;
    the replay seals it again and it is not fitted a second time."""
    names, settings, _, v = await _first_run(deployment)
    last = [r for r in await read_records(broker.bootstrap, names.binmaps)
            if r.key == MODEL.encode()][-1]
    async with EventProducer(broker.bootstrap) as prod:  # after the final checkpoint
        await prod.raw(names.binmaps, BinMap.from_json(last.value).with_version(v + 1)
                       .to_json(), MODEL)
        await prod.flush()
    async with running_daemon(settings) as rd:
        assert rd.daemon.registry.slots[MODEL].state.binmap_version == v + 1
        assert rd.daemon.registry.slots[MODEL].prefitted == 1
