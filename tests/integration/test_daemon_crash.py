"""Crash safety of the daemon: ``lpcal serve`` as a SUBPROCESS with the Kafka state backend.

One scenario (module fixture) runs two daemons over the same input topics at the same time:

* ``crashy``: SIGKILLed twice while its pools fill (once mid-stream after some checkpoints,
  once right after a restart's restore), restarted each time, finally stopped with SIGTERM;
* ``reference``: runs uninterrupted (another group id and state topic), stopped with SIGTERM.

Input: two models, predictions in bursts with each burst's outcomes one burst later (so joins
are pending across the kills); pool targets are huge, so no fit happens and every joined
sample stays in the filling pools. Then both final checkpoints are read from the state topics
and compared: pools (``PoolSet.__eq__``), ``samples_total``, pending joins.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import pytest

from daemon import kafka_io
from tests.integration.daemon_harness import (
    EventProducer,
    SubprocessDaemon,
    TopicNames,
    create_topics,
    daemon_config,
    free_port,
    http_get,
    pool_diff,
    read_records,
    read_state,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

MODELS = {"ck-a": 3, "ck-b": 4}
BURSTS, PER_BURST, HELD_BACK = 10, 240, 40
BURST_PAUSE = 3.0  # between bursts until both kills happened: they happen while producing
EXPECTED = BURSTS * PER_BURST - HELD_BACK   # joined samples per model
GRACE = 10


async def _samples_of(d: SubprocessDaemon) -> dict[str, int]:
    import orjson

    status, body = await http_get(d.url, "/v1/models", timeout=2.0)
    assert status == 200, status
    return {e["model"]: e["samples_total"] for e in orjson.loads(body)["models"]}


async def _scenario(bootstrap: str, workdir) -> dict:
    prefix = f"it-crash-{uuid.uuid4().hex[:8]}"
    names = TopicNames.for_prefix(prefix)
    ref_names = names.with_state(f"{prefix}.state-ref")
    await create_topics(bootstrap, names, partitions=2)
    await kafka_io.ensure_topics(bootstrap, [kafka_io.TopicSpec(ref_names.state, 1,
                                                                configs=kafka_io.COMPACT)])
    common = {"partitions": 2, "defaults": {"pool": 10 ** 6, "mu_pool": 10 ** 6},
              "models": {m: {"k": k} for m, k in MODELS.items()},
              "state": {"checkpoint_interval_seconds": 0.5}, "shutdown_grace_seconds": GRACE}
    crashy = SubprocessDaemon(daemon_config(bootstrap, names, http_port=free_port(),
                                            group_id=f"{prefix}-crashy", **common),
                              workdir, "crashy")
    ref = SubprocessDaemon(daemon_config(bootstrap, ref_names, http_port=free_port(),
                                         group_id=f"{prefix}-ref", **common),
                           workdir, "reference")
    data = {m: synth_samples(BURSTS * PER_BURST, k, i, m)
            for i, (m, k) in enumerate(MODELS.items())}
    res: dict = {"events": [], "names": names, "ref_names": ref_names}
    t0 = time.monotonic()

    def note(what: str) -> None:
        res["events"].append(f"{time.monotonic() - t0:6.1f} s  {what}")

    try:
        crashy.start()
        ref.start()
        await asyncio.gather(crashy.wait_ready(40), ref.wait_ready(40))
        note("both daemons ready")
        bursts_done = 0
        kills_done = asyncio.Event()

        async def produce():
            nonlocal bursts_done
            async with EventProducer(bootstrap) as prod:
                for b in range(BURSTS + 1):
                    for m, (ids, probs, labels) in data.items():
                        lo, hi = b * PER_BURST, (b + 1) * PER_BURST
                        if b < BURSTS:
                            await prod.samples(names, m, ids[lo:hi], probs[lo:hi],
                                               labels[lo:hi], ts0=1e9 + lo, outcomes=False)
                        if b > 0:  # the previous burst's outcomes arrive now
                            plo, phi = lo - PER_BURST, hi - PER_BURST
                            if b == BURSTS:
                                phi -= HELD_BACK  # never answered: pending at the end
                            await prod.samples(names, m, ids[plo:phi], probs[plo:phi],
                                               labels[plo:phi], ts0=1e9 + plo,
                                               predictions=False)
                    await prod.flush()
                    bursts_done = b + 1
                    if b < BURSTS:  # slow while kills are pending, then catch up quickly
                        await asyncio.sleep(0.3 if kills_done.is_set() else BURST_PAUSE)
            note("production finished")

        producer = asyncio.create_task(produce())

        # kill 1: mid-stream, after the crashy daemon has checkpointed a few times
        async def filling():
            s = await _samples_of(crashy)
            return sum(s.values()) > 0 and bursts_done >= 2
        await wait_until(filling, 30, "crashy daemon filling pools", diag=crashy.logs)
        await asyncio.sleep(1.2)  # >= 2 checkpoint intervals
        note(f"SIGKILL 1 after burst {bursts_done}, samples {await _samples_of(crashy)}")
        res["kill1_rc"] = crashy.kill()
        crashy.start()
        # kill 2: as soon as the restarted daemon is ready (just after its restore)
        await crashy.wait_ready(40)
        await asyncio.sleep(0.3)
        note(f"SIGKILL 2 after burst {bursts_done}, samples {await _samples_of(crashy)}")
        res["kill2_rc"] = crashy.kill()
        kills_done.set()
        crashy.start()
        await asyncio.wait_for(producer, 60)
        await crashy.wait_ready(40)
        note("crashy ready after the second restart")

        want = {m: EXPECTED for m in MODELS}

        async def caught_up(d):
            return await _samples_of(d) == want
        await wait_until(lambda: caught_up(ref), 30, "reference joined everything",
                         diag=ref.logs)
        seen: dict = {"samples": None, "since": 0.0}

        async def settled():  # caught up, or no progress for 3 s (compared below in detail)
            s = await _samples_of(crashy)
            if s != seen["samples"]:
                seen.update(samples=s, since=time.monotonic())
            return s == want or time.monotonic() - seen["since"] >= 3.0
        await wait_until(settled, 30, "crashy joined everything or stopped progressing",
                         diag=crashy.logs)
        res["crashy_live"] = await _samples_of(crashy)
        note("SIGTERM both")
        res["crashy_term"] = await asyncio.to_thread(crashy.terminate, GRACE + 5)
        res["ref_term"] = await asyncio.to_thread(ref.terminate, GRACE + 5)
        note(f"stopped: crashy {res['crashy_term']}, reference {res['ref_term']}")
        res["crashy_state"] = await read_state(bootstrap, names.state)
        res["ref_state"] = await read_state(bootstrap, ref_names.state)
        ends: dict[tuple[str, int], int] = {}
        for topic in (names.predictions, names.outcomes):
            for m in await read_records(bootstrap, topic):
                ends[(topic, m.partition)] = max(ends.get((topic, m.partition), 0),
                                                 m.offset + 1)
        res["log_ends"] = ends
        res["logs"] = crashy.logs(1500) + "\n" + ref.logs(1500)
    except BaseException:
        crashy.stop_quietly()
        ref.stop_quietly()
        print("\n".join(res["events"]))
        print(crashy.logs())
        print(ref.logs())
        raise
    finally:
        crashy.stop_quietly()
        ref.stop_quietly()
    note("scenario done")
    print("\n".join(res["events"]))
    return res


@pytest.fixture(scope="module")
def scenario(broker, tmp_path_factory):
    return asyncio.run(_scenario(broker.bootstrap, tmp_path_factory.mktemp("crash")))


def _report(sc) -> str:
    return ("\n".join(sc["events"]) + f"\ncrashy: {sc['crashy_state'].summary()}"
            + f"\nreference: {sc['ref_state'].summary()}\n{sc['logs']}")


def test_sigkill_twice_while_filling_then_restart_equals_uninterrupted_run(scenario):
    sc = scenario
    assert sc["kill1_rc"] == -9 and sc["kill2_rc"] == -9
    got, ref = sc["crashy_state"], sc["ref_state"]
    assert set(ref.models) == set(MODELS), _report(sc)
    lost_doubled = {}
    for m in MODELS:
        assert m in got.models, f"no final checkpoint of {m}\n{_report(sc)}"
        g, r = got.models[m], ref.models[m]
        lost_doubled[m] = pool_diff(g.filling, r.filling)
        print(f"model {m}: samples lost/doubled vs the uninterrupted run = "
              f"{lost_doubled[m][0]}/{lost_doubled[m][1]}; samples_total "
              f"{g.samples_total} vs {r.samples_total}")
    for m in MODELS:
        g, r = got.models[m], ref.models[m]
        assert r.samples_total == EXPECTED, _report(sc)
        assert lost_doubled[m] == (0, 0), f"{m}: lost/doubled {lost_doubled[m]}\n{_report(sc)}"
        assert g.samples_total == r.samples_total == EXPECTED
        assert g.filling == r.filling and g.pools == r.pools
        assert g.filling.total == EXPECTED and not g.sealed
        assert g.join.pending(m) == r.join.pending(m) == HELD_BACK
        assert g.offsets == r.offsets
    assert sc["crashy_live"] == {m: EXPECTED for m in MODELS}


def test_sigterm_exits_zero_within_grace_and_final_checkpoint_covers_input(scenario):
    sc = scenario
    for who in ("ref_term", "crashy_term"):
        rc, seconds = sc[who]
        assert rc == 0, f"{who}: exit code {rc}\n{_report(sc)}"
        assert seconds < GRACE, f"{who}: took {seconds:.1f} s (grace {GRACE} s)"
    st, names, ends = sc["ref_state"], sc["names"], sc["log_ends"]
    assert set(st.models) == set(MODELS), _report(sc)
    for m, model_state in st.models.items():
        part = st.envelopes[m]["partition"]
        assert st.envelopes[m]["inflight"] is None
        for topic in (names.predictions, names.outcomes):
            assert model_state.offsets[topic][part] == ends[(topic, part)], (m, topic)
        assert model_state.samples_total == EXPECTED
        assert model_state.filling.total == EXPECTED
        assert model_state.join.pending(m) == HELD_BACK
    for (topic, part), end in ends.items():
        assert st.manifests[part]["offsets"][topic] == end, (topic, part, st.manifests)


def test_serve_with_invalid_settings_exits_2_naming_each_bad_field(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[defaults]\neps = 1.5\n[http]\nport = 0\n[kafka]\ngroup_id = ""\n')
    proc = subprocess.run([sys.executable, "-m", "lpcal.cli", "serve", "--config", str(cfg)],
                          check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("LPCAL_")})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    for field in ("defaults.eps", "http.port", "kafka.group_id"):
        assert field in proc.stderr, proc.stderr
