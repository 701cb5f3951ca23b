"""The checkpoint format ``lpcal.model_state/6`` (/5's packed count tables, plus packed monitor
sums and loss grids, empty parts left out): the encode cache, the older formats it still reads,
and corrupt or truncated checkpoints rejected with a reason."""

from __future__ import annotations

import base64
import gzip
import hashlib
from pathlib import Path

import numpy as np
import orjson
import pytest

from daemon.model_state import CheckpointCache, ModelState
from lpcal.errors import ArtifactError, InputError
from lpcal.online import OnlineConfig
from lpcal.pools import (
    MEMO_MIN_PAIRS,
    CountTable,
    PoolSet,
    pack_arrays,
    tables_from_rows,
    unpack_arrays,
)
from tests.daemon.test_model_state import (
    CERTIFIED,
    MODEL,
    ONLINE,
    feed,
    feed_online,
    new_state,
    parser,
    traffic,
)

DATA = Path(__file__).parents[1] / "data"


def _blocked_online() -> ModelState:
    """An online state blocked on a fit, joined samples waiting in its backlog."""
    st, p = new_state(**ONLINE), parser()
    msgs = traffic(9000, seed=5)
    for a in range(0, len(msgs), 1000):
        for mb in p.parse_batch(msgs[a:a + 1000]).by_model.values():
            st.offer(mb)
        if st.backlogged:
            return st
    raise AssertionError("never blocked")


def _states() -> dict[str, ModelState]:
    paper = new_state()
    feed(paper, parser(), traffic(2717, seed=2), fit=True)
    certified = new_state(**CERTIFIED)
    feed(certified, parser(), traffic(2717, seed=2), fit=True)
    sealed = new_state()
    feed(sealed, parser(), traffic(2000, seed=3))         # no fits: sealed epochs wait
    online = new_state(**ONLINE)
    feed_online(online, parser(), traffic(4000, seed=6))
    fresh = new_state()
    return {"paper": paper, "certified": certified, "sealed": sealed, "online": online,
            "blocked": _blocked_online(), "fresh": fresh}


STATES = _states()


@pytest.mark.parametrize("name", list(STATES))
def test_round_trip_of_every_state_kind_is_exact(name):
    st = STATES[name]
    blob = st.to_checkpoint()
    assert orjson.loads(blob)["format"] == "lpcal.model_state/6"
    back = ModelState.from_checkpoint(blob)
    # first (comparing states merges their monitor sums, which /6 writes as they are held)
    assert back.to_checkpoint() == blob
    assert back == st
    assert orjson.dumps(back.to_dict()) == orjson.dumps(st.to_dict())  # the /3 or /4 document
    assert back.filling == st.filling and back.monitor == st.monitor and back.join == st.join
    assert [(e, ps) for e, ps in back.sealed] == [(e, ps) for e, ps in st.sealed]
    assert back.binmap == st.binmap and back.backlogged == st.backlogged


def test_the_states_cover_live_maps_sealed_epochs_and_backlogs():
    assert STATES["paper"].binmap is not None and STATES["certified"].binmap is not None
    assert STATES["certified"].filling.holdout.n > 0
    assert len(STATES["sealed"].sealed) >= 2
    assert STATES["online"].binmap is not None and STATES["online"].online.window.n > 0
    assert STATES["blocked"].backlog is not None and STATES["blocked"].online.blocked


def test_packed_checkpoints_are_smaller_than_bin_keys_would_be_for_these_states():
    """Not a benchmark: the packed document is at most the legacy one plus a margin (the
    held-out sums' many zeros are shorter as text; tests/bench/bench_checkpoint.py measures)."""
    for st in STATES.values():
        assert len(st.to_checkpoint()) <= 1.3 * len(orjson.dumps(st.to_dict())) + 200


def _with_certification_share(doc: dict) -> dict:
    """``doc`` as an online state written before the certification share reads back: the
    share's defaults added where the encoder writes them (epochs states: unchanged)."""
    online = doc.get("online")
    if online is None:
        return doc
    share = OnlineConfig.cert_share  # the current default, which such a state adopts
    online["config"].update(cert_share=share, cert_growth=1.25, cert_buckets=20)
    window = online["window"]
    window.update(cert_share=share, cert_buckets=20)
    online.update(cert_looks=0, cert_next=0)
    return doc


def _gap_size_tested(doc: dict) -> dict:
    """``doc`` as a change test written before the confidence gap was tested by its size reads
    back: the signed test's ``cusum_low`` dropped, ``absolute`` added, and the gap's signed
    baseline restarted (the other statistics keep theirs)."""
    change = doc["monitor"].get("change")
    if change is None:
        return doc
    test = change["test"]
    assert test.pop("cusum_low") == {"confidence_gap": 0.0}
    test["absolute"] = ["confidence_gap"]
    for part in ("base_sum", "base_var", "cusum"):
        test[part]["confidence_gap"] = 0.0
    test["base_n"]["confidence_gap"] = 0
    return doc


def _change_test(doc: dict) -> dict | None:
    change = doc["monitor"].get("change")
    return None if change is None else change["test"]


@pytest.mark.parametrize("name, fmt", [("model_state_3.json", "lpcal.model_state/3"),
                                       ("model_state_3_fitted.json.gz", "lpcal.model_state/3"),
                                       ("model_state_4.json.gz", "lpcal.model_state/4")])
def test_checkpoints_written_before_format_5_load_to_the_same_state(name, fmt):
    """The fixtures were written by the encoder before /5 (the /4 one is an online state
    blocked on a fit with a backlog, a live map and pending joins): they load, their document
    is written back byte for byte, and their /5 checkpoint restores the same state."""
    raw = (DATA / name).read_bytes()
    data = gzip.decompress(raw) if name.endswith(".gz") else raw
    assert orjson.loads(data)["format"] == fmt
    st = ModelState.from_checkpoint(data)
    # an online state written before the certification share adopts it (the share's
    # settings and its empty look counters are the only additions)
    # (the document is compared parsed; an epochs state's is still written byte for byte)
    expect = _gap_size_tested(_with_certification_share(orjson.loads(data)))
    assert orjson.loads(orjson.dumps(st.to_dict())) == expect
    back = ModelState.from_checkpoint(st.to_checkpoint())
    assert back == st and orjson.loads(orjson.dumps(back.to_dict())) == expect
    if fmt.endswith("/4"):
        assert st.backlogged and st.binmap is not None and st.join.pending() > 0
        assert [r.id for r in back.fit_requests_outstanding] == \
            [r.id for r in st.fit_requests_outstanding]


#: The sha256 of ``orjson.dumps(state.to_dict())`` (the /3 or /4 document, every part of the
#: state) of the states the /5 encoder wrote to the fixtures, taken with that encoder's code
#: before /6: a part lost by the /5 reader or by the /6 round trip changes it.
_FIXTURES_5 = {
    "model_state_5.json.gz":
        "9639b2d732ad7ea5644ea2f68d19fe0f4289ba4f7e7ef34e146e1cb6064fef13",
    "model_state_5_certified.json.gz":
        "3f9e24c26ae0d4182be28efba749802991b29afbe38e854773f9d289b7524d9a",
}


@pytest.mark.parametrize("name", list(_FIXTURES_5))
def test_checkpoints_written_by_the_format_5_encoder_load_to_the_same_state(name):
    """The fixtures were written by the /5 encoder (an online state blocked on a fit with a
    backlog, a live map and pending joins; a certified epochs state with a fitted map and
    held-out sums): they restore to the state they were written from, and its /6 checkpoint
    restores the same state."""
    data = gzip.decompress((DATA / name).read_bytes())
    assert orjson.loads(data)["format"] == "lpcal.model_state/5"
    st = ModelState.from_checkpoint(data)
    doc = orjson.dumps(st.to_dict())
    # the change test's snapshot is the one part read differently since (the gap's size is
    # tested): with the fixture's own put back, the document is the one the /5 encoder had
    written, restored = orjson.loads(data), orjson.loads(doc)
    assert _change_test(restored) == _change_test(_gap_size_tested(orjson.loads(data)))
    if restored["monitor"].get("change") is not None:
        restored["monitor"]["change"]["test"] = written["monitor"]["change"]["test"]
    assert hashlib.sha256(orjson.dumps(restored)).hexdigest() == _FIXTURES_5[name]
    blob = st.to_checkpoint()
    assert orjson.loads(blob)["format"] == "lpcal.model_state/6"
    back = ModelState.from_checkpoint(blob)
    assert back.to_checkpoint() == blob
    assert orjson.dumps(back.to_dict()) == doc and back == st
    if name == "model_state_5.json.gz":
        assert st.backlogged and st.binmap is not None and st.join.pending() > 0
        assert [r.id for r in back.fit_requests_outstanding] == \
            [r.id for r in st.fit_requests_outstanding]
    else:
        assert st.binmap is not None and st.filling.holdout.n > 0


def test_the_states_hold_every_part_the_packed_form_writes():
    """What makes the round trips above mean something: between them, the states hold each
    part /6 packs or leaves out (so a lost part changes their document)."""
    online, certified, sealed = STATES["online"], STATES["certified"], STATES["sealed"]
    for st in (online, certified):
        bk = list(st.monitor.buckets.values())
        assert any(b.sums("calibrated", st.k).n for b in bk)      # calibrated sums
        assert any(b.cw["calibrated"] is not None for b in bk)    # classwise sums
        assert st.monitor.change is not None
    assert any(st.monitor._block and st.monitor._block_cw is not None  # the change test's block
               for st in STATES.values())
    assert any(b.held.n for b in online.online.window.buckets)    # loss grids
    assert any(not t.empty for t in sealed.filling.tables.values())
    fresh = STATES["fresh"].filling
    assert all(t.empty for t in fresh.tables.values())            # left out
    for name, st in STATES.items():
        d = orjson.loads(st.to_checkpoint())
        for bd in d["monitor"]["buckets"]:
            assert set(bd) == {"id", "n", "raw", "calibrated", "classwise"}, name


def test_a_lost_or_damaged_packed_part_is_noticed():
    """Dropping or truncating a packed part of the monitor or of a loss grid is an
    :class:`ArtifactError` naming the part, never a silently different state."""
    st = STATES["online"]
    d = orjson.loads(st.to_checkpoint())
    mon = d["monitor"]
    cases = []

    def cut(raw):  # a packed sums with its last bytes lost
        raw[-1] = [*raw[-1][:4], raw[-1][4][:-8]]

    assert mon["buckets"][0]["raw"][-1] is not None  # merged sums or the last part
    for mutate in (lambda m: cut(m["buckets"][0]["raw"]),
                   lambda m: m["buckets"][0]["raw"].pop(),                 # lost sums
                   lambda m: m["buckets"][0]["raw"][-1].__setitem__(0, 10**6),  # its count
                   lambda m: m["buckets"][0].update(raw=[]),
                   lambda m: m["buckets"][0]["classwise"].update(classwise=[0]),
                   lambda m: m["buckets"][0].pop("calibrated"),
                   lambda m: m["change"].update(block_n=m["change"]["block_n"] + 1)):
        doc = orjson.loads(orjson.dumps(d))
        mutate(doc["monitor"])
        cases.append(doc)
    for doc in cases:
        with pytest.raises(ArtifactError, match="monitor"):
            ModelState.from_dict(doc)
    held = next(i for i, b in enumerate(d["online"]["window"]["buckets"]) if b["held"]["n"])
    doc = orjson.loads(orjson.dumps(d))
    doc["online"]["window"]["buckets"][held]["held"]["data"] = "AAAA"
    with pytest.raises(ArtifactError, match="online"):
        ModelState.from_dict(doc)
    assert mon["buckets"] and ModelState.from_dict(d) == st


def test_the_cache_gives_the_same_bytes_and_follows_changes():
    st = new_state(**CERTIFIED)
    msgs = traffic(4000, seed=8)
    feed(st, parser(), msgs[:2000], fit=True)
    first = st.to_checkpoint()
    assert st.checkpoint_cache_bytes > 0
    assert st.to_checkpoint() == first
    uncached = orjson.dumps(st._packed_dict(CheckpointCache(0)))
    assert uncached == first
    q = parser()
    q.set_k(MODEL, st.k)
    feed(st, q, msgs[2000:], fit=True)
    later = st.to_checkpoint()
    assert later != first
    assert later == orjson.dumps(st._packed_dict(CheckpointCache(0)))
    assert ModelState.from_checkpoint(later) == st


def test_the_cache_is_bounded_and_counted_in_the_state_bytes():
    st = new_state(**ONLINE)
    feed_online(st, parser(), traffic(4000, seed=6))
    assert st.checkpoint_cache_bytes == 0
    st.to_checkpoint()
    assert 0 < st.checkpoint_cache_bytes <= st.checkpoint_cache.max_bytes
    arrays = st.filling.nbytes + st.monitor.nbytes + st.online.nbytes
    assert st.nbytes == arrays + st.checkpoint_cache_bytes
    st.set_budget(40_000)
    st.to_checkpoint()
    assert st.checkpoint_cache.max_bytes == 10_000
    assert st.checkpoint_cache_bytes <= 10_000


def test_the_cache_drops_parts_that_left_the_state():
    cache = CheckpointCache(1 << 20)
    a, b = object(), object()
    cache(a, (1,), lambda: {"x": 1})
    cache(b, (1,), lambda: {"y": [1, 2]})
    cache.sweep()
    n = cache.nbytes
    assert cache(a, (1,), lambda: pytest.fail("encoded again")) is not None
    cache.sweep()  # b was not used since the last sweep
    assert cache.nbytes < n
    calls = []
    cache(a, (2,), lambda: calls.append(1) or {"x": 2})  # refs changed: encoded again
    assert calls == [1]


# ---------------------------------------------------------------- hostile checkpoints
def _packed() -> dict:
    return orjson.loads(STATES["certified"].to_checkpoint())


def _table(d: dict) -> dict:
    return d["filling"]["tables"]["mu"]


def _cut(s: str) -> str:
    return s[:len(s) // 2 // 4 * 4]


@pytest.mark.parametrize("mutate, match", [
    (lambda d: _table(d).update(data=_cut(_table(d)["data"])), "bytes of packed arrays"),
    (lambda d: _table(d).update(data="not base64!"), "base64"),
    (lambda d: _table(d).update(n=10**15), "bytes of packed arrays"),
    (lambda d: _table(d).update(nnz=-1), "integer >= 0"),
    (lambda d: _table(d).update(pairs=2.5), "integer >= 0"),
    (lambda d: _table(d).update(dtypes=["<f4"] * 6), "dtypes"),
    (lambda d: _table(d).pop("dtypes"), "malformed"),
    (lambda d: _table(d).update(k=10**9), "k="),
    (lambda d: _table(d).update(lam=1 << 40), "lambda="),
    (lambda d: _table(d).update(lam=1), "count outside|level set"),
    (lambda d: d["filling"]["holdout"].update(data=_cut(d["filling"]["holdout"]["data"])),
     "hold"),
    (lambda d: d["filling"]["holdout"].update(n=10**12), "hold"),
])
def test_corrupt_packed_parts_are_rejected_naming_the_part(mutate, match):
    d = _packed()
    mutate(d)
    with pytest.raises(ArtifactError, match=f"filling.*({match})"):
        ModelState.from_checkpoint(orjson.dumps(d))


def _repack(d: dict, change) -> None:
    """Rewrite table ``d``'s arrays after ``change(arrays)`` (same dtypes widened to fit)."""
    sizes = (d["n"], d["nnz"], d["nnz"], d["pairs"], d["pairs"], d["pairs"])
    arrays = unpack_arrays(d, sizes, "test")
    change(arrays)
    d.update(pack_arrays(arrays))


@pytest.mark.parametrize("change, match", [
    (lambda a: a[4].__setitem__(0, 99), "label outside"),
    (lambda a: a[5].__setitem__(0, 0), "counts must be positive"),
    (lambda a: a[3].__setitem__(0, 10**6), "bin position"),
    (lambda a: a[1].__setitem__(slice(0, 2), a[1][1::-1].copy()), "strictly increasing|order"),
    (lambda a: (a[3].__setitem__(slice(None), a[3][::-1].copy())), "canonical order"),
])
def test_packed_tables_that_decode_but_break_an_invariant_are_rejected(change, match):
    d = _packed()
    t = _table(d)
    assert t["n"] >= 2 and t["pairs"] >= 2
    _repack(t, change)
    with pytest.raises(ArtifactError, match=match):
        ModelState.from_checkpoint(orjson.dumps(d))


def test_truncated_or_flipped_checkpoints_never_raise_anything_but_artifact_errors():
    blob = STATES["online"].to_checkpoint()
    rng = np.random.default_rng(0)
    for cut in (0, 1, 100, len(blob) // 3, len(blob) - 1):
        with pytest.raises(ArtifactError):
            ModelState.from_checkpoint(blob[:cut])
    raw = bytearray(blob)
    for _ in range(40):
        bad = raw.copy()
        for i in rng.integers(0, len(bad), size=3):
            bad[i] = int(rng.integers(32, 127))
        try:
            ModelState.from_checkpoint(bytes(bad))
        except ArtifactError:
            pass


# ---------------------------------------------------------------- count tables
def test_packed_count_tables_round_trip_every_shape():
    rng = np.random.default_rng(1)
    x = rng.dirichlet(np.ones(4), size=300)
    y = rng.integers(0, 4, 300)
    full = CountTable.from_samples(x, y, lam=10)
    lazy = tables_from_rows(x, y, rng.integers(0, 2, 300), 2, 4, 10)[0]
    zero_rows = CountTable.from_samples(np.full((5, 4), 0.25), np.arange(5) % 4, lam=3)
    for t in (full, lazy, zero_rows, CountTable(3, 7)):
        d = orjson.loads(orjson.dumps(t.to_dict(packed=True)))
        back = CountTable.from_dict(d)
        assert back == t and back.to_dict() == t.to_dict()
        assert CountTable.from_dict(t.to_dict()) == back  # the key form still reads
    assert full.to_dict(packed=True)["dtypes"][:3] == ["<u1", "<u1", "<u1"]  # narrowest


def test_packed_pool_sets_keep_the_held_out_sums_and_read_the_old_form():
    st = STATES["certified"]
    ps = st.filling
    d = orjson.loads(orjson.dumps(ps.to_dict(packed=True)))
    back = PoolSet.from_dict(d)
    assert back == ps and back.holdout == ps.holdout and back.holdout_raw == ps.holdout_raw
    assert np.array_equal(back.holdout.rows, ps.holdout.rows)
    assert PoolSet.from_dict(ps.to_dict()) == back


def test_unpack_checks_sizes_before_allocating():
    d = pack_arrays([np.arange(3), np.arange(2.0)])
    a, b = unpack_arrays(d, [3, 2], "x")
    assert a.tolist() == [0, 1, 2] and b.tolist() == [0.0, 1.0]
    for sizes in ([3, 3], [10**18, 2], [3]):
        with pytest.raises(InputError, match="x:"):
            unpack_arrays(d, sizes, "x")
    with pytest.raises(InputError, match="base64"):
        unpack_arrays({"dtypes": d["dtypes"], "data": base64.b64encode(b"12345")[:-1]
                       .decode() + "!"}, [3, 2], "x")


def test_an_envelope_packs_the_frozen_pools_of_a_fit_once_and_reads_both_forms():
    from daemon.checkpoint.envelope import Envelope, decode_envelope, encode_envelope
    from daemon.registry import Inflight, ModelSlot

    st = new_state()
    feed(st, parser(), traffic(2000, seed=3))
    assert st.sealed
    slot = ModelSlot(st, 1, Inflight(st.pools, "pools_full", 2), 0)
    raw = encode_envelope(MODEL, slot)
    d = orjson.loads(raw)
    assert "data" in d["inflight"]["pools"]["tables"]["mu"]
    assert d["state"]["format"] == "lpcal.model_state/6"
    cached = st.checkpoint_cache_bytes
    assert orjson.loads(encode_envelope(MODEL, slot))["inflight"] == d["inflight"]
    assert st.checkpoint_cache_bytes == cached  # the frozen pools came from the cache
    for inflight in (d["inflight"]["pools"], slot.inflight.pools.to_dict()):  # /5 and before
        d["inflight"]["pools"] = inflight
        env = decode_envelope(MODEL, orjson.dumps(d), limit=64 << 20, wanted=lambda p: True)
        assert isinstance(env, Envelope) and env.inflight.pools == slot.inflight.pools
        assert env.state == st
    d["inflight"]["pools"]["tables"]["mu"] = {"k": 3, "lam": 10, "n": 1, "nnz": 1, "pairs": 0,
                                              "dtypes": ["<u1"] * 6, "data": "AAAA"}
    bad = decode_envelope(MODEL, orjson.dumps(d), limit=64 << 20, wanted=lambda p: True)
    assert bad.reason == "corrupt" and "pool mu" in bad.detail


def test_the_cache_reuses_unchanged_tables_and_keeps_no_replaced_array_alive():
    import gc
    import weakref

    st = new_state()
    feed(st, parser(), traffic(300, seed=9))
    cache, made = CheckpointCache(), []

    def memo(owner, refs, make):  # the cache, recording what it had to encode
        return cache(owner, refs, lambda: made.append(owner) or make())

    ps = st.filling
    # small tables are packed every time, without the cache
    first = orjson.dumps(ps.to_dict(packed=True, memo=memo))
    assert all(t._pb.size < MEMO_MIN_PAIRS for t in ps.tables.values()) and made == []
    assert first == orjson.dumps(ps.to_dict(packed=True))
    # larger ones through it (a threshold of 0: every non-empty table)
    first = orjson.dumps(ps.to_dict(packed=True, memo=memo, memo_min_pairs=0))
    assert set(map(id, made)) == {id(t) for t in ps.tables.values() if not t.empty} != set()
    made.clear()
    assert orjson.dumps(ps.to_dict(packed=True, memo=memo, memo_min_pairs=0)) == first
    assert made == []
    t = ps.tables["mu"]
    old = weakref.ref(t._pc)
    q = parser()
    q.set_k(MODEL, st.k)
    feed(st, q, traffic(900, seed=9)[600:])
    assert st.filling is ps
    later = orjson.dumps(ps.to_dict(packed=True, memo=memo, memo_min_pairs=0))
    assert any(m is t for m in made)  # the table received samples: encoded again
    assert later == orjson.dumps(ps.to_dict(packed=True))
    gc.collect()
    assert old() is None  # the cache held the replaced counts only weakly


def test_the_checkpoint_benchmark_measures_both_formats_on_the_same_state():
    """A smoke run of tests/bench/bench_checkpoint.py's measurement (structure, not timing)."""
    from tests.bench import bench_checkpoint, run_all

    m = bench_checkpoint.measure("small", 10, 300, repeats=1)
    assert run_all.BENCHMARKS["checkpoint"] is bench_checkpoint
    assert m["samples"] == 300 + bench_checkpoint.STEP
    assert min(m["enc_old"], m["enc_new"], m["dec_old"], m["dec_new"]) > 0
    assert m["bytes_new"] > 0 and m["zbytes_new"] <= m["bytes_new"] + 64
    assert 0 < m["cache"] <= m["state_bytes"]


def test_empty_packed_tables_and_held_out_sums_round_trip_and_are_still_checked():
    ps = new_state(**CERTIFIED).filling
    assert ps.holdout is not None and ps.holdout.n == 0
    d = orjson.loads(orjson.dumps(ps.to_dict(packed=True)))
    assert d["tables"] == {} and d["holdout"]["data"] == ""  # empty tables are left out
    back = PoolSet.from_dict(d)
    assert back == ps and back.holdout == ps.holdout
    assert set(back.tables) == set(ps.layout.names) and all(t.empty for t in back.tables.values())
    empty = orjson.loads(orjson.dumps(ps.tables["mu"].to_dict(packed=True)))
    assert empty["data"] == "" and CountTable.from_dict(empty) == ps.tables["mu"]
    for bad, match in (({"dtypes": None}, "malformed"), ({"k": 1 << 30}, "k="),
                       ({"n": 1}, "bytes of packed arrays")):
        t = {**empty, **bad}
        with pytest.raises(InputError, match=match):
            CountTable.from_dict(t)
