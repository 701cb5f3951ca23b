"""Prometheus metrics of the lpcal daemon: the contract between the daemon, the alert rules
(``deploy/prometheus/rules.yaml``) and the Grafana dashboard (``deploy/grafana``).

Conventions: every name starts with ``lpcal_``, values are in base units (seconds, ratios,
counts), counters end in ``_total``, and every label has a bounded value set:

* ``topic``, ``reason``, ``kind``, ``trigger``, ``predictor``, ``outcome`` are the fixed enums
  defined below; helpers reject anything else.
* ``pool`` is ``mu`` or ``P<i>``/``E<i>``/``PE<i>`` with ``i < MAX_POOL_LEVELS``: Algorithm 2
  needs O(log |B|) pools (one per merge level of the groups in M), so the set is bounded; in the
  certified mode also ``warmup`` (the samples that fit the epoch's temperature) and ``hold``
  (the held-out share of the certificate).
* ``candidate`` (certificate gauges) is ``raw`` | ``precalibrator`` | ``corrected``.
* ``model`` is bounded by the daemon, which only admits configured models (or at most
  ``max_models`` new ones per replica); :class:`DaemonMetrics` enforces the same cap as a
  guard. Models restored on assignment are always admitted, so a replica that took over
  another's partitions can export more; across replicas each input partition carries at most
  ``max_models`` models (see :class:`DaemonMetrics`).
* ``outcome`` of ``lpcal_state_restores_total`` is a :class:`RestoreOutcome`.
* ``version`` and ``ingest_path`` (``c`` | ``python``, see :mod:`daemon.native`) on
  ``lpcal_build_info`` have one value per process.

Quality gauges (labels ``{model, predictor}``, predictor = raw | calibrated):
``lpcal_calibration_error`` is the windowed estimate of the lp calibration error
``Err_p(f) = (E_x ||E[y | f(x)] - f(x)||_p^p)^(1/p)`` over the recent evaluation window (binned
by level sets, as in the paper), ``lpcal_top_label_ece`` the top-label expected calibration
error, ``lpcal_brier_score`` the mean ``||f(x) - e_y||_2^2`` (in [0, 2]) and
``lpcal_accuracy_ratio`` the top-1 accuracy (in [0, 1]).

Calibration statistics (labels ``{model, predictor, statistic}``, statistic a
:class:`Statistic`): ``lpcal_calibration_statistic`` is a windowed debiased estimate (top-label
and classwise l2 ECE, the Brier reliability term, the confidence gap accuracy - confidence, and
Err_p) and ``lpcal_calibration_statistic_stderr`` its standard error. ``lpcal_drift_change_score``
``{model}`` is the change test of the live bin map (:mod:`daemon.drift`): its largest CUSUM over
its threshold, so drift is declared at 1 (latched until a new map). The absolute rule, calibrated
``lpcal_calibration_error`` above ``lpcal_drift_threshold``, is a backstop.

Certificate gauges (set after each fit whose bin map carries a held-out certificate, see
:mod:`lpcal.certificate`; removed when a map has none, e.g. ``mode = "paper"`` without a held-out
share): ``lpcal_certificate_bound`` ``{model}`` is the upper confidence bound (level
``1 - delta``) on the published candidate's ``Err_p``, computed on the epoch's held-out samples;
``lpcal_certificate_target`` ``{model}`` is the ``eps`` it is certified against (certified iff
bound <= target); ``lpcal_certificate_vacuous`` ``{model}`` is 1 when that target says nothing
about the model (the raw model's own bound already meets it), else 0;
``lpcal_certificate_estimate`` ``{model, candidate}`` is the plug-in held-out ``Err_p`` of each
candidate: ``raw`` (the model as-is, reported only), ``precalibrator``
(temperature scaling alone) and ``corrected`` (Algorithm 2's map on the temperature-scaled bins).

**Per-model gauges at scrape time.** The gauges in :data:`MODEL_GAUGES` (pool fill, join
buffer, state bytes, epochs waiting, windowed quality and statistics, drift score and
threshold) are not ``Gauge`` objects set through ``labels()``: a
:class:`ModelGaugeCollector` (a client_python custom collector) reads one :class:`ModelGauges`
row per model from a *provider* when Prometheus scrapes, and yields their families:
:meth:`DaemonMetrics.read_model_gauges` sets it (the daemon's reads the models' state:
:meth:`daemon.gauges.GaugeExporter.rows`), so that nothing about these gauges runs per batch;
without one, the families are exported empty. Names, types, labels and help are those of :data:`_SPEC`.

Names in :data:`METRIC_NAMES` are the names used in PromQL: counters with their ``_total``
suffix, histograms by family name (their samples add ``_bucket``/``_sum``/``_count``); use
:func:`family_of` to map an exposed sample name back to its entry.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from daemon import native
from daemon.event_records import REASONS as EVENT_REASONS
from lpcal.errors import InputError

__all__ = [
    "CONTENT_TYPE_LATEST",
    "FIT_DURATION_BUCKETS",
    "MAX_POOL_LEVELS",
    "METRIC_LABELS",
    "METRIC_NAMES",
    "METRIC_TYPES",
    "MODEL_GAUGES",
    "POOL_NAME_RE",
    "BinMapSkipReason",
    "Candidate",
    "CheckpointOutcome",
    "DaemonMetrics",
    "EvictionReason",
    "GapResolution",
    "InvalidReason",
    "ModelGaugeCollector",
    "ModelGauges",
    "Predictor",
    "RejectReason",
    "RestoreOutcome",
    "Statistic",
    "Topic",
    "Trigger",
    "UnmatchedKind",
    "family_of",
    "pool_names",
]


# --------------------------------------------------------------------------- label enums


class Topic(StrEnum):
    """Input topic an event was consumed from."""

    PREDICTIONS = "predictions"
    OUTCOMES = "outcomes"


#: Why an input event was rejected (and dead-lettered): the parser's reasons, one source of truth.
InvalidReason = StrEnum("InvalidReason", {r.upper(): r for r in EVENT_REASONS})


class EvictionReason(StrEnum):
    """Why a pending (half-joined) event was dropped from the join buffer."""

    TTL = "ttl"
    CAPACITY = "capacity"


class UnmatchedKind(StrEnum):
    """Events that could not be joined: outcome after eviction, repeated id, no partner."""

    LATE = "late"
    DUPLICATE = "duplicate"
    ORPHAN = "orphan"


class Trigger(StrEnum):
    """What started a recalibration."""

    POOLS_FULL = "pools_full"
    DRIFT = "drift"
    MANUAL = "manual"


class RejectReason(StrEnum):
    """Why a bin map read back from the compacted topic was rejected."""

    CHECKSUM = "checksum"
    TRUNCATED = "truncated"
    SCHEMA = "schema"
    PARSE = "parse"
    MODEL = "model"  # the map's model_id is not its record key
    SIGNATURE = "signature"  # signing configured: unsigned, or not signed by the daemon's key(s)
    CONFIG = "config"  # its k or lambda differs from the model's state (it could not be applied)


class BinMapSkipReason(StrEnum):
    """Why a record of the bin-map topic was skipped by the replica's view of every model's map
    (:mod:`daemon.binmap_view`)."""

    CHECKSUM = "checksum"
    TRUNCATED = "truncated"
    SCHEMA = "schema"
    PARSE = "parse"
    MODEL = "model"  # the map's model_id is not its record key
    SIGNATURE = "signature"  # unsigned, or not signed by one of the daemon's keys
    TOO_LARGE = "too_large"  # more than kafka.max_message_bytes
    NO_KEY = "no_key"  # no model id as its key
    CAPACITY = "capacity"  # beyond the view's bound on models or bytes
    CONFIG = "config"  # its k (pinned) or lambda does not fit the model's settings


class Predictor(StrEnum):
    """Which predictor a quality gauge describes: the model as-is or after the bin map."""

    RAW = "raw"
    CALIBRATED = "calibrated"


class Statistic(StrEnum):
    """A calibration statistic of the monitor (:func:`daemon.monitor.block_statistics`)."""

    CONFIDENCE_GAP = "confidence_gap"
    ECE_TOP = "ece_top"
    ECE_CLASSWISE = "ece_classwise"
    BRIER_RELIABILITY = "brier_reliability"
    ERR_P = "err_p"


class Candidate(StrEnum):
    """A predictor evaluated by a bin map's held-out certificate (:mod:`lpcal.certificate`)."""

    RAW = "raw"
    PRECALIBRATOR = "precalibrator"
    CORRECTED = "corrected"


class GapResolution(StrEnum):
    """How a hole in the input offsets ended (see :mod:`daemon.offset_gaps`)."""

    FILLED = "filled"
    SKIPPED = "skipped"


class CheckpointOutcome(StrEnum):
    """Result of writing a state checkpoint."""

    OK = "ok"
    ERROR = "error"


class RestoreOutcome(StrEnum):
    """What restoring one state record on partition assignment did. A record that
    cannot be used costs only its own model its restored state (the model starts fresh)."""

    RESTORED = "restored"              # restored as checkpointed
    K_CHANGED = "k_changed"            # the settings pin another k: pools, joins, map discarded
    CONFIG_CHANGED = "config_changed"  # eps/p/lambda/mode/... changed: a new epoch started
    WRONG_MODEL = "wrong_model"        # the record's model is not the one of its key: skipped
    TOO_LARGE = "too_large"            # above state.max_record_bytes (decoded): skipped
    CORRUPT = "corrupt"                # not a readable model record: skipped
    BAD_MANIFEST = "bad_manifest"      # a partition manifest that is not usable: ignored


#: Largest number of pool levels. Algorithm 2 uses ``L = floor(log2(6/beta)) + 1`` levels
#: (lpcal.pools.n_levels); L <= 64 holds for every beta >= 6 / 2**63, far below any feasible
#: configuration, so the ``pool`` label has at most 1 + 3 * 64 values per model.
MAX_POOL_LEVELS = 64
POOL_NAME_RE = re.compile(r"^(?:mu|warmup|hold|(?:P|E|PE)(?:[0-9]|[1-5][0-9]|6[0-3]))$")


def pool_names(levels: int) -> list[str]:
    """All admissible pool names for ``levels`` merge levels: mu, warmup, hold, P0.., E0..,
    PE0.."""
    if not 0 <= levels <= MAX_POOL_LEVELS:
        raise InputError(f"pool_names: levels={levels} must be in [0, {MAX_POOL_LEVELS}]")
    return ["mu", "warmup", "hold"] + [f"{kind}{i}" for kind in ("P", "E", "PE")
                                       for i in range(levels)]


#: Histogram buckets of ``lpcal_fit_duration_seconds``: 1 ms ... 60 s, roughly x2.5 steps.
FIT_DURATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)

# --------------------------------------------------------------------------- the contract

# name -> (type, labels, help). Types are Prometheus types: counter | gauge | histogram.
_SPEC: dict[str, tuple[str, tuple[str, ...], str]] = {
    "lpcal_events_consumed_total": (
        "counter", ("topic",), "Events consumed from the input topics."),
    "lpcal_events_invalid_total": (
        "counter", ("reason",), "Input events rejected as invalid, by reason."),
    "lpcal_deadletter_published_total": (
        "counter", (), "Events published to the dead-letter topic."),
    "lpcal_joined_samples_total": (
        "counter", ("model",), "Prediction/outcome pairs joined into labelled samples."),
    "lpcal_events_sampled_out_total": (
        "counter", ("model", "topic"),
        "Input events dropped by the model's sample_rate (hash of the event id), before the join."),
    "lpcal_join_evictions_total": (
        "counter", ("model", "reason"), "Pending events evicted from the join buffer."),
    "lpcal_join_unmatched_total": (
        "counter", ("model", "kind"), "Events that could not be joined (late, duplicate, orphan)."),
    "lpcal_join_pending": (
        "gauge", ("model",), "Events waiting in the join buffer for their partner."),
    "lpcal_join_buffer_bytes": (
        "gauge", ("model",),
        ("Estimated bytes of the model's join buffer (pending events and recent ids); kept "
         "within lpcal_join_buffer_budget_bytes by evicting the oldest events.")),
    "lpcal_join_buffer_budget_bytes": (
        "gauge", ("model",),
        "Byte budget of the model's join buffer: its share of join.max_bytes_total."),
    "lpcal_model_state_bytes": (
        "gauge", ("model",),
        ("Bytes of the model's pools (filling and sealed epochs), held-out sums and monitoring "
         "window; kept within lpcal_model_state_budget_bytes (see daemon/state_budget.py).")),
    "lpcal_model_state_budget_bytes": (
        "gauge", ("model",),
        "Byte budget of the model's pools and window: its share of state.max_bytes_total."),
    "lpcal_epochs_sealed_early_total": (
        "counter", ("model",),
        ("Epochs sealed (and fitted) before their pools were full because they reached a "
         "quarter of lpcal_model_state_budget_bytes: smaller pools, looser certificates.")),
    "lpcal_window_trimmed_samples_total": (
        "counter", ("model",),
        ("Samples dropped from the monitoring window before their time, oldest first, to keep "
         "it within its byte budget.")),
    "lpcal_pool_samples": (
        "gauge", ("model", "pool"), "Samples currently in each sample pool of Algorithm 2."),
    "lpcal_pool_fill_ratio": (
        "gauge", ("model", "pool"), "Pool samples divided by the pool's target size (1 = full)."),
    "lpcal_epochs_waiting": (
        "gauge", ("model",),
        ("Full pool sets (sealed epochs) waiting for their fit; at MAX_SEALED the model's input "
         "partition is paused until fits catch up.")),
    "lpcal_calibrations_total": (
        "counter", ("model", "trigger"), "Successful recalibrations (bin map fitted), by trigger."),
    "lpcal_calibration_failures_total": (
        "counter", ("model",),
        ("Failed recalibration attempts: fits that raised, and bin-map publishes that failed "
         "(a failed publish is retried).")),
    "lpcal_fit_duration_seconds": (
        "histogram", ("model",), "Wall time of one recalibration fit."),
    "lpcal_fit_iterations": (
        "gauge", ("model",), "Merge iterations of Algorithm 2 in the latest fit."),
    "lpcal_high_probability_bins": (
        "gauge", ("model",), "Number |B| of high-probability bins in the latest bin map."),
    "lpcal_binmap_version": (
        "gauge", ("model",), "Version of the latest published bin map."),
    "lpcal_binmap_published_timestamp_seconds": (
        "gauge", ("model",), "Unix time the latest bin map was published."),
    "lpcal_binmaps_rejected_total": (
        "counter", ("reason",), "Bin maps read back from the bin-map topic and rejected."),
    "lpcal_binmap_records_skipped_total": (
        "counter", ("reason",),
        ("Records of the bin-map topic the replica's view of every model's map skipped "
         "(hostile, unverifiable, or beyond its bounds), by reason.")),
    "lpcal_binmaps_served": (
        "gauge", (), "Models whose latest verified bin map this replica serves over HTTP."),
    "lpcal_binmaps_served_bytes": (
        "gauge", (),
        "Estimated bytes of the bin maps this replica serves (bounded, see daemon/binmap_view.py)."),
    "lpcal_certificate_bound": (
        "gauge", ("model",),
        ("Upper confidence bound (level 1 - delta) on the published bin map's Err_p, from the "
         "epoch's held-out samples.")),
    "lpcal_certificate_estimate": (
        "gauge", ("model", "candidate"),
        ("Plug-in held-out Err_p of each candidate of the latest fit: raw, precalibrator "
         "(temperature scaling alone), corrected (Algorithm 2 on the scaled bins).")),
    "lpcal_certificate_target": (
        "gauge", ("model",),
        "The eps the latest bin map is certified against (certified iff bound <= target)."),
    "lpcal_certificate_vacuous": (
        "gauge", ("model",),
        ("1 when the latest certificate's target is vacuous: the raw (uncalibrated) model's own "
         "held-out bound already meets eps; 0 otherwise.")),
    "lpcal_calibration_error": (
        "gauge", ("model", "predictor"), "Windowed estimate of the lp calibration error Err_p."),
    "lpcal_top_label_ece": (
        "gauge", ("model", "predictor"), "Windowed top-label expected calibration error."),
    "lpcal_brier_score": (
        "gauge", ("model", "predictor"), "Windowed multiclass Brier score (mean squared L2)."),
    "lpcal_accuracy_ratio": (
        "gauge", ("model", "predictor"), "Windowed top-1 accuracy."),
    "lpcal_drift_threshold": (
        "gauge", ("model",), "Calibrated Err_p above which a drift recalibration is triggered."),
    "lpcal_window_samples": (
        "gauge", ("model",), "Labelled samples in the quality evaluation window."),
    "lpcal_calibration_statistic": (
        "gauge", ("model", "predictor", "statistic"),
        ("Windowed debiased calibration statistic: l2 top-label / classwise ECE, Brier "
         "reliability term, confidence gap (accuracy - confidence), Err_p.")),
    "lpcal_calibration_statistic_stderr": (
        "gauge", ("model", "predictor", "statistic"),
        "Standard error of lpcal_calibration_statistic."),
    "lpcal_drift_change_score": (
        "gauge", ("model",),
        ("Change test of the live bin map against its baseline: largest CUSUM over its "
         "threshold (drift declared at 1; latched until a new map).")),
    "lpcal_consumer_lag_messages": (
        "gauge", ("topic",), "Messages between the committed offset and the log end."),
    "lpcal_input_holds_total": (
        "counter", ("topic",),
        ("Times an input topic's partition was paused by the join's flow control: its events "
         "filled a model's join buffer while the other topic's partition was behind "
         "(join.align_inputs; a backlog read faster on one topic).")),
    "lpcal_input_held_partitions": (
        "gauge", ("topic",),
        "Input partitions of each topic paused by the join's flow control now."),
    "lpcal_last_poll_timestamp_seconds": (
        "gauge", (), "Unix time of the last successful Kafka poll."),
    "lpcal_checkpoints_total": (
        "counter", ("outcome",), "State checkpoints written, by outcome."),
    "lpcal_checkpoint_duration_seconds": (
        "gauge", (), "Seconds the last successful periodic checkpoint (all models) took."),
    "lpcal_checkpoint_interval_seconds": (
        "gauge", (),
        ("Seconds between the starts of periodic checkpoints now: the configured interval, or "
         "the last duration over state.checkpoint_max_cpu_share if that is longer.")),
    "lpcal_staging_age_seconds": (
        "gauge", (),
        ("Seconds a model's small staged slices wait at most before they are offered to its "
         "state (besides checkpoints, releases and idle polls): 5, or longer when that many "
         "staged offers would take more than join.staging_max_cpu_share of the time (at most "
         "join.staging_max_wait_seconds).")),
    "lpcal_state_restores_total": (
        "counter", ("outcome",),
        ("State records restored on partition assignment, by outcome: restored, k_changed, "
         "config_changed, or skipped (wrong_model, too_large, corrupt, bad_manifest).")),
    "lpcal_input_offset_gaps_total": (
        "counter", ("topic", "resolution"),
        ("Holes in the input offsets of a fetch: filled (read again and found) or skipped "
         "(accepted: transaction markers, compaction, or records lost to a broker fault).")),
    "lpcal_ready": (
        "gauge", (), "1 when the daemon is ready (consuming and state restored), else 0."),
    "lpcal_build_info": (
        "gauge", ("version", "ingest_path"),
        ("Always 1; the labels carry the daemon version and whether its ingest path runs the C "
         "accelerator (c) or pure Python (python).")),
}

#: Every metric the daemon exports, as written in PromQL.
METRIC_NAMES: frozenset[str] = frozenset(_SPEC)
#: Prometheus type of each metric in :data:`METRIC_NAMES`.
METRIC_TYPES: Mapping[str, str] = {name: spec[0] for name, spec in _SPEC.items()}
#: Label names of each metric in :data:`METRIC_NAMES`.
METRIC_LABELS: Mapping[str, tuple[str, ...]] = {name: spec[1] for name, spec in _SPEC.items()}

#: The per-model gauges exported at scrape time by :class:`ModelGaugeCollector`.
MODEL_GAUGES: tuple[str, ...] = (
    "lpcal_join_pending", "lpcal_join_buffer_bytes", "lpcal_join_buffer_budget_bytes",
    "lpcal_model_state_bytes", "lpcal_model_state_budget_bytes", "lpcal_pool_samples",
    "lpcal_pool_fill_ratio", "lpcal_epochs_waiting", "lpcal_calibration_error",
    "lpcal_top_label_ece", "lpcal_brier_score", "lpcal_accuracy_ratio", "lpcal_drift_threshold",
    "lpcal_window_samples", "lpcal_calibration_statistic", "lpcal_calibration_statistic_stderr",
    "lpcal_drift_change_score",
)

_SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def family_of(sample_name: str) -> str | None:
    """Map an exposed sample name (e.g. ``lpcal_fit_duration_seconds_bucket`` or
    ``lpcal_events_consumed_created``) to its :data:`METRIC_NAMES` entry, or None if unknown."""
    if sample_name in METRIC_NAMES:
        return sample_name
    for suffix in _SAMPLE_SUFFIXES:
        if not sample_name.endswith(suffix):
            continue
        base = sample_name[: -len(suffix)]
        if METRIC_TYPES.get(base) == "histogram":
            return base
        if suffix == "_created" and METRIC_TYPES.get(base + "_total") == "counter":
            return base + "_total"
    return None


# --------------------------------------------------------------------------- per-model gauges


@dataclass(slots=True)
class ModelGauges:
    """One model's per-model gauge values (:data:`MODEL_GAUGES`), a row of a gauge provider.

    A field left None exports no series. ``pools``: ``{pool: (count, target)}`` as
    :meth:`lpcal.pools.PoolSet.fill` returns it (samples and their ratio to the target);
    ``quality``: ``{predictor: (err_p, ece, brier, accuracy)}``; ``statistics``:
    ``{predictor: {statistic: (value, stderr)}}`` (a non-finite value or stderr exports no
    series). Enum labels (pool, predictor, statistic) outside their sets are skipped at scrape
    time, never raised: a scrape never fails on one model's values."""

    model: str
    join_pending: float | None = None
    join_buffer_bytes: float | None = None
    join_buffer_budget: float | None = None
    state_bytes: float | None = None
    state_budget: float | None = None
    epochs_waiting: float | None = None
    window_samples: float | None = None
    drift_threshold: float | None = None
    drift_change_score: float | None = None
    pools: Mapping[str, tuple[int, int]] | None = None
    quality: Mapping[str, tuple[float, float, float, float]] | None = None
    statistics: Mapping[str, Mapping[str, tuple[float, float]]] | None = None


#: ModelGauges scalar fields -> their metric
_SCALAR_GAUGES = (
    ("join_pending", "lpcal_join_pending"),
    ("join_buffer_bytes", "lpcal_join_buffer_bytes"),
    ("join_buffer_budget", "lpcal_join_buffer_budget_bytes"),
    ("state_bytes", "lpcal_model_state_bytes"),
    ("state_budget", "lpcal_model_state_budget_bytes"),
    ("epochs_waiting", "lpcal_epochs_waiting"),
    ("window_samples", "lpcal_window_samples"),
    ("drift_threshold", "lpcal_drift_threshold"),
    ("drift_change_score", "lpcal_drift_change_score"),
)
_QUALITY_GAUGES = ("lpcal_calibration_error", "lpcal_top_label_ece", "lpcal_brier_score",
                   "lpcal_accuracy_ratio")
_PREDICTORS = frozenset(p.value for p in Predictor)
_STATISTICS = frozenset(s.value for s in Statistic)


def _family(name: str) -> GaugeMetricFamily:
    _, labels, doc = _SPEC[name]
    return GaugeMetricFamily(name, doc, labels=list(labels))


class ModelGaugeCollector:
    """A client_python custom collector of the per-model gauges: at every scrape it calls
    ``provider()``, an iterable of :class:`ModelGauges` (one per model), and yields the
    :data:`MODEL_GAUGES` families (all of them, empty ones too) with their :data:`_SPEC`
    names, labels and help. The work is O(series) per scrape and nothing between scrapes."""

    def __init__(self, provider: Callable[[], Iterable[ModelGauges]]):
        self.provider = provider

    def describe(self) -> list[GaugeMetricFamily]:
        """The families, without samples (the registry checks their names at registration)."""
        return [_family(name) for name in MODEL_GAUGES]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = {name: _family(name) for name in MODEL_GAUGES}
        scalars = [(field, fam[name].add_metric) for field, name in _SCALAR_GAUGES]
        quality = [fam[name].add_metric for name in _QUALITY_GAUGES]
        pool_samples = fam["lpcal_pool_samples"].add_metric
        pool_ratio = fam["lpcal_pool_fill_ratio"].add_metric
        stat_value = fam["lpcal_calibration_statistic"].add_metric
        stat_se = fam["lpcal_calibration_statistic_stderr"].add_metric
        isfinite = math.isfinite
        for row in self.provider():
            model = row.model
            labels = [model]
            for field, add in scalars:
                v = getattr(row, field)
                if v is not None:
                    add(labels, float(v))
            if row.pools:
                for pool, (count, target) in row.pools.items():
                    if target > 0 and POOL_NAME_RE.match(pool):
                        pool_samples([model, pool], float(count))
                        pool_ratio([model, pool], count / target)
            if row.quality:
                for pred, values in row.quality.items():
                    if pred in _PREDICTORS:
                        for add, v in zip(quality, values):
                            add([model, pred], float(v))
            if row.statistics:
                for pred, stats in row.statistics.items():
                    if pred not in _PREDICTORS:
                        continue
                    for name, (v, se) in stats.items():
                        if name in _STATISTICS and isfinite(v) and isfinite(se) and se >= 0:
                            stat_value([model, pred, name], float(v))
                            stat_se([model, pred, name], float(se))
        yield from fam.values()


def _check(value: str, enum: type[StrEnum], what: str) -> str:
    try:
        return enum(value).value
    except ValueError:
        allowed = ", ".join(member.value for member in enum)
        raise InputError(f"metrics: {what}={value!r} is not one of: {allowed}") from None


def _finite(value: float, what: str, lo: float = 0.0, hi: float = math.inf) -> float:
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise InputError(f"metrics: {what}={value!r} must be finite and in [{lo}, {hi}]")
    return v


def _count(n: float, what: str) -> float:
    v = float(n)
    if not math.isfinite(v) or v < 0:
        raise InputError(f"metrics: {what}={n!r} must be a finite count >= 0")
    return v


def _default_version() -> str:
    try:
        return metadata.version("lpcal")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class DaemonMetrics:
    """All Prometheus metrics of the daemon, registered in one registry.

    ``registry=None`` creates a private :class:`CollectorRegistry` with the standard process,
    platform and GC collectors (so several daemons/tests in one process never collide);
    pass a fresh registry in tests to get only the ``lpcal_`` families.
    ``max_models`` caps the distinct ``model`` label values of *new* models (a guard: the
    daemon admits at most that many); exceeding it raises :class:`InputError`. Models restored
    on partition assignment (``register_model(..., restored=True)``) are always registered:
    a replica that takes over another's partitions exports their models too. Across replicas
    the label is bounded per input partition: a replica admits a new model only while it owns
    fewer than ``max_models``, so each partition carries at most ``max_models`` models and the
    deployment at most ``partitions * max_models`` (``max_models`` in all when
    ``unknown_models = "reject"``, which admits configured models only).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        version: str | None = None,
        max_models: int = 64,
    ) -> None:
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        if max_models < 1:
            raise InputError(f"metrics: max_models={max_models} must be >= 1")
        self.registry = registry
        self.max_models = max_models
        self._models: set[str] = set()
        # the per-model counter children counted every batch (labels() is a lookup, a lock and
        # label checks per call); dropped with the model
        self._joined: dict[str, object] = {}

        def make(name: str):
            kind, labels, doc = _SPEC[name]
            if kind == "counter":
                # client_python appends _total itself; pass the base name.
                return Counter(name[: -len("_total")], doc, labels, registry=registry)
            if kind == "gauge":
                return Gauge(name, doc, labels, registry=registry)
            return Histogram(name, doc, labels, buckets=FIT_DURATION_BUCKETS, registry=registry)

        self.events_consumed = make("lpcal_events_consumed_total")
        self.events_invalid = make("lpcal_events_invalid_total")
        self.deadletter_published = make("lpcal_deadletter_published_total")
        self.joined_samples = make("lpcal_joined_samples_total")
        self.join_evictions = make("lpcal_join_evictions_total")
        self.join_unmatched = make("lpcal_join_unmatched_total")
        self.events_sampled_out = make("lpcal_events_sampled_out_total")
        self.sealed_early = make("lpcal_epochs_sealed_early_total")
        self.window_trimmed = make("lpcal_window_trimmed_samples_total")
        self.calibrations = make("lpcal_calibrations_total")
        self.calibration_failures = make("lpcal_calibration_failures_total")
        self.fit_duration = make("lpcal_fit_duration_seconds")
        self.fit_iterations = make("lpcal_fit_iterations")
        self.high_probability_bins = make("lpcal_high_probability_bins")
        self.binmap_version = make("lpcal_binmap_version")
        self.binmap_published = make("lpcal_binmap_published_timestamp_seconds")
        self.binmaps_rejected = make("lpcal_binmaps_rejected_total")
        self.binmap_records_skipped = make("lpcal_binmap_records_skipped_total")
        self.binmaps_served = make("lpcal_binmaps_served")
        self.binmaps_served_bytes = make("lpcal_binmaps_served_bytes")
        self.certificate_bound = make("lpcal_certificate_bound")
        self.certificate_estimate = make("lpcal_certificate_estimate")
        self.certificate_target = make("lpcal_certificate_target")
        self.certificate_vacuous = make("lpcal_certificate_vacuous")
        self.consumer_lag = make("lpcal_consumer_lag_messages")
        self.input_holds = make("lpcal_input_holds_total")
        self.input_held = make("lpcal_input_held_partitions")
        self.last_poll = make("lpcal_last_poll_timestamp_seconds")
        self.checkpoints = make("lpcal_checkpoints_total")
        self.checkpoint_duration = make("lpcal_checkpoint_duration_seconds")
        self.checkpoint_interval = make("lpcal_checkpoint_interval_seconds")
        self.input_offset_gaps = make("lpcal_input_offset_gaps_total")
        self.staging_age = make("lpcal_staging_age_seconds")
        self.state_restores = make("lpcal_state_restores_total")
        self.ready = make("lpcal_ready")
        self.build_info = make("lpcal_build_info")
        #: the per-model gauges (MODEL_GAUGES): read at scrape time from a provider, by default
        #: this table, which the set_* methods of those gauges write
        self.model_gauge_collector = ModelGaugeCollector(tuple)  # no rows until a provider
        registry.register(self.model_gauge_collector)

        self.build_info.labels(version=version or _default_version(),
                               ingest_path=native.describe()).set(1)
        self.ready.set(0)
        # Pre-create the enum-labelled children so rate()/increase() see a 0 before the first
        # event (otherwise the first increment is invisible to rate()).
        for topic in Topic:
            self.events_consumed.labels(topic=topic.value)
            for resolution in GapResolution:
                self.input_offset_gaps.labels(topic=topic.value, resolution=resolution.value)
        for reason in InvalidReason:
            self.events_invalid.labels(reason=reason.value)
        for reason in RejectReason:
            self.binmaps_rejected.labels(reason=reason.value)
        for reason in BinMapSkipReason:
            self.binmap_records_skipped.labels(reason=reason.value)
        for outcome in CheckpointOutcome:
            self.checkpoints.labels(outcome=outcome.value)
        for outcome in RestoreOutcome:
            self.state_restores.labels(outcome=outcome.value)

    # ------------------------------------------------------------------ bookkeeping

    def _model(self, model: str, restored: bool = False) -> str:
        if not isinstance(model, str) or not model:
            raise InputError(f"metrics: model={model!r} must be a non-empty string")
        if model not in self._models:
            if len(self._models) >= self.max_models and not restored:
                raise InputError(
                    f"metrics: model={model!r} would exceed max_models={self.max_models} "
                    "distinct model label values")
            self._models.add(model)
            for trigger in Trigger:
                self.calibrations.labels(model=model, trigger=trigger.value)
            self.calibration_failures.labels(model=model)
            self.joined_samples.labels(model=model)
            self.window_trimmed.labels(model=model)
            self.sealed_early.labels(model=model)
        return model

    @property
    def models(self) -> frozenset[str]:
        """Model label values currently exported."""
        return frozenset(self._models)

    def register_model(self, model: str, *, restored: bool = False) -> None:
        """Pre-create a model's counters at 0 (call when a model is admitted). A model
        ``restored`` from a checkpoint is registered even beyond ``max_models``: it was
        admitted under the cap by the replica that created it (see :class:`DaemonMetrics`)."""
        self._model(model, restored)

    def read_model_gauges(self, provider: Callable[[], Iterable[ModelGauges]]) -> None:
        """Export the per-model gauges (:data:`MODEL_GAUGES`) from ``provider`` at scrape time:
        ``provider()`` returns one :class:`ModelGauges` per model, e.g. read from the daemon's
        registry (a model it no longer returns has no series)."""
        self.model_gauge_collector.provider = provider

    def remove_model(self, model: str) -> None:
        """Drop every series of ``model`` (call when a model is removed from the config)."""
        if model not in self._models:
            return
        only = ((),)  # metrics whose only label is ``model``
        per_model = [
            (self.joined_samples, only), (self.sealed_early, only), (self.window_trimmed, only),
            (self.calibration_failures, only), (self.fit_duration, only),
            (self.fit_iterations, only), (self.high_probability_bins, only),
            (self.binmap_version, only), (self.binmap_published, only),
            (self.certificate_bound, only), (self.certificate_target, only),
            (self.certificate_vacuous, only),
            (self.certificate_estimate, tuple((c.value,) for c in Candidate)),
            (self.join_evictions, tuple((r.value,) for r in EvictionReason)),
            (self.join_unmatched, tuple((k.value,) for k in UnmatchedKind)),
            (self.events_sampled_out, tuple((t.value,) for t in Topic)),
            (self.calibrations, tuple((t.value,) for t in Trigger)),
        ]
        for metric, rests in per_model:  # rests: the label values after ``model``
            for rest in rests:
                try:
                    metric.remove(model, *rest)
                except KeyError:
                    pass  # that child was never created
        self._joined.pop(model, None)
        self._models.discard(model)

    # ------------------------------------------------------------------ ingest

    def inc_consumed(self, topic: str, n: int = 1) -> None:
        """Count ``n`` events consumed from ``topic`` (predictions | outcomes)."""
        self.events_consumed.labels(topic=_check(topic, Topic, "topic")).inc(_count(n, "n"))

    def inc_invalid(self, reason: str, n: int = 1) -> None:
        """Count ``n`` invalid input events with :class:`InvalidReason` ``reason``."""
        self.events_invalid.labels(
            reason=_check(reason, InvalidReason, "reason")).inc(_count(n, "n"))

    def inc_invalid_many(self, reasons: Mapping[str, int]) -> None:
        """Count a batch of invalid events, ``{reason: count}``."""
        for reason, n in reasons.items():
            self.inc_invalid(reason, n)

    def inc_deadletter(self, n: int = 1) -> None:
        """Count ``n`` messages published to the dead-letter topic."""
        self.deadletter_published.inc(_count(n, "n"))

    # ------------------------------------------------------------------ join

    def inc_joined(self, model: str, n: int = 1) -> None:
        """Count ``n`` joined (prediction, outcome) samples of ``model``."""
        n = _count(n, "n")
        child = self._joined.get(model)
        if child is None:
            child = self._joined[model] = self.joined_samples.labels(model=self._model(model))
        child.inc(n)

    def inc_sampled_out(self, model: str, topic: str, n: int = 1) -> None:
        """Count ``n`` events of ``model`` from ``topic`` (predictions | outcomes) dropped by
        its ``sample_rate``."""
        self.events_sampled_out.labels(
            model=self._model(model), topic=_check(topic, Topic, "topic")).inc(_count(n, "n"))

    def inc_evicted(self, model: str, reason: str, n: int = 1) -> None:
        """Count ``n`` join-buffer evictions (ttl | capacity)."""
        self.join_evictions.labels(
            model=self._model(model),
            reason=_check(reason, EvictionReason, "reason")).inc(_count(n, "n"))

    def inc_unmatched(self, model: str, kind: str, n: int = 1) -> None:
        """Count ``n`` events that could not be joined (late | duplicate | orphan)."""
        self.join_unmatched.labels(
            model=self._model(model),
            kind=_check(kind, UnmatchedKind, "kind")).inc(_count(n, "n"))

    def inc_sealed_early(self, model: str, n: int = 1) -> None:
        """Count ``n`` epochs of ``model`` sealed before full, at the byte budget."""
        self.sealed_early.labels(model=self._model(model)).inc(_count(n, "n"))

    def inc_window_trimmed(self, model: str, n: int) -> None:
        """Count ``n`` samples dropped early from ``model``'s window by its byte budget."""
        self.window_trimmed.labels(model=self._model(model)).inc(_count(n, "n"))

    # ------------------------------------------------------------------ calibration

    def observe_fit(
        self,
        model: str,
        trigger: str,
        seconds: float,
        iterations: int,
        n_bins: int,
    ) -> None:
        """Record one successful recalibration: trigger, wall time, iterations and |B|."""
        trig = _check(trigger, Trigger, "trigger")
        seconds = _finite(seconds, "seconds")
        iterations = _count(iterations, "iterations")
        n_bins = _count(n_bins, "n_bins")
        self._model(model)
        self.calibrations.labels(model=model, trigger=trig).inc()
        self.fit_duration.labels(model=model).observe(seconds)
        self.fit_iterations.labels(model=model).set(iterations)
        self.high_probability_bins.labels(model=model).set(n_bins)

    def inc_calibration_failure(self, model: str) -> None:
        """Count a failed recalibration attempt of ``model`` (a fit that raised, or a failed
        publish of its bin map)."""
        self.calibration_failures.labels(model=self._model(model)).inc()

    def set_binmap_published(
        self, model: str, version: int, timestamp: float | None = None
    ) -> None:
        """Record that bin map ``version`` of ``model`` was published at ``timestamp``
        (Unix seconds; default now)."""
        version = _count(version, "version")
        ts = time.time() if timestamp is None else _finite(timestamp, "timestamp")
        self._model(model)
        self.binmap_version.labels(model=model).set(version)
        self.binmap_published.labels(model=model).set(ts)

    def set_certificate(self, model: str, certificate: Mapping | None) -> None:
        """Export a bin map's held-out certificate (``BinMap.certificate``, a dict as in
        :meth:`lpcal.certificate.Certificate.to_dict`): the selected candidate's bound, the
        target ``eps`` and each candidate's plug-in ``Err_p``. ``None`` (a map without a
        certificate) removes the model's certificate series, so no stale bound remains."""
        self._model(model)
        if certificate is None:
            for gauge in (self.certificate_bound, self.certificate_target,
                          self.certificate_vacuous):
                try:
                    gauge.remove(model)
                except KeyError:
                    pass
            for c in Candidate:
                try:
                    self.certificate_estimate.remove(model, c.value)
                except KeyError:
                    pass
            return
        try:
            estimates = dict(certificate["estimates"])
            selected = str(certificate["selected"])
            bound = float(estimates[selected]["bound"])
            target = _finite(certificate["eps"], "certificate eps", 0.0, 1.0)
            rows = [(_check(name, Candidate, "candidate"),
                     _finite(e["err_p"], f"certificate estimates[{name!r}].err_p"))
                    for name, e in estimates.items()]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"metrics: malformed certificate of model {model!r} "
                             f"({type(e).__name__}: {e})") from None
        if math.isnan(bound) or bound < 0:  # +inf is a valid (uninformative) bound
            raise InputError(f"metrics: certificate bound={bound!r} must be >= 0")
        self.certificate_bound.labels(model=model).set(bound)
        self.certificate_target.labels(model=model).set(target)
        self.certificate_vacuous.labels(model=model).set(
            1.0 if certificate.get("vacuous") is True else 0.0)
        present = {name for name, _ in rows}
        for name, err in rows:
            self.certificate_estimate.labels(model=model, candidate=name).set(err)
        for c in Candidate:
            if c.value not in present:
                try:
                    self.certificate_estimate.remove(model, c.value)
                except KeyError:
                    pass

    def inc_binmap_rejected(self, reason: str) -> None:
        """Count a bin map rejected on read (a :class:`RejectReason`)."""
        self.binmaps_rejected.labels(reason=_check(reason, RejectReason, "reason")).inc()

    def inc_binmap_record_skipped(self, reason: str) -> None:
        """Count a record of the bin-map topic skipped by the view (a :class:`BinMapSkipReason`)."""
        self.binmap_records_skipped.labels(
            reason=_check(reason, BinMapSkipReason, "reason")).inc()

    def set_binmaps_served(self, models: int, nbytes: int) -> None:
        """Set how many models' bin maps the view serves, and their estimated bytes."""
        self.binmaps_served.set(_count(models, "models"))
        self.binmaps_served_bytes.set(_count(nbytes, "bytes"))

    # ------------------------------------------------------------------ consumer / process

    def set_consumer_lag(self, topic: str, lag: int) -> None:
        """Set the lag (messages, summed over partitions) of ``topic``."""
        self.consumer_lag.labels(topic=_check(topic, Topic, "topic")).set(_count(lag, "lag"))

    def inc_input_hold(self, topic: str) -> None:
        """Count one hold of an input partition of ``topic`` by the join's flow control."""
        self.input_holds.labels(topic=_check(topic, Topic, "topic")).inc()

    def set_input_held(self, held: Mapping[str, int]) -> None:
        """Set the input partitions held now, ``{topic: count}``."""
        for topic, n in held.items():
            self.input_held.labels(topic=_check(topic, Topic, "topic")).set(_count(n, "n"))

    def set_consumer_lags(self, lags: Mapping[str, int]) -> None:
        """Set several topics' lag at once, ``{topic: lag}``."""
        for topic, lag in lags.items():
            self.set_consumer_lag(topic, lag)

    def mark_poll(self, timestamp: float | None = None) -> None:
        """Record a successful poll at ``timestamp`` (Unix seconds; default now)."""
        self.last_poll.set(time.time() if timestamp is None else _finite(timestamp, "timestamp"))

    def inc_checkpoint(self, outcome: str) -> None:
        """Count a state checkpoint with outcome ok | error."""
        self.checkpoints.labels(outcome=_check(outcome, CheckpointOutcome, "outcome")).inc()

    def set_checkpoint_pacing(self, duration: float, interval: float) -> None:
        """Set the last periodic checkpoint's duration and the effective interval (seconds;
        see :mod:`daemon.checkpoint.pacing`)."""
        self.checkpoint_duration.set(_finite(duration, "duration"))
        self.checkpoint_interval.set(_finite(interval, "interval"))

    def set_staging_age(self, seconds: float) -> None:
        """Set the staging age in effect (seconds; see :class:`daemon.staging.StagePacing`)."""
        self.staging_age.set(_finite(seconds, "seconds"))

    def inc_restore(self, outcome: str) -> None:
        """Count one state record restored (or skipped) on assignment: a :class:`RestoreOutcome`."""
        self.state_restores.labels(outcome=_check(outcome, RestoreOutcome, "outcome")).inc()

    def inc_offset_gap(self, topic: str, resolution: str) -> None:
        """Count a hole in ``topic``'s input offsets, resolved as filled | skipped."""
        self.input_offset_gaps.labels(topic=_check(topic, Topic, "topic"), resolution=_check(
            resolution, GapResolution, "resolution")).inc()

    def set_ready(self, ready: bool) -> None:
        """Set ``lpcal_ready`` to 1 or 0."""
        self.ready.set(1 if ready else 0)

    # ------------------------------------------------------------------ exposition

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (serve with :data:`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)

    def exported_names(self) -> Iterable[str]:
        """Names of the ``lpcal_`` families currently in the registry, as in PromQL."""
        for family in self.registry.collect():
            if family.name.startswith("lpcal_"):
                yield family.name + "_total" if family.type == "counter" else family.name
