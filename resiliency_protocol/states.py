"""Node and worker states and the rule for node and job names: what the host monitor
reports and the supervisor reads. Imports nothing from supervisor, host_monitor or
training."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import StringConstraints

#: Node and job names: what Kubernetes allows in a name, plus underscores.
NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$"

#: A node's or job's name in a pydantic body.
Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=NAME_PATTERN)]


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
