"""Labelled time: the intervals of each label (phase 4 of :mod:`supervisor.goodput.breakdown`)
and the sweep that gives each instant of the window its highest-priority label."""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from supervisor.goodput.model import EMERGENCY_TIER, Timeline
from supervisor.goodput.step_computations import (
    AttemptProgress,
    Attempts,
    Computations,
)


class Label(IntEnum):
    """Labels of time, by priority (lower value wins where intervals overlap)."""

    SAVE = 0
    LOAD = 1
    STEP = 2
    LOST = 3
    DETECT = 4
    REMEDIATE = 5
    RESTART = 6


class LabelledInterval(NamedTuple):
    start: float
    end: float
    label: Label
    key: int  # for STEP: the computation's index; else 0


class Labelling(NamedTuple):
    """Phase 4's result: the labelled intervals, and the indices of the saves (into the
    timeline's ``saves``) that were emergency checkpoints."""

    intervals: list[LabelledInterval]
    emergency_saves: set[int]


def union_spans(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted union of closed time spans."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def label_intervals(
    timeline: Timeline,
    attempts: Attempts,
    found: Computations,
    started_at: Sequence[float],
    progress: AttemptProgress,
) -> Labelling:
    """Phase 4: every interval that may label time (the sweep picks among overlaps)."""
    intervals: list[LabelledInterval] = []
    for index, comp in enumerate(found.computations):
        intervals.append(LabelledInterval(started_at[index], comp.reported_at, Label.STEP, index))
        if comp.after_resume:
            intervals.append(
                LabelledInterval(comp.resume_began_at, started_at[index], Label.RESTART, 0)
            )
    for attempt, start in enumerate(attempts.starts):
        if not progress.computation_ends[attempt]:
            load_end = found.load_ended_at[attempt]
            until = load_end if load_end is not None else attempts.ends[attempt]
            intervals.append(LabelledInterval(start, until, Label.RESTART, 0))
    for load in timeline.loads:
        intervals.append(LabelledInterval(load.time - load.duration_s, load.time, Label.LOAD, 0))
    for remediation in timeline.remediations:
        intervals.append(LabelledInterval(remediation.start, remediation.end, Label.REMEDIATE, 0))

    handling_windows: list[tuple[float, float]] = []
    for failure in timeline.failures:
        detected = failure.detected_at
        struck = failure.fault_at if failure.fault_at is not None else detected
        if failure.fault_at is not None:
            intervals.append(LabelledInterval(failure.fault_at, detected, Label.DETECT, 0))
        # The work in flight when the fault struck: since the attempt's last report.
        attempt = attempts.index_at(struck)
        if attempt >= 0 and struck <= attempts.ends[attempt]:
            ends = progress.computation_ends[attempt]
            reported_before = bisect.bisect_right(ends, struck)
            in_flight_since = (
                ends[reported_before - 1]
                if reported_before
                else progress.progress_began_at[attempt]
            )
            if in_flight_since is not None and in_flight_since <= struck:
                intervals.append(LabelledInterval(in_flight_since, struck, Label.LOST, 0))
        next_attempt = bisect.bisect_right(attempts.starts, detected)
        handled_until = detected
        if next_attempt < len(attempts.starts):
            restart = attempts.starts[next_attempt]
            all_ends = progress.all_computation_ends
            progressed = bisect.bisect_right(all_ends, detected) < bisect.bisect_left(
                all_ends, restart
            )
            if not progressed:
                intervals.append(LabelledInterval(detected, restart, Label.REMEDIATE, 0))
                handled_until = restart
        # From the detection: a periodic save that ran between the fault and its
        # detection was no answer to it.
        handling_windows.append((detected, handled_until))

    handling = union_spans(handling_windows)
    handling_starts = [lo for lo, _ in handling]
    emergency: set[int] = set()
    for index, save in enumerate(timeline.saves):
        middle = save.time - save.duration_s / 2
        window = bisect.bisect_right(handling_starts, middle) - 1
        during_handling = window >= 0 and middle <= handling[window][1]
        if save.tier == EMERGENCY_TIER or (save.blocking and during_handling):
            emergency.add(index)
        if save.blocking:
            label = Label.REMEDIATE if index in emergency else Label.SAVE
            intervals.append(LabelledInterval(save.time - save.duration_s, save.time, label, 0))
    return Labelling(intervals, emergency)


@dataclass
class LabelTotals:
    """Seconds of each label, and of step time per computation (also weighted by the
    share of replicas running)."""

    label_s: list[float] = field(default_factory=lambda: [0.0] * len(Label))
    idle_s: float = 0.0
    step_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    step_capacity_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))

    def copy(self) -> LabelTotals:
        return LabelTotals(
            list(self.label_s), self.idle_s, dict(self.step_s), dict(self.step_capacity_s)
        )


class Sweep(NamedTuple):
    totals: LabelTotals
    #: (time, the totals from the window's start up to it), one per mark.
    snapshots: list[tuple[float, LabelTotals]]


def sweep(
    window_start: float,
    window_end: float,
    intervals: Sequence[LabelledInterval],
    capacity: Sequence[tuple[float, float]],
    marks: Sequence[float] = (),
) -> Sweep:
    """Label each instant of the window with its highest-priority covering interval;
    also snapshot the totals at each of ``marks`` (sorted, within the window).
    ``capacity``: sorted (time, share of replicas running from then on)."""
    pending_marks = [m for m in marks if window_start <= m <= window_end]
    clipped = [
        LabelledInterval(max(iv.start, window_start), min(iv.end, window_end), iv.label, iv.key)
        for iv in intervals
    ]
    clipped = [iv for iv in clipped if iv.end > iv.start]
    points = {window_start, window_end}
    for iv in clipped:
        points.add(iv.start)
        points.add(iv.end)
    points.update(t for t, _ in capacity if window_start < t < window_end)
    points.update(pending_marks)
    ordered = sorted(points)
    by_start = sorted(clipped, key=lambda iv: iv.start)
    by_end = sorted(clipped, key=lambda iv: iv.end)
    # Per label: how many intervals of each key cover the current segment.
    active: list[dict[int, int]] = [{} for _ in Label]
    totals = LabelTotals()
    snapshots: list[tuple[float, LabelTotals]] = []
    next_mark = next_start = next_end = next_capacity = 0
    share = 1.0
    for segment_start, segment_end in itertools.pairwise(ordered):
        while next_mark < len(pending_marks) and pending_marks[next_mark] <= segment_start:
            snapshots.append((pending_marks[next_mark], totals.copy()))
            next_mark += 1
        while next_start < len(by_start) and by_start[next_start].start <= segment_start:
            _, _, label, key = by_start[next_start]
            active[label][key] = active[label].get(key, 0) + 1
            next_start += 1
        while next_end < len(by_end) and by_end[next_end].end <= segment_start:
            _, _, label, key = by_end[next_end]
            left = active[label][key] - 1
            if left:
                active[label][key] = left
            else:
                del active[label][key]
            next_end += 1
        while next_capacity < len(capacity) and capacity[next_capacity][0] <= segment_start:
            share = capacity[next_capacity][1]
            next_capacity += 1
        length = segment_end - segment_start
        for label in Label:
            if active[label]:
                totals.label_s[label] += length
                if label == Label.STEP:
                    key = max(active[label])
                    totals.step_s[key] += length
                    totals.step_capacity_s[key] += length * share
                break
        else:
            totals.idle_s += length
    snapshots.extend((m, totals.copy()) for m in pending_marks[next_mark:])
    return Sweep(totals, snapshots)
