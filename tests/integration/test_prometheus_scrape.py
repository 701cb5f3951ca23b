"""A real Prometheus (Debian's ``prometheus``) scrapes a running daemon; the calibrated Err_p
series is then read back through Prometheus' HTTP API and compared with the daemon's gauge."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.parse
import urllib.request

import numpy as np
import pytest

from tests.support.daemon_harness import (
    EventProducer,
    TopicNames,
    build_settings,
    daemon_config,
    free_port,
    metric_value,
    running_daemon,
    scrape_metrics,
    wait_until,
)

pytestmark = pytest.mark.integration


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:  # make test installs it with deploy/tools/ensure-promtool.sh
        subprocess.run(["bash", "deploy/tools/ensure-promtool.sh"], check=True)
        path = shutil.which("prometheus")
    assert path, "Debian's prometheus package is not installed"
    return path


def _query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            body = json.loads(r.read())
    except OSError:
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


async def test_prometheus_scrapes_calibrated_err_p(broker, topic_prefix, tmp_path):
    names = TopicNames.for_prefix(topic_prefix)
    port = free_port()
    cfg = daemon_config(broker.bootstrap, names, http_port=port,
                        defaults={"eps": 0.1, "p": "inf", "k": 3, "pool": 570, "mu_pool": 570,
                                  "variant": "shared", "mode": "paper",  # the counts below
                                  "window_samples": 2000},
                        # the synthetic events are 1 s of event time apart: 7,000 s in all
                        join={"ttl_seconds": 86400})
    settings = build_settings(cfg, tmp_path)
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: lpcal\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}']\n")
    prom = subprocess.Popen(  # noqa: ASYNC220 - starts a server, returns at once
        [_prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115, ASYNC230 - Popen's, once
        stderr=subprocess.STDOUT)
    prom_url = f"http://127.0.0.1:{prom_port}"
    try:
        async with running_daemon(settings) as rd:
            rng = np.random.default_rng(0)
            n = 7000
            f = rng.dirichlet([0.3, 0.3, 0.3], size=n)
            q = f**0.4 / (f**0.4).sum(axis=1, keepdims=True)  # overconfident model
            y = (q.cumsum(axis=1) > rng.random(n)[:, None]).argmax(axis=1)
            # events are routed to the 7 pools of 570 at random: 5,500 fill them all once
            # (each gets 786 +- 26 on average), and the ~2,700 left cannot fill them again
            half = 5500
            async with EventProducer(broker.bootstrap) as prod:
                await prod.samples(names, "m1", [f"e{i}" for i in range(half)], f[:half],
                                   y[:half])
                await prod.flush()

                def published():
                    st = rd.daemon.registry.states().get("m1")
                    return st is not None and st.binmap_version >= 1

                await wait_until(published, 60, "a published bin map", diag=rd.describe)
                # the calibrated predictor is scored on samples that arrive after its install
                await prod.samples(names, "m1", [f"e{i}" for i in range(half, n)], f[half:],
                                   y[half:], ts0=1_764_100_000.0)
                await prod.flush()

            await wait_until(lambda: rd.daemon.registry.slots["m1"].state.monitor.window_size("calibrated"),
                             60, "a calibrated monitoring window", diag=rd.describe)
            promql = 'lpcal_calibration_error{model="m1",predictor="calibrated"}'

            async def scraped():
                return await asyncio.to_thread(_query, prom_url, promql)

            series = await wait_until(scraped, 60, "Prometheus to scrape the calibrated Err_p",
                                      diag=lambda: (tmp_path / "prometheus.log").read_text()[-2000:])
            assert series[0]["metric"]["job"] == "lpcal"
            value = float(series[0]["value"][1])
            own = await scrape_metrics(rd.url)
            gauge = metric_value(own, "lpcal_calibration_error", model="m1",
                                 predictor="calibrated")
            assert value >= 0
            # the daemon updates the gauge every second, Prometheus scrapes every second
            assert value == pytest.approx(gauge, abs=0.05)
            up = await asyncio.to_thread(_query, prom_url, 'up{job="lpcal"}')
            assert up and float(up[0]["value"][1]) == 1.0
            raw = await asyncio.to_thread(
                _query, prom_url, 'lpcal_calibration_error{model="m1",predictor="raw"}')
            assert raw, "the raw predictor's Err_p series is missing"
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.kill()
