"""Checkpoint values on the state topic: large ones are zstd-compressed by the store (off the
event loop), small ones and plain values of earlier versions pass unchanged, zlib values of
earlier versions are read, corrupt ones are reported, not raised. The round trip through the
real broker is covered by the integration and crash tests (they read the state topic with
:func:`decode_value`)."""

from __future__ import annotations

import asyncio
import threading
import zlib

import orjson
import pytest
import zstandard

from daemon.checkpoint import store as cs
from daemon.checkpoint.store import (
    COMPRESS_MIN_BYTES,
    COMPRESSED,
    ZLIB,
    KafkaCheckpointStore,
    LocalCheckpointStore,
    decode_value,
    encode_value,
)


def _big_checkpoint(n: int = 20_000) -> bytes:
    return orjson.dumps({"format": "x", "recent_ids": [f"model-a-{i}" for i in range(n)]})


def test_large_values_are_compressed_and_round_trip():
    v = _big_checkpoint()
    assert len(v) >= COMPRESS_MIN_BYTES
    enc = encode_value(v)
    assert enc.startswith(COMPRESSED) and len(enc) < len(v) / 3
    assert decode_value(enc) == v


def test_small_values_and_earlier_plain_values_pass_unchanged():
    small = b'{"offsets": {"p": 3}}'
    assert encode_value(small) is small
    assert decode_value(small) is small
    plain_big = _big_checkpoint()            # as written by versions before compression
    assert decode_value(plain_big) is plain_big


def test_zlib_values_of_earlier_versions_are_read():
    v = _big_checkpoint()
    assert decode_value(ZLIB + zlib.compress(v, 1)) == v


@pytest.mark.parametrize("damage, match", [
    (lambda e: e[:len(COMPRESSED) + 20], "truncated"),
    (lambda e: e[:-3], "truncated"),
    (lambda e: COMPRESSED + b"\x00not zstd at all", "corrupt"),
    # a frame without its content size (encode_value always writes it)
    (lambda e: COMPRESSED + zstandard.ZstdCompressor(write_content_size=False).compress(
        decode_value(e)), "does not state its size"),
    # a frame that states fewer bytes than it inflates to
    (lambda e: COMPRESSED + _resized(e[len(COMPRESSED):]), "corrupt"),
    (lambda e: ZLIB + zlib.compress(decode_value(e))[:40], "truncated"),
    (lambda e: ZLIB + b"\x00not zlib at all", "corrupt"),
])
def test_corrupt_compressed_values_raise_value_error(damage, match):
    with pytest.raises(ValueError, match=match):
        decode_value(damage(encode_value(_big_checkpoint())))


def _resized(frame: bytes) -> bytes:
    """``frame`` with its stated content size halved (single-segment frames state it in the
    bytes after the header's descriptor)."""
    params = zstandard.get_frame_parameters(frame)
    size = params.content_size
    out = bytearray(frame)
    descriptor = out[4]
    fcs_flag, single = descriptor >> 6, (descriptor >> 5) & 1
    width = [1 if single else 0, 2, 4, 8][fcs_flag]
    at = 5 + (0 if single else 1)
    new = size // 2 - (256 if width == 2 else 0)
    out[at:at + width] = new.to_bytes(width, "little")
    assert zstandard.frame_content_size(bytes(out)) == size // 2
    return bytes(out)


def test_inflation_is_bounded(monkeypatch):
    monkeypatch.setattr(cs, "MAX_INFLATED_BYTES", 1000)
    with pytest.raises(ValueError, match="inflates beyond 1000 bytes"):
        decode_value(ZLIB + zlib.compress(b"0" * 10_000))
    with pytest.raises(ValueError, match="inflates to 10000 bytes, beyond 1000"):
        decode_value(COMPRESSED + zstandard.ZstdCompressor().compress(b"0" * 10_000))


class _RecordingProducer:
    def __init__(self):
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def send(self, topic, key, value):
        self.sent.append((topic, key, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def test_kafka_store_compresses_large_values_in_a_worker_thread(monkeypatch):
    threads = []
    encode = cs.encode_value

    def spy(v):
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(v)

    monkeypatch.setattr(cs, "encode_value", spy)
    prod = _RecordingProducer()
    store = KafkaCheckpointStore(prod, "127.0.0.1:1", "state")
    big, small = _big_checkpoint(), b'{"offsets": {}}'
    await store.save({"model/a": big, "partition/0": small})
    assert [(t, k) for t, k, _ in prod.sent] == [("state", b"model/a"), ("state", b"partition/0")]
    assert prod.sent[0][2].startswith(COMPRESSED) and decode_value(prod.sent[0][2]) == big
    assert prod.sent[1][2] == small
    assert threads == [False, False]          # both encoded off the event loop's thread
    threads.clear()
    await store.save({"partition/0": small})  # nothing large: no thread hop
    assert threads == [] and prod.sent[-1][2] == small


async def test_kafka_store_load_keeps_raw_values_and_their_positions(monkeypatch):
    """load_all does not decode (values are decoded one at a time on restore)."""
    big = _big_checkpoint()
    latest = {"model/a": encode_value(big), "model/b": COMPRESSED + b"garbage",
              "partition/0": b'{"offsets": {}}'}
    where = {"model/a": "state[0]@3", "model/b": "state[0]@4", "partition/0": "state[0]@5"}

    async def fake_read(*a, **kw):
        return dict(latest), dict(where)

    monkeypatch.setattr(cs, "read_latest_with_positions", fake_read)
    store = KafkaCheckpointStore(None, "127.0.0.1:1", "state")
    out = await store.load_all()
    assert out == latest and store.where("model/b") == "state[0]@4"
    assert decode_value(out["model/a"]) == big
    with pytest.raises(ValueError, match="corrupt compressed checkpoint"):
        decode_value(out["model/b"])


@pytest.mark.parametrize("form", ["zstd", "zlib"])
def test_decode_value_is_bounded_by_its_limit(form):
    """Decompression bombs: inflation stops at the limit (a zstd frame stating more is refused
    before any inflation); plain values above it are refused too."""
    import tracemalloc

    zeros = b"0" * (256 << 20)
    bomb = (COMPRESSED + zstandard.ZstdCompressor(level=19).compress(zeros) if form == "zstd"
            else ZLIB + zlib.compress(zeros, 9))
    del zeros
    tracemalloc.start()
    try:
        with pytest.raises(cs.ValueTooLarge):
            decode_value(bomb, 4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # was: the whole 256 MiB inflated
    with pytest.raises(cs.ValueTooLarge):
        decode_value(b"x" * 2000, 1000)
    assert decode_value(encode_value(b"y" * 100_000), 100_000) == b"y" * 100_000


async def test_local_store_round_trip(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    await store.save({"model/a b": b"1", "partition/0": b"2"})
    await store.save({"model/a b": b"3"})
    assert await store.load_all() == {"model/a b": b"3", "partition/0": b"2"}
