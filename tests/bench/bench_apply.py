"""Benchmark 2: ``BinMap.apply`` against temperature scaling and against R.

Three kinds of bin map, all at eps = 0.05, p = inf (lambda = 20):

* **default**: ``lpcal.fit(f, y, eps=0.05, p=inf)`` (mode "certified") on an overconfident model
  that temperature scaling fixes (logits ``N(0, 3^2)``, true temperature 0.5). It publishes the
  temperature alone with a certificate (``B`` empty, identity outside). The targets are
  for this map.
* **TS + B**: a temperature and groups in ``B``, identity outside (the form of the certified
  mode's "corrected" candidate): ``fit(..., mode="paper", prescale="temperature",
  outside="identity")`` on a model whose outputs concentrate on 50 prototypes (half the rows).
* **paper**: ``fit(..., mode="paper")`` on the same model: no temperature, ``rho`` outside ``B``.

The baseline is temperature scaling written as plain vectorised numpy, ``e = exp(log(f) / T)``,
``e / e.sum(axis=1, keepdims=True)`` (:func:`temperature_scaling`), at the map's temperature (2
for the paper map, which has none), on the same array. Tables:

1. one row (``(1, k)`` arrays): p50 and p99 latency of ``apply`` and of the baseline, called
   alternately row after row; target p50 at most 2x the baseline's for the default map;
2. batches: wall time of ``apply`` over the baseline, interleaved; target at most 1.0x for the
   default map at every k and n. ``n * k`` is capped at :data:`MAX_ELEMENTS` values (160 MB of
   float64 per array) to keep memory reasonable on a shared machine;
3. ``apply`` of paper-mode maps against computing R alone (``bin_counts``); target 3x.

Run alone: ``python -m tests.bench.bench_apply [--quick]``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings

import numpy as np

from lpcal.calibrate import fit
from lpcal.client import BinMapStore
from lpcal.levels import bin_counts
from tests.bench.common import MIN_REPEATS, Overconfident, Table, compare, fmt_time, yes_no

LATENCY_TARGET = 2.0
BATCH_TARGET = 1.0
R_TARGET = 3.0
MAX_ELEMENTS = 2 * 10**7  # n * k of a timed batch (160 MB of float64)
FIT_ELEMENTS = 2 * 10**7  # n * k of a fit sample (at most 20,000 rows)
R_ELEMENTS = 10**7
CALLS, ROUNDS = 2000, MIN_REPEATS  # single rows: calls per round, rounds
NO_T = 2.0  # baseline temperature for the paper map (it has none)


def temperature_scaling(f: np.ndarray, temperature: float) -> np.ndarray:
    """The baseline: ``exp(log f / T)``, normalised row-wise (plain vectorised numpy)."""
    e = np.exp(np.log(f) / temperature)
    return e / e.sum(axis=1, keepdims=True)


def _maps(k: int, fit_n: int) -> dict:
    """``{name: (task, bin map)}`` for the three kinds of map (module docstring)."""
    smooth = Overconfident(k, s=3.0, T=0.5)
    proto = Overconfident(k, s=3.0, T=0.5, prototypes=50, proto_share=0.5)
    f, y, _ = smooth.sample(fit_n, seed=3)
    fp, yp, _ = proto.sample(fit_n, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "default": (smooth, fit(f, y, eps=0.05, p=math.inf, seed=0)),
            "TS + B": (proto, fit(fp, yp, eps=0.05, p=math.inf, seed=0, mode="paper",
                                  prescale="temperature", outside="identity")),
            "paper": (proto, fit(fp, yp, eps=0.05, p=math.inf, seed=0, mode="paper")),
        }


def _kind(bm) -> str:
    cert = bm.certificate.selected if bm.certificate else "-"
    t = "none" if bm.temperature is None else f"{bm.temperature:.2f}"
    return f"{bm.mode}, selected {cert}, T {t}, outside {bm.outside}"


# ----------------------------------------------------------------------------- one row


def _latency(fn, base, rows, rounds: int) -> dict:
    """Per round: p50 and p99 of ``fn(row)`` and ``base(row)``, called alternately; medians."""
    pc = time.perf_counter_ns
    for r in rows[: max(1, len(rows) // 10)]:  # warm-up
        base(r)
        fn(r)
    stats = {"b50": [], "b99": [], "c50": [], "c99": [], "r50": [], "r99": []}
    for _ in range(rounds):
        bt, ct = np.empty(len(rows)), np.empty(len(rows))
        for i, r in enumerate(rows):
            t0 = pc()
            base(r)
            t1 = pc()
            fn(r)
            ct[i] = pc() - t1
            bt[i] = t1 - t0
        b50, b99, c50, c99 = (float(np.percentile(a, q)) * 1e-9
                              for a, q in ((bt, 50), (bt, 99), (ct, 50), (ct, 99)))
        for key, v in zip(stats, (b50, b99, c50, c99, c50 / b50, c99 / b99)):
            stats[key].append(v)
    return {key: statistics.median(v) for key, v in stats.items()}


def latency_table(quick: bool) -> Table:
    tab = Table(
        "Apply latency, one row: `BinMap.apply` on a (1, k) array vs temperature scaling",
        ["k", "map", "|B|", "call", "TS p50", "TS p99", "apply p50", "apply p99",
         "p50 / TS", "p99 / TS", "target p50 <= 2x"],
        key="apply_latency",
    )
    calls, rounds = (200, 3) if quick else (CALLS, ROUNDS)
    for k in (10, 100):
        maps = _maps(k, 3000 if quick else min(20000, FIT_ELEMENTS // k))
        for name, (task, bm) in maps.items():
            x, _, _ = task.sample(calls, seed=4)
            rows = [x[i : i + 1] for i in range(calls)]
            temp = bm.temperature or NO_T
            base = lambda r, temp=temp: temperature_scaling(r, temp)
            store = BinMapStore()
            store.offer(bm)
            buf = np.empty((1, k))
            calls_ = [("bm.apply(row)", bm.apply)]
            if name == "default":
                calls_ += [("bm.apply(row, out=buf, check=False)",
                            lambda r, bm=bm, buf=buf: bm.apply(r, out=buf, check=False)),
                           ("BinMapStore.apply(model, row)",
                            lambda r, s=store, m=bm.model_id: s.apply(m, r))]
            for label, fn in calls_:
                st = _latency(fn, base, rows, rounds)
                target = yes_no(st["r50"] <= LATENCY_TARGET) if name == "default" else "–"
                tab.add(k, name, bm.n_bins, f"`{label}`", fmt_time(st["b50"]),
                        fmt_time(st["b99"]), fmt_time(st["c50"]), fmt_time(st["c99"]),
                        f"{st['r50']:.2f}x", f"{st['r99']:.2f}x", target)
            if name == "default":
                tab.notes.append(f"k = {k}: the default map is {_kind(bm)}.")
    tab.notes.append(
        f"{calls:,} rows per round, each timed alone (`perf_counter_ns`) with the baseline "
        f"and `apply` called alternately on it; p50/p99 are medians over {rounds} rounds, and "
        "the ratios medians of the per-round ratios. Baseline: `exp(log(f) / T)` normalised "
        "(numpy on the (1, k) row, no validation) at the map's temperature.")
    tab.notes.append(
        "A single row takes a dedicated path: the same arithmetic on 1-D views, rows of "
        "k <= 32 summed as Python lists, and for maps with bins a `dict` from the bin's two "
        "exact hashes to its group prediction, built when the map is loaded. "
        "`BinMapStore.apply` adds one dict read and a call.")
    return tab


# ----------------------------------------------------------------------------- batches


def _grid(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return [(10, 2000), (100, 2000)]
    out = []
    for k in (10, 100, 1000, 10000):
        for n in (10**4, 10**6):
            cell = (k, min(n, MAX_ELEMENTS // k))
            if cell not in out:
                out.append(cell)
    return out


def batch_table(quick: bool) -> Table:
    tab = Table(
        "Apply throughput: `BinMap.apply` vs temperature scaling on the same array (batches)",
        ["k", "n", "map", "|B|", "variant", "TS (median)", "apply (median)", "apply rows/s",
         "apply / TS", "target <= 1.0x"],
        key="apply",
    )
    grid = _grid(quick)
    maps_by_k: dict = {}
    for k, n in grid:
        if k not in maps_by_k:
            maps_by_k[k] = _maps(k, 3000 if quick else min(20000, FIT_ELEMENTS // k))
        for name, (task, bm) in maps_by_k[k].items():
            x, _, _ = task.sample(n, seed=4)
            temp = bm.temperature or NO_T
            variants = [("apply(x)", lambda bm=bm, x=x: bm.apply(x))]
            if name == "default":
                buf = np.empty_like(x)
                variants += [
                    ("check=False", lambda bm=bm, x=x: bm.apply(x, check=False)),
                    ("out=buf", lambda bm=bm, x=x, buf=buf: bm.apply(x, out=buf)),
                    ("out=buf, check=False",
                     lambda bm=bm, x=x, buf=buf: bm.apply(x, out=buf, check=False)),
                ]
            for label, fn in variants:
                cmp_ = compare(fn, lambda x=x, temp=temp: temperature_scaling(x, temp),
                               repeats=MIN_REPEATS)
                target = yes_no(cmp_.ratio <= BATCH_TARGET) if name == "default" else "–"
                tab.add(k, f"{n:,}", name, bm.n_bins, label, fmt_time(cmp_.baseline.median),
                        fmt_time(cmp_.candidate.median),
                        f"{n / cmp_.candidate.median:,.0f}", f"{cmp_.ratio:.2f}x", target)
            del x
    capped = [f"k = {k:,}: {n:,}" for k, n in grid if n not in (10**4, 10**6)]
    tab.notes.append(
        f"n * k is capped at {MAX_ELEMENTS:.0e} values per array: n = min(n, cap / k) for n in "
        "{1e4, 1e6}, duplicate cells dropped; rows actually run where capped: "
        + "; ".join(capped) + "." if not quick else "Quick run: tiny arrays.")
    tab.notes.append(
        f"Medians of {MIN_REPEATS} interleaved repeats (baseline, apply, baseline, ...); "
        "`apply / TS` is the median of the per-repeat ratios. Maps fitted on min(20,000, 2e7 / k) "
        "samples; the arrays are fresh samples of the same model (for TS + B and paper about "
        "half of the rows fall in B). `out=buf` writes into a preallocated array; "
        "`check=False` skips the row validation.")
    tab.notes.append(
        "apply runs in chunks of max(16, 65,536 / k) rows: temperature scaling in place in the "
        "output (one log, a multiplication by 1/T, one exp, a gemv row sum and one "
        "normalisation; validation adds one gemv row sum on rows already in cache), then, for "
        "maps with bins, the floor, one gemm for both hashes and the bin sums, a table lookup "
        "on the low bits of the first hash and the writes for rows in B. The baseline allocates "
        "four temporaries of n * k and does not validate.")
    return tab


# ----------------------------------------------------------------------------- against R


def _variants(k: int, fit_n: int):
    """``(task, [(name, bin map, apply kwargs), ...])``: the paper-mode maps of the R table
    (also profiled by :mod:`tests.bench.bench_fit`, which takes the first)."""
    task = Overconfident(k, s=3.0, T=0.5, prototypes=50, proto_share=0.5)
    f, y, _ = task.sample(fit_n, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit(f, y, eps=0.05, p=math.inf, seed=0, mode="paper")
        ident = fit(f, y, eps=0.05, p=math.inf, seed=0, mode="paper", outside="identity")
        temp = fit(f, y, eps=0.05, p=math.inf, seed=0, mode="paper", prescale="temperature")
    return task, [
        ("paper (check, rho outside B)", plain, {}),
        ("check=False", plain, {"check": False}),
        ("outside=identity", ident, {}),
        ("prescale=temperature", temp, {}),
    ]


def r_table(quick: bool) -> Table:
    tab = Table(
        "Apply vs R: `BinMap.apply` (paper-mode maps) vs computing R (`bin_counts`) on the "
        "same array",
        ["k", "n", "lambda", "|B|", "variant", "R (median)", "apply (median)", "apply / R",
         "target <= 3x"],
        key="apply_r",
    )
    ks = (10, 100) if quick else (10, 100, 1000)
    elements = 2 * 10**5 if quick else R_ELEMENTS
    for k in ks:
        task, variants = _variants(k, 3000 if quick else 20000)
        n = elements // k
        x, _, _ = task.sample(n, seed=4)
        for name, bm, kw in variants:
            cmp_ = compare(lambda bm=bm, kw=kw, x=x: bm.apply(x, **kw),
                           lambda bm=bm, x=x: bin_counts(x, bm.lam), repeats=MIN_REPEATS)
            tab.add(k, f"{n:,}", bm.lam, bm.n_bins, name, fmt_time(cmp_.baseline.median),
                    fmt_time(cmp_.candidate.median), f"{cmp_.ratio:.2f}x",
                    yes_no(cmp_.ratio <= R_TARGET))
    tab.notes.append(
        "The R table: maps fitted in the paper's mode with eps = 0.05, p = inf (lambda = 20) "
        f"on 20,000 samples of the prototype model; n * k = {elements:.0e} values; medians of "
        f"{MIN_REPEATS} interleaved repeats. `prescale=temperature` (a temperature, rho outside "
        "B) includes its log/exp pass: judge it against temperature scaling (table above).")
    return tab


def run(quick: bool = False) -> list[Table]:
    return [latency_table(quick), batch_table(quick), r_table(quick)]


if __name__ == "__main__":
    for t in run("--quick" in sys.argv[1:]):
        print(t.to_markdown())
