"""Node and worker states, the rule for node and job names, and the clock of timestamps:
what the host monitor reports and the supervisor reads. Imports nothing from supervisor,
host_monitor or training."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from enum import StrEnum

#: Node and job names: what Kubernetes allows in a name, plus underscores.
NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$"


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


class NodeState(StrEnum):
    """What a host monitor says its node is doing (the host states of Google's supervisor)."""

    UNDEFINED = "undefined"
    RUNNING = "running"
    SPARE = "spare"
    FAILED = "failed"
    COMPLETE = "complete"


class WorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    # The worker left its training loop and is finishing (its last save, its output):
    # not watched for hangs, but bounded by the supervisor's `finishing_timeout_s`.
    FINISHING = "finishing"
    EXITED = "exited"
    # The host monitor stopped hearing from the worker although its process may live.
    LOST = "lost"
    STOPPED = "stopped"
