"""Taking the next leader epoch (resiliency_protocol/leaders.py) in one transaction: an
increment in the database itself (`epoch = epoch + 1`), so two supervisors starting at
once on one database never share an epoch; the first ever inserts the row (one that
inserts second fails on the primary key and increments instead)."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from supervisor.domain import utcnow
from supervisor.store.models import LeaderEpochRow

_ROW = 1


def take_leader_epoch(sessions: sessionmaker[Session], holder: str) -> int:
    """The next epoch, now held by `holder` (who appears in the row, for people)."""
    for _ in range(3):
        try:
            with sessions.begin() as session:
                now = utcnow()
                moved = session.execute(
                    update(LeaderEpochRow)
                    .where(LeaderEpochRow.id == _ROW)
                    .values(epoch=LeaderEpochRow.epoch + 1, holder=holder, acquired_at=now)
                )
                if getattr(moved, "rowcount", 0) == 0:
                    session.add(LeaderEpochRow(id=_ROW, epoch=1, holder=holder, acquired_at=now))
                    session.flush()
                epoch = session.scalar(
                    select(LeaderEpochRow.epoch).where(LeaderEpochRow.id == _ROW)
                )
                assert epoch is not None
            return int(epoch)
        except IntegrityError:
            continue  # another supervisor made the row first: increment it instead
    raise RuntimeError("could not take a leader epoch")
