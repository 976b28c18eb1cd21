"""Plain input and output types of the goodput computation.

The input is a :class:`Timeline`: what happened to one job, as a handful of record types
(plain frozen dataclasses, times in seconds on one clock, e.g. Unix seconds). Nothing here
knows about the store, the API or the workers' wire format, so an adapter can build a
timeline from the event/action history and the workers' checkpoint reports, and the
gpu-recipes goodput calculator's log maps onto it too
(:func:`supervisor.goodput.calculator_timeline.timeline_from_calculator`).

Meaning of each record (the breakdown in :mod:`supervisor.goodput.breakdown` relies on it):

- :class:`JobStarted`: the job's workers were (re)started; one *attempt* begins. Every
  restart of the workers must be recorded, or the time before it is taken as step time.
- :class:`JobStopped`: the workers stopped (a user stop, the end of the job, or the
  failure that :class:`FailureDetected` describes).
- :class:`StepReported`: training step ``step`` completed at ``time``. Reports need not be
  for every step: a report of step 120 after one of step 100 means steps 101-120 ran in
  between, at a uniform rate. ``duration_s``, when known, is the step's own compute time.
- :class:`CheckpointSaved`: a checkpoint of ``step`` finished saving at ``time`` after
  ``duration_s``; ``blocking`` says whether training waited for it (an asynchronous save
  should report only its blocking part, e.g. the device-to-host copy, as a blocking save).
  ``size_bytes`` and ``total_s``, when known, are a rank's checkpoint size and the seconds
  from the save's start to its commit (for a checkpoint of several ranks: their means);
  they feed the per-tier figures only, never the breakdown.
- :class:`CheckpointLoaded`: a checkpoint of ``step`` finished loading at ``time`` from
  ``tier`` (the tier that served it); ``size_bytes`` and ``total_s`` as for a save.
- :class:`FailureDetected`: a failure was detected at ``detected_at``; ``fault_at`` is
  when it happened, when known (e.g. the last heartbeat of a lost node).
- :class:`Remediation`: an action of the supervisor ran from ``start`` to ``end``.
- :class:`ReplicaChange`: from ``time`` on, the job ran ``replicas`` of its
  ``max_replicas`` data-parallel replicas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

from resiliency_protocol.checkpoint_reports import Tier
from supervisor.goodput.calculator_log import CalculatorGoodput

#: Tier names used by default for the fast local tier and the durable tier.
LOCAL_TIER = "local"
EMERGENCY_TIER = "emergency"  # what the training side calls an emergency checkpoint
RAM_TIER = Tier.RAM  # the PyTorch checkpoint tiers' fast tier
DURABLE_TIER = Tier.DURABLE


def _check_time(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")


def _check_duration(name: str, value: float) -> None:
    _check_time(name, value)
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")


def _check_step(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"step must be a non-negative integer, got {value!r}")


def _check_size(size_bytes: float | None, total_s: float | None) -> None:
    if size_bytes is not None and (
        isinstance(size_bytes, bool)
        or not isinstance(size_bytes, int | float)
        or not math.isfinite(size_bytes)
        or size_bytes < 0
    ):
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")
    if total_s is not None:
        _check_duration("total_s", total_s)


# --- input records ------------------------------------------------------------------------


@dataclass(frozen=True)
class JobStarted:
    """The job's workers were (re)started at ``time``: an attempt begins."""

    time: float
    attempt: int | None = None

    def __post_init__(self) -> None:
        _check_time("time", self.time)


@dataclass(frozen=True)
class JobStopped:
    """The job's workers stopped at ``time``."""

    time: float
    reason: str = ""

    def __post_init__(self) -> None:
        _check_time("time", self.time)


@dataclass(frozen=True)
class StepReported:
    """Training step ``step`` completed at ``time`` (``duration_s``: its compute time)."""

    step: int
    time: float
    duration_s: float | None = None

    def __post_init__(self) -> None:
        _check_step(self.step)
        _check_time("time", self.time)
        if self.duration_s is not None:
            _check_duration("duration_s", self.duration_s)


@dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint of ``step`` finished saving at ``time``, after ``duration_s``."""

    step: int
    time: float
    duration_s: float = 0.0
    tier: str = DURABLE_TIER
    blocking: bool = True
    size_bytes: float | None = None
    total_s: float | None = None

    def __post_init__(self) -> None:
        _check_step(self.step)
        _check_time("time", self.time)
        _check_duration("duration_s", self.duration_s)
        _check_size(self.size_bytes, self.total_s)


@dataclass(frozen=True)
class CheckpointLoaded:
    """A checkpoint of ``step`` finished loading at ``time``, after ``duration_s``."""

    step: int
    time: float
    duration_s: float = 0.0
    tier: str = DURABLE_TIER
    size_bytes: float | None = None
    total_s: float | None = None

    def __post_init__(self) -> None:
        _check_step(self.step)
        _check_time("time", self.time)
        _check_duration("duration_s", self.duration_s)
        _check_size(self.size_bytes, self.total_s)


@dataclass(frozen=True)
class FailureDetected:
    """A failure detected at ``detected_at``; ``fault_at`` when it happened, if known."""

    detected_at: float
    fault_at: float | None = None
    kind: str = ""
    node: str | None = None

    def __post_init__(self) -> None:
        _check_time("detected_at", self.detected_at)
        if self.fault_at is not None:
            _check_time("fault_at", self.fault_at)
            if self.fault_at > self.detected_at:
                raise ValueError(
                    f"fault_at ({self.fault_at}) is after detected_at ({self.detected_at})"
                )


@dataclass(frozen=True)
class Remediation:
    """A remediation action (hot swap, restart, scale down...) ran from ``start`` to ``end``."""

    start: float
    end: float
    action: str = ""

    def __post_init__(self) -> None:
        _check_time("start", self.start)
        _check_time("end", self.end)
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) is before start ({self.start})")


@dataclass(frozen=True)
class ReplicaChange:
    """From ``time`` on the job ran ``replicas`` of its ``max_replicas`` replicas."""

    time: float
    replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        _check_time("time", self.time)
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be at least 1, got {self.max_replicas}")
        if not 0 <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas must be between 0 and max_replicas ({self.max_replicas}), "
                f"got {self.replicas}"
            )

    @property
    def capacity(self) -> float:
        """Fraction of the full job running: ``replicas / max_replicas``."""
        return self.replicas / self.max_replicas


Record = (
    JobStarted
    | JobStopped
    | StepReported
    | CheckpointSaved
    | CheckpointLoaded
    | FailureDetected
    | Remediation
    | ReplicaChange
)


@dataclass(frozen=True)
class Timeline:
    """Everything known about one job, grouped by record type (order within a group is free).

    ``start`` and ``end`` bound the wall time; when left out they are the earliest and the
    latest time any record mentions (a save or load's start counts: ``time - duration_s``).
    """

    job: str | None = None
    start: float | None = None
    end: float | None = None
    job_starts: tuple[JobStarted, ...] = ()
    job_stops: tuple[JobStopped, ...] = ()
    steps: tuple[StepReported, ...] = ()
    saves: tuple[CheckpointSaved, ...] = ()
    loads: tuple[CheckpointLoaded, ...] = ()
    failures: tuple[FailureDetected, ...] = ()
    remediations: tuple[Remediation, ...] = ()
    replica_changes: tuple[ReplicaChange, ...] = ()

    def __post_init__(self) -> None:
        if self.start is not None:
            _check_time("start", self.start)
        if self.end is not None:
            _check_time("end", self.end)
        if self.start is not None and self.end is not None and self.end < self.start:
            raise ValueError(f"end ({self.end}) is before start ({self.start})")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):  # accept lists from callers, store tuples
                object.__setattr__(self, f.name, tuple(value))

    @classmethod
    def from_records(
        cls,
        records: Iterable[Record],
        *,
        job: str | None = None,
        start: float | None = None,
        end: float | None = None,
    ) -> Timeline:
        """Build a timeline from records of any type, in any order."""
        starts: list[JobStarted] = []
        stops: list[JobStopped] = []
        steps: list[StepReported] = []
        saves: list[CheckpointSaved] = []
        loads: list[CheckpointLoaded] = []
        failures: list[FailureDetected] = []
        remediations: list[Remediation] = []
        replicas: list[ReplicaChange] = []
        for r in records:
            if isinstance(r, JobStarted):
                starts.append(r)
            elif isinstance(r, JobStopped):
                stops.append(r)
            elif isinstance(r, StepReported):
                steps.append(r)
            elif isinstance(r, CheckpointSaved):
                saves.append(r)
            elif isinstance(r, CheckpointLoaded):
                loads.append(r)
            elif isinstance(r, FailureDetected):
                failures.append(r)
            elif isinstance(r, Remediation):
                remediations.append(r)
            elif isinstance(r, ReplicaChange):
                replicas.append(r)
            else:
                raise TypeError(f"not a timeline record: {r!r}")
        return cls(
            job=job,
            start=start,
            end=end,
            job_starts=tuple(starts),
            job_stops=tuple(stops),
            steps=tuple(steps),
            saves=tuple(saves),
            loads=tuple(loads),
            failures=tuple(failures),
            remediations=tuple(remediations),
            replica_changes=tuple(replicas),
        )

    def records(self) -> Iterator[Record]:
        """All records, group by group."""
        yield from self.job_starts
        yield from self.job_stops
        yield from self.steps
        yield from self.saves
        yield from self.loads
        yield from self.failures
        yield from self.remediations
        yield from self.replica_changes

    def record_bounds(self) -> tuple[float, float] | None:
        """Earliest and latest time mentioned by any record, or None without records."""
        times: list[float] = []
        for r in self.records():
            times.extend(_times_of(r))
        if not times:
            return None
        return min(times), max(times)

    def window(self) -> tuple[float, float] | None:
        """The wall-time window: ``start``/``end`` where given, else the record bounds."""
        bounds = self.record_bounds()
        lo = self.start if self.start is not None else (bounds[0] if bounds else self.end)
        hi = self.end if self.end is not None else (bounds[1] if bounds else self.start)
        if lo is None or hi is None:
            return None
        if hi < lo:
            raise ValueError(f"the timeline ends ({hi}) before it starts ({lo})")
        return lo, hi


def _times_of(r: Record) -> tuple[float, ...]:
    if isinstance(r, CheckpointSaved | CheckpointLoaded):
        return (r.time - r.duration_s, r.time)
    if isinstance(r, StepReported):
        return (r.time,) if r.duration_s is None else (r.time - r.duration_s, r.time)
    if isinstance(r, FailureDetected):
        return (r.detected_at,) if r.fault_at is None else (r.fault_at, r.detected_at)
    if isinstance(r, Remediation):
        return (r.start, r.end)
    return (r.time,)


# --- output -------------------------------------------------------------------------------

#: Badput categories, in the order reports show them.
BADPUT_CATEGORIES: tuple[str, ...] = (
    "lost_progress_s",
    "detection_s",
    "remediation_s",
    "restart_s",
    "checkpoint_save_s",
    "reduced_capacity_s",
    "idle_s",
)


@dataclass(frozen=True)
class Badput:
    """Wall time that was not productive, by cause (seconds). See :class:`GoodputReport`."""

    lost_progress_s: float = 0.0
    detection_s: float = 0.0
    remediation_s: float = 0.0
    restart_s: float = 0.0
    checkpoint_save_s: float = 0.0
    reduced_capacity_s: float = 0.0
    idle_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in BADPUT_CATEGORIES}


@dataclass(frozen=True)
class TierStats:
    """What the timeline shows of one checkpoint tier."""

    tier: str
    saves: int
    blocking_saves: int
    #: Emergency checkpoints: saves reported as tier `emergency`, and blocking saves taken
    #: after a failure's detection, before training resumed.
    emergency_saves: int
    #: Mean duration of all saves of the tier.
    mean_save_s: float | None
    #: Mean duration of the blocking saves outside failure handling: the save cost C (of
    #: the emergency tier: of its own saves).
    mean_blocking_save_s: float | None
    #: Median number of steps between consecutive saves of the tier.
    interval_steps: int | None
    loads: int
    mean_load_s: float | None
    #: Failures whose recovery loaded a checkpoint of this tier.
    recoveries: int
    #: Mean size of a rank's checkpoint over the saves that reported one (bytes).
    mean_save_bytes: float | None = None
    #: Mean of ``size_bytes / total_s`` over the saves that reported both (MiB/s): how fast
    #: the tier takes a rank's checkpoint, start to commit, not only the blocking part. A
    #: save is one checkpoint: with several ranks, their mean size over their mean time.
    save_mib_per_s: float | None = None
    #: As ``mean_save_bytes`` and ``save_mib_per_s``, for the loads this tier served.
    mean_load_bytes: float | None = None
    load_mib_per_s: float | None = None


@dataclass(frozen=True)
class GoodputPoint:
    """The breakdown from the window's start up to ``time`` (``wall_s`` after the start)."""

    time: float
    wall_s: float
    productive_s: float
    badput: Badput

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class GoodputReport:
    """Goodput of one job over its wall-time window, and where the rest of the time went.

    Invariant (checked by the tests): ``productive_s + badput.total_s == wall_s``, up to
    floating-point rounding. Every instant of the window is counted exactly once.

    ``productive_s`` is the time spent computing steps that were kept (not redone later),
    weighted by the fraction of replicas running; the missing fraction of that time is
    ``badput.reduced_capacity_s``.
    """

    job: str | None
    start: float
    end: float
    wall_s: float
    productive_s: float
    badput: Badput
    attempts: int
    failures: int
    #: Step reached at the end of the window (None without step reports).
    last_step: int | None
    #: Distinct steps computed and kept.
    steps_kept: int
    #: Step computations thrown away (counted once per computation redone).
    steps_redone: int
    #: Median measured time per step (None when no interval between reports is known).
    step_time_s: float | None
    tiers: tuple[TierStats, ...] = ()
    #: The gpu-recipes goodput calculator's figure on the same log, when the input was its log.
    calculator: CalculatorGoodput | None = None
    notes: tuple[str, ...] = ()
    #: Cumulative breakdown at evenly spaced times (``compute_goodput(series_points=N)``).
    series: tuple[GoodputPoint, ...] = ()

    @property
    def goodput(self) -> float:
        """Productive time / wall time, 0..1 (0 for an empty window)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def downtime_per_failure_s(self) -> float | None:
        """Mean detection + remediation + restart time per failure (None without failures).

        The restart time includes the initial start-up, so this slightly overstates the
        downtime of a job with few failures.
        """
        if self.failures == 0:
            return None
        b = self.badput
        return (b.detection_s + b.remediation_s + b.restart_s) / self.failures

    def tier(self, name: str) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == name), None)
