"""Rank claims: two nodes cannot run one rank of a job at once.

A job's `claims` map each rank to the node whose last accepted heartbeat has it running,
starting or finishing. A heartbeat whose worker claims a rank another alive node of the
job holds is refused (`RankClaimed`); a node that is not alive holds nothing, so a spare
swapped in for it takes its ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from resiliency_protocol.heartbeat import HostHeartbeat, WorkerReport
from supervisor.domain import WorkerState
from supervisor.errors import SupervisorError
from supervisor.sensor.jobs import JobRecord
from supervisor.sensor.nodes import NodeRecord

#: Worker states that hold their rank: no other node may run it meanwhile.
CLAIMING = frozenset({WorkerState.RUNNING, WorkerState.STARTING, WorkerState.FINISHING})


class RankClaimed(SupervisorError):
    """A heartbeat's worker claims a rank of its job that another alive node reports
    running or starting: two nodes cannot run one rank at once. `index` is the worker's
    position in the heartbeat."""

    def __init__(self, job: str, rank: int, holder: str, index: int) -> None:
        super().__init__(
            f"workers.{index}.rank: rank {rank} of job {job} is running on node {holder}"
        )
        self.job = job
        self.rank = rank
        self.holder = holder
        self.index = index


def check_claims(hb: HostHeartbeat, job: JobRecord, nodes: Mapping[str, NodeRecord]) -> None:
    """Raise RankClaimed when a running or starting worker of `hb` (of `job`) has a rank
    that another node of the job, alive, reports running or starting."""
    claims = job.claims
    if not claims:
        return
    for index, worker in enumerate(hb.workers):
        if worker.state not in CLAIMING:
            continue
        holder = claims.get(worker.rank)
        if holder is None or holder == hb.node:
            continue
        other = nodes.get(holder)
        if other is not None and other.alive and other.job == job.name:
            raise RankClaimed(job.name, worker.rank, holder, index)


def release(job: JobRecord, node: str, workers: list[WorkerReport]) -> None:
    """The node no longer holds the ranks of these, its previous, workers."""
    for worker in workers:
        if job.claims.get(worker.rank) == node:
            del job.claims[worker.rank]


def claim(job: JobRecord, node: str, workers: list[WorkerReport]) -> None:
    """The node holds the ranks of those of its workers that run (`check_claims` allowed)."""
    claims = job.claims
    for worker in workers:
        if worker.state in CLAIMING:
            claims[worker.rank] = node
