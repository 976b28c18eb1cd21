"""Bounds the history the database keeps: a periodic pass deleting rows past retention.

Deleting months of rows at once would hold the database (SQLite: its only writer lock)
for as long as it takes, and the heartbeat path, the API and the policy's counters wait
behind it. So each pass deletes in batches of ``batch_size`` rows, one short transaction
each in a worker thread, and pauses between batches so that other writers get their
turn. What is never deleted, whatever its age, is listed in
:mod:`supervisor.store.retention`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta

from supervisor.config_parts import HistorySettings
from supervisor.domain import utcnow
from supervisor.metrics import Metrics
from supervisor.store import PRUNE_ORDER, HistoryTable
from supervisor.store.roles import Prunable

log = logging.getLogger(__name__)

BATCH_SIZE = 1000
PAUSE_S = 0.05
#: The first pass waits this long at most after a start: the start has its own work
#: (resuming actions and events), and a supervisor restarted more often than the period
#: still prunes.
FIRST_PASS_DELAY_S = 60.0


def retention_ages(
    settings: HistorySettings, restart_window_s: float
) -> dict[HistoryTable, timedelta]:
    """How old a row of each table may get; tables kept forever are left out."""
    ages: dict[HistoryTable, timedelta] = {}
    history = settings.history_retention_days
    if history > 0:
        # The settings refuse a shorter retention; the bound is kept here too so that
        # no way of building settings can shorten the window the policy counts over.
        age = max(timedelta(days=history), timedelta(seconds=restart_window_s))
        ages[HistoryTable.ACTIONS] = ages[HistoryTable.EVENTS] = age
        ages[HistoryTable.NOTIFICATION_DELIVERIES] = age
    goodput = settings.goodput_retention_days
    goodput = history if goodput is None else goodput
    if goodput > 0:
        age = timedelta(days=goodput)
        ages[HistoryTable.CHECKPOINT_REPORTS] = ages[HistoryTable.PROGRESS_SAMPLES] = age
    return ages


class HistoryPruner:
    def __init__(
        self,
        store: Prunable,
        ages: Mapping[HistoryTable, timedelta],
        metrics: Metrics,
        *,
        period_s: float,
        batch_size: int = BATCH_SIZE,
        pause_s: float = PAUSE_S,
    ) -> None:
        self.store = store
        self.ages = dict(ages)
        self.metrics = metrics
        self.period_s = period_s
        self.batch_size = batch_size
        self.pause_s = pause_s

    async def prune(self) -> dict[HistoryTable, int]:
        """One pass over every table with a retention; the rows deleted per table."""
        # One `now` for the pass: events are cut where their actions were just before.
        now = utcnow()
        deleted: dict[HistoryTable, int] = {}
        for table in PRUNE_ORDER:
            age = self.ages.get(table)
            if age is None:
                continue
            deleted[table] = await self._prune_table(table, now - age)
        return deleted

    async def _prune_table(self, table: HistoryTable, cutoff: datetime) -> int:
        until = await asyncio.to_thread(self.store.prune_extent, table, cutoff)
        total, after = 0, 0
        counter = self.metrics.history_pruned.labels(table=table.value)
        while until is not None and after < until:
            if after:  # other writers' turn between two batches
                await asyncio.sleep(self.pause_s)
            batch = await asyncio.to_thread(
                self.store.prune, table, cutoff, after=after, until=until, limit=self.batch_size
            )
            total += batch.deleted
            counter.inc(batch.deleted)
            after = batch.last_id
        return total

    async def run_pass(self) -> None:
        """One pass, as the scheduler runs it every period (see
        supervisor.schedules.periodic); a failure waits for the next pass."""
        try:
            deleted = await self.prune()
        except Exception:
            # The database is down or busy: the next pass deletes what this one left.
            log.exception("cannot prune old history; retrying in %g s", self.period_s)
            return
        if any(deleted.values()):
            log.info(
                "pruned old history: %s",
                ", ".join(f"{n} {t.value}" for t, n in deleted.items() if n),
            )
