"""Persistence: the schema, its migrations, and the repository every other part uses."""

from supervisor.store.counters import PolicyCounts
from supervisor.store.database import UNAVAILABLE, make_engine, migrate
from supervisor.store.queries import ActionFilter, DeliveryFilter, EventFilter, InvalidCursor, Page
from supervisor.store.remedy_state import BudgetRecord, IncidentRecord
from supervisor.store.repository import Store
from supervisor.store.retention import PRUNE_ORDER, HistoryTable, PrunedBatch

__all__ = [
    "PRUNE_ORDER",
    "UNAVAILABLE",
    "ActionFilter",
    "BudgetRecord",
    "DeliveryFilter",
    "EventFilter",
    "HistoryTable",
    "IncidentRecord",
    "InvalidCursor",
    "Page",
    "PolicyCounts",
    "PrunedBatch",
    "Store",
    "make_engine",
    "migrate",
]


def open_store(url: str, *, dry_run: bool = False) -> Store:
    """Connect, migrate to the newest schema, and return the repository (of a dry-run
    supervisor: its actions marked and counted apart)."""
    engine = make_engine(url)
    migrate(engine)
    return Store(engine, dry_run=dry_run)
