"""The host monitor's local HTTP API: bodies exchanged with workers and with the actuator.

Workers on the node call the `/v1/workers/...` routes with the node's worker token
(env `HOST_MONITOR_WORKER_TOKEN`). The supervisor's actuator calls the other routes with
the actuator token. Both are bearer tokens.

The emergency checkpoint's bodies (`EmergencyAck`, `EmergencyCheckpointRequest`,
`EmergencyCheckpointResult`) are the actuator's as well: they live in
resiliency_protocol.emergency, beside the client that sends the request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from host_monitor.wire import Name
from resiliency_protocol.emergency import EmergencyAck as EmergencyAck
from resiliency_protocol.emergency import EmergencyCheckpointRequest as EmergencyCheckpointRequest
from resiliency_protocol.emergency import EmergencyCheckpointResult as EmergencyCheckpointResult
from resiliency_protocol.states import NodeState, WorkerState

# --- worker -> host monitor -------------------------------------------------------------


class WorkerRegistration(BaseModel):
    """POST /v1/workers/register"""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    pid: int = Field(ge=1, description="os.getpid(): the pid in the worker's PID namespace.")
    world_size: int | None = Field(None, ge=1)
    # How a worker in another PID namespace (its own pod) is found (host_monitor/pidns.py).
    # Without them, `pid` must be a pid of the host monitor's own namespace.
    pid_namespace: int | None = Field(
        None, ge=1, description="Inode of the worker's /proc/self/ns/pid."
    )
    start_time: int | None = Field(
        None, ge=0, description="Field 22 of the worker's /proc/self/stat (ticks since boot)."
    )
    # On Kubernetes the host monitor starts as a spare and learns its job from the first
    # worker that registers (env HOST_MONITOR_JOB of the pod). Optional: older clients
    # and the workers we launch ourselves register on a node that already has its job.
    job: Name | None = Field(
        None, description="The job this worker belongs to (on Kubernetes: the JobSet name)."
    )
    instance: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="What this process runs in, once (on Kubernetes its pod's UID, env "
        "POD_UID): a world assigned to that instance (POST /v1/workers/world) reaches it.",
    )


class WorkerStopping(BaseModel):
    """POST /v1/workers/{rank}/stopping: the worker was told to stop (SIGTERM).

    Its exit is then `stopped` (on purpose, not a failure). `pid` (and `pid_namespace`)
    as registered: a report from the previous process of a rank is refused (409).
    """

    model_config = ConfigDict(extra="forbid")
    pid: int = Field(ge=1)
    pid_namespace: int | None = Field(None, ge=1)
    signal: int | None = Field(None, ge=1, le=64, description="The signal received.")


class WorkerFinishing(BaseModel):
    """POST /v1/workers/{rank}/finishing: the worker left its training loop and is
    finishing (its last save, its output). Its state turns `finishing` until it exits: the
    supervisor watches it with a bound of its own, not for hangs. `pid` (and
    `pid_namespace`) as registered: a report from another process is refused (409)."""

    model_config = ConfigDict(extra="forbid")
    pid: int = Field(ge=1)
    pid_namespace: int | None = Field(None, ge=1)


ATTEMPT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


class WorkerProgress(BaseModel):
    """POST /v1/workers/{rank}/progress: the newest finished step (also the worker heartbeat)."""

    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(None, ge=0, le=2**63 - 1)
    compute_s: float | None = Field(
        None,
        ge=0,
        le=86400,
        description="Seconds per step in the worker's own work, before it waits for the "
        "other ranks (mean over its steps since its last report): stragglers are scored on it.",
    )
    attempt: str | None = Field(
        None,
        pattern=ATTEMPT_PATTERN,
        description="The torch.distributed world the worker trains in (WORKLOAD_ATTEMPT); "
        "an in-process restart moves it to a new one.",
    )


class WorldAssignment(BaseModel):
    """GET /v1/workers/{rank}/world: the world this worker is to join without restarting
    (an in-process restart), or none (`attempt` null)."""

    attempt: str | None
    env: dict[str, str] = Field(
        default_factory=dict, description="MASTER_ADDR, MASTER_PORT, WORLD_SIZE, ..."
    )


class ProgressReply(BaseModel):
    """What the host monitor answers to a progress report (nothing yet: room to grow)."""


# `local`: the NumPy demo's node-local files; `ram`: tmpfs on the node; `peer`: a copy held
# by a partner node's host monitor; `durable`: shared storage; `emergency`: saved on demand.
CheckpointTier = Literal["local", "ram", "peer", "durable", "emergency"]
MAX_CHECKPOINT_BYTES = 2**62
MAX_CHECKPOINT_TOTAL_S = 604_800.0  # a week


MAX_CHECKPOINT_ERROR_CHARS = 1000


class CheckpointReport(BaseModel):
    """POST /v1/workers/{rank}/checkpoints: a checkpoint saved, loaded or failed.

    A load is reported with the tier that served it; a save that did not commit as
    `failed`, with the tier it was for and the error. `bytes` and `total_s` are optional:
    older clients (and the NumPy demo) leave them out.
    """

    model_config = ConfigDict(extra="forbid")
    event: Literal["saved", "loaded", "failed"]
    step: int = Field(ge=0)
    duration_s: float = Field(ge=0, description="Seconds the training loop was blocked.")
    tier: CheckpointTier
    bytes: int | None = Field(
        None, ge=0, le=MAX_CHECKPOINT_BYTES, description="Size of this rank's checkpoint."
    )
    total_s: float | None = Field(
        None,
        ge=0,
        le=MAX_CHECKPOINT_TOTAL_S,
        allow_inf_nan=False,
        description="Seconds from the start of the save or load to its commit, in all.",
    )
    error: str | None = Field(
        None,
        validate_default=True,
        max_length=MAX_CHECKPOINT_ERROR_CHARS,
        description="Why the save failed (`failed` reports only).",
    )

    @field_validator("error")
    @classmethod
    def _error_with_failed(cls, error: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("event") == "failed") != (error is not None):
            raise ValueError("given with a `failed` report, and only with one")
        return error


# --- actuator -> host monitor -----------------------------------------------------------


class WorkerSpec(BaseModel):
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)


class CheckpointPeer(BaseModel):
    """The partner of the peer checkpoint tier: the node whose host monitor keeps a copy of
    this node's newest checkpoint shards (and whose shards this node keeps)."""

    model_config = ConfigDict(extra="forbid")
    node: Name
    url: str = Field(
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Base URL of the partner's host monitor.",
    )


class StartWorkersRequest(BaseModel):
    """POST /v1/workers/start: run the job's workers on this node (local backend).

    Each worker runs `command` with `env` plus RANK, LOCAL_RANK, NODE_NAME,
    HOST_MONITOR_URL and HOST_MONITOR_WORKER_TOKEN set. Idempotent by `request_id`.
    """

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    job: str = Field(min_length=1)
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    workers: list[WorkerSpec] = Field(min_length=1)
    checkpoint_peer: CheckpointPeer | None = Field(
        None, description="The node's partner for the peer checkpoint tier; None: none."
    )
    standby_preload: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Keep a warm standby of `command` on this node, with these modules "
        "imported, for the next start of the job's ranks here (`[python, -m, module]` "
        "commands only); empty: none.",
    )


class StandbyRequest(BaseModel):
    """POST /v1/standby: have a warm standby of the job's command ready on this node (a
    spare that may take a rank of the job). Idempotent."""

    model_config = ConfigDict(extra="forbid")
    job: str = Field(min_length=1)
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    preload: list[str] = Field(min_length=1, max_length=32)


class StandbyResult(BaseModel):
    ready: bool = Field(description="False when the command cannot have a standby.")


class RejoinRequest(BaseModel):
    """POST /v1/workers/rejoin: give the job's live workers on this node a new
    torch.distributed world to join without restarting (an in-process restart).

    Each worker reads it from GET /v1/workers/{rank}/world and reports `attempt` in its
    progress once it trains in that world. Idempotent by `request_id`.
    """

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    job: str = Field(min_length=1)
    attempt: str = Field(pattern=ATTEMPT_PATTERN)
    env: dict[str, str] = Field(description="The new world: MASTER_ADDR, MASTER_PORT, ...")


class AssignWorldRequest(BaseModel):
    """POST /v1/workers/world: the torch.distributed world that the worker of `rank` running
    in `instance` (on Kubernetes: a pod's UID) is to train in, whether it is registered yet
    or not (a replacement pod still starting, or one a JobSet that heals in-process keeps).

    The worker reads it from GET /v1/workers/{rank}/world, at its start and after its
    collective failed. A later assignment for the same job and rank replaces an earlier
    one. Idempotent by `request_id`.
    """

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    job: Name
    rank: int = Field(ge=0)
    instance: str = Field(min_length=1, max_length=128)
    attempt: str = Field(pattern=ATTEMPT_PATTERN)
    env: dict[str, str] = Field(description="The world: MASTER_PORT, WORLD_SIZE, ...")


class AssignWorldResult(BaseModel):
    request_id: str
    rank: int
    attempt: str
    delivered: bool = Field(
        description="The worker of that instance is registered here and now has the world; "
        "false: it gets it when it registers."
    )


class RejoinResult(BaseModel):
    request_id: str
    attempt: str
    ranks: list[int] = Field(description="The live workers given the new world.")


class StopWorkersRequest(BaseModel):
    """POST /v1/workers/stop: SIGTERM, then SIGKILL after `grace_s`. `release` makes the
    node a spare again."""

    model_config = ConfigDict(extra="forbid")
    grace_s: float = Field(5.0, ge=0, le=600)
    release: bool = False


class StopWorkersResult(BaseModel):
    exit_codes: dict[int, int | None] = Field(description="By rank; None if unknown.")


ProcessFaultKind = Literal["worker_crash", "worker_hang", "straggler", "xid", "ecc", "node_down"]


class ProcessFault(BaseModel):
    """POST /v1/faults: a fault acted out on real processes of this node."""

    model_config = ConfigDict(extra="forbid")
    kind: ProcessFaultKind
    rank: int | None = Field(None, ge=0, description="Worker to hit; default: the lowest.")
    code: int | None = Field(None, ge=0, le=1000, description="XID code (xid).")
    gpu: int = Field(0, ge=0, le=255)
    count: int | None = Field(None, ge=1, description="Uncorrected ECC errors to add (ecc).")
    slowdown: float | None = Field(
        None,
        gt=0,
        le=10,
        description="straggler: how much slower the worker runs (0.5: its steps take 1.5 "
        "times as long), by stopping and continuing it (SIGSTOP, SIGCONT) ten times a "
        "second; default 0.5.",
    )
    duration_s: float | None = Field(
        None, gt=0, le=86400, description="straggler: for how long; unset: until it exits."
    )


class WorkerStatus(BaseModel):
    rank: int
    local_rank: int
    pid: int | None = Field(description="As the worker knows itself (what it registered).")
    host_pid: int | None = Field(
        None, description="The same process in the host monitor's PID namespace (signalled)."
    )
    state: WorkerState
    step: int | None
    exit_code: int | None
    attempt: str | None = Field(None, description="The world it reported training in.")
    compute_s: float | None = Field(None, description="As last reported (see WorkerProgress).")


class NodeStatus(BaseModel):
    """GET /v1/status"""

    node: str
    state: NodeState
    job: str | None
    workers: list[WorkerStatus]
