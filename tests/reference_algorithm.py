"""A slow, literal reference of Algorithm 2's iterative phase, written from the paper.

Bairaktari & Nguyen, *Sample-efficient Multiclass Calibration under lp Error*, Algorithm 2
("Multiclass Calibration"), the ``While`` loop. Plain Python: dicts, sets, frozensets, tuples of
floats and loops. It deliberately does NOT import ``lpcal.algorithm`` (nor ``lpcal.simplex`` or
``lpcal.levels``); it is the oracle that ``tests/test_algorithm.py`` compares the vectorised
kernel ``lpcal.algorithm.run_kernel`` against.

State, as in the paper:

* ``M``: estimation groups ``mid -> (frozenset of bin positions, level i, P_hat, E_hat)``, a group
  of size ``2^i`` estimated once, when created, from the level-``i`` pools:
  ``P_hat = sum_{b in S} P_cnt[i][b] / |P_i|``, ``E_hat_j = sum_{b in S} E_cnt[i][b][j] / |E_i|``.
  ``mid`` counts up in creation order (the singletons ``{b}`` get ``mid = b``).
* ``G``: prediction groups ``gid -> {"bins": frozenset, "mids": set, "pred": tuple}``.
  Initially ``G = M = {{b}}`` and ``pred({b}) = rho(v_b)``.
* ``P(S) = sum_{S' in M, S' subset S} P_hat_S'``, ``E(S)`` likewise,
  ``Err(S, j) = |P(S) pred(S)_j - E(S)_j|``.

Deterministic choices (the ones ``run_kernel`` documents):

* select the ``(S, j)`` with the largest ``Err``; ties to the lowest group id, then lowest class;
* a group's id is the position in ``B`` of the bin it started from; the merged group keeps the id
  of the selected group ``S^(t)``;
* ``pred(S^(t) u S') = pred(S')`` if ``P(S^(t)) <= P(S')`` else the new ``pred(S^(t))``;
* ``M`` merges by binary addition: sizes ascending; while a size holds two or more groups inside
  ``S^(t)``, the two oldest (lowest ``mid``) merge and the result moves to the next size;
* the loop also stops on ``max_iterations`` (``t`` reached the cap) and on ``cycle`` (the whole
  prediction state repeats while the partition ``G`` is unchanged: since the run is deterministic
  it would repeat forever); then the state with the smallest estimated ``Err_p`` (first one on
  ties) is returned. The checks run in the order converged, max_iterations, cycle.

Floating point: to make trajectories comparable *bit for bit* (the selection, the merge test
``R(pred(S')) = R(pred(S))`` and the cycle test compare floats exactly), a few evaluation orders
follow the library's documented conventions:

* ``R(u)_i = floor(u_i lambda + 1e-9) / lambda`` (``FLOOR_TOL`` of ``lpcal.levels``);
* ``rho(v)_i = (c_i + (lambda - sum c) / k) / lambda`` for ``c = lambda v`` (the paper's
  ``v_i + (1 - sum v)/k``, evaluated on the integer counts);
* ``P(S)``, ``E(S)`` sum the ``M``-groups in increasing size;
* the projection ``pi`` finds ``theta`` by bisection on ``g(theta) = sum max(v_i - theta, 0) - 1``,
  then takes the exact closed form on the support it found, ``theta = (sum_{supp} v_i - 1)/|supp|``
  (summed in decreasing order), and fixes the support up until the KKT conditions hold in floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FLOOR_TOL = 1e-9


# ----------------------------------------------------------------------------- geometry


def project(v) -> tuple:
    """Euclidean projection of ``v`` onto the simplex, by bisection on ``theta``."""
    v = [float(x) for x in v]
    k = len(v)

    def excess(theta):
        return sum(max(x - theta, 0.0) for x in v) - 1.0

    lo, hi = min(v) - 1.0, max(v)  # excess(lo) >= k - 1 >= 0 > -1 = excess(hi)
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if excess(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    theta_b = 0.5 * (lo + hi)
    supp = frozenset(i for i in range(k) if v[i] > theta_b) or frozenset([max(range(k),
                                                                             key=v.__getitem__)])
    seen = set()
    while True:
        theta = _theta(v, supp)
        new = frozenset(i for i in range(k) if v[i] - theta > 0.0)
        if new == supp or not new:
            break
        if new in seen:
            # No support is self-consistent in floating point: some v_i lie within a few ulps of
            # theta. The support of the projection is a prefix of v sorted decreasingly (Held,
            # Wolfe & Crowder), of the largest length r with s_r > theta_r; use that length.
            s_desc = sorted(v, reverse=True)
            acc, r = 0.0, 1
            for j, x in enumerate(s_desc, start=1):
                acc += x
                if x - (acc - 1.0) / j > 0.0:
                    r = j
            acc = 0.0
            for x in s_desc[:r]:
                acc += x
            theta = (acc - 1.0) / r
            break
        seen.add(supp)
        supp = new
    return tuple(max(x - theta, 0.0) for x in v)


def _theta(v, supp) -> float:
    """Closed-form ``theta = (sum_{i in supp} v_i - 1) / |supp|``, summed in decreasing order."""
    acc = 0.0
    for x in sorted((v[i] for i in supp), reverse=True):
        acc += x
    return (acc - 1.0) / len(supp)


def round_down(u, lam: int) -> tuple:
    """``lambda * R(u)`` as a tuple of ints."""
    return tuple(min(max(math.floor(x * lam + FLOOR_TOL), 0), lam) for x in u)


def rho(c, lam: int) -> tuple:
    """``rho(v)`` of the level set ``v = c / lambda``: the deficit spread evenly."""
    k = len(c)
    d = (lam - sum(int(x) for x in c)) / k
    return tuple((int(x) + d) / lam for x in c)


def iteration_bound(beta: float, lam: int) -> int:
    """``T <= (9 + 36/ceil(1/beta) log2(36/beta)) / beta^2`` (Lemma algorithm-termination)."""
    return math.ceil((9.0 + 36.0 / lam * math.log2(36.0 / beta)) / beta**2)


# ----------------------------------------------------------------------------- the algorithm


@dataclass
class RefResult:
    groups: dict  # gid -> frozenset of bin positions
    preds: dict  # gid -> tuple of floats
    iterations: int
    iterations_run: int
    stop_reason: str
    n_merges: int
    history: list = field(default_factory=list)  # (t, gid, j, absorbed gid or -1)
    est_err_p: float = 0.0
    est_err_max: float = 0.0
    # per iteration t (only with keep_trace): (Err_p, groups, preds, merges, history length)
    trace: list = field(default_factory=list)
    history_run: list = field(default_factory=list)  # every iteration run, up to the stop


def _err_p(errs: dict, p: float) -> float:
    flat = [e for row in errs.values() for e in row]
    if not flat:
        return 0.0
    if math.isinf(p):
        return max(flat)
    return math.fsum(e**p for e in flat) ** (1.0 / p)


def reference_run(c_B, levels, *, beta: float, lam: int, p: float, max_iter: int | None = None,
                  keep_trace: bool = False):
    """Algorithm 2's ``While`` loop on bins ``c_B`` (rows of ints) and per-level pool counts.

    ``levels[i]`` has attributes ``p_cnt`` (per bin), ``p_tot``, ``e_cnt`` (per bin, per class),
    ``e_tot`` (duck-typed; no noise). ``keep_trace`` records every state visited (``trace[t]``),
    so a caller can inspect states whose ``Err_p`` ties the best one up to rounding.

    ``Err_p`` here is summed exactly (``math.fsum``); states whose objectives differ only in the
    last bits (the run converging to a floating-point fixed point) may rank differently under
    another summation order, which is why the trace exists.
    """
    bins = [tuple(int(x) for x in row) for row in c_B]
    n = len(bins)
    k = len(bins[0]) if n else 0
    cap = iteration_bound(beta, lam) if max_iter is None else int(max_iter)
    lv = [(
        [float(x) for x in L.p_cnt], float(L.p_tot),
        [[float(x) for x in row] for row in L.e_cnt], float(L.e_tot),
    ) for L in levels]

    M: dict[int, tuple] = {}

    def new_m(members: frozenset, level: int) -> int:
        p_cnt, p_tot, e_cnt, e_tot = lv[level]
        ps = sum(p_cnt[b] for b in sorted(members))
        p_hat = ps / p_tot if p_tot > 0 else 0.0
        e_hat = []
        for j in range(k):
            es = sum(e_cnt[b][j] for b in sorted(members))
            e_hat.append(es / e_tot if e_tot > 0 else 0.0)
        mid = len(M)
        M[mid] = (members, level, p_hat, tuple(e_hat))
        return mid

    G: dict[int, dict] = {}
    for b in range(n):
        mid = new_m(frozenset([b]), 0)
        G[b] = {"bins": frozenset([b]), "mids": {mid}, "pred": rho(bins[b], lam)}

    def P_of(gid):
        mids = sorted(G[gid]["mids"], key=lambda m: M[m][1])
        return sum(M[m][2] for m in mids)

    def E_of(gid):
        mids = sorted(G[gid]["mids"], key=lambda m: M[m][1])
        out = []
        for j in range(k):
            acc = 0.0
            for m in mids:
                acc += M[m][3][j]
            out.append(acc)
        return out

    def errors():
        out = {}
        for gid in sorted(G):
            P, E, pr = P_of(gid), E_of(gid), G[gid]["pred"]
            out[gid] = [abs(P * pr[j] - E[j]) for j in range(k)]
        return out

    def check_structure():
        """The paper's invariants of M and G (Lemma size-of-M and the merge rule)."""
        covered = []
        for grp in G.values():
            sizes = [len(M[m][0]) for m in grp["mids"]]
            assert all(len(M[m][0]) == 2 ** M[m][1] for m in grp["mids"]), "|S'| != 2^level"
            assert len(set(sizes)) == len(sizes), "two M-groups of one size inside a G-group"
            union = frozenset().union(*(M[m][0] for m in grp["mids"]))
            assert union == grp["bins"] and sum(sizes) == len(union), "M does not tile S"
            covered.extend(grp["bins"])
        assert sorted(covered) == list(range(n)), "G is not a partition of B"
        keys = [round_down(grp["pred"], lam) for grp in G.values()]
        assert len(set(keys)) == len(keys), "two groups share R(pred(S))"

    def snapshot():
        return ({g: G[g]["bins"] for g in G}, {g: G[g]["pred"] for g in G})

    check_structure()
    t = 0
    merges = 0
    history: list = []
    seen: dict = {}
    best = None  # (objective, t, snapshot, merges, history length)
    reason = "converged"
    trace: list = []
    while True:
        errs = errors()
        obj = _err_p(errs, p)
        if keep_trace:
            trace.append((obj, *snapshot(), merges, len(history)))
        if best is None or obj < best[0]:
            emax = max((e for r in errs.values() for e in r), default=0.0)
            best = (obj, t, snapshot(), merges, len(history), emax)
        # selection: largest error, ties to lowest gid then lowest class
        sel, sel_err = None, -math.inf
        for gid in sorted(errs):
            for j in range(k):
                if errs[gid][j] > sel_err:
                    sel, sel_err = (gid, j), errs[gid][j]
        if sel is None or sel_err <= beta / 2.0:
            reason = "converged"
            break
        if t >= cap:
            reason = "max_iterations"
            break
        state = tuple((g, G[g]["pred"]) for g in sorted(G))
        if state in seen:
            reason = "cycle"
            break
        seen[state] = t
        g, j = sel
        P, E = P_of(g), E_of(g)
        z = list(G[g]["pred"])
        ratio = E[j] / P if P != 0 else math.inf
        z[j] = min(ratio, 1.0)
        new_pred = project(z)
        key = round_down(new_pred, lam)
        other = -1
        for g2 in sorted(G):
            if g2 != g and round_down(G[g2]["pred"], lam) == key:
                other = g2
                break
        if other == -1:
            G[g]["pred"] = new_pred
        else:
            P2 = P_of(other)
            merged_pred = G[other]["pred"] if P <= P2 else new_pred
            mids = G[g]["mids"] | G[other]["mids"]
            # binary addition of the M-groups inside S^(t) u S'
            by_size: dict[int, list[int]] = {}
            for m in mids:
                by_size.setdefault(M[m][1], []).append(m)
            level = 0
            final = set()
            while by_size and level <= max(by_size):
                here = sorted(by_size.get(level, []))
                while len(here) >= 2:
                    a, b2 = here.pop(0), here.pop(0)
                    m_new = new_m(M[a][0] | M[b2][0], level + 1)
                    by_size.setdefault(level + 1, []).append(m_new)
                final.update(here)
                level += 1
            G[g] = {"bins": G[g]["bins"] | G[other]["bins"], "mids": final, "pred": merged_pred}
            del G[other]
            merges += 1
            seen.clear()
            check_structure()
        history.append((t, g, j, other))
        t += 1

    t_run = t
    if reason == "converged":
        groups, preds = snapshot()
        errs = errors()
        return RefResult(groups, preds, t, t_run, reason, merges, history,
                         _err_p(errs, p), max((e for r in errs.values() for e in r), default=0.0),
                         trace, history)
    obj, t_best, (groups, preds), merges_best, hlen, emax = best
    return RefResult(groups, preds, t_best, t_run, reason, merges_best, history[:hlen], obj, emax,
                     trace, history)
