"""Smoke test of the families benchmark's quick path: the TS-fixable family, one seed, through
the daemon's model state with the online loop."""

import math

from tests.bench import bench_families


def test_families_quick_table():
    (table,) = bench_families.run(quick=True)
    assert table.key == "families" and len(table.rows) == 1
    row = dict(zip(table.headers, table.rows[0]))
    assert row["family"] == "tempered"
    # a certified map with true Err_p <= eps within the short stream, and no certificate that
    # missed the truth
    first = row["online: first certified, true Err_p <= eps"]
    assert not first.startswith(">") and int(first.split()[0].replace(",", "")) <= 15_000
    assert int(row["certified with true Err_p > eps"]) == 0
    assert float(row["true Err_p of that map"]) <= bench_families.EPS


def test_a_stream_reports_the_certified_map_and_the_baseline():
    r = bench_families.run_stream("tempered", 1)
    assert r["first"] is not None and r["first_true"] <= bench_families.EPS
    assert r["ts_first"] is not None and r["published"] >= 1
    assert r["detected"] is None            # stationary: the change test stays quiet
    assert math.isfinite(r["last_true"])
