"""Fitting: Algorithm 2 from pools (``fit_pools``) or from one labelled sample (``fit``).

``fit_pools`` is the functional kernel the daemon uses: it takes a filled :class:`PoolSet` and
returns a :class:`BinMap`.

1. ``beta``, ``lambda`` from ``(eps, p)``;
2. ``mu_hat_v`` = share of the ``mu`` pool in bin ``v``; ``B = {v : mu_hat_v >= beta/6}``, ordered
   by canonical bin key (deterministic and independent of hashing);
3. per level ``i``, the counts of pools ``P{i}``/``E{i}`` (or ``PE{i}``) restricted to ``B``;
4. the iterative phase (:func:`lpcal.algorithm.run_kernel`);
5. ``h`` = group prediction on ``B``, fallback ``rho(R(f))`` (or ``f``) outside ``B``.

``fit`` splits one labelled sample into the pools with a seeded permutation: a share for the
optional temperature pre-scaling first, then consecutive blocks of the permutation for ``mu`` and
every estimation pool. Everything is deterministic given ``seed``.

Two options go beyond the paper; both keep its guarantee:

* ``prescale="temperature"`` fits a temperature on its own share of the data and calibrates the
  scaled predictor ``softmax(log f / T)``; the theorem holds for any given predictor.
* ``outside="identity"`` keeps ``h(x) = f(x)`` outside ``B``; the error bound for bins outside ``B``
  only uses their mass (``Err(h, v, j) <= P[R(f(x)) = v] < beta/6 + beta/12``), which is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lpcal.algorithm import LevelCounts, run_kernel
from lpcal.binmap import BinMap, scale_temperature, utc_now
from lpcal.errors import InputError
from lpcal.io import validate_labels, validate_probs
from lpcal.levels import beta_for, encode_keys, lambda_for
from lpcal.pools import PoolSet, tables_from_rows
from lpcal.sizing import Sizing, practical_sizing, theory_sizing

_PRESCALE = ("none", "temperature")
_OUTSIDE = ("rho", "identity")


def select_high_probability_bins(pools: PoolSet, beta: float):
    """``B = {v : mu_hat_v >= beta/6}`` from the ``mu`` pool: ``(hashes, rows, keys)``, by key."""
    mu = pools.tables["mu"]
    if mu.total == 0:
        raise InputError("the mu pool is empty: cannot estimate bin masses")
    h, mass = mu.bin_mass()
    sel = np.flatnonzero(mass * 6.0 >= beta * mu.total)
    rows = mu.bin_rows(sel)
    keys = encode_keys(rows) if sel.size else []
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return h[sel][order], rows[order], [keys[i] for i in order]


def _level_counts(pools: PoolSet, hB: np.ndarray, sizing: Sizing | None) -> list[LevelCounts]:
    lay = pools.layout
    scales = sizing.noise_scales if sizing is not None else {}
    out = []
    for i in range(lay.levels):
        if lay.variant == "split":
            pt, et = pools.tables[f"P{i}"], pools.tables[f"E{i}"]
            sp, se = scales.get(f"P{i}", 0.0), scales.get(f"E{i}", 0.0)
            p_cnt = pt.label_counts(hB).sum(axis=1).astype(np.float64)
            e_cnt = et.label_counts(hB).astype(np.float64)
            out.append(LevelCounts(p_cnt, float(pt.total), e_cnt, float(et.total), sp, se))
        else:
            t = pools.tables[f"PE{i}"]
            s = scales.get(f"PE{i}", 0.0)
            e_cnt = t.label_counts(hB).astype(np.float64)
            out.append(LevelCounts(e_cnt.sum(axis=1), float(t.total), e_cnt, float(t.total), s, s))
    return out


def fit_pools(
    pools: PoolSet,
    *,
    eps: float,
    p: float,
    delta: float = 0.1,
    sizing: Sizing | None = None,
    seed: int = 0,
    model_id: str = "model",
    version: int = 1,
    temperature: float | None = None,
    outside: str = "rho",
    max_iter: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> BinMap:
    """Run Algorithm 2 on filled pools and return the bin map (see the module docstring).

    ``temperature`` is recorded in the bin map: the pools must then hold bins of the scaled
    predictor ``softmax(log f / T)``, and ``apply`` scales raw inputs the same way.
    """
    if outside not in _OUTSIDE:
        raise InputError(f"outside must be one of {_OUTSIDE}, got {outside!r}")
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    lay = pools.layout
    if lay.lam != lam:
        raise InputError(f"pools were binned at lambda={lay.lam}, but eps={eps}, p={p} need "
                         f"lambda={lam}")
    hB, cB, keys = select_high_probability_bins(pools, beta)
    levels = _level_counts(pools, hB, sizing)
    res = run_kernel(cB, levels, beta=beta, lam=lam, p=p, seed=seed, max_iter=max_iter,
                     progress=progress)
    sizing_info = sizing.to_dict() if sizing is not None else {
        "mode": "pools", "variant": lay.variant, "levels": lay.levels,
        "pools": dict(lay.targets), "total": lay.total_target, "noise_scales": {},
        "warnings": []}
    sizing_info["filled"] = {n: t.total for n, t in pools.tables.items()}
    return BinMap(
        model_id=model_id, version=version, created_at=utc_now(), eps=float(eps), p=float(p),
        delta=float(delta), beta=beta, lam=lam, k=lay.k, temperature=temperature,
        outside=outside, sizing=sizing_info, iterations=res.iterations,
        stop_reason=res.stop_reason,
        est_error={"err_p": res.est_err_p, "err_max": res.est_err_max, "threshold": beta / 2,
                   "iterations_run": res.iterations_run, "merges": res.n_merges,
                   "mass_outside_B": _mass_outside(pools, hB)},
        bins=tuple(keys), group=res.group_of_bin, preds=res.preds, bin_rows=cB,
    )


def _mass_outside(pools: PoolSet, hB: np.ndarray) -> float:
    """Estimated probability mass of the bins outside ``B`` (from the ``mu`` pool)."""
    h, mass = pools.tables["mu"].bin_mass()
    return float(1.0 - mass[np.isin(h, hB)].sum() / max(1, mass.sum()))


def _scanned(probs, lam: int, tol: float = 1e-4):
    """Validate and bin-hash ``probs`` in one fused pass: ``(x, scan)``; ``x`` is renormalised
    (and rescanned) only when row sums are far enough from 1 to move a bin boundary."""
    from lpcal.levels import scan_rows

    x = np.asarray(probs, dtype=np.float64)
    if x.ndim == 2 and x.size and x.shape[1] >= 2:
        scan = scan_rows(x, lam)
        s, mn = scan[2], scan[3]
        if np.isfinite(s).all() and np.abs(s - 1.0).max() <= tol and mn.min() >= 0:
            if np.abs(s - 1.0).max() * lam > 1e-6:
                x = x / s[:, None]
                scan = scan_rows(x, lam)
            return x, scan
    x = validate_probs(x, "probs", tol=tol)
    return _scanned(x / x.sum(axis=1, keepdims=True), lam, tol)


def split_sample(n: int, sizes: list[int], seed: int) -> list[np.ndarray]:
    """Consecutive blocks of a seeded permutation of ``range(n)`` with the given sizes."""
    if sum(sizes) > n:
        raise InputError(f"need {sum(sizes)} samples, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    cuts = np.cumsum([0] + list(sizes))
    return [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def fit(
    probs,
    labels,
    *,
    eps: float,
    p: float,
    delta: float = 0.1,
    sizing: str = "practical",
    pool_size: int | None = None,
    mu_pool: int | None = None,
    variant: str = "shared",
    noise: bool | None = None,
    seed: int = 0,
    prescale: str = "none",
    prescale_fraction: float = 0.1,
    outside: str = "rho",
    model_id: str = "model",
    max_iter: int | None = None,
    logits: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> BinMap:
    """Fit a bin map from one labelled sample ``(probs (n, k), labels (n,))``.

    ``variant="shared"`` (default) estimates a group's P and E from one pool per level, so the
    estimates are consistent; ``"split"`` uses the paper's separate P and E pools (often stops on
    a cycle at practical sizes; see ``lpcal.algorithm``).

    ``sizing="practical"``: every estimation pool gets ``pool_size`` samples and ``mu`` gets
    ``mu_pool`` (default ``pool_size``); without ``pool_size`` the sample left after pre-scaling is
    split evenly over all pools. ``sizing="theory"``: the paper's sizes; raises if the sample is
    too small (it almost always is, see :mod:`lpcal.sizing`). ``noise`` (Laplace noise of Lemma
    adaptive-samples) defaults to on for ``theory`` and off for ``practical``.
    """
    if prescale not in _PRESCALE:
        raise InputError(f"prescale must be one of {_PRESCALE}, got {prescale!r}")
    if logits:
        from lpcal.io import softmax
        probs = softmax(probs)
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    x, scan = _scanned(probs, lam)
    n, k = x.shape
    y = validate_labels(labels, k, "labels", n=n)
    n_pre = int(round(n * prescale_fraction)) if prescale == "temperature" else 0
    if prescale == "temperature" and not (0 < prescale_fraction < 1 and n_pre >= 2):
        raise InputError(f"prescale_fraction must leave samples on both sides, got "
                         f"{prescale_fraction} of {n}")
    n_rest = n - n_pre
    if sizing == "theory":
        sz = theory_sizing(eps, p, delta, k, variant, noise=True if noise is None else noise)
        if sz.total > n_rest:
            raise InputError(
                f"theory sizing needs {sz.total:.3g} samples ({sz.levels} levels, mu pool "
                f"{sz.targets['mu']:.3g}, largest pool {max(sz.targets.values()):.3g}); got "
                f"{n_rest}. Use practical sizing (pool_size=...) instead.")
    elif sizing == "practical":
        from lpcal.pools import n_levels, pool_names
        n_pools = len(pool_names(n_levels(beta), variant))
        if pool_size is None:
            each = n_rest // n_pools
            if each < 1:
                raise InputError(f"{n_rest} samples cannot fill {n_pools} pools")
            pool_size, mu_pool = each, (mu_pool or n_rest - each * (n_pools - 1))
        sz = practical_sizing(eps, p, delta, k, mu_pool=mu_pool or pool_size, pool=pool_size,
                              variant=variant, noise=bool(noise))
        if sz.total > n_rest:
            raise InputError(f"practical sizing with pool_size={pool_size} needs {sz.total} "
                             f"samples after pre-scaling; got {n_rest}")
    else:
        raise InputError(f"sizing must be 'theory' or 'practical', got {sizing!r}")
    layout = sz.layout()
    blocks = split_sample(n, [n_pre] + [layout.targets[nm] for nm in layout.names], seed)
    temperature = None
    if n_pre:
        from lpcal.temperature import fit_temperature
        temperature = float(fit_temperature(x[blocks[0]], y[blocks[0]]))
        x = scale_temperature(x, temperature)
        scan = None
    assign = np.full(n, -1, dtype=np.int64)
    for i, idx in enumerate(blocks[1:]):
        assign[idx] = i
    tables = tables_from_rows(x, y, assign, len(layout.names), k, layout.lam, scan)
    pools = PoolSet(layout, dict(zip(layout.names, tables)))
    return fit_pools(pools, eps=eps, p=p, delta=delta, sizing=sz, seed=seed, model_id=model_id,
                     temperature=temperature, outside=outside, max_iter=max_iter,
                     progress=progress)

