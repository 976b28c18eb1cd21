"""A job's state as operators see it (`GET /api/v1/jobs`, `supervisor get jobs`, the
dashboard): `running`; `recovering` while a remedy of it is in flight; `finishing` once
its workers left their training loop (supervisor/sensor/finishing.py); `finished` when
none is left at work."""

from __future__ import annotations

from typing import Literal

from supervisor.remedies import RemediesInFlight
from supervisor.sensor import Sensor

JobState = Literal["running", "recovering", "finishing", "finished"]


def job_state(sensor: Sensor, remedies: RemediesInFlight, job: str) -> JobState:
    """The job's state now (call on the event loop)."""
    if remedies.recovering(job):
        return "recovering"
    return sensor.job_phase(job) or "running"
