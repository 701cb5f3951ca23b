"""The fast paths of :meth:`daemon.model_state.ModelState.offer` against the paths they
replace, kept here as references: the same stream, cut into the same random batches, must
leave byte-identical checkpoints.

* the monitor: small updates of a sample window without the per-slice dispatch
  (:meth:`daemon.monitor.WindowMonitor._update_small`), and the slices of a large update
  summed in one pass per predictor (:meth:`daemon.monitor.WindowMonitor._planned`), against
  the general loop that sums each slice on its own;
* the join: the joined rows taken in one gather when they all come from one place, counters
  added only when something was counted (:meth:`daemon.join.JoinStore._finish_offer`), and
  the row blocks tracked by weak references with a callback;
* the state: the label check by two reductions (a list for a few labels), the monitor fed at
  once when the online calibrator published nothing (:meth:`daemon.model_state.ModelState.
  ingest`, ``_take_events``), and an epoch's pools summed for the fill check only once its
  warm-up and held-out share are complete;
* the merge of window sums (:meth:`daemon.monitor.CellSums.merge_all`).
"""

from __future__ import annotations

import gc
import math
import re
from typing import Any

import numpy as np
import orjson
import pytest

from daemon.drift import ChangeDetector
from daemon.event_records import ModelPolicy
from daemon.events import EventParser
from daemon.join import JoinResult, JoinStore, _acc
from daemon.model_state import IngestResult, ModelState
from daemon.monitor import SMALL_UPDATE, CellSums, WindowMonitor, _Rows, _Small
from daemon.native import route_uniform_fast
from daemon.settings import JoinSettings, ModelSettings
from lpcal.errors import InputError
from lpcal.levels import bin_rows
from lpcal.online import run_fit

MODEL = "m"
K = 4


# --------------------------------------------------------------------------- references


class ReferenceMonitor(WindowMonitor):
    """:meth:`WindowMonitor.update` as it was: every update, small or large, through the
    general loop; each slice summed on its own."""

    def update(self, probs, labels, ts=None, calibrated=None, hashes=None) -> int:
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        n = y.shape[0]
        if x.shape != (n, self.k):
            raise InputError("shape")
        if n == 0:
            return 0
        self._cache.clear()
        rows: Any
        if n < SMALL_UPDATE:
            rows = _Small(x.copy(), y.copy(),
                          None if hashes is None else np.array(hashes[0]),
                          None if hashes is None else np.array(hashes[1]),
                          None if calibrated is None
                          else np.array(calibrated, dtype=np.float64))
        else:
            rows = (_Rows(x, y, self.lam, hashes),
                    None if calibrated is None else
                    _Rows(np.asarray(calibrated, dtype=np.float64), y, self.lam))
        feed = calibrated is not None and self.change is not None
        assert not self.by_time
        if ts is not None and len(ts):
            self.clock = max(self.clock, float(np.max(ts)))
        a = 0
        half = None if self.max_bytes is None else self.max_bytes // 2
        step = n if half is None else max(1, half // (2 * (16 * self.k + 16)))
        while a < n:
            last = next(reversed(self.buckets.values())) if self.buckets else None
            if last is None or last.n >= self.width or (half is not None and last.n
                                                        and last.nbytes >= half):
                nxt = (next(reversed(self.buckets)) + 1) if self.buckets else 0
                self._advance_bucket(nxt)
                self._bucket(nxt)
            cur = self.buckets[next(reversed(self.buckets))]
            take = min(n - a, int(self.width) - cur.n, step)
            if feed:
                take = min(take, self.change.block_samples - self._block_n)
            self._add(cur, rows, slice(a, a + take), feed)
            a += take
        self.total_samples += n
        self._trim()
        return n


class ReferenceJoin(JoinStore):
    """:meth:`JoinStore._finish_offer` as it was: every joined row scattered into a new
    array, the counters always added."""

    def _finish_offer(self, m, probs, out_ids, out_ts, out_lab, b_out, b_idx, p_groups,
                      live_e, live_r, ev, um) -> JoinResult:
        from daemon import native

        if p_groups:
            k = p_groups[0][0].shape[1]
        else:
            k = probs.shape[1] if probs is not None else 0
        rows = np.empty((len(out_ids), k), dtype=np.float64)
        if len(b_out):
            rows[b_out] = probs[b_idx]
        for blk, js, rs in p_groups:
            rows[js] = blk[rs]
        if live_e:
            block = probs[live_r]
            m.rows.track(block)
            native.KERNELS.attach_rows(live_e, block)
        m.joined += len(out_ids)
        m.compact()
        _acc(m, ev, um)
        return JoinResult(out_ids, np.asarray(out_ts, dtype=np.float64), rows,
                          np.asarray(out_lab, dtype=np.int64), ev, um)


class ReferenceState(ModelState):
    """:meth:`ModelState.ingest` and ``_take_events`` as they were, on the reference monitor
    and join."""

    def _new_monitor(self, k, max_bytes=None):
        mon = self.monitor_spec
        return ReferenceMonitor(k, self.lam, self.fit_spec.p, window_samples=mon.window_samples,
                                window_seconds=mon.window_seconds, max_bytes=max_bytes,
                                change=mon.change_detector())

    def ingest(self, ids, probs, labels, ts=None) -> IngestResult:
        labels = np.asarray(labels, dtype=np.int64)
        res = IngestResult()
        n = labels.shape[0]
        if n == 0:
            return res
        probs = np.asarray(probs, dtype=np.float64).reshape(n, self.k)
        ok = (labels >= 0) & (labels < self.k)
        u = route_uniform_fast(ids)
        rate = self.sample_rate
        if rate < 1.0:
            ok &= u < rate
            u = u / rate
        if not ok.all():
            keep = np.flatnonzero(ok)
            bad = (labels < 0) | (labels >= self.k)
            res.label_out_of_range = int(np.count_nonzero(bad))
            self.dropped_labels += res.label_out_of_range
            ids = [ids[i] for i in keep.tolist()]
            probs, labels, u = probs[keep], labels[keep], u[keep]
            ts = None if ts is None else np.asarray(ts)[keep]
        if labels.size and self.online is not None:
            self._ingest_online(res, probs, labels, u, ts)
        elif labels.size:
            c, h, pair = bin_rows(probs, self.lam)
            a, n = 0, labels.size
            while a < n:
                used = self.filling.add_samples(u[a:], probs[a:], labels[a:],
                                                raw_bins=(c[a:], h[a:]))
                a += used
                if self.filling.full:
                    self.seal()
                    res.sealed += 1
                elif self._epoch_over_budget():
                    self.seal()
                    res.sealed += 1
                    res.sealed_early += 1
            cal = self._calibrator(probs) if self._calibrator is not None else None
            before = self.monitor.trimmed
            self.monitor.update(probs, labels, ts, calibrated=cal, hashes=(h, pair))
            res.window_trimmed = self.monitor.trimmed - before
        res.joined = int(labels.size)
        self.samples_total += res.joined
        return res

    def _take_events(self, res, events, start, probs, labels, ts) -> None:
        a = 0
        before = self.monitor.trimmed
        for e in events:
            if e.kind == "published":
                b = e.n - start
                self._monitor_rows(probs[a:b], labels[a:b], None if ts is None else ts[a:b])
                a = b
                if self.adopting is not None and e.version <= self.adopting[1].version:
                    res.on_topic.add(e.version)
                    if e.version == self.adopting[1].version:
                        self._replayed(e.binmap)
                        continue
                self._use_binmap(e.binmap.to_json(), e.version,
                                 same_regime=self._same_regime(e.binmap))
        self._monitor_rows(probs[a:], labels[a:], None if ts is None else ts[a:])
        if self.adopting is not None and self.online.n_seen >= self.adopting[2]:
            self._adopt_now()
        res.window_trimmed += self.monitor.trimmed - before
        res.events.extend(events)


# --------------------------------------------------------------------------- streams


def _settings(recovery: str) -> ModelSettings:
    base: dict[str, Any] = {"eps": 0.1, "p": math.inf, "window_samples": 2000,
                            "drift_min_samples": 100, "drift_baseline_samples": 600}
    if recovery == "online":
        base.update(recovery="online", mode="certified", bucket_size=500, fit_delay=500,
                    warmup_tol=0.2)
    else:
        base.update(recovery="epochs", mode="certified", holdout=50, warmup=80, pool=300,
                    mu_pool=300)
    return ModelSettings(**base)


def _pair(recovery: str, sample_rate: float, budget: int | None):
    join = JoinSettings(ttl_seconds=50, max_pending_per_model=5000)
    ms = _settings(recovery)
    new = ModelState.create(MODEL, K, ms, join)
    ref = ReferenceState.create(MODEL, K, ms, join)
    ref.join = ReferenceJoin(new.join.max_pending, new.join.ttl, new.join.max_recent)
    assert type(ref.monitor) is ReferenceMonitor
    for st in (new, ref):
        st.sample_rate = sample_rate
        if budget is not None:
            st.set_budget(budget)
    return new, ref


def _messages(n: int, seed: int, bad_labels: bool) -> list[bytes]:
    """Predictions and outcomes of ``n`` events (outcomes trail by 0 to 300 events, some
    duplicated); over-confident predictions, so maps get published; with ``bad_labels``
    some outcomes carry a label >= k."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.dirichlet(np.ones(K) * 0.7, size=n), 3)
    x /= x.sum(axis=1, keepdims=True)
    y = (x.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    raw = x**2 / (x**2).sum(axis=1, keepdims=True)
    events = []
    for i in range(n):
        events.append((i, 0, {"model": MODEL, "id": f"e{i}", "ts": i * 0.01,
                              "probs": raw[i].tolist()}))
        lab = int(y[i]) if not (bad_labels and i % 97 == 5) else K + 1
        delay = int(rng.integers(0, 300))
        events.append((i + delay, 1, {"model": MODEL, "id": f"e{i}", "ts": i * 0.01 + 3.0,
                                      "label": lab}))
        if i % 211 == 7:  # a duplicate outcome
            events.append((i + delay + 1, 1, {"model": MODEL, "id": f"e{i}",
                                              "ts": i * 0.01 + 3.0, "label": lab}))
    events.sort(key=lambda e: (e[0], e[1]))
    return [orjson.dumps(d) for _, _, d in events]


_STAMPS = re.compile(rb'(created_at|checksum)\\?":\\?"[^"\\]*\\?"')


def _checkpoint(st: ModelState) -> bytes:
    """``st.to_checkpoint()`` without the maps' ``created_at`` stamps (the time the online
    loop published each, so two states fed one after the other differ there) and the
    checksums that cover them."""
    return _STAMPS.sub(rb"\1", st.to_checkpoint())


def _fits(new: ModelState, ref: ModelState, res_new: IngestResult,
          res_ref: IngestResult) -> None:
    """Run the fits both states requested (the same requests), once each: a map's
    ``created_at`` is the time it was fitted."""
    todo = list(zip(res_new.fit_requests, res_ref.fit_requests, strict=True))
    while todo:
        a, b = todo.pop(0)
        bm = run_fit(a)
        todo += zip(new.complete_fit(a, bm).fit_requests, ref.complete_fit(b, bm).fit_requests,
                    strict=True)


@pytest.mark.parametrize(("recovery", "sample_rate", "budget", "seed"), [
    ("online", 1.0, None, 0), ("online", 1.0, 300_000, 1), ("online", 0.7, None, 2),
    ("epochs", 1.0, None, 3), ("epochs", 1.0, 60_000, 4), ("epochs", 0.6, None, 6)])
def test_offers_leave_the_checkpoint_of_the_reference_paths(recovery, sample_rate, budget,
                                                            seed):
    msgs = _messages(6000, seed, bad_labels=True)
    # k unset: the parser takes labels >= k, which the states drop (label_out_of_range)
    parser = EventParser(lambda m: ModelPolicy())
    new, ref = _pair(recovery, sample_rate, budget)
    rng = np.random.default_rng(seed + 100)
    a = 0
    joined = small = large = 0
    while a < len(msgs):
        size = int(rng.choice([1, 3, 12, 40, 150, 700, 1500, 3000]))
        mb = parser.parse_batch(msgs[a:a + size]).by_model[MODEL]
        a += size
        res, res_ref = new.offer(mb), ref.offer(mb)
        if recovery == "online":
            _fits(new, ref, res, res_ref)
        if rng.random() < 0.1:  # joined samples with labels >= k (an outcome before k)
            n = int(rng.choice([1, 7, 64, 65, 300]))  # both ways of checking labels
            x = rng.dirichlet(np.ones(K), size=n)
            y = rng.integers(0, K + 2, n)
            ids = [f"x{a}-{j}" for j in range(n)]
            t = np.full(n, float(mb.ts.max()))
            r1, r2 = new.ingest(ids, x, y, t), ref.ingest(ids, x, y, t)
            _fits(new, ref, r1, r2)
            assert r1.label_out_of_range == r2.label_out_of_range
        joined += res.joined
        small += 0 < res.joined < SMALL_UPDATE
        large += res.joined >= SMALL_UPDATE
        if rng.random() < 0.1:
            assert _checkpoint(new) == _checkpoint(ref)
    assert joined > 3000 and small and large  # both monitor paths and the join's both ways
    if recovery == "online":
        assert new.binmap_version > 0  # maps installed: calibrated rows, the change test
    else:  # epochs sealed at their exact fill point, after warm-ups and held-out shares
        assert new.fill_epoch >= 1 and new.fill_epoch == ref.fill_epoch
    assert new.dropped_labels > 0 and new.dropped_labels == ref.dropped_labels
    assert new.monitor.total_samples == ref.monitor.total_samples
    assert _checkpoint(new) == _checkpoint(ref)
    assert new.join.memory_bytes() == ref.join.memory_bytes()


def test_large_updates_cut_as_the_general_loop_under_a_budget_and_the_change_test():
    """Large updates, with bucket closes at half the byte budget (which the planned cuts do
    not foresee) and change-test blocks: the same sums, buckets and test state."""
    rng = np.random.default_rng(7)
    k = 6
    for max_bytes in (None, 40_000, 400_000):
        det = {"false_alarm_rate": 1e-3, "baseline_samples": 700, "min_shift": 0.01,
               "block_samples": 300}
        new = WindowMonitor(k, 10, math.inf, window_samples=3000, max_bytes=max_bytes,
                            change=ChangeDetector(**det))
        ref = ReferenceMonitor(k, 10, math.inf, window_samples=3000, max_bytes=max_bytes,
                               change=ChangeDetector(**det))
        for i in range(40):
            n = int(rng.choice([5, 300, 900, 2600]))
            x = rng.dirichlet(np.ones(k) * 0.5, size=n)
            y = rng.integers(0, k, n)
            cal = np.sqrt(x)
            cal /= cal.sum(axis=1, keepdims=True)
            c = cal if i > 3 else None
            h = bin_rows(x, 10)[1:] if i % 2 else None
            assert new.update(x, y, np.arange(n) + i * 1e4, calibrated=c, hashes=h) == \
                ref.update(x, y, np.arange(n) + i * 1e4, calibrated=c, hashes=h)
            assert new.nbytes == ref.nbytes
        assert new.trimmed == ref.trimmed
        assert new.to_dict() == ref.to_dict()
        assert new.change.to_dict() == ref.change.to_dict()
        assert new.evaluate() == ref.evaluate()


def test_row_blocks_are_released_when_their_last_pending_row_leaves():
    """The join's row-block bytes follow the blocks still held by pending predictions."""
    store = JoinStore(max_pending_per_model=1000, ttl_seconds=1e9)
    rng = np.random.default_rng(3)
    pending: list[str] = []
    nxt = 0
    for _ in range(60):
        n = int(rng.integers(1, 40))
        ids = [f"i{nxt + j}" for j in range(n)]
        nxt += n
        store.offer(MODEL, np.zeros(n, np.int8), ids, np.zeros(n),
                    rng.dirichlet(np.ones(3), size=n), np.full(n, -1))
        pending += ids
        rng.shuffle(pending)
        cut = int(rng.integers(0, len(pending) + 1))
        take, pending = pending[:cut], pending[cut:]
        if take:
            store.offer(MODEL, np.ones(len(take), np.int8), take, np.zeros(len(take)), None,
                        np.zeros(len(take), np.int64))
        m = store._models[MODEL]
        gc.collect()
        # alive: the blocks of pending predictions and of joined ones the queue still holds
        held = {id(e[3][0]): e[3][0].nbytes for e in [*m.pending.values(), *m.queue]
                if type(e[3]) is tuple}
        assert m.rows.nbytes == sum(held.values()) > 0
    assert store.pending(MODEL) == len(pending)


def _reference_merge(parts: list[CellSums], k: int) -> CellSums:
    """:meth:`CellSums.merge_all` as it was: ``np.unique`` with its inverse, then a stable
    sort of the inverse."""
    out = CellSums(k)
    h = np.concatenate([p.hashes for p in parts])
    uh, inv = np.unique(h, return_inverse=True)
    inv = inv.reshape(-1)
    out.hashes = uh
    out.counts = np.bincount(inv, weights=np.concatenate([p.counts for p in parts]),
                             minlength=uh.size).astype(np.int64)
    order = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[order], np.arange(uh.size))
    out.s = np.add.reduceat(np.concatenate([p.s for p in parts])[order], starts, axis=0)
    out.q = np.add.reduceat(np.concatenate([p.q for p in parts])[order], starts, axis=0)
    out.n = sum(p.n for p in parts)
    out.brier = float(sum(p.brier for p in parts))
    out.correct = sum(p.correct for p in parts)
    out.gap = np.sum([p.gap for p in parts], axis=0)
    out.ece_n = np.sum([p.ece_n for p in parts], axis=0)
    out.ece_q = np.sum([p.ece_q for p in parts], axis=0)
    return out


def test_merged_sums_equal_the_reference_merge_to_the_bit():
    rng = np.random.default_rng(11)
    for _ in range(200):
        k = int(rng.integers(2, 12))
        parts = []
        for _ in range(int(rng.integers(2, 6))):
            n = int(rng.integers(1, 300))
            x = np.round(rng.dirichlet(np.ones(k) * 0.3, size=n), 1)  # bins shared by parts
            x /= x.sum(axis=1, keepdims=True)
            parts.append(CellSums.from_batch(x, rng.integers(0, k, n), int(rng.choice([2, 10]))))
        merged = CellSums.merge_all(parts, k)
        assert merged.to_dict() == _reference_merge(parts, k).to_dict()
        assert merged.counts.dtype == np.int64 and merged.hashes.dtype == np.int64
