"""History retention on SQLite and PostgreSQL: what is pruned, what is kept, the settings,
and the service pruning in the background while its API answers."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update

from supervisor.config import ConfigError, Settings, load_settings
from supervisor.domain import (
    ActionRequest,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    ProgressSample,
    utcnow,
)
from supervisor.metrics import Metrics
from supervisor.pruner import HistoryPruner, retention_ages
from supervisor.store import HistoryTable, PrunedBatch, Store, open_store
from supervisor.store.models import (
    ActionRow,
    CheckpointReportRow,
    EventRow,
    FaultRow,
    NotificationDeliveryRow,
    ProgressSampleRow,
)
from tests.conftest import OPERATOR_TOKEN, SettingsFactory
from tests.test_api import heartbeat, running
from tests.timing import scaled

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
T = HistoryTable
DAY = timedelta(days=1)
EVERYTHING_30_DAYS = {table: 30 * DAY for table in HistoryTable}


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    opened = open_store(database_url)
    try:
        yield opened
    finally:
        opened.close()


def pruner(
    store: Store, *, batch_size: int = 1000, metrics: Metrics | None = None
) -> HistoryPruner:
    return HistoryPruner(
        store,
        EVERYTHING_30_DAYS,
        metrics or Metrics(),
        period_s=3600,
        batch_size=batch_size,
        pause_s=0,
    )


def handled_event(store: Store, at: datetime, **kw: Any) -> int:
    [recorded] = store.record([Event(EventType.WORKER_EXITED, at, node="n1", job="j1", **kw)])
    assert recorded.id is not None
    store.handle_event(recorded.id, [])
    return recorded.id


def action(
    store: Store,
    at: datetime,
    status: ActionStatus = ActionStatus.SUCCEEDED,
    *,
    key: str,
    event_id: int | None = None,
    fault_id: int | None = None,
) -> int:
    """An action created at ``at`` (backdated: the store stamps the present)."""
    created, _ = store.create_action(
        ActionRequest(ActionType.CORDON, node="n1"), key=key, source="test", fault_id=fault_id
    )
    with store.engine.begin() as conn:
        conn.execute(
            update(ActionRow)
            .where(ActionRow.id == created.id)
            .values(created_at=at, status=status.value, event_id=event_id)
        )
    return created.id


def report(key: str, at: datetime, job: str = "j1") -> CheckpointReport:
    return CheckpointReport(key, "n1", job, 0, "saved", 100, 1.0, "durable", at)


def ids(store: Store, row: Any) -> set[int]:
    with store.engine.connect() as conn:
        return set(conn.scalars(select(row.id)))


def count(store: Store, row: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(row)) or 0)


def bulk_history(store: Store, at: datetime, *, events: int, actions: int, samples: int) -> None:
    """Many old rows at once: finished actions referring to the first events, handled
    events, progress samples of two jobs, and one checkpoint report per sample."""
    with store.engine.begin() as conn:
        first = conn.scalar(select(func.coalesce(func.max(EventRow.id), 0))) or 0
        conn.execute(
            insert(EventRow),
            [
                {
                    "type": EventType.WORKER_EXITED.value,
                    "time": at,
                    "node": "n1",
                    "job": "j1",
                    "rank": None,
                    "details": {},
                    "fault_id": None,
                    "handled_at": at,
                }
                for _ in range(events)
            ],
        )
        conn.execute(
            insert(ActionRow),
            [
                {
                    "idempotency_key": f"bulk-{i}",
                    "type": ActionType.RESTART_IN_PLACE.value,
                    "status": ActionStatus.SUCCEEDED.value,
                    "source": "policy",
                    "job": "j1",
                    "node": "n1",
                    "params": {},
                    "reason": "",
                    "event_id": first + 1 + i,
                    "attempts": 1,
                    "created_at": at,
                }
                for i in range(actions)
            ],
        )
        conn.execute(
            insert(ProgressSampleRow),
            [
                {"job": f"j{i % 2 + 1}", "step": i, "time": at + timedelta(seconds=i)}
                for i in range(samples)
            ],
        )
        conn.execute(
            insert(CheckpointReportRow),
            [
                {
                    "report_id": f"bulk-{i}",
                    "node": "n1",
                    "job": "j1",
                    "rank": 0,
                    "event": "saved",
                    "step": i,
                    "duration_s": 1.0,
                    "tier": "durable",
                    "time": at,
                    "received_at": at,
                }
                for i in range(samples)
            ],
        )


# --- the SQL, on both databases ----------------------------------------------------------------


async def test_old_rows_are_pruned_in_batches_and_young_ones_kept(store: Store) -> None:
    now = utcnow()
    old = [handled_event(store, now - 40 * DAY) for _ in range(10)]
    young = [handled_event(store, now - 29 * DAY) for _ in range(2)]
    batches: list[PrunedBatch] = []
    prune = store.prune

    def counted(*args: Any, **kwargs: Any) -> PrunedBatch:
        batches.append(prune(*args, **kwargs))
        return batches[-1]

    store.prune = counted  # type: ignore[method-assign]
    metrics = Metrics()
    deleted = await pruner(store, batch_size=3, metrics=metrics).prune()

    assert deleted[T.EVENTS] == 10
    assert [b.deleted for b in batches] == [3, 3, 3, 1]
    assert ids(store, EventRow) == set(young)
    assert not set(old) & ids(store, EventRow)
    value = metrics.registry.get_sample_value(
        "supervisor_history_pruned_rows_total", {"table": "events"}
    )
    assert value == 10
    # A second pass finds nothing more.
    assert (await pruner(store).prune())[T.EVENTS] == 0


def test_a_batch_reads_one_window_of_ids(store: Store) -> None:
    old = utcnow() - 40 * DAY
    first, second = handled_event(store, old), handled_event(store, old)
    young = handled_event(store, utcnow())
    third = handled_event(store, old)
    cutoff = utcnow() - 30 * DAY
    until = store.prune_extent(T.EVENTS, cutoff)
    assert until == third
    assert store.prune(T.EVENTS, cutoff, after=0, until=until, limit=2) == PrunedBatch(2, second)
    # The young row takes its place in the window and is kept.
    assert store.prune(T.EVENTS, cutoff, after=second, until=until, limit=2) == PrunedBatch(
        1, third
    )
    assert ids(store, EventRow) == {young} and first not in ids(store, EventRow)
    assert store.prune_extent(T.EVENTS, cutoff) is None


async def test_rows_still_needed_are_kept_whatever_their_age(store: Store) -> None:
    now = utcnow()
    old = now - 40 * DAY
    # Not handled yet: the controller handles it after a restart.
    [unhandled] = store.record([Event(EventType.HANG, old, node="n1", job="j1")])
    # Unfinished actions, and the events they refer to.
    pending_event = handled_event(store, old)
    pending = action(store, old, ActionStatus.PENDING, key="p", event_id=pending_event)
    running_event = handled_event(store, old)
    running_ = action(store, old, ActionStatus.RUNNING, key="r", event_id=running_event)
    # A young action keeps its old event (its foreign key).
    late_event = handled_event(store, old)
    late = action(store, now, key="late", event_id=late_event)
    # An active fault keeps its events and actions.
    fault = store.create_fault("xid", node="n1", job="j1", params={})
    fault_event = handled_event(store, old, fault_id=fault.id)
    fault_action = action(store, old, key="f", event_id=fault_event, fault_id=fault.id)
    # Old, finished, unreferenced: pruned.
    done_event = handled_event(store, old)
    done = action(store, old, ActionStatus.FAILED, key="d", event_id=done_event)

    deleted = await pruner(store).prune()

    assert (deleted[T.ACTIONS], deleted[T.EVENTS]) == (1, 1)
    assert ids(store, ActionRow) == {pending, running_, late, fault_action}
    assert unhandled.id is not None
    kept_events = {unhandled.id, pending_event, running_event, late_event, fault_event}
    assert ids(store, EventRow) == kept_events
    assert done not in ids(store, ActionRow)

    # Once the fault has ended, what it kept goes with the next pass.
    store.end_fault(fault.id)
    deleted = await pruner(store).prune()
    assert (deleted[T.ACTIONS], deleted[T.EVENTS]) == (1, 1)
    assert fault_event not in ids(store, EventRow)
    assert count(store, FaultRow) == 1  # faults themselves are few, and kept


async def test_old_notification_deliveries_go_unless_still_pending(store: Store) -> None:
    old, now = utcnow() - 40 * DAY, utcnow()

    def delivery(item_id: int, status: str, at: datetime) -> None:
        row = {
            "route": "on-call", "sink": "webhook", "item_kind": "event", "item_id": item_id,
            "item_type": "hang", "job": "j1", "node": "n1", "notice": {}, "status": status,
            "attempts": 1, "created_at": at, "updated_at": at,
        }  # fmt: skip
        with store.engine.begin() as conn:
            conn.execute(insert(NotificationDeliveryRow).values(**row))

    delivery(1, "delivered", old)
    delivery(2, "failed", old)
    delivery(3, "pending", old)  # its sender resumes it after a restart
    delivery(4, "delivered", now)
    deleted = await pruner(store).prune()
    assert deleted[T.NOTIFICATION_DELIVERIES] == 2
    with store.engine.connect() as conn:
        kept = set(conn.scalars(select(NotificationDeliveryRow.item_id)))
    assert kept == {3, 4}


async def test_each_jobs_newest_sample_is_kept_so_its_last_step_stays(store: Store) -> None:
    now = utcnow()
    old = now - 40 * DAY
    store.record_progress_samples(
        [
            ProgressSample("j1", 10, old),
            ProgressSample("j1", 20, old + timedelta(seconds=10)),
            # Both at the job's newest time: both kept (the store reads the second last).
            ProgressSample("j1", 29, old + timedelta(seconds=20)),
            ProgressSample("j1", 30, old + timedelta(seconds=20)),
            ProgressSample("j2", 5, old),
            ProgressSample("j2", 6, now),
        ]
    )
    store.record_checkpoint_reports([report("old", old), report("young", now)])
    last_steps = {job: store.job_history(job).samples[-1].step for job in ("j1", "j2")}

    deleted = await pruner(store).prune()

    assert (deleted[T.PROGRESS_SAMPLES], deleted[T.CHECKPOINT_REPORTS]) == (3, 1)
    assert [s.step for s in store.job_history("j1").samples] == [29, 30]
    assert [s.step for s in store.job_history("j2").samples] == [6]
    assert {job: store.job_history(job).samples[-1].step for job in ("j1", "j2")} == last_steps
    assert [r.report_id for r in store.list_checkpoint_reports()] == ["young"]


# --- settings ------------------------------------------------------------------------------------


def test_retention_shorter_than_the_restart_window_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(history_retention_days=0.01, restart_window_s=3600)
    message = str(raised.value)
    assert "history_retention_days" in message
    assert "restart_window_s" in message
    # Kept forever, or long enough: accepted; goodput's tables have no such bound.
    assert load_settings(history_retention_days=0, restart_window_s=10**9)
    assert load_settings(history_retention_days=1, restart_window_s=86400)
    assert load_settings(goodput_retention_days=0.001)


def test_retention_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERVISOR_HISTORY_RETENTION_DAYS", "7")
    monkeypatch.setenv("SUPERVISOR_GOODPUT_RETENTION_DAYS", "2")
    settings = load_settings()
    assert (settings.history_retention_days, settings.goodput_retention_days) == (7, 2)
    monkeypatch.setenv("SUPERVISOR_HISTORY_RETENTION_DAYS", "-1")
    with pytest.raises(ConfigError, match="history_retention_days"):
        load_settings()


def ages_of(settings: Settings) -> dict[T, timedelta]:
    return retention_ages(settings.history, settings.restart_window_s)


def test_retention_ages() -> None:
    assert ages_of(Settings()) == EVERYTHING_30_DAYS
    ages = ages_of(Settings(history_retention_days=0, goodput_retention_days=3))
    assert ages == {T.CHECKPOINT_REPORTS: 3 * DAY, T.PROGRESS_SAMPLES: 3 * DAY}
    assert ages_of(Settings(history_retention_days=2))[T.NOTIFICATION_DELIVERIES] == 2 * DAY
    assert ages_of(Settings(history_retention_days=0)) == {}
    # Settings built past their validation still never shorten the restart window.
    unchecked = Settings.model_construct(
        **{**Settings().model_dump(), "history_retention_days": 0.001, "restart_window_s": 7200}
    )
    assert ages_of(unchecked)[T.ACTIONS] == timedelta(seconds=7200)


# --- the service -------------------------------------------------------------------------------


def pruned(metrics_text: str) -> dict[str, float]:
    found = re.findall(r'supervisor_history_pruned_rows_total\{table="(\w+)"\} (\S+)', metrics_text)
    return {table: float(value) for table, value in found}


async def test_the_api_answers_while_a_large_prune_runs(
    database_url: str, make_settings: SettingsFactory
) -> None:
    old = utcnow() - 60 * DAY
    store = open_store(database_url)
    try:
        bulk_history(store, old, events=20_000, actions=10_000, samples=10_000)
        fault = store.create_fault("xid", node="n1", job="j1", params={})
        kept_event = handled_event(store, old, fault_id=fault.id)
        young_event = handled_event(store, utcnow())
        last_steps = {job: store.job_history(job).samples[-1].step for job in ("j1", "j2")}
    finally:
        store.close()
    settings = make_settings(
        database_url=database_url,
        heartbeat_timeout_s=30,
        heartbeat_polling_period_s=5,
        # No new sample while pruning: each job's newest is then the one stored before.
        goodput_sample_period_s=3600,
    )

    async with running(settings) as api:
        assert api.supervisor.pruner is not None
        prune = asyncio.create_task(api.supervisor.pruner.prune())
        answered_while_pruning = 0
        step = 0
        while not prune.done():
            step += 1
            responses = await asyncio.gather(
                api.beat(heartbeat("n1", step=step)),
                api.client.get("/api/v1/events", params={"limit": 50}, headers=OPERATOR),
                api.client.get("/api/v1/actions", params={"limit": 50}, headers=OPERATOR),
                api.client.get("/readyz"),
            )
            assert [r.status_code for r in responses] == [204, 200, 200, 200]
            answered_while_pruning += not prune.done()
        deleted = await prune
        assert answered_while_pruning > 0
        assert deleted == {
            T.ACTIONS: 10_000,
            T.EVENTS: 20_000,
            T.CHECKPOINT_REPORTS: 10_000,
            T.PROGRESS_SAMPLES: 10_000 - 2,  # each job's newest is kept
            T.NOTIFICATION_DELIVERIES: 0,
        }
        assert pruned((await api.client.get("/metrics")).text) == {
            "actions": 10_000,
            "events": 20_000,
            "checkpoint_reports": 10_000,
            "progress_samples": 9_998,
            "notification_deliveries": 0,
        }
        events = (await api.get("/api/v1/events", limit=1000))["items"]
        listed = {e["id"] for e in events}
        assert {kept_event, young_event} <= listed
        store = api.supervisor.store
        assert count(store, EventRow) == len(listed)
        assert {job: store.job_history(job).samples[-1].step for job in ("j1", "j2")} == last_steps


async def test_the_service_prunes_old_history_by_itself(
    database_url: str, make_settings: SettingsFactory
) -> None:
    now = utcnow()
    store = open_store(database_url)
    try:
        bulk_history(store, now - 2 * DAY, events=50, actions=20, samples=30)
        young_events = {handled_event(store, now) for _ in range(3)}
        young_action = action(store, now, key="young")
        store.record_checkpoint_reports([report("young", now)])
    finally:
        store.close()
    settings = make_settings(
        database_url=database_url,
        history_retention_days=0.5,
        history_prune_period_s=0.05,
    )

    async with running(settings) as api:
        expected = {
            "actions": 20,
            "events": 50,
            "checkpoint_reports": 30,
            "progress_samples": 28,
            "notification_deliveries": 0,
        }

        deadline = asyncio.get_running_loop().time() + scaled(60)
        # The background pass runs every 0.05 s.
        while (so_far := pruned((await api.client.get("/metrics")).text)) != expected:
            assert asyncio.get_running_loop().time() < deadline, so_far
            await asyncio.sleep(0.05)
        events = (await api.get("/api/v1/events", limit=1000))["items"]
        assert {e["id"] for e in events} == young_events
        actions = (await api.get("/api/v1/actions", limit=1000))["items"]
        assert [a["id"] for a in actions] == [young_action]
        checkpoints = await api.get("/api/v1/checkpoints")
        assert [c["id"] for c in checkpoints] == ["young"]
