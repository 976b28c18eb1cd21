"""What a node is, in one word, as the API, the CLI and the dashboard show it.

A node's `state` is what its host monitor last said; it stays as it was when the node
goes silent, so a lost node would read `running`. Its `status` says what the node is
for the cluster now, and its `marks` what to keep an eye on:

- `lost`: no heartbeat within `heartbeat_timeout_s`.
- `failed`: its host monitor reports it failed.
- `draining`: cordoned while its workers still run (a hot swap is taking its job off).
- `cordoned`: out of service, idle.
- `spare`: idle and free to take a job.
- `running`, `complete`, `undefined`: as its host monitor reports.

Marks: `flapping` (lost again and again within `flap_window_s`; cleared after that long
steady), `late` (alive, but its last heartbeat is over half the timeout old).

A dry-run supervisor cordons nothing: what it would have cordoned is a separate field,
never `cordoned` nor the status.
"""

from __future__ import annotations

from enum import StrEnum

from supervisor.domain import NodeState, NodeView, WorkerState


class NodeStatus(StrEnum):
    LOST = "lost"
    FAILED = "failed"
    DRAINING = "draining"
    CORDONED = "cordoned"
    SPARE = "spare"
    RUNNING = "running"
    COMPLETE = "complete"
    UNDEFINED = "undefined"


class NodeMark(StrEnum):
    FLAPPING = "flapping"
    LATE = "late"


#: Workers that still hold a share of a job (a cordoned node with them is draining).
_BUSY = frozenset({WorkerState.STARTING, WorkerState.RUNNING, WorkerState.FINISHING})
_AS_REPORTED = {
    NodeState.SPARE: NodeStatus.SPARE,
    NodeState.RUNNING: NodeStatus.RUNNING,
    NodeState.COMPLETE: NodeStatus.COMPLETE,
    NodeState.UNDEFINED: NodeStatus.UNDEFINED,
    NodeState.FAILED: NodeStatus.FAILED,
}


def node_status(view: NodeView, *, cordoned: bool) -> NodeStatus:
    """`cordoned`: whether the node is really cordoned (never a dry run's would-have)."""
    if not view.alive:
        return NodeStatus.LOST
    if view.state is NodeState.FAILED:
        return NodeStatus.FAILED
    if cordoned:
        busy = view.job is not None and any(w.state in _BUSY for w in view.workers)
        return NodeStatus.DRAINING if busy else NodeStatus.CORDONED
    return _AS_REPORTED[view.state]


def node_marks(view: NodeView, age_s: float | None, timeout_s: float) -> list[NodeMark]:
    marks = []
    if view.flapping:
        marks.append(NodeMark.FLAPPING)
    if view.alive and age_s is not None and age_s > timeout_s / 2:
        marks.append(NodeMark.LATE)
    return marks
