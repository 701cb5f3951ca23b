"""Local checkpoint backend: file names of any allowed model name.

Model names have up to 255 characters; escaped, ``model/<name>`` grew past the file-name limit
(255 bytes) and ``save`` failed with ENAMETOOLONG, and since records are saved in order, every
model sorted after it was never saved again.
"""

from __future__ import annotations

import os

import pytest

from daemon.checkpoint.store import LocalCheckpointStore

NAMES = ["a", "fraud v3/€", "m" * 255, "é" * 255, "/" * 255, "%" * 200 + "x" * 55,
         "m" * 254 + "n"]


async def test_model_names_of_any_allowed_length_round_trip(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    records = {f"model/{n}": f"state of {n}".encode() for n in NAMES}
    records["partition/0"] = b'{"offsets": {}}'
    await store.save(records)
    for p in tmp_path.iterdir():
        assert len(os.fsencode(p.name)) <= 255, p.name
    assert await store.load_all() == records
    assert await LocalCheckpointStore(tmp_path).load_all() == records  # after a restart
    await store.save({f"model/{NAMES[3]}": b"v2"})
    assert (await store.load_all())[f"model/{NAMES[3]}"] == b"v2"
    assert len(list(tmp_path.glob("*ckpt"))) == len(records)  # replaced, not duplicated


async def test_short_names_keep_their_existing_files(tmp_path):
    """Files written before the change (escaped key + .ckpt) are read and replaced in place."""
    (tmp_path / "model%2Fold.ckpt").write_bytes(b"old")
    (tmp_path / "partition%2F0.ckpt").write_bytes(b"{}")
    store = LocalCheckpointStore(tmp_path)
    assert await store.load_all() == {"model/old": b"old", "partition/0": b"{}"}
    await store.save({"model/old": b"new"})
    assert (tmp_path / "model%2Fold.ckpt").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model%2Fold.ckpt",
                                                         "partition%2F0.ckpt"]


async def test_one_failing_record_does_not_stop_the_others(tmp_path, monkeypatch):
    store = LocalCheckpointStore(tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if "model%2Fb" in os.fspath(dst):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="model/b"):
        await store.save({"model/a": b"1", "model/b": b"2", "model/c": b"3"})
    monkeypatch.setattr(os, "replace", real_replace)
    assert await store.load_all() == {"model/a": b"1", "model/c": b"3"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
