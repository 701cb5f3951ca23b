"""Retrying an awaitable with exponential backoff, a stop event and an optional deadline.

The daemon retries broker calls in four places with the same rule (startup's producer, topic
and consumer calls; reading the checkpoints on assignment; restoring an assignment that
failed; publishing a fitted bin map): wait ``first`` seconds after a failure, doubling up to
``cap``; a stop request cuts the wait short and ends the retry (:class:`Stopped`); errors of
``fatal`` types, and any error once ``deadline`` seconds have passed, are raised at once. The
bin-map publish keeps trying during a shutdown (``stop_on_failure_only``): a stop ends it only
when an attempt fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Stopped(Exception):
    """The stop event was set while retrying ``what``; ``__cause__`` is the last error, if any."""


async def pause(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``, cut short by ``stop``: True if stopped."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def retry(what: str, attempt: Callable[[], Awaitable[T]], *, stop: asyncio.Event,
                first: float = 0.5, cap: float = 10.0, deadline: float | None = None,
                fatal: tuple[type[BaseException], ...] = (),
                on_error: Callable[[Exception, float], None] | None = None,
                wait_first: bool = False, check_stop_first: bool = True,
                stop_on_failure_only: bool = False) -> T:
    """``await attempt()`` until it returns, and return its result.

    After a failure, ``on_error(error, delay)`` is called (to log it; it may raise to give up),
    then the retry waits ``delay`` (``first``, doubling up to ``cap``). ``wait_first``: wait
    once before the first attempt too. Ends with :class:`Stopped` (``what``) when ``stop`` is
    set before an attempt (unless ``check_stop_first`` is false: then only after a failure),
    during a wait, or when an attempt fails while it is set (``on_error`` is then not called);
    with the error itself if it is one of ``fatal`` or ``deadline`` seconds have passed since
    the call. ``stop_on_failure_only``: only the last of these, so a stop never prevents an
    attempt nor cuts a wait short."""
    delay = first
    give_up_at = None if deadline is None else time.monotonic() + deadline
    last: Exception | None = None

    async def wait() -> bool:
        """Wait ``delay``; True if the stop cut it short."""
        if stop_on_failure_only:
            await asyncio.sleep(delay)
            return False
        return await pause(stop, delay)

    if wait_first:
        if await wait():
            raise Stopped(what)
        delay = min(2 * delay, cap)
    while True:
        if (stop.is_set() and not stop_on_failure_only
                and (check_stop_first or last is not None)):
            raise Stopped(what) from last
        try:
            return await attempt()
        except fatal:
            raise
        except Exception as e:  # retried until stopped or past the deadline
            if give_up_at is not None and time.monotonic() > give_up_at:
                raise
            if stop.is_set():
                raise Stopped(what) from e
            last = e
            if on_error is not None:
                on_error(e, delay)
        if await wait():
            raise Stopped(what) from last
        delay = min(2 * delay, cap)
