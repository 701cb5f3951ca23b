"""The in-flight pools are shared by two threads (found by the long crash test).

``Fitter.launch`` hands the sealed epoch's :class:`lpcal.pools.PoolSet` to the fit worker
thread (``fit_pools`` reads it) and keeps it in its model's ``ModelSlot.inflight``; every checkpoint
serialises it on the event-loop thread (``encode_envelope`` -> ``PoolSet.to_dict``). Reads of
a :class:`lpcal.pools.CountTable` are not read-only: they first merge the table's pending rows
(``_compact``), which mutates it. In the long crash test a subprocess daemon died from this
(``ValueError: need at least one array to concatenate`` in ``_compact`` under
``Daemon.checkpoint``), not from a SIGKILL.

The test reproduces the interleaving deterministically: thread A serialises a table while
thread B reads it; a list that pauses A's first pass over the pending rows until B is done
stands in for the scheduler (nothing of lpcal is replaced).
"""

from __future__ import annotations

import threading

import numpy as np

from lpcal.pools import CountTable


class _PausingList(list):
    """Pauses the first iteration (thread A) until ``release`` is set (after thread B ran)."""

    def __init__(self, items, inside: threading.Event, release: threading.Event):
        super().__init__(items)
        self.inside, self.release, self.first = inside, release, True

    def __iter__(self):
        if self.first and threading.current_thread().name == "A":
            self.first = False
            self.inside.set()
            self.release.wait(5)
        return super().__iter__()


def test_serialising_pools_while_the_fit_thread_reads_them_is_safe():
    rng = np.random.default_rng(0)
    table = CountTable(3, 10)
    for _ in range(4):  # pending (not yet compacted) rows, as while an epoch fills
        table.add(rng.dirichlet(np.ones(3), size=50), rng.integers(0, 3, size=50))
    reference = CountTable(3, 10)
    rng = np.random.default_rng(0)
    for _ in range(4):
        reference.add(rng.dirichlet(np.ones(3), size=50), rng.integers(0, 3, size=50))
    want = reference.to_dict()

    inside, release = threading.Event(), threading.Event()
    table._pending = _PausingList(table._pending, inside, release)
    errors: list[BaseException] = []
    out: dict = {}

    def a():  # the event loop: checkpoint serialises the in-flight pools
        try:
            out["a"] = table.to_dict()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def b():  # the fit worker reads the same pools
        inside.wait(5)
        try:
            out["b"] = table.n_bins  # fit_pools reads bins (n_bins, bin_mass, ...)
        finally:
            release.set()

    ta, tb = threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")
    ta.start(), tb.start()
    ta.join(10), tb.join(10)
    assert not errors, errors
    assert table.total == 200 and out["b"] == reference.n_bins
    assert out["a"] == want
