"""Notifications as an on-call person gets them: a supervisor with routes, real local HTTP
receivers standing in for a webhook, Slack and Alertmanager, faults and heartbeats over
the API, and what the receivers got and the API shows."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import CONFIG_FILE_ENV, ConfigError, load_settings
from supervisor.config_parts.notification_routes import Route
from supervisor.domain import ActionRecord, ActionStatus, ActionType, Event, EventType
from supervisor.notices import action_notice, event_notice
from supervisor.notifications.routing import routes_for
from tests.conftest import OPERATOR_TOKEN, SettingsFactory
from tests.test_api import OPERATOR, Api, heartbeat, running


class Receiver:
    """An HTTP endpoint on a free local port that records each POST and answers with the
    statuses queued in `answers` (then `default`); with `hang`, it holds each request
    until released."""

    def __init__(self, *, default: int = 200, hang: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: deque[int] = deque()
        self.default = default
        self.hang = hang
        self.echo = False
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = {
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": json.loads(body),
                }
                receiver.requests.append(request)
                if receiver.hang:
                    receiver.release.wait(30)
                status = receiver.answers.popleft() if receiver.answers else receiver.default
                # A careless receiver may echo what it was sent, credentials included.
                text = json.dumps(request) if receiver.echo else "{}"
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def bodies(self, path: str | None = None) -> list[Any]:
        return [r["body"] for r in self.requests if path is None or r["path"] == path]

    @contextmanager
    def serving(self) -> Iterator[Receiver]:
        self._thread.start()
        try:
            yield self
        finally:
            self.release.set()
            self.server.shutdown()
            self.server.server_close()


async def until(check: Callable[[], Awaitable[Any]], within: float = 15.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {within} s (last: {value!r})")
        await asyncio.sleep(0.05)


async def notifications(api: Api, **filters: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await api.get("/api/v1/notifications", **filters))["items"]
    return items


async def finished(api: Api, count: int, **filters: Any) -> list[dict[str, Any]]:
    """The notifications matching `filters` once `count` of them are delivered or failed."""

    async def check() -> list[dict[str, Any]] | None:
        items = await notifications(api, **filters)
        done = [n for n in items if n["status"] != "pending"]
        return items if len(done) >= count else None

    result: list[dict[str, Any]] = await until(check)
    return result


def route(name: str, url: Any, **fields: Any) -> dict[str, Any]:
    sink = {"type": fields.pop("type", "webhook"), "url": url, **fields.pop("sink", {})}
    return {"name": name, "sink": sink, **fields}


async def xid_with_a_spare(api: Api) -> None:
    """n1 and n2 run job j1, s1 is a spare; XID 79 on n1: checkpoint, then hot-swap."""
    for name, job in (("n1", "j1"), ("n2", "j1"), ("s1", None)):
        assert (await api.beat(heartbeat(name, job=job))).status_code in (202, 204)
    response = await api.client.post(
        "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
    )
    assert response.status_code == 201, response.text
    await api.settle()


SLOW = {"heartbeat_timeout_s": 30, "heartbeat_polling_period_s": 5}


# --- each sink, end to end ---------------------------------------------------------------------


async def test_a_hot_swap_reaches_the_webhook_slack_and_alertmanager(
    make_settings: SettingsFactory, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_TOKEN", "Bearer hook-token-1")
    hook, slack, alertmanager = Receiver(), Receiver(), Receiver()
    routes = [
        route(
            "everything",
            f"{hook.url}/hook",
            events=["*"],
            actions=["*"],
            sink={"headers": {"Authorization": {"env": "HOOK_TOKEN"}}},
        ),
        route("swaps", f"{slack.url}/services/T0/B0/x", type="slack", actions=["hot_swap"]),
        route(
            "pager",
            alertmanager.url,
            type="alertmanager",
            events=["gpu_xid"],
            sink={"alert_duration_s": 600},
        ),
    ]
    settings = make_settings(
        database_url=database_url,
        notification_routes=routes,
        public_url="https://supervisor.example/",
        **SLOW,
    )
    with hook.serving(), slack.serving(), alertmanager.serving():
        async with running(settings) as api:
            await xid_with_a_spare(api)
            await finished(api, 4, route="everything")
            await finished(api, 1, route="swaps")
            await finished(api, 1, route="pager")
            delivered = await notifications(api)
            metrics = (await api.client.get("/metrics")).text
            event = (await api.get("/api/v1/events", type="gpu_xid"))["items"][0]

    # The webhook: the spare's and the XID's events, then the two actions, in order.
    bodies = hook.bodies("/hook")
    assert [(b["kind"], b["type"], b["outcome"]) for b in bodies] == [
        ("event", "spare_available", None),
        ("event", "gpu_xid", None),
        ("action", "emergency_checkpoint", "succeeded"),
        ("action", "hot_swap", "succeeded"),
    ]
    xid = bodies[1]
    assert xid["id"] == event["id"] and xid["node"] == "n1" and xid["job"] == "j1"
    assert xid["source"] == "resiliency-supervisor" and xid["severity"] == "warning"
    assert xid["details"]["code"] == 79
    assert datetime.fromisoformat(xid["time"]) == datetime.fromisoformat(event["time"])
    assert xid["url"] == "https://supervisor.example/#type=gpu_xid&node=n1&job=j1"
    assert xid["api_url"] == f"https://supervisor.example/api/v1/events/{event['id']}"
    swap = bodies[3]
    assert swap["event_id"] == event["id"] and swap["details"]["params"] == {"spare": "s1"}
    assert {r["headers"]["Authorization"] for r in hook.requests} == {"Bearer hook-token-1"}
    ids = {r["headers"]["X-Supervisor-Delivery"] for r in hook.requests}
    assert ids == {str(n["id"]) for n in delivered if n["route"] == "everything"}

    # Slack: only the hot-swap, readable as text, with blocks linking to the dashboard.
    (message,) = slack.bodies("/services/T0/B0/x")
    assert message["text"] == ":white_check_mark: hot swap succeeded: node n1, job j1"
    section, context = message["blocks"]
    assert "hot swap succeeded" in section["text"]["text"]
    assert (
        "<https://supervisor.example/#action_type=hot_swap&node=n1&job=j1|"
        in (context["elements"][0]["text"])
    )

    # Alertmanager: one alert at its v2 API, labelled for routing, ending by itself.
    ((alert,),) = alertmanager.bodies("/api/v2/alerts")
    assert alert["labels"] == {
        "alertname": "SupervisorGpuXid",
        "severity": "warning",
        "source": "resiliency-supervisor",
        "node": "n1",
        "job": "j1",
    }
    starts, ends = (datetime.fromisoformat(alert[k]) for k in ("startsAt", "endsAt"))
    assert ends - starts == timedelta(seconds=600)
    assert alert["generatorURL"].startswith("https://supervisor.example/#type=gpu_xid")
    assert alert["annotations"]["summary"] == "gpu xid: node n1, job j1"

    assert all(n["status"] == "delivered" and n["attempts"] == 1 for n in delivered)
    assert 'supervisor_notifications_total{outcome="delivered",route="swaps",sink="slack"} 1.0' in (
        metrics
    )


async def test_alertmanager_alert_is_resolved_when_the_node_recovers(
    make_settings: SettingsFactory,
) -> None:
    alertmanager = Receiver()
    pager = route("pager", alertmanager.url, type="alertmanager", events=["host_heartbeat_lost"])
    settings = make_settings(
        notification_routes=[pager], heartbeat_timeout_s=0.3, heartbeat_polling_period_s=0.05
    )
    with alertmanager.serving():
        async with running(settings) as api:
            await api.beat(heartbeat("n1"))
            fault = (
                await api.client.post(
                    "/api/v1/faults",
                    json={"kind": "heartbeat_loss", "node": "n1"},
                    headers=OPERATOR,
                )
            ).json()
            await finished(api, 1, route="pager")
            await api.client.delete(f"/api/v1/faults/{fault['id']}", headers=OPERATOR)
            await api.beat(heartbeat("n1"))
            await finished(api, 2, route="pager")
            recovered = (await api.get("/api/v1/events", type="node_recovered"))["items"][0]

    (firing,), resolutions = alertmanager.bodies()[:2]
    assert firing["labels"]["alertname"] == "SupervisorHostHeartbeatLost"
    assert datetime.fromisoformat(firing["endsAt"]) > datetime.now(UTC)
    # node_recovered is not asked for itself: only the resolutions of what it clears.
    resolved = {a["labels"]["alertname"]: a for a in resolutions}
    assert set(resolved) == {
        "SupervisorHostHeartbeatLost",
        "SupervisorNodeFlapping",
        "SupervisorNodeNotReady",
    }
    ending = resolved["SupervisorHostHeartbeatLost"]
    assert ending["labels"] == firing["labels"]  # the same alert, to Alertmanager
    assert "startsAt" not in ending
    assert datetime.fromisoformat(ending["endsAt"]) == datetime.fromisoformat(recovered["time"])


# --- retries, failures, restarts ---------------------------------------------------------------


async def test_a_receiver_failing_at_first_gets_retries_until_delivered(
    make_settings: SettingsFactory, database_url: str
) -> None:
    hook = Receiver()
    hook.answers.extend([503, 429])
    settings = make_settings(
        database_url=database_url,
        notification_routes=[route("hook", hook.url, events=["spare_available"])],
        notification_retry_backoff_s=0.01,
        **SLOW,
    )
    with hook.serving():
        async with running(settings) as api:
            await api.beat(heartbeat("s1", job=None))
            (delivery,) = await finished(api, 1)
    assert delivery["status"] == "delivered" and delivery["attempts"] == 3
    assert delivery["last_error"] is None and delivery["finished_at"] is not None
    assert len(hook.requests) == 3
    assert len({r["headers"]["X-Supervisor-Delivery"] for r in hook.requests}) == 1


async def test_a_receiver_always_down_ends_failed_and_visible(
    make_settings: SettingsFactory, database_url: str
) -> None:
    down, refusing = Receiver(default=502), Receiver(default=400)
    settings = make_settings(
        database_url=database_url,
        notification_routes=[
            route("down", down.url, events=["spare_available"]),
            route("refusing", refusing.url, events=["spare_available"]),
        ],
        notification_max_attempts=3,
        notification_retry_backoff_s=0.01,
        **SLOW,
    )
    with down.serving(), refusing.serving():
        async with running(settings) as api:
            await api.beat(heartbeat("s1", job=None))
            await finished(api, 2)
            (failed,) = await notifications(api, status="failed", route="down")
            (refused,) = await notifications(api, status="failed", route="refusing")
            assert await notifications(api, status="delivered") == []
            one = await api.get(f"/api/v1/notifications/{failed['id']}")
            metrics = (await api.client.get("/metrics")).text
            missing = await api.client.get("/api/v1/notifications/999999", headers=OPERATOR)
    assert failed["attempts"] == 3 and failed["last_error"] == "HTTP 502: {}"
    assert one == failed and one["kind"] == "event" and one["type"] == "spare_available"
    # A 400 will not change on a retry: given up at once.
    assert refused["attempts"] == 1 and refused["last_error"] == "HTTP 400: {}"
    assert len(down.requests) == 3 and len(refusing.requests) == 1
    assert 'supervisor_notifications_total{outcome="failed",route="down",sink="webhook"} 1.0' in (
        metrics
    )
    assert missing.status_code == 404


async def test_heartbeats_are_acknowledged_while_the_receiver_hangs(
    make_settings: SettingsFactory, database_url: str
) -> None:
    hanging = Receiver(hang=True)
    settings = make_settings(
        database_url=database_url,
        notification_routes=[route("hook", hanging.url, events=["*"])],
        notification_timeout_s=60,
        **SLOW,
    )
    with hanging.serving():
        async with running(settings) as api:
            # Each beat raises an event (a spare appears, a job changes) to be notified.
            for i in range(10):
                body = heartbeat(f"n{i}", job=None if i % 2 else "j1")
                response = await asyncio.wait_for(api.beat(body), timeout=5)
                assert response.status_code in (202, 204)  # 202: it raised events

            async def received() -> bool:
                return bool(hanging.requests)

            await until(received)
            for i in range(10):
                response = await asyncio.wait_for(api.beat(heartbeat(f"n{i}")), timeout=5)
                assert response.status_code in (202, 204)  # 202: it raised events
            pending = await notifications(api, status="pending")
            assert pending and all(n["attempts"] == 0 for n in pending)
            assert len(hanging.requests) == 1  # one route, one at a time, oldest first
            hanging.release.set()
            hanging.hang = False
            # Every one that was waiting is delivered (events the sensor raises later
            # from those beats may add more, delivered too).
            waiting = {n["item_id"] for n in pending}

            async def all_delivered() -> bool:
                delivered = await notifications(api, status="delivered")
                return waiting <= {n["item_id"] for n in delivered}

            await until(all_delivered, within=60)


async def test_a_pending_delivery_is_resumed_after_a_restart(
    make_settings: SettingsFactory, database_url: str
) -> None:
    hook = Receiver(default=503)
    hook_route = route("hook", hook.url, events=["spare_available"])
    gone_route = route("gone", hook.url, events=["spare_available"])
    first = make_settings(
        database_url=database_url,
        notification_routes=[hook_route, gone_route],
        notification_retry_backoff_s=60,  # still waiting for its second attempt at the stop
        **SLOW,
    )
    with hook.serving():
        async with running(first) as api:
            await api.beat(heartbeat("s1", job=None))

            async def tried_once() -> bool:
                items = await notifications(api, status="pending")
                return len([n for n in items if n["attempts"] == 1]) == 2

            await until(tried_once)
        hook.default = 200
        second = first.model_copy(update={"notification_routes": first.notification_routes[:1]})
        async with running(second) as api:
            (delivered,) = await finished(api, 1, route="hook")
            (gone,) = await notifications(api, route="gone")
    assert delivered["status"] == "delivered" and delivered["attempts"] == 2
    assert hook.requests[-1]["body"]["type"] == "spare_available"
    assert hook.requests[-1]["headers"]["X-Supervisor-Delivery"] == str(delivered["id"])
    assert gone["status"] == "failed" and gone["last_error"] == "route no longer configured"


async def test_a_secret_never_appears_in_logs_or_api_output(
    make_settings: SettingsFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url_secret, token = "T0SECRET/B0SECRET/xoxsecretpath", "Bearer header-secret-42"
    hook = Receiver(default=500)
    hook.echo = True  # its errors quote the URL and the Authorization header
    (tmp_path / "slack-url").write_text(f"{hook.url}/services/{url_secret}\n")
    monkeypatch.setenv("SLACK_AUTH", token)
    slack = route(
        "slack",
        {"file": str(tmp_path / "slack-url")},
        type="slack",
        events=["spare_available"],
        sink={"headers": {"Authorization": {"env": "SLACK_AUTH"}}},
    )
    settings = make_settings(
        notification_routes=[slack],
        notification_max_attempts=2,
        notification_retry_backoff_s=0.01,
        **SLOW,
    )
    caplog.set_level(logging.DEBUG)
    with hook.serving():
        async with running(settings) as api:
            await api.beat(heartbeat("s1", job=None))
            (failed,) = await finished(api, 1)
            outputs = [
                (await api.client.get(path, headers=OPERATOR)).text
                for path in (
                    "/api/v1/notifications",
                    f"/api/v1/notifications/{failed['id']}",
                    "/metrics",
                )
            ]
    # The receiver did get them, and quoted them back.
    assert hook.requests[0]["path"] == f"/services/{url_secret}"
    assert hook.requests[0]["headers"]["Authorization"] == token
    assert failed["status"] == "failed" and "***" in failed["last_error"]
    assert any("HTTP Request: POST" in r.getMessage() for r in caplog.records)  # httpx logs
    seen = "\n".join([caplog.text, *outputs, repr(settings), str(settings.model_dump())])
    for secret in (url_secret, "xoxsecretpath", token, "header-secret-42"):
        assert secret not in seen
    assert OPERATOR_TOKEN not in seen


# --- routing -----------------------------------------------------------------------------------


def _event(type_: EventType, job: str | None = "j1") -> Event:
    return Event(type_, datetime.now(UTC), node="n1", job=job, id=1)


def _action(type_: ActionType, status: ActionStatus, job: str = "j1") -> ActionRecord:
    now = datetime.now(UTC)
    return ActionRecord(7, type_, status, "k", "policy", now, job=job, finished_at=now)


def _routes(*routes: dict[str, Any]) -> list[Route]:
    return [Route.model_validate(r) for r in routes]


def test_routes_match_on_event_types_action_types_outcomes_and_jobs() -> None:
    url = "http://hooks.example"
    routes = _routes(
        route("all-events", url, events=["*"]),
        route("failed-actions", url, actions=["*"], outcomes=["failed"]),
        route("swaps-of-llm", url, actions=["hot_swap"], outcomes=["succeeded"], jobs=["llm"]),
        route("hangs", url, events=["hang"]),
        route("pager", url, type="alertmanager", events=["host_heartbeat_lost"]),
    )

    def names(notice: Any) -> list[str]:
        assert notice is not None
        return [r.name for r in routes_for(notice, routes)]

    assert names(event_notice(_event(EventType.HANG))) == ["all-events", "hangs"]
    assert names(event_notice(_event(EventType.GPU_XID, job=None))) == ["all-events"]
    failed_swap = action_notice(_action(ActionType.HOT_SWAP, ActionStatus.FAILED, job="llm"))
    assert names(failed_swap) == ["failed-actions"]
    swap = action_notice(_action(ActionType.HOT_SWAP, ActionStatus.SUCCEEDED, job="llm"))
    assert names(swap) == ["swaps-of-llm"]
    other_job = action_notice(_action(ActionType.HOT_SWAP, ActionStatus.SUCCEEDED, job="x"))
    assert names(other_job) == []
    # Only finished actions are notified.
    assert action_notice(_action(ActionType.HOT_SWAP, ActionStatus.RUNNING)) is None
    # Alertmanager also hears what resolves its alerts; other sinks only what they list.
    assert names(event_notice(_event(EventType.NODE_RECOVERED))) == ["all-events", "pager"]
    assert names(event_notice(_event(EventType.STRAGGLER_RECOVERED))) == ["all-events"]


async def test_routing_through_the_api_sends_only_what_each_route_asks_for(
    make_settings: SettingsFactory,
) -> None:
    hook = Receiver()
    routes = [
        route("failures", f"{hook.url}/failures", actions=["*"], outcomes=["failed"]),
        route("checkpoints", f"{hook.url}/checkpoints", actions=["emergency_checkpoint"]),
        route("other-job", f"{hook.url}/other", events=["*"], actions=["*"], jobs=["j2"]),
        route("xids", f"{hook.url}/xids", events=["gpu_xid"], jobs=["j1"]),
    ]
    with hook.serving():
        async with running(make_settings(notification_routes=routes, **SLOW)) as api:
            await xid_with_a_spare(api)
            await finished(api, 2)
            await asyncio.sleep(0.2)  # anything else routed would be recorded by now
            recorded = await notifications(api)
    assert sorted((n["route"], n["type"]) for n in recorded) == [
        ("checkpoints", "emergency_checkpoint"),
        ("xids", "gpu_xid"),
    ]
    assert sorted(r["path"] for r in hook.requests) == ["/checkpoints", "/xids"]


# --- settings ----------------------------------------------------------------------------------


def test_route_settings_from_a_yaml_file_with_secrets_from_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "url").write_text("https://hooks.slack.com/services/T/B/secret\n")
    monkeypatch.setenv("AM_TOKEN", "Bearer am")
    config = tmp_path / "settings.yaml"
    config.write_text(
        f"""
notification_routes:
  - name: oncall
    sink: {{type: slack, url: {{file: {tmp_path / "url"}}}}}
    events: [host_heartbeat_lost, hang]
    actions: ["*"]
    outcomes: [failed]
  - name: pager
    sink:
      type: alertmanager
      url: http://alertmanager:9093
      headers: {{Authorization: {{env: AM_TOKEN}}}}
    events: ["*"]
    jobs: [llm]
"""
    )
    for name in [k for k in os.environ if k.startswith("SUPERVISOR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))  # restored after the test
    settings = load_settings(config)
    oncall, pager = settings.notification_routes
    assert oncall.sink.url.get_secret_value() == "https://hooks.slack.com/services/T/B/secret"
    assert oncall.events == ["host_heartbeat_lost", "hang"] and oncall.outcomes == ["failed"]
    assert pager.sink.headers["Authorization"].get_secret_value() == "Bearer am"
    assert pager.outcomes == ["succeeded", "failed"] and pager.jobs == ["llm"]

    monkeypatch.delenv("AM_TOKEN")
    with pytest.raises(ConfigError, match="environment variable AM_TOKEN is not set") as missing:
        load_settings(config)
    assert "hooks.slack.com" not in str(missing.value)
    config.write_text(
        "notification_routes:\n"
        "  - {name: a, sink: {type: webhook, url: 'https://x/secret-1'}, events: [nope]}\n"
        "  - {name: a, sink: {type: webhook, url: 'https://x/secret-2'}}\n"
    )
    with pytest.raises(ConfigError) as bad:
        load_settings(config)
    assert "notification_routes.0.events.0" in str(bad.value)
    assert "secret-" not in str(bad.value)
    config.write_text(
        "notification_routes:\n"
        "  - {name: a, sink: {type: webhook, url: 'https://x/secret-1'}}\n"
        "  - {name: a, sink: {type: webhook, url: 'https://x/secret-2'}}\n"
    )
    with pytest.raises(ConfigError, match=r"route names must be unique \(a repeated\)") as dup:
        load_settings(config)
    assert "secret-" not in str(dup.value)
