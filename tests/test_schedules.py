"""Scheduled operations (supervisor/schedules): the scheduler's job store on the
supervisor's database (SQLite, and PostgreSQL when configured), the missed-run rule,
fault drills by cron or interval, and maintenance windows, over the HTTP API.

Runs of the child processes (a kill -9 of `supervisor serve`, a change of leader) are in
tests/test_schedules_processes.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from apscheduler.triggers.date import DateTrigger
from sqlalchemy import text

from supervisor.schedules import Scheduler, registry
from supervisor.schedules.maintenance import WindowTrigger
from supervisor.schedules.scheduler import JOBS_TABLE
from supervisor.store import open_store
from tests.conftest import SettingsFactory
from tests.test_api import OPERATOR, Api, heartbeat, running
from tests.timing import scaled

#: (the supervisor that ran it, the job's name), as the stored test job records them.
turns: list[tuple[str | None, str]] = []


async def record_turn(host: str, name: str) -> None:
    """A stored job's function (module-level, as APScheduler keeps it by reference)."""
    found = registry.lookup(host)
    turns.append((getattr(found, "name", None), name))


class Host:
    def __init__(self, name: str) -> None:
        self.name = name


async def until(predicate: Callable[[], Any], within: float = 20.0) -> Any:
    deadline = time.monotonic() + scaled(within)
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
    return value


async def until_async(predicate: Callable[[], Any], within: float = 20.0) -> Any:
    deadline = time.monotonic() + scaled(within)
    while not (value := await predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
    return value


RECORD = "tests.test_schedules:record_turn"


# --- the scheduler and its job store ------------------------------------------------------


async def test_a_stored_job_runs_on_the_next_acting_supervisor(database_url: str) -> None:
    turns.clear()
    store = open_store(database_url)
    key = registry.host_key(database_url)
    try:
        first = Scheduler(store.engine, key, misfire_grace_s=60)
        first.start(Host("first"))
        at = datetime.now(UTC) + timedelta(seconds=1)
        first.add("t:later", RECORD, DateTrigger(at), {"name": "later"})
        first.stop()  # before its time: the first supervisor never runs it
        with store.engine.connect() as conn:
            ids = conn.execute(text(f"SELECT id FROM {JOBS_TABLE}")).scalars().all()
        assert ids == ["t:later"]
        assert registry.lookup(key) is None

        second = Scheduler(store.engine, key, misfire_grace_s=60)
        second.start(Host("second"))
        try:
            await until(lambda: turns)
            assert turns == [("second", "later")]
            assert second.jobs() == []  # a one-off job is gone once run
        finally:
            second.stop()
    finally:
        store.close()


async def test_missed_runs_coalesce_and_run_within_the_grace_only(database_url: str) -> None:
    """Down across a job's time: a drill-like job more than the grace late is skipped;
    a window's start and end, both missed, run once (coalesced), however late."""
    turns.clear()
    store = open_store(database_url)
    key = registry.host_key(database_url)
    try:
        first = Scheduler(store.engine, key, misfire_grace_s=1)
        first.start(Host("first"))
        now = datetime.now(UTC)
        soon = now + timedelta(seconds=0.3)
        first.add("t:late", RECORD, DateTrigger(soon), {"name": "late"})
        window = WindowTrigger(soon, soon + timedelta(seconds=0.3))
        first.add("t:window", RECORD, window, {"name": "window"}, always_run=True)
        first.stop()
        # Down until the late job is well past its grace (1 s), and the window over.
        await asyncio.sleep(
            max(0.0, (now + timedelta(seconds=2.5) - datetime.now(UTC)).total_seconds())
        )

        second = Scheduler(store.engine, key, misfire_grace_s=1)
        second.start(Host("second"))
        try:
            await until(lambda: turns)
            await until(lambda: not second.jobs())  # both done with: nothing stored
            await asyncio.sleep(0.3)
            assert turns == [("second", "window")]
        finally:
            second.stop()
    finally:
        store.close()


# --- fault drills over the API ------------------------------------------------------------


async def drills(api: Api) -> list[str]:
    assert api.supervisor.scheduler is not None
    return [j.id for j in await asyncio.to_thread(api.supervisor.scheduler.jobs, "drill:")]


@pytest.mark.parametrize(
    ("schedule", "needle"),
    [
        ({"cron": "61 * * * *", "kinds": ["xid"]}, "schedule: cron: Error validating"),
        ({"cron": "0 2 * *", "kinds": ["xid"]}, "schedule: cron: a cron expression has 5 fields"),
        ({"cron": "0 0 31 2 *", "kinds": ["xid"]}, "schedule: cron: '0 0 31 2 *' never fires"),
        ({"cron": "0 2 * * *", "every_s": 60, "kinds": ["xid"]}, "schedule: give exactly one"),
        ({"every_s": 0.5, "kinds": ["xid"]}, "schedule: every_s: "),
        ({"cron": "0 2 * * *", "kinds": []}, "schedule: kinds: "),
        ({"cron": "0 2 * * *", "kinds": ["meteor"]}, "schedule: kinds.0: "),
        ({"cron": "0 2 * * *", "kinds": ["xid"], "when": "now"}, "schedule: when: "),
        (7, "schedule: expected a string such as 'random,120' or an object"),
    ],
)
async def test_a_bad_drill_is_a_422_naming_the_field_and_changes_nothing(
    make_settings: SettingsFactory, schedule: Any, needle: str
) -> None:
    async with running(make_settings(heartbeat_timeout_s=30)) as api:
        await api.beat(heartbeat("n1"))
        response = await api.client.post(
            "/api/v1/faults", json={"schedule": schedule}, headers=OPERATOR
        )
        assert response.status_code == 422, response.text
        assert response.json()["message"].startswith(needle), response.text
        assert await api.get("/api/v1/faults") == []
        assert await drills(api) == []


async def test_an_interval_drill_injects_until_deleted(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        heartbeat_timeout_s=30, heartbeat_polling_period_s=5, gpu_report_cooldown_s=0
    )
    async with running(settings) as api:
        await api.beat(heartbeat("n1"))
        await api.beat(heartbeat("n2", job="j2"))
        body = {"schedule": {"every_s": 1, "kinds": ["xid", "ecc"], "job": "j1"}}
        response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
        assert response.status_code == 201, response.text
        drill = response.json()
        assert drill["kind"] == "schedule" and drill["job"] == "j1"
        assert drill["params"] == {"schedule": {"every_s": 1, "kinds": ["xid", "ecc"], "job": "j1"}}
        assert await drills(api) == [f"drill:{drill['id']}"]

        async def children() -> list[dict[str, Any]]:
            faults = await api.get("/api/v1/faults")
            return [f for f in faults if f["kind"] in ("xid", "ecc")]

        await until_async(lambda: _at_least(children, 2))
        ended = await api.client.delete(f"/api/v1/faults/{drill['id']}", headers=OPERATOR)
        assert ended.json()["active"] is False
        assert await drills(api) == []
        count = len(await children())
        await asyncio.sleep(1.5)  # more than a period: nothing more
        made = await children()
        assert len(made) == count
        assert all(f["params"]["schedule"] == drill["id"] and f["node"] == "n1" for f in made)
        await api.settle()
        for fault in made:  # each turn's GPU error is an event carrying its id (an ECC
            # drill's count grows, as the driver's cumulative counter would)
            linked = await api.get(f"/api/v1/faults/{fault['id']}")
            assert linked["events"], (fault, made)


async def _at_least(read: Callable[[], Any], n: int) -> bool:
    return len(await read()) >= n


async def test_a_nightly_drill_is_stored_and_outlives_a_restart(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(heartbeat_timeout_s=30)
    body = {"schedule": {"cron": "0 2 * * *", "kinds": ["xid"]}}
    async with running(settings) as api:
        await api.beat(heartbeat("n1"))
        response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
        assert response.status_code == 201, response.text
        drill = response.json()
        assert api.supervisor.scheduler is not None
        job = api.supervisor.scheduler.get(f"drill:{drill['id']}")
        assert job is not None
        when = job.next_run_time.astimezone(UTC)
        assert (when.hour, when.minute, when.second) == (2, 0, 0)
        assert timedelta(0) < when - datetime.now(UTC) <= timedelta(days=1)
    async with running(settings) as api:  # the same database, a new supervisor
        assert api.supervisor.scheduler is not None
        job = api.supervisor.scheduler.get(f"drill:{drill['id']}")
        assert job is not None and job.next_run_time.astimezone(UTC) == when
        (fault,) = await api.get("/api/v1/faults", active=True)
        assert fault["id"] == drill["id"]
        await api.client.delete(f"/api/v1/faults/{drill['id']}", headers=OPERATOR)
        assert await drills(api) == []


# --- maintenance windows ------------------------------------------------------------------


def at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def window_actions(api: Api, window: str) -> list[dict[str, Any]]:
    items = (await api.get("/api/v1/actions", limit=1000))["items"]
    mine = [a for a in items if a["idempotency_key"].startswith(f"maintenance-{window}-")]
    return sorted(mine, key=lambda a: a["id"])


async def test_a_maintenance_window_moves_the_job_off_and_hands_the_node_back(
    make_settings: SettingsFactory,
) -> None:
    async with running(make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)) as api:
        await api.beat(heartbeat("n1"))
        await api.beat(heartbeat("n2", job=None))  # a spare
        body = {"node": "n1", "start": at(0.5), "end": at(4), "reason": "firmware"}
        response = await api.client.post("/api/v1/maintenance", json=body, headers=OPERATOR)
        assert response.status_code == 201, response.text
        window = response.json()
        assert window["state"] == "scheduled" and window["node"] == "n1"
        assert [w["id"] for w in await api.get("/api/v1/maintenance")] == [window["id"]]

        async def opened() -> list[dict[str, Any]]:
            done = [
                a for a in await window_actions(api, window["id"]) if a["status"] == "succeeded"
            ]
            return done if len(done) == 3 else []

        started = await until_async(opened)
        assert [a["type"] for a in started] == ["emergency_checkpoint", "hot_swap", "cordon"]
        assert all(a["source"] == "maintenance" and "firmware" in a["reason"] for a in started)
        assert [a["job"] for a in started] == ["j1", "j1", "j1"]
        assert started[0]["finished_at"] <= started[1]["started_at"]  # checkpoint first
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is True
        (listed,) = await api.get("/api/v1/maintenance")
        assert listed["state"] == "open" and listed["next_run"] is not None

        async def closed() -> list[dict[str, Any]]:
            done = [
                a for a in await window_actions(api, window["id"]) if a["status"] == "succeeded"
            ]
            return done if len(done) == 4 else []

        ended = await until_async(closed)
        assert ended[-1]["type"] == "uncordon" and ended[-1]["node"] == "n1"
        await api.settle()
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is False
        assert await api.get("/api/v1/maintenance") == []
        gone = await api.client.get(f"/api/v1/maintenance/{window['id']}", headers=OPERATOR)
        assert gone.status_code == 404


async def test_deleting_an_open_window_hands_the_node_back_now(
    make_settings: SettingsFactory,
) -> None:
    async with running(make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)) as api:
        await api.beat(heartbeat("n3", job=None))  # no job: the window only cordons it
        body = {"node": "n3", "start": at(-60), "end": at(3600)}
        headers = {**OPERATOR, "Idempotency-Key": "rack-7-bios"}
        first = await api.client.post("/api/v1/maintenance", json=body, headers=headers)
        again = await api.client.post("/api/v1/maintenance", json=body, headers=headers)
        assert first.status_code == 201 and again.status_code == 200, again.text
        window = first.json()
        assert again.json()["id"] == window["id"]
        other = await api.client.post(
            "/api/v1/maintenance", json={**body, "reason": "other"}, headers=headers
        )
        assert other.status_code == 409

        async def cordoned() -> list[dict[str, Any]]:
            done = [
                a for a in await window_actions(api, window["id"]) if a["status"] == "succeeded"
            ]
            return done

        (cordon,) = await until_async(cordoned)
        assert cordon["type"] == "cordon" and cordon["job"] is None
        deleted = await api.client.delete(f"/api/v1/maintenance/{window['id']}", headers=OPERATOR)
        assert deleted.status_code == 200 and deleted.json()["state"] == "open"
        done = await until_async(lambda: _at_least(lambda: cordoned(), 2))
        assert done
        actions = await window_actions(api, window["id"])
        assert [a["type"] for a in actions] == ["cordon", "uncordon"]
        assert await api.get("/api/v1/maintenance") == []


async def test_a_bad_window_is_refused_and_changes_nothing(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    cases = [
        ({"node": "n1", "start": at(60), "end": at(30)}, 422, "end: must be after start"),
        ({"node": "n1", "start": at(-60), "end": at(-30)}, 422, "end: is in the past"),
        ({"node": "n1", "start": "tomorrow", "end": at(30)}, 422, "start"),
        ({"node": "n9", "start": at(0), "end": at(30)}, 404, "n9"),
    ]
    for body, code, needle in cases:
        response = await api.client.post("/api/v1/maintenance", json=body, headers=OPERATOR)
        assert response.status_code == code and needle in response.json()["message"], response.text
    body = {"node": "n1", "start": at(0), "end": at(30)}
    assert (await api.client.post("/api/v1/maintenance", json=body)).status_code == 401
    assert await api.get("/api/v1/maintenance") == []
    assert (await api.get("/api/v1/actions"))["items"] == []


@pytest.fixture
async def api(make_settings: SettingsFactory) -> Any:
    async with running(make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)) as a:
        yield a


async def test_a_dry_run_supervisor_on_the_same_database_keeps_its_own_jobs(
    make_settings: SettingsFactory,
) -> None:
    """A shadow (dry run) may share the acting supervisor's database: it neither lists
    nor runs the acting one's windows, and the reverse."""
    live = make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)
    shadow = make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5, dry_run=True)
    async with running(live) as acting, running(shadow) as dry:
        for api in (acting, dry):
            await api.beat(heartbeat("n1"))
        body = {"node": "n1", "start": at(3600), "end": at(7200)}
        mine = await acting.client.post("/api/v1/maintenance", json=body, headers=OPERATOR)
        its = await dry.client.post("/api/v1/maintenance", json=body, headers=OPERATOR)
        assert mine.status_code == its.status_code == 201
        assert [w["id"] for w in await acting.get("/api/v1/maintenance")] == [mine.json()["id"]]
        assert [w["id"] for w in await dry.get("/api/v1/maintenance")] == [its.json()["id"]]
