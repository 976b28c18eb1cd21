"""The supervisor's fence on reports from an older world than the one its backend started
(supervisor/sensor/worlds.py), over HTTP as host monitors send them: a heartbeat with live
workers of an older world is refused (409 `stale_world`, naming the newest world and the
ranks to stop) and changes nothing; ended workers of an older world are dropped from the
heartbeat, so what they report (an exit) never raises an event; a checkpoint report of an
older world is acknowledged and not recorded. Every one is counted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.acting_stand_in import RecordingBackend
from tests.conftest import SettingsFactory
from tests.test_api import AGENT, OPERATOR, Api, running


class Worlds(RecordingBackend):
    """A backend that started world 2 of job j1."""

    def worlds(self) -> Mapping[str, int]:
        return {"j1": 2}


def beat(world: int, state: str = "running", **worker: Any) -> dict[str, Any]:
    workers = [
        {"rank": r, "local_rank": r - 2, "pid": 100 + r, "state": state, "world": world, **worker}
        for r in (2, 3)
    ]
    return {"node": "n1", "state": "running", "job": "j1", "workers": workers}


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    settings = make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)
    async with running(settings, backend=Worlds()) as a:
        yield a


async def counted(api: Api, report: str, outcome: str) -> float:
    text = (await api.client.get("/metrics")).text
    line = f'supervisor_stale_world_reports_total{{outcome="{outcome}",report="{report}"}}'
    (value,) = [row.split()[-1] for row in text.splitlines() if row.startswith(line)]
    return float(value)


async def events(api: Api, type_: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await api.get("/api/v1/events", type=type_))["items"]
    return items


async def test_live_workers_of_an_older_world_are_refused_and_change_nothing(api: Api) -> None:
    r = await api.beat(beat(world=1))
    assert r.status_code == 409, r.text
    body = r.json()
    assert (body["code"], body["job"], body["world"], body["ranks"]) == (
        "stale_world",
        "j1",
        2,
        [2, 3],
    )
    assert "older world" in body["message"]
    assert (await api.client.get("/api/v1/nodes/n1", headers=OPERATOR)).status_code == 404
    assert await counted(api, "heartbeat", "refused") == 1
    # The newest world's workers are taken.
    r = await api.beat(beat(world=2))
    assert r.status_code in (202, 204), r.text
    # The backend starts a newer world: world 2 is the older one now.
    api.supervisor.backend.world_started("j1", 3)
    r = await api.beat(beat(world=2))
    assert r.status_code == 409 and r.json()["world"] == 3, r.text
    assert await counted(api, "heartbeat", "refused") == 2


async def test_an_ended_worker_of_an_older_world_raises_nothing(api: Api) -> None:
    assert (await api.beat(beat(world=2))).status_code in (202, 204)
    # Its exit, reported as of world 1: dropped (the node itself is heard).
    r = await api.beat(beat(world=1, state="exited", exit_code=1))
    assert r.status_code in (202, 204), r.text
    await api.settle()
    assert await events(api, "worker_exited") == []
    assert await counted(api, "heartbeat", "dropped") == 1
    # The same exit in the newest world is a failure.
    r = await api.beat(beat(world=2, state="exited", exit_code=1))
    assert r.status_code == 202, r.text
    await api.settle()
    assert len(await events(api, "worker_exited")) == 2


async def test_checkpoint_reports_of_an_older_world_are_not_recorded(api: Api) -> None:
    now = datetime.now(UTC).isoformat()
    base = {"node": "n1", "job": "j1", "rank": 2, "step": 40, "duration_s": 1, "time": now}
    reports = [
        {**base, "id": "old", "event": "saved", "tier": "durable", "world": 1},
        {**base, "id": "bad", "event": "failed", "tier": "durable", "world": 1, "error": "x"},
        {**base, "id": "new", "event": "saved", "tier": "durable", "world": 2},
        {**base, "id": "unknown", "event": "saved", "tier": "ram"},
    ]
    r = await api.client.post("/api/v1/checkpoints", json={"reports": reports}, headers=AGENT)
    assert r.status_code == 200, r.text
    assert r.json() == {"stored": 2, "duplicates": 0, "refused": 2}
    stored = {c["id"] for c in await api.get("/api/v1/checkpoints")}
    assert stored == {"new", "unknown"}
    await api.settle()
    assert await events(api, "checkpoint_failed") == []
    assert await counted(api, "checkpoint", "refused") == 2
    r = await api.client.post(
        "/api/v1/checkpoints", json={"reports": [{**reports[0], "world": -1}]}, headers=AGENT
    )
    assert r.status_code == 422 and "reports.0.world" in r.json()["message"], r.text
