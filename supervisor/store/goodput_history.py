"""The history goodput is computed from: checkpoint reports, progress samples, and one
job's events, actions and reports read together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Insert, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite

from supervisor.domain import (
    ActionRecord,
    CheckpointReport,
    Event,
    JobView,
    ProgressSample,
    utcnow,
)
from supervisor.store.base import RepositoryBase
from supervisor.store.mappers import (
    action_of,
    checkpoint_of,
    event_of,
    job_of,
)
from supervisor.store.models import (
    ActionRow,
    CheckpointReportRow,
    EventRow,
    JobRow,
    ProgressSampleRow,
)


@dataclass(frozen=True, slots=True)
class JobHistory:
    """What the store knows of one job, oldest first: the input of its goodput.

    ``checkpoints`` summarises the reports of all ranks for one checkpoint (same event,
    tier and step, all within the grouping window) as one report (node ``*``, the latest
    time, the longest duration, the mean ``size_bytes`` and ``total_s`` of the ranks that
    gave them), so reading them does not grow with the number of ranks;
    a step saved again later (after a rollback) comes as its individual reports.
    ``checkpoint_reports`` is the number of reports stored.
    """

    job: JobView | None
    created_at: datetime | None
    events: list[Event]
    actions: list[ActionRecord]
    checkpoints: list[CheckpointReport]
    samples: list[ProgressSample]
    checkpoint_reports: int = 0


class GoodputHistory(RepositoryBase):
    # --- goodput history ----------------------------------------------------------------

    def record_checkpoint_reports(self, reports: Sequence[CheckpointReport]) -> tuple[int, int]:
        """Store the reports not stored yet (by ``report_id``), committed on return.

        Returns (stored, duplicates): a batch sent again stores nothing twice.
        """
        new, duplicates = self.record_new_checkpoint_reports(reports)
        return len(new), duplicates

    def record_new_checkpoint_reports(
        self, reports: Sequence[CheckpointReport]
    ) -> tuple[list[CheckpointReport], int]:
        """As `record_checkpoint_reports`; returns the reports stored now (not those
        stored before) and the number of duplicates."""
        if not reports:
            return [], 0
        now = utcnow()
        unique = list({r.report_id: r for r in reports}.values())
        with self._sessions.begin() as session:
            known = set(
                session.scalars(
                    select(CheckpointReportRow.report_id).where(
                        CheckpointReportRow.report_id.in_([r.report_id for r in unique])
                    )
                )
            )
            new = [r for r in unique if r.report_id not in known]
            if new:
                # ON CONFLICT DO NOTHING: a concurrent retry of the same batch is harmless.
                session.execute(
                    self._insert_ignoring_duplicates(),
                    [
                        {
                            "report_id": r.report_id,
                            "node": r.node,
                            "job": r.job,
                            "rank": r.rank,
                            "event": r.event,
                            "step": r.step,
                            "duration_s": r.duration_s,
                            "tier": r.tier,
                            "time": r.time,
                            "received_at": now,
                            "bytes": r.size_bytes,
                            "total_s": r.total_s,
                            "error": r.error,
                        }
                        for r in new
                    ],
                )
        return new, len(reports) - len(new)

    def _insert_ignoring_duplicates(self) -> Insert:
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            return postgresql.insert(CheckpointReportRow).on_conflict_do_nothing(
                index_elements=["report_id"]
            )
        if dialect == "sqlite":
            return sqlite.insert(CheckpointReportRow).on_conflict_do_nothing(
                index_elements=["report_id"]
            )
        return insert(CheckpointReportRow)

    def record_progress_samples(self, samples: Sequence[ProgressSample]) -> None:
        if not samples:
            return
        # One statement for every job's sample (executemany): the ORM's add_all sends an
        # INSERT per row, so a fleet of many jobs would cost as many statements a period.
        with self._sessions.begin() as session:
            session.execute(
                insert(ProgressSampleRow),
                [{"job": s.job, "step": s.step, "time": s.time} for s in samples],
            )

    def job_history(self, job: str, *, group_window_s: float = 30.0) -> JobHistory:
        """Events, actions, checkpoint reports (see :class:`JobHistory`) and progress
        samples of ``job``, oldest first, read in one transaction."""
        c = CheckpointReportRow
        by_checkpoint = (
            select(
                c.event,
                c.tier,
                c.step,
                func.count(),
                func.min(c.time),
                func.max(c.time),
                func.max(c.duration_s),
                func.avg(c.bytes),
                func.avg(c.total_s),
            )
            # Failed saves are no checkpoint: goodput reads saves and loads.
            .where(c.job == job, c.event != "failed")
            .group_by(c.event, c.tier, c.step)
        )
        p = ProgressSampleRow
        with self._sessions() as session, session.begin():
            row = session.get(JobRow, job)
            events = session.scalars(
                select(EventRow).where(EventRow.job == job).order_by(EventRow.id)
            )
            actions = session.scalars(
                select(ActionRow).where(ActionRow.job == job).order_by(ActionRow.id)
            )
            checkpoints: list[CheckpointReport] = []
            spread: list[tuple[str, str, int]] = []
            total = 0
            for event, tier, step, count, first, last, longest, size, seconds in session.execute(
                by_checkpoint
            ):
                total += count
                if (last - first).total_seconds() > group_window_s:
                    spread.append((event, tier, step))
                    continue
                checkpoints.append(
                    CheckpointReport(
                        f"{count} report(s)",
                        "*",
                        job,
                        0,
                        event,
                        step,
                        longest,
                        tier,
                        last,
                        # PostgreSQL averages a BIGINT as a NUMERIC (a Decimal).
                        size_bytes=round(size) if size is not None else None,
                        total_s=float(seconds) if seconds is not None else None,
                    )
                )
            for event, tier, step in spread:
                rows = session.scalars(
                    select(c).where(c.job == job, c.event == event, c.tier == tier, c.step == step)
                )
                checkpoints.extend(checkpoint_of(r) for r in rows)
            checkpoints.sort(key=lambda r: r.time)
            samples = session.execute(
                select(p.step, p.time).where(p.job == job).order_by(p.time, p.id)
            )
            return JobHistory(
                job=job_of(row) if row is not None else None,
                created_at=row.created_at if row is not None else None,
                events=[event_of(e) for e in events],
                actions=[action_of(a) for a in actions],
                checkpoints=checkpoints,
                samples=[ProgressSample(job=job, step=step, time=t) for step, t in samples],
                checkpoint_reports=total,
            )

    def list_checkpoint_reports(
        self, job: str | None = None, limit: int = 100
    ) -> list[CheckpointReport]:
        """The newest checkpoint reports (of ``job``), newest first."""
        query = select(CheckpointReportRow).order_by(
            CheckpointReportRow.time.desc(), CheckpointReportRow.id.desc()
        )
        if job is not None:
            query = query.where(CheckpointReportRow.job == job)
        with self._sessions() as session:
            return [checkpoint_of(r) for r in session.scalars(query.limit(limit))]
