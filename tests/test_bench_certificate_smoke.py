"""Smoke test of the certificate and eps benchmarks: their quick paths run and their tables
are consistent (no timing assertions; the figures belong to `make bench`)."""

from tests.bench import bench_certificate, bench_eps


def test_certificate_bench_quick_tables():
    cov = bench_certificate.run_coverage(2, 5000)
    assert cov.key == "certificate_coverage" and len(cov.rows) == len(bench_certificate.SETTINGS)
    for share in cov.column("coverage (published)") + cov.column("certified"):
        assert 0.0 <= float(share) <= 1.0
    sel = bench_certificate.run_selection(2)
    assert [r[0] for r in sel.rows] == ["2", "inf", "inf"]


def test_eps_bench_quick_tables():
    ece, auto = bench_eps.run(quick=True)
    assert (ece.key, auto.key) == ("eps_ece", "eps_auto")
    assert ece.column("predictor") == ["raw", "TS", "raw, logits x0.5", "raw, logits x2"]
    for row in auto.rows:  # vacuous iff the raw model's own bound meets the chosen eps
        eps, raw_bound, vacuous = float(row[3]), float(row[6]), row[8]
        if abs(raw_bound - eps) > 1e-4:  # the table rounds the bound to 4 decimals
            assert vacuous == ("yes" if raw_bound <= eps else "no")
