"""The thread pool of numpy's BLAS library (OpenBLAS or MKL) in the daemon process.

Why the daemon limits it: the daemon computes on two threads, its event loop (ingest: parse,
join, calibrator, monitor) and one fit worker (``lpcal-fit``). OpenBLAS starts one thread per
CPU of the *host* (not of the container's CPU limit) and its threads spin while they wait for
work, so a BLAS or LAPACK call from either thread competes with the other for cores it cannot
use: in the ingest benchmark's online run (2 cores, a fit now and then in the worker), the
warm-up's polynomial fit of the temperature (``np.polyfit``, a 5-point least-squares problem)
took 12 ms per call on the event loop with OpenBLAS's default, 0.2 ms with one thread, and the
daemon's CPU per message fell by about 7% (6 interleaved pairs, in-process, through
``threadpoolctl``). The matrices the daemon multiplies are small (k columns, batches of
rows), so one thread per caller loses nothing.

``blas_threads`` (a daemon setting, default 1) is applied at startup with ``threadpoolctl``
(every BLAS library numpy loaded) and undone at shutdown; 0 keeps the library's own default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("lpcal.daemon")

__all__ = ["limit_threads"]


def limit_threads(threads: int) -> Callable[[], None]:
    """Limit every loaded BLAS library to ``threads`` threads (0: leave them as they are);
    returns the function that puts back the limits found. Logs, and changes nothing, where
    ``threadpoolctl`` is missing."""
    if threads <= 0:
        return _nothing
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        log.info("blas_threads: threadpoolctl is not installed; BLAS keeps its own threads")
        return _nothing
    limiter = threadpool_limits(limits=int(threads), user_api="blas")
    return limiter.restore_original_limits


def _nothing() -> None:
    return None
