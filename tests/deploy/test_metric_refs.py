"""Every metric used by the alert rules and the dashboard is one the daemon exports, and the
dashboard is well-formed with valid PromQL."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from daemon.metrics import METRIC_LABELS, METRIC_NAMES, METRIC_TYPES, family_of

from .common import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "lpcal-dashboard.json"
RULE_FILES = [DEPLOY / "prometheus" / "rules.yaml", DEPLOY / "k8s" / "prometheusrule.yaml"]
METRIC_RE = re.compile(r"\blpcal_[a-z_]+\b")
#: Series the rules use that are not in daemon/metrics.py _SPEC, and who produces them.
EXTERNAL = {
    "up": "Prometheus itself",
    "process_resident_memory_bytes": "the daemon's process collector (prometheus_client)",
    "kube_pod_container_resource_limits": "kube-state-metrics",
}
#: Names PromQL uses that are functions, keywords or label names, not series.
_NOT_SERIES = {"by", "on", "ignoring", "unless", "and", "or", "without", "group_left",
               "group_right", "bool", "offset"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    out = []
    stack = list(dashboard()["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []))
    return out


def rule_exprs() -> list[str]:
    out = []
    for path in RULE_FILES:
        doc = yaml.safe_load(path.read_text())
        groups = doc["spec"]["groups"] if doc.get("kind") == "PrometheusRule" else doc["groups"]
        out.extend(r["expr"] for g in groups for r in g["rules"])
    return out


def referenced(expr: str) -> set[str]:
    """lpcal_* names in ``expr``, histogram/created suffixes mapped to their family."""
    names = set()
    for token in METRIC_RE.findall(expr):
        family = family_of(token)
        assert family is not None, f"unknown metric {token!r} in: {expr}"
        names.add(family)
    return names


def test_metric_regex_and_family_mapping_are_strict():
    with pytest.raises(AssertionError, match="lpcal_not_a_metric"):
        referenced("rate(lpcal_not_a_metric_total[5m])")
    assert referenced("histogram_quantile(0.9, rate(lpcal_fit_duration_seconds_bucket[5m]))") \
        == {"lpcal_fit_duration_seconds"}


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_referenced_metrics_exist(source):
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    assert exprs
    used = set()
    for expr in exprs:
        used |= referenced(expr)
        for bare in re.findall(r"\b(up)\s*\{", expr):
            assert bare in EXTERNAL
    assert used <= METRIC_NAMES


def test_rules_use_only_exported_labels():
    """Label matchers / grouping in the rules name labels the metric has (or target labels)."""
    target_labels = {"job", "instance", "namespace"}
    for expr in rule_exprs():
        for name, matchers in re.findall(r"\b(lpcal_[a-z_]+)\{([^}]*)\}", expr):
            labels = {m.split("=")[0].strip().rstrip("!~") for m in matchers.split(",") if m}
            allowed = set(METRIC_LABELS[family_of(name)]) | target_labels
            assert labels <= allowed, (name, labels - allowed)


def test_dashboard_covers_the_required_views():
    exprs = "\n".join(dashboard_exprs())
    for needed in ["lpcal_calibration_error", "lpcal_pool_fill_ratio", "lpcal_calibrations_total",
                   "lpcal_deadletter_published_total", "lpcal_consumer_lag_messages"]:
        assert needed in exprs, needed
    titles = {p["title"] for p in dashboard()["panels"]}
    assert "Err_p: raw vs calibrated" in titles


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "model"} <= set(variables)
    assert variables["model"]["type"] == "query" and variables["model"]["multi"] is True
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            per_model = referenced(t["expr"]) & {
                n for n, labels in METRIC_LABELS.items() if "model" in labels}
            if per_model:
                assert 'model=~"$model"' in t["expr"], (p["title"], t["expr"])
            if any(METRIC_TYPES[n] in ("counter", "histogram") for n in referenced(t["expr"])):
                assert re.search(r"\b(rate|increase)\(", t["expr"]), t["expr"]


def grafana_to_promql(expr: str) -> str:
    """Substitute the Grafana variables so the expression is plain PromQL."""
    return (expr.replace("$__rate_interval", "5m").replace('"$model"', '".*"')
            .replace('"$job"', '"lpcal"'))


def test_dashboard_queries_are_valid_promql(promtool, tmp_path):
    """promtool parses each query (wrapped as a recording rule)."""
    rules = [{"record": f"lpcal_dashboard:q{i}", "expr": grafana_to_promql(e)}
             for i, e in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (model (lpcal_ready)"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(bad)], check=False, capture_output=True,
                          timeout=120).returncode != 0


def test_exposition_passes_promtool_check_metrics(promtool):
    """promtool's metric linter (naming, _total, base units, HELP) accepts the daemon's
    exposition with every family populated, and rejects a bad one."""
    from prometheus_client import CollectorRegistry

    from daemon.metrics import DaemonMetrics, ModelGauges

    dm = DaemonMetrics(CollectorRegistry(), version="0.0.0-test")
    dm.inc_consumed("predictions", 3)
    dm.inc_invalid("bad_json")
    dm.inc_deadletter()
    dm.inc_joined("m")
    dm.inc_evicted("m", "ttl")
    dm.inc_unmatched("m", "orphan")
    dm.observe_fit("m", "manual", 0.3, 4, 12)
    dm.inc_calibration_failure("m")
    dm.set_binmap_published("m", 1, 1.7e9)
    dm.inc_binmap_rejected("parse")
    dm.read_model_gauges(lambda: [ModelGauges(
        "m", join_pending=2, join_buffer_bytes=10, join_buffer_budget=100, state_bytes=5,
        state_budget=50, epochs_waiting=0, window_samples=100, drift_threshold=0.1,
        drift_change_score=0.2, pools={"mu": (1, 10), "P0": (2, 4)},
        quality={"raw": (0.2, 0.1, 0.5, 0.7)},
        statistics={"raw": {"ece_top": (0.1, 0.01)}})])
    dm.set_consumer_lag("outcomes", 5)
    dm.mark_poll()
    dm.inc_checkpoint("error")
    dm.set_ready(True)
    families = set(dm.exported_names())
    assert families == METRIC_NAMES  # every family is in the linted text
    proc = subprocess.run([promtool, "check", "metrics"], input=dm.exposition(), check=False,
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
    bad = b"# HELP lpcal_x_milliseconds x\n# TYPE lpcal_x_milliseconds counter\n" \
          b"lpcal_x_milliseconds 1\n"
    proc = subprocess.run([promtool, "check", "metrics"], input=bad, check=False,
                          capture_output=True, timeout=60)
    assert proc.returncode != 0 and b"_total" in proc.stdout + proc.stderr


def test_rules_use_only_known_series():
    """Every series a rule selects is the daemon's (_SPEC) or a named external one."""
    for expr in rule_exprs():
        for name in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr):
            if name in _NOT_SERIES or name.startswith("lpcal_"):
                continue
            assert name in EXTERNAL, f"unknown series {name!r} in: {expr}"


def test_the_daemon_exports_the_process_series_the_rules_use():
    """The daemon's own registry (``Daemon`` builds ``DaemonMetrics()`` without one) carries
    the process collector, whose resident memory LpcalMemoryNearLimit reads."""
    from daemon.metrics import DaemonMetrics

    exposition = DaemonMetrics(version="0.0.0-test").exposition().decode()
    assert re.search(r"^process_resident_memory_bytes \d", exposition, re.MULTILINE)
