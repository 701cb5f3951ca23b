"""``make demo`` (daemon.tools.demo): its configuration, its quality verdict, and its main path
in reduced form on the embedded broker (one drifting model, a shorter change-test baseline)."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest

from daemon.settings import load_settings
from daemon.tools import demo
from daemon.tools.demo_quality import TS_BOUNDS, FreshSamples, verdict
from daemon.tools.simulate.model import SyntheticModel

TOP = "top-label ECE (15 eq-width)"


def test_config_sets_online_recovery_and_the_baseline_per_plan(tmp_path):
    plan = demo.Plan(drift_baseline_samples=3000)
    text = demo.daemon_config("127.0.0.1:1", 8080, plan)
    parsed = tomllib.loads(text)
    assert {m: parsed["models"][m]["recovery"] for m in parsed["models"]} == {
        "fraud-v3": "online", "churn-v1": "online"}
    (tmp_path / "demo.toml").write_text(text)
    s = load_settings(tmp_path / "demo.toml")
    for m in plan.models:
        ms = s.model_settings(m.model_id)
        assert ms.recovery == "online" and ms.drift_baseline_samples == 3000
        assert (ms.k, ms.eps, ms.p) == (m.k, m.eps, m.p)


def test_quality_verdict_uses_the_ts_bounds():
    synth = SyntheticModel("m", 3, 0.3, 5.0, seed=2)
    fresh = FreshSamples.draw(synth, 20_000, ts_n=20_000)
    cols = fresh.columns({"ideal": lambda f: f ** 0.3 / (f ** 0.3).sum(axis=1, keepdims=True),
                          "raw again": lambda f: f}, lam=10, p=math.inf)
    assert cols["ideal"]["TRUE Err_p (known q)"] == pytest.approx(0.0, abs=1e-12)
    assert verdict(cols["raw"], cols["TS"], cols["ideal"]) == (True, True)
    assert verdict(cols["raw"], cols["TS"], cols["raw again"]) == (False, False)
    worse = dict(cols["ideal"], **{TOP: cols["TS"][TOP] + TS_BOUNDS[TOP] + 1e-4})
    assert verdict(cols["raw"], cols["TS"], worse) == (True, False)


REDUCED = demo.Plan(
    models=(demo.DemoModel("fraud-v3", 3, 0.25, 8.0, 1.0, 0.05, math.inf),),
    drift_baseline_samples=2000, rate=3000.0, fresh=10_000,
    budget_seconds=150.0, repair_samples=15_000, seed=5)


@pytest.mark.integration
@pytest.mark.slow
def test_demo_main_path_reduced():
    """The whole loop on the embedded broker: first map, drift, the change test's alarm from
    /metrics, the repair on post-drift samples, signed maps, graceful shutdown."""
    lines: list[str] = []
    out = demo.run(REDUCED, say=lines.append)
    text = "\n".join(lines)
    assert out.ok, f"{out.missing}\n{text}"
    first, sw, repair = out.first_map, out.switch, out.repair
    assert first.bm.version == 1 and first.bm.temperature == pytest.approx(4.0, rel=0.15)
    # the switch waited for the live map's baseline, and came before the repair
    assert sw.labelled_before >= first.joined + REDUCED.drift_baseline_samples
    assert 0 <= out.detected_since <= out.first_repair_since <= out.repair_since
    assert sw.live_version < out.first_repair.bm.version <= repair.bm.version
    assert "trigger drift" in text   # the first map after the alarm is counted as the drift's
    assert repair.bm.version > sw.live_version
    # the repair is fitted on drifted samples only: the truth is T / s = 0.25 / 0.5
    assert repair.bm.temperature == pytest.approx(2.0, rel=0.15)
    cols = out.repair_columns
    live, fixed = (f"v{sw.live_version} (live)", f"v{repair.bm.version} (repair)")
    assert cols[fixed][TOP] < cols[live][TOP] - 0.05
    assert "signed by key id" in text and "verified" in text
    assert "daemon stopped on SIGTERM" in text and "(exit 0)" in text
    assert ("DRIFT DETECTED" in text) == (out.detected_by == "score")
    assert np.isfinite(out.detected_seconds)
