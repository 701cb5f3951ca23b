"""Heap release (:mod:`daemon.heap`): glibc keeps freed memory resident until ``malloc_trim``,
and the daemon's main loop trims after each periodic checkpoint when ``state.release_heap``."""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import textwrap

import pytest

from daemon import heap
from daemon.service import Daemon
from daemon.settings import Settings

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")

# In a child process: 200 MiB of 4 KiB malloc blocks (below the mmap threshold: all from the
# heap), touched, then all freed except the last one, which pins the top of the heap.
_CHILD = textwrap.dedent("""
    import ctypes, sys
    from daemon import heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    base = rss_mib()
    blocks = [libc.malloc(4096) for _ in range(51200)]
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    full = rss_mib()
    for b in blocks[:-1]:
        libc.free(b)
    freed = rss_mib()
    released = heap.release_free_heap() if sys.argv[1] == "trim" else None
    print(base, full, freed, rss_mib(), released)
""")


def _child(mode: str) -> tuple[float, float, float, float, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], check=True, capture_output=True,
                         text=True, timeout=120).stdout.split()
    return float(out[0]), float(out[1]), float(out[2]), float(out[3]), out[4]


@glibc
def test_freed_heap_stays_resident_until_released():
    base, full, freed, after, released = _child("keep")
    assert full - base > 180                  # the 200 MiB were resident
    assert freed - base > 180                 # free() gave none of it back (top pinned)
    assert after - base > 180 and released == "None"
    base, full, freed, after, released = _child("trim")
    assert freed - base > 180
    assert after - base < 20, (base, after)   # malloc_trim returned it
    assert released == "True"


@glibc
def test_available_on_glibc():
    assert heap.available()


def test_no_malloc_trim_is_a_no_op(monkeypatch):
    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert not heap.available()
        assert heap.release_free_heap() is False
    finally:
        heap._malloc_trim.cache_clear()


class _IdleConsumer:
    """``getmany`` returns nothing, a bit later; the loop stops after ``polls`` calls."""

    def __init__(self, daemon: Daemon, polls: int):
        self.daemon, self.left = daemon, polls

    async def getmany(self, timeout_ms: int, max_records: int):
        await asyncio.sleep(0.02)
        self.left -= 1
        if self.left <= 0:
            self.daemon.stopping.set()
        return {}


@pytest.mark.parametrize("release", [True, False])
async def test_main_loop_releases_the_heap_after_each_checkpoint(monkeypatch, release):
    d = Daemon(Settings(state={"checkpoint_interval_seconds": 0.01, "release_heap": release}))
    d.clients.consumer = _IdleConsumer(d, polls=6)
    events: list[str] = []
    checkpoint = d.checkpointer.commit

    async def counted_checkpoint(*a, **kw):
        events.append("checkpoint")
        return await checkpoint(*a, **kw)

    monkeypatch.setattr(d.checkpointer, "commit", counted_checkpoint)
    monkeypatch.setattr(heap, "release_free_heap", lambda: events.append("release") or True)
    await d.main_loop()
    assert events.count("checkpoint") == 6    # every poll: the 0.01 s interval has passed
    if release:
        assert events == ["checkpoint", "release"] * 6
    else:
        assert "release" not in events
