"""Every timing margin of the tests, from one setting: TEST_TIME_SCALE (default 1).

A margin is how long a test waits for something that happens on its own (a process
ready, an event seen, a heartbeat lost) before it calls the wait a failure. A wait on
an event ends as soon as the event comes, so a larger scale slows only the failures:
on a slow or busy machine, `TEST_TIME_SCALE=3 make test` is one knob, not forty. The
product's own timeouts (a heartbeat timeout a test configures) are not margins and do
not scale, unless a test sets one only so that a fault it does not inject goes unseen
(tests/kube_real_fixtures.py: a rank's silence on the real control plane).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _scale() -> float:
    raw = os.environ.get("TEST_TIME_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"TEST_TIME_SCALE must be a number, got {raw!r}") from None
    if not scale > 0:
        raise ValueError(f"TEST_TIME_SCALE must be above 0, got {raw!r}")
    return scale


SCALE = _scale()


def scaled(seconds: float) -> float:
    """`seconds` of margin on this machine."""
    return seconds * SCALE


def wait_until(predicate: Callable[[], T | None], what: str, within: float) -> T:
    """Poll `predicate` until it returns something true (returned), for `scaled(within)`
    seconds at most; then fail naming `what`."""
    deadline = time.monotonic() + scaled(within)
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {scaled(within):g} s"
        time.sleep(0.1)
    return value


async def wait_until_async(predicate: Callable[[], T | None], what: str, within: float) -> T:
    """`wait_until` on the running event loop: its tasks run between the polls."""
    deadline = time.monotonic() + scaled(within)
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {scaled(within):g} s"
        await asyncio.sleep(0.01)
    return value
