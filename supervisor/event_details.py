"""What each event type carries in its `details`: one model per type, the contract the
sensor and the Kubernetes watchers write to and policies, notifications and the API read.

An `Event` keeps its details as a plain mapping (that is what is stored and sent); the
emitters build it from these models (`EventDetails.mapping`), so a field that is not
declared here cannot be emitted, and readers take a typed view back with
`WorkerExitedDetails.of(event)`. Every field is optional on reading: events stored by an
older version, and events a test builds by hand, may lack some. docs/http-api.md's event
table lists these fields, and a test holds the two together.

Pure: imports the domain and pydantic only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from supervisor.domain import Event, EventType


class EventDetails(BaseModel):
    """Base of the details models: frozen; an undeclared field is refused when built."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    #: The event types whose details this model describes.
    event_types: ClassVar[frozenset[EventType]] = frozenset()

    @classmethod
    def of(cls, event: Event) -> Self:
        """The typed view of `event`'s details (fields it lacks are None; fields this
        version does not declare are left out)."""
        if event.type not in cls.event_types:
            raise TypeError(f"{cls.__name__} does not describe {event.type.value} events")
        return cls.from_mapping(event.details)

    @classmethod
    def from_mapping(cls, details: Mapping[str, Any]) -> Self:
        """Tolerant, for what is stored: a value of the wrong type is left out rather than
        failing the reader."""
        known = {k: v for k, v in details.items() if k in cls.model_fields}
        try:
            return cls.model_validate(known)
        except ValidationError as exc:
            bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
            return cls.model_validate({k: v for k, v in known.items() if k not in bad})

    def mapping(self) -> dict[str, Any]:
        """The details as an event stores them: unset fields left out."""
        return self.model_dump(mode="json", exclude_none=True)


class HeartbeatSilenceDetails(EventDetails):
    """A node's heartbeats stopped (lost, or lost once too often: flapping)."""

    last_heartbeat: str | None = None
    """When the node's last heartbeat arrived (ISO 8601)."""
    heartbeat_timeout_s: float | None = None
    lateness_ms: float | None = None
    """How long after its deadline the silence was noticed."""


class HostHeartbeatLostDetails(HeartbeatSilenceDetails):
    event_types = frozenset({EventType.HOST_HEARTBEAT_LOST})


class NodeFlappingDetails(HeartbeatSilenceDetails):
    event_types = frozenset({EventType.NODE_FLAPPING})
    losses: int | None = None
    window_s: float | None = None


class NodeCutOffDetails(EventDetails):
    """The supervisor hears the node, but it and its peers cannot reach each other: its
    ranks cannot train with theirs (supervisor/sensor/peer_cuts.py)."""

    event_types = frozenset({EventType.NODE_CUT_OFF})
    cannot_reach: list[str] | None = None
    """The peers the node said it cannot reach."""
    unreachable_from: list[str] | None = None
    """The peers that said they cannot reach it."""


class NodeRecoveredDetails(EventDetails):
    event_types = frozenset({EventType.NODE_RECOVERED})
    state: str | None = None
    """The node's state in the heartbeat that brought it back."""
    was_flapping: bool | None = None
    source: str | None = None
    """`kubernetes` when a swapped-out node was given back on the cluster."""
    uncordoned_by: str | None = None
    """The key of the action that gave it back."""


class SpareAvailableDetails(EventDetails):
    event_types = frozenset({EventType.SPARE_AVAILABLE})
    uncordoned: bool | None = None


class _WorkerDetails(EventDetails):
    pid: int | None = None
    local_rank: int | None = None
    step: int | None = None
    """The worker's last reported step."""


class WorkerExitedDetails(_WorkerDetails):
    event_types = frozenset({EventType.WORKER_EXITED})
    exit_code: int | None = None


class WorkerHeartbeatLostDetails(_WorkerDetails):
    event_types = frozenset({EventType.WORKER_HEARTBEAT_LOST})


class HangDetails(EventDetails):
    event_types = frozenset({EventType.HANG})
    last_step: int | None = None
    stalled_for_s: float | None = None
    hang_timeout_s: float | None = None
    timeout_learned: bool | None = None
    suspect_step: int | None = None
    """The laggard's step, when one rank is behind the others."""
    kind: str | None = None
    """`finishing`: a worker still finishing, or at work, `finishing_timeout_s`
    (`hang_timeout_s`) after its job began to end (`stalled_for_s` ago); unset: the step
    stalled."""


class _GpuDetails(EventDetails):
    gpu: int | None = None
    message: str | None = None
    observed_at: str | None = None
    """When the host monitor saw it (ISO 8601)."""


class GpuClassDetails(_GpuDetails):
    """The class from the XID table (supervisor/xid.py)."""

    meaning: str | None = None
    origin: str | None = None
    """`application`, `driver`, `hardware` or `unknown`."""
    response: str | None = None
    """`restart_workload`, `replace_node` or `ignore`."""


class GpuXidDetails(GpuClassDetails):
    event_types = frozenset({EventType.GPU_XID})
    code: int | None = None


class GpuHealthDetails(GpuClassDetails):
    event_types = frozenset({EventType.GPU_HEALTH})
    kind: str | None = None
    """`row_remap`, `nvlink` or `throttle`."""
    count: int | None = None


class GpuEccDetails(_GpuDetails):
    event_types = frozenset({EventType.GPU_ECC})
    count: int | None = None
    """Uncorrected errors counted so far."""
    new_errors: int | None = None


class StragglerDetails(EventDetails):
    event_types = frozenset({EventType.STRAGGLER, EventType.STRAGGLER_RECOVERED})
    score: float | None = None
    """The rank's median compute time over its job's median."""
    slowdown_pct: float | None = None
    compute_s: float | None = None
    typical_s: float | None = None
    for_s: float | None = None
    threshold: float | None = None
    window_s: float | None = None


class PodStuckTerminatingDetails(EventDetails):
    event_types = frozenset({EventType.POD_STUCK_TERMINATING})
    pod: str | None = None
    namespace: str | None = None
    uid: str | None = None
    terminating_since: str | None = None
    terminating_for_s: float | None = None
    grace_period_s: int | None = None
    finalizers: list[str] | None = None
    threshold_s: float | None = None


class WorkloadDownDetails(EventDetails):
    event_types = frozenset({EventType.WORKLOAD_DOWN})
    expected_pods: int | None = None
    running_pods: int | None = None
    pending_pods: int | None = None
    terminating_pods: int | None = None
    unschedulable_pods: int | None = None
    restarts: int | None = None
    """The JobSet's `status.restarts`."""
    scheduler_message: str | None = None
    down_for_s: float | None = None
    threshold_s: float | None = None


class NodeNotReadyDetails(EventDetails):
    event_types = frozenset({EventType.NODE_NOT_READY})
    status: str | None = None
    """The `Ready` condition's status: `False` or `Unknown`."""
    reason: str | None = None
    message: str | None = None
    since: str | None = None


class CheckpointFailedDetails(EventDetails):
    event_types = frozenset({EventType.CHECKPOINT_FAILED})
    rank: int | None = None
    step: int | None = None
    """The step whose save did not commit."""
    tier: str | None = None
    """The tier it was for: `ram`, `durable`, `emergency`, ..."""
    error: str | None = None
    report_id: str | None = None
    """The checkpoint report that said so (`GET /api/v1/checkpoints`)."""


class JobGivenUpDetails(EventDetails):
    event_types = frozenset({EventType.JOB_GIVEN_UP})
    reason: str | None = None
    """Why, in a sentence: which budget was spent, and what the job did meanwhile."""
    no_progress_restarts: int | None = None
    """Remedies in a row not followed by progress (every rank past the step it stood at)."""
    restarts_in_window: int | None = None
    last_step: int | None = None


class JobBudgetResetDetails(EventDetails):
    event_types = frozenset({EventType.JOB_BUDGET_RESET})
    was_given_up: bool | None = None
    no_progress_restarts: int | None = None
    """What the count stood at before the reset."""


#: Event type -> its details model; every type has one.
EVENT_DETAILS: Mapping[EventType, type[EventDetails]] = {
    type_: model
    for model in (
        HostHeartbeatLostDetails,
        NodeFlappingDetails,
        NodeCutOffDetails,
        NodeRecoveredDetails,
        SpareAvailableDetails,
        WorkerExitedDetails,
        WorkerHeartbeatLostDetails,
        HangDetails,
        GpuXidDetails,
        GpuHealthDetails,
        GpuEccDetails,
        StragglerDetails,
        PodStuckTerminatingDetails,
        WorkloadDownDetails,
        NodeNotReadyDetails,
        CheckpointFailedDetails,
        JobGivenUpDetails,
        JobBudgetResetDetails,
    )
    for type_ in model.event_types
}


def details_of(event: Event) -> EventDetails:
    """The typed view of any event's details, by its type."""
    return EVENT_DETAILS[event.type].from_mapping(event.details)
