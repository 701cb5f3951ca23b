"""Benchmark: ingest cost per message from 1 to 10,000 models, and memory per idle model.

Targets: the same stream of ``k = 10`` events spread over 1,000 models ingests at >= 0.7 of the
1-model rate, over 10,000 models at >= 0.5; at 1 model the daemon ingests at >= 0.75 of a raw
aiokafka reader (median of 10 interleaved pairs); an idle ``k = 10`` model takes at most 64 KiB
outside its configured pools and windows.

Setup (one process, one embedded Tansu broker, the readers of :mod:`tests.bench.bench_ingest`):
for each model count ``M`` a :class:`daemon.tools.simulate.traffic.TrafficGenerator` stream of
``EVENTS[M]`` events is produced once into its own predictions/outcomes topic pair (1 partition
each): event ``i`` belongs to model ``i mod M`` (``M`` seeded ``k = 10``
:class:`SyntheticModel` s), its outcome follows 5 s of event time later. Every stream has the
same event rate and delay, so only the number of models differs; its length lets a daemon run
last :data:`SPAN` seconds (15 s: one or two checkpoints, three staging ages) at that count's
rate (at 10,000 models, 60 events per model: the staged events of every model are offered by
age, not all at the stream's end, as in a replica that runs for hours). The daemons
run the shipped default, ``recovery = "online"`` (:data:`RECOVERY`); ``recovery = "epochs"``
(huge pools, no fit) is measured once at 1 and 1,000 models for comparison.

Each repetition reads, with fresh consumer groups: the first :data:`RAW_MESSAGES` of the
1-model stream with the raw reader
(``getmany(5000)`` + ``orjson.loads``, :func:`tests.bench.bench_ingest.raw_read`), then every
stream with a real in-process :class:`daemon.service.Daemon`
(:func:`tests.bench.bench_ingest.daemon_read`: parsing, join, pools, monitor, triggers, gauges,
Kafka checkpoints at the default 10 s interval; online fits and publishes as they come). Each
daemon runs with ``max_models`` raised to ``M`` and byte budgets raised so that every model
keeps the share one model has (``join.max_bytes_total = M x join.max_bytes_per_model``,
likewise ``state``): the runs differ in the number of models only, never in evictions, trimmed
windows or epochs sealed early. More raw/1-model pairs follow until the 1-model target has its
10 pairs. Fewer repetitions run at 100 models (the table states how many).

Steady state and admission apart: a daemon run is timed from the first batch after every model
of its stream was admitted (the warm-up, untimed, is the stream's first messages: about one
event per model) until the last message is processed and the events the daemon staged
(:mod:`daemon.staging`) are in their models' states; the raw reader is timed from the first
message to the last. The warm-up is reported apart as the **admission cost**: the process CPU
time of the warm-up minus what its messages cost at the run's steady-state CPU per message,
per admitted model.

Reported per model count: messages/s (median), the median of the
per-repetition ratios to the 1-model run and to the raw run of the same repetition, CPU time of
the whole process per message over the same span (all threads: aiokafka's fetch and decode,
the daemon's poll loop and its per-batch work; the raw reader's for comparison), CPU time of the
event-loop thread inside ``Ingest.process`` and the offers of staged events per message, the
admission cost per model, and the peak resident set size
during the run (``VmHWM``, reset before each run through ``/proc/self/clear_refs``) with its
growth over the resident size before the run (freed heap released first); one process runs
every reader, so RSS is indicative: the broker is another process and is not counted.

**Bytes per idle model** (:func:`idle_model_bytes`, also asserted by
``tests/daemon/test_idle_model_memory.py``): ``tracemalloc`` (which traces numpy's buffers
too) measures what creating ``n`` models adds to the heap, divided by ``n``, after one model
was created first (module-level caches and interned strings are not per model). Two levels:
the :class:`daemon.model_state.ModelState` alone (``ModelState.create``: empty pools, monitor,
join buffer, triggers), and the daemon's whole footprint of an admitted model
(``ModelRegistry.create``: the state, its registry slot and its counter series; its gauges
are read from the registry at scrape time, nothing is kept per model for them). No model holds a
sample, so nothing of this is in its configured pools or windows. A cross-check,
:func:`idle_model_rss`, takes the growth of the resident set over 2,000 admitted models
(allocator overhead included), measured before any daemon runs.

Run alone: ``python -m tests.bench.bench_models [--quick] [--events N] [--repeats R]
[--profile M [--profile-out PATH]]`` (``--profile M``: one more daemon run at ``M`` models under
cProfile, on its own stream when the run did not produce one (:func:`profile_events`); prints its
top entries, cumulative and own time, to stderr, not into the table; ``--profile-out``: also
dumps its pstats).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import logging
import math
import pstats
import statistics
import sys
import time
import uuid
from pathlib import Path

from daemon.ingest import STAGE_MAX_AGE
from tests.bench.bench_ingest import HUGE_POOL, K, Run, daemon_read, raw_read
from tests.bench.common import Table, yes_no

MODEL_COUNTS = (1, 100, 1_000, 10_000)
QUICK_MODEL_COUNTS = (1, 20)
#: events of each model count's stream: enough for most of :data:`SPAN` at the rates measured
#: from 100 models on (about 100k to 150k messages/s; at 10,000 models 60 predictions and 60
#: outcomes per model, so that its staged events are offered by age, paced, within the span: a
#: stream of 10 events per model ended before the first staging age and measured one offer of
#: every model at the stream's end); one model's stream lasts several seconds (it is never
#: staged and checkpoints one model: a shorter span holds what a long one does, and producing it
#: is what takes longest)
EVENTS = {1: 200_000, 100: 500_000, 1_000: 500_000, 10_000: 600_000}
#: seconds of a timed daemon run: one or two checkpoints (every 10 s) and three staging ages
#: (5 s) in each, whatever the model count (a stream that ends sooner ends it)
SPAN = 15.0
#: messages the raw reader reads of the 1-model stream (its rate is steady from the start)
RAW_MESSAGES = 400_000
#: the recovery mode measured: the shipped default; ``recovery = "epochs"`` (huge pools, no
#: fit) is measured once at :data:`EPOCHS_COUNTS` models for comparison
RECOVERY = "online"
EPOCHS_COUNTS = (1, 1_000)
#: seconds a daemon run may take (beyond it, the run reports the messages read until then)
RUN_LIMIT = 120.0
QUICK_EVENTS = 2_000
REPEATS = 3
#: fewer repetitions at 100 models keep the run within minutes (a 10,000-model run takes
#: seconds: its target ratio is a median of :data:`REPEATS` pairs, as at 1,000 models)
FEWER_REPEATS = {100: 2}
RAW_PAIRS = 10  # interleaved raw / 1-model pairs for the 1-model target
QUICK_REPEATS, QUICK_RAW_PAIRS = 1, 1
IDLE_MODELS, IDLE_RSS_MODELS = 200, 2000  # models measured per idle figure (heap, resident)
QUICK_IDLE = (50, 200)
TARGETS = {1_000: 0.7, 10_000: 0.5}  # ratio to the 1-model rate
TARGET_RAW = 0.75  # 1 model, ratio to raw aiokafka (median of RAW_PAIRS pairs)
TARGET_IDLE_BYTES = 64 * 1024  # an idle k = 10 model, outside its pools and windows
MIB = 1 << 20
# per-model shares one model has under the defaults (daemon.settings: JoinSettings,
# StateSettings max_bytes_per_model)
JOIN_PER_MODEL, STATE_PER_MODEL = 64 * MIB, 128 * MIB


def profile_events(models: int) -> int:
    """Events of the stream profiled at ``models`` models when the run did not produce one:
    the full benchmark's (:data:`EVENTS`), else enough for 4 predictions per model (every
    model must be admitted before the timed part begins)."""
    return EVENTS.get(models, max(4 * models, QUICK_EVENTS))


def model_id(i: int) -> str:
    return f"bench-m{i:05d}"


def extra_settings(models: int) -> dict:
    """``max_models`` and budgets for ``models`` models, each keeping one model's share
    (``max_models`` counts the configured models too: the ingest benchmark's own and the
    example of ``config/lpcal.toml``, which the daemon's settings read from the working
    directory; neither sends events). The totals cover the registry's planned model count
    (:class:`daemon.state_budget.BudgetShares`: at most ``ceil(models x STEP)`` while models
    are admitted), so the shares stay at ``max_bytes_per_model``."""
    from daemon.state_budget import STEP

    planned = math.ceil((models + 2) * STEP)
    return {"max_models": models + 2,
            "join": {"max_bytes_per_model": JOIN_PER_MODEL,
                     "max_bytes_total": max(planned, 6) * JOIN_PER_MODEL},
            "state": {"max_bytes_per_model": STATE_PER_MODEL,
                      "max_bytes_total": max(planned, 3) * STATE_PER_MODEL}}


def generator(models: int, events: int):
    """The stream of ``events`` k = 10 events over ``models`` models (seeded)."""
    from daemon.tools.simulate.model import SyntheticModel
    from daemon.tools.simulate.traffic import TrafficGenerator

    ms = [SyntheticModel(model_id(i), k=K, T=0.5, scale=3.0, seed=(1, i)) for i in range(models)]
    # large chunks: the generator loops over the models once per chunk
    return TrafficGenerator(ms, events=events, delay=5.0, seed=7, chunk=max(1000, events // 4))


async def produce(bootstrap: str, topics: dict[str, str], models: int, events: int) -> int:
    """Write the ``models``-model stream; return its message count."""
    from daemon.tools.simulate.driver import simulate

    rep = await simulate(bootstrap, topics, generator(models, events), idempotence=False,
                         partitions=1, create_topics=True, max_batch_size=1 << 20)
    return sum(rep.messages.values())


# --------------------------------------------------------------------------- resident memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


async def measured_daemon_read(bootstrap: str, topics: dict[str, str], expected: int,
                               models: int, profile: object | None = None,
                               recovery: str = RECOVERY, span: float | None = SPAN
                               ) -> tuple[Run, float | None, float | None]:
    """:func:`daemon_read` with ``models``' settings, ``recovery`` and the timed ``span``;
    returns the run, the peak RSS during it and its growth over the RSS before it (MiB; None
    where ``/proc`` does not tell)."""
    from daemon import heap

    gc.unfreeze()  # the previous daemon froze its objects: let them be collected
    gc.collect()
    heap.release_free_heap()
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    run = await daemon_read(bootstrap, topics, expected, HUGE_POOL, profile=profile,
                            extra=extra_settings(models), warm_models=models,
                            time_limit=RUN_LIMIT, partial=True, recovery=recovery, span=span)
    peak = _status_kib("VmHWM") if reset else None
    if peak is None or before is None:
        return run, None, None
    return run, peak / 1024, (peak - before) / 1024


# --------------------------------------------------------------------------- idle models


def idle_settings(models: int):
    """Settings with default model settings, ``max_models`` and budgets for ``models``."""
    from daemon.settings import load_settings

    return load_settings(None, **extra_settings(models))


def admit(registry, model: str, k: int):
    """``registry.create`` a model, as the daemon admits it (its per-model gauges are read from
    the registry at scrape time, :meth:`daemon.gauges.GaugeExporter.rows`: nothing kept per
    model for them)."""
    return registry.create(model, k, 0)


def idle_model_rss(k: int, n: int = 2000) -> float:
    """Resident bytes per idle admitted ``k``-class model (as :func:`admit`): the growth of
    ``VmRSS`` over ``n`` models, freed heap released before (a cross-check of
    :func:`idle_model_bytes` that includes the allocator's overhead); NaN without ``/proc``."""
    from daemon import heap
    from daemon.events import EventParser
    from daemon.metrics import DaemonMetrics
    from daemon.registry import ModelRegistry

    s = idle_settings(n + 1)
    registry = ModelRegistry(s, DaemonMetrics(max_models=n + 1), EventParser.from_settings(s))
    admit(registry, f"rss-{k}-first", k)
    gc.collect()
    heap.release_free_heap()
    before = _status_kib("VmRSS")
    for i in range(n):
        admit(registry, f"rss-{k}-{i:06d}", k)
    gc.collect()
    after = _status_kib("VmRSS")
    if before is None or after is None:
        return float("nan")
    return (after - before) * 1024 / n


def idle_model_bytes(k: int, n: int = 200) -> dict[str, float]:
    """Heap bytes per idle ``k``-class model (module docstring), measured with tracemalloc
    over ``n`` models: ``{"state": ModelState.create alone, "admitted": ModelRegistry.create
    with its slot and counter series}``. Default model settings (pools and windows empty)."""
    import tracemalloc

    from daemon.events import EventParser
    from daemon.metrics import DaemonMetrics
    from daemon.model_state import ModelState
    from daemon.registry import ModelRegistry

    s = idle_settings(2 * n + 2)
    metrics = DaemonMetrics(max_models=2 * n + 2)
    registry = ModelRegistry(s, metrics, EventParser.from_settings(s))

    def state(i: int) -> ModelState:
        m = f"idle-{k}-{i:06d}"
        return ModelState.create(m, k, s.model_settings(m), s.join)

    def admitted(i: int):
        return admit(registry, f"idle-{k}-{i:06d}", k)

    out: dict[str, float] = {}
    gc.collect()
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    try:
        for name, make, base in (("state", state, 0), ("admitted", admitted, n + 1)):
            keep = [make(base)]  # the first one allocates shared, lazily built objects
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            keep += [make(base + 1 + i) for i in range(n)]
            gc.collect()
            out[name] = (tracemalloc.get_traced_memory()[0] - before) / n
            del keep
    finally:
        if not was:
            tracemalloc.stop()
    return out


# --------------------------------------------------------------------------- the benchmark


async def measure(counts: tuple[int, ...], events: dict[int, int], repeats: dict[int, int],
                  raw_pairs: int,
                  log=print, profile_models: int | None = None,
                  idle: tuple[int, int] = (IDLE_MODELS, IDLE_RSS_MODELS),
                  span: float | None = SPAN, raw_messages: int | None = RAW_MESSAGES,
                  epochs_counts: tuple[int, ...] = EPOCHS_COUNTS,
                  profile_out: str | None = None) -> dict:
    """Every run of the benchmark: ``events`` and ``repeats`` per model count (``counts[0]``
    is the 1-model baseline, read ``max(its repeats, raw_pairs)`` times), each daemon run
    timed over ``span`` seconds with :data:`RECOVERY`, and once, after the first repetition,
    with ``recovery = "epochs"`` at ``epochs_counts``; the raw reader reads ``raw_messages``
    of the 1-model stream; ``idle``: the models measured by :func:`idle_model_bytes` and
    :func:`idle_model_rss`."""
    from daemon.tools.embedded_broker import EmbeddedBroker

    # first, while the heap has no free chunks of earlier runs to reuse (resident growth)
    idle_bytes = {k: {**idle_model_bytes(k, idle[0]), "rss": idle_model_rss(k, idle[1])}
                  for k in (10, 100)}
    with EmbeddedBroker() as broker:
        prefix = f"bench.models.{uuid.uuid4().hex[:6]}"
        topics: dict[int, dict[str, str]] = {}
        total: dict[int, int] = {}
        for m in counts:
            p = f"{prefix}.m{m}"
            topics[m] = {"predictions": f"{p}.preds", "outcomes": f"{p}.outs",
                         "binmaps": f"{p}.binmaps", "deadletter": f"{p}.dlq"}
            t = time.perf_counter()
            total[m] = await produce(broker.bootstrap, topics[m], m, events[m])
            log(f"[models] {m} models: produced {total[m]:,} messages in "
                f"{time.perf_counter() - t:.1f} s")
        one = counts[0]
        pair = [topics[one]["predictions"], topics[one]["outcomes"]]
        raws: list[Run] = []
        runs: dict[int, list[tuple[Run, float | None, float | None]]] = {m: [] for m in counts}
        epochs: dict[int, tuple[Run, float | None, float | None]] = {}
        raw_n = total[one] if raw_messages is None else min(total[one], raw_messages)
        for r in range(max(*repeats.values(), raw_pairs)):
            gc.unfreeze()  # the last daemon froze its objects: collect them before timing
            gc.collect()
            raws.append(await raw_read(broker.bootstrap, pair, raw_n))
            log(f"[models] rep {r}: raw {raws[-1].rate:,.0f} msg/s")
            for m in [c for c in counts if r < repeats[c] or c == one]:
                runs[m].append(await measured_daemon_read(broker.bootstrap, topics[m],
                                                          total[m], m))
                run = runs[m][-1][0]
                log(f"[models] rep {r}: {m} models {run.rate:,.0f} msg/s "
                    f"{'' if run.complete else f'(stopped at {RUN_LIMIT:g} s) '}"
                    f"({run.proc_cpu / run.messages * 1e6:.1f} us CPU/msg, admission "
                    f"{admission(run, m) * 1e6:,.0f} us CPU/model, peak RSS "
                    f"{_mib(runs[m][-1][1])} MiB)")
            if r == 0:
                for m in [c for c in epochs_counts if c in topics]:
                    epochs[m] = await measured_daemon_read(broker.bootstrap, topics[m],
                                                           total[m], m, recovery="epochs",
                                                           span=span)
                    log(f"[models] rep {r}: {m} models, epochs {epochs[m][0].rate:,.0f} msg/s")
        profile_text = None
        if profile_models is not None:
            m = profile_models
            if m not in topics:
                p = f"{prefix}.prof{m}"
                topics[m] = {"predictions": f"{p}.preds", "outcomes": f"{p}.outs",
                             "binmaps": f"{p}.binmaps", "deadletter": f"{p}.dlq"}
                total[m] = await produce(broker.bootstrap, topics[m], m, profile_events(m))
                log(f"[models] profile, {m} models: produced {total[m]:,} messages")
            prof = cProfile.Profile()
            run, _, _ = await measured_daemon_read(broker.bootstrap, topics[m], total[m], m,
                                                   profile=prof, span=SPAN)
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(30)
            if profile_out:
                stats.dump_stats(profile_out)
            profile_text = (f"cProfile of the daemon at {m} models ({total[m]:,} messages, "
                            f"{run.rate:,.0f} msg/s under the profiler)\n{buf.getvalue()}")
    return {"counts": counts, "events": events, "messages": total, "raw": raws, "runs": runs,
            "epochs": epochs, "span": span, "raw_messages": raw_n,
            "profile": profile_text,
            "idle_n": idle,
            "idle": idle_bytes}


def admission(run: Run, models: int) -> float:
    """CPU seconds per admitted model: the warm-up's process CPU time minus what its messages
    cost at the run's steady-state CPU per message, over the models (at least 0)."""
    steady = run.proc_cpu / run.messages
    return max(0.0, run.warm_cpu - run.warm_messages * steady) / models


def _us(x: float) -> str:
    return f"{x * 1e6:.2f}"


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def render(res: dict) -> list[Table]:
    counts, raws, runs = res["counts"], res["raw"], res["runs"]
    one = counts[0]
    base = [r for r, _, _ in runs[one]]
    tab = Table(
        f"Ingest from 1 to {counts[-1]:,} models, `recovery = \"{RECOVERY}\"` (the shipped "
        "default; k = 10 JSON events, real broker)",
        ["models", "events (messages)", "msgs/s (median)", "per repetition",
         "of 1-model rate", "of raw aiokafka", "CPU us / msg, process",
         "CPU us / msg, `Ingest`", "admission, CPU us / model (warm-up messages)",
         "peak RSS MiB (growth)", "target", "met"],
        key="models")
    tab.add("raw aiokafka reader (1-model stream)",
            f"({res['raw_messages']:,} of the 1-model stream)",
            f"{statistics.median(r.rate for r in raws):,.0f}",
            ", ".join(f"{r.rate:,.0f}" for r in raws), "", "1.00",
            _us(statistics.median(r.proc_cpu / r.messages for r in raws)), "", "", "", "",
            "")
    for m in counts:
        rs = [r for r, _, _ in runs[m]]
        to_one = [a.rate / b.rate for a, b in zip(rs, base)]
        to_raw = [a.rate / b.rate for a, b in zip(rs, raws)]
        peaks = [(p, g) for _, p, g in runs[m] if p is not None]
        rss = (f"{_mib(statistics.median(p for p, _ in peaks))} "
               f"({_mib(statistics.median(g for _, g in peaks))})" if peaks else "n/a")
        if m == one:
            target = f"of raw >= {TARGET_RAW} (median of {len(rs)} pairs)"
            ok = statistics.median(to_raw) >= TARGET_RAW
        elif m in TARGETS:
            target = f"of 1-model rate >= {TARGETS[m]}"
            ok = statistics.median(to_one) >= TARGETS[m]
        else:
            target, ok = "", None
        stopped = [r for r in rs if not r.complete]
        if stopped:
            tab.notes.append(
                f"{m:,} models: {len(stopped)} of {len(rs)} runs did not read the whole stream "
                f"within {RUN_LIMIT:g} s; their rate is over the messages read until then "
                f"({', '.join(f'{r.messages + r.warm_messages:,}' for r in stopped)} of "
                f"{res['messages'][m]:,}).")
        tab.add(f"{m:,}", f"{res['events'][m]:,} ({res['messages'][m]:,})",
                f"{statistics.median(r.rate for r in rs):,.0f}",
                ", ".join(f"{r.rate:,.0f}" for r in rs),
                f"**{statistics.median(to_one):.2f}**" if m != one else "1.00",
                f"{statistics.median(to_raw):.2f} ({min(to_raw):.2f} to {max(to_raw):.2f})",
                _us(statistics.median(r.proc_cpu / r.messages for r in rs)),
                _us(statistics.median(r.cpu / r.messages for r in rs)),
                f"{statistics.median(admission(r, m) for r in rs) * 1e6:,.0f} "
                f"({statistics.median(r.warm_messages for r in rs):,.0f})", rss, target,
                "" if ok is None else yes_no(ok))
    ep = res.get("epochs") or {}
    if one in ep:
        base_ep = ep[one][0]
        for m in sorted(ep):
            r, p, g = ep[m]
            tab.add(f"{m:,}, `recovery = \"epochs\"` (no fit)",
                    f"{res['events'][m]:,} ({res['messages'][m]:,})", f"{r.rate:,.0f}",
                    f"{r.rate:,.0f}", f"{r.rate / base_ep.rate:.2f} (of epochs, 1 model)",
                    f"{r.rate / raws[0].rate:.2f}", _us(r.proc_cpu / r.messages),
                    _us(r.cpu / r.messages),
                    f"{admission(r, m) * 1e6:,.0f} ({r.warm_messages:,.0f})",
                    "n/a" if p is None else f"{_mib(p)} ({_mib(g)})", "", "")
    lost = {f"{m:,} model{'s' if m != 1 else ''}": sum(r.join_lost for r, _, _ in runs[m])
            for m in counts}
    lost.update({f"{m:,} (epochs)": r.join_lost for m, (r, _, _) in ep.items()})
    tab.notes.append(
        "Events the join dropped (evicted or unmatched), summed over the daemon runs: "
        + "; ".join(f"{k}: {v:,}" for k, v in lost.items())
        + (". Every run joined the whole stream, so every repetition did the same work "
           "(`join.align_inputs` holds back the topic read ahead)." if not any(lost.values())
           else ". Runs that dropped events did less join, monitor and calibrator work."))
    tab.notes += [
        ("Each repetition reads raw, then the daemon at each model count in that order; "
         "repetitions per model count: "
         + ", ".join(f"{m:,} model{'s' if m != 1 else ''}: {len(runs[m])}" for m in counts)
         + " (the 1-model target is the median of all its raw / 1-model pairs). Ratios are "
         "medians of the per-repetition ratios (to the 1-model and raw runs of the same "
         "repetition)."),
        ("Each daemon has `max_models` raised to its model count and byte budgets raised so every model "
         f"keeps one model's share ({JOIN_PER_MODEL // MIB} MiB of join buffer, "
         f"{STATE_PER_MODEL // MIB} MiB of state; the totals cover the registry's planned "
         "model count, `daemon.state_budget.BudgetShares`): the runs differ in the number of "
         "models only."),
        ("Steady state: a daemon run is timed from the first batch after every model was "
         "admitted (the warm-up before it, about one event per model, is untimed), with a "
         "first checkpoint run right then and its time taken out of the timing (a process's "
         "first checkpoint encodes every model's state from scratch; wall seconds, median: "
         + ", ".join(f"{m:,} model{'s' if m != 1 else ''} "
                     f"{statistics.median(r.first_checkpoint for r, _, _ in runs[m]):.2f} s"
                     for m in counts)
         + ") until the span ends (or the last message is processed), every staged event is "
         "in its model's state and the sums still deferred (monitors' waiting rows, "
         "online calibrators' deferred rows) are summed; "
         "the later checkpoints come at their paced times (at least "
         "`state.checkpoint_interval_seconds` apart, and at most "
         "`state.checkpoint_max_cpu_share` = 0.1 of the time), inside the timing; where the "
         "pacing puts none inside the span (a long first checkpoint), the steady state is at "
         "least 1 / 1.1 of the rate shown. The messages column counts the whole stream, the "
         "rates the timed part. Admission: the warm-up's process CPU time (to the last "
         "admission, the first checkpoint excluded) minus its messages at the run's "
         "steady-state CPU per message, per admitted model (median; the warm-up's messages in "
         "parentheses)."),
        ("Timed span (median): "
         + ", ".join(f"{m:,} model{'s' if m != 1 else ''}: "
                     f"{statistics.median(r.seconds for r, _, _ in runs[m]):.1f} s"
                     for m in counts)
         + (f"; each run is timed for {res['span']:g} s (or to its stream's end, if sooner)"
            if res.get("span") else "")
         + f". Staged events wait {STAGE_MAX_AGE:g} s (`daemon.ingest.STAGE_MAX_AGE`), longer "
         "where staging pacing raises the age (`join.staging_max_cpu_share`, at most "
         "`join.staging_max_wait_seconds`; `lpcal_staging_age_seconds`), and checkpoints run "
         "every 10 s (`state.checkpoint_interval_seconds`):"
         + (f" a span of {res['span']:g} s holds one or two checkpoints and three staging "
            "ages; the staged events at its end are offered inside the timing. The streams "
            "have the same event rate and delay; their lengths differ so that each lasts the "
            "span from 100 models on; one model's stream ends sooner (a model alone is never "
            "staged and its checkpoint is one model's: a short span holds what a long one "
            "does)." if res.get("span") else " a span of a few seconds holds fewer of both than "
            "a long run; the staged events at its end are offered inside the timing.")),
        (f"Recovery: every model count runs the shipped default, `recovery = \"{RECOVERY}\"` "
         "(warm-up, sliding window, champion/challenger, fits and publishes as they come); "
         "the `epochs` rows (huge pools: no fit) ran once, in the first repetition, their "
         "ratios against the epochs 1-model run and the first raw run."),
        ("CPU per message: CPU time of the whole process (all threads) over the timed part, "
         "over its messages; `Ingest`: the event-loop thread inside `Ingest.process` and the "
         "offers of staged events (parse, join, pools, monitor), without the per-batch work "
         "after it (triggers, gauges) and the checkpoints."),
        ("Peak RSS: `VmHWM` of the benchmark process during the run (reset before it), and its "
         "growth over the resident size before it; the broker runs in another process."),
    ]
    idle = res["idle"]
    mem = Table("Memory per idle model (no samples; default model settings)",
                ["k", "bytes per idle model: `ModelState.create`",
                 "bytes per idle model: admitted (registry slot and counter series)",
                 "resident bytes per admitted model (RSS growth)",
                 "target (k = 10)", "met"], key="models_idle")
    for k in sorted(idle):
        a = idle[k]["admitted"]
        mem.add(k, f"{idle[k]['state']:,.0f}", f"{a:,.0f} ({a / 1024:.1f} KiB)",
                f"{idle[k]['rss']:,.0f}",
                f"<= {TARGET_IDLE_BYTES // 1024} KiB" if k == 10 else "",
                yes_no(a <= TARGET_IDLE_BYTES) if k == 10 else "")
    mem.notes += [
        (f"Heap bytes: tracemalloc over {res['idle_n'][0]:,} models created after a first "
         "one (`tests.bench.bench_models.idle_model_bytes`, asserted by "
         "`tests/daemon/test_idle_model_memory.py`); the target applies to the admitted model. "
         f"Resident bytes: growth of `VmRSS` over {res['idle_n'][1]:,} admitted models "
         "(allocator overhead included; measured first, in a fresh process; indicative)."),
    ]
    if 10 in idle and 100 in idle and abs(idle[100]["state"] / idle[10]["state"] - 1) < 0.1:
        mem.notes.append("An idle model allocates nothing k-wide (its sums, tables and window "
                         "come with its first samples): k = 100 takes about what k = 10 takes.")
    sizing = sizing_table(res)
    return [tab, mem] if sizing is None else [tab, mem, sizing]


#: the deployment docs/scaling.md sizes: models, messages per second (events: predictions and
#: outcomes), headroom factor on a replica's measured rate (fits, checkpoints, bursts)
PLAN_MODELS, PLAN_RATE, PLAN_HEADROOM = 10_000, 1_000_000, 2.0


def sizing_table(res: dict) -> Table | None:
    """Replicas and partitions for :data:`PLAN_MODELS` models at :data:`PLAN_RATE` messages/s,
    from the rates measured in this run at each model count (None unless 100+ models ran)."""
    counts = [m for m in res["counts"] if m >= 100]
    if not counts:
        return None
    tab = Table(f"Sizing {PLAN_MODELS:,} models at {PLAN_RATE:,} messages/s from this run",
                ["models per replica M", "msgs/s of one replica at M models, R_M (median)",
                 f"replicas to hold the models, {PLAN_MODELS:,} / M",
                 f"replicas for the rate, ceil({PLAN_HEADROOM:g} x {PLAN_RATE:,} / R_M)",
                 "replicas needed (the larger)", "input partitions (power of 2 >= 2 x replicas)",
                 "peak RSS at M models, MiB (growth)"], key="models_sizing")
    for m in counts:
        rs = [r for r, _, _ in res["runs"][m]]
        rate = statistics.median(r.rate for r in rs)
        hold = math.ceil(PLAN_MODELS / m)
        need_rate = math.ceil(PLAN_HEADROOM * PLAN_RATE / max(rate, 1e-9))
        need = max(hold, need_rate)
        parts = 1 << max(0, math.ceil(math.log2(2 * need)))
        peaks = [(p, g) for _, p, g in res["runs"][m] if p is not None]
        rss = (f"{_mib(statistics.median(p for p, _ in peaks))} "
               f"({_mib(statistics.median(g for _, g in peaks))})" if peaks else "n/a")
        tab.add(f"{m:,}", f"{rate:,.0f}", f"{hold:,}", f"{need_rate:,}", f"**{need:,}**",
                f"{parts:,}", rss)
    tab.notes += [
        (f"Each row assumes the {PLAN_MODELS:,} models spread evenly, M per replica, and that "
         "a replica at M models sustains the rate measured here at M models (its messages "
         f"spread over its models as in this benchmark), divided by {PLAN_HEADROOM:g} for "
         "fits, checkpoints and bursts; the replicas needed are the larger of the two counts "
         "(a replica holding fewer than M models is at least as fast, so the count is an upper "
         "bound at that density). Partitions: at least one per replica (the range assignor), "
         "doubled so replicas can be added without repartitioning (keys map models to "
         "partitions)."),
        ("Memory: the peak RSS of the benchmark process at M models (the raw reader's buffers "
         "included; the broker is another process) plus, under load, up to the state and join "
         "budgets (`state.max_bytes_total`, `join.max_bytes_total`), which are per replica, "
         "whatever the model count."),
    ]
    return tab


def run(quick: bool = False, events: int | None = None, repeats: int | None = None,
        log=None, profile_models: int | None = None, profile_out: str | None = None
        ) -> list[Table]:
    """Run the benchmark; return its tables (quick: two tiny model counts, one repetition)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    logging.getLogger("lpcal.daemon").setLevel(logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    counts = QUICK_MODEL_COUNTS if quick else MODEL_COUNTS
    ev = {m: events or (QUICK_EVENTS if quick else EVENTS[m]) for m in counts}
    reps = {m: repeats or (QUICK_REPEATS if quick else REPEATS) for m in counts}
    if not quick and repeats is None:
        reps.update(FEWER_REPEATS)
    res = asyncio.run(measure(counts, ev, reps,
                              QUICK_RAW_PAIRS if quick else RAW_PAIRS, log, profile_models,
                              QUICK_IDLE if quick else (IDLE_MODELS, IDLE_RSS_MODELS),
                              span=None if quick else SPAN,
                              raw_messages=None if quick else RAW_MESSAGES,
                              epochs_counts=counts if quick else EPOCHS_COUNTS,
                              profile_out=profile_out))
    if res["profile"]:
        log(res["profile"])
    return render(res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--profile", type=int, default=None, metavar="M",
                    help="one more daemon run at M models under cProfile (stderr)")
    ap.add_argument("--profile-out", default=None, metavar="PATH",
                    help="with --profile: also dump the profile's pstats to PATH")
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    a = ap.parse_args(argv)
    text = "\n".join(t.to_markdown() for t in run(a.quick, a.events, a.repeats,
                                                   profile_models=a.profile,
                                                   profile_out=a.profile_out))
    print(text)
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
