"""The kernels of the ingest path, chosen once per process: C (``daemon._speedups``) or Python.

``daemon/csrc/`` (the extension module ``daemon._speedups``) holds native versions of the
per-event loops of ingestion: parsing events and extracting their fields
(:func:`daemon.columns.parse_columns`), the join loop (:meth:`daemon.join.JoinStore.offer`), the
blake2b pool routing (:func:`route_uniform_fast`, reference :func:`lpcal.pools.route_uniform`;
ids of up to 128 bytes are hashed 4 or 8 side by side in AVX2 / AVX-512F vector lanes when the
CPU has them, see ``hash_lanes``) and the sampling prefilter of hot models
(``sample_records``: the decision of :meth:`daemon.model_state.ModelState.sample` taken on raw
message bytes, one call per partition batch, see :meth:`daemon.ingest.Ingest._sample_out`).
Each one computes exactly what its pure-Python reference computes;
``tests/daemon/test_native.py`` and ``tests/daemon/test_sampling.py`` check that on random and
adversarial input, at every hash width the CPU runs.

**One boundary.** :data:`KERNELS` is the one object through which every user reaches a kernel:
a :class:`Kernels` whose fields are the C functions, or :data:`PYTHON`, whose fields are all
None (each user then runs its reference). Users read ``native.KERNELS.<kernel>`` when they run,
never a copy, so :func:`pure_python` switches a whole process by rebinding that one name. The
codes the C kernels share with Python (event kinds, the pending join entry) are defined in
:mod:`daemon.codes`; a built module whose copies differ is not used.

The extension is built by ``pip install`` when a C compiler and the Python headers are present,
and skipped with a warning otherwise (``optional = true`` in pyproject.toml). Without it, or
with ``LPCAL_NATIVE=0`` in the environment, the daemon runs the pure-Python path, with the same
results at about 70% of the ingest throughput (``tests/bench/bench_ingest.py``).
``lpcal_build_info{ingest_path}`` on ``/metrics`` says which path a process runs
(:func:`describe`). ``SPEEDUPS`` (the loaded module or None) is ``KERNELS.module``, read
through the same reference.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from daemon import codes
from lpcal.pools import route_uniform

__all__ = ["KERNELS", "PYTHON", "Kernels", "describe", "disabled_by_env", "pure_python",
           "route_uniform_fast"]

_FUNCTIONS = ("scan", "offer_loop", "attach_rows", "route_u64", "sample_out", "sample_records")


@dataclass(frozen=True, slots=True)
class Kernels:
    """The kernels one process runs. Each function field is a function of ``daemon._speedups``
    or None: then its user runs the pure-Python reference named below."""

    path: str                                  # "c" | "python": lpcal_build_info{ingest_path}
    module: ModuleType | None = None           # daemon._speedups on the C path
    #: fields of parsed events as columns (:func:`daemon.columns.columns_python`)
    scan: Callable | None = None
    #: the join's event loop and its row attachment (the loop of ``JoinStore._offer``)
    offer_loop: Callable | None = None
    attach_rows: Callable | None = None
    #: blake2b-64 of str ids (:func:`lpcal.pools.route_uniform`)
    route_u64: Callable | None = None
    #: the sampling prefilter on raw bytes (``ModelState.sample``, after parsing)
    sample_out: Callable | None = None
    sample_records: Callable | None = None

    @classmethod
    def of_module(cls, mod: ModuleType) -> Kernels:
        """The C kernels of ``mod``; ValueError if its shared codes differ from
        :data:`daemon.codes.SHARED_WITH_C`."""
        wrong = {k: getattr(mod, k, None) for k, v in codes.SHARED_WITH_C.items()
                 if getattr(mod, k, None) != v}
        if wrong:
            raise ValueError(f"{mod.__name__} disagrees with daemon.codes on {wrong}")
        return cls("c", mod, **{f: getattr(mod, f) for f in _FUNCTIONS})


#: the pure-Python path: every kernel is its reference
PYTHON = Kernels("python")


def disabled_by_env() -> bool:
    """Whether ``LPCAL_NATIVE`` asks for the pure-Python path (0, false, no or off)."""
    return os.environ.get("LPCAL_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _choose() -> Kernels:
    if disabled_by_env():
        return PYTHON
    try:
        from daemon import _speedups
    except ImportError:
        return PYTHON
    try:
        return Kernels.of_module(_speedups)
    except (AttributeError, ValueError) as e:  # a stale build: rebuild with pip install -e .
        warnings.warn(f"daemon._speedups not used ({e}); running the pure-Python path",
                      RuntimeWarning, stacklevel=2)
        return PYTHON


#: the kernels this process runs (rebound only by :func:`pure_python`)
KERNELS: Kernels = _choose()


def __getattr__(name: str):
    if name == "SPEEDUPS":  # the loaded module or None, through the one reference
        return KERNELS.module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe() -> str:
    """``"c"`` when the accelerator runs in this process, else ``"python"``."""
    return KERNELS.path


def route_uniform_fast(ids: list[str]) -> np.ndarray:
    """:func:`lpcal.pools.route_uniform` of str ids: the same values, hashed in C if it can."""
    route_u64 = KERNELS.route_u64
    if route_u64 is not None and type(ids) is list:
        digests = route_u64(ids)
        if digests is not None:
            return np.frombuffer(digests, dtype=np.uint64).astype(np.float64) / 2.0**64
    return route_uniform(ids)


@contextmanager
def pure_python() -> Iterator[None]:
    """Within the block, every user of the accelerator in this process runs its pure-Python
    reference (for the equivalence tests and the benchmark's in-run comparison; a deployment
    sets ``LPCAL_NATIVE=0`` instead): :data:`KERNELS` is :data:`PYTHON`. Not thread-safe:
    nothing else may ingest meanwhile."""
    global KERNELS
    saved, KERNELS = KERNELS, PYTHON
    try:
        yield
    finally:
        KERNELS = saved
