"""Smoke test of the recovery benchmark's quick path: one record, one seed, short streams."""

from tests.bench import bench_recovery


def test_recovery_quick_table():
    (table,) = bench_recovery.run(quick=True)
    assert table.key == "recovery" and len(table.rows) == 1
    row = dict(zip(table.headers, table.rows[0]))
    # the online loop publishes a good map within the short stream, before and after the drift;
    # the fixed schedule cannot (its first epoch needs about 48,000 samples)
    assert row["start: online"] != "never" and row["drift: online"] != "never"
    assert row["start: fixed epochs"] == "never"
    assert int(row["published worse than replaced"]) == 0
