"""The iterative phase of Algorithm 2 (Bairaktari & Nguyen, Sec. 3), on per-bin count arrays.

Given the high-probability bins ``B`` (``|B| = n``) and, for every group-size level ``i < L``, the
counts of the pools reserved for level ``i``::

    P_cnt[i][b]     samples of pool P_i whose bin is b          P_tot[i] = |P_i|
    E_cnt[i][b, j]  samples of pool E_i with bin b and label j  E_tot[i] = |E_i|

the algorithm maintains two partitions of ``B``:

* ``M`` (estimation groups): sizes are powers of two; a group of size ``2^i`` is estimated once,
  when it is created, from the level-``i`` pools: ``P_hat_S = sum_{b in S} P_cnt[i][b] / P_tot[i]``
  and ``E_hat_S = sum_{b in S} E_cnt[i][b] / E_tot[i]`` (optionally plus Laplace noise of scale
  ``8/(m alpha)``, Lemma adaptive-samples).
* ``G`` (prediction groups): each ``S in G`` is a disjoint union of ``M``-groups of distinct sizes
  and has a prediction ``pred(S)``; initially ``G = M = {{v} : v in B}`` and ``pred({v}) = rho(v)``.
  Invariant: the level sets ``R(pred(S))`` of the groups in ``G`` are pairwise distinct.

With ``P(S) = sum_{S' in M, S' subset S} P_hat_S'`` and likewise ``E(S)``, the estimated error is
``Err(S, j) = |P(S) pred(S)_j - E(S)_j|``. While some ``Err(S, j) > beta/2``:

1. pick ``(S, j)`` (see *choices* below);
2. ``z = pred(S)``, ``z_j = min(E(S)_j / P(S), 1)``; ``pred(S) = pi(z)`` (Euclidean projection);
3. if another ``S'`` in ``G`` has ``R(pred(S')) = R(pred(S))``: merge them; the merged group keeps
   the prediction of the group with the larger ``P`` (``S'`` on ties, as in the paper);
4. inside the merged group, merge equal-size ``M``-groups until all sizes differ, estimating every
   new ``M``-group from the pools of its size;
5. recompute ``Err(S, .)``.

Choices where the paper leaves one (all deterministic):

* selection: the pair ``(S, j)`` with the largest ``Err``; ties go to the lowest group id, then to
  the lowest class (``numpy.argmax`` order). Initially the group of the ``b``-th bin of ``B`` has
  id ``b`` (``B`` is ordered by canonical bin key); a merged group keeps the id of the selected
  group ``S^(t)``.
* correction when ``P(S) <= 0`` (possible only with Laplace noise): ``z_j = 1``, the limit of
  ``min(E/P, 1)`` as ``P -> 0+``; the literal formula would push class ``j`` the wrong way.
* merging in ``M`` is binary addition: sizes are processed in increasing order; when a size holds
  more than one group, the two oldest (lowest ids) are merged, and the result carries to the next
  size.

Termination: with finite pools the loop need not end (separate P and E pools give
``sum_j E(S)_j != P(S)``; once that gap exceeds ``k beta / 2`` no simplex vector meets all ``k``
constraints). The loop therefore also stops when

* ``cycle``: the full state (all predictions) repeats exactly; between two merges the group
  structure is fixed, so the state is fingerprinted incrementally and a repeat is certain to recur;
* ``max_iterations``: ``T = (9 + 36/lambda * log2(36/beta)) / beta^2`` (Lemma
  algorithm-termination), or a smaller explicit cap.

In both cases the best state seen (smallest estimated ``Err_p`` over ``G``; a later state counts
as better only if smaller by a relative 1e-12, so the choice does not hinge on rounding) is
returned; since the run is deterministic it is recovered by replaying the run up to that
iteration, which costs nothing on the normal path.

Complexity per iteration: ``O(k log k)`` for the projection plus ``O(|G|)`` for the selection (row
maxima are cached); merges cost ``O(|S| k)`` and happen at most ``|B| - 1`` times in total. Memory:
``O(L |B| k)`` for the count arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lpcal.levels import HashCollision, bin_counts, rho, row_hash
from lpcal.simplex import project_simplex

STOP_CONVERGED = "converged"
STOP_CYCLE = "cycle"
STOP_MAX_ITER = "max_iterations"


def iteration_bound(beta: float, lam: int) -> int:
    """``T <= (9 + 36/lambda * log2(36/beta)) / beta^2`` (Lemma algorithm-termination)."""
    return math.ceil((9.0 + 36.0 / lam * math.log2(36.0 / beta)) / beta**2)


@dataclass
class LevelCounts:
    """Counts of the pools of one group-size level, restricted to the bins of ``B``."""

    p_cnt: np.ndarray  # (n,) float
    p_tot: float
    e_cnt: np.ndarray  # (n, k) float
    e_tot: float
    noise_p: float = 0.0  # Laplace scales (0 = no noise)
    noise_e: float = 0.0


@dataclass
class KernelResult:
    group_of_bin: np.ndarray  # (n,) int, compact group ids 0..g-1
    preds: np.ndarray  # (g, k) float, rows on the simplex
    iterations: int  # iterations applied to the returned state
    stop_reason: str
    est_err_p: float  # estimated Err_p over the groups of G
    est_err_max: float
    n_groups: int
    n_merges: int
    history: list = field(default_factory=list)  # (t, group, class, merged_with or -1)
    iterations_run: int = 0  # iterations run before stopping (>= iterations after a replay)


class _State:
    """Mutable state of one run of the kernel (kept out of the public API)."""

    def __init__(self, c_B, levels, beta, lam, p, rng):
        self.beta, self.lam, self.p = beta, lam, p
        self.levels = levels
        self.rng = rng
        n, k = c_B.shape
        self.n, self.k = n, k
        # M: id -> (members array, level, P_hat, E_hat)
        self.m_members: list[np.ndarray] = []
        self.m_level: list[int] = []
        self.m_p: list[float] = []
        self.m_e: list[np.ndarray] = []
        # G: group id = index of its first bin; arrays sized n, dead rows flagged
        self.alive = np.ones(n, dtype=bool)
        self.g_members: list[np.ndarray | None] = [np.array([b]) for b in range(n)]
        self.g_m: list[dict[int, int] | None] = [None] * n  # level -> M id
        self.pred = rho(c_B, lam).astype(np.float64)
        self.psum = np.zeros(n)
        self.esum = np.zeros((n, k))
        for b in range(n):
            mid = self._new_m(np.array([b]), 0)
            self.g_m[b] = {0: mid}
            self.psum[b] = self.m_p[mid]
            self.esum[b] = self.m_e[mid]
        self.err = np.abs(self.psum[:, None] * self.pred - self.esum)
        self.rowmax = self.err.max(axis=1)
        self.rowpow = self._pow(self.err)
        # level-set keys of predictions (hash of R(pred)); invariant: distinct
        self.key = row_hash(bin_counts(self.pred, lam))
        self.key_to_g = {int(h): g for g, h in enumerate(self.key)}
        self.n_merges = 0

    def _new_m(self, members: np.ndarray, level: int) -> int:
        lc = self.levels[level]
        p_hat = lc.p_cnt[members].sum() / lc.p_tot if lc.p_tot > 0 else 0.0
        e_hat = lc.e_cnt[members].sum(axis=0) / lc.e_tot if lc.e_tot > 0 else np.zeros(self.k)
        if lc.noise_p > 0:
            p_hat = p_hat + self.rng.laplace(0.0, lc.noise_p)
        if lc.noise_e > 0:
            e_hat = e_hat + self.rng.laplace(0.0, lc.noise_e, size=self.k)
        self.m_members.append(members)
        self.m_level.append(level)
        self.m_p.append(float(p_hat))
        self.m_e.append(np.asarray(e_hat, dtype=np.float64))
        return len(self.m_members) - 1

    def _refresh(self, g: int) -> None:
        mids = self.g_m[g].values()
        self.psum[g] = sum(self.m_p[m] for m in mids)
        self.esum[g] = np.sum([self.m_e[m] for m in mids], axis=0)
        self._refresh_err(g)

    def _pow(self, e: np.ndarray) -> np.ndarray:
        if math.isinf(self.p):
            return e.max(axis=-1)
        return np.sum(e**self.p, axis=-1)

    def _refresh_err(self, g: int) -> None:
        self.err[g] = np.abs(self.psum[g] * self.pred[g] - self.esum[g])
        self.rowmax[g] = self.err[g].max()
        self.rowpow[g] = self._pow(self.err[g])

    def objective(self) -> tuple[float, float]:
        """``(estimated Err_p over G, largest estimated Err(S, j))`` in O(|G|)."""
        mx = float(self.rowmax[self.alive].max()) if self.alive.any() else 0.0
        if math.isinf(self.p):
            return mx, mx
        return float(np.sum(self.rowpow[self.alive]) ** (1.0 / self.p)), mx

    def step(self, g: int, j: int) -> int:
        """One iteration on group ``g`` and class ``j``; returns the absorbed group or -1."""
        z = self.pred[g].copy()
        P, E = self.psum[g], self.esum[g, j]
        z[j] = min(E / P, 1.0) if P > 0 else 1.0
        new = project_simplex(z)
        c_new = bin_counts(new[None, :], self.lam)
        h = int(row_hash(c_new)[0])
        old_h = int(self.key[g])
        if self.key_to_g.get(old_h) == g:
            del self.key_to_g[old_h]
        other = self.key_to_g.get(h, -1)
        if other not in (-1, g) and not np.array_equal(
                bin_counts(self.pred[other][None, :], self.lam), c_new):
            raise HashCollision("two distinct level sets share a hash")
        if other == -1 or other == g:
            self.pred[g] = new
            self.key[g] = h
            self.key_to_g[h] = g
            self._refresh_err(g)
            return -1
        # merge S = g with S' = other; the larger estimated mass keeps its prediction
        keep_new = not (self.psum[g] <= self.psum[other])
        self.pred[g] = new if keep_new else self.pred[other]
        self.key[g] = h
        self.key_to_g[h] = g
        self.g_members[g] = np.concatenate([self.g_members[g], self.g_members[other]])
        by_level: dict[int, list[int]] = {}
        for d in (self.g_m[g], self.g_m[other]):
            for lvl, mid in d.items():
                by_level.setdefault(lvl, []).append(mid)
        merged: dict[int, int] = {}
        lvl = 0
        top = max(by_level) if by_level else 0
        while lvl <= top or lvl in by_level:
            mids = sorted(by_level.get(lvl, []))
            while len(mids) >= 2:
                a, b = mids.pop(0), mids.pop(0)
                members = np.concatenate([self.m_members[a], self.m_members[b]])
                new_m = self._new_m(members, lvl + 1)
                by_level.setdefault(lvl + 1, []).append(new_m)
                top = max(top, lvl + 1)
            if mids:
                merged[lvl] = mids[0]
            lvl += 1
        self.g_m[g] = merged
        self.alive[other] = False
        self.g_members[other] = None
        self.g_m[other] = None
        self.err[other] = 0.0
        self.rowmax[other] = -np.inf
        self.rowpow[other] = 0.0
        self._refresh(g)
        self.n_merges += 1
        return other


def run_kernel(
    c_B: np.ndarray,
    levels: list[LevelCounts],
    *,
    beta: float,
    lam: int,
    p: float,
    seed: int = 0,
    max_iter: int | None = None,
    progress=None,
    record_history: bool = False,
    threshold: float | None = None,
) -> KernelResult:
    """Run the iterative phase of Algorithm 2 on the bins ``c_B`` (int rows, ordered).

    ``levels[i]`` holds the level-``i`` pool counts restricted to ``B``. ``progress``, if given, is
    called as ``progress(t, est_err_max)`` every 256 iterations. ``threshold`` (default
    ``beta/2``, the paper's) is the estimated error below which correction stops; a smaller one
    keeps correcting while the pools support it (the certified mode uses ``beta/8``), and the
    iteration cap is then the paper's bound for ``beta = 2 threshold``.
    """
    n = c_B.shape[0]
    threshold = beta / 2.0 if threshold is None else float(threshold)
    if not (0.0 < threshold <= beta / 2.0):
        raise ValueError(f"threshold must lie in (0, beta/2], got {threshold}")
    cap = iteration_bound(2.0 * threshold, lam) if max_iter is None else int(max_iter)
    if n == 0:
        return KernelResult(np.zeros(0, np.int64), np.zeros((0, c_B.shape[1])), 0,
                            STOP_CONVERGED, 0.0, 0.0, 0, 0)
    need = math.floor(math.log2(n)) + 1
    if len(levels) < need:
        raise ValueError(f"|B| = {n} needs {need} pool levels, got {len(levels)}")

    def run(limit: int, track: bool):
        st = _State(c_B, levels, beta, lam, p, np.random.default_rng(seed))
        t = 0
        hist = []
        best_obj, best_t = math.inf, 0
        salt = np.random.default_rng(seed + 1).integers(1, 2**62, size=n)
        fp = 0
        fps: dict[int, int] = {}
        for g in range(n):
            fp ^= hash((int(salt[g]), st.pred[g].tobytes()))
        reason = STOP_CONVERGED
        while True:
            if track:
                obj = st.objective()[0]
                if obj < best_obj * (1.0 - 1e-12):
                    best_obj, best_t = obj, t
            g = int(np.argmax(st.rowmax))
            if st.rowmax[g] <= threshold:
                reason = STOP_CONVERGED
                break
            if t >= limit:
                reason = STOP_MAX_ITER
                break
            if track:
                if fp in fps:
                    reason = STOP_CYCLE
                    break
                fps[fp] = t
            j = int(np.argmax(st.err[g]))
            old = hash((int(salt[g]), st.pred[g].tobytes()))
            other = st.step(g, j)
            if other >= 0:
                fps.clear()
                fp = 0
                for a in np.flatnonzero(st.alive):
                    fp ^= hash((int(salt[a]), st.pred[a].tobytes()))
            else:
                fp ^= old ^ hash((int(salt[g]), st.pred[g].tobytes()))
            if record_history:
                hist.append((t, g, j, other))
            t += 1
            if track and progress is not None and t % 256 == 0:
                progress(t, float(st.rowmax.max()))
        return st, t, reason, hist, best_t

    st, t, reason, hist, best_t = run(cap, True)
    t_run = t
    if reason != STOP_CONVERGED and best_t != t:
        st, t2, _, hist, _ = run(best_t, False)
        assert t2 == best_t
        t = best_t
    alive = np.flatnonzero(st.alive)
    compact = np.full(n, -1, dtype=np.int64)
    compact[alive] = np.arange(alive.size)
    group_of_bin = np.empty(n, dtype=np.int64)
    for g in alive:
        group_of_bin[st.g_members[g]] = compact[g]
    obj, mx = st.objective()
    return KernelResult(group_of_bin, st.pred[alive].copy(), t, reason, obj, mx,
                        int(alive.size), st.n_merges, hist, t_run)
