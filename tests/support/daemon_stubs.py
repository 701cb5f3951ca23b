"""Stand-ins shared by the broker-free tests of :class:`daemon.service.Daemon` and its
components: a consumer that records pause/resume, a daemon wired to it, small settings and a
model state with sealed epochs."""

from __future__ import annotations

import numpy as np
import orjson
from aiokafka import TopicPartition

from daemon.events import EventParser
from daemon.fitting import RetryPolicy
from daemon.model_state import ModelState
from daemon.settings import Settings

MODEL, K = "bp-unit", 3


class RecordingConsumer:
    """Records which partitions are paused (``highwater``: the lag export's only other call)."""

    def __init__(self):
        self.paused: set[TopicPartition] = set()
        self.calls: list[tuple[str, tuple]] = []

    def pause(self, *tps):
        self.calls.append(("pause", tps))
        self.paused |= set(tps)

    def resume(self, *tps):
        self.calls.append(("resume", tps))
        self.paused -= set(tps)

    def highwater(self, tp):
        return None


def broker_free_daemon(settings: Settings, partitions=(0,), **kw):
    """A :class:`daemon.service.Daemon` of ``settings`` without a broker: its consumer is a
    :class:`RecordingConsumer`, input ``partitions`` of both topics are assigned, bin-map
    publishes are retried every 10 ms (``retry_policy``); ``kw`` go to the constructor."""
    from daemon.service import Daemon

    kw.setdefault("retry_policy", RetryPolicy(first=0.01))
    d = Daemon(settings, **kw)
    d.clients.consumer = RecordingConsumer()
    t = settings.kafka.topics
    d.partitions.assign({TopicPartition(topic, p) for p in partitions
                         for topic in (t.predictions, t.outcomes)})
    return d


def small_settings() -> Settings:
    # the paper's mode: these tests are about fits and backpressure, not the fit mode
    return Settings(defaults={"pool": 40, "mu_pool": 80, "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0,
                              "mode": "paper"},
                    models={MODEL: {"k": K}})


def offer_samples(settings: Settings, st: ModelState, start: int, n: int) -> None:
    """Offer ``n`` complete samples (ids ``u{start}``...) to ``st``."""
    rng = np.random.default_rng(start)
    probs = rng.dirichlet(np.ones(K), size=n)
    labels = rng.integers(0, K, size=n)
    values = [orjson.dumps({"model": MODEL, "id": f"u{start + i}", "ts": float(start + i),
                            "probs": probs[i].tolist(), "label": int(labels[i])})
              for i in range(n)]
    for mb in EventParser.from_settings(settings).parse_batch(values).by_model.values():
        st.offer(mb)


def state_with_sealed(settings: Settings, n_sealed: int) -> ModelState:
    """A state of :data:`MODEL` with ``n_sealed`` full epochs waiting for their fit."""
    st = ModelState.create(MODEL, K, settings.model_settings(MODEL), settings.join)
    per_epoch = sum(st.layout.targets.values())
    offer_samples(settings, st, 0, 3 * per_epoch * (n_sealed + 1))  # routing fills unevenly
    while len(st.sealed) > n_sealed:
        st.start_new_epoch()
    assert len(st.sealed) == n_sealed
    return st
