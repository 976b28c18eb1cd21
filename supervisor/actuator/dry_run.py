"""A backend that records what it is asked to do and touches nothing.

The backend of `backend: dry_run` and of `dry_run: true`, to watch what a policy would
decide: either way the supervisor is a dry run (`Backend.dry_run`). Under a dry-run
supervisor it may wrap a backend that only watches the cluster (Kubernetes, read only):
its events, jobs and spares are seen as the acting supervisor sees them, and no action
ever reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from supervisor.actuator.backend import (
    ActionTable,
    Backend,
    BackendHooks,
    ClusterNode,
    dispatch,
)
from supervisor.domain import ActionRecord, ActionType, JobView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecordedCall:
    key: str
    type: ActionType
    job: str | None
    node: str | None
    params: Mapping[str, Any]


class DryRunBackend(Backend):
    name = "dry_run"
    dry_run = True

    def __init__(self, watching: Backend | None = None) -> None:
        self.calls: list[RecordedCall] = []
        self._keys: set[str] = set()
        #: Watches the cluster for us (read only); never asked to act.
        self.watching = watching

    async def start(self, hooks: BackendHooks) -> None:
        if self.watching is not None:
            await self.watching.start(hooks)

    def job_views(self) -> Mapping[str, JobView]:
        return self.watching.job_views() if self.watching is not None else {}

    def cluster_nodes(self) -> Mapping[str, ClusterNode]:
        return self.watching.cluster_nodes() if self.watching is not None else {}

    async def close(self) -> None:
        if self.watching is not None:
            await self.watching.close()

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if action.idempotency_key in self._keys:
            return {"dry_run": True, "repeated": True}
        self._keys.add(action.idempotency_key)
        return await dispatch(self.name, self.actions, self, action)

    async def _record(self, action: ActionRecord) -> Mapping[str, Any]:
        self.calls.append(
            RecordedCall(
                key=action.idempotency_key,
                type=action.type,
                job=action.job,
                node=action.node,
                params=dict(action.params),
            )
        )
        log.info(
            "dry run: would %s job=%s node=%s params=%s",
            action.type.value,
            action.job,
            action.node,
            dict(action.params),
        )
        return {"dry_run": True}

    #: A dry run records whatever it is asked to do.
    actions: ClassVar[ActionTable[DryRunBackend]] = dict.fromkeys(ActionType, _record)
