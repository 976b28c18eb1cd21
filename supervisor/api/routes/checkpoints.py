"""Checkpoint reports: the workers' saves and loads, forwarded in batches by host monitors.

POST is the host monitors' (agent credential: every report names its node, refused with
403 unless that is the credential's, supervisor/identity). A batch is committed before it is
acknowledged, and idempotent by each report's `id`: a host monitor that did not get the
acknowledgement sends the batch again, and nothing is stored twice. A report from an
older world than its job's newest is acknowledged and not recorded (supervisor/sensor/
worlds.py). This is not the heartbeat path: checkpoints are rare (every few minutes per worker).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from resiliency_protocol.checkpoint_reports import (
    MAX_CHECKPOINT_SECONDS,
    CheckpointBatchAck,
    CheckpointBatchIn,
    CheckpointEvent,
    CheckpointReportIn,
    Tier,
)
from supervisor.agent_time import AgentTimeError, agent_time
from supervisor.api.deps import AgentDep, Reader, check_node
from supervisor.api.parts import (
    Known,
    MetricsDep,
    ProgressLog,
    Refusals,
    SettingsDep,
    SupervisorDep,
    Worlds,
)
from supervisor.api.routes.common import check_known
from supervisor.domain import CheckpointReport, Event, EventType, utcnow
from supervisor.event_details import CheckpointFailedDetails

router = APIRouter(prefix="/api/v1/checkpoints", tags=["goodput"])


def to_domain(report: CheckpointReportIn) -> CheckpointReport:
    """The report as the store keeps it."""
    return CheckpointReport(
        report_id=report.id,
        node=report.node,
        job=report.job,
        rank=report.rank,
        event=report.event,
        step=report.step,
        duration_s=report.duration_s,
        tier=report.tier.value,
        time=report.time,
        size_bytes=report.bytes,
        total_s=report.total_s,
        error=report.error,
    )


class CheckpointReportOut(BaseModel):
    id: str
    node: str
    job: str | None
    rank: int
    event: CheckpointEvent
    step: int
    duration_s: float
    tier: Tier
    time: datetime
    bytes: int | None
    total_s: float | None
    error: str | None = None

    @classmethod
    def of(cls, r: CheckpointReport) -> CheckpointReportOut:
        return cls(
            id=r.report_id,
            node=r.node,
            job=r.job,
            rank=r.rank,
            event=r.event,
            step=r.step,
            duration_s=r.duration_s,
            tier=r.tier,
            time=r.time,
            bytes=r.size_bytes,
            total_s=r.total_s,
            error=r.error,
        )


@router.post(
    "",
    response_model=CheckpointBatchAck,
    response_model_exclude_defaults=True,  # `refused` only when some were
    summary="Report checkpoints saved or loaded by workers (host monitors; idempotent by id)",
)
async def report_checkpoints(
    supervisor: SupervisorDep,
    progress: ProgressLog,
    worlds: Worlds,
    metrics: MetricsDep,
    settings: SettingsDep,
    refusals: Refusals,
    agent: AgentDep,
    body: CheckpointBatchIn,
) -> CheckpointBatchAck:
    for i, report in enumerate(body.reports):
        check_node(refusals, agent, report.node, f"reports.{i}.node")
    skew = settings.agent_clock_skew_s
    try:
        if body.sent_at is None:  # a host monitor that does not say: each time as it is
            for i, report in enumerate(body.reports):
                agent_time(report.time, ("reports", i, "time"), max_skew_s=skew)
        else:
            # The agent's clock is checked on the send; a report may be old (kept in its
            # outbox while the supervisor was down), never newer than its send.
            sent = agent_time(body.sent_at, ("sent_at",), max_skew_s=skew)
            for i, report in enumerate(body.reports):
                agent_time(
                    report.time,
                    ("reports", i, "time"),
                    max_skew_s=skew,
                    now=sent,
                    max_age_s=max(MAX_CHECKPOINT_SECONDS, skew),
                )
    except AgentTimeError as exc:
        error = {"loc": ("body", *exc.loc), "msg": exc.message, "type": "value_error"}
        raise RequestValidationError([error]) from None
    fresh = [r for r in body.reports if worlds.checkpoint(r.job, r.world)]
    reports = [to_domain(r) for r in fresh]
    new, duplicates = await asyncio.to_thread(progress.record_new_checkpoint_reports, reports)
    for stored in new:
        metrics.job_checkpoints.count(stored)
    failed = [failed_event(r) for r in new if r.event == "failed"]
    if failed:  # stored with the reports above: a retried batch raises nothing twice
        supervisor.raise_events(failed)
    refused = len(body.reports) - len(fresh)
    return CheckpointBatchAck(stored=len(new), duplicates=duplicates, refused=refused)


def failed_event(report: CheckpointReport) -> Event:
    """The `checkpoint_failed` event of a failed save's report."""
    details = CheckpointFailedDetails(
        rank=report.rank,
        step=report.step,
        tier=report.tier,
        error=report.error,
        report_id=report.report_id,
    )
    return Event(
        type=EventType.CHECKPOINT_FAILED,
        time=utcnow(),
        node=report.node,
        job=report.job,
        rank=report.rank,
        details=details.mapping(),
    )


@router.get(
    "",
    response_model=list[CheckpointReportOut],
    dependencies=[Reader],
    summary="The newest checkpoint reports, newest first",
)
async def list_checkpoints(
    progress: ProgressLog,
    known: Known,
    job: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[CheckpointReportOut]:
    check_known(known, job=job)
    reports = await asyncio.to_thread(progress.list_checkpoint_reports, job, limit)
    return [CheckpointReportOut.of(r) for r in reports]
