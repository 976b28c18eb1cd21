"""A backend that records what it is asked to do and touches nothing.

Used by the unit tests and by `dry_run: true`, to watch what a policy would decide.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.actuator.backend import Backend
from supervisor.domain import ActionRecord, ActionType

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

    def __init__(self) -> None:
        self.calls: list[RecordedCall] = []
        self._keys: set[str] = set()

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if action.idempotency_key in self._keys:
            return {"dry_run": True, "repeated": True}
        self._keys.add(action.idempotency_key)
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
