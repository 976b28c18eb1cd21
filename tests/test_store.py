"""The store on SQLite and PostgreSQL: migrations, events, actions, counters, faults."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from supervisor.domain import (
    NODE_FAILURE_EVENTS,
    ActionRequest,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
    WorkerView,
    utcnow,
)
from supervisor.policy import actions
from supervisor.store import (
    ActionFilter,
    EventFilter,
    InvalidCursor,
    Store,
    make_engine,
    migrate,
    open_store,
)
from supervisor.store.database import alembic_config
from supervisor.store.models import ActionRow, Base, EventRow, JobRow

A = ActionType
E = EventType
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    opened = open_store(database_url)
    try:
        yield opened
    finally:
        opened.close()


def event(
    type_: EventType = E.HOST_HEARTBEAT_LOST,
    node: str | None = "n1",
    job: str | None = "j1",
    *,
    time: datetime | None = None,
    rank: int | None = None,
    fault_id: int | None = None,
    **details: Any,
) -> Event:
    return Event(
        type=type_,
        time=time or utcnow(),
        node=node,
        job=job,
        rank=rank,
        details=details,
        fault_id=fault_id,
    )


def node_view(
    name: str = "n1",
    job: str | None = "j1",
    *,
    alive: bool = True,
    state: NodeState = NodeState.RUNNING,
    cordoned: bool = False,
    flapping: bool = False,
) -> NodeView:
    return NodeView(
        name=name,
        state=state,
        job=job,
        alive=alive,
        last_heartbeat=T0,
        cordoned=cordoned,
        flapping=flapping,
    )


def job_view(name: str = "j1", replicas: int = 4) -> JobView:
    return JobView(
        name=name,
        num_dp_replicas=replicas,
        min_num_dp_replicas=2,
        max_num_dp_replicas=4,
        num_nodes_per_dp=4,
    )


def assert_utc(value: datetime | None) -> None:
    assert value is not None
    assert value.tzinfo is not None
    assert value.utcoffset() == timedelta(0)


def one_event(store: Store, **kw: Any) -> Event:
    [recorded] = store.record([event(**kw)])
    return recorded


# --- schema -------------------------------------------------------------------------------


def test_migrations_run_twice_are_a_no_op(store: Store, database_url: str) -> None:
    store.record([event()], [node_view()], [job_view()])
    tables_before = sorted(inspect(store.engine).get_table_names())

    migrate(store.engine)
    again = open_store(database_url)
    try:
        assert sorted(inspect(again.engine).get_table_names()) == tables_before
        with again.engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
        head = ScriptDirectory.from_config(alembic_config(again.engine)).get_current_head()
        assert [v for (v,) in versions] == [head]
        # Nothing recorded was lost.
        assert [n.name for n in again.load_nodes()] == ["n1"]
        assert len(again.list_events(EventFilter()).items) == 1
    finally:
        again.close()
    assert set(tables_before) >= {
        "actions",
        "alembic_version",
        "events",
        "faults",
        "jobs",
        "nodes",
        "policy_counters",
    }


def test_open_store_with_percent_in_url(database_url: str, tmp_path: Path) -> None:
    # The PostgreSQL test URL carries options=-csearch_path%3D<schema>.
    url = f"sqlite:///{tmp_path}/100%.db" if database_url.startswith("sqlite") else database_url
    opened = open_store(url)
    try:
        assert opened.record([event()])[0].id is not None
    finally:
        opened.close()


def test_migration_matches_the_models(store: Store) -> None:
    with store.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        differences = compare_metadata(context, Base.metadata)
    assert differences == []


# --- record -------------------------------------------------------------------------------


def test_record_returns_events_with_ids(store: Store) -> None:
    at = datetime(2025, 3, 1, 14, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2)))
    recorded = store.record(
        [
            event(E.HOST_HEARTBEAT_LOST, time=at, lateness_ms=1.5),
            event(E.WORKER_EXITED, rank=3, exit_code=137),
            event(E.SPARE_AVAILABLE, node="s1", job=None),
        ]
    )
    ids = [e.id for e in recorded]
    assert all(isinstance(i, int) for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert [e.type for e in recorded] == [E.HOST_HEARTBEAT_LOST, E.WORKER_EXITED, E.SPARE_AVAILABLE]

    assert recorded[0].id is not None
    loaded = store.get_event(recorded[0].id)
    assert loaded is not None
    assert (loaded.type, loaded.node, loaded.job) == (E.HOST_HEARTBEAT_LOST, "n1", "j1")
    assert dict(loaded.details) == {"lateness_ms": 1.5}
    assert loaded.time == at  # the same instant ...
    assert_utc(loaded.time)  # ... handed back in UTC
    assert recorded[1].id is not None
    exited = store.get_event(recorded[1].id)
    assert exited is not None and exited.rank == 3 and exited.details["exit_code"] == 137
    assert store.get_event(10**9) is None
    assert store.record([]) == []


def test_record_upserts_nodes_and_jobs(store: Store) -> None:
    store.record([], [node_view("n2"), node_view("n1")], [job_view("j1", replicas=4)])
    assert [n.name for n in store.load_nodes()] == ["n1", "n2"]
    with Session(store.engine) as session:
        created = session.scalars(select(JobRow.created_at)).one()

    changed = node_view(
        "n1", None, alive=False, state=NodeState.SPARE, cordoned=True, flapping=True
    )
    store.record([], [changed], [job_view("j1", replicas=3)])

    nodes = {n.name: n for n in store.load_nodes()}
    assert len(nodes) == 2
    n1 = nodes["n1"]
    assert (n1.state, n1.job, n1.alive, n1.cordoned, n1.flapping) == (
        NodeState.SPARE,
        None,
        False,
        True,
        True,
    )
    assert n1.last_heartbeat == T0
    assert_utc(n1.last_heartbeat)
    assert nodes["n2"].alive and nodes["n2"].job == "j1"
    [job] = store.load_jobs()
    assert (job.name, job.num_dp_replicas) == ("j1", 3)
    with Session(store.engine) as session:
        assert session.scalars(select(JobRow.created_at)).one() == created


@pytest.mark.parametrize("type_", list(EventType), ids=[t.value for t in EventType])
def test_record_bumps_failures_only_for_node_failure_events(store: Store, type_: EventType) -> None:
    store.record([event(type_, node="x")])
    store.record([event(type_, node="x"), event(type_, node="y")])
    failures = store.policy_counts(T0).node_failures
    if type_ in NODE_FAILURE_EVENTS:
        assert failures == {"x": 2, "y": 1}
    else:
        assert failures == {}


def test_failure_without_a_node_counts_for_no_one(store: Store) -> None:
    store.record([event(E.GPU_XID, node=None)])
    assert store.policy_counts(T0).node_failures == {}


# --- handle_event -------------------------------------------------------------------------


def test_handle_event_records_actions_and_marks_handled(store: Store) -> None:
    fault = store.create_fault("xid", node="n1", job=None, params={"code": 79})
    first = one_event(store, type_=E.GPU_XID, fault_id=fault.id, code=79)
    other = one_event(store, type_=E.WORKER_EXITED)
    assert [e.id for e in store.unhandled_events()] == [first.id, other.id]
    assert first.id is not None

    requests = [
        actions.emergency_checkpoint("j1", exclude_nodes=("n1",), reason="xid"),
        actions.restart_in_place("j1", "n1", reason="xid"),
        actions.cordon("n1", reason="xid"),
    ]
    recorded = store.handle_event(first.id, requests)

    assert [a.type for a in recorded] == [A.EMERGENCY_CHECKPOINT, A.RESTART_IN_PLACE, A.CORDON]
    assert [a.idempotency_key for a in recorded] == [
        f"event-{first.id}-0-emergency_checkpoint",
        f"event-{first.id}-1-restart_in_place",
        f"event-{first.id}-2-cordon",
    ]
    for action, request in zip(recorded, requests, strict=True):
        assert action.status is ActionStatus.PENDING
        assert action.source == "policy"
        assert action.event_id == first.id
        assert action.fault_id == fault.id
        assert action.attempts == 0
        assert action.request == ActionRequest(
            request.type,
            job=request.job,
            node=request.node,
            params=dict(request.params),
            reason=request.reason,
        )
        assert_utc(action.created_at)
        loaded = store.get_action(action.id)
        assert loaded == action
    assert recorded[0].params == {"exclude_nodes": ["n1"]}

    assert [e.id for e in store.unhandled_events()] == [other.id]

    # Handling again (e.g. after a crash) returns what was recorded and records nothing.
    again = store.handle_event(first.id, [actions.restart_workload("j1")])
    assert [a.id for a in again] == [a.id for a in recorded]
    assert again == recorded
    page = store.list_actions(ActionFilter())
    assert len(page.items) == 3

    counts = store.policy_counts(T0)
    assert counts.action_counts == {
        ("j1", A.EMERGENCY_CHECKPOINT): 1,
        ("j1", A.RESTART_IN_PLACE): 1,
    }
    assert counts.restarts_in_window == {"j1": 1}


def test_handle_event_without_actions_marks_handled(store: Store) -> None:
    recorded = one_event(store, type_=E.SPARE_AVAILABLE, node="s1", job=None)
    assert recorded.id is not None
    assert store.handle_event(recorded.id, []) == []
    assert store.unhandled_events() == []
    assert store.handle_event(recorded.id, [actions.cordon("s1")]) == []
    assert store.list_actions(ActionFilter()).items == []


def test_handle_unknown_event_raises(store: Store) -> None:
    with pytest.raises(KeyError):
        store.handle_event(424242, [])


def test_action_counts_per_job_and_type(store: Store) -> None:
    for job in ("j1", "j1", "j2"):
        e = one_event(store, job=job)
        assert e.id is not None
        store.handle_event(
            e.id, [actions.restart_in_place(job, "n1"), actions.emergency_checkpoint(job)]
        )
    e = one_event(store, job="j1")
    assert e.id is not None
    store.handle_event(e.id, [actions.hot_swap("j1", "n1"), actions.cordon("n1")])
    counts = store.policy_counts(T0)
    assert counts.action_counts == {
        ("j1", A.RESTART_IN_PLACE): 2,
        ("j1", A.EMERGENCY_CHECKPOINT): 2,
        ("j1", A.HOT_SWAP): 1,
        ("j2", A.RESTART_IN_PLACE): 1,
        ("j2", A.EMERGENCY_CHECKPOINT): 1,
    }
    assert counts.restarts_in_window == {"j1": 3, "j2": 1}


def test_restarts_in_window_respects_the_window(store: Store) -> None:
    made = {}
    for key, request in {
        "old-restart": actions.restart_workload("j1"),
        "new-restart": actions.restart_in_place("j1", "n1"),
        "new-scale": actions.scale_down("j1", to_replicas=3),
        "new-checkpoint": actions.emergency_checkpoint("j1"),
        "other-job": actions.hot_swap("j2", "n9"),
        "no-job": actions.cordon("n1"),
    }.items():
        made[key], created = store.create_action(request, key=key, source="operator")
        assert created
    now = utcnow()
    with store.engine.begin() as conn:
        conn.execute(
            update(ActionRow)
            .where(ActionRow.id == made["old-restart"].id)
            .values(created_at=now - timedelta(hours=2))
        )

    assert store.policy_counts(now - timedelta(hours=1)).restarts_in_window == {"j1": 2, "j2": 1}
    assert store.policy_counts(now - timedelta(hours=3)).restarts_in_window == {"j1": 3, "j2": 1}
    assert store.policy_counts(now + timedelta(minutes=1)).restarts_in_window == {}
    # The window bounds restarts; the per-type counters are all-time.
    counts = store.policy_counts(now + timedelta(minutes=1)).action_counts
    assert counts[("j1", A.RESTART_WORKLOAD)] == 1


def test_failed_handling_leaves_nothing_half_written(store: Store) -> None:
    recorded = one_event(store)
    assert recorded.id is not None
    # Someone already holds the key the second action will get.
    taken = f"event-{recorded.id}-1-cordon"
    store.create_action(actions.cordon("n7"), key=taken, source="operator")

    with pytest.raises(IntegrityError):
        store.handle_event(
            recorded.id, [actions.restart_in_place("j1", "n1"), actions.cordon("n1")]
        )

    assert [e.id for e in store.unhandled_events()] == [recorded.id]
    assert [a.idempotency_key for a in store.list_actions(ActionFilter()).items] == [taken]
    assert store.policy_counts(T0).action_counts == {}


# --- actions ------------------------------------------------------------------------------


def test_create_action_is_idempotent_by_key(store: Store) -> None:
    first, created = store.create_action(
        actions.scale_up("j1", to_replicas=4, reason="operator"), key="op-1", source="operator"
    )
    assert created
    assert (first.type, first.job, first.params, first.source) == (
        A.SCALE_UP,
        "j1",
        {"to_replicas": 4},
        "operator",
    )
    assert first.event_id is None and first.status is ActionStatus.PENDING

    second, created = store.create_action(
        actions.restart_workload("j1"), key="op-1", source="operator"
    )
    assert not created
    assert second == first
    assert len(store.list_actions(ActionFilter()).items) == 1
    assert store.policy_counts(T0).action_counts == {("j1", A.SCALE_UP): 1}

    third, created = store.create_action(actions.uncordon("n1"), key="op-2", source="operator")
    assert created and third.id != first.id


def test_action_lifecycle(store: Store) -> None:
    action, _ = store.create_action(actions.hot_swap("j1", "n1"), key="k", source="operator")
    assert action.started_at is None and action.finished_at is None

    running = store.start_attempt(action.id)
    assert running.status is ActionStatus.RUNNING and running.attempts == 1
    assert_utc(running.started_at)
    assert running.started_at is not None and running.started_at >= action.created_at
    assert running.finished_at is None
    assert store.get_action(action.id) == running

    store.note_attempt_error(action.id, "backend busy")
    noted = store.get_action(action.id)
    assert noted is not None and noted.error == "backend busy"
    assert noted.status is ActionStatus.RUNNING

    retried = store.start_attempt(action.id)
    assert retried.attempts == 2 and retried.error is None
    assert retried.started_at == running.started_at  # the first start is kept

    done = store.finish_action(action.id, ActionStatus.SUCCEEDED, result={"spare": "s1"})
    assert done.status is ActionStatus.SUCCEEDED and done.status.finished
    assert done.result == {"spare": "s1"} and done.error is None
    assert_utc(done.finished_at)
    assert done.finished_at is not None and running.started_at is not None
    assert done.finished_at >= running.started_at
    loaded = store.get_action(action.id)
    assert loaded == done
    assert loaded is not None
    assert_utc(loaded.created_at)
    assert_utc(loaded.started_at)
    assert_utc(loaded.finished_at)

    failed, _ = store.create_action(actions.cordon("n2"), key="k2", source="operator")
    store.start_attempt(failed.id)
    out = store.finish_action(failed.id, ActionStatus.FAILED, error="no such node")
    assert (out.status, out.error, out.result) == (ActionStatus.FAILED, "no such node", None)

    with pytest.raises(KeyError):
        store.start_attempt(10**9)
    with pytest.raises(KeyError):
        store.finish_action(10**9, ActionStatus.FAILED)
    assert store.get_action(10**9) is None


def test_the_jobs_whose_latest_disruptive_action_failed(store: Store) -> None:
    """What the policy reads to restart a job nothing runs since its last remedy failed:
    the latest disruptive action of each job decides; a checkpoint or a cordon does not."""

    def done(request: ActionRequest, key: str, status: ActionStatus) -> None:
        action, _ = store.create_action(request, key=key, source="policy")
        store.start_attempt(action.id)
        store.finish_action(action.id, status)

    done(actions.restart_workload("j1"), "a", ActionStatus.FAILED)
    done(actions.restart_workload("j2"), "b", ActionStatus.FAILED)
    done(actions.scale_up("j2", to_replicas=2), "c", ActionStatus.SUCCEEDED)
    done(actions.emergency_checkpoint("j1"), "d", ActionStatus.FAILED)
    done(actions.hot_swap("j3", "n1", spare="s1"), "e", ActionStatus.FAILED)
    assert store.policy_counts(T0).failed_last_remedy == {"j1", "j3"}
    done(actions.restart_workload("j3"), "f", ActionStatus.SUCCEEDED)
    assert store.policy_counts(T0).failed_last_remedy == {"j1"}


def test_unfinished_actions_and_unhandled_events(store: Store) -> None:
    keys = ["pending", "running", "succeeded", "failed"]
    made = {
        k: store.create_action(actions.cordon(f"n-{k}"), key=k, source="operator")[0] for k in keys
    }
    store.start_attempt(made["running"].id)
    for k in ("succeeded", "failed"):
        store.start_attempt(made[k].id)
        store.finish_action(made[k].id, ActionStatus(k))
    unfinished = store.unfinished_actions()
    assert [a.idempotency_key for a in unfinished] == ["pending", "running"]
    assert [a.status for a in unfinished] == [ActionStatus.PENDING, ActionStatus.RUNNING]

    recorded = store.record([event(), event(), event()])
    first = recorded[0].id
    assert first is not None
    store.handle_event(first, [])
    assert [e.id for e in store.unhandled_events()] == [e.id for e in recorded[1:]]


def test_list_actions_filters(store: Store) -> None:
    e = one_event(store)
    assert e.id is not None
    by_policy = store.handle_event(
        e.id, [actions.emergency_checkpoint("j1"), actions.restart_in_place("j1", "n1")]
    )
    direct, _ = store.create_action(actions.cordon("n2"), key="op", source="operator")
    store.start_attempt(direct.id)

    def ids(**kw: Any) -> list[int]:
        return [a.id for a in store.list_actions(ActionFilter(**kw)).items]

    assert ids() == [direct.id, by_policy[1].id, by_policy[0].id]
    assert ids(event_id=e.id) == [by_policy[1].id, by_policy[0].id]
    assert ids(status=ActionStatus.RUNNING) == [direct.id]
    assert ids(types=[A.CORDON, A.RESTART_IN_PLACE]) == [direct.id, by_policy[1].id]
    assert ids(node="n1") == [by_policy[1].id]
    assert ids(job="j1") == [by_policy[1].id, by_policy[0].id]
    assert ids(since=utcnow() + timedelta(minutes=1)) == []
    assert ids(until=utcnow() + timedelta(minutes=1)) == ids()


# --- list_events --------------------------------------------------------------------------


def test_list_events_filters(store: Store) -> None:
    minute = timedelta(minutes=1)
    recorded = store.record(
        [
            event(E.HOST_HEARTBEAT_LOST, "n1", "j1", time=T0),
            event(E.GPU_XID, "n2", "j1", time=T0 + minute, code=79),
            event(E.WORKER_EXITED, "n1", "j2", time=T0 + 2 * minute),
            event(E.SPARE_AVAILABLE, "s1", None, time=T0 + 3 * minute),
            event(E.HANG, None, "j1", time=T0 + 4 * minute),
        ]
    )
    by_index = {e.id: i for i, e in enumerate(recorded)}

    def listed(**kw: Any) -> list[int]:
        return [by_index[e.id] for e in store.list_events(EventFilter(**kw)).items]

    assert listed() == [4, 3, 2, 1, 0]  # newest first
    assert listed(types=[E.GPU_XID, E.HANG]) == [4, 1]
    assert listed(node="n1") == [2, 0]
    assert listed(job="j1") == [4, 1, 0]
    assert listed(node="n1", job="j1") == [0]
    assert listed(since=T0 + minute) == [4, 3, 2, 1]  # inclusive
    assert listed(until=T0 + 2 * minute) == [1, 0]  # exclusive
    assert listed(since=T0 + minute, until=T0 + 3 * minute) == [2, 1]
    # Bounds in another zone mean the same instants.
    plus2 = timezone(timedelta(hours=2))
    assert listed(since=(T0 + minute).astimezone(plus2)) == [4, 3, 2, 1]
    assert listed(types=[E.NODE_FLAPPING]) == []
    assert listed(node="nobody") == []


def test_list_events_paginates_newest_first(store: Store) -> None:
    recorded = store.record([event(job="even" if i % 2 == 0 else "odd", seq=i) for i in range(250)])
    all_ids = [e.id for e in recorded]

    def pages(limit: int, **kw: Any) -> list[list[int]]:
        out: list[list[int]] = []
        cursor = None
        while True:
            page = store.list_events(EventFilter(**kw), cursor=cursor, limit=limit)
            out.append([e.id for e in page.items if e.id is not None])
            if page.next_cursor is None:
                return out
            cursor = page.next_cursor
            assert len(out) < 100, "pagination does not end"

    got = pages(100)
    assert [len(p) for p in got] == [100, 100, 50]
    flat = [i for p in got for i in p]
    assert flat == sorted(all_ids, reverse=True)  # complete, disjoint, newest first
    assert len(set(flat)) == 250

    assert [len(p) for p in pages(125)] == [125, 125]  # exact fit: no empty last page
    assert [len(p) for p in pages(250)] == [250]
    assert [len(p) for p in pages(1000)] == [250]

    even = pages(40, job="even")
    assert [len(p) for p in even] == [40, 40, 40, 5]
    even_ids = [i for p in even for i in p]
    assert even_ids == sorted(all_ids[0::2], reverse=True)


@pytest.mark.parametrize("cursor", ["abc", "", "0", "-5", "1.5", "12abc"])
def test_invalid_cursor(store: Store, cursor: str) -> None:
    store.record([event()])
    with pytest.raises(InvalidCursor):
        store.list_events(EventFilter(), cursor=cursor)
    with pytest.raises(InvalidCursor):
        store.list_actions(ActionFilter(), cursor=cursor)


@pytest.mark.parametrize("cursor", [str(2**63), "9" * 30])
def test_out_of_range_cursor_is_invalid(store: Store, cursor: str) -> None:
    store.record([event()])
    with pytest.raises(InvalidCursor):
        store.list_events(EventFilter(), cursor=cursor)


# --- faults -------------------------------------------------------------------------------


def test_faults_create_end_list(store: Store) -> None:
    a = store.create_fault("heartbeat_loss", node="n1", job=None, params={"duration_s": 30})
    b = store.create_fault("xid", node="n2", job="j1", params={"code": 79})
    assert b.id > a.id
    assert (a.kind, a.node, a.job, a.params, a.active, a.ended_at) == (
        "heartbeat_loss",
        "n1",
        None,
        {"duration_s": 30},
        True,
        None,
    )
    assert_utc(a.created_at)
    assert store.get_fault(a.id) == a

    ended = store.end_fault(a.id)
    assert ended is not None and not ended.active
    assert_utc(ended.ended_at)
    assert ended.ended_at is not None and ended.ended_at >= a.created_at
    assert store.end_fault(a.id) == ended  # ending twice changes nothing
    assert store.get_fault(a.id) == ended
    assert store.end_fault(10**9) is None
    assert store.get_fault(10**9) is None

    assert [f.id for f in store.list_faults()] == [b.id, a.id]
    assert [f.id for f in store.list_faults(active=True)] == [b.id]
    assert [f.id for f in store.list_faults(active=False)] == [a.id]


def test_linked_to_fault(store: Store) -> None:
    fault = store.create_fault("xid", node="n1", job="j1", params={})
    other = store.create_fault("xid", node="n2", job="j1", params={})
    linked_event, _, foreign = store.record(
        [
            event(E.GPU_XID, fault_id=fault.id, code=79),
            event(E.WORKER_EXITED),
            event(E.GPU_XID, "n2", fault_id=other.id, code=79),
        ]
    )
    assert linked_event.id is not None and foreign.id is not None
    policy_actions = store.handle_event(linked_event.id, [actions.restart_in_place("j1", "n1")])
    store.handle_event(foreign.id, [actions.restart_in_place("j1", "n2")])
    operator_action, _ = store.create_action(
        actions.cordon("n1"), key="op", source="fault", fault_id=fault.id
    )

    events, acts = store.linked_to_fault(fault.id)
    assert [e.id for e in events] == [linked_event.id]
    assert [a.id for a in acts] == [policy_actions[0].id, operator_action.id]
    assert store.linked_to_fault(10**9) == ([], [])


# --- atomicity ----------------------------------------------------------------------------


def test_failed_record_leaves_nothing_half_written(store: Store) -> None:
    with pytest.raises(IntegrityError):
        store.record(
            [event(E.HOST_HEARTBEAT_LOST), event(E.GPU_XID, fault_id=987654, code=79)],
            [node_view("n1")],
            [job_view("j1")],
        )
    assert store.load_nodes() == []
    assert store.load_jobs() == []
    assert store.list_events(EventFilter()).items == []
    assert store.policy_counts(T0).node_failures == {}
    with Session(store.engine) as session:
        assert session.scalar(select(func.count()).select_from(EventRow)) == 0

    # The store is still usable afterwards.
    [ok] = store.record([event()], [node_view("n1")])
    assert ok.id is not None
    assert store.policy_counts(T0).node_failures == {"n1": 1}


def test_naive_datetimes_are_refused(store: Store) -> None:
    with pytest.raises(Exception, match="naive datetime"):
        store.record([event(time=datetime(2025, 1, 1))])
    assert store.list_events(EventFilter()).items == []


def test_upgrade_from_0001_backfills_worker_states(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        migrate(engine, "0001")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO nodes (name, state, job, alive, cordoned, flapping, updated_at)"
                    " VALUES ('old', 'running', 'j1', true, false, false, CURRENT_TIMESTAMP)"
                )
            )
        migrate(engine)
        [node] = Store(engine).load_nodes()
        assert node.name == "old" and node.workers == ()
    finally:
        engine.dispose()


def test_upgrade_from_0003_keeps_checkpoint_reports_without_sizes(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        migrate(engine, "0003")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO checkpoint_reports (report_id, node, job, rank, event, step,"
                    " duration_s, tier, time, received_at) VALUES ('old', 'n1', 'j1', 0,"
                    " 'saved', 10, 0.5, 'local', :t, :t)"
                ),
                {"t": T0},
            )
        migrate(engine)
        store = Store(engine)
        [old] = store.list_checkpoint_reports("j1")
        assert (old.report_id, old.step, old.tier) == ("old", 10, "local")
        assert (old.size_bytes, old.total_s) == (None, None)
        # The upgraded table takes the new fields and tiers, big sizes included.
        new = CheckpointReport(
            "new", "n1", "j1", 0, "loaded", 20, 0.1, "peer", T0 + timedelta(seconds=1),
            size_bytes=2**62, total_s=604_800.0,
        )  # fmt: skip
        assert store.record_checkpoint_reports([new]) == (1, 0)
        assert store.list_checkpoint_reports("j1") == [new, old]
        columns = {c["name"] for c in inspect(engine).get_columns("checkpoint_reports")}
        assert {"bytes", "total_s"} <= columns
    finally:
        engine.dispose()


def test_worker_states_round_trip(store: Store) -> None:
    worker = WorkerView(
        rank=3, local_rank=1, pid=42, state=WorkerState.EXITED, step=7, exit_code=-9
    )
    view = NodeView("n1", NodeState.RUNNING, "j1", True, T0, workers=(worker,))
    store.record([], [view])
    [loaded] = store.load_nodes()
    assert loaded.workers == (worker,)


def test_a_new_node_recorded_from_two_threads_at_once_is_recorded_by_both(store: Store) -> None:
    """The heartbeat route, the deadline handler and a fault injection each record in a
    thread of their own: two records of a node (and job) new to the database, at once,
    both land with their events and each failure counted (a read-then-insert upsert lost
    one of them to a unique violation, seen once under load)."""
    rounds = 20
    for i in range(rounds):
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def write(
            name: str, job: str, barrier: threading.Barrier, errors: list[BaseException]
        ) -> None:
            barrier.wait()
            try:
                store.record([event(node=name, job=job)], [node_view(name, job)], [job_view(job)])
            except BaseException as exc:
                errors.append(exc)

        args = (f"new-{i}", f"job-{i}", barrier, errors)
        threads = [threading.Thread(target=write, args=args) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
    assert len(store.load_nodes()) == rounds and len(store.load_jobs()) == rounds
    failures = store.policy_counts(T0).node_failures
    assert failures == {f"new-{i}": 2 for i in range(rounds)}
