"""Authentic bin maps on the embedded broker.

* a checksummed map with the wrong k for its model, published on the bin-map topic,
  was adopted at the next start; the first joined sample then ended ``lpcal serve`` (exit 2),
  and so did every restart. Now it is rejected (``lpcal_binmaps_rejected_total{reason="config"}``)
  and never installed; the daemon keeps joining samples across restarts.
* the daemon signs what it publishes (private key from the secrets directory); a
  forged map of a higher version on the topic (unsigned, or signed by another key) is rejected
  (``reason="signature"``) at the next assignment and does not make the daemon skip fits.
"""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.settings import load_settings
from lpcal.binmap import BinMap
from lpcal.client import BinMapStore
from tests.support.daemon_harness import (
    EventProducer,
    SubprocessDaemon,
    http_get,
    metric_value,
    read_records,
    read_state,
    running_daemon,
    scrape_metrics,
    synth_samples,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.integration


def _pem_pair():
    sk = Ed25519PrivateKey.generate()
    priv = sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = sk.public_key().public_bytes(serialization.Encoding.PEM,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    return priv, pub


def _map(model: str, k: int, lam: int, version: int) -> BinMap:
    """A valid, checksummed map (the identity outside an empty B) of the given k and lambda."""
    return BinMap(model_id=model, version=version, created_at="2025-01-01T00:00:00.000Z",
                  eps=0.1, p=float("inf"), delta=0.1, beta=0.1, lam=lam, k=k, temperature=None,
                  outside="identity", sizing={}, iterations=0, stop_reason="forged",
                  est_error={}, bins=(), group=np.zeros(0, dtype=np.int64),
                  preds=np.zeros((0, k)), mode="paper")


async def _publish(bootstrap: str, topic: str, model: str, value: bytes) -> None:
    async with EventProducer(bootstrap) as prod:
        await prod.raw(topic, value, model)
        await prod.flush()


async def _samples_total(url: str, model: str) -> int:
    status, body = await http_get(url, "/v1/models", timeout=2.0)
    assert status == 200, status
    return {e["model"]: e["samples_total"] for e in orjson.loads(body)["models"]}.get(model, 0)


async def test_wrong_k_map_on_the_topic_does_not_crash_loop_the_daemon(
        deployment, broker, tmp_path):
    names = await deployment.topics(1)
    model, k, n = "wk", 3, 60
    cfg = deployment.config(models={model: {"k": k}}, shutdown_grace_seconds=10)
    d = SubprocessDaemon(cfg, tmp_path, "wrong-k")
    ids, probs, labels = synth_samples(3 * n, k, 1, model)

    async def feed(lo: int, hi: int) -> None:
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, model, ids[lo:hi], probs[lo:hi], labels[lo:hi],
                               ts0=1e9 + lo)
            await prod.flush()

    async def joined(total: int) -> bool:
        if not d.alive():  # fail at once: wait_until does not retry a RuntimeError
            raise RuntimeError(f"daemon exited with {d.proc.returncode}\n{d.logs()}")
        return await _samples_total(d.url, model) >= total

    try:
        d.start()
        await d.wait_ready(40)
        await feed(0, n)
        await wait_until(lambda: joined(n), 40, f"{n} joined samples", diag=d.logs)
        rc, _ = d.terminate(30)
        assert rc == 0, d.logs()
        st = (await read_state(broker.bootstrap, names.state)).models[model]
        assert st.k == k and st.binmap_version == 0
        # a map with a valid checksum, a higher version and the wrong k (and one with the
        # wrong lambda before it, for the same model: the latest per key is what is read)
        await _publish(broker.bootstrap, names.binmaps, model,
                       _map(model, k, st.lam + 3, 4).to_json())
        await _publish(broker.bootstrap, names.binmaps, model,
                       _map(model, k + 1, st.lam, 5).to_json())
        for i in (1, 2):  # two restarts: no crash loop
            d.start()
            await d.wait_ready(40)
            if i == 1:
                await feed(n, 2 * n)
            want = 2 * n
            await wait_until(lambda w=want: joined(w), 40, f"{want} joined samples after "
                             f"restart {i}", diag=d.logs)
            mx = await scrape_metrics(d.url)
            assert metric_value(mx, "lpcal_binmaps_rejected_total", reason="config") == 1
            status, _ = await http_get(d.url, f"/v1/models/{model}/binmap")
            assert status == 404  # never installed
            await asyncio.sleep(1.5)  # a calibrated window would have raised by now
            assert d.alive(), d.logs()
            rc, _ = d.terminate(30)
            assert rc == 0, d.logs()
        assert (await read_state(broker.bootstrap, names.state)).models[model].binmap_version \
            == 0
    finally:
        d.stop_quietly()


async def test_signed_daemon_publishes_verified_maps_and_ignores_forged_versions(
        deployment, broker, topic_prefix, tmp_path):
    from lpcal.signing import Signer, key_id

    names = await deployment.topics(1)
    priv, pub = _pem_pair()
    other_priv, _ = _pem_pair()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "signing__private_key").write_bytes(priv)
    model, k = "sg", 3
    cfg = deployment.config(group_id=f"{topic_prefix}-g",
                            defaults={"pool": 100, "mu_pool": 100, "mode": "paper",
                                      "drift_threshold": 100.0, "drift_false_alarm_rate": 0.0},
                            models={model: {"k": k}})
    settings = load_settings(write_config(cfg, tmp_path / "lpcal.toml"), secrets_dir=secrets)
    assert settings.signing.signer().key_id == key_id(pub)
    ids, probs, labels = synth_samples(8000, k, 3, model)

    async def feed(lo: int, hi: int) -> None:
        async with EventProducer(broker.bootstrap) as prod:
            await prod.samples(names, model, ids[lo:hi], probs[lo:hi], labels[lo:hi],
                               ts0=1e9 + lo)
            await prod.flush()

    def version(rd) -> int:
        st = rd.daemon.registry.states().get(model)
        return 0 if st is None else st.binmap_version

    async with running_daemon(settings) as rd:
        await feed(0, 3000)
        await wait_until(lambda: version(rd) >= 1 and not rd.daemon.registry.fitting(), 90,
                         "a published bin map", diag=rd.describe)
        status, body = await http_get(rd.url, f"/v1/models/{model}/binmap")
        assert status == 200
        served = BinMap.from_json(body, public_keys=[pub])
        assert served.verified_by == key_id(pub)
    published = version(rd)
    # forged maps of higher versions: unsigned, then signed by a key the daemon does not trust
    forged = _map(model, k, rd.daemon.registry.slots[model].state.lam, 1003)
    await _publish(broker.bootstrap, names.binmaps, model, forged.to_json())
    await _publish(broker.bootstrap, names.binmaps, model,
                   forged.with_version(1004).to_json(signer=Signer(other_priv)))
    async with running_daemon(settings) as rd2:
        await wait_until(lambda: rd2.daemon.registry.states().get(model) is not None, 30, "restored")
        assert version(rd2) == published  # the forgery did not set the version
        mx = await scrape_metrics(rd2.url)
        assert metric_value(mx, "lpcal_binmaps_rejected_total", reason="signature") == 1
        await feed(3000, 8000)
        await wait_until(lambda: version(rd2) > published, 90,
                         f"a bin map after version {published}", diag=rd2.describe)
        assert version(rd2) < 1003
    # every record the daemon wrote verifies against its public key, and versions are 1..V
    store = BinMapStore(public_keys=[pub])
    mine = []
    for rec in await read_records(broker.bootstrap, names.binmaps):
        if store.offer(rec.value, model=model, source=f"@{rec.offset}"):
            mine.append(store.get(model).version)
    assert store.rejections["signature"] == 2
    assert sorted(set(mine)) == list(range(1, max(mine) + 1)) and max(mine) > published
    assert store.get(model).verified_by == key_id(pub)
