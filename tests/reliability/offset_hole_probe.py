"""Reproduce the embedded broker's skipped batches with a plain aiokafka consumer (no lpcal code
on the read path unless ``--guard refetch``). See :mod:`daemon.offset_gaps`.

Per trial: a fresh 2-partition topic on the embedded Tansu broker, a group consumer reading it
live while ``--producers`` producers write ``--records`` records each at ``--rate`` records/s;
then a read from the start. Reports what the live consumer received against what the topic
holds, the holes it met (its offsets jumping), and with ``--guard refetch`` what
:class:`daemon.offset_gaps.OffsetGapGuard` did (seek back to a hole until it fills).

The fault needs a loaded machine. Measured on 2 cores (2026-11-26) with two producers of 20,000
records at 1,800/s: under three CPU hogs (``python -c 'while True: pass'``), 1 trial of 8
skipped a batch of 34 records (the consumer got offset 4265, then 4300), which the read from the
start returned; with less load, 0 of 34 trials.

    python -m tests.reliability.offset_hole_probe --trials 8 [--guard refetch]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

from aiokafka import TopicPartition

from daemon.kafka.clients import make_consumer, make_producer
from daemon.kafka.topics import TopicSpec, ensure_topics
from daemon.offset_gaps import OffsetGapGuard
from daemon.tools.embedded_broker import EmbeddedBroker
from tests.support.daemon_harness import read_records


async def _produce(bootstrap: str, topic: str, tag: str, n: int, rate: float) -> None:
    producer = make_producer(bootstrap, idempotence=False, linger_ms=5)
    await producer.start()
    futs, t0 = [], time.monotonic()
    try:
        for i in range(n):
            futs.append(await producer.send(topic, key=f"m{i % 3}".encode(),
                                            value=f"{tag}-{i}".encode()))
            if i % 50 == 49 and (ahead := t0 + i / rate - time.monotonic()) > 0:
                await asyncio.sleep(ahead)
        await asyncio.gather(*futs)
    finally:
        await producer.stop()


async def trial(bootstrap: str, topic: str, args: argparse.Namespace) -> dict:
    await ensure_topics(bootstrap, [TopicSpec(topic, partitions=2)])
    consumer = make_consumer(bootstrap, topic, group_id=f"probe-{topic}",
                             session_timeout_ms=2000, heartbeat_interval_ms=200)
    await consumer.start()
    guard = OffsetGapGuard(refetch=True) if args.guard == "refetch" else None
    seen: set[tuple[int, int]] = set()
    expected: dict[TopicPartition, int] = {}
    holes, stats, stop = [], collections.Counter(), asyncio.Event()

    async def read_live() -> None:
        while not stop.is_set():
            for tp, msgs in (await consumer.getmany(timeout_ms=250, max_records=5000)).items():
                if guard is not None and msgs:
                    v = guard.check(tp, expected.get(tp), msgs[0].offset, msgs[-1].offset,
                                    len(msgs), lambda m=msgs: [r.offset for r in m],
                                    time.monotonic())
                    stats["filled"] += v.filled
                    stats["skipped"] += v.skipped
                    if v.seek is not None:
                        consumer.seek(tp, v.seek)
                        stats["seeks"] += 1
                        msgs = msgs[:v.keep]
                for m in msgs:
                    want = expected.get(tp)
                    if want is not None and m.offset != want:
                        holes.append((tp.partition, want, m.offset))
                    expected[tp] = m.offset + 1
                    seen.add((m.partition, m.offset))

    reader = asyncio.create_task(read_live())
    try:
        await asyncio.sleep(2.0)  # joined the group
        await asyncio.gather(*[_produce(bootstrap, topic, chr(65 + i), args.records, args.rate)
                               for i in range(args.producers)])
        await asyncio.sleep(args.settle)
    finally:
        stop.set()
        await reader
        await consumer.stop()
    stored = {(r.partition, r.offset) for r in await read_records(bootstrap, topic, timeout=60)}
    return {"stored": len(stored), "received live": len(seen & stored),
            "missed": len(stored - seen), "holes met live": holes[:5], "guard": dict(stats)}


async def main(args: argparse.Namespace) -> int:
    bad = 0
    with EmbeddedBroker() as broker:
        for i in range(args.trials):
            r = await trial(broker.bootstrap, f"probe{i}", args)
            bad += r["missed"] > 0
            print(f"trial {i}: " + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    print(f"{bad} of {args.trials} trials missed records")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--records", type=int, default=20_000, help="per producer")
    ap.add_argument("--rate", type=float, default=1800.0, help="records/s per producer")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--settle", type=float, default=6.0, help="seconds after the last send")
    ap.add_argument("--guard", choices=("none", "refetch"), default="none")
    raise SystemExit(asyncio.run(main(ap.parse_args())))
