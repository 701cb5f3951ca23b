"""Champion and challenger: publish a candidate map only when held-out data says it is better.

A calibrator that refits as samples accrue must not replace a good live map (the *champion*)
with a worse candidate (the *challenger*) fitted on a noisy or mixed sample. The decision here
compares the two on held-out samples the challenger was **not fitted on**, through the **paired
difference of per-sample losses**::

    d_i = L(h_challenger(x_i), y_i) - L(h_champion(x_i), y_i),      i = 1..n held out,

with ``L`` the Brier score ``||h - e_y||^2`` (default; bounded in [0, 2], a proper scoring rule,
so it rewards calibration and sharpness together and cannot be gamed by a constant) or the
log-loss ``-log h_y`` (clipped at :data:`NLL_CLIP` nats). Pairing removes the between-sample
variance that both maps share, which is most of it: two temperature-scaled maps of one network
differ by far less per sample than either's loss varies across samples.

**The test.** ``H0: E[d] >= 0`` (the challenger is not better) against ``H1: E[d] < 0``. With
``dbar`` the mean and ``se = s / sqrt(n)`` its standard error (``s`` the sample standard deviation
of ``d``), the one-sided upper confidence bound at level ``1 - alpha`` is
``U = dbar + z_{1 - alpha} se`` (normal approximation by the central limit theorem; ``d`` is
bounded, and :func:`challenge` refuses to decide on fewer than ``min_samples``). The challenger
is **published iff ``U < -margin``** (``margin >= 0``, default 0): held-out data says it is better
with confidence ``1 - alpha``; otherwise the champion is **kept**. So a challenger whose held-out
mean loss is worse is never published (``U >= dbar >= 0``), and one that is truly no better is
published with probability at most ``alpha`` per test. A *refinement* (the live map's own
estimator refitted on more samples of the same regime) needs only ``dbar < -margin``
(``significance=False`` in :func:`challenge`): its improvement is second order in the
estimation error, a significance test would hold a stale estimate for tens of thousands of
samples, and a refinement held-out data says is worse is still never published. A caller testing successive challengers
against one champion spends ``alpha`` over the tests (:class:`lpcal.online.OnlineCalibrator`
uses ``alpha_j = alpha / (j (j + 1))`` for its ``j``-th test, which sums to ``alpha``).

**Sufficient statistics.** The test needs only ``(n, sum d, sum d^2)`` (:class:`PairedLoss`),
which are additive. Two sources:

* :class:`LossGrid`, for maps that are temperature scaling (the identity is ``T = 1``): for every
  held-out sample the vector ``l_i`` of its losses at the temperatures of a fixed grid
  (:data:`LOSS_GRID_LOG2_T`, ``log2 T`` from -4 to 4 in steps of 1/4), summed as ``sum l_i`` and
  ``sum l_i l_i^T``. The loss at any ``T`` is a cubic Lagrange interpolation ``w(T)^T l_i`` in
  ``log2 T``, so for two temperatures ``a``, ``b`` with ``u = w(a) - w(b)``::

      sum d_i = u^T (sum l_i),        sum d_i^2 = u^T (sum l_i l_i^T) u,

  exact at grid temperatures (``T = 1`` is one), interpolated between them. The sums cover any
  pair of temperatures, so a challenger can be tested the moment it is fitted, on every held-out
  sample already seen (retrospectively: they were held out of its fit by routing).
* :meth:`PairedLoss.score`, for any two maps (e.g. Algorithm 2's corrected map): both are applied
  to held-out samples as they arrive and the differences summed (prospectively: the samples
  arrive after the challenger was fitted).

Both are kept in int64 fixed point (:data:`SCALE` units per unit of loss, each per-sample loss
rounded), so sums are exact and associative and a decision is bit-identical however the samples
were batched. :class:`LossGrid` holds ``G = 33`` sums and the ``G (G + 1) / 2`` distinct products
per loss (about 4.7 kB each); up to ``2^25`` samples fit (log-loss products reach ``2^38``
units per sample).

References: P. J. Huber, *The behavior of maximum likelihood estimates under nonstandard
conditions*, 1967 (the loss-difference view of model comparison); F. X. Diebold and R. S.
Mariano, *Comparing predictive accuracy*, JBES 1995 (the paired loss-difference test).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from lpcal.errors import InputError
from lpcal.precalibrate import chunk_rows, chunk_runs, grid_exp, run_bounds, shifted_log
from lpcal.warmup import lagrange_weights, normal_quantile

__all__ = ["LOSSES", "LOSS_GRID_LOG2_T", "NLL_CLIP", "SCALE", "Decision", "LossGrid",
           "PairedLoss", "challenge", "per_sample_loss", "update_runs"]

#: ``log2`` of the loss grid's temperatures: -4 to 4 in steps of 1/4 (33 points).
LOSS_GRID_LOG2_T = np.arange(-16, 17, dtype=np.float64) / 4.0
_INV_T = 2.0 ** -LOSS_GRID_LOG2_T
_G = LOSS_GRID_LOG2_T.size
_GRID_ID = "log2T:-4:4:1/4"
_IU = np.triu_indices(_G)
_IU_FLAT = _IU[0] * _G + _IU[1]
#: Fixed-point units per unit of loss (per-sample losses are rounded to ``1 / SCALE``).
SCALE = float(1 << 14)
#: Largest per-sample log-loss summed, in nats (a label given probability ``< e^-32``).
NLL_CLIP = 32.0
LOSSES = ("brier", "nll")
#: Rows per chunk of the grid's exponentials, at most: the products of per-sample losses
#: (integers up to ``2^38``) then sum exactly in float64 (below ``2^53``).
_EXACT_ROWS = 1 << 14


def _zeros(n: int) -> np.ndarray:
    a = np.zeros(n, dtype=np.int64)
    a.flags.writeable = False
    return a


#: The sums and products of an empty :class:`LossGrid`: shared, read-only (mappings that
#: cannot be assigned to), replaced by the grid's own arrays on its first update.
_ZERO_SUMS = MappingProxyType({loss: _zeros(_G) for loss in LOSSES})
_ZERO_PRODS = MappingProxyType({loss: _zeros(_IU[0].size) for loss in LOSSES})
#: Bytes of a grid's arrays.
_NBYTES = 8 * len(LOSSES) * (_G + _IU[0].size)


def per_sample_loss(h: np.ndarray, labels: np.ndarray, loss: str) -> np.ndarray:
    """``L(h_i, y_i)`` for every row: Brier ``||h_i - e_y||^2`` or log-loss (clipped)."""
    h = np.asarray(h, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    hy = h[np.arange(h.shape[0]), y]
    if loss == "brier":
        return np.einsum("ij,ij->i", h, h) - 2.0 * hy + 1.0
    if loss == "nll":
        with np.errstate(divide="ignore"):
            return np.minimum(-np.log(hy), NLL_CLIP)
    raise InputError(f"loss must be one of {LOSSES}, got {loss!r}")


def _fixed(v: np.ndarray) -> np.ndarray:
    return np.rint(v * SCALE).astype(np.int64)


@dataclass(frozen=True)
class PairedLoss:
    """Additive sums of a paired loss difference ``d = L(challenger) - L(champion)``:
    ``n`` samples, ``sd = sum d`` and ``sd2 = sum d^2`` in units of ``1 / SCALE`` and
    ``1 / SCALE^2`` (exact integers)."""

    loss: str
    n: int = 0
    sd: int = 0
    sd2: int = 0

    @classmethod
    def score(cls, challenger: np.ndarray, champion: np.ndarray, labels: np.ndarray,
              loss: str = "brier") -> PairedLoss:
        """The sums of one batch: both maps' outputs ``(n, k)`` on held-out samples."""
        d = _fixed(per_sample_loss(challenger, labels, loss)) - _fixed(
            per_sample_loss(champion, labels, loss))
        return cls(loss, int(d.size), int(d.sum()), int((d * d).sum()))

    def __add__(self, other: PairedLoss) -> PairedLoss:
        if other.loss != self.loss:
            raise InputError(f"cannot add paired {self.loss} and {other.loss} sums")
        return PairedLoss(self.loss, self.n + other.n, self.sd + other.sd, self.sd2 + other.sd2)

    @property
    def mean(self) -> float:
        """Mean difference ``dbar`` (nan without samples)."""
        return self.sd / SCALE / self.n if self.n else math.nan

    @property
    def stderr(self) -> float:
        """Standard error of ``dbar``: ``s / sqrt(n)`` with the unbiased variance."""
        if self.n < 2:
            return math.inf
        m = self.sd / SCALE / self.n
        var = (self.sd2 / SCALE**2 - self.n * m * m) / (self.n - 1)
        return math.sqrt(max(var, 0.0) / self.n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PairedLoss:
        try:
            out = cls(str(d["loss"]), int(d["n"]), int(d["sd"]), int(d["sd2"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"malformed paired loss sums ({e})") from None
        if out.loss not in LOSSES or out.n < 0 or out.sd2 < 0:
            raise InputError(f"malformed paired loss sums ({out})")
        return out


@dataclass(frozen=True)
class Decision:
    """The verdict of :func:`challenge` and its evidence: ``publish`` (else keep the
    champion), the loss, ``n`` paired samples, the mean difference (challenger minus champion;
    negative: the challenger is better), its standard error, the one-sided upper bound ``U`` at
    level ``1 - alpha``, ``alpha`` and, when kept, why."""

    publish: bool
    loss: str
    n: int
    mean_diff: float
    stderr: float
    upper_bound: float
    alpha: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def challenge(paired: PairedLoss, *, alpha: float = 0.05, min_samples: int = 200,
              margin: float = 0.0, significance: bool = True) -> Decision:
    """Publish the challenger iff ``dbar + z_{1 - alpha} se < -margin`` on at least
    ``min_samples`` paired held-out samples (module docstring).

    ``significance=False`` is the **refinement** rule: publish iff ``dbar < -margin`` (the
    held-out point estimate is better, no confidence required). It is for a challenger that
    re-estimates the live map's own parameters on more samples of the same regime (a consistent
    estimator fitted on, say, twice the data): requiring significance there would keep a map
    whose loss is worse by a second-order amount for a very long time (the difference shrinks
    with the square of the estimation error while its noise shrinks only linearly), yet the
    promise still holds that a map held-out data says is worse is never published.

    Returns
    -------
    Decision
        ``publish`` and the evidence; never ``publish`` when the challenger's held-out mean
        loss is not below the champion's.
    """
    if not (0.0 < alpha < 0.5) or margin < 0 or min_samples < 2:
        raise InputError(f"challenge needs 0 < alpha < 0.5, margin >= 0, min_samples >= 2; "
                         f"got {alpha!r}, {margin!r}, {min_samples!r}")
    m, se = paired.mean, paired.stderr
    if paired.n < min_samples:
        return Decision(False, paired.loss, paired.n, m, se, math.inf, alpha,
                        f"{paired.n} < {min_samples} held-out samples")
    u = m + normal_quantile(1.0 - alpha) * se if significance else m
    if u < -margin:
        return Decision(True, paired.loss, paired.n, m, se, u, alpha if significance else 0.5,
                        "")
    why = ("held-out loss is worse" if m > 0 else
           "held-out loss is not lower" if m >= -margin else "not significant")
    return Decision(False, paired.loss, paired.n, m, se, u, alpha, why)


class LossGrid:
    """Held-out loss sums of temperature scaling at every temperature of
    :data:`LOSS_GRID_LOG2_T` (module docstring): for each loss, ``sums[loss]`` (G,) and the
    packed upper triangle ``prods[loss]`` (G (G + 1) / 2,) of ``sum l_i l_i^T``, int64 in units
    of ``1 / SCALE`` and ``1 / SCALE^2``; ``n`` samples."""

    __slots__ = ("n", "prods", "sums")

    def __init__(self) -> None:
        self.n = 0
        # an empty grid reads shared read-only zeros; its own arrays come with the first
        # update (``nbytes`` counts them all along: what the grid holds once it is used)
        self.sums, self.prods = _ZERO_SUMS, _ZERO_PRODS

    def update(self, probs: np.ndarray, labels: np.ndarray) -> LossGrid:
        """Add held-out rows ``probs`` (n, k) of the raw model with labels; returns self."""
        x = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        if x.ndim != 2 or y.shape != (x.shape[0],):
            raise InputError(f"LossGrid.update: probs {x.shape} and labels {y.shape} do not "
                             "match")
        if x.shape[0]:
            update_runs([self], x, y, [x.shape[0]])
        return self

    def merge(self, other: LossGrid) -> LossGrid:
        """A new object with the sums of both (neither is modified)."""
        out = LossGrid()
        out.n = self.n + other.n
        if self.sums is _ZERO_SUMS and other.sums is _ZERO_SUMS:
            return out
        out.sums = {loss: self.sums[loss] + other.sums[loss] for loss in LOSSES}
        out.prods = {loss: self.prods[loss] + other.prods[loss] for loss in LOSSES}
        return out

    __add__ = merge

    def _weights(self, temperature: float | None) -> np.ndarray:
        t = 1.0 if temperature is None else float(temperature)
        if not (t > 0 and math.isfinite(t)):
            raise InputError(f"temperature must be positive and finite, got {temperature!r}")
        first, w = lagrange_weights(math.log2(t), LOSS_GRID_LOG2_T)
        out = np.zeros(_G)
        out[first:first + w.size] = w
        return out

    def mean_loss(self, temperature: float | None, loss: str = "brier") -> float:
        """Held-out mean loss of temperature scaling at ``temperature`` (None: identity)."""
        if loss not in LOSSES:
            raise InputError(f"loss must be one of {LOSSES}, got {loss!r}")
        return float(self._weights(temperature) @ self.sums[loss]) / SCALE / max(self.n, 1)

    def paired(self, challenger: float | None, champion: float | None,
               loss: str = "brier") -> PairedLoss:
        """:class:`PairedLoss` of ``TS(challenger) - TS(champion)`` on the held-out samples
        (temperatures; None: the identity)."""
        if loss not in LOSSES:
            raise InputError(f"loss must be one of {LOSSES}, got {loss!r}")
        u = self._weights(challenger) - self._weights(champion)
        full = np.zeros((_G, _G))
        full[_IU] = self.prods[loss]
        full = full + np.triu(full, 1).T
        sd = float(u @ self.sums[loss])
        sd2 = float(u @ full @ u)
        return PairedLoss(loss, self.n, round(sd), max(round(sd2), 0))

    @property
    def nbytes(self) -> int:
        return _NBYTES

    def to_dict(self, *, packed: bool = False) -> dict[str, Any]:
        """JSON-safe dict. ``packed`` (the checkpoint format ``lpcal.model_state/6``): the sums
        and products as one base64 string of little-endian int64 (the sums of each loss, then
        the products of each loss, in :data:`LOSSES` order), left out while no sample was
        added; else integer lists."""
        if packed:
            d: dict[str, Any] = {"grid": _GRID_ID, "scale": int(SCALE), "n": self.n}
            if self.n or any(v.any() for v in (*self.sums.values(), *self.prods.values())):
                d["data"] = base64.b64encode(b"".join(
                    np.asarray(a, dtype="<i8").tobytes()
                    for a in (*(self.sums[x] for x in LOSSES), *(self.prods[x] for x in LOSSES))
                )).decode("ascii")
            return d
        return {"grid": _GRID_ID, "scale": int(SCALE), "n": self.n,
                "sums": {k: v.tolist() for k, v in self.sums.items()},
                "prods": {k: v.tolist() for k, v in self.prods.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LossGrid:
        """Inverse of :meth:`to_dict` (either form); malformed input raises
        :class:`InputError`."""
        out = cls()
        try:
            if d["grid"] != _GRID_ID or int(d["scale"]) != int(SCALE):
                raise ValueError(f"unknown grid {d['grid']!r} or scale {d['scale']!r}")
            out.n = int(d["n"])
            if "sums" not in d:  # packed
                out._unpack(d.get("data"))
                if out.n < 0:
                    raise ValueError(f"n={out.n}")
                return out
            out.sums = {loss: np.asarray(d["sums"][loss], dtype=np.int64) for loss in LOSSES}
            out.prods = {loss: np.asarray(d["prods"][loss], dtype=np.int64)
                         for loss in LOSSES}
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise InputError(f"malformed loss grid ({e})") from None
        if out.n < 0 or any(out.sums[x].shape != (_G,) or out.prods[x].shape != _IU[0].shape
                            for x in LOSSES):
            raise InputError("malformed loss grid (arrays out of shape or range)")
        return out

    def _unpack(self, data: Any) -> None:
        """Set the sums and products from :meth:`to_dict`'s packed ``data`` (None: all zero)."""
        if data is None:
            return
        if type(data) is not str:
            raise ValueError("packed loss grid data is not a string")
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"packed loss grid is not base64 ({e})") from None
        m, t = _G, _IU[0].size
        if len(raw) != 8 * len(LOSSES) * (m + t):
            raise ValueError(f"packed loss grid has {len(raw)} bytes, expected "
                             f"{8 * len(LOSSES) * (m + t)}")
        a = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        self.sums = {loss: a[i * m:(i + 1) * m] for i, loss in enumerate(LOSSES)}
        self.prods = {loss: a[len(LOSSES) * m + i * t:len(LOSSES) * m + (i + 1) * t]
                      for i, loss in enumerate(LOSSES)}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LossGrid):
            return NotImplemented
        return self.n == other.n and all(
            np.array_equal(self.sums[x], other.sums[x])
            and np.array_equal(self.prods[x], other.prods[x]) for x in LOSSES)

    def __repr__(self) -> str:
        return f"LossGrid(n={self.n})"


def update_runs(grids: Sequence[LossGrid], probs: np.ndarray, labels: np.ndarray,
                counts) -> None:
    """:meth:`LossGrid.update` of each ``grids[j]`` with the ``j``-th run of ``counts`` (m,)
    validated rows, in one pass for all of them (:func:`lpcal.window.flush_many`): each gets
    the sums of its own rows, to the bit (:func:`lpcal.precalibrate.run_bounds`); a run of no
    rows changes nothing.

    The products ``sum_i l_i l_i^T`` of a chunk inside one run are one matrix product; a chunk
    holding several runs takes each row's products of the upper triangle and sums them by run.
    Both are exact (integers up to ``2^38``, sums over at most :data:`_EXACT_ROWS` rows below
    ``2^53``), so they agree to the bit."""
    counts = np.asarray(counts, dtype=np.int64)
    bounds, owners = run_bounds(counts)
    mine = [grids[j] for j in owners.tolist()]
    for g in mine:
        if g.sums is _ZERO_SUMS:
            g.sums = {loss: np.zeros(_G, dtype=np.int64) for loss in LOSSES}
            g.prods = {loss: np.zeros(_IU[0].size, dtype=np.int64) for loss in LOSSES}
    z = shifted_log(probs)
    for a, b, e, S in grid_exp(z, _INV_T, min(_EXACT_ROWS, chunk_rows(_G, probs.shape[1]))):
        lo, hi, starts = chunk_runs(bounds, a, b)
        e /= S[None]                                                 # q, (k, G, m)
        m = b - a
        qy = e[labels[a:b], :, np.arange(m)].T                       # (G, m)
        q = np.ascontiguousarray(e.transpose(1, 2, 0))               # (G, m, k)
        v = np.empty((2, _G, m))                                     # brier, nll
        np.einsum("gmk,gmk->gm", q, q, out=v[0])
        v[0] -= 2.0 * qy
        v[0] += 1.0
        with np.errstate(divide="ignore"):
            np.log(qy, out=v[1])
        np.negative(v[1], out=v[1])
        np.minimum(v[1], NLL_CLIP, out=v[1])
        v *= SCALE
        np.rint(v, out=v)                                            # integers, as float
        if starts.size == 1:                                         # (runs, 2, ...) each
            sums = v.sum(axis=2).astype(np.int64)[None]
            prods = np.take(np.matmul(v, v.transpose(0, 2, 1)).reshape(2, _G * _G), _IU_FLAT,
                            axis=1).astype(np.int64)[None]
        else:  # rows first: the products, their sums by run and the adds run contiguously
            vt = np.ascontiguousarray(v.transpose(2, 0, 1))          # (m, 2, G)
            sums = np.add.reduceat(vt, starts, axis=0).astype(np.int64)
            prods = np.add.reduceat(vt[:, :, _IU[0]] * vt[:, :, _IU[1]], starts,
                                    axis=0).astype(np.int64)
        for r, g in enumerate(mine[lo:hi]):
            for i, loss in enumerate(LOSSES):
                g.sums[loss] += sums[r, i]
                g.prods[loss] += prods[r, i]
    for g, c in zip(mine, counts[owners].tolist()):
        g.n += c
