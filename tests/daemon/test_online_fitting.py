"""Online recovery (``recovery = "online"``) in :class:`daemon.service.Daemon`, without a broker:
events go through ``Ingest.process``, the producer is a stand-in, the online fits run in the
daemon's worker thread (real :func:`lpcal.online.run_fit`, or a gated / failing stand-in).

- The maps the calibrator publishes go to the bin-map topic in version order, signed, with the
  version header; the version gauge follows.
- A fit request runs in the worker thread; while the stream is blocked on it the model's
  partition is paused, and resumed once the result is handed back; no joined sample is lost.
- A fit that raises is counted and does not stall the stream.
- A publish that fails is retried, and later versions wait for it (never out of order).
- A manual request makes the loop fit at its next decision point.
- A drift's refill restarts the warm-up on post-drift samples; the map that repairs the drift
  is labelled ``drift``. A refill while blocked drops the fit and feeds the rows waiting
  behind it.
- A restore publishes again a map the checkpoint installed but the topic lacks (the same
  bytes), and re-runs the fit requests the checkpoint holds. Behind the topic, the replay
  publishes the same maps again: they are not sent, the topic's bytes are installed when the
  replay reaches its version, and the maps after it are the uninterrupted run's; a replay that
  diverges (or a state the settings changed) adopts the topic's map; versions never go back.
- A released model leaves nothing behind in the fitter.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from daemon.checkpoint.envelope import decode_envelope, encode_envelope
from daemon.checkpoint.store import LocalCheckpointStore
from daemon.settings import Settings
from lpcal.client import verify_artifact
from lpcal.online import run_fit
from tests.support.daemon_harness import wait_until
from tests.support.daemon_stubs import broker_free_daemon

M, K = "online-unit", 3
T0 = 1.7e9  # event times: one event per second from here
#: a fast online loop: the warm-up ends at its minimum on this data, fits take effect 250
#: samples after their request
ONLINE = {"k": K, "recovery": "online", "warmup_tol": 0.2, "bucket_size": 500,
          "fit_delay": 250}


@dataclass
class Msg:
    value: bytes
    offset: int
    timestamp: int = 0
    key: bytes | None = None


class Producer:
    """Records sends; ``send_and_wait`` fails the first ``failures`` calls."""

    def __init__(self, failures: int = 0):
        self.failures, self.attempts = failures, 0
        self.sent: list[tuple[str, bytes, bytes, dict]] = []

    async def send_and_wait(self, topic, key, value, headers=()):
        self.attempts += 1
        await asyncio.sleep(0)
        if self.attempts <= self.failures:
            from aiokafka.errors import KafkaConnectionError
            raise KafkaConnectionError("broker unreachable (stand-in)")
        self.sent.append((topic, key, value, dict(headers)))

    def versions(self) -> list[int]:
        return [int(h["lpcal.version"]) for _, _, _, h in self.sent]


def settings(**model) -> Settings:
    return Settings(defaults={"drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                    models={M: {**ONLINE, **model}})


def events(start: int, n: int, seed: int = 0, scale: float = 2.5) -> list[bytes]:
    """``n`` complete events of :data:`M` (ids ``e{start}``...): an over-confident network
    (its logits scaled by ``scale`` against the labels' true distribution), which temperature
    scaling repairs."""
    rng = np.random.default_rng(seed * 1_000_003 + start)
    z = rng.normal(size=(n, K)) * 1.5
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    y = (rng.random(n)[:, None] > np.cumsum(p, 1)).sum(1)
    q = np.exp(scale * z) / np.exp(scale * z).sum(1, keepdims=True)
    return [orjson.dumps({"model": M, "id": f"e{start + i}", "ts": T0 + start + i,
                          "probs": q[i].tolist(), "label": int(y[i])}) for i in range(n)]


class Feeder:
    """Feeds the predictions partition 0 of ``d`` in batches, as the main loop does (skipping
    batches while the partition is paused, as aiokafka does not deliver them)."""

    def __init__(self, d):
        self.d, self.next = d, 0
        self.scale = 2.5  # of the network's logits (events)
        self.rescale: tuple[int, float] | None = None  # (from event, scale) after a change
        self.tp = TopicPartition(d.s.kafka.topics.predictions, 0)

    @property
    def paused(self) -> bool:
        return self.tp in self.d.clients.consumer.paused

    def batch(self, n: int = 250) -> bool:
        """One batch (False: the partition is paused, nothing fetched)."""
        if not self.paused:
            scale = (self.rescale[1] if self.rescale and self.next >= self.rescale[0]
                     else self.scale)
            vals = events(self.next, n, scale=scale)
            self.d.ingest.process(self.tp, [Msg(v, self.next + i, int((T0 + self.next + i) * 1000))
                                          for i, v in enumerate(vals)])
            self.next += n
        self.d.fitter.after_batch(time.monotonic())
        return not self.paused

    async def until(self, cond, what: str, limit: int = 40_000) -> None:
        while not cond():
            if self.next >= limit:
                raise AssertionError(f"{what}: not after {self.next} events")
            self.batch()
            await asyncio.sleep(0)


@pytest.fixture
def make():
    made = []

    def make(s: Settings | None = None, failures: int = 0, **kw):
        """A broker-free daemon of ``s`` (default :func:`settings`)."""
        d = broker_free_daemon(s or settings(), **kw)
        d.clients.producer = Producer(failures)
        made.append(d)
        return d

    yield make
    for d in made:
        d.executor.shutdown(wait=True)


async def until(cond, what: str) -> None:
    await wait_until(cond, 30.0, what, interval=0.01)


def gauge(d, name: str, **labels) -> float | None:
    return d.metrics.registry.get_sample_value(name, {"model": M, **labels})


def counting_fit():
    """``(calls, fit)``: :func:`lpcal.online.run_fit` recording each request it runs."""
    calls = []

    def fit(req):
        calls.append(req)
        return run_fit(req)

    return calls, fit


async def past_a_first_fit(make):
    """A daemon fed past its first (scheduled) fit request and that request's result back:
    ``(d, feed, calls)`` (``calls``: the requests its fit received)."""
    calls, counting = counting_fit()
    d = make(online_fit=counting)
    feed = Feeder(d)
    await feed.until(lambda: calls and d.registry.slots[M].state.online.pending is None,
                     "a first fit")
    return d, feed, calls


async def paused_on_a_gated_fit(make):
    """A daemon whose online fits wait for ``gate``, fed until its partition pauses on the
    first fit request: ``(d, feed, gate, calls)`` (``calls``: the requests the fit received)."""
    gate, calls = threading.Event(), []

    def gated_fit(req):
        calls.append(req)
        gate.wait(30)
        return run_fit(req)

    d = make(online_fit=gated_fit)
    feed = Feeder(d)
    await feed.until(lambda: feed.paused, "a pause on a fit request")
    return d, feed, gate, calls


async def test_online_maps_are_published_in_order_signed_and_counted(make):
    d = make()
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 2, "two maps")
    st = d.registry.slots[M].state
    await until(lambda: len(d.clients.producer.sent) == st.binmap_version, "the publishes")
    sent = d.clients.producer.sent
    assert d.clients.producer.versions() == list(range(1, st.binmap_version + 1))
    for topic, key, value, _ in sent:
        assert (topic, key) == (d.s.kafka.topics.binmaps, M.encode())
        bm = verify_artifact(value)
        assert bm.model_id == M and bm.temperature is not None
        assert bm.sizing["evidence"]["mean_diff"] < 0  # it beat the live map on held-out data
    # the installed map is the last one sent (up to the signature: the state keeps it unsigned)
    last = verify_artifact(sent[-1][2])
    assert (last.version, last.temperature) == (st.binmap_version,
                                               orjson.loads(st.binmap)["temperature"])
    assert gauge(d, "lpcal_binmap_version") == st.binmap_version
    assert gauge(d, "lpcal_calibrations_total", trigger="pools_full") == st.binmap_version
    # an over-confident network: the published temperature spreads its probabilities
    assert last.temperature > 1.5
    # no epoch pool gauges: the window has no target to fill (LpcalPoolsNotFilling would fire)
    assert st.pool_fill() is None
    assert gauge(d, "lpcal_pool_fill_ratio", pool="mu") is None
    assert gauge(d, "lpcal_pool_samples", pool="mu") is None
    # nor empty epoch pools in /v1/models: it names the recovery
    from daemon.http_api import HttpServer

    resp = await HttpServer(d.status()).models(None)
    row = orjson.loads(resp.body)["models"][0]
    assert (row["model"], row["recovery"], row["pool_fill"]) == (M, "online", None)
    assert row["binmap_version"] == st.binmap_version


async def test_stream_pauses_while_blocked_on_a_fit_and_resumes_after_it(make):
    d, feed, gate, calls = await paused_on_a_gated_fit(make)
    st = d.registry.slots[M].state
    assert st.backlogged and len(calls) == 1 and st.fit_requests_outstanding == calls
    req = calls[0]
    assert st.online.n_seen == req.due  # stopped exactly where the result takes effect
    joined_before = st.online.n_seen + (0 if st.backlog is None else st.backlog[1].size)
    assert feed.batch() is False  # nothing is fetched while paused
    assert st.backlogged and d.partitions.paused() == {0}
    gate.set()
    await until(lambda: not st.backlogged, "the fit to come back")
    assert not feed.paused and d.partitions.paused() == set()
    assert st.online.n_seen == joined_before  # the backlog went in, nothing lost
    assert st.fit_requests_outstanding == []
    feed.batch()
    assert st.online.n_seen == joined_before + 250


async def test_failed_online_fit_is_counted_and_does_not_stall(make):
    def failing(req):
        raise RuntimeError("no fit today")

    d = make(online_fit=failing)
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.online.requests_issued >= 1, "a fit request")
    st = d.registry.slots[M].state
    await until(lambda: not st.fit_requests_outstanding, "the failed fit to be handed back")
    assert gauge(d, "lpcal_calibration_failures_total") == 1
    n = st.online.n_seen
    for _ in range(8):
        feed.batch()
        await asyncio.sleep(0.01)
    assert st.online.n_seen > n + 1000 and not feed.paused


async def test_failed_publishes_are_retried_and_versions_go_out_in_order(make):
    d = make(failures=4)
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 2, "two maps")
    st = d.registry.slots[M].state
    await until(lambda: len(d.clients.producer.sent) == st.binmap_version, "the publishes")
    assert d.clients.producer.versions() == list(range(1, st.binmap_version + 1))
    assert gauge(d, "lpcal_calibration_failures_total") == 4
    assert gauge(d, "lpcal_binmap_version") == st.binmap_version


async def test_manual_request_fits_at_the_next_decision_point(make):
    d, feed, calls = await past_a_first_fit(make)
    st = d.registry.slots[M].state
    scheduled = st.online.next_fit_at
    assert d.fitter.request_recalibration(M)
    feed.batch(1)  # the trigger is asked after the batch
    at = st.online.next_fit_at
    assert at is not None and (scheduled is None or at < scheduled)
    await feed.until(lambda: len(calls) == 2, "the manual fit")
    assert calls[1].n == st.online.regime_start + at  # the next multiple of step


async def test_drift_refill_while_blocked_feeds_the_waiting_rows(make):
    d, feed, gate, _ = await paused_on_a_gated_fit(make)
    st = d.registry.slots[M].state
    # a batch fetched before the pause took effect: it waits in the backlog
    vals = events(feed.next, 250)
    d.ingest.process(feed.tp, [Msg(v, feed.next + i, int((T0 + feed.next + i) * 1000))
                               for i, v in enumerate(vals)])
    waiting = st.backlog[1].size
    assert waiting >= 250
    seen = st.online.n_seen
    st.notify_drift()  # what check_online does on a refill firing ...
    d.fitter.online_result(M, st.feed_backlog())  # ... and then
    d.fitter.apply_backpressure()
    assert not st.backlogged and not feed.paused
    assert st.online.n_seen == seen + waiting and st.fit_requests_outstanding == []
    gate.set()


async def test_restore_republishes_an_installed_map_the_topic_lacks(make, monkeypatch):
    d = make()
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 2, "two maps")
    st = d.registry.slots[M].state
    await until(lambda: len(d.clients.producer.sent) == st.binmap_version, "the publishes")
    sent_last = d.clients.producer.sent[-1][2]
    record = encode_envelope(M, d.registry.slots[M])
    # a new daemon whose topic only holds version 1: the checkpoint's map is published again
    d2 = make()
    first = d.clients.producer.sent[0][2]

    async def latest(*a, **kw):
        return {M: first}

    d2.restorer.read_latest = latest
    d2.restorer.restore_model(M, record, {0})
    st2 = d2.registry.slots[M].state
    assert st2.binmap_version == st.binmap_version
    await d2.restorer.adopt_published_binmaps({0})
    await until(lambda: d2.clients.producer.sent, "the republish")
    assert d2.clients.producer.sent[0][2] == sent_last  # the same bytes
    assert st2.binmap_version == st.binmap_version


def content(data: bytes) -> dict:
    """A map's JSON without what differs between two runs making the same decisions."""
    d = orjson.loads(data)
    for key in ("created_at", "checksum", "signature"):
        d.pop(key, None)
    return d


class PastCheckpoint(NamedTuple):
    """A daemon run until a map, checkpointed then (``record``, at input ``at``), and run on
    until one more map was published (``newest``, version ``top``): what a crash between
    publishing and checkpointing leaves behind."""

    d: Any
    feed: Feeder
    st: Any
    record: bytes
    v: int  # the version at the checkpoint
    at: int
    top: int
    newest: bytes


async def published_past_the_checkpoint(make) -> PastCheckpoint:
    d = make()
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 1, "a map")
    st = d.registry.slots[M].state
    record = encode_envelope(M, d.registry.slots[M])  # the checkpoint at version v
    v, at = st.binmap_version, feed.next
    await feed.until(lambda: st.binmap_version >= v + 1, "one more map")
    await until(lambda: len(d.clients.producer.sent) == st.binmap_version, "the publishes")
    return PastCheckpoint(d, feed, st, record, v, at, st.binmap_version,
                          d.clients.producer.sent[-1][2])


async def restored_behind(make, past: PastCheckpoint, s: Settings | None = None):
    """A second daemon (of ``s``) restoring ``past.record`` while the bin-map topic holds
    ``past.newest``."""
    async def latest(*a, **kw):
        return {M: past.newest}

    d2 = make(s)
    d2.restorer.read_latest = latest
    d2.restorer.restore_model(M, past.record, {0})
    d2.restorer._restored_from[M] = ("test", None)  # what restore() records for the record
    await d2.restorer.adopt_published_binmaps({0})
    return d2


async def test_restore_behind_the_topic_replays_the_same_maps_and_adopts_its_bytes(make):
    past = await published_past_the_checkpoint(make)
    d, feed, st, v, at = past.d, past.feed, past.st, past.v, past.at
    top, newest = past.top, past.newest
    # the uninterrupted run goes on until it published a map after the crash point (the
    # network changes, so a new temperature wins, whatever the refit schedule)
    feed.rescale = (feed.next, 1.5)
    await feed.until(lambda: st.binmap_version > top, "a map after the crash", limit=80_000)
    end = feed.next + 1_000
    await feed.until(lambda: feed.next >= end, "the uninterrupted run", limit=end + 1)
    await until(lambda: not d.fitter.publishing(), "the publishes")
    ref = {int(h["lpcal.version"]): value for _, _, value, h in d.clients.producer.sent}

    d2 = await restored_behind(make, past)
    st2 = d2.registry.slots[M].state
    # deferred: the replay from the checkpoint's offsets publishes versions v+1..top again
    assert st2.binmap_version == v and st2.adopting is not None
    assert gauge(d2, "lpcal_binmap_version") == top  # what the topic serves
    feed2 = Feeder(d2)
    feed2.next, feed2.rescale = at, feed.rescale
    await feed2.until(lambda: st2.binmap_version >= top, "the replay to reach the topic's map",
                      limit=end + 1)
    assert st2.adopting is None and st2.binmap == newest  # the topic's bytes, not re-made
    await feed2.until(lambda: feed2.next >= end, "the replay", limit=end + 1)
    await until(lambda: not d2.fitter.publishing(), "the publishes")
    sent = {int(h["lpcal.version"]): value for _, _, value, h in d2.clients.producer.sent}
    # nothing at or below the topic's version is sent again; what follows is the
    # uninterrupted run's maps (their content; created_at differs)
    assert sorted(sent) == [w for w in sorted(ref) if w > top]
    assert sent and all(content(sent[w]) == content(ref[w]) for w in sent)
    assert st2.binmap_version == st.binmap_version


async def test_restore_behind_a_topic_the_replay_does_not_reproduce_adopts_its_map(make):
    past = await published_past_the_checkpoint(make)
    at, top, newest = past.at, past.top, past.newest
    d2 = await restored_behind(make, past)
    st2 = d2.registry.slots[M].state
    assert st2.adopting is not None
    due = st2.adopting[2]
    feed2 = Feeder(d2)
    feed2.next = at
    feed2.scale = 1.0  # other input than the first run's: the replay cannot repeat its maps
    await feed2.until(lambda: st2.online.n_seen >= due, "the replay past the topic's map",
                      limit=at + 20_000)
    # adopted at the latest when the replay passes the sample the topic's map was published at
    assert st2.adopting is None and st2.binmap == newest and st2.binmap_version == top
    assert st2.online.version == top and st2.online.live.version == top
    await feed2.until(lambda: feed2.next >= at + 12_000, "more", limit=at + 12_001)
    await until(lambda: not d2.fitter.publishing(), "the publishes")
    assert all(w > top for w in d2.clients.producer.versions())  # versions only go up


async def test_restore_with_changed_settings_adopts_a_newer_map_at_once(make):
    d = make()
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 1, "a map")
    st = d.registry.slots[M].state
    record = encode_envelope(M, d.registry.slots[M])
    v = st.binmap_version
    await feed.until(lambda: st.binmap_version >= v + 1, "one more map")
    await until(lambda: len(d.clients.producer.sent) == st.binmap_version, "the publishes")
    newest = d.clients.producer.sent[-1][2]

    async def latest(*a, **kw):
        return {M: newest}

    d2 = make(settings(challenger_alpha=0.01))  # a fresh calibrator: no replay of the maps
    d2.restorer.read_latest = latest
    d2.restorer.restore_model(M, record, {0})
    await d2.restorer.adopt_published_binmaps({0})
    st2 = d2.registry.slots[M].state
    assert st2.adopting is None and st2.binmap == newest
    assert st2.binmap_version == st2.online.version == st.binmap_version
    assert d2.clients.producer.sent == []


async def test_released_models_leave_nothing_in_the_fitter(make):
    d, feed, _ = await past_a_first_fit(make)
    await until(lambda: M in d.fitter._online_seconds, "the fit's time")
    assert d.fitter.request_recalibration(M)
    feed.batch(1)
    assert d.fitter._online_cause.get(M) == "manual"
    t = d.s.kafka.topics
    await d.on_revoked({TopicPartition(t.predictions, 0), TopicPartition(t.outcomes, 0)})
    assert d.registry.get(M) is None
    assert M not in d.fitter._online_cause and M not in d.fitter._online_seconds


async def test_restore_reruns_the_fit_requests_of_the_checkpoint(make, monkeypatch, tmp_path):
    d, feed, gate, _ = await paused_on_a_gated_fit(make)
    slot = d.registry.slots[M]
    record = encode_envelope(M, slot)
    env = decode_envelope(M, record, limit=d.s.state.max_state_bytes, wanted=lambda p: True)
    assert env.state.fit_requests_outstanding  # the checkpoint holds the request

    async def latest(*a, **kw):
        return {}

    store = LocalCheckpointStore(tmp_path)
    await store.save({f"model/{M}": record})
    d2 = make(store=store)
    d2.restorer.read_latest = latest
    d2.clients.consumer.seek = lambda tp, off: None

    async def seek_to_beginning(tp):
        pass

    d2.clients.consumer.seek_to_beginning = seek_to_beginning
    await d2.restorer.restore({feed.tp}, {feed.tp})
    st2 = d2.registry.slots[M].state
    assert d2.partitions.paused() == {0} and st2.backlogged  # kept paused: not resumed
    assert not any(feed.tp in tps for call, tps in d2.clients.consumer.calls
                   if call == "resume")
    await until(lambda: not st2.backlogged, "the re-run fit")
    assert d2.partitions.paused() == set()
    assert any(feed.tp in tps for call, tps in d2.clients.consumer.calls if call == "resume")
    assert st2.online.n_seen == slot.state.online.n_seen + (
        0 if slot.state.backlog is None else slot.state.backlog[1].size)
    gate.set()


async def test_drift_trigger_restarts_the_warm_up_and_labels_the_next_map(make):
    # the change test, with a short baseline and a high false-alarm rate so that the drift
    # below is declared soon (the absolute rule, which in online mode only asks for a fit,
    # is out of the way)
    d = make(settings(drift_threshold=1.0, drift_false_alarm_rate=1e-3,
                      drift_baseline_samples=2000))
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 1, "a first map")
    st = d.registry.slots[M].state
    # the drift comes once the change test has its baseline (a drift inside the baseline is
    # the live map's own level: not a change of it)
    await feed.until(lambda: st.monitor.change.testing, "the change test's baseline")
    feed.scale = 0.6  # the network turns under-confident: the live map's temperature is wrong
    await feed.until(lambda: st.online.regime_start > 0, "a drift refill")
    assert st.triggers.drift.cause == "change"
    assert gauge(d, "lpcal_calibrations_total", trigger="drift") in (None, 0.0)
    assert st.online.warming  # the warm-up restarted at the drift
    v = st.binmap_version
    await feed.until(lambda: st.binmap_version > v, "the map after the drift")
    await until(lambda: not d.fitter.publishing(), "the publishes")
    assert gauge(d, "lpcal_calibrations_total", trigger="drift") >= 1
    assert d.clients.producer.versions() == list(range(1, st.binmap_version + 1))
    # the post-drift map repairs the under-confidence (the true temperature is 0.6)
    assert verify_artifact(d.clients.producer.sent[-1][2]).temperature < 0.8


async def test_restore_does_not_republish_when_the_topic_cannot_be_read(make, monkeypatch):
    d = make()
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 1, "a map")
    record = encode_envelope(M, d.registry.slots[M])

    async def unreadable(*a, **kw):
        raise ConnectionError("broker unreachable (stand-in)")

    d2 = make()
    d2.restorer.read_latest = unreadable
    d2.restorer.restore_model(M, record, {0})
    await d2.restorer.adopt_published_binmaps({0})
    await asyncio.sleep(0.05)
    # the topic may hold a newer version: an older one must not follow it
    assert d2.clients.producer.sent == [] and not d2.fitter.publishing()


async def test_a_signing_replica_serves_its_online_map_only_once_it_is_signed(make, tmp_path):
    """The loop installs its maps unsigned at the sample it decides; the daemon signs them
    when it publishes them. Over HTTP a signing replica serves no unsigned map: before the
    publish is acknowledged it answers from the topic (here: no map yet), after it the signed
    bytes the topic has, which verify against the public key."""
    from aiohttp.test_utils import make_mocked_request

    from daemon.http_api import HttpServer
    from lpcal.client import verify_artifact
    from lpcal.signing import KeyRing, keygen

    private, public, _ = keygen(tmp_path / "keys")
    s = Settings(defaults={"drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                 models={M: dict(ONLINE)}, signing={"private_key": private.read_text()})
    d = make(s, failures=10**9)  # the broker refuses every publish for now
    feed = Feeder(d)
    await feed.until(lambda: d.registry.get(M) is not None
                     and d.registry.slots[M].state.binmap_version >= 1, "a map")
    st = d.registry.slots[M].state
    assert b'"signature"' not in st.binmap  # installed unsigned at the decision
    http = HttpServer(d.status())

    def get():
        req = make_mocked_request("GET", f"/v1/models/{M}/binmap", match_info={"model": M})
        return http.binmap(req)

    resp = await get()
    assert resp.status in (404, 503)  # not the unsigned map
    d.clients.producer.failures = 0  # the broker is back: the retried publish goes through
    await until(lambda: d.clients.producer.sent, "the publish")
    await until(lambda: b'"signature"' in st.binmap, "the signed bytes installed")
    resp = await get()
    assert resp.status == 200 and resp.body == d.clients.producer.sent[0][2]
    bm = verify_artifact(resp.body, where="served map", public_keys=KeyRing([public]))
    assert bm.version == 1
