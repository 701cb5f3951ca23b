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
       with the best held-out Brier; with none certified, the one with the best held-out Brier.
       The choice sees the data that certify it, so each of the two candidates is bounded at
       ``1 - delta/2`` (Bonferroni) and the published one holds at ``1 - delta``. The
       certificate, with the same figures for the raw model (``vacuous`` when the raw model
       already meets ``eps``), travels in the bin map.

    So on a network that temperature scaling calibrates (most trained networks), the default is
    temperature scaling with a certificate; where it does not (class-dependent distortion), the
    corrected map wins on the bound.

``"paper"``
    Algorithm 2 as in the paper: no pre-calibration, ``rho(R(f))`` outside ``B``, no held-out
    share (``holdout_fraction`` may still be set to certify the map). One deviation, in both
    modes: the probability floor (:func:`probability_floor`). The paper's projection onto the
    simplex, and ``rho`` of a bin whose coordinates sum to ``lambda``, can give a class exactly
    0, which makes the log-loss of any sample of that class infinite; a map's output with an
    exact 0 on a class seen in the fit pools is lifted to at least ``FLOOR_SHARE * eps / m`` on
    each of them (``m`` such classes), which moves ``Err_p`` by at most
    ``2 FLOOR_SHARE eps = eps / 50``.

``fit_pools`` is the functional kernel the daemon uses: it takes a filled :class:`PoolSet` and
the :class:`lpcal.spec.FitSpec` of the fit (the same type :func:`fit` takes) and returns a
:class:`BinMap`:

1. ``beta``, ``lambda`` from ``(eps, p)``;
2. ``mu_hat_v`` = share of the ``mu`` pool in bin ``v``; ``B = {v : mu_hat_v >= beta/6}``, ordered
   by canonical bin key (deterministic and independent of hashing);
3. per level ``i``, the counts of pools ``P{i}``/``E{i}`` (or ``PE{i}``) restricted to ``B``;
4. the iterative phase (:func:`lpcal.algorithm.run_kernel`);
5. ``h`` = group prediction on ``B``, fallback ``rho(R(g))`` (or ``g``) outside ``B``, with the
   probability floor (:func:`probability_floor`);
6. with held-out sums in the pools: the certificate and the selection of step 4 above.

``fit`` splits one labelled sample with a seeded permutation: the held-out share first, then
consecutive blocks for ``mu`` and every estimation pool. Everything is deterministic given
``seed``. Both extensions keep the paper's guarantee: the theorem holds for any given predictor
(here ``g``), and for bins outside ``B`` the error bound only uses their mass
(``Err(h, v, j) <= P[R(g(x)) = v] < beta/6 + beta/12``), whatever ``h`` returns there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from lpcal.algorithm import LevelCounts, run_kernel
from lpcal.binmap import BinMap, scale_temperature, utc_now
from lpcal.certificate import Certificate, certify_and_select, min_certifiable_holdout
from lpcal.errors import InputError
from lpcal.io import validate_labels, validate_probs
from lpcal.levels import beta_for, encode_keys, lambda_for, rho
from lpcal.pools import PoolSet, tables_from_rows
from lpcal.precalibrate import fit_grid_temperature
from lpcal.simplex import lift_zeros
from lpcal.sizing import Sizing
from lpcal.spec import FitSpec, Mode, Outside, Prescale

FLOOR_SHARE = 0.01
"""Probability floor of published bin maps: a prediction with an exact 0 on a class seen in the
fit pools gets ``eta = FLOOR_SHARE * eps / m`` on each of the ``m`` such classes (see
:func:`probability_floor`); this moves ``Err_p`` by at most ``2 FLOOR_SHARE eps = eps / 50``."""


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
    spec: FitSpec,
    *,
    seed: int | None = None,
    model_id: str = "model",
    version: int = 1,
    sizing: Sizing | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> BinMap:
    """Run Algorithm 2 on filled pools, certify on their held-out sums, return the bin map.

    Parameters
    ----------
    pools : PoolSet
        Filled pools. If ``pools.temperature`` is set they hold bins of ``softmax(log f / T)``
        and the map applies that temperature first; if ``pools.holdout`` holds samples, the map
        carries a :class:`lpcal.certificate.Certificate`.
    spec : FitSpec
        The options of the fit (:class:`lpcal.spec.FitSpec`). Used here: ``eps`` (a number:
        ``"auto"`` needs a sample, :func:`fit`), ``p``, ``delta`` (also the certificate's level
        ``1 - delta``), ``mode`` (``certified``: the pre-calibrator alone competes with the
        corrected map, module docstring; ``paper``: the corrected map is published, and
        certified if held-out sums exist), ``outside`` (with its default from ``mode``: what
        the map returns outside ``B``, the (pre-calibrated) input or ``rho(R(.))``) and
        ``max_iter``. The pools' sizes are the pools' own (their layout), whatever the
        spec's sizing options say.
    seed : int, optional
        Tie-breaking seed of the kernel (default: ``spec.seed``).
    model_id, version
        Artifact identity.
    sizing : Sizing, optional
        The sizing the pools were built with, recorded in the map (with its noise scales).
    progress : callable, optional
        Called as ``progress(iteration, largest estimated error)`` during the kernel.

    Returns
    -------
    BinMap

    Raises
    ------
    InputError
        ``spec`` not a :class:`FitSpec` or with ``eps = "auto"``, pools binned at another
        lambda, or an empty ``mu`` pool.
    """
    if not isinstance(spec, FitSpec):
        raise InputError(f"fit_pools takes a FitSpec (lpcal.spec.FitSpec(eps=..., p=...)), got "
                         f"{type(spec).__name__}")
    if spec.eps_auto:
        raise InputError("eps='auto' is chosen from a sample (lpcal.fit); fit_pools needs a "
                         "number")
    eps, p, delta, mode, outside = spec.eps, spec.p, spec.delta, spec.mode, spec.outside_value
    beta, lam = spec.beta, spec.lam
    lay = pools.layout
    if lay.lam != lam:
        raise InputError(f"pools were binned at lambda={lay.lam}, but eps={eps}, p={p} need "
                         f"lambda={lam}")
    hB, cB, keys = select_high_probability_bins(pools, beta)
    levels = _level_counts(pools, hB, sizing)
    threshold = beta / 2.0 if mode is Mode.PAPER else beta / 8.0
    res = run_kernel(cB, levels, beta=beta, lam=lam, p=p,
                     seed=spec.seed if seed is None else seed, max_iter=spec.max_iter,
                     progress=progress, threshold=threshold)
    sizing_info = sizing.to_dict() if sizing is not None else {
        "mode": "pools", "variant": lay.variant, "levels": lay.levels,
        "pools": dict(lay.targets), "holdout": lay.holdout, "warmup": lay.warmup,
        "total": lay.total_target, "noise_scales": {}, "warnings": []}
    sizing_info["filled"] = {n: c for n, (c, _) in pools.fill().items()}
    floor = probability_floor(pools, eps)
    preds = res.preds if floor is None else lift_zeros(res.preds, _mask(floor, lay.k),
                                                         floor["eta"])
    bins, group, rows = tuple(keys), res.group_of_bin, cB
    cert = _certify(pools, hB, preds[group] if len(keys) else preds, eps=eps, p=p, lam=lam,
                    delta=delta, mode=mode, outside=outside, floor=floor)
    if cert is not None and cert.selected == "precalibrator":
        bins, group, preds, rows = (), np.zeros(0, np.int64), np.zeros((0, lay.k)), None
        outside = Outside.IDENTITY
    return BinMap(
        model_id=model_id, version=version, created_at=utc_now(), eps=float(eps), p=float(p),
        delta=float(delta), beta=beta, lam=lam, k=lay.k, temperature=pools.temperature,
        outside=outside.value, sizing=sizing_info, iterations=res.iterations,
        stop_reason=res.stop_reason,
        est_error={"err_p": res.est_err_p, "err_max": res.est_err_max, "threshold": threshold,
                   "iterations_run": res.iterations_run, "merges": res.n_merges,
                   "mass_outside_B": _mass_outside(pools, hB)},
        bins=bins, group=group, preds=preds, bin_rows=rows, mode=mode.value,
        certificate=cert, floor=floor,
    )


def seen_classes(pools: PoolSet) -> np.ndarray:
    """Boolean mask of the classes with at least one label in the fit pools (held-out excluded)."""
    seen = np.zeros(pools.layout.k, dtype=bool)
    for table in pools.tables.values():
        seen |= table.class_counts() > 0
    return seen


def probability_floor(pools: PoolSet, eps: float) -> dict | None:
    """The probability floor a bin map fitted on ``pools`` carries: ``{"eta", "classes"}``, or
    None when no class was seen.

    Algorithm 2's projection onto the simplex sets coordinates to exactly 0, and so does
    ``rho`` for a bin whose coordinates sum to ``lambda`` (a network's float32 output of exactly
    1.0 falls there); a published 0 for a class that does occur makes the log-loss of such a
    sample infinite. So every output of the map, group prediction or fallback, with an exact 0
    on a class seen in the fit pools (``m`` classes, ``classes``) is mixed with the uniform
    vector on them, ``(1 - m eta) u + eta 1`` with ``eta = FLOOR_SHARE * eps / m``
    (:func:`lpcal.simplex.lift_zeros`); other outputs are unchanged. A prediction moves by at
    most ``2 m eta = 2 FLOOR_SHARE eps`` in l1, so the error of each level set,
    ``|E[(h_j - y_j) 1{h in S}]|``, moves by at most ``P(S) 2 FLOOR_SHARE eps``, and ``Err_p``
    by at most ``2 FLOOR_SHARE eps`` for every ``p``. The group predictions are floored before
    the held-out certificate is computed, which therefore covers the published map.
    """
    seen = seen_classes(pools)
    if not seen.any():
        return None
    return {"eta": FLOOR_SHARE * float(eps) / int(seen.sum()),
            "classes": np.flatnonzero(seen).tolist()}


def _mask(floor: dict, k: int) -> np.ndarray:
    mask = np.zeros(k, dtype=bool)
    mask[floor["classes"]] = True
    return mask


def _certify(pools: PoolSet, hB: np.ndarray, bin_preds: np.ndarray, *, eps: float, p: float,
             lam: int, delta: float, mode: Mode, outside: Outside,
             floor: dict | None = None) -> Certificate | None:
    """The held-out certificate of the candidates (None without held-out samples)."""
    hold = pools.holdout
    if hold is None or hold.n == 0:
        return None
    if outside is Outside.RHO:  # constant rho(v) on every held-out bin outside B
        out = ~np.isin(hold.hashes, hB)
        hashes = np.concatenate([hB, hold.hashes[out]])
        fallback = rho(hold.rows[out], lam).astype(np.float64)
        if floor is not None:  # as the map applies it
            lift_zeros(fallback, _mask(floor, pools.layout.k), floor["eta"], out=fallback)
        consts = np.concatenate([bin_preds.reshape(-1, pools.layout.k), fallback])
    else:
        hashes, consts = hB, bin_preds
    candidates = {"corrected": hold.cells(hashes, consts)}
    if mode is Mode.CERTIFIED:
        candidates = {"precalibrator": hold.cells(), **candidates}
    return certify_and_select(candidates, eps=eps, p=p, lam=lam, delta=delta,
                              reported={"raw": pools.holdout_raw.cells()})


def _mass_outside(pools: PoolSet, hB: np.ndarray) -> float:
    """Estimated probability mass of the bins outside ``B`` (from the ``mu`` pool)."""
    h, mass = pools.tables["mu"].bin_mass()
    return float(1.0 - mass[np.isin(h, hB)].sum() / max(1, mass.sum()))


#: The grid of ``eps = "auto"``: ``0.005 * 2^(i/4)`` to 3 significant digits, 0.005 to 0.448.
AUTO_EPS_GRID = tuple(float(f"{0.005 * 2.0 ** (i / 4.0):.3g}") for i in range(27))
#: ``eps = "auto"`` keeps the proxy bound at most this share of eps: room for the held-out
#: share's own sampling variation (the bound varies by 3 to 5% between draws on the families of
#: ``tests/test_certificate_coverage.py``).
AUTO_EPS_MARGIN = 0.85


def auto_eps(probs, labels, spec: FitSpec) -> float:
    """The ``eps`` that ``eps = "auto"`` resolves to: the smallest value of
    :data:`AUTO_EPS_GRID` whose certificate bound for the pre-calibrated model, computed on a
    block of the fitting share as large as the held-out share (same seeded split as
    :func:`fit`), is at most ``AUTO_EPS_MARGIN * eps``; the largest grid value if none is.

    So ``eps`` is what this sample size can certify for a model as good as temperature
    scaling, judged on data the certificate does not use: the held-out share stays untouched,
    and the certificate's guarantee is unchanged. Whether the target is also informative for
    the model is what the certificate's ``vacuous`` flag then says.

    Raises
    ------
    InputError
        Bad inputs, or a spec that holds nothing out (``holdout_fraction = 0``).
    """
    import dataclasses

    from lpcal.certificate import err_p_bound
    from lpcal.holdout import HoldoutSums

    x = validate_probs(np.asarray(probs, dtype=np.float64), "probs", tol=1e-4)
    x = x / x.sum(axis=1, keepdims=True)
    n, k = x.shape
    y = validate_labels(labels, k, "labels", n=n)
    hf = spec.holdout_fraction_value
    n_hold = round(n * hf)
    if not (1 <= n_hold < n):
        raise InputError(f"eps='auto' needs a held-out share: holdout_fraction={hf} of {n} "
                         "samples holds none out")
    rest = np.random.default_rng(spec.seed).permutation(n)[n_hold:]
    g = x[rest]
    if spec.prescale_value is Prescale.TEMPERATURE:
        g = scale_temperature(g, fit_grid_temperature(g, y[rest]))
    block, yb = g[:n_hold], y[rest][:n_hold]
    for eps in AUTO_EPS_GRID:
        p_spec = dataclasses.replace(spec, eps=eps)
        cells = HoldoutSums(k, p_spec.lam).update(block, yb).cells()
        if err_p_bound(cells, spec.p, spec.delta / 2.0, k)[1] <= AUTO_EPS_MARGIN * eps:
            return eps
    return AUTO_EPS_GRID[-1]


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


@functools.lru_cache(maxsize=256)
def _min_certifiable_holdout(eps: float, p: float, delta: float, k: int, candidates: int) -> int:
    """:func:`lpcal.certificate.min_certifiable_holdout`, computed once per setting (a binary
    search over the bound, milliseconds: a fit of ten thousand samples takes tens)."""
    return min_certifiable_holdout(eps, p, delta, k, candidates=candidates)


def fit(
    probs,
    labels,
    spec: FitSpec | None = None,
    /,
    *,
    model_id: str = "model",
    logits: bool = False,
    progress: Callable[[int, float], None] | None = None,
    **options: Any,
) -> BinMap:
    """Fit a bin map from one labelled sample (see the module docstring for the two modes).

    Parameters
    ----------
    probs : array_like, shape (n, k)
        Predicted probabilities (rows on the simplex within 1e-4), or logits with ``logits=True``.
    labels : array_like, shape (n,)
        Observed classes in ``[0, k)``.
    spec : FitSpec, optional
        Every option of the fit (:class:`lpcal.spec.FitSpec`): ``eps`` (a number, or
        ``"auto"``: :func:`auto_eps`, recorded in the map as the value chosen), ``p``, ``delta``,
        ``mode``, ``sizing``, ``pool_size``, ``mu_pool``, ``variant``, ``noise``, ``prescale``,
        ``outside``, ``holdout_fraction``, ``seed``, ``max_iter``.
    **options
        The same options as keywords (they replace those of ``spec``); ``eps`` and ``p`` are
        required without ``spec``.
    model_id : str
        Recorded in the artifact.
    logits : bool, default False
        ``probs`` are logits (softmax applied first).
    progress : callable, optional
        Called as ``progress(iteration, largest estimated error)`` during the kernel.

    Returns
    -------
    BinMap
        With a ``certificate`` whenever a share was held out. With the certified defaults, a
        sample whose 30% could not certify anything whatever the data
        (:func:`lpcal.certificate.min_certifiable_holdout`: 162 samples for eps = 0.05,
        p = inf, delta = 0.1, k = 10) gets temperature scaling fitted on all of it, with a
        certificate that says it is not certified.

    Raises
    ------
    InputError
        Bad probabilities or labels (naming the first bad row), an unknown or invalid option
        (naming it), or a sample too small for the requested pools.

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
    >>> bm.certificate.selected, bm.certificate.certified
    ('precalibrator', True)
    >>> round(bm.temperature)
    3
    >>> fit(f, y, eps=0.05, p=math.inf, mode="paper").certificate is None
    True
    """
    spec = FitSpec.from_options(spec, **options)
    if logits:
        from lpcal.io import softmax
        probs = softmax(probs)
    if spec.eps_auto:
        import dataclasses

        spec = dataclasses.replace(spec, eps=auto_eps(probs, labels, spec))
    eps, p, delta, lam = spec.eps, spec.p, spec.delta, spec.lam
    x, scan = _scanned(probs, lam)
    n, k = x.shape
    y = validate_labels(labels, k, "labels", n=n)
    prescale, hf = spec.prescale_value, spec.holdout_fraction_value
    n_hold = round(n * hf)
    if (spec.mode is Mode.CERTIFIED and spec.holdout_fraction is None
            and prescale is Prescale.TEMPERATURE
            and n_hold < _min_certifiable_holdout(eps, p, delta, k, 2)):
        return _precalibrator_only(x, y, eps=eps, p=p, delta=delta, model_id=model_id)
    if hf > 0 and not (1 <= n_hold < n):
        raise InputError(f"holdout_fraction={hf} of {n} samples leaves no held-out or no fit "
                         "sample")
    sz = spec.pool_sizing(k, n_fit=n - n_hold, holdout=n_hold)
    layout = sz.layout()
    perm = np.random.default_rng(spec.seed).permutation(n)
    hold, rest = perm[:n_hold], perm[n_hold:]
    temperature = None
    if prescale is Prescale.TEMPERATURE:
        temperature = fit_grid_temperature(x[rest], y[rest])
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
    return fit_pools(pools, spec, seed=spec.seed, model_id=model_id, sizing=sz,
                     progress=progress)


def _precalibrator_only(x: np.ndarray, y: np.ndarray, *, eps: float, p: float, delta: float,
                        model_id: str) -> BinMap:
    """Temperature scaling fitted on the whole sample, for a sample whose default held-out share
    could not certify anything (its certificate says so): Algorithm 2's pools would be tiny."""
    beta = beta_for(eps, p)
    lam = lambda_for(beta)
    k = x.shape[1]
    seen = np.unique(y)
    cert = Certificate.without_holdout(eps=eps, p=p, lam=lam, delta=delta)
    return BinMap(
        model_id=model_id, version=1, created_at=utc_now(), eps=float(eps), p=float(p),
        delta=float(delta), beta=beta, lam=lam, k=k, temperature=fit_grid_temperature(x, y),
        outside="identity",
        sizing={"mode": "precalibrator-only", "samples": int(x.shape[0]),
                "min_certifiable_holdout": _min_certifiable_holdout(eps, p, delta, k, 2)},
        iterations=0, stop_reason="not_run", est_error={}, bins=(),
        group=np.zeros(0, np.int64), preds=np.zeros((0, k)), mode="certified",
        certificate=cert, floor={"eta": FLOOR_SHARE * float(eps) / int(seen.size),
                                           "classes": seen.tolist()})
