"""Return freed heap memory to the operating system (glibc ``malloc_trim``).

Why the daemon needs it: glibc's ``malloc`` reuses a freed block for later allocations but
gives memory back to the OS only when the free space sits at the top of the heap. The daemon
makes bursts of large short-lived allocations (a checkpoint's JSON of the pools, pending joins
and recently joined ids of every model; batch matrices), and once glibc's dynamic mmap
threshold has risen (it does after the first large block is freed) they come from the main
heap. Any long-lived object allocated above them pins the heap's top, so the heap ratchets up
in steps of free but resident memory: resident memory grows for tens of minutes although no
Python object does. The figures (smaps of the daemon under the load of
``tests/reliability/test_load_soak.py``, with and without trimming) are in docs/reliability.md,
row "soak, 30 minutes".

``malloc_trim(0)`` returns the free memory at the top of every arena and, since glibc 2.8,
``madvise(MADV_DONTNEED)``\\ s the free pages inside them. It is glibc-only: on other C
libraries (musl, macOS) :func:`release_free_heap` does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """True where :func:`release_free_heap` can do anything (glibc)."""
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS; True if glibc released any memory.

    Takes a few ms on the daemon's heap (walks the free lists of every arena); call it after
    a burst of large short-lived allocations, e.g. a checkpoint, not per message."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
