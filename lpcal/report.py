"""Evaluation tables: Err_p at lambda for p = 1, 2, inf, ECEs, Brier, NLL, accuracy."""

from __future__ import annotations

import math

import numpy as np

from lpcal import metrics

ROWS = (
    ("Err_1", lambda x, y, lam: metrics.err_p(x, y, lam, 1.0)),
    ("Err_2", lambda x, y, lam: metrics.err_p(x, y, lam, 2.0)),
    ("Err_inf", lambda x, y, lam: metrics.err_p(x, y, lam, math.inf)),
    ("top-label ECE (15 eq-width)", lambda x, y, lam: metrics.top_label_ece(x, y)),
    ("top-label ECE (15 eq-mass)", lambda x, y, lam: metrics.top_label_ece(x, y, binning="mass")),
    ("classwise ECE (15 eq-width)", lambda x, y, lam: metrics.classwise_ece(x, y)),
    ("Brier", lambda x, y, lam: metrics.brier(x, y)),
    ("NLL", lambda x, y, lam: metrics.nll(x, y)),
    ("accuracy", lambda x, y, lam: metrics.accuracy(x, y)),
)


def evaluate(probs: np.ndarray, labels: np.ndarray, lam: int) -> dict[str, float]:
    return {name: float(fn(probs, labels, lam)) for name, fn in ROWS}


def format_table(columns: dict[str, dict[str, float]], lam: int, n: int) -> str:
    """A plain-text table: one row per metric, one column per predictor."""
    names = [name for name, _ in ROWS]
    heads = list(columns)
    w0 = max(len(s) for s in names) + 2
    lines = [f"n = {n}, Err_p at lambda = {lam}",
             "metric".ljust(w0) + "".join(h.rjust(14) for h in heads)]
    for name in names:
        lines.append(name.ljust(w0) + "".join(f"{columns[h][name]:14.5f}" for h in heads))
    return "\n".join(lines)
