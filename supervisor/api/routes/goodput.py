"""Goodput and checkpoint advice per job: the routes and their response models.

The figures come from :class:`supervisor.goodput.service.GoodputService` (the job's
history and live step, computations shared). The response models below are the stable
contract (the dashboard's goodput panel reads them).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, Field

from supervisor.api.deps import Reader
from supervisor.api.parts import History, Picture
from supervisor.api.routes.common import check_known
from supervisor.goodput.advice import (
    CheckpointAdvice,
    advise_from_report,
    estimate_mtbf,
)
from supervisor.goodput.history import HistorySources
from supervisor.goodput.model import Badput, GoodputReport
from supervisor.goodput.ramdisk import ramdisk_sizing
from supervisor.goodput.service import GoodputService

router = APIRouter(prefix="/api/v1/jobs", tags=["goodput"], dependencies=[Reader])


# --- response models --------------------------------------------------------------------


class BadputOut(BaseModel):
    """Wall time that was not productive, by cause, in seconds."""

    lost_progress_s: float = Field(
        description="Work thrown away: steps computed again after a rollback to a checkpoint, "
        "and the work in flight when a fault struck."
    )
    detection_s: float = Field(description="From a fault to its detection.")
    remediation_s: float = Field(
        description="The supervisor's actions (emergency checkpoints included), and the "
        "time from a detection to the restart when no step ran in between."
    )
    restart_s: float = Field(
        description="From a (re)start of the workers to their first step: start-up and "
        "checkpoint loading (the initial start-up included)."
    )
    checkpoint_save_s: float = Field(description="Periodic checkpoint saves that blocked training.")
    reduced_capacity_s: float = Field(
        description="The share of step time lost while the job ran fewer data-parallel "
        "replicas than its maximum."
    )
    idle_s: float = Field(description="Time nothing above explains (queueing, shutdown).")

    @classmethod
    def of(cls, b: Badput) -> BadputOut:
        return cls(**b.as_dict())


class TierStatsOut(BaseModel):
    """What was measured of one checkpoint tier (`local`, `ram`, `peer`, `durable`,
    `emergency`). Seconds are the time the training loop was blocked (`duration_s` of the
    reports); the throughputs use the time from start to commit (`total_s`). Loads count
    for the tier that served them."""

    tier: str
    saves: int
    blocking_saves: int
    emergency_saves: int = Field(
        description="Emergency checkpoints: saves reported as tier `emergency`, and blocking "
        "saves after a failure's detection, before training resumed."
    )
    mean_save_s: float | None
    mean_blocking_save_s: float | None = Field(
        description="Mean blocking save outside failure handling: the save cost C (of the "
        "`emergency` tier: of its own saves)."
    )
    interval_steps: int | None = Field(description="Median steps between two saves.")
    loads: int
    mean_load_s: float | None
    recoveries: int = Field(description="Failures recovered by loading this tier.")
    mean_save_bytes: float | None = Field(
        description="Mean size of a rank's checkpoint saved (bytes), where reported."
    )
    save_mib_per_s: float | None = Field(
        description="Mean of bytes / total_s over the saves reporting both (MiB/s)."
    )
    mean_load_bytes: float | None = Field(
        description="Mean size of a rank's checkpoint loaded (bytes), where reported."
    )
    load_mib_per_s: float | None = Field(
        description="Mean of bytes / total_s over the loads reporting both (MiB/s)."
    )


class GoodputPointOut(BaseModel):
    """The job's breakdown from the window's start up to `time` (cumulative)."""

    time: datetime
    wall_s: float
    productive_s: float
    goodput: float = Field(ge=0, le=1)
    badput: BadputOut


class SourcesOut(BaseModel):
    """How many records of the job's history the figures were computed from."""

    events: int
    failure_events: int
    actions: int
    checkpoint_reports: int
    progress_samples: int

    @classmethod
    def of(cls, s: HistorySources) -> SourcesOut:
        return cls(**asdict(s))


class GoodputOut(BaseModel):
    """Goodput of a job over its whole history, with the badput breakdown.

    `productive_s + badput_total_s == wall_s`: every second of the window is counted once.
    """

    job: str
    start: datetime = Field(description="When the supervisor first saw the job.")
    end: datetime = Field(description="Now, or when the job finished.")
    wall_s: float
    productive_s: float = Field(description="Time computing steps that were kept.")
    goodput: float = Field(ge=0, le=1, description="productive_s / wall_s.")
    badput: BadputOut
    badput_total_s: float
    attempts: int = Field(description="Starts of the workers (the first one included).")
    failures: int = Field(description="Failure incidents (events until the next restart).")
    last_step: int | None
    steps_kept: int
    steps_redone: int
    step_time_s: float | None = Field(description="Median measured time per step.")
    downtime_per_failure_s: float | None = Field(
        description="(detection + remediation + restart) / failures."
    )
    tiers: list[TierStatsOut]
    series: list[GoodputPointOut] = Field(
        description="For a chart: the breakdown from `start` up to each of `points` evenly "
        "spaced times, the last one `end`, labelled as the whole report labels the time "
        "(work redone later counts as lost progress from the start)."
    )
    sources: SourcesOut
    notes: list[str]


class MtbfOut(BaseModel):
    failures: int
    observed_s: float
    mtbf_s: float | None = Field(description="observed_s / failures; null below 2 failures.")
    note: str


class TierAdviceOut(BaseModel):
    name: str
    save_cost_s: float
    mtbf_s: float | None = Field(description="MTBF of the failures this tier recovers.")
    young_interval_s: float | None
    daly_interval_s: float | None
    recommended_interval_steps: int | None
    recommended_interval_s: float | None
    current_interval_steps: int | None
    current_interval_s: float | None
    waste_current: float | None = Field(description="C/T + T/(2M) at the current interval.")
    waste_recommended: float | None


class RamdiskOut(BaseModel):
    """Ramdisk per host for the in-memory tier (12 bytes/parameter, sharded, x2, + buffer)."""

    parameters: float
    hosts: int
    buffer: float
    bytes_per_parameter: float
    checkpoint_bytes: int
    shard_bytes: int
    double_buffered_bytes: int
    size_bytes: int
    size_mib: int


class AdviceOut(BaseModel):
    """Checkpoint intervals per tier (Young/Daly) from the job's measured costs and MTBF."""

    job: str
    measured_goodput: float = Field(ge=0, le=1, description="As GET .../goodput reports it.")
    observed: MtbfOut = Field(description="Failures over the job's wall time.")
    step_time_s: float | None
    mtbf_s: float | None = Field(description="Used for the advice (measured or given).")
    durable_mtbf_s: float | None
    downtime_per_failure_s: float
    tiers: list[TierAdviceOut]
    expected_goodput_current: float | None
    expected_goodput_recommended: float | None
    warnings: list[str]
    model: str
    ramdisk: RamdiskOut | None = Field(description="Given `parameters` (and `hosts`).")


# --- computation ---------------------------------------------------------------------------


def _time(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def goodput_out(job: str, report: GoodputReport, sources: HistorySources) -> GoodputOut:
    return GoodputOut(
        job=job,
        start=_time(report.start),
        end=_time(report.end),
        wall_s=report.wall_s,
        productive_s=report.productive_s,
        goodput=min(1.0, max(0.0, report.goodput)),
        badput=BadputOut.of(report.badput),
        badput_total_s=report.badput.total_s,
        attempts=report.attempts,
        failures=report.failures,
        last_step=report.last_step,
        steps_kept=report.steps_kept,
        steps_redone=report.steps_redone,
        step_time_s=report.step_time_s,
        downtime_per_failure_s=report.downtime_per_failure_s,
        tiers=[TierStatsOut(**asdict(t)) for t in report.tiers],
        series=[
            GoodputPointOut(
                time=_time(p.time),
                wall_s=p.wall_s,
                productive_s=p.productive_s,
                goodput=min(1.0, max(0.0, p.goodput)),
                badput=BadputOut.of(p.badput),
            )
            for p in report.series
        ],
        sources=SourcesOut.of(sources),
        notes=list(report.notes),
    )


def advice_out(
    job: str, report: GoodputReport, advice: CheckpointAdvice, ramdisk: RamdiskOut | None
) -> AdviceOut:
    observed = estimate_mtbf(report.failures, report.wall_s)
    return AdviceOut(
        job=job,
        measured_goodput=min(1.0, max(0.0, report.goodput)),
        observed=MtbfOut(**asdict(observed)),
        step_time_s=advice.step_time_s,
        mtbf_s=advice.mtbf_s,
        durable_mtbf_s=advice.durable_mtbf_s,
        downtime_per_failure_s=advice.downtime_per_failure_s,
        tiers=[TierAdviceOut(**asdict(t)) for t in advice.tiers],
        expected_goodput_current=advice.expected_goodput_current,
        expected_goodput_recommended=advice.expected_goodput_recommended,
        warnings=list(advice.warnings),
        model=advice.model,
        ramdisk=ramdisk,
    )


def get_goodput_service(request: Request, store: History, sensor: Picture) -> GoodputService:
    """The app's goodput service (made on first use: the store exists once started)."""
    state = request.app.state
    service: GoodputService | None = getattr(state, "goodput", None)
    if service is None:
        service = state.goodput = GoodputService(store, sensor)
    return service


Goodput = Annotated[GoodputService, Depends(get_goodput_service)]


# --- routes ------------------------------------------------------------------------------


@router.get("/{job}/goodput", response_model=GoodputOut, summary="Goodput and badput of a job")
async def get_goodput(
    sensor: Picture,
    goodput: Goodput,
    job: str,
    points: Annotated[
        int, Query(ge=0, le=200, description="Points of the `series` (0: none).")
    ] = 20,
    reference_step_time_s: Annotated[
        float | None,
        Query(gt=0, description="Step time to assume after a restart; measured if unset."),
    ] = None,
) -> GoodputOut:
    check_known(sensor, job=job)
    report, sources = await goodput.report(
        job, points=points, reference_step_time_s=reference_step_time_s
    )
    return goodput_out(job, report, sources)


@router.get("/{job}/advice", response_model=AdviceOut, summary="Checkpoint advice for a job")
async def get_advice(
    sensor: Picture,
    goodput: Goodput,
    job: str,
    mtbf_s: Annotated[
        float | None, Query(gt=0, description="MTBF to use instead of the observed one.")
    ] = None,
    durable_mtbf_s: Annotated[
        float | None,
        Query(gt=0, description="MTBF of the failures the local tier cannot survive."),
    ] = None,
    parameters: Annotated[
        float | None,
        Query(gt=0, le=1e15, description="Model parameters, for the ramdisk sizing."),
    ] = None,
    hosts: Annotated[
        int | None,
        Query(
            ge=1,
            le=1_000_000,
            description="Hosts sharing the checkpoint; default: the job's nodes now.",
        ),
    ] = None,
    ramdisk_buffer: Annotated[
        float,
        Query(ge=0, le=1, description="Ramdisk headroom (GKE advises 0.10-0.15)."),
    ] = 0.15,
) -> AdviceOut:
    check_known(sensor, job=job)
    ramdisk: RamdiskOut | None = None
    if parameters is not None:
        if hosts is None:
            view = sensor.job_view(job)
            hosts = len(view.nodes) if view is not None else 0
            if hosts < 1:
                raise HTTPException(422, "hosts: the job has no nodes now; give hosts")
        sizing = ramdisk_sizing(parameters, hosts, ramdisk_buffer)
        ramdisk = RamdiskOut(**asdict(sizing), size_mib=sizing.size_mib)
    elif hosts is not None:
        raise HTTPException(422, "parameters: required with hosts (ramdisk sizing)")
    report, _ = await goodput.report(job)
    try:
        advice = advise_from_report(report, mtbf_s=mtbf_s, durable_mtbf_s=durable_mtbf_s)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    return advice_out(job, report, advice, ramdisk)
