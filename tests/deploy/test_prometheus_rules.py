"""Alert rules: promtool check + unit tests, PrometheusRule == rules.yaml, runbooks, coverage."""

from __future__ import annotations

import re
import subprocess

import yaml

from .common import DEPLOY

RULES = DEPLOY / "prometheus" / "rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "rules_test.yaml"
PROM_RULE = DEPLOY / "k8s" / "prometheusrule.yaml"
README = DEPLOY / "README.md"
REQUIRED_ALERTS = {
    "LpcalCalibrationDrift", "LpcalRecalibrationFailing", "LpcalPoolsNotFilling",
    "LpcalDeadLetterRateHigh", "LpcalConsumerLagHigh", "LpcalDaemonDown",
}


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def run(cmd: list[str], cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_promtool_check_rules(promtool):
    proc = run([promtool, "check", "rules", str(RULES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout + proc.stderr


def test_promtool_unit_tests(promtool):
    proc = run([promtool, "test", "rules", str(RULES_TEST)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_unit_tests_catch_a_broken_rule(promtool, tmp_path):
    """The unit tests are sensitive: a wrong threshold makes them fail."""
    broken = RULES.read_text().replace("> 0.05", "> 0.5")
    assert broken != RULES.read_text()
    (tmp_path / "rules.yaml").write_text(broken)
    (tmp_path / "rules_test.yaml").write_text(RULES_TEST.read_text())
    proc = run([promtool, "test", "rules", "rules_test.yaml"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "LpcalDeadLetterRateHigh" in proc.stdout + proc.stderr


def test_required_alerts_exist_with_severity_and_for():
    by_name = {a["alert"]: a for a in alerts()}
    assert REQUIRED_ALERTS <= set(by_name)
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert re.fullmatch(r"\d+[mh]", rule.get("for", "")), f"{name}: needs a for: duration"
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
    assert by_name["LpcalCalibrationDrift"]["for"] == "15m"
    drift = by_name["LpcalCalibrationDrift"]["expr"]  # the change test, not Err_p vs eps
    assert "lpcal_drift_change_score" in drift and "lpcal_drift_threshold" not in drift
    down = by_name["LpcalDaemonDown"]["expr"]
    assert "up{job=" in down and "absent(up{job=" in down


def github_anchor(heading: str) -> str:
    """GitHub's heading slug: lower-case, drop punctuation except - and _, spaces -> -."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_alert_has_a_runbook_section():
    headings = re.findall(r"^#{1,6} (.+)$", README.read_text(), re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    for rule in alerts():
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("https://") and "deploy/README.md#" in url, url
        anchor = url.rsplit("#", 1)[1]
        assert anchor == rule["alert"].lower()
        assert anchor in anchors, f"deploy/README.md has no section for {rule['alert']}"


def test_prometheusrule_groups_equal_the_rules_file():
    pr = yaml.safe_load(PROM_RULE.read_text())
    assert pr["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_each_alert_is_tested_firing_and_not_firing():
    tests = yaml.safe_load(RULES_TEST.read_text())
    assert tests["rule_files"] == ["rules.yaml"]
    firing, quiet = set(), set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {a["alert"] for a in alerts()}
    assert firing == names, f"alerts never shown firing: {names - firing}"
    assert quiet == names, f"alerts never shown quiet: {names - quiet}"
