"""Events as the API shows them, and the heartbeat's answer (the events it raised)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from supervisor.domain import Event, EventType


class HeartbeatAck(BaseModel):
    events: list[int] = Field(description="Ids of the events this heartbeat raised.")


class EventOut(BaseModel):
    id: int
    type: EventType
    time: datetime
    node: str | None
    job: str | None
    rank: int | None
    details: dict[str, Any]
    fault_id: int | None
    policy_error: str | None = Field(
        None, description="What the policy raised on this event; it then decided nothing."
    )
    incident_action_id: int | None = Field(
        None,
        description="The remedy whose incident this event was attached to: it arrived while "
        "that remedy ran (or was its old worker's end, seen late) and got no action of its own.",
    )

    @classmethod
    def of(cls, e: Event) -> EventOut:
        assert e.id is not None
        return cls(
            id=e.id,
            type=e.type,
            time=e.time,
            node=e.node,
            job=e.job,
            rank=e.rank,
            details=dict(e.details),
            fault_id=e.fault_id,
            policy_error=e.policy_error,
            incident_action_id=e.incident_action_id,
        )
