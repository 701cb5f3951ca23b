"""Authentic bin maps (forged maps are refused; a map with the wrong k does not crash-loop the
daemon); broker-free. The daemon's end-to-end behaviour on the
embedded broker is in tests/integration/test_daemon_signing.py.

* maps are signed with Ed25519 (:mod:`lpcal.signing`, the ``cryptography`` package); a signed
  map is still one JSON document that readers without keys (and lpcal 0.1 readers) load;
* with a public key configured, the client (``BinMapStore``, the loaders, ``lpcal apply``)
  rejects unsigned, forged and foreign-key maps under the reason ``signature``;
* versions are integers in ``[0, MAX_VERSION]``;
* the daemon signs what it publishes, and on assignment adopts only maps signed by its own key(s)
  whose ``k`` and ``lambda`` fit the model's state.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lpcal import cli
from lpcal.binmap import MAX_VERSION, BinMap
from lpcal.calibrate import fit
from lpcal.client import (
    REJECT_REASONS,
    BinMapRejected,
    BinMapStore,
    load_file,
    verify_artifact,
)
from lpcal.errors import ArtifactError
from lpcal.signing import KeyRing, SignatureError, Signer, key_id

MODEL = "fraud-v3"


def _keypair():
    sk = Ed25519PrivateKey.generate()
    priv = sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = sk.public_key().public_bytes(serialization.Encoding.PEM,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    raw_pub = sk.public_key().public_bytes(serialization.Encoding.Raw,
                                           serialization.PublicFormat.Raw)
    return SimpleNamespace(sk=sk, priv=priv, pub=pub, raw_pub=raw_pub)


@pytest.fixture(scope="module")
def keys():
    return SimpleNamespace(a=_keypair(), b=_keypair())


@pytest.fixture(scope="module")
def maps():
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(3) * 0.7, size=6000)
    q = 0.5 * f + 0.5 * np.roll(f, -1, axis=1)
    y = np.minimum((q.cumsum(axis=1) < rng.random((len(f), 1))).sum(axis=1), 2)
    v1 = fit(f, y, eps=0.3, p=2.0, seed=0, model_id=MODEL, mode="paper").with_version(1)
    x = rng.dirichlet(np.ones(3), size=400)
    return SimpleNamespace(v1=v1, x=x, out=v1.apply(x))


def _forge(data: bytes, **edits) -> bytes:
    """Edit a map and recompute its checksum: what anyone with write access to the topic can
    do (the checksum has no key). A signature present is kept as it was."""
    obj = orjson.loads(data)
    obj.pop("checksum")
    obj.update(edits)
    obj["checksum"] = BinMap._digest(obj)
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def _flip_top_class(bm: BinMap) -> list:
    """The preds of ``bm`` with every group's prediction reversed (flips the top class)."""
    return [{"d": 0.0, "i": list(range(bm.k)), "v": row[::-1].tolist()} for row in bm.preds]


# ----------------------------------------------------------------------------- the format


def test_signed_map_is_one_json_document_verified_by_its_key_id(maps, keys):
    signer = Signer(keys.a.priv)
    data = maps.v1.to_json(signer=signer)
    obj = orjson.loads(data)
    sig = obj["signature"]
    assert set(sig) == {"alg", "key_id", "sig"} and sig["alg"] == "ed25519"
    assert sig["key_id"] == signer.key_id == key_id(keys.a.pub)
    assert len(base64.b64decode(sig["sig"], validate=True)) == 64
    bm = BinMap.from_json(data, public_keys=[keys.a.pub])
    assert bm.verified_by == signer.key_id
    np.testing.assert_array_equal(bm.apply(maps.x), maps.out)
    # deterministic: signing twice gives the same bytes
    assert maps.v1.to_json(signer=signer) == data


def test_signed_maps_load_without_keys_and_in_lpcal_0_1_readers(maps, keys):
    data = maps.v1.to_json(signer=Signer(keys.a.priv))
    bm = BinMap.from_json(data)  # no key required: the signature is not checked
    assert bm.verified_by is None
    np.testing.assert_array_equal(bm.apply(maps.x), maps.out)
    # an lpcal 0.1 reader pops "checksum" and hashes every other top-level field: the signature
    # is inside the checksummed content, so old readers keep accepting signed maps
    obj = orjson.loads(data)
    checksum = obj.pop("checksum")
    assert BinMap._digest(obj) == checksum
    # old unsigned maps (schema 2 and schema 1) still load when no key is required
    assert BinMap.from_json(maps.v1.to_json()).version == 1
    old = orjson.loads(maps.v1.to_json())
    for f in ("mode", "certificate", "checksum"):
        old.pop(f)
    old["schema"] = 1
    old["checksum"] = BinMap._digest(old)
    assert BinMap.from_json(orjson.dumps(old)).mode == "paper"


@pytest.mark.parametrize("fmt", ["pem", "raw", "base64", "file", "object"])
def test_public_keys_in_every_documented_form(maps, keys, fmt, tmp_path):
    data = maps.v1.to_json(signer=Signer(keys.a.priv))
    path = tmp_path / "a.pub"
    path.write_bytes(keys.a.pub)
    key = {"pem": keys.a.pub, "raw": keys.a.raw_pub,
           "base64": base64.b64encode(keys.a.raw_pub).decode(), "file": path,
           "object": keys.a.sk.public_key()}[fmt]
    assert BinMap.from_json(data, public_keys=[key]).verified_by == key_id(keys.a.pub)


@pytest.mark.parametrize("fmt", ["pem", "raw", "base64"])
def test_private_keys_pem_or_raw_32_bytes(maps, keys, fmt):
    raw = keys.a.sk.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption())
    src = {"pem": keys.a.priv, "raw": raw, "base64": base64.b64encode(raw).decode()}[fmt]
    assert Signer(src).key_id == key_id(keys.a.pub)


def test_bad_keys_are_refused_with_a_clear_error(keys):
    with pytest.raises(ValueError, match="Ed25519"):
        Signer(b"not a key")
    with pytest.raises(ValueError, match="Ed25519"):
        KeyRing([b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"])
    with pytest.raises(ValueError, match="at least one"):
        KeyRing([])


# ----------------------------------------------------------------------------- forged maps


def test_forged_maps_are_rejected_when_a_key_is_configured(maps, keys):
    """A forged map that flipped the top class of 23% of rows was installed.
    With the daemon's public key configured, unsigned, edited and foreign-key maps are rejected
    under ``signature`` and the installed map stays in force."""
    good = maps.v1.to_json(signer=Signer(keys.a.priv))
    store = BinMapStore(public_keys=[keys.a.pub])
    assert store.offer(good, model=MODEL)
    assert store.get(MODEL).verified_by == key_id(keys.a.pub)
    flipped = _flip_top_class(maps.v1)
    forgeries = {
        "unsigned": maps.v1.with_version(2).to_json(),
        "edited-after-signing": _forge(good, version=2, preds=flipped),
        "signed-by-another-key": maps.v1.with_version(2).to_json(signer=Signer(keys.b.priv)),
        "garbage-signature": _forge(good, version=2, signature={"alg": "ed25519",
                                                                "key_id": "x", "sig": "!!"}),
        "other-alg": _forge(good, version=2, signature={"alg": "rsa", "key_id": "x", "sig": ""}),
    }
    for name, data in forgeries.items():
        assert store.offer(data, model=MODEL, source=name) is False, name
        with pytest.raises(BinMapRejected) as ei:
            verify_artifact(data, where=name, public_keys=[keys.a.pub])
        assert ei.value.reason == "signature" and name in str(ei.value)
        assert isinstance(ei.value, ArtifactError)
        with pytest.raises(SignatureError):
            BinMap.from_json(data, public_keys=[keys.a.pub])
    assert "signature" in REJECT_REASONS
    assert store.rejections["signature"] == len(forgeries)
    assert store.versions() == {MODEL: 1}
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out)


def test_without_keys_unsigned_maps_are_accepted_for_development(maps, caplog):
    with caplog.at_level("WARNING", logger="lpcal.client"):
        store = BinMapStore()
    assert "not authenticated" in caplog.text
    assert store.offer(maps.v1.to_json(), model=MODEL)


def test_key_rotation_old_and_new_keys_both_verify(maps, keys):
    old = maps.v1.to_json(signer=Signer(keys.a.priv))
    new = maps.v1.with_version(2).to_json(signer=Signer(keys.b.priv))
    both = BinMapStore(public_keys=[keys.a.pub, keys.b.pub])
    assert both.offer(old, model=MODEL) and both.offer(new, model=MODEL)
    assert both.get(MODEL).verified_by == key_id(keys.b.pub)
    only_new = BinMapStore(public_keys=[keys.b.pub])
    assert only_new.offer(old, model=MODEL) is False
    assert only_new.rejections["signature"] == 1


def test_binmap_objects_must_have_been_verified_against_the_stores_keys(maps, keys):
    store = BinMapStore(public_keys=[keys.a.pub])
    assert store.offer(maps.v1) is False  # built in memory: nothing to verify
    assert store.rejections["signature"] == 1
    verified = BinMap.from_json(maps.v1.to_json(signer=Signer(keys.a.priv)),
                                public_keys=[keys.a.pub])
    assert store.offer(verified) is True
    other = BinMap.from_json(maps.v1.with_version(3).to_json(signer=Signer(keys.b.priv)),
                             public_keys=[keys.b.pub])
    assert store.offer(other) is False


def test_loaders_verify_against_public_keys(maps, keys, tmp_path):
    signed, unsigned = tmp_path / "s.json", tmp_path / "u.json"
    signed.write_bytes(maps.v1.to_json(signer=Signer(keys.a.priv)))
    unsigned.write_bytes(maps.v1.to_json())
    assert load_file(signed, public_keys=[keys.a.pub]).verified_by == key_id(keys.a.pub)
    assert load_file(unsigned).version == 1
    with pytest.raises(BinMapRejected) as ei:
        load_file(unsigned, public_keys=[keys.a.pub])
    assert ei.value.reason == "signature" and str(unsigned) in str(ei.value)


def test_cli_apply_and_eval_verify_with_public_key(maps, keys, tmp_path, capsys):
    pub = tmp_path / "binmap.pub"
    pub.write_bytes(keys.a.pub)
    other = tmp_path / "other.pub"
    other.write_bytes(keys.b.pub)
    signed, forged = tmp_path / "s.json", tmp_path / "f.json"
    good = maps.v1.to_json(signer=Signer(keys.a.priv))
    signed.write_bytes(good)
    forged.write_bytes(_forge(good, preds=_flip_top_class(maps.v1)))
    inp = tmp_path / "in.npz"
    np.savez(inp, probs=maps.x, labels=np.zeros(len(maps.x), dtype=np.int64))
    out = tmp_path / "out.npz"
    args = ["apply", "--binmap", str(signed), "--input", str(inp), "--out", str(out)]
    assert cli.main(args + ["--public-key", str(pub)]) == 0
    assert "verified" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(out)["probs"], maps.out)
    # rotation: several keys, any one verifies
    assert cli.main(args + ["--public-key", str(other), "--public-key", str(pub)]) == 0
    capsys.readouterr()
    bad = ["apply", "--binmap", str(forged), "--input", str(inp), "--out", str(out),
           "--public-key", str(pub)]
    assert cli.main(bad) == 2
    assert "signature" in capsys.readouterr().err
    assert cli.main(["eval", "--input", str(inp), "--binmap", str(forged),
                     "--public-key", str(pub)]) == 2
    assert "signature" in capsys.readouterr().err
    # without a key: accepted, with a warning that it is not authenticated
    assert cli.main(["apply", "--binmap", str(forged), "--input", str(inp),
                     "--out", str(out)]) == 0
    assert "not authenticated" in capsys.readouterr().err


# ----------------------------------------------------------------------------- versions


@pytest.mark.parametrize("version", [1e300, 1003.0, 2 ** 53, 2 ** 63, -1, "7", True, None])
def test_versions_are_bounded_integers(maps, version):
    """A forged version 1e300 made every later checkpoint fail."""
    data = _forge(maps.v1.to_json(), version=version)
    with pytest.raises(ArtifactError, match="version"):
        BinMap.from_json(data)
    with pytest.raises(BinMapRejected, match="version") as ei:
        verify_artifact(data)
    assert ei.value.reason == "parse"
    store = BinMapStore()
    assert store.offer(data, model=MODEL) is False and store.get(MODEL) is None


def test_the_version_bound_itself(maps):
    assert MAX_VERSION == 2 ** 53 - 1
    top = maps.v1.with_version(MAX_VERSION)
    assert BinMap.from_json(top.to_json()).version == MAX_VERSION
    with pytest.raises(ArtifactError, match="version"):
        maps.v1.with_version(MAX_VERSION + 1)
    with pytest.raises(ArtifactError, match="version"):
        dataclasses.replace(maps.v1, version=2 ** 70).to_json()


# ----------------------------------------------------------------------------- the daemon


def _secrets(tmp_path, priv: bytes):
    d = tmp_path / "secrets"
    d.mkdir(exist_ok=True)
    (d / "signing__private_key").write_bytes(priv)
    return d


def _settings(tmp_path, secrets=None, **kw):
    from daemon.settings import load_settings

    cfg = tmp_path / "lpcal.toml"
    cfg.write_text('[defaults]\npool = 40\nmu_pool = 80\ndrift_threshold = 100.0\ndrift_false_alarm_rate = 0.0\n'
                   'mode = "paper"\n[models."bp-unit"]\nk = 3\n')
    return load_settings(cfg, secrets_dir=secrets or (tmp_path / "no-secrets"), **kw)


def test_settings_read_the_private_key_from_the_secrets_dir(tmp_path, keys):
    s = _settings(tmp_path, _secrets(tmp_path, keys.a.priv),
                  signing={"public_keys": [keys.b.pub.decode()]})
    assert s.signing.signer().key_id == key_id(keys.a.pub)
    assert set(s.signing.keyring().key_ids) == {key_id(keys.a.pub), key_id(keys.b.pub)}
    assert s.signing.warnings() == []
    assert "PRIVATE KEY" not in str(s.redacted())  # the secret is masked


def test_settings_refuse_a_bad_key_and_warn_when_unsigned(tmp_path, keys):
    from daemon.settings import SettingsError

    with pytest.raises(SettingsError, match="signing.private_key"):
        _settings(tmp_path, _secrets(tmp_path, b"-----BEGIN PRIVATE KEY-----\nxx\n"))
    s = _settings(tmp_path)
    assert s.signing.signer() is None and s.signing.keyring() is None
    assert any("unsigned" in w for w in s.signing.warnings())


@pytest.fixture
def daemon_factory(tmp_path):
    from tests.support.daemon_stubs import broker_free_daemon

    made = []

    def make(priv: bytes | None):
        s = _settings(tmp_path, _secrets(tmp_path, priv) if priv else None)
        d = broker_free_daemon(s)
        made.append(d)
        return d

    yield make
    for d in made:
        d.executor.shutdown(wait=True)


def _rejected(d, reason: str) -> float:
    return d.metrics.registry.get_sample_value("lpcal_binmaps_rejected_total",
                                               {"reason": reason}) or 0.0


def _state(d, n_sealed=0):
    from tests.support.daemon_stubs import MODEL as M
    from tests.support.daemon_stubs import state_with_sealed

    st = state_with_sealed(d.s, n_sealed)
    d.registry.place(M, st, 0)
    return st


def _map_for(st, *, k=None, lam=None, version=5) -> BinMap:
    """A valid, checksummed map for ``st``'s model (k and lambda as given, else the state's)."""
    k = st.k if k is None else k
    return BinMap(model_id=st.model, version=version, created_at="2025-01-01T00:00:00.000Z",
                  eps=0.1, p=float("inf"), delta=0.1, beta=0.1, lam=st.lam if lam is None
                  else lam, k=k, temperature=None, outside="identity", sizing={},
                  iterations=0, stop_reason="forged", est_error={}, bins=(),
                  group=np.zeros(0, dtype=np.int64), preds=np.zeros((0, k)), mode="paper")


def test_daemon_rejects_maps_with_the_wrong_k_or_lambda(daemon_factory):
    """``verify_binmap`` checked the model id but not k or lambda; a map with
    the wrong k was adopted, and the first joined sample then ended the process."""
    d = daemon_factory(None)
    st = _state(d)
    assert d.restorer.verify_binmap(_map_for(st).to_json(), st.model) is not None
    assert d.restorer.verify_binmap(_map_for(st, k=st.k + 1).to_json(), st.model) is None
    assert d.restorer.verify_binmap(_map_for(st, lam=st.lam + 1).to_json(), st.model) is None
    assert _rejected(d, "config") == 2


def test_daemon_with_a_key_accepts_only_its_own_signatures(daemon_factory, keys):
    d = daemon_factory(keys.a.priv)
    st = _state(d)
    bm = _map_for(st)
    assert d.restorer.verify_binmap(bm.to_json(signer=Signer(keys.a.priv)), st.model) is not None
    assert d.restorer.verify_binmap(bm.to_json(), st.model) is None
    assert d.restorer.verify_binmap(bm.to_json(signer=Signer(keys.b.priv)), st.model) is None
    assert _rejected(d, "signature") == 2


async def test_daemon_signs_what_it_publishes(daemon_factory, keys):
    from tests.daemon.test_fit_publish import FlakyProducer
    from tests.support.daemon_harness import wait_until

    d = daemon_factory(keys.a.priv)
    d.clients.producer = FlakyProducer(failures=0)
    _state(d, n_sealed=1)
    d.fitter.after_batch(time.monotonic())
    await wait_until(lambda: d.clients.producer.sent, 20.0, "a bin map published", interval=0.01)
    _, _, value, _ = d.clients.producer.sent[0]
    bm = verify_artifact(value, public_keys=[keys.a.pub])
    assert bm.verified_by == key_id(keys.a.pub) and bm.version == 1


async def test_forged_version_on_the_topic_does_not_skip_fits(daemon_factory, keys, monkeypatch):
    """The daemon adopted a forged version 1003 and then skipped every fit
    until version 1003. Maps not signed by the daemon's own key never set its version."""
    from tests.support.daemon_stubs import MODEL as M

    d = daemon_factory(keys.a.priv)
    st = _state(d, n_sealed=2)
    forged = {"unsigned": _map_for(st, version=1003).to_json(),
              "other-key": _map_for(st, version=1004).to_json(signer=Signer(keys.b.priv))}
    for name, data in forged.items():
        async def latest(*a, _data=data, **kw):
            return {M: _data}
        d.restorer.read_latest = latest
        await d.restorer.adopt_published_binmaps({0})
        assert st.binmap_version == 0 and d.registry.slots[M].prefitted == 0, name
        assert len(st.sealed) == 2, name
    assert _rejected(d, "signature") == 2
    # its own signed map of a later version is adopted (a crash between publish and checkpoint)
    own = _map_for(st, version=1).to_json(signer=Signer(keys.a.priv))

    async def latest_own(*a, **kw):
        return {M: own}
    d.restorer.read_latest = latest_own
    await d.restorer.adopt_published_binmaps({0})
    assert st.binmap_version == 1
    await asyncio.sleep(0)
