"""Baseline calibrators on every prediction record of ``tests/bench/data``.

For each record (the five CIFAR records and the scikit-learn ones of
:mod:`tests.bench.make_sklearn_records`) and each split seed, the samples are split in half by
the same seeded permutation as :mod:`tests.bench.bench_quality` (``default_rng(1000 + seed)``);
every baseline of :mod:`tests.bench.baselines` is fitted on the first half and evaluated on the
second. Metrics on the evaluation half: top-label ECE and classwise ECE (15 equal-width bins),
Brier, NLL, accuracy and the plug-in ``Err_inf`` at lambda = 20
(``lpcal.metrics.err_p(h, y, 20, inf)``); each figure is the median over the seeds.

Run alone: ``python -m tests.bench.compare_baselines [--quick]`` (``--quick``: two records, one
seed). :func:`baseline_rows` gives the medians of one record as a dict, for other benchmarks.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lpcal import metrics
from lpcal.io import load_predictions
from tests.bench.baselines import BASELINES
from tests.bench.common import Table, fmt_num, median

DATA = Path(__file__).resolve().parent / "data"
SEEDS = (0, 1, 2, 3, 4)
METRICS = ["Err_inf (lam=20)", "top-label ECE", "classwise ECE", "Brier", "NLL", "accuracy"]
"""Metric names (as in :mod:`tests.bench.bench_quality`)."""
QUICK_RECORDS = ["wideresnet-16-4-cifar-10", "mlp-digits"]


def records() -> list[str]:
    """Stems of every ``.npz`` record in ``tests/bench/data``: CIFAR first, then the rest."""
    names = sorted(p.stem for p in DATA.glob("*.npz"))
    return sorted(names, key=lambda s: (not s.endswith(("cifar-10", "cifar-100")), s))


def load_record(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(probs, labels)`` of ``tests/bench/data/<name>.npz``."""
    return load_predictions(DATA / f"{name}.npz")


def split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fit and evaluation indices: halves of ``default_rng(1000 + seed).permutation(n)``."""
    perm = np.random.default_rng(1000 + seed).permutation(n)
    return perm[: n // 2], perm[n // 2:]


def evaluate(h: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Every metric of :data:`METRICS` for calibrated probabilities ``h`` and labels ``y``."""
    return {
        "Err_inf (lam=20)": metrics.err_p(h, y, 20, math.inf),
        "top-label ECE": metrics.top_label_ece(h, y, n_bins=15),
        "classwise ECE": metrics.classwise_ece(h, y, n_bins=15),
        "Brier": metrics.brier(h, y),
        "NLL": metrics.nll(h, y),
        "accuracy": metrics.accuracy(h, y),
    }


def baseline_rows(name: str, seeds: Sequence[int] = SEEDS) -> dict[str, dict[str, float]]:
    """Median metrics of ``uncalibrated`` and of every baseline on record ``name``.

    Parameters
    ----------
    name : str
        Record stem in ``tests/bench/data`` (e.g. ``"mlp-digits"``).
    seeds : sequence of int
        Split seeds; the split of seed ``s`` is :func:`split` ``(n, s)``.

    Returns
    -------
    dict
        ``{method: {metric: median over seeds}}``, methods ``"uncalibrated"`` then the keys of
        :data:`tests.bench.baselines.BASELINES`, metrics :data:`METRICS`.
    """
    x, y = load_record(name)
    runs: dict[str, list[dict[str, float]]] = {"uncalibrated": []}
    runs.update({m: [] for m in BASELINES})
    for seed in seeds:
        a, b = split(x.shape[0], seed)
        runs["uncalibrated"].append(evaluate(x[b], y[b]))
        for method, cls in BASELINES.items():
            h = cls().fit(x[a], y[a]).predict(x[b])
            runs[method].append(evaluate(h, y[b]))
    return {m: {k: median([r[k] for r in rs]) for k in METRICS} for m, rs in runs.items()}


def table(name: str, seeds: Sequence[int] = SEEDS) -> Table:
    """One Markdown-ready table of :func:`baseline_rows` for record ``name``."""
    x, _ = load_record(name)
    n, k = x.shape
    rows = baseline_rows(name, seeds)
    tab = Table(f"{name} (n={n}, k={k}; fit on {n // 2}, evaluate on {n - n // 2})",
                ["method", *METRICS], key=f"baselines-{name}")
    for method, vals in rows.items():
        tab.add(method, *(fmt_num(vals[m], 4 if m == "accuracy" else 3) for m in METRICS))
    tab.notes.append(f"Medians over {len(seeds)} split seed(s) {tuple(seeds)}.")
    return tab


def run(quick: bool = False) -> list[Table]:
    names = QUICK_RECORDS if quick else records()
    seeds = SEEDS[:1] if quick else SEEDS
    return [table(name, seeds) for name in names]


if __name__ == "__main__":
    for t in run("--quick" in sys.argv[1:]):
        print(t.to_markdown())
