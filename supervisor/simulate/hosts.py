"""A simulated node, and what its host monitor says of it."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.domain import NodeState, WorkerState
from supervisor.sensor import GpuReport, HostHeartbeat, WorkerReport


@dataclass
class SimNode:
    name: str
    slot: int | None = None  # its place in the job; None: not in the job
    up: bool = True  # heartbeating
    in_repair: bool = False
    cordoned: bool = False
    memory_lost: bool = False  # went down since the job's last restart
    exited: bool = False  # a worker of it exited (crashed) and was not restarted


def heartbeat(
    node: SimNode,
    *,
    job: str,
    gpus: int,
    stopped: bool,
    step: int,
    gpu_reports: list[GpuReport],
    exit_code: int | None,
) -> HostHeartbeat:
    """The heartbeat of `node`: a spare's, or one worker per GPU of the job's (`stopped`:
    the job waits for nodes; a node whose worker `exited` reports its exit code)."""
    if node.slot is None:
        return HostHeartbeat(node=node.name, state=NodeState.SPARE, gpu_reports=gpu_reports)
    workers = []
    for local in range(gpus):
        rank = node.slot * gpus + local
        if node.exited and local == 0:
            w = WorkerReport(
                rank=rank,
                local_rank=local,
                state=WorkerState.EXITED,
                exit_code=exit_code if exit_code is not None else 1,
                step=step,
            )
        elif stopped:
            w = WorkerReport(rank=rank, local_rank=local, state=WorkerState.STOPPED)
        else:
            w = WorkerReport(rank=rank, local_rank=local, state=WorkerState.RUNNING, step=step)
        workers.append(w)
    return HostHeartbeat(
        node=node.name, state=NodeState.RUNNING, job=job, workers=workers, gpu_reports=gpu_reports
    )
