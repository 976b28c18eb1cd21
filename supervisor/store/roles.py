"""The store as each of its consumers uses it: one small protocol per role, so that a
part takes the few methods it calls rather than every table of the database.

`Store` (repository.py) has every one of them; the checks at the end of this module make
mypy prove it, so that a method renamed in the store fails here, by its role's name.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Engine

from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    ActionStatus,
    Event,
    Fault,
    ProgressSample,
)
from supervisor.notices import Delivery, DeliveryStatus, NewDelivery
from supervisor.store.counters import PolicyCounts
from supervisor.store.goodput_history import JobHistory
from supervisor.store.queries import ActionFilter, EventFilter, Page
from supervisor.store.remedy_state import BudgetRecord, IncidentRecord
from supervisor.store.retention import HistoryTable, PrunedBatch

if TYPE_CHECKING:
    from supervisor.store.repository import Store


class RemedyState(Protocol):
    """Each job's restart budget and newest incident, kept across restarts."""

    def load_budgets(self) -> dict[str, BudgetRecord]: ...

    def load_incidents(self) -> dict[str, IncidentRecord]: ...

    def save_budget(self, job: str, budget: BudgetRecord, *, epoch: int | None) -> bool: ...

    def save_incident(self, job: str, incident: IncidentRecord, *, epoch: int | None) -> bool: ...


class PolicyLog(Protocol):
    """Where the policy's decisions go: an event's actions, and the counts it decides by."""

    def handle_event(
        self,
        event_id: int,
        requests: Sequence[ActionRequest],
        *,
        policy_error: str | None = None,
    ) -> list[ActionRecord]: ...

    def attach_event(self, event_id: int, action_id: int) -> ActionRecord | None: ...

    def get_action(self, action_id: int) -> ActionRecord | None: ...

    def policy_counts(self, window_start: datetime) -> PolicyCounts: ...


class ControllerRecords(RemedyState, PolicyLog, Protocol):
    """All the controller reads and writes."""


class AttemptLog(Protocol):
    """The actuator's record of each attempt at an action: before and after it."""

    def start_attempt(self, action_id: int) -> ActionRecord: ...

    def note_attempt_error(self, action_id: int, error: str) -> None: ...

    def finish_action(
        self,
        action_id: int,
        status: ActionStatus,
        *,
        error: str | None = None,
        result: dict[str, Any] | None = None,
    ) -> ActionRecord: ...


class DeliveryQueue(Protocol):
    """The notifier's deliveries: recorded pending, then each attempt."""

    def create_deliveries(self, new: Sequence[NewDelivery]) -> list[Delivery]: ...

    def pending_deliveries(self, route: str, limit: int = 100) -> list[Delivery]: ...

    def record_delivery_attempt(
        self, delivery_id: int, status: DeliveryStatus, error: str | None = None
    ) -> Delivery: ...

    def fail_pending_deliveries(self, *, except_routes: Collection[str], error: str) -> int: ...


class Prunable(Protocol):
    """History past its retention, deleted in short batches."""

    def prune_extent(self, table: HistoryTable, cutoff: datetime) -> int | None: ...

    def prune(
        self, table: HistoryTable, cutoff: datetime, *, after: int, until: int, limit: int
    ) -> PrunedBatch: ...


class HistorySource(Protocol):
    """A job's stored history, as goodput computes from it."""

    def job_history(self, job: str, *, group_window_s: float = 30.0) -> JobHistory: ...


class CountedHistory(HistorySource, Protocol):
    """A job's history and the restarts the policy counts (the per-job metrics)."""

    def policy_counts(self, window_start: datetime) -> PolicyCounts: ...


class PeriodicRecords(Prunable, Protocol):
    """What the periodic work writes: goodput's step samples, the scheduler's job table
    (in the store's database, so that replicas share one schedule), and retention's
    deletions."""

    engine: Engine

    def record_progress_samples(self, samples: Sequence[ProgressSample]) -> None: ...


class HistoryPages(Protocol):
    """Events and actions, a page at a time, newest first."""

    def list_events(
        self, filters: EventFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[Event]: ...

    def list_actions(
        self, filters: ActionFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[ActionRecord]: ...


class FaultLedger(Protocol):
    """The faults injected, active until ended."""

    def create_fault(
        self, kind: str, *, node: str | None, job: str | None, params: dict[str, Any]
    ) -> Fault: ...

    def end_fault(self, fault_id: int) -> Fault | None: ...

    def get_fault(self, fault_id: int) -> Fault | None: ...

    def list_faults(self, active: bool | None = None) -> list[Fault]: ...


if TYPE_CHECKING:  # mypy proves the store plays every role

    def _plays_every_role(
        store: Store,
    ) -> tuple[
        ControllerRecords,
        AttemptLog,
        DeliveryQueue,
        PeriodicRecords,
        HistoryPages,
        CountedHistory,
        FaultLedger,
    ]:
        return store, store, store, store, store, store, store
