"""A job's :class:`~supervisor.goodput.model.Timeline` from the supervisor's own history.

Pure: it takes the plain records the store returns (events, actions, the workers'
checkpoint reports, progress samples) and maps them onto the timeline's records, whose
meaning :mod:`supervisor.goodput.model` defines:

- :class:`JobStarted`: when the supervisor first saw the job (``created_at``), at the end
  of every finished disruptive action (restart in place or of the workload, hot swap,
  scale down or up), before a checkpoint load that no such action explains (the workers
  were restarted by someone else, e.g. Kubernetes), and where the sampled step went back
  with no start recorded (halfway between the two samples).
- :class:`StepReported`: each progress sample, and the step of each periodic checkpoint
  (local, ram or durable), which had completed when its save began.
- :class:`CheckpointSaved` / :class:`CheckpointLoaded`: the reports of all ranks for one
  checkpoint (same event, tier and step, close in time) make one record: the last report's
  time and the longest duration, since a synchronous job waits for its slowest rank. Saves
  are taken as blocking for their ``duration_s`` (the workers report only the blocking part
  of an asynchronous save; ``total_s``, start to commit, never counts as badput). The
  record's ``size_bytes`` and ``total_s`` are the means over the ranks that reported them.
- :class:`FailureDetected`: failure events (heartbeat lost, worker exited with a non-zero
  code or lost, hang, GPU errors, flapping, Kubernetes failures). Events detected before
  the job was started again belong to the same incident and make one failure. The fault
  time is the node's last heartbeat for a lost node, the last step advance for a hang, and
  the watchdog's observation for a GPU error; else unknown.
- :class:`Remediation`: every action of the job that started, from its start to its end.
- :class:`ReplicaChange`: each finished scale action (``to_replicas`` of the job's maximum),
  the count before the first one inferred from it (one more before a scale down); a job
  never scaled ran at full size.
- :class:`JobStopped`: the first worker exit with code 0 (the job finished).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from resiliency_protocol.checkpoint_reports import Tier
from supervisor.action_params import InvalidParams, ScaleDownParams, ScaleUpParams, check_params
from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    ActionRecord,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    ProgressSample,
)
from supervisor.event_details import WorkerExitedDetails
from supervisor.goodput.model import (
    CheckpointLoaded,
    CheckpointSaved,
    FailureDetected,
    JobStarted,
    JobStopped,
    Remediation,
    ReplicaChange,
    StepReported,
    Timeline,
)

#: Events that mean the job's training stopped making progress.
FAILURE_EVENTS = frozenset(
    {
        EventType.HOST_HEARTBEAT_LOST,
        EventType.WORKER_HEARTBEAT_LOST,
        EventType.WORKER_EXITED,
        EventType.HANG,
        EventType.GPU_XID,
        EventType.GPU_ECC,
        EventType.NODE_FLAPPING,
        EventType.NODE_NOT_READY,
        EventType.NODE_CUT_OFF,
        EventType.WORKLOAD_DOWN,
        EventType.POD_STUCK_TERMINATING,
    }
)

#: Checkpoint tiers whose saves are the job's periodic checkpoints, saved by the workers
#: at the step they report (not emergency ones, nor the copies a partner node's host
#: monitor makes later, `peer`).
PERIODIC_TIERS = frozenset({Tier.LOCAL, Tier.RAM, Tier.DURABLE})

#: Reports of one checkpoint by the ranks of a job arrive within this of each other.
GROUPING_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class HistorySources:
    """How many records of each kind the timeline was built from (shown by the API)."""

    events: int
    failure_events: int
    actions: int
    checkpoint_reports: int
    progress_samples: int


def ts(value: datetime) -> float:
    """Unix seconds of an aware datetime."""
    return value.timestamp()


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


def is_failure(event: Event) -> bool:
    if event.type not in FAILURE_EVENTS:
        return False
    if event.type is EventType.WORKER_EXITED:
        return WorkerExitedDetails.of(event).exit_code != 0
    return True


def fault_time(event: Event) -> float | None:
    """When the fault behind ``event`` happened, if the event says (never after detection)."""
    detected = ts(event.time)
    d = event.details
    at: float | None = None
    if event.type in (EventType.HOST_HEARTBEAT_LOST, EventType.NODE_FLAPPING):
        at = _parse_time(d.get("last_heartbeat"))
    elif event.type is EventType.HANG:
        stalled = d.get("stalled_for_s")
        if isinstance(stalled, int | float) and not isinstance(stalled, bool) and stalled >= 0:
            at = detected - float(stalled)
    elif event.type in (EventType.GPU_XID, EventType.GPU_ECC):
        at = _parse_time(d.get("observed_at"))
    if at is None:
        return None
    return min(at, detected)


@dataclass
class _Group:
    event: str
    tier: str
    step: int
    first: float
    last: float
    duration_s: float
    sizes: list[int] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)

    @property
    def began(self) -> float:
        return self.last - self.duration_s

    def add_size(self, r: CheckpointReport) -> None:
        if r.size_bytes is not None:
            self.sizes.append(r.size_bytes)
        if r.total_s is not None:
            self.totals.append(r.total_s)

    @property
    def size_bytes(self) -> float | None:
        return sum(self.sizes) / len(self.sizes) if self.sizes else None

    @property
    def total_s(self) -> float | None:
        return sum(self.totals) / len(self.totals) if self.totals else None


def group_checkpoints(
    reports: Iterable[CheckpointReport], window_s: float = GROUPING_WINDOW_S
) -> list[_Group]:
    """One group per checkpoint: same event, tier and step, reported within ``window_s``."""
    groups: list[_Group] = []
    open_groups: dict[tuple[str, str, int], _Group] = {}
    for r in sorted(reports, key=lambda r: (r.time, r.report_id)):
        t = ts(r.time)
        key = (r.event, r.tier, r.step)
        g = open_groups.get(key)
        if g is not None and t - g.first <= window_s:
            g.last = max(g.last, t)
            g.duration_s = max(g.duration_s, r.duration_s)
            g.add_size(r)
            continue
        g = _Group(r.event, r.tier, r.step, t, t, r.duration_s)
        g.add_size(r)
        open_groups[key] = g
        groups.append(g)
    return groups


def _replica_changes(
    actions: Sequence[ActionRecord], start: float, max_replicas: int
) -> list[ReplicaChange]:
    scales: list[tuple[float, ActionType, int]] = []
    for a in actions:
        if (
            a.type in (ActionType.SCALE_DOWN, ActionType.SCALE_UP)
            and a.status is ActionStatus.SUCCEEDED
            and a.finished_at is not None
        ):
            try:
                params = check_params(a.type, a.params)
            except InvalidParams:
                continue  # not a scale it could have carried out
            assert isinstance(params, ScaleDownParams | ScaleUpParams)
            scales.append((ts(a.finished_at), a.type, params.to_replicas))
    scales.sort(key=lambda s: s[0])

    def clamp(n: int) -> int:
        return max(0, min(max_replicas, n))

    if not scales:
        return []  # never scaled: the job ran its full size throughout
    _, first_type, to = scales[0]
    before = to + 1 if first_type is ActionType.SCALE_DOWN else to - 1
    out = [ReplicaChange(start, clamp(before), max_replicas)]
    for finished, _, to in scales:
        out.append(ReplicaChange(finished, clamp(to), max_replicas))
    return out


def _steps_of_saves(
    saves: Sequence[CheckpointSaved],
    samples: Sequence[StepReported],
    starts: Sequence[float],
    loads: Sequence[CheckpointLoaded],
) -> list[StepReported]:
    """The step of each periodic save, completed when the save began, unless a sample of
    the same attempt had already seen that step or a later one (a late report)."""
    ordered = sorted(samples, key=lambda s: s.time)
    times = [s.time for s in ordered]
    boundaries = sorted([*starts, *(ld.time for ld in loads)])
    out = []
    for sv in saves:
        if sv.tier not in PERIODIC_TIERS:
            continue
        at = sv.time - sv.duration_s
        i = bisect.bisect_right(times, at) - 1
        b = bisect.bisect_right(boundaries, at) - 1
        boundary = boundaries[b] if b >= 0 else float("-inf")
        if i >= 0 and ordered[i].time >= boundary and ordered[i].step >= sv.step:
            continue
        out.append(StepReported(sv.step, at))
    return out


def _monotonic(steps: Sequence[StepReported], boundaries: Sequence[float]) -> list[StepReported]:
    """Step reports without the stale ones: between two restarts or loads, progress only
    moves forwards, so a sample below a step already reported (by a save, which workers
    report at once, while samples lag by up to a progress interval and a heartbeat) is
    dropped."""
    cuts = sorted(boundaries)
    out = []
    segment, highest = -2, -1
    for sr in sorted(steps, key=lambda s: (s.time, s.step)):
        k = bisect.bisect_right(cuts, sr.time) - 1
        if k != segment:
            segment, highest = k, -1
        if sr.step < highest:
            continue
        highest = sr.step
        out.append(sr)
    return out


def failures_by_incident(
    events: Sequence[Event], starts: Sequence[float], *, origin: float = 0.0
) -> list[FailureDetected]:
    """The failures among `events`, one per incident: a failure detected before the job
    was started again (`starts`, sorted) after the previous one belongs to it. Times are
    Unix seconds minus `origin`."""
    failing = sorted((e for e in events if is_failure(e)), key=lambda e: (e.time, e.id or 0))
    failures: list[FailureDetected] = []
    last_detected: float | None = None
    for e in failing:
        detected = ts(e.time) - origin
        if last_detected is not None:
            i = bisect.bisect_right(starts, last_detected)
            if i == len(starts) or starts[i] > detected:
                continue  # not started again since the previous failure: same incident
        at = fault_time(e)
        failures.append(
            FailureDetected(detected, None if at is None else at - origin, e.type.value, e.node)
        )
        last_detected = detected
    return failures


def timeline_from_history(
    job: str,
    *,
    created_at: datetime | None,
    events: Sequence[Event],
    actions: Sequence[ActionRecord],
    checkpoints: Sequence[CheckpointReport],
    samples: Sequence[ProgressSample],
    now: datetime,
    max_replicas: int | None = None,
    reported_bound_s: float | None = None,
) -> tuple[Timeline, HistorySources]:
    """The job's timeline from ``created_at`` (or its first record, if earlier: the job
    ran before the supervisor saw it) to ``now``, or to its clean end when it finished.
    A time an agent reported (a checkpoint's) moves the start at most `reported_bound_s`
    before ``created_at`` (the supervisor's `agent_clock_skew_s`). See the module
    docstring for the mapping."""
    end = ts(now)
    reported = [ts(c.time) - c.duration_s for c in checkpoints]
    if reported and reported_bound_s is not None and created_at is not None:
        earliest = ts(created_at) - reported_bound_s
        reported = [max(t, earliest) for t in reported]
    first_seen = [ts(s.time) for s in samples] + reported
    start: float | None = ts(created_at) if created_at is not None else None
    if first_seen and (start is None or min(first_seen) < start):
        start = min(first_seen)

    # Attempt starts.
    starts: list[float] = []
    if start is not None:
        starts.append(start)
    remediations: list[Remediation] = []
    for a in actions:
        if a.started_at is None:
            continue
        finish = ts(a.finished_at) if a.finished_at is not None else end
        remediations.append(
            Remediation(ts(a.started_at), max(ts(a.started_at), finish), a.type.value)
        )
        if (
            a.type in DISRUPTIVE_ACTIONS
            and a.status is ActionStatus.SUCCEEDED
            and a.finished_at is not None
        ):
            starts.append(ts(a.finished_at))

    groups = group_checkpoints(checkpoints)
    saves = [
        CheckpointSaved(
            g.step,
            g.last,
            g.duration_s,
            g.tier,
            blocking=True,
            size_bytes=g.size_bytes,
            total_s=g.total_s,
        )
        for g in groups
        if g.event == "saved"
    ]
    loads = [
        CheckpointLoaded(
            g.step, g.last, g.duration_s, g.tier, size_bytes=g.size_bytes, total_s=g.total_s
        )
        for g in groups
        if g.event == "loaded"
    ]
    steps = [StepReported(s.step, ts(s.time)) for s in samples]
    starts.sort()
    steps += _steps_of_saves(saves, steps, starts, loads)

    # Progress evidence, to tell whether a load or a step going back has a start already.
    evidence = sorted([s.time for s in steps])

    def started_between(lo: float, hi: float) -> bool:
        i = bisect.bisect_left(starts, lo)
        return i < len(starts) and starts[i] <= hi

    extra: list[float] = []
    for ld in sorted(loads, key=lambda ld: ld.time):
        began = ld.time - ld.duration_s
        k = bisect.bisect_left(evidence, began)
        since = evidence[k - 1] if k else float("-inf")
        if not started_between(since, began):
            extra.append(began)
    ordered = sorted(samples, key=lambda s: s.time)
    for prev, cur in itertools.pairwise(ordered):
        if cur.step < prev.step:
            lo, hi = ts(prev.time), ts(cur.time)
            if not started_between(lo, hi) and not any(
                lo <= ld.time - ld.duration_s <= hi for ld in loads
            ):
                extra.append((lo + hi) / 2)
    all_starts = sorted(set(starts) | set(extra))
    steps = _monotonic(steps, [*all_starts, *(ld.time for ld in loads)])

    failures = failures_by_incident(events, all_starts)

    stops = [
        JobStopped(ts(e.time), "workers exited with code 0")
        for e in events
        if e.type is EventType.WORKER_EXITED and WorkerExitedDetails.of(e).exit_code == 0
    ]
    stops = stops[:1] if stops else []

    if stops and all(s <= stops[0].time for s in all_starts):
        later = [s.time for s in steps if s.time > stops[0].time]
        if not later:
            end = max(stops[0].time, start if start is not None else stops[0].time)
    if start is not None and end < start:
        end = start

    window_start = start
    if window_start is None:
        times = [*all_starts, *(s.time for s in steps), *(e.detected_at for e in failures)]
        window_start = min(times) if times else None
    replica_changes: list[ReplicaChange] = []
    if max_replicas is not None and window_start is not None:
        replica_changes = _replica_changes(actions, window_start, max_replicas)

    timeline = Timeline(
        job=job,
        start=start,
        end=end,
        job_starts=tuple(JobStarted(t, attempt=i) for i, t in enumerate(all_starts)),
        job_stops=tuple(stops),
        steps=tuple(steps),
        saves=tuple(saves),
        loads=tuple(loads),
        failures=tuple(failures),
        remediations=tuple(remediations),
        replica_changes=tuple(replica_changes),
    )
    sources = HistorySources(
        events=len(events),
        failure_events=sum(1 for e in events if is_failure(e)),
        actions=len(actions),
        checkpoint_reports=len(checkpoints),
        progress_samples=len(samples),
    )
    return timeline, sources
