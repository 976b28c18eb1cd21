"""The REST API as a client sees it: auth, validation, reads, faults, manual actions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
import pytest

from supervisor.actuator import ActionError, Backend, DryRunBackend
from supervisor.api import create_app
from supervisor.config import Settings
from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    ActionStatus,
    ActionType,
    Event,
    EventType,
)
from supervisor.policy import Policy
from supervisor.runtime import Supervisor
from tests.acting_stand_in import RecordingBackend
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def heartbeat(node: str, *, job: str | None = "j1", step: int = 10, **extra: Any) -> dict[str, Any]:
    if job is None:
        return {"node": node, "state": "spare", **extra}
    workers = [
        {
            "rank": 2 * int(node.lstrip("n") or 0) + i,
            "local_rank": i,
            "pid": 100 + i,
            "state": "running",
            "step": step,
        }
        for i in range(2)
    ]
    return {"node": node, "state": "running", "job": job, "workers": workers, **extra}


class Api:
    def __init__(self, client: httpx.AsyncClient, supervisor: Supervisor) -> None:
        self.client = client
        self.supervisor = supervisor

    async def beat(
        self, body: dict[str, Any], headers: Mapping[str, str] = AGENT
    ) -> httpx.Response:
        return await self.client.post("/api/v1/heartbeats", json=body, headers=headers)

    async def get(self, path: str, **params: Any) -> Any:
        response = await self.client.get(path, params=params, headers=OPERATOR)
        assert response.status_code == 200, response.text
        return response.json()

    async def settle(self) -> None:
        await asyncio.wait_for(self.supervisor.settle(), timeout=scaled(10))


@asynccontextmanager
async def running(
    settings: Settings, backend: Backend | None = None, policy: Policy | None = None
) -> AsyncIterator[Api]:
    supervisor = Supervisor(settings, backend=backend or RecordingBackend(), policy=policy)
    app = create_app(settings, supervisor)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Api(client, supervisor)


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    async with running(make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5)) as a:
        yield a


# --- authentication ---------------------------------------------------------------------


async def test_heartbeat_needs_the_agent_token(api: Api) -> None:
    missing = await api.beat(heartbeat("n1"), headers={})
    wrong = await api.beat(heartbeat("n1"), headers=OPERATOR)
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert api.supervisor.sensor.node_names() == []
    ok = await api.beat(heartbeat("n1"))
    assert ok.status_code == 204 and ok.content == b""
    assert api.supervisor.sensor.has_node("n1")


async def test_heartbeat_body_in_parts_and_one_too_large(api: Api) -> None:
    """A body that arrives in several parts (chunked) is put together; one larger than
    1 MiB gets 413 naming the limit, and changes nothing."""
    body = json.dumps(heartbeat("n1")).encode()

    async def parts(data: bytes, size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    ok = await api.client.post("/api/v1/heartbeats", content=parts(body, 7), headers=AGENT)
    assert ok.status_code == 204, ok.text
    assert api.supervisor.sensor.has_node("n1")
    big = heartbeat("n2")
    padded = json.dumps(big).encode()[:-1] + b" " * (1 << 20) + b"}"  # valid, too large
    r = await api.client.post("/api/v1/heartbeats", content=parts(padded, 64 * 1024), headers=AGENT)
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    assert not api.supervisor.sensor.has_node("n2")


async def test_reads_need_the_operator_token_unless_opened(make_settings: SettingsFactory) -> None:
    async with running(make_settings()) as api:
        assert (await api.client.get("/api/v1/events")).status_code == 401
        assert (await api.client.get("/api/v1/nodes", headers=AGENT)).status_code == 401
        assert (await api.client.get("/api/v1/nodes", headers=OPERATOR)).status_code == 200
    async with running(make_settings(read_requires_token=False)) as api:
        assert (await api.client.get("/api/v1/events")).status_code == 200
        # Writes stay protected.
        assert (await api.client.post("/api/v1/faults", json={})).status_code == 401


async def test_agent_token_cannot_inject_faults_or_act(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    fault = await api.client.post(
        "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=AGENT
    )
    action = await api.client.post(
        "/api/v1/actions", json={"type": "cordon", "node": "n1"}, headers=AGENT
    )
    assert fault.status_code == 401 and action.status_code == 401
    assert (await api.get("/api/v1/events"))["items"] == []
    assert (await api.get("/api/v1/actions"))["items"] == []


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"state": "running", "job": "j1"}, "node"),
        ({"node": "", "state": "running", "job": "j1"}, "node"),
        ({"node": "n1", "state": "sleeping", "job": "j1"}, "state"),
        (
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [{"rank": -1, "local_rank": 0, "state": "running"}],
            },
            "workers.0.rank",
        ),
        (
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [{"rank": 0, "local_rank": 0, "state": "running", "step": "ten"}],
            },
            "workers.0.step",
        ),
        ({"node": "n1", "state": "running"}, "job: required when state is running"),
        ({"node": "n1", "state": "running", "job": "j1", "colour": "red"}, "colour"),
        # A value of a mapping has no index to name: the mapping is named.
        ({"node": "n1", "state": "spare", "topology": {"rack": 1}}, "topology"),
        # Accepted, a step past SQL's BIGINT stopped goodput sampling for every job.
        (
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [
                    {"rank": 0, "local_rank": 0, "state": "running", "step": 2**63},
                ],
            },
            "workers.0.step",
        ),
        (
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [{"rank": 0, "local_rank": 0, "state": "exited", "exit_code": -(2**64)}],
            },
            "workers.0.exit_code",
        ),
        # A rank past SQL's INTEGER failed the event's insert on PostgreSQL.
        (
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [{"rank": 5912593423, "local_rank": 0, "state": "exited"}],
            },
            "workers.0.rank",
        ),
    ],
)
async def test_bad_heartbeats_get_422_naming_the_field(
    api: Api, body: dict[str, Any], field: str
) -> None:
    response = await api.beat(body)
    assert response.status_code == 422
    assert field in response.json()["message"]
    assert api.supervisor.sensor.node_names() == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"job": None}, "job: required when state is running"),
        ({"state": "spare", "job": None}, "workers: a spare node reports no workers"),
        ({"node": "n1 "}, "node: Expected str matching regex"),
        # The operator API could never name a node with a trailing newline again.
        ({"node": "n1\n"}, "node: Expected str matching regex"),
        ({"job": "j1/x"}, "job: Expected str matching regex"),
        (
            {
                "workers": [
                    {"rank": 2, "local_rank": 0, "state": "running", "step": 11},
                    {"rank": 2, "local_rank": 1, "state": "running", "step": 11},
                ]
            },
            "workers.1.rank: rank 2 is reported twice",
        ),
    ],
)
async def test_a_known_node_cannot_skip_the_cross_field_checks(
    api: Api, change: dict[str, Any], field: str
) -> None:
    """A node's steady heartbeats skip the checks their fields already passed; any other
    heartbeat from it still gets them, and a refused one changes nothing."""
    assert (await api.beat(heartbeat("n1"))).status_code == 204  # registered
    assert (await api.beat(heartbeat("n1", step=11))).status_code == 204  # steady
    before = api.supervisor.sensor.node_view("n1")
    bad = {k: v for k, v in {**heartbeat("n1", step=12), **change}.items() if v is not None}
    response = await api.beat(bad)
    assert response.status_code == 422, response.text
    assert field in response.json()["message"]
    assert api.supervisor.sensor.node_view("n1") == before
    assert [e["type"] for e in (await api.get("/api/v1/events"))["items"]] == []


async def test_malformed_json_is_422(api: Api) -> None:
    response = await api.client.post(
        "/api/v1/heartbeats",
        content=b"{not json",
        headers={**AGENT, "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert api.supervisor.sensor.node_names() == []


async def test_heartbeats_take_a_lowercase_bearer_and_refuse_other_content_types(
    api: Api,
) -> None:
    body = json.dumps(heartbeat("n1")).encode()
    lower = {"Authorization": AGENT["Authorization"].replace("Bearer", "bearer")}
    ok = await api.client.post(
        "/api/v1/heartbeats", content=body, headers={**lower, "Content-Type": "application/json"}
    )
    assert ok.status_code == 204, ok.text
    form = await api.client.post(
        "/api/v1/heartbeats",
        content=body,
        headers={**AGENT, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415 and "content-type" in form.json()["message"]
    wrong = await api.client.post(
        "/api/v1/heartbeats", content=body, headers={"Authorization": "bearer nope"}
    )
    assert wrong.status_code == 401 and wrong.json()["message"]


async def test_a_heartbeat_that_is_not_utf8_is_422(api: Api) -> None:
    response = await api.client.post(
        "/api/v1/heartbeats",
        content=b'{"node": "n1\xff", "state": "spare"}',
        headers={**AGENT, "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    # The decoder's own words follow ours; their case changed between pydantic-core releases.
    assert "invalid utf-8" in response.json()["message"].lower()
    assert api.supervisor.sensor.node_names() == []


async def test_bad_query_parameters(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    bad = [
        ("/api/v1/events", {"limit": 0}, 422, "limit"),
        ("/api/v1/events", {"type": "nope"}, 422, "type"),
        ("/api/v1/events", {"cursor": "abc"}, 422, "cursor"),
        (
            "/api/v1/events",
            {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
            422,
            "since",
        ),
        # Valid with its zone, before year 1 in UTC: a 500 before.
        ("/api/v1/events", {"since": "0001-01-01T00:00:00+14:00"}, 422, "since"),
        ("/api/v1/actions", {"until": "9999-12-31T23:59:59-14:00"}, 422, "until"),
        ("/api/v1/events", {"node": "ghost"}, 404, "ghost"),
        ("/api/v1/actions", {"job": "ghost"}, 404, "ghost"),
        ("/api/v1/nodes/ghost", {}, 404, "ghost"),
        ("/api/v1/jobs/ghost", {}, 404, "ghost"),
        ("/api/v1/events/999", {}, 404, "999"),
        ("/api/v1/actions/999", {}, 404, "999"),
        # Ids are SQL BIGINTs: one past the largest is refused by name, not a 500.
        ("/api/v1/events/9223372036854775808", {}, 422, "event_id"),
        ("/api/v1/actions/9223372036854775808", {}, 422, "action_id"),
        ("/api/v1/faults/9223372036854775808", {}, 422, "fault_id"),
        ("/api/v1/actions", {"event_id": 2**63}, 422, "event_id"),
        ("/api/v1/events/0", {}, 422, "event_id"),
        ("/api/v1/events/9223372036854775807", {}, 404, "9223372036854775807"),
    ]
    for path, params, status, needle in bad:
        response = await api.client.get(path, params=params, headers=OPERATOR)
        assert response.status_code == status, (path, params, response.text)
        assert needle in response.json()["message"], (path, params, response.text)
    response = await api.client.delete("/api/v1/faults/9223372036854775808", headers=OPERATOR)
    assert response.status_code == 422 and "fault_id" in response.text


# --- reads --------------------------------------------------------------------------------


async def test_nodes_and_jobs_show_the_live_picture(api: Api) -> None:
    await api.beat(heartbeat("n1", step=7))
    await api.beat(heartbeat("n2", step=7))
    await api.beat(heartbeat("n9", job=None))
    nodes = await api.get("/api/v1/nodes")
    assert [n["name"] for n in nodes] == ["n1", "n2", "n9"]
    assert nodes[0]["workers"][0]["step"] == 7 and nodes[0]["alive"] is True
    assert [n["name"] for n in await api.get("/api/v1/nodes", state="spare")] == ["n9"]
    assert [n["name"] for n in await api.get("/api/v1/nodes", job="j1")] == ["n1", "n2"]
    node = await api.get("/api/v1/nodes/n2")
    assert node["job"] == "j1" and node["heartbeat_age_s"] >= 0
    jobs = await api.get("/api/v1/jobs")
    assert jobs == [await api.get("/api/v1/jobs/j1")]
    assert jobs[0]["nodes"] == ["n1", "n2"] and jobs[0]["last_step"] == 7
    assert jobs[0]["num_dp_replicas"] == api.supervisor.settings.num_dp_replicas


async def test_event_pagination_and_filters(api: Api) -> None:
    for i in range(12):
        await api.beat(heartbeat(f"s{i}", job=None))  # each new spare raises an event
    await api.beat(heartbeat("n1"))
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 5}
        if cursor:
            params["cursor"] = cursor
        page = await api.get("/api/v1/events", **params)
        seen += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(seen, reverse=True) and len(seen) == len(set(seen)) == 12
    only = await api.get("/api/v1/events", node="s3")
    assert [e["node"] for e in only["items"]] == ["s3"]
    assert (await api.get("/api/v1/events", type="hang"))["items"] == []
    first = only["items"][0]["time"]
    later = await api.get("/api/v1/events", since=first)
    assert {e["node"] for e in later["items"]} >= {"s3"}
    assert "s0" not in {e["node"] for e in later["items"]}


async def test_openapi_documents_every_route(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    for path in [
        "/api/v1/heartbeats",
        "/api/v1/events",
        "/api/v1/events/{event_id}",
        "/api/v1/actions",
        "/api/v1/actions/{action_id}",
        "/api/v1/nodes",
        "/api/v1/nodes/{name}",
        "/api/v1/jobs",
        "/api/v1/jobs/{name}",
        "/api/v1/faults",
        "/api/v1/faults/{fault_id}",
        "/healthz",
        "/readyz",
        "/metrics",
    ]:
        assert path in schema["paths"], path
    body = schema["paths"]["/api/v1/heartbeats"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/HostHeartbeat")
    heartbeat_schema = schema["components"]["schemas"]["HostHeartbeat"]
    assert {"node", "state"} <= set(heartbeat_schema["required"])
    assert "WorkerReport" in schema["components"]["schemas"]


async def test_health_and_metrics(api: Api) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    assert (await api.client.get("/readyz")).json() == {"status": "ready"}
    await api.beat(heartbeat("n1"))
    await api.beat(heartbeat("s1", job=None))
    text = (await api.client.get("/metrics")).text
    assert "supervisor_heartbeats_received_total 2.0" in text
    assert 'supervisor_events_total{type="spare_available"} 1.0' in text
    assert "supervisor_detection_lateness_seconds_bucket" in text


# --- faults, events, policy, actions ----------------------------------------------------------


async def test_fault_injection_is_off_by_default(make_settings: SettingsFactory) -> None:
    async with running(make_settings(enable_fault_injection=False)) as api:
        await api.beat(heartbeat("n1"))
        post = await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
        )
        listing = await api.client.get("/api/v1/faults", headers=OPERATOR)
        assert post.status_code == 403 and listing.status_code == 403
        assert "enable_fault_injection" in post.json()["detail"]
        await api.settle()
        assert (await api.get("/api/v1/events"))["items"] == []


async def test_xid_fault_runs_the_policy_and_links_everything(
    make_settings: SettingsFactory,
) -> None:
    backend = RecordingBackend()
    async with running(
        make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5), backend
    ) as api:
        await api.beat(heartbeat("n1"))
        await api.beat(heartbeat("n2"))
        await api.beat(heartbeat("s1", job=None))
        response = await api.client.post(
            "/api/v1/faults",
            json={"kind": "xid", "node": "n1", "code": 79, "gpu": 3},
            headers=OPERATOR,
        )
        assert response.status_code == 201, response.text
        fault = response.json()
        assert fault["job"] == "j1" and len(fault["events"]) == 1
        assert not fault["active"] and fault["ended_at"] is not None  # it happened: over
        await api.settle()
        event = await api.get(f"/api/v1/events/{fault['events'][0]}")
        assert event["type"] == "gpu_xid" and event["details"]["code"] == 79
        assert event["fault_id"] == fault["id"] and event["details"]["gpu"] == 3
        actions = (await api.get("/api/v1/actions", event_id=event["id"]))["items"][::-1]
        assert [a["type"] for a in actions] == ["emergency_checkpoint", "hot_swap"]
        assert all(a["status"] == "succeeded" and a["fault_id"] == fault["id"] for a in actions)
        assert actions[1]["params"] == {"spare": "s1"}
        assert actions[0]["params"] == {"exclude_nodes": ["n1"]}
        linked = await api.get(f"/api/v1/faults/{fault['id']}")
        assert linked["events"] == [event["id"]]
        assert linked["actions"] == [a["id"] for a in actions]
        assert [c.type for c in backend.calls] == [
            ActionType.EMERGENCY_CHECKPOINT,
            ActionType.HOT_SWAP,
        ]
        # The hot-swapped node is now cordoned in the live picture.
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is True


class GatedSwapBackend(RecordingBackend):
    """A hot-swap that lasts until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        self.swapping = asyncio.Event()
        self.release = asyncio.Event()

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if action.type is ActionType.HOT_SWAP:
            self.swapping.set()
            await self.release.wait()
        return await super().execute(action)


async def test_a_swapped_out_node_is_no_spare_until_uncordoned(
    make_settings: SettingsFactory,
) -> None:
    backend = GatedSwapBackend()
    async with running(
        make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5), backend
    ) as api:
        for node, job in (("n1", "j1"), ("n2", "j1"), ("s1", None)):
            await api.beat(heartbeat(node, job=job))
        response = await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
        )
        assert response.status_code == 201, response.text
        await asyncio.wait_for(backend.swapping.wait(), scaled(10))
        # Its host monitor reports it idle while the swap still runs, and after.
        await api.beat(heartbeat("n1", job=None))
        backend.release.set()
        await api.settle()
        await api.beat(heartbeat("n1", job=None))
        await api.settle()

        async def spares() -> list[dict[str, Any]]:
            page = await api.get("/api/v1/events", type="spare_available")
            return [e for e in page["items"] if e["node"] == "n1"]

        assert await spares() == []
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is True
        swap = (await api.get("/api/v1/actions", type="hot_swap"))["items"][0]
        assert swap["status"] == "succeeded"
        # Repaired and uncordoned by the operator: a spare again, and said so.
        response = await api.client.post(
            "/api/v1/actions", json={"type": "uncordon", "node": "n1"}, headers=OPERATOR
        )
        assert response.status_code == 202, response.text
        await api.settle()
        await api.settle()
        raised = await spares()
        assert len(raised) == 1 and raised[0]["details"]["uncordoned"] is True, raised
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is False


async def test_an_application_xid_restarts_the_job_and_leaves_the_node_in_service(
    make_settings: SettingsFactory,
) -> None:
    """XID 31 (a page fault of the program's own) on a node past its restart rung and
    with a spare at hand: the job is restarted, the node stays uncordoned, and the XID is
    not counted against it. With XID 94 set to `ignore` in settings, it is only recorded."""
    backend = RecordingBackend()
    settings = make_settings(
        heartbeat_timeout_s=30,
        heartbeat_polling_period_s=5,
        max_workload_restarts=0,
        xid_responses={"94": "ignore"},
    )
    async with running(settings, backend) as api:
        for name, job in (("n1", "j1"), ("n2", "j1"), ("s1", None)):
            await api.beat(heartbeat(name, job=job))
        response = await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 31}, headers=OPERATOR
        )
        assert response.status_code == 201, response.text
        await api.settle()
        [event] = (await api.get("/api/v1/events", type="gpu_xid"))["items"]
        assert {k: event["details"][k] for k in ("code", "origin", "response")} == {
            "code": 31,
            "origin": "application",
            "response": "restart_workload",
        }
        assert event["details"]["meaning"] == "GPU memory page fault"
        actions = (await api.get("/api/v1/actions", event_id=event["id"]))["items"][::-1]
        assert [a["type"] for a in actions] == ["emergency_checkpoint", "restart_workload"]
        assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is False
        counts = api.supervisor.store.policy_counts(datetime.now(UTC) - timedelta(days=1))
        assert counts.node_failures.get("n1", 0) == 0

        response = await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n2", "code": 94}, headers=OPERATOR
        )
        assert response.status_code == 201, response.text
        await api.settle()
        ignored = (await api.get("/api/v1/events", type="gpu_xid"))["items"][0]
        assert ignored["details"]["code"] == 94 and ignored["details"]["response"] == "ignore"
        assert (await api.get("/api/v1/actions", event_id=ignored["id"]))["items"] == []
        assert [c.type for c in backend.calls] == [
            ActionType.EMERGENCY_CHECKPOINT,
            ActionType.RESTART_WORKLOAD,
        ]


async def test_nvml_health_reports_become_events_and_a_remap_moves_the_job(
    make_settings: SettingsFactory,
) -> None:
    backend = RecordingBackend()
    async with running(
        make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5), backend
    ) as api:
        for name, job in (("n1", "j1"), ("n2", "j1"), ("s1", None)):
            await api.beat(heartbeat(name, job=job))
        throttle = {"kind": "throttle", "gpu": 2, "message": "hardware thermal slowdown"}
        remap = {"kind": "row_remap", "gpu": 5, "count": 1, "message": "row remapping failed"}
        await api.beat(heartbeat("n2", gpu_reports=[throttle]))
        await api.beat(heartbeat("n1", gpu_reports=[remap]))
        await api.settle()
        events = (await api.get("/api/v1/events", type="gpu_health"))["items"][::-1]
        assert [(e["node"], e["details"]["kind"], e["details"]["response"]) for e in events] == [
            ("n2", "throttle", "ignore"),
            ("n1", "row_remap", "replace_node"),
        ]
        assert events[1]["details"]["gpu"] == 5 and events[1]["details"]["origin"] == "hardware"
        assert (await api.get("/api/v1/actions", event_id=events[0]["id"]))["items"] == []
        moved = (await api.get("/api/v1/actions", event_id=events[1]["id"]))["items"][::-1]
        assert [a["type"] for a in moved] == ["emergency_checkpoint", "hot_swap"]
        assert moved[1]["node"] == "n1" and moved[1]["params"] == {"spare": "s1"}


async def test_bad_faults_change_nothing(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    cases = [
        ({"kind": "xid", "node": "n1"}, 422, "code"),
        ({"kind": "meteor", "node": "n1"}, 422, "kind"),
        ({"kind": "ecc", "node": "n1", "count": 0}, 422, "count"),
        ({"kind": "xid", "node": "n1", "code": 79, "duration_s": 5}, 422, "duration_s"),
        ({"kind": "heartbeat_loss", "node": "n1", "duration_s": -1}, 422, "duration_s"),
        ({"kind": "xid", "node": "ghost", "code": 79}, 404, "ghost"),
    ]
    for body, status, needle in cases:
        response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
        assert response.status_code == status, (body, response.text)
        assert needle in response.text
    assert await api.get("/api/v1/faults") == []
    assert (await api.get("/api/v1/events"))["items"] == []


async def test_heartbeat_loss_fault_until_deleted(make_settings: SettingsFactory) -> None:
    # A timeout the fault's injection is well within on a loaded machine: with 0.3 s, the
    # node was once lost on its own, before the fault was recorded (no fault_id).
    async with running(
        make_settings(heartbeat_timeout_s=2.0, heartbeat_polling_period_s=0.5)
    ) as api:
        await api.beat(heartbeat("n1"))
        fault = (
            await api.client.post(
                "/api/v1/faults", json={"kind": "heartbeat_loss", "node": "n1"}, headers=OPERATOR
            )
        ).json()
        give_up = time.monotonic() + scaled(10)
        lost: list[dict[str, Any]] = []
        while not lost:  # the agent keeps sending; the fault drops them
            assert time.monotonic() < give_up, "the node was not lost"
            await api.beat(heartbeat("n1"))
            await asyncio.sleep(0.1)
            lost = (await api.get("/api/v1/events", type="host_heartbeat_lost"))["items"]
        await api.settle()
        lost = (await api.get("/api/v1/events", type="host_heartbeat_lost"))["items"]
        assert len(lost) == 1 and lost[0]["fault_id"] == fault["id"]
        ended = await api.client.delete(f"/api/v1/faults/{fault['id']}", headers=OPERATOR)
        assert ended.status_code == 200 and ended.json()["active"] is False
        await api.beat(heartbeat("n1"))
        await api.settle()
        recovered = (await api.get("/api/v1/events", type="node_recovered"))["items"]
        assert [e["node"] for e in recovered] == ["n1"]
        assert await api.get("/api/v1/faults", active=True) == []


async def test_nodes_lost_together_are_recorded_together(make_settings: SettingsFactory) -> None:
    """A rack going dark: its losses are persisted in one transaction or a few, not one
    commit each, and every one of them is there and decided."""
    async with running(
        make_settings(heartbeat_timeout_s=scaled(1.5), heartbeat_polling_period_s=0.5)
    ) as api:
        rack = [f"n{i}" for i in range(1, 41)]
        transactions: list[int] = []
        store = api.supervisor.store
        record = store.record

        def counted(events: Sequence[Event], *args: Any, **kwargs: Any) -> Any:
            # Only the commits that hold losses: the nodes' joins go through here too, and
            # on a machine slow enough the first losses come before the last joins.
            losses = [e for e in events if e.type is EventType.HOST_HEARTBEAT_LOST]
            if losses:
                transactions.append(len(losses))
                # Each commit as slow as a loaded database's (the store runs in a thread):
                # what expires meanwhile goes in the next, however far the 40 requests
                # spread their deadlines on a loaded machine (one commit each in 29 of 40
                # there, with the commits at SQLite's speed).
                time.sleep(0.25)
            return record(events, *args, **kwargs)

        store.record = counted  # type: ignore[method-assign]
        await asyncio.gather(*(api.beat(heartbeat(n, job=None)) for n in rack))
        await api.settle()
        await asyncio.sleep(scaled(2.0))  # every node silent past its timeout
        # On a loaded machine the sensor's deadlines may fire late, and a loss found late
        # is looked at once more (the supervisor ran behind): wait for all of them.
        give_up = time.monotonic() + scaled(15)
        while True:
            await api.settle()
            found = await api.get("/api/v1/events", type="host_heartbeat_lost", limit=100)
            lost = found["items"]
            if len(lost) >= len(rack) or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.25)
        assert sorted(e["node"] for e in lost) == sorted(rack)
        # Their last heartbeats (so their deadlines) are spread over the time the 40
        # requests took; what expires during one commit goes in the next: a few
        # transactions, where one each would be 40.
        assert sum(transactions) == len(rack) and len(transactions) <= 20, transactions
        nodes = await api.get("/api/v1/nodes")
        assert {n["name"] for n in nodes if not n["alive"]} == set(rack)


async def test_manual_action_is_idempotent_by_key(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    headers = {**OPERATOR, "Idempotency-Key": "cordon-n1-ticket-42"}
    body = {"type": "cordon", "node": "n1", "reason": "bad fan"}
    first = await api.client.post("/api/v1/actions", json=body, headers=headers)
    second = await api.client.post("/api/v1/actions", json=body, headers=headers)
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    await api.settle()
    action = await api.get(f"/api/v1/actions/{first.json()['id']}")
    assert action["status"] == "succeeded" and action["source"] == "operator"
    assert action["attempts"] == 1 and action["reason"] == "bad fan"
    assert (await api.get("/api/v1/nodes/n1"))["cordoned"] is True
    assert len((await api.get("/api/v1/actions"))["items"]) == 1


async def test_bad_manual_actions(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    cases = [
        ({"type": "cordon"}, 422, "node is required"),
        ({"type": "restart_workload"}, 422, "job is required"),
        ({"type": "scale_down", "job": "j1", "params": {"to_replicas": 0}}, 422, "to_replicas"),
        ({"type": "force_delete_pod", "job": "j1", "node": "n1"}, 422, "params.pod"),
        ({"type": "explode", "job": "j1"}, 422, "type"),
        ({"type": "restart_workload", "job": "ghost"}, 404, "ghost"),
        ({"type": "cordon", "node": "ghost"}, 404, "ghost"),
        # The job's replica bounds are [2, 4]; 2**63 overflowed in the controller.
        ({"type": "scale_up", "job": "j1", "params": {"to_replicas": 7}}, 422, "bounds [2, 4]"),
        ({"type": "scale_down", "job": "j1", "params": {"to_replicas": 1}}, 422, "bounds [2, 4]"),
        ({"type": "scale_up", "job": "j1", "params": {"to_replicas": 2**63}}, 422, "to_replicas"),
        # PostgreSQL cannot store a NUL; SQLite stored a non-finite number as null.
        ({"type": "cordon", "node": "n1", "reason": "bad\x00fan"}, 422, "reason"),
        ({"type": "cordon", "node": "n1", "params": {"why": ["a\x00"]}}, 422, "params.why.0"),
        ({"type": "cordon", "node": "n1", "params": {"x": "y" * 20_000}}, 422, "params"),
    ]
    for body, status, needle in cases:
        response = await api.client.post("/api/v1/actions", json=body, headers=OPERATOR)
        assert response.status_code == status, (body, response.text)
        assert needle in response.text
    for number in ("NaN", "Infinity", "1e400"):
        response = await api.client.post(
            "/api/v1/actions",
            content='{"type": "cordon", "node": "n1", "params": {"x": ' + number + "}}",
            headers={**OPERATOR, "Content-Type": "application/json"},
        )
        assert response.status_code == 422, (number, response.text)
        assert "params.x" in response.text and "finite" in response.text
    assert (await api.get("/api/v1/actions"))["items"] == []


async def test_an_idempotency_key_reused_for_another_request_is_refused(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    headers = {**OPERATOR, "Idempotency-Key": "ticket-42"}
    body = {"type": "cordon", "node": "n1", "reason": "bad fan"}
    first = await api.client.post("/api/v1/actions", json=body, headers=headers)
    assert first.status_code == 202, first.text
    other = {**body, "type": "uncordon"}
    response = await api.client.post("/api/v1/actions", json=other, headers=headers)
    assert response.status_code == 422, response.text
    assert "Idempotency-Key" in response.json()["message"]
    assert [a["type"] for a in (await api.get("/api/v1/actions"))["items"]] == ["cordon"]


# --- actuator behaviour seen through the API ---------------------------------------------------


class FlakyBackend(RecordingBackend):
    """Fails the first attempts of each action the way a busy API server would."""

    def __init__(self, failures: int, *, retryable: bool = True) -> None:
        super().__init__()
        self.failures = failures
        self.retryable = retryable
        self.attempts: dict[str, int] = {}

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        n = self.attempts[action.idempotency_key] = self.attempts.get(action.idempotency_key, 0) + 1
        if n <= self.failures:
            raise ActionError(f"busy ({n})", retryable=self.retryable)
        return await super().execute(action)


class SlowBackend(RecordingBackend):
    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        await asyncio.sleep(5)
        return await super().execute(action)


async def _cordon(api: Api) -> dict[str, Any]:
    await api.beat(heartbeat("n1"))
    response = await api.client.post(
        "/api/v1/actions", json={"type": "cordon", "node": "n1"}, headers=OPERATOR
    )
    await api.settle()
    result: dict[str, Any] = await api.get(f"/api/v1/actions/{response.json()['id']}")
    return result


async def test_retryable_errors_are_retried(make_settings: SettingsFactory) -> None:
    async with running(make_settings(action_max_attempts=3), FlakyBackend(2)) as api:
        action = await _cordon(api)
    assert action["status"] == "succeeded" and action["attempts"] == 3 and action["error"] is None


async def test_retries_are_bounded(make_settings: SettingsFactory) -> None:
    async with running(make_settings(action_max_attempts=2), FlakyBackend(5)) as api:
        action = await _cordon(api)
    assert action["status"] == "failed" and action["attempts"] == 2
    # The last attempt's error, and that it was the last of the bounded attempts.
    assert action["error"] == "busy (2) (attempt 2 of 2)"


async def test_permanent_errors_are_not_retried(make_settings: SettingsFactory) -> None:
    async with running(make_settings(), FlakyBackend(5, retryable=False)) as api:
        action = await _cordon(api)
    assert action["status"] == "failed" and action["attempts"] == 1


async def test_actions_time_out(make_settings: SettingsFactory) -> None:
    async with running(
        make_settings(action_timeout_s=0.1, action_max_attempts=1), SlowBackend()
    ) as api:
        action = await _cordon(api)
    assert action["status"] == "failed" and "timed out after 0.1s" in action["error"]
    assert action["finished_at"] is not None


class Broken(Policy):
    def event_policy(self, event: Any, context: Any) -> list[Any]:
        raise RuntimeError("bug in user policy")


async def test_a_raising_policy_decides_nothing_and_the_event_is_kept(
    make_settings: SettingsFactory,
) -> None:
    # A timeout no loaded machine reaches: the event under test is the XID's alone (with
    # 0.5 s, a starved run once lost the node too).
    async with running(make_settings(heartbeat_timeout_s=60), policy=Broken()) as api:
        await api.beat(heartbeat("n1"))
        await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
        )
        await api.settle()
        [event] = (await api.get("/api/v1/events"))["items"]
        assert (await api.get("/api/v1/actions"))["items"] == []
        assert api.supervisor.store.unhandled_events() == []
        # Seen beyond the log: on the event (API, dashboard) and in the metrics.
        assert event["policy_error"].startswith("RuntimeError: ")
        metrics = (await api.client.get("/metrics")).text
        assert 'supervisor_policy_errors_total{type="gpu_xid"} 1.0' in metrics


async def test_policy_from_a_file(make_settings: SettingsFactory, tmp_path: Any) -> None:
    path = tmp_path / "cordon_everything.py"
    path.write_text(
        "from supervisor.domain import EventType\n"
        "from supervisor.policy import Policy, actions, handles\n"
        "class CordonOnXid(Policy):\n"
        "    @handles(EventType.GPU_XID)\n"
        "    def xid(self, event, ctx):\n"
        "        return [actions.cordon(event.node, reason='any xid')]\n"
    )
    backend = RecordingBackend()
    async with running(make_settings(policy=f"{path}:CordonOnXid"), backend) as api:
        await api.beat(heartbeat("n1"))
        await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 31}, headers=OPERATOR
        )
        await api.settle()
        actions = (await api.get("/api/v1/actions"))["items"]
    assert [(a["type"], a["node"], a["reason"]) for a in actions] == [("cordon", "n1", "any xid")]
    assert [c.type for c in backend.calls] == [ActionType.CORDON]


async def test_dry_run_setting_uses_the_recording_backend(make_settings: SettingsFactory) -> None:
    settings = make_settings(dry_run=True)
    supervisor = Supervisor(settings)
    assert isinstance(supervisor.backend, DryRunBackend)


async def test_fault_schedule_injects_until_deleted(make_settings: SettingsFactory) -> None:
    async with running(
        make_settings(heartbeat_timeout_s=30, heartbeat_polling_period_s=5, gpu_report_cooldown_s=0)
    ) as api:
        await api.beat(heartbeat("n1"))
        response = await api.client.post(
            "/api/v1/faults", json={"schedule": "xid,0.05", "job": "j1"}, headers=OPERATOR
        )
        assert response.status_code == 201, response.text
        schedule = response.json()
        assert schedule["kind"] == "schedule" and schedule["params"] == {"schedule": "xid,0.05"}
        deadline = time.monotonic() + scaled(30)
        while len(await api.get("/api/v1/faults")) < 4:  # the schedule and 3 of its faults
            assert time.monotonic() < deadline, "the schedule did not inject 3 faults"
            await asyncio.sleep(0.02)
        ended = await api.client.delete(f"/api/v1/faults/{schedule['id']}", headers=OPERATOR)
        assert ended.json()["active"] is False
        # Nothing of the schedule's is written once its end is answered.
        count = len(await api.get("/api/v1/faults"))
        await asyncio.sleep(0.3)
        assert len(await api.get("/api/v1/faults")) == count  # stopped
        children = [f for f in await api.get("/api/v1/faults") if f["kind"] == "xid"]
        assert len(children) >= 3
        assert all(
            f["params"]["schedule"] == schedule["id"] and f["node"] == "n1" for f in children
        )
        await api.settle()
        xids = (await api.get("/api/v1/events", type="gpu_xid"))["items"]
        assert {e["fault_id"] for e in xids} <= {f["id"] for f in children} and xids


async def test_process_faults_need_a_process_backend(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    for body in (
        {"kind": "node_down", "node": "n1"},
        {"kind": "worker_crash", "node": "n1", "rank": 2},
        {"kind": "straggler", "node": "n1", "slowdown": 0.5},
        {"schedule": "random,60"},
    ):
        response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
        assert response.status_code == 422, (body, response.text)
        assert "backend" in response.text
    for body, needle in (
        ({"schedule": "random,0"}, "positive"),
        ({"schedule": "often"}, "schedule"),
        ({"kind": "xid", "schedule": "xid,5", "node": "n1", "code": 1}, "exactly one"),
        ({"kind": "straggler", "node": "n1", "slowdown": 0}, "slowdown"),
        ({"kind": "xid", "node": "n1", "code": 79, "slowdown": 1}, "slowdown applies"),
    ):
        response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
        assert response.status_code == 422 and needle in response.text, response.text
    assert await api.get("/api/v1/faults") == []


async def test_an_action_interrupted_by_a_crash_gets_one_more_attempt(
    make_settings: SettingsFactory,
) -> None:
    backend = RecordingBackend()
    async with running(make_settings(), backend) as api:
        await api.beat(heartbeat("n1"))
        store = api.supervisor.store
        request = ActionRequest(ActionType.EMERGENCY_CHECKPOINT, job="j1")
        action, _ = store.create_action(request, key="crashed", source="operator")
        interrupted = store.start_attempt(action.id)  # running when the process died
        done = await api.supervisor.controller.actuator.run(interrupted)
        assert done.status.value == "succeeded" and done.attempts == 2
        assert [c.key for c in backend.calls] == ["crashed"]
        # A checkpoint that failed is still not retried: late is useless.
        failed, _ = store.create_action(request, key="failed", source="operator")
        store.start_attempt(failed.id)
        finished = store.finish_action(failed.id, ActionStatus.FAILED, error="timed out")
        assert (await api.supervisor.controller.actuator.run(finished)).attempts == 1


async def test_a_body_over_the_limit_is_413_and_records_nothing(api: Api) -> None:
    await api.beat(heartbeat("n1"))
    huge = {"type": "cordon", "node": "n1", "reason": "x" * (2 << 20)}
    response = await api.client.post("/api/v1/actions", json=huge, headers=OPERATOR)
    assert response.status_code == 413, response.text
    assert "large" in response.json()["message"].lower()

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        yield b'{"type": "cordon", "node": "n1", "reason": "'
        for _ in range(3):
            yield b"y" * (1 << 20)
        yield b'"}'

    response = await api.client.post(
        "/api/v1/actions",
        content=chunks(),
        headers={**OPERATOR, "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text
    assert "large" in response.json()["message"].lower()
    assert (await api.get("/api/v1/actions"))["items"] == []


async def test_openapi_documents_the_error_answers(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    paths = schema["paths"]
    error = {"$ref": "#/components/schemas/ErrorOut"}
    assert set(schema["components"]["schemas"]["ErrorOut"]["required"]) == {"message", "detail"}

    def codes(path: str, method: str) -> dict[str, Any]:
        responses: dict[str, Any] = paths[path][method]["responses"]
        return responses

    for path, method in [("/api/v1/events/{event_id}", "get"), ("/api/v1/nodes/{name}", "get")]:
        assert {"401", "404", "503"} <= set(codes(path, method)), path
    post_action = codes("/api/v1/actions", "post")
    assert {"401", "404", "413", "422", "503"} <= set(post_action)
    assert post_action["413"]["content"]["application/json"]["schema"] == error
    assert {"401", "403", "404", "413"} <= set(codes("/api/v1/faults", "post"))
    assert "404" not in codes("/api/v1/nodes", "get")  # its filters name no record
    assert "401" not in codes("/healthz", "get")


async def test_work_cut_by_a_database_outage_is_carried_out_once_it_is_back(
    make_settings: SettingsFactory,
) -> None:
    """The database fails while the policy's decision is recorded, then again when the
    finished action is: the controller's lane tries again until it answers, and the
    action ends succeeded, carried out once more by the idempotent backend."""
    from sqlalchemy.exc import OperationalError

    backend = RecordingBackend()
    # Heartbeats stop meanwhile: a timeout well past the retries, so that the node is not
    # also lost (a second decision) on a slow machine.
    async with running(make_settings(heartbeat_timeout_s=30.0), backend) as api:
        store = api.supervisor.store
        failures = {"handle_event": 1, "finish_action": 2}

        def flaky(name: str) -> Any:
            real = getattr(store, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                if failures[name]:
                    failures[name] -= 1
                    raise OperationalError("COMMIT", {}, Exception("connection lost"))
                return real(*args, **kwargs)

            return call

        for name in failures:
            setattr(store, name, flaky(name))
        await api.beat(heartbeat("n1"))
        await api.beat(heartbeat("s1", job=None))
        fault = await api.client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
        )
        assert fault.status_code == 201, fault.text
        event_id = fault.json()["events"][0]

        async def done() -> list[dict[str, Any]]:
            actions = (await api.get("/api/v1/actions", event_id=event_id))["items"]
            finished = all(a["status"] == "succeeded" for a in actions)
            return actions if actions and finished else []

        deadline = asyncio.get_running_loop().time() + scaled(20)
        while not (actions := await done()):
            assert asyncio.get_running_loop().time() < deadline, "never carried out"
            await asyncio.sleep(0.1)
        assert failures == {"handle_event": 0, "finish_action": 0}
        assert [a["type"] for a in actions[::-1]] == ["emergency_checkpoint", "hot_swap"]
        # Decided once (two actions, not four); the checkpoint whose end could not be
        # recorded was attempted again, twice, with the same key (the backend carried it
        # out once).
        assert len(actions) == 2
        checkpoint = actions[-1]
        assert checkpoint["type"] == "emergency_checkpoint" and checkpoint["attempts"] == 3
        assert [c.type for c in backend.calls] == [
            ActionType.EMERGENCY_CHECKPOINT,
            ActionType.HOT_SWAP,
        ]


# --- what the property-based run (tests/test_api_schema.py) found -------------------------


async def test_a_heartbeat_may_write_an_integer_as_a_float(api: Api) -> None:
    """JSON Schema's (and pydantic's) integers include 1.0; the heartbeat's decoder did
    not, and refused a heartbeat its documented schema allows."""
    body = heartbeat("n1")
    body["workers"][0].update(step=12.0, pid=101.0)
    assert (await api.beat(body)).status_code in (202, 204)
    worker = (await api.get("/api/v1/nodes/n1"))["workers"][0]
    assert worker["step"] == 12 and isinstance(worker["step"], int)
    body["workers"][0]["step"] = 12.5
    r = await api.beat(body)
    assert r.status_code == 422 and "workers.0.step" in r.json()["message"]


async def test_filters_naming_an_unknown_record_get_a_documented_404(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    for path, params in [
        ("/api/v1/events", {"node": "nope"}),
        ("/api/v1/actions", {"job": "nope"}),
        ("/api/v1/checkpoints", {"job": "nope"}),
        ("/api/v1/notifications", {"job": "nope"}),
    ]:
        r = await api.client.get(path, params=params, headers=OPERATOR)
        assert r.status_code == 404 and "'nope' not found" in r.json()["message"], path
        assert "404" in schema["paths"][path]["get"]["responses"], path


async def test_every_422_is_documented_as_the_error_format(api: Api) -> None:
    """The routes' own 422s (a bad cursor, since >= until) carry `detail` as a string,
    which the document's 422 (FastAPI's list of validation errors) did not allow."""
    r = await api.client.get("/api/v1/events", params={"cursor": "x"}, headers=OPERATOR)
    assert r.status_code == 422 and r.json()["message"].startswith("cursor: ")
    assert isinstance(r.json()["detail"], str)
    schema = (await api.client.get("/openapi.json")).json()
    error = {"$ref": "#/components/schemas/ErrorOut"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if "422" in operation["responses"] and path != "/api/v1/heartbeats":
                content = operation["responses"]["422"]["content"]["application/json"]
                assert content["schema"] == error, (method, path)


async def test_a_body_that_is_not_utf8_gets_a_documented_400(api: Api) -> None:
    r = await api.client.post(
        "/api/v1/actions",
        content=b"\xff\xfe{",
        headers={**OPERATOR, "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["message"]
    schema = (await api.client.get("/openapi.json")).json()
    for path in ("/api/v1/actions", "/api/v1/faults", "/api/v1/checkpoints"):
        assert "400" in schema["paths"][path]["post"]["responses"], path


async def test_documented_integer_bounds_are_exact(api: Api) -> None:
    """FastAPI's OpenAPI model turned 2**63 - 1 into 2**63 (a float): a client trusting
    it sent an id the API refuses."""
    schema = (await api.client.get("/openapi.json")).json()
    (event_id,) = schema["paths"]["/api/v1/events/{event_id}"]["get"]["parameters"]
    assert event_id["schema"]["maximum"] == 2**63 - 1
    assert isinstance(event_id["schema"]["minimum"], int)
    step = schema["components"]["schemas"]["CheckpointReportIn"]["properties"]["step"]
    assert step["maximum"] == 2**62
    largest = await api.client.get(f"/api/v1/events/{2**63 - 1}", headers=OPERATOR)
    assert largest.status_code == 404
    beyond = await api.client.get(f"/api/v1/events/{2**63}", headers=OPERATOR)
    assert beyond.status_code == 422 and "event_id" in beyond.json()["message"]


@pytest.mark.parametrize("time", ["3", "1714564800", "tomorrow"])
async def test_times_are_dates_not_seconds(api: Api, time: str) -> None:
    """pydantic took "3" as 3 seconds after 1970, where the schema says `date-time`."""
    report = {
        "id": "r1",
        "node": "n1",
        "job": "j1",
        "rank": 0,
        "event": "saved",
        "step": 10,
        "duration_s": 1.0,
        "tier": "ram",
        "time": time,
    }
    r = await api.client.post("/api/v1/checkpoints", json={"reports": [report]}, headers=AGENT)
    assert r.status_code == 422 and "reports.0.time" in r.json()["message"], r.text
    r = await api.client.get("/api/v1/events", params={"since": time}, headers=OPERATOR)
    assert r.status_code == 422 and "since" in r.json()["message"], r.text
    local = datetime.now(UTC).replace(microsecond=0).astimezone(timezone(timedelta(hours=2)))
    report["time"] = local.isoformat()
    r = await api.client.post("/api/v1/checkpoints", json={"reports": [report]}, headers=AGENT)
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text
    stored = (await api.get("/api/v1/checkpoints"))[0]["time"]
    assert stored == local.astimezone(UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    ("field", "value"), [("total_s", False), ("bytes", True), ("step", "3"), ("duration_s", "1")]
)
async def test_checkpoint_numbers_are_json_numbers(api: Api, field: str, value: Any) -> None:
    """pydantic's lax mode stored `"total_s": false` as 0.0, where the schema says number."""
    report = {
        "id": "r1",
        "node": "n1",
        "rank": 0.0,  # an integer, as JSON Schema has it
        "event": "saved",
        "step": 10,
        "duration_s": 1,
        "tier": "ram",
        "time": datetime.now(UTC).isoformat(),
    }
    r = await api.client.post(
        "/api/v1/checkpoints", json={"reports": [{**report, field: value}]}, headers=AGENT
    )
    assert r.status_code == 422 and f"reports.0.{field}" in r.json()["message"], r.text
    r = await api.client.post("/api/v1/checkpoints", json={"reports": [report]}, headers=AGENT)
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text


async def test_a_route_filter_with_a_nul_gets_a_422(
    database_url: str, make_settings: SettingsFactory
) -> None:
    """PostgreSQL refuses a NUL in a query's text: the filter reached it, and got a 500."""
    async with running(make_settings(database_url=database_url)) as api:
        r = await api.client.get(
            "/api/v1/notifications", params={"route": "a\x00b"}, headers=OPERATOR
        )
        assert r.status_code == 422 and r.json()["message"].startswith("query.route: ")
        page = await api.get("/api/v1/notifications", route="chat-ops")
        assert page["items"] == []
