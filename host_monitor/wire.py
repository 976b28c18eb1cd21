"""The body of the supervisor's POST /api/v1/heartbeats, as this agent sends it.

These are the heartbeat types of the neutral package, the supervisor's own, so the agent
and the supervisor cannot drift apart; the agent encodes them with msgspec, the supervisor
decodes them with it.
"""

from __future__ import annotations

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport, check_heartbeat
from resiliency_protocol.states import Name  # the rule for node and job names

__all__ = ["GpuReport", "HostHeartbeat", "Name", "WorkerReport", "check_heartbeat"]
