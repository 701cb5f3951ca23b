"""Crash safety: SIGKILL the daemon at random moments, restart it, and compare the
end state with an uninterrupted run over the same input.

Two subprocess daemons consume the SAME input topics at the same time: ``ref`` (never killed)
and ``crash`` (SIGKILLed ``kills`` times at seeded random moments, 1-8 s after each (re)start,
so some kills land during startup or restore; restarted at once). Each has its own consumer
group, state topic, bin-map topic and dead-letter topic. Input: seeded
:class:`daemon.tools.simulate.traffic.TrafficGenerator` streams of 3 models, produced at a fixed rate so the
kills land while they flow; every event joins exactly once:

* ``crash-a`` (k=3), ``crash-b`` (k=4): complete samples (vector and label in one event). The
  sequence of their joined samples is the input order, so the epochs (sealed at the exact
  sample that fills the pools) must be identical to the uninterrupted run's: filling and
  sealed pools (``PoolSet ==``; differences counted as pool cells lost/doubled), the raw
  monitor's window sums (counts exact, float sums to 1e-9: they are added per fetched batch),
  and every bin-map version 1..V with the same content (fits are seeded by (model, version));
* ``crash-c`` (k=5): predictions and outcomes on the two topics, i.e. the join path and its
  checkpointed pending joins. Its joined samples come out in an order that depends on how the
  fetches of the two topics interleave, which differs between ANY two runs, so its epoch
  boundaries (hence pools and maps) are not comparable; it is checked for exact
  ``samples_total``, no pending joins left but the 40 held back (below), and versions 1..V
  without gaps.

For all: ``samples_total`` (lost / doubled), no fit left in flight in the final envelopes,
no dead letters, exit 0 within the grace period at SIGTERM, and final partition manifests
that cover the input logs to their ends. One kill lands right
after a restart's restore. After the stream, 40 predictions of ``crash-c`` never get their
outcome: both final checkpoints hold exactly those pending. (This test absorbed the SIGKILL
scenario of the former ``tests/integration/test_daemon_crash.py``.) Both daemons
are stopped with SIGTERM and compared through what they wrote to Kafka (``model/<id>``
envelopes of the state topics, all records of the bin-map topics).
Drift refills are off (``drift_threshold`` 100, ``drift_false_alarm_rate`` 0): when a drift fires depends on batching.
Short: 60,000 joined samples, 5 kills. Long (LPCAL_SOAK=1): 1,000,002 samples, 100 kills.

The test runs twice: with ``recovery = "epochs"`` (the fixed epochs above) and with
``recovery = "online"`` (the default, :mod:`lpcal.online`: small buckets and a short fit delay,
so the kills land while maps are published, fits are requested and the stream is blocked on
them). For the online models the epoch comparisons are replaced by the calibrator's: the final
checkpoints of ``crash-a`` and ``crash-b`` hold the same calibrator state as the reference's
(sample count, window sums, warm-up, live map, tests, shadow challenger, fit request; the
decisions depend on the input order only), and every bin-map version 1..V has the reference's
content. A crash between publishing and checkpointing leaves the topic ahead of the checkpoint:
the replay publishes the same maps again, which are installed, not sent
(:meth:`daemon.model_state.ModelState.adopt_published`). For every model of both modes, no
version is published with two contents, and the versions on the bin-map topic, in topic order,
never go down.

The first bug this test found (``on_assigned`` processed new partitions before restoring their
state) is fixed in ``daemon/service.py``: new partitions stay paused until restored.
It also caught the embedded broker skipping a record batch under load (the never-killed
reference daemon missed 115 samples of ``crash-a`` in CI): the daemons here run with
``kafka.offset_gaps = "refetch"`` (see :mod:`daemon.offset_gaps`), and the figures report the
holes each one met.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time

import numpy as np
import orjson
import pytest

from daemon.monitor import WindowMonitor
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from lpcal.binmap import BinMap
from tests.support.daemon_harness import (
    EventProducer,
    TopicNames,
    binmap_contents,
    create_topics,
    daemon_config,
    free_port,
    http_get,
    pool_diff,
    read_records,
    read_state,
    scrape_metrics,
    synth_samples,
)
from tests.support.reliability import FastDaemon, run_names, wait_settled

pytestmark = [
    pytest.mark.integration, pytest.mark.soak,
]

SAMPLE_MODELS = (("crash-a", 3), ("crash-b", 4))  # complete samples: deterministic order
JOIN_MODELS = (("crash-c", 5),)                    # predictions + outcomes: joined
MODELS = SAMPLE_MODELS + JOIN_MODELS
HELD_MODEL, HELD_BACK = "crash-c", 40   # predictions that never get an outcome
GRACE = 30                              # shutdown_grace_seconds of both daemons


#: the online loop, fast: decisions every 250 samples, buckets of 500, fits due 250 samples
#: after their request (the stream blocks on them), Algorithm 2 from the defaults' pools
ONLINE = {"recovery": "online", "bucket_size": 500, "window_buckets": 16, "fit_delay": 250,
          "warmup_tol": 0.1}


def _cfg(broker, names, pool, recovery):
    fit = ({"recovery": "epochs", "pool": pool, "mu_pool": pool, "warmup": pool,
            "holdout": pool} if recovery == "epochs" else ONLINE)
    return daemon_config(
        broker.bootstrap, names, http_port=free_port(), partitions=2,
        defaults={**fit, "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
        models={m: {"k": k} for m, k in MODELS},
        state={"checkpoint_interval_seconds": 0.5}, shutdown_grace_seconds=GRACE)


def _raw_monitor_diff(cenv: dict, renv: dict) -> str | None:
    """Compare the raw predictor's window sums: counts exactly, float sums to 1e-9 (they are
    accumulated per fetched batch, and batches differ between runs: float addition order)."""
    mons = [WindowMonitor.from_dict(e["state"]["monitor"]) for e in (cenv, renv)]
    if [m.total_samples for m in mons] != [mons[1].total_samples] * 2:
        return f"total samples {[m.total_samples for m in mons]}"
    if [list(m.buckets) for m in mons] != [list(mons[1].buckets)] * 2:
        return "bucket ids differ"
    for bid in mons[1].buckets:
        a, b = (m.buckets[bid].sums("raw", m.k) for m in mons)
        if (a.n, a.correct) != (b.n, b.correct):
            return f"bucket {bid}: n/correct differ"
        ia, ib = np.argsort(a.hashes), np.argsort(b.hashes)
        if not (np.array_equal(a.hashes[ia], b.hashes[ib])
                and np.array_equal(a.counts[ia], b.counts[ib])):
            return f"bucket {bid}: bins or bin counts differ"
        for x, y in ((a.s[ia], b.s[ib]), (a.q[ia], b.q[ib]), (a.gap, b.gap),
                     (a.brier, b.brier)):
            if not np.allclose(x, y, rtol=1e-9, atol=1e-9):
                return f"bucket {bid}: sums differ beyond rounding"
    return None


def _daemon_warnings(*daemons: FastDaemon, limit: int = 40) -> str:
    """The WARNING/ERROR lines and group (re)assignments of the daemons' logs, for the
    message of a failed assertion (the logs themselves are in the test's tmp_path)."""
    keep = (" WARNING ", " ERROR ", "Setting newly assigned", "Revoking previously")
    out = []
    for d in daemons:
        lines = [ln[:300] for ln in d.all_logs().splitlines() if any(k in ln for k in keep)]
        out.append(f"\n--- {d.name}: {len(lines)} warning/assignment lines, last {limit}:")
        out.extend(lines[-limit:])
    return "\n".join(out)


def _without_stamps(x):
    """``x`` (a calibrator's checkpoint) with the bin maps it embeds parsed, without what
    differs between two runs making the same decisions (``created_at``, ``checksum``), without
    a fit request's result (whether it is back at the final checkpoint is timing) and without
    the byte budget (``max_bytes``: the model's share of ``state.max_bytes_total``, which
    depends on how many models the replica owned when it was set; here far above the window,
    so it drops no bucket)."""
    if isinstance(x, dict):
        return {k: _without_stamps(v) for k, v in x.items()
                if k not in ("created_at", "checksum", "result", "max_bytes")}
    if isinstance(x, list):
        return [_without_stamps(v) for v in x]
    if isinstance(x, str) and x.startswith("{"):
        with contextlib.suppress(ValueError):
            return _without_stamps(orjson.loads(x))
    return x


def _same(a, b, path: str = "") -> str | None:
    """Where ``a`` and ``b`` (JSON values) differ, floats to 1e-9 relative; None if nowhere."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a.keys() ^ b.keys())}"
        return next((w for k in a if (w := _same(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} / {len(b)}"
        return next((w for i, (x, y) in enumerate(zip(a, b))
                     if (w := _same(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, float) and isinstance(b, float):
        return None if np.isclose(a, b, rtol=1e-9, atol=1e-12) else f"{path}: {a} / {b}"
    return None if a == b else f"{path}: {str(a)[:60]} / {str(b)[:60]}"


async def _topic_order(bootstrap: str, topic: str) -> dict[str, list[int]]:
    """{model: the versions of its records on the bin-map topic, in offset order}."""
    recs = sorted(await read_records(bootstrap, topic, timeout=60),
                  key=lambda r: (r.partition, r.offset))
    out: dict[str, list[int]] = {}
    for rec in recs:
        out.setdefault(rec.key.decode(), []).append(BinMap.from_json(rec.value).version)
    return out


async def _versions(bootstrap: str, topic: str) -> dict[str, dict[int, dict]]:
    """{model: {version: bin map content without created_at/checksum}}, the last record of
    each version (see :func:`binmap_contents`)."""
    return {m: {v: bodies[-1] for v, bodies in by_version.items()}
            for m, by_version in (await binmap_contents(bootstrap, topic)).items()}


@pytest.mark.parametrize("recovery", ["epochs", "online"])
async def test_sigkill_at_random_moments_loses_and_doubles_nothing(
        broker, topic_prefix, tmp_path, soak, figures, recovery):
    n_events = 1_000_002 if soak else 60_000
    kills = 100 if soak else 5
    pool = 3000 if soak else 300
    gap = (1.0, 12.0) if soak else (1.0, 8.0)           # seconds from a (re)start to its kill
    stream_seconds = kills * sum(gap) / 2               # the stream spans the kills
    rng = random.Random(20261125)

    base = TopicNames.for_prefix(topic_prefix)
    ref_names, crash_names = run_names(base, "ref"), run_names(base, "crash")
    await create_topics(broker.bootstrap, ref_names, partitions=2)
    await create_topics(broker.bootstrap, crash_names, partitions=2)
    ref = FastDaemon(_cfg(broker, ref_names, pool, recovery), tmp_path, name="ref")
    crash = FastDaemon(_cfg(broker, crash_names, pool, recovery), tmp_path, name="crash")
    n_sample = n_events * len(SAMPLE_MODELS) // len(MODELS)
    n_join = n_events - n_sample
    per_model = {m: len(range(j, n_sample, len(SAMPLE_MODELS)))
                 for j, (m, _) in enumerate(SAMPLE_MODELS)}
    per_model.update({m: len(range(j, n_join, len(JOIN_MODELS)))
                      for j, (m, _) in enumerate(JOIN_MODELS)})
    topics = {"predictions": base.predictions, "outcomes": base.outcomes}
    try:
        ref.start(), crash.start()
        await ref.wait_ready(60), await crash.wait_ready(60)
        gens = [TrafficGenerator([SyntheticModel(m, k, T=0.4, scale=4.0, seed=11 + j)
                                  for j, (m, k) in enumerate(models)], n, event_rate=200.0,
                                 delay=5.0, seed=5 + len(models), decimals=6, sample_frac=frac)
                for models, n, frac in ((SAMPLE_MODELS, n_sample, 1.0),
                                        (JOIN_MODELS, n_join, 0.0))]
        producers = [asyncio.create_task(simulate(
            broker.bootstrap, topics, g, rate=g.events / stream_seconds, idempotence=False,
            create_topics=False)) for g in gens]

        ready_at_kill = 0
        t0 = time.monotonic()
        kills_done = 0
        unexpected: list[str] = []  # exits not caused by our SIGKILL (restarted like a pod)

        def restart_if_dead() -> None:
            if not crash.alive():
                tail = crash.all_logs().strip().splitlines()[-1:]
                unexpected.append(f"incarnation {crash.incarnation}: exit "
                                  f"{crash.proc.returncode}: {tail[0][:160] if tail else ''}")
                crash.returncodes.append(crash.proc.returncode)
                crash.start()

        for i in range(kills):
            if i == 1:  # right after a restart's restore: the restored state is checkpointed
                await crash.wait_ready(60)  # once more and read back by the next restart
                await asyncio.sleep(0.3)
            else:
                await asyncio.sleep(rng.uniform(*gap))
            if not crash.alive():
                restart_if_dead()
                continue
            with contextlib.suppress(Exception):  # not serving HTTP yet
                st, _ = await http_get(crash.url, "/readyz", timeout=0.5)
                ready_at_kill += st == 200
            assert crash.kill() == -9
            kills_done += 1
            crash.start()
        reports = await asyncio.wait_for(asyncio.gather(*producers),
                                         timeout=stream_seconds * 3 + 120)
        assert reports[0].counts["sample"] == n_sample and reports[1].counts["sample"] == 0
        assert all(r.counts["malformed"] == r.counts["orphan"] == 0 for r in reports)
        kill_phase = time.monotonic() - t0
        # predictions of the joined model that never get an outcome: pending at the end, in
        # both runs' final checkpoints (pending joins survive the kills and SIGTERM)
        held_ids, held_probs, _ = synth_samples(HELD_BACK, dict(JOIN_MODELS)[HELD_MODEL], 9,
                                               f"{HELD_MODEL}-held")
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(base, HELD_MODEL, held_ids, held_probs, [0] * HELD_BACK,
                               ts0=time.time() - 30, outcomes=False)
            await prod.flush()

        restart_if_dead()
        await ref.wait_ready(60)
        await crash.wait_ready(60)
        quiet = 20.0 if soak else 4.0  # a daemon that lost samples never reaches per_model
        settled = {name: {m: e["samples_total"] for m, e in (await wait_settled(
                       d.url, per_model, 900 if soak else 90, quiet=quiet)).items()}
                   for name, d in (("ref", ref), ("crash", crash))}
        holes = {}  # input offset holes each daemon met (this incarnation; daemon/offset_gaps)
        for name, d in (("ref", ref), ("crash", crash)):
            mx = await scrape_metrics(d.url)
            holes[name] = {res: sum(v for (n, lab), v in mx.items()
                                    if n == "lpcal_input_offset_gaps_total"
                                    and dict(lab)["resolution"] == res)
                           for res in ("filled", "skipped")}
        await asyncio.sleep(1.0)
        rc_ref, term_ref = ref.terminate(60)
        rc_crash, term_crash = crash.terminate(60)
        log_ends: dict[tuple[str, int], int] = {}
        for topic in (base.predictions, base.outcomes):
            for rec in await read_records(broker.bootstrap, topic, timeout=60):
                key = (topic, rec.partition)
                log_ends[key] = max(log_ends.get(key, 0), rec.offset + 1)

        big = 600 if soak else 60  # the state topics hold every checkpoint (lazy compaction)
        ref_state = await read_state(broker.bootstrap, ref_names.state, timeout=big)
        crash_state = await read_state(broker.bootstrap, crash_names.state, timeout=big)
        ref_maps = await _versions(broker.bootstrap, ref_names.binmaps)
        crash_maps = await _versions(broker.bootstrap, crash_names.binmaps)
        bodies = {name: await binmap_contents(broker.bootstrap, n.binmaps)
                  for name, n in (("ref", ref_names), ("crash", crash_names))}
        order = {name: await _topic_order(broker.bootstrap, n.binmaps)
                 for name, n in (("ref", ref_names), ("crash", crash_names))}
        dlq = [len(await read_records(broker.bootstrap, n.deadletter)) for n in
               (ref_names, crash_names)]
    finally:
        ref.stop_quietly()
        crash.stop_quietly()

    lost = doubled = pool_lost = pool_doubled = online_runs = 0
    mismatches, join_epochs, calibrators = [], {}, {}
    for m, n in per_model.items():
        r, c = ref_state.models[m], crash_state.models[m]
        if r.samples_total != n:
            mismatches.append(f"{m}: reference run has {r.samples_total} samples, not {n} "
                              f"(crash run {c.samples_total}; /v1/models when settled "
                              f"{settled})")
        lost += max(0, n - c.samples_total)
        doubled += max(0, c.samples_total - n)
        renv, cenv = ref_state.envelopes[m], crash_state.envelopes[m]
        for label, env in (("crash", cenv), ("ref", renv)):
            if env["inflight"]:
                mismatches.append(f"{m}: {label} run ended with a fit in flight")
        held = HELD_BACK if m == HELD_MODEL else 0
        if c.join.pending(m) != held or r.join.pending(m) != held:
            mismatches.append(f"{m}: events left unjoined ({c.join.pending(m)} / "
                              f"{r.join.pending(m)}); join stats crash {c.join.stats(m)}, "
                              f"reference {r.join.stats(m)}; offsets crash {c.offsets}, "
                              f"reference {r.offsets}")
        for label, st, env in (("crash", c, cenv), ("ref", r, renv)):
            # a model's record is rewritten only when it changed, so its offsets may stop
            # before the log ends (the partition's manifest, checked below, covers them)
            part = env["partition"]
            for topic in (base.predictions, base.outcomes):
                got = st.offsets.get(topic, {}).get(part, 0)
                if got > log_ends.get((topic, part), 0):
                    mismatches.append(f"{m}: {label} final checkpoint covers {topic}[{part}] "
                                      f"to {got}, beyond the log's end "
                                      f"{log_ends.get((topic, part))}")
        for label in ("crash", "ref"):
            seq = order[label].get(m, [])
            if any(b < a for a, b in itertools.pairwise(seq)):
                mismatches.append(f"{m}: {label} versions go down on the topic: {seq}")
            twice = [v for v, bs in bodies[label].get(m, {}).items()
                     if any(b != bs[0] for b in bs)]
            if twice:
                mismatches.append(f"{m}: {label} published versions {twice} with two contents")
        rv, cv = ref_maps.get(m, {}), crash_maps.get(m, {})
        if sorted(rv) != list(range(1, len(rv) + 1)) or not rv:
            mismatches.append(f"{m}: reference versions {sorted(rv)}")
        if sorted(cv) != list(range(1, len(cv) + 1)):
            mismatches.append(f"{m}: versions {sorted(cv)} are not 1..V")
        if m not in dict(SAMPLE_MODELS):
            # joined samples come out in an order that depends on how fetches of the two
            # topics interleave, so epoch boundaries differ between ANY two runs
            join_epochs[m] = (c.fill_epoch, r.fill_epoch)
            continue
        if recovery == "online":
            online_runs += 1
            for label, st in (("crash", c), ("ref", r)):
                if st.online is None or st.backlog is not None:
                    mismatches.append(f"{m}: {label} run ended without a calibrator or with "
                                      "rows waiting")
            why = _same(_without_stamps(cenv["state"]["online"]),
                        _without_stamps(renv["state"]["online"]))
            if why:
                mismatches.append(f"{m}: calibrator differs from the reference at {why}")
            calibrators[m] = (c.online.n_seen, c.online.version) if c.online else None
        else:
            pairs = [("filling", c.filling, r.filling)]
            pairs += [(f"sealed[{i}]", cs, rs) for i, ((_, cs), (_, rs)) in
                      enumerate(zip(c.sealed, r.sealed))]
            for what, got, want in pairs:
                lo, do = pool_diff(got, want)
                pool_lost += lo
                pool_doubled += do
                if got != want:
                    mismatches.append(f"{m}: {what} pools differ (lost {lo}, doubled {do})")
            if len(c.sealed) != len(r.sealed) or c.fill_epoch != r.fill_epoch:
                mismatches.append(f"{m}: epochs {c.fill_epoch}/{len(c.sealed)} sealed vs "
                                  f"{r.fill_epoch}/{len(r.sealed)}")
        why = _raw_monitor_diff(cenv, renv)
        if why:
            mismatches.append(f"{m}: raw monitor: {why}")
        if sorted(cv) != sorted(rv):
            mismatches.append(f"{m}: versions {sorted(cv)} vs reference {sorted(rv)}")
        for v in sorted(set(cv) & set(rv)):
            if cv[v] != rv[v]:
                mismatches.append(f"{m}: bin map version {v} differs from the reference")

    if recovery == "online":  # the online loop published and fitted during the kills
        for m, got in calibrators.items():
            if got is None or got[1] < 2:
                mismatches.append(f"{m}: the online loop published {got} (sample count, "
                                  "version): too little to compare")
    figures(f"crash safety ({recovery})", {
        "recovery": recovery,
        "joined samples (input)": n_events, "models": len(MODELS), "SIGKILLs": kills_done,
        "kills while /readyz was 200": ready_at_kill,
        "kill phase seconds": round(kill_phase, 1),
        "samples lost (samples_total)": lost, "samples doubled (samples_total)": doubled,
        "pool cells lost vs reference (sample models)": pool_lost,
        "pool cells doubled vs reference (sample models)": pool_doubled,
        "bin-map versions per model (crash / reference)":
            {m: (max(crash_maps.get(m, {0: 0})), max(ref_maps.get(m, {0: 0}))) for m in per_model},
        "joined model: epochs (crash / reference)": join_epochs,
        "online calibrators compared (sample models)": online_runs,
        "online calibrators (samples, version), crash run": calibrators,
        "dead letters (ref, crash)": tuple(dlq),
        "input offset holes filled/skipped (ref, crash's last incarnation)": holes,
        "exit codes at SIGTERM (ref, crash)": (rc_ref, rc_crash),
        "seconds to exit at SIGTERM (ref, crash)": (round(term_ref, 1), round(term_crash, 1)),
        "predictions never answered, pending in both final checkpoints": HELD_BACK,
        "unexpected daemon exits (restarted)": len(unexpected),
        "unexpected exit causes": unexpected[:5],
        "mismatches": len(mismatches), "first mismatches": mismatches[:6],
    })
    for label, state in (("crash", crash_state), ("ref", ref_state)):
        for (topic, part), end in log_ends.items():
            got = state.manifests.get(part, {}).get("offsets", {}).get(topic)
            if got != end:
                mismatches.append(f"{label}: manifest of partition {part} has {topic} at "
                                  f"{got}, the log ends at {end}")
    context = "\n".join(mismatches) + _daemon_warnings(ref, crash)
    assert rc_ref == 0 and rc_crash == 0, (rc_ref, rc_crash)
    assert max(term_ref, term_crash) < GRACE, (term_ref, term_crash)
    assert not unexpected, unexpected
    assert dlq == [0, 0]
    assert (lost, doubled, pool_lost, pool_doubled) == (0, 0, 0, 0), context
    assert not mismatches, context
