"""The clock of every timestamp the processes write: the real one, except where the
simulator runs the supervisor's code on a virtual clock (`wall_clock`). Imports nothing
from supervisor, host_monitor or training."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

#: Unix time as read everywhere: the real clock, except inside `wall_clock` (the
#: simulator runs the supervisor's code on a virtual clock).
_wall_time: Callable[[], float] = time.time


def wall_time() -> float:
    """Unix time now (seconds)."""
    return _wall_time()


def utcnow() -> datetime:
    return datetime.fromtimestamp(_wall_time(), UTC)


@contextmanager
def wall_clock(read: Callable[[], float]) -> Iterator[None]:
    """Read Unix time from `read` instead of the real clock, within the block."""
    global _wall_time
    saved, _wall_time = _wall_time, read
    try:
        yield
    finally:
        _wall_time = saved
