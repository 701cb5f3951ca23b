"""The retry helper's ``stop_on_failure_only`` mode (:mod:`daemon.retry`), which the bin-map
publish uses: a stop ends the retry only at a failed attempt. The other modes are tested with
the registry (``tests/daemon/test_registry.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from daemon import retry


async def test_a_stop_does_not_prevent_an_attempt():
    stop = asyncio.Event()
    stop.set()

    async def ok():
        return "ok"

    assert await retry.retry("x", ok, stop=stop, stop_on_failure_only=True) == "ok"
    with pytest.raises(retry.Stopped):  # the default mode stops before the attempt
        await retry.retry("x", ok, stop=stop)


@pytest.mark.parametrize("on_failure_only", [True, False])
async def test_a_stop_during_a_wait_ends_the_retry_at_the_next_failure(on_failure_only):
    stop = asyncio.Event()
    calls: list[float] = []
    errors: list[str] = []

    async def failing():
        calls.append(time.monotonic())
        if len(calls) == 1:
            asyncio.get_running_loop().call_later(0.01, stop.set)  # during the first wait
        raise ConnectionError(f"down {len(calls)}")

    with pytest.raises(retry.Stopped) as info:
        await retry.retry("x", failing, stop=stop, first=0.2,
                          on_error=lambda e, _delay: errors.append(str(e)),
                          stop_on_failure_only=on_failure_only)
    assert errors == ["down 1"]  # the failure after the stop is not reported as retried
    if on_failure_only:  # the wait runs in full, then one more attempt fails
        assert len(calls) == 2 and calls[1] - calls[0] >= 0.19
        assert str(info.value.__cause__) == "down 2"
    else:  # the stop cuts the wait short: no further attempt
        assert len(calls) == 1 and str(info.value.__cause__) == "down 1"
