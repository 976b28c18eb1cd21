"""Fault drills on a clock: a 5-field cron expression (UTC; a nightly game day is
"0 2 * * *") or a fixed interval, injecting one fault of the given kinds per run.

A drill is a `schedule` fault record (what it injects links to it, as a random
schedule's faults do) and a stored job named after it, `drill:<fault id>`: it survives
a kill of the supervisor and a change of leader. Ending the fault removes the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC
from typing import Any

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

#: The stored job's function (a reference: APScheduler keeps it as text).
RUN_DRILL = "supervisor.schedules.jobs:run_drill"


def job_id(fault_id: int) -> str:
    return f"drill:{fault_id}"


def cron_trigger(expression: str) -> CronTrigger:
    """A trigger for a 5-field crontab line in UTC; ValueError names what is wrong."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(
            f"a cron expression has 5 fields (minute hour day month weekday), "
            f"got {len(fields)}: {expression!r}"
        )
    return CronTrigger.from_crontab(expression, timezone=UTC)


@dataclass(frozen=True, slots=True)
class Drill:
    """When a drill runs and what it may inject (one fault of `kinds` per run)."""

    kinds: tuple[str, ...]
    cron: str | None = None
    every_s: float | None = None

    def trigger(self) -> BaseTrigger:
        if self.cron is not None:
            return cron_trigger(self.cron)
        assert self.every_s is not None
        return IntervalTrigger(seconds=self.every_s, timezone=UTC)

    def params(self, job: str | None) -> dict[str, Any]:
        """What the schedule's fault record keeps of it."""
        when: dict[str, Any] = (
            {"cron": self.cron} if self.cron is not None else {"every_s": self.every_s}
        )
        return {"schedule": {**when, "kinds": list(self.kinds), "job": job}}
