"""Sliding-window pools: a ring of buckets of additive count tables over recent samples.

Every statistic a fit and its evaluation use is a **sum over samples**: the warm-up grid of
temperature scaling (:class:`lpcal.precalibrate.TemperatureGrid`), Algorithm 2's pools
(:class:`lpcal.pools.CountTable` per pool: counts per (bin, label)), the held-out sums that certify
a map (:class:`lpcal.holdout.HoldoutSums`) and the held-out loss sums that decide whether to
publish it (:class:`lpcal.challenger.LossGrid`). Sums of disjoint sets of samples add, so the
statistics of any set of recent samples are the sum of the statistics of the *buckets* that
partition it. A :class:`SlidingWindow` keeps the last ``n_buckets`` buckets of ``bucket_size``
samples each::

    bucket:   [ b_{j-B+1} | ... | b_{j-1} | b_j (open) ]      window = sum of the B buckets

* a bucket **seals** at the exact sample that makes it hold ``bucket_size`` samples (a batch that
  crosses the boundary is split there), so bucket boundaries depend only on the sample sequence,
  never on batching: a replay fills bit-identical buckets;
* when a new bucket opens and the ring holds ``n_buckets``, the oldest is dropped: the window
  covers the last ``(B - 1) N`` to ``B N`` samples, and a refit reuses all of them instead of
  starting an epoch from nothing;
* :meth:`SlidingWindow.reset_after` drops every bucket up to a given index (a detected drift:
  only post-drift buckets count), including the open one if it is not newer;
* the held-out sums that certify a map (:class:`lpcal.holdout.HoldoutSums`) are **built when
  asked for** (:meth:`SlidingWindow.pools`) from the held-out *samples* of the newest
  ``holdout_buckets`` buckets, which a bucket keeps (``held_x``, ``held_y``) instead of their
  sums; older buckets drop them. Sums per bin cost ``28 k + 16`` bytes, twice (for ``g`` and
  for ``f``), and at ``lambda = 10`` level sets rarely hold two samples (at k = 100, 3,000
  held-out samples fall in about 1,200 bins; each bucket's 300 in about 215), so a bucket's
  sums take about 7 times the ``8 k + 8`` bytes of its samples, and merged sums about 4 times.
  The sums are exact integers whatever the grouping of the samples (:mod:`lpcal.holdout`), so
  building them at once gives the very sums the buckets' sums merged would: additivity and
  replay determinism are unchanged. The certificate uses the most recent held-out samples (as
  many as an epoch held out before); they are routed to the held-out share, so never in the
  pools of the fit they certify.

**The certification share.** With ``cert_share > 0`` the top ``cert_share`` of the held-out
share's interval of ``u`` (:meth:`SlidingWindow.certifying`) is kept apart: those samples enter
neither the loss grid (the champion/challenger test) nor the held-out sums of Algorithm 2's
fits; a bucket only counts them (``cert_n``) and keeps them raw (``cert`` in its checkpoint
form) while it is among the newest ``cert_buckets``, from the first sample on (during the
warm-up too). They certify the maps the online loop publishes (:mod:`lpcal.online`): samples
no fit and no selection saw. ``8 k + 8`` bytes per sample: at the online defaults (half of a
30% held-out share, 20 buckets of 1,000) 3,000 certification samples, 1.5 times the bytes of
the 3,000 held-out samples the newest 10 buckets kept before (now 1,500 of the test share).

Samples are routed by a uniform ``u`` in [0, 1) per sample (a hash of the event id in the
daemon, :func:`lpcal.pools.route_uniform`), through the layout's routing
(:meth:`lpcal.pools.PoolLayout.route_uniforms`): to one of Algorithm 2's pools (the *fit
share*) or to the held-out share ``"hold"``. Fit-share samples always enter the bucket's
temperature grid; held-out samples always enter its loss grid. Once a **pool temperature** ``T``
is set (the warm-up determined it), fit-share samples also enter Algorithm 2's pools as bins of
``g = softmax(log f / T)``, and held-out samples the held-out sums of ``g`` and of ``f``: the
bucket's :class:`lpcal.pools.PoolSet` (its layout's warm-up is 0). Buckets whose pools were
binned at another temperature, or opened before one was set, contribute their grids but not
their pools (:meth:`SlidingWindow.pools`).

Serialisation (:meth:`SlidingWindow.to_dict`) nests the existing formats unchanged
(``PoolSet.to_dict``, ``TemperatureGrid.to_dict``) plus :meth:`LossGrid.to_dict` and a
bucket's held-out samples (``held_samples``: little-endian float64 and int64, base64; exact);
a window written with held-out sums in its buckets' pools still restores and counts them;
:attr:`SlidingWindow.nbytes` is the bytes of the arrays held (the checkpoint's JSON is larger by
the usual factor of text over int64).

Cost: adding ``n`` samples costs what the underlying sums cost (``O(n k G)`` for the grids, the
binning of ``g`` of the fit share for the pools; :meth:`SlidingWindow.add` given the warm-up's
:class:`lpcal.warmup.WarmupSums` fills them from the bucket grid's exponentials); :meth:`SlidingWindow.pools` merges the buckets pairwise (a
balanced tree: ``O(W log B)`` for ``W`` stored bins); memory is bounded by ``n_buckets`` buckets.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from lpcal.challenger import LossGrid
from lpcal.challenger import update_runs as update_loss_runs
from lpcal.errors import InputError
from lpcal.holdout import HoldoutSums
from lpcal.io import softmax_rows
from lpcal.pools import PoolLayout, PoolSet, tree_sum
from lpcal.precalibrate import TemperatureGrid, grid_nll_runs
from lpcal.warmup import WarmupSums
from lpcal.warmup import update_runs as update_warmup_runs

__all__ = ["FLUSH_ROWS", "Bucket", "PoolsSnapshot", "SlidingWindow", "flush_many"]


#: ``memo(owner, refs, make)``: a cache of encoded parts (see :meth:`SlidingWindow.to_dict`).
Memo = Callable[[object, tuple, Callable[[], Any]], Any]


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _same_samples(a: tuple[np.ndarray, np.ndarray] | None,
                  b: tuple[np.ndarray, np.ndarray] | None) -> bool:
    if a is None or b is None:
        return a is b
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


class PoolsSnapshot:
    """The window's pools at one moment, not yet merged: the sealed buckets' pool sets
    (compacted; never written again), a copy of the open bucket's, and the held-out samples
    (arrays never written again). :meth:`build` merges them into one :class:`PoolSet` with
    its held-out sums (:meth:`SlidingWindow.pools`), in any thread: taking a snapshot costs
    a copy of one bucket, the merge (hundreds of ms at k = 100) runs where the fit runs."""

    __slots__ = ("held", "layout", "parts", "temperature")

    def __init__(self, layout: PoolLayout, temperature: float, parts: list[PoolSet],
                 held: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.layout, self.temperature, self.parts, self.held = layout, temperature, parts, held

    @property
    def fit_samples(self) -> int:
        """Samples in Algorithm 2's pools."""
        return sum(t.total for ps in self.parts for t in ps.tables.values())

    def build(self) -> PoolSet:
        """The merged pools and the held-out sums of ``g`` (binned at the temperature) and of
        ``f`` (a new object; the parts are not modified)."""
        out = PoolSet.merge_many(self.parts) if len(self.parts) > 1 else self.parts[0]
        if out is self.parts[0]:
            out = PoolSet(out.layout, {n: t.copy() for n, t in out.tables.items()},
                          temperature=self.temperature)
            out.holdout, out.holdout_raw = self.parts[0].holdout, self.parts[0].holdout_raw
        if self.held:
            from lpcal.binmap import scale_temperature

            x = np.concatenate([h[0] for h in self.held])
            y = np.concatenate([h[1] for h in self.held])
            lay = self.layout
            out.holdout = out.holdout.merge(
                HoldoutSums(lay.k, lay.lam).update(scale_temperature(x, self.temperature), y))
            out.holdout_raw = out.holdout_raw.merge(HoldoutSums(lay.k, lay.lam).update(x, y))
        return out

    def to_dict(self, *, packed: bool = False) -> dict[str, Any]:
        """The parts (``PoolSet.to_dict``, their own held-out sums included; ``packed``: their
        packed form) and the held-out samples (little-endian base64), unmerged: no merge on
        the caller's loop."""
        d: dict[str, Any] = {"layout": self.layout.to_dict(), "temperature": self.temperature,
                             "parts": [ps.to_dict(packed=packed) for ps in self.parts],
                             "held": None}
        if self.held:
            x = np.concatenate([h[0] for h in self.held])
            y = np.concatenate([h[1] for h in self.held])
            d["held"] = {"k": int(x.shape[1]), "x": _b64(x.astype("<f8")),
                         "y": _b64(y.astype("<i8"))}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolsSnapshot:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`."""
        try:
            layout = PoolLayout.from_dict(d["layout"])
            t = float(d["temperature"])
            parts = [PoolSet.from_dict(p) for p in d["parts"]]
            if not parts or any(p.layout != layout or p.temperature != t for p in parts):
                raise ValueError("parts do not match the layout or the temperature")
            held = []
            if d["held"] is not None:
                held = [_held_from_dict(d["held"], layout.k, None)]
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise InputError(f"malformed pools snapshot ({e})") from None
        return cls(layout, t, parts, held)


def _held_from_dict(hs: Mapping[str, Any], k_layout: int,
                    limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Held-out samples of their base64 form (``ValueError`` naming what is wrong)."""
    k = int(hs["k"])
    xb = base64.b64decode(hs["x"], validate=True)
    yb = base64.b64decode(hs["y"], validate=True)
    if len(xb) % 8 or len(yb) % 8:
        raise ValueError("held-out samples: truncated arrays")
    x, y = np.frombuffer(xb, "<f8"), np.frombuffer(yb, "<i8")
    if k != k_layout or x.size != k * y.size or (limit is not None and y.size > limit):
        raise ValueError(f"held-out samples of shape ({x.size}, {y.size}) for k = {k} and "
                         f"at most {limit} held-out samples")
    if y.size and (y.min() < 0 or y.max() >= k or not np.isfinite(x).all() or x.min() < 0):
        raise ValueError("held-out samples out of range")
    return x.reshape(y.size, k).astype(np.float64), y.astype(np.int64)


class Bucket:
    """The sums of one bucket: ``index`` (its number since the window was created), ``n``
    samples, ``grid`` (fit share), ``held`` (held-out share), ``pools`` (a
    :class:`PoolSet` binned at ``temperature``, or None before a pool temperature was set;
    its held-out sums stay empty) and the held-out samples routed while ``pools`` was set,
    raw (``held_x`` (m, k) float64, ``held_y`` (m,) int64; module docstring).

    Held-out samples that the bucket keeps anyway enter ``held`` when it is read (once per
    bucket, usually, instead of once per batch): :meth:`keep_held` with ``summed=False``. The
    loss grid's sums are exact integers, so they are the same whenever they are added."""

    __slots__ = ("_cert_chunks", "_held", "_held_chunks", "_held_lazy", "_sealed", "cert_n",
                 "grid", "index", "n", "pools", "temperature")

    def __init__(self, index: int) -> None:
        self.index = int(index)
        self.n = 0
        self.grid = TemperatureGrid()
        self._held = LossGrid()
        #: the last ``_held_lazy`` kept held-out samples are not in ``_held`` yet
        self._held_lazy = 0
        self.pools: PoolSet | None = None
        self.temperature: float | None = None
        self._held_chunks: list[tuple[np.ndarray, np.ndarray]] = []
        #: samples routed to the certification share (kept or not), and those kept
        self.cert_n = 0
        self._cert_chunks: list[tuple[np.ndarray, np.ndarray]] = []
        #: after :meth:`seal`: the pools sealed and the bytes of their tables
        self._sealed: tuple[PoolSet, int] | None = None

    def seal(self) -> None:
        """The bucket is full: no sample enters it any more. Its pools are compacted, and the
        bytes of their tables are kept (they no longer change, and :attr:`nbytes` is read
        for every sealed bucket each time a bucket is sealed under a byte budget)."""
        if self.pools is not None:
            self.pools.compact()
            self._sealed = (self.pools, self.pools.table_nbytes)

    def clear_pool_holdout(self, layout: PoolLayout) -> None:
        """Empty the held-out sums of the pools (a bucket past ``holdout_buckets``)."""
        self.pools.holdout = HoldoutSums(layout.k, layout.lam)
        self.pools.holdout_raw = HoldoutSums(layout.k, layout.lam)

    @property
    def held(self) -> LossGrid:
        """The held-out share's loss grid (kept samples not summed yet are added first)."""
        self.sum_held()
        return self._held

    def sum_held(self) -> None:
        """Add the kept held-out samples not summed yet to the loss grid."""
        if self._held_lazy:
            x, y = self.held_samples(self._held_chunks[0][0].shape[1])
            m, self._held_lazy = self._held_lazy, 0
            self._held.update(x[x.shape[0] - m:], y[y.size - m:])

    @held.setter
    def held(self, grid: LossGrid) -> None:
        self._held, self._held_lazy = grid, 0

    def keep_held(self, x: np.ndarray, y: np.ndarray, *, summed: bool = True) -> None:
        """Keep held-out samples (copies) for the certificate's sums. ``summed=False``: they
        are not in :attr:`held` yet, and enter it when it is next read."""
        if y.size:
            self._held_chunks.append((np.array(x, dtype=np.float64),
                                      np.array(y, dtype=np.int64)))
            if not summed:
                self._held_lazy += int(y.size)

    def held_samples(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The held-out samples kept, in arrival order (one array each)."""
        if len(self._held_chunks) != 1:
            xs = [c[0] for c in self._held_chunks] or [np.zeros((0, k))]
            ys = [c[1] for c in self._held_chunks] or [np.zeros(0, np.int64)]
            self._held_chunks = [(np.concatenate(xs), np.concatenate(ys))]
        return self._held_chunks[0]

    def drop_held(self) -> None:
        """Drop the kept held-out samples (summed into the loss grid first)."""
        self.sum_held()
        self._held_chunks = []

    @property
    def n_held(self) -> int:
        return sum(int(c[1].size) for c in self._held_chunks)

    def keep_cert(self, x: np.ndarray, y: np.ndarray) -> None:
        """Keep samples of the certification share (copies; module docstring)."""
        self.cert_n += int(y.size)
        if y.size:
            self._cert_chunks.append((np.array(x, dtype=np.float64),
                                      np.array(y, dtype=np.int64)))

    def cert_samples(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The certification share's samples kept, in arrival order (one array each)."""
        if len(self._cert_chunks) != 1:
            xs = [c[0] for c in self._cert_chunks] or [np.zeros((0, k))]
            ys = [c[1] for c in self._cert_chunks] or [np.zeros(0, np.int64)]
            self._cert_chunks = [(np.concatenate(xs), np.concatenate(ys))]
        return self._cert_chunks[0]

    def drop_cert(self) -> None:
        self._cert_chunks = []

    @property
    def n_cert(self) -> int:
        """Certification samples kept (``cert_n`` counts those routed, kept or dropped)."""
        return sum(int(c[1].size) for c in self._cert_chunks)

    @property
    def nbytes(self) -> int:
        ps, sealed = self.pools, self._sealed
        if ps is None:
            pools = 0
        elif sealed is not None and sealed[0] is ps:
            pools = sealed[1] + ps.holdout_nbytes
        else:
            pools = ps.nbytes
        return (self.grid.nll.nbytes + self._held.nbytes + pools
                + sum(x.nbytes + y.nbytes for x, y in self._held_chunks)
                + sum(x.nbytes + y.nbytes for x, y in self._cert_chunks))

    def to_dict(self, *, packed: bool = False) -> dict[str, Any]:
        """JSON-safe dict (``packed``: the pools' packed form, :meth:`PoolSet.to_dict`)."""
        d = {"index": self.index, "n": self.n, "grid": self.grid.to_dict(),
             "held": self.held.to_dict(packed=packed), "temperature": self.temperature,
             "pools": None if self.pools is None else self.pools.to_dict(packed=packed)}
        if self._held_chunks:
            k = self._held_chunks[0][0].shape[1]
            x, y = self.held_samples(k)
            d["held_samples"] = {"k": k, "x": _b64(x.astype("<f8")),
                                 "y": _b64(y.astype("<i8"))}
        if self.cert_n:  # the certification share (absent: none, as written before it)
            d["cert"] = {"n": self.cert_n}
            if self._cert_chunks:
                x, y = self.cert_samples(self._cert_chunks[0][0].shape[1])
                d["cert"].update(k=int(x.shape[1]), x=_b64(x.astype("<f8")),
                                 y=_b64(y.astype("<i8")))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], layout: PoolLayout) -> Bucket:
        try:
            b = cls(int(d["index"]))
            b.n = int(d["n"])
            b.grid = TemperatureGrid.from_dict(d["grid"])
            b.held = LossGrid.from_dict(d["held"])
            t = d["temperature"]
            b.temperature = None if t is None else float(t)
            if d["pools"] is not None:
                b.pools = PoolSet.from_dict(d["pools"])
            hs = d.get("held_samples")
            if hs is not None:
                b.keep_held(*_held_from_dict(hs, layout.k, b.held.n))
            cs = d.get("cert")
            if cs is not None:
                if "x" in cs:
                    b.keep_cert(*_held_from_dict(cs, layout.k, int(cs["n"])))
                b.cert_n = int(cs["n"])
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise InputError(f"malformed window bucket ({e})") from None
        if b.pools is not None and (b.pools.layout != layout
                                    or b.pools.temperature != b.temperature):
            raise InputError(f"window bucket {b.index}: pools do not match the window's "
                             "layout or the bucket's temperature")
        if b.n < 0 or b.grid.n + b.grid.skipped + b.held.n + b.cert_n != b.n:
            raise InputError(f"window bucket {b.index}: counts do not add up to n={b.n}")
        return b

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bucket):
            return NotImplemented
        return ((self.index, self.n, self.temperature) == (other.index, other.n,
                                                             other.temperature)
                and self.grid == other.grid and self.held == other.held
                and self.pools == other.pools and self.cert_n == other.cert_n
                and _same_samples(self.held_samples(1) if self._held_chunks else None,
                                  other.held_samples(1) if other._held_chunks else None)
                and _same_samples(self.cert_samples(1) if self._cert_chunks else None,
                                  other.cert_samples(1) if other._cert_chunks else None))


class SlidingWindow:
    """A ring of at most ``n_buckets`` :class:`Bucket` of ``bucket_size`` samples each
    (module docstring); ``layout`` routes samples (warm-up must be 0, a held-out share > 0).

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.pools import PoolLayout
    >>> from lpcal.window import SlidingWindow
    >>> lay = PoolLayout(3, 10, 1, "shared", {"mu": 7, "PE0": 7}, holdout=6)
    >>> w = SlidingWindow(lay, bucket_size=100, n_buckets=3)
    >>> rng = np.random.default_rng(0)
    >>> f = rng.dirichlet(np.ones(3), 450); y = rng.integers(0, 3, 450)
    >>> w.add(rng.random(450), f, y)
    >>> [b.n for b in w.buckets], w.n            # 450 samples, the last 3 buckets kept
    ([100, 100, 50], 250)
    >>> w.reset_after(w.buckets[-1].index); w.n  # a drift: nothing before it counts
    0
    """

    def __init__(self, layout: PoolLayout, *, bucket_size: int = 1_000,
                 n_buckets: int = 32, holdout_buckets: int | None = None,
                 cert_share: float = 0.0, cert_buckets: int | None = None) -> None:
        if layout.warmup or not layout.holdout:
            raise InputError("a sliding window needs a layout without warm-up and with a "
                             f"held-out share; got warmup={layout.warmup}, "
                             f"holdout={layout.holdout}")
        if bucket_size < 1 or n_buckets < 1 or (holdout_buckets is not None
                                                 and holdout_buckets < 1):
            raise InputError(f"bucket_size, n_buckets and holdout_buckets must be >= 1, got "
                             f"{bucket_size}, {n_buckets}, {holdout_buckets}")
        if not 0.0 <= cert_share < 1.0:
            raise InputError(f"cert_share must be in [0, 1), got {cert_share!r}")
        if cert_buckets is not None and cert_buckets < 1:
            raise InputError(f"cert_buckets must be >= 1, got {cert_buckets!r}")
        self.holdout_buckets = None if holdout_buckets is None else int(holdout_buckets)
        #: share of the held-out samples routed to the certification share (module docstring)
        self.cert_share = float(cert_share)
        #: newest buckets that keep their certification samples (None: ``holdout_buckets``)
        self.cert_buckets = self.holdout_buckets if cert_buckets is None else int(cert_buckets)
        self.layout = layout
        self.bucket_size = int(bucket_size)
        self.n_buckets = int(n_buckets)
        self.buckets: list[Bucket] = [Bucket(0)]
        self.temperature: float | None = None
        #: rows added with ``defer=True`` and not yet summed (:meth:`add`), in order, and the
        #: warm-up sums they go to
        self._deferred: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._deferred_n = 0
        self._deferred_warm: WarmupSums | None = None

    # ------------------------------------------------------------------ filling
    @property
    def open(self) -> Bucket:
        """The bucket being filled (the newest). Its sums leave out rows still deferred
        (:meth:`add`); its ``index`` is final (deferred rows never open a bucket)."""
        return self.buckets[-1]

    def flush(self) -> None:
        """Sum the rows deferred by :meth:`add` into the open bucket (and their warm-up sums):
        every method that reads or changes the buckets' sums calls it first
        (:func:`flush_many` flushes many windows in one pass)."""
        if self._deferred:
            parts, _, warm = self._take_deferred()
            self._add_to(self.open, *_concat_parts(parts), warm)

    def _take_deferred(self) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], int,
                                      WarmupSums | None]:
        """The deferred parts ``(u, x, y)`` in order, their rows and their warm-up sums; none
        are left deferred."""
        out = (self._deferred, self._deferred_n, self._deferred_warm)
        self._deferred, self._deferred_n, self._deferred_warm = [], 0, None
        return out

    @property
    def routing_key(self) -> tuple:
        """What routes a sample (classes, the layout's shares, the certification share):
        windows with equal keys send every routing uniform to the same share."""
        lay = self.layout
        return (lay.k, len(lay.names), lay.cumulative_weights().tobytes(), self.cert_share)

    def set_temperature(self, temperature: float | None) -> None:
        """Bin Algorithm 2's pools at ``temperature`` from the next sample on (None: stop
        filling pools). The open bucket's pools restart at the new temperature (they would
        mix two binnings); sealed buckets keep theirs, used only at their own temperature."""
        self.flush()
        t = None if temperature is None else float(temperature)
        self.temperature = t
        b = self.open
        b.temperature = t
        b.pools = None if t is None else PoolSet(self.layout, temperature=t)
        b.drop_held()  # they went with the pools of the old binning

    def _start_bucket(self) -> None:
        self.open.seal()
        b = Bucket(self.open.index + 1)
        self.buckets.append(b)
        if len(self.buckets) > self.n_buckets:
            del self.buckets[0]
        if self.holdout_buckets is not None and len(self.buckets) > self.holdout_buckets:
            old = self.buckets[-1 - self.holdout_buckets]
            old.drop_held()
            if old.pools is not None and old.pools.holdout.n:  # a state written with sums
                old.clear_pool_holdout(self.layout)
        if self.cert_buckets is not None and len(self.buckets) > self.cert_buckets:
            self.buckets[-1 - self.cert_buckets].drop_cert()
        if self.temperature is not None:
            b.temperature = self.temperature
            b.pools = PoolSet(self.layout, temperature=self.temperature)

    def add(self, uniforms: np.ndarray, probs: np.ndarray, labels: np.ndarray, *,
            warmup: WarmupSums | None = None, defer: bool = False) -> None:
        """Add samples in order (validated ``probs`` (n, k), labels, routing uniforms),
        sealing buckets at their exact boundaries. ``warmup``: also add the fit share to these
        warm-up sums (the grid's exponentials are computed once for both: the bucket's grid
        gets the very sums the warm-up's grid does).

        ``defer``: keep copies of the rows and sum them later, together with the rows deferred
        after them, at the next call without ``defer`` or the next method that reads or changes
        the sums (:meth:`flush`): one pass over many small batches instead of one per batch.
        Rows are deferred only while they fit in the open bucket (with the same ``warmup``);
        otherwise everything is summed at once. Every sum is an exact integer and the kept
        samples are concatenated in arrival order, so the state after the flush is the very
        state the rows summed one call at a time would give. Deferred rows count in :attr:`n`
        and :attr:`nbytes`."""
        y = np.asarray(labels, dtype=np.int64)
        n = y.shape[0]
        x = np.asarray(probs, dtype=np.float64)
        u = np.asarray(uniforms, dtype=np.float64)
        if x.shape != (n, self.layout.k) or u.shape != (n,):
            raise InputError(f"SlidingWindow.add: expected probs (n, {self.layout.k}), labels "
                             f"and uniforms (n,); got {x.shape}, {y.shape}, {u.shape}")
        if not n or (defer and self.defer(u, x, y, warmup)):
            return
        if self._deferred and self._deferred_warm is warmup:
            # the rows that fit in the open bucket join the deferred ones: one pass
            m = min(n, self.bucket_size - self.open.n - self._deferred_n)
            if m > 0:
                self._deferred.append((u[:m], x[:m], y[:m]))  # summed now: no copy
                self._deferred_n += m
                u, x, y, n = u[m:], x[m:], y[m:], n - m
        self.flush()
        a = 0
        while a < n:
            if self.open.n >= self.bucket_size:
                self._start_bucket()
            b = min(n, a + self.bucket_size - self.open.n)
            self._add_to(self.open, u[a:b], x[a:b], y[a:b], warmup)
            a = b

    def defer(self, u: np.ndarray, x: np.ndarray, y: np.ndarray,
              warmup: WarmupSums | None) -> bool:
        """:meth:`add` with ``defer=True`` for rows already validated (float64 ``x`` (n, k),
        int64 ``y`` and float64 ``u`` (n,), ``n >= 1``): keep copies of them if they may be
        deferred (they fit in the open bucket, with the same ``warmup``; a full open bucket
        with nothing deferred is followed by a new one first, as :meth:`add` does); False if
        not (then no row was taken: :meth:`add` them)."""
        n = y.shape[0]
        b = self.buckets[-1]
        if b.n >= self.bucket_size and not self._deferred:  # as add() would: open the next
            self._start_bucket()
            b = self.buckets[-1]
        if ((self._deferred_warm is warmup or not self._deferred)
                and b.n + self._deferred_n + n <= self.bucket_size):
            self._deferred.append((u.copy(), x.copy(), y.copy()))
            self._deferred_n += n
            self._deferred_warm = warmup
            return True
        return False

    def _add_to(self, bucket: Bucket, u: np.ndarray, x: np.ndarray, y: np.ndarray,
                warmup: WarmupSums | None) -> None:
        self._add_runs([(bucket, warmup)], u, x, y, [int(y.size)])

    def _add_runs(self, targets: list[tuple[Bucket, WarmupSums | None]], u: np.ndarray,
                  x: np.ndarray, y: np.ndarray, counts: list[int]) -> None:
        """Add the ``j``-th run of ``counts`` rows (validated, in order) to ``targets[j]``'s
        bucket and warm-up sums, routed as this window routes (every target's window has its
        :attr:`routing_key`). The temperature kernels run once over all runs (their
        ``update_runs``), each bucket getting the sums of its own rows, to the bit. The
        per-target bookkeeping is Python ints: one target (every add but
        :func:`flush_many`'s) costs no extra numpy call."""
        m = len(targets)
        owner = np.repeat(np.arange(m), counts) if m > 1 else None

        def split(mask: np.ndarray) -> tuple[np.ndarray, list[int]]:
            """The rows of ``mask`` and how many of them are each target's, in order."""
            idx = np.flatnonzero(mask)
            if owner is None:
                return idx, [idx.size]
            return idx, np.bincount(owner[idx], minlength=m).tolist()

        route = self.layout.route_uniforms(u)
        fit = route < len(self.layout.names)
        cert = self.certifying(u) & ~fit
        if self.cert_share:
            ci, cn = split(cert)
            for (bucket, _), (xc, yc) in zip(targets, _runs_of(cn, x[ci], y[ci])):
                bucket.keep_cert(xc, yc)
        fi, fn = split(fit)
        _add_fit_share(targets, route[fi], x[fi], y[fi], fn)
        hi, hn = split(~fit & ~cert)
        _add_test_share(targets, x[hi], y[hi], hn)
        for (bucket, _), c in zip(targets, counts):
            bucket.n += c

    def testing(self, u: np.ndarray) -> np.ndarray:
        """Which routing uniforms go to the test share (held out, not certifying): ``a <= u <
        c`` for the fit share's end ``a`` and the certification share's start ``c``, the very
        mask of :meth:`lpcal.pools.PoolLayout.route_uniforms` and :meth:`certifying` (one
        comparison each instead of a search)."""
        u = np.asarray(u, dtype=np.float64)
        cw = self.layout.cumulative_weights()
        a = cw[len(self.layout.names) - 1]
        out = u >= a
        if self.cert_share:
            out &= u < 1.0 - (1.0 - a) * self.cert_share
        return out

    def certifying(self, u: np.ndarray) -> np.ndarray:
        """Which routing uniforms go to the certification share: the top ``cert_share`` of
        the held-out share's interval of ``u`` (so a subset of the held-out share)."""
        u = np.asarray(u, dtype=np.float64)
        if not self.cert_share:
            return np.zeros(u.shape, dtype=bool)
        cw = self.layout.cumulative_weights()
        return u >= 1.0 - (1.0 - cw[len(self.layout.names) - 1]) * self.cert_share

    def reset_after(self, index: int) -> None:
        """Keep only the buckets with an index above ``index`` (after a drift at bucket
        ``index``: only later samples count). If the open bucket is dropped, a new one opens
        (its pools at the current temperature)."""
        self.flush()
        keep = [b for b in self.buckets if b.index > index]
        if keep:
            self.buckets = keep
            return
        nxt = max(self.open.index, int(index)) + 1
        self.buckets = [Bucket(nxt)]
        if self.temperature is not None:
            self.open.temperature = self.temperature
            self.open.pools = PoolSet(self.layout, temperature=self.temperature)

    # ------------------------------------------------------------------ reading
    @property
    def n(self) -> int:
        """Samples in the window (deferred rows included)."""
        return sum(b.n for b in self.buckets) + self._deferred_n

    def grid(self) -> TemperatureGrid:
        """The fit share's temperature grid over the window."""
        self.flush()
        return tree_sum([b.grid for b in self.buckets], TemperatureGrid.merge)

    def held(self) -> LossGrid:
        """The held-out share's loss grid over the window."""
        self.flush()
        return tree_sum([b.held for b in self.buckets], LossGrid.merge)

    def held_mark(self) -> tuple[int, int]:
        """Where the held-out samples kept from now on start, for :meth:`held_since`:
        ``(index of the open bucket, held-out samples it keeps now)``."""
        self.flush()
        b = self.open
        return b.index, b.n_held

    def held_since(self, mark: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The held-out samples kept after ``mark`` (:meth:`held_mark`), oldest first:
        ``(probs (m, k), labels (m,))``. Those of buckets dropped since are gone with them."""
        self.flush()
        index, count = mark
        k = self.layout.k
        parts = []
        for b in self.buckets:
            if b.index < index or not b.n_held:
                continue
            x, y = b.held_samples(k)
            parts.append((x[count:], y[count:]) if b.index == index else (x, y))
        if not parts:
            return np.zeros((0, k)), np.zeros(0, np.int64)
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def cert_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """The certification share's samples kept in the window (those of the newest
        ``holdout_buckets`` buckets), oldest first: ``(probs (m, k), labels (m,))``."""
        self.flush()
        k = self.layout.k
        parts = [b.cert_samples(k) for b in self.buckets if b.n_cert]
        if not parts:
            return np.zeros((0, k)), np.zeros(0, np.int64)
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    @property
    def n_cert(self) -> int:
        """Certification samples kept in the window (:meth:`cert_samples`' rows)."""
        self.flush()
        return sum(b.n_cert for b in self.buckets)

    def pools(self, temperature: float | None = None) -> PoolSet | None:
        """Algorithm 2's pools and held-out sums over the window's buckets binned at
        ``temperature`` (default: the current pool temperature); None if there are none."""
        snap = self.snapshot(temperature)
        return None if snap is None else snap.build()

    def snapshot(self, temperature: float | None = None) -> PoolsSnapshot | None:
        """What :meth:`pools` merges, frozen now and merged later (:class:`PoolsSnapshot`);
        None if no bucket has pools at ``temperature`` (default: the pool temperature)."""
        self.flush()
        t = self.temperature if temperature is None else float(temperature)
        mine = [b for b in self.buckets if b.pools is not None and b.temperature == t]
        if t is None or not mine:
            return None
        parts = []
        for b in mine:
            b.pools.compact()
            ps = b.pools
            if b is self.open:  # still filling: copy it
                ps = PoolSet(ps.layout, {n: tb.copy() for n, tb in ps.tables.items()},
                             temperature=t)
            else:  # sealed: a wrapper, so a later reset of its attributes is not seen
                ps = PoolSet(ps.layout, dict(ps.tables), temperature=t)
            ps.holdout, ps.holdout_raw = b.pools.holdout, b.pools.holdout_raw
            parts.append(ps)
        held = [b.held_samples(self.layout.k) for b in mine if b.n_held]
        return PoolsSnapshot(self.layout, t, parts, held)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays of every bucket, and of the rows deferred (:meth:`add`)."""
        return sum(b.nbytes for b in self.buckets) + sum(
            u.nbytes + x.nbytes + y.nbytes for u, x, y in self._deferred)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self, *, packed: bool = False, memo: Memo | None = None) -> dict[str, Any]:
        """JSON-safe dict; ``packed``: pools as packed arrays (:meth:`PoolSet.to_dict`).

        ``memo(owner, refs, make)`` (optional; the daemon's checkpoint cache) returns what
        ``make()`` returned for ``owner`` the last time ``refs`` were the same: each sealed
        bucket (all but the open one) is encoded once while it stays as it is (its sample
        and held-out counts, temperature, pools and held-out sums, which change when it leaves
        the held-out buckets)."""
        self.flush()
        buckets: list[Any] = []
        for i, b in enumerate(self.buckets):
            if memo is None or i == len(self.buckets) - 1:
                buckets.append(b.to_dict(packed=packed))
                continue
            pools = b.pools
            refs = (packed, b.n, b.n_held, b.n_cert, b.temperature, pools,
                    None if pools is None else pools.holdout,
                    None if pools is None else pools.holdout_raw)
            buckets.append(memo(b, refs, lambda b=b: b.to_dict(packed=packed)))
        return {"layout": self.layout.to_dict(), "bucket_size": self.bucket_size,
                "n_buckets": self.n_buckets, "holdout_buckets": self.holdout_buckets,
                "cert_share": self.cert_share, "cert_buckets": self.cert_buckets,
                "temperature": self.temperature, "buckets": buckets}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SlidingWindow:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`."""
        try:
            hb = d.get("holdout_buckets")
            out = cls(PoolLayout.from_dict(d["layout"]), bucket_size=int(d["bucket_size"]),
                      n_buckets=int(d["n_buckets"]),
                      holdout_buckets=None if hb is None else int(hb),
                      cert_share=float(d.get("cert_share", 0.0)),
                      cert_buckets=None if d.get("cert_buckets") is None
                      else int(d["cert_buckets"]))
            t = d["temperature"]
            out.temperature = None if t is None else float(t)
            out.buckets = [Bucket.from_dict(b, out.layout) for b in d["buckets"]]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"malformed sliding window ({e})") from None
        idx = [b.index for b in out.buckets]
        if not idx or idx != sorted(set(idx)) or len(idx) > out.n_buckets:
            raise InputError(f"malformed sliding window (bucket indices {idx})")
        if any(b.n > out.bucket_size for b in out.buckets) or any(
                b.n != out.bucket_size for b in out.buckets[:-1]):
            raise InputError("malformed sliding window (a sealed bucket is not full)")
        for b in out.buckets[:-1]:
            b.seal()
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlidingWindow):
            return NotImplemented
        self.flush()
        other.flush()
        return (self.layout == other.layout and self.bucket_size == other.bucket_size
                and self.n_buckets == other.n_buckets
                and self.holdout_buckets == other.holdout_buckets
                and self.cert_share == other.cert_share
                and self.cert_buckets == other.cert_buckets
                and self.temperature == other.temperature
                and self.buckets == other.buckets)

    def __repr__(self) -> str:
        return (f"SlidingWindow(n={self.n}, buckets={len(self.buckets)}/{self.n_buckets}, "
                f"bucket_size={self.bucket_size}, temperature={self.temperature})")


#: Rows :func:`flush_many` sums in one pass at most, by default: its temporary arrays (a copy
#: of the rows, their routing and logarithms: about 250 bytes a row at k = 10) stay below
#: about 16 MB.
FLUSH_ROWS = 1 << 16


def flush_many(windows: Iterable[SlidingWindow], *, max_rows: int = FLUSH_ROWS) -> None:
    """:meth:`SlidingWindow.flush` of every window in ``windows``, in one vectorised pass per
    routing (:attr:`SlidingWindow.routing_key`) and ``max_rows`` rows.

    A daemon replica holding many models defers each model's few rows per offer
    (:meth:`SlidingWindow.add`); summed one window at a time, the temperature kernels (the
    warm-up scores, the grid NLL, the held-out loss grid) cost 0.15 to 0.2 ms of numpy calls
    per window whatever its rows (k = 10, measured), which at thousands of models is most of
    the ingest's time. Here the rows of all windows are concatenated and each kernel runs once
    over them as runs, one per window (:func:`lpcal.precalibrate.run_bounds`): every window's
    state afterwards is the one its own flush would leave, to the bit (every per-sample term is
    an integer computed from its own row, and integer sums do not depend on their order;
    tested). A window given twice is flushed once."""
    groups: dict[tuple, list[SlidingWindow]] = {}
    seen: set[int] = set()
    for w in windows:
        if w._deferred and id(w) not in seen:
            seen.add(id(w))
            groups.setdefault(w.routing_key, []).append(w)
    for ws in groups.values():
        batch: list[SlidingWindow] = []
        rows = 0
        for w in ws:
            batch.append(w)
            rows += w._deferred_n
            if rows >= max_rows or w is ws[-1]:
                _flush_batch(batch)
                batch, rows = [], 0


def _flush_batch(ws: list[SlidingWindow]) -> None:
    """Flush windows of one routing in one pass of :meth:`SlidingWindow._add_runs`."""
    if len(ws) == 1:
        ws[0].flush()
        return
    targets, parts, counts = [], [], []
    for w in ws:
        own, n, warm = w._take_deferred()
        parts += own
        counts.append(n)
        targets.append((w.open, warm))
    ws[0]._add_runs(targets, *_concat_parts(parts), counts)


def _concat_parts(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Deferred parts ``(u, x, y)`` as one array each, in order (a single part as it is)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def _add_fit_share(targets: list[tuple[Bucket, WarmupSums | None]], route: np.ndarray,
                   x: np.ndarray, y: np.ndarray, counts: list[int]) -> None:
    """The fit share's rows, ``counts[j]`` of them ``targets[j]``'s, in order: the warm-up
    sums and the bucket's grid of targets warming up, the grid of the others, and the pools
    (binned at each bucket's temperature) of buckets that have them."""
    warm = [w is not None for _, w in targets]
    pooled = [b.pools is not None for b, _ in targets]
    if not all(warm) or any(pooled):
        with np.errstate(divide="ignore"):
            log_f = np.log(x)  # for the grid and the binning at the pool temperature
    if any(warm):
        rows = _rows_of(warm, counts)
        update_warmup_runs([w for _, w in targets if w is not None],
                           [b.grid for b, w in targets if w is not None],
                           x[rows], y[rows], _chosen(counts, warm))
    if not all(warm):
        cold = [not w for w in warm]
        rows = _rows_of(cold, counts)
        nll, summed, skipped = grid_nll_runs(x[rows], y[rows], _chosen(counts, cold),
                                             log_f[rows])
        for j, b in enumerate(b for (b, w) in targets if w is None):
            if summed[j] or skipped[j]:
                b.grid.add_sums(nll[j], int(summed[j]), int(skipped[j]))
    if any(pooled):
        rows = _rows_of(pooled, counts)
        buckets = [b for b, _ in targets if b.pools is not None]
        n = _chosen(counts, pooled)
        # scale_temperature's values, row by row at each bucket's temperature
        t = (np.repeat([b.temperature for b in buckets], n)[:, None] if len(targets) > 1
             else buckets[0].temperature)
        parts = _runs_of(n, route[rows], softmax_rows(log_f[rows] / t), y[rows])
        for b, (r, q, yb), c in zip(buckets, parts, n):
            if c:
                b.pools.add(r, q, yb)


def _add_test_share(targets: list[tuple[Bucket, WarmupSums | None]], x: np.ndarray,
                    y: np.ndarray, counts: list[int]) -> None:
    """The test share's rows, ``counts[j]`` of them ``targets[j]``'s: summed into the loss
    grid of buckets without pools, kept (summed when read) by buckets with pools."""
    lazy = [b.pools is None for b, _ in targets]
    if any(lazy):
        rows = _rows_of(lazy, counts)
        update_loss_runs([b.held for b, _ in targets if b.pools is None], x[rows], y[rows],
                         _chosen(counts, lazy))
    if not all(lazy):
        for (b, _), (xb, yb) in zip(targets, _runs_of(counts, x, y)):
            if b.pools is not None:
                b.keep_held(xb, yb, summed=False)


def _runs_of(counts: list[int], *arrays: np.ndarray):
    """Per run of ``counts[j]`` rows, in order: the run's slice of each array (views)."""
    a = 0
    for c in counts:
        yield tuple(arr[a:a + c] for arr in arrays)
        a += c


def _chosen(values: list[int], chosen: list[bool]) -> list[int]:
    return [v for v, c in zip(values, chosen) if c]


def _rows_of(chosen: list[bool], counts: list[int]) -> slice | np.ndarray:
    """The rows of the chosen targets among rows laid out by target, ``counts[j]`` rows
    each: a slice when all are chosen."""
    if all(chosen):
        return slice(None)
    return np.repeat(chosen, counts)
