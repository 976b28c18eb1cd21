"""The supervisor's scheduler: APScheduler 3's AsyncIOScheduler on the event loop of the
acting supervisor, its jobs in a SQLAlchemy job store on the supervisor's own database.

Only the acting supervisor runs it (`Supervisor.start` starts it, `stop` stops it; a
standby never starts it, see supervisor.kube.leader), so a job runs on one replica, and
the replica that takes over finds every job where the last one left it.

Missed runs (the supervisor was down, or busy past a run's time): each job is
`coalesce=True`, so runs missed in a row collapse into one, and that one still runs
if it is at most `misfire_grace_s` late (the `schedule_misfire_grace_s` setting);
later than that it is skipped, and the job goes on from its next time. A nightly drill
missed for hours is not sprung on the cluster in the morning; a maintenance window's
start or end, which must happen, uses a grace without bound (see maintenance.py).

Stored jobs name a module-level function and plain arguments (APScheduler pickles
them); they reach the running supervisor through supervisor.schedules.registry.

APScheduler reads its job store, and moves a job run to its next time, on the event
loop when it wakes for a due job: a few short statements per run, at the pace of the
jobs (minutes to days), never per heartbeat. Callers add and remove jobs in a worker
thread (APScheduler's methods are thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC
from typing import Any

from apscheduler.job import Job
from apscheduler.jobstores.base import JobLookupError
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.base import BaseTrigger
from sqlalchemy import Engine

from supervisor.schedules import registry

log = logging.getLogger(__name__)

#: Where the supervisor keeps its jobs (beside its own tables).
JOBS_TABLE = "apscheduler_jobs"
#: A dry-run supervisor's own: it may share the database of one that acts (see
#: docs/simulate.md), whose jobs it must neither run nor move on.
DRY_RUN_JOBS_TABLE = "apscheduler_jobs_dry_run"
#: Jobs rebuilt from the settings at every start (retention): nothing to keep.
MEMORY = "memory"


class Scheduler:
    def __init__(
        self, engine: Engine, key: str, *, misfire_grace_s: int, table: str = JOBS_TABLE
    ) -> None:
        self.key = key
        self._scheduler = AsyncIOScheduler(
            jobstores={
                "default": SQLAlchemyJobStore(engine=engine, tablename=table),
                MEMORY: MemoryJobStore(),
            },
            job_defaults={
                "coalesce": True,
                "misfire_grace_time": misfire_grace_s,
                "max_instances": 1,
            },
            timezone=UTC,
        )
        self._host: Any = None

    @property
    def running(self) -> bool:
        return bool(self._scheduler.running)

    def start(self, host: Any) -> None:
        """Run the stored jobs (on the running event loop) for `host`."""
        self._host = host
        registry.register(self.key, host)
        self._scheduler.start()
        log.info("scheduler started: %d stored jobs", len(self._scheduler.get_jobs()))

    def stop(self) -> None:
        """Stop running jobs here; they stay stored for the next acting supervisor."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        registry.unregister(self.key, self._host)

    def add(
        self,
        job_id: str,
        func: str,
        trigger: BaseTrigger,
        kwargs: dict[str, Any],
        *,
        always_run: bool = False,
    ) -> Job:
        """Store (or replace) a job; `func` is a "module:function" reference.
        `always_run`: a missed run runs however late (no grace time)."""
        extra: dict[str, Any] = {"misfire_grace_time": None} if always_run else {}
        return self._scheduler.add_job(
            func,
            trigger,
            id=job_id,
            kwargs={"host": self.key, **kwargs},
            replace_existing=True,
            **extra,
        )

    def add_local(self, job_id: str, func: Any, trigger: BaseTrigger) -> Job:
        """A job kept in memory only: made again from the settings at each start."""
        return self._scheduler.add_job(
            func, trigger, id=job_id, jobstore=MEMORY, replace_existing=True
        )

    def remove(self, job_id: str) -> bool:
        """Remove a job; False when there was none (removed already: as is)."""
        with contextlib.suppress(JobLookupError):
            self._scheduler.remove_job(job_id)
            return True
        return False

    def get(self, job_id: str) -> Job | None:
        job: Job | None = self._scheduler.get_job(job_id)
        return job

    def jobs(self, prefix: str = "") -> list[Job]:
        return [j for j in self._scheduler.get_jobs() if str(j.id).startswith(prefix)]
