"""Unit tests of the downstream bin-map client (lpcal.client); no broker, no aiohttp.

Real fitted bin maps (``lpcal.calibrate.fit`` on small synthetic data); two maps with different
``eps`` (hence different lambda) give different outputs on every input row, so a call that mixed
two maps would match neither precomputed output. The maps and the artifact helpers are shared
with the broker tests (``tests/support/client_fixtures.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import orjson
import pytest

from lpcal.binmap import BinMap
from lpcal.client import (
    REJECT_REASONS,
    BinMapFollower,
    BinMapLoadError,
    BinMapRejected,
    BinMapStore,
    FollowerThread,
    Rejection,
    UnknownModelError,
    fetch_http,
    load_file,
    load_http,
    verify_artifact,
)
from lpcal.errors import ArtifactError, InputError
from tests.support.client_fixtures import MODEL, fitted_maps, flip_digit, resigned


@pytest.fixture(scope="module")
def maps():
    """Two real fitted maps of MODEL (different eps -> different lambda) and test inputs."""
    return fitted_maps(data_seed=0, x_seed=7, n_x=500)


def _reasons(store):
    return {k: v for k, v in store.rejections.items() if v}


# ----------------------------------------------------------------------------- install / swap


def test_offer_bytes_installs_and_apply_matches_the_map(maps):
    swaps = []
    store = BinMapStore(on_swap=lambda m, old, bm: swaps.append((m, old, bm.version)))
    assert store.offer(maps.v1.to_json(), source="unit") is True
    assert store.models() == [MODEL] and MODEL in store and len(store) == 1
    assert store.versions() == {MODEL: 1}
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)
    np.testing.assert_array_equal(store.apply(MODEL, maps.x[3]), maps.out1[3])  # one row
    assert store.get(MODEL).checksum == maps.v1.checksum
    assert swaps == [(MODEL, None, 1)] and store.swaps == 1


def test_newer_version_hot_swaps(maps):
    swaps = []
    store = BinMapStore(on_swap=lambda m, old, bm: swaps.append((old, bm.version)))
    store.offer(maps.v1)
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)
    held = store.get(MODEL)
    assert store.offer(maps.v2.to_json(), model=MODEL, source="t[0]@1") is True
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)
    assert store.versions() == {MODEL: 2} and swaps == [(None, 1), (1, 2)]
    # a reference obtained before the swap still is the complete old map
    np.testing.assert_array_equal(held.apply(maps.x), maps.out1)


def test_version_ordering(maps):
    store = BinMapStore()
    assert store.offer(maps.v2.to_json())
    # older: ignored, v2 stays
    assert store.offer(maps.v1.to_json()) is False
    assert store.offer(maps.v1) is False
    # equal version, same checksum: ignored
    assert store.offer(maps.v2.to_json()) is False
    assert store.offer(maps.v2) is False
    assert store.ignored == {"stale": 2, "duplicate": 2}
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)
    # equal version, other content (a refit of version 2): the later one wins
    refit = maps.v1.with_version(2, created_at="2026-11-25T00:00:00.000Z")
    assert store.offer(refit.to_json()) is True
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)
    # newer wins; force installs an older one (daemon state wiped, versions restarted)
    assert store.offer(maps.v2.with_version(5)) is True
    assert store.offer(maps.v1, force=True) is True
    assert store.versions() == {MODEL: 1} and store.swaps == 4
    assert sum(store.rejections.values()) == 0


def test_models_are_independent(maps):
    other = dataclasses.replace(maps.v2, model_id="churn", version=1)
    store = BinMapStore()
    store.offer(maps.v1)
    store.offer(other)
    assert store.versions() == {MODEL: 1, "churn": 1} and store.models() == ["churn", MODEL]
    np.testing.assert_array_equal(store.apply("churn", maps.x), maps.out2)
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)
    assert store.remove("churn") is True and store.remove("churn") is False
    assert store.models() == [MODEL]


# ----------------------------------------------------------------------------- rejections


def _corruptions(good: bytes) -> dict[str, tuple[str, bytes]]:
    obj = orjson.loads(good)
    no_sum = {k: v for k, v in obj.items() if k != "checksum"}
    bad_field = dict(obj, lam="many")
    return {
        "truncated-half": ("truncated", good[: len(good) // 2]),
        "truncated-one-byte": ("truncated", good[:-1]),
        "empty": ("truncated", b""),
        "bit-flip": ("checksum", flip_digit(good)),
        "no-checksum": ("checksum", orjson.dumps(no_sum)),
        "schema-3": ("schema", resigned(dict(obj, schema=3))),
        "no-schema": ("schema", orjson.dumps({k: v for k, v in obj.items() if k != "schema"})),
        "garbage": ("parse", b"this is not json"),
        "trailing-garbage": ("parse", good + b"}"),
        "json-list": ("parse", b"[1, 2, 3]"),
        "malformed-field-valid-checksum": ("parse", resigned(bad_field)),
    }


CASES = ["truncated-half", "truncated-one-byte", "empty", "bit-flip", "no-checksum", "schema-3",
         "no-schema", "garbage", "trailing-garbage", "json-list", "malformed-field-valid-checksum"]


def test_every_corruption_case_is_run(maps):
    cases = _corruptions(maps.v2.to_json())
    assert set(CASES) == set(cases)
    assert {reason for reason, _ in cases.values()} == set(REJECT_REASONS) - {"model", "signature"}


@pytest.mark.parametrize("case", CASES)
def test_rejected_artifacts_are_counted_and_the_previous_map_stays(maps, case):
    reason, data = _corruptions(maps.v2.to_json())[case]
    assert reason in REJECT_REASONS
    seen: list[Rejection] = []
    store = BinMapStore(on_reject=seen.append)
    assert store.offer(maps.v1)
    assert store.offer(data, model=MODEL, source=f"binmaps[0]@{case}") is False
    assert _reasons(store) == {reason: 1}
    assert store.versions() == {MODEL: 1}
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)
    assert len(seen) == 1 and seen[0].reason == reason and seen[0].model == MODEL
    assert seen[0].source == f"binmaps[0]@{case}" and case in seen[0].message
    with pytest.raises(BinMapRejected) as ei:
        verify_artifact(data, where="somewhere.json")
    assert ei.value.reason == reason and "somewhere.json" in str(ei.value)
    assert isinstance(ei.value, ArtifactError)
    # the same good artifact is still accepted afterwards
    assert store.offer(maps.v2.to_json(), model=MODEL) is True


def test_schema_1_artifacts_are_still_accepted(maps):
    """lpcal 0.1 wrote schema 1 (no ``mode``, no ``certificate``); the compacted topic may still
    hold such records, and ``BinMap.from_json`` reads them, so the store accepts them too."""
    obj = orjson.loads(maps.v1.to_json())
    old = resigned({k: v for k, v in obj.items() if k not in ("mode", "certificate")}
                   | {"schema": 1})
    store = BinMapStore()
    assert store.offer(old, model=MODEL) is True and _reasons(store) == {}
    assert store.get(MODEL).mode == "paper"
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)


def test_artifact_published_under_another_model_is_rejected(maps):
    store = BinMapStore()
    assert store.offer(maps.v1.to_json(), model="churn", source="binmaps[0]@9") is False
    assert _reasons(store) == {"model": 1} and len(store) == 0
    assert store.rejections.keys() == set(REJECT_REASONS)


def test_failing_callbacks_do_not_break_the_store(maps):
    def boom(*a):
        raise RuntimeError("callback bug")

    store = BinMapStore(on_reject=boom, on_swap=boom)
    assert store.offer(maps.v1) is True
    assert store.offer(b"{", model=MODEL) is False
    assert store.versions() == {MODEL: 1} and _reasons(store) == {"truncated": 1}


def test_offer_rejects_wrong_types_and_bad_options():
    store = BinMapStore()
    with pytest.raises(InputError, match="expected bytes, str or BinMap from src"):
        store.offer(123, source="src")
    with pytest.raises(InputError, match="missing must be one of"):
        BinMapStore(missing="zero")


# ----------------------------------------------------------------------------- unknown models


def test_unknown_model_raises_or_falls_back(maps):
    store = BinMapStore()
    with pytest.raises(UnknownModelError, match="no bin map for model 'nope'"):
        store.apply("nope", maps.x)
    store.offer(maps.v1)
    with pytest.raises(LookupError, match=r"known: \['fraud-v3'\]"):
        store.apply("nope", maps.x)
    ident = BinMapStore(missing="identity")
    out = ident.apply("nope", maps.x)
    np.testing.assert_array_equal(out, maps.x)
    assert out is not maps.x
    assert ident.get("nope") is None


def test_apply_validates_input_through_the_map(maps):
    store = BinMapStore()
    store.offer(maps.v1)
    with pytest.raises(InputError, match="row 1"):
        store.apply(MODEL, np.array([[0.2, 0.3, 0.5], [0.9, 0.9, 0.1]]))
    with pytest.raises(InputError, match="length 3"):
        store.apply(MODEL, np.ones((2, 4)) / 4)


# ----------------------------------------------------------------------------- thread safety


def _swap_while_reading(store, v1, v2, reader, n_threads, swaps=300):
    """Run ``reader(r, stop, calls, seen, bad)`` in ``n_threads`` threads while a writer
    installs v2, v1, v2, ... contents ``swaps`` times (half of them through the bytes path,
    verification included), each swap waiting for at least two reader calls."""
    store.offer(v1)
    staged = [(v1, v2)[i % 2 == 0].with_version(i + 2) for i in range(swaps)]  # v2, v1, ...
    stop = threading.Event()
    calls = [0] * n_threads
    seen = [[0, 0] for _ in range(n_threads)]
    bad: list = []
    threads = [threading.Thread(target=reader, args=(r, stop, calls, seen, bad))
               for r in range(n_threads)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # frequent GIL hand-offs: more interleavings, a faster writer
    for t in threads:
        t.start()
    try:
        for i, bm in enumerate(staged):
            assert store.offer(bm.to_json() if i % 2 else bm, source="writer") is True
            before = sum(calls)
            deadline = time.monotonic() + 2.0
            while sum(calls) < before + 2 and time.monotonic() < deadline:
                time.sleep(0)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        sys.setswitchinterval(switch)
    assert not bad, f"{len(bad)} outputs matched neither v1 nor v2: {bad[:3]}"
    assert store.swaps == swaps + 1 and store.versions() == {MODEL: swaps + 1}
    total = np.array(seen).sum(axis=0)
    assert total[0] > 0 and total[1] > 0 and sum(calls) >= 2 * swaps
    return calls


def test_concurrent_apply_never_sees_a_mixture(maps):
    """4 threads apply batches in a loop while a writer swaps v1 <-> v2 contents 300 times.

    Every output must equal exactly the v1 output or the v2 output for the same input."""
    store = BinMapStore()

    def reader(r, stop, calls, seen, bad):
        while not stop.is_set():
            out = store.apply(MODEL, maps.x)
            if np.array_equal(out, maps.out1):
                seen[r][0] += 1
            elif np.array_equal(out, maps.out2):
                seen[r][1] += 1
            else:
                bad.append(out)
            calls[r] += 1

    _swap_while_reading(store, maps.v1, maps.v2, reader, n_threads=4)


def _temperature_only(bm: BinMap, temperature: float) -> BinMap:
    """``bm`` as the certified default often publishes it: the temperature alone, B empty."""
    return dataclasses.replace(bm, temperature=temperature, outside="identity", bins=(),
                               group=np.zeros(0, dtype=np.int64), preds=np.zeros((0, 3)),
                               mode="certified")


@pytest.mark.parametrize("kind", ["paper", "temperature + B", "temperature only"])
def test_concurrent_single_rows_never_see_a_mixture(maps, kind):
    """8 threads apply SINGLE rows (the dedicated single-row path: shapes (k,) and (1, k), with
    and without ``out=``) while a writer swaps v1 <-> v2 contents 150 times.

    Every row's output must equal exactly that row's output under v1 or under v2."""
    v1, v2 = {
        "paper": (maps.v1, maps.v2),
        "temperature + B": (dataclasses.replace(maps.v1, temperature=1.6),
                            dataclasses.replace(maps.v2, temperature=0.7)),
        "temperature only": (_temperature_only(maps.v1, 1.6), _temperature_only(maps.v2, 0.7)),
    }[kind]
    x = maps.x
    want1 = np.array([v1.apply(r) for r in x])
    want2 = np.array([v2.apply(r) for r in x])
    # every row differs, so an output mixing the two maps equals neither
    assert (np.abs(want1 - want2).max(axis=1) > 1e-9).all()
    np.testing.assert_allclose(want1, v1.apply(x), rtol=0, atol=1e-15)  # = the batch path
    store = BinMapStore()

    def reader(r, stop, calls, seen, bad):
        buf1, buf2 = np.empty(3), np.empty((1, 3))
        i = r * 61
        while not stop.is_set():
            i = (i + 1) % len(x)
            form = calls[r] % 4
            if form == 0:
                out = store.apply(MODEL, x[i])
            elif form == 1:
                out = store.apply(MODEL, x[i : i + 1])[0]
            elif form == 2:
                out = store.apply(MODEL, x[i], out=buf1, check=False)
            else:
                out = store.apply(MODEL, x[i : i + 1], out=buf2)[0]
            if np.array_equal(out, want1[i]):
                seen[r][0] += 1
            elif np.array_equal(out, want2[i]):
                seen[r][1] += 1
            else:
                bad.append((i, out.copy()))
            calls[r] += 1

    calls = _swap_while_reading(store, v1, v2, reader, n_threads=8, swaps=150)
    assert min(calls) > 0  # every thread ran


def test_wait_for_blocks_until_a_version_arrives(maps):
    store = BinMapStore()
    with pytest.raises(TimeoutError, match="fraud-v3.*installed: none"):
        store.wait_for(MODEL, timeout=0.05)
    store.offer(maps.v1)
    assert store.wait_for(MODEL, timeout=0.05) is store.get(MODEL)
    t = threading.Timer(0.1, store.offer, args=(maps.v2.to_json(),))
    t.start()
    bm = store.wait_for(MODEL, min_version=2, timeout=5)
    t.join()
    assert bm.version == 2
    with pytest.raises(TimeoutError, match=r"version >= 3.*installed: version 2"):
        store.wait_for(MODEL, min_version=3, timeout=0.05)


# ----------------------------------------------------------------------------- loaders


def test_load_file_round_trip_and_errors_name_the_file(maps, tmp_path):
    good = tmp_path / "fraud-v3.json"
    good.write_bytes(maps.v1.to_json())
    bm = load_file(good)
    assert bm.checksum == maps.v1.checksum
    np.testing.assert_array_equal(bm.apply(maps.x), maps.out1)

    missing = tmp_path / "absent.json"
    with pytest.raises(BinMapLoadError, match="absent.json: cannot read"):
        load_file(missing)
    cut = tmp_path / "cut.json"
    cut.write_bytes(maps.v1.to_json()[:100])
    with pytest.raises(BinMapRejected, match="cut.json: truncated") as ei:
        load_file(cut)
    assert ei.value.reason == "truncated"
    flipped = tmp_path / "flipped.json"
    flipped.write_bytes(flip_digit(maps.v1.to_json()))
    with pytest.raises(BinMapRejected, match="flipped.json: checksum mismatch") as ei:
        load_file(str(flipped))
    assert ei.value.reason == "checksum"
    with pytest.raises(BinMapLoadError, match=str(tmp_path)):
        load_file(tmp_path)  # a directory


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict] = {}

    def do_GET(self):
        status, headers, body = self.routes.get(self.path, (404, {}, b'{"error": "nope"}'))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server(maps):
    good = maps.v1.to_json()
    _Handler.routes = {
        "/v1/models/fraud-v3/binmap": (200, {"Content-Type": "application/json"}, good),
        "/short": (200, {"Content-Length": str(len(good))}, good[:200]),
        "/corrupt": (200, {}, flip_digit(good)),
    }
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_load_http_and_its_errors(maps, http_server):
    bm = load_http(f"{http_server}/v1/models/fraud-v3/binmap", timeout=5)
    np.testing.assert_array_equal(bm.apply(maps.x), maps.out1)
    url = f"{http_server}/v1/models/other/binmap"
    with pytest.raises(BinMapLoadError, match=r"other/binmap: HTTP 404.*nope"):
        load_http(url, timeout=5)
    with pytest.raises(BinMapRejected, match="short: truncated response") as ei:
        fetch_http(f"{http_server}/short", timeout=5)
    assert ei.value.reason == "truncated"
    with pytest.raises(BinMapRejected, match="corrupt: checksum mismatch"):
        load_http(f"{http_server}/corrupt", timeout=5)
    with pytest.raises(InputError, match="timeout"):
        fetch_http(url, timeout=0)


def test_load_http_connection_refused_names_the_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}/v1/models/x/binmap"
    with pytest.raises(BinMapLoadError, match=f"127.0.0.1:{port}.*cannot fetch"):
        load_http(url, timeout=2)


# ----------------------------------------------------------------------------- follower (fake)


class FakeConsumer:
    """Duck-typed consumer over an in-memory partition log (one partition)."""

    def __init__(self, log, *, fail_polls=0):
        self.log = list(log)  # [(key, value)]
        self.pos = len(self.log)  # like auto_offset_reset=latest: the follower must seek
        self.calls: list[str] = []
        self.fail_polls = fail_polls
        self.tp = ("binmaps", 0)

    def start(self):
        self.calls.append("start")

    async def stop(self):
        self.calls.append("stop")

    def assignment(self):
        return {self.tp}

    async def seek_to_beginning(self, *tps):
        self.calls.append("seek")
        self.pos = 0

    async def end_offsets(self, tps):
        return {tp: len(self.log) for tp in tps}

    async def getmany(self, timeout_ms):
        if self.fail_polls:
            self.fail_polls -= 1
            raise ConnectionError("broker away")
        batch = self.log[self.pos:self.pos + 2]
        recs = [SimpleNamespace(key=k, value=v, offset=self.pos + i, topic="binmaps",
                                partition=0) for i, (k, v) in enumerate(batch)]
        self.pos += len(batch)
        if not recs:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        return {self.tp: recs}


class FakeConsumerNoOffsets(FakeConsumer):
    end_offsets = property(lambda self: (_ for _ in ()).throw(AttributeError("end_offsets")))


async def test_follower_reads_from_the_beginning_skips_bad_records_and_becomes_ready(maps):
    key = MODEL.encode()
    log = [(key, maps.v1.to_json()), (key, maps.v1.to_json()[:50]), (None, maps.v2.to_json()),
           (b"\xff", maps.v2.to_json()), (key, None), (key, flip_digit(maps.v2.to_json())),
           (key, maps.v2.to_json()), (b"churn", maps.v2.to_json())]
    consumer = FakeConsumer(log, fail_polls=1)
    store = BinMapStore()
    follower = BinMapFollower(store, consumer, poll_timeout_ms=20)
    async with follower:
        await follower.wait_ready(5)
        assert follower.records == len(log)
        assert store.versions() == {MODEL: 2}
        np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out2)
        assert _reasons(store) == {"truncated": 1, "checksum": 1, "model": 1}
        assert follower.skipped == {"no_key": 2, "tombstone": 1, "error": 0}
        assert follower.errors == 1  # the failed poll was retried
        # keeps following: a record appended later is picked up
        consumer.log.append((key, maps.v1.with_version(3).to_json()))
        await asyncio.to_thread(store.wait_for, MODEL, 3, 5)
        assert follower.running
    assert not follower.running
    assert consumer.calls[:2] == ["start", "seek"] and consumer.calls[-1] == "stop"


async def test_follower_without_end_offsets_is_ready_after_an_empty_poll(maps):
    consumer = FakeConsumerNoOffsets([(MODEL.encode(), maps.v1.to_json())] * 3)
    store = BinMapStore()
    follower = BinMapFollower(store, consumer, poll_timeout_ms=10)
    task = follower.start()
    await follower.wait_ready(5)
    assert store.versions() == {MODEL: 1} and store.ignored["duplicate"] == 2
    await follower.stop()
    assert task.done() and consumer.calls[-1] == "stop"
    with pytest.raises(RuntimeError, match="runs once"):
        await follower.run()


async def test_follower_wait_ready_reports_a_failed_start():
    class Broken(FakeConsumer):
        def start(self):
            raise ConnectionError("no broker at 127.0.0.1:1")

    consumer = Broken([])
    follower = BinMapFollower(BinMapStore(), consumer, poll_timeout_ms=10)
    follower.start()
    with pytest.raises(RuntimeError, match="stopped before it caught up") as ei:
        await follower.wait_ready(5)
    assert isinstance(ei.value.__cause__, ConnectionError)
    assert consumer.calls == ["stop"]  # the half-started consumer is still closed
    with pytest.raises(InputError, match="store must be a BinMapStore"):
        BinMapFollower({}, Broken([]))


# ----------------------------------------------------------------------------- hygiene


def test_client_imports_no_daemon_or_service_packages():
    code = ("import sys, lpcal.client; "
            "bad = {'aiokafka', 'aiohttp', 'prometheus_client', 'pydantic', "
            "'pydantic_settings', 'daemon'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_follower_thread_with_a_fake_consumer(maps):
    store = BinMapStore()
    key = MODEL.encode()
    ft = FollowerThread(store, lambda: FakeConsumer([(key, maps.v1.to_json())]),
                        poll_timeout_ms=10).start()
    ft.wait_ready(5)
    np.testing.assert_array_equal(store.apply(MODEL, maps.x), maps.out1)  # from this thread
    ft.stop(5)
    assert not ft._thread.is_alive() and ft.error is None
    assert ft.follower.consumer.calls[-1] == "stop"
    # stopped right after the start (before the follower existed): still ends cleanly
    ft2 = FollowerThread(BinMapStore(), lambda: FakeConsumer([]), poll_timeout_ms=10).start()
    ft2.stop(5)
    assert not ft2._thread.is_alive() and ft2.error is None
    assert ft2.follower.consumer.calls[-1] == "stop"
