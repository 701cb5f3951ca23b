"""Smoke test of the benchmarks: every module imports and runs its ``--quick`` path on tiny inputs.

No timing assertions (timings belong to `make bench`); the tests check that the tables have the
expected rows and well-formed cells, and that the helpers the benchmarks rely on are correct.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lpcal.metrics import brier_true, err_p_true
from tests.bench import bench_apply, bench_fit, bench_quality, bench_variants, run_all
from tests.bench.common import Overconfident, Table, compare, measure


def _ratio(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


def test_fit_quick_tables():
    pools, raw, cert, prof = bench_fit.run(quick=True)
    assert cert.key == "fit_certified" and _ratio(cert.column("default / TS")[0]) > 0
    assert cert.column("selected")[0] in ("precalibrator", "corrected")
    assert prof.key == "profile" and len(prof.rows) > 2
    assert {r[0].split("(")[0] for r in prof.rows} == {"fit", "BinMap.apply"}
    assert pools.key == "fit_pools" and raw.key == "fit_raw"
    # one pool case; its kernel really iterates (the point of the constructed inputs)
    assert [r[0] for r in pools.rows] == [c[0] for c in bench_fit.QUICK_POOL_CASES]
    assert int(pools.column("iters")[0]) > 0
    assert pools.column("setup <= 50 ms")[0] in ("yes", "**NO**")
    # raw grid: 2 (k, n) pairs x 4 (eps, p) pairs, in order
    assert [(r[0], r[2], r[3]) for r in raw.rows] == [
        (str(k), str(eps), p) for k in (10, 100)
        for eps, p in (("0.1", "2"), ("0.1", "inf"), ("0.05", "2"), ("0.05", "inf"))]
    assert all(_ratio(c) > 0 for c in raw.column("fit / R"))
    # the 2x target is judged for k = 100 only
    assert set(raw.column("target <= 2x (k=100)")[:4]) == {"–"}
    assert set(raw.column("target <= 2x (k=100)")[4:]) <= {"yes", "**NO**"}


def test_apply_quick_table():
    lat, batch, vs_r = bench_apply.run(quick=True)
    assert (lat.key, batch.key, vs_r.key) == ("apply_latency", "apply", "apply_r")
    kinds = ["default"] * 3 + ["TS + B", "paper"]
    # one row: three calls of the default map, one of each other map, for k = 10 and 100
    assert [(r[0], r[1]) for r in lat.rows] == [(str(k), m) for k in (10, 100) for m in kinds]
    for col in ("p50 / TS", "p99 / TS"):
        assert all(_ratio(c) > 0 for c in lat.column(col))
    targets = dict(zip(lat.column("map"), lat.column("target p50 <= 2x")))
    assert targets["default"] in ("yes", "**NO**") and targets["paper"] == "–"
    # the default is the certified temperature alone (B empty); the others have bins
    bins = dict(zip(lat.column("map"), lat.column("|B|")))
    assert bins["default"] == "0" and int(bins["TS + B"]) > 0 and int(bins["paper"]) > 0
    assert any("selected precalibrator" in n for n in lat.notes)
    # batches: four variants of the default map, one of each other map, per (k, n)
    variants = ["apply(x)", "check=False", "out=buf", "out=buf, check=False"]
    per_cell = [("default", v) for v in variants] + [("TS + B", "apply(x)"),
                                                     ("paper", "apply(x)")]
    assert [(r[0], r[2], r[4]) for r in batch.rows] == [
        (str(k), m, v) for k, _ in bench_apply._grid(quick=True) for m, v in per_cell]
    assert all(_ratio(c) > 0 for c in batch.column("apply / TS"))
    assert set(batch.column("target <= 1.0x")) <= {"yes", "**NO**", "–"}
    r_variants = ["paper (check, rho outside B)", "check=False", "outside=identity",
                  "prescale=temperature"]
    assert [(r[0], r[4]) for r in vs_r.rows] == [(str(k), v) for k in (10, 100)
                                                  for v in r_variants]
    assert all(_ratio(c) > 0 for c in vs_r.column("apply / R"))
    assert all(int(b) > 0 for b in vs_r.column("|B|"))
    # the full grid covers the apply benchmark's k and n, n * k capped
    full = bench_apply._grid(quick=False)
    assert {k for k, _ in full} == {10, 100, 1000, 10_000}
    assert (10, 10**4) in full and (10, 10**6) in full
    assert all(k * n <= bench_apply.MAX_ELEMENTS for k, n in full)
    # the baseline is temperature scaling: f^(1/T), normalised
    f = np.random.default_rng(0).dirichlet(np.ones(4), size=50)
    e = f ** (1 / 1.5)
    np.testing.assert_allclose(bench_apply.temperature_scaling(f, 1.5),
                               e / e.sum(axis=1, keepdims=True), rtol=1e-12)


def test_quality_quick_table():
    tab, bounds = bench_quality.run(quick=True)
    methods = tab.column("method")
    assert set(tab.column("record")) == {"wideresnet-16-4-cifar-10"}
    assert methods[:2] == ["uncalibrated", "temperature"]
    assert "lpcal paper (eps=0.05, p=inf)" in methods
    assert "lpcal paper+TS+id (eps=0.1, p=2)" in methods
    assert "lpcal paper shared (eps=0.1, p=2)" in methods
    assert "lpcal default (eps=0.05, p=inf)" in methods and "vector scaling" in methods
    assert len(methods) == 2 + 3 + (1 + len(bench_quality.LPCAL_VARIANTS)) * len(
        bench_quality.SETTINGS)
    acc = [float(a) for a in tab.column("accuracy")]
    assert all(0.85 < a < 0.95 for a in acc)  # WideResNet on CIFAR-10: about 0.91
    ece = dict(zip(methods, (float(v) for v in tab.column("top-label ECE"))))
    assert ece["temperature"] < ece["uncalibrated"]
    # the default stays within the quality bounds of temperature scaling on this network
    assert bounds.key == "quality_bounds"
    assert bounds.column("within")[0] == "yes" and bounds.column("certified (seeds)")[0] == "c"


def test_variants_quick_tables():
    var, siz = bench_variants.run(quick=True)
    assert [(r[0], r[1], r[2], r[3]) for r in var.rows] == [
        (str(k), str(eps), "inf" if math.isinf(p) else "2", v)
        for k, eps, p in bench_variants.QUICK_CONFIGS for v in bench_variants.VARIANTS]
    for reasons in var.column("stop reasons"):
        assert reasons and all(r.split()[0] in ("converged", "cycle", "max_iterations")
                               for r in reasons.split(", "))
    # theory sizes are astronomically larger than the practical ones
    for th, pr in zip(siz.column("theory: total"), siz.column("practical: total")):
        assert float(th) > 1e6 * float(pr.replace(",", ""))


def test_run_all_quick_writes_markdown(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert run_all.main(["--quick", "--only", "apply", "--out", str(out)]) == 0
    text = out.read_text()
    assert "python -m tests.bench.run_all --quick --only apply" in text
    assert "### Apply throughput" in text and "| 100 |" in text
    assert "<!-- bench:apply -->" in text and text.count("<!-- /bench:") == 1
    assert "### Apply throughput" in capsys.readouterr().out
    # a second run of another benchmark keeps the first one's section, in BENCHMARKS order
    assert run_all.main(["--quick", "--only", "variants", "--out", str(out)]) == 0
    text2 = out.read_text()
    assert text2.index("<!-- bench:apply -->") < text2.index("<!-- bench:variants -->")
    assert "### Apply throughput" in text2 and text2.count("<!-- /bench:") == 2
    with pytest.raises(SystemExit):
        run_all.main(["--quick", "--only", "nope"])


# ---------------------------------------------------------------- helpers the tables rely on


def test_table_markdown_and_row_width():
    t = Table("T", ["a", "b"], key="t")
    t.add(1, "x|y")
    assert t.to_markdown().splitlines()[2:5] == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]
    with pytest.raises(ValueError):
        t.add(1)
    # a header with a pipe ("|B|") is escaped too, or GitHub does not render the table
    assert Table("T", ["k", "|B|"], key="t").to_markdown().splitlines()[2] == "| k | \\|B\\| |"


def test_timing_helpers_count_repeats():
    calls = []
    tm = measure(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(tm) == 5 and len(calls) == 7 and tm.median >= 0
    c = compare(lambda: sum(range(2000)), lambda: None, repeats=5, warmup=0)
    assert len(c.ratios) == 5 and len(c.candidate) == len(c.baseline) == 5


def test_overconfident_family_is_overconfident_and_its_labels_follow_q():
    task = Overconfident(4, s=2.0, T=0.5, prototypes=5, proto_share=1.0)
    f, y, q = task.sample(3000, seed=0)
    assert err_p_true(q, q, 10, math.inf) == 0.0
    assert err_p_true(f, q, 10, math.inf) > 0.01  # T < 1: f is overconfident
    # the expected Brier score is minimised by the true conditionals
    assert brier_true(q, q) < brier_true(f, q)
    # labels follow q: class frequencies close to the mean of q
    assert np.abs(np.bincount(y, minlength=4) / 3000 - q.mean(axis=0)).max() < 0.04


def test_directions_quick_tables():
    from tests.bench import bench_directions as bd

    real, summ, syn = bd.run(quick=True)
    assert (real.key, summ.key, syn.key) == (
        "directions_real", "directions_real_summary", "directions_synth")
    assert run_all.BENCHMARKS["directions"] is bd
    # one record, every method once, in order (the run itself asserts that its replay of the
    # certified path publishes what lpcal.fit publishes)
    assert real.headers[:2] == ["record", "method"] and "fit ms" in real.headers
    assert set(real.column("record")) == {bd.QUICK_RECORD}
    assert real.column("method") == bd.METHODS == summ.column("method")
    for m in (*bd.METRICS, "fit ms"):
        assert all(math.isfinite(float(v)) for v in real.column(m)), m
    acc = [float(a) for a in real.column("accuracy")]
    assert all(0.85 < a < 0.95 for a in acc)
    sel = dict(zip(real.column("method"), real.column("selected (seeds)")))
    assert sel[bd.M_B] == "R" and sel[bd.M_CORR] == "C" and len(sel[bd.M_DEFAULT]) == 1
    for col in summ.headers[2:7]:
        assert all(math.isfinite(float(v)) for v in summ.column(col)), col
    # synthetic: every case x method; true errors finite; on the class-dependent family
    # temperature scaling fails eps and the default meets it
    n_cases = len(bd.QUICK_SYNTH) + len(bd.QUICK_CD)
    assert syn.column("method") == bd.METHODS * n_cases
    for col in ("true Err_p", "true Brier", "fit s"):
        assert all(math.isfinite(float(v)) for v in syn.column(col)), col
    ok = {(f, m): v for f, m, v in zip(syn.column("family"), syn.column("method"),
                                       syn.column("<= eps"))}
    cd = next(f for f in syn.column("family") if f.startswith("class-dependent"))
    assert ok[(cd, bd.M_TS)] == "**NO**" and ok[(cd, bd.M_DEFAULT)] == "yes"


def test_scale_quick_tables():
    """bench_scale --quick: 1 and 2 replica processes on the embedded broker, then a SIGKILL
    failover over a small state topic (timings not asserted)."""
    from tests.bench import bench_scale

    scale, fail = bench_scale.run(quick=True, log=lambda m: None)
    assert scale.key == "scale" and [r[0] for r in scale.rows] == ["1", "2"]
    assert all(float(c.replace(",", "")) > 0 for c in scale.column("joined samples/s (median)"))
    assert fail.key == "failover" and "bench_scale" in run_all.BENCHMARKS["scale"].__name__
    assert any("SIGKILL" in fail.title for _ in (0,)) and len(fail.rows) >= 6



def test_drift_quick_tables():
    from tests.bench import bench_drift

    det, fa = bench_drift.run(quick=True)
    assert (det.key, fa.key) == ("drift_detection", "drift_false_alarms")
    assert det.column("drift") == ["logits x0.5", "logits x2"]
    assert all("missed" not in c and "before" not in c
               for c in det.column("change test delay (median / max)"))
    assert fa.column("false alarms") == ["0"]
    assert "drift" in run_all.BENCHMARKS


def test_models_quick_tables():
    """bench_models --quick: the daemon at 1 and 20 models against a raw reader on the
    embedded broker, and the bytes per idle model (timings not asserted)."""
    from tests.bench import bench_models

    ingest, idle = bench_models.run(quick=True, log=lambda m: None)
    assert run_all.BENCHMARKS["models"] is bench_models
    assert ingest.key == "models" and idle.key == "models_idle"
    counts = [f"{m:,}" for m in bench_models.QUICK_MODEL_COUNTS]
    # the shipped default (online) at every count, then the epochs rows
    assert ingest.column("models")[1:] == \
        counts + [f'{m}, `recovery = "epochs"` (no fit)' for m in counts]
    assert ingest.column("of 1-model rate")[1] == "1.00"
    assert all(float(c.replace(",", "")) > 0 for c in ingest.column("msgs/s (median)"))
    assert all(float(c) > 0 for c in ingest.column("CPU us / msg, process"))
    assert set(ingest.column("met")) <= {"", "yes", "**NO**"}
    assert idle.column("k") == ["10", "100"]
    heap = [float(c.split()[0].replace(",", "")) for c in idle.column(idle.headers[2])]
    assert all(0 < b < 1 << 20 for b in heap)
