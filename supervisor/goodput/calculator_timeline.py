"""The gpu-recipes goodput calculator's log as a :class:`Timeline`, and our breakdown of it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from supervisor.goodput.breakdown import compute_goodput
from supervisor.goodput.calculator_log import (
    CalculatorEvent,
    CalculatorEventType,
    calculator_goodput,
    collapse_repeats,
    select_job,
)
from supervisor.goodput.model import (
    CheckpointLoaded,
    CheckpointSaved,
    FailureDetected,
    GoodputReport,
    JobStarted,
    JobStopped,
    StepReported,
    Timeline,
)

#: Tier name given to checkpoints of the gpu-recipes calculator's log, which does not say.
CALCULATOR_TIER = "unknown"


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
    Event = CalculatorEventType
    start_positions = [i for i, e in enumerate(selected) if e.event_type == Event.JOB_STARTED]
    starts: list[JobStarted] = []
    stops: list[JobStopped] = []
    steps: list[StepReported] = []
    saves: list[CheckpointSaved] = []
    loads: list[CheckpointLoaded] = []
    failures: list[FailureDetected] = []
    for position, event in enumerate(selected):
        time = event.timestamp
        kind = event.kind
        if kind is Event.JOB_STARTED:
            starts.append(JobStarted(time, attempt=len(starts)))
        elif kind is Event.CHECKPOINT_LOADED:
            loads.append(CheckpointLoaded(event.step or 0, time, 0.0, CALCULATOR_TIER))
        elif kind is Event.CHECKPOINT_SAVED:
            saves.append(
                CheckpointSaved(event.step or 0, time, 0.0, CALCULATOR_TIER, blocking=False)
            )
            steps.append(StepReported(event.step or 0, time))
        elif kind is Event.USER_TERMINATED:
            stops.append(JobStopped(time, "user_terminated"))
        elif kind is Event.JOB_TERMINATED:
            # A failure when another attempt follows and the user stopped none in between.
            following = bisect.bisect_right(start_positions, position)
            attempt_start = start_positions[following - 1] if following else -1
            next_start = start_positions[following] if following < len(start_positions) else None
            user_stop = next_start is not None and any(
                selected[j].event_type == Event.USER_TERMINATED
                for j in range(attempt_start + 1, next_start)
            )
            if next_start is not None and not user_stop:
                failures.append(FailureDetected(time, kind="job_terminated"))
            stops.append(JobStopped(time, "job_terminated"))
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
