"""Memory is bounded in bytes: the worst traffic we can generate keeps a
subprocess daemon's peak resident memory (``VmHWM``) within its budgets.

Traffic, all at once, on the embedded broker:

* models whose ``k`` is learned, each sent predictions with ``k = max_k = 1000`` and 256-byte
  ids that never get an outcome (the costliest pending entry: ~17 KB with its row);
* outcomes that never match, and predictions of a model whose first vector has k = 100,000
  (``k_too_large``: before the cap, 0.8 MB per pending prediction);
* events under thousands of distinct model names (``unknown_model`` beyond ``max_models``;
  they grew an unbounded policy cache by 127 MiB per 200,000 names);
* predictions *with* outcomes of models with k = 1000 whose every sample falls in its own bin
  (nine classes at level 1 of 10): without the state budget of :mod:`daemon.state_budget`,
  ~32 KB of window and ~5 KB of pools and held-out sums per sample (320 MB for a 10,000-sample
  window).

Short version (``make test``): join budgets lowered to 96 MiB in all, 32 MiB per model, the
state budget to 32 MiB, and traffic whose unbounded footprint (~420 MB of rows, ~200 MB of
window) is several times that; asserted: peak RSS growth below the budgets plus 160 MiB for the
process's own buffers. Long version (``make soak``): the shipped defaults (384 MiB of join
buffers, 320 MiB of state) and traffic worth ~1.3 GB of rows and ~640 MB of windows unbounded;
asserted: peak RSS below the shipped pod limit (``deploy/k8s/base``, 1 GiB).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.kafka.clients import make_producer
from tests.support.daemon_harness import (
    TopicNames,
    metric_value,
    scrape_metrics,
    wait_until,
)
from tests.support.reliability import FastDaemon, rss_kib

pytestmark = [pytest.mark.integration, pytest.mark.soak]

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
K = 1000


def _pod_memory_limit() -> int:
    text = (ROOT / "deploy/k8s/base/deployment.yaml").read_text()
    m = re.search(r"limits:\s*\n(?:\s+\w+: .*\n)*?\s+memory: (\d+)Gi", text)
    assert m, "deploy/k8s/base/deployment.yaml has no memory limit in Gi"
    return int(m.group(1)) << 30


async def _invalid(url: str, reason: str, at_least: int) -> bool:
    mx = await scrape_metrics(url)
    return metric_value(mx, "lpcal_events_invalid_total", default=0.0,
                        reason=reason) >= at_least


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _prediction(model: str, eid: str, k: int, hot: int, ts: float) -> bytes:
    probs = ["0"] * k
    probs[hot] = "1"
    return (f'{{"model":"{model}","id":"{eid}","ts":{ts},"probs":[' + ",".join(probs)
            + "]}").encode()


_LEVEL1 = "0.1005"
_FILLER = f"{(1 - 9 * 0.1005) / (K - 9):.4e}"


def _dense_pair(model: str, eid: str, rng, ts: float) -> tuple[bytes, bytes]:
    """A prediction whose level set at lambda = 10 is new (nine random classes at level 1)
    and its outcome (one of the nine)."""
    top = rng.choice(K, size=9, replace=False)
    probs = [_FILLER] * K
    for j in top:
        probs[j] = _LEVEL1
    pred = (f'{{"model":"{model}","id":"{eid}","ts":{ts},"probs":[' + ",".join(probs)
            + "]}").encode()
    out = f'{{"model":"{model}","id":"{eid}","ts":{ts},"label":{int(top[0])}}}'.encode()
    return pred, out


async def _produce(bootstrap: str, names: TopicNames, models: int, per_model: int,
                   names_count: int, admitted=None, dense: tuple[int, int] = (0, 0)) -> int:
    """The worst traffic of the module docstring; returns the number of messages sent."""
    prod = make_producer(bootstrap, idempotence=False, client_id="memory-bound",
                         max_request_size=2 * MIB, linger_ms=20)
    await prod.start()
    sent = 0
    ts = time.time() - 60
    try:
        futs = []

        async def send(topic, value, model):
            nonlocal sent
            futs.append(await prod.send(topic, value=value, key=model.encode()))
            sent += 1
            if len(futs) >= 2000:
                for f in futs:
                    await f
                futs.clear()

        for j in range(3):  # a learned k of 100,000: rejected, nothing kept
            await send(names.predictions, _prediction("huge", f"h{j}", 100_000, 0, ts), "huge")
        for f in futs:
            await f
        futs.clear()
        if admitted is not None:
            await admitted()  # before the distinct names below fill max_models
        for i in range(per_model):
            for m in range(models):
                eid = f"m{m}-{i}-".ljust(256, "x")
                await send(names.predictions, _prediction(f"wide-{m}", eid, K, i % K, ts),
                           f"wide-{m}")
            await send(names.outcomes, (f'{{"model":"wide-0","id":"{"o" * 200}-{i}",'
                                        f'"ts":{ts},"label":1}}').encode(), "wide-0")
        rng = np.random.default_rng(0)
        for i in range(dense[1]):
            for m in range(dense[0]):
                model = f"dense-{m}"
                pred, out = _dense_pair(model, f"d{m}-{i}", rng, ts)
                await send(names.predictions, pred, model)
                await send(names.outcomes, out, model)
        for j in range(names_count):
            await send(names.outcomes, f'{{"model":"name-{j}","id":"x","ts":{ts},"label":0}}'
                       .encode(), f"name-{j}")
        for f in futs:
            await f
    finally:
        await prod.stop()
    return sent


async def test_worst_traffic_keeps_peak_memory_within_the_budget(
        deployment, broker, tmp_path, soak, figures):
    names = await deployment.topics(2)
    if soak:  # the shipped defaults
        join: dict = {}
        state: dict = {}
        models, per_model, names_count = 8, 20_000, 200_000
        dense = (2, 12_000)
        total, state_total = 384 * MIB, 320 * MIB
    else:
        total, state_total = 96 * MIB, 32 * MIB
        join = {"max_bytes_total": total, "max_bytes_per_model": 32 * MIB}
        state = {"max_bytes_total": state_total, "max_bytes_per_model": state_total}
        models, per_model, names_count = 6, 8_000, 20_000
        dense = (1, 6_000)
    cfg = deployment.config(partitions=2, defaults={"k": None}, join=join,
                            kafka={"max_message_bytes": 2 * MIB},
                            state={"checkpoint_interval_seconds": 5.0, **state})
    daemon = FastDaemon(cfg, tmp_path, name="memory").start()
    try:
        await daemon.wait_ready(60)
        await asyncio.sleep(1.0)
        rss0 = rss_kib(daemon.pid)
        t0 = time.monotonic()
        async def huge_rejected():
            await wait_until(lambda: _invalid(daemon.url, "k_too_large", 3), 60,
                             "the k = 100,000 predictions rejected")

        sent = await _produce(broker.bootstrap, names, models, per_model, names_count,
                              huge_rejected, dense)
        t_sent = time.monotonic() - t0

        async def consumed():
            mx = await scrape_metrics(daemon.url)
            done = sum(v for (n, _lb), v in mx.items() if n == "lpcal_events_consumed_total")
            return done >= sent or None

        async def progress():
            mx = await scrape_metrics(daemon.url)
            done = sum(v for (n, _lb), v in mx.items() if n == "lpcal_events_consumed_total")
            lag = sum(v for (n, _lb), v in mx.items() if n == "lpcal_consumer_lag_messages")
            return (f"consumed {done:.0f} of {sent}, lag {lag:.0f}, RSS "
                    f"{rss_kib(daemon.pid) // 1024} MiB\n{daemon.logs(2000)}")

        await wait_until(consumed, 900 if soak else 120, "every message consumed",
                         interval=0.5, diag=progress)
        await asyncio.sleep(6.0)  # a checkpoint of the full buffers
        mx = await scrape_metrics(daemon.url)
        hwm = _status_kib(daemon.pid, "VmHWM")
        rss_end = rss_kib(daemon.pid)
        assert daemon.alive(), daemon.logs()
    finally:
        rc, _ = daemon.terminate(60)
        log = daemon.all_logs()
        daemon.stop_quietly()

    def total_of(name: str) -> float:
        return sum(v for (n, _lb), v in mx.items() if n == name)

    state_bytes = total_of("lpcal_model_state_bytes")
    trimmed = total_of("lpcal_window_trimmed_samples_total")
    dense_models = [f"dense-{m}" for m in range(dense[0])]
    joined = sum(metric_value(mx, "lpcal_joined_samples_total", model=m) for m in dense_models)
    # a pair not joined had an event evicted by the join budget (the predictions and outcomes
    # topics are consumed unevenly under load) or still waits
    unjoined = sum(v for (n, lb), v in mx.items()
                   if n in ("lpcal_join_evictions_total", "lpcal_join_pending")
                   and dict(lb).get("model") in dense_models)
    buffers = total_of("lpcal_join_buffer_bytes")
    budgets = total_of("lpcal_join_buffer_budget_bytes")
    pending = total_of("lpcal_join_pending")
    too_large = metric_value(mx, "lpcal_events_invalid_total", default=0.0,
                             reason="k_too_large")
    unknown = metric_value(mx, "lpcal_events_invalid_total", default=0.0,
                           reason="unknown_model")
    unbounded_rows = models * per_model * 8 * K
    limit = _pod_memory_limit()
    figures("memory bound: worst traffic", {
        "messages sent": sent,
        "seconds to send": round(t_sent, 1),
        "models with k = 1000 and 256-byte ids": models,
        "predictions per model (never joined)": per_model,
        "distinct model names": names_count,
        "rows if unbounded (MiB)": round(unbounded_rows / MIB),
        "join budget, all models (MiB)": round(total / MIB),
        "sum of lpcal_join_buffer_bytes (MiB)": round(buffers / MIB, 1),
        "sum of lpcal_join_buffer_budget_bytes (MiB)": round(budgets / MIB, 1),
        "pending events kept": int(pending),
        "models with k = 1000, every sample a new bin": dense[0],
        "samples joined of those models": int(joined),
        "their events evicted or pending": int(unjoined),
        "window if unbounded (MiB)": round(min(dense[1], 10_000) * dense[0] * 32_032 / MIB),
        "state budget, all models (MiB)": round(state_total / MIB),
        "sum of lpcal_model_state_bytes (MiB)": round(state_bytes / MIB, 1),
        "samples trimmed from windows": int(trimmed),
        "k_too_large rejected": int(too_large),
        "unknown_model rejected": int(unknown),
        "RSS when ready (MiB)": round(rss0 / 1024),
        "peak RSS, VmHWM (MiB)": round(hwm / 1024),
        "RSS at end (MiB)": round(rss_end / 1024),
        "shipped memory limit (MiB)": limit // MIB,
        "exit code after SIGTERM": rc,
    })
    assert rc == 0, log[-3000:]
    assert "checkpoint failed" not in log and "Traceback" not in log, log[-3000:]
    assert too_large >= 3
    assert unknown >= names_count - 100
    assert metric_value(mx, "lpcal_events_invalid_total", reason="bad_schema") == 0
    assert buffers <= total, (buffers, total)
    assert budgets <= total + MIB
    assert pending < models * per_model  # the budgets evicted
    assert joined >= dense[0] * dense[1] / 2 and joined + unjoined >= dense[0] * dense[1]
    assert trimmed > 0 and state_bytes <= state_total + 16 * MIB, (trimmed, state_bytes)
    if soak:
        assert hwm * 1024 < limit, f"peak RSS {hwm} KiB above the pod limit {limit} bytes"
    else:
        growth = (hwm - rss0) * 1024
        assert growth < total + state_total + 160 * MIB, (
            f"peak RSS grew by {growth / MIB:.0f} MiB with a join budget of {total / MIB:.0f} "
            f"MiB and a state budget of {state_total / MIB:.0f} MiB (rows alone would be "
            f"{unbounded_rows / MIB:.0f} MiB unbounded)")
