"""What is said about one event or finished action (a notice), and the record of its
delivery to one route."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from supervisor.domain import (
    NODE_FAILURE_EVENTS,
    ActionRecord,
    ActionStatus,
    Event,
    EventType,
)

Kind = Literal["event", "action"]
Severity = Literal["info", "warning", "critical"]

#: Events that end the condition other events began (on the same node, or rank): an
#: Alertmanager alert raised for the one is resolved by the other.
CLEARS: Mapping[EventType, frozenset[EventType]] = {
    EventType.NODE_RECOVERED: frozenset(
        {EventType.HOST_HEARTBEAT_LOST, EventType.NODE_FLAPPING, EventType.NODE_NOT_READY}
    ),
    EventType.STRAGGLER_RECOVERED: frozenset({EventType.STRAGGLER}),
    EventType.JOB_BUDGET_RESET: frozenset({EventType.JOB_GIVEN_UP}),
}
#: Events that stop training or take a node out, rather than inform.
WARNING_EVENTS = NODE_FAILURE_EVENTS | {
    EventType.HANG,
    EventType.WORKLOAD_DOWN,
    # A job with no checkpoint committing loses everything since the last one.
    EventType.CHECKPOINT_FAILED,
}


@dataclass(frozen=True, slots=True)
class Notice:
    kind: Kind
    id: int
    type: str
    time: datetime
    summary: str
    severity: Severity
    job: str | None = None
    node: str | None = None
    rank: int | None = None
    #: How a finished action ended (succeeded, failed); None for an event.
    outcome: str | None = None
    reason: str = ""
    error: str | None = None
    event_id: int | None = None
    fault_id: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.id,
            "type": self.type,
            "time": self.time.isoformat(),
            "summary": self.summary,
            "severity": self.severity,
            "job": self.job,
            "node": self.node,
            "rank": self.rank,
            "outcome": self.outcome,
            "reason": self.reason,
            "error": self.error,
            "event_id": self.event_id,
            "fault_id": self.fault_id,
            "details": dict(self.details),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Notice:
        return cls(**{**data, "time": datetime.fromisoformat(data["time"])})


def event_notice(event: Event) -> Notice:
    assert event.id is not None, "only recorded events are notified"
    return Notice(
        kind="event",
        id=event.id,
        type=event.type.value,
        time=event.time,
        summary=f"{event.type.value.replace('_', ' ')}{_where(event.job, event.node, event.rank)}",
        severity=event_severity(event.type),
        job=event.job,
        node=event.node,
        rank=event.rank,
        fault_id=event.fault_id,
        error=event.policy_error,
        reason=str(event.details.get("reason") or ""),
        details=dict(event.details),
    )


def event_severity(type_: EventType) -> Severity:
    if type_ is EventType.JOB_GIVEN_UP:
        return "critical"  # a job left broken: somebody must look
    return "warning" if type_ in WARNING_EVENTS else "info"


def action_notice(action: ActionRecord) -> Notice | None:
    """A notice for a finished action; None for one still pending or running."""
    if not action.status.finished:
        return None
    failed = action.status is ActionStatus.FAILED
    where = _where(action.job, action.node, None)
    dry = "dry run, nothing done: " if action.dry_run else ""
    return Notice(
        kind="action",
        id=action.id,
        type=action.type.value,
        time=action.finished_at or action.created_at,
        summary=f"{dry}{action.type.value.replace('_', ' ')} {action.status.value}{where}",
        severity="critical" if failed else "info",
        job=action.job,
        node=action.node,
        outcome=action.status.value,
        reason=action.reason,
        error=action.error,
        event_id=action.event_id,
        fault_id=action.fault_id,
        details={
            "params": dict(action.params),
            "attempts": action.attempts,
            **({"dry_run": True} if action.dry_run else {}),
        },
    )


def _where(job: str | None, node: str | None, rank: int | None) -> str:
    parts = [f"{label} {value}" for label, value in (("node", node), ("job", job)) if value]
    if rank is not None:
        parts.append(f"rank {rank}")
    return f": {', '.join(parts)}" if parts else ""


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One notice sent to one route: recorded pending before the first attempt."""

    id: int
    route: str
    sink: str
    notice: Notice
    status: DeliveryStatus
    attempts: int
    created_at: datetime
    updated_at: datetime
    last_error: str | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class NewDelivery:
    route: str
    sink: str
    notice: Notice
