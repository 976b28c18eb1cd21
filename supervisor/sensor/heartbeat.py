"""The heartbeat a host monitor sends: what one node and its workers look like right now."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from supervisor.domain import NodeState, WorkerState

Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$"),
]


class WorkerReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0, description="Global rank of the worker in the job.")
    local_rank: int = Field(ge=0, description="Rank of the worker on its node.")
    pid: int | None = Field(None, ge=1, description="Process id on the node.")
    state: WorkerState
    step: int | None = Field(None, ge=0, description="Last training step the worker finished.")
    exit_code: int | None = Field(None, description="Exit code, once the worker has exited.")


class GpuReport(BaseModel):
    """A GPU error seen by the host's watchdogs (kernel log XID, nvidia-smi ECC)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["xid", "ecc"]
    gpu: int | None = Field(None, ge=0, description="GPU index on the node.")
    code: int | None = Field(None, ge=0, le=1000, description="XID code (kind xid).")
    count: int | None = Field(
        None, ge=0, description="Uncorrected volatile ECC error count (kind ecc)."
    )
    message: str | None = Field(None, max_length=2000)
    time: datetime | None = Field(None, description="When the watchdog saw it.")

    @model_validator(mode="after")
    def _check_kind(self) -> Self:
        if self.kind == "xid" and self.code is None:
            raise ValueError("code is required for an xid report")
        if self.kind == "ecc" and self.count is None:
            raise ValueError("count is required for an ecc report")
        return self


class HostHeartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: Name = Field(description="Node name.")
    state: NodeState
    job: Name | None = Field(None, description="Job the node serves; none for a spare.")
    workers: list[WorkerReport] = Field(default_factory=list, max_length=1024)
    gpu_reports: list[GpuReport] = Field(default_factory=list, max_length=256)
    address: str | None = Field(None, max_length=255)
    topology: dict[str, str] = Field(
        default_factory=dict, description="e.g. zone, superblock, subblock.", max_length=16
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        if self.state is NodeState.RUNNING and self.job is None:
            raise ValueError("job is required when state is running")
        if self.state is NodeState.SPARE and (self.job is not None or self.workers):
            raise ValueError("a spare node reports no job and no workers")
        ranks = [w.rank for w in self.workers]
        if len(ranks) != len(set(ranks)):
            raise ValueError("workers: ranks must be unique")
        return self
