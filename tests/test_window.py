"""Sliding window: buckets seal at exact counts, sums add, reset after a drift, round trips."""

import base64
import itertools
import json

import numpy as np
import pytest

from lpcal.challenger import LossGrid
from lpcal.errors import InputError
from lpcal.online import OnlineConfig, index_uniforms
from lpcal.pools import tree_sum
from lpcal.precalibrate import TemperatureGrid
from lpcal.window import SlidingWindow
from tests.test_warmup import tempered

LAYOUT = OnlineConfig().layout(10)


def fill(batches, n=5000, t=None, bucket_size=1000, n_buckets=4):
    f, y = tempered(n)
    u = index_uniforms(0, n)
    w = SlidingWindow(LAYOUT, bucket_size=bucket_size, n_buckets=n_buckets)
    if t is not None:
        w.set_temperature(t)
    cuts = [0, *batches, n]
    for a, b in itertools.pairwise(cuts):
        w.add(u[a:b], f[a:b], y[a:b])
    return w, f, y, u


def test_batching_does_not_change_the_buckets():
    w1, *_ = fill([])
    w2, *_ = fill([1, 999, 1000, 2500, 2501, 4999])
    assert w1 == w2
    assert [b.n for b in w1.buckets] == [1000] * 4 and w1.buckets[0].index == 1


def test_window_sums_equal_the_sums_of_its_samples():
    w, f, y, u = fill([], n=4500, t=2.0, n_buckets=3)  # keeps samples 2000..4499
    f, y, u = f[2000:], y[2000:], u[2000:]
    hold = LAYOUT.route_uniforms(u) >= len(LAYOUT.names)
    assert w.n == 2500
    assert w.grid() == TemperatureGrid().update(f[~hold], y[~hold])
    assert w.held() == LossGrid().update(f[hold], y[hold])
    pools = w.pools()
    assert pools.temperature == 2.0
    assert sum(t.total for t in pools.tables.values()) == int((~hold).sum())
    assert pools.holdout.n == pools.holdout_raw.n == int(hold.sum())


def test_pools_only_from_buckets_binned_at_the_temperature():
    f, y = tempered(3000)
    u = index_uniforms(0, 3000)
    w = SlidingWindow(LAYOUT, bucket_size=1000, n_buckets=8)
    w.add(u[:1500], f[:1500], y[:1500])        # no temperature yet
    assert w.pools(1.0) is None
    w.set_temperature(1.5)                      # the open bucket restarts its pools
    w.add(u[1500:], f[1500:], y[1500:])
    pools = w.pools()
    n_fit = sum(t.total for t in pools.tables.values())
    assert 0 < n_fit + pools.holdout.n == 1500


def test_reset_after_keeps_only_later_buckets():
    w, f, y, u = fill([], n=3500, n_buckets=8)
    w.reset_after(w.buckets[1].index)
    assert [b.index for b in w.buckets] == [2, 3] and w.n == 1500
    w.reset_after(w.open.index)
    assert w.n == 0 and w.open.index == 4
    w.add(u[:10], f[:10], y[:10])
    assert w.n == 10


def test_round_trip_and_bytes():
    w, *_ = fill([], n=2500, t=2.0)
    d = json.loads(json.dumps(w.to_dict()))
    back = SlidingWindow.from_dict(d)
    assert back == w
    assert 0 < w.nbytes < 2500 * 10 * 200
    d["buckets"][0]["n"] = 7
    with pytest.raises(InputError, match="bucket"):
        SlidingWindow.from_dict(d)


def test_rejects_a_layout_without_held_out_share():
    import dataclasses
    with pytest.raises(InputError, match="held-out share"):
        SlidingWindow(dataclasses.replace(LAYOUT, holdout=0))


def test_tree_sum_adds_everything():
    assert tree_sum(list(range(11)), lambda a, b: a + b) == 55


def test_certifying_sums_only_in_the_newest_buckets():
    f, y = tempered(5000)
    u = index_uniforms(0, 5000)
    w = SlidingWindow(LAYOUT, bucket_size=1000, n_buckets=8, holdout_buckets=2)
    w.set_temperature(2.0)
    w.add(u, f, y)
    held = [b.n_held for b in w.buckets]
    assert held[:3] == [0, 0, 0] and min(held[3:]) > 0
    assert w.pools().holdout.n == w.pools().holdout_raw.n == sum(held)
    assert w.held().n == sum(b.held.n for b in w.buckets) > sum(held)   # loss grids: all
    back = SlidingWindow.from_dict(json.loads(json.dumps(w.to_dict())))
    assert back == w and back.pools().holdout == w.pools().holdout


def test_held_out_sums_built_from_samples_equal_streamed_sums():
    # the buckets keep held-out samples, not sums: the sums built from them are the very sums
    # a stream of updates (any batching) gives, so a certificate is unchanged
    from lpcal.binmap import scale_temperature
    from lpcal.holdout import HoldoutSums

    f, y = tempered(5000)
    u = index_uniforms(0, 5000)
    w = SlidingWindow(LAYOUT, bucket_size=1000, n_buckets=8, holdout_buckets=3)
    w.set_temperature(2.0)
    for a in range(0, 5000, 377):
        w.add(u[a:a + 377], f[a:a + 377], y[a:a + 377])
    hold = LAYOUT.route_uniforms(u) >= len(LAYOUT.names)
    hold[:2000] = False                      # the two oldest buckets dropped theirs
    g_ref, f_ref = HoldoutSums(LAYOUT.k, LAYOUT.lam), HoldoutSums(LAYOUT.k, LAYOUT.lam)
    for a in range(2000, 5000, 101):
        sel = np.flatnonzero(hold[a:a + 101]) + a
        g_ref.update(scale_temperature(f[sel], 2.0), y[sel])
        f_ref.update(f[sel], y[sel])
    pools = w.pools()
    assert pools.holdout == g_ref and pools.holdout_raw == f_ref and g_ref.n > 0
    assert w.pools() is not w.buckets[-1].pools


def test_malformed_held_out_samples_are_named():
    w, _, _, _ = fill([], n=1500, t=2.0)
    d = w.to_dict()
    d["buckets"][0]["held_samples"]["y"] = d["buckets"][0]["held_samples"]["y"][:-8]
    with pytest.raises(InputError, match="held-out samples"):
        SlidingWindow.from_dict(d)


def _written_with_held_out_sums(w: SlidingWindow, t: float) -> SlidingWindow:
    """``w`` (pools at temperature ``t``) written in the previous form and read back: each
    bucket's held-out samples as held-out sums in its pools."""
    from lpcal.binmap import scale_temperature
    from lpcal.holdout import HoldoutSums

    d = w.to_dict()
    for b in d["buckets"]:
        hs = b.pop("held_samples", None)
        if hs is None:
            continue
        x = np.frombuffer(base64.b64decode(hs["x"]), "<f8").reshape(-1, 10)
        yy = np.frombuffer(base64.b64decode(hs["y"]), "<i8")
        b["pools"]["holdout"] = HoldoutSums(10, LAYOUT.lam).update(
            scale_temperature(x, t), yy).to_dict()
        b["pools"]["holdout_raw"] = HoldoutSums(10, LAYOUT.lam).update(x, yy).to_dict()
    return SlidingWindow.from_dict(json.loads(json.dumps(d)))


def test_a_window_written_with_held_out_sums_in_its_buckets_still_counts_them():
    w, _, _, _ = fill([], n=2500, t=2.0)
    want = w.pools()
    old = _written_with_held_out_sums(w, 2.0)
    got = old.pools()
    assert got.holdout == want.holdout and got.holdout_raw == want.holdout_raw
    assert got.holdout.n > 0


def _bucket_bytes(b, k=10):
    """A bucket's bytes summed from its parts (the pools' full count, no kept value)."""
    held = sum(a.nbytes for a in b.held_samples(k)) if b.n_held else 0
    cert = sum(a.nbytes for a in b.cert_samples(k)) if b.n_cert else 0
    pools = b.pools.nbytes if b.pools is not None else 0
    return b.grid.nll.nbytes + b.held.nbytes + pools + held + cert


def test_a_sealed_bucket_counts_the_bytes_it_holds():
    """Sealed buckets keep their tables' bytes (:meth:`Bucket.seal`): what they count stays
    what they hold while their held-out samples, certification samples and a restored
    state's held-out sums are dropped as newer buckets arrive, and after a restore."""
    n = 9000
    f, y = tempered(n)
    u = index_uniforms(0, n)
    w = SlidingWindow(LAYOUT, bucket_size=500, n_buckets=8, holdout_buckets=3,
                      cert_share=0.5, cert_buckets=2)
    w.set_temperature(2.0)
    w.add(u[:2200], f[:2200], y[:2200])
    w = _written_with_held_out_sums(w, 2.0)
    rng = np.random.default_rng(1)
    a, cleared, dropped = 2200, 0, 0
    while a < n:
        b = min(n, a + int(rng.integers(1, 700)))
        before = {s.index: (s.pools.holdout.n, s.n_held) for s in w.buckets[:-1]}
        w.add(u[a:b], f[a:b], y[a:b], defer=bool(rng.integers(2)))
        w.flush()
        sealed = w.buckets[:-1]
        was = [(before.get(s.index, (0, 0)), s) for s in sealed]
        cleared += sum(h > 0 and not s.pools.holdout.n for (h, _), s in was)
        dropped += sum(m > 0 and not s.n_held for (_, m), s in was)
        assert all(s.nbytes == _bucket_bytes(s) for s in sealed)
        a = b
    assert cleared and dropped   # both kinds of change to a sealed bucket were seen
    assert all(s.nbytes == _bucket_bytes(s) for s in w.buckets)


def test_held_since_a_mark_returns_the_held_out_samples_kept_after_it():
    f, y = tempered(6000)
    u = index_uniforms(0, 6000)
    hold = LAYOUT.route_uniforms(u) >= len(LAYOUT.names)
    w = SlidingWindow(LAYOUT, bucket_size=1000, n_buckets=8, holdout_buckets=3)
    w.set_temperature(2.0)
    for a, b in ((0, 1700), (1700, 2000), (2000, 3600)):
        if a == 1700:
            mark = w.held_mark()
            assert mark == (1, int(hold[1000:1700].sum()))
        w.add(u[a:b], f[a:b], y[a:b])
    x, lab = w.held_since(mark)
    sel = np.flatnonzero(hold[1700:3600]) + 1700     # bucket 1 from the mark on, 2, 3
    assert sel.size > 0 and np.array_equal(x, f[sel]) and np.array_equal(lab, y[sel])
    # buckets 1 and 2 drop their held-out samples once they are not among the newest three
    w.add(u[3600:6000], f[3600:6000], y[3600:6000])
    x, lab = w.held_since(mark)
    sel = np.flatnonzero(hold[3000:6000]) + 3000
    assert np.array_equal(x, f[sel]) and np.array_equal(lab, y[sel])
    empty = SlidingWindow(LAYOUT, bucket_size=1000).held_since((5, 0))
    assert empty[0].shape == (0, LAYOUT.k) and empty[1].shape == (0,)
