"""Checkpoint reports: the workers' saves and loads, forwarded in batches by host monitors.

POST is the host monitors' (agent credential: every report names its node, refused with
403 unless that is the credential's, supervisor/identity). A batch is committed before it is
acknowledged, and idempotent by each report's `id`: a host monitor that did not get the
acknowledgement sends the batch again, and nothing is stored twice. This is not the
heartbeat path: checkpoints are rare (every few minutes per worker).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from supervisor.agent_time import AgentTimeError, agent_time
from supervisor.api.deps import AgentDep, Reader, SupervisorDep, check_node
from supervisor.api.routes.common import check_known
from supervisor.api.schemas import JsonFloat, JsonInt, Name, date_time_text, in_utc
from supervisor.domain import CheckpointReport, Event, EventType, utcnow
from supervisor.event_details import CheckpointFailedDetails

router = APIRouter(prefix="/api/v1/checkpoints", tags=["goodput"])

CheckpointEvent = Literal["saved", "loaded", "failed"]
# `local`: node-local files (the NumPy demo); `ram`: tmpfs on the node; `peer`: a copy held
# by a partner node's host monitor; `durable`: shared storage; `emergency`: saved on demand.
CheckpointTier = Literal["local", "ram", "peer", "durable", "emergency"]
MAX_BATCH = 1000
MAX_BYTES = 2**62
MAX_SECONDS = 604_800  # a week
MAX_ERROR_CHARS = 1000


class CheckpointReportIn(BaseModel):
    """One checkpoint saved or loaded by one worker (rank)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="Unique id of the report, chosen by the host monitor; a report sent "
        "again with the same id is stored once.",
    )
    node: Name
    job: Name | None = Field(None, description="Job the worker belongs to.")
    rank: JsonInt = Field(ge=0, le=10_000_000)
    event: CheckpointEvent
    step: JsonInt = Field(ge=0, le=2**62, description="Step of the checkpoint.")
    duration_s: JsonFloat = Field(
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="Seconds the save or load blocked the training loop.",
    )
    tier: CheckpointTier = Field(description="For a load: the tier that served it.")
    time: Annotated[AwareDatetime, BeforeValidator(date_time_text), AfterValidator(in_utc)] = Field(
        description="When the save or load finished (with a zone): within "
        "`agent_clock_skew_s` of the supervisor's clock, or, when the batch says when it "
        "was sent (`sent_at`), at most a week before that."
    )
    bytes: JsonInt | None = Field(
        None, ge=0, le=MAX_BYTES, description="Size of this rank's checkpoint, when known."
    )
    total_s: JsonFloat | None = Field(
        None,
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="Seconds from the start of the save or load to its commit, when known.",
    )
    error: str | None = Field(
        None,
        validate_default=True,
        max_length=MAX_ERROR_CHARS,
        description="Why the save did not commit: given with a `failed` report, and only with one.",
    )

    @field_validator("error")
    @classmethod
    def _error_with_failed(cls, error: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("event") == "failed") != (error is not None):
            raise ValueError("given with a `failed` report, and only with one")
        return error

    def to_domain(self) -> CheckpointReport:
        return CheckpointReport(
            report_id=self.id,
            node=self.node,
            job=self.job,
            rank=self.rank,
            event=self.event,
            step=self.step,
            duration_s=self.duration_s,
            tier=self.tier,
            time=self.time,
            size_bytes=self.bytes,
            total_s=self.total_s,
            error=self.error,
        )


class CheckpointBatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reports: list[CheckpointReportIn] = Field(min_length=1, max_length=MAX_BATCH)
    sent_at: (
        Annotated[AwareDatetime, BeforeValidator(date_time_text), AfterValidator(in_utc)] | None
    ) = Field(
        None,
        description="When the host monitor sent this batch, by its clock: checked against "
        "`agent_clock_skew_s`; the reports' times are then checked against it, so that "
        "reports a host monitor kept while the supervisor was down are still taken.",
    )


class CheckpointBatchAck(BaseModel):
    """Sent once the batch is committed."""

    stored: int = Field(description="Reports stored now.")
    duplicates: int = Field(description="Reports already stored (a retried batch).")


class CheckpointReportOut(BaseModel):
    id: str
    node: str
    job: str | None
    rank: int
    event: CheckpointEvent
    step: int
    duration_s: float
    tier: CheckpointTier
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
    summary="Report checkpoints saved or loaded by workers (host monitors; idempotent by id)",
)
async def report_checkpoints(
    supervisor: SupervisorDep, agent: AgentDep, body: CheckpointBatchIn
) -> CheckpointBatchAck:
    for i, report in enumerate(body.reports):
        check_node(supervisor, agent, report.node, f"reports.{i}.node")
    skew = supervisor.settings.agent_clock_skew_s
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
                    max_age_s=max(MAX_SECONDS, skew),
                )
    except AgentTimeError as exc:
        error = {"loc": ("body", *exc.loc), "msg": exc.message, "type": "value_error"}
        raise RequestValidationError([error]) from None
    reports = [r.to_domain() for r in body.reports]
    new, duplicates = await asyncio.to_thread(
        supervisor.store.record_new_checkpoint_reports, reports
    )
    for stored in new:
        supervisor.metrics.job_checkpoints.count(stored)
    failed = [failed_event(r) for r in new if r.event == "failed"]
    if failed:  # stored with the reports above: a retried batch raises nothing twice
        supervisor.raise_events(failed)
    return CheckpointBatchAck(stored=len(new), duplicates=duplicates)


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
    supervisor: SupervisorDep,
    job: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[CheckpointReportOut]:
    check_known(supervisor, job=job)
    reports = await asyncio.to_thread(supervisor.store.list_checkpoint_reports, job, limit)
    return [CheckpointReportOut.of(r) for r in reports]
