"""Nodes and their workers as the API shows them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from supervisor.api.node_status import NodeMark, NodeStatus, node_marks, node_status
from supervisor.domain import NodeState, NodeView, WorkerState


class WorkerOut(BaseModel):
    rank: int
    local_rank: int
    pid: int | None
    state: WorkerState = Field(
        description="`lost` on a lost node: nothing is known of it since (`reported_state` "
        "keeps what was last reported)."
    )
    reported_state: WorkerState | None = Field(
        None, description="On a lost node: the state its host monitor last reported."
    )
    step: int | None
    exit_code: int | None
    compute_s: float | None = Field(
        None,
        description="Seconds per step in the worker's own work, as it last reported them "
        "(what stragglers are scored on).",
    )


class NodeOut(BaseModel):
    name: str
    status: NodeStatus = Field(
        description="What the node is now: lost, failed, draining, cordoned, spare, running, "
        "complete or undefined (supervisor/api/node_status.py)."
    )
    marks: list[NodeMark] = Field(
        description="What to keep an eye on: flapping (cleared after flap_window_s steady), "
        "late (alive, its last heartbeat over half the timeout old)."
    )
    state: NodeState = Field(description="What its host monitor last reported.")
    job: str | None
    alive: bool
    cordoned: bool = Field(description="Cordoned by the supervisor (never by a dry run).")
    dry_run_cordoned: bool = Field(
        False,
        description="Dry run: the supervisor would have cordoned it (it did not; the node "
        "is in service).",
    )
    flapping: bool
    flapping_clears_in_s: float | None = Field(
        None,
        description="Flapping and up: seconds of steady heartbeats left until the mark "
        "clears (flap_window_s after it was last heard again).",
    )
    last_heartbeat: datetime | None
    heartbeat_age_s: float | None
    workers: list[WorkerOut]

    @classmethod
    def of(
        cls,
        n: NodeView,
        age_s: float | None,
        *,
        timeout_s: float,
        dry_run: bool = False,
        flapping_clears_in_s: float | None = None,
    ) -> NodeOut:
        cordoned = n.cordoned and not dry_run
        return cls(
            name=n.name,
            status=node_status(n, cordoned=cordoned),
            marks=node_marks(n, age_s, timeout_s),
            state=n.state,
            job=n.job,
            alive=n.alive,
            cordoned=cordoned,
            dry_run_cordoned=n.cordoned and dry_run,
            flapping=n.flapping,
            flapping_clears_in_s=(
                None if flapping_clears_in_s is None else round(flapping_clears_in_s, 1)
            ),
            last_heartbeat=n.last_heartbeat,
            heartbeat_age_s=None if age_s is None else round(age_s, 3),
            workers=[
                WorkerOut(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    state=w.state if n.alive else WorkerState.LOST,
                    reported_state=None if n.alive else w.state,
                    step=w.step,
                    exit_code=w.exit_code,
                    compute_s=w.compute_s,
                )
                for w in n.workers
            ],
        )
