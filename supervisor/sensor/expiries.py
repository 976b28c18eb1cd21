"""What the sensor does when a deadline passes (deadlines.py keeps them).

- a node's (`NODE`): it is lost, or flapping when lost too often within `flap_window_s`;
- a job's hang check (`HANG`): it hangs, unless a silent node of it explains the stall;
- a job's end (`FINISHING`): a worker still at work is stuck (finishing.py);
- the periodic straggler check (`STRAGGLERS`, stragglers.py).

`Sensor` has these from `DeadlineHandlers`; its `_expired` picks one by the key's kind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from supervisor.config_parts import SensingSettings
from supervisor.domain import Event, EventType, WorkerState, utcnow
from supervisor.event_details import HangDetails
from supervisor.metrics import Metrics
from supervisor.sensor.changes import Changes
from supervisor.sensor.clock import SensorClock
from supervisor.sensor.fault_marks import FaultMarks
from supervisor.sensor.finishing import stuck
from supervisor.sensor.jobs import JobRecord
from supervisor.sensor.nodes import NodeRecord
from supervisor.sensor.stragglers import StragglerScorer

HANG = "hang"
FINISHING = "finishing"  # a job's end, bounded by finishing_timeout_s
STRAGGLERS = "stragglers"  # the periodic straggler check (one key, name "")

#: Worker states in which a job can hang: with none of them left, a stall is the end.
_MAY_HANG = frozenset({WorkerState.RUNNING, WorkerState.STARTING})
#: A node this many polling periods past its last heartbeat counts as silent.
_SILENT_PERIODS = 1.5
#: A deferred hang check runs this long after the silent node's heartbeat deadline.
_AFTER_NODE_DEADLINE_S = 0.01

log = logging.getLogger(__name__)


class DeadlineHandlers(SensorClock):
    # What `Sensor` sets up.
    settings: SensingSettings
    metrics: Metrics
    fault_marks: FaultMarks
    stragglers: StragglerScorer
    _nodes: dict[str, NodeRecord]
    _jobs: dict[str, JobRecord]
    _timeout_s: float
    _changed: set[str]  # nodes whose view may have changed (views.py)
    _event: Callable[..., Event]
    #: When the log last said the supervisor ran behind (event-loop time).
    _warned_behind_at = float("-inf")

    def answered(self, name: str) -> None:
        """`name`'s heartbeat was answered only now: recording what it changed took a while
        (a slow commit). A host monitor sends its next heartbeat once the last is answered,
        so its silence counts from the answer, not from when the heartbeat came in."""
        node = self._nodes.get(name)
        if node is not None and node.alive:
            node.last_seen = max(node.last_seen, self._clock())
            self._changed.add(name)

    def _node_lost(self, name: str, deadline: float, changes: Changes) -> None:
        node = self._nodes.get(name)
        if node is None or not node.alive:
            return
        now = self._deadlines.time()
        second_look = node.loss_recheck == deadline
        node.loss_recheck = None
        if not second_look and self._ran_behind(node, deadline, now):
            return
        # After a second look, how late the loss is told counts from the node's own
        # deadline, not from that look's.
        lateness = now - (node.last_seen + self._timeout_s if second_look else deadline)
        self.metrics.detection_lateness.observe(lateness)
        node.alive = False
        self._changed.add(name)
        if node.job is not None:
            # The job stalls while the node is gone; that is not a separate hang.
            self._deadlines.disarm((HANG, node.job))
        window = self.settings.flap_window_s
        node.losses = [t for t in node.losses if now - t <= window]
        node.losses.append(now)
        cause = self.fault_marks.loss_cause(node.name)
        details: dict[str, Any] = {
            "last_heartbeat": datetime.fromtimestamp(
                node.last_heartbeat(self._wall_offset()), UTC
            ).isoformat(),
            "heartbeat_timeout_s": self.settings.heartbeat_timeout_s,
            "lateness_ms": round(lateness * 1000, 3),
        }
        if node.flapping:
            self.metrics.events_suppressed.labels(EventType.HOST_HEARTBEAT_LOST.value).inc()
        elif len(node.losses) >= self.settings.flap_max_losses:
            node.flapping = True
            changes.events.append(
                self._event(
                    EventType.NODE_FLAPPING,
                    node,
                    fault_id=cause,
                    losses=len(node.losses),
                    window_s=window,
                    **details,
                )
            )
        else:
            changes.events.append(
                self._event(EventType.HOST_HEARTBEAT_LOST, node, fault_id=cause, **details)
            )
        changes.nodes.append(node.view(self._wall_offset()))

    def _ran_behind(self, node: NodeRecord, deadline: float, now: float) -> bool:
        """Whether the node's loss waits: its deadline fired more than a heartbeat period
        late, so the supervisor itself ran behind (paused, starved of CPU, a slow commit),
        and the node's heartbeat may sit unread in its own queue. The loss is checked
        once more (never a third time), as long after as the supervisor was behind (at
        least a period, at most a timeout): a heartbeat read meanwhile moves the deadline
        on; else the node is lost then. Said once per timeout in the log, and in the
        metrics."""
        behind = now - deadline
        period = self.settings.heartbeat_polling_period_s
        if behind <= period:
            return False
        node.loss_recheck = now + min(max(behind, period), self._timeout_s)
        self._deadlines.arm(node.deadline_key, node.loss_recheck)
        self.metrics.losses_deferred.inc()
        self.metrics.behind.observe(behind)
        if now - self._warned_behind_at > self._timeout_s:
            self._warned_behind_at = now
            log.warning(
                "the supervisor ran %.2fs behind its heartbeat deadlines (paused, starved "
                "of CPU, or a slow commit): node losses are checked again once the "
                "heartbeats queued meanwhile are read",
                behind,
            )
        return True

    def _check_stragglers(self, changes: Changes) -> None:
        """Every heartbeat period: one sample per running rank that reports its compute
        time and stepped since, then the stragglers and recoveries that became due (see
        stragglers.py)."""
        now = self._deadlines.time()
        self._deadlines.arm((STRAGGLERS, ""), now + self.settings.heartbeat_polling_period_s)
        for node in self._nodes.values():
            if not node.alive or node.job is None:
                continue
            # Most nodes' newest heartbeat is kept as its bytes: decoded only if it has
            # compute times at all.
            if node.body is not None and b'"compute_s"' not in node.body:
                continue
            for worker in node.workers:
                if worker.state is WorkerState.RUNNING and worker.compute_s is not None:
                    self.stragglers.observe(
                        node.job, worker.rank, node.name, worker.compute_s, now, worker.step
                    )
        params = self.stragglers.params
        for verdict in self.stragglers.evaluate(now):
            record = self._nodes.get(verdict.node)
            if record is None or record.job != verdict.job:
                continue
            changes.events.append(
                self._event(
                    EventType.STRAGGLER if verdict.slow else EventType.STRAGGLER_RECOVERED,
                    record,
                    rank=verdict.rank,
                    score=round(verdict.score, 3),
                    slowdown_pct=round((verdict.score - 1) * 100, 1),
                    compute_s=round(verdict.compute_s, 6),
                    typical_s=round(verdict.typical_s, 6),
                    for_s=round(now - verdict.since, 3),
                    threshold=params.threshold,
                    window_s=params.window_s,
                )
            )

    def _finishing_overdue(self, name: str, changes: Changes) -> None:
        """`finishing_timeout_s` after the job began to end: a worker still finishing is
        stuck, a hang of its own kind."""
        job = self._jobs.get(name)
        if job is None or job.finishing_since is None:
            return
        nodes = [(n, self._nodes[n]) for n in job.nodes if n in self._nodes]
        found = stuck((n, node.workers) for n, node in nodes if node.alive)
        if found is None:
            return
        node = self._nodes[found[0]]
        now = self._deadlines.time()
        changes.events.append(
            self._event(
                EventType.HANG,
                node,
                rank=found[1],
                kind="finishing",
                last_step=job.progress.max_step if job.progress.max_step >= 0 else None,
                stalled_for_s=round(now - job.finishing_since, 3),
                hang_timeout_s=self.settings.finishing_timeout_s,
            )
        )

    def _job_hung(self, name: str, changes: Changes) -> None:
        job = self._jobs.get(name)
        if job is None or job.hang_reported or job.finishing_since is not None:
            return
        alive = [self._nodes[n] for n in job.nodes if n in self._nodes and self._nodes[n].alive]
        if not alive:
            return  # every node is gone: the heartbeat-lost events already tell
        if not any(w.state in _MAY_HANG for node in alive for w in node.workers):
            # Finished, stopped on purpose, or exited (an exit is an event of its own):
            # nothing is left to hang. Progress arms the check again.
            return
        now = self._deadlines.time()
        # A node heard from since the last wait is no reason to wait again: heartbeats
        # slower than the polling period would otherwise put the hang off for ever.
        heard_since = job.hang_deferred_at
        silent = [
            node.last_seen + self._timeout_s
            for node in alive
            if now - node.last_seen > _SILENT_PERIODS * self.settings.heartbeat_polling_period_s
            and (heard_since is None or node.last_seen <= heard_since)
        ]
        if silent:
            # A node of the job has missed its heartbeats: the job stalls because of it,
            # most likely. Its heartbeat deadline decides first (a lost node disarms this
            # check and is remediated once, as a node loss); then look again.
            job.hang_deferred_at = now
            self._deadlines.arm((HANG, name), max(silent) + _AFTER_NODE_DEADLINE_S)
            return
        job.hang_reported = True
        suspect = job.progress.laggard()
        node = self._nodes.get(suspect[0]) if suspect else None
        rank = None
        if node is not None:
            ranks = [w.rank for w in node.workers if w.state is WorkerState.RUNNING]
            rank = min(ranks) if ranks else None
        changes.events.append(
            Event(
                type=EventType.HANG,
                time=utcnow(),
                node=node.name if node else None,
                job=name,
                rank=rank,
                details=HangDetails(
                    last_step=job.progress.max_step,
                    stalled_for_s=round(now - job.progress.last_progress, 3),
                    hang_timeout_s=round(job.progress.timeout_s, 3),
                    timeout_learned=job.progress.learned,
                    suspect_step=suspect[1] if suspect else None,
                ).mapping(),
            )
        )
