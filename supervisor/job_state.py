"""A job's state as operators see it (`GET /api/v1/jobs`, `supervisor get jobs`, the
dashboard): `given_up` once the supervisor gave up healing it (its restart budget spent,
supervisor/controller/budget.py), until an operator resets its budget; `recovering` while
a remedy of it is in flight; `finishing` once its workers left their training loop
(supervisor/sensor/finishing.py); `finished` when none is left at work; else `running`."""

from __future__ import annotations

from typing import Literal

from supervisor.controller.budget import Budgets
from supervisor.remedies import RemediesInFlight
from supervisor.sensor import Sensor

JobState = Literal["running", "recovering", "finishing", "finished", "given_up"]


def job_state(sensor: Sensor, remedies: RemediesInFlight, budgets: Budgets, job: str) -> JobState:
    """The job's state now (call on the event loop)."""
    if budgets.given_up(job) is not None:
        return "given_up"
    if remedies.recovering(job):
        return "recovering"
    return sensor.job_phase(job) or "running"
