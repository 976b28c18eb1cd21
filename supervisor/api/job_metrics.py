"""Per-job Prometheus series, exported at /metrics with the supervisor's own.

Two kinds of figures:

- Live ones, read from memory when scraped: each job's last step and when it advanced,
  whether it runs, its restarts and emergency checkpoints (counted by the actuator as it
  finishes them, see supervisor.metrics.JobActionCounts), and the usable spare nodes.
- Figures of the job's stored history: goodput, step time, time to recover, restarts
  left in the restart budget. They are computed as `GET /api/v1/jobs/{job}/goodput`
  computes its figures (same timeline, same model), in a worker thread, when /metrics is
  scraped and the last computation is older than max(goodput_sample_period_s, 20 x what
  it cost): the history moves no faster than the step samples, and goodput of many long
  jobs is CPU-bound Python, so it takes at most about 5% of the process's time from
  heartbeats however often Prometheus scrapes.

Labels are bounded: `job_name` is a job the sensor knows (its series go when the sensor
forgets it), `kind` and `outcome` come from fixed enums; no series is labelled by node.
The training job is `job_name`, not `job`: Prometheus sets `job` on every series it
scrapes (the scrape job) and would rename ours to `exported_job`.

A standby exports none of these (it knows no jobs): only the acting replica does.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.actuator import Backend
from supervisor.controller.budget import Budgets
from supervisor.domain import ActionStatus, NodeState, ProgressSample, utcnow
from supervisor.goodput.breakdown import compute_goodput
from supervisor.goodput.model import Timeline
from supervisor.goodput.service import GoodputService
from supervisor.metrics import Metrics, RestartKind
from supervisor.sensor import Sensor
from supervisor.store.roles import CountedHistory

log = logging.getLogger(__name__)

#: Upper bounds of the time-to-recover histogram (s): seconds for an in-process restart,
#: minutes for a rescheduled JobSet, an hour for a job that waited for capacity.
RECOVERY_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)
#: Step time is measured over the last this many seconds of the current attempt: the
#: step reports' times are only as exact as a heartbeat period, so a longer span evens
#: that out.
STEP_TIME_WINDOW_S = 300.0
#: A computation of the history figures is reused for at least this many times its cost.
COST_FACTOR = 20.0
EMERGENCY_OUTCOMES = (ActionStatus.SUCCEEDED, ActionStatus.FAILED)


class JobMetricsSettings(Protocol):
    """The settings the series read: the sampling period (history) and the restart
    budget (remediation)."""

    @property
    def goodput_sample_period_s(self) -> float: ...
    @property
    def restart_window_s(self) -> float: ...
    @property
    def max_restarts_in_window(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Sources:
    """What the series are read from: the parts that live as long as the runtime, and
    (as functions, called only once `ready` says so) those it makes when it starts."""

    ready: Callable[[], bool]
    sensor: Sensor
    settings: JobMetricsSettings
    metrics: Metrics
    backend: Backend
    store: Callable[[], CountedHistory]
    budgets: Callable[[], Budgets]


@dataclass(frozen=True, slots=True)
class HistoryFigures:
    """What one job's stored history says, computed in a worker thread."""

    goodput: float
    step_seconds: float | None
    #: (detection time, seconds to recover) of each recovered incident, oldest first.
    recoveries: tuple[tuple[float, float], ...]


@dataclass(slots=True)
class RecoveryHistogram:
    """Cumulative time-to-recover observations of one job."""

    counts: list[int] = field(default_factory=lambda: [0] * len(RECOVERY_BUCKETS))
    total: int = 0
    sum_s: float = 0.0
    #: Detection time of the newest incident observed; older ones are never seen again.
    observed_until: float = float("-inf")

    def observe(self, recoveries: Iterable[tuple[float, float]]) -> None:
        for detected_at, seconds in recoveries:
            if detected_at <= self.observed_until:
                continue
            self.observed_until = detected_at
            self.total += 1
            self.sum_s += seconds
            for i, bound in enumerate(RECOVERY_BUCKETS):
                if seconds <= bound:
                    self.counts[i] += 1

    def buckets(self) -> list[tuple[str, float]]:
        pairs = zip(RECOVERY_BUCKETS, self.counts, strict=True)
        return [*((str(b), float(c)) for b, c in pairs), ("+Inf", float(self.total))]


def recent_step_seconds(timeline: Timeline, window_s: float = STEP_TIME_WINDOW_S) -> float | None:
    """Seconds per step from the newest step report back to the oldest one within
    ``window_s`` before it, in the same attempt (no start or checkpoint load between)."""
    steps = sorted(timeline.steps, key=lambda s: (s.time, s.step))
    if len(steps) < 2:
        return None
    last = steps[-1]
    boundaries = [s.time for s in timeline.job_starts] + [ld.time for ld in timeline.loads]
    since = max((b for b in boundaries if b < last.time), default=float("-inf"))
    first = last
    for report in reversed(steps[:-1]):
        if report.time <= since or report.time < last.time - window_s:
            break
        first = report
    if first is last or last.step <= first.step:
        return None
    return (last.time - first.time) / (last.step - first.step)


def recoveries(timeline: Timeline) -> list[tuple[float, float]]:
    """(detection, seconds to recover) of each incident the job recovered from.

    An incident (one per failure as the goodput history counts them: failures detected
    before the job was started again are one) is recovered at the first step reported
    after the job's next start (a restart by an action, or one seen in the workers'
    steps or checkpoint loads). Until then it is not counted.
    """
    starts = sorted(s.time for s in timeline.job_starts)
    steps = sorted(s.time for s in timeline.steps)
    out = []
    for failure in sorted(timeline.failures, key=lambda f: f.detected_at):
        i = bisect.bisect_left(starts, failure.detected_at)
        if i == len(starts):
            break
        k = bisect.bisect_right(steps, starts[i])
        if k == len(steps):
            break
        out.append((failure.detected_at, steps[k] - failure.detected_at))
    return out


def history_figures(timeline: Timeline) -> HistoryFigures:
    report = compute_goodput(timeline)
    return HistoryFigures(
        goodput=min(1.0, max(0.0, report.goodput)),
        step_seconds=recent_step_seconds(timeline),
        recoveries=tuple(recoveries(timeline)),
    )


_JOB = ["job_name"]


@dataclass(slots=True)
class _Families:
    """The families of one scrape, empty until filled."""

    goodput: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_goodput_ratio",
            "Productive time over wall time of the job's whole history, as GET "
            "/api/v1/jobs/{job}/goodput reports it (0..1).",
            labels=_JOB,
        )
    )
    last_step: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_last_step",
            "Newest training step the job's nodes reported.",
            labels=_JOB,
        )
    )
    last_progress: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_last_progress_timestamp_seconds",
            "Unix time the job's step last changed (advanced, or went back at a restart).",
            labels=_JOB,
        )
    )
    running: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_running",
            "1 while some node of the job last reported the state running (alive or not); "
            "0 once none does (the job completed, or its nodes were released).",
            labels=_JOB,
        )
    )
    step_seconds: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_step_seconds",
            "Seconds per training step over the last 5 minutes of the current attempt "
            "(step samples and periodic checkpoints).",
            labels=_JOB,
        )
    )
    restarts_left: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_restarts_remaining",
            "Disruptive actions the policy may still take for the job: "
            "max_restarts_in_window minus those taken within restart_window_s; 0 as well "
            "once the job was given up (max_no_progress_restarts). 0: the restart budget "
            "is spent and the job is left alone.",
            labels=_JOB,
        )
    )
    restarts: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "supervisor_job_restarts",
            "Restarts of the job carried out by this replica (succeeded disruptive "
            "actions), by kind.",
            labels=[*_JOB, "kind"],
        )
    )
    emergency: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "supervisor_job_emergency_checkpoints",
            "Emergency checkpoints of the job carried out by this replica, by outcome.",
            labels=[*_JOB, "outcome"],
        )
    )
    checkpoint_failures: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "supervisor_job_checkpoint_failures",
            "Checkpoint saves of the job that did not commit, as its workers reported "
            "them, by tier.",
            labels=[*_JOB, "tier"],
        )
    )
    checkpoint_step: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_checkpoint_newest_step",
            "The newest step every reporting rank of the job has saved, by tier.",
            labels=[*_JOB, "tier"],
        )
    )
    checkpoint_time: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_job_checkpoint_newest_timestamp_seconds",
            "When the last rank saved the job's newest step of the tier (Unix time): "
            "time() minus this is the age of the newest checkpoint.",
            labels=[*_JOB, "tier"],
        )
    )
    recovery: HistogramMetricFamily = field(
        default_factory=lambda: HistogramMetricFamily(
            "supervisor_job_recovery_seconds",
            "Time to recover: from the event that detected a failure to the first step "
            "reported after the job's next start (late by up to a step sample period).",
            labels=_JOB,
        )
    )
    spares: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "supervisor_spare_nodes",
            "Spare nodes the policy can use now: alive, not cordoned, not flapping.",
        )
    )

    def all(self) -> list[Metric]:
        return [
            self.goodput,
            self.last_step,
            self.last_progress,
            self.running,
            self.step_seconds,
            self.restarts_left,
            self.restarts,
            self.emergency,
            self.checkpoint_failures,
            self.checkpoint_step,
            self.checkpoint_time,
            self.recovery,
            self.spares,
        ]


class JobMetrics(Collector):
    """The per-job series (see the module docstring). Register it with the supervisor's
    registry, and await `refresh` before each scrape."""

    def __init__(self, sources: Sources, cost_factor: float = COST_FACTOR) -> None:
        self._ready = sources.ready
        self._sensor = sources.sensor
        self._settings = sources.settings
        self._metrics = sources.metrics
        self._backend = sources.backend
        self._store = sources.store
        self._budgets = sources.budgets
        self.cost_factor = cost_factor
        self._figures: dict[str, HistoryFigures] = {}
        self._recovery: dict[str, RecoveryHistogram] = {}
        self._restarts_in_window: dict[str, int] = {}
        self._fresh_until = float("-inf")  # monotonic
        self._lock = asyncio.Lock()

    # --- computing the history figures ---------------------------------------------------

    async def refresh(self) -> None:
        """Compute the history figures again if they are stale (never raises: a database
        that does not answer leaves the previous figures in place)."""
        if not self._ready():
            return
        async with self._lock:
            if time.monotonic() < self._fresh_until:
                return
            jobs = self._sensor.job_names()
            # Each job's step as the sensor holds it now, newer than its last sample.
            live = {
                job: [ProgressSample(job, step, datetime.fromtimestamp(at, UTC))]
                for job, step, at in self._sensor.job_steps()
            }
            started = time.monotonic()
            try:
                figures, restarts = await asyncio.to_thread(self._compute, jobs, live)
            except Exception:
                log.exception("cannot compute the per-job metrics from the history")
                return
            finally:
                cost = time.monotonic() - started
                period = self._settings.goodput_sample_period_s
                self._fresh_until = time.monotonic() + max(period, self.cost_factor * cost)
            self._figures = figures
            self._restarts_in_window = restarts
            for job, figure in figures.items():
                self._recovery.setdefault(job, RecoveryHistogram()).observe(figure.recoveries)

    def _compute(
        self, jobs: Sequence[str], live: dict[str, list[ProgressSample]]
    ) -> tuple[dict[str, HistoryFigures], dict[str, int]]:
        figures = {}
        store = self._store()
        goodput = GoodputService(store, self._sensor)
        for job in jobs:
            timeline, _ = goodput.timeline(job, live=live.get(job, ()))
            figures[job] = history_figures(timeline)
        # The restart budget as the policy counts it (controller.context).
        window = timedelta(seconds=self._settings.restart_window_s)
        counts = store.policy_counts(utcnow() - window)
        return figures, dict(counts.restarts_in_window)

    # --- scraping ------------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        # Registration must not call `collect`: the runtime may not be started yet.
        return iter(_Families().all())

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        if self._ready():
            self._fill(families)
        return iter(families.all())

    def _fill(self, f: _Families) -> None:
        sensor = self._sensor
        jobs = sensor.job_names()
        self._forget_all_but(jobs)
        counts = self._metrics.job_actions
        checkpoints = self._metrics.job_checkpoints
        budget = self._settings.max_restarts_in_window
        budgets = self._budgets()
        steps = {job: (step, at) for job, step, at in sensor.job_steps()}
        running = sensor.running_jobs()
        for name in jobs:
            labels = [name]
            if name in steps:
                step, at = steps[name]
                f.last_step.add_metric(labels, step)
                f.last_progress.add_metric(labels, at)
            f.running.add_metric(labels, 1.0 if name in running else 0.0)
            by_kind = counts.restarts.get(name, {})
            for kind in RestartKind:
                f.restarts.add_metric([name, kind.value], by_kind.get(kind, 0))
            by_outcome = counts.emergency_checkpoints.get(name, {})
            for outcome in EMERGENCY_OUTCOMES:
                f.emergency.add_metric([name, outcome.value], by_outcome.get(outcome, 0))
            for tier, failed in sorted(checkpoints.failures.get(name, {}).items()):
                f.checkpoint_failures.add_metric([name, tier], failed)
            for tier, (step, at) in sorted(checkpoints.newest(name).items()):
                f.checkpoint_step.add_metric([name, tier], step)
                f.checkpoint_time.add_metric([name, tier], at)
            figures = self._figures.get(name)
            if figures is None:
                continue  # a job new since the last computation: next time
            f.goodput.add_metric(labels, figures.goodput)
            if figures.step_seconds is not None:
                f.step_seconds.add_metric(labels, figures.step_seconds)
            left = budget - self._restarts_in_window.get(name, 0)
            if budgets.given_up(name) is not None:
                left = 0  # given up (no progress): nothing more until a reset
            f.restarts_left.add_metric(labels, max(0, left))
            histogram = self._recovery.get(name) or RecoveryHistogram()
            f.recovery.add_metric(labels, histogram.buckets(), histogram.sum_s)
        f.spares.add_metric([], usable_spares(self._backend, sensor))

    def _forget_all_but(self, jobs: Iterable[str]) -> None:
        known = set(jobs)
        self._metrics.job_actions.keep_only(known)
        self._metrics.job_checkpoints.keep_only(known)
        for cache in (self._figures, self._recovery):
            for job in [j for j in cache if j not in known]:
                del cache[job]


def usable_spares(backend: Backend, sensor: Sensor) -> int:
    """Spare nodes as the policy sees them (`Supervisor._snapshot`, `NodeView.is_usable_spare`):
    alive, not flapping, spare by their own report or, when the backend watches the
    cluster, because no workload runs on them; not cordoned. Counted from the sensor's
    records, without building every node's view."""
    cluster = backend.cluster_nodes()
    count = 0
    for name, state, own_cordoned in sensor.healthy_nodes():
        seen = cluster.get(name)
        spare = state is NodeState.SPARE or (seen is not None and seen.spare)
        cordoned = seen.cordoned if seen is not None else own_cordoned
        if spare and not cordoned:
            count += 1
    return count
