"""Fits, their publication and the per-model gauges in :class:`daemon.service.Daemon`, without a
broker: the producer is a stand-in that fails a given number of times, the fits are real
(:func:`lpcal.calibrate.fit_pools` in the daemon's worker thread).

- A publish that fails (broker down) is counted and retried until it lands; the epoch is not
  lost and its version is not reused for other pools.
- Publish retries back off (doubling to a cap); a stop prevents no attempt, and the first
  attempt that fails after it ends the retry at once; a revoked model's publish stops.
- On shutdown a publish that cannot land is left in flight, so the final checkpoint carries it.
- A fit that raises is counted and its epoch dropped.
- The gauges of a model that turns idle right after a change are still exported (CI caught
  ``lpcal_epochs_waiting`` stuck at 3 for a model whose last fits came within one gauge period).
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiokafka.errors import KafkaConnectionError

from daemon.checkpoint.envelope import encode_envelope
from daemon.fitting import RetryPolicy
from daemon.gauges import _GAUGE_EVERY
from daemon.service import Daemon
from lpcal.client import verify_artifact
from lpcal.errors import LpcalError
from tests.support.daemon_harness import wait_until
from tests.support.daemon_stubs import (
    MODEL,
    broker_free_daemon,
    offer_samples,
    small_settings,
    state_with_sealed,
)


class FlakyProducer:
    """``send_and_wait`` fails the first ``failures`` calls (all of them if None)."""

    def __init__(self, failures: int | None):
        self.failures = failures
        self.attempts = 0
        self.sent: list[tuple[str, bytes, bytes, dict]] = []

    async def send_and_wait(self, topic, key, value, headers=()):
        self.attempts += 1
        await asyncio.sleep(0)
        if self.failures is None or self.attempts <= self.failures:
            raise KafkaConnectionError("broker unreachable (stand-in)")
        self.sent.append((topic, key, value, dict(headers)))


@pytest.fixture
def make_daemon():
    """``make_daemon(**kw)``: a broker-free daemon of :func:`small_settings` (``kw``: its
    constructor's, e.g. ``fit`` or ``retry_policy``)."""
    made = []

    def make(**kw) -> Daemon:
        made.append(broker_free_daemon(small_settings(), **kw))
        return made[-1]

    yield make
    for d in made:
        d.executor.shutdown(wait=True)


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


def after_batch(d: Daemon) -> None:
    """What the main loop does after a batch: the fits, then the gauges."""
    now = time.monotonic()
    d.fitter.after_batch(now)
    d.gauges.after_batch(now)


def sample(d: Daemon, name: str, **labels) -> float | None:
    """The sample ``name{model=MODEL, **labels}`` of ``d``'s registry (None: not exported)."""
    return d.metrics.registry.get_sample_value(name, {"model": MODEL, **labels})


def failures(d: Daemon) -> float:
    return sample(d, "lpcal_calibration_failures_total")


async def until(cond, what: str) -> None:
    await wait_until(cond, 20.0, what, interval=0.01)


def with_sealed(d: Daemon, n: int):
    st = state_with_sealed(d.s, n)
    d.registry.place(MODEL, st, 0)
    return st


async def test_failed_publish_is_counted_and_retried_until_it_lands(daemon):
    st = with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=3)
    after_batch(daemon)
    assert daemon.registry.slots[MODEL].inflight.version == 1
    await until(lambda: MODEL not in daemon.registry.fitting(), "the fit to be published")
    assert daemon.clients.producer.attempts == 4 and len(daemon.clients.producer.sent) == 1
    assert failures(daemon) == 3
    topic, key, value, headers = daemon.clients.producer.sent[0]
    assert (topic, key, headers) == (daemon.s.kafka.topics.binmaps, MODEL.encode(),
                                     {"lpcal.version": b"1"})
    bm = verify_artifact(value)
    assert (bm.model_id, bm.version) == (MODEL, 1)
    assert st.binmap_version == 1 and not st.sealed   # installed, and no epoch lost
    assert sample(daemon, "lpcal_binmap_version") == 1


async def test_publish_failing_at_shutdown_stays_in_flight_for_the_checkpoint(daemon):
    st = with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=None)
    after_batch(daemon)
    inf = daemon.registry.slots[MODEL].inflight
    await until(lambda: daemon.clients.producer.attempts >= 2, "a retried publish")
    daemon.stopping.set()
    await until(lambda: not daemon.fitter.publishing(), "the publish to give up")
    assert daemon.registry.fitting().get(MODEL) is inf and st.binmap_version == 0
    envelope = orjson.loads(encode_envelope(MODEL, daemon.registry.slots[MODEL]))
    assert envelope["inflight"]["version"] == 1
    assert envelope["inflight"]["pools"] == inf.pools.to_dict(packed=True)
    # the attempts before the shutdown count as failures; the one cut short by it does not
    assert failures(daemon) == daemon.clients.producer.attempts - 1


async def test_publish_backs_off_doubling_to_its_cap(make_daemon, caplog):
    daemon = make_daemon(retry_policy=RetryPolicy(first=0.01, cap=0.04))
    with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=5)
    with caplog.at_level("WARNING", logger="lpcal.daemon"):
        after_batch(daemon)
        await until(lambda: MODEL not in daemon.registry.fitting(), "the fit to be published")
    retried = [r for r in caplog.records if "publishing bin map version 1 failed" in r.message]
    assert [r.args[-1] for r in retried] == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert all("KafkaConnectionError" in r.message for r in retried)
    assert daemon.clients.producer.attempts == 6 and failures(daemon) == 5


async def test_publish_requested_during_shutdown_is_still_attempted(daemon):
    """Shutdown lets fits in flight finish and publish: a stop prevents no attempt."""
    st = with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=0)
    daemon.stopping.set()
    after_batch(daemon)
    await until(lambda: MODEL not in daemon.registry.fitting(), "the fit to be published")
    assert len(daemon.clients.producer.sent) == 1 and st.binmap_version == 1


class GatedProducer:
    """``send_and_wait`` waits for ``gate``, then fails."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.attempts = 0

    async def send_and_wait(self, topic, key, value, headers=()):
        self.attempts += 1
        await self.gate.wait()
        raise KafkaConnectionError("broker unreachable (stand-in)")


async def test_publish_failing_after_a_stop_ends_without_a_backoff(make_daemon, caplog):
    daemon = make_daemon(retry_policy=RetryPolicy(first=30.0))
    with_sealed(daemon, 1)
    daemon.clients.producer = GatedProducer()
    after_batch(daemon)
    inf = daemon.registry.slots[MODEL].inflight
    await until(lambda: daemon.clients.producer.attempts == 1, "a publish attempt")
    daemon.stopping.set()
    daemon.clients.producer.gate.set()
    t0 = asyncio.get_running_loop().time()
    with caplog.at_level("INFO", logger="lpcal.daemon"):
        await until(lambda: not daemon.fitter.publishing(), "the publish to give up")
    assert asyncio.get_running_loop().time() - t0 < 5.0  # not after the 30 s backoff
    assert daemon.clients.producer.attempts == 1 and not failures(daemon)
    assert daemon.registry.fitting().get(MODEL) is inf
    assert any("not published before shutdown (KafkaConnectionError)" in r.message
               for r in caplog.records)


async def test_publish_of_a_revoked_model_stops_retrying(daemon):
    with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=None)
    after_batch(daemon)
    await until(lambda: daemon.clients.producer.attempts >= 2, "a retried publish")
    daemon.registry.slots[MODEL].inflight = None  # as when the model's partition is revoked
    await until(lambda: not daemon.fitter.publishing(), "the publish to give up")
    attempts = daemon.clients.producer.attempts
    await asyncio.sleep(0.1)  # ten retry periods
    assert daemon.clients.producer.attempts == attempts and not daemon.clients.producer.sent


async def test_fit_that_raises_is_counted_and_its_epoch_dropped(make_daemon):
    def broken_fit(*a, **kw):
        raise LpcalError("fit failed (stand-in)")

    daemon = make_daemon(fit=broken_fit)
    st = with_sealed(daemon, 1)
    daemon.clients.producer = FlakyProducer(failures=0)
    after_batch(daemon)
    await until(lambda: MODEL not in daemon.registry.fitting(), "the failed fit")
    assert failures(daemon) == 1 and daemon.clients.producer.attempts == 0
    assert st.binmap_version == 0 and not st.sealed


def pool_gauges(d: Daemon, st) -> dict[str, float | None]:
    return {p: sample(d, "lpcal_pool_samples", pool=p) for p in st.pools.tables}


def pool_totals(st) -> dict[str, int]:
    return {p: t.total for p, t in st.pools.tables.items()}


def window_samples(d: Daemon) -> float | None:
    return sample(d, "lpcal_window_samples")


def test_gauges_of_a_model_that_turns_idle_are_exported(daemon):
    st = with_sealed(daemon, 0)
    # pool gauges are read from the state at scrape time: current before any check
    assert pool_gauges(daemon, st) == pool_totals(st)
    daemon.registry.touched.add(MODEL)
    after_batch(daemon)
    assert window_samples(daemon) == st.evaluate()["raw"].n
    evaluated = window_samples(daemon)
    # a change within the same gauge period: pools current, the window's evaluation is
    # rate-limited (due later)
    offer_samples(daemon.s, st, 10_000, 20)
    daemon.registry.touched.add(MODEL)
    after_batch(daemon)
    assert pool_gauges(daemon, st) == pool_totals(st)
    assert window_samples(daemon) == evaluated != st.evaluate()["raw"].n
    assert MODEL in daemon.gauges.due
    # no event arrives any more: one gauge period later the window is evaluated once more
    daemon.gauges.export_due(time.monotonic() + 2 * _GAUGE_EVERY)
    assert window_samples(daemon) == st.evaluate()["raw"].n
    assert MODEL not in daemon.gauges.due


@pytest.fixture
def certified_daemon():
    """The certified default, with small epochs (warm-up 200, held out 300)."""
    from daemon.settings import Settings

    s = Settings(defaults={"pool": 40, "mu_pool": 80, "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0,
                           "holdout": 300, "warmup": 200, "recovery": "epochs"}, models={MODEL: {"k": 3}})
    d = broker_free_daemon(s)
    yield d
    d.executor.shutdown(wait=True)


async def test_certified_fit_publishes_a_certificate_and_exports_it(certified_daemon):
    from daemon.http_api import HttpServer

    daemon = certified_daemon
    st = with_sealed(daemon, 1)
    temperature = st.pools.temperature
    assert st.fit_spec.mode == "certified" and temperature is not None
    daemon.clients.producer = FlakyProducer(failures=0)
    after_batch(daemon)
    await until(lambda: MODEL not in daemon.registry.fitting(), "the fit to be published")
    bm = verify_artifact(daemon.clients.producer.sent[0][2])
    assert bm.mode == "certified" and bm.temperature == temperature
    cert = bm.certificate
    assert cert.n_holdout >= 300
    assert sample(daemon, "lpcal_certificate_bound") == cert.bound
    assert sample(daemon, "lpcal_certificate_target") == 0.1
    for name, est in cert.estimates.items():
        assert sample(daemon, "lpcal_certificate_estimate", candidate=name) == est.err_p
    # the warm-up and held-out share are pool gauges too
    assert sample(daemon, "lpcal_pool_samples", pool="warmup") is not None
    # GET /v1/models summarises the installed map's certificate
    resp = await HttpServer(daemon.status()).models(None)
    view = orjson.loads(resp.body)["models"][0]
    assert view["mode"] == "certified"
    assert view["certificate"] == {"selected": cert.selected, "certified": cert.certified,
                                   "bound": cert.bound, "eps": 0.1,
                                   "n_holdout": cert.n_holdout}


async def test_a_fit_whose_version_is_on_the_topic_already_is_not_published_again(daemon):
    """A restore that could not see the latest maps relaunches a fit whose version its
    predecessor had published: when the replica's view of the topic holds that version (or a
    newer one) by the time the fit is done, the fit is dropped and the view's map installed,
    so no older version follows a newer one on the topic; the next epoch goes on after it."""
    from daemon.binmap_view import Served
    from lpcal.calibrate import fit_pools

    st = with_sealed(daemon, 2)
    bm = fit_pools(st.pools, st.fit_spec, model_id=MODEL, version=1)
    raw = bm.to_json()
    daemon.registry.published = lambda m: Served(bm, raw, "binmaps[0]@7", len(raw))
    daemon.clients.producer = FlakyProducer(failures=0)
    after_batch(daemon)
    assert daemon.registry.slots[MODEL].inflight.version == 1
    await until(lambda: len(daemon.clients.producer.sent) == 1, "the next epoch's publish")
    await until(lambda: MODEL not in daemon.registry.fitting(), "the fits")
    assert [h["lpcal.version"] for _, _, _, h in daemon.clients.producer.sent] == [b"2"]
    assert st.binmap_version == 2 and not st.sealed
