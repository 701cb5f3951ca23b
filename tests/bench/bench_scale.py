"""Benchmark: replica scaling and failover.

**Scaling.** One embedded Tansu broker; a :class:`daemon.tools.simulate.traffic.TrafficGenerator` stream of 8
``k = 10`` models is produced once into predictions/outcomes topics of 8 partitions (each model
on its own partition, keyed by model id). Then, alternating, the same stream is consumed by 1
replica and by 2 replicas in one fresh consumer group. Each replica is a separate process
(``python -m tests.bench.bench_scale --replica SPEC``) running a real
:class:`daemon.service.Daemon` with pools so large that no fit runs. A replica holds its
``getmany`` until the harness says go, which it does once the group is settled (every
partition assigned and restored), so both setups start from the same point. Throughput = total
joined samples / (time of the last replica to reach its partitions' end offsets - go). CPU
shares: utime + stime deltas from ``/proc/<pid>/stat`` of the broker, of each replica and of
the harness over the same interval, as a share of the machine's cores.

**Failover.** The state topic is pre-populated with 10,000 model checkpoints (real
``ModelState`` envelopes of one k = 10 model with samples in its pools and monitor, under
10,000 names, spread over the 8 partitions). Two replicas start (each restores its half:
the restore reads the whole state topic); one is then killed with SIGKILL (no final checkpoint,
no leave-group: the survivor waits out the session timeout, the worst case). Reported: the time
from the kill until the survivor has the 8 partitions assigned and restored, split into the wait
for the rebalance and the restore itself, and the bytes the restore read.

Run alone: ``python -m tests.bench.bench_scale [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from daemon.kafka.clients import make_producer
from daemon.kafka.topics import TopicSpec, ensure_topics
from tests.bench.common import Table

K = 10
MODELS = 8
PARTITIONS = 8
EVENTS = 240_000          # 480,000 messages
QUICK_EVENTS = 8_000
REPEATS = 3
STATE_MODELS = 10_000
QUICK_STATE_MODELS = 200
HUGE_POOL = 10**9
SESSION_TIMEOUT_MS = 6000
# --quick (the smoke test in `make test`): a shorter session timeout, so the group joins (Tansu
# waits about half of it for members) and the failover (the survivor waits it out) take seconds
# less; the quick tables assert no timings
QUICK_SESSION_TIMEOUT_MS = 2000
TARGET = 1.6
REPO = Path(__file__).resolve().parents[2]
_HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its waited-for children: not used), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


# --------------------------------------------------------------------------- a replica


def _settings(spec: dict):
    from daemon.settings import load_settings

    return load_settings(
        None,
        kafka={"bootstrap_servers": spec["bootstrap"], "enable_idempotence": False,
               "create_topics": False, "topic_partitions": PARTITIONS,
               "group_id": spec["group"], "client_id": spec["name"],
               "session_timeout_ms": spec.get("session_timeout_ms", SESSION_TIMEOUT_MS),
               "heartbeat_interval_ms": 300,
               "fetch_max_wait_ms": 100, "topics": spec["topics"]},
        http={"host": "127.0.0.1", "port": spec["http_port"]},
        defaults={"k": K, "eps": 0.1, "p": "inf", "pool": HUGE_POOL, "mu_pool": HUGE_POOL, "recovery": "epochs"},
        state={"checkpoint_interval_seconds": 3600.0},
        shutdown_grace_seconds=10, max_models=STATE_MODELS + 100,
    )


async def replica(spec: dict) -> None:
    """One replica: a Daemon whose fetches wait for ``spec['go']``; reports to ``spec['out']``
    (JSON lines: assignments with their restore timings, then the consumption result)."""
    from daemon.service import Daemon

    out = open(spec["out"], "a", buffering=1)  # noqa: ASYNC230, SIM115 - a line-buffered report file for the life of the replica

    def report(**kw):
        out.write(json.dumps({"t": time.monotonic(), **kw}) + "\n")

    d = Daemon(_settings(spec))
    ends = {(t, int(p)): o for t, parts in spec["ends"].items() for p, o in parts.items()}
    go = Path(spec["go"])
    joined = {"n": 0}
    state = {"done": False}
    on_assigned, process = d.on_assigned, d.ingest.process

    async def timed_assigned(tps):
        t0 = time.monotonic()
        loaded = {}
        store_load = d.store.load_all

        async def counting_load():
            recs = await store_load()
            loaded["bytes"] = sum(len(k) + len(v) for k, v in recs.items())
            loaded["records"] = len(recs)
            loaded["t"] = time.monotonic() - t0
            return recs

        d.store.load_all = counting_load
        try:
            await on_assigned(tps)
        finally:
            d.store.load_all = store_load
        report(event="assigned", partitions=sorted({tp.partition for tp in tps}),
               seconds=time.monotonic() - t0, read_seconds=loaded.get("t"),
               bytes=loaded.get("bytes"), records=loaded.get("records"),
               models=len(d.registry.states()))

    def counting_process(tp, msgs):
        process(tp, msgs)
        if state["done"]:
            return
        mine = [(tp.topic, tp.partition) for tp in d.partitions.assigned]
        if mine and all((d.partitions.position(*key) or 0) >= ends.get(key, 0) for key in mine):
            state["done"] = True
            n = sum(st.samples_total for st in d.registry.states().values())
            report(event="done", joined=n, partitions=sorted({p for _, p in mine}))

    d.on_assigned, d.ingest.process = timed_assigned, counting_process
    task = asyncio.create_task(d.serve(install_signals=True))
    while d.clients.consumer is None and not task.done():
        await asyncio.sleep(0.05)
    if not task.done():
        getmany = d.clients.consumer.getmany

        async def gated(*a, **kw):
            if not go.exists():
                await asyncio.sleep(0.05)
                return {}
            return await getmany(*a, **kw)

        d.clients.consumer.getmany = gated
    del joined
    await task


# --------------------------------------------------------------------------- the harness


class Replicas:
    def __init__(self, spec: dict, n: int, workdir: Path):
        self.procs: list[subprocess.Popen] = []
        self.outs: list[Path] = []
        self.go = Path(spec["go"])
        from daemon.tools.embedded_broker import _free_port

        for i in range(n):
            s = dict(spec, name=f"r{i}", out=str(workdir / f"{spec['group']}-r{i}.jsonl"),
                     http_port=_free_port("127.0.0.1"))
            Path(s["out"]).unlink(missing_ok=True)
            self.outs.append(Path(s["out"]))
            log = open(workdir / f"{spec['group']}-r{i}.log", "wb")  # noqa: SIM115 - the child keeps it
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.bench.bench_scale", "--replica", json.dumps(s)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT))

    def events(self, i: int) -> list[dict]:
        try:
            return [json.loads(x) for x in self.outs[i].read_text().splitlines() if x]
        except FileNotFoundError:
            return []

    def last_assignment(self, i: int) -> dict | None:
        ev = [e for e in self.events(i) if e["event"] == "assigned"]
        return ev[-1] if ev else None

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(cond, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _settled(reps: Replicas) -> bool:
    parts = []
    for i in range(len(reps.procs)):
        a = reps.last_assignment(i)
        if a is None:
            return False
        parts += a["partitions"]
    return sorted(parts) == list(range(PARTITIONS))


def scale_run(broker, spec: dict, n: int, workdir: Path, expected: int) -> dict:
    """``n`` replicas consume the whole stream; joined samples/s and CPU shares."""
    spec = dict(spec, group=f"bench-scale-{uuid.uuid4().hex[:8]}",
                go=str(workdir / f"go-{uuid.uuid4().hex[:8]}"))
    reps = Replicas(spec, n, workdir)
    try:
        _wait(lambda: _settled(reps), 120, f"{n} replicas to settle")
        time.sleep(1.0)  # let a late rebalance show up
        _wait(lambda: _settled(reps), 60, f"{n} replicas to settle")
        pids = {"broker": broker.pid, **{f"replica {i}": p.pid for i, p in enumerate(reps.procs)},
                "harness": os.getpid()}
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.monotonic()
        Path(spec["go"]).touch()
        done = _wait(lambda: (lambda ev: ev if all(ev) else None)(  # noqa: PLC3002
            [next((e for e in reps.events(i) if e["event"] == "done"), None)
             for i in range(n)]), 600, "the stream to be consumed")
        t1 = max(e["t"] for e in done)
        cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
    finally:
        reps.stop()
    wall = t1 - t0
    joined = sum(e["joined"] for e in done)
    if joined < expected:
        raise RuntimeError(f"{n} replicas joined {joined} of {expected} samples")
    cores = os.cpu_count() or 1
    shares = {k: (cpu1[k] - cpu0[k]) / (wall * cores) for k in pids}
    return {"replicas": n, "wall": wall, "joined": joined, "rate": joined / wall,
            "shares": shares}


async def _prepare(bootstrap: str, names: dict, events: int) -> dict:
    from daemon.kafka.topics import COMPACT, TopicSpec, ensure_topics
    from daemon.tools.simulate.driver import simulate
    from daemon.tools.simulate.model import SyntheticModel
    from daemon.tools.simulate.traffic import TrafficGenerator

    specs = [TopicSpec(names["predictions"], PARTITIONS),
             TopicSpec(names["outcomes"], PARTITIONS),
             TopicSpec(names["binmaps"], 1, configs=COMPACT),
             TopicSpec(names["deadletter"], PARTITIONS)]
    await ensure_topics(bootstrap, specs)
    models = _models_on_distinct_partitions()
    gen = TrafficGenerator([SyntheticModel(m, k=K, T=0.5, scale=3.0, seed=i)
                            for i, m in enumerate(models)], events=events, delay=5.0, seed=7)
    await simulate(bootstrap, names, gen, idempotence=False, partitions=PARTITIONS,
                   create_topics=False, max_batch_size=1 << 20)
    from tests.support.daemon_harness import end_offsets

    ends = {t: await end_offsets(bootstrap, names[t]) for t in ("predictions", "outcomes")}
    return {names[t]: {str(p): o for p, o in v.items()} for t, v in ends.items()}


def _models_on_distinct_partitions() -> list[str]:
    """8 model ids whose keys land on 8 distinct partitions (Kafka's murmur2 partitioner)."""
    from aiokafka.partitioner import DefaultPartitioner

    part = DefaultPartitioner()
    seen: dict[int, str] = {}
    i = 0
    while len(seen) < PARTITIONS:
        m = f"scale-m{i}"
        seen.setdefault(part(m.encode(), list(range(PARTITIONS)), list(range(PARTITIONS))), m)
        i += 1
    return [seen[p] for p in range(PARTITIONS)]


def _envelopes(n_models: int) -> tuple[dict[str, bytes], int]:
    """``n_models`` checkpoint records (and 8 manifests): one real envelope, renamed."""
    import numpy as np
    import orjson

    from daemon.checkpoint.envelope import ENVELOPE_FORMAT
    from daemon.checkpoint.store import encode_value
    from daemon.model_state import ModelState
    from daemon.settings import Settings

    s = Settings(defaults={"k": K})
    st = ModelState.create("tmpl", K, s.model_settings("tmpl"), s.join)
    rng = np.random.default_rng(0)
    n = 200  # a small model: a live model's checkpoint is larger (docs/scaling.md)
    st.ingest([f"x{i}" for i in range(n)], rng.dirichlet(np.ones(K) * 0.3, size=n),
              rng.integers(0, K, size=n), np.arange(n, dtype=float))
    state = st.to_dict()
    recs = {}
    for i in range(n_models):
        m = f"state-m{i:05d}"
        state["model"] = m
        recs[f"model/{m}"] = encode_value(orjson.dumps({
            "format": ENVELOPE_FORMAT, "model": m, "partition": i % PARTITIONS,
            "state": state, "inflight": None, "prefitted": 0}))
    return recs, sum(len(k) + len(v) for k, v in recs.items())


async def _populate_state(bootstrap: str, topic: str, n_models: int) -> tuple[int, int]:
    from daemon.checkpoint.store import state_topic_config

    await ensure_topics(
        bootstrap, [TopicSpec(topic, 1, configs=state_topic_config(1 << 20))])
    recs, size = _envelopes(n_models)
    prod = make_producer(bootstrap, idempotence=False, client_id="bench-state",
                         max_request_size=1 << 20)
    await prod.start()
    try:
        futs = [await prod.send(topic, key=k.encode(), value=v) for k, v in recs.items()]
        for f in futs:
            await f
    finally:
        await prod.stop()
    return len(recs), size


def failover_run(broker, spec: dict, workdir: Path) -> dict:
    spec = dict(spec, group=f"bench-failover-{uuid.uuid4().hex[:8]}",
                go=str(workdir / f"go-{uuid.uuid4().hex[:8]}"))
    Path(spec["go"]).touch()  # consume at once (the stream was consumed before: small lag)
    reps = Replicas(spec, 2, workdir)
    try:
        _wait(lambda: _settled(reps), 300, "2 replicas to settle with the state topic")
        time.sleep(2.0)
        first = [reps.last_assignment(i) for i in range(2)]
        victim, survivor = reps.procs[1], 0
        before = len([e for e in reps.events(survivor) if e["event"] == "assigned"])
        t_kill = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        after = _wait(lambda: (lambda ev: ev[-1] if len(ev) > before  # noqa: PLC3002
                               and len(ev[-1]["partitions"]) == PARTITIONS else None)(
            [e for e in reps.events(survivor) if e["event"] == "assigned"]),
            120, "the survivor to take all partitions")
    finally:
        reps.stop()
    return {"initial": first, "after": after, "moved": after["t"] - t_kill,
            "rebalance_wait": after["t"] - after["seconds"] - t_kill}


def measure(quick: bool, log) -> dict:
    from daemon.tools.embedded_broker import EmbeddedBroker

    events = QUICK_EVENTS if quick else EVENTS
    repeats = 1 if quick else REPEATS
    n_state = QUICK_STATE_MODELS if quick else STATE_MODELS
    workdir = Path(tempfile.mkdtemp(prefix="lpcal-bench-scale-"))
    with EmbeddedBroker() as broker:
        prefix = f"bench.scale.{uuid.uuid4().hex[:6]}"
        names = {"predictions": f"{prefix}.preds", "outcomes": f"{prefix}.outs",
                 "binmaps": f"{prefix}.binmaps", "deadletter": f"{prefix}.dlq",
                 "state": f"{prefix}.state"}
        t = time.perf_counter()
        ends = asyncio.run(_prepare(broker.bootstrap, names, events))
        expected = events  # every prediction is joined (outcomes for all)
        log(f"[scale] produced {events:,} events over {MODELS} models in "
            f"{time.perf_counter() - t:.1f} s")
        spec = {"bootstrap": broker.bootstrap, "topics": names, "ends": ends,
                "session_timeout_ms": QUICK_SESSION_TIMEOUT_MS if quick else SESSION_TIMEOUT_MS}
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(repeats):
            for n in (1, 2):
                spec_n = dict(spec, topics=dict(names, state=f"{prefix}.state.{r}.{n}"))
                runs[n].append(scale_run(broker, spec_n, n, workdir, int(expected * 0.95)))
                x = runs[n][-1]
                log(f"[scale] rep {r}: {n} replica(s) {x['rate']:,.0f} joined/s in "
                    f"{x['wall']:.2f} s; CPU " + ", ".join(f"{k} {v:.0%}"
                                                           for k, v in x["shares"].items()))
        t = time.perf_counter()
        n_recs, size = asyncio.run(_populate_state(broker.bootstrap, names["state"], n_state))
        log(f"[scale] state topic: {n_recs:,} checkpoints, {size / 1e6:.1f} MB, written in "
            f"{time.perf_counter() - t:.1f} s")
        fo = failover_run(broker, dict(spec, topics=names), workdir)
        log(f"[scale] failover: partitions moved in {fo['moved']:.2f} s "
            f"(restore {fo['after']['seconds']:.2f} s)")
    return {"events": events, "runs": runs, "state_models": n_recs, "state_bytes": size,
            "failover": fo, "session_timeout_ms": spec["session_timeout_ms"]}


def tables(res: dict) -> list[Table]:
    runs = res["runs"]
    ratios = [b["rate"] / a["rate"] for a, b in zip(runs[1], runs[2])]
    ratio = statistics.median(ratios)
    scale = Table(
        f"Replica scaling: {MODELS} models on {PARTITIONS} partitions, 1 replica "
        "against 2 in one consumer group (one process each)",
        ["replicas", "joined samples/s (median)", "per repetition", "ratio to 1 replica",
         "CPU share: broker", "replicas (each)", "harness", f"target >= {TARGET}"],
        notes=[(f"{res['events']:,} events ({2 * res['events']:,} messages) pre-produced on the "
               "embedded Tansu broker, consumed with a fresh group per run; no fits (pools "
               "never fill). CPU share = utime + stime delta / (wall x cores), medians; "
               f"{os.cpu_count()} cores. Ratio: median of the per-pair ratios.")], key="scale")
    for n in (1, 2):
        rs = runs[n]
        share = {k: statistics.median(r["shares"][k] for r in rs) for k in rs[0]["shares"]}
        reps = [v for k, v in share.items() if k.startswith("replica")]
        scale.add(*[str(n), f"{statistics.median(r['rate'] for r in rs):,.0f}",
                       ", ".join(f"{r['rate']:,.0f}" for r in rs),
                       "1.00" if n == 1 else f"**{ratio:.2f}** ({', '.join(f'{x:.2f}' for x in ratios)})",
                       f"{share['broker']:.0%}", ", ".join(f"{x:.0%}" for x in reps),
                       f"{share['harness']:.0%}",
                       "" if n == 1 else ("yes" if ratio >= TARGET else "**NO**")])
    fo = res["failover"]
    a = fo["after"]
    fail = Table(
        f"Failover: one replica of 2 killed (SIGKILL), state topic of "
        f"{res['state_models']:,} model checkpoints",
        ["step", "value"],
        notes=[(f"Session timeout {res.get('session_timeout_ms', SESSION_TIMEOUT_MS)} ms, "
                "heartbeat 300 ms. The restore reads "
               "the whole state topic (every replica, every assignment), then restores the "
               "models of its partitions.")], key="failover")
    init = fo["initial"]
    fail.add(*["state topic (records, bytes as stored)",
                  f"{res['state_models']:,} records, {res['state_bytes'] / 1e6:.1f} MB"])
    fail.add(*["initial restore per replica (4 partitions each)",
                  ", ".join(f"{x['seconds']:.2f} s ({x['models']:,} models)" for x in init)])
    fail.add(*["kill -> survivor holds all 8 partitions, restored", f"**{fo['moved']:.2f} s**"])
    fail.add(*["of which waiting for the rebalance (session timeout, rejoin)",
                  f"{fo['rebalance_wait']:.2f} s"])
    fail.add(*["of which the restore (on_assigned)", f"{a['seconds']:.2f} s"])
    fail.add(*["of which reading the state topic",
                  f"{a['read_seconds']:.2f} s" if a.get("read_seconds") is not None else "–"])
    fail.add(*["bytes read by the restore (keys + values, decompressed)",
                  f"{(a.get('bytes') or 0) / 1e6:.1f} MB ({a.get('records') or 0:,} records)"])
    fail.add(*["models held by the survivor afterwards", f"{a['models']:,}"])
    return [scale, fail]


def run(quick: bool = False, log=None) -> list[Table]:
    import logging

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    return tables(measure(quick, log))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replica", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.replica:
        import logging

        logging.basicConfig(level=logging.WARNING)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(replica(json.loads(a.replica)))
        return 0
    for t in run(a.quick):
        print(t.to_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
