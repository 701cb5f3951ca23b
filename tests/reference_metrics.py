"""Independent brute-force reference implementations of lpcal.metrics (plain Python, small n).

Written directly from the definitions with dicts and loops; nothing here imports lpcal, so the
tests compare two implementations that share no code. Inputs are lists (or arrays) of probability
rows and integer labels.

The rounding is the paper's ``R(u)_j = floor(u_j * lambda) / lambda``; like lpcal it adds 1e-9
(in units of bins) before flooring so that ``0.29 * 100 = 28.999999999999996`` lands in bin 29.
"""

from __future__ import annotations

import math

FLOOR_TOL = 1e-9


def bin_of(row, lam: int) -> tuple[int, ...]:
    """``lambda * R(u)`` as a tuple of ints, clipped to ``[0, lambda]``."""
    return tuple(min(lam, max(0, math.floor(float(u) * lam + FLOOR_TOL))) for u in row)


def sparse_key(cell: tuple[int, ...]) -> str:
    return ",".join(f"{i}:{c}" for i, c in enumerate(cell) if c != 0)


def _z(row, label: int, j: int) -> float:
    return float(row[j]) - (1.0 if int(label) == j else 0.0)


def err_table(probs, labels, lam: int) -> tuple[dict[tuple[int, ...], list[float]], int]:
    """``{bin: [sum over samples in bin of (f_j - y_j) for j]}`` and ``n``."""
    table: dict[tuple[int, ...], list[float]] = {}
    n = 0
    for row, y in zip(probs, labels):
        n += 1
        v = bin_of(row, lam)
        acc = table.setdefault(v, [0.0] * len(row))
        for j in range(len(row)):
            acc[j] += _z(row, y, j)
    return table, n


def err_p(probs, labels, lam: int, p: float) -> float:
    """``(sum_v sum_j |mean_i (f_ij - y_ij) 1[R(f_i) = v]|^p)^(1/p)``; max for ``p = inf``."""
    table, n = err_table(probs, labels, lam)
    errs = [abs(s) / n for sums in table.values() for s in sums]
    if math.isinf(p):
        return max(errs)
    return sum(e**p for e in errs) ** (1.0 / p)


def err_1_ece_form(probs, labels, lam: int) -> float:
    """The paper's ECE form: ``sum_v P(v) sum_j |E[f_j - y_j | R(f) = v]|`` (conditional means)."""
    members: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(probs):
        members.setdefault(bin_of(row, lam), []).append(i)
    n = len(probs)
    k = len(probs[0])
    total = 0.0
    for idx in members.values():
        mass = len(idx) / n
        for j in range(k):
            cond = sum(_z(probs[i], labels[i], j) for i in idx) / len(idx)
            total += mass * abs(cond)
    return total


def err_2_squared_ustat(probs, labels, lam: int) -> float:
    """``sum_{v,j} mean_{i != i'} Z_i Z_i'`` with ``Z_i = (f_ij - y_ij) 1[R(f_i) = v]`` (pairs)."""
    n = len(probs)
    k = len(probs[0])
    bins = [bin_of(row, lam) for row in probs]
    total = 0.0
    for v in set(bins):
        for j in range(k):
            z = [_z(probs[i], labels[i], j) if bins[i] == v else 0.0 for i in range(n)]
            pair_sum = 0.0
            for a in range(n):
                for b in range(n):
                    if a != b:
                        pair_sum += z[a] * z[b]
            total += pair_sum / (n * (n - 1))
    return total


def _width_bin(score: float, n_bins: int) -> int:
    """Right-closed equal-width bins ``((b)/B, (b+1)/B]``; edges ``i * (1/B)`` as numpy.linspace."""
    step = 1.0 / n_bins
    for b in range(n_bins - 1):
        if score <= (b + 1) * step:
            return b
    return n_bins - 1


def _mass_bins(scores: list[float], n_bins: int) -> list[int]:
    """Equal-mass bins by rank, for DISTINCT scores and ``gcd(n - 1, n_bins) = 1``.

    Then the quantile edges ``q_b`` (linear interpolation at position ``(n - 1) b / B``) fall
    strictly between consecutive sorted scores, and sorted position ``r`` lies in the first bin
    ``b`` with ``r <= floor((n - 1)(b + 1) / B)``.
    """
    n = len(scores)
    assert len(set(scores)) == n and math.gcd(n - 1, n_bins) == 1
    order = sorted(range(n), key=lambda i: scores[i])
    out = [0] * n
    for r, i in enumerate(order):
        b = 0
        while r > ((n - 1) * (b + 1)) // n_bins:
            b += 1
        out[i] = b
    return out


def _binned_gap(scores: list[float], hits: list[float], n_bins: int, binning: str) -> float:
    if binning == "width":
        bins = [_width_bin(s, n_bins) for s in scores]
    else:
        bins = _mass_bins(scores, n_bins)
    groups: dict[int, list[int]] = {}
    for i, b in enumerate(bins):
        groups.setdefault(b, []).append(i)
    n = len(scores)
    total = 0.0
    for idx in groups.values():
        acc = sum(hits[i] for i in idx) / len(idx)
        conf = sum(scores[i] for i in idx) / len(idx)
        total += len(idx) / n * abs(acc - conf)
    return total


def top_label_ece(probs, labels, n_bins: int, binning: str = "width") -> float:
    scores, hits = [], []
    for row, y in zip(probs, labels):
        row = [float(u) for u in row]
        pred = row.index(max(row))
        scores.append(row[pred])
        hits.append(1.0 if pred == int(y) else 0.0)
    return _binned_gap(scores, hits, n_bins, binning)


def classwise_ece(probs, labels, n_bins: int, binning: str = "width") -> float:
    k = len(probs[0])
    total = 0.0
    for j in range(k):
        scores = [float(row[j]) for row in probs]
        hits = [1.0 if int(y) == j else 0.0 for y in labels]
        total += _binned_gap(scores, hits, n_bins, binning)
    return total / k


def brier(probs, labels) -> float:
    n = len(probs)
    return sum(_z(row, y, j) ** 2 for row, y in zip(probs, labels) for j in range(len(row))) / n


def nll(probs, labels, clip: float = 1e-12) -> float:
    return -sum(math.log(max(clip, float(row[int(y)]))) for row, y in zip(probs, labels)) / len(
        probs
    )


def accuracy(probs, labels) -> float:
    hits = 0
    for row, y in zip(probs, labels):
        row = [float(u) for u in row]
        hits += row.index(max(row)) == int(y)
    return hits / len(probs)
