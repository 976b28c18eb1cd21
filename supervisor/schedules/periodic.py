"""The acting supervisor's periodic work: the scheduler (fault drills, maintenance
windows, history retention) and the goodput sampler.

Retention is a job of the scheduler, kept in memory (it is made again from the settings
at each start): the scheduler runs one pass at a time, coalesces passes missed while a
pass ran long, and the first pass comes at most a minute after a start, so a supervisor
restarted more often than the period still prunes. Goodput sampling stays a task of
its own: it holds what it sampled in memory, per replica, and writes what is left when
the supervisor stops; there is nothing of it to store or hand over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from apscheduler.triggers.interval import IntervalTrigger

from supervisor.config_parts import HistorySettings
from supervisor.domain import utcnow
from supervisor.goodput.sampler import ProgressSampler
from supervisor.metrics import Metrics
from supervisor.pruner import FIRST_PASS_DELAY_S, HistoryPruner, retention_ages
from supervisor.schedules.registry import host_key
from supervisor.schedules.scheduler import DRY_RUN_JOBS_TABLE, JOBS_TABLE, Scheduler
from supervisor.store.roles import PeriodicRecords

log = logging.getLogger(__name__)


class PeriodicSettings(Protocol):
    """What the periodic work reads: its group, where its jobs are stored, and the
    restart window that retention never cuts into."""

    @property
    def history(self) -> HistorySettings: ...
    @property
    def database_url(self) -> str: ...
    @property
    def restart_window_s(self) -> float: ...


class PeriodicWork:
    def __init__(
        self,
        settings: PeriodicSettings,
        store: PeriodicRecords,
        metrics: Metrics,
        job_steps: Callable[[], list[tuple[str, int, float]]],
        *,
        dry_run: bool,
    ) -> None:
        dry = dry_run  # a dry run keeps its own jobs, apart from the acting one's
        history = settings.history
        self.scheduler = Scheduler(
            store.engine,
            host_key(settings.database_url) + (" dry-run" if dry else ""),
            misfire_grace_s=history.schedule_misfire_grace_s,
            table=DRY_RUN_JOBS_TABLE if dry else JOBS_TABLE,
        )
        # Step progress for goodput: a sample per job every period, never per heartbeat.
        self.sampler = ProgressSampler(
            history.goodput_sample_period_s, job_steps, store.record_progress_samples
        )
        ages = retention_ages(history, settings.restart_window_s)
        #: Deletes history past its retention; None when all of it is kept forever.
        self.pruner = (
            HistoryPruner(store, ages, metrics, period_s=history.history_prune_period_s)
            if ages
            else None
        )
        self._sampling: asyncio.Task[None] | None = None

    def start(self, host: Any) -> None:
        self._sampling = asyncio.create_task(self.sampler.run(), name="progress-sampler")
        self.scheduler.start(host)
        if self.pruner is not None:
            period = self.pruner.period_s
            first = utcnow() + timedelta(seconds=min(period, FIRST_PASS_DELAY_S))
            trigger = IntervalTrigger(seconds=period, start_date=first)
            self.scheduler.add_local("history-pruner", self.pruner.run_pass, trigger)

    async def stop(self) -> None:
        self.scheduler.stop()
        if self._sampling is not None:
            self._sampling.cancel()
            await asyncio.gather(self._sampling, return_exceptions=True)
            try:
                await self.sampler.flush()  # the last steps seen, for the next start
            except Exception:
                log.exception("cannot store the last progress samples")
