"""daemon.join: either arrival order, bounds, TTL, stragglers, determinism, snapshots."""

from __future__ import annotations

import contextlib
import itertools
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import native
from daemon.join import KIND_OUTCOME as O
from daemon.join import KIND_PREDICTION as P
from daemon.join import KIND_SAMPLE as S
from daemon.join import JoinStore
from lpcal.errors import InputError

K = 3


def row(i: int) -> list[float]:
    a = np.array([i % 7 + 1.0, 2.0, 3.0])
    return (a / a.sum()).tolist()


def offer(store, events, model="m", now=None):
    """events: list of (kind, id, ts, label)."""
    kind = [e[0] for e in events]
    ids = [e[1] for e in events]
    ts = [float(e[2]) for e in events]
    labels = [e[3] if e[0] != P else -1 for e in events]
    probs = np.array([row(int(e[1][1:])) if e[0] != O else [0.0] * K for e in events],
                     dtype=np.float64).reshape(len(events), K)
    return store.offer(model, kind, ids, ts, probs, labels, now)


def test_join_in_either_order():
    s = JoinStore(100, 60)
    r1 = offer(s, [(P, "e1", 0, None), (O, "e2", 1, 2)])
    assert len(r1) == 0 and s.pending("m") == 2
    r2 = offer(s, [(O, "e1", 5, 1), (P, "e2", 6, None)])
    assert r2.ids == ["e1", "e2"]
    assert r2.labels.tolist() == [1, 2]
    assert np.array_equal(r2.probs, np.array([row(1), row(2)]))
    assert r2.ts.tolist() == [5.0, 6.0]
    assert s.pending("m") == 0 and s.stats("m")["joined"] == 2


def test_join_within_one_batch_and_complete_samples():
    s = JoinStore(100, 60)
    r = offer(s, [(O, "e1", 0, 0), (S, "e5", 1, 2), (P, "e1", 2, None)])
    assert r.ids == ["e5", "e1"] and r.labels.tolist() == [2, 0]
    assert np.array_equal(r.probs, np.array([row(5), row(1)]))


def test_duplicates_and_late_events():
    s = JoinStore(100, 60)
    offer(s, [(P, "e1", 0, None), (P, "e1", 1, None)])           # duplicate prediction
    offer(s, [(O, "e2", 0, 1), (O, "e2", 1, 1)])                  # duplicate outcome
    r = offer(s, [(O, "e1", 2, 1), (O, "e1", 3, 1), (P, "e1", 4, None), (S, "e1", 5, 1)])
    assert r.ids == ["e1"]
    # second outcome after the join: late; prediction and sample after the join: duplicates
    assert r.unmatched == {"late": 1, "duplicate": 2, "orphan": 0}
    st_ = s.stats("m")
    assert st_["unmatched"] == {"late": 1, "duplicate": 4, "orphan": 0}
    assert st_["pending"] == 1  # e2's outcome


def test_ttl_eviction_orphans_and_late_partner():
    s = JoinStore(100, ttl_seconds=10)
    offer(s, [(P, "e1", 0, None), (O, "e2", 1, 0)])
    # the watermark is min(predictions 10.5, outcomes 10.5) = 10.5 > 0 + 10: e1 expires
    r = offer(s, [(P, "e3", 10.5, None), (O, "x3", 10.5, 0)])
    assert r.evicted == {"ttl": 1, "capacity": 0} and s.pending("m") == 3
    r = offer(s, [(P, "e4", 11.5, None), (O, "x4", 11.5, 0)])   # e2 (outcome) expires: orphan
    assert r.evicted["ttl"] == 1 and r.unmatched["orphan"] == 1
    r = offer(s, [(O, "e1", 12, 1), (P, "e2", 12, None)])
    assert len(r) == 0 and r.unmatched["late"] == 2   # partners arrive after expiry
    assert s.stats("m")["evicted"] == {"ttl": 2, "capacity": 0}


def test_one_stream_ahead_does_not_expire_pairs():
    """A backlog: the outcomes topic is read far ahead of the predictions topic. Event time on
    one stream alone must not expire predictions whose outcomes are already pending."""
    s = JoinStore(100, ttl_seconds=10)
    r = offer(s, [(O, f"e{i}", 100 + i, i % 3) for i in range(50)])   # outcomes, t = 100..149
    assert len(r) == 0 and r.evicted["ttl"] == 0 and s.pending("m") == 50
    r = offer(s, [(P, f"e{i}", float(i), None) for i in range(50)])   # predictions, t = 0..49
    assert len(r) == 50 and r.evicted["ttl"] == 0 and s.pending("m") == 0
    # both streams past a pending prediction's deadline: it expires
    offer(s, [(P, "e900", 150, None)])
    r = offer(s, [(P, "e901", 161, None), (O, "e902", 161, 0)])
    assert r.evicted["ttl"] == 1 and s.stats("m")["unmatched"]["orphan"] == 0


def test_watermarks_survive_snapshots():
    s = JoinStore(100, ttl_seconds=10)
    offer(s, [(P, "e1", 5, None), (O, "e2", 3, 1)])
    t = JoinStore.from_dict(s.to_dict())
    assert t.wm == s.wm == [5.0, 3.0] and t.clock == s.clock == 3.0 and t == s


def test_explicit_clock_and_advance():
    s = JoinStore(100, ttl_seconds=10)
    offer(s, [(P, "e1", 1e9, None)], now=0.0)   # processing time: event ts ignored for expiry
    assert offer(s, [(P, "e2", 0, None)], now=5.0).evicted["ttl"] == 0
    r = s.advance(10.5)
    assert r.evicted["ttl"] == 1 and s.pending("m") == 1
    s.advance(3.0)  # the clock never goes back
    assert s.clock == 10.5


def test_capacity_evicts_oldest():
    s = JoinStore(max_pending_per_model=3, ttl_seconds=100)
    r = offer(s, [(P, f"e{i}", i, None) for i in range(5)])
    assert r.evicted == {"ttl": 0, "capacity": 2} and s.pending("m") == 3
    r = offer(s, [(O, "e0", 6, 1), (O, "e4", 6, 1)])
    assert r.ids == ["e4"] and r.unmatched["late"] == 1
    other = offer(s, [(P, "e0", 0, None)], model="other")   # the bound is per model
    assert other.evicted["capacity"] == 0 and s.pending() == 3


def test_recent_set_is_bounded():
    s = JoinStore(10, 100, recent_per_model=2)
    offer(s, [(S, f"e{i}", i, 1) for i in range(3)])
    r = offer(s, [(O, "e0", 3, 1), (O, "e2", 3, 1)])
    # e0 was forgotten (pending now), e2 is recent (late)
    assert r.unmatched["late"] == 1 and s.pending("m") == 1


def test_input_validation():
    s = JoinStore(10, 10)
    with pytest.raises(InputError):
        s.offer("m", [P], ["a", "b"], [0.0], np.zeros((1, 3)), [-1])
    with pytest.raises(InputError):
        JoinStore(0, 10)
    with pytest.raises(InputError):
        JoinStore(10, float("inf"))


# ----------------------------------------------------------------------------- determinism

stream = st.lists(
    st.tuples(st.sampled_from([P, O, O, S]), st.integers(0, 25), st.floats(0, 3),
              st.integers(0, 2)),
    min_size=1, max_size=40,
)


def _materialise(raw):
    t, out = 0.0, []
    for kind, i, dt, lab in raw:
        t += dt
        out.append((kind, f"{'s' if kind == S else 'e'}{i}", t, lab))
    return out


def _run(events, cuts, snapshot_at=None):
    s = JoinStore(max_pending_per_model=6, ttl_seconds=4.0, recent_per_model=8)
    joined = []
    bounds = [0] + sorted(set(cuts)) + [len(events)]
    for n_batch, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a == b:
            continue
        r = offer(s, events[a:b])
        joined += list(zip(r.ids, r.labels.tolist(), r.ts.tolist(),
                           map(tuple, r.probs.tolist())))
        if snapshot_at == n_batch:
            s = JoinStore.from_dict(orjson.loads(orjson.dumps(s.to_dict())))
    return joined, s.to_dict()


@settings(max_examples=80, deadline=None)
@given(stream, st.lists(st.integers(0, 60), max_size=6), st.integers(0, 6))
def test_event_time_join_is_independent_of_batching_and_snapshots(raw, cuts, snap):
    events = _materialise(raw)
    ref_joined, ref_state = _run(events, [])
    joined, state = _run(events, [c for c in cuts if c < len(events)], snapshot_at=snap)
    assert joined == ref_joined
    assert state == ref_state
    # conservation: every offered event is in exactly one place: a joined pair (2 events), a
    # joined complete sample (1), pending, dropped as duplicate/late, or evicted (ttl/capacity)
    m = ref_state["models"]["m"]
    n_samples = sum(1 for j in ref_joined if j[0].startswith("s"))
    n_pairs = len(ref_joined) - n_samples
    accounted = (2 * n_pairs + n_samples + len(m["pending"]) + m["unmatched"]["duplicate"]
                 + m["unmatched"]["late"] + m["evicted"]["ttl"] + m["evicted"]["capacity"])
    assert accounted == len(events)
    assert m["unmatched"]["orphan"] <= m["evicted"]["ttl"]


def test_snapshot_round_trip_is_exact():
    s = JoinStore(50, 30)
    offer(s, [(P, "e1", 0, None), (O, "e2", 1, 1), (S, "e3", 2, 0), (P, "e4", 3, None)])
    offer(s, [(P, "e9", 0, None)], model="other")
    d = orjson.loads(orjson.dumps(s.to_dict()))
    s2 = JoinStore.from_dict(d)
    assert s2 == s and s2.to_dict() == s.to_dict()
    r1 = offer(s, [(O, "e1", 4, 2), (P, "e2", 4, None)])
    r2 = offer(s2, [(O, "e1", 4, 2), (P, "e2", 4, None)])
    assert r1.ids == r2.ids and np.array_equal(r1.probs, r2.probs)


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d.pop("ttl"), "ttl"),
    (lambda d: d["models"]["m"]["pending"][0].__setitem__(1, 9), "kind"),
    (lambda d: d["models"]["m"]["recent_ids"].append("e3"), "twice"),
    (lambda d: d["models"]["m"]["recent_ids"].append(7), "recent_ids"),
    (lambda d: d["models"]["m"]["recent_expired"].append(5), "out of range"),
    (lambda d: d["models"]["m"].pop("recent_expired"), "recent_expired"),
    (lambda d: d["models"]["m"]["evicted"].pop("ttl"), "ttl"),
])
def test_malformed_snapshot_raises_input_error(mutate, where):
    s = JoinStore(50, 30)
    offer(s, [(P, "e1", 0, None), (S, "e3", 2, 0)])
    d = s.to_dict()
    mutate(d)
    with pytest.raises(InputError, match="malformed snapshot"):
        JoinStore.from_dict(d)


def _store_with_expired_ids() -> JoinStore:
    s = JoinStore(50, 5)
    offer(s, [(P, "e1", 0, None), (O, "e2", 0, 1), (S, "e3", 0, 2)])
    offer(s, [(P, "e4", 100, None), (O, "e5", 100, 2)])  # watermark 100: e1, e2 expire
    return s


def test_snapshot_keeps_expired_and_joined_recent_ids_in_order():
    s = _store_with_expired_ids()
    m = s.to_dict()["models"]["m"]
    assert m["recent_ids"] == ["e3", "e1", "e2"]
    assert m["recent_expired"] == [1, 2]
    s2 = JoinStore.from_dict(orjson.loads(orjson.dumps(s.to_dict())))
    assert s2 == s
    # stragglers are classified alike: late outcome of an expired id, duplicate of a joined one
    for store in (s, s2):
        r = offer(store, [(O, "e1", 101, 0)])
        r2 = offer(store, [(S, "e3", 101, 0)])
        assert not len(r) and r.unmatched["late"] == 1
        assert not len(r2) and r2.unmatched["duplicate"] == 1


def test_snapshot_of_the_previous_format_restores_the_same_store():
    """Checkpoints written before ``recent_ids`` list ``recent`` as ``[id, state]`` pairs."""
    s = _store_with_expired_ids()
    d = s.to_dict()
    m = d["models"]["m"]
    expired = set(m.pop("recent_expired"))
    m["recent"] = [[eid, int(i in expired)] for i, eid in enumerate(m.pop("recent_ids"))]
    assert m["recent"] == [["e3", 0], ["e1", 1], ["e2", 1]]
    assert JoinStore.from_dict(d) == s
    m["recent"].append(["x", 7])
    with pytest.raises(InputError, match="recent state"):
        JoinStore.from_dict(d)


# ----------------------------------------------------------------------------- both loops
needs_c = pytest.mark.skipif(native.KERNELS.offer_loop is None, reason="C join loop not built")


def _both(store_args: tuple, kw: dict, script) -> tuple[JoinStore, JoinStore]:
    """``script(store)`` run with the C join loop and with the Python loop (its reference);
    the two stores, after asserting that every result was the same."""
    c, py = JoinStore(*store_args, **kw), JoinStore(*store_args, **kw)
    got = script(c)
    with native.pure_python():
        want = script(py)
    assert got == want
    return c, py


one_kind_batches = st.lists(
    st.tuples(st.sampled_from([P, O, S]),
              st.lists(st.tuples(st.integers(0, 30), st.floats(0, 2), st.integers(0, 2)),
                       min_size=1, max_size=12)),
    min_size=1, max_size=10,
)


@needs_c
@pytest.mark.parametrize("blocks", [2, 8, 9, 20])
def test_outcomes_over_many_earlier_blocks_gather_the_same_rows_in_c_and_python(blocks):
    """Outcomes whose predictions came in many earlier batches (each batch's pending rows are
    one block), in an order that cycles over the blocks: the C loop groups rows by block
    (searching its newest groups) and gathers the same rows, in the same order, as the Python
    reference, also past the number of groups it searches."""
    per = 5

    def script(store):
        out = []
        for b in range(blocks):
            offer(store, [(P, f"e{b * per + i}", float(b), -1) for i in range(per)])
        # outcome j of the cycle: the j-th prediction of every block in turn
        events = [(O, f"e{b * per + i}", float(blocks), (b + i) % K)
                  for i in range(per) for b in range(blocks)]
        r = offer(store, events)
        out.append((r.ids, r.labels.tolist(), r.probs.tolist(), store.to_dict()))
        return out

    _both((10_000, 100.0), {}, script)
    want = [row(b * per + i) for i in range(per) for b in range(blocks)]
    assert script(JoinStore(10_000, 100.0))[0][2] == want


@needs_c
@settings(max_examples=150, deadline=None)
@given(one_kind_batches, st.integers(1, 6))
def test_one_kind_batches_join_alike_in_c_and_python(batches, recent):
    """Single-kind batches (a partition of one input topic: the common case, incl. forgetting
    from a small recent set) join exactly alike in the C loop and its Python reference: same
    samples, counters and state after every batch."""
    def script(store):
        out, t = [], 0.0
        for kind, evs in batches:
            events = []
            for i, dt, lab in evs:
                t += dt
                events.append((kind, f"e{i}", t, lab))
            r = offer(store, events)
            out.append((r.ids, r.labels.tolist(), r.ts.tolist(), r.probs.tolist(), r.evicted,
                        r.unmatched, store.to_dict()))
        return out

    _both((40, 5.0), {"recent_per_model": recent}, script)


@pytest.mark.parametrize("path", ["c", "python"])
def test_recent_ids_forgotten_oldest_first(path):
    if path == "c" and native.KERNELS.offer_loop is None:
        pytest.skip("C join loop not built")
    s = JoinStore(100, 100, recent_per_model=3)
    with native.pure_python() if path == "python" else contextlib.nullcontext():
        offer(s, [(S, f"s{i}", i, 0) for i in range(5)])        # s0, s1 forgotten
        offer(s, [(S, f"s{i}", 6, 1) for i in (5, 6)])
    assert s.to_dict()["models"]["m"]["recent_ids"] == ["s4", "s5", "s6"]


def test_queue_of_joined_entries_stays_bounded_behind_a_straggler():
    """Joined entries leave the arrival queue lazily; an old entry that keeps waiting must not
    let them pile up (compaction), and order, expiry and snapshots stay exact."""
    s = JoinStore(100_000, 1e9)
    offer(s, [(P, "e0", 0, None)])                      # never gets its outcome (until the end)
    for b in range(12):
        ids = [f"e{b * 1000 + i + 1}" for i in range(1000)]
        offer(s, [(P, i, b + 1, None) for i in ids])
        r = offer(s, [(O, i, b + 1.5, 1) for i in ids])
        assert len(r) == 1000
        q = s._models["m"].queue
        assert s.pending("m") == 1 and len(q) <= 2 * 1 + 1024 + 1000
    snap = s.to_dict()
    assert [p[0] for p in snap["models"]["m"]["pending"]] == ["e0"]
    assert JoinStore.from_dict(orjson.loads(orjson.dumps(snap))) == s
    r = offer(s, [(O, "e0", 20, 2)])
    assert r.ids == ["e0"] and r.labels.tolist() == [2] and s.pending("m") == 0
    assert np.array_equal(r.probs, np.array([row(0)]))


def test_capacity_evicts_oldest_pending_not_joined_ones():
    """With joined entries still queued ahead of it, the oldest *pending* entry is evicted."""
    s = JoinStore(3, 1e9)
    offer(s, [(P, "e1", 0, None), (P, "e2", 1, None), (P, "e3", 2, None)])
    offer(s, [(O, "e1", 3, 0)])                          # e1 joined: its queue slot is dead
    r = offer(s, [(P, "e4", 4, None), (P, "e5", 5, None)])
    assert r.evicted["capacity"] == 1                    # e2 went, not the joined e1
    assert [p[0] for p in s.to_dict()["models"]["m"]["pending"]] == ["e3", "e4", "e5"]
    r = offer(s, [(O, "e2", 6, 1)])
    assert len(r) == 0 and r.unmatched["late"] == 1      # e2 was remembered as expired


# ----------------------------------------------------------------------------- dict layout
def _entry_bytes(d: dict) -> int | None:
    """Bytes per entry of ``d``'s key table (16: compact all-str layout, 24: hashes kept), from
    CPython's dict size (object, keys header, ``2**L`` index slots of 1 to 8 bytes, ``2/3`` of
    them as entries); None when no table size fits (another implementation)."""
    size = sys.getsizeof(d)
    base = sys.getsizeof({"a": 1}) - 8 - 5 * 16  # a one-key dict: 8 one-byte slots, 5 entries
    for log2 in range(3, 40):
        slots = 1 << log2
        ix = 1 if log2 < 8 else 2 if log2 < 16 else 4 if log2 < 32 else 8
        for entry in (16, 24):
            if base + slots * ix + (2 * slots // 3) * entry == size:
                return entry
    return None


def _keeps_hashes(d: dict) -> bool:
    return _entry_bytes(d) == 24


def _compact_dicts(store: JoinStore) -> JoinStore:
    """``store`` with its models' ``pending`` and ``recent`` as compact all-str dicts (the
    layout before :func:`daemon.join_loop.hashed_dict`), same items in the same order."""
    for m in store._models.values():
        m.pending = {k: v for k, v in m.pending.items()}
        m.recent = {k: v for k, v in m.recent.items()}
    return store


def _mixed_script(store: JoinStore) -> list:
    """Predictions, their outcomes a batch later, duplicates, stragglers and evictions (small
    recent set and pending bound), with the snapshot bytes after every batch."""
    out = []
    for b in range(12):
        preds = [(P, f"x{b * 300 + i}", b * 10.0 + i / 100, 0) for i in range(300)]
        outs = [(O, f"x{(b - 1) * 300 + i}", b * 10.0 + i / 100, i % K)
                for i in range(0, 300, 2)] if b else []
        extra = [(O, "x5", b * 10.0, 1), (P, f"x{b * 300}", b * 10.0, 0)]
        for events in (preds, outs + extra):
            if events:
                r = offer(store, events)
                out.append((r.ids, r.labels.tolist(), r.ts.tolist(), r.probs.tolist(),
                            r.evicted, r.unmatched, orjson.dumps(store.to_dict())))
    return out


def _general_dict() -> dict:
    d = {None: 1, "a": 1}  # a non-str key: the general layout, kept after it leaves
    del d[None]
    return d


dict_layout = pytest.mark.skipif(
    _entry_bytes({"a": 1, "b": 2}) != 16 or _entry_bytes(_general_dict()) != 24,
    reason="not CPython's dict layout")


@dict_layout
@pytest.mark.parametrize("path", ["c", "python"])
def test_join_dicts_keep_hashes_through_offers_and_restores(path):
    """``pending`` and ``recent`` keep their keys' hashes (cheaper lookups of absent ids)
    after offers, evictions and both snapshot formats, and hold only ids, in recent order."""
    if path == "c" and native.KERNELS.offer_loop is None:
        pytest.skip("C join loop not built")
    with native.pure_python() if path == "python" else contextlib.nullcontext():
        s = JoinStore(2_000, 25.0, recent_per_model=1_500)
        _mixed_script(s)
    d = s.to_dict()
    old = orjson.loads(orjson.dumps(d))
    md = old["models"]["m"]
    expired = set(md.pop("recent_expired"))
    md["recent"] = [[e, int(i in expired)] for i, e in enumerate(md.pop("recent_ids"))]
    for store in (s, JoinStore.from_dict(orjson.loads(orjson.dumps(d))), JoinStore.from_dict(old)):
        m = store._models["m"]
        assert len(m.pending) > 500 and len(m.recent) == 1_500
        assert _keeps_hashes(m.pending) and _keeps_hashes(m.recent)
        assert None not in m.recent and None not in m.pending
        assert list(m.recent) == list(m.recent_order)
        assert store == s


@dict_layout
@needs_c
def test_hashed_dicts_join_bit_identically_to_compact_ones_in_c_and_python():
    """The same script on stores with hash-keeping dicts (C loop, Python loop) and with the
    compact dicts of before: the same samples, counts and snapshot bytes after every batch."""
    def compact_script(store):
        store._model("m")  # created before its first offer, to be given compact dicts
        _compact_dicts(store)
        return _mixed_script(store)

    args = ((2_000, 25.0), {"recent_per_model": 1_500})
    c, _py = _both(*args, _mixed_script)
    ref = JoinStore(*args[0], **args[1])
    with native.pure_python():
        want = compact_script(ref)
    assert not _keeps_hashes(ref._models["m"].recent)
    assert _mixed_script(JoinStore(*args[0], **args[1])) == want
    assert c == ref
