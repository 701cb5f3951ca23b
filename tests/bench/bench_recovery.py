"""Recovery: samples to a good map at the start and after a drift, online loop vs fixed epochs.

For each CIFAR record (k = 10 and k = 100 networks) and seed: a seeded half of the record (5,000
samples) is the fixed **test split**; the stream resamples the other half with replacement.
``DRIFT_AT`` stationary samples, then the logits (``log p``) are halved and renormalised (the
network turns under-confident, as after a data shift; the test split is drifted the same way).
A second, shorter stream doubles them instead (over-confident), for the online loop and
temperature scaling only.

Three calibrators see the same stream:

* **online**: :class:`lpcal.online.OnlineCalibrator` with its defaults, watched as the daemon
  watches it (:class:`Watched`): a :class:`daemon.monitor.WindowMonitor` with the shipped
  change test (:mod:`daemon.drift`, the model settings' defaults) sees the raw and the served
  map's outputs, restarts its calibrated window at every publication, and when the test alarms
  the loop is told (:meth:`~lpcal.online.OnlineCalibrator.notify_drift`), once per map, as the
  daemon's drift trigger does; an alarm before the switch is a false one (counted);
* **fixed epochs**: the daemon's previous schedule, simulated with the library
  (:class:`lpcal.pools.PoolSet` with today's defaults: warm-up 10,000, 3,000 held out, pools
  of 5,000 per estimation pool; every full epoch is fitted with :func:`lpcal.calibrate.fit_pools`
  and published, and the next epoch starts from nothing; an epoch straddling the drift is fitted
  as it is);
* **temperature scaling** (the baseline): fitted on every sample seen so far (after the switch:
  every drifted sample seen so far).

**A good map** at stream position ``n``: the served map (a published one) is within the quality
bounds of docs/benchmarks.md section ``quality`` of temperature scaling fitted on the same
samples seen so far, on the test split: top-label ECE within +0.003, classwise ECE +0.001,
Brier +0.001, NLL +0.01. Reported: the first ``n`` (from the start, and from the switch) at which
the served map is good, checked every ``EVAL_EVERY`` samples for ``SETTLED`` samples after each
publication, then every ``SETTLED_EVERY`` (the served map does not change in between). After the
switch, also **the issue's criterion**: the first sample from the switch at which the served
map's top-label ECE on the drifted test split is within ``ISSUE_ECE`` (0.01) of temperature
scaling fitted on the drifted stream pool (target: within 10,000 samples). For temperature
scaling itself, the
first ``n`` at which TS fitted on ``n`` samples is within the same bounds of TS fitted on the
whole stream pool (5,000 distinct samples). Medians over seeds, with the range. Also: the maps
the online loop published, and how many of them were worse on the test split (Brier) than the
map they replaced (champion/challenger's promise is: none, up to the test's level).

A second table: the **bytes** of the online loop's state at k = 100 (one seed, ``BYTES_AT``
stationary samples), against a full epoch of the fixed schedule in the same run: the window
(its buckets keep their held-out *samples*; the certificate's sums are built when a fit is
requested), the held-out sums the window's buckets kept before (per bucket, for ``g`` and for
``f``, computed here from the same samples) and a full fixed epoch's pools and held-out sums.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from daemon.monitor import WindowMonitor
from daemon.settings import ModelSettings
from lpcal.binmap import BinMap, scale_temperature
from lpcal.holdout import HoldoutSums
from lpcal.metrics import brier, classwise_ece, nll, top_label_ece
from lpcal.online import OnlineCalibrator, OnlineConfig, fit_window_pools, index_uniforms, run_fit
from lpcal.pools import PoolSet
from lpcal.precalibrate import TemperatureGrid
from lpcal.spec import FitSpec
from tests.bench.common import Table, load_record, median, rescale

RECORDS = ("wideresnet-16-4-cifar-10", "lenet-5-cifar-10", "wideresnet-16-4-cifar-100",
           "densenet-bc-100-cifar-100")
SCALE = 0.5
SCALE_UP = 2.0                # the over-confident drift: online loop and TS only
UP_AT = 20_000                # its stationary phase (only a published map is needed first)
DRIFT_AT = 60_000
AFTER_CAP = 90_000            # drifted samples streamed at most
ISSUE_ECE = 0.01              # the issue's criterion after a drift: top-label ECE within this
RATE = 10.0                   # samples per second of event time (the monitor's clock)
BYTES_AT = 40_000             # stationary samples before the state's bytes are measured
BATCH = 500
EVAL_EVERY = 500
SETTLED = 5_000               # samples after a publication checked every EVAL_EVERY; then
SETTLED_EVERY = 2_500         # every SETTLED_EVERY (only the TS baseline moves meanwhile)
BOUNDS = {"top-label ECE": 0.003, "classwise ECE": 0.001, "Brier": 0.001, "NLL": 0.01}
FIXED = {"warmup": 10_000, "holdout": 3_000, "pool": 5_000}





def quality(h: np.ndarray, y: np.ndarray) -> dict[str, float]:
    return {"top-label ECE": top_label_ece(h, y, tol=1e-6),
            "classwise ECE": classwise_ece(h, y, tol=1e-6),
            "Brier": brier(h, y, tol=1e-6), "NLL": nll(h, y, tol=1e-6)}


def within(m: dict[str, float], ref: dict[str, float]) -> bool:
    return all(m[key] - ref[key] <= tol + 1e-12 for key, tol in BOUNDS.items())


class Split:
    """One record and seed: test split, stream pool, both before and after the drift."""

    def __init__(self, name: str, seed: int, drift_at: int = DRIFT_AT,
                 after_cap: int = AFTER_CAP, scale: float = SCALE):
        self.drift_at, self.after_cap = drift_at, after_cap
        probs, labels = load_record(name)
        perm = np.random.default_rng(seed).permutation(labels.size)
        half = labels.size // 2
        test, pool = perm[:half], perm[half:]
        self.k = probs.shape[1]
        self.seed = seed
        self.x = {False: probs[pool], True: rescale(probs[pool], scale)}
        self.y = labels[pool]
        self.tx = {False: probs[test], True: rescale(probs[test], scale)}
        self.ty = labels[test]
        rng = np.random.default_rng(10_000 + seed)
        self.idx = rng.integers(0, pool.size, drift_at + after_cap)
        self._ts_cache: dict[tuple[bool, float], dict[str, float]] = {}

    def batch(self, a: int, b: int):
        drifted = a >= self.drift_at
        i = self.idx[a:b]
        return self.x[drifted][i], self.y[i], drifted

    def ts_quality(self, drifted: bool, t: float) -> dict[str, float]:
        key = (drifted, t)
        if key not in self._ts_cache:
            self._ts_cache[key] = quality(scale_temperature(self.tx[drifted], t), self.ty)
        return self._ts_cache[key]

    def map_quality(self, drifted: bool, bm: BinMap) -> dict[str, float]:
        if not bm.n_bins and bm.temperature is not None:
            return self.ts_quality(drifted, bm.temperature)
        return quality(bm.apply(self.tx[drifted], check=False), self.ty)


class Tracker:
    """The TS baseline fitted on the samples seen so far (since the switch, after it)."""

    def __init__(self):
        self.grid = {False: TemperatureGrid(), True: TemperatureGrid()}

    def add(self, x, y, drifted):
        self.grid[drifted].update(x, y)

    def temperature(self, drifted):
        return self.grid[drifted].fit()


def run_stream(sp: Split, make, feed) -> dict:
    """Stream ``sp`` through a calibrator (``feed(cal, a, x, y)`` returns published maps);
    returns the first good positions (from the start, from the switch; the issue's criterion
    after it), the publications and, for a :class:`Watched` loop, its drift notifications."""
    cal = make(sp.k)
    ts = Tracker()
    served: BinMap | None = None
    first = {False: None, True: None}
    issue = None
    ref_ece = sp.ts_quality(True, TemperatureGrid().update(sp.x[True], sp.y).fit())[
        "top-label ECE"]
    pubs: list[tuple[int, BinMap]] = []
    last_pub = 0
    for a in range(0, sp.drift_at + sp.after_cap, BATCH):
        b = a + BATCH
        x, y, drifted = sp.batch(a, b)
        ts.add(x, y, drifted)
        for bm in feed(cal, a, x, y):
            served = bm
            pubs.append((b, bm))
            last_pub = b
        if not drifted and first[False] is not None:
            continue  # the start is settled: no evaluation until the switch
        if drifted and first[True] is not None and issue is not None:
            break
        if served is None or b % (EVAL_EVERY if b - last_pub <= SETTLED else SETTLED_EVERY):
            continue
        q = sp.map_quality(drifted, served)
        if drifted and issue is None and q["top-label ECE"] <= ref_ece + ISSUE_ECE:
            issue = b - sp.drift_at
        if first[drifted] is None and within(q, sp.ts_quality(drifted,
                                                              ts.temperature(drifted))):
            first[drifted] = b - (sp.drift_at if drifted else 0)
    worse = 0
    for (_, old), (b, new) in itertools.pairwise(pubs):
        d = b > sp.drift_at
        worse += sp.map_quality(d, new)["Brier"] > sp.map_quality(d, old)["Brier"] + 1e-4
    det = getattr(cal, "detections", [])
    after = [n - sp.drift_at for n in det if n > sp.drift_at]
    return {"start": first[False], "drift": first[True], "issue": issue, "published": len(pubs),
            "worse": worse, "detected": after[0] if after else None,
            "false_alarms": sum(n <= sp.drift_at for n in det)}


class Watched:
    """The online loop watched as the daemon watches it (module docstring): its served map's
    outputs feed a :class:`daemon.monitor.WindowMonitor` with the shipped change test, whose
    calibrated window restarts at every publication (at the exact sample, as
    :meth:`daemon.model_state.ModelState.install_binmap` does; the change test keeps its
    baseline when the map replaces one of the same regime, as the daemon's does); an alarm
    tells the loop of a
    drift once per map (:class:`daemon.trigger.DriftTrigger` fires once until re-armed by the
    next map). ``detections``: the loop's sample counts at the notifications."""

    def __init__(self, k: int):
        self.cal = OnlineCalibrator(k, fit=run_fit)
        self.mon = WindowMonitor(k, self.cal.window.layout.lam, self.cal.config.p,
                                 window_samples=10_000,
                                 change=ModelSettings().monitor_spec().change_detector())
        self.armed = True
        self.live_at: int | None = None  # the loop's sample count when the live map came
        self.detections: list[int] = []

    def feed(self, x: np.ndarray, y: np.ndarray) -> list[BinMap]:
        start = self.cal.n_seen
        out, a = [], 0
        for e in self.cal.update(x, y).events:
            if e.kind == "published":
                b = e.n - start
                self._watch(x[a:b], y[a:b], start + a)
                a = b
                same = self.live_at is not None and self.live_at >= self.cal.regime_start
                self.mon.reset("calibrated", keep_change=same)
                self.live_at = e.n
                self.armed = True
                out.append(e.binmap)
        self._watch(x[a:], y[a:], start + a)
        if self.mon.change.alarm and self.armed:
            self.armed = False
            self.detections.append(self.cal.n_seen)
            self.cal.notify_drift()
        return out

    def _watch(self, x: np.ndarray, y: np.ndarray, t0: int) -> None:
        if y.size:
            live = self.cal.live
            self.mon.update(x, y, (t0 + np.arange(y.size)) / RATE,
                            calibrated=None if live is None else live.apply(x, check=False))


def online_feed(cal: Watched, a: int, x, y):
    return cal.feed(x, y)


class FixedSchedule:
    """The previous daemon schedule at the library level: epochs of warm-up, pools and held-out
    share filled in order, each fitted when full and published, the next from nothing."""

    def __init__(self, k: int):
        spec = FitSpec(eps=0.1, p=math.inf, delta=0.1, pool_size=FIXED["pool"],
                       variant="shared")
        self.layout = spec.pool_sizing(k, holdout=FIXED["holdout"],
                                       warmup=FIXED["warmup"]).layout()
        self.pools = PoolSet(self.layout)
        self.n = 0
        self.version = 0
        self.cfg = OnlineConfig()

    def feed(self, x, y) -> list[BinMap]:
        u = index_uniforms(self.n, y.size)
        self.n += y.size
        out, a = [], 0
        while a < y.size:
            a += self.pools.add_samples(u[a:], x[a:], y[a:])
            if self.pools.full:
                self.version += 1
                out.append(fit_window_pools(self.pools, self.cfg, seed=self.n,
                                            model_id="bench", version=self.version))
                self.pools = PoolSet(self.layout)
        return out


def ts_samples(sp: Split, drifted: bool) -> int | None:
    """Samples until TS on them is within the bounds of TS on the whole stream pool."""
    ref = sp.ts_quality(drifted, TemperatureGrid().update(sp.x[drifted], sp.y).fit())
    g = TemperatureGrid()
    start = sp.drift_at if drifted else 0
    for a in range(start, start + min(30_000, sp.drift_at), EVAL_EVERY):
        x, y, _ = sp.batch(a, a + EVAL_EVERY)
        g.update(x, y)
        if within(sp.ts_quality(drifted, g.fit()), ref):
            return a + EVAL_EVERY - start
    return None


def state_bytes(sp: Split) -> dict[str, int]:
    """Bytes of the online loop after ``BYTES_AT`` samples, of the held-out sums its buckets
    kept before, and of a full epoch of the fixed schedule, on the same stream."""
    cal = OnlineCalibrator(sp.k, OnlineConfig(pools_from=10**9))   # no fit: bytes only
    for a in range(0, BYTES_AT, BATCH):
        x, y, _ = sp.batch(a, a + BATCH)
        cal.update(x, y)
    w = cal.window
    held = [b for b in w.buckets if b.n_held]
    held_bytes = sum(x.nbytes + y.nbytes for x, y in (b.held_samples(sp.k) for b in held))
    cx, cy = w.cert_samples()
    cert_bytes = cx.nbytes + cy.nbytes
    per_bucket = 0
    for b in held:  # the previous release: all their held-out samples as sums
        x, y = b.held_samples(sp.k)
        if b.n_cert:
            x = np.concatenate([x, b.cert_samples(sp.k)[0]])
            y = np.concatenate([y, b.cert_samples(sp.k)[1]])
        g = scale_temperature(x, b.temperature)
        per_bucket += (HoldoutSums(sp.k, w.layout.lam).update(g, y).nbytes
                       + HoldoutSums(sp.k, w.layout.lam).update(x, y).nbytes)
    fixed = FixedSchedule(sp.k)
    a = 0
    while not fixed.pools.full:
        x, y, _ = sp.batch(a, a + BATCH)
        u = index_uniforms(a, y.size)
        fixed.pools.add_samples(u, x, y)
        a += BATCH
    fixed.pools.compact()
    return {"online": cal.nbytes, "held": held_bytes, "n_held": sum(b.n_held for b in held),
            "cert": cert_bytes, "n_cert": int(cy.size),
            "before": cal.nbytes - held_bytes - cert_bytes + per_bucket,
            "per_bucket": per_bucket,
            "fixed": fixed.pools.nbytes, "fixed_n": a}


def _fmt(vals: list[int | None]) -> str:
    got = [v for v in vals if v is not None]
    if not got:
        return "never"
    miss = len(vals) - len(got)
    med = median(got) if not miss else None
    s = (f"{med:,.0f}" if med is not None else f"> cap ({miss} of {len(vals)})")
    return f"{s} [{min(got):,}-{max(got):,}]" if len(got) > 1 else s


def _ratio(a: list, b: list) -> str:
    if any(v is None for v in a) or any(v is None for v in b):
        return "-"
    return f"{median(a) / median(b):.2f}"


def run(quick: bool = False) -> list[Table]:
    seeds = range(1) if quick else range(3)
    records = RECORDS[:1] if quick else RECORDS
    t = Table(
        "Samples to a good map at the start and after a drift (logits x0.5): online loop vs "
        "fixed epochs vs temperature scaling",
        ["network", "k", "start: online", "start: fixed epochs", "start: TS alone",
         "online / fixed", "drift: online", "drift: fixed epochs", "drift: TS alone",
         "online / fixed (drift)", "drift x2: online", "drift x2: TS alone",
         "online maps published", "published worse than replaced",
         "drift detected after (change test)", "false alarms before the switch",
         "drift: online, ECE within 0.01 of TS there", "<= 10,000 (issue)"],
        key="recovery",
        notes=[
            (f"Joined samples until the served map is within the quality bounds of "
             f"temperature scaling fitted on the same samples seen so far ({BOUNDS}; test "
             f"split: the seeded half of the record, 5,000 samples); median [min-max] over "
             f"{len(seeds)} seeds, checked every {EVAL_EVERY} samples up to {SETTLED:,} after a "
             f"publication, then every {SETTLED_EVERY:,}. Drift: logits x"
             f"{SCALE} after {DRIFT_AT:,} samples, counted from the switch; the online loop is "
             "told when the daemon's change test (shipped defaults) on its served map alarms "
             f"('drift detected after'; alarms before the switch are false ones); streams "
             f"capped at {AFTER_CAP:,} drifted samples ('> cap'). "
             f"Drift x{SCALE_UP:g} (over-confident): a separate stream of {UP_AT:,} "
             f"stationary samples, then logits x{SCALE_UP:g}, at most {UP_AT:,} of them; the "
             "fixed schedule is not run on it (its epochs do not depend on the drift)."),
            (f"The issue's criterion after the drift: the served map's top-label ECE on the "
             f"drifted test split within {ISSUE_ECE} of temperature scaling fitted on the "
             "whole drifted stream pool; '<= 10,000 (issue)': in how many seeds that held "
             "within 10,000 samples of the switch."),
            (f"Fixed epochs: warm-up {FIXED['warmup']:,}, held out {FIXED['holdout']:,}, "
             f"{FIXED['pool']:,} per estimation pool (the previous daemon defaults, eps 0.1, "
             "p inf), every full epoch fitted and published. TS alone: samples until TS "
             "fitted on them is within the same bounds of TS fitted on the whole stream pool."),
            ("Online loop: lpcal.online.OnlineConfig defaults (warm-up until the 95% interval "
             "of ln T is within +-0.05, window of 32 buckets of 1,000, 30% held out, 12% of the "
             "samples the test share and 18% the certification share, champion/challenger on "
             "the test share's paired log-loss difference at alpha 0.05 spent over the "
             "tests; Algorithm 2 once the pools hold 3,500 fit-share samples, its fits taking "
             "effect 1,000 samples after they are requested). "
             "'Published worse than replaced': publications whose test-split Brier "
             "exceeds the replaced map's by more than 1e-4."),
        ])
    mb = Table(
        f"Bytes of the online loop's state after {BYTES_AT:,} samples (k = 100 networks), "
        "against a full epoch of the fixed schedule",
        ["network", "k", "online state", "of which test-share samples",
         "of which certification samples", "samples kept (test / certification)",
         "the same with per-bucket held-out sums (before)", "full fixed epoch",
         "online / fixed epoch", "before / fixed epoch"],
        key="recovery",
        notes=[("Seed 0, stationary stream. The online state: lpcal.online.OnlineCalibrator."
                "nbytes (window buckets: temperature and loss grids, Algorithm 2's pool "
                "tables, the test share's held-out samples of the newest 10 buckets and the "
                "certification share's of the newest 20). 'Before': the window of two "
                "releases ago, each of the newest 10 buckets keeping the held-out sums of g "
                "and f (lpcal.holdout.HoldoutSums of all their held-out samples) and no "
                "certification samples. "
                "Full fixed epoch: lpcal.pools.PoolSet.nbytes of the first full epoch of the "
                "previous defaults (warm-up grid, pools, 3,000 held out), compacted.")])
    for name in records:
        res = {"online": [], "fixed": [], "ts": [], "up": [], "up_ts": []}
        k = None
        for s in seeds:
            sp = Split(name, s, *((24_000, 12_000) if quick else ()))
            k = sp.k
            res["online"].append(run_stream(sp, Watched, online_feed))
            res["fixed"].append(run_stream(sp, FixedSchedule,
                                           lambda cal, a, x, y: cal.feed(x, y)))
            res["ts"].append({"start": ts_samples(sp, False), "drift": ts_samples(sp, True)})
            up = Split(name, s, *((12_000, 12_000) if quick else (UP_AT, UP_AT)), SCALE_UP)
            res["up"].append(run_stream(up, Watched, online_feed)["drift"])
            res["up_ts"].append(ts_samples(up, True))
        col = {m: {ph: [r[ph] for r in res[m]] for ph in ("start", "drift")}
               for m in ("online", "fixed", "ts")}
        t.add(name, k, _fmt(col["online"]["start"]), _fmt(col["fixed"]["start"]),
              _fmt(col["ts"]["start"]), _ratio(col["online"]["start"], col["fixed"]["start"]),
              _fmt(col["online"]["drift"]), _fmt(col["fixed"]["drift"]),
              _fmt(col["ts"]["drift"]), _ratio(col["online"]["drift"], col["fixed"]["drift"]),
              _fmt(res["up"]), _fmt(res["up_ts"]),
              "/".join(str(r["published"]) for r in res["online"]),
              sum(r["worse"] for r in res["online"]),
              _fmt([r["detected"] for r in res["online"]]),
              sum(r["false_alarms"] for r in res["online"]),
              _fmt([r["issue"] for r in res["online"]]),
              f"{sum(r['issue'] is not None and r['issue'] <= 10_000 for r in res['online'])}"
              f" of {len(res['online'])}")
        if k >= 100 or quick:
            b = state_bytes(Split(name, 0))
            mb.add(name, k, f"{b['online'] / 1e6:.2f} MB", f"{b['held'] / 1e6:.2f} MB",
                   f"{b['cert'] / 1e6:.2f} MB", f"{b['n_held']:,} / {b['n_cert']:,}",
                   f"{b['before'] / 1e6:.2f} MB",
                   f"{b['fixed'] / 1e6:.2f} MB", f"{b['online'] / b['fixed']:.2f}",
                   f"{b['before'] / b['fixed']:.2f}")
    return [t, mb]


if __name__ == "__main__":
    for table in run():
        print(table.to_markdown())
