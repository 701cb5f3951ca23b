"""When the next periodic checkpoint starts (:class:`CheckpointPacing`): every
``state.checkpoint_interval_seconds``, but never sooner than the last full checkpoint's duration
divided by ``state.checkpoint_max_cpu_share`` after that checkpoint started (as Flink's minimum
pause between checkpoints, expressed as a share of the time).

The daemon ingests, checkpoints and serves on one event loop: while a checkpoint runs nothing
is ingested. A checkpoint's cost grows with the models it writes, not with the messages, so
with many models a round of checkpoints can take longer than the interval; without pacing the
loop would then checkpoint back to back and ingest nothing. With pacing, checkpoints take at
most ``max_share`` of the loop's time (their wall-clock duration, which bounds their CPU time):
a 2 s round with a share of 0.1 is followed by the next one 20 s after it started.

Spacing checkpoints out only means more input to replay after a crash (the input since the
last checkpoint, at most the effective interval plus the checkpoint's own duration); nothing
is lost, nothing counted twice (see :mod:`daemon.checkpoint.checkpointer`). Checkpoints
before a release, a rebalance or a shutdown are not paced: they run when they are needed.

Pure: the clock is given, so tests drive it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["DEFAULT_MAX_SHARE", "CheckpointPacing"]

#: The default of ``state.checkpoint_max_cpu_share``: checkpoints cost the ingest at most about
#: a tenth of its throughput (1 / (1 + 0.1) of it is left), and at the default 10 s interval
#: the pacing only moves checkpoints that take more than 1 s (thousands of models).
DEFAULT_MAX_SHARE = 0.1


class CheckpointPacing:
    """The schedule of periodic checkpoints.

    Parameters
    ----------
    interval : float
        ``state.checkpoint_interval_seconds``: the shortest time between the starts of two
        periodic checkpoints.
    max_share : float
        ``state.checkpoint_max_cpu_share``, in (0, 1]: the largest share of the time that
        checkpoints may take.
    clock : callable, default ``time.monotonic``
        Seconds (any origin).

    Attributes
    ----------
    last_at : float
        When the last checkpoint (of any kind) started; the constructor's time before any.
    last_duration : float
        Seconds the last successful full checkpoint took (0 before any).
    """

    def __init__(self, interval: float, max_share: float = DEFAULT_MAX_SHARE, *,
                 clock: Callable[[], float] = time.monotonic):
        if not (math.isfinite(interval) and interval > 0):
            raise ValueError(f"checkpoint interval {interval!r} is not a positive number")
        if not (math.isfinite(max_share) and 0 < max_share <= 1):
            raise ValueError(f"checkpoint max share {max_share!r} is not in (0, 1]")
        self.interval, self.max_share, self.clock = float(interval), float(max_share), clock
        self.last_at = clock()
        self.last_duration = 0.0

    @property
    def effective_interval(self) -> float:
        """Seconds from the start of the last checkpoint to the next periodic one:
        ``max(interval, last_duration / max_share)``."""
        return max(self.interval, self.last_duration / self.max_share)

    def due(self) -> bool:
        """True when the next periodic checkpoint may start."""
        return self.clock() - self.last_at >= self.effective_interval

    def started(self) -> float:
        """Mark a checkpoint as started (any kind: periodic, release, shutdown); its start."""
        self.last_at = now = self.clock()
        return now

    def finished(self, start: float, *, full: bool, ok: bool) -> None:
        """Record the end of the checkpoint started at ``start``. Only successful full
        checkpoints (every assigned partition) set :attr:`last_duration`: a partial one
        (a release) says little about a full round, and a failed one spent its time waiting
        for the broker (the retry comes after the configured interval)."""
        if full and ok:
            self.last_duration = max(0.0, self.clock() - start)
