"""Fitting: the certified default and Algorithm 2 (``fit_pools`` from pools, ``fit`` from a sample).

Two modes (``mode=``), one switch apart:

``"certified"`` (the default)
    1. a share of the sample is **held out** (``holdout_fraction``, default 0.3) and never seen by
       the fit;
    2. a **temperature pre-calibrator** ``g = softmax(log f / T)`` is fitted on the rest
       (:class:`lpcal.precalibrate.TemperatureGrid`, NLL sums on a log grid);
    3. Algorithm 2 runs on pools of ``g``'s bins, with ``g`` itself kept outside ``B``
       (``outside="identity"``), correcting until every estimated error is below ``beta/8``
       rather than the paper's ``beta/2`` (the pools support it; on the class-dependent
       families of ``tests/test_oracle.py`` this cut the true ``Err_inf`` 2 to 3.5 times at no
       cost in fit time, and changed nothing on the real networks: see
       ``docs/benchmarks.md``, directions): the **corrected** candidate;
    4. both candidates, the pre-calibrator alone and the corrected map, are evaluated on the
       held-out sums (:mod:`lpcal.holdout`): plug-in ``Err_p`` on each candidate's own level sets,
       an upper confidence bound at level ``1 - delta`` and the Brier score
       (:mod:`lpcal.certificate`). The published map is the certified candidate (bound ``<= eps``)
       with the best held-out Brier; with none certified, the one with the lowest bound.
       The certificate, with the same figures for the raw model, travels in the bin map.

    So on a network that temperature scaling calibrates (most trained networks), the default is
    temperature scaling with a certificate; where it does not (class-dependent distortion), the
    corrected map wins on the bound.

``"paper"``
    Algorithm 2 as in the paper: no pre-calibration, ``rho(R(f))`` outside ``B``, no held-out
    share (``holdout_fraction`` may still be set to certify the map).

``fit_pools`` is the functional kernel the daemon uses: it takes a filled :class:`PoolSet` and
returns a :class:`BinMap`:

1. ``beta``, ``lambda`` from ``(eps, p)``;
2. ``mu_hat_v`` = share of the ``mu`` pool in bin ``v``; ``B = {v : mu_hat_v >= beta/6}``, ordered
   by canonical bin key (deterministic and independent of hashing);
3. per level ``i``, the counts of pools ``P{i}``/``E{i}`` (or ``PE{i}``) restricted to ``B``;
4. the iterative phase (:func:`lpcal.algorithm.run_kernel`);
5. ``h`` = group prediction on ``B``, fallback ``rho(R(g))`` (or ``g``) outside ``B``;
6. with held-out sums in the pools: the certificate and the selection of step 4 above.

``fit`` splits one labelled sample with a seeded permutation: the held-out share first, then
consecutive blocks for ``mu`` and every estimation pool. Everything is deterministic given
``seed``. Both extensions keep the paper's guarantee: the theorem holds for any given predictor
(here ``g``), and for bins outside ``B`` the error bound only uses their mass
(``Err(h, v, j) <= P[R(g(x)) = v] < beta/6 + beta/12``), whatever ``h`` returns there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from lpcal.algorithm import LevelCounts, run_kernel
from lpcal.binmap import BinMap, scale_temperature, utc_now
from lpcal.certificate import Certificate, certify_and_select, min_certifiable_holdout
from lpcal.errors import InputError
from lpcal.io import validate_labels, validate_probs
from lpcal.levels import beta_for, encode_keys, lambda_for, rho
from lpcal.pools import PoolSet, tables_from_rows
from lpcal.precalibrate import TemperatureGrid
from lpcal.sizing import Sizing, practical_sizing, theory_sizing

MODES = ("certified", "paper")
_PRESCALE = ("none", "temperature")
_OUTSIDE = ("rho", "identity")
#: What each mode implies for the options left at None.
MODE_DEFAULTS = {
    "certified": {"prescale": "temperature", "outside": "identity", "holdout_fraction": 0.3},
    "paper": {"prescale": "none", "outside": "rho", "holdout_fraction": 0.0},
}


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
    mode: str = "certified",
    outside: str = "identity",
    max_iter: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> BinMap:
    """Run Algorithm 2 on filled pools, certify on their held-out sums, return the bin map.

    Parameters
    ----------
    pools : PoolSet
        Filled pools. If ``pools.temperature`` is set they hold bins of ``softmax(log f / T)``
        and the map applies that temperature first; if ``pools.holdout`` holds samples, the map
        carries a :class:`lpcal.certificate.Certificate`.
    eps, p, delta : float
        Target ``Err_p <= eps`` (``p`` in ``[1, inf]``), failure probability ``delta`` (also the
        certificate's level ``1 - delta``).
    mode : {"certified", "paper"}
        ``"certified"``: the pre-calibrator alone competes with the corrected map (module
        docstring). ``"paper"``: the corrected map is published (and certified if held-out sums
        exist).
    outside : {"identity", "rho"}
        What the map returns outside ``B``: the (pre-calibrated) input, or ``rho(R(.))``.
    sizing, seed, model_id, version, max_iter, progress
        Recorded sizing, tie-breaking seed, artifact identity, iteration cap, progress callback
        ``(iteration, largest estimated error)``.

    Returns
    -------
    BinMap

    Raises
    ------
    InputError
        Unknown ``mode``/``outside``, pools binned at another lambda, or an empty ``mu`` pool.
    """
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
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
    threshold = beta / 2.0 if mode == "paper" else beta / 8.0
    res = run_kernel(cB, levels, beta=beta, lam=lam, p=p, seed=seed, max_iter=max_iter,
                     progress=progress, threshold=threshold)
    sizing_info = sizing.to_dict() if sizing is not None else {
        "mode": "pools", "variant": lay.variant, "levels": lay.levels,
        "pools": dict(lay.targets), "holdout": lay.holdout, "warmup": lay.warmup,
        "total": lay.total_target, "noise_scales": {}, "warnings": []}
    sizing_info["filled"] = {n: c for n, (c, _) in pools.fill().items()}
    bins, group, preds, rows = tuple(keys), res.group_of_bin, res.preds, cB
    cert = _certify(pools, hB, preds[group] if len(keys) else preds, eps=eps, p=p, lam=lam,
                    delta=delta, mode=mode, outside=outside)
    if cert is not None and cert.selected == "precalibrator":
        bins, group, preds, rows = (), np.zeros(0, np.int64), np.zeros((0, lay.k)), None
        outside = "identity"
    return BinMap(
        model_id=model_id, version=version, created_at=utc_now(), eps=float(eps), p=float(p),
        delta=float(delta), beta=beta, lam=lam, k=lay.k, temperature=pools.temperature,
        outside=outside, sizing=sizing_info, iterations=res.iterations,
        stop_reason=res.stop_reason,
        est_error={"err_p": res.est_err_p, "err_max": res.est_err_max, "threshold": threshold,
                   "iterations_run": res.iterations_run, "merges": res.n_merges,
                   "mass_outside_B": _mass_outside(pools, hB)},
        bins=bins, group=group, preds=preds, bin_rows=rows, mode=mode,
        certificate=None if cert is None else cert.to_dict(),
    )


def _certify(pools: PoolSet, hB: np.ndarray, bin_preds: np.ndarray, *, eps: float, p: float,
             lam: int, delta: float, mode: str, outside: str) -> Certificate | None:
    """The held-out certificate of the candidates (None without held-out samples)."""
    hold = pools.holdout
    if hold is None or hold.n == 0:
        return None
    if outside == "rho":  # constant rho(v) on every held-out bin outside B
        out = ~np.isin(hold.hashes, hB)
        hashes = np.concatenate([hB, hold.hashes[out]])
        consts = np.concatenate([bin_preds.reshape(-1, pools.layout.k),
                                 rho(hold.rows[out], lam).astype(np.float64)])
    else:
        hashes, consts = hB, bin_preds
    candidates = {"corrected": hold.cells(hashes, consts)}
    if mode == "certified":
        candidates = {"precalibrator": hold.cells(), **candidates}
    return certify_and_select(candidates, eps=eps, p=p, lam=lam, delta=delta,
                              reported={"raw": pools.holdout_raw.cells()})


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


def fit(
    probs,
    labels,
    *,
    eps: float,
    p: float,
    delta: float = 0.1,
    mode: str = "certified",
    sizing: str = "practical",
    pool_size: int | None = None,
    mu_pool: int | None = None,
    variant: str = "shared",
    noise: bool | None = None,
    seed: int = 0,
    prescale: str | None = None,
    outside: str | None = None,
    holdout_fraction: float | None = None,
    model_id: str = "model",
    max_iter: int | None = None,
    logits: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> BinMap:
    """Fit a bin map from one labelled sample (see the module docstring for the two modes).

    Parameters
    ----------
    probs : array_like, shape (n, k)
        Predicted probabilities (rows on the simplex within 1e-4), or logits with ``logits=True``.
    labels : array_like, shape (n,)
        Observed classes in ``[0, k)``.
    eps : float
        Target lp calibration error, in ``(0, 1)``.
    p : float
        The ``p`` of ``Err_p``, ``>= 1`` or ``math.inf``.
    delta : float, default 0.1
        Failure probability of the guarantee; the certificate's level is ``1 - delta``.
    mode : {"certified", "paper"}, default "certified"
        ``"certified"``: held-out share, temperature pre-calibration, identity outside ``B``,
        selection by certificate. ``"paper"``: the paper's Algorithm 2 exactly.
    sizing : {"practical", "theory"}, default "practical"
        ``"practical"``: every estimation pool gets ``pool_size`` samples and ``mu`` gets
        ``mu_pool`` (default ``pool_size``); without ``pool_size`` the fit share is split evenly
        over all pools. ``"theory"``: the paper's sizes; raises if the sample is too small (it
        almost always is, see :mod:`lpcal.sizing`).
    pool_size, mu_pool : int, optional
        Practical pool sizes.
    variant : {"shared", "split"}, default "shared"
        ``"shared"`` estimates a group's ``P`` and ``E`` from one pool per level (consistent
        estimates); ``"split"`` uses the paper's separate pools (often stops on a cycle at
        practical sizes; see :mod:`lpcal.algorithm`).
    noise : bool, optional
        Laplace noise of Lemma adaptive-samples; defaults to on for ``theory``, off otherwise.
    seed : int, default 0
        Seed of the split and of the kernel's noise; the fit is deterministic given it.
    prescale : {"temperature", "none"}, optional
        Pre-calibrator fitted on the fit share (default from ``mode``).
    outside : {"identity", "rho"}, optional
        What the map returns outside ``B`` (default from ``mode``).
    holdout_fraction : float, optional
        Share held out for the certificate, in ``[0, 1)`` (default 0.3 certified, 0 paper).
        With the certified defaults, a sample whose 30% could not certify anything whatever the
        data (:func:`lpcal.certificate.min_certifiable_holdout`: 120 samples for eps = 0.05,
        p = inf, delta = 0.1) gets temperature scaling fitted on all of it, with a certificate
        that says it is not certified.
    model_id : str
        Recorded in the artifact.
    max_iter : int, optional
        Cap on the kernel's iterations (default: the paper's bound).
    logits : bool, default False
        ``probs`` are logits (softmax applied first).
    progress : callable, optional
        Called as ``progress(iteration, largest estimated error)`` during the kernel.

    Returns
    -------
    BinMap
        With a ``certificate`` whenever ``holdout_fraction > 0``.

    Raises
    ------
    InputError
        Bad probabilities or labels (naming the first bad row), unknown options, or a sample too
        small for the requested pools.

    Examples
    --------
    >>> import math, numpy as np
    >>> from lpcal import fit
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(20000, 4)) * 3
    >>> f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)          # overconfident model
    >>> q = np.exp(z / 3) / np.exp(z / 3).sum(axis=1, keepdims=True)  # true label law
    >>> y = (q.cumsum(axis=1) > rng.random(20000)[:, None]).argmax(axis=1)
    >>> bm = fit(f, y, eps=0.05, p=math.inf)
    >>> bm.certificate["selected"], bm.certificate["certified"]
    ('precalibrator', True)
    >>> round(bm.temperature)
    3
    """
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    d = MODE_DEFAULTS[mode]
    prescale = d["prescale"] if prescale is None else prescale
    outside = d["outside"] if outside is None else outside
    hf = d["holdout_fraction"] if holdout_fraction is None else holdout_fraction
    if prescale not in _PRESCALE:
        raise InputError(f"prescale must be one of {_PRESCALE}, got {prescale!r}")
    if outside not in _OUTSIDE:
        raise InputError(f"outside must be one of {_OUTSIDE}, got {outside!r}")
    try:
        hf = float(hf)
    except (TypeError, ValueError):
        raise InputError(f"holdout_fraction must be a number, got {hf!r}") from None
    if not (0.0 <= hf < 1.0):
        raise InputError(f"holdout_fraction must lie in [0, 1), got {hf!r}")
    if logits:
        from lpcal.io import softmax
        probs = softmax(probs)
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    x, scan = _scanned(probs, lam)
    n, k = x.shape
    y = validate_labels(labels, k, "labels", n=n)
    n_hold = round(n * hf)
    if (mode == "certified" and holdout_fraction is None and prescale == "temperature"
            and n_hold < min_certifiable_holdout(eps, p, delta)):
        return _precalibrator_only(x, y, eps=eps, p=p, delta=delta, model_id=model_id)
    if hf > 0 and not (1 <= n_hold < n):
        raise InputError(f"holdout_fraction={hf} of {n} samples leaves no held-out or no fit "
                         "sample")
    n_rest = n - n_hold
    sz = _sizing(sizing, eps, p, delta, k, variant, noise, pool_size, mu_pool, n_rest, n_hold)
    layout = sz.layout()
    perm = np.random.default_rng(seed).permutation(n)
    hold, rest = perm[:n_hold], perm[n_hold:]
    temperature = None
    if prescale == "temperature":
        temperature = TemperatureGrid().update(x[rest], y[rest]).fit()
        x_raw, x = x, scale_temperature(x, temperature)
        scan = None
    else:
        x_raw = x
    assign = np.full(n, -1, dtype=np.int64)
    cuts = np.cumsum([0] + [layout.targets[nm] for nm in layout.names])
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        assign[rest[a:b]] = i
    tables = tables_from_rows(x, y, assign, len(layout.names), k, layout.lam, scan)
    pools = PoolSet(layout, dict(zip(layout.names, tables)), temperature=temperature)
    if n_hold:
        pools.holdout.update(x[hold], y[hold])
        pools.holdout_raw.update(x_raw[hold], y[hold])
    return fit_pools(pools, eps=eps, p=p, delta=delta, sizing=sz, seed=seed, model_id=model_id,
                     mode=mode, outside=outside, max_iter=max_iter, progress=progress)


def _precalibrator_only(x: np.ndarray, y: np.ndarray, *, eps: float, p: float, delta: float,
                        model_id: str) -> BinMap:
    """Temperature scaling fitted on the whole sample, for a sample whose default held-out share
    could not certify anything (its certificate says so): Algorithm 2's pools would be tiny."""
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    k = x.shape[1]
    grid = TemperatureGrid().update(x, y)
    cert = Certificate.without_holdout(eps=eps, p=p, lam=lam, delta=delta)
    return BinMap(
        model_id=model_id, version=1, created_at=utc_now(), eps=float(eps), p=float(p),
        delta=float(delta), beta=beta, lam=lam, k=k, temperature=grid.fit(), outside="identity",
        sizing={"mode": "precalibrator-only", "samples": int(x.shape[0]),
                "min_certifiable_holdout": min_certifiable_holdout(eps, p, delta)},
        iterations=0, stop_reason="not_run", est_error={}, bins=(),
        group=np.zeros(0, np.int64), preds=np.zeros((0, k)), mode="certified",
        certificate=cert.to_dict())


def _sizing(sizing: str, eps: float, p: float, delta: float, k: int, variant: str,
            noise: bool | None, pool_size: int | None, mu_pool: int | None, n_rest: int,
            n_hold: int) -> Sizing:
    """The pool sizes of :func:`fit` for ``n_rest`` fit samples (and ``n_hold`` held out)."""
    if sizing == "theory":
        sz = theory_sizing(eps, p, delta, k, variant, noise=True if noise is None else noise)
        if sz.total > n_rest:
            raise InputError(
                f"theory sizing needs {sz.total:.3g} samples ({sz.levels} levels, mu pool "
                f"{sz.targets['mu']:.3g}, largest pool {max(sz.targets.values()):.3g}); got "
                f"{n_rest}. Use practical sizing (pool_size=...) instead.")
    elif sizing == "practical":
        from lpcal.pools import n_levels, pool_names
        n_pools = len(pool_names(n_levels(beta_for(eps, p)), variant))
        if pool_size is None:
            each = n_rest // n_pools
            if each < 1:
                raise InputError(f"{n_rest} samples cannot fill {n_pools} pools")
            pool_size, mu_pool = each, (mu_pool or n_rest - each * (n_pools - 1))
        sz = practical_sizing(eps, p, delta, k, mu_pool=mu_pool or pool_size, pool=pool_size,
                              variant=variant, noise=bool(noise))
        if sz.total > n_rest:
            raise InputError(f"practical sizing with pool_size={pool_size} needs {sz.total} "
                             f"samples besides the {n_hold} held out; got {n_rest}")
    else:
        raise InputError(f"sizing must be 'theory' or 'practical', got {sizing!r}")
    return dataclasses.replace(sz, holdout=n_hold)
