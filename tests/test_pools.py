"""Sample pools: count tables over (bin, label), the pool layout and its routing, pool sets."""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import subprocess
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lpcal.errors import InputError
from lpcal.levels import bin_counts, encode_key, row_hash
from lpcal.pools import CountTable, PoolLayout, PoolSet, n_levels, pool_names

SETTINGS = settings(max_examples=40, deadline=None)


def _samples(seed: int, n: int, k: int, concentration: float = 0.5):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(k) * concentration, size=n)
    labels = rng.integers(0, k, size=n)
    return probs, labels


def _dict_counts(probs, labels, lam):
    """Reference: Counter over (canonical bin key, label)."""
    out = collections.Counter()
    for c, y in zip(bin_counts(probs, lam), labels.tolist()):
        out[(encode_key(c), int(y))] += 1
    return out


def _table_counts(t: CountTable):
    d = t.to_dict()
    out = collections.Counter()
    for b, y, c in zip(d["bin"], d["label"], d["count"]):
        out[(d["bins"][b], y)] += c
    return out


samples = st.tuples(st.integers(0, 10_000), st.integers(0, 120), st.integers(2, 5),
                    st.integers(1, 8))


# ----------------------------------------------------------------------------- CountTable


@SETTINGS
@given(samples, st.lists(st.integers(0, 120), max_size=6))
def test_streaming_add_equals_batch(s, cuts):
    seed, n, k, lam = s
    probs, labels = _samples(seed, n, k)
    batch = CountTable(k, lam)
    batch.add(probs, labels)
    stream = CountTable(k, lam)
    edges = sorted({0, n, *[c for c in cuts if c <= n]})
    for a, b in itertools.pairwise(edges):
        if b % 2:
            stream.add(probs[a:b], labels[a:b])
        else:  # precomputed bin rows
            stream.add(None, labels[a:b], counts=bin_counts(probs[a:b], lam))
    assert stream == batch
    assert stream.total == batch.total == n
    assert _table_counts(stream) == _dict_counts(probs, labels, lam)


def test_streaming_across_compactions():
    """More than 2^16 buffered rows force compaction in the middle of the stream."""
    probs, labels = _samples(1, 150_000, 3, concentration=2.0)
    lam = 7
    stream = CountTable(3, lam)
    for a in range(0, 150_000, 9_000):
        stream.add(probs[a:a + 9_000], labels[a:a + 9_000])
        assert stream.total == min(a + 9_000, 150_000)
    batch = CountTable.from_samples(probs, labels, lam)
    assert stream == batch
    assert _table_counts(stream) == _dict_counts(probs, labels, lam)


@SETTINGS
@given(samples, st.integers(0, 10_000), st.integers(0, 10_000))
def test_merge_commutative_associative_union(s, seed_b, seed_c):
    seed, n, k, lam = s
    parts = [_samples(sd, m, k) for sd, m in ((seed, n), (seed_b, n // 2), (seed_c, 7))]
    a, b, c = (CountTable.from_samples(p, y, lam, k) for p, y in parts)
    assert a.merge(b) == b.merge(a)
    assert (a + b) + c == a + (b + c)
    union = CountTable.from_samples(np.vstack([p for p, _ in parts]),
                                    np.concatenate([y for _, y in parts]), lam, k)
    assert a + b + c == union
    assert (a + b + c).total == a.total + b.total + c.total


def test_merge_leaves_inputs_unchanged():
    pa, ya = _samples(2, 50, 3)
    pb, yb = _samples(3, 40, 3)
    a, b = CountTable.from_samples(pa, ya, 5), CountTable.from_samples(pb, yb, 5)
    da, db = a.to_dict(), b.to_dict()
    m = a.merge(b)
    m.add(pa[:5], ya[:5])
    assert a.to_dict() == da and b.to_dict() == db
    assert m.total == 95


def test_merge_with_empty_table_is_a_new_object():
    pb, yb = _samples(3, 40, 3)
    empty, b = CountTable(3, 5), CountTable.from_samples(pb, yb, 5)
    before = b.to_dict()
    for merged in (empty.merge(b), b.merge(empty)):
        merged.add(pb[:3], yb[:3])
    assert b.to_dict() == before


def test_merge_rejects_other_k_or_lambda():
    with pytest.raises(InputError, match="cannot merge pools"):
        CountTable(3, 5).merge(CountTable(3, 6))
    with pytest.raises(InputError, match="cannot merge pools"):
        CountTable(3, 5).merge(CountTable(4, 5))


@SETTINGS
@given(samples)
def test_to_dict_round_trip(s):
    seed, n, k, lam = s
    probs, labels = _samples(seed, n, k)
    t = CountTable.from_samples(probs, labels, lam, k)
    d = t.to_dict()
    back = CountTable.from_dict(orjson.loads(orjson.dumps(d)))
    assert back == t
    assert back.to_dict() == d
    assert back.total == n


def _valid_dict():
    probs, labels = _samples(4, 30, 3)
    return CountTable.from_samples(probs, labels, 5).to_dict()


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("k"), "malformed pool"),
    (lambda d: d.pop("count"), "malformed pool"),
    (lambda d: d.update(k="three"), "malformed pool"),
    (lambda d: d.update(count=d["count"][:-1]), "differ in shape"),
    (lambda d: d.update(bin=[len(d["bins"])] + d["bin"][1:]), "bin position outside"),
    (lambda d: d.update(bin=[-1] + d["bin"][1:]), "bin position outside"),
    (lambda d: d.update(label=[3] + d["label"][1:]), "label outside"),
    (lambda d: d.update(count=[0] + d["count"][1:]), "counts must be positive"),
    (lambda d: d.update(bins=[d["bins"][0]] + d["bins"][:-1] if len(d["bins"]) > 1 else 0),
     "duplicate bin keys"),
    (lambda d: d.update(bins=["0:x"] + d["bins"][1:]), "not 'index:count'"),
    (lambda d: d.update(bins=["7:5"] + d["bins"][1:]), "outside"),
    (lambda d: d.update(bins=["0:1"] + d["bins"][1:]), "not a level set"),
    (lambda d: d.update(k=1), r"label outside \[0, 1\)"),
])
def test_from_dict_rejects_malformed(mutate, message):
    d = _valid_dict()
    mutate(d)
    with pytest.raises(InputError, match=message):
        CountTable.from_dict(d, where="pool E3")


def test_from_dict_error_names_the_pool():
    d = _valid_dict()
    d["label"][0] = 9
    with pytest.raises(InputError, match="pool E3"):
        CountTable.from_dict(d, where="pool E3")
    with pytest.raises(InputError, match="malformed pool"):
        CountTable.from_dict(["not", "a", "dict"])


@pytest.mark.parametrize("field,value", [("count", 2.7), ("label", 0.9), ("label", True)])
def test_from_dict_rejects_non_integers(field, value):
    d = _valid_dict()
    d[field][0] = value
    with pytest.raises(InputError):
        CountTable.from_dict(d)


def test_label_and_k_errors():
    with pytest.raises(InputError, match="k >= 2"):
        CountTable(1, 5)
    with pytest.raises(InputError, match="lambda >= 1"):
        CountTable(3, 0)
    t = CountTable(3, 5)
    probs, labels = _samples(5, 10, 3)
    with pytest.raises(InputError, match=r"label 3 at row 4 outside \[0, 3\)"):
        t.add(probs, np.where(np.arange(10) == 4, 3, labels))
    with pytest.raises(InputError, match="label -1 at row 0"):
        t.add(probs, np.where(np.arange(10) == 0, -1, labels))
    with pytest.raises(InputError, match="integers"):
        t.add(probs, labels.astype(float))
    with pytest.raises(InputError, match="shape"):
        t.add(probs, labels[:-1])
    with pytest.raises(InputError, match="k=3"):
        t.add(np.full((2, 4), 0.25), labels[:2])
    with pytest.raises(InputError, match="probs or counts"):
        t.add(None, labels)
    assert t.total == 0  # nothing was added by the failing calls


@SETTINGS
@given(samples)
def test_bin_mass_and_label_counts_against_dicts(s):
    seed, n, k, lam = s
    probs, labels = _samples(seed, n, k)
    t = CountTable.from_samples(probs, labels, lam, k)
    ref = _dict_counts(probs, labels, lam)
    h, mass = t.bin_mass()
    assert mass.sum() == n
    keys = [encode_key(r) for r in t.bin_rows(np.arange(h.size))]
    assert len(set(keys)) == h.size
    mass_ref = collections.Counter()
    for (key, _), c in ref.items():
        mass_ref[key] += c
    assert dict(zip(keys, mass.tolist())) == dict(mass_ref)
    # label counts for the stored bins (reversed) plus two bins not in the table
    absent = [np.array([lam] + [0] * (k - 1)), np.array([0] * (k - 1) + [lam])]
    absent = [a for a in absent if encode_key(a) not in mass_ref]
    query = np.concatenate([h[::-1], row_hash(np.array(absent)) if absent else []]).astype(np.int64)
    lc = t.label_counts(query)
    qkeys = keys[::-1] + [encode_key(a) for a in absent]
    for key, row in zip(qkeys, lc.tolist()):
        assert row == [ref.get((key, j), 0) for j in range(k)]


# ----------------------------------------------------------------------------- PoolLayout


def _layout(variant="split", k=3, lam=5):
    L = n_levels(1.0 / lam)
    names = pool_names(L, variant)
    targets = {nm: (5000 if nm == "mu" else 200 * (i + 1)) for i, nm in enumerate(names)}
    return PoolLayout(k, lam, L, variant, targets)


def test_layout_names_and_errors():
    lay = _layout()
    L = lay.levels
    assert lay.names == tuple(["mu"] + [f"P{i}" for i in range(L)] + [f"E{i}" for i in range(L)])
    assert _layout("shared").names == tuple(["mu"] + [f"PE{i}" for i in range(L)])
    assert lay.total_target == sum(lay.targets.values())
    with pytest.raises(InputError, match="missing"):
        PoolLayout(3, 5, 2, "split", {"mu": 1, "P0": 1})
    bad = dict(lay.targets, P0=0)
    with pytest.raises(InputError, match="positive"):
        PoolLayout(3, 5, lay.levels, "split", bad)
    with pytest.raises(InputError, match="variant"):
        PoolLayout(3, 5, 2, "both", {"mu": 1})
    assert PoolLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(InputError, match="malformed pool layout"):
        PoolLayout.from_dict({"k": 3})


def _route_reference(ids, layout):
    """Independent: blake2b-64 of the id as a uniform, inverted through the target CDF."""
    w = np.array([layout.targets[n] for n in layout.names], dtype=float)
    edges = np.cumsum(w) / w.sum()
    out = []
    for i in ids:
        u = int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big") / 2.0**64
        out.append(min(int(np.sum(edges <= u)), len(w) - 1))
    return np.array(out)


def test_route_deterministic_and_proportional():
    lay = _layout()
    ids = [f"evt-{i:07d}" for i in range(60_000)]
    r1 = lay.route(ids)
    assert np.array_equal(r1, lay.route(ids))
    assert np.array_equal(r1[:2000], _route_reference(ids[:2000], lay))
    assert np.array_equal(r1[::7], lay.route(ids[::7]))  # per id, not per batch
    counts = np.bincount(r1, minlength=len(lay.names))
    w = np.array([lay.targets[n] for n in lay.names], dtype=float)
    expected = len(ids) * w / w.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # df = pools - 1 (<= 20 here); the 99.99% quantile of chi2(20) is about 52
    assert chi2 < 60, (chi2, counts.tolist(), expected.round().tolist())
    # bytes ids route like their str form
    assert np.array_equal(lay.route([i.encode() for i in ids[:100]]), r1[:100])


def test_route_stable_across_processes():
    lay = _layout()
    ids = [f"order-{i}" for i in range(300)]
    code = ("import sys, orjson; from lpcal.pools import PoolLayout; "
            "lay = PoolLayout.from_dict(orjson.loads(sys.argv[1])); "
            "print(orjson.dumps(lay.route(sys.argv[2].split(',')).tolist()).decode())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, orjson.dumps(lay.to_dict()).decode(),
                          ",".join(ids)], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert orjson.loads(out.stdout) == lay.route(ids).tolist()


# ----------------------------------------------------------------------------- PoolSet


def _filled(layout, seed, n):
    probs, labels = _samples(seed, n, layout.k)
    ps = PoolSet(layout)
    ids = [f"s{seed}-{i}" for i in range(n)]
    ps.add(layout.route(ids), probs, labels)
    return ps, probs, labels, ids


@pytest.mark.parametrize("variant", ["split", "shared"])
def test_poolset_fill_full_merge_round_trip(variant):
    lay = _layout(variant)
    a, pa, ya, ida = _filled(lay, 1, 3000)
    b, pb, yb, idb = _filled(lay, 2, 2500)
    fill = a.fill()
    assert list(fill) == list(lay.names)
    assert all(t == lay.targets[n] for n, (_, t) in fill.items())
    route = lay.route(ida)
    for i, n in enumerate(lay.names):
        assert fill[n][0] == int(np.sum(route == i)) == a.tables[n].total
    assert a.total == 3000 and not a.full
    m = a.merge(b)
    assert m == b.merge(a) and m.total == 5500
    # the merged pool set equals one filled with all events at once
    whole = PoolSet(lay)
    whole.add(lay.route(ida + idb), np.vstack([pa, pb]), np.concatenate([ya, yb]))
    assert m == whole
    back = PoolSet.from_dict(orjson.loads(orjson.dumps(m.to_dict())))
    assert back == m
    # full once every pool reaches its target
    big = _filled(lay, 3, lay.total_target * 3)[0]
    assert big.full == all(c >= t for c, t in big.fill().values())
    assert big.full


def test_poolset_errors():
    lay = _layout()
    with pytest.raises(InputError, match="unknown pool"):
        PoolSet(lay, {"Q7": CountTable(3, 5)})
    other = _layout(k=4)
    with pytest.raises(InputError, match="different layouts"):
        PoolSet(lay).merge(PoolSet(other))
    d = PoolSet(lay).to_dict()
    d["tables"]["mu"] = CountTable(4, 5).to_dict()
    with pytest.raises(InputError, match=r"pool mu: \(k, lambda\)"):
        PoolSet.from_dict(d)
    with pytest.raises(InputError, match="malformed pool set"):
        PoolSet.from_dict({"tables": {}})


def _route_uniform_v1(ids):
    """The original per-id implementation of :func:`lpcal.pools.route_uniform` (reference)."""
    out = []
    for i in ids:
        b = i.encode() if isinstance(i, str) else bytes(i)
        out.append(int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "big"))
    return np.asarray(out, dtype=np.uint64).astype(np.float64) / 2.0**64


def test_route_uniform_equals_the_original_implementation():
    """Routing must never change (checkpoints and crash replay depend on it): the bulk digest
    read gives bit-identical uniforms to the per-id int.from_bytes version."""
    from lpcal.pools import route_uniform

    rng = np.random.default_rng(5)
    ids = [f"evt-{i}" for i in range(5000)] + ["", "é-ü-😀", "x" * 300]
    ids += ["".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, size=int(n)))
            for n in rng.integers(1, 40, size=500)]
    mixed = ids[:50] + [i.encode() for i in ids[50:100]] + [bytearray(b"ba"), memoryview(b"mv")]
    for batch in (ids, mixed, [], ["one"]):
        got, ref = route_uniform(batch), _route_uniform_v1(batch)
        assert got.dtype == ref.dtype == np.float64 and got.shape == (len(batch),)
        assert np.array_equal(got, ref)
        assert ((got >= 0) & (got < 1)).all()
    lay = _layout()
    assert np.array_equal(lay.route(ids), np.minimum(
        np.searchsorted(lay.cumulative_weights(), _route_uniform_v1(ids), side="right"),
        len(lay.names) - 1))


def test_class_counts_sum_the_labels_of_every_bin():
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(6), size=500)
    labels = rng.choice([0, 2, 3], size=500)
    t = CountTable(6, 10)
    t.add(probs[:200], labels[:200])
    t.add(probs[200:], labels[200:])  # buffered rows are folded in first
    np.testing.assert_array_equal(t.class_counts(), np.bincount(labels, minlength=6))
    assert t.class_counts().dtype == np.int64 and CountTable(6, 10).class_counts().sum() == 0
