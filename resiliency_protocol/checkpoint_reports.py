"""Checkpoint reports, from the worker to its host monitor and from the host monitor to
the supervisor, and the checkpoint tiers they name.

A worker reports each save, load or failed save (`CheckpointReport`, POST
/v1/workers/{rank}/checkpoints); its host monitor keeps it in an outbox and forwards it
in batches (`CheckpointBatchIn` of `CheckpointReportIn`, POST /api/v1/checkpoints with
its agent credential), which the supervisor acknowledges once committed
(`CheckpointBatchAck`). Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

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

from resiliency_protocol.json_types import JsonFloat, JsonInt, date_time_text, in_utc
from resiliency_protocol.states import Name


class Tier(StrEnum):
    """Where a checkpoint was saved, or which tier served a load."""

    LOCAL = "local"  # node-local files (the NumPy demo)
    RAM = "ram"  # tmpfs on the node
    PEER = "peer"  # a copy held by a partner node's host monitor
    DURABLE = "durable"  # shared storage
    EMERGENCY = "emergency"  # saved on demand (an emergency checkpoint)


CheckpointEvent = Literal["saved", "loaded", "failed"]
MAX_CHECKPOINT_BYTES = 2**62
MAX_CHECKPOINT_SECONDS = 604_800  # a week
MAX_CHECKPOINT_ERROR_CHARS = 1000
#: Reports per batch the supervisor takes.
MAX_BATCH = 1000
#: The supervisor's route, relative to its base URL.
SUPERVISOR_PATH = "/api/v1/checkpoints"
#: The header of a worker's checkpoint report that names it: a report sent again (its
#: answer timed out, though the host monitor may have taken it) is kept once, and
#: forwarded under an id made of it. A header, not a field, so that a host monitor that
#: predates it takes the body as it is.
REPORT_KEY_HEADER = "Idempotency-Key"
REPORT_KEY_PATTERN = r"^[A-Za-z0-9_-]{8,32}$"


def error_with_failed(error: str | None, info: ValidationInfo) -> str | None:
    """An `error` comes with a `failed` report, and only with one."""
    if (info.data.get("event") == "failed") != (error is not None):
        raise ValueError("given with a `failed` report, and only with one")
    return error


class CheckpointReport(BaseModel):
    """POST /v1/workers/{rank}/checkpoints: a checkpoint saved, loaded or failed.

    A load is reported with the tier that served it; a save that did not commit as
    `failed`, with the tier it was for and the error. `bytes` and `total_s` are optional:
    older clients (and the NumPy demo) leave them out.
    """

    model_config = ConfigDict(extra="forbid")
    event: CheckpointEvent
    step: int = Field(ge=0)
    duration_s: float = Field(ge=0, description="Seconds the training loop was blocked.")
    tier: Tier
    bytes: int | None = Field(
        None, ge=0, le=MAX_CHECKPOINT_BYTES, description="Size of this rank's checkpoint."
    )
    total_s: float | None = Field(
        None,
        ge=0,
        le=float(MAX_CHECKPOINT_SECONDS),
        allow_inf_nan=False,
        description="Seconds from the start of the save or load to its commit, in all.",
    )
    error: str | None = Field(
        None,
        validate_default=True,
        max_length=MAX_CHECKPOINT_ERROR_CHARS,
        description="Why the save failed (`failed` reports only).",
    )

    _error_with_failed = field_validator("error")(error_with_failed)


class CheckpointRecordOut(BaseModel):
    """GET /v1/checkpoints: a report as the host monitor received it, and when."""

    rank: int
    time: str
    report: CheckpointReport


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
        le=MAX_CHECKPOINT_SECONDS,
        allow_inf_nan=False,
        description="Seconds the save or load blocked the training loop.",
    )
    tier: Tier = Field(description="For a load: the tier that served it.")
    time: Annotated[AwareDatetime, BeforeValidator(date_time_text), AfterValidator(in_utc)] = Field(
        description="When the save or load finished (with a zone): within "
        "`agent_clock_skew_s` of the supervisor's clock, or, when the batch says when it "
        "was sent (`sent_at`), at most a week before that."
    )
    bytes: JsonInt | None = Field(
        None,
        ge=0,
        le=MAX_CHECKPOINT_BYTES,
        description="Size of this rank's checkpoint, when known.",
    )
    total_s: JsonFloat | None = Field(
        None,
        ge=0,
        le=MAX_CHECKPOINT_SECONDS,
        allow_inf_nan=False,
        description="Seconds from the start of the save or load to its commit, when known.",
    )
    world: JsonInt | None = Field(
        None,
        ge=0,
        le=2**62,
        description="The world (the job's attempt) of the worker that saved or loaded it: a "
        "report from an older world than the job's newest is not recorded (`refused`).",
    )
    error: str | None = Field(
        None,
        validate_default=True,
        max_length=MAX_CHECKPOINT_ERROR_CHARS,
        description="Why the save did not commit: given with a `failed` report, and only with one.",
    )

    _error_with_failed = field_validator("error")(error_with_failed)


# POST /api/v1/checkpoints: a host monitor's batch of its workers' reports (no docstring:
# the OpenAPI document would carry it).
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
    refused: int = Field(
        0,
        description="Reports from an older world than their job's newest: not recorded "
        "(they never drive an action in the newer world), and not to be sent again. "
        "Left out when none was.",
    )
