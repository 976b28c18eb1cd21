"""What the supervisor's actuator sends a host monitor, and what it answers: the
commands of the host monitor's routes other than the workers' (`/v1/workers/start`,
`/v1/standby`, `/v1/workers/rejoin`, `/v1/workers/world`, `/v1/workers/stop`,
`/v1/faults`, `/v1/status`), with the actuator token. The local backend
(supervisor/local/cluster.py) and the Kubernetes backend (supervisor/kube/pod_links.py)
build them, the host monitor (host_monitor/server.py) takes them.

The emergency checkpoint's bodies live in `emergency`, the peer tier's in
`peer_checkpoints`. Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol.faults import ProcessFaultKind
from resiliency_protocol.states import Name, NodeState, WorkerState
from resiliency_protocol.worker_wire import ATTEMPT_PATTERN


class WorkerSpec(BaseModel):
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)


class HostMonitorAddress(BaseModel):
    """Another node, and where its host monitor listens."""

    model_config = ConfigDict(extra="forbid")
    node: Name
    url: str = Field(
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Base URL of the node's host monitor.",
    )


class CheckpointPeer(HostMonitorAddress):
    """The partner of the peer checkpoint tier: the node whose host monitor keeps a copy of
    this node's newest checkpoint shards (and whose shards this node keeps)."""


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
        "imported, for the next start of the job's ranks here (Python commands only: "
        "`[python, -m, module, ...]` or `[python, script.py, ...]`, `-u` at most before "
        "them); empty: none.",
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
    warm: bool = Field(
        default=False,
        description="It has imported what it preloads: the next start of the job here is "
        "a fork of it.",
    )


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
    checkpoint_peer: CheckpointPeer | None = Field(
        None,
        description="The node's partner for the peer checkpoint tier in the new world "
        "(the placement changed); left out: the partner stays.",
    )


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


class FaultOutcome(BaseModel):
    """The 202 answer to POST /v1/faults: what was done."""

    kind: ProcessFaultKind
    rank: int | None = None
    pid: int | None = None
    gpu: int | None = None
    detail: str
    exiting: bool = False  # node_down: the agent exits right after this answer


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
