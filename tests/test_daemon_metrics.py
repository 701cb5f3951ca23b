"""Contract tests of daemon.metrics: names, types, labels, conventions, exposition round-trip.

Every test builds a fresh CollectorRegistry (like client_python's own tests)."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from daemon import metrics as m
from daemon import native
from daemon.metrics import DaemonMetrics
from lpcal.errors import InputError

NAME_RE = re.compile(r"^lpcal_[a-z][a-z0-9_]*$")
# Base units only: no ms/minutes/percent/kilobytes style names.
NON_BASE_UNITS = re.compile(r"_(milliseconds|ms|minutes|hours|percent|kb|mb|kilobytes)(_|$)")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def dm(registry: CollectorRegistry) -> DaemonMetrics:
    return DaemonMetrics(registry, version="1.2.3", max_models=3)


def families(registry: CollectorRegistry) -> dict[str, object]:
    """Parse the registry's exposition text back with prometheus_client.parser."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(registry, name, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


EXPECTED = {
    "lpcal_events_consumed_total": ("counter", ("topic",)),
    "lpcal_events_invalid_total": ("counter", ("reason",)),
    "lpcal_deadletter_published_total": ("counter", ()),
    "lpcal_joined_samples_total": ("counter", ("model",)),
    "lpcal_join_evictions_total": ("counter", ("model", "reason")),
    "lpcal_join_unmatched_total": ("counter", ("model", "kind")),
    "lpcal_events_sampled_out_total": ("counter", ("model", "topic")),
    "lpcal_join_pending": ("gauge", ("model",)),
    "lpcal_epochs_waiting": ("gauge", ("model",)),
    "lpcal_pool_samples": ("gauge", ("model", "pool")),
    "lpcal_pool_fill_ratio": ("gauge", ("model", "pool")),
    "lpcal_calibrations_total": ("counter", ("model", "trigger")),
    "lpcal_calibration_failures_total": ("counter", ("model",)),
    "lpcal_fit_duration_seconds": ("histogram", ("model",)),
    "lpcal_fit_iterations": ("gauge", ("model",)),
    "lpcal_join_buffer_bytes": ("gauge", ("model",)),
    "lpcal_join_buffer_budget_bytes": ("gauge", ("model",)),
    "lpcal_model_state_bytes": ("gauge", ("model",)),
    "lpcal_model_state_budget_bytes": ("gauge", ("model",)),
    "lpcal_epochs_sealed_early_total": ("counter", ("model",)),
    "lpcal_window_trimmed_samples_total": ("counter", ("model",)),
    "lpcal_high_probability_bins": ("gauge", ("model",)),
    "lpcal_binmap_version": ("gauge", ("model",)),
    "lpcal_binmap_published_timestamp_seconds": ("gauge", ("model",)),
    "lpcal_binmaps_rejected_total": ("counter", ("reason",)),
    "lpcal_binmap_records_skipped_total": ("counter", ("reason",)),
    "lpcal_binmaps_served": ("gauge", ()),
    "lpcal_binmaps_served_bytes": ("gauge", ()),
    "lpcal_certificate_bound": ("gauge", ("model",)),
    "lpcal_certificate_estimate": ("gauge", ("model", "candidate")),
    "lpcal_certificate_target": ("gauge", ("model",)),
    "lpcal_certificate_vacuous": ("gauge", ("model",)),
    "lpcal_calibration_error": ("gauge", ("model", "predictor")),
    "lpcal_top_label_ece": ("gauge", ("model", "predictor")),
    "lpcal_brier_score": ("gauge", ("model", "predictor")),
    "lpcal_accuracy_ratio": ("gauge", ("model", "predictor")),
    "lpcal_drift_threshold": ("gauge", ("model",)),
    "lpcal_window_samples": ("gauge", ("model",)),
    "lpcal_calibration_statistic": ("gauge", ("model", "predictor", "statistic")),
    "lpcal_calibration_statistic_stderr": ("gauge", ("model", "predictor", "statistic")),
    "lpcal_drift_change_score": ("gauge", ("model",)),
    "lpcal_consumer_lag_messages": ("gauge", ("topic",)),
    "lpcal_input_holds_total": ("counter", ("topic",)),
    "lpcal_input_held_partitions": ("gauge", ("topic",)),
    "lpcal_last_poll_timestamp_seconds": ("gauge", ()),
    "lpcal_checkpoints_total": ("counter", ("outcome",)),
    "lpcal_checkpoint_duration_seconds": ("gauge", ()),
    "lpcal_checkpoint_interval_seconds": ("gauge", ()),
    "lpcal_staging_age_seconds": ("gauge", ()),
    "lpcal_state_restores_total": ("counter", ("outcome",)),
    "lpcal_input_offset_gaps_total": ("counter", ("topic", "resolution")),
    "lpcal_ready": ("gauge", ()),
    "lpcal_build_info": ("gauge", ("version", "ingest_path")),
}


def test_metric_names_match_the_contract():
    assert m.METRIC_NAMES == frozenset(EXPECTED)
    for name, (kind, labels) in EXPECTED.items():
        assert m.METRIC_TYPES[name] == kind, name
        assert m.METRIC_LABELS[name] == labels, name


def test_naming_conventions():
    for name, kind in m.METRIC_TYPES.items():
        assert NAME_RE.match(name), name
        assert not NON_BASE_UNITS.search(name), name
        # _total exactly on counters
        assert name.endswith("_total") == (kind == "counter"), name
    assert m.METRIC_TYPES["lpcal_fit_duration_seconds"] == "histogram"


def test_enum_values_are_the_specified_sets():
    assert {t.value for t in m.Topic} == {"predictions", "outcomes"}
    assert {r.value for r in m.InvalidReason} == {
        "bad_json", "oversize", "bad_schema", "unknown_model", "wrong_length", "non_finite",
        "negative", "not_normalized", "label_out_of_range", "bad_encoding", "ts_out_of_range",
        "k_too_large"}
    assert {r.value for r in m.EvictionReason} == {"ttl", "capacity"}
    assert {k.value for k in m.UnmatchedKind} == {"late", "duplicate", "orphan"}
    assert {t.value for t in m.Trigger} == {"pools_full", "drift", "manual"}
    assert {r.value for r in m.RejectReason} == {"checksum", "truncated", "schema", "parse",
                                                 "model", "signature", "config"}
    assert {p.value for p in m.Predictor} == {"raw", "calibrated"}
    assert {o.value for o in m.CheckpointOutcome} == {"ok", "error"}
    assert {r.value for r in m.GapResolution} == {"filled", "skipped"}
    assert {c.value for c in m.Candidate} == {"raw", "precalibrator", "corrected"}


def test_registered_families_types_and_labels(dm: DaemonMetrics, registry):
    # Touch every labelled metric once so each family has at least one sample.
    exercise(dm)
    fams = families(registry)
    seen = set()
    for fam in fams.values():
        assert fam.name.startswith("lpcal_"), fam.name
        if fam.name.endswith("_created"):
            # text format 0.0.4 exposes counter/histogram creation times as extra gauges
            assert m.METRIC_TYPES[m.family_of(fam.name)] in ("counter", "histogram")
            continue
        promql = fam.name + "_total" if fam.type == "counter" else fam.name
        assert promql in EXPECTED, promql
        kind, labels = EXPECTED[promql]
        assert fam.type == kind, promql
        for s in fam.samples:
            extra = {"le"} if s.name.endswith("_bucket") else set()
            assert set(s.labels) == set(labels) | extra, (s.name, s.labels)
            assert m.family_of(s.name) == promql, s.name
        seen.add(promql)
    assert seen == set(EXPECTED)
    assert set(dm.exported_names()) == set(EXPECTED)


#: a bin map's certificate, as lpcal.certificate.Certificate.to_dict() writes it
CERTIFICATE = {
    "method": "normal-union+missing-mass", "eps": 0.05, "p": "inf", "lam": 20, "delta": 0.1,
    "n_holdout": 3000, "selected": "precalibrator", "certified": False,
    "estimates": {"raw": {"err_p": 0.21, "bound": 0.26, "brier": 0.5},
                  "precalibrator": {"err_p": 0.04, "bound": 0.07, "brier": 0.41},
                  "corrected": {"err_p": 0.05, "bound": 0.09, "brier": 0.42}},
}


def exercise(dm: DaemonMetrics) -> None:
    dm.inc_consumed("predictions", 5)
    dm.inc_consumed("outcomes")
    dm.inc_invalid("bad_json", 2)
    dm.inc_deadletter(2)
    dm.inc_joined("fraud-v3", 4)
    dm.inc_evicted("fraud-v3", "ttl", 1)
    dm.inc_unmatched("fraud-v3", "late", 1)
    dm.observe_fit("fraud-v3", "pools_full", 0.2, 9, 31)
    dm.inc_calibration_failure("fraud-v3")
    dm.set_binmap_published("fraud-v3", 3, 1_700_000_000.0)
    dm.inc_binmap_rejected("checksum")
    dm.set_certificate("fraud-v3", CERTIFICATE)
    # the per-model gauges, read from a provider at scrape time (the daemon's reads its
    # registry, so a model removed has no row)
    row = m.ModelGauges(
        "fraud-v3", join_pending=7, epochs_waiting=2, drift_threshold=0.05,
        window_samples=5000, drift_change_score=1.25,
        pools={"mu": (50, 100), "P0": (10, 40), "E0": (40, 40), "PE0": (0, 8),
               "warmup": (2000, 2000), "hold": (30, 3000)},
        quality={"raw": (0.12, 0.08, 0.4, 0.81), "calibrated": (0.03, 0.02, 0.35, 0.81)},
        statistics={"calibrated": {"ece_top": (0.02, 0.004),
                                   "ece_classwise": (float("nan"), 0.0)}})
    dm.read_model_gauges(lambda: [row] if row.model in dm.models else [])
    dm.set_consumer_lag("predictions", 12)
    dm.mark_poll(1_700_000_001.0)
    dm.inc_checkpoint("ok")
    dm.inc_offset_gap("predictions", "filled")
    dm.set_ready(True)


def test_helpers_set_the_right_samples(dm: DaemonMetrics, registry):
    exercise(dm)
    g = lambda name, **kw: sample_value(registry, name, **kw)
    assert g("lpcal_events_consumed_total", topic="predictions") == 5
    assert g("lpcal_events_consumed_total", topic="outcomes") == 1
    assert g("lpcal_events_invalid_total", reason="bad_json") == 2
    assert g("lpcal_events_invalid_total", reason="oversize") == 0  # pre-created at 0
    assert g("lpcal_deadletter_published_total") == 2
    assert g("lpcal_joined_samples_total", model="fraud-v3") == 4
    assert g("lpcal_join_evictions_total", model="fraud-v3", reason="ttl") == 1
    assert g("lpcal_join_unmatched_total", model="fraud-v3", kind="late") == 1
    assert g("lpcal_join_pending", model="fraud-v3") == 7
    assert g("lpcal_epochs_waiting", model="fraud-v3") == 2
    assert g("lpcal_pool_samples", model="fraud-v3", pool="mu") == 50
    assert g("lpcal_pool_fill_ratio", model="fraud-v3", pool="mu") == 0.5
    assert g("lpcal_pool_fill_ratio", model="fraud-v3", pool="P0") == 0.25
    assert g("lpcal_pool_fill_ratio", model="fraud-v3", pool="E0") == 1.0
    assert g("lpcal_pool_fill_ratio", model="fraud-v3", pool="PE0") == 0.0
    assert g("lpcal_pool_fill_ratio", model="fraud-v3", pool="warmup") == 1.0
    assert g("lpcal_pool_samples", model="fraud-v3", pool="hold") == 30
    assert g("lpcal_certificate_bound", model="fraud-v3") == 0.07
    assert g("lpcal_certificate_target", model="fraud-v3") == 0.05
    assert g("lpcal_certificate_vacuous", model="fraud-v3") == 0  # raw bound 0.26 > eps
    dm.set_certificate("fraud-v3", {**CERTIFICATE, "vacuous": True})
    assert g("lpcal_certificate_vacuous", model="fraud-v3") == 1
    dm.set_certificate("fraud-v3", CERTIFICATE)
    assert g("lpcal_certificate_estimate", model="fraud-v3", candidate="raw") == 0.21
    assert g("lpcal_certificate_estimate", model="fraud-v3", candidate="corrected") == 0.05
    assert g("lpcal_calibrations_total", model="fraud-v3", trigger="pools_full") == 1
    assert g("lpcal_calibrations_total", model="fraud-v3", trigger="drift") == 0
    assert g("lpcal_calibration_failures_total", model="fraud-v3") == 1
    assert g("lpcal_fit_duration_seconds_count", model="fraud-v3") == 1
    assert g("lpcal_fit_duration_seconds_sum", model="fraud-v3") == pytest.approx(0.2)
    assert g("lpcal_fit_duration_seconds_bucket", model="fraud-v3", le="0.1") == 0
    assert g("lpcal_fit_duration_seconds_bucket", model="fraud-v3", le="0.25") == 1
    assert g("lpcal_fit_iterations", model="fraud-v3") == 9
    assert g("lpcal_high_probability_bins", model="fraud-v3") == 31
    assert g("lpcal_binmap_version", model="fraud-v3") == 3
    assert g("lpcal_binmap_published_timestamp_seconds", model="fraud-v3") == 1_700_000_000.0
    assert g("lpcal_binmaps_rejected_total", reason="checksum") == 1
    assert g("lpcal_calibration_error", model="fraud-v3", predictor="raw") == 0.12
    assert g("lpcal_calibration_error", model="fraud-v3", predictor="calibrated") == 0.03
    assert g("lpcal_top_label_ece", model="fraud-v3", predictor="raw") == 0.08
    assert g("lpcal_brier_score", model="fraud-v3", predictor="calibrated") == 0.35
    assert g("lpcal_accuracy_ratio", model="fraud-v3", predictor="raw") == 0.81
    assert g("lpcal_drift_threshold", model="fraud-v3") == 0.05
    assert g("lpcal_window_samples", model="fraud-v3") == 5000
    assert g("lpcal_calibration_statistic", model="fraud-v3", predictor="calibrated",
             statistic="ece_top") == 0.02
    assert g("lpcal_calibration_statistic_stderr", model="fraud-v3", predictor="calibrated",
             statistic="ece_top") == 0.004
    # a statistic that is not kept (NaN) has no series
    assert g("lpcal_calibration_statistic", model="fraud-v3", predictor="calibrated",
             statistic="ece_classwise") is None
    assert g("lpcal_drift_change_score", model="fraud-v3") == 1.25
    assert g("lpcal_consumer_lag_messages", topic="predictions") == 12
    assert g("lpcal_last_poll_timestamp_seconds") == 1_700_000_001.0
    assert g("lpcal_checkpoints_total", outcome="ok") == 1
    assert g("lpcal_checkpoints_total", outcome="error") == 0
    assert g("lpcal_input_offset_gaps_total", topic="predictions", resolution="filled") == 1
    assert g("lpcal_input_offset_gaps_total", topic="outcomes", resolution="skipped") == 0
    assert g("lpcal_ready") == 1
    assert g("lpcal_build_info", version="1.2.3", ingest_path=native.describe()) == 1
    dm.set_ready(False)
    assert g("lpcal_ready") == 0


def test_fit_duration_buckets_span_1ms_to_60s(dm, registry):
    dm.observe_fit("m", "manual", 0.0005, 1, 1)
    fam = families(registry)["lpcal_fit_duration_seconds"]
    les = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")]
    finite = [x for x in les if math.isfinite(x)]
    assert finite == sorted(finite)
    assert finite[0] == 0.001 and finite[-1] == 60.0
    assert math.inf in les


def test_exposition_round_trips_through_the_parser(dm, registry):
    exercise(dm)
    text = dm.exposition().decode()
    parsed = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            parsed[(s.name, tuple(sorted(s.labels.items())))] = s.value
    # every sample the registry reports is in the text with the same value
    for fam in registry.collect():
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key in parsed, key
            assert parsed[key] == pytest.approx(s.value), key


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.inc_consumed("prediction"),
        lambda d: d.inc_invalid("weird"),
        lambda d: d.inc_evicted("m", "old"),
        lambda d: d.inc_unmatched("m", "lost"),
        lambda d: d.observe_fit("m", "cron", 0.1, 1, 1),
        lambda d: d.inc_binmap_rejected("bad"),
        lambda d: d.inc_checkpoint("maybe"),
        lambda d: d.inc_offset_gap("predictions", "ignored"),
        lambda d: d.set_consumer_lag("binmaps", 1),
    ],
)
def test_unknown_enum_label_values_are_rejected(dm, call):
    with pytest.raises(InputError, match="is not one of"):
        call(dm)


@pytest.mark.parametrize(
    "pool", ["P64", "PE99", "X0", "mu1", "p0", "", "P-1", "E 1", "P01"])
def test_pool_names_are_bounded(dm, pool):
    dm.read_model_gauges(lambda: [m.ModelGauges("m", pools={pool: (1, 2), "mu": (1, 2)})])
    text = dm.exposition().decode()
    assert 'pool="mu"' in text and f'pool="{pool}"' not in text


def test_pool_names_of_the_library_layouts_are_accepted():
    """Every pool name lpcal.pools can produce (both variants, any feasible beta) passes."""
    from lpcal import pools
    assert pools.n_levels(6.0 / 2**63) <= m.MAX_POOL_LEVELS
    for variant in ("split", "shared"):
        for name in pools.pool_names(m.MAX_POOL_LEVELS, variant):
            assert m.POOL_NAME_RE.match(name), name


def test_pool_names_helper_matches_the_regex():
    names = m.pool_names(m.MAX_POOL_LEVELS)
    assert len(names) == 3 + 3 * m.MAX_POOL_LEVELS
    assert {"warmup", "hold"} <= set(names)
    assert all(m.POOL_NAME_RE.match(n) for n in names)
    assert not m.POOL_NAME_RE.match(f"P{m.MAX_POOL_LEVELS}")
    with pytest.raises(InputError):
        m.pool_names(m.MAX_POOL_LEVELS + 1)


def test_certificate_gauges_follow_the_latest_bin_map(dm, registry):
    g = lambda name, **kw: sample_value(registry, name, **kw)
    dm.set_certificate("m", CERTIFICATE)
    assert g("lpcal_certificate_estimate", model="m", candidate="precalibrator") == 0.04
    # a map certified with fewer candidates (the paper's mode) drops the others' series
    paper = {**CERTIFICATE, "selected": "corrected", "certified": True,
             "estimates": {k: v for k, v in CERTIFICATE["estimates"].items()
                           if k != "precalibrator"}}
    dm.set_certificate("m", paper)
    assert g("lpcal_certificate_bound", model="m") == 0.09
    assert g("lpcal_certificate_estimate", model="m", candidate="precalibrator") is None
    # an unbounded bound is exported as +Inf (the alert then fires)
    inf = {**paper, "estimates": {**paper["estimates"],
                                  "corrected": {"err_p": 0.3, "bound": float("inf"),
                                                "brier": 0.5}}}
    dm.set_certificate("m", inf)
    assert g("lpcal_certificate_bound", model="m") == float("inf")
    # a map without a certificate clears every certificate series of the model
    dm.set_certificate("m", None)
    text = dm.exposition().decode()
    assert 'lpcal_certificate_bound{model="m"}' not in text
    assert 'lpcal_certificate_estimate{' not in text and "lpcal_certificate_target{" not in text
    assert "lpcal_certificate_vacuous{" not in text
    with pytest.raises(InputError, match="is not one of"):
        dm.set_certificate("m", {**CERTIFICATE, "estimates": {
            **CERTIFICATE["estimates"], "smoothed": {"err_p": 0.1, "bound": 0.2, "brier": 0.3}}})
    with pytest.raises(InputError, match="malformed certificate"):
        dm.set_certificate("m", {"eps": 0.1})
    with pytest.raises(InputError, match="bound"):
        dm.set_certificate("m", {**paper, "estimates": {"corrected": {
            "err_p": 0.1, "bound": float("nan"), "brier": 0.1}}})
    assert g("lpcal_certificate_bound", model="m") is None  # rejected calls leave nothing


def test_bad_values_are_rejected_with_a_message(dm, registry):
    with pytest.raises(InputError, match="n="):
        dm.inc_consumed("outcomes", -1)
    with pytest.raises(InputError, match="seconds"):
        dm.observe_fit("m", "manual", float("inf"), 1, 1)
    # a rejected call leaves no partial state behind
    assert sample_value(registry, "lpcal_fit_duration_seconds_count", model="m") is None


def test_model_label_cardinality_is_capped(dm):
    for name in ("a", "b", "c"):
        dm.inc_joined(name)
    dm.inc_joined("a")  # known model: fine
    with pytest.raises(InputError, match="max_models=3"):
        dm.inc_joined("d")
    assert dm.models == {"a", "b", "c"}


def test_remove_model_drops_its_series_and_frees_a_slot(dm, registry):
    exercise(dm)
    dm.remove_model("fraud-v3")
    text = dm.exposition().decode()
    assert 'model="fraud-v3"' not in text
    # unrelated series survive
    assert sample_value(registry, "lpcal_events_consumed_total", topic="predictions") == 5
    for name in ("a", "b", "c"):
        dm.register_model(name)
    assert sample_value(registry, "lpcal_calibrations_total", model="a", trigger="drift") == 0


def test_a_model_removed_before_its_first_gauges_is_removed_cleanly(dm):
    """A revoke can land before a new or restored model's first fit: its fit and
    certificate series were never created (this raised ``ValueError: Incorrect label
    count``)."""
    dm.register_model("fresh", restored=True)
    dm.remove_model("fresh")
    assert 'model="fresh"' not in dm.exposition().decode()
    assert "fresh" not in dm.models


def test_default_registry_is_private_and_has_process_metrics():
    a, b = DaemonMetrics(), DaemonMetrics()  # no duplicate-registration error
    assert a.registry is not b.registry
    text = a.exposition().decode()
    assert "lpcal_build_info" in text
    assert "python_info" in text  # platform collector


def test_family_of_maps_suffixes():
    assert m.family_of("lpcal_fit_duration_seconds_bucket") == "lpcal_fit_duration_seconds"
    assert m.family_of("lpcal_fit_duration_seconds_count") == "lpcal_fit_duration_seconds"
    assert m.family_of("lpcal_events_consumed_created") == "lpcal_events_consumed_total"
    assert m.family_of("lpcal_ready") == "lpcal_ready"
    assert m.family_of("lpcal_ready_bucket") is None
    assert m.family_of("lpcal_nope") is None


# --------------------------------------------------------------------------- per-model gauges


def test_model_gauges_come_from_the_provider_at_scrape_time(dm, registry):
    """read_model_gauges: the collector reads the provider at every scrape (no state kept in
    between), with the _SPEC names, labels and help."""
    rows = [m.ModelGauges(
        "a", join_pending=3, join_buffer_bytes=100, join_buffer_budget=1000, state_bytes=7,
        state_budget=70, epochs_waiting=1, window_samples=50, drift_threshold=0.05,
        drift_change_score=0.4, pools={"mu": (10, 40), "P0": (4, 4)},
        quality={"raw": (0.2, 0.1, 0.5, 0.7), "calibrated": (0.05, 0.02, 0.4, 0.7)},
        statistics={"calibrated": {"ece_top": (0.02, 0.004), "err_p": (float("nan"), 0.1)}})]
    calls = []

    def provider():
        calls.append(1)
        return list(rows)

    dm.read_model_gauges(provider)
    g = lambda name, **kw: sample_value(registry, name, **kw)
    assert g("lpcal_join_pending", model="a") == 3
    assert g("lpcal_join_buffer_budget_bytes", model="a") == 1000
    assert g("lpcal_model_state_budget_bytes", model="a") == 70
    assert g("lpcal_pool_fill_ratio", model="a", pool="mu") == 0.25
    assert g("lpcal_pool_samples", model="a", pool="P0") == 4
    assert g("lpcal_calibration_error", model="a", predictor="calibrated") == 0.05
    assert g("lpcal_accuracy_ratio", model="a", predictor="raw") == 0.7
    assert g("lpcal_calibration_statistic_stderr", model="a", predictor="calibrated",
             statistic="ece_top") == 0.004
    # a non-finite statistic exports no series
    assert g("lpcal_calibration_statistic", model="a", predictor="calibrated",
             statistic="err_p") is None
    assert g("lpcal_drift_change_score", model="a") == 0.4
    # the provider is read again at the next scrape: a changed row shows, a removed one goes
    rows[0] = m.ModelGauges("b", join_pending=9)
    assert g("lpcal_join_pending", model="b") == 9
    assert g("lpcal_join_pending", model="a") is None
    assert calls
    # the exposition keeps the contract: HELP from _SPEC, gauge type
    text = dm.exposition().decode()
    help_line = f"# HELP lpcal_join_pending {m._SPEC['lpcal_join_pending'][2]}"
    assert help_line in text and "# TYPE lpcal_join_pending gauge" in text


def test_values_outside_the_label_sets_are_skipped_at_scrape_time(dm, registry):
    """A scrape never fails on one model's values: unknown pools, predictors and statistics,
    and pools with no target, are left out."""
    dm.read_model_gauges(lambda: [m.ModelGauges(
        "a", pools={"mu": (1, 2), "bogus": (1, 2), "P0": (1, 0)},
        quality={"smoothed": (0.1, 0.1, 0.1, 0.5)},
        statistics={"raw": {"made_up": (0.1, 0.01)}, "other": {"ece_top": (0.1, 0.01)}})])
    text = dm.exposition().decode()
    assert 'pool="mu"' in text
    assert 'pool="bogus"' not in text and 'pool="P0"' not in text
    assert "smoothed" not in text and "made_up" not in text and 'predictor="other"' not in text


def test_without_a_provider_the_model_gauge_families_are_empty(dm):
    """Before read_model_gauges (a DaemonMetrics on its own) the per-model gauge families are
    exported with their HELP and TYPE, without series."""
    families = {f.name: f for f in dm.registry.collect()}
    for name in m.MODEL_GAUGES:
        assert families[name].type == "gauge" and families[name].samples == [], name
    dm.read_model_gauges(lambda: [m.ModelGauges("a", epochs_waiting=1)])
    assert [s.value for s in {f.name: f for f in dm.registry.collect()}[
        "lpcal_epochs_waiting"].samples] == [1.0]


def test_model_gauges_are_exported_by_one_collector_not_labels_children(dm, registry):
    """The per-model gauge families are the collector's: setting them creates no child of a
    labelled Gauge (what cost a labels() call per model and batch)."""
    from prometheus_client import Gauge

    gauges = {c._name for c in registry._collector_to_names if isinstance(c, Gauge)}
    assert not gauges & set(m.MODEL_GAUGES)
    assert set(m.MODEL_GAUGES) <= set(dm.exported_names())
