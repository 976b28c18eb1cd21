"""What every part of the store shares: the session factory, whether this is a dry-run
supervisor's store, and the writes more than one aggregate makes in its transaction
(a policy counter bumped, an action recorded)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from supervisor.domain import (
    ActionRequest,
    ActionStatus,
)
from supervisor.store.models import (
    ActionRow,
    CounterRow,
)
from supervisor.store.upsert import upsert

NODE_SCOPE = "node"
JOB_SCOPE = "job"
#: A dry-run supervisor's own action counts: never read by a live one, nor the reverse.
DRY_RUN_JOB_SCOPE = "job:dry_run"
FAILURES = "failures"


class RepositoryBase:
    """The state the store's parts (one class per aggregate, composed into `Store`) share."""

    engine: Engine
    _sessions: sessionmaker[Session]
    #: Actions recorded here are what a dry-run supervisor would have done: marked so,
    #: and counted apart (restart budget, in-job restarts) from those carried out.
    dry_run: bool
    _job_scope: str

    def _bump(self, session: Session, scope: str, key: str, name: str, now: datetime) -> None:
        values = {"scope": scope, "key": key, "name": name, "value": 1, "updated_at": now}
        bump = {"value": CounterRow.value + 1, "updated_at": now}
        upsert(session, CounterRow, values, ("scope", "key", "name"), bump)

    def _new_action(
        self,
        session: Session,
        request: ActionRequest,
        *,
        key: str,
        source: str,
        now: datetime,
        event_id: int | None = None,
        fault_id: int | None = None,
    ) -> ActionRow:
        row = ActionRow(
            idempotency_key=key,
            type=request.type.value,
            status=ActionStatus.PENDING.value,
            source=source,
            job=request.job,
            node=request.node,
            params=dict(request.params),
            reason=request.reason,
            event_id=event_id,
            fault_id=fault_id,
            attempts=0,
            created_at=now,
            dry_run=self.dry_run,
        )
        session.add(row)
        if request.job:
            self._bump(session, self._job_scope, request.job, request.type.value, now)
        return row
