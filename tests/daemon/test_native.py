"""daemon._speedups (the optional C accelerator) against its pure-Python references.

Every native kernel must compute exactly what the Python code computes, so that a process
with the accelerator and one without (``LPCAL_NATIVE=0``, or no compiler at install) fill the
same pools from the same input. Each test runs both paths on the same random or adversarial
input and compares everything observable: results, counters and snapshots.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
import types
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daemon.columns
import daemon.event_columnar
import daemon.event_general
import daemon.events
import daemon.join
import daemon.join_loop
import daemon.native
from daemon import codes
from daemon.columns import columns_python
from daemon.event_records import ModelPolicy
from daemon.events import EventParser
from daemon.join import KIND_OUTCOME, KIND_PREDICTION, KIND_SAMPLE, JoinStore
from daemon.native import pure_python, route_uniform_fast
from lpcal.pools import route_uniform

NATIVE = daemon.native.KERNELS.module
needs_native = pytest.mark.skipif(NATIVE is None, reason="daemon._speedups is not built here")


def test_accelerator_is_built_where_it_can_be():
    """With a C compiler and the Python headers, ``pip install`` must have built the module
    (a silent fallback would halve ingest throughput). LPCAL_NATIVE=0 switches it off."""
    if daemon.native.disabled_by_env():
        assert NATIVE is None and daemon.native.describe() == "python"
        return
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers:
        pytest.skip("no C compiler or Python headers: the pure-Python path is expected")
    assert NATIVE is not None, "daemon._speedups was not built; see the pip install output"
    assert daemon.native.describe() == "c"


@needs_native
def test_pure_python_switches_every_user_and_restores():
    """The equivalence tests below are only meaningful if the switch really switches: one
    reference, ``native.KERNELS``, which no user copies into its own namespace."""
    c = daemon.native.KERNELS
    assert c.path == "c" and c.module is NATIVE
    for f in ("attach_rows", "sample_out", "sample_records"):  # used as they are
        assert getattr(c, f) is getattr(NATIVE, f)
    for mod in (daemon.columns, daemon.join, daemon.join_loop, daemon.events):
        assert not {"SPEEDUPS", "KERNELS"} & set(vars(mod)), mod
    store = daemon.join.JoinStore(10, 10.0)
    with pure_python():
        assert daemon.native.KERNELS is daemon.native.PYTHON
        assert daemon.native.SPEEDUPS is None and daemon.native.describe() == "python"
        cols = daemon.native.KERNELS.scan([{"model": "m", "id": "a", "ts": 1.0, "label": 1}], 255, 256)
        assert cols.vecs is not None  # the Python reference built it (the C one sets flat)
        store.offer("m", [KIND_PREDICTION], ["a"], [1.0], np.ones((1, 2)) / 2, [-1])
        assert store._models["m"].pending["a"][codes.E_PAYLOAD][1] == 0  # (block, row) in Python
    assert daemon.native.KERNELS is c and daemon.native.SPEEDUPS is NATIVE
    assert daemon.native.KERNELS.scan([{"model": "m", "id": "a", "ts": 1.0, "label": 1}], 255, 256).vecs is None


def test_every_kernel_has_its_python_reference():
    """No field of either path is None: users never branch on which path runs."""
    py = daemon.native.PYTHON
    fields = ("scan", "offer_loop", "attach_rows", "route_uniform", "sample_out",
              "sample_records")
    assert py.path == "python" and py.module is None
    assert all(callable(getattr(py, f)) for f in fields)
    assert py.offer_loop is daemon.join_loop.offer_loop
    assert py.scan is daemon.columns.scan_python
    if NATIVE is not None:
        c = daemon.native.Kernels.of_module(NATIVE)
        assert all(callable(getattr(c, f)) for f in fields)
    # the references decide nothing on raw bytes: every record is kept for the parser
    recs = [types.SimpleNamespace(value=b'{"model":"m"}'), types.SimpleNamespace(value=b"x")]
    kept, values, counts = py.sample_records(recs, {"m": 0.5}, 1 << 20, 256)
    assert kept == recs and values == [b'{"model":"m"}', b"x"] and counts == {}
    mask, counts = py.sample_out([b"a", b"b"], {"m": 0.5}, 1 << 20, 256)
    assert mask == b"\0\0" and counts == {}


def test_the_join_state_has_the_attributes_the_c_loop_reads():
    """The names the C join loop reads (MJ_* of daemon.codes, exported by the module) are
    attributes of the per-model join state."""
    names = {v for k, v in codes.SHARED_WITH_C.items() if k.startswith("MJ_")}
    assert names == set(codes.MODEL_JOIN_ATTRS)
    assert names <= set(daemon.join_loop._ModelJoin.__slots__)
    m = daemon.join_loop._ModelJoin()
    assert all(hasattr(m, n) for n in names)


def test_kind_codes_are_defined_once():
    """The parse paths' and the join's kind codes are daemon.codes' (not copies that could
    drift)."""
    for name in ("KIND_PREDICTION", "KIND_OUTCOME", "KIND_SAMPLE"):
        assert getattr(daemon.event_columnar, name) is getattr(codes, name)
        assert getattr(daemon.event_general, name) is getattr(codes, name)
        assert getattr(daemon.join, name) is getattr(codes, name)
    assert len({codes.KIND_PREDICTION, codes.KIND_OUTCOME, codes.KIND_SAMPLE,
                codes.KIND_DEAD}) == 4
    assert sorted((codes.E_KIND, codes.E_DEADLINE, codes.E_TS, codes.E_PAYLOAD,
                   codes.E_ID)) == list(range(codes.ENTRY_LEN))


@needs_native
def test_c_codes_equal_the_python_codes():
    """The C kernels' #defines (speedups.h), exported by the module, are daemon.codes'."""
    assert {k: getattr(NATIVE, k) for k in codes.SHARED_WITH_C} == codes.SHARED_WITH_C


@needs_native
def test_a_module_with_other_codes_is_not_used():
    """A stale or mismatched build is refused (native falls back to Python with a warning)."""
    stale = types.ModuleType("daemon._speedups")
    stale.__dict__.update(vars(NATIVE))
    stale.KIND_DEAD = 7
    with pytest.raises(ValueError, match="KIND_DEAD"):
        daemon.native.Kernels.of_module(stale)
    assert daemon.native.Kernels.of_module(NATIVE) == daemon.native.KERNELS


# ------------------------------------------------------------------------------ routing
ids_strategy = st.lists(st.text(min_size=0, max_size=300), max_size=40)


@needs_native
@settings(max_examples=200, deadline=None)
@given(ids_strategy)
def test_route_hash_equals_hashlib_blake2b(ids):
    """Any str (empty, non-ASCII, longer than one 128-byte block) hashes as hashlib does."""
    try:
        ref = route_uniform(ids)
    except UnicodeEncodeError:  # lone surrogates: the C path must fall back, not guess
        assert NATIVE.route_u64(ids) is None
        return
    digests = np.frombuffer(NATIVE.route_u64(ids), dtype=np.uint64)
    want = [int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big")
            for i in ids]
    assert digests.tolist() == want
    assert np.array_equal(route_uniform_fast(ids), ref)


@needs_native
def test_route_block_boundaries():
    ids = ["x" * n for n in (0, 1, 127, 128, 129, 255, 256, 257, 1000)]
    assert np.array_equal(route_uniform_fast(ids), route_uniform(ids))


@needs_native
def test_route_hash_at_every_lane_width():
    """Ids hashed side by side in vector lanes (4: AVX2, 8: AVX-512F, where the CPU has them)
    hash as hashlib does: lengths 0..300 bytes (one block, two, three), non-ASCII, counts that
    leave a scalar tail."""
    rng = np.random.default_rng(11)
    alphabet = list("abcXYZ09-_") + ["\u00e9", "\u4e2d", "\U0001f600"]
    ids = ["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(0, 140, 997)]
    ids += ["y" * n for n in range(0, 300, 7)]
    want = [int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big")
            for i in ids]
    prev = NATIVE.hash_lanes()
    try:
        for width in (1, 4, 8):
            try:
                NATIVE.hash_lanes(width)
            except ValueError:
                assert width > prev  # only widths above the CPU's are refused
                continue
            for n in (len(ids), 3, 1, 0):
                got = np.frombuffer(NATIVE.route_u64(ids[:n]), dtype=np.uint64).tolist()
                assert got == want[:n], (width, n)
    finally:
        NATIVE.hash_lanes(prev)


# ------------------------------------------------------------------------------ columns
scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.integers(2**53 - 2, 2**64 + 5),
                   st.floats(allow_nan=False), st.text(max_size=3), st.just([]), st.just({}))
number = st.one_of(st.floats(0, 1), st.integers(0, 3), st.sampled_from([True, 0, 1, 2**53, 2**53 + 1,
                                                                        -(2**60), 1e300]))
vector = st.one_of(st.lists(number, min_size=0, max_size=4), scalar)


@st.composite
def event(draw):
    d = {}
    for key, strat in (("model", st.one_of(st.sampled_from(["m", "n", "", "x" * 300]), scalar)),
                       ("id", st.one_of(st.text(min_size=0, max_size=4), scalar)),
                       ("ts", st.one_of(st.floats(0, 2e9), st.integers(0, 2**70), scalar)),
                       ("probs", vector), ("label", st.one_of(st.integers(-2, 4), scalar)),
                       ("logits", st.one_of(st.none(), vector))):
        if draw(st.booleans()) or key in ("model", "id", "ts"):
            d[key] = draw(strat)
    return d


def well_formed(rng: np.random.Generator, n: int) -> list[dict]:
    out = []
    for i in range(n):
        d = {"model": ["m", "n"][i % 2], "id": f"e{i}", "ts": float(i) if i % 3 else i}
        if i % 4 != 1:
            d["probs"] = rng.dirichlet(np.ones(3)).tolist() if i % 2 == 0 else [0, 1, 0.0]
        if i % 4 != 0:
            d["label"] = int(rng.integers(0, 3))
        out.append(d)
    return out


def rejected(cols, k_values) -> bool:
    """Whether the parser's fast path gives up on these columns for every k: ``columns`` says
    None, or (the Python reference checks vector entries only there) no matrix can be built."""
    if cols is None:
        return True
    rows = np.flatnonzero(cols.has_vec)
    return rows.size > 0 and all(cols.matrix(rows, k) is None for k in k_values)


def assert_same_columns(ds: list, k_values=(0, 1, 2, 3, 4)):
    a = daemon.native.KERNELS.scan(ds, 255, 256)           # native (when built)
    b = columns_python(ds, 255, 256)
    assert rejected(a, k_values) == rejected(b, k_values), (ds, a, b)
    if rejected(a, k_values):
        return
    assert a.models == b.models and a.ids == b.ids
    assert np.array_equal(a.ts, b.ts) and a.ts.dtype == b.ts.dtype
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.has_vec, b.has_vec)
    rows = np.flatnonzero(a.has_vec)
    for k in k_values:
        ma, mb = a.matrix(rows, k), b.matrix(rows, k)
        assert (ma is None) == (mb is None), (ds, k)
        if ma is not None:
            assert ma.dtype == mb.dtype == np.float64 and np.array_equal(ma, mb)
    for part in (rows[::2], rows[1::2]):
        for k in k_values:
            ma, mb = a.matrix(part, k), b.matrix(part, k)
            assert (ma is None) == (mb is None)
            if ma is not None:
                assert np.array_equal(ma, mb)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event(), min_size=1, max_size=6))
def test_columns_native_equals_python_on_arbitrary_events(ds):
    assert_same_columns(ds)


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(0, 2**32 - 1))
def test_columns_native_equals_python_on_well_formed_batches(n, seed):
    ds = well_formed(np.random.default_rng(seed), n)
    assert daemon.native.KERNELS.scan(ds, 255, 256) is not None
    assert_same_columns(ds)


@needs_native
def test_columns_rejections_match():
    good = {"model": "m", "id": "a", "ts": 1.0, "probs": [0.5, 0.5]}
    for bad in ({**good, "label": -1}, {**good, "label": True}, {**good, "ts": True},
                {**good, "probs": [0.5, True]}, {**good, "probs": [2**53 + 1, 0]},
                {**good, "logits": [1, 2]}, {"model": "m", "id": "a", "ts": 1.0},
                {**good, "id": ""}, {**good, "model": "m" * 256}, {**good, "ts": 10**400},
                {**good, "label": 2**63}):
        assert daemon.native.KERNELS.scan([good, bad], 255, 256) is None
        assert rejected(columns_python([good, bad], 255, 256), range(5)), bad
    assert daemon.native.KERNELS.scan([good, {**good, "logits": None, "label": None, "id": "b"}], 255, 256)


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.builds(lambda d: json.dumps(d).encode(), event()),
                          st.binary(max_size=8)), min_size=1, max_size=8),
       st.booleans())
def test_parse_batch_native_equals_python(raws, policy_k):
    """The whole parser: same records, invalid reasons and learned k either way."""
    def parse():
        p = EventParser(lambda m: ModelPolicy(k=3 if policy_k else None), max_bytes=200)
        return repr(p.parse_batch(raws, [5.0] * len(raws)).records()), dict(p.k)
    with_native = parse()
    with pure_python():
        assert parse() == with_native


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.builds(lambda d: json.dumps(d).encode(), event()), min_size=1, max_size=8),
       st.booleans(), st.lists(st.floats(0, 2e9) | st.just(-1.0), min_size=8, max_size=8))
def test_parse_batch_ts_bound_native_equals_python(raws, policy_k, rec_ts):
    """With ``max_ts_skew``: the same ``ts_out_of_range`` verdicts and
    ``ts_limit`` either way."""
    def parse():
        p = EventParser(lambda m: ModelPolicy(k=3 if policy_k else None), max_bytes=200,
                        max_ts_skew=300.0)
        pb = p.parse_batch(raws, rec_ts[:len(raws)])
        return (repr(pb.records()), {m: mb.ts_limit for m, mb in pb.by_model.items()},
                dict(p.k))
    with_native = parse()
    with pure_python():
        assert parse() == with_native


# ------------------------------------------------------------------------------ join
@st.composite
def join_script(draw):
    """Batches of events over a small id space: duplicates, late and orphan events, samples,
    in-batch joins, TTL expiry and capacity evictions all happen."""
    batches = []
    t = 0.0
    for _ in range(draw(st.integers(1, 6))):
        evs = []
        for _ in range(draw(st.integers(0, 12))):
            t += draw(st.sampled_from([0.0, 0.5, 3.0, -2.0]))
            kind = draw(st.sampled_from([KIND_PREDICTION, KIND_OUTCOME, KIND_SAMPLE]))
            evs.append((kind, f"e{draw(st.integers(0, 15))}", t, draw(st.integers(0, 2))))
        now = draw(st.one_of(st.none(), st.floats(0, 40)))
        batches.append((evs, now))
    return (draw(st.integers(1, 6)), draw(st.sampled_from([1.0, 4.0, 100.0])),
            draw(st.integers(0, 8)), batches)


def run_script(script, models=("m", "w")):
    cap, ttl, recent, batches = script
    store = JoinStore(cap, ttl, recent_per_model=recent)
    results = []
    for b, (evs, now) in enumerate(batches):
        model = models[b % len(models)]
        kind = np.array([e[0] for e in evs], dtype=np.int8)
        ids = [e[1] for e in evs]
        ts = np.array([e[2] for e in evs], dtype=np.float64)
        labels = np.array([e[3] if e[0] != KIND_PREDICTION else -1 for e in evs],
                          dtype=np.int64)
        probs = np.array([[int(e[1].lstrip("eid")) + 1.0, float(b), 1.0] for e in evs]
                         ).reshape(len(evs), 3)
        r = store.offer(model, kind, ids, ts, probs, labels, now)
        results.append((r.ids, r.ts.tolist(), r.probs.tolist(), r.labels.tolist(), r.evicted,
                        r.unmatched))
        if b % 2:
            results.append(store.advance(now if now is not None else ts.max(initial=0.0))
                           .evicted)
    stats = {m: store.stats(m) for m in store.models()}
    return results, stats, store.to_dict(), store.clock, list(store.wm)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(join_script())
def test_join_native_equals_python(script):
    with_native = run_script(script)
    with pure_python():
        assert run_script(script) == with_native


@needs_native
def test_join_native_equals_python_at_scale():
    """Long, realistic streams of one-kind batches (partitions of the predictions or the
    outcomes topic): predictions then their outcomes, some duplicated, some lost, tight
    capacity."""
    rng = np.random.default_rng(3)
    batches, t = [], 0.0
    for b in range(40):
        n = 300
        base = b * 200
        ids = [f"id{base + i}" for i in range(n)]
        if b % 5 == 4:
            ids[7] = ids[3]  # a duplicate inside a batch
        kind = KIND_PREDICTION if b % 2 == 0 else KIND_OUTCOME
        evs = [(kind, ids[i], t + i * 0.01, int(rng.integers(0, 3))) for i in range(n)]
        t += 3.0
        batches.append((evs, None))
    script = (5000, 20.0, 2000, batches)
    with_native = run_script(script, models=("m",))
    with pure_python():
        assert run_script(script, models=("m",)) == with_native
    assert sum(len(r[0]) for r in with_native[0] if isinstance(r, tuple)) > 1000


@needs_native
def test_join_snapshot_round_trip_across_paths():
    """A store snapshotted by one path restores and continues identically under the other."""
    script = (50, 10.0, 20, [([(KIND_PREDICTION, f"e{i}", float(i), 0) for i in range(30)],
                              None)])
    first = JoinStore(50, 10.0, recent_per_model=20)
    evs = script[3][0][0]
    first.offer("m", [e[0] for e in evs], [e[1] for e in evs], [e[2] for e in evs],
                np.ones((30, 3)) / 3, [-1] * 30)
    snap = orjson.loads(orjson.dumps(first.to_dict()))
    outs = [(KIND_OUTCOME, f"e{i}", 31.0 + i, 1) for i in range(0, 30, 2)]

    def continue_from(s):
        r = s.offer("m", [e[0] for e in outs], [e[1] for e in outs], [e[2] for e in outs],
                    np.zeros((len(outs), 3)), [e[3] for e in outs])
        return r.ids, r.probs.tolist(), r.evicted, r.unmatched, s.to_dict()

    a = continue_from(JoinStore.from_dict(snap))
    with pure_python():
        assert continue_from(JoinStore.from_dict(snap)) == a


@needs_native
def test_attach_rows_native_equals_python():
    """``attach_rows`` gives every entry ``(block, r)``, whatever its payload was: the batch
    row ``r`` itself (every prediction stayed pending: C reuses that int), another row, a
    large row, or not an int."""
    block = np.arange(12.0).reshape(6, 2)

    def entries():
        pay = [0, 1, 300, 2, 10**30, None]  # rows 0 and 1 equal r; the rest do not
        return [[KIND_PREDICTION, 1.0, 1.0, p, f"e{r}"] for r, p in enumerate(pay)]

    c, py = entries(), entries()
    NATIVE.attach_rows(c, block)
    daemon.join_loop.attach_rows(py, block)
    assert [e[:3] + [e[3][1]] + e[4:] for e in c] == [e[:3] + [e[3][1]] + e[4:] for e in py]
    assert all(e[3][0] is block and type(e[3]) is tuple and type(e[3][1]) is int for e in c)
    assert [e[3][1] for e in c] == list(range(6))
    with pytest.raises(TypeError, match="5-item lists"):
        NATIVE.attach_rows([[1, 2]], block)
