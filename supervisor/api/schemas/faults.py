"""Faults: the one to inject (or a schedule of them), and as the API shows them."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypeAlias

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from resiliency_protocol import faults as protocol
from resiliency_protocol.fault_params import (
    DurationS,
    EccCount,
    Gpu,
    Rank,
    Slowdown,
    XidCode,
    params_model,
    takers,
)
from supervisor.api.drill_schemas import SCHEDULE_PATTERN, DrillIn, check_schedule
from supervisor.api.schemas.fields import Name
from supervisor.domain import Fault

if TYPE_CHECKING:
    FaultKind: TypeAlias = str
else:
    # The kinds an operator injects: the values of the protocol's table (FAULTS), as a
    # Literal of strings so that a wrong kind's 422 lists them plainly.
    FaultKind = Literal[tuple(k.value for k in protocol.FAULTS)]

#: Fields refused on a kind whose parameters lack them ("applies to ... only"); the
#: others (rank, gpu, code, count) are taken with any kind and unused where it has none.
TUNING_FIELDS = ("slowdown", "duration_s")


def _an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


class FaultIn(BaseModel):
    """A fault to inject, or a schedule of random faults.

    - `heartbeat_loss`: the node's heartbeats are dropped (for `duration_s`, or until the
      fault is deleted). Works with every backend.
    - `xid`, `ecc`: a GPU error with `code` / `count`; through the node's real watchdog
      when the backend runs processes, else reported straight to the sensor.
    - `node_down` (agent and workers die), `worker_crash` (SIGKILL), `worker_hang`
      (SIGSTOP), `straggler` (a worker runs `1 + slowdown` times slower, stopped and
      continued ten times a second, for `duration_s` or until it exits): real processes,
      local backend only.
    - `schedule`: `"<kind>,<mean_interval_s>"`, e.g. `"random,120"`: faults at random
      with that mean interval on nodes of `job` (or any job) until the fault is deleted;
      or a drill, `{"cron": "0 2 * * *", "kinds": ["worker_crash"]}` (or `every_s`):
      one fault of `kinds` per run, kept on the supervisor's scheduler.
    """

    model_config = ConfigDict(extra="forbid")

    kind: FaultKind | None = None
    schedule: Annotated[
        str | DrillIn | None,
        BeforeValidator(check_schedule),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "pattern": SCHEDULE_PATTERN},
                    DrillIn.model_json_schema(),
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
        None,
        examples=[
            "random,120",
            {"cron": "0 2 * * *", "kinds": [protocol.FaultKind.WORKER_CRASH.value]},
        ],
    )
    node: Name | None = None
    job: Name | None = Field(None, description="Job whose nodes a schedule targets.")
    rank: Rank | None = Field(None, description="Worker to hit.")
    code: XidCode | None = Field(None, description="XID code.")
    gpu: Gpu | None = None
    count: EccCount | None = Field(None, description="Uncorrected ECC count to report.")
    duration_s: DurationS | None = None
    slowdown: Slowdown | None = Field(
        None, description="straggler: 0.5 runs the worker 1.5 times slower (the default)."
    )

    @model_validator(mode="after")
    def _check_kind(self) -> Self:
        if (self.kind is None) == (self.schedule is None):
            raise ValueError("give exactly one of kind and schedule")
        if isinstance(self.schedule, DrillIn):
            if self.job is not None and self.schedule.job not in (None, self.job):
                raise ValueError("schedule.job: differs from job")
            return self
        if self.schedule is not None:
            if float(self.schedule.split(",")[1]) <= 0:
                raise ValueError("schedule: the mean interval must be positive")
            return self
        assert self.kind is not None  # exactly one of the two, as checked above
        if self.node is None:
            raise ValueError(f"node is required for a {self.kind} fault")
        return self._check_params(protocol.FaultKind(self.kind))

    def _check_params(self, kind: protocol.FaultKind) -> Self:
        """The kind's own parameters (its model in the protocol's table): the required
        ones given, the tuning ones only where the kind takes them."""
        model = params_model(kind)
        fields = model.model_fields if model is not None else {}
        for name, field in fields.items():
            if field.is_required() and getattr(self, name) is None:
                raise ValueError(f"{name} is required for {_an(kind)} fault")
        for name in TUNING_FIELDS:
            if name not in fields and getattr(self, name) is not None:
                kinds = " and ".join(takers(name))
                raise ValueError(f"{name} applies to {kinds} only")
        return self

    def params(self) -> dict[str, Any]:
        if isinstance(self.schedule, DrillIn):
            return self.schedule.drill().params(self.target_job())
        return self.model_dump(exclude={"kind", "node", "job"}, exclude_none=True)

    def target_job(self) -> str | None:
        """The job named, by `job` or a drill's own `job`."""
        if isinstance(self.schedule, DrillIn) and self.schedule.job is not None:
            return self.schedule.job
        return self.job

    def schedule_of(self) -> tuple[str, float] | None:
        if not isinstance(self.schedule, str):
            return None
        kind, mean = self.schedule.split(",")
        return kind, float(mean)


class FaultOut(BaseModel):
    id: int
    kind: str
    node: str | None
    job: str | None
    params: dict[str, Any]
    active: bool
    created_at: datetime
    ended_at: datetime | None
    events: list[int] = Field(default_factory=list, description="Events the fault caused.")
    actions: list[int] = Field(default_factory=list, description="Actions taken for it.")

    @classmethod
    def of(
        cls, f: Fault, events: list[int] | None = None, actions: list[int] | None = None
    ) -> FaultOut:
        return cls(
            id=f.id,
            kind=f.kind,
            node=f.node,
            job=f.job,
            params=dict(f.params),
            active=f.active,
            created_at=f.created_at,
            ended_at=f.ended_at,
            events=events or [],
            actions=actions or [],
        )
