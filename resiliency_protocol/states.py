"""Node and worker states, the rule for node and job names, and the clock of timestamps:
what the host monitor reports and the supervisor reads. Imports nothing from supervisor,
host_monitor or training."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

#: Node and job names: what Kubernetes allows in a name, plus underscores.
NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$"


def utcnow() -> datetime:
    return datetime.now(UTC)


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
    EXITED = "exited"
    # The host monitor stopped hearing from the worker although its process may live.
    LOST = "lost"
    STOPPED = "stopped"
