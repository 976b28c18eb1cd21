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

import math
from dataclasses import replace

from supervisor.goodput.calculator_log import CalculatorGoodput
from supervisor.goodput.model import (
    Badput,
    GoodputPoint,
    GoodputReport,
    Remediation,
    Timeline,
)
from supervisor.goodput.step_computations import (
    attempt_progress,
    computation_starts,
    find_attempts,
    find_computations,
    kept_steps,
    measured_step_time,
)
from supervisor.goodput.tier_stats import tier_stats
from supervisor.goodput.time_labels import Label, LabelTotals, label_intervals, sweep


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
    window_start, window_end = window

    attempts = find_attempts(timeline, window_start, window_end)
    if attempts.implicit_start:
        notes.append("no job start recorded before the first step: assumed at the window start")
    found = find_computations(timeline, attempts)
    computations = found.computations
    measured_step_s = measured_step_time(computations, timeline.saves)
    step_time_s = reference_step_time_s if reference_step_time_s is not None else measured_step_s
    started_at = computation_starts(computations, step_time_s)
    progress = attempt_progress(len(attempts.starts), found, started_at)

    labelling = label_intervals(timeline, attempts, found, started_at, progress)
    capacity = sorted((change.time, change.capacity) for change in timeline.replica_changes)
    marks = [
        window_start + (window_end - window_start) * (k + 1) / series_points
        for k in range(max(0, series_points))
    ]
    swept = sweep(window_start, window_end, labelling.intervals, capacity, marks)

    kept = kept_steps(computations)
    productive, badput = _totals(swept.totals, kept.kept_share)
    series = tuple(
        GoodputPoint(t, t - window_start, *_totals(snapshot, kept.kept_share))
        for t, snapshot in swept.snapshots
    )
    if not timeline.steps:
        notes.append("no step reports: productive time cannot be measured")

    last = max(
        enumerate(computations), key=lambda item: (item[1].reported_at, item[0]), default=None
    )
    return GoodputReport(
        job=timeline.job,
        start=window_start,
        end=window_end,
        wall_s=window_end - window_start,
        productive_s=productive,
        badput=badput,
        attempts=len(attempts.starts),
        failures=len(timeline.failures),
        last_step=last[1].to_step if last is not None else None,
        steps_kept=kept.steps_kept,
        steps_redone=kept.steps_redone,
        step_time_s=measured_step_s,
        tiers=tier_stats(timeline, labelling.emergency_saves),
        calculator=calculator,
        notes=tuple(notes),
        series=series,
    )


def _totals(totals: LabelTotals, kept_share: dict[int, float]) -> tuple[float, Badput]:
    """Productive time and badput of a sweep's totals, given which share of each
    computation was kept."""
    productive = reduced = 0.0
    lost_s = totals.label_s[Label.LOST]
    for index, spent in totals.step_s.items():
        weighted = totals.step_capacity_s[index]
        productive += kept_share[index] * weighted
        reduced += kept_share[index] * (spent - weighted)
        lost_s += (1 - kept_share[index]) * spent
    badput = Badput(
        lost_progress_s=lost_s,
        detection_s=totals.label_s[Label.DETECT],
        remediation_s=totals.label_s[Label.REMEDIATE],
        restart_s=totals.label_s[Label.RESTART] + totals.label_s[Label.LOAD],
        checkpoint_save_s=totals.label_s[Label.SAVE],
        reduced_capacity_s=reduced,
        idle_s=totals.idle_s,
    )
    return productive, badput


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
    window_start, window_end = window
    base = replace(timeline, start=window_start)
    times = [window_start + (window_end - window_start) * (k + 1) / points for k in range(points)]
    return [
        compute_goodput(truncate(base, t), reference_step_time_s=reference_step_time_s)
        for t in times
    ]
