"""Benchmark: the held-out certificate on truth-known families (coverage, tightness, how often
it certifies), the selection rule, and what the bound costs.

Families (``tests/test_oracle.py``), ``k = 10``, a sample of ``n = 5,000`` per draw fitted with
the shipped default ``lpcal.fit(f, y, eps=..., p=...)`` (30% held out):

* ``tempered``: ``synth(n, 10, T=0.15, scale=12)``, overconfident outputs near the vertices,
  labels from ``softmax(0.15 z)``: temperature scaling fixes it exactly;
* ``class-dependent``: ``synth_class_dependent(n, 10)``, 20 output prototypes, over- and
  under-confident by class: no single temperature fixes it.

Per draw the TRUE ``Err_p`` of the published map (and of the raw model) is computed from the
known label law ``q`` on an independent sample of :data:`N_TRUTH` (:func:`lpcal.metrics.err_p_true`),
and compared with the certificate's bound. ``coverage`` is the share of draws where the bound is
at least the truth (target ``>= 1 - delta``); ``certified`` the share where the bound is
``<= eps``; ``bound / true`` the median ratio where the truth is above 0.005 (else "–").

Selection table: the two candidates raw and temperature scaling at the true temperature on the
same held-out share of 1,500, under the two selection-aware rules: **Bonferroni** (both bounded
at ``delta/2`` on all 1,500, certified best-Brier published) and **split** (the Brier score of 750
samples chooses, the other 750 certify the chosen one at ``delta``). The rule that certifies more
often at the same sample size is the one lpcal uses.

Cost table: the median time of :func:`lpcal.certificate.certify_and_select` on the held-out
share of a ``k = 10`` and a ``k = 100`` fit, as a ratio to a temperature-scaling fit
(:func:`lpcal.temperature.fit_temperature`) on the same 5,000 samples, interleaved.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np

from lpcal import fit
from lpcal.certificate import certify_and_select, err_p_bound
from lpcal.holdout import HoldoutSums
from lpcal.levels import beta_for, lambda_for
from lpcal.metrics import err_p_true
from lpcal.temperature import apply_temperature, fit_temperature
from tests.bench.common import Table, compare, p_label
from tests.test_oracle import synth, synth_class_dependent

DELTA = 0.1
N = 5000
N_TRUTH = 50_000
R = 100
SETTINGS = [  # family, p, eps
    ("tempered", 2.0, 0.1),
    ("tempered", math.inf, 0.1),
    ("class-dependent", 2.0, 0.1),
    ("class-dependent", math.inf, 0.05),
]


def draw(family: str, n: int, seed: int):
    """``(f, q, y)`` of a family (module docstring)."""
    if family == "tempered":
        return synth(n, 10, 0.15, 12.0, 0.0, seed)
    return synth_class_dependent(n, 10, seed)


def _f4(x: float) -> str:
    return f"{x:.4f}"


def run_coverage(reps: int, n_truth: int) -> Table:
    t = Table(
        f"Certificate on truth-known families (k = 10, n = {N:,}, delta = {DELTA}, "
        f"{reps} draws per setting)",
        ["family", "p", "eps", "lambda", "coverage (published)", "coverage (raw)",
         "certified", "vacuous", "median bound", "median true Err_p", "bound / true",
         "selected"], key="certificate_coverage")
    for family, p, eps in SETTINGS:
        lam = lambda_for(beta_for(eps, p))
        fb, qb, _ = draw(family, n_truth, seed=10**6)
        raw_truth = err_p_true(fb, qb, lam, p)
        cov = cov_raw = cert = vac = 0
        bounds, truths, ratios, sel = [], [], [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r in range(reps):
                f, _, y = draw(family, N, seed=r)
                bm = fit(f, y, eps=eps, p=p, seed=r)
                c = bm.certificate
                b = c.bound
                tr = err_p_true(bm.apply(fb), qb, lam, p)
                cov += b >= tr
                cov_raw += c.raw_bound >= raw_truth
                cert += c.certified
                vac += c.vacuous
                bounds.append(b)
                truths.append(tr)
                if tr > 0.005:
                    ratios.append(b / tr)
                sel[c.selected] = sel.get(c.selected, 0) + 1
        t.add(family, p_label(p), eps, lam, f"{cov / reps:.2f}", f"{cov_raw / reps:.2f}",
              f"{cert / reps:.2f}", f"{vac / reps:.2f}", _f4(float(np.median(bounds))),
              _f4(float(np.median(truths))),
              f"{np.median(ratios):.2f}" if len(ratios) >= reps // 2 else "–",
              ", ".join(f"{k} {v}" for k, v in sorted(sel.items())))
        print(f"[certificate] {family} p={p_label(p)} eps={eps} done", file=sys.stderr,
              flush=True)
    t.notes += [
        (f"True Err_p from the known label law on {n_truth:,} independent samples; raw true "
         "Err_p is that of the uncalibrated model (its bound is reported in every "
         "certificate)."),
        ("coverage: share of draws with bound >= true Err_p (target >= 1 - delta = "
         f"{1 - DELTA:g}); certified: bound <= eps; vacuous: the raw model's own bound <= eps."),
        ("bound / true: median over the draws whose true Err_p > 0.005 ('–' when fewer than "
         "half are)."),
        ("Bounds: p = inf, Bernstein per cell with a union over the heavy cells (second "
         "moments by a union weighted by level-set mass) and Chernoff "
         "mass bounds for the light ones; p = 2, Bousquet's bound on the whole residual vector "
         "(lpcal/certificate.py docstring); each of the 2 candidates at delta/2."),
    ]
    return t


def run_selection(reps: int) -> Table:
    t = Table(f"Selection-aware certification: Bonferroni against a separate share "
              f"(tempered family, k = 10, 1,500 held out, {reps} draws)",
              ["p", "eps", "Bonferroni: certified", "split 750 / 750: certified",
               "Bonferroni: median bound", "split: median bound"], key="certificate_selection")
    for p, eps in ((2.0, 0.1), (math.inf, 0.05), (math.inf, 0.02)):
        lam = lambda_for(beta_for(eps, p))
        bon = spl = 0
        bb, sb = [], []
        for r in range(reps):
            f, _, y = draw("tempered", 1500, seed=10_000 + r)
            cands = {"raw": f, "ts": apply_temperature(f, 1.0 / 0.15)}
            full = {nm: HoldoutSums(10, lam).update(h, y).cells() for nm, h in cands.items()}
            c = certify_and_select(full, eps=eps, p=p, lam=lam, delta=DELTA)
            bon += c.certified
            bb.append(c.bound)
            a = {nm: HoldoutSums(10, lam).update(h[:750], y[:750]).cells()
                 for nm, h in cands.items()}
            pick = min(a, key=lambda nm: a[nm].brier)
            b = err_p_bound(HoldoutSums(10, lam).update(cands[pick][750:], y[750:]).cells(),
                            p, DELTA)[1]
            spl += b <= eps
            sb.append(b)
        t.add(p_label(p), eps, f"{bon / reps:.2f}", f"{spl / reps:.2f}",
              _f4(float(np.median(bb))), _f4(float(np.median(sb))))
    t.notes.append("Both rules hold at 1 - delta for the published candidate; Bonferroni keeps "
                   "the whole share and pays log(2m/delta) instead of log(2/delta).")
    return t


def run_cost(repeats: int) -> Table:
    t = Table("Cost of the certificate against a temperature-scaling fit (n = 5,000)",
              ["k", "p", "eps", "held-out level sets", "certify ms", "TS fit ms",
               "certify / TS fit"], key="certificate_cost")
    for k, fam in ((10, "tempered"), (100, "skewed")):
        if fam == "tempered":
            f, _, y = draw("tempered", N, seed=1)
        else:
            f, _, y = synth(N, 100, 0.10, 12.0, 8.0, seed=1)
        g = apply_temperature(f, fit_temperature(f[1500:], y[1500:]))
        for p, eps in ((2.0, 0.1), (math.inf, 0.05)):
            lam = lambda_for(beta_for(eps, p))
            cells = {"precalibrator": HoldoutSums(k, lam).update(g[:1500], y[:1500]).cells(),
                     "corrected": HoldoutSums(k, lam).update(g[:1500], y[:1500]).cells()}
            raw = {"raw": HoldoutSums(k, lam).update(f[:1500], y[:1500]).cells()}
            cmp = compare(lambda cells=cells, raw=raw, lam=lam, p=p, eps=eps: certify_and_select(
                cells, eps=eps, p=p, lam=lam, delta=DELTA, reported=raw),
                lambda f=f, y=y: fit_temperature(f, y), repeats=repeats)
            t.add(k, p_label(p), eps, cells["precalibrator"].counts.size,
                  f"{cmp.candidate.median * 1e3:.1f}", f"{cmp.baseline.median * 1e3:.1f}",
                  f"{cmp.ratio:.2f}x")
    t.notes.append("certify: certify_and_select on the three candidates' level-set sums (the "
                   "part of a fit this bound changes), median of interleaved repeats.")
    return t


def run(quick: bool = False) -> list[Table]:
    if quick:
        return [run_coverage(3, 5000), run_selection(3), run_cost(1)]
    return [run_coverage(R, N_TRUTH), run_selection(R), run_cost(5)]


if __name__ == "__main__":
    for tab in run(quick="--quick" in sys.argv):
        print(tab.to_markdown())
