"""A timeline's attempts, the step computations within them, when each computation ran,
and which share of it was kept (phases 1 to 3 of :mod:`supervisor.goodput.breakdown`)."""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from supervisor.goodput.model import CheckpointLoaded, CheckpointSaved, StepReported, Timeline


@dataclass(frozen=True, slots=True)
class Attempts:
    """The job's attempts: the ``i``-th runs from ``starts[i]`` to ``ends[i]``."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    #: The first start was not recorded but assumed (step reports or loads came first).
    implicit_start: bool

    def index_at(self, time: float) -> int:
        """The attempt running at ``time``; -1 before the first."""
        return bisect.bisect_right(self.starts, time) - 1


def find_attempts(timeline: Timeline, window_start: float, window_end: float) -> Attempts:
    """Phase 1: each start opens an attempt, which lasts until the next start, a stop, or
    the end of the window; activity before the first start implies one."""
    starts = sorted({s.time for s in timeline.job_starts})
    activity = [s.time for s in timeline.steps] + [ld.time for ld in timeline.loads]
    implicit_start = bool(activity) and (not starts or min(activity) < starts[0])
    if implicit_start:
        starts.insert(0, min(window_start, *activity))
    stop_times = sorted(s.time for s in timeline.job_stops)
    ends: list[float] = []
    for index, start in enumerate(starts):
        next_start = starts[index + 1] if index + 1 < len(starts) else max(window_end, start)
        first_stop = bisect.bisect_right(stop_times, start)
        ends.append(
            min(next_start, stop_times[first_stop]) if first_stop < len(stop_times) else next_start
        )
    return Attempts(tuple(starts), tuple(ends), implicit_start)


@dataclass(frozen=True, slots=True)
class Computation:
    """One computation of steps ``(from_step, to_step]``, reported at ``reported_at``."""

    from_step: int
    to_step: int
    since: float  # when the previous report, load or start happened
    reported_at: float
    after_resume: bool  # the first computation after a (re)start or a load
    duration_s: float | None
    attempt: int
    resume_began_at: float  # for a computation after a resume: when the resume began

    @property
    def steps(self) -> int:
        return self.to_step - self.from_step


class Computations(NamedTuple):
    """Phase 2's result: the computations in report order per attempt, and when each
    attempt's last checkpoint load finished (None: it loaded none)."""

    computations: tuple[Computation, ...]
    load_ended_at: tuple[float | None, ...]


def find_computations(timeline: Timeline, attempts: Attempts) -> Computations:
    """Phase 2: the step computations, attempt by attempt."""
    saves_by_time = sorted(timeline.saves, key=lambda s: s.time)
    save_times = [s.time for s in saves_by_time]
    highest_saved = list(itertools.accumulate((s.step for s in saves_by_time), max))
    records: list[list[tuple[float, int, StepReported | CheckpointLoaded]]] = [
        [] for _ in attempts.starts
    ]
    # A load sorts before a step report of the same time.
    for load in timeline.loads:
        attempt = attempts.index_at(load.time)
        if attempt >= 0:
            records[attempt].append((load.time, 0, load))
    for report in timeline.steps:
        attempt = attempts.index_at(report.time)
        if attempt >= 0:
            records[attempt].append((report.time, 1, report))
    computations: list[Computation] = []
    load_ended_at: list[float | None] = [None] * len(attempts.starts)
    for attempt, start in enumerate(attempts.starts):
        # Without a load, an attempt resumes from the latest checkpoint saved before it;
        # the first attempt of a job with none starts from step 0, unless its start is
        # implicit (the job was already running when the timeline begins).
        saved_before = bisect.bisect_right(save_times, start)
        last_step: int | None = highest_saved[saved_before - 1] if saved_before else None
        if last_step is None and not (attempt == 0 and attempts.implicit_start):
            last_step = 0
        since, after_resume, resume_began_at = start, True, start
        for _, _, record in sorted(records[attempt], key=lambda item: (item[0], item[1])):
            if isinstance(record, CheckpointLoaded):
                if not after_resume:
                    resume_began_at = record.time - record.duration_s
                since = max(since, record.time)
                last_step, after_resume = record.step, True
                load_ended_at[attempt] = since
                continue
            if last_step is not None and record.step == last_step:
                continue  # a repeated report of the same step
            from_step = (
                last_step if last_step is not None and record.step > last_step else record.step - 1
            )
            computations.append(
                Computation(
                    from_step,
                    record.step,
                    since,
                    record.time,
                    after_resume,
                    record.duration_s,
                    attempt,
                    resume_began_at,
                )
            )
            since, last_step, after_resume = max(since, record.time), record.step, False
    return Computations(tuple(computations), tuple(load_ended_at))


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


def measured_step_time(
    computations: Sequence[Computation], saves: Sequence[CheckpointSaved]
) -> float | None:
    """Median time per step, from the computations with a duration or that follow another
    report directly (less the blocking saves in between)."""
    blocking = _BlockingSaves(saves)
    samples: list[float] = []
    for comp in computations:
        if comp.duration_s is not None:
            samples.append(comp.duration_s / comp.steps)
        elif not comp.after_resume:
            busy = comp.reported_at - comp.since - blocking.overlap(comp.since, comp.reported_at)
            if busy > 0:
                samples.append(busy / comp.steps)
    return statistics.median(samples) if samples else None


def computation_starts(
    computations: Sequence[Computation], step_time_s: float | None
) -> tuple[float, ...]:
    """When each computation began: ``duration_s`` before its report when known; for the
    first after a resume, ``step_time_s`` per step before it; else at the previous
    report, load or start."""
    started_at: list[float] = []
    for comp in computations:
        if comp.duration_s is not None:
            began = max(comp.since, comp.reported_at - comp.duration_s)
        elif comp.after_resume and step_time_s is not None:
            began = max(comp.since, comp.reported_at - step_time_s * comp.steps)
        else:
            began = comp.since
        started_at.append(min(began, comp.reported_at))
    return tuple(started_at)


class AttemptProgress(NamedTuple):
    """Per attempt: when its progress began (its first computation's start or its load's
    end, whichever is earlier; None without either) and the sorted ends of its
    computations; and the sorted ends of every computation."""

    progress_began_at: tuple[float | None, ...]
    computation_ends: tuple[list[float], ...]
    all_computation_ends: list[float]


def attempt_progress(
    attempt_count: int,
    found: Computations,
    started_at: Sequence[float],
) -> AttemptProgress:
    progress_began_at: list[float | None] = list(found.load_ended_at)
    for comp, began in zip(found.computations, started_at, strict=True):
        earliest = progress_began_at[comp.attempt]
        if comp.after_resume and (earliest is None or began < earliest):
            progress_began_at[comp.attempt] = began
    computation_ends: list[list[float]] = [[] for _ in range(attempt_count)]
    for comp in found.computations:
        computation_ends[comp.attempt].append(comp.reported_at)
    for ends in computation_ends:
        ends.sort()
    all_ends = sorted(comp.reported_at for comp in found.computations)
    return AttemptProgress(tuple(progress_began_at), tuple(computation_ends), all_ends)


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


class KeptSteps(NamedTuple):
    """Phase 3's result: the share of each computation (by index) that was kept, the
    number of distinct steps kept, and the step computations redone."""

    kept_share: dict[int, float]
    steps_kept: int
    steps_redone: int


def kept_steps(computations: Sequence[Computation]) -> KeptSteps:
    """Phase 3: of all computations of one step, the last one keeps it."""
    computed_later = _StepSet()
    kept_share: dict[int, float] = {}
    redone = 0
    newest_first = sorted(
        range(len(computations)),
        key=lambda i: (computations[i].reported_at, i),
        reverse=True,
    )
    for index in newest_first:
        comp = computations[index]
        lost = computed_later.overlap(comp.from_step, comp.to_step)
        redone += lost
        kept_share[index] = (comp.steps - lost) / comp.steps
        computed_later.add(comp.from_step, comp.to_step)
    return KeptSteps(kept_share, computed_later.size(), redone)
