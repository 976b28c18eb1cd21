"""All reads and writes of the database. Methods are synchronous and short; async callers
run them in a worker thread. Each public method is one transaction."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine, text
from sqlalchemy.orm import sessionmaker

from supervisor.store.actions import ActionRecords
from supervisor.store.base import DRY_RUN_JOB_SCOPE, JOB_SCOPE
from supervisor.store.counters import PolicyCounters
from supervisor.store.deliveries import DeliveryRecords
from supervisor.store.epochs import take_leader_epoch
from supervisor.store.events import EventRecords
from supervisor.store.fault_records import FaultRecords
from supervisor.store.goodput_history import GoodputHistory
from supervisor.store.picture import ClusterPictureRecords
from supervisor.store.remedy_state import RemedyStateRecords
from supervisor.store.retention import HistoryTable, PrunedBatch, prune_batch, prune_extent


class Store(
    ClusterPictureRecords,
    EventRecords,
    ActionRecords,
    PolicyCounters,
    FaultRecords,
    GoodputHistory,
    DeliveryRecords,
    RemedyStateRecords,
):
    """Every read and write of the database, one part per aggregate (its module says
    which), on one session factory."""

    def __init__(self, engine: Engine, *, dry_run: bool = False) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self.dry_run = dry_run
        self._job_scope = DRY_RUN_JOB_SCOPE if dry_run else JOB_SCOPE

    def close(self) -> None:
        self.engine.dispose()

    def take_leader_epoch(self, holder: str) -> int:
        """The next epoch of the acting supervisor (supervisor/store/epochs.py)."""
        return take_leader_epoch(self._sessions, holder)

    def ping(self) -> None:
        """Raise unless the database answers a trivial query (the readiness probe)."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    # --- retention ----------------------------------------------------------------------

    def prune_extent(self, table: HistoryTable, cutoff: datetime) -> int | None:
        """The highest id of a row of ``table`` older than ``cutoff`` (None: no such row)."""
        with self.engine.connect() as conn:
            return prune_extent(conn, table, cutoff)

    def prune(
        self, table: HistoryTable, cutoff: datetime, *, after: int, until: int, limit: int
    ) -> PrunedBatch:
        """Delete ``table``'s rows older than ``cutoff`` that nothing still needs among the
        next ``limit`` ids above ``after`` (see :mod:`supervisor.store.retention`), in one
        short transaction."""
        with self.engine.begin() as conn:
            return prune_batch(conn, table, cutoff, after=after, until=until, limit=limit)
