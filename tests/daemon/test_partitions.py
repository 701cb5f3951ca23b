"""The per-partition state (:mod:`daemon.partitions`): one object per input partition number,
released as a whole on revocation."""

from __future__ import annotations

from aiokafka import TopicPartition

from daemon.partitions import PartitionTable

P, O = "preds", "outs"


def tps(*parts: int) -> set[TopicPartition]:
    return {TopicPartition(t, p) for p in parts for t in (P, O)}


def test_assign_returns_the_new_partitions_and_keeps_the_state_of_kept_ones():
    table = PartitionTable(refetch=True, grace_seconds=2.0)
    assert table.assign(tps(0, 1)) == tps(0, 1)
    table.ensure(0).seek(P, 7)
    assert table.assign(tps(0, 2)) == tps(2)       # 0 kept, 2 new, 1 gone
    assert table.numbers() == {0, 2} and table.position(P, 0) == 7
    assert table.position(O, 0) is None and table.position(P, 5) is None


def test_release_drops_positions_gap_guard_paused_and_sampled_of_revoked_partitions():
    table = PartitionTable(refetch=True, grace_seconds=2.0)
    table.assign(tps(0, 1))
    for n in (0, 1):
        ps = table.ensure(n)
        ps.seek(P, 10 * (n + 1))
        ps.sample("m", 0.5)
        ps.gaps.check(P, 0, 5, 9, 5, lambda: [5, 6, 7, 8, 9], 0.0)  # a hole at 0..4: open
        assert ps.gaps.open_holes == 1
    table.set_paused({1})
    assert table.paused() == {1}
    assert table.release(tps(1)) == {1}
    assert table.assigned == tps(0) and 1 not in table and table.paused() == set()
    kept = table.get(0)
    assert (kept.positions, kept.sampled, kept.gaps.open_holes) == ({P: 10}, {"m": 0.5}, 1)
    fresh = table.ensure(1)  # reassigned later: starts from nothing
    assert (fresh.positions, fresh.sampled, fresh.paused, fresh.gaps.open_holes) == (
        {}, {}, False, 0)


def test_sample_records_only_rates_below_one_and_set_paused_is_exact():
    table = PartitionTable(refetch=False, grace_seconds=0.0)
    ps = table.ensure(3)
    ps.sample("full", 1.0)
    ps.sample("hot", 0.01)
    assert ps.sampled == {"hot": 0.01}
    table.set_paused({3, 4})
    assert table.paused() == {3, 4}
    table.set_paused({4})
    assert table.paused() == {4} and not table.get(3).paused
