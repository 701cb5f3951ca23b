"""The BLAS thread limit of the daemon process (:mod:`daemon.blas`): applied to every BLAS
library numpy loaded and put back as found; 0 leaves the libraries alone. The daemon's
startup and shutdown apply and undo it (tests/reliability/test_startup_shutdown.py)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from daemon import blas
from daemon.settings import Settings


def blas_threads() -> list[int]:
    """The thread count of every BLAS library loaded in this process."""
    np.dot(np.ones((2, 2)), np.ones(2))  # numpy's BLAS is loaded
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_limit_applies_to_every_blas_library_and_restores_what_it_found():
    with threadpool_limits(limits=2, user_api="blas"):  # a known starting point above 1
        before = blas_threads()
        assert before and all(n == 2 for n in before)
        restore = blas.limit_threads(1)
        assert blas_threads() == [1] * len(before)
        restore()
        assert blas_threads() == before


def test_zero_keeps_the_library_default():
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        restore = blas.limit_threads(0)
        assert blas_threads() == before
        restore()
        assert blas_threads() == before


def test_setting_defaults_to_one_thread_and_rejects_negative_counts():
    assert Settings().blas_threads == 1
    assert Settings(blas_threads=0).blas_threads == 0
    with pytest.raises(ValueError):
        Settings(blas_threads=-1)
