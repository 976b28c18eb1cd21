"""A job's end: its workers leave the training loop and finish (a last save, the output).

A worker that says it is finishing (state `finishing`, which the training side reports
from the worker client's or the Checkpointer's `close`) puts its job in its end phase:
from then on the job is not watched for hangs (a stalled step is what an end looks
like), but by a bound of its own, `finishing_timeout_s` from the first such report: a
worker still finishing then, or still running, is stuck, and raises a `hang` of kind
`finishing`. A remedy (a restart) starts the job over: running again.

The phase the job is in, as the sensor sees it, is `running`, `finishing` (it began to
end, and some worker is still at work) or `finished` (none left at work, and it ended:
some worker exited with success, or they said they were finishing and none exited with a
failure). Workers that said so and then all failed did not end the job: it failed while
ending (a worker's `close()` says it is finishing on its way out of a failure too), and it
is remedied as any other failed job.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from resiliency_protocol.heartbeat import WorkerReport
from resiliency_protocol.states import WorkerState
from supervisor.domain import JobPhase

SensedPhase = JobPhase


class EndedOrNot(Protocol):
    """What `phase` reads of a worker: its report, or its view."""

    @property
    def state(self) -> WorkerState: ...

    @property
    def exit_code(self) -> int | None: ...


#: Worker states that are still at work (or may be: lost from view).
AT_WORK = frozenset(
    {WorkerState.STARTING, WorkerState.RUNNING, WorkerState.LOST, WorkerState.FINISHING}
)
#: Worker states out of the training loop.
_OUT_OF_THE_LOOP = frozenset({WorkerState.FINISHING, WorkerState.STOPPED, WorkerState.EXITED})
#: Still at work when the end's bound passed: stuck (finishing ones named first).
_STUCK = (WorkerState.FINISHING, WorkerState.RUNNING, WorkerState.STARTING)


def ends_the_loop(worker: WorkerReport) -> bool:
    """This worker said it left its training loop."""
    return worker.state is WorkerState.FINISHING


def finished(worker: WorkerReport) -> bool:
    """Stopped on purpose, or exited with success."""
    return worker.state is WorkerState.STOPPED or (
        worker.state is WorkerState.EXITED and worker.exit_code == 0
    )


def out_of_the_loop(worker: WorkerReport) -> bool:
    """This worker left its training loop: said so, stopped or exited. Its job's time
    until the next step is its end's (or a failure's), no step's (progress.py)."""
    return worker.state in _OUT_OF_THE_LOOP


def phase(finishing_since: float | None, workers: Iterable[EndedOrNot]) -> SensedPhase:
    """The job's phase from when it began to finish (None: it did not say so) and the
    workers its alive nodes report."""
    workers = list(workers)
    if any(w.state in AT_WORK for w in workers):
        return "running" if finishing_since is None else "finishing"
    exited = [w.exit_code for w in workers if w.state is WorkerState.EXITED]
    succeeded = 0 in exited
    failed = any(code not in (None, 0) for code in exited)
    ended = succeeded or (finishing_since is not None and not failed)
    return "finished" if ended else "running"


def stuck(nodes: Iterable[tuple[str, Iterable[WorkerReport]]]) -> tuple[str, int] | None:
    """(node, rank) of a worker still at work, among (node, its workers): one still
    finishing first, else one still running or starting."""
    at_work = [(name, w) for name, workers in nodes for w in workers if w.state in _STUCK]
    for state in _STUCK:
        found = sorted((name, w.rank) for name, w in at_work if w.state is state)
        if found:
            return found[0]
    return None
