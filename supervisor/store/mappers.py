"""Rows to the domain's records: how each table reads back (one function per entity)."""

from __future__ import annotations

from supervisor.domain import (
    ActionRecord,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    Fault,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
    WorkerView,
)
from supervisor.notices import Delivery, DeliveryStatus, Notice
from supervisor.store.models import (
    ActionRow,
    CheckpointReportRow,
    EventRow,
    FaultRow,
    JobRow,
    NodeRow,
    NotificationDeliveryRow,
)


def event_of(row: EventRow) -> Event:
    return Event(
        id=row.id,
        type=EventType(row.type),
        time=row.time,
        node=row.node,
        job=row.job,
        rank=row.rank,
        details=row.details or {},
        fault_id=row.fault_id,
        policy_error=row.policy_error,
        incident_action_id=row.incident_action_id,
    )


def action_of(row: ActionRow) -> ActionRecord:
    return ActionRecord(
        id=row.id,
        type=ActionType(row.type),
        status=ActionStatus(row.status),
        idempotency_key=row.idempotency_key,
        source=row.source,
        created_at=row.created_at,
        job=row.job,
        node=row.node,
        params=row.params or {},
        reason=row.reason,
        event_id=row.event_id,
        fault_id=row.fault_id,
        attempts=row.attempts,
        error=row.error,
        result=row.result,
        started_at=row.started_at,
        finished_at=row.finished_at,
        dry_run=row.dry_run,
        attached_events=tuple(row.attached_events or ()),
    )


def node_of(row: NodeRow) -> NodeView:
    return NodeView(
        name=row.name,
        state=NodeState(row.state),
        job=row.job,
        alive=row.alive,
        last_heartbeat=row.last_heartbeat,
        workers=tuple(
            WorkerView(
                rank=w["rank"],
                local_rank=w["local_rank"],
                pid=w.get("pid"),
                state=WorkerState(w["state"]),
                step=w.get("step"),
                exit_code=w.get("exit_code"),
            )
            for w in row.workers or ()
        ),
        cordoned=row.cordoned,
        flapping=row.flapping,
    )


def job_of(row: JobRow) -> JobView:
    return JobView(
        name=row.name,
        num_dp_replicas=row.num_dp_replicas,
        min_num_dp_replicas=row.min_num_dp_replicas,
        max_num_dp_replicas=row.max_num_dp_replicas,
        num_nodes_per_dp=row.num_nodes_per_dp,
        step_interval_s=row.step_interval_s,
    )


def fault_of(row: FaultRow) -> Fault:
    return Fault(
        id=row.id,
        kind=row.kind,
        created_at=row.created_at,
        node=row.node,
        job=row.job,
        params=row.params or {},
        active=row.active,
        ended_at=row.ended_at,
    )


def checkpoint_of(row: CheckpointReportRow) -> CheckpointReport:
    return CheckpointReport(
        report_id=row.report_id,
        node=row.node,
        job=row.job,
        rank=row.rank,
        event=row.event,
        step=row.step,
        duration_s=row.duration_s,
        tier=row.tier,
        time=row.time,
        size_bytes=row.bytes,
        total_s=row.total_s,
        error=row.error,
    )


def delivery_of(row: NotificationDeliveryRow) -> Delivery:
    return Delivery(
        id=row.id,
        route=row.route,
        sink=row.sink,
        notice=Notice.from_json(row.notice),
        status=DeliveryStatus(row.status),
        attempts=row.attempts,
        created_at=row.created_at,
        updated_at=row.updated_at,
        last_error=row.last_error,
        finished_at=row.finished_at,
    )
