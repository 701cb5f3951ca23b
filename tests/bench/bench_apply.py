"""Benchmark 2: ``BinMap.apply`` throughput as a ratio to computing ``R`` alone.

For each ``k`` a bin map is fitted on synthetic data (half the rows on fixed prototypes, so ``B``
is not empty); then ``apply(probs)`` and ``bin_counts(probs, lam)`` run interleaved on the same
fresh array. Target (issue 2): ``apply`` within 3x of ``R``. Besides the default (validated
input, ``rho`` outside ``B``) the table shows ``check=False``, ``outside="identity"`` and a bin map
with a pre-scaling temperature (which adds a log/exp pass).

Run alone: ``python -m tests.bench.bench_apply [--quick]``.
"""

from __future__ import annotations

import math
import sys
import warnings

from lpcal.calibrate import fit
from lpcal.levels import bin_counts
from tests.bench.common import MIN_REPEATS, Overconfident, Table, compare, fmt_time, yes_no

TARGET = 3.0
ELEMENTS = 10**7  # n * k of the timed array (80 MB of float64)


def _variants(k: int, fit_n: int):
    task = Overconfident(k, s=3.0, T=0.5, prototypes=50, proto_share=0.5)
    f, y, _ = task.sample(fit_n, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit(f, y, eps=0.05, p=math.inf, seed=0)
        ident = fit(f, y, eps=0.05, p=math.inf, seed=0, outside="identity")
        temp = fit(f, y, eps=0.05, p=math.inf, seed=0, prescale="temperature")
    return task, [
        ("default (check, rho outside B)", plain, {}),
        ("check=False", plain, {"check": False}),
        ("outside=identity", ident, {}),
        ("prescale=temperature", temp, {}),
    ]


def run(quick: bool = False) -> list[Table]:
    tab = Table(
        "Apply throughput: `BinMap.apply` vs computing R (`bin_counts`) on the same array",
        ["k", "n", "lambda", "|B|", "variant", "R rows/s", "apply rows/s", "R (median)",
         "apply (median)", "apply / R", "target <= 3x"],
        key="apply",
    )
    ks = (10, 100) if quick else (10, 100, 1000)
    elements = 2 * 10**5 if quick else ELEMENTS
    for k in ks:
        task, variants = _variants(k, 3000 if quick else 20000)
        n = elements // k
        x, _, _ = task.sample(n, seed=4)
        for name, bm, kw in variants:
            cmp_ = compare(lambda bm=bm, kw=kw, x=x: bm.apply(x, **kw),
                           lambda bm=bm, x=x: bin_counts(x, bm.lam),
                           repeats=MIN_REPEATS)
            tab.add(k, f"{n:,}", bm.lam, bm.n_bins, name,
                    f"{n / cmp_.baseline.median:,.0f}", f"{n / cmp_.candidate.median:,.0f}",
                    fmt_time(cmp_.baseline.median), fmt_time(cmp_.candidate.median),
                    f"{cmp_.ratio:.2f}x", yes_no(cmp_.ratio <= TARGET))
    tab.notes.append(
        "Bin maps fitted with eps = 0.05, p = inf (lambda = 20) on 20,000 synthetic samples "
        "(logits N(0, 3^2), T = 0.5, half the rows on 50 prototypes); applied to a fresh array of "
        f"n * k = {elements:.0e} values from the same distribution (about half of the rows hit B).")
    tab.notes.append(f"Medians of {MIN_REPEATS} interleaved repeats; `apply / R` is the median of "
                     "the per-repeat ratios.")
    return [tab]


if __name__ == "__main__":
    for t in run("--quick" in sys.argv[1:]):
        print(t.to_markdown())
