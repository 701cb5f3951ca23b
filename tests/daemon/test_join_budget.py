"""The join buffer's byte budget: the per-entry costs of
:mod:`daemon.join` are upper bounds of what ``tracemalloc`` measures, a store with a budget
stays within it under the worst traffic, and lowered bounds evict the oldest entries."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from daemon import native
from daemon.join import KIND_OUTCOME, KIND_PREDICTION, ROW_SLACK_BYTES, JoinStore

MIB = 1 << 20


def _ids(prefix: str, n: int, length: int) -> list[str]:
    return [f"{prefix}{i}-".ljust(length, "x") for i in range(n)]


def _predictions(store: JoinStore, ids: list[str], k: int, t0: float, batch: int = 500,
                 rng=None) -> None:
    rng = rng or np.random.default_rng(0)
    for s in range(0, len(ids), batch):
        chunk = ids[s:s + batch]
        n = len(chunk)
        store.offer("m", [KIND_PREDICTION] * n, chunk, [t0] * n,
                    rng.dirichlet(np.ones(k), n), [-1] * n)


def _outcomes(store: JoinStore, ids: list[str], t0: float, batch: int = 500) -> None:
    for s in range(0, len(ids), batch):
        chunk = ids[s:s + batch]
        n = len(chunk)
        store.offer("m", [KIND_OUTCOME] * n, chunk, [t0] * n, None, [0] * n)


def _traced(fn) -> tuple[int, object]:
    """Bytes still allocated by ``fn()`` when it returns (its result kept alive)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, out
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("k,id_len", [(10, 36), (10, 256), (100, 36), (1000, 64)])
def test_estimate_bounds_the_measured_memory_of_pending_predictions(k, id_len):
    n = 20_000 if k < 1000 else 2_000
    ids = _ids("p", n, id_len)

    def fill():
        store = JoinStore(10 * n, 3600.0)
        _predictions(store, ids, k, 1000.0)
        return store

    used, store = _traced(fill)
    est = store.memory_bytes("m")
    assert store.pending("m") == n
    assert used <= est, f"measured {used} B > estimate {est} B"
    assert used >= 0.5 * est, f"estimate {est} B is more than twice the measured {used} B"


def test_estimate_bounds_outcomes_and_recent_ids():
    n = 20_000
    ids = _ids("o", n, 256)

    def fill():
        store = JoinStore(10 * n, 3600.0)
        _outcomes(store, ids[: n // 2], 1000.0)              # pending outcomes
        _predictions(store, ids[: n // 4], 10, 1000.0)       # join half of them: recent ids
        return store

    used, store = _traced(fill)
    assert store.pending("m") == n // 4 and len(store._models["m"].recent) == n // 4
    assert used <= store.memory_bytes("m")


def test_blocks_that_keep_few_live_rows_are_compacted():
    """One prediction of each batch of 500 never gets its outcome: without compaction every
    batch's whole block of rows stayed allocated for that one row."""
    k, batch, batches = 200, 500, 40
    ids = _ids("b", batch * batches, 36)

    def fill():
        store = JoinStore(10 ** 6, 3600.0)
        for b in range(batches):
            chunk = ids[b * batch:(b + 1) * batch]
            _predictions(store, chunk, k, 1000.0, batch=batch)
            _outcomes(store, chunk[1:], 1000.0, batch=batch)  # all but the first join
        return store

    used, store = _traced(fill)
    assert store.pending("m") == batches
    rows = store._models["m"].rows.nbytes
    assert rows <= 2 * 8 * k * batches + ROW_SLACK_BYTES, rows
    assert used <= store.memory_bytes("m") + ROW_SLACK_BYTES
    assert used < 4 * MIB  # the 40 uncompacted blocks alone held 40 * 500 * 200 * 8 = 32 MB


@pytest.mark.parametrize("python", [False, True], ids=["native", "pure-python"])
def test_a_budget_holds_under_the_worst_traffic(python):
    """Long ids, wide rows, ids that never match: measured memory stays within the budget,
    and the bounds lowered by it evict the oldest events (counted as capacity)."""
    budget = 8 * MIB
    k = 500
    ids = _ids("w", 12_000, 256)

    def run():
        store = JoinStore(100_000, 3600.0, max_bytes=budget)
        _predictions(store, ids[:6_000], k, 1000.0)
        _outcomes(store, ids[6_000:], 1000.0)  # never match
        return store

    if python:
        with native.pure_python():
            used, store = _traced(run)
    else:
        used, store = _traced(run)
    cap_pending, _cap_recent = store.capacity("m")
    assert cap_pending < 6_000
    assert store.pending("m") <= cap_pending
    assert store.memory_bytes("m") <= budget
    assert used <= budget, f"measured {used} B beyond the budget {budget} B"
    ev = store.stats("m")["evicted"]
    assert ev["capacity"] == 12_000 - store.pending("m")


def test_lower_bounds_evict_the_oldest_and_set_budget_trims():
    store = JoinStore(10_000, 3600.0)
    ids = _ids("t", 4_000, 40)
    _predictions(store, ids, 50, 1000.0)
    assert store.pending("m") == 4_000 and store.capacity("m") == (10_000, 10_000)
    evicted = store.set_budget(1 * MIB)
    cap, _ = store.capacity("m")
    assert evicted == 4_000 - cap and store.pending("m") == cap
    kept = list(store._models["m"].pending)
    assert kept == ids[4_000 - cap:]  # the newest stay
    assert store.memory_bytes("m") <= 1 * MIB
    # a longer id than any before lowers the bounds at once
    res = store.offer("m", [KIND_PREDICTION], ["z" * 4000], [1000.0],
                      np.full((1, 50), 0.02), [-1])
    assert store.capacity("m")[0] < cap
    assert res.evicted["capacity"] >= 1
    assert store.memory_bytes("m") <= 1 * MIB
    assert store.set_budget(None) == 0
    assert store.capacity("m") == (10_000, 10_000)


def test_snapshot_round_trip_keeps_rows_budget_and_reads_the_list_form():
    store = JoinStore(1_000, 60.0, max_bytes=4 * MIB)
    rng = np.random.default_rng(3)
    ids = _ids("s", 300, 30)
    _predictions(store, ids[:200], 7, 10.0, batch=64, rng=rng)
    _outcomes(store, ids[100:300], 10.0, batch=64)
    snap = store.to_dict()
    again = JoinStore.from_dict(snap)
    assert again == store and again.max_bytes == 4 * MIB
    assert again.capacity("m") == store.capacity("m")
    # rows come back exactly: join the pending predictions and compare
    pend = [e for e, (kd, *_r) in store._models["m"].pending.items() if kd == KIND_PREDICTION]
    want = store.offer("m", [KIND_OUTCOME] * len(pend), pend, [11.0] * len(pend), None,
                       [1] * len(pend)).probs
    got = again.offer("m", [KIND_OUTCOME] * len(pend), pend, [11.0] * len(pend), None,
                      [1] * len(pend)).probs
    assert want.shape == (100, 7) and np.array_equal(want, got)
    # the form written before pending_rows: one list of floats per pending prediction
    old = JoinStore.from_dict(snap)
    legacy = old.to_dict()
    md = legacy["models"]["m"]
    flat = np.frombuffer(__import__("base64").b64decode(md.pop("pending_rows")), "<f8")
    rows = flat.reshape(-1, md.pop("k")).tolist()
    it = iter(rows)
    md["pending"] = [[e, kd, d, t, next(it) if kd == KIND_PREDICTION else pl]
                     for e, kd, d, t, pl in md["pending"]]
    legacy.pop("max_bytes")
    assert JoinStore.from_dict(legacy).to_dict()["models"] == old.to_dict()["models"]


def test_corrupt_pending_rows_are_an_input_error():
    store = JoinStore(100, 60.0)
    _predictions(store, _ids("c", 5, 10), 4, 1.0)
    snap = store.to_dict()
    snap["models"]["m"]["pending_rows"] = snap["models"]["m"]["pending_rows"][:-8]
    with pytest.raises(Exception, match="malformed snapshot"):
        JoinStore.from_dict(snap)
    snap = store.to_dict()
    snap["models"]["m"]["pending_rows"] = "%%%"
    with pytest.raises(Exception, match="malformed snapshot"):
        JoinStore.from_dict(snap)


def test_largest_id_size_is_the_largest_getsizeof_of_the_ids():
    """The budget sizes a batch's ids from the longest one when all are ASCII: the very
    ``sys.getsizeof`` of the largest (non-ASCII ids are sized one by one), also for the ids
    the ingest parser makes."""
    import sys

    from daemon.events import EventParser, ModelPolicy
    from daemon.join import largest_str_bytes

    rng = np.random.default_rng(3)
    ascii_ids = ["".join(map(chr, rng.integers(32, 127, int(n))))
                 for n in rng.integers(0, 90, 500)]
    # non-ASCII ids take more bytes than ASCII ones as long: the largest may be a shorter one
    for ids in (ascii_ids, ascii_ids[:1], ["", "a"], ["abcd", "é" * 3], ["ab", "€"],
                ["😀", "x" * 20], ascii_ids + ["é" * 90], ["\x7f" * 70, "x"]):
        assert largest_str_bytes(ids) == max(map(sys.getsizeof, ids)), ids[-1]
    raws = [b'{"model": "m", "id": "%s", "ts": 1.0, "label": 1}' % i.encode()
            for i in ("ev-1", "ev-" + "x" * 80, "ev-22")]
    mb = EventParser(lambda model: ModelPolicy(k=3)).parse_batch(raws).by_model["m"]
    assert largest_str_bytes(mb.ids) == max(map(sys.getsizeof, mb.ids)) == sys.getsizeof(
        "ev-" + "x" * 80)
