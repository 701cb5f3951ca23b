"""Temperature pre-calibration from additive sums: NLL on a fixed log-spaced grid of temperatures.

Temperature scaling (Guo et al. 2017) maps ``f`` to ``q_T = softmax(log f / T)``. Its negative
log-likelihood on a sample is a sum over samples::

    NLL(T) = sum_i [ logsumexp(z_i / T) - z_{i, y_i} / T ],      z_i = log f(x_i),

so for every temperature of a **fixed grid** the sums of disjoint batches add. A
:class:`TemperatureGrid` holds those sums: it is small (one float per grid point), additive,
mergeable and checkpointable like the sample pools, which is what lets the streaming daemon fit
the pre-calibrator without keeping raw samples. :meth:`TemperatureGrid.fit` returns the grid
minimiser refined by the minimum of a quartic through it and its (up to) four nearest neighbours
in ``log2 T`` (``NLL`` is convex in ``1/T`` and smooth in ``log T``). Measured on the five CIFAR
records against the exact minimiser (:func:`lpcal.temperature.fit_temperature`): within 0.15% of
``T`` at this grid's spacing of 1/2 in ``log2 T`` (0.01% at 1/4, 0.0001% at 1/8), while the cost
per sample is proportional to the number of grid points.

The fit minimises ``NLL(T) + (log2 T)^2 / 8``: the maximum a posteriori temperature under a
normal prior with standard deviation 2 on ``log2 T`` (a factor of 4 either way is one sigma). The prior matters only when the sample carries almost no
information: on a sample the model classifies without error the likelihood alone keeps improving
as ``T -> 0`` and would send ``T`` to the end of the grid (measured: ``T = 1/16`` on 62 samples of
a wine classifier, NLL 0.59 on held-out data against 0.05 for ``T = 1.5``). On thousands of
samples it moves ``T`` by well under 1% (the likelihood's curvature is hundreds of nats). The
weight was chosen on the small scikit-learn records of the quality benchmark: with ``1/2``
instead of ``1/8`` the prior cost 0.001 to 0.002 of Brier on 89-sample wine splits.

Grid: ``log2 T = -4, -3.5, ..., 4`` (17 temperatures from 1/16 to 16, ratio 1.41). A fit at
an end of the grid means the likelihood still improves beyond it; :attr:`TemperatureGrid.at_edge`
says so.

Sums are kept in fixed point (:data:`NLL_SCALE` units per nat, each sample's term clipped to
:data:`NLL_CLIP` nats), as int64: integer addition is exact and associative, so the sums, and
hence the fitted ``T``, are bit-identical however the samples were batched or merged (a replay of
a stream fits the same temperature). The quantisation error is at most ``n / (2 NLL_SCALE)``
nats, far below what moves the minimiser; up to about ``2^33`` samples fit in int64.

Cost: ``O(n k G)`` exponentials for ``n`` samples with ``k`` classes and ``G = 17`` grid points,
computed in row chunks of bounded memory. Samples whose observed class has probability 0 have
likelihood 0 at every ``T`` and are counted in ``skipped``, not summed (as in
:func:`lpcal.temperature.fit_temperature`).

Reference: C. Guo, G. Pleiss, Y. Sun, K. Q. Weinberger, *On Calibration of Modern Neural
Networks*, ICML 2017.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lpcal.errors import InputError

__all__ = ["GRID_LOG2_T", "TemperatureGrid", "fit_grid_temperature", "grid_nll_runs",
           "run_bounds"]

#: ``log2`` of the grid temperatures: -4 to 4 in steps of 1/2.
GRID_LOG2_T = np.arange(-8, 9, dtype=np.float64) / 2.0
_GRID_ID = "log2T:-4:4:1/2"
_INV_T = 2.0 ** -GRID_LOG2_T
_CHUNK_CELLS = 1 << 20  # rows * grid * classes evaluated at once, at most (8 MB)
#: Rows per chunk of the grid's exponentials, at most (:func:`chunk_rows`).
CHUNK_ROWS = 512
#: the owners of a single run, and its start in any chunk (read-only)
_ONE_OWNER = np.zeros(1, dtype=np.int64)
_ONE_OWNER.flags.writeable = False
#: Fixed-point units per nat of the NLL sums, and the largest per-sample term (nats).
NLL_SCALE = float(1 << 20)
NLL_CLIP = 1024.0


def pairwise_planes(a: np.ndarray) -> np.ndarray:
    """``a.sum(axis=0)`` added in the order numpy adds the elements of one contiguous row.

    numpy sums a contiguous row pairwise: below 8 terms one after the other, up to 128 terms in
    8 running accumulators combined as ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``
    and then the remainder, above 128 the two halves (the first a multiple of 8) separately.
    Here each term is a whole plane ``a[j]``, so the additions are long contiguous loops, and
    the result equals the row sums of ``a``'s values laid out as contiguous rows
    (``np.ascontiguousarray(np.moveaxis(a, 0, -1)).sum(axis=-1)``) bit for bit (tested).
    """
    n = a.shape[0]
    if n < 8:
        res = a[0] + 0.0
        for j in range(1, n):
            res += a[j]
        return res
    if n <= 128:
        stop = n - n % 8
        r = a[:8] if stop == 8 else a[:8] + a[8:16]
        for j in range(16, stop, 8):
            r += a[j:j + 8]
        h = r[0::2] + r[1::2]             # r0 + r1, r2 + r3, r4 + r5, r6 + r7
        res = (h[0] + h[1]) + (h[2] + h[3])
        for j in range(stop, n):
            res += a[j]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise_planes(a[:n2]) + pairwise_planes(a[n2:])


def shifted_log(x: np.ndarray) -> np.ndarray:
    """``log x - max_j log x_j`` row-wise (``<= 0``; ``-inf`` where ``x`` is 0)."""
    with np.errstate(divide="ignore"):
        z = np.log(x)
    z -= z.max(axis=1, keepdims=True)
    return z


def chunk_rows(g: int, k: int) -> int:
    """Rows per chunk of :func:`grid_exp` for ``g`` grid points and ``k`` classes: up to
    :data:`CHUNK_ROWS` (long enough loops over rows), and at most ``_CHUNK_CELLS`` cells."""
    return max(1, min(CHUNK_ROWS, _CHUNK_CELLS // (g * k)))


def grid_exp(zs: np.ndarray, inv_t: np.ndarray, rows: int | None = None):
    """The exponentials of temperature scaling on a grid, in row chunks of bounded memory.

    For shifted log-probabilities ``zs`` (n, k) (:func:`shifted_log`) and inverse temperatures
    ``inv_t`` (G,), yields ``(a, b, e, S)`` for consecutive row chunks ``[a, b)`` of ``rows``
    rows (default :func:`chunk_rows`):
    ``e[j, g, i] = exp(zs[a + i, j] inv_t[g])`` (classes first: every pass is a long
    contiguous loop) and ``S[g, i] = sum_j e[j, g, i]``, each value bit-identical to
    ``exp(zs[:, None, :] * inv_t[None, :, None]).sum(axis=2)`` (:func:`pairwise_planes`).
    Every temperature-scaling sum of lpcal (the grid NLL, the warm-up scores, the held-out
    loss grid) is computed from these: one implementation of the ``O(n k G)`` exponentials.
    ``e`` and ``S`` are reused buffers: a consumer may write them, and must not keep them.
    """
    n, k = zs.shape
    g = inv_t.size
    step = max(1, min(n, chunk_rows(g, k) if rows is None else int(rows)))
    zt = np.ascontiguousarray(zs.T)                      # (k, n)
    buf = np.empty(k * g * step)
    for a in range(0, n, step):
        b = min(a + step, n)
        e = buf[: k * g * (b - a)].reshape(k, g, b - a)
        np.multiply(zt[:, None, a:b], inv_t[None, :, None], out=e)
        np.exp(e, out=e)
        yield a, b, e, pairwise_planes(e)


def checked_batch(probs, labels, who: str) -> tuple[np.ndarray, np.ndarray]:
    """``probs`` as float64 (n, k) and ``labels`` as int64 (n,), or :class:`InputError`."""
    x = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise InputError(f"{who}: probs {x.shape} and labels {y.shape} do not match")
    return x, y


def positive_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(x, y, skipped)`` without the rows whose observed class has probability 0
    (:func:`positive_runs` of one run)."""
    keep, _, skipped = positive_runs(x, y, np.array([x.shape[0]], dtype=np.int64))
    if keep is not None:
        x, y = x[keep], y[keep]
    return x, y, int(skipped[0])


def run_bounds(counts) -> tuple[np.ndarray, np.ndarray]:
    """``(bounds, owners)`` of consecutive row runs, ``counts`` (m,) rows each, in order
    (zeros allowed): ``bounds`` (r + 1,) the starts and the end of the ``r`` non-empty runs,
    ``owners`` (r,) which of the ``m`` each one is.

    Many owners' small batches (models, window buckets) concatenated into one array are summed
    in one pass of a kernel as runs: every per-sample term depends on its own row only and is
    an integer, so each run's sums are those of its rows alone, to the bit, however the rows
    were concatenated or chunked (:func:`chunk_runs`)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size == 1 and counts[0]:  # one owner: no search
        return np.array([0, counts[0]], dtype=np.int64), _ONE_OWNER
    owners = np.flatnonzero(counts)
    bounds = np.zeros(owners.size + 1, dtype=np.int64)
    np.cumsum(counts[owners], out=bounds[1:])
    return bounds, owners


def chunk_runs(bounds: np.ndarray, a: int, b: int) -> tuple[int, int, np.ndarray]:
    """``(lo, hi, starts)``: the non-empty runs ``lo .. hi - 1`` of ``bounds``
    (:func:`run_bounds`) that overlap the row chunk ``[a, b)``, and where each starts in the
    chunk (``starts[0] == 0``): the indices ``np.add.reduceat`` sums the chunk's rows by."""
    if bounds.size == 2:  # one run holds every row
        return 0, 1, _ONE_OWNER
    lo = int(np.searchsorted(bounds, a, side="right")) - 1
    hi = int(np.searchsorted(bounds, b, side="left"))
    return lo, hi, np.maximum(bounds[lo:hi], a) - a


def sum_runs(v: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of ``v``'s last axis over the runs beginning at ``starts`` (:func:`chunk_runs`),
    as int64: ``v`` holds integers (rounded fixed-point terms) whose float64 sums over a chunk
    are exact, so the sums are the same in any order."""
    if starts.size == 1:
        return v.sum(axis=-1, keepdims=True).astype(np.int64)
    return np.add.reduceat(v, starts, axis=-1).astype(np.int64)


def nll_fixed(S: np.ndarray, zy: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Fixed-point NLL sums ``(G, r)`` of one chunk's ``r`` runs (``starts``,
    :func:`chunk_runs`) from its ``S`` (G, m) (overwritten) and the shifted log-probabilities
    ``zy`` (m,) of the observed classes."""
    np.log(S, out=S)
    S -= zy[None, :] * _INV_T[:, None]                   # NLL, >= 0
    np.minimum(S, NLL_CLIP, out=S)
    S *= NLL_SCALE
    np.rint(S, out=S)
    # integers up to 2^30 per sample: their float64 sum over a chunk (far below 2^23 rows) is
    # exact
    return sum_runs(S, starts)


def positive_runs(x: np.ndarray, y: np.ndarray, counts: np.ndarray
                  ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """:func:`positive_rows` of runs of ``counts`` (m,) rows: ``(keep, kept (m,), skipped
    (m,))``, ``keep`` the mask of the rows whose observed class has a positive probability
    (None when all have), and per run the rows kept and left out."""
    keep = x[np.arange(x.shape[0]), y] > 0
    if keep.all():
        return None, counts, np.zeros(counts.size, dtype=np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    skipped = np.bincount(owner[~keep], minlength=counts.size)
    return keep, counts - skipped, skipped


def grid_nll_runs(x: np.ndarray, y: np.ndarray, counts,
                  log_x: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The grid's fixed-point NLL sums of consecutive row runs in one pass:
    ``(nll (m, G), summed (m,), skipped (m,))`` for the runs of ``counts`` (m,) rows of the
    validated ``x`` (n, k), ``y`` (n,), each run's sums those of its rows alone, to the bit
    (:func:`run_bounds`). ``log_x``: ``np.log(x)``, if the caller has it (the same values:
    not computed again). :meth:`TemperatureGrid.update` is its one-run case."""
    counts = np.asarray(counts, dtype=np.int64)
    if log_x is None:
        with np.errstate(divide="ignore"):
            log_x = np.log(x)
    keep, kept, skipped = positive_runs(x, y, counts)
    if keep is not None:
        log_x, y = log_x[keep], y[keep]
    if y.shape[0] == 0:
        return np.zeros((counts.size, _INV_T.size), dtype=np.int64), kept, skipped
    zs = log_x - log_x.max(axis=1, keepdims=True)  # shifted_log's values
    zy = zs[np.arange(zs.shape[0]), y]
    bounds, owners = run_bounds(kept)
    runs = np.zeros((owners.size, _INV_T.size), dtype=np.int64)
    for a, b, _, S in grid_exp(zs, _INV_T):
        lo, hi, starts = chunk_runs(bounds, a, b)
        runs[lo:hi] += nll_fixed(S, zy[a:b], starts).T
    if owners.size == counts.size:
        return runs, kept, skipped
    total = np.zeros((counts.size, _INV_T.size), dtype=np.int64)
    total[owners] = runs
    return total, kept, skipped


def _fit_objective(obj: np.ndarray) -> float:
    """:meth:`TemperatureGrid.fit` of the objective ``obj`` (G,): the grid argmin refined by
    the quartic through it and its (up to) four nearest neighbours. Only those five values and
    the argmin are read: other entries may be any value above the minimum (``inf``)."""
    g = int(np.argmin(obj))
    x = float(GRID_LOG2_T[g])
    if 0 < g < obj.size - 1:
        lo, hi = max(0, g - 2), min(obj.size, g + 3)
        xs = GRID_LOG2_T[lo:hi] - x
        c = np.polyfit(xs, obj[lo:hi] - obj[g], min(4, hi - lo - 1))
        r = np.roots(np.polyder(c))
        step = float(GRID_LOG2_T[1] - GRID_LOG2_T[0])
        r = r[np.isreal(r)].real
        r = r[np.abs(r) <= step]
        if r.size:
            best = r[np.argmin(np.polyval(c, r))]
            if np.polyval(c, best) <= 0.0:  # never worse than the grid point itself
                x += float(best)
    return float(2.0**x)


#: Rows of the subsample whose full-grid fit guesses where the minimum lies
#: (:func:`fit_grid_temperature`); samples up to twice this are fitted on the full grid.
GUESS_ROWS = 512
#: Bound on the error of one sample's computed NLL term, in nats (the rounding of ``log S``
#: and of ``z_y / T``: below 1e-11 for terms up to :data:`NLL_CLIP`; generous).
_TERM_ERR = 1e-8


def _grid_terms(zs: np.ndarray, zy: np.ndarray, idx: list[int]) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Fixed-point NLL sums ``(len(idx),)`` at the grid points ``idx`` and each sample's term
    ``min(NLL_i, NLL_CLIP)`` there ``(len(idx), n)``: the values :func:`nll_fixed` sums, to the
    bit (every value is a function of its own row and temperature only)."""
    inv = _INV_T[idx]
    sums = np.zeros(len(idx), dtype=np.int64)
    terms = np.empty((len(idx), zs.shape[0]))
    for a, b, _, S in grid_exp(zs, inv):
        np.log(S, out=S)
        S -= zy[None, a:b] * inv[:, None]
        np.minimum(S, NLL_CLIP, out=S)
        terms[:, a:b] = S
        S *= NLL_SCALE
        np.rint(S, out=S)
        sums += S.sum(axis=1).astype(np.int64)
    return sums, terms


def _beyond(terms: dict[int, np.ndarray], near: int, far: int, us: list[int]) -> np.ndarray:
    """Lower bounds, in nats, on the sums of the clipped NLL terms at the grid points ``us``
    beyond the evaluated points ``far``, ``near`` (``near`` between ``far`` and every ``u``),
    from the convexity of each sample's ``NLL_i`` in ``1/T``: it lies above the extension of
    its chord through ``near`` and ``far``. A sample clipped at either point, or whose bound is
    negative, is bounded by 0 (``NLL_i >= 0``); the rounding of the terms is allowed for
    (``_TERM_ERR`` at each of the two points, amplified by the extension, and at ``u``)."""
    bn, bf = _INV_T[near], _INV_T[far]
    r = (_INV_T[us] - bn) / (bn - bf)               # > 0: every u lies beyond near
    tn, tf = terms[near], terms[far]
    lin = tn[None, :] + (tn - tf)[None, :] * r[:, None]
    np.clip(lin, 0.0, NLL_CLIP, out=lin)
    lin[:, (tn >= NLL_CLIP) | (tf >= NLL_CLIP)] = 0.0
    return lin.sum(axis=1) - tn.size * (2.0 + 2.0 * r) * _TERM_ERR


def fit_grid_temperature(probs, labels) -> float:
    """``TemperatureGrid().update(probs, labels).fit()``, bit for bit, computing the grid's
    exponentials only at the grid points that can matter (the fit of the certified default,
    :func:`lpcal.calibrate.fit`).

    The fit reads the objective only at its argmin and the two grid points either side. So:
    guess the argmin from the full grid on a subsample of :data:`GUESS_ROWS` rows, evaluate
    the objective of all rows on a contiguous range of grid points around it, and widen the
    range until it holds the argmin's neighbourhood and every grid point outside it is
    **proven** to be above the minimum: each sample's ``NLL_i`` is convex in ``1/T`` (a
    log-sum-exp of linear functions minus a linear function), so beyond the range it is at
    least the extension of its chord through the two outermost points
    (:func:`_beyond`); the fixed-point rounding (at most half a unit per sample) and the
    prior (exact) are added. A point that cannot be excluded is evaluated. The evaluated
    sums are those of :class:`TemperatureGrid` to the bit (same exponentials, same order),
    so the temperature is the same float. On the five CIFAR records of ``tests/bench/data``
    five of the 17 grid points are evaluated, in one pass (three to six on synthetic samples
    with temperatures from 1/20 to 20).

    Raises :class:`InputError` as :meth:`TemperatureGrid.fit` does when no sample has a
    positive probability on its label.
    """
    x, y = checked_batch(probs, labels, "fit_grid_temperature")
    g_n = _INV_T.size
    if x.shape[0] <= 2 * GUESS_ROWS:
        return TemperatureGrid().update(x, y).fit()
    x, y, _ = positive_rows(x, y)
    n = x.shape[0]
    if n <= 2 * GUESS_ROWS:
        return TemperatureGrid().update(x, y).fit()
    stride = n // GUESS_ROWS
    guess = TemperatureGrid().update(x[::stride], y[::stride])
    prior = GRID_LOG2_T**2 / 8.0
    g0 = int(np.argmin(guess.nll / NLL_SCALE * (n / guess.n) + prior))
    zs = shifted_log(x)
    zy = zs[np.arange(n), y]
    nll = np.zeros(g_n, dtype=np.int64)
    terms: dict[int, np.ndarray] = {}
    lo, hi = g_n, -1                                  # the evaluated range [lo, hi]

    def evaluate(want: list[int]) -> None:
        nonlocal lo, hi
        want = [g for g in want if g not in terms]
        if want:
            sums, t = _grid_terms(zs, zy, want)
            for j, g in enumerate(want):
                nll[g], terms[g] = sums[j], t[j]
        lo, hi = min(terms), max(terms)
        missing = [g for g in range(lo, hi + 1) if g not in terms]
        if missing:
            evaluate(missing)

    evaluate(list(range(max(0, g0 - 2), min(g_n, g0 + 3))))
    slack = n * 0.5 / NLL_SCALE                       # rint: at most half a unit per sample
    while True:
        obj = np.full(g_n, np.inf)
        obj[lo:hi + 1] = nll[lo:hi + 1] / NLL_SCALE + prior[lo:hi + 1]
        g = int(np.argmin(obj))
        want = [j for j in range(max(0, g - 2), min(g_n, g + 3)) if j not in terms]
        if not want:
            best = float(obj[g])
            margin = 1e-9 * (abs(best) + 1.0)
            for near, far, us in ((lo, lo + 1, list(range(lo))),
                                  (hi, hi - 1, list(range(hi + 1, g_n)))):
                if us and (_beyond(terms, near, far, us) - slack + prior[us]
                           <= best + margin).any():
                    want.append(near - 1 if near == lo else near + 1)  # widen by one point
            if not want:
                return _fit_objective(obj)
        evaluate(want)


class TemperatureGrid:
    """Additive NLL sums of temperature scaling on :data:`GRID_LOG2_T` (module docstring).

    Attributes: ``nll`` (G,) int64 fixed-point sums (see the module docstring), ``n`` samples
    summed, ``skipped`` samples left out.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.precalibrate import TemperatureGrid
    >>> rng = np.random.default_rng(0)
    >>> logits = rng.normal(size=(4000, 5)) * 3
    >>> f = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    >>> q = np.exp(logits / 2) / np.exp(logits / 2).sum(axis=1, keepdims=True)
    >>> y = (q.cumsum(axis=1) > rng.random(4000)[:, None]).argmax(axis=1)
    >>> g = TemperatureGrid().update(f[:2000], y[:2000]).merge(
    ...     TemperatureGrid().update(f[2000:], y[2000:]))
    >>> abs(g.fit() - 2.0) < 0.2   # the labels follow softmax(log f / 2)
    True
    """

    __slots__ = ("n", "nll", "skipped")

    def __init__(self) -> None:
        self.nll = np.zeros(_INV_T.size, dtype=np.int64)
        self.n = 0
        self.skipped = 0

    def update(self, probs: np.ndarray, labels: np.ndarray, *,
               log_probs: np.ndarray | None = None) -> TemperatureGrid:
        """Add a batch of validated rows ``probs`` (n, k) and labels (n,); returns ``self``.
        ``log_probs``: ``np.log(probs)``, when the caller computed it anyway (the window
        bins the same rows at a temperature): the same sums, one logarithm fewer per value."""
        x, y = checked_batch(probs, labels, "TemperatureGrid.update")
        if x.shape[0] == 0:
            return self
        nll, summed, skipped = grid_nll_runs(x, y, [x.shape[0]], log_probs)
        return self.add_sums(nll[0], int(summed[0]), int(skipped[0]))

    def add_sums(self, nll: np.ndarray, n: int, skipped: int) -> TemperatureGrid:
        """Add the fixed-point sums ``nll`` (G,) of ``n`` samples (and ``skipped`` left out),
        computed elsewhere from the same kernel (:meth:`lpcal.warmup.WarmupSums.update` feeds a
        bucket's grid this way); returns ``self``."""
        self.nll += nll
        self.n += n
        self.skipped += skipped
        return self

    def merge(self, other: TemperatureGrid) -> TemperatureGrid:
        """A new grid holding the sums of both operands (neither is modified)."""
        out = TemperatureGrid()
        out.nll = self.nll + other.nll
        out.n, out.skipped = self.n + other.n, self.skipped + other.skipped
        return out

    def objective(self) -> np.ndarray:
        """``NLL(T_g) + (log2 T_g)^2 / 8`` in nats at every grid point (raises when empty)."""
        if self.n == 0:
            raise InputError("TemperatureGrid: no sample with a positive probability on its "
                             "label was added; cannot fit a temperature")
        return self.nll / NLL_SCALE + GRID_LOG2_T**2 / 8.0

    def _argmin(self) -> int:
        return int(np.argmin(self.objective()))

    @property
    def at_edge(self) -> bool:
        """True when the minimum lies at an end of the grid (the fit is clamped there)."""
        g = self._argmin()
        return g in (0, self.nll.size - 1)

    def fit(self) -> float:
        """The MAP temperature (module docstring): the grid argmin, refined by the minimum of a
        quartic through the objective at it and its nearest neighbours, within one grid step."""
        return _fit_objective(self.objective())

    def mean_nll(self) -> np.ndarray:
        """Mean NLL at every grid temperature (raises when empty)."""
        self._argmin()
        return self.nll / (NLL_SCALE * self.n)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"grid": _GRID_ID, "scale": int(NLL_SCALE), "nll": self.nll.tolist(),
                "n": self.n, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TemperatureGrid:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`InputError`."""
        try:
            if d["grid"] != _GRID_ID or d["scale"] != int(NLL_SCALE):
                raise ValueError(f"unknown grid {d['grid']!r} or scale {d['scale']!r}")
            nll = np.asarray(d["nll"], dtype=np.int64)
            n, skipped = int(d["n"]), int(d["skipped"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise InputError(f"malformed temperature grid ({e})") from None
        if nll.shape != _INV_T.shape or (nll < 0).any() or n < 0 or skipped < 0:
            raise InputError("malformed temperature grid (sums or counts out of range)")
        out = cls()
        out.nll, out.n, out.skipped = nll, n, skipped
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TemperatureGrid):
            return NotImplemented
        return (self.n, self.skipped) == (other.n, other.skipped) and bool(
            np.array_equal(self.nll, other.nll))

    def __repr__(self) -> str:
        t = f"{self.fit():.4g}" if self.n else "-"
        return f"TemperatureGrid(n={self.n}, skipped={self.skipped}, T={t})"
