"""Benchmark 4: split P/E pools (the paper) vs one shared pool, and theory vs practical sizing.

Synthetic data with known conditionals (:class:`tests.bench.common.Overconfident`): most rows on
fixed prototypes (Zipf masses) so that ``B`` is not empty, the rest with fresh logits; labels
from ``q = softmax(T log f)``. For every configuration and seed a bin map is fitted with
practical pool sizes, then evaluated on fresh samples against the known ``q``:

* true ``Err_p(h)`` at the fit's lambda (:func:`lpcal.metrics.err_p_true`);
* the change of the expected Brier score, ``Brier(h) - Brier(f)`` with ``y ~ q``;
* the stop reason and the number of iterations of the returned state.

The second table puts the paper's pool sizes (:func:`lpcal.sizing.theory_sizing`, with the
Laplace noise of Lemma adaptive-samples) next to the practical ones used here.

Run alone: ``python -m tests.bench.bench_variants [--quick]``.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import Counter

from lpcal.calibrate import fit
from lpcal.levels import beta_for, lambda_for
from lpcal.metrics import brier_true, err_p_true
from lpcal.pools import n_levels, pool_names
from lpcal.sizing import practical_sizing, theory_sizing
from tests.bench.common import (
    Overconfident,
    Table,
    fmt_num,
    median,
    p_label,
    yes_no,
)

INF = math.inf
CONFIGS = [(10, 0.1, 2.0), (10, 0.05, INF), (100, 0.1, 2.0), (100, 0.05, INF)]
QUICK_CONFIGS = [(10, 0.1, 2.0), (10, 0.05, INF)]
VARIANTS = ("split", "shared")
SEEDS = (0, 1, 2, 3, 4)
POOLS = (500, 2000)  # every estimation pool; mu gets max(pool, 6/beta)
QUICK_POOLS = (300,)


def task_for(k: int) -> Overconfident:
    return Overconfident(k, s=3.0, T=0.4, prototypes=30, proto_share=0.9, zipf=1.0)


def pools_for(eps: float, p: float, pool: int) -> tuple[int, int]:
    return max(pool, math.ceil(6.0 / beta_for(eps, p))), pool


def _fit(f, y, eps, p, variant, seed, mu, pool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(f, y, eps=eps, p=p, variant=variant, seed=seed, mu_pool=mu, pool_size=pool,
                   mode="paper")


def variants_table(quick: bool = False) -> tuple[Table, dict]:
    configs = QUICK_CONFIGS if quick else CONFIGS
    seeds = SEEDS[:2] if quick else SEEDS
    tab = Table(
        "Variants: split P/E pools (paper) vs shared pool — true error on synthetic data",
        ["k", "eps", "p", "variant", "pools (mu / each)", "|B| (median)", "stop reasons",
         "iterations (median)", "true Err_p(f)", "true Err_p(h) median", "true Err_p(h) max",
         "<= eps (all seeds)", "Brier(h) - Brier(f) median"],
        key="variants",
    )
    achieved: dict = {}
    for k, eps, p in configs:
        task = task_for(k)
        lam = lambda_for(beta_for(eps, p))
        n_eval = (2 * 10**4 if quick else 4 * 10**6) // k
        fe, _, qe = task.sample(n_eval, seed=999)
        err_f = err_p_true(fe, qe, lam, p)
        brier_f = brier_true(fe, qe)
        for pool, variant in [(pl, v) for pl in (QUICK_POOLS if quick else POOLS)
                              for v in VARIANTS]:
            mu, each = pools_for(eps, p, pool)
            n_pools = len(pool_names(n_levels(beta_for(eps, p)), variant))
            n_fit = mu + each * (n_pools - 1)
            stops, iters, errs, dbrier, nb = Counter(), [], [], [], []
            for seed in seeds:
                f, y, _ = task.sample(n_fit, seed=seed)
                bm = _fit(f, y, eps, p, variant, seed, mu, each)
                h = bm.apply(fe)
                stops[bm.stop_reason] += 1
                iters.append(bm.iterations)
                nb.append(bm.n_bins)
                errs.append(err_p_true(h, qe, lam, p))
                dbrier.append(brier_true(h, qe) - brier_f)
            achieved[(k, eps, p, variant, pool)] = (median(errs), max(errs), n_fit)
            tab.add(k, eps, p_label(p), variant, f"{mu:,} / {each:,}", fmt_num(median(nb)),
                    ", ".join(f"{r} {c}" for r, c in sorted(stops.items())),
                    fmt_num(median(iters)), fmt_num(err_f), fmt_num(median(errs)),
                    fmt_num(max(errs)), yes_no(max(errs) <= eps), f"{median(dbrier):+.4f}")
    tab.notes.append(
        f"{len(seeds)} seeds per row (fit sample and split). Data: k classes, logits N(0, 3^2), "
        "T = 0.4; 90% of the rows on 30 prototypes with Zipf(1) masses, 10% fresh logits. "
        "True errors at the fit's lambda, from the known q on fresh samples "
        f"(n * k = {'2e4' if quick else '4e6'}); Brier is the expected score under q.")
    return tab, achieved


def sizing_table(achieved: dict, quick: bool = False) -> Table:
    configs = QUICK_CONFIGS if quick else CONFIGS
    pool = max(QUICK_POOLS if quick else POOLS)
    tab = Table(
        "Theory vs practical pool sizes (split variant, delta = 0.1)",
        ["k", "eps", "p", "L", "theory: mu pool", "theory: largest pool", "theory: total",
         "theory: Laplace scale (level 0)", "practical: total",
         "Laplace scale at practical sizes", "practical: true Err_p(h) median / max",
         "<= eps"],
        key="sizing",
        notes=[(f"Practical: mu pool max({pool}, 6/beta), every estimation pool {pool}; the "
                "achieved errors are those of the variants table (split variant, same sizes).")],
    )
    for k, eps, p in configs:
        th = theory_sizing(eps, p, 0.1, k, "split", noise=True)
        mu, each = pools_for(eps, p, pool)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pr = practical_sizing(eps, p, 0.1, k, mu_pool=mu, pool=each, variant="split",
                                  noise=True)
        est = [v for n, v in th.targets.items() if n != "mu"]
        med, mx, _ = achieved.get((k, eps, p, "split", pool), (float("nan"),) * 3)
        tab.add(k, eps, p_label(p), th.levels, f"{th.targets['mu']:.3g}", f"{max(est):.3g}",
                f"{th.total:.3g}", fmt_num(th.noise_scales.get("P0", 0.0)), f"{pr.total:,}",
                fmt_num(pr.noise_scales.get("P0", 0.0)), f"{fmt_num(med)} / {fmt_num(mx)}",
                yes_no(mx <= eps))
    tab.notes.append(
        "Theory: Lemma samples-probabilities (mu pool) and Lemma adaptive-samples (estimation "
        "pools, alpha = beta/(36 L), Laplace noise of scale 8/(m alpha)). Practical sizes use no "
        "noise: at those sizes the noise scale would exceed the quantities estimated (bin "
        "masses <= 1) by orders of magnitude.")
    return tab


def run(quick: bool = False) -> list[Table]:
    tab, achieved = variants_table(quick)
    return [tab, sizing_table(achieved, quick)]


if __name__ == "__main__":
    for t in run("--quick" in sys.argv[1:]):
        print(t.to_markdown())
