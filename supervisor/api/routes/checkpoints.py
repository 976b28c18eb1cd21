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
from pydantic import AfterValidator, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

from supervisor.agent_time import AgentTimeError, agent_time
from supervisor.api.deps import AgentDep, Reader, SupervisorDep, check_node
from supervisor.api.routes.common import check_known
from supervisor.api.schemas import JsonFloat, JsonInt, Name, date_time_text, in_utc
from supervisor.domain import CheckpointReport

router = APIRouter(prefix="/api/v1/checkpoints", tags=["goodput"])

CheckpointEvent = Literal["saved", "loaded"]
# `local`: node-local files (the NumPy demo); `ram`: tmpfs on the node; `peer`: a copy held
# by a partner node's host monitor; `durable`: shared storage; `emergency`: saved on demand.
CheckpointTier = Literal["local", "ram", "peer", "durable", "emergency"]
MAX_BATCH = 1000
MAX_BYTES = 2**62
MAX_SECONDS = 604_800  # a week


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
        description="When the save or load finished (with a zone), within "
        "`agent_clock_skew_s` of the supervisor's clock."
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
        )


class CheckpointBatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reports: list[CheckpointReportIn] = Field(min_length=1, max_length=MAX_BATCH)


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
        for i, report in enumerate(body.reports):
            agent_time(report.time, ("reports", i, "time"), max_skew_s=skew)
    except AgentTimeError as exc:
        error = {"loc": ("body", *exc.loc), "msg": exc.message, "type": "value_error"}
        raise RequestValidationError([error]) from None
    reports = [r.to_domain() for r in body.reports]
    stored, duplicates = await asyncio.to_thread(
        supervisor.store.record_checkpoint_reports, reports
    )
    return CheckpointBatchAck(stored=stored, duplicates=duplicates)


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
