"""A supervisor's database holding a fleet, as a supervisor restarted with its fleet finds
it: every node alive, running its job's workers (the nodes of bench/fleet_loadgen.py),
every job past its warm-up.

Registering 25,000 nodes over HTTP is a write each, and on this machine took minutes;
the supervisor restores these at start-up and gives them one heartbeat timeout to beat.
"""

from __future__ import annotations

from datetime import UTC, datetime

from bench.fleet_loadgen import job_name
from bench.payload import node_name
from supervisor.config_parts import WorkloadSettings
from supervisor.domain import JobView, NodeState, NodeView, WorkerState, WorkerView
from supervisor.store import open_store

BATCH = 2000
#: The jobs have run a while: the longest step interval their supervisor learned (a step
#: with a checkpoint, say). A fresh job persists its longest interval at each new maximum
#: while it learns (a few writes a job, not per heartbeat); a steady fleet's rarely grow.
LEARNED_INTERVAL_S = 5.0


def fill_fleet(url: str, nodes: int, workers: int, ranks_per_job: int) -> None:
    """Migrate the database at `url` and write the fleet's nodes and jobs."""
    store = open_store(url)
    try:
        per_job = max(1, ranks_per_job // workers)
        shape = WorkloadSettings()
        jobs = [
            JobView(
                name=job_name(j),
                num_dp_replicas=shape.num_dp_replicas,
                min_num_dp_replicas=shape.min_num_dp_replicas,
                max_num_dp_replicas=shape.max_num_dp_replicas,
                num_nodes_per_dp=shape.num_nodes_per_dp,
                step_interval_s=LEARNED_INTERVAL_S,
            )
            for j in range((nodes + per_job - 1) // per_job)
        ]
        store.record([], jobs=jobs)
        now = datetime.now(UTC)
        for start in range(0, nodes, BATCH):
            views = [
                NodeView(
                    name=node_name(i),
                    state=NodeState.RUNNING,
                    job=job_name(i // per_job),
                    alive=True,
                    last_heartbeat=now,
                    workers=tuple(
                        WorkerView(
                            rank=(i % per_job) * workers + local,
                            local_rank=local,
                            pid=10_000 + local,
                            state=WorkerState.RUNNING,
                            step=1,
                        )
                        for local in range(workers)
                    ),
                )
                for i in range(start, min(nodes, start + BATCH))
            ]
            store.record([], nodes=views)
    finally:
        store.close()
