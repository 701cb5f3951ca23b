"""The online calibrator's cost per call and per sample, by batch size.

In the daemon each model's :meth:`lpcal.online.OnlineCalibrator.update` gets the samples of
that model in one consumer batch: hundreds at one model, 1 to about 30 at 10,000 models. So
the fixed cost of a call matters as much as the cost of a sample. A calibrator configured as
the daemon configures it (:class:`lpcal.online.OnlineConfig` defaults: ``step`` 250, buckets of
1,000) is fed the same stream in batches of 1 to 4,096 samples, in two phases: the warm-up (a
fresh calibrator) and the steady state (after 20,000 samples, fits run, maps published).

Baseline, in the same run: the same samples in batches of ``step`` rows that end at decision
points (nothing is deferred there: every row is summed in the call that brings it). The ratio
is the cost per sample against that baseline's: the median of the ratios of pairs run one
after the other. Fit requests
are run between calls, outside the timing (the daemon runs them in a worker thread).

Run alone: ``python -m tests.bench.bench_online_calls [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from lpcal.online import OnlineCalibrator, OnlineConfig, index_uniforms, run_fit
from tests.bench.common import Overconfident, Table

BATCHES = (1, 8, 32, 256, 4096)
REPEATS = 3


def _feed(cal: OnlineCalibrator, f, y, u, size: int) -> tuple[float, int]:
    """Feed ``f, y, u`` in batches of ``size`` (the first one shorter, so that batches of
    ``step`` end at decision points); returns (seconds in ``update``, calls)."""
    step = cal.config.step
    spent, calls, a, n = 0.0, 0, 0, y.size
    first = size - cal.n_seen % step if size == step else size
    while a < n:
        b = min(n, a + (first if a == 0 else size))
        t0 = time.perf_counter()
        up = cal.update(f[a:b], y[a:b], uniforms=u[a:b])
        spent += time.perf_counter() - t0
        calls += 1
        for req in up.requests:
            cal.complete(req, run_fit(req))
        a += up.consumed
    return spent, calls


def _state(k: int, f, y, u, pre: int) -> dict:
    cal = OnlineCalibrator(k, OnlineConfig(), fit=None)
    if pre:
        _feed(cal, f[:pre], y[:pre], u[:pre], 1000)
    return cal.to_dict()


def online_calls_table(quick: bool = False) -> Table:
    tab = Table("Online calibrator: cost per `update` call and per sample, by batch size",
                ["k", "phase", "batch", "per call", "per sample", "per sample / baseline"],
                key="online_calls")
    ks = (10,) if quick else (10, 100)
    batches = (1, 32, 256) if quick else BATCHES
    for k in ks:
        m = 500 if quick else (4000 if k == 10 else 2000)
        pre_steady = 2000 if quick else 20000
        f, y, _ = Overconfident(k, s=3.0, T=0.5).sample(pre_steady + m, seed=1)
        u = index_uniforms(0, pre_steady + m)
        for phase, pre in (("warm-up", 0), ("steady", pre_steady)):
            state = _state(k, f, y, u, pre)
            xs, ys, us = f[pre:pre + m], y[pre:pre + m], u[pre:pre + m]
            _feed(OnlineCalibrator.from_dict(state), xs, ys, us, 1000)  # untimed: first use
            for b in batches:
                rows = []
                for _ in range(1 if quick else REPEATS):  # baseline and candidate in pairs
                    cal = OnlineCalibrator.from_dict(state)
                    t_base, _calls = _feed(cal, xs, ys, us, cal.config.step)
                    cal = OnlineCalibrator.from_dict(state)
                    t, calls = _feed(cal, xs, ys, us, b)
                    rows.append((t / calls, t / m, t / t_base))
                tab.add(k, phase, b, f"{statistics.median(r[0] for r in rows) * 1e6:,.1f} µs",
                        f"{statistics.median(r[1] for r in rows) * 1e6:.2f} µs",
                        f"{statistics.median(r[2] for r in rows):.2f}x")
    tab.notes.append(
        "Data: logits N(0, 3^2), labels from softmax(log f / 2) (`Overconfident(k, s=3, T=0.5)`); "
        "routing uniforms `index_uniforms`. The calibrator is restored from the same checkpoint "
        "for every run. Baseline: the same samples in batches of `step` = 250 rows ending "
        "at decision points (nothing deferred). Rows short of a decision point are deferred and "
        "summed there in one pass (`SlidingWindow.add(defer=True)`), so a call of a few rows costs "
        "a copy, and the sums are the same to the bit.")
    return tab


def run(quick: bool = False) -> list[Table]:
    return [online_calls_table(quick)]


def main(argv: list[str]) -> None:
    for t in run("--quick" in argv):
        print(t.to_markdown())


if __name__ == "__main__":
    np.seterr(all="ignore")
    main(sys.argv[1:])
