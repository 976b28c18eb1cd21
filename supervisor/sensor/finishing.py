"""A job's end: its workers leave the training loop and finish (a last save, the output).

A worker that says it is finishing (state `finishing`, which the training side reports
from the worker client's or the Checkpointer's `close`), or one that exited with success,
puts its job in its end phase: from then on the job is not watched for hangs (a stalled
step is what an end looks like), but by a bound of its own, `finishing_timeout_s` from the
first such report: a worker still `finishing` then is stuck, and raises a `hang` of kind
`finishing`. A remedy (a restart) starts the job over: running again.

The phase the job is in, as the sensor sees it, is `running`, `finishing` (some worker
still finishing or running) or `finished` (none left alive).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from resiliency_protocol.heartbeat import WorkerReport
from resiliency_protocol.states import WorkerState

SensedPhase = Literal["running", "finishing", "finished"]

#: Worker states that are still at work (or may be: lost from view).
_ALIVE = frozenset(
    {WorkerState.STARTING, WorkerState.RUNNING, WorkerState.LOST, WorkerState.FINISHING}
)


def ends_the_loop(worker: WorkerReport) -> bool:
    """This worker left its training loop: finishing, or exited with success."""
    return worker.state is WorkerState.FINISHING or (
        worker.state is WorkerState.EXITED and worker.exit_code == 0
    )


def phase(finishing_since: float | None, workers: Iterable[WorkerReport]) -> SensedPhase:
    """The job's phase from when it began to finish (None: it has not) and the workers
    its alive nodes report."""
    if finishing_since is None:
        return "running"
    if any(w.state in _ALIVE for w in workers):
        return "finishing"
    return "finished"


def stuck(nodes: Iterable[tuple[str, Iterable[WorkerReport]]]) -> tuple[str, int] | None:
    """(node, rank) of the first worker still finishing, among (node, its workers)."""
    for name, workers in sorted(nodes, key=lambda item: item[0]):
        ranks = sorted(w.rank for w in workers if w.state is WorkerState.FINISHING)
        if ranks:
            return name, ranks[0]
    return None
