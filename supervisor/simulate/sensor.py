"""The production sensor, told by the simulated cluster what it would have heard.

A healthy node heartbeats every period and a healthy job steps all the time; sending
each of those to the sensor would make a month of a 2,048-node job billions of calls.
The sensor already lets a node's deadline move on without a call per heartbeat (see
`DeadlineQueue`): when a deadline comes, it asks for the latest one. Here the answer
comes from the simulated cluster: a node that still heartbeats is due at the end of the
run, unless it falls silent before (`silence` moves its deadline to that moment); a job
that still steps was seen stepping just now. Everything else (events from state changes,
GPU reports, losses, flapping, hangs, the learned hang timeout) is the sensor's own code.
Stragglers are not simulated: the periodic straggler scan is not run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from supervisor.config_parts import SensingSettings, WorkloadSettings
from supervisor.domain import JobView, NodeView, WorkerState
from supervisor.metrics import Metrics
from supervisor.sensor import Changes, Sensor
from supervisor.sensor.sensor import HANG, NODE, STRAGGLERS, DeadlineKey


class Liveness(Protocol):
    """What the simulated cluster tells the sensor."""

    def heartbeating(self, node: str) -> bool: ...

    def progressing(self, job: str) -> int | None:
        """The job's step now, when it is making progress; None when it is not."""
        ...


class SimulatedSensor(Sensor):
    def __init__(
        self,
        settings: SensingSettings,
        workload: WorkloadSettings,
        emit: Callable[[Changes], None],
        metrics: Metrics | None,
        cluster: Liveness,
        *,
        horizon: float,
        step_s: float,
    ) -> None:
        super().__init__(settings, workload, emit, metrics)
        self.cluster = cluster
        #: Loop time past the end of the run: a healthy node's deadline.
        self.horizon = horizon
        # What the hang check would learn from steady heartbeats: the longest interval
        # between two observed step advances, one polling period or one step.
        self._learned_interval = max(step_s, settings.heartbeat_polling_period_s)

    # --- what the cluster says ----------------------------------------------------------

    def silence(self, node_name: str, at: float) -> None:
        """The node's last heartbeat was at `at` (loop time): its loss is due a timeout
        after it."""
        node = self._nodes.get(node_name)
        if node is None or not node.alive:
            return
        node.last_seen = at
        self._changed.add(node_name)
        self._deadlines.arm(node.deadline_key, at + self._timeout_s)

    def progressed(self, job_name: str, step: int, at: float) -> None:
        """The job (re)started stepping at `at` from `step`: watch it for hangs anew."""
        job = self._jobs.get(job_name)
        if job is None:
            return
        progress = job.progress
        if not progress.warmed_up:
            progress.relearn(self._learned_interval)
        # Steady steps pass the warm-up after a restart in that many intervals.
        warmup = progress.unwatched_intervals * self._learned_interval
        progress.unwatched_intervals = 0
        progress.max_step = step
        progress.last_progress = at + warmup
        progress.node_steps.clear()
        self._advanced(job, at + warmup)

    # --- the sensor's own hooks -----------------------------------------------------------

    def _extended(self, key: DeadlineKey, deadline: float) -> float:
        kind, name = key
        now = self._clock()
        if kind == NODE:
            node = self._nodes.get(name)
            if node is not None and node.alive and self.cluster.heartbeating(name):
                node.last_seen = now
                self._changed.add(name)
                return self.horizon
        elif kind == HANG:
            job = self._jobs.get(name)
            step = self.cluster.progressing(name) if job is not None else None
            if job is not None and step is not None:
                job.progress.max_step = max(job.progress.max_step, step)
                job.progress.last_progress = now
                for node_name in job.nodes:
                    self._stepping(node_name, step)
                return now + job.progress.timeout_s
        return super()._extended(key, deadline)

    def _expired(self, key: DeadlineKey, deadline: float) -> None:
        kind, name = key
        if kind == STRAGGLERS:
            return  # not simulated; and not armed again
        if kind == HANG:
            self._heard(self._jobs[name].nodes if name in self._jobs else ())
        super()._expired(key, deadline)

    def snapshot(self) -> tuple[dict[str, NodeView], dict[str, JobView]]:
        self._heard(self._nodes)
        return super().snapshot()

    def _heard(self, names: Iterable[str]) -> None:
        """Nodes that heartbeat were heard from just now (their last heartbeat is read,
        with their running workers at the step their job is at)."""
        now = self._clock()
        for name in list(names):
            node = self._nodes.get(name)
            if node is not None and node.alive and self.cluster.heartbeating(name):
                node.last_seen = now
                self._changed.add(name)
                step = self.cluster.progressing(node.job) if node.job is not None else None
                if step is not None:
                    self._stepping(name, step)

    def _stepping(self, node_name: str, step: int) -> None:
        """The node's running workers report `step`, as their heartbeats would."""
        node = self._nodes.get(node_name)
        if node is None or not node.alive:
            return
        self._changed.add(node_name)
        node.heard_again(
            [
                msgspec.structs.replace(w, step=step) if w.state is WorkerState.RUNNING else w
                for w in node.workers
            ]
        )


__all__ = ["HANG", "Liveness", "SimulatedSensor"]
