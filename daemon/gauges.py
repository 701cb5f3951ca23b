"""Per-model gauges (:class:`GaugeExporter`): pool fill, join buffers, epochs waiting, windowed
quality, bin-map certificates and consumer lag.

A model's gauges are exported when it was checked since their last export
(``registry.gauges_due``), at most once per :data:`_GAUGE_EVERY` seconds per model, so that a
model that turns idle does not keep stale gauges.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from daemon.registry import ModelSlot
from lpcal.certificate import Certificate
from lpcal.errors import InputError

log = logging.getLogger("lpcal.daemon")

_GAUGE_EVERY = 1.0
_LAG_EVERY = 5.0  # seconds between consumer lag exports


class GaugeExporter:
    """Exports the gauges of the owned models and the consumer lag.

    Parameters
    ----------
    registry : daemon.registry.ModelRegistry
    partitions : daemon.partitions.PartitionTable
        The assignment and the positions (consumer lag).
    metrics : daemon.metrics.DaemonMetrics
    clients : daemon.clients.KafkaClients
        Its consumer knows the high watermarks.
    """

    def __init__(self, registry, partitions, metrics, clients):
        self.registry, self.partitions, self.metrics = registry, partitions, metrics
        self.clients = clients
        self._last_lag = 0.0

    def after_batch(self, now: float) -> None:
        """After each fetched batch: the gauges due, and the lag every :data:`_LAG_EVERY` s."""
        self.export_due(now)
        if now - self._last_lag >= _LAG_EVERY:
            self._last_lag = now
            self.export_lag()

    def export_due(self, now: float) -> None:
        """Export the gauges of models checked since their last export, at most once per
        :data:`_GAUGE_EVERY` seconds per model; the others stay due for a later poll."""
        due = self.registry.gauges_due
        for model in list(due):
            slot = self.registry.get(model)
            if slot is None:
                due.discard(model)
            elif now - slot.gauges_at >= _GAUGE_EVERY:
                slot.gauges_at = now
                due.discard(model)
                self.export_model(model, slot)

    def export_model(self, model: str, slot: ModelSlot) -> None:
        m, st = self.metrics, slot.state
        m.set_pool_fill(model, st.pools.fill())
        m.set_join_pending(model, st.join.pending(model))
        m.set_join_buffer(model, st.join.memory_bytes(model), st.join.max_bytes)
        m.set_epochs_waiting(model, len(st.sealed))
        inflight = slot.inflight
        fitting = inflight.pools.nbytes if inflight is not None else 0  # the last quarter
        m.set_model_state(model, st.nbytes + fitting, st.budget)
        stats = st.evaluate()
        for pred in ("raw", "calibrated"):
            w = stats.get(pred)
            if w is not None:
                m.observe_quality(model, pred, w.err_p, min(w.ece, 1.0), min(w.brier, 2.0),
                                  w.accuracy)
        raw = stats.get("raw")
        m.set_window_samples(model, raw.n if raw is not None else 0)
        # calibration statistics with their standard errors, and the change test's score
        for pred in ("raw", "calibrated"):
            w = stats.get(pred)
            if w is not None:
                m.set_statistics(model, pred, {s: (e.value, e.stderr)
                                               for s, e in w.statistics().items()})
        change = st.monitor.change
        m.set_drift_change_score(model, change.score if change is not None else 0.0)

    def export_certificate(self, model: str, certificate: Any) -> None:
        """Export a bin map's held-out certificate (a :class:`lpcal.certificate.Certificate`, its
        dict, or the map's JSON bytes); a map
        without one clears the gauges. A malformed certificate is logged, never fatal."""
        try:
            if isinstance(certificate, (bytes, bytearray)):
                certificate = orjson.loads(certificate).get("certificate")
            elif isinstance(certificate, Certificate):
                certificate = certificate.to_dict()
            self.metrics.set_certificate(model, certificate)
        except (InputError, orjson.JSONDecodeError, AttributeError) as e:
            log.warning("model %s: certificate not exported: %s", model, e)

    def export_lag(self) -> None:
        lags = {"predictions": 0, "outcomes": 0}
        consumer, table = self.clients.consumer, self.partitions
        for tp in table.assigned:
            hw = consumer.highwater(tp)
            pos = table.position(tp.topic, tp.partition)
            if hw is not None and pos is not None:
                lags[self.clients.topic_kind(tp.topic)] += max(0, hw - pos)
        self.metrics.set_consumer_lags(lags)
