"""Per-model gauges (:class:`GaugeExporter`): pool fill, join buffers, epochs waiting, windowed
quality, bin-map certificates and consumer lag.

The per-model gauges are read from the registry when Prometheus scrapes
(:meth:`GaugeExporter.rows`, the provider of :class:`daemon.metrics.ModelGaugeCollector`): pool
fill, join buffers, state bytes, epochs waiting and the drift threshold are the models' current
values, and nothing about them runs per batch; so is the change test's score (kept up to date
by the monitor as samples arrive), so an alarm shows at the next scrape. The windowed quality,
the calibration statistics and the window's sample count need an evaluation of the window
(O(window bins * k)), so they are cached: a model checked after a batch
(:meth:`daemon.fitting.Fitter.check_model`) is scheduled (:meth:`GaugeExporter.schedule`) and
evaluated at most once per :data:`_GAUGE_EVERY` seconds (a model that turns idle is evaluated
once more after its last change, so it keeps no stale quality); the models due are kept in a
:class:`daemon.due_times.DueTimes`, so the work per batch follows the models due, not the
number of models. The evaluations of one call take at most :data:`EVAL_SHARE` of the time since
the previous call (at least :data:`EVAL_MIN_SECONDS`); the models left over stay due, first in
line for the next call. So with many models the window gauges refresh less often (every
``models x evaluation cost / EVAL_SHARE`` seconds at the most), and the cost per message does
not grow with the number of models. An evaluation is cached by the monitor until its window
changes, so the drift trigger's evaluation and the gauges' share it when no samples came in
between.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

from daemon.due_times import DueTimes
from daemon.metrics import ModelGauges
from daemon.registry import ModelSlot
from lpcal.certificate import Certificate
from lpcal.errors import InputError

log = logging.getLogger("lpcal.daemon")

_GAUGE_EVERY = 10.0  # seconds between two evaluations of a model's window for its gauges
#: share of the time between two calls of :meth:`GaugeExporter.export_due` its evaluations take
EVAL_SHARE = 0.05
EVAL_MIN_SECONDS = 0.002  # evaluation time one call may always take
EVAL_MAX_SECONDS = 0.1  # ... and at most (after a long pause the loop must not stall)
_EVAL_CHUNK = 32  # models taken from the due-time heap at once
_LAG_EVERY = 5.0  # seconds between consumer lag exports


class WindowGauges(NamedTuple):
    """The gauges of one evaluation of a model's window (:meth:`GaugeExporter.evaluate`)."""

    quality: dict[str, tuple[float, float, float, float]]
    statistics: dict[str, dict[str, tuple[float, float]]]
    window_samples: int
    change_score: float


class GaugeExporter:
    """Exports the gauges of the owned models and the consumer lag.

    Parameters
    ----------
    registry : daemon.registry.ModelRegistry
    partitions : daemon.partitions.PartitionTable
        The assignment and the positions (consumer lag).
    metrics : daemon.metrics.DaemonMetrics
        Its per-model gauges are read from :meth:`rows` at scrape time.
    clients : daemon.clients.KafkaClients
        Its consumer knows the high watermarks.
    staged_bytes : callable, optional
        ``staged_bytes(model)``: bytes of the model's events staged before its state
        (:meth:`daemon.ingest.Ingest.staged_bytes`), shown as part of its join buffer.
    """

    #: seconds between two evaluations of a model's window for its gauges
    every = _GAUGE_EVERY

    def __init__(self, registry, partitions, metrics, clients, *,
                 staged_bytes: Callable[[str], int] | None = None):
        self.registry, self.partitions, self.metrics = registry, partitions, metrics
        self.clients, self.staged_bytes = clients, staged_bytes
        self._last_lag = 0.0
        self._last_due: float | None = None  # the time of the last export_due
        self.due = DueTimes()  # models whose window gauges are to be evaluated, and when
        metrics.read_model_gauges(self.rows)

    def after_batch(self, now: float) -> None:
        """After each fetched batch: the gauges due, and the lag every :data:`_LAG_EVERY` s."""
        self.export_due(now)
        if now - self._last_lag >= _LAG_EVERY:
            self._last_lag = now
            self.export_lag()

    def schedule(self, model: str, when: float) -> None:
        """Evaluate ``model``'s window gauges at ``when`` (``time.monotonic()``), or sooner if
        it is due sooner already."""
        self.due.schedule(model, when, earliest=True)

    def export_due(self, now: float, *, budget: float | None = None) -> int:
        """Evaluate the window gauges of the models due at ``now``, earliest due first, for at
        most ``budget`` seconds (default: :data:`EVAL_SHARE` of the time since the last call,
        between :data:`EVAL_MIN_SECONDS` and :data:`EVAL_MAX_SECONDS`; ``math.inf``: all of
        them; at least one model per call); the models left stay
        due. Returns the models evaluated: O(models evaluated)."""
        last, self._last_due = self._last_due, now
        if budget is None:
            budget = min(EVAL_MAX_SECONDS, max(
                EVAL_MIN_SECONDS, EVAL_SHARE * (now - last) if last is not None else 0.0))
        get, due = self.registry.get, self.due
        end = time.perf_counter() + budget
        done = 0
        while True:  # at least one model per call, so every model's turn comes
            models = due.pop_due(now, _EVAL_CHUNK)
            if not models:
                break
            for i, model in enumerate(models):
                if done and time.perf_counter() >= end:
                    for rest in models[i:]:  # first in line next time
                        due.schedule(rest, -math.inf, earliest=True)
                    return done
                slot = get(model)
                if slot is not None:  # else released meanwhile
                    slot.gauges_at = now
                    slot.window_gauges = self.evaluate(slot)
                    done += 1
        return done

    @staticmethod
    def evaluate(slot: ModelSlot) -> WindowGauges:
        """Evaluate ``slot``'s window: quality (``err_p``, ECE clipped to 1, Brier clipped to 2,
        accuracy; non-finite values are not exported), statistics with their standard errors,
        the window's samples and the change test's score."""
        st = slot.state
        stats = st.evaluate()
        quality, statistics = {}, {}
        for pred in ("raw", "calibrated"):
            w = stats.get(pred)
            if w is None:
                continue
            values = (w.err_p, min(w.ece, 1.0), min(w.brier, 2.0), w.accuracy)
            if all(map(math.isfinite, values)):
                quality[pred] = values
            statistics[pred] = {s: (e.value, e.stderr) for s, e in w.statistics().items()}
        raw = stats.get("raw")
        change = st.monitor.change
        return WindowGauges(quality, statistics, raw.n if raw is not None else 0,
                            change.score if change is not None else 0.0)

    def rows(self) -> list[ModelGauges]:
        """One :class:`daemon.metrics.ModelGauges` per owned model, read now (the scrape-time
        provider of the per-model gauges). A model whose window was not evaluated yet (restored,
        or not checked since it was admitted) exports no window gauges and is scheduled now."""
        out = []
        staged = self.staged_bytes or (lambda model: 0)
        for model, slot in self.registry.slots.items():
            st = slot.state
            join = st.join
            inflight = slot.inflight
            fitting = inflight.pools.nbytes if inflight is not None else 0  # the last quarter
            row = ModelGauges(
                model, join_pending=join.pending(model),
                join_buffer_bytes=join.memory_bytes(model) + staged(model),
                join_buffer_budget=join.max_bytes,
                state_bytes=st.nbytes + fitting, state_budget=st.budget,
                epochs_waiting=len(st.sealed),
                drift_threshold=st.monitor_spec.drift_threshold, pools=st.pool_fill())
            w = slot.window_gauges
            if w is None:
                self.schedule(model, 0.0)
            else:
                row.quality, row.statistics = w.quality, w.statistics
                row.window_samples, row.drift_change_score = w.window_samples, w.change_score
            change = st.monitor.change
            if change is not None:  # read now: the alarm shows at the next scrape, not the
                row.drift_change_score = change.score  # next window evaluation
            out.append(row)
        return out

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
