"""The kernels of the ingest path, chosen once per process: C (``daemon._speedups``) or Python.

``daemon/csrc/`` (the extension module ``daemon._speedups``) holds native versions of the
per-event loops of ingestion: parsing events and extracting their fields
(:func:`daemon.columns.scan_python` and its C twin), the join loop (:meth:`daemon.join.JoinStore.offer`), the
blake2b pool routing (:func:`route_uniform_fast`, reference :func:`lpcal.pools.route_uniform`;
ids of up to 128 bytes are hashed 4 or 8 side by side in AVX2 / AVX-512F vector lanes when the
CPU has them, see ``hash_lanes``) and the sampling prefilter of hot models
(``sample_records``: the decision of :meth:`daemon.model_state.ModelState.sample` taken on raw
message bytes, one call per partition batch, see :meth:`daemon.ingest.Ingest._sample_out`).
Each one computes exactly what its pure-Python reference computes;
``tests/daemon/test_native.py`` and ``tests/daemon/test_sampling.py`` check that on random and
adversarial input, at every hash width the CPU runs.

**One boundary.** :data:`KERNELS` is the one object through which every user reaches a kernel:
a :class:`Kernels` whose fields are the C functions (wrapped to return what the reference
returns), or :data:`PYTHON`, whose fields are the pure-Python references. Both have one
signature and one result per field, so no user asks which path runs (no ``is None`` branch).
Users read ``native.KERNELS.<kernel>`` when they run, never a copy, so :func:`pure_python`
switches a whole process by rebinding that one name. Both are built on first use (the
references live in the modules that use them, which import this one). The codes the C kernels
share with Python (event kinds, the pending join entry, the attribute names of a model's join
state) are defined in :mod:`daemon.codes`; a built module whose copies differ is not used.

The extension is built by ``pip install`` when a C compiler and the Python headers are present,
and skipped with a warning otherwise (``optional = true`` in pyproject.toml). Without it, or
with ``LPCAL_NATIVE=0`` in the environment, the daemon runs the pure-Python path, with the same
results at a lower ingest throughput (measured by ``tests/bench/bench_ingest.py``).
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
from typing import Any

import numpy as np

from daemon import codes

__all__ = ["KERNELS", "PYTHON", "Kernels", "describe", "disabled_by_env", "pure_python",
           "route_uniform_fast"]


@dataclass(frozen=True, slots=True)
class Kernels:
    """The kernels one process runs: C functions of ``daemon._speedups`` (:meth:`of_module`)
    or their pure-Python references (:meth:`python`), with one signature and result each."""

    path: str                 # "c" | "python": lpcal_build_info{ingest_path}
    module: ModuleType | None  # daemon._speedups on the C path
    #: ``scan(items, max_model_len, max_id_len, loads=None, max_bytes=None) -> Columns | None``:
    #: the fields of parsed events as columns (reference :func:`daemon.columns.scan_python`)
    scan: Callable[..., Any]
    #: the join's event loop and its row attachment (reference: :mod:`daemon.join_loop`)
    offer_loop: Callable[..., tuple]
    attach_rows: Callable[[list, np.ndarray], None]
    #: ``route_uniform(ids) -> float64 array``: blake2b uniforms of str ids
    #: (reference :func:`lpcal.pools.route_uniform`)
    route_uniform: Callable[[list], np.ndarray]
    #: the sampling prefilter on raw bytes: ``sample_out(values, rates, max_bytes, max_id_len,
    #: fallback=None, placed=None) -> (mask, counts)`` and ``sample_records(records, ...) ->
    #: (kept, values, counts)``. The reference decides nothing on raw bytes (it keeps every
    #: record: :meth:`daemon.model_state.ModelState.offer` samples them after parsing, by the
    #: same rule); the C kernel drops the events it can decide there.
    sample_out: Callable[..., tuple]
    sample_records: Callable[..., tuple]

    @classmethod
    def of_module(cls, mod: ModuleType) -> Kernels:
        """The C kernels of ``mod``; ValueError if its shared codes differ from
        :data:`daemon.codes.SHARED_WITH_C`. One object per module (equal on every call)."""
        wrong = {k: getattr(mod, k, None) for k, v in codes.SHARED_WITH_C.items()
                 if getattr(mod, k, None) != v}
        if wrong:
            raise ValueError(f"{mod.__name__} disagrees with daemon.codes on {wrong}")
        got = _C_KERNELS.get(id(mod))
        if got is None or got.module is not mod:
            got = _C_KERNELS[id(mod)] = _c_kernels(mod)
        return got

    @classmethod
    def python(cls) -> Kernels:
        """The pure-Python references."""
        from daemon import columns, join_loop
        from lpcal.pools import route_uniform

        return cls("python", None, columns.scan_python, join_loop.offer_loop,
                   join_loop.attach_rows, route_uniform, _sample_out_python,
                   _sample_records_python)


_C_KERNELS: dict[int, Kernels] = {}


def _c_kernels(mod: ModuleType) -> Kernels:
    from daemon import columns
    from lpcal.pools import route_uniform

    scan_c, offer_c, route_c = mod.scan, mod.offer_loop, mod.route_u64
    native_columns = columns.native_columns
    # dtype instances, passed positionally: a third of the cost of ``dtype=np.int64`` per call
    # (about six calls per offer)
    frombuffer = np.frombuffer
    i64, f64, u64 = np.dtype(np.int64), np.dtype(np.float64), np.dtype(np.uint64)

    def scan(items, max_model_len, max_id_len, loads=None, max_bytes=None):
        if type(items) is not list:
            items = list(items)
        if loads is None:
            return native_columns(scan_c(items, max_model_len, max_id_len))
        return native_columns(scan_c(items, max_model_len, max_id_len, loads, max_bytes))

    def offer_loop(m, ttl, event_time, clock, wm0, wm1, kind_l, ids, ts_l, lab_l):
        (clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx, p_groups, live_e,
         live_r) = offer_c(m, ttl, event_time, clock, wm0, wm1, kind_l, ids, ts_l, lab_l)
        return (clock, wm0, wm1, counts, out_ids, frombuffer(out_ts, f64),
                frombuffer(out_lab, i64), frombuffer(b_out, i64), frombuffer(b_idx, i64),
                [(blk, frombuffer(js, i64), frombuffer(rs, i64)) for blk, js, rs in p_groups],
                live_e, frombuffer(live_r, i64))

    def route(ids):
        if type(ids) is list:
            digests = route_c(ids)
            if digests is not None:  # None: an id the kernel does not hash (the reference does)
                return frombuffer(digests, u64).astype(f64) / 2.0**64
        return route_uniform(ids)

    return Kernels("c", mod, scan, offer_loop, mod.attach_rows, route, mod.sample_out,
                   mod.sample_records)


def _sample_out_python(values, rates, max_bytes, max_id_len, fallback=None, placed=None):
    """Reference of ``sample_out``: no message is decided on its raw bytes."""
    return bytes(len(values)), {}


def _sample_records_python(records, rates, max_bytes, max_id_len, fallback=None, placed=None):
    """Reference of ``sample_records``: every record kept, with its value."""
    kept = records if type(records) is list else list(records)
    return kept, [r.value for r in kept], {}


def disabled_by_env() -> bool:
    """Whether ``LPCAL_NATIVE`` asks for the pure-Python path (0, false, no or off)."""
    return os.environ.get("LPCAL_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _choose() -> Kernels:
    if disabled_by_env():
        return _python()
    try:
        from daemon import _speedups
    except ImportError:
        return _python()
    try:
        return Kernels.of_module(_speedups)
    except (AttributeError, ValueError) as e:  # a stale build: rebuild with pip install -e .
        warnings.warn(f"daemon._speedups not used ({e}); running the pure-Python path",
                      RuntimeWarning, stacklevel=2)
        return _python()


_PYTHON: Kernels | None = None
#: the kernels this process runs, chosen on first use (:func:`_kernels`; rebound only by
#: :func:`pure_python`), and the pure-Python path (every kernel its reference): both are
#: module attributes served by ``__getattr__`` until then
KERNELS: Kernels
PYTHON: Kernels


def _python() -> Kernels:
    global _PYTHON
    if _PYTHON is None:
        _PYTHON = Kernels.python()
    return _PYTHON


def _kernels() -> Kernels:
    """:data:`KERNELS`, chosen on first use."""
    k = globals().get("KERNELS")
    if k is None:
        k = globals()["KERNELS"] = _choose()
    return k


def __getattr__(name: str):
    if name == "KERNELS":  # the kernels this process runs (rebound only by pure_python)
        return _kernels()
    if name == "PYTHON":  # the pure-Python path: every kernel is its reference
        return _python()
    if name == "SPEEDUPS":  # the loaded module or None, through the one reference
        return _kernels().module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe() -> str:
    """``"c"`` when the accelerator runs in this process, else ``"python"``."""
    return _kernels().path


def route_uniform_fast(ids: list[str]) -> np.ndarray:
    """:func:`lpcal.pools.route_uniform` of str ids: the same values, hashed in C if it can."""
    return _kernels().route_uniform(ids)


@contextmanager
def pure_python() -> Iterator[None]:
    """Within the block, every user of the accelerator in this process runs its pure-Python
    reference (for the equivalence tests and the benchmark's in-run comparison; a deployment
    sets ``LPCAL_NATIVE=0`` instead): :data:`KERNELS` is :data:`PYTHON`. Not thread-safe:
    nothing else may ingest meanwhile."""
    g = globals()
    saved = _kernels()
    g["KERNELS"] = _python()
    try:
        yield
    finally:
        g["KERNELS"] = saved
