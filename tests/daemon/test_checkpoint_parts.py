"""Checkpoints larger than ``state.max_record_bytes`` are split into parts: no
record written is larger than the limit, a crash at any step leaves one complete value,
and stale parts are deleted. The broker here is a log in memory with compaction's read
semantics (latest value per key, tombstones delete); the real broker is exercised by
``tests/integration/test_state_limits.py``."""

from __future__ import annotations

import asyncio
import os

import orjson
import pytest

from daemon.checkpoint import store as cs
from daemon.checkpoint.store import CHUNKED, PART, KafkaCheckpointStore, decode_value

LIMIT = 64 * 1024


class _Log:
    """An append-only topic; ``latest()`` is what a compacted read returns."""

    def __init__(self, fail_on=None):
        self.records: list[tuple[bytes, bytes | None]] = []
        self.fail_on = fail_on  # predicate on (key, value): raise instead of appending

    async def send(self, topic, key, value):
        if self.fail_on is not None and self.fail_on(key, value):
            raise ConnectionError("broker gone")
        self.records.append((key, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def latest(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for k, v in self.records:
            if v is None:
                out.pop(k.decode(), None)
            else:
                out[k.decode()] = v
        return out


@pytest.fixture
def log(monkeypatch):
    log = _Log()

    async def fake_read(*a, **kw):
        latest = log.latest()
        return latest, {k: f"state[0]@{i}" for i, k in enumerate(latest)}

    monkeypatch.setattr(cs, "read_latest_with_positions", fake_read)
    return log


def _store(log) -> KafkaCheckpointStore:
    return KafkaCheckpointStore(log, "127.0.0.1:1", "state", max_record_bytes=LIMIT)


async def test_large_values_are_split_into_records_within_the_limit(log):
    big = os.urandom(5 * LIMIT + 123)          # incompressible: stays large
    small = b'{"offsets": {}}'
    store = _store(log)
    await store.save({"model/a": big, "partition/0": small})
    assert all(len(k) + len(v or b"") <= LIMIT for k, v in log.records)
    keys = [k.decode() for k, _ in log.records]
    parts = [k for k in keys if k.startswith(PART)]
    assert len(parts) == 6 and all(k.startswith(PART + "model/a/") for k in parts)
    assert keys.index("model/a") > max(keys.index(p) for p in parts)  # head after its parts
    got = await _store(log).load_all()
    assert set(got) == {"model/a", "partition/0"}
    assert decode_value(got["model/a"]) == big and got["partition/0"] == small


async def test_a_new_value_deletes_the_parts_of_the_one_it_replaced(log):
    store = _store(log)
    first, second = os.urandom(3 * LIMIT), os.urandom(2 * LIMIT)
    await store.save({"model/a": first})
    old_parts = {k for k in log.latest() if k.startswith(PART)}
    await store.save({"model/a": second})
    latest = log.latest()
    assert not old_parts & set(latest)                    # tombstoned
    assert decode_value((await _store(log).load_all())["model/a"]) == second
    await store.save({"model/a": b"small now"})           # whole again: its parts go too
    assert [k for k in log.latest() if k.startswith(PART)] == []
    assert (await _store(log).load_all())["model/a"] == b"small now"


async def test_saving_an_unchanged_value_again_keeps_its_parts(log):
    """Same content, same digest, same part keys: the second save must not delete them."""
    store = _store(log)
    value = os.urandom(3 * LIMIT)
    await store.save({"model/a": value})
    await store.save({"model/a": value})
    assert decode_value((await _store(log).load_all())["model/a"]) == value
    assert not [k for k, v in log.records if v is None]  # nothing was deleted


async def test_a_crash_before_the_head_keeps_the_previous_value(log):
    store = _store(log)
    old = os.urandom(3 * LIMIT)
    await store.save({"model/a": old})
    log.fail_on = lambda key, value: key == b"model/a"    # parts written, head lost
    with pytest.raises(ConnectionError):
        await store.save({"model/a": os.urandom(4 * LIMIT)})
    log.fail_on = None
    restored = _store(log)
    assert decode_value((await restored.load_all())["model/a"]) == old
    # the orphaned new parts are deleted by the next save of that key after the restore
    head = orjson.loads(log.latest()["model/a"][len(CHUNKED):])
    current = f"/{head['sha256'][:16]}/"
    orphans = {k for k in log.latest() if k.startswith(PART) and current not in k}
    assert len(orphans) == 5  # 4 * LIMIT bytes in parts of LIMIT minus key and overhead
    await restored.save({"model/a": b"fresh"})
    assert not orphans & set(log.latest())


async def test_a_head_with_a_missing_or_damaged_part_is_rejected_on_decode(log):
    store = _store(log)
    await store.save({"model/a": os.urandom(3 * LIMIT), "model/b": os.urandom(2 * LIMIT)})
    latest = log.latest()
    a_part = sorted(k for k in latest if k.startswith(PART + "model/a/"))[1]
    b_part = min(k for k in latest if k.startswith(PART + "model/b/"))
    log.records.append((a_part.encode(), None))                       # lost
    log.records.append((b_part.encode(), b"x" * len(latest[b_part])))  # same size, damaged
    got = await _store(log).load_all()
    for key in ("model/a", "model/b"):
        assert got[key].startswith(CHUNKED)
        with pytest.raises(ValueError, match="split into parts"):
            decode_value(got[key])


def test_a_limit_too_small_for_any_part_is_refused():
    with pytest.raises(ValueError, match="too small"):
        KafkaCheckpointStore(None, "x:1", "state", max_record_bytes=1000)
