"""The body of the supervisor's POST /api/v1/heartbeats, as this agent sends it.

These are the heartbeat types of the neutral package, the supervisor's own, so the agent
and the supervisor cannot drift apart; the agent encodes them with msgspec, the supervisor
decodes them with it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport, check_heartbeat
from resiliency_protocol.states import NAME_PATTERN

#: The supervisor's rule for node and job names, for the agent's pydantic settings.
Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=NAME_PATTERN)]

__all__ = ["GpuReport", "HostHeartbeat", "Name", "WorkerReport", "check_heartbeat"]
