"""Actions as the API shows them, and the action an operator asks for."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from supervisor.action_params import MAX_REPLICAS, ScaleDownParams, ScaleUpParams, check_params
from supervisor.api.schemas.fields import Name
from supervisor.domain import ActionRecord, ActionStatus, ActionType


class ActionOut(BaseModel):
    id: int
    type: ActionType
    status: ActionStatus
    job: str | None
    node: str | None
    params: dict[str, Any]
    reason: str
    source: Literal["policy", "operator"] | str
    idempotency_key: str
    event_id: int | None
    fault_id: int | None
    attempts: int
    error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None = Field(description="From the first attempt's start to the end.")
    dry_run: bool = Field(
        False,
        description="Recorded by a supervisor in dry run: what it would have done; nothing "
        "was done, and it counts only toward that supervisor's own restart budget.",
    )
    attached_events: list[int] = Field(
        [],
        description="Events of the same incident attached to this remedy, in the order they "
        "came: recorded, with no action of their own.",
    )

    @classmethod
    def of(cls, a: ActionRecord) -> ActionOut:
        duration = None
        if a.started_at and a.finished_at:
            duration = round((a.finished_at - a.started_at).total_seconds(), 3)
        return cls(
            id=a.id,
            type=a.type,
            status=a.status,
            job=a.job,
            node=a.node,
            params=dict(a.params),
            reason=a.reason,
            source=a.source,
            idempotency_key=a.idempotency_key,
            event_id=a.event_id,
            fault_id=a.fault_id,
            attempts=a.attempts,
            error=a.error,
            result=dict(a.result) if a.result is not None else None,
            attached_events=list(a.attached_events),
            created_at=a.created_at,
            started_at=a.started_at,
            finished_at=a.finished_at,
            duration_s=duration,
            dry_run=a.dry_run,
        )


#: An action's params as JSON: the actions take a few small values, never a document.
MAX_PARAMS_BYTES = 16 * 1024


def _storable(value: Any, where: str) -> None:
    """Refuse what JSON in SQL cannot hold the same way on SQLite and PostgreSQL: a NUL
    character (PostgreSQL refuses it), a float that is not finite (SQLite stores null)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where}: a NUL character cannot be stored")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, where)
            _storable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _storable(item, f"{where}.{i}")


class ActionIn(BaseModel):
    """An action an operator asks for by hand."""

    model_config = ConfigDict(extra="forbid")

    type: ActionType
    job: Name | None = None
    node: Name | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    reason: str = Field("requested by operator", max_length=1000)

    @model_validator(mode="after")
    def _check_storable(self) -> Self:
        _storable(self.reason, "reason")
        _storable(self.params, "params")
        if len(json.dumps(self.params)) > MAX_PARAMS_BYTES:
            raise ValueError(f"params: larger than {MAX_PARAMS_BYTES} bytes as JSON")
        return self

    @model_validator(mode="after")
    def _check_target(self) -> Self:
        node_actions = {ActionType.CORDON, ActionType.UNCORDON, ActionType.HOT_SWAP}
        if self.type in node_actions and self.node is None:
            raise ValueError(f"node is required for {self.type.value}")
        if self.type not in {ActionType.CORDON, ActionType.UNCORDON} and self.job is None:
            raise ValueError(f"job is required for {self.type.value}")
        params = check_params(self.type, self.params)  # InvalidParams (a ValueError) names it
        if isinstance(params, ScaleDownParams | ScaleUpParams) and params.to_replicas < 1:
            raise ValueError(
                f"params.to_replicas must be a positive integer (at most {MAX_REPLICAS})"
            )
        return self
