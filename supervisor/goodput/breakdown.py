"""Goodput and badput of one job from its :class:`~supervisor.goodput.model.Timeline`.

How the wall time is split (every instant of ``[start, end]`` gets exactly one label, so
productive time plus the badput categories add up to the wall time):

1. Attempts. Each :class:`JobStarted` opens an attempt, which lasts until the next start,
   a :class:`JobStopped`, or the end of the window. Step reports or loads before the first
   recorded start get an implicit start at the beginning of the window.
2. Step computations. Within an attempt, a step report covers the steps since the previous
   report (or since the checkpoint loaded, or, without a load, since the latest checkpoint
   saved before the attempt, or step 0 for the first attempt), over the time since the
   previous report or load. Steps are
   taken to run at a uniform rate within one report's interval. The first report after a
   (re)start or a load, when it has no ``duration_s``, is taken to have started
   ``step time x steps covered`` before it was reported (step time: the reference step
   time when given, else the median measured one): the rest of that gap is restart time.
3. Kept or redone. Of all computations of one step, the last one is kept; earlier ones
   were redone after a rollback and count as ``lost_progress_s``. So does the work in
   flight when a failure struck: from the last report before the fault (or, when the
   fault time is unknown, before the detection) to the fault.
4. Labels, highest priority first, where intervals overlap:
   blocking checkpoint save (``checkpoint_save_s``; during a failure's handling it is an
   emergency checkpoint and counts as ``remediation_s``) > checkpoint load
   (``restart_s``) > step computation (kept: productive; redone: lost progress) > work in
   flight at a fault (``lost_progress_s``) > fault to detection (``detection_s``) >
   detection to the next start, when no step ran in between, and every
   :class:`Remediation` (``remediation_s``) > start of an attempt to its first step
   (``restart_s``, including the initial start-up) > anything else (``idle_s``: queueing,
   shutdown, gaps nothing explains).
5. Reduced capacity. Kept step time while the job ran ``r`` of ``R`` replicas is split:
   ``r/R`` of it is productive, ``1 - r/R`` is ``reduced_capacity_s``.

Work still unsaved at the end of the window is counted as productive: nothing redid it.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from supervisor.goodput.calculator_log import (
    CalculatorEvent,
    CalculatorEventType,
    CalculatorGoodput,
    calculator_goodput,
    collapse_repeats,
    select_job,
)
from supervisor.goodput.model import (
    EMERGENCY_TIER,
    Badput,
    CheckpointLoaded,
    CheckpointSaved,
    FailureDetected,
    GoodputPoint,
    GoodputReport,
    JobStarted,
    JobStopped,
    Remediation,
    StepReported,
    TierStats,
    Timeline,
)

# Labels, by priority (lower value wins).
_SAVE, _LOAD, _STEP, _LOST, _DETECT, _REMEDIATE, _RESTART = range(7)
_LEVELS = 7

#: Tier name given to checkpoints of the gpu-recipes calculator's log, which does not say.
CALCULATOR_TIER = "unknown"


@dataclass
class _Computation:
    """One computation of steps ``(lo, hi]`` that ended at ``t1``."""

    lo: int
    hi: int
    boundary: float  # when the previous report/load/start happened
    t1: float
    first: bool  # first computation after a (re)start or a load
    duration_s: float | None
    attempt: int
    resume_at: float  # for a first computation: when the (re)start or load began
    t0: float = 0.0


class _StepSet:
    """A set of steps as disjoint half-open ranges ``(lo, hi]``."""

    def __init__(self) -> None:
        self.los: list[int] = []
        self.his: list[int] = []

    def overlap(self, lo: int, hi: int) -> int:
        total = 0
        i = bisect.bisect_right(self.his, lo)
        while i < len(self.los) and self.los[i] < hi:
            total += min(hi, self.his[i]) - max(lo, self.los[i])
            i += 1
        return total

    def add(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self.his, lo)  # first range that touches or follows lo
        j = i
        while j < len(self.los) and self.los[j] <= hi:
            lo = min(lo, self.los[j])
            hi = max(hi, self.his[j])
            j += 1
        self.los[i:j] = [lo]
        self.his[i:j] = [hi]

    def size(self) -> int:
        return sum(h - lo for lo, h in zip(self.los, self.his, strict=True))


@dataclass
class _Sweep:
    label_s: list[float] = field(default_factory=lambda: [0.0] * _LEVELS)
    idle_s: float = 0.0
    step_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    step_capacity_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    #: (time, the totals from the window's start up to it), one per mark.
    snapshots: list[tuple[float, _Sweep]] = field(default_factory=list)

    def copy(self) -> _Sweep:
        return _Sweep(
            list(self.label_s), self.idle_s, dict(self.step_s), dict(self.step_capacity_s)
        )


def _sweep(
    w0: float,
    w1: float,
    intervals: list[tuple[float, float, int, int]],
    capacity: list[tuple[float, float]],
    marks: Sequence[float] = (),
) -> _Sweep:
    """Label each instant of ``[w0, w1]`` with its highest-priority covering interval;
    also snapshot the totals at each of ``marks`` (sorted, within the window)."""
    pending_marks = [m for m in marks if w0 <= m <= w1]
    clipped = [(max(a, w0), min(b, w1), lvl, key) for a, b, lvl, key in intervals]
    clipped = [iv for iv in clipped if iv[1] > iv[0]]
    points = {w0, w1}
    for a, b, _, _ in clipped:
        points.add(a)
        points.add(b)
    points.update(t for t, _ in capacity if w0 < t < w1)
    points.update(pending_marks)
    ordered = sorted(points)
    mi = 0
    by_start = sorted(clipped, key=lambda iv: iv[0])
    by_end = sorted(clipped, key=lambda iv: iv[1])
    active: list[dict[int, int]] = [{} for _ in range(_LEVELS)]
    out = _Sweep()
    si = ei = ci = 0
    frac = 1.0
    for k in range(len(ordered) - 1):
        p, q = ordered[k], ordered[k + 1]
        while mi < len(pending_marks) and pending_marks[mi] <= p:
            out.snapshots.append((pending_marks[mi], out.copy()))
            mi += 1
        while si < len(by_start) and by_start[si][0] <= p:
            _, _, lvl, key = by_start[si]
            active[lvl][key] = active[lvl].get(key, 0) + 1
            si += 1
        while ei < len(by_end) and by_end[ei][1] <= p:
            _, _, lvl, key = by_end[ei]
            left = active[lvl][key] - 1
            if left:
                active[lvl][key] = left
            else:
                del active[lvl][key]
            ei += 1
        while ci < len(capacity) and capacity[ci][0] <= p:
            frac = capacity[ci][1]
            ci += 1
        seg = q - p
        for lvl in range(_LEVELS):
            if active[lvl]:
                out.label_s[lvl] += seg
                if lvl == _STEP:
                    key = max(active[lvl])
                    out.step_s[key] += seg
                    out.step_capacity_s[key] += seg * frac
                break
        else:
            out.idle_s += seg
    out.snapshots.extend((m, out.copy()) for m in pending_marks[mi:])
    return out


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted union of closed time spans."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


MIB = 2**20


def _sizes(
    records: Sequence[CheckpointSaved | CheckpointLoaded],
) -> tuple[float | None, float | None]:
    """Mean size (bytes) over the records that have one, and mean throughput (MiB/s) over
    those with a size and a total time above zero."""
    sizes = [r.size_bytes for r in records if r.size_bytes is not None]
    rates = [
        r.size_bytes / r.total_s / MIB
        for r in records
        if r.size_bytes is not None and r.total_s is not None and r.total_s > 0
    ]
    return _mean(sizes), _mean(rates)


class _BlockingSaves:
    """Overlap of blocking saves with a time range, for the per-step time estimate."""

    def __init__(self, saves: Sequence[CheckpointSaved]) -> None:
        spans = sorted((s.time, s.time - s.duration_s) for s in saves if s.blocking)
        self.ends = [end for end, _ in spans]
        self.starts = [start for _, start in spans]
        self.longest = max((s.duration_s for s in saves if s.blocking), default=0.0)

    def overlap(self, a: float, b: float) -> float:
        total = 0.0
        i = bisect.bisect_right(self.ends, a)
        while i < len(self.ends) and self.ends[i] < b + self.longest:
            total += max(0.0, min(b, self.ends[i]) - max(a, self.starts[i]))
            i += 1
        return total


def compute_goodput(
    timeline: Timeline,
    *,
    reference_step_time_s: float | None = None,
    calculator: CalculatorGoodput | None = None,
    series_points: int = 0,
) -> GoodputReport:
    """Goodput and badput breakdown of ``timeline`` (see the module docstring for the model).

    ``reference_step_time_s`` is used only to place the start of the first step after a
    (re)start; without it the median measured step time is used. ``calculator`` is attached to
    the report as is. ``series_points`` > 0 adds ``series``: the breakdown from the start
    up to each of that many evenly spaced times, as this report labels the time (so work
    redone later is lost progress already), in one pass; :func:`goodput_series` gives
    the figures as they were known at each time instead, at the cost of a computation
    per point.
    """
    if reference_step_time_s is not None and not (
        math.isfinite(reference_step_time_s) and reference_step_time_s > 0
    ):
        reference_step_time_s = None
    notes: list[str] = []
    window = timeline.window()
    if window is None:
        return GoodputReport(
            job=timeline.job,
            start=0.0,
            end=0.0,
            wall_s=0.0,
            productive_s=0.0,
            badput=Badput(),
            attempts=0,
            failures=0,
            last_step=None,
            steps_kept=0,
            steps_redone=0,
            step_time_s=None,
            calculator=calculator,
            notes=("empty timeline",),
        )
    w0, w1 = window

    # 1. Attempts.
    starts = sorted({s.time for s in timeline.job_starts})
    activity = [s.time for s in timeline.steps] + [ld.time for ld in timeline.loads]
    implicit_start = bool(activity) and (not starts or min(activity) < starts[0])
    if implicit_start:
        starts.insert(0, min(w0, *activity))
        notes.append("no job start recorded before the first step: assumed at the window start")
    stop_times = sorted(s.time for s in timeline.job_stops)
    ends: list[float] = []
    for i, s in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else max(w1, s)
        j = bisect.bisect_right(stop_times, s)
        ends.append(min(nxt, stop_times[j]) if j < len(stop_times) else nxt)

    def attempt_of(t: float) -> int:
        return bisect.bisect_right(starts, t) - 1

    saves_sorted = sorted(timeline.saves, key=lambda s: s.time)
    save_times = [s.time for s in saves_sorted]
    highest_saved = list(itertools.accumulate((s.step for s in saves_sorted), max))

    # 2. Step computations, attempt by attempt.
    per_attempt: list[list[tuple[float, int, StepReported | CheckpointLoaded]]] = [
        [] for _ in starts
    ]
    for ld in timeline.loads:
        a = attempt_of(ld.time)
        if a >= 0:
            per_attempt[a].append((ld.time, 0, ld))
    for sr in timeline.steps:
        a = attempt_of(sr.time)
        if a >= 0:
            per_attempt[a].append((sr.time, 1, sr))
    comps: list[_Computation] = []
    load_end: list[float | None] = [None] * len(starts)
    for a, s in enumerate(starts):
        # Without a load, an attempt resumes from the latest checkpoint saved before it;
        # the first attempt of a job with none starts from step 0, unless its start is
        # implicit (the job was already running when the timeline begins).
        j = bisect.bisect_right(save_times, s)
        chain: int | None = highest_saved[j - 1] if j else None
        if chain is None and not (a == 0 and implicit_start):
            chain = 0
        boundary, first, resume_at = s, True, s
        for _, _, rec in sorted(per_attempt[a], key=lambda item: (item[0], item[1])):
            if isinstance(rec, CheckpointLoaded):
                if not first:
                    resume_at = rec.time - rec.duration_s
                boundary = max(boundary, rec.time)
                chain, first = rec.step, True
                load_end[a] = boundary
                continue
            if chain is not None and rec.step == chain:
                continue  # a repeated report of the same step
            lo = chain if chain is not None and rec.step > chain else rec.step - 1
            comps.append(
                _Computation(lo, rec.step, boundary, rec.time, first, rec.duration_s, a, resume_at)
            )
            boundary, chain, first = max(boundary, rec.time), rec.step, False

    # Per-step time from the computations that follow another report directly.
    blocking = _BlockingSaves(timeline.saves)
    samples: list[float] = []
    for c in comps:
        if c.duration_s is not None:
            samples.append(c.duration_s / (c.hi - c.lo))
        elif not c.first:
            busy = c.t1 - c.boundary - blocking.overlap(c.boundary, c.t1)
            if busy > 0:
                samples.append(busy / (c.hi - c.lo))
    measured_step_s = _median(samples)
    per_step = reference_step_time_s if reference_step_time_s is not None else measured_step_s
    for c in comps:
        if c.duration_s is not None:
            c.t0 = max(c.boundary, c.t1 - c.duration_s)
        elif c.first and per_step is not None:
            c.t0 = max(c.boundary, c.t1 - per_step * (c.hi - c.lo))
        else:
            c.t0 = c.boundary
        c.t0 = min(c.t0, c.t1)

    progress_start: list[float | None] = list(load_end)
    for c in comps:
        ps = progress_start[c.attempt]
        if c.first and (ps is None or c.t0 < ps):
            progress_start[c.attempt] = c.t0
    comp_ends: list[list[float]] = [[] for _ in starts]
    for c in comps:
        comp_ends[c.attempt].append(c.t1)
    for lst in comp_ends:
        lst.sort()
    all_comp_ends = sorted(c.t1 for c in comps)

    # 3/4. Labelled intervals.
    intervals: list[tuple[float, float, int, int]] = []
    for i, c in enumerate(comps):
        intervals.append((c.t0, c.t1, _STEP, i))
        if c.first:
            intervals.append((c.resume_at, c.t0, _RESTART, 0))
    for a, s in enumerate(starts):
        if not comp_ends[a]:
            le = load_end[a]
            intervals.append((s, le if le is not None else ends[a], _RESTART, 0))
    for ld in timeline.loads:
        intervals.append((ld.time - ld.duration_s, ld.time, _LOAD, 0))
    for rem in timeline.remediations:
        intervals.append((rem.start, rem.end, _REMEDIATE, 0))

    handling_windows: list[tuple[float, float]] = []
    for f in timeline.failures:
        d = f.detected_at
        x = f.fault_at if f.fault_at is not None else d
        if f.fault_at is not None:
            intervals.append((f.fault_at, d, _DETECT, 0))
        a = attempt_of(x)
        if a >= 0 and x <= ends[a]:
            k = bisect.bisect_right(comp_ends[a], x)
            ps = progress_start[a]
            r = comp_ends[a][k - 1] if k else ps
            if r is not None and r <= x:
                intervals.append((r, x, _LOST, 0))
        n = bisect.bisect_right(starts, d)
        handled_until = d
        if n < len(starts):
            restart = starts[n]
            progressed = bisect.bisect_right(all_comp_ends, d) < bisect.bisect_left(
                all_comp_ends, restart
            )
            if not progressed:
                intervals.append((d, restart, _REMEDIATE, 0))
                handled_until = restart
        # From the detection: a periodic save that ran between the fault and its
        # detection was no answer to it.
        handling_windows.append((d, handled_until))

    handling = _union(handling_windows)
    handling_starts = [lo for lo, _ in handling]
    emergency: set[int] = set()
    for idx, sv in enumerate(timeline.saves):
        mid = sv.time - sv.duration_s / 2
        w = bisect.bisect_right(handling_starts, mid) - 1
        if sv.tier == EMERGENCY_TIER or (sv.blocking and w >= 0 and mid <= handling[w][1]):
            emergency.add(idx)
        if sv.blocking:
            label = _REMEDIATE if idx in emergency else _SAVE
            intervals.append((sv.time - sv.duration_s, sv.time, label, 0))

    capacity = sorted((rc.time, rc.capacity) for rc in timeline.replica_changes)
    marks = [w0 + (w1 - w0) * (k + 1) / series_points for k in range(max(0, series_points))]
    swept = _sweep(w0, w1, intervals, capacity, marks)

    # 3. Kept or redone: the last computation of a step keeps it.
    later = _StepSet()
    keep: dict[int, float] = {}
    redone = 0
    for i in sorted(range(len(comps)), key=lambda i: (comps[i].t1, i), reverse=True):
        c = comps[i]
        n_steps = c.hi - c.lo
        lost = later.overlap(c.lo, c.hi)
        redone += lost
        keep[i] = (n_steps - lost) / n_steps
        later.add(c.lo, c.hi)

    productive, badput = _totals(swept, keep)
    series = tuple(
        GoodputPoint(t, t - w0, *_totals(snapshot, keep)) for t, snapshot in swept.snapshots
    )
    if not timeline.steps:
        notes.append("no step reports: productive time cannot be measured")

    last = max(enumerate(comps), key=lambda ic: (ic[1].t1, ic[0]), default=None)
    return GoodputReport(
        job=timeline.job,
        start=w0,
        end=w1,
        wall_s=w1 - w0,
        productive_s=productive,
        badput=badput,
        attempts=len(starts),
        failures=len(timeline.failures),
        last_step=last[1].hi if last is not None else None,
        steps_kept=later.size(),
        steps_redone=redone,
        step_time_s=measured_step_s,
        tiers=_tier_stats(timeline, emergency),
        calculator=calculator,
        notes=tuple(notes),
        series=series,
    )


def _totals(swept: _Sweep, keep: dict[int, float]) -> tuple[float, Badput]:
    """Productive time and badput of a sweep, given which share of each computation was
    kept."""
    productive = reduced = 0.0
    lost_s = swept.label_s[_LOST]
    for i, spent in swept.step_s.items():
        weighted = swept.step_capacity_s[i]
        productive += keep[i] * weighted
        reduced += keep[i] * (spent - weighted)
        lost_s += (1 - keep[i]) * spent
    badput = Badput(
        lost_progress_s=lost_s,
        detection_s=swept.label_s[_DETECT],
        remediation_s=swept.label_s[_REMEDIATE],
        restart_s=swept.label_s[_RESTART] + swept.label_s[_LOAD],
        checkpoint_save_s=swept.label_s[_SAVE],
        reduced_capacity_s=reduced,
        idle_s=swept.idle_s,
    )
    return productive, badput


def _tier_stats(timeline: Timeline, emergency: set[int]) -> tuple[TierStats, ...]:
    names = sorted({s.tier for s in timeline.saves} | {ld.tier for ld in timeline.loads})
    loads = sorted(timeline.loads, key=lambda ld: ld.time)
    load_times = [ld.time for ld in loads]
    recoveries: dict[str, int] = defaultdict(int)
    for f in timeline.failures:
        i = bisect.bisect_left(load_times, f.detected_at)
        if i < len(loads):
            recoveries[loads[i].tier] += 1
    out = []
    for name in names:
        saves = [(i, s) for i, s in enumerate(timeline.saves) if s.tier == name]
        # The emergency tier's cost is its own saves'; any other tier's, its periodic ones.
        periodic = [
            s.duration_s
            for i, s in saves
            if s.blocking and (i not in emergency or name == EMERGENCY_TIER)
        ]
        steps = sorted({s.step for _, s in saves})
        gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
        median_gap = _median([float(g) for g in gaps])
        served = [ld for ld in loads if ld.tier == name]
        tier_loads = [ld.duration_s for ld in served]
        save_bytes, save_rate = _sizes([s for _, s in saves])
        load_bytes, load_rate = _sizes(served)
        out.append(
            TierStats(
                tier=name,
                saves=len(saves),
                blocking_saves=sum(1 for _, s in saves if s.blocking),
                emergency_saves=sum(1 for i, _ in saves if i in emergency),
                mean_save_s=_mean([s.duration_s for _, s in saves]),
                mean_blocking_save_s=_mean(periodic),
                interval_steps=round(median_gap) if median_gap is not None else None,
                loads=len(tier_loads),
                mean_load_s=_mean(tier_loads),
                recoveries=recoveries.get(name, 0),
                mean_save_bytes=save_bytes,
                save_mib_per_s=save_rate,
                mean_load_bytes=load_bytes,
                load_mib_per_s=load_rate,
            )
        )
    return tuple(out)


# --- over time ----------------------------------------------------------------------------


def truncate(timeline: Timeline, until: float) -> Timeline:
    """The timeline as it was known at ``until``: later records dropped, spans cut there."""

    start = timeline.start
    if start is not None and start > until:
        start = until
    return Timeline(
        job=timeline.job,
        start=start,
        end=until,
        job_starts=tuple(s for s in timeline.job_starts if s.time <= until),
        job_stops=tuple(s for s in timeline.job_stops if s.time <= until),
        steps=tuple(s for s in timeline.steps if s.time <= until),
        saves=tuple(s for s in timeline.saves if s.time <= until),
        loads=tuple(ld for ld in timeline.loads if ld.time <= until),
        failures=tuple(f for f in timeline.failures if f.detected_at <= until),
        remediations=tuple(
            Remediation(r.start, min(r.end, until), r.action)
            for r in timeline.remediations
            if r.start <= until
        ),
        replica_changes=tuple(r for r in timeline.replica_changes if r.time <= until),
    )


def goodput_series(
    timeline: Timeline, points: int = 20, *, reference_step_time_s: float | None = None
) -> list[GoodputReport]:
    """Cumulative reports at ``points`` evenly spaced times up to the end (for a chart).

    Each report is what was known then: work redone later is still productive in it.
    """
    window = timeline.window()
    if window is None or points < 1:
        return []
    w0, w1 = window
    base = replace(timeline, start=w0)
    times = [w0 + (w1 - w0) * (k + 1) / points for k in range(points)]
    return [
        compute_goodput(truncate(base, t), reference_step_time_s=reference_step_time_s)
        for t in times
    ]


# --- the calculator's log as a timeline -------------------------------------------------------


def timeline_from_calculator(
    events: Sequence[CalculatorEvent], *, job_name: str | None = None
) -> Timeline:
    """Map the calculator's events of one job (:func:`select_job`) onto a :class:`Timeline`.

    - The window runs from the first to the last event, as the calculator's runtime does;
      ``user_scheduled`` only opens it (time until ``job_started`` is idle: queueing).
    - ``job_started`` -> :class:`JobStarted` (repeats collapsed, as the calculator does).
    - ``checkpoint_loaded`` -> :class:`CheckpointLoaded` (no duration known).
    - ``checkpoint_saved`` -> :class:`CheckpointSaved` (non-blocking: no duration known,
      so ``checkpoint_save_s`` stays 0) and a :class:`StepReported` of that step: the
      log's only evidence of progress.
    - ``job_terminated`` followed by another ``job_started``, with no
      ``user_terminated`` in that attempt -> a failure detected then (fault time unknown,
      so detection time is 0 and the work since the last save is lost progress) and a
      :class:`JobStopped`; otherwise only a :class:`JobStopped`.
    - ``user_terminated`` -> :class:`JobStopped`. Events of unknown types only widen the
      window.
    """
    selected = collapse_repeats(select_job(events, job_name))
    job = job_name if job_name is not None else (selected[0].job_name if selected else None)
    if not selected:
        return Timeline(job=job)
    T = CalculatorEventType
    start_idx = [i for i, e in enumerate(selected) if e.event_type == T.JOB_STARTED]
    starts: list[JobStarted] = []
    stops: list[JobStopped] = []
    steps: list[StepReported] = []
    saves: list[CheckpointSaved] = []
    loads: list[CheckpointLoaded] = []
    failures: list[FailureDetected] = []
    for i, e in enumerate(selected):
        t = e.timestamp
        kind = e.kind
        if kind is T.JOB_STARTED:
            starts.append(JobStarted(t, attempt=len(starts)))
        elif kind is T.CHECKPOINT_LOADED:
            loads.append(CheckpointLoaded(e.step or 0, t, 0.0, CALCULATOR_TIER))
        elif kind is T.CHECKPOINT_SAVED:
            saves.append(CheckpointSaved(e.step or 0, t, 0.0, CALCULATOR_TIER, blocking=False))
            steps.append(StepReported(e.step or 0, t))
        elif kind is T.USER_TERMINATED:
            stops.append(JobStopped(t, "user_terminated"))
        elif kind is T.JOB_TERMINATED:
            k = bisect.bisect_right(start_idx, i)
            prev = start_idx[k - 1] if k else -1
            nxt = start_idx[k] if k < len(start_idx) else None
            user_stop = nxt is not None and any(
                selected[j].event_type == T.USER_TERMINATED for j in range(prev + 1, nxt)
            )
            if nxt is not None and not user_stop:
                failures.append(FailureDetected(t, kind="job_terminated"))
            stops.append(JobStopped(t, "job_terminated"))
    return Timeline(
        job=job,
        start=selected[0].timestamp,
        end=selected[-1].timestamp,
        job_starts=tuple(starts),
        job_stops=tuple(stops),
        steps=tuple(steps),
        saves=tuple(saves),
        loads=tuple(loads),
        failures=tuple(failures),
    )


def goodput_from_calculator_log(
    events: Sequence[CalculatorEvent],
    reference_step_time_s: float | None = None,
    *,
    job_name: str | None = None,
) -> GoodputReport:
    """Our breakdown of a calculator log, with its own figure attached (``.calculator``)."""
    calculator = calculator_goodput(events, reference_step_time_s, job_name=job_name)
    timeline = timeline_from_calculator(events, job_name=job_name)
    report = compute_goodput(
        timeline, reference_step_time_s=reference_step_time_s, calculator=calculator
    )
    notes = (
        *report.notes,
        "from the calculator's log: save durations are not logged (checkpoint_save_s is 0) and "
        "fault times are not known (detection_s is 0)",
    )
    return replace(report, notes=notes)
