"""Request and response bodies of the REST API (what /openapi.json documents)."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    model_validator,
)

from supervisor.action_params import MAX_REPLICAS, ScaleDownParams, ScaleUpParams, check_params
from supervisor.domain import (
    NAME_PATTERN,
    ActionRecord,
    ActionStatus,
    ActionType,
    Event,
    EventType,
    Fault,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
)
from supervisor.job_state import JobState

T = TypeVar("T")

Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=NAME_PATTERN)]


def in_utc(value: datetime | None) -> datetime | None:
    """A time in UTC (a time without a zone is taken as UTC). A zone that moves it out of
    the years 1-9999 (0001-01-01T00:00:00+14:00) is refused here, not a 500 later."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range once in UTC (years 1 to 9999)") from None


#: The date and time of RFC 3339 (what the schema's `date-time` means), zone aside.
_DATE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}").match


def date_time_text(value: Any) -> Any:
    """Refuse a time given as anything but a date and time: pydantic would take "3" or
    3 as seconds since 1970, which the documented `date-time` does not allow."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or _DATE_TIME(value) is None:
        raise ValueError("expected a date and time (RFC 3339, e.g. 2024-05-01T12:00:00Z)")
    return value


def _whole_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: Numbers as the schema has them (pydantic's lax mode took `false` and `"3"` too): an
#: integer is 3 or 3.0, a number 3 or 3.5.
JsonInt = Annotated[int, BeforeValidator(_whole_number), Strict()]
JsonFloat = Annotated[float, Strict()]


#: A time as stored and compared: in UTC, and representable there.
UtcTime = Annotated[datetime, BeforeValidator(date_time_text), AfterValidator(in_utc)]


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(
        description="Pass as `cursor` to get the next (older) page; null on the last page."
    )


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


class ActionOut(BaseModel):
    id: int
    type: ActionType
    status: ActionStatus
    job: str | None
    node: str | None
    params: dict[str, Any]
    reason: str
    source: Literal["policy", "operator"] | str
    idempotency_key: str
    event_id: int | None
    fault_id: int | None
    attempts: int
    error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None = Field(description="From the first attempt's start to the end.")
    dry_run: bool = Field(
        False,
        description="Recorded by a supervisor in dry run: what it would have done; nothing "
        "was done, and it counts only toward that supervisor's own restart budget.",
    )
    attached_events: list[int] = Field(
        [],
        description="Events of the same incident attached to this remedy, in the order they "
        "came: recorded, with no action of their own.",
    )

    @classmethod
    def of(cls, a: ActionRecord) -> ActionOut:
        duration = None
        if a.started_at and a.finished_at:
            duration = round((a.finished_at - a.started_at).total_seconds(), 3)
        return cls(
            id=a.id,
            type=a.type,
            status=a.status,
            job=a.job,
            node=a.node,
            params=dict(a.params),
            reason=a.reason,
            source=a.source,
            idempotency_key=a.idempotency_key,
            event_id=a.event_id,
            fault_id=a.fault_id,
            attempts=a.attempts,
            error=a.error,
            result=dict(a.result) if a.result is not None else None,
            attached_events=list(a.attached_events),
            created_at=a.created_at,
            started_at=a.started_at,
            finished_at=a.finished_at,
            duration_s=duration,
            dry_run=a.dry_run,
        )


#: An action's params as JSON: the actions take a few small values, never a document.
MAX_PARAMS_BYTES = 16 * 1024


def _storable(value: Any, where: str) -> None:
    """Refuse what JSON in SQL cannot hold the same way on SQLite and PostgreSQL: a NUL
    character (PostgreSQL refuses it), a float that is not finite (SQLite stores null)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where}: a NUL character cannot be stored")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, where)
            _storable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _storable(item, f"{where}.{i}")


class ActionIn(BaseModel):
    """An action an operator asks for by hand."""

    model_config = ConfigDict(extra="forbid")

    type: ActionType
    job: Name | None = None
    node: Name | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    reason: str = Field("requested by operator", max_length=1000)

    @model_validator(mode="after")
    def _check_storable(self) -> Self:
        _storable(self.reason, "reason")
        _storable(self.params, "params")
        if len(json.dumps(self.params)) > MAX_PARAMS_BYTES:
            raise ValueError(f"params: larger than {MAX_PARAMS_BYTES} bytes as JSON")
        return self

    @model_validator(mode="after")
    def _check_target(self) -> Self:
        node_actions = {ActionType.CORDON, ActionType.UNCORDON, ActionType.HOT_SWAP}
        if self.type in node_actions and self.node is None:
            raise ValueError(f"node is required for {self.type.value}")
        if self.type not in {ActionType.CORDON, ActionType.UNCORDON} and self.job is None:
            raise ValueError(f"job is required for {self.type.value}")
        params = check_params(self.type, self.params)  # InvalidParams (a ValueError) names it
        if isinstance(params, ScaleDownParams | ScaleUpParams) and params.to_replicas < 1:
            raise ValueError(
                f"params.to_replicas must be a positive integer (at most {MAX_REPLICAS})"
            )
        return self


class WorkerOut(BaseModel):
    rank: int
    local_rank: int
    pid: int | None
    state: WorkerState
    step: int | None
    exit_code: int | None
    compute_s: float | None = Field(
        None,
        description="Seconds per step in the worker's own work, as it last reported them "
        "(what stragglers are scored on).",
    )


class NodeOut(BaseModel):
    name: str
    state: NodeState
    job: str | None
    alive: bool
    cordoned: bool
    flapping: bool
    last_heartbeat: datetime | None
    heartbeat_age_s: float | None
    workers: list[WorkerOut]

    @classmethod
    def of(cls, n: NodeView, age_s: float | None) -> NodeOut:
        return cls(
            name=n.name,
            state=n.state,
            job=n.job,
            alive=n.alive,
            cordoned=n.cordoned,
            flapping=n.flapping,
            last_heartbeat=n.last_heartbeat,
            heartbeat_age_s=None if age_s is None else round(age_s, 3),
            workers=[
                WorkerOut(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    state=w.state,
                    step=w.step,
                    exit_code=w.exit_code,
                    compute_s=w.compute_s,
                )
                for w in n.workers
            ],
        )


class JobOut(BaseModel):
    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    nodes: list[str]
    last_step: int | None
    hang_timeout_s: float | None = Field(
        description="Hang timeout in force (learned or fixed); null while warming up."
    )
    state: JobState = Field(
        description="running; recovering (a remedy in flight); finishing (its workers left "
        "their loop); finished (none left at work); given_up (its restart budget spent, "
        "until an operator resets it)."
    )
    given_up_reason: str | None = Field(
        None, description="Why the supervisor gave up healing the job (state given_up)."
    )
    no_progress_restarts: int = Field(
        0,
        description="Remedies in a row not followed by progress (max_no_progress_restarts "
        "gives the job up).",
    )

    @classmethod
    def of(
        cls,
        j: JobView,
        hang_timeout_s: float | None,
        state: JobState,
        *,
        given_up_reason: str | None = None,
        no_progress_restarts: int = 0,
    ) -> JobOut:
        return cls(
            state=state,
            given_up_reason=given_up_reason,
            no_progress_restarts=no_progress_restarts,
            name=j.name,
            num_dp_replicas=j.num_dp_replicas,
            min_num_dp_replicas=j.min_num_dp_replicas,
            max_num_dp_replicas=j.max_num_dp_replicas,
            num_nodes_per_dp=j.num_nodes_per_dp,
            nodes=list(j.nodes),
            last_step=j.last_step,
            hang_timeout_s=None if hang_timeout_s is None else round(hang_timeout_s, 3),
        )


FaultKind = Literal[
    "heartbeat_loss", "xid", "ecc", "node_down", "worker_crash", "worker_hang", "straggler"
]
SCHEDULE_PATTERN = (
    r"^(random|node_down|worker_crash|worker_hang|straggler|xid|ecc),"
    r"([0-9]+(\.[0-9]+)?)$"
)


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
      with that mean interval on nodes of `job` (or any job) until the fault is deleted.
    """

    model_config = ConfigDict(extra="forbid")

    kind: FaultKind | None = None
    schedule: str | None = Field(None, pattern=SCHEDULE_PATTERN, examples=["random,120"])
    node: Name | None = None
    job: Name | None = Field(None, description="Job whose nodes a schedule targets.")
    rank: Annotated[int, Field(ge=0)] | None = Field(None, description="Worker to hit.")
    code: Annotated[int, Field(ge=0, le=1000)] | None = Field(None, description="XID code.")
    gpu: Annotated[int, Field(ge=0, le=255)] | None = None
    count: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Uncorrected ECC count to report."
    )
    duration_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    slowdown: Annotated[float, Field(gt=0, le=10)] | None = Field(
        None, description="straggler: 0.5 runs the worker 1.5 times slower (the default)."
    )

    @model_validator(mode="after")
    def _check_kind(self) -> Self:
        if (self.kind is None) == (self.schedule is None):
            raise ValueError("give exactly one of kind and schedule")
        if self.schedule is not None:
            if float(self.schedule.split(",")[1]) <= 0:
                raise ValueError("schedule: the mean interval must be positive")
            return self
        if self.node is None:
            raise ValueError(f"node is required for a {self.kind} fault")
        if self.kind == "xid" and self.code is None:
            raise ValueError("code is required for an xid fault")
        if self.kind == "ecc" and self.count is None:
            raise ValueError("count is required for an ecc fault")
        if self.kind != "straggler" and self.slowdown is not None:
            raise ValueError("slowdown applies to straggler only")
        if self.kind not in ("heartbeat_loss", "straggler") and self.duration_s is not None:
            raise ValueError("duration_s applies to heartbeat_loss and straggler only")
        return self

    def params(self) -> dict[str, Any]:
        return self.model_dump(exclude={"kind", "node", "job"}, exclude_none=True)

    def schedule_of(self) -> tuple[str, float] | None:
        if self.schedule is None:
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
