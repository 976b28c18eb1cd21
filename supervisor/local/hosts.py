"""Hosts that launched their own node's workers (`host-monitor --launch`, e.g. on the
hosts of a Slurm allocation) join the local cluster of a `supervisor serve`.

Each host monitor tells the supervisor its node, its address and the job it launches
(`HostJoin`), again until the job is complete; then it starts its node's workers (the
job's first attempt, as torchrun's nodes start once they all met). From then on the job
is the cluster's, with the hosts' rendezvous, and the local backend's actions (restarts,
emergency checkpoints) reach its workers through the host monitors, as for a cluster the
supervisor launched itself. A host monitor started again on a node of the job joins again
with its new address; once the supervisor started an attempt of its own, such a host
starts nothing (`start` false): its ranks are the next restart's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resiliency_protocol.launch import HostJoin, master_port
from supervisor.errors import RequestRefused
from supervisor.local.cluster_state import ClusterState, JobSpec, NodeInfo

#: What every host of one job must agree on.
SHAPE = ("job", "command", "nnodes", "nproc_per_node", "spares", "master_addr", "master_port")
#: `started_by` of the attempt the hosts started themselves.
LAUNCHED = "launched-by-hosts"


class JoinConflict(RequestRefused):
    """The join contradicts the job or the joins before it (409; the message names the
    field)."""


class HostJoins:
    """The joins of the local cluster's hosts; the job once they are all in."""

    def __init__(self, state: ClusterState, on_world: Callable[[str, int], None]) -> None:
        self.state = state
        self._on_world = on_world
        self._pending: dict[int, HostJoin] = {}  # node rank -> its join, until complete

    def join(self, host: HostJoin) -> dict[str, Any]:
        """Record `host`; raises JoinConflict (nothing changed) when it does not fit."""
        if host.node_rank >= host.nnodes + host.spares:
            raise JoinConflict(
                f"node_rank: {host.node_rank} is not below nnodes + spares "
                f"({host.nnodes} + {host.spares})"
            )
        if host.node_rank >= host.nnodes:
            return self._spare(host)
        job = self.state.job
        if job is not None:
            self._check_job(job, host)
        else:
            self._check_pending(host)
        self._record(host)
        if job is None:
            self._pending = {r: j for r, j in self._pending.items() if j.node != host.node}
            self._pending[host.node_rank] = host
            if len(self._pending) == host.nnodes:
                job = self._job()
        self.state.save()
        # The hosts start the job's first attempt; once the supervisor started one, a host
        # joining again (its host monitor started again) leaves its ranks to the next.
        start = job is not None and job.started_by == LAUNCHED and host.node in job.placement
        return self._answer(host, job, start=start)

    def _spare(self, host: HostJoin) -> dict[str, Any]:
        """A spare host of the job: known to the cluster (a spare the backend may swap in
        for a lost node), no workers of its own until then."""
        job = self.state.job
        if job is not None:
            self._check_job(job, host, spare=True)
        else:
            self._check_shape(host)
            if host.node in {j.node for j in self._pending.values()}:
                raise JoinConflict(f"node_rank: {host.node!r} joined as a node of the job")
        self._record(host)
        self.state.save()
        swapped_in = job is not None and host.node in job.placement
        # A spare's workers are the supervisor's to start, once it is swapped in.
        return {**self._answer(host, job, start=False), "spare": not swapped_in}

    def _record(self, host: HostJoin) -> None:
        self.state.nodes[host.node] = NodeInfo(
            address=host.address, checkpoint_root=host.checkpoint_root
        )

    def _answer(self, host: HostJoin, job: JobSpec | None, *, start: bool) -> dict[str, Any]:
        """The join's answer: the job once complete, else the node ranks still awaited."""
        if job is None:
            waiting = [r for r in range(host.nnodes) if r not in self._pending]
            return {
                "job": host.job,
                "complete": False,
                "attempt": None,
                "waiting_for": waiting,
                "start": False,
            }
        return {
            "job": job.name,
            "complete": True,
            "attempt": job.attempt,
            "waiting_for": [],
            "start": start,
        }

    def _check_job(self, job: JobSpec, host: HostJoin, *, spare: bool = False) -> None:
        if job.name != host.job:
            raise JoinConflict(f"job: this cluster runs job {job.name!r}, not {host.job!r}")
        if job.hosts_master_port is None:
            raise JoinConflict(f"job: {job.name!r} was launched by the supervisor, not by hosts")
        theirs = {
            "command": job.command,
            "nnodes": len(job.placement),
            "nproc_per_node": job.nproc_per_node,
        }
        for field, value in theirs.items():
            if getattr(host, field) != value:
                raise JoinConflict(f"{field}: the job has {value!r}, not {getattr(host, field)!r}")
        if spare:
            return
        placed = job.placement[host.node_rank]
        if placed != host.node and host.node in job.placement:
            raise JoinConflict(
                f"node_rank: {host.node!r} runs node rank {job.placement.index(host.node)}"
            )

    def _check_shape(self, host: HostJoin) -> None:
        first = next(iter(self._pending.values()), None)
        if first is not None:
            for field in SHAPE:
                if getattr(first, field) != getattr(host, field):
                    raise JoinConflict(
                        f"{field}: {first.node!r} joined with {getattr(first, field)!r}, "
                        f"not {getattr(host, field)!r}"
                    )

    def _check_pending(self, host: HostJoin) -> None:
        self._check_shape(host)
        taken = self._pending.get(host.node_rank)
        if taken is not None and taken.node != host.node:
            raise JoinConflict(f"node_rank: {host.node_rank} is {taken.node!r}'s")

    def _job(self) -> JobSpec:
        """The job of the complete joins, at the newest attempt its hosts started."""
        joins = [self._pending[r] for r in sorted(self._pending)]
        first = joins[0]
        attempt = max(j.attempt for j in joins)
        job = JobSpec(
            name=first.job,
            command=first.command,
            num_dp_replicas=first.nnodes,
            num_nodes_per_dp=1,
            placement=[j.node for j in joins],
            nproc_per_node=first.nproc_per_node,
            attempt=attempt,
            started_by=LAUNCHED,
            master_port=master_port(first.master_port, attempt),
            hosts_master_addr=first.master_addr,
            hosts_master_port=first.master_port,
            hosts_master_node=joins[0].node,
        )
        self.state.job = job
        self._pending.clear()
        # Reports of older worlds than the hosts' are refused from now on.
        self._on_world(job.name, job.attempt)
        return job
