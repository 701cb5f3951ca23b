"""Smoke test of the recovery benchmark's quick path: one record, one seed, short streams."""

from tests.bench import bench_recovery


def test_recovery_quick_table():
    table, state = bench_recovery.run(quick=True)
    assert table.key == "recovery" and len(table.rows) == 1
    row = dict(zip(table.headers, table.rows[0]))
    # the online loop publishes a good map within the short stream, before and after the drift;
    # the fixed schedule cannot (its first epoch needs about 48,000 samples)
    assert row["start: online"] != "never" and row["drift: online"] != "never"
    assert row["start: fixed epochs"] == "never"
    assert int(row["published worse than replaced"]) == 0
    # the state's bytes: test-share and certification samples, against a fixed epoch
    b = dict(zip(state.headers, state.rows[0]))
    assert state.key == "recovery" and len(state.rows) == 1
    mb = {h: float(v.split()[0]) for h, v in b.items() if v.endswith(" MB")}
    assert 0 < mb["of which test-share samples"] < mb["online state"]
    assert 0 < mb["of which certification samples"] < mb["online state"]
    # the certification samples: 18% of the newest 20 buckets (3,600), the test share's
    # 12% of the newest 10 (1,200), 8 k + 8 bytes each
    test_n, cert_n = (int(v.replace(",", "")) for v in b["samples kept (test / certification)"]
                      .split(" / "))
    assert 3_100 < cert_n < 4_100 and 900 < test_n < 1_500
    assert abs(mb["of which certification samples"] * 1e6 - cert_n * 88) < 0.006e6
