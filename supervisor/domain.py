"""Plain value types shared by the sensor, the controller, the policies and the actuator.

Nothing here performs I/O or knows about HTTP, SQL or Kubernetes, so policies can import
it freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from resiliency_protocol.clock import utcnow as utcnow
from resiliency_protocol.clock import wall_clock as wall_clock
from resiliency_protocol.clock import wall_time as wall_time

# What crosses to the host monitors and the training side lives in the neutral package;
# the names stay importable from here for the rest of the supervisor and the policies.
from resiliency_protocol.states import NAME_PATTERN as NAME_PATTERN
from resiliency_protocol.states import NodeState as NodeState
from resiliency_protocol.states import WorkerState as WorkerState


class EventType(StrEnum):
    HOST_HEARTBEAT_LOST = "host_heartbeat_lost"
    WORKER_HEARTBEAT_LOST = "worker_heartbeat_lost"
    WORKER_EXITED = "worker_exited"
    HANG = "hang"
    GPU_XID = "gpu_xid"
    GPU_ECC = "gpu_ecc"
    # NVML's other health signals: row remapping, NVLink errors, clock slowdowns.
    GPU_HEALTH = "gpu_health"
    STRAGGLER = "straggler"
    STRAGGLER_RECOVERED = "straggler_recovered"
    SPARE_AVAILABLE = "spare_available"
    NODE_RECOVERED = "node_recovered"
    NODE_FLAPPING = "node_flapping"
    # Heard by the supervisor, but its peers cannot reach it nor it them (peer probes).
    NODE_CUT_OFF = "node_cut_off"
    # Raised by the Kubernetes backend's watchers.
    POD_STUCK_TERMINATING = "pod_stuck_terminating"
    WORKLOAD_DOWN = "workload_down"
    NODE_NOT_READY = "node_not_ready"
    # A worker's checkpoint save did not commit (reported through its host monitor).
    CHECKPOINT_FAILED = "checkpoint_failed"
    # The supervisor's own word on a job: it gave up healing it, or an operator reset that.
    JOB_GIVEN_UP = "job_given_up"
    JOB_BUDGET_RESET = "job_budget_reset"


#: Events that mean a node can no longer be trusted to run its share of the job.
NODE_FAILURE_EVENTS = frozenset(
    {
        EventType.HOST_HEARTBEAT_LOST,
        EventType.GPU_XID,
        EventType.GPU_ECC,
        EventType.GPU_HEALTH,
        EventType.NODE_FLAPPING,
        EventType.NODE_NOT_READY,
        EventType.NODE_CUT_OFF,
    }
)


class ActionType(StrEnum):
    EMERGENCY_CHECKPOINT = "emergency_checkpoint"
    RESTART_IN_PLACE = "restart_in_place"
    RESTART_WORKLOAD = "restart_workload"
    HOT_SWAP = "hot_swap"
    SCALE_DOWN = "scale_down"
    SCALE_UP = "scale_up"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    # Kubernetes: delete a pod stuck terminating with grace period 0.
    FORCE_DELETE_POD = "force_delete_pod"


#: Actions that stop training workers; the default policy checkpoints before each.
DISRUPTIVE_ACTIONS = frozenset(
    {
        ActionType.RESTART_IN_PLACE,
        ActionType.RESTART_WORKLOAD,
        ActionType.HOT_SWAP,
        ActionType.SCALE_DOWN,
        ActionType.SCALE_UP,
    }
)

#: Actions that count as a restart of the job for the restart-window bound.
RESTART_ACTIONS = DISRUPTIVE_ACTIONS


class ActionStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (ActionStatus.SUCCEEDED, ActionStatus.FAILED)

    def may_become(self, new: ActionStatus) -> bool:
        """Whether an action in this status may move to `new` (`ACTION_TRANSITIONS`)."""
        return new in ACTION_TRANSITIONS[self]


#: The moves an action's status may make, as a table (as ray's autoscaler keeps its
#: instances' statuses): an attempt starts from pending, or again from running (the next
#: attempt, or one resumed after a restart of the supervisor); it ends succeeded or
#: failed, or failed without an attempt (none left); a finished action stays as it is.
ACTION_TRANSITIONS: dict[ActionStatus, frozenset[ActionStatus]] = {
    ActionStatus.PENDING: frozenset({ActionStatus.RUNNING, ActionStatus.FAILED}),
    ActionStatus.RUNNING: frozenset(
        {ActionStatus.RUNNING, ActionStatus.SUCCEEDED, ActionStatus.FAILED}
    ),
    ActionStatus.SUCCEEDED: frozenset(),
    ActionStatus.FAILED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class Event:
    type: EventType
    time: datetime
    node: str | None = None
    job: str | None = None
    rank: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    fault_id: int | None = None
    id: int | None = None
    #: Set when the policy raised on this event, and so decided nothing.
    policy_error: str | None = None
    #: The remedy whose incident this event was attached to (it got no action of its own).
    incident_action_id: int | None = None


@dataclass(frozen=True, slots=True)
class ActionRequest:
    """One step a policy asks for. Targets are names; the backend resolves them."""

    type: ActionType
    job: str | None = None
    node: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WorkerView:
    rank: int
    local_rank: int
    pid: int | None
    state: WorkerState
    step: int | None
    exit_code: int | None = None
    compute_s: float | None = None  # as last reported; not persisted


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    state: NodeState
    job: str | None
    alive: bool
    last_heartbeat: datetime | None
    workers: tuple[WorkerView, ...] = ()
    cordoned: bool = False
    flapping: bool = False

    @property
    def is_usable_spare(self) -> bool:
        return (
            self.alive and self.state is NodeState.SPARE and not self.cordoned and not self.flapping
        )


#: A job's phase as its workers report it: `finishing` once one left its training loop
#: while others are still at work, `finished` once none is (supervisor/sensor/finishing.py).
JobPhase = Literal["running", "finishing", "finished"]


@dataclass(frozen=True, slots=True)
class JobView:
    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    nodes: tuple[str, ...] = ()
    last_step: int | None = None
    #: The longest step interval seen past the warm-up, which the learned hang timeout
    #: is computed from; None during the warm-up.
    step_interval_s: float | None = None
    #: A finished job needs no remedy: its nodes' failures change nothing it will do.
    phase: JobPhase = "running"


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """An action as recorded: what was asked, why, and how it went."""

    id: int
    type: ActionType
    status: ActionStatus
    idempotency_key: str
    source: str
    created_at: datetime
    job: str | None = None
    node: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    event_id: int | None = None
    fault_id: int | None = None
    attempts: int = 0
    error: str | None = None
    result: Mapping[str, Any] | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    #: Recorded by a dry-run supervisor: what it would have done; nothing was done.
    dry_run: bool = False
    #: Events of the same incident that arrived while it ran or just after: no action of
    #: their own (supervisor/controller/incidents.py).
    attached_events: tuple[int, ...] = ()

    @property
    def request(self) -> ActionRequest:
        return ActionRequest(
            self.type, job=self.job, node=self.node, params=self.params, reason=self.reason
        )


@dataclass(frozen=True, slots=True)
class Fault:
    id: int
    kind: str
    created_at: datetime
    node: str | None = None
    job: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    active: bool = True
    ended_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    """A worker saved or loaded a checkpoint (forwarded by its host monitor), for goodput.

    ``time`` is when the worker reported it to its host monitor, just after the save or
    load finished; ``report_id`` is unique per report, so a report sent again is one report.
    ``duration_s`` is the time the training loop was blocked; ``size_bytes`` (the rank's
    checkpoint size) and ``total_s`` (from start to commit) are None when not reported.
    A load's ``tier`` is the tier that served it.
    """

    report_id: str
    node: str
    job: str | None
    rank: int
    event: str  # "saved", "loaded" or "failed" (a save that did not commit)
    step: int
    duration_s: float
    tier: str  # "local", "ram", "peer", "durable" or "emergency"
    time: datetime
    size_bytes: int | None = None
    total_s: float | None = None
    error: str | None = None  # why a `failed` save failed


@dataclass(frozen=True, slots=True)
class ProgressSample:
    """A job had reached ``step`` at ``time`` (sampled from the sensor's picture)."""

    job: str
    step: int
    time: datetime
