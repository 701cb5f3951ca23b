"""Shared helpers of the lpcal benchmarks: timing, Markdown tables and synthetic data.

Timing. The machine is shared and noisy, so every figure is a *ratio* against a baseline
measured in the same process, with the two measurements interleaved (baseline, candidate,
baseline, candidate, ...) so that a burst of background load hits both. A :class:`Timing` keeps
every repeat; the headline is the median over at least :data:`MIN_REPEATS` repeats, and the ratio
is the median of the per-pair ratios.

Synthetic data with known conditionals (the oracle). Logits ``z ~ N(0, s^2)`` per
class, ``f = softmax(z)`` and the true label distribution ``q = softmax(T log f) = softmax(T z)``
with ``T < 1``, so ``f`` is overconfident. Optionally a share of the rows takes its logits from a
fixed, finite set of *prototypes* (themselves ``N(0, s^2)`` draws): a model whose outputs
concentrate on a few points (as deep nets do near the vertices), which gives Algorithm 2 a set
``B`` of high-probability bins to work on. Continuous logits alone put almost every sample in its
own bin at ``lambda >= 20`` and leave ``B`` empty.

True error. For a calibrator ``h`` and fresh samples with known ``q``, the true ``Err_p(h)``
and Brier score are :func:`lpcal.metrics.err_p_true` and :func:`lpcal.metrics.brier_true` (``q``
replaces the one-hot label, which removes the label noise from the estimate).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lpcal.io import softmax_rows
from lpcal.levels import bin_counts

#: the real predictions of trained networks (CIFAR records, with their provenance)
DATA = Path(__file__).resolve().parent / "data"
MIN_REPEATS = 5


# ============================================================================ timing


@dataclass
class Timing:
    """Wall times (seconds) of repeated runs of one function."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def best(self) -> float:
        return min(self.values)

    def __len__(self) -> int:
        return len(self.values)


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(fn: Callable[[], object], repeats: int = MIN_REPEATS, warmup: int = 1) -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed (GC off while timing)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        vals = [_once(fn) for _ in range(repeats)]
    finally:
        if was:
            gc.enable()
    return Timing(vals)


@dataclass
class Comparison:
    """Interleaved timings of a candidate and its baseline."""

    candidate: Timing
    baseline: Timing
    ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Median over the repeats of ``candidate / baseline`` (measured back to back)."""
        return statistics.median(self.ratios)


def compare(candidate: Callable[[], object], baseline: Callable[[], object],
            repeats: int = MIN_REPEATS, warmup: int = 1) -> Comparison:
    """Time ``candidate`` and ``baseline`` alternately ``repeats`` times each."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        baseline()
        candidate()
    cand, base, ratios = [], [], []
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            b = _once(baseline)
            c = _once(candidate)
            base.append(b)
            cand.append(c)
            ratios.append(c / b if b > 0 else math.inf)
    finally:
        if was:
            gc.enable()
    return Comparison(Timing(cand), Timing(base), ratios)


def fmt_time(seconds: float) -> str:
    """Human-readable duration: µs, ms or s with three significant digits."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def fmt_num(x, digits: int = 3) -> str:
    """Compact number: integers as is, floats with ``digits`` significant digits."""
    if x is None:
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


# ============================================================================ tables


@dataclass
class Table:
    """One result table: a title, column headers, rows of cells (strings) and notes."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    key: str = ""  # stable identifier used by the smoke test

    def add(self, *cells) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"{self.title}: row has {len(cells)} cells for "
                             f"{len(self.headers)} headers")
        self.rows.append([str(c) for c in cells])

    def column(self, name: str) -> list[str]:
        i = self.headers.index(name)
        return [r[i] for r in self.rows]

    def to_markdown(self) -> str:
        out = [f"### {self.title}", ""]
        out.append("| " + " | ".join(h.replace("|", "\\|") for h in self.headers) + " |")
        out.append("|" + "|".join("---" for _ in self.headers) + "|")
        for r in self.rows:
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
        if self.notes:
            out.append("")
            out.extend(f"- {n}" for n in self.notes)
        return "\n".join(out) + "\n"


def yes_no(ok: bool) -> str:
    return "yes" if ok else "**NO**"


# ============================================================================ synthetic data


@dataclass(frozen=True)
class Overconfident:
    """Synthetic task with known conditionals (see the module docstring).

    ``k`` classes, logit scale ``s``, true temperature ``T`` (< 1: ``f`` is overconfident);
    ``prototypes`` fixed logit vectors (drawn with ``proto_seed``) supply a share
    ``proto_share`` of the rows, chosen uniformly; the other rows get fresh logits.
    """

    k: int
    s: float = 2.0
    T: float = 0.6
    prototypes: int = 0
    proto_share: float = 0.0
    zipf: float = 0.0
    proto_seed: int = 12345

    def protos(self) -> np.ndarray:
        """The fixed prototype logits, ``(prototypes, k)``."""
        return np.random.default_rng(self.proto_seed).normal(0.0, self.s, (self.prototypes, self.k))

    def proto_weights(self) -> np.ndarray:
        """Probability of each prototype: ``(i + 1)^-zipf``, normalised (uniform for 0)."""
        w = np.arange(1, self.prototypes + 1, dtype=np.float64) ** -self.zipf
        return w / w.sum()

    def _draw_labels(self, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        cdf = np.cumsum(q, axis=1)
        u = rng.random(q.shape[0]) * cdf[:, -1]
        return np.minimum((cdf < u[:, None]).sum(axis=1), self.k - 1).astype(np.int64)

    def sample_bins(self, n: int, lam: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(c, y)``: bin rows ``lambda * R(f)`` and labels of ``n`` fresh samples.

        Cheaper than :meth:`sample` for large pools: prototype rows reuse precomputed bins.
        """
        rng = np.random.default_rng(seed)
        c = np.empty((n, self.k), dtype=np.int32)
        y = np.empty(n, dtype=np.int64)
        pick = (rng.random(n) < self.proto_share) if self.prototypes else np.zeros(n, bool)
        if pick.any():
            z = self.protos()
            f = softmax_rows(z)
            q = softmax_rows(z * self.T)
            idx = rng.choice(self.prototypes, size=int(pick.sum()), p=self.proto_weights())
            c[pick] = bin_counts(f, lam)[idx]
            y[pick] = self._draw_labels(q[idx], rng)
        rest = int((~pick).sum())
        if rest:
            f, yr, _ = self.sample(rest, int(rng.integers(1 << 62)), prototypes_off=True)
            c[~pick] = bin_counts(f, lam)
            y[~pick] = yr
        return c, y

    def sample(self, n: int, seed: int, *, prototypes_off: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(f, y, q)``: predictions, labels drawn from ``q``, and ``q``; float64 / int64."""
        rng = np.random.default_rng(seed)
        z = rng.normal(0.0, self.s, (n, self.k))
        if self.prototypes and self.proto_share > 0 and not prototypes_off:
            pick = rng.random(n) < self.proto_share
            idx = rng.choice(self.prototypes, size=int(pick.sum()), p=self.proto_weights())
            z[pick] = self.protos()[idx]
        f = softmax_rows(z)
        z *= self.T
        q = softmax_rows(z, out=z)
        return f, self._draw_labels(q, rng), q


def p_label(p: float) -> str:
    return "inf" if math.isinf(p) else f"{p:g}"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def load_record(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(probs, labels)`` of the record ``DATA/<name>.npz``, rows renormalised to sum 1."""
    with np.load(DATA / f"{name}.npz") as z:
        probs = np.asarray(z["predictions"], dtype=np.float64)
        labels = np.asarray(z["ground_truth"], dtype=np.int64)
    return probs / probs.sum(axis=1, keepdims=True), labels


def rescale(probs: np.ndarray, scale: float) -> np.ndarray:
    """``softmax(scale * log p)``: the logit-scale drift (scale < 1: under-confident)."""
    z = scale * np.log(np.clip(probs, 1e-300, None))
    return softmax_rows(z, out=z)
