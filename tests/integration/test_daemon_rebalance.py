"""Two daemon replicas in one consumer group (in-process, real broker): they split the models
by input partition and hand them over across rebalances without losing or doubling samples.

Input topics have 4 partitions; 6 models whose keys (model ids) cover all 4 partitions. Pool
targets are huge, so every joined sample stays in the filling pools and ``samples_total`` of a
model's owner must equal the joined samples produced for it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiokafka.partitioner import murmur2

from tests.support.daemon_harness import (
    EventProducer,
    RunningDaemon,
    TopicNames,
    read_state,
    start_daemon,
    synth_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

PARTITIONS = 4
MODELS = [f"rb-m{i}" for i in range(6)]
PER_PHASE, HELD_BACK = 250, 30


def partition_of(model: str) -> int:
    """aiokafka's default partitioner (murmur2 of the key), as the producer uses it."""
    return (murmur2(model.encode()) & 0x7FFFFFFF) % PARTITIONS


def _owned(rd: RunningDaemon) -> dict[str, int]:
    return {m: st.samples_total for m, st in rd.daemon.registry.states().items()}


def _parts(rd: RunningDaemon) -> set[tuple[str, int]]:
    return {(tp.topic, tp.partition) for tp in rd.daemon.partitions.assigned}


class Traffic:
    """Phase-wise input. A phase sends its predictions and, lagging ``HELD_BACK`` ids behind,
    outcomes (so the last ``HELD_BACK`` of a phase stay pending joins into the next phase,
    across the rebalance), in ``chunks`` small bursts ``pause`` seconds apart."""

    def __init__(self, names: TopicNames):
        self.names = names
        self.data = {m: synth_samples(3 * PER_PHASE, 3, i, m) for i, m in enumerate(MODELS)}
        self.joined = {m: 0 for m in MODELS}
        self.phase = 0

    async def send_phase(self, bootstrap: str, last: bool = False, chunks: int = 1,
                         pause: float = 0.0) -> None:
        lo, hi = self.phase * PER_PHASE, (self.phase + 1) * PER_PHASE
        o_lo, o_hi = max(0, lo - HELD_BACK), (hi if last else hi - HELD_BACK)
        self.phase += 1
        p_cuts = np.linspace(lo, hi, chunks + 1).astype(int)
        o_cuts = np.linspace(o_lo, o_hi, chunks + 1).astype(int)
        async with EventProducer(bootstrap) as prod:
            for c in range(chunks):
                for m, (ids, probs, labels) in self.data.items():
                    a, b = p_cuts[c], p_cuts[c + 1]
                    await prod.samples(self.names, m, ids[a:b], probs[a:b], labels[a:b],
                                       ts0=1e9 + a, outcomes=False)
                for m, (ids, probs, labels) in self.data.items():
                    a, b = o_cuts[c], o_cuts[c + 1]
                    await prod.samples(self.names, m, ids[a:b], probs[a:b], labels[a:b],
                                       ts0=1e9 + a, predictions=False)
                    self.joined[m] += int(b - a)
                await prod.flush()
                if pause:
                    await asyncio.sleep(pause)


async def _run(deployment, *, quiescent: bool) -> None:
    names = await deployment.topics(PARTITIONS)
    assert {partition_of(m) for m in MODELS} == set(range(PARTITIONS))
    group = f"{names.predictions}-group"
    settings = [deployment.settings(deployment.config(
        group_id=group, partitions=PARTITIONS, defaults={"pool": 10 ** 6, "mu_pool": 10 ** 6, "recovery": "epochs"},
        state={"checkpoint_interval_seconds": 1.0}), f"replica-{r}") for r in "AB"]
    traffic = Traffic(names)
    all_parts = {(t, p) for t in (names.predictions, names.outcomes) for p in range(PARTITIONS)}
    a = await start_daemon(settings[0])
    b: RunningDaemon | None = None
    try:
        def diag():
            return "\n".join([f"joined produced: {traffic.joined}", f"A: {a.describe()}",
                              f"B: {b.describe() if b else None}"])

        def totals_match(*replicas: RunningDaemon):
            seen: dict[str, int] = {}
            for rd in replicas:
                for m, n in _owned(rd).items():
                    assert m not in seen, f"model {m} owned by two replicas"
                    seen[m] = n
            return seen == traffic.joined

        # ---- phase 1 with A alone, then B joins (rebalance)
        if quiescent:
            await traffic.send_phase(deployment.bootstrap)
            await wait_until(lambda: totals_match(a), 20, "A consumed phase 1", diag=diag)
            await asyncio.sleep(1.5)  # a checkpoint with everything
            b = await start_daemon(settings[1])
        else:  # B joins while phase 1 streams in (~5 s of small bursts)
            sending = asyncio.create_task(traffic.send_phase(deployment.bootstrap, chunks=25,
                                                             pause=0.2))
            await asyncio.sleep(1.0)
            b = await start_daemon(settings[1])
            await asyncio.wait_for(sending, 30)

        def split():
            pa, pb = _parts(a), _parts(b)
            return a.daemon.ready and b.daemon.ready and pa and pb and not pa & pb \
                and pa | pb == all_parts
        await wait_until(split, 30, "A and B split the partitions", diag=diag)
        await wait_until(lambda: totals_match(a, b), 20, "phase 1 joined across A and B",
                         diag=diag)
        # ---- phase 2 while both run: the models are split between A and B
        await traffic.send_phase(deployment.bootstrap)
        await wait_until(lambda: totals_match(a, b), 20, "phase 2 joined across A and B",
                         diag=diag)
        owned_a, owned_b = set(_owned(a)), set(_owned(b))
        assert owned_a and owned_b and not owned_a & owned_b, diag()
        assert owned_a | owned_b == set(MODELS), diag()
        for rd, owned in ((a, owned_a), (b, owned_b)):
            assert {partition_of(m) for m in owned} == {p for _, p in _parts(rd)}, diag()
            assert all(rd.daemon.registry.slots[m].partition == partition_of(m) for m in owned)

        # ---- A leaves (rebalance back to B), phase 3 goes to B alone
        if quiescent:
            await asyncio.sleep(1.5)
            await a.stop(30)
        else:  # A leaves while phase 3 streams in
            sending = asyncio.create_task(traffic.send_phase(deployment.bootstrap, last=True,
                                                             chunks=25, pause=0.2))
            await asyncio.sleep(1.0)
            await a.stop(30)
            await asyncio.wait_for(sending, 30)
        await wait_until(lambda: _parts(b) == all_parts and b.daemon.ready, 30,
                         "B owns every partition after A left", diag=diag)
        if quiescent:
            await traffic.send_phase(deployment.bootstrap, last=True)
        await wait_until(lambda: totals_match(b), 20, "phase 3 joined by B", diag=diag)
        assert set(_owned(b)) == set(MODELS)
        for m in MODELS:
            st = b.daemon.registry.slots[m].state
            assert st.samples_total == traffic.joined[m] == 3 * PER_PHASE
            assert st.filling.total == 3 * PER_PHASE and st.join.pending(m) == 0
        await b.stop(30)
        final = await read_state(deployment.bootstrap, names.state)
        for m in MODELS:
            assert final.models[m].samples_total == 3 * PER_PHASE, final.summary()
            assert final.envelopes[m]["partition"] == partition_of(m)
    finally:
        for rd in (a, b):
            if rd is not None and not rd.task.done():
                rd.daemon.stopping.set()
                try:
                    await asyncio.wait_for(rd.task, 20)
                except BaseException:  # noqa: BLE001 - report the test's own failure
                    rd.task.cancel()


async def test_two_replicas_split_models_and_hand_over_when_idle(deployment):
    """Rebalances while no input is pending: a replica joins, then one leaves."""
    await _run(deployment, quiescent=True)


async def test_two_replicas_split_models_and_hand_over_under_load(deployment):
    """Rebalances while input is pending: B joins right after phase 1 is produced, and
    phase 3 is produced while A is leaving."""
    await _run(deployment, quiescent=False)
