"""The newest world of each job, and the fence it puts on reports from older ones.

A backend tells `started(job, world)` as it starts a newer world (a restart, a hot-swap,
an in-process heal), before it starts any rank in it, and the newest it keeps when the
supervisor starts (the Kubernetes backend: as its watch sees each JobSet restart and
in-process heal, supervisor/kube/worlds.py). Only the backend decides: a world is never
learned from reports (a pod started anew by its JobSet may report an older world until it
is told the current one, and must not be killed for it). A job whose backend tells no
world is not fenced. A worker report of an older world is never applied: a node cut off
during the heal would otherwise report, when it comes back, what its old workers did (a
lost heartbeat, an exit) and drive an action in the newer world. One that is still alive
makes the whole report refused (`StaleWorldReport`): its host monitor stops it and
reports again; one that is not is dropped from the report, and the rest applies. Both are
counted in `supervisor_stale_world_reports`.
"""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import Counter

from resiliency_protocol.heartbeat import HostHeartbeat, WorkerReport
from resiliency_protocol.states import WorkerState
from resiliency_protocol.worlds import StaleWorld
from supervisor.errors import SupervisorError
from supervisor.metrics import Metrics

log = logging.getLogger(__name__)

#: The worker states of a process that may still run (and write).
_ALIVE = frozenset(
    {WorkerState.STARTING, WorkerState.RUNNING, WorkerState.FINISHING, WorkerState.LOST}
)


class StaleWorldReport(SupervisorError):
    """A report with live workers of an older world than the job's newest."""

    def __init__(self, reply: StaleWorld) -> None:
        super().__init__(reply.message)
        self.reply = reply

    def body(self) -> bytes:
        return msgspec.json.encode(self.reply)


class WorldFence:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self._newest: dict[str, int] = {}
        self._runs: dict[str, str] = {}  # job -> the run its newest world counts in
        self._counter = Counter(
            "supervisor_stale_world_reports",
            "Reports from an older world than the job's newest, refused or dropped, by "
            "report (heartbeat, checkpoint) and outcome (refused: the sender must stop "
            "the workers; dropped: the workers had ended, the rest of the report applied).",
            ["report", "outcome"],
            registry=metrics.registry if metrics is not None else None,
        )
        for report in ("heartbeat", "checkpoint"):
            for outcome in ("refused", "dropped"):
                self._counter.labels(report, outcome)

    def started(self, job: str, world: int, run: str | None = None) -> None:
        """The job runs in `world` from now on (an older one is ignored). `run`: which run
        of the job its worlds count in (a JobSet's UID); a job made again under its name
        (a JobSet recreated to rescale it) counts its worlds from 0 again, so the new run's
        world replaces the old run's newest instead of being taken for an older one."""
        if run is not None:
            previous, self._runs[job] = self._runs.get(job), run
            if previous is not None and previous != run:
                log.info("job %s: made again; world %d is its newest", job, world)
                self._newest[job] = world
                return
        if world > self._newest.get(job, -1):
            log.info("job %s: world %d is the newest; older ones are fenced", job, world)
            self._newest[job] = world

    def newest(self, job: str) -> int | None:
        return self._newest.get(job)

    def counted(self, report: str, outcome: str) -> float:
        """How many reports of a kind had an outcome (for tests and the bench)."""
        value: float = self._counter.labels(report, outcome)._value.get()
        return value

    def heartbeat(self, hb: HostHeartbeat) -> HostHeartbeat:
        """`hb` as it may be applied: unchanged (nearly always), or without its ended
        workers of an older world. Raises StaleWorldReport when a live one is of an
        older world."""
        job = hb.job
        if job is None or not hb.workers:
            return hb
        newest = self._newest.get(job)
        if newest is None:
            return hb
        stale: list[WorkerReport] | None = None
        for worker in hb.workers:
            world = worker.world
            if world is not None and world < newest:
                if stale is None:
                    stale = []
                stale.append(worker)
        if stale is None:
            return hb
        alive = [w.rank for w in stale if w.state in _ALIVE]
        if alive:
            self._counter.labels("heartbeat", "refused").inc()
            raise StaleWorldReport(
                StaleWorld(
                    message=f"ranks {alive} of job {job!r} on node {hb.node!r} belong to an "
                    f"older world than its newest ({newest}): stop them",
                    job=job,
                    world=newest,
                    ranks=alive,
                )
            )
        self._counter.labels("heartbeat", "dropped").inc()
        ended = {id(w) for w in stale}
        return msgspec.structs.replace(hb, workers=[w for w in hb.workers if id(w) not in ended])

    def checkpoint(self, job: str | None, world: int | None) -> bool:
        """Whether a checkpoint report of `world` may be recorded (counted when not)."""
        if job is None or world is None:
            return True
        newest = self._newest.get(job)
        if newest is None or world >= newest:
            return True
        self._counter.labels("checkpoint", "refused").inc()
        return False
