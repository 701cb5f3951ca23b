"""Retained memory does not grow with the messages consumed: a leak check that the allocator
does not blur.

The load soak (:mod:`tests.reliability.test_load_soak`) watches resident memory, which is what
a pod's limit sees. In a run of a minute that is a poor leak detector: glibc's heap keeps
settling for minutes (freed chunks it does not return, a mmap threshold that moves with the
largest array freed), so RSS moved by 2 % to 9 % between runs of the same code while the
daemon's accounted bytes (``lpcal_join_buffer_bytes``, ``lpcal_model_state_bytes``) were flat.
A leak of one small object per message (say 64 bytes at 4,000 messages/s for 40 s, 10 MB) hides
in that noise.

This test counts what the interpreter allocates instead (``tracemalloc``: Python objects and
numpy's buffers), in an in-process daemon on the embedded broker, for each recovery loop with
windows or pools small enough to be full after the warm-up, so that fits run all along. One
seeded two-model stream (k = 10 and k = 3, outcomes 5 s of event time after their predictions)
is produced in phases; at each phase boundary the producer waits until the daemon has consumed
every message sent, offered what it staged and finished its fits, then reads the traced size
(the least of three readings over a second, each after a full collection, so that a checkpoint
being encoded does not count; without the parts the checkpoint cache keeps, which are bounded
on their own and which tracemalloc counts at the JSON encoder's initial capacity, 260 KB for
3.9 KB of JSON):

* a warm-up phase (``WARMUP`` events) fills every bounded buffer: the join buffer's pending
  and recently joined ids, the sliding window or the pools;
* then ``PHASES`` phases of ``PHASE`` events each (100k messages). Between the boundary after
  the warm-up and the last, the traced size may grow by at most ``BYTES_PER_MESSAGE`` (40)
  per message. What stays is noise of up to about a MiB either way (arrays that grow by
  doubling, the monitor's buckets): -9.3 to +14.7 bytes per message in eleven runs. A leak of
  one 64-byte object per message, put in on purpose, measured 74 bytes per message (the
  object and its list slot) and failed it, naming its source line first.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
import tracemalloc
from pathlib import Path

import pytest

import daemon.tools.simulate as simulate_pkg
from daemon.model_state import CheckpointCache
from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import TrafficGenerator
from tests.support.daemon_harness import (
    build_settings,
    daemon_config,
    free_port,
    scrape_metrics,
    start_daemon,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODELS = (("retain-k10", 10), ("retain-k3", 3))
WARMUP = 40_000     # events (2 messages each)
PHASE = 25_000
PHASES = 2
BYTES_PER_MESSAGE = 40.0


async def _consumed(url: str) -> float:
    """``lpcal_events_consumed_total`` summed over its topics."""
    mx = await scrape_metrics(url)
    return sum(v for (name, _), v in mx.items() if name == "lpcal_events_consumed_total")


def _dumps_line(fn) -> tuple[str, int]:
    """(file, line) of the ``orjson.dumps`` call in ``fn``."""
    lines, first = inspect.getsourcelines(fn)
    return inspect.getsourcefile(fn), first + next(
        i for i, line in enumerate(lines) if "orjson.dumps(" in line)


#: not counted: the encoded parts the checkpoint cache keeps (bounded by its own byte limit,
#: ``CHECKPOINT_CACHE_BYTES`` per model, counted in the state's bytes; traced at the encoder's
#: initial capacity, not at their length: 3.9 KB of JSON is traced as 260 KB), and what the
#: test itself holds (its snapshots, its producer's generator)
_NOT_COUNTED = [tracemalloc.Filter(False, *_dumps_line(CheckpointCache.__call__)),
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, str(Path(simulate_pkg.__file__).parent / "*"))]

#: small windows and pools, so that they are full after the warm-up and fits run all along
RECOVERY = {
    "online": {"bucket_size": 250, "window_buckets": 8},
    "epochs": {"recovery": "epochs", "pool": 400, "mu_pool": 400, "warmup": 400, "holdout": 400},
}


@pytest.mark.parametrize("recovery", sorted(RECOVERY))
async def test_traced_memory_does_not_grow_with_messages(deployment, broker, tmp_path, figures,
                                                         recovery):
    names = await deployment.topics(2)
    settings = build_settings(daemon_config(
        broker.bootstrap, names, http_port=free_port(), partitions=2,
        defaults={**RECOVERY[recovery], "drift_false_alarm_rate": 0.0},
        models={m: {"k": k} for m, k in MODELS},
        join={"max_pending_per_model": 10_000}), tmp_path, "retain")
    total = WARMUP + PHASES * PHASE
    gen = TrafficGenerator([SyntheticModel(m, k, T=0.4, scale=4.0, seed=j)
                            for j, (m, k) in enumerate(MODELS)], total, event_rate=2000.0,
                           delay=5.0, seed=5, decimals=6, chunk=1000, id_digits=10)
    boundaries = [WARMUP + i * PHASE for i in range(PHASES + 1)]
    traced: list[tuple[int, int]] = []     # (messages consumed, traced bytes)
    snapshots: list[tracemalloc.Snapshot] = []

    tracemalloc.start()
    rd = await start_daemon(settings)
    try:
        async def quiescent(sent: int) -> bool:
            return await _consumed(rd.url) >= sent and not rd.daemon.registry.fitting()

        async def at_boundary(g: TrafficGenerator) -> None:
            if not boundaries or g.produced < boundaries[0]:
                return
            boundaries.pop(0)
            sent = g.valid_messages

            async def diag() -> str:
                return f"consumed {await _consumed(rd.url)}: {rd.describe()}"
            await wait_until(lambda: quiescent(sent), 60, f"{sent} messages consumed",
                             diag=diag)
            # staged slices are offered on an idle poll, and a fit may start on what they fill:
            # settled once the joined count holds for a second with no fit running
            joined = -1
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                now = sum(st.samples_total for st in rd.daemon.registry.states().values())
                if now == joined and not rd.daemon.registry.fitting():
                    break
                joined = now
                await asyncio.sleep(1.0)
            else:
                raise AssertionError(f"the daemon did not settle: {rd.describe()}")
            readings = []
            for _ in range(3):  # the least of 3 over a second: not a checkpoint being encoded
                gc.collect()
                snap = tracemalloc.take_snapshot().filter_traces(_NOT_COUNTED)
                readings.append((sum(st.size for st in snap.statistics("filename")), snap))
                await asyncio.sleep(0.3)
            size, snap = min(readings, key=lambda r: r[0])
            traced.append((sent, size))
            if len(traced) in (1, PHASES + 1):
                snapshots.append(snap)

        await simulate(broker.bootstrap, {"predictions": names.predictions,
                                          "outcomes": names.outcomes}, gen,
                       idempotence=False, create_topics=False, between_chunks=at_boundary,
                       flush_every=1000)  # few of the producer's own futures at a boundary
    finally:
        await rd.stop(30.0)
        tracemalloc.stop()

    (m0, b0), (m1, b1) = traced[0], traced[-1]
    per_message = (b1 - b0) / (m1 - m0)
    figures(f"retained memory [{recovery}]", {
        "messages measured (after the warm-up)": m1 - m0,
        "traced MiB at each boundary": [round(b / 2**20, 2) for _, b in traced],
        "growth after the warm-up (bytes per message)": round(per_message, 3),
    }, command="make test  # tests/reliability/test_retained_memory.py")
    grown = snapshots[-1].compare_to(snapshots[0], "lineno")[:10]
    assert per_message < BYTES_PER_MESSAGE, "\n".join(map(str, grown))
