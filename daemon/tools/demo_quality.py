"""The quality tables of ``make demo``: a published bin map on fresh samples of a synthetic model
whose truth is known, beside temperature scaling fitted on other fresh samples.

Each table has one row per metric (TRUE ``Err_p`` from the known label distribution ``q``,
top-label and classwise ECE, Brier, NLL, accuracy) and one column per predictor. The verdict
compares a map with temperature scaling under :data:`TS_BOUNDS`, the quality bounds of the
README and of the quality benchmark (docs/benchmarks.md, section quality).

Usage::

    fresh = FreshSamples.draw(synth, 50_000, logit_scale=0.5)    # drifted model
    cols = fresh.columns({"v1 (live)": bm1.apply, "v3": bm3.apply}, lam=bm3.lam, p=bm3.p)
    print(format_quality(cols))
    verdict(cols["raw"], cols["TS"], cols["v3"])                # (beats raw, within TS bounds)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from daemon.tools.simulate.model import SyntheticModel
from lpcal import metrics
from lpcal.temperature import apply_temperature, fit_temperature

__all__ = ["QUALITY", "TS_BOUNDS", "FreshSamples", "beyond_bounds", "format_quality", "verdict"]

#: Rows of the tables after TRUE Err_p (named as in :mod:`lpcal.report`), and their metrics.
QUALITY = {"top-label ECE (15 eq-width)": metrics.top_label_ece,
           "classwise ECE (15 eq-width)": metrics.classwise_ece, "Brier": metrics.brier,
           "NLL": metrics.nll, "accuracy": metrics.accuracy}
#: Allowed excess over temperature scaling (accuracy: allowed shortfall): the quality bounds.
TS_BOUNDS = {"top-label ECE (15 eq-width)": 0.003, "classwise ECE (15 eq-width)": 0.001,
             "Brier": 0.001, "NLL": 0.01}
ACCURACY_BOUND = 0.001
TRUE = "TRUE Err_p (known q)"


@dataclass(frozen=True)
class FreshSamples:
    """Fresh samples ``(f, q, y)`` of a synthetic model (optionally drifted) and the temperature
    fitted on ``ts_n`` other fresh samples of the same model (the peer a user would pick)."""

    f: np.ndarray
    q: np.ndarray
    y: np.ndarray
    temperature: float

    @classmethod
    def draw(cls, synth: SyntheticModel, n: int, *, ts_n: int = 20_000,
             logit_scale: float | None = None) -> FreshSamples:
        f_ts, _, y_ts = synth.sample(ts_n, logit_scale=logit_scale)
        temp = fit_temperature(f_ts, y_ts)
        f, q, y = synth.sample(n, logit_scale=logit_scale)
        return cls(f, q, y, float(temp))

    def columns(self, maps: Mapping[str, Callable[[np.ndarray], np.ndarray]], *, lam: int,
                p: float) -> dict[str, dict[str, float]]:
        """``{"raw": ..., "TS": ..., **{name: ...}}``: each a dict of TRUE Err_p and
        :data:`QUALITY` on these samples; ``maps`` apply a bin map to probabilities."""
        preds = {"raw": self.f, "TS": apply_temperature(self.f, self.temperature)}
        preds.update({name: fn(self.f) for name, fn in maps.items()})
        out = {}
        for name, x in preds.items():
            out[name] = {TRUE: float(metrics.err_p_true(x, self.q, lam, p)),
                         **{m: float(fn(x, self.y)) for m, fn in QUALITY.items()}}
        return out


def format_quality(columns: Mapping[str, Mapping[str, float]], p: float, indent: str = "  "
                   ) -> str:
    """The table: one row per metric, one column per predictor."""
    pname = "inf" if math.isinf(p) else f"{p:g}"
    heads = list(columns)
    width = max(12, *(len(h) + 2 for h in heads))
    lines = [indent + f"{'metric':30s}" + "".join(h.rjust(width) for h in heads)]
    for name in (TRUE, *QUALITY):
        label = name.replace("Err_p", f"Err_{pname}")
        lines.append(indent + f"{label:30s}"
                     + "".join(f"{columns[h][name]:{width}.4f}" for h in heads))
    return "\n".join(lines)


def verdict(raw: Mapping[str, float], ts: Mapping[str, float], cal: Mapping[str, float]
            ) -> tuple[bool, bool]:
    """(beats the raw model on the four error metrics, within the bounds of TS)."""
    beats = all(cal[name] < raw[name] for name in TS_BOUNDS)
    return beats, not beyond_bounds(ts, cal)


def beyond_bounds(ts: Mapping[str, float], cal: Mapping[str, float]) -> list[str]:
    """The metrics on which ``cal`` is beyond the bounds of TS, each with its excess and bound
    (empty: within the bounds)."""
    out = [f"{name} {cal[name] - ts[name]:+.4f} over TS (bound {tol})"
           for name, tol in TS_BOUNDS.items() if cal[name] > ts[name] + tol]
    if cal["accuracy"] < ts["accuracy"] - ACCURACY_BOUND:
        out.append(f"accuracy {cal['accuracy'] - ts['accuracy']:+.4f} under TS "
                   f"(bound {ACCURACY_BOUND})")
    return out
