"""The optional C accelerator of the ingest path, and the switch that turns it off.

``daemon/csrc/`` (the extension module ``daemon._speedups``) holds native versions of the
per-event loops of ingestion: parsing events and extracting their fields
(:meth:`daemon.events.EventParser.parse_batch`), the join loop
(:meth:`daemon.join.JoinStore.offer`), the blake2b pool routing
(:func:`lpcal.pools.route_uniform`; ids of up to 128 bytes are hashed 4 or 8 side by side in
AVX2 / AVX-512F vector lanes when the CPU has them, see ``hash_lanes``) and the sampling
prefilter of hot models (``sample_records``: the decision of
:meth:`daemon.model_state.ModelState.sample` taken on raw message bytes, one call per
partition batch, see :meth:`daemon.service.Daemon._sample_out`). Each one computes exactly what
its pure-Python reference computes; ``tests/daemon/test_native.py`` and
``tests/daemon/test_sampling.py`` check that on random and adversarial input, at every hash
width the CPU runs.

The extension is built by ``pip install`` when a C compiler and the Python headers are present,
and skipped with a warning otherwise (``optional = true`` in pyproject.toml). ``SPEEDUPS`` is the
loaded module, or None: then, or with ``LPCAL_NATIVE=0`` in the environment, the daemon runs
the pure-Python path, with the same results at about half the ingest throughput (README,
benchmark 5). ``lpcal_build_info{ingest_path}`` on ``/metrics`` says which path a process
runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import numpy as np

from lpcal.pools import route_uniform

__all__ = ["SPEEDUPS", "describe", "disabled_by_env", "pure_python", "route_uniform_fast"]


def disabled_by_env() -> bool:
    """Whether ``LPCAL_NATIVE`` asks for the pure-Python path (0, false, no or off)."""
    return os.environ.get("LPCAL_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _load() -> ModuleType | None:
    if disabled_by_env():
        return None
    try:
        from daemon import _speedups
    except ImportError:
        return None
    return _speedups


SPEEDUPS: ModuleType | None = _load()


def describe() -> str:
    """``"c"`` when the accelerator runs in this process, else ``"python"``."""
    return "python" if SPEEDUPS is None else "c"


def route_uniform_fast(ids: list[str]) -> np.ndarray:
    """:func:`lpcal.pools.route_uniform` of str ids: the same values, hashed in C if it can."""
    if SPEEDUPS is not None and type(ids) is list:
        digests = SPEEDUPS.route_u64(ids)
        if digests is not None:
            return np.frombuffer(digests, dtype=np.uint64).astype(np.float64) / 2.0**64
    return route_uniform(ids)


@contextmanager
def pure_python() -> Iterator[None]:
    """Within the block, every user of the accelerator in this process runs its pure-Python
    reference (for the equivalence tests and the benchmark's in-run comparison; a deployment
    sets ``LPCAL_NATIVE=0`` instead). Not thread-safe: nothing else may ingest meanwhile."""
    import daemon.columns
    import daemon.join

    mods = (daemon.columns, daemon.join, sys.modules[__name__])
    saved = [m.SPEEDUPS for m in mods]
    for m in mods:
        m.SPEEDUPS = None
    try:
        yield
    finally:
        for m, v in zip(mods, saved):
            m.SPEEDUPS = v
