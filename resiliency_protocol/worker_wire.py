"""What a worker and its node's host monitor send each other: the bodies of the host
monitor's worker routes (`/v1/workers/...`, with the node's worker token, env
`HOST_MONITOR_WORKER_TOKEN`). The worker client (training/worker_client.py) builds them,
the host monitor's routes (host_monitor/server.py) take and answer them.

The checkpoint report (`POST /v1/workers/{rank}/checkpoints`) lives with the other
checkpoint reports in `checkpoint_reports`, the emergency checkpoint's ack in `emergency`.
Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol.states import Name

#: The worker routes' paths, relative to the host monitor's base URL.
REGISTER_PATH = "/v1/workers/register"


def worker_path(rank: int, route: str) -> str:
    """`/v1/workers/{rank}/{route}`: progress, stopping, finishing, checkpoints, world,
    emergency-ack, emergency-checkpoints."""
    return f"/v1/workers/{rank}/{route}"


#: The torch.distributed world a worker trains in (env WORKLOAD_ATTEMPT).
ATTEMPT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


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
    # False for a worker that says nothing (an older client, a script of its own): SIGUSR1's
    # default action ends a process, so only a worker that handles it is ever signalled.
    emergency_checkpoints: bool = Field(
        False,
        description="The worker takes emergency checkpoints: it handles SIGUSR1 and acks "
        "(the worker client's handler is installed). Otherwise it is never signalled.",
    )


class WorkerEmergencyCheckpoints(BaseModel):
    """POST /v1/workers/{rank}/emergency-checkpoints: the worker now takes emergency
    checkpoints, or no longer does (its SIGUSR1 handler was installed, or put back, after
    it registered). `pid` (and `pid_namespace`) as registered: another process's is
    refused (409)."""

    model_config = ConfigDict(extra="forbid")
    pid: int = Field(ge=1)
    pid_namespace: int | None = Field(None, ge=1)
    emergency_checkpoints: bool


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
    """What the host monitor answers to a progress report."""

    supervisor_heard_s: float | None = Field(
        None,
        ge=0,
        description="Seconds since the supervisor last answered this host monitor's "
        "heartbeats; null while it has none or was never answered. The worker's lease "
        "(training/monitor_link/lease.py) runs from then.",
    )
