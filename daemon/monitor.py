"""Windowed calibration monitoring of one model, for the raw and the calibrated predictor. Pure.

For each predictor ``f`` (``raw``: the model's probabilities; ``calibrated``: after the current
bin map) the monitor keeps additive sums over a sliding window of recent joined samples:

* per bin ``v = R(f(x))`` (level set at the model's ``lambda``) and class ``j``, with
  ``Z_i = (f(x_i)_j - y_ij) * 1[R(f(x_i)) = v]``: the count ``N_v``, ``S_vj = sum Z_i`` and
  ``Q_vj = sum Z_i^2``. The plug-in lp calibration error (as :func:`lpcal.metrics.err_p`) is
  ``Err_p = ( sum_vj |S_vj / n|^p )^(1/p)`` (max for ``p = inf``);
* top-label ECE (15 equal-width confidence bins, as :func:`lpcal.metrics.top_label_ece`):
  per bin ``sum (1[argmax f = y] - max f)``; ECE ``= sum_b |gap_b| / n``;
* Brier ``sum ||f - e_y||^2 / n`` and accuracy ``sum 1[argmax f = y] / n``;
* for the debiased statistics (:func:`block_statistics`): per confidence bin the count and sum of
  squared residuals, and, for the calibrated predictor, the classwise sums per (class, bin of
  ``f_j``) (:class:`Classwise`, ``360 k`` bytes per bucket, up to ``k =``
  :data:`CLASSWISE_MAX_K`).

**Change test.** With a :class:`daemon.drift.ChangeDetector` (``change``), the calibrated
samples are also cut into blocks of its ``block_samples``, counted from the last
``reset("calibrated")`` (a new bin map): each completed block's statistics are one observation
of the test. The current block's sums and the test's state are part of the snapshot.

**Noise and the confidence margin** (used by the drift trigger). Each cell mean
``Zbar_vj = S_vj / n`` has standard error ``se_vj = sqrt(s^2_vj / n)`` with the unbiased sample
variance ``s^2_vj = (Q_vj - S_vj^2 / n) / (n - 1)`` (all ``n`` samples, zeros outside the bin).
The *lower confidence bound* shrinks every cell by ``z`` standard errors before taking the norm::

    Err_p^lower(z) = ( sum_vj max(0, |Zbar_vj| - z se_vj)^p )^(1/p)

Each shrunk cell is below its true ``|E Z|`` with probability about ``Phi(z)``, so the bound
absorbs both the noise and the upward bias of the plug-in (which grows with the number of
cells, and is what would make a plain "estimate > threshold" rule fire on a well-calibrated
stream). ``margin(z) = Err_p - Err_p^lower(z)``. A bin seen once has ``se = |Zbar|``, so single
samples never count. ``stderr`` is the delta-method standard error of the plug-in (informative).

**Window**: the last ``window_samples`` samples (to a granularity of one bucket,
``ceil(N / n_buckets)`` samples) or, when ``window_seconds`` is set, the samples whose time falls
in the last ``n_buckets`` buckets of width ``T / n_buckets`` (event time; the clock is the largest
time seen). Buckets form a ring; each holds additive sums, so an update costs O(batch * k) and
an evaluation merges at most ``n_buckets`` buckets (O(window bins * k): call it on a timer, not
per event).

**Memory**: the sums take ``16 k + 16`` bytes per bin, bucket and predictor, so a window whose
samples fall in distinct bins costs up to ``2 (16 k + 16)`` bytes per sample (320 MB for 10,000
samples at k = 1000). With a byte budget (``max_bytes``) the oldest buckets are dropped while
the sums exceed it (the newest one too if it alone does): the window then covers fewer samples
than configured, counted in ``trimmed``. A sample window's bucket then also closes once it takes
half the budget, so the newest samples that fit are kept; a time window's bucket cannot close
early (its samples are placed by time), and one that alone exceeds the budget is dropped. A time
window without a budget is unbounded in samples. Evaluating merges the buckets into one more
copy of the window's sums, transiently.

**Small updates** (fewer than :data:`SMALL_UPDATE` samples, as when a batch spreads over many
models, or a model's staged slices are offered) do not pay the fixed cost of computing sums (a few dozen NumPy calls, whatever the
sample count): their rows are copied into their bucket (and the change test's block) and summed
in one vectorised pass once :data:`FLUSH_ROWS` of them wait there, when a block completes (so
the change test sees every block as it completes), or when anything reads the sums
(evaluation, snapshot, trimming). The bytes of the waiting rows (at most ``16 k + 32`` per
sample) count in :attr:`WindowMonitor.nbytes`, within :func:`sample_bytes`. Sums are additive,
so the result is the same as summing each update at once, up to float rounding; under a byte
budget a bucket closes at half of it counting the waiting rows' bytes, so where it closes may
differ (as it already depends on how updates are sliced).

State is the buckets' sums: ``to_dict``/``from_dict`` round-trip it exactly (arrays
are stored as base64 of their little-endian bytes). Bins are identified by their 64-bit row hash
(collision probability ~ bins^2 / 2^64; a collision would merge two bins' sums).

Usage::

    mon = WindowMonitor(k=3, lam=10, p=math.inf, window_samples=10_000)
    mon.update(probs, labels, ts, calibrated=binmap.apply(probs))
    stats = mon.evaluate(z=3.0)      # {"raw": WindowStats, "calibrated": WindowStats | None}
    stats["calibrated"].err_p, stats["calibrated"].lower, stats["raw"].ece
    stats["calibrated"].statistics()   # debiased ECEs, ..., each with its standard error
    mon.change.alarm                 # the change test (if one was given)
    mon.reset("calibrated")          # after a new bin map: measure it from scratch
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from daemon.drift import ChangeDetector
from lpcal.errors import InputError
from lpcal.levels import HashCollision, bin_rows, pairs_agree, run_starts
from lpcal.metrics import Estimate, binned_sq_error, l2_of_squared
from lpcal.metrics import lp_norm as _lp_norm

__all__ = ["CLASSWISE_MAX_K", "PREDICTORS", "CellSums", "Classwise", "WindowMonitor",
           "WindowStats", "block_statistics", "cell_bounds", "fixed_bytes", "flush_waiting",
           "largest", "sample_bytes"]

PREDICTORS = ("raw", "calibrated")
ECE_BINS = 15
_COMPACT_PARTS = 32
#: rows of small updates waiting in a bucket (or the change test's block) are summed at once
#: when this many wait there, or when the sums are read
FLUSH_ROWS = 512
#: an update of fewer samples is buffered as rows (copies) in its bucket and the change test's
#: block (see "Small updates" in the module docstring): every update that would not fill a
#: flush on its own, so a model's staged offers (:mod:`daemon.staging`, tens to hundreds of
#: samples) pay one vectorised pass per :data:`FLUSH_ROWS` rows instead of one per offer
SMALL_UPDATE = FLUSH_ROWS


#: float64 arrays of up to this many values have their largest taken as a Python list
#: (:func:`largest`): a NumPy reduction costs about 1 us whatever the size, the list a fifth
LIST_MAX = 64
_F64 = np.dtype(np.float64)
_NBYTES = attrgetter("nbytes")


def largest(a: Any) -> float:
    """``float(np.max(a))``, to the bit, for a non-empty array ``a`` (event times).

    A 1-d float64 array of at most :data:`LIST_MAX` values is reduced as a Python list. Python's
    ``max`` differs from NumPy's in two cases only, both left to NumPy: a NaN (NumPy returns NaN
    if any value is NaN, Python only if the first is; any NaN makes the sum NaN) and a largest
    value of zero (``0.0 == -0.0``: Python keeps the first of them, NumPy does not promise which).
    """
    if type(a) is not np.ndarray:
        return float(np.max(a))
    if a.dtype != _F64 or a.ndim != 1 or not 0 < a.size <= LIST_MAX:
        return float(a.max())  # the method: the same reduction without np.max's dispatch
    values = a.tolist()
    top = max(values)
    if top == 0.0 or math.isnan(sum(values)):  # a zero maximum, a NaN (or both infinities)
        return float(a.max())
    return top


# --------------------------------------------------------------------------- array codec


def _enc(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"dtype": le.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(le.tobytes()).decode("ascii")}


_DTYPES = {"<i8": np.int64, "<f8": np.float64}


def _dec(d: Mapping[str, Any], where: str) -> np.ndarray:
    try:
        dt = _DTYPES[d["dtype"]]
        shape = tuple(int(x) for x in d["shape"])
        raw = base64.b64decode(d["b64"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{where}: malformed array ({type(e).__name__}: {e})") from None
    if any(s < 0 for s in shape) or len(raw) != 8 * math.prod(shape):
        raise InputError(f"{where}: array of shape {shape} has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=np.dtype(d["dtype"])).astype(dt).reshape(shape)


# Packed sums (the checkpoint format ``lpcal.model_state/6``): the arrays of several
# :class:`CellSums` and :class:`Classwise` in one base64 string of little-endian bytes, in a
# fixed order whose lengths follow from ``k`` and each sums' bin count ``G``: per sums, ``gap``
# (15 float64), ``ece_n`` (15 int64), ``ece_q`` (15 float64), ``hashes`` and ``counts`` (G
# int64), ``s`` and ``q`` (G k float64); per classwise, ``n`` (15 k int64), ``s``, ``q`` (15 k
# float64). One base64 call and one dict per bucket instead of one per array.
_SUMS_ARRAYS = (("gap", "<f8"), ("ece_n", "<i8"), ("ece_q", "<f8"), ("hashes", "<i8"),
                ("counts", "<i8"), ("s", "<f8"), ("q", "<f8"))
_CW_ARRAYS = (("n", "<i8"), ("s", "<f8"), ("q", "<f8"))


def pack_sums(sums: list[CellSums | None], classwise: list[Classwise | None]
              ) -> dict[str, Any]:
    """``{"sums": [[n, brier, correct, G] | None, ...], "classwise": [0 | 1, ...],
    "data": base64}``: the packed form of ``sums`` (None: ``None``) and ``classwise``
    (None: 0), read by :func:`unpack_sums`."""
    meta: list[Any] = []
    raw: list[bytes] = []
    for s in sums:
        if s is None:
            meta.append(None)
            continue
        meta.append([s.n, s.brier, s.correct, int(s.hashes.size)])
        raw.extend(np.asarray(getattr(s, name), dtype=dt).tobytes() for name, dt in _SUMS_ARRAYS)
    flags = []
    for cw in classwise:
        flags.append(0 if cw is None else 1)
        if cw is not None:
            raw.extend(np.asarray(getattr(cw, name), dtype=dt).tobytes()
                       for name, dt in _CW_ARRAYS)
    return {"sums": meta, "classwise": flags,
            "data": base64.b64encode(b"".join(raw)).decode("ascii")}


def unpack_sums(d: Mapping[str, Any], k: int, where: str
                ) -> tuple[list[CellSums | None], list[Classwise | None]]:
    """Inverse of :func:`pack_sums` for sums of ``k`` classes, checked as
    :meth:`CellSums.from_dict` and :meth:`Classwise.from_dict` check theirs (array lengths
    against the decoded bytes before anything is allocated from them); :class:`InputError`
    names ``where``."""
    try:
        metas, flags, data = list(d["sums"]), list(d["classwise"]), d["data"]
        if type(data) is not str:
            raise TypeError("data is not a string")
        raw = base64.b64decode(data, validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{where}: malformed packed sums ({type(e).__name__}: {e})") from None
    if not 1 <= k <= 1 << 20:
        raise InputError(f"{where}: k={k}")
    rows = []
    for meta in metas:
        if meta is None:
            rows.append(None)
            continue
        if not (isinstance(meta, list) and len(meta) == 4 and type(meta[0]) is int
                and type(meta[1]) in (int, float) and type(meta[2]) is int
                and type(meta[3]) is int and meta[0] >= 0 and meta[3] >= 0):
            raise InputError(f"{where}: sums header {meta!r} is not [n, brier, correct, bins]")
        rows.append(meta)
    if any(f not in (0, 1) for f in flags):
        raise InputError(f"{where}: classwise flags {flags!r} are not 0 or 1")
    want = sum(8 * (3 * ECE_BINS + 2 * m[3] + 2 * m[3] * k) for m in rows if m is not None)
    want += sum(f * 8 * 3 * ECE_BINS * k for f in flags)
    if len(raw) != want:
        raise InputError(f"{where}: {len(raw)} bytes of packed sums, expected {want}")
    at = 0

    def take(dt: str, count: int) -> np.ndarray:
        nonlocal at
        a = np.frombuffer(raw, dtype=dt, count=count, offset=at)
        at += 8 * count
        return a.astype(_DTYPES[dt])

    sums: list[CellSums | None] = []
    for i, meta in enumerate(rows):
        if meta is None:
            sums.append(None)
            continue
        n, brier, correct, g = meta
        s = CellSums(k)
        s.n, s.brier, s.correct = n, float(brier), correct
        shapes = {"gap": (ECE_BINS,), "ece_n": (ECE_BINS,), "ece_q": (ECE_BINS,),
                  "hashes": (g,), "counts": (g,), "s": (g, k), "q": (g, k)}
        for name, dt in _SUMS_ARRAYS:
            shape = shapes[name]
            setattr(s, name, take(dt, math.prod(shape)).reshape(shape))
        if int(s.counts.sum()) != n or (s.counts <= 0).any():
            raise InputError(f"{where}: sums {i}: bin counts do not add up to n={n}")
        if int(s.ece_n.sum()) > n:
            raise InputError(f"{where}: sums {i}: ECE bin counts exceed n={n}")
        sums.append(s)
    cws: list[Classwise | None] = []
    for f in flags:
        if not f:
            cws.append(None)
            continue
        cw = Classwise(k)
        for name, dt in _CW_ARRAYS:
            setattr(cw, name, take(dt, k * ECE_BINS).reshape(k, ECE_BINS))
        if (cw.n.sum(axis=1) != cw.n[0].sum()).any():
            raise InputError(f"{where}: classwise sums: classes hold different sample counts")
        cws.append(cw)
    return sums, cws


def pack_one_sums(s: CellSums) -> list[Any]:
    """``[n, brier, correct, G, base64]``: one :class:`CellSums` packed as :func:`pack_sums`
    packs each of its sums (the checkpoint's unit: a monitor bucket holds several, each encoded
    once)."""
    d = pack_sums([s], [])
    return [*d["sums"][0], d["data"]]


def unpack_one_sums(item: Any, k: int, where: str) -> CellSums:
    """Inverse of :func:`pack_one_sums`, checked as :func:`unpack_sums` checks."""
    if not (isinstance(item, list) and len(item) == 5):
        raise InputError(f"{where}: packed sums are not [n, brier, correct, bins, data]")
    (s,), _ = _unpack_n({"sums": [item[:4]], "classwise": [], "data": item[4]}, k, 1, where, 0)
    return CellSums(k) if s is None else s  # (never None: the header was checked)


def _unpack_n(d: Mapping[str, Any], k: int, n: int, where: str, n_cw: int | None = None
              ) -> tuple[list[CellSums | None], list[Classwise | None]]:
    """:func:`unpack_sums` of exactly ``n`` sums and ``n_cw`` (default ``n``) classwise
    flags."""
    sums, cws = unpack_sums(d, k, where)
    n_cw = n if n_cw is None else n_cw
    if len(sums) != n or len(cws) != n_cw:
        raise InputError(f"{where}: {len(sums)} sums and {len(cws)} classwise, expected {n} "
                         f"and {n_cw}")
    return sums, cws


def fixed_bytes(k: int, n_buckets: int) -> int:
    """Bytes of a window's sums that do not grow with its samples: the calibrated predictor's
    classwise ECE sums (:class:`Classwise`, ``360 k`` bytes) in each bucket and in the change
    test's current block; 0 above :data:`CLASSWISE_MAX_K`."""
    return 0 if k > CLASSWISE_MAX_K else (n_buckets + 1) * 3 * 8 * ECE_BINS * int(k)


def sample_bytes(k: int) -> int:
    """Upper bound of the bytes one sample adds to a window's sums: ``16 k + 16`` for its bin
    (``S`` and ``Q`` rows, hash and count) in each of the two predictors' sums."""
    return 2 * (16 * int(k) + 16)


# --------------------------------------------------------------------------- sums


class _Rows:
    """Per-row quantities of one batch of validated rows ``x`` (n, k) with labels ``y``, computed
    once per :meth:`WindowMonitor.update` and summed per window bucket by
    :meth:`CellSums.from_rows`: the bin hashes of ``R(x)`` (folded ``h`` and the exact ``pair``),
    the top label's confidence and hit, ``x_iy``, ``||x_i||^2`` and the ECE bin of the top
    confidence."""

    __slots__ = ("conf", "cw_cell", "ece_bin", "fy", "h", "hit", "pair", "sq", "x", "y")

    def __init__(self, x: np.ndarray, y: np.ndarray, lam: int,
                 hashes: tuple[np.ndarray, np.ndarray] | None = None):
        n = x.shape[0]
        self.x, self.y = x, y
        self.h, self.pair = bin_rows(x, lam)[1:] if hashes is None else hashes
        idx = np.arange(n)
        pred = x.argmax(axis=1)
        self.conf = x[idx, pred]
        self.hit = (pred == y).astype(np.float64)
        self.fy = x[idx, y]
        self.sq = np.einsum("ij,ij->i", x, x)
        self.ece_bin = np.searchsorted(_ECE_INNER, self.conf, side="left")
        self.cw_cell: np.ndarray | None = None  # classwise cells, computed when first used

    def subset(self, sel: slice | np.ndarray) -> _Rows:
        """The rows ``sel`` (views for a slice), without computing anything again."""
        out = _Rows.__new__(_Rows)
        for name in ("conf", "ece_bin", "fy", "h", "hit", "pair", "sq", "x", "y"):
            setattr(out, name, getattr(self, name)[sel])
        out.cw_cell = None if self.cw_cell is None else self.cw_cell[sel]
        return out


_ECE_INNER = np.linspace(0.0, 1.0, ECE_BINS + 1)[1:-1]


class _Small(NamedTuple):
    """The rows of a small update (copies): raw ``x``, labels ``y``, the raw rows' bin hashes
    ``h``/``pair`` if the caller gave them, and the calibrated rows ``cal`` (or None)."""

    x: np.ndarray
    y: np.ndarray
    h: np.ndarray | None
    pair: np.ndarray | None
    cal: np.ndarray | None


def _segments(r: _Rows, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                         np.ndarray]:
    """Group the rows of ``r`` by (segment, bin): segment ``i`` is the rows
    ``bounds[i]:bounds[i + 1]``. Returns ``(inverse, group hashes, group starts per segment,
    segment of each row)``: ``inverse[row]`` is the row's group, groups are numbered by segment,
    then by hash (so each segment's groups are its sorted distinct hashes, as
    :func:`lpcal.levels.group_hashed` numbers them); rows of a group must share both exact
    hashes (checked, :class:`lpcal.levels.HashCollision` otherwise)."""
    n, nseg = r.h.shape[0], bounds.size - 1
    seg = np.repeat(np.arange(nseg), np.diff(bounds))
    # a stable sort: the first row of each group is its first occurrence
    order = (np.argsort(r.h, kind="stable") if nseg == 1
             else np.lexsort((r.h, seg)))
    hs, ss = r.h[order], seg[order]
    new = run_starts(hs)
    if nseg > 1:
        new[1:] |= ss[1:] != ss[:-1]
    gid = np.cumsum(new) - 1
    inv = np.empty(n, dtype=np.int64)
    inv[order] = gid
    first = order[new]
    if not pairs_agree(r.pair, first, inv):
        raise HashCollision("two distinct bins share a 64-bit hash")
    starts = np.searchsorted(ss[new], np.arange(nseg + 1))
    return inv, hs[new], starts, seg


def _segment_sums(r: _Rows, bounds: np.ndarray) -> list[CellSums]:
    """:class:`CellSums` of each segment ``bounds[i]:bounds[i + 1]`` (non-empty) of the rows
    ``r``: per bin ``v`` (sorted row hashes) the count ``N_v``, ``S_vj = sum (x_ij - 1[y_i =
    j])`` and ``Q_vj = sum (x_ij - 1[y_i = j])^2``, the latter as ``sum x_ij^2 - sum_{y_i = j}
    (2 x_ij - 1)``, and the scalar metric sums. Same statistics as
    :func:`lpcal.metrics.batch_stats` (up to float rounding), with ``np.bincount`` over the
    flattened (group, class) cells instead of the much slower unbuffered ``ufunc.at``.

    The one implementation of summing rows: one segment for an update's rows in a bucket,
    many for the waiting rows of many monitors (:func:`flush_waiting`). Every cell and bin is
    summed over its rows in row order, and each segment's scalars over its own rows, so a
    segment's sums are those of its rows alone, to the bit."""
    x, y = r.x, r.y
    k = x.shape[1]
    inv, uh, starts, seg = _segments(r, bounds)
    g = uh.size
    counts = np.bincount(inv, minlength=g).astype(np.int64)
    cells = (inv[:, None] * k + np.arange(k)).ravel()
    hit_cell = inv * k + y
    sums = np.bincount(cells, weights=x.ravel(), minlength=g * k)
    sums -= np.bincount(hit_cell, minlength=g * k)
    sq = np.bincount(cells, weights=(x * x).ravel(), minlength=g * k)
    sq -= np.bincount(hit_cell, weights=2.0 * r.fy - 1.0, minlength=g * k)
    sums, sq = sums.reshape(g, k), sq.reshape(g, k)
    nseg = bounds.size - 1
    res = r.hit - r.conf
    eb = seg * ECE_BINS + r.ece_bin
    m = nseg * ECE_BINS
    gap = np.bincount(eb, weights=res, minlength=m).astype(np.float64).reshape(nseg, ECE_BINS)
    ece_n = np.bincount(eb, minlength=m).astype(np.int64).reshape(nseg, ECE_BINS)
    ece_q = np.bincount(eb, weights=res * res, minlength=m).astype(np.float64).reshape(
        nseg, ECE_BINS)
    brier = r.sq - 2.0 * r.fy + 1.0
    one = nseg == 1
    out = []
    for i in range(nseg):
        a, b, ga, gb = int(bounds[i]), int(bounds[i + 1]), int(starts[i]), int(starts[i + 1])
        c = CellSums.__new__(CellSums)  # every field set here: no empty arrays to replace
        c.k = k
        # copies: a view would keep every segment's arrays alive as long as any one of them
        c.hashes, c.counts = uh[ga:gb].copy(), counts[ga:gb].copy()
        c.s, c.q = (sums, sq) if one else (sums[ga:gb].copy(), sq[ga:gb].copy())
        c.n = b - a
        c.brier = float(np.sum(brier[a:b]))
        c.correct = int(r.hit[a:b].sum())
        c.gap, c.ece_n, c.ece_q = gap[i].copy(), ece_n[i].copy(), ece_q[i].copy()
        out.append(c)
    return out


def _segment_classwise(r: _Rows, bounds: np.ndarray) -> list[Classwise]:
    """:class:`Classwise` sums of each segment ``bounds[i]:bounds[i + 1]`` of the rows ``r``
    (as :func:`_segment_sums`: one implementation, each cell summed over its rows in order)."""
    x, y = r.x, r.y
    k = x.shape[1]
    if r.cw_cell is None:  # class j, equal-width bin b of x_ij: cell j * ECE_BINS + b
        r.cw_cell = (np.searchsorted(_ECE_INNER, x, side="left")
                     + np.arange(k) * ECE_BINS)
    nseg = bounds.size - 1
    per = k * ECE_BINS
    cw = r.cw_cell
    if nseg > 1:
        cw = cw + (np.repeat(np.arange(nseg), np.diff(bounds)) * per)[:, None]
    m = nseg * per
    cells = cw.ravel()
    on_y = cw[np.arange(y.shape[0]), y]
    n = np.bincount(cells, minlength=m).reshape(nseg, k, ECE_BINS)
    s = (np.bincount(on_y, minlength=m)
         - np.bincount(cells, weights=x.ravel(), minlength=m)).reshape(nseg, k, ECE_BINS)
    q = (np.bincount(cells, weights=(x * x).ravel(), minlength=m)
         + np.bincount(on_y, weights=1.0 - 2.0 * r.fy, minlength=m)).reshape(nseg, k, ECE_BINS)
    out = []
    for i in range(nseg):
        c = Classwise(k)
        c.n += n[i]
        c.s += s[i]
        c.q += q[i]
        out.append(c)
    return out


class CellSums:
    """Additive per-(bin, class) sums ``N_v``, ``S_vj``, ``Q_vj`` plus the scalar metric sums."""

    __slots__ = ("brier", "correct", "counts", "ece_n", "ece_q", "gap", "hashes", "k", "n", "q",
                 "s")

    def __init__(self, k: int):
        self.k = int(k)
        self.hashes = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.s = np.zeros((0, self.k))
        self.q = np.zeros((0, self.k))
        self.n = 0
        self.brier = 0.0
        self.correct = 0
        self.gap = np.zeros(ECE_BINS)
        # debiased ECE sums: per confidence bin the count and the sum of squared residuals
        # (``gap`` is their sum). The classwise sums are kept apart (:class:`Classwise`).
        self.ece_n = np.zeros(ECE_BINS, dtype=np.int64)
        self.ece_q = np.zeros(ECE_BINS)

    @classmethod
    def from_batch(cls, probs: np.ndarray, labels: np.ndarray, lam: int) -> CellSums:
        """Sums of one batch of validated rows ``probs`` (n, k) and labels (n,)."""
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        if x.shape[0] == 0:
            return cls(x.shape[1])
        return cls.from_rows(_Rows(x, y, lam), slice(None))

    @classmethod
    def from_rows(cls, r: _Rows, sel: slice | np.ndarray) -> CellSums:
        """Sums of the rows ``sel`` (a non-empty slice or index array) of a batch's
        :class:`_Rows`."""
        sub = r.subset(sel)
        return _segment_sums(sub, np.array([0, sub.y.shape[0]]))[0]

    @classmethod
    def merge_all(cls, parts: list[CellSums], k: int) -> CellSums:
        """Sums of the union of all ``parts`` (one vectorised group-by)."""
        parts = [p for p in parts if p.n]
        if not parts:
            return cls(k)
        if len(parts) == 1:
            return parts[0]
        out = cls(k)
        h = np.concatenate([p.hashes for p in parts])
        # one stable sort by hash: each bin's rows in part order, bins by hash (what a sort
        # for np.unique and a stable sort of its inverse gave, in one sort)
        order = np.argsort(h, kind="stable")
        hs = h[order]
        starts = np.flatnonzero(run_starts(hs))
        out.hashes = hs[starts]
        out.counts = np.add.reduceat(np.concatenate([p.counts for p in parts])[order], starts)
        out.s = np.add.reduceat(np.concatenate([p.s for p in parts])[order], starts, axis=0)
        out.q = np.add.reduceat(np.concatenate([p.q for p in parts])[order], starts, axis=0)
        out.n = sum(p.n for p in parts)
        out.brier = float(sum(p.brier for p in parts))
        out.correct = sum(p.correct for p in parts)
        out.gap = np.sum([p.gap for p in parts], axis=0)
        out.ece_n = np.sum([p.ece_n for p in parts], axis=0)
        out.ece_q = np.sum([p.ece_q for p in parts], axis=0)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the per-bin arrays (``16 k + 16`` per bin; the fixed 15-bin arrays are not
        counted)."""
        return self.hashes.nbytes + self.counts.nbytes + self.s.nbytes + self.q.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "n": self.n, "brier": self.brier, "correct": self.correct,
                "gap": _enc(self.gap), "hashes": _enc(self.hashes), "counts": _enc(self.counts),
                "s": _enc(self.s), "q": _enc(self.q), "ece_n": _enc(self.ece_n),
                "ece_q": _enc(self.ece_q)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "sums") -> CellSums:
        try:
            out = cls(int(d["k"]))
            out.n, out.brier, out.correct = int(d["n"]), float(d["brier"]), int(d["correct"])
            arrays = {name: _dec(d[name], f"{where}.{name}")
                      for name in ("gap", "hashes", "counts", "s", "q")}
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed sums ({type(e).__name__}: {e})") from None
        g = arrays["hashes"].shape
        if (len(g) != 1 or arrays["counts"].shape != g or arrays["s"].shape != (g[0], out.k)
                or arrays["q"].shape != (g[0], out.k) or arrays["gap"].shape != (ECE_BINS,)):
            raise InputError(f"{where}: inconsistent array shapes")
        if int(arrays["counts"].sum()) != out.n or (arrays["counts"] <= 0).any():
            raise InputError(f"{where}: bin counts do not add up to n={out.n}")
        for name, a in arrays.items():
            setattr(out, name, a)
        # the ECE sums: absent from snapshots written before the debiased statistics (their
        # samples then count in no ECE bin: the debiased statistics cover the newer samples)
        for name in ("ece_n", "ece_q"):
            if name in d:
                a = _dec(d[name], f"{where}.{name}")
                if a.shape != (ECE_BINS,):
                    raise InputError(f"{where}.{name}: shape {a.shape}, expected ({ECE_BINS},)")
                setattr(out, name, a)
        if int(out.ece_n.sum()) > out.n:
            raise InputError(f"{where}: ECE bin counts exceed n={out.n}")
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CellSums):
            return NotImplemented
        return (self.k == other.k and self.n == other.n and self.brier == other.brier
                and self.correct == other.correct and np.array_equal(self.gap, other.gap)
                and np.array_equal(self.hashes, other.hashes)
                and np.array_equal(self.counts, other.counts)
                and np.array_equal(self.s, other.s) and np.array_equal(self.q, other.q)
                and np.array_equal(self.ece_n, other.ece_n)
                and np.array_equal(self.ece_q, other.ece_q))


#: Largest k whose classwise ECE sums are kept: they take ``Classwise.nbytes`` = ``360 k``
#: bytes per window bucket and predictor, whatever the samples.
CLASSWISE_MAX_K = 1_000


class Classwise:
    """Classwise ECE sums: per class ``j`` and equal-width bin ``b`` of ``x_j`` (15 bins) the
    count, sum and sum of squares of ``1[y = j] - x_j``; dense (k, 15) arrays, accumulated in
    place (one per window bucket and predictor, not one per batch)."""

    __slots__ = ("n", "q", "s")

    def __init__(self, k: int):
        self.n = np.zeros((k, ECE_BINS), dtype=np.int64)
        self.s = np.zeros((k, ECE_BINS))
        self.q = np.zeros((k, ECE_BINS))

    def add(self, r: _Rows, sel: slice | np.ndarray) -> None:
        """Add the rows ``sel`` of a batch's :class:`_Rows`."""
        sub = r.subset(sel)
        self.iadd(_segment_classwise(sub, np.array([0, sub.y.shape[0]]))[0])

    def iadd(self, other: Classwise) -> None:
        """Add ``other``'s sums to these, in place."""
        self.n += other.n
        self.s += other.s
        self.q += other.q

    @property
    def total(self) -> int:
        """Samples added (each counts once per class)."""
        return int(self.n[0].sum())

    @property
    def nbytes(self) -> int:
        return self.n.nbytes + self.s.nbytes + self.q.nbytes

    @classmethod
    def merge_all(cls, parts: list[Classwise | None]) -> Classwise | None:
        """The sums of all ``parts`` (a new object; None when none is kept)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        out = cls(parts[0].n.shape[0])
        for p in parts:
            out.n += p.n
            out.s += p.s
            out.q += p.q
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"n": _enc(self.n), "s": _enc(self.s), "q": _enc(self.q)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], k: int, where: str) -> Classwise:
        out = cls(k)
        try:
            for name in ("n", "s", "q"):
                a = _dec(d[name], f"{where}.{name}")
                if a.shape != (k, ECE_BINS):
                    raise InputError(f"{where}.{name}: shape {a.shape}, expected ({k}, "
                                     f"{ECE_BINS})")
                setattr(out, name, a)
        except (KeyError, TypeError) as e:
            raise InputError(f"{where}: malformed ({type(e).__name__}: {e})") from None
        if (out.n.sum(axis=1) != out.n[0].sum()).any():
            raise InputError(f"{where}: classes hold different sample counts")
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Classwise):
            return NotImplemented
        return (np.array_equal(self.n, other.n) and np.array_equal(self.s, other.s)
                and np.array_equal(self.q, other.q))


def cell_bounds(sums: CellSums) -> tuple[np.ndarray, np.ndarray]:
    """``(|Zbar|, se)`` per cell (G, k); see the module docstring."""
    n = sums.n
    zbar = sums.s / n
    if n < 2:
        return np.abs(zbar), np.abs(zbar)
    var = np.maximum(sums.q - sums.s * sums.s / n, 0.0) / (n - 1)
    return np.abs(zbar), np.sqrt(var / n)


@dataclass(frozen=True)
class WindowStats:
    """Metrics of one predictor over the current window (all plain floats, JSON-safe)."""

    n: int
    err_p: float        # plug-in Err_p at the model's lambda
    lower: float        # Err_p^lower(z): the confidence-shrunk estimate used by the trigger
    margin: float       # err_p - lower
    stderr: float       # delta-method standard error of err_p
    z: float
    ece: float          # top-label ECE, 15 equal-width bins
    brier: float
    accuracy: float
    n_bins: int         # distinct bins seen in the window
    # debiased statistics (see :func:`block_statistics`), each with its standard error
    confidence_gap: float = 0.0      # accuracy - mean confidence
    confidence_gap_se: float = 0.0
    ece_debiased: float = 0.0        # l2 top-label ECE
    ece_debiased_se: float = 0.0
    ece_classwise: float | None = None     # l2 classwise ECE (None: not kept, raw predictor)
    ece_classwise_se: float | None = None
    brier_reliability: float = 0.0   # reliability term of Brier on the level sets
    brier_reliability_se: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def statistics(self) -> dict[str, Estimate]:
        """The statistics as exported (``lpcal_calibration_statistic``): the confidence gap,
        the debiased ECEs as l2 errors (classwise only where kept), the Brier reliability term
        and Err_p, each with its standard error."""
        out = {"confidence_gap": Estimate(self.confidence_gap, self.confidence_gap_se),
               "ece_top": Estimate(self.ece_debiased, self.ece_debiased_se),
               "ece_classwise": Estimate(self.ece_classwise, self.ece_classwise_se),
               "brier_reliability": Estimate(self.brier_reliability, self.brier_reliability_se),
               "err_p": Estimate(self.err_p, self.stderr)}
        if self.ece_classwise is None:
            del out["ece_classwise"]
        return out


def block_statistics(sums: CellSums, p: float, cw: Classwise | None = None, *,
                     reliability: bool = True) -> dict[str, Estimate]:
    """The calibration statistics of merged sums, each with its standard error, on the scale the
    change test (:mod:`daemon.drift`) uses: the confidence gap ``mean(1[argmax f = y] - max f)``
    (accuracy minus mean confidence: negative when over-confident); the debiased *squared* l2
    top-label ECE (15 confidence bins), classwise ECE (15 bins per class, averaged over classes;
    NaN when the classwise sums are not kept) and Brier reliability term (level sets at lambda:
    ``sum_v (n_v / n) ||mean_v (f - y)||^2``; bins seen once count 0; exported, not tested), all
    by :func:`lpcal.metrics.binned_sq_error`; and the plug-in Err_p. ``reliability=False``
    leaves the Brier term out (the change test's blocks: it is not tested)."""
    n = sums.n
    top = binned_sq_error(sums.ece_n, sums.gap, sums.ece_q, int(sums.ece_n.sum()))
    if cw is not None:
        e = binned_sq_error(cw.n, cw.s, cw.q, cw.total)
        classwise = Estimate(e.value / sums.k, e.stderr / sums.k)
    else:
        classwise = Estimate(math.nan, math.nan)
    rel = (binned_sq_error(sums.counts[:, None], sums.s, sums.q, n) if reliability
           else Estimate(math.nan, math.nan))
    err, stderr = _err_p(sums, p)
    m = int(sums.ece_n.sum())
    if m >= 2:
        mean = float(sums.gap.sum()) / m
        var = max(float(sums.ece_q.sum()) / m - mean * mean, 0.0) * m / (m - 1)
        gap = Estimate(mean, math.sqrt(var / m))
    else:
        gap = Estimate(0.0, 0.0)
    return {"confidence_gap": gap, "ece_top": top, "ece_classwise": classwise,
            "brier_reliability": rel, "err_p": Estimate(err, stderr)}


def _pairs(stats: Mapping[str, Estimate]) -> dict[str, tuple[float, float]]:
    return {s: (e.value, e.stderr) for s, e in stats.items()}


def _err_p(sums: CellSums, p: float) -> tuple[float, float]:
    """Plug-in Err_p of merged sums and its delta-method standard error."""
    a, se = cell_bounds(sums)
    err = _lp_norm(a, p)
    if err == 0.0:
        return 0.0, 0.0
    if math.isinf(p):
        g, j = np.unravel_index(int(np.argmax(a)), a.shape)
        return float(err), float(se[g, j])
    w = (a / err) ** (p - 1.0)  # d Err_p / d |Zbar_vj|
    return float(err), float(math.sqrt(float(np.sum((w * se) ** 2))))


def window_stats(sums: CellSums, p: float, z: float,
                 classwise: Classwise | None = None) -> WindowStats | None:
    """Evaluate merged sums (and classwise sums, if kept); None when the window is empty."""
    n = sums.n
    if n == 0:
        return None
    st = block_statistics(sums, p, classwise)
    top = l2_of_squared(st["ece_top"])
    cw = (l2_of_squared(st["ece_classwise"]) if math.isfinite(st["ece_classwise"].value)
          else Estimate(None, None))  # type: ignore[arg-type]
    a, se = cell_bounds(sums)
    err = _lp_norm(a, p)
    lower = _lp_norm(np.maximum(a - z * se, 0.0), p)
    stderr = st["err_p"].stderr
    return WindowStats(n=n, err_p=float(err), lower=float(lower), margin=float(err - lower),
                       stderr=stderr, z=float(z), ece=float(np.abs(sums.gap).sum() / n),
                       brier=sums.brier / n, accuracy=sums.correct / n,
                       n_bins=int(sums.hashes.size), confidence_gap=st["confidence_gap"].value,
                       confidence_gap_se=st["confidence_gap"].stderr, ece_debiased=top.value,
                       ece_debiased_se=top.stderr, ece_classwise=cw.value,
                       ece_classwise_se=cw.stderr,
                       brier_reliability=st["brier_reliability"].value,
                       brier_reliability_se=st["brier_reliability"].stderr)


# --------------------------------------------------------------------------- window


class _Rowbuf:
    """Rows of small updates waiting to be summed: ``(x, y, h, pair)`` pieces (``h``/``pair``
    None when not known: computed when summed) and their total count and bytes."""

    __slots__ = ("nbytes", "nrows", "pieces")

    def __init__(self):
        self.pieces: list[tuple] = []
        self.nrows = 0
        self.nbytes = 0

    def add(self, x: np.ndarray, y: np.ndarray, h: np.ndarray | None = None,
            pair: np.ndarray | None = None) -> int:
        """Add a piece; returns its bytes."""
        self.pieces.append((x, y, h, pair))
        nb = x.nbytes + y.nbytes + (0 if h is None else h.nbytes + pair.nbytes)
        self.nrows += y.shape[0]
        self.nbytes += nb
        return nb

    def take(self) -> list[tuple]:
        """The waiting pieces; empties the buffer."""
        pieces = self.pieces
        self.pieces, self.nrows, self.nbytes = [], 0, 0
        return pieces


#: a flush of waiting rows: ``(lambda, the rows, whether classwise sums are wanted,
#: sink(sums, classwise sums or None))``
_Job = tuple[int, _Rowbuf, bool, Callable[[CellSums, "Classwise | None"], None]]


def _flush_rows(jobs: list[_Job]) -> None:
    """Sum the waiting rows of every job and hand each job its sums: the rows of all jobs of
    the same ``k``, lambda and classwise wish in one vectorised pass (:func:`_segment_sums`,
    one segment per job), so that many monitors' small buffers cost about what one large one
    does. Each job gets the sums of its rows alone, to the bit (the one implementation of a
    flush, of one buffer or of many)."""
    groups: dict[tuple[int, int, bool], list[tuple[int, Callable]]] = {}
    pieces: dict[tuple[int, int, bool], list[tuple]] = {}
    for lam, buf, want_cw, sink in jobs:
        if not buf.pieces:
            continue
        key = (buf.pieces[0][0].shape[1], lam, want_cw)
        nrows = buf.nrows
        groups.setdefault(key, []).append((nrows, sink))
        pieces.setdefault(key, []).extend(buf.take())
    for key, items in groups.items():
        _, lam, want_cw = key
        ps = pieces[key]
        if len(ps) == 1:
            x, y, h, pair = ps[0]
        else:
            xs, ys, hs, pairs = zip(*ps)
            x, y = np.concatenate(xs), np.concatenate(ys)
            # the hashes are exact integer dot products: computed once for the whole
            # concatenation when any piece lacks them, they are each row's own
            h = None if any(v is None for v in hs) else np.concatenate(hs)
            pair = None if h is None else np.concatenate(pairs)
        r = _Rows(x, y, lam, None if h is None or pair is None else (h, pair))
        bounds = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([n for n, _ in items], out=bounds[1:])
        sums = _segment_sums(r, bounds)
        cws = _segment_classwise(r, bounds) if want_cw else [None] * len(items)
        for (_, sink), c, w in zip(items, sums, cws):
            sink(c, w)


def flush_waiting(monitors: Iterable[WindowMonitor]) -> None:
    """Sum the rows of small updates waiting in ``monitors`` (their buckets and change-test
    blocks) in one vectorised pass per ``(k, lambda)``, instead of one pass per monitor and
    bucket when each is next read (a snapshot, an evaluation): what many models' small offers
    left waiting (:mod:`daemon.staging`) costs about one model's pass. The sums are those each
    monitor would compute alone, to the bit."""
    jobs: list[_Job] = []
    for mon in monitors:
        if mon._block_rows.pieces:
            jobs.append(mon._block_job())
        for bk in mon.buckets.values():
            for name in PREDICTORS:
                if bk.waiting[name].pieces:
                    jobs.append(bk.job(name))
    _flush_rows(jobs)


class _Bucket:
    __slots__ = ("cw", "k", "lam", "merged", "n", "nbytes", "parts", "waiting")

    def __init__(self, k: int = 0, lam: int = 1):
        self.k, self.lam = k, lam
        self.n = 0                                   # samples (raw predictor) in this bucket
        self.nbytes = 0                              # bytes of all the sums and waiting rows
        self.parts: dict[str, list[CellSums]] = {name: [] for name in PREDICTORS}
        self.merged: dict[str, CellSums | None] = {name: None for name in PREDICTORS}
        # classwise sums of the bucket, accumulated in place (counted once in nbytes)
        self.cw: dict[str, Classwise | None] = {name: None for name in PREDICTORS}
        # rows of small updates not summed yet
        self.waiting: dict[str, _Rowbuf] = {name: _Rowbuf() for name in PREDICTORS}

    def add_rows(self, name: str, x: np.ndarray, y: np.ndarray, h: np.ndarray | None = None,
                 pair: np.ndarray | None = None) -> None:
        """Add the rows of a small update to be summed later (:data:`FLUSH_ROWS`)."""
        buf = self.waiting[name]
        self.nbytes += buf.add(x, y, h, pair)
        if buf.nrows >= FLUSH_ROWS:
            self.flush(name)

    def flush(self, name: str) -> None:
        """Sum the rows waiting for predictor ``name``."""
        if self.waiting[name].pieces:
            _flush_rows([self.job(name)])

    def job(self, name: str) -> _Job:
        """The flush of the rows waiting for predictor ``name`` (:func:`_flush_rows`; their
        bytes leave this bucket's count now, their sums enter it with the sink)."""
        buf = self.waiting[name]
        self.nbytes -= buf.nbytes
        # classwise sums of the calibrated predictor only (the live map)
        want_cw = name == "calibrated" and self.k <= CLASSWISE_MAX_K

        def sink(sums: CellSums, cw: Classwise | None) -> None:
            self.add(name, sums, self.k, cw)

        return self.lam, buf, want_cw, sink

    def classwise(self, name: str) -> Classwise | None:
        self.flush(name)
        return self.cw[name]

    def add(self, name: str, s: CellSums, k: int, cw: Classwise | None = None) -> None:
        """Add the sums ``s`` of some samples (never modified: the change test's block may hold
        them too) and, if given, their classwise sums ``cw`` (added into the bucket's own)."""
        self.parts[name].append(s)
        self.nbytes += s.nbytes
        if cw is not None:
            if self.cw[name] is None:
                self.cw[name] = Classwise(k)
                self.nbytes += self.cw[name].nbytes
            self.cw[name].iadd(cw)  # type: ignore[union-attr]
        if len(self.parts[name]) >= _COMPACT_PARTS:
            self.sums(name, k)

    def sums(self, name: str, k: int) -> CellSums:
        self.flush(name)
        parts = self.parts[name]
        if parts or self.merged[name] is None:
            old = self.merged[name]
            base = [old] if old is not None else []
            self.nbytes -= sum(p.nbytes for p in base + parts)
            merged = CellSums.merge_all(base + parts, k)
            self.nbytes += merged.nbytes
            self.merged[name] = merged
            self.parts[name] = []
        return self.merged[name]  # type: ignore[return-value]

    def drop(self, name: str) -> None:
        """Forget the sums of one predictor."""
        m, cw = self.merged[name], self.cw[name]
        self.nbytes -= (sum(p.nbytes for p in self.parts[name]) + (m.nbytes if m else 0)
                        + (cw.nbytes if cw else 0) + self.waiting[name].nbytes)
        self.parts[name], self.merged[name], self.cw[name] = [], None, None
        self.waiting[name] = _Rowbuf()


class WindowMonitor:
    """Sliding-window Err_p / ECE / Brier / accuracy of one model (raw and calibrated)."""

    def __init__(self, k: int, lam: int, p: float, *, window_samples: int | None = 10_000,
                 window_seconds: float | None = None, n_buckets: int = 16,
                 max_bytes: int | None = None, change: ChangeDetector | None = None):
        if k < 2 or lam < 1:
            raise InputError(f"WindowMonitor needs k >= 2 and lambda >= 1, got {k}, {lam}")
        if not p >= 1:
            raise InputError(f"p must be >= 1 or inf, got {p}")
        if window_seconds is None and (window_samples is None or window_samples < 1):
            raise InputError("set window_samples >= 1 or window_seconds > 0")
        if window_seconds is not None and not (window_seconds > 0 and math.isfinite(window_seconds)):
            raise InputError(f"window_seconds must be positive, got {window_seconds}")
        if n_buckets < 1:
            raise InputError("n_buckets must be >= 1")
        self.k, self.lam, self.p = int(k), int(lam), float(p)
        self.window_samples = None if window_samples is None else int(window_samples)
        self.window_seconds = None if window_seconds is None else float(window_seconds)
        self.n_buckets = int(n_buckets)
        self.by_time = self.window_seconds is not None
        self.width = (self.window_seconds / self.n_buckets if self.by_time
                      else math.ceil(self.window_samples / self.n_buckets))  # type: ignore
        self.buckets: OrderedDict[int, _Bucket] = OrderedDict()
        self.clock = -math.inf
        self.total_samples = 0
        #: byte budget of the window's sums (None: none); see :meth:`set_max_bytes`
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        #: samples dropped from the window, oldest first, to keep it within ``max_bytes``
        self.trimmed = 0
        self._cache: dict[float, dict[str, WindowStats | None]] = {}  # z -> stats, until changed
        # merged sums of the buckets before the newest (see sums): predictor -> (key, sums);
        # _older_changes counts changes to those buckets that their ids do not show
        self._older: dict[str, tuple] = {}
        self._older_changes = 0
        #: the change test of the calibrated predictor (None: none), fed in blocks of its
        #: ``block_samples`` calibrated samples counted from the last :meth:`reset`
        self.change = change
        self._block: list[CellSums] = []   # the current block's sums, in parts
        self._block_n = 0                  # samples in the current block (parts and rows)
        self._block_cw: Classwise | None = None
        self._block_rows = _Rowbuf()       # calibrated rows of small updates, not summed yet

    # ---------------------------------------------------------------- updating
    def update(self, probs: np.ndarray, labels: np.ndarray, ts: np.ndarray | None = None,
               calibrated: np.ndarray | None = None,
               hashes: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Add joined samples (rows on the simplex, labels in [0, k)); return how many counted.

        ``ts`` (event times) is required for time windows. ``calibrated``: the same samples'
        calibrated rows (None while there is no bin map). ``hashes``: the ``(h, pair)`` bin
        hashes of ``probs`` at this monitor's lambda, if the caller has them
        (:func:`lpcal.levels.bin_rows`). Samples older than a time window are ignored.
        """
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        n = y.shape[0]
        if x.shape != (n, self.k):
            raise InputError(f"monitor: probs must have shape ({n}, {self.k}), got {x.shape}")
        if calibrated is not None and np.shape(calibrated) != (n, self.k):
            raise InputError(f"monitor: calibrated must have shape ({n}, {self.k})")
        if n == 0:
            return 0
        self._cache.clear()
        if hashes is not None and hashes[0].shape != (n,):
            raise InputError(f"monitor: hashes must be given for all {n} rows")
        if n < SMALL_UPDATE and not self.by_time:
            return self._update_small(x, y, ts, calibrated, hashes)
        rows: Any
        if n < SMALL_UPDATE:  # copies, summed later with other small updates (see above)
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
        if self.by_time:
            if feed:  # blocks follow arrival order, buckets event time: computed apart
                self._feed_change(rows)
            if ts is None:
                raise InputError("monitor: a time window needs ts")
            t = np.asarray(ts, dtype=np.float64)
            bid = np.floor(t / self.width).astype(np.int64)
            self.clock = max(self.clock, float(t.max()))
            hi = math.floor(self.clock / self.width)
            self._advance_bucket(hi)
            lo = hi - self.n_buckets + 1
            counted = 0
            for b in np.unique(bid).tolist():
                if b < lo:
                    continue
                sel = np.flatnonzero(bid == b)
                self._add(self._bucket(b), rows, sel)
                counted += sel.size
            self.total_samples += counted
            self._trim()
            return counted
        if ts is not None and len(ts):
            self.clock = max(self.clock, largest(ts))
        a = 0
        # under a byte budget a bucket closes early at half of it, and one slice adds at most
        # that much (at the worst case of sample_bytes): the trim then keeps the newest
        # buckets that fit instead of emptying the window
        half = None if self.max_bytes is None else self.max_bytes // 2
        step = n if half is None else max(1, half // sample_bytes(self.k))
        if type(rows) is not _Small:
            rows = self._planned(rows, n, half, step, feed)
        while a < n:
            last = next(reversed(self.buckets.values())) if self.buckets else None
            if last is None or last.n >= self.width or (half is not None and last.n
                                                        and last.nbytes >= half):
                nxt = (next(reversed(self.buckets)) + 1) if self.buckets else 0
                self._advance_bucket(nxt)
                self._bucket(nxt)
            bid_last = next(reversed(self.buckets))
            cur = self.buckets[bid_last]
            take = min(n - a, int(self.width) - cur.n, step)
            if feed:  # cut at the change test's blocks too: one piece serves both
                take = min(take, self.change.block_samples - self._block_n)  # type: ignore
            self._add(cur, rows, slice(a, a + take), feed)
            a += take
        self.total_samples += n
        self._trim()
        return n

    def _update_small(self, x: np.ndarray, y: np.ndarray, ts: np.ndarray | None,
                      calibrated: np.ndarray | None,
                      hashes: tuple[np.ndarray, np.ndarray] | None) -> int:
        """:meth:`update` of a small update (validated, fewer than :data:`SMALL_UPDATE`
        samples) in a sample window: the same cuts and the same rows waiting in the same
        buckets and change-test block as its general loop, without building a :class:`_Small`
        and dispatching each slice."""
        n = y.shape[0]
        x, y = x.copy(), y.copy()
        h = pair = None
        if hashes is not None:
            h, pair = np.array(hashes[0]), np.array(hashes[1])
        cal = None if calibrated is None else np.array(calibrated, dtype=np.float64)
        change = self.change if cal is not None else None
        if ts is not None and len(ts):
            # a few times as a list: the reduction took a third of a small update
            self.clock = max(self.clock, largest(ts))
        half = None if self.max_bytes is None else self.max_bytes // 2
        step = n if half is None else max(1, half // sample_bytes(self.k))
        width = int(self.width)
        buckets = self.buckets
        a = 0
        while a < n:
            cur = next(reversed(buckets.values())) if buckets else None
            if cur is None or cur.n >= width or (half is not None and cur.n
                                                  and cur.nbytes >= half):
                nxt = (next(reversed(buckets)) + 1) if buckets else 0
                self._advance_bucket(nxt)
                cur = self._bucket(nxt)
                buckets = self.buckets
            take = min(n - a, width - cur.n, step)
            if change is not None:
                take = min(take, change.block_samples - self._block_n)
            if take == n:
                xs, ys, hs, ps, cs = x, y, h, pair, cal
            else:
                sl = slice(a, a + take)
                xs, ys, cs = x[sl], y[sl], None if cal is None else cal[sl]
                hs, ps = (None, None) if h is None else (h[sl], pair[sl])  # type: ignore[index]
            cur.n += take
            cur.add_rows("raw", xs, ys, hs, ps)
            if cs is not None:
                cur.add_rows("calibrated", cs, ys)
                if change is not None:
                    self._block_add_rows(cs, ys)
            a += take
        self.total_samples += n
        self._trim()
        return n

    def _planned(self, rows: tuple[_Rows, _Rows | None], n: int, half: int | None,
                 step: int, feed: bool) -> tuple:
        """``rows`` of a sample window's update with the sums of the slices it is expected to
        be cut into, computed in one pass per predictor (:func:`_segment_sums`, one segment
        per slice: each segment's sums are those of its rows alone, to the bit) instead of
        one pass per slice: ``(raw, calibrated, {(start, stop): (raw sums, calibrated sums,
        classwise sums)})``. The cuts follow :meth:`update`'s loop, assuming that no bucket
        opened by this update closes early at half the byte budget; a slice the loop cuts
        otherwise is not in the dict and is summed on its own, as before."""
        raw, cal = rows
        width = int(self.width)
        last = next(reversed(self.buckets.values())) if self.buckets else None
        cur = None if last is None else last.n
        if cur is not None and half is not None and cur and last.nbytes >= half:
            cur = None
        block = self.change.block_samples if feed else 0  # type: ignore[union-attr]
        block_n = self._block_n
        cuts = [0]
        a = 0
        while a < n:
            if cur is None or cur >= width:
                cur = 0
            take = min(n - a, width - cur, step)
            if feed:
                take = min(take, block - block_n)
                block_n = (block_n + take) % block
            cur += take
            a += take
            cuts.append(a)
        if len(cuts) <= 2:  # one slice: summed once either way
            return raw, cal, {}
        bounds = np.array(cuts, dtype=np.int64)
        raws = _segment_sums(raw, bounds)
        if cal is None:
            cals, cws = [None] * len(raws), [None] * len(raws)
        else:
            cals = _segment_sums(cal, bounds)
            cws = (_segment_classwise(cal, bounds) if self.k <= CLASSWISE_MAX_K
                   else [None] * len(raws))
        return raw, cal, {(cuts[i], cuts[i + 1]): (raws[i], cals[i], cws[i])
                          for i in range(len(raws))}

    def set_change(self, change: ChangeDetector | None) -> None:
        """Use the change test ``change`` from the next calibrated sample on (a new baseline)."""
        self.change = change
        self._block, self._block_n, self._block_cw = [], 0, None
        self._block_rows = _Rowbuf()

    def _classwise(self, cal: _Rows, sel: slice | np.ndarray) -> Classwise | None:
        if self.k > CLASSWISE_MAX_K:
            return None
        cw = Classwise(self.k)
        cw.add(cal, sel)
        return cw

    def _feed_change(self, rows: Any) -> None:
        """Add calibrated rows to the change test's blocks (time windows; a sample window
        shares its pieces with the buckets, see :meth:`update`). ``rows``: a :class:`_Small`
        or the ``(raw, calibrated)`` :class:`_Rows` of :meth:`update`."""
        small = type(rows) is _Small
        n, a = rows.y.shape[0] if small else rows[1].y.shape[0], 0
        while a < n:
            sl = slice(a, a + min(n - a, self.change.block_samples - self._block_n))  # type: ignore
            if small:
                self._block_add_rows(rows.cal[sl], rows.y[sl])
            else:
                cal = rows[1]
                self._block_add(CellSums.from_rows(cal, sl), self._classwise(cal, sl))
            a = sl.stop

    def _block_add(self, part: CellSums, cw: Classwise | None) -> None:
        """Add the sums of the next calibrated samples (within the current block) to the change
        test's block; a completed block of ``change.block_samples`` samples is one observation
        of the test."""
        self._block_part(part, cw)
        self._block_n += part.n
        self._block_check()

    def _block_add_rows(self, x: np.ndarray, y: np.ndarray) -> None:
        """:meth:`_block_add` for the rows of a small update (summed when the block completes,
        or when :data:`FLUSH_ROWS` rows wait)."""
        self._block_rows.add(x, y)
        self._block_n += y.shape[0]
        if self._block_rows.nrows >= FLUSH_ROWS:
            self._block_flush()
        self._block_check()

    def _block_flush(self) -> None:
        """Sum the block's waiting rows into one part."""
        if self._block_rows.pieces:
            _flush_rows([self._block_job()])

    def _block_job(self) -> _Job:
        """The flush of the block's waiting rows (:func:`_flush_rows`)."""
        return self.lam, self._block_rows, self.k <= CLASSWISE_MAX_K, self._block_part

    def _block_part(self, part: CellSums, cw: Classwise | None) -> None:
        self._block.append(part)
        if cw is not None:
            if self._block_cw is None:
                self._block_cw = Classwise(self.k)
            self._block_cw.iadd(cw)

    def _block_check(self) -> None:
        """Observe the block once complete (``change.block_samples`` samples)."""
        det = self.change
        if self._block_n >= det.block_samples:  # type: ignore[union-attr]
            self._block_flush()
            merged = CellSums.merge_all(self._block, self.k)
            stats = block_statistics(merged, self.p, self._block_cw, reliability=False)
            self._block, self._block_n, self._block_cw = [], 0, None
            det.observe_block(_pairs(stats))  # type: ignore[union-attr]
        elif len(self._block) >= _COMPACT_PARTS:
            self._block = [CellSums.merge_all(self._block, self.k)]

    # ---------------------------------------------------------------- byte budget
    @property
    def nbytes(self) -> int:
        """Bytes of the window's sums: ``16 k + 16`` per (bucket, predictor, bin), so at most
        :func:`sample_bytes` per sample in the window."""
        # map over an attribute getter, not generators: a window under a byte budget is
        # measured after every update (:meth:`_trim`), small ones included
        total = sum(map(_NBYTES, self.buckets.values())) + self._block_rows.nbytes
        if self._block:
            total += sum(map(_NBYTES, self._block))
        if self._block_cw is not None:
            total += self._block_cw.nbytes
        return total

    def set_max_bytes(self, max_bytes: int | None) -> int:
        """Set the byte budget of the window's sums (None: none) and trim to it; returns the
        samples dropped."""
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        return self._trim()

    def _trim(self) -> int:
        """Drop the oldest buckets while the sums take more than ``max_bytes`` (the newest
        bucket too, after merging its parts, if it alone is over): the window then covers
        fewer samples than configured, newest first. Counted in :attr:`trimmed`; returns the
        samples dropped by this call."""
        if self.max_bytes is None or self.nbytes <= self.max_bytes:
            return 0
        dropped = 0
        while len(self.buckets) > 1 and self.nbytes > self.max_bytes:
            dropped += self.buckets.popitem(last=False)[1].n
        if self.buckets and self.nbytes > self.max_bytes:
            bk = next(iter(self.buckets.values()))
            for name in PREDICTORS:
                bk.sums(name, self.k)
            if bk.nbytes > self.max_bytes:
                dropped += bk.n
                self.buckets.clear()
        self._cache.clear()
        self.trimmed += dropped
        return dropped

    def _bucket(self, b: int) -> _Bucket:
        bk = self.buckets.get(b)
        if bk is None:
            bk = self.buckets[b] = _Bucket(self.k, self.lam)
            if len(self.buckets) > 1 and b < next(reversed(self.buckets)):
                self.buckets = OrderedDict(sorted(self.buckets.items()))
        return bk

    def _advance_bucket(self, newest: int) -> None:
        lo = newest - self.n_buckets + 1
        while self.buckets and next(iter(self.buckets)) < lo:
            self.buckets.popitem(last=False)
            self._cache.clear()

    def _add(self, bk: _Bucket, rows: tuple[_Rows, _Rows | None], sel: slice | np.ndarray,
             feed: bool = False) -> None:
        """Add the samples ``sel`` (non-empty) of a batch to bucket ``bk``; ``feed``: to the
        change test's current block too (``sel`` then lies within it)."""
        if self.buckets and bk is not self.buckets[next(reversed(self.buckets))]:
            self._older_changes += 1  # a late sample of a time window, in an older bucket
        if type(rows) is _Small:
            y = rows.y[sel]
            bk.n += y.shape[0]
            h = rows.h
            bk.add_rows("raw", rows.x[sel], y, None if h is None else h[sel],
                        None if h is None else rows.pair[sel])
            if rows.cal is not None:
                cal_x = rows.cal[sel]
                bk.add_rows("calibrated", cal_x, y)
                if feed:
                    self._block_add_rows(cal_x, y)
            return
        raw, cal = rows[0], rows[1]
        bk.n += raw.y[sel].shape[0]
        pre = rows[2].get((sel.start, sel.stop)) if len(rows) > 2 else None
        bk.add("raw", pre[0] if pre else CellSums.from_rows(raw, sel), self.k)
        if cal is not None:  # classwise sums of the calibrated predictor only (the live map)
            part, cw = ((pre[1], pre[2]) if pre else
                        (CellSums.from_rows(cal, sel), self._classwise(cal, sel)))
            bk.add("calibrated", part, self.k, cw)
            if feed:
                self._block_add(part, cw)

    def advance(self, now: float) -> None:
        """Time windows: move the clock to ``now`` and drop buckets that left the window."""
        if now > self.clock:
            self.clock = float(now)
        if self.by_time and math.isfinite(self.clock):
            self._advance_bucket(math.floor(self.clock / self.width))

    def bound_clock(self, limit: float) -> bool:
        """Pull the clock back to at most ``limit`` (a largest event time the input allows) and,
        for a time window, drop the buckets beyond it (they hold only samples of events from
        the future). Repairs a window poisoned by a far-future event, after which every genuine
        sample fell outside the window. Returns whether it did."""
        if not self.clock > limit:
            return False
        self.clock = float(limit)
        self._cache.clear()
        if self.by_time:
            hi = math.floor(limit / self.width)
            for b in [b for b in self.buckets if b > hi]:
                del self.buckets[b]
        return True

    def reset(self, predictor: str | None = None, *, keep_change: bool = False) -> None:
        """Forget the window of one predictor (e.g. ``"calibrated"`` after a new bin map) or all.

        ``keep_change``: the change test of the calibrated predictor keeps its baseline, its
        CUSUM and the block it is filling (a new map of the same regime: the statistics it
        tests go on, on the new map's outputs)."""
        self._cache.clear()
        if predictor is None or (predictor == "calibrated" and not keep_change):
            self._block, self._block_n, self._block_cw = [], 0, None
            self._block_rows = _Rowbuf()
            if self.change is not None:
                self.change.reset()
        if predictor is None:
            self.buckets.clear()
            return
        if predictor not in PREDICTORS:
            raise InputError(f"unknown predictor {predictor!r}")
        self._older_changes += 1
        for bk in self.buckets.values():
            bk.drop(predictor)

    # ---------------------------------------------------------------- reading
    def sums(self, predictor: str = "raw") -> CellSums:
        """Merged sums of ``predictor`` over the window (never modify them: they may be cached
        or a bucket's own).

        The buckets before the newest change only when one is dropped, closed or reset (or, in
        a time window, takes a late sample), so their merge is cached under that state and an
        evaluation merges two parts, not ``n_buckets``."""
        ids = list(self.buckets)
        if len(ids) <= 2:
            return CellSums.merge_all([self.buckets[b].sums(predictor, self.k) for b in ids],
                                      self.k)
        key = (ids[0], ids[-2], len(ids), self._older_changes)
        cached = self._older.get(predictor)
        if cached is None or cached[0] != key:
            older = CellSums.merge_all([self.buckets[b].sums(predictor, self.k)
                                        for b in ids[:-1]], self.k)
            self._older[predictor] = cached = (key, older)
        return CellSums.merge_all([cached[1], self.buckets[ids[-1]].sums(predictor, self.k)],
                                  self.k)

    def classwise(self, predictor: str = "calibrated") -> Classwise | None:
        """Merged classwise sums of ``predictor`` over the window (None: not kept)."""
        return Classwise.merge_all([bk.classwise(predictor) for bk in self.buckets.values()])

    def window_size(self, predictor: str = "raw") -> int:
        return sum(bk.sums(predictor, self.k).n for bk in self.buckets.values())

    def evaluate(self, z: float = 3.0) -> dict[str, WindowStats | None]:
        """:class:`WindowStats` of both predictors (None for an empty window).

        Cached until the window changes, so repeated calls between updates are free."""
        return {name: self.evaluate_one(name, z) for name in PREDICTORS}

    def evaluate_one(self, predictor: str, z: float = 3.0) -> WindowStats | None:
        """:class:`WindowStats` of ``predictor`` alone (what :meth:`evaluate` gives for it),
        cached with it: the drift trigger reads the calibrated predictor only, and the raw
        one's flush, merge and statistics are about half of an evaluation."""
        if predictor not in PREDICTORS:
            raise InputError(f"unknown predictor {predictor!r}")
        per = self._cache.setdefault(z, {})
        if predictor not in per:
            per[predictor] = window_stats(self.sums(predictor), self.p, z,
                                          self.classwise(predictor))
        return per[predictor]

    # ---------------------------------------------------------------- snapshots
    def _header(self) -> dict[str, Any]:
        """The snapshot's scalar part (the same in both forms)."""
        return {"k": self.k, "lam": self.lam, "p": "inf" if math.isinf(self.p) else self.p,
                "window_samples": self.window_samples, "window_seconds": self.window_seconds,
                "n_buckets": self.n_buckets,
                "clock": None if math.isinf(self.clock) else self.clock,
                "total_samples": self.total_samples}

    def to_dict(self, *, memo: Callable[[object, tuple, Callable[[], Any]], Any] | None = None,
                packed: bool = False) -> dict[str, Any]:
        """JSON-safe snapshot (arrays little-endian base64); :meth:`from_dict` restores it.

        ``packed`` (the checkpoint format ``lpcal.model_state/6``): each bucket's sums as they
        are held, merged sums and the parts added since (:meth:`_packed_bucket_dict`), and the
        change test's block, each as one :func:`pack_sums` string instead of one base64 string
        per array; nothing is merged to write them.

        ``memo(owner, refs, make)`` (optional; the checkpoint's cache, see
        :meth:`lpcal.window.SlidingWindow.to_dict`): a bucket is encoded again only when its
        sample count or its merged sums changed (every sample added to a bucket changes
        both)."""
        self._block_flush()
        for bk in self.buckets.values():
            for name in PREDICTORS:
                bk.flush(name)
        if packed:
            change = None if self.change is None else {
                "test": self.change.to_dict(), "block_n": self._block_n,
                "block": [pack_one_sums(s) if memo is None else memo(s, (), partial(
                    pack_one_sums, s)) for s in self._block],
                "block_classwise": pack_sums([], [self._block_cw])}
            return {**self._header(),
                    "buckets": [self._bucket_dict(b, bk, memo, packed=True)
                                for b, bk in self.buckets.items()],
                    "change": change}
        if len(self._block) > 1:  # merged once: the next snapshot merges only new parts
            self._block = [CellSums.merge_all(self._block, self.k)]
        block = None
        if self._block:
            part = self._block[0]  # never modified (a new part or merge replaces it)
            block = part.to_dict() if memo is None else memo(part, (), part.to_dict)
        return {
            **self._header(),
            "buckets": [self._bucket_dict(b, bk, memo) for b, bk in self.buckets.items()],
            "change": None if self.change is None else {
                "test": self.change.to_dict(), "block_n": self._block_n,
                "block": block,
                "block_classwise": (None if self._block_cw is None
                                    else self._block_cw.to_dict())},
        }

    def _bucket_dict(self, b: int, bk: _Bucket, memo, *, packed: bool = False) -> Any:
        if packed:
            return self._packed_bucket_dict(b, bk, memo)
        sums = {name: bk.sums(name, self.k) for name in PREDICTORS}

        def make() -> dict[str, Any]:
            return {"id": b, "n": bk.n, **{name: s.to_dict() for name, s in sums.items()},
                    "classwise": {name: None if bk.cw[name] is None else bk.cw[name].to_dict()
                                  for name in PREDICTORS}}

        if memo is None:
            return make()
        return memo(bk, (b, bk.n, *sums.values(), *bk.cw.values()), make)

    def _packed_bucket_dict(self, b: int, bk: _Bucket, memo) -> dict[str, Any]:
        """A bucket as it is held (its waiting rows summed by :meth:`to_dict`), not merged: per
        predictor its merged sums (or ``None``) then the sums added since the last merge, each
        :func:`pack_one_sums` through ``memo`` (sums are never modified, a merge or an update
        makes new ones: each is encoded once however often the bucket is written), and the
        classwise sums (:func:`pack_sums`). Writing it merges nothing, and the restored bucket
        merges exactly as this one would."""
        out: dict[str, Any] = {"id": b, "n": bk.n}
        for name in PREDICTORS:
            m = bk.merged[name]
            out[name] = [None if s is None else
                         pack_one_sums(s) if memo is None else memo(s, (), partial(pack_one_sums, s))
                         for s in (m, *bk.parts[name])]
        out["classwise"] = pack_sums([], [bk.cw[name] for name in PREDICTORS])
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "monitor") -> WindowMonitor:
        try:
            p = math.inf if d["p"] == "inf" else float(d["p"])
            mon = cls(int(d["k"]), int(d["lam"]), p, window_samples=d["window_samples"],
                      window_seconds=d["window_seconds"], n_buckets=int(d["n_buckets"]))
            mon.clock = -math.inf if d["clock"] is None else float(d["clock"])
            mon.total_samples = int(d["total_samples"])
            last = None
            for i, bd in enumerate(d["buckets"]):
                b = int(bd["id"])
                if last is not None and b <= last:
                    raise ValueError("bucket ids must increase")
                last = b
                bk = _Bucket(mon.k, mon.lam)
                bk.n = int(bd["n"])
                if isinstance(bd["raw"], list):  # packed (lpcal.model_state/6)
                    mon._packed_bucket(bk, bd, f"{where}.buckets[{i}]")
                    mon.buckets[b] = bk
                    continue
                for name in PREDICTORS:
                    s = CellSums.from_dict(bd[name], f"{where}.buckets[{i}].{name}")
                    if s.k != mon.k:
                        raise ValueError(f"bucket {i} {name} has k={s.k}")
                    bk.merged[name] = s
                    bk.nbytes += s.nbytes
                    cwd = (bd.get("classwise") or {}).get(name)  # absent: older snapshots
                    if cwd is not None:
                        cw = Classwise.from_dict(cwd, mon.k,
                                                 f"{where}.buckets[{i}].classwise.{name}")
                        if cw.total != s.n:
                            raise ValueError(f"bucket {i} {name}: classwise sums hold "
                                             f"{cw.total} samples, not {s.n}")
                        bk.cw[name] = cw
                        bk.nbytes += cw.nbytes
                if bk.merged["raw"].n != bk.n:  # type: ignore[union-attr]
                    raise ValueError(f"bucket {i}: n={bk.n} but raw sums hold "
                                     f"{bk.merged['raw'].n}")  # type: ignore[union-attr]
                mon.buckets[b] = bk
            ch = d.get("change")  # absent: written before the change test
            if ch is not None:
                mon.change = ChangeDetector.from_dict(ch["test"], f"{where}.change")
                if isinstance(ch["block"], list):  # packed (lpcal.model_state/6): its parts
                    parts = [unpack_one_sums(it, mon.k, f"{where}.change.block[{j}]")
                             for j, it in enumerate(ch["block"])]
                    _, (bcw,) = _unpack_n(ch["block_classwise"], mon.k, 0,
                                          f"{where}.change.block_classwise", 1)
                    if sum(p.n for p in parts) != int(ch["block_n"]):
                        raise ValueError("change block does not match its count")
                    mon._block, mon._block_cw = parts, bcw
                else:
                    if ch["block"] is not None:
                        blk = CellSums.from_dict(ch["block"], f"{where}.change.block")
                        if blk.k != mon.k or blk.n != int(ch["block_n"]):
                            raise ValueError("change block does not match its count or k")
                        mon._block = [blk]
                    if ch.get("block_classwise") is not None:
                        mon._block_cw = Classwise.from_dict(ch["block_classwise"], mon.k,
                                                            f"{where}.change.block_classwise")
                mon._block_n = int(ch["block_n"])
                if not 0 <= mon._block_n < mon.change.block_samples:
                    raise ValueError(f"change block_n={mon._block_n} out of range")
        except InputError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed snapshot ({type(e).__name__}: {e})") from None
        return mon

    def _packed_bucket(self, bk: _Bucket, bd: Mapping[str, Any], where: str) -> None:
        """Fill ``bk`` from :meth:`_packed_bucket_dict`'s form, checked as the unpacked form
        is: every sums of ``k`` classes, the raw samples adding up to the bucket's ``n``,
        classwise sums holding their predictor's samples."""
        _, cws = _unpack_n(bd["classwise"], self.k, 0, f"{where}.classwise", len(PREDICTORS))
        for name, cw in zip(PREDICTORS, cws):
            items = bd[name]
            if not isinstance(items, list) or not items:
                raise ValueError(f"{where}.{name}: not a list of sums")
            m = None if items[0] is None else unpack_one_sums(items[0], self.k,
                                                              f"{where}.{name}[0]")
            parts = [unpack_one_sums(it, self.k, f"{where}.{name}[{j}]")
                     for j, it in enumerate(items[1:], 1)]
            bk.merged[name], bk.parts[name] = m, parts
            bk.nbytes += sum(s.nbytes for s in parts) + (m.nbytes if m is not None else 0)
            n = (m.n if m is not None else 0) + sum(s.n for s in parts)
            if name == "raw" and n != bk.n:
                raise ValueError(f"{where}: n={bk.n} but raw sums hold {n}")
            if cw is not None:
                if cw.total != n:
                    raise ValueError(f"{where} {name}: classwise sums hold {cw.total} samples, "
                                     f"not {n}")
                bk.cw[name] = cw
                bk.nbytes += cw.nbytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowMonitor):
            return NotImplemented
        return self.to_dict() == other.to_dict()
